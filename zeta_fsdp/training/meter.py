"""A live view of a training job: ``StepMeter`` reports tokens/s, MFU, step time, peak memory and
the slowest rank every ``every`` steps, as one ``key=value`` line a log scraper can read.

Between reports a step costs two clock reads and an addition: no device synchronization and no
collective. At a report step the meter synchronizes the device once and runs one tiny all-gather
(arrival time, tokens, peak memory per rank): the rank that reaches it last is the slowest rank
(``benchmarks/results/meter.md``: the overhead at ``every=10``).
"""

from __future__ import annotations

import re
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["PEAK_TFLOPS", "StepMeter", "StepReport", "batch_tokens", "peak_flops_of", "training_flops_per_token"]

# Dense (no structured sparsity) peak TFLOP/s per GPU from NVIDIA's datasheets; "fp32" is plain FP32
# (no TF32 tensor cores). Matched in order against torch.cuda.get_device_name(): specific names first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM5 ("NVIDIA H100 80GB HBM3")
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # no bf16
}


def peak_flops_of(device_name: str, dtype: str = "bf16") -> Optional[float]:
    """Peak dense FLOP/s of a GPU named ``device_name`` in ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``),
    from ``PEAK_TFLOPS``; ``None`` when unknown (a CPU, a card not in the table).

    Example:
        >>> peak_flops_of("NVIDIA H100 80GB HBM3"), peak_flops_of("NVIDIA L40S", "fp32"), peak_flops_of("cpu")
        (989400000000000.0, 91600000000000.0, None)
    """
    for name, peaks in PEAK_TFLOPS.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])", device_name):
            tflops = peaks.get(dtype)
            return None if tflops is None else tflops * 1e12
    return None


def training_flops_per_token(model: nn.Module, *, seq_len: int = 0, n_layers: int = 0, dim: int = 0) -> float:
    """FLOPs to train on one token: ``6 * parameters`` (forward 2, backward 4, per multiply-add), plus
    the attention scores ``12 * n_layers * dim * seq_len`` when given (PaLM's MFU, appendix B).
    Counts every parameter once (a sharded model's full size; tied weights once).

    Example:
        >>> training_flops_per_token(torch.nn.Linear(10, 10, bias=False))
        600.0
        >>> training_flops_per_token(torch.nn.Linear(10, 10, bias=False), seq_len=8, n_layers=2, dim=4)
        1368.0
    """
    numel = sum(p.numel() for p in model.parameters())
    return float(6 * numel + 12 * n_layers * dim * seq_len)


@dataclass
class StepReport:
    """One report of ``StepMeter``: means over the last ``steps`` steps, memory peaks (worst rank).

    Example:
        >>> StepReport(10, 10, 212.4, 154310.0, 0.41, 30512.0, 32000.0, 3, 41.5).line()
        'zeta_fsdp step=10 step_ms=212.4 tokens_per_s=154310 mfu=0.410 peak_mem_mib=30512 peak_reserved_mib=32000 slowest_rank=3 slowest_lag_ms=41.5'
    """

    step: int
    steps: int
    step_ms: float
    tokens_per_s: float  # all ranks together
    mfu: Optional[float]  # model FLOP/s utilization of one device, 0..1; None when the peak is unknown
    peak_mem_mib: float  # CUDA: peak active bytes; CPU: peak RSS
    peak_reserved_mib: Optional[float]  # CUDA allocator's peak reserved bytes; None on CPU
    slowest_rank: int
    slowest_lag_ms: float  # how much later than the median rank it reached the report

    def line(self) -> str:
        """The report as one ``key=value`` line (unknown values left out).

        Example:
            >>> StepReport(5, 5, 80.0, 1200.0, None, 900.0, None, 0, 0.2).line()
            'zeta_fsdp step=5 step_ms=80.0 tokens_per_s=1200 peak_mem_mib=900 slowest_rank=0 slowest_lag_ms=0.2'
        """
        fields = {"step": self.step, "step_ms": f"{self.step_ms:.1f}", "tokens_per_s": f"{self.tokens_per_s:.0f}"}
        if self.mfu is not None:
            fields["mfu"] = f"{self.mfu:.3f}"
        fields["peak_mem_mib"] = f"{self.peak_mem_mib:.0f}"
        if self.peak_reserved_mib is not None:
            fields["peak_reserved_mib"] = f"{self.peak_reserved_mib:.0f}"
        fields |= {"slowest_rank": self.slowest_rank, "slowest_lag_ms": f"{self.slowest_lag_ms:.1f}"}
        return "zeta_fsdp " + " ".join(f"{k}={v}" for k, v in fields.items())


def _peak_memory(device: torch.device) -> tuple[float, Optional[float]]:
    """(peak active bytes, peak reserved bytes) on CUDA; (peak RSS, None) on CPU."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return float(stats.get("active_bytes.all.peak", 0)), float(stats.get("reserved_bytes.all.peak", 0))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return float(rss if sys.platform == "darwin" else rss * 1024), None


def batch_tokens(batch: Any) -> int:
    """Tokens in one batch, for the meter: ``input_ids``' elements (a dict batch), else the first tensor's
    elements when it holds token ids (integers), else its first dimension (samples).

    Example:
        >>> batch_tokens({"input_ids": torch.zeros(2, 5, dtype=torch.long)}), batch_tokens((torch.zeros(3, 4),))
        (10, 3)
    """
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [batch]
    first = next((v for v in values if isinstance(v, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return 0
    return first.numel() if not (first.is_floating_point() or first.is_complex()) else first.shape[0]


class StepMeter:
    """Call ``meter.step(tokens)`` at the top of every training step, once the batch is ready; every
    ``every`` steps it reports the steps before it (on rank 0: ``log(line)``) and returns a ``StepReport``.

    Every rank must call ``step()`` equally often: a report step runs one tiny all-gather. It
    synchronizes the device there (only there), so step times are those of finished work. The
    slowest rank is the one that reached this all-gather last: the first collective of the step,
    after the previous step's optimizer update and this step's data loading. ``finish()`` reports
    the steps since the last report (collective too).

    ``flops_per_token``: training FLOPs per token (``training_flops_per_token(model)``; else no
    MFU). ``peak_flops``: the device's peak FLOP/s, default from ``PEAK_TFLOPS`` for ``dtype``.

    Example:
        meter = StepMeter(every=10, flops_per_token=training_flops_per_token(model), dtype="bf16")
        for x, y in loader:
            meter.step(tokens=x.numel())
            loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
        meter.finish()
        # rank 0 logs: zeta_fsdp step=10 step_ms=212.4 tokens_per_s=154310 mfu=0.412 peak_mem_mib=30512 ...
    """

    def __init__(
        self,
        *,
        every: int = 10,
        flops_per_token: Optional[float] = None,
        peak_flops: Optional[float] = None,
        dtype: str = "bf16",
        device: Union[str, torch.device, None] = None,
        group: Optional[dist.ProcessGroup] = None,
        log: Optional[Callable[[str], None]] = print,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"StepMeter(every={every!r}) is not accepted. Accepted: an int >= 1 (steps per report).")
        self.every, self.flops_per_token, self.group, self.log = every, flops_per_token, group, log
        self.device = torch.device(device) if device is not None else _default_device()
        if peak_flops is None and self.device.type == "cuda":
            peak_flops = peak_flops_of(torch.cuda.get_device_name(self.device), dtype)
        self.peak_flops = peak_flops
        self.steps, self.last = 0, None  # steps begun; the last StepReport
        self._window_start: Optional[float] = None
        self._window_steps = self._window_tokens = self._pending_tokens = 0

    def step(self, tokens: int = 0) -> Optional[StepReport]:
        """Mark the start of a step that trains on ``tokens`` tokens (this rank's); a report every ``every`` steps."""
        report = None
        if self._window_start is None:  # the first step: the clock starts
            self._window_start = self._synchronized_time()
        else:  # the previous step is done
            self._window_steps += 1
            self._window_tokens += self._pending_tokens
            if self._window_steps >= self.every:
                report = self._report()
        self._pending_tokens, self.steps = tokens, self.steps + 1
        return report

    def add_tokens(self, tokens: int) -> None:
        """Count ``tokens`` more into the step begun by the last ``step()`` (its micro-batches, one at a time)."""
        self._pending_tokens += int(tokens)

    def finish(self) -> Optional[StepReport]:
        """Report the steps since the last report, the current one included (every rank calls it;
        ``None`` when no step ran). The next ``step()`` starts a new window."""
        if self._window_start is None:
            return None
        self._window_steps += 1
        self._window_tokens += self._pending_tokens
        report = self._report()
        self._window_start, self._pending_tokens = None, 0
        return report

    def _synchronized_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _report(self) -> StepReport:
        """Close the window: one all-gather of (arrival time, tokens, memory, seconds) over the ranks, then log."""
        now = self._synchronized_time()
        steps = self._window_steps
        mem, reserved = _peak_memory(self.device)
        mine = [time.time(), float(self._window_tokens), mem, reserved or 0.0, now - self._window_start]
        rows = _gather_rows(mine, self.device, self.group)
        seconds = max(r[4] for r in rows)  # the slowest rank's window: the same numbers on every rank
        arrivals = sorted(r[0] for r in rows)
        late = max(range(len(rows)), key=lambda r: rows[r][0])
        median = arrivals[(len(arrivals) - 1) // 2]
        tokens = sum(r[1] for r in rows)
        mfu = None
        if self.flops_per_token and self.peak_flops:
            mfu = tokens * self.flops_per_token / seconds / len(rows) / self.peak_flops
        self.last = StepReport(
            step=self.steps,
            steps=steps,
            step_ms=seconds / steps * 1000,
            tokens_per_s=tokens / seconds,
            mfu=mfu,
            peak_mem_mib=max(r[2] for r in rows) / 2**20,
            peak_reserved_mib=max(r[3] for r in rows) / 2**20 if reserved is not None else None,
            slowest_rank=late,
            slowest_lag_ms=(rows[late][0] - median) * 1000,
        )
        if self.log is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            self.log(self.last.line())
        self._window_start, self._window_steps, self._window_tokens = self._synchronized_time(), 0, 0
        return self.last


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_rows(mine: list[float], device: torch.device, group: Optional[dist.ProcessGroup]) -> list[list[float]]:
    """Every rank's row (float64: wall-clock seconds keep their microseconds); just ours without a group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    backend = str(dist.get_backend(group))
    where = device if ("nccl" in backend and "cpu:" not in backend) else torch.device("cpu")
    local = torch.tensor(mine, dtype=torch.float64, device=where)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, local, group=group)
    return [r.tolist() for r in rows]

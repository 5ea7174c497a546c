"""One rank of ``python -m zeta_fsdp demo`` (started by ``torch.distributed.run``, see ``demo``).

Each rank wraps the demo GPT with ``fsdp()`` once per strategy, trains it on its slice of the
same global batches, measures peak memory (``measure.peak_memory_by_category``), collectives and
step time, and rank 0 writes every result as JSON for the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional, TextIO

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..distributed import choose_device, ensure_process_group, shutdown
from ..files import atomic_write
from ..fsdp import fsdp
from ..measure import collectives_per_step, median_step_seconds, peak_memory_by_category
from ..models import gpt
from ..training import StepMeter

__all__ = ["LEARNING_RATE", "PER_RANK_BATCH", "SEQ_LEN", "main"]

LEARNING_RATE = 3e-3
SEQ_LEN = 12  # tokens per sample; the demo GPT has max_seq_len 16
PER_RANK_BATCH = 4


class _Progress:
    """A progress bar on the terminal ``tty``: tqdm when installed, else a plain ``\\r`` bar; silent without one."""

    def __init__(self, total: int, tty: str):
        self.total, self.done, self.bar = total, 0, None
        self.stream: Optional[TextIO] = open(tty, "w") if tty else None  # noqa: SIM115 - closed by close()
        if self.stream is not None:
            with contextlib.suppress(ImportError):  # tqdm is optional (the "demo" extra)
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=self.stream, unit="step", leave=False, dynamic_ncols=True)

    def update(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            self.bar.update(1)
        elif self.stream is not None:
            filled = int(30 * self.done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            self.stream.write(f"\r{label:<13} [{bar}] {self.done}/{self.total}")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.stream is not None:
            self.stream.write("\r" + " " * 60 + "\r")
        if self.stream is not None:
            self.stream.close()


def _run_strategy(strategy: str, steps: int, mp: str, progress: _Progress, device: torch.device) -> dict[str, Any]:
    """Train ``strategy`` for ``steps`` steps, then measure it: losses, memory, step time, collectives."""
    run = _DemoRun(strategy, mp, device)
    first = _train(run, strategy, steps, progress)
    final = run.held_out_loss()
    return {"strategy": strategy, "loss_first": first, "loss_final": final, **_measure(run)}


class _DemoRun:
    """One strategy's model (``gpt.small()``, seeded alike for every strategy) and optimizer on this rank."""

    def __init__(self, strategy: str, mp: str, device: torch.device) -> None:
        self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), device
        torch.manual_seed(0)
        self.model = gpt.small()
        extra = {"replicate_size": 2} if strategy.startswith("HYBRID") else {}
        fsdp(
            self.model, auto_wrap=True, mp=mp, shard_strat=strategy, TransformerBlock=gpt.Block, device=device, **extra
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)

    def batch(self, seed: int) -> torch.Tensor:
        """This rank's slice of global batch ``seed``, the same for every strategy: sequences that count
        up from a random start (mod vocab), so the loss visibly drops in a few steps."""
        generator = torch.Generator().manual_seed(seed)
        vocab = self.model.cfg.vocab_size
        start = torch.randint(0, vocab, (PER_RANK_BATCH * self.world, 1), generator=generator)
        tokens = (start + torch.arange(SEQ_LEN + 1)) % vocab
        return tokens[self.rank * PER_RANK_BATCH : (self.rank + 1) * PER_RANK_BATCH].to(self.device)

    def mean_loss(self, loss: torch.Tensor) -> float:
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        return value.item() / self.world

    def train_step(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = gpt.lm_loss(self.model(tokens[:, :-1]).float(), tokens[:, 1:])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # step times are wall times of finished steps
        return loss

    def held_out_loss(self) -> float:
        """The mean loss on a batch no step trained on; the units resharded after (ready to measure)."""
        with torch.no_grad():
            held_out = self.batch(10_000)
            final = self.mean_loss(gpt.lm_loss(self.model(held_out[:, :-1]).float(), held_out[:, 1:]))
        for module in self.model.modules():  # a no-grad forward leaves ZeRO-2 units unsharded
            if isinstance(module, FSDPModule):
                module.reshard()
        return final


def _train(run: _DemoRun, strategy: str, steps: int, progress: _Progress) -> float:
    """``steps`` training steps, tokens/s on the progress line; returns the first step's mean loss."""
    first, meter = None, StepMeter(every=2, device=run.device, log=None)  # tokens/s for the progress line
    for step in range(steps):
        tokens = run.batch(step)
        meter.step(tokens=tokens[:, :-1].numel())
        loss = run.train_step(tokens)
        if first is None:
            first = run.mean_loss(loss)
        progress.update(strategy if meter.last is None else f"{strategy} {meter.last.tokens_per_s:.0f} tok/s")
    return first


def _measure(run: _DemoRun) -> dict[str, Any]:
    """Peak memory by category (the worst rank's, and each rank's), the slowest rank's median step time,
    and the collectives of one step."""
    tokens = run.batch(0)
    step = lambda: run.train_step(tokens)  # noqa: E731 - one step, measured three ways
    memory = peak_memory_by_category(run.model, run.optimizer, step, inputs=(tokens,), warmup=0)
    collectives = collectives_per_step(step)
    seconds = median_step_seconds(step, steps=3, warmup=0)
    per_rank: list[Any] = [None] * run.world
    dist.all_gather_object(per_rank, {"memory": memory, "seconds": seconds})
    return {
        "memory": {k: max(r["memory"].get(k, 0) for r in per_rank) for k in memory},
        "memory_per_rank": [r["memory"] for r in per_rank],
        "step_seconds": max(r["seconds"] for r in per_rank),
        "collectives": collectives,
    }


def main(argv: list[str]) -> None:
    """One rank of the demo (started by ``torch.distributed.run``; ``argv`` from the launcher)."""
    parser = argparse.ArgumentParser(prog="zeta_fsdp.cli.demo_rank")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--mp", required=True)
    parser.add_argument("--tty", default="")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    try:
        torch.set_num_threads(1)
        device = choose_device(device=args.device)  # "cuda" -> cuda:LOCAL_RANK
        ensure_process_group(device, timeout_s=120)  # nccl on CUDA, gloo on CPU
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rows = _run_strategies(args, device, world, rank)
        if rank == 0:
            _write_result(out, args, device, world, rows)
        shutdown()  # collects what is left in cycles, then waits for every rank before destroying
    except BaseException:
        (out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _run_strategies(args: argparse.Namespace, device: torch.device, world: int, rank: int) -> list[dict[str, Any]]:
    """Every strategy this world size runs (HYBRID needs 2 replicas of >= 2 ranks), one after another."""
    strategies = ["FULL_SHARD", "SHARD_GRAD", "NO_SHARD"]
    if world >= 4 and world % 2 == 0:
        strategies.append("HYBRID_SHARD")
    progress = _Progress(args.steps * len(strategies), args.tty if rank == 0 else "")
    try:
        rows = []
        for strategy in strategies:
            rows.append(_run_strategy(strategy, args.steps, args.mp, progress, device))
            # A wrapped model is a reference cycle; under NO_SHARD it holds DDP's reducer and so the
            # group. Collected now, not in interpreter finalization (SIGABRT in gloo, docs/pitfalls.md).
            gc.collect()
    finally:
        progress.close()
    return rows


def _write_result(out: Path, args: argparse.Namespace, device: torch.device, world: int, rows: list) -> None:
    """Rank 0: ``result.json``, all or nothing: the launcher treats a present one as a finished run."""
    reference = gpt.small()
    numel = sum(p.numel() for p in reference.parameters())
    tied = ", tied embedding/head" if reference.cfg.tie_weights else ""
    model = f"GPT ({numel:,} parameters, {reference.cfg.n_layers} blocks{tied})"
    result = dict(model=model, nproc=world, steps=args.steps, mp=args.mp, rows=rows)
    result.update(device=device.type, backend=str(dist.get_backend()))
    atomic_write(out / "result.json", lambda tmp: tmp.write_text(json.dumps(result)))


if __name__ == "__main__":
    main(sys.argv[1:])

"""``python -m zeta_fsdp demo``: train the tiny GPT under every sharding strategy and compare.

The launcher (``run_demo``) starts ``nproc`` local ranks with ``torch.distributed.run`` (on CUDA
with nccl when there is a GPU per rank, else on CPU with gloo: ``demo_device``), waits,
and prints one row per strategy: the loss after N steps (the same for every strategy: same seed,
same data), per-rank peak memory by category (``FSDPMemTracker``), step time and collectives per
step (``CommDebugMode``). Each rank (``_worker``) wraps the model with ``fsdp()`` once per
strategy, trains, measures, and rank 0 writes the results as JSON for the launcher.

Ctrl-C (SIGINT) or SIGTERM on the launcher stops every rank: the ranks live in their own
session, so the launcher forwards the stop to ``torch.distributed.run`` and then makes sure no
rank process is left.

Example:
    >>> from zeta_fsdp.demo import run_demo
    >>> result = run_demo(nproc=2, steps=4)  # doctest: +SKIP
    >>> print(format_table(result))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional, TextIO

from .options import MIXED_PRECISION_ALIASES

__all__ = [
    "MAX_NPROC",
    "MAX_STEPS",
    "DemoError",
    "demo_device",
    "format_table",
    "losses_equal",
    "run_demo",
    "strategies_for",
    "write_plot",
]

# More local CPU ranks than this only measures the machine's scheduler, not FSDP.
MAX_NPROC = 32
MAX_STEPS = 1000
LEARNING_RATE = 3e-3
SEQ_LEN = 12  # tokens per sample; the demo GPT has max_seq_len 16
PER_RANK_BATCH = 4
# Same seed and data everywhere: strategies differ only in reduction order (~1e-7 in fp32).
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}
# What each strategy is in the terms users know (the legend under the demo's table).
_STRATEGY_NOTES = {
    "FULL_SHARD": "ZeRO-3",
    "SHARD_GRAD": "ZeRO-2",
    "NO_SHARD": "DDP-like",
    "HYBRID_SHARD": "ZeRO-3 in 2 replicas",
}


class DemoError(RuntimeError):
    """A rank failed or the launcher could not run: the message is one line (plus the log path).

    Example:
        >>> try:  # doctest: +SKIP
        ...     run_demo(nproc=2)
        ... except DemoError as e:
        ...     print(e)  # e.g. "rank1 failed: RuntimeError: ... (full log: /tmp/.../launcher.log)"
    """


def demo_device(nproc: int) -> tuple[str, str]:
    """(device type, backend) the demo's ``nproc`` ranks use: ``("cuda", "nccl")`` when CUDA is
    available with a GPU for every rank, else ``("cpu", "gloo")`` (CPU is enough for the demo).

    Example:
        >>> demo_device(2)  # on a machine without a GPU
        ('cpu', 'gloo')
    """
    import torch

    if torch.cuda.is_available() and nproc <= torch.cuda.device_count():
        return "cuda", "nccl"
    return "cpu", "gloo"


def strategies_for(nproc: int) -> list[str]:
    """The strategies the demo compares at ``nproc`` ranks (HYBRID needs 2 replicas of >= 2 ranks).

    Example:
        >>> strategies_for(4)
        ['FULL_SHARD', 'SHARD_GRAD', 'NO_SHARD', 'HYBRID_SHARD']
    """
    names = ["FULL_SHARD", "SHARD_GRAD", "NO_SHARD"]
    if nproc >= 4 and nproc % 2 == 0:
        names.append("HYBRID_SHARD")
    return names


def _load_gpt() -> ModuleType:
    """The demo's model: the tiny GPT shipped in ``zeta_fsdp.models.gpt``."""
    from .models import gpt

    return gpt


# --------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------


def _validate(nproc: int, steps: int, mp: str, plot: Optional[str]) -> None:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= MAX_NPROC:
        raise ValueError(f"nproc={nproc!r} is not accepted. Accepted: an int from 1 to {MAX_NPROC}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps={steps!r} is not accepted. Accepted: an int from 1 to {MAX_STEPS}.")
    if MIXED_PRECISION_ALIASES.get(str(mp).lower()) not in LOSS_TOLERANCE:
        raise ValueError(f"mp={mp!r} is not accepted. Accepted: {', '.join(map(repr, MIXED_PRECISION_ALIASES))}.")
    if plot is not None:
        # The target is checked first: that error does not depend on what is installed.
        parent = Path(plot).resolve().parent
        if not parent.is_dir():
            raise ValueError(f"cannot write the plot to {plot!r}: folder {str(parent)!r} does not exist.")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib).") from None


def _rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # ranks share the cores: one intra-op thread each
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it.
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return []
    children = _children_map()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Stop the launcher and every rank: SIGTERM to ``torch.distributed.run`` (it forwards it to
    its ranks and waits for them), then SIGKILL anything of ours still alive."""
    ranks = _descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + timeout_s
    for pid in ranks:
        while _is_ours(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _is_ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _is_ours(pid: int) -> bool:
    """Is ``pid`` still one of our rank processes (not a reused pid, not a zombie)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z" and (b"zeta_fsdp.demo" in cmdline or b"torch.distributed.run" in cmdline)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A SIGTERM to the launcher (a CI timeout, ``kill``) cleans up like Ctrl-C instead of orphaning ranks."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _die_with_launcher() -> None:
    """Child-side (Linux): if the launcher itself is killed (SIGKILL, no clean-up), the kernel
    sends SIGTERM to ``torch.distributed.run``, which then stops its ranks."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _progress_tty() -> str:
    """The terminal the launcher's stderr is on, for rank 0's progress bar ("" when not a TTY)."""
    try:
        return os.ttyname(sys.stderr.fileno()) if sys.stderr.isatty() else ""
    except (OSError, ValueError, AttributeError):
        return ""


def run_demo(
    nproc: int = 2,
    steps: int = 8,
    mp: str = "fp32",
    plot: Optional[str] = None,
    *,
    progress: Optional[bool] = None,
    log: Optional[TextIO] = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Launch ``nproc`` local ranks, run every strategy for ``steps`` steps, return the results.

    ``progress``: show a progress bar on the launcher's terminal (default: only when stderr is a
    TTY, so CI logs stay clean). ``plot``: also write a memory bar chart there (needs matplotlib).
    ``log``: where to say that the ranks are being launched (nothing is said when ``None``).
    Raises ``ValueError`` for bad arguments (before anything starts), ``DemoError`` when a rank
    fails, ``KeyboardInterrupt`` after stopping every rank on Ctrl-C.

    Example:
        >>> result = run_demo(nproc=2, steps=4)  # doctest: +SKIP
        >>> [row["strategy"] for row in result["rows"]]  # doctest: +SKIP
        ['FULL_SHARD', 'SHARD_GRAD', 'NO_SHARD']
    """
    _validate(nproc, steps, mp, plot)
    mp = MIXED_PRECISION_ALIASES[mp.lower()]
    device, backend = demo_device(nproc)
    workdir = Path(tempfile.mkdtemp(prefix="zeta_fsdp_demo_"))
    tty = _progress_tty() if progress in (None, True) else ""
    if log is not None:
        log.write(f"launching {nproc} rank(s) on {device.upper()} ({backend}): {steps} steps per strategy ...\n")
        log.flush()
    try:
        command = _rank_command(nproc, steps, mp, workdir, tty, device)
        returncode = _launch_and_wait(command, workdir, timeout_s)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    result_path = workdir / "result.json"
    if returncode != 0 or not result_path.exists():
        raise DemoError(_failure_summary(workdir, returncode))  # workdir kept: it holds the log
    result = json.loads(result_path.read_text())
    shutil.rmtree(workdir, ignore_errors=True)
    if plot is not None:
        write_plot(result, plot)
    return result


def _rank_command(nproc: int, steps: int, mp: str, workdir: Path, tty: str, device: str = "cpu") -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    worker = ["--module", "zeta_fsdp.demo", "--out", str(workdir), "--steps", str(steps), "--mp", mp]
    worker += ["--device", device]
    return launcher + worker + (["--tty", tty] if tty else [])


def _launch_and_wait(cmd: list[str], workdir: Path, timeout_s: float) -> int:
    """Run the launcher; on Ctrl-C, SIGTERM or timeout stop every rank before returning/raising."""
    with open(workdir / "launcher.log", "w") as launcher_log, _sigterm_as_interrupt():
        # A session of its own: a terminal's Ctrl-C reaches only us, and we stop the ranks in order.
        proc = subprocess.Popen(
            cmd,
            env=_rank_env(),
            stdout=launcher_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_launcher if sys.platform.startswith("linux") else None,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise DemoError(f"the ranks did not finish within {timeout_s:.0f} s; stopped them") from None
        except KeyboardInterrupt:
            _stop(proc)
            raise


def _failure_summary(workdir: Path, returncode: int) -> str:
    """One line: the first failing rank's last traceback line, and where the full log is."""
    log_path = workdir / "launcher.log"
    for path in sorted(workdir.glob("error_rank*.txt")):
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if lines:
            return f"{path.stem.replace('error_', '')} failed: {lines[-1]} (full log: {log_path})"
    return f"the ranks exited with code {returncode} (full log: {log_path})"


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

_COLUMNS = (
    ("params", ("Sharded Param",)),
    ("grads", ("Sharded Grad", "Unsharded Grad", "Reduce Scatter")),
    ("optim", ("OptState",)),
    ("gathered", ("Unsharded Param", "All Gather")),
    ("activ", ("Activation", "Temp", "Inputs", "Buffer")),
)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f}"


def _collectives(counts: dict[str, int]) -> str:
    # CommDebugMode names the c10d ops (gloo) or the functional collectives (compiled code).
    short = {
        "_allgather_base_": "AG",
        "all_gather_into_tensor": "AG",
        "_reduce_scatter_base_": "RS",
        "reduce_scatter_tensor": "RS",
        "allreduce_": "AR",
        "all_reduce": "AR",
    }
    if not counts:
        return "0"
    merged: dict[str, int] = {}
    for op, n in counts.items():
        merged[short.get(op, op)] = merged.get(short.get(op, op), 0) + n
    parts = [f"{n} {op}" for op, n in sorted(merged.items())]
    return f"{sum(counts.values())} ({', '.join(parts)})"


def losses_equal(result: dict[str, Any]) -> tuple[bool, float]:
    """Do all strategies end at the same loss? Returns (within tolerance, largest difference).

    Example:
        >>> losses_equal({"mp": "fp32", "rows": [{"loss_final": 3.0}, {"loss_final": 3.0}]})
        (True, 0.0)
    """
    finals = [row["loss_final"] for row in result["rows"]]
    spread = max(finals) - min(finals)
    return spread <= LOSS_TOLERANCE[result["mp"]], spread


def format_table(result: dict[str, Any]) -> str:
    """The demo's printed report: one row per strategy, then the loss-equality verdict.

    Example:
        >>> print(format_table(run_demo(nproc=2)))  # doctest: +SKIP
    """
    n = result["steps"]
    header = (
        "strategy",
        f"loss 1st -> {n}",
        *(name for name, _ in _COLUMNS),
        "peak",
        "step ms",
        "collectives/step",
    )
    device, backend = result.get("device", "cpu"), result.get("backend", "gloo")
    rows = [header]
    for row in result["rows"]:
        mem = row["memory"]
        cells = [_kib(sum(mem.get(c, 0) for c in cats)) for _, cats in _COLUMNS]
        rows.append(
            (
                row["strategy"],
                f"{row['loss_first']:.4f} -> {row['loss_final']:.4f}",
                *cells,
                _kib(mem.get("Total", 0)),
                f"{row['step_seconds'] * 1000:.1f}",
                _collectives(row["collectives"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = set(range(2, len(header) - 1))
    lines = [
        f"zeta_fsdp demo: {result['model']} on {result['nproc']} {device.upper()} rank(s) ({backend}), "
        f"mp={result['mp']}, {n} AdamW steps from one seed on the same data",
        "per-rank memory in KiB at the step's peak (FSDPMemTracker, worst rank); "
        "gathered = unsharded params + all-gather buffers",
        "",
    ]
    for i, r in enumerate(rows):
        line = "  ".join(c.rjust(widths[j]) if j in right else c.ljust(widths[j]) for j, c in enumerate(r))
        lines.append(line.rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    names = [row["strategy"] for row in result["rows"]]
    lines.append("(" + ", ".join(f"{s} = {_STRATEGY_NOTES[s]}" for s in names if s in _STRATEGY_NOTES) + ")")
    equal, spread = losses_equal(result)
    verdict = "equal across strategies" if equal else "NOT equal across strategies"
    lines += ["", f"loss after {n} steps: {verdict} (largest difference {spread:.1e})"]
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: str) -> None:
    """Write a stacked bar chart of per-rank peak memory by category, one bar per strategy.

    Example:
        >>> write_plot(run_demo(nproc=2), "memory.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    names = [row["strategy"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(names)
    for label, cats in _COLUMNS:
        values = [sum(row["memory"].get(c, 0) for c in cats) / 1024 for row in result["rows"]]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("KiB per rank at the step's peak")
    ax.set_title(f"zeta_fsdp demo: {result['nproc']} ranks, mp={result['mp']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------


class _Progress:
    """A progress bar on ``stream``: tqdm when installed, else a plain ``\\r`` bar; silent without a stream."""

    def __init__(self, total: int, stream: Optional[TextIO]):
        self.total, self.done, self.stream, self.bar = total, 0, stream, None
        if stream is None:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, file=stream, unit="step", leave=False, dynamic_ncols=True)

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
            self.stream.flush()


def _counting_batch(vocab_size: int, rows: int, seed: int) -> Any:
    """Sequences that count up from a random start (mod vocab): the loss visibly drops in a few steps."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (rows, 1), generator=generator)
    return (start + torch.arange(SEQ_LEN + 1)) % vocab_size


def _run_strategy(
    gpt: ModuleType, strategy: str, steps: int, mp: str, progress: _Progress, device: Any
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from ._measure import collectives_per_step, median_step_seconds, peak_memory_by_category
    from .fsdp import fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gpt.small()
    vocab = model.cfg.vocab_size
    extra = {"replicate_size": 2} if strategy.startswith("HYBRID") else {}
    fsdp(model, auto_wrap=True, mp=mp, shard_strat=strategy, TransformerBlock=gpt.Block, device=device, **extra)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)

    def local(tokens: torch.Tensor) -> torch.Tensor:
        return tokens[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH].to(device)

    def mean_loss(loss: torch.Tensor) -> float:
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        return value.item() / world

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        loss = gpt.lm_loss(model(tokens[:, :-1]).float(), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # step times are wall times of finished steps
        return loss

    first = None
    for step in range(steps):
        # The same global batch for every strategy; each rank trains its own slice of it.
        loss = train_step(local(_counting_batch(vocab, PER_RANK_BATCH * world, seed=step)))
        if first is None:
            first = mean_loss(loss)
        progress.update(strategy)
    with torch.no_grad():
        held_out = local(_counting_batch(vocab, PER_RANK_BATCH * world, seed=10_000))
        final = mean_loss(gpt.lm_loss(model(held_out[:, :-1]).float(), held_out[:, 1:]))
    for module in model.modules():  # a no-grad forward leaves ZeRO-2 units unsharded
        if isinstance(module, FSDPModule):
            module.reshard()

    batch = local(_counting_batch(vocab, PER_RANK_BATCH * world, seed=0))
    memory = peak_memory_by_category(model, optimizer, lambda: train_step(batch), inputs=(batch,), warmup=0)
    collectives = collectives_per_step(lambda: train_step(batch))
    seconds = median_step_seconds(lambda: train_step(batch), steps=3, warmup=0)
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, {"memory": memory, "seconds": seconds})
    worst = {k: max(r["memory"].get(k, 0) for r in per_rank) for k in memory}
    return {
        "strategy": strategy,
        "loss_first": first,
        "loss_final": final,
        "memory": worst,
        "memory_per_rank": [r["memory"] for r in per_rank],
        "step_seconds": max(r["seconds"] for r in per_rank),
        "collectives": collectives,
    }


def _worker(argv: list[str]) -> None:
    """One rank of the demo (started by ``torch.distributed.run``)."""
    parser = argparse.ArgumentParser(prog="zeta_fsdp.demo")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--mp", required=True)
    parser.add_argument("--tty", default="")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    try:
        import torch

        from .distributed import choose_device, default_backend, ensure_process_group, shutdown

        torch.set_num_threads(1)
        device = choose_device(device=args.device)  # "cuda" -> cuda:LOCAL_RANK
        ensure_process_group(device, timeout_s=120)  # nccl on CUDA, gloo on CPU
        gpt = _load_gpt()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        strategies = strategies_for(world)
        stream = open(args.tty, "w") if args.tty and rank == 0 else None  # noqa: SIM115 - closed below
        progress = _Progress(args.steps * len(strategies), stream)
        try:
            rows = [_run_strategy(gpt, s, args.steps, args.mp, progress, device) for s in strategies]
        finally:
            progress.close()
            if stream is not None:
                stream.close()
        if rank == 0:
            reference = gpt.small()
            numel = sum(p.numel() for p in reference.parameters())
            tied = ", tied embedding/head" if reference.cfg.tie_weights else ""
            model = f"GPT ({numel:,} parameters, {reference.cfg.n_layers} blocks{tied})"
            result = {"model": model, "nproc": world, "steps": args.steps, "mp": args.mp}
            result.update(device=device.type, backend=default_backend(device))
            result["rows"] = rows
            (out / "result.json").write_text(json.dumps(result))
        shutdown()
    except BaseException:
        (out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    _worker(sys.argv[1:])

"""``python -m zeta_fsdp demo``: train the tiny GPT under every sharding strategy and compare.

``run_demo`` starts ``nproc`` local ranks (``torch.distributed.run`` in a session of its own,
stopped as a whole on Ctrl-C, SIGTERM or timeout), on CUDA with nccl when there is a GPU per rank, else on CPU with gloo
(``demo_device``), waits, and returns one row per strategy: the loss after N steps (the same for
every strategy: same seed, same data), per-rank peak memory by category (``FSDPMemTracker``),
step time and collectives per step (``CommDebugMode``). What each rank does is ``demo_rank``.
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
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

import torch

from ..distributed import without_launcher_env
from ..options import MIXED_PRECISION_ALIASES
from ..report import render_table
from .args import UsageError, choice, int_in

__all__ = ["HELP", "MAX_NPROC", "MAX_STEPS", "DemoError", "add_arguments", "demo_device", "format_table"]
__all__ += ["losses_equal", "run", "run_demo", "write_plot"]

HELP = (
    "train a small GPT under every sharding strategy on local ranks and compare "
    "(CUDA/nccl with a GPU per rank, else CPU/gloo)"
)
# More local CPU ranks than this only measures the machine's scheduler, not FSDP.
MAX_NPROC = 32
MAX_STEPS = 1000
# Same seed and data everywhere: strategies differ only in reduction order (~1e-7 in fp32).
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}
# The module every rank runs (``python -m``): its name also marks our processes for clean-up.
RANK_MODULE = "zeta_fsdp.cli.demo_rank"
# What each strategy is in the terms users know (the legend under the demo's table).
_STRATEGY_NOTES = {
    "FULL_SHARD": "ZeRO-3",
    "SHARD_GRAD": "ZeRO-2",
    "NO_SHARD": "DDP-like",
    "HYBRID_SHARD": "ZeRO-3 in 2 replicas",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    nproc = int_in(1, MAX_NPROC, "--nproc")
    parser.add_argument("--nproc", type=nproc, default=2, help="local ranks to launch (default 2)")
    steps = int_in(1, MAX_STEPS, "--steps")
    parser.add_argument("--steps", type=steps, default=8, help="training steps per strategy (default 8)")
    mp = choice("mp", MIXED_PRECISION_ALIASES, str.lower)
    parser.add_argument("--mp", type=mp, default="fp32", help="mixed precision: fp32 (default), bf16, fp16")
    parser.add_argument("--plot", metavar="OUT.png", help="also write a bar chart of memory per strategy (matplotlib)")


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its table; bad input raises ``UsageError``, a failed rank returns 1."""
    try:
        result = run_demo(nproc=args.nproc, steps=args.steps, mp=args.mp, plot=args.plot, log=sys.stderr)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except DemoError as e:
        sys.stderr.write(f"python -m zeta_fsdp demo: {e}\n")
        return 1
    print(format_table(result))
    if args.plot:
        print(f"memory chart written to {args.plot}")
    return 0


class DemoError(RuntimeError):
    """A rank failed or the launcher could not run: the message is one line (plus the log path)."""


def demo_device(nproc: int) -> tuple[str, str]:
    """``("cuda", "nccl")`` when there is a GPU for each of the ``nproc`` ranks, else ``("cpu", "gloo")``."""
    if torch.cuda.is_available() and nproc <= torch.cuda.device_count():
        return "cuda", "nccl"
    return "cpu", "gloo"


def _validate(nproc: int, steps: int, mp: str, plot: Optional[str]) -> None:
    for name, value, high in (("nproc", nproc, MAX_NPROC), ("steps", steps, MAX_STEPS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ValueError(f"{name}={value!r} is not accepted. Accepted: an int from 1 to {high}.")
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


def run_demo(
    nproc: int = 2,
    steps: int = 8,
    mp: str = "fp32",
    plot: Optional[str] = None,
    *,
    log: Optional[TextIO] = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Launch ``nproc`` local ranks, run every strategy for ``steps`` steps, return the results.

    Rank 0 draws a progress bar only when stderr is a terminal (CI logs stay clean). ``plot``: a
    memory bar chart there (matplotlib); ``log``: where to say the ranks are launching.
    Raises ``ValueError`` for bad arguments (before anything starts), ``DemoError`` when a rank
    fails, ``KeyboardInterrupt`` after stopping every rank on Ctrl-C.
    """
    _validate(nproc, steps, mp, plot)
    mp = MIXED_PRECISION_ALIASES[mp.lower()]
    device, backend = demo_device(nproc)
    workdir = Path(tempfile.mkdtemp(prefix="zeta_fsdp_demo_"))
    if log is not None:
        log.write(f"launching {nproc} rank(s) on {device.upper()} ({backend}): {steps} steps per strategy ...\n")
        log.flush()
    worker = ["--module", RANK_MODULE, "--out", str(workdir), "--steps", str(steps), "--mp", mp, "--device", device]
    try:
        returncode = _launch_and_wait(_launcher(nproc) + worker + _tty_args(), workdir, timeout_s)
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


def _launcher(nproc: int) -> list[str]:
    """``torch.distributed.run`` for ``nproc`` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _tty_args() -> list[str]:
    """``--tty`` and the terminal our stderr is on, for rank 0's progress bar (none off a terminal)."""
    try:
        tty = os.ttyname(sys.stderr.fileno()) if sys.stderr.isatty() else ""
    except (OSError, ValueError, AttributeError):
        tty = ""
    return ["--tty", tty] if tty else []


# Stopping the ranks: Ctrl-C or SIGTERM is forwarded to torch.distributed.run, then no rank process may be
# left (Linux /proc); if the launcher is killed outright, PR_SET_PDEATHSIG stops the ranks.
def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else None
        except OSError:
            continue
        if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_ours(pid: int) -> bool:
    """Is ``pid`` still one of our rank processes (not a reused pid, not a zombie)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z" and (RANK_MODULE.encode() in cmdline or b"torch.distributed.run" in cmdline)


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
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def _launch_and_wait(cmd: list[str], workdir: Path, timeout_s: float) -> int:
    """Run the launcher ``cmd`` (output to ``workdir/launcher.log``) and return its exit code; on Ctrl-C,
    SIGTERM or timeout stop every rank first, then raise ``KeyboardInterrupt`` / ``DemoError``."""
    with open(workdir / "launcher.log", "w") as log, _sigterm_as_interrupt():
        env = without_launcher_env()  # start a job of our own, never join the one that started us
        env["OMP_NUM_THREADS"] = "1"  # the ranks share the cores
        # A session of its own: a terminal's Ctrl-C reaches only us, and we stop the ranks in order.
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
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


_COLUMNS = (
    ("params", ("Sharded Param",)),
    ("grads", ("Sharded Grad", "Unsharded Grad", "Reduce Scatter")),
    ("optim", ("OptState",)),
    ("gathered", ("Unsharded Param", "All Gather")),
    ("activ", ("Activation", "Temp", "Inputs", "Buffer")),
)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f}"


# CommDebugMode names the c10d ops (gloo) or the functional collectives (compiled code).
_SHORT_OPS = {"_allgather_base_": "AG", "all_gather_into_tensor": "AG", "allreduce_": "AR", "all_reduce": "AR"}
_SHORT_OPS |= {"_reduce_scatter_base_": "RS", "reduce_scatter_tensor": "RS"}


def _collectives(counts: dict[str, int]) -> str:
    merged: Counter = Counter()
    for op, n in counts.items():
        merged[_SHORT_OPS.get(op, op)] += n
    parts = ", ".join(f"{n} {op}" for op, n in sorted(merged.items()))
    return f"{sum(counts.values())} ({parts})" if counts else "0"


def losses_equal(result: dict[str, Any]) -> tuple[bool, float]:
    """Do all strategies end at the same loss? Returns (within tolerance, largest difference)."""
    finals = [row["loss_final"] for row in result["rows"]]
    spread = max(finals) - min(finals)
    return spread <= LOSS_TOLERANCE[result["mp"]], spread


def format_table(result: dict[str, Any]) -> str:
    """The demo's printed report: one row per strategy, then the loss-equality verdict."""
    n = result["steps"]
    header = ("strategy", f"loss 1st -> {n}", *(name for name, _ in _COLUMNS), "peak", "step ms", "collectives/step")
    device, backend = result.get("device", "cpu"), result.get("backend", "gloo")
    rows = [header]
    for row in result["rows"]:
        mem = row["memory"]
        cells = [_kib(sum(mem.get(c, 0) for c in cats)) for _, cats in _COLUMNS]
        cells += [_kib(mem.get("Total", 0)), f"{row['step_seconds'] * 1000:.1f}", _collectives(row["collectives"])]
        rows.append((row["strategy"], f"{row['loss_first']:.4f} -> {row['loss_final']:.4f}", *cells))
    lines = [
        f"zeta_fsdp demo: {result['model']} on {result['nproc']} {device.upper()} rank(s) ({backend}), "
        f"mp={result['mp']}, {n} AdamW steps from one seed on the same data",
        "per-rank memory in KiB at the step's peak (FSDPMemTracker, worst rank); "
        "gathered = unsharded params + all-gather buffers",
        "",
        render_table(rows, align="ll" + "r" * (len(header) - 3) + "l"),
    ]
    names = [row["strategy"] for row in result["rows"]]
    lines.append("(" + ", ".join(f"{s} = {_STRATEGY_NOTES[s]}" for s in names if s in _STRATEGY_NOTES) + ")")
    equal, spread = losses_equal(result)
    verdict = "equal across strategies" if equal else "NOT equal across strategies"
    lines += ["", f"loss after {n} steps: {verdict} (largest difference {spread:.1e})"]
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: str) -> None:
    """Write a stacked bar chart of per-rank peak memory by category, one bar per strategy."""
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

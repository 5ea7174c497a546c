"""`python -m zeta_fsdp bench [NAME ...] [--quick]`: run the repository's benchmark scripts.

The scripts live in the source checkout's ``benchmarks/`` folder (found next to the package, as
the demo finds ``examples/``); each is started as ``python benchmarks/bench_<name>.py``, which
launches its own ranks. Without NAME, the benchmarks are listed.

Example:
    $ python -m zeta_fsdp bench step_time --quick --out /tmp/bench
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .cli import UsageError, register

_HELP = "run the repository's benchmarks (benchmarks/bench_*.py); without NAME, list them"
_BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"

# name -> (script, what it measures). All but checkpoint take --quick (a seconds-long smoke run
# whose results go to a temp folder) and --out DIR (see benchmarks/_common.py: bench_parser).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "facade": ("bench_facade.py", "fsdp() vs hand-written fully_shard: step time, peak memory, collectives, wrap time"),
    "memory": ("bench_memory.py", "peak memory per rank by category vs world size 1, 2, 4 for every strategy"),
    "step_time": ("bench_step_time.py", "step time of fsdp() vs hand-written fully_shard vs NO_SHARD vs DDP"),
    "accelerate": ("bench_accelerate.py", "fsdp() vs accelerate's FSDP2 plugin (needs accelerate, else skips)"),
    "gpu": ("bench_gpu.py", "bf16 tokens/s and MFU on 1 GPU vs the unwrapped model (skips without CUDA)"),
    "checkpoint": ("bench_checkpoint.py", "sharded DCP save/load vs torch.save/torch.load, gather peak memory"),
    "training": ("bench_training.py", "no_sync gradient accumulation, FSDP2Strategy vs a plain fsdp() loop"),
    "long_jobs": ("bench_long_jobs.py", "async save stall vs synchronous save, staged-copy memory, crash recovery"),
}
# bench_checkpoint.py has its own arguments (no --quick, no --out): a quick run is a small model,
# one repetition, printed only (--no-write: results/checkpoint.md is left alone).
_CHECKPOINT_QUICK = ["--repeats", "1", "--vocab", "1024", "--dim", "64", "--layers", "2", "--no-write"]


def _name(text: str) -> str:
    if text not in BENCHMARKS:
        raise argparse.ArgumentTypeError(f"unknown benchmark {text!r}; accepted: {', '.join(BENCHMARKS)}")
    return text


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", type=_name, metavar="NAME", help=f"one of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (tiny model, figures meaningless)")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="results folder (default benchmarks/results; a temp folder with --quick); not for checkpoint",
    )


def bench_command(name: str, quick: bool = False, out: Path | None = None) -> list[str]:
    """The command line that runs benchmark ``name`` (from the repository root).

    Example:
        >>> bench_command("step_time", quick=True)[1:]  # doctest: +SKIP
        ['.../benchmarks/bench_step_time.py', '--quick']
    """
    script, _ = BENCHMARKS[name]
    cmd = [sys.executable, str(_BENCH_DIR / script)]
    if name == "checkpoint":
        if out is not None and not quick:
            raise UsageError(
                "checkpoint writes only benchmarks/results/checkpoint.md (it has no --out); "
                "drop --out, or add --quick to print its figures without writing"
            )
        return cmd + (_CHECKPOINT_QUICK if quick else [])
    return cmd + (["--quick"] if quick else []) + (["--out", str(out)] if out is not None else [])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(_BENCH_DIR.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    # The scripts launch their own ranks only when not started as one: never inherit a job's.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _run(args: argparse.Namespace) -> int:
    if not _BENCH_DIR.is_dir():
        raise UsageError(
            f"the benchmarks live in the repository's benchmarks/ folder, not found at {_BENCH_DIR}; "
            "run it from a source checkout of zeta_fsdp"
        )
    if not args.names:
        print("benchmarks (python -m zeta_fsdp bench NAME [NAME ...] [--quick] [--out DIR]):")
        width = max(map(len, BENCHMARKS))
        for name, (_, what) in BENCHMARKS.items():
            print(f"  {name:<{width}}  {what}")
        print(f"scripts and recorded results: {_BENCH_DIR} (see its README.md)")
        return 0
    names = list(dict.fromkeys(args.names))
    commands = {name: bench_command(name, args.quick, args.out) for name in names}  # all checked first
    for name in names:
        script = BENCHMARKS[name][0]
        if not (_BENCH_DIR / script).is_file():
            raise UsageError(f"benchmark script {script} is missing from {_BENCH_DIR}")
    for name, cmd in commands.items():
        sys.stderr.write(f"== {name}: python {' '.join([f'benchmarks/{BENCHMARKS[name][0]}', *cmd[2:]])}\n")
        sys.stderr.flush()
        code = subprocess.run(cmd, cwd=_BENCH_DIR.parent, env=_env()).returncode
        if code != 0:
            sys.stderr.write(f"python -m zeta_fsdp bench: {name} failed (exit code {code})\n")
            return 1
    return 0


register("bench", _HELP, _add_arguments, _run)

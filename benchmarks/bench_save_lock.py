"""What the concurrent-writer protection costs a save (issue 18): ``save_checkpoint(path, overwrite=True)``
with its path lock and atomic exchange, against the same save without them.

Variants, interleaved block by block (order reversed every block) in one process, so drift from
other jobs on the machine hits all of them alike:

* ``protected``: what the library does (``flock`` on ``.<name>.lock`` held from the first look at
  the path to the publish; the new directory swapped in with ``renameat2(RENAME_EXCHANGE)``),
* ``no lock``: the same save with the lock's acquire/release made no-ops,
* ``two renames``: the lock, but the previous directory moved aside and the new one renamed in
  (what systems without ``renameat2`` get).

The lock and the publish are rank 0's alone, so one process measures them; the rest of a save
(DCP writing every rank's shards) is the same in every variant. Two model sizes: a tiny one, where
the fixed cost shows most, and one of 64 MiB.

    python benchmarks/bench_save_lock.py [--blocks 10] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import zeta_fsdp.files as files  # noqa: E402
from zeta_fsdp.state_dict import save_checkpoint  # noqa: E402

VARIANTS = ("protected", "no lock", "two renames")


def _variant(name: str):
    """Patch ``zeta_fsdp.files`` for ``name``; returns an undo function."""
    saved = (files.PathLock.acquire, files.PathLock.release, files.exchange_paths)
    if name == "no lock":
        files.PathLock.acquire = lambda self, timeout_s: True
        files.PathLock.release = lambda self: None
    elif name == "two renames":
        files.exchange_paths = lambda a, b: False

    def undo() -> None:
        files.PathLock.acquire, files.PathLock.release, files.exchange_paths = saved

    return undo


def measure(numel: int, blocks: int, per_block: int, folder: Path) -> dict[str, list[float]]:
    model = torch.nn.Linear(1, 1, bias=False)
    model.weight = torch.nn.Parameter(torch.randn(numel, 1))
    path = folder / f"c{numel}"
    save_checkpoint(path, model, overwrite=True)  # warm up: the file system, DCP's imports
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for block in range(blocks):
        order = VARIANTS if block % 2 == 0 else tuple(reversed(VARIANTS))
        for name in order:
            undo = _variant(name)
            try:
                start = time.perf_counter()
                for _ in range(per_block):
                    save_checkpoint(path, model, overwrite=True)
                seconds[name].append((time.perf_counter() - start) / per_block)
            finally:
                undo()
    return seconds


def micro(folder: Path, repeat: int) -> dict[str, float]:
    """Median microseconds of the added steps alone: lock + release, one exchange, two renames."""
    a, b = folder / "a", folder / "b"
    a.mkdir()
    b.mkdir()
    out: dict[str, list[float]] = {"lock + release": [], "exchange (renameat2)": [], "two renames": []}
    for _ in range(repeat):
        start = time.perf_counter()
        lock = files.PathLock(folder / "c")
        lock.acquire(timeout_s=1)
        lock.release()
        out["lock + release"].append(time.perf_counter() - start)
        start = time.perf_counter()
        files.exchange_paths(a, b)
        out["exchange (renameat2)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        a.rename(folder / "old")
        b.rename(a)
        (folder / "old").rename(b)
        out["two renames"].append((time.perf_counter() - start) * 2 / 3)  # two of the three renames
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (figures meaningless)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    blocks, per_block = (2, 1) if args.quick else (args.blocks, args.per_block)
    sizes = {"tiny (1 KiB)": 256, "64 MiB": 16 * 2**20}
    if args.quick:
        sizes = {"tiny (1 KiB)": 256}
    rows = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        steps = micro(Path(tmp), 20 if args.quick else 2000)
        for label, numel in sizes.items():
            s = measure(numel, blocks, per_block, Path(tmp))
            base = s["no lock"]
            rows[label] = {
                name: {
                    "median_ms": statistics.median(v) * 1e3,
                    "ratio_vs_no_lock": statistics.median(a / b for a, b in zip(v, base)),
                    "ratio_min": min(a / b for a, b in zip(v, base)),
                    "ratio_max": max(a / b for a, b in zip(v, base)),
                }
                for name, v in s.items()
            }
    lines = [
        "# What the concurrent-writer protection costs a save (issue 18)",
        "",
        "`save_checkpoint(path, model, overwrite=True)`, one process, variants interleaved block by block "
        f"({blocks} blocks x {per_block} saves). Ratio: median of the per-block ratios to `no lock` (range).",
        f"Machine: {os.cpu_count()} cores, shared with other jobs (load average {load:.1f} at the start); "
        f"torch {torch.__version__}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
        f"Command: `python benchmarks/bench_save_lock.py {' '.join(argv)}`".rstrip(),
        "",
        "The added steps alone (median of "
        + ("20" if args.quick else "2000")
        + " repetitions, microseconds; the lock is taken once per save, the exchange or renames once per overwrite):",
        "",
        "| step | µs |",
        "|---|---|",
        *(f"| {k} | {v:.1f} |" for k, v in steps.items()),
        "",
        "Whole saves (their spread on a loaded machine is far larger than the steps above):",
        "",
        "| model | variant | ms per save | ratio vs no lock |",
        "|---|---|---|---|",
    ]
    for label, by in rows.items():
        for name, r in by.items():
            lines.append(
                f"| {label} | {name} | {r['median_ms']:.2f} | {r['ratio_vs_no_lock']:.3f} "
                f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "save_lock.md").write_text(text)
        (args.out / "save_lock.json").write_text(json.dumps({"steps_us": steps, "saves": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

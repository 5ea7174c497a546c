"""Long-jobs benchmark: training stall of an async save vs a synchronous save, staged-copy memory, crash recovery.

Measures, in one run, at N ranks (default 2) on one model (the example GPT, ~84 MB of fp32 weights
plus AdamW state by default):

* the training stall per save: ``save_checkpoint`` (synchronous: the whole write) against
  ``AsyncCheckpointer.save`` (returns once this rank's shards are staged), median of ``--repeats``,
  side by side in one run; and the async write's total time (save -> ``wait()``, training meanwhile);
* extra memory of the staged copy: bytes of the staged tensors (exact) against the rank's shard
  bytes (model + optimizer state), and the process's RSS growth while an async write is in flight;
* crash recovery: ``tests/crash_train.py`` under ``torchrun --max-restarts=1``, clean and with one
  rank SIGKILLed after step 5: wall time of each and the steps redone.

Run (relaunches itself under torchrun when started plainly; rank 0 writes the results file):

    python benchmarks/bench_long_jobs.py                 # writes results/long_jobs.md
    python benchmarks/bench_long_jobs.py --repeats 3 --no-write

Example:
    $ python benchmarks/bench_long_jobs.py --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from zeta_fsdp import AsyncCheckpointer, fsdp, save_checkpoint, shutdown  # noqa: E402
from zeta_fsdp.models.gpt import GPT, Block, GPTConfig, lm_loss  # noqa: E402
from zeta_fsdp.state_dict.async_save import stage_state  # noqa: E402
from zeta_fsdp.state_dict.checkpoint import checkpoint_state  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "long_jobs.md"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-crash", action="store_true", help="skip the crash-recovery runs")
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny model, 1 repeat, no crash runs")
    parser.add_argument("--out", default=None, help="write long_jobs.md here instead of benchmarks/results")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n-heads", type=int, default=8, help=argparse.SUPPRESS)
    return parser.parse_args()


def rss_now() -> int:
    """Resident memory of this process now (``VmRSS``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def local_bytes(state: dict) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def ranks_part(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=args.vocab, dim=args.dim, n_heads=args.n_heads, n_layers=args.layers, max_seq_len=64)
    torch.manual_seed(0)
    model = fsdp(GPT(cfg), auto_wrap=True, TransformerBlock=Block, shard_strat="FULL_SHARD")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, 32))

    def step() -> float:
        start = time.perf_counter()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    step()  # optimizer state exists from here on
    work = Path(args.dir)
    rank = dist.get_rank()
    sync_s, stall_s, write_s, step_s = [], [], [], []
    checkpointer = AsyncCheckpointer()
    for i in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        save_checkpoint(work / f"sync_{i}", model, opt)
        sync_s.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        checkpointer.save(work / f"async_{i}", model, opt)
        stall_s.append(time.perf_counter() - start)
        steps = 0
        # Training goes on during the write. Every rank runs the same number of steps (they are
        # collective): as many as fit in the write on rank 0, agreed by one broadcast per step.
        while True:
            busy = torch.tensor([int(checkpointer.in_flight is not None)])
            dist.broadcast(busy, src=0)
            if not busy.item():
                break
            step_s.append(step())
            steps += 1
        written = time.perf_counter() - start
        checkpointer.wait()
        write_s.append(written)
        if rank == 0:
            shutil.rmtree(work / f"sync_{i}", ignore_errors=True)
            shutil.rmtree(work / f"async_{i}", ignore_errors=True)
    # Memory: the staged copy's bytes (exact) vs this rank's shard bytes; RSS growth over one async save.
    live = checkpoint_state(model, opt, None)
    shard_bytes = local_bytes(live)
    staged_bytes = local_bytes(stage_state(live))
    del live
    dist.barrier()
    before = rss_now()
    checkpointer.save(work / "async_mem", model, opt)
    rss_growth = rss_now() - before  # what the process holds more while the write is in flight
    checkpointer.wait()
    checkpointer.close()
    result = {
        "rank": rank,
        "sync_s": statistics.median(sync_s),
        "stall_s": statistics.median(stall_s),
        "write_s": statistics.median(write_s),
        "steps_during_write": len(step_s) / args.repeats,
        "step_s": statistics.median(step_s) if step_s else None,
        "shard_bytes": shard_bytes,
        "staged_bytes": staged_bytes,
        "rss_growth": rss_growth,
        "params": sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
        + sum(p.full_tensor().numel() for p in model.parameters() if isinstance(p, DTensor)),
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if rank == 0:
        (work / "ranks.json").write_text(json.dumps(results))
    shutdown()


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["OMP_NUM_THREADS"] = "1"
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(var, None)
    return out


def crash_runs(work: Path) -> dict:
    """``tests/crash_train.py`` clean and with a SIGKILL after step 5: wall times, steps redone."""
    out = {}
    for name, extra in (("clean", []), ("crash", ["--kill-at", "5"])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
        cmd += [str(ROOT / "tests" / "crash_train.py"), "--out", str(work / name), "--ckpt", str(work / f"ck_{name}")]
        start = time.perf_counter()
        proc = subprocess.run(cmd + extra, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"crash_train.py {name} failed:\n{proc.stderr[-4000:]}")
        attempts = [json.loads(line) for line in (work / name / "attempts.jsonl").read_text().splitlines()]
        out[name] = {"wall_s": wall, "resumed_from": attempts[-1]["resumed_from"], "attempt": attempts[-1]["attempt"]}
    want = torch.load(work / "clean" / "final.pt", weights_only=True)
    got = torch.load(work / "crash" / "final.pt", weights_only=True)
    out["identical"] = all(
        torch.equal(got[p][k], v) if isinstance(v, torch.Tensor) else got[p][k] == v
        for p in want
        for k, v in want[p].items()
    )
    out["steps_redone"] = 5 - out["crash"]["resumed_from"]
    return out


def mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(args: argparse.Namespace, ranks: list[dict], crash: dict | None, command: str) -> str:
    lines = [
        "# Long jobs: async save stall, staged-copy memory, crash recovery",
        "",
        f"Command: `{command}`",
        "",
        f"Recorded {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()} ({os.cpu_count()} CPUs, "
        f"shared with other jobs: timings are noisy, compare the ratios measured side by side), "
        f"torch {torch.__version__}, {args.nproc} ranks (gloo, CPU), model GPT(vocab={args.vocab}, dim={args.dim}, "
        f"layers={args.layers}) = {ranks[0]['params'] / 1e6:.1f} M parameters + AdamW state, FULL_SHARD; "
        f"median of {args.repeats} saves.",
        "",
        "## Training stall per save (goal: async <= 0.2 x synchronous)",
        "",
        "| rank | synchronous `save_checkpoint` | async `save()` returns (stall) | stall / sync | async write, save -> published | training steps run during the write |",
        "|---|---|---|---|---|---|",
    ]
    for r in ranks:
        lines.append(
            f"| {r['rank']} | {r['sync_s'] * 1e3:.0f} ms | {r['stall_s'] * 1e3:.0f} ms | "
            f"**{r['stall_s'] / r['sync_s']:.2f}** | {r['write_s'] * 1e3:.0f} ms | {r['steps_during_write']:.1f} |"
        )
    lines += [
        "",
        "## Extra memory of the staged copy (goal: <= 1 x the rank's shard bytes)",
        "",
        "| rank | shard bytes (model + optimizer) | staged copy | staged / shard | RSS growth while the write is in flight (right after `save()` returns) |",
        "|---|---|---|---|---|",
    ]
    for r in ranks:
        lines.append(
            f"| {r['rank']} | {mb(r['shard_bytes'])} | {mb(r['staged_bytes'])} | "
            f"**{r['staged_bytes'] / r['shard_bytes']:.2f}** | {mb(r['rss_growth'])} |"
        )
    if crash is not None:
        lines += [
            "",
            "## Crash recovery (`tests/crash_train.py`, 2 ranks, 10 steps, async save every 2 steps)",
            "",
            "| run | wall time (torchrun start to exit) | resumed from step | steps redone | final weights + optimizer equal the clean run |",
            "|---|---|---|---|---|",
            f"| clean | {crash['clean']['wall_s']:.1f} s | - | - | - |",
            f"| rank 1 SIGKILLed after step 5, `--max-restarts=1` | {crash['crash']['wall_s']:.1f} s | "
            f"{crash['crash']['resumed_from']} | {crash['steps_redone']} | {'yes, bit for bit' if crash['identical'] else 'NO'} |",
            "",
            "Steps redone = 5 - the step of the latest checkpoint complete when the rank died: the",
            "save of step 4 is asynchronous, so whether it was published before the kill decides 4 or 2",
            "(3 steps redone at most with `every=2`).",
        ]
    lines += [
        "",
        "How: the stall is the time `AsyncCheckpointer.save` blocks (checks, `stage_state` copying the",
        "rank's shards to CPU memory, starting DCP's `async_save` on the checkpointer's own gloo group); the",
        "synchronous time is `save_checkpoint` of the same model and optimizer, in the same run. The staged",
        "copy is counted exactly (bytes of the staged tensors); RSS growth is `VmRSS` right after `save()`",
        "returns minus `VmRSS` just before (the staged copy plus DCP's write buffers, minus what the",
        "allocator reused).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if args.quick:
        args.vocab, args.dim, args.layers, args.repeats, args.no_crash = 64, 16, 1, 1, True
        args.out = args.out or tempfile.mkdtemp(prefix="zeta_long_jobs_quick_")
    if args.part == "ranks":
        ranks_part(args)
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="zeta_long_jobs_"))
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += [__file__, "--part", "ranks", "--dir", str(work), "--repeats", str(args.repeats)]
    cmd += ["--vocab", str(args.vocab), "--dim", str(args.dim), "--layers", str(args.layers)]
    cmd += ["--n-heads", str(2 if args.quick else args.n_heads)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark ranks failed:\n{proc.stderr[-6000:]}")
    ranks = json.loads((work / "ranks.json").read_text())
    crash = None if args.no_crash else crash_runs(work)
    command = "python benchmarks/bench_long_jobs.py" + (f" --repeats {args.repeats}" if args.repeats != 5 else "")
    text = report(args, ranks, crash, command)
    print(text)
    if not args.no_write:
        (Path(args.out) / RESULTS.name if args.out else RESULTS).write_text(text)
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

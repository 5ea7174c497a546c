"""Checkpoint benchmark: sharded DCP save/load at N ranks vs torch.save/torch.load on one process.

Measures, in one run and on one model (the example GPT, ~84 MB of fp32 weights by default):

* ``save_checkpoint`` / ``load_checkpoint`` wall time at N ranks (median of ``--repeats``), against
  ``torch.save`` (+ fsync, as DCP fsyncs its files) and ``torch.load(weights_only=True)`` of the
  full state dict on rank 0 alone; also a raw ``dcp.load`` with none of our checks, to show
  what the checks (CRC-32, scratch copy, validation) cost;
* bytes each rank writes, against the model's bytes;
* peak memory of ``get_full_state_dict(cpu_offload=True)`` on rank 0, two ways: tensor storages
  counted by ``torch.distributed._tools.mem_tracker.MemTracker`` (exact, CPU included), and the
  process's peak RSS (``VmHWM`` after resetting it through ``/proc/self/clear_refs``).

Run (relaunches itself under torchrun when started plainly; rank 0 writes the results file):

    python benchmarks/bench_checkpoint.py                     # 2 ranks, writes results/checkpoint.md
    python benchmarks/bench_checkpoint.py --nproc 4 --no-write

Example:
    $ python benchmarks/bench_checkpoint.py --repeats 3 --no-write
"""

from __future__ import annotations

import argparse
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
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from zeta_fsdp import fsdp, shutdown  # noqa: E402
from zeta_fsdp.models.gpt import GPT, Block, GPTConfig  # noqa: E402
from zeta_fsdp.state_dict import get_full_state_dict, get_sharded_state_dict, load_checkpoint, save_checkpoint  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "checkpoint.md"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch when started plainly")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/checkpoint.md")
    return parser.parse_args()


def relaunch(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += [__file__, *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(cmd, env=env)


def timed(fn: Callable[[], object], repeats: int, *, collective: bool = True) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs; with ``collective`` every rank starts together."""
    times = []
    for _ in range(repeats):
        if collective:
            dist.barrier()
        start = time.perf_counter()
        fn()
        if collective:
            dist.barrier()  # the slowest rank decides
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def unique_bytes(sd: dict) -> int:
    seen, total = set(), 0
    for value in sd.values():
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
            seen.add(value.untyped_storage().data_ptr())
            total += value.numel() * value.element_size()
    return total


def rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure_gather_peak(model: torch.nn.Module) -> dict[str, int]:
    """Peak memory of get_full_state_dict(cpu_offload=True) on this rank, above what was live before.

    Peak RSS first, on the process's first gather (later ones reuse memory the allocator kept), then
    MemTracker on a second gather for the exact tensor bytes.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    can_reset = reset_rss_peak()
    rss_before = rss_peak_bytes()
    sd = get_full_state_dict(model, cpu_offload=True)
    rss_delta = rss_peak_bytes() - rss_before if can_reset else -1
    del sd
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot("current")
        sd = get_full_state_dict(model, cpu_offload=True)
        peak = tracker.get_tracker_snapshot("peak")
    base = sum(v["Total"] for v in before.values())
    tensor_peak = sum(v["Total"] for v in peak.values()) - base
    kept = unique_bytes(sd)
    return {"tensor_peak": tensor_peak, "kept": kept, "rss_delta": rss_delta}


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(relaunch(args))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "zeta_fsdp_bench_ckpt"
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    dist.barrier()

    cfg = GPTConfig(vocab_size=args.vocab, dim=args.dim, n_heads=8, n_layers=args.layers, max_seq_len=128)
    torch.manual_seed(0)
    model = fsdp(GPT(cfg), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    load_avg = os.getloadavg()[0]

    # Peak memory first, before the timing loops warm up allocator caches.
    mem = measure_gather_peak(model)
    full_sd = get_full_state_dict(model)  # rank 0: the torch.save baseline's input (not timed)
    model_bytes = torch.tensor(unique_bytes(full_sd) if rank == 0 else 0)
    dist.broadcast(model_bytes, src=0)
    model_bytes = int(model_bytes)

    counter = iter(range(1000))

    def save_sharded() -> None:
        save_checkpoint(base / f"dcp_{next(counter)}", model)

    t_save = timed(save_sharded, args.repeats)
    ckpt = base / "dcp_0"
    t_load = timed(lambda: load_checkpoint(ckpt, model), args.repeats)
    live = {"model." + k: v for k, v in get_sharded_state_dict(model).items()}  # the layout save_checkpoint writes
    raw = dcp.DefaultLoadPlanner(allow_partial_load=True)  # the tied head is stored once, as the embedding
    t_raw_load = timed(lambda: dcp.load(live, checkpoint_id=str(ckpt), planner=raw), args.repeats)
    t_gather_save = timed(
        lambda: (lambda sd: torch.save(sd, base / "gathered.pt") if rank == 0 else None)(get_full_state_dict(model)),
        args.repeats,
    )
    per_rank = sorted((p.name, p.stat().st_size) for p in ckpt.glob("*.distcp"))
    meta_bytes = (ckpt / ".metadata").stat().st_size

    t_tsave = t_tload = file_bytes = 0.0
    if rank == 0:
        target = base / "full.pt"

        def torch_save() -> None:
            with open(target, "wb") as f:
                torch.save(full_sd, f)
                f.flush()
                os.fsync(f.fileno())  # DCP fsyncs each file: same durability for the baseline

        t_tsave = timed(torch_save, args.repeats, collective=False)
        t_tload = timed(lambda: torch.load(target, weights_only=True), args.repeats, collective=False)
        file_bytes = target.stat().st_size
    dist.barrier()

    if rank == 0:
        report = render(args, world, cfg, model_bytes, load_avg, mem, per_rank, meta_bytes, file_bytes,
                        t_save, t_load, t_raw_load, t_gather_save, t_tsave, t_tload)  # fmt: skip
        print(report)
        if not args.no_write:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(report)
            print(f"wrote {RESULTS}")
        shutil.rmtree(base, ignore_errors=True)
    shutdown(force=True)


def mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def render(args, world, cfg, model_bytes, load_avg, mem, per_rank, meta_bytes, file_bytes,
           t_save, t_load, t_raw_load, t_gather_save, t_tsave, t_tload) -> str:  # fmt: skip
    n_params = model_bytes // 4
    argv = " ".join(sys.argv[1:])
    rows_files = "\n".join(f"| `{name}` | {mb(size)} | {size / model_bytes:.3f} |" for name, size in per_rank)
    return f"""# Checkpoint benchmark

Command: `python benchmarks/bench_checkpoint.py{" " + argv if argv else ""}` (relaunches itself with
`torchrun --standalone --nproc-per-node {world}`; gloo, CPU, `OMP_NUM_THREADS=1`).

- Date: {datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
- Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()};
  1-minute load average at start {load_avg:.1f} (the machine is shared: timings are indicative)
- torch {torch.__version__}, Python {platform.python_version()}
- Model: example GPT, vocab {cfg.vocab_size}, dim {cfg.dim}, {cfg.n_layers} blocks, tied embedding/head:
  {n_params / 1e6:.1f} M parameters, {mb(model_bytes)} of fp32 weights (buffers included, tied weight once);
  `fsdp(..., auto_wrap=True, shard_strat="FULL_SHARD")` at {world} ranks
- Checkpoints go to a local disk (temp dir); page cache warm after the first repetition;
  median of {args.repeats} repetitions.

## Time: sharded save/load at {world} ranks vs torch.save/torch.load on one process

| Operation | Time | Ratio to torch.save / torch.load |
|---|---|---|
| `save_checkpoint(path, model)` ({world} ranks, DCP, fsync, atomic rename) | {t_save * 1e3:.0f} ms | {t_save / t_tsave:.2f}x |
| `torch.save(full_sd)` + fsync (rank 0 alone) | {t_tsave * 1e3:.0f} ms | 1.00x |
| `get_full_state_dict` + `torch.save` (gather to rank 0, then save) | {t_gather_save * 1e3:.0f} ms | {t_gather_save / t_tsave:.2f}x |
| `load_checkpoint(path, model)` ({world} ranks: validate, read into scratch with CRC-32 checks, copy in) | {t_load * 1e3:.0f} ms | {t_load / t_tload:.2f}x |
| raw `dcp.load` into the live shards (no checks, for comparison) | {t_raw_load * 1e3:.0f} ms | {t_raw_load / t_tload:.2f}x |
| `torch.load(full.pt, weights_only=True)` (rank 0 alone) | {t_tload * 1e3:.0f} ms | 1.00x |

## Bytes written per rank

Model: {mb(model_bytes)}; the single `torch.save` file: {mb(file_bytes)}; DCP `.metadata`: {mb(meta_bytes)}.

| File | Size | Fraction of the model |
|---|---|---|
{rows_files}

## Peak memory of `get_full_state_dict(model, cpu_offload=True)` on rank 0

| Measure | Bytes above what was live before | Multiple of the model's bytes |
|---|---|---|
| Tensor storages (`MemTracker`: every allocation through the dispatcher, CPU included) | {mb(mem["tensor_peak"])} | {mem["tensor_peak"] / model_bytes:.2f}x |
| Result kept (the returned state dict) | {mb(mem["kept"])} | {mem["kept"] / model_bytes:.2f}x |
| Process peak RSS (`VmHWM` reset via `/proc/self/clear_refs`; the process's first gather) | {mb(mem["rss_delta"]) if mem["rss_delta"] >= 0 else "n/a"} | {f"{mem['rss_delta'] / model_bytes:.2f}x" if mem["rss_delta"] >= 0 else "n/a"} |

Tensors are all-gathered one at a time and kept on rank 0 only; on CPU the gathered tensor is the
kept one (no device-to-host copy), and the tied embedding/head is gathered once.

## Reading the numbers

- Here all ranks share {os.cpu_count()} cores and one disk, so writing shards in parallel cannot beat one
  process writing the same bytes; DCP adds planning collectives, one `torch.save` record per
  tensor and an fsync per file. What the sharded save buys is that no rank ever holds the full
  model (compare the gather + `torch.save` row) and that each rank writes 1/N of the bytes, which
  scales with ranks and nodes.
- `load_checkpoint` pays for its guarantees on top of a raw `dcp.load`: validation (collectives),
  reading into a scratch copy so a bad shard cannot leave the model half-loaded, and a CRC-32
  pass over every record (`torch.load` does not check them).
- The tied embedding/head is written once (under `tok_emb.weight`), so the ranks' files add up to
  the model's bytes.
"""


if __name__ == "__main__":
    main()

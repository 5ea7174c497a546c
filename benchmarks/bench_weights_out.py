"""Weights out: ``iter_full_weights`` vs ``get_full_state_dict`` vs per-tensor ``full_tensor()``, and the floor.

Every rank of a FULL_SHARD model (one unit per ``nn.Linear(2048, 2048)``, fp32) gets the full weights; the
caller drops each tensor at once (no consumer work, so no overlap to gain: the times are the gathering's
own). The all-gather floor moves the same bytes as the iterator (its buckets' sizes) in one flat
``all_gather_into_tensor`` per bucket into one buffer, with no packing or copying out. Peak memory: the
bytes each variant allocates on rank 0 while it runs (``MemTracker``, exact on CPU), beyond the model.

    python benchmarks/bench_weights_out.py                      # launches 2 ranks itself
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_weights_out.py
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from _common import MIB, Report, bench_parser, finite, fmt_mib, run_benchmark
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from zeta_fsdp import fsdp, get_full_state_dict, iter_full_weights

WIDTH = 2048  # one layer: 2048 x 2048 fp32 weight + bias, 16 MiB


def build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return fsdp(model, auto_wrap=True, TransformerBlock=nn.Linear, shard_strat="FULL_SHARD")


def variants(model: nn.Module, bucket_mb: float) -> dict[str, Callable[[], Any]]:
    def stream() -> None:
        for bucket in iter_full_weights(model, bucket_mb=bucket_mb):
            del bucket

    def per_tensor() -> None:
        for p in model.parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            del full

    plan = iter_full_weights(model, bucket_mb=bucket_mb)
    sizes = [(b.shards * b.segment_bytes, b.shards) for b in plan.buckets if b.gathers]
    plan.close()
    floor_buf = torch.empty(max(n for n, _ in sizes), dtype=torch.uint8)
    group = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh.get_group(0)

    def floor() -> None:
        rank = dist.get_rank(group)
        for n, shards in sizes:
            out = floor_buf[:n]
            dist.all_gather_into_tensor(out, out.narrow(0, rank * (n // shards), n // shards), group=group)

    return {
        f"iter_full_weights (bucket {bucket_mb:g} MiB)": stream,
        "get_full_state_dict (rank 0, CPU)": lambda: get_full_state_dict(model),
        "per-tensor full_tensor()": per_tensor,
        "all-gather floor (same buckets)": floor,
    }


def timed(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return finite(statistics.median(times))


def peak(fn: Callable[[], Any]) -> int:
    tracker = MemTracker()
    with tracker:
        fn()
    return int(tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).get("Total", 0))


def rank_main(args: Any) -> None:
    width = 256 if args.quick else WIDTH
    sizes = [1, 2, 4] if args.quick else [int(s) for s in args.layers.split(",")]
    bucket_mb = 0.5 if args.quick else args.bucket_mb
    reps = 1 if args.quick else args.reps
    rows, mem_rows, data = [], [], {}
    for layers in sizes:
        model = build(layers, width)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        runs = variants(model, bucket_mb)
        for fn in runs.values():
            fn()  # warm-up: first-touch allocations, gloo connections
        times = {name: timed(fn, reps) for name, fn in runs.items()}
        peaks = {name: peak(fn) for name, fn in runs.items() if "floor" not in name and "iter" not in name}
        stream = iter_full_weights(model, bucket_mb=bucket_mb)  # made outside: the tracker sees its iteration
        peaks = {f"iter_full_weights (bucket {bucket_mb:g} MiB)": peak(lambda s=stream: [None for _ in s]), **peaks}
        floor = times["all-gather floor (same buckets)"]
        key = f"{nbytes / 1e6:.1f} MB"
        data[key] = {"bytes": nbytes, "seconds": times, "peak_bytes_rank0": peaks}
        for name, t in times.items():
            rows.append([key, f"`{name}`", f"{t * 1e3:.0f}", f"{nbytes / t / MIB:.0f}", f"{t / floor:.2f}x"])
        mem_rows.append([key] + [fmt_mib(peaks[name]) for name in peaks])
        del model, runs
    report = Report(
        name="weights_out",
        title="Weights out benchmark",
        command=args.command,
        what=f"The full weights of a FULL_SHARD model at {dist.get_world_size()} ranks (gloo, CPU), every rank; "
        f"median of {reps} runs after a warm-up. `iter_full_weights` vs `get_full_state_dict` (one tensor at a "
        "time, kept on rank 0) vs per-tensor `full_tensor()`, and the all-gather floor: the iterator's bucket "
        "bytes in one flat all-gather each, nothing packed or copied out.",
        data=data,
    )
    report.table("Time", ["model (fp32)", "variant", "ms", "MiB/s", "vs floor"], rows)
    report.table(
        "Peak memory allocated on rank 0 while running (MemTracker, CPU, beyond the model)",
        ["model (fp32)"] + [f"`{n}`" for n in list(data.values())[0]["peak_bytes_rank0"]],
        mem_rows,
    )
    report.notes.append(
        "The iterator's peak is its one all-gather buffer plus one bucket of full tensors: flat in the model's size "
        "(at most 2 buckets + the largest tensor). get_full_state_dict keeps the whole model on rank 0; its figure "
        "also counts this rank's shards (MemTracker counts the views its state dict makes of them as new tensors)."
    )
    report.publish(args.out_dir)


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", default="6,24,96", help="model sizes, in 16 MiB layers (100 MB, 400 MB, 1.6 GB)")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--reps", type=int, default=3)
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()

"""Weights out: ``iter_full_weights`` vs ``get_full_state_dict`` vs per-tensor ``full_tensor()``, and the floor.

Every rank of a FULL_SHARD model (one unit per ``nn.Linear(2048, 2048)``, fp32) gets the full weights; the
caller drops each tensor at once (no consumer work, so no overlap to gain: the times are the gathering's
own). The all-gather floor moves the same bytes as the iterator (its buckets' sizes, fp32 as the model)
in one flat ``all_gather_into_tensor`` per bucket, with no packing or copying out in Python, twice: into
one reused buffer (the floor the goal is measured against), and into a new buffer per bucket as the
iterator must allocate (its yielded tensors are the caller's). Rounds are interleaved (one round runs every
variant once); each variant's median, and its spread over the rounds. Peak memory: the bytes each variant
allocates on rank 0 while it runs (``MemTracker``, exact on CPU), beyond the model.

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

from zeta_fsdp import fsdp, get_full_state_dict
from zeta_fsdp.torch_compat import all_gather_single
from zeta_fsdp.weights_out import broadcasts, iter_full_weights

WIDTH = 2048  # one layer: 2048 x 2048 fp32 weight + bias, 16 MiB


def build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return fsdp(model, auto_wrap=True, TransformerBlock=nn.Linear, shard_strat="FULL_SHARD")


def variants(model: nn.Module, bucket_mbs: list[float]) -> dict[str, Callable[[], Any]]:
    def stream(mb: float) -> Callable[[], None]:
        def run() -> None:
            for bucket in iter_full_weights(model, bucket_mb=mb):
                del bucket  # dropped before the next is asked for (a plain loop variable would hold it)

        return run

    def per_tensor() -> None:
        for p in model.parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            del full

    out: dict[str, Callable[[], Any]] = {f"iter_full_weights (bucket {mb:g} MiB)": stream(mb) for mb in bucket_mbs}
    out["get_full_state_dict (rank 0, CPU)"] = lambda: get_full_state_dict(model)
    out["per-tensor full_tensor()"] = per_tensor
    out.update({f"{FLOOR} (bucket {mb:g} MiB)": floor(model, mb, reuse=True) for mb in bucket_mbs})
    out.update({f"{FLOOR_NEW} (bucket {mb:g} MiB)": floor(model, mb, reuse=False) for mb in bucket_mbs})
    return out


FLOOR = "all-gather floor"
FLOOR_NEW = "all-gather floor, new output per bucket"


def floor(model: nn.Module, bucket_mb: float, reuse: bool) -> Callable[[], None]:
    """The iterator's bucket bytes, one flat all-gather each (nothing packed or unpacked in Python), into one
    reused buffer or, with ``reuse=False``, into a new buffer per bucket (what the iterator yields views of)."""
    plan = iter_full_weights(model, bucket_mb=bucket_mb)
    sizes = [(b.shards * b.segment_bytes, b.shards) for b in plan.buckets if b.gathers]
    plan.close()
    buf = torch.empty(max(n for n, _ in sizes), dtype=torch.uint8)
    group = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh.get_group(0)

    def run() -> None:
        rank = dist.get_rank(group)
        for n, shards in sizes:
            out = buf[:n] if reuse else torch.empty(n, dtype=torch.uint8)
            all_gather_single(out, out.narrow(0, rank * (n // shards), n // shards), group=group)
            del out

    return run


def timed(runs: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of each variant in each round; the rounds are interleaved (one round runs every variant once), so
    a burst of load from other jobs on a shared machine hits every variant alike rather than one of them."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(finite(time.perf_counter() - start))
    return times


def time_rows(key: str, nbytes: int, rounds: dict[str, list[float]], bucket_mbs: list[float]) -> list[list[str]]:
    """One table row per variant: median ms, its spread over the rounds, MiB/s, and the ratio to both floors of
    the same bucket size (a variant without buckets: to the first bucket size's floors)."""
    med = {name: statistics.median(t) for name, t in rounds.items()}
    rows = []
    for name, t in rounds.items():
        mb = next((m for m in bucket_mbs if f"(bucket {m:g} MiB)" in name), bucket_mbs[0])
        floors = [med[f"{which} (bucket {mb:g} MiB)"] for which in (FLOOR, FLOOR_NEW)]
        spread = f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f} (±{(max(t) - min(t)) / 2 / med[name]:.0%})"
        ratios = " / ".join(f"{med[name] / f:.2f}x" for f in floors)
        rows.append([key, f"`{name}`", f"{med[name] * 1e3:.0f}", spread, f"{nbytes / med[name] / MIB:.0f}", ratios])
    return rows


def threshold_rows(kibs: list[int], reps: int) -> list[list[str]]:
    """Where broadcasts start to pay (``broadcasts.BROADCAST_MIN_BYTES``): ~48 MiB of square weights of each
    size, 24 MiB buckets, every tensor by broadcasts vs every tensor in the buckets' coalesced all-gathers."""
    rows = []
    for kib in kibs:
        n = int((kib * 1024 / 4) ** 0.5)
        torch.manual_seed(0)
        layers = [nn.Linear(n, n, bias=False) for _ in range(max(1, (48 << 20) // (n * n * 4)))]
        model = fsdp(nn.Sequential(*layers), shard_strat="FULL_SHARD")

        def run(threshold: int, model: nn.Module = model) -> Callable[[], None]:
            def go() -> None:
                saved, broadcasts.BROADCAST_MIN_BYTES = broadcasts.BROADCAST_MIN_BYTES, threshold
                try:
                    drain(iter_full_weights(model, bucket_mb=24))
                finally:
                    broadcasts.BROADCAST_MIN_BYTES = saved

            return go

        runs = {"broadcasts": run(0), "coalesced": run(1 << 60)}
        for fn in runs.values():
            fn()
        med = {k: statistics.median(t) for k, t in timed(runs, reps).items()}
        ratio = med["broadcasts"] / med["coalesced"]
        rows.append(
            [f"{n * n * 4 / 1024:.0f} KiB x {len(layers)}", *(f"{t * 1e3:.0f}" for t in med.values()), f"{ratio:.2f}x"]
        )
    return rows


def drain(stream: Any) -> None:
    for bucket in stream:
        del bucket


def peak(fn: Callable[[], Any], model: nn.Module) -> int:
    """Bytes allocated beyond what is live at the start; the model's own storage is tracked up front, so a
    view of a shard (what gets sent as it is) is not counted as new memory."""
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot("current").get(torch.device("cpu"), {}).get("Total", 0)
        fn()
    return int(tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).get("Total", 0) - before)


def rank_main(args: Any) -> None:
    width = 256 if args.quick else WIDTH
    sizes = [1, 2, 4] if args.quick else [int(s) for s in args.layers.split(",")]
    bucket_mbs = [0.5] if args.quick else [float(b) for b in args.bucket_mb.split(",")]
    reps = 1 if args.quick else args.reps
    rows, mem_rows, data = [], [], {}
    for layers in sizes:
        model = build(layers, width)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        runs = variants(model, bucket_mbs)
        for fn in runs.values():
            fn()  # warm-up: first-touch allocations, gloo connections
        rounds = timed(runs, reps)
        times = {name: statistics.median(t) for name, t in rounds.items()}
        peaks = {name: peak(fn, model) for name, fn in runs.items() if FLOOR not in name and "iter" not in name}
        for mb in reversed(bucket_mbs):  # streams made outside the tracker: it sees their iteration only
            stream = iter_full_weights(model, bucket_mb=mb)
            peaks = {f"iter_full_weights (bucket {mb:g} MiB)": peak(lambda s=stream: drain(s), model), **peaks}
        key = f"{nbytes / 1e6:.1f} MB"
        data[key] = {"bytes": nbytes, "seconds": times, "rounds": rounds, "peak_bytes_rank0": peaks}
        rows += time_rows(key, nbytes, rounds, bucket_mbs)
        mem_rows.append([key] + [fmt_mib(peaks[name]) for name in peaks])
        del model, runs
    report = Report(
        name="weights_out",
        title="Weights out benchmark",
        command=args.command,
        what=f"The full weights of a FULL_SHARD model at {dist.get_world_size()} ranks (gloo, CPU), every rank; "
        f"median of {reps} rounds after a warm-up (interleaved: each round runs every variant once). "
        "`iter_full_weights` vs `get_full_state_dict` (one tensor at a time, kept on rank 0) vs per-tensor "
        "`full_tensor()`, and the all-gather floor: the iterator's bucket bytes in one flat all-gather each, "
        "nothing packed or copied out in Python, into one reused buffer, and into a new buffer per bucket "
        "(as the iterator must allocate: its tensors are the caller's).",
        data=data,
    )
    floors_head = f"vs floor / vs floor with new outputs (same bucket; else {bucket_mbs[0]:g} MiB)"
    head = ["model (fp32)", "variant", "ms (median)", "min-max ms (± half-range)", "MiB/s", floors_head]
    report.table("Time", head, rows)
    if args.tensor_kib and not args.quick:
        report.table(
            "Broadcast threshold: every tensor by broadcasts vs in the coalesced all-gather (ms, median)",
            ["tensors (fp32)", "broadcasts", "coalesced all-gather", "ratio"],
            threshold_rows([int(k) for k in args.tensor_kib.split(",")], reps),
        )
    report.table(
        "Peak memory allocated on rank 0 while running (MemTracker, CPU, beyond the model)",
        ["model (fp32)"] + [f"`{n}`" for n in list(data.values())[0]["peak_bytes_rank0"]],
        mem_rows,
    )
    report.notes.append(
        "The iterator's peak is the bucket in flight plus the bucket the caller holds, flat in the model's size (at "
        "most 2 buckets + the largest tensor), with the caller dropping each bucket before asking for the next "
        "(`del bucket` at the end of the loop body; a plain loop variable keeps one bucket more alive). Gloo's own "
        "staging for a collective (allocated in C++, one bucket) is not seen by MemTracker, for any variant. "
        "get_full_state_dict keeps the whole model on rank 0. The model's own shards are tracked up front "
        "(`track_external`), so a view of a shard is not counted as new memory."
    )
    report.notes += NOTES
    report.publish(args.out_dir)


NOTES = [
    "The floor is what the goal names: the same bytes in one flat `all_gather_into_tensor` per bucket. On gloo "
    "that collective receives into a staging buffer of its own (a new allocation per call) and copies every "
    "gathered byte out of it into the output (`ProcessGroupGloo` allgather), so the floor pays one bucket of "
    "copy-out per bucket. The iterator moves each tensor of 2 MiB or more by in-place broadcasts instead (each "
    "rank's rows from that rank straight into the yielded tensor; it copies only its own rows), which is how it "
    "can run under its floor. `new output per bucket` is the floor with the allocation the iterator must make "
    "(its tensors are the caller's, never reused).",
    "Buckets of 32 MiB or more: glibc serves an allocation that large as fresh pages from the kernel every time "
    "(page faults, zeroing), gloo's staging and the iterator's own output buffer alike; hence the CPU default of "
    "24 MiB.",
]


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", default="6,24,96", help="model sizes, in 16 MiB layers (100 MB, 400 MB, 1.6 GB)")
    parser.add_argument("--bucket-mb", default="24,256", help="bucket sizes, comma-separated (the first: CPU default)")
    parser.add_argument("--reps", type=int, default=9, help="interleaved rounds")
    parser.add_argument("--tensor-kib", default="64,256,512,1024,2048,4096", help="tensor sizes of the threshold table")
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()

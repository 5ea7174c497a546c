"""One start on every rank: what ``fsdp()``'s sync of rank 0's weights (``zeta_fsdp.start``) costs.

Before sharding, ``fsdp()`` fingerprints every parameter and buffer (integer sums of their bits), all-gathers
the fingerprints once per mesh dimension and broadcasts from the first rank only the tensors that differ.
Measured at 2 CPU ranks (gloo) on a 1-D mesh, for the tests' ``small()`` GPT and bigger ones:
  * ranks agree (every rank seeded alike: the common case): collectives, wall time;
  * ranks differ (``torch.manual_seed(1337 + rank)`` before building, nanoGPT's habit): the same, and
    the bytes broadcast;
  * the fingerprints alone (local compute, no collective), and the whole ``fsdp()`` FULL_SHARD call
    (sync included) for scale.
Wall times are the slowest rank's, the median over repetitions. Results: ``results/one_start.md``.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_one_start.py
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from _common import (
    MIB,
    QUICK_MODEL,
    GPTConfig,
    Report,
    bench_parser,
    fmt_collectives,
    gather_max,
    median,
    run_benchmark,
    timed_max,
)

from zeta_fsdp import fsdp
from zeta_fsdp.distributed import init_mesh
from zeta_fsdp.measure import collectives_per_step
from zeta_fsdp.models.gpt import GPT, Block
from zeta_fsdp.start import start_from_first_rank, tensor_fingerprint

MODELS = {
    "small() (tests' GPT)": GPTConfig(),
    "GPT dim 256, 8 layers, vocab 8192": GPTConfig(vocab_size=8192, dim=256, n_heads=8, n_layers=8, max_seq_len=256),
    "GPT-2-small shape, vocab 32000": GPTConfig(vocab_size=32000, dim=768, n_heads=12, n_layers=12, max_seq_len=1024),
}
QUICK_MODELS = {"small() (tests' GPT)": GPTConfig(), "quick GPT": QUICK_MODEL.config}


def build(config: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def tensors_of(model: torch.nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def median_max_seconds(fn: Callable[[], Any], reps: int, before: Callable[[], None] = lambda: None) -> float:
    """Median over ``reps`` of the slowest rank's wall time of ``fn()`` (``before()`` untimed, each rep)."""
    times = []
    for _ in range(reps):
        before()
        times.append(timed_max(fn))
    return median(times)


def local_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median local wall time of ``fn()`` (no collective inside), max over ranks."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return gather_max([median(times)])[0]


def measure(name: str, config: GPTConfig, reps: int, wrap_reps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = init_mesh((dist.get_world_size(),), torch.device("cpu"))
    build_s = local_seconds(lambda: build(config, seed=0), max(1, reps // 3))  # for scale: what a script pays first
    model = build(config, seed=0)  # every rank alike
    tensors = tensors_of(model)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    params = sum(p.numel() for p in model.parameters())

    def sync() -> Any:
        return start_from_first_rank(model, mesh)

    agree_comms = collectives_per_step(sync)
    agree_s = median_max_seconds(sync, reps)
    fingerprint_s = local_seconds(lambda: [tensor_fingerprint(t) for t in tensors], reps)

    per_rank = build(config, seed=1337 + rank).state_dict()  # nanoGPT: a seed per rank
    per_rank = {k: v.clone() for k, v in per_rank.items()}

    def diverge() -> None:
        model.load_state_dict(per_rank)

    diverge()
    differ_comms = collectives_per_step(sync)
    diverge()
    replaced = sync().replaced
    differ_s = median_max_seconds(sync, reps, before=diverge)
    tensors_by_name = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    broadcast_bytes = sum(tensors_by_name[n].numel() * tensors_by_name[n].element_size() for n in replaced)
    broadcast_bytes = int(gather_max([float(broadcast_bytes)])[0])  # rank 0 replaces nothing

    model.load_state_dict(build(config, seed=0).state_dict())
    wraps = []
    for _ in range(wrap_reps):
        fresh = copy.deepcopy(model)
        wraps.append(
            timed_max(lambda m=fresh: fsdp(m, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block))
        )
        del fresh
    return {
        "model": name,
        "params": params,
        "tensors": len(tensors),
        "bytes": nbytes,
        "agree": {"collectives": agree_comms, "seconds": agree_s},
        "differ": {"collectives": differ_comms, "seconds": differ_s, "broadcast_bytes": broadcast_bytes},
        "fingerprint_seconds": fingerprint_s,
        "fsdp_full_shard_seconds": median(wraps),
        "build_seconds": build_s,
    }


def rank_main(args: argparse.Namespace) -> None:
    report = Report(
        name="one_start",
        title="One start on every rank: the cost of syncing rank 0's weights in fsdp()",
        command=args.command,
        what=(
            f"`zeta_fsdp.start.start_from_first_rank` on an unwrapped GPT, {dist.get_world_size()} CPU ranks "
            "(gloo), 1-D mesh, fp32. Ranks agree: every rank built the model from seed 0. Ranks differ: "
            "`torch.manual_seed(1337 + rank)` before building (every randomly initialised tensor differs)."
        ),
    )
    models = QUICK_MODELS if args.quick else MODELS
    reps, wrap_reps = (2, 1) if args.quick else (args.reps, args.wrap_reps)
    results = [measure(name, config, reps, wrap_reps) for name, config in models.items()]
    rows = []
    for r in results:
        rows.append(
            [
                r["model"],
                f"{r['params'] / 1e6:.2f} M",
                f"{r['tensors']}",
                f"{r['bytes'] / MIB:.1f}",
                fmt_collectives(r["agree"]["collectives"]),
                f"{r['agree']['seconds'] * 1e3:.1f}",
                fmt_collectives(r["differ"]["collectives"]),
                f"{r['differ']['broadcast_bytes'] / MIB:.1f}",
                f"{r['differ']['seconds'] * 1e3:.1f}",
                f"{r['fingerprint_seconds'] * 1e3:.1f} ({r['bytes'] / max(r['fingerprint_seconds'], 1e-9) / 1e9:.2f} GB/s)",
                f"{r['fsdp_full_shard_seconds'] * 1e3:.1f}",
                f"{100 * r['agree']['seconds'] / r['fsdp_full_shard_seconds']:.0f} %",
                f"{r['build_seconds'] * 1e3:.0f}",
            ]
        )
    headers = ["model", "parameters", "tensors", "MiB (params + buffers)"]
    headers += ["ranks agree: collectives", "ranks agree: ms", "ranks differ: collectives"]
    headers += ["ranks differ: MiB broadcast", "ranks differ: ms", "fingerprints alone: ms"]
    headers += ["fsdp() FULL_SHARD: ms (sync included)", "sync (agree) / fsdp()", "building the model: ms"]
    report.table("Cost per call, slowest rank, median over repetitions", headers, rows)
    report.notes += [
        f"{reps} repetitions per figure ({wrap_reps} for the fsdp() call); collectives counted with CommDebugMode "
        "over one call. `_allgather_base_` is the fingerprint all-gather (5 int64 per tensor); `broadcast_` the "
        "buckets of differing tensors (bytes, at most 64 MiB each).",
        "On a 2-D (replicate, shard) mesh there is one all-gather per mesh dimension of size > 1; in a "
        "one-process job none. A meta model is synced once more after materialization (its unsharded tensors: "
        "buffers, whole 0-dim parameters), one all-gather per mesh dimension.",
        "Wall times on a shared 2-core machine (see the load average): read the orders of magnitude; the "
        "collective counts are exact.",
        "Ranks differ: the broadcast dominates; it is what DDP pays at every start (it broadcasts every tensor "
        "unconditionally). Building the model (`GPT(config)`, its init on one thread) is shown for scale.",
        "Under NO_SHARD on DDP's engine, engines/replicate.py still broadcasts every parameter before DDP's "
        "first forward (one broadcast per dtype), which this sync makes redundant.",
    ]
    report.data.update({"results": results, "reps": reps})
    report.publish(args.out_dir)


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="repetitions per timed figure")
    parser.add_argument("--wrap-reps", type=int, default=3, help="repetitions of the fsdp() call")
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()

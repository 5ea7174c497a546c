"""Gradient accumulation under HYBRID_SHARD: ``no_sync(defer="all")`` vs ``defer="all_reduce"`` vs syncing.

One run at 4 CPU ranks (gloo), a 2x2 ``(replicas, shard)`` mesh, K=4 micro-batches per optimizer
step, three loops on the same model and data:

* ``sync every micro-batch``: no ``no_sync``; each micro-batch reduce-scatters and all-reduces.
* ``no_sync(defer="all")``: the first K-1 micro-batches issue no gradient collective and keep
  unsharded gradients; the last reduces everything.
* ``no_sync(defer="all_reduce")``: every micro-batch reduce-scatters within its replica (sharded
  gradients kept); only the cross-replica all-reduce waits for the last micro-batch.

Measured: gradient collectives per optimizer step (``CommDebugMode``, phase by phase), peak
memory by category over one optimizer step (``FSDPMemTracker``, worst rank) next to what
``memory_report(model, micro_batches=K)`` predicts is held between micro-batches, and the
step-time ratio (variants interleaved block by block). On one CPU host every "link" is the same
loopback, so the time saved by not all-reducing across slow inter-node links does not show here:
the step-time ratio only says what the extra reduce-scatters cost on this machine.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/bench_accumulation.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from _common import (  # noqa: E402
    Report,
    add_timing_args,
    bench_parser,
    fmt_mib,
    gather_max,
    interleaved_block_times,
    is_rank0,
    run_benchmark,
    timing_note,
    timing_table,
)

from zeta_fsdp import fsdp  # noqa: E402
from zeta_fsdp.measure import collectives_per_step, restore_fsdp_hooks  # noqa: E402
from zeta_fsdp.training import memory_report, no_sync  # noqa: E402

K = 4


class MLPBlock(nn.Module):
    """A residual MLP block: one module per FSDP unit (see ``Net``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Residual MLP blocks and an output layer on the root: every FSDP unit is ONE module.

    Not the demo GPT: its ``[tok_emb, pos_emb, norm, head]`` unit spans several modules, and
    ``FSDPMemTracker`` (torch 2.13) re-registers such a unit's hooks per module, so FSDP2 reduces
    it in pieces; with the all-reduce deferred the pieces do not match the sharded sum FSDP2 keeps
    and the tracked backward fails (``partial_reduce_output += reduce_output``: 32 vs 1824
    elements). Untracked, the GPT accumulates exactly (tests/training_cases.py).
    """

    def __init__(self, dim: int, n_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(n_blocks))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


# (dim, blocks, rows per micro-batch per rank): 2.2 M parameters; --quick: tiny
BENCH_SHAPE, QUICK_SHAPE = (256, 4, 64), (32, 2, 4)
# variant name -> no_sync's defer for the first K-1 micro-batches (None: no no_sync)
VARIANTS: dict[str, Optional[str]] = {
    "sync every micro-batch": None,
    'no_sync(defer="all")': "all",
    'no_sync(defer="all_reduce")': "all_reduce",
}
COST_KEY = {None: "sync", "all": "all", "all_reduce": "all_reduce"}
CATEGORIES = ("Sharded Grad", "Unsharded Grad", "Total")


def _wrap(shape: tuple[int, int, int]) -> nn.Module:
    torch.manual_seed(0)
    net = Net(shape[0], shape[1])
    return fsdp(net, auto_wrap=True, shard_strat="HYBRID_SHARD", replicate_size=2, TransformerBlock=MLPBlock)


def accumulation_phases(
    shape: tuple[int, int, int], model: nn.Module, defer: Optional[str]
) -> tuple[list[Callable[[], Any]], torch.optim.Optimizer]:
    """One optimizer step as phases: K micro-batches (the first K-1 inside ``no_sync(defer=...)``
    unless ``defer`` is None), then the optimizer step. Kept apart so collectives can be counted
    phase by phase (CommDebugMode in torch 2.13 loses its place across several passes)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    phases: list[Callable[[], Any]] = []
    g = torch.Generator().manual_seed(10 + dist.get_rank())  # different data per rank
    for k in range(K):
        x = torch.randn(shape[2], shape[0], generator=g)

        def micro_step(x=x, quiet=defer is not None and k < K - 1) -> None:
            with no_sync(model, defer=defer) if quiet else contextlib.nullcontext():
                (model(x).pow(2).mean() / K).backward()

        phases.append(micro_step)

    def optimizer_step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    phases.append(optimizer_step)
    return phases, opt


def _snapshot(tracker: Any, kind: str) -> dict[str, int]:
    snap = next(iter(tracker.get_tracker_snapshot(kind).values()))
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def tracked_memory(model: nn.Module, optimizer: torch.optim.Optimizer, phases: list[Callable[[], Any]]) -> dict:
    """``FSDPMemTracker`` (exact on CPU: it counts tensor storages by category) over one optimizer
    step, after an untracked warm-up step: ``"between"``, the snapshot after the first K-1
    micro-batches (what accumulation holds), and ``"peak"``, the step's peak (categories at the
    moment the total peaks)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    _run_all(phases)()
    with restore_fsdp_hooks(model):
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            for phase in phases[: K - 1]:
                phase()
            # What is held, not what is in flight: gloo's worker thread may still reference the
            # last reduce-scatter's input (a unit's unsharded gradient) for a moment after the
            # collective returned; wait that out, and drop anything only a reference cycle keeps.
            time.sleep(0.5)
            gc.collect()
            between = _snapshot(tracker, "current")
            for phase in phases[K - 1 :]:
                phase()
    return {"between": between, "peak": _snapshot(tracker, "peak")}


def _run_all(phases: list[Callable[[], Any]]) -> Callable[[], None]:
    def step() -> None:
        for phase in phases:
            phase()

    return step


def _counts(phases: list[Callable[[], Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for phase in phases:
        for op, n in collectives_per_step(phase).items():
            total[op.strip("_")] = total.get(op.strip("_"), 0) + n
    return dict(sorted(total.items()))


# FSDPMemTracker's categories for gradients: sharded .grad, unsharded gradients, and "Temp", where
# it files the sharded sum FSDP2 keeps while the all-reduce is deferred (not a .grad yet).
GRAD_CATEGORIES = ("Sharded Grad", "Unsharded Grad", "Temp")


def rank_main(args: argparse.Namespace) -> None:
    shape = QUICK_SHAPE if args.quick else BENCH_SHAPE
    blocks, per_block = (2, 1) if args.quick else (args.blocks, args.steps_per_block)
    warmup = 1 if args.quick else 2

    models = {name: _wrap(shape) for name in VARIANTS}
    built = {name: accumulation_phases(shape, models[name], defer) for name, defer in VARIANTS.items()}
    phases = {name: p for name, (p, _) in built.items()}
    predicted = memory_report(next(iter(models.values())), micro_batches=K)["accumulation"]
    counts = {name: _counts(p) for name, p in phases.items()}
    memory: dict[str, dict[str, int]] = {}
    for name, (p, opt) in built.items():
        tracked = tracked_memory(models[name], opt, p)
        figures = [sum(tracked["between"].get(c, 0) for c in GRAD_CATEGORIES), tracked["between"]["Total"]]
        figures.append(tracked["peak"]["Total"])
        worst = gather_max([float(f) for f in figures])  # ranks hold equal shards: they should agree
        best = [-v for v in gather_max([-float(f) for f in figures])]
        keys = ("grads_between", "total_between", "peak_total")
        memory[name] = {k: int(v) for k, v in zip(keys, worst)}
        memory[name].update({f"{k}_best_rank": int(v) for k, v in zip(keys, best)})
    steps = {name: _run_all(p) for name, p in phases.items()}
    times = interleaved_block_times(steps, blocks=blocks, steps_per_block=per_block, warmup=warmup)
    headers, rows, timing = timing_table(times, ["sync every micro-batch", 'no_sync(defer="all")'])

    n_params = sum(p.numel() for p in Net(shape[0], shape[1]).parameters())
    report = Report(
        name="accumulation",
        title='Gradient accumulation under HYBRID_SHARD: no_sync(defer="all") vs defer="all_reduce" vs syncing',
        command=args.command,
        what=(
            f"Same model, same data, same run, {dist.get_world_size()} CPU ranks (gloo), HYBRID_SHARD on a "
            f"2x2 (replicas, shard) mesh, fp32, AdamW, K={K} micro-batches per optimizer step. Model: "
            f"{shape[1]} residual MLP blocks of dim {shape[0]} + an output layer ({n_params:,} parameters, "
            f"{shape[1] + 1} FSDP units), {shape[2]} rows per micro-batch per rank."
        ),
    )
    ops = sorted({op for c in counts.values() for op in c})
    report.table(
        f"Gradient collectives per optimizer step, K={K} (CommDebugMode; predicted: memory_report)",
        ["variant", *ops, "predicted reduce-scatters", "predicted all-reduces"],
        [
            [
                name,
                *(str(counts[name].get(op, 0)) for op in ops),
                str(predicted[COST_KEY[d]].reduce_scatters),
                str(predicted[COST_KEY[d]].all_reduces),
            ]
            for name, d in VARIANTS.items()
        ],
    )
    sync = memory["sync every micro-batch"]
    report.table(
        f"Memory per rank (FSDPMemTracker): held after {K - 1} of {K} micro-batches, and the step's peak (worst rank)",
        [
            "variant",
            "grads held (memory_report)",
            "grads held (measured, best rank)",
            "grads held (measured, worst rank)",
            "vs sync (worst)",
            "total held",
            "vs sync",
            "peak total",
            "vs sync",
        ],
        [
            [
                name,
                fmt_mib(predicted[COST_KEY[d]].grad_bytes),
                fmt_mib(memory[name]["grads_between_best_rank"]),
                fmt_mib(memory[name]["grads_between"]),
                f"{memory[name]['grads_between'] / sync['grads_between']:.3f}",
                fmt_mib(memory[name]["total_between"]),
                f"{memory[name]['total_between'] / sync['total_between']:.3f}",
                fmt_mib(memory[name]["peak_total"]),
                f"{memory[name]['peak_total'] / sync['peak_total']:.3f}",
            ]
            for name, d in VARIANTS.items()
        ],
    )
    report.table(f"Step time per optimizer step (K={K} micro-batches)", headers, rows)
    report.notes.append(timing_note(blocks, per_block))
    report.notes.append(
        "Grads held (measured) = FSDPMemTracker's Sharded Grad + Unsharded Grad + Temp after the first K-1 "
        'micro-batches; the tracker files the sharded sum FSDP2 keeps under defer="all_reduce" (not a .grad '
        "until the all-reduce) as Temp. Total held adds the sharded parameters and AdamW state every variant has. "
        "The snapshot is taken 0.5 s after the last micro-batch (and a gc.collect()): without that wait, one rank in "
        'about half of the runs showed one more block-sized Temp buffer under defer="all_reduce" (the size of a '
        "unit's unsharded gradient, i.e. its reduce-scatter input), gone after the wait: in flight, not held."
    )
    report.notes.append(
        "One CPU host: every link is the same loopback, so the time a real job saves by not all-reducing "
        "across slow inter-node links cannot show here; the step-time ratios say what the extra (K-1 per unit) "
        'reduce-scatters of defer="all_reduce" cost on this machine.'
    )
    report.data.update(
        {
            "model": report.what,
            "k": K,
            "collectives": counts,
            "predicted": {name: vars(predicted[COST_KEY[d]]) for name, d in VARIANTS.items()},
            "memory_bytes": memory,
            "timing": timing,
        }
    )
    if is_rank0():
        path = report.write(args.out_dir)
        print(report.markdown())
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__.splitlines()[0], default_nproc=4)
    add_timing_args(parser, blocks=20, steps_per_block=1)
    run_benchmark(rank_main, parser, argv)


if __name__ == "__main__":
    main()

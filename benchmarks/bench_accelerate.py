"""fsdp() vs accelerate's FSDP2 plugin on the same model: wrap time, step time, peak memory.

accelerate is a benchmark-only extra: without it this script prints one line and exits 0.
Both sides shard the same GPT (FULL_SHARD, fp32, per-block units) at 2 CPU ranks (gloo):
  * ``fsdp()``: ``fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)``;
  * ``accelerate``: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
    auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
    reshard_after_forward=True))`` then ``accelerator.prepare(model, optimizer)``.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_accelerate.py
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    BENCH_MODEL,
    GPT,
    QUICK_MODEL,
    Block,
    Report,
    add_timing_args,
    bench_parser,
    build_model,
    finite,
    fmt_collectives,
    fmt_mib,
    gather_max,
    interleaved_block_times,
    make_batch,
    median,
    run_benchmark,
    timed_max,
    timing_note,
    timing_table,
    train_step,
)

from zeta_fsdp import fsdp
from zeta_fsdp.measure import collectives_per_step, peak_memory_by_category

SKIP_MESSAGE = "bench_accelerate: skipped: accelerate is not installed (benchmark-only extra: pip install accelerate)"

# Why accelerate's FSDP2 path does not run on CPU as configured (accelerate 1.x, state.py):
CPU_REASON = (
    "accelerate only switches to DistributedType.FSDP when the job's distributed type is a multi-accelerator "
    "one (MULTI_GPU/NPU/XPU/HPU/MLU/MUSA/SDAA/NEURON); a CPU/gloo job is MULTI_CPU, so the fsdp_plugin is "
    "silently ignored and prepare() wraps the model in DistributedDataParallel instead."
)


class HFStyleGPT(GPT):
    """The example GPT plus the two accessors accelerate looks for (``get_input/output_embeddings``).

    With them accelerate puts the tied embedding/head (and the final norm) in one unit, its best
    case; without them the tied weight would stay in the root unit. Parameters are unchanged.
    """

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.tok_emb

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def make_accelerator(report: Report) -> tuple[Any, Any]:
    """An Accelerator with the FSDP2 plugin, and the plugin (on CPU its FSDP path must be forced)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        reshard_after_forward=True,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    if accelerator.distributed_type != DistributedType.FSDP:
        report.notes.append(
            f"accelerate on CPU (distributed_type here: {accelerator.distributed_type}): {CPU_REASON} The benchmark "
            "sets `accelerator.state.distributed_type = DistributedType.FSDP` and `state.fsdp_plugin = plugin` "
            "before each prepare() (AcceleratorState re-copies MULTI_CPU from PartialState whenever it is "
            "re-instantiated), so prepare() runs accelerate's real FSDP2 path (`_prepare_fsdp2` -> "
            "`fsdp2_prepare_model`); on a GPU job no override is needed."
        )
    return accelerator, plugin


def prepare_fsdp2(accelerator: Any, plugin: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """``accelerator.prepare(model, optimizer)`` on accelerate's FSDP2 path, checked."""
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule

    if accelerator.distributed_type != DistributedType.FSDP:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    model, optimizer = accelerator.prepare(model, optimizer)
    if not isinstance(model, FSDPModule):
        raise RuntimeError(f"accelerate did not take its FSDP2 path: prepare() returned {type(model).__name__}")
    return model, optimizer


def unit_names(model: torch.nn.Module) -> str:
    """The FSDP units (one per ``fully_shard`` call), e.g. ``[norm, tok_emb, head]``, root last."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    units, seen = [], set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                group = [names[id(x)] for x in state._modules]
                units.append(group[0] if len(group) == 1 else "[" + ", ".join(group) + "]")
    return ", ".join(units[1:] + units[:1])  # modules() yields the root first; list it last


def rank_main(args: argparse.Namespace) -> None:
    import accelerate

    report = Report(
        name="accelerate",
        title="fsdp() vs accelerate's FSDP2 plugin",
        command=args.command,
        what=f"Same model, same run, {dist.get_world_size()} CPU ranks (gloo), FULL_SHARD, fp32, AdamW. "
        f"accelerate {accelerate.__version__}.",
    )
    accelerator, plugin = make_accelerator(report)
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    base = build_model(spec, model_cls=HFStyleGPT)

    def wrap_fsdp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = fsdp(copy.deepcopy(base), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def wrap_accelerate() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)  # accelerate's order: optimizer first, then prepare() both
        return prepare_fsdp2(accelerator, plugin, model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    wraps = {"fsdp()": wrap_fsdp, "accelerate": wrap_accelerate}
    wrap_s: dict[str, list[float]] = {k: [] for k in wraps}
    for fn in wraps.values():  # untimed: one-time costs (lazy imports, first mesh) would hit whoever goes first
        fn()
        accelerator.free_memory()
    for rep in range(args.wrap_reps):
        for name in list(wraps) if rep % 2 == 0 else reversed(list(wraps)):
            wrap_s[name].append(timed_max(wraps[name]))
            accelerator.free_memory()  # drop accelerate's references to the model just prepared
            gc.collect()

    built = {k: fn() for k, fn in wraps.items()}
    models = {k: m for k, (m, _) in built.items()}
    batch = make_batch(spec)
    steps = {
        "fsdp()": train_step(*built["fsdp()"], batch),
        "accelerate": train_step(*built["accelerate"], batch, backward=accelerator.backward),
    }
    first_loss = {k: float(step()) for k, step in steps.items()}
    blocks, per_block = (2, 1) if args.quick else (args.blocks, args.steps_per_block)
    times = interleaved_block_times(steps, blocks=blocks, steps_per_block=per_block, warmup=1 if args.quick else 3)
    comms = {k: collectives_per_step(step) for k, step in steps.items()}
    # the tracker hooks the real optimizer: accelerate's wrapper forwards step() to it
    inner = {k: getattr(opt, "optimizer", opt) for k, (_, opt) in built.items()}
    peaks = {k: peak_memory_by_category(models[k], inner[k], steps[k], inputs=(batch[0],), warmup=1) for k in models}
    peak_max = {k: gather_max([p["Total"]])[0] for k, p in peaks.items()}

    headers, rows, timing = timing_table(times, references=["accelerate"])
    report.table(f"Step time: {spec.describe()}", headers, rows)
    report.table(
        "Wrap time (model in memory -> sharded model + optimizer), peak memory, collectives",
        [
            "variant",
            "wrap ms (median)",
            "wrap runs (ms)",
            "peak MiB (rank 0)",
            "peak MiB (max rank)",
            "collectives per step",
            "first-step loss",
        ],
        [
            [
                k,
                f"{median(wrap_s[k]) * 1e3:.1f}",
                ", ".join(f"{x * 1e3:.1f}" for x in wrap_s[k]),
                fmt_mib(peaks[k]["Total"]),
                fmt_mib(peak_max[k]),
                fmt_collectives(comms[k]),
                f"{first_loss[k]:.6f}",
            ]
            for k in models
        ],
    )
    report.table("FSDP units each side created", ["variant", "units"], [[k, unit_names(m)] for k, m in models.items()])
    a, b = peaks["fsdp()"]["Total"], peaks["accelerate"]["Total"]
    report.notes.append(
        f"Peak memory fsdp() vs accelerate: {finite((a - b) / b) * 100:+.2f} % (rank 0). The units differ (table "
        "above): accelerate groups [final norm, embedding, head] with reshard_after_forward=False (kept unsharded "
        "from forward to backward) and leaves the position embedding in the root unit; fsdp() puts both "
        "embeddings, the norm and the head in one unit resharded after forward (FULL_SHARD) and leaves the root "
        "without parameters. That is where the collective counts and the peak differ."
    )
    report.notes.append(timing_note(blocks, per_block))
    report.notes.append(
        "Wrap time includes creating AdamW on both sides (accelerate wants it before prepare(), FSDP2 after "
        f"fully_shard); {args.wrap_reps} runs per side, alternating, after one untimed run of each."
    )
    report.data.update(
        {
            "accelerate_version": accelerate.__version__,
            "model": spec.describe(),
            "wrap_s": wrap_s,
            "wrap_median_s": {k: median(v) for k, v in wrap_s.items()},
            "timing": timing,
            "peak_bytes_rank0": {k: p["Total"] for k, p in peaks.items()},
            "peak_bytes_max_rank": peak_max,
            "collectives": comms,
            "first_loss": first_loss,
        }
    )
    report.publish(args.out_dir)


def main() -> None:
    if importlib.util.find_spec("accelerate") is None:
        print(SKIP_MESSAGE)
        sys.exit(0)
    parser = bench_parser(__doc__.splitlines()[0])
    add_timing_args(parser, blocks=100, steps_per_block=1)
    parser.add_argument("--wrap-reps", type=int, default=6, help="wrap-time repetitions per variant")
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()

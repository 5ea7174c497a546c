"""``optimizer.step()`` on an ``fsdp()`` model's DTensor parameters vs plain tensors of the same local sizes.

After ``fsdp()`` every parameter, gradient and optimizer state is a DTensor (issue 32). For each
elementwise optimizer torch ships (SGD with / without momentum, Adam, AdamW, Adagrad, RMSprop,
Adamax, NAdam, RAdam) and each implementation it has (foreach, fused, single-tensor), ONE run at
2 ranks (gloo, CPU, FULL_SHARD, fp32) times three optimizers of the same class and options,
interleaved block by block:

* ``DTensor (torch path)``: over the fsdp() model's parameters with the local-shard step turned
  off (``use_local_step(opt, False)``): what hand-written FSDP2 and fsdp() before issue 32 run;
* ``DTensor (fsdp() local step)``: the same, as ``fsdp()`` runs it now (the default);
* ``plain local tensors``: over plain tensors shaped like this rank's shards, with gradients:
  the floor (goal: the fsdp() step <= 1.2x it).

A second table times ``clip_grad_norm_(model)`` against its floor: torch's norm of the local
gradients (read from ``model.parameters()``), one all-reduce, one local foreach scale (goal <= 1.2x),
with its collectives.

Gradients come from one real backward; only ``optimizer.step()`` is timed (median step per block,
slowest rank). Results: ``results/optimizer.md`` and ``.json``.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_optimizer.py
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from _common import (
    BENCH_MODEL,
    QUICK_MODEL,
    Block,
    Report,
    add_timing_args,
    bench_parser,
    build_model,
    fmt_collectives,
    interleaved_block_times,
    lm_loss,
    make_batch,
    median,
    paired_ratio,
    run_benchmark,
    timing_note,
)

from zeta_fsdp import fsdp
from zeta_fsdp.measure import collectives_per_step
from zeta_fsdp.optim import steps_locally, use_local_step
from zeta_fsdp.training import clip_grad_norm_

OPT = torch.optim
# (row name, class, options); each row is timed with every implementation the class accepts.
OPTIMIZERS: list[tuple[str, type, dict[str, Any]]] = [
    ("SGD", OPT.SGD, {"lr": 1e-3}),
    ("SGD momentum=0.9", OPT.SGD, {"lr": 1e-3, "momentum": 0.9}),
    ("Adam", OPT.Adam, {"lr": 1e-4}),
    ("AdamW", OPT.AdamW, {"lr": 1e-4}),
    ("Adagrad", OPT.Adagrad, {"lr": 1e-3}),
    ("RMSprop", OPT.RMSprop, {"lr": 1e-4}),
    ("Adamax", OPT.Adamax, {"lr": 1e-4}),
    ("NAdam", OPT.NAdam, {"lr": 1e-4}),
    ("RAdam", OPT.RAdam, {"lr": 1e-4}),
]
IMPLEMENTATIONS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "single-tensor": {"foreach": False}}
VARIANTS = ("DTensor (torch path)", "DTensor (fsdp() local step)", "plain local tensors")


def _optimizers(cls: type, options: dict, model: torch.nn.Module, plain: list) -> dict[str, Any]:
    """The three optimizers of one row, or ``None`` if torch does not offer this implementation here."""
    try:
        off = use_local_step(cls(model.parameters(), **options), False)
        on = cls(model.parameters(), **options)
        local = cls(plain, **options)
    except (RuntimeError, ValueError, TypeError):
        return None
    assert steps_locally(on) and not steps_locally(off)
    opts = dict(zip(VARIANTS, (off, on, local)))
    try:
        off.step()
    except NotImplementedError:  # DTensor has no sharding strategy for this kernel (fused SGD): no torch-path row
        del opts[VARIANTS[0]]
    return opts


def _fmt(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def _step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    return lambda: optimizer.step()


def _clip_floor(model: torch.nn.Module) -> Callable[[], None]:
    """The floor of clipping: the model's local gradients (``model.parameters()``, as any clipping of a model
    walks it), torch's norm of them, one all-reduce, one local foreach scale."""

    def clip() -> None:
        with torch.no_grad():
            grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        share = torch.nn.utils.get_total_norm([g for g in grads if g.numel()], 2.0) ** 2
        dist.all_reduce(share)
        torch._foreach_mul_(grads, torch.clamp(1e9 / (share.sqrt() + 1e-6), max=1.0))

    return clip


def _clip_rows(model: torch.nn.Module, args: argparse.Namespace) -> tuple[list, dict]:
    steps = {
        "clip_grad_norm_(model)": lambda: clip_grad_norm_(model, 1e9),
        "local norm + 1 all-reduce + local scale": _clip_floor(model),
    }
    comms = collectives_per_step(steps["clip_grad_norm_(model)"])
    t = interleaved_block_times(steps, blocks=args.blocks, steps_per_block=args.steps_per_block)
    names = list(steps)
    ratio = paired_ratio(t[names[0]]["wall"], t[names[1]]["wall"])
    rows = [[n, f"{median(t[n]['wall']) * 1e3:.3f}"] for n in names]
    rows[0].append(_fmt(ratio))
    rows[1].append("1")
    rows[0].append(fmt_collectives(comms))
    rows[1].append("allreduce_ 1")
    return rows, {"ratio": ratio, "collectives": comms, **{n: t[n]["wall"] for n in names}}


def _gradients(model: torch.nn.Module, spec: Any) -> None:
    """Gradients from a real backward: FSDP2's gradient DTensors, laid out as in training."""
    inputs, targets = make_batch(spec)
    lm_loss(model(inputs), targets).backward()


def rank_main(args: argparse.Namespace) -> None:
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    if args.dim:  # wider shards: the local step's cost is per parameter, the step's per element
        spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, dim=args.dim))
    model = fsdp(build_model(spec), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    _gradients(model, spec)
    params = list(model.parameters())
    plain = [p.to_local().detach().clone() for p in params]
    for t, p in zip(plain, params):
        t.grad = p.grad.to_local().clone()
    local_elems = sum(t.numel() for t in plain)
    report = Report(
        "optimizer",
        "optimizer.step() on fsdp() DTensors vs plain local tensors",
        args.command,
        f"{spec.describe()}; 2 CPU ranks (gloo), FULL_SHARD, fp32: {len(params)} parameters, {local_elems} local "
        "elements on rank 0. Per row three optimizers of the same class and options: over the DTensor parameters "
        "with the local-shard step off (torch's DTensor path, what hand-written FSDP2 runs) and on (what fsdp() "
        "runs, the default), and over plain tensors of the same local sizes. Ratios are paired per block.",
    )
    headers = ["optimizer", "implementation", *[f"{v} ms" for v in VARIANTS], "torch path / plain", "fsdp() / plain"]
    headers += ["torch path / plain (CPU)", "fsdp() / plain (CPU)"]
    rows, data = [], {}
    for name, cls, options in OPTIMIZERS:
        for impl, flag in IMPLEMENTATIONS.items():
            if args.rows and not any(f"{name} / {impl}".startswith(row) for row in args.rows.split(",")):
                continue
            opts = _optimizers(cls, {**options, **flag}, model, plain)
            if opts is None:
                continue
            steps = {v: _step(o) for v, o in opts.items()}
            t = interleaved_block_times(steps, blocks=args.blocks, steps_per_block=args.steps_per_block)
            wall = {v: t[v]["wall"] for v in opts}
            ratios = {v: paired_ratio(wall[v], wall[VARIANTS[2]]) for v in VARIANTS[:2] if v in opts}
            cpu = {v: paired_ratio(t[v]["cpu"], t[VARIANTS[2]]["cpu"]) for v in VARIANTS[:2] if v in opts}
            rows.append(
                [name, impl, *[f"{median(wall[v]) * 1e3:.2f}" if v in wall else "fails" for v in VARIANTS]]
                + [_fmt(ratios[v]) if v in ratios else "-" for v in VARIANTS[:2]]
                + [_fmt(cpu[v]) if v in cpu else "-" for v in VARIANTS[:2]]
            )
            data[f"{name} / {impl}"] = {
                **{v: {"median_wall_s": median(wall[v]), "block_wall_s": wall[v]} for v in wall},
                "vs plain": ratios,
                "vs plain (cpu)": cpu,
            }
            del opts, steps
    report.table("optimizer.step() median ms (slowest rank), ratios vs plain local tensors", headers, rows)
    clip_rows, data["clip_grad_norm_"] = _clip_rows(model, args)
    report.table(
        "clip_grad_norm_ (max_norm large: the factor is 1, applied as torch does) vs its floor",
        ["variant", "median ms (slowest rank)", "ratio vs floor", "collectives"],
        clip_rows,
    )
    report.notes.append(timing_note(args.blocks, args.steps_per_block))
    report.notes.append(
        "Fused: torch's CPU fused kernels exist for SGD, Adam, AdamW and Adagrad; the other classes have no row. "
        "'fails': DTensor has no sharding strategy for aten._fused_sgd_ (NotImplementedError on torch's path); "
        "the fsdp() local step runs the kernel on the local tensors."
    )
    report.data = {"rows": data, "parameters": len(params), "local_elements_rank0": local_elems}
    report.publish(args.out_dir)


def main() -> None:
    parser = bench_parser(__doc__)
    add_timing_args(parser, blocks=6, steps_per_block=5)
    parser.add_argument(
        "--rows",
        default="",
        help="only these rows, comma-separated prefixes of 'name / implementation' (e.g. 'SGD / ')",
    )
    parser.add_argument("--dim", type=int, default=0, help="the GPT's width instead of the default model's")
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()

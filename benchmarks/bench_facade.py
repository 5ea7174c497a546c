"""fsdp() vs hand-written ``fully_shard`` on the same model, same run (issue 3, "Performance").

Measures, at 2 ranks on CPU (gloo):
  * step time, the two variants interleaved in alternating blocks (ratio target <= 1.05);
  * FSDPMemTracker peak per rank (target: equal within 1 %);
  * collectives per training step with CommDebugMode (must be equal);
  * wrap time of the ~1B-parameter Llama-shaped GPT built on ``meta``: ``fsdp()`` (shard +
    materialize + init) vs the same steps written by hand.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_facade.py
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import time
from typing import Optional

import torch
import torch.distributed as dist
from _common import (
    BENCH_MODEL,
    GPT,
    QUICK_MODEL,
    Block,
    GPTConfig,
    ModelSpec,
    Report,
    add_timing_args,
    bench_parser,
    build_model,
    finite,
    fmt_collectives,
    fmt_mib,
    fmt_ratio,
    gather_max,
    hand_written_fully_shard,
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
from zeta_fsdp.models.gpt import llama_1b_config

QUICK_WRAP_CONFIG = GPTConfig(vocab_size=1024, dim=128, n_heads=4, n_layers=2, max_seq_len=128)


def compare_step(args: argparse.Namespace, report: Report) -> None:
    """Step time, peak memory and collectives of fsdp() vs hand-written on one model."""
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    base = build_model(spec)
    models = {"fsdp()": copy.deepcopy(base), "hand-written": copy.deepcopy(base)}
    fsdp(models["fsdp()"], auto_wrap=True, mp=args.mp, shard_strat="FULL_SHARD", TransformerBlock=Block)
    hand_written_fully_shard(models["hand-written"], mp=args.mp)
    batch = make_batch(spec)
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    steps = {k: train_step(m, optims[k], batch) for k, m in models.items()}
    first_loss = {k: float(step()) for k, step in steps.items()}  # same weights, same data: equal

    blocks, per_block = (2, 2) if args.quick else (args.blocks, args.steps_per_block)
    times = interleaved_block_times(steps, blocks=blocks, steps_per_block=per_block, warmup=1 if args.quick else 3)
    comms = {k: collectives_per_step(step) for k, step in steps.items()}
    peaks = {
        k: peak_memory_by_category(m, optims[k], steps[k], inputs=(batch[0],), warmup=1) for k, m in models.items()
    }
    peak_max = {k: gather_max([p["Total"]])[0] for k, p in peaks.items()}

    headers, rows, timing = timing_table(times, references=["hand-written"])
    caption = f"{spec.describe()}, FULL_SHARD, mp={args.mp}, AdamW, {dist.get_world_size()} ranks"
    report.table(f"Step time: {caption}", headers, rows)
    report.table(
        "Peak memory (FSDPMemTracker) and collectives per step",
        ["variant", "peak MiB (rank 0)", "peak MiB (max over ranks)", "collectives per step (CommDebugMode)"],
        [[k, fmt_mib(peaks[k]["Total"]), fmt_mib(peak_max[k]), fmt_collectives(c)] for k, c in comms.items()],
    )
    a, b = peaks["fsdp()"]["Total"], peaks["hand-written"]["Total"]
    mem_diff = finite((a - b) / b)
    comm_equal = comms["fsdp()"] == comms["hand-written"]
    wall, cpu = (timing["fsdp()"]["vs hand-written"][clock] for clock in ("wall", "cpu"))
    report.table(
        "fsdp() / hand-written",
        ["figure", "value", "target", "met"],
        [
            [
                "step-time ratio, wall (median of paired blocks)",
                fmt_ratio(wall),
                "<= 1.05",
                _yes(wall["median"] <= 1.05),
            ],
            ["step-time ratio, CPU (median of paired blocks)", fmt_ratio(cpu), "<= 1.05", _yes(cpu["median"] <= 1.05)],
            ["peak memory difference (rank 0)", f"{mem_diff * 100:+.3f} %", "within 1 %", _yes(abs(mem_diff) <= 0.01)],
            ["collectives per step", "equal" if comm_equal else "DIFFERENT", "equal", _yes(comm_equal)],
            ["first-step loss", f"{first_loss['fsdp()']:.6f} vs {first_loss['hand-written']:.6f}", "equal", "-"],
        ],
    )
    report.notes.append(timing_note(blocks, per_block))
    report.data["step"] = {
        "model": spec.describe(),
        "mp": args.mp,
        "timing": timing,
        "peak_bytes_rank0": {k: p["Total"] for k, p in peaks.items()},
        "peak_bytes_max_rank": peak_max,
        "peak_by_category_rank0": peaks,
        "peak_diff": mem_diff,
        "collectives": comms,
        "collectives_equal": comm_equal,
        "first_loss": first_loss,
    }


README_LM = ModelSpec(GPTConfig(vocab_size=2048, dim=128, n_heads=4, n_layers=8, max_seq_len=64), batch=4)


def compare_readme_optimizer(args: argparse.Namespace, report: Report) -> None:
    """Issue 32: fsdp() + the README's ``torch.optim.AdamW(model.parameters())`` (torch's defaults: foreach on
    GPUs, single-tensor on CPU; fsdp() steps it on the local shards) vs hand-written ``fully_shard`` + the same
    line, an 8-block LM, 2 ranks: step-time ratio (goal <= 0.94), collectives and peaks equal."""
    spec = QUICK_MODEL if args.quick else README_LM
    base = build_model(spec)
    models = {"fsdp() + README AdamW": copy.deepcopy(base), "hand-written + AdamW": copy.deepcopy(base)}
    fsdp(models["fsdp() + README AdamW"], auto_wrap=True, mp=args.mp, shard_strat="FULL_SHARD", TransformerBlock=Block)
    hand_written_fully_shard(models["hand-written + AdamW"], mp=args.mp)
    batch = make_batch(spec)
    optims = {k: torch.optim.AdamW(m.parameters()) for k, m in models.items()}  # the README's line, verbatim
    steps = {k: train_step(m, optims[k], batch) for k, m in models.items()}
    first_loss = {k: float(step()) for k, step in steps.items()}
    blocks = 2 if args.quick else max(10, args.blocks // 3)
    times = interleaved_block_times(steps, blocks=blocks, steps_per_block=1, warmup=1 if args.quick else 3)
    comms = {k: collectives_per_step(step) for k, step in steps.items()}
    peaks = {
        k: peak_memory_by_category(m, optims[k], steps[k], inputs=(batch[0],), warmup=1) for k, m in models.items()
    }
    headers, rows, timing = timing_table(times, references=["hand-written + AdamW"])
    report.table(f"README optimizer line (issue 32): {spec.describe()}, FULL_SHARD, mp={args.mp}", headers, rows)
    wall = timing["fsdp() + README AdamW"]["vs hand-written + AdamW"]["wall"]
    report.table(
        "fsdp() + README AdamW / hand-written + AdamW",
        ["figure", "value", "target", "met"],
        [
            ["step-time ratio, wall", fmt_ratio(wall), "<= 0.94", _yes(wall["median"] <= 0.94)],
            ["peak MiB (rank 0)", " vs ".join(fmt_mib(p["Total"]) for p in peaks.values()), "equal", "-"],
            [
                "collectives per step",
                "equal" if len({str(c) for c in comms.values()}) == 1 else "DIFFERENT",
                "equal",
                "-",
            ],
            ["first-step loss", " vs ".join(f"{v:.6f}" for v in first_loss.values()), "equal", "-"],
        ],
    )
    report.notes.append(timing_note(blocks, 1))
    report.data["readme_optimizer"] = {
        "model": spec.describe(),
        "timing": timing,
        "collectives": comms,
        "peak_bytes_rank0": {k: p["Total"] for k, p in peaks.items()},
        "first_loss": first_loss,
    }


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def wrap_with_fsdp(cfg: GPTConfig) -> None:
    """The one-liner on a meta model: shards, materializes, initialises and re-ties."""
    model = _build_meta(cfg)
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)


def wrap_by_hand(cfg: GPTConfig, phases: Optional[dict[str, list[float]]] = None) -> None:
    """What fsdp() does for a meta model, written out: shard, allocate shards, init, re-tie.

    ``phases`` collects the seconds of the two halves (sharding vs materializing).
    """
    model = _build_meta(cfg)
    start = time.perf_counter()
    hand_written_fully_shard(model)
    sharded = time.perf_counter()
    model.to_empty(device="cpu")
    model.init_weights()
    if model.head.weight is not model.tok_emb.weight:
        model.head.weight = model.tok_emb.weight
    if phases is not None:
        phases["fully_shard"].append(sharded - start)
        phases["to_empty + init_weights"].append(time.perf_counter() - sharded)


def compare_wrap(args: argparse.Namespace, report: Report) -> None:
    """Wrap time of the ~1B Llama-shaped GPT built on meta (2 ranks)."""
    cfg = QUICK_WRAP_CONFIG if args.quick else llama_1b_config()
    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(cfg).parameters())
    build = timed_max(lambda: _build_meta(cfg))
    # The first multi-GB allocation of a process is slower (fresh pages; freed blocks are reused
    # later), so whichever variant went first would look slower: time one cold fsdp() wrap on its
    # own (what a user's fresh process sees), then alternate warm runs of the two variants.
    cold = timed_max(lambda: wrap_with_fsdp(cfg))
    gc.collect()
    runs: dict[str, list[float]] = {"fsdp()": [], "hand-written": []}
    phases: dict[str, list[float]] = {"fully_shard": [], "to_empty + init_weights": []}
    for rep in range(args.wrap_reps):
        order = [("fsdp()", wrap_with_fsdp), ("hand-written", functools.partial(wrap_by_hand, phases=phases))]
        for name, fn in order if rep % 2 == 0 else reversed(order):
            runs[name].append(timed_max(lambda fn=fn: fn(cfg)))
            gc.collect()  # free the previous model's shards before the next allocation
    report.table(
        f"Wrap time, {numel / 1e9:.2f}B-parameter Llama-shaped GPT built on meta (dim {cfg.dim}, "
        f"{cfg.n_layers} layers, vocab {cfg.vocab_size}), FULL_SHARD, {dist.get_world_size()} ranks",
        ["variant", "seconds (median)", "each run (s)"],
        [
            ["build on meta (GPT(cfg) under torch.device('meta'))", f"{build:.2f}", f"{build:.2f}"],
            ["fsdp(), first wrap in the process (cold allocator)", f"{cold:.2f}", f"{cold:.2f}"],
        ]
        + [[f"{k} (warm, alternating)", f"{median(v):.2f}", ", ".join(f"{x:.2f}" for x in v)] for k, v in runs.items()],
    )
    split = dict(zip(phases, gather_max([median(v) for v in phases.values()])))
    report.notes.append(
        "Wrap = fully_shard bottom-up + to_empty + init_weights + re-tie (fsdp() does all of it in one call; "
        "'hand-written' is the same steps by hand; AdamW is not created). Seconds are the slowest rank's. "
        "Split of the hand-written wrap (median, slowest rank): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in split.items())
        + f" ({split['to_empty + init_weights'] / sum(split.values()):.0%} is allocating and initialising "
        "this rank's shards)."
    )
    report.data["wrap"] = {
        "params": numel,
        "config": {"dim": cfg.dim, "n_layers": cfg.n_layers, "vocab_size": cfg.vocab_size},
        "build_meta_s": build,
        "cold_fsdp_wrap_s": cold,
        "wrap_s": runs,
        "wrap_median_s": {k: median(v) for k, v in runs.items()},
        "hand_written_split_s": split,
    }


def _build_meta(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def rank_main(args: argparse.Namespace) -> None:
    report = Report(
        name="facade",
        title="fsdp() vs hand-written fully_shard",
        command=args.command,
        what="Same model, same run, 2 CPU ranks (gloo): step-time ratio, FSDPMemTracker peak, collectives "
        "per step, and wrap time of the ~1B Llama-shaped model built on meta.",
    )
    compare_step(args, report)
    gc.collect()
    compare_readme_optimizer(args, report)
    gc.collect()
    if args.wrap_reps > 0:
        compare_wrap(args, report)
    report.publish(args.out_dir)


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--mp", default="fp32", help="mixed precision for both variants (fp32 or bf16)")
    add_timing_args(parser, blocks=150, steps_per_block=1)
    parser.add_argument(
        "--wrap-reps", type=int, default=2, help="wrap-time repetitions per variant (0: skip the wrap-time part)"
    )
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()

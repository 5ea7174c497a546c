"""What ``set_reduce_scatter_unused_params(True)`` (which ``fsdp()`` turns on for every unit) costs.

A dense model (every parameter used on every rank, the common case) with the setting on (what
``fsdp()`` does) and off (FSDP2's default), in ONE run at 2 ranks (gloo, CPU, FULL_SHARD, fp32,
AdamW): the collectives of one step (CommDebugMode), the peak memory per rank over one step
(FSDPMemTracker) and the step time in interleaved blocks (paired ratios). The setting only acts
when a rank holds a parameter without a gradient, so a dense model should see no difference.
Results: ``results/unused_params.md``.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_unused_params.py

``--none-grads``: what leaving ``.grad`` None for a parameter no rank used costs (``engines.unused``):
an MoE model (experts no rank's tokens reach in a step, so the flags are exchanged and the zeros
dropped every step) and the GPT (no module a forward may skip: nothing registered, so unchanged),
each with the change and as before it, in ONE run; it replaces its own section of the results file.
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_unused_params.py --none-grads
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import (
    BENCH_MODEL,
    QUICK_MODEL,
    Block,
    ModelSpec,
    add_timing_args,
    bench_parser,
    build_model,
    fmt_collectives,
    interleaved_block_times,
    is_rank0,
    machine_info,
    make_batch,
    run_benchmark,
    timing_note,
    timing_table,
    train_step,
)

from zeta_fsdp import fsdp
from zeta_fsdp.engines import fully_shard as fully_shard_engine
from zeta_fsdp.engines import get_wrap_plan
from zeta_fsdp.measure import collectives_per_step, peak_memory_by_category

VARIANTS = {"fsdp() (unused params reduced: on)": True, "same, setting off (FSDP2 default)": False}


def rank_main(args: argparse.Namespace) -> None:
    spec = BENCH_MODEL
    steps, rows = {}, []
    for name, on in VARIANTS.items():
        model = fsdp(build_model(spec), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
        model.set_reduce_scatter_unused_params(on)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = train_step(model, opt, make_batch(spec))
        step()
        comms = collectives_per_step(step)
        peak = peak_memory_by_category(model, opt, step)["Total"]
        steps[name] = step
        rows.append((name, comms, peak))
    times = interleaved_block_times(steps, blocks=args.blocks, steps_per_block=args.steps_per_block)
    headers, timing_rows, _ = timing_table(times, [next(iter(VARIANTS))])
    if not is_rank0():
        return
    info = machine_info()
    lines = [
        "# set_reduce_scatter_unused_params: what it costs a dense model",
        "",
        f"{spec.describe()}; 2 CPU ranks (gloo), FULL_SHARD, fp32, AdamW.",
        "",
        "Reproduce (from the repository root):",
        "",
        "```bash",
        args.command,
        "```",
        "",
        f"- torch {torch.__version__}; {info.get('cpu', '')}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        "| variant | collectives / step | peak MiB (rank 0, FSDPMemTracker) |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {fmt_collectives(c)} | {p / 2**20:.3f} |" for n, c, p in rows]
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in timing_rows]
    lines += ["", timing_note(args.blocks, args.steps_per_block)]
    (args.out_dir / "unused_params.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """LayerNorm, then each token through the expert its id picks; an expert no token reached does not run."""

    def __init__(self, dim: int, n_experts: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.vocab = nn.LayerNorm(dim), vocab
        self.experts = nn.ModuleList(Expert(dim) for _ in range(n_experts))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x, out = self.norm(h), torch.zeros_like(h)
        route = ids * len(self.experts) // self.vocab
        for i, expert in enumerate(self.experts):
            mask = route == i
            if mask.any():
                out[mask] = expert(x[mask])
        return h + out


class MoELM(nn.Module):
    """The bench GPT's sizes (dim, layers, vocab) with 8 experts per block instead of attention + MLP."""

    def __init__(self, dim: int, layers: int, vocab: int, n_experts: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, n_experts, vocab) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, ids)
        return self.head(self.norm(h))


def moe_batch(spec: ModelSpec, n_experts: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens reach experts {2r, 2r+1} only: at 2 ranks experts 4-7 are idle on every rank."""
    rank = torch.distributed.get_rank()
    vocab, batch, seq = spec.config.vocab_size, spec.batch, spec.config.max_seq_len
    span = vocab // n_experts
    g = torch.Generator().manual_seed(1000 + rank)
    ids = 2 * rank * span + torch.randint(0, 2 * span, (batch, seq + 1), generator=g)
    return ids[:, :-1], torch.randint(0, vocab, (batch, seq), generator=g)


@contextlib.contextmanager
def zeros_left() -> Iterator[None]:
    """``fsdp()`` as before the change: FSDP2's zero gradients for parameters no rank used are kept."""
    saved = fully_shard_engine._leave_unused_grads_none
    fully_shard_engine._leave_unused_grads_none = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fully_shard_engine._leave_unused_grads_none = saved


NONE_VARIANTS = {
    "MoE: fsdp() (unused -> None)": ("moe", True),
    "MoE: before (zero .grad kept)": ("moe", False),
    "GPT: fsdp()": ("gpt", True),
    "GPT: before": ("gpt", False),
}
NONE_SECTION = "## Unused means None: what leaving `.grad` None costs"


def none_grads_main(args: argparse.Namespace) -> None:
    """The ``--none-grads`` mode (module docstring): collectives per step and interleaved step times."""
    spec, steps, comms = QUICK_MODEL if args.quick else BENCH_MODEL, {}, {}
    cfg = spec.config
    for name, (kind, on) in NONE_VARIANTS.items():
        torch.manual_seed(0)
        model = MoELM(cfg.dim, cfg.n_layers, cfg.vocab_size) if kind == "moe" else build_model(spec)
        with contextlib.nullcontext() if on else zeros_left():
            fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=MoEBlock if kind == "moe" else Block)
        assert bool(get_wrap_plan(model).skippable) == (kind == "moe"), get_wrap_plan(model).skippable
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = train_step(model, opt, moe_batch(spec) if kind == "moe" else make_batch(spec))
        step()
        idle = model.blocks[0].experts[7].up.weight if kind == "moe" else None
        if idle is not None:  # the step zeroes grads at its end: look inside one backward
            out = model(moe_batch(spec)[0])
            out.float().mean().backward()
            assert (idle.grad is None) == on, f"{name}: expert 7 .grad {idle.grad is None}"
            opt.zero_grad()
        comms[name] = collectives_per_step(step)
        steps[name] = step
    times = interleaved_block_times(steps, blocks=args.blocks, steps_per_block=args.steps_per_block)
    names = list(NONE_VARIANTS)
    tables = [timing_table({n: times[n] for n in pair}, [pair[1]]) for pair in (names[:2], names[2:])]
    if not is_rank0():
        return
    info = machine_info()
    lines = [
        NONE_SECTION,
        "",
        f"The MoE: {cfg.n_layers} blocks of LayerNorm + 8 experts (Linear {cfg.dim}->{4 * cfg.dim}->{cfg.dim}, routed "
        f"by token id), embedding and head of the bench GPT (vocab {cfg.vocab_size}), batch {spec.batch}x"
        f"{cfg.max_seq_len}/rank; each rank's tokens reach its own 2 experts, so 4 of 8 are idle on every rank in "
        f"every step (their zeros dropped each step). The GPT: {spec.describe()}, no module a forward may skip. "
        "2 CPU ranks (gloo), FULL_SHARD, fp32, AdamW. 'before': the same fsdp() without the hooks "
        "(`engines.unused`), i.e. the zero `.grad` FSDP2 reduces is kept.",
        "",
        "```bash",
        args.command,
        "```",
        "",
        f"- torch {torch.__version__}; {info.get('cpu', '')}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        "| variant | collectives / step |",
        "|---|---|",
    ]
    lines += [f"| {n} | {fmt_collectives(c)} |" for n, c in comms.items()]
    for headers, rows, _ in tables:
        lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", timing_note(args.blocks, args.steps_per_block), ""]
    section = "\n".join(lines)
    path = args.out_dir / "unused_params.md"
    text = path.read_text() if path.exists() else ""
    start = text.find(NONE_SECTION)
    if start >= 0:  # replace this section (up to the next one, if any), keep the rest
        end = text.find("\n## ", start + len(NONE_SECTION))
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section if text else section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(section)


def main() -> None:
    parser = bench_parser(__doc__)
    add_timing_args(parser, blocks=8, steps_per_block=5)
    parser.add_argument("--none-grads", action="store_true", help="measure engines.unused (module docstring)")
    run_benchmark(lambda args: (none_grads_main if args.none_grads else rank_main)(args), parser)


if __name__ == "__main__":
    main()

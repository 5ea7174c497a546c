"""LoRA vs full fine-tuning of the same bf16 Llama: per-rank bytes (FSDPMemTracker) and step time.

Both variants: a Hugging Face ``LlamaForCausalLM`` loaded in bf16 (``.to(torch.bfloat16)``, what
``from_pretrained(dtype=torch.bfloat16)`` gives), ``fsdp(model, auto_wrap=True, mp="bf16",
shard_strat="FULL_SHARD")``, AdamW.

* ``full``: every parameter trains: fp32 masters (fsdp's default), fp32 gradients and AdamW state.
* ``lora``: PEFT LoRA (r=16 on q/k/v/o and the MLP projections); the base is frozen and stays bf16,
  sharded 1/N, with no gradient or optimizer state; the adapters are fp32 masters.

Per rank and step the tracker's peak is split by category. Step times are measured in one run,
the two variants interleaved block by block (``_common.interleaved_block_times``).
Results: ``results/lora.md`` / ``results/lora.json``.

Run (launches 2 ranks itself):
    python benchmarks/bench_lora.py
"""

from __future__ import annotations

import argparse
import gc

import torch
from _common import (
    MIB,
    Report,
    add_timing_args,
    bench_parser,
    interleaved_block_times,
    run_benchmark,
    timing_note,
    timing_table,
)

from zeta_fsdp import fsdp, memory_report
from zeta_fsdp.measure import peak_memory_by_category

GROUPS = {
    "params (sharded)": ("Sharded Param",),
    "params (unsharded + all-gather)": ("Unsharded Param", "All Gather"),
    "grads (+ reduce-scatter)": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimizer state": ("OptState",),
    "activations + temporaries": ("Activation", "Temp", "Buffer", "Inputs"),
}


def llama(quick: bool, lora: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if quick:
        config = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        )
    else:
        config = LlamaConfig(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    return model


def rank_main(args: argparse.Namespace) -> None:
    seq, batch = (16, 2) if args.quick else (128, 4)
    ids = torch.randint(0, 256 if args.quick else 8192, (batch, seq), generator=torch.Generator().manual_seed(0))
    variants, steps, memory, counts = {}, {}, {}, {}
    for name in ("full", "lora"):
        model = fsdp(llama(args.quick, name == "lora"), auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step(model=model, opt=opt) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        peak = peak_memory_by_category(model, opt, step, inputs=(ids,))
        memory[name] = {group: sum(peak.get(c, 0) for c in cats) for group, cats in GROUPS.items()}
        memory[name]["total peak"] = peak["Total"]
        report = memory_report(model, opt)
        counts[name] = {
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
            "param_local_bytes": report["params"]["local_bytes"],
            "frozen_local_bytes": report["frozen"]["local_bytes"],
            "optimizer_local_bytes": report["optimizer_state"]["local_bytes"],
            "dtypes": {"masters": report["trainable_dtypes"], "frozen": report["frozen"]["dtypes"]},
        }
        variants[name] = model
        steps[name] = step
    times = interleaved_block_times(steps, blocks=args.blocks, steps_per_block=args.steps_per_block)
    out = Report(
        name="lora",
        title="LoRA vs full fine-tuning of a bf16 Llama (2 ranks, FULL_SHARD, mp=bf16)",
        command=args.command,
        what=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1].replace("\n", " "),
    )
    rows = [
        [
            name,
            f"{c['trainable']:,}",
            f"{c['frozen']:,}",
            ", ".join(c["dtypes"]["masters"]),
            ", ".join(c["dtypes"]["frozen"]) or "-",
            f"{c['param_local_bytes'] / MIB:.2f}",
            f"{c['frozen_local_bytes'] / MIB:.2f}",
            f"{c['optimizer_local_bytes'] / MIB:.2f}",
        ]
        for name, c in counts.items()
    ]
    out.table(
        "What rank 0 stores (memory_report: logical shards)",
        [
            "variant",
            "trainable",
            "frozen",
            "master dtype",
            "frozen dtype",
            "params MiB",
            "of which frozen MiB",
            "AdamW state MiB",
        ],
        rows,
    )
    groups = [*GROUPS, "total peak"]
    out.table(
        "Peak per rank over one training step (FSDPMemTracker, rank 0, MiB, split at the moment of the peak)",
        ["variant", *groups],
        [[name, *(f"{memory[name][g] / MIB:.2f}" for g in groups)] for name in memory],
    )
    headers, trows, tdata = timing_table(times, ["full"])
    out.table("Step time (forward + backward + AdamW)", headers, trows)
    ratio = memory["lora"]["total peak"] / memory["full"]["total peak"]
    out.notes += [
        f"LoRA peak / full peak: {ratio:.3f}. The frozen base is bf16 and sharded 1/2 "
        f"({counts['lora']['frozen_local_bytes'] / MIB:.2f} MiB on rank 0 = 2 bytes x {counts['lora']['frozen']:,} / 2 "
        "elements, padding aside); full fine-tuning holds the same weights as fp32 masters plus fp32 gradients "
        "and two fp32 AdamW moments (16 bytes per element, / 2).",
        timing_note(args.blocks, args.steps_per_block),
        "The machine was shared with other jobs (2 cores, several agents): ratios come from one run with the "
        "variants interleaved, so drift cancels; absolute times move with the load.",
    ]
    out.data = {"memory": memory, "counts": counts, "times": tdata, "lora_over_full_peak": ratio}
    out.publish(args.out_dir)
    del variants
    gc.collect()


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    add_timing_args(parser, blocks=5, steps_per_block=3)
    args, _ = parser.parse_known_args()
    if args.quick:
        parser.set_defaults(blocks=2, steps_per_block=1)
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()

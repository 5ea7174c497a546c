"""GPU: bf16 tokens/s and MFU, fsdp() on 1 GPU vs the unwrapped model; memory vs the planner.

Runs only where CUDA is available; otherwise prints one line and exits 0. One process, no
launcher: ``fsdp()`` starts its own one-process group (the notebook path).
  * ``fsdp()``: ``fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)``
    (bf16 compute, fp32 parameters, gradients and AdamW state);
  * ``hand-written fully_shard``: ``fully_shard`` per block then the root, the same bf16 policy: what a
    user writes without the façade. Goal: fsdp() >= 1.0x of it.
  * ``unwrapped``: the same model, fp32 parameters, ``torch.autocast(bf16)``: the usual
    single-GPU mixed-precision recipe. Goal: fsdp() throughput >= 0.98x of it.
``--size 1b``: a ~1.07B-parameter GPT (dim 2048, 16 layers, vocab 128256, batch 4 x 1024) instead of ~185M.
  * ``torch.cuda.max_memory_allocated`` of the fsdp() model's training step vs ``zeta_fsdp.planner.plan``
    (skipped if the planner is not there).

Run:
    python benchmarks/bench_gpu.py            # ~185M
    python benchmarks/bench_gpu.py --size 1b  # ~1.07B
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
from typing import Any, Callable, Optional

import torch
from _common import (
    MIB,
    Block,
    GPTConfig,
    ModelSpec,
    Report,
    add_timing_args,
    bench_parser,
    build_model,
    finite,
    interleaved_block_times,
    lm_loss,
    make_batch,
    median,
    out_dir,
    paired_ratio,
    reproduce_command,
)

from zeta_fsdp import fsdp, shutdown

SKIP_MESSAGE = "bench_gpu: skipped: no CUDA device (torch.cuda.is_available() is False)"

# ~185M parameters; big enough that matmuls, not Python, set the step time on an H100.
GPU_MODEL = ModelSpec(GPTConfig(vocab_size=32000, dim=1024, n_heads=16, n_layers=12, max_seq_len=1024), batch=8)
# ~1.07B parameters (Llama-3.2-1B-like widths), batch 4 x 1024: `--size 1b`.
GPU_MODEL_1B = ModelSpec(GPTConfig(vocab_size=128256, dim=2048, n_heads=32, n_layers=16, max_seq_len=1024), batch=4)
QUICK_GPU_MODEL = ModelSpec(GPTConfig(vocab_size=256, dim=64, n_heads=4, n_layers=2, max_seq_len=64), batch=2)

# Dense bf16 peak TFLOP/s by device name (vendor datasheets, no sparsity); --peak-tflops overrides.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
)


def peak_tflops(device: torch.device, override: Optional[float]) -> Optional[float]:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def flops_per_token(model: torch.nn.Module, cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention scores (PaLM appendix B).

    The tied embedding/head weight counts once (the head matmul); the position embedding is a
    lookup, not a matmul. Attention: 12 x layers x seq x dim (QK^T and AV, forward + backward).
    """
    params = {id(p): p.numel() for p in model.parameters()}
    matmul = sum(params.values()) - model.pos_emb.weight.numel()
    return 6.0 * matmul + 12.0 * cfg.n_layers * cfg.max_seq_len * cfg.dim


def synced(step: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``step`` followed by a device sync, so host timers see the GPU's work."""

    def run() -> Any:
        out = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    return run


def make_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    autocast: bool,
    after_step: Optional[Callable[[], None]] = None,
) -> Callable[[], torch.Tensor]:
    """One training step; ``autocast`` for the unwrapped bf16 recipe; ``after_step`` runs before zero_grad."""
    inputs, targets = batch
    device_type = inputs.device.type

    def step() -> torch.Tensor:
        ctx = torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            logits = model(inputs)
        loss = lm_loss(logits.float(), targets)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    return fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)


def hand_written(model: torch.nn.Module) -> torch.nn.Module:
    """What a user writes without the façade: ``fully_shard`` per block, then the root (tied embedding and
    head in it), one bf16 policy (fp32 gradient reduction) on every unit; the process group is fsdp()'s."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def planner_estimate(spec: ModelSpec) -> tuple[Optional[Any], str]:
    """``zeta_fsdp.planner.plan`` for this run (1 rank, FULL_SHARD, bf16, AdamW), or why not."""
    try:
        from zeta_fsdp.planner import plan
    except ImportError as e:
        return None, f"planner not available ({e})"
    with torch.device("meta"):
        meta_model = build_model(spec)
    try:
        return plan(meta_model, world_size=1, shard_strat="FULL_SHARD", mp="bf16", TransformerBlock=Block), ""
    except (TypeError, ValueError) as e:
        return None, f"plan() call failed: {e}"


def measure_memory(spec: ModelSpec, device: torch.device, steps: int) -> dict[str, int]:
    """The fsdp() model alone on the device: peak of a training step, and states after optimizer.step()."""
    if device.type != "cuda":
        return {}
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    model = wrap(build_model(spec).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    states: list[int] = []
    step = make_step(
        model,
        optimizer,
        make_batch(spec, device=device),
        autocast=False,
        after_step=lambda: states.append(torch.cuda.memory_allocated(device) - before),
    )
    step()  # creates AdamW state: the steady state starts at the second step
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del model, optimizer, step
    gc.collect()
    torch.cuda.empty_cache()
    return {"max_memory_allocated": peak, "after_optimizer_step": states[-1]}


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    spec = QUICK_GPU_MODEL if args.quick else GPU_MODEL_1B if args.size == "1b" else GPU_MODEL
    memory = measure_memory(spec, device, steps=2 if args.quick else 5)

    base = build_model(spec).to(device)
    fsdp_model = wrap(copy.deepcopy(base))  # first: starts the one-process group the hand-written model uses
    hand_model = hand_written(copy.deepcopy(base))
    batch = make_batch(spec, device=device)

    def adamw_step(model: torch.nn.Module, autocast: bool) -> Callable[[], Any]:
        return synced(
            make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch, autocast=autocast), device
        )

    steps = {
        "fsdp()": adamw_step(fsdp_model, False),
        "hand-written fully_shard": adamw_step(hand_model, False),
        "unwrapped": adamw_step(base, True),
    }
    blocks, per_block = (2, 1) if args.quick else (args.blocks, args.steps_per_block)
    times = interleaved_block_times(steps, blocks=blocks, steps_per_block=per_block, warmup=1 if args.quick else 5)
    tokens = spec.tokens_per_step
    fpt = flops_per_token(base, spec.config)
    peak = peak_tflops(device, args.peak_tflops)
    ratio = paired_ratio(times["unwrapped"]["wall"], times["fsdp()"]["wall"])  # throughput ratio fsdp/unwrapped
    hand_ratio = paired_ratio(times["hand-written fully_shard"]["wall"], times["fsdp()"]["wall"])

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (debug run, not a GPU figure)"
    report = Report(
        name="gpu",
        title="GPU: fsdp() on 1 GPU vs the unwrapped model (bf16)",
        command=args.command,
        what=f"Device: {name}. {spec.describe()}; AdamW; bf16 compute (fsdp(mp='bf16') vs autocast).",
    )
    rows = []
    for k, t in times.items():
        step_s = finite(median(t["wall"]))
        tps = tokens / step_s
        mfu = f"{tps * fpt / (peak * 1e12) * 100:.1f} %" if peak else "n/a (pass --peak-tflops)"
        rows.append([k, f"{step_s * 1e3:.1f}", f"{tps:,.0f}", mfu])
        report.data.setdefault("variants", {})[k] = {"step_s": step_s, "tokens_per_s": tps}
    report.table(
        "Throughput (median over interleaved blocks)", ["variant", "step ms", "tokens/s", "MFU (dense bf16 peak)"], rows
    )
    report.table(
        "fsdp() tokens/s over the other variants (median of paired blocks, min-max)",
        ["over", "ratio", "goal"],
        [
            ["unwrapped + autocast", f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})", ">= 0.98"],
            [
                "hand-written fully_shard",
                f"{hand_ratio['median']:.3f} ({hand_ratio['min']:.3f}-{hand_ratio['max']:.3f})",
                ">= 1.0",
            ],
        ],
    )
    plan_obj, why = planner_estimate(spec)
    if memory:
        rows = [
            ["torch.cuda.max_memory_allocated (training step)", f"{memory['max_memory_allocated'] / MIB:.1f}", "-"],
            ["memory_allocated after optimizer.step()", f"{memory['after_optimizer_step'] / MIB:.1f}", "-"],
        ]
        if plan_obj is not None:
            states = plan_obj.param_bytes + plan_obj.grad_bytes + plan_obj.optimizer_bytes
            rows += [
                [
                    "planner: params + grads + AdamW state",
                    f"{states / MIB:.1f}",
                    f"{states / memory['after_optimizer_step']:.3f} of measured after step",
                ],
                [
                    "planner: total_bytes (+ all-gather peak, no activations)",
                    f"{plan_obj.total_bytes / MIB:.1f}",
                    f"{plan_obj.total_bytes / memory['max_memory_allocated']:.3f} of max_memory_allocated",
                ],
            ]
            report.data["planner"] = {"states_bytes": states, "total_bytes": plan_obj.total_bytes}
        else:
            report.notes.append(f"Planner line skipped: {why}.")
        report.table("Memory of the fsdp() model alone (MiB)", ["figure", "MiB", "ratio"], rows)
        report.data["memory"] = memory
    report.notes.append(
        f"MFU = tokens/s x {fpt / 1e6:.1f} MFLOP/token (6 x matmul params + 12 x layers x seq x dim) / "
        f"{peak if peak else 'unknown'} TFLOP/s. The example GPT's attention is plain einsum + softmax "
        "(no fused/flash attention), so MFU is far below what a tuned model reaches."
    )
    report.notes.append(f"Timing: {blocks} interleaved blocks x {per_block} steps, each step ends with a CUDA sync.")
    report.data.update({"ratio_tokens_per_s": ratio, "ratio_over_hand_written": hand_ratio})
    report.data.update({"flops_per_token": fpt, "peak_tflops": peak})
    path = report.write(out_dir(args))
    print(report.markdown())
    print(f"wrote {path}")


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0], default_nproc=None)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to debug the script itself")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU, TFLOP/s")
    parser.add_argument("--size", choices=("185m", "1b"), default="185m", help="the model: ~185M (default) or ~1.07B")
    add_timing_args(parser, blocks=20, steps_per_block=5)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(SKIP_MESSAGE)
        sys.exit(0)
    args.command = reproduce_command("bench_gpu.py", sys.argv[1:], launcher=False)
    run(args)
    shutdown()  # only tears down the one-process group fsdp() started


if __name__ == "__main__":
    main()

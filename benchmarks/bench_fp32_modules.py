"""What ``fsdp(keep_fp32=[nn.LayerNorm])`` costs under ``mp="bf16"``: collectives per step and step time.

Run (2 CPU ranks, gloo):
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_fp32_modules.py

Rank 0 prints a markdown table (recorded in ``results/fp32_modules.md``). On torch < 2.15 the norms
are FSDP units of their own (one all-gather + one reduce-scatter more per norm and step); on
torch >= 2.15 they stay in their block (``param_dtype_override_fn``): the counts say which ran.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeta_fsdp import fsdp, shutdown  # noqa: E402
from zeta_fsdp.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from zeta_fsdp.torch_compat import HAS_PARAM_DTYPE_OVERRIDE  # noqa: E402

CFG = GPTConfig(vocab_size=512, dim=256, n_heads=8, n_layers=4, max_seq_len=64)
STEPS, ROUNDS = 5, 4


def build(keep_fp32):
    torch.manual_seed(0)
    model = fsdp(GPT(CFG), auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", keep_fp32=keep_fp32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, x, y):
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    x = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len), generator=torch.Generator().manual_seed(1))
    variants = {"bf16": build(None), "bf16 + keep_fp32=[nn.LayerNorm]": build([nn.LayerNorm])}
    counts, times = {}, {k: [] for k in variants}
    for name, (model, opt) in variants.items():
        step(model, opt, x, x)  # warm-up (lazy init)
        with CommDebugMode() as comm:
            step(model, opt, x, x)
        counts[name] = Counter({str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()})
    for _ in range(ROUNDS):  # interleaved A/B: load on a shared machine hits both alike
        for name, (model, opt) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                step(model, opt, x, x)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / STEPS * 1e3)
    if dist.get_rank() == 0:
        print(
            f"torch {torch.__version__}, param_dtype_override_fn: {HAS_PARAM_DTYPE_OVERRIDE}, {dist.get_world_size()} ranks"
        )
        print("| variant | collectives per step | median step (ms) |\n|---|---|---|")
        for name in variants:
            comms = ", ".join(f"{k} {v}" for k, v in sorted(counts[name].items()))
            print(f"| {name} | {comms} | {statistics.median(times[name]):.1f} |")
    shutdown()


if __name__ == "__main__":
    main()

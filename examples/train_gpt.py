"""Train the tiny GPT with ``fsdp()`` for a few steps and print the loss.

Run on 2 CPU ranks (the README's main command):
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
or in one process (a notebook works the same: no process-group set-up needed):
    python examples/train_gpt.py

The script never calls ``init_process_group``: ``fsdp()`` starts the group from torchrun's
environment, or a one-process group when there is none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeta_fsdp import fsdp, get_wrap_plan, shutdown  # noqa: E402
from zeta_fsdp.models.gpt import Block, GPTConfig, lm_loss, small  # noqa: E402
from zeta_fsdp.wrapped import compute_device  # noqa: E402


def counting_batch(vocab_size: int, generator: torch.Generator, batch: int = 4, length: int = 12) -> torch.Tensor:
    """Sequences that count up from a random start (mod vocab): learnable in a few steps."""
    start = torch.randint(0, vocab_size, (batch, 1), generator=generator)
    return (start + torch.arange(length)) % vocab_size


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shard-strat", default="FULL_SHARD")
    parser.add_argument("--mp", default="fp32")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = fsdp(small(), auto_wrap=True, mp=args.mp, shard_strat=args.shard_strat, TransformerBlock=Block)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"sharded over {world} rank(s) with {args.shard_strat}, mp={args.mp}")
        print(get_wrap_plan(model).table())
    # The optimizer is built after fsdp(): it must see the sharded (DTensor) parameters.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    device = compute_device(model)  # cuda:LOCAL_RANK on GPUs, else CPU: batches go there
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(args.steps):
        tokens = counting_batch(cfg.vocab_size, generator).to(device)
        loss = lm_loss(model(tokens[:, :-1]).float(), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    shutdown()
    return losses


if __name__ == "__main__":
    main()

"""A complete training loop on ``FSDP2Strategy``: data, accumulation, clipping, checkpoints, resume.

Run on 2 CPU ranks, then continue from the last checkpoint:
    torchrun --standalone --nproc-per-node 2 examples/strategy_loop.py
    torchrun --standalone --nproc-per-node 2 examples/strategy_loop.py --resume --steps 12
One process works too (a notebook-style one-process group starts by itself), and so does resuming
a checkpoint written at another world size (checkpoints are full tensors keyed by name).

What it shows, in order: build the model on ``meta`` inside ``tensor_init_context(empty_init=True)`` (nothing is
allocated until ``parallelize()`` shards it), create the optimizer from the sharded parameters,
split a padded token dataset over the data-parallel ranks (``process_dataloader``), accumulate
``--accumulate`` micro-batches per optimizer step with gradient reduction skipped on all but the
last (``no_sync``), clip the global gradient norm, log the global token-weighted loss, save a
checkpoint every ``--save-every`` steps keeping the newest ``--keep``, and resume with ``--resume``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeta_fsdp.models.gpt import Block, small  # noqa: E402
from zeta_fsdp.strategy import FSDP2Strategy  # noqa: E402


class PaddedCounting(Dataset):
    """Sequences that count up from a random start (learnable), right-padded to a fixed length.

    ``labels`` are the next tokens; ``loss_mask`` is 0 on padding, so samples hold different
    numbers of tokens and the loss must be token-weighted across ranks.
    """

    def __init__(self, n: int = 256, length: int = 12, vocab: int = 37, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        tokens = (start + torch.arange(length + 1)) % vocab
        lengths = torch.randint(length // 3, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length) < lengths[:, None]).long()
        self.inputs = tokens[:, :-1] * self.mask  # 0 is the padding id
        self.labels = tokens[:, 1:]

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.inputs[i], "labels": self.labels[i], "loss_mask": self.mask[i]}


def checkpoint_name(step: int, fmt: str) -> str:
    return f"step_{step:06d}" + (".ckpt" if fmt == "full" else "")


def latest_checkpoint(directory: Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in directory.glob("step_*") if (m := re.match(r"step_(\d+)", p.name))]
    return max(found)[1] if found else None


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=8, help="optimizer steps in total (a resumed run counts the earlier ones)"
    )
    parser.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step, over all ranks")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--keep", type=int, default=2, help="newest checkpoints to keep")
    parser.add_argument("--ckpt-dir", default="checkpoints/strategy_loop")
    parser.add_argument("--format", choices=("full", "sharded"), default="full")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    args = parser.parse_args(argv)

    strategy = FSDP2Strategy(TransformerBlock=Block, checkpoint_format=args.format)
    torch.manual_seed(0)
    with strategy.tensor_init_context(empty_init=True):
        model = small()  # on meta: allocated shard by shard in parallelize()
    strategy.connect(model)
    strategy.setup_optimizers(lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr))  # shards first
    dp = strategy.data_parallel_size
    micro = args.global_batch // (dp * args.accumulate)
    if micro * dp * args.accumulate != args.global_batch:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of ranks x --accumulate")
    loader = strategy.process_dataloader(DataLoader(PaddedCounting(), batch_size=micro, shuffle=True, drop_last=True))
    steps_per_epoch = len(loader) // args.accumulate

    ckpt_dir = Path(args.ckpt_dir)
    if args.resume:
        last = latest_checkpoint(ckpt_dir)
        if last is None:
            raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}")
        # weights now; optimizer state at the first training step (applied once, then freed)
        strategy.load_checkpoint(last)
        if strategy.is_global_zero:
            print(f"resumed from {last} at {strategy.current_epoch_step}", flush=True)

    losses = []
    while strategy.current_epoch_step.step < args.steps:
        step = strategy.current_epoch_step.step
        epoch = step // steps_per_epoch
        strategy.set_epoch(epoch)  # same shuffle as an uninterrupted run
        skip = (step - epoch * steps_per_epoch) * args.accumulate
        batches = iter(loader)
        for _ in range(skip):
            next(batches)
        for _ in range(steps_per_epoch - skip // args.accumulate):
            for k in range(args.accumulate):
                batch = {k: v.to(strategy.root_device) for k, v in next(batches).items()}  # onto this rank's device
                last_micro = k == args.accumulate - 1
                # no gradient reduction until the last micro-batch: one reduce-scatter per step
                with contextlib.nullcontext() if last_micro else strategy.no_sync():
                    (strategy.training_step(batch, k) / args.accumulate).backward()
            norm = strategy.optimizer_step(max_norm=args.max_norm)
            loss = strategy.reduced_loss("training").item()  # global token-weighted mean
            losses.append(loss)
            step = strategy.current_epoch_step.step
            if strategy.is_global_zero:
                print(f"step {step}: loss {loss:.6f} grad-norm {norm:.4f}", flush=True)
            if step % args.save_every == 0 or step == args.steps:
                strategy.save_checkpoint({"args": vars(args)}, ckpt_dir / checkpoint_name(step, args.format))
                old = sorted(p for p in ckpt_dir.glob("step_*") if p.name != checkpoint_name(step, args.format))
                for stale in old[: max(0, len(old) - args.keep + 1)]:
                    strategy.remove_checkpoint(stale)
            if step >= args.steps:
                break
    strategy.teardown()
    return losses


if __name__ == "__main__":
    main()

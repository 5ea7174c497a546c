"""A training script that survives a crash: run it under ``torchrun --max-restarts=1``.

It trains the demo GPT with FSDP2 on ``ResumableLoader`` batches, saving asynchronously every
``--every`` steps through a ``CheckpointManager``. On the first attempt (``TORCHELASTIC_RESTART_COUNT``
is 0), ``--kill-rank`` SIGKILLs itself after step ``--kill-at``: torchrun stops the other ranks and
restarts all of them, and the script resumes from the latest complete checkpoint. At the end rank 0
writes the full weights and optimizer state (``--out``/final.pt) and what each attempt did
(``--out``/attempts.jsonl), so a test can compare with an uninterrupted run.

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 \\
        tests/crash_train.py --out OUT --ckpt CKPT --kill-at 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeta_fsdp import fsdp, shutdown  # noqa: E402
from zeta_fsdp.data import ResumableLoader  # noqa: E402
from zeta_fsdp.models.gpt import Block, lm_loss, small  # noqa: E402
from zeta_fsdp.state_dict import CheckpointManager, get_full_state_dict, get_optimizer_state_dict  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 40, seq: int = 11, vocab: int = 37) -> None:
        g = torch.Generator().manual_seed(5)
        self.t = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.t[i, :-1], self.t[i, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.monotonic()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = fsdp(small(), auto_wrap=True, TransformerBlock=Block, shard_strat="FULL_SHARD")
    rank = torch.distributed.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loader = ResumableLoader(Tokens(), global_batch_size=8, seed=1)
    manager = CheckpointManager(
        args.ckpt, model, optimizer, every=args.every, keep_last=2, async_save=True, state={"data": loader}
    )
    step = start = manager.resume()  # 0 on the first launch; the latest complete checkpoint on a relaunch
    while step < args.steps:
        for x, y in loader:
            lm_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if attempt == 0 and step == args.kill_at and rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)  # a node dies: no exception, no clean-up
            if manager.after_step(step) or step == args.steps:
                break
        if manager.preemption is not None and manager.preemption.received is not None:
            break
    manager.close()
    full = {"model": get_full_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, full=True)}
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(full, args.out / "final.pt")
        record = {"attempt": attempt, "resumed_from": start, "steps": step, "seconds": time.monotonic() - started}
        with open(args.out / "attempts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    shutdown()


if __name__ == "__main__":
    main()

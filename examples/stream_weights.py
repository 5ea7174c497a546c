"""Weights out while training: trainer ranks stream their weights to a separate process that generates with them.

Run on 2 CPU trainer ranks (rank 0 starts the receiver process itself):
    torchrun --standalone --nproc-per-node 2 examples/stream_weights.py --steps 6 --every 2

The shape of an RL loop (the receiver stands for an inference engine such as vLLM): the trainers shard a tiny
Hugging Face Llama with ``fsdp()``, and after every ``--every`` optimizer steps call ``send_weights`` (every
trainer rank: the buckets are all-gathered over the training group; trainer rank 0 broadcasts each bucket to the
weights group). The receiver, a separate process holding a plain ``LlamaForCausalLM``, joins the weights group
(``weights_group``: a process group of its own, not part of the torchrun job), loads each round with
``receive_weights`` and generates a few tokens. It writes a digest of every tensor it received; trainer rank 0
checks them against ``get_full_state_dict`` of the same step, bit for bit, and exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeta_fsdp import fsdp, get_full_state_dict, shutdown  # noqa: E402
from zeta_fsdp.weights_out import receive_weights, send_weights, weights_group  # noqa: E402

VOCAB = 64


def config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip


def digests(state: dict) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in state.items()
    }


def receiver(args: argparse.Namespace) -> None:
    """The inference side: a plain model, filled by the trainers every round, generating with what it got."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(123)  # other weights than the trainers': everything it generates with must come from them
    model = LlamaForCausalLM(config()).eval()
    group = weights_group(args.receiver, rank=1, world_size=2)
    rounds = []
    for r in range(args.steps // args.every):
        receive_weights(model, group)
        prompt = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        print(f"receiver: round {r}: generated {out[0, 4:].tolist()}", flush=True)
        rounds.append(digests(model.state_dict()))
    Path(args.digests).write_text(json.dumps(rounds))


def start_receiver(args: argparse.Namespace) -> tuple:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, __file__, "--receiver", address, "--digests", args.digests]
    proc = subprocess.Popen([*cmd, "--steps", str(args.steps), "--every", str(args.every)], env=env)
    return weights_group(address, rank=0, world_size=2), proc


def trainer(args: argparse.Namespace) -> int:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = fsdp(LlamaForCausalLM(config()), auto_wrap=True, shard_strat="FULL_SHARD")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group, proc = start_receiver(args) if dist.get_rank() == 0 else (None, None)
    sent = []
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step % args.every == 0:
            nbytes = send_weights(model, group, bucket_mb=0.05)  # every trainer rank
            reference = get_full_state_dict(model)  # rank 0 gets it: what the receiver must now hold
            if dist.get_rank() == 0:
                sent.append(digests(reference))
                print(f"trainer: step {step}: sent {nbytes / 2**10:.0f} KiB", flush=True)
    ok = True
    if dist.get_rank() == 0:
        ok = proc.wait(timeout=120) == 0
        got = json.loads(Path(args.digests).read_text()) if ok else []
        ok = ok and got == sent
        print("receiver weights equal get_full_state_dict bit for bit:", ok, flush=True)
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    shutdown()
    return 0 if flag.item() else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--digests", default="stream_weights_digests.json", help="where the receiver writes them")
    parser.add_argument("--receiver", default=None, help=argparse.SUPPRESS)  # the receiver process: the address
    args = parser.parse_args(argv)
    if args.receiver:
        receiver(args)
        return 0
    return trainer(args)


if __name__ == "__main__":
    sys.exit(main())

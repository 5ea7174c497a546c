"""A receiver process for ``weights_out_cases.py``: a plain (unsharded) model that ``receive_weights`` fills.

``python tests/weights_receiver.py ADDRESS OUT [--wrong-shape] [--die-after-bucket N]``: joins the weights group
as rank 1, receives, writes its state dict to ``OUT`` (``torch.save``). ``--wrong-shape`` builds a model whose
head differs; ``--die-after-bucket N`` exits abruptly after loading N buckets (a receiver that dies mid-stream).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weights_out_cases import Odd  # noqa: E402

import zeta_fsdp.weights_out.transfer as transfer  # noqa: E402
from zeta_fsdp.weights_out import receive_weights, weights_group  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("out")
    parser.add_argument("--wrong-shape", action="store_true")
    parser.add_argument("--die-after-bucket", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(1)
    model = Odd()
    if args.wrong_shape:
        model.tiny = nn.Linear(6, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # nothing left from the model's own initialisation: every value must come from the trainer
    if args.die_after_bucket >= 0:
        load, loaded = transfer._load, [0]

        def dying(*a):
            load(*a)
            loaded[0] += 1
            if loaded[0] > args.die_after_bucket:
                os._exit(3)

        transfer._load = dying
    group = weights_group(args.address, rank=1, world_size=2, timeout_s=30)
    receive_weights(model, group, timeout_s=30)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()

"""`python -m zeta_fsdp consolidate`: argument parsing only; the work lives in the library modules.

Example:
    $ python -m zeta_fsdp consolidate checkpoints/step_100 model.safetensors
"""

from __future__ import annotations

import argparse

from . import cli


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dcp_dir", metavar="DIR", help="checkpoint directory written by save_checkpoint()")
    parser.add_argument("out", metavar="OUT", help="output file: *.safetensors (needs safetensors) or torch.save")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--hf", action="store_true", help="write OUT as a Hugging Face model directory")
    parser.add_argument("--config", metavar="DIR_OR_FILE", help="with --hf: the model's HF config (dir or config.json)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="with --hf: cast floating-point weights")
    parser.add_argument("--max-shard-size", default="5GB", help="with --hf: largest file (default 5GB)")


def _run(args: argparse.Namespace) -> int:
    # Imported here: `python -m zeta_fsdp --help` need not load torch.distributed.checkpoint.
    import torch

    from .state_dict import CheckpointError, consolidate_checkpoint

    try:
        if args.hf:
            from .hf import consolidate_to_hf

            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
            out = consolidate_to_hf(
                args.dcp_dir, args.out, config=args.config, dtype=dtype,
                max_shard_size=args.max_shard_size, overwrite=args.overwrite,
            )  # fmt: skip
            print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 2**20:.1f} MiB)")
            return 0
        out = consolidate_checkpoint(args.dcp_dir, args.out, overwrite=args.overwrite)
    except FileExistsError as e:
        raise cli.UsageError(f"{args.out} already exists; pass --overwrite to replace it.") from e
    except (FileNotFoundError, CheckpointError, ImportError, ValueError) as e:  # a corrupted checkpoint too: one line
        raise cli.UsageError(str(e)) from e
    except OSError as e:  # reading DIR or writing OUT failed (permissions, full disk); the error names the file
        raise cli.UsageError(str(e)) from e
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


cli.register(
    "consolidate",
    "turn a sharded checkpoint into one torch.save or .safetensors file of the model's weights",
    _add_arguments,
    _run,
)

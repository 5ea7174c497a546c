"""``python -m zeta_fsdp consolidate DIR OUT``: argument parsing only; the work is ``consolidate_checkpoint``."""

from __future__ import annotations

import argparse
import pickle

import torch

from ..hf import consolidate_to_hf
from ..state_dict import CheckpointError, consolidate_checkpoint
from .args import UsageError

HELP = "turn a sharded checkpoint into one torch.save or .safetensors file of the model's weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments (``DIR OUT [--overwrite] [--hf [--config C] [--dtype D] [--max-shard-size S]]``)."""
    parser.add_argument("dcp_dir", metavar="DIR", help="checkpoint directory written by save_checkpoint()")
    parser.add_argument("out", metavar="OUT", help="output file: *.safetensors (needs safetensors) or torch.save")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--hf", action="store_true", help="write OUT as a Hugging Face model directory")
    parser.add_argument("--config", metavar="DIR_OR_FILE", help="with --hf: the model's HF config (dir or config.json)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="with --hf: cast floating-point weights")
    parser.add_argument("--max-shard-size", help="with --hf: largest file (default 5GB)")


HF_ONLY = ("config", "dtype", "max_shard_size")


def run(args: argparse.Namespace) -> int:
    """Consolidate ``args.dcp_dir`` into ``args.out``; bad input raises ``UsageError`` (one line)."""
    given = [f"--{name.replace('_', '-')}" for name in HF_ONLY if getattr(args, name) is not None]
    if given and not args.hf:  # they shape a Hugging Face directory only: never ignore them silently
        raise UsageError(f"{', '.join(given)} apply(ies) to --hf output only; add --hf, or leave them out.")
    try:
        if args.hf:  # a Hugging Face model directory, streamed tensor by tensor
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
            options = dict(config=args.config, dtype=dtype, max_shard_size=args.max_shard_size or "5GB")
            out = consolidate_to_hf(args.dcp_dir, args.out, overwrite=args.overwrite, **options)
        else:
            out = consolidate_checkpoint(args.dcp_dir, args.out, overwrite=args.overwrite)
    except FileExistsError as e:
        if args.overwrite:  # refused even with --overwrite: say why
            raise UsageError(one_line(e)) from e
        raise UsageError(f"{args.out} already exists; pass --overwrite to replace it.") from e
    # A corrupted checkpoint, a missing extra, or reading DIR / writing OUT failed (the error names the file).
    except (CheckpointError, ImportError, ValueError, OSError) as e:
        raise UsageError(one_line(e)) from e
    # A record that holds a pickle (refused, never run), or sizes no machine can allocate: the file is bad.
    except (pickle.UnpicklingError, MemoryError, OverflowError) as e:
        raise UsageError(f"{args.dcp_dir} is not a usable checkpoint: {one_line(e)}") from e
    except RuntimeError as e:
        if "memory" not in str(e).lower() and "overflow" not in str(e).lower():
            raise
        raise UsageError(f"{args.dcp_dir} declares tensors too large to allocate: {one_line(e)}") from e
    size = sum(f.stat().st_size for f in out.iterdir()) if out.is_dir() else out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


def one_line(error: BaseException) -> str:
    """The error's message on one line (a message quoting a multi-line cause is joined with ``" | "``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " | ".join(lines) if lines else type(error).__name__

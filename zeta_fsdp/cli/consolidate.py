"""``python -m zeta_fsdp consolidate DIR OUT``: argument parsing only; the work is ``consolidate_checkpoint``.

Example:
    $ python -m zeta_fsdp consolidate checkpoints/step_100 model.safetensors
"""

from __future__ import annotations

import argparse

from .args import UsageError

HELP = "turn a sharded checkpoint into one torch.save or .safetensors file of the model's weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments (``DIR OUT [--overwrite]``).

    Example:
        >>> add_arguments(parser := argparse.ArgumentParser())
        >>> parser.parse_args(["ckpt", "out.pt"]).overwrite
        False
    """
    parser.add_argument("dcp_dir", metavar="DIR", help="checkpoint directory written by save_checkpoint()")
    parser.add_argument("out", metavar="OUT", help="output file: *.safetensors (needs safetensors) or torch.save")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    """Consolidate ``args.dcp_dir`` into ``args.out``; bad input raises ``UsageError`` (one line).

    Example:
        >>> run(argparse.Namespace(dcp_dir="/no/such/dir", out="x.pt", overwrite=False))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        zeta_fsdp.cli.args.UsageError: ...
    """
    # Imported here: `python -m zeta_fsdp --help` need not load torch.distributed.checkpoint.
    from ..state_dict import CheckpointError, consolidate_checkpoint

    try:
        out = consolidate_checkpoint(args.dcp_dir, args.out, overwrite=args.overwrite)
    except FileExistsError as e:
        raise UsageError(f"{args.out} already exists; pass --overwrite to replace it.") from e
    except (FileNotFoundError, CheckpointError, ImportError) as e:  # a corrupted checkpoint too: one line
        raise UsageError(str(e)) from e
    except OSError as e:  # reading DIR or writing OUT failed (permissions, full disk); the error names the file
        raise UsageError(str(e)) from e
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0

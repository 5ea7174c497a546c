"""The full-format checkpoint: one ``torch.save`` file written and read by rank 0; removing either format.

The file is the dict Lightning and NeMo checkpoint (``state_dict``, ``optimizer_states``, small
entries), ``FSDP2Strategy``'s default. Only rank 0 touches the disk; errors are raised on every rank.
"""

from __future__ import annotations

import inspect
import os
import pickle
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ..distributed import get_rank, is_distributed
from ..files import atomic_write
from .checkpoint import check_save_target
from .checks import CheckpointError, PathLike, checkpoint_on_all_ranks, from_rank0
from .publish import discard_checkpoint_dir, is_checkpoint, is_full_checkpoint

__all__ = ["TENSOR_KEYS", "read_full_checkpoint", "remove_checkpoint", "write_full_checkpoint"]

# The entries that hold tensors: rank 0 alone keeps them (load_full_state_dict and
# load_optimizer_state_dict broadcast them from rank 0); every rank gets the others.
TENSOR_KEYS = ("state_dict", "optimizer_states")


def write_full_checkpoint(
    filepath: PathLike,
    payload: Mapping[str, Any],
    *,
    checkpoint_io: Any = None,
    storage_options: Any = None,
    caller: str = "FSDP2Strategy.save_checkpoint()",
) -> None:
    """Rank 0 writes ``payload`` to ``filepath`` atomically (temporary file, then rename; none is left).
    ``checkpoint_io`` (Lightning's ``CheckpointIO``) replaces the writer and gets the path as given."""

    def write() -> None:
        if checkpoint_io is not None:
            # Lightning's CheckpointIO takes storage_options (NeMo passes it, None included); a minimal one may not
            try:
                params = inspect.signature(checkpoint_io.save_checkpoint).parameters
            except (TypeError, ValueError):  # no signature to read (a builtin): pass it only when given
                params = {}
            takes = "storage_options" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
            extra = {"storage_options": storage_options} if takes or storage_options is not None else {}
            checkpoint_io.save_checkpoint(dict(payload), filepath, **extra)
            return
        path = check_save_target(filepath, overwrite=True, caller=caller, full=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda tmp: torch.save(dict(payload), tmp))
        except Exception as e:  # noqa: BLE001 - torch's own messages do not name the path
            raise OSError(f"{caller}: cannot write {path}: {type(e).__name__}: {e}") from e

    checkpoint_on_all_ranks(write, rank0_only=True)


def _load_file(path: Path, weights_only: bool, caller: str) -> dict[str, Any]:
    """The package's one reader of a ``torch.save`` file: every failure a ``CheckpointError`` naming the path."""
    if not path.exists():
        raise FileNotFoundError(f"{caller}: {path} does not exist.")
    if path.is_dir():
        raise CheckpointError(f"{caller}: {path} is a directory but not a sharded checkpoint.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as e:
        reason = str(e).split("\n\n")[-1].strip().splitlines()[0] if str(e) else ""
        raise CheckpointError(
            f"{caller}: {path} holds objects torch.load(weights_only=True) refuses "
            f"({reason}); if you trust the file, load it with weights_only=False."
        ) from e
    except Exception as e:  # noqa: BLE001 - torch's zip/enforce errors do not name the path
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(
            f"{caller}: {path} is not a readable checkpoint file (truncated, or not "
            f"written by torch.save): {type(e).__name__}: {first}"
        ) from e
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f"{caller}: {path} holds a {type(ckpt).__name__}, not a dict.")
    return dict(ckpt)


def read_full_checkpoint(
    filepath: PathLike,
    *,
    checkpoint_io: Any = None,
    weights_only: Optional[bool] = True,
    caller: str = "FSDP2Strategy.load_checkpoint()",
) -> dict[str, Any]:
    """Rank 0 reads the file (``weights_only`` unless it is ``False``); every rank gets its small entries.
    Rank 0 alone keeps the tensors: other ranks get ``state_dict={}`` and one ``None`` per optimizer."""
    held: dict[str, Any] = {}

    def read() -> dict[str, Any]:
        if checkpoint_io is not None:
            held.update(checkpoint_io.load_checkpoint(filepath))
        else:
            held.update(_load_file(Path(filepath), weights_only is not False, caller))
        small = {k: v for k, v in held.items() if k not in TENSOR_KEYS}
        small["optimizer_states"] = len(held.get("optimizer_states") or [])
        return small

    small = from_rank0(read)
    if get_rank() == 0:
        return held
    return {**small, "state_dict": {}, "optimizer_states": [None] * small["optimizer_states"]}


def remove_checkpoint(
    filepath: PathLike, *, checkpoint_io: Any = None, caller: str = "FSDP2Strategy.remove_checkpoint()"
) -> None:
    """Delete a checkpoint (full-format file or sharded directory) on rank 0, once every rank got here; a symbolic
    link (NeMo's "last") is unlinked, anything not verifiably ours refused. ``checkpoint_io`` replaces all of this."""
    path = Path(filepath)

    def remove() -> None:
        if checkpoint_io is not None:
            checkpoint_io.remove_checkpoint(filepath)
        elif not str(filepath).strip():
            raise ValueError(f"{caller}: filepath={str(filepath)!r} is empty.")
        elif path.is_symlink():
            if path.exists() and not (is_checkpoint(path) or is_full_checkpoint(path)):
                raise CheckpointError(
                    f"{caller}: {path} is a symbolic link to {os.path.realpath(path)}, which is not a checkpoint; "
                    "refusing to remove it."
                )
            path.unlink()  # the link only, as NeMo does: the checkpoint it points to stays
        elif path.is_dir():
            discard_checkpoint_dir(path, caller)
        elif path.exists():
            if not is_full_checkpoint(path):
                raise CheckpointError(
                    f"{caller}: {path} is not a checkpoint file (not written by torch.save); refusing to delete it."
                )
            path.unlink()

    if is_distributed():
        dist.barrier()  # no rank may still be reading it
    checkpoint_on_all_ranks(remove, rank0_only=True)

"""Names, shapes and agreement across ranks: what every other part of the checkpoint package checks with."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException

from ..distributed import get_world_size, is_distributed, on_all_ranks

PathLike = Union[str, os.PathLike]
# DCP's CheckpointException derives from BaseException, not Exception: catch it explicitly.
FAILURES = (Exception, CheckpointException)

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
EXTRA_KEY = "extra"
# {"keys": the model's keys in order, "tied": {alias: first name}}: a tied tensor is written once,
# under its first name; consolidation restores every name, in the unwrapped model's order.
LAYOUT_KEY = "model_layout"
# All param-group options in one record (rank 0's): hundreds of tiny records otherwise, each one
# read back by every rank.
PACKED_GROUPS_KEY = "optim.param_groups"
STATE_PREFIX = "state."
GROUPS_PREFIX = "param_groups."
METADATA_FILE = ".metadata"
# Wrapper modules that insert a name into parameter paths (activation checkpointing, torch.compile,
# FSDP1). The façade adds none of them, but a user's own wrapping may.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class CheckpointError(ValueError):
    """A checkpoint or state dict that cannot be used (not a checkpoint, corrupted, or of another model), raised
    before the live model or optimizer is changed.

    Example:
        try:
            load_checkpoint("ckpt/other_model", model)
        except CheckpointError as e:
            print(e)  # names the path and the mismatching keys/shapes
    """


def error_reason(error: BaseException) -> str:
    """One readable line per failing rank (DCP's exception text holds every rank's traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(error.failures.items())
        )
    return f"{type(error).__name__}: {error}" if not isinstance(error, CheckpointError) else str(error)


def checkpoint_on_all_ranks(fn: Callable[[], Any], *, rank0_only: bool = False) -> Any:
    """``distributed.on_all_ranks`` (an error on any rank raised on every rank) for checkpoint code:
    DCP's exceptions count and read as one line per failing rank; other error types arrive as ``CheckpointError``.
    """
    return on_all_ranks(
        fn,
        rank0_only=rank0_only,
        errors=(CheckpointError, ImportError),
        catch=FAILURES,
        default=CheckpointError,
        describe=lambda e: error_reason(e) if isinstance(e, CheckpointException) else str(e),
    )


def from_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0 alone, its result (it must pickle) or its error given to every rank."""
    result = checkpoint_on_all_ranks(fn, rank0_only=True)
    if is_distributed() and get_world_size() > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result


def clean_fqn(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every name of every parameter (tied ones too), without wrapper prefixes."""
    return {clean_fqn(name): param for name, param in model.named_parameters(remove_duplicate=False)}


def shape_of(value: Any) -> Optional[tuple[int, ...]]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... and {len(names) - limit} more' if len(names) > limit else ''}]"


def foreign_entries(path: PathLike, ours: Callable[[os.DirEntry], bool]) -> str:
    """The entries of the directory ``path`` that ``ours`` rejects, named for an error ("" when none)."""
    foreign = [
        entry.name + ("/" if entry.is_dir(follow_symlinks=False) else "")
        for entry in sorted(os.scandir(path), key=lambda entry: entry.name)
        if not ours(entry)
    ]
    return ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")


def describe_mismatch(
    got: Mapping[str, Optional[tuple]], want: Mapping[str, Optional[tuple]], source: str, strict: bool
) -> str:
    """What differs between two ``{key: shape}`` maps, in words; empty when they match."""
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    shapes = [
        f"{k}: {source} {list(got[k])} vs model {list(want[k])}"
        for k in want
        if k in got and got[k] is not None and want[k] is not None and got[k] != want[k]
    ]
    parts = []
    if strict and missing:
        parts.append(f"missing keys (in the model, not in the {source}): {short_list(missing)}")
    if strict and unexpected:
        parts.append(f"unexpected keys (in the {source}, not in the model): {short_list(unexpected)}")
    if shapes:
        parts.append(f"shape mismatches: {short_list(shapes)}")
    return "; ".join(parts)

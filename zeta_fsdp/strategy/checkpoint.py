"""The strategy's full-format checkpoint file: write, read, check, remove (plain functions).

A full-format checkpoint is one ``torch.save`` file written by rank 0, holding ``state_dict``
(full tensors keyed by FQN), ``optimizer_states`` (full, keyed by FQN), the caller's entries and
``META_KEY`` (format, optimizer classes, sizes). Every function here that touches the disk does
so on rank 0 and makes every rank raise the same error (``distributed.on_all_ranks``), naming
the path, before anything the user owns is changed. The sharded format is
``zeta_fsdp.state_dict``'s DCP directory.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import state_dict as sd
from ..distributed import get_rank, get_world_size, on_all_ranks
from ..files import atomic_write
from ..state_dict import CheckpointError, is_checkpoint
from ..state_dict.publish import discard_checkpoint_dir, removal_problem

__all__ = [
    "Gathered",
    "META_KEY",
    "Restored",
    "SHARDED_REF",
    "check_optimizers_match",
    "check_save_target",
    "check_weights_only_loadable",
    "is_full_checkpoint",
    "load_model_weights",
    "load_strategy_checkpoint",
    "read_full_checkpoint",
    "remove_checkpoint",
    "restore_optimizer_states",
    "save_strategy_checkpoint",
    "write_full_checkpoint",
]

PathLike = Union[str, os.PathLike]
# Where the strategy's own bookkeeping lives inside a checkpoint.
META_KEY = "zeta_fsdp"
# An optimizer entry that points at a sharded (DCP) checkpoint directory.
SHARDED_REF = "zeta_fsdp_sharded_checkpoint"
_TENSORS = ("state_dict", "optimizer_states")


class Restored(dict):
    """A state dict ``load_checkpoint`` already loaded into the model: ``load_model_weights`` skips it."""


class Gathered(dict):
    """A state the strategy gathered for a checkpoint: ``save_strategy_checkpoint`` reuses it, never gathers twice."""


def is_full_checkpoint(path: PathLike) -> bool:
    """``True`` if ``path`` is a file written by ``torch.save`` (a zip archive with a pickle in it)."""
    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def check_save_target(filepath: PathLike, checkpoint_format: str, caller: str) -> Path:
    """The path to save to, refused when saving there would fail or destroy something else."""
    if not str(filepath).strip():
        raise ValueError(f"FSDP2Strategy.{caller}(): filepath={str(filepath)!r} is empty; pass the checkpoint's path.")
    path = Path(filepath)

    def check() -> None:
        if checkpoint_format == "sharded" and path.is_file():
            kind = "a full-format checkpoint" if is_full_checkpoint(path) else "a file that is not a checkpoint"
            raise FileExistsError(
                f"FSDP2Strategy.{caller}(): {path} is {kind}; a sharded (checkpoint_format='sharded') save "
                "writes a directory. Remove it or save elsewhere."
            )
        if checkpoint_format == "full" and path.is_file() and not is_full_checkpoint(path):
            raise CheckpointError(
                f"FSDP2Strategy.{caller}(): {path} is a file that is not a checkpoint (not written by torch.save); "
                "refusing to replace it. Save elsewhere, or remove it yourself."
            )
        if checkpoint_format == "full" and path.is_dir():
            kind = "a sharded checkpoint directory" if is_checkpoint(path) else "a directory"
            raise IsADirectoryError(
                f"FSDP2Strategy.{caller}(): {path} is {kind}; a full-format save writes one file. "
                "Remove it, save elsewhere, or use checkpoint_format='sharded'."
            )

    on_all_ranks(check, rank0_only=True, errors=(CheckpointError,))
    return path


def check_weights_only_loadable(entries: Mapping[str, Any], caller: str) -> None:
    """Refuse entries that ``torch.load(weights_only=True)`` would not read back, now rather than at resume."""
    buffer = io.BytesIO()
    try:
        torch.save(dict(entries), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported with torch's reason
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TypeError(
            f"FSDP2Strategy.{caller}(): the checkpoint's entries must load with torch.load(weights_only=True): "
            f"tensors, numbers, strings, None and lists/tuples/dicts of them. {reason}"
        ) from e


def write_full_checkpoint(
    filepath: PathLike, payload: Mapping[str, Any], *, checkpoint_io: Any = None, storage_options: Any = None
) -> None:
    """Rank 0 writes ``payload`` to ``filepath`` atomically (temporary file, then rename); every rank
    raises if it failed, no temporary file is left and a checkpoint already there is kept.

    ``checkpoint_io`` (Lightning's ``CheckpointIO``) replaces the writer and gets the path as given.
    """
    path = Path(filepath)

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
        if path.is_file() and not is_full_checkpoint(path):
            raise CheckpointError(
                f"FSDP2Strategy.save_checkpoint(): {path} is a file that is not a checkpoint (not written by "
                "torch.save); refusing to replace it. Save elsewhere, or remove it yourself."
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda tmp: torch.save(dict(payload), tmp))
        except Exception as e:  # noqa: BLE001 - torch's own messages do not name the path
            raise OSError(f"FSDP2Strategy.save_checkpoint(): cannot write {path}: {type(e).__name__}: {e}") from e

    on_all_ranks(write, rank0_only=True, errors=(CheckpointError,))


def _torch_load(path: Path, weights_only: bool) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"FSDP2Strategy.load_checkpoint(): {path} does not exist.")
    if path.is_dir():
        raise CheckpointError(f"FSDP2Strategy.load_checkpoint(): {path} is a directory but not a sharded checkpoint.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as e:
        reason = str(e).split("\n\n")[-1].strip().splitlines()[0] if str(e) else ""
        raise CheckpointError(
            f"FSDP2Strategy.load_checkpoint(): {path} holds objects torch.load(weights_only=True) refuses "
            f"({reason}); if you trust the file, load it with weights_only=False."
        ) from e
    except Exception as e:  # noqa: BLE001 - torch's zip/enforce errors do not name the path
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(
            f"FSDP2Strategy.load_checkpoint(): {path} is not a readable checkpoint file (truncated, or not "
            f"written by torch.save): {type(e).__name__}: {first}"
        ) from e
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f"FSDP2Strategy.load_checkpoint(): {path} holds a {type(ckpt).__name__}, not a dict.")
    return dict(ckpt)


def read_full_checkpoint(
    filepath: PathLike, *, checkpoint_io: Any = None, weights_only: Optional[bool] = True
) -> dict[str, Any]:
    """Rank 0 reads the file; every rank gets its small entries, rank 0 alone keeps the tensors.

    Other ranks get ``state_dict={}`` and one ``None`` per optimizer state. A missing, truncated or
    foreign file raises the same error on every rank, naming the path.
    """
    path = Path(filepath)

    def read() -> dict[str, Any]:
        if checkpoint_io is not None:
            return dict(checkpoint_io.load_checkpoint(filepath))
        return _torch_load(path, weights_only is not False)

    ckpt = on_all_ranks(read, rank0_only=True, errors=(CheckpointError,))
    if get_world_size() == 1:
        return ckpt
    small = None
    if get_rank() == 0:
        small = {k: v for k, v in ckpt.items() if k not in _TENSORS}
        small["optimizer_states"] = len(ckpt.get("optimizer_states") or [])
    box = [small]
    dist.broadcast_object_list(box, src=0)
    if get_rank() == 0:
        return ckpt
    ckpt = box[0]
    ckpt["state_dict"] = {}
    ckpt["optimizer_states"] = [None] * ckpt["optimizer_states"]
    return ckpt


def check_optimizers_match(optimizers: Sequence[torch.optim.Optimizer], ckpt: Mapping[str, Any], source: Any) -> None:
    """The live optimizers are the kind the checkpoint saved: count and class, before anything changes.

    Every rank decides alike: it reads only entries every rank holds (``META_KEY``).
    """
    meta = ckpt.get(META_KEY) or {}
    saved = meta.get("optimizer_classes")
    count = len(ckpt.get("optimizer_states") or [])
    if not count or not optimizers:
        return  # nothing to restore, or optimizers created later (checked when restored)
    if count != len(optimizers):
        raise CheckpointError(
            f"FSDP2Strategy.load_checkpoint(): {source} holds the state of {count} optimizer(s), but "
            f"{len(optimizers)} exist(s)."
        )
    live = [type(o).__name__ for o in optimizers]
    if saved is not None and list(saved) != live:
        raise CheckpointError(
            f"FSDP2Strategy.load_checkpoint(): {source} was saved by optimizer(s) {list(saved)}, but the "
            f"optimizer(s) are {live}; create the same optimizer class to resume (nothing was changed)."
        )


def remove_checkpoint(filepath: PathLike, *, checkpoint_io: Any = None) -> None:
    """Delete a checkpoint (full-format file or sharded directory) on rank 0; refuse anything else.

    A missing path is nothing to do. A symbolic link (NeMo keeps its "last" checkpoints as links)
    is unlinked itself when it points to a checkpoint or nowhere; what it points to is never
    touched. A directory that is not verifiably a sharded checkpoint written by this library
    (``state_dict.metadata.checkpoint_problem``: validated metadata, nothing but shard files), or
    a file that is not a ``torch.save`` archive, raises ``CheckpointError`` (a ``ValueError``) on
    every rank naming the path and why, and is left untouched.
    """
    path = Path(filepath)
    caller = "FSDP2Strategy.remove_checkpoint()"

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
            problem = removal_problem(path)
            if problem is not None:
                raise CheckpointError(
                    f"{caller}: {path} is a directory but not a sharded checkpoint written by this library "
                    f"({problem}); refusing to delete it."
                )
            discard_checkpoint_dir(path)
        elif path.exists():
            if not is_full_checkpoint(path):
                raise CheckpointError(
                    f"{caller}: {path} is not a checkpoint file (not written by torch.save); refusing to delete it."
                )
            path.unlink()

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank may still be reading it
    on_all_ranks(remove, rank0_only=True, errors=(CheckpointError,))


def _meta(strategy: Any, checkpoint_format: str) -> dict[str, Any]:
    return {
        "format": checkpoint_format,
        "optimizers": len(strategy.optimizers),
        "optimizer_classes": [type(o).__name__ for o in strategy.optimizers],
        "data_parallel_size": strategy.data_parallel_size,
        "tensor_parallel_size": strategy.tensor_parallel_size,
    }


def save_strategy_checkpoint(
    strategy: Any, checkpoint: Mapping[str, Any], filepath: PathLike, storage_options: Any = None
) -> None:
    """``FSDP2Strategy.save_checkpoint``: the live model, every optimizer and ``checkpoint``'s other entries.

    ``strategy`` is a parallelized ``FSDP2Strategy`` (its public attributes only). Weights and
    optimizer states are gathered collectively unless ``checkpoint`` holds ``Gathered`` ones
    (Lightning asks for them first). The full format is one file (``write_full_checkpoint``);
    the sharded format a DCP directory written by every rank.
    """
    fmt = strategy.checkpoint_format
    module, optimizers = strategy.model, strategy.optimizers
    extras = {k: v for k, v in checkpoint.items() if k not in _TENSORS}
    step = strategy.current_epoch_step
    extras.setdefault("epoch", step.epoch)
    extras.setdefault("global_step", int(step))
    if strategy.lr_schedulers and "lr_schedulers" not in extras:
        extras["lr_schedulers"] = [s.state_dict() for s in strategy.lr_schedulers]
    extras[META_KEY] = _meta(strategy, fmt)
    if strategy.entries_weights_only:
        on_all_ranks(lambda: check_weights_only_loadable(extras, "save_checkpoint"))
    if fmt == "sharded":
        if len(optimizers) > 1:
            raise NotImplementedError("FSDP2Strategy: the sharded format saves one optimizer; use the full format.")
        save = strategy.sharded_saver()  # save_checkpoint, or an AsyncCheckpointer's save (async_save=True)
        save(Path(filepath), module, optimizers[0] if optimizers else None, extra=extras, overwrite=True)
        strategy.after_sharded_save(Path(filepath))
        return
    given, given_optim = checkpoint.get("state_dict"), checkpoint.get("optimizer_states")
    reuse = isinstance(given, Gathered) and isinstance(given_optim, (list, tuple))
    reuse = reuse and len(given_optim) == len(optimizers) and all(isinstance(o, Gathered) for o in given_optim)
    payload = dict(extras)
    payload["state_dict"] = dict(given) if reuse else sd.get_full_state_dict(module)
    payload["optimizer_states"] = (
        [dict(o) for o in given_optim]
        if reuse
        else [sd.get_optimizer_state_dict(module, o, full=True) for o in optimizers]
    )
    write_full_checkpoint(filepath, payload, checkpoint_io=strategy.checkpoint_io, storage_options=storage_options)


def load_strategy_checkpoint(strategy: Any, filepath: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """``FSDP2Strategy.load_checkpoint``: either format (detected on disk), checked before anything changes.

    The optimizers are checked against the checkpoint first (count and class); then the weights
    are restored, the optimizer state queued (``strategy.load_optimizer_state_dict``), and
    ``current_epoch_step`` and the LR schedulers restored. Every rank raises alike, naming the path.
    """
    path = Path(filepath)
    module = strategy.model
    errors = (CheckpointError,)
    if strategy.checkpoint_io is None and on_all_ranks(lambda: is_checkpoint(path)):
        meta = on_all_ranks(lambda: sd.load_checkpoint(path, module, model_weights=False) or {}, errors=errors)
        ckpt = dict(meta)
        count = ckpt.get(META_KEY, {}).get("optimizers", 0)
        ckpt["optimizer_states"] = [{SHARDED_REF: str(path)} for _ in range(count)]
        check_optimizers_match(strategy.optimizers, ckpt, path)
        on_all_ranks(lambda: sd.load_checkpoint(path, module), errors=errors)
        ckpt["state_dict"] = sd.get_sharded_state_dict(module)
    else:
        ckpt = read_full_checkpoint(filepath, checkpoint_io=strategy.checkpoint_io, weights_only=weights_only)
        check_optimizers_match(strategy.optimizers, ckpt, path)
        strategy.load_model_state_dict(ckpt, strict=True)
    ckpt["state_dict"] = Restored(ckpt.get("state_dict") or {})  # Lightning hands it back: not loaded twice
    if ckpt.get("optimizer_states"):
        strategy.load_optimizer_state_dict(ckpt)
    strategy.current_epoch_step = (ckpt.get("epoch", 0), ckpt.get("global_step", 0))
    for scheduler, state in zip(strategy.lr_schedulers, ckpt.get("lr_schedulers", [])):
        scheduler.load_state_dict(state)
    return ckpt


def load_model_weights(module: torch.nn.Module, ckpt: Any, strict: bool = True) -> None:
    """``ckpt["state_dict"]`` (or ``ckpt`` itself) into the sharded ``module``, now.

    A full state dict (plain tensors) is sharded into the live model, rank 0's copy used (other
    ranks may pass ``{}``); a sharded one (DTensors) loads shard by shard. Keys and shapes are
    checked first (``strict``): on a mismatch nothing changes.
    """
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, Mapping) else ckpt
    if isinstance(state, Restored):
        return
    state = {} if state is None else state
    if any(isinstance(v, DTensor) for v in state.values()):
        sd.load_sharded_state_dict(module, state, strict=strict)
    else:
        sd.load_full_state_dict(module, state, broadcast_from_rank0=True, strict=strict)


def restore_optimizer_states(module: torch.nn.Module, optimizers: Sequence[Any], pending: Sequence[Any]) -> None:
    """Load queued optimizer states (full, keyed by FQN, rank 0's copy; or a sharded-checkpoint reference)."""
    if len(pending) != len(optimizers):
        raise RuntimeError(
            f"FSDP2Strategy: the checkpoint holds the state of {len(pending)} optimizer(s), but "
            f"{len(optimizers)} exist(s). Create the optimizers (setup_optimizers / configure_optimizers) "
            "before the first training step."
        )
    for optimizer, state in zip(optimizers, pending):
        if isinstance(state, Mapping) and SHARDED_REF in state:
            # the optimizer only: the weights were restored by load_checkpoint(), and anything
            # loaded since (load_model_state_dict) must not be overwritten by the old weights
            sd.load_checkpoint(state[SHARDED_REF], module, optimizer, model_weights=False)
        else:
            sd.load_optimizer_state_dict(module, optimizer, state, full=True, broadcast_from_rank0=True)

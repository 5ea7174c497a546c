"""``save_checkpoint`` / ``load_checkpoint``: one DCP directory holding model, optimizer state and ``extra``."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..distributed import get_rank, is_distributed
from ..files import PathLock, end_stage, incomplete_path, stage_dir
from ..ties import tied_aliases
from .checks import (
    EXTRA_KEY,
    FAILURES,
    GROUPS_PREFIX,
    LAYOUT_KEY,
    METADATA_FILE,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    PACKED_GROUPS_KEY,
    STATE_PREFIX,
    CheckpointError,
    PathLike,
    checkpoint_on_all_ranks,
    describe_mismatch,
    error_reason,
    named_parameters,
    shape_of,
)
from .model import get_sharded_state_dict
from .optimizer import (
    check_group_consistency,
    flat_optimizer_state,
    optimizer_scratch,
    set_flat_optimizer_state,
    validate_optimizer,
)
from .publish import (
    LOCK_WAIT_S,
    checkpoint_files,
    checkpoint_problem,
    is_checkpoint,
    is_full_checkpoint,
    publish_checkpoint,
    recover,
)
from .reader import dcp_load, open_checkpoint, read_checked

# Types ``torch.load(weights_only=True)`` always accepts (a dict key too). Objects built only of
# these need no ``torch.save``/``torch.load`` round trip to know that they load back.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _plainly_loadable(obj: Any, depth: int = 0) -> bool:
    """``True`` if ``obj`` is plain values, CPU tensors, and lists/tuples/dicts of them (nothing to round-trip)."""
    if depth > 32:
        return False
    if type(obj) in _PLAIN:  # exact types: a subclass (an IntEnum, numpy.float64) takes the round trip
        return True
    if type(obj) is torch.Tensor:  # so does a tensor subclass (DTensor, Parameter)
        return obj.device.type == "cpu" and obj.layout == torch.strided and not obj.is_quantized and not obj.__dict__
    if type(obj) in (list, tuple):
        return all(_plainly_loadable(v, depth + 1) for v in obj)
    if type(obj) is dict:
        return all(type(k) in _PLAIN and _plainly_loadable(v, depth + 1) for k, v in obj.items())
    return False


def check_loadable(obj: Any, what: str, caller: str = "save_checkpoint()") -> None:
    """``obj`` must come back through ``torch.load(weights_only=True)``: refuse it now, not at resume."""
    if isinstance(obj, list):  # param groups: the parameters themselves are stored by name, not here
        obj = [{k: v for k, v in group.items() if k != "params"} for group in obj]
    if _plainly_loadable(obj):
        return
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported with the reason torch gives
        raise TypeError(
            f"{caller}: {what} must be loadable with torch.load(weights_only=True): tensors, "
            "numbers, strings, None, and lists/tuples/dicts of them (convert numpy arrays to "
            f"tensors or lists). {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    extra: Any = None,
    overwrite: bool = False,
) -> Path:
    """Save a sharded checkpoint with DCP: every rank writes its own shards, in parallel.

    Call on every rank. Holds the model, the optimizer state keyed by parameter FQN, and ``extra``
    (anything ``torch.load(weights_only=True)`` accepts; saved from rank 0). Written beside ``path``
    and renamed into place, so a crash never leaves a complete-looking checkpoint. An existing
    checkpoint is refused unless ``overwrite=True``, and replaced only once the new one is complete.
    A failed save removes what it wrote. Returns ``path``.

    Example:
        save_checkpoint(f"ckpt/step_{step}", model, optimizer,
                        extra={"step": step, "rng": torch.get_rng_state()})
    """
    path = Path(path)
    lock = start_save(path, optimizer, extra, overwrite=overwrite)
    try:
        state = checkpoint_state(model, optimizer, extra)
        try:
            # DCP's own collectives carry a failure on any rank to every rank: no extra agreement needed.
            writer = FileSystemWriter(incomplete_path(path))
            planner = DefaultSavePlanner(flatten_state_dict=False)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=not is_distributed())
        except FAILURES as e:
            raise save_failure(path, f"writing {path}", e) from e
        try:  # rank 0 publishes; no rank returns before the checkpoint is in place
            checkpoint_on_all_ranks(lambda: publish_checkpoint(path, replace=overwrite) if get_rank() == 0 else None)
        except FAILURES as e:
            raise save_failure(path, f"renaming {incomplete_path(path)} to {path}", e) from e
    finally:
        end_save(path, lock)
    return path


# The steps of a save (``AsyncCheckpointer`` runs the same ones, the write in the background).


def start_save(
    path: Path, optimizer: Optional[torch.optim.Optimizer], extra: Any, *, overwrite: bool
) -> Optional[PathLock]:
    """Check ``extra`` and the optimizer's options load back, then ``prepare_save_dir``, in one collective;
    returns rank 0's held ``PathLock`` of ``path`` (``None`` elsewhere), for ``end_save``."""
    holder: list[Optional[PathLock]] = []

    def start() -> Optional[PathLock]:
        check_loadable(extra, "extra")
        if optimizer is not None:
            check_loadable(list(optimizer.param_groups), "the optimizer's param_groups")
        lock = prepare_save_dir(path, overwrite=overwrite)
        holder.append(lock)  # None off rank 0: end_save ignores it
        return lock

    try:
        return checkpoint_on_all_ranks(start)
    except FAILURES:
        for lock in holder:  # rank 0 prepared, another rank refused: nothing stays behind
            end_save(path, lock)
        raise


def end_save(path: Path, lock: Optional[PathLock]) -> None:
    """Rank 0, after a save: ``files.end_stage`` (what a failed save left in ``.<name>.incomplete`` goes,
    ``.metadata`` first; a published one left nothing there), then the lock is released."""
    if lock is None:
        return
    tmp = incomplete_path(path)
    with contextlib.suppress(OSError):  # end_stage releases the lock whatever happens
        end_stage(path, lock, checkpoint_files(tmp), first=(METADATA_FILE,))


def check_save_target(
    path: PathLike, *, overwrite: bool, caller: str = "save_checkpoint()", full: bool = False
) -> Path:
    """Refuse to save at ``path`` what would fail there or destroy something that is not a checkpoint of ours.
    A sharded save replaces only an empty folder or (``overwrite``) our checkpoint, a link counting as its
    target (only the link is replaced); a ``full`` one (a ``torch.save`` file) only such a file."""
    if not str(path).strip():
        raise ValueError(f"{caller}: filepath={str(path)!r} is empty; pass the checkpoint's path.")
    path = Path(path)
    if full:
        _check_full_target(path, caller)
    elif _holds_our_checkpoint(path, caller) and not overwrite and os.path.exists(path):
        raise FileExistsError(f"{caller}: a checkpoint already exists at {path}; pass overwrite=True to replace it.")
    return path


def _check_full_target(path: Path, caller: str) -> None:
    """A full-format save may write ``path``: nothing there, or a ``torch.save`` file."""
    if path.is_dir():
        kind = "a sharded checkpoint directory" if is_checkpoint(path) else "a directory"
        raise IsADirectoryError(
            f"{caller}: {path} is {kind}; a full-format save writes one file. "
            "Remove it, save elsewhere, or use checkpoint_format='sharded'."
        )
    if path.is_file() and not is_full_checkpoint(path):
        raise CheckpointError(
            f"{caller}: {path} is a file that is not a checkpoint (not written by torch.save); "
            "refusing to replace it. Save elsewhere, or remove it yourself."
        )


def _holds_our_checkpoint(path: Path, caller: str) -> bool:
    """For a sharded save: ``False`` where nothing would be replaced (no ``path``, an empty folder),
    ``True`` for our checkpoint (or a link to one, or a dangling link); anything else is refused."""
    if not os.path.lexists(path):
        return False
    if path.is_symlink():
        if not is_checkpoint(path) and os.path.exists(path):
            raise CheckpointError(
                f"{caller}: {path} is a symbolic link to {os.path.realpath(path)}, which is not a checkpoint; "
                "refusing to replace it. Save elsewhere, or remove the link yourself."
            )
        return True
    if path.is_dir() and not any(path.iterdir()):
        return False
    if is_full_checkpoint(path):
        raise FileExistsError(
            f"{caller}: {path} is a full-format checkpoint; a sharded (checkpoint_format='sharded') save "
            "writes a directory. Remove it or save elsewhere."
        )
    if not path.is_dir():
        raise CheckpointError(
            f"{caller}: {path} exists and is a file, not a checkpoint; refusing to replace it. Save elsewhere."
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(
            f"{caller}: {path} exists and is not a checkpoint written by this library ({problem}); "
            "refusing to replace it. Save elsewhere, or remove it yourself if it is yours to delete."
        )
    return True


def prepare_save_dir(path: Path, *, overwrite: bool) -> Optional[PathLock]:
    """Rank 0: ``stage_dir``: lock ``path``, finish an interrupted overwrite, check it may be written
    (``check_save_target``), make an empty ``.<name>.incomplete`` beside it. The held lock (``None`` off rank 0)
    makes two jobs take turns."""
    if get_rank() != 0:
        return None

    def check(target: Path) -> None:
        recover(target, locked=True)
        check_save_target(target, overwrite=overwrite)

    try:
        lock = stage_dir(path, ours=checkpoint_files(incomplete_path(path)), check=check, timeout_s=LOCK_WAIT_S)
    except (CheckpointError, FileExistsError):
        raise
    except OSError as e:  # a read-only folder, a file system without locks: the message says which
        raise CheckpointError(f"save_checkpoint(): cannot save to {path}: {e}") from e
    if lock is None:
        raise CheckpointError(
            f"save_checkpoint(): another process has been saving to {path} for {LOCK_WAIT_S:.0f} s (it holds "
            f"{PathLock(path).file}); nothing was saved. Save to another path, or wait for that job."
        )
    return lock


def checkpoint_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: Any) -> dict[str, Any]:
    """What one rank writes: its model shards (a tied tensor once), optimizer shards, and on rank 0 the records.
    The tensors are the live ones (no copy): write them before the next optimizer step, or stage them."""
    model_sd = get_sharded_state_dict(model)
    tied = {alias: source for alias, source in tied_aliases(named_parameters(model)).items() if alias in model_sd}
    state: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in model_sd.items() if k not in tied}
    if get_rank() == 0:
        state[LAYOUT_KEY] = {"keys": list(model_sd), "tied": tied}
    if optimizer is not None:
        flat = flat_optimizer_state(model, optimizer)
        state.update({OPTIM_PREFIX + k: v for k, v in flat.items() if not k.startswith(GROUPS_PREFIX)})
        if get_rank() == 0:
            state[PACKED_GROUPS_KEY] = {k: v for k, v in flat.items() if k.startswith(GROUPS_PREFIX)}
    if extra is not None and get_rank() == 0:
        state[EXTRA_KEY] = extra
    return state


def save_failure(path: Path, what: str, error: BaseException) -> CheckpointError:
    """The error a failed save raises: what failed, and whether the checkpoint already at ``path`` is intact."""
    kept = " The checkpoint already there is untouched." if is_checkpoint(path) else ""
    return CheckpointError(f"save_checkpoint(): {what} failed; nothing was saved.{kept} {error_reason(error)}")


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    strict: bool = True,
    model_weights: bool = True,
) -> Any:
    """Restore ``model`` (and ``optimizer``) in place from ``save_checkpoint``; return the saved ``extra``.

    Call on every rank; any world size and sharding strategy. Before anything changes, the
    checkpoint is checked against the model, the optimizer and its files, and every record's
    CRC-32 on every rank. Returns ``None`` when no ``extra`` was saved. ``model_weights=False``
    restores the optimizer only (the weights are neither read nor changed).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: not a checkpoint, corrupted or truncated, or of another model/optimizer.

    Example:
        extra = load_checkpoint("ckpt/step_100", model, optimizer)
        start_step = extra["step"]
        load_checkpoint("ckpt/step_100", model, optimizer, model_weights=False)  # optimizer only
    """
    path = Path(path)
    live = get_sharded_state_dict(model)
    metadata, objects, stored = checkpoint_on_all_ranks(lambda: _check_model(path, live, strict))
    targets, via_scratch = _model_targets(model, live, stored) if model_weights else ({}, {})
    was_fresh = optimizer is not None and not optimizer.state
    try:
        if optimizer is not None:
            optim_scratch = _optimizer_scratch(path, metadata, objects, model, optimizer)
            targets.update({OPTIM_PREFIX + k: v for k, v in optim_scratch.items() if k.startswith(STATE_PREFIX)})
        try:
            checked = checkpoint_on_all_ranks(lambda: read_checked(targets, path, metadata))
        except FAILURES as e:
            raise CheckpointError(
                f"{_LOAD}: reading {path} failed; the model and optimizer were not changed. {error_reason(e)}"
            ) from e
        if optimizer is not None:
            checked.commit(lambda key: key.startswith(OPTIM_PREFIX))  # into scratch: the live state is untouched
            flat_optim = {k: v for k, v in optim_scratch.items() if not k.startswith(STATE_PREFIX)}
            flat_optim.update({k[len(OPTIM_PREFIX) :]: v for k, v in targets.items() if k.startswith(OPTIM_PREFIX)})
            checkpoint_on_all_ranks(lambda: check_group_consistency(model, optimizer, flat_optim))
    except FAILURES:
        if was_fresh:
            optimizer.state.clear()  # validation created its state: back to the fresh optimizer we were given
        raise
    # Commit: every rank read and checked everything.
    checked.commit()
    if via_scratch:
        set_model_state_dict(
            model, {k: targets[key] for k, key in via_scratch.items()}, options=StateDictOptions(strict=False)
        )
    if optimizer is not None:
        set_flat_optimizer_state(model, optimizer, flat_optim)
    return objects.get(EXTRA_KEY)


_LOAD = "load_checkpoint()"


def _check_model(path: Path, live: dict[str, Any], strict: bool) -> tuple[Metadata, dict[str, Any], dict[str, str]]:
    """Every check that needs no optimizer, in one collective: the files, the small non-tensor records (options,
    ``extra``, layout; read on this rank alone before the real load), the model's keys and shapes. Returns the
    metadata, those records and where each model key is stored (under its own name, or the one it is tied to)."""
    metadata = open_checkpoint(path, _LOAD)
    saved = metadata.state_dict_metadata
    objects: dict[str, Any] = {k: None for k in (PACKED_GROUPS_KEY, EXTRA_KEY, LAYOUT_KEY) if k in saved}
    try:
        dcp_load(objects, path, metadata=metadata)
    except FAILURES as e:
        raise CheckpointError(
            f"{_LOAD}: reading {path} failed; the model and optimizer were not changed. {error_reason(e)}"
        ) from e
    stored = {k[len(MODEL_PREFIX) :]: k for k in saved if k.startswith(MODEL_PREFIX)}
    for alias, source in (objects.get(LAYOUT_KEY) or {}).get("tied", {}).items():
        if source in stored and alias not in stored:
            stored[alias] = stored[source]
    got = {
        k: tuple(saved[key].size) if isinstance(saved[key], TensorStorageMetadata) else None
        for k, key in stored.items()
    }
    problem = describe_mismatch(got, {k: shape_of(v) for k, v in live.items()}, "checkpoint", strict)
    if problem:
        raise CheckpointError(f"{_LOAD}: {path} does not match the model: {problem}")
    return metadata, objects, stored


def _model_targets(
    model: nn.Module, live: dict[str, Any], stored: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Where each stored model record is read to: straight into the live tensor (``read_checked`` checks every
    record, and copies only once all ranks agree), else into scratch (returned by key: ``set_model_state_dict``)."""
    targets: dict[str, Any] = {}
    via_scratch: dict[str, str] = {}
    owned = {_storage_of(t) for t in (*model.parameters(), *model.buffers())}  # local shards of DTensors
    for key, value in live.items():
        if key not in stored or stored[key] in targets:
            continue
        if isinstance(value, torch.Tensor) and _storage_of(value) in owned:
            targets[stored[key]] = value
        else:
            targets[stored[key]] = torch.empty_like(value) if isinstance(value, torch.Tensor) else value
            via_scratch[key] = stored[key]
    via_scratch.update({k: stored[k] for k in live if k in stored and stored[k] in via_scratch.values()})
    return targets, via_scratch


def _optimizer_scratch(
    path: Path, metadata: Metadata, objects: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's saved state checked against ``optimizer`` on every rank, and scratch to read it into."""
    saved_optim: dict[str, Any] = {
        k[len(OPTIM_PREFIX) :]: md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(OPTIM_PREFIX + STATE_PREFIX)
    }
    saved_optim.update(objects.get(PACKED_GROUPS_KEY) or {})
    source = f"{_LOAD}: {path}"
    chosen = checkpoint_on_all_ranks(lambda: validate_optimizer(list(saved_optim), model, optimizer, source))
    return optimizer_scratch(saved_optim, model, optimizer, chosen)


def _storage_of(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()

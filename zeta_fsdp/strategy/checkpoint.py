"""What ``FSDP2Strategy`` puts in a checkpoint and takes back out, over ``zeta_fsdp.state_dict`` (both formats).

Here: the entries (weights, every optimizer, step, epoch, schedulers, ``META_KEY``), the optimizer
checks before anything changes, and the deferred optimizer restore.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from .. import state_dict as sd
from ..state_dict import CheckpointError, is_checkpoint
from ..state_dict.checkpoint import check_loadable
from ..state_dict.checks import PathLike, checkpoint_on_all_ranks
from ..state_dict.full import TENSOR_KEYS, read_full_checkpoint, write_full_checkpoint

# Where the strategy's own bookkeeping lives inside a checkpoint.
META_KEY = "zeta_fsdp"
# An optimizer entry that points at a sharded (DCP) checkpoint directory.
SHARDED_REF = "zeta_fsdp_sharded_checkpoint"


class Restored(dict):
    """A state dict ``load_checkpoint`` already loaded into the model: ``load_model_state_dict`` skips it."""


class Gathered(dict):
    """A state the strategy gathered for a checkpoint: ``save_strategy_checkpoint`` reuses it, never gathers twice."""


def check_optimizers_match(optimizers: Sequence[torch.optim.Optimizer], ckpt: Mapping[str, Any], source: Any) -> None:
    """The live optimizers are the kind the checkpoint saved (count, class); every rank decides alike (``META_KEY``)."""
    saved = (ckpt.get(META_KEY) or {}).get("optimizer_classes")
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


def save_strategy_checkpoint(
    strategy: Any, checkpoint: Mapping[str, Any], filepath: PathLike, storage_options: Any = None
) -> None:
    """``FSDP2Strategy.save_checkpoint``: the model, every optimizer and ``checkpoint``'s other entries
    (gathered collectively, unless ``checkpoint`` holds ``Gathered`` ones: Lightning asks for them first)."""
    fmt = strategy.checkpoint_format
    module, optimizers = strategy.model, strategy.optimizers
    extras = _extras(strategy, checkpoint)
    if strategy.entries_weights_only:
        caller = "FSDP2Strategy.save_checkpoint()"
        checkpoint_on_all_ranks(lambda: check_loadable(extras, "the checkpoint's entries", caller))
    if fmt == "sharded":
        if len(optimizers) > 1:
            raise NotImplementedError("FSDP2Strategy: the sharded format saves one optimizer; use the full format.")
        save = strategy.sharded_saver()  # save_checkpoint, or an AsyncCheckpointer's save (async_save=True)
        save(Path(filepath), module, optimizers[0] if optimizers else None, extra=extras, overwrite=True)
        strategy.after_sharded_save(Path(filepath))
        return
    given, given_optim = _full_states(module, optimizers, checkpoint)
    payload = {**extras, "state_dict": dict(given), "optimizer_states": [dict(o) for o in given_optim]}
    write_full_checkpoint(filepath, payload, checkpoint_io=strategy.checkpoint_io, storage_options=storage_options)


def _extras(strategy: Any, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint``'s entries other than the model and optimizers, with the loop position, the LR
    schedulers (unless given) and what the loader checks (format, optimizers, parallel sizes)."""
    extras = {k: v for k, v in checkpoint.items() if k not in TENSOR_KEYS}
    step = strategy.current_epoch_step
    extras.setdefault("epoch", step.epoch)
    extras.setdefault("global_step", int(step))
    if strategy.lr_schedulers and "lr_schedulers" not in extras:
        extras["lr_schedulers"] = [s.state_dict() for s in strategy.lr_schedulers]
    extras[META_KEY] = {
        "format": strategy.checkpoint_format,
        "optimizers": len(strategy.optimizers),
        "optimizer_classes": [type(o).__name__ for o in strategy.optimizers],
        "data_parallel_size": strategy.data_parallel_size,
        "tensor_parallel_size": strategy.tensor_parallel_size,
    }
    return extras


def _full_states(module: Any, optimizers: list, checkpoint: Mapping[str, Any]) -> tuple[Any, list]:
    """The full model and optimizer state dicts: ``checkpoint``'s when Lightning gathered them already
    (``Gathered``, one per optimizer), else gathered now (a collective)."""
    given, given_optim = checkpoint.get("state_dict"), checkpoint.get("optimizer_states")
    reuse = isinstance(given, Gathered) and isinstance(given_optim, (list, tuple))
    reuse = reuse and len(given_optim) == len(optimizers) and all(isinstance(o, Gathered) for o in given_optim)
    if not reuse:
        given = sd.get_full_state_dict(module)
        given_optim = [sd.get_optimizer_state_dict(module, o, full=True) for o in optimizers]
    return given, given_optim


def load_strategy_checkpoint(strategy: Any, filepath: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """``FSDP2Strategy.load_checkpoint``: either format (detected on disk). The optimizers are checked
    first (count, class; every rank alike); then the weights restored, the optimizer state queued,
    ``current_epoch_step`` and the LR schedulers restored."""
    path = Path(filepath)
    module = strategy.model
    if strategy.checkpoint_io is None and checkpoint_on_all_ranks(lambda: is_checkpoint(path)):
        ckpt = dict(checkpoint_on_all_ranks(lambda: sd.load_checkpoint(path, module, model_weights=False) or {}))
        count = ckpt.get(META_KEY, {}).get("optimizers", 0)
        ckpt["optimizer_states"] = [{SHARDED_REF: str(path)} for _ in range(count)]
        check_optimizers_match(strategy.optimizers, ckpt, path)
        checkpoint_on_all_ranks(lambda: sd.load_checkpoint(path, module))
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

"""``FSDP2Strategy``'s state dicts, checkpoints and long-job methods (``CheckpointingMethods``, a base
of the class): what to save and load, where, when (async saves, retention, preemption, resume).
``strategy.checkpoint`` builds a checkpoint's content; ``zeta_fsdp.state_dict`` writes and reads it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch.distributed.tensor import DTensor

from .. import state_dict as sd
from ..distributed import on_all_ranks
from ..state_dict.checkpoint import check_save_target
from ..state_dict.checks import from_rank0
from ..state_dict.full import remove_checkpoint
from . import checkpoint as ckpt_io

__all__ = ["CheckpointingMethods"]


class CheckpointingMethods:
    """The checkpoint half of ``FSDP2Strategy`` (its state lives on the strategy: ``__init__`` there)."""

    # ----------------------------------------------------------------------------- state dicts

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's full state dict (plain tensors, unwrapped FQNs) on rank 0, ``{}`` on other ranks; with
        ``checkpoint_format="sharded"`` each rank's shards (DTensors). Every rank calls it.
        Example: ``state = strategy.lightning_module_state_dict()``."""
        module = self._require_module()
        if not self._parallelized:
            return module.state_dict()
        if self.checkpoint_format == "sharded":
            return sd.get_sharded_state_dict(module)
        return ckpt_io.Gathered(sd.get_full_state_dict(module))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state keyed by parameter FQN: full on rank 0 (``{}`` elsewhere), or with
        ``checkpoint_format="sharded"`` each rank's shards; every rank calls it.
        Example: ``state = strategy.optimizer_state(strategy.optimizers[0])``."""
        self.restore_pending_optimizer_state()
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        full = self.checkpoint_format == "full"
        state = sd.get_optimizer_state_dict(self._require_module(), optimizer, full=full)
        return ckpt_io.Gathered(state) if full else state

    def load_model_state_dict(self, ckpt: Mapping[str, Any], strict: bool = True) -> None:
        """Load ``ckpt["state_dict"]`` (or ``ckpt``), full (rank 0's copy) or sharded (DTensors), into the module now;
        ``strict=False`` loads a part (adapters). What ``load_checkpoint`` returned is not loaded twice.
        Example: ``strategy.load_model_state_dict({"state_dict": torch.load("weights.pt", weights_only=True)})``."""
        self.parallelize()
        state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, Mapping) else ckpt
        if isinstance(state, ckpt_io.Restored):
            return
        if any(isinstance(v, DTensor) for v in (state or {}).values()):
            sd.load_sharded_state_dict(self._require_module(), state, strict=strict)
        else:  # a full one: rank 0's copy (other ranks may pass {}), broadcast
            sd.load_full_state_dict(self._require_module(), state or {}, broadcast_from_rank0=True, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Queue ``checkpoint["optimizer_states"]`` (one entry per optimizer) and restore it later, exactly once.
        Example: ``strategy.load_optimizer_state_dict(ckpt)``."""
        states = checkpoint.get("optimizer_states") if isinstance(checkpoint, Mapping) else None
        if states is None:
            raise ValueError("FSDP2Strategy.load_optimizer_state_dict(): the checkpoint has no 'optimizer_states'.")
        self._optimizer_state_to_restore = list(states)

    def restore_pending_optimizer_state(self) -> None:
        """Apply now an optimizer state queued by ``load_checkpoint`` (otherwise applied at the next step).
        Example: ``strategy.load_checkpoint("last.ckpt"); strategy.restore_pending_optimizer_state()``."""
        pending = self._optimizer_state_to_restore
        if pending is None:
            return
        steps = self._steps  # restoring steps the optimizer to create its state: not a step
        try:
            ckpt_io.restore_optimizer_states(self._require_module(), self.optimizers, pending)
        finally:
            self._steps = steps
        self._optimizer_state_to_restore = None  # applied once; drop the checkpoint's tensors

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, checkpoint: Mapping[str, Any], filepath: Union[str, os.PathLike], storage_options: Any = None
    ) -> None:
        """Save the model, every optimizer and ``checkpoint``'s other entries to ``filepath``; every rank calls it.
        Example: ``strategy.save_checkpoint({"note": "nightly"}, "ckpt/step_100.ckpt")``."""
        # Refused on every rank, before anything changes: a path this save would fail at or destroy.
        full, caller = self.checkpoint_format == "full", "FSDP2Strategy.save_checkpoint()"
        on_all_ranks(lambda: check_save_target(filepath, overwrite=True, caller=caller, full=full), rank0_only=True)
        if storage_options is not None and self.checkpoint_io is None:
            raise TypeError(
                f"FSDP2Strategy.save_checkpoint(): storage_options={storage_options!r} is for a checkpoint_io; "
                "zeta's own writer takes none (pass checkpoint_io=..., or no storage_options)."
            )
        self.parallelize()
        self.restore_pending_optimizer_state()  # never save a fresh optimizer over a waiting state
        ckpt_io.save_strategy_checkpoint(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, filepath: Union[str, os.PathLike], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint of either format (detected on disk): weights now, optimizer state deferred.
        Example: ``ckpt = strategy.load_checkpoint("ckpt/step_100.ckpt"); start = int(strategy.current_epoch_step)``."""
        if not str(filepath).strip():
            raise ValueError(f"FSDP2Strategy.load_checkpoint(): filepath={str(filepath)!r} is empty.")
        self.parallelize()
        self.wait_for_checkpoint()  # a save of this path may still be in flight
        return ckpt_io.load_strategy_checkpoint(self, filepath, weights_only)

    def remove_checkpoint(self, filepath: Union[str, os.PathLike]) -> None:
        """Delete a checkpoint (file or sharded directory): rank 0, after every rank reached this point.
        Example: ``strategy.remove_checkpoint("ckpt/step_50.ckpt")``."""
        remove_checkpoint(filepath, checkpoint_io=self.checkpoint_io)

    # ----------------------------------------------------------------------------- long jobs

    def sharded_saver(self) -> Callable[..., Any]:
        """What writes a sharded checkpoint: ``save_checkpoint``, or with ``async_save=True`` an
        ``AsyncCheckpointer`` (returns once the shards are staged). Example: ``strategy.sharded_saver()``."""
        if not self.options.async_save:
            return sd.save_checkpoint
        self._checkpointer = self._checkpointer or sd.AsyncCheckpointer()
        return self._checkpointer.save

    def after_sharded_save(self, path: Path) -> None:
        """With ``keep_last``: rank 0 keeps the newest K complete ``step_<n>`` checkpoints beside ``path``.
        Example: ``strategy.after_sharded_save(Path("ckpt/step_100"))``."""
        self._checkpoint_root = path.parent
        root, keep = self._checkpoint_root, self.options.keep_last
        if keep is not None:
            on_all_ranks(lambda: sd.prune_checkpoints(root, keep), rank0_only=True)

    def wait_for_checkpoint(self) -> None:
        """Block until an ``async_save`` checkpoint in flight is complete (every rank); no-op otherwise.
        Example: ``strategy.wait_for_checkpoint()``."""
        if self._checkpointer is not None:
            self._checkpointer.wait()
            if self._checkpoint_root is not None:
                self.after_sharded_save(self._checkpoint_root / "_")

    def should_stop(self) -> bool:
        """``True`` on every rank once a ``preemption_signals`` signal reached any rank; call at each step
        boundary. Example: ``if strategy.should_stop(): strategy.save_checkpoint({}, f"ckpt/step_{step}")``."""
        if not self.options.preemption_signals:
            return False
        if self._preemption is None:
            self.parallelize()  # the handler's gloo group needs the process group
            self._preemption = sd.PreemptionHandler(self.options.preemption_signals)
        return self._preemption.stop_requested()

    def resume_latest(self, root: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
        """Load the latest complete ``root/step_<n>`` checkpoint; ``None`` when there is none (first launch).
        Example: ``strategy.resume_latest("ckpt"); start = int(strategy.current_epoch_step)``."""
        self.parallelize()
        self.wait_for_checkpoint()
        latest = from_rank0(lambda: sd.latest_checkpoint(root))
        return None if latest is None else self.load_checkpoint(latest)

"""``FSDP2Strategy``: NeMo's FSDP2 strategy API on zeta_fsdp's pieces, no Lightning needed.

Modules are duck-typed like a ``LightningModule``; a plain ``nn.Module``'s output is reduced per token.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .. import state_dict as sd
from ..data import shard_dataloader
from ..distributed import (
    build_dp_tp_mesh,
    choose_device,
    ensure_process_group,
    expected_world_size,
    on_all_ranks,
    shutdown,
)
from ..state_dict.checkpoint import check_save_target
from ..state_dict.checks import from_rank0
from ..state_dict.full import remove_checkpoint
from ..training import NonFiniteGuard, clip_grad_norm_, no_sync
from ..training.accumulation import resolve_defer
from ..training.meter import StepMeter, batch_tokens
from . import checkpoint as ckpt_io
from . import parallel as strategy_parallel
from .options import resolve_sizes, validate_strategy_options
from .steps import StepLosses, parse_optimizers, run_step

__all__ = ["EpochStep", "FSDP2Strategy"]

StepType = Literal["training", "validation", "test", "predict"]


class EpochStep(int):
    """``strategy.current_epoch_step``: the number of optimizer steps taken, which also knows its epoch.

    It is the step number wherever an int is (``step >= 4``, ``step + 1``, ``int(step)``, NeMo's
    int), and unpacks / indexes as ``(epoch, step)``.

    Example:
        >>> s = EpochStep(epoch=1, step=250)
        >>> s + 1, s.epoch, s.step, tuple(s)
        (251, 1, 250, (1, 250))
    """

    epoch: int

    def __new__(cls, epoch: int = 0, step: int = 0) -> EpochStep:
        obj = super().__new__(cls, int(step))
        obj.epoch = int(epoch)
        return obj

    @property
    def step(self) -> int:
        """The step number as a plain int.

        Example:
            >>> EpochStep(0, 7).step
            7
        """
        return int(self)

    def __iter__(self):
        return iter((self.epoch, int(self)))

    def __getitem__(self, index: int) -> int:
        return (self.epoch, int(self))[index]

    def __eq__(self, other: object) -> bool:
        return (self.epoch, int(self)) == other if isinstance(other, tuple) else int(self) == other

    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f"EpochStep(epoch={self.epoch}, step={int(self)})"

    def __reduce__(self):
        return (EpochStep, (self.epoch, int(self)))


class FSDP2Strategy:
    """Fully sharded data parallel (FSDP2) training with optional tensor parallel: NeMo's API.

    Args:
        data_parallel_size: ``"auto"`` (world size / tensor parallel size) or an int.
        tensor_parallel_size: ``"auto"`` (1) or an int. With ``> 1`` the module needs a plan, ``tp_plan=``
            or its ``tp_plan`` attribute (``{fqn pattern: ParallelStyle or "colwise"/"rowwise"}``).
        data_sampler: used by ``process_dataloader`` instead of a ``DistributedSampler``: an object
            with ``transform_dataloader(dataloader)`` (NeMo's samplers), or a ``Sampler``.
        checkpoint_io: Lightning's ``CheckpointIO`` (``save_checkpoint``, ``load_checkpoint``,
            ``remove_checkpoint``): replaces the full format's writer (called on rank 0).
        mp_policy: a ``MixedPrecisionPolicy`` or an ``mp`` string (``"bf16"``...), for every unit.
        parallelize_fn: ``fn(module, device_mesh=..., mp_policy=..., **kwargs)`` that shards the
            module itself. ``None``: ``parallelize_module`` on the tp mesh (when tp > 1), then
            ``fsdp()`` on the dp mesh (``shard_strat="FULL_SHARD"``, ``auto_wrap=True`` unless given).
        **kwargs: ``fsdp()``'s options (a custom ``parallelize_fn``'s own too) and the strategy's:
            ``checkpoint_format`` (``"full"``, or ``"sharded"``: DCP), ``tp_plan``, ``device``, Lightning's
            ``process_group_backend`` / ``timeout``, ``skip_nonfinite`` (``True``: ``optimizer_step`` skips
            a step with NaN/inf gradients on every rank alike), ``meter_every`` (``N``: a ``StepMeter`` line —
            tokens/s, MFU, memory, slowest rank — every N optimizer steps; ``strategy.meter``). Anything else (``TransformerBlok``), a bad ``mp``
            or ``shard_strat``: ``ValueError`` here, before any process group starts.

    Example:
        strategy = FSDP2Strategy(mp_policy="bf16", TransformerBlock=Block)
        strategy.connect(model)
        strategy.parallelize()  # process group, mesh, sharding, configure_optimizers()
    """

    # The mesh's dimension names; the Lightning adapter uses Lightning's ("data_parallel", "tensor_parallel").
    mesh_dim_names: tuple[str, str] = ("dp", "tp")

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        data_sampler: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        mp_policy: Union[MixedPrecisionPolicy, str, None] = None,
        parallelize_fn: Optional[Callable[..., Optional[nn.Module]]] = None,
        **kwargs: Any,
    ) -> None:
        # Every option is checked now, before any change; the sizes against the world in setup_environment().
        self.options = opts = validate_strategy_options(
            data_parallel_size, tensor_parallel_size, checkpoint_io, mp_policy, parallelize_fn, **kwargs
        )
        self.checkpoint_format, self.mp_policy = opts.checkpoint_format, opts.mp_policy
        self.fsdp_kwargs = opts.fsdp_kwargs
        self.data_sampler, self.checkpoint_io = data_sampler, checkpoint_io
        # NeMo's default is a function too (readable, replaceable); parallelize() clears it once it ran.
        self.parallelize_fn = parallelize_fn or functools.partial(
            strategy_parallel.default_parallelize, tp_plan=opts.tp_plan, device=opts.device
        )
        # Checkpoint entries must load with weights_only=True; the Lightning adapter turns this off
        # (Lightning pickles hyperparameters), and leaves creating the optimizers to Lightning.
        self.entries_weights_only = self.owns_optimizers = True

        self._module: Optional[nn.Module] = None
        self._device: Optional[torch.device] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._parallelized, self._epoch = False, 0
        self._optimizer_fn: Optional[Callable[[nn.Module], Any]] = None
        self._optimizers: list[torch.optim.Optimizer] = []
        # The first optimizer's steps, counted by a step post-hook: opt.step() by the user (as the seeds
        # do), by optimizer_step() or by Lightning all count.
        self._steps, self._step_hook = 0, None
        self.lr_schedulers: list[Any] = []
        # Optimizer state from a checkpoint, applied once at the next training step, then dropped.
        self._optimizer_state_to_restore: Optional[list[Any]] = None
        self._samplers: list[Any] = []
        self._losses = StepLosses(lambda: self.device_mesh[self.mesh_dim_names[0]].get_group())
        # Long jobs: the background checkpointer, the signal handler, where keep_last prunes.
        self._checkpointer: Optional[sd.AsyncCheckpointer] = None
        self._preemption: Optional[sd.PreemptionHandler] = None
        self._checkpoint_root: Optional[Path] = None
        self._nonfinite: Optional[NonFiniteGuard] = None  # skip_nonfinite=True: made at the first step
        self._meter: Optional[StepMeter] = None  # meter_every=N: made at the first training step
        self._step_open = False  # a training step began (training_step) and optimizer_step has not closed it

    # ----------------------------------------------------------------------------- module

    def connect(self, module: nn.Module) -> None:
        """Attach the module to train (an ``nn.Module`` or a ``LightningModule``); before ``parallelize()``.
        Example: ``strategy.connect(model)``."""
        if not isinstance(module, nn.Module):
            raise ValueError(f"FSDP2Strategy.connect(): expected an nn.Module, got {type(module).__name__}.")
        if self._parallelized and module is not self._module:
            raise ValueError("FSDP2Strategy.connect(): the strategy already parallelized another module.")
        self._module = module

    @property
    def model(self) -> Optional[nn.Module]:
        """The connected module (``lightning_module`` too), sharded in place by ``parallelize()`` (NO_SHARD in
        fp32/bf16: replicated on DDP's engine, ``fsdp_engine`` says).
        Example: ``strategy.parallelize(); isinstance(strategy.model, FSDPModule)`` -> ``True``."""
        return self._module

    lightning_module = model

    def _require_module(self) -> nn.Module:
        if self._module is None:
            raise RuntimeError("FSDP2Strategy: no module; call strategy.connect(module) first.")
        return self._module

    # ----------------------------------------------------------------------------- environment

    def setup_environment(self) -> None:
        """Start the process group (if none), choose the device, build the 2-D ``(dp, tp)`` mesh.
        Example: ``strategy.setup_environment(); strategy.device_mesh.shape  # (2, 2): 4 ranks, tp 2``."""
        if self._device_mesh is not None:
            return
        opts = self.options
        resolve_sizes(opts.data_parallel_size, opts.tensor_parallel_size, expected_world_size())  # before joining
        self._device = choose_device(self._module, opts.device)
        ensure_process_group(
            self._device,
            cpu_offload=bool(self.fsdp_kwargs.get("cpu_offload", False)),
            timeout_s=opts.timeout.total_seconds() if opts.timeout is not None else 1800,
            backend=opts.process_group_backend,
        )
        dp, tp = resolve_sizes(opts.data_parallel_size, opts.tensor_parallel_size, dist.get_world_size())
        self._device_mesh = build_dp_tp_mesh(self._device, dp, tp, names=self.mesh_dim_names)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(dp, tp)`` mesh (set up on first use).
        Example: ``strategy.device_mesh.mesh_dim_names`` -> ``('dp', 'tp')``."""
        self.setup_environment()
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        """The device this rank computes on.
        Example: ``batch = {k: v.to(strategy.root_device) for k, v in batch.items()}``."""
        self.setup_environment()
        return self._device

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel replicas (ranks that see different data).
        Example: ``strategy.data_parallel_size  # 4 ranks, tensor_parallel_size=2`` -> ``2``."""
        return self.device_mesh[self.mesh_dim_names[0]].size()

    @property
    def tensor_parallel_size(self) -> int:
        """Number of ranks one tensor-parallel layer is split over.
        Example: ``FSDP2Strategy(tensor_parallel_size=2).tensor_parallel_size`` -> ``2``."""
        return self.device_mesh[self.mesh_dim_names[1]].size()

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group (which data shard it reads).
        Example: ``strategy.data_parallel_rank  # rank 3 of 4 with tensor_parallel_size=2`` -> ``1``."""
        return self.device_mesh[self.mesh_dim_names[0]].get_local_rank()

    @property
    def is_global_zero(self) -> bool:
        """``True`` on global rank 0 (and without a process group).
        Example: ``if strategy.is_global_zero: print(f"step {step}: loss {loss:.4f}")``."""
        return not dist.is_initialized() or dist.get_rank() == 0

    # ----------------------------------------------------------------------------- sharding

    def tensor_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """Where to build the module: real tensors (as NeMo's), ``meta`` only with ``empty_init=True`` (Lightning
        passes ``None`` around ``configure_model``, where loaded weights must not be reset).
        Example: ``with strategy.tensor_init_context(empty_init=True): model = GPT(cfg)``."""
        return torch.device("meta") if empty_init else contextlib.nullcontext()

    def parallelize(self) -> None:
        """Shard the connected module with ``parallelize_fn``, once (then ``parallelize_fn`` is ``None`` and a
        second call does nothing), then create its optimizers. Example: ``strategy.connect(model); strategy.parallelize()``."""
        if self._parallelized:
            return
        module = self._require_module()
        self.setup_environment()
        self._module = strategy_parallel.shard_module(
            module, self.parallelize_fn, self._device_mesh, self.mp_policy, self._device, **self.fsdp_kwargs
        )
        self._parallelized, self.parallelize_fn = True, None
        if not self.optimizers and self.owns_optimizers:
            self._create_optimizers()

    # ----------------------------------------------------------------------------- optimizers

    def setup_optimizers(self, fn: Optional[Callable[[nn.Module], Any]] = None) -> list[torch.optim.Optimizer]:
        """Create the optimizers from the sharded module: ``fn(module)``, else its ``configure_optimizers()``.
        Example: ``strategy.setup_optimizers(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))``."""
        if fn is not None:
            self._optimizer_fn = fn
        if not self._parallelized:
            self.parallelize()  # creates them
        else:
            self._create_optimizers()
        return self.optimizers

    def _create_optimizers(self) -> None:
        module = self._require_module()
        fn = self._optimizer_fn or getattr(module, "configure_optimizers", None)
        if callable(fn):
            self.optimizers, self.lr_schedulers = parse_optimizers(fn(module) if fn is self._optimizer_fn else fn())

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers; ``current_epoch_step`` counts the steps of the first one, however it is stepped.
        Example: ``strategy.optimizers = [torch.optim.AdamW(strategy.model.parameters())]``."""
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)
        if self._step_hook is not None:
            self._step_hook.remove()
        first = self._optimizers[0] if self._optimizers else None
        self._step_hook = first.register_step_post_hook(self._count_step) if first is not None else None

    def _count_step(self, *_: Any) -> None:
        self._steps += 1

    # ----------------------------------------------------------------------------- steps

    def _get_loss_reduction(self, step_type: StepType) -> Any:
        """The loss reduction for ``"training"``, ``"validation"``, ``"test"`` or ``"predict"``.
        Example: ``strategy._get_loss_reduction("training")  # -> MaskedTokenLossReduction``."""
        return self._losses.reduction(self._module, step_type)

    def reduced_loss(self, step_type: StepType = "training") -> torch.Tensor:
        """Global token-weighted mean loss of the ``step_type`` steps since the last call (one all-reduce).
        Example: ``for b in val_loader: strategy.validation_step(b)``, then ``strategy.reduced_loss("validation")``."""
        return self._losses.reduced(self._module, step_type)

    def training_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """One forward pass and loss for training; returns the loss to call ``backward()`` on.
        Example: ``loss = strategy.training_step(batch, batch_idx); loss.backward(); strategy.optimizer_step()``."""
        self.parallelize()
        self.restore_pending_optimizer_state()
        self._meter_step(batch)
        return self._step("training", batch, batch_idx)

    def _meter_step(self, batch: Any) -> None:
        """``meter_every=N``: the first micro-batch of a step starts it on the meter; each adds its tokens."""
        if self.options.meter_every is None:
            return
        if self._meter is None:
            self._meter = StepMeter(every=self.options.meter_every, device=self.root_device)
        if not self._step_open:
            self._meter.step()
            self._step_open = True
        self._meter.add_tokens(batch_tokens(batch))

    def _step(self, step_type: str, batch: Any, batch_idx: Optional[int]) -> Any:
        self.parallelize()
        module = self._require_module()
        return run_step(module, step_type, batch, batch_idx, lambda kind, b: self._losses.step(module, kind, b))

    def validation_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """One evaluation step without gradients: the module's ``validation_step``, or this rank's token-weighted loss
        on the batch (``reduced_loss("validation")`` gives the global mean).
        Example: ``loss = strategy.validation_step(batch, batch_idx)``."""
        return self._step("validation", batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """Like ``validation_step``, for the test set (``reduced_loss("test")``).
        Example: ``loss = strategy.test_step(batch, batch_idx)``."""
        return self._step("test", batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """The module's ``predict_step``, or its output on the batch, without gradients.
        Example: ``logits = strategy.predict_step({"input_ids": ids})``."""
        return self._step("predict", batch, batch_idx)

    # ----------------------------------------------------------------------------- loop helpers

    def no_sync(self, *, defer: str = "all") -> contextlib.AbstractContextManager:
        """``zeta_fsdp.training.no_sync`` on the module: accumulate gradients, deferring their reduction
        (``defer="all"``: every gradient collective; ``"all_reduce"``: only HYBRID's replica all-reduce).
        Example: ``with strategy.no_sync(defer="all_reduce"): strategy.training_step(batch0).backward()``."""
        resolve_defer(defer)  # a bad value fails before parallelize() changes anything
        self.parallelize()
        return no_sync(self._require_module(), defer=defer)

    def clip_grad_norm_(self, max_norm: float, norm_type: Union[float, str] = 2.0) -> float:
        """``zeta_fsdp.training.clip_grad_norm_`` on the module; returns the global norm.
        Example: ``norm = strategy.clip_grad_norm_(1.0)``."""
        return clip_grad_norm_(self._require_module(), max_norm, norm_type)

    def optimizer_step(self, max_norm: Optional[float] = None, norm_type: Union[float, str] = 2.0) -> Optional[float]:
        """Clip (when ``max_norm``), step every optimizer and scheduler, zero gradients, count the step. With
        ``skip_nonfinite=True`` a step whose gradients hold NaN/inf on any rank is skipped on every rank (gradients
        zeroed, no optimizer or scheduler step, not counted; ``skipped_steps`` counts it).
        Example: ``strategy.training_step(batch).backward(); norm = strategy.optimizer_step(max_norm=1.0)``."""
        if not self.optimizers:
            raise RuntimeError("FSDP2Strategy.optimizer_step(): no optimizer; see setup_optimizers().")
        self.restore_pending_optimizer_state()
        norm = self.clip_grad_norm_(max_norm, norm_type) if max_norm is not None else None
        if self.options.skip_nonfinite:
            self._nonfinite = self._nonfinite or NonFiniteGuard(self._require_module())
            if not self._nonfinite.check():
                for optimizer in self.optimizers:
                    optimizer.zero_grad(set_to_none=True)
                self._step_open = False
                return norm
        for optimizer in self.optimizers:
            optimizer.step()
        for scheduler in self.lr_schedulers:
            scheduler.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._step_open = False
        return norm

    @property
    def meter(self) -> Optional[StepMeter]:
        """The ``StepMeter`` of ``meter_every=N`` (``meter.last``: the latest report), ``None`` without one.
        Example: ``FSDP2Strategy(meter_every=10)`` logs a line every 10 steps; ``strategy.meter.last.tokens_per_s``."""
        return self._meter

    @property
    def skipped_steps(self) -> int:
        """Steps ``optimizer_step()`` skipped for NaN/inf gradients (``skip_nonfinite=True``), the same on every rank.
        Example: ``print(f"skipped {strategy.skipped_steps}")``."""
        return self._nonfinite.skipped if self._nonfinite is not None else 0

    @property
    def current_epoch_step(self) -> EpochStep:
        """The optimizer steps taken (an int, as NeMo's), with ``.epoch`` (``set_epoch``); saved in checkpoints.
        Example: ``strategy.current_epoch_step  # -> EpochStep(epoch=0, step=12); >= 12 is True``."""
        return EpochStep(self._epoch, self._steps)

    @current_epoch_step.setter
    def current_epoch_step(self, value: Union[int, tuple[int, int]]) -> None:
        if isinstance(value, (tuple, EpochStep)):
            self._epoch, self._steps = int(value[0]), int(value[1])
        else:
            self._steps = int(value)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, and reshuffle the samplers of dataloaders from ``process_dataloader``.
        Example: ``for epoch in range(start_epoch, epochs): strategy.set_epoch(epoch)``."""
        self._epoch = int(epoch)
        for sampler in self._samplers:
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(self._epoch)

    # ----------------------------------------------------------------------------- data

    def process_dataloader(self, dataloader: Any) -> Any:
        """Give each data-parallel rank its own part of the data.
        Example: ``loader = strategy.process_dataloader(DataLoader(dataset, batch_size=8, shuffle=True))``."""
        loader, sampler = shard_dataloader(
            dataloader,
            rank=self.data_parallel_rank,
            world_size=self.data_parallel_size,
            epoch=self._epoch,
            data_sampler=self.data_sampler,
            caller="FSDP2Strategy.process_dataloader()",
        )
        if sampler is not None and sampler not in self._samplers:
            self._samplers.append(sampler)
        return loader

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

    def teardown(self) -> None:
        """Leave cleanly: waits for an async save in flight, restores signal handlers, then destroys the
        process group if the strategy started it. Example: ``strategy.teardown()  # end of the script``."""
        if self._checkpointer is not None:
            self.wait_for_checkpoint()
            self._checkpointer.close()
            self._checkpointer = None
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        if self._meter is not None:
            self._meter.finish()  # the steps since the last report (a collective: every rank tears down)
            self._meter = None
        shutdown()

"""``FSDP2Strategy``: NeMo's FSDP2 strategy API on zeta_fsdp's pieces, no Lightning needed.

Modules are duck-typed like a ``LightningModule``; a plain ``nn.Module``'s output is reduced per token.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from .. import state_dict as sd
from ..data import shard_dataloader
from ..distributed import (
    build_dp_tp_mesh,
    choose_device,
    ensure_process_group,
    expected_world_size,
    shutdown,
)
from ..training import NonFiniteGuard, clip_grad_norm_, no_sync
from ..training.accumulation import resolve_defer
from ..training.meter import StepMeter, batch_tokens
from . import parallel as strategy_parallel
from .checkpointing import CheckpointingMethods
from .epoch import EpochStep
from .options import resolve_sizes, validate_strategy_options
from .steps import StepLosses, parse_optimizers, run_step

__all__ = ["EpochStep", "FSDP2Strategy"]  # EpochStep: strategy.epoch, importable here as before

StepType = Literal["training", "validation", "test", "predict"]


class FSDP2Strategy(CheckpointingMethods):
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

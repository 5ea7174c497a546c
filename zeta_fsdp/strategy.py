"""``FSDP2Strategy``: NeMo's FSDP2 strategy API on zeta_fsdp's pieces, no Lightning needed.

The strategy owns the distributed side of training: the process group and a 2-D ``(dp, tp)``
device mesh, sharding the model (``fsdp()``, after ``parallelize_module`` when tensor parallel),
optimizers created after sharding, data sampling over the data-parallel group, the
token-weighted loss reduction (``zeta_fsdp.loss``), and checkpoints: full (gathered, one
``torch.save`` file keyed by parameter FQN, loadable anywhere) by default, or sharded (DCP).

The module contract is duck-typed like a ``LightningModule``: the strategy calls the module's
own ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` /
``configure_optimizers`` when it defines them; a plain ``nn.Module`` is called with the batch and
its output (logits or per-token losses) is reduced with ``MaskedTokenLossReduction``.

Example:
    >>> strategy = FSDP2Strategy(TransformerBlock=Block)  # doctest: +SKIP
    >>> strategy.connect(model)  # doctest: +SKIP
    >>> strategy.setup_optimizers(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))  # doctest: +SKIP
    >>> for i, batch in enumerate(strategy.process_dataloader(loader)):  # doctest: +SKIP
    ...     strategy.training_step(batch, i).backward()
    ...     strategy.optimizer_step(max_norm=1.0)
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

from . import state_dict as sd
from . import strategy_checkpoint as ckpt_io
from .distributed import (
    build_dp_tp_mesh,
    choose_device,
    ensure_process_group,
    expected_world_size,
    on_all_ranks,
    shutdown,
)
from .fsdp import fsdp, is_fsdp_wrapped, materialize_meta_model
from .loss import MaskedTokenLossReduction
from .options import resolve_sharding
from .strategy_options import resolve_sizes, tp_style, validate_strategy_options
from .strategy_steps import call_through_root, defines, parse_optimizers
from .training import clip_grad_norm_, no_sync
from .wrapping import tied_groups

__all__ = ["EpochStep", "FSDP2Strategy"]

StepType = Literal["training", "validation", "test", "predict"]
_STEP_TYPES = ("training", "validation", "test", "predict")


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
        if isinstance(other, tuple):
            return (self.epoch, int(self)) == other
        return int(self) == other

    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f"EpochStep(epoch={self.epoch}, step={int(self)})"

    def __reduce__(self):
        return (EpochStep, (self.epoch, int(self)))


class _Gathered(dict):
    """A state gathered by this strategy for a checkpoint (``save_checkpoint`` reuses it, never gathers twice)."""


class FSDP2Strategy:
    """Fully sharded data parallel (FSDP2) training with optional tensor parallel: NeMo's API.

    Args:
        data_parallel_size: ``"auto"`` (world size / tensor parallel size) or an int.
        tensor_parallel_size: ``"auto"`` (1) or an int. With ``> 1`` the module needs a plan:
            ``tp_plan=`` here or a ``tp_plan`` attribute on the module (``{fqn pattern:
            ParallelStyle or "colwise"/"rowwise"}``).
        data_sampler: used by ``process_dataloader`` instead of a ``DistributedSampler``: an object
            with ``transform_dataloader(dataloader)`` (NeMo's samplers), or a ``Sampler``.
        checkpoint_io: an object with ``save_checkpoint(checkpoint, path)``,
            ``load_checkpoint(path)`` and ``remove_checkpoint(path)`` (Lightning's ``CheckpointIO``)
            that replaces the built-in writer for the full format (called on rank 0).
        mp_policy: a ``MixedPrecisionPolicy`` or an ``mp`` string (``"bf16"``...), for every unit.
        parallelize_fn: ``fn(module, device_mesh=..., mp_policy=..., **kwargs)`` that shards the
            module itself (TP included). ``None`` (default): ``parallelize_module`` on the tp mesh
            when tensor parallel, then ``fsdp()`` on the dp mesh with ``shard_strat="FULL_SHARD"``
            and ``auto_wrap=True`` unless given.
        **kwargs: passed to ``fsdp()`` (``shard_strat``, ``TransformerBlock``, ``mp``,
            ``activation_checkpointing``, ``cpu_offload``, ...), except the strategy's own:
            ``checkpoint_format`` (``"full"`` default, or ``"sharded"``: DCP), ``tp_plan``, ``device``.
            With a custom ``parallelize_fn``, its own keyword parameters are accepted too. Any other
            name (a typo such as ``TransformerBlok``), a bad ``mp`` or ``shard_strat`` is a
            ``ValueError`` here, before any process group starts.

    Example:
        >>> strategy = FSDP2Strategy(mp_policy="bf16", TransformerBlock=Block)  # doctest: +SKIP
        >>> strategy.connect(model)  # doctest: +SKIP
        >>> strategy.parallelize()  # process group, mesh, sharding, configure_optimizers()  # doctest: +SKIP
    """

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
        # Every option is checked now, before any process group or model change; the sizes against
        # the world size in setup_environment() (under Lightning or SLURM it is not known yet).
        opts = validate_strategy_options(
            data_parallel_size, tensor_parallel_size, data_sampler, checkpoint_io, mp_policy, parallelize_fn, **kwargs
        )
        self.options = opts
        self._dp_arg, self._tp_arg = opts.data_parallel_size, opts.tensor_parallel_size
        self.checkpoint_format = opts.checkpoint_format
        self._tp_plan, self._device_arg = opts.tp_plan, opts.device
        self.mp_policy = opts.mp_policy
        self.data_sampler, self.checkpoint_io = opts.data_sampler, opts.checkpoint_io
        self.parallelize_fn = opts.parallelize_fn
        self.fsdp_kwargs = opts.fsdp_kwargs
        # Extra checkpoint entries must load with torch.load(weights_only=True); the Lightning adapter
        # turns this off (Lightning pickles hyperparameters; loading them takes weights_only=False).
        self.entries_weights_only = True

        self._module: Optional[nn.Module] = None
        self._device: Optional[torch.device] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._parallelized = False
        self._optimizer_fn: Optional[Callable[[nn.Module], Any]] = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._step_hook: Any = None
        self._restoring = False
        self.lr_schedulers: list[Any] = []
        # Optimizer state from a checkpoint, applied once at the next training step, then dropped.
        self._optimizer_state_to_restore: Optional[list[Any]] = None
        self._epoch = 0
        self._step = 0
        self._samplers: list[Any] = []
        self._reductions: dict[str, Any] = {}
        # step type -> (reduction, record key, running [loss sum, count]) since the last reduced_loss()
        self._loss_totals: dict[str, tuple[Any, str, torch.Tensor]] = {}

    # ----------------------------------------------------------------------------- module

    def connect(self, module: nn.Module) -> None:
        """Attach the module to train (an ``nn.Module`` or a ``LightningModule``); before ``parallelize()``.

        Example:
            >>> strategy.connect(model)  # doctest: +SKIP
        """
        if not isinstance(module, nn.Module):
            raise ValueError(f"FSDP2Strategy.connect(): expected an nn.Module, got {type(module).__name__}.")
        if self._parallelized and module is not self._module:
            raise ValueError("FSDP2Strategy.connect(): the strategy already parallelized another module.")
        self._module = module

    @property
    def lightning_module(self) -> Optional[nn.Module]:
        """The connected module (sharded in place by ``parallelize()``).

        Example:
            >>> strategy.connect(model); strategy.lightning_module is model  # doctest: +SKIP
            True
        """
        return self._module

    @property
    def model(self) -> Optional[nn.Module]:
        """The connected module; after ``parallelize()`` it is the sharded ``FSDPModule``.

        Example:
            >>> strategy.parallelize(); isinstance(strategy.model, FSDPModule)  # doctest: +SKIP
            True
        """
        return self._module

    def _require_module(self) -> nn.Module:
        if self._module is None:
            raise RuntimeError("FSDP2Strategy: no module; call strategy.connect(module) first.")
        return self._module

    # ----------------------------------------------------------------------------- environment

    def setup_environment(self) -> None:
        """Start the process group (if none), choose the device, build the 2-D ``(dp, tp)`` mesh.

        Idempotent. Under ``torchrun`` the group comes from its environment; in a notebook a
        one-process group starts. The mesh has dimension names ``"dp"`` and ``"tp"``.

        Example:
            >>> strategy.setup_environment()  # doctest: +SKIP
            >>> strategy.device_mesh.shape  # 4 ranks, tensor_parallel_size=2  # doctest: +SKIP
            (2, 2)
        """
        if self._device_mesh is not None:
            return
        resolve_sizes(self._dp_arg, self._tp_arg, expected_world_size())  # before joining a group
        self._device = choose_device(self._module, self._device_arg)
        timeout = self.options.timeout.total_seconds() if self.options.timeout is not None else 1800
        ensure_process_group(
            self._device,
            cpu_offload=bool(self.fsdp_kwargs.get("cpu_offload", False)),
            timeout_s=timeout,
            backend=self.options.process_group_backend,
        )
        dp, tp = resolve_sizes(self._dp_arg, self._tp_arg, dist.get_world_size())
        self._device_mesh = build_dp_tp_mesh(self._device, dp, tp)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(dp, tp)`` mesh (set up on first use).

        Example:
            >>> strategy.device_mesh.mesh_dim_names  # doctest: +SKIP
            ('dp', 'tp')
        """
        self.setup_environment()
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        """The device this rank computes on.

        Example:
            >>> batch = {k: v.to(strategy.root_device) for k, v in batch.items()}  # doctest: +SKIP
        """
        self.setup_environment()
        return self._device

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel replicas (ranks that see different data).

        Example:
            >>> strategy.data_parallel_size  # 4 ranks, tensor_parallel_size=2  # doctest: +SKIP
            2
        """
        return self.device_mesh["dp"].size()

    @property
    def tensor_parallel_size(self) -> int:
        """Number of ranks one tensor-parallel layer is split over.

        Example:
            >>> FSDP2Strategy(tensor_parallel_size=2).tensor_parallel_size  # doctest: +SKIP
            2
        """
        return self.device_mesh["tp"].size()

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group (which data shard it reads).

        Example:
            >>> strategy.data_parallel_rank  # rank 3 of 4 with tensor_parallel_size=2  # doctest: +SKIP
            1
        """
        return self.device_mesh["dp"].get_local_rank()

    @property
    def is_global_zero(self) -> bool:
        """``True`` on global rank 0 (and without a process group).

        Example:
            >>> if strategy.is_global_zero:  # doctest: +SKIP
            ...     print(f"step {step}: loss {loss:.4f}")
        """
        return not dist.is_initialized() or dist.get_rank() == 0

    # ----------------------------------------------------------------------------- sharding

    def tensor_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """Context in which to build the module: real tensors (as NeMo's), or ``meta`` with ``empty_init=True``.

        The default keeps whatever ``__init__`` (or loading pretrained weights) puts in the tensors.
        ``empty_init=True`` allocates nothing: ``parallelize()`` then allocates only each rank's
        shards and refills them with the modules' ``reset_parameters()`` / the root's
        ``init_weights()``, so initialisation written in ``__init__`` itself is not kept.

        Example:
            >>> with strategy.tensor_init_context(empty_init=True):  # doctest: +SKIP
            ...     model = GPT(cfg)
            >>> strategy.connect(model); strategy.parallelize()  # doctest: +SKIP
        """
        if empty_init:
            return torch.device("meta")
        return contextlib.nullcontext()

    def _default_parallelize(
        self, module: nn.Module, device_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, **kwargs: Any
    ) -> nn.Module:
        """Tensor parallel on the tp mesh (when tp > 1), then ``fsdp()`` on the dp mesh."""
        if device_mesh["tp"].size() > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            plan = self._tp_plan if self._tp_plan is not None else getattr(module, "tp_plan", None)
            if callable(plan):
                plan = plan(device_mesh["tp"])
            if not plan:
                raise ValueError(
                    f"FSDP2Strategy: tensor_parallel_size={device_mesh['tp'].size()} needs a tensor-parallel "
                    "plan: pass tp_plan={'layers.*.up': ColwiseParallel(), ...} or give the module a tp_plan attribute."
                )
            parallelize_module(module, device_mesh["tp"], {k: tp_style(v) for k, v in plan.items()})
        options = {"auto_wrap": True, "shard_strat": "FULL_SHARD", **kwargs}
        spec = resolve_sharding(options["shard_strat"])
        if "mesh" not in options:
            if spec.mesh_ndim == 1:
                options["mesh"] = device_mesh["dp"]
            elif device_mesh["tp"].size() > 1:
                raise ValueError(
                    f"FSDP2Strategy: shard_strat={spec.name!r} needs a 2-D data-parallel mesh, which is not "
                    "combined with tensor parallel here. Use FULL_SHARD or SHARD_GRAD with tensor_parallel_size > 1."
                )
            # tp == 1: fsdp() builds its 2-D (replicate, shard) mesh over the same ranks as "dp".
        return fsdp(module, mp=mp_policy, device=self._device, **options)

    def parallelize(self) -> None:
        """Shard the connected module, once (a second call does nothing), then create its optimizers.

        ``parallelize_fn=None``: tensor parallel first (when ``tensor_parallel_size > 1``), then
        ``fsdp()`` on the dp mesh. A module built in ``tensor_init_context()`` is materialized.
        The result must be sharded: a ``parallelize_fn`` that leaves the module without FSDP is
        an error, never a silently unsharded model. Then ``setup_optimizers``' function, or the
        module's ``configure_optimizers()``, creates the optimizers from the sharded parameters.

        Example:
            >>> strategy.connect(model)  # doctest: +SKIP
            >>> strategy.parallelize()  # doctest: +SKIP
        """
        if self._parallelized:
            return
        module = self._require_module()
        self.setup_environment()
        fn = self.parallelize_fn or self._default_parallelize
        tied = tied_groups(module)
        result = fn(module, device_mesh=self._device_mesh, mp_policy=self.mp_policy, **self.fsdp_kwargs)
        if result is not None and result is not module:
            module = self._module = result
        if not is_fsdp_wrapped(module):
            raise RuntimeError(
                "FSDP2Strategy.parallelize(): the module is not sharded after parallelize_fn "
                f"({getattr(fn, '__name__', fn)}); it must apply fully_shard/fsdp(). Pass parallelize_fn=None "
                "for the default (tensor parallel when configured, then fsdp())."
            )
        if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            # ties as they were before parallelize_fn ran: sharding may replace the shared parameter
            materialize_meta_model(module, self._device, _current_ties(module, tied))
        self._parallelized = True
        if not self.optimizers:
            self._create_optimizers()

    # ----------------------------------------------------------------------------- optimizers

    def setup_optimizers(self, fn: Optional[Callable[[nn.Module], Any]] = None) -> list[torch.optim.Optimizer]:
        """Create the optimizers from the sharded module: ``fn(module)``, else its ``configure_optimizers()``.

        ``fn`` (or ``configure_optimizers``) may return an optimizer, a list of them, a
        ``(optimizers, schedulers)`` pair, or Lightning's ``{"optimizer": ..., "lr_scheduler": ...}``.
        Called before ``parallelize()``, it parallelizes first: optimizers must see the sharded
        (DTensor) parameters. Returns the optimizers.

        Example:
            >>> strategy.setup_optimizers(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))  # doctest: +SKIP
        """
        if fn is not None:
            self._optimizer_fn = fn
        if not self._parallelized:
            self.parallelize()  # creates them
        else:
            self._create_optimizers()
        return self.optimizers

    def _create_optimizers(self) -> None:
        module = self._require_module()
        if self._optimizer_fn is not None:
            result = self._optimizer_fn(module)
        elif callable(getattr(module, "configure_optimizers", None)):
            result = module.configure_optimizers()
        else:
            return
        self.optimizers, self.lr_schedulers = parse_optimizers(result)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers; ``current_epoch_step`` counts the steps of the first one, however it is stepped.

        Example:
            >>> strategy.optimizers = [torch.optim.AdamW(strategy.model.parameters())]  # doctest: +SKIP
        """
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._optimizers = list(optimizers)
        if self._optimizers:
            # counts opt.step() called by the user, by optimizer_step() or by Lightning alike
            self._step_hook = self._optimizers[0].register_step_post_hook(self._count_step)

    def _count_step(self, *_: Any) -> None:
        if not self._restoring:  # restoring a state creates it with a step that trains nothing
            self._step += 1

    # ----------------------------------------------------------------------------- steps

    def _get_loss_reduction(self, step_type: StepType) -> Any:
        """The loss reduction for ``"training"``, ``"validation"``, ``"test"`` or ``"predict"``.

        The module's own ``<step_type>_loss_reduction`` or ``loss_reduction`` (an object, or a
        callable returning one) wins; otherwise ``MaskedTokenLossReduction`` over the dp group
        (global token-weighted mean; evaluation steps do not communicate per batch).

        Example:
            >>> strategy._get_loss_reduction("training")  # doctest: +SKIP
            <zeta_fsdp.loss.MaskedTokenLossReduction object at ...>
        """
        if step_type not in _STEP_TYPES:
            raise ValueError(f"FSDP2Strategy: unknown step type {step_type!r}. Accepted: {_STEP_TYPES}.")
        module = self._module
        for name in (f"{step_type}_loss_reduction", "loss_reduction"):
            found = getattr(module, name, None) if module is not None else None
            if found is not None:
                if callable(found) and not hasattr(found, "reduce"):
                    found = found()
                return found
        if step_type not in self._reductions:
            group = self.device_mesh["dp"].get_group()
            self._reductions[step_type] = MaskedTokenLossReduction(validation_step=step_type != "training", group=group)
        return self._reductions[step_type]

    def _forward(self, batch: Any) -> Any:
        """Call a plain module with the batch: matching keyword arguments, else the inputs tensor."""
        module = self._require_module()
        if isinstance(batch, Mapping):
            params = inspect.signature(module.forward).parameters
            takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            # labels / loss_mask are for the loss reduction; a model computing its own per-rank
            # mean loss from them is exactly the error the reduction exists to avoid.
            kwargs = {
                k: v for k, v in batch.items() if k in params or (takes_kwargs and k not in ("labels", "loss_mask"))
            }
            if kwargs:
                return module(**kwargs)
            for key in ("input_ids", "inputs", "input", "x"):
                if key in batch:
                    return module(batch[key])
            raise ValueError(
                f"FSDP2Strategy: cannot call {type(module).__name__}.forward with batch keys {sorted(batch)}; "
                "define training_step(batch, batch_idx) on the module or use matching argument names."
            )
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return module(batch[0])  # (inputs, labels)
        return module(batch)

    @staticmethod
    def _logits(output: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return output
        logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            return logits
        raise ValueError(
            f"FSDP2Strategy: the module returned {type(output).__name__}; the loss reduction needs logits or "
            "per-token losses (a tensor, or an output with .logits). A loss already averaged on each rank "
            "cannot be re-weighted: return logits, or define training_step on the module."
        )

    def _reduce_step(self, step_type: str, batch: Any) -> torch.Tensor:
        reduction = self._get_loss_reduction(step_type)
        loss, record = reduction.forward(batch, self._logits(self._forward(batch)))
        self._accumulate(step_type, reduction, record)
        return loss

    def _accumulate(self, step_type: str, reduction: Any, record: Mapping[str, torch.Tensor]) -> None:
        # A running sum of records per step type: memory stays constant however long nobody asks.
        key = next(iter(record))
        value = record[key].detach()
        if step_type in self._loss_totals:
            value = value + self._loss_totals[step_type][2]
        self._loss_totals[step_type] = (reduction, key, value)

    def reduced_loss(self, step_type: StepType = "training") -> torch.Tensor:
        """Global token-weighted mean loss of the ``step_type`` steps since the last call (one all-reduce).

        Example:
            >>> for batch in val_loader:  # doctest: +SKIP
            ...     strategy.validation_step(batch)
            >>> strategy.reduced_loss("validation")  # over all ranks and batches  # doctest: +SKIP
        """
        if step_type not in self._loss_totals:
            return self._get_loss_reduction(step_type).reduce([])
        reduction, key, total = self._loss_totals.pop(step_type)
        return reduction.reduce([{key: total}])

    def training_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """One forward pass and loss for training; returns the loss to call ``backward()`` on.

        First applies an optimizer state waiting from ``load_optimizer_state_dict`` /
        ``load_checkpoint`` (exactly once, then dropped). Calls the module's own
        ``training_step(batch, batch_idx)`` when it has one; otherwise runs the module on the
        batch and reduces with ``_get_loss_reduction("training")`` (token-weighted across ranks).

        Example:
            >>> loss = strategy.training_step(batch, batch_idx)  # doctest: +SKIP
            >>> loss.backward(); strategy.optimizer_step()  # doctest: +SKIP
        """
        self.parallelize()
        self._restore_deferred_optimizer_state()
        module = self._require_module()
        module.train()
        if defines(module, "training_step"):
            return call_through_root(module, "training_step", batch, batch_idx)
        return self._reduce_step("training", batch)

    def _eval_step(self, step_type: str, batch: Any, batch_idx: Optional[int]) -> Any:
        self.parallelize()
        module = self._require_module()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                name = f"{step_type}_step"
                if defines(module, name):
                    return call_through_root(module, name, batch, batch_idx)
                if step_type == "predict":
                    return self._forward(batch)
                return self._reduce_step(step_type, batch)
        finally:
            module.train(was_training)

    def validation_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """One evaluation step without gradients: the module's ``validation_step``, or this rank's
        token-weighted loss on the batch (``reduced_loss("validation")`` gives the global mean).

        Example:
            >>> loss = strategy.validation_step(batch, batch_idx)  # doctest: +SKIP
        """
        return self._eval_step("validation", batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """Like ``validation_step``, for the test set (``reduced_loss("test")``).

        Example:
            >>> loss = strategy.test_step(batch, batch_idx)  # doctest: +SKIP
        """
        return self._eval_step("test", batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: Optional[int] = None) -> Any:
        """The module's ``predict_step``, or its output on the batch, without gradients.

        Example:
            >>> logits = strategy.predict_step({"input_ids": ids})  # doctest: +SKIP
        """
        return self._eval_step("predict", batch, batch_idx)

    # ----------------------------------------------------------------------------- loop helpers

    def no_sync(self) -> contextlib.AbstractContextManager:
        """``zeta_fsdp.training.no_sync`` on the module: accumulate gradients without reducing them.

        Example:
            >>> with strategy.no_sync():  # doctest: +SKIP
            ...     strategy.training_step(batch0).backward()
        """
        self.parallelize()
        return no_sync(self._require_module())

    def clip_grad_norm_(self, max_norm: float, norm_type: Union[float, str] = 2.0) -> float:
        """``zeta_fsdp.training.clip_grad_norm_`` on the module; returns the global norm.

        Example:
            >>> norm = strategy.clip_grad_norm_(1.0)  # doctest: +SKIP
        """
        return clip_grad_norm_(self._require_module(), max_norm, norm_type)

    def optimizer_step(self, max_norm: Optional[float] = None, norm_type: Union[float, str] = 2.0) -> Optional[float]:
        """Clip (when ``max_norm``), step every optimizer and scheduler, zero gradients, count the step.

        Returns the gradient norm before clipping, or ``None`` without ``max_norm``.

        Example:
            >>> strategy.training_step(batch).backward()  # doctest: +SKIP
            >>> norm = strategy.optimizer_step(max_norm=1.0)  # doctest: +SKIP
        """
        if not self.optimizers:
            raise RuntimeError("FSDP2Strategy.optimizer_step(): no optimizer; see setup_optimizers().")
        self._restore_deferred_optimizer_state()
        norm = self.clip_grad_norm_(max_norm, norm_type) if max_norm is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        for scheduler in self.lr_schedulers:
            scheduler.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def current_epoch_step(self) -> EpochStep:
        """The optimizer steps taken (an int, as NeMo's), with ``.epoch`` (``set_epoch``); saved in checkpoints.

        Every step of the first optimizer counts, whether ``optimizer_step()``, ``opt.step()`` or
        Lightning made it.

        Example:
            >>> strategy.current_epoch_step  # doctest: +SKIP
            EpochStep(epoch=0, step=12)
            >>> strategy.current_epoch_step >= 12, strategy.current_epoch_step.epoch  # doctest: +SKIP
            (True, 0)
        """
        return EpochStep(self._epoch, self._step)

    @current_epoch_step.setter
    def current_epoch_step(self, value: Union[int, tuple[int, int]]) -> None:
        if isinstance(value, (tuple, EpochStep)):
            self._epoch, self._step = int(value[0]), int(value[1])
        else:
            self._step = int(value)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, and reshuffle the samplers of dataloaders from ``process_dataloader``.

        Example:
            >>> for epoch in range(start_epoch, epochs):  # doctest: +SKIP
            ...     strategy.set_epoch(epoch)
        """
        self._epoch = int(epoch)
        for sampler in self._samplers:
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(self._epoch)

    # ----------------------------------------------------------------------------- data

    def process_dataloader(self, dataloader: Any) -> Any:
        """Give each data-parallel rank its own part of the data.

        With ``data_sampler``: its ``transform_dataloader(dataloader)`` (NeMo), or a rebuilt
        loader using it as sampler. Otherwise the loader is rebuilt around a ``DistributedSampler``
        over the dp group (tensor-parallel peers read the same data), shuffling when the original
        did, at the current epoch. A loader that already has a ``DistributedSampler`` is kept.

        Example:
            >>> loader = strategy.process_dataloader(DataLoader(dataset, batch_size=8, shuffle=True))  # doctest: +SKIP
        """
        if self.data_sampler is not None and callable(getattr(self.data_sampler, "transform_dataloader", None)):
            return self.data_sampler.transform_dataloader(dataloader)
        if not isinstance(dataloader, DataLoader):
            raise ValueError(
                f"FSDP2Strategy.process_dataloader(): expected a torch DataLoader, got {type(dataloader).__name__}; "
                "pass data_sampler= with a transform_dataloader(dataloader) method for other loaders."
            )
        if isinstance(dataloader.dataset, IterableDataset):
            warnings.warn(
                "FSDP2Strategy.process_dataloader(): an IterableDataset cannot be split by a sampler; "
                "it is returned unchanged, so it must shard itself by data-parallel rank.",
                stacklevel=2,
            )
            return dataloader
        if isinstance(dataloader.sampler, DistributedSampler) and self.data_sampler is None:
            self._samplers.append(dataloader.sampler)
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError(
                "FSDP2Strategy.process_dataloader(): the loader uses a custom batch_sampler; pass data_sampler= "
                "with a transform_dataloader(dataloader) method that splits it by data-parallel rank."
            )
        if self.data_sampler is not None:
            if not isinstance(self.data_sampler, Sampler):
                raise ValueError(
                    "FSDP2Strategy: data_sampler must be a torch Sampler or have transform_dataloader(dataloader)."
                )
            sampler = self.data_sampler
        else:
            sampler = DistributedSampler(
                dataloader.dataset,
                num_replicas=self.data_parallel_size,
                rank=self.data_parallel_rank,
                shuffle=isinstance(dataloader.sampler, RandomSampler),
                drop_last=dataloader.drop_last,
            )
            sampler.set_epoch(self._epoch)
        self._samplers.append(sampler)
        options = {
            "batch_size": dataloader.batch_size,
            "num_workers": dataloader.num_workers,
            "collate_fn": dataloader.collate_fn,
            "pin_memory": dataloader.pin_memory,
            "drop_last": dataloader.drop_last,
            "timeout": dataloader.timeout,
            "worker_init_fn": dataloader.worker_init_fn,
            "persistent_workers": dataloader.persistent_workers,
        }
        if dataloader.num_workers > 0:
            options["prefetch_factor"] = dataloader.prefetch_factor
        return DataLoader(dataloader.dataset, sampler=sampler, **options)

    # ----------------------------------------------------------------------------- state dicts

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's full state dict (plain tensors, unwrapped FQNs) on rank 0; ``{}`` on other ranks.

        Every rank must call it (it gathers). Before ``parallelize()`` it is ``module.state_dict()``.

        Example:
            >>> state = strategy.lightning_module_state_dict()  # doctest: +SKIP
            >>> if strategy.is_global_zero: torch.save(state, "weights.pt")  # doctest: +SKIP
        """
        module = self._require_module()
        if not self._parallelized:
            return module.state_dict()
        return _Gathered(sd.get_full_state_dict(module))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s full state keyed by parameter FQN, on rank 0 (``{}`` elsewhere); every rank calls it.

        Example:
            >>> state = strategy.optimizer_state(strategy.optimizers[0])  # doctest: +SKIP
        """
        self._restore_deferred_optimizer_state()
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        return _Gathered(sd.get_optimizer_state_dict(self._require_module(), optimizer, full=True))

    def load_model_state_dict(self, ckpt: Mapping[str, Any], strict: bool = True) -> None:
        """Load model weights now: ``ckpt["state_dict"]`` (or ``ckpt`` itself) into the sharded module.

        A full state dict (plain tensors) is sharded into the live model; rank 0's copy is the
        one used (other ranks may pass ``{}``). A sharded one (DTensors) loads shard by shard.
        Keys and shapes are checked first (``strict``); on a mismatch nothing changes.

        Example:
            >>> strategy.load_model_state_dict({"state_dict": torch.load("weights.pt", weights_only=True)})  # doctest: +SKIP
        """
        self.parallelize()
        state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, Mapping) else ckpt
        if state is None:
            state = {}
        if any(isinstance(v, DTensor) for v in state.values()):
            sd.load_sharded_state_dict(self._module, state, strict=strict)
        else:
            sd.load_full_state_dict(self._module, state, broadcast_from_rank0=True, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Store the optimizer state of ``checkpoint`` and restore it later, exactly once.

        It is applied at the next ``training_step`` (or ``optimizer_step`` / ``save_checkpoint``,
        whichever comes first), when the optimizer surely exists, and then the strategy drops
        its reference so the memory is freed. ``checkpoint["optimizer_states"]`` holds one entry
        per optimizer: a full state keyed by parameter FQN (from ``save_checkpoint``; rank 0's
        copy is used) or a reference to a sharded checkpoint.

        Example:
            >>> ckpt = strategy.load_checkpoint("last.ckpt")  # calls this for you  # doctest: +SKIP
            >>> strategy.load_optimizer_state_dict(ckpt)  # doctest: +SKIP
        """
        states = checkpoint.get("optimizer_states") if isinstance(checkpoint, Mapping) else None
        if states is None:
            raise ValueError("FSDP2Strategy.load_optimizer_state_dict(): the checkpoint has no 'optimizer_states'.")
        self._optimizer_state_to_restore = list(states)

    def restore_pending_optimizer_state(self) -> None:
        """Apply now an optimizer state queued by ``load_checkpoint`` (otherwise applied at the next step).

        Example:
            >>> strategy.load_checkpoint("last.ckpt"); strategy.restore_pending_optimizer_state()  # doctest: +SKIP
        """
        self._restore_deferred_optimizer_state()

    def _restore_deferred_optimizer_state(self) -> None:
        pending = self._optimizer_state_to_restore
        if pending is None:
            return
        if len(pending) != len(self.optimizers):
            raise RuntimeError(
                f"FSDP2Strategy: the checkpoint holds the state of {len(pending)} optimizer(s), but "
                f"{len(self.optimizers)} exist(s). Create the optimizers (setup_optimizers / configure_optimizers) "
                "before the first training step."
            )
        module = self._require_module()
        self._restoring = True
        try:
            self._restore_states(module, pending)
        finally:
            self._restoring = False
        self._optimizer_state_to_restore = None  # applied once; drop the checkpoint's tensors

    def _restore_states(self, module: nn.Module, pending: list[Any]) -> None:
        for optimizer, state in zip(self.optimizers, pending):
            if isinstance(state, Mapping) and ckpt_io.SHARDED_REF in state:
                # the optimizer only: the weights were restored by load_checkpoint(), and anything
                # loaded since (load_model_state_dict) must not be overwritten by the old weights
                sd.load_checkpoint(state[ckpt_io.SHARDED_REF], module, optimizer, model_weights=False)
            else:
                sd.load_optimizer_state_dict(module, optimizer, state, full=True, broadcast_from_rank0=True)

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, checkpoint: Mapping[str, Any], filepath: Union[str, os.PathLike], storage_options: Any = None
    ) -> None:
        """Save the model, every optimizer and ``checkpoint``'s other entries to ``filepath``; every rank calls it.

        Model weights and optimizer state come from the live (sharded) objects, gathered
        collectively, so every rank's shards are in it (``checkpoint["state_dict"]`` /
        ``["optimizer_states"]`` are used only when this strategy's own ``lightning_module_state_dict``
        / ``optimizer_state`` made them). ``epoch`` / ``global_step`` default to
        ``current_epoch_step``. Other entries must load with ``torch.load(weights_only=True)``.

        ``checkpoint_format="full"`` (default): one ``torch.save`` file written by rank 0
        (atomically: temporary file, then rename); ``checkpoint_io`` replaces the writer.
        ``"sharded"``: a DCP directory, every rank writing its own shards. If the write fails,
        every rank raises, no temporary file is left and a checkpoint already at ``filepath`` is kept.

        Example:
            >>> strategy.save_checkpoint({"note": "nightly"}, "ckpt/step_100.ckpt")  # doctest: +SKIP
        """
        path = ckpt_io.check_save_target(filepath, self.checkpoint_format, "save_checkpoint")
        self.parallelize()
        self._restore_deferred_optimizer_state()  # never save a fresh optimizer over a waiting state
        module = self._require_module()
        extras = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        extras.setdefault("epoch", self._epoch)
        extras.setdefault("global_step", self._step)
        if self.lr_schedulers and "lr_schedulers" not in extras:
            extras["lr_schedulers"] = [s.state_dict() for s in self.lr_schedulers]
        extras[ckpt_io.META_KEY] = {
            "format": self.checkpoint_format,
            "optimizers": len(self.optimizers),
            "optimizer_classes": [type(o).__name__ for o in self.optimizers],
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        if self.entries_weights_only:
            on_all_ranks(lambda: ckpt_io.check_weights_only_loadable(extras, "save_checkpoint"))
        if self.checkpoint_format == "sharded":
            if len(self.optimizers) > 1:
                raise NotImplementedError("FSDP2Strategy: the sharded format saves one optimizer; use the full format.")
            optimizer = self.optimizers[0] if self.optimizers else None
            sd.save_checkpoint(path, module, optimizer, extra=extras, overwrite=True)
            return
        given, given_optim = checkpoint.get("state_dict"), checkpoint.get("optimizer_states")
        reuse = isinstance(given, _Gathered) and isinstance(given_optim, (list, tuple))
        reuse = (
            reuse and len(given_optim) == len(self.optimizers) and all(isinstance(o, _Gathered) for o in given_optim)
        )
        payload = dict(extras)
        payload["state_dict"] = dict(given) if reuse else sd.get_full_state_dict(module)
        payload["optimizer_states"] = (
            [dict(o) for o in given_optim]
            if reuse
            else [sd.get_optimizer_state_dict(module, o, full=True) for o in self.optimizers]
        )
        ckpt_io.write_full_checkpoint(
            filepath, payload, checkpoint_io=self.checkpoint_io, storage_options=storage_options
        )

    def load_checkpoint(self, filepath: Union[str, os.PathLike], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint of either format (detected on disk): weights now, optimizer state deferred.

        Checks first that the live optimizers are the kind the checkpoint saved; then restores the
        model (``load_model_state_dict``), queues the optimizer state (``load_optimizer_state_dict``:
        applied at the first ``training_step``), and restores ``current_epoch_step`` and LR
        schedulers. Works at any world size and parallel layout. ``weights_only=False`` reads a
        trusted file holding pickled objects (e.g. Lightning hyperparameters); the default refuses
        them. Returns the checkpoint dict: the full format's file is read on rank 0 only, so other
        ranks get the same entries with an empty ``state_dict``. A missing or unreadable checkpoint
        raises the same error on every rank, naming the path, before anything changes.

        Example:
            >>> ckpt = strategy.load_checkpoint("ckpt/step_100.ckpt")  # doctest: +SKIP
            >>> start = int(strategy.current_epoch_step)  # doctest: +SKIP
        """
        if not str(filepath).strip():
            raise ValueError(f"FSDP2Strategy.load_checkpoint(): filepath={str(filepath)!r} is empty.")
        self.parallelize()
        path = Path(filepath)
        module = self._require_module()
        if self.checkpoint_io is None and on_all_ranks(lambda: sd.is_checkpoint(path)):
            meta = on_all_ranks(lambda: sd.load_checkpoint(path, module, model_weights=False) or {}, errors=_ERRORS)
            ckpt = dict(meta)
            count = ckpt.get(ckpt_io.META_KEY, {}).get("optimizers", 0)
            ckpt["optimizer_states"] = [{ckpt_io.SHARDED_REF: str(path)} for _ in range(count)]
            ckpt_io.check_optimizers_match(self.optimizers, ckpt, path)
            on_all_ranks(lambda: sd.load_checkpoint(path, module), errors=_ERRORS)
            ckpt["state_dict"] = sd.get_sharded_state_dict(module)
        else:
            ckpt = ckpt_io.read_full_checkpoint(filepath, checkpoint_io=self.checkpoint_io, weights_only=weights_only)
            ckpt_io.check_optimizers_match(self.optimizers, ckpt, path)
            self.load_model_state_dict(ckpt, strict=True)
        if ckpt.get("optimizer_states"):
            self.load_optimizer_state_dict(ckpt)
        self.current_epoch_step = (ckpt.get("epoch", 0), ckpt.get("global_step", 0))
        for scheduler, state in zip(self.lr_schedulers, ckpt.get("lr_schedulers", [])):
            scheduler.load_state_dict(state)
        return ckpt

    def remove_checkpoint(self, filepath: Union[str, os.PathLike]) -> None:
        """Delete a checkpoint (file or sharded directory): rank 0, after every rank reached this point.

        Anything that is not a checkpoint (a data folder, a text file) is refused with a
        ``ValueError`` on every rank and left untouched.

        Example:
            >>> strategy.remove_checkpoint("ckpt/step_50.ckpt")  # doctest: +SKIP
        """
        ckpt_io.remove_checkpoint(filepath, checkpoint_io=self.checkpoint_io)

    def teardown(self) -> None:
        """Leave cleanly: destroys the process group if the strategy started it (``zeta_fsdp.shutdown``).

        Example:
            >>> strategy.teardown()  # end of the script  # doctest: +SKIP
        """
        shutdown()


_ERRORS = (sd.CheckpointError,)


def _current_ties(module: nn.Module, before: list[list[str]]) -> list[list[str]]:
    """Tie groups to restore: those recorded before ``parallelize_fn`` whose names still exist, plus
    ties the module still shows under names a wrapper may have changed."""
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    ties = [group for group in before if all(n in names for n in group)]
    covered = {n for group in ties for n in group}
    return ties + [group for group in tied_groups(module) if not covered.intersection(group)]

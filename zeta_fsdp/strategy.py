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
import shutil
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from . import state_dict as sd
from .data import shard_dataloader
from .distributed import build_dp_tp_mesh, choose_device, ensure_process_group, expected_world_size, shutdown
from .fsdp import fsdp, is_fsdp_wrapped, materialize_meta_model
from .loss import MaskedTokenLossReduction
from .options import resolve_mixed_precision, resolve_sharding
from .training import clip_grad_norm_, no_sync
from .wrapping import _tied_groups

__all__ = ["EpochStep", "FSDP2Strategy"]

StepType = Literal["training", "validation", "test", "predict"]
_STEP_TYPES = ("training", "validation", "test", "predict")
_FORMATS = ("full", "sharded")
# Strategy options that never reach fsdp().
_STRATEGY_KWARGS = ("checkpoint_format", "tp_plan", "device", "async_save", "keep_last", "preemption_signals")
# Where the strategy's own bookkeeping lives inside a checkpoint.
_META_KEY = "zeta_fsdp"
_SHARDED_REF = "zeta_fsdp_sharded_checkpoint"


class EpochStep(NamedTuple):
    """``strategy.current_epoch_step``: the epoch and the number of optimizer steps taken.

    Example:
        >>> EpochStep(epoch=1, step=250).step
        250
    """

    epoch: int
    step: int


def _resolve_sizes(dp: Union[str, int], tp: Union[str, int], world: int) -> tuple[int, int]:
    """``"auto"`` sizes to numbers: tp 1 unless given, dp = world / tp; the product must be the world."""
    for name, value in (("data_parallel_size", dp), ("tensor_parallel_size", tp)):
        if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"FSDP2Strategy: {name}={value!r} is not accepted. Accepted: 'auto' or an int >= 1.")
    tp_size = 1 if tp == "auto" else tp
    if dp == "auto":
        if world % tp_size != 0:
            raise ValueError(
                f"FSDP2Strategy: data_parallel_size='auto' x tensor_parallel_size={tp_size} cannot equal the "
                f"world size {world}: tensor_parallel_size={tp_size} does not divide it."
            )
        dp_size = world // tp_size
    else:
        dp_size = dp
    if dp_size * tp_size != world:
        raise ValueError(
            f"FSDP2Strategy: data_parallel_size={dp_size} x tensor_parallel_size={tp_size} = "
            f"{dp_size * tp_size}, but the world size is {world}; the product must equal it."
        )
    return dp_size, tp_size


def _tp_style(style: Any) -> Any:
    """Hugging Face style plan strings to torch ``ParallelStyle`` objects; objects pass through."""
    if not isinstance(style, str):
        return style
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if style.lower() not in styles:
        raise ValueError(f"FSDP2Strategy: unknown tensor-parallel style {style!r}. Accepted: {sorted(styles)}.")
    return styles[style.lower()]()


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
            ``checkpoint_format`` (``"full"`` default, or ``"sharded"``: DCP), ``tp_plan``, ``device``;
            for long jobs (sharded format): ``async_save`` (``save_checkpoint`` returns once the shards
            are staged, ``AsyncCheckpointer``), ``keep_last`` (after each save, keep the newest K
            ``step_<n>`` checkpoints next to it), ``preemption_signals`` (e.g. ``("SIGTERM",)``: then
            ``should_stop()`` turns True at the step boundary after the signal).
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
        # Validate everything now: a bad option must fail before any process group or model change.
        self._dp_arg, self._tp_arg = data_parallel_size, tensor_parallel_size
        _resolve_sizes(data_parallel_size, tensor_parallel_size, expected_world_size())
        self.checkpoint_format = kwargs.pop("checkpoint_format", "full")
        if self.checkpoint_format not in _FORMATS:
            raise ValueError(
                f"FSDP2Strategy: checkpoint_format={self.checkpoint_format!r} is not accepted. Accepted: {_FORMATS}."
            )
        if checkpoint_io is not None and self.checkpoint_format == "sharded":
            raise ValueError(
                "FSDP2Strategy: checkpoint_io replaces the writer of the full format; the sharded format "
                "is written by DCP on every rank. Use one or the other."
            )
        if checkpoint_io is not None:
            missing = [
                m for m in ("save_checkpoint", "load_checkpoint", "remove_checkpoint") if not hasattr(checkpoint_io, m)
            ]
            if missing:
                raise ValueError(f"FSDP2Strategy: checkpoint_io lacks {missing}.")
        self._long_jobs = _long_job_options(kwargs, self.checkpoint_format)
        self._checkpointer: Optional[sd.AsyncCheckpointer] = None
        self._preemption: Optional[sd.PreemptionHandler] = None
        self._checkpoint_root: Optional[Path] = None
        self._tp_plan = kwargs.pop("tp_plan", None)
        self._device_arg = kwargs.pop("device", None)
        if mp_policy is not None and "mp" in kwargs:
            raise ValueError("FSDP2Strategy: pass mixed precision once, as mp_policy or as mp, not both.")
        self.mp_policy = resolve_mixed_precision(mp_policy if mp_policy is not None else kwargs.pop("mp", None))
        kwargs.pop("mp", None)
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ValueError(f"FSDP2Strategy: parallelize_fn={parallelize_fn!r} is not callable.")
        accepted = _fsdp_option_names(parallelize_fn)
        unknown = [k for k in kwargs if k not in accepted]
        if unknown:
            raise ValueError(
                f"FSDP2Strategy: unknown keyword argument(s) {unknown}. Accepted: the strategy's own "
                f"{list(_STRATEGY_KWARGS)} and mp, and fsdp()'s options {accepted}."
            )
        if "shard_strat" in kwargs:
            resolve_sharding(kwargs["shard_strat"])  # ValueError now, not at parallelize()
        self.data_sampler = data_sampler
        self.checkpoint_io = checkpoint_io
        self.parallelize_fn = parallelize_fn
        self.fsdp_kwargs = kwargs

        self._module: Optional[nn.Module] = None
        self._device: Optional[torch.device] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._parallelized = False
        self._optimizer_fn: Optional[Callable[[nn.Module], Any]] = None
        self.optimizers: list[torch.optim.Optimizer] = []
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
        dp, tp = _resolve_sizes(self._dp_arg, self._tp_arg, expected_world_size())
        self._device = choose_device(self._module, self._device_arg)
        ensure_process_group(self._device, cpu_offload=bool(self.fsdp_kwargs.get("cpu_offload", False)))
        dp, tp = _resolve_sizes(self._dp_arg, self._tp_arg, dist.get_world_size())
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
        """Context in which to build the module: on the ``meta`` device, so nothing is allocated.

        ``parallelize()`` then shards it and allocates only each rank's shards, running the
        module's ``init_weights()`` / ``reset_parameters()``. ``empty_init=False`` builds real tensors.

        Example:
            >>> with strategy.tensor_init_context():  # doctest: +SKIP
            ...     model = GPT(cfg)
            >>> strategy.connect(model); strategy.parallelize()  # doctest: +SKIP
        """
        if empty_init is False:
            return contextlib.nullcontext()
        return torch.device("meta")

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
            parallelize_module(module, device_mesh["tp"], {k: _tp_style(v) for k, v in plan.items()})
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
        tied = _tied_groups(module)
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
        self.optimizers, self.lr_schedulers = _parse_optimizers(result)

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
        if _defines(module, "training_step"):
            return _through_root(module, "training_step", batch, batch_idx)
        return self._reduce_step("training", batch)

    def _eval_step(self, step_type: str, batch: Any, batch_idx: Optional[int]) -> Any:
        self.parallelize()
        module = self._require_module()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                name = f"{step_type}_step"
                if _defines(module, name):
                    return _through_root(module, name, batch, batch_idx)
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
        self._step += 1
        return norm

    @property
    def current_epoch_step(self) -> EpochStep:
        """``(epoch, step)``: the epoch (``set_epoch``) and optimizer steps taken; saved in checkpoints.

        Example:
            >>> strategy.current_epoch_step  # doctest: +SKIP
            EpochStep(epoch=0, step=12)
        """
        return EpochStep(self._epoch, self._step)

    @current_epoch_step.setter
    def current_epoch_step(self, value: tuple[int, int]) -> None:
        self._epoch, self._step = int(value[0]), int(value[1])

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
        """The module's full state dict (plain tensors, unwrapped FQNs) on rank 0; ``{}`` on other ranks.

        Every rank must call it (it gathers). Before ``parallelize()`` it is ``module.state_dict()``.

        Example:
            >>> state = strategy.lightning_module_state_dict()  # doctest: +SKIP
            >>> if strategy.is_global_zero: torch.save(state, "weights.pt")  # doctest: +SKIP
        """
        module = self._require_module()
        if not self._parallelized:
            return module.state_dict()
        return sd.get_full_state_dict(module)

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
        for optimizer, state in zip(self.optimizers, pending):
            if isinstance(state, Mapping) and _SHARDED_REF in state:
                # the optimizer only: the weights were restored by load_checkpoint(), and anything
                # loaded since (load_model_state_dict) must not be overwritten by the old weights
                sd.load_checkpoint(state[_SHARDED_REF], module, optimizer, model_weights=False)
            else:
                sd.load_optimizer_state_dict(module, optimizer, state, full=True, broadcast_from_rank0=True)
        self._optimizer_state_to_restore = None  # applied once; drop the checkpoint's tensors

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, checkpoint: Mapping[str, Any], filepath: Union[str, os.PathLike], storage_options: Any = None
    ) -> None:
        """Save the model, every optimizer and ``checkpoint``'s other entries to ``filepath``; every rank calls it.

        Model weights and optimizer state always come from the live (sharded) objects, gathered
        collectively, so every rank's shards are in it; ``checkpoint["state_dict"]`` /
        ``["optimizer_states"]`` passed in are ignored. ``epoch`` / ``global_step`` default to
        ``current_epoch_step``. Other entries must load with ``torch.load(weights_only=True)``.

        ``checkpoint_format="full"`` (default): one ``torch.save`` file written by rank 0
        (atomically: temporary file, then rename) holding ``state_dict`` (full tensors keyed by
        FQN) and ``optimizer_states`` (full, keyed by FQN); ``checkpoint_io`` replaces the writer.
        ``"sharded"``: a DCP directory, every rank writing its own shards. If the write fails,
        every rank raises, no temporary file is left and a checkpoint already at ``filepath`` is kept.

        Example:
            >>> strategy.save_checkpoint({"note": "nightly"}, "ckpt/step_100.ckpt")  # doctest: +SKIP
        """
        self.parallelize()
        self._restore_deferred_optimizer_state()  # never save a fresh optimizer over a waiting state
        module = self._require_module()
        extras = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        extras.setdefault("epoch", self._epoch)
        extras.setdefault("global_step", self._step)
        if self.lr_schedulers and "lr_schedulers" not in extras:
            extras["lr_schedulers"] = [s.state_dict() for s in self.lr_schedulers]
        extras[_META_KEY] = {
            "format": self.checkpoint_format,
            "optimizers": len(self.optimizers),
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        sd.on_all_ranks(lambda: sd.check_loadable(extras, "the checkpoint's entries"))
        path = Path(filepath)
        if self.checkpoint_format == "sharded":
            if len(self.optimizers) > 1:
                raise NotImplementedError("FSDP2Strategy: the sharded format saves one optimizer; use the full format.")
            optimizer = self.optimizers[0] if self.optimizers else None
            if self._long_jobs["async_save"]:
                self._checkpointer = self._checkpointer or sd.AsyncCheckpointer()
                self._checkpointer.save(path, module, optimizer, extra=extras, overwrite=True)
            else:
                sd.save_checkpoint(path, module, optimizer, extra=extras, overwrite=True)
            self._checkpoint_root = path.parent
            self._prune()
            return
        payload = dict(extras)
        payload["state_dict"] = sd.get_full_state_dict(module)
        payload["optimizer_states"] = [sd.get_optimizer_state_dict(module, o, full=True) for o in self.optimizers]

        def write() -> None:
            if self.checkpoint_io is not None:
                extra_args = {} if storage_options is None else {"storage_options": storage_options}
                self.checkpoint_io.save_checkpoint(payload, filepath, **extra_args)  # the caller's path, as given
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.incomplete"
            try:
                torch.save(payload, tmp)
                os.replace(tmp, path)
            finally:
                # a failed write leaves no temporary file; a file already at ``path`` is untouched
                tmp.unlink(missing_ok=True)

        _on_rank0(write)

    def load_checkpoint(self, filepath: Union[str, os.PathLike]) -> dict[str, Any]:
        """Load a checkpoint of either format (detected on disk): weights now, optimizer state deferred.

        Restores the model immediately (``load_model_state_dict``), queues the optimizer state
        (``load_optimizer_state_dict``: applied at the first ``training_step``), and restores
        ``current_epoch_step`` and LR schedulers. Works at any world size and parallel layout.
        Returns the checkpoint dict: the full format's file is read on rank 0 only, so other
        ranks get the same entries with an empty ``state_dict``.

        Example:
            >>> ckpt = strategy.load_checkpoint("ckpt/step_100.ckpt")  # doctest: +SKIP
            >>> start = strategy.current_epoch_step.step  # doctest: +SKIP
        """
        self.parallelize()
        self.wait_for_checkpoint()  # a save of this path may still be in flight
        path = Path(filepath)
        module = self._require_module()
        if self.checkpoint_io is None and path.is_dir():
            extras = sd.load_checkpoint(path, module) or {}
            ckpt = dict(extras)
            ckpt["state_dict"] = sd.get_sharded_state_dict(module)
            count = ckpt.get(_META_KEY, {}).get("optimizers", 0)
            ckpt["optimizer_states"] = [{_SHARDED_REF: str(path)} for _ in range(count)]
        else:
            ckpt = self._read_full(filepath)
            self.load_model_state_dict(ckpt, strict=True)
        if ckpt.get("optimizer_states"):
            self.load_optimizer_state_dict(ckpt)
        self.current_epoch_step = (ckpt.get("epoch", 0), ckpt.get("global_step", 0))
        for scheduler, state in zip(self.lr_schedulers, ckpt.get("lr_schedulers", [])):
            scheduler.load_state_dict(state)
        return ckpt

    def _read_full(self, filepath: Union[str, os.PathLike]) -> dict[str, Any]:
        """Rank 0 reads the file; every rank gets its small entries, rank 0 alone keeps the tensors."""
        path = Path(filepath)

        def read() -> dict[str, Any]:
            if self.checkpoint_io is not None:
                return dict(self.checkpoint_io.load_checkpoint(filepath))
            if not path.exists():
                raise FileNotFoundError(f"FSDP2Strategy.load_checkpoint(): {path} does not exist.")
            return torch.load(path, map_location="cpu", weights_only=True)

        ckpt = _on_rank0(read)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return ckpt
        small = None
        if dist.get_rank() == 0:
            small = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
            small["optimizer_states"] = len(ckpt.get("optimizer_states", []))
        box = [small]
        dist.broadcast_object_list(box, src=0)
        if dist.get_rank() == 0:
            return ckpt
        ckpt = box[0]
        ckpt["state_dict"] = {}
        ckpt["optimizer_states"] = [None] * ckpt["optimizer_states"]
        return ckpt

    def remove_checkpoint(self, filepath: Union[str, os.PathLike]) -> None:
        """Delete a checkpoint (file or sharded directory): rank 0, after every rank reached this point.

        Example:
            >>> strategy.remove_checkpoint("ckpt/step_50.ckpt")  # doctest: +SKIP
        """
        path = Path(filepath)

        def remove() -> None:
            if self.checkpoint_io is not None:
                self.checkpoint_io.remove_checkpoint(filepath)
            elif path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

        if dist.is_initialized():
            dist.barrier()  # no rank may still be reading it
        _on_rank0(remove)

    def wait_for_checkpoint(self) -> None:
        """Block until an ``async_save`` checkpoint in flight is complete (every rank); no-op otherwise.

        Example:
            >>> strategy.wait_for_checkpoint()  # doctest: +SKIP
        """
        if self._checkpointer is not None:
            self._checkpointer.wait()
            self._prune()

    def _prune(self) -> None:
        """With ``keep_last``: rank 0 keeps the newest K complete checkpoints next to the last one saved."""
        root, keep = self._checkpoint_root, self._long_jobs["keep_last"]
        if keep is not None and root is not None:
            _on_rank0(lambda: sd.prune_checkpoints(root, keep))

    def should_stop(self) -> bool:
        """``True`` on every rank once a ``preemption_signals`` signal reached any rank; call at each step boundary.

        Example:
            >>> if strategy.should_stop():  # doctest: +SKIP
            ...     strategy.save_checkpoint({}, f"ckpt/step_{step}")
            ...     break
        """
        if not self._long_jobs["preemption_signals"]:
            return False
        if self._preemption is None:
            self.parallelize()  # the handler's gloo group needs the process group
            self._preemption = sd.PreemptionHandler(self._long_jobs["preemption_signals"])
        return self._preemption.stop_requested()

    def resume_latest(self, root: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
        """Load the latest complete ``root/step_<n>`` checkpoint (``load_checkpoint``); ``None`` when there is none.

        The same script then works on first launch and on relaunch.

        Example:
            >>> ckpt = strategy.resume_latest("ckpt")  # doctest: +SKIP
            >>> start = strategy.current_epoch_step.step  # 0 on the first launch  # doctest: +SKIP
        """
        self.parallelize()
        self.wait_for_checkpoint()
        latest = _on_rank0(lambda: sd.latest_checkpoint(root))
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [latest]
            dist.broadcast_object_list(box, src=0)
            latest = box[0]
        return None if latest is None else self.load_checkpoint(latest)

    def teardown(self) -> None:
        """Leave cleanly: waits for an async save in flight, restores signal handlers, then destroys the
        process group if the strategy started it (``zeta_fsdp.shutdown``).

        Example:
            >>> strategy.teardown()  # end of the script  # doctest: +SKIP
        """
        if self._checkpointer is not None:
            self.wait_for_checkpoint()
            self._checkpointer.close()
            self._checkpointer = None
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        shutdown()


# --------------------------------------------------------------------------------- helpers


def _defines(module: nn.Module, name: str) -> bool:
    """``True`` when the module's class defines ``name`` itself (not a plain ``nn.Module``)."""
    attr = getattr(type(module), name, None)
    return callable(attr) and getattr(nn.Module, name, None) is not attr


def _through_root(module: nn.Module, method: str, *args: Any) -> Any:
    """Call ``module.<method>(*args)`` from inside ``module(...)``, so FSDP's root hooks wrap it.

    FSDP2 treats the first unit whose ``forward`` runs as the root. A LightningModule step that
    calls ``self.model(x)`` (not ``self(x)``) would make a child unit the root and leave the real
    root's parameters sharded. So, like Lightning's forward redirection, ``forward`` is swapped
    for the step for exactly one call; the step's own ``self(...)`` calls reach the real forward.
    """
    if not isinstance(module, FSDPModule):
        return getattr(module, method)(*args)
    had_own = "forward" in vars(module)
    original = module.forward

    def restore() -> None:
        if had_own:
            module.forward = original
        else:
            vars(module).pop("forward", None)

    def redirected(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()
        return getattr(module, method)(*inner_args, **inner_kwargs)

    module.forward = redirected
    try:
        return module(*args)
    finally:
        restore()


def _parse_optimizers(result: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Lightning's ``configure_optimizers`` return forms -> (optimizers, schedulers)."""
    if result is None:
        return [], []
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, Mapping):
        scheduler = result.get("lr_scheduler")
        if isinstance(scheduler, Mapping):
            scheduler = scheduler.get("scheduler")
        return [result["optimizer"]], [scheduler] if scheduler is not None else []
    if isinstance(result, tuple) and len(result) == 2 and all(isinstance(r, (list, tuple)) for r in result):
        optimizers, schedulers = result
        return list(optimizers), [s.get("scheduler") if isinstance(s, Mapping) else s for s in schedulers]
    if isinstance(result, (list, tuple)):
        optimizers, schedulers = [], []
        for item in result:
            opts, scheds = _parse_optimizers(item)
            optimizers += opts
            schedulers += scheds
        return optimizers, schedulers
    raise ValueError(f"FSDP2Strategy: configure_optimizers returned {type(result).__name__}, not an optimizer.")


def _current_ties(module: nn.Module, before: list[list[str]]) -> list[list[str]]:
    """Tie groups to restore: those recorded before ``parallelize_fn`` whose names still exist, plus
    ties the module still shows under names a wrapper may have changed."""
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    ties = [group for group in before if all(n in names for n in group)]
    covered = {n for group in ties for n in group}
    return ties + [group for group in _tied_groups(module) if not covered.intersection(group)]


def _fsdp_option_names(parallelize_fn: Optional[Callable[..., Any]]) -> list[str]:
    """The ``**kwargs`` names the strategy accepts: ``fsdp()``'s options (not the model, nor the
    strategy's own ``mp``/``device``), plus a custom ``parallelize_fn``'s own keyword parameters."""
    names = [n for n in inspect.signature(fsdp).parameters if n not in ("model", "mp", "device")]
    if parallelize_fn is not None:
        try:
            params = inspect.signature(parallelize_fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: fsdp()'s names only
            params = []
        skip = ("module", "device_mesh", "mp_policy")
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names += [p.name for p in params if p.kind in kinds and p.name not in skip and p.name not in names]
    return names


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only; every rank raises if it failed (``state_dict.on_all_ranks``), so no
    peer waits in a collective forever. Other ranks return ``None``."""
    return sd.on_all_ranks(lambda: fn() if sd.current_rank() == 0 else None)


def _long_job_options(kwargs: dict[str, Any], checkpoint_format: str) -> dict[str, Any]:
    """Pop and check ``async_save`` / ``keep_last`` / ``preemption_signals`` (constructor time, no process group)."""
    options = {
        "async_save": kwargs.pop("async_save", False),
        "keep_last": kwargs.pop("keep_last", None),
        "preemption_signals": tuple(kwargs.pop("preemption_signals", ()) or ()),
    }
    if not isinstance(options["async_save"], bool):
        raise ValueError(f"FSDP2Strategy: async_save must be True or False, got {options['async_save']!r}.")
    keep = options["keep_last"]
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"FSDP2Strategy: keep_last must be a positive int or None, got {keep!r}.")
    if (options["async_save"] or keep is not None) and checkpoint_format != "sharded":
        raise ValueError(
            'FSDP2Strategy: async_save and keep_last apply to checkpoint_format="sharded" (DCP directories); '
            f"checkpoint_format is {checkpoint_format!r}."
        )
    sd.resolve_signals(options["preemption_signals"])  # a bad name is a ValueError now
    return options

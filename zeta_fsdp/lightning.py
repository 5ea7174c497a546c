"""``FSDP2Strategy`` as a ``lightning.pytorch`` strategy: pass it to a ``Trainer``.

Optional (``pip install zeta-fsdp[lightning]``); ``import zeta_fsdp`` never imports it. A thin
adapter: NeMo's API is the Lightning-free ``zeta_fsdp.FSDP2Strategy`` it holds as ``self.core``;
this class answers Lightning's calls (launch, process group, precision plugin, logging).

The base is ``ParallelStrategy``, not ``ModelParallelStrategy`` (NeMo's): that one refuses
``"16-mixed"``, demands ``configure_model``, resolves "auto" sizes the other way and has its own
checkpoint format: nearly every method would be overridden.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

try:
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher  # no public name for it
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError(
        "zeta_fsdp.lightning needs Lightning: pip install 'zeta-fsdp[lightning]' (lightning>=2.4)."
    ) from e

from .options import resolve_mixed_precision
from .state_dict.checks import GROUPS_PREFIX, STATE_PREFIX, named_parameters
from .strategy import FSDP2Strategy as CoreStrategy
from .strategy.options import resolve_sizes
from .strategy.steps import call_through_root, nemo_step_result
from .training import clip_grad_norm_

__all__ = ["FSDP2Strategy", "MESH_DIM_NAMES", "precision_policy"]

# The adapter's mesh dimensions: Lightning's (ModelParallelStrategy) names, not zeta's "dp"/"tp".
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")

_MIXED = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
_ACCEPTED_PRECISION = ("32-true", "32", "bf16-mixed", "16-mixed")
# What NeMo's validation/test steps log (its recipes monitor "val_loss").
_LOGGED = {"validation": "val_loss", "test": "test_loss"}


def precision_policy(precision: str) -> Optional[MixedPrecisionPolicy]:
    """The FSDP2 policy a Trainer ``precision`` maps to (``None``: full precision).

    Example:
        >>> precision_policy("bf16-mixed").param_dtype
        torch.bfloat16
    """
    precision = str(precision)
    if precision not in _ACCEPTED_PRECISION:
        raise ValueError(
            f"zeta_fsdp.lightning.FSDP2Strategy: precision={precision!r} is not accepted. Accepted: "
            f"{_ACCEPTED_PRECISION} (mixed precision runs as an FSDP2 policy with fp32 master weights)."
        )
    return resolve_mixed_precision(_MIXED[precision]) if precision in _MIXED else None


class _ZetaMixin:
    """Precision plugin behaviour under FSDP2: FSDP casts (no autocast); norm clipping is zeta's."""

    strategy: Optional[FSDP2Strategy] = None

    def forward_context(self) -> ContextManager:
        return nullcontext()  # the FSDP2 policy casts parameters; autocast would only add casts

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        # DTensor-aware over every mesh dimension (dp and tp), unlike torch.nn.utils.clip_grad_norm_
        clip_grad_norm_(self.strategy.lightning_module, float(clip_val))


class _FullPrecision(_ZetaMixin, Precision):
    pass


class _FSDPMixedPrecision(_ZetaMixin, MixedPrecision):
    pass


def _hparam_classes(module: Any) -> list[type]:
    """The non-builtin classes in ``module.hparams`` (the dict itself, dataclasses, enums, ...), recursively."""
    found: list[type] = []

    def visit(value: Any) -> None:
        cls = type(value)
        if cls.__module__ != "builtins" and not isinstance(value, torch.Tensor) and cls not in found:
            found.append(cls)
        items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            items = [getattr(value, f.name) for f in dataclasses.fields(value)]
        for item in items:
            visit(item)

    visit(getattr(module, "hparams", {}))
    return found


def _core_attribute(name: str) -> property:
    """NeMo's attribute ``name``, read and written on the core: one value, whichever class is asked."""
    doc = getattr(CoreStrategy, name).__doc__ if isinstance(getattr(CoreStrategy, name, None), property) else None
    return property(lambda self: getattr(self.core, name), lambda self, value: setattr(self.core, name, value), doc=doc)


def _core_method(name: str) -> Callable[..., Any]:
    """NeMo's method ``name``: the core's, with its signature and docstring."""
    method = getattr(CoreStrategy, name)

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self.core, *args, **kwargs)

    return call


def _saved_fqn(rest: str, live: set[str]) -> bool:
    """Whether a flat optimizer key's remainder (``<fqn>.<state or option>``) names a live parameter."""
    parts = rest.split(".")
    return any(".".join(parts[:n]) in live for n in range(1, len(parts)))


def map_module_prefix(state: Any, module: Any) -> Any:
    """A flat optimizer state saved from a module inside ``module`` (NeMo: ``self.model`` of the LightningModule),
    its keys given the child's prefix (``state.l1.weight.step`` -> ``state.model.l1.weight.step``) when exactly
    one child prefix makes every key name a live parameter; anything else is returned as it was (and the load
    then names what does not match).

    Example:
        >>> import torch.nn as nn
        >>> outer = nn.Module(); outer.model = nn.Linear(2, 2)
        >>> sorted(map_module_prefix({"state.weight.step": 1, "param_groups.weight.lr": 0.1}, outer))
        ['param_groups.model.weight.lr', 'state.model.weight.step']
    """
    keys = list(state) if isinstance(state, Mapping) else []
    if not keys or not all(isinstance(k, str) and k.startswith((STATE_PREFIX, GROUPS_PREFIX)) for k in keys):
        return state
    live = set(named_parameters(module))

    def kind_rest(key: str) -> tuple[str, str]:
        kind = STATE_PREFIX if key.startswith(STATE_PREFIX) else GROUPS_PREFIX
        return kind, key[len(kind) :]

    if all(_saved_fqn(kind_rest(k)[1], live) for k in keys):
        return state
    prefixes = sorted({name + "." for name, _ in module.named_modules() if name})
    fits = [p for p in prefixes if all(_saved_fqn(p + kind_rest(k)[1], live) for k in keys)]
    if len(fits) != 1:
        return state
    return {kind + fits[0] + rest: value for kind, rest, value in ((*kind_rest(k), v) for k, v in state.items())}


class FSDP2Strategy(ParallelStrategy):
    """Lightning strategy running ``zeta_fsdp.FSDP2Strategy``: FSDP2 (+ tensor parallel) in a ``Trainer``.

    Takes ``zeta_fsdp.FSDP2Strategy``'s arguments (and Lightning's ``process_group_backend`` / ``timeout`` /
    ``save_distributed_checkpoint``); ``Trainer(precision="bf16-mixed" | "16-mixed")`` becomes the FSDP2 policy,
    ``gradient_clip_val`` clips with ``zeta_fsdp.clip_grad_norm_``; docs/lightning.md has the rest.

    Example:
        trainer = L.Trainer(devices=2, accelerator="cpu", precision="bf16-mixed",
                            strategy=FSDP2Strategy(TransformerBlock=Block), gradient_clip_val=1.0)
    """

    strategy_name = "zeta_fsdp2"

    def __init__(
        self,
        data_parallel_size: Union[str, int] = "auto",
        tensor_parallel_size: Union[str, int] = "auto",
        data_sampler: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        mp_policy: Union[MixedPrecisionPolicy, str, None] = None,
        parallelize_fn: Optional[Callable[..., Any]] = None,
        **kwargs: Any,
    ) -> None:
        # checks every argument now (the world size is known in _configure_launcher)
        self.core = CoreStrategy(
            data_parallel_size, tensor_parallel_size, data_sampler, checkpoint_io, mp_policy, parallelize_fn, **kwargs
        )
        # Lightning pickles hyperparameters (dataclasses too); they load back with weights_only=False.
        self.core.entries_weights_only = False
        self.core.owns_optimizers = False  # Lightning calls configure_optimizers itself
        # Lightning's ModelParallelStrategy names its mesh dims so; users index self.device_mesh["data_parallel"]
        self.core.mesh_dim_names = MESH_DIM_NAMES
        super().__init__(checkpoint_io=checkpoint_io)
        self.num_nodes = 1
        self.trainer: Optional[Any] = None  # NeMo's: the Trainer, once setup() ran
        self._mesh: Optional[Any] = None
        self._user_policy = mp_policy is not None or "mp" in kwargs

    # ------------------------------------------------------------------ NeMo's API: the core's

    mp_policy = _core_attribute("mp_policy")
    parallelize_fn = _core_attribute("parallelize_fn")
    data_sampler = _core_attribute("data_sampler")
    current_epoch_step = _core_attribute("current_epoch_step")
    _get_loss_reduction = _core_method("_get_loss_reduction")
    tensor_init_context = _core_method("tensor_init_context")
    lightning_module_state_dict = _core_method("lightning_module_state_dict")
    optimizer_state = _core_method("optimizer_state")
    load_model_state_dict = _core_method("load_model_state_dict")

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Queue ``checkpoint["optimizer_states"]`` for the first training step (the core's), a state saved from
        the LightningModule's inner model (keys without its ``model.`` prefix) mapped onto the module's names.
        Example: ``trainer.strategy.load_optimizer_state_dict({"optimizer_states": [inner_state]})``."""
        module = self.lightning_module
        states = checkpoint.get("optimizer_states") if isinstance(checkpoint, Mapping) else None
        if module is not None and isinstance(states, (list, tuple)):
            checkpoint = {**checkpoint, "optimizer_states": [map_module_prefix(s, module) for s in states]}
        self.core.load_optimizer_state_dict(checkpoint)

    remove_checkpoint = _core_method("remove_checkpoint")

    @property
    def checkpoint_io(self) -> Any:
        """The ``CheckpointIO`` replacing the full-format writer (``None``: zeta's own writer)."""
        return self.core.checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self.core.checkpoint_io = self._checkpoint_io = io

    def parallelize(self) -> None:
        """Shard the module with ``parallelize_fn``, once (``Trainer`` calls it in ``setup``)."""
        self.core.connect(self.lightning_module)
        self.core.parallelize()
        self.model = self.core.model

    # ------------------------------------------------------------------ topology

    @property
    def root_device(self) -> torch.device:
        """This rank's device (Lightning's choice)."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning adds a distributed sampler over the data-parallel ranks."""
        return True

    @property
    def device_mesh(self) -> Any:
        """The 2-D ``("data_parallel", "tensor_parallel")`` mesh (also the LightningModule's ``device_mesh``);
        before the Trainer set up the processes it raises, as Lightning's does."""
        if self._mesh is None:
            raise RuntimeError(
                "zeta_fsdp.lightning.FSDP2Strategy: the device mesh exists once the Trainer set up the processes "
                "(in configure_model, setup or later), not before."
            )
        return self._mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's ``DistributedSampler`` splits over the data-parallel group (tp peers read alike)."""
        return {"num_replicas": self.core.data_parallel_size, "rank": self.core.data_parallel_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """``True``: a checkpoint loads into the sharded module and its optimizers."""
        return True

    def _configure_launcher(self) -> None:
        # The world size is known before any process starts: a bad size fails now, not in a child
        # that would leave rank 0 waiting in init_process_group.
        opts = self.core.options
        resolve_sizes(opts.data_parallel_size, opts.tensor_parallel_size, self.num_nodes * max(self.num_processes, 1))
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ precision plugin

    @property
    def precision_plugin(self) -> Precision:
        """Lightning's precision plugin, replaced by one that lets FSDP2 cast and zeta clip."""
        return self._precision_plugin if self._precision_plugin is not None else _FullPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is None or isinstance(plugin, _ZetaMixin):
            self._precision_plugin = plugin
            return
        name = str(getattr(plugin, "precision", "32-true"))
        policy = precision_policy(name)
        if policy is None:
            wrapped: Precision = _FullPrecision()
        else:
            if self._user_policy and self.core.mp_policy != policy:
                raise ValueError(
                    f"zeta_fsdp.lightning.FSDP2Strategy: Trainer(precision={name!r}) and mp_policy="
                    f"{self.core.mp_policy} disagree; give mixed precision once."
                )
            self.core.mp_policy = policy
            device = "cuda" if getattr(plugin, "device", "cpu") == "cuda" else "cpu"
            wrapped = _FSDPMixedPrecision(name, device, scaler=getattr(plugin, "scaler", None))
        wrapped.strategy = self
        self._precision_plugin = wrapped

    # ------------------------------------------------------------------ set-up

    def setup_environment(self) -> None:
        """Join the job Lightning launched (zeta's process group start-up), then build the ``(dp, tp)`` mesh."""
        super().setup_environment()
        self.set_world_ranks()
        env = self.cluster_environment
        # the rendezvous Lightning's launcher (or torchrun, SLURM) chose, in the variables torch reads
        os.environ.update(MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port))
        os.environ.update(RANK=str(self.global_rank), WORLD_SIZE=str(self.world_size))
        self.core.options.device = self.core.options.device or self.root_device
        self.core.setup_environment()
        self._mesh = self.lightning_module._device_mesh = self.core.device_mesh

    def setup(self, trainer: Any) -> None:
        """Shard the module (after ``configure_model``), then let Lightning create the optimizers."""
        assert self.lightning_module is not None
        self.trainer = trainer
        self.accelerator.setup(trainer)
        self.parallelize()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.core.optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        """Nothing to move: sharding placed every shard on its device."""

    def process_dataloader(self, dataloader: Any) -> Any:
        """Lightning already split the data over dp ranks; a ``data_sampler`` given to the strategy applies."""
        return self.core.process_dataloader(dataloader) if self.core.data_sampler is not None else dataloader

    # ------------------------------------------------------------------ steps (through the FSDP root)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step`` inside the FSDP root's forward; a queued optimizer state applies first."""
        self.core.restore_pending_optimizer_state()  # NeMo: deferred to the first step (PEFT adds adapters late)
        self.core.set_epoch(self.trainer.current_epoch if self.trainer is not None else 0)
        with self.precision_plugin.train_step_context():
            return call_through_root(self.lightning_module, "training_step", *args, *kwargs.values())

    def _eval_step(self, step_type: str, context: ContextManager, args: tuple) -> Any:
        # NeMo's step: the module's step, its loss reduction, val_loss / test_loss logged
        with context:
            output = call_through_root(self.lightning_module, f"{step_type}_step", *args)
        loss, reduced = nemo_step_result(self.lightning_module, step_type, args[0] if args else None, output)
        value, key = reduced.get("avg"), _LOGGED.get(step_type)
        if key and isinstance(value, torch.Tensor) and value.numel() == 1:
            try:  # the mean over ranks, so every rank's ModelCheckpoint(monitor="val_loss") decides alike
                self.lightning_module.log(key, value.detach().float(), sync_dist=True, batch_size=1)
            except MisconfigurationException:
                pass  # the module logs this name itself, with other options: its own value stays
        return reduced if step_type == "predict" else loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``validation_step`` through the FSDP root; logs ``val_loss`` as NeMo does."""
        return self._eval_step("validation", self.precision_plugin.val_step_context(), (*args, *kwargs.values()))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``test_step`` through the FSDP root; logs ``test_loss``."""
        return self._eval_step("test", self.precision_plugin.test_step_context(), (*args, *kwargs.values()))

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step`` through the FSDP root; returns NeMo's reduced dict (``{"avg": output}``)."""
        return self._eval_step("predict", self.precision_plugin.predict_step_context(), (*args, *kwargs.values()))

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: Optional[str] = None) -> None:
        """Every rank waits here."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """All-reduce a tensor in place (mean by default), for ``self.log(sync_dist=True)``."""
        if not isinstance(tensor, torch.Tensor) or not (dist.is_available() and dist.is_initialized()):
            return tensor
        name = reduce_op.lower() if isinstance(reduce_op, str) else None
        mean = name in ("mean", "avg")  # gloo has no AVG: sum, then divide
        op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, name.upper()) if name else reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        return tensor.copy_(tensor / dist.get_world_size(group)) if mean else tensor

    # ------------------------------------------------------------------ checkpoints (the core's)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """zeta's checkpoint (full file, or DCP directory); ``storage_options`` goes to ``checkpoint_io``."""
        self.core.save_checkpoint(checkpoint, self.broadcast(filepath), storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore the weights now, queue the optimizer state; return the checkpoint for Lightning."""
        # Lightning 2.6 drops trainer.fit(weights_only=...) here, and the file holds the module's
        # hyperparameters: allow exactly the classes the live module's own hyperparameters use.
        with torch.serialization.safe_globals(_hparam_classes(self.lightning_module)):
            return self.core.load_checkpoint(self.broadcast(checkpoint_path), weights_only=weights_only)

    def teardown(self) -> None:
        """Release Lightning's pieces; the process group stays (Lightning's own strategies keep it too)."""
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()

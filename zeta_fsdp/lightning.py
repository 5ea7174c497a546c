"""``FSDP2Strategy`` as a ``lightning.pytorch`` strategy: pass it to a ``Trainer``.

Optional (``pip install zeta-fsdp[lightning]``); ``import zeta_fsdp`` never imports this module.
Every piece of work is delegated to the Lightning-free ``zeta_fsdp.FSDP2Strategy`` (mesh,
sharding, checkpoints); this class only answers Lightning's calls.

Why ``ParallelStrategy`` and not Lightning's ``ModelParallelStrategy`` (NeMo's base): that one
refuses ``precision="16-mixed"`` in the Trainer's checks, demands a ``configure_model`` hook,
resolves "auto" sizes the opposite way (tensor parallel over the node) and has its own
checkpoint format: nearly every method would be overridden.

Example:
    from zeta_fsdp.lightning import FSDP2Strategy
    trainer = L.Trainer(devices=2, accelerator="cpu", strategy=FSDP2Strategy(TransformerBlock=Block))
    trainer.fit(module)
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, ContextManager, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

try:
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device as _lt_backend
    from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError(
        "zeta_fsdp.lightning needs Lightning: pip install 'zeta-fsdp[lightning]' (lightning>=2.4)."
    ) from e

from .options import resolve_mixed_precision
from .strategy import FSDP2Strategy as CoreStrategy
from .strategy.options import resolve_sizes
from .strategy.steps import call_through_root
from .training import clip_grad_norm_

__all__ = ["FSDP2Strategy", "MESH_DIM_NAMES", "precision_policy"]

# The adapter's mesh dimensions: Lightning's (ModelParallelStrategy) names, not zeta's "dp"/"tp".
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")

_MIXED = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
_ACCEPTED_PRECISION = ("32-true", "32", "bf16-mixed", "16-mixed")


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


class FSDP2Strategy(ParallelStrategy):
    """Lightning strategy running ``zeta_fsdp.FSDP2Strategy``: FSDP2 (+ tensor parallel) in a ``Trainer``.

    Takes exactly ``zeta_fsdp.FSDP2Strategy``'s arguments (and Lightning's ``process_group_backend``
    / ``timeout``). ``"auto"`` sizes mean FSDP over all ranks (dp = world / tp, tp = 1). The mesh
    dims are Lightning's names, ``self.device_mesh["data_parallel"]`` / ``["tensor_parallel"]``.
    ``Trainer(precision="bf16-mixed" | "16-mixed")`` becomes the matching FSDP2 policy on every
    unit with fp32 master weights; ``gradient_clip_val`` clips with ``zeta_fsdp.clip_grad_norm_``.
    The module is sharded in ``setup`` (after ``configure_model`` if it has one); checkpoints are
    zeta's (full file by default, ``checkpoint_format="sharded"`` for DCP), resumable with
    ``trainer.fit(model, ckpt_path=...)``.

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
        parallelize_fn: Optional[Any] = None,
        **kwargs: Any,
    ) -> None:
        # zeta's strategy checks every argument now (no world size yet: it is known in _configure_launcher)
        self.core = CoreStrategy(
            data_parallel_size, tensor_parallel_size, data_sampler, checkpoint_io, mp_policy, parallelize_fn, **kwargs
        )
        # Lightning pickles hyperparameters (dataclasses too); they load back with weights_only=False.
        self.core.entries_weights_only = False
        # Lightning's ModelParallelStrategy names its mesh dims so; users index self.device_mesh["data_parallel"]
        self.core.mesh_dim_names = MESH_DIM_NAMES
        super().__init__()
        self.num_nodes = 1
        self._user_policy = mp_policy is not None or "mp" in kwargs

    # ------------------------------------------------------------------ topology

    @property
    def root_device(self) -> torch.device:
        """This rank's device (Lightning's choice).

        Example:
            trainer.strategy.root_device
            # -> device(type='cpu')
        """
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes on this node.

        Example:
            trainer.strategy.num_processes
            # -> 2
        """
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning adds a distributed sampler over the data-parallel ranks.

        Example:
            >>> FSDP2Strategy().is_distributed
            True
        """
        return True

    @property
    def device_mesh(self) -> Any:
        """The 2-D mesh, dims named as Lightning's ``ModelParallelStrategy`` names them:
        ``("data_parallel", "tensor_parallel")``; also ``self.device_mesh`` in the LightningModule.

        Example:
            trainer.strategy.device_mesh["data_parallel"].size()
            # -> 2
        """
        return self.core.device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's ``DistributedSampler`` splits over the data-parallel group (tp peers read alike).

        Example:
            trainer.strategy.distributed_sampler_kwargs
            # -> {'num_replicas': 2, 'rank': 0}
        """
        return {"num_replicas": self.core.data_parallel_size, "rank": self.core.data_parallel_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """``True``: a checkpoint loads into the sharded module and its optimizers.

        Example:
            >>> FSDP2Strategy().restore_checkpoint_after_setup
            True
        """
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """``False``: ``load_checkpoint`` restores the optimizers itself.

        Example:
            >>> FSDP2Strategy().lightning_restore_optimizer
            False
        """
        return False

    def _configure_launcher(self) -> None:
        # The world size is known here, before any process starts: a bad size fails now, not in a
        # child that would leave rank 0 waiting in init_process_group.
        resolve_sizes(
            self.core.options.data_parallel_size,
            self.core.options.tensor_parallel_size,
            self.num_nodes * max(self.num_processes, 1),
        )
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size.

        Example:
            trainer.strategy.set_world_ranks()
        """
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ precision plugin

    @property
    def precision_plugin(self) -> Precision:
        """Lightning's precision plugin, replaced by one that lets FSDP2 cast and zeta clip.

        Example:
            trainer.strategy.precision_plugin.precision
            # -> 'bf16-mixed'
        """
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
        """Join (start) the process group the Lightning way, then build zeta's ``(dp, tp)`` mesh.

        Example:
            trainer.strategy.setup_environment()  # Lightning calls it
        """
        super().setup_environment()
        self.set_world_ranks()
        backend = self.core.options.process_group_backend or _lt_backend(self.root_device)
        timeout = self.core.options.timeout or timedelta(minutes=30)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=timeout, device_id=device_id)
        self.core.connect(self.lightning_module)
        self.core.setup_environment()
        self.lightning_module._device_mesh = self.core.device_mesh

    def tensor_init_context(self, empty_init: Optional[bool] = None) -> ContextManager:
        """Where ``configure_model`` runs: real tensors, ``meta`` only with ``empty_init=True``.

        Lightning passes ``empty_init=None``: a model that loads pretrained weights there keeps them.

        Example:
            with trainer.strategy.tensor_init_context(empty_init=True):
                model = GPT(cfg)
        """
        return self.core.tensor_init_context(empty_init)

    def setup(self, trainer: Any) -> None:
        """Shard the module with zeta (after ``configure_model``), then let Lightning create the optimizers.

        Example:
            trainer.strategy.setup(trainer)  # Lightning calls it
        """
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.core.connect(self.lightning_module)
        # the strategy shards; Lightning's configure_optimizers creates the optimizers afterwards
        self.core.setup_optimizers(lambda module: None)
        self.model = self.core.model
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.core.optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        """Nothing to move: sharding placed every shard on its device.

        Example:
            trainer.strategy.model_to_device()
        """

    def process_dataloader(self, dataloader: Any) -> Any:
        """Lightning already split the data over dp ranks; a ``data_sampler`` given to the strategy applies.

        Example:
            loader = trainer.strategy.process_dataloader(loader)
        """
        if self.core.data_sampler is not None:
            return self.core.process_dataloader(dataloader)
        return dataloader

    # ------------------------------------------------------------------ steps (through the FSDP root)

    def _step(self, name: str, context: ContextManager, *args: Any) -> Any:
        # A step calling self.model(...) must not make a child the FSDP root (see call_through_root).
        with context:
            return call_through_root(self.lightning_module, name, *args)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step``, run inside the FSDP root's forward.

        Example:
            trainer.strategy.training_step(batch, 0)  # Lightning calls it
        """
        return self._step("training_step", self.precision_plugin.train_step_context(), *args, *kwargs.values())

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``validation_step`` through the FSDP root.

        Example:
            trainer.strategy.validation_step(batch, 0)
        """
        return self._step("validation_step", self.precision_plugin.val_step_context(), *args, *kwargs.values())

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``test_step`` through the FSDP root.

        Example:
            trainer.strategy.test_step(batch, 0)
        """
        return self._step("test_step", self.precision_plugin.test_step_context(), *args, *kwargs.values())

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step`` through the FSDP root.

        Example:
            trainer.strategy.predict_step(batch, 0)
        """
        return self._step("predict_step", self.precision_plugin.predict_step_context(), *args, *kwargs.values())

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: Optional[str] = None) -> None:
        """Every rank waits here.

        Example:
            trainer.strategy.barrier()
        """
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank.

        Example:
            path = trainer.strategy.broadcast(path)
        """
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """All-reduce a tensor (mean by default), as Lightning's DDP does for ``self.log(sync_dist=True)``.

        Example:
            trainer.strategy.reduce(torch.tensor(1.0))
            # -> tensor(1.)
        """
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict on rank 0 (``{}`` elsewhere); ``save_checkpoint`` reuses it.

        Example:
            trainer.strategy.lightning_module_state_dict()
        """
        return self.core.lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's full state keyed by parameter FQN on rank 0; ``save_checkpoint`` reuses it.

        Example:
            trainer.strategy.optimizer_state(trainer.optimizers[0])
        """
        return self.core.optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """zeta's checkpoint (full file, or DCP directory with ``checkpoint_format="sharded"``); every rank calls it.

        Example:
            trainer.save_checkpoint("ckpt/manual.ckpt")
        """
        self.core.save_checkpoint(checkpoint, self.broadcast(filepath), storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore weights and optimizer state now; return the checkpoint for Lightning's loops and callbacks.

        Example:
            trainer.fit(module, ckpt_path="ckpt/last.ckpt")  # calls it
        """
        # Lightning 2.6 drops trainer.fit(weights_only=...) for strategies restoring after setup, and
        # the file holds the module's hyperparameters (dataclasses...): allow exactly the classes the
        # live module's own hyperparameters use, nothing else.
        with torch.serialization.safe_globals(_hparam_classes(self.lightning_module)):
            ckpt = self.core.load_checkpoint(self.broadcast(checkpoint_path), weights_only=weights_only)
        self.core.restore_pending_optimizer_state()  # Lightning never restores them here
        return ckpt

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` restored the weights already (other ranks hold an empty dict).

        Example:
            trainer.strategy.load_model_state_dict(ckpt)
        """

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint`` restored the optimizers already.

        Example:
            trainer.strategy.load_optimizer_state_dict(ckpt)
        """

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint (refusing anything that is not one); every rank calls it.

        Example:
            trainer.strategy.remove_checkpoint("ckpt/old.ckpt")
        """
        self.core.remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Release Lightning's pieces; the process group stays (Lightning's own strategies keep it too).

        Example:
            trainer.strategy.teardown()
        """
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()

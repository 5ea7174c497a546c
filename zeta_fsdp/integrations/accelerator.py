"""``FSDPAccelerator``: accelerate's ``Accelerator`` for a model ``fsdp()`` already sharded.

``Accelerator.prepare`` wraps a model in ``DistributedDataParallel`` (on CPU, or a single GPU per
process), which fails on DTensor parameters and would all-reduce a NO_SHARD model twice; its FSDP2
plugin shards again. Here a model ``fsdp()`` wrapped is passed through as it is: its engine
already reduces gradients. What accelerate does around the model is answered by ours:
``no_sync`` (gradient accumulation: ``accumulate``), ``clip_grad_norm_`` (DTensors on any mesh),
and mixed precision, which the model's own ``mp`` decides (``check_precision``).
Any other model is prepared as accelerate does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.nn as nn

try:
    import accelerate
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError("zeta_fsdp.integrations needs accelerate: pip install 'zeta-fsdp[hf]'") from e

from ..engines import engine_named, fsdp_engine, fsdp_param_groups, is_fsdp_wrapped
from ..torch_compat import param_mp_policy
from ..training import clip_grad_norm_, no_sync

__all__ = ["FSDPAccelerator", "check_precision", "compute_dtype"]

_FLAG = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype FSDP2's policy computes ``model`` in (``None``: no cast; also for DDP's engine).

    Example:
        >>> compute_dtype(nn.Linear(2, 2)) is None
        True
    """
    for module in model.modules():
        for group in fsdp_param_groups(module) or []:
            for fsdp_param in getattr(group, "fsdp_params", []):
                return param_mp_policy(group, fsdp_param).param_dtype
    return None


def check_precision(model: nn.Module, mixed_precision: str, setting: str) -> bool:
    """Whether accelerate's autocast may run on ``model``; a ``ValueError`` if no single mechanism fits.

    One mechanism, decided by ``fsdp(mp=...)``: FSDP2's policy casts the parameters (``mp="bf16"``:
    bf16 compute, fp32 master weights and reduction), so accelerate's autocast never runs on top of
    it; ``mixed_precision="bf16"`` (``TrainingArguments(bf16=True)``) must then name the same dtype.
    On DDP's engine (NO_SHARD) ``mp="bf16"`` is ``torch.autocast`` itself, and accelerate's bf16
    autocast is that same mechanism, so it may run. fp16 needs a loss scaler whose overflow check
    spans the shards, which accelerate's is not: refused under FSDP2, and ``setting`` names the fix.

    Example:
        >>> check_precision(nn.Linear(2, 2), "no", "mixed_precision")
        False
    """
    if mixed_precision in (None, "no"):
        return False
    wanted = _FLAG.get(mixed_precision)
    if wanted is None:
        raise ValueError(
            f"zeta_fsdp: {setting} asks for mixed precision {mixed_precision!r}, which a model sharded by fsdp() "
            "cannot take from accelerate. Set it once, in fsdp(model, mp='bf16'), and leave it off here."
        )
    engine = fsdp_engine(model)
    if engine is not None and engine_named(engine).AUTOCAST_MP and wanted == torch.bfloat16:
        return True  # the same torch.autocast(bf16) the engine's own mp="bf16" runs: one mechanism
    has = compute_dtype(model)
    if wanted == torch.bfloat16 and has == torch.bfloat16:
        return False  # FSDP2's policy already computes in bf16: no autocast stacked on top
    if wanted == torch.float16:
        fix = f"turn {setting} off and use fsdp(model, mp='bf16') (fp16 needs a loss scaler synchronised across shards)"
    else:
        fix = f"build the model with fsdp(model, mp='bf16', ...) (FSDP2's policy: bf16 compute, fp32 master weights), or turn {setting} off"
    raise ValueError(
        f"zeta_fsdp: {setting} asks for {mixed_precision} mixed precision, but the model fsdp() sharded computes in "
        f"{has or 'its parameters dtype (mp=fp32)'}; mixed precision is set once, by fsdp()'s mp: {fix}."
    )


class FSDPAccelerator(accelerate.Accelerator):
    """An ``accelerate.Accelerator`` that never wraps a model ``fsdp()`` returned a second time.

    ``prepare(model, optimizer, loader, scheduler)`` returns that same model object (no
    ``DistributedDataParallel``, no second ``fully_shard``); ``accumulate``/``no_sync`` defer its
    gradient collectives with ``zeta_fsdp.no_sync``; ``clip_grad_norm_`` is ``zeta_fsdp.clip_grad_norm_``;
    mixed precision is the model's own ``mp`` (``check_precision``). Other models: as accelerate.

    Example:
        accelerator = FSDPAccelerator(gradient_accumulation_steps=2)
        model, optimizer, loader = accelerator.prepare(fsdp(model, shard_strat="FULL_SHARD"), optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    """

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
        """The model as ``fsdp()`` left it (with accelerate's autocast only where ``check_precision`` allows)."""
        if not is_fsdp_wrapped(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.distributed_type in (accelerate.DistributedType.FSDP, accelerate.DistributedType.DEEPSPEED):
            raise ValueError(
                f"zeta_fsdp: the model is sharded by fsdp() already, and accelerate is set to shard it again "
                f"({self.distributed_type}). Drop accelerate's FSDP/DeepSpeed setting (fsdp=/fsdp_config=/deepspeed= in "
                "TrainingArguments, fsdp_plugin= or the FSDP/DeepSpeed part of `accelerate config`)."
            )
        if self.state.dynamo_plugin.backend != accelerate.utils.DynamoBackend.NO:
            raise ValueError(
                "zeta_fsdp: torch.compile through accelerate (TrainingArguments(torch_compile=True), dynamo_backend=) "
                "would compile around the FSDP hooks: use fsdp(model, compile=True) instead, and turn it off here."
            )
        self.__dict__.setdefault("_zeta_sharded", []).append(model)  # save_state refuses these (below)
        if check_precision(model, self.mixed_precision, "mixed_precision"):
            # evaluation_mode: accelerate adds its autocast only, no DistributedDataParallel
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Gradient accumulation: ``zeta_fsdp.no_sync`` for a model ``fsdp()`` wrapped."""
        if not is_fsdp_wrapped(model):
            with super().no_sync(model):
                yield
            return
        with no_sync(model):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: Any = 2) -> torch.Tensor:
        """The global gradient norm (before clipping) as a tensor, clipped with ``zeta_fsdp.clip_grad_norm_``."""
        if self.distributed_type in (accelerate.DistributedType.DEEPSPEED, accelerate.DistributedType.XLA):
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        return torch.tensor(clip_grad_norm_(list(parameters), max_norm, norm_type))

    def save_state(self, *args: Any, **kwargs: Any) -> Any:
        """Refused for a model ``fsdp()`` wrapped (accelerate would write rank 0's shards only)."""
        self._refuse_state("save_state", "save_checkpoint(path, model, optimizer)")
        return super().save_state(*args, **kwargs)

    def load_state(self, *args: Any, **kwargs: Any) -> Any:
        """Refused for a model ``fsdp()`` wrapped: ``zeta_fsdp.load_checkpoint`` restores it."""
        self._refuse_state("load_state", "load_checkpoint(path, model, optimizer)")
        return super().load_state(*args, **kwargs)

    def _refuse_state(self, name: str, ours: str) -> None:
        if self.__dict__.get("_zeta_sharded"):
            raise ValueError(
                f"zeta_fsdp: FSDPAccelerator.{name}() cannot save a model fsdp() sharded (accelerate's writes one "
                f"rank's shards): use zeta_fsdp.{ours}, which saves every rank's shards with DCP."
            )

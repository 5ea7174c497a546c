"""``FSDP2Strategy``'s constructor arguments, checked in one place, and its ``(dp, tp)`` sizes; no process group.

``validate_strategy_options`` runs in the constructor, before the world size is known (Lightning's
launcher, SLURM); ``resolve_sizes`` turns ``"auto"`` sizes into numbers once it is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..fsdp import fsdp
from ..options import resolve_mixed_precision, resolve_sharding
from ..state_dict.preemption import resolve_signals

__all__ = ["StrategyOptions", "resolve_sizes", "validate_strategy_options"]

CHECKPOINT_FORMATS = ("full", "sharded")
# Options that never reach fsdp(): the strategy's own, Lightning's (process_group_backend ...), NeMo's (last five).
STRATEGY_KWARGS = tuple(
    "checkpoint_format tp_plan device process_group_backend timeout async_save keep_last preemption_signals skip_nonfinite "
    "meter_every "
    "save_distributed_checkpoint context_parallel_size sequence_parallel use_hf_tp_plan custom_tp_plan offload_policy".split()
)
_BACKENDS = ("gloo", "nccl", "cuda:nccl,cpu:gloo")


@dataclass
class StrategyOptions:
    """``FSDP2Strategy``'s arguments, checked (``data_sampler``, ``checkpoint_io``, ``parallelize_fn`` are kept as given)."""

    data_parallel_size: Union[str, int]
    tensor_parallel_size: Union[str, int]
    mp_policy: MixedPrecisionPolicy
    checkpoint_format: str = "full"
    tp_plan: Any = None
    device: Any = None
    process_group_backend: Optional[str] = None
    timeout: Optional[timedelta] = None
    fsdp_kwargs: dict[str, Any] = field(default_factory=dict)
    # Long jobs (sharded format): save in the background, keep the newest K, save on a signal.
    async_save: bool = False
    keep_last: Optional[int] = None
    preemption_signals: tuple = ()
    # optimizer_step() skips a step whose gradients are NaN/inf on any rank, on every rank (NonFiniteGuard).
    skip_nonfinite: bool = False
    # A StepMeter line (tokens/s, MFU, memory, slowest rank) every N optimizer steps; None: no meter.
    meter_every: Optional[int] = None


def resolve_sizes(dp: Union[str, int], tp: Union[str, int], world: int) -> tuple[int, int]:
    """``"auto"`` sizes (checked by ``validate_strategy_options``) to numbers: tp 1 unless given, dp = world / tp;
    the product must be the world."""
    tp_size = 1 if tp == "auto" else tp
    if dp == "auto" and world % tp_size != 0:
        raise ValueError(
            f"FSDP2Strategy: data_parallel_size='auto' x tensor_parallel_size={tp_size} cannot equal the "
            f"world size {world}: tensor_parallel_size={tp_size} does not divide it."
        )
    dp_size = world // tp_size if dp == "auto" else dp
    if dp_size * tp_size != world:
        raise ValueError(
            f"FSDP2Strategy: data_parallel_size={dp_size} x tensor_parallel_size={tp_size} = "
            f"{dp_size * tp_size}, but the world size is {world}; the product must equal it."
        )
    return dp_size, tp_size


def fsdp_option_names(parallelize_fn: Optional[Callable[..., Any]] = None) -> list[str]:
    """The ``**kwargs`` the strategy passes on: ``fsdp()``'s options (not ``model``, nor the strategy's
    own ``mp``/``device``), plus a custom ``parallelize_fn``'s own keyword parameters."""
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


def validate_strategy_options(
    data_parallel_size: Union[str, int],
    tensor_parallel_size: Union[str, int],
    checkpoint_io: Any,
    mp_policy: Union[MixedPrecisionPolicy, str, None],
    parallelize_fn: Optional[Callable[..., Optional[nn.Module]]],
    **kwargs: Any,
) -> StrategyOptions:
    """Check every ``FSDP2Strategy`` argument (``ValueError`` naming it and what is accepted; ``data_sampler``
    when used); sizes are checked for their form here, against the world size in ``resolve_sizes``."""
    _check_sizes(data_parallel_size, tensor_parallel_size)
    _nemo_arguments(kwargs)
    checkpoint_format = _checked_checkpoint_format(kwargs, checkpoint_io)
    backend, timeout = _process_group_options(kwargs)
    if mp_policy is not None and "mp" in kwargs:
        raise ValueError("FSDP2Strategy: pass mixed precision once, as mp_policy or as mp, not both.")
    policy = resolve_mixed_precision(mp_policy if mp_policy is not None else kwargs.pop("mp", None))
    if parallelize_fn is not None and not callable(parallelize_fn):
        raise ValueError(f"FSDP2Strategy: parallelize_fn={parallelize_fn!r} is not callable.")
    tp_plan = kwargs.pop("tp_plan", None)
    device = kwargs.pop("device", None)
    long_jobs = _long_job_options(kwargs, checkpoint_format)
    _check_fsdp_options(kwargs, parallelize_fn)
    sizes = (data_parallel_size, tensor_parallel_size)
    return StrategyOptions(*sizes, policy, checkpoint_format, tp_plan, device, backend, timeout, kwargs, **long_jobs)


def _check_sizes(data_parallel_size: Any, tensor_parallel_size: Any) -> None:
    """Each size is ``"auto"`` or an int >= 1 (checked against the world size in ``resolve_sizes``)."""
    for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if size != "auto" and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise ValueError(f"FSDP2Strategy: {name}={size!r} is not accepted. Accepted: 'auto' or an int >= 1.")


def _checked_checkpoint_format(kwargs: dict[str, Any], checkpoint_io: Any) -> str:
    """The checkpoint format (popped from ``kwargs``), one of ``CHECKPOINT_FORMATS``, and a ``checkpoint_io``
    that fits it: only for the full format, with the three methods Lightning calls."""
    checkpoint_format = _checkpoint_format(kwargs)
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"FSDP2Strategy: checkpoint_format={checkpoint_format!r} is not accepted. Accepted: {CHECKPOINT_FORMATS}."
        )
    if checkpoint_io is not None:
        if checkpoint_format == "sharded":
            raise ValueError(
                "FSDP2Strategy: checkpoint_io replaces the writer of the full format; the sharded format "
                "is written by DCP on every rank. Use one or the other."
            )
        needed = ("save_checkpoint", "load_checkpoint", "remove_checkpoint")
        missing = [m for m in needed if not callable(getattr(checkpoint_io, m, None))]
        if missing:
            raise ValueError(f"FSDP2Strategy: checkpoint_io lacks {missing}; it needs {list(needed)}.")
    return checkpoint_format


def _process_group_options(kwargs: dict[str, Any]) -> tuple[Optional[str], Optional[timedelta]]:
    """``(process_group_backend, timeout)`` popped from ``kwargs`` and checked (``None``: the default)."""
    backend = kwargs.pop("process_group_backend", None)
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"FSDP2Strategy: process_group_backend={backend!r} is not accepted. Accepted: {_BACKENDS}.")
    timeout = kwargs.pop("timeout", None)
    if timeout is not None and not isinstance(timeout, timedelta):
        raise ValueError(f"FSDP2Strategy: timeout={timeout!r} is not accepted. Accepted: a datetime.timedelta.")
    return backend, timeout


def _check_fsdp_options(kwargs: dict[str, Any], parallelize_fn: Optional[Callable[..., Any]]) -> None:
    """What is left in ``kwargs`` are ``fsdp()``'s options (or ``parallelize_fn``'s), a ``shard_strat``
    one ``fsdp()`` accepts: ``ValueError`` now, not at ``parallelize()``."""
    accepted = fsdp_option_names(parallelize_fn)
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise ValueError(
            f"FSDP2Strategy: unknown keyword argument(s) {unknown}. Accepted: the strategy's own "
            f"{list(STRATEGY_KWARGS)} and mp, and fsdp()'s options {accepted}."
        )
    if "shard_strat" in kwargs:
        resolve_sharding(kwargs["shard_strat"])


def _nemo_arguments(kwargs: dict[str, Any]) -> None:
    """NeMo's own constructor arguments, mapped so a NeMo script runs unchanged, or refused by name."""
    cp = kwargs.pop("context_parallel_size", 1)
    if cp not in (1, None):
        raise ValueError(f"FSDP2Strategy: context_parallel_size={cp!r} is not supported. Accepted: 1.")
    if kwargs.pop("sequence_parallel", False):
        raise ValueError(
            "FSDP2Strategy: sequence_parallel=True is not supported; give SequenceParallel styles in tp_plan."
        )
    kwargs.pop("use_hf_tp_plan", None)  # without a tp_plan the module's own tp_plan attribute is used
    if kwargs.get("custom_tp_plan") is not None and kwargs.get("tp_plan") is not None:
        raise ValueError("FSDP2Strategy: give the tensor-parallel plan once, as tp_plan or custom_tp_plan.")
    plan = kwargs.pop("custom_tp_plan", None)
    kwargs["tp_plan"] = plan if plan is not None else kwargs.get("tp_plan")
    if kwargs.pop("offload_policy", None) is not None:
        kwargs.setdefault("cpu_offload", True)


def _checkpoint_format(kwargs: dict[str, Any]) -> str:
    """Pop ``checkpoint_format`` and Lightning's ``save_distributed_checkpoint`` (``True``: "sharded")."""
    fmt = kwargs.pop("checkpoint_format", None)
    distributed = kwargs.pop("save_distributed_checkpoint", None)
    if distributed is not None and not isinstance(distributed, bool):
        raise ValueError(
            f"FSDP2Strategy: save_distributed_checkpoint={distributed!r} is not accepted. Accepted: True, False."
        )
    implied = None if distributed is None else ("sharded" if distributed else "full")
    if fmt is not None and implied is not None and fmt != implied:
        raise ValueError(
            f"FSDP2Strategy: checkpoint_format={fmt!r} and save_distributed_checkpoint={distributed} disagree; give one."
        )
    return fmt if fmt is not None else implied or "full"


def _long_job_options(kwargs: dict[str, Any], checkpoint_format: str) -> dict[str, Any]:
    """Pop and check ``async_save`` / ``keep_last`` / ``preemption_signals`` (no process group needed)."""
    async_save, keep = kwargs.pop("async_save", False), kwargs.pop("keep_last", None)
    signals = tuple(kwargs.pop("preemption_signals", ()) or ())
    if not isinstance(async_save, bool):
        raise ValueError(f"FSDP2Strategy: async_save must be True or False, got {async_save!r}.")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"FSDP2Strategy: keep_last must be a positive int or None, got {keep!r}.")
    if (async_save or keep is not None) and checkpoint_format != "sharded":
        raise ValueError(
            'FSDP2Strategy: async_save and keep_last apply to checkpoint_format="sharded" (DCP directories); '
            f"checkpoint_format is {checkpoint_format!r}."
        )
    resolve_signals(signals)  # a bad name is a ValueError now
    skip = kwargs.pop("skip_nonfinite", False)
    if not isinstance(skip, bool):
        raise ValueError(f"FSDP2Strategy: skip_nonfinite must be True or False, got {skip!r}.")
    meter = kwargs.pop("meter_every", None)
    if meter is not None and (isinstance(meter, bool) or not isinstance(meter, int) or meter < 1):
        raise ValueError(
            f"FSDP2Strategy: meter_every must be a positive int (steps per report) or None, got {meter!r}."
        )
    return {
        "async_save": async_save,
        "keep_last": keep,
        "preemption_signals": signals,
        "skip_nonfinite": skip,
        "meter_every": meter,
    }

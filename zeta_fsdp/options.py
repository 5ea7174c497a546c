"""User-facing option strings -> FSDP2 objects. Pure: no process group, no model changes.

Every resolver raises ``ValueError`` naming the bad value and listing every accepted one,
so ``fsdp()`` can validate all of its arguments before it touches anything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "MASTER_DTYPE_ALIASES",
    "MIXED_PRECISION_ALIASES",
    "MP_PRESETS",
    "SHARDING_ALIASES",
    "ShardingSpec",
    "autocast_dtype",
    "choose_engine",
    "mesh_shape",
    "resolve_mesh_shape",
    "resolve_master_dtype",
    "stored_dtype",
    "resolve_mixed_precision",
    "resolve_sharding",
    "validate_keep_tail_unsharded",
    "validate_mesh",
    "validate_prefetch",
    "validate_replicate_size",
    "validate_reshard_after_forward",
]

# Canonical name -> (param_dtype, reduce_dtype, output_dtype): every field of the policy spelled
# out, so a torch release that changes a default changes none of our numerics (torch 2.15 made
# ``reduce_dtype=None`` follow the parameter's dtype where older releases reduced in
# ``param_dtype``). Gradients are reduced in fp32 on purpose: summing N bf16/fp16 gradients loses
# bits that fp32 keeps, at 2x the reduce-scatter bytes. ``None`` is deliberate where it stands:
# "fp32" casts nothing (each parameter computes and reduces in its own dtype, as DDP's engine
# does, on every release), and no preset casts outputs (a loss a model computes in fp32 stays fp32).
MP_PRESETS: dict[str, tuple[Optional[torch.dtype], Optional[torch.dtype], Optional[torch.dtype]]] = {
    "fp32": (None, None, None),
    "bf16": (torch.bfloat16, torch.float32, None),
    "fp16": (torch.float16, torch.float32, None),
}

MIXED_PRECISION_ALIASES: dict[str, str] = {
    **dict.fromkeys(("fp32", "float32", "float", "32", "full"), "fp32"),
    **dict.fromkeys(("bf16", "bfloat16", "bf16-mixed"), "bf16"),
    **dict.fromkeys(("fp16", "float16", "half", "16", "16-mixed"), "fp16"),
}


# ``master_dtype`` names -> the dtype sharded floating-point parameters are stored (and updated) in.
# ``None`` keeps every parameter's own dtype: pure low-precision training, on purpose.
MASTER_DTYPE_ALIASES: dict[str, Optional[torch.dtype]] = {
    **dict.fromkeys(("fp32", "float32", "float"), torch.float32),
    **dict.fromkeys(("fp64", "float64"), torch.float64),
    **dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "float16", "half"), torch.float16),
    **dict.fromkeys(("param", "keep", "none"), None),
}


@dataclass(frozen=True)
class ShardingSpec:
    """What a ``shard_strat`` string means for FSDP2.

    Attributes:
        name: canonical strategy name, e.g. ``"FULL_SHARD"``.
        mesh_ndim: 1 for a flat shard mesh, 2 for ``(replicate, shard)``.
        replicate_all: ``True`` for NO_SHARD: the 2-D mesh is ``(world, 1)``.
        reshard_after_forward: what transformer blocks use (ZeRO-3: ``True``, ZeRO-2: ``False``).

    Example:
        >>> resolve_sharding("HYBRID_SHARD").mesh_ndim
        2
    """

    name: str
    mesh_ndim: int
    replicate_all: bool
    reshard_after_forward: bool


_SHARDING_TABLE: dict[str, ShardingSpec] = {
    "FULL_SHARD": ShardingSpec("FULL_SHARD", 1, False, True),
    "SHARD_GRAD": ShardingSpec("SHARD_GRAD", 1, False, False),
    "NO_SHARD": ShardingSpec("NO_SHARD", 2, True, False),
    "HYBRID_SHARD": ShardingSpec("HYBRID_SHARD", 2, False, True),
    "HYBRID_SHARD_ZERO2": ShardingSpec("HYBRID_SHARD_ZERO2", 2, False, False),
}

SHARDING_ALIASES: dict[str, str] = {
    **dict.fromkeys(("FULL_SHARD", "ZERO3"), "FULL_SHARD"),
    **dict.fromkeys(("SHARD_GRAD", "SHARD_GRAD_OP", "ZERO2"), "SHARD_GRAD"),
    **dict.fromkeys(("NO_SHARD", "DDP"), "NO_SHARD"),
    **dict.fromkeys(("HYBRID_SHARD", "HSDP"), "HYBRID_SHARD"),
    **dict.fromkeys(("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"), "HYBRID_SHARD_ZERO2"),
}


def _lookup(aliases: dict, key: Optional[str], bad: str, also: str) -> object:
    """``aliases[key]``, else ``ValueError``: ``bad`` (what was passed), then every accepted value."""
    if key not in aliases:
        raise ValueError(f"{bad}. Accepted (case-insensitive): {', '.join(map(repr, aliases))}, {also}.")
    return aliases[key]


def resolve_mixed_precision(
    mp: Union[str, MixedPrecisionPolicy, None], *, caller: str = "fsdp"
) -> MixedPrecisionPolicy:
    """Turn Zeta's ``mp`` string into the FSDP2 ``MixedPrecisionPolicy`` used for every unit.

    ``"fp32"`` (default) casts nothing; ``"bf16"``/``"fp16"`` compute in the low dtype and reduce
    gradients in fp32. A ``MixedPrecisionPolicy`` is returned as given. Case-insensitive.

    Example:
        >>> policy = resolve_mixed_precision("FP16")
        >>> policy.param_dtype, policy.reduce_dtype, policy.output_dtype
        (torch.float16, torch.float32, None)
    """
    if isinstance(mp, MixedPrecisionPolicy):
        return mp
    if mp is None:
        mp = "fp32"
    if isinstance(mp, torch.dtype):
        mp = str(mp).replace("torch.", "")
    key = mp.strip().lower() if isinstance(mp, str) else None
    bad = f"{caller}(): unknown mp={mp!r}"
    preset = _lookup(MIXED_PRECISION_ALIASES, key, bad, "or a torch.distributed.fsdp.MixedPrecisionPolicy")
    param_dtype, reduce_dtype, output_dtype = MP_PRESETS[preset]
    return MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype, cast_forward_inputs=True
    )


def resolve_sharding(shard_strat: Union[str, enum.Enum, None], *, caller: str = "fsdp") -> ShardingSpec:
    """Turn Zeta's ``shard_strat`` (or an FSDP1 ``ShardingStrategy`` member) into a ShardingSpec.

    Example:
        >>> from torch.distributed.fsdp import ShardingStrategy
        >>> resolve_sharding(ShardingStrategy.SHARD_GRAD_OP).name
        'SHARD_GRAD'
    """
    if shard_strat is None:
        shard_strat = "NO_SHARD"
    raw = shard_strat.name if isinstance(shard_strat, enum.Enum) else shard_strat
    key = raw.strip().upper().replace("-", "_") if isinstance(raw, str) else None
    bad = f"{caller}(): unknown shard_strat={shard_strat!r}"
    return _SHARDING_TABLE[_lookup(SHARDING_ALIASES, key, bad, "or a torch.distributed.fsdp.ShardingStrategy member")]


def autocast_dtype(mp_policy: MixedPrecisionPolicy) -> Optional[torch.dtype]:
    """``torch.bfloat16`` for the ``mp="bf16"`` preset, which DDP's engine gives with ``torch.autocast``;
    else ``None`` (fp16 needs a loss scaler, a custom policy what autocast cannot do: FSDP2 casts)."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return torch.bfloat16 if mp_policy == bf16 else None


def choose_engine(
    spec: ShardingSpec,
    mp_policy: MixedPrecisionPolicy,
    *,
    mesh_given: bool = False,
    cpu_offload: bool = False,
    has_ignored: bool = False,
    has_trainable: bool = True,
    has_fp32: bool = False,
) -> tuple[str, str]:
    """Which engine runs ``spec``: ``("replicate", why)`` or ``("fully_shard", why)``.

    NO_SHARD keeps a whole copy of every parameter on every rank: that is DDP, and PyTorch's DDP
    engine (composable ``replicate``) steps at DDP speed where FSDP2 on a ``(world, 1)`` mesh takes
    1.4-1.5x (``benchmarks/results/no_shard.md``). So NO_SHARD runs on ``replicate`` unless it needs
    what only FSDP2 has (docs/options.md, "NO_SHARD runs on DDP's engine"). Every other strategy shards.

    Example:
        >>> choose_engine(resolve_sharding("NO_SHARD"), resolve_mixed_precision("fp32"))[0]
        'replicate'
        >>> choose_engine(resolve_sharding("NO_SHARD"), resolve_mixed_precision("bf16"))
        ('replicate', "NO_SHARD, bf16: DDP's engine + autocast(bfloat16)")
        >>> choose_engine(resolve_sharding("NO_SHARD"), resolve_mixed_precision("fp16"))
        ('fully_shard', 'mp casts parameters (MixedPrecisionPolicy)')
    """
    if not spec.replicate_all:
        return "fully_shard", f"{spec.name} shards parameters"
    autocast = autocast_dtype(mp_policy)
    if mp_policy != MixedPrecisionPolicy() and autocast is None:
        return "fully_shard", "mp casts parameters (MixedPrecisionPolicy)"
    if has_fp32 and autocast is not None:
        # autocast casts every matmul, an fp32 module's too; FSDP2 keeps their policy per parameter
        return "fully_shard", "fp32 modules (keep_fp32, a model's _keep_in_fp32_modules) under mp"
    if cpu_offload:
        return "fully_shard", "cpu_offload=True"
    if has_ignored:
        return "fully_shard", "ignored_params / ignored_modules"
    if mesh_given:
        return "fully_shard", "a mesh was passed"
    if not has_trainable:
        return "fully_shard", "no parameter requires a gradient"
    if autocast is not None:
        return "replicate", "NO_SHARD, bf16: DDP's engine + autocast(bfloat16)"
    return "replicate", "NO_SHARD, fp32: DDP's engine"


def validate_replicate_size(
    spec: ShardingSpec, replicate_size: Optional[int], world_size: int, *, caller: str = "fsdp"
) -> None:
    """Check ``replicate_size`` (the number of HYBRID replicas) against ``spec`` and ``world_size``.

    Example:
        >>> validate_replicate_size(resolve_sharding("HYBRID_SHARD"), 2, 8)
        >>> validate_replicate_size(resolve_sharding("FULL_SHARD"), 2, 8)
        Traceback (most recent call last):
        ValueError: fsdp(): replicate_size=2 only applies to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not FULL_SHARD.
    """
    if spec.mesh_ndim == 1:
        if replicate_size not in (None, 1):
            raise ValueError(
                f"{caller}(): replicate_size={replicate_size!r} only applies to HYBRID_SHARD / "
                f"HYBRID_SHARD_ZERO2, not {spec.name}."
            )
    elif spec.replicate_all:
        if replicate_size not in (None, world_size):
            raise ValueError(
                f"{caller}(): replicate_size={replicate_size!r} does not apply to NO_SHARD, which replicates "
                f"over all {world_size} ranks. Accepted: None or {world_size}."
            )
    elif replicate_size is not None and (
        not isinstance(replicate_size, int) or replicate_size < 1 or world_size % replicate_size != 0
    ):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"{caller}(): replicate_size={replicate_size!r} must divide the world size {world_size}. Accepted: {divisors}."
        )


def mesh_shape(
    spec: ShardingSpec,
    world_size: int,
    *,
    local_world_size: Optional[int] = None,
    replicate_size: Optional[int] = None,
    caller: str = "fsdp",
) -> tuple[int, ...]:
    """The mesh shape ``spec`` needs at ``world_size`` ranks. Pure; raises ``ValueError`` when impossible.

    HYBRID replicates across nodes by default (``world_size // LOCAL_WORLD_SIZE`` groups) and
    shards within a node; ``replicate_size`` overrides the number of replicas. Error messages
    start with ``caller``, the public function the user called.

    Example:
        >>> mesh_shape(resolve_sharding("HYBRID_SHARD"), 16, local_world_size=8)
        (2, 8)
    """
    validate_replicate_size(spec, replicate_size, world_size, caller=caller)
    if spec.mesh_ndim == 1:
        return (world_size,)
    if spec.replicate_all:
        return (world_size, 1)
    if replicate_size is None:
        local = local_world_size or world_size
        replicate_size = max(1, world_size // local) if world_size % local == 0 else 1
    return (replicate_size, world_size // replicate_size)


def validate_mesh(spec: ShardingSpec, mesh: DeviceMesh) -> None:
    """A user mesh must have the dimensions ``spec`` shards over (1-D, or 2-D for HYBRID/NO_SHARD)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fsdp(): mesh={mesh!r} is not accepted. Accepted: None or a torch DeviceMesh.")
    if mesh.ndim != spec.mesh_ndim:
        raise ValueError(
            f"fsdp(): shard_strat={spec.name!r} needs a {spec.mesh_ndim}-D mesh "
            f"({'(shard,)' if spec.mesh_ndim == 1 else '(replicate, shard)'}), got a {mesh.ndim}-D "
            f"mesh of shape {tuple(mesh.shape)}."
        )
    if spec.replicate_all and mesh.size(-1) != 1:
        raise ValueError(f"fsdp(): NO_SHARD needs a mesh of shape (world, 1), got {tuple(mesh.shape)}.")


def resolve_mesh_shape(
    spec: ShardingSpec,
    mesh: Optional[DeviceMesh],
    replicate_size: Optional[int],
    world_size: int,
    local_world_size: Optional[int] = None,
) -> tuple[int, ...]:
    """The mesh shape one ``fsdp()`` call runs on, computed once: the user's ``mesh`` (checked against
    ``spec``; ``replicate_size`` must then be left out), else ``mesh_shape``.

    Example:
        >>> resolve_mesh_shape(resolve_sharding("FULL_SHARD"), None, None, 4)
        (4,)
    """
    if mesh is None:
        return mesh_shape(spec, world_size, local_world_size=local_world_size, replicate_size=replicate_size)
    validate_mesh(spec, mesh)
    if replicate_size is not None:
        raise ValueError(
            f"fsdp(): replicate_size={replicate_size!r} cannot be combined with mesh=: the mesh's "
            f"shape {tuple(mesh.shape)} already fixes the replicas. Pass one or the other."
        )
    return tuple(mesh.shape)


def validate_reshard_after_forward(
    value: Union[bool, int, None], shard_group_size: Optional[int] = None
) -> Union[bool, int, None]:
    """Check a ``reshard_after_forward`` override: ``None``, a bool, or an int ``k`` dividing the shard group
    (parameters stay sharded over ``k`` ranks between forward and backward: ``False`` is 1, ``True`` all)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(
            f"fsdp(): reshard_after_forward={value!r} is not accepted. Accepted: None, True, "
            "False, or a positive int that divides the shard group size."
        )
    n = shard_group_size
    if value < 1 or (n is not None and n % value != 0):
        group = f" ({n})" if n else ""
        divisors = f" Accepted ints here: {[d for d in range(1, n + 1) if n % d == 0]}." if n else ""
        raise ValueError(
            f"fsdp(): reshard_after_forward={value!r} must be a positive int that divides the "
            f"shard group size{group}, or None/True/False.{divisors}"
        )
    return value


def validate_prefetch(value: Optional[int]) -> Optional[int]:
    """Check ``fsdp(prefetch=...)``: ``None`` or an int >= 1 (``True`` would silently mean 1: refused)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"fsdp(): prefetch={value!r} is not accepted. Accepted: None (FSDP2's implicit prefetching, the "
        "default) or an int >= 1 (explicit chains: each unit all-gathers the next n in forward, the previous "
        "n in backward)."
    )


def validate_keep_tail_unsharded(value: Union[bool, int]) -> int:
    """Check ``fsdp(keep_tail_unsharded=...)``; return it as a count of the units forward runs last
    (the head, then blocks counting back), ``True`` being 1."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(
        f"fsdp(): keep_tail_unsharded={value!r} is not accepted. Accepted: False/0 (default: every unit "
        "resharded as the strategy says), True/1 (the output head unit kept unsharded between forward and "
        "backward), or an int n >= 0 (the head and the last n - 1 blocks)."
    )


def resolve_master_dtype(master_dtype: Union[str, torch.dtype, None], *, caller: str = "fsdp") -> Optional[torch.dtype]:
    """Turn ``fsdp(master_dtype=...)`` into the dtype of the sharded (master) parameters, or ``None``.

    The optimizer reads and updates the master copy, so the optimizer state has its dtype too.
    ``None`` (or ``"param"``/``"keep"``) keeps each parameter's own dtype: pure bf16/fp16 training.
    Case-insensitive; a floating ``torch.dtype`` is accepted as well.

    Example:
        >>> resolve_master_dtype("FP32")
        torch.float32
        >>> resolve_master_dtype(None) is None
        True
    """
    if master_dtype is None:
        return None
    if isinstance(master_dtype, torch.dtype):
        if not master_dtype.is_floating_point:
            raise ValueError(
                f"{caller}(): master_dtype={master_dtype} is not a floating-point dtype. Accepted: "
                "torch.float32, torch.float64, torch.bfloat16, torch.float16, their names, or None."
            )
        return master_dtype
    key = master_dtype.strip().lower() if isinstance(master_dtype, str) else None
    bad = f"{caller}(): unknown master_dtype={master_dtype!r}"
    return _lookup(MASTER_DTYPE_ALIASES, key, bad, "None (keep each parameter's dtype), or a floating torch.dtype")


def stored_dtype(param: torch.Tensor, master: Optional[torch.dtype]) -> torch.dtype:
    """The dtype ``fsdp(master_dtype=master)`` stores ``param`` in: ``master`` for trainable floating-point
    parameters (masters are what an optimizer steps); frozen (a LoRA base) and integer ones, and every
    one under ``master=None``, keep their own."""
    if master is None or not param.is_floating_point() or not param.requires_grad:
        return param.dtype
    return master

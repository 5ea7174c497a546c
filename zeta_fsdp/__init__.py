"""zeta_fsdp: one line that turns any PyTorch model into a correctly sharded FSDP2 model.

Example:
    from zeta_fsdp import fsdp
    model = fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)

Optional, imported only on demand (never by ``import zeta_fsdp``): ``zeta_fsdp.lightning.FSDP2Strategy``,
a Lightning ``Trainer`` strategy (``pip install "zeta-fsdp[lightning]"``).
"""

# First: refuses a torch older than the supported floor (torch_compat.MIN_TORCH), naming both.
from . import torch_compat  # noqa: F401
from .cli.model_spec import meta_model_from_spec
from .data import ResumableLoader, shard_dataloader
from .distributed import shutdown
from .fsdp import fsdp, fsdp_engine, get_wrap_plan, is_fsdp_wrapped
from .hf import consolidate_to_hf, load_pretrained, save_pretrained
from .loss import MaskedTokenLossReduction, PerSampleLossReduction
from .measure import collectives_per_step, median_step_seconds, peak_memory_by_category
from .options import ShardingSpec, choose_engine, resolve_master_dtype, resolve_mixed_precision, resolve_sharding
from .planner import DryRunResult, MemoryPlan, UnitEstimate, dry_run, plan
from .state_dict import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointManager,
    PreemptionHandler,
    consolidate_checkpoint,
    get_full_state_dict,
    get_optimizer_state_dict,
    get_sharded_state_dict,
    is_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_full_state_dict,
    load_optimizer_state_dict,
    load_sharded_state_dict,
    prune_checkpoints,
    save_checkpoint,
)
from .strategy import EpochStep, FSDP2Strategy
from .training import MemoryReport, clip_grad_norm_, memory_report, no_sync
from .wrapping import WrapPlan, WrapUnit, build_wrap_plan, detect_block_classes

__version__ = "0.1.0"

__all__ = [
    "EpochStep",
    "FSDP2Strategy",
    "MaskedTokenLossReduction",
    "MemoryReport",
    "PerSampleLossReduction",
    "clip_grad_norm_",
    "collectives_per_step",
    "median_step_seconds",
    "memory_report",
    "peak_memory_by_category",
    "no_sync",
    "CheckpointError",
    "consolidate_checkpoint",
    "get_full_state_dict",
    "get_optimizer_state_dict",
    "get_sharded_state_dict",
    "is_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
    "load_optimizer_state_dict",
    "load_sharded_state_dict",
    "save_checkpoint",
    "AsyncCheckpointer",
    "CheckpointManager",
    "PreemptionHandler",
    "latest_checkpoint",
    "prune_checkpoints",
    "ResumableLoader",
    "shard_dataloader",
    "consolidate_to_hf",
    "load_pretrained",
    "save_pretrained",
    "DryRunResult",
    "MemoryPlan",
    "UnitEstimate",
    "dry_run",
    "meta_model_from_spec",
    "plan",
    "ShardingSpec",
    "WrapPlan",
    "WrapUnit",
    "build_wrap_plan",
    "detect_block_classes",
    "choose_engine",
    "fsdp",
    "fsdp_engine",
    "get_wrap_plan",
    "is_fsdp_wrapped",
    "resolve_master_dtype",
    "resolve_mixed_precision",
    "resolve_sharding",
    "shutdown",
]

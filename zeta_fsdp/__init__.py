"""zeta_fsdp: one line that turns any PyTorch model into a correctly sharded FSDP2 model.

Example:
    from zeta_fsdp import fsdp
    model = fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)

The names below are the whole public surface (docs/api.md is their map). Tools and internals
(option resolvers, plan units, measuring helpers, checkpoint retention) are importable from their
own modules.

Optional, imported only on demand (never by ``import zeta_fsdp``): ``zeta_fsdp.lightning.FSDP2Strategy``,
a Lightning ``Trainer`` strategy (``pip install "zeta-fsdp[lightning]"``).
"""

# First: refuses a torch older than the supported floor (torch_compat.MIN_TORCH), naming both.
from . import torch_compat  # noqa: F401
from .data import ResumableLoader, shard_dataloader
from .distributed import shutdown
from .engines import fsdp_engine, get_wrap_plan, is_fsdp_wrapped
from .fsdp import fsdp
from .hf import consolidate_to_hf, load_pretrained, save_pretrained
from .loss import MaskedTokenLossReduction, PerSampleLossReduction
from .planner import MemoryPlan, dry_run, plan
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
    load_checkpoint,
    load_full_state_dict,
    load_optimizer_state_dict,
    load_sharded_state_dict,
    save_checkpoint,
)
from .strategy import EpochStep, FSDP2Strategy
from .training import MemoryReport, clip_grad_norm_, memory_report, no_sync
from .wrapping import WrapPlan

__version__ = "0.1.0"

__all__ = [
    "fsdp",
    "fsdp_engine",
    "get_wrap_plan",
    "is_fsdp_wrapped",
    "WrapPlan",
    "shutdown",
]  # sharding
__all__ += ["plan", "dry_run", "MemoryPlan"]  # planning
# state dicts and checkpoints
__all__ += ["get_full_state_dict", "load_full_state_dict", "get_sharded_state_dict", "load_sharded_state_dict"]
__all__ += ["get_optimizer_state_dict", "load_optimizer_state_dict", "save_checkpoint", "load_checkpoint"]
__all__ += ["is_checkpoint", "consolidate_checkpoint", "CheckpointError"]
# long jobs
__all__ += ["AsyncCheckpointer", "CheckpointManager", "PreemptionHandler", "ResumableLoader", "shard_dataloader"]
__all__ += ["load_pretrained", "save_pretrained", "consolidate_to_hf"]  # Hugging Face
# training and loss
__all__ += ["no_sync", "clip_grad_norm_", "memory_report", "MemoryReport"]
__all__ += ["MaskedTokenLossReduction", "PerSampleLossReduction"]
__all__ += ["FSDP2Strategy", "EpochStep"]  # NeMo's strategy

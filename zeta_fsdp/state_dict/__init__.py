"""State dicts and checkpoints of sharded models, on PyTorch's own machinery (DCP and
``torch.distributed.checkpoint.state_dict``; no file format of our own). A checkpoint is a plain DCP
directory (one ``.metadata`` file plus one ``.distcp`` file per rank) holding:

* ``model.<fqn>``: the model's tensors, sharded as they live on the ranks; a tied tensor once, under its first name,
* ``optim.state.<fqn>.<name>``: optimizer state keyed by parameter name (never by index), so it
  loads at any world size and sharding strategy; ``optim.param_groups``: one record of
  ``{"param_groups.<fqn>.<option>": value}`` (torch's flattened optimizer format),
* ``model_layout``: the model's keys in order and its tied names (for consolidation),
* ``extra``: one object of the user's (step, epoch, scheduler, RNG), saved from rank 0.

What a save and a load guarantee (nothing unpickled with ``weights_only=False``, atomic publish, every
record's CRC-32 checked before anything changes) is in docs/checkpoints.md.

Example:
    save_checkpoint("ckpt/step_100", model, optimizer, extra={"step": 100})
    extra = load_checkpoint("ckpt/step_100", model, optimizer)  # any world size, any strategy
    consolidate_checkpoint("ckpt/step_100", "model.safetensors")  # offline, one process
"""

from __future__ import annotations

from .async_save import AsyncCheckpointer
from .checkpoint import load_checkpoint, save_checkpoint
from .checks import CheckpointError
from .consolidate import consolidate_checkpoint
from .manager import CheckpointManager, latest_checkpoint, prune_checkpoints
from .model import get_full_state_dict, get_sharded_state_dict, load_full_state_dict, load_sharded_state_dict
from .optimizer import get_optimizer_state_dict, load_optimizer_state_dict
from .preemption import PreemptionHandler
from .publish import is_checkpoint

__all__ = ["AsyncCheckpointer", "CheckpointError", "CheckpointManager", "PreemptionHandler", "consolidate_checkpoint"]
__all__ += ["get_full_state_dict", "get_optimizer_state_dict", "get_sharded_state_dict", "is_checkpoint"]
__all__ += ["latest_checkpoint", "load_checkpoint", "load_full_state_dict", "load_optimizer_state_dict"]
__all__ += ["load_sharded_state_dict", "prune_checkpoints", "save_checkpoint"]

"""The optimizer step of an ``fsdp()`` model on each rank's local shards (issue 32).

After ``fsdp()`` every parameter, gradient and optimizer state is a DTensor, and every op of
``optimizer.step()`` pays DTensor dispatch although torch's elementwise optimizers (SGD, Adam,
AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam) only touch each rank's own elements. ``fsdp()``
therefore steps those optimizers on the local tensors, in place, with the same torch
implementation (foreach, fused or single-tensor); the state stays DTensors, so checkpoints do not
change. ``ZETA_FSDP_LOCAL_STEP=0`` or ``use_local_step(optimizer, False)`` turns it off.

Example:
    >>> import torch
    >>> from zeta_fsdp.optim import is_elementwise
    >>> is_elementwise(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
    True
"""

from .local_step import (
    ELEMENTWISE_OPTIMIZERS,
    ENV_VAR,
    is_elementwise,
    snapshot_params,
    steps_locally,
    track_fsdp_model,
    use_local_step,
)
from .registry import forget_snapshot

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ENV_VAR", "is_elementwise", "snapshot_params", "steps_locally"]
__all__ += ["track_fsdp_model", "use_local_step", "forget_snapshot"]

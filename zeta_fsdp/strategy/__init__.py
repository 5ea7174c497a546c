"""``FSDP2Strategy``: NeMo's strategy API on top of ``fsdp()``, the class and the plain functions it delegates to.

``core``: the class (set-up, sharding, steps, optimizers, data); ``checkpointing``: its state-dict, checkpoint and
long-job methods; ``epoch``: ``EpochStep``; ``options``: its arguments; ``parallel``: sharding; ``steps``: steps and
losses; ``checkpoint``: what goes in a checkpoint (``zeta_fsdp.state_dict`` writes it).

Example:
    >>> from zeta_fsdp.strategy import FSDP2Strategy
    >>> FSDP2Strategy(data_parallel_size=2, TransformerBlock="Block").checkpoint_format
    'full'
"""

from .core import EpochStep, FSDP2Strategy

__all__ = ["EpochStep", "FSDP2Strategy"]

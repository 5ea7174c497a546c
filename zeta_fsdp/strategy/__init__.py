"""``FSDP2Strategy``: NeMo's strategy API on top of ``fsdp()``, the class and the plain functions it delegates to.

``core`` holds the class (NeMo's methods, each a few lines); ``options`` checks the constructor's
arguments and resolves sizes; ``parallel`` shards the module (TP, then ``fsdp()``); ``steps`` runs
training/eval steps and reduces losses; ``checkpoint`` says what goes in a checkpoint (both formats
are ``zeta_fsdp.state_dict``'s); ``progress`` counts optimizer steps.

Example:
    >>> from zeta_fsdp.strategy import FSDP2Strategy
    >>> FSDP2Strategy(data_parallel_size=2, TransformerBlock="Block").checkpoint_format
    'full'
"""

from .core import FSDP2Strategy
from .progress import EpochStep

__all__ = ["EpochStep", "FSDP2Strategy"]

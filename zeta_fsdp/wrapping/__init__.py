"""Which modules become FSDP units: a pure, inspectable plan (no process group, no allocation).

The plan is formed bottom-up, the order ``fully_shard`` must be called in: every transformer
block, then the input embeddings, then ``[final norm, output head]``, then the root. Parameters
shared between modules (an embedding tied to the output head) always land in one unit, because
FSDP2 only keeps a tie when every module holding the parameter is sharded by the same call.

Works on ``meta`` models, so it can describe a model too large to build for real.

The package, by idea: ``plan`` (``WrapUnit``, ``WrapPlan``), ``detect`` (which classes are the
blocks), ``skips`` (what a forward may not run on every rank), ``build`` (``build_wrap_plan``,
``add_fp32_units``), ``tree`` (names in a module tree).
"""

from __future__ import annotations

from .build import add_fp32_units, build_wrap_plan
from .detect import BlockSpec, block_specs, detect_block_classes
from .plan import WrapPlan, WrapUnit
from .skips import skippable_modules

__all__ = ["BlockSpec", "WrapPlan", "WrapUnit", "block_specs", "build_wrap_plan", "detect_block_classes"]
__all__ += ["skippable_modules", "add_fp32_units"]

"""``zeta_fsdp.wrapped.compute_device``, the documented path (docs/api.md); what ``fsdp()`` did is read in ``engines``."""

from __future__ import annotations

from .engines import compute_device

__all__ = ["compute_device"]

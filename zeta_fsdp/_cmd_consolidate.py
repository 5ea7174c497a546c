"""`python -m zeta_fsdp consolidate`: argument parsing only; the work lives in the library modules."""

from __future__ import annotations

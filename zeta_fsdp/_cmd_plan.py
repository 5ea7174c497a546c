"""`python -m zeta_fsdp plan`: argument parsing only; the work lives in the library modules."""

from __future__ import annotations

"""The command line, ``python -m zeta_fsdp demo | plan | consolidate``: argument parsing, model
specs, launching local ranks. Library code never imports this package.
"""

from .main import main

__all__ = ["main"]

"""The command line, ``python -m zeta_fsdp demo | plan | consolidate``: argument parsing, model
specs, launching local ranks. Library code never imports this package.

Example:
    $ python -m zeta_fsdp plan zeta_fsdp.models.gpt:small --world-size 1024
"""

from .main import main

__all__ = ["main"]

"""``python -m zeta_fsdp``: see ``zeta_fsdp.cli``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

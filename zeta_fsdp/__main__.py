"""``python -m zeta_fsdp``: see ``zeta_fsdp.cli``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())

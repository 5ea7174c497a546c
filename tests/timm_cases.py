"""timm models on 2 gloo ranks: losses every step and weights after training equal a
single-process reference bit for bit (``zoo_cases.zoo_parity``: same argument, same bar)."""

from __future__ import annotations

from timm_models import TINY
from worker import Cases, run_cases
from zoo_cases import zoo_parity

CASES = Cases()

for _name in TINY:

    def _parity(_n: str = _name) -> None:
        zoo_parity(_n, TINY[_n])

    _parity.__name__ = f"timm_parity_{_name}"
    CASES.case(_parity)


if __name__ == "__main__":
    run_cases(CASES)

"""The façade on real gloo ranks: parity with a single-process reference, bf16, meta, comms, memory.

The cases live in ``dist_cases.py`` (``@case`` runs on 2 ranks, ``@case(ranks=4)`` on 4); each
rank count is one launch.
"""

from __future__ import annotations

from conftest import dist_test

test_two_ranks = dist_test("dist_cases.py", 2)
test_four_ranks = dist_test("dist_cases.py", 4)

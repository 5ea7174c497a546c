"""The training step's edges on real gloo ranks (cases in ``steps_cases.py``): a dropped accumulation,
a NaN on one rank only, clipping on empty shards and ignored parameters, memory measuring with frozen
parameters, tied weights under tensor parallel."""

from __future__ import annotations

from conftest import dist_test

test_two_ranks = dist_test("steps_cases.py", 2)
test_four_ranks = dist_test("steps_cases.py", 4)

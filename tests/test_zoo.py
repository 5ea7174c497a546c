"""The parity zoo: models nobody here wrote, tiny configs, no downloads.

Plans (which modules become FSDP units) are checked here without a process group; losses and
weights against a single-process reference run on 2 gloo ranks in ``zoo_cases.py``.
"""

from __future__ import annotations

import warnings

import pytest
from conftest import dist_test

pytest.importorskip("transformers")  # a guard only: CI installs the hf extra

from zoo_models import ZOO  # noqa: E402

from zeta_fsdp.wrapping import build_wrap_plan  # noqa: E402


@pytest.mark.parametrize("name", list(ZOO))
def test_plan_finds_the_units(name):
    model = ZOO[name].build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tie fallback, no "found nothing" warning
        plan = build_wrap_plan(model, auto_wrap=True)
    assert [u.name for u in plan.units] == ZOO[name].units
    assert all(len(u.name) <= 80 for u in plan.units), [u.name for u in plan.units]
    # every parameter is owned exactly once (0-dim ones are kept whole, outside every unit)
    owned = [n for u in plan.units for n in u.param_names] + plan.scalar_param_names
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())


ZOO_CASES = [f"parity_{name}" for name in ZOO] + [
    "master_weights_fp32_for_a_bf16_model",
    "failed_validation_leaves_the_model_unwrapped_and_a_retry_works",
    "meta_init_never_leaves_uninitialised_memory",
    "meta_init_runs_torch_nn_and_hugging_face_initialisers",
]
test_zoo_parity = dist_test("zoo_cases.py", 2, ZOO_CASES)

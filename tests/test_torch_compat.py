"""Every torch the package supports: the floor is enforced at import, and the ``mp`` presets pin
the numerics on the running release (cases needing ranks in ``compat_cases.py``)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, dist_test, rank_env
from torch.distributed.fsdp import MixedPrecisionPolicy

from zeta_fsdp import torch_compat
from zeta_fsdp.costs import gradient_wait_dtype
from zeta_fsdp.options import MIXED_PRECISION_ALIASES, MP_PRESETS, resolve_mixed_precision
from zeta_fsdp.torch_compat import MIN_TORCH, UnsupportedTorchError, check_torch_version, torch_release

test_two_ranks = dist_test("compat_cases.py", 2)

FLOOR = ".".join(map(str, MIN_TORCH))


@pytest.mark.parametrize("name", sorted(MP_PRESETS))
def test_preset_sets_every_field_on_this_torch(name):
    """Each preset's policy holds exactly the table's dtypes, and every other field of this
    release's ``MixedPrecisionPolicy`` (2.15 added ``param_dtype_override_fn``) stays at its default."""
    param, reduce, output = MP_PRESETS[name]
    policy = resolve_mixed_precision(name)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (param, reduce, output)
    assert policy.cast_forward_inputs is True
    ours = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
    default = MixedPrecisionPolicy()
    for field in dataclasses.fields(MixedPrecisionPolicy):
        if field.name not in ours:
            assert getattr(policy, field.name) == getattr(default, field.name), field.name
    # reduce_dtype=None changed meaning in torch 2.15: it is left None only where both meanings
    # agree (no cast: a parameter computes in its own dtype, so "compute dtype" = "own dtype").
    if reduce is None:
        assert param is None, f"{name}: reduce_dtype=None next to param_dtype={param}"
    else:
        assert reduce == torch.float32


def test_every_alias_names_a_preset():
    assert set(MIXED_PRECISION_ALIASES.values()) == set(MP_PRESETS)


def test_gradient_wait_dtype_follows_the_release(monkeypatch):
    """``reduce_dtype=None`` next to a bf16 compute: bf16 before torch 2.15, the parameter's own
    dtype from 2.15 on (``compat_cases.reduce_dtype_none_matches_torch_compat`` checks the flag
    against the running torch's real reduction)."""
    user = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    monkeypatch.setattr(torch_compat, "REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE", False)
    assert gradient_wait_dtype(user, torch.float32) == torch.bfloat16
    monkeypatch.setattr(torch_compat, "REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE", True)
    assert gradient_wait_dtype(user, torch.float32) == torch.float32
    for flag in (False, True):  # the presets mean the same on both
        monkeypatch.setattr(torch_compat, "REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE", flag)
        assert gradient_wait_dtype(resolve_mixed_precision("bf16"), torch.float32) == torch.float32
        assert gradient_wait_dtype(resolve_mixed_precision("fp32"), torch.float32) == torch.float32
        assert gradient_wait_dtype(resolve_mixed_precision("fp32"), torch.bfloat16) == torch.bfloat16


def test_release_flag_matches_the_running_torch():
    assert torch_compat.REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE == (torch_release() >= (2, 15))


@pytest.mark.parametrize(
    "version, release",
    [("2.13.0+cpu", (2, 13)), ("2.15.0+cu132", (2, 15)), ("2.10.0a0+git1234", (2, 10)), ("3.0", (3, 0))],
)
def test_torch_release_parses(version, release):
    assert torch_release(version) == release


def test_unreadable_version_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot read a torch release from 'nightly'"):
        torch_release("nightly")


@pytest.mark.parametrize("version", ["2.9.1", "2.8.0+cu128", "1.13.1"])
def test_below_the_floor_is_refused(version):
    with pytest.raises(UnsupportedTorchError) as info:
        check_torch_version(version)
    message = str(info.value)
    assert f"zeta_fsdp needs torch >= {FLOOR}; this environment has torch {version}" in message
    assert f"pip install 'torch>={FLOOR}'" in message
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize("version", [FLOOR + ".0", "2.13.0+cpu", "2.15.0", "3.1.0"])
def test_the_floor_and_above_are_accepted(version):
    check_torch_version(version)


@pytest.mark.launch
def test_import_on_an_old_torch_fails_at_once_naming_both_versions():
    """``import zeta_fsdp`` in a fresh interpreter whose torch reports 2.9.1: the import raises
    our error (not a failure deep inside torch.distributed, and not a wrong gradient later)."""
    code = "import torch\ntorch.__version__ = '2.9.1'\nimport zeta_fsdp\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("zeta_fsdp.torch_compat.UnsupportedTorchError: zeta_fsdp needs torch >= "), proc.stderr
    assert "this environment has torch 2.9.1" in last, last


def test_setup_declares_the_same_floor():
    setup = (ROOT / "setup.py").read_text()
    floors = re.findall(r'"torch>=([0-9.]+)"', setup)
    assert floors == [FLOOR], f"setup.py says torch>={floors}, torch_compat.MIN_TORCH is {FLOOR}"

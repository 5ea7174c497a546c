"""Multi-rank cases for ``tests/test_torch_compat.py``: the numerics our ``mp`` presets pin hold on
the running torch release, whatever that release's defaults are."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from worker import Cases, full, rank, run_cases

from zeta_fsdp import fsdp
from zeta_fsdp.torch_compat import REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE

CASES = Cases()
case = CASES.case

# Rank 0's gradient is 1, rank 1's is 2^-12: both exact in bf16 and fp16. Their mean,
# (1 + 2^-12) / 2 = 0.5 + 2^-13, is exact in fp32 (whether FSDP divides before or after the sum:
# the divisions are by powers of two). In bf16 (8 significant bits) and fp16 (11), 1 + 2^-12
# and 0.5 + 2^-13 round to 1 and 0.5: the reduction's dtype shows in the result, exactly.
SMALL = 2.0**-12
MEAN_IF_FP32 = 0.5 + SMALL / 2
MEAN_IF_LOW = 0.5


def _reduced_gradient(mp) -> float:
    """The averaged gradient of a 1x1 weight whose local gradient is 1 on rank 0 and 2^-12 on rank 1."""
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    fsdp(model, mp=mp, shard_strat="FULL_SHARD")
    x = torch.tensor([[1.0 if rank() == 0 else SMALL]])
    model(x).float().sum().backward()  # d(w x)/dw = x, exact in the compute dtype
    grad = full(model[0].weight.grad)
    assert grad.dtype == torch.float32, grad.dtype  # the master weight's dtype
    return grad.item()


@case
def presets_reduce_gradients_in_fp32_on_this_torch():
    """bf16 and fp16 compute in low precision and reduce in fp32 on every release (torch 2.15
    changed what ``reduce_dtype=None`` means; the presets do not leave it to the default)."""
    for mp in ("fp32", "bf16", "fp16"):
        got = _reduced_gradient(mp)
        assert got == MEAN_IF_FP32, f"mp={mp!r}: gradient {got!r}, want {MEAN_IF_FP32!r} (an fp32 reduction)"


@case
def reduce_dtype_none_matches_torch_compat():
    """A user's own ``MixedPrecisionPolicy(param_dtype=bf16)`` gets the running release's meaning of
    ``reduce_dtype=None``; ``torch_compat.REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE`` (which memory_report
    and the planner use) must say which one that is."""
    for low in (torch.bfloat16, torch.float16):
        got = _reduced_gradient(MixedPrecisionPolicy(param_dtype=low))
        want = MEAN_IF_FP32 if REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE else MEAN_IF_LOW
        assert got == want, (
            f"param_dtype={low}, reduce_dtype=None on torch {torch.__version__}: gradient {got!r}, want {want!r} "
            f"(REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE={REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE})"
        )


if __name__ == "__main__":
    run_cases(CASES)

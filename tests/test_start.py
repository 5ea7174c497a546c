"""One start on every rank (``zeta_fsdp.start``): ranks seeded differently begin from rank 0's weights.

The multi-rank cases live in ``start_cases.py`` (2 ranks, and 4 for the 2x2 HYBRID mesh), one launch
per rank count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import dist_test
from torch.distributed.tensor.debug import CommDebugMode

from zeta_fsdp.start import start_from_first_rank, tensor_fingerprint

test_two_ranks = dist_test("start_cases.py", 2)
test_four_ranks = dist_test("start_cases.py", 4)


# --- in-process: the fingerprint ------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]
DTYPES += [torch.int8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)


def _flip_one_bit(t: torch.Tensor, element: int, bit: int) -> torch.Tensor:
    """A copy of ``t`` with one bit of one element's bytes flipped."""
    raw = t.clone().view(-1).view(torch.uint8)
    byte = element * t.element_size() + bit // 8
    raw[byte] ^= 1 << (bit % 8)
    return raw.view(t.dtype).view(t.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_equal_tensors_agree_and_one_bit_differs(dtype):
    t = _sample(dtype)
    assert tensor_fingerprint(t) == tensor_fingerprint(t.clone())
    # any bit of any byte: the first, a middle, and the last element's top bit
    for element, bit in [(0, 0), (17, 3), (t.numel() - 1, 8 * t.element_size() - 1)]:
        if dtype == torch.bool and bit > 0:
            continue  # a bool's other bits are not values
        flipped = _flip_one_bit(t, element, bit)
        assert tensor_fingerprint(flipped) != tensor_fingerprint(t), (element, bit)


def test_fingerprint_reads_bits_not_values():
    # equal as numbers, different bits: a sync must carry the bits (every rank bit-identical)
    assert tensor_fingerprint(torch.tensor([0.0])) != tensor_fingerprint(torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert tensor_fingerprint(nan) == tensor_fingerprint(nan.clone())  # NaN != NaN as a number
    assert tensor_fingerprint(torch.ones(3)) != tensor_fingerprint(torch.ones(3, dtype=torch.int32))


def test_fingerprint_sees_order():
    t = torch.arange(130, dtype=torch.float32)  # words in rows of 64
    for i, j in [(2, 9), (3, 67)]:  # swapped within a row, within a column
        swapped = t.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert tensor_fingerprint(swapped)[2] == tensor_fingerprint(t)[2]  # same sum ...
        assert tensor_fingerprint(swapped) != tensor_fingerprint(t), (i, j)  # ... other places


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.complex128], ids=str)
def test_fingerprint_non_contiguous_and_chunked(dtype):
    base = _sample(dtype, (6, 4, 5))
    strided = base.permute(2, 0, 1)  # non-contiguous: read in row-major order, one piece at a time
    assert not strided.is_contiguous()
    want = tensor_fingerprint(strided.contiguous())
    assert tensor_fingerprint(strided) == want
    assert tensor_fingerprint(base[:, 1]) == tensor_fingerprint(base[:, 1].contiguous())  # a strided slice
    assert tensor_fingerprint(base.view(-1)[::3]) == tensor_fingerprint(base.view(-1)[::3].contiguous())
    for rows in (1, 2, 7):  # chunks combined exactly: the same fingerprint whatever the chunk size
        assert tensor_fingerprint(strided, chunk_rows=rows) == want, rows
        assert tensor_fingerprint(strided.contiguous(), chunk_rows=rows) == want, rows


def test_fingerprint_fixed_values():
    # integer arithmetic on the bits: these numbers are the same on every CPU (and GPU)
    assert tensor_fingerprint(torch.tensor([1.0, 2.0])) == (2, 4, 2139095040, 3212836864, 2139095040)
    assert tensor_fingerprint(torch.tensor([True, False, True])) == (3, 1, 2, 4, 2)
    assert tensor_fingerprint(torch.tensor(-1, dtype=torch.int64)) == (1, 8, 2**61 - 3, 2**61 - 4, 2**61 - 3)
    assert tensor_fingerprint(torch.empty(0, 3)) == (0, 4, 0, 0, 0)
    big = torch.randn(3 * 2**18 + 5, generator=torch.Generator().manual_seed(0))  # three default chunks, a tail
    assert tensor_fingerprint(big) == tensor_fingerprint(big, chunk_rows=100)
    assert tensor_fingerprint(big[1:]) == tensor_fingerprint(big[1:].clone(), chunk_rows=1000)


def test_one_process_does_nothing():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight  # tied: one tensor
    before = {k: v.clone() for k, v in model.state_dict().items()}
    comm = CommDebugMode()
    with comm:
        start = start_from_first_rank(model)
    assert comm.get_total_counts() == 0
    assert start.replaced == [] and start.on_meta == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.device("meta"):
        meta = nn.Linear(3, 4)
    assert start_from_first_rank(meta).on_meta == ["weight", "bias"]
    assert start_from_first_rank(meta, only=["bias"]).on_meta == ["bias"]

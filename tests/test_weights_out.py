"""Weights out while training: ``iter_full_weights`` and the weight sender/receiver.

Multi-rank cases in ``weights_out_cases.py``: one launch on 2 gloo ranks (every strategy but HYBRID, ties,
bf16 with a cast, LoRA, a Hugging Face Mixtral, memory, failures) and one on 4 (HYBRID_SHARD, a 2x2 mesh).
The bucket planner is pure and runs here.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ROOT, dist_test, torchrun

from zeta_fsdp.weights_out import iter_full_weights
from zeta_fsdp.weights_out.plan import HEADER_BYTES, Item, Output, Source, plan_buckets

pytest.importorskip("transformers")
pytest.importorskip("peft")

test_two_ranks = dist_test("weights_out_cases.py", 2)
test_four_ranks = dist_test("weights_out_cases.py", 4)


def _item(key: str, rows: int, shards: int = 2, dtype=torch.float32, group="g") -> Item:
    s = Source(key, (rows, 3), dtype, shards, group if shards > 1 else None)
    return Item((s,), (Output(key, dtype, (rows, 3)),))


def test_uneven_shards_are_padded_to_torch_chunk_rows():
    s = Source("w", (5, 3), torch.float32, 4, "g")
    assert s.rows_per_rank == 2 and [s.rows_of(r) for r in range(4)] == [2, 2, 1, 0]  # torch.chunk(5, 4)
    (bucket,) = plan_buckets([_item("w", 5, shards=4)], cap_bytes=1 << 20)
    assert bucket.segment == {"w": HEADER_BYTES} and bucket.segment_bytes == HEADER_BYTES + 64  # 24 B, aligned
    assert bucket.output_bytes == 64 and bucket.shards == 4 and bucket.gathers


def test_a_tensor_larger_than_the_cap_gets_its_own_bucket_and_groups_split_buckets():
    items = [_item("a", 4), _item("big", 100), _item("b", 4), _item("c", 4, group="other"), _item("p", 4, shards=1)]
    buckets = plan_buckets(items, cap_bytes=200)
    assert [[i.outputs[0].name for i in b.items] for b in buckets] == [["a"], ["big"], ["b"], ["c", "p"]]
    assert [b.gathers for b in buckets] == [True, True, True, True]
    only_plain = plan_buckets([_item("p", 4, shards=1), _item("q", 4, shards=1)], cap_bytes=1000)
    assert len(only_plain) == 1 and not only_plain[0].gathers and only_plain[0].segment_bytes == HEADER_BYTES
    with pytest.raises(ValueError, match="cap_bytes=0"):
        plan_buckets(items, cap_bytes=0)


@pytest.mark.launch
def test_example_streams_to_a_receiver_process_that_generates(tmp_path):
    """``examples/stream_weights.py`` as a user runs it: 2 trainer ranks under torchrun, a receiver process."""
    digests = tmp_path / "digests.json"
    proc = torchrun(
        2, str(ROOT / "examples" / "stream_weights.py"), "--steps", "2", "--every", "1", "--digests", str(digests)
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "receiver weights equal get_full_state_dict bit for bit: True" in out, out[-4000:]
    assert out.count("receiver: round") == 2 and out.count("trainer: step") == 2, out[-4000:]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(bucket_mb=float("inf")), "bucket_mb=inf is not accepted"),
        (dict(bucket_mb=1e-9), "bucket_mb=1e-09 is not accepted"),
        (dict(device="meta"), "device='meta' is not accepted"),
        (dict(device=torch.device("meta")), "never 'meta'"),
        (dict(ranks=[True]), "ranks=[True] is not accepted"),
    ],
)
def test_bad_arguments_are_refused_before_anything_moves(kwargs, fragment):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        iter_full_weights(model, **kwargs)

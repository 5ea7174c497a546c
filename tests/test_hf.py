"""Hugging Face weights in and out: ``load_pretrained``, ``save_pretrained``, ``consolidate_to_hf``.

Two launches of ``hf_cases.py``: 2 ranks (every architecture of the zoo under FULL_SHARD,
SHARD_GRAD, NO_SHARD; errors; meta models; consolidation and its CLI) and 4 ranks (HYBRID_SHARD,
a 2x2 mesh). Plus the file helpers, in this process.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import dist_test

pytest.importorskip("transformers")  # a guard only: CI installs the hf extra

ZOO = ["llama_tied", "llama_untied", "gpt2", "bert_mlm", "mixtral", "t5", "bart", "vit"]
TWO_RANK = (
    [f"load_{a}_{s}" for a in ZOO for s in ("FULL_SHARD", "SHARD_GRAD", "NO_SHARD")]
    + [f"save_{a}" for a in ZOO]
    + [f"load_meta_unmaterialized_{a}" for a in ("llama_tied", "bert_mlm", "mixtral", "gpt2")]
    + [
        "load_meta_materialized_llama_tied",
        "meta_unmaterialized_ties_share_storage",
        "save_bf16_cast_on_write",
        "strict_errors_on_every_rank_before_change",
        "error_on_one_rank_raises_on_all",
        "load_single_file_and_index",
        "existing_dir_refused_and_failed_save_keeps_it",
        "consolidate_checkpoint_to_hf",
        "sharded_shapes_are_real_shards",
        "save_uneven_shards_every_engine",
        "clip_load_and_save",  # CLIP's 0-dim logit_scale: kept whole by fsdp(), loaded and saved
    ]
)
FOUR_RANK = [f"load_{a}_HYBRID_SHARD" for a in ("llama_tied", "mixtral", "bert_mlm", "t5")] + [
    f"save_{a}_HYBRID_SHARD" for a in ("llama_tied", "mixtral")
]

test_two_ranks = dist_test("hf_cases.py", 2, TWO_RANK)
test_four_ranks_hybrid = dist_test("hf_cases.py", 4, FOUR_RANK)


def test_stream_writer_matches_safetensors(tmp_path):
    from safetensors.torch import load_file

    from zeta_fsdp.hf.files import SafetensorsStreamWriter, read_rows, read_safetensors_header

    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(4, 3),
        "b": torch.tensor(2.5, dtype=torch.bfloat16),
        "c": torch.tensor([True, False, True]),
    }
    f = tmp_path / "x.safetensors"
    with SafetensorsStreamWriter(f, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}) as w:
        for k, v in tensors.items():
            w.write(k, v)
    back = load_file(str(f))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    header = read_safetensors_header(f)
    assert torch.equal(read_rows(header["a"], 1, 2), tensors["a"][1:3])
    assert torch.equal(read_rows(header["b"]), tensors["b"])


def test_truncated_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    from zeta_fsdp.hf.files import read_checkpoint_index

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(f))
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        read_checkpoint_index(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither"):
        read_checkpoint_index(tmp_path / "..")


def test_shard_plan_and_sizes():
    from zeta_fsdp.hf.files import parse_size, plan_shard_files

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(10) == 10
    for bad in ("lots", 0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    assert plan_shard_files({"a": 6, "b": 6, "c": 1, "d": 20}, 10) == [["a"], ["b", "c"], ["d"]]
    assert json.dumps(plan_shard_files({}, 10)) == "[]"

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
        "index_outside_or_malformed_refused_on_every_rank",
        "save_uneven_shards_every_engine",
        "clip_load_and_save",  # CLIP's 0-dim logit_scale: kept whole by fsdp(), loaded and saved
        "foreign_file_during_save_kept_and_stale_index_ignored",
        "shared_buffer_on_meta_and_untied_checkpoint_into_tied_model",
        "no_shard_save_before_first_forward_is_rank0s_model",
    ]
)
FOUR_RANK = [f"load_{a}_HYBRID_SHARD" for a in ("llama_tied", "mixtral", "bert_mlm", "t5")] + [
    f"save_{a}_HYBRID_SHARD" for a in ("llama_tied", "mixtral")
]

test_two_ranks = dist_test("hf_cases.py", 2, TWO_RANK)
test_four_ranks_hybrid = dist_test("hf_cases.py", 4, FOUR_RANK)


def test_planned_file_matches_safetensors(tmp_path):
    """A file planned by ``SafetensorsLayout`` and filled by ``write_at`` in any order is the safetensors
    library's file: same tensors, read back by ``read_rows`` row range by row range."""
    import os

    from safetensors.torch import load_file

    from zeta_fsdp.hf.files import SafetensorsLayout, read_rows, read_safetensors_header, write_at

    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(4, 3),
        "b": torch.tensor(2.5, dtype=torch.bfloat16),
        "c": torch.tensor([True, False, True]),
    }
    f = tmp_path / "x.safetensors"
    layout = SafetensorsLayout({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
    layout.create(f)
    fd = os.open(f, os.O_WRONLY)
    for k in reversed(tensors):  # any order: every offset is known up front
        write_at(fd, layout.offset[k], tensors[k])
    os.close(fd)
    back = load_file(str(f))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    header = read_safetensors_header(f)
    assert torch.equal(read_rows(header["a"], 1, 2), tensors["a"][1:3])
    assert torch.equal(read_rows(header["b"]), tensors["b"])
    fd = os.open(f, os.O_RDONLY)  # an open file, as load_pretrained passes it
    assert torch.equal(read_rows(header["a"], 3, 1, fd=fd), tensors["a"][3:])
    os.close(fd)


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


# --------------------------------------------------------------------------- hostile headers (issue 18)


def _raw_safetensors(path, header, data: bytes = b"\0" * 64) -> None:
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "header, needle",
    [
        ([1, 2], "JSON list"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        ({"w": [1]}, "is a list, not an object"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "data_offsets [-8, 0]"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, "data_offsets [0, 16]"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "malformed"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [60, 76]}}, "ends at 64"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, "not ints"),
        ({"w": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, "malformed"),
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            "overlap",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
            },
            "overlap",
        ),
        ({"__metadata__": [1], "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "__metadata__"),
    ],
    ids=[
        "list",
        "deep",
        "entry-list",
        "negative",
        "wrong-length",
        "negative-dim",
        "past-end",
        "string-offsets",
        "dtype",
        "overlap",
        "overlap-past-empty",
        "metadata-list",
    ],
)
def test_malformed_header_is_a_checkpoint_error(tmp_path, header, needle):
    from zeta_fsdp.hf.files import read_checkpoint_index
    from zeta_fsdp.state_dict import CheckpointError

    f = tmp_path / "model.safetensors"
    _raw_safetensors(f, header.encode() if isinstance(header, str) else header)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_index(tmp_path)
    assert needle in str(info.value) and str(f) in str(info.value), info.value


@pytest.mark.parametrize(
    "index, needle",
    [
        ([1], "weight_map"),
        ({"weight_map": [1]}, "weight_map"),
        ({"weight_map": {"w": 3}}, "not a file name"),
        ({"weight_map": {"w": "../x/model.safetensors"}}, "not a file inside"),
        ({"weight_map": {"w": "/etc/passwd"}}, "not a file inside"),
        ({"weight_map": {"w": "link.safetensors"}}, "outside"),
    ],
    ids=["list", "map-list", "non-string", "dotdot", "absolute", "link-outside"],
)
def test_malformed_or_escaping_index_is_a_checkpoint_error(tmp_path, index, needle):
    import os

    from safetensors.torch import save_file

    from zeta_fsdp.hf.files import INDEX_NAME, read_checkpoint_index
    from zeta_fsdp.state_dict import CheckpointError

    model_dir, outside = tmp_path / "m", tmp_path / "x"
    model_dir.mkdir()
    outside.mkdir()
    save_file({"w": torch.ones(2)}, str(outside / "model.safetensors"))
    os.symlink(outside / "model.safetensors", model_dir / "link.safetensors")
    (model_dir / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_index(model_dir)
    assert needle in str(info.value), info.value


def test_hub_cache_layout_loads(tmp_path):
    """Files of a Hugging Face cache snapshot are links into ``../../blobs``: they stay readable."""
    import os

    from safetensors.torch import save_file

    from zeta_fsdp.hf.files import INDEX_NAME, read_checkpoint_index, read_rows

    blobs, snap = tmp_path / "models--x" / "blobs", tmp_path / "models--x" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file({"a": torch.arange(4.0)}, str(blobs / "1111"))
    save_file({"b": torch.ones(3)}, str(blobs / "2222"))
    os.symlink("../../blobs/1111", snap / "model-00001-of-00002.safetensors")
    os.symlink("../../blobs/2222", snap / "model-00002-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (blobs / "3333").write_text(json.dumps({"weight_map": weight_map}))
    os.symlink("../../blobs/3333", snap / INDEX_NAME)
    entries = read_checkpoint_index(snap)
    assert torch.equal(read_rows(entries["a"]), torch.arange(4.0)) and torch.equal(
        read_rows(entries["b"]), torch.ones(3)
    )


def test_full_disk_names_the_file(tmp_path, monkeypatch):
    """A full disk while writing a safetensors file names the file and says what to do."""
    import os

    from zeta_fsdp.hf.files import SafetensorsLayout

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    target = tmp_path / "model.safetensors"
    with pytest.raises(OSError, match="No space left") as info:
        SafetensorsLayout({"w": (torch.float32, (2,))}).create(target)
    assert str(target) in str(info.value) and "save elsewhere" in str(info.value), info.value


@pytest.mark.launch
def test_two_processes_saving_pretrained_to_one_directory_lose_nothing(tmp_path):
    """Two jobs, 10 ``save_pretrained(model, dir, overwrite=True)`` each, at once (issue 18): they take
    turns on the directory's lock; every call publishes a complete file or raises naming the path, and
    the directory ends with one call's whole, unmixed weights and nothing left beside it."""
    from conftest import run_concurrent_writers
    from safetensors.torch import load_file

    path, n = tmp_path / "m", 10
    results = run_concurrent_writers(path, n, tmp_path, "hf")
    for w, calls in results.items():
        bad = [r for r in calls if r != "ok" and str(path) not in r]
        assert not bad, f"writer {w}: {bad[:3]}"
    weights = load_file(str(path / "model.safetensors"))
    values = {float(v.flatten()[0]) for v in weights.values()}
    assert len(values) == 1 and all(torch.all(v == v.flatten()[0]) for v in weights.values()), "mixed weights"
    value = int(values.pop())
    writer, i = divmod(value, 1000)
    assert results[writer][i] == "ok", "the directory holds the weights of a call that reported failure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "w1.json", "w2.json"], "a save left files beside it"


def test_a_model_directory_being_written_is_refused_by_name(tmp_path, monkeypatch):
    """While another job holds a model directory's lock, a save to it waits, then refuses naming it."""
    import zeta_fsdp.hf.files as hf_files
    from zeta_fsdp.files import PathLock

    path = tmp_path / "llama"
    other = PathLock(path)
    assert other.acquire(timeout_s=0)
    monkeypatch.setattr(hf_files, "LOCK_WAIT_S", 0.05)
    try:
        with pytest.raises(FileExistsError, match="another job is writing"):
            hf_files.staging_dir(path, overwrite=True, caller="save_pretrained()")
        assert not path.exists() and not hf_files.incomplete_path(path).exists()
    finally:
        other.release()
    tmp = hf_files.staging_dir(path, overwrite=True, caller="save_pretrained()")
    hf_files.end_staging(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_unsigned_and_e8m0_safetensors_read_and_write(tmp_path):
    """Issue 29 §9: valid files with U16/U32/U64/F8_E8M0 are read (not called corrupt), our writer stores those
    dtypes as safetensors does, and a dtype safetensors cannot hold (complex) is refused naming it."""
    import os

    from safetensors.torch import load_file, save_file

    from zeta_fsdp.hf.files import SafetensorsLayout, read_rows, read_safetensors_header, write_at
    from zeta_fsdp.hf.save import check_savable

    tensors = {
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
        "u32": torch.tensor([[7, 2**32 - 1]], dtype=torch.uint32),
        "u64": torch.tensor([2**63 + 5], dtype=torch.uint64),
        "e8m0": torch.tensor([0.5, 4.0], dtype=torch.float32).to(torch.float8_e8m0fnu),
    }
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, str(theirs))
    header = read_safetensors_header(theirs)
    for key, want in tensors.items():
        got = read_rows(header[key])
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
    ours = tmp_path / "ours.safetensors"
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    check_savable(layout, "save_pretrained()")
    SafetensorsLayout(layout).create(ours)
    fd = os.open(ours, os.O_WRONLY)
    for key, value in tensors.items():
        write_at(fd, SafetensorsLayout(layout).offset[key], value)
    os.close(fd)
    back = load_file(str(ours))
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())
    with pytest.raises(ValueError, match=r"cannot store torch.complex64 \(tensors: \['freqs'\]\). Accepted dtypes: "):
        check_savable({"freqs": (torch.complex64, (4,)), "w": (torch.float32, (2,))}, "save_pretrained()")


def test_a_safetensors_dtype_torch_lacks_is_named_not_called_corrupt(tmp_path):
    from zeta_fsdp.hf.files import read_safetensors_header
    from zeta_fsdp.state_dict import CheckpointError

    header = json.dumps({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(CheckpointError, match="dtype 'F4', which zeta_fsdp cannot read") as caught:
        read_safetensors_header(f)
    assert "Re-download" not in str(caught.value)

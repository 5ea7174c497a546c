"""State dicts and checkpoints on real gloo ranks, plus the offline pieces (consolidation, CLI).

Four launches of ``ckpt_cases.py`` share one checkpoint directory: 2 ranks save (and check
everything that needs one world size), a fresh 2-rank launch resumes and then loses a rank
mid-save, and 1- and 4-rank launches load what 2 ranks saved. The offline tests read the
checkpoints those launches left, in this process, with no process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, rank_env, torchrun

from examples.gpt import small
from zeta_fsdp import cli
from zeta_fsdp.state_dict import (
    CheckpointError,
    consolidate_checkpoint,
    get_full_state_dict,
    get_optimizer_state_dict,
    is_checkpoint,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)

SAVE_CASES = [
    "resume_save_reference",
    "full_state_dict_equals_reference",
    "full_state_dict_into_meta_model",
    "optimizer_state_roundtrip",
    "step0_checkpoint_keeps_optimizer_fresh",
    "reshard_between_strategies_2_ranks",
    "crash_mid_save_leaves_earlier_checkpoint",
    "bad_inputs_raise_before_touching",
]
RESUME_CASES = ["resume_continue_identical"]
ONE_RANK_CASES = ["load_2rank_checkpoint_full_shard", "load_2rank_checkpoint_no_shard"]
FOUR_RANK_CASES = [
    "load_2rank_checkpoint_full_shard",
    "load_2rank_checkpoint_no_shard",
    "load_2rank_checkpoint_hybrid",
]


def launch(
    out: Path, nproc: int, cases: list[str], ckpt: Path, *extra: str
) -> tuple[dict, subprocess.CompletedProcess]:
    """One launch of ``ckpt_cases.py``; returns ({case: "ok" | failures}, the process).

    One rank runs as a plain ``python`` process (the one-process group ``fsdp()`` starts in a
    notebook, and no launcher to pay for); more ranks go through ``torchrun``.
    """
    worker = str(ROOT / "tests" / "ckpt_cases.py")
    args = ["--out", str(out), "--cases", ",".join(cases), "--ckpt-dir", str(ckpt), *extra]
    if nproc == 1:
        cmd = [sys.executable, worker, *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    else:
        proc = torchrun(nproc, worker, *args, timeout=300)
    files = sorted(out.glob("rank*.json")) if out.exists() else []
    if len(files) != nproc or (proc.returncode != 0 and not extra):
        raise AssertionError(f"launch failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    per_rank = [json.loads(f.read_text()) for f in files]
    results = {}
    for name in cases:
        failures = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "ok"]
        results[name] = "ok" if not failures else "\n".join(failures)
    return results, proc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory) -> dict:
    return launch(tmp_path_factory.mktemp("save"), 2, SAVE_CASES, ckpt)[0]


@pytest.fixture(scope="module")
def resumed(saved, ckpt, tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    assert saved["resume_save_reference"] == "ok", "the checkpoint to resume from was not saved"
    return launch(tmp_path_factory.mktemp("resume"), 2, RESUME_CASES, ckpt, "--kill-save")


@pytest.fixture(scope="module")
def one_rank(saved, ckpt, tmp_path_factory) -> dict:
    assert saved["resume_save_reference"] == "ok", "the 2-rank checkpoint was not saved"
    return launch(tmp_path_factory.mktemp("one"), 1, ONE_RANK_CASES, ckpt)[0]


@pytest.fixture(scope="module")
def four_ranks(saved, ckpt, tmp_path_factory) -> dict:
    assert saved["resume_save_reference"] == "ok", "the 2-rank checkpoint was not saved"
    return launch(tmp_path_factory.mktemp("four"), 4, FOUR_RANK_CASES, ckpt)[0]


@pytest.mark.parametrize("case", SAVE_CASES)
def test_two_ranks(saved, case):
    assert saved[case] == "ok", saved[case]


def test_resume_in_fresh_process_group_is_identical(resumed):
    results, _ = resumed
    assert results["resume_continue_identical"] == "ok", results["resume_continue_identical"]


@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_saved_at_2_loaded_at_1(one_rank, case):
    assert one_rank[case] == "ok", one_rank[case]


@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_saved_at_2_loaded_at_4(four_ranks, case):
    assert four_ranks[case] == "ok", four_ranks[case]


def test_rank_killed_mid_save_leaves_earlier_checkpoint(resumed, ckpt, tmp_path):
    _, proc = resumed
    # The kill really happened mid-save: rank 1 died (exit 17) right after writing its shard file.
    assert "exitcode  : 17" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    written = json.loads((ckpt / "killed_marker.json").read_text())
    assert "__1_0.distcp" in written and ".metadata" not in written, written
    complete = sorted(p.name for p in ckpt.iterdir() if "killed" in p.name and is_checkpoint(p))
    assert complete == ["killed"], f"complete-looking checkpoints after the crash: {complete}"
    path = ckpt / "killed"
    digest = json.loads((ckpt / "killed_digest.json").read_text())
    import hashlib

    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())} == digest
    out = consolidate_checkpoint(path, tmp_path / "killed.pt")
    got = torch.load(out, weights_only=True)
    want = torch.load(ckpt / "killed_expected.pt", weights_only=True)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


# --------------------------------------------------------------------------- offline: no process group


def expected_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt / "expected_step3.pt", weights_only=True)["model"]


def test_consolidate_to_torch_save(saved, ckpt, tmp_path):
    assert saved["resume_save_reference"] == "ok"
    out = consolidate_checkpoint(ckpt / "resume", tmp_path / "model.pt")
    sd = torch.load(out, weights_only=True)
    want = expected_weights(ckpt)
    assert list(sd) == list(small().state_dict()) == list(want)
    for key, value in want.items():
        assert torch.equal(sd[key], value), key
    model = small()
    model.load_state_dict(sd)  # strict
    assert torch.equal(model.head.weight, want["head.weight"])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        consolidate_checkpoint(ckpt / "resume", out)
    consolidate_checkpoint(ckpt / "resume", out, overwrite=True)
    assert not list(tmp_path.glob(".*incomplete*"))


def test_consolidate_to_safetensors(saved, ckpt, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    out = consolidate_checkpoint(ckpt / "resume", tmp_path / "model.safetensors")
    sd = safetensors_torch.load_file(str(out))
    want = expected_weights(ckpt)
    assert sorted(sd) == sorted(want)
    for key, value in want.items():
        assert torch.equal(sd[key], value), key


def test_consolidate_to_safetensors_without_the_package_says_how(saved, ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install 'zeta-fsdp\[safetensors\]'"):
        consolidate_checkpoint(ckpt / "resume", tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


def test_cli_consolidate(saved, ckpt, tmp_path, capsys):
    out = tmp_path / "cli.pt"
    assert cli.main(["consolidate", str(ckpt / "resume"), str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    assert all(torch.equal(sd[k], v) for k, v in expected_weights(ckpt).items())
    assert str(out) in capsys.readouterr().out
    # bad input: one line on stderr, exit code 2
    for argv, needle in [
        (["consolidate", str(tmp_path / "nope"), str(tmp_path / "x.pt")], "does not exist"),
        (["consolidate", str(tmp_path), str(tmp_path / "x.pt")], "not a checkpoint"),
        (["consolidate", str(ckpt / "resume"), str(out)], "--overwrite"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert cli.main(["consolidate", str(ckpt / "resume"), str(out), "--overwrite"]) == 0


def test_offline_errors_name_the_path(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        consolidate_checkpoint(missing, tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        consolidate_checkpoint(tmp_path, tmp_path / "x.pt")
    model = small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_checkpoint(missing, model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not is_checkpoint(missing) and not is_checkpoint(tmp_path)


def test_without_process_group_plain_model(tmp_path):
    """The helpers work in a notebook on an unwrapped model: no group is started."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = small()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 37, (2, 11))
    model(x).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model, opt, extra={"step": 1})
    other = small()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert load_checkpoint(tmp_path / "c", other, other_opt) == {"step": 1}
    assert not dist.is_initialized()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    want, got = get_optimizer_state_dict(model, opt, full=True), get_optimizer_state_dict(other, other_opt, full=True)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())
    assert list(get_full_state_dict(model)) == list(model.state_dict())
    # Keys written by wrapped models (torch.compile, activation-checkpoint or FSDP1 wrappers) load as is.
    prefixed = {
        k.replace("blocks.0.", "blocks.0._checkpoint_wrapped_module.").replace("tok_emb", "_orig_mod.tok_emb"): v
        for k, v in model.state_dict().items()
    }
    third = small()
    load_full_state_dict(third, prefixed)
    for (name, p), q in zip(model.named_parameters(), third.parameters()):
        assert torch.equal(p, q), name

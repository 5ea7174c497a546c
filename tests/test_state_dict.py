"""State dicts and checkpoints on real gloo ranks, plus the offline pieces (consolidation, CLI).

Four launches of ``ckpt_cases.py`` share one checkpoint directory: 2 ranks save (and check
everything that needs one world size), a fresh 2-rank launch resumes and then loses a rank
mid-save, and 1- and 4-rank launches load what 2 ranks saved. The offline tests read the
checkpoints those launches left, in this process, with no process group.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    check_case,
    launch_worker,
    launches,
    merge_ranks,
    rank_env,
    run_concurrent_writers,
    worker_cases,
)

from zeta_fsdp import cli
from zeta_fsdp.models.gpt import small
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

# The cases are registered in ckpt_cases.py by group (one launch each) and rank count.
SAVE_CASES = worker_cases("ckpt_cases.py", 2, "save")
RESUME_CASES = worker_cases("ckpt_cases.py", 2, "resume")
ONE_RANK_CASES = worker_cases("ckpt_cases.py", 1, "load")
FOUR_RANK_CASES = worker_cases("ckpt_cases.py", 4, "load")


def launch(
    out: Path, nproc: int, cases: list[str], ckpt: Path, *extra: str
) -> tuple[dict, subprocess.CompletedProcess]:
    """One launch of ``ckpt_cases.py`` (1 rank: plain ``python``); returns ({case: "ok" | failures}, the process).

    ``extra`` (``--kill-save``) ends the launch with a rank killed on purpose: its exit code is not checked.
    """
    per_rank, proc = launch_worker(
        out, nproc, "ckpt_cases.py", cases, "--ckpt-dir", str(ckpt), *extra, timeout=300, allow_exit_code=bool(extra)
    )
    return merge_ranks(per_rank, cases), proc


@pytest.fixture(scope="module")
@launches
def ckpt(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
@launches
def saved(ckpt, tmp_path_factory) -> dict:
    return launch(tmp_path_factory.mktemp("save"), 2, SAVE_CASES, ckpt)[0]


@pytest.fixture(scope="module")
@launches
def resumed(saved, ckpt, tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    assert saved["resume_save_reference"] == "ok", "the checkpoint to resume from was not saved"
    return launch(tmp_path_factory.mktemp("resume"), 2, RESUME_CASES, ckpt, "--kill-save")


@pytest.fixture(scope="module")
@launches
def one_rank(saved, ckpt, tmp_path_factory) -> dict:
    assert saved["resume_save_reference"] == "ok", "the 2-rank checkpoint was not saved"
    return launch(tmp_path_factory.mktemp("one"), 1, ONE_RANK_CASES, ckpt)[0]


@pytest.fixture(scope="module")
@launches
def four_ranks(saved, ckpt, tmp_path_factory) -> dict:
    assert saved["resume_save_reference"] == "ok", "the 2-rank checkpoint was not saved"
    return launch(tmp_path_factory.mktemp("four"), 4, FOUR_RANK_CASES, ckpt)[0]


@pytest.mark.parametrize("case", SAVE_CASES)
def test_two_ranks(saved, case):
    check_case(saved, case)


def test_resume_in_fresh_process_group_is_identical(resumed):
    check_case(resumed[0], "resume_continue_identical")


@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_saved_at_2_loaded_at_1(one_rank, case):
    check_case(one_rank, case)


@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_saved_at_2_loaded_at_4(four_ranks, case):
    check_case(four_ranks, case)


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


# --------------------------------------------------------------------------- failed and interrupted writes, offline


def plain_checkpoint(path: Path, step: int) -> dict[str, torch.Tensor]:
    """Save an unwrapped ``small()`` (seeded by ``step``) with no process group; return its weights."""
    torch.manual_seed(step)
    model = small()
    save_checkpoint(path, model, extra={"step": step}, overwrite=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_holds(path: Path, step: int, weights: dict[str, torch.Tensor]) -> None:
    model = small()
    assert load_checkpoint(path, model) == {"step": step}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def flip_a_model_byte(path: Path) -> None:
    """Flip one bit inside the tensor bytes of the largest model record (only its CRC-32 can tell)."""
    from zeta_fsdp.state_dict.reader import read_metadata

    md = read_metadata(path, "test")
    records = [(i, info) for i, info in md.storage_data.items() if i.fqn.startswith("model.")]
    _, info = max(records, key=lambda r: r[1].length)
    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x40
    shard.write_bytes(bytes(data))


def test_consolidate_corrupted_record_is_one_line_error(tmp_path, capsys):
    path, out = tmp_path / "c", tmp_path / "model.pt"
    plain_checkpoint(path, 1)
    flip_a_model_byte(path)
    # DCP raises CheckpointException, a BaseException: it must come out as a CheckpointError
    with pytest.raises(CheckpointError) as info:
        consolidate_checkpoint(path, out)
    message = str(info.value)
    assert str(path) in message and "CRC-32" in message and "\n" not in message, message
    assert names(tmp_path) == ["c"], "consolidation of a corrupted checkpoint left files behind"
    assert cli.main(["consolidate", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "CRC-32" in err and err.count("\n") == 1, err
    assert names(tmp_path) == ["c"]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_consolidate_write_failure_leaves_no_temp_file(tmp_path, monkeypatch, capsys, suffix):
    path, out = tmp_path / "c", tmp_path / f"model{suffix}"
    plain_checkpoint(path, 1)

    def half_written(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    if suffix == ".safetensors":
        monkeypatch.setattr(pytest.importorskip("safetensors.torch"), "save_file", half_written)
    else:
        monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(OSError, match="No space left"):
        consolidate_checkpoint(path, out)
    assert names(tmp_path) == ["c"], "a failed consolidation left a temporary file"
    assert cli.main(["consolidate", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left" in err and err.count("\n") == 1, err
    assert names(tmp_path) == ["c"]


# A save killed between its two renames: the previous checkpoint has been moved aside, the new one
# (complete) is not yet in place. os._exit: no exception handler or clean-up runs, as after a kill.
KILLED_BETWEEN_RENAMES = """
import os, sys
from pathlib import Path
import torch
from zeta_fsdp.models.gpt import small
from zeta_fsdp.state_dict import save_checkpoint

path = Path(sys.argv[1])
torch.manual_seed(1)
save_checkpoint(path, small(), extra={"step": 1})
rename = Path.rename

def killed(self, target):
    if self.name == f".{path.name}.incomplete" and Path(target) == path:
        os._exit(3)
    return rename(self, target)

Path.rename = killed
import zeta_fsdp.files
zeta_fsdp.files.exchange_paths = lambda a, b: False  # the two-rename publish (systems without renameat2)
torch.manual_seed(2)
save_checkpoint(path, small(), extra={"step": 2}, overwrite=True)
"""


@pytest.mark.launch
def test_overwrite_killed_between_renames_recovers(tmp_path):
    path = tmp_path / "c"
    cmd = [sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    # The killed save's lock file stays (the kernel released the lock itself); the next writer removes it.
    assert names(tmp_path) == [".c.incomplete", ".c.lock", ".c.replaced"], "not the state between the two renames"
    torch.manual_seed(2)
    new = small().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # is_checkpoint only reads: no warning, no rename
        assert is_checkpoint(path)  # the usual `if is_checkpoint(p): load_checkpoint(p, ...)` finds it
    assert names(tmp_path) == [".c.incomplete", ".c.lock", ".c.replaced"], "is_checkpoint changed the folder"
    with pytest.warns(UserWarning, match="interrupted"):
        assert_holds(path, 2, new)  # the load finishes the overwrite
    assert names(tmp_path) == ["c"]


def test_overwrite_interrupted_before_new_was_complete_restores_previous(tmp_path, monkeypatch):
    path = tmp_path / "c"
    weights = plain_checkpoint(path, 1)
    path.rename(tmp_path / ".c.replaced")
    (tmp_path / ".c.incomplete").mkdir()
    (tmp_path / ".c.incomplete" / "__0_0.distcp").write_bytes(b"partial")

    def refused(self, target):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:  # recovery impossible: the error says where the data is
        m.setattr(Path, "rename", refused)
        with pytest.raises(FileNotFoundError, match=r"previous checkpoint is in .*\.c\.replaced"):
            load_checkpoint(path, small())
        with pytest.raises(FileNotFoundError, match=r"partial data is in .*\.c\.incomplete"):
            consolidate_checkpoint(path, tmp_path / "x.pt")
    with pytest.warns(UserWarning, match="restored the previous checkpoint"):
        assert_holds(path, 1, weights)
    assert names(tmp_path) == [".c.incomplete", "c"]  # the partial save is removed by the next save
    plain_checkpoint(path, 3)
    assert names(tmp_path) == ["c"]


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), KeyboardInterrupt()])
def test_overwrite_failing_rename_puts_previous_back(tmp_path, monkeypatch, error):
    import zeta_fsdp.files

    path = tmp_path / "c"
    weights = plain_checkpoint(path, 1)
    rename = Path.rename
    monkeypatch.setattr(zeta_fsdp.files, "exchange_paths", lambda a, b: False)  # the two-rename publish

    def failing(self, target):
        if self.name == ".c.incomplete":
            raise error
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    expected = CheckpointError if isinstance(error, OSError) else KeyboardInterrupt
    with pytest.raises(expected, match="untouched" if expected is CheckpointError else None):
        plain_checkpoint(path, 2)
    monkeypatch.undo()
    assert names(tmp_path) == ["c"], "a failed overwrite left files behind"
    assert_holds(path, 1, weights)


def test_overwrite_failing_exchange_keeps_previous(tmp_path, monkeypatch):
    """Where the atomic exchange is used (Linux), a failing one leaves the previous checkpoint in place."""
    import zeta_fsdp.files

    path = tmp_path / "c"
    weights = plain_checkpoint(path, 1)

    def failing(a, b):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(zeta_fsdp.files, "exchange_paths", failing)
    with pytest.raises(CheckpointError, match="untouched"):
        plain_checkpoint(path, 2)
    monkeypatch.undo()
    assert names(tmp_path) == ["c"], "a failed overwrite left files behind"
    assert_holds(path, 1, weights)


def test_save_failing_before_writing_leaves_no_temp_dir(tmp_path):
    other = torch.optim.AdamW(small().parameters())  # the optimizer of another model
    with pytest.raises(CheckpointError, match="not in the model"):
        save_checkpoint(tmp_path / "c", small(), other)
    assert names(tmp_path) == [], "a failed save left a temporary directory"


# --------------------------------------------------------------------------- files of anyone (issue 18)


class _Payload:
    """A pickle that creates ``marker`` when unpickled by anything but an allow-list unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.mkdir, (str(self.marker),))


@pytest.mark.launch
def test_no_reader_runs_a_crafted_metadata_pickle(tmp_path, capsys):
    """Every reader of ``.metadata`` (load, both consolidations, the CLI) refuses a crafted pickle."""
    import pickle

    from zeta_fsdp.hf import consolidate_to_hf

    path, marker = tmp_path / "c", tmp_path / "PWNED"
    plain_checkpoint(path, 1)
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    model = small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    readers = {
        "load_checkpoint": lambda: load_checkpoint(path, model),
        "consolidate_checkpoint": lambda: consolidate_checkpoint(path, tmp_path / "out.pt"),
        "consolidate_to_hf": lambda: consolidate_to_hf(path, tmp_path / "out_hf"),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointError, match="not allowed") as info:
            read()
        assert str(path) in str(info.value), (name, info.value)
        assert not marker.exists(), f"{name} ran code from the checkpoint's .metadata"
    assert not is_checkpoint(path)
    for argv in (["consolidate", str(path), str(tmp_path / "o.pt")], ["consolidate", str(path), "o", "--hf"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "not allowed" in err and err.count("\n") == 1, err
        assert not marker.exists(), f"{argv} ran code from the checkpoint's .metadata"
    proc = subprocess.run(
        [sys.executable, "-m", "zeta_fsdp", "consolidate", str(path), str(tmp_path / "cli_hf"), "--hf"],
        cwd=ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not allowed" in proc.stderr, proc.stderr
    assert not marker.exists()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert names(tmp_path) == ["c"]


def test_metadata_pointing_outside_is_refused(tmp_path):
    """A ``.metadata`` whose records name ``../file`` never makes a reader open a file outside."""
    import pickle

    from zeta_fsdp.state_dict.reader import read_metadata

    path = tmp_path / "c"
    plain_checkpoint(path, 1)
    metadata = read_metadata(path, "test")
    for info in metadata.storage_data.values():
        info.relative_path = "../secret.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file inside"):
        load_checkpoint(path, small())


@pytest.mark.launch
def test_two_processes_saving_to_one_path_lose_nothing(tmp_path):
    """Two jobs, 25 ``save_checkpoint(path, overwrite=True)`` each, at once: every call publishes a complete
    checkpoint or raises ``CheckpointError``; the path always ends with a complete checkpoint of one call."""
    path, n = tmp_path / "c", 25
    results = run_concurrent_writers(path, n, tmp_path)
    for w, calls in results.items():
        raw = [r for r in calls if not (r == "ok" or r.startswith("CheckpointError"))]
        assert not raw, f"writer {w}: {raw[:3]}"
        assert all(str(path) in r for r in calls if r != "ok"), calls
    assert results[1][-1] == "ok" or results[2][-1] == "ok"
    model = torch.nn.Linear(64, 64)
    extra = load_checkpoint(path, model)  # complete: every record CRC-checked
    value = extra["writer"] * 1000 + extra["i"]
    assert results[extra["writer"]][extra["i"]] == "ok", "the path holds the data of a call that reported failure"
    assert all(torch.equal(p, torch.full_like(p, value)) for p in model.parameters()), "mixed checkpoint"
    assert names(tmp_path) == ["c", "w1.json", "w2.json"], "a save left files beside the checkpoint"


def test_destructive_calls_refuse_what_is_not_ours(tmp_path):
    """``remove_checkpoint``, a full-format save, and a save onto a link touch only checkpoints of ours."""
    import os

    from zeta_fsdp.state_dict.full import remove_checkpoint, write_full_checkpoint

    ours = tmp_path / "ours"
    weights = plain_checkpoint(ours, 1)
    notes, users = tmp_path / "notes.txt", tmp_path / "users"
    notes.write_text("my notes")
    users.mkdir()
    (users / ".metadata").write_text("not a checkpoint")
    (users / "data.csv").write_text("1,2")
    # a full-format save never replaces a file that is not a checkpoint
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        write_full_checkpoint(notes, {"state_dict": {}})
    assert notes.read_text() == "my notes"
    # remove_checkpoint: a user's folder that merely holds a .metadata, or a file, is refused
    for target in (users, notes):
        with pytest.raises(CheckpointError, match="refusing") as info:
            remove_checkpoint(target)
        assert str(target) in str(info.value)
    assert sorted(p.name for p in users.iterdir()) == [".metadata", "data.csv"] and notes.read_text() == "my notes"
    # remove_checkpoint(link) unlinks the link (NeMo's "last" checkpoints); the checkpoint stays
    last = tmp_path / "last"
    os.symlink(ours, last, target_is_directory=True)
    remove_checkpoint(last)
    assert not os.path.lexists(last)
    assert_holds(ours, 1, weights)
    # a link to a user's file is not removed either
    link = tmp_path / "link_to_notes"
    os.symlink(notes, link)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        remove_checkpoint(link)
    assert os.path.islink(link)
    # save_checkpoint(overwrite=True) onto a link to a checkpoint replaces the link, not what it points to
    os.symlink(ours, last, target_is_directory=True)
    new = plain_checkpoint(last, 2)
    assert not last.is_symlink() and is_checkpoint(last)
    assert_holds(ours, 1, weights)
    assert_holds(last, 2, new)
    # ... and onto a link to a user's folder is refused
    os.symlink(users, tmp_path / "step_9", target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link"):
        plain_checkpoint(tmp_path / "step_9", 3)
    assert sorted(p.name for p in users.iterdir()) == [".metadata", "data.csv"]


def test_full_format_file_through_state_dict(tmp_path):
    """The full format (one ``torch.save`` file) and the sharded one share one save-target check and
    one weights-only check; the file reads back only with ``weights_only`` unless asked otherwise."""
    from zeta_fsdp.state_dict.full import read_full_checkpoint, write_full_checkpoint
    from zeta_fsdp.strategy import EpochStep

    full = tmp_path / "full.ckpt"
    write_full_checkpoint(full, {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "step": 3})
    ckpt = read_full_checkpoint(full)
    assert ckpt["step"] == 3 and torch.equal(ckpt["state_dict"]["w"], torch.ones(2))
    kept = full.read_bytes()
    with pytest.raises(FileExistsError, match="is a full-format checkpoint"):  # a sharded save onto it
        save_checkpoint(full, torch.nn.Linear(2, 2))
    with pytest.raises(IsADirectoryError, match="a full-format save writes one file"):
        write_full_checkpoint(tmp_path, {"state_dict": {}})
    with pytest.raises(ValueError, match="is empty"):
        write_full_checkpoint("  ", {"state_dict": {}})
    assert full.read_bytes() == kept
    with pytest.raises(TypeError, match=r"save_checkpoint\(\): extra must be loadable with torch.load\(weights_only"):
        save_checkpoint(tmp_path / "x", torch.nn.Linear(2, 2), extra={"epoch": EpochStep(1, 2)})
    pickled = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": {}, "obj": EpochStep(1, 2)}, pickled)  # a class weights_only refuses
    with pytest.raises(CheckpointError, match=re.escape(str(pickled)) + r".*weights_only=True\) refuses"):
        read_full_checkpoint(pickled)
    assert read_full_checkpoint(pickled, weights_only=False)["obj"] == (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.ckpt", "pickled.ckpt"]


def test_path_lock_is_exclusive_and_leaves_nothing(tmp_path):
    from zeta_fsdp.files import PathLock

    a, b = PathLock(tmp_path / "c"), PathLock(tmp_path / "c")
    assert a.acquire(timeout_s=0)
    assert not b.acquire(timeout_s=0.1)
    a.release()
    assert names(tmp_path) == []
    assert b.acquire(timeout_s=0)
    b.release()
    assert names(tmp_path) == []


# --------------------------------------------------------------------------- the record reader (no process group)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(15, dtype=torch.float32).reshape(3, 5),
        torch.arange(12, dtype=torch.int64).reshape(4, 3).t(),  # saved with transposed strides
        torch.tensor([True, False, True]),
        torch.zeros(0, 4, dtype=torch.bfloat16),
    ],
    ids=["float32", "int64-transposed", "bool", "empty-bf16"],
)
def test_record_reader_never_returns_a_wrong_tensor(tensor):
    """Every single-bit flip anywhere in a record: an error, a fall-back to torch.load, or the exact tensor.

    ``reader.entries`` checks every entry's CRC-32 over the bytes in memory and
    ``reader.tensor_record`` views the data entry; a damaged record must never decode to a
    different tensor.
    """
    import io

    from zeta_fsdp.state_dict.reader import entries, tensor_record

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    record = bytearray(buffer.getvalue())
    files = entries(memoryview(bytes(record)), "intact")
    decoded = tensor_record(files, "intact")
    assert decoded is not None and decoded.dtype == tensor.dtype and decoded.stride() == tensor.stride()
    assert torch.equal(decoded, tensor)
    # Where the pickle and the tensor bytes are: every flip there must be caught (their CRC-32s).
    checked = set()
    for name, data in files.items():
        if name.endswith(("data.pkl", "data/0")) and len(data):
            start = bytes(record).find(bytes(data))
            checked.update(range(start, start + len(data)))
    outcomes = {"error": 0, "fallback": 0, "same": 0}
    for position in range(len(record)):
        for mask in (0x01, 0x80):
            damaged = bytearray(record)
            damaged[position] ^= mask
            try:
                files = entries(memoryview(bytes(damaged)), "damaged")
                got = tensor_record(files, "damaged") if files is not None else None
            except CheckpointError:
                outcomes["error"] += 1
                continue
            assert position not in checked, f"a flip at byte {position} of a checked entry went unnoticed"
            if got is None:
                outcomes["fallback"] += 1
                continue
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (position, mask)
            outcomes["same"] += 1  # the flip hit a byte nothing reads (a timestamp, an unused field)
    assert outcomes["error"] >= 2 * len(checked), outcomes


def test_load_into_a_state_dict_that_copies(tmp_path):
    """A module whose ``state_dict()`` returns copies is still loaded (through scratch and ``load_state_dict``)."""

    class Copying(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 4)
            self._register_state_dict_hook(lambda _m, sd, _p, _l: {k: v.clone() for k, v in sd.items()})

    torch.manual_seed(0)
    saved = Copying()
    save_checkpoint(tmp_path / "c", saved)
    target = Copying()
    assert not torch.equal(target.lin.weight, saved.lin.weight)
    load_checkpoint(tmp_path / "c", target)
    assert torch.equal(target.lin.weight, saved.lin.weight) and torch.equal(target.lin.bias, saved.lin.bias)


def test_extra_needs_no_round_trip_but_is_still_checked(tmp_path):
    """Plain ``extra`` skips the torch.save round trip; a look-alike that would not load back is still refused."""
    import enum

    class Mode(enum.IntEnum):
        TRAIN = 1

    model = small()
    extra = {"step": 3, "lr": 0.1, "betas": (0.9, 0.99), "rng": torch.get_rng_state(), "dtype": torch.float32}
    save_checkpoint(tmp_path / "c", model, extra=extra)
    got = load_checkpoint(tmp_path / "c", small())
    assert list(got) == list(extra) and torch.equal(got["rng"], extra["rng"])
    assert {k: v for k, v in got.items() if k != "rng"} == {k: v for k, v in extra.items() if k != "rng"}
    with pytest.raises(TypeError, match="weights_only"):
        save_checkpoint(tmp_path / "d", model, extra={"mode": Mode.TRAIN})  # an int subclass: not plain
    assert names(tmp_path) == ["c"]


# --------------------------------------------------------------------------- your files, any file system (issue 29)

TOKENIZER = b'{"version": "1.0", "model": {"type": "BPE"}}\n\x00\xff'  # a user's file, compared byte for byte


def foreign_file_at_first_write(monkeypatch, target: Path) -> None:
    """Another process writes ``target/tokenizer.json`` at the moment the library writes its first data."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def racing(self, plan, planner):
        if not (target / "tokenizer.json").exists():
            target.mkdir(exist_ok=True)
            (target / "tokenizer.json").write_bytes(TOKENIZER)
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", racing)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_file_added_during_an_overwrite_is_kept_and_survives_resume_and_prune(tmp_path, monkeypatch, exchange):
    """3./8.: tokenizer.json written into the checkpoint while it is overwritten is kept under a name no clean-up
    removes, the warning says where; the save succeeds (the new checkpoint in place), and the next resume, saves
    and pruning leave it alone, with or without the atomic exchange."""
    import zeta_fsdp.files
    from zeta_fsdp.state_dict import CheckpointManager

    if not exchange:
        monkeypatch.setattr(zeta_fsdp.files, "exchange_paths", lambda a, b: False)
    root = tmp_path / "ckpt"
    torch.manual_seed(1)
    manager = CheckpointManager(root, small(), every=1, keep_last=1, preemption_signals=())
    manager.save(1)
    with monkeypatch.context() as m:
        foreign_file_at_first_write(m, root / "step_1")
        torch.manual_seed(2)
        model = small()
        manager.model = model
        with pytest.warns(UserWarning, match=r"tokenizer\.json .*kept, untouched, in .*step_1\.kept"):
            assert manager.save(1) == root / "step_1"
    assert (root / "step_1.kept" / "tokenizer.json").read_bytes() == TOKENIZER
    assert names(root / "step_1.kept") == ["tokenizer.json"], "our old files were not discarded"
    fresh = small()
    resumed = CheckpointManager(root, fresh, every=1, keep_last=1, preemption_signals=())
    assert resumed.resume() == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    for step in (2, 3):
        resumed.save(step)  # keeps one: step_1 and step_2 pruned, the kept folder never
    assert names(root) == ["step_1.kept", "step_3"]
    assert (root / "step_1.kept" / "tokenizer.json").read_bytes() == TOKENIZER
    save_checkpoint(root / "step_3", small(), overwrite=True)  # later overwrites keep working
    assert names(root) == ["step_1.kept", "step_3"]


def test_the_fallback_publish_with_a_user_file_in_the_old_checkpoint_is_a_success(tmp_path, monkeypatch):
    """8.: without renameat2, a previous checkpoint holding a user's file: the save returns (never "nothing was
    saved" with the new one in place), the file is kept, and a stale ``.replaced`` left by a crash does not
    block later overwrites."""
    import zeta_fsdp.files

    monkeypatch.setattr(zeta_fsdp.files, "exchange_paths", lambda a, b: False)
    path = tmp_path / "c"
    plain_checkpoint(path, 1)
    with monkeypatch.context() as m:
        foreign_file_at_first_write(m, path)
        with pytest.warns(UserWarning, match=r"c\.kept"):
            weights = plain_checkpoint(path, 2)
    assert_holds(path, 2, weights)
    # a crash after the second rename left the previous one, with a user's note, in .c.replaced
    (tmp_path / ".c.replaced").mkdir()
    (tmp_path / ".c.replaced" / "notes.txt").write_bytes(b"mine")
    with pytest.warns(UserWarning, match=r"notes\.txt .*c\.kept-2"):
        weights = plain_checkpoint(path, 3)
    assert_holds(path, 3, weights)
    assert names(tmp_path) == ["c", "c.kept", "c.kept-2"]
    assert (tmp_path / "c.kept-2" / "notes.txt").read_bytes() == b"mine"
    assert (tmp_path / "c.kept" / "tokenizer.json").read_bytes() == TOKENIZER


def test_is_checkpoint_only_reads(tmp_path, monkeypatch):
    """``is_checkpoint`` takes no lock and renames nothing, even after an interrupted overwrite."""
    import zeta_fsdp.files

    path = tmp_path / "c"
    plain_checkpoint(path, 1)
    path.rename(tmp_path / ".c.replaced")

    def no_lock(*a, **k):
        raise AssertionError("is_checkpoint took a lock")

    monkeypatch.setattr(zeta_fsdp.files.PathLock, "acquire", no_lock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert is_checkpoint(path)  # load_checkpoint would restore it
        assert not is_checkpoint(tmp_path / "other")
    assert names(tmp_path) == [".c.replaced"]


@pytest.mark.parametrize("err", [38, 95, 37], ids=["ENOSYS", "EOPNOTSUPP", "ENOLCK"])
def test_a_file_system_without_flock_says_so_and_leaves_no_lock_file(tmp_path, monkeypatch, err):
    """8.: flock failing (Lustre without -o flock, NFS without a lock manager): a clear error naming the file
    system problem and the ways out, before anything is written; no lock file left; the opt-out works."""
    import fcntl
    import os

    from zeta_fsdp.hf import consolidate_to_hf

    path = tmp_path / "c"
    plain_checkpoint(path, 1)
    kept = {p.name: p.read_bytes() for p in path.iterdir()}

    def no_flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(CheckpointError, match=r"does not support file locks.*-o flock.*ZETA_FSDP_FILE_LOCKS=0"):
        plain_checkpoint(path, 2)
    with pytest.raises(OSError, match=r"does not support file locks.*-o flock"):
        consolidate_to_hf(path, tmp_path / "hf")
    assert names(tmp_path) == ["c"], "a lock file or staging directory was left"
    assert {p.name: p.read_bytes() for p in path.iterdir()} == kept
    monkeypatch.setenv("ZETA_FSDP_FILE_LOCKS", "0")
    weights = plain_checkpoint(path, 2)
    consolidate_to_hf(path, tmp_path / "hf")
    assert names(tmp_path) == ["c", "hf"]
    assert_holds(path, 2, weights)


def test_consolidate_to_hf_keeps_a_file_added_meanwhile(tmp_path, monkeypatch):
    """3.: consolidate_to_hf(overwrite=True) with tokenizer.json appearing in the output at its first data write."""
    import zeta_fsdp.hf.consolidate as cons
    from zeta_fsdp.hf import consolidate_to_hf

    path, out = tmp_path / "c", tmp_path / "hf"
    plain_checkpoint(path, 1)
    consolidate_to_hf(path, out)
    write_at = cons.write_at

    def racing(*a, **k):
        if not (out / "tokenizer.json").exists():
            (out / "tokenizer.json").write_bytes(TOKENIZER)
        return write_at(*a, **k)

    monkeypatch.setattr(cons, "write_at", racing)
    with pytest.warns(UserWarning, match=r"tokenizer\.json .*hf\.kept"):
        consolidate_to_hf(path, out, overwrite=True)
    assert names(tmp_path) == ["c", "hf", "hf.kept"]
    assert names(tmp_path / "hf.kept") == ["tokenizer.json"]
    assert (tmp_path / "hf.kept" / "tokenizer.json").read_bytes() == TOKENIZER
    assert names(out) == ["model.safetensors"]


def _rewrite_metadata(path: Path, edit) -> None:
    import pickle

    from zeta_fsdp.state_dict.reader import read_metadata

    md = read_metadata(path, "test")
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _gap(md):  # the first matrix keeps only its first half of rows: the rest is covered by nothing
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    key = next(k for k, v in md.state_dict_metadata.items() if k.startswith("model.") and len(v.size) == 2)
    (chunk,) = md.state_dict_metadata[key].chunks
    half = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
    md.state_dict_metadata[key].chunks = [ChunkStorageMetadata(chunk.offsets, half)]


def _overlap(md):  # two chunks, rows [0, 3n/4) and [n/2, 3n/4): the volumes add up, rows overlap and a gap stays
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    key = next(k for k, v in md.state_dict_metadata.items() if k.startswith("model.") and len(v.size) == 2)
    (chunk,) = md.state_dict_metadata[key].chunks
    n, rest = chunk.sizes[0], list(chunk.sizes[1:])
    at = torch.Size([n // 2, *[0] * len(rest)])
    md.state_dict_metadata[key].chunks = [
        ChunkStorageMetadata(chunk.offsets, torch.Size([3 * n // 4, *rest])),
        ChunkStorageMetadata(at, torch.Size([n // 4, *rest])),
    ]
    md.storage_data[MetadataIndex(key, at)] = md.storage_data[MetadataIndex(key, chunk.offsets)]


@pytest.mark.parametrize("edit", [_gap, _overlap], ids=["gap", "overlap"])
def test_chunks_must_cover_each_tensor_exactly(tmp_path, edit):
    """4.: a .metadata whose chunks leave part of a tensor uncovered (or overlap): every reader refuses before
    anything changes or is written."""
    from zeta_fsdp.hf import consolidate_to_hf

    path = tmp_path / "c"
    plain_checkpoint(path, 1)
    _rewrite_metadata(path, edit)
    needle = r"inconsistently: its (chunks hold \d+ of its \d+ elements|chunks at offsets .* overlap)"
    for strict in (True, False):
        torch.manual_seed(5)
        model = small()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointError, match=needle):
            load_checkpoint(path, model, strict=strict)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "the model changed"
    with pytest.raises(CheckpointError, match=needle):
        consolidate_checkpoint(path, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match=needle):
        consolidate_to_hf(path, tmp_path / "hf")
    assert not is_checkpoint(path)
    assert names(tmp_path) == ["c"]


def test_zero_padded_step_directories_are_found_and_pruned_by_their_real_names(tmp_path):
    """6.: step_000300 is returned as step_000300 (not a step_300 that does not exist) and pruning deletes it."""
    from zeta_fsdp.state_dict import latest_checkpoint, prune_checkpoints

    for step in (100, 200, 300):
        plain_checkpoint(tmp_path / f"step_{step:06d}", step)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000300"
    assert prune_checkpoints(tmp_path, keep_last=1) == [tmp_path / "step_000100", tmp_path / "step_000200"]
    assert names(tmp_path) == ["step_000300"]


def test_consolidate_cli_hf_only_options_and_huge_sizes(tmp_path, capsys):
    """Issue 29 §9: --dtype / --config / --max-shard-size without --hf are refused (not ignored); a metadata
    declaring a size no machine can allocate is one line and exit 2, not a traceback."""
    path = tmp_path / "c"
    plain_checkpoint(path, 1)
    for extra in (["--dtype", "bf16"], ["--config", str(tmp_path)], ["--max-shard-size", "1MB"]):
        assert cli.main(["consolidate", str(path), str(tmp_path / "o.pt"), *extra]) == 2
        err = capsys.readouterr().err
        assert f"{extra[0]} apply(ies) to --hf output only" in err and err.count("\n") == 1, err
        assert names(tmp_path) == ["c"]

    def huge(md) -> None:
        key = next(k for k, v in md.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size"))
        md.state_dict_metadata[key].size = torch.Size([2**40, 2**30])

    _rewrite_metadata(path, huge)
    for argv in (["consolidate", str(path), str(tmp_path / "o.pt")], ["consolidate", str(path), "o", "--hf"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        # refused by the size check, or first by the chunk-coverage check (the crafted size is not covered)
        assert str(path) in err and ("too large" in err or "inconsistently" in err) and err.count("\n") == 1, err
    assert names(tmp_path) == ["c"]


def test_a_pickle_in_a_tensor_record_is_a_checkpoint_error(tmp_path, capsys):
    """Issue 29 §9: consolidate_to_hf / consolidate --hf on a record holding a pickle: CheckpointError, exit 2,
    nothing runs."""
    import dataclasses
    import io

    from zeta_fsdp.hf import consolidate_to_hf
    from zeta_fsdp.state_dict.reader import read_metadata

    path, marker = tmp_path / "c", tmp_path / "PWNED"
    plain_checkpoint(path, 1)
    md = read_metadata(path, "test")
    index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn.startswith("model."))
    shard = path / info.relative_path
    buffer = io.BytesIO()
    torch.save(_Payload(marker), buffer)  # a torch.save record whose pickle would run code
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + buffer.getvalue())
    _rewrite_metadata(
        path,
        lambda m: m.storage_data.update(
            {index: dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))}
        ),
    )
    with pytest.raises(CheckpointError, match="failed") as caught:
        consolidate_to_hf(path, tmp_path / "out_hf")
    assert str(path) in str(caught.value)
    assert cli.main(["consolidate", str(path), str(tmp_path / "o"), "--hf"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not marker.exists() and names(tmp_path) == ["c"]

"""``scripts/torch_versions.py`` (docs/install.md's table) and ``tests/cross_torch.txt`` (what CI and
the table run on other torch releases): the pieces that need no venv."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("torch_versions", ROOT / "scripts" / "torch_versions.py")
torch_versions = importlib.util.module_from_spec(_spec)
sys.modules["torch_versions"] = torch_versions  # its dataclass looks its module up there
_spec.loader.exec_module(torch_versions)


def test_cross_torch_list_names_existing_test_files():
    tests = torch_versions.cross_torch_tests()
    assert "tests/test_fsdp_dist.py" in tests and "tests/test_torch_compat.py" in tests
    for path in tests:
        assert (ROOT / path).is_file(), path
    assert len(set(tests)) == len(tests)


def test_ci_runs_the_cross_torch_list_on_the_newest_release():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tests/cross_torch.txt" in ci and "NEWEST_TORCH=" in ci
    assert "tests/test_timm.py" in ci  # timm needs a torchvision matching torch: only that environment has one


def test_table_says_what_ran_and_what_failed():
    outcomes = [
        torch_versions.Outcome("2.10.0", "2.10.0+cu128", passed=3, failed=["test_a::test_x"], minutes=1.25),
        torch_versions.Outcome("2.9.1", error="could not install: no such release"),
    ]
    text = torch_versions.table(outcomes, ["tests/test_a.py"], "python scripts/torch_versions.py 2.10.0 2.9.1", "idle")
    lines = text.splitlines()
    assert "tests run: `test_a.py`" in lines[0]
    assert lines[1] == "Made by `python scripts/torch_versions.py 2.10.0 2.9.1` (idle)."
    assert "| 2.10.0+cu128 | 3 | 1 | 0 | 1.2 | `test_a::test_x` |" in lines
    assert "| 2.9.1 | - | - | - | - | could not install: no such release |" in lines


def test_write_table_replaces_only_between_the_markers(tmp_path):
    doc = tmp_path / "install.md"
    begin, end = torch_versions.BEGIN, torch_versions.END
    doc.write_text(f"before\n{begin}\nold table\n{end}\nafter\n")
    torch_versions.write_table(doc, "new table")
    assert doc.read_text() == f"before\n{begin}\nnew table\n{end}\nafter\n"
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- torch-versions:begin -->"):
        torch_versions.write_table(tmp_path / "plain.md", "x")
    assert (tmp_path / "plain.md").read_text() == "no markers\n"


def test_install_doc_holds_a_generated_table_of_the_cross_torch_list():
    text = (ROOT / "docs" / "install.md").read_text()
    table = text[text.index(torch_versions.BEGIN) : text.index(torch_versions.END)]
    for path in torch_versions.cross_torch_tests():
        assert f"`{path.split('/')[-1]}`" in table, path
    assert "Made by `python scripts/torch_versions.py" in table

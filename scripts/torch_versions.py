"""Run the test suite (or a stated subset) on several torch releases and write docs/install.md's table.

One virtual environment per release (``VENVS/torch-<version>``, reused when it already holds that
release): ``pip install torch==<version>``, then ``pip install torch==<version> -e .[test]`` (this
checkout and its test extra; the pin keeps the torch just installed), then pytest. The table says, per release, the
torch build that ran, how many tests passed and which failed, with the date and the command.

    python scripts/torch_versions.py 2.10.0 2.13.0 2.15.0                 # tests/cross_torch.txt
    python scripts/torch_versions.py 2.13.0 --tests all                  # the whole suite
    python scripts/torch_versions.py 2.10.0 --write docs/install.md      # rewrite the table

PyPI's Linux wheels are CUDA builds (a few GB of ``nvidia-*`` packages per release; they run on
CPU). ``PIP_CONSTRAINT=/dev/null`` lifts a machine-wide constraints file that caps torch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CROSS_TORCH = ROOT / "tests" / "cross_torch.txt"
BEGIN, END = "<!-- torch-versions:begin -->", "<!-- torch-versions:end -->"


@dataclass
class Outcome:
    version: str  # as asked, e.g. 2.10.0
    build: str = ""  # torch.__version__ in the venv, e.g. 2.10.0+cu128
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: int = 0
    minutes: float = 0.0
    error: str = ""  # the venv could not be made or pytest did not run


def cross_torch_tests() -> list[str]:
    """The paths tests/cross_torch.txt lists (comments and blank lines dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in CROSS_TORCH.read_text().splitlines())
    return [line for line in lines if line]


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PIP_CONSTRAINT"] = "/dev/null"  # a machine-wide constraints file may cap torch
    return env


def _installed_torch(python: Path) -> str:
    if not python.exists():
        return ""
    proc = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, cwd="/"
    )
    return proc.stdout.strip() if proc.returncode == 0 else ""


def prepare(version: str, venvs: Path) -> Path:
    """The venv's python, holding ``torch==version``, the test packages and this checkout."""
    venv = venvs / f"torch-{version}"
    python = venv / "bin" / "python"
    if _installed_torch(python).split("+")[0] != version:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", f"torch=={version}"], check=True, env=_pip_env()
        )
    # This checkout with its test extra; torch named with its pin so the extra cannot move it.
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, f"torch=={version}", "-e", f"{ROOT}[test]"], check=True, env=_pip_env())
    return python


def run_tests(python: Path, tests: list[str], report: Path) -> tuple[int, list[str], int]:
    """(passed, failed test ids, skipped) of one pytest run, read from its JUnit XML report."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests]
    subprocess.run(cmd, cwd=ROOT, env=env)
    passed, failed, skipped = 0, [], 0
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def measure(version: str, venvs: Path, tests: list[str]) -> Outcome:
    outcome = Outcome(version)
    try:
        python = prepare(version, venvs)
    except subprocess.CalledProcessError as e:
        outcome.error = f"could not install: {e}"
        return outcome
    outcome.build = _installed_torch(python)
    start = time.monotonic()
    report = venvs / f"torch-{version}.junit.xml"
    try:
        outcome.passed, outcome.failed, outcome.skipped = run_tests(python, tests, report)
    except (ET.ParseError, FileNotFoundError) as e:
        outcome.error = f"pytest wrote no report: {e}"
    outcome.minutes = (time.monotonic() - start) / 60
    return outcome


def table(outcomes: list[Outcome], tests: list[str], command: str, note: str = "") -> str:
    """The markdown docs/install.md shows between its markers."""
    today = datetime.date.today().isoformat()
    what = "the whole suite (`tests/`)" if tests == ["tests"] else ", ".join(f"`{Path(t).name}`" for t in tests)
    lines = [
        f"Measured {today} on Linux, CPU (gloo), Python {sys.version_info.major}.{sys.version_info.minor}, "
        f"one fresh virtual environment per release; tests run: {what}.",
        f"Made by `{command}`" + (f" ({note})." if note else "."),
        "",
        "| torch | passed | failed | skipped | minutes | failing tests |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        if o.error:
            lines.append(f"| {o.version} | - | - | - | - | {o.error} |")
            continue
        failing = ", ".join(f"`{name}`" for name in o.failed[:8]) + (" ..." if len(o.failed) > 8 else "")
        lines.append(
            f"| {o.build or o.version} | {o.passed} | {len(o.failed)} | {o.skipped} | {o.minutes:.1f} | {failing or '-'} |"
        )
    return "\n".join(lines)


def write_table(doc: Path, text: str) -> None:
    """Replace what stands between the markers in ``doc`` (the rest of the file is kept)."""
    content = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(content):
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers to write the table between")
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", content))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", help="torch releases, e.g. 2.10.0 2.13.0 2.15.0")
    parser.add_argument(
        "--tests",
        nargs="+",
        default=["cross"],
        help="'cross' (tests/cross_torch.txt, the default), 'all' (tests/), or test paths",
    )
    parser.add_argument("--venvs", type=Path, default=ROOT / ".venvs", help="where the per-release venvs live")
    parser.add_argument("--write", type=Path, help="a markdown file to write the table into (between its markers)")
    parser.add_argument("--note", default="", help="said after the command, e.g. how loaded the machine was")
    args = parser.parse_args(argv)
    tests = {"cross": cross_torch_tests(), "all": ["tests"]}.get(args.tests[0], args.tests)
    args.venvs.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for version in args.versions:
        print(f"== torch {version}", flush=True)
        outcomes.append(measure(version, args.venvs, tests))
    command = "python scripts/torch_versions.py " + " ".join(
        [*args.versions, *(["--tests", *args.tests] if args.tests != ["cross"] else [])]
    )
    text = table(outcomes, tests, command, args.note)
    print(text)
    if args.write is not None:
        write_table(args.write, text)
    return 0 if all(not o.error and not o.failed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

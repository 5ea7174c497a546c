"""Shared test helpers: launch real gloo ranks with torchrun, as users do."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests import zeta_fsdp.models.gpt, as users run them from the repo root

# CPU tests stay on CPU on a GPU host: fsdp() would otherwise pick cuda:LOCAL_RANK (and 2 ranks need 2
# GPUs). Hidden before anything initialises CUDA, for this process and every process it starts; the
# GPU tests (tests/test_gpu.py) give the original visibility back to the processes they start.
_CUDA_UNSET = "<unset>"
_ORIGINAL_CUDA = os.environ.get("ZETA_TEST_ORIGINAL_CUDA_VISIBLE_DEVICES")
if _ORIGINAL_CUDA is None:
    _ORIGINAL_CUDA = os.environ.get("CUDA_VISIBLE_DEVICES", _CUDA_UNSET)
    os.environ["ZETA_TEST_ORIGINAL_CUDA_VISIBLE_DEVICES"] = _ORIGINAL_CUDA
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def gpu_env() -> Optional[dict[str, str]]:
    """``rank_env()`` with the GPUs this session started with visible again (``None`` when it hid them itself:
    ``CUDA_VISIBLE_DEVICES=''`` from the user)."""
    if _ORIGINAL_CUDA == "":
        return None
    env = rank_env()
    if _ORIGINAL_CUDA == _CUDA_UNSET:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = _ORIGINAL_CUDA
    return env


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def torchrun(nproc: int, script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` local ranks (fresh processes, free port) and return the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=timeout)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "launch: starts processes (torchrun ranks, scripts, pip); the fast tier `pytest -m 'not launch'` skips it",
    )
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/test_gpu.py); skipped cleanly without one")


_running: dict[str, object] = {"item": None}
_popen_init = subprocess.Popen.__init__


def _popen_if_marked(self, *args, **kwargs):
    """Keep the ``launch`` marker honest: a test without it whose body or fixtures start a process
    fails, naming itself, so the fast tier (``-m "not launch"``) stays in-process and fast."""
    item = _running["item"]
    if item is not None and item.get_closest_marker("launch") is None:
        raise AssertionError(f"{item.nodeid} starts a process: mark it @pytest.mark.launch")
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _popen_if_marked


def launches(fixture_function: Callable) -> Callable:
    """Decorate a fixture (under ``@pytest.fixture``) that starts processes: every test using it is ``launch``."""
    fixture_function.launches = True
    return fixture_function


def pytest_collection_modifyitems(config, items):
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        chains = defs.name2fixturedefs.values() if defs is not None else ()
        if any(getattr(d.func, "launches", False) for chain in chains for d in chain):
            item.add_marker(pytest.mark.launch)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = item  # fixtures of any scope are set up inside the item that first needs them
    try:
        yield
    finally:
        _running["item"] = None


def program_lines(stdout: str) -> list[str]:
    """A process's stdout lines as the program printed them: without the connection notices some
    torch releases' gloo prints to stdout when a group starts (torch 2.10:
    ``[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0``)."""
    return [line for line in stdout.splitlines() if not line.startswith("[Gloo] ")]


def run_concurrent_writers(path: Path, n: int, out: Path, *mode: str) -> dict[int, list[str]]:
    """Two processes, ``n`` saves each to ``path`` at once (``tests/concurrent_save.py``); each one's
    per-call results (``"ok"`` or the error it raised), keyed by writer 1 and 2."""
    script = str(ROOT / "tests" / "concurrent_save.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(path), str(w), str(n), str(out / f"w{w}.json"), *mode],
            cwd=ROOT,
            env=rank_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in (1, 2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return {w: json.loads((out / f"w{w}.json").read_text()) for w in (1, 2)}


NOT_RUN = "NOT RUN"  # worker.NOT_RUN: a case its launch stopped before (another case failed)


def _launch_once(out: Path, nproc: int, script: str, cases: list[str], args: tuple, timeout: float):
    argv = ["--out", str(out), "--cases", ",".join(cases), *args]
    if nproc == 1:
        cmd = [sys.executable, script, *argv]
        proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=timeout)
    else:
        proc = torchrun(nproc, script, *argv, timeout=timeout)
    per_rank = []
    for r in range(nproc):
        f = out / f"rank{r}.json"
        per_rank.append(json.loads(f.read_text()) if f.exists() else {})
    return per_rank, proc


def _reported(per_rank: list[dict], case: str) -> bool:
    """Some rank ran ``case`` to a result (so relaunching it would only repeat that result)."""
    return any(case in res and not str(res[case]).startswith(NOT_RUN) for res in per_rank)


def launch_worker(
    out: Path,
    nproc: int,
    worker: str,
    cases: list[str],
    *args: str,
    timeout: float = 600,
    allow_exit_code: bool = False,
) -> tuple[list[dict], subprocess.CompletedProcess]:
    """Run ``cases`` of ``tests/<worker>`` in one launch; return (each rank's results, the process).

    One rank runs as a plain ``python`` process (the one-process group ``fsdp()`` starts in a
    notebook); more go through ``torchrun``. A case that fails on one rank stops the launch on
    every rank (see ``worker.run_cases``); the cases it did not reach are launched again, so every
    case reports its own result. A case a rank never reported (the rank died) reads as that
    rank's launch output. The launch must exit 0 unless ``allow_exit_code`` (a rank killed on
    purpose); a launch whose ranks report nothing at all raises with its output.
    """
    script = str(ROOT / "tests" / worker)
    per_rank: list[dict] = [{} for _ in range(nproc)]
    todo, proc, attempt = list(cases), None, 0
    while todo:
        launch_out = out if attempt == 0 else out / f"relaunch{attempt}"
        got, proc = _launch_once(launch_out, nproc, script, todo, args, timeout)
        progress = [c for c in todo if _reported(got, c)]
        # Every rank reported every case, yet the launch failed: a crash at teardown, which is
        # a real bug (see DESIGN.md on gloo teardown), not something to relaunch around.
        complete = all(c in res and not str(res[c]).startswith(NOT_RUN) for res in got for c in todo)
        if not progress or (complete and proc.returncode != 0 and not allow_exit_code):
            raise AssertionError(
                f"launch of {worker} on {nproc} rank(s) failed (rc={proc.returncode}) running {todo}:\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            )
        for r, res in enumerate(got):
            for case in progress:
                per_rank[r][case] = res.get(
                    case, f"rank {r} did not report this case (it died):\n{proc.stderr[-3000:]}"
                )
        todo = [c for c in todo if c not in progress]
        attempt += 1
    return per_rank, proc


def merge_ranks(per_rank: list[dict], cases: list[str]) -> dict[str, str]:
    """{case: "ok" if every rank passed it, else the failing ranks' tracebacks}."""
    results = {}
    for name in cases:
        failures = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "ok"]
        results[name] = "ok" if not failures else "\n".join(failures)
    return results


def run_dist(tmp_path: Path, nproc: int, worker: str, cases: list[str], timeout: float = 600) -> dict[str, str]:
    """Run ``cases`` of ``worker`` in one launch; return {case: "ok" or the failing ranks' tracebacks}."""
    per_rank, _ = launch_worker(tmp_path / f"results_{nproc}", nproc, worker, cases, timeout=timeout)
    return merge_ranks(per_rank, cases)


def check_case(results: dict[str, str], case: str) -> None:
    """One case of a launch passed on every rank (else: the failing ranks' tracebacks)."""
    assert results[case] == "ok", results[case]


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="session")
def dist_results(session_tmp) -> Callable[[str, int, list[str]], dict[str, str]]:
    """``dist_results(worker, nproc, cases)``: the results of one launch, made at the first call.

    Each launch runs in ``session_tmp/<worker's stem>``; a failed launch fails every test that
    asks for it, without launching again.
    """
    launched: dict[tuple, object] = {}

    def results(worker: str, nproc: int, cases: list[str]) -> dict[str, str]:
        key = (worker, nproc, tuple(cases))
        if key not in launched:
            try:
                launched[key] = run_dist(session_tmp / Path(worker).stem, nproc, worker, cases)
            except AssertionError as e:
                launched[key] = e
        if isinstance(launched[key], AssertionError):
            raise launched[key]
        return launched[key]

    return results


def worker_cases(worker: str, ranks: int, group: str = "") -> list[str]:
    """The case names ``tests/<worker>`` registers for ``ranks`` ranks in ``group`` (``@case(ranks=..., group=...)``)."""
    module = importlib.import_module(Path(worker).stem)  # tests/ is on sys.path; main() is guarded
    return module.CASES.names(ranks, group)


def dist_test(worker: str, nproc: int, cases: Optional[list[str]] = None, group: str = "") -> Callable:
    """A test with one id per case, all run by one launch of ``worker`` on ``nproc`` ranks.

    ``cases`` defaults to every case the worker registers for ``nproc`` ranks in ``group``, so a
    case is named once, where it is written. Example (in a test module):
    ``test_two_ranks = dist_test("dist_cases.py", 2)``.
    """
    cases = worker_cases(worker, nproc, group) if cases is None else cases

    @pytest.mark.launch
    @pytest.mark.parametrize("case", cases)
    def test(dist_results, case):
        check_case(dist_results(worker, nproc, cases), case)

    test.__doc__ = f"{worker} on {nproc} ranks: the case passed on every rank."
    return test

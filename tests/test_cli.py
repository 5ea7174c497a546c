"""`python -m zeta_fsdp demo | plan | consolidate`: the demo end to end, bad input, Ctrl-C with no orphan rank."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, launches, rank_env

from zeta_fsdp.cli import main

DEMO_STEPS = 3


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "zeta_fsdp", *args]
    return subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=timeout)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------ demo, end to end at 2 ranks


@pytest.fixture(scope="module")
@launches
def demo(tmp_path_factory):
    plot = tmp_path_factory.mktemp("demo") / "memory.png"
    extra = ["--plot", str(plot)] if _has_matplotlib() else []
    proc = run_cli("demo", "--nproc", "2", "--steps", str(DEMO_STEPS), *extra)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    rows = {}
    for line in proc.stdout.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] in ("FULL_SHARD", "SHARD_GRAD", "NO_SHARD", "HYBRID_SHARD"):
            rows[cells[0]] = cells
    return proc, rows, plot if extra else None


@pytest.mark.launch
def test_demo_table_has_every_strategy(demo):
    proc, rows, _ = demo
    assert list(rows) == ["FULL_SHARD", "SHARD_GRAD", "NO_SHARD"], proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.startswith("strategy"))
    for column in (f"loss 1st -> {DEMO_STEPS}", "params", "grads", "optim", "gathered", "peak", "step ms"):
        assert column in header


def test_demo_losses_are_equal_and_falling(demo):
    proc, rows, _ = demo
    pairs = [tuple(map(float, row[1].split(" -> "))) for row in rows.values()]
    finals = [final for _, final in pairs]
    assert max(finals) - min(finals) <= 1e-4, pairs
    assert all(final < first for first, final in pairs), f"training did not lower the loss: {pairs}"
    assert f"loss after {DEMO_STEPS} steps: equal across strategies" in proc.stdout


def test_demo_memory_and_collectives(demo):
    _, rows, _ = demo
    params = {name: float(row[2]) for name, row in rows.items()}
    optim = {name: float(row[4]) for name, row in rows.items()}
    # 2 ranks: FULL_SHARD holds half the parameters (+ one padded embedding row) of NO_SHARD.
    assert params["FULL_SHARD"] == params["SHARD_GRAD"]
    assert 0.49 < params["FULL_SHARD"] / params["NO_SHARD"] < 0.51
    assert 0.49 < optim["FULL_SHARD"] / optim["NO_SHARD"] < 0.51
    collectives = {name: row[-1] for name, row in rows.items()}
    assert "AG" in collectives["FULL_SHARD"] and "RS" in collectives["FULL_SHARD"], collectives
    assert "AG" not in collectives["NO_SHARD"] and "AR" in collectives["NO_SHARD"], collectives
    # ZeRO-3 re-gathers in backward what ZeRO-2 kept: more all-gathers per step.
    ag = {n: int(re.search(r"(\d+) AG", c).group(1)) for n, c in collectives.items() if "AG" in c}
    assert ag["FULL_SHARD"] > ag["SHARD_GRAD"], collectives


def test_demo_says_where_it_runs_and_what_strategies_are(demo):
    proc, _, _ = demo
    import torch

    device, backend = (
        ("CUDA", "nccl") if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else ("CPU", "gloo")
    )
    assert f"launching 2 rank(s) on {device} ({backend})" in proc.stderr, proc.stderr
    assert f"on 2 {device} rank(s) ({backend})" in proc.stdout, proc.stdout
    assert "(FULL_SHARD = ZeRO-3, SHARD_GRAD = ZeRO-2, NO_SHARD = DDP-like)" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "available, count, nproc, expected",
    [
        (False, 0, 2, ("cpu", "gloo")),
        (True, 2, 2, ("cuda", "nccl")),
        (True, 8, 1, ("cuda", "nccl")),
        (True, 1, 2, ("cpu", "gloo")),  # fewer GPUs than ranks: CPU
    ],
)
def test_demo_device_choice(monkeypatch, available, count, nproc, expected):
    import torch

    from zeta_fsdp.cli.demo import demo_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert demo_device(nproc) == expected


def test_demo_ranks_get_the_chosen_device(monkeypatch):
    """On a GPU machine the launcher hands ``--device cuda`` to the ranks and says so (no GPU needed)."""
    import io

    import zeta_fsdp.cli.demo as demo

    launched = []

    def fake_launch(cmd, workdir, timeout_s):
        launched.append(cmd)
        shutil.rmtree(workdir)  # a failed run keeps its folder for the log: leave nothing behind
        return 1  # as if the ranks failed: nothing runs

    monkeypatch.setattr(demo, "demo_device", lambda nproc: ("cuda", "nccl"))
    monkeypatch.setattr(demo, "_launch_and_wait", fake_launch)
    log = io.StringIO()
    with pytest.raises(demo.DemoError):
        demo.run_demo(nproc=2, steps=1, log=log)
    assert launched[0][-2:] == ["--device", "cuda"], launched[0]
    assert "launching 2 rank(s) on CUDA (nccl)" in log.getvalue()
    row = {"strategy": "FULL_SHARD", "loss_first": 1.0, "loss_final": 0.5, "memory": {}, "step_seconds": 0.1}
    result = {"model": "GPT", "nproc": 2, "steps": 1, "mp": "fp32", "device": "cuda", "backend": "nccl"}
    table = demo.format_table({**result, "rows": [{**row, "collectives": {}}]})
    assert "on 2 CUDA rank(s) (nccl)" in table


def test_demo_output_is_clean_without_a_tty(demo):
    proc, _, _ = demo
    assert "\r" not in proc.stdout + proc.stderr, "progress-bar control characters in a non-TTY log"
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib is not installed")
def test_demo_plot_is_a_png(demo):
    _, _, plot = demo
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ plan CLI


@pytest.mark.launch
def test_plan_cli_dry_run_matches_at_1024_ranks(capsys):
    code = main(
        [
            "plan",
            "zeta_fsdp.models.gpt:small",
            "dim=512",
            "n_heads=8",
            "n_layers=4",
            "vocab_size=50257",
            "max_seq_len=1024",
            "--world-size",
            "1024",
            "--shard-strat",
            "HYBRID_SHARD",
            "--mp",
            "bf16",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "HYBRID_SHARD on 1024 ranks: mesh 128x8" in out
    assert "blocks.0 .. blocks.3 (x4)" in out
    assert "-> matches the plan" in out, out  # plan(dry_run=True): the fake-group run agrees
    match = re.search(r"sharded parameter bytes on rank 0: ([\d,]+)", out)
    # By hand, elements per rank with 8-way sharding of dim 0 (rows padded up: ceil(rows / 8)):
    norms = 2 * (64 + 64)  # two LayerNorms (weight + bias) of 512
    attention = 192 * 512 + 64 * 512 + 64  # qkv 1536x512, proj 512x512 + bias
    mlp = 256 * 512 + 256 + 64 * 2048 + 64  # 2048x512 + bias, 512x2048 + bias
    embeddings = 6283 * 512 + 128 * 512 + 64 + 64  # tok_emb 50257 rows (tied head), pos_emb 1024, final norm
    expected = 4 * (4 * (norms + attention + mlp) + embeddings)  # fp32 bytes, 4 blocks
    assert int(match.group(1).replace(",", "")) == expected


def test_plan_cli_json(capsys):
    import json

    assert main(["plan", "zeta_fsdp.models.gpt:small", "--world-size", "2", "--no-dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["param_bytes"] == 69960 and data["world_size"] == 2 and data["dry_run"] is None


def test_plan_cli_micro_batches(capsys):
    argv = ["plan", "zeta_fsdp.models.gpt:small", "--world-size", "4", "--shard-strat", "HYBRID_SHARD"]
    assert main([*argv, "--replicate-size", "2", "--no-dry-run", "--micro-batches", "3"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith('no_sync(defer="all_reduce")'))
    assert row.split()[-4:] == ["68.32", "KiB", "12", "4"], row  # sharded grads, 3 x 4 reduce-scatters, 4 all-reduces


# ------------------------------------------------------------------ bad input: one line, exit code 2

BAD_INPUT = [
    (["bogus"], "invalid choice: 'bogus'"),
    (["demo", "--nproc", "0"], "--nproc must be an int from 1 to 32, got '0'"),
    (["demo", "--nproc", "-3"], "--nproc must be an int from 1 to 32, got '-3'"),
    (["demo", "--nproc", "two"], "--nproc must be an int from 1 to 32, got 'two'"),
    (["demo", "--nproc", "4096"], "--nproc must be an int from 1 to 32, got '4096'"),
    (["demo", "--steps", "0"], "--steps must be an int from 1 to 1000"),
    (["demo", "--mp", "int8"], "accepted (case-insensitive): fp32,"),
    (["demo", "--plot", "/no/such/folder/x.png"], "does not exist"),
    (["plan", "examples.nope:small"], "cannot import 'examples.nope'"),
    (["plan", "zeta_fsdp.models.gpt:nope"], "has no attribute 'nope'"),
    (["plan", "no.colon.or.config"], "MODEL is 'package.module:factory'"),
    (["plan", "zeta_fsdp.models.gpt:small", "bogus=1"], "unexpected keyword argument 'bogus'"),
    (["plan", "zeta_fsdp.models.gpt:small", "notkeyvalue"], "is not KEY=VALUE"),
    (["plan", "zeta_fsdp.models.gpt:small", "--shard-strat", "ZERO4"], "accepted (case-insensitive): FULL_SHARD,"),
    (["plan", "zeta_fsdp.models.gpt:small", "--mp", "int8"], "accepted (case-insensitive): fp32,"),
    (["plan", "zeta_fsdp.models.gpt:small", "--world-size", "0"], "--world-size must be an int from 1 to"),
    (["plan", "zeta_fsdp.models.gpt:small", "--micro-batches", "0"], "--micro-batches must be an int from 1 to"),
    (["plan", "zeta_fsdp.models.gpt:small", "--world-size", "2", "--rank", "2"], "Accepted: an int in [0, 1]"),
    (["plan", "zeta_fsdp.models.gpt:small", "--block", "Nope"], "matches no submodule"),
    (["plan", "/no/such/config.json"], "no config file"),
    (["bench"], "invalid choice: 'bench'"),  # benchmarks are repository scripts: benchmarks/README.md
]


@pytest.mark.parametrize("argv, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_in_process(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err, err
    assert "launching" not in err, "ranks were launched for bad input"


@pytest.mark.launch
def test_plan_finds_a_model_in_the_current_folder(tmp_path):
    """``plan mymodels:build`` imports ./mymodels.py, as ``python -m`` would, dry run included."""
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\n\n"
        "def build(width=8):\n"
        "    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))\n"
    )
    cmd = [sys.executable, "-m", "zeta_fsdp", "plan", "mymodels:build", "width=16", "--world-size", "2", "--json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    # fp32, 2 ranks, one unit: weights 16x16 and 4x16 split by rows (8 + 2 rows), biases 16 and 4 (8 + 2).
    assert data["param_bytes"] == 4 * (8 * 16 + 8 + 2 * 16 + 2)
    assert data["dry_run_matches"] is True, data["dry_run"]


@pytest.mark.launch
def test_bad_input_real_process():
    proc = run_cli("plan", "examples.nope:small", timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert main(["demo", "--plot", str(tmp_path / "m.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "m.png").exists()
    assert err.strip() == (
        "python -m zeta_fsdp demo: error: --plot needs matplotlib, which is not installed (pip install matplotlib)."
    )


def test_hf_config_without_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: import raises
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    for spec in (str(config), "LlamaConfig"):
        code = main(["plan", spec])
        assert code == 2


# ------------------------------------------------------------------ Ctrl-C: every rank stops


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found += [child]
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _is_rank(pid: int) -> bool:
    try:
        return b"zeta_fsdp.cli.demo_rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.launch
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the rank processes")
def test_sigint_stops_every_rank():
    cmd = [sys.executable, "-m", "zeta_fsdp", "demo", "--nproc", "2", "--steps", "1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        ranks: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:
            tree = _tree(proc.pid)
            ranks = [p for p in tree if _is_rank(p)]
            # torchrun itself has the rank module in its command line too: launcher + 2 ranks
            if len(ranks) >= 3:
                break
            time.sleep(0.2)
        assert len(ranks) >= 3, f"ranks did not start: {ranks}"
        time.sleep(1)  # let the ranks get into process-group set-up
        tree = _tree(proc.pid)
        assert len([p for p in tree if _is_rank(p)]) >= 3
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted", err
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.1)
    left = [p for p in tree if _alive(p)]
    assert not left, f"processes left after Ctrl-C: {left}"


def test_a_failing_rank_is_reported_in_one_line(tmp_path):
    from zeta_fsdp.cli.demo import _failure_summary

    (tmp_path / "error_rank1.txt").write_text("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")
    line = _failure_summary(tmp_path, 1)
    assert line == f"rank1 failed: RuntimeError: boom (full log: {tmp_path / 'launcher.log'})"
    (tmp_path / "error_rank1.txt").unlink()
    assert _failure_summary(tmp_path, -15).startswith("the ranks exited with code -15")

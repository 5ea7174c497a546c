"""Stress run of the main job: ``python -m zeta_fsdp demo`` many times while other processes keep the cores busy.

Issue 18 (9): the demo aborted with SIGABRT ("terminate called without an active exception") on
rank 1 at exit, in 2 of 11 runs on a loaded machine. This script runs the demo ``--runs`` times as
users start it (``python -m zeta_fsdp demo --nproc 2 --steps 2``), with ``--burners`` processes
spinning on the CPU meanwhile, and counts runs that did not end cleanly: a non-zero exit, or
"terminate called" / "Aborted" / a signal anywhere in the output or the ranks' log. Bounded: the
burners are stopped when the runs end (or on Ctrl-C), each run has a timeout. With ``--out`` it
writes ``results/demo_stress.md`` (the figures, the command, the machine's load).

    python benchmarks/stress_demo.py --runs 30 --burners 2 --out benchmarks/results

``--rank-module`` runs ``torch.distributed.run`` on a rank program directly instead (to compare
variants of the teardown); ``--jobs J`` runs J launches side by side (more contention).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ABORT = re.compile(r"terminate called|Aborted|SIGABRT|Signal 6|exitcode\s*:\s*-6|core dumped")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def one_run(index: int, timeout_s: float, rank_module: str) -> dict:
    """One demo run; what it printed (and the ranks' log it points to, on failure) checked for an abort."""
    start = time.monotonic()
    cwd = ROOT
    if rank_module:
        workdir = tempfile.mkdtemp(prefix="zeta_stress_")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--module"]
        cmd += [rank_module, "--out", workdir, "--steps", "2", "--mp", "fp32", "--device", "cpu"]
        cwd = Path(workdir)  # a core dump (when enabled) lands beside the run's files, not in the repository
    else:
        cmd = [sys.executable, "-m", "zeta_fsdp", "demo", "--nproc", "2", "--steps", "2"]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
    log = re.search(r"full log: (\S+?)\)", text)
    if log and Path(log.group(1)).is_file():
        text += Path(log.group(1)).read_text(errors="replace")
    aborted = bool(_ABORT.search(text))
    lines = [line for line in text.splitlines() if _ABORT.search(line)]
    if rank_module and not aborted and code == 0:
        import shutil

        shutil.rmtree(cwd, ignore_errors=True)  # kept only when it holds the evidence of a failure
    return {"run": index, "code": code, "aborted": aborted, "seconds": time.monotonic() - start, "lines": lines[:3]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--burners", type=int, default=2, help="processes spinning on the CPU meanwhile")
    parser.add_argument("--jobs", type=int, default=1, help="demo launches side by side")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--rank-module", default="", help="run this rank module under torchrun instead of the demo")
    parser.add_argument("--out", type=Path, help="write demo_stress.md there")
    args = parser.parse_args(argv)
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(args.burners)
    ]
    load_before = os.getloadavg()
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = []
            for row in pool.map(lambda i: one_run(i, args.timeout, args.rank_module), range(1, args.runs + 1)):
                rows.append(row)
                state = "ABORT" if row["aborted"] else ("ok" if row["code"] == 0 else f"exit {row['code']}")
                print(f"run {row['run']:3d}: {state} ({row['seconds']:.0f} s) {' | '.join(row['lines'])}", flush=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    load_after = os.getloadavg()
    failed = [r for r in rows if r["aborted"] or r["code"] != 0]
    aborted = [r for r in rows if r["aborted"]]
    summary = (
        f"{len(rows)} runs, {len(aborted)} aborted, {len(failed)} not clean (exit code != 0), "
        f"{time.monotonic() - start:.0f} s"
    )
    print(summary)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/stress_demo.py " + " ".join(argv)
        what = (
            f"`torch.distributed.run ... --module {args.rank_module}`"
            if args.rank_module
            else "`python -m zeta_fsdp demo --nproc 2 --steps 2`"
        )
        text = [
            "# Stress run of the main job (issue 18, item 9)",
            "",
            f"{what}, {args.runs} runs ({args.jobs} at a time), while {args.burners} processes spin on the CPU.",
            f"Machine: {os.cpu_count()} cores, shared with other jobs (load average {load_before[0]:.1f} before, "
            f"{load_after[0]:.1f} after); {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
            "",
            f"Command: `{command}`",
            "",
            f"**Result: {summary}.**",
            "",
            "| run | exit | abort | seconds |",
            "|---|---|---|---|",
            *(f"| {r['run']} | {r['code']} | {'yes' if r['aborted'] else 'no'} | {r['seconds']:.0f} |" for r in rows),
        ]
        (args.out / "demo_stress.md").write_text("\n".join(text) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""CPU ranks sharing cores (issue 32): a training step and an AdamW step when each rank keeps torch's
default threads (as many as the machine has cores: oversubscribed) vs the fair share ``fsdp()`` now sets.

Two ranks are started the way a launcher that does not set ``OMP_NUM_THREADS`` starts them (SLURM's
``srun``, ``mpirun``, a script: the rendezvous variables only), twice: with ``OMP_NUM_THREADS=<cores>``
(torch's default, what ranks got before) and without it (``fsdp()`` gives each ``cores // 2``).
FULL_SHARD, fp32, the benchmark GPT; median of the step times of rank 0 (the slowest rank's
steps are the same: every step ends in a collective). Results: ``results/cpu_threads.md``.

Run:
    python benchmarks/bench_cpu_threads.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def rank_main() -> None:
    import torch
    from _common import BENCH_MODEL, Block, build_model, lm_loss, make_batch, median

    from zeta_fsdp import fsdp, shutdown

    model = fsdp(build_model(BENCH_MODEL), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = make_batch(BENCH_MODEL)
    steps, opt_steps = [], []
    for i in range(int(os.environ["BENCH_STEPS"]) + 2):
        start = time.perf_counter()
        lm_loss(model(inputs), targets).backward()
        mid = time.perf_counter()
        opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        if i >= 2:
            steps.append(end - start)
            opt_steps.append(end - mid)
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"threads": torch.get_num_threads(), "step": median(steps), "opt": median(opt_steps)}))
    shutdown(force=True)


def launch(omp: str | None, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), BENCH_STEPS=str(steps), PYTHONPATH=str(ROOT))
        if omp is not None:
            env["OMP_NUM_THREADS"] = omp
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank"], env=env, stdout=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(out[0].strip().splitlines()[-1])


def main() -> None:
    quick = "--quick" in sys.argv
    steps = 3 if quick else 20
    cores = str(len(os.sched_getaffinity(0)))
    runs = {"before: torch's default threads per rank": cores, "after: fsdp() shares the cores": None}
    results = {name: [] for name in runs}
    for _ in range(1 if quick else 3):  # alternate: drift on the shared machine hits both
        for name, omp in runs.items():
            results[name].append(launch(omp, steps))
    rows = []
    for name, rs in results.items():
        step = sorted(r["step"] for r in rs)[len(rs) // 2]
        opt = sorted(r["opt"] for r in rs)[len(rs) // 2]
        rows.append(f"| {name} | {rs[0]['threads']} | {step * 1e3:.1f} | {opt * 1e3:.2f} |")
    command = "python benchmarks/bench_cpu_threads.py" + (" --quick" if quick else "")
    md = "\n".join(
        [
            "# CPU ranks share cores: threads per rank before / after",
            "",
            f"2 ranks on {cores} cores, started without OMP_NUM_THREADS (srun-style); FULL_SHARD fp32 benchmark GPT, "
            f"median of {steps} steps per launch, median of the launches (alternating).",
            "",
            "```bash",
            command,
            "```",
            "",
            "| variant | threads per rank | train step ms | of which AdamW step ms |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_threads.md").write_text(md)
    (out / "cpu_threads.json").write_text(json.dumps({"command": command, "runs": results}, indent=2))
    print(md)


if __name__ == "__main__":
    rank_main() if "--rank" in sys.argv else main()

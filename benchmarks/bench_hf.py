"""Hugging Face weights benchmark: peak host RSS of ``load_pretrained`` / ``save_pretrained`` at N ranks.

Measures, on one Llama-shaped model (~400 MB of fp32 weights by default, untied), each phase in
fresh processes so one phase's freed-but-kept memory never counts in the next:

* ``load_pretrained`` at N ranks into ``fsdp(meta model, FULL_SHARD, materialize=False)``: per-rank
  peak RSS growth (``VmHWM`` reset through ``/proc/self/clear_refs`` after wrapping, minus the RSS
  then; mapped file pages count, page cache does not) as a multiple of the model's bytes, and wall time;
* the rank-0 path it replaces: rank 0 ``safetensors.torch.load_file`` + ``load_full_state_dict``
  (broadcast one tensor at a time), same model, same measure;
* ``save_pretrained`` at N ranks of the loaded model: per-rank peak RSS growth, wall time;
* ``safetensors.torch.load_file`` of the same file on one process, every tensor then read once
  (``load_file`` maps the file lazily; untouched, it would measure nothing): wall time (the
  ratio's denominator) and its RSS growth (mapped pages).

Run (rank programs are launched with torchrun by the script itself):

    python benchmarks/bench_hf.py                  # 2 ranks, writes benchmarks/results/hf.md (+ .json)
    python benchmarks/bench_hf.py --quick --out /tmp/hf_bench   # tiny model, smoke run

Example:
    $ OMP_NUM_THREADS=1 python benchmarks/bench_hf.py --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12)
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def config(quick: bool):
    import transformers

    return transformers.LlamaConfig(**(QUICK if quick else FULL), tie_word_embeddings=False)


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS (Linux >= 4.0)


def measured(fn) -> dict:
    """Run ``fn``; its wall time and the peak RSS growth above the RSS just before it."""
    import gc

    gc.collect()
    reset_peak()
    base = rss_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_growth_bytes": (rss_kib("VmHWM") - base) * 1024}


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one phase (under torchrun): writes ``<work>/<phase>_rank<r>.json``."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import transformers

    from zeta_fsdp import fsdp, load_full_state_dict, load_pretrained, save_pretrained, shutdown

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    work = Path(args.work)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(args.quick))
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", materialize=False)
    weights = work / "hf"
    if args.phase == "load":
        result = measured(lambda: load_pretrained(model, weights))
    elif args.phase == "broadcast":

        def rank0_path() -> None:
            from safetensors.torch import load_file

            model.to_empty(device="cpu")
            sd = load_file(str(weights / "model.safetensors")) if dist.get_rank() == 0 else None
            load_full_state_dict(model, sd)
            del sd

        result = measured(rank0_path)
    elif args.phase == "save":
        load_pretrained(model, weights)
        out = work / f"saved_{os.getpid()}"
        result = measured(lambda: save_pretrained(model, out, overwrite=True))
    else:
        raise SystemExit(f"unknown phase {args.phase}")
    (work / f"{args.phase}_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    shutdown(force=True)


def load_file_main(args: argparse.Namespace) -> None:
    """``load_file`` returns tensors over a memory map: nothing is read until touched. The fair
    denominator reads every byte (``sum`` of each tensor), as a load into a model must."""
    from safetensors.torch import load_file

    def read_all() -> None:
        for t in load_file(str(Path(args.work) / "hf" / "model.safetensors")).values():
            t.sum()

    result = measured(read_all)
    (Path(args.work) / "load_file.json").write_text(json.dumps(result))


def prepare(work: Path, quick: bool) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(quick))
    model.save_pretrained(work / "hf")
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def run(cmd: list[str]) -> None:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke run, figures mean nothing")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where hf.md/hf.json go")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "load_file":
        return load_file_main(args)
    if args.phase:
        return rank_main(args)
    me = [sys.executable, str(Path(__file__).resolve())] + (["--quick"] if args.quick else [])
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        work = Path(tmp)
        model_bytes = prepare(work, args.quick)
        (work / "hf" / "model.safetensors").read_bytes()  # warm the page cache once for every phase
        run(me + ["--phase", "load_file", "--work", tmp])
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        for phase in ("load", "broadcast", "save"):
            run(torchrun + me[1:] + ["--phase", phase, "--work", tmp])
        figures = {"load_file": json.loads((work / "load_file.json").read_text())}
        for phase in ("load", "broadcast", "save"):
            figures[phase] = [json.loads((work / f"{phase}_rank{r}.json").read_text()) for r in range(args.nproc)]
    write_results(Path(args.out), figures, model_bytes, args)


def write_results(out: Path, figures: dict, model_bytes: int, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mb = model_bytes / 1e6

    def ratios(phase: str) -> str:
        return ", ".join(f"{r['peak_growth_bytes'] / model_bytes:.2f}x" for r in figures[phase])

    def seconds(phase: str) -> float:
        return max(r["seconds"] for r in figures[phase])

    base = figures["load_file"]["seconds"]
    cmd = "OMP_NUM_THREADS=1 python benchmarks/bench_hf.py" + (f" --nproc {args.nproc}" if args.nproc != 2 else "")
    cmd += " --quick" if args.quick else ""
    rows = [
        ("`load_pretrained` (each rank preads its rows)", ratios("load"), seconds("load")),
        ("rank 0 `load_file` + `load_full_state_dict` (broadcast)", ratios("broadcast"), seconds("broadcast")),
        ("`save_pretrained` (gather one tensor, stream it)", ratios("save"), seconds("save")),
        (
            "`safetensors.torch.load_file` + read every byte, one process",
            f"{figures['load_file']['peak_growth_bytes'] / model_bytes:.2f}x",
            base,
        ),
    ]
    lines = [
        "# Hugging Face weights in and out: peak host RSS per rank",
        "",
        f"Model: `LlamaForCausalLM` {'(quick: tiny)' if args.quick else str(FULL)}, untied, "
        f"{mb:.0f} MB of fp32 weights in one `model.safetensors`. {args.nproc} ranks (gloo, CPU), FULL_SHARD, "
        "model built on `meta` and wrapped with `fsdp(..., materialize=False)`.",
        "",
        "Peak RSS growth = `VmHWM` (reset via `/proc/self/clear_refs` just before the call) minus `VmRSS` "
        "then, as a multiple of the model's bytes; mapped file pages count, page cache does not. Each phase "
        "runs in fresh processes. Goal: <= 0.6x at 2 ranks (1/N of the model plus one tensor).",
        "",
        "| phase | peak RSS growth per rank (x model bytes) | wall time (s, slowest rank) | time / `load_file` |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {r} | {s:.2f} | {s / base:.2f} |" for name, r, s in rows]
    lines += [
        "",
        f"Recorded {datetime.now(timezone.utc):%Y-%m-%d} on {platform.machine()}, {os.cpu_count()} CPU cores shared "
        f"with other jobs (timings are noisy; the ratios were measured side by side in one run), "
        f"torch {__import__('torch').__version__}, transformers {__import__('transformers').__version__}.",
        "",
        "Reproduce:",
        "",
        "```",
        cmd,
        "```",
        "",
    ]
    (out / "hf.md").write_text("\n".join(lines))
    (out / "hf.json").write_text(json.dumps({"model_bytes": model_bytes, "nproc": args.nproc, **figures}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Hugging Face weights in and out at 2 ranks: time and peak RSS against the disk's floor and the alternatives.

For each model size (Llama, fp32, untied: ~106 MB, ~423 MB, ~1.6 GB) one launch of N ranks
(gloo, CPU) runs every variant in rounds, interleaved (the order flips every round), so machine
load hits them alike:

load (into FULL_SHARD, the same sharding for every row)
* ``floor``: each rank ``os.pread``s exactly the bytes of its shards into fresh tensors;
* ``load_pretrained`` (the call, into ``fsdp(meta model, materialize=False)``), and end to end
  (building the meta model and ``fsdp()`` included);
* transformers' own FSDP2 loading, end to end:
  ``from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=N))``; and the same with
  every local shard then read once (it can leave shards as views of a private file mapping,
  read from disk at first touch, so the call alone may not have read them);
* both, end to end, then every local shard read once (``sum``) and written once in place
  (``mul_(1)``): what a first step does to every weight (its forward reads it, its optimizer
  writes it), so a mapping's page faults and copy-on-write are counted where a training job pays
  them (a real first step costs 1-2 s here and would drown the difference).

save (of the loaded FULL_SHARD model)
* ``floor``: one process writes the model's bytes with one ``writev`` + ``fdatasync``;
* ``floor, N ranks``: each rank ``pwrite``s its shards' bytes into one preallocated file + ``fdatasync``;
* ``save_pretrained`` (ours: every rank writes its rows at their offsets);
* one-process ``model.save_pretrained`` (transformers, rank 0, plain model) + ``fdatasync``.

Time = the slowest rank's wall time, median (and min) over rounds; CPU = the same for the rank's
CPU time (``time.process_time``: user + system, page faults included), which other jobs on a
shared machine disturb far less than wall time. Peak RSS growth per rank = ``VmHWM``
(reset through ``/proc/self/clear_refs`` just before the call) minus ``VmRSS`` then; page cache
does not count, mapped file pages do. ``MALLOC_MMAP_THRESHOLD_`` is fixed so freed tensors go
back to the OS between variants. Files are read warm (page cache), as the floor is.

Run (the script launches its own ranks):

    python benchmarks/bench_hf.py                       # 3 sizes, writes benchmarks/results/hf.md (+ .json)
    python benchmarks/bench_hf.py --sizes 106MB,423MB   # skip the 1.6 GB model
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = {
    "106MB": dict(vocab_size=8192, hidden_size=512, intermediate_size=1280, num_hidden_layers=6, num_attention_heads=8),
    "423MB": dict(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12
    ),
    "1.6GB": dict(
        vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=11, num_attention_heads=12
    ),
}
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
LOAD_ROWS = (
    "load_floor",
    "load_ours",
    "load_ours_e2e",
    "load_ours_written",
    "load_transformers",
    "load_transformers_touched",
    "load_transformers_written",
)
SAVE_ROWS = ("save_floor", "save_floor_ranks", "save_ours", "save_transformers")


def config(shape: dict):
    import transformers

    return transformers.LlamaConfig(**shape, tie_word_embeddings=False)


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since ``start``, a ``clock()``."""
    return tuple(b - a for a, b in zip(start, clock()))


def measured(fn) -> tuple[dict, object]:
    """Run ``fn`` (every rank, started together); its wall and CPU time, and peak RSS growth above the RSS before it."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS (Linux >= 4.0)
    base = rss_kib("VmRSS")
    t0 = clock()
    value = fn()
    seconds, cpu = since(t0)
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_growth_bytes": (rss_kib("VmHWM") - base) * 1024}, value


def rank_main(args: argparse.Namespace) -> None:
    """One launch (under torchrun) for one size: every variant, ``--rounds`` times, interleaved."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    from zeta_fsdp import fsdp, load_pretrained, save_pretrained, shutdown
    from zeta_fsdp.hf.files import read_checkpoint_index, read_rows
    from zeta_fsdp.hf.load import local_box

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    work = Path(args.work)
    weights = work / "hf"
    cfg = config(json.loads(args.shape))

    def meta_fsdp():
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        return fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", materialize=False)

    # What the floor reads: the rows of every tensor this rank's FULL_SHARD shards hold.
    entries = read_checkpoint_index(weights)
    planned = [(entries[k], local_box(t)[0] if t.dim() else (0, 1)) for k, t in meta_fsdp().state_dict().items()]

    def load_floor():
        fd = os.open(entries[next(iter(entries))].file, os.O_RDONLY)
        out = [
            read_rows(e, a, b - a, out=torch.empty((b - a, *e.shape[1:]), dtype=e.dtype), fd=fd)
            for e, (a, b) in planned
        ]
        os.close(fd)
        return out

    def locals_of(model):
        return [(t.to_local() if hasattr(t, "to_local") else t) for t in model.state_dict().values()]

    def first_touches(model) -> tuple[tuple[float, float], tuple[float, float]]:
        """(wall, CPU) seconds to read every local shard once, then to write each once in place:
        what a first step does (its forward reads the weights, its optimizer writes them)."""
        t0 = clock()
        with torch.no_grad():
            for t in locals_of(model):
                t.sum()
            read, t1 = since(t0), clock()
            for t in locals_of(model):
                t.mul_(1)
        return read, since(t1)

    def load_ours():
        model = meta_fsdp()
        t0 = clock()
        load_pretrained(model, weights)
        return model, (since(t0), *first_touches(model))

    def less(fig: dict, *phases: tuple[float, float]) -> dict:
        """``fig`` with the (wall, CPU) seconds of ``phases`` taken off."""
        wall, cpu = (sum(p[i] for p in phases) for i in (0, 1))
        return {**fig, "seconds": fig["seconds"] - wall, "cpu_seconds": fig["cpu_seconds"] - cpu}

    def load_transformers():
        model = transformers.LlamaForCausalLM.from_pretrained(
            weights, distributed_config=DistributedConfig(fsdp_size=world), dtype=torch.float32
        )
        return model, first_touches(model)

    figures: dict[str, list] = {name: [] for name in LOAD_ROWS + SAVE_ROWS}
    order = [("load_floor", load_floor), ("load_ours", load_ours), ("load_transformers", load_transformers)]
    for r in range(args.rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            fig, value = measured(fn)
            if name == "load_ours":
                # end to end: meta model + fsdp() + load (+ first read and write); the call is timed inside
                call, read, write = value[1]
                figures["load_ours_written"].append(dict(fig))
                figures["load_ours_e2e"].append(less(fig, read, write))
                fig = {**fig, "seconds": call[0], "cpu_seconds": call[1]}
            if name == "load_transformers":
                read, write = value[1]
                figures["load_transformers_written"].append(dict(fig))
                figures["load_transformers_touched"].append(less(fig, write))
                fig = less(fig, read, write)
            figures[name].append(fig)
            del value

    model, _ = load_ours()
    # transformers' one-process save runs on rank 0 from a plain model (rank 1 waits at the barrier).
    plain = transformers.LlamaForCausalLM.from_pretrained(weights, dtype=torch.float32) if me == 0 else None
    shards = [(t.to_local() if hasattr(t, "to_local") else t).detach() for t in model.state_dict().values()]
    share = sum(s.numel() * s.element_size() for s in shards)
    shares = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(shares, torch.tensor([share]))
    start = sum(int(s) for s in shares[:me])
    total = sum(int(s) for s in shares)

    def views(tensors):
        return [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors]

    def save_floor():
        if me == 0:
            fd = os.open(work / "floor_1p.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.writev(fd, views(plain.state_dict().values()))
            os.fdatasync(fd)
            os.close(fd)

    def save_floor_ranks():
        f = work / "floor_ranks.bin"
        if me == 0:
            with open(f, "wb") as h:
                h.truncate(total)
        dist.barrier()
        fd = os.open(f, os.O_WRONLY)
        os.pwritev(fd, views(shards), start)
        os.fdatasync(fd)
        os.close(fd)

    def save_ours():
        save_pretrained(model, work / "saved_ours")

    def save_transformers():
        if me == 0:
            out = work / "saved_transformers"
            plain.save_pretrained(out)
            for f in out.iterdir():
                fd = os.open(f, os.O_RDONLY)
                os.fdatasync(fd)
                os.close(fd)

    order = [
        ("save_floor", save_floor),
        ("save_floor_ranks", save_floor_ranks),
        ("save_ours", save_ours),
        ("save_transformers", save_transformers),
    ]
    for r in range(args.rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            fig, _ = measured(fn)
            figures[name].append(fig)
            dist.barrier()
            if me == 0:  # the next variant writes into a fresh file, as a first save does
                for leftover in ("floor_1p.bin", "floor_ranks.bin", "saved_transformers", "saved_ours"):
                    p = work / leftover
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    save_ours()
    if me == 0:
        from safetensors.torch import load_file

        ours = load_file(str(work / "saved_ours" / "model.safetensors"))
        same = all(torch.equal(ours[k], v) for k, v in plain.state_dict().items())
        figures["save_ours_bit_identical"] = same
    dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if me == 0:
        (work / "figures.json").write_text(json.dumps(gathered))
    dist.barrier()
    shutdown(force=True)


def prepare(work: Path, shape: dict) -> int:
    """A random Llama of ``shape`` written by transformers' own ``save_pretrained``; returns its bytes."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(shape))
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.save_pretrained(work / "hf")
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def summarize(per_rank: list[dict], model_bytes: int) -> dict:
    """Per variant: median and min over rounds of the slowest rank's wall and CPU seconds; the largest RSS growth per rank."""
    out = {}
    for name in LOAD_ROWS + SAVE_ROWS:
        rounds = len(per_rank[0][name])
        out[name] = {"rss_x_model": [max(x["peak_growth_bytes"] for x in r[name]) / model_bytes for r in per_rank]}
        for key in ("seconds", "cpu_seconds"):
            slowest = [max(r[name][i][key] for r in per_rank) for i in range(rounds)]
            out[name].update({key: statistics.median(slowest), f"min_{key}": min(slowest)})
    out["save_ours_bit_identical"] = per_rank[0]["save_ours_bit_identical"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per size (default: 5, 3 at 1.6GB)")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke run, figures mean nothing")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where hf.md/hf.json go")
    parser.add_argument("--work-dir", default=None, help="where the temporary checkpoints go (default: $TMPDIR)")
    parser.add_argument("--keep-other-sizes", action="store_true", help="keep --out's figures of sizes not run")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return rank_main(args)
    sizes = {"quick": QUICK} if args.quick else {s: SIZES[s] for s in args.sizes.split(",")}
    me = [sys.executable, str(Path(__file__).resolve())]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    results = {}
    if args.keep_other_sizes and (Path(args.out) / "hf.json").is_file():  # sizes not run now keep their figures
        results = json.loads((Path(args.out) / "hf.json").read_text())["sizes"]
    for size, shape in sizes.items():
        rounds = args.rounds or (2 if args.quick else 3 if size == "1.6GB" else 5)
        with tempfile.TemporaryDirectory(prefix="bench_hf_", dir=args.work_dir) as tmp:
            work = Path(tmp)
            model_bytes = prepare(work, shape)
            (work / "hf" / "model.safetensors").read_bytes()  # warm the page cache once for every variant
            cmd = torchrun + me[1:] + ["--phase", "rank", "--work", tmp, "--shape", json.dumps(shape)]
            run(cmd + ["--rounds", str(rounds)])
            per_rank = json.loads((work / "figures.json").read_text())
        when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        results[size] = {"model_bytes": model_bytes, "rounds": rounds, "recorded": when}
        results[size].update(summarize(per_rank, model_bytes))
        print(size, json.dumps(results[size]), flush=True)
    write_results(Path(args.out), {s: results[s] for s in [*SIZES, "quick"] if s in results}, args)


NAMES = {
    "load_floor": "floor: each rank `os.pread`s exactly its bytes",
    "load_ours": "`load_pretrained` (the call)",
    "load_ours_e2e": "`load_pretrained` end to end (meta model + `fsdp()` + load)",
    "load_ours_written": "the same, then every local shard read once and written once (as a first step)",
    "load_transformers": "transformers `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))`",
    "load_transformers_touched": "the same, then every local shard read once (`.sum()`)",
    "load_transformers_written": "the same, then every local shard read once and written once (as a first step)",
    "save_floor": "floor: one process, one `writev` + `fdatasync` of the model's bytes",
    "save_floor_ranks": "floor, N ranks: each `pwrite`s its shards into one file + `fdatasync`",
    "save_ours": "`save_pretrained` (each rank writes its rows)",
    "save_transformers": "one-process `model.save_pretrained` + `fdatasync` (plain model)",
}


def write_results(out: Path, results: dict, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = "OMP_NUM_THREADS=1 python benchmarks/bench_hf.py"
    cmd += f" --nproc {args.nproc}" if args.nproc != 2 else ""
    cmd += f" --sizes {args.sizes}" if args.sizes != ",".join(SIZES) and not args.quick else ""
    cmd += " --keep-other-sizes" if args.keep_other_sizes else ""
    cmd += " --quick" if args.quick else ""
    lines = [
        "# Hugging Face weights in and out: time and peak RSS per rank against the floor",
        "",
        f"Llama (`LlamaForCausalLM`, fp32, untied) in one `model.safetensors`, {args.nproc} ranks (gloo, CPU), "
        "loaded into FULL_SHARD. Time: slowest rank, median over rounds; every variant runs in the same "
        "launch, interleaved (order flipped each round). CPU: the slowest rank's CPU time (user + system, "
        "page faults included), less disturbed than wall time by other jobs on the machine. RSS: peak growth per rank during the call, as a "
        "multiple of the model's bytes (page cache does not count). Files warm in the page cache.",
        "",
    ]
    for size, r in results.items():
        mb = r["model_bytes"] / 1e6
        lines += [
            f"## {size} ({mb:.0f} MB, {r['rounds']} rounds, recorded {r.get('recorded', '?')})",
            "",
            "| variant | time (s), median | min | x floor (median) | CPU (s), median (min) | CPU x floor | "
            "peak RSS growth per rank (x model) |",
            "|---|---|---|---|---|---|---|",
        ]
        for group, floor in ((LOAD_ROWS, "load_floor"), (SAVE_ROWS, "save_floor")):
            for name in group:
                s = r[name]["seconds"]
                rss = ", ".join(f"{x:.2f}" for x in r[name]["rss_x_model"])
                low, cpu = r[name]["min_seconds"], r[name]["cpu_seconds"]
                lines.append(
                    f"| {NAMES[name]} | {s:.3f} | {low:.3f} | {s / r[floor]['seconds']:.2f} | {cpu:.3f} "
                    f"({r[name]['min_cpu_seconds']:.3f}) | {cpu / r[floor]['cpu_seconds']:.2f} | {rss} |"
                )
        lines += [
            "",
            f"`save_pretrained`'s file holds `model.save_pretrained`'s tensors bit for bit: {r['save_ours_bit_identical']}.",
            "",
        ]
    lines += [
        "## How the costs grow with the model",
        "",
        "| size | load floor (s/GB) | `load_pretrained` (s/GB) | transformers FSDP2 load (s/GB) | "
        "load RSS per rank (x model) | save floor (s/GB) | `save_pretrained` (s/GB) | save RSS per rank (x model) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, r in results.items():
        gb = r["model_bytes"] / 1e9

        def per_gb(name: str, gb: float = gb, r: dict = r) -> str:
            return f"{r[name]['seconds'] / gb:.2f}"

        lines.append(
            f"| {size} | {per_gb('load_floor')} | {per_gb('load_ours')} | {per_gb('load_transformers')} | "
            f"{max(r['load_ours']['rss_x_model']):.2f} | {per_gb('save_floor')} | {per_gb('save_ours')} | "
            f"{max(r['save_ours']['rss_x_model']):.3f} |"
        )
    lines += [
        "",
        "Reading the figures:",
        "",
        "* Most of a load's CPU time is page faults: one per 4 KiB page of the rank's shards (~2 us "
        "each on this VM). The floor and `load_pretrained` pay them during the read, into fresh, "
        "zero-filled pages; transformers' map pays them at the first write (copy on write). "
        "`benchmarks/bench_first_touch.py` times the mechanisms alone (one process, 800 MB): their "
        "CPU costs are the same, so compare the 'written once' rows by CPU when the machine is shared.",
        "* transformers' FSDP2 loading leaves each rank's shards as views of a private memory map "
        "of the file (checked: every local shard's `data_ptr` lies in the file's mapping): the call "
        "copies nothing, so it can sit below the pread floor. The copy only moves: the first "
        "optimizer step writes every weight and each page of the map is then copied on write. The "
        "rows '... read once and written once' add that first read and write to both loads: "
        "compare them for what a training job pays end to end. `load_pretrained` does not adopt the map "
        "(issue 23; docs/huggingface.md says why: end to end the gain mostly goes, an unwritten "
        "(frozen) weight stays file-backed and dies of `SIGBUS` when the file is rewritten in "
        "place, a bf16 checkpoint into fp32 master weights and FSDP2's padded uneven shards are "
        "copied anyway).",
        "* A `load_pretrained` call's fixed cost (106 MB, per rank, CPU time): FSDP2's `to_empty` of "
        "the meta shards 5-6 ms (57 tensors, ~90 us each: the meta-to-CPU `empty_like` runs through "
        "Python decompositions, then the parameter swap; the allocation itself is 15-35 us; "
        "`bench_first_touch.py --alloc` times the public alternatives, none cheaper), the key and shape check ~1 ms, two rank syncs ~1 ms (one before any change, "
        "one so an I/O error raises on every rank), ~3 ms of bookkeeping; the reads cost what the "
        "floor's do. That is why small models sit further above the floor than big ones.",
        "* Every save row flushes with `fdatasync` (the file's size is set before its data is "
        "written, so data is all there is to flush; two ranks `fsync`-ing one file took ~2x as "
        "long). Save timings depend on how much other dirty data the disk is flushing (other jobs "
        "wrote too), so save ratios move more between runs than load ratios.",
        "* Times are medians (and minima: the least disturbed round) of rounds inside one process: "
        "costs paid once per process (importing transformers, building its key-conversion mapping, "
        "which `load_pretrained` skips for checkpoints under the model's own names and which "
        "`save_pretrained` and transformers' own `save_pretrained` both pay once, 0.3-0.6 s here) "
        "fall in the first round only.",
        "",
        f"Recorded {datetime.now(timezone.utc):%Y-%m-%d} on {platform.machine()}, {os.cpu_count()} CPU cores shared "
        "with other jobs (timings are noisy; ratios were measured side by side in one launch per size), "
        f"torch {__import__('torch').__version__}, transformers {__import__('transformers').__version__}.",
        "",
        "Reproduce (all sizes in one go; a size run alone with `--sizes S --keep-other-sizes` rewrites "
        "only its own section, hence each section's record time):",
        "",
        "```",
        "OMP_NUM_THREADS=1 python benchmarks/bench_hf.py" if args.keep_other_sizes else cmd,
        "```",
        "",
    ]
    (out / "hf.md").write_text("\n".join(lines))
    from _common import machine_info  # the benchmarks' shared machine record (imports torch)

    data = {"command": cmd, "machine": machine_info(), "nproc": args.nproc, "sizes": results}
    (out / "hf.json").write_text(json.dumps(data, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

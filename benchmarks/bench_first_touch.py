"""What a load's first touch of fresh memory costs, mechanism by mechanism (issue 23).

Default: one process, one file of ``--mb`` MB (fp32 values, warm in the page cache), got into
writable memory by each mechanism below, then read once (``sum``) and written once (``mul_(1)``),
as a first training step does; variants interleaved, order flipped every round:

* ``pread``: ``torch.empty`` + one ``os.preadv`` of the whole range (``load_pretrained``'s way);
* ``pread 1 MiB`` / ``pread 64 KiB``: the same in many small reads;
* ``zero, then pread``: the pages faulted first by ``zero_()``;
* ``MADV_POPULATE_WRITE, then pread``: the pages faulted first in one ``madvise`` call (Linux >= 5.14);
* ``MADV_HUGEPAGE, then pread``: transparent huge pages asked for on ``torch.empty``'s memory;
* ``anonymous map + MADV_HUGEPAGE, then pread``: the same on a Python ``mmap`` viewed by ``torch.frombuffer``;
* ``private file map``: a ``MAP_PRIVATE`` map of the file (transformers' FSDP2 load): no copy at
  load, each page copied on its first write.

Reported per variant: wall and CPU time (``time.process_time``: user + system, page faults
included), and minor page faults (``getrusage``). ``--alloc``: 2 ranks (gloo), a 106 MB Llama
under ``fsdp(..., materialize=False)``, the CPU time of allocating its shards with ``to_empty``
against the public alternatives (``load_state_dict(assign=True)`` of fresh DTensors) and against
bare ``torch.empty`` of the same local shapes (``MALLOC_MMAP_THRESHOLD_`` fixed as in
``bench_hf.py``; the one-process regions are above glibc's largest threshold, so always fresh maps).

Example:
    $ OMP_NUM_THREADS=1 python benchmarks/bench_first_touch.py --mb 800
    $ OMP_NUM_THREADS=1 python benchmarks/bench_first_touch.py --alloc
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # <linux/mman.h>; Python's mmap.madvise takes only its own maps
HUGE = 2 << 20


def madvise(t: torch.Tensor, advice: int) -> None:
    """``madvise`` the whole pages (huge pages: the aligned 2 MiB ones) of ``t``'s memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    align = HUGE if advice == MADV_HUGEPAGE else mmap.PAGESIZE
    p, n = t.data_ptr(), t.numel() * t.element_size()
    start, end = -(-p // align) * align, (p + n) // align * align
    if end > start and libc.madvise(start, end - start, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice})")


def table(head: str, rows: dict[str, list[list[float]]], digits: int = 3) -> list[str]:
    """Markdown rows: per variant, each column's median (min); a last column of counts, median only."""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, cols in rows.items():
        cells = [f"{statistics.median(c):.{digits}f} ({min(c):.{digits}f})" for c in cols[:-1]]
        lines.append(f"| {name} | {' | '.join(cells)} | {statistics.median(cols[-1]):.0f} |")
    return lines


def one_process(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    n = args.mb << 20
    with tempfile.TemporaryDirectory(prefix="bench_first_touch_") as tmp:
        path = Path(tmp) / "blob.bin"
        path.write_bytes(torch.randn(n // 4).numpy().tobytes())  # real floats: no denormals in mul_
        fd = os.open(path, os.O_RDONLY)

        def pread(t: torch.Tensor, chunk: int = n) -> torch.Tensor:
            view = memoryview(t.numpy())
            for at in range(0, n, chunk):
                if os.preadv(fd, [view[at : at + chunk]], at) != min(chunk, n - at):
                    raise OSError("short read")
            return t

        def fresh() -> torch.Tensor:
            return torch.empty(n, dtype=torch.uint8)

        def advised(advice: int) -> torch.Tensor:
            t = fresh()
            madvise(t, advice)
            return t

        def anonymous_huge() -> torch.Tensor:
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)
            return torch.frombuffer(m, dtype=torch.uint8)

        def private_map() -> torch.Tensor:
            m = mmap.mmap(fd, n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return torch.frombuffer(m, dtype=torch.uint8)

        variants = {
            "pread": lambda: pread(fresh()),
            "pread 1 MiB": lambda: pread(fresh(), 1 << 20),
            "pread 64 KiB": lambda: pread(fresh(), 64 << 10),
            "zero, then pread": lambda: pread(fresh().zero_()),
            "MADV_POPULATE_WRITE, then pread": lambda: pread(advised(MADV_POPULATE_WRITE)),
            "MADV_HUGEPAGE, then pread": lambda: pread(advised(MADV_HUGEPAGE)),
            "anonymous map + MADV_HUGEPAGE, then pread": lambda: pread(anonymous_huge()),
            "private file map (copy on first write)": private_map,
        }
        figures: dict[str, list[tuple]] = {name: [] for name in variants}
        order = list(variants.items())
        for r in range(args.rounds):
            for name, fn in order if r % 2 == 0 else order[::-1]:
                f0, c0, t0 = (
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                    time.process_time(),
                    time.perf_counter(),
                )
                t = fn()
                loaded = time.perf_counter() - t0
                with torch.no_grad():
                    t.view(torch.float32).sum()
                    t.view(torch.float32).mul_(1)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                figures[name].append((loaded, wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
                del t
        os.close(fd)
    return {name: [list(col) for col in zip(*rows)] for name, rows in figures.items()}


def alloc_rank(args: argparse.Namespace) -> None:
    """Under torchrun: CPU time of materialising a meta FSDP2 model's shards, each way, interleaved."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import transformers
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_hf import SIZES, config

    from zeta_fsdp import fsdp, shutdown

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = config(SIZES["106MB"] if not args.quick else dict(SIZES["106MB"], num_hidden_layers=1))

    def meta() -> torch.nn.Module:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        return fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", materialize=False)

    def local_shape(t: torch.Tensor) -> torch.Size:
        return t.to_local().shape if isinstance(t, DTensor) else t.shape

    def from_local(model: torch.nn.Module) -> None:
        sd = {
            k: DTensor.from_local(
                torch.empty(local_shape(t), dtype=t.dtype),
                t.device_mesh,
                t.placements,
                shape=t.shape,
                stride=t.stride(),
            )
            if isinstance(t, DTensor)
            else torch.empty(t.shape, dtype=t.dtype)
            for k, t in model.state_dict().items()
        }
        model.load_state_dict(sd, assign=True)

    keep = []
    variants = {
        "`model.to_empty(device='cpu')` (what `load_pretrained` does)": lambda m: m.to_empty(device="cpu"),
        "`load_state_dict(assign=True)` of `DTensor.from_local(torch.empty(...))`": from_local,
        "`load_state_dict(assign=True)` of `torch.empty_like(t, device='cpu')`": lambda m: m.load_state_dict(
            {k: torch.empty_like(t, device="cpu") for k, t in m.state_dict().items()}, assign=True
        ),
        "bare `torch.empty` of every local shape (no FSDP2 bookkeeping: a floor)": lambda m: keep.append(
            [torch.empty(local_shape(t), dtype=t.dtype) for t in m.state_dict().values()]
        ),
    }
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for r in range(args.rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            model = meta()
            dist.barrier()
            c0 = time.process_time()
            fn(model)
            cpu[name].append(time.process_time() - c0)
            keep.clear()
    count = len(meta().state_dict())
    if dist.get_rank() == 0:  # CPU ms, and the tensor count as the last column
        figures = {name: [[1e3 * x for x in v], [count] * len(v)] for name, v in cpu.items()}
        Path(args.phase).write_text(json.dumps(figures))
    dist.barrier()
    shutdown(force=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=800, help="bytes of the one-process region, in MiB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--alloc", action="store_true", help="2 ranks: allocating a meta FSDP2 model's shards")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, figures mean nothing")
    parser.add_argument("--out", default=None, help="write first_touch.md and .json there (default: print only)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return alloc_rank(args)
    if args.quick:
        args.mb, args.rounds = 4, 2
    cmd = "OMP_NUM_THREADS=1 python benchmarks/bench_first_touch.py"
    cmd += f" --mb {args.mb} --rounds {args.rounds}" + " --alloc" * args.alloc + " --quick" * args.quick
    data: dict = {"command": cmd, "rounds": args.rounds}
    lines = [f"`{cmd}`", ""]
    if not args.alloc or args.quick:  # --quick smoke-runs both parts
        data["first_touch"] = one_process(args)
        lines += [f"{args.mb} MiB, one process; seconds, median (min) over {args.rounds} rounds:", ""]
        head = "| variant | load, wall | load + first read + write, wall | the same, CPU | minor faults |"
        lines += table(head, data["first_touch"]) + [""]
    if args.alloc or args.quick:
        with tempfile.TemporaryDirectory(prefix="bench_first_touch_") as tmp:
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
            run += ["--phase", f"{tmp}/alloc.json", "--rounds", str(args.rounds)] + ["--quick"] * args.quick
            paths = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
            subprocess.run(
                run,
                cwd=ROOT,
                env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=paths),
                check=True,
            )
            data["alloc"] = json.loads(Path(tmp, "alloc.json").read_text())
        lines += ["Allocating a meta FSDP2 Llama's shards, 2 ranks; rank 0's CPU ms, median (min):", ""]
        lines += table("| way | CPU ms | tensors |", data["alloc"], digits=1) + [""]
    lines.append(f"Load average {os.getloadavg()[0]:.1f} at the end (2 cores shared with other jobs).")
    print("\n".join(lines))
    if args.out:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _common import machine_info  # the benchmarks' shared machine record

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "first_touch.md").write_text("\n".join(lines) + "\n")
        (out / "first_touch.json").write_text(json.dumps({**data, "machine": machine_info()}, indent=2))


if __name__ == "__main__":
    main()

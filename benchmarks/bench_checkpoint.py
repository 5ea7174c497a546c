"""Checkpoint benchmark: sharded ``save_checkpoint``/``load_checkpoint`` at N ranks vs ``torch.save``/``torch.load``.

Measures, in one run and on one model (the example GPT, ~84 MB of fp32 weights by default):

* wall time of ``save_checkpoint`` and ``load_checkpoint`` at N ranks against ``torch.save`` (+ fsync,
  as DCP fsyncs its files) and ``torch.load(weights_only=True)`` of the full state dict on rank 0
  alone, plus a raw ``dcp.load`` with none of our checks (the floor DCP itself sets), a
  ``load_checkpoint`` that reads the files instead of mapping them, and a gather-then-``torch.save``.
  Variants alternate block by block (order reversed every block) and every ratio is the median of
  per-block ratios, so slow drift of the shared machine cancels;
* where the time goes: each step of ``load_checkpoint`` and ``save_checkpoint`` timed on rank 0 by
  wrapping the functions that do it (median per call over the repetitions);
* bytes each rank writes, against the model's bytes;
* peak memory of ``get_full_state_dict(cpu_offload=True)`` on rank 0, two ways: tensor storages
  counted by ``torch.distributed._tools.mem_tracker.MemTracker`` (exact, CPU included), and the
  process's peak RSS (``VmHWM`` after resetting it through ``/proc/self/clear_refs``).

Run (relaunches itself under torchrun when started plainly; rank 0 writes the results):

    python benchmarks/bench_checkpoint.py                     # 2 ranks, writes results/checkpoint.md
    python benchmarks/bench_checkpoint.py --nproc 4 --out /tmp/ckpt_bench

Example:
    $ python benchmarks/bench_checkpoint.py --quick
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from _common import GPT, Block, GPTConfig, Report, bench_parser, finite, gather_max, paired_ratio, run_benchmark
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from zeta_fsdp import fsdp
from zeta_fsdp.state_dict import checkpoint as ckpt_mod
from zeta_fsdp.state_dict import get_full_state_dict, get_sharded_state_dict, load_checkpoint, save_checkpoint
from zeta_fsdp.state_dict import reader as reader_mod


def parser():
    p = bench_parser(__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10, help="blocks per variant (variants alternate block by block)")
    p.add_argument("--steps", type=int, default=3, help="repetitions per block (the block's median is kept)")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    return p


# --- timing


def interleaved(variants: dict[str, Callable[[], Any]], blocks: int, steps: int, after: Callable[[], None]) -> dict:
    """Per-block median wall time of each variant (max over ranks), variants alternating block by block."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for name in names:  # warm-up: page cache, allocator, lazy imports
        variants[name]()
    after()
    for b in range(blocks):
        for name in names if b % 2 == 0 else reversed(names):
            block = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                variants[name]()
                block.append(gather_max([time.perf_counter() - start])[0])  # the slowest rank decides
            times[name].append(statistics.median(block))
            after()  # clean up outside the timed region
    return times


class StepTimer:
    """Time named steps by wrapping the functions that do them (rank 0's seconds per call, median over calls)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self._current: dict[str, float] = {}

    @contextlib.contextmanager
    def wrapped(self, targets: list[tuple[str, Any, str]]) -> Iterator[None]:
        saved = []
        for label, owner, attr in targets:
            original = getattr(owner, attr)
            saved.append((owner, attr, original))
            setattr(owner, attr, self._timer(label, original))
        try:
            yield
        finally:
            for owner, attr, original in reversed(saved):
                setattr(owner, attr, original)

    def _timer(self, label: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current[label] = self._current.get(label, 0.0) + time.perf_counter() - start

        return timed

    def run(self, fn: Callable[[], Any], repeats: int) -> float:
        """Run ``fn`` ``repeats`` times; record each step's total per call; return the median total."""
        totals = []
        for _ in range(repeats):
            self._current = {}
            dist.barrier()
            start = time.perf_counter()
            fn()
            totals.append(time.perf_counter() - start)
            for label, seconds in self._current.items():
                self.calls.setdefault(label, []).append(seconds)
            # What no top-level step covers, per call (a difference of medians could go negative).
            top = sum(v for k, v in self._current.items() if not k.startswith("-"))
            self.calls.setdefault("rest", []).append(totals[-1] - top)
        return statistics.median(totals)


def load_steps() -> list[tuple[str, Any, str]]:
    return [
        ("live sharded state dict (`get_sharded_state_dict`)", ckpt_mod, "get_sharded_state_dict"),
        ("metadata read (allow-list unpickler) + file sizes (`open_checkpoint`)", ckpt_mod, "open_checkpoint"),
        ("small records: layout, `extra` (`dcp_load`)", ckpt_mod, "dcp_load"),
        ("read + check every record, nothing copied yet (`read_checked`)", ckpt_mod, "read_checked"),
        ("- of which DCP planning (`create_local_plan`)", reader_mod._SafeLoadPlanner, "create_local_plan"),
        ("- of which mapping the files (`_map`)", reader_mod, "_map"),
        ("- of which zip parse + CRC-32 of every entry (`reader.entries`)", reader_mod, "entries"),
        ("- of which tensor views of the checked bytes (`reader.tensor_record`)", reader_mod, "tensor_record"),
        ("copy into the live shards, after all ranks agree (`CheckedRead.commit`)", reader_mod.CheckedRead, "commit"),
    ]


def save_steps() -> list[tuple[str, Any, str]]:
    return [
        ("input checks + make `.incomplete` dir (`check_save_inputs`, `prepare_save_dir`)", ckpt_mod, "start_save"),
        ("state dict build (`checkpoint_state`)", ckpt_mod, "checkpoint_state"),
        ("DCP save: plan, write, fsync, metadata (`dcp.save`)", dcp, "save"),
        ("- of which local planning (`create_local_plan`)", DefaultSavePlanner, "create_local_plan"),
        ("- of which global planning, rank 0 (`create_global_plan`)", DefaultSavePlanner, "create_global_plan"),
        ("- of which serialize + write each record (`_write_item`)", dcp_fs, "_write_item"),
        ("- of which fsync (data file, `.metadata`; also the parent-dir fsync of `publish_checkpoint`)", os, "fsync"),
        (
            "publish: rename into place + fsync parent dir (`publish_checkpoint`, rank 0)",
            ckpt_mod,
            "publish_checkpoint",
        ),
    ]


# --- memory of get_full_state_dict


def rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure_gather_peak(model: torch.nn.Module) -> dict[str, int]:
    """Peak memory of get_full_state_dict(cpu_offload=True) on this rank, above what was live before.

    Peak RSS first, on the process's first gather (later ones reuse memory the allocator kept), then
    MemTracker on a second gather for the exact tensor bytes.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    can_reset = reset_rss_peak()
    rss_before = rss_peak_bytes()
    sd = get_full_state_dict(model, cpu_offload=True)
    rss_delta = rss_peak_bytes() - rss_before if can_reset else -1
    del sd
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot("current")
        sd = get_full_state_dict(model, cpu_offload=True)
        peak = tracker.get_tracker_snapshot("peak")
    base = sum(v["Total"] for v in before.values())
    tensor_peak = sum(v["Total"] for v in peak.values()) - base
    kept = sum(v.numel() * v.element_size() for v in {id(v): v for v in sd.values()}.values())
    return {"tensor_peak": tensor_peak, "kept": kept, "rss_delta": rss_delta}


# --- the run


def rank_main(args) -> None:
    if args.quick:
        args.vocab, args.dim, args.layers, args.blocks, args.steps = 512, 64, 2, 2, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / f"zeta_fsdp_bench_ckpt_{os.getppid()}"
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    dist.barrier()
    report = Report(
        name="checkpoint",
        title="Checkpoint benchmark",
        command=args.command,
        what=(
            f"`save_checkpoint`/`load_checkpoint` at {world} ranks (gloo, CPU) against `torch.save` + fsync and "
            "`torch.load(weights_only=True)` of the full state dict on rank 0 alone; where each step's time goes."
        ),
    )
    cfg = GPTConfig(vocab_size=args.vocab, dim=args.dim, n_heads=8, n_layers=args.layers, max_seq_len=128)
    torch.manual_seed(0)
    model = fsdp(GPT(cfg), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    mem = measure_gather_peak(model)  # first, before the timing loops warm up allocator caches
    full_sd = get_full_state_dict(model)  # rank 0: the baselines' input (not timed)
    unique = {id(v): v for v in full_sd.values()}.values()  # the tied embedding/head once
    model_bytes = torch.tensor(sum(v.numel() * v.element_size() for v in unique) if rank == 0 else 0)
    dist.broadcast(model_bytes, src=0)
    model_bytes = int(model_bytes)
    counter = iter(range(10**6))  # save_checkpoint paths: every rank draws the same numbers
    files = iter(range(10**6))  # file names of one rank's own saves
    ckpt = save_checkpoint(base / "ckpt", model)
    full_pt = base / "full.pt"
    if rank == 0:
        torch.save(full_sd, full_pt)
    dist.barrier()

    def on_rank0(fn: Callable[[], Any]) -> Callable[[], None]:
        return lambda: fn() if rank == 0 else None

    # Every save writes a new file, as save_checkpoint writes a new directory (overwriting a file
    # would add freeing its old pages to the baseline); ``clean`` deletes them outside the timing.
    def torch_save() -> None:
        with open(base / f"s_full_{next(files)}.pt", "wb") as f:
            torch.save(full_sd, f)
            f.flush()
            os.fsync(f.fileno())  # DCP fsyncs each file: the same durability for the baseline

    def read_not_map() -> None:
        reader_mod._MAP_FILES = False
        try:
            load_checkpoint(ckpt, model)
        finally:
            reader_mod._MAP_FILES = True

    live = {"model." + k: v for k, v in get_sharded_state_dict(model).items()}  # the layout save_checkpoint writes
    # The floor of any N-rank save/load here: every rank torch.save/torch.load its own local shards,
    # in parallel, no DCP and no checks (own contiguous copies, so no padding is written).
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in live.items()}
    local_pt = base / f"local_{rank}.pt"
    torch.save(local, local_pt)

    def local_save() -> None:
        with open(base / f"s_local_{rank}_{next(files)}.pt", "wb") as f:
            torch.save(local, f)
            f.flush()
            os.fsync(f.fileno())

    variants = {
        "save_checkpoint": lambda: save_checkpoint(base / f"s{next(counter)}", model),
        "torch.save + fsync (rank 0)": on_rank0(torch_save),
        "torch.save of each rank's shards + fsync (all ranks)": local_save,
        "gather + torch.save (rank 0)": lambda: (
            lambda sd: torch.save(sd, base / f"s_gathered_{next(files)}.pt") if rank == 0 else None
        )(get_full_state_dict(model)),
        "load_checkpoint": lambda: load_checkpoint(ckpt, model),
        "load_checkpoint, files read not mapped": read_not_map,
        # the tied head is stored once, as the embedding: allow the partial load
        "raw dcp.load (no checks)": lambda: dcp.load(
            live, checkpoint_id=str(ckpt), planner=DefaultLoadPlanner(allow_partial_load=True)
        ),
        "torch.load of each rank's shards (all ranks)": lambda: torch.load(local_pt, weights_only=True),
        "torch.load (rank 0)": on_rank0(lambda: torch.load(full_pt, weights_only=True)),
    }

    def clean() -> None:
        dist.barrier()
        if rank == 0:
            for p in base.glob("s*"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        dist.barrier()

    times = interleaved(variants, args.blocks, args.steps, clean)
    refs = {
        "save_checkpoint": "torch.save + fsync (rank 0)",
        "gather + torch.save (rank 0)": "torch.save + fsync (rank 0)",
        "load_checkpoint": "torch.load (rank 0)",
        "load_checkpoint, files read not mapped": "torch.load (rank 0)",
        "raw dcp.load (no checks)": "torch.load (rank 0)",
        "torch.save of each rank's shards + fsync (all ranks)": "torch.save + fsync (rank 0)",
        "torch.load of each rank's shards (all ranks)": "torch.load (rank 0)",
    }
    rows, timing = [], {}
    for name, t in times.items():
        ref = refs.get(name)
        ratio = paired_ratio(t, times[ref]) if ref else None
        timing[name] = {"median_s": finite(statistics.median(t)), "block_s": t}
        if ratio:
            timing[name][f"vs {ref}"] = ratio
        cell = f"{ratio['median']:.2f}x (blocks {ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "1"
        rows.append([f"`{name}`", f"{statistics.median(t) * 1e3:.1f}", cell, f"`{ref}`" if ref else ""])
    report.table(
        f"Time: {world} ranks vs one process (median of {args.blocks} blocks x {args.steps} repetitions)",
        ["variant", "median ms", "ratio (median of per-block ratios)", "vs"],
        rows,
    )

    # Where the time goes: each step of load_checkpoint / save_checkpoint on rank 0.
    breakdown: dict[str, Any] = {}
    repeats = max(3, args.blocks)
    for what, steps, fn in [
        ("load_checkpoint", load_steps(), lambda: load_checkpoint(ckpt, model)),
        ("save_checkpoint", save_steps(), lambda: save_checkpoint(base / f"s{next(counter)}", model)),
    ]:
        timer = StepTimer()
        with timer.wrapped(steps):
            total = timer.run(fn, repeats)
        clean()
        per_step = {label: statistics.median(timer.calls.get(label, [0.0])) for label, _, _ in steps}
        rest = statistics.median(timer.calls["rest"])
        breakdown[what] = {"total_s": finite(total), "steps_s": per_step, "rest_s": rest}
        rows = [[label, f"{s * 1e3:.1f}", f"{s / total * 100:.0f} %"] for label, s in per_step.items()]
        label = "rest: collectives, incl. waiting for the slower rank (validation, agreement), Python glue"
        rows.append([label, f"{rest * 1e3:.1f}", f"{rest / total * 100:.0f} %"])
        rows.append([f"**total `{what}`** (rank 0)", f"{total * 1e3:.1f}", "100 %"])
        report.table(
            f"Where `{what}` spends its time (rank 0, median of {repeats} calls; steps timed by wrapping the "
            "functions that do them)",
            ["step", "ms", "share"],
            rows,
        )

    per_rank = sorted((p.name, p.stat().st_size) for p in ckpt.glob("*.distcp"))
    report.table(
        f"Bytes written per rank (model: {model_bytes / 2**20:.1f} MiB)",
        ["file", "MiB", "fraction of the model"],
        [[f"`{n}`", f"{s / 2**20:.1f}", f"{s / model_bytes:.3f}"] for n, s in per_rank],
    )
    if rank == 0:
        report.table(
            "Peak memory of `get_full_state_dict(model, cpu_offload=True)` on rank 0",
            ["measure", "MiB above what was live before", "multiple of the model's bytes"],
            [
                [label, f"{mem[key] / 2**20:.1f}" if mem[key] >= 0 else "n/a",
                 f"{mem[key] / model_bytes:.2f}x" if mem[key] >= 0 else "n/a"]
                for label, key in [
                    ("tensor storages (`MemTracker`: every allocation through the dispatcher, CPU included)", "tensor_peak"),
                    ("result kept (the returned state dict)", "kept"),
                    ("process peak RSS (`VmHWM` reset via `/proc/self/clear_refs`; the first gather)", "rss_delta"),
                ]
            ],
        )  # fmt: skip

    def ratio(name: str) -> float:
        return next(v["median"] for k, v in timing[name].items() if k.startswith("vs "))

    load, save = ratio("load_checkpoint"), ratio("save_checkpoint")
    load_floor = ratio("torch.load of each rank's shards (all ranks)")
    save_floor = ratio("torch.save of each rank's shards + fsync (all ranks)")
    report.notes += [
        f"Goal `load_checkpoint` <= 2x `torch.load`: {load:.2f}x, {'met' if load <= 2 else 'NOT met'} in this run. "
        "It keeps every check: the model and optimizer are validated first (one collective), each rank maps "
        "its shard files once and computes the CRC-32 of every entry of every record it needs over the mapped "
        "pages (no read into a buffer, no second pass, no `torch.load` per record: tensors are views of the "
        "checked bytes), the ranks agree that all of them succeeded (one all-reduce), and only then are the "
        "checked bytes copied into the live shards: no scratch copy, and a bad file on any rank changes nothing. "
        f"The floor on this machine, every rank `torch.load`ing its own shards with no checks, is {load_floor:.2f}x; "
        f"raw `dcp.load` (no checks) is {ratio('raw dcp.load (no checks)'):.2f}x; reading the files into memory "
        f"instead of mapping them costs {ratio('load_checkpoint, files read not mapped'):.2f}x.",
        f"Goal `save_checkpoint` <= 1.1x `torch.save` + fsync: {save:.2f}x, {'met' if save <= 1.1 else 'NOT met'} "
        f"in this run. The floor of any {world}-rank save here, every rank `torch.save`ing its own shards + fsync "
        f"in parallel, is {save_floor:.2f}x: the ranks share {os.cpu_count()} cores (with other jobs) and one disk, "
        "so writing in parallel buys nothing on this machine. The rest is DCP's format and durability: one "
        "`torch.save` zip per tensor (`_write_item`), planning collectives, the `.metadata` file written and "
        "fsynced by rank 0, and the directory published atomically (rename + fsync of the parent): see the "
        "breakdown. What was avoidable is gone: the input checks and the temporary directory take one "
        "collective (was two), no extra agreement wraps DCP's save (its collectives already carry a failure to "
        "every rank), and `extra`/optimizer options made of plain values skip the `torch.save`/`torch.load` "
        "round trip (anything else still takes it).",
        "Before this work (commit 58c8864; results file of 2026-11-23 01:31, another run, median of 5): "
        "`load_checkpoint` 8.20x `torch.load`, raw `dcp.load` 3.39x, `save_checkpoint` 1.85x `torch.save` + fsync. "
        "Where that load went (cProfile of rank 0, 4 calls, ms per call, inflated by the profiler): DCP's "
        "reader 100 (a seek and a read per record 19, `zipfile.testzip` CRC pass over a copy of each record "
        "58, then `torch.load` of each record from another copy 69), `set_model_state_dict` copying the "
        "scratch copy into the model 38, `get_sharded_state_dict` 14, six collectives ~28 (validation, DCP "
        "planning, the read's agreement): 335 in all.",
        "Ratios are medians of per-block ratios (a block of a variant and the adjacent block of its baseline "
        "saw the same machine state); the block ranges show how much the shared machine moved.",
        f"Model: example GPT, vocab {cfg.vocab_size}, dim {cfg.dim}, {cfg.n_layers} blocks, tied embedding/head "
        f'({model_bytes / 2**20:.1f} MiB of fp32 weights); `fsdp(..., auto_wrap=True, shard_strat="FULL_SHARD")`.',
        "Checkpoints go to a local disk (temp dir); the page cache is warm (the files were just written or read), "
        "as when resuming on the node that saved.",
        "Rank-0-only baselines run while the other ranks wait in a barrier; a figure is the slowest rank's time.",
    ]
    report.data = {
        "timing": timing,
        "breakdown": breakdown,
        "model_bytes": model_bytes,
        "files": dict(per_rank),
        "gather_peak_bytes_rank0": mem,
    }
    report.publish(args.out_dir)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    run_benchmark(rank_main, parser())

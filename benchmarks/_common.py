"""Code shared by the benchmark scripts: launching ranks, the models, timing, and results files.

Every benchmark script is both a rank program and its own launcher:

* under ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node N
  benchmarks/bench_x.py``) it measures and rank 0 writes ``results/<name>.md`` (+ ``.json``);
* started plainly (``python benchmarks/bench_x.py``) it relaunches itself under ``torchrun``
  with ``--nproc`` ranks, so tests and users need not type the launcher.

Measurement itself comes from ``zeta_fsdp.measure`` (FSDPMemTracker, CommDebugMode, timers);
this module only adds what the benchmarks need around it: interleaved A/B timing, the
hand-written ``fully_shard`` reference, and the results-file format.

Example:
    >>> from _common import bench_parser, run_benchmark  # doctest: +SKIP
    >>> run_benchmark(rank_main, bench_parser("what it measures"))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
# The scripts import the example model and the package from the repository, as users run them.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from zeta_fsdp import shutdown  # noqa: E402
from zeta_fsdp.distributed import ensure_process_group  # noqa: E402
from zeta_fsdp.measure import median_step_seconds  # noqa: E402
from zeta_fsdp.models.gpt import GPT, Block, GPTConfig, lm_loss  # noqa: E402
from zeta_fsdp.options import resolve_mixed_precision  # noqa: E402

__all__ = [
    "BENCH_MODEL",
    "MIB",
    "QUICK_MODEL",
    "ROOT",
    "Block",
    "GPT",
    "GPTConfig",
    "ModelSpec",
    "Report",
    "bench_parser",
    "build_model",
    "finite",
    "fmt_collectives",
    "fmt_mib",
    "fmt_ratio",
    "gather_max",
    "gather_sum",
    "hand_written_fully_shard",
    "interleaved_block_times",
    "is_rank0",
    "drop_option",
    "launch_ranks",
    "launcher_argv",
    "lm_loss",
    "make_batch",
    "median",
    "out_dir",
    "paired_ratio",
    "reproduce_command",
    "run_benchmark",
    "spread",
    "timing_note",
    "timed_max",
    "timing_table",
    "train_step",
    "under_torchrun",
]

MIB = 2**20


@dataclass(frozen=True)
class ModelSpec:
    """A GPT shape plus the per-rank batch the benchmarks train it on."""

    config: GPTConfig
    batch: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.config.max_seq_len

    def describe(self) -> str:
        c = self.config
        return (
            f"GPT (zeta_fsdp.models.gpt) dim={c.dim} heads={c.n_heads} layers={c.n_layers} vocab={c.vocab_size} "
            f"seq={c.max_seq_len} tied, batch {self.batch}/rank"
        )


# Sized so one fp32 FULL_SHARD training step at 2 ranks takes ~50-200 ms on a 2-core CPU:
# long enough that timer and Python noise are small, short enough that many interleaved
# blocks fit in a few minutes.
BENCH_MODEL = ModelSpec(GPTConfig(vocab_size=2048, dim=128, n_heads=4, n_layers=4, max_seq_len=64), batch=4)
# The --quick smoke mode: odd sizes (uneven shards, like the tests), milliseconds per step.
QUICK_MODEL = ModelSpec(GPTConfig(vocab_size=97, dim=32, n_heads=2, n_layers=2, max_seq_len=16), batch=2)


def build_model(spec: ModelSpec, seed: int = 0, model_cls: type = GPT) -> GPT:
    """A freshly initialised GPT; the same ``seed`` gives the same weights on every rank."""
    torch.manual_seed(seed)
    return model_cls(spec.config)


def make_batch(
    spec: ModelSpec, seed: int = 1, device: Union[str, torch.device] = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets): different data per rank, as in data-parallel training."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    tokens = torch.randint(0, spec.config.vocab_size, (spec.batch, spec.config.max_seq_len + 1), generator=g)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    backward: Optional[Callable[[torch.Tensor], None]] = None,
) -> Callable[[], torch.Tensor]:
    """A closure running one full step: forward, loss, backward, optimizer step, zero_grad.

    ``backward`` replaces ``loss.backward()`` (accelerate's ``Accelerator.backward``). Logits are
    upcast for the loss so bf16 runs compute the same fp32 cross-entropy as fp32 runs.
    """
    inputs, targets = batch

    def step() -> torch.Tensor:
        loss = lm_loss(model(inputs).float(), targets)
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def hand_written_fully_shard(model: GPT, mp: str = "fp32", reshard_after_forward: bool = True) -> GPT:
    """The reference a careful user writes by hand: per-unit ``fully_shard``, bottom-up.

    Blocks, then ``[tok_emb, pos_emb, norm, head]`` in one unit (the tied embedding/head must
    share one), then the root; the same ``MixedPrecisionPolicy`` on every call. The mesh is
    built directly with ``init_device_mesh``, not through zeta_fsdp.
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    policy = resolve_mixed_precision(mp)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(
        [model.tok_emb, model.pos_emb, model.norm, model.head],
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=policy,
    )
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


# ---------------------------------------------------------------------------------------------
# Timing


def gather_max(values: Sequence[float]) -> list[float]:
    """Element-wise max over ranks: a synchronous step takes as long as its slowest rank."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed_max(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes on the slowest rank; all ranks start it together (barrier)."""
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    return gather_max([time.perf_counter() - start])[0]


def gather_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum over ranks (CPU seconds the whole job spent)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def interleaved_block_times(
    steps: dict[str, Callable[[], Any]], *, blocks: int, steps_per_block: int, warmup: int = 2
) -> dict[str, dict[str, list[float]]]:
    """Per-block step times of each variant, blocks interleaved A B C, C B A, A B C ...

    Running the variants in alternating short blocks within one run cancels slow drift (other
    jobs on the shared cores) that would bias back-to-back runs; reversing the order every
    block cancels "who runs first after the switch" effects. Two clocks per block:

    * ``"wall"``: the block's median step seconds, max over ranks (a synchronous step takes as
      long as its slowest rank);
    * ``"cpu"``: CPU seconds per step (``time.process_time``: every thread of the process,
      gloo's polling threads included), summed over ranks. Time spent descheduled by other
      tenants does not count, so it is steadier than the wall clock on a shared machine.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for b in range(blocks):
        for name in names if b % 2 == 0 else reversed(names):
            start = time.process_time()
            wall[name].append(median_step_seconds(steps[name], steps=steps_per_block, warmup=0))
            cpu[name].append((time.process_time() - start) / steps_per_block)
    return {name: {"wall": gather_max(wall[name]), "cpu": gather_sum(cpu[name])} for name in names}


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Median, min and max over blocks of ``a[i] / b[i]`` (paired blocks share the same drift)."""
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": median(ratios), "min": min(ratios), "max": max(ratios)}


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of per-block medians: how much the machine moved during the run."""
    return (max(values) - min(values)) / median(values)


def timing_table(
    times: dict[str, dict[str, list[float]]], references: Sequence[str]
) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    """Headers, rows and JSON data comparing every variant's step time with each of ``references``.

    Ratios are the median over blocks of the paired per-block ratio (a block of A and the
    adjacent block of B saw the same machine state), with their range across blocks.
    """
    headers = ["variant", "median step ms (wall)", "block spread (wall)", "CPU ms/step (all ranks)"]
    for ref in references:
        headers += [f"wall ratio vs {ref}", f"CPU ratio vs {ref}"]
    rows, data = [], {}
    for name, t in times.items():
        row = [
            name,
            f"{median(t['wall']) * 1e3:.1f}",
            f"{spread(t['wall']) * 100:.0f} %",
            f"{median(t['cpu']) * 1e3:.1f}",
        ]
        data[name] = {
            "median_wall_s": finite(median(t["wall"])),
            "median_cpu_s": finite(median(t["cpu"])),
            "block_wall_s": t["wall"],
            "block_cpu_s": t["cpu"],
        }
        for ref in references:
            ratios = {clock: paired_ratio(t[clock], times[ref][clock]) for clock in ("wall", "cpu")}
            row += ["1" if name == ref else fmt_ratio(ratios[clock]) for clock in ("wall", "cpu")]
            data[name][f"vs {ref}"] = ratios
        rows.append(row)
    return headers, rows, data


def timing_note(blocks: int, steps_per_block: int) -> str:
    return (
        f"Timing: {blocks} blocks x {steps_per_block} steps per variant in one run, variants alternating block by "
        "block (order reversed every block). Wall: each block's median step, max over ranks. CPU: process CPU "
        "seconds per step summed over ranks (gloo's polling threads included; time a rank spends descheduled "
        "by other jobs is not). Block spread = (max - min) / median of the per-block wall medians: how much "
        "the machine moved. Ranges in parentheses are over single blocks: read the median, not one block."
    )


# ---------------------------------------------------------------------------------------------
# Results files


def fmt_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.2f}"


def fmt_collectives(counts: dict[str, int]) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(counts.items())) or "none"


def fmt_ratio(r: dict[str, float]) -> str:
    return f"{r['median']:.3f} (blocks {r['min']:.3f}-{r['max']:.3f})"


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def machine_info() -> dict[str, str]:
    """What the results depend on: cores available, CPU model, torch, Python, date, commit."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))  # what `nproc` prints: the cores we may run on
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cores": str(cores),
        "cpu": cpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
    }


def reproduce_command(script: str, argv: Sequence[str], launcher: bool = True) -> str:
    """The command that reproduces this run (what a reader copies): torchrun, or plain python."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"python -m torch.distributed.run --standalone --nproc-per-node {world}" if launcher else "python"
    return " ".join([prefix, f"benchmarks/{script}", *(shlex.quote(a) for a in argv)])


@dataclass
class Report:
    """One results file: a title, the command, tables, notes; written as Markdown and JSON."""

    name: str
    title: str
    command: str
    what: str
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)
    load_start: str = field(default_factory=load_average)

    def table(self, caption: str, headers: list[str], rows: list[list[Any]]) -> None:
        self.tables.append((caption, headers, [[str(c) for c in row] for row in rows]))

    def markdown(self) -> str:
        m = machine_info()
        lines = [
            f"# {self.title}",
            "",
            self.what,
            "",
            "Reproduce (from the repository root):",
            "",
            "```bash",
            self.command,
            "```",
            "",
            f"- Machine: {m['cores']} CPU cores (`nproc`), {m['cpu']}",
            f"- torch {m['torch']}, Python {m['python']}, commit {m['commit']}",
            f"- Date: {m['date']}",
            f"- Load average (1/5/15 min) at start: {self.load_start}; at end: {load_average()}",
            "",
        ]
        for caption, headers, rows in self.tables:
            lines += [f"## {caption}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            lines.append("")
        for image in self.images:
            lines += [f"![{image}]({image})", ""]
        if self.notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(lines)

    def publish(self, out_dir: Path) -> None:
        """On rank 0 only: write the files and print the Markdown (the run's console summary)."""
        if is_rank0():
            path = self.write(out_dir)
            print(self.markdown())
            print(f"wrote {path}")

    def write(self, out_dir: Path) -> Path:
        """Write ``<name>.md`` and ``<name>.json`` (the figures, for tools and tests)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        md = out_dir / f"{self.name}.md"
        md.write_text(self.markdown())
        payload = {**self.data, "command": self.command, "machine": machine_info()}  # never a stale copy
        (out_dir / f"{self.name}.json").write_text(json.dumps(payload, indent=2, sort_keys=True, allow_nan=False))
        return md


def finite(x: float) -> float:
    """Refuse NaN/inf early: a results file must never record a broken measurement."""
    if not math.isfinite(x):
        raise ValueError(f"non-finite measurement: {x}")
    return x


# ---------------------------------------------------------------------------------------------
# Launching


def add_timing_args(parser: argparse.ArgumentParser, *, blocks: int, steps_per_block: int) -> None:
    """``--blocks`` / ``--steps-per-block`` of ``interleaved_block_times``, with this script's defaults."""
    parser.add_argument("--blocks", type=int, default=blocks, help="interleaved timing blocks per variant")
    parser.add_argument("--steps-per-block", type=int, default=steps_per_block, help="timed steps per block")


def bench_parser(description: str, default_nproc: Optional[int] = 2) -> argparse.ArgumentParser:
    """Arguments every benchmark takes: ``--quick``, ``--out``, ``--nproc`` (launcher mode; none if ``None``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny model, few steps (figures meaningless)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default benchmarks/results; a temp folder with --quick so smoke runs never "
        "overwrite recorded results)",
    )
    if default_nproc is not None:
        parser.add_argument(
            "--nproc", type=int, default=default_nproc, help="ranks to launch when started without torchrun"
        )
    return parser


def out_dir(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if args.quick:
        return Path(tempfile.gettempdir()) / "zeta_fsdp_bench_quick"
    return RESULTS_DIR


def under_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def launch_ranks(script: Path, nproc: int, argv: Sequence[str], timeout: Optional[float] = None) -> int:
    """Run ``script`` on ``nproc`` local ranks with torchrun; returns its exit status.

    One thread per rank when ranks share the cores (more would only oversubscribe them).
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    return subprocess.run([*cmd, *argv], cwd=ROOT, env=env, timeout=timeout).returncode


def drop_option(argv: Sequence[str], name: str) -> list[str]:
    """``argv`` without option ``name`` and its value (``--name V`` or ``--name=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def launcher_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` (the ranks do not need it)."""
    return drop_option(argv, "--nproc")


def setup_rank() -> None:
    """Join the torchrun job (gloo on CPU) and use the cores this rank fairly owns."""
    ensure_process_group(torch.device("cpu"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = int(machine_info()["cores"])
    torch.set_num_threads(max(1, cores // local))


def run_benchmark(
    rank_main: Callable[[argparse.Namespace], None],
    parser: argparse.ArgumentParser,
    argv: Optional[Sequence[str]] = None,
) -> None:
    """Entry point: launch ranks (plain ``python``) or be one (under torchrun).

    A rank ends with ``zeta_fsdp.shutdown(force=True)`` (barrier + store counter, then destroy):
    gloo teardown is racy otherwise. A rank that raised does not reach it; torchrun stops its
    peers.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if not under_torchrun():
        sys.exit(launch_ranks(Path(sys.argv[0]).resolve(), args.nproc, launcher_argv(argv)))
    setup_rank()
    args.command = reproduce_command(Path(sys.argv[0]).name, launcher_argv(argv))
    args.out_dir = out_dir(args)
    rank_main(args)
    shutdown(force=True)

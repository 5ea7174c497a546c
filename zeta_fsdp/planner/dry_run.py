"""Dry run: the real ``fsdp()`` on a meta copy under PyTorch's fake process group, in a subprocess.

Checks the memory estimate (``plan(..., dry_run=True)``) against what ``fsdp()`` builds, at any
world size, on one CPU: nothing allocated, nothing communicated. The job's size and mesh (and the
dtype names the subprocess reads) are resolved here for ``plan()`` too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..distributed import expected_world_size, fake_process_group, without_launcher_env
from ..engines import fsdp_param_groups
from ..options import mesh_shape, resolve_master_dtype, resolve_mixed_precision, resolve_sharding
from ..wrapping import BlockSpec, block_specs

__all__ = ["DryRunResult", "dry_run", "dry_run_batch", "dry_run_job", "dtype_name", "resolve_world_and_mesh"]

# Default GPUs per node for HYBRID meshes when planning a cluster from a laptop.
DEFAULT_LOCAL_WORLD_SIZE = 8


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``; ``"none"`` for ``None``."""
    return "none" if dtype is None else str(dtype).replace("torch.", "")


def resolve_world_and_mesh(
    spec: Any, world_size: Optional[int], replicate_size: Optional[int], local_world_size: Optional[int], caller: str
) -> tuple[int, tuple[int, ...]]:
    """The job's world size (the launcher's when ``None``) and the mesh ``fsdp()`` would build (``plan`` too)."""
    world_size = expected_world_size() if world_size is None else world_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{caller}(): world_size={world_size!r} is not accepted. Accepted: a positive int.")
    local = min(world_size, DEFAULT_LOCAL_WORLD_SIZE) if local_world_size is None else local_world_size
    return world_size, mesh_shape(
        spec, world_size, local_world_size=local, replicate_size=replicate_size, caller=caller
    )


@dataclasses.dataclass(frozen=True)
class DryRunResult:
    """What the real ``fsdp()`` produced on a meta copy under the fake process group (one rank).

    Attributes:
        world_size, rank, mesh_shape: the simulated job and the rank looked at.
        param_bytes: that rank's sharded parameter storage; local_param_bytes: its ``to_local()`` sizes.
        num_units: FSDP parameter groups ``fsdp()`` created.
        wrap_seconds: wall time of the ``fsdp()`` call; load_seconds: unpickling the meta copy.

    Example:
        dry_run(model, world_size=1024).wrap_seconds
    """

    world_size: int
    rank: int
    mesh_shape: tuple[int, ...]
    param_bytes: int
    local_param_bytes: int
    num_units: int
    wrap_seconds: float
    load_seconds: float


def _meta_copy(model: nn.Module) -> nn.Module:
    """A ``meta`` deep copy of ``model``: ``deepcopy``'s memo holds a meta twin of every tensor, so no
    real storage is touched (and tied parameters stay tied: one object, one twin)."""
    memo: dict[int, Any] = {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def dry_run(
    model: nn.Module,
    world_size: int,
    shard_strat: Any = "FULL_SHARD",
    mp: Union[str, MixedPrecisionPolicy] = "fp32",
    auto_wrap: bool = True,
    TransformerBlock: BlockSpec = None,  # noqa: N803 - the same name as fsdp()
    *,
    rank: int = 0,
    replicate_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
    ignored_param_names: Iterable[str] = (),
    timeout_s: float = 600.0,
) -> DryRunResult:
    """Run the real ``fsdp()`` on a meta copy of ``model`` as ``rank`` of a fake ``world_size`` job.

    One subprocess, the ``"fake"`` backend: no communication, nothing allocated (the model stays on
    ``meta``). Reports the sharded parameter bytes that rank would hold and the wrap time. The
    model's classes must be importable (not from ``__main__``): the copy is pickled to the subprocess.

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
        >>> result = dry_run(model, 1024, "HYBRID_SHARD")
        >>> from zeta_fsdp.planner import plan
        >>> result.mesh_shape, result.param_bytes == plan(model, 1024, "HYBRID_SHARD").param_bytes
        ((128, 8), True)
    """
    args = (world_size, shard_strat, mp, auto_wrap, TransformerBlock, rank, replicate_size, local_world_size)
    return dry_run_batch(model, [dry_run_job(*args, ignored_param_names=ignored_param_names)], timeout_s=timeout_s)[0]


def dry_run_job(
    world_size: int,
    shard_strat: Any = "FULL_SHARD",
    mp: Union[str, MixedPrecisionPolicy] = "fp32",
    auto_wrap: bool = True,
    transformer_block: BlockSpec = None,
    rank: int = 0,
    replicate_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
    ignored_param_names: Iterable[str] = (),
    master_dtype: Union[str, torch.dtype, None] = "fp32",
) -> dict[str, Any]:
    """Validate one dry-run configuration and turn it into plain JSON for the subprocess."""
    policy = resolve_mixed_precision(mp, caller="dry_run")
    master = resolve_master_dtype(master_dtype, caller="dry_run")
    spec = resolve_sharding(shard_strat, caller="dry_run")
    world_size, shape = resolve_world_and_mesh(spec, world_size, replicate_size, local_world_size, "dry_run")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"dry_run(): rank={rank!r} is not accepted. Accepted: an int in [0, {world_size - 1}].")
    blocks = [] if transformer_block is None else block_specs(transformer_block, "dry_run")
    # picklable for the subprocess: fully qualified class names
    names = [b if isinstance(b, str) else f"{b.__module__}.{b.__qualname__}" for b in blocks]
    return {
        "world_size": world_size,
        "rank": rank,
        "shard_strat": spec.name,
        "replicate_size": shape[0] if len(shape) == 2 else None,
        "param_dtype": dtype_name(policy.param_dtype),
        "reduce_dtype": dtype_name(policy.reduce_dtype),
        "auto_wrap": auto_wrap,
        "transformer_block": names if transformer_block is not None else None,
        "ignored_param_names": list(ignored_param_names),
        "master_dtype": dtype_name(master),
    }


def dry_run_batch(model: nn.Module, jobs: list[dict[str, Any]], *, timeout_s: float = 600.0) -> list[DryRunResult]:
    """Run several dry-run jobs (from ``dry_run_job``) in one subprocess: start-up dominates."""
    in_main = sorted({type(m).__name__ for m in model.modules() if type(m).__module__ == "__main__"})
    if in_main:
        raise ValueError(
            f"dry_run(): module classes defined in __main__ ({', '.join(in_main)}) cannot be loaded by the "
            "dry-run subprocess; define them in an importable module."
        )
    env = without_launcher_env()  # the child runs its own fake job, never joins ours
    # The child must import what the parent imports (the model's classes, this package): parent's path first.
    paths = [p for p in sys.path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="zeta_fsdp_dry_run_") as tmp:
        torch.save(_meta_copy(model), Path(tmp) / "model.pt")
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        code = "import sys; from zeta_fsdp.planner.dry_run import run_child; run_child(sys.argv[1])"
        proc = subprocess.run(
            [sys.executable, "-c", code, tmp], env=env, capture_output=True, text=True, timeout=timeout_s
        )
        out = Path(tmp) / "results.json"
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"dry_run(): the fake-process-group run failed (exit {proc.returncode}): {tail}")
        results = json.loads(out.read_text())
    return [DryRunResult(**{**r, "mesh_shape": tuple(r["mesh_shape"])}) for r in results]


def run_child(workdir: str) -> None:
    """Body of the dry-run subprocess (``python -c``): per job, a fake group, the real ``fsdp()``, measure."""
    from ..fsdp import fsdp

    torch.set_num_threads(1)
    results = []
    for job in json.loads((Path(workdir) / "jobs.json").read_text()):
        start = time.perf_counter()
        model = torch.load(Path(workdir) / "model.pt", weights_only=False)
        load_seconds = time.perf_counter() - start
        with fake_process_group(job["world_size"], job["rank"]):
            results.append(_dry_run_one(fsdp, model, job, load_seconds))
    (Path(workdir) / "results.json").write_text(json.dumps(results))


def _dry_run_one(fsdp: Any, model: nn.Module, job: dict[str, Any], load_seconds: float) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    dtypes = {k: None if job[k] == "none" else getattr(torch, job[k]) for k in job if k.endswith("_dtype")}
    policy = MixedPrecisionPolicy(param_dtype=dtypes["param_dtype"], reduce_dtype=dtypes["reduce_dtype"])
    block, ignored = job["transformer_block"], {model.get_parameter(n) for n in job["ignored_param_names"]}
    options = {k: job[k] for k in ("auto_wrap", "shard_strat", "replicate_size")}
    options.update(TransformerBlock=tuple(block) if block else None, ignored_params=ignored or None)
    start = time.perf_counter()
    # materialize=False: allocating every shard would cost gigabytes; the dry run only inspects the sharding
    fsdp(model, mp=policy, device="cpu", materialize=False, master_dtype=dtypes["master_dtype"], **options)
    wrap_seconds = time.perf_counter() - start
    storage = local = 0
    mesh: tuple[int, ...] = ()
    for param in model.parameters():
        sharded = isinstance(param, DTensor)
        tensor = param.to_local() if sharded else param
        mesh, size = (tuple(param.device_mesh.shape) if sharded else mesh), tensor.numel() * tensor.element_size()
        local += size
        storage += tensor.untyped_storage().nbytes() if sharded else size  # a shard's own padded storage
    groups = {id(group) for m in model.modules() for group in fsdp_param_groups(m) or ()}
    result = DryRunResult(job["world_size"], job["rank"], mesh, storage, local, len(groups), wrap_seconds, load_seconds)
    return dataclasses.asdict(result)

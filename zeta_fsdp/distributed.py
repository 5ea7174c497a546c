"""Process group start-up, device and backend choice, DeviceMesh construction, clean shutdown.

Every ``torch.distributed`` set-up call of the package lives here. The rules:

* A group that already exists is used as is and never destroyed by us.
* No group: start one from ``torchrun``'s environment variables when they are set, otherwise a
  one-process group on an in-memory store (no port, no env vars) so a notebook just works.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .cpu_threads import share_cores
from .options import ShardingSpec, mesh_shape, resolve_mesh_shape, validate_mesh  # mesh_shape: documented here

__all__ = ["LAUNCHER_ENV_VARS", "comm_device", "get_rank", "get_world_size", "is_distributed", "process_group_of"]
__all__ += ["without_launcher_env", "choose_device", "ensure_process_group", "expected_world_size"]
__all__ += ["fake_process_group", "mesh_shape", "build_mesh", "build_dp_tp_mesh", "init_mesh", "shutdown"]
__all__ += ["shard_group_size", "mesh_groups"]
__all__ += ["local_world_size", "on_all_ranks", "validate_mesh"]

# Groups this package started, so shutdown() never tears down one the user made.
_CREATED_BY_US: dict[str, Any] = {"group": None, "shutdowns": 0}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What a launcher (torchrun, SLURM via torchrun) sets for each rank: a process we start must not
# inherit them, or it would join (or wait for) the job that started us.
LAUNCHER_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

GroupLike = Union[dist.ProcessGroup, DeviceMesh, None]


def is_distributed() -> bool:
    """``True`` when a default process group exists (``torch.distributed`` is built and initialized)."""
    return dist.is_available() and dist.is_initialized()


def process_group_of(group: GroupLike) -> Optional[dist.ProcessGroup]:
    """The process group of a 1-D mesh; a process group (or ``None``: the world) as given."""
    return group.get_group() if isinstance(group, DeviceMesh) else group


def get_rank(group: GroupLike = None) -> int:
    """This process's rank in ``group`` (a process group or a 1-D mesh; default: the world); 0 without a group."""
    return dist.get_rank(process_group_of(group)) if is_distributed() else 0


def get_world_size(group: GroupLike = None) -> int:
    """Ranks in ``group`` (a process group or a 1-D mesh; default: the world); 1 without a group."""
    return dist.get_world_size(process_group_of(group)) if is_distributed() else 1


def _has_cpu_backend(group: GroupLike = None) -> bool:
    """Can ``group`` run collectives on CPU tensors? A plain backend name: all but nccl; a device map
    (``"cuda:nccl,cpu:gloo"``): only with a ``cpu:`` entry."""
    backend = str(dist.get_backend(process_group_of(group)))
    return "cpu:" in backend if ":" in backend else backend != "nccl"


def comm_device(group: GroupLike = None) -> torch.device:
    """Where a tensor must live for a collective of ``group``: the current CUDA device when its backend
    takes no CPU tensors (NCCL), else the CPU (also without a process group)."""
    if is_distributed() and not _has_cpu_backend(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def without_launcher_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) without the launcher's per-rank variables
    (``LAUNCHER_ENV_VARS``): for a subprocess that must start its own job, not join ours."""
    env = dict(os.environ if env is None else env)
    for var in LAUNCHER_ENV_VARS:
        env.pop(var, None)
    return env


def _running_under_torchrun() -> bool:
    """``True`` when a launcher set the rendezvous variables. An incomplete set is an error: else
    ``WORLD_SIZE=8`` without ``MASTER_ADDR`` would quietly start eight one-process jobs, each training alone."""
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if present and len(present) < len(_TORCHRUN_VARS) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise ValueError(
            f"fsdp(): the environment sets {present} but not {missing}: a multi-process launch needs all of "
            f"{list(_TORCHRUN_VARS)} (torchrun sets them). Unset WORLD_SIZE for a one-process run."
        )
    return len(present) == len(_TORCHRUN_VARS)


def expected_world_size() -> int:
    """World size the job has or will have, without starting anything."""
    if is_distributed():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if _running_under_torchrun() else 1


def local_world_size() -> int:
    """Ranks per node the job has or will have (``LOCAL_WORLD_SIZE``, else the world size)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", expected_world_size()))


def _visible_cuda(index: int) -> torch.device:
    """``cuda:index``, or a ``RuntimeError`` naming what this process sees when that device is not visible
    (more ranks per node than GPUs, or ``CUDA_VISIBLE_DEVICES`` hiding it)."""
    count = torch.cuda.device_count()
    if index >= count:
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "<unset>")
        raise RuntimeError(
            f"fsdp(): this node runs LOCAL_WORLD_SIZE={local_world} rank(s), one CUDA device each, and this rank "
            f"(LOCAL_RANK={os.environ.get('LOCAL_RANK', '<unset>')}) needs cuda:{index}, but the process sees "
            f"{count} CUDA device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). "
            f"Start at most {count} process(es) per node (torchrun --nproc-per-node {max(count, 1)}), or train on "
            "CPU: fsdp(..., device='cpu') or CUDA_VISIBLE_DEVICES=''."
        )
    return torch.device("cuda", index)


def _local_cuda() -> torch.device:
    """``cuda:LOCAL_RANK``, checked on every local rank alike: when the node has more local ranks than
    GPUs, each of them raises (not only the ranks past the last GPU, which would leave the others waiting)."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    _visible_cuda(max(local_rank, local_world - 1))
    return torch.device("cuda", local_rank)


def _group_device_type() -> Optional[str]:
    """``"cuda"`` or ``"cpu"``: what the existing default group's backend computes on (``None`` without one).
    A gloo-only group means CPU: the caller chose it, even on a host with GPUs."""
    if not is_distributed():
        return None
    backend = str(dist.get_backend())
    return "cuda" if ("cuda:" in backend or backend == "nccl") else "cpu"


def choose_device(model: Optional[nn.Module] = None, device: Union[str, torch.device, None] = None) -> torch.device:
    """The device this rank computes on.

    ``device`` when given (``"cuda"`` means ``cuda:LOCAL_RANK``); else what an existing process group's
    backend runs on (a gloo-only group: CPU; NCCL: ``cuda:LOCAL_RANK``); else ``cuda:LOCAL_RANK`` when CUDA
    is available; else the device the model's parameters are on (``meta`` counts as not chosen: CPU). A CUDA
    device this process cannot see raises a ``RuntimeError`` naming ``LOCAL_RANK``, the device count and
    ``CUDA_VISIBLE_DEVICES``.

    Example:
        >>> choose_device(device="cpu")
        device(type='cpu')
    """
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return device
        return _local_cuda() if device.index is None else _visible_cuda(device.index)
    group_type = _group_device_type()
    if group_type == "cuda" or (group_type is None and torch.cuda.is_available()):
        return _local_cuda()
    if model is not None and group_type is None:
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.device.type not in ("meta", "cpu"):
                return tensor.device
    return torch.device("cpu")


def ensure_process_group(
    device: torch.device, *, cpu_offload: bool = False, timeout_s: float = 1800, backend: Optional[str] = None
) -> bool:
    """Start the default process group if none exists (``True`` if this call started it): under ``torchrun``
    joining the job through ``env://``, otherwise a one-process group on an in-memory store."""
    if not dist.is_available():
        raise RuntimeError("fsdp(): this PyTorch build has no torch.distributed support.")
    if dist.is_initialized():
        if device.type == "cuda":
            # A group the user started: collectives and comm_device() use the current device, which
            # is cuda:0 on every rank until someone sets it.
            torch.cuda.set_device(device)
        if cpu_offload and device.type == "cuda" and not _has_cpu_backend():
            warnings.warn(
                "fsdp(cpu_offload=True): the existing process group has no CPU backend, so collectives on "
                "CPU-offloaded tensors (gradient-norm clipping, state-dict gathers) will fail. Start it "
                'with init_process_group("cuda:nccl,cpu:gloo").',
                stacklevel=3,
            )
        return False
    if backend is None:
        # gloo on CPU; on CUDA nccl plus gloo for CPU tensors: offloaded shards, DCP's async save
        # (it stages to CPU) and object collectives need a CPU backend, whatever this first call asks.
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    torchrun, restart = _running_under_torchrun(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if torchrun and restart not in ("", "0") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A torchrun restart (--max-restarts) reuses the agent's store, which still holds the first
        # attempt's gloo addresses (torch 2.13): new ranks would dial dead peers. Keys per attempt.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=kwargs["timeout"]
        )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        prefixed = dist.PrefixStore(f"zeta_fsdp/attempt_{restart}", store)
        dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world, **kwargs)
    elif torchrun:
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    _CREATED_BY_US["group"] = dist.group.WORLD
    share_cores(device, cpu_offload)  # CPU ranks on one machine: cores // local ranks threads each
    return True


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be ``rank`` of a simulated ``world_size``-rank job in the block (PyTorch's ``"fake"`` backend:
    collectives return at once, move nothing), so ``planner.dry_run`` can run ``fsdp()`` on a ``meta``
    model as any rank of any world size in one process. Refuses to replace an existing group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_process_group(): a process group already exists; it would be replaced.")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        # No peers to wait for (shutdown()'s store counter does not exist on a FakeStore).
        dist.destroy_process_group()


def build_mesh(spec: ShardingSpec, device: torch.device, *, replicate_size: Optional[int] = None) -> DeviceMesh:
    """Build the DeviceMesh ``spec`` needs over the default group (which must exist)."""
    shape = mesh_shape(spec, dist.get_world_size(), local_world_size=local_world_size(), replicate_size=replicate_size)
    return init_mesh(shape, device)


def shard_group_size(
    spec: ShardingSpec, mesh: Optional[DeviceMesh] = None, *, replicate_size: Optional[int] = None
) -> int:
    """Number of ranks one parameter is sharded over (the last mesh dimension) in this job."""
    shape = resolve_mesh_shape(spec, mesh, replicate_size, expected_world_size(), local_world_size())
    return shape[-1]


def mesh_groups(mesh: DeviceMesh) -> list[Optional[dist.ProcessGroup]]:
    """Groups whose collectives together reach every rank of ``mesh``: none for one rank, the default
    group (``None``) when the mesh spans the job (one collective sees every rank), else one group per mesh
    dimension of more than one rank (a 2-D sub-mesh: a value passed along both reaches every rank)."""
    if mesh.size() == 1:
        return []
    if mesh.size() == dist.get_world_size():
        return [None]
    return [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]


def init_mesh(shape: tuple[int, ...], device: torch.device) -> DeviceMesh:
    """A data-parallel mesh of ``shape`` (``options.mesh_shape``) over the default group: 1-D
    ``("dp_shard",)``, or 2-D ``("dp_replicate", "dp_shard")``."""
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def build_dp_tp_mesh(device: torch.device, dp: int, tp: int, *, names: tuple[str, str] = ("dp", "tp")) -> DeviceMesh:
    """A 2-D ``(dp, tp)`` mesh over the default group. Tensor-parallel ranks are adjacent (the last
    dimension), so they share a node when ``tp`` divides the ranks per node: TP's collectives stay on fast links."""
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=tuple(names))


def shutdown(*, force: bool = False, timeout_s: float = 300.0) -> None:
    """Leave the job cleanly: every rank waits for every other, then the group is destroyed.

    Destroys only a group this package started (``force=True`` for one you started yourself).
    A plain ``barrier()`` is not enough with gloo: the first rank out of it may destroy its group
    while a peer still finishes the barrier, and the peer aborts. So each rank also adds 1 to a
    counter in the rendezvous store and waits until all ranks have, before destroying.

    Example:
        >>> shutdown()  # at the end of a training script started by fsdp()
    """
    if not is_distributed():
        return
    ours = _CREATED_BY_US["group"] is not None and _CREATED_BY_US["group"] is dist.group.WORLD
    if not (force or ours):
        return
    # Models the script dropped may still sit in reference cycles holding the group (DDP's reducer
    # does): collected now, before the group goes, not during interpreter exit after it.
    gc.collect()
    world = dist.get_world_size()
    if world > 1:
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        # A fresh key per shutdown: the store can outlive a group (torchrun's agent store), and a
        # counter left at `world` by an earlier shutdown would let ranks leave without waiting.
        _CREATED_BY_US["shutdowns"] += 1
        key = f"zeta_fsdp/shutdown/{_CREATED_BY_US['shutdowns']}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        try:
            while store.add(key, 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)
        except (RuntimeError, dist.DistStoreError):
            # The store's host left: it only leaves after seeing every rank's increment.
            pass
    dist.destroy_process_group()
    _CREATED_BY_US["group"] = None


# Exception types rebuilt by name on every rank by on_all_ranks(); anything else becomes RuntimeError.
_SHARED_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError, OSError)
_SHARED_ERRORS += (TypeError, ValueError, NotImplementedError, RuntimeError)


def on_all_ranks(
    fn: Callable[[], Any],
    *,
    rank0_only: bool = False,
    errors: tuple[type, ...] = (),
    catch: tuple[type, ...] = (Exception,),
    default: type = RuntimeError,
    describe: Callable[[BaseException], str] = str,
) -> Any:
    """Run ``fn`` on every rank (or rank 0 only); if it raised anywhere, the same error is raised everywhere.

    A rank that raised alone would leave its peers waiting in their next collective, and a
    per-type ``except`` would see different types on different ranks. So each rank reports
    "ok or (type, message)" in one all-gather, and every rank raises an exception of the first
    failing rank's type (``errors`` adds types to the built-in ones; others become ``default``)
    with its message (``describe(error)``), chained to the original where it happened. Alone (no
    peers) the original is raised as it is. ``catch``: what counts as failing (DCP's
    ``CheckpointException`` is a ``BaseException``). Other ranks return ``None`` with ``rank0_only``.
    """
    world, me = get_world_size(), get_rank()
    result, error = None, None
    if me == 0 or not rank0_only:
        try:
            result = fn()
        except catch as e:  # re-raised below, on every rank
            error = e
    if world == 1:
        if error is not None:
            raise error  # alone: the original, as it is
        return result
    # Usually every rank succeeded: one all-reduce of a flag says so. The reports (pickled, two
    # all-gathers) travel only when some rank failed.
    failures = torch.tensor([0 if error is None else 1], device=comm_device())
    dist.all_reduce(failures)
    if not int(failures.item()):
        return result
    reports: list = [None] * world
    dist.all_gather_object(reports, None if error is None else (type(error).__name__, describe(error)))
    where, (name, message) = next((r, item) for r, item in enumerate(reports) if item is not None)
    known = {cls.__name__: cls for cls in (*_SHARED_ERRORS, *errors)}
    raised = known.get(name, default)(f"{message} (reported by rank {where})")
    raise raised from (error if where == me else None)

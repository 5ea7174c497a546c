"""DDP's engine (composable ``replicate``): NO_SHARD in fp32 or bf16 at DDP's speed.

``engines.SEAM``, as in ``engines.fully_shard``. Parameters stay plain tensors; gradients are
all-reduced in buckets, each ``.grad`` a view into its bucket (``gradient_as_bucket_view``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule  # noqa: N811 - torch names the class DDP
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..costs import AccumulationCost, accumulation_costs, peak_by_device
from ..options import autocast_dtype
from ..wrapping import WrapPlan
from .base import PlanTerms, WrapOptions
from .record import compute_device

# The name options.choose_engine gives this engine.
NAME = "replicate"
# DDP broadcasts rank 0's parameters when it is built, then every rank applies the same averaged
# gradient: any rank's copy of a parameter is every rank's.
REPLICAS_EQUAL = True
# mp="bf16" runs the forward under torch.autocast; parameters, gradients and all-reduce stay fp32.
AUTOCAST_MP = True


def managed(model: nn.Module) -> list[nn.Module]:
    """The modules in ``model`` (itself, or inside a container or ``torch.compile``'s wrapper) on ``replicate``."""
    return [m for m in model.modules() if isinstance(m, ReplicatedModule)]


def check(plan: WrapPlan, model: nn.Module, master: Optional[torch.dtype]) -> None:
    """Nothing to refuse: DDP buckets per dtype and has no units."""


def add_fp32_units(plan: WrapPlan, model: nn.Module, names: Sequence[str], caller: str = "fsdp") -> None:
    """No units: ``options.choose_engine`` never picks DDP's engine for fp32 modules under autocast,
    and in fp32 every parameter already computes in fp32."""


def mesh_for(options: WrapOptions) -> Optional[DeviceMesh]:
    """DDP runs over the default group: no mesh."""


def wrap(model: nn.Module, plan: WrapPlan, options: WrapOptions) -> int:
    """Put ``model`` on DDP's engine; ``mp="bf16"`` runs its forward under ``torch.autocast``
    (parameters, gradients and their all-reduce stay fp32: DDP + autocast). Returns 0 (no shard).

    DDP is built at the first forward (a ``meta`` model can be materialized or loaded first), then
    checks every rank's shapes and broadcasts rank 0's parameters; buffers are not broadcast
    (like FSDP2, a BatchNorm's running statistics stay each rank's own).
    """
    device = options.device
    if not any(t.is_meta for t in model.parameters()):
        model.to(device)
        # DDP would broadcast rank 0's parameters only at the first forward: a save_pretrained, a state dict
        # or a checkpoint taken before it would mix ranks' differently initialised rows. Broadcast now.
        broadcast_parameters(model)
    # The search for parameters a step leaves without a gradient runs every step: which ones a
    # step uses may change from step to step or rank to rank (routing, skipped layers), and
    # without the search DDP then all-reduces only some buckets, so the replicas drift apart
    # and a rank hangs or fails a step later. Its cost is one graph walk and one small all-reduce.
    replicate(model, device_id=device, gradient_as_bucket_view=True, find_unused_parameters=True)
    _quiet_search_notice(model)
    dtype = autocast_dtype(options.mp_policy)
    if dtype is not None:
        autocast_forward(model, device.type, dtype)
    return 0


def unfreeze_check(model: nn.Module, master: Optional[torch.dtype]) -> Callable[[], Optional[str]]:
    """``unfreeze.guard_unfreezing``'s check on DDP's engine: a parameter frozen when DDP built its
    all-reduce (the first forward) may not be unfrozen (its gradient would never be averaged)."""
    frozen: list[tuple[str, nn.Parameter]] = []
    built = [False]

    def check() -> Optional[str]:
        if not built[0]:  # DDP's reducer was built by this forward's own pre-hook, which ran before ours
            frozen.extend((n, p) for n, p in model.named_parameters() if not p.requires_grad)
            built[0] = True
            return None
        for name, param in frozen:
            if param.requires_grad:
                return (
                    f"{name} was frozen at the first forward, when DDP's engine (NO_SHARD) built its gradient "
                    "all-reduce, and requires a gradient now: its gradient would never be averaged across ranks. "
                    'Pass a (world, 1) DeviceMesh (fsdp(..., mesh=init_device_mesh(device, (world, 1), mesh_dim_names=("replicate", "shard"))): FSDP2\'s '
                    "engine, where unfreezing works), or keep it trainable through the first step and freeze "
                    "it after."
                )
        return None

    return check


def broadcast_parameters(model: nn.Module) -> None:
    """Rank 0's parameters on every rank of the default group (one broadcast per dtype), as DDP's first forward does."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        by_dtype.setdefault(p.dtype, []).append(p)
    with torch.no_grad():
        for params in by_dtype.values():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=0)
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run every forward of ``model`` under ``torch.autocast(device_type, dtype)``, also when it raises
    (``always_call``) or re-enters (a stack); checkpointing recomputes under the same state."""
    entered: list = []

    def enter(module: nn.Module, args: Any) -> None:
        entered.append(torch.autocast(device_type, dtype=dtype))
        entered[-1].__enter__()

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if entered:
            entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def _quiet_search_notice(model: nn.Module) -> None:
    """Keep DDP's one-time "find_unused_parameters=True ... did not find any unused parameters" notice
    off stderr: DDP's C++ reducer prints it (``TORCH_WARN_ONCE``, straight to fd 2, beyond Python's
    ``warnings``) advising to turn the search off, unsafe here (see ``wrap``). It prints only from DDP's
    post-forward step, so fd 2 points at ``/dev/null`` around that step of the first forward that syncs,
    then both hooks go. (A later step that uses every parameter, after a first that did not, may print it.)
    """
    saved: list[int] = []

    @torch.compiler.disable
    def quiet(module: nn.Module, args: Any, output: Any) -> None:
        ddp = replicate.state(module)._ddp
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            sys.stderr.flush()
            saved.append(os.dup(2))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)

    @torch.compiler.disable
    def restore(module: nn.Module, args: Any, output: Any) -> None:
        if saved:
            fd = saved.pop()
            os.dup2(fd, 2)
            os.close(fd)
            for handle in handles:
                handle.remove()

    handles = [
        model.register_forward_hook(quiet, prepend=True),  # before replicate's own post-forward hook
        model.register_forward_hook(restore, always_call=True),  # after it, also when it raises
    ]


@contextlib.contextmanager
def no_sync(model: nn.Module, reduce: bool) -> Iterator[None]:
    """``training.no_sync``: either choice defers DDP's one collective, the all-reduce.

    DDP decides at each forward, so the forward must run inside the block (as with
    ``DistributedDataParallel.no_sync``). Settings are restored on exit: nested blocks nest.
    """
    modules = managed(model)
    was_off = [bool(getattr(replicate.state(m), "_no_sync", False)) for m in modules]
    for module in modules:
        module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for module, off in zip(modules, was_off):
            module.set_requires_gradient_sync(not off)


# DDP's defaults (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``).
_FIRST_BUCKET_BYTES = 1024 * 1024
_BUCKET_BYTES = 25 * 1024 * 1024


def all_reduces(grads: list[tuple[torch.dtype, int]]) -> int:
    """All-reduces per synced backward for gradients of these ``(dtype, bytes)``, in parameter order.

    One per bucket (``_compute_bucket_assignment_by_size``: one open bucket per dtype, closed at
    1 MiB for the first, 25 MiB after; with the unused-parameter search DDP keeps that order), plus
    one for the search's map of used parameters.
    """
    limits: dict[torch.dtype, int] = {}
    open_bytes: dict[torch.dtype, int] = {}
    closed = 0
    for dtype, nbytes in grads:
        open_bytes[dtype] = open_bytes.get(dtype, 0) + nbytes
        if open_bytes[dtype] >= limits.get(dtype, _FIRST_BUCKET_BYTES):
            closed += 1
            open_bytes[dtype] = 0
            limits[dtype] = _BUCKET_BYTES
    return closed + sum(1 for b in open_bytes.values() if b) + 1


def accumulation_bytes(model: nn.Module, micro_batches: int) -> dict[str, AccumulationCost]:
    """Gradients are whole and accumulate in place in DDP's buckets whatever the choice; the
    collectives are all-reduces (``all_reduces``)."""
    grads = [p for p in model.parameters() if p.requires_grad]
    whole = sum(p.numel() * p.element_size() for p in grads)
    return _whole_grads(micro_batches, whole, all_reduces([(p.dtype, p.numel() * p.element_size()) for p in grads]))


def _whole_grads(micro_batches: int, whole: int, all_reduce_count: int) -> dict[str, AccumulationCost]:
    """Every choice keeps the same whole gradients, in DDP's buckets."""
    return accumulation_costs(
        micro_batches,
        sharded=whole,
        unsharded=whole,
        partial=whole,
        reduce_scatter_units=0,
        all_reduce_units=all_reduce_count,
    )


def gradient_bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets, which every ``.grad`` views (0 before DDP's first forward)."""
    total = 0
    for module in managed(model):
        ddp = getattr(replicate.state(module), "_ddp", None)  # DistributedDataParallel, built at the first forward
        if ddp is not None:  # DDP's own record of the buckets it allocated (a comma-separated string)
            sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
            total += sum(int(n) for n in sizes.split(",") if n.strip())
    return total


# MemTracker's categories under FSDPMemTracker's names (a rank's "shard" is the whole tensor here), so
# one table reads the same for both engines. "Other" is what track_external(inputs) records.
_MEMTRACKER_NAMES = {
    "Parameter": "Sharded Param",
    "Gradient": "Sharded Grad",
    "Optstate": "OptState",
    "Other": "Inputs",
}


def memtracker_categories(snapshot: dict) -> dict[str, int]:
    """One device's ``MemTracker`` snapshot under ``FSDPMemTracker``'s category names."""
    names = {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items()}
    return {_MEMTRACKER_NAMES.get(k, k): v for k, v in names.items()}


def peak_memory(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], step: Callable[[], Any], inputs: tuple
) -> dict[str, int]:
    """``measure.peak_memory_by_category`` with ``MemTracker``. DDP's buckets stay allocated from
    its first forward; a step starting with no ``.grad`` (views into them) shows the tracker none,
    so they are added to ``"Sharded Grad"`` and ``"Total"``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    grads_set = any(p.grad is not None for p in model.parameters())
    tracker = MemTracker()
    tracker.track_external(*(t for t in (model, optimizer) if t is not None), *inputs)
    with tracker:
        step()
    result = peak_by_device(tracker.get_tracker_snapshot("peak"), compute_device(model), memtracker_categories)
    if not grads_set:
        buckets = gradient_bucket_bytes(model)
        result["Sharded Grad"] = result.get("Sharded Grad", 0) + buckets
        result["Total"] = result.get("Total", 0) + buckets
    return result


def _autocast_copies(model: nn.Module, policy: MixedPrecisionPolicy) -> int:
    """Bytes of the copies ``torch.autocast`` makes under ``mp="bf16"``: Linear/conv weights and
    biases, cast once per forward and kept by autograd for backward (embeddings, norms stay fp32)."""
    dtype = autocast_dtype(policy)
    if dtype is None:
        return 0
    kinds = (nn.Linear, nn.modules.conv._ConvNd)
    cast = {p for m in model.modules() if isinstance(m, kinds) for p in m.parameters(recurse=False)}  # ties once
    return sum(p.numel() * dtype.itemsize for p in cast if p.requires_grad and p.is_floating_point())


def plan_costs(terms: PlanTerms) -> tuple[int, int, list[str]]:
    """The planner's engine terms: ``(all-gather peak, all-reduces per synced backward, notes)``.

    Nothing is gathered: DDP computes with the parameters themselves; under autocast the
    low-precision weight copies stand in the all-gather's place. A planned model has not run, so
    it is counted as one that uses every parameter (no unused-parameter search).
    """
    copies = _autocast_copies(terms.model, terms.policy)
    notes = [
        f"engine: replicate ({terms.why}): plain tensor parameters used in place, gradients are views "
        "of DDP's all-reduce buckets (no second copy)"
    ]
    if copies:
        notes.append(
            f"autocast: {copies:,} bytes of low-precision copies of Linear/conv weights, cached for "
            "the forward and kept by autograd until backward (in 'all-gather peak')"
        )
    return copies, all_reduces(terms.grads), notes


def plan_accumulation(plan: Any, micro_batches: int) -> dict[str, AccumulationCost]:
    """``MemoryPlan.accumulation``: whole gradients in DDP's buckets; DDP only all-reduces."""
    return _whole_grads(micro_batches, plan.grad_bytes, plan.ddp_all_reduce_count)

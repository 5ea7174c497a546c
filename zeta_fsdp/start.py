"""One start on every rank: every rank begins from the first rank's parameters and buffers, as DDP does.

Scripts seed each rank differently (``torch.manual_seed(1337 + rank)``, nanoGPT's habit) before they build
the model. DDP broadcasts rank 0's weights, but a sharded rank keeps its own rows of its own init: the
tensors would mix ranks' inits. ``fsdp()`` calls ``start_from_first_rank`` before sharding (and once more
on what a ``meta`` model materialized). Cheaply: each rank fingerprints its tensors bit for bit
(``tensor_fingerprint``: integer sums of the bits, the same on every CPU and GPU), one all-gather of the
fingerprints per mesh dimension compares them, and only the tensors that differ are broadcast from the
group's first rank. Along a 2-D ``(replicate, shard)`` mesh each dimension's group is synced in turn, so
every rank ends with mesh coordinate ``(0, 0)``'s values. One process: nothing happens.

Its own module, not ``distributed``'s: that one sets up groups and meshes; this one moves model state
over them (``distributed`` gives it the groups' communication device).

Example:
    >>> import torch.nn as nn
    >>> start_from_first_rank(nn.Linear(2, 2))  # one process: no collective, nothing replaced
    Start(replaced=[], on_meta=[])
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .distributed import comm_device, get_world_size, is_distributed
from .torch_compat import all_gather_single, local_tensor

__all__ = ["Start", "start_from_first_rank", "tensor_fingerprint"]

# The bits are read as words (int32; int16 or bytes for 2- and 1-byte dtypes) laid out in rows of
# ``_COLUMNS``, up to ``CHUNK_ROWS`` rows widened to int64 at a time: a word is below 2**31, a row's sum
# below 2**37, a chunk's row-weighted sum below 2**61: exact in int64 (2 MiB a chunk).
_COLUMNS = 64
CHUNK_ROWS = 2**12
# Fingerprint sums are reduced modulo this prime (2**61 - 1) so they fit an int64 for the all-gather.
_MODULUS = 2**61 - 1
# Differing tensors travel as bytes in buckets of at most this size (one broadcast each).
BUCKET_BYTES = 64 * 2**20
_ALIGN = 16  # each tensor's offset in a bucket: any dtype's view of the bytes is aligned


@dataclasses.dataclass
class Start:
    """What ``start_from_first_rank`` did on this rank: the tensors it overwrote with the first rank's
    values, and those it skipped because they are on ``meta`` (synced after materialization)."""

    replaced: list[str]
    on_meta: list[str]


Fingerprint = tuple[int, int, int, int, int]


def tensor_fingerprint(tensor: torch.Tensor, *, chunk_rows: int = CHUNK_ROWS) -> Fingerprint:
    """``(numel, element size, sum, column-weighted sum, row-weighted sum)`` of ``tensor``'s bits.

    The bits, in row-major order, are read as int32 words (int16 for 2-byte dtypes, bytes for bool, int8,
    fp8) laid out in rows of 64: ``sum`` adds the words, the weighted sums weight each word by its column
    (1 to 64) and by its row (from 1). Integer arithmetic only, exact in int64 chunk by chunk (see
    ``CHUNK_ROWS``), combined in Python modulo ``2**61 - 1``: the same value on every CPU and GPU, for any
    strides and any ``chunk_rows`` (1 to ``CHUNK_ROWS``). One element changed changes the sum; two words
    swapped change a weighted sum. A DTensor gives its local tensor's fingerprint.

    Example:
        >>> tensor_fingerprint(torch.tensor([1.0, 2.0]))
        (2, 4, 2139095040, 3212836864, 2139095040)
    """
    rows = min(max(chunk_rows, 1), CHUNK_ROWS)  # more rows per chunk could overflow int64
    local = local_tensor(tensor).detach()
    itemsize = local.element_size()
    word = torch.uint8 if itemsize == 1 else torch.int16 if itemsize == 2 else torch.int32
    words = _dense(local).view(word)  # a strided tensor is copied whole (one tensor at a time)
    weights = torch.arange(1, max(rows, _COLUMNS) + 1, dtype=torch.int64, device=words.device)
    total = by_column = by_row = 0
    for start in range(0, words.numel(), rows * _COLUMNS):
        piece = words[start : start + rows * _COLUMNS].to(torch.int64)
        if piece.numel() % _COLUMNS:  # the last row: zeros add nothing
            piece = F.pad(piece, (0, -piece.numel() % _COLUMNS))
        grid = piece.view(-1, _COLUMNS)
        row_sums = grid.sum(dim=1)
        parts = [row_sums.sum(), grid.sum(dim=0) @ weights[:_COLUMNS], row_sums @ weights[: grid.shape[0]]]
        chunk_total, chunk_by_column, chunk_by_row = (int(v) for v in torch.stack(parts).tolist())
        total += chunk_total
        by_column += chunk_by_column
        by_row += chunk_by_row + (start // _COLUMNS) * chunk_total  # rows counted from the tensor's first
    return local.numel(), itemsize, total % _MODULUS, by_column % _MODULUS, by_row % _MODULUS


def start_from_first_rank(
    model: nn.Module, mesh: Optional[DeviceMesh] = None, *, only: Optional[Sequence[str]] = None
) -> Start:
    """Give every rank the first rank's parameters and buffers along ``mesh`` (``None``: the default group).

    Tensors on ``meta`` are skipped (``Start.on_meta``: pass them as ``only=`` once materialized). A tied
    parameter counts once. A plain tensor, or a DTensor on another mesh (tensor parallel), is synced along
    every dimension of ``mesh``; a DTensor on ``mesh`` only along the dimensions it is replicated on (its
    shards differ by design). ``only``: the names to consider (default: all). Costs one all-gather of 5
    int64 per tensor per mesh dimension, plus broadcasts of what differs; nothing at all in one process.

    Raises:
        ValueError: on every rank of a group, when its ranks hold a tensor with different sizes or dtypes.

    Example:
        >>> start_from_first_rank(nn.Linear(2, 2), only=["bias"]).replaced
        []
    """
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    wanted = None if only is None else set(only)
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        if (wanted is None or name in wanted) and id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor
    on_meta = [n for n, t in tensors.items() if t.is_meta]
    live = {n: t for n, t in tensors.items() if not t.is_meta}
    replaced: set[str] = set()
    if not live or not is_distributed() or get_world_size() == 1:
        return Start(replaced=[], on_meta=on_meta)
    dims = _sync_dims(live, mesh)
    fingerprints = {n: tensor_fingerprint(t) for n, t in live.items()}
    for group, names_on_dim in _groups(mesh, dims):
        replaced |= _sync_group(group, {n: live[n] for n in names_on_dim}, fingerprints)
    return Start(replaced=[n for n in live if n in replaced], on_meta=on_meta)


def _sync_dims(tensors: dict[str, torch.Tensor], mesh: Optional[DeviceMesh]) -> dict[str, list[int]]:
    """For each tensor, the dimensions of ``mesh`` along which every rank must hold the same local values."""
    ndim = 1 if mesh is None else mesh.ndim
    every = list(range(ndim))
    dims = {}
    for name, tensor in tensors.items():
        dims[name] = every
        if mesh is None or not isinstance(tensor, DTensor):
            continue
        own = tensor.device_mesh
        if own == mesh:
            dims[name] = [d for d in every if tensor.placements[d].is_replicate()]
            continue
        names, own_names = mesh.mesh_dim_names, own.mesh_dim_names
        if names and own_names and set(names) <= set(own_names):  # FSDP over tensor parallel: the root mesh
            dims[name] = [d for d, n in enumerate(names) if tensor.placements[own_names.index(n)].is_replicate()]
    return dims


def _groups(
    mesh: Optional[DeviceMesh], dims: dict[str, list[int]]
) -> Iterator[tuple[Optional[dist.ProcessGroup], list[str]]]:
    """Each mesh dimension's group (of this rank) with more than one rank, and the tensors synced along it."""
    if mesh is None:
        yield None, list(dims)
        return
    for d in range(mesh.ndim):
        names = [n for n, on in dims.items() if d in on]
        if mesh.size(d) > 1 and names:
            yield mesh.get_group(d), names


def _sync_group(
    group: Optional[dist.ProcessGroup],
    tensors: dict[str, torch.Tensor],
    fingerprints: dict[str, Fingerprint],
) -> set[str]:
    """One all-gather of ``tensors``' fingerprints over ``group``; broadcast from its first rank those that
    differ somewhere. ``fingerprints`` is updated to the values now held. Returns what this rank overwrote."""
    names = list(tensors)
    mine = torch.tensor([fingerprints[n] for n in names], dtype=torch.int64, device=comm_device(group))
    size = dist.get_world_size(group)
    # Prefilled with this rank's rows: a backend that moves nothing (the planner's fake group) reads as agreement.
    gathered = mine.repeat(size, 1)
    all_gather_single(gathered, mine, group=group)
    rows = gathered.view(size, len(names), mine.shape[1]).cpu()
    first = rows[0]
    shapes_differ = (rows[:, :, :2] != first[:, :2]).any(dim=2).any(dim=0)
    if bool(shapes_differ.any()):
        bad = [n for n, d in zip(names, shapes_differ.tolist()) if d]
        raise ValueError(
            f"fsdp(): the ranks built tensors of different sizes or dtypes: {bad[:10]}. Every rank must build "
            "the same model before fsdp()."
        )
    differs = [n for n, d in zip(names, (rows != first).any(dim=2).any(dim=0).tolist()) if d]
    if not differs:
        return set()
    src = 0 if group is None else dist.get_global_rank(group, 0)
    _broadcast([tensors[n] for n in differs], src, group)
    for name in differs:
        fingerprints[name] = tuple(int(v) for v in first[names.index(name)].tolist())  # type: ignore[assignment]
    return set(differs) if dist.get_rank() != src else set()


def _broadcast(tensors: list[torch.Tensor], src: int, group: Optional[dist.ProcessGroup]) -> None:
    """``src``'s values of ``tensors`` on every rank of ``group``, as bytes in buckets of ``BUCKET_BYTES``."""
    sending = dist.get_rank() == src
    bucket: list[torch.Tensor] = []
    used = 0
    with torch.no_grad():
        for tensor in [local_tensor(t).detach() for t in tensors]:
            nbytes = _aligned(tensor.numel() * tensor.element_size())
            if bucket and used + nbytes > BUCKET_BYTES:
                _broadcast_bucket(bucket, src, group, sending)
                bucket, used = [], 0
            bucket.append(tensor)
            used += nbytes
        if bucket:
            _broadcast_bucket(bucket, src, group, sending)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _broadcast_bucket(bucket: list[torch.Tensor], src: int, group: Optional[dist.ProcessGroup], sending: bool) -> None:
    device = _collective_device(bucket[0].device, group)
    if len(bucket) == 1 and bucket[0].is_contiguous() and bucket[0].numel() > 1 and bucket[0].device == device:
        dist.broadcast(bucket[0].view(-1).view(torch.uint8), src=src, group=group)  # in place
        return
    flat = torch.empty(sum(_aligned(t.numel() * t.element_size()) for t in bucket), dtype=torch.uint8, device=device)
    spans, offset = [], 0
    for tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        spans.append((offset, nbytes))
        if sending:
            flat[offset : offset + nbytes].copy_(_dense(tensor).view(torch.uint8))
        offset += _aligned(nbytes)
    dist.broadcast(flat, src=src, group=group)
    if sending:
        return
    for tensor, (offset, nbytes) in zip(bucket, spans):
        tensor.copy_(flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flattened with stride 1 (a copy where it is strided, or one element at an odd stride)."""
    flat = tensor.reshape(-1)
    return flat if flat.numel() == 0 or flat.stride(0) == 1 else flat.new_empty(flat.shape).copy_(flat)


def _collective_device(device: torch.device, group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where ``group``'s collectives can take a tensor that lives on ``device``: there when its backend
    serves that device type (``"cuda:nccl,cpu:gloo"`` serves both), else the group's own (``comm_device``)."""
    backend = str(dist.get_backend(group))
    serves = device.type in backend if ":" in backend else (backend == "nccl") == (device.type == "cuda")
    return device if serves else comm_device(group)

"""Where each byte of a weight stream goes: items grouped into size-capped buckets, offsets in the buffers. Pure.

A bucket is moved by one all-gather: every rank sends a status header and its dim-0 shard of each
gathered source (padded to ``ceil(rows / world)`` rows, FSDP2's ``torch.chunk`` split): its
``segment`` (``segment_bytes`` per rank), and the full tensors land in one flat output buffer, tensor
after tensor, which the yielded tensors view.
Offsets are aligned so that any dtype can view any slice. No process group, no model here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import torch

__all__ = ["ALIGN", "HEADER_BYTES", "BucketPlan", "Item", "Output", "Source", "plan_buckets"]

ALIGN = 64  # bytes: every slice starts here, so a uint8 slice views as any dtype (and stays cache-line aligned)
HEADER_BYTES = 1024  # per rank and bucket: status, bucket index, a failing rank's message


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Source:
    """A tensor as the stream reads it: ``key`` in the model, its full ``shape``, the ``dtype`` it travels in,
    and ``shards`` (ranks it is split over along dim 0 in ``group``; 1: every rank holds it whole)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: int = 1
    group: Optional[Hashable] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def rows_per_rank(self) -> int:
        """Rows each rank's padded shard holds (``torch.chunk``'s chunk size; 0 for an empty tensor)."""
        return -(-self.shape[0] // self.shards) if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def rows_of(self, rank: int) -> int:
        """Rows rank ``rank`` of the shard group really holds (the last ones may hold fewer, or none)."""
        c = self.rows_per_rank
        return max(0, min(c, self.shape[0] - rank * c))


@dataclass(frozen=True)
class Output:
    """A tensor the stream yields: its ``name`` and, as yielded, its ``dtype`` and ``shape``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Item:
    """What one piece of the stream reads (``sources``) and yields (``outputs``, plus ``aliases``: extra names of
    an output, yielded as the same tensor). ``build``: ``None`` when output i is source i as it is; else what
    turns the full sources into the outputs (``gather.py`` runs it). Items are never split across buckets."""

    sources: tuple[Source, ...]
    outputs: tuple[Output, ...]
    build: Any = None
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def nbytes(self) -> int:
        return max(sum(s.nbytes for s in self.sources), sum(o.nbytes for o in self.outputs))


@dataclass
class BucketPlan:
    """One bucket: its items, each gathered source's byte offset in a rank's segment (after the header), each
    output's byte offset in the flat output, and the sizes. ``group``: the shard group (``None``: no gather)."""

    index: int
    items: list[Item] = field(default_factory=list)
    segment: dict[str, int] = field(default_factory=dict)
    segment_bytes: int = HEADER_BYTES
    outputs: dict[str, int] = field(default_factory=dict)
    output_bytes: int = 0
    group: Optional[Hashable] = None
    shards: int = 1

    @property
    def gathers(self) -> bool:
        return bool(self.segment)

    def add(self, item: Item) -> None:
        for s in item.sources:
            if s.shards > 1:
                self.segment[s.key] = self.segment_bytes
                self.segment_bytes += _aligned(s.rows_per_rank * s.row_bytes)
                self.group, self.shards = s.group, s.shards
        for o in item.outputs:
            self.outputs[o.name] = self.output_bytes
            self.output_bytes += _aligned(o.nbytes)
        self.items.append(item)


def _group_of(item: Item) -> tuple[Optional[Hashable], int]:
    """The one shard group an item's sources are split over (``(None, 1)``: none); two groups are refused."""
    groups = {(s.group, s.shards) for s in item.sources if s.shards > 1}
    if len(groups) > 1:
        raise ValueError(f"{[s.key for s in item.sources]} are sharded over different groups; cannot stream them.")
    return next(iter(groups), (None, 1))


def plan_buckets(items: list[Item], cap_bytes: int) -> list[BucketPlan]:
    """Items in order, into buckets of at most ``cap_bytes`` (an item larger than the cap gets a bucket of its
    own). A bucket's gathered sources share one shard group: a new group starts a new bucket.

    Example:
        >>> f32 = torch.float32
        >>> items = [Item((Source(k, (4, 2), f32, 2, "g"),), (Output(k, f32, (4, 2)),)) for k in "abc"]
        >>> [[i.outputs[0].name for i in b.items] for b in plan_buckets(items, cap_bytes=64)]
        [['a', 'b'], ['c']]
        >>> plan_buckets(items, cap_bytes=64)[0].segment  # per rank: header, then 2 padded rows of each
        {'a': 1024, 'b': 1088}
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes} must be positive.")
    buckets: list[BucketPlan] = []
    size = 0
    for item in items:
        group = _group_of(item)
        current = buckets[-1] if buckets else None
        fits = current is not None and size + item.nbytes <= cap_bytes
        same_group = current is not None and (group[0] is None or not current.gathers or current.group == group[0])
        if not (fits and same_group):
            current = BucketPlan(index=len(buckets))
            buckets.append(current)
            size = 0
        current.add(item)
        size += item.nbytes
    return buckets

"""Large plain tensors on CPU: each rank's rows broadcast from that rank straight into the full tensor.

Gloo's all-gathers (coalesced or flat) receive into a staging buffer of their own (a fresh allocation per
collective, fresh pages from 32 MiB on) and copy every gathered byte out of it; gloo's broadcast receives
in place. So a full tensor of a plain dim-0 split is filled by one broadcast per rank of the shard group
(rank ``r`` sends its shard, the others receive it into rows ``r*c`` onward of the yielded tensor), and
each rank copies only its own shard into its own rows. Uneven splits need no padding here (each rank's
rows are what it holds). Small tensors stay in the bucket's coalesced all-gather: a collective each would
cost more than the copies it saves. Every rank issues the same broadcasts in the same order (they depend
on the plan only), a failing rank too (with whatever bytes its buffer holds).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .plan import BucketPlan, Source

__all__ = ["BROADCAST_DEVICES", "BROADCAST_MIN_BYTES", "Works", "broadcast_slots", "start_broadcasts"]

# Devices whose backend broadcasts in place (gloo on CPU). NCCL's flat all-gather has no staging to save.
BROADCAST_DEVICES = {"cpu"}
# A full tensor at least this large travels by broadcasts (measured on 2 gloo ranks, the threshold table of
# benchmarks/results/weights_out.md: at 512 KiB and below one collective per rank costs more than the pack and
# copy-out it saves, at 1 MiB it is about even, from 2 MiB on broadcasts win by a third).
BROADCAST_MIN_BYTES = 2 << 20


class Works:
    """Several collectives' works, waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def broadcast_slots(plan: BucketPlan, fallback: dict, device: torch.device) -> dict[str, str]:
    """``{source key: output name}`` of the sources a bucket moves by broadcasts: a sharded source yielded as it
    is (same dtype and shape, no build step), of at least ``BROADCAST_MIN_BYTES``, on a ``BROADCAST_DEVICES``
    device. The same on every rank: it depends on the plan only.

    Example:
        >>> from zeta_fsdp.weights_out.plan import Item, Output, Source, plan_buckets
        >>> f32 = torch.float32
        >>> w, b = [Item((Source(k, (n, 1024), f32, 2, "g"),), (Output(k, f32, (n, 1024)),)) for k, n in (("w", 512), ("b", 1))]
        >>> broadcast_slots(plan_buckets([w, b], cap_bytes=2**30)[0], {}, torch.device("cpu"))  # 2 MiB and 4 KiB
        {'w': 'w'}
    """
    if device.type not in BROADCAST_DEVICES:
        return {}
    out = {}
    for item in plan.items:
        for s, o in zip(item.sources, item.outputs) if item.build is None else ():
            same = (s.dtype, s.shape) == (o.dtype, o.shape)
            if s.key in plan.segment and s.key not in fallback and same and s.nbytes >= BROADCAST_MIN_BYTES:
                out[s.key] = o.name
    return out


def _rows(s: Source, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the full tensor ``full`` (``torch.chunk``'s split; empty past the end)."""
    start = min(rank * s.rows_per_rank, s.shape[0])
    return full.narrow(0, start, s.rows_of(rank))


def start_broadcasts(
    sources: list[tuple[Source, torch.Tensor]], local: Optional[dict[str, torch.Tensor]], me: int, group: Any
) -> list[Any]:
    """Start the broadcasts that fill each ``(source, full tensor)``; ``local``: this rank's shard of each source
    (``None``: this rank only takes part, its rows hold no data). Returns the works, one per non-empty rank."""
    ranks = dist.get_process_group_ranks(group)
    works, copies = [], []
    for s, full in sources:
        mine = _rows(s, full, me)
        shard = None if local is None else local[s.key]
        sends_shard = shard is not None and shard.dtype == s.dtype and shard.is_contiguous()
        if shard is not None and not sends_shard:
            mine.copy_(shard)  # a cast or a strided shard: sent from its place in the full tensor
        for r in range(s.shards):
            rows = shard if r == me and sends_shard else _rows(s, full, r)
            if rows.numel():  # as bytes: gloo broadcasts only some dtypes
                works.append(dist.broadcast(rows.reshape(-1).view(torch.uint8), ranks[r], group, async_op=True))
        if sends_shard:
            copies.append((mine, shard))
    for mine, shard in copies:  # while the broadcasts run in gloo's threads
        mine.copy_(shard)
    return works

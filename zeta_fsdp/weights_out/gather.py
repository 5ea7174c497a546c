"""Moving the planned buckets: pack this rank's shards, one flat all-gather per bucket, copy the full tensors out.

The next bucket's all-gather is started (``async_op=True``) before the current bucket is handed to the
consumer, so communication overlaps the consumer's work; the all-gather writes into the buffer it reads
from (each rank's segment is a slice of the output, as FSDP2 does), so a bucket in flight costs one
buffer. Every segment starts with a status header: a rank that fails, or stops early, says so in its
next bucket, and a last small all-gather over every rank ends the stream, so all ranks raise together.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..distributed import comm_device, get_rank, get_world_size, is_distributed
from .items import shard_layout
from .plan import HEADER_BYTES, BucketPlan, Item, Source

__all__ = ["StreamError", "WeightBucket", "WeightStream"]

_MAGIC = 0x5A57  # "ZW": a header this code wrote
OK, FAILED, CLOSED = 0, 1, 2
_ACTIVE: weakref.WeakSet[WeightStream] = weakref.WeakSet()
_HOOK: list[Any] = []


class StreamError(RuntimeError):
    """A weight stream stopped on some rank (an error, a peer that stopped early, an optimizer step mid-stream);
    raised on every rank with the first failing rank's message."""


class WeightBucket(list):
    """One bucket: a list of ``(name, full tensor)`` pairs (``dict(bucket)`` gives a state dict), plus ``index``
    and ``flat`` (the ``uint8`` buffer the tensors view, in order; ``None`` on a rank that keeps no results)."""

    index: int = 0
    flat: Optional[torch.Tensor] = None


def _on_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Refuse a step that would change weights a stream is reading: it would mix two steps' weights."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for stream in list(_ACTIVE):
        if stream.reading & ids:
            raise StreamError(
                "optimizer.step() while iter_full_weights() streams this model's weights: the stream would mix "
                "the weights of two steps. Consume the whole stream (or close() it) before the next step."
            )


def _header(buf: torch.Tensor, status: int, index: int, message: str) -> None:
    head = buf[:HEADER_BYTES]
    words = head[:32].view(torch.int64)
    text = message.encode()[: HEADER_BYTES - 64]
    words.copy_(torch.tensor([_MAGIC, status, index, len(text)], dtype=torch.int64))
    head[64 : 64 + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else head[64:64])


def _read_headers(buf: torch.Tensor, ranks: int, ranks_of: list[int]) -> Optional[tuple[int, int, str]]:
    """The first failure among the gathered segments as ``(status, global rank, message)`` (a rank that failed
    before one that only stopped early), or ``None`` when every rank is fine."""
    rows = buf.view(ranks, -1)
    found = []
    for i in range(ranks):
        magic, status, _, length = rows[i, :32].view(torch.int64).tolist()
        if magic != _MAGIC:
            return FAILED, ranks_of[i], "its segment holds no stream header (the ranks do not run the same stream)"
        if status != OK:
            found.append((status != FAILED, status, ranks_of[i], bytes(rows[i, 64 : 64 + length].tolist())))
    if not found:
        return None
    _, status, rank, text = min(found)
    return status, rank, text.decode(errors="replace")


class WeightStream:
    """The iterator ``iter_full_weights`` returns: yields a ``WeightBucket`` per planned bucket, on every rank."""

    def __init__(
        self,
        buckets: list[BucketPlan],
        read: dict[str, torch.Tensor],
        keep: bool,
        device: torch.device,
        watch: set[int],
    ) -> None:
        self.buckets, self.read, self.keep, self.device = buckets, read, keep, device
        self.reading = watch  # ids of the parameters an optimizer step must not change mid-stream
        self._next = 0  # the bucket the consumer gets next
        self._launched = 0  # buckets whose all-gather this rank has started
        self._pending: Optional[tuple[int, torch.Tensor, Any, dict[str, torch.Tensor]]] = None
        self._done = False
        self._recv: Optional[torch.Tensor] = None
        _ACTIVE.add(self)
        if not _HOOK:
            _HOOK.append(register_optimizer_step_pre_hook(_on_optimizer_step))

    # -- iteration ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[WeightBucket]:
        return self

    @torch.no_grad()  # and DTensor.to_local() is then the shard itself, not a new view
    def __next__(self) -> WeightBucket:
        if self._done:
            raise StopIteration
        if self._next >= len(self.buckets):
            self._finish(OK, "")
            raise StopIteration
        try:
            if self._pending is None:
                self._pending = self._launch(self._next, OK, "")
            plan = self.buckets[self._next]
            recv, fallback = self._wait()
            out = self._unpack(plan, recv, fallback) if self.keep else WeightBucket()
            out.index = plan.index
            del recv, fallback
            self._next += 1
            if self._next < len(self.buckets):
                self._pending = self._launch(self._next, OK, "")
            return out
        except StreamError:
            raise
        except Exception as e:
            self.close(e)
            raise

    def __enter__(self) -> WeightStream:
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        self.close(error)

    @torch.no_grad()
    def close(self, error: Optional[BaseException] = None) -> None:
        """Stop streaming on this rank; ``error``: why (its peers raise it). Every rank's stream ends together: a
        rank that stops early tells its peers in the next bucket and in the closing exchange."""
        if self._done:
            return
        status, message = (CLOSED, "") if error is None else (FAILED, f"{type(error).__name__}: {error}")
        try:
            if self._pending is not None:
                work = self._pending[2]
                self._pending = None
                if work is not None:
                    work.wait()
            if self._launched < len(self.buckets):  # the bucket the peers wait in next: tell them there
                _, _, work, _ = self._launch(self._launched, status, message)
                if work is not None:
                    work.wait()
        finally:
            self._finish(status, message, raise_peer_errors=error is None)

    # -- one bucket ---------------------------------------------------------------------------------------
    def _launch(self, index: int, status: int, message: str) -> tuple:
        """Pack this rank's shards of bucket ``index`` (or only a status) and start its all-gather."""
        plan = self.buckets[index]
        fallback = {}
        for item in plan.items:  # other layouts (tensor parallel): gathered whole, in the same order everywhere
            for s in item.sources:
                t = self.read[s.key]
                if s.shards == 1 and isinstance(t, DTensor) and shard_layout(t) is None:
                    fallback[s.key] = t.full_tensor()
        if not plan.gathers:
            self._launched = index + 1
            return index, None, None, fallback
        group = self._group(plan)
        me = dist.get_rank(group)
        recv = self._buffer(plan)
        segment = recv.narrow(0, me * plan.segment_bytes, plan.segment_bytes)
        if status == OK:
            try:
                self._pack(plan, segment, me)
            except Exception as e:  # noqa: BLE001 - told to every peer through the header, then raised below
                status, message = FAILED, f"{type(e).__name__}: {e}"
        _header(segment, status, index, message)
        self._launched = index + 1  # from here on, the peers can count on this rank's segment of bucket ``index``
        work = dist.all_gather_into_tensor(recv, segment, group=group, async_op=True)
        return index, recv, work, fallback

    def _buffer(self, plan: BucketPlan) -> torch.Tensor:
        """The all-gather buffer for ``plan``: one buffer, sized for the largest bucket, reused by every bucket (the
        previous bucket is unpacked before the next starts; a freed buffer could outlive its gather in the process
        group's own references, and the next allocation would then briefly hold a third bucket)."""
        device = self._gather_device(plan)
        if self._recv is None or self._recv.device != device:
            most = max(b.shards * b.segment_bytes for b in self.buckets if b.gathers)
            self._recv = torch.empty(most, dtype=torch.uint8, device=device)
        return self._recv[: plan.shards * plan.segment_bytes]

    def _group(self, plan: BucketPlan) -> Any:
        """The process group of a bucket's shards (``plan.group`` is its name)."""
        return shard_layout(self.read[next(iter(plan.segment))])[0]

    def _gather_device(self, plan: BucketPlan) -> torch.device:
        key = next(iter(plan.segment))
        return self.read[key].device

    def _pack(self, plan: BucketPlan, segment: torch.Tensor, me: int) -> None:
        for item in plan.items:
            for s in item.sources:
                if s.key not in plan.segment:
                    continue
                local = self.read[s.key].to_local()
                rows = s.rows_of(me)
                if tuple(local.shape) != (rows, *s.shape[1:]):
                    raise RuntimeError(
                        f"{s.key}: this rank holds a shard of shape {tuple(local.shape)}, expected {rows} rows of "
                        f"{s.shape} split over {s.shards} ranks (torch.chunk along dim 0)."
                    )
                start = plan.segment[s.key]
                dst = segment[start : start + rows * s.row_bytes].view(s.dtype).view(rows, *s.shape[1:])
                dst.copy_(local)

    def _wait(self) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
        index, recv, work, fallback = self._pending
        self._pending = None
        if work is not None:
            work.wait()
            plan = self.buckets[index]
            found = _read_headers(recv, plan.shards, dist.get_process_group_ranks(self._group(plan)))
            if found is not None:
                self._fail_from_peer(*found)
        return recv, fallback

    def _fail_from_peer(self, status: int, rank: int, message: str) -> None:
        reason = (
            f"rank {rank} stopped iterating before the end (close(), or a loop left early)"
            if status == CLOSED
            else f"rank {rank} failed: {message}"
        )
        self._finish(FAILED, reason)
        raise StreamError(f"iter_full_weights(): {reason}")

    def _full(self, s: Source, plan: BucketPlan, recv: Optional[torch.Tensor], into: torch.Tensor) -> None:
        """Write source ``s``'s full bytes into ``into`` (a uint8 slice of exactly its size)."""
        if s.key not in plan.segment:
            t = self.read[s.key]
            whole = t.to_local() if isinstance(t, DTensor) else t
            into.view(s.dtype).view(s.shape).copy_(whole)
            return
        if s.shape[0] == 0:
            return
        step = s.rows_per_rank * s.row_bytes
        pieces = recv.view(plan.shards, plan.segment_bytes)[:, plan.segment[s.key] : plan.segment[s.key] + step]
        whole = s.shape[0] // s.rows_per_rank  # ranks holding a full chunk; the next one may hold a part
        into[: whole * step].view(whole, step).copy_(pieces[:whole])
        rest = into.numel() - whole * step
        if rest:
            into[whole * step :].copy_(pieces[whole, :rest])

    def _unpack(self, plan: BucketPlan, recv: Optional[torch.Tensor], fallback: dict) -> WeightBucket:
        device = recv.device if recv is not None else self._plain_device(plan)
        flat = torch.empty(plan.output_bytes, dtype=torch.uint8, device=device)
        for item in plan.items:
            self._unpack_item(item, plan, recv, fallback, flat)
        if flat.device != self.device:
            flat = flat.to(self.device)
        bucket = WeightBucket()
        for item in plan.items:
            views = {}
            for o in item.outputs:
                start = plan.outputs[o.name]
                views[o.name] = flat[start : start + o.nbytes].view(o.dtype).view(o.shape)
                bucket.append((o.name, views[o.name]))
            bucket.extend((alias, views[kept]) for alias, kept in item.aliases)
        bucket.flat = flat
        return bucket

    def _plain_device(self, plan: BucketPlan) -> torch.device:
        first = self.read[plan.items[0].sources[0].key] if plan.items and plan.items[0].sources else None
        return first.device if first is not None else self.device

    def _unpack_item(self, item: Item, plan: BucketPlan, recv: Any, fallback: dict, flat: torch.Tensor) -> None:
        def slot(o: Any) -> torch.Tensor:
            return flat[plan.outputs[o.name] : plan.outputs[o.name] + o.nbytes]

        if item.build is None:
            for s, o in zip(item.sources, item.outputs):
                if s.key in fallback:
                    slot(o).view(o.dtype).view(o.shape).copy_(fallback[s.key])
                elif s.dtype == o.dtype:
                    self._full(s, plan, recv, slot(o))
                else:
                    t = self.read[s.key]
                    whole = t.to_local() if isinstance(t, DTensor) else t
                    slot(o).view(o.dtype).view(o.shape).copy_(whole)
            return
        fulls = []
        for s in item.sources:
            if s.key in fallback:
                fulls.append(fallback[s.key].to(s.dtype))
                continue
            into = torch.empty(s.nbytes, dtype=torch.uint8, device=flat.device)
            self._full(s, plan, recv, into)
            fulls.append(into.view(s.dtype).view(s.shape))
        for o, value in zip(item.outputs, item.build(fulls)):
            slot(o).view(o.dtype).view(o.shape).copy_(value)

    # -- the end ------------------------------------------------------------------------------------------
    def _finish(self, status: int, message: str, raise_peer_errors: bool = True) -> None:
        """The closing exchange over every rank (one 1 KiB all-gather): raises the first failure anywhere."""
        if self._done:
            return
        self._done = True
        self._recv = None
        _ACTIVE.discard(self)
        if not is_distributed() or get_world_size() == 1:
            return
        world = get_world_size()
        buf = torch.empty(world * HEADER_BYTES, dtype=torch.uint8, device=comm_device())
        mine = buf.narrow(0, get_rank() * HEADER_BYTES, HEADER_BYTES)
        _header(mine, status, len(self.buckets), message)
        dist.all_gather_into_tensor(buf, mine)
        found = _read_headers(buf, world, list(range(world)))
        if found is None or not raise_peer_errors and status != OK:
            return
        kind, rank, text = found
        if kind == CLOSED and status == CLOSED:
            return  # every rank that stopped early did so on purpose (close() on all ranks)
        if kind == CLOSED:
            text = f"rank {rank} stopped iterating before the end (close(), or a loop left early)"
        elif not text.startswith("rank "):
            text = f"rank {rank} failed: {text}"
        raise StreamError(f"iter_full_weights(): {text}")

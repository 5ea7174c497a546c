"""Moving the planned buckets: one all-gather per bucket that writes every rank's piece where it belongs.

On CPU a bucket's large plain tensors (2 MiB and more) are filled by one in-place broadcast per rank of the
shard group instead (``broadcasts.py``: gloo's all-gathers copy every byte through a staging buffer of their
own, its broadcasts do not); the header and the other tensors travel in the bucket's all-gather.
On CPU a bucket's all-gather is gloo's coalesced one (NCCL has none for lists: there it is one flat
all-gather, copied out when waited for; see ``all_gather_pieces``): each rank sends its header and its dim-0 shard
of every source (the shard itself, no packing copy, unless it must be cast or padded), and each rank's
piece lands straight in the yielded tensor's place in the bucket's output buffer (the full tensor of a
dim-0 split is its ranks' pieces one after the other), so there is no copy-out either; only sources that
are built into something else (LoRA merge, fused experts) or padded go through a scratch. Each bucket gets
a new output buffer (a yielded tensor is never overwritten, however the caller keeps it).
The next bucket's all-gather is started (``async_op=True``) before the current bucket is handed to the
consumer, so communication overlaps the consumer's work. Every rank's piece starts with a status header:
a rank that fails, or stops early, says so in its next bucket, and a last small all-gather over every rank
ends the stream, so all ranks raise together.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..distributed import comm_device, get_rank, get_world_size, is_distributed
from ..torch_compat import all_gather_single
from .broadcasts import Works, broadcast_slots, start_broadcasts
from .items import shard_layout
from .plan import HEADER_BYTES, BucketPlan, Item, Source

__all__ = ["COALESCED_DEVICES", "StreamError", "WeightBucket", "WeightStream", "all_gather_pieces"]

_MAGIC = 0x5A57  # "ZW": a header this code wrote
OK, FAILED, CLOSED = 0, 1, 2
_ACTIVE: weakref.WeakSet[WeightStream] = weakref.WeakSet()
_HOOK: list[Any] = []


# Devices whose backend has a coalesced all-gather of lists (gloo's writes each piece where it goes); NCCL and
# the other accelerator backends refuse ``all_gather_coalesced`` ("does not support allgather_coalesced").
COALESCED_DEVICES = {"cpu"}


class _FlatGather:
    """The pieces in one flat byte all-gather, copied to where they go when waited for (NCCL and other
    backends without a coalesced all-gather of lists: one collective per bucket all the same)."""

    def __init__(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], group: Any) -> None:
        send = torch.cat(inputs)
        self._recv = torch.empty(len(outputs) * send.numel(), dtype=torch.uint8, device=send.device)
        self._outputs, self._sizes = outputs, [t.numel() for t in inputs]
        self._work = all_gather_single(self._recv, send, group=group, async_op=True)

    def wait(self) -> bool:
        self._work.wait()
        for pieces, chunk in zip(self._outputs, self._recv.chunk(len(self._outputs))):
            torch._foreach_copy_(pieces, list(chunk.split(self._sizes)))
        self._outputs = self._recv = None  # the output pieces are the caller's again
        return True


def all_gather_pieces(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], group: Any) -> Any:
    """Start gathering every rank's byte ``inputs`` into ``outputs[rank]``; returns the work to ``wait()`` on.
    On CPU (gloo) the coalesced all-gather, elsewhere one flat all-gather (see ``COALESCED_DEVICES``)."""
    if inputs[0].device.type not in COALESCED_DEVICES:
        return _FlatGather(outputs, inputs, group)
    with warnings.catch_warnings():  # deprecated in name since torch 2.2, with no replacement for lists
        warnings.simplefilter("ignore", FutureWarning)
        return dist.all_gather_coalesced(outputs, inputs, group=group, async_op=True)


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


def _read_headers(rows: torch.Tensor, ranks_of: list[int]) -> Optional[tuple[int, int, str]]:
    """The first failure among the gathered headers (one row per rank) as ``(status, global rank, message)`` (a
    rank that failed before one that only stopped early), or ``None`` when every rank is fine."""
    found = []
    for i in range(len(ranks_of)):
        magic, status, _, length = rows[i, :32].clone().view(torch.int64).tolist()
        if magic != _MAGIC:
            return FAILED, ranks_of[i], "its segment holds no stream header (the ranks do not run the same stream)"
        if status != OK:
            found.append((status != FAILED, status, ranks_of[i], bytes(rows[i, 64 : 64 + length].tolist())))
    if not found:
        return None
    _, status, rank, text = min(found)
    return status, rank, text.decode(errors="replace")


def _gathered(plan: BucketPlan, moved: dict) -> list[Source]:
    """The sources a bucket's all-gather moves, in the plan's order (the same on every rank); ``moved``: those
    that travel by broadcasts instead (``broadcast_slots``)."""
    sources = {s.key: s for item in plan.items for s in item.sources}
    return [sources[key] for key in plan.segment if key not in moved]


def _direct_slots(plan: BucketPlan, fallback: dict) -> dict[str, str]:
    """``{source key: output name}`` where the output is the gathered bytes as they are: a plain dim-0 split that
    every rank holds an equal part of, kept in its dtype. The all-gather writes those in place."""
    out = {}
    for item in plan.items:
        for s, o in zip(item.sources, item.outputs) if item.build is None else ():
            even = bool(s.shape) and s.shape[0] % s.shards == 0
            if s.key in plan.segment and s.key not in fallback and (s.dtype, s.shape) == (o.dtype, o.shape) and even:
                out[s.key] = o.name
    return out


def _status_pieces(plan: BucketPlan, device: torch.device, moved: dict) -> tuple:
    """A bucket's all-gather lists for a rank that only tells its status (it failed, or stops early): the same
    bytes as its peers send, all in one piece (and a buffer its broadcasts, if any, land in)."""
    total = HEADER_BYTES + sum(s.rows_per_rank * s.row_bytes for s in _gathered(plan, moved))
    every = torch.empty(plan.shards, total, dtype=torch.uint8, device=device)
    mine = torch.zeros(total, dtype=torch.uint8, device=device)
    flat = torch.empty(plan.output_bytes, dtype=torch.uint8, device=device) if moved else None
    return [mine], [[every[q]] for q in range(plan.shards)], every[:, :HEADER_BYTES], flat, {}, None


def _slot(plan: BucketPlan, flat: torch.Tensor, name: str, like: Any) -> torch.Tensor:
    """Output ``name``'s place in the bucket's buffer, as a tensor of ``like``'s dtype and shape (the output
    itself, or a source moved into it as it is)."""
    start = plan.outputs[name]
    return flat[start : start + like.nbytes].view(like.dtype).view(like.shape)


def _moved_sources(plan: BucketPlan, moved: dict) -> list[Source]:
    """The sources of ``plan`` that travel by broadcasts (``broadcast_slots``), in the plan's order."""
    return [s for item in plan.items for s in item.sources if s.key in moved]


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
        self._pending: Optional[tuple] = None  # (index, (headers, output buffer), work, fallback, scratch)
        self._done = False
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
            flat, fallback, scratch = self._wait()
            out = self._unpack(plan, flat, fallback, scratch) if self.keep else WeightBucket()
            out.index = plan.index
            del flat, fallback, scratch
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

    def __del__(self) -> None:
        """A stream dropped before its end (``break`` out of a bare ``for bucket in iter_full_weights(...)``): its
        peers are told at once, as by ``close()``, and raise ``StreamError``; here the error a peer reports can
        only be a warning (Python ignores what ``__del__`` raises)."""
        if getattr(self, "_done", True) or not dist.is_available() or not dist.is_initialized():
            return
        try:
            self.close()
        except StreamError as e:
            warnings.warn(f"{e} (a stream left without close() or a with block)", RuntimeWarning, stacklevel=2)
        except Exception as e:  # noqa: BLE001 - e.g. the process group is already gone at exit
            warnings.warn(f"iter_full_weights(): closing a dropped stream failed: {e}", RuntimeWarning, stacklevel=2)

    @torch.no_grad()
    def close(self, error: Optional[BaseException] = None) -> None:
        """Stop streaming on this rank; ``error``: why (its peers raise it). Every rank's stream ends together: a
        rank that stops early tells its peers in the next bucket and in the closing exchange."""
        if self._done:
            return
        if error is None and self._pending is None and self._next >= len(self.buckets):
            self._finish(OK, "")  # every bucket reached this rank (a loop left at the last one): it finished
            return
        status, message = (CLOSED, "") if error is None else (FAILED, f"{type(error).__name__}: {error}")
        try:
            peer_stopped = self._pending is not None and self._drain_pending()
            if not peer_stopped and self._launched < len(self.buckets):  # the bucket the peers wait in next
                work = self._launch(self._launched, status, message)[2]
                if work is not None:
                    work.wait()
        finally:
            self._finish(status, message, raise_peer_errors=error is None)

    def _drain_pending(self) -> bool:
        """Wait for the bucket in flight; whether a peer said in it that it stopped or failed. That peer is in the
        closing exchange already, so this rank must start no bucket more (a mismatched collective aborts gloo)."""
        index, where, work, _, _ = self._pending
        self._pending = None
        if work is None:
            return False
        work.wait()
        return _read_headers(where[0], dist.get_process_group_ranks(self._group(self.buckets[index]))) is not None

    # -- one bucket ---------------------------------------------------------------------------------------
    def _launch(self, index: int, status: int, message: str) -> tuple:
        """Start bucket ``index``'s all-gather (or, with a status other than OK, only this rank's status)."""
        plan = self.buckets[index]
        fallback = self._fallbacks(plan)
        if not plan.gathers:
            self._launched = index + 1
            return index, None, None, fallback, {}
        group = self._group(plan)
        me = dist.get_rank(group)
        moved = broadcast_slots(plan, fallback, self._gather_device(plan))
        pieces = None
        if status == OK:
            try:
                pieces = self._pieces(plan, me, fallback, moved)
            except Exception as e:  # noqa: BLE001 - told to every peer through the header, then raised below
                status, message = FAILED, f"{type(e).__name__}: {e}"
        if pieces is None:
            pieces = _status_pieces(plan, self._gather_device(plan), moved)
        inputs, outputs, heads, flat, scratch, local = pieces
        _header(inputs[0], status, index, message)
        self._launched = index + 1  # from here on, the peers can count on this rank's segment of bucket ``index``
        work = all_gather_pieces(outputs, inputs, group)
        fulls = [(s, _slot(plan, flat, moved[s.key], s)) for s in _moved_sources(plan, moved)]
        return index, (heads, flat), Works([work, *start_broadcasts(fulls, local, me, group)]), fallback, scratch

    def _fallbacks(self, plan: BucketPlan) -> dict[str, torch.Tensor]:
        """Sources of another layout (tensor parallel): gathered whole, in the same order on every rank."""
        fallback = {}
        for item in plan.items:
            for s in item.sources:
                t = self.read[s.key]
                if s.shards == 1 and isinstance(t, DTensor) and shard_layout(t) is None:
                    fallback[s.key] = t.full_tensor()
        return fallback

    def _pieces(self, plan: BucketPlan, me: int, fallback: dict, moved: dict) -> tuple:
        """The coalesced all-gather's lists: what this rank sends (its header, then its shard of each source, as
        bytes: the shard itself where it is already what travels) and where each rank's piece lands (straight
        in the output tensor where the full tensor is the gathered bytes as they are, else in a scratch); and
        this rank's shards of the sources ``moved`` by broadcasts."""
        flat = self._out_buffer(plan)
        heads = torch.empty(plan.shards, HEADER_BYTES, dtype=torch.uint8, device=flat.device)
        inputs, outputs, scratch = [heads[me]], [[heads[q]] for q in range(plan.shards)], {}
        direct = _direct_slots(plan, fallback)
        local = {s.key: self._local(s, me) for s in _moved_sources(plan, moved)}
        for s in _gathered(plan, moved):
            inputs.append(self._shard_bytes(s, me))
            step = s.rows_per_rank * s.row_bytes
            if s.key in direct:
                start = plan.outputs[direct[s.key]]
                rows = flat[start : start + plan.shards * step]
            else:
                rows = scratch[s.key] = torch.empty(plan.shards * step, dtype=torch.uint8, device=flat.device)
            for q in range(plan.shards):
                outputs[q].append(rows[q * step : (q + 1) * step])
        return inputs, outputs, heads, flat, scratch, local

    def _local(self, s: Source, me: int) -> torch.Tensor:
        """This rank's shard of ``s``, checked against the plan's split."""
        local = self.read[s.key].to_local()
        rows = s.rows_of(me)
        if tuple(local.shape) != (rows, *s.shape[1:]):
            raise RuntimeError(
                f"{s.key}: this rank holds a shard of shape {tuple(local.shape)}, expected {rows} rows of "
                f"{s.shape} split over {s.shards} ranks (torch.chunk along dim 0)."
            )
        return local

    def _shard_bytes(self, s: Source, me: int) -> torch.Tensor:
        """This rank's shard of ``s`` as the bytes it sends: ``rows_per_rank`` rows in ``s.dtype`` (a copy only
        where the shard must be cast or padded)."""
        local, rows = self._local(s, me), s.rows_of(me)
        if local.dtype == s.dtype and rows == s.rows_per_rank and local.is_contiguous():
            return local.reshape(-1).view(torch.uint8)
        out = torch.zeros(s.rows_per_rank * s.row_bytes, dtype=torch.uint8, device=local.device)
        out[: rows * s.row_bytes].view(s.dtype).view(rows, *s.shape[1:]).copy_(local)
        return out

    def _out_buffer(self, plan: BucketPlan) -> torch.Tensor:
        """The flat output of ``plan``, new for every bucket: the yielded tensors are its views, and a caller may
        keep one in ways no count of references sees (its ``untyped_storage()`` alone, a raw pointer handed to
        another process), so it is never written again. On CPU the default bucket stays under glibc's 32 MiB
        mmap threshold, so freed buffers come back from the heap without page faults."""
        device = self._gather_device(plan) if plan.gathers else self._plain_device(plan)
        return torch.empty(plan.output_bytes, dtype=torch.uint8, device=device)

    def _group(self, plan: BucketPlan) -> Any:
        """The process group of a bucket's shards (``plan.group`` is its name)."""
        return shard_layout(self.read[next(iter(plan.segment))])[0]

    def _gather_device(self, plan: BucketPlan) -> torch.device:
        key = next(iter(plan.segment))
        return self.read[key].device

    def _wait(self) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        index, where, work, fallback, scratch = self._pending
        self._pending = None
        if work is None:
            return None, fallback, scratch
        work.wait()
        plan = self.buckets[index]
        found = _read_headers(where[0], dist.get_process_group_ranks(self._group(plan)))
        if found is not None:
            self._fail_from_peer(*found)
        return where[1], fallback, scratch

    def _fail_from_peer(self, status: int, rank: int, message: str) -> None:
        reason = (
            f"rank {rank} stopped iterating before the end (close(), or a loop left early)"
            if status == CLOSED
            else f"rank {rank} failed: {message}"
        )
        self._finish(FAILED, reason)
        raise StreamError(f"iter_full_weights(): {reason}")

    def _whole(self, s: Source) -> torch.Tensor:
        """A source every rank holds whole (NO_SHARD, replicated), as a new tensor in ``s.dtype``."""
        t = self.read[s.key]
        return (t.to_local() if isinstance(t, DTensor) else t).to(s.dtype, copy=True)

    def _full(self, s: Source, fallback: dict, scratch: dict) -> torch.Tensor:
        """Source ``s``'s full tensor, from wherever it is (not for a source gathered straight into its output)."""
        if s.key in fallback:
            return fallback[s.key].to(s.dtype)
        if s.key in scratch:
            return scratch[s.key][: s.nbytes].view(s.dtype).view(s.shape)
        return self._whole(s)

    def _unpack(self, plan: BucketPlan, flat: Optional[torch.Tensor], fallback: dict, scratch: dict) -> WeightBucket:
        if flat is None:  # nothing gathered: the tensors are copied into a buffer here
            flat = self._out_buffer(plan)
        direct = {}
        if plan.gathers:  # written in place by the all-gather or the broadcasts
            direct = {**_direct_slots(plan, fallback), **broadcast_slots(plan, fallback, self._gather_device(plan))}
        for item in plan.items:
            self._unpack_item(item, plan, fallback, scratch, direct, flat)
        if flat.device != self.device:
            flat = flat.to(self.device)
        bucket = WeightBucket()
        for item in plan.items:
            views = {}
            for o in item.outputs:
                views[o.name] = _slot(plan, flat, o.name, o)
                bucket.append((o.name, views[o.name]))
            bucket.extend((alias, views[kept]) for alias, kept in item.aliases)
        bucket.flat = flat
        return bucket

    def _plain_device(self, plan: BucketPlan) -> torch.device:
        first = self.read[plan.items[0].sources[0].key] if plan.items and plan.items[0].sources else None
        return first.device if first is not None else self.device

    def _unpack_item(
        self, item: Item, plan: BucketPlan, fallback: dict, scratch: dict, direct: dict, flat: torch.Tensor
    ) -> None:
        if item.build is None:
            for s, o in zip(item.sources, item.outputs):
                if s.key not in direct:  # else: the all-gather wrote it in place
                    _slot(plan, flat, o.name, o).copy_(self._full(s, fallback, scratch))
            return
        fulls = [self._full(s, fallback, scratch) for s in item.sources]
        for o, value in zip(item.outputs, item.build(fulls)):
            _slot(plan, flat, o.name, o).copy_(value)

    # -- the end ------------------------------------------------------------------------------------------
    def _finish(self, status: int, message: str, raise_peer_errors: bool = True) -> None:
        """The closing exchange over every rank (one 1 KiB all-gather): raises the first failure anywhere."""
        if self._done:
            return
        self._done = True
        _ACTIVE.discard(self)
        if not is_distributed() or get_world_size() == 1:
            return
        world = get_world_size()
        buf = torch.empty(world * HEADER_BYTES, dtype=torch.uint8, device=comm_device())
        mine = buf.narrow(0, get_rank() * HEADER_BYTES, HEADER_BYTES)
        _header(mine, status, len(self.buckets), message)
        all_gather_single(buf, mine)
        found = _read_headers(buf.view(world, -1), list(range(world)))
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

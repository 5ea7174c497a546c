"""Weights to another process group: trainer rank 0 broadcasts the stream's buckets, receivers load them by name.

The weights group holds trainer rank 0 (its rank 0) and the receivers (an inference engine's workers, an
evaluator): a group of its own (``weights_group``, from a TCP store, so the receivers need not be part of
the training job) or any ``ProcessGroup`` with these ranks. Per bucket: a 1 KiB status exchange among
all of them (every wait bounded by ``timeout_s``), then one broadcast of the bucket's flat buffer. Any
failure (a receiver whose model does not match, a process that died) is raised by every member within
the timeout, and by every trainer rank through the stream (``iter_full_weights``'s status headers).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import get_rank, is_distributed
from ..state_dict.checks import short_list
from .gather import StreamError
from .stream import iter_full_weights

__all__ = ["receive_weights", "send_weights", "weights_group"]

_STATUS_BYTES = 1024
_OK, _FAILED = 0, 1


def weights_group(address: str, *, rank: int, world_size: int, timeout_s: float = 60.0) -> dist.ProcessGroup:
    """A gloo process group of its own for sending weights: ``rank`` 0 is trainer rank 0 (it hosts the store at
    ``address``, ``"host:port"``), ranks 1.. the receivers. Independent of the training job's group.

    Example:
        group = weights_group("10.0.0.1:29600", rank=0, world_size=2)  # trainer rank 0; the receiver passes rank=1
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 <= rank < world_size:
        raise ValueError(
            f"weights_group(): address={address!r}, rank={rank}, world_size={world_size} is not accepted. "
            "Accepted: 'host:port', and 0 <= rank < world_size (rank 0: the sending trainer)."
        )
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("zeta_fsdp_weights", store), rank, world_size, timeout)


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - one readable error: which step, and why
        raise StreamError(f"weights group: {what} failed ({type(e).__name__}: {str(e).splitlines()[0]})") from e


def _broadcast(group: Any, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    _wait(group.broadcast([tensor], opts), timeout_s, what)


def _exchange(group: Any, error: Optional[str], timeout_s: float, what: str) -> None:
    """Every member says ok or why not; every member raises the first failure's message."""
    mine = torch.zeros(_STATUS_BYTES, dtype=torch.uint8)
    text = (error or "").encode()[: _STATUS_BYTES - 16]
    mine[:16].view(torch.int64).copy_(torch.tensor([_FAILED if error else _OK, len(text)]))
    if text:
        mine[16 : 16 + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    outs = [torch.empty_like(mine) for _ in range(group.size())]
    _wait(group.allgather([outs], [mine]), timeout_s, what)
    for rank, out in enumerate(outs):
        status, length = out[:16].view(torch.int64).tolist()
        if status != _OK:
            who = "trainer rank 0" if rank == 0 else f"receiver {rank}"
            raise StreamError(f"weights group: {who} failed: {bytes(out[16 : 16 + length].tolist()).decode()}")


def _manifest(stream: Any) -> list[dict]:
    """Per bucket: its byte size and ``[name, dtype, shape, offset]`` of each tensor (aliases at their kept offset)."""
    out = []
    for plan in stream.buckets:
        entries = {}
        for item in plan.items:
            for o in item.outputs:
                entries[o.name] = [o.name, str(o.dtype).removeprefix("torch."), list(o.shape), plan.outputs[o.name]]
            for alias, kept in item.aliases:
                entries[alias] = [alias, *entries[kept][1:]]
        out.append({"bytes": plan.output_bytes, "tensors": list(entries.values())})
    return out


def send_weights(
    model: nn.Module,
    group: Optional[Any],
    *,
    bucket_mb: Optional[float] = None,
    dtype: Optional[torch.dtype] = None,
    names: str = "model",
    lora: str = "merged",
    timeout_s: float = 60.0,
) -> int:
    """Stream ``model``'s full weights to the receivers of ``group``; returns the bytes sent (0 off rank 0).

    **Every trainer rank calls it** (the buckets are gathered over the training group); ``group`` is the
    weights group on trainer rank 0 (its rank 0) and ``None`` on the other trainer ranks. The receivers call
    ``receive_weights`` at the same time. A failure anywhere (a receiver that died or does not match)
    raises ``StreamError`` on every trainer rank and every receiver, within ``timeout_s``.

    Example:
        group = weights_group("localhost:29600", rank=0, world_size=2) if dist.get_rank() == 0 else None
        send_weights(model, group, dtype=torch.bfloat16)  # every trainer rank, after optimizer.step()
    """
    sender = not is_distributed() or get_rank() == 0
    if sender and group is None:
        raise ValueError("send_weights(): trainer rank 0 needs the weights group (group=None given).")
    stream = iter_full_weights(model, bucket_mb=bucket_mb, dtype=dtype, names=names, lora=lora, ranks=[0])
    with stream:
        return _send(stream, group, timeout_s) if sender else sum(0 for _ in stream)


def _send(stream: Any, group: Any, timeout_s: float) -> int:
    """Trainer rank 0: the manifest, then per bucket a status exchange (the receivers' checks or last load, and
    this rank's own state) and the bucket's broadcast; a last exchange. A failure of the stream is told too."""
    text = torch.frombuffer(bytearray(json.dumps(_manifest(stream)).encode()), dtype=torch.uint8)
    _broadcast(group, torch.tensor([text.numel()], dtype=torch.int64), timeout_s, "sending the manifest size")
    _broadcast(group, text, timeout_s, "sending the manifest")
    sent, told = 0, False
    try:
        for bucket in stream:
            told = True
            _exchange(group, None, timeout_s, f"before bucket {bucket.index}")
            told = False
            _broadcast(group, bucket.flat, timeout_s, f"sending bucket {bucket.index}")
            sent += bucket.flat.numel()
            del bucket  # before the next one is copied out
        told = True
        _exchange(group, None, timeout_s, "after the last bucket")
    except Exception as e:
        if not told:  # the receivers wait in the next exchange: they raise this rank's error there
            try:
                _exchange(group, f"{type(e).__name__}: {e}", timeout_s, "telling the receivers")
            except StreamError:
                pass
        raise
    return sent


def _check_names(manifest: list[dict], target: dict[str, torch.Tensor], strict: bool) -> Optional[str]:
    shapes = {e[0]: tuple(e[2]) for b in manifest for e in b["tensors"]}
    sent = {target[k].data_ptr() for k in target if k in shapes}  # a tied alias of a sent tensor is filled too
    missing = [k for k in target if k not in shapes and target[k].data_ptr() not in sent] if strict else []
    unexpected = [k for k in shapes if k not in target]
    wrong = [
        f"{k}: sent {list(s)}, model {list(target[k].shape)}"
        for k, s in shapes.items()
        if k in target and s != tuple(target[k].shape)
    ]
    if not (missing or unexpected or wrong):
        return None
    parts = [f"{what} {short_list(keys)}" for what, keys in (
        ("missing (in the model, not sent):", missing), ("unexpected (sent, not in the model):", unexpected),
        ("shape mismatches:", wrong)) if keys]  # fmt: skip
    return "the weights sent do not match the receiving model: " + "; ".join(parts)


def receive_weights(model: nn.Module, group: Any, *, strict: bool = True, timeout_s: float = 60.0) -> int:
    """Receive the weights ``send_weights`` streams and copy them into ``model`` (a plain, unsharded model) by name,
    cast to its dtypes; returns the bytes received. Names and shapes are checked before any bucket moves: a
    mismatch (with ``strict``, also a model tensor nobody sent) raises ``StreamError`` here and on every trainer rank.

    Example:
        group = weights_group("trainer0:29600", rank=1, world_size=2)
        receive_weights(model, group)  # a plain copy of the trained model, e.g. AutoModelForCausalLM.from_config(cfg)
    """
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size, timeout_s, "receiving the manifest size")
    text = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(group, text, timeout_s, "receiving the manifest")
    manifest = json.loads(bytes(text.tolist()).decode())
    target = model.state_dict(keep_vars=True)
    error = _check_names(manifest, target, strict)
    received = 0
    for index, bucket in enumerate(manifest):
        _exchange(group, error, timeout_s, f"before bucket {index}")
        flat = torch.empty(bucket["bytes"], dtype=torch.uint8)
        _broadcast(group, flat, timeout_s, f"receiving bucket {index}")
        try:
            _load(flat, bucket["tensors"], target)
        except Exception as e:  # noqa: BLE001 - told to the trainer and the other receivers, then raised
            error = f"{type(e).__name__}: {e}"
        received += flat.numel()
    _exchange(group, error, timeout_s, "after the last bucket")
    return received


@torch.no_grad()
def _load(flat: torch.Tensor, tensors: list, target: dict[str, torch.Tensor]) -> None:
    for name, dtype, shape, offset in tensors:
        dt = getattr(torch, dtype)
        view = flat[offset : offset + dt.itemsize * int(torch.Size(shape).numel())].view(dt).view(shape)
        target[name].copy_(view)

"""``iter_full_weights``: the full weights of a model returned by ``fsdp()``, streamed in size-capped buckets."""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from ..distributed import comm_device, get_rank, get_world_size, is_distributed, on_all_ranks
from ..hf.save import check_dtype
from ..torch_compat import all_gather_single
from ..wrapped import compute_device
from .gather import StreamError, WeightStream
from .items import LORA, NAMES, model_items
from .plan import plan_buckets

__all__ = ["default_bucket_mb", "iter_full_weights"]

_CALLER = "iter_full_weights()"


def _check_args(bucket_mb: Optional[float], names: str, lora: str, device: object, ranks: object) -> None:
    if bucket_mb is not None and (
        not isinstance(bucket_mb, (int, float))
        or isinstance(bucket_mb, bool)
        or not math.isfinite(bucket_mb)
        or not bucket_mb * 2**20 >= 1
    ):
        raise ValueError(
            f"{_CALLER}: bucket_mb={bucket_mb!r} is not accepted. Accepted: None (the default for the device) "
            "or a finite number of MiB, at least one byte."
        )
    if names not in NAMES:
        raise ValueError(f"{_CALLER}: names={names!r} is not accepted. Accepted: {', '.join(map(repr, NAMES))}.")
    if lora not in LORA:
        raise ValueError(f"{_CALLER}: lora={lora!r} is not accepted. Accepted: {', '.join(map(repr, LORA))}.")
    if device != "compute":
        try:
            where = torch.device(device)  # type: ignore[arg-type]
        except (RuntimeError, TypeError):
            where = None
        usable = where is not None and where.type != "meta"
        if usable and where.type == "cuda" and not torch.cuda.is_available():
            usable = False
        if not usable:
            raise ValueError(
                f"{_CALLER}: device={device!r} is not accepted. Accepted: 'cpu', 'compute' (the device the model "
                "computes on), or a torch.device (or its name) this machine has; never 'meta'."
            )
    world = get_world_size() if is_distributed() else 1
    if ranks is not None and (
        not isinstance(ranks, (list, tuple, set, frozenset))
        or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in ranks)
    ):
        raise ValueError(
            f"{_CALLER}: ranks={ranks!r} is not accepted. Accepted: None (every rank) or ranks in 0..{world - 1}."
        )


def default_bucket_mb(model: nn.Module) -> float:
    """The bucket cap ``bucket_mb=None`` means for ``model``: 256 MiB on an accelerator, 24 MiB on CPU.

    Example:
        >>> default_bucket_mb(torch.nn.Linear(2, 2))
        24
    """
    return 24 if compute_device(model).type == "cpu" else 256


def _digest(buckets: list) -> bytes:
    """What every rank must agree on before the first all-gather: the buckets' layout."""
    text = repr([(b.segment, b.segment_bytes, b.shards, b.output_bytes, list(b.outputs)) for b in buckets])
    return hashlib.sha256(text.encode()).digest()


def _check_same_plan(buckets: list) -> None:
    """Refuse (on every rank) plans that differ by rank: their all-gathers would not match. One 32-byte
    all-gather (``all_gather_object`` would pickle and take two collectives)."""
    world = get_world_size()
    digests = torch.empty(world, 32, dtype=torch.uint8, device=comm_device())
    mine = torch.frombuffer(bytearray(_digest(buckets)), dtype=torch.uint8)
    all_gather_single(digests.view(-1), mine.to(digests.device))
    rows = [bytes(r) for r in digests.cpu().tolist()]
    if len(set(rows)) > 1:
        raise StreamError(
            f"{_CALLER}: the ranks planned different buckets (their models differ in names, shapes or dtypes, or "
            "the call's bucket_mb, dtype, names or lora differ by rank); "
            f"layout digests per rank: {[r.hex()[:8] for r in rows]}."
        )


def iter_full_weights(
    model: nn.Module,
    *,
    bucket_mb: Optional[float] = None,
    dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device] = "cpu",
    names: str = "model",
    ranks: Optional[Sequence[int]] = None,
    lora: str = "merged",
    adapter_name: str = "default",
) -> WeightStream:
    """The full (unsharded) weights of ``model``, bucket by bucket: an iterator of lists of ``(name, tensor)``.

    **Every rank must call it and consume the whole stream** (each bucket is one all-gather), or leave it
    with ``close()`` / a ``with`` block on every rank: a rank that fails inside a ``with`` block, or closes
    early, makes every other rank raise ``StreamError`` with its message at their next bucket, instead of
    waiting for the process group's timeout (``break`` out of a bare ``for`` over it closes it too). An ``optimizer.step()`` on the model while a stream is open
    raises: the weights streamed are exactly those of one step.

    Each bucket holds at most ``bucket_mb`` MiB of weights (a larger tensor gets a bucket of its own) and
    costs one flat all-gather over the shard group (nothing to gather for NO_SHARD; on CPU, a tensor of
    2 MiB or more is filled by one in-place broadcast per rank instead: gloo's all-gathers copy every byte
    through a staging buffer, its broadcasts do not); the next bucket's collectives run while the caller
    works on the current one. Memory per rank: at most two buckets and
    one tensor beyond what the caller keeps (``del bucket`` at the end of a loop body: the loop variable
    would otherwise keep the previous bucket alive while the next one is copied out). A bucket's tensors view one buffer (``bucket.flat``), kept
    alive while any of them is. Units a forward left unsharded (``reshard_after_forward=False``) are resharded
    first: the stream reads the shards.

    Args:
        bucket_mb: the bucket size cap, in MiB. ``None``: 256 where the shards live on an accelerator (few,
            large collectives), 24 on CPU (gloo: an all-gather of 32 MiB or more gets fresh pages from the
            kernel every time, 2-4x slower per byte here; see docs/weights_out.md).
        dtype: cast floating-point tensors to this dtype (on the shards, before they travel).
        device: ``"cpu"`` (default), ``"compute"`` (where the model computes: a colocated inference
            engine on the same GPU) or a ``torch.device``.
        names: ``"model"``: ``get_full_state_dict``'s keys (tied aliases yielded as the same tensor);
            ``"hf"``: the keys ``save_pretrained`` writes (tied weights once, fused MoE experts split).
        ranks: the ranks that keep the tensors (default: all); the others get empty buckets (they still
            take part in every all-gather).
        lora: for a PEFT model: ``"merged"`` (the weights ``merge_and_unload()`` gives) or ``"adapters"``
            (only adapter ``adapter_name``'s tensors, under PEFT's file names).

    Raises:
        ValueError: a bad argument, or a model with tensors on the meta device; raised on every rank.
        StreamError: some rank failed or stopped early while streaming.

    Example:
        model = fsdp(GPT(GPTConfig()), auto_wrap=True, shard_strat="FULL_SHARD")
        with iter_full_weights(model, bucket_mb=64, dtype=torch.bfloat16) as stream:  # every rank, to the end
            for bucket in stream:
                for name, tensor in bucket:
                    ...  # e.g. engine.load_weights(bucket); the next bucket is already on its way
                del bucket
    """

    def prepare() -> tuple:
        check_dtype(dtype, _CALLER)
        _check_args(bucket_mb, names, lora, device, ranks)
        items, read = model_items(model, names=names, lora=lora, dtype=dtype, adapter_name=adapter_name)
        cap = bucket_mb if bucket_mb is not None else default_bucket_mb(model)
        return plan_buckets(items, int(cap * 2**20)), read

    buckets, read = on_all_ranks(prepare, errors=(StreamError,))
    if is_distributed() and get_world_size() > 1:
        _check_same_plan(buckets)
    where = compute_device(model) if device == "compute" else torch.device(device)
    keep = ranks is None or get_rank() in set(ranks)
    return WeightStream(buckets, read, keep, where, {id(p) for p in model.parameters()})

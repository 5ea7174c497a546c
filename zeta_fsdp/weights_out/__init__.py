"""Weights out while training: the full weights of a sharded model streamed in size-capped buckets.

``plan`` (pure: buckets and offsets), ``items`` (what a model's stream reads and yields, in its names or
Hugging Face's), ``gather`` (one flat all-gather per bucket, overlapped; on CPU large tensors by
in-place ``broadcasts``), ``stream`` (``iter_full_weights``),
``transfer`` (sending buckets to another process group, and loading them into a plain model).
"""

from .gather import StreamError, WeightBucket, WeightStream
from .stream import iter_full_weights
from .transfer import receive_weights, send_weights, weights_group

__all__ = ["StreamError", "WeightBucket", "WeightStream", "iter_full_weights", "receive_weights", "send_weights"]
__all__ += ["weights_group"]

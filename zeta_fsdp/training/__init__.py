"""Helpers a training loop needs around ``fsdp()``: gradient accumulation, clipping, memory.

* ``no_sync(model)``: accumulate gradients over micro-batches without any gradient collective;
  the first backward after the block reduces everything accumulated. ``defer="all_reduce"``
  keeps the reduce-scatter (sharded gradients) and defers only HYBRID_SHARD's replica all-reduce;
  ``memory_report(micro_batches=K)`` says what each choice costs (``zeta_fsdp.costs``).
* ``clip_grad_norm_(model, max_norm)``: the global gradient norm of a sharded model (DTensor
  gradients, on one or several meshes), returned as a plain float, and clipping in place.
* ``memory_report(model, optimizer)``: bytes this rank holds for parameters, gradients and
  optimizer state, next to what the unsharded tensors would take.

Example:
    for i, batch in enumerate(micro_batches):
        with no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(model(batch)) / len(micro_batches)).backward()
    norm = clip_grad_norm_(model, 1.0)
    print(memory_report(model, optimizer).table())
"""

from .accumulation import no_sync
from .clipping import clip_grad_norm_
from .memory import MemoryReport, memory_report

__all__ = ["MemoryReport", "clip_grad_norm_", "memory_report", "no_sync"]

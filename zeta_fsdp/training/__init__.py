"""Helpers a training loop needs around ``fsdp()``: gradient accumulation (``no_sync``), the global
gradient norm and clipping (``clip_grad_norm_``), and the bytes each rank holds (``memory_report``).

Example:
    for i, batch in enumerate(micro_batches):
        with no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(model(batch)) / len(micro_batches)).backward()
    norm = clip_grad_norm_(model, 1.0)
    NonFiniteGuard(model).step(optimizer, loss)  # skipped on every rank if any rank saw NaN/inf
    print(memory_report(model, optimizer).table())
"""

from .accumulation import no_sync
from .clipping import clip_grad_norm_
from .memory import MemoryReport, memory_report
from .meter import StepMeter, StepReport, training_flops_per_token
from .nonfinite import NonFiniteGuard
from .pending import drop_accumulation

__all__ = ["MemoryReport", "NonFiniteGuard", "clip_grad_norm_", "drop_accumulation", "memory_report", "no_sync"]
__all__ += ["StepMeter", "StepReport", "training_flops_per_token"]

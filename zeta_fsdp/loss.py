"""Loss reductions across data-parallel ranks, with NeMo's ``forward`` / ``reduce`` interface.

Averaging per-rank mean losses is wrong when ranks hold different numbers of valid tokens (a
rank with 10 tokens would weigh as much as one with 1000). These reductions compute the global
token-weighted (or sample-weighted) mean instead, with one all-reduce of two numbers; docs/strategy.md
("Loss reduction") says how the training loss is scaled so that FSDP's gradient average is the global one.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .distributed import GroupLike, comm_device, get_world_size, process_group_of

__all__ = ["MaskedTokenLossReduction", "PerSampleLossReduction"]

# NeMo's record key: users of its MaskedTokenLossReduction read the same name.
RECORD_KEY = "loss_sum_and_ub_size"


def _labels_and_mask(batch: Any) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if isinstance(batch, Mapping):
        return batch.get("labels"), batch.get("loss_mask")
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor):
        return batch[1], None  # (inputs, labels)
    return None, None


class _GlobalMeanReduction:
    """Shared machinery: subclasses say what is summed and what is counted."""

    def __init__(
        self,
        validation_step: bool = False,
        val_drop_last: bool = True,
        *,
        ignore_index: int = -100,
        group: GroupLike = None,
    ) -> None:
        self.validation_step = validation_step
        self.val_drop_last = val_drop_last  # NeMo's argument; nothing is dropped here, kept for compatibility
        self.ignore_index = ignore_index
        self.group = group

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group; the result is on ``tensor``'s device."""
        if get_world_size(self.group) > 1:
            buffer = tensor.to(comm_device(self.group))  # in place when it already lives there
            dist.all_reduce(buffer, group=process_group_of(self.group))
            tensor = buffer.to(tensor.device)
        return tensor

    def _sum_and_count(self, batch: Any, forward_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _per_token(self, batch: Any, forward_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position losses and weights (0 where masked), same shape, from logits or losses."""
        labels, mask = _labels_and_mask(batch)
        if labels is not None:  # labels follow the logits (CPU batches, a model fsdp() put on CUDA)
            labels = labels.to(forward_out.device)
        if mask is None:
            mask = (
                labels != self.ignore_index if labels is not None else torch.ones_like(forward_out, dtype=torch.float)
            )
        elif labels is not None and labels.shape == mask.shape:
            # A label equal to ignore_index is never a target, whatever loss_mask says (a mask built
            # from attention alone still counts -100 positions: loss 0 with weight 1 halves the loss).
            mask = torch.where((labels != self.ignore_index).to(mask.device), mask, torch.zeros_like(mask))
        mask = mask.to(forward_out.device)
        if labels is not None and forward_out.dim() == labels.dim() + 1:
            # Masked positions may hold any label (-100, padding ids): give them a valid one so
            # cross_entropy never sees an out-of-range target, then weight them by zero.
            safe = torch.where(mask.bool(), labels, torch.zeros_like(labels))
            losses = F.cross_entropy(
                forward_out.float().reshape(-1, forward_out.shape[-1]), safe.reshape(-1), reduction="none"
            ).view(labels.shape)
        else:
            losses = forward_out.float()
        weights = mask.to(losses.dtype)
        # torch.where, not a product: an inf/NaN loss at a masked position must not leak in.
        return torch.where(weights != 0, losses * weights, torch.zeros_like(losses)), weights

    def forward(self, batch: Any, forward_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss_for_backward, record)`` for one micro-batch on this rank.

        Training: ``loss_sum * dp_size / global_count`` (one all-reduce of the count), so that FSDP's gradient
        average over the ``dp_size`` ranks is the gradient of the global mean. ``validation_step=True``: this
        rank's own mean, nothing communicated. A rank whose tokens are all masked gives a zero loss (never NaN).

        Example:
            >>> reduction = MaskedTokenLossReduction(validation_step=True)
            >>> loss, record = reduction.forward({"loss_mask": torch.tensor([1, 1, 0])}, torch.tensor([1.0, 3.0, 7.0]))
            >>> loss.item(), record["loss_sum_and_ub_size"].tolist()
            (2.0, [4.0, 2.0])
        """
        loss_sum, count = self._sum_and_count(batch, forward_out)
        record = {RECORD_KEY: torch.stack([loss_sum.detach().double(), count.detach().double()])}
        if self.validation_step:
            return loss_sum / count.clamp(min=1), record
        global_count = self._all_reduce(count.detach().double().clone())
        scale = get_world_size(self.group) / global_count.clamp(min=1)
        return loss_sum * scale.to(loss_sum.dtype), record

    __call__ = forward

    def reduce(self, records: Union[Sequence[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """The global mean over ``records`` (one per micro-batch): one all-reduce of two numbers.

        Returns ``sum of losses / count`` over every rank of the data-parallel group and every
        record, as a float32 scalar tensor; ``0.0`` when nothing was counted anywhere. A rank
        with no records (``[]``) still takes part, with zeros on the communication device.

        Example:
            >>> reduction = MaskedTokenLossReduction()
            >>> _, record = reduction.forward({"labels": torch.tensor([[1, -100]])}, torch.tensor([[2.0, 9.0]]))
            >>> reduction.reduce([record]).item(), reduction.reduce([]).item()
            (2.0, 0.0)
        """
        if isinstance(records, Mapping):
            records = [records]
        if records:
            total = torch.stack([r[RECORD_KEY] for r in records]).sum(dim=0)
        else:
            total = torch.zeros(2, dtype=torch.float64, device=comm_device(self.group))
        total = self._all_reduce(total.clone())
        return (total[0] / total[1].clamp(min=1)).float()


class MaskedTokenLossReduction(_GlobalMeanReduction):
    """Global token-weighted mean loss across the data-parallel group (NeMo's interface).

    ``forward_out`` is logits ``(..., vocab)`` (cross-entropy against ``batch["labels"]``) or
    per-token losses shaped like the labels/mask. Padding is excluded with ``batch["loss_mask"]``
    (0/1 or float weights) or, without a mask, with labels equal to ``ignore_index``. A
    ``(inputs, labels)`` tuple works as a batch too. ``group`` is the data-parallel process group
    or 1-D ``DeviceMesh`` (default: the whole job).

    Example:
        >>> reduction = MaskedTokenLossReduction()
        >>> logits = torch.randn(2, 3, 5)
        >>> batch = {"labels": torch.tensor([[1, 2, 3], [4, -100, -100]])}
        >>> loss, record = reduction.forward(batch, logits)
        >>> record["loss_sum_and_ub_size"][1].item()  # 4 valid tokens
        4.0
        >>> torch.allclose(reduction.reduce([record]), torch.nn.functional.cross_entropy(logits.view(-1, 5), batch["labels"].view(-1)))
        True
    """

    def _sum_and_count(self, batch: Any, forward_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        losses, weights = self._per_token(batch, forward_out)
        return losses.sum(), weights.sum()


class PerSampleLossReduction(_GlobalMeanReduction):
    """Global per-sample mean across the data-parallel group: every sample weighs the same.

    For losses that are not per token (or where each sequence should count once, whatever its
    length). ``forward_out`` is one loss per sample ``(batch,)``, classification logits ``(batch, classes)``
    with labels ``(batch,)``, or per-token losses / logits, which are first averaged over each sample's
    valid tokens (samples with none are skipped).

    Example:
        >>> reduction = PerSampleLossReduction()
        >>> loss, record = reduction.forward({}, torch.tensor([1.0, 2.0, 6.0]))
        >>> reduction.reduce([record]).item()
        3.0
    """

    def _sum_and_count(self, batch: Any, forward_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels, mask = _labels_and_mask(batch)
        if forward_out.dim() == 1 and labels is None and mask is None:
            losses = forward_out.float()
            return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)
        losses, weights = self._per_token(batch, forward_out)
        if losses.dim() == 1:  # one loss per sample already: classification logits (B, C) with labels (B,)
            return losses.sum(), weights.sum()
        if losses.dim() == 0:
            raise ValueError(
                "PerSampleLossReduction: got a single loss (0-dim); it needs one loss per sample (batch,), "
                "per-token losses (batch, ...), or logits (batch, ..., classes) with labels (batch, ...)."
            )
        losses, weights = losses.flatten(1), weights.flatten(1)
        tokens = weights.sum(dim=1)
        has_tokens = tokens > 0
        per_sample = losses.sum(dim=1) / tokens.clamp(min=torch.finfo(tokens.dtype).tiny)
        per_sample = torch.where(has_tokens, per_sample, torch.zeros_like(per_sample))
        return per_sample.sum(), has_tokens.to(per_sample.dtype).sum()

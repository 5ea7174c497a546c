"""Which label convention a batch follows, and the per-token losses the strategy's reduction weighs.

Two conventions meet in ``FSDP2Strategy`` (docs/strategy.md, "Two label conventions"):

- **pre-shifted** (NeMo's, zeta's): ``labels[t]`` is the token after ``input_ids[t]``; the strategy's
  reduction computes ``cross_entropy(logits[t], labels[t])``, weighted by ``loss_mask`` / ``ignore_index``.
- **Hugging Face's**: ``labels`` is ``input_ids`` (ignored positions ``-100``); the model shifts them
  itself and returns ``.loss``, already averaged over its ``labels[..., 1:] != -100`` tokens.

A batch in Hugging Face's convention is recognised by its labels equalling its input ids; its module's
own loss is then used, weighted by its token count across ranks. The same labels given to a module
that computes no loss would train every position to predict its own token: refused, as are pre-shifted
labels given to a module that shifts them again.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ..distributed import GroupLike, comm_device, get_world_size, process_group_of

__all__ = ["HF_IGNORE_INDEX", "agree", "classify", "module_loss", "own_loss_tokens"]

HF_IGNORE_INDEX = -100  # transformers' loss functions ignore this label
KINDS = ("hf", "shifted", "other")  # "unknown": no valid label on this rank, nothing to tell

CONVENTIONS = (
    "Use one convention: Hugging Face's {'input_ids': ids, 'labels': ids} with a model that takes labels and "
    "returns .loss (a transformers model: it shifts the labels itself), or pre-shifted labels "
    "{'input_ids': tokens[:, :-1], 'labels': tokens[:, 1:]} (NeMo's, optionally with 'loss_mask'), "
    "whose loss the strategy computes from the logits."
)


def classify(batch: Any) -> str:
    """``"hf"`` (labels equal the input ids wherever not -100), ``"shifted"`` (labels equal the next input id),
    ``"other"`` (neither, or no ``input_ids`` to compare), ``"unknown"`` (no label that is not -100).

    Example:
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> classify({"input_ids": ids, "labels": ids}), classify({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        ('hf', 'shifted')
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return "other"
    if labels.shape != ids.shape or labels.dtype.is_floating_point:
        return "other"
    ids = ids.to(labels.device)
    valid = labels != HF_IGNORE_INDEX
    if not bool(valid.any()):
        return "unknown"
    if bool(((labels == ids) | ~valid).all()):
        return "hf"
    if ids.shape[-1] > 1 and bool(((labels[..., :-1] == ids[..., 1:]) | ~valid[..., :-1]).all()):
        return "shifted"
    return "other"


def agree(kind: str, group: GroupLike) -> str:
    """The convention every rank of ``group`` agrees on (one all-reduce), so that a refusal is raised on all.

    Example:
        >>> agree("hf", None)  # one process: its own
        'hf'
    """
    if get_world_size(group) == 1:
        return kind
    votes = torch.tensor([float(kind == k) for k in KINDS], device=comm_device(group))
    dist.all_reduce(votes, group=process_group_of(group))
    seen = [k for k, v in zip(KINDS, votes.tolist()) if v > 0]
    if "shifted" in seen or len(seen) > 1:
        return "shifted" if "shifted" in seen else "mixed"
    return seen[0] if seen else "unknown"


def module_loss(output: Any) -> Optional[torch.Tensor]:
    """The loss a module computed itself (``output.loss`` / ``output["loss"]``), else ``None``.

    Example:
        >>> module_loss({"loss": torch.tensor(2.0), "logits": torch.zeros(1)}).item(), module_loss(torch.zeros(1))
        (2.0, None)
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def own_loss_tokens(kind: str, batch: Mapping[str, Any], loss: torch.Tensor, module: str) -> dict[str, torch.Tensor]:
    """``(per-token losses, loss_mask)`` standing for a module's own mean ``loss``: the mean at each token it
    averaged (``labels[..., 1:] != -100`` for Hugging Face's causal convention, else ``labels != -100``), so that
    the token-weighted reduction gives each rank weight = its token count. Pre-shifted labels are refused.

    Example:
        >>> ids = torch.tensor([[5, 6, -100]])
        >>> own_loss_tokens("hf", {"input_ids": ids, "labels": ids}, torch.tensor(2.0), "M")["loss_mask"].tolist()
        [[1.0, 0.0]]
    """
    if kind in ("shifted", "mixed"):
        raise ValueError(
            f"FSDP2Strategy: {module} computed its own loss from labels that are already shifted (labels[t] is "
            "input_ids[t + 1]): a model that shifts them again (a transformers model) trains on the token after "
            f"next. {CONVENTIONS} Add 'loss_mask' to keep pre-shifted labels out of the model's own loss."
        )
    labels = batch["labels"]
    valid = labels[..., 1:] if kind in ("hf", "unknown") else labels
    mask = (valid != HF_IGNORE_INDEX).to(device=loss.device, dtype=torch.float32)
    return {"losses": loss.expand(mask.shape), "loss_mask": mask}


def refuse_unshifted(module: str) -> ValueError:
    """The error for Hugging Face labels (= input ids) reaching the strategy's reduction (no shift anywhere)."""
    return ValueError(
        f"FSDP2Strategy: the batch's labels equal its input_ids (Hugging Face's convention, where the model shifts "
        f"them), but {module} computed no loss of its own from them, so the loss would train each position to "
        f"predict its own token. {CONVENTIONS}"
    )

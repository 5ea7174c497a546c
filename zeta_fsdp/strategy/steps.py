"""How the strategy calls a module (its own hooks, through the FSDP root), what they return, the loss.

Shared by ``zeta_fsdp.strategy`` and ``zeta_fsdp.lightning``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from ..engines import hooks_on, unwrapped_class
from ..loss import MaskedTokenLossReduction
from .labels import agree, classify, module_loss, own_loss_tokens, refuse_unshifted

__all__ = ["StepLosses", "call_through_root", "nemo_step_result", "parse_optimizers", "run_step"]

STEP_TYPES = ("training", "validation", "test", "predict")


def call_through_root(module: nn.Module, method: str, *args: Any) -> Any:
    """Call ``module.<method>(*args)`` from inside ``module(...)``, so FSDP's root hooks wrap it.

    FSDP2 treats the first unit whose ``forward`` runs as the root. A LightningModule step that
    calls ``self.model(x)`` (not ``self(x)``) would make a child unit the root and leave the real
    root's parameters sharded. So, like Lightning's forward redirection, ``forward`` is swapped
    for the step for exactly one call; the step's own ``self(...)`` calls reach the real forward.
    """
    if not hooks_on(module):
        return getattr(module, method)(*args)
    had_own = "forward" in vars(module)
    original = module.forward

    def restore() -> None:
        if had_own:
            module.forward = original
        else:
            vars(module).pop("forward", None)

    def redirected(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()
        return getattr(module, method)(*inner_args, **inner_kwargs)

    module.forward = redirected
    try:
        return module(*args)
    finally:
        restore()


def parse_optimizers(result: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Lightning's ``configure_optimizers`` return forms -> (optimizers, schedulers)."""
    if result is None:
        return [], []
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, Mapping):
        scheduler = result.get("lr_scheduler")
        if isinstance(scheduler, Mapping):
            scheduler = scheduler.get("scheduler")
        return [result["optimizer"]], [scheduler] if scheduler is not None else []
    if isinstance(result, tuple) and len(result) == 2 and all(isinstance(r, (list, tuple)) for r in result):
        optimizers, schedulers = result
        return list(optimizers), [s.get("scheduler") if isinstance(s, Mapping) else s for s in schedulers]
    if isinstance(result, (list, tuple)):
        parsed = [parse_optimizers(item) for item in result]
        return [o for opts, _ in parsed for o in opts], [s for _, scheds in parsed for s in scheds]
    raise ValueError(f"FSDP2Strategy: configure_optimizers returned {type(result).__name__}, not an optimizer.")


def module_loss_reduction(module: Optional[nn.Module], step_type: str) -> Any:
    """The module's ``<step_type>_loss_reduction`` or ``loss_reduction`` (an object, or a callable returning one)."""
    if step_type not in STEP_TYPES:
        raise ValueError(f"FSDP2Strategy: unknown step type {step_type!r}. Accepted: {STEP_TYPES}.")
    for name in (f"{step_type}_loss_reduction", "loss_reduction"):
        found = getattr(module, name, None)  # None for module=None
        if found is not None:
            if callable(found) and not hasattr(found, "reduce"):
                found = found()
            return found
    return None


def nemo_step_result(module: nn.Module, step_type: str, batch: Any, output: Any) -> tuple[Any, dict[str, Any]]:
    """NeMo's ``(loss, reduced)`` of a step's ``output``: the module's loss reduction's ``forward``, else
    ``(output, {"avg": output})``; a record with no ``"avg"`` (zeta's) gets its global mean (one all-reduce)."""
    reduction = module_loss_reduction(module, step_type)
    if reduction is None or output is None:
        return output, {"avg": output}
    loss, reduced = reduction.forward(batch, output)
    if "avg" not in reduced and callable(getattr(reduction, "reduce", None)):
        reduced = {**reduced, "avg": reduction.reduce([reduced])}
    return loss, reduced


def forward_batch(module: nn.Module, batch: Any) -> Any:
    """Call a plain module with the batch: matching keyword arguments, else the inputs tensor."""
    if isinstance(batch, Mapping):
        params = inspect.signature(module.forward).parameters
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        # labels / loss_mask are for the loss reduction; a model computing its own per-rank
        # mean loss from them is exactly the error the reduction exists to avoid.
        kwargs = {k: v for k, v in batch.items() if k in params or (takes_kwargs and k not in ("labels", "loss_mask"))}
        if kwargs:
            return module(**kwargs)
        for key in ("input_ids", "inputs", "input", "x"):
            if key in batch:
                return module(batch[key])
        raise ValueError(
            f"FSDP2Strategy: cannot call {type(module).__name__}.forward with batch keys {sorted(batch)}; "
            "define training_step(batch, batch_idx) on the module or use matching argument names."
        )
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return module(batch[0])  # (inputs, labels)
    return module(batch)


def logits_of(output: Any) -> torch.Tensor:
    """The logits (or per-token losses) in a module's output: a tensor, ``["logits"]`` or ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ValueError(
        f"FSDP2Strategy: the module returned {type(output).__name__}; the loss reduction needs logits or "
        "per-token losses (a tensor, or an output with .logits). A loss already averaged on each rank "
        "cannot be re-weighted: return logits, or define training_step on the module."
    )


def run_step(
    module: nn.Module, step_type: str, batch: Any, batch_idx: Optional[int], reduce: Callable[[str, Any], Any]
) -> Any:
    """One ``step_type`` step: the module's own ``<step_type>_step`` through the FSDP root, else
    ``reduce(step_type, batch)`` (``"predict"``: the module's output). Evaluation runs in eval mode
    without gradients, the previous mode restored after."""
    name, training = f"{step_type}_step", step_type == "training"
    own = getattr(type(module), name, None)  # the module's class defines the step itself (not nn.Module)
    was_training = module.training
    module.train(training)
    try:
        with contextlib.nullcontext() if training else torch.no_grad():
            if callable(own) and own is not getattr(nn.Module, name, None):
                return call_through_root(module, name, batch, batch_idx)
            return forward_batch(module, batch) if step_type == "predict" else reduce(step_type, batch)
    finally:
        module.train(was_training or training)


class StepLosses:
    """The strategy's losses: which reduction a step uses (the module's own, else a token-weighted one over
    the dp group ``group_fn()``), a plain module's step loss, and the global mean since the last
    ``reduced`` call. Records are summed as they come (constant memory): one all-reduce gives the mean."""

    def __init__(self, group_fn: Callable[[], Any]) -> None:
        self._group_fn = group_fn
        self._defaults: dict[str, Any] = {}
        self._totals: dict[str, tuple[Any, str, torch.Tensor]] = {}  # step type -> (reduction, key, sum)
        self._kinds: dict[tuple[str, bool], str] = {}  # (step type, has loss_mask) -> label convention

    def reduction(self, module: Optional[nn.Module], step_type: str) -> Any:
        """The module's ``<step_type>_loss_reduction`` / ``loss_reduction``, else the token-weighted default."""
        own = module_loss_reduction(module, step_type)
        if own is not None:
            return own
        if step_type not in self._defaults:
            self._defaults[step_type] = MaskedTokenLossReduction(
                validation_step=step_type != "training", group=self._group_fn()
            )
        return self._defaults[step_type]

    def step(self, module: nn.Module, step_type: str, batch: Any) -> torch.Tensor:
        """This rank's loss of ``module`` on ``batch``; its record (first entry) joins the running sum."""
        reduction = self.reduction(module, step_type)
        loss, record = reduction.forward(*self._loss_inputs(module, step_type, reduction, batch))
        key = next(iter(record))
        value = record[key].detach()
        if step_type in self._totals:
            value = value + self._totals[step_type][2]
        self._totals[step_type] = (reduction, key, value)
        return loss

    def _loss_inputs(self, module: nn.Module, step_type: str, reduction: Any, batch: Any) -> tuple[Any, torch.Tensor]:
        """``(batch, forward_out)`` for the reduction: the logits, or (Hugging Face's label convention, the
        default reduction) the module's own mean loss at each token it averaged (strategy/labels.py)."""
        output = forward_batch(module, batch)
        if reduction is not self._defaults.get(step_type) or not isinstance(batch, Mapping) or "labels" not in batch:
            return batch, logits_of(output)
        style = (step_type, "loss_mask" in batch)  # loss_mask: NeMo's pre-shifted batch
        kind = self._kinds.get(style)
        if kind is None:  # decided once per batch style, by every rank together: a refusal is raised on all
            kind = agree(classify(batch), self._group_fn())
            if kind != "unknown":
                self._kinds[style] = kind
        own = module_loss(output) if "loss_mask" not in batch else None
        if own is not None:
            tokens = own_loss_tokens(kind, batch, own, unwrapped_class(module).__name__)
            return {"loss_mask": tokens["loss_mask"]}, tokens["losses"]
        if kind == "hf":
            raise refuse_unshifted(unwrapped_class(module).__name__)
        return batch, logits_of(output)

    def reduced(self, module: Optional[nn.Module], step_type: str) -> torch.Tensor:
        """Global mean of the ``step_type`` steps since the last call (one all-reduce); forgets them."""
        if step_type not in self._totals:
            return self.reduction(module, step_type).reduce([])
        reduction, key, total = self._totals.pop(step_type)
        return reduction.reduce([{key: total}])

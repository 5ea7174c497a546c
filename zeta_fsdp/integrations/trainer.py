"""``FSDPTrainer``: transformers' ``Trainer`` for a model ``fsdp()`` already sharded.

One line changes in a Trainer script: ``Trainer(...)`` becomes ``FSDPTrainer(...)`` (for a
``Trainer`` subclass such as TRL's ``SFTTrainer``: ``class MyTrainer(FSDPTrainerMixin, SFTTrainer)``).
A subclass, not a callback or ``TrainingArguments``: the parts that must change (how the model is
prepared, clipped, checkpointed and saved) are methods of the Trainer, and a callback reaches none
of them. What changes:

* the Trainer's accelerator is ``FSDPAccelerator``: the model is never wrapped a second time
  (no ``DistributedDataParallel``, no second ``fully_shard``), accumulation is ``no_sync``,
  clipping is ``clip_grad_norm_``, and mixed precision is ``fsdp(mp=...)`` (``check_precision``);
* checkpoints (``save_strategy``) hold a sharded DCP checkpoint (``save_checkpoint``: model,
  optimizer) and the scheduler's state next to the Trainer's own files, and ``resume_from_checkpoint`` restores it
  at any world size;
* ``save_model()`` writes Hugging Face files from the shards (``save_pretrained``; a PEFT model's
  adapter as PEFT writes it), on every rank, into a folder ``from_pretrained`` loads.

Settings that cannot work with a model sharded already raise a ``ValueError`` naming the setting,
when the Trainer is built (``check_trainer_args``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    import accelerate
    import transformers
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError(
        "zeta_fsdp.integrations.trainer needs transformers and accelerate: pip install 'zeta-fsdp[hf]'"
    ) from e

from ..engines import fsdp_engine, is_fsdp_wrapped
from ..hf import load_pretrained, save_pretrained
from ..hf.adapters import save_adapters
from ..state_dict import load_checkpoint, save_checkpoint
from .accelerator import FSDPAccelerator, check_precision

__all__ = ["CHECKPOINT_DIR", "FSDPTrainer", "FSDPTrainerMixin", "check_trainer_args"]

# Inside each checkpoint-N folder: the DCP checkpoint (model, optimizer) resuming reads.
CHECKPOINT_DIR = "zeta_fsdp"
# The Trainer methods FSDPTrainerMixin overrides. Some are private; a release that renames one
# must fail loudly here, not train on with the Trainer's own (wrong for shards) version.
_OVERRIDDEN = ("create_accelerator_and_postprocess", "save_model", "_save_optimizer_and_scheduler")
_OVERRIDDEN += ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_clip_grad_norm")
_SCHEDULER = "scheduler.pt"  # the Trainer's own name and format for the scheduler's state
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def _check_transformers() -> None:
    missing = [name for name in _OVERRIDDEN if not callable(getattr(transformers.Trainer, name, None))]
    if missing:
        raise ImportError(
            f"zeta_fsdp's FSDPTrainer does not support transformers {transformers.__version__}: its Trainer no longer "
            f"has {missing}. Install the transformers release the zeta_fsdp docs name (docs/huggingface.md)."
        )


def _engine(model: nn.Module) -> Optional[str]:
    """The engine ``fsdp()`` chose for ``model`` or the module it wrapped inside (a PEFT model's base)."""
    return next((e for e in map(fsdp_engine, model.modules()) if e is not None), None)


def _refuse(setting: str, why: str) -> None:
    raise ValueError(f"zeta_fsdp FSDPTrainer: {setting} {why}")


# The TrainingArguments settings FSDPTrainer refuses, in the order checked: (is it set, the setting, why
# and what to use instead).
_REFUSED_ARGS: list[tuple[Callable[[Any], Any], str, str]] = [
    (
        lambda args: args.fsdp or (args.fsdp_config or {}).get("fsdp_version") or args.deepspeed,
        "TrainingArguments(fsdp=/fsdp_config=/deepspeed=)",
        "would shard the model again: fsdp() sharded it already. Remove those arguments.",
    ),
    (
        lambda args: args.torch_compile,
        "TrainingArguments(torch_compile=True)",
        "compiles around FSDP's hooks: use fsdp(model, compile=True).",
    ),
    (
        lambda args: args.gradient_checkpointing,
        "TrainingArguments(gradient_checkpointing=True)",
        "is applied after sharding here: use fsdp(model, activation_checkpointing=True) instead.",
    ),
    (
        lambda args: args.load_best_model_at_end,
        "TrainingArguments(load_best_model_at_end=True)",
        "is not supported: load the best checkpoint-N/zeta_fsdp yourself with zeta_fsdp.load_checkpoint.",
    ),
    # transformers casts the model with model.to(dtype) for evaluation: on sharded parameters that
    # makes the fp32 master weights bf16/fp16 for good (or breaks FSDP's all-gather buffers).
    *(
        (
            lambda args, flag=flag: getattr(args, flag, False),
            f"TrainingArguments({flag}=True)",
            "would cast the sharded master weights for good: evaluation already computes in fsdp(mp=...)'s "
            "dtype. Remove it (use fsdp(model, mp='bf16') for low-precision compute).",
        )
        for flag in ("bf16_full_eval", "fp16_full_eval")
    ),
]


def check_trainer_args(model: Any, args: Any) -> None:
    """Raise a ``ValueError`` naming the setting to change if ``model``/``args`` cannot train as is.

    Called by ``FSDPTrainer`` before the Trainer is built, identically on every rank.

    Example:
        >>> check_trainer_args(nn.Linear(2, 2), None)
        Traceback (most recent call last):
        ...
        ValueError: zeta_fsdp FSDPTrainer: model=Linear is not a model fsdp() wrapped: shard it first, model = fsdp(model, ...), or train it with transformers.Trainer
    """
    if not isinstance(model, nn.Module) or not is_fsdp_wrapped(model) or _engine(model) is None:
        _refuse(
            f"model={type(model).__name__}",
            "is not a model fsdp() wrapped: shard it first, model = fsdp(model, ...), or train it with transformers.Trainer",
        )
    if args is None:
        return
    for is_set, setting, why in _REFUSED_ARGS:
        if is_set(args):
            _refuse(setting, why)
    for flag in ("bf16", "fp16"):
        if getattr(args, flag):
            check_precision(model, flag, f"TrainingArguments({flag}=True)")


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` holds the torch optimizer whose state is saved."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def save_hf(model: nn.Module, output_dir: os.PathLike) -> None:
    """Write ``model`` (a PEFT model: its adapter) in Hugging Face's layout into ``output_dir``, on every rank.

    The Trainer's output folder holds other things (checkpoints, a tokenizer), which ``save_pretrained``
    never replaces: the files are written into a hidden folder inside, then moved over the old weights.
    """
    output_dir = Path(output_dir)
    staging = output_dir / ".zeta_fsdp_save"
    if _is_peft(model):
        save_adapters(model, staging, overwrite=True)
    else:
        save_pretrained(model, staging, overwrite=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        new = {f.name for f in staging.iterdir()}
        for old in output_dir.glob("*.safetensors*"):  # weights of an earlier save the new ones replace
            if old.name not in new and (old.name in _HF_WEIGHTS or old.name.startswith("model-")):
                old.unlink()
        for f in staging.iterdir():
            os.replace(f, output_dir / f.name)
        staging.rmdir()
    _barrier()


class FSDPTrainerMixin:
    """Makes a ``transformers.Trainer`` (or subclass) train a model ``fsdp()`` sharded.

    Put it first: ``class MyTrainer(FSDPTrainerMixin, SFTTrainer): pass``. What it changes: the
    module docstring (``zeta_fsdp.integrations.trainer``).

    Example:
        class SFT(FSDPTrainerMixin, trl.SFTTrainer):
            pass
        SFT(model=fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD"), args=config, train_dataset=ds).train()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_transformers()
        model = kwargs.get("model", args[0] if args else None)
        check_trainer_args(model, kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if type(self.accelerator) is accelerate.Accelerator:
            # FSDPAccelerator adds methods only (no state), so the Trainer's instance is retyped
            # rather than rebuilt from a copy of the Trainer's long list of Accelerator arguments.
            self.accelerator.__class__ = FSDPAccelerator

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Hugging Face files ``from_pretrained`` loads, written from the shards on every rank."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        _barrier()
        save_hf(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self.model, _inner_optimizer(self.optimizer), overwrite=True)
        if self.args.should_save and self.lr_scheduler is not None:  # as the Trainer writes it
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        model = self.model if model is None else model
        sharded = Path(resume_from_checkpoint) / CHECKPOINT_DIR
        if sharded.is_dir():
            load_checkpoint(sharded, model)
        elif _is_peft(model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # PEFT's load_adapter: plain tensors
        else:
            load_pretrained(model, resume_from_checkpoint)  # save_only_model=True: the weights alone

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or not (Path(checkpoint) / CHECKPOINT_DIR).is_dir():
            return
        load_checkpoint(
            Path(checkpoint) / CHECKPOINT_DIR, self.model, _inner_optimizer(self.optimizer), model_weights=False
        )
        if self.lr_scheduler is not None and os.path.isfile(os.path.join(checkpoint, _SCHEDULER)):
            # weights_only: plain numbers and lists, nothing a file could run
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True))


class FSDPTrainer(FSDPTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for a model returned by ``fsdp()``: the same arguments, nothing else to add.

    Example:
        model = fsdp(LlamaForCausalLM(cfg), auto_wrap=True, shard_strat="FULL_SHARD", mp="bf16")
        args = TrainingArguments("out", bf16=True, gradient_accumulation_steps=2, save_strategy="steps")
        FSDPTrainer(model=model, args=args, train_dataset=ds).train()
    """

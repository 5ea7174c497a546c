"""Integrations with training frameworks that own the loop: transformers' ``Trainer`` and accelerate.

Optional, imported only on demand (never by ``import zeta_fsdp``):

* ``zeta_fsdp.integrations.trainer.FSDPTrainer``: a ``transformers.Trainer`` for a model returned by
  ``fsdp()`` (``FSDPTrainerMixin`` for ``Trainer`` subclasses such as TRL's).
* ``zeta_fsdp.integrations.accelerator.FSDPAccelerator``: an ``accelerate.Accelerator`` that prepares such
  a model without wrapping it a second time.

docs/huggingface.md ("Training with transformers' Trainer") says what differs from accelerate's FSDP2 plugin.
"""

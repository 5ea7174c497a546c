"""Train the demo GPT with a Lightning ``Trainer`` and ``zeta_fsdp.lightning.FSDP2Strategy``, then resume.

Two CPU ranks; Lightning starts the second one itself (run it as a script file), or use torchrun:
    python examples/lightning_train.py --steps 6
    python examples/lightning_train.py --steps 6 --resume checkpoints/lightning/step=3.ckpt
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --steps 6

What it shows: a ``LightningModule`` building its model in ``configure_model`` (under the
strategy's ``tensor_init_context``), FSDP2 over both ranks (``TransformerBlock=Block``: every block
its own unit), ``self.log(..., sync_dist=True)``, validation, an LR scheduler, dataclass
hyperparameters, ``ModelCheckpoint`` every ``--save-every`` steps plus ``last.ckpt``, and
``trainer.fit(..., ckpt_path=...)`` resuming weights, optimizer state and step exactly.
Rank 0 prints ``step N: loss X`` (the loss over both ranks' batches) for each step it trains.
An epoch is 3 steps (24 samples, 4 per rank): a checkpoint at an epoch's end resumes bit for bit
(a mid-epoch one restarts Lightning's epoch: Lightning warns about it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeta_fsdp import shutdown  # noqa: E402
from zeta_fsdp.lightning import FSDP2Strategy  # noqa: E402
from zeta_fsdp.models.gpt import GPT, Block, GPTConfig, lm_loss  # noqa: E402


def counting_data(n: int = 24, length: int = 12, vocab: int = 37) -> TensorDataset:
    """Sequences counting up from a random start: learnable next-token targets."""
    g = torch.Generator().manual_seed(0)
    tokens = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(length + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class LitGPT(L.LightningModule):
    def __init__(self, config: GPTConfig, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()  # the dataclass round-trips through the checkpoint
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:  # called again on resume: keep the model
            torch.manual_seed(0)  # same initial weights on every rank
            self.model = GPT(self.hparams.config)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = lm_loss(self.model(inputs), targets)  # self.model(...): the strategy routes it through the FSDP root
        self.log("train_loss", loss, sync_dist=True)  # mean over the data-parallel ranks
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        return lm_loss(self.model(inputs), targets)  # the strategy logs it as val_loss (mean over ranks), as NeMo's

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}


class PrintLoss(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics["train_loss"].item()  # every rank reduces; rank 0 prints
        if trainer.is_global_zero:
            print(f"step {trainer.global_step}: loss {loss:.6f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--ckpt-dir", default="checkpoints/lightning")
    parser.add_argument("--resume", default=None, help="a checkpoint written by an earlier run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = counting_data()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDP2Strategy(TransformerBlock=Block),
        max_steps=args.steps,
        val_check_interval=args.save_every,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="{step}",
                every_n_train_steps=args.save_every,
                save_top_k=-1,
                save_last=True,
            ),
            PrintLoss(),
        ],
    )
    module = LitGPT(GPTConfig())
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=8), ckpt_path=args.resume)
    if trainer.is_global_zero:
        print(f"done: global_step {trainer.global_step}, val_loss {trainer.callback_metrics['val_loss'].item():.6f}")
        print("checkpoints:", " ".join(sorted(p.name for p in Path(args.ckpt_dir).iterdir())), flush=True)
    shutdown(force=True)  # every rank leaves together (Lightning keeps the group it made)
    os._exit(0)  # Lightning's launcher waits on its child; nothing else to flush


if __name__ == "__main__":
    main()

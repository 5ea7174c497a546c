"""A real ``lightning.pytorch.Trainer.fit`` with ``zeta_fsdp.lightning.FSDP2Strategy`` on 2 CPU ranks.

Run by ``tests/test_lightning.py`` two ways, as users launch: ``torchrun --nproc-per-node=2`` (Lightning
sees an external launcher) and plain ``python`` (Lightning's own ``_SubprocessScriptLauncher`` re-runs
this file for rank 1; that is why it is a script file). Rank 0 writes its results to ``--out``.

``--mode fit``: parity with a single-process reference, ModelCheckpoint (save_top_k, save_last),
validation, logging, an LR scheduler, dataclass hyperparameters; then a resume from
the mid-run checkpoint that trains only the remaining steps and ends equal to the uninterrupted run.
``--mode bf16``: ``precision="bf16-mixed"`` runs the FSDP2 bf16 policy (bf16 parameters in forward,
fp32 masters), and ``gradient_clip_val`` clips with zeta's DTensor-aware ``clip_grad_norm_``: bit-equal
to zeta's own strategy with ``mp_policy="bf16"`` clipping by ``strategy.clip_grad_norm_``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from zeta_fsdp.lightning import FSDP2Strategy

STEPS, HALF, PER_RANK, LR, CLIP = 8, 4, 2, 0.05, 0.5


@dataclasses.dataclass
class Config:
    width: int = 16
    depth: int = 2


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g)
    return TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


class Net(L.LightningModule):
    def __init__(self, config: Config, build_in_configure: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.config = config
        self.net = None if build_in_configure else self._build()
        self.param_dtypes: list[torch.dtype] = []

    def _build(self) -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(8, self.config.width), nn.Tanh()]
        for _ in range(self.config.depth - 1):
            layers += [nn.Linear(self.config.width, self.config.width), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(self.config.width, 1))

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._build()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.param_dtypes.append(next(self.net.parameters()).dtype)  # inside forward: unsharded
        loss = F.mse_loss(self.net(x), y)  # self.net, not self: needs the root redirection
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


class CountSteps(Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, *args, **kwargs):
        self.batches += 1


def loaders():
    ds = data()
    return DataLoader(ds, batch_size=PER_RANK), DataLoader(ds, batch_size=PER_RANK)


def trainer(max_steps: int, ckpt_dir: Path, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDP2Strategy(),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        val_check_interval=HALF,
        callbacks=[
            ModelCheckpoint(
                dirpath=ckpt_dir, monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=HALF
            ),
            *callbacks,
        ],
        **kwargs,
    )


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }


def rank_batch(rank: int, epoch: int, step_in_epoch: int) -> list[int]:
    """The sample indices Lightning feeds ``rank``: its own shuffled DistributedSampler (seed 0)."""
    sampler = DistributedSampler(data(), num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)[step_in_epoch * PER_RANK : (step_in_epoch + 1) * PER_RANK]


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, AdamW + StepLR (per epoch), the gradient FSDP computes bit for bit: each rank's
    batch (``rank_batch``) gets its own forward, mean loss and gradient (same shapes, so the same
    kernels and rounding as on the rank), and the two gradients are averaged as the reduce-scatter
    does, ``(g0 + g1) / 2`` (a sum of two is exact in either order; halving is exact)."""
    ref = Net(Config())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    x, y = data().tensors
    per_epoch = len(x) // (2 * PER_RANK)
    params = list(ref.parameters())
    for step in range(steps):
        s = step % per_epoch
        grads = []
        for r in range(2):
            idx = rank_batch(r, step // per_epoch, s)
            grads.append(torch.autograd.grad(F.mse_loss(ref(x[idx]), y[idx]), params))
        for p, g0, g1 in zip(params, *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
        opt.zero_grad()
        if s == per_epoch - 1:
            sched.step()  # Lightning steps a scheduler once per epoch unless told otherwise
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def mode_fit(out: Path, tmp: Path) -> dict:
    results = {}
    # uninterrupted run, model built in configure_model
    model = Net(Config(), build_in_configure=True)
    t = trainer(STEPS, tmp / "full")
    t.fit(model, *loaders())
    results["global_step"] = t.global_step
    final = full_params(model)
    results["ref_diff"] = max_diff(final, reference(STEPS))
    results["files"] = sorted(p.name for p in (tmp / "full").iterdir())
    results["val_loss_logged"] = "val_loss" in t.callback_metrics
    mesh = model.device_mesh  # Lightning's names, as users of ModelParallelStrategy index them
    results["mesh"] = [list(mesh.mesh_dim_names), mesh["data_parallel"].size(), mesh["tensor_parallel"].size()]
    results["param_mesh"] = sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()})
    # interrupted at HALF, resumed from the checkpoint written there: only the remaining steps run
    model = Net(Config())
    t = trainer(HALF, tmp / "half")
    t.fit(model, *loaders())
    counter = CountSteps()
    resumed = Net(Config())
    t = trainer(STEPS, tmp / "half", callbacks=[counter])
    t.fit(resumed, *loaders(), ckpt_path=str(tmp / "half" / "last.ckpt"), weights_only=False)
    results["resumed_batches"] = counter.batches
    results["resumed_global_step"] = t.global_step
    results["resume_diff"] = max_diff(full_params(resumed), final)
    results["lr_after_resume"] = t.optimizers[0].param_groups[0]["lr"]
    results["hparams"] = dataclasses.asdict(resumed.hparams["config"])
    ckpt = torch.load(tmp / "half" / "last.ckpt", weights_only=False)
    results["ckpt_hparams_is_dataclass"] = isinstance(ckpt["hyper_parameters"]["config"], Config)
    return results


def mode_bf16(out: Path, tmp: Path) -> dict:
    from zeta_fsdp import FSDP2Strategy as Core

    model = Net(Config())
    t = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDP2Strategy(),
        precision="bf16-mixed",
        gradient_clip_val=CLIP,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    t.fit(model, loaders()[0])
    # the same three steps with zeta's own strategy (bf16 policy), same data split
    core = Core(mp_policy="bf16")
    twin = Net(Config())
    core.connect(twin)
    opt = core.setup_optimizers(lambda m: torch.optim.AdamW(m.parameters(), lr=LR))[0]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    x, y = data().tensors
    r = dist.get_rank()
    norms = []
    for step in range(3):
        idx = rank_batch(r, 0, step)
        core.training_step((x[idx], y[idx]), step).backward()
        norms.append(core.clip_grad_norm_(CLIP))  # what gradient_clip_val must do: zeta's clipping
        opt.step()
        sched.step()
        opt.zero_grad()
    return {
        "forward_dtypes": sorted({str(d) for d in model.param_dtypes}),
        "master_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "twin_diff": max_diff(full_params(model), full_params(twin)),
        "clipped": max(norms) > CLIP,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["fit", "bf16"], required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    tmp = out / "work"
    results = {"fit": mode_fit, "bf16": mode_bf16}[args.mode](out, tmp)
    results["world"] = dist.get_world_size()
    rank = dist.get_rank()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    from zeta_fsdp import shutdown

    shutdown(force=True)
    os._exit(0)  # Lightning's launcher waits on the children; nothing else to flush


if __name__ == "__main__":
    main()

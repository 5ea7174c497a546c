"""``zeta_fsdp.lightning.FSDP2Strategy`` driven the way NeMo and Lightning drive theirs, in real ``Trainer`` runs.

NeMo's own test file for its ``FSDP2Strategy`` (``tests/lightning/pytorch/strategies/test_fsdp2_strategy.py``)
checks its behaviour against mocks; the behaviour is checked here with real modules, a real ``Trainer``
and real gloo ranks: ``setup`` connects the trainer and parallelizes once, ``val_loss`` / ``test_loss``
are logged (and monitored), ``predict_step`` returns the reduced dict, ``save_checkpoint`` hands
``storage_options`` to a ``CheckpointIO``, and NeMo's PEFT calls (``load_model_state_dict(adapter_state,
strict=False)``, ``load_optimizer_state_dict``) inside a running fit. Lightning's own
``ModelParallelStrategy`` integration tests (device mesh, tensor parallel, FSDP2 + TP, the strategy's
state dict) run here on 2 and 4 CPU ranks.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from worker import Cases, expect_error, full, rank, run_cases, world

from zeta_fsdp.lightning import FSDP2Strategy
from zeta_fsdp.state_dict import get_sharded_state_dict

CASES = Cases()
case = CASES.case


def trainer(strategy: FSDP2Strategy, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=world(),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(strategy=strategy, **{**options, **kwargs})


def regression_data(n: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


class Net(L.LightningModule):
    """A step returning its loss (NeMo's contract): the strategy logs it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@case
def nemo_setup_parallelizes_once_and_keeps_the_trainer():
    """NeMo's test_init / test_setup / test_parallelize: defaults set, trainer kept, parallelize_fn cleared."""
    strategy = FSDP2Strategy(data_parallel_size=world(), tensor_parallel_size=1)
    assert strategy.mp_policy is not None and strategy.parallelize_fn is not None
    assert strategy.lightning_restore_optimizer is True
    expect_error(RuntimeError, lambda: strategy.device_mesh, "device mesh")
    model = Net()
    t = trainer(strategy, max_steps=1)
    t.fit(model, DataLoader(regression_data(), batch_size=2))
    assert strategy.trainer is t, "setup() did not keep the trainer"
    assert strategy.parallelize_fn is None, "parallelize_fn not cleared after it ran"
    assert all(isinstance(p, DTensor) for p in model.parameters())
    params = [id(p) for p in model.parameters()]
    strategy.parallelize()  # a second call changes nothing
    assert [id(p) for p in model.parameters()] == params
    assert int(strategy.current_epoch_step) == t.global_step == 1
    assert strategy._get_loss_reduction("validation") is not None  # the core's (token-weighted) default


@case
def nemo_val_loss_logged_and_monitored_test_loss_predict_dict():
    """val_loss is logged from the returned loss, the mean over ranks and steps, on every rank alike,
    so ModelCheckpoint(monitor="val_loss") works; test_loss likewise; predict returns {"avg": output}."""
    data = regression_data()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(dist_broadcast(tmp))
        ckpt = ModelCheckpoint(dirpath=tmp, monitor="val_loss", save_top_k=1, filename="{step}")
        model = Net()
        t = trainer(FSDP2Strategy(), max_steps=2, callbacks=[ckpt], enable_checkpointing=True)
        t.fit(model, DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
        # every rank validated its 2 batches of 2 (DistributedSampler, no shuffle): the logged value is
        # the mean of the 4 per-batch losses (mean over ranks of each step, then over steps)
        ref = full_copy(model)
        per_batch = []
        for r in range(world()):
            idx = list(DistributedSampler(data, num_replicas=world(), rank=r, shuffle=False))
            per_batch += [
                F.mse_loss(ref(data.tensors[0][idx[i : i + 2]]), data.tensors[1][idx[i : i + 2]]) for i in (0, 2)
            ]
        want = torch.stack(per_batch).mean()
        got = t.callback_metrics["val_loss"]
        # 4 float32 losses summed in another grouping: within a few roundings of the mean
        assert abs(got.item() - want.item()) <= 8 * 2.0**-24 * want.item(), (got, want)
        assert ckpt.best_model_score is not None and torch.equal(ckpt.best_model_score, got)
        files = sorted(p.name for p in tmp.iterdir())
        assert files == ["step=2.ckpt"], files
        dist.barrier()
    t.test(model, DataLoader(data, batch_size=2), verbose=False)
    assert abs(t.callback_metrics["test_loss"].item() - want.item()) <= 8 * 2.0**-24 * want.item()
    preds = t.predict(model, DataLoader(data, batch_size=2))
    assert all(isinstance(p, dict) and set(p) == {"avg"} for p in preds), preds
    assert preds[0]["avg"].shape == (2, 1)


def dist_broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def full_copy(model: nn.Module) -> nn.Module:
    """A plain single-process copy of a sharded ``Net`` (every rank gets the same)."""
    ref = Net()
    ref.load_state_dict({k: full(v) for k, v in get_sharded_state_dict(model).items()})
    return ref.eval()


class RecordingIO(TorchCheckpointIO):
    calls: list = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        RecordingIO.calls.append(storage_options)
        super().save_checkpoint(checkpoint, path)


@case
def nemo_save_checkpoint_passes_storage_options():
    """NeMo's test_save_checkpoint: checkpoint_io.save_checkpoint(checkpoint, path, storage_options=...)."""
    model = Net()
    t = trainer(FSDP2Strategy(checkpoint_io=RecordingIO()), max_steps=1)
    t.fit(model, DataLoader(regression_data(), batch_size=2))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(dist_broadcast(tmp)) / "a.ckpt"
        t.save_checkpoint(path)
        t.save_checkpoint(path.with_name("b.ckpt"), storage_options={"bucket": "x"})
        dist.barrier()
        if rank() == 0:
            assert RecordingIO.calls == [None, {"bucket": "x"}], RecordingIO.calls
            assert path.is_file() and path.with_name("b.ckpt").is_file()
        dist.barrier()
    own = trainer(FSDP2Strategy(), max_steps=1)  # zeta's own writer takes no storage_options: a clear error
    own.fit(Net(), DataLoader(regression_data(), batch_size=2))
    expect_error(TypeError, lambda: own.save_checkpoint("never.ckpt", storage_options={"a": 1}), "storage_options")
    assert not Path("never.ckpt").exists()


# ----------------------------------------------------------------------------- NeMo's PEFT calls


class PeftNet(L.LightningModule):
    """A frozen base with a LoRA-style adapter: only ``lora_*`` train (NeMo's PEFT layout)."""

    def __init__(self, adapter_seed: int):
        super().__init__()
        torch.manual_seed(0)
        self.base, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        torch.manual_seed(adapter_seed)
        self.lora_a, self.lora_b = nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)
        for p in [*self.base.parameters(), *self.head.parameters()]:
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.base(x) + self.lora_b(self.lora_a(x))))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)


class LoadAdapter(Callback):
    """What NeMo's PEFT callback does once the strategy is set up: adapter weights now, optimizer deferred."""

    def __init__(self, adapter_state):
        self.adapter_state = adapter_state
        self.seen = {}

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.load_model_state_dict(self.adapter_state, strict=False)
        self.seen["loaded"] = {k: full(v).clone() for k, v in pl_module.state_dict().items() if "lora" in k}
        trainer.strategy.load_optimizer_state_dict(self.adapter_state)
        self.seen["state_before_step"] = len(trainer.optimizers[0].state)  # deferred: nothing applied yet


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class Wrapping(L.LightningModule):
    """NeMo's layout: the network is the LightningModule's ``self.model`` (its names start with ``model.``)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.model = Inner()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class LoadOptimizer(Callback):
    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.load_optimizer_state_dict(self.checkpoint)


@case
def optimizer_state_of_the_inner_model_loads_with_the_model_prefix():
    """Issue 29 §10 (NeMo's adapted test): an optimizer state saved from the LightningModule's inner
    ``model`` (keys ``l1.weight``...) loads into the strategy (keys ``model.l1.weight``...): 2 + 2 steps end
    exactly where 4 uninterrupted steps end."""
    from zeta_fsdp.state_dict import get_optimizer_state_dict

    loader = DataLoader(Subset(regression_data(16), range(rank() * 4, rank() * 4 + 4)), batch_size=2)

    def run(steps, **kwargs):
        return trainer(FSDP2Strategy(), use_distributed_sampler=False, max_steps=steps, **kwargs)

    first = Wrapping(seed=0)
    t = run(2)
    t.fit(first, loader)
    inner_state = get_optimizer_state_dict(first.model, t.optimizers[0], full=True)
    if rank() == 0:
        assert any(k.startswith("state.l1.weight.") for k in inner_state), sorted(inner_state)[:4]
    weights = {k: v for k, v in params(first).items()}
    straight = Wrapping(seed=0)
    run(4).fit(straight, loader)
    resumed = Wrapping(seed=1)
    resumed.load_state_dict(weights)
    run(2, callbacks=[LoadOptimizer({"optimizer_states": [inner_state]})]).fit(resumed, loader)
    got, want = params(resumed), params(straight)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert diff == 0.0, f"resumed training differs from the uninterrupted run by {diff}"


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).clone() for k, v in model.state_dict().items()}


@case
def nemo_peft_adapter_state_loads_inside_a_running_fit():
    """NeMo's PEFT resume: ``load_model_state_dict(adapter_state, strict=False)`` (full on rank 0, or
    each rank's shards) and ``load_optimizer_state_dict(adapter_state)`` inside a running fit, then 2
    steps, end exactly where 4 uninterrupted steps end (the same 2 batches each epoch: each rank reads
    its own quarter of the data in order; Lightning's DistributedSampler would reshuffle per epoch).
    The same optimizer state serves both resumes: loading it must not alias (and step) the caller's tensors."""
    loader = DataLoader(Subset(regression_data(16), range(rank() * 4, rank() * 4 + 4)), batch_size=2)

    def run(strategy, **kwargs):
        return trainer(strategy, use_distributed_sampler=False, **kwargs)

    first = PeftNet(adapter_seed=1)
    t = run(FSDP2Strategy(), max_steps=2)
    t.fit(first, loader)
    sharded = {k: v for k, v in get_sharded_state_dict(first).items() if "lora" in k}
    full_state = {k: v for k, v in t.strategy.lightning_module_state_dict().items() if "lora" in k}
    assert (len(full_state) == 2) == (rank() == 0), sorted(full_state)  # full: rank 0 only
    optimizer_state = t.strategy.optimizer_state(t.optimizers[0])
    saved = {k: full(v).clone() for k, v in sharded.items()}
    straight = PeftNet(adapter_seed=1)
    run(FSDP2Strategy(), max_steps=4).fit(straight, loader)
    want = params(straight)
    for name, adapter in (("full", full_state), ("sharded", sharded)):
        resumed = PeftNet(adapter_seed=2)  # other adapter weights: the load must replace them
        base_before = {k: v for k, v in params(resumed).items() if "lora" not in k}
        callback = LoadAdapter({"state_dict": adapter, "optimizer_states": [optimizer_state]})
        run(FSDP2Strategy(), max_steps=2, callbacks=[callback]).fit(resumed, loader)
        loaded = callback.seen["loaded"]
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), f"{name}: adapter weights not loaded"
        assert callback.seen["state_before_step"] == 0, f"{name}: optimizer state applied before the first step"
        got = params(resumed)
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        assert diff == 0.0, f"{name}: resumed adapter training differs from the uninterrupted run by {diff}"
        assert all(torch.equal(got[k], v) for k, v in base_before.items()), f"{name}: frozen base changed"


# ----------------------------------------------------------------------------- Lightning's ModelParallelStrategy tests


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def tp_feed_forward(model: nn.Module, mesh: DeviceMesh) -> None:
    plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
    parallelize_module(model, mesh["tensor_parallel"], plan)


class TemplateModel(L.LightningModule):
    """Lightning's test model: the user parallelizes in ``configure_model`` (``mode``), or leaves it to zeta."""

    def __init__(self, mode: str = ""):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.mode, self.checked = FeedForward(), mode, {}

    def configure_model(self):
        if "tp" in self.mode:
            tp_feed_forward(self.model, self.device_mesh)
        if "fsdp" in self.mode:
            for layer in (self.model.w1, self.model.w2, self.model.w3):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def on_train_start(self):
        mesh, optimizer = self.device_mesh, self.optimizers()
        self.checked["param_meshes"] = {p.device_mesh for p in self.model.parameters()}
        self.checked["optimizer_meshes"] = {p.device_mesh for p in optimizer.param_groups[0]["params"]}
        self.checked["placements"] = {n: p.placements for n, p in self.model.named_parameters()}
        self.checked["batches"] = len(self.trainer.train_dataloader)
        self.checked["sampler"] = type(self.trainer.train_dataloader.sampler)
        self.checked["mesh"] = mesh

    def training_step(self, batch, batch_idx=0):
        batches = self.all_gather(batch)  # tensor-parallel peers must read the same batch
        tp = self.device_mesh["tensor_parallel"]
        peers = [r for r in range(world()) if r // tp.size() == rank() // tp.size()]
        assert all(torch.equal(batches[peers[0]], batches[r]) for r in peers), "tp peers read different data"
        return self.model(batch).sum()

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


ZETA_TP_PLAN = {"model.w1": "colwise", "model.w2": "colwise", "model.w3": "rowwise"}


@case
def lightning_setup_device_mesh():
    """Lightning's test_setup_device_mesh on 2 ranks: the mesh in configure_model, Lightning's dim names."""

    class Model(TemplateModel):
        def configure_model(self):
            mesh = self.device_mesh
            self.seen = dict(kind=isinstance(mesh, DeviceMesh), device=mesh.device_type == self.device.type)
            self.seen.update(names=mesh.mesh_dim_names, shape=(mesh.size(0), mesh.size(1)), ndim=mesh.ndim)
            super().configure_model()

    for dp, tp in ((world(), 1), (1, world())):
        model = Model("tp" if tp > 1 else "")
        trainer(FSDP2Strategy(data_parallel_size=dp, tensor_parallel_size=tp), max_steps=1).fit(model)
        assert model.seen == {
            "kind": True,
            "device": True,
            "names": ("data_parallel", "tensor_parallel"),
            "shape": (dp, tp),
            "ndim": 2,
        }, model.seen


@case
def lightning_tensor_parallel_params_stay_on_the_tp_mesh():
    """Lightning's test_tensor_parallel: TP applied in configure_model (dp 1 x tp 2) is kept: every
    parameter and optimizer tensor on the TP mesh (no FSDP over a 1-rank dp dimension), no data split."""
    model = TemplateModel("tp")
    trainer(FSDP2Strategy(data_parallel_size=1, tensor_parallel_size=world()), max_steps=2).fit(model)
    tp_mesh = model.checked["mesh"]["tensor_parallel"]
    assert model.checked["param_meshes"] == {tp_mesh}, model.checked["param_meshes"]
    assert model.checked["optimizer_meshes"] == {tp_mesh}
    assert model.checked["placements"]["w1.weight"] == (Shard(0),)
    assert model.checked["batches"] == 8 // 2 and model.checked["sampler"] is DistributedSampler


@case
def zeta_tensor_parallel_plan_on_the_2d_mesh():
    """zeta's own path (tp_plan, no configure_model): TP on the tensor_parallel dim, FSDP on data_parallel."""
    model = TemplateModel()
    strategy = FSDP2Strategy(data_parallel_size=1, tensor_parallel_size=world(), tp_plan=ZETA_TP_PLAN)
    trainer(strategy, max_steps=2).fit(model)
    mesh = model.checked["mesh"]
    assert model.checked["param_meshes"] == {mesh}, model.checked["param_meshes"]
    placements = model.checked["placements"]
    # tp: colwise Shard(0), rowwise Shard(1), the rowwise bias replicated; dp: FSDP's dim-0 shard (strided after TP)
    assert [p.dim for p in placements["w1.weight"]] == [0, 0], placements["w1.weight"]
    assert placements["w3.weight"] == (Shard(0), Shard(1)) and placements["w3.bias"] == (Shard(0), Replicate())


def check_state_dict(strategy: FSDP2Strategy, keys: list[str], distributed: bool) -> None:
    state = strategy.lightning_module_state_dict()
    if not distributed:  # full, on rank 0 only
        assert list(state) == (keys if rank() == 0 else []), list(state)
        return
    assert list(state) == keys, (list(state), keys)
    for key, value in state.items():  # each rank holds its own shards of the full tensor
        assert isinstance(value, DTensor), key
        mine = distribute_tensor(value.full_tensor(), value.device_mesh, value.placements).to_local()
        assert torch.equal(value.to_local(), mine), key
    assert state["model.w1.weight"].to_local().numel() < state["model.w1.weight"].numel()


@case
def lightning_strategy_state_dict_sharded_and_full():
    """Lightning's test_strategy_state_dict: save_distributed_checkpoint=True gives every rank its shards
    (the unwrapped keys, in order), False the full state dict on rank 0; for a module parallelized in
    configure_model (TP + FSDP, dp 1 x tp 2) and for zeta's default sharding (dp 2)."""
    keys = list(TemplateModel().state_dict())
    for distributed in (True, False):
        for mode, sizes in (("tp+fsdp", (1, world())), ("", (world(), 1))):
            strategy = FSDP2Strategy(*sizes, save_distributed_checkpoint=distributed)
            trainer(strategy, max_steps=1).fit(TemplateModel(mode))
            check_state_dict(strategy, keys, distributed)


@case(ranks=4)
def lightning_fsdp2_tensor_parallel_2x2():
    """Lightning's test_fsdp2_tensor_parallel at dp 2 x tp 2: TP + fully_shard done in configure_model are
    kept (2-D parameters); zeta's tp_plan path gives the same layout; data split over dp only."""
    for mode, extra in (("tp+fsdp", {}), ("", {"tp_plan": ZETA_TP_PLAN})):
        model = TemplateModel(mode)
        trainer(FSDP2Strategy(2, 2, **extra), max_steps=1).fit(model)
        mesh = model.checked["mesh"]
        meshes = model.checked["param_meshes"] | model.checked["optimizer_meshes"]
        assert all(m.ndim == 2 and (m.size(0), m.size(1)) == (2, 2) for m in meshes), (mode, meshes)
        assert [p.dim for p in model.checked["placements"]["w1.weight"]] == [0, 0], mode
        assert model.checked["batches"] == 8 // 2 // mesh["data_parallel"].size(), model.checked["batches"]
        assert all(not p.is_meta for p in model.parameters())


if __name__ == "__main__":
    run_cases(CASES)

"""Multi-rank cases for ``zeta_fsdp.strategy.FSDP2Strategy``, run by ``torchrun``.

Same pattern as ``dist_cases.py`` (helpers and main loop from ``worker.py``). The reference is a
``copy.deepcopy`` made before the strategy shards the model, trained on one process over the
global batch with the global token-weighted loss. Regression cases (names start with
``regression_``) each fail on a version with the bug they are named after.
"""

from __future__ import annotations

import copy
import gc
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from training_cases import TPNet, tp_plan
from worker import ARGS, SEQ, Cases, assert_close, assert_close_scaled, expect_error, full, rank, run_cases, world

from zeta_fsdp import fsdp
from zeta_fsdp.loss import MaskedTokenLossReduction
from zeta_fsdp.models.gpt import Block, small
from zeta_fsdp.strategy import EpochStep, FSDP2Strategy

CASES = Cases()
case = CASES.case
PER_RANK = 2


# ---------------------------------------------------------------------------------------------
# data and reference


class MaskedLM(Dataset):
    """Token samples whose loss masks differ wildly: even indices keep ~90% of their tokens,
    odd ones ~10%, so with a ``DistributedSampler`` over 2 ranks, rank 0 holds most tokens."""

    def __init__(self, n: int = 24, vocab: int = 37, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (n, SEQ + 1), generator=g)
        rate = torch.tensor([0.9 if i % 2 == 0 else 0.1 for i in range(n)]).unsqueeze(1)
        keep = torch.rand(n, SEQ, generator=g) < rate
        keep[:, 0] = True
        self.x, self.y, self.mask = tokens[:, :-1], tokens[:, 1:], keep.long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.x[i], "labels": self.y[i], "loss_mask": self.mask[i], "index": i}

    def global_batch(self, step: int, dp: int) -> dict[str, torch.Tensor]:
        """What all dp ranks together see at ``step`` (DistributedSampler, no shuffle, PER_RANK each)."""
        idx = torch.arange(step * PER_RANK * dp, (step + 1) * PER_RANK * dp)
        return {"input_ids": self.x[idx], "labels": self.y[idx], "loss_mask": self.mask[idx]}


def token_mean(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    m = mask.flatten().float()
    return (ce * m).sum() / m.sum()


def rank_batch(data: MaskedLM, step: int, dp: int, r: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s batch at ``step``, in its order: a ``DistributedSampler`` (no shuffle) deals
    sample ``step * PER_RANK * dp + k * dp + r`` to rank ``r`` as its ``k``-th."""
    ids = torch.arange(step * PER_RANK * dp, (step + 1) * PER_RANK * dp).view(PER_RANK, dp)[:, r]
    return {"input_ids": data.x[ids], "labels": data.y[ids], "loss_mask": data.mask[ids]}


def reference_losses(
    ref: nn.Module, data: MaskedLM, steps: int, dp: int, *, opt: torch.optim.Optimizer, max_norm=None, replicas: int = 1
) -> list[float]:
    """The strategy's training on one process: FSDP's gradient bit for bit where it can be.

    Each rank's batch gets its own forward and its token-weighted loss scaled as
    ``MaskedTokenLossReduction`` scales it (``loss_sum * dp / global_count``); the rank
    gradients are averaged along FSDP's reduction tree (``replicas`` x shard groups, every level
    two members at 2 ranks and 2x2: exact). Returns the reduced loss of each step (its sums in
    float64, as ``reduce`` takes them).
    """
    reduction = MaskedTokenLossReduction()
    params = [p for p in ref.parameters() if p.requires_grad]
    losses = []
    for step in range(steps):
        batches = [rank_batch(data, step, dp, r) for r in range(dp)]
        sums, grads = [], []
        global_count = sum(b["loss_mask"].sum().double() for b in batches)
        for b in batches:
            loss_sum, _ = reduction._sum_and_count(b, ref(b["input_ids"]))
            loss = loss_sum * (dp / global_count.clamp(min=1)).to(loss_sum.dtype)
            grads.append(torch.autograd.grad(loss, params, allow_unused=True))
            sums.append(loss_sum.detach().double())
        per_group = dp // replicas
        for i, p in enumerate(params):
            chunk = [g[i] if g[i] is not None else torch.zeros_like(p) for g in grads]
            groups = [_mean(chunk[k * per_group : (k + 1) * per_group]) for k in range(replicas)]
            p.grad = _mean(groups)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(float((_sum(sums) / global_count).float()))
    return losses


def _sum(items: list) -> Any:
    total = items[0]
    for item in items[1:]:
        total = total + item
    return total


def _mean(items: list) -> Any:
    return _sum(items) / len(items)


def adamw(lr: float = 1e-3) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr)


def sgd(lr: float = 0.1) -> Callable[[nn.Module], torch.optim.Optimizer]:
    # momentum: optimizer state to checkpoint, and still linear in the gradients
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)


def train(strategy: FSDP2Strategy, loader, steps: int, *, max_norm=None, skip: int = 0) -> list[float]:
    """``steps`` optimizer steps through the strategy; returns the globally reduced loss of each."""
    losses = []
    for i, batch in enumerate(loader):
        if i < skip:
            continue
        if len(losses) == steps:
            break
        strategy.training_step(batch, i).backward()
        strategy.optimizer_step(max_norm=max_norm)
        losses.append(strategy.reduced_loss("training").item())
    return losses


def assert_params_match(model: nn.Module, ref: nn.Module, atol: float) -> None:
    """Same names, and values within ``atol``; either side may be sharded."""
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), f"names differ: {names} vs {list(ref_params)}"
    for name, param in model.named_parameters():
        assert_close(name, param, full(ref_params[name]), atol)


def assert_losses_match(
    got: list[float], want: list[float], atol: float, *, first_step: int = 0, against: str = "reference"
) -> None:
    """Step by step (as many steps as both have), ``got`` is within ``atol`` of ``want``."""
    for step, (g, w) in enumerate(zip(got, want), start=first_step):
        assert abs(g - w) <= atol, f"step {step}: {g} vs {against} {w}"


# Where the arithmetic differs from any single-process reference (clipping: the norm is summed
# over shards; tensor parallelism: partial products added across ranks), each step's gradient
# differs by a relative error far below 2^-10 (a few roundings, u = 2^-24, per regrouped sum or
# norm). Under SGD errors add up linearly, so the parameters are within 2^-10 of the total
# update (plus one rounding of the parameter). A wrong gradient (a rank missing, no clipping)
# is off by a large fraction of the update. AdamW is not used there: it divides by sqrt(v) and
# turns rounding noise in near-zero gradients into updates of ~lr.
REGROUPED_RELATIVE = 2.0**-10


def assert_trains_like_reference(
    strategy: FSDP2Strategy, ref: nn.Module, steps: int, dp: int, *, max_norm=None, data=None, replicas: int = 1
) -> None:
    """``steps`` steps through the strategy equal the single-process reference (``reference_losses``).

    With AdamW and nothing that regroups the arithmetic, losses and parameters are equal bit for
    bit. With ``max_norm``, or tensor parallelism (``strategy.tensor_parallel_size > 1``), both
    sides use SGD and the bound above.
    """
    data = MaskedLM() if data is None else data
    exact = max_norm is None and strategy.tensor_parallel_size == 1
    factory = adamw() if exact else sgd()
    strategy.setup_optimizers(factory)
    start = {n: full(p).detach().clone() for n, p in ref.named_parameters()}
    want = reference_losses(ref, data, steps, dp, opt=factory(ref), max_norm=max_norm, replicas=replicas)
    got = train(strategy, strategy.process_dataloader(DataLoader(data, batch_size=PER_RANK)), steps, max_norm=max_norm)
    if exact:
        assert_losses_match(got, want, 0.0)
        assert_params_match(strategy.model, ref, atol=0.0)
        return
    # losses: the first is exact up to its float32 rounding; later ones follow parameters within the bound
    assert_losses_match(got, want, REGROUPED_RELATIVE * max(abs(w) for w in want))
    ref_params = dict(ref.named_parameters())
    for name, param in strategy.model.named_parameters():
        want_p = ref_params[name].detach()
        update = (want_p - start[name]).abs().max().item()
        bound = REGROUPED_RELATIVE * update + 2.0**-24 * want_p.abs().max().item()
        assert_close(name, param, want_p, bound)


def optimizer_state(strategy: FSDP2Strategy) -> dict[str, torch.Tensor]:
    """Full (gathered) optimizer state tensors keyed ``<fqn>.<name>``, on every rank."""
    names = {id(p): n for n, p in strategy.model.named_parameters()}
    out = {}
    for opt in strategy.optimizers:
        for param, state in opt.state.items():
            for key, value in state.items():
                out[f"{names[id(param)]}.{key}"] = full(value).detach().clone()
    return out


def shared_tmp() -> Path:
    """A new directory for all ranks (rank 0 makes it, everyone gets its name), under the launch's
    pytest temporary folder so checkpoints never pile up in /tmp."""
    base = Path(ARGS.out).parent / "ckpt"
    if rank() == 0:
        base.mkdir(parents=True, exist_ok=True)
    box = [tempfile.mkdtemp(prefix="case_", dir=base) if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def gpt_strategy(seed: int = 0, **kwargs) -> tuple[FSDP2Strategy, nn.Module]:
    torch.manual_seed(seed)
    model = small()
    ref = copy.deepcopy(model)
    strategy = FSDP2Strategy(TransformerBlock=Block, **kwargs)
    strategy.connect(model)
    strategy.setup_optimizers(adamw())
    return strategy, ref


# ---------------------------------------------------------------------------------------------
# environment, parallelize


@case(ranks=(2, 4))
def setup_environment_mesh_and_sizes():
    strategy = FSDP2Strategy()
    strategy.setup_environment()
    mesh = strategy.device_mesh
    assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == (world(), 1), mesh
    assert strategy.data_parallel_size == world() and strategy.tensor_parallel_size == 1
    assert strategy.data_parallel_rank == rank() and strategy.root_device == torch.device("cpu")
    strategy.setup_environment()  # idempotent
    assert strategy.device_mesh is mesh
    tp = FSDP2Strategy(tensor_parallel_size=world())
    tp.setup_environment()
    assert tuple(tp.device_mesh.shape) == (1, world())
    # sizes are checked against the world at setup_environment() (issue 12 §2.1), on every rank alike
    bad = FSDP2Strategy(tensor_parallel_size=3)
    expect_error(ValueError, bad.setup_environment, "3", f"world size {world()}")
    bad = FSDP2Strategy(data_parallel_size=1)
    expect_error(ValueError, bad.setup_environment, "data_parallel_size=1", f"{world()}")
    bad = FSDP2Strategy(data_parallel_size=world(), tensor_parallel_size=2)
    expect_error(ValueError, bad.setup_environment, "x")


@case
def regression_parallelize_fn_none_still_shards():
    """NeMo's strategy with ``parallelize_fn=None`` trained an unsharded model without a word;
    and ``fsdp()``'s own default (NO_SHARD) would replicate. The strategy default must shard."""
    torch.manual_seed(0)
    model = small()
    strategy = FSDP2Strategy(parallelize_fn=None)
    strategy.connect(model)
    strategy.parallelize()
    assert isinstance(model, FSDPModule)
    assert all(isinstance(b, FSDPModule) for b in model.blocks), "blocks are not their own FSDP units"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not sharded"
        assert param.placements == (Shard(0),), f"{name}: {param.placements} (not FULL_SHARD)"
        assert param.device_mesh.mesh_dim_names == ("dp",), param.device_mesh
    qkv = model.blocks[0].attn.qkv.weight
    assert qkv.to_local().numel() == qkv.numel() // world(), "each rank holds the whole parameter"
    # a second call is a no-op: same parameter objects, no second wrapping
    params = [id(p) for p in model.parameters()]
    strategy.parallelize()
    assert [id(p) for p in model.parameters()] == params
    # a parallelize_fn that forgets to shard is an error, not a silently unsharded model
    bad = FSDP2Strategy(parallelize_fn=lambda module, **kw: module)
    bad.connect(small())
    expect_error(RuntimeError, bad.parallelize, "not sharded")
    # a custom parallelize_fn gets the mesh and the policy, and is used instead of the default
    seen = {}

    def custom(module, device_mesh, mp_policy, **kwargs):
        seen.update(mesh=device_mesh, policy=mp_policy, kwargs=kwargs)
        return fsdp(module, shard_strat="SHARD_GRAD", mesh=device_mesh["dp"], mp=mp_policy)

    mine = FSDP2Strategy(parallelize_fn=custom, mp_policy="bf16", TransformerBlock=Block)
    mine.connect(small())
    mine.parallelize()
    assert seen["mesh"] is mine.device_mesh and seen["policy"].param_dtype == torch.bfloat16
    assert seen["kwargs"] == {"TransformerBlock": Block}, seen["kwargs"]


@case
def tensor_init_context_meta_then_materialized():
    strategy = FSDP2Strategy(TransformerBlock=Block)
    with strategy.tensor_init_context(empty_init=True):
        model = small()
    assert all(p.is_meta for p in model.parameters())
    strategy.connect(model)
    strategy.parallelize()
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors), "a tensor stayed on meta"
    assert model.head.weight is model.tok_emb.weight, "tie lost"
    std = full(model.blocks[0].attn.qkv.weight).std().item()
    assert 0.015 < std < 0.025, f"init_weights() did not run (std {std})"
    w = full(model.tok_emb.weight)
    gathered = [torch.empty_like(w) for _ in range(world())]
    dist.all_gather(gathered, w)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks initialised differently"
    with strategy.tensor_init_context(empty_init=False):
        assert not nn.Linear(2, 2).weight.is_meta


@case
def regression_parallelize_fn_meta_model_keeps_ties():
    """A custom parallelize_fn that shards the blocks only and leaves a meta model for the strategy
    to materialize: the tied embedding/head (plain parameters, outside any FSDP unit) must still be
    one parameter. materialize_meta_model was given no ties, and to_empty() split them."""

    def blocks_only(module, device_mesh, mp_policy, **kwargs):
        for block in module.blocks:
            fully_shard(block, mesh=device_mesh["dp"], mp_policy=mp_policy)
        return module

    strategy = FSDP2Strategy(parallelize_fn=blocks_only)
    with strategy.tensor_init_context(empty_init=True):
        model = small()
    assert model.head.weight is model.tok_emb.weight
    strategy.connect(model)
    strategy.parallelize()
    assert not any(p.is_meta for p in model.parameters()), "a parameter stayed on meta"
    assert model.head.weight is model.tok_emb.weight, "tie lost: head and embedding are two parameters"
    assert isinstance(model.blocks[0].attn.qkv.weight, DTensor) and not isinstance(model.head.weight, DTensor)


# ---------------------------------------------------------------------------------------------
# steps and loss


@case
def regression_token_weighted_training_parity():
    """Plain nn.Module through the strategy, ranks with very different token counts: the reduced
    loss and the trained parameters equal the single-process token-weighted reference. NeMo's
    mean of per-rank means gives other gradients and fails this."""
    strategy, ref = gpt_strategy()
    data = MaskedLM()
    counts = [int(data.mask[i].sum()) for i in range(4)]
    assert counts[0] + counts[2] > 3 * (counts[1] + counts[3]), counts
    assert_trains_like_reference(strategy, ref, 3, world(), max_norm=0.5, data=data)
    assert strategy.current_epoch_step == EpochStep(0, 3)


@case
def process_dataloader_sampler_and_epochs():
    strategy = FSDP2Strategy()
    data = MaskedLM(n=8)
    loader = strategy.process_dataloader(DataLoader(data, batch_size=2))
    assert isinstance(loader.sampler, DistributedSampler) and loader.batch_size == 2
    mine = [int(i) for b in loader for i in b["index"]]
    assert mine == list(range(rank(), 8, world())), mine
    shuffled = strategy.process_dataloader(DataLoader(data, batch_size=2, shuffle=True))
    epoch0 = [int(i) for b in shuffled for i in b["index"]]
    strategy.set_epoch(1)
    epoch1 = [int(i) for b in shuffled for i in b["index"]]
    assert strategy.current_epoch_step.epoch == 1
    everyone = [None] * world()
    dist.all_gather_object(everyone, epoch0)
    assert sorted(i for part in everyone for i in part) == list(range(8)), "ranks overlap or miss samples"
    both = [None] * world()
    dist.all_gather_object(both, epoch1)
    assert sum(both, []) != sum(everyone, []), "set_epoch did not reshuffle"

    class Transforming:
        def __init__(self):
            self.calls = 0

        def transform_dataloader(self, dl):
            self.calls += 1
            return dl

    sampler = Transforming()
    plain = DataLoader(data, batch_size=2)
    assert FSDP2Strategy(data_sampler=sampler).process_dataloader(plain) is plain and sampler.calls == 1

    class Evens(Sampler):
        def __iter__(self):
            return iter(range(0, 8, 2))

        def __len__(self):
            return 4

    custom = FSDP2Strategy(data_sampler=Evens()).process_dataloader(plain)
    assert [int(i) for b in custom for i in b["index"]] == [0, 2, 4, 6]


class LitModule(nn.Module):
    """A LightningModule-shaped module (no Lightning import): the strategy must call its hooks."""

    def __init__(self):
        super().__init__()
        self.net = small()
        self.calls: list[str] = []

    def forward(self, input_ids):
        return self.net(input_ids)

    def training_step(self, batch, batch_idx):
        self.calls.append(f"train:{batch_idx}:{self.training}:{torch.is_grad_enabled()}")
        # self.net(...), not self(...): the strategy must still run it through the FSDP root
        return token_mean(self.net(batch["input_ids"]), batch["labels"], batch["loss_mask"])

    def validation_step(self, batch, batch_idx):
        self.calls.append(f"val:{batch_idx}:{self.training}:{torch.is_grad_enabled()}")
        return torch.tensor(1.5)

    def test_step(self, batch, batch_idx):
        self.calls.append(f"test:{batch_idx}")
        return torch.tensor(2.5)

    def predict_step(self, batch, batch_idx):
        self.calls.append(f"predict:{batch_idx}")
        return self(batch["input_ids"]).argmax(-1)

    def configure_optimizers(self):
        self.calls.append(f"configure:{isinstance(next(self.parameters()), DTensor)}")
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}}


@case
def lightning_style_module_hooks():
    torch.manual_seed(0)
    module = LitModule()
    ref = copy.deepcopy(module)
    strategy = FSDP2Strategy(TransformerBlock=Block)
    strategy.connect(module)
    strategy.parallelize()
    assert module.calls == ["configure:True"], module.calls  # optimizers made after sharding
    assert len(strategy.optimizers) == 1 and len(strategy.lr_schedulers) == 1
    loader = strategy.process_dataloader(DataLoader(MaskedLM(), batch_size=PER_RANK))
    batch = next(iter(loader))
    loss = strategy.training_step(batch, 7)
    loss.backward()
    strategy.optimizer_step()
    assert strategy.optimizers[0].param_groups[0]["lr"] == 0.05, "scheduler not stepped"
    # the module's own loss is a per-rank mean (its choice): the reference averages rank means
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    halves = [
        {k: v[r :: world()][:PER_RANK] for k, v in MaskedLM().global_batch(0, world()).items()} for r in range(world())
    ]
    params = list(ref.parameters())
    per_rank = [torch.autograd.grad(ref.training_step(h, 0), params) for h in halves]
    for i, p in enumerate(params):  # each rank's gradient, then their mean: FSDP's arithmetic, exact
        p.grad = _mean([g[i] for g in per_rank])
    ref_opt.step()
    assert_params_match(module, ref, atol=0.0)
    assert strategy.validation_step(batch, 1).item() == 1.5
    assert strategy.test_step(batch, 2).item() == 2.5
    pred = strategy.predict_step(batch, 3)
    assert pred.shape == batch["input_ids"].shape
    assert module.calls[1:] == ["train:7:True:True", "val:1:False:False", "test:2", "predict:3"], module.calls
    assert module.training, "evaluation left the module in eval mode"


@case
def plain_module_eval_steps_and_loss_reduction():
    strategy, ref = gpt_strategy()
    data = MaskedLM(seed=3)
    loader = strategy.process_dataloader(DataLoader(data, batch_size=PER_RANK))
    local_means = []
    for i, batch in enumerate(loader):
        if i == 2:
            break
        local_means.append(strategy.validation_step(batch, i))
        assert not local_means[-1].requires_grad
        mine = {k: batch[k] for k in ("input_ids", "labels", "loss_mask")}
        assert_close(
            "local mean", local_means[-1], token_mean(ref(mine["input_ids"]), mine["labels"], mine["loss_mask"]), 0.0
        )
    both = {
        k: torch.cat([data.global_batch(s, world())[k] for s in (0, 1)]) for k in ("input_ids", "labels", "loss_mask")
    }
    with torch.no_grad():
        want = token_mean(ref(both["input_ids"]), both["labels"], both["loss_mask"]).item()
    got = strategy.reduced_loss("validation").item()
    # The reference runs the whole batch at once (other matmul blocking: a few roundings per logit)
    # and sums its tokens in another grouping: within 4 roundings per token of the mean.
    tokens = both["labels"].numel()
    assert abs(got - want) <= 4 * tokens * 2.0**-24 * abs(want), f"validation mean {got} vs {want}"
    assert strategy.reduced_loss("validation").item() == 0.0, "records not cleared"
    batch = data.global_batch(0, world())
    strategy.test_step(batch)
    with torch.no_grad():
        want = token_mean(ref(batch["input_ids"]), batch["labels"], batch["loss_mask"]).item()
    # the same forward; the mean's division in float64 then rounded, against one float32 division
    assert abs(strategy.reduced_loss("test").item() - want) <= 2.0**-23 * abs(want)
    logits = strategy.predict_step({"input_ids": batch["input_ids"]})
    assert_close("predict", logits, ref(batch["input_ids"]), 0.0)  # the same forward
    # the reductions
    train_red = strategy._get_loss_reduction("training")
    assert isinstance(train_red, MaskedTokenLossReduction) and not train_red.validation_step
    for kind in ("validation", "test", "predict"):
        red = strategy._get_loss_reduction(kind)
        assert isinstance(red, MaskedTokenLossReduction) and red.validation_step, kind
    expect_error(ValueError, lambda: strategy._get_loss_reduction("train"), "train")
    own = MaskedTokenLossReduction()
    strategy.model.validation_loss_reduction = own
    assert strategy._get_loss_reduction("validation") is own
    # a model that returns a pre-averaged loss cannot be re-weighted: a clear error
    strategy.model.forward = lambda input_ids: {"loss": torch.tensor(1.0)}
    expect_error(ValueError, lambda: strategy.training_step(batch), "logits")


# ---------------------------------------------------------------------------------------------
# checkpoints


def _save_then_continue(tmp: Path, name: str, **kwargs) -> tuple[Path, dict, list[float], nn.Module, MaskedLM]:
    """Train 2 steps, save, record the optimizer state, train 2 more: the uninterrupted run."""
    strategy, _ = gpt_strategy(**kwargs)
    data = MaskedLM()
    loader = strategy.process_dataloader(DataLoader(data, batch_size=PER_RANK))
    train(strategy, loader, 2)
    path = tmp / name
    strategy.save_checkpoint({"note": "hello", "rng": torch.tensor([1, 2, 3])}, path)
    saved_state = optimizer_state(strategy)
    later = train(strategy, loader, 2, skip=2)
    return path, saved_state, later, strategy.model, data


def _resume_and_check(path: Path, saved_state: dict, later: list[float], trained: nn.Module, data: MaskedLM, **kwargs):
    strategy, _ = gpt_strategy(seed=1, **kwargs)  # other initial weights: loading must replace them
    ckpt = strategy.load_checkpoint(path)
    assert ckpt["note"] == "hello" and torch.equal(ckpt["rng"], torch.tensor([1, 2, 3]))
    assert strategy.current_epoch_step == EpochStep(0, 2), strategy.current_epoch_step
    # deferred: nothing in the optimizer yet, the state waits for the first training step
    assert all(not opt.state for opt in strategy.optimizers)
    assert strategy._optimizer_state_to_restore is not None
    probe = None
    if rank() == 0:
        entry = ckpt["optimizer_states"][0]
        tensors = (
            [v for k, v in entry.items() if isinstance(v, torch.Tensor) and k.endswith("exp_avg")]
            if isinstance(entry, dict)
            else []
        )
        probe = weakref.ref(tensors[0]) if tensors else None
        del entry, tensors
    del ckpt
    loader = strategy.process_dataloader(DataLoader(data, batch_size=PER_RANK))
    batches = [b for i, b in enumerate(loader) if i >= 2]
    loss = strategy.training_step(batches[0], 2)
    restored = optimizer_state(strategy)
    assert set(restored) == set(saved_state), f"{sorted(set(restored) ^ set(saved_state))[:5]}"
    for key, value in saved_state.items():
        assert_close(f"optimizer state {key}", restored[key], value, 0.0)
    assert strategy._optimizer_state_to_restore is None, "the checkpoint's optimizer state is still referenced"
    gc.collect()
    if probe is not None:
        assert probe() is None, "the strategy keeps the checkpoint's optimizer tensors alive"
    loss.backward()
    strategy.optimizer_step()
    got = [strategy.reduced_loss().item()]
    got += train(strategy, iter(batches[1:]), 1)  # a re-applied restore here would change step 4
    assert_losses_match(got, later, 0.0, first_step=3, against="uninterrupted")
    assert_params_match(strategy.model, trained, atol=0.0)
    return strategy


@case
def regression_deferred_optimizer_restore_full_format():
    """NeMo stored the optimizer state and never applied it (or kept it forever): here it is
    applied at the first training step, equals the saved state, and the reference is dropped."""
    tmp = shared_tmp()
    path, saved_state, later, trained, data = _save_then_continue(tmp, "full.ckpt")
    assert path.is_file()
    _resume_and_check(path, saved_state, later, trained, data)


@case
def regression_every_rank_optimizer_shard_saved():
    """A rank-0-only optimizer state (Lightning's default for sharded optimizers) would hold half
    of every tensor: the file must hold every rank's part, gathered, keyed by FQN."""
    tmp = shared_tmp()
    strategy, ref = gpt_strategy()
    data = MaskedLM()
    loader = strategy.process_dataloader(DataLoader(data, batch_size=PER_RANK))
    train(strategy, loader, 2)
    path = tmp / "every_rank.ckpt"
    strategy.save_checkpoint({}, path)
    live = optimizer_state(strategy)
    saved = torch.load(path, weights_only=True)  # any rank, any world size: a plain file
    states = saved["optimizer_states"]
    assert len(states) == 1
    flat = states[0]
    exp_avg = {k[len("state.") :]: v for k, v in flat.items() if k.startswith("state.")}
    assert set(exp_avg) == set(live), f"{sorted(set(exp_avg) ^ set(live))[:6]}"
    for key, value in live.items():
        assert exp_avg[key].shape == value.shape, f"{key}: saved {tuple(exp_avg[key].shape)} vs {tuple(value.shape)}"
        assert_close(f"saved {key}", exp_avg[key], value, 0.0)
    # the model part: full tensors, the unwrapped model's keys, loadable into a plain copy
    assert set(saved["state_dict"]) == set(ref.state_dict()), "keys differ from the unwrapped model's"
    ref.load_state_dict(saved["state_dict"])
    assert_params_match(strategy.model, ref, atol=0.0)
    assert saved["global_step"] == 2 and saved["epoch"] == 0
    assert saved["zeta_fsdp"]["format"] == "full"


@case
def checkpoint_sharded_format_roundtrip():
    tmp = shared_tmp()
    path, saved_state, later, trained, data = _save_then_continue(tmp, "sharded", checkpoint_format="sharded")
    assert path.is_dir() and (path / ".metadata").is_file()
    assert len(list(path.glob("*.distcp"))) == world(), "every rank writes its own shards"
    _resume_and_check(path, saved_state, later, trained, data, checkpoint_format="sharded")


@case
def regression_sharded_optimizer_restore_keeps_later_weights():
    """Sharded format: the deferred optimizer restore (at the first training step) must restore the
    optimizer only. It used to re-read the checkpoint's weights over a load_model_state_dict
    made in between."""
    tmp = shared_tmp()
    path, saved_state, _, _, data = _save_then_continue(tmp, "sharded_then_weights", checkpoint_format="sharded")
    strategy, _ = gpt_strategy(seed=1, checkpoint_format="sharded")
    strategy.load_checkpoint(path)
    assert strategy._optimizer_state_to_restore is not None
    torch.manual_seed(7)
    other = small()
    strategy.load_model_state_dict({"state_dict": other.state_dict()})  # after load_checkpoint
    batch = next(iter(strategy.process_dataloader(DataLoader(data, batch_size=PER_RANK))))
    strategy.training_step(batch, 0)  # applies the deferred optimizer state; no optimizer step
    assert strategy._optimizer_state_to_restore is None
    assert_params_match(strategy.model, other, atol=0.0)
    restored = optimizer_state(strategy)
    assert set(restored) == set(saved_state)
    for key, value in saved_state.items():
        assert_close(f"optimizer state {key}", restored[key], value, 0.0)


@case
def regression_full_save_failure_leaves_no_temp_file():
    """A full-format write that fails midway (disk full, an object torch.save cannot write) raises
    on every rank, removes its temporary file and leaves the checkpoint already at the path alone."""
    tmp = shared_tmp()
    strategy, _ = gpt_strategy()
    path = tmp / "kept.ckpt"
    strategy.save_checkpoint({"version": 1}, path)
    before = path.read_bytes()
    temp = tmp / f".{path.name}.incomplete"
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, Path)):  # the checkpoint file, not the in-memory validation buffer
            Path(f).write_bytes(b"half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    torch.save = failing_save
    try:
        expect_error(Exception, lambda: strategy.save_checkpoint({"version": 2}, path), "No space left")
    finally:
        torch.save = real_save
    dist.barrier()
    assert not temp.exists(), f"{temp.name} left behind"
    assert path.read_bytes() == before, "the earlier checkpoint was changed"
    assert sorted(p.name for p in tmp.iterdir()) == [path.name]
    assert torch.load(path, weights_only=True)["version"] == 1


@case
def checkpoint_loads_into_other_sharding_and_model_state_dict():
    tmp = shared_tmp()
    path, _, _, _, _ = _save_then_continue(tmp, "for_no_shard.ckpt")
    saved = torch.load(path, weights_only=True)
    strategy, ref = gpt_strategy(seed=2, shard_strat="NO_SHARD")
    strategy.load_checkpoint(path)
    ref.load_state_dict(saved["state_dict"])
    assert_params_match(strategy.model, ref, atol=0.0)
    # load_model_state_dict: immediate; a full state dict is sharded into the live model
    torch.manual_seed(5)
    other = small()
    strategy.load_model_state_dict({"state_dict": other.state_dict()})
    assert_params_match(strategy.model, other, atol=0.0)
    before = {n: full(p).clone() for n, p in strategy.model.named_parameters()}
    bad = {k: v for k, v in other.state_dict().items() if not k.startswith("blocks.0.")}
    expect_error(ValueError, lambda: strategy.load_model_state_dict(bad), "blocks.0")
    for name, param in strategy.model.named_parameters():
        assert torch.equal(full(param), before[name]), f"{name} changed by a failed load"
    strategy.load_model_state_dict(bad, strict=False)
    # lightning_module_state_dict: the full state dict on rank 0, {} elsewhere
    state = strategy.lightning_module_state_dict()
    if rank() == 0:
        assert set(state) == set(other.state_dict())
        for key, value in other.state_dict().items():
            assert torch.equal(state[key], value), key
    else:
        assert state == {}


class MemoryIO:
    """A ``checkpoint_io`` that keeps checkpoints in memory and records its calls."""

    def __init__(self):
        self.store: dict[str, Any] = {}
        self.calls: list[str] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append("save")
        self.store[str(path)] = copy.deepcopy(checkpoint)

    def load_checkpoint(self, path, map_location=None):
        self.calls.append("load")
        return self.store[str(path)]

    def remove_checkpoint(self, path):
        self.calls.append("remove")
        del self.store[str(path)]


@case
def checkpoint_io_and_remove_checkpoint():
    io = MemoryIO()
    strategy, _ = gpt_strategy(checkpoint_io=io)
    data = MaskedLM()
    train(strategy, strategy.process_dataloader(DataLoader(data, batch_size=PER_RANK)), 1)
    strategy.save_checkpoint({"k": 1}, "mem://a")
    expected = ["save"] if rank() == 0 else []
    assert io.calls == expected, io.calls
    if rank() == 0:
        assert set(io.store["mem://a"]["state_dict"]) == set(small().state_dict())
    fresh, _ = gpt_strategy(seed=3, checkpoint_io=io)
    ckpt = fresh.load_checkpoint("mem://a")
    assert ckpt["k"] == 1
    assert_params_match(fresh.model, strategy.model, atol=0.0)
    strategy.remove_checkpoint("mem://a")
    assert io.calls == (["save", "load", "remove"] if rank() == 0 else []), io.calls
    # the built-in writer: rank 0 removes a file or a sharded directory, after a barrier
    tmp = shared_tmp()
    plain, _ = gpt_strategy()
    plain.save_checkpoint({}, tmp / "x.ckpt")
    assert (tmp / "x.ckpt").is_file()
    plain.remove_checkpoint(tmp / "x.ckpt")
    dist.barrier()
    assert not (tmp / "x.ckpt").exists()
    sharded, _ = gpt_strategy(checkpoint_format="sharded")
    sharded.save_checkpoint({}, tmp / "dir")
    sharded.remove_checkpoint(tmp / "dir")
    dist.barrier()
    assert not (tmp / "dir").exists()
    expect_error(FileNotFoundError, lambda: plain.load_checkpoint(tmp / "missing.ckpt"), "missing.ckpt")
    expect_error(TypeError, lambda: plain.save_checkpoint({"bad": object()}, tmp / "y.ckpt"), "weights_only")
    assert not (tmp / "y.ckpt").exists()


# ---------------------------------------------------------------------------------------------
# issue 29 §1: Hugging Face's label convention (labels = input_ids, the model shifts them)


def tiny_gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg).float()


def hf_global_batch() -> dict[str, torch.Tensor]:
    """4 rows; rank 0's two rows are mostly -100, rank 1's nearly full: unequal token counts."""
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, 3:] = -100
    labels[1, 2:] = -100
    labels[3, 7:] = -100
    return {"input_ids": ids, "labels": labels}


def rows(batch: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    return {k: v[2 * r : 2 * r + 2] for k, v in batch.items()}


@case
def hf_batch_convention_uses_the_models_own_shifted_loss():
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    strategy = FSDP2Strategy()
    strategy.connect(model)
    strategy.setup_optimizers(lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    batch = hf_global_batch()
    want = ref(**batch).loss  # transformers' next-token loss over the global batch, token-averaged
    want.backward()
    loss = strategy.training_step(rows(batch, rank()), 0)
    loss.backward()
    # The global mean (l0 c0 + l1 c1) / (c0 + c1) against one mean over the same 2 x 2 rows: a few dozen
    # roundings of terms no larger than the loss (a row's matmul may block differently at 2 and 4 rows).
    assert_close_scaled("reduced loss", strategy.reduced_loss(), want, 256)
    for (name, p), (_, q) in zip(strategy.model.named_parameters(), ref.named_parameters()):
        assert_close_scaled(f"grad {name}", full(p.grad), q.grad, 256)
    strategy.optimizer_step()
    assert abs(strategy.reduced_loss().item()) == 0.0  # nothing since the last call
    # Pre-shifted labels with loss_mask (NeMo's batch) keep working with the same model: the loss is the
    # strategy's, from the logits, whatever the model computes itself.
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(rank()))
    nemo = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 8)}
    with torch.no_grad():
        strategy.validation_step(nemo, 0)
        logits = strategy.predict_step({"input_ids": nemo["input_ids"]}).logits
    expected = F.cross_entropy(logits.flatten(0, 1), nemo["labels"].flatten())
    everyone = torch.stack([expected.detach()])
    dist.all_reduce(everyone)
    assert_close_scaled("NeMo-style validation", strategy.reduced_loss("validation"), everyone[0] / world(), 64)


@case
def hf_batch_convention_refused_where_it_would_train_the_wrong_objective():
    strategy, _ = gpt_strategy()  # the demo GPT computes no loss of its own
    batch = hf_global_batch()
    batch["input_ids"] %= 37
    batch["labels"] = torch.where(batch["labels"] == -100, batch["labels"], batch["input_ids"])
    error = raised_everywhere(strategy.training_step, rows(batch, rank()), 0)
    assert isinstance(error, ValueError) and "Hugging Face's" in str(error) and "pre-shifted" in str(error), error
    hf = FSDP2Strategy()
    hf.connect(tiny_gpt2())
    hf.setup_optimizers(lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    before = full_params(hf.model)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(rank()))
    shifted = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}  # the model would shift them again
    error = raised_everywhere(hf.training_step, shifted, 0)
    assert isinstance(error, ValueError) and "already shifted" in str(error) and "loss_mask" in str(error), error
    for name, value in full_params(hf.model).items():
        assert torch.equal(value, before[name]), name


# ---------------------------------------------------------------------------------------------
# issue 12 §2: the seed API without surprises (each case fails with its bug put back)


def raised_everywhere(fn: Callable[..., Any], *args: Any) -> BaseException:
    """``fn(*args)`` raises on every rank, the SAME exception type everywhere; returns this rank's."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - compared across ranks below
        error = e
    else:
        error = None
    kinds: list = [None] * world()
    dist.all_gather_object(kinds, None if error is None else type(error).__name__)
    assert None not in kinds, f"not raised on every rank: {kinds}"
    assert len(set(kinds)) == 1, f"ranks raised different exception types: {kinds}"
    return error


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


@case
def regression_user_opt_step_counts_and_is_saved():
    """§2.2: a loop that calls ``opt.step()`` itself (the seeds show no ``optimizer_step``) used to
    leave ``current_epoch_step`` at 0 and save ``global_step 0``."""
    tmp = shared_tmp()
    strategy, _ = gpt_strategy()
    opt = strategy.optimizers[0]
    loader = strategy.process_dataloader(DataLoader(MaskedLM(), batch_size=PER_RANK))
    for i, batch in enumerate(loader):
        if i == 3:
            break
        strategy.training_step(batch, i).backward()
        opt.step()  # not strategy.optimizer_step()
        opt.zero_grad()
    assert strategy.current_epoch_step == 3, strategy.current_epoch_step
    path = tmp / "user_steps.ckpt"
    strategy.save_checkpoint({}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 3
    resumed, _ = gpt_strategy(seed=1)
    resumed.load_checkpoint(path)
    resumed.training_step(batch, 3)  # applies the saved optimizer state: restoring is not a step
    assert resumed.current_epoch_step == 3, resumed.current_epoch_step


class ZeroHead(nn.Module):
    """Custom initialisation in ``__init__`` (as pretrained/special inits do): ``reset_parameters``
    would overwrite it with random values."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        nn.init.zeros_(self.head.weight)
        nn.init.constant_(self.head.bias, 0.25)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@case
def regression_tensor_init_context_keeps_init_in_init():
    """§2.4: a module built under ``tensor_init_context()`` (NeMo's context does nothing) keeps the
    values its ``__init__`` set; it used to go to meta and be refilled by ``reset_parameters()``."""
    strategy = FSDP2Strategy(TransformerBlock=nn.Linear)
    torch.manual_seed(0)
    with strategy.tensor_init_context():
        model = ZeroHead()
    ref = copy.deepcopy(model)
    strategy.connect(model)
    strategy.parallelize()
    params = full_params(model)
    assert torch.equal(params["head.weight"], torch.zeros(4, 8)), "nn.init.zeros_ in __init__ was replaced"
    assert torch.equal(params["head.bias"], torch.full((4,), 0.25))
    assert_params_match(model, ref, atol=0.0)


@case
def regression_remove_checkpoint_refuses_user_data():
    """§2.5: ``remove_checkpoint`` deleted any directory it was given, e.g. a data folder."""
    tmp = shared_tmp()
    data_dir, notes = tmp / "my_data", tmp / "notes.txt"
    if rank() == 0:
        data_dir.mkdir()
        (data_dir / "train.bin").write_bytes(b"precious")
        notes.write_text("not a checkpoint")
    dist.barrier()
    strategy, _ = gpt_strategy()
    for target in (data_dir, notes):
        error = raised_everywhere(strategy.remove_checkpoint, target)
        assert isinstance(error, ValueError) and str(target) in str(error) and "refusing" in str(error), error
    dist.barrier()
    assert (data_dir / "train.bin").read_bytes() == b"precious", "the data folder was touched"
    assert notes.read_text() == "not a checkpoint"
    strategy.remove_checkpoint(tmp / "never_written.ckpt")  # nothing there: nothing to do


@case
def regression_bad_file_same_error_type_every_rank():
    """§2.6 and §2.8: the same bad file raised ``RuntimeError``/``UnpicklingError`` on rank 0 and
    ``CheckpointError`` elsewhere, with torch's messages that do not name the path."""
    from zeta_fsdp import CheckpointError

    tmp = shared_tmp()
    strategy, _ = gpt_strategy()
    good = tmp / "good.ckpt"
    strategy.save_checkpoint({}, good)
    garbage, truncated, pickled, folder = (tmp / n for n in ("garbage.ckpt", "truncated.ckpt", "pickled.ckpt", "dir"))
    if rank() == 0:
        garbage.write_bytes(b"this is not a zip archive" * 10)
        truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        torch.save({"state_dict": {}, "obj": EpochStep(1, 2)}, pickled)  # a class weights_only refuses
        folder.mkdir()
    dist.barrier()
    before = full_params(strategy.model)
    for path, needle in ((garbage, "not a readable"), (truncated, "not a readable"), (pickled, "weights_only")):
        error = raised_everywhere(strategy.load_checkpoint, path)
        assert isinstance(error, CheckpointError), f"{path.name}: {type(error).__name__}: {error}"
        assert str(path) in str(error) and needle in str(error), error
    error = raised_everywhere(lambda: strategy.load_checkpoint(folder))
    assert isinstance(error, CheckpointError) and str(folder) in str(error), error
    error = raised_everywhere(lambda: strategy.load_checkpoint(tmp / "missing.ckpt"))
    assert isinstance(error, FileNotFoundError) and "missing.ckpt" in str(error), error
    for name, value in full_params(strategy.model).items():
        assert torch.equal(value, before[name]), f"{name} changed by a failed load"
    assert strategy.current_epoch_step == 0


@case
def regression_error_messages_name_the_path():
    """§2.8: ``/proc/x.ckpt`` gave ``[enforce fail at inline_container.cc] . open file failed``, an
    empty path ``Device or resource busy: '..incomplete' -> '.'``, and a sharded save onto a
    full-format checkpoint said it "exists and is not a checkpoint"."""
    tmp = shared_tmp()
    strategy, _ = gpt_strategy()
    error = raised_everywhere(lambda: strategy.save_checkpoint({}, "/proc/x.ckpt"))
    assert "/proc/x.ckpt" in str(error) and "cannot write" in str(error), error
    for empty in ("", "  "):
        error = raised_everywhere(strategy.save_checkpoint, {}, empty)
        assert isinstance(error, ValueError) and "is empty" in str(error), error
        error = raised_everywhere(strategy.load_checkpoint, empty)
        assert isinstance(error, ValueError) and "is empty" in str(error), error
    full_ckpt = tmp / "full.ckpt"
    strategy.save_checkpoint({}, full_ckpt)
    kept = full_ckpt.read_bytes()
    sharded, _ = gpt_strategy(checkpoint_format="sharded")
    error = raised_everywhere(lambda: sharded.save_checkpoint({}, full_ckpt))
    assert "is a full-format checkpoint" in str(error) and str(full_ckpt) in str(error), error
    assert "not a checkpoint" not in str(error), error
    assert full_ckpt.read_bytes() == kept, "the full-format checkpoint was changed"
    error = raised_everywhere(lambda: strategy.save_checkpoint({}, tmp))
    assert isinstance(error, IsADirectoryError) and str(tmp) in str(error), error


@case
def regression_adam_checkpoint_into_sgd_refused_before_change():
    """§2.7: an AdamW checkpoint loaded into an SGD optimizer succeeded; the error came at the first
    ``training_step`` (every step), after the weights and the step had been replaced."""
    from zeta_fsdp import CheckpointError

    tmp = shared_tmp()
    for fmt in ("full", "sharded"):
        strategy, _ = gpt_strategy(checkpoint_format=fmt)
        loader = strategy.process_dataloader(DataLoader(MaskedLM(), batch_size=PER_RANK))
        train(strategy, loader, 2)
        path = tmp / f"adam_{fmt}"
        strategy.save_checkpoint({}, path)
        torch.manual_seed(1)
        model = small()
        sgd = FSDP2Strategy(TransformerBlock=Block, checkpoint_format=fmt)
        sgd.connect(model)
        sgd.setup_optimizers(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        before = full_params(model)
        error = raised_everywhere(sgd.load_checkpoint, path)
        assert isinstance(error, CheckpointError), f"{fmt}: {type(error).__name__}: {error}"
        assert "AdamW" in str(error) and "SGD" in str(error) and str(path) in str(error), error
        for name, value in full_params(model).items():
            assert torch.equal(value, before[name]), f"{fmt}: {name} changed before the error"
        assert sgd.current_epoch_step == 0 and sgd._optimizer_state_to_restore is None
        batch = next(iter(sgd.process_dataloader(DataLoader(MaskedLM(), batch_size=PER_RANK))))
        sgd.training_step(batch, 0).backward()  # the strategy still trains
        sgd.optimizer_step()
        assert sgd.current_epoch_step == 1


# ---------------------------------------------------------------------------------------------
# tensor parallel


def tp_strategy(tp: int, seed: int = 0, **kwargs) -> tuple[FSDP2Strategy, nn.Module]:
    torch.manual_seed(seed)
    model = TPNet(vocab=37)
    ref = copy.deepcopy(model)
    strategy = FSDP2Strategy(tensor_parallel_size=tp, tp_plan=tp_plan(), **kwargs)
    strategy.connect(model)
    strategy.setup_optimizers(adamw())
    return strategy, ref


def _tp_parity(tp: int) -> FSDP2Strategy:
    strategy, ref = tp_strategy(tp)
    dp = world() // tp
    assert tuple(strategy.device_mesh.shape) == (dp, tp)
    up = strategy.model.layers[0].up.weight
    assert up.device_mesh.mesh_dim_names == ("dp", "tp"), up.device_mesh
    assert up.to_local().numel() == up.numel() // world(), "up projection not split over dp x tp"
    assert_trains_like_reference(strategy, ref, 3, dp, max_norm=0.5)
    return strategy


@case
def regression_tp2_training_parity():
    """TP=2 (dp=1 on 2 ranks): losses and parameters equal the single-process reference."""
    _tp_parity(tp=2)


@case(ranks=4)
def regression_dp2_tp2_training_parity_and_relayout():
    """DP=2 x TP=2 on 4 ranks equals the reference; its full checkpoint loads at DP=4 x TP=1."""
    strategy = _tp_parity(tp=2)
    tmp = shared_tmp()
    path = tmp / "tp.ckpt"
    strategy.save_checkpoint({}, path)
    saved_state = optimizer_state(strategy)
    plain, _ = tp_strategy(1, seed=4)
    plain.setup_optimizers(sgd())  # the parity run trained (and saved) SGD state
    plain.load_checkpoint(path)
    assert_params_match(plain.model, strategy.model, atol=0.0)
    batch = next(iter(plain.process_dataloader(DataLoader(MaskedLM(), batch_size=PER_RANK))))
    plain.training_step(batch)
    restored = optimizer_state(plain)
    for key, value in saved_state.items():
        assert_close(f"optimizer state {key}", restored[key], value, 0.0)


@case(ranks=4)
def hybrid_shard_strategy_training_parity():
    """HYBRID_SHARD (2 replicas x 2 shards) through the strategy: fsdp() builds the 2-D mesh over
    the same ranks as the strategy's dp dimension; losses and parameters equal the reference."""
    strategy, ref = gpt_strategy(shard_strat="HYBRID_SHARD", replicate_size=2)
    qkv = strategy.model.blocks[0].attn.qkv.weight
    assert tuple(qkv.device_mesh.shape) == (2, world() // 2), qkv.device_mesh
    assert_trains_like_reference(strategy, ref, 2, world(), replicas=2)


@case
def tp_without_plan_is_an_error():
    strategy = FSDP2Strategy(tensor_parallel_size=world())
    strategy.connect(TPNet())
    expect_error(ValueError, strategy.parallelize, "tp_plan")


# ---------------------------------------------------------------------------------------------
# the example loop, run inside this launch (torchrun, 2 ranks): examples/strategy_loop.py's main()
# joins the existing group and leaves it to us


def example_dir() -> Path:
    """Next to this launch's results, so test_strategy.py can resume from it on one process."""
    return Path(ARGS.out).parent / "example_loop"


@case
def example_strategy_loop_trains_checkpoints_and_resumes():
    import json

    from examples.strategy_loop import main

    ckpt = example_dir() / "ckpt"
    args = ["--steps", "6", "--save-every", "2", "--keep", "2", "--ckpt-dir", str(ckpt)]
    losses = main(args)
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["step_000004.ckpt", "step_000006.ckpt"], f"--keep 2 not honoured: {names}"
    dist.barrier()
    if rank() == 0:
        (ckpt / "step_000006.ckpt").unlink()
        (example_dir() / "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    resumed = main([*args, "--resume"])  # from step 4: steps 5 and 6 again
    assert len(resumed) == 2, resumed
    assert_losses_match(resumed, losses[4:], 0.0, first_step=5, against="uninterrupted")
    assert dist.is_initialized(), "the example tore down a process group it did not start"


if __name__ == "__main__":
    run_cases(CASES)

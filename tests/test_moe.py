"""Ranks that use different parameters in one step (mixture of experts).

In-process: which units ``auto_wrap`` picks when a forward may skip modules, and the refusals
(a unit the user named that ranks may skip; a torch without ``set_reduce_scatter_unused_params``).
Multi-rank parity (every strategy, blocks given and detected, experts of different sizes, Hugging
Face MoE models): ``moe_cases.py``, one launch per rank count.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import dist_test
from moe_models import MLP, AttrMoELayer, Expert, HelperMoELayer, HitsMoELayer, MoEBlock, MoELM, Towered
from worker import expect_error

from zeta_fsdp import fsdp
from zeta_fsdp.engines import fully_shard as engine
from zeta_fsdp.models.gpt import small
from zeta_fsdp.wrapping import build_wrap_plan, detect_block_classes, skippable_modules

test_two_ranks = dist_test("moe_cases.py", 2)
test_four_ranks = dist_test("moe_cases.py", 4)


def test_auto_wrap_makes_the_moe_block_the_unit_not_its_experts():
    plan = build_wrap_plan(MoELM(), auto_wrap=True)
    assert detect_block_classes(MoELM()) == (MoEBlock,)
    assert [u.name for u in plan.blocks] == ["blocks.0", "blocks.1"]
    assert plan.skippable == {
        "blocks.0.moe.experts": "MoELayer.forward runs its members under `mask.any()`",
        "blocks.1.moe.experts": "MoELayer.forward runs its members under `mask.any()`",
    }
    table = plan.table()
    assert "not units, as ranks may skip them in a step: blocks.0.moe.experts" in table, table
    assert "Expert" not in table  # no suggestion to split a block into experts


def test_a_named_expert_unit_is_refused_before_anything_changes():
    model = MoELM()
    before = {n: p.clone() for n, p in model.named_parameters()}
    expect_error(
        ValueError,
        lambda: fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=(MoEBlock, Expert)),
        "blocks.0.moe.experts.0",
        "MoELayer.forward runs its members under `mask.any()`",
        "Name the class of the layer",
    )
    assert not dist.is_initialized()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_old_torch_refuses_a_model_ranks_may_use_differently(monkeypatch):
    monkeypatch.setattr(engine, "REDUCES_UNUSED_PARAMS", False)
    expect_error(
        ValueError,
        lambda: fsdp(MoELM(), auto_wrap=True, shard_strat="FULL_SHARD"),
        "blocks.0.moe.experts",
        f"torch {torch.__version__}",
        "torch>=2.13",
    )
    assert not dist.is_initialized()
    # a model every rank uses alike is not refused
    engine.check(build_wrap_plan(small(), auto_wrap=True), small(), torch.float32)


class _Routed(nn.Module):
    """Hugging Face 4.x Mixtral's dispatch: only the experts a token hit run."""

    def __init__(self, container: str = "ffns"):
        super().__init__()
        setattr(self, container, nn.ModuleList(nn.Linear(2, 2) for _ in range(3)))
        self.container = container

    def forward(self, x, hit):
        for idx in hit:
            x = x + self.ffns[idx](x)
        return x


class _SkipByContinue(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffns = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    def forward(self, x, route):
        for i, ffn in enumerate(self.ffns):
            if not (route == i).any():
                continue
            x = x + ffn(x)
        return x


class _Stack(nn.Module):
    """Every member runs: checkpointed or not, by element or by index."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        self.more = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        self.ckpt = False

    def forward(self, x):
        for layer in self.layers:
            if self.ckpt:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        for i in range(len(self.more)):
            x = self.more[i](x)
            if i == 1:
                x = x * 2
        return x


class _LayerDrop(nn.Module):
    """LayerDrop written by hand: a coin per layer, drawn on each rank (so it may differ by rank): evidence."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        self.layerdrop = 0.0

    def forward(self, x):
        for layer in self.layers:
            skip = self.training and float(torch.rand([])) < self.layerdrop
            if not skip:
                x = layer(x)
        return x


@pytest.mark.parametrize(
    "model, expected",
    [
        (_Routed(), {"ffns": "_Routed.forward runs its members in a loop over `hit`"}),
        (
            _SkipByContinue(),
            {"ffns": "_SkipByContinue.forward runs its members after `if not (route == i).any(): continue`"},
        ),
        (_Stack(), {}),
        (_LayerDrop(), {"layers": "_LayerDrop.forward runs its members under `not skip`"}),
        (nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(2, 2) for _ in range(2))}), None),
    ],
    ids=["picked-by-index", "continue", "every-member-runs", "random-layer-skip", "named-experts"],
)
def test_which_containers_a_forward_may_skip(model, expected):
    found = skippable_modules(model)
    if expected is None:
        assert found == {"experts": "named 'experts': the experts a router picks per token"}
    else:
        assert found == expected


def test_a_hugging_face_moe_keeps_its_declared_blocks():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=8,
        num_local_experts=4,
    )
    plan = build_wrap_plan(transformers.MixtralForCausalLM(cfg), auto_wrap=True)
    assert [u.name for u in plan.blocks] == ["model.layers.0", "model.layers.1"]
    assert plan.skippable == {}


# Dispatch in a module-level helper, a comprehension over the ids hit, experts reached by getattr: the
# readable call sites are under conditions on the data (evidence); the experts stay in their block's unit.
@pytest.mark.parametrize("layer", [HelperMoELayer, HitsMoELayer, AttrMoELayer], ids=["helper", "hits", "getattr"])
def test_experts_behind_a_helper_are_never_units(layer):
    model = MoELM(layer=layer)
    plan = build_wrap_plan(model, auto_wrap=True)
    assert [u.name for u in plan.blocks] == ["blocks.0", "blocks.1"], plan.table()
    assert plan.block_classes == (MoEBlock,)
    assert "MLP" not in plan.table()  # no suggestion to split a block into its experts
    # named explicitly, the experts are refused (the layer holding them is accepted)
    before = {n: p.clone() for n, p in model.named_parameters()}
    expect_error(
        ValueError,
        lambda: fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=MLP),
        "TransformerBlock makes blocks.0.moe.",
        "a forward may skip it on some ranks",
    )
    assert not dist.is_initialized()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert [u.name for u in build_wrap_plan(model, auto_wrap=True, transformer_block=MoEBlock).blocks] == [
        "blocks.0",
        "blocks.1",
    ]


def test_experts_alone_behind_a_helper_leave_one_unit():
    # no enclosing block: the experts (the only repeated class) are not units, the root holds them
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = HelperMoELayer(4, (8, 8, 8, 8))

        def forward(self, x, route):
            return self.moe(x, route)

    plan = build_wrap_plan(Net(), auto_wrap=True)
    assert [u.name for u in plan.units] == ["<root>"]


def test_an_optional_tower_is_not_a_unit():
    plan = build_wrap_plan(Towered(), auto_wrap=True)
    assert [u.name for u in plan.blocks] == ["blocks.0", "blocks.1"], plan.table()
    assert plan.skippable == {"vision": "Towered.forward runs it under `batch_has_image`"}
    assert "not units, as ranks may skip them in a step: vision (Towered.forward" in plan.table()
    assert "vision.0.up.weight" in plan.units[-1].param_names  # in the root's unit, gathered by every rank
    expect_error(
        ValueError,
        lambda: build_wrap_plan(Towered(), auto_wrap=True, transformer_block=MLP),
        "TransformerBlock makes vision.0 an FSDP unit",
        "vision: Towered.forward runs it under `batch_has_image`",
    )


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(4, 8) for _ in range(2))

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return h

    def run_some(self, h):
        for block in self.blocks[:1]:
            h = block(h)
        return h


class _AdaptiveDepth(nn.Module):
    """A looped transformer: the number of passes depends on the data (differs by rank)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(4, 8) for _ in range(2))

    def forward(self, h):
        for _ in range(int(h.abs().sum()) % 3):
            for block in self.blocks:
                h = block(h)
        return h


class _ExtraCall(nn.Module):
    """A clean loop, then the first block once more on some ranks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(4, 8) for _ in range(2))

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        if h.sum() > 0:
            h = self.blocks[0](h)
        return h


class _MethodUnderCondition(nn.Module):
    def __init__(self):
        super().__init__()
        self.stack = _Stack()

    def forward(self, h):
        if h.sum() > 0:
            h = self.stack.run_some(h)
        return self.stack(h)


class _TwiceAlways(nn.Module):
    """The same child called twice on every run (an embedding for source and target): the same count on
    every rank, so it may be a unit."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(4, 8) for _ in range(2))
        self.embed = nn.Linear(4, 4)

    def forward(self, a, b):
        h = self.embed(a) + self.embed(b)
        for block in self.blocks:
            h = block(h)
        return h


@pytest.mark.parametrize("model", [_AdaptiveDepth, _ExtraCall, _MethodUnderCondition], ids=lambda c: c.__name__)
def test_blocks_that_may_run_a_different_number_of_times_are_not_units(model):
    """Running at least once is not enough: a unit must run the same number of times on every rank
    (a data-dependent pass count, a conditional extra call, a second method of the holder under a condition)."""
    with pytest.warns(UserWarning):  # auto_wrap found no block it may make a unit
        plan = build_wrap_plan(model(), auto_wrap=True)
    assert plan.blocks == [] and [u.kind for u in plan.units] == ["root"], plan.table()
    expect_error(ValueError, lambda: build_wrap_plan(model(), auto_wrap=True, transformer_block=MLP), "an FSDP unit")


def test_a_child_called_twice_on_every_run_stays_provable():
    plan = build_wrap_plan(_TwiceAlways(), auto_wrap=True)
    assert [u.name for u in plan.blocks] == ["blocks.0", "blocks.1"], plan.table()


def checkpoint_seq(blocks, x):
    """timm's helper: run each member once (under activation checkpointing in timm)."""
    for block in blocks:
        x = block(x)
    return x


class _TimmLike(nn.Module):
    """timm's shape: forward -> forward_features / forward_head methods, a setting-gated branch, a
    flag with a default, a classifier head whose fc is skipped only for pre_logits=True."""

    def __init__(self, checkpointing: bool = False):
        super().__init__()
        self.grad_checkpointing = checkpointing
        self.blocks = nn.Sequential(MLP(4, 8), MLP(4, 8))
        self.head = _Head()
        self.extra = None

    def forward_features(self, x):
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        if self.extra is not None:
            x = self.extra(x)
        return x

    def forward_head(self, x, pre_logits: bool = False):
        return self.head(x, pre_logits=True) if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(4), nn.Linear(4, 2)

    def forward(self, x, pre_logits: bool = False):
        x = self.norm(x)
        if pre_logits:
            return x
        return self.fc(x)


class _DataGatedMethod(_TimmLike):
    """The same model, but a method that runs the first block again when the data says so."""

    def again(self, x):
        return self.blocks[0](x)

    def forward(self, x):
        if x.sum() > 0:
            x = self.again(x)
        return self.forward_head(self.forward_features(x))


def test_methods_settings_and_default_flags_are_read_as_the_model_has_them():
    plan = build_wrap_plan(_TimmLike(), auto_wrap=True)
    assert [u.name for u in plan.units] == ["blocks.0", "blocks.1", "[head.norm, head.fc]", "<root>"], plan.table()
    # with checkpointing on, timm's checkpoint_seq runs every member once: the same units
    assert [u.name for u in build_wrap_plan(_TimmLike(True), auto_wrap=True).units] == [u.name for u in plan.units]
    # a method run under a data condition that calls a block again: that block's count differs by rank
    with pytest.warns(UserWarning):
        gated = build_wrap_plan(_DataGatedMethod(), auto_wrap=True)
    assert gated.blocks == [], gated.table()


class _Switchable(nn.Module):
    """Dense now; a setting turns on routing later (a data-dependent subset of the layers runs)."""

    def __init__(self):
        super().__init__()
        self.routed = False
        self.layers = nn.ModuleList(MLP(4, 8) for _ in range(2))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if self.routed:
                if (x.argmax(-1) == i).any():
                    x = x + layer(x)
            else:
                x = x + layer(x)
        return x


def test_a_branch_a_setting_may_take_later_is_read_too():
    with pytest.warns(UserWarning):  # no block it may make a unit
        plan = build_wrap_plan(_Switchable(), auto_wrap=True)
    assert plan.blocks == [], plan.table()


_GENERATED = """
class GenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.down(self.up(x))


class GenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(GenBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
"""


def test_a_model_whose_source_cannot_be_read_is_trusted():
    """No evidence is no refusal: the blocks are units, detected or named (the run-time check covers them)."""
    scope = {"nn": nn}
    exec(compile(_GENERATED, "<generated>", "exec"), scope)
    model = scope["GenNet"]()
    assert [u.name for u in build_wrap_plan(model, auto_wrap=True).blocks] == ["blocks.0", "blocks.1"]
    assert [u.name for u in build_wrap_plan(model, auto_wrap=True).blocks] == ["blocks.0", "blocks.1"]
    assert [u.name for u in build_wrap_plan(model, auto_wrap=True, transformer_block="GenBlock").blocks] == [
        "blocks.0",
        "blocks.1",
    ]


def test_old_torch_refuses_experts_behind_a_helper(monkeypatch):
    monkeypatch.setattr(engine, "REDUCES_UNUSED_PARAMS", False)
    model = Towered()
    with pytest.raises(ValueError, match="vision"):
        engine.check(build_wrap_plan(model, auto_wrap=True), model, torch.float32)

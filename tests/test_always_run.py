"""The auto_wrap proof (zeta_fsdp.always_run) against forwards written to fool it, and real patterns
it must still read. In-process: plans only (the multi-rank consequences are in moe_cases.py)."""

from __future__ import annotations

import contextlib
import functools
import types
import warnings

import pytest
import torch
import torch.nn as nn

from zeta_fsdp.always_run import always_run, modality_towers
from zeta_fsdp.wrapping import build_wrap_plan


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.a(x)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class WhileReturn(Base):
    def forward(self, x):
        h = self.emb(x)
        while x.sum() > 100:
            return self.head(h)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class CaughtSkip(Base):
    def check(self, x):
        if (x > 5).any():
            raise ValueError("long")

    def forward(self, x):
        h = self.emb(x)
        try:
            self.check(x)
            for b in self.blocks:
                h = b(h)
        except ValueError:
            pass
        return self.head(h)


class Suppressed(Base):
    def forward(self, x):
        h = self.emb(x)
        with contextlib.suppress(ValueError):
            if (x > 5).any():
                raise ValueError
            for b in self.blocks:
                h = b(h)
        return self.head(h)


class SelfAlias(Base):
    def forward(self, x):
        me = self
        h = super().forward(x)
        if (x > 5).any():
            h = me.blocks[2](h)
        return h


class ModulesDict(Base):
    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        if (x > 5).any():
            h = self._modules["blocks"][2](h)
        return self.head(h)


class ListAlias(Base):
    def __init__(self):
        super().__init__()
        self._again = [self.blocks[2]]

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        if (x > 5).any():
            h = self._again[0](h)
        return self.head(h)


class FlagFromData(Base):
    def __init__(self):
        super().__init__()
        self.has_text = True

    def forward(self, x):
        self.has_text = bool((x > 5).any())
        h = self.emb(x)
        if self.has_text:
            for b in self.blocks:
                h = b(h)
        return self.head(h)


class FlagPerRank(Base):
    """A setting the training loop may set per batch, per rank: both branches count."""

    def __init__(self):
        super().__init__()
        self.use_blocks = True

    def forward(self, x):
        h = self.emb(x)
        if self.use_blocks:
            for b in self.blocks:
                h = b(h)
        return self.head(h)


class StochasticDepthInEval(Base):
    def forward(self, x):
        h = self.emb(x)
        if self.training and torch.rand(()) < 0.1:
            return self.head(h)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class PonderLoop(Base):
    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
            while h.norm() > 10:
                h = blk(h)
        return self.head(h)


class GeneratorRerun(Base):
    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = sum(blk(h) for _ in range(int(x.sum()) % 2 + 1))
        return self.head(h)


class SkippingCall(Block):
    def __call__(self, x, skip=False):
        return x if skip else super().__call__(x)


class CallOverride(Base):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(SkippingCall() for _ in range(3))

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h, skip=bool((x > 5).any()))
        return self.head(h)


def _skip_if_none(f):
    @functools.wraps(f)
    def wrapper(self, x, *args):
        return None if x is None else f(self, x, *args)

    return wrapper


class DecoratedTower(Base):
    @_skip_if_none
    def encode(self, image):
        for b in self.blocks:
            image = b(image)
        return image

    def forward(self, x, image=None):
        h = self.emb(x)
        img = self.encode(image)
        return self.head(h if img is None else h + img.mean())


class SharedExtraStep(Base):
    def __init__(self):
        super().__init__()
        self.again = self.blocks[2]

    def forward(self, x):
        h = super().forward(x)
        if (x > 5).any():
            h = self.again(h)
        return h


def _patched_forward(self, x):
    h = self.emb(x)
    if (x > 5).any():
        for b in self.blocks:
            h = b(h)
    return self.head(h)


def _instance_patched():
    model = Base()
    model.forward = types.MethodType(_patched_forward, model)
    return model


SKIPPABLE = {
    "while-return": WhileReturn,
    "caught-exception": CaughtSkip,
    "suppress": Suppressed,
    "self-alias": SelfAlias,
    "_modules": ModulesDict,
    "list-alias": ListAlias,
    "flag-from-data": FlagFromData,
    "flag-per-rank": FlagPerRank,
    "stochastic-depth-planned-in-eval": lambda: StochasticDepthInEval().eval(),
    "ponder-while": PonderLoop,
    "generator": GeneratorRerun,
    "__call__-override": CallOverride,
    "decorated-method": DecoratedTower,
    "instance-forward": _instance_patched,
}


@pytest.mark.parametrize("make", list(SKIPPABLE.values()), ids=list(SKIPPABLE))
def test_a_block_some_rank_may_skip_or_rerun_is_never_a_unit(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "found no repeated block it may make a unit"
        plan = build_wrap_plan(make(), auto_wrap=True)
    assert plan.blocks == [], plan.table()


def test_a_module_registered_twice_is_not_a_unit_and_its_twin_blocks_are():
    plan = build_wrap_plan(SharedExtraStep(), auto_wrap=True)
    assert [u.name for u in plan.blocks] == ["blocks.0", "blocks.1"], plan.table()
    _, why = always_run(SharedExtraStep())
    assert why["blocks.2"] == "registered under two names"


class NanoGPT(nn.Module):
    """nanoGPT's layout: embeddings and blocks inside an ``nn.ModuleDict``."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(wte=nn.Embedding(10, 8), h=nn.ModuleList(Block() for _ in range(3)), ln_f=nn.LayerNorm(8))
        )
        self.lm_head = nn.Linear(8, 10, bias=False)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            return self.lm_head(x)
        return self.lm_head(x[:, [-1], :])


class DenseStage(nn.ModuleDict):
    def __init__(self):
        super().__init__({f"l{i}": Block() for i in range(3)})

    def forward(self, x):
        for _, layer in self.items():
            x = layer(x)
        return x


class Zipped(Base):
    def __init__(self):
        super().__init__()
        self.scales = nn.ModuleList(nn.LayerNorm(8) for _ in range(3))

    def forward(self, x):
        h = self.emb(x)
        for blk, scale in zip(self.blocks, self.scales):
            h = scale(blk(h))
        return self.head(h)


class Settings(Base):
    """Both branches of a setting counted: each runs every block once (timm's checkpointing switch)."""

    def __init__(self):
        super().__init__()
        self.grad_checkpointing = False
        self.depth = 3

    def forward(self, x):
        h = self.emb(x)
        first = self.blocks[0]  # a local name only read
        assert first.a.in_features == 8
        with torch.autocast("cpu", enabled=False):
            for i in range(self.depth):
                if self.grad_checkpointing:
                    h = torch.utils.checkpoint.checkpoint(self.blocks[i], h, use_reentrant=False)
                else:
                    h = self.blocks[i](h)
        return self.head(h)


FOUND = {
    "nanogpt": (NanoGPT, ["transformer.h.0", "transformer.h.1", "transformer.h.2"]),
    "densenet-items": (lambda: nn.Sequential(nn.Embedding(10, 8), DenseStage()), ["1.l0", "1.l1", "1.l2"]),
    "zip": (Zipped, ["blocks.0", "blocks.1", "blocks.2"]),
    "settings-both-branches": (Settings, ["blocks.0", "blocks.1", "blocks.2"]),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_blocks_every_path_runs_once_are_units(name):
    make, blocks = FOUND[name]
    plan = build_wrap_plan(make(), auto_wrap=True)
    assert set(blocks) <= {u.name for u in plan.blocks}, plan.table()
    assert not plan.unproven, plan.unproven


class MetaProperty(Base):
    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.zeros(()))

    @property
    def temperature(self):
        return float(self.logit_scale.exp())

    def forward(self, x):
        h = super().forward(x)
        return h * self.temperature if self.temperature != 1.0 else h


def test_planning_never_runs_a_property():
    with torch.device("meta"):  # float() of a meta tensor would raise
        model = MetaProperty()
    assert [u.name for u in build_wrap_plan(model, auto_wrap=True).blocks] == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_multimodal_language_models_tower_is_not_a_unit():
    transformers = pytest.importorskip("transformers")
    text = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4
    )
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=3)
    model = transformers.LlavaForConditionalGeneration(cfg)
    assert set(modality_towers(model)) == {"model.vision_tower", "model.multi_modal_projector"}
    plan = build_wrap_plan(model, auto_wrap=True)
    assert [u.name for u in plan.blocks] == ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert "runs its vision_tower only for batches that carry that input" in plan.table()
    # CLIP runs both towers on every batch: its vision layers stay units
    clip = transformers.CLIPModel(
        transformers.CLIPConfig(text_config=dict(text, max_position_embeddings=16), vision_config=vision)
    )
    assert modality_towers(clip) == {}


def test_a_lightning_module_is_read_from_its_training_step():
    lightning = pytest.importorskip("lightning")

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = Base()
            self.tower = nn.ModuleList(Block() for _ in range(2))

        def training_step(self, batch, i):
            h = self.lm(batch["x"])
            if batch.get("image") is not None:
                for b in self.tower:
                    h = h + b(batch["image"])
            return h.sum()

    plan = build_wrap_plan(Lit(), auto_wrap=True)
    assert [u.name for u in plan.blocks] == ["lm.blocks.0", "lm.blocks.1", "lm.blocks.2"], plan.table()

"""The wrapping plan: block detection, unit order, tied weights, byte counts. Pure: no group."""

from __future__ import annotations

import torch
import torch.nn as nn

from zeta_fsdp.models.gpt import Block, GPTConfig, small
from zeta_fsdp.wrapping import build_wrap_plan, detect_block_classes


def test_units_are_bottom_up_with_tied_embedding_and_head_together():
    plan = build_wrap_plan(small(), auto_wrap=True, transformer_block=Block)
    assert [u.name for u in plan.units] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "[tok_emb, pos_emb, norm, head]",
        "<root>",
    ]
    assert plan.tied_params == [["tok_emb.weight", "head.weight"]]
    assert plan.units[3].kind == "embedding+head"


def test_untied_model_gets_separate_embedding_and_head_units():
    plan = build_wrap_plan(small(tie_weights=False), auto_wrap=True)
    assert [(u.kind, u.name) for u in plan.units[3:]] == [
        ("embedding", "[tok_emb, pos_emb]"),
        ("head", "[norm, head]"),
        ("root", "<root>"),
    ]


def test_byte_counts_cover_every_parameter_once():
    model = small(tie_weights=False)
    plan = build_wrap_plan(model, auto_wrap=True)
    assert plan.numel == sum(p.numel() for p in model.parameters())
    assert plan.nbytes == 4 * plan.numel
    names = [n for u in plan.units for n in u.param_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert "total" in plan.table() and "blocks.2" in plan.table()


def test_detection_prefers_hugging_face_no_split_modules():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

    class HFModel(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(3, 3) for _ in range(8))  # a decoy list
            self.layers = nn.Sequential(Layer(), Layer())

    assert [c.__name__ for c in detect_block_classes(HFModel())] == ["Layer"]


def test_detection_falls_back_to_repeated_modulelist_children():
    assert detect_block_classes(small()) == (Block,)
    assert detect_block_classes(nn.Sequential(nn.Linear(2, 2))) == ()


def test_plan_works_on_meta_without_allocating():
    with torch.device("meta"):
        model = small(**vars(GPTConfig(dim=300, n_heads=3)))
    plan = build_wrap_plan(model, auto_wrap=True)
    assert plan.numel == sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())


def test_parameters_shared_between_blocks_fall_back_to_the_parent_unit():
    import pytest

    model = small(tie_weights=False)
    model.blocks[1].mlp[0].weight = model.blocks[0].mlp[0].weight  # weight sharing across layers
    with pytest.warns(UserWarning, match="blocks.0, blocks.1 cannot be split"):
        plan = build_wrap_plan(model, auto_wrap=True)
    names = [u.name for u in plan.units]
    assert "blocks.0" not in names and "blocks.1" not in names and "blocks.2" in names
    root = plan.units[-1]
    assert "blocks.0.mlp.0.weight" in root.param_names
    assert plan.numel == sum(p.numel() for p in model.parameters())

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


def test_auto_wrap_that_finds_nothing_warns_how_to_name_the_block():
    import pytest

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match=r"found no repeated block.*TransformerBlock=MyBlock"):
        plan = build_wrap_plan(model, auto_wrap=True)
    assert [u.name for u in plan.units] == ["<root>"]


def test_sublayer_lists_inside_blocks_are_not_blocks_themselves():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))  # 8 Linears in all > 2 Layers

        def forward(self, x):
            return sum(head(x) for head in self.heads)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(Layer(), Layer())

        def forward(self, x):
            return self.layers(x)

    assert [c.__name__ for c in detect_block_classes(Net())] == ["Layer"]


def test_plan_and_report_show_fp32_masters_for_a_bf16_model():
    from zeta_fsdp.planner import plan

    with torch.device("meta"):
        model = small().to(torch.bfloat16)
    p = plan(model, world_size=2, shard_strat="FULL_SHARD", mp="bf16")
    assert (p.master_dtype, p.optimizer_state_dtype) == ("float32", "float32")
    assert "master weights float32, optimizer state float32" in p.report()
    keep = plan(model, world_size=2, shard_strat="FULL_SHARD", mp="bf16", master_dtype=None)
    assert keep.master_dtype == "bfloat16"
    # fp32 masters: twice the bf16 shard bytes, gradients and optimizer state alike
    assert (p.param_bytes, p.grad_bytes) == (2 * keep.param_bytes, 2 * keep.grad_bytes)
    # the all-gathered copies are bf16 either way (mp is the compute dtype)
    assert sum(u.unsharded_bytes for u in p.units) == sum(u.unsharded_bytes for u in keep.units)


class _Mlp(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class _ConvNormAct(nn.Module):
    """One weight layer and its norm: a layer, not a block (timm's ConvNormAct)."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(dim, dim, 1), nn.BatchNorm2d(dim)


class _Bottleneck(nn.Module):
    """timm RegNet's Bottleneck: conv1 .. conv3 are indexed named attributes too, but layers."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = _ConvNormAct(dim), _ConvNormAct(dim), _ConvNormAct(dim)


def test_blocks_in_a_module_dict_and_as_indexed_attributes_are_found():
    class Titan(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({str(i): _Mlp(4) for i in range(3)})

        def forward(self, x):
            for layer in self.layers.values():
                x = layer(x)
            return x

    class RegStage(nn.Module):
        def __init__(self):
            super().__init__()
            for i in range(3):
                self.add_module(f"b{i + 1}", _Bottleneck(4))
            self.depth = 3

        def forward(self, x):
            for i in range(self.depth):
                x = getattr(self, f"b{i + 1}")(x)
            return x

    class RegNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.s1, self.s2 = RegStage(), RegStage()
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.s2(self.s1(x)))

    assert detect_block_classes(Titan()) == (_Mlp,)
    plan = build_wrap_plan(RegNet(), auto_wrap=True)
    assert plan.block_classes == (_Bottleneck,)  # not the conv layers inside, not the RegStage around
    assert [u.name for u in plan.blocks] == [f"s{s}.b{b}" for s in (1, 2) for b in (1, 2, 3)]
    assert any("RegStage" in n for n in plan.notes), plan.notes


def test_nested_models_are_wrapped_at_the_innermost_block_never_at_sequential():
    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.downsample = nn.Linear(4, 4)
            self.blocks = nn.Sequential(_Mlp(4), _Mlp(4))

    model = nn.Sequential(nn.Sequential(Stage(), Stage()), nn.Sequential(_Mlp(4), _Mlp(4)), nn.Linear(4, 2))
    classes = detect_block_classes(model)
    assert classes == (_Mlp,) and nn.Sequential not in classes
    # EfficientNet's layout: a Sequential of Sequential stages of blocks (the stages never chosen)
    effnet = nn.Sequential(nn.Sequential(_Mlp(4)), nn.Sequential(_Mlp(4), _Mlp(4)), nn.Sequential(_Mlp(4)))
    assert [u.name for u in build_wrap_plan(effnet, auto_wrap=True).blocks] == ["0.0", "1.0", "1.1", "2.0"]


def test_table_shows_shares_and_names_the_block_to_split_a_large_unit():
    class Tower(nn.Module):  # blocks under names with no index: not detected
        def __init__(self):
            super().__init__()
            self.first, self.second = _Mlp(16), _Mlp(16)

        def forward(self, x):
            return self.second(self.first(x))

    class Small(nn.Linear):
        pass

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Small(4, 4) for _ in range(2))
            self.tower = Tower()

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.tower(x)

    plan = build_wrap_plan(Net(), auto_wrap=True)
    tail = plan.units[-2]  # the tower comes after the last detected block: the "head" group
    share = tail.numel / sum(p.numel() for p in Net().parameters())
    assert plan.largest is tail and tail.kind == "head" and share > 0.9
    table = plan.table()
    assert f"{100 * share:.1f}%" in table and f"largest unit: {tail.name} (head), {100 * share:.1f}%" in table
    assert "pass TransformerBlock='_Mlp'" in table, table
    # split as suggested: the largest unit is now small, and no hint
    split = build_wrap_plan(Net(), auto_wrap=True, transformer_block="_Mlp")
    assert max(split.share(u) for u in split.units) < 0.5 and "TransformerBlock=" not in split.table()


def test_a_repeated_plain_layer_elsewhere_does_not_make_blocks_stages():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.adapters = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.blocks = nn.ModuleList(_Mlp(4) for _ in range(2))

        def forward(self, x):
            for adapter in self.adapters:
                x = adapter(x)
            for block in self.blocks:
                x = block(x)
            return x

    # _Mlp holds Linears, and Linear is repeated (in adapters): _Mlp is still a block, not a stage
    assert _Mlp in detect_block_classes(Net())

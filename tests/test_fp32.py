"""fp32 modules (``fsdp(keep_fp32=...)``, Hugging Face ``_keep_in_fp32_modules(_strict)``) and staged
unfreezing. Multi-rank cases in ``fp32_cases.py`` (one launch); validation, selection and the
planner in process."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from conftest import dist_test
from torch.distributed.fsdp import MixedPrecisionPolicy

from zeta_fsdp import fsdp
from zeta_fsdp.engines import is_fsdp_wrapped
from zeta_fsdp.fp32_modules import select_fp32
from zeta_fsdp.models.gpt import small
from zeta_fsdp.planner import plan
from zeta_fsdp.wrapping import add_fp32_units, build_wrap_plan

test_two_ranks = dist_test("fp32_cases.py", 2)

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize(
    ("keep_fp32", "message"),
    [
        ("router", "keep_fp32 entry 'router' matches no submodule of GPT"),
        ([nn.LayerNorm, "norm3"], "'norm3' matches no submodule"),
        ([nn.GRU], "'GRU' matches no submodule"),
        (3, "keep_fp32=3 is not accepted"),
        (["norm", 2.0], "keep_fp32=['norm', 2.0] is not accepted (2.0)"),
        ("blocks", "matched 'blocks', a ModuleList"),
    ],
)
def test_bad_keep_fp32_raises_before_anything_changes(keep_fp32, message):
    model = small()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="^fsdp\\(\\): .*" + re.escape(message)):
        fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", keep_fp32=keep_fp32)
    assert not is_fsdp_wrapped(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_name_patterns_match_whole_dotted_parts():
    model = small(n_layers=1)
    assert select_fp32(model, "norm", BF16).cast_modules == ("norm",)
    assert select_fp32(model, "norm*", BF16).cast_modules == ("blocks.0.norm1", "blocks.0.norm2", "norm")
    assert select_fp32(model, "attn.proj", BF16).param_names == ("blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias")
    assert select_fp32(model, [nn.LayerNorm], MixedPrecisionPolicy()).param_names == ()  # fp32 mp: nothing to keep


def test_hf_rule_is_from_pretrained_rule():
    """Strict entries under bf16 and fp16, plain ones under fp16 only; each a regex searched in the name."""

    class Model(nn.Module):
        _keep_in_fp32_modules = ["wo"]
        _keep_in_fp32_modules_strict = ["gate.weight"]

        def __init__(self):
            super().__init__()
            self.gate, self.wo, self.gate_proj = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert select_fp32(Model(), None, BF16).param_names == ("gate.weight",)
    assert select_fp32(Model(), None, fp16).param_names == ("gate.weight", "wo.weight", "wo.bias")
    assert select_fp32(Model(), None, MixedPrecisionPolicy()).param_names == ()


def test_fp32_units_sit_before_their_block_and_leave_groups():
    model = small(n_layers=1)
    wrap = build_wrap_plan(model, auto_wrap=True)
    add_fp32_units(wrap, model, select_fp32(model, [nn.LayerNorm], BF16).param_names)
    assert [(u.name, u.kind) for u in wrap.units] == [
        ("blocks.0.norm1", "fp32"),
        ("blocks.0.norm2", "fp32"),
        ("blocks.0", "block"),
        ("[tok_emb, pos_emb, head]", "embedding+head"),
        ("norm", "fp32"),
        ("<root>", "root"),
    ]
    assert sum(len(u.param_names) for u in wrap.units) == len(list(model.parameters()))


def test_tied_fp32_modules_share_one_unit():
    """keep_fp32 on a tied head: the weight is named under its first name (tok_emb.weight) and both modules
    holding it go into one fp32 unit (keeping only the head once crashed in F.linear: float vs bf16)."""
    model = small(n_layers=1)
    for keep in (["head"], ["head", "tok_emb"]):
        assert select_fp32(model, keep, BF16).param_names == ("tok_emb.weight",)
        wrap = build_wrap_plan(model, auto_wrap=True)
        add_fp32_units(wrap, model, select_fp32(model, keep, BF16).param_names)
        assert [u.module_names for u in wrap.units if u.kind == "fp32"] == [["tok_emb", "head"]], keep
        assert sum(len(u.param_names) for u in wrap.units) == len(list(model.parameters()))


def test_fp32_parameter_sharing_a_module_without_override_is_refused():
    model = small(n_layers=1)
    wrap = build_wrap_plan(model, auto_wrap=True)
    with pytest.raises(ValueError, match="blocks.0.attn.proj.weight must stay fp32 but its module blocks.0.attn.proj"):
        add_fp32_units(wrap, model, ["blocks.0.attn.proj.weight"])


def test_planner_counts_fp32_modules_at_fp32():
    with torch.device("meta"):
        model = small()
    base = plan(model, world_size=2, mp="bf16")
    kept = plan(model, world_size=2, mp="bf16", keep_fp32=[nn.LayerNorm])
    norms = sum(p.numel() for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters())
    gathered = sum(u.unsharded_bytes for u in kept.units) - sum(u.unsharded_bytes for u in base.units)
    assert gathered == norms * 2  # gathered in fp32 (4 bytes) instead of bf16 (2)
    assert kept.param_bytes == base.param_bytes  # stored fp32 either way (master_dtype="fp32")

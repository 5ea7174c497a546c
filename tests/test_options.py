"""Option tables and every error path of fsdp(): message content, and nothing changed."""

from __future__ import annotations

import copy
import inspect
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy

from zeta_fsdp import fsdp
from zeta_fsdp.engines import DEFAULT_ENGINE, SEAM, Engine, engine_named
from zeta_fsdp.engines import fully_shard as fully_shard_engine
from zeta_fsdp.engines import replicate as replicate_engine
from zeta_fsdp.models.gpt import Block, small
from zeta_fsdp.options import (
    choose_engine,
    mesh_shape,
    resolve_mixed_precision,
    resolve_sharding,
    validate_keep_tail_unsharded,
    validate_prefetch,
    validate_reshard_after_forward,
)


@pytest.mark.parametrize(
    "mp, param_dtype, reduce_dtype, output_dtype",
    [
        ("fp32", None, None, None),
        ("FP32", None, None, None),
        ("float32", None, None, None),
        ("bf16", torch.bfloat16, torch.float32, None),
        ("BFloat16", torch.bfloat16, torch.float32, None),
        ("fp16", torch.float16, torch.float32, None),
        ("float16", torch.float16, torch.float32, None),
        (torch.bfloat16, torch.bfloat16, torch.float32, None),
    ],
)
def test_mixed_precision_table(mp, param_dtype, reduce_dtype, output_dtype):
    policy = resolve_mixed_precision(mp)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (param_dtype, reduce_dtype, output_dtype)


def test_policy_object_is_used_as_given():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert resolve_mixed_precision(policy) is policy


@pytest.mark.parametrize(
    "strat, name, ndim, reshard",
    [
        ("FULL_SHARD", "FULL_SHARD", 1, True),
        ("full_shard", "FULL_SHARD", 1, True),
        ("SHARD_GRAD", "SHARD_GRAD", 1, False),
        ("shard_grad_op", "SHARD_GRAD", 1, False),
        ("NO_SHARD", "NO_SHARD", 2, False),
        ("HYBRID_SHARD", "HYBRID_SHARD", 2, True),
        ("hybrid_shard_zero2", "HYBRID_SHARD_ZERO2", 2, False),
        (ShardingStrategy.FULL_SHARD, "FULL_SHARD", 1, True),
        (ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD", 1, False),
        (ShardingStrategy.NO_SHARD, "NO_SHARD", 2, False),
        (ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", 2, True),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, "HYBRID_SHARD_ZERO2", 2, False),
    ],
)
def test_sharding_table(strat, name, ndim, reshard):
    spec = resolve_sharding(strat)
    assert (spec.name, spec.mesh_ndim, spec.reshard_after_forward) == (name, ndim, reshard)


@pytest.mark.parametrize(
    "strat, world, local, replicate, shape",
    [
        ("FULL_SHARD", 8, 8, None, (8,)),
        ("NO_SHARD", 4, 4, None, (4, 1)),
        ("HYBRID_SHARD", 16, 8, None, (2, 8)),  # replicas default to the number of nodes
        ("HYBRID_SHARD", 16, 8, 4, (4, 4)),
        ("HYBRID_SHARD_ZERO2", 4, 2, None, (2, 2)),
    ],
)
def test_mesh_shapes(strat, world, local, replicate, shape):
    assert mesh_shape(resolve_sharding(strat), world, local_world_size=local, replicate_size=replicate) == shape


@pytest.mark.parametrize(
    ("strat", "mp", "kwargs", "engine", "why"),
    [
        ("NO_SHARD", "fp32", {}, "replicate", "DDP's engine"),
        ("NO_SHARD", "bf16", {}, "replicate", "autocast(bfloat16)"),
        ("NO_SHARD", "fp16", {}, "fully_shard", "mp casts"),
        ("NO_SHARD", MixedPrecisionPolicy(param_dtype=torch.bfloat16), {}, "fully_shard", "mp casts"),
        ("NO_SHARD", "bf16", {"cpu_offload": True}, "fully_shard", "cpu_offload"),
        ("NO_SHARD", "fp32", {"cpu_offload": True}, "fully_shard", "cpu_offload"),
        ("NO_SHARD", "fp32", {"has_ignored": True}, "fully_shard", "ignored"),
        ("NO_SHARD", "fp32", {"mesh_given": True}, "fully_shard", "mesh"),
        ("NO_SHARD", "fp32", {"has_trainable": False}, "fully_shard", "no parameter requires a gradient"),
        ("FULL_SHARD", "fp32", {}, "fully_shard", "FULL_SHARD shards"),
        ("HYBRID_SHARD", "fp32", {}, "fully_shard", "HYBRID_SHARD shards"),
    ],
)
def test_engine_choice(strat, mp, kwargs, engine, why):
    got, reason = choose_engine(resolve_sharding(strat), resolve_mixed_precision(mp), **kwargs)
    assert got == engine and why in reason, (got, reason)
    # the engine it names implements the whole seam consumers call (zeta_fsdp.engines)
    module = engine_named(got)
    missing = [name for name in SEAM if not hasattr(module, name)]
    assert not missing and module.__name__ == f"zeta_fsdp.engines.{got}", (module.__name__, missing)


def seam_mismatches(module: types.ModuleType) -> list[str]:
    """Where ``module`` departs from the ``Engine`` protocol: a missing name, or a function whose
    parameters (names, kinds, defaults, annotations) or return annotation differ from the protocol's."""
    found = []
    for name in SEAM:
        if not hasattr(module, name):
            found.append(f"{name}: missing")
            continue
        wanted = getattr(Engine, name, None)
        if wanted is None:  # a constant: its declared type
            if not isinstance(getattr(module, name), eval(Engine.__annotations__[name])):
                found.append(f"{name}: not a {Engine.__annotations__[name]}")
            continue
        protocol = inspect.signature(wanted)
        protocol = protocol.replace(parameters=list(protocol.parameters.values())[1:])  # drop self
        got = inspect.signature(getattr(module, name))
        if got != protocol:
            found.append(f"{name}{got} != {name}{protocol}")
    return found


def test_engines_implement_the_protocol_signatures():
    # both engines, every function with the protocol's exact signature: a changed one fails here
    assert SEAM and "wrap" in SEAM and "plan_costs" in SEAM
    for engine in (fully_shard_engine, replicate_engine):
        assert seam_mismatches(engine) == [], (engine.__name__, seam_mismatches(engine))
    # the check itself can fail: a module whose wrap takes the old positionals, and one missing a name
    drifted = types.ModuleType("drifted")
    vars(drifted).update({n: getattr(replicate_engine, n) for n in SEAM})
    drifted.wrap = lambda model, plan, device, mp_policy, *_: 0
    del drifted.plan_accumulation
    problems = seam_mismatches(drifted)
    assert len(problems) == 2 and problems[0].startswith("wrap(") and problems[1] == "plan_accumulation: missing"


def test_only_choose_engine_names_an_engine_outside_engines(tmp_path):
    # The engine seam: outside engines/, one place chooses an engine by name (options.choose_engine,
    # documented there); everything else asks engines/ (engine_of, engine_named, DEFAULT_ENGINE).
    import ast
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("code_stats", root / "scripts" / "code_stats.py")
    code_stats = importlib.util.module_from_spec(spec)
    sys.modules["code_stats"] = code_stats  # its dataclasses look their module up
    try:
        spec.loader.exec_module(code_stats)
    finally:
        del sys.modules["code_stats"]
    hits = dict(h.split(":") for h in code_stats.engine_mentions(root / "zeta_fsdp", root))
    assert list(hits) == ["zeta_fsdp/options.py"], hits
    tree = ast.parse((root / "zeta_fsdp" / "options.py").read_text())
    chooser = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "choose_engine")
    lines = [int(n) for n in hits["zeta_fsdp/options.py"].split(",")]
    assert all(chooser.lineno <= n <= chooser.end_lineno for n in lines), lines
    # the check can fail: a module branching on an engine's name is found
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text('def f(name):\n    return name == "replicate"\n')
    assert code_stats.engine_mentions(tmp_path / "pkg", tmp_path) == ["pkg/mod.py:2"]
    assert engine_named(DEFAULT_ENGINE) is fully_shard_engine


def test_reshard_after_forward_values():
    assert validate_reshard_after_forward(None, 4) is None
    assert validate_reshard_after_forward(False, 4) is False
    assert validate_reshard_after_forward(2, 4) == 2
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 .*divides the shard group size \(4\).*\[1, 2, 4\]"):
        validate_reshard_after_forward(3, 4)
    with pytest.raises(ValueError, match="reshard_after_forward='yes'"):
        validate_reshard_after_forward("yes", 4)


def test_prefetch_and_keep_tail_values():
    assert validate_prefetch(None) is None
    assert validate_prefetch(1) == 1 and validate_prefetch(3) == 3
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"prefetch={bad!r} is not accepted. Accepted: None .* or an int >= 1"):
            validate_prefetch(bad)
    assert validate_keep_tail_unsharded(False) == 0 and validate_keep_tail_unsharded(True) == 1
    assert validate_keep_tail_unsharded(0) == 0 and validate_keep_tail_unsharded(2) == 2
    for bad in (-1, 1.0, "head", None):
        with pytest.raises(ValueError, match=rf"keep_tail_unsharded={bad!r} is not accepted. Accepted: False/0"):
            validate_keep_tail_unsharded(bad)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


BAD_CALLS = [
    (dict(mp="fp8"), ["mp='fp8'", "'bf16'", "'fp16'", "'fp32'", "MixedPrecisionPolicy"]),
    (dict(mp=3), ["mp=3", "'bf16'"]),
    (
        dict(shard_strat="ZERO_SHARD"),
        [
            "shard_strat='ZERO_SHARD'",
            "'FULL_SHARD'",
            "'SHARD_GRAD'",
            "'NO_SHARD'",
            "'HYBRID_SHARD'",
            "'HYBRID_SHARD_ZERO2'",
        ],
    ),
    (dict(shard_strat="FULL_SHARD", reshard_after_forward=3), ["reshard_after_forward=3", "divides"]),
    (dict(shard_strat="FULL_SHARD", reshard_after_forward=0), ["reshard_after_forward=0"]),
    (
        dict(auto_wrap=True, TransformerBlock="DecoderLayer"),
        ["TransformerBlock='DecoderLayer'", "matches no submodule of GPT", "Block"],
    ),
    (
        dict(auto_wrap=True, TransformerBlock=nn.TransformerEncoderLayer),
        ["TransformerEncoderLayer", "matches no submodule"],
    ),
    (dict(auto_wrap=True, TransformerBlock=42), ["TransformerBlock=42", "class name string"]),
    (dict(auto_wrap="yes"), ["auto_wrap='yes'", "True or False"]),
    (dict(shard_strat="HYBRID_SHARD", replicate_size=3), ["replicate_size=3", "divide the world size 1"]),
    (dict(shard_strat="FULL_SHARD", replicate_size=2), ["replicate_size=2", "only applies to HYBRID"]),
    (dict(compile="max"), ["compile='max'"]),
    (dict(compile={"bogus": 1}, auto_wrap=True), ["'bogus'", "'backend'", "'mode'"]),
    (dict(device="gpu"), ["device='gpu'", "'cuda:N'"]),
    (dict(auto_wrap=True, shard_strat="FULL_SHARD", prefetch=0), ["prefetch=0", "None", "int >= 1"]),
    (dict(auto_wrap=True, shard_strat="FULL_SHARD", prefetch="auto"), ["prefetch='auto'", "int >= 1"]),
    (
        dict(auto_wrap=True, shard_strat="FULL_SHARD", keep_tail_unsharded=-1),
        ["keep_tail_unsharded=-1", "False/0", "True/1", "int n >= 0"],
    ),
    (dict(shard_strat="NO_SHARD", replicate_size=2), ["replicate_size=2", "does not apply to NO_SHARD"]),
]
if not torch.cuda.is_available():
    BAD_CALLS.append((dict(device="cuda"), ["device='cuda'", "CUDA is not available"]))


@pytest.mark.parametrize("kwargs, fragments", BAD_CALLS, ids=[str(k) for k, _ in BAD_CALLS])
def test_bad_input_is_a_clear_error_and_changes_nothing(kwargs, fragments):
    torch.manual_seed(0)
    model = small()
    before = _snapshot(model)
    with pytest.raises(ValueError) as err:
        fsdp(model, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} missing from: {err.value}"
    assert not dist.is_initialized(), "a process group was started before validation failed"
    after = _snapshot(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert type(model).__name__ == "GPT", "model class was swapped"


def test_incomplete_launcher_environment_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    model = small()
    with pytest.raises(ValueError, match=r"sets \['RANK', 'WORLD_SIZE'\] but not \['MASTER_ADDR', 'MASTER_PORT'\]"):
        fsdp(model, shard_strat="FULL_SHARD")
    assert not dist.is_initialized()


def test_mixed_dtypes_in_one_unit_is_a_clear_error():
    # Only when the user keeps each parameter's dtype (master_dtype=None): by default the
    # floating-point parameters are all stored in fp32 and the unit is uniform.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    reference = copy.deepcopy(model)
    with pytest.raises(
        ValueError, match=r"mixes trainable parameter dtypes \(float32: 0.weight, 0.bias; bfloat16: 1.weight, 1.bias\)"
    ):
        fsdp(model, shard_strat="FULL_SHARD", master_dtype=None)
    assert not dist.is_initialized()
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("bad", ["int8", torch.int32, 3])
def test_bad_master_dtype_is_refused_before_anything_changes(bad):
    model = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"master_dtype=.*Accepted"):
        fsdp(model, shard_strat="FULL_SHARD", master_dtype=bad)
    assert not dist.is_initialized()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_transformer_block_without_auto_wrap_warns():
    from zeta_fsdp.wrapping import build_wrap_plan

    with pytest.warns(UserWarning, match="only used with auto_wrap=True"):
        plan = build_wrap_plan(small(), transformer_block=Block)
    assert [u.kind for u in plan.units] == ["root"]


def test_a_container_without_forward_is_refused_before_anything_changes():
    from zeta_fsdp import is_fsdp_wrapped

    model = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"<root> is a ModuleList, which has no forward"):
        fsdp(model, shard_strat="FULL_SHARD")
    assert not dist.is_initialized() and not is_fsdp_wrapped(model)

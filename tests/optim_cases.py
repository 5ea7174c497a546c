"""Multi-rank cases for the optimizer step on local shards (issue 32), run by ``torchrun``.

The reference of the local step is the same torch implementation stepping the DTensors (the local
step turned off with ``use_local_step(opt, False)``), trained side by side on identical models and
gradients: parameters and every optimizer state entry must be bit-identical (``torch.equal``), the
state must stay DTensors, for every elementwise optimizer and variant, several param groups, an LR
scheduler, ``zero_grad(set_to_none=False)``, ``add_param_group``, GradScaler, a checkpoint round trip,
on every strategy. Where torch's DTensor path has no kernel (fused SGD / Adagrad), the reference is
the same optimizer over plain tensors of the same local values.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.optim import SGD, Adagrad, Adam, Adamax, AdamW, NAdam, RAdam, RMSprop
from worker import (
    ARGS,
    UNIT_ROUNDOFF,
    Cases,
    assert_close,
    expect_error,
    local_slice,
    rank,
    reference_backward,
    run_cases,
    tokens,
)

from zeta_fsdp import fsdp, fsdp_engine
from zeta_fsdp.models.gpt import Block, lm_loss, small
from zeta_fsdp.optim import ENV_VAR, steps_locally, use_local_step
from zeta_fsdp.state_dict import get_optimizer_state_dict, load_checkpoint, save_checkpoint
from zeta_fsdp.training import clip_grad_norm_

CASES = Cases()
case = CASES.case

# Every elementwise class with its variants (weight decay, amsgrad, maximize, nesterov, centered, ...).
CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (SGD, {"lr": 0.1}),
    (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "maximize": True}),
    (Adam, {"lr": 0.01}),
    (Adam, {"lr": 0.01, "amsgrad": True, "maximize": True, "weight_decay": 0.1}),
    (AdamW, {"lr": 0.01}),
    (AdamW, {"lr": 0.01, "amsgrad": True}),
    (Adagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1}),
    (Adagrad, {"lr": 0.1, "maximize": True}),
    (RMSprop, {"lr": 0.01}),
    (RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5, "weight_decay": 0.1, "maximize": True}),
    (Adamax, {"lr": 0.01, "weight_decay": 0.1}),
    (Adamax, {"lr": 0.01, "maximize": True}),
    (NAdam, {"lr": 0.01}),
    (NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (RAdam, {"lr": 0.01}),
    (RAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
]
IMPLS = ({"foreach": True}, {"foreach": False}, {"fused": True})
SHORT = [(AdamW, {"lr": 0.01, "weight_decay": 0.1}), (SGD, {"lr": 0.1, "momentum": 0.9}), (Adagrad, {"lr": 0.1})]


def mlp() -> nn.Module:
    """Odd sizes: uneven shards (rank 1 holds fewer rows), a bias of 5 split 3 + 2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))


def two_groups(model: nn.Module, cls: type, options: dict) -> torch.optim.Optimizer:
    """Two param groups with their own lr and weight decay."""
    first, second = list(model[0].parameters()), list(model[2].parameters())
    second_options = {"lr": options["lr"] / 2}
    if "weight_decay" in options:
        second_options["weight_decay"] = 0.0
    return cls([{"params": first}, {"params": second, **second_options}], **options)


def local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int = 3,
    scaler: Any = None,
    after: Callable = None,
    schedule: bool = True,
) -> None:
    """A few steps with an LR scheduler, alternating ``zero_grad(set_to_none=True/False)``; data per rank.
    ``schedule=False`` for ``add_param_group`` (torch's schedulers do not follow a group added later)."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    g = torch.Generator().manual_seed(10 + rank())
    for s in range(steps):
        loss = model(torch.randn(4, 7, generator=g)).square().mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=s % 2 == 0)
        if after is not None:
            after(s)


def assert_same(what: str, m1: nn.Module, o1: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer) -> None:
    """Bit-identical parameters and optimizer state, with the same types (DTensor stays DTensor)."""
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert type(p1) is type(p2), f"{what}: {name} {type(p1).__name__} vs {type(p2).__name__}"
        assert torch.equal(local(p1), local(p2)), f"{what}: parameter {name} differs"
        s1, s2 = o1.state.get(p1, {}), o2.state.get(p2, {})
        assert sorted(s1) == sorted(s2), f"{what}: state keys of {name}: {sorted(s1)} vs {sorted(s2)}"
        for key in s1:
            v1, v2 = s1[key], s2[key]
            assert type(v1) is type(v2), f"{what}: state {name}.{key}: {type(v1).__name__} vs {type(v2).__name__}"
            if isinstance(v1, DTensor):
                assert v1.placements == v2.placements and v1.shape == v2.shape, f"{what}: {name}.{key} layout"
            assert torch.equal(local(v1), local(v2)), f"{what}: state {name}.{key} differs"
    for g1, g2 in zip(o1.param_groups, o2.param_groups):
        skip = ("params", "initial_lr")  # initial_lr: set by an LR scheduler, not saved in checkpoints
        assert {k: v for k, v in g1.items() if k not in skip} == {k: v for k, v in g2.items() if k not in skip}


def side_by_side(what: str, cls: type, options: dict, wrap: dict, **train_kwargs) -> bool:
    """Local step vs torch's DTensor path; ``False`` if torch's path has no kernel for this (nothing compared)."""
    m_ref, m_loc = fsdp(mlp(), **wrap), fsdp(mlp(), **wrap)
    o_ref = use_local_step(two_groups(m_ref, cls, options), False)
    o_loc = two_groups(m_loc, cls, options)
    sharded = isinstance(next(m_loc.parameters()), DTensor)
    assert steps_locally(o_loc) == sharded and not steps_locally(o_ref), what
    try:
        train(m_ref, o_ref, **train_kwargs)
    except NotImplementedError:  # torch >= 2.11: no sharding strategy for the fused kernel
        return False
    except RuntimeError as error:  # torch 2.10 says it another way
        if "found no DeviceMesh" not in str(error):
            raise
        return False
    train(m_loc, o_loc, **train_kwargs)
    assert_same(what, m_loc, o_loc, m_ref, o_ref)
    if sharded:
        tensors = [v for st in o_loc.state.values() for v in st.values() if getattr(v, "ndim", 0) > 0]
        assert all(isinstance(v, DTensor) for v in tensors), f"{what}: optimizer state is not DTensors"
    return True


def plain_reference(what: str, cls: type, options: dict, wrap: dict) -> None:
    """Where torch's DTensor path fails (no sharding rule for the fused kernel): the local step equals
    the same optimizer over plain tensors holding this rank's local values and gradients."""
    model = fsdp(mlp(), **wrap)
    params = list(model.parameters())
    plain = [nn.Parameter(p.to_local().detach().clone()) for p in params]
    opt, ref = cls(params, **options), cls(plain, **options)
    g = torch.Generator().manual_seed(10 + rank())
    for _ in range(3):
        model(torch.randn(4, 7, generator=g)).square().mean().backward()
        for p, q in zip(params, plain):
            q.grad = p.grad.to_local().clone()
        opt.step()
        ref.step()
        opt.zero_grad()
    for p, q in zip(params, plain):
        assert torch.equal(p.to_local(), q.detach()), f"{what}: parameter differs from the plain-tensor step"
        for key, value in opt.state[p].items():
            assert torch.equal(local(value), ref.state[q][key]), f"{what}: state {key} differs"


def each_config(wrap: dict, configs: list, tag: str) -> int:
    compared = 0
    for cls, options in configs:
        for impl in IMPLS:
            if "fused" in impl and "fused" not in cls.__init__.__code__.co_varnames:
                continue
            what = f"{tag} {cls.__name__}({options}, {impl})"
            if side_by_side(what, cls, {**options, **impl}, wrap):
                compared += 1
            else:
                plain_reference(what, cls, {**options, **impl}, wrap)
    return compared


@case
def every_optimizer_full_shard():
    compared = each_config({"shard_strat": "FULL_SHARD"}, CONFIGS, "FULL_SHARD")
    # 17 configs x (foreach, single-tensor) + fused Adam/AdamW (4); fused SGD (3) and Adagrad (2) have no
    # DTensor kernel: they were checked against the plain-tensor reference instead.
    assert compared == 38, compared


@case
def strategies_and_cpu_offload():
    for tag, wrap in {
        "SHARD_GRAD_OP": {"shard_strat": "SHARD_GRAD_OP"},
        "HYBRID_SHARD 2x1": {"shard_strat": "HYBRID_SHARD", "replicate_size": 2},
        "HYBRID_SHARD 1x2": {"shard_strat": "HYBRID_SHARD", "replicate_size": 1},
        "cpu_offload": {"shard_strat": "FULL_SHARD", "cpu_offload": True},
    }.items():
        each_config(wrap, SHORT, tag)


@case
def no_shard_replicate_engine_untouched():
    """NO_SHARD on DDP's engine: plain parameters, torch's path (nothing to localize), same results."""
    model = fsdp(mlp(), shard_strat="NO_SHARD")
    assert fsdp_engine(model) == "replicate", fsdp_engine(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    assert not steps_locally(opt) and not isinstance(next(model.parameters()), DTensor)
    each_config({"shard_strat": "NO_SHARD"}, SHORT, "NO_SHARD")


@case
def add_param_group_and_grad_scaler():
    for cls, options in SHORT:
        for impl in IMPLS[:2] + (({"fused": True},) if cls is AdamW else ()):  # no DTensor fused SGD/Adagrad
            m_ref, m_loc = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
            opts, errors = [], []
            for m, on in ((m_ref, False), (m_loc, True)):
                opt = use_local_step(cls(m[0].parameters(), **options, **impl), on)

                def add(s, m=m, opt=opt):
                    return s == 1 and opt.add_param_group({"params": list(m[2].parameters())})

                try:
                    train(m, opt, steps=4, after=add, schedule=False)
                except KeyError as error:  # torch 2.10's Adagrad: a group added later gets no state ("sum")
                    errors.append(repr(error))
                opts.append(opt)
            if errors:  # then the local step fails exactly as torch's path does
                assert cls is Adagrad and errors == [errors[0]] * 2, errors
                continue
            assert_same(f"add_param_group {cls.__name__} {impl}", m_loc, opts[1], m_ref, opts[0])
            assert all(isinstance(v, DTensor) for v in opts[1].state[m_loc[2].weight].values() if v.ndim > 0)
    for impl in IMPLS:  # GradScaler: unscaling outside the step; fused AdamW reads grad_scale/found_inf inside
        m_ref, m_loc = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
        o_ref = use_local_step(AdamW(m_ref.parameters(), lr=0.01, **impl), False)
        o_loc = AdamW(m_loc.parameters(), lr=0.01, **impl)
        train(m_ref, o_ref, scaler=torch.amp.GradScaler("cpu", init_scale=64.0))
        train(m_loc, o_loc, scaler=torch.amp.GradScaler("cpu", init_scale=64.0))
        assert_same(f"GradScaler AdamW {impl}", m_loc, o_loc, m_ref, o_ref)


@case
def cached_view_follows_the_state_between_steps():
    """The local step caches its view of the state across steps: it must see what changed between them (a
    state value replaced rather than updated in place, an entry dropped, the state loaded anew, parameters
    swapped between groups inside their lists), and the state
    it creates wraps the very tensor torch made (no view) on the parameter's layout."""
    m_ref, m_loc = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
    opts = []
    for m, on in ((m_ref, False), (m_loc, True)):
        groups = [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": 0.5}]
        opt = use_local_step(AdamW(groups, lr=0.01), on)

        def edit(s: int, m: nn.Module = m, opt: torch.optim.Optimizer = opt) -> None:
            entry = opt.state[m[0].weight]
            if s == 0:  # a new DTensor in place of the stepped one, twice: the first one's freed id is reused
                entry["exp_avg"] = entry["exp_avg"] * 0.5
                entry["exp_avg"] = entry["exp_avg"] * 0.5
            elif s == 3:  # two parameters change groups (and lr) inside the groups' own lists
                first, second = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
                first[0], second[0] = second[0], first[0]
            elif s == 1:
                del opt.state[m[2].bias]  # re-created from zero at the next step
            elif s == 2:
                opt.load_state_dict(opt.state_dict())  # a new state dict and new param group lists

        train(m, opt, steps=5, after=edit)
        opts.append(opt)
    assert_same("state edited between steps", m_loc, opts[1], m_ref, opts[0])
    for p in m_loc.parameters():
        for key, value in opts[1].state[p].items():
            if value.ndim > 0:
                assert value._spec == p._spec and not value._local_tensor._is_view(), f"{key}: a view or another layout"


@case
def user_lists_and_reset_momentum_survive_local_steps():
    """A param group given a new list of the same parameters keeps that very list (a parameter appended to it
    later is stepped), and SGD momentum reset to ``None`` is re-created as DTensor state, as on torch's path."""
    runs = []
    for on in (False, True):
        m = fsdp(mlp(), shard_strat="FULL_SHARD")
        params = [p for name, p in m.named_parameters() if name != "2.bias"]
        opt = use_local_step(SGD([{"params": params}], lr=0.1, momentum=0.9), on)
        mine = []

        def edit(s: int, m: nn.Module = m, opt: torch.optim.Optimizer = opt, mine: list = mine) -> None:
            if s == 0:
                mine.extend(opt.param_groups[0]["params"])
                opt.param_groups[0]["params"] = mine  # same parameters, the user's own list
            elif s == 1:
                mine.append(m[2].bias)
                for entry in opt.state.values():
                    entry["momentum_buffer"] = None

        train(m, opt, steps=4, after=edit, schedule=False)
        assert opt.param_groups[0]["params"] is mine, "the group's list is the one the user gave it"
        runs.append((m, opt))
    assert_same("user lists, momentum reset", *runs[1], *runs[0])
    assert all(isinstance(e["momentum_buffer"], DTensor) for e in runs[1][1].state.values()), "momentum state"


@case
def checkpoint_round_trip():
    """State saved from local steps = state of torch's path; a checkpoint saved after local steps and
    loaded (get_optimizer_state_dict / save_checkpoint / load_checkpoint) continues bit-identically."""
    path = Path(ARGS.out) / "ckpt"
    m_ref, m_loc = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
    o_ref = use_local_step(AdamW(m_ref.parameters(), lr=0.01, weight_decay=0.1), False)
    o_loc = AdamW(m_loc.parameters(), lr=0.01, weight_decay=0.1)
    train(m_ref, o_ref, steps=2)
    train(m_loc, o_loc, steps=2)
    full_ref = get_optimizer_state_dict(m_ref, o_ref, full=True)
    full_loc = get_optimizer_state_dict(m_loc, o_loc, full=True)
    assert repr(sorted(full_ref)) == repr(sorted(full_loc))
    for key in full_ref:
        a, b = full_ref[key], full_loc[key]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f"full optimizer state {key}"
    save_checkpoint(path, m_loc, o_loc, overwrite=True)
    m_new = fsdp(nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5)), shard_strat="FULL_SHARD")
    o_new = AdamW(m_new.parameters(), lr=0.01, weight_decay=0.1)
    load_checkpoint(path, m_new, o_new)
    assert all(isinstance(v, DTensor) for st in o_new.state.values() for v in st.values() if v.ndim > 0)
    for m, o in ((m_ref, o_ref), (m_new, o_new)):
        g = torch.Generator().manual_seed(99 + rank())
        m(torch.randn(4, 7, generator=g)).square().mean().backward()
        o.step()
    assert steps_locally(o_new)
    assert_same("after load_checkpoint", m_new, o_new, m_ref, o_ref)


@case
def clip_grad_norm_one_all_reduce():
    """clip_grad_norm_ on fsdp() models: ONE all-reduce for every parameter (CommDebugMode), the norm and
    the clipped gradients equal torch's on the single-process reference (bound as in steps_cases.py)."""
    for wrap in ({"shard_strat": "FULL_SHARD"}, {"shard_strat": "HYBRID_SHARD", "replicate_size": 1}):
        torch.manual_seed(0)
        plain = small()
        ref = copy.deepcopy(plain)
        model = fsdp(plain, auto_wrap=True, TransformerBlock=Block, **wrap)
        x, y = tokens(4, seed=3)
        reference_backward(ref, lm_loss, x, y)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-2).item()
        comm = CommDebugMode()
        with comm:
            got = clip_grad_norm_(model, 1e-2)
        counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        assert sum(counts.values()) == 1 and "allreduce" in str(counts), f"{wrap}: collectives {counts}"
        assert abs(got - want) <= 20 * UNIT_ROUNDOFF * want, f"{wrap}: norm {got} vs torch {want}"
        for name, p in ref.named_parameters():
            assert_close(f"{wrap} clipped {name}", model.get_parameter(name).grad, p.grad, 8 * UNIT_ROUNDOFF * want)


@case
def default_implementation_is_the_plain_tensors_one():
    """With ``foreach`` and ``fused`` left at None, torch picks the implementation from the parameters' type and
    device (foreach on CUDA for plain tensors and DTensors, single-tensor on CPU). The local step hands torch
    aliases of the shards: they must get the choice plain tensors get. CPU is made a foreach device here, so
    torch's path on the DTensors and the local step must both run the multi-tensor functions, bit for bit."""
    import torch.optim.adam as adam_module
    import torch.optim.optimizer as optimizer_module
    import torch.optim.sgd as sgd_module

    saved = optimizer_module._get_foreach_kernels_supported_devices, adam_module._multi_tensor_adam
    saved_sgd, ran = sgd_module._multi_tensor_sgd, []

    def spy(name: str, fn: Callable) -> Callable:
        return lambda params, *args, **kwargs: ran.append((name, type(params[0]))) or fn(params, *args, **kwargs)

    optimizer_module._get_foreach_kernels_supported_devices = lambda: ["cpu", *saved[0]()]
    adam_module._multi_tensor_adam = spy("adam", saved[1])
    sgd_module._multi_tensor_sgd = spy("sgd", saved_sgd)
    try:
        for cls, options in ((Adam, {"lr": 0.01}), (SGD, {"lr": 0.1, "momentum": 0.9})):
            ran.clear()
            assert side_by_side(f"default {cls.__name__}", cls, options, {"shard_strat": "FULL_SHARD"})
            kinds = {t.__name__ for _, t in ran}
            # the first local step through torch's step on the aliases, the later ones its functional call
            assert len(ran) == 12 and kinds == {"DTensor", "LocalParam", "Tensor"}, f"{cls.__name__}: ran {ran}"
    finally:
        optimizer_module._get_foreach_kernels_supported_devices, adam_module._multi_tensor_adam = saved
        sgd_module._multi_tensor_sgd = saved_sgd


class WithFrozen(nn.Module):
    """``mlp()`` and a frozen layer: its parameters get no gradient (an unused one would get zeros from FSDP2)."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.frozen = mlp(), nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _closure(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator, edit: Optional[str]) -> Callable:
    """A training closure that first adds the model's last layer as a group or drops a parameter (``edit``)."""

    def closure() -> torch.Tensor:
        if edit == "add":
            opt.add_param_group({"params": list(model[2].parameters())})
        elif edit == "remove":
            opt.param_groups[0]["params"].pop()
        opt.zero_grad()
        loss = model(torch.randn(4, 7, generator=g)).square().mean()
        loss.backward()
        return loss

    return closure


@case
def functional_call_after_the_first_step():
    """From its second step on, the local step calls torch's functional implementation itself (no ``_init_group``
    loop); where that is not what torch's step would do it runs torch's own step on the aliases: a parameter without
    a gradient, a tensor lr, a torch release not compared with the calls. Bit for bit as torch's path either way."""
    from zeta_fsdp.optim import functional_step

    def counting(cls: type) -> Callable:
        own = cls.__dict__["_init_group"]
        cls._init_group = lambda self, *a: calls.append(id(self)) or own(self, *a)
        return lambda: setattr(cls, "_init_group", own)

    def run(cls: type, options: dict, make: Callable = mlp, groups: bool = True) -> tuple[int, int]:
        """Calls of ``_init_group`` in three steps: (local step, torch's path)."""
        m_ref, m_loc = fsdp(make(), shard_strat="FULL_SHARD"), fsdp(make(), shard_strat="FULL_SHARD")

        def build(m: nn.Module) -> torch.optim.Optimizer:  # a tensor lr of its own: the scheduler updates it in place
            own = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
            return two_groups(m, cls, own) if groups else cls(m.parameters(), **own)

        o_ref, o_loc = use_local_step(build(m_ref), False), build(m_loc)
        calls.clear()
        train(m_ref, o_ref)
        train(m_loc, o_loc)
        assert_same(f"{cls.__name__} {options}", m_loc, o_loc, m_ref, o_ref)
        return calls.count(id(o_loc)), calls.count(id(o_ref))

    # A closure that changes the param groups (add_param_group in a Lightning training_step): stepped as changed.
    for edit in ("add", "remove"):
        pair = []
        for on in (False, True):
            model = fsdp(mlp(), shard_strat="FULL_SHARD")
            opt = use_local_step(Adam(model[0].parameters(), lr=0.01), on)
            g = torch.Generator().manual_seed(3 + rank())
            for s in range(4):
                opt.step(_closure(model, opt, g, edit if s == 2 else None))
            pair += [model, opt]
        assert_same(f"closure that changes the groups ({edit})", pair[2], pair[3], pair[0], pair[1])

    calls: list = []
    restores = [
        counting(cls) for cls in (SGD, Adam, AdamW, RMSprop) if "_init_group" in cls.__dict__
    ]  # AdamW's may be Adam's
    try:
        # once (per group) at the first step, which creates the state; torch's path every step
        assert run(Adam, {"lr": 0.01, "foreach": True}) == (2, 6)
        assert run(SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}) == (2, 6)
        assert run(AdamW, {"lr": 0.01, "fused": True}) == (2, 6)
        assert run(RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}) == (2, 6)
        # what only torch's step does right: every step through it
        counts = run(Adam, {"lr": 0.01}, make=WithFrozen, groups=False)  # no gradient, no state
        assert counts == (3, 3), counts
        counts = run(Adam, {"lr": torch.tensor(0.01), "foreach": False}, groups=False)
        assert counts == (3, 3), counts
        verified, functional_step._VERIFIED = functional_step._VERIFIED, False
        try:
            counts = run(SGD, {"lr": 0.1, "momentum": 0.9}, groups=False)
            assert counts == (3, 3), counts
        finally:
            functional_step._VERIFIED = verified
    finally:
        for restore in restores:
            restore()


class MyAdamW(AdamW):
    """A user's subclass: its step may look across elements, so it keeps torch's path."""


@case
def bad_input_and_excluded_optimizers():
    model = mlp()
    early = AdamW(model.parameters(), lr=0.01)
    model = fsdp(model, shard_strat="FULL_SHARD")
    model(torch.randn(2, 7)).sum().backward()
    expect_error(ValueError, early.step, "from before fsdp() wrapped it", "Build the optimizer after wrapping")
    other = fsdp(mlp(), shard_strat="HYBRID_SHARD", replicate_size=1)  # a 2-D mesh
    mixed = AdamW(list(model.parameters()) + list(other.parameters()), lr=0.01)
    expect_error(ValueError, mixed.step, "different device meshes", "one optimizer per model")
    same_mesh = fsdp(mlp(), shard_strat="FULL_SHARD")  # two models on equal meshes: fine
    together = AdamW(list(model.parameters()) + list(same_mesh.parameters()), lr=0.01)
    assert steps_locally(together)
    together.step()
    # Not elementwise or not plain: torch's path, same numbers as the off switch.
    for make in (lambda m: MyAdamW(m.parameters(), lr=0.01), lambda m: torch.optim.LBFGS(m.parameters())):
        assert not steps_locally(make(fsdp(mlp(), shard_strat="FULL_SHARD")))
    m_ref, m_sub = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
    o_ref, o_sub = use_local_step(AdamW(m_ref.parameters(), lr=0.01), False), MyAdamW(m_sub.parameters(), lr=0.01)
    seen = []
    o_sub.register_step_pre_hook(lambda opt, args, kwargs: seen.append(type(opt.param_groups[0]["params"][0])))
    train(m_ref, o_ref)
    train(m_sub, o_sub)
    assert_same("user subclass", m_sub, o_sub, m_ref, o_ref)
    # A closure (how Lightning steps): called first, as torch's step calls it, then the local step; the same
    # numbers and loss as torch's path. Hooks still see DTensors.
    m_cl, m_cl_ref = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
    o_cl, o_cl_ref = AdamW(m_cl.parameters(), lr=0.01), use_local_step(AdamW(m_cl_ref.parameters(), lr=0.01), False)
    o_cl.register_step_pre_hook(lambda opt, args, kwargs: seen.append(type(opt.param_groups[0]["params"][0])))
    x = torch.randn(4, 7)
    import torch.optim.adam as adam_module

    functional, stepped = adam_module.adam, []
    adam_module.adam = lambda params, *a, **k: stepped.append(type(params[0]).__name__) or functional(params, *a, **k)
    try:
        for _ in range(2):
            with TypesSeen() as types:  # a user's mode around the step: both local paths run under it
                loss = o_cl.step(lambda: m_cl(x).square().mean().backward() or torch.tensor(1.5))
            assert loss.item() == 1.5 and types, (loss, types)
            assert o_cl_ref.step(closure=lambda: m_cl_ref(x).square().mean().backward()) is None
    finally:
        adam_module.adam = functional
    # the first step through torch's step on the aliases, the second its functional call on the shards
    assert stepped == ["LocalParam", "DTensor", "Tensor", "DTensor"], stepped
    assert_same("closure", m_cl, o_cl, m_cl_ref, o_cl_ref)
    assert seen and all(t is DTensor for t in seen), seen
    for off in ("0", "false", " OFF", "no"):
        os.environ[ENV_VAR] = off
        try:
            assert not steps_locally(o_cl), off
        finally:
            del os.environ[ENV_VAR]
    os.environ[ENV_VAR] = "maybe"
    try:
        expect_error(ValueError, o_cl.step, f"{ENV_VAR}='maybe'", "0 / false / off / no")
    finally:
        del os.environ[ENV_VAR]
    assert steps_locally(o_cl)
    o_cl.param_groups[0]["differentiable"] = True  # set after steps: torch's path from then on
    assert not steps_locally(o_cl)
    o_cl.param_groups[0]["differentiable"] = False
    assert steps_locally(o_cl)
    expect_error(ValueError, lambda: use_local_step(o_cl, "yes"), "True or False")
    expect_error(ValueError, lambda: use_local_step(m_cl, False), "not the model")

    class Wrapper(AdamW):  # like accelerate's AcceleratedOptimizer: an Optimizer holding the one that steps
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    use_local_step(Wrapper(o_cl), False)
    assert not steps_locally(o_cl)
    use_local_step(o_cl, True)
    use_local_step(type("Holder", (), {"optimizer": o_cl})(), False)  # a wrapper that is no Optimizer itself
    assert not steps_locally(o_cl)


class TypesSeen(torch.overrides.TorchFunctionMode):
    """The tensor types torch functions saw while active (a user's mode around ``step()``)."""

    def __enter__(self) -> set:
        self.names: set = set()
        super().__enter__()
        return self.names

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.update(t.__name__ for t in types)
        return func(*args, **(kwargs or {}))


class Wrapped(torch.Tensor):
    """A shard with its own dispatch (the shape of torchao's float8 weights): unwraps, runs, rewraps views."""

    @staticmethod
    def __new__(cls, t: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, t.shape, strides=t.stride(), dtype=t.dtype, device=t.device)

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __tensor_flatten__(self) -> tuple:
        return ["_t"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> Wrapped:
        return Wrapped(inner["_t"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        from torch.utils._pytree import tree_map

        out = func(*tree_map(lambda x: x._t if isinstance(x, Wrapped) else x, (args, kwargs or {}))[0], **kwargs or {})
        if func._schema.is_mutable and isinstance(args[0], Wrapped):
            return args[0]
        views = ("detach", "alias", "view", "slice", "split", "chunk", "narrow", "new_zeros", "zeros_like", "clone")
        if func.__name__.split(".")[0] in views:
            return tree_map(lambda x: Wrapped(x) if isinstance(x, torch.Tensor) else x, out)
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl


def _pair() -> tuple:
    """An fsdp() model with AdamW stepping locally, and an identical one on torch's path."""
    m, m_ref = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
    return m, AdamW(m.parameters(), lr=0.01), m_ref, use_local_step(AdamW(m_ref.parameters(), lr=0.01), False)


@case
def changed_between_steps_or_by_hand():
    """What a user changes between steps or puts in by hand: the local step follows torch's path, and the old
    shards and state it cached are not held."""
    import gc
    import weakref

    from torch.distributed.tensor import Replicate

    # A state DTensor given a new local tensor in place (torch.utils.swap_tensors): the next steps update it.
    m, o, m_ref, o_ref = _pair()
    for model, opt in ((m, o), (m_ref, o_ref)):
        train(model, opt, steps=1)
        for entry in opt.state.values():
            torch.utils.swap_tensors(entry["exp_avg"], entry["exp_avg"].clone())
        train(model, opt, steps=2)
    assert_same("swap_tensors on state", m, o, m_ref, o_ref)
    # FSDP2 gives the parameters new local tensors (what model.to(...) does): the old shards are freed at once,
    # not kept by the cached view until the next step. load_state_dict: the old state goes with the view.
    m, o, _, _ = _pair()
    train(m, o, steps=3)  # the later steps through the functional call
    shards = [weakref.ref(p._local_tensor) for p in m.parameters()]  # to_local() returns a new view each call
    m._apply(lambda t: t.clone())
    gc.collect()
    assert all(r() is None for r in shards), "old shards are still held after the parameters were replaced"
    old_state = [weakref.ref(v._local_tensor) for st in o.state.values() for v in st.values() if isinstance(v, DTensor)]
    o.load_state_dict(copy.deepcopy(o.state_dict()))
    gc.collect()
    assert old_state and all(r() is None for r in old_state), "the old optimizer state is held after loading"
    train(m, o, steps=1)
    # State laid out unlike its parameter (put in by hand): torch's path (it redistributes, or raises the same
    # error on every rank), never the local tensor of another layout.
    m, o, m_ref, o_ref = _pair()
    outcomes = []
    for model, opt in ((m, o), (m_ref, o_ref)):
        train(model, opt, steps=1)
        for entry in opt.state.values():
            entry["exp_avg"] = entry["exp_avg"].redistribute(placements=[Replicate()])
        try:
            train(model, opt, steps=2)
            outcomes.append("trained")
        except RuntimeError as error:
            outcomes.append(str(error).splitlines()[0])
    assert outcomes[0] == outcomes[1], outcomes
    assert_same("state laid out unlike its parameter", m, o, m_ref, o_ref)
    x = torch.randn(4, 7)
    # A shard that is itself a tensor subclass: torch's path (an alias would skip its dispatch), same numbers.
    models = []
    for on in (True, False):
        net = mlp()
        net[0].weight = nn.Parameter(Wrapped(net[0].weight.detach().clone()))
        model = fsdp(net, shard_strat="FULL_SHARD")
        opt = use_local_step(SGD(model.parameters(), lr=0.1, momentum=0.9), on)
        model(x).square().mean().backward()
        opt.step()
        models.append(model)
    assert type(models[0][0].weight.to_local()) is Wrapped
    assert not steps_locally(SGD(models[0].parameters(), lr=0.1))
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        la, lb = local(a), local(b)
        assert torch.equal(getattr(la, "_t", la), getattr(lb, "_t", lb)), "a subclass shard stepped differently"
    # A plain-dict state (restored by hand) and parameters without state (a group added later): KeyError as on
    # torch's path, with the same updates before it.
    m, o, m_ref, o_ref = _pair()
    extras = fsdp(mlp(), shard_strat="FULL_SHARD"), fsdp(mlp(), shard_strat="FULL_SHARD")
    for model, opt, extra in ((m, o, extras[0]), (m_ref, o_ref, extras[1])):
        train(model, opt, steps=1)
        opt.state = dict(opt.state)
        opt.add_param_group({"params": list(extra.parameters())})
        (model(x).square().mean() + extra(x).square().mean()).backward()
        message = expect_error(KeyError, opt.step)
        assert "DTensor" in message and "LocalParam" not in message, message
    assert steps_locally(o) and not steps_locally(o_ref)
    assert_same("plain-dict state", m, o, m_ref, o_ref)
    assert all(torch.equal(local(a), local(b)) for a, b in zip(extras[0].parameters(), extras[1].parameters()))


if __name__ == "__main__":
    run_cases(CASES)

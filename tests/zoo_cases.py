"""Parity zoo on 2 gloo ranks: each model's losses every step and weights after training equal a
single-process reference, bit for bit.

Why exact equality is the right bar (and holds on any CPU kernel set): the reference is a
``copy.deepcopy`` made before wrapping that runs the SAME per-rank computations: for each step it
runs forward/backward on rank 0's slice, then on rank 1's slice, accumulating into ``.grad``
(``0 + g0``, then ``g0 + g1``), then divides by 2. FSDP computes ``g0`` and ``g1`` on the two ranks
with the same kernels on the same all-gathered weights and the same inputs, reduce-scatters
``g0 + g1`` (a sum of two floats is commutative, so the order does not matter) and divides by 2
(exact, a power of two). The optimizer then does the same elementwise arithmetic on a shard as
on the full tensor. Every operand is identical, so every result is; ``ATEN_CPU_CAPABILITY``
changes the kernels on both sides alike.

Where the zoo entry says ``exact=False`` (T5) FSDP's backward hooks change the order in which
autograd sums some gradient contributions, so each gradient element may differ by the rounding
of a reordered fp32 sum: at most ``(k - 1) * 2**-24 * sum|terms|`` for ``k`` terms. There we
train with SGD (linear in the gradient, so that difference is not amplified the way Adam's
normalisation amplifies it for near-zero gradients): weights move by ``lr * dgrad``; with
``k <= 4``, ``sum|terms| < 4`` (mean losses of O(1) over the batch), lr=1e-2 and 3 steps that is
``3 * 1e-2 * 3 * 6e-8 * 4 < 3e-8``, and the loss moves by at most ``|grad| * |dw|`` summed over
the parameters (< 1e-6 for these ~50k-parameter models). We assert 1e-6 on weights and 1e-5
on losses, both above those bounds with margin for the second-order feedback of three steps,
and still far below the ~lr = 1e-2 a wrong gradient moves a weight by.
"""

from __future__ import annotations

import copy

import torch
from worker import Cases, assert_losses_match, full, rank, run_cases, world
from zoo_models import ZOO

from zeta_fsdp import fsdp, get_wrap_plan

CASES = Cases()
STEPS, PER_RANK = 3, 2


def _slice(batch: dict, index: int) -> dict:
    return {
        k: v[index * PER_RANK : (index + 1) * PER_RANK] if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def zoo_parity(name: str, entry=None) -> None:
    """Train ``ZOO[name]`` (or ``entry``) on every rank and on a single-process reference; assert
    the units, every loss and every weight (see the module docstring for the tolerances)."""
    entry = entry or ZOO[name]
    torch.manual_seed(0)
    model = entry.build().eval()  # eval: no dropout/layerdrop/masking, gradients still flow
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")
    got_units = [u.name for u in get_wrap_plan(model).units]
    assert got_units == entry.units, f"units {got_units} != {entry.units}"
    make_opt = torch.optim.AdamW if entry.exact else torch.optim.SGD
    opt = make_opt(model.parameters(), lr=1e-2)
    ref_opt = make_opt(ref.parameters(), lr=1e-2)
    loss_tol, weight_tol = (0.0, 0.0) if entry.exact else (1e-5, 1e-6)  # see the module docstring
    for step in range(STEPS):
        batch = entry.batch(step, PER_RANK * world())
        ref_losses = []
        for r in range(world()):  # rank order: the order the reduce-scatter sums in
            loss_r = entry.loss(ref, _slice(batch, r))
            loss_r.backward()
            ref_losses.append(loss_r.detach())
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.div_(world())
        ref_opt.step()
        ref_opt.zero_grad()
        loss = entry.loss(model, _slice(batch, rank()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        # step 0: same weights, same kernels -> always exact
        assert_losses_match(loss, ref_losses, step, 0.0 if step == 0 else loss_tol)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), "parameter names changed"
    for n, p in model.named_parameters():
        got, want = full(p).detach(), ref_params[n].detach()
        err = (got.double() - want.double()).abs().max().item()
        assert got.dtype == want.dtype and err <= weight_tol, f"{n}: max abs diff {err:.3e} > {weight_tol:.0e}"
    # ties survive: one object per tied group, as in the reference
    ref_ties = {id(p) for p in ref.parameters()}
    assert len({id(p) for p in model.parameters()}) == len(ref_ties)


@CASES.case
def master_weights_fp32_for_a_bf16_model():
    """bf16-loaded model + mp="bf16": fp32 shards and AdamW state, bf16 compute, exact parity.

    Reference with the same policy semantics, by hand: fp32 masters (the deepcopy, upcast); each
    rank-sized chunk runs on a copy whose parameters are cast to bf16 (buffers untouched: FSDP
    casts only parameters), its bf16 gradients are upcast and accumulated in rank order, then
    divided by 2: what FSDP's fp32 reduce-scatter does. Every operand is the same, so exact.
    """
    from worker import global_batch, local_slice

    from zeta_fsdp import memory_report
    from zeta_fsdp.models.gpt import lm_loss, small

    torch.manual_seed(0)
    model = small().to(torch.bfloat16)  # what from_pretrained(dtype="auto") gives for a bf16 file
    ref = copy.deepcopy(model).float()  # the masters: bf16 values, exactly representable in fp32
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "masters are not fp32"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = global_batch(step)
        ref_losses = []
        for r in range(world()):
            compute = copy.deepcopy(ref)
            for p in compute.parameters():
                p.data = p.data.to(torch.bfloat16)
            loss_r = lm_loss(compute(local_slice(x, index=r)), local_slice(y, index=r))
            loss_r.backward()
            ref_losses.append(loss_r.detach())
            for p, c in zip(ref.parameters(), compute.parameters()):
                g = c.grad.float()
                p.grad = g if p.grad is None else p.grad + g
        for p in ref.parameters():
            p.grad.div_(world())
        ref_opt.step()
        ref_opt.zero_grad()
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        assert loss.dtype == torch.bfloat16, f"compute is not bf16: {loss.dtype}"
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert_losses_match(loss, ref_losses, step)
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(full(p), ref_params[n]), f"{n} differs from the reference"
    states = [t for st in opt.state.values() for k, t in st.items() if k != "step"]
    assert states and {t.dtype for t in states} == {torch.float32}, "optimizer state is not fp32"
    report = memory_report(model, opt)
    assert report["params"]["dtypes"] == ["float32"] and report["optimizer_state"]["dtypes"] == ["float32"]
    assert "master weights float32; optimizer state float32" in report.table()
    # the documented opt-out: pure bf16 training keeps bf16 shards
    low = small().to(torch.bfloat16)
    fsdp(low, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", master_dtype=None)
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}


@CASES.case
def failed_validation_leaves_the_model_unwrapped_and_a_retry_works():
    from zeta_fsdp import is_fsdp_wrapped

    torch.manual_seed(0)
    model = ZOO["clip"].build().eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock="NoSuchLayer")
    except ValueError as err:
        assert "NoSuchLayer" in str(err), err
    else:
        raise AssertionError("a TransformerBlock matching nothing must raise")
    assert not is_fsdp_wrapped(model), "half-wrapped after an error"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "changed before raising"
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")  # the retry
    assert is_fsdp_wrapped(model) and model.logit_scale.dim() == 0
    loss = ZOO["clip"].loss(model, ZOO["clip"].batch(0, 2))
    loss.backward()
    assert model.logit_scale.grad is not None and torch.isfinite(model.logit_scale.grad)


class _Scale(torch.nn.Module):
    """Holds a parameter and has no reset_parameters(): only a model-wide init can fill it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


class _PartialInit(torch.nn.Module):
    """Its init_weights() refills only a buffer: ``scale.weight`` is left to nobody."""

    def __init__(self, overwrite_linear: bool = False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = _Scale()
        self.register_buffer("offset", torch.zeros(4))
        self.overwrite_linear = overwrite_linear

    def init_weights(self):
        self.offset.fill_(1.0)
        if self.overwrite_linear:
            self.lin.weight.fill_(0.5)
            self.scale.weight.fill_(2.0)

    def forward(self, x):
        return self.scale(self.lin(x)) + self.offset


@CASES.case
def meta_init_never_leaves_uninitialised_memory():
    with torch.device("meta"):
        model = _PartialInit()
    try:
        fsdp(model, shard_strat="FULL_SHARD")
    except RuntimeError as err:
        assert "scale.weight" in str(err) and "lin.weight" not in str(err), err
    else:
        raise AssertionError("a parameter nothing initialised must raise")
    # reset_parameters() first, the root's init_weights() on top: init_weights wins where it writes
    with torch.device("meta"):
        model = _PartialInit(overwrite_linear=True)
    fsdp(model, shard_strat="FULL_SHARD")
    assert torch.equal(full(model.lin.weight), torch.full((4, 4), 0.5))
    assert torch.equal(full(model.scale.weight), torch.full((4,), 2.0))
    bias = full(model.lin.bias)  # reset_parameters() drew it: uniform(-1/2, 1/2), never NaN
    assert torch.isfinite(bias).all() and bias.abs().max() <= 0.5 and bias.abs().max() > 0
    assert torch.equal(model.offset, torch.ones(4))


@CASES.case
def meta_init_runs_torch_nn_and_hugging_face_initialisers():
    """Built on meta, sharded, materialized: torch.nn's ``_reset_parameters`` (MultiheadAttention,
    nn.Transformer), Hugging Face's own init and CLIP's constructor constant (``logit_scale``)."""
    import math

    torch.manual_seed(0)
    for name in ("torch_encoder", "torch_transformer", "clip", "titan_llama"):
        with torch.device("meta"):
            model = ZOO[name].build()
        fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")  # raises if anything stayed unset
        for n, p in model.named_parameters():
            assert torch.isfinite(full(p)).all(), f"{name}: {n} not finite"
        attn = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
        for m in attn:  # MultiheadAttention._reset_parameters: xavier-uniform in_proj, zero biases
            w = full(m.in_proj_weight)
            bound = math.sqrt(6 / (w.shape[0] + w.shape[1]))
            assert torch.equal(full(m.in_proj_bias), torch.zeros_like(w[:, 0])), f"{name}: in_proj_bias"
            assert w.abs().max() <= bound and w.abs().max() > bound / 2, f"{name}: in_proj_weight not xavier"
            half = w.shape[0] // 2  # rank 0 and rank 1 drew their shards apart: no repeated block
            assert not torch.equal(w[:half], w[half : 2 * half]), f"{name}: shards drew the same numbers"
        if name == "clip":
            want = torch.tensor(model.config.logit_scale_init_value)
            assert torch.equal(model.logit_scale.detach().cpu(), want), (model.logit_scale, want)
        if name == "titan_llama":
            ref = ZOO[name].build()
            assert torch.equal(model.freqs_cis, ref.freqs_cis), "init_weights() did not refill the RoPE table"
        loss = ZOO[name].loss(model, ZOO[name].batch(0, 2))
        loss.backward()
        assert torch.isfinite(loss), f"{name}: loss {loss}"


for _name in ZOO:

    def _parity(_n: str = _name) -> None:
        zoo_parity(_n)

    _parity.__name__ = f"parity_{_name}"
    CASES.case(_parity)


if __name__ == "__main__":
    run_cases(CASES)

"""Multi-rank cases for fp32 modules (``fsdp(keep_fp32=...)``, a Hugging Face model's
``_keep_in_fp32_modules(_strict)``) and staged unfreezing. Collected by tests/test_fp32.py."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from worker import Cases, assert_close, full, global_batch, local_slice, rank, reference_backward, run_cases, world

from zeta_fsdp import fsdp
from zeta_fsdp.fsdp import fsdp_engine
from zeta_fsdp.models.gpt import Block, lm_loss, small
from zeta_fsdp.unfreeze import UnfrozenAfterWrapError

CASES = Cases()


def _record_dtypes(model: nn.Module, kinds: tuple) -> dict:
    """A forward pre-hook, registered after fsdp(), on every module of ``kinds``: the dtype of its weight
    (FSDP2 has gathered it by then) and of its first input, by module name."""
    seen: dict = {}
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, (m.weight.dtype, args[0].dtype))
            )
    return seen


class _Fp32Norms:
    """The reference's casting: a bf16 compute copy of ``ref`` (LayerNorms fp32, inputs cast up, outputs
    back to bf16), its per-rank gradients cast to fp32 and averaged, as FSDP2 reduces them in fp32."""

    def __init__(self, ref: nn.Module):
        self.ref = ref

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        comp = copy.deepcopy(self.ref)
        norms = {id(p) for m in comp.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        for p in comp.parameters():
            if id(p) not in norms:
                p.data = p.data.to(torch.bfloat16)
        for m in comp.modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_pre_hook(lambda mod, args: (args[0].float(),))
                m.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16))
        params = list(comp.parameters())
        grads = []
        for r in range(world()):
            loss = lm_loss(comp(local_slice(x, world(), r)), local_slice(y, world(), r))
            grads.append([g.float() for g in torch.autograd.grad(loss.float(), params)])
        for p, *gs in zip(self.ref.parameters(), *grads):
            p.grad = sum(gs[1:], gs[0]) / len(gs)


@CASES.case
def gpt_keep_fp32_norms_train():
    """keep_fp32=[nn.LayerNorm] under bf16, FULL_SHARD: norms see fp32 weights and inputs, Linears
    bf16; 3 AdamW steps equal a reference doing the same casting; state dict keys and dtypes as without."""
    torch.manual_seed(0)
    model = small()
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block, keep_fp32=[nn.LayerNorm])
    seen = _record_dtypes(model, (nn.LayerNorm, nn.Linear))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    shadow = _Fp32Norms(ref)
    for step in range(3):
        x, y = global_batch(step)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        shadow.backward(x, y)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # Same bf16/fp32 kernels on the same chunk shapes, fp32 sums of two: exact.
            assert_close(f"step {step} grad {name}", p.grad, q.grad, 0)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(f"param {name}", p, q, 0)
    wrong = {n: d for n, d in seen.items() if d != ((torch.float32,) * 2 if "norm" in n else (torch.bfloat16,) * 2)}
    assert len(seen) == 20 and not wrong, f"compute dtypes: {wrong or seen}"
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict()), f"state dict keys changed: {list(sd)}"
    assert {v.dtype for k, v in sd.items() if k != "causal_mask"} == {torch.float32}


@CASES.case
def no_shard_bf16_keep_fp32_routes_to_fully_shard():
    """NO_SHARD + bf16 runs on DDP's engine under autocast, which would cast the norms' matmuls too:
    with fp32 modules the model goes to FSDP2 on a (world, 1) mesh, where the policy is per parameter."""
    model = small()
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="NO_SHARD", keep_fp32=["norm*"])
    assert fsdp_engine(model) == "fully_shard", fsdp_engine(model)
    seen = _record_dtypes(model, (nn.LayerNorm, nn.Linear))
    model(global_batch(0)[0][:2]).float().sum().backward()
    assert seen["norm"] == (torch.float32,) * 2 and seen["blocks.0.norm2"] == (torch.float32,) * 2, seen
    assert seen["blocks.0.attn.qkv"] == (torch.bfloat16,) * 2, seen


def _dots1():
    from transformers import Dots1Config, Dots1ForCausalLM

    config = Dots1Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return Dots1ForCausalLM(config)


@CASES.case
def hf_dots1_strict_router_fp32():
    """Dots1 declares ``_keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]``: under
    bf16 its router weight is gathered and used in fp32 (as from_pretrained(dtype=bf16) keeps it), the
    experts and attention in bf16; the router's gradient is fp32 and matches across ranks."""
    model = _dots1()
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    seen: dict = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("q_proj"):
            module.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, m.weight.dtype))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    want = {"model.layers.1.mlp.gate": torch.float32, "model.layers.1.self_attn.q_proj": torch.bfloat16}
    assert all(seen.get(k) == v for k, v in want.items()), seen
    grad = model.get_parameter("model.layers.1.mlp.gate.weight").grad
    assert grad.dtype == torch.float32 and torch.isfinite(full(grad)).all()


@CASES.case
def hf_t5_keep_fp32_under_fp16_only():
    """T5 declares ``_keep_in_fp32_modules = ["wo"]`` (not strict): under fp16 every ``wo`` computes in
    fp32, ``wi`` in fp16; under bf16 ``wo`` follows mp (from_pretrained(dtype=bf16) does not keep it)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    for mp, wo_dtype in (("fp16", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(config)
        fsdp(model, auto_wrap=True, mp=mp, shard_strat="FULL_SHARD")
        seen = _record_dtypes(model, (nn.Linear,))
        ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        low = torch.float16 if mp == "fp16" else torch.bfloat16
        wo = {n: d[0] for n, d in seen.items() if n.endswith(".wo")}
        wi = {n: d[0] for n, d in seen.items() if n.endswith(".wi")}
        assert len(wo) == 2 and set(wo.values()) == {wo_dtype}, (mp, wo)
        assert len(wi) == 2 and set(wi.values()) == {low}, (mp, wi)


@CASES.case
def staged_unfreeze_fp32_trains_like_reference():
    """Frozen at wrap, unfrozen after a step (fp32 model: its dtype is its master dtype): its gradient
    after the unfreeze equals the single-process reference's (FSDP2 reduces what got a gradient)."""
    torch.manual_seed(0)
    model = small()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")
    x, y = global_batch(0)
    lm_loss(model(local_slice(x)), local_slice(y)).backward()
    assert model.blocks[0].norm1.weight.grad is None
    model.zero_grad(set_to_none=True)
    for p, q in zip(model.blocks[0].parameters(), ref.blocks[0].parameters()):
        p.requires_grad_(True), q.requires_grad_(True)
    x, y = global_batch(1)
    lm_loss(model(local_slice(x)), local_slice(y)).backward()
    reference_backward(ref, lm_loss, x, y)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(f"grad {name}", p.grad, q.grad, 0)


@CASES.case
def staged_unfreeze_whole_unit_under_bf16():
    """A whole unit frozen at wrap (fp32 model, mp="bf16": no trainable parameter at its first forward, so
    FSDP2 fixed no gradient dtypes for it) and unfrozen after a step: trains, its fp32 gradients equal
    those of the same model wrapped with the unit trainable from the start (same kernels: bit for bit)."""
    torch.manual_seed(0)
    model = small()
    twin = copy.deepcopy(model)
    model.blocks[0].requires_grad_(False)
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)
    fsdp(twin, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)
    x, y = global_batch(0)
    for net in (model, twin):
        lm_loss(net(local_slice(x)).float(), local_slice(y)).backward()
        net.zero_grad(set_to_none=True)
    model.blocks[0].requires_grad_(True)
    x, y = global_batch(1)
    for net in (model, twin):
        lm_loss(net(local_slice(x)).float(), local_slice(y)).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert_close(f"grad {name}", p.grad, q.grad, 0)


@CASES.case
def staged_unfreeze_refused_where_wrong():
    """A bf16 block frozen at wrap (kept bf16; trainable it would be fp32) and unfrozen: the next
    forward raises on every rank naming it. On DDP's engine any unfreeze after the first forward
    raises (its all-reduce was built without the parameter); a (world, 1) mesh trains it."""
    model = small()
    model.blocks[0].bfloat16().requires_grad_(False)
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    x = global_batch(0)[0][:2]
    model(x)
    model.blocks[0].requires_grad_(True)
    _expect_unfreeze_error(lambda: model(x), "blocks.0.norm1.weight was frozen when fsdp() wrapped")

    model = small()
    model.blocks[0].requires_grad_(False)
    fsdp(model, auto_wrap=True)
    assert fsdp_engine(model) == "replicate"
    model(x).sum().backward()
    model.blocks[0].requires_grad_(True)
    _expect_unfreeze_error(lambda: model(x), "blocks.0.norm1.weight was frozen at the first forward")

    model = small()
    model.blocks[0].requires_grad_(False)
    fsdp(model, auto_wrap=True, mesh=init_device_mesh("cpu", (world(), 1), mesh_dim_names=("replicate", "shard")))
    model(x).sum().backward()
    model.blocks[0].requires_grad_(True)
    model(x).sum().backward()
    assert model.blocks[0].norm1.weight.grad is not None


def _expect_unfreeze_error(call, text: str) -> None:
    try:
        call()
    except UnfrozenAfterWrapError as err:
        assert text in str(err), str(err)
    else:
        raise AssertionError(f"no UnfrozenAfterWrapError ({text})")


if __name__ == "__main__":
    run_cases(CASES)

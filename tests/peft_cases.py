"""PEFT LoRA on a tiny Hugging Face Llama, sharded on 2 gloo ranks: frozen bf16 base, fp32 adapters.

Reference (exact, as in ``zoo_cases.master_weights_fp32_for_a_bf16_model``): a ``copy.deepcopy``
of the PEFT model made before wrapping holds the same bf16 base and fp32 adapters. For each
rank-sized chunk a copy computes with every parameter cast to bf16 (what ``mp="bf16"`` does:
the frozen bf16 base is not cast, the fp32 adapters are), its bf16 adapter gradients are upcast
and summed in rank order, then halved: FSDP's fp32 reduce-scatter of two terms (exact in any
order) divided by 2 (exact). AdamW then does the same elementwise arithmetic on fp32 adapters.
Every operand is the same, so losses and weights are equal bit for bit.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist
from worker import ARGS, Cases, assert_losses_match, expect_error, full, rank, run_cases, world

from zeta_fsdp import fsdp, memory_report, save_pretrained
from zeta_fsdp.hf.adapters import load_adapters, save_adapters

CASES = Cases()
VOCAB, SEQ, PER_RANK = 64, 8, 2


def lora_llama(seed: int = 0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(config).to(torch.bfloat16)  # what from_pretrained(dtype=bf16) gives
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(base, lora)  # adapters in fp32 (autocast_adapter_dtype), base frozen
    for p in model.parameters():
        if p.requires_grad:  # lora_B starts at zero: give it values so every gradient is exercised
            p.data.normal_(0, 0.05)
    return model


def batch(step: int, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(100 + step))


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def work() -> Path:
    d = Path(ARGS.out) / "work"
    d.mkdir(parents=True, exist_ok=True)
    return d


def train(model, ref, steps: int = 3) -> None:
    """``model`` (sharded, mp=bf16) and the bf16-compute reference, step for step, asserting losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        ids = batch(step, PER_RANK * world())
        ref_losses = []
        for r in range(world()):
            compute = copy.deepcopy(ref)
            for p in compute.parameters():
                p.data = p.data.to(torch.bfloat16)
            loss_r = loss_of(compute, ids[r * PER_RANK : (r + 1) * PER_RANK])
            loss_r.backward()
            ref_losses.append(loss_r.detach())
            for p, c in zip(ref.parameters(), compute.parameters()):
                if p.requires_grad:
                    g = c.grad.float()
                    p.grad = g if p.grad is None else p.grad + g
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.div_(world())
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(model, ids[rank() * PER_RANK : (rank() + 1) * PER_RANK])
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert_losses_match(loss, ref_losses, step)
    return opt


@CASES.case
def lora_bf16_base_fp32_adapters_train_exactly_and_shard_the_frozen_base():
    model = lora_llama()
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    from zeta_fsdp import get_wrap_plan

    prefix = "base_model.model."  # PeftModel -> LoraModel -> LlamaForCausalLM: its _no_split_modules
    assert [u.name for u in get_wrap_plan(model).units] == [
        f"{prefix}model.layers.0",
        f"{prefix}model.layers.1",
        f"{prefix}model.embed_tokens",
        f"[{prefix}model.norm, {prefix}lm_head]",
        "<root>",
    ], get_wrap_plan(model).table()
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert frozen and adapters and all("lora_" in n for n, _ in adapters)
    # frozen weights keep bf16 (no fp32 masters), sharded 1/N; adapters are fp32 masters
    assert {p.dtype for _, p in frozen} == {torch.bfloat16}, {p.dtype for _, p in frozen}
    assert {p.dtype for _, p in adapters} == {torch.float32}
    for n, p in frozen + adapters:
        rows = p.shape[0]
        assert p.to_local().shape[0] == len(
            range(rank() * math.ceil(rows / 2), min(rows, (rank() + 1) * math.ceil(rows / 2)))
        ), n
    opt = train(model, ref)
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(full(p), ref_params[n]), f"{n} differs from the reference"
    # memory: frozen bf16 at 1/N, no gradient and no optimizer state for them
    report = memory_report(model, opt)
    frozen_local = sum(p.to_local().numel() * 2 for _, p in frozen)
    adapter_local = sum(p.to_local().numel() * 4 for _, p in adapters)
    assert report["params"]["local_bytes"] == frozen_local + adapter_local, report["params"]
    assert report["frozen"]["local_bytes"] == frozen_local and report["frozen"]["dtypes"] == ["bfloat16"]
    assert report["optimizer_state"]["dtypes"] == ["float32"]
    # AdamW: two fp32 moments per adapter element (+ a 4-byte step counter per tensor)
    assert report["optimizer_state"]["local_bytes"] == 2 * adapter_local + 4 * len(adapters)
    assert "frozen" in report.table() and "master weights float32" in report.table()


@CASES.case
def adapters_round_trip_through_peft_files():
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model = lora_llama()
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    train(model, ref, steps=2)
    out = work() / "adapter"
    save_adapters(model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    if rank() == 0:
        peft_dir = work() / "peft_own"
        ref.save_pretrained(str(peft_dir))  # PEFT's own writer, from the unsharded reference
        ours, theirs = load_file(out / "adapter_model.safetensors"), load_file(peft_dir / "adapter_model.safetensors")
        assert sorted(ours) == sorted(theirs), (sorted(ours)[:3], sorted(theirs)[:3])
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), "saved adapters differ from PEFT's own"
        assert {t.dtype for t in ours.values()} == {torch.float32}
        # PEFT reads it
        loaded = PeftModel.from_pretrained(LlamaForCausalLM(ref.config).to(torch.bfloat16), str(out))
        got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        want = {n: p for n, p in ref.named_parameters() if "lora_" in n}
        assert sorted(got) == sorted(want) and all(torch.equal(got[n].float(), want[n]) for n in got)
    dist.barrier()
    # back into a fresh sharded model (other seed: every adapter value differs before the load)
    fresh = lora_llama(seed=1)
    fsdp(fresh, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    before = {n: full(p).clone() for n, p in fresh.named_parameters()}
    # a file for another rank r is refused on every rank, before anything is copied
    # (issue 29: also lora_alpha / use_rslora / target modules, which load and compute something else)
    edits = {"bad_r": {"r": 8}, "bad_alpha": {"lora_alpha": 16}, "bad_rslora": {"use_rslora": True}}
    edits["bad_targets"] = {"target_modules": ["v_proj", "q_proj", "up_proj"]}
    if rank() == 0:
        import json

        for name, edit in edits.items():
            bad = work() / name
            bad.mkdir(exist_ok=True)
            for f in out.iterdir():
                (bad / f.name).write_bytes(f.read_bytes())
            cfg = json.loads((bad / "adapter_config.json").read_text())
            (bad / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    dist.barrier()
    expect_error(ValueError, lambda: load_adapters(fresh, work() / "bad_r"), "r=8", "r=4")
    expect_error(ValueError, lambda: load_adapters(fresh, work() / "bad_alpha"), "lora_alpha=16", "lora_alpha=8")
    expect_error(ValueError, lambda: load_adapters(fresh, work() / "bad_rslora"), "use_rslora=True", "use_rslora=False")
    expect_error(ValueError, lambda: load_adapters(fresh, work() / "bad_targets"), "target_modules=", "up_proj")
    expect_error(ValueError, lambda: load_adapters(fresh, out, adapter_name="other"), "'other'", "'default'")
    assert all(torch.equal(full(p), before[n]) for n, p in fresh.named_parameters()), "changed before raising"
    load_adapters(fresh, out)
    ref_params = dict(ref.named_parameters())
    for n, p in fresh.named_parameters():
        want = ref_params[n] if "lora_" in n else before[n]  # the base is untouched
        assert torch.equal(full(p), want), n


@CASES.case
def merged_model_saves_as_a_plain_hugging_face_model():
    from transformers import LlamaForCausalLM

    model = lora_llama()
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    train(model, ref, steps=1)
    out = work() / "merged"
    save_pretrained(model.merge_and_unload(), out, overwrite=True)
    if rank() == 0:
        merged_ref = ref.merge_and_unload()
        loaded = LlamaForCausalLM.from_pretrained(str(out))
        want = merged_ref.state_dict()
        got = loaded.state_dict()
        assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
        for k in want:
            # merge: W + (B @ A) * scale, each output element one length-r dot product in fp32 on
            # both sides, cast to bf16 once: the same numbers, so equal
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    dist.barrier()


class _FrozenTower(torch.nn.Module):
    """A frozen bf16 tower and a trainable fp32 head in ONE unit (the root): FSDP2 accepts it."""

    def __init__(self):
        super().__init__()
        self.tower = torch.nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.tower(x.bfloat16()).float())


@CASES.case
def frozen_bf16_and_trainable_fp32_share_one_unit():
    torch.manual_seed(0)
    model = _FrozenTower()
    ref = copy.deepcopy(model)
    fsdp(model, shard_strat="FULL_SHARD")  # one unit, default fp32 masters: for the head only
    assert model.tower.weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.float32
    assert model.tower.weight.to_local().numel() == 32  # 8x8 bf16 sharded 1/2
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2 * world(), 8, generator=g)
        for r in range(world()):  # rank order: 2 terms, exact in any order; /2 exact
            ref(x[2 * r : 2 * r + 2]).pow(2).mean().backward()
        for p in ref.head.parameters():
            p.grad.div_(world())
        ref_opt.step()
        ref_opt.zero_grad()
        model(x[2 * rank() : 2 * rank() + 2]).pow(2).mean().backward()
        assert model.tower.weight.grad is None
        opt.step()
        opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(full(p), ref_params[n]), n


if __name__ == "__main__":
    run_cases(CASES)

"""GPU cases: one process on one CUDA device, the group ``fsdp()`` starts itself (nccl + gloo).

Run by ``tests/test_gpu.py`` (skipped without CUDA) or by hand on a GPU machine:
``python tests/gpu_cases.py [--cases a,b] [--out DIR]``. Each case raises on failure; the script
prints one line per case and exits 1 when any failed. One process, so the cases share the group
(as a notebook does); each builds its own models.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zeta_fsdp import (  # noqa: E402
    AsyncCheckpointer,
    MaskedTokenLossReduction,
    fsdp,
    get_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    load_pretrained,
    save_checkpoint,
    save_pretrained,
)
from zeta_fsdp.models.gpt import GPT, Block, GPTConfig, lm_loss  # noqa: E402
from zeta_fsdp.wrapped import compute_device  # noqa: E402

CASES: dict[str, Callable[[], None]] = {}
CFG = GPTConfig(vocab_size=97, dim=64, n_heads=4, n_layers=3, max_seq_len=32)


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def batches(n: int, device: torch.device, batch: int = 4, seq: int = 17) -> list[torch.Tensor]:
    """Sequences counting up from a random start (mod vocab): learnable in a few steps."""
    g = torch.Generator().manual_seed(1234)
    return [
        ((torch.randint(0, CFG.vocab_size, (batch, 1), generator=g) + torch.arange(seq)) % CFG.vocab_size).to(device)
        for _ in range(n)
    ]


def train(model, batches_, *, autocast=None, scaler=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in batches_:
        with torch.autocast("cuda", dtype=autocast) if autocast else torch.autocast("cuda", enabled=False):
            loss = lm_loss(model(tokens[:, :-1]).float(), tokens[:, 1:])
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@case
def facade_fp32_parity() -> None:
    """fsdp() on cuda:0 (nccl + gloo for CPU tensors) trains like the plain model on the same GPU."""
    torch.manual_seed(0)
    plain = GPT(CFG).cuda()
    model = fsdp(copy.deepcopy(plain), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    assert compute_device(model) == torch.device("cuda", 0), compute_device(model)
    assert "cpu:gloo" in str(dist.get_backend()), dist.get_backend()  # async save, offload need it
    assert all(p.device.type == "cuda" for p in model.parameters())
    data = batches(4, torch.device("cuda"))
    got, want = train(model, data), train(plain, data)
    assert rel(got, want) <= 1e-5, (got, want)


@case
def bf16_and_fp16_numerics() -> None:
    """mp="bf16" tracks the plain model under autocast(bf16); mp="fp16" trains with GradScaler."""
    torch.manual_seed(0)
    plain = GPT(CFG).cuda()
    data = batches(6, torch.device("cuda"))
    bf16 = fsdp(copy.deepcopy(plain), auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)
    got, want = train(bf16, data), train(copy.deepcopy(plain), data, autocast=torch.bfloat16)
    # bf16 keeps 8 significant bits: a relative 2^-8 per rounding, a few dozen roundings per logit.
    assert rel(got, want) <= 3e-2, (got, want)
    assert all(p.dtype == torch.float32 for p in bf16.parameters())  # fp32 master weights
    fp16 = fsdp(copy.deepcopy(plain), auto_wrap=True, mp="fp16", shard_strat="FULL_SHARD", TransformerBlock=Block)
    scaler = torch.amp.GradScaler("cuda")
    losses = train(fp16, data, scaler=scaler)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] and rel(losses, want) <= 3e-2, (losses, want)


@case
def meta_init_distinct_and_offload() -> None:
    """A meta model gets real, distinct weights per block on CUDA, and with cpu_offload too (shards on
    pinned CPU, buffers on the GPU), and trains."""
    for offload in (False, True):
        with torch.device("meta"):
            model = GPT(CFG)
        model = fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, cpu_offload=offload)
        params = dict(model.named_parameters())
        assert not any(p.is_meta for p in params.values())
        a, b = full(params["blocks.0.mlp.0.weight"]), full(params["blocks.1.mlp.0.weight"])
        assert not torch.equal(a.cpu(), b.cpu()), f"offload={offload}: blocks 0 and 1 got the same numbers"
        assert a.std().item() > 0
        shard_type = "cpu" if offload else "cuda"
        for name, p in params.items():
            local = p.to_local()
            assert local.device.type == shard_type, (name, local.device)
            if offload and local.numel():
                assert local.is_pinned(), name
        assert all(b.device.type == "cuda" for b in model.buffers())
        losses = train(model, batches(3, torch.device("cuda")))
        assert losses[-1] < losses[0], losses


@case
def cpu_labels_follow_logits() -> None:
    """Labels and masks left on CPU are moved to the logits' device by the loss reductions."""
    logits = torch.randn(2, 5, 7, device="cuda")
    labels = torch.randint(0, 7, (2, 5))
    loss, _ = MaskedTokenLossReduction().forward({"labels": labels, "loss_mask": torch.ones(2, 5)}, logits)
    want = torch.nn.functional.cross_entropy(logits.view(-1, 7), labels.cuda().view(-1))
    assert torch.allclose(loss, want), (loss, want)


@case
def checkpoints_on_cuda() -> None:
    """DCP save/load of CUDA shards (also async, which stages to CPU) restores every parameter exactly."""
    torch.manual_seed(0)
    model = fsdp(GPT(CFG), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, batches(1, torch.device("cuda")))
    want = {n: full(p).clone() for n, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "sync", model, opt)
        saver = AsyncCheckpointer()
        saver.save(Path(tmp) / "async", model, opt)
        saver.wait()
        for kind in ("sync", "async"):
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            load_checkpoint(Path(tmp) / kind, model, opt)
            for n, p in model.named_parameters():
                assert torch.equal(full(p), want[n]), (kind, n)
    # a full state dict into a model built on meta: parameters and buffers where the model computes
    sd = {n: t.cpu() for n, t in get_full_state_dict(model).items()}
    with torch.device("meta"):
        fresh = GPT(CFG)
    fresh = fsdp(fresh, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, materialize=False)
    load_full_state_dict(fresh, sd)
    placed = {n: t.device.type for n, t in [*fresh.named_parameters(), *fresh.named_buffers()]}
    assert set(placed.values()) == {"cuda"}, placed
    for n, p in fresh.named_parameters():
        assert torch.equal(full(p), want[n]), n


@case
def hf_weights_to_and_from_cuda() -> None:
    """save_pretrained from CUDA shards and load_pretrained onto CUDA (and into an offloaded meta model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    source = fsdp(LlamaForCausalLM(cfg), auto_wrap=True, shard_strat="FULL_SHARD")
    want = {n: full(p).cpu().clone() for n, p in source.named_parameters()}
    ids = torch.randint(0, 97, (2, 9))
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(source, tmp)
        for offload in (False, True):
            with torch.device("meta"):
                target = LlamaForCausalLM(cfg)
            target = fsdp(target, auto_wrap=True, shard_strat="FULL_SHARD", materialize=False, cpu_offload=offload)
            load_pretrained(target, tmp)
            for n, p in target.named_parameters():
                assert torch.equal(full(p).cpu(), want[n]), (offload, n)
                assert p.to_local().device.type == ("cpu" if offload else "cuda"), (offload, n)
            logits = target(ids.to(compute_device(target))).logits
            ref = source(ids.cuda()).logits
            assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-5), offload


@case
def compile_inductor() -> None:
    """fsdp(compile=True) with the default (inductor) backend trains like eager."""
    torch.manual_seed(0)
    plain = GPT(CFG).cuda()
    data = batches(3, torch.device("cuda"))
    compiled = fsdp(
        copy.deepcopy(plain), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, compile=True
    )
    eager = fsdp(copy.deepcopy(plain), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    got, want = train(compiled, data), train(eager, data)
    # inductor fuses and reorders fp32 reductions: a few ulps per op, tens of ops per loss.
    assert rel(got, want) <= 1e-4, (got, want)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_cases: no CUDA device")
        return 2
    names = [n for n in args.cases.split(",") if n] or list(CASES)
    failed = []
    for name in names:
        start = time.perf_counter()
        try:
            CASES[name]()
            print(f"PASS {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001 - reported, then the next case runs
            failed.append(name)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    print(f"gpu_cases: {len(names) - len(failed)} passed, {len(failed)} failed {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Multi-rank cases of ``test_trust.py``: the patterns ``fsdp()`` trusts train in parity with one
process; a rank that skips a unit stops every rank with the module's name (the divergence check), and
costs nothing once the checked forwards are over; LayerDrop is refused on every rank."""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.debug import CommDebugMode
from trust_models import SEQ, TRUSTED, VOCAB, Block, SkipSome, lm_loss
from worker import Cases, assert_close, expect_error, local_slice, rank, reference_backward, run_cases, tokens

from zeta_fsdp import fsdp
from zeta_fsdp.divergence import UnitDivergenceError

CASES = Cases()
case = CASES.case


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(4, 300 + step, vocab=VOCAB, seq=SEQ)


@case
def trusted_patterns_train_in_parity():
    """Every pattern: a unit per block, 3 AdamW steps exactly as the reference (bit-exact at 2 ranks)."""
    for name, make in TRUSTED.items():
        if name == "two_heads":
            continue  # heads its forward never calls: planned in test_trust.py, nothing to train
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block if name == "this" else None)
        assert all(isinstance(b, FSDPModule) for b in model.blocks), name
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
        for step in range(3):
            x, y = _batch(step)
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            reference_backward(ref, lm_loss, x, y)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(f"{name}: {n}", p, q, atol=0.0)


def _diverging(skip_on_rank1: set[int], **kwargs) -> SkipSome:
    torch.manual_seed(0)
    model = SkipSome()
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", **kwargs)
    model.skip = skip_on_rank1 if rank() == 1 else set()
    return model


@case
def a_skipped_unit_stops_every_rank_naming_it():
    for skipped, names in (
        ({1}, ("rank 0: blocks.1", "rank 1: blocks.2")),
        ({3}, ("rank 0: blocks.3", "rank 1: head")),
    ):
        model = _diverging(skipped)
        x = local_slice(_batch(0)[0])
        message = expect_error(UnitDivergenceError, lambda m=model, x=x: m(x), *names, "forward #1")
        assert f"this is rank {rank()}" in message, message


@case(ranks=4)
def a_skipped_unit_stops_every_rank_of_a_2d_mesh():
    """HYBRID_SHARD 2x2: rank 1 skips a block; ranks 0 and 2, whose own groups agree, stop too (no hang)."""
    for strat, skipped in (("HYBRID_SHARD", {1}), ("HYBRID_SHARD_ZERO2", {3})):
        torch.manual_seed(0)
        model = SkipSome()
        fsdp(model, auto_wrap=True, shard_strat=strat, replicate_size=2)
        model.skip = skipped if rank() == 1 else set()
        x = local_slice(_batch(0)[0])
        expect_error(UnitDivergenceError, lambda m=model, x=x: m(x), "forward #1", f"this is rank {rank()}")


class _Holder(torch.nn.Module):
    """Holds the model as ``self.model`` and is never called itself (a LightningModule's training_step)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = SkipSome()

    def training_step(self, x, y):
        return lm_loss(self.model(x), y)


@case
def the_check_counts_forwards_of_a_child_unit_and_not_no_grad_ones():
    """fsdp(holder) whose root never runs: forwards start at the child unit, and the check still ends;
    two no_grad forwards first (Lightning's sanity check) spend none of the budget."""
    torch.manual_seed(0)
    holder = fsdp(_Holder(), auto_wrap=True, shard_strat="FULL_SHARD")
    x, y = (local_slice(t) for t in _batch(0))
    with torch.no_grad():
        holder.model(x), holder.model(x)
    counts = []
    for _ in range(3):
        with CommDebugMode() as comm:
            holder.training_step(x, y).backward()
        counts.append(comm.get_total_counts())
    assert counts[0] == counts[1] > counts[2], counts  # checked twice, then the hooks are gone


@case
def an_evaluation_on_one_rank_alone_stops_every_rank():
    """nanoGPT's `if master_process: estimate_loss()`: rank 0's no_grad forward pairs unit for unit with rank
    1's training forward (FSDP2 would then abort or hang in backward); the mode tells them apart."""
    model = _diverging(set())
    x, y = (local_slice(t) for t in _batch(0))

    def step():
        if rank() == 0:
            model.eval()
            with torch.no_grad():
                model(x)
        else:
            lm_loss(model(x), y).backward()

    expect_error(
        UnitDivergenceError,
        step,
        "rank 0: <root> (eval mode, no_grad)",
        "rank 1: <root> (train mode)",
        "evaluate on every rank",
    )


@case
def a_skip_after_the_checked_forwards_is_not_seen_and_costs_nothing():
    """After the checked forwards the hooks are gone: the same collectives as with the check off."""

    def collectives(model) -> list[int]:
        counts = []
        for step in range(4):
            with CommDebugMode() as comm:
                lm_loss(model(local_slice(_batch(step)[0])), local_slice(_batch(step)[1])).backward()
            counts.append(comm.get_total_counts())
        return counts

    checked, off = collectives(_diverging(set())), collectives(_diverging(set(), divergence_check=False))
    units = 1 + 4 + 1 + 1  # emb, 4 blocks, head, root
    assert [c - o for c, o in zip(checked, off)] == [units + 1, units + 1, 0, 0], (checked, off)
    always = collectives(_diverging(set(), divergence_check=True))
    assert [c - o for c, o in zip(always, off)] == [units + 1] * 4, (always, off)


@case
def layerdrop_is_refused_on_every_rank():
    import transformers

    shape = dict(vocab_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    convs = dict(conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8)
    cfg = transformers.Wav2Vec2Config(**shape, **convs, num_conv_pos_embedding_groups=4)  # the default layerdrop=0.1
    model = transformers.Wav2Vec2ForCTC(cfg)
    before = {n: p.clone() for n, p in model.named_parameters()}
    expect_error(ValueError, lambda: fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD"), "config.layerdrop=0.1")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    model.config.layerdrop = 0.0  # the way out the message gives
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")
    assert isinstance(model.wav2vec2.encoder.layers[0], FSDPModule)


if __name__ == "__main__":
    run_cases(CASES)

"""transformers' Trainer and accelerate driving an fsdp() model: real Trainer runs on gloo ranks.

Group "" (2 ranks) trains, checkpoints and resumes with ``FSDPTrainer``, and leaves in ``--work``
the final parameters and logs of the uninterrupted run and its step-3 checkpoint; group "one"
(1 rank, launched after it) compares a single-process ``transformers.Trainer`` on the same global
batches with them and resumes the 2-rank checkpoint on 1 rank.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import transformers  # noqa: E402
from torch.distributed.tensor import DTensor
from worker import ARGS, UNIT_ROUNDOFF, Cases, assert_close, expect_error, rank, run_cases

from zeta_fsdp import fsdp, get_full_state_dict, no_sync  # noqa: E402
from zeta_fsdp.integrations.accelerator import FSDPAccelerator  # noqa: E402
from zeta_fsdp.integrations.trainer import FSDPTrainer  # noqa: E402

CASES = Cases()
case = CASES.case

SEQ, VOCAB, GLOBAL, ACCUM, STEPS = 8, 97, 4, 2, 6  # 4 sequences per micro-batch, 2 micro-batches a step
SAMPLES = GLOBAL * ACCUM * STEPS  # one epoch of 6 steps: a resumed run must skip exactly the first half
CFG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences (labels = inputs: the model shifts them)."""

    def __init__(self, n: int = SAMPLES, seed: int = 0):
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))


def work() -> Path:
    d = Path(ARGS.work)
    d.mkdir(parents=True, exist_ok=True)
    return d


def targs(out: Path, ranks: int, **kw) -> transformers.TrainingArguments:
    """The run every comparison shares: SGD with momentum (its state must be restored), a decaying
    learning rate (the scheduler's), clipping that binds (grad norms are ~1.2), sequential batches
    (the same global batches at any world size), the same 4-sequence global micro-batch."""
    base = dict(
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=GLOBAL // ranks,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=0.5,
        lr_scheduler_type="linear",
        optim="sgd",
        optim_args="momentum=0.9",
        max_grad_norm=0.5,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(str(out), **base)


def full_params(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in get_full_state_dict(model, rank0_only=False).items()}


def logged(trainer) -> list:
    return [
        {k: e[k] for k in ("loss", "grad_norm", "learning_rate") if k in e}
        for e in trainer.state.log_history
        if "loss" in e
    ]


def assert_same_params(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs by {(got[k] - want[k]).abs().max().item():.3e}"


def parity_ulps(n_params: int) -> float:
    """The bound (in unit roundoffs of the largest update) between runs that split a global batch
    differently (1 process against 2 ranks). Per step a gradient element differs by at most
    tokens x u x its terms' magnitudes (the rows of X^T dY summed in another grouping: 2 x 4 x 8
    tokens), and the clipping coefficient by the relative error of the global norm, at most
    n_params x u (a sum of n_params squares, summed per shard or whole). Momentum 0.9 weighs each
    gradient into at most sum(0.9^j, j<6) = 4.69 updates, and 6 steps add up."""
    tokens = GLOBAL * ACCUM * SEQ
    return sum(0.9**j for j in range(STEPS)) * STEPS * (tokens + n_params)


def assert_close_updates(got: dict, want: dict, start: dict, what: str) -> None:
    """Every parameter's total update within ``parity_ulps`` of the largest update anywhere."""
    scale = max((want[k] - start[k]).abs().max().item() for k in want)
    tol = parity_ulps(sum(v.numel() for v in want.values())) * UNIT_ROUNDOFF * scale
    for k in want:
        assert_close(f"{what}: {k}", got[k] - start[k], want[k] - start[k], tol)


# ---------------------------------------------------------------- 2 ranks


@case
def full_shard_trains_checkpoints_and_resumes_bit_exactly():
    """6 steps at 2 ranks (FULL_SHARD, accumulation 2): never wrapped again; checkpoint-3 resumed
    in a fresh Trainer ends bit for bit where the uninterrupted run ends."""
    global TRAINED
    model = fsdp(llama(), auto_wrap=True, shard_strat="FULL_SHARD")
    start = full_params(model)
    out = work() / "a"
    trainer = FSDPTrainer(
        model=model,
        args=targs(out, 2, save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=6),
        train_dataset=Tokens(),
        eval_dataset=Tokens(8, seed=1),
    )
    trainer.train()
    TRAINED = trainer
    assert trainer.model_wrapped is model and trainer.model is model, type(trainer.model_wrapped)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    final, logs = full_params(model), logged(trainer)
    assert len(logs) == STEPS and all(math.isfinite(e["loss"]) for e in logs), logs
    assert logs[0]["learning_rate"] > logs[-1]["learning_rate"] > 0, logs
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == 1 and math.isfinite(evals[0]), trainer.state.log_history
    assert final.keys() == start.keys() and any(not torch.equal(final[k], start[k]) for k in final)
    if rank() == 0:
        torch.save({"start": start, "final": final}, work() / "a_params.pt")
        (work() / "a_logs.json").write_text(json.dumps({"train": logs, "eval": evals}))
    dist.barrier()

    fresh = fsdp(llama(seed=1), auto_wrap=True, shard_strat="FULL_SHARD")  # other weights: all must come back
    resumed = FSDPTrainer(model=fresh, args=targs(work() / "c", 2), train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert_same_params(full_params(fresh), final, "resumed at step 3")
    assert logged(resumed) == logs, (logged(resumed), logs)  # steps 1-3 from trainer_state.json, 4-6 equal


@case
def save_model_loads_with_from_pretrained_and_gives_the_same_logits():
    model, out = TRAINED.model, work() / "saved"
    TRAINED.save_model(str(out))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    ids = Tokens(3, seed=2).x
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = back(input_ids=ids).logits
    assert torch.equal(got, want), (got - want).abs().max()
    TRAINED.save_model(str(out))  # again, over the first: the folder's other files stay
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "training_args.bin"]
    ), list(out.iterdir())


@case
def no_shard_is_not_wrapped_twice_and_matches_full_shard():
    """NO_SHARD on DDP's engine: the Trainer adds no DistributedDataParallel (gradients would be
    all-reduced twice); the same run as FULL_SHARD, only the clipping norm is summed differently."""
    model = fsdp(llama(), shard_strat="NO_SHARD")
    start = full_params(model)
    trainer = FSDPTrainer(model=model, args=targs(work() / "ns", 2), train_dataset=Tokens())
    trainer.train()
    assert trainer.model_wrapped is model
    assert not any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in model.modules())
    want = torch.load(work() / "a_params.pt")["final"]
    assert_close_updates(full_params(model), want, start, "NO_SHARD vs FULL_SHARD")


@case
def bf16_runs_fsdp_policy_alone_not_autocast_on_top():
    model = fsdp(llama(), auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    seen = []
    mlp = model.model.layers[0].mlp
    mlp.register_forward_hook(lambda m, a, o: seen.append((torch.is_autocast_enabled("cpu"), a[0].dtype, o.dtype)))
    trainer = FSDPTrainer(model=model, args=targs(work() / "bf16", 2, bf16=True, max_steps=2), train_dataset=Tokens())
    trainer.train()
    assert seen and set(seen) == {(False, torch.bfloat16, torch.bfloat16)}, set(seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert all(math.isfinite(e["loss"]) for e in logged(trainer))


@case
def lora_trains_and_saves_the_adapter_peft_loads():
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = fsdp(get_peft_model(llama(), lora), auto_wrap=True, shard_strat="FULL_SHARD")
    before = {k: v for k, v in full_params(model).items() if "lora_B" in k}
    trainer = FSDPTrainer(model=model, args=targs(work() / "lora", 2, max_steps=2), train_dataset=Tokens())
    trainer.train()
    after = {k: v for k, v in full_params(model).items() if "lora_B" in k}
    assert before and all(not torch.equal(after[k], before[k]) for k in before)  # the adapters trained
    out = work() / "lora_saved"
    trainer.save_model(str(out))
    back = PeftModel.from_pretrained(llama(), str(out))
    ids = Tokens(3, seed=2).x
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


@case
def settings_that_cannot_work_raise_before_training():
    model = fsdp(llama(), auto_wrap=True, shard_strat="FULL_SHARD")
    data = Tokens(8)

    def build(m=model, **kw):
        return FSDPTrainer(model=m, args=targs(work() / "err", 2, **kw), train_dataset=data)

    expect_error(ValueError, lambda: build(m=llama()), "model=LlamaForCausalLM", "fsdp(model")
    expect_error(ValueError, lambda: build(bf16=True), "bf16=True", "mp='bf16'")
    expect_error(ValueError, lambda: build(gradient_checkpointing=True), "activation_checkpointing=True")
    expect_error(ValueError, lambda: build(torch_compile=True), "torch_compile", "compile=True")
    expect_error(
        ValueError, lambda: build(load_best_model_at_end=True, eval_strategy="steps"), "load_best_model_at_end"
    )
    expect_error(ValueError, lambda: build(fsdp="full_shard"), "fsdp=", "Remove")
    # transformers would model.to(bf16) the sharded master weights for evaluation, for good
    expect_error(ValueError, lambda: build(bf16_full_eval=True), "bf16_full_eval=True", "master weights")


@case
def accelerator_prepares_without_a_second_wrap_and_accumulates_with_no_sync():
    """accelerate without Trainer: prepare returns the same object; accumulate() over 2 micro-batches
    gives the parameters our own no_sync loop gives, bit for bit."""
    base = llama()
    ref = fsdp(copy.deepcopy(base), auto_wrap=True, shard_strat="FULL_SHARD")
    model = fsdp(base, auto_wrap=True, shard_strat="FULL_SHARD")
    acc = FSDPAccelerator(cpu=True, gradient_accumulation_steps=2)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(Tokens(8), batch_size=2)
    prepared, opt, loader = acc.prepare(model, opt, loader)
    assert prepared is model and all(isinstance(p, DTensor) for p in model.parameters())
    batches = list(loader)
    for batch in batches:
        with acc.accumulate(model):
            acc.backward(model(**batch).loss)
            acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    for i in range(0, len(batches), 2):
        with no_sync(ref):
            (ref(**batches[i]).loss / 2).backward()
        (ref(**batches[i + 1]).loss / 2).backward()
        from zeta_fsdp import clip_grad_norm_

        clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(full_params(model), full_params(ref), "FSDPAccelerator.accumulate")
    expect_error(ValueError, lambda: acc.save_state(str(work() / "acc_state")), "save_checkpoint")


@case
def plain_accelerator_does_not_wrap_again():
    """A plain accelerate.Accelerator: prepare() returns the fsdp() model itself (no DistributedDataParallel
    around the shards), and a step through accelerator.backward equals the same step without accelerate."""
    from accelerate import Accelerator

    base = llama()
    ref = fsdp(copy.deepcopy(base), auto_wrap=True, shard_strat="FULL_SHARD")
    model = fsdp(base, auto_wrap=True, shard_strat="FULL_SHARD")
    acc = Accelerator(cpu=True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    prepared, opt = acc.prepare(model, opt)
    assert prepared is model and all(isinstance(p, DTensor) for p in model.parameters())
    batch = Tokens(2, seed=rank()).x
    acc.backward(model(input_ids=batch, labels=batch).loss)
    opt.step()
    ref(input_ids=batch, labels=batch).loss.backward()
    ref_opt.step()
    assert_same_params(full_params(model), full_params(ref), "plain Accelerator step")


@case
def the_example_script_runs():
    """examples/trainer_llama.py's main(), as torchrun runs it: trains, resumes, evaluates, saves."""
    from examples.trainer_llama import main

    out = work() / "example"
    metrics = main(str(out))
    assert math.isfinite(metrics["eval_loss"]), metrics
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out / "final"))
    assert back.config.num_hidden_layers == 2 and sum(p.numel() for p in back.parameters()) > 0


# ---------------------------------------------------------------- 1 rank, after the 2-rank launch


@case(ranks=1, group="one")
def single_process_trainer_matches_two_ranks():
    """transformers.Trainer on the unwrapped model, one process, the same global batches: the same
    parameters within ``parity_ulps`` and the same losses logged."""
    model = llama()
    saved = torch.load(work() / "a_params.pt")
    trainer = transformers.Trainer(model=model, args=targs(work() / "one", 1), train_dataset=Tokens())
    trainer.train()
    got = {k: v.detach() for k, v in model.state_dict().items() if k in saved["final"]}
    assert_close_updates(got, saved["final"], saved["start"], "1 process vs 2 ranks")
    want_logs = json.loads((work() / "a_logs.json").read_text())["train"]
    for g, w in zip(logged(trainer), want_logs):
        assert abs(g["loss"] - w["loss"]) <= 1e-4 * abs(w["loss"]) and g["learning_rate"] == w["learning_rate"], (g, w)


@case(ranks=1, group="one")
def two_rank_checkpoint_resumes_on_one_rank():
    model = fsdp(llama(seed=1), auto_wrap=True, shard_strat="FULL_SHARD")
    saved = torch.load(work() / "a_params.pt")
    trainer = FSDPTrainer(model=model, args=targs(work() / "one_resumed", 1), train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=str(work() / "a" / "checkpoint-3"))
    assert trainer.state.global_step == STEPS
    assert_close_updates(full_params(model), saved["final"], saved["start"], "resumed on 1 rank")


def _args(parser):
    parser.add_argument("--work", required=True)


if __name__ == "__main__":
    run_cases(CASES, extra_args=_args)

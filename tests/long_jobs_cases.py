"""Multi-rank cases for long jobs: async save, the checkpoint manager, preemption, data position at any world size.

Launched by ``test_long_jobs.py``; ``--dir`` is shared by the launches of one test module (the data
cases save at 2 ranks and resume at 1 and 4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from worker import ARGS, Cases, expect_error, full, global_batch, local_slice, rank, run_cases, world

from zeta_fsdp import fsdp
from zeta_fsdp.data import ResumableLoader
from zeta_fsdp.models.gpt import Block, lm_loss, small
from zeta_fsdp.state_dict import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointManager,
    get_full_state_dict,
    get_optimizer_state_dict,
    is_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

CASES = Cases()
case = CASES.case


def root() -> Path:
    return ARGS.dir


def gpt():
    torch.manual_seed(0)
    model = fsdp(small(), auto_wrap=True, TransformerBlock=Block, shard_strat="FULL_SHARD")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model, opt, steps) -> None:
    for step in steps:
        x, y = global_batch(step)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt) -> dict:
    """Model and optimizer, full tensors on every rank (exact copies, for equality checks)."""
    return {
        "model": get_full_state_dict(model, rank0_only=False),
        "optim": get_optimizer_state_dict(model, opt, full=True, rank0_only=False),
    }


def assert_identical(what: str, got: dict, want: dict) -> None:
    assert list(got) == list(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:10]}"
    for key, value in want.items():
        if isinstance(value, dict):
            assert_identical(f"{what}.{key}", got[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{what}: {key} differs"
        else:
            assert got[key] == value, f"{what}: {key}: {got[key]!r} vs {value!r}"


def loaded(path: Path) -> dict:
    model, opt = gpt()
    extra = load_checkpoint(path, model, opt)
    return {"state": snapshot(model, opt), "extra": extra}


def on_rank0(fn) -> None:
    if rank() == 0:
        fn()
    dist.barrier()


# --------------------------------------------------------------------------- async save


@case
def async_save_equals_sync_save_while_training_continues():
    model, opt = gpt()
    train(model, opt, range(2))
    want = snapshot(model, opt)
    sync_path, async_path = root() / "sync", root() / "async"
    save_checkpoint(sync_path, model, opt, extra={"step": 2})
    checkpointer = AsyncCheckpointer()
    assert checkpointer.save(async_path, model, opt, extra={"step": 2}) == async_path
    train(model, opt, range(2, 5))  # parameters and optimizer state change while the write goes on
    assert checkpointer.wait() == async_path
    assert checkpointer.wait() is None, "a second wait() has nothing in flight"
    assert is_checkpoint(async_path)
    assert not (root() / ".async.incomplete").exists(), "temporary directory left behind"
    got, reference = loaded(async_path), loaded(sync_path)
    assert got["extra"] == {"step": 2}, got["extra"]
    assert_identical("async vs the step-2 state", got["state"], want)
    assert_identical("async vs sync save", got["state"], reference["state"])
    # Same records as the synchronous save: same keys, same sizes (DCP layout of one rank's file).
    from zeta_fsdp.state_dict.reader import read_metadata

    a, s = read_metadata(async_path, "test"), read_metadata(sync_path, "test")
    assert sorted(a.state_dict_metadata) == sorted(s.state_dict_metadata)
    checkpointer.close()


@case
def async_save_one_in_flight_and_bad_input_first():
    model, opt = gpt()
    train(model, opt, range(1))
    checkpointer = AsyncCheckpointer()
    first, second = root() / "one", root() / "two"
    checkpointer.save(first, model, opt)
    train(model, opt, range(1, 2))
    checkpointer.save(second, model, opt)  # waits for the first one
    assert is_checkpoint(first), "the second save started before the first was complete"
    assert checkpointer.in_flight in (second, None)
    checkpointer.wait()
    assert is_checkpoint(second)
    # Bad input: refused on every rank before anything is written; the existing checkpoint stays.
    expect_error(FileExistsError, lambda: checkpointer.save(second, model, opt), "overwrite=True")
    expect_error(TypeError, lambda: checkpointer.save(root() / "bad", model, opt, extra=object()), "weights_only")
    assert not (root() / ".bad.incomplete").exists() and not (root() / "bad").exists()
    checkpointer.close()
    expect_error(RuntimeError, lambda: checkpointer.save(root() / "three", model, opt), "closed")


# --------------------------------------------------------------------------- the manager


@case
def async_save_failing_to_start_on_one_rank_raises_on_every_rank():
    """Issue 18: an async save whose start fails on rank 1 only raises on every rank at once (no peer waits
    in the write's collectives for gloo's timeout); the previous checkpoint stays, the checkpointer works on."""
    import torch.distributed.checkpoint as dcp

    model, opt = gpt()
    train(model, opt, range(1))
    checkpointer = AsyncCheckpointer()
    path = root() / "start_fails"
    checkpointer.save(path, model, opt, extra={"step": 1})
    checkpointer.wait()
    before = loaded(path)
    train(model, opt, range(1, 2))
    real = dcp.async_save

    def failing(*args, **kwargs):
        if rank() == 1:
            raise RuntimeError("cannot start the write (injected)")
        return real(*args, **kwargs)

    dcp.async_save = failing
    try:
        expect_error(CheckpointError, lambda: checkpointer.save(path, model, opt, overwrite=True), "injected")
    finally:
        dcp.async_save = real
    assert checkpointer.in_flight is None
    assert_identical("previous checkpoint after a failed start", loaded(path)["state"], before["state"])
    dist.barrier()  # rank 0 removes what it prepared after raising, as rank 1 raises: look once it is done
    assert not (root() / ".start_fails.incomplete").exists() and not (root() / ".start_fails.lock").exists()
    dist.barrier()  # every rank has looked before rank 0 prepares the next save
    checkpointer.save(path, model, opt, extra={"step": 2}, overwrite=True)  # the checkpointer works on
    checkpointer.wait()
    assert loaded(path)["extra"] == {"step": 2}
    checkpointer.close()


@case
def manager_saves_every_n_keeps_last_k_and_resumes():
    model, opt = gpt()
    ckpt = root() / "managed"
    manager = CheckpointManager(ckpt, model, opt, every=2, keep_last=2, async_save=True)
    assert manager.resume() == 0, "a fresh root must start at step 0"
    states = {}
    for step in range(1, 8):
        train(model, opt, range(step - 1, step))
        states[step] = snapshot(model, opt)
        assert manager.after_step(step, extra={"note": f"step {step}"}) is False
    manager.close()
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["step_4", "step_6"], names
    dist.barrier()  # every rank has looked before rank 0 adds a partial directory
    # A partial directory (a save killed mid-write) is never "latest", and resume removes it.
    on_rank0(lambda: (ckpt / ".step_8.incomplete").mkdir())
    model2, opt2 = gpt()
    manager2 = CheckpointManager(ckpt, model2, opt2, every=2, keep_last=2, preemption_signals=())
    assert manager2.latest() == ckpt / "step_6"
    assert manager2.resume() == 6
    assert manager2.extra == {"note": "step 6"}, manager2.extra
    assert_identical("resumed at step 6", snapshot(model2, opt2), states[6])
    assert not (ckpt / ".step_8.incomplete").exists()
    manager2.close()
    expect_error(ValueError, lambda: CheckpointManager(ckpt, model2, every=0), "every", "0")
    expect_error(ValueError, lambda: CheckpointManager(ckpt, model2, preemption_signals=["SIGNOPE"]), "SIGNOPE")


class Cursor:
    """A per-rank stream position (each rank reads its own shard of a stream)."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


@case
def manager_state_is_saved_and_restored_per_rank():
    """Issue 29 §5: ``CheckpointManager(state=...)`` saves each rank's own ``state_dict()`` and restores each
    rank its own (it restored rank 0's everywhere); a state every rank holds alike still resumes."""
    model, opt = gpt()
    ckpt = root() / "per_rank_state"
    lr_like = Cursor(7)  # the same on every rank
    manager = CheckpointManager(
        ckpt, model, opt, preemption_signals=(), state={"cursor": Cursor(100 + rank()), "same": lr_like}
    )
    manager.save(3)
    manager.close()
    model2, opt2 = gpt()
    cursor, same = Cursor(-1), Cursor(-1)
    resumed = CheckpointManager(ckpt, model2, opt2, preemption_signals=(), state={"cursor": cursor, "same": same})
    assert resumed.resume() == 3
    resumed.close()
    assert cursor.pos == 100 + rank(), f"rank {rank()} got stream position {cursor.pos}"
    assert same.pos == 7


@case
def preemption_signal_saves_at_next_boundary_and_stops():
    model, opt = gpt()
    ckpt = root() / "preempted"
    previous = signal.getsignal(signal.SIGUSR1)
    manager = CheckpointManager(ckpt, model, opt, every=100, preemption_signals=["SIGUSR1"])
    stopped_at = None
    for step in range(1, 10):
        train(model, opt, range(step - 1, step))
        if step == 3 and rank() == world() - 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # one rank only: the others learn it at the boundary
        if manager.after_step(step):
            stopped_at = step
            state = snapshot(model, opt)
            break
    manager.close()
    assert stopped_at == 3, f"stopped at {stopped_at}"
    assert signal.getsignal(signal.SIGUSR1) == previous, "the previous handler was not restored"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3"]
    got = loaded(ckpt / "step_3")
    assert_identical("preemption checkpoint", got["state"], state)
    assert got["extra"]["step"] == 3


@case
def strategy_async_keep_last_preemption_resume_latest():
    from zeta_fsdp import FSDP2Strategy

    expect_error(ValueError, lambda: FSDP2Strategy(TransformerBlock=Block, async_save=True), "sharded")
    expect_error(ValueError, lambda: FSDP2Strategy(checkpoint_format="sharded", keep_last=0), "keep_last", "0")
    expect_error(ValueError, lambda: FSDP2Strategy(preemption_signals=["SIGNOPE"]), "SIGNOPE")

    def build(seed: int) -> FSDP2Strategy:
        torch.manual_seed(seed)
        strategy = FSDP2Strategy(
            TransformerBlock=Block,
            checkpoint_format="sharded",
            async_save=True,
            keep_last=2,
            preemption_signals=("SIGUSR1",),
        )
        strategy.connect(small())
        strategy.setup_optimizers(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
        strategy.parallelize()
        return strategy

    ckpt = root() / "strategy"
    strategy = build(0)
    assert strategy.resume_latest(ckpt) is None, "nothing to resume on the first launch"
    model, opt = strategy.model, strategy.optimizers[0]
    stopped = None
    for step in range(1, 8):
        train(model, opt, range(step - 1, step))
        strategy.current_epoch_step = (0, step)
        if step == 4 and rank() == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        stop = strategy.should_stop()
        strategy.save_checkpoint({"note": step}, ckpt / f"step_{step}")
        if stop:
            stopped = step
            break
    want = get_full_state_dict(model, rank0_only=False)
    strategy.wait_for_checkpoint()
    assert stopped == 4, stopped
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3", "step_4"], sorted(p.name for p in ckpt.iterdir())
    strategy.teardown()  # waits, restores the handler; the harness's process group stays
    assert dist.is_initialized()
    resumed = build(1)
    got = resumed.resume_latest(ckpt)
    assert got is not None and got["note"] == 4 and resumed.current_epoch_step.step == 4
    assert_identical("strategy resume_latest", get_full_state_dict(resumed.model, rank0_only=False), want)
    resumed.teardown()


# --------------------------------------------------------------------------- data position at any world size

D, OUT, N_SAMPLES, GLOBAL = 16, 4, 20, 8
STEPS, SAVE_AT, LR = 6, 3, 2.0**-6


class Regression(torch.utils.data.Dataset):
    """``(index, x, y)``: the index lets each run record exactly which samples it saw."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N_SAMPLES, D, generator=g)
        self.y = torch.randn(N_SAMPLES, OUT, generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def regression_run(start_from: bool) -> dict:
    """Train a linear least-squares model with SGD on ``ResumableLoader`` batches; record what each step saw."""
    torch.manual_seed(0)
    model = fsdp(torch.nn.Sequential(torch.nn.Linear(D, OUT, bias=False)), shard_strat="FULL_SHARD")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = ResumableLoader(Regression(), GLOBAL, seed=3)
    manager = CheckpointManager(root() / "data", model, opt, preemption_signals=(), state={"data": loader})
    step = manager.resume() if start_from else 0
    assert step == (SAVE_AT if start_from else 0), step
    record = {"indices": {}, "losses": {}, "weights": {}}
    while step < STEPS:
        for idx, x, y in loader:
            record["weights"][step] = full(model[0].weight).detach().double().tolist()  # W_t, before the step
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            step += 1
            seen = [None] * world()
            dist.all_gather_object(seen, idx.tolist())
            record["indices"][step] = [i for part in seen for i in part]  # rank order = the global batch
            record["losses"][step] = (reported / world()).item()
            if step == SAVE_AT and not start_from:
                manager.save(step)  # mid-epoch: epoch 1, 8 samples consumed
            if step == STEPS:
                break
    manager.close()
    return record


def loss_bound(weights: list, step_batches: list[list[int]]) -> list[float]:
    """Bound on |loss(resumed run) - loss(reference)| at each step after the resume, derived from fp32 arithmetic.

    Both runs start the resume step with bit-identical weights (loaded from one checkpoint) and
    see the same global batches; they differ only in how sums are split over ranks. For a batch
    X (G x d), Y (G x o), W (o x d), with u = 2^-24 and gamma_n = n u / (1 - n u):
    * an fp32 result of a sum of products with at most n roundings on any path is within
      gamma_n * (the same sum of absolute values) of exact (Higham, Accuracy and Stability, 3.1);
    * the gradient G_W = 2/(G o) (XW^T - Y)^T X: within gamma_{d+G+2} * 2/(G o) * A^T |X|,
      A = |X||W|^T + |Y|; the update W - lr G_W adds 2u(|W| + lr |G_W|) (two roundings);
      powers of two (1/G, 1/o, 1/world, lr) are exact;
    * the exact SGD step is affine in W with Jacobian W -> W (I - 2 lr/(G o) X^T X), of spectral norm
      rho = max |1 - 2 lr lambda / (G o)| over the eigenvalues lambda of X^T X;
    * so the weight gap e obeys e_{t+1} <= rho e_t + 2 delta_t (each run off exact by delta_t),
      and the loss gap is <= |grad loss| e + lambda_max/(G o) e^2 + 2 gamma_{2d+Go+6} sum(A^2)/(G o)
      (the residual's relative error doubles when squared).
    Quantities are evaluated in float64 at the reference weights, and doubled for the (tiny)
    distance between the runs' weights.
    """
    data = Regression()
    u = 2.0**-24

    def gamma(n: int) -> float:
        return n * u / (1 - n * u)

    bounds, e = [], 0.0
    for w_list, batch in zip(weights, step_batches):
        w = torch.tensor(w_list, dtype=torch.float64)
        x, y = data.x[batch].double(), data.y[batch].double()
        g, o = x.shape[0], y.shape[1]
        a = x.abs() @ w.abs().T + y.abs()
        r = x @ w.T - y
        grad = 2.0 / (g * o) * r.T @ x
        lam = torch.linalg.eigvalsh(x.T @ x)
        loss_round = 2 * gamma(2 * D + g * o + 6) * (a**2).sum().item() / (g * o)
        bounds.append(2 * (grad.norm().item() * e + lam.max().item() / (g * o) * e * e + loss_round))
        grad_round = gamma(D + g + 2) * 2.0 / (g * o) * (a.T @ x.abs())
        delta = (LR * grad_round + 2 * u * (w.abs() + LR * grad.abs())).norm().item()
        rho = (1 - 2 * LR * lam / (g * o)).abs().max().item()
        e = rho * e + 2 * delta
    return bounds


@case
def data_reference_run_saves_midway():
    record = regression_run(start_from=False)
    on_rank0(lambda: (root() / "data_reference.json").write_text(json.dumps(record)))
    assert len(record["indices"]) == STEPS


@case(ranks=(1, 2, 4), group="resume")
def data_resume_at_this_world_size():
    reference = json.loads((root() / "data_reference.json").read_text())
    record = regression_run(start_from=True)
    resumed_steps = list(range(SAVE_AT + 1, STEPS + 1))
    assert sorted(int(s) for s in record["indices"]) == resumed_steps, record["indices"].keys()
    for step in resumed_steps:
        got, want = record["indices"][step], reference["indices"][str(step)]
        assert got == want, f"step {step} at {world()} ranks saw global batch {got}, the reference {want}"
    weights = [reference["weights"][str(s - 1)] for s in resumed_steps]
    bounds = loss_bound(weights, [reference["indices"][str(s)] for s in resumed_steps])
    diffs = [abs(record["losses"][s] - reference["losses"][str(s)]) for s in resumed_steps]
    on_rank0(lambda: (root() / f"data_resume_{world()}.json").write_text(json.dumps({"diff": diffs, "bound": bounds})))
    for step, bound in zip(resumed_steps, bounds):
        got, want = record["losses"][step], reference["losses"][str(step)]
        assert math.isfinite(got) and abs(got - want) <= bound, (
            f"step {step}: loss {got!r} vs reference {want!r}, |diff| {abs(got - want):.3e} > derived bound {bound:.3e}"
        )
    # The first step after the resume starts from bit-identical weights.
    assert record["weights"][SAVE_AT] == reference["weights"][str(SAVE_AT)]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, required=True)


if __name__ == "__main__":
    run_cases(CASES, extra_args=add_args)

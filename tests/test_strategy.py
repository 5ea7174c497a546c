"""``FSDP2Strategy`` on real gloo ranks (cases in ``strategy_cases.py``), its pure parts, and the example loop."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, check_case, dist_test, rank_env, worker_cases

TWO_RANK_CASES = worker_cases("strategy_cases.py", 2)  # @case in strategy_cases.py; @case(ranks=4) below

test_two_ranks = dist_test("strategy_cases.py", 2)
test_four_ranks = dist_test("strategy_cases.py", 4)


# ----------------------------------------------------------------------------- the seed API, in-process

SEED_METHODS = {
    "setup_environment": [],
    "parallelize": [],
    "load_optimizer_state_dict": ["checkpoint"],
    "_get_loss_reduction": ["step_type"],
    "training_step": ["batch", "batch_idx"],
    "validation_step": ["batch", "batch_idx"],
    "test_step": ["batch", "batch_idx"],
    "predict_step": ["batch", "batch_idx"],
    "save_checkpoint": ["checkpoint", "filepath"],
    "load_checkpoint": ["filepath"],
    "tensor_init_context": [],
    "process_dataloader": ["dataloader"],
    "load_model_state_dict": ["ckpt", "strict"],
    "remove_checkpoint": ["filepath"],
    "lightning_module_state_dict": [],
    "connect": ["module"],
}


def test_seed_api_signatures():
    from zeta_fsdp.strategy import FSDP2Strategy

    params = list(inspect.signature(FSDP2Strategy.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [
        "data_parallel_size",
        "tensor_parallel_size",
        "data_sampler",
        "checkpoint_io",
        "mp_policy",
        "parallelize_fn",
        "kwargs",
    ]
    assert [p.default for p in params[:6]] == ["auto", "auto", None, None, None, None]
    for name, required in SEED_METHODS.items():
        method = getattr(FSDP2Strategy, name)
        sig = inspect.signature(method)
        names = [p for p in sig.parameters if p != "self"]
        assert names[: len(required)] == required, f"{name}{sig}"
        assert method.__doc__ and "Example" in method.__doc__, f"{name} has no docstring example"
    assert isinstance(FSDP2Strategy.current_epoch_step, property)
    assert inspect.signature(FSDP2Strategy.load_model_state_dict).parameters["strict"].default is True
    assert inspect.signature(FSDP2Strategy.training_step).parameters["batch_idx"].default is None


def test_constructor_validates_before_any_process_group():
    import torch.distributed as dist

    from zeta_fsdp.strategy import FSDP2Strategy

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        FSDP2Strategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="process_group_backend='mpi'"):
        FSDP2Strategy(process_group_backend="mpi")
    with pytest.raises(ValueError, match="timeout=30"):
        FSDP2Strategy(timeout=30)
    with pytest.raises(ValueError, match="checkpoint_format='zip'"):
        FSDP2Strategy(checkpoint_format="zip")
    with pytest.raises(ValueError, match="shard_strat"):
        FSDP2Strategy(shard_strat="QUARTER_SHARD")
    with pytest.raises(ValueError, match="mp_policy or as mp"):
        FSDP2Strategy(mp_policy="bf16", mp="fp16")
    with pytest.raises(ValueError, match="mp="):
        FSDP2Strategy(mp_policy="fp8")
    with pytest.raises(ValueError, match="one or the other"):
        FSDP2Strategy(checkpoint_io=object(), checkpoint_format="sharded")
    with pytest.raises(ValueError, match="lacks"):
        FSDP2Strategy(checkpoint_io=object())
    assert not dist.is_initialized(), "validation started a process group"
    assert FSDP2Strategy(mp_policy="bf16").mp_policy.param_dtype == torch.bfloat16
    assert FSDP2Strategy(mp="fp16").mp_policy.param_dtype == torch.float16
    strategy = FSDP2Strategy(
        shard_strat="SHARD_GRAD", TransformerBlock="Block", tp_plan={}, checkpoint_format="sharded"
    )
    assert strategy.fsdp_kwargs == {"shard_strat": "SHARD_GRAD", "TransformerBlock": "Block"}


def test_regression_sizes_checked_at_setup_environment_not_construction(monkeypatch):
    """Issue 12 §2.1/§2.9: the world size is unknown when Lightning's launcher or SLURM builds the
    strategy (no WORLD_SIZE, or WORLD_SIZE without RANK): construction accepts the sizes and
    Lightning's own options; setup_environment() refuses a wrong product before any process group."""
    import datetime

    import torch.distributed as dist

    from zeta_fsdp.strategy import FSDP2Strategy

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    strategy = FSDP2Strategy(data_parallel_size=2, process_group_backend="gloo", timeout=datetime.timedelta(seconds=60))
    assert strategy.options.process_group_backend == "gloo"
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=1 = 2, but the world size is 1"):
        strategy.setup_environment()
    with pytest.raises(ValueError, match=r"data_parallel_size='auto' x tensor_parallel_size=2 .*world size 1"):
        FSDP2Strategy(tensor_parallel_size=2).setup_environment()
    # a Lightning child before its process group: WORLD_SIZE and MASTER_* but no RANK yet
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    FSDP2Strategy(data_parallel_size=2, tensor_parallel_size=1)
    assert not dist.is_initialized(), "a size check started a process group"


class _StopError(Exception):
    """Raised by a recorder in place of starting a process group."""


def test_regression_lightning_kwargs_reach_init_process_group(monkeypatch):
    """Issue 12 §2.9: ``process_group_backend`` / ``timeout`` (Lightning's strategy options) were
    rejected; accepted, they must really reach ``init_process_group`` (not be dropped)."""
    import datetime

    import torch.distributed as dist

    from zeta_fsdp.strategy import FSDP2Strategy

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    seen = []

    def record(*args, **kwargs):
        seen.append(kwargs)
        raise _StopError

    monkeypatch.setattr(dist, "init_process_group", record)
    # a backend this CPU run would never choose by itself, so a dropped option cannot pass
    strategy = FSDP2Strategy(process_group_backend="cuda:nccl,cpu:gloo", timeout=datetime.timedelta(seconds=42))
    with pytest.raises(_StopError):
        strategy.setup_environment()
    assert seen[-1]["backend"] == "cuda:nccl,cpu:gloo" and seen[-1]["timeout"] == datetime.timedelta(seconds=42)
    with pytest.raises(_StopError):
        FSDP2Strategy().setup_environment()
    assert seen[-1]["backend"] == "gloo" and seen[-1]["timeout"] == datetime.timedelta(minutes=30)
    assert not dist.is_initialized()


def test_regression_lightning_adapter_passes_backend_and_timeout(monkeypatch):
    """Issue 12 §2.9, the Lightning adapter: its own process-group start uses the options."""
    pytest.importorskip("lightning")
    import datetime

    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import ParallelStrategy

    import zeta_fsdp.lightning as zl

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.setenv(var, "0")  # recorded, so the values the adapter sets are undone too
        monkeypatch.delenv(var)
    seen = []

    def record(*args, **kwargs):
        seen.append(kwargs)
        raise _StopError

    monkeypatch.setattr(ParallelStrategy, "setup_environment", lambda self: None)  # the accelerator's set-up
    monkeypatch.setattr(dist, "init_process_group", record)
    for options, backend, timeout in (
        ({"process_group_backend": "cuda:nccl,cpu:gloo", "timeout": datetime.timedelta(seconds=42)}, None, None),
        ({}, "gloo", datetime.timedelta(minutes=30)),
    ):
        strategy = zl.FSDP2Strategy(**options)
        strategy.parallel_devices = [torch.device("cpu")]
        strategy.cluster_environment = LightningEnvironment()
        with pytest.raises(_StopError):
            strategy.setup_environment()
        assert seen[-1]["backend"] == (backend or options["process_group_backend"]), seen[-1]
        assert seen[-1]["timeout"] == (timeout or options["timeout"]), seen[-1]


def test_regression_current_epoch_step_is_the_step_number():
    """Issue 12 §2.3: NeMo's current_epoch_step is an int; comparisons and arithmetic must work."""
    from zeta_fsdp.strategy import EpochStep

    step = EpochStep(epoch=2, step=5)
    assert step >= 4 and step + 1 == 6 and int(step) == 5 and f"{step:d}" == "5"
    assert step.epoch == 2 and step.step == 5 and tuple(step) == (2, 5) and step[0] == 2
    epoch, n = step
    assert (epoch, n) == (2, 5) and step == (2, 5) and step != (1, 5)
    import pickle

    assert pickle.loads(pickle.dumps(step)).epoch == 2


def test_unknown_fsdp_kwarg_is_an_error_at_construction():
    """A misspelt fsdp() option used to surface as a TypeError inside parallelize(), after the
    process group had started; it must be a ValueError naming it (and the accepted names) at once."""
    import torch.distributed as dist

    from zeta_fsdp.strategy import FSDP2Strategy

    with pytest.raises(ValueError, match=r"'TransformerBlok'.*Accepted.*'TransformerBlock'.*'cpu_offload'") as info:
        FSDP2Strategy(TransformerBlok=torch.nn.Module)
    assert "'model'" not in str(info.value), "fsdp()'s model is not an option"
    with pytest.raises(ValueError, match="auto_wrapp"):
        FSDP2Strategy(shard_strat="FULL_SHARD", auto_wrapp=True)
    assert not dist.is_initialized(), "validation started a process group"
    # every fsdp() option except the model (mp and device are the strategy's own) is accepted
    names = [n for n in inspect.signature(__import__("zeta_fsdp").fsdp).parameters if n not in ("model", "mp")]
    options = {n: None for n in names if n not in ("shard_strat",)}
    assert set(FSDP2Strategy(**options).fsdp_kwargs) == set(options) - {"device"}
    # a custom parallelize_fn may take options of its own; a typo is still caught

    def custom(module, device_mesh, mp_policy, *, float8=False, **kwargs):
        return module

    assert FSDP2Strategy(parallelize_fn=custom, float8=True).fsdp_kwargs == {"float8": True}
    with pytest.raises(ValueError, match="float9"):
        FSDP2Strategy(parallelize_fn=custom, float9=True)


def test_every_public_name_has_a_docstring_example():
    """Properties and methods of FSDP2Strategy, and the public API of loss.py / training.py."""
    from zeta_fsdp import loss, strategy, training

    lacking = []
    owners = [strategy.FSDP2Strategy, strategy.EpochStep, training.MemoryReport]
    owners += [getattr(loss, n) for n in loss.__all__]
    for owner in owners:
        for name, value in vars(owner).items():
            if name.startswith("_") or not (callable(value) or isinstance(value, property)):
                continue
            doc = (value.fget if isinstance(value, property) else value).__doc__
            if "Example:" not in (doc or ""):
                lacking.append(f"{owner.__name__}.{name}")
    for module in (loss, strategy, training):
        lacking += [
            f"{module.__name__}.{n}" for n in module.__all__ if "Example:" not in (getattr(module, n).__doc__ or "")
        ]
    for name in ("forward", "reduce"):  # inherited by both reductions
        if "Example:" not in (getattr(loss.MaskedTokenLossReduction, name).__doc__ or ""):
            lacking.append(f"MaskedTokenLossReduction.{name}")
    assert not lacking, f"public names without an Example: in their docstring: {lacking}"


def test_resolve_sizes_and_optimizer_forms():
    from zeta_fsdp.strategy.options import resolve_sizes as _resolve_sizes
    from zeta_fsdp.strategy.steps import parse_optimizers as _parse_optimizers

    assert _resolve_sizes("auto", "auto", 8) == (8, 1)
    assert _resolve_sizes("auto", 2, 8) == (4, 2)
    assert _resolve_sizes(2, 4, 8) == (2, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot equal the world size 8"):
        _resolve_sizes("auto", 3, 8)
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert _parse_optimizers(opt) == ([opt], [])
    assert _parse_optimizers([opt]) == ([opt], [])
    assert _parse_optimizers(([opt], [sched])) == ([opt], [sched])
    assert _parse_optimizers({"optimizer": opt, "lr_scheduler": sched}) == ([opt], [sched])
    assert _parse_optimizers({"optimizer": opt, "lr_scheduler": {"scheduler": sched}}) == ([opt], [sched])
    with pytest.raises(ValueError):
        _parse_optimizers("adam")


# ----------------------------------------------------------------------------- the example loop

LOSS_LINE = re.compile(r"^step (\d+): loss ([0-9.]+) grad-norm ([0-9.]+)$", re.M)


def _losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v, _ in LOSS_LINE.findall(stdout)}


@pytest.mark.launch
def test_example_resumes_on_one_process(dist_results, session_tmp):
    """The 2-rank example run (case above) left a step-4 checkpoint; plain ``python`` resumes it on
    ONE process (notebook-style group, clean exit): the full checkpoint loads at any world size,
    the data order and optimizer state carry over, so steps 5 and 6 reproduce the 2-rank run."""
    check_case(
        dist_results("strategy_cases.py", 2, TWO_RANK_CASES), "example_strategy_loop_trains_checkpoints_and_resumes"
    )
    example = session_tmp / "strategy_cases" / "example_loop"  # dist_results launched it there
    losses = json.loads((example / "losses.json").read_text())
    ckpt = example / "ckpt"
    (ckpt / "step_000006.ckpt").unlink()  # the 2-rank resume wrote it again
    args = ["--steps", "6", "--save-every", "2", "--keep", "2", "--ckpt-dir", str(ckpt), "--resume"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "strategy_loop.py"), *args],
        cwd=ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "resumed from" in proc.stdout and "step=4" in proc.stdout, proc.stdout
    again = _losses(proc.stdout)
    assert sorted(again) == [5, 6], proc.stdout
    for step in (5, 6):
        # printed with 6 decimals; micro-batches group samples differently at 1 rank
        assert abs(again[step] - losses[step - 1]) <= 2e-5, (step, again[step], losses[step - 1])
    assert (ckpt / "step_000006.ckpt").is_file()


def test_no_sync_defer_is_checked_before_parallelize(monkeypatch):
    """``strategy.no_sync(defer=...)`` passes ``defer`` through; a bad value fails before
    ``parallelize()`` (which would start a process group and shard the model)."""
    from zeta_fsdp.strategy import FSDP2Strategy, core

    strategy = FSDP2Strategy()
    calls = []
    monkeypatch.setattr(strategy, "parallelize", lambda: calls.append("parallelize"))
    monkeypatch.setattr(strategy, "_require_module", lambda: "the module")
    with pytest.raises(ValueError, match=r"defer='replicas' is not accepted. Accepted: 'all'"):
        strategy.no_sync(defer="replicas")
    assert calls == []
    seen = {}
    monkeypatch.setattr(core, "no_sync", lambda module, defer: seen.update(module=module, defer=defer))
    strategy.no_sync(defer="all_reduce")
    assert calls == ["parallelize"] and seen == {"module": "the module", "defer": "all_reduce"}
    strategy.no_sync()
    assert seen["defer"] == "all"

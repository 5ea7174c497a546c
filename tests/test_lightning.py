"""``zeta_fsdp.lightning.FSDP2Strategy`` in a real ``Trainer.fit`` at 2 CPU ranks, both launchers.

The work is in ``lightning_fit.py`` (a script file: Lightning's own launcher re-runs it for each
rank). Every comparison is exact (0.0), on any kernel set: the single-process reference computes
each rank's gradient on that rank's own 2 samples (same shapes, same kernels, same rounding) and
averages the two as the reduce-scatter does, ``(g0 + g1) / 2`` (a sum of two floats is the same in
either order, halving is exact); AdamW is elementwise. Resume and the bf16 twin (zeta's own
strategy, clipping with ``strategy.clip_grad_norm_``) run the very same operations.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, dist_test, rank_env

pytest.importorskip("lightning")

# NeMo's strategy tests and Lightning's ModelParallelStrategy tests, real Trainer runs (lightning_cases.py)
test_nemo_and_lightning_two_ranks = dist_test("lightning_cases.py", 2)
test_nemo_and_lightning_four_ranks = dist_test("lightning_cases.py", 4)


def run(tmp_path, mode: str, launcher: str) -> dict:
    out = tmp_path / f"{mode}_{launcher}"
    script = str(ROOT / "tests" / "lightning_fit.py")
    args = [script, "--out", str(out), "--mode", mode]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    else:  # Lightning's _SubprocessScriptLauncher starts rank 1 by re-running the script
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=600)
    files = sorted(out.glob("rank*.json"))
    assert proc.returncode == 0 and len(files) == 2, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    results = [json.loads(f.read_text()) for f in files]
    assert results[0] == results[1], "ranks disagree"
    return results[0]


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["torchrun", "lightning"])
def test_fit_parity_checkpoints_and_resume(tmp_path, launcher):
    r = run(tmp_path, "fit", launcher)
    assert r["world"] == 2 and r["global_step"] == 8
    assert r["ref_diff"] == 0.0, r  # bit-exact single-process reference (see module docstring)
    assert r["files"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], r["files"]
    assert r["val_loss_logged"]
    assert r["mesh"] == [["data_parallel", "tensor_parallel"], 2, 1], r["mesh"]  # Lightning's dim names
    assert r["param_mesh"] == ["('data_parallel',)"], r["param_mesh"]
    # resumed from step 4: only the remaining 4 steps ran, and it ends where the uninterrupted run did
    assert r["resumed_batches"] == 4 and r["resumed_global_step"] == 8, r
    assert r["resume_diff"] == 0.0, r
    assert r["hparams"] == {"width": 16, "depth": 2} and r["ckpt_hparams_is_dataclass"]


@pytest.mark.launch
def test_bf16_mixed_is_the_fsdp2_policy(tmp_path):
    r = run(tmp_path, "bf16", "torchrun")
    assert r["forward_dtypes"] == ["torch.bfloat16"], r  # parameters cast by FSDP, not autocast
    assert r["master_dtypes"] == ["torch.float32"], r
    assert r["twin_diff"] == 0.0, r  # == zeta_fsdp.FSDP2Strategy(mp_policy="bf16") + its clipping, same data
    assert r["clipped"], r  # gradient_clip_val=0.5 really clipped (a norm above it was seen)


@pytest.mark.launch
def test_import_zeta_fsdp_does_not_import_lightning():
    code = "import sys, zeta_fsdp; assert 'lightning' not in sys.modules and 'zeta_fsdp.lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=rank_env(), check=True)


def test_precision_mapping_and_bad_precision():
    import torch

    from zeta_fsdp.lightning import precision_policy

    assert precision_policy("bf16-mixed").param_dtype == torch.bfloat16
    assert precision_policy("16-mixed").param_dtype == torch.float16
    assert precision_policy("bf16-mixed").reduce_dtype == torch.float32
    assert precision_policy("32-true") is None
    with pytest.raises(ValueError, match="precision='bf16-true' is not accepted"):
        precision_policy("bf16-true")


def test_api_reference_lists_the_lightning_names():
    """``zeta_fsdp.lightning``'s public names are documented in docs/api.md under their submodule path
    (they are not in ``zeta_fsdp.__all__``: that would import Lightning), each with an example."""
    import zeta_fsdp.lightning as zl

    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in zl.__all__ if f"`zeta_fsdp.lightning.{n}" not in text]
    assert not missing, f"docs/api.md does not list: {missing}"
    lacking = [n for n in zl.__all__ if callable(getattr(zl, n)) and "Example" not in (getattr(zl, n).__doc__ or "")]
    assert not lacking, lacking
    setup = (ROOT / "setup.py").read_text()
    assert '"lightning": ["lightning>=2.4"]' in setup and '"lightning>=2.4"' in setup.split('"test":')[1].split("]")[0]


STEP_LINE = re.compile(r"^step (\d+): loss ([0-9.]+)$", re.M)


@pytest.mark.launch
def test_example_lightning_train_fits_checkpoints_and_resumes(tmp_path):
    """``examples/lightning_train.py`` as a user runs it (plain ``python``: Lightning's launcher starts
    rank 1): 6 steps, checkpoints at steps 3 and 6 + last; then a resume from ``step=3.ckpt`` trains
    only steps 4-6 and prints the very same losses (the checkpoint is at an epoch's end: same data,
    same operations, so the printed values are equal digit for digit)."""

    def example(*args: str) -> str:
        cmd = [sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--steps", "6", *args]
        proc = subprocess.run(cmd, cwd=tmp_path, env=rank_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return proc.stdout

    first = example("--ckpt-dir", str(tmp_path / "run"))
    losses = {int(s): v for s, v in STEP_LINE.findall(first)}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], first
    assert float(losses[6]) < float(losses[1]) - 0.2, losses  # it learns
    assert "checkpoints: last.ckpt step=3.ckpt step=6.ckpt" in first, first
    again = example("--ckpt-dir", str(tmp_path / "resumed"), "--resume", str(tmp_path / "run" / "step=3.ckpt"))
    resumed = {int(s): v for s, v in STEP_LINE.findall(again)}
    assert resumed == {s: losses[s] for s in (4, 5, 6)}, (resumed, losses)
    done = re.compile(r"^done: global_step 6, val_loss ([0-9.]+)$", re.M)
    assert done.findall(again) == done.findall(first) != [], (first[-500:], again[-500:])


def test_nemo_defaults_and_arguments_without_a_process_group():
    """NeMo's test_init / test_lightning_restore_optimizer / test_checkpoint_io, in-process: its attributes
    are the core's (one value), Lightning's save_distributed_checkpoint is accepted, and reading the
    mesh before the Trainer set up the processes raises (as Lightning's) instead of starting a group."""
    import torch.distributed as dist

    from zeta_fsdp.lightning import FSDP2Strategy

    strategy = FSDP2Strategy(data_parallel_size=2, tensor_parallel_size=1)
    assert strategy.mp_policy is strategy.core.mp_policy is not None
    assert strategy.parallelize_fn is strategy.core.parallelize_fn is not None
    assert strategy.lightning_restore_optimizer is True and strategy.trainer is None
    strategy.mp_policy = "changed"
    assert strategy.core.mp_policy == "changed"
    io = object()
    strategy.checkpoint_io = io
    assert strategy.checkpoint_io is io is strategy.core.checkpoint_io
    with pytest.raises(RuntimeError, match="device mesh"):
        _ = strategy.device_mesh
    assert not dist.is_initialized()
    assert FSDP2Strategy(save_distributed_checkpoint=True).core.checkpoint_format == "sharded"
    assert FSDP2Strategy(save_distributed_checkpoint=False).core.checkpoint_format == "full"
    with pytest.raises(ValueError, match="disagree"):
        FSDP2Strategy(save_distributed_checkpoint=True, checkpoint_format="full")
    with pytest.raises(ValueError, match="save_distributed_checkpoint='yes'"):
        FSDP2Strategy(save_distributed_checkpoint="yes")
    # NeMo's own constructor arguments: a NeMo script runs unchanged, or is told what is unsupported
    from torch.distributed.fsdp import CPUOffloadPolicy

    plan = {"model.w1": "colwise"}
    nemo = FSDP2Strategy(
        context_parallel_size=1, sequence_parallel=False, use_hf_tp_plan=True, custom_tp_plan=plan,
        offload_policy=CPUOffloadPolicy(),
    )  # fmt: skip
    assert nemo.core.options.tp_plan is plan and nemo.core.fsdp_kwargs == {"cpu_offload": True}
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        FSDP2Strategy(context_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        FSDP2Strategy(sequence_parallel=True)


def test_nemo_step_result_uses_the_module_reduction():
    """NeMo's _step_proxy: the module's own ``<step>_loss_reduction`` reduces the step's output, else
    ``{"avg": output}``; a zeta reduction (no "avg" in its record) gets its global mean as "avg"."""
    import torch

    from zeta_fsdp.loss import MaskedTokenLossReduction
    from zeta_fsdp.strategy.steps import nemo_step_result

    plain = torch.nn.Linear(2, 2)
    out = torch.tensor(0.25)
    assert nemo_step_result(plain, "validation", None, out) == (out, {"avg": out})
    plain.validation_loss_reduction = MaskedTokenLossReduction(validation_step=True)
    batch = {"loss_mask": torch.tensor([1, 1, 0])}
    loss, reduced = nemo_step_result(plain, "validation", batch, torch.tensor([1.0, 3.0, 7.0]))
    assert loss.item() == 2.0 and reduced["avg"].item() == 2.0 and "loss_sum_and_ub_size" in reduced

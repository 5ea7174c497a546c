"""``zeta_fsdp.lightning.FSDP2Strategy`` in a real ``Trainer.fit`` at 2 CPU ranks, both launchers.

The work is in ``lightning_fit.py`` (a script file: Lightning's own launcher re-runs it for each
rank). Tolerances: the fp32 reference sums the same 4 samples' gradients in another order (FSDP
reduce-scatters two 2-sample means); for this 8 -> 16 -> 16 -> 1 MLP over 8 AdamW steps the
difference stays within a few fp32 ulps of the O(1) weights, so 1e-5 (~80 ulps) is a bound that
holds on any kernel set. Resume and the bf16 twin run the very same operations: bit-equal (0.0).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, rank_env

pytest.importorskip("lightning")


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


@pytest.mark.parametrize("launcher", ["torchrun", "lightning"])
def test_fit_parity_checkpoints_and_resume(tmp_path, launcher):
    r = run(tmp_path, "fit", launcher)
    assert r["world"] == 2 and r["global_step"] == 8
    assert r["ref_diff"] <= 1e-5, r  # single-process reference (see module docstring)
    assert r["files"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], r["files"]
    assert r["val_loss_logged"]
    # resumed from step 4: only the remaining 4 steps ran, and it ends where the uninterrupted run did
    assert r["resumed_batches"] == 4 and r["resumed_global_step"] == 8, r
    assert r["resume_diff"] == 0.0, r
    assert r["hparams"] == {"width": 16, "depth": 2} and r["ckpt_hparams_is_dataclass"]


def test_bf16_mixed_is_the_fsdp2_policy(tmp_path):
    r = run(tmp_path, "bf16", "torchrun")
    assert r["forward_dtypes"] == ["torch.bfloat16"], r  # parameters cast by FSDP, not autocast
    assert r["master_dtypes"] == ["torch.float32"], r
    assert r["twin_diff"] == 0.0, r  # == zeta_fsdp.FSDP2Strategy(mp_policy="bf16") on the same data


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

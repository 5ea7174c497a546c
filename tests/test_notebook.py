"""The seed examples run unchanged in a fresh `python`: no init_process_group, no torchrun."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, program_lines, rank_env

pytestmark = pytest.mark.launch  # every test here starts processes

SEED_EXAMPLES = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import FSDPModule
    from zeta_fsdp import fsdp, fsdp_engine, get_wrap_plan

    # Basic FSDP wrapper (Zeta doc, unchanged)
    model = nn.Sequential(
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    fsdp_model = fsdp(model)
    # Zeta's default NO_SHARD in fp32 runs on DDP's engine: the same object, plain tensor weights
    assert fsdp_model is model and fsdp_engine(model) == "replicate" and not isinstance(model, FSDPModule)
    assert model[0].weight.grad is None
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    out = fsdp_model(torch.randn(3, 784))
    out.sum().backward()
    assert model[0].weight.grad is not None
    print("basic", tuple(out.shape))

    # Automatic layer wrapping (Zeta doc, with a block that does something)
    class TransformerBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = nn.Linear(256, 256)

        def forward(self, x):
            return x + self.ff(x)

    model = nn.Sequential(
        nn.Linear(784, 256),
        TransformerBlock(),
        nn.Linear(256, 10),
    )
    fsdp_model = fsdp(model, auto_wrap=True, TransformerBlock=TransformerBlock)
    assert [u.kind for u in get_wrap_plan(model).units] == ["block", "head", "root"], get_wrap_plan(model).table()
    print("auto_wrap", tuple(fsdp_model(torch.randn(2, 784)).shape))

    # Advanced configuration (Zeta doc, unchanged)
    model = nn.Sequential(
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    fsdp_model = fsdp(model, mp="bf16", shard_strat="FULL_SHARD")
    assert isinstance(model, FSDPModule) and fsdp_engine(model) == "fully_shard"
    out = fsdp_model(torch.randn(2, 784))
    out.float().sum().backward()  # after backward FSDP holds the fp32 sharded parameters again
    print("advanced", out.dtype, model[0].weight.dtype, model[0].weight.grad.dtype)
    """
)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300
    )


def test_seed_examples_run_in_a_fresh_python():
    proc = run_python(SEED_EXAMPLES)
    assert proc.returncode == 0, proc.stderr
    assert program_lines(proc.stdout) == [
        "basic (3, 10)",
        "auto_wrap (2, 10)",
        "advanced torch.bfloat16 torch.float32 torch.float32",
    ]


def test_a_group_the_user_made_is_never_torn_down():
    proc = run_python(
        textwrap.dedent(
            """
            import torch.distributed as dist, torch.nn as nn
            from zeta_fsdp import fsdp, shutdown
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            group = dist.group.WORLD
            fsdp(nn.Linear(4, 4), shard_strat="FULL_SHARD")
            shutdown()
            assert dist.is_initialized() and dist.group.WORLD is group
            print("kept")
            """
        )
    )
    assert proc.returncode == 0, proc.stderr
    assert program_lines(proc.stdout) == ["kept"]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_example_script_trains_on_two_ranks(strategy):
    from conftest import torchrun

    proc = torchrun(2, "examples/train_gpt.py", "--steps", "6", "--shard-strat", strategy)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses
    assert "sharded over 2 rank(s)" in proc.stdout
    # NO_SHARD runs on DDP's engine; the GPT uses every parameter, so DDP is not asked to search for
    # unused ones, and its reducer's warning about a search that found none (C++) is not printed
    assert "find_unused_parameters" not in proc.stderr, proc.stderr[-3000:]


def test_notebook_example_runs_without_group_setup():
    proc = subprocess.run(
        [sys.executable, "examples/notebook.py"], cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 5
    first, last = (float(s.split()[3]) for s in (steps[0], steps[-1]))
    assert last < first, steps
    assert "FSDPGPT | tied: True" in proc.stdout
    assert "Sharded Param" in proc.stdout and "OptState" in proc.stdout

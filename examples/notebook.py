# %% [markdown]
# # zeta_fsdp in a notebook
#
# A py:percent notebook (open it in Jupyter/VS Code as a notebook, or run it with `python`).
# No `init_process_group`, no `torchrun`: `fsdp()` starts a one-process group itself, so the
# code you write here runs unchanged under `torchrun --nproc-per-node 8` later.

# %%
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd() if (Path.cwd() / "examples").is_dir() else Path(__file__).resolve().parents[1]))
from zeta_fsdp import fsdp  # noqa: E402
from zeta_fsdp.models.gpt import Block, lm_loss, small  # noqa: E402
from zeta_fsdp.wrapped import compute_device  # noqa: E402
from zeta_fsdp.wrapping import build_wrap_plan  # noqa: E402

torch.manual_seed(0)
model = small()
reference = copy.deepcopy(model)  # an unwrapped copy, to check the sharded model against

# %% [markdown]
# ## 1. See the plan before sharding: which modules become FSDP units

# %%
print(build_wrap_plan(model, auto_wrap=True, transformer_block=Block).table())

# %% [markdown]
# ## 2. One line

# %%
model = fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
device = compute_device(model)  # cuda:0 on a GPU machine, else CPU: the reference and batches go there too
reference.to(device)
ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
print(type(model).__name__, "| tied:", model.head.weight is model.tok_emb.weight)

# %% [markdown]
# ## 3. Train a few steps; the sharded model tracks the unwrapped one

# %%
for step in range(5):
    start = torch.randint(0, 37, (4, 1))
    tokens = ((start + torch.arange(12)) % 37).to(device)
    losses = []
    for net, opt in ((model, optimizer), (reference, ref_optimizer)):
        loss = lm_loss(net(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    print(f"step {step}: fsdp {losses[0]:.5f}  reference {losses[1]:.5f}")
    assert abs(losses[0] - losses[1]) < 1e-5

# %% [markdown]
# ## 4. Memory by category (FSDPMemTracker, exact on CPU)

# %%
from zeta_fsdp.measure import peak_memory_by_category  # noqa: E402


def train_step():
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


peak = peak_memory_by_category(model, optimizer, train_step, inputs=(tokens,))
for category, nbytes in peak.items():
    print(f"{category:>16}: {nbytes / 1024:8.1f} KiB")

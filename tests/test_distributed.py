"""``zeta_fsdp.distributed`` without peers: the helpers every module uses, and their defaults.

Multi-rank behaviour (meshes, process groups under torchrun, ``shutdown``) is exercised by every
``*_cases.py`` launch; ``on_all_ranks`` across ranks by the strategy and hf cases.
"""

from __future__ import annotations

import pytest
import torch

from zeta_fsdp.distributed import (
    LAUNCHER_ENV_VARS,
    comm_device,
    get_rank,
    get_world_size,
    is_distributed,
    mesh_shape,
    on_all_ranks,
    without_launcher_env,
)
from zeta_fsdp.options import resolve_sharding


def test_rank_helpers_without_a_process_group():
    assert not is_distributed()
    assert (get_rank(), get_world_size(), comm_device()) == (0, 1, torch.device("cpu"))


def test_without_launcher_env_drops_only_the_launcher_variables():
    env = {name: "1" for name in LAUNCHER_ENV_VARS} | {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert without_launcher_env(env) == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(
    "strategy, world, expected",
    [("FULL_SHARD", 8, (8,)), ("NO_SHARD", 4, (4, 1)), ("HYBRID_SHARD", 16, (2, 8))],
)
def test_mesh_shapes(strategy, world, expected):
    assert tuple(mesh_shape(resolve_sharding(strategy), world, local_world_size=8)) == expected


def test_on_all_ranks_alone_returns_or_raises_the_original():
    assert on_all_ranks(lambda: 3) == 3
    with pytest.raises(KeyError, match="missing"):
        on_all_ranks(lambda: {}["missing"])  # one process: the error as it was, not a copy


# --- Device choice on a GPU host, with the device count and backend patched (only a GPU can show
# the real thing: tests/test_gpu.py). Named for what they stand in for.


def _fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_patched_gpu_host_device_follows_local_rank_when_visible(monkeypatch):
    from zeta_fsdp.distributed import choose_device

    _fake_cuda(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert choose_device() == torch.device("cuda", 1)
    assert choose_device(device="cuda") == torch.device("cuda", 1)
    assert choose_device(device="cpu") == torch.device("cpu")


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_patched_gpu_host_more_ranks_than_gpus_is_a_clear_error_on_every_local_rank(monkeypatch, local_rank):
    """torchrun --nproc-per-node 2 on a 1-GPU box: every local rank raises (rank 0 too, so none waits
    for a peer that died), naming LOCAL_RANK, the device count, CUDA_VISIBLE_DEVICES and the way out."""
    from zeta_fsdp.distributed import choose_device

    _fake_cuda(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError) as err:
        choose_device()
    for needle in (f"LOCAL_RANK={local_rank}", "1 CUDA device(s)", "CUDA_VISIBLE_DEVICES=0", "device='cpu'"):
        assert needle in str(err.value), str(err.value)
    with pytest.raises(RuntimeError, match="cuda:3"):
        choose_device(device="cuda:3")


def test_patched_gpu_host_an_existing_group_decides_the_device(monkeypatch):
    """A gloo-only group the caller started means CPU even where CUDA exists; an NCCL one means cuda:LOCAL_RANK."""
    import torch.distributed as dist

    from zeta_fsdp.distributed import choose_device

    _fake_cuda(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    backend = {"name": "gloo"}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    assert choose_device() == torch.device("cpu")
    assert choose_device(device="cuda") == torch.device("cuda", 1)  # device= still wins
    for name in ("nccl", "cuda:nccl,cpu:gloo"):
        backend["name"] = name
        assert choose_device() == torch.device("cuda", 1)

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

"""What the memory estimate and the dry run share: reading the job's size and mesh, naming dtypes."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..distributed import expected_world_size, mesh_shape

# Default GPUs per node for HYBRID meshes when planning a cluster from a laptop.
DEFAULT_LOCAL_WORLD_SIZE = 8


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``; ``"none"`` for ``None``."""
    return "none" if dtype is None else str(dtype).replace("torch.", "")


def resolve_world_and_mesh(
    spec: Any, world_size: Optional[int], replicate_size: Optional[int], local_world_size: Optional[int], caller: str
) -> tuple[int, tuple[int, ...]]:
    """The job's world size (the launcher's when ``None``) and the mesh ``fsdp()`` would build."""
    world_size = expected_world_size() if world_size is None else world_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{caller}(): world_size={world_size!r} is not accepted. Accepted: a positive int.")
    local = min(world_size, DEFAULT_LOCAL_WORLD_SIZE) if local_world_size is None else local_world_size
    return world_size, mesh_shape(
        spec, world_size, local_world_size=local, replicate_size=replicate_size, caller=caller
    )

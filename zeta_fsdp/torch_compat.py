"""Which torch releases the package runs on, and the few places they differ.

Importing this module (``import zeta_fsdp`` does so before anything else) runs
``check_torch_version()``: below ``MIN_TORCH`` it raises at once, before any other module touches
``torch.distributed``, instead of a wrong gradient later (torch 2.8 sums gradients over gloo where
2.10 averages them).
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

if TYPE_CHECKING:  # imported where used: an old torch must reach check_torch_version() first
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["MIN_TORCH", "REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE", "UnsupportedTorchError", "check_torch_version"]
__all__ += ["HAS_PARAM_DTYPE_OVERRIDE", "all_gather_single", "foreach_as_plain", "local_tensor", "param_mp_policy"]
__all__ += ["torch_release"]

# The oldest release the whole suite passes on (docs/install.md has the table and how it was made).
# setup.py's install_requires says the same (tests/test_torch_compat.py and the built wheel's
# metadata in tests/test_install.py check it).
MIN_TORCH: tuple[int, int] = (2, 10)


class UnsupportedTorchError(ImportError):
    """``import zeta_fsdp`` on a torch older than ``MIN_TORCH``."""


def torch_release(version: Optional[str] = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``torch.__version__`` when ``None``)."""
    text = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"cannot read a torch release from {text!r}: expected 'MAJOR.MINOR...' such as '2.13.0'")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: Optional[str] = None) -> None:
    """Raise ``UnsupportedTorchError`` when ``version`` (default: the installed torch) is below ``MIN_TORCH``.

    Example:
        >>> check_torch_version("2.15.0")  # supported: returns None
        >>> check_torch_version("2.9.1")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        zeta_fsdp.torch_compat.UnsupportedTorchError: zeta_fsdp needs torch >= 2.10; this environment has torch 2.9.1 ...
    """
    installed = str(torch.__version__ if version is None else version)
    if torch_release(installed) < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise UnsupportedTorchError(
            f"zeta_fsdp needs torch >= {floor}; this environment has torch {installed} "
            f"(imported from {torch.__file__}). Older releases compute wrong results with FSDP2 on "
            f"CPU (e.g. summed instead of averaged gradients on 2.8). Install a newer one: "
            f"pip install 'torch>={floor}'"
        )


def param_mp_policy(group: Any, fsdp_param: Any) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` FSDP2 applies to one parameter of a parameter group.

    torch <= 2.14 keeps one policy per group (``FSDPParamGroup.mp_policy``); 2.15 keeps it on
    each ``FSDPParam`` (``mp_policy``). Both are private: this is the one place that reads them.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for owner in (fsdp_param, group):
        policy = getattr(owner, "mp_policy", None)
        if isinstance(policy, MixedPrecisionPolicy):
            return policy
    raise AttributeError(
        f"cannot read the MixedPrecisionPolicy of an FSDP parameter on torch {torch.__version__}: neither "
        f"{type(fsdp_param).__name__}.mp_policy nor {type(group).__name__}.mp_policy exists"
    )


# ``MixedPrecisionPolicy(reduce_dtype=None)``: torch >= 2.15 reduces (and accumulates under
# no_sync) each gradient in its parameter's own dtype; older releases in ``param_dtype``.
REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE: bool = torch_release() >= (2, 15)


def _has_param_dtype_override() -> bool:
    from dataclasses import fields

    from torch.distributed.fsdp import MixedPrecisionPolicy

    return "param_dtype_override_fn" in {f.name for f in fields(MixedPrecisionPolicy)}


check_torch_version()  # on import (see the module docstring)

# ``MixedPrecisionPolicy(param_dtype_override_fn=...)`` (torch >= 2.15): one parameter of a unit may
# compute in its own dtype. Without it, ``keep_fp32`` parameters get FSDP units of their own.
HAS_PARAM_DTYPE_OVERRIDE: bool = _has_param_dtype_override()


@contextlib.contextmanager
def dtensor_random_from_local_generator(mesh: Any) -> Iterator[None]:
    """In the block, DTensor random ops on ``mesh`` draw from the generator of their local tensor's device
    (seeded by the caller), not from DTensor's offset-based CUDA RNG tracker.

    Why: under CPU offload on a CUDA mesh the shards are CPU tensors; the tracker forks and restores the
    CPU generator around each op (it only advances the CUDA state), so every same-shaped tensor would get
    the same numbers. The tracker is private (``torch.distributed.tensor._random``): this is its one reader.
    """
    try:
        from torch.distributed.tensor import _random

        if getattr(_random, "_rng_tracker", None) is None and _random.is_rng_supported_mesh(mesh):
            _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh)  # what DTensor's first random op makes
        tracker = _random._rng_tracker
        before = tracker.distribute_region_enabled
    except Exception:  # noqa: BLE001 - a torch without this tracker: DTensor draws per shard already
        yield
        return
    tracker.distribute_region_enabled = False
    try:
        yield
    finally:
        tracker.distribute_region_enabled = before


def all_gather_single(output: torch.Tensor, local: torch.Tensor, **kwargs: Any) -> Any:
    """``torch.distributed.all_gather_single`` (torch >= 2.13, where the old name
    ``all_gather_into_tensor`` warns on every call) or the old name on older releases.

    Example:
        >>> callable(all_gather_single)
        True
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, **kwargs)


def local_tensor(tensor: Any) -> Any:
    """A DTensor's own local tensor (sharing its storage: what ``to_local()`` returns under no_grad), or
    ``tensor`` itself when it is not a DTensor. It reads DTensor's ``_local_tensor`` (present on every release
    from ``MIN_TORCH``) without ``to_local()``'s Python call: the per-step paths (the optimizer's local step,
    clipping) pay it for every parameter.

    Example:
        >>> t = torch.zeros(2)
        >>> local_tensor(t) is t
        True
    """
    return getattr(tensor, "_local_tensor", tensor)


def foreach_as_plain(tensor_type: type) -> None:
    """Let torch's optimizers pick their default implementation for ``tensor_type`` (a ``torch.Tensor``
    subclass that runs no override) as for a plain tensor: with ``foreach=None`` and ``fused=None`` they step
    foreach only over types in ``torch.optim.optimizer._foreach_supported_types`` (on CUDA; CPU steps
    single-tensor either way). DTensor registers itself there the same way on every release from ``MIN_TORCH``.

    Example:
        >>> foreach_as_plain(torch.Tensor)  # already there: nothing changes
    """
    import torch.optim.optimizer as optimizer_module  # a submodule: not an attribute of torch.optim until imported

    supported = getattr(optimizer_module, "_foreach_supported_types", None)
    if supported is not None and tensor_type not in supported:
        supported.append(tensor_type)

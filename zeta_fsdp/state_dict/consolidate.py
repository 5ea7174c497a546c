"""Offline consolidation of a checkpoint into one file of weights (``torch.save`` or safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..files import atomic_write
from .checks import FAILURES, LAYOUT_KEY, MODEL_PREFIX, CheckpointError, PathLike, error_reason, short_list
from .reader import dcp_load, open_checkpoint


def consolidate_checkpoint(dcp_dir: PathLike, out_file: PathLike, *, overwrite: bool = False) -> Path:
    """Turn a checkpoint into one file of the model's weights: offline, one process, no process group.

    ``out_file`` ending in ``.safetensors`` is written with ``safetensors``, anything else with
    ``torch.save`` (``weights_only=True`` loads it). Keys are the unwrapped model's; optimizer state and
    ``extra`` are left out. Returns ``out_file``. Also ``python -m zeta_fsdp consolidate DIR OUT``.

    Example:
        consolidate_checkpoint("ckpt/step_100", "model.pt")
        GPT(cfg).load_state_dict(torch.load("model.pt", weights_only=True))
    """
    caller = "consolidate_checkpoint()"
    src, out = Path(dcp_dir), Path(out_file)
    metadata = open_checkpoint(src, caller)
    use_safetensors = out.suffix == ".safetensors"
    if use_safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise ImportError(
                f"{caller}: writing {out.name} needs the safetensors package: pip install 'zeta-fsdp[safetensors]'"
            ) from e
    if out.exists() and not overwrite:
        raise FileExistsError(f"{caller}: {out} already exists; pass overwrite=True to replace it.")
    weights = _read_weights(src, metadata, caller, copy_ties=use_safetensors)
    odd = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)] if use_safetensors else []
    if odd:
        raise CheckpointError(f"{caller}: safetensors holds tensors only; these entries are not: {short_list(odd)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if use_safetensors:
        return atomic_write(out, lambda tmp: save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp)))
    return atomic_write(out, lambda tmp: torch.save(weights, tmp))


def _read_weights(src: Path, metadata: Any, caller: str, copy_ties: bool) -> dict[str, Any]:
    """The checkpoint's model entries, keyed as the unwrapped model's (its order first), every tied name
    filled (``copy_ties``: with a copy, as safetensors refuses shared tensors; else the same tensor)."""
    state: dict[str, Any] = {
        key: torch.zeros(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX)
    }
    if not state:
        raise CheckpointError(f"{caller}: {src} holds no model weights (no '{MODEL_PREFIX}*' entries).")
    if LAYOUT_KEY in metadata.state_dict_metadata:
        state[LAYOUT_KEY] = None
    try:
        dcp_load(state, src)
    except FAILURES as e:  # one readable line, not a traceback
        raise CheckpointError(f"{caller}: reading {src} failed: {error_reason(e)}") from e
    layout = state.pop(LAYOUT_KEY, None) or {}
    weights = {k[len(MODEL_PREFIX) :]: v for k, v in state.items()}
    for alias, source in layout.get("tied", {}).items():
        if source in weights and alias not in weights:
            # torch.save keeps one copy of a shared tensor; safetensors refuses sharing: a copy.
            weights[alias] = weights[source].clone() if copy_ties else weights[source]
    # the unwrapped model's order first (a dict keeps the first place of a key), then any others
    return {**{k: weights[k] for k in layout.get("keys", []) if k in weights}, **weights}

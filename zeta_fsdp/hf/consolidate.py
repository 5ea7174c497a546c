"""``consolidate_to_hf``: a sharded ``save_checkpoint`` checkpoint -> a Hugging Face model directory, offline.

One CPU process, no process group. The safetensors files are planned first; tensors are then read
in batches of at most 256 MiB and written straight to their offsets, so the peak is one batch (or
one bigger tensor), whatever the model's size. Our checkpoints do not hold the model's Hugging Face
config: without ``config=`` the weights keep the checkpoint's names and no ``config.json`` is written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn as nn

from ..engines import unwrapped_class
from ..state_dict import CheckpointError
from ..state_dict.checks import FAILURES, error_reason
from ..state_dict.reader import dcp_load, open_checkpoint
from .files import end_staging, parse_size, plan_hf_files, plan_shard_files, publish_staged, staging_dir, write_at
from .naming import saved_aliases, saved_layout, saved_tensors
from .save import cast, check_dtype, check_savable, write_metadata

__all__ = ["consolidate_to_hf", "meta_model_from_config"]

_CALLER = "consolidate_to_hf()"
_MODEL = "model."  # save_checkpoint's prefix for the model's tensors


def meta_model_from_config(config: Union[str, os.PathLike]) -> nn.Module:
    """The model ``config`` (a model directory or a ``config.json``) describes, built on ``meta``:
    its class is the config's first ``architectures`` entry."""
    import transformers

    config = Path(config)
    if not config.exists():
        raise FileNotFoundError(f"{_CALLER}: config={str(config)!r} does not exist.")
    file = config / "config.json" if config.is_dir() else config
    if not file.is_file():
        raise FileNotFoundError(f"{_CALLER}: {config} holds no config.json.")
    try:
        raw = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{_CALLER}: {file} is not a Hugging Face config (not JSON: {e}).") from e
    if not isinstance(raw, dict):
        raise ValueError(
            f"{_CALLER}: {file} is not a Hugging Face config (a JSON {type(raw).__name__}, not an object)."
        )
    try:
        cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{_CALLER}: {file} is not a Hugging Face config (no known model_type): {e}") from e
    names = list(getattr(cfg, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ValueError(
            f"{_CALLER}: {file} names architectures={names}; need one transformers model class to build the layout."
        )
    with torch.device("meta"):
        return cls(cfg)


_BATCH_BYTES = 256 * 2**20  # tensors read per DCP call: fewer calls, a bounded peak


def consolidate_to_hf(
    ckpt_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    config: Union[str, os.PathLike, None] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
) -> Path:
    """Turn a ``save_checkpoint`` checkpoint into a Hugging Face model directory; one process, batch by batch.

    ``config``: the model's Hugging Face config (directory or ``config.json``), written as
    ``config.json`` and used for the tie rules, MoE key conversions and to check every key.
    ``dtype``, ``max_shard_size`` and ``overwrite`` as in ``save_pretrained``. Returns ``out_dir``.

    Also: ``python -m zeta_fsdp consolidate CKPT OUT --hf [--config DIR] [--dtype bf16]``.

    Raises:
        FileNotFoundError: ``ckpt_dir`` or ``config`` does not exist.
        CheckpointError: not a checkpoint, no model weights, or keys that do not match ``config``'s model.
        FileExistsError: ``out_dir`` exists and is not empty (without ``overwrite=True``).

    Example:
        consolidate_to_hf("ckpt/step_100", "out/llama", config="llama-dir", dtype=torch.bfloat16)
        LlamaForCausalLM.from_pretrained("out/llama")
    """
    src = Path(ckpt_dir)
    check_dtype(dtype, _CALLER)
    limit = parse_size(max_shard_size)
    metadata, stored = _stored_weights(src)
    model: Optional[nn.Module] = meta_model_from_config(config) if config is not None else None
    source = _source_names(model, stored, src, config)  # output key (model's kept name) -> stored name
    metas = {
        key: cast(torch.empty(tuple(stored[name].size), dtype=stored[name].properties.dtype, device="meta"), dtype)
        for key, name in source.items()
    }
    saved = saved_layout(model, metas)  # without a model: every key saved as it is
    layout = {k: v for entries in saved.values() for k, v in entries.items()}
    check_savable(layout, _CALLER)
    where, plans = plan_hf_files(layout, limit)
    tmp = staging_dir(out_dir, overwrite=overwrite, caller=_CALLER)
    try:
        converted = _converted(src, metadata, stored, source, saved, model, dtype)
        _write_files(tmp, plans, where, saved, converted)
        write_metadata(model, tmp, layout, where, dtype)
        publish_staged(tmp, out_dir)
    finally:
        end_staging(tmp)  # removes what a failed run left; releases the path's lock
    return Path(out_dir)


def _write_files(
    tmp: Path, plans: dict[str, Any], where: dict[str, str], saved: dict[str, dict], converted: Iterator
) -> None:
    """Create the planned files in ``tmp`` and write each ``converted`` tensor at its offsets, one at a time."""
    for name, plan in plans.items():
        plan.create(tmp / name)  # headers and sizes first: tensors then go straight to their offsets
    fds = {name: os.open(tmp / name, os.O_WRONLY) for name in plans}
    try:
        for key, out in converted:
            for k in saved[key]:
                write_at(fds[where[k]], plans[where[k]].offset[k], out[k], file=tmp / where[k])
            del out  # before the next tensor is read: one converted tensor alive at a time
        for fd in fds.values():
            os.fdatasync(fd)  # the size is final since create(): data only
    finally:
        for fd in fds.values():
            os.close(fd)


def _stored_weights(src: Path) -> tuple[Any, dict[str, Any]]:
    """The checkpoint's metadata (the hardened reader: allow-list unpickling of ``.metadata``, shard files present
    and long enough) and its model tensors' records, by name without the model prefix."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not src.exists():
        raise FileNotFoundError(f"{_CALLER}: no checkpoint at {src}: the path does not exist.")
    metadata = open_checkpoint(src, _CALLER)
    stored = {
        k[len(_MODEL) :]: md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(_MODEL) and isinstance(md, TensorStorageMetadata)
    }
    if not stored:
        raise CheckpointError(f"{_CALLER}: {src} holds no model weights (no '{_MODEL}*' tensors).")
    return metadata, stored


def _source_names(
    model: Optional[nn.Module], stored: dict[str, Any], src: Path, config: Union[str, os.PathLike, None]
) -> dict[str, str]:
    """Each output key (the model's kept name; a stored alias serves it) -> its stored name; without a model
    every stored name as it is. Missing, unexpected or mis-shaped keys against ``config``'s model raise."""
    if model is None:
        return {k: k for k in stored}
    tensors = model.state_dict(keep_vars=True)
    aliases = saved_aliases(model, tensors)
    source: dict[str, str] = {}
    for name in [*(k for k in tensors if k not in aliases), *aliases]:  # a kept name before its aliases
        if name in stored:
            source.setdefault(aliases.get(name, name), name)
    missing = [k for k in tensors if k not in aliases and k not in source]
    unexpected = [k for k in stored if k not in tensors]
    wrong = [
        f"{k}: checkpoint {list(stored[s].size)} vs model {list(tensors[k].shape)}"
        for k, s in source.items()
        if tuple(stored[s].size) != tuple(tensors[k].shape)
    ]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{_CALLER}: {src} does not match the {unwrapped_class(model).__name__} of {config}: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}, shape mismatches {wrong[:8]}"
        )
    return source


def _converted(
    src: Path,
    metadata: Any,
    stored: dict[str, Any],
    source: dict[str, str],
    saved: dict[str, dict],
    model: Optional[nn.Module],
    dtype: Optional[torch.dtype],
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """``(key, {saved name: tensor})`` for every output key, read batch by batch (a bigger tensor in a batch of
    its own), cast to ``dtype`` and converted to the Hugging Face layout (``saved_tensors``)."""
    sizes = {k: math.prod(stored[source[k]].size) * stored[source[k]].properties.dtype.itemsize for k in saved}
    for batch in plan_shard_files(sizes, _BATCH_BYTES):
        state = _read_batch(src, metadata, batch, {_MODEL + source[key]: stored[source[key]] for key in batch})
        for key in batch:
            value = cast(state.pop(_MODEL + source[key]), dtype)
            plain = list(saved[key]) == [key] and saved[key][key][1] == tuple(value.shape)
            yield key, ({key: value} if plain else saved_tensors(model, key, value))


def _read_batch(src: Path, metadata: Any, batch: list[str], records: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors ``records`` name, read from ``src``: every record CRC-checked before it is used; one readable
    error, no DCP traceback."""
    # zeros, not empty: nothing uninitialised can reach the file (the chunks' cover is checked too)
    state: dict[str, Any] = {
        name: torch.zeros(tuple(md.size), dtype=md.properties.dtype) for name, md in records.items()
    }
    try:
        dcp_load(state, src, metadata=metadata)
    except CheckpointError as e:
        raise CheckpointError(f"{_CALLER}: reading {batch} from {src} failed: {e}") from None
    except FAILURES as e:  # a record torch refuses to unpickle, sizes it cannot allocate: a bad file
        raise CheckpointError(f"{_CALLER}: reading {batch} from {src} failed: {error_reason(e)}") from e
    return state

"""PEFT adapters of a sharded model, in and out: ``save_adapters`` / ``load_adapters``.

The files are exactly PEFT's (``adapter_model.safetensors`` + ``adapter_config.json``), both ways.
Only the adapter tensors are gathered (a few MiB for a LoRA of a 70B base), never the frozen base.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..distributed import get_rank, get_world_size, on_all_ranks
from ..state_dict.checks import short_list
from .files import TensorEntry, end_staging, publish_staged, read_rows, read_safetensors_header, staging_dir

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_tensors", "load_adapters", "save_adapters"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _check_peft_model(model: nn.Module, adapter_name: str, caller: str) -> None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not any(c.__module__.startswith("peft.") for c in type(model).__mro__):
        raise ValueError(
            f"{caller}: {type(model).__name__} is not a PEFT model. Accepted: the PeftModel returned by "
            "peft.get_peft_model(...) (or PeftModel.from_pretrained), wrapped with fsdp() or not."
        )
    if adapter_name not in configs:
        raise ValueError(
            f"{caller}: adapter_name={adapter_name!r} is not an adapter of this model. Accepted: "
            f"{', '.join(map(repr, configs))}."
        )


def adapter_tensors(model: nn.Module, adapter_name: str = "default") -> dict[str, tuple[str, torch.Tensor]]:
    """The tensors PEFT saves for ``adapter_name``: ``{key in the file: (name in model, tensor)}``.

    PEFT chooses them and their file names (``...lora_A.default.weight`` -> ``...lora_A.weight``);
    the tensors are the model's own (sharded ``DTensor``s under ``fsdp()``).
    """
    from peft.utils import get_peft_model_state_dict

    own = model.state_dict(keep_vars=True)
    name_of = {id(t): n for n, t in own.items()}
    chosen = get_peft_model_state_dict(model, state_dict=own, adapter_name=adapter_name)
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for key, tensor in chosen.items():
        name = name_of.get(id(tensor))
        if name is None:  # PEFT made a new tensor (a transform we do not know): refuse, never guess
            raise ValueError(f"adapter tensor {key!r} is not one of the model's own tensors; cannot map it.")
        out[key] = (name, tensor)
    return out


def save_adapters(
    model: nn.Module, path: Union[str, os.PathLike], *, adapter_name: str = "default", overwrite: bool = False
) -> Path:
    """Write the adapter ``adapter_name`` of a (sharded) PEFT model as PEFT does; returns ``path``.

    Call on every rank. The adapter tensors are gathered one at a time and rank 0 writes
    ``adapter_model.safetensors`` and ``adapter_config.json``; the base is not written
    (``save_pretrained(model.merge_and_unload(), ...)`` saves a merged model). ``overwrite`` as in
    ``save_pretrained``.

    Raises:
        ValueError: not a PEFT model, an unknown ``adapter_name``, or a bad ``overwrite``.
        FileExistsError: ``path`` exists and is not empty (without ``overwrite=True``).

    Example:
        save_adapters(model, "out/adapter")
        PeftModel.from_pretrained(LlamaForCausalLM(config), "out/adapter")
    """
    from safetensors.torch import save_file

    caller = "save_adapters()"
    path = Path(path)
    staged: list[Path] = []

    def prepare() -> dict[str, tuple[str, torch.Tensor]]:
        _check_peft_model(model, adapter_name, caller)
        tensors = adapter_tensors(model, adapter_name)
        if get_rank() == 0:
            staged.append(staging_dir(path, overwrite=overwrite, caller=caller))
        return tensors

    try:
        tensors = on_all_ranks(prepare)
        full = {}
        for key, (_, t) in tensors.items():
            whole = t.full_tensor() if isinstance(t, DTensor) else t  # collective: every rank, same order
            full[key] = whole.detach().to("cpu").contiguous() if get_rank() == 0 else None

        def write() -> None:
            if get_rank() != 0:
                return
            save_file(full, str(staged[0] / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            config = model.peft_config[adapter_name]
            inference_mode, config.inference_mode = config.inference_mode, True  # as PeftModel.save_pretrained
            try:
                config.save_pretrained(str(staged[0]))
            finally:
                config.inference_mode = inference_mode
            publish_staged(staged[0], path)

        on_all_ranks(write)
    finally:
        for made in staged:
            end_staging(made)
    return path


# adapter_config.json fields that change what the adapter computes (PEFT's LoRA and its variants); training-only
# (dropout) and bookkeeping ones (inference_mode, base model name) may differ.
COMPUTING_FIELDS = (
    "peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "bias", "lora_bias",
    "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules", "layers_to_transform",
    "layers_pattern", "modules_to_save", "target_parameters", "use_qalora", "qalora_group_size",
    "layer_replication", "trainable_token_indices",
)  # fmt: skip


def _comparable(value: Any) -> Any:
    """A config value as JSON has it (PEFT writes sets as lists; enums as their value), order-free for sets."""
    if isinstance(value, (set, frozenset, list, tuple)):
        items = [_comparable(v) for v in value]
        return (
            sorted(items, key=repr)
            if isinstance(value, (set, frozenset)) or all(isinstance(v, str) for v in items)
            else items
        )
    if isinstance(value, dict):
        return {str(k): _comparable(v) for k, v in value.items()}
    return getattr(value, "value", value)


def check_adapter_config(config_file: Path, own: Any, caller: str) -> None:
    """Every field of ``config_file`` that changes the adapter's computation equals the model's adapter config's
    (``lora_alpha`` / ``use_rslora`` change the scaling alone: the weights would load and compute something else).

    Example:
        check_adapter_config(Path("out/adapter/adapter_config.json"), model.peft_config["default"], "load_adapters()")
    """
    try:
        saved = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{caller}: {config_file} is not readable JSON: {e}") from e
    if not isinstance(saved, dict):
        raise ValueError(f"{caller}: {config_file} holds a {type(saved).__name__}, not PEFT's adapter config.")
    mine = own.to_dict() if callable(getattr(own, "to_dict", None)) else dict(vars(own))
    differ = [
        f"{field}={saved[field]!r} in the file, {field}={_comparable(mine[field])!r} in the model"
        for field in COMPUTING_FIELDS
        if field in saved and field in mine and _comparable(saved[field]) != _comparable(mine[field])
    ]
    if differ:
        raise ValueError(
            f"{caller}: {config_file} describes another adapter than the model's ({'; '.join(differ)}). Build the "
            "model with the adapter's own config (peft.LoraConfig.from_pretrained(path)), then load."
        )


def _check_adapter_file(
    model: nn.Module, path: Path, adapter_name: str, caller: str
) -> tuple[dict[str, tuple[str, torch.Tensor]], dict[str, TensorEntry]]:
    """``load_adapters``' checks: a PEFT model with that adapter, the file's tensors (names and shapes)
    and config matching it. Returns the adapter's tensors and the file's header."""
    _check_peft_model(model, adapter_name, caller)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{caller}: {weights} does not exist (expected PEFT's {ADAPTER_WEIGHTS}).")
    tensors = adapter_tensors(model, adapter_name)
    header = read_safetensors_header(weights)
    missing, unexpected = sorted(set(tensors) - set(header)), sorted(set(header) - set(tensors))
    if missing or unexpected:
        raise ValueError(
            f"{caller}: {weights} does not match adapter {adapter_name!r}: missing {short_list(missing)}, "
            f"unexpected {short_list(unexpected)}."
        )
    bad = [k for k, (_, t) in tensors.items() if tuple(header[k].shape) != tuple(t.shape)]
    if bad:
        k = bad[0]
        raise ValueError(
            f"{caller}: {len(bad)} tensor(s) have the wrong shape, e.g. {k}: file {tuple(header[k].shape)}, "
            f"model {tuple(tensors[k][1].shape)}."
        )
    config_file = path / ADAPTER_CONFIG
    if config_file.is_file():
        check_adapter_config(config_file, model.peft_config[adapter_name], caller)
    return tensors, header


def load_adapters(model: nn.Module, path: Union[str, os.PathLike], *, adapter_name: str = "default") -> None:
    """Load PEFT adapter weights from ``path`` into the adapter ``adapter_name`` of a (sharded) model.

    Call on every rank after ``fsdp()``: each rank reads the small adapter file and keeps its shards.
    Its tensors (names, shapes) and every ``adapter_config.json`` field that changes the computation
    (``r``, ``lora_alpha``, ``use_rslora``, target modules ...) must match the model's adapter;
    checked on every rank before anything is copied.

    Raises:
        ValueError: not a PEFT model, an unknown ``adapter_name``, or a file that does not match.
        FileNotFoundError: ``path`` holds no ``adapter_model.safetensors``.

    Example:
        model = fsdp(get_peft_model(base, lora_config), auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
        load_adapters(model, "out/adapter")
    """
    caller = "load_adapters()"
    path = Path(path)
    tensors, header = on_all_ranks(lambda: _check_adapter_file(model, path, adapter_name, caller))
    with torch.no_grad():
        for key, (_, t) in tensors.items():
            whole = read_rows(header[key])
            if isinstance(t, DTensor):
                # Local chunking only (src_data_rank=None): every rank read the same file.
                piece = distribute_tensor(whole.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
                t.to_local().copy_(piece.to_local())
            else:
                t.copy_(whole.to(dtype=t.dtype, device=t.device))
    if get_world_size() > 1:
        dist.barrier()  # no rank goes on training while a peer still reads

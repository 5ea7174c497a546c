"""What a weight stream reads from a model and what it yields, in the model's names or Hugging Face's.

Names: ``"model"`` gives ``get_full_state_dict``'s keys (tied aliases as the same tensor); ``"hf"`` gives the
keys ``save_pretrained`` writes (``hf.naming``: tied weights once, fused MoE experts split as transformers saves
them). A PEFT model streams its LoRA adapters merged into the base weights (the names and values of
``merge_and_unload()``, computed as PEFT computes them) or only its adapters (PEFT's file names).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..hf.adapters import adapter_tensors
from ..hf.naming import is_hf_model, saved_aliases, saved_layout, saved_tensors
from ..state_dict import get_sharded_state_dict
from ..state_dict.checks import clean_fqn, named_parameters
from ..ties import tied_aliases
from .plan import Item, Output, Source

__all__ = ["NAMES", "LORA", "is_peft_model", "model_items", "shard_layout"]

NAMES = ("model", "hf")
LORA = ("merged", "adapters")
_PEFT_PREFIX = "base_model.model."


def is_peft_model(model: nn.Module) -> bool:
    """``True`` for a PEFT ``PeftModel`` (sharded or not), without importing peft otherwise."""
    return isinstance(getattr(model, "peft_config", None), dict) and any(
        c.__module__.startswith("peft.") for c in type(model).__mro__
    )


def shard_layout(t: torch.Tensor) -> Optional[tuple[Any, int, int]]:
    """``(process group, shard count, this rank's index)`` of a DTensor split along dim 0 over one mesh dim and
    replicated over the others (FSDP2: ``Shard(0)``; HSDP: ``(Replicate(), Shard(0))``); ``(None, 1, 0)`` for a
    tensor every rank holds whole; ``None`` for another layout (tensor parallelism), gathered by ``full_tensor()``.
    """
    if not isinstance(t, DTensor):
        return None, 1, 0
    dims = [i for i, p in enumerate(t.placements) if type(p) is Shard and p.dim == 0]
    if len(dims) > 1 or any(type(p) not in (Shard, Replicate) for p in t.placements) or t.dim() == 0:
        return None
    if any(type(p) is Shard and p.dim != 0 for p in t.placements):
        return None
    if not dims or t.device_mesh.size(dims[0]) == 1:
        return None, 1, 0
    mesh, dim = t.device_mesh, dims[0]
    return mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)


def _source(key: str, t: torch.Tensor, dtype: Optional[torch.dtype]) -> Source:
    layout = shard_layout(t)
    group, shards, _ = layout if layout is not None else (None, 1, 0)
    travel = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return Source(key, tuple(t.shape), travel, shards, None if group is None else group.group_name)


def _plain(key: str, name: str, t: torch.Tensor, dtype: Optional[torch.dtype]) -> Item:
    s = _source(key, t, dtype)
    return Item((s,), (Output(name, s.dtype, s.shape),))


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict's tensors, sharded (the shards FSDP2 keeps, not what a forward left unsharded)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    tensors = {k: v for k, v in get_sharded_state_dict(model).items() if isinstance(v, torch.Tensor)}
    on_meta = [k for k, t in tensors.items() if t.is_meta]
    if on_meta:
        raise ValueError(
            f"iter_full_weights(): these tensors are on the meta device, with no values to stream: {on_meta[:8]}. "
            "Load or initialise the model first (load_pretrained, load_full_state_dict, or fsdp(..., materialize=True))."
        )
    return tensors


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{clean module name: layer}`` of every PEFT LoRA layer; a kind ``lora="merged"`` cannot merge is refused."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    layers = {}
    for name, m in model.named_modules():
        if isinstance(m, ModulesToSaveWrapper):
            raise ValueError(
                f"iter_full_weights(lora='merged'): {clean_fqn(name)} is a PEFT modules_to_save copy, which "
                "merging does not support yet. Accepted: lora='adapters', or LoRA layers only."
            )
        if not isinstance(m, LoraLayer):
            continue
        active = [a for a in m.active_adapters if a in m.lora_A and a not in m.merged_adapters]
        odd = [a for a in active if m.use_dora.get(a) or m.lora_bias.get(a) or a in getattr(m, "lora_variant", {})]
        if type(m) is not LoraLinear or odd:
            raise ValueError(
                f"iter_full_weights(lora='merged'): {clean_fqn(name)} is a {type(m).__name__} "
                f"{'with DoRA, a LoRA bias or a variant ' if odd else ''}that merging does not support. Accepted: "
                "plain LoRA on nn.Linear layers, or lora='adapters'."
            )
        layers[clean_fqn(name)] = m
    return layers


def _merged_name(key: str) -> str:
    key = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
    return key.replace(".base_layer.", ".")


def _merge_build(layer: nn.Module, adapters: list[str]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The merged weight from full ``[base, A_1, B_1, ...]``, with PEFT's own arithmetic (``Linear.merge``:
    ``weight.data += get_delta_weight(adapter)``, a bf16/fp16 delta computed in fp32 on CPU), bit for bit."""
    from peft.utils.other import transpose

    def build(fulls: list[torch.Tensor]) -> list[torch.Tensor]:
        merged = fulls[0].clone()
        for i, adapter in enumerate(adapters):
            a, b = fulls[1 + 2 * i], fulls[2 + 2 * i]
            dtype = b.dtype
            cast_to_fp32 = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
            if cast_to_fp32:
                a, b = a.float(), b.float()
            delta = transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[adapter]
            merged += delta.to(dtype) if cast_to_fp32 else delta
        return [merged]

    return build


def _named_entries(
    model: nn.Module, dtype: Optional[torch.dtype]
) -> tuple[dict[str, torch.Tensor], dict[str, Item], dict[str, torch.Tensor], dict[str, str]]:
    """``{name: tensor}`` as streamed before Hugging Face renaming (a PEFT model: ``merge_and_unload()``'s names),
    the items that merge LoRA (by name), ``{source key: tensor}`` every source reads, ``{alias: kept name}``."""
    tensors = _tensors(model)
    aliases = tied_aliases(named_parameters(model))
    if not is_peft_model(model):
        return tensors, {}, tensors, aliases
    merges: dict[str, Item] = {}
    layers = _lora_layers(model)
    entries: dict[str, torch.Tensor] = {}
    read: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        owner = key.rpartition(".lora_")[0] or key.rpartition(".base_layer.")[0]
        layer = layers.get(owner)
        name = _merged_name(key)
        if layer is None or key == f"{owner}.base_layer.bias":
            entries[name] = read[name] = t
            continue
        if key != f"{owner}.base_layer.weight":
            continue  # an adapter tensor: merged into its base weight
        adapters = [a for a in layer.active_adapters if a in layer.lora_A and a not in layer.merged_adapters]
        sources = [_source(name, t, None)]
        for a in adapters:
            for part in ("lora_A", "lora_B"):
                k = f"{owner}.{part}.{a}.weight"
                sources.append(_source(k, tensors[k], None))
                read[k] = tensors[k]
        out = Output(name, dtype if dtype is not None and t.is_floating_point() else t.dtype, tuple(t.shape))
        merges[name] = Item(tuple(sources), (out,), build=_merge_build(layer, adapters))
        entries[name] = read[name] = t
    return entries, merges, read, {_merged_name(a): _merged_name(k) for a, k in aliases.items()}


def _hf_items(
    model: nn.Module,
    naming: nn.Module,
    entries: dict[str, torch.Tensor],
    merges: dict[str, Item],
    dtype: Optional[torch.dtype],
) -> list[Item]:
    """Items under the names ``save_pretrained`` writes: tied weights once, fused tensors split as transformers does."""
    rename = _merged_name if is_peft_model(model) else (lambda k: k)
    every = {rename(clean_fqn(k)): t for k, t in model.state_dict(keep_vars=True).items()}  # ties: one object
    aliases = saved_aliases(naming, {k: t for k, t in every.items() if k in entries})
    kept = {k: t for k, t in entries.items() if k not in aliases}
    metas = {}
    for k, t in kept.items():
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        metas[k] = torch.empty(t.shape, dtype=out_dtype, device="meta")
    layout = saved_layout(naming, metas)
    items = []
    for name, t in kept.items():
        saved = layout[name]
        plain = list(saved) == [name] and saved[name][1] == tuple(t.shape)
        item = merges.get(name) or _plain(name, name, t, dtype)
        if plain:
            item.outputs = (Output(name, saved[name][0], tuple(t.shape)),)
            items.append(item)
            continue
        if name in merges:
            raise ValueError(f"iter_full_weights(names='hf'): {name} is both LoRA-merged and converted; unsupported.")

        def build(fulls: list[torch.Tensor], name: str = name, order: tuple = tuple(saved)) -> list[torch.Tensor]:
            pieces = saved_tensors(naming, name, fulls[0])
            return [pieces[k] for k in order]

        item.outputs = tuple(Output(k, d, tuple(shape)) for k, (d, shape) in saved.items())
        item.build = build
        items.append(item)
    return items


def model_items(
    model: nn.Module, *, names: str, lora: str, dtype: Optional[torch.dtype], adapter_name: str = "default"
) -> tuple[list[Item], dict[str, torch.Tensor]]:
    """The stream's items in order, and ``{source key: tensor}`` (live sharded tensors) the sources read."""
    if lora == "adapters":
        if not is_peft_model(model):
            raise ValueError(
                f"iter_full_weights(): lora='adapters' needs a PEFT model; {type(model).__name__} has no adapters. "
                "Accepted: lora='merged' (every weight)."
            )
        _tensors(model)  # refuses a model on meta
        read = {file_key: t for file_key, (_, t) in adapter_tensors(model, adapter_name).items()}
        return [_plain(k, k, t, dtype) for k, t in read.items()], read
    entries, merges, read, aliases = _named_entries(model, dtype)
    if names == "hf":
        naming = model.get_base_model() if is_peft_model(model) else model
        if not is_hf_model(naming):
            raise ValueError(
                f"iter_full_weights(): names='hf' needs a Hugging Face (transformers) model; {type(naming).__name__} "
                "is not one. Accepted: names='model' (the model's own state-dict keys)."
            )
        return _hf_items(model, naming, entries, merges, dtype), read
    items: dict[str, Item] = {}
    for name, t in entries.items():
        kept = aliases.get(name)
        if kept is not None and kept in items:
            items[kept].aliases += ((name, kept),)
            continue
        items[name] = merges.get(name) or _plain(name, name, t, dtype)
    return list(items.values()), read

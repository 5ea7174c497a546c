"""``save_pretrained``: a sharded model written in Hugging Face's layout, without any rank holding it whole.

The files are planned before any byte moves (a safetensors header holds every tensor's byte
range), so rank 0 writes the headers and sizes the files, then every rank writes its own rows at
their offsets: a dim-0 shard is one contiguous byte range, so nothing is gathered.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..distributed import get_rank as rank
from ..distributed import get_world_size as world
from ..engines import engine_of, unwrapped_class
from ..files import incomplete_path
from ..state_dict.checks import CheckpointError, checkpoint_on_all_ranks
from .files import (
    DTYPES,
    INDEX_NAME,
    NAMES,
    SafetensorsLayout,
    end_staging,
    parse_size,
    plan_hf_files,
    publish_staged,
    staging_dir,
    write_at,
)
from .load import local_box
from .naming import is_hf_model, saved_aliases, saved_layout, saved_tensors

__all__ = ["cast", "check_dtype", "check_savable", "save_pretrained", "write_metadata"]

_CALLER = "save_pretrained()"


def check_dtype(dtype: Optional[torch.dtype], caller: str) -> None:
    """``dtype`` must be ``None`` or a floating-point ``torch.dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"{caller}: dtype={dtype!r} is not accepted. Accepted: None (keep each tensor's dtype) or a "
            "floating-point torch.dtype such as torch.bfloat16."
        )


def check_savable(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], caller: str) -> None:
    """Every tensor's dtype must be one safetensors stores (a complex tensor, a quantised one, are not).

    Example:
        >>> check_savable({"w": (torch.complex64, (2,))}, "save_pretrained()")
        Traceback (most recent call last):
        ...
        ValueError: save_pretrained(): safetensors cannot store torch.complex64 (tensors: ['w']). Accepted dtypes: ...
    """
    bad: dict[torch.dtype, list[str]] = {}
    for key, (dtype, _) in layout.items():
        if dtype not in NAMES:
            bad.setdefault(dtype, []).append(key)
    if bad:
        what = "; ".join(
            f"{dtype} (tensors: {keys[:4]}{' ...' if len(keys) > 4 else ''})" for dtype, keys in bad.items()
        )
        raise ValueError(
            f"{caller}: safetensors cannot store {what}. Accepted dtypes: "
            f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES.values())}. Store such a tensor as real "
            "numbers (torch.view_as_real for complex) or keep it out of the saved state (a non-persistent buffer)."
        )


def cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Floating-point tensors to ``dtype`` (integers and bools keep theirs)."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def write_metadata(
    model: Optional[nn.Module],
    out: Path,
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    where: dict[str, str],
    dtype: Optional[torch.dtype],
) -> None:
    """The index when there is more than one file and, for a Hugging Face model, ``config.json`` (and
    ``generation_config.json`` when it generates) naming the saved dtype and the model's own class (not FSDP's)."""
    if len(set(where.values())) > 1:
        total = sum(math.prod(shape) * d.itemsize for d, shape in layout.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    if not is_hf_model(model):
        return
    config = copy.deepcopy(model.config)
    saved_dtype = dtype or next((d for d, _ in layout.values() if d.is_floating_point), None)
    if saved_dtype is not None:
        config.dtype = str(saved_dtype).removeprefix("torch.")
    config.architectures = [unwrapped_class(model).__name__]
    config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(out)


_CAST_CHUNK = 8 * 2**20  # bytes cast to the saved dtype at a time: a rank never holds a whole cast tensor


def rows_to_write(t: torch.Tensor, split: bool = True) -> Optional[tuple[int, int]]:
    """``(first row, row count)`` of ``t`` (along dim 0) this rank writes, or ``None`` if it needs a gather.

    A DTensor sharded on dim 0 only holds a contiguous row range; the ranks at coordinate 0 of every
    ``Replicate`` mesh dim write it. A plain tensor is whole on every rank: with ``split`` (replicas
    known equal: parameters on DDP's engine) rank ``r`` writes ``torch.chunk`` piece ``r``, else rank 0
    writes it all (BatchNorm's running statistics may differ between ranks: one rank's copy, never a mix).
    """
    if not isinstance(t, DTensor):
        if t.dim() == 0 or not split:
            return (0, t.shape[0] if t.dim() else 1) if rank() == 0 else (0, 0)
        chunk = -(-t.shape[0] // world())
        start = min(rank() * chunk, t.shape[0])
        return start, min(chunk, t.shape[0] - start)
    if t.dim() == 0 or any(
        type(p) not in (Shard, Replicate) or (type(p) is Shard and p.dim != 0) for p in t.placements
    ):
        return None
    coord = t.device_mesh.get_coordinate()
    if any(type(p) is Replicate and coord[i] != 0 for i, p in enumerate(t.placements)):
        return (0, 0)  # another replica writes these rows
    try:
        (lo, hi), *_ = local_box(t)
    except CheckpointError:
        return None  # a layout we do not recognise: gather instead of guessing
    return lo, hi - lo


def _write_rows(fd: int, offset: int, rows: torch.Tensor, saved: torch.dtype, file: Path) -> None:
    """``rows`` written at ``offset`` as ``saved`` dtype; a cast is done a bounded number of rows at a time."""
    if rows.dtype == saved or rows.dim() == 0:
        write_at(fd, offset, rows.to(saved), file=file)
        return
    row_bytes = int(torch.Size(rows.shape[1:]).numel()) * saved.itemsize
    step = max(1, _CAST_CHUNK // max(1, row_bytes))
    for i in range(0, rows.shape[0], step):
        write_at(fd, offset + i * row_bytes, rows[i : i + step].to(saved), file=file)


def _write_data(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    saved: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]],
    where: dict[str, str],
    plans: dict[str, SafetensorsLayout],
    folder: Path,
    dtype: Optional[torch.dtype],
) -> None:
    """Every rank writes its rows of every tensor at their offsets, then flushes them. The rest (fused MoE
    tensors split on save, shards on another dim) are gathered one at a time, in the same order on every
    rank, and written by the rank owning their file."""
    out = _PlannedFiles(folder, plans)
    owner = {name: i % world() for i, name in enumerate(plans)}
    params_equal = engine_of(model).REPLICAS_EQUAL  # then any rank's rows are everyone's: split the writing
    try:
        for key, entries in saved.items():
            t = tensors[key]
            plain = list(entries) == [key] and tuple(entries[key][1]) == tuple(t.shape)
            rows = rows_to_write(t, split=params_equal and isinstance(t, nn.Parameter)) if plain else None
            if rows is None:
                mine = {k: where[k] for k in entries if owner[where[k]] == rank()}
                out.write_gathered(model, key, t, mine, dtype)
            elif rows[1] and out.failed is None:
                out.write_rows(t, key, where[key], entries[key][0], rows)
        out.flush()
    finally:
        out.close()
    if out.failed is not None:
        raise out.failed


class _PlannedFiles:
    """The pre-sized files of one save (``plans``: file name -> layout), opened on first write; the
    first write error is kept in ``failed`` (raised after the loop: peers still wait in gathers)."""

    def __init__(self, folder: Path, plans: dict[str, SafetensorsLayout]) -> None:
        self.plans, self.files = plans, {name: folder / name for name in plans}
        self.fds: dict[str, int] = {}
        self.failed: Optional[BaseException] = None

    def fd_of(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = os.open(self.files[name], os.O_WRONLY)
        return self.fds[name]

    def write_gathered(
        self, model: nn.Module, key: str, t: torch.Tensor, mine: dict[str, str], dtype: Optional[torch.dtype]
    ) -> None:
        """Gather ``t`` whole (every rank: a collective) and write the saved tensors in ``mine`` (saved key ->
        file) it becomes. A failed write must not leave peers waiting in the next gather: keep gathering."""
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if not mine or self.failed is not None:
            return
        try:
            pieces = saved_tensors(model, key, cast(full.detach(), dtype))
            for k, name in mine.items():
                write_at(self.fd_of(name), self.plans[name].offset[k], pieces[k], file=self.files[name])
        except Exception as e:
            self.failed = e

    def write_rows(self, t: torch.Tensor, key: str, name: str, saved_dtype: torch.dtype, rows: tuple[int, int]) -> None:
        """Write this rank's ``rows`` (``(start, count)`` along dim 0) of ``t`` at their offset in file ``name``."""
        start, count = rows
        local = t.to_local() if isinstance(t, DTensor) else t
        if not isinstance(t, DTensor):
            local = local.narrow(0, start, count) if local.dim() else local
        row_bytes = saved_dtype.itemsize * (int(torch.Size(t.shape[1:]).numel()) if t.dim() else 1)
        offset = self.plans[name].offset[key] + start * row_bytes
        try:
            _write_rows(self.fd_of(name), offset, local.detach(), saved_dtype, self.files[name])
        except Exception as e:
            self.failed = e

    def flush(self) -> None:
        """On disk before anyone publishes. fdatasync: the size is final since create(); fsync (timestamps
        too) from two ranks took about 2x as long at 423 MB on ext4."""
        if self.failed is None:
            for fd in self.fds.values():
                os.fdatasync(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _plan_save(
    model: nn.Module, dtype: Optional[torch.dtype], max_shard_size: Union[int, str]
) -> tuple[dict, dict, dict, dict, dict]:
    """``save_pretrained``'s arguments checked and its files planned, nothing written: ``(tensors, saved,
    layout, where, plans)``, the model's tensors (tied aliases too), each one's saved entries, saved key ->
    (dtype, shape), saved key -> file name and each file's layout."""
    check_dtype(dtype, _CALLER)
    limit = parse_size(max_shard_size)
    tensors = model.state_dict(keep_vars=True)  # every name, tied aliases included
    on_meta = [k for k, t in tensors.items() if t.is_meta]
    if on_meta:
        raise ValueError(
            f"{_CALLER}: these tensors are on the meta device, with no values to save: {on_meta[:8]}. "
            "Load or initialise the model first (load_pretrained, or fsdp(..., materialize=True))."
        )
    aliases = saved_aliases(model, tensors)
    metas = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in tensors.items() if k not in aliases}
    saved = saved_layout(model, {k: cast(t, dtype) for k, t in metas.items()})
    layout = {k: v for entries in saved.values() for k, v in entries.items()}
    check_savable(layout, _CALLER)
    where, plans = plan_hf_files(layout, limit)
    return tensors, saved, layout, where, plans


def save_pretrained(
    model: nn.Module,
    path: Union[str, os.PathLike],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write a model returned by ``fsdp()`` as a Hugging Face model directory; returns ``path``.

    Call on every rank. Writes ``model.safetensors`` (or files of at most ``max_shard_size`` and
    their index), and ``config.json`` / ``generation_config.json`` for a Hugging Face model, so
    ``AutoModelFor*.from_pretrained(path)`` loads it; no rank holds a whole tensor. Tied weights are
    stored once and fused MoE tensors under transformers' per-expert keys, as transformers saves them.
    ``dtype`` casts floating-point tensors on write.

    ``path`` must not exist, or be an empty directory, unless ``overwrite=True``; the files are
    renamed into place once complete, so a refused or failed save leaves ``path`` untouched. With
    several nodes, ``path`` must be on a file system every rank sees.

    Raises:
        FileExistsError: ``path`` exists and is not empty (without ``overwrite=True``), or is a file.
        ValueError: a bad ``dtype`` or ``max_shard_size``.

    Example:
        save_pretrained(model, "out/llama", dtype=torch.bfloat16, max_shard_size="2GB")
        AutoModelForCausalLM.from_pretrained("out/llama")
    """
    path = Path(path)
    tmp = incomplete_path(path)  # where staging_dir (rank 0) stages: every rank knows it, nothing to broadcast
    staged: list[Path] = []

    def prepare() -> tuple[dict, dict, dict, dict, dict]:
        planned = _plan_save(model, dtype, max_shard_size)
        if rank() == 0:
            staged.append(staging_dir(path, overwrite=overwrite, caller=_CALLER))
            for name, plan in planned[-1].items():  # headers and final sizes first: every rank then fills its rows
                plan.create(tmp / name)
        return planned

    for m in model.modules():  # gather from shards, not from unsharded parameters left by a forward
        if isinstance(m, FSDPModule):
            m.reshard()
    try:
        tensors, saved, layout, where, plans = checkpoint_on_all_ranks(prepare)

        def write() -> None:
            _write_data(model, tensors, saved, where, plans, tmp, dtype)
            if rank() == world() - 1:  # rank 0 created the files (and writes every plain buffer)
                write_metadata(model, tmp, layout, where, dtype)

        checkpoint_on_all_ranks(write)
        checkpoint_on_all_ranks(lambda: publish_staged(tmp, path) if rank() == 0 else None)
    finally:
        for made in staged:  # rank 0: removes what a refused or failed save left, releases the path's lock
            end_staging(made)
    return path

"""The hardened DCP reader: an allow-list unpickler for ``.metadata``, file-length checks, a CRC-32 check of every
record before any tensor is copied, and non-tensor entries loaded with ``torch.load(weights_only=True)``.

Each record in a ``.distcp`` file is a stored zip whose entries carry CRC-32s, which ``torch.load`` never checks.
Here every CRC-32 is computed over a ``memoryview`` of the file's bytes, and a tensor record becomes a tensor
viewing those same bytes (no copy, no per-record ``torch.load``); its ``data.pkl`` is read by an unpickler that
knows ``_rebuild_tensor_v2`` and the storage classes only.
"""

from __future__ import annotations

import collections
import io
import mmap
import os
import pickle
import struct
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .checks import CheckpointError, short_list
from .publish import read_metadata


def open_checkpoint(path: Path, caller: str) -> Metadata:
    """The checkpoint's metadata, once every shard file it points to exists and is long enough."""
    metadata = read_metadata(path, caller)
    needed: dict[str, int] = {}
    keys: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        keys.setdefault(info.relative_path, []).append(index.fqn)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{caller}: shard file {file} is missing (it holds {short_list(keys[name], 4)}).")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{caller}: shard file {file} is truncated: {size} bytes, the metadata needs {end} "
                f"(it holds {short_list(keys[name], 4)})."
            )
    return metadata


class _VerifyingReader(FileSystemReader):
    """DCP's file reader: each file mapped once, every record CRC-checked in place and decoded as views.
    ``read_data`` only queues ``(target, source)`` pairs, which ``CheckedRead.commit`` copies once all are checked."""

    def __init__(self, path: Path, metadata: Optional[Metadata] = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self.pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (read item, target, checked source)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata if self._metadata is not None else read_metadata(Path(self.path), "load")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            file = Path(self.path) / relative_path
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            with open(file, "rb") as f:
                mapped = _map(f) if _MAP_FILES else None
                for start, end, run in self._runs(items):
                    if mapped is not None:
                        view = mapped[start:end]
                    else:
                        f.seek(start)
                        view = memoryview(f.read(end - start))  # one read for the run, not one per record
                    if len(view) != end - start:
                        raise CheckpointError(f"shard file {file} is truncated: it ends before byte {end}.")
                    for item in run:
                        info = self.storage_data[item.storage_index]
                        record = view[info.offset - start : info.offset - start + info.length]
                        where = f"{file} (bytes {info.offset}..{info.offset + info.length})"
                        if info.transform_descriptors:
                            raise CheckpointError(f"shard record {where} was written with a storage transform.")
                        self._read_record(item, record, where, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _runs(self, items: list[Any]) -> list[list[Any]]:
        """Records (sorted by offset) as ``[begin, end, items]`` runs, each read at once."""
        runs: list[list[Any]] = []
        for item in items:
            info = self.storage_data[item.storage_index]
            begin, end = int(info.offset), int(info.offset) + int(info.length)
            if runs and begin - runs[-1][1] <= _GAP:
                runs[-1][1] = max(runs[-1][1], end)
                runs[-1][2].append(item)
            else:
                runs.append([begin, end, [item]])
        return runs

    def _read_record(self, item: Any, record: memoryview, where: str, planner: LoadPlanner) -> None:
        files = entries(record, where)
        if files is None:  # a zip layout the fast path does not parse: zipfile checks it
            try:
                bad = zipfile.ZipFile(io.BytesIO(bytes(record))).testzip()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
                raise CheckpointError(f"shard record {where} is corrupted: {e}") from e
            if bad is not None:
                raise CheckpointError(f"shard record {where} is corrupted: {bad} fails its CRC-32 check.")
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(record)))
            return
        tensor = tensor_record(files, where) if files is not None else None
        if tensor is None:
            tensor = torch.load(io.BytesIO(bytes(record)), map_location="cpu", weights_only=True)
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            if tensor.size(dim) != length:  # the part of the saved chunk this rank's shard needs
                tensor = tensor.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(
                f"shard record {where} holds {list(tensor.size())} for {item.dest_index.fqn}, "
                f"expected {list(target.size())}."
            )
        self.pending.append((item, target, tensor))


# One record (a ``torch.save`` zip archive), checked and decoded from the bytes in memory.

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header
_ZIP64_MARK = 0xFFFFFFFF


def entries(record: memoryview, where: str) -> Optional[dict[str, memoryview]]:
    """``{entry name: its bytes}`` of a stored zip record, every entry's CRC-32 checked; ``CheckpointError`` if damaged.
    ``None`` for a zip this parser does not handle (compressed entries, ZIP64 sizes, a trailing comment):
    the caller then checks it with ``zipfile``."""
    try:
        if len(record) < _EOCD.size:
            raise CheckpointError(f"shard record {where} is corrupted: {len(record)} bytes is too short for a zip.")
        sig, _, _, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(record, len(record) - _EOCD.size)
        if sig != b"PK\x05\x06" or comment or count == 0xFFFF or _ZIP64_MARK in (cd_size, cd_offset):
            return None
        out: dict[str, memoryview] = {}
        pos = cd_offset
        for _ in range(count):
            (sig, _, _, flags, method, _, _, crc, csize, usize, n_name, n_extra, n_comment, _, _, _, local) = (
                _CENTRAL.unpack_from(record, pos)
            )
            if sig != b"PK\x01\x02":
                raise CheckpointError(f"shard record {where} is corrupted: bad central directory entry at byte {pos}.")
            name = bytes(record[pos + _CENTRAL.size : pos + _CENTRAL.size + n_name]).decode("utf-8")
            pos += _CENTRAL.size + n_name + n_extra + n_comment
            if method != 0 or flags & 1 or csize != usize or _ZIP64_MARK in (csize, local):
                return None
            lsig, *_, l_name, l_extra = _LOCAL.unpack_from(record, local)
            start = local + _LOCAL.size + l_name + l_extra
            if lsig != b"PK\x03\x04" or l_name != n_name or start + usize > cd_offset:
                raise CheckpointError(f"shard record {where} is corrupted: bad local header for {name}.")
            data = record[start : start + usize]
            if zlib.crc32(data) != crc:
                raise CheckpointError(f"shard record {where} is corrupted: {name} fails its CRC-32 check.")
            out[name] = data
        return out
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"shard record {where} is corrupted: {e}") from e


def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{"FloatStorage": torch.float32, ...}``: the names ``torch.save`` writes for typed storages."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; its names still fill data.pkl
        for name in dir(torch):
            dtype = getattr(getattr(torch, name), "dtype", None) if name.endswith("Storage") else None
            if isinstance(dtype, torch.dtype) and not name.startswith(("Q", "Storage")):
                out[name] = dtype
    return out


_STORAGE_DTYPES = _storage_dtypes()


class _Storage(tuple):
    """``(dtype, key, numel)`` of the storage a tensor record's ``data.pkl`` names."""


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> tuple:
    # ``rest``: requires_grad, backward hooks, tensor metadata (conj/neg bits...). Anything beyond
    # the plain case (no hooks, no metadata) is left to ``torch.load``.
    plain = len(rest) <= 3 and not any(rest[1:])
    return ("tensor", storage, offset, tuple(size), tuple(stride)) if plain else ("other",)


class _TensorPickle(pickle.Unpickler):
    """Reads a tensor record's ``data.pkl`` into ``(storage, offset, size, stride)``; nothing else runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not expected in a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError(f"unexpected storage reference {pid!r}")
        return _Storage((pid[1], str(pid[2]), int(pid[4])))


def tensor_record(files: dict[str, memoryview], where: str) -> Optional[torch.Tensor]:
    """The tensor a checked record holds, viewing the record's bytes (no copy); ``None``: use ``torch.load``."""
    pkl = [name for name in files if name.endswith("/data.pkl")]
    if len(pkl) != 1 or sys.byteorder != "little":
        return None
    prefix = pkl[0][: -len("data.pkl")]
    order = files.get(prefix + "byteorder")
    if order is not None and bytes(order) != b"little":
        return None
    try:
        parsed = _TensorPickle(io.BytesIO(bytes(files[pkl[0]]))).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, AttributeError):
        return None  # not the one shape of record this fast path knows: torch.load decides
    plain = isinstance(parsed, tuple) and len(parsed) == 5 and parsed[0] == "tensor" and isinstance(parsed[1], _Storage)
    if not (plain and all(type(x) is int for x in (parsed[2], *parsed[3], *parsed[4]))):
        return None
    _, (dtype, key, numel), offset, size, stride = parsed
    data = files.get(f"{prefix}data/{key}")
    if data is None or len(data) != numel * dtype.itemsize:
        raise CheckpointError(f"shard record {where} is corrupted: its tensor data does not match its header.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: the tensor is only read from
        flat = torch.frombuffer(data, dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    try:
        return flat.as_strided(size, stride, offset)
    except RuntimeError as e:
        raise CheckpointError(f"shard record {where} is corrupted: {e}") from e


# Records closer than this in one file are read in one go (the bytes between them are read and dropped).
_GAP = 1 << 20
# Map the shard files instead of reading them: the bytes are never copied into a buffer first (about
# half a load's time). Safe because checkpoint files are never modified in place.
_MAP_FILES = True


def _map(f: Any) -> Optional[memoryview]:
    """A read-only memory map of the open file ``f``; ``None`` for an empty file."""
    size = os.fstat(f.fileno()).st_size
    return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)) if size else None


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor entries load with ``torch.load(weights_only=True)``; keys matched as
    given (``extra`` is one object), keys absent from the checkpoint skipped (validated before loading)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, allow_partial_load=True)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # ``self.state_dict`` may be a copy (sharded-tensor flattening): fill the caller's dict.
        loaded = torch.load(value, weights_only=True)
        self.state_dict[read_item.dest_index.fqn] = loaded
        self.original_state_dict[read_item.dest_index.fqn] = loaded


class CheckedRead:
    """What this rank needs from a checkpoint, read and CRC-checked (non-tensor entries already in the state
    dict), not yet copied into its tensors: ``commit`` does that. Holding it holds the file bytes read."""

    def __init__(self, reader: _VerifyingReader, planner: _SafeLoadPlanner) -> None:
        self._reader, self._planner = reader, planner

    @torch.no_grad()
    def commit(self, keys: Optional[Callable[[str], bool]] = None) -> None:
        """Copy the checked tensors whose key ``keys`` accepts (all by default) into their targets."""
        rest = []
        for item, target, source in self._reader.pending:
            if keys is None or keys(item.dest_index.fqn):
                target.copy_(source)
                self._planner.commit_tensor(item, target)
            else:
                rest.append((item, target, source))
        self._reader.pending = rest


def read_checked(state: dict[str, Any], path: Path, metadata: Optional[Metadata] = None) -> CheckedRead:
    """Read and CRC-check what this rank needs of ``state`` (tensors are targets, DCP's planner reshards; other
    values are replaced by the saved objects); no collectives, and no tensor of ``state`` changes until ``commit``."""
    reader = _VerifyingReader(path, metadata)
    planner = _SafeLoadPlanner()
    metadata = reader.read_metadata()
    # DCP's load steps for one process (``dcp.load(no_dist=True)``), minus its exception wrapping:
    # errors keep their own type and message.
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()
    return CheckedRead(reader, planner)


def dcp_load(state: dict[str, Any], path: Path, *, metadata: Optional[Metadata] = None) -> None:
    """Fill ``state`` from the checkpoint at ``path``, on this rank alone, once every record read passed its check."""
    read_checked(state, path, metadata).commit()

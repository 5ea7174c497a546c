"""One DCP record (a ``torch.save`` zip archive) checked and decoded from bytes already in memory.

Each record in a ``.distcp`` file is a stored zip whose entries carry CRC-32s, which ``torch.load``
never checks. Here every CRC-32 is computed over a ``memoryview`` of the file's bytes, and a tensor
record becomes a tensor viewing those same bytes (no copy, no per-record ``torch.load``); its
``data.pkl`` is read by an unpickler that knows ``_rebuild_tensor_v2`` and the storage classes only.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import warnings
import zlib
from typing import Any, Optional

import torch

from .checks import CheckpointError

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header
_ZIP64_MARK = 0xFFFFFFFF


def entries(record: memoryview, where: str) -> Optional[dict[str, memoryview]]:
    """``{entry name: its bytes}`` of a stored zip record, every entry's CRC-32 checked.

    Returns ``None`` for a zip this parser does not handle (compressed entries, ZIP64 sizes, a
    trailing comment): the caller then checks it with ``zipfile``. Raises ``CheckpointError`` for
    a damaged record.
    """
    try:
        return _entries(record, where)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"shard record {where} is corrupted: {e}") from e


def _entries(record: memoryview, where: str) -> Optional[dict[str, memoryview]]:
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

"""Hugging Face weight files on disk: safetensors headers, index files, shard plans, a streaming writer.

Pure file handling, no process group and no model: ``load``/``save`` decide what to read or write.
The safetensors format is small enough to handle directly (8-byte little-endian header length, a
JSON header ``{name: {"dtype", "shape", "data_offsets"}}``, then the raw bytes). Reading the header
ourselves lets every rank pread exactly its own rows of a tensor (nothing memory-mapped, so no
page of another rank's shard counts in this rank's RSS), and writing it ourselves lets a file be
streamed tensor by tensor without holding the whole file in memory first.

Example:
    entries = read_checkpoint_index("llama-dir")  # {key: TensorEntry(file, dtype, shape, offset)}
    rows = read_rows(entries["lm_head.weight"], start=0, count=8)
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Optional, Union

import torch

from ..files import incomplete_path

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "PlannedFilesWriter",
    "SafetensorsLayout",
    "SafetensorsStreamWriter",
    "TensorEntry",
    "parse_size",
    "plan_shard_files",
    "read_checkpoint_index",
    "read_rows",
    "read_safetensors_header",
    "shard_file_names",
    "staging_dir",
    "write_at",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit: a bigger header is a corrupt file


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file: ``file``, its ``dtype`` and ``shape``, byte ``offset``.

    Example:
        entry = read_safetensors_header("model.safetensors")["wte.weight"]
        entry.shape, entry.dtype
        # -> ((50257, 768), torch.float32)
    """

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's first byte in ``file``
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a 0-dim one)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_safetensors_header(file: Union[str, os.PathLike]) -> dict[str, TensorEntry]:
    """The tensors of one ``.safetensors`` file (header only: no tensor byte is read).

    Raises ``ValueError`` naming the file when the header is not valid safetensors, or when a
    tensor's bytes lie beyond the end of the file (a truncated download).

    Example:
        sorted(read_safetensors_header("model.safetensors"))[:2]
        # -> ['lm_head.weight', 'model.embed_tokens.weight']
    """
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file: shorter than its 8-byte header length.")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{file} is not a safetensors file: header length {length} exceeds the file.")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file} is not a safetensors file: its header is not JSON ({e}).") from e
    base = 8 + length
    entries: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{file}: the header entry of {key!r} is malformed ({e!r}).") from e
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or base + end > size:
            raise ValueError(
                f"{file}: tensor {key!r} ({info['dtype']} {list(shape)}) needs bytes {begin}..{end} of the "
                f"data section but the file ends at {size - base}: truncated or corrupt."
            )
        entries[key] = TensorEntry(file, key, dtype, shape, base + begin, nbytes)
    return entries


def read_checkpoint_index(path: Union[str, os.PathLike]) -> dict[str, TensorEntry]:
    """Every tensor of a Hugging Face checkpoint: a model directory or one ``.safetensors`` file.

    A directory is read through ``model.safetensors.index.json`` when present (only the files it
    names, so a stale extra file is never read), else its ``model.safetensors``.

    Raises:
        FileNotFoundError: ``path``, its index's shard files, or its weights file do not exist.
        ValueError: a file is not valid safetensors, or the index names a key its file lacks.

    Example:
        entries = read_checkpoint_index("out/llama")  # dir with model.safetensors or an index
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {path}: the path does not exist.")
    if path.is_file():
        return read_safetensors_header(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{index} is not a safetensors index (no 'weight_map'): {e!r}") from e
        entries: dict[str, TensorEntry] = {}
        headers: dict[str, dict[str, TensorEntry]] = {}
        for key, name in weight_map.items():
            if name not in headers:
                shard = path / name
                if not shard.is_file():
                    raise FileNotFoundError(f"{index} names {name} (for {key!r}) but {shard} does not exist.")
                headers[name] = read_safetensors_header(shard)
            if key not in headers[name]:
                raise ValueError(f"{index} maps {key!r} to {name}, which does not hold it.")
            entries[key] = headers[name][key]
        return entries
    single = path / SINGLE_NAME
    if single.is_file():
        return read_safetensors_header(single)
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise FileNotFoundError(
        f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}"
        + (f" (it has {found}; pass one file's path to load it alone)." if found else ".")
    )


def read_rows(
    entry: TensorEntry, start: int = 0, count: Optional[int] = None, *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Rows ``start:start+count`` (along dim 0) of a stored tensor, read with one ``pread``.

    Rows of a row-major tensor are one contiguous byte range, so a rank reads exactly the bytes
    of its shard; nothing is memory-mapped. ``count=None`` reads to the end. ``out``: a contiguous
    CPU tensor of the stored dtype and the rows' shape to read straight into (no extra copy).

    Example:
        read_rows(entry, 4, 2).shape  # rows 4 and 5
        # -> torch.Size([2, 768])
    """
    if not entry.shape:  # 0-dim
        start, count, shape = 0, 1, ()
    else:
        count = entry.shape[0] - start if count is None else count
        shape = (count, *entry.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=entry.dtype)
    elif out.dtype != entry.dtype or tuple(out.shape) != tuple(shape) or not out.is_contiguous() or out.is_cuda:
        raise ValueError(f"read_rows(): out must be a contiguous CPU {entry.dtype} tensor of shape {tuple(shape)}.")
    nbytes = count * entry.row_bytes
    if nbytes:
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        with open(entry.file, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], entry.offset + start * entry.row_bytes)
        if got != nbytes:
            raise OSError(f"{entry.file}: short read of {entry.key!r} ({got} of {nbytes} bytes).")
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` (10^9, as Hugging Face counts), ``"500MiB"`` (2^20) or an int of bytes -> bytes.

    Example:
        >>> parse_size("5GB"), parse_size("1MiB"), parse_size(1000)
        (5000000000, 1048576, 1000)
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(
            f"max_shard_size={size!r} is not accepted. Accepted: bytes as an int, or '5GB', '500MB', '2GiB'."
        )
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.match(size)
        if not m:
            raise ValueError(
                f"max_shard_size={size!r} is not accepted. Accepted: bytes as an int, or '5GB', '500MB', '2GiB'."
            )
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} is not accepted: it must be positive.")
    return value


def plan_shard_files(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Split keys (in order) into files of at most ``max_shard_size`` bytes, as Hugging Face does.

    A tensor larger than the limit gets a file of its own.

    Example:
        >>> plan_shard_files({"a": 6, "b": 6, "c": 1}, 10)
        [['a'], ['b', 'c']]
    """
    files: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if files[-1] and used + size > max_shard_size:
            files.append([])
            used = 0
        files[-1].append(key)
        used += size
    return files if files[0] else []


def shard_file_names(count: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class SafetensorsLayout:
    """A safetensors file planned before any tensor exists: its header bytes and where each tensor goes.

    ``layout``: ``{key: (dtype, shape)}`` in file order. ``header`` is the file's first
    ``data_start`` bytes (8-byte length, JSON, padded so the data starts 8-byte aligned, as the
    safetensors library writes it); ``offset[key]`` is the absolute byte offset of ``key``'s first
    byte and ``size`` the file's length. Knowing every offset up front is what lets several
    writers fill one file in any order (``write_at``).

    Example:
        >>> plan = SafetensorsLayout({"a": (torch.float32, (2, 3)), "b": (torch.bfloat16, (4,))})
        >>> plan.offset["b"] - plan.offset["a"], plan.size - plan.data_start
        (24, 32)
    """

    def __init__(self, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        relative: dict[str, int] = {}
        end = 0
        for key, (dtype, shape) in layout.items():
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [end, end + nbytes]}
            relative[key] = end
            end += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(self.header)
        self.offset = {k: self.data_start + r for k, r in relative.items()}
        self.size = self.data_start + end

    def create(self, file: Union[str, os.PathLike]) -> None:
        """Write the header and size ``file`` to its final length (the data bytes are filled by ``write_at``)."""
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, self.size)
            _pwrite_all(fd, memoryview(self.header), 0, file)
        finally:
            os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int, file: object) -> None:
    while len(data):
        done = os.pwrite(fd, data, offset)
        if done <= 0:
            raise OSError(f"{file}: write returned {done} at byte {offset}.")
        data, offset = data[done:], offset + done


def write_at(fd: int, offset: int, tensor: torch.Tensor, *, file: object = "") -> None:
    """Write ``tensor``'s bytes (row-major) at byte ``offset`` of the open file ``fd`` (``os.pwrite``).

    Several processes may write disjoint ranges of one file at once. A non-contiguous or non-CPU
    tensor is copied to a contiguous CPU one first.

    Example:
        fd = os.open("model.safetensors", os.O_WRONLY)
        write_at(fd, plan.offset["lm_head.weight"] + start_row * row_bytes, local_rows)
    """
    data = tensor.detach()
    if data.device.type != "cpu" or not data.is_contiguous():
        data = data.to("cpu").contiguous()
    if data.numel():
        _pwrite_all(fd, memoryview(data.reshape(-1).view(torch.uint8).numpy()), offset, file)


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensors' names, dtypes and shapes are known up front.

    The header is written first; then ``write(key, tensor)`` appends each tensor's bytes in the
    announced order, so only one tensor is in memory at a time.

    Example:
        >>> with SafetensorsStreamWriter("m.safetensors", {"w": (torch.float32, (2, 2))}) as w:
        ...     w.write("w", torch.zeros(2, 2))
    """

    def __init__(self, file: Union[str, os.PathLike], layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.file = Path(file)
        self._order = list(layout)
        self._layout = layout
        self._f: Optional[BinaryIO] = open(self.file, "wb")
        self._f.write(SafetensorsLayout(layout).header)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (must be the next announced key, with its dtype and shape)."""
        want = self._order[self._next] if self._next < len(self._order) else None
        dtype, shape = self._layout.get(key, (None, None))
        if key != want or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{self.file}: expected {want!r} next ({dtype}, {shape}); got {key!r} ({tensor.dtype}, {tuple(tensor.shape)})."
            )
        data = tensor.detach().to("cpu").contiguous()
        if data.numel():
            self._f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        """Flush to disk; refuses a file that did not get every announced tensor."""
        if self._f is None:
            return
        f, self._f = self._f, None
        try:
            if self._next != len(self._order):
                raise ValueError(f"{self.file}: only {self._next} of {len(self._order)} tensors were written.")
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._f is not None:
            self._f.close()
            self._f = None


class PlannedFilesWriter:
    """Streams tensors into the planned safetensors files (``plan_shard_files``): each file is opened
    at its first tensor and closed, complete, at its last; leaving on an error closes what is open.

    Example:
        with PlannedFilesWriter(tmp, where, files) as out:
            for key, tensor in tensors.items():
                out.write(key, tensor)
    """

    def __init__(self, folder: Path, where: dict[str, str], files: dict[str, dict]) -> None:
        self.folder, self.where, self.files = Path(folder), where, files
        self._open: dict[str, SafetensorsStreamWriter] = {}
        self._left = {name: len(layout) for name, layout in files.items()}

    def write(self, key: str, tensor: torch.Tensor) -> None:
        name = self.where[key]
        if name not in self._open:
            self._open[name] = SafetensorsStreamWriter(self.folder / name, self.files[name])
        self._open[name].write(key, tensor)
        self._left[name] -= 1
        if not self._left[name]:
            self._open.pop(name).close()

    def __enter__(self) -> PlannedFilesWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        for writer in self._open.values():  # only files that did not get every tensor are still open
            writer.__exit__(RuntimeError, None, None)
        self._open.clear()


def staging_dir(path: Union[str, os.PathLike], *, overwrite: bool, caller: str) -> Path:
    """Check ``path`` may be written, then make (afresh) the hidden directory beside it to write into.

    An existing non-empty ``path`` is refused unless ``overwrite``; a file at ``path`` always is.
    Nothing at ``path`` is touched here: ``publish_dir`` swaps the finished directory in.

    Example:
        >>> tmp = staging_dir("out/llama", overwrite=False, caller="save_pretrained()")
    """
    import shutil

    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise FileExistsError(f"{caller}: {path} exists and is a file; pass a directory path.")
        if any(path.iterdir()) and not overwrite:
            raise FileExistsError(f"{caller}: {path} exists and is not empty; pass overwrite=True to replace it.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = incomplete_path(path)
    if tmp.exists():  # left by an interrupted save: ours, never the user's
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp

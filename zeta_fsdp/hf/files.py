"""Hugging Face weight files on disk: safetensors headers, index files, shard plans, writes at offsets.

No process group and no model. The safetensors format is small enough to handle directly: reading
the header ourselves lets every rank pread exactly its own rows (nothing memory-mapped, so no page
of another rank's shard counts in this rank's RSS); writing it lets a file be planned before any
tensor exists, then filled by every rank at its own offsets.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from ..files import PathLock, end_stage, incomplete_path, publish_dir, stage_dir
from ..state_dict.checks import CheckpointError, foreign_entries
from ..state_dict.publish import LOCK_WAIT_S

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "SafetensorsLayout",
    "TensorEntry",
    "contained_file",
    "parse_size",
    "plan_hf_files",
    "plan_shard_files",
    "read_checkpoint_index",
    "read_rows",
    "read_safetensors_header",
    "end_staging",
    "publish_staged",
    "staging_dir",
    "written_here",
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
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E8M0": torch.float8_e8m0fnu,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit: a bigger header is a corrupt file


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file: ``file``, its ``dtype`` and ``shape``, byte ``offset``."""

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


def _bad(file: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{file} is not a valid safetensors file: {why}. Re-download or re-save it.")


def _parse_json(raw: bytes, file: Path, what: str) -> object:
    """``raw`` parsed as JSON; ``CheckpointError`` naming ``file`` when it is not (a deep nesting included)."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: its {what} is not JSON ({e}). Re-download or re-save it.") from e
    except RecursionError as e:  # a deeply nested document: refused, never a crash
        raise CheckpointError(f"{file}: its {what} is nested too deeply to be a safetensors {what}.") from e


def read_safetensors_header(file: Union[str, os.PathLike]) -> dict[str, TensorEntry]:
    """The tensors of one ``.safetensors`` file, from its header alone. ``CheckpointError`` naming the file for a
    malformed entry, or a byte range that does not match its shape, leaves the data section or overlaps another."""
    file = Path(file)
    header, base, size = _read_header_json(file)
    entries: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict):
                raise _bad(file, f"its __metadata__ is a {type(info).__name__}, not an object")
            continue
        entries[key] = _header_entry(file, key, info, base, size - base)
    _check_no_overlap(file, entries.values(), base)
    return entries


def _read_header_json(file: Path) -> tuple[dict, int, int]:
    """``(header, where the data section starts, the file's size)``: the length-prefixed JSON header."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise _bad(file, "shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise _bad(file, f"header length {length} exceeds the file ({size} bytes)")
        header = _parse_json(f.read(length), file, "header")
    if not isinstance(header, dict):
        raise _bad(file, f"its header is a JSON {type(header).__name__}, not an object")
    return header, 8 + length, size


def _header_entry(file: Path, key: str, info: Any, base: int, data: int) -> TensorEntry:
    """One tensor's header entry, checked: a dtype torch has, a shape, and ``data_offsets`` spanning
    exactly its bytes inside the ``data``-byte data section (which starts at byte ``base``)."""
    if not isinstance(info, dict):
        raise _bad(file, f"the header entry of {key!r} is a {type(info).__name__}, not an object")
    dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None and isinstance(info.get("dtype"), str) and info["dtype"].isupper():
        # a safetensors dtype torch has no type for (F4, F6_*, C64...): a valid file we cannot read
        raise CheckpointError(
            f"{file}: tensor {key!r} has dtype {info['dtype']!r}, which zeta_fsdp cannot read. "
            f"Supported dtypes: {', '.join(DTYPES)}."
        )
    shape = info.get("shape")
    shape = tuple(shape) if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) else None
    offsets = info.get("data_offsets")
    if dtype is None or shape is None or not isinstance(offsets, list) or len(offsets) != 2:
        raise _bad(file, f"the header entry of {key!r} is malformed (need dtype, shape, data_offsets): {info!r:.200}")
    nbytes = math.prod(shape) * dtype.itemsize
    _check_offsets(file, key, offsets, data, nbytes, f"{info['dtype']} {list(shape)}, {nbytes} bytes")
    return TensorEntry(file, key, dtype, shape, base + offsets[0], nbytes)


def _check_offsets(file: Path, key: str, offsets: list, data: int, nbytes: int, layout: str) -> None:
    """``data_offsets`` are ints spanning exactly the tensor's ``nbytes`` (``layout``: its dtype, shape
    and size, for the message) inside the ``data``-byte data section."""
    begin, end = offsets
    if type(begin) is not int or type(end) is not int:
        raise _bad(file, f"the data_offsets of {key!r} are not ints: {offsets!r:.100}")
    if begin < 0 or end < begin or end - begin != nbytes:
        raise _bad(file, f"tensor {key!r} ({layout}) has data_offsets [{begin}, {end}]")
    if end > data:
        raise _bad(
            file,
            f"tensor {key!r} needs bytes {begin}..{end} of the data section but it ends at {data} "
            "(truncated or corrupt)",
        )


def _check_no_overlap(file: Path, entries: Iterable[TensorEntry], base: int) -> None:
    """No two tensors share a byte of the data section (empty tensors occupy none)."""
    reached, last = 0, None  # the end of the data seen so far, sorted by offset, and whose it is
    ranges = sorted((e.offset - base, e.offset - base + e.nbytes, e.key) for e in entries if e.nbytes)
    for begin, end, key in ranges:
        if begin < reached:
            raise _bad(file, f"tensors {last!r} and {key!r} overlap (bytes {begin}..{min(end, reached)})")
        reached, last = end, key


def contained_file(folder: Union[str, os.PathLike], name: object, what: str) -> Path:
    """``folder / name`` for a name read from ``what`` (a file in ``folder``); ``CheckpointError`` unless it lies
    inside ``folder`` (or a hub cache snapshot's ``blobs``), symbolic links resolved."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name) or ".." in Path(name).parts:
        raise CheckpointError(
            f"{what} names {name!r}, which is not a file inside {folder}; refusing to read it "
            "(an index may only name files of its own directory)."
        )
    target = folder / name
    real = target.resolve()
    roots = [folder.resolve()]
    if roots[0].parent.name == "snapshots":  # a hub cache snapshot (models--x/snapshots/<rev>) links into blobs/
        roots.append((roots[0].parent.parent / "blobs").resolve())
    if not any(real == root or root in real.parents for root in roots):
        raise CheckpointError(
            f"{what} names {name!r}, which resolves to {real}, outside {folder}; refusing to read it."
        )
    return target


def read_checkpoint_index(path: Union[str, os.PathLike]) -> dict[str, TensorEntry]:
    """Every tensor of a Hugging Face checkpoint: one ``.safetensors`` file, or a model directory: its
    ``model.safetensors`` when present, else through its index (only the files it names, each ``contained_file``).
    With both, the single file wins, as in transformers' ``from_pretrained`` (an index left by an earlier sharded
    save is stale: transformers' own re-save leaves one).

    ``FileNotFoundError`` for a missing path or file; ``CheckpointError`` for a malformed index or header,
    a file outside the directory, or an index naming a key its file lacks.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {path}: the path does not exist.")
    if path.is_file():
        return read_safetensors_header(path)
    index, single = path / INDEX_NAME, path / SINGLE_NAME
    if single.is_file():
        return read_safetensors_header(contained_file(path, SINGLE_NAME, str(path)))
    if index.is_file():
        return _read_indexed(path, index)
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise FileNotFoundError(
        f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}"
        + (f" (it has {found}; pass one file's path to load it alone)." if found else ".")
    )


def _weight_map(index: Path) -> dict:
    """The index's ``weight_map`` (tensor name -> file name), a JSON object, else ``CheckpointError``."""
    document = _parse_json(index.read_bytes(), index, "index")
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index} is not a safetensors index: need a JSON object with a 'weight_map' object "
            f"of {{tensor name: file name}}, got {type(document).__name__}"
            + ("" if not isinstance(document, dict) else f" whose weight_map is {type(weight_map).__name__}")
            + "."
        )
    return weight_map


def _read_indexed(path: Path, index: Path) -> dict[str, TensorEntry]:
    """Every tensor the ``index`` of directory ``path`` names, from the headers of the files it names
    (each read once, each ``contained_file``); a key its file lacks is refused."""
    weight_map = _weight_map(index)
    entries: dict[str, TensorEntry] = {}
    headers: dict[str, dict[str, TensorEntry]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{index} maps {key!r} to {name!r}, not a file name.")
        if name not in headers:
            shard = contained_file(path, name, str(index))
            if not shard.is_file():
                raise FileNotFoundError(f"{index} names {name} (for {key!r}) but {shard} does not exist.")
            headers[name] = read_safetensors_header(shard)
        if key not in headers[name]:
            raise CheckpointError(f"{index} maps {key!r} to {name}, which does not hold it.")
        entries[key] = headers[name][key]
    return entries


def read_rows(
    entry: TensorEntry,
    start: int = 0,
    count: Optional[int] = None,
    *,
    out: Optional[torch.Tensor] = None,
    fd: Optional[int] = None,
) -> torch.Tensor:
    """Rows ``start:start+count`` (along dim 0) of a stored tensor, read with one ``pread``.

    ``count=None`` reads to the end. ``out``: a contiguous CPU tensor of the stored dtype and the
    rows' shape to read straight into. ``fd``: ``entry.file`` already open for reading.
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
        if fd is None:
            with open(entry.file, "rb", buffering=0) as f:
                got = os.preadv(f.fileno(), [buf], entry.offset + start * entry.row_bytes)
        else:
            got = os.preadv(fd, [buf], entry.offset + start * entry.row_bytes)
        if got != nbytes:
            raise OSError(f"{entry.file}: short read of {entry.key!r} ({got} of {nbytes} bytes).")
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` (10^9, as Hugging Face counts), ``"500MiB"`` (2^20) or an int of bytes -> bytes."""
    m = _SIZE.match(size) if isinstance(size, str) else None
    if isinstance(size, bool) or not (isinstance(size, int) or m):
        raise ValueError(
            f"max_shard_size={size!r} is not accepted. Accepted: bytes as an int, or '5GB', '500MB', '2GiB'."
        )
    value = size if isinstance(size, int) else int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} is not accepted: it must be positive.")
    return value


def plan_shard_files(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Split keys (in order) into files of at most ``max_shard_size`` bytes, as Hugging Face does.

    A tensor larger than the limit gets a file of its own.
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


def plan_hf_files(
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], max_shard_size: int
) -> tuple[dict[str, str], dict[str, SafetensorsLayout]]:
    """``({saved key: file name}, {file name: its layout})`` for saved keys in order, files named as
    Hugging Face names them (``model.safetensors``, else ``model-0000i-of-0000n.safetensors``)."""
    groups = plan_shard_files({k: math.prod(s) * d.itemsize for k, (d, s) in layout.items()}, max_shard_size)
    count = len(groups)
    names = [SINGLE_NAME] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    where = {k: name for name, keys in zip(names, groups) for k in keys}
    return where, {name: SafetensorsLayout({k: layout[k] for k in keys}) for name, keys in zip(names, groups)}


@contextlib.contextmanager
def _naming(file: Path) -> Iterator[None]:
    """An ``OSError`` (a full disk, a quota) raised inside names ``file`` and says what to do."""
    try:
        yield
    except OSError as e:
        if str(file) in str(e):
            raise
        raise OSError(
            e.errno,
            f"cannot write {file}: {e.strerror or e}; free space there (or fix its permissions) or save elsewhere",
        ) from e


class SafetensorsLayout:
    """A safetensors file planned before any tensor exists: its header bytes and where each tensor goes.

    ``layout``: ``{key: (dtype, shape)}`` in file order. ``header``: the file's first ``data_start``
    bytes; ``offset[key]``: the absolute offset of ``key``'s first byte; ``size``: the file's length.
    Knowing every offset up front lets several writers fill one file in any order (``write_at``).
    """

    def __init__(self, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        relative: dict[str, int] = {}
        end = 0
        for key, (dtype, shape) in layout.items():
            nbytes = math.prod(shape) * dtype.itemsize
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
        with _naming(Path(file)):
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, self.size)
                write_at(fd, 0, torch.frombuffer(bytearray(self.header), dtype=torch.uint8), file=file)
            finally:
                os.close(fd)


def write_at(fd: int, offset: int, tensor: torch.Tensor, *, file: object = "") -> None:
    """Write ``tensor``'s bytes (row-major) at byte ``offset`` of the open file ``fd``: several processes
    may write disjoint ranges of one file at once."""
    data = tensor.detach()
    if data.device.type != "cpu" or not data.is_contiguous():
        data = data.to("cpu").contiguous()
    view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
    with _naming(Path(str(file))):  # a full disk names the file and says what to do
        while len(view):
            done = os.pwrite(fd, view, offset)
            if done <= 0:
                raise OSError(f"{file}: write returned {done} at byte {offset}.")
            view, offset = view[done:], offset + done


_WRITTEN = re.compile(
    r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json|config\.json|"
    r"generation_config\.json|adapter_model\.safetensors|adapter_config\.json)$"
)
# ``{staging directory: (its target, the held lock, overwrite)}`` from ``staging_dir`` to ``end_staging``.
_STAGED: dict[Path, tuple[Path, PathLock, bool]] = {}


def written_here(name: str) -> bool:
    """``True`` for the names of the files ``save_pretrained``, ``consolidate_to_hf`` and ``save_adapters`` write."""
    return bool(_WRITTEN.match(name))


def staging_dir(path: Union[str, os.PathLike], *, overwrite: bool, caller: str) -> Path:
    """Lock ``path``, check it may be written, then make (afresh) the hidden directory beside it to write into
    (``files.stage_dir``).

    The lock (held until ``end_staging``) makes two jobs writing one model directory take turns.
    A non-empty ``path`` is replaced only with ``overwrite`` and only if it holds nothing but regular
    files this library writes (``written_here``): a folder holding notes, a tokenizer or ``.git`` is not
    ours to replace. A file or a symbolic link (the folder it points to would not be the one replaced) is
    refused. Nothing at ``path`` is touched here.
    """
    if not isinstance(overwrite, bool):
        raise ValueError(f"{caller}: overwrite={overwrite!r} is not accepted. Accepted: True or False.")
    path = Path(path)

    def check(target: Path) -> None:
        if target.is_symlink():
            raise FileExistsError(
                f"{caller}: {target} is a symbolic link (to {os.path.realpath(target)}); pass the directory itself."
            )
        if target.exists() and not target.is_dir():
            raise FileExistsError(f"{caller}: {target} exists and is a file; pass a directory path.")
        if target.exists() and any(target.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{caller}: {target} exists and is not empty; pass overwrite=True to replace it.")
            shown = foreign_entries(target, lambda e: e.is_file(follow_symlinks=False) and written_here(e.name))
            if shown:
                raise FileExistsError(
                    f"{caller}: {target} is not a model directory written by this library (it holds files this "
                    f"library does not write ({shown})); refusing to replace it, even with overwrite=True. "
                    "Save elsewhere, or remove it yourself."
                )

    lock = stage_dir(path, ours=written_here, check=check, timeout_s=LOCK_WAIT_S)
    if lock is None:
        raise FileExistsError(
            f"{caller}: another job is writing {path} (it holds {PathLock(path).file}) and did not finish within "
            f"{LOCK_WAIT_S:.0f} s; wait for it, or save elsewhere."
        )
    tmp = incomplete_path(path)
    _STAGED[tmp] = (path, lock, overwrite)
    return tmp


def publish_staged(tmp: Path, path: Union[str, os.PathLike]) -> Path:
    """Put ``staging_dir``'s finished ``tmp`` in place at ``path`` (``files.publish_dir``, the target checked again:
    a file a user added meanwhile is kept and named, never deleted)."""
    return publish_dir(tmp, path, ours=written_here, replace=_STAGED[Path(tmp)][2])


def end_staging(tmp: Path) -> None:
    """After a save: discard what a failed save left in ``tmp`` (our files only), and release ``staging_dir``'s
    lock."""
    path, lock, _ = _STAGED.pop(Path(tmp))
    end_stage(path, lock, written_here)

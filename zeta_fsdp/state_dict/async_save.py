"""Checkpoints written in the background: ``AsyncCheckpointer`` (stage a CPU copy, DCP writes it, rank 0 publishes)."""

from __future__ import annotations

import atexit
import copy
import threading
import warnings
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.tensor import DTensor

from ..distributed import get_rank, get_world_size, is_distributed
from ..files import PathLock, incomplete_path
from .checkpoint import checkpoint_state, end_save, save_failure, start_save
from .checks import FAILURES, CheckpointError, PathLike, checkpoint_on_all_ranks
from .publish import publish_checkpoint


@torch.no_grad()
def stage_state(state: dict[str, Any], buffers: Optional[dict[str, torch.Tensor]] = None) -> dict[str, Any]:
    """A CPU copy of ``state`` later training cannot change (a ``DTensor`` around a copy of its local shard, so DCP
    writes what ``save_checkpoint`` would). ``buffers`` (``{key: CPU tensor}``) are reused by later calls:
    copying into memory already mapped is several times faster than into fresh pages."""
    out: dict[str, Any] = {}
    buffers = {} if buffers is None else buffers
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            kept = buffers.get(key)
            if kept is None or kept.shape != local.shape or kept.dtype != local.dtype:
                kept = buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
            kept.copy_(local.detach())
            if isinstance(value, DTensor):  # the same mesh and placements around the CPU copy
                kept = DTensor.from_local(
                    kept, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
                )
            out[key] = kept
        else:
            out[key] = copy.deepcopy(value)
    return out


class _GatedWriter(FileSystemWriter):
    """DCP's file writer whose ``reset`` (the first thing the write thread does, before any collective)
    waits for ``gate``: ``True`` once every rank started its write, ``False`` to cancel it. As DCP's
    stager it hands back the state dict ``stage_state`` copied already (no second copy)."""

    def __init__(self, path: Path, gate: Future) -> None:
        super().__init__(path)
        self._gate = gate

    def reset(self, checkpoint_id: Any = None) -> None:
        if not self._gate.result():
            raise CheckpointError("the save did not start on every rank; this rank's write was cancelled")
        super().reset(checkpoint_id)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


class AsyncCheckpointer:
    """Save checkpoints without stopping training for the write.

    ``save()`` takes ``save_checkpoint``'s arguments and returns once every rank's shards are copied to CPU
    memory; DCP writes them in a background thread on a gloo group of its own, rank 0 publishes: what
    ``save_checkpoint`` would write, with its guarantees. At most one save is in flight (the next call, or
    exit, waits for it); the CPU copy is reused unless ``reuse_buffers=False``. Every rank (docs/long_jobs.md).

    Example:
        checkpointer = AsyncCheckpointer()
        checkpointer.save(f"ckpt/step_{step}", model, optimizer, extra={"step": step})
        ...  # keep training; the write goes on in the background
        checkpointer.wait()  # the checkpoint is complete (raises CheckpointError if it failed)
    """

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None, reuse_buffers: bool = True) -> None:
        self._group = process_group
        self._buffers: Optional[dict[str, torch.Tensor]] = {} if reuse_buffers else None
        self._made_group = False
        self._pending: Optional[tuple[Path, Optional[PathLock], Future]] = None
        self._closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref()._wait_here())  # type: ignore[union-attr]

    @property
    def in_flight(self) -> Optional[Path]:
        """The checkpoint being written now (``None`` when none is).

        Example:
            checkpointer.in_flight  # -> PosixPath('ckpt/step_200') while that save is written
        """
        return None if self._pending is None or self._pending[2].done() else self._pending[0]

    def save(
        self,
        path: PathLike,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        extra: Any = None,
        overwrite: bool = False,
    ) -> Path:
        """Stage this rank's shards, start writing them in the background, and return ``path``.

        Waits first for a save still in flight. Bad input raises as ``save_checkpoint`` does, before
        anything is written.

        Example:
            checkpointer.save("ckpt/step_100", model, optimizer, extra={"step": 100})
        """
        if self._closed:
            raise RuntimeError("AsyncCheckpointer.save(): the checkpointer was closed.")
        self.wait()
        path = Path(path)
        self._ensure_group()
        lock = start_save(path, optimizer, extra, overwrite=overwrite)
        try:
            # every rank staged, or every rank raises; the live tensors are not referenced afterwards
            staged = checkpoint_on_all_ranks(
                lambda: stage_state(checkpoint_state(model, optimizer, extra), self._buffers)
            )
            upload = self._start_upload(path, staged)
        except FAILURES as e:
            end_save(path, lock)
            raise save_failure(path, f"staging {path}", e) from e
        done: Future = Future()
        publisher = get_rank() == 0
        threading.Thread(target=_finish, args=(upload, path, publisher, done), daemon=True).start()
        self._pending = (path, lock, done)
        return path

    def _ensure_group(self) -> None:
        """A gloo group of its own: the background thread's collectives never interleave with
        training's (and CPU tensors need a CPU backend even when training runs on nccl)."""
        if self._group is None and is_distributed() and get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
            self._made_group = True

    def _start_upload(self, path: Path, staged: dict[str, Any]) -> Any:
        """Start DCP's background write of ``staged`` on every rank, or on none: a write thread must not wait
        in its first collective for a peer whose write failed to start (until gloo's timeout). It waits at
        the gate until the ranks agree."""
        gate: Future = Future()

        def start() -> Any:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                return dcp.async_save(
                    staged,
                    checkpoint_id=incomplete_path(path),  # DCP then calls the writer's reset() first, in the thread
                    storage_writer=_GatedWriter(incomplete_path(path), gate),
                    planner=DefaultSavePlanner(flatten_state_dict=False),
                    process_group=self._group,
                    no_dist=not is_distributed(),
                )

        try:
            upload = checkpoint_on_all_ranks(start)
        except FAILURES:
            gate.set_result(False)  # a thread that started here stops before its first collective
            raise
        gate.set_result(True)
        return upload

    def wait(self) -> Optional[Path]:
        """Block until the save in flight is written and published; return its path (``None`` if none).

        Call on every rank. A failed write raises ``CheckpointError`` on every rank, and the
        partial directory is removed (the previous checkpoint stays the latest).

        Example:
            checkpointer.wait()
            # -> PosixPath('ckpt/step_100')
        """
        if self._pending is None:
            return None
        path, lock, done = self._pending
        self._pending = None
        try:
            checkpoint_on_all_ranks(done.result)  # raises this rank's write error, if any, on every rank
        except FAILURES as e:
            raise save_failure(path, f"writing {path}", e) from e
        finally:
            end_save(path, lock)
        return path

    def close(self) -> None:
        """Wait for the save in flight, then release the checkpointer's process group. Every rank.

        Example:
            checkpointer.close()
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._buffers = None
            if self._made_group and is_distributed():
                dist.destroy_process_group(self._group)
            self._group = None

    def _wait_here(self) -> None:
        """At interpreter exit: let the write in flight finish (this rank only, no collective)."""
        if self._pending is not None:
            self._pending[2].exception()
            if self._pending[1] is not None:
                self._pending[1].release()


def _finish(upload: Any, path: Path, publisher: bool, done: Future) -> None:
    """Background: wait for DCP's write (every rank's files, and the metadata), then publish on rank 0."""
    try:
        result = upload.upload_completion if hasattr(upload, "upload_completion") else upload
        result.result()
        if publisher:
            publish_checkpoint(path)
        done.set_result(path)
    except BaseException as e:  # noqa: BLE001 - handed to wait(), which raises it on every rank
        done.set_exception(e)

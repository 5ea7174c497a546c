"""A checkpoint directory for a training loop: ``CheckpointManager``.

``root/step_<n>`` every N steps, the last K kept, the latest complete one found and resumed from
(or a fresh start) in one call, and a save-and-stop at the step boundary after a preemption signal.
The same script works on first launch and on every relaunch.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from ..distributed import get_rank, get_world_size, is_distributed
from ..files import PathLock
from ..training.nonfinite import first_nonfinite
from .async_save import AsyncCheckpointer
from .checkpoint import load_checkpoint, save_checkpoint
from .checks import CheckpointError, PathLike, checkpoint_on_all_ranks, from_rank0
from .preemption import PreemptionHandler, SignalLike
from .publish import discard_checkpoint_dir, discard_staging, is_checkpoint

_STEP_DIR = re.compile(r"^step_(\d+)$")
_STALE = re.compile(r"^\.step_\d+\.incomplete$")


def checkpoint_dirs(root: PathLike) -> list[Path]:
    """The complete ``root/step_<n>`` checkpoints, oldest first (``[]`` when none), under their real names
    (``step_000300`` stays ``step_000300``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), child.name) for child in root.iterdir() if (m := _STEP_DIR.match(child.name))]
    return [root / name for _, name in sorted(found) if is_checkpoint(root / name)]


def latest_checkpoint(root: PathLike) -> Optional[Path]:
    """``root/step_<n>`` with the largest ``n`` among complete checkpoints, or ``None`` (this process's view).

    Example:
        latest_checkpoint("ckpt")
        # -> PosixPath('ckpt/step_300')
    """
    dirs = checkpoint_dirs(root)
    return dirs[-1] if dirs else None


def prune_checkpoints(root: PathLike, keep_last: int) -> list[Path]:
    """Delete complete ``root/step_<n>`` checkpoints older than the newest ``keep_last``; return what was deleted.

    One process (rank 0). Never touches the newest complete checkpoint, a save in flight, or anything
    not named ``step_<n>``; a symbolic link loses the link only, and a ``step_<n>`` that is not
    verifiably a checkpoint of ours is kept, with a warning naming it and why.

    Example:
        prune_checkpoints("ckpt", keep_last=2)
        # -> [PosixPath('ckpt/step_100')]
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"prune_checkpoints(): keep_last must be a positive int, got {keep_last!r}.")
    deleted = []
    for path in checkpoint_dirs(root)[:-keep_last]:
        try:
            discard_checkpoint_dir(path, "prune_checkpoints()")
            deleted.append(path)
        except CheckpointError as e:  # not ours: kept, and a warning names it and why
            warnings.warn(str(e), stacklevel=2)
    return deleted


def _positive(name: str, value: Optional[int]) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"CheckpointManager(): {name} must be a positive int or None, got {value!r}.")
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal values, tensors compared by value (``==`` on them is elementwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def gather_rank_states(state: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{name: [rank 0's state_dict(), rank 1's, ...]}``: every rank's own state (a per-rank stream
    position differs by rank), gathered on every rank (one all-gather of small objects)."""
    mine = {name: obj.state_dict() for name, obj in state.items()}
    everyone = [mine]
    if is_distributed() and get_world_size() > 1:
        everyone = [None] * get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
    return {name: [ranks[name] for ranks in everyone] for name in mine}


def restore_rank_states(state: Mapping[str, Any], saved: Mapping[str, list[Any]], path: Path) -> None:
    """Give each rank its own saved state. At another world size only a state every rank saved alike (a
    ``ResumableLoader``, an LR scheduler) can be restored; a per-rank one raises (on every rank, before any load)."""
    rank, world = get_rank(), get_world_size()
    uneven = [
        name for name in state if len(saved[name]) != world and not all(_same(saved[name][0], s) for s in saved[name])
    ]
    if uneven:
        raise CheckpointError(
            f"CheckpointManager.resume(): {path} holds a different state per rank for {uneven}, saved by "
            f"{len(saved[uneven[0]])} ranks; this job has {world}. A per-rank state cannot be resharded: resume at "
            f"{len(saved[uneven[0]])} ranks, or make that state the same on every rank (e.g. ResumableLoader)."
        )
    for name, obj in state.items():
        obj.load_state_dict(saved[name][rank] if len(saved[name]) == world else saved[name][0])


class CheckpointManager:
    """Checkpoints of one training run under ``root``: periodic, pruned, resumable, preemption-safe.

    ``after_step(step)`` saves ``root/step_<step>`` every ``every`` steps and once a preemption signal
    (``preemption_signals``; ``()`` for none) arrived, then returns ``True``: stop the loop. ``keep_last=K``
    keeps the K newest; ``resume()`` loads the latest and returns its step (0 on first launch). ``state``:
    ``{name: object with state_dict() / load_state_dict()}`` (a ``ResumableLoader``, an LR scheduler) saved
    and restored with them, each rank's own (a per-rank state resumes only at the world size that saved it;
    one every rank saved alike resumes at any). Every rank (docs/long_jobs.md).

    Example:
        manager = CheckpointManager("ckpt", model, optimizer, every=100, keep_last=3,
                                    async_save=True, state={"data": loader})
        step = manager.resume()  # 0 on first launch
        while step < total_steps:
            train_step(next(batches)); step += 1
            if manager.after_step(step):
                break  # preempted: saved, stop cleanly
        manager.close()
    """

    def __init__(
        self,
        root: PathLike,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        every: Optional[int] = None,
        keep_last: Optional[int] = None,
        async_save: bool = False,
        preemption_signals: Iterable[SignalLike] = ("SIGTERM",),
        state: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.root = Path(root)
        self.model, self.optimizer = model, optimizer
        self.every = _positive("every", every)
        self.keep_last = _positive("keep_last", keep_last)
        self.state = dict(state or {})
        for name, obj in self.state.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(
                    f"CheckpointManager(): state[{name!r}] ({type(obj).__name__}) needs state_dict() and load_state_dict()."
                )
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"CheckpointManager(): root {self.root} is a file, not a directory.")
        signals = list(preemption_signals)
        self.preemption = PreemptionHandler(signals) if signals else None
        self.checkpointer = AsyncCheckpointer() if async_save else None
        self.extra: Any = None  # the user's ``extra`` of the checkpoint resume() loaded
        self._saved_step: Optional[int] = None

    def latest(self) -> Optional[Path]:
        """The latest complete checkpoint under ``root`` (rank 0's view, the same on every rank), or ``None``.

        Example:
            manager.latest()
            # -> PosixPath('ckpt/step_300')
        """
        return from_rank0(lambda: latest_checkpoint(self.root))

    def resume(self) -> int:
        """Load the latest complete checkpoint (model, optimizer, ``state``); return its step, or 0 if none.

        Partial directories left by interrupted saves are removed first. The user's ``extra`` of
        that checkpoint is in ``manager.extra``.

        Example:
            start = manager.resume()
        """
        checkpoint_on_all_ranks(self._remove_stale if get_rank() == 0 else lambda: None)
        path = self.latest()
        if path is None:
            return 0
        saved = load_checkpoint(path, self.model, self.optimizer)
        if not isinstance(saved, dict) or "step" not in saved:
            raise CheckpointError(f"CheckpointManager.resume(): {path} was not saved by a CheckpointManager.")
        missing = [name for name in self.state if name not in saved.get("state", {})]
        if missing:
            raise CheckpointError(f"CheckpointManager.resume(): {path} holds no state for {missing}.")
        if "rank_state" in saved:
            restore_rank_states(self.state, saved["rank_state"], path)
        else:  # saved before per-rank states: rank 0's
            for name, obj in self.state.items():
                obj.load_state_dict(saved["state"][name])
        self.extra = saved.get("extra")
        self._saved_step = int(saved["step"])
        return int(saved["step"])

    def after_step(self, step: int, extra: Any = None) -> bool:
        """Call at every step boundary; saves when due or preempted. ``True``: a preemption signal came, stop now.

        Example:
            if manager.after_step(step, extra={"loss": loss.item()}):
                break
        """
        preempted = self.preemption is not None and self.preemption.stop_requested()
        due = self.every is not None and step % self.every == 0
        if (due or preempted) and self._saved_step != step:
            self.save(step, extra)
        if preempted:
            self.wait()  # the process is about to end: the checkpoint must be complete
        return preempted

    def save(self, step: int, extra: Any = None) -> Path:
        """Save ``root/step_<step>`` now (in the background with ``async_save``), then prune to ``keep_last``.

        A model with a NaN/inf parameter on any rank is refused (``CheckpointError`` on every rank, one
        small all-reduce): nothing is written and nothing pruned, so the last finite checkpoints stay.

        Example:
            manager.save(step)
            # -> PosixPath('ckpt/step_120')
        """
        self._refuse_nonfinite(step)
        path = self.root / f"step_{int(step)}"
        ranks = gather_rank_states(self.state)  # each rank's own; "state" keeps rank 0's (older readers)
        record = {"step": int(step), "state": {n: s[0] for n, s in ranks.items()}, "rank_state": ranks, "extra": extra}
        self.wait()  # a background save still in flight completes (and is pruned) first
        save = save_checkpoint if self.checkpointer is None else self.checkpointer.save
        save(path, self.model, self.optimizer, extra=record, overwrite=True)
        if self.checkpointer is None:
            self._prune()
        self._saved_step = int(step)
        return path

    def _refuse_nonfinite(self, step: int) -> None:
        """Raise ``CheckpointError`` on every rank, before anything is written or pruned, when a model
        parameter holds a NaN/inf on any rank: a diverged model must never replace good checkpoints."""
        named = list(self.model.named_parameters())
        bad = first_nonfinite([p for _, p in named])
        if bad < len(named):
            raise CheckpointError(
                f"CheckpointManager.save(): refused to save step {int(step)}: parameter {named[bad][0]!r} holds "
                f"NaN/inf (the model diverged). The checkpoints under {self.root} are kept as they are; resume "
                "from the latest with manager.resume(), and skip non-finite steps with "
                "zeta_fsdp.training.NonFiniteGuard."
            )

    def wait(self) -> None:
        """Wait for a background save to be complete (and prune). Every rank.

        Example:
            manager.wait()
        """
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self._prune()

    def close(self) -> None:
        """Wait for the save in flight, restore the signal handlers, release the groups. Every rank.

        Example:
            manager.close()
        """
        try:
            if self.checkpointer is not None:
                self.wait()
                self.checkpointer.close()
        finally:
            if self.preemption is not None:
                self.preemption.close()

    def _prune(self) -> None:
        """Rank 0 deletes complete checkpoints older than the newest ``keep_last`` (the in-flight one is hidden)."""
        if self.keep_last is not None:
            keep = self.keep_last
            checkpoint_on_all_ranks(lambda: prune_checkpoints(self.root, keep) if get_rank() == 0 else None)

    def _remove_stale(self) -> None:
        for child in self.root.iterdir() if self.root.is_dir() else ():
            if not _STALE.match(child.name):
                continue
            # A save in flight (another job on this root) holds the lock of its step: leave it.
            lock = PathLock(child.parent / child.name[1 : -len(".incomplete")])
            with contextlib.suppress(OSError):  # a read-only root, or a file we cannot remove: left as it is
                if lock.acquire(timeout_s=0):
                    with lock:
                        discard_staging(lock.path)  # DCP's files only: a user's file in it is kept

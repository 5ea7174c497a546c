"""Preemption: a signal (SIGTERM by default) asks the training loop to save and stop at the next step boundary."""

from __future__ import annotations

import signal
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

from ..distributed import get_world_size, is_distributed

SignalLike = Union[int, signal.Signals, str]


def resolve_signals(signals: Iterable[SignalLike]) -> list[signal.Signals]:
    """``["SIGTERM", signal.SIGUSR1, 10]`` -> signal members; a bad entry raises naming it and what is accepted."""
    out = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.upper()
                out.append(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
            else:
                out.append(signal.Signals(item))
        except (KeyError, ValueError):
            accepted = ", ".join(s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2))
            raise ValueError(
                f"preemption signals: {item!r} is not a signal; give names or numbers such as {accepted}."
            ) from None
    if signal.SIGKILL in out:
        raise ValueError("preemption signals: SIGKILL cannot be caught; use SIGTERM (what schedulers send first).")
    return out


class PreemptionHandler:
    """Turn a signal into a request to stop: the loop checks ``stop_requested()`` at each step boundary.

    The handler only records the signal (a collective may be half done inside a signal handler);
    ``stop_requested()`` agrees across ranks (one tiny all-reduce), so every rank stops at the same
    step even when the signal reached only one. ``close()`` puts the previous handlers back. Every rank.

    Example:
        preemption = PreemptionHandler(["SIGTERM", "SIGUSR1"])
        for step in range(start, steps):
            train_step()
            if preemption.stop_requested():
                save_checkpoint(f"ckpt/step_{step + 1}", model, optimizer)
                break
        preemption.close()
    """

    def __init__(self, signals: Iterable[SignalLike] = (signal.SIGTERM,)) -> None:
        self.signals = resolve_signals(signals)
        self.received: Optional[signal.Signals] = None
        self._group = dist.new_group(backend="gloo") if is_distributed() and get_world_size() > 1 else None
        self._previous = {sig: signal.signal(sig, self._record) for sig in self.signals}

    def _record(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum)

    def stop_requested(self) -> bool:
        """``True`` on every rank once any rank received one of the signals. Call on every rank, each step.

        Example:
            if preemption.stop_requested():
                break
        """
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def close(self) -> None:
        """Restore the handlers that were installed before (every rank).

        Example:
            preemption.close()
        """
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._group is not None and is_distributed():
            dist.destroy_process_group(self._group)
        self._group = None

"""``EpochStep``: the step counter ``FSDP2Strategy.current_epoch_step`` returns (an int that knows its epoch)."""

from __future__ import annotations

__all__ = ["EpochStep"]


class EpochStep(int):
    """``strategy.current_epoch_step``: the number of optimizer steps taken, which also knows its epoch.

    It is the step number wherever an int is (``step >= 4``, ``step + 1``, ``int(step)``, NeMo's
    int), and unpacks / indexes as ``(epoch, step)``.

    Example:
        >>> s = EpochStep(epoch=1, step=250)
        >>> s + 1, s.epoch, s.step, tuple(s)
        (251, 1, 250, (1, 250))
    """

    epoch: int

    def __new__(cls, epoch: int = 0, step: int = 0) -> EpochStep:
        obj = super().__new__(cls, int(step))
        obj.epoch = int(epoch)
        return obj

    @property
    def step(self) -> int:
        """The step number as a plain int.

        Example:
            >>> EpochStep(0, 7).step
            7
        """
        return int(self)

    def __iter__(self):
        return iter((self.epoch, int(self)))

    def __getitem__(self, index: int) -> int:
        return (self.epoch, int(self))[index]

    def __eq__(self, other: object) -> bool:
        return (self.epoch, int(self)) == other if isinstance(other, tuple) else int(self) == other

    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f"EpochStep(epoch={self.epoch}, step={int(self)})"

    def __reduce__(self):
        return (EpochStep, (self.epoch, int(self)))

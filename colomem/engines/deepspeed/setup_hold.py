"""What a DeepSpeed engine's set-up takes on for the whole process and nothing gives back (a replaced
function, a default process group), held for the live trainers and given back by the last one to close.

A trainer builds its engine through `setup()`, which says whether the caller now holds the thing and must
`release()` it when it closes; a set-up that fails gives back what it took. What was there before the first
set-up (someone else's) is never taken.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


class SetupHold:
    """A count of the live trainers that hold what their set-ups took; subclasses say what the state before a
    set-up is (`_snapshot`), whether a set-up took the thing (`_took`) and how it is given back (`_give_back`)."""

    def __init__(self) -> None:
        self._holders = 0

    def _snapshot(self) -> Any:
        raise NotImplementedError

    def _took(self, before: Any) -> bool:
        """Whether the set-up that began in state `before` left the caller holding the thing (a live trainer's
        set-up may have taken it already: then it is held once more)."""
        raise NotImplementedError

    def _give_back(self) -> None:
        raise NotImplementedError

    def setup(self, build: Callable[[], T], before: Any = None) -> tuple[T, bool]:
        """(build(), whether the caller holds the thing now and must release() it). before: the state before
        the caller's set-up began, when that was earlier than build(); None: now."""
        before = self._snapshot() if before is None else before
        try:
            out = build()
        except BaseException:
            if self._hold(before):
                self.release()
            raise
        return out, self._hold(before)

    def _hold(self, before: Any) -> bool:
        if not self._took(before):
            return False
        self._holders += 1
        return True

    def release(self) -> None:
        """One holder fewer; the last gives the thing back."""
        if self._holders == 0:
            return
        self._holders -= 1
        if self._holders == 0:
            self._give_back()

    @property
    def holders(self) -> int:
        return self._holders


__all__ = ["SetupHold"]

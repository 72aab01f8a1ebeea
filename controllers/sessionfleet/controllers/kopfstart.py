"""Kopf's start, made linear in the number of watched objects.

Kopf runs no event handler until every index holds its initial list. It tracks that
with one toggle per listed object in a set that is "on" when all of them are dropped
(``ToggleSet(all)``), and each object's worker waits for the set to turn on. Kopf
1.45 wakes every waiter whenever a toggle is added or dropped: a start with N
objects wakes N waiters N times. A restarted operator with 20,000 AgentSessions was
not ready after four minutes, all of it in ``ToggleSet.make_toggle``.

The waiters only ask whether the set as a whole is on or off, so waking them when
that answer changes is enough: ``install`` makes kopf build its toggle sets from
``ChangeOnlyToggleSet``, which does exactly that. Single toggles (peering's pause)
still wake their waiters on every turn, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sessionfleet.controllers.kopfcompat import aiotoggles

log = logging.getLogger(__name__)


class ChangeOnlyToggleSet(aiotoggles.ToggleSet):
    """A kopf toggle set that wakes its waiters only when its own state flips."""

    async def make_toggle(
        self, __val: bool = False, *, name: str | None = None
    ) -> aiotoggles.Toggle:
        """Add a toggle; waiters wake only if it flips the set."""
        toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
        async with self._condition:
            was_on = self.is_on()
            self._toggles.add(toggle)
            self._notify_if_flipped(was_on)
        return toggle

    async def drop_toggle(self, toggle: aiotoggles.Toggle) -> None:
        """Drop a toggle; waiters wake only if that flips the set."""
        async with self._condition:
            was_on = self.is_on()
            self._toggles.discard(toggle)
            self._notify_if_flipped(was_on)

    async def drop_toggles(self, toggles: Iterable[aiotoggles.Toggle]) -> None:
        """Drop toggles; waiters wake only if that flips the set."""
        async with self._condition:
            was_on = self.is_on()
            self._toggles.difference_update(toggles)
            self._notify_if_flipped(was_on)

    def _notify_if_flipped(self, was_on: bool) -> None:
        if self.is_on() != was_on:
            self._condition.notify_all()


def install() -> bool:
    """Make kopf's toggle sets change-only; False (and kopf as it is) if its internals moved.

    Kopf creates its sets as ``aiotoggles.ToggleSet(...)`` when the operator starts,
    so this must run before ``kopf.operator``.
    """
    current = aiotoggles.ToggleSet
    if current is ChangeOnlyToggleSet:
        return True
    probe = current(all)
    if current is not ChangeOnlyToggleSet.__mro__[1] or not (
        hasattr(probe, "_condition") and isinstance(getattr(probe, "_toggles", None), set)
    ):
        log.warning("kopf's ToggleSet is not the one this fix knows: its start stays as it is")
        return False
    aiotoggles.ToggleSet = ChangeOnlyToggleSet  # type: ignore[misc]
    return True

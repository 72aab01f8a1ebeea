"""Kopf's start with many objects: the index-readiness toggle set wakes its waiters once."""

from __future__ import annotations

import asyncio

import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._core.reactor import orchestration

from sessionfleet.controllers import kopfstart
from sessionfleet.controllers.kopfstart import ChangeOnlyToggleSet

OBJECTS = 600


def counting(base: type[aiotoggles.ToggleSet]) -> type[aiotoggles.ToggleSet]:
    """The set, counting how often anyone asks for its state (each wake-up asks once)."""

    class Counting(base):  # type: ignore[valid-type,misc]
        asks = 0

        def is_on(self) -> bool:
            type(self).asks += 1
            return super().is_on()

    return Counting


async def kopf_like_start(toggles: aiotoggles.ToggleSet, objects: int) -> None:
    """What kopf does at start: a toggle per listed object, whose worker drops it and
    waits for every index to be filled; the watcher's own toggle goes last."""
    listing = await toggles.make_toggle(name="kind")

    async def worker(toggle: aiotoggles.Toggle) -> None:
        await toggles.drop_toggle(toggle)
        await toggles.wait_for(True)

    workers = []
    for index in range(objects):
        toggle = await toggles.make_toggle(name=str(index))
        workers.append(asyncio.create_task(worker(toggle)))
        await asyncio.sleep(0)
    assert toggles.is_off()
    await toggles.drop_toggle(listing)
    await asyncio.wait_for(asyncio.gather(*workers), timeout=30)


async def test_a_start_asks_the_state_a_number_of_times_linear_in_the_objects() -> None:
    change_only = counting(ChangeOnlyToggleSet)
    await kopf_like_start(change_only(all), OBJECTS)
    assert change_only.asks <= 8 * OBJECTS


async def test_kopfs_own_set_asks_quadratically_which_is_why_this_exists() -> None:
    # When this fails, kopf wakes its waiters sparingly itself and kopfstart can go.
    kopfs = counting(aiotoggles.ToggleSet)
    await kopf_like_start(kopfs(all), OBJECTS)
    assert kopfs.asks > OBJECTS * OBJECTS / 8


@pytest.mark.parametrize("fn", [all, any])
async def test_waiters_see_every_flip_of_the_whole_set(fn: object) -> None:
    toggles = ChangeOnlyToggleSet(fn)  # type: ignore[arg-type]
    first = await toggles.make_toggle(fn is any)
    second = await toggles.make_toggle(fn is any)
    on_by_default = toggles.is_on()
    waiter = asyncio.create_task(toggles.wait_for(not on_by_default))
    await asyncio.sleep(0)
    await toggles.drop_toggle(first)
    await asyncio.sleep(0)
    assert not waiter.done()  # the other toggle still holds the set where it was
    await toggles.drop_toggles([second])
    await asyncio.wait_for(waiter, timeout=1)
    assert toggles.is_on() is (fn is all)


async def test_a_single_toggle_still_wakes_the_sets_waiters() -> None:
    toggles = ChangeOnlyToggleSet(any)
    peer = await toggles.make_toggle(False)
    waiter = asyncio.create_task(toggles.wait_for(True))
    await asyncio.sleep(0)
    await peer.turn_to(True)
    await asyncio.wait_for(waiter, timeout=1)


def test_install_makes_kopf_build_change_only_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiotoggles, "ToggleSet", aiotoggles.ToggleSet)
    assert kopfstart.install()
    assert kopfstart.install()  # twice is once
    assert orchestration.aiotoggles.ToggleSet is ChangeOnlyToggleSet


def test_install_leaves_a_toggle_set_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    class Other(aiotoggles.ToggleSet):
        pass

    monkeypatch.setattr(aiotoggles, "ToggleSet", Other)
    assert not kopfstart.install()
    assert aiotoggles.ToggleSet is Other

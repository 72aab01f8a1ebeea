"""The router freezes its start-up heap out of the garbage collector's walks.

A full collection walks every tracked object; the router's start-up heap (its modules
and their objects) made each one a 35-42 ms stall of the event loop under load
(bench/README.md, "Router: the tail"). After start the router freezes that heap once.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref
from collections.abc import Iterator

import pytest
from router_fakes import FakeKube

from sessionfleet.router.collector import YOUNG_COLLECTION_THRESHOLD, freeze_startup_heap
from sessionfleet.router.server import RouterSettings, serve


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Start and end with nothing frozen and the default thresholds: the process's own."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_objects_alive_at_the_freeze_leave_the_collected_generations(unfrozen: None) -> None:
    kept = [[n] for n in range(1000)]  # lists: always tracked by the collector
    assert any(obj is kept[0] for obj in gc.get_objects())
    frozen = freeze_startup_heap()
    assert frozen >= len(kept)
    assert frozen == gc.get_freeze_count()
    # gc.get_objects() lists what collections walk; the frozen heap is not in it.
    assert not any(obj is kept[0] for obj in gc.get_objects())


def test_cyclic_garbage_made_before_the_freeze_is_collected_not_frozen(unfrozen: None) -> None:
    class Node:
        pass

    node = Node()
    node.self = node  # type: ignore[attr-defined]
    alive = weakref.ref(node)
    del node
    freeze_startup_heap()
    assert alive() is None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_serving_router_has_frozen_its_start_up_heap_and_collects_less_often(
    unfrozen: None,
) -> None:
    assert gc.get_freeze_count() == 0
    port = _free_port()
    settings = RouterSettings(namespace="default", replica="gc", flush_tick=3600)
    serving = asyncio.create_task(serve(FakeKube(), settings, "127.0.0.1", port))  # type: ignore[arg-type]
    try:
        for _ in range(200):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            break
        else:
            pytest.fail("the router did not listen")
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD
    finally:
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving

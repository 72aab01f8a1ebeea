"""The supervisor of background tasks: the first unexpected end is recorded and awaited."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from sessionfleet.supervise import EXIT_TASK_FAILED, Failure, Supervisor


async def forever() -> None:
    await asyncio.Event().wait()


async def dies(message: str = "boom", after: float = 0.0) -> None:
    await asyncio.sleep(after)
    raise RuntimeError(message)


async def returns() -> str:
    return "done"


async def test_a_task_that_raises_is_the_failure(caplog: pytest.LogCaptureFixture) -> None:
    async with Supervisor() as supervisor:
        supervisor.start("sampling", forever())
        supervisor.start("capability", dies())
        failure = await asyncio.wait_for(supervisor.wait(), 5)
        assert failure == Failure("capability", "died: RuntimeError: boom")
        assert str(failure) == "background task capability died: RuntimeError: boom"
        assert supervisor.failure == failure and not supervisor.healthy
        assert supervisor.failed.is_set()
        assert supervisor.names == ["sampling"]
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == str(failure)
    assert record.exc_info is not None and "boom" in str(record.exc_info[1])
    assert EXIT_TASK_FAILED != 0


async def test_a_loop_that_returns_has_failed_too() -> None:
    async with Supervisor() as supervisor:
        supervisor.start("pod-names", returns())
        failure = await asyncio.wait_for(supervisor.wait(), 5)
    assert failure == Failure("pod-names", "returned, but should run until the process stops")


async def test_a_one_shot_task_may_return_but_not_raise() -> None:
    async with Supervisor() as supervisor:
        done = supervisor.start("warm-up", returns(), forever=False)
        assert await done == "done"
        await asyncio.sleep(0)
        assert supervisor.healthy and supervisor.failure is None
        supervisor.start("load", dies(), forever=False)
        failure = await asyncio.wait_for(supervisor.wait(), 5)
    assert failure is not None and failure.task == "load"


async def test_a_task_cancelled_by_someone_else_has_failed() -> None:
    async with Supervisor() as supervisor:
        task = supervisor.start("watch", forever())
        await asyncio.sleep(0)
        task.cancel()
        failure = await asyncio.wait_for(supervisor.wait(), 5)
    assert failure == Failure("watch", "was cancelled")


async def test_the_first_failure_wins_and_later_ones_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with Supervisor() as supervisor:
        supervisor.start("first", dies("one"))
        supervisor.start("second", dies("two", after=0.01))
        await asyncio.wait_for(supervisor.wait(), 5)
        await asyncio.sleep(0.05)
        assert supervisor.failure is not None and supervisor.failure.task == "first"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "background task first died: RuntimeError: one",
        "background task second died: RuntimeError: two",
    ]


async def test_wait_returns_none_when_stopped_and_stopping_is_no_failure() -> None:
    stop = asyncio.Event()
    supervisor = Supervisor()
    tasks = [supervisor.start(name, forever()) for name in ("a", "b")]
    asyncio.get_running_loop().call_later(0.01, stop.set)
    assert await asyncio.wait_for(supervisor.wait(stop), 5) is None
    assert supervisor.names == ["a", "b"]
    await supervisor.stop()
    assert all(task.cancelled() for task in tasks)
    assert supervisor.healthy and supervisor.names == []


async def test_wait_returns_a_failure_that_came_before_it() -> None:
    async with Supervisor() as supervisor:
        supervisor.start("early", dies())
        await asyncio.sleep(0.01)
        stop = asyncio.Event()
        stop.set()
        assert (await supervisor.wait(stop)) == Failure("early", "died: RuntimeError: boom")


async def test_no_task_is_started_once_stopping() -> None:
    supervisor = Supervisor()
    await supervisor.stop()
    coroutine = forever()
    with pytest.raises(RuntimeError, match="cannot start late: the supervisor is stopping"):
        supervisor.start("late", coroutine)
    assert coroutine.cr_frame is None, "closed, so Python does not warn it was never awaited"


async def test_asyncio_is_not_left_with_unretrieved_exceptions() -> None:
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        async with Supervisor() as supervisor:
            supervisor.start("dies", dies())
            await supervisor.wait()
        del supervisor
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert reported == []

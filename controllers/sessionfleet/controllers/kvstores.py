"""The vLLM workers' KV stores: finished sessions' blocks removed, the store's health read.

Every interval the leader asks one Ready engine of each store (the workers of one model
in one namespace share a store: ``resources.kvstore.store_root``) to keep the blocks of
the sessions that are live and forget the rest. The request is level-triggered: it names
the live sessions, so a finish or a deletion the operator missed (a restart, a lost
watch event) is cleaned up all the same, and a session too new to be in the operator's
index is protected by the store's grace. Blocks a live session still uses (a shared
system prompt, a parent's context) stay. The answer carries the store's health, which
becomes each worker's ``KVStore`` condition (docs/kvstore.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Final

from sessionfleet.api import CheckpointDriver, KVStoreType, SessionPhase, WorkerPhase
from sessionfleet.checkpoint import CheckpointTarget, DriverError, KVStoreControl
from sessionfleet.controllers.checkpoints import target_for
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.records import WorkerRecord
from sessionfleet.resources.kvstore import kv_store_of, store_root

log = logging.getLogger(__name__)

_ENDED: Final = frozenset({SessionPhase.FINISHED, SessionPhase.LOST})


def stores(fleet: Fleet) -> dict[str, list[WorkerRecord]]:
    """Return the Ready vLLM workers with sessionfleet's store, by the store's root."""
    grouped: dict[str, list[WorkerRecord]] = defaultdict(list)
    for record in fleet.indexes.all_workers():
        worker = record.worker
        if (
            worker is not None
            and record.status.phase in (WorkerPhase.READY, WorkerPhase.DRAINING)
            and kv_store_of(worker) is KVStoreType.SESSIONFLEET
        ):
            grouped[store_root(worker)].append(record)
    return grouped


def live_sessions(fleet: Fleet, namespace: str, model: str) -> list[str]:
    """Return the names of the sessions of a model in a namespace that may have another turn."""
    return sorted(
        s.name
        for s in fleet.sessions.all_sessions()
        if s.namespace == namespace
        and s.model == model
        and not s.finished
        and s.phase not in _ENDED
    )


async def retain_once(fleet: Fleet, driver: KVStoreControl) -> dict[str, str | None]:
    """Tell every store its live sessions; return each worker's store health by name."""
    health: dict[str, str | None] = {}
    for records in stores(fleet).values():
        record = records[0]
        worker = record.worker
        assert worker is not None
        target: CheckpointTarget | None = target_for(record, worker, "", ())
        if target is None:
            continue
        live = live_sessions(fleet, record.namespace, worker.spec.model)
        try:
            answer = await driver.store_control(
                target,
                {"op": "retain", "sessions": live, "grace": fleet.config.kv_store_grace_seconds},
            )
        except DriverError as error:
            log.debug("KV store of %s: %s", record.key, error)
            continue
        problem = answer.get("health")
        for member in records:
            health[f"{member.namespace}/{member.name}"] = str(problem) if problem else None
    return health


async def kv_stores_forever(fleet: Fleet) -> None:
    """Run :func:`retain_once` on the interval while this replica leads."""
    await fleet.indexed.wait()
    await fleet.leadership.acquired.wait()
    driver: object = fleet.checkpointing.drivers.get(CheckpointDriver.ENGINE)
    if not isinstance(driver, KVStoreControl):
        return
    while True:
        await asyncio.sleep(fleet.config.kv_store_interval_seconds)
        # A store that did not answer this time keeps its last health, not none.
        fleet.engines.kv_store_health.update(await retain_once(fleet, driver))

"""Placement's view of the workers, kept between placements, always equals one built anew."""

from __future__ import annotations

import random
from typing import Any

from sessionfleet.api import SessionPhase
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.engines import EngineStats
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.records import WorkerRecord, worker_record
from sessionfleet.policy.placement import RANK
from sessionfleet.policy.sessions import SessionState

NAMESPACES = ("a", "b")


def worker(namespace: str, name: str, **change: Any) -> WorkerRecord:
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"},
        "spec": {
            "model": change.get("model", "m"),
            "engine": {"type": "sim"},
            "gpus": 1,
            "capacity": {"maxSessions": change.get("max_sessions", 10)},
            "drain": change.get("drain", False),
        },
        "status": {"phase": change.get("phase", "Ready"), "epoch": 1, "pod": f"{name}-1"},
    }
    return worker_record(body)


def fleet_with(*records: WorkerRecord) -> Fleet:
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    fleet.indexes.workers = {}  # type: ignore[assignment]
    for record in records:
        put_worker(fleet, record)
    return fleet


def put_worker(fleet: Fleet, record: WorkerRecord) -> None:
    fleet.indexes.workers[record.key] = [record]  # type: ignore[index]
    fleet.sessions.placement.worker_seen(record.key, record)  # what the worker's event does


def built_anew(fleet: Fleet, namespace: str) -> list[Any]:
    stats = fleet.engines.stats
    loads = [fleet.sessions._load(r, namespace, stats) for r in fleet.indexes.all_workers()]
    return sorted((load for load in loads if load is not None), key=lambda w: w.name)


def test_only_the_workers_that_changed_are_looked_at_again() -> None:
    fleet = fleet_with(worker("a", "w1"), worker("a", "w2"))
    first = fleet.loads("a")
    w1, w2 = sorted(first, key=lambda w: w.name)
    fleet.sessions.ledger.add(("a", "s"), "w1", 0)
    second = fleet.loads("a")
    assert second is first  # the same view, updated in place
    assert {w.name: w.pinned_sessions for w in second} == {"w1": 1, "w2": 0}
    assert any(w is w2 for w in second) and not any(w is w1 for w in second)


def test_a_worker_that_is_no_longer_ready_drops_its_namespaces_view() -> None:
    fleet = fleet_with(worker("a", "w1"), worker("b", "w1"))
    in_a, in_b = fleet.loads("a"), fleet.loads("b")
    put_worker(fleet, worker("a", "w1", drain=True))
    assert [w.ready for w in fleet.loads("a")] == [False]
    assert fleet.loads("a") is not in_a and fleet.loads("b") is in_b


def test_the_kept_view_equals_one_built_anew_through_any_changes() -> None:
    rng = random.Random(7)
    names = [f"w{i}" for i in range(6)]
    fleet = fleet_with(*(worker(ns, n) for ns in NAMESPACES for n in names))
    sessions: dict[tuple[str, str], SessionState] = {}
    for step in range(3000):
        namespace, name = rng.choice(NAMESPACES), rng.choice(names)
        key = (namespace, f"s{rng.randrange(40)}")
        action = rng.randrange(7)
        if action == 0:  # a binding written
            fleet.sessions.ledger.add(key, name, rng.randrange(1000))
        elif action == 1:  # the watch shows it, or the session moves or ends
            state = SessionState(
                namespace,
                key[1],
                "id",
                "m",
                worker=name,
                phase=rng.choice([SessionPhase.BOUND, SessionPhase.FINISHED]),
                prompt_tokens=rng.randrange(5000),
                turns=1,
            )
            sessions[key] = state
            fleet.sessions.ledger.observe(key, name)
            fleet.sessions.worker_loads.update(state)
        elif action == 2:
            fleet.sessions.ledger.settle(key)
            fleet.sessions.worker_loads.remove(key)
        elif action == 3:  # an engine scrape
            fleet.engines.stats[(namespace, name)] = EngineStats(kv_usage=rng.random())
            fleet.sessions.placement.touched.add((namespace, name))
        elif action == 4:  # the worker changes, or goes and comes back
            change = rng.choice([{"drain": True}, {"phase": "Recovering"}, {"max_sessions": 5}, {}])
            if rng.random() < 0.1:
                fleet.indexes.workers.pop((namespace, name), None)  # type: ignore[union-attr]
                fleet.sessions.placement.worker_seen((namespace, name), None)
            else:
                put_worker(fleet, worker(namespace, name, **change))
        elif action == 5 and step % 50 == 0:  # the full pass
            fleet.sessions.placement.drop()
        view = fleet.loads(namespace)
        assert view == sorted(view, key=RANK), f"step {step}: not in rank order"
        kept = sorted(view, key=lambda w: w.name)
        assert kept == built_anew(fleet, namespace), f"step {step}"

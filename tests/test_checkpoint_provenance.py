"""Provenance of the operator's WorkerCheckpoints: signed on the object, checked by any replica.

A new leader must run the checkpoints an earlier leader created but never started (a
drain's among them), and still refuse a user's checkpoint with a reserved reason, even
one carrying an annotation copied from a genuine checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sessionfleet.api import CheckpointDriver, CheckpointReason
from sessionfleet.api.labels import PROVENANCE_ANNOTATION
from sessionfleet.checkpoint import CheckpointOutcome, CheckpointTarget
from sessionfleet.controllers.checkpoints import reconcile_checkpoints
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.provenance import CheckpointKeyUnusable, checkpoint_key
from sessionfleet.controllers.records import checkpoint_record, worker_record
from sessionfleet.kube import Conflict, NotFound, Resource
from sessionfleet.policy.checkpoint import CheckpointState
from sessionfleet.policy.provenance import CheckpointIdentity, provenance_problem, sign
from sessionfleet.resources.checkpoints import (
    build_checkpoint_key_secret,
    checkpoint_key_of,
)

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
KEY = b"k" * 32
OTHER_KEY = b"o" * 32

DRAIN = CheckpointIdentity("ns", "w-drain-1-20261204120000", "w", CheckpointReason.DRAIN)
GENUINE = sign(KEY, DRAIN, NOW)


@pytest.mark.parametrize(
    ("identity", "annotation", "created_at", "says"),
    [
        pytest.param(DRAIN, GENUINE, NOW + timedelta(seconds=1), None, id="genuine"),
        pytest.param(
            dataclasses.replace(DRAIN, name="mine"),
            GENUINE,
            NOW,
            "does not match",
            id="copied onto another name",
        ),
        pytest.param(
            dataclasses.replace(DRAIN, namespace="other"),
            GENUINE,
            NOW,
            "does not match",
            id="copied into another namespace",
        ),
        pytest.param(
            dataclasses.replace(DRAIN, destination="/data/ns/elsewhere"),
            GENUINE,
            NOW,
            "does not match",
            id="tampered destination",
        ),
        pytest.param(
            dataclasses.replace(DRAIN, worker="victim"),
            GENUINE,
            NOW,
            "does not match",
            id="tampered worker",
        ),
        pytest.param(
            dataclasses.replace(DRAIN, sessions=("s1",)),
            GENUINE,
            NOW,
            "does not match",
            id="tampered sessions",
        ),
        pytest.param(
            dataclasses.replace(DRAIN, driver=CheckpointDriver.CRIU),
            GENUINE,
            NOW,
            "does not match",
            id="tampered driver",
        ),
        pytest.param(
            DRAIN,
            GENUINE.replace(f".{int(NOW.timestamp())}.", f".{int(NOW.timestamp()) + 3600}."),
            NOW + timedelta(hours=1),
            "does not match",
            id="tampered signing time",
        ),
        pytest.param(DRAIN, None, NOW, "no provenance annotation", id="missing"),
        pytest.param(DRAIN, "", NOW, "no provenance annotation", id="empty"),
        pytest.param(DRAIN, "v1.x.y", NOW, "malformed", id="malformed"),
        pytest.param(DRAIN, "v0" + GENUINE[2:], NOW, "malformed", id="unknown version"),
        pytest.param(
            DRAIN, sign(OTHER_KEY, DRAIN, NOW), NOW, "does not match", id="signed with a wrong key"
        ),
        pytest.param(
            DRAIN, GENUINE, NOW + timedelta(hours=2), "not when the object", id="replayed later"
        ),
        pytest.param(DRAIN, GENUINE, None, "not when the object", id="no creationTimestamp"),
    ],
)
def test_provenance_is_accepted_only_as_signed(
    identity: CheckpointIdentity,
    annotation: str | None,
    created_at: datetime | None,
    says: str | None,
) -> None:
    problem = provenance_problem(KEY, identity, annotation, created_at)
    if says is None:
        assert problem is None
    else:
        assert problem is not None and says in problem


def test_the_key_secret_round_trips_and_a_short_key_is_refused() -> None:
    secret = build_checkpoint_key_secret("key", "ops", KEY)
    assert secret["immutable"] is True
    assert checkpoint_key_of(secret) == KEY
    assert checkpoint_key_of(build_checkpoint_key_secret("key", "ops", b"short")) is None
    assert checkpoint_key_of({"data": {"key": "not base64!"}}) is None
    assert checkpoint_key_of({}) is None


class FakeKube:
    def __init__(self) -> None:
        self.statuses: dict[str, list[dict[str, Any]]] = {}

    async def patch(
        self, resource: Resource, name: str, body: dict[str, Any], *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        self.statuses.setdefault(name, []).append(body["status"])
        return {"metadata": {"resourceVersion": "7"}}


class FakeDriver:
    name = CheckpointDriver.ENGINE

    async def save(self, target: CheckpointTarget) -> CheckpointOutcome:
        return CheckpointOutcome(target.location, 0.5, 1024, {})


def checkpoint(name: str, reason: CheckpointReason, annotation: str | None) -> CheckpointState:
    """Parse a WorkerCheckpoint body as the index would hold it."""
    state = checkpoint_record(
        {
            "apiVersion": "sessionfleet.dev/v1alpha1",
            "kind": "WorkerCheckpoint",
            "metadata": {
                "name": name,
                "namespace": "ns",
                "creationTimestamp": "2026-12-04T12:00:01Z",
                "annotations": {PROVENANCE_ANNOTATION: annotation} if annotation else {},
            },
            "spec": {"worker": "w", "reason": reason.value},
        }
    )
    assert state is not None
    return state


def new_leader(checkpoints: list[CheckpointState]) -> tuple[Fleet, FakeKube]:
    """A replica that created none of ``checkpoints`` and now leads, with the shared key."""
    kube = FakeKube()
    fleet = Fleet(config=OperatorConfig(), kube=kube, http=None)  # type: ignore[arg-type]
    fleet.checkpointing.key = KEY
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": "w", "namespace": "ns", "uid": "u1"},
        "spec": {"model": "m", "engine": {"type": "sim"}, "checkpoint": {"driver": "engine"}},
        "status": {"phase": "Draining", "epoch": 1, "pod": "w-1", "endpoint": "http://x:8000"},
    }
    fleet.indexes.workers = {("ns", "w"): [worker_record(body)]}  # type: ignore[assignment]
    fleet.indexes.checkpoints = {("ns", "w"): checkpoints}  # type: ignore[assignment]
    fleet.checkpointing.drivers = {CheckpointDriver.ENGINE: FakeDriver()}  # type: ignore[dict-item]
    return fleet, kube


async def reconcile(fleet: Fleet) -> None:
    record = fleet.indexes.worker("ns", "w")
    assert record is not None and record.worker is not None
    await reconcile_checkpoints(fleet, record, record.worker, NOW + timedelta(seconds=5))
    await asyncio.gather(*fleet.spawner.tasks)


def outcome(status: dict[str, Any]) -> tuple[str, str]:
    reasons = [c["reason"] for c in status.get("conditions", ())]
    return status["phase"], reasons[-1] if reasons else ""


async def test_a_new_leader_runs_the_drain_checkpoint_its_predecessor_created() -> None:
    drain = checkpoint(DRAIN.name, CheckpointReason.DRAIN, GENUINE)
    fleet, kube = new_leader([drain])
    await reconcile(fleet)
    phases = [status["phase"] for status in kube.statuses[DRAIN.name]]
    assert phases == ["Running", "Succeeded"]


async def test_a_copied_annotation_does_not_make_a_users_drain_checkpoint_run() -> None:
    genuine = checkpoint(DRAIN.name, CheckpointReason.DRAIN, GENUINE)
    copied = checkpoint("mine", CheckpointReason.DRAIN, GENUINE)
    unsigned = checkpoint("plain", CheckpointReason.PERIODIC, None)
    fleet, kube = new_leader([genuine, copied, unsigned])
    await reconcile(fleet)
    assert [s["phase"] for s in kube.statuses[DRAIN.name]] == ["Running", "Succeeded"]
    for name, says in (("mine", "does not match"), ("plain", "no provenance")):
        (refusal,) = kube.statuses[name]
        assert outcome(refusal) == ("Failed", "ReservedCheckpointReason")
        assert says in refusal["error"]


async def test_an_earlier_leaders_per_session_drain_checkpoint_is_closed_not_refused() -> None:
    identity = dataclasses.replace(DRAIN, name="w-drain-s", sessions=("s1",))
    state = dataclasses.replace(
        checkpoint(identity.name, CheckpointReason.DRAIN, None),
        sessions=("s1",),
        provenance=sign(KEY, identity, NOW),
    )
    fleet, kube = new_leader([state])
    await reconcile(fleet)
    (closed,) = kube.statuses[identity.name]
    assert outcome(closed) == ("Failed", "CheckpointFailed")
    assert "started again" in closed["error"]


def test_the_key_secret_flag_takes_namespace_and_name() -> None:
    from sessionfleet.cli import build_parser

    args = build_parser().parse_args(["operator", "--checkpoint-key-secret=ops/sf-key"])
    assert args.checkpoint_key_secret == ("ops", "sf-key")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--checkpoint-key-secret=no-slash"])


class SecretKube:
    """The Secrets API as the key needs it: a get, and a create that may lose a race."""

    def __init__(self, stored: dict[str, Any] | None, race: dict[str, Any] | None = None) -> None:
        self.stored = stored
        self.race = race
        self.created: list[dict[str, Any]] = []

    async def get(self, resource: Resource, name: str, namespace: str) -> dict[str, Any]:
        if self.stored is None:
            raise NotFound(404, f"secrets {name} not found")
        return self.stored

    async def create(
        self, resource: Resource, body: dict[str, Any], namespace: str
    ) -> dict[str, Any]:
        if self.race is not None:  # another replica created it first
            self.stored = self.race
            raise Conflict(409, "already exists")
        self.created.append(body)
        self.stored = body
        return body


def keyed_fleet(kube: SecretKube) -> Fleet:
    config = OperatorConfig(checkpoint_key_secret=("ops", "sf-key"))
    return Fleet(config=config, kube=kube, http=None)  # type: ignore[arg-type]


async def test_the_first_leader_creates_the_key_and_the_next_reads_the_same() -> None:
    kube = SecretKube(None)
    first = await checkpoint_key(keyed_fleet(kube))
    (created,) = kube.created
    assert created["metadata"] == {
        "name": "sf-key",
        "namespace": "ops",
        "labels": {"app.kubernetes.io/managed-by": "sessionfleet"},
    }
    assert len(first) == 32
    assert await checkpoint_key(keyed_fleet(kube)) == first
    assert len(kube.created) == 1


async def test_a_replica_that_loses_the_race_to_create_the_key_uses_the_winners() -> None:
    winner = build_checkpoint_key_secret("sf-key", "ops", OTHER_KEY)
    kube = SecretKube(None, race=winner)
    assert await checkpoint_key(keyed_fleet(kube)) == OTHER_KEY
    assert kube.created == []


async def test_a_secret_without_a_usable_key_is_an_error_that_says_what_to_do() -> None:
    kube = SecretKube({"data": {"key": ""}})
    with pytest.raises(CheckpointKeyUnusable, match="delete it and the operator creates one"):
        await checkpoint_key(keyed_fleet(kube))

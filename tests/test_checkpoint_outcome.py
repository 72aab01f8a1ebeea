"""How a checkpoint's run ends up in its status: phase, error and the Checkpointed condition."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from sessionfleet.api import CheckpointDriver, CheckpointReason
from sessionfleet.checkpoint import (
    CheckpointOutcome,
    CheckpointTarget,
    DriverError,
    DriverUnavailable,
)
from sessionfleet.controllers.checkpoints import save
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.records import worker_record
from sessionfleet.kube import Resource
from sessionfleet.policy.checkpoint import CheckpointState

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class FakeKube:
    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []

    async def patch(
        self, resource: Resource, name: str, body: dict[str, Any], *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        self.statuses.append(body["status"])
        return {"metadata": {"resourceVersion": "7"}}


class FakeDriver:
    name = CheckpointDriver.ENGINE

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    async def save(self, target: CheckpointTarget) -> CheckpointOutcome:
        if self.error is not None:
            raise self.error
        return CheckpointOutcome(target.location, 0.5, 1024, {"s1": 3000})


def fleet_with(driver: FakeDriver | None, worker: bool = True) -> tuple[Fleet, FakeKube]:
    kube = FakeKube()
    fleet = Fleet(config=OperatorConfig(), kube=kube, http=None)  # type: ignore[arg-type]
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": "w", "namespace": "ns"},
        "spec": {"model": "m", "engine": {"type": "sim"}},
        "status": {"phase": "Ready", "epoch": 1, "pod": "w-1", "endpoint": "http://127.0.0.9:8000"},
    }
    fleet.indexes.workers = {("ns", "w"): [worker_record(body)]} if worker else {}  # type: ignore[assignment]
    if driver is not None:
        fleet.checkpointing.drivers = {CheckpointDriver.ENGINE: driver}  # type: ignore[dict-item]
    return fleet, kube


CHECKPOINT = CheckpointState("ns", "w-manual", "w", CheckpointReason.MANUAL)


def checkpointed(status: dict[str, Any]) -> tuple[str, str, str]:
    (condition,) = status["conditions"]
    assert condition["type"] == "Checkpointed"
    return condition["status"], condition["reason"], condition["message"]


@pytest.mark.parametrize(
    ("driver", "worker", "reason", "says"),
    [
        (FakeDriver(), False, "CheckpointFailed", "worker w not found"),
        (None, True, "DriverUnsupported", "driver engine cannot checkpoint here"),
        (
            FakeDriver(DriverUnavailable("CUDA driver 550 lacks the checkpoint API")),
            True,
            "DriverUnsupported",
            "lacks the checkpoint API",
        ),
        (FakeDriver(DriverError("store unreachable")), True, "CheckpointFailed", "unreachable"),
    ],
)
async def test_a_failed_checkpoint_says_why_in_its_condition(
    driver: FakeDriver | None, worker: bool, reason: str, says: str
) -> None:
    fleet, kube = fleet_with(driver, worker)
    assert await save(fleet, CHECKPOINT, NOW) is None
    final = kube.statuses[-1]
    assert final["phase"] == "Failed" and says in final["error"]
    assert checkpointed(final) == ("False", reason, final["error"])


async def test_a_written_checkpoint_is_checkpointed() -> None:
    fleet, kube = fleet_with(FakeDriver())
    outcome = await save(fleet, CHECKPOINT, NOW)
    assert outcome is not None
    final = kube.statuses[-1]
    assert final["phase"] == "Succeeded"
    assert checkpointed(final) == ("True", "CheckpointSucceeded", "3000 tokens of 1 session(s)")

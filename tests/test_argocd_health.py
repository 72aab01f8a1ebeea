"""The Argo CD health checks, run in Lua 5.1 against sample objects.

Argo CD runs health scripts in gopher-lua, which implements Lua 5.1, with the object
as the global ``obj``; the script returns ``{status=..., message=...}``. ``lupa``
(from PyPI) embeds the reference Lua 5.1 interpreter, so these tests run the very
files shipped in ``deploy/argocd/health/`` in the dialect Argo CD speaks, with no
system package to install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

REPO = Path(__file__).resolve().parent.parent
HEALTH = REPO / "deploy" / "argocd" / "health"
KINDS = {
    "InferenceWorker": "inferenceworker",
    "AgentSession": "agentsession",
    "DrainPolicy": "drainpolicy",
    "WorkerCheckpoint": "workercheckpoint",
}
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def health(kind: str, obj: dict[str, Any]) -> tuple[str, str]:
    """Run the kind's script as Argo CD does; return (status, message)."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    script = (HEALTH / f"{KINDS[kind]}.lua").read_text()
    result = lua.execute(script)
    assert result is not None, "the script must return its health table"
    return str(result["status"]), str(result["message"])


def cond(kind: str, status: str, reason: str, message: str = "") -> dict[str, str]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-11-29T12:00:00Z",
    }


def worker(status: dict[str, Any] | None, generation: int = 1, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": "w", "generation": generation},
        "spec": {"model": "Qwen/Qwen3-32B", "engine": {"type": "vllm"}, "gpus": 1, **spec},
    }
    if status is not None:
        body["status"] = status
    return body


@pytest.mark.parametrize(
    ("obj", "expected", "says"),
    [
        (worker(None), "Progressing", "Waiting for the operator"),
        (worker({"phase": "Pending", "observedGeneration": 1}), "Progressing", "Pending"),
        (
            worker(
                {
                    "phase": "Starting",
                    "observedGeneration": 1,
                    "conditions": [cond("Ready", "False", "PodStarting", "engine loading")],
                }
            ),
            "Progressing",
            "PodStarting: engine loading",
        ),
        (
            worker({"phase": "Ready", "epoch": 3, "observedGeneration": 1}),
            "Healthy",
            "Serving Qwen/Qwen3-32B (epoch 3)",
        ),
        (
            worker({"phase": "Ready", "epoch": 1, "observedGeneration": 1}, generation=2),
            "Progressing",
            "generation 2",
        ),
        (
            worker(
                {
                    "phase": "Draining",
                    "observedGeneration": 1,
                    "conditions": [cond("Draining", "True", "SessionsPinned", "3 pinned")],
                }
            ),
            "Progressing",
            "SessionsPinned: 3 pinned",
        ),
        (
            worker({"phase": "Drained", "observedGeneration": 1}, drain=True),
            "Suspended",
            "spec.drain",
        ),
        (worker({"phase": "Drained", "observedGeneration": 1}), "Progressing", "Draining"),
        (
            worker(
                {
                    "phase": "Recovering",
                    "observedGeneration": 1,
                    "conditions": [cond("Recovering", "True", "PodFailed", "exit 137")],
                }
            ),
            "Progressing",
            "PodFailed",
        ),
        (
            worker(
                {
                    "phase": "Failed",
                    "observedGeneration": 1,
                    "conditions": [cond("Ready", "False", "PodFailed", "no GPU")],
                }
            ),
            "Degraded",
            "PodFailed: no GPU",
        ),
        (
            worker(
                {
                    "phase": "Pending",
                    "observedGeneration": 1,
                    "conditions": [cond("Valid", "False", "InvalidSpec", "spec.gpus: bad")],
                }
            ),
            "Degraded",
            "InvalidSpec: spec.gpus: bad",
        ),
        (
            worker(
                {
                    "phase": "Ready",
                    "observedGeneration": 1,
                    "conditions": [cond("Conflict", "True", "PolicyConflict", "a, b")],
                }
            ),
            "Degraded",
            "PolicyConflict",
        ),
        (worker({"phase": "Hibernating"}), "Unknown", "Hibernating"),
    ],
)
def test_inference_worker(obj: dict[str, Any], expected: str, says: str) -> None:
    status, message = health("InferenceWorker", obj)
    assert status == expected, message
    assert says in message


def session(status: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {"name": "s", "generation": 1},
        "spec": {"sessionId": "abc", "model": "m"},
    }
    if status is not None:
        body["status"] = status
    return body


@pytest.mark.parametrize(
    ("obj", "expected", "says"),
    [
        (session(None), "Progressing", "bind"),
        (
            session(
                {
                    "phase": "Pending",
                    "conditions": [cond("Ready", "False", "NoReadyWorker", "none serve m")],
                }
            ),
            "Progressing",
            "NoReadyWorker: none serve m",
        ),
        (session({"phase": "Bound", "worker": "w1"}), "Healthy", "Bound to worker w1"),
        (session({"phase": "Migrating", "worker": "w1"}), "Progressing", "Migrating"),
        (session({"phase": "Restoring", "worker": "w1"}), "Progressing", "Restoring"),
        (
            session(
                {"phase": "Finished", "conditions": [cond("Ready", "False", "FinishedByClient")]}
            ),
            "Healthy",
            "FinishedByClient",
        ),
        (
            session(
                {"phase": "Lost", "conditions": [cond("Ready", "False", "WorkerDeleted", "gone")]}
            ),
            "Degraded",
            "WorkerDeleted: gone",
        ),
    ],
)
def test_agent_session(obj: dict[str, Any], expected: str, says: str) -> None:
    status, message = health("AgentSession", obj)
    assert status == expected, message
    assert says in message


def policy(status: dict[str, Any] | None, generation: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "DrainPolicy",
        "metadata": {"name": "p", "generation": generation},
        "spec": {"mode": "Wait", "deadline": "13m"},
    }
    if status is not None:
        body["status"] = status
    return body


@pytest.mark.parametrize(
    ("obj", "expected", "says"),
    [
        (policy(None), "Healthy", "Mode Wait, deadline 13m"),
        (
            policy({"observedGeneration": 2, "matchedWorkers": 4, "activeDrains": 1}, 2),
            "Healthy",
            "Selects 4 worker(s), 1 draining",
        ),
        (policy({"observedGeneration": 1}, 2), "Progressing", "generation 2"),
        (
            policy({"conditions": [cond("Valid", "False", "InvalidSpec", "spec.deadline")]}),
            "Degraded",
            "InvalidSpec: spec.deadline",
        ),
        (
            policy({"conditions": [cond("Conflict", "True", "PolicyConflict", "also q")]}),
            "Degraded",
            "PolicyConflict: also q",
        ),
    ],
)
def test_drain_policy(obj: dict[str, Any], expected: str, says: str) -> None:
    status, message = health("DrainPolicy", obj)
    assert status == expected, message
    assert says in message


def test_drain_policy_health_reads_the_status_the_operator_writes() -> None:
    # The statuses come from the operator's own code, so the script and the writer agree
    # on every field: matchedWorkers, activeDrains, observedGeneration, Valid, Conflict.
    from datetime import UTC, datetime

    from sessionfleet.api import DrainPolicySpec
    from sessionfleet.controllers.policies import desired_status
    from sessionfleet.controllers.records import PolicyRecord
    from sessionfleet.policy.policies import WorkerView, plan_policy_statuses

    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    pool_a = DrainPolicySpec.model_validate({"selector": {"matchLabels": {"pool": "a"}}})
    plans = plan_policy_statuses(
        {"p": pool_a, "all": DrainPolicySpec()},
        [
            WorkerView("w1", {"pool": "b"}, reference="p"),
            WorkerView("w2", {"pool": "b"}, reference="p", draining=True),
            WorkerView("wa", {"pool": "a"}),
            WorkerView("wx", {}, reference="broken"),
        ],
        {"broken": "spec: gracePeriod must not be longer than deadline"},
    )

    def written(name: str) -> dict[str, Any]:
        record = PolicyRecord(name, None, namespace="ns", generation=1)
        status = desired_status(record, plans[name], now)
        return policy({k: v for k, v in status.items() if v is not None})

    assert health("DrainPolicy", written("p")) == (
        "Degraded",
        "PolicyConflict: DrainPolicy all also selects worker(s) wa: they drain under the "
        "built-in default until their spec.drainPolicyRef names one policy or the selectors "
        "are narrowed",
    )
    status, message = health("DrainPolicy", written("broken"))
    assert status == "Degraded"
    assert message.startswith("InvalidSpec: spec: gracePeriod must not be longer than deadline")
    plans["p"] = plan_policy_statuses({"p": pool_a}, [WorkerView("w", {}, "p", draining=True)])["p"]
    assert health("DrainPolicy", written("p")) == ("Healthy", "Selects 1 worker(s), 1 draining")


def checkpoint(status: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "WorkerCheckpoint",
        "metadata": {"name": "c", "generation": 1},
        "spec": {"worker": "w1", "reason": "Manual"},
    }
    if status is not None:
        body["status"] = status
    return body


@pytest.mark.parametrize(
    ("obj", "expected", "says"),
    [
        (checkpoint(None), "Progressing", "worker w1 to start"),
        (checkpoint({"phase": "Pending"}), "Progressing", "to start"),
        (checkpoint({"phase": "Running"}), "Progressing", "Writing"),
        (
            checkpoint({"phase": "Succeeded", "sizeBytes": 3800000000}),
            "Healthy",
            "3800000000 bytes",
        ),
        (checkpoint({"phase": "Failed", "error": "store unreachable"}), "Degraded", "unreachable"),
    ],
)
def test_worker_checkpoint(obj: dict[str, Any], expected: str, says: str) -> None:
    status, message = health("WorkerCheckpoint", obj)
    assert status == expected, message
    assert says in message


def test_every_kind_has_a_script_and_statuses_are_argo_ones() -> None:
    assert {p.stem for p in HEALTH.glob("*.lua")} == set(KINDS.values())
    for path in HEALTH.glob("*.lua"):
        text = path.read_text()
        assert text.rstrip().endswith("return hs"), path.name
        for word in ("Healthy", "Progressing", "Degraded"):
            assert f'"{word}"' in text, f"{path.name} never says {word}"
    used: set[str] = set()
    for path in HEALTH.glob("*.lua"):
        used |= {
            token.strip('"')
            for token in path.read_text().split()
            if token.startswith('"') and token.strip('"') in ARGO_STATUSES
        }
    assert used <= ARGO_STATUSES


def test_scripts_stay_lua_5_1() -> None:
    # gopher-lua has no integer division, goto or bitwise operators (Lua 5.3/5.2).
    for path in HEALTH.glob("*.lua"):
        text = path.read_text()
        for newer in ("//", "goto ", "::", " & ", " | ", "<<", ">>"):
            assert newer not in text, f"{path.name}: {newer!r} is not Lua 5.1"


def test_argocd_configmap_carries_the_scripts_verbatim() -> None:
    config = yaml.safe_load((REPO / "deploy" / "argocd" / "argocd-cm-health.yaml").read_text())
    assert config["kind"] == "ConfigMap" and config["metadata"]["name"] == "argocd-cm"
    expected = {
        f"resource.customizations.health.sessionfleet.dev_{kind}": (
            HEALTH / f"{stem}.lua"
        ).read_text()
        for kind, stem in KINDS.items()
    }
    assert config["data"] == expected

"""DrainPolicy status, written by the operator as a real process against the real control plane.

A policy lists the workers it governs (``status.workers``, ``status.matchedWorkers``, which
``kubectl get drainpolicies`` shows in its Workers column), says when another policy
selects the same worker (``Conflict``), and a policy whose spec the operator cannot parse
is reported as invalid — on itself (``Valid=False``) and on the workers that reference it
(``PolicyInvalid``), never as a policy that does not exist.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from e2e.helpers import Kubectl, wait_until
from e2e.localcluster import LocalCluster
from e2e.operator import (
    Custom,
    OperatorProcess,
    condition,
    drain_policy,
    sim_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)


def printed(kubectl: Kubectl, namespace: str, name: str) -> dict[str, str]:
    """The row of ``kubectl get drainpolicies`` for one policy, by column header."""
    lines = kubectl("get", "drainpolicies", f"--namespace={namespace}").stdout.splitlines()
    header = lines[0].split()
    rows = [dict(zip(header, line.split(), strict=True)) for line in lines[1:]]
    return next(row for row in rows if row["NAME"] == name)


def governs(crs: Custom, policy: str, workers: list[str]) -> bool:
    """Whether the policy's status, for its current generation, lists exactly ``workers``."""
    body = crs.get("drainpolicies", policy)
    status = body.get("status") or {}
    return (
        status.get("observedGeneration") == body["metadata"]["generation"]
        and status.get("matchedWorkers") == len(workers)
        and (status.get("workers") or []) == workers
    )


def test_a_drain_policy_lists_the_workers_it_governs(
    operator: OperatorProcess, crs: Custom, kubectl: Kubectl, namespace: str
) -> None:
    crs.create(sim_worker("wa", labels={"pool": "a"}))
    crs.create(sim_worker("wb", labels={"pool": "b"}))
    crs.create(drain_policy("pool-a", selector={"matchLabels": {"pool": "a"}}, mode="Wait"))
    wait_for(
        operator,
        lambda: governs(crs, "pool-a", ["wa"]),
        timeout=30,
        what="DrainPolicy pool-a listing wa",
    )
    status = crs.status("drainpolicies", "pool-a")
    assert condition(status, "Valid")["status"] == "True"
    assert condition(status, "Conflict") == {}
    assert status["activeDrains"] == 0
    wait_until(
        lambda: printed(kubectl, namespace, "pool-a")["WORKERS"] == "1",
        timeout=10,
        what="the Workers column of pool-a",
    )
    assert printed(kubectl, namespace, "pool-a")["MODE"] == "Wait"

    # A second policy selecting every worker: wb is its own, wa is selected by both and
    # drains under neither (the built-in default) until its drainPolicyRef says which.
    crs.create(drain_policy("everything"))
    wait_for(
        operator,
        lambda: governs(crs, "everything", ["wb"]) and governs(crs, "pool-a", []),
        timeout=30,
        what="wa counted by neither policy",
    )
    for name, other in (("pool-a", "everything"), ("everything", "pool-a")):
        conflict = condition(crs.status("drainpolicies", name), "Conflict")
        assert (conflict["status"], conflict["reason"]) == ("True", "PolicyConflict")
        assert f"DrainPolicy {other} also selects worker(s) wa:" in conflict["message"]
    assert printed(kubectl, namespace, "pool-a")["WORKERS"] == "0"

    crs.patch("inferenceworkers", "wa", {"spec": {"drainPolicyRef": "pool-a"}})
    wait_for(
        operator,
        lambda: (
            governs(crs, "pool-a", ["wa"])
            and condition(crs.status("drainpolicies", "pool-a"), "Conflict") == {}
            and condition(crs.status("drainpolicies", "everything"), "Conflict") == {}
        ),
        timeout=30,
        what="the reference settling the overlap",
    )
    assert governs(crs, "everything", ["wb"])
    assert {
        name: printed(kubectl, namespace, name)["WORKERS"] for name in ("pool-a", "everything")
    } == {
        "pool-a": "1",
        "everything": "1",
    }


# --- an invalid DrainPolicy ---------------------------------------------------------------
# The API server refuses every spec the operator's models refuse (schema bounds and CEL
# rules), so a policy the operator cannot parse exists only when it was stored before a
# rule existed, or under an older CRD. The test stores one that way: it rewrites the
# object in etcd, under the API server, leaving the shared cluster's CRDs alone.


def _etcd(cluster: LocalCluster) -> str:
    ports = cluster.state.ports if cluster.state is not None else {}
    if "etcd_client" not in ports:
        pytest.skip("needs the harness's own etcd (a cluster started by e2e.localcluster)")
    return f"http://127.0.0.1:{ports['etcd_client']}"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def store_spec_under_the_api_server(
    cluster: LocalCluster, namespace: str, name: str, spec: dict[str, Any]
) -> None:
    """Merge ``spec`` into a stored DrainPolicy in etcd, as if written before a CEL rule."""
    etcd = _etcd(cluster)
    key = _b64(f"/registry/sessionfleet.dev/drainpolicies/{namespace}/{name}")

    def rewrite() -> bool:
        (kv,) = httpx.post(f"{etcd}/v3/kv/range", json={"key": key}, timeout=5).json()["kvs"]
        stored = json.loads(base64.b64decode(kv["value"]))
        stored["spec"].update(spec)
        # Only if nothing wrote the object meanwhile (the operator writes its status).
        answer = httpx.post(
            f"{etcd}/v3/kv/txn",
            json={
                "compare": [
                    {
                        "key": key,
                        "target": "MOD",
                        "result": "EQUAL",
                        "mod_revision": kv["mod_revision"],
                    }
                ],
                "success": [{"request_put": {"key": key, "value": _b64(json.dumps(stored))}}],
            },
            timeout=5,
        ).json()
        return answer.get("succeeded") is True

    wait_until(rewrite, timeout=15, what=f"DrainPolicy {name} rewritten in etcd")


def test_an_invalid_drain_policy_is_reported_as_invalid_not_missing(
    operator: OperatorProcess, crs: Custom, cluster: LocalCluster, namespace: str
) -> None:
    crs.create(drain_policy("broken", gracePeriod="5m", deadline="10m"))
    store_spec_under_the_api_server(cluster, namespace, "broken", {"gracePeriod": "30m"})
    wait_until(
        lambda: crs.get("drainpolicies", "broken")["spec"]["gracePeriod"] == "30m",
        timeout=15,
        what="the API server serving the rewritten policy",
    )
    crs.create(sim_worker("wx", drainPolicyRef="broken"))

    def worker_says_invalid() -> dict[str, Any] | None:
        conflict = condition(crs.status("inferenceworkers", "wx"), "Conflict")
        return conflict if conflict.get("reason") == "PolicyInvalid" else None

    conflict = wait_for(
        operator, worker_says_invalid, timeout=30, what="wx's Conflict=PolicyInvalid"
    )
    assert conflict["status"] == "True"
    assert conflict["message"].startswith(
        "DrainPolicy broken is invalid: spec: gracePeriod must not be longer than deadline"
    )
    assert "does not exist" not in conflict["message"]

    # The policy says so itself: written through the status subresource, which the API
    # server accepts while the stored spec is unchanged (CRD validation ratcheting).
    def policy_says_invalid() -> dict[str, Any] | None:
        valid = condition(crs.status("drainpolicies", "broken"), "Valid")
        return valid if valid.get("status") == "False" else None

    valid = wait_for(operator, policy_says_invalid, timeout=30, what="broken's Valid=False")
    assert valid["reason"] == "InvalidSpec"
    assert "gracePeriod must not be longer than deadline" in valid["message"]
    assert "worker(s) wx reference it" in valid["message"]
    assert crs.status("drainpolicies", "broken")["matchedWorkers"] == 0

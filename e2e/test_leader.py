"""Leader election against the real API server: one leader, a takeover when it stops
renewing, a fast one when it releases, and writes fenced twice (gate and precondition).

The electors run in this process with short timings; e2e/test_chaos.py kills whole
operator replicas.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from e2e.localcluster import LocalCluster
from sessionfleet.kube import (
    LEASES,
    SESSIONS,
    Conflict,
    Invalid,
    Kube,
    KubeConfig,
    NotFound,
    NotLeading,
)
from sessionfleet.kube.client import HOLD_WRITES_ENV
from sessionfleet.operator.leader import DEFAULT_LEASE_NAME, LeaderElector
from sessionfleet.policy.leadership import ElectionTiming
from sessionfleet.resources.times import rfc3339

pytestmark = pytest.mark.timeout(90)

FAST = ElectionTiming(
    lease_duration=timedelta(seconds=3),
    renew_deadline=timedelta(seconds=2),
    retry_period=timedelta(seconds=0.25),
)


@pytest.fixture
async def kube(cluster: LocalCluster) -> AsyncIterator[Kube]:
    client = Kube(KubeConfig.load(str(cluster.kubeconfig)), timeout=5.0)
    yield client
    await client.aclose()


def elector(kube: Kube, namespace: str, identity: str) -> LeaderElector:
    return LeaderElector(kube, namespace, "election", identity=identity, timing=FAST)


async def wait_for(check: object, timeout: float) -> float:
    """Wait until ``check()`` holds; return the monotonic time it first did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return time.monotonic()
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


async def test_one_of_two_candidates_leads_and_the_other_takes_over_when_it_stops_renewing(
    kube: Kube, namespace: str
) -> None:
    a, b = elector(kube, namespace, "a"), elector(kube, namespace, "b")
    run_a = asyncio.create_task(a.run())
    await wait_for(lambda: a.leading, 10)
    run_b = asyncio.create_task(b.run())
    await asyncio.sleep(FAST.lease_duration.total_seconds() * 1.5)
    assert a.leading and not b.leading and b.holder == "a"

    # The leader freezes: it neither renews nor releases (a SIGSTOP, a lost network).
    run_a.cancel()
    lost = await wait_for(lambda: not a.leading, 10)
    took = await wait_for(lambda: b.leading, 10)
    assert lost < took, "the deposed leader's gate must close before the successor leads"
    lease = await kube.get(LEASES, "election", namespace)
    assert lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] == 1
    run_b.cancel()
    await asyncio.gather(run_a, run_b, return_exceptions=True)


async def test_a_released_lease_is_taken_within_a_retry_period(kube: Kube, namespace: str) -> None:
    a, b = elector(kube, namespace, "a"), elector(kube, namespace, "b")
    run_a = asyncio.create_task(a.run())
    await wait_for(lambda: a.leading, 10)
    run_b = asyncio.create_task(b.run())
    await asyncio.sleep(0.5)
    run_a.cancel()
    await asyncio.gather(run_a, return_exceptions=True)
    released = time.monotonic()
    await a.release()
    assert not a.leading
    took = await wait_for(lambda: b.leading, 5)
    # Well under the lease duration: a rolling update hands over at once.
    assert took - released < FAST.lease_duration.total_seconds()
    run_b.cancel()
    await asyncio.gather(run_b, return_exceptions=True)


async def test_a_release_after_a_renewal_it_never_saw_answered_still_hands_over(
    kube: Kube, namespace: str
) -> None:
    """Cancelled mid-renewal (SIGTERM), the leader's last renewal may have reached the API
    server unseen: the release must not be refused for the version it changed."""
    a = elector(kube, namespace, "a")
    run_a = asyncio.create_task(a.run())
    await wait_for(lambda: a.leading, 10)
    run_a.cancel()
    await asyncio.gather(run_a, return_exceptions=True)
    # The renewal in flight when the task was cancelled, applied by the API server:
    await kube.patch(
        LEASES, "election", {"spec": {"renewTime": rfc3339(time.time(), micros=True)}}, namespace
    )
    await a.release()
    lease = await kube.get(LEASES, "election", namespace)
    assert not lease["spec"].get("holderIdentity"), lease["spec"]
    assert lease["spec"]["leaseDurationSeconds"] == 1


async def test_a_leader_that_cannot_renew_stops_writing_and_says_so(
    cluster: LocalCluster, kube: Kube, namespace: str
) -> None:
    a = elector(kube, namespace, "a")
    run_a = asyncio.create_task(a.run())
    await wait_for(lambda: a.leading, 10)
    # Someone else takes the Lease by force (an admin, or a standby that saw it expire).
    await kube.patch(LEASES, "election", {"spec": {"holderIdentity": "intruder"}}, namespace)
    with pytest.raises(Exception, match="could not renew"):
        await asyncio.wait_for(run_a, 10)
    assert not a.leading


async def test_writes_are_fenced_by_the_gate_and_by_the_resource_version(
    cluster: LocalCluster, kube: Kube, namespace: str, crds_installed: None
) -> None:
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {"name": "s"},
        "spec": {"sessionId": "id-s", "model": "m"},
    }
    created = await kube.create(SESSIONS, body, namespace)
    version = created["metadata"]["resourceVersion"]

    leading = False
    gated = Kube(KubeConfig.load(str(cluster.kubeconfig)), write_gate=lambda: leading)
    try:
        # Refused unsent while the gate is closed; reads still go through.
        with pytest.raises(NotLeading):
            await gated.patch(
                SESSIONS, "s", {"status": {"phase": "Pending"}}, namespace, status=True
            )
        assert (await gated.get(SESSIONS, "s", namespace))["metadata"]["resourceVersion"] == version
        leading = True
        # A write decided from a copy someone has since changed fails instead of winning.
        await kube.patch(SESSIONS, "s", {"metadata": {"labels": {"x": "1"}}}, namespace)
        with pytest.raises(Conflict):
            await gated.patch(
                SESSIONS,
                "s",
                {"status": {"phase": "Pending"}},
                namespace,
                status=True,
                resource_version=version,
            )
        current = await gated.get(SESSIONS, "s", namespace)
        assert "phase" not in (current.get("status") or {})
        written = await gated.patch(
            SESSIONS,
            "s",
            {"status": {"phase": "Pending"}},
            namespace,
            status=True,
            resource_version=current["metadata"]["resourceVersion"],
        )
        assert written["status"]["phase"] == "Pending"
    finally:
        await gated.aclose()


def test_two_operator_replicas_elect_one_and_the_standby_is_ready(
    cluster: LocalCluster, namespace: str, crds_installed: None, tmp_path: Path
) -> None:
    """Covered end to end in e2e/test_chaos.py; here only the probes and the Lease."""
    import httpx

    from e2e.helpers import wait_until
    from e2e.operator import OperatorProcess

    replicas = [
        OperatorProcess(
            cluster.kubeconfig,
            namespace,
            tmp_path / str(i),
            f"--leader-election-namespace={namespace}",
        )
        for i in range(2)
    ]
    for replica in replicas:
        replica.log_path.parent.mkdir(exist_ok=True)
        replica.start()
    try:

        def roles() -> list[str] | None:
            answers = []
            for replica in replicas:
                try:
                    answer = httpx.get(f"http://127.0.0.1:{replica.health_port}/readyz", timeout=2)
                except httpx.HTTPError:
                    return None
                if answer.status_code != 200:
                    return None
                answers.append(answer.json()["role"])
            return sorted(answers)

        try:
            ready = wait_until(roles, timeout=30, what="both replicas ready")
        except AssertionError as error:
            tails = "\n".join(
                f"--- replica {i} ---\n{r.log_tail(20)}" for i, r in enumerate(replicas)
            )
            raise AssertionError(f"{error}\n{tails}") from None
        assert ready == ["leader", "standby"]
    finally:
        for replica in replicas:
            replica.stop()


def audited_writes(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    """The API server's audit events for writes in ``namespace``, in the order received."""
    events = []
    for line in cluster.layout.audit_log.read_text().splitlines():
        event = json.loads(line)
        if (event.get("objectRef") or {}).get("namespace") == namespace:
            events.append(event)
    return sorted(events, key=lambda e: e["requestReceivedTimestamp"])


def test_a_paused_leader_with_writes_past_its_gate_check_lands_none_after_its_successor(
    cluster: LocalCluster, namespace: str, crds_installed: None, crs: Any, tmp_path: Path
) -> None:
    """Fencing (docs/operator.md): the leader is stopped (SIGSTOP) right after the gate
    let its writes through, for longer than the margin; the standby takes over and
    writes; the old leader resumes. The audit log tells the replicas apart by user agent."""
    from e2e.helpers import wait_until
    from e2e.operator import OperatorProcess, sim_worker

    hold = tmp_path / "hold"
    old = OperatorProcess(
        cluster.kubeconfig, namespace, tmp_path / "old", env={HOLD_WRITES_ENV: str(hold)}
    )
    new = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "new")
    config = KubeConfig.load(str(cluster.kubeconfig))

    def holder() -> str:
        async def read() -> str:
            async with Kube(config) as kube:
                lease = await kube.get(LEASES, DEFAULT_LEASE_NAME, namespace)
            return str(lease["spec"].get("holderIdentity") or "")

        try:
            return asyncio.run(read())
        except NotFound:
            return ""

    for replica in (old, new):
        replica.log_path.parent.mkdir(exist_ok=True)
    old.start()
    try:
        old_identity = wait_until(holder, timeout=60, what="the first replica leads")
        old_agent = f"sessionfleet-operator/{old_identity}"
        crs.create(sim_worker("w0"))
        wait_until(
            lambda: any(e["userAgent"] == old_agent for e in audited_writes(cluster, namespace)),
            timeout=60,
            what="the first replica writes (the audit log names it)",
        )
        new.start()
        hold.touch()
        crs.create(sim_worker("w"))  # the leader decides writes: a pod, a status
        wait_until(hold.with_suffix(".held").exists, timeout=30, what="a write held")
        assert old.process is not None
        old.process.send_signal(signal.SIGSTOP)
        try:
            new_identity = wait_until(
                lambda: (h := holder()) not in ("", old_identity) and h,
                timeout=60,
                what="the standby takes over",
            )
            new_agent = f"sessionfleet-operator/{new_identity}"

            def new_leaders_first_write() -> dict[str, Any] | None:
                return next(
                    (
                        e
                        for e in audited_writes(cluster, namespace)
                        if e["userAgent"] == new_agent
                        and e["responseStatus"]["code"] < 300
                        and e["objectRef"]["resource"] != "leases"
                    ),
                    None,
                )

            first = wait_until(new_leaders_first_write, timeout=60, what="the new leader writes")
        finally:
            hold.unlink()
            old.process.send_signal(signal.SIGCONT)
        # The old leader resumes: it finds its Lease gone and exits; what it had let
        # through its gate before the pause has had every chance to be sent.
        old.process.wait(timeout=60)
        time.sleep(1)
        events = audited_writes(cluster, namespace)
        late = [
            (e["verb"], e["objectRef"]["resource"], e["responseStatus"]["code"])
            for e in events
            if e["userAgent"].startswith(old_agent)
            and e["requestReceivedTimestamp"] > first["requestReceivedTimestamp"]
        ]
        assert late == [], f"the old leader's requests reached the API server after {first}"
    finally:
        old.stop()
        new.stop()


async def test_the_preconditions_a_deposed_leader_writes_with_are_refused_by_the_api_server(
    kube: Kube, namespace: str, crds_installed: None
) -> None:
    """What the operator's writes carry (docs/operator.md, "Fencing"), against the real
    API server: a uid in a merge patch of an object (not of its status subresource,
    whose strategy keeps the stored metadata), uid and resourceVersion in DeleteOptions."""
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {"name": "p"},
        "spec": {"sessionId": "id-p", "model": "m"},
    }
    created = await kube.create(SESSIONS, body, namespace)
    uid, version = created["metadata"]["uid"], created["metadata"]["resourceVersion"]
    # As the pods' hold annotations are written: the uid in the patch is a precondition.
    stale = {"metadata": {"uid": "not-" + uid, "annotations": {"hold": "1"}}}
    with pytest.raises(Invalid, match="uid"):
        await kube.patch(SESSIONS, "p", stale, namespace)
    written = await kube.patch(
        SESSIONS, "p", {"metadata": {"uid": uid, "annotations": {"hold": "1"}}}, namespace
    )
    assert written["metadata"]["annotations"] == {"hold": "1"}
    with pytest.raises(Conflict):  # changed since the copy the delete was decided from
        await kube.delete(SESSIONS, "p", namespace, uid=uid, resource_version=version)
    with pytest.raises(Conflict):  # another incarnation of the name
        await kube.delete(SESSIONS, "p", namespace, uid="not-" + uid)
    current = written["metadata"]["resourceVersion"]
    await kube.delete(SESSIONS, "p", namespace, uid=uid, resource_version=current)
    with pytest.raises(NotFound):
        await kube.get(SESSIONS, "p", namespace)

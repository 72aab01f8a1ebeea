"""``helm upgrade`` from the previous chart to this one while sessions run and a drain holds.

The previous chart is the one of the commit before the newest commit that changed
``charts/sessionfleet`` (or ``HEAD``'s when the working tree changes it), read from git
with ``git archive``: the test needs the repository's history (a clone with
``--depth=1`` has none; ``git fetch --unshallow`` gives it) and fails saying so. Set
``SESSIONFLEET_UPGRADE_FROM=<rev>`` to upgrade from another commit's chart.

On a fresh cluster of its own (the CRDs are the chart's here), with the old chart
installed, the real operator leading and a router serving two sessions bound to one
worker whose drain is held by a DrainPolicy's grace period, turns keep running through
``helm upgrade`` to the current chart and through an operator replica handover (the old
leader stops, a standby takes over, as a Deployment's rolling update does). Then: every
turn was answered, every binding is the same, the drain is still held; the objects
stored under the old CRDs read back; the sessions finish and the drain completes.

What is not upgraded here: the operator and router processes run this commit's code on
both sides (the images of the previous commit are not built here); the chart's
Deployments run on KWOK, which runs no container.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client

from e2e.chart import CHART, REPO_ROOT, helm, set_args
from e2e.helpers import wait_established, wait_until
from e2e.localcluster import K8S_VERSION, LocalCluster, gpu_pod_tolerations
from e2e.operator import (
    Custom,
    OperatorProcess,
    condition,
    drain_policy,
    sim_worker,
    start_router,
)

pytestmark = pytest.mark.timeout(300)

CHART_PATH = "charts/sessionfleet"
PART_OF = "app.kubernetes.io/part-of=sessionfleet"
NAMESPACE = "sessionfleet-system"
UPGRADE_FROM_ENV = "SESSIONFLEET_UPGRADE_FROM"


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
    )


def previous_chart_rev() -> str:
    """The commit whose chart this one upgrades from (see the module docstring)."""
    chosen = os.environ.get(UPGRADE_FROM_ENV)
    if not chosen:
        if git("diff", "--quiet", "HEAD", "--", CHART_PATH).returncode != 0:
            chosen = "HEAD"  # the working tree changes the chart: HEAD's is the previous
        else:
            newest = git("log", "-n1", "--format=%H", "--", CHART_PATH).stdout.strip()
            chosen = f"{newest}^" if newest else ""
    resolved = git("rev-parse", "--verify", "--quiet", f"{chosen}^{{commit}}")
    if not chosen or resolved.returncode != 0:
        pytest.fail(
            f"the upgrade test needs the commit of the previous chart ({chosen or 'none'}),"
            " which this clone does not have: a shallow clone has no history"
            " (`git fetch --unshallow`), or set SESSIONFLEET_UPGRADE_FROM=<rev>",
            pytrace=False,
        )
    return resolved.stdout.strip()


def extract_chart(rev: str, into: Path) -> Path:
    """``git archive REV charts/sessionfleet`` unpacked under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "chart.tar"
    with archive.open("wb") as out:
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "archive", rev, CHART_PATH], stdout=out, check=True
        )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / CHART_PATH


def crd_schemas(chart: Path) -> dict[str, Any]:
    """The served versions and schemas of the CRDs a chart renders, by CRD name."""
    rendered = helm("template", "sf", str(chart), f"--kube-version={K8S_VERSION}").stdout
    return {
        doc["metadata"]["name"]: doc["spec"]["versions"]
        for doc in yaml.safe_load_all(rendered)
        if doc and doc["kind"] == "CustomResourceDefinition"
    }


def without_empty_required(schema: Any) -> Any:
    """A schema without ``required: []``, which the API server does not store."""
    if isinstance(schema, dict):
        return {
            key: without_empty_required(value)
            for key, value in schema.items()
            if not (key == "required" and value == [])
        }
    if isinstance(schema, list):
        return [without_empty_required(value) for value in schema]
    return schema


class Turns:
    """Turns through the router in a loop, one thread per session, until stopped."""

    def __init__(self, url: str, session_ids: list[str]) -> None:
        self.url = url
        self.results: list[tuple[float, str, int, str]] = []  # (ended, session, status, worker)
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(sid,)) for sid in session_ids]

    def run(self, session_id: str) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stopping.is_set():
                try:
                    answer = http.post(
                        f"{self.url}/v1/chat/completions",
                        json={
                            "model": "m",
                            "messages": [{"role": "user", "content": "Go on with the refactor."}],
                            "max_tokens": 16,
                        },
                        headers={"X-Session-Id": session_id},
                    )
                    status, worker = (
                        answer.status_code,
                        answer.headers.get("X-Sessionfleet-Worker", ""),
                    )
                except httpx.HTTPError as error:
                    status, worker = 0, type(error).__name__
                self.results.append((time.monotonic(), session_id, status, worker))

    def __enter__(self) -> Turns:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=90)

    def between(self, start: float, end: float) -> list[tuple[float, str, int, str]]:
        return [r for r in self.results if start <= r[0] <= end]


def test_helm_upgrade_with_sessions_mid_turn_and_a_drain_held(
    fresh_cluster: LocalCluster, tmp_path: Path
) -> None:
    rev = previous_chart_rev()
    old_chart = extract_chart(rev, tmp_path / "previous")
    old_crds, new_crds = crd_schemas(old_chart), crd_schemas(CHART)
    changed = sorted(name for name in new_crds if old_crds.get(name) != new_crds[name])
    print(f"\nupgrading from the chart of {rev[:12]}; CRDs whose schema changed: {changed}")

    kubeconfig = fresh_cluster.kubeconfig
    tolerate = {"tolerations": gpu_pod_tolerations()}
    values = {"operator": tolerate, "router": tolerate}
    installed = helm(
        "install", "sf", str(old_chart), f"--namespace={NAMESPACE}", "--create-namespace",
        "--wait", "--timeout=120s", *set_args(values, []), kubeconfig=kubeconfig,
    )  # fmt: skip
    assert "STATUS: deployed" in installed.stdout
    wait_established(fresh_cluster.kubectl, "-l", PART_OF, timeout=30)

    logs = tmp_path / "logs"
    old_leader = OperatorProcess(kubeconfig, NAMESPACE, logs / "old")
    successor = OperatorProcess(kubeconfig, NAMESPACE, logs / "new")
    router = None
    for directory in (logs / "old", logs / "new"):
        directory.mkdir(parents=True)
    with fresh_cluster.api_client() as api:
        crs = Custom(client.CustomObjectsApi(api), NAMESPACE)
        try:
            old_leader.start()
            wait_until(lambda: old_leader.role() == "leader", timeout=60, what="a leader")
            # Each token takes 100 ms: a 16-token turn lasts about 1.5 s, so turns are
            # always in flight. The grace period holds the drain for the whole test.
            crs.create(drain_policy("hold", mode="WaitThenMigrate", gracePeriod="10m",
                                    deadline="20m"))  # fmt: skip
            engine = {"type": "sim", "args": ["--decode-ms-per-token=100"]}
            crs.create(sim_worker("w", engine=engine))
            wait_until(
                lambda: crs.status("inferenceworkers", "w").get("phase") == "Ready",
                timeout=90,
                what=f"worker w Ready\n{old_leader.log_tail()}",
            )
            router_url, router = start_router(kubeconfig, NAMESPACE, "r1", logs)
            ids = ["agent-a", "agent-b"]
            for sid in ids:
                first = httpx.post(
                    f"{router_url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4},
                    headers={"X-Session-Id": sid}, timeout=60,
                )  # fmt: skip
                assert first.status_code == 200, first.text

            def bindings() -> dict[str, tuple[str | None, str | None]]:
                return {
                    s["spec"]["sessionId"]: (
                        (s.get("status") or {}).get("worker"),
                        (s.get("status") or {}).get("phase"),
                    )
                    for s in crs.list("agentsessions")
                }

            wait_until(
                lambda: bindings() == {sid: ("w", "Bound") for sid in ids},
                timeout=30,
                what="both sessions Bound to w",
            )
            before = bindings()
            crs.patch("inferenceworkers", "w", {"spec": {"drain": True}})

            def held() -> bool:
                status = crs.status("inferenceworkers", "w")
                return status.get("phase") == "Draining"

            wait_until(held, timeout=30, what="w's drain held (Draining)")

            with Turns(router_url, ids) as turns:
                time.sleep(3)  # turns in flight before the upgrade starts
                upgrade_started = time.monotonic()
                upgraded = helm(
                    "upgrade", "sf", str(CHART), f"--namespace={NAMESPACE}", "--wait",
                    "--timeout=120s", *set_args(values, []), kubeconfig=kubeconfig,
                )  # fmt: skip
                assert "REVISION: 2" in upgraded.stdout
                # The operator's rolling update: a new replica stands by, the old
                # leader stops (releasing its Lease), the new one takes over.
                successor.start()
                wait_until(lambda: successor.role() == "standby", timeout=60, what="standby")
                handover = time.monotonic()
                old_leader.stop()
                # Until its process has exited the old leader may still be writing: the
                # time without a leader is what follows (the release, the standby's look).
                exited = time.monotonic()
                wait_until(lambda: successor.role() == "leader", timeout=60, what="the new leader")
                leaderless = time.monotonic() - exited
                stopping = exited - handover
                time.sleep(3)  # turns after the handover too
                upgrade_ended = time.monotonic()

            during = turns.between(upgrade_started, upgrade_ended)
            failed = [r for r in turns.results if r[2] != 200 or r[3] != "w"]
            print(
                f"turns answered: {len(turns.results)} in all, {len(during)} during the"
                f" upgrade and handover ({upgrade_ended - upgrade_started:.1f} s);"
                f" failed: {len(failed)}; the old leader's shutdown: {stopping:.1f} s,"
                f" then without a leader: {leaderless:.1f} s;"
                f" bindings before {before}, after {bindings()}"
            )
            assert failed == [], failed[:5]
            assert len(during) >= 2, "no turn ran during the upgrade"
            assert bindings() == before
            assert crs.status("inferenceworkers", "w").get("phase") == "Draining"

            # The CRDs are the current chart's, and what was stored under the old
            # ones reads back (the API server serves stored objects under the new
            # schema: pruning and defaults apply on read, validation on the next write).
            for name, versions in new_crds.items():
                live = yaml.safe_load(
                    fresh_cluster.kubectl("get", "crd", name, "-o", "yaml").stdout
                )
                assert [without_empty_required(v["schema"]) for v in live["spec"]["versions"]] == [
                    without_empty_required(v["schema"]) for v in versions
                ], f"{name}: the CRD's schema is not the current chart's"
                assert live["status"]["storedVersions"] == ["v1alpha1"]
            assert crs.get("drainpolicies", "hold")["spec"]["gracePeriod"] == "10m"
            assert crs.get("inferenceworkers", "w")["spec"]["drain"] is True
            for item in crs.list("agentsessions"):
                crs.patch("agentsessions", item["metadata"]["name"], {"metadata": {
                    "labels": {"e2e.sessionfleet.dev/rewritten": "true"}}})  # fmt: skip

            # The drain completes once the sessions finish.
            for sid in ids:
                final = httpx.post(
                    f"{router_url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "done"}],
                          "max_tokens": 4},
                    headers={"X-Session-Id": sid, "X-Session-Final": "true"}, timeout=60,
                )  # fmt: skip
                assert final.status_code == 200, final.text
            wait_until(
                lambda: crs.status("inferenceworkers", "w").get("phase") == "Drained",
                timeout=60,
                what=f"w Drained\n{successor.log_tail()}",
            )
            assert (
                condition(crs.status("inferenceworkers", "w"), "DrainHeld").get("status") != "True"
            )
        finally:
            if router is not None:
                router.stop()
            successor.stop()
            old_leader.stop()

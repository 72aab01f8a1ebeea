"""What the chart's AgentSession quota costs: create rate with and without a ResourceQuota.

Run against a local control plane (it creates two namespaces and the CRDs):

    .venv/bin/python e2e/localcluster run -- .venv/bin/python bench/router/session_quota.py

Creates ``--sessions`` AgentSessions, ``--concurrency`` at a time, first in a namespace
without a quota, then in one with ``count/agentsessions.sessionfleet.dev``, and prints
the create rate of each and the stored size of one session (what the quota bounds in
etcd). Numbers, not pass/fail: bench/README.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

from sessionfleet.api import AgentSessionSpec
from sessionfleet.kube import SESSIONS, Kube
from sessionfleet.kube.config import KubeConfig
from sessionfleet.resources.sessions import agent_session

ROOT = Path(__file__).resolve().parents[2]


def kubectl(*args: str, stdin: str | None = None) -> str:
    """Run kubectl with the run's kubeconfig; return its output."""
    return subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, check=True
    ).stdout


def quota_status() -> dict[str, object]:
    """Return the bench quota's status as the API server holds it."""
    quota = json.loads(
        kubectl("get", "resourcequota", "agentsessions", "-n", "bench-quota", "-o", "json")
    )
    return dict(quota.get("status") or {})


async def create_all(
    kube: Kube, namespace: str, count: int, concurrency: int, prefix: str = "s"
) -> float:
    """Create ``count`` sessions in ``namespace``; return how many a second."""
    slots = asyncio.Semaphore(concurrency)

    async def one(n: int) -> None:
        spec = AgentSessionSpec(session_id=f"bench-{n}", model="m")
        async with slots:
            await kube.create(
                SESSIONS,
                agent_session(f"{prefix}-{n}", namespace, spec, created_by="bench"),
                namespace,
            )

    started = time.perf_counter()
    await asyncio.gather(*(one(n) for n in range(count)))
    return count / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    kubectl("apply", "-f", str(ROOT / "crds" / "agentsessions.sessionfleet.dev.yaml"))
    kubectl(
        "wait", "--for=condition=Established", "crd/agentsessions.sessionfleet.dev", "--timeout=60s"
    )
    for namespace in ("bench-free", "bench-quota"):
        kubectl("create", "namespace", namespace)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "agentsessions", "namespace": "bench-quota"},
        "spec": {"hard": {"count/agentsessions.sessionfleet.dev": "100000"}},
    }
    kubectl("apply", "-f", "-", stdin=json.dumps(quota))
    async with Kube(KubeConfig.from_kubeconfig(os.environ.get("KUBECONFIG"))) as kube:
        await create_all(kube, "bench-free", 100, args.concurrency, "warm")
        free = await create_all(kube, "bench-free", args.sessions, args.concurrency)
        # Until the quota controller has computed the quota's usage, the API server
        # refuses every create it covers (403 "status unknown for quota").
        waited = 0.0
        while "used" not in quota_status():
            await asyncio.sleep(0.5)
            waited += 0.5
        quota_rate = await create_all(kube, "bench-quota", args.sessions, args.concurrency)
        stored = await kube.get(SESSIONS, "s-0", "bench-quota")
    print(f"the quota refused creates for {waited:.1f} s after it was made")
    print(f"create rate without a quota: {free:.0f}/s; with one: {quota_rate:.0f}/s")
    print(f"quota usage: {quota_status().get('used')}")
    print(f"one new AgentSession as stored (JSON, with managedFields): {len(json.dumps(stored))} B")


if __name__ == "__main__":
    asyncio.run(main())

"""Who may call the node agent, with the real API server deciding (TokenRequest, TokenReview).

The chart is installed with the criu driver and no static token; two real agents run on
loopback for two nodes with a token of the chart's agent ServiceAccount (so they have
exactly its RBAC), and the operator's side requests its tokens with a token of the
chart's operator ServiceAccount. A token requested for one node's agent is refused by
the other's, whose TokenReview is for its own audience.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from e2e.chart import CHART, helm
from e2e.helpers import Kubectl
from e2e.localcluster import LocalCluster
from e2e.operator import SESSIONFLEET, Process, free_port
from e2e.test_chart import can_i, release_name, service_account_kubeconfig
from sessionfleet.api import EngineType
from sessionfleet.checkpoint.agent_tokens import AgentTokens, agent_ssl_context, node_audience
from sessionfleet.checkpoint.driver import CheckpointTarget, DriverUnavailable
from sessionfleet.kube import Kube, KubeConfig
from sessionfleet.operator.drivers.criu import CriuDriver

NODES = ("gpu-a", "gpu-b")


def start_agent(
    node: str, kubeconfig: Path, operator: str, reader: str, tmp_path: Path
) -> tuple[str, Process]:
    """``sessionfleet agent`` for ``node`` on loopback (storage root ``root-<node>``)."""
    port = free_port()
    root = tmp_path / f"root-{node}"
    root.mkdir()
    agent = Process(
        [
            str(SESSIONFLEET),
            "agent",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--node-name={node}",
            f"--kubeconfig={kubeconfig}",
            f"--operator={operator}",
            f"--metrics-reader={reader}",
            f"--storage-root={root}",
            "--criu=criu-absent-on-purpose",
        ],
        tmp_path / f"agent-{node}.log",
    )
    url = f"https://127.0.0.1:{port}"
    agent.wait_http(f"{url}/healthz")
    return url, agent


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_token_for_one_nodes_agent_opens_no_other(
    cluster: LocalCluster,
    kubectl: Kubectl,
    namespace: str,
    crds_installed: None,
    tmp_path: Path,
) -> None:
    release = release_name()
    ns = f"--namespace={namespace}"
    reader = f"system:serviceaccount:{namespace}:reader"
    helm(
        "install",
        release,
        str(CHART),
        ns,
        "--set=crds.enabled=false",
        f"--set=operator.watchNamespaces={{{namespace}}}",
        "--set=agent.enabled=true",
        "--set=agent.criu=true",
        f"--set=agent.metricsReaders={{{reader}}}",
        kubeconfig=cluster.kubeconfig,
    )
    processes: list[Process] = []
    try:
        operator_sa = f"{release}-sessionfleet-operator"
        agent_sa = f"{release}-sessionfleet-agent"
        as_operator = f"system:serviceaccount:{namespace}:{operator_sa}"
        as_agent = f"system:serviceaccount:{namespace}:{agent_sa}"
        kubectl("create", "serviceaccount", "reader", ns)

        # The rules, as the API server reads them: the operator mints tokens of itself
        # only; the agent reviews tokens and can do nothing else.
        token = ("--subresource=token", ns)
        assert can_i(kubectl, as_operator, "create", f"serviceaccounts/{operator_sa}", *token)
        assert not can_i(kubectl, as_operator, "create", f"serviceaccounts/{agent_sa}", *token)
        assert not can_i(kubectl, as_operator, "create", "serviceaccounts/default", *token)
        assert can_i(kubectl, as_agent, "create", "tokenreviews.authentication.k8s.io")
        assert not can_i(kubectl, as_agent, "create", f"serviceaccounts/{agent_sa}", *token)
        assert not can_i(kubectl, as_agent, "get", "secrets", ns)
        assert not can_i(kubectl, as_agent, "list", "pods", ns)

        agent_config = service_account_kubeconfig(
            cluster, namespace, agent_sa, tmp_path / "agent.kubeconfig"
        )
        operator_config = service_account_kubeconfig(
            cluster, namespace, operator_sa, tmp_path / "operator.kubeconfig"
        )
        urls = {}
        for node in NODES:
            urls[node], process = start_agent(node, agent_config, as_operator, reader, tmp_path)
            processes.append(process)
        reader_token = kubectl("create", "token", "reader", ns).stdout.strip()
        reader_for_a = kubectl(
            "create", "token", "reader", ns, f"--audience={node_audience('gpu-a')}"
        ).stdout.strip()
        asyncio.run(
            _exercise(
                operator_config, namespace, operator_sa, urls, reader_token, reader_for_a, tmp_path
            )
        )
    finally:
        for process in processes:
            process.stop()
        helm("uninstall", release, ns, kubeconfig=cluster.kubeconfig, check=False)


async def _exercise(
    operator_config: Path,
    namespace: str,
    operator_sa: str,
    urls: dict[str, str],
    reader_token: str,
    reader_for_a: str,
    tmp_path: Path,
) -> None:
    async with (
        Kube(KubeConfig.load(str(operator_config))) as kube,
        httpx.AsyncClient(verify=agent_ssl_context(None), timeout=30) as http,
    ):
        tokens = AgentTokens(kube, namespace, operator_sa)
        for_a = await tokens.for_node("gpu-a")
        answer = await http.get(f"{urls['gpu-a']}/capability", headers=bearer(for_a))
        assert answer.status_code == 200, answer.text
        assert answer.json()["node"] == "gpu-a"

        # The same token replayed at the other node: its TokenReview is for gpu-b.
        refused = await http.get(f"{urls['gpu-b']}/capability", headers=bearer(for_a))
        assert refused.status_code == 401, refused.text
        assert "not accepted" in refused.json()["error"]
        for_b = await tokens.for_node("gpu-b")
        assert (await http.get(f"{urls['gpu-b']}/capability", headers=bearer(for_b))).is_success

        # Another ServiceAccount's token for gpu-a's audience: valid, but not the operator.
        refused = await http.get(f"{urls['gpu-a']}/capability", headers=bearer(reader_for_a))
        assert refused.status_code == 401 and "may not" in refused.json()["error"]

        # /metrics: the reader's ordinary token, and nothing else of it; nobody without one.
        assert (await http.get(f"{urls['gpu-a']}/metrics")).status_code == 401
        metrics = await http.get(f"{urls['gpu-a']}/metrics", headers=bearer(reader_token))
        assert metrics.status_code == 200 and "sessionfleet_agent_nvml_available" in metrics.text
        assert (
            await http.get(f"{urls['gpu-a']}/capability", headers=bearer(reader_token))
        ).status_code == 401
        assert (await http.get(f"{urls['gpu-a']}/metrics", headers=bearer(for_a))).is_success

        # The operator's driver end to end: TokenRequest, HTTPS, the agent's TokenReview,
        # and the agent's answer (this machine cannot checkpoint).
        async def locate(node: str) -> str:
            return urls[node]

        driver = CriuDriver(http, kube, locate=locate, tokens=tokens)
        target = CheckpointTarget(
            namespace=namespace,
            worker="w",
            epoch=1,
            engine=EngineType.VLLM,
            endpoint="http://127.0.0.1:9",
            location=str(tmp_path / "root-gpu-b" / namespace / "w" / "c1"),
            node="gpu-b",
        )
        with pytest.raises(DriverUnavailable, match="node gpu-b: .*criu is not installed"):
            await driver.load(target)

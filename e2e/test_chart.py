"""The chart against the real control plane: dry runs, installs, and its RBAC for real.

* The rendered chart passes the API server's server-side dry run, in a namespace that
  enforces the "restricted" Pod Security Standard (only the criu agent is flagged).
* The kustomize manifests are what the chart renders, and the API server accepts them.
* On a fresh cluster of its own (the shared one's CRDs belong to every test), the
  chart installs with every CRD Established, upgrades, and uninstalls leaving only the
  CRDs kept by policy; with ``crds.keep=false`` the CRDs go too.
* On the shared cluster (``crds.enabled=false``: those CRDs are shared), the operator
  and the router run outside the cluster with tokens of the chart's ServiceAccounts
  (TokenRequest API): a simulated worker becomes Ready, a session created through the
  router binds, usage is written, the session finishes, a worker drains; and calls
  outside their rules are refused.

KWOK runs no containers: the in-cluster Deployments are checked as objects (and, on
the fresh cluster, reach Ready because KWOK marks their pods Ready), while the real
operator and router processes run here with the ServiceAccounts' credentials.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import secrets
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client

from e2e.chart import CHART, REPO_ROOT, helm, set_args, template_text
from e2e.helpers import CRDS_DIR, Kubectl, wait_established, wait_until
from e2e.localcluster import LocalCluster, gpu_pod_tolerations
from e2e.operator import (
    SESSIONFLEET,
    Custom,
    OperatorProcess,
    condition,
    drain_policy,
    free_port,
    session,
    sim_worker,
)
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.provenance import checkpoint_key
from sessionfleet.kube import Kube, KubeConfig

pytestmark = pytest.mark.timeout(300)

PART_OF = "app.kubernetes.io/part-of=sessionfleet"
KEEP = "helm.sh/resource-policy"


@pytest.fixture(scope="session")
def crds_installed(kubectl: Kubectl) -> None:
    """The sessionfleet CRDs, applied and Established (idempotent across workers)."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS_DIR))
    wait_established(kubectl, "-l", PART_OF)


FORBIDDEN = re.compile(r"HTTP/1\.1 403|\b403,? ?(message=)?.?Forbidden|\bForbidden\b")
"""An API refusal in a log: httpx's status line, or kopf's and aiohttp's error text."""


def release_name() -> str:
    """A release name of this test alone: cluster-scoped RBAC objects carry it."""
    return f"sf{secrets.token_hex(3)}"


def kubectl_as(
    config: Path, *args: str, tools_kubectl: Path, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """kubectl with another kubeconfig (a ServiceAccount's)."""
    return subprocess.run(
        [str(tools_kubectl), f"--kubeconfig={config}", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def service_account_kubeconfig(
    cluster: LocalCluster, namespace: str, account: str, path: Path
) -> Path:
    """A kubeconfig holding a TokenRequest token of ``namespace/account``.

    The server and its CA come from the admin kubeconfig; the only credential is the
    ServiceAccount's token, so whatever uses this file has exactly the chart's RBAC.
    """
    token = cluster.kubectl(
        "create", "token", account, f"--namespace={namespace}", "--duration=1h"
    ).stdout.strip()
    assert token.count(".") == 2, "a JWT"
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "e2e",
                "cluster": {
                    "server": server["server"],
                    "certificate-authority-data": server["certificate-authority-data"],
                },
            }
        ],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [
            {
                "name": account,
                "context": {"cluster": "e2e", "user": account, "namespace": namespace},
            }
        ],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


GATEWAY_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
"""The gateway's proxies, as networkPolicy.eppFrom names them."""


def container_args(apps: Any, namespace: str, deployment: str) -> list[str]:
    """The arguments of a chart Deployment's first container, as the API server holds them."""
    body = apps.read_namespaced_deployment(deployment, namespace)
    return list(body.spec.template.spec.containers[0].args)


async def checkpoint_key_as(config: Path, namespace: str, name: str) -> bytes:
    """The operator's checkpoint key, fetched (created if missing) with ``config``'s token."""
    kube = Kube(KubeConfig.load(str(config)), timeout=10.0)
    try:
        fleet = Fleet(
            config=OperatorConfig(checkpoint_key_secret=(namespace, name)),
            kube=kube,
            http=None,  # type: ignore[arg-type]
        )
        return await checkpoint_key(fleet)
    finally:
        await kube.aclose()


def can_i(kubectl: Kubectl, subject: str, *args: str) -> bool:
    """``kubectl auth can-i ... --as=subject``: yes or no."""
    result = kubectl("auth", "can-i", *args, f"--as={subject}", check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), result.stderr
    return answer == "yes"


def dry_run(kubectl: Kubectl, manifests: str) -> subprocess.CompletedProcess[str]:
    """Server-side dry run of ``manifests``: validated and admitted, nothing stored."""
    return kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=e2e-chart",
        "--dry-run=server",
        "-f",
        "-",
        input=manifests,
        check=False,
    )


# --- dry runs ---------------------------------------------------------------------------


def test_rendered_chart_passes_a_server_side_dry_run_under_restricted_pod_security(
    kubectl: Kubectl, core: Any, namespace: str, crds_installed: None
) -> None:
    core.patch_namespace(
        namespace,
        {
            "metadata": {
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/warn": "restricted",
                }
            }
        },
    )
    values: dict[str, Any] = {
        "operator": {"watchNamespaces": [namespace]},
        "router": {"autoscaling": {"enabled": True}},
        "agent": {"enabled": True},
        "networkPolicy": {"enabled": True},
        "defaultDrainPolicy": {"enabled": True},
    }
    text = template_text(values=values, namespace=namespace, release=release_name()).stdout
    documents = [d for d in yaml.safe_load_all(text) if d]
    result = dry_run(kubectl, text)
    assert result.returncode == 0, result.stderr
    assert "would violate PodSecurity" not in result.stderr, result.stderr
    applied = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    assert len(applied) == len(documents) >= 20, result.stdout

    # The criu driver makes the agent privileged: the one workload PodSecurity flags.
    values["agent"]["criu"] = True
    text = template_text(values=values, namespace=namespace, release=release_name()).stdout
    flagged = dry_run(kubectl, text)
    assert flagged.returncode == 0, flagged.stderr  # enforce applies to pods, warn to workloads
    warnings = [line for line in flagged.stderr.splitlines() if "would violate PodSecurity" in line]
    assert len(warnings) == 1, flagged.stderr
    assert 'container "agent"' in warnings[0] and "hostPID=true" in warnings[0]


def test_schema_errors_stop_helm_before_the_api_server(cluster: LocalCluster) -> None:
    result = helm(
        "install",
        release_name(),
        str(CHART),
        "--namespace=default",
        "--set=operator.replicaz=2",
        kubeconfig=cluster.kubeconfig,
        check=False,
    )
    assert result.returncode != 0 and "replicaz" in result.stderr
    assert (
        helm("list", "--all-namespaces", "--short", kubeconfig=cluster.kubeconfig).stdout.find(
            "replicaz"
        )
        < 0
    )


def test_notes_tell_what_to_do_next(cluster: LocalCluster, namespace: str) -> None:
    result = helm(
        "install",
        "notes",
        str(CHART),
        f"--namespace={namespace}",
        "--dry-run=client",
        # The shared cluster's CRDs belong to no release: a client dry run refuses to
        # adopt them, as a real install would.
        "--set=crds.enabled=false",
        "--set=agent.enabled=true",
        kubeconfig=cluster.kubeconfig,
    )
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {namespace} rollout status deployment/notes-sessionfleet-operator" in notes
    assert "install the CRDs yourself" in notes
    assert "port-forward service/notes-sessionfleet-router" in notes
    assert "WARNING: agent.enabled is true" in notes
    assert "crds.keep is false" not in notes
    assert "the operator fences each worker's engine port" in notes
    assert "not Flannel alone" in notes
    assert "deploy/admission/inferenceworker-pods.yaml" in notes


def test_kustomize_manifests_are_the_charts_and_pass_a_dry_run(
    kubectl: Kubectl, namespace: str, crds_installed: None, tmp_path: Path
) -> None:
    rendered = tmp_path / "rendered"
    subprocess.run(
        [str(REPO_ROOT / "deploy" / "kustomize" / "render.sh"), str(rendered)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    for relative in ("base/sessionfleet.yaml", "components/router/router.yaml"):
        committed = (REPO_ROOT / "deploy" / "kustomize" / relative).read_text()
        assert (rendered / relative).read_text() == committed, (
            f"deploy/kustomize/{relative} drifts from the chart: run `make kustomize-manifests`"
        )

    # The example overlay, moved into this test's namespace (the Namespace object
    # itself dropped: a dry run cannot create the namespace its objects need).
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": namespace,
                # kustomize takes a base by relative path only.
                "resources": [
                    os.path.relpath(
                        REPO_ROOT / "deploy" / "kustomize" / "overlays" / "example", overlay
                    )
                ],
                "patches": [
                    {
                        "patch": yaml.safe_dump(
                            {
                                "$patch": "delete",
                                "apiVersion": "v1",
                                "kind": "Namespace",
                                "metadata": {"name": "sessionfleet-system"},
                            }
                        )
                    }
                ],
            }
        )
    )
    built = kubectl("kustomize", str(overlay)).stdout
    objects = [d for d in yaml.safe_load_all(built) if d]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("CustomResourceDefinition") == 4 and kinds.count("Deployment") == 2
    router = next(
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "sessionfleet-router"
    )
    assert router["spec"]["replicas"] == 3
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kustomize"
    result = dry_run(kubectl, built)
    assert result.returncode == 0, result.stderr


# --- a fresh cluster: install, upgrade, uninstall -------------------------------------------


def crds_of(cluster: LocalCluster) -> list[dict[str, Any]]:
    listing = cluster.kubectl("get", "crd", "-l", PART_OF, "-o", "json").stdout
    return list(json.loads(listing)["items"])


def release_objects(cluster: LocalCluster, release: str, namespace: str) -> list[str]:
    """Every object left that carries the release's instance label, except CRDs."""
    selector = f"app.kubernetes.io/instance={release}"
    namespaced = cluster.kubectl(
        "get",
        "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,"
        "poddisruptionbudgets,horizontalpodautoscalers,networkpolicies,drainpolicies",
        f"--namespace={namespace}",
        "-l",
        selector,
        "-o",
        "name",
    ).stdout.split()
    cluster_wide = cluster.kubectl(
        "get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name"
    ).stdout.split()
    return namespaced + cluster_wide


def test_install_upgrade_uninstall_on_a_fresh_cluster(fresh_cluster: LocalCluster) -> None:
    kubeconfig, release, namespace = fresh_cluster.kubeconfig, "sf", "sessionfleet-system"
    assert crds_of(fresh_cluster) == []
    # KWOK's nodes carry a taint; tolerating it lets KWOK schedule the operator and
    # router pods and mark them Ready (it runs no container), so --wait has a meaning.
    tolerate = {"tolerations": gpu_pod_tolerations()}
    values = {"operator": tolerate, "router": tolerate}

    started = time.monotonic()
    installed = helm(
        "install",
        release,
        str(CHART),
        f"--namespace={namespace}",
        "--create-namespace",
        "--wait",
        "--timeout=120s",
        *set_args(values, []),
        kubeconfig=kubeconfig,
    )
    install_seconds = time.monotonic() - started
    wait_established(fresh_cluster.kubectl, "-l", PART_OF, timeout=30)
    established_seconds = time.monotonic() - started
    print(
        f"\nhelm install --wait: {install_seconds:.1f} s;"
        f" CRDs Established at {established_seconds:.1f} s"
    )
    assert "STATUS: deployed" in installed.stdout
    assert "rollout status deployment/sf-sessionfleet-operator" in installed.stdout

    crds = crds_of(fresh_cluster)
    assert sorted(c["spec"]["names"]["kind"] for c in crds) == [
        "AgentSession",
        "DrainPolicy",
        "InferenceWorker",
        "WorkerCheckpoint",
    ]
    for crd in crds:
        assert crd["metadata"]["annotations"][KEEP] == "keep"
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert established["Established"] == "True"
        assert established["NamesAccepted"] == "True"

    # The kinds are served: the category lists them (none yet). A fresh discovery
    # cache each time: kubectl's own would remember the cluster without the CRDs.
    def served() -> bool:
        listing = fresh_cluster.kubectl(
            "get",
            "sessionfleet",
            "--all-namespaces",
            f"--cache-dir={tempfile.mkdtemp(prefix='kubectl-cache-')}",
            check=False,
        )
        return listing.returncode == 0

    wait_until(served, timeout=30, what="the sessionfleet category served")

    with fresh_cluster.api_client() as api:
        apps = client.AppsV1Api(api)
        operator = apps.read_namespaced_deployment("sf-sessionfleet-operator", namespace)
        router = apps.read_namespaced_deployment("sf-sessionfleet-router", namespace)
    assert operator.spec.replicas == 2 and operator.spec.strategy.type == "RollingUpdate"
    assert operator.spec.template.spec.service_account_name == "sf-sessionfleet-operator"
    assert operator.status.ready_replicas == 2  # KWOK's Ready: no container ran
    assert router.spec.replicas == 2

    # Something a user made, which must outlive the release while the CRDs are kept.
    fresh_cluster.kubectl(
        "apply", f"--namespace={namespace}", "-f", str(REPO_ROOT / "examples" / "drainpolicy.yaml")
    )

    upgraded = helm(
        "upgrade",
        release,
        str(CHART),
        f"--namespace={namespace}",
        "--wait",
        "--timeout=120s",
        *set_args(
            values,
            ["router.replicas=3", "operator.idleTimeout=1h", "defaultDrainPolicy.enabled=true"],
        ),
        kubeconfig=kubeconfig,
    )
    assert "REVISION: 2" in upgraded.stdout
    assert apps.read_namespaced_deployment("sf-sessionfleet-router", namespace).spec.replicas == 3
    operator = apps.read_namespaced_deployment("sf-sessionfleet-operator", namespace)
    assert "--idle-timeout=1h" in operator.spec.template.spec.containers[0].args
    policies = fresh_cluster.kubectl(
        "get", "drainpolicies", f"--namespace={namespace}", "-o", "name"
    ).stdout.split()
    assert sorted(policies) == [
        "drainpolicy.sessionfleet.dev/default",
        "drainpolicy.sessionfleet.dev/eks-upgrade",
    ]

    started = time.monotonic()
    uninstalled = helm(
        "uninstall", release, f"--namespace={namespace}", "--wait", kubeconfig=kubeconfig
    )
    print(f"helm uninstall --wait: {time.monotonic() - started:.1f} s")
    assert "These resources were kept due to the resource policy" in uninstalled.stdout
    wait_until(
        lambda: release_objects(fresh_cluster, release, namespace) == [],
        timeout=60,
        what="every object of the release gone",
    )
    assert helm("list", "--all-namespaces", "--short", kubeconfig=kubeconfig).stdout.strip() == ""
    assert len(crds_of(fresh_cluster)) == 4, "the CRDs are kept"
    left = fresh_cluster.kubectl(
        "get", "drainpolicies", f"--namespace={namespace}", "-o", "name"
    ).stdout.split()
    assert left == ["drainpolicy.sessionfleet.dev/eks-upgrade"], "the user's object survives"

    # Without keep, uninstall deletes the CRDs, and every object of their kinds with
    # them: the policy above is what protected them. The same release name adopts the
    # kept CRDs (their ownership annotations name it).
    helm(
        "install",
        release,
        str(CHART),
        f"--namespace={namespace}",
        "--set=crds.keep=false",
        "--set=router.enabled=false",
        kubeconfig=kubeconfig,
    )
    # Helm decides what to keep from the release's manifest, not the live objects
    # (adoption leaves the old annotation on them).
    manifest = helm("get", "manifest", release, f"--namespace={namespace}", kubeconfig=kubeconfig)
    assert manifest.stdout.count("kind: CustomResourceDefinition") == 4
    assert KEEP not in manifest.stdout
    helm("uninstall", release, f"--namespace={namespace}", "--wait", kubeconfig=kubeconfig)
    wait_until(lambda: crds_of(fresh_cluster) == [], timeout=60, what="the CRDs deleted")
    # The API group is gone, and the user's DrainPolicy with it.
    gone = fresh_cluster.kubectl("get", "--raw", "/apis/sessionfleet.dev", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr, gone.stderr


# --- the chart's ServiceAccounts, for real ---------------------------------------------------


class RouterProcess:
    """``sessionfleet router`` on loopback with a kubeconfig of its own."""

    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "router.log"
        argv = [
            str(SESSIONFLEET),
            "router",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--namespace={namespace}",
            f"--kubeconfig={kubeconfig}",
            "--replica=e2e-chart-router",
            "--flush-interval=0.5",
            *extra,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ),
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def turn(url: str, session_id: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "Fix the failing test in the parser."}],
            "max_tokens": 16,
        },
        headers={"X-Session-Id": session_id, **headers},
        timeout=30,
    )


def test_operator_and_router_run_with_the_charts_service_accounts(
    cluster: LocalCluster,
    kubectl: Kubectl,
    core: Any,
    api: Any,
    namespace: str,
    crds_installed: None,
    tmp_path: Path,
) -> None:
    release = release_name()
    helm(
        "install",
        release,
        str(CHART),
        f"--namespace={namespace}",
        "--set=crds.enabled=false",  # the shared cluster's CRDs belong to every test
        f"--set=operator.watchNamespaces={{{namespace}}}",
        # The Endpoint Picker too, for its Role; its gateway's peers it requires.
        "--set=epp.enabled=true",
        "--set-json=networkPolicy.eppFrom=" + json.dumps([GATEWAY_PEER]),
        kubeconfig=cluster.kubeconfig,
    )
    operator: OperatorProcess | None = None
    router: RouterProcess | None = None
    try:
        operator_sa = f"{release}-sessionfleet-operator"
        router_sa = f"{release}-sessionfleet-router"
        as_operator = f"system:serviceaccount:{namespace}:{operator_sa}"
        as_router = f"system:serviceaccount:{namespace}:{router_sa}"

        # The in-cluster Deployment exists with the chart's ServiceAccount (KWOK would
        # not run its container; the real process runs below, outside the cluster).
        apps = client.AppsV1Api(api)
        deployment = apps.read_namespaced_deployment(operator_sa, namespace)
        assert deployment.spec.template.spec.service_account_name == operator_sa
        assert f"--namespace={namespace}" in deployment.spec.template.spec.containers[0].args

        # What the rules allow, and what they do not.
        ns = f"--namespace={namespace}"
        assert can_i(kubectl, as_operator, "create", "pods", ns)
        assert can_i(
            kubectl,
            as_operator,
            "patch",
            "inferenceworkers.sessionfleet.dev",
            "--subresource=status",
            ns,
        )
        assert can_i(
            kubectl,
            as_operator,
            "patch",
            "drainpolicies.sessionfleet.dev",
            "--subresource=status",
            ns,
        )
        assert not can_i(kubectl, as_operator, "patch", "drainpolicies.sessionfleet.dev", ns)
        assert can_i(kubectl, as_operator, "watch", "nodes")
        assert not can_i(kubectl, as_operator, "delete", "nodes")
        assert not can_i(kubectl, as_operator, "get", "secrets", ns)
        assert not can_i(kubectl, as_operator, "create", "pods", "--namespace=default")
        assert not can_i(kubectl, as_operator, "patch", "inferenceworkers.sessionfleet.dev", ns)
        assert can_i(kubectl, as_router, "create", "agentsessions.sessionfleet.dev", ns)
        assert can_i(
            kubectl,
            as_router,
            "patch",
            "agentsessions.sessionfleet.dev",
            "--subresource=status",
            ns,
        )
        # Only to remove a session whose first turn got no answer.
        assert can_i(kubectl, as_router, "delete", "agentsessions.sessionfleet.dev", ns)
        assert not can_i(kubectl, as_router, "delete", "inferenceworkers.sessionfleet.dev", ns)
        assert not can_i(kubectl, as_router, "create", "pods", ns)
        assert not can_i(
            kubectl,
            as_router,
            "patch",
            "inferenceworkers.sessionfleet.dev",
            "--subresource=status",
            ns,
        )

        operator_config = service_account_kubeconfig(
            cluster, namespace, operator_sa, tmp_path / "operator.kubeconfig"
        )
        router_config = service_account_kubeconfig(
            cluster, namespace, router_sa, tmp_path / "router.kubeconfig"
        )
        # Our client must send the token, or every call is system:anonymous's.
        for config in (operator_config, router_config):
            assert KubeConfig.from_kubeconfig(str(config)).bearer_token(), (
                "sessionfleet.kube.KubeConfig dropped the kubeconfig's token (kubernetes>=30 "
                "keeps it in Configuration.api_key['BearerToken'])"
            )
        # Real calls with the tokens, refused by the API server.
        tools_kubectl = cluster.tools().kubectl
        node = core.list_node().items[0].metadata.name
        refused = kubectl_as(operator_config, "delete", "node", node, tools_kubectl=tools_kubectl)
        assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stderr
        refused = kubectl_as(operator_config, "get", "secrets", ns, tools_kubectl=tools_kubectl)
        assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stderr
        refused = kubectl_as(
            router_config,
            "delete",
            "inferenceworker",
            "any-worker",
            ns,
            tools_kubectl=tools_kubectl,
        )
        assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stderr

        # It elects itself on the chart's Lease, with the rights the chart grants on it.
        lease = f"{release}-sessionfleet-operator"
        assert can_i(kubectl, as_operator, "create", "leases.coordination.k8s.io", ns)
        assert can_i(kubectl, as_operator, "patch", f"leases.coordination.k8s.io/{lease}", ns)
        assert not can_i(kubectl, as_operator, "patch", "leases.coordination.k8s.io/other", ns)

        # The router and the Endpoint Picker reach their own slot Leases only: never the
        # operator's, whose holder or duration they could otherwise rewrite (issue 29).
        as_epp = f"system:serviceaccount:{namespace}:{release}-sessionfleet-epp"
        for subject, component in ((as_router, "router"), (as_epp, "epp")):
            slot = f"leases.coordination.k8s.io/{release}-sessionfleet-{component}-0"
            for verb in ("patch", "update", "delete", "get"):
                assert not can_i(
                    kubectl, subject, verb, f"leases.coordination.k8s.io/{lease}", ns
                ), (subject, verb)
            assert not can_i(kubectl, subject, "list", "leases.coordination.k8s.io", ns)
            assert can_i(kubectl, subject, "patch", slot, ns)
            assert can_i(kubectl, subject, "get", slot, ns)
            assert not can_i(kubectl, subject, "delete", slot, ns)
        # RBAC cannot scope a create by name; the chart's admission policy does. Before
        # the operator ever ran, the router cannot create the operator's Lease first.
        epp_config = service_account_kubeconfig(
            cluster, namespace, f"{release}-sessionfleet-epp", tmp_path / "epp.kubeconfig"
        )

        def create_lease(config: Path, name: str) -> subprocess.CompletedProcess[str]:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name},
                "spec": {"holderIdentity": "squatter", "leaseDurationSeconds": 3600},
            }
            return kubectl_as(
                config, "create", "-f", "-", ns, tools_kubectl=tools_kubectl, input=json.dumps(body)
            )

        probes = itertools.count()
        wait_until(
            lambda: (
                "ValidatingAdmissionPolicy"
                in (create_lease(router_config, f"probe-{next(probes)}").stderr)
            ),
            timeout=30,
            what="the chart's Lease admission policy in force",
        )
        for config, component in ((router_config, "router"), (epp_config, "epp")):
            created = create_lease(config, lease)
            assert created.returncode != 0, f"the {component} created the operator's Lease"
            assert f"may create only its Lease slots {release}-sessionfleet-{component}-0" in (
                created.stderr
            ), created.stderr
        operator_args = container_args(client.AppsV1Api(api), namespace, operator_sa)
        engine_peers = [a for a in operator_args if a.startswith("--engine-peers=")]
        assert len(engine_peers) == 1, operator_args
        # The checkpoint key (docs/checkpoints.md, Provenance): the operator may create
        # Secrets (a create cannot be scoped by name) but read only its key.
        key_name = f"{release}-sessionfleet-checkpoint-key"
        key_secret = f"--checkpoint-key-secret={namespace}/{key_name}"
        assert key_secret in operator_args, operator_args
        assert can_i(kubectl, as_operator, "get", f"secrets/{key_name}", ns)
        assert can_i(kubectl, as_operator, "create", "secrets", ns)
        assert not can_i(kubectl, as_operator, "get", "secrets/other", ns)
        assert not can_i(kubectl, as_router, "get", f"secrets/{key_name}", ns)
        # With the operator's token alone, its code creates the key, then reads it back.
        created_key = asyncio.run(checkpoint_key_as(operator_config, namespace, key_name))
        assert asyncio.run(checkpoint_key_as(operator_config, namespace, key_name)) == created_key
        assert len(created_key) == 32
        operator = OperatorProcess(
            operator_config,
            namespace,
            tmp_path,
            f"--leader-election-id={lease}",
            key_secret,
            *engine_peers,
        )
        operator.start()
        # The router picks its free port once the operator holds both of its own.
        health = f"http://127.0.0.1:{operator.health_port}/healthz"
        wait_until(
            lambda: httpx.get(health, timeout=2).status_code == 200,
            timeout=30,
            what="the operator's /healthz",
        )
        # The router runs with the chart's Lease slots, as its Deployment would.
        router_args = container_args(apps, namespace, router_sa)
        slot_args = [a for a in router_args if a.startswith(("--lease-prefix=", "--lease-slots="))]
        assert len(slot_args) == 2, router_args
        router = RouterProcess(router_config, namespace, tmp_path, *slot_args)
        crs = Custom(client.CustomObjectsApi(api), namespace)

        def fail(what: str) -> str:
            assert operator is not None and router is not None
            return (
                f"{what}\n--- operator ---\n{operator.log_tail()}\n--- router ---\n"
                f"{router.log_tail()}"
            )

        # The operator (its token only) starts a worker: pods, worker status; and
        # writes the status of the DrainPolicy that governs it (the built-in defaults).
        crs.create(drain_policy("everything"))
        crs.create(sim_worker("w"))
        try:
            wait_until(
                lambda: crs.status("inferenceworkers", "w").get("phase") == "Ready",
                timeout=90,
                what="worker w Ready",
            )
            wait_until(
                lambda: crs.status("drainpolicies", "everything").get("workers") == ["w"],
                timeout=30,
                what="DrainPolicy everything's status listing w",
            )
        except AssertionError as error:
            raise AssertionError(fail(str(error))) from None

        # The engine's fence: the operator (its token only) wrote the worker's
        # NetworkPolicy with the chart's peers; one deleted by hand is put back.
        networking = client.NetworkingV1Api(api)
        peers = json.loads(engine_peers[0].split("=", 1)[1])
        fence = wait_until(
            lambda: networking.read_namespaced_network_policy("w-engine", namespace),
            timeout=15,
            what="the worker's engine NetworkPolicy",
        )
        fence_dict = api.sanitize_for_serialization(fence)
        worker_uid = crs.get("inferenceworkers", "w")["metadata"]["uid"]
        assert fence_dict["metadata"]["ownerReferences"][0]["uid"] == worker_uid
        assert fence_dict["spec"]["podSelector"] == {
            "matchLabels": {"sessionfleet.dev/worker": "w"}
        }
        assert fence_dict["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = fence_dict["spec"]["ingress"]
        assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
        assert rule["from"] == peers
        components = [
            p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
            for p in rule["from"]
        ]
        assert components == ["operator", "router", None]  # then the gateway's peer
        assert rule["from"][2] == GATEWAY_PEER
        networking.delete_namespaced_network_policy("w-engine", namespace)
        wait_until(
            lambda: (
                networking.read_namespaced_network_policy("w-engine", namespace).metadata.uid
                != fence.metadata.uid
            ),
            timeout=30,
            what="the deleted NetworkPolicy put back",
        )

        # The router (its token only) records a session; the operator binds it.
        wait_until(
            lambda: httpx.get(f"{router.url}/readyz", timeout=2).status_code == 200,
            timeout=30,
            what="the router ready",
        )
        # The router keeps its own Lease, a slot by name, holding it as itself.
        coordination = client.CoordinationV1Api(api)
        held = wait_until(
            lambda: [
                item
                for item in coordination.list_namespaced_lease(namespace).items
                if item.spec.holder_identity == "e2e-chart-router"
            ],
            timeout=15,
            what="the router's Lease",
        )
        (slot_lease,) = held
        assert re.fullmatch(rf"{release}-sessionfleet-router-[0-7]", slot_lease.metadata.name)
        assert slot_lease.metadata.labels == {"sessionfleet.dev/component": "router"}
        renewed = slot_lease.spec.renew_time
        wait_until(
            lambda: (
                coordination.read_namespaced_lease(
                    slot_lease.metadata.name, namespace
                ).spec.renew_time
                > renewed
            ),
            timeout=15,
            what="the router's Lease renewed",
        )
        assert coordination.read_namespaced_lease(lease, namespace).spec.holder_identity != (
            "squatter"
        )

        answer = turn(router.url, "agent-1")
        assert answer.status_code == 200, fail(answer.text)
        assert answer.headers["X-Sessionfleet-Worker"] == "w"

        def recorded() -> dict[str, Any] | None:
            return next(
                (s for s in crs.list("agentsessions") if s["spec"]["sessionId"] == "agent-1"),
                None,
            )

        item = wait_until(recorded, timeout=15, what="the router's AgentSession")
        name = item["metadata"]["name"]
        assert item["metadata"]["annotations"]["sessionfleet.dev/created-by"] == "e2e-chart-router"
        wait_until(
            lambda: crs.status("agentsessions", name).get("phase") == "Bound",
            timeout=30,
            what="the session Bound",
        )
        # Usage flushed by the router into the status; the hold put up by the operator.
        wait_until(
            lambda: (crs.status("agentsessions", name).get("turns") or 0) >= 1,
            timeout=15,
            what="usage in the session's status",
        )
        policy = client.PolicyV1Api(api)
        wait_until(
            lambda: (
                [
                    p.metadata.name
                    # The chart's own PDB of the operator pods is in the namespace too.
                    for p in policy.list_namespaced_pod_disruption_budget(
                        namespace, label_selector="sessionfleet.dev/worker"
                    ).items
                ]
                == ["w"]
            ),
            timeout=15,
            what="the worker's PodDisruptionBudget",
        )
        wait_until(
            lambda: (
                condition(crs.status("inferenceworkers", "w"), "DrainHeld").get("status") == "True"
            ),
            timeout=15,
            what="DrainHeld",
        )

        # The last turn: the router marks the spec finished, the operator the phase.
        final = turn(router.url, "agent-1", **{"X-Session-Final": "true"})
        assert final.status_code == 200, fail(final.text)
        wait_until(
            lambda: crs.get("agentsessions", name)["spec"].get("finished") is True,
            timeout=15,
            what="spec.finished set by the router",
        )
        wait_until(
            lambda: crs.status("agentsessions", name).get("phase") == "Finished",
            timeout=30,
            what="the session Finished",
        )
        wait_until(
            lambda: (
                policy.list_namespaced_pod_disruption_budget(
                    namespace, label_selector="sessionfleet.dev/worker"
                ).items
                == []
            ),
            timeout=30,
            what="the hold taken down",
        )

        # An expired session is deleted by the operator.
        crs.create(session("expired", finished=True, ttlSecondsAfterFinished=0))
        wait_until(
            lambda: "expired" not in {s["metadata"]["name"] for s in crs.list("agentsessions")},
            timeout=30,
            what="the expired session deleted",
        )

        # A requested drain with nothing pinned: the worker's pod is deleted.
        crs.patch("inferenceworkers", "w", {"spec": {"drain": True}})
        wait_until(
            lambda: (
                crs.status("inferenceworkers", "w").get("phase") == "Drained"
                and not core.list_namespaced_pod(
                    namespace, label_selector="sessionfleet.dev/worker=w"
                ).items
            ),
            timeout=60,
            what="w Drained and its pod gone",
        )

        # Every kind of write the rules allow was made, with the ServiceAccount's token.
        writes = {
            line.split("{", 1)[1].split("}", 1)[0]
            for line in operator.metrics().splitlines()
            if line.startswith("sessionfleet_operator_api_writes_total{")
            and float(line.rsplit(" ", 1)[1]) >= 1
        }
        for verb, resource in (
            ("create", "pods"),
            ("delete", "pods"),
            ("patch", "pods"),
            ("create", "poddisruptionbudgets"),
            ("delete", "poddisruptionbudgets"),
            ("patch", "inferenceworkers/status"),
            ("patch", "agentsessions/status"),
            ("patch", "drainpolicies/status"),
            ("delete", "agentsessions"),
            ("apply", "networkpolicies"),
        ):
            assert f'resource="{resource}",verb="{verb}"' in writes, (verb, resource, writes)
        # kopf degrades quietly when a watch is forbidden (a warning, then no events);
        # its log is the one place that says so.
        log = operator.log_path.read_text()
        # A refusal, as httpx and kopf write it: not a bare "403", which a log line's
        # milliseconds (",403 INFO") contain once in a thousand lines.
        assert "Not enough permissions" not in log and not FORBIDDEN.search(log), (
            operator.log_tail()
        )
        assert not FORBIDDEN.search(router.log_path.read_text()), router.log_tail()
        # A clean stop gives the slot back: no holder, no renewal, so no migration waits
        # for the stopped replica and the next one may take the slot at once.
        router.stop()
        released = coordination.read_namespaced_lease(slot_lease.metadata.name, namespace)
        assert released.spec.holder_identity is None and released.spec.renew_time is None
    finally:
        if router is not None:
            router.stop()
        if operator is not None:
            operator.stop()
        helm("uninstall", release, f"--namespace={namespace}", kubeconfig=cluster.kubeconfig)
    leftovers = cluster.kubectl(
        "get",
        "clusterroles,clusterrolebindings",
        "-l",
        f"app.kubernetes.io/instance={release}",
        "-o",
        "name",
    ).stdout.split()
    assert leftovers == []

"""Command lines of the control-plane components (pure functions, no I/O).

The flags follow e2e/README.md, "The cluster": loopback addresses only, a loopback
Service range and pod CIDR, RBAC + Node authorization, service-account token signing,
and the controller manager's controllers minus the cloud and IPAM ones.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ._pki import Pki
from ._tools import K8S_VERSION, Tools

HOST = "127.0.0.1"
#: The ``kubernetes`` Service gets 127.96.0.1: nothing leaves the loopback range.
SERVICE_CLUSTER_IP_RANGE = "127.96.0.0/16"
#: Each cluster's KWOK hands out pod IPs from its own 127.N.0.0/16, N in this range
#: (clear of 127.0.x.x, of the Service range and of the low /16s tests use for their
#: own processes). Two clusters on one machine must never share one: a backed process
#: binds its pod IP and port, and the other cluster would hand out the same address.
POD_CIDR_SECOND_OCTETS = range(128, 251)
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

#: KWOK manages only nodes with this annotation, so a real node would never be touched.
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
#: Pods with this annotation are left alone by KWOK: the pod backer owns their status.
KWOK_CUSTOM_STATUS_ANNOTATION = ("kwok.x-k8s.io/status", "custom")
#: The label by which a pod opts in to a real process behind it (see backer.py).
BACKED_LABEL = "sessionfleet.dev/backed"

#: Controllers that need a cloud or allocate node CIDRs; everything else runs
#: (garbage collector, disruption, namespace, service-account tokens, node lifecycle).
_DISABLED_CONTROLLERS = ("nodeipam", "service-lb-controller", "cloud-node-lifecycle")
#: Controllers that 1.37's controller manager no longer has (naming one is an error).
_GONE_IN_1_37 = ("service-lb-controller", "cloud-node-lifecycle")


def _minor(version: str) -> int:
    """The minor release of a version such as ``v1.37.2``."""
    return int(version.removeprefix("v1.").split(".")[0])


def disabled_controllers(version: str) -> tuple[str, ...]:
    """The controllers to turn off on this Kubernetes release."""
    if _minor(version) >= 37:
        return tuple(name for name in _DISABLED_CONTROLLERS if name not in _GONE_IN_1_37)
    return _DISABLED_CONTROLLERS


#: The Stage files shipped with KWOK that the cluster plays, relative to the stages
#: directory. The chaos stages only act on objects labelled to opt in.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "node/chaos/node-not-ready.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
)


@dataclass(frozen=True)
class Ports:
    """The loopback ports of one cluster."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int

    @classmethod
    def allocate(cls) -> Ports:
        """Pick free loopback ports, all distinct.

        The sockets stay open until every port is chosen so the kernel cannot hand
        the same port out twice; another process could still take one before the
        component binds it, which start-up reports as that component failing.
        """
        sockets = []
        try:
            for _ in range(6):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind((HOST, 0))
                sockets.append(sock)
            numbers = [sock.getsockname()[1] for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        return cls(*numbers)


@dataclass(frozen=True)
class Layout:
    """Files and directories of one cluster inside its state directory."""

    state_dir: Path

    @property
    def pki_dir(self) -> Path:
        """Certificates and keys."""
        return self.state_dir / "pki"

    @property
    def etcd_data(self) -> Path:
        """etcd's data directory."""
        return self.state_dir / "etcd-data"

    @property
    def logs(self) -> Path:
        """One log file per component."""
        return self.state_dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig handed to users and tests."""
        return self.state_dir / "kubeconfig"

    def component_kubeconfig(self, name: str) -> Path:
        """The kubeconfig a component authenticates with."""
        return self.state_dir / "kubeconfigs" / f"{name}.yaml"

    @property
    def kwok_config(self) -> Path:
        """The multi-document YAML of KWOK Stage objects."""
        return self.state_dir / "kwok.yaml"

    @property
    def audit_policy(self) -> Path:
        """The API server's audit policy (:func:`audit_policy_yaml`)."""
        return self.state_dir / "audit-policy.yaml"

    @property
    def audit_log(self) -> Path:
        """The API server's audit log: one JSON event per line."""
        return self.logs / "audit.log"

    @property
    def pods_dir(self) -> Path:
        """Working directories and logs of backed pod processes."""
        return self.state_dir / "pods"

    @property
    def state_file(self) -> Path:
        """JSON record of ports and processes, read by ``down`` and ``status``."""
        return self.state_dir / "cluster.json"


def choose_pod_cidr(in_use: Collection[int], rng: random.Random | None = None) -> str:
    """Pick a pod CIDR ``127.N.0.1/16`` whose N no running cluster uses.

    Chosen at random among the free ones, so that two clusters starting at the same
    moment are unlikely to pick the same one before either KWOK runs.
    """
    free = [octet for octet in POD_CIDR_SECOND_OCTETS if octet not in in_use]
    if not free:
        raise RuntimeError("every loopback pod CIDR is taken by a running cluster")
    return f"127.{(rng or random.SystemRandom()).choice(free)}.0.1/16"


def etcd_argv(tools: Tools, ports: Ports, layout: Layout) -> list[str]:
    """Single-member etcd on loopback."""
    client = f"http://{HOST}:{ports.etcd_client}"
    peer = f"http://{HOST}:{ports.etcd_peer}"
    return [
        str(tools.binary("etcd")),
        "--name=e2e",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=e2e={peer}",
        "--initial-cluster-state=new",
        # The data is thrown away with the cluster; skipping fsync makes writes
        # (every object the tests create) much cheaper on a shared disk.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def endpoint_reconciler_args(version: str) -> list[str]:
    """Return the reconciler flag for the ``kubernetes`` Service's endpoints.

    From 1.37 the API server refuses to start with a loopback advertise address and an
    endpoint reconciler ("may not be in the loopback range"); nothing here proxies
    Service IPs, so the endpoints are not reconciled there. Older releases keep their
    default (the lease reconciler).
    """
    return ["--endpoint-reconciler-type=none"] if _minor(version) >= 37 else []


def apiserver_argv(tools: Tools, ports: Ports, layout: Layout, pki: Pki) -> list[str]:
    """kube-apiserver with RBAC + Node authorization and service-account tokens."""
    return [
        str(tools.binary("kube-apiserver")),
        f"--etcd-servers=http://{HOST}:{ports.etcd_client}",
        f"--bind-address={HOST}",
        f"--advertise-address={HOST}",
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--allow-privileged=true",
        f"--audit-policy-file={layout.audit_policy}",
        f"--audit-log-path={layout.audit_log}",
        # Bounded: a long run keeps the newest 3 x 20 MB; the policy logs writes only.
        "--audit-log-maxsize=20",
        "--audit-log-maxbackup=2",
        "--audit-log-maxage=1",
        # Written as they happen, so a test reads what it just caused.
        "--audit-log-mode=blocking",
        "--profiling=false",
        "--v=1",
        *endpoint_reconciler_args(K8S_VERSION),
    ]


#: Who the audit log follows: the project's resources and the objects it writes.
AUDITED_RESOURCES = (
    {"group": "sessionfleet.dev"},
    {"group": "", "resources": ["pods", "events"]},
    {"group": "policy", "resources": ["poddisruptionbudgets"]},
    {"group": "coordination.k8s.io", "resources": ["leases"]},
    {"group": "events.k8s.io", "resources": ["events"]},
)
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")


def audit_policy_yaml() -> str:
    """Return the API server's audit policy: who wrote what, when; reads are not logged.

    Metadata level (no bodies) at the response stage only, for writes to
    :data:`AUDITED_RESOURCES`: what fencing tests read (e2e/test_leader.py) without
    slowing the suite's many reads and the nodes' lease renewals down.
    """
    policy = {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived", "ResponseStarted", "Panic"],
        "rules": [
            {"level": "None", "userGroups": ["system:nodes"]},
            {"level": "None", "namespaces": ["kube-node-lease"]},  # KWOK's node heartbeats
            {"level": "Metadata", "verbs": list(WRITE_VERBS), "resources": list(AUDITED_RESOURCES)},
            {"level": "None"},
        ],
    }
    return yaml.safe_dump(policy, sort_keys=False)


def controller_manager_argv(tools: Tools, ports: Ports, layout: Layout, pki: Pki) -> list[str]:
    """kube-controller-manager with per-controller service-account credentials."""
    return [
        str(tools.binary("kube-controller-manager")),
        f"--kubeconfig={layout.component_kubeconfig('kube-controller-manager')}",
        f"--bind-address={HOST}",
        f"--secure-port={ports.controller_manager}",
        f"--cert-dir={layout.state_dir / 'kube-controller-manager-certs'}",
        "--use-service-account-credentials",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--root-ca-file={pki.ca.cert}",
        f"--cluster-signing-cert-file={pki.ca.cert}",
        f"--cluster-signing-key-file={pki.ca.key}",
        "--leader-elect=false",
        "--controllers=*," + ",".join(f"-{name}" for name in disabled_controllers(K8S_VERSION)),
        "--profiling=false",
        "--v=1",
    ]


def scheduler_argv(tools: Tools, ports: Ports, layout: Layout) -> list[str]:
    """kube-scheduler, serving /healthz on loopback for the readiness check."""
    return [
        str(tools.binary("kube-scheduler")),
        f"--kubeconfig={layout.component_kubeconfig('kube-scheduler')}",
        f"--bind-address={HOST}",
        f"--secure-port={ports.scheduler}",
        f"--cert-dir={layout.state_dir / 'kube-scheduler-certs'}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def kwok_argv(tools: Tools, ports: Ports, layout: Layout, pod_cidr: str) -> list[str]:
    """KWOK managing the annotated fake nodes, with loopback pod and node IPs."""
    return [
        str(tools.binary("kwok")),
        f"--kubeconfig={layout.kubeconfig}",
        f"--config={layout.kwok_config}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=" + "=".join(KWOK_NODE_ANNOTATION),
        # Deprecated in favour of Stage selectors, but still honoured by v0.8.0's pod
        # and stage controllers: it is what lets the pod backer own a pod's status.
        "--disregard-status-with-annotation-selector=" + "=".join(KWOK_CUSTOM_STATUS_ANNOTATION),
        f"--cidr={pod_cidr}",
        f"--node-ip={HOST}",
        f"--server-address={HOST}:{ports.kwok}",
        # The heartbeat-with-lease stage refreshes node status only every ~10 minutes
        # and relies on a Lease for liveness; without one, the node lifecycle
        # controller marks the nodes Unknown after its grace period and every pod on
        # them not Ready, which lets evictions through PodDisruptionBudgets.
        "--node-lease-duration-seconds=40",
    ]


# A backed pod's first status, written by KWOK: Running with a pod IP (allocated by
# KWOK, which is why KWOK plays this step), but its containers still "creating" and
# the pod not Ready. The pod backer takes over from there, as a kubelet would report
# the container started and, after the readiness probe, Ready. The template
# functions are KWOK's (see its pod-ready stage).
_BACKED_POD_STARTING_TEMPLATE = """\
{{ $now := Now }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: ContainersNotReady,
   lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  started: false
  restartCount: 0
  state: {waiting: {reason: ContainerCreating}}
{{ end }}
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
{{ end }}
{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" )
   ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
{{ with $podIPs }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""

_BACKED_LABEL_KEY = f'.metadata.labels["{BACKED_LABEL}"]'


def backed_pod_starting_stage() -> dict[str, Any]:
    """The Stage that starts backed pods: Running with an IP, not yet Ready."""
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": "sessionfleet-backed-pod-starting"},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {
                "matchExpressions": [
                    {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                    {"key": _BACKED_LABEL_KEY, "operator": "In", "values": ["true"]},
                    {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
                ]
            },
            "next": {"statusTemplate": _BACKED_POD_STARTING_TEMPLATE},
        },
    }


def kwok_stages_yaml(tools: Tools) -> str:
    """KWOK's shipped Stage files plus the backed-pod stage, as one multi-document YAML.

    KWOK v0.8.0 exits with "no stages found" unless it is given Stage objects. The
    shipped pod-ready stage would mark a backed pod Ready before its process runs, so
    it is narrowed to pods that are not backed.
    """
    stages = [yaml.safe_load((tools.stages_dir / name).read_text()) for name in KWOK_STAGES]
    for stage in stages:
        if stage["metadata"]["name"] == "pod-ready":
            stage["spec"]["selector"]["matchExpressions"].append(
                {"key": _BACKED_LABEL_KEY, "operator": "NotIn", "values": ["true"]}
            )
    stages.append(backed_pod_starting_stage())
    return yaml.safe_dump_all(stages, sort_keys=False)

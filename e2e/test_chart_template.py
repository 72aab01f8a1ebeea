"""The chart rendered by the real, pinned helm: lint, schema, and what each value does.

No cluster is needed (``helm template`` renders offline); the API server's view of the
same manifests is in test_chart.py. helm comes from ``make e2e-tools``: without it
these tests fail, they do not skip.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.chart import CHART, REPO_ROOT, by_kind, helm, render, rules, set_args, template_text
from e2e.localcluster import K8S_VERSION
from sessionfleet._version import __version__
from sessionfleet.api import DrainPolicy, parse

pytestmark = pytest.mark.timeout(120)

IMAGE = f"ghcr.io/sessionfleet/sessionfleet:{__version__}"
LIST_WATCH = ("list", "watch")
OPERATOR_NAMESPACED = {
    *(
        ("sessionfleet.dev", kind, verb)
        for kind in ("inferenceworkers", "agentsessions", "drainpolicies")
        for verb in LIST_WATCH
    ),
    ("sessionfleet.dev", "inferenceworkers/status", "patch"),
    ("sessionfleet.dev", "agentsessions/status", "patch"),
    ("sessionfleet.dev", "drainpolicies/status", "patch"),
    ("sessionfleet.dev", "agentsessions", "delete"),
    ("sessionfleet.dev", "agentsessions", "get"),  # a failed session's conditions
    ("sessionfleet.dev", "inferenceworkers/finalizers", "update"),
    *(("", "pods", verb) for verb in ("list", "watch", "create", "delete", "patch")),
    ("policy", "poddisruptionbudgets", "list"),
    ("policy", "poddisruptionbudgets", "watch"),
    ("policy", "poddisruptionbudgets", "create"),
    ("policy", "poddisruptionbudgets", "delete"),
    ("", "events", "create"),
    ("events.k8s.io", "events", "create"),
    ("events.k8s.io", "events", "patch"),
    *(
        ("sessionfleet.dev", "workercheckpoints", verb)
        for verb in ("list", "watch", "create", "delete")
    ),
    ("sessionfleet.dev", "workercheckpoints/status", "patch"),
    ("coordination.k8s.io", "leases", "list"),
    ("coordination.k8s.io", "leases", "watch"),
    *(
        ("networking.k8s.io", "networkpolicies", verb)
        for verb in ("list", "watch", "create", "patch")
    ),
}
OPERATOR_CLUSTER = {
    ("", "nodes", "list"),
    ("", "nodes", "watch"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}
ROUTER = {
    ("sessionfleet.dev", "inferenceworkers", "list"),
    ("sessionfleet.dev", "inferenceworkers", "watch"),
    *(
        ("sessionfleet.dev", "agentsessions", verb)
        for verb in ("list", "watch", "get", "create", "patch", "delete")
    ),
    ("sessionfleet.dev", "agentsessions/status", "patch"),
    # The slot Leases: create in a rule of its own; get and patch by name only
    # (test_lease_rules_name_the_slots_and_nothing_else).
    *(("coordination.k8s.io", "leases", verb) for verb in ("create", "get", "patch")),
}
# The Endpoint Picker's Role: the router's without `delete` on agentsessions (the EPP
# never deletes the session of a first turn that got no answer).
EPP = ROUTER - {("sessionfleet.dev", "agentsessions", "delete")}
GATEWAY = {"namespaceSelector": {"matchLabels": {"role": "gateway"}}}
EPP_ON = ("epp.enabled=true", "networkPolicy.eppFrom[0].namespaceSelector.matchLabels.role=gateway")
"""The Endpoint Picker on, with the gateway's peers its NetworkPolicy requires."""
EPP_SELECTOR = {
    "app.kubernetes.io/name": "sessionfleet",
    "app.kubernetes.io/instance": "rel",
    "app.kubernetes.io/component": "epp",
}
ALL_FEATURES: dict[str, Any] = {
    "router": {
        "autoscaling": {"enabled": True},
        "auth": {"existingSecret": "agent-api-keys"},
        "sessionQuota": {"enabled": True},
    },
    "epp": {"enabled": True},
    "agent": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "grafana": {"dashboard": {"enabled": True}},
    "prometheusRule": {"enabled": True},
    "networkPolicy": {"enabled": True, "eppFrom": [GATEWAY]},
    "defaultDrainPolicy": {"enabled": True},
    "operator": {"watchNamespaces": ["team-a", "team-b"]},
}
# epp values away from their defaults, one per flag the chart passes.
EPP_EVERY_FLAG: dict[str, Any] = {
    "enabled": True,
    "port": 9003,
    "metricsPort": 9091,
    "namespace": "inference",
    "sessionHeader": "X-Agent-Session",
    "parentHeader": "X-Agent-Parent",
    "finalHeader": "X-Agent-Final",
    "holdTimeoutSeconds": 2.5,
    "retryAfterSeconds": 2,
    "fallbacks": 0,
    "requestBodyMode": "BUFFERED",
    "responseBodyMode": "STREAMED",
    "flushIntervalSeconds": 30,
    "logLevel": "DEBUG",
    "extraArgs": ["--replica=epp-a"],
}
OPERATOR_SELECTOR = {
    "app.kubernetes.io/name": "sessionfleet",
    "app.kubernetes.io/instance": "rel",
    "app.kubernetes.io/component": "operator",
}
SHARD_LABEL = "sessionfleet.dev/shard"


def chart_peer(component: str, namespace: str = "sf") -> dict[str, Any]:
    """The NetworkPolicyPeer of one of the release's components."""
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {
            "matchLabels": {**OPERATOR_SELECTOR, "app.kubernetes.io/component": component}
        },
    }


def engine_peers_arg(*components: str, extra: tuple[dict[str, Any], ...] = ()) -> str:
    """The operator's --engine-peers flag as the chart writes it."""
    peers = [chart_peer(c) for c in components] + list(extra)
    return "--engine-peers=" + json.dumps(peers, separators=(",", ":"), sort_keys=True)


# Two operator shards; the release namespace is one of the namespaces served.
SHARDS: list[dict[str, Any]] = [
    {"name": "a", "namespaces": ["team-a", "team-b"]},
    {"name": "b", "namespaces": ["team-c", "sf"]},
]
LEADER_ELECTION_ARGS = [
    "--leader-elect",
    "--leader-election-namespace=sf",
    "--leader-election-id=rel-sessionfleet-operator",
    "--lease-duration=15s",
    "--renew-deadline=10s",
    "--retry-period=2s",
]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only  # type: ignore[no-any-return]


def assert_restricted(workload: dict[str, Any]) -> None:
    """The pod meets the restricted Pod Security Standard's rules, as configured."""
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container(workload)["securityContext"]
    assert security == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert not pod.get("hostPID") and not pod.get("hostNetwork")
    mounts = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
    assert mounts["tmp"] == "/tmp"  # the one writable place


# --- lint and schema --------------------------------------------------------------------


def test_helm_lint_strict_with_defaults_and_with_every_feature(tmp_path: Path) -> None:
    values = tmp_path / "all.yaml"
    values.write_text(yaml.safe_dump(ALL_FEATURES))
    for extra in ([], [f"--values={values}"]):
        result = helm("lint", "--strict", str(CHART), *extra)
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout


def test_helm_applies_the_schema_to_typos() -> None:
    typo = template_text("operator.replicaz=2", check=False)
    assert typo.returncode != 0
    assert "additional properties 'replicaz' not allowed" in typo.stderr
    bad = template_text("defaultDrainPolicy.spec.mode=Sometimes", check=False)
    assert bad.returncode != 0 and "/defaultDrainPolicy/spec/mode" in bad.stderr


def test_service_account_name_is_required_when_not_created() -> None:
    result = template_text("router.serviceAccount.create=false", check=False)
    assert result.returncode != 0
    assert "router.serviceAccount.name is required" in result.stderr
    objects = render(
        "router.serviceAccount.create=false", "router.serviceAccount.name=existing-router"
    )
    router = by_kind(objects, "Deployment")["rel-sessionfleet-router"]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "existing-router"
    assert "rel-sessionfleet-router" not in by_kind(objects, "ServiceAccount")


# --- defaults ---------------------------------------------------------------------------


def test_defaults_render_the_operator_router_and_crds_only() -> None:
    objects = render()
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "NetworkPolicy",  # on by default: the operator's and the router's
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        # The router's Lease creates, limited to its slots (leaseCreatePolicy).
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "rel"
        assert labels["app.kubernetes.io/part-of"] == "sessionfleet"
        assert labels["helm.sh/chart"] == f"sessionfleet-{__version__}"
    # The Endpoint Picker is off by default.
    assert not [o for o in objects if o["metadata"]["name"].endswith("-epp")]


def test_operator_deployment_two_replicas_rolling_update_probes_and_flags() -> None:
    objects = render()
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    spec = operator["spec"]
    assert spec["replicas"] == 2
    # The new pod starts as a standby before the old leader stops.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "rel-sessionfleet-operator"
    main = container(operator)
    assert main["image"] == IMAGE
    assert main["args"] == [
        "operator",
        "--metrics-port=8080",
        "--health-port=8081",
        "--idle-timeout=30m",
        "--lost-session-timeout=30m",
        "--node-not-ready-toleration=30s",
        "--max-node-recoveries=10",
        "--unhealthy-node-threshold=0.55",
        "--resync=2",
        "--full-resync=60",
        "--counter-writes=20",
        "--session-writes=16",
        "--scrape-interval=15",
        f"--sim-image={IMAGE}",
        "--checkpoint-key-secret=sf/rel-sessionfleet-checkpoint-key",
        engine_peers_arg("operator", "router"),
        *LEADER_ELECTION_ARGS,
    ]
    # POD_NAME is the replica's leader-election identity.
    assert main["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # A standby is Ready too: readiness is not leadership.
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert main["resources"]["limits"]["memory"] == "512Mi"
    assert_restricted(operator)
    metrics = by_kind(objects, "Service")["rel-sessionfleet-operator-metrics"]
    assert metrics["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert metrics["spec"]["selector"] == spec["selector"]["matchLabels"] == OPERATOR_SELECTOR


def test_operator_replicas_prefer_different_nodes_unless_affinity_is_set() -> None:
    operator = by_kind(render(), "Deployment")["rel-sessionfleet-operator"]
    # Preferred, not required: a one-node cluster still runs both replicas.
    assert operator["spec"]["template"]["spec"]["affinity"] == {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": OPERATOR_SELECTOR},
                    },
                }
            ]
        }
    }
    mine = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}
                ]
            }
        }
    }
    objects = render(values={"operator": {"affinity": mine}})
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    assert operator["spec"]["template"]["spec"]["affinity"] == mine


def test_operator_pod_disruption_budget_leaves_a_replica_and_never_blocks_on_unhealthy() -> None:
    pdb = by_kind(render(), "PodDisruptionBudget")["rel-sessionfleet-operator"]
    assert pdb["metadata"]["namespace"] == "sf"
    assert pdb["spec"] == {
        "minAvailable": 1,
        "selector": {"matchLabels": OPERATOR_SELECTOR},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    three = render("operator.replicas=3", "operator.podDisruptionBudget.minAvailable=2")
    assert (
        by_kind(three, "PodDisruptionBudget")["rel-sessionfleet-operator"]["spec"]["minAvailable"]
        == 2
    )
    # One replica: a budget of one would block every drain of its node.
    assert by_kind(render("operator.replicas=1"), "PodDisruptionBudget") == {}
    assert (
        by_kind(render("operator.podDisruptionBudget.enabled=false"), "PodDisruptionBudget") == {}
    )
    # A budget no eviction could ever meet is refused.
    hang = template_text("operator.podDisruptionBudget.minAvailable=2", check=False)
    assert hang.returncode != 0
    assert "minAvailable (2) must be less than operator.replicas (2)" in hang.stderr


def leader_role_rules(leases: list[str]) -> list[dict[str, Any]]:
    """The leader-election Role's rules: a create cannot be restricted by name;
    everything else only on the operator's Leases."""
    return [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": leases,
            "verbs": ["get", "patch"],
        },
    ]


def test_leader_election_role_grants_only_the_operators_lease() -> None:
    objects = render()
    role = by_kind(objects, "Role")["rel-sessionfleet-operator-leader"]
    assert role["metadata"]["namespace"] == "sf"
    assert role["rules"] == leader_role_rules(["rel-sessionfleet-operator"])
    binding = by_kind(objects, "RoleBinding")["rel-sessionfleet-operator-leader"]
    assert binding["metadata"]["namespace"] == "sf"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "rel-sessionfleet-operator-leader",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-sessionfleet-operator", "namespace": "sf"}
    ]
    # Apart from the Role that serving the release namespace puts there.
    served = render(values={"operator": {"watchNamespaces": ["sf"]}})
    roles = {(r["metadata"]["namespace"], name) for name, r in by_kind(served, "Role").items()}
    assert {
        ("sf", "rel-sessionfleet-operator"),
        ("sf", "rel-sessionfleet-operator-leader"),
    } <= roles


def test_leader_election_values_map_to_the_flags_and_the_role() -> None:
    objects = render(
        values={
            "operator": {
                "leaderElection": {
                    "leaseName": "fleet-leader",
                    "leaseDuration": "30s",
                    "renewDeadline": "20s",
                    "retryPeriod": "4s",
                }
            }
        }
    )
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    args = container(operator)["args"]
    assert args[args.index("--leader-elect") :] == [
        "--leader-elect",
        "--leader-election-namespace=sf",
        "--leader-election-id=fleet-leader",
        "--lease-duration=30s",
        "--renew-deadline=20s",
        "--retry-period=4s",
    ]
    role = by_kind(objects, "Role")["rel-sessionfleet-operator-leader"]
    assert role["rules"][1]["resourceNames"] == ["fleet-leader"]
    bad = template_text("operator.leaderElection.leaseDuration=15 seconds", check=False)
    assert bad.returncode != 0 and "/operator/leaderElection/leaseDuration" in bad.stderr


def test_one_replica_without_leader_election_recreates_and_has_no_lease() -> None:
    objects = render("operator.replicas=1", "operator.leaderElection.enabled=false")
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    assert operator["spec"]["replicas"] == 1
    # Nothing else keeps two operators from acting at once during a rollout.
    assert operator["spec"]["strategy"] == {"type": "Recreate"}
    args = container(operator)["args"]
    assert not [
        a for a in args if a.startswith(("--leader-elect", "--lease-", "--renew-", "--retry-"))
    ]
    # The checkpoint key's Role stays: one replica restarted must know its own checkpoints.
    roles = {"rel-sessionfleet-router", "rel-sessionfleet-operator-key"}
    assert set(by_kind(objects, "Role")) == roles
    assert set(by_kind(objects, "RoleBinding")) == roles
    assert by_kind(objects, "PodDisruptionBudget") == {}


def test_more_than_one_replica_needs_leader_election() -> None:
    result = template_text(
        "operator.replicas=2", "operator.leaderElection.enabled=false", check=False
    )
    assert result.returncode != 0
    assert "operator.replicas is 2 but operator.leaderElection.enabled is false" in result.stderr, (
        result.stderr
    )


def test_operator_values_map_to_its_flags() -> None:
    objects = render(
        values={
            "operator": {
                "idleTimeout": "2h",
                "lostSessionTimeout": "10m",
                "nodeNotReadyToleration": "1m",
                "resyncSeconds": 5,
                "fullResyncSeconds": 120,
                "counterWritesPerSecond": 50,
                "sessionWrites": 32,
                "scrapeIntervalSeconds": 30,
                "metricsPort": 9090,
                "healthPort": 9091,
                "vllmImage": "registry.example.com/vllm:1",
                "simImage": "registry.example.com/sim:1",
                "verbose": True,
                "extraArgs": ["--scrape-interval=5"],
            }
        }
    )
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    main = container(operator)
    assert main["args"] == [
        "operator",
        "--metrics-port=9090",
        "--health-port=9091",
        "--idle-timeout=2h",
        "--lost-session-timeout=10m",
        "--node-not-ready-toleration=1m",
        "--max-node-recoveries=10",
        "--unhealthy-node-threshold=0.55",
        "--resync=5",
        "--full-resync=120",
        "--counter-writes=50",
        "--session-writes=32",
        "--scrape-interval=30",
        "--sim-image=registry.example.com/sim:1",
        "--vllm-image=registry.example.com/vllm:1",
        "--checkpoint-key-secret=sf/rel-sessionfleet-checkpoint-key",
        engine_peers_arg("operator", "router"),
        *LEADER_ELECTION_ARGS,
        "--verbose",
        "--scrape-interval=5",
    ]
    assert {p["containerPort"] for p in main["ports"]} == {9090, 9091}
    # Every flag the chart passes is one `sessionfleet operator` accepts.
    from sessionfleet.cli import build_parser

    build_parser().parse_args(main["args"])


def test_the_cli_accepts_every_flag_the_chart_passes() -> None:
    from sessionfleet.cli import build_parser

    objects = render(values=ALL_FEATURES)
    deployments = by_kind(objects, "Deployment")
    for name in ("rel-sessionfleet-operator", "rel-sessionfleet-router", "rel-sessionfleet-epp"):
        args = build_parser().parse_args(container(deployments[name])["args"])
        assert args.command in ("operator", "router", "epp")
    # Every epp value that maps to a flag, set away from its default, still parses
    # into the settings the EPP runs with.
    from sessionfleet.epp.cli import settings_from_args

    epp = by_kind(
        render(values={"epp": EPP_EVERY_FLAG, "networkPolicy": {"eppFrom": [GATEWAY]}}),
        "Deployment",
    )["rel-sessionfleet-epp"]
    args = build_parser().parse_args(container(epp)["args"])
    assert args.command == "epp"
    assert (args.port, args.metrics_port, args.namespace) == (9003, 9091, "inference")
    assert (args.hold_timeout, args.retry_after, args.fallbacks) == (2.5, 2, 0)
    assert (args.request_body_mode, args.response_body_mode) == ("BUFFERED", "STREAMED")
    assert args.session_header == "X-Agent-Session"
    assert args.replica == "epp-a"  # from extraArgs
    settings = settings_from_args(args)
    assert settings.namespace == "inference"
    assert settings.hold_timeout == 2.5 and settings.flush_interval == 30
    assert settings.picker.fallbacks == 0 and settings.picker.retry_after == 2


def test_image_digest_wins_over_the_tag() -> None:
    digest = "sha256:" + "ab" * 32
    objects = render(f"image.digest={digest}", "image.tag=9.9.9")
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    assert container(operator)["image"] == f"ghcr.io/sessionfleet/sessionfleet@{digest}"


def test_long_release_names_give_valid_object_names() -> None:
    release = "a-very-long-release-name-for-a-team-with-long-names"
    for obj in render(release=release):
        name = obj["metadata"]["name"]
        if obj["kind"] != "CustomResourceDefinition":
            assert len(name) <= 63 and name.startswith(release[:40]), name
            assert not name.startswith("-") and "--" not in name


# --- CRDs -------------------------------------------------------------------------------


def test_crd_templates_render_the_generated_crds_with_keep() -> None:
    rendered = by_kind(render(), "CustomResourceDefinition")
    committed = {
        doc["metadata"]["name"]: doc
        for path in sorted((REPO_ROOT / "crds").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    }
    assert set(rendered) == set(committed) and len(rendered) == 4
    for name, crd in rendered.items():
        assert crd["spec"] == committed[name]["spec"], name
        assert crd["metadata"]["annotations"] == {
            "helm.sh/resource-policy": "keep",
            "argocd.argoproj.io/sync-options": "Delete=false",
        }
        assert crd["metadata"]["labels"]["app.kubernetes.io/part-of"] == "sessionfleet"
        assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_crds_can_be_left_out_or_not_kept() -> None:
    assert by_kind(render("crds.enabled=false"), "CustomResourceDefinition") == {}
    for crd in by_kind(render("crds.keep=false"), "CustomResourceDefinition").values():
        assert "annotations" not in crd["metadata"]


# --- RBAC -------------------------------------------------------------------------------


def test_cluster_wide_operator_gets_exactly_its_rules() -> None:
    objects = render()
    role = by_kind(objects, "ClusterRole")["rel-sessionfleet-operator"]
    assert rules(role) == OPERATOR_NAMESPACED | OPERATOR_CLUSTER
    binding = by_kind(objects, "ClusterRoleBinding")["rel-sessionfleet-operator"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-sessionfleet-operator", "namespace": "sf"}
    ]
    # The only namespaced Roles by default are the router's, the operator's Lease's and
    # the operator's checkpoint key's.
    assert set(by_kind(objects, "Role")) == {
        "rel-sessionfleet-router",
        "rel-sessionfleet-operator-leader",
        "rel-sessionfleet-operator-key",
    }


def test_the_operator_may_read_only_its_checkpoint_key_secret() -> None:
    objects = render(values={"operator": {"shards": SHARDS}})
    role = by_kind(objects, "Role")["rel-sessionfleet-operator-key"]
    assert role["metadata"]["namespace"] == "sf"
    # A create cannot be scoped by name; reads are, to the one Secret every shard shares.
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["rel-sessionfleet-checkpoint-key"],
            "verbs": ["get"],
        },
    ]
    binding = by_kind(objects, "RoleBinding")["rel-sessionfleet-operator-key"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-sessionfleet-operator", "namespace": "sf"}
    ]
    for operator in operator_deployments(objects).values():
        args = container(operator)["args"]
        assert "--checkpoint-key-secret=sf/rel-sessionfleet-checkpoint-key" in args
    # No other Role or ClusterRole of the operator touches Secrets.
    for kind in ("Role", "ClusterRole"):
        for name, other in by_kind(objects, kind).items():
            if name.startswith("rel-sessionfleet-operator") and name != role["metadata"]["name"]:
                assert not [r for r in rules(other) if r[1] == "secrets"], name


def test_watch_namespaces_moves_the_operators_rules_into_roles() -> None:
    objects = render(values={"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    cluster = by_kind(objects, "ClusterRole")["rel-sessionfleet-operator"]
    assert rules(cluster) == OPERATOR_CLUSTER | {
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    roles = [
        o for o in objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-operator")
    ]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert rules(role) == OPERATOR_NAMESPACED
    bindings = [
        o
        for o in objects
        if o["kind"] == "RoleBinding" and o["metadata"]["name"].endswith("-operator")
    ]
    assert {b["metadata"]["namespace"] for b in bindings} == {"team-a", "team-b"}
    for binding in bindings:
        assert binding["subjects"][0]["namespace"] == "sf"
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    assert "--namespace=team-a" in container(operator)["args"]
    assert "--namespace=team-b" in container(operator)["args"]


def test_router_role_lives_in_the_namespace_it_serves() -> None:
    objects = render("router.namespace=inference")
    role = by_kind(objects, "Role")["rel-sessionfleet-router"]
    assert role["metadata"]["namespace"] == "inference"
    assert rules(role) == ROUTER
    binding = by_kind(objects, "RoleBinding")["rel-sessionfleet-router"]
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["subjects"][0] == {
        "kind": "ServiceAccount",
        "name": "rel-sessionfleet-router",
        "namespace": "sf",
    }
    router = by_kind(objects, "Deployment")["rel-sessionfleet-router"]
    assert "--namespace=inference" in container(router)["args"]


# --- operator shards --------------------------------------------------------------------


def shard_selector(shard: str) -> dict[str, str]:
    """The labels that select one operator shard's pods."""
    return {**OPERATOR_SELECTOR, SHARD_LABEL: shard}


def operator_deployments(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The operator's Deployments (one, or one per shard), by name."""
    return {
        name: deployment
        for name, deployment in by_kind(objects, "Deployment").items()
        if name.startswith("rel-sessionfleet-operator")
    }


def by_kind_in_namespaces(
    objects: list[dict[str, Any]], kind: str
) -> dict[tuple[str, str], dict[str, Any]]:
    """Namespaced objects of one kind, by (namespace, name): one name may be in many."""
    return {
        (o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects if o["kind"] == kind
    }


def test_helm_lint_strict_with_shards(tmp_path: Path) -> None:
    values = tmp_path / "shards.yaml"
    values.write_text(yaml.safe_dump({"operator": {"shards": SHARDS}}))
    result = helm("lint", "--strict", str(CHART), f"--values={values}")
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout


def test_two_shards_render_a_deployment_each_with_its_namespaces_lease_and_label() -> None:
    from sessionfleet.cli import build_parser

    objects = render(values={"operator": {"shards": SHARDS}})
    deployments = operator_deployments(objects)
    assert set(deployments) == {"rel-sessionfleet-operator-a", "rel-sessionfleet-operator-b"}
    for shard in SHARDS:
        name = shard["name"]
        operator = deployments[f"rel-sessionfleet-operator-{name}"]
        spec = operator["spec"]
        assert spec["replicas"] == 2
        assert operator["metadata"]["labels"][SHARD_LABEL] == name
        assert spec["selector"]["matchLabels"] == shard_selector(name)
        pod_labels = spec["template"]["metadata"]["labels"]
        assert shard_selector(name).items() <= pod_labels.items()
        term = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ][0]["podAffinityTerm"]
        assert term["labelSelector"] == {"matchLabels": shard_selector(name)}
        # The shards share the one ServiceAccount.
        assert spec["template"]["spec"]["serviceAccountName"] == "rel-sessionfleet-operator"
        args = container(operator)["args"]
        assert [a for a in args if a.startswith("--namespace=")] == [
            f"--namespace={namespace}" for namespace in shard["namespaces"]
        ]
        assert args[args.index("--leader-elect") :] == [
            "--leader-elect",
            "--leader-election-namespace=sf",
            f"--leader-election-id=rel-sessionfleet-operator-{name}",
            "--lease-duration=15s",
            "--renew-deadline=10s",
            "--retry-period=2s",
        ]
        parsed = build_parser().parse_args(args)
        assert parsed.namespace == shard["namespaces"]
        assert parsed.leader_election_id == f"rel-sessionfleet-operator-{name}"
        assert_restricted(operator)
    # Disjoint selectors: neither shard's Deployment selects the other's pods.
    a, b = (deployments[f"rel-sessionfleet-operator-{s}"] for s in ("a", "b"))
    for mine, other in ((a, b), (b, a)):
        selector = mine["spec"]["selector"]["matchLabels"]
        other_pods = other["spec"]["template"]["metadata"]["labels"]
        assert not selector.items() <= other_pods.items()
    # The one metrics Service selects the pods of every shard.
    metrics = by_kind(objects, "Service")["rel-sessionfleet-operator-metrics"]
    assert metrics["spec"]["selector"] == OPERATOR_SELECTOR
    assert "rel-sessionfleet-operator" in by_kind(objects, "ServiceAccount")


def test_shard_leases_follow_the_lease_name() -> None:
    objects = render(
        values={"operator": {"shards": SHARDS, "leaderElection": {"leaseName": "fleet-leader"}}}
    )
    for name in ("a", "b"):
        args = container(operator_deployments(objects)[f"rel-sessionfleet-operator-{name}"])["args"]
        assert f"--leader-election-id=fleet-leader-{name}" in args
    role = by_kind(objects, "Role")["rel-sessionfleet-operator-leader"]
    assert role["rules"][1]["resourceNames"] == ["fleet-leader-a", "fleet-leader-b"]


def test_each_shard_has_its_own_pod_disruption_budget() -> None:
    budgets = by_kind(render(values={"operator": {"shards": SHARDS}}), "PodDisruptionBudget")
    assert set(budgets) == {"rel-sessionfleet-operator-a", "rel-sessionfleet-operator-b"}
    for name in ("a", "b"):
        pdb = budgets[f"rel-sessionfleet-operator-{name}"]
        assert pdb["metadata"]["namespace"] == "sf"
        assert pdb["metadata"]["labels"][SHARD_LABEL] == name
        assert pdb["spec"] == {
            "minAvailable": 1,
            "selector": {"matchLabels": shard_selector(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        }
    # One replica a shard: no budget, as without shards.
    one = render("operator.replicas=1", values={"operator": {"shards": SHARDS}})
    assert by_kind(one, "PodDisruptionBudget") == {}
    assert {d["spec"]["replicas"] for d in operator_deployments(one).values()} == {1}


def test_with_shards_the_operators_series_carry_their_shard_for_the_leader_alerts() -> None:
    values = {"operator": {"shards": SHARDS}, "serviceMonitor": {"enabled": True}}
    monitors = by_kind(render(values=values), "ServiceMonitor")
    assert monitors["rel-sessionfleet-operator"]["spec"]["podTargetLabels"] == [SHARD_LABEL]
    assert "podTargetLabels" not in monitors["rel-sessionfleet-router"]["spec"]


def test_shards_put_the_operators_roles_in_their_namespaces_and_nowhere_else() -> None:
    objects = render(values={"operator": {"shards": SHARDS}})
    cluster = by_kind(objects, "ClusterRole")["rel-sessionfleet-operator"]
    assert rules(cluster) == OPERATOR_CLUSTER | {
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    served = {"team-a", "team-b", "team-c", "sf"}
    operator = "rel-sessionfleet-operator"
    roles = {
        key: role
        for key, role in by_kind_in_namespaces(objects, "Role").items()
        if key[1].startswith(operator)
    }
    # Besides the Lease's Role, the operator's Role in each shard namespace, no other.
    assert set(roles) == {(namespace, operator) for namespace in served} | {
        ("sf", f"{operator}-leader"),
        ("sf", f"{operator}-key"),
    }
    for namespace in served:
        assert rules(roles[(namespace, operator)]) == OPERATOR_NAMESPACED
    bindings = {
        key: binding
        for key, binding in by_kind_in_namespaces(objects, "RoleBinding").items()
        if key[1] == operator
    }
    assert set(bindings) == {(namespace, operator) for namespace in served}
    for binding in bindings.values():
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": operator, "namespace": "sf"}
        ]


def test_leader_election_role_grants_every_shards_lease_and_only_those() -> None:
    objects = render(values={"operator": {"shards": SHARDS}})
    role = by_kind(objects, "Role")["rel-sessionfleet-operator-leader"]
    assert role["metadata"]["namespace"] == "sf"
    assert role["rules"] == leader_role_rules(
        ["rel-sessionfleet-operator-a", "rel-sessionfleet-operator-b"]
    )
    # One replica a shard without leader election: no Lease, no leader Role.
    alone = render(
        "operator.replicas=1",
        "operator.leaderElection.enabled=false",
        values={"operator": {"shards": SHARDS}},
    )
    assert "rel-sessionfleet-operator-leader" not in by_kind(alone, "Role")
    for operator in operator_deployments(alone).values():
        assert operator["spec"]["strategy"] == {"type": "Recreate"}
        assert not [a for a in container(operator)["args"] if a.startswith("--leader-")]


@pytest.mark.parametrize(
    ("values", "sets", "message"),
    [
        pytest.param(
            {"shards": SHARDS, "watchNamespaces": ["team-z"]},
            (),
            "operator.shards and operator.watchNamespaces are both set: use one or the other",
            id="shards-and-watch-namespaces",
        ),
        pytest.param(
            {"shards": [SHARDS[0], {**SHARDS[1], "name": "a"}]},
            (),
            'operator.shards: two shards are named "a"',
            id="same-name",
        ),
        pytest.param(
            {"shards": [SHARDS[0], {"name": "b", "namespaces": ["team-c", "team-b"]}]},
            (),
            'operator.shards: namespace "team-b" is in shard "a" and in shard "b"',
            id="namespace-in-two-shards",
        ),
        pytest.param(
            {"shards": SHARDS},
            ("operator.leaderElection.enabled=false",),
            "operator.replicas is 2 but operator.leaderElection.enabled is false: every shard",
            id="replicas-without-leader-election",
        ),
        pytest.param(
            {"shards": [{"name": "a" * 20, "namespaces": ["team-a"]}]},
            ("fullnameOverride=" + "f" * 40,),
            f'the Deployment of shard "{"a" * 20}", "{"f" * 40}-operator-{"a" * 20}", '
            "is longer than 63 characters",
            id="deployment-name-too-long",
        ),
    ],
)
def test_shards_that_would_overlap_fail_rendering_with_a_reason(
    values: dict[str, Any], sets: tuple[str, ...], message: str
) -> None:
    result = template_text(*sets, values={"operator": values}, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        pytest.param(
            [{"name": "a", "namespaces": []}],
            "at '/operator/shards/0/namespaces': minItems: got 0, want 1",
            id="no-namespaces",
        ),
        pytest.param(
            [{"name": "a"}],
            "at '/operator/shards/0': missing property 'namespaces'",
            id="namespaces-missing",
        ),
        pytest.param(
            [{"name": "a", "namespaces": ["team-a", "team-a"]}],
            "at '/operator/shards/0/namespaces'",
            id="namespace-twice-in-one-shard",
        ),
        pytest.param(
            [{"name": "Team_A", "namespaces": ["team-a"]}],
            "at '/operator/shards/0/name': 'Team_A' does not match pattern",
            id="name-not-a-dns-label",
        ),
        pytest.param(
            [{"name": "a" * 21, "namespaces": ["team-a"]}],
            "at '/operator/shards/0/name': maxLength: got 21, want 20",
            id="name-too-long",
        ),
        pytest.param(
            [{"name": "a", "namespaces": ["team-a"], "replicas": 3}],
            "additional properties 'replicas' not allowed",
            id="unknown-key",
        ),
    ],
)
def test_the_schema_refuses_malformed_shards(shards: list[dict[str, Any]], message: str) -> None:
    result = template_text(values={"operator": {"shards": shards}}, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_a_shard_without_namespaces_fails_even_without_the_schema() -> None:
    result = helm(
        "template",
        "rel",
        str(CHART),
        "--namespace=sf",
        f"--kube-version={K8S_VERSION}",
        "--skip-schema-validation",
        *set_args({"operator": {"shards": [{"name": "a", "namespaces": []}]}}, ()),
        check=False,
    )
    assert result.returncode != 0
    assert 'operator.shards: shard "a" has no namespaces' in result.stderr, result.stderr


def test_without_shards_nothing_carries_a_shard_label() -> None:
    for values in ({}, ALL_FEATURES):
        text = template_text(values=values).stdout
        assert SHARD_LABEL not in text
    deployments = operator_deployments(render())
    assert set(deployments) == {"rel-sessionfleet-operator"}


# --- router -----------------------------------------------------------------------------


def test_router_limits_authentication_and_session_quota() -> None:
    objects = render(
        values={
            "router": {
                "maxInflightBodyBytes": 100_000_000,
                "maxHeaderBytes": 65536,
                "maxInflightHeaderBytes": 33_554_432,
                "idleTimeoutSeconds": 15,
                "newSessions": {"perClient": 5, "burst": 50},
                "trustedProxies": ["10.0.0.0/8", "fd00::/8"],
                "auth": {"existingSecret": "agent-api-keys"},
                "sessionQuota": {"enabled": True, "maxSessions": 5000},
            }
        }
    )
    router = by_kind(objects, "Deployment")["rel-sessionfleet-router"]
    args = container(router)["args"]
    for flag in (
        "--max-inflight-body-bytes=100000000",
        "--max-header-bytes=65536",
        "--max-inflight-header-bytes=33554432",
        "--idle-timeout=15",
        "--new-sessions-per-client=5",
        "--new-sessions-burst=50",
        "--api-keys-dir=/etc/sessionfleet/api-keys",
        "--trusted-proxy=10.0.0.0/8",
        "--trusted-proxy=fd00::/8",
    ):
        assert flag in args
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "agent-api-keys"
    mounts = {m["name"]: m for m in container(router)["volumeMounts"]}
    assert mounts["api-keys"] == {
        "name": "api-keys",
        "mountPath": "/etc/sessionfleet/api-keys",
        "readOnly": True,
    }
    quota = by_kind(objects, "ResourceQuota")["rel-sessionfleet-agentsessions"]
    assert quota["spec"]["hard"] == {"count/agentsessions.sessionfleet.dev": "5000"}
    # Off by default: no keys, no quota.
    defaults = render()
    assert "ResourceQuota" not in {o["kind"] for o in defaults}
    default_args = container(by_kind(defaults, "Deployment")["rel-sessionfleet-router"])["args"]
    assert not [a for a in default_args if a.startswith(("--api-keys-dir", "--trusted-proxy"))]
    assert "--max-body-bytes=8388608" in default_args


def test_router_deployment_service_and_flags() -> None:
    objects = render(
        values={
            "router": {
                "replicas": 3,
                "port": 8000,
                "sessionHeader": "X-Agent-Session",
                "flushIntervalSeconds": 30,
                "maxBodyBytes": 134217728,
                "logLevel": "DEBUG",
                "service": {"type": "LoadBalancer", "port": 8000},
            }
        }
    )
    router = by_kind(objects, "Deployment")["rel-sessionfleet-router"]
    assert router["spec"]["replicas"] == 3
    main = container(router)
    args = main["args"]
    assert args[:4] == ["router", "--host=0.0.0.0", "--port=8000", "--namespace=sf"]
    for flag in (
        "--session-header=X-Agent-Session",
        "--flush-interval=30",
        "--max-body-bytes=134217728",
        "--log-level=DEBUG",
    ):
        assert flag in args
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert main["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert_restricted(router)
    service = by_kind(objects, "Service")["rel-sessionfleet-router"]
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"][0] == {
        "name": "http",
        "port": 8000,
        "targetPort": "http",
        "protocol": "TCP",
    }


def test_router_autoscaling_replaces_the_replica_count() -> None:
    objects = render("router.autoscaling.enabled=true", "router.autoscaling.maxReplicas=20")
    router = by_kind(objects, "Deployment")["rel-sessionfleet-router"]
    assert "replicas" not in router["spec"]
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["rel-sessionfleet-router"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "rel-sessionfleet-router",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 20)
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 70


def test_router_can_be_turned_off() -> None:
    objects = render("router.enabled=false", "serviceMonitor.enabled=true")
    assert not [o for o in objects if "router" in o["metadata"]["name"]]


# --- Endpoint Picker --------------------------------------------------------------------


def test_epp_deployment_service_probes_and_flags() -> None:
    objects = render(*EPP_ON)
    epp = by_kind(objects, "Deployment")["rel-sessionfleet-epp"]
    assert epp["metadata"]["namespace"] == "sf"
    spec = epp["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert spec["selector"]["matchLabels"] == EPP_SELECTOR
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "rel-sessionfleet-epp"
    main = container(epp)
    assert main["image"] == IMAGE
    assert main["args"] == [
        "epp",
        "--host=0.0.0.0",
        "--port=9002",
        "--health-port=9003",
        "--metrics-port=9090",
        "--namespace=sf",
        "--lease-prefix=rel-sessionfleet-epp",
        "--lease-slots=8",
        "--session-header=X-Session-Id",
        "--parent-header=X-Parent-Session-Id",
        "--final-header=X-Session-Final",
        "--hold-timeout=0",
        "--retry-after=5",
        "--fallbacks=0",
        "--request-body-mode=FULL_DUPLEX_STREAMED",
        "--response-body-mode=FULL_DUPLEX_STREAMED",
        "--mode-probe-seconds=0.1",
        "--max-body-bytes=8388608",
        "--max-inflight-body-bytes=201326592",
        "--flush-interval=10",
        "--unobserved-turn-seconds=120",
        "--log-level=INFO",
    ]
    # The chart's defaults are the CLI's: a chart with no epp values runs the EPP as
    # `sessionfleet epp` alone would.
    from sessionfleet.cli import build_parser

    parsed = build_parser().parse_args(main["args"])
    bare = build_parser().parse_args(["epp"])
    for flag in (
        "port",
        "metrics_port",
        "hold_timeout",
        "retry_after",
        "fallbacks",
        "unobserved_turn_seconds",
        "pool_name",
        "health_port",
        "secure_serving",
        "cert_path",
        "mode_probe_seconds",
        "max_body_bytes",
        "max_inflight_body_bytes",
    ):
        assert getattr(parsed, flag) == getattr(bare, flag), flag
    assert main["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    assert {p["name"]: p["containerPort"] for p in main["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    # gRPC probes on the EPP protocol's health service names, on the plaintext port.
    assert main["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert main["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert_restricted(epp)
    service = by_kind(objects, "Service")["rel-sessionfleet-epp"]
    assert service["metadata"]["namespace"] == "sf"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == EPP_SELECTOR
    assert service["spec"]["ports"] == [
        {
            "name": "grpc",
            "port": 9002,
            "targetPort": "grpc",
            "protocol": "TCP",
            "appProtocol": "grpc",
        },
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"},
    ]
    assert "rel-sessionfleet-epp" in by_kind(objects, "ServiceAccount")


def test_epp_role_grants_exactly_what_the_epp_calls() -> None:
    objects = render(*EPP_ON)
    role = by_kind(objects, "Role")["rel-sessionfleet-epp"]
    assert rules(role) == EPP
    binding = by_kind(objects, "RoleBinding")["rel-sessionfleet-epp"]
    assert binding["roleRef"]["name"] == "rel-sessionfleet-epp"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-sessionfleet-epp", "namespace": "sf"}
    ]
    assert not [o for o in by_kind(objects, "ClusterRole") if o.endswith("-epp")]


def test_epp_pool_name_adds_the_flag_and_read_access_to_pools_and_pods() -> None:
    objects = render(*EPP_ON, "epp.poolName=agents")
    args = container(by_kind(objects, "Deployment")["rel-sessionfleet-epp"])["args"]
    assert "--pool-name=agents" in args
    role = by_kind(objects, "Role")["rel-sessionfleet-epp"]
    assert rules(role) - EPP == {
        ("inference.networking.k8s.io", "inferencepools", "get"),
        ("inference.networking.k8s.io", "inferencepools", "list"),
        ("inference.networking.k8s.io", "inferencepools", "watch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
    }
    assert EPP <= rules(role)


def test_epp_tls_from_a_secret_or_off() -> None:
    default = container(by_kind(render(*EPP_ON), "Deployment")["rel-sessionfleet-epp"])
    assert not [a for a in default["args"] if "secure-serving" in a or "cert-path" in a]
    objects = render(*EPP_ON, "epp.tls.secretName=epp-tls")
    epp = by_kind(objects, "Deployment")["rel-sessionfleet-epp"]
    main = container(epp)
    assert "--cert-path=/etc/sessionfleet/epp-tls" in main["args"]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["tls"] == {
        "name": "tls",
        "mountPath": "/etc/sessionfleet/epp-tls",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in epp["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "epp-tls"}
    plain = render(*EPP_ON, "epp.tls.enabled=false", "epp.tls.secretName=epp-tls")
    main = container(by_kind(plain, "Deployment")["rel-sessionfleet-epp"])
    assert "--no-secure-serving" in main["args"]
    assert "tls" not in {m["name"] for m in main["volumeMounts"]}
    # The flags the chart renders parse as the EPP's own.
    from sessionfleet.cli import build_parser

    parsed = build_parser().parse_args(main["args"])
    assert parsed.secure_serving is False


def test_epp_lives_in_the_namespace_it_serves() -> None:
    # An InferencePool names its EPP Service in its own namespace: every EPP object goes
    # where the InferencePool and the workers are.
    for sets, namespace in (
        (["epp.namespace=inference"], "inference"),
        (["router.namespace=team-a"], "team-a"),
        (["router.namespace=team-a", "epp.namespace=inference"], "inference"),
    ):
        objects = render(*EPP_ON, "serviceMonitor.enabled=true", *sets)
        mine = [o for o in objects if o["metadata"]["name"] == "rel-sessionfleet-epp"]
        assert {o["kind"] for o in mine} == {
            "ServiceAccount",
            "Deployment",
            "Service",
            "Role",
            "RoleBinding",
            "PodDisruptionBudget",
            "ServiceMonitor",
            "NetworkPolicy",
        }
        assert {o["metadata"]["namespace"] for o in mine} == {namespace}
        epp = by_kind(objects, "Deployment")["rel-sessionfleet-epp"]
        assert f"--namespace={namespace}" in container(epp)["args"]
        binding = by_kind(objects, "RoleBinding")["rel-sessionfleet-epp"]
        assert binding["subjects"][0]["namespace"] == namespace
        monitor = by_kind(objects, "ServiceMonitor")["rel-sessionfleet-epp"]
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [namespace]}


def test_epp_pod_disruption_budget_only_with_more_than_one_replica() -> None:
    pdb = by_kind(render(*EPP_ON), "PodDisruptionBudget")["rel-sessionfleet-epp"]
    assert pdb["spec"] == {
        "minAvailable": 1,
        "selector": {"matchLabels": EPP_SELECTOR},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    three = render(*EPP_ON, "epp.replicas=3", "epp.podDisruptionBudget.minAvailable=2")
    assert (
        by_kind(three, "PodDisruptionBudget")["rel-sessionfleet-epp"]["spec"]["minAvailable"] == 2
    )
    one = render(*EPP_ON, "epp.replicas=1")
    assert "rel-sessionfleet-epp" not in by_kind(one, "PodDisruptionBudget")
    assert by_kind(one, "Deployment")["rel-sessionfleet-epp"]["spec"]["replicas"] == 1
    off = render(*EPP_ON, "epp.podDisruptionBudget.enabled=false")
    assert "rel-sessionfleet-epp" not in by_kind(off, "PodDisruptionBudget")
    hang = template_text(*EPP_ON, "epp.podDisruptionBudget.minAvailable=2", check=False)
    assert hang.returncode != 0
    assert "minAvailable (2) must be less than epp.replicas (2)" in hang.stderr


def test_epp_without_metrics_port_has_no_metrics_port_or_monitor() -> None:
    objects = render(
        *EPP_ON,
        "epp.metricsPort=0",
        "serviceMonitor.enabled=true",
        "networkPolicy.enabled=true",
    )
    epp = by_kind(objects, "Deployment")["rel-sessionfleet-epp"]
    assert "--metrics-port=0" in container(epp)["args"]
    assert [p["name"] for p in container(epp)["ports"]] == ["grpc", "grpc-health"]
    service = by_kind(objects, "Service")["rel-sessionfleet-epp"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]
    assert "rel-sessionfleet-epp" not in by_kind(objects, "ServiceMonitor")
    policy = by_kind(objects, "NetworkPolicy")["rel-sessionfleet-epp"]
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": "grpc", "protocol": "TCP"}], "from": [GATEWAY]}
    ]


def test_epp_scheduling_pod_metadata_and_service_account_follow_values() -> None:
    toleration = {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}
    objects = render(
        values={
            "epp": {
                "enabled": True,
                "replicas": 3,
                "nodeSelector": {"kubernetes.io/os": "linux"},
                "tolerations": [toleration],
                "affinity": affinity,
                "priorityClassName": "high-priority",
                "podAnnotations": {"prometheus.io/scrape": "true"},
                "podLabels": {"team": "inference"},
                "resources": {"requests": {"cpu": "1"}},
                "serviceAccount": {"create": False, "name": "gateway-epp"},
            },
            "networkPolicy": {"enabled": True, "eppFrom": [peer]},
        }
    )
    epp = by_kind(objects, "Deployment")["rel-sessionfleet-epp"]
    assert epp["spec"]["replicas"] == 3
    template = epp["spec"]["template"]
    pod = template["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"] == [toleration]
    assert pod["affinity"] == affinity
    assert pod["priorityClassName"] == "high-priority"
    assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    assert template["metadata"]["labels"]["team"] == "inference"
    assert container(epp)["resources"]["requests"]["cpu"] == "1"
    assert pod["serviceAccountName"] == "gateway-epp"
    assert "rel-sessionfleet-epp" not in by_kind(objects, "ServiceAccount")
    binding = by_kind(objects, "RoleBinding")["rel-sessionfleet-epp"]
    assert binding["subjects"][0]["name"] == "gateway-epp"
    policy = by_kind(objects, "NetworkPolicy")["rel-sessionfleet-epp"]
    assert policy["spec"]["ingress"][0]["from"] == [peer]
    missing = template_text(*EPP_ON, "epp.serviceAccount.create=false", check=False)
    assert missing.returncode != 0
    assert "epp.serviceAccount.name is required" in missing.stderr


def test_gateway_example_names_the_charts_epp_service() -> None:
    """examples/gateway/inferencepool.yaml points at what `helm install sessionfleet` makes."""
    example = REPO_ROOT / "examples" / "gateway" / "inferencepool.yaml"
    (pool,) = [
        doc
        for doc in yaml.safe_load_all(example.read_text())
        if doc and doc["kind"] == "InferencePool"
    ]
    objects = render(*EPP_ON, release="sessionfleet", namespace="inference")
    service = by_kind(objects, "Service")[pool["spec"]["endpointPickerRef"]["name"]]
    # Applied with -n in the namespace the EPP serves, which holds its Service.
    assert "namespace" not in pool["metadata"]
    assert service["metadata"]["namespace"] == "inference"
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": grpc["port"]}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


# --- node agent -------------------------------------------------------------------------


def test_agent_is_off_by_default_and_unprivileged_without_criu() -> None:
    assert by_kind(render(), "DaemonSet") == {}
    objects = render("agent.enabled=true")
    agent = by_kind(objects, "DaemonSet")["rel-sessionfleet-agent"]
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["automountServiceAccountToken"] is False
    assert container(agent)["args"] == [
        "agent",
        "--port=9400",
        "--storage-root=/var/lib/sessionfleet/checkpoints",
    ]
    # Prometheus reaches it at the pod IP; a hostPort only with criu (restricted PSS).
    assert container(agent)["ports"] == [{"name": "http", "containerPort": 9400, "protocol": "TCP"}]
    # It serves HTTPS always (a certificate it makes at start); the kubelet's probes do
    # not verify it.
    assert container(agent)["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": "http",
        "scheme": "HTTPS",
    }
    assert container(agent)["livenessProbe"]["httpGet"] == {
        "path": "/healthz",
        "port": "http",
        "scheme": "HTTPS",
    }
    assert_restricted(agent)
    account = by_kind(objects, "ServiceAccount")["rel-sessionfleet-agent"]
    assert account["automountServiceAccountToken"] is False
    # No RBAC at all for an agent that authenticates nobody (telemetry alone).
    for kind in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"):
        assert not [name for name in by_kind(objects, kind) if "agent" in name]


def test_only_the_criu_agent_is_privileged() -> None:
    objects = render("agent.enabled=true", "agent.criu=true")
    agent = by_kind(objects, "DaemonSet")["rel-sessionfleet-agent"]
    assert container(agent)["securityContext"]["privileged"] is True
    assert agent["spec"]["template"]["spec"]["hostPID"] is True
    # The operator calls the agent of a worker's node at its InternalIP.
    assert container(agent)["ports"][0]["hostPort"] == 9400
    for workload in objects:
        if workload["kind"] in ("Deployment", "DaemonSet") and workload is not agent:
            assert_restricted(workload)
    assert not [a for a in container(agent)["args"] if a.startswith("--token-file")]


def test_by_default_the_criu_agents_take_a_token_for_their_node_alone() -> None:
    """Without agent.tokenSecret: the operator requests a token of its own ServiceAccount
    per node (TokenRequest, on that ServiceAccount alone) and each agent checks it with
    a TokenReview (its only right, with a mounted token for it)."""
    objects = render(
        "agent.enabled=true",
        "agent.criu=true",
        "agent.metricsReaders={system:serviceaccount:monitoring:prometheus}",
    )
    agent = by_kind(objects, "DaemonSet")["rel-sessionfleet-agent"]
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    operator_user = "system:serviceaccount:sf:rel-sessionfleet-operator"
    assert container(agent)["args"] == [
        "agent",
        "--port=9400",
        "--storage-root=/var/lib/sessionfleet/checkpoints",
        f"--operator={operator_user}",
        "--metrics-reader=system:serviceaccount:monitoring:prometheus",
    ]
    assert agent["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    env = {e["name"]: e for e in container(agent)["env"]}
    assert env["HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert {"--agent-service-account=sf/rel-sessionfleet-operator", "--agent-port=9400"} <= set(
        container(operator)["args"]
    )
    assert not [a for a in container(operator)["args"] if a.startswith("--agent-token-file")]
    assert "agent-token" not in {v["name"] for v in operator["spec"]["template"]["spec"]["volumes"]}
    reviewer = by_kind(objects, "ClusterRole")["rel-sessionfleet-agent"]
    assert rules(reviewer) == {("authentication.k8s.io", "tokenreviews", "create")}
    binding = by_kind(objects, "ClusterRoleBinding")["rel-sessionfleet-agent"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-sessionfleet-agent", "namespace": "sf"}
    ]
    minter = by_kind(objects, "Role")["rel-sessionfleet-operator-agent-tokens"]
    assert minter["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["serviceaccounts/token"],
            "resourceNames": ["rel-sessionfleet-operator"],
            "verbs": ["create"],
        }
    ]
    assert by_kind(objects, "RoleBinding")["rel-sessionfleet-operator-agent-tokens"][
        "subjects"
    ] == [{"kind": "ServiceAccount", "name": "rel-sessionfleet-operator", "namespace": "sf"}]


def test_the_agents_certificate_from_a_secret_is_verified_by_the_operator() -> None:
    objects = render("agent.enabled=true", "agent.criu=true", "agent.tls.secret=agent-tls")
    agent = by_kind(objects, "DaemonSet")["rel-sessionfleet-agent"]
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    assert {
        "--tls-cert-file=/etc/sessionfleet/agent-tls/tls.crt",
        "--tls-key-file=/etc/sessionfleet/agent-tls/tls.key",
    } <= set(container(agent)["args"])
    assert "--agent-ca-file=/etc/sessionfleet/agent-tls/ca.crt" in container(operator)["args"]
    for workload, keys in ((agent, ["tls.crt", "tls.key"]), (operator, ["ca.crt"])):
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["agent-tls"]["secret"] == {
            "secretName": "agent-tls",
            "items": [{"key": k, "path": k} for k in keys],
        }, "the operator never holds the agents' private key"


def test_the_operator_calls_the_criu_agents_with_their_token() -> None:
    objects = render(
        "agent.enabled=true",
        "agent.criu=true",
        "agent.tokenSecret=agent-token",
        "agent.port=9401",
        "agent.storage.path=/mnt/checkpoints",
        "agent.storage.volume.persistentVolumeClaim.claimName=checkpoints",
    )
    agent = by_kind(objects, "DaemonSet")["rel-sessionfleet-agent"]
    operator = by_kind(objects, "Deployment")["rel-sessionfleet-operator"]
    token = "/etc/sessionfleet/agent-token/token"
    assert container(agent)["args"] == [
        "agent",
        "--port=9401",
        "--storage-root=/mnt/checkpoints",
        f"--token-file={token}",
    ]
    assert container(agent)["ports"][0] == {
        "name": "http",
        "containerPort": 9401,
        "hostPort": 9401,
        "protocol": "TCP",
    }
    assert {f"--agent-token-file={token}", "--agent-port=9401"} <= set(container(operator)["args"])
    for workload in (agent, operator):
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["agent-token"]["secret"] == {
            "secretName": "agent-token",
            "items": [{"key": "token", "path": "token"}],
        }
        mounts = {m["name"]: m for m in container(workload)["volumeMounts"]}
        assert mounts["agent-token"]["mountPath"] == "/etc/sessionfleet/agent-token"
    volumes = {v["name"]: v for v in agent["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"] == {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": "checkpoints"},
    }
    mounts = {m["name"]: m["mountPath"] for m in container(agent)["volumeMounts"]}
    assert mounts["checkpoints"] == "/mnt/checkpoints"
    # The driver reads the worker's pod and its node, one by one.
    role = by_kind(objects, "ClusterRole")["rel-sessionfleet-operator"]
    assert rules(role) == OPERATOR_NAMESPACED | OPERATOR_CLUSTER | {
        ("", "pods", "get"),
        ("", "nodes", "get"),
    }


# --- optional objects -------------------------------------------------------------------


def test_service_monitors_network_policies_and_default_drain_policy() -> None:
    objects = render(
        values={**ALL_FEATURES, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}
    )
    monitors = by_kind(objects, "ServiceMonitor")
    assert set(monitors) == {
        "rel-sessionfleet-operator",
        "rel-sessionfleet-router",
        "rel-sessionfleet-epp",
    }
    assert monitors["rel-sessionfleet-operator"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitors["rel-sessionfleet-router"]["spec"]["endpoints"][0]["port"] == "http"
    assert monitors["rel-sessionfleet-router"]["metadata"]["labels"]["release"] == "prom"

    policies = by_kind(objects, "NetworkPolicy")
    operator_policy = policies["rel-sessionfleet-operator"]["spec"]
    assert operator_policy["policyTypes"] == ["Ingress"]
    assert operator_policy["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    assert policies["rel-sessionfleet-router"]["spec"]["ingress"][0]["ports"][0]["port"] == "http"
    epp_monitor = monitors["rel-sessionfleet-epp"]["spec"]
    assert epp_monitor["endpoints"][0]["port"] == "metrics"
    assert epp_monitor["selector"]["matchLabels"] == EPP_SELECTOR
    assert epp_monitor["namespaceSelector"] == {"matchNames": ["sf"]}
    epp_policy = policies["rel-sessionfleet-epp"]["spec"]
    assert epp_policy["podSelector"]["matchLabels"] == EPP_SELECTOR
    assert epp_policy["ingress"] == [
        {"ports": [{"port": "grpc", "protocol": "TCP"}], "from": [GATEWAY]},
        {"ports": [{"port": "metrics", "protocol": "TCP"}]},
    ]

    (drain,) = by_kind(objects, "DrainPolicy").values()
    assert drain["metadata"]["namespace"] == "sf"
    result = parse(DrainPolicy, drain)
    assert result.ok, result.message


def test_grafana_dashboard_config_map_for_the_sidecar() -> None:
    dashboard = (CHART / "dashboards" / "sessionfleet.json").read_text()
    (config,) = by_kind(render("grafana.dashboard.enabled=true"), "ConfigMap").values()
    assert config["metadata"]["name"] == "rel-sessionfleet-dashboard"
    assert config["metadata"]["namespace"] == "sf"
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in config["metadata"]
    assert config["data"] == {"sessionfleet.json": dashboard.rstrip("\n")}
    assert json.loads(config["data"]["sessionfleet.json"])["uid"] == "sessionfleet"

    objects = render(
        values={
            "grafana": {
                "dashboard": {
                    "enabled": True,
                    "namespace": "monitoring",
                    "sidecarLabel": "grafana.example.com/dashboard",
                    "sidecarLabelValue": "sessionfleet",
                    "labels": {"team": "inference"},
                    "annotations": {"grafana_folder": "Inference"},
                }
            }
        }
    )
    (config,) = by_kind(objects, "ConfigMap").values()
    assert config["metadata"]["namespace"] == "monitoring"
    labels = config["metadata"]["labels"]
    assert labels["grafana.example.com/dashboard"] == "sessionfleet"
    assert "grafana_dashboard" not in labels
    assert labels["team"] == "inference"
    assert config["metadata"]["annotations"] == {"grafana_folder": "Inference"}


def test_prometheus_rule_for_the_rule_selector() -> None:
    objects = render(
        values={
            "prometheusRule": {
                "enabled": True,
                "namespace": "monitoring",
                "labels": {"release": "kube-prometheus-stack"},
            }
        }
    )
    (rule,) = by_kind(objects, "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == "rel-sessionfleet"
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(alerts) == 9 and all(a.startswith("Sessionfleet") for a in alerts)
    operator_down = next(
        r
        for g in rule["spec"]["groups"]
        for r in g["rules"]
        if r["alert"] == "SessionfleetOperatorDown"
    )
    # The operator's job is its metrics Service's name; its namespace the release's.
    assert 'up{job="rel-sessionfleet-operator-metrics", namespace="sf"}' in operator_down["expr"]


def test_network_policy_peers_and_drain_policy_namespace_follow_values() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objects = render(
        values={
            "networkPolicy": {"enabled": True, "metricsFrom": [peer]},
            "defaultDrainPolicy": {
                "enabled": True,
                "name": "platform",
                "spec": {"mode": "Wait", "deadline": "13m", "gracePeriod": "1m"},
            },
            "router": {"namespace": "inference"},
        }
    )
    operator_policy = by_kind(objects, "NetworkPolicy")["rel-sessionfleet-operator"]
    assert operator_policy["spec"]["ingress"][0]["from"] == [peer]
    drain = by_kind(objects, "DrainPolicy")["platform"]
    assert drain["metadata"]["namespace"] == "inference"
    assert (drain["spec"]["mode"], drain["spec"]["deadline"]) == ("Wait", "13m")


# --- Lease slots, engine fences, the Endpoint Picker's peers (issue 29) -----------------


def lease_rules(role: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in role["rules"] if "leases" in r["resources"]]


@pytest.mark.parametrize("component", ["router", "epp"])
def test_lease_rules_name_the_slots_and_nothing_else(component: str) -> None:
    objects = render(*EPP_ON)
    name = f"rel-sessionfleet-{component}"
    slots = [f"{name}-{index}" for index in range(8)]  # twice 2 replicas plus 2, at least 8
    create, named = lease_rules(by_kind(objects, "Role")[name])
    # RBAC cannot scope a create by name: a rule of its own, with nothing else in it.
    assert create == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["create"],
    }
    assert named["verbs"] == ["get", "patch"]  # no update, no delete, no list
    assert named["resourceNames"] == slots
    assert "rel-sessionfleet-operator" not in named["resourceNames"]
    args = container(by_kind(objects, "Deployment")[name])["args"]
    assert f"--lease-prefix={name}" in args and "--lease-slots=8" in args
    from sessionfleet.cli import build_parser
    from sessionfleet.fronts.options import lease_slots_from_args

    parsed = build_parser().parse_args(args)
    assert lease_slots_from_args(parsed, component).names() == slots


def test_lease_slots_follow_the_most_replicas() -> None:
    def slots(*sets: str) -> list[str]:
        role = by_kind(render(*sets), "Role")["rel-sessionfleet-router"]
        return list(lease_rules(role)[1]["resourceNames"])

    assert len(slots("router.replicas=6")) == 14
    assert len(slots("router.autoscaling.enabled=true", "router.autoscaling.maxReplicas=20")) == 42
    assert len(slots("router.leaseSlots=30")) == 30
    too_few = template_text("router.replicas=4", "router.leaseSlots=4", check=False)
    assert too_few.returncode != 0
    assert "router.leaseSlots is 4 but up to 4 router replicas run" in too_few.stderr
    epp = template_text(*EPP_ON, "epp.replicas=3", "epp.leaseSlots=2", check=False)
    assert "epp.leaseSlots is 2 but up to 3 epp replicas run" in epp.stderr


def test_the_endpoint_picker_needs_the_gateways_peers() -> None:
    # On by default: no install leaves the unauthenticated gRPC port open to the cluster.
    missing = template_text("epp.enabled=true", check=False)
    assert missing.returncode != 0
    assert "epp.enabled needs networkPolicy.eppFrom" in missing.stderr, missing.stderr
    # Only the engines' fence on still needs them: the gateway reaches the engines.
    fence_only = template_text("epp.enabled=true", "networkPolicy.enabled=false", check=False)
    assert "epp.enabled needs networkPolicy.eppFrom" in fence_only.stderr
    policy = by_kind(render(*EPP_ON), "NetworkPolicy")["rel-sessionfleet-epp"]
    assert policy["spec"]["ingress"][0] == {
        "ports": [{"port": "grpc", "protocol": "TCP"}],
        "from": [GATEWAY],
    }
    # Whoever wants the port open says so, and then it is.
    everyone = {"namespaceSelector": {}}
    open_policy = by_kind(
        render(values={"epp": {"enabled": True}, "networkPolicy": {"eppFrom": [everyone]}}),
        "NetworkPolicy",
    )["rel-sessionfleet-epp"]
    assert open_policy["spec"]["ingress"][0]["from"] == [everyone]
    both_off = render(
        "epp.enabled=true", "networkPolicy.enabled=false", "networkPolicy.workers.enabled=false"
    )
    assert not by_kind(both_off, "NetworkPolicy")


def test_the_operator_fences_engines_with_the_charts_peers() -> None:
    scraper = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    objects = render(
        *EPP_ON,
        "agent.enabled=true",
        values={"networkPolicy": {"eppFrom": [GATEWAY], "workers": {"extraFrom": [scraper]}}},
    )
    args = container(by_kind(objects, "Deployment")["rel-sessionfleet-operator"])["args"]
    expected = engine_peers_arg("operator", "router", "agent", extra=(GATEWAY, scraper))
    assert expected in args
    from sessionfleet.cli import build_parser

    parsed = build_parser().parse_args(args)
    assert parsed.engine_peers == (
        chart_peer("operator"),
        chart_peer("router"),
        chart_peer("agent"),
        GATEWAY,
        scraper,
    )
    # The operator's peer selects every shard's pods: no shard label in it.
    sharded = render(values={"operator": {"shards": SHARDS}})
    sharded_args = container(by_kind(sharded, "Deployment")["rel-sessionfleet-operator-a"])["args"]
    assert engine_peers_arg("operator", "router") in sharded_args
    for role in by_kind(sharded, "Role").values():
        if role["metadata"]["name"].startswith("rel-sessionfleet-operator") and not role[
            "metadata"
        ]["name"].endswith(("-leader", "-key")):
            assert ("networking.k8s.io", "networkpolicies", "patch") in rules(role)
    # Off: no flag, and the operator may only read NetworkPolicies (its index).
    off = render("networkPolicy.workers.enabled=false")
    off_args = container(by_kind(off, "Deployment")["rel-sessionfleet-operator"])["args"]
    assert not [a for a in off_args if a.startswith("--engine-peers")]
    role = by_kind(off, "ClusterRole")["rel-sessionfleet-operator"]
    assert {v for g, r, v in rules(role) if r == "networkpolicies"} == {"list", "watch"}


def test_the_lease_create_policy_admits_only_the_slots_of_each_account() -> None:
    objects = render(*EPP_ON, "router.leaseSlots=12")
    (policy,) = by_kind(objects, "ValidatingAdmissionPolicy").values()
    (binding,) = by_kind(objects, "ValidatingAdmissionPolicyBinding").values()
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE"],
            "resources": ["leases"],
        }
    ]
    router = "system:serviceaccount:sf:rel-sessionfleet-router"
    epp = "system:serviceaccount:sf:rel-sessionfleet-epp"
    (condition,) = spec["matchConditions"]
    assert condition["expression"] == f"request.userInfo.username in ['{router}', '{epp}']"
    router_rule, epp_rule = spec["validations"]
    assert "startsWith('rel-sessionfleet-router-')" in router_rule["expression"]
    assert "< 12)" in router_rule["expression"]
    assert "startsWith('rel-sessionfleet-epp-')" in epp_rule["expression"]
    assert "< 8)" in epp_rule["expression"]
    # The real API server runs the CEL (e2e/test_chart.py); here: off means none.
    off = render("leaseCreatePolicy.enabled=false")
    assert not by_kind(off, "ValidatingAdmissionPolicy")


# --- Kubernetes versions ---------------------------------------------------------------------


def releases_the_e2e_tools_build() -> list[tuple[int, int, int]]:
    """The releases the e2e tools can build (one module each in e2e/tools/k8s/)."""
    found = [
        tuple(int(part) for part in path.name.removeprefix("v").split("."))
        for path in (REPO_ROOT / "e2e" / "tools" / "k8s").glob("v1.*")
        if (path / "go.mod").is_file()
    ]
    return sorted(found)  # type: ignore[arg-type]


def test_the_charts_kube_version_starts_at_the_oldest_tested_release() -> None:
    oldest = releases_the_e2e_tools_build()[0]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={oldest[0]}.{oldest[1]}.0-0"


@pytest.mark.parametrize("version", ["v1.33.9", "v1.30.0"])
def test_helm_refuses_a_cluster_older_than_the_supported_range(version: str) -> None:
    result = helm("template", "rel", str(CHART), f"--kube-version={version}", check=False)
    assert result.returncode != 0
    assert (
        f"chart requires kubeVersion: >=1.34.0-0 which is incompatible with Kubernetes {version}"
        in result.stderr
    ), result.stderr


@pytest.mark.parametrize("version", ["v1.34.0", "v1.37.2", "v1.40.1"])
def test_helm_renders_for_every_supported_release(version: str) -> None:
    result = helm("template", "rel", str(CHART), f"--kube-version={version}")
    assert "kind: CustomResourceDefinition" in result.stdout

"""Pure builders: the worker pod for each engine, the PDB, names and labels."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sessionfleet.api import InferenceWorker
from sessionfleet.api.labels import EPOCH_LABEL, WORKER_LABEL
from sessionfleet.resources.names import label_value, session_object_name
from sessionfleet.resources.pods import build_pdb, build_pod, hold_annotations


def worker(**spec: Any) -> InferenceWorker:
    return InferenceWorker.model_validate(
        {
            "metadata": {"name": "qwen-a", "namespace": "ns", "uid": "u-1"},
            "spec": {"model": "Qwen/Qwen3-32B", **spec},
        }
    )


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["spec"]["containers"]
    return only  # type: ignore[no-any-return]


def test_vllm_pod_has_prefix_caching_usage_details_and_a_fixed_hash_seed() -> None:
    pod = build_pod(worker(gpus=2, engine={"args": ["--max-model-len", "200000"]}), 3)
    engine = container(pod)
    assert pod["metadata"]["name"] == "qwen-a-3"
    for flag in (
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        "--tensor-parallel-size=2",
    ):
        assert flag in engine["args"]
    assert engine["args"][-2:] == ["--max-model-len", "200000"]  # the user's come last
    assert {"name": "PYTHONHASHSEED", "value": "0"} in engine["env"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert engine["image"].startswith("ghcr.io/sessionfleet/sessionfleet-vllm:")
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]


def test_only_a_criu_checkpointed_vllm_engine_runs_in_development_mode() -> None:
    # vLLM serves /pause and /resume only with VLLM_SERVER_DEV_MODE=1, and the criu
    # driver pauses the engine before it checkpoints; nothing else needs those routes.
    def env(**spec: Any) -> dict[str, str]:
        return {
            e["name"]: e.get("value", "") for e in container(build_pod(worker(**spec), 1))["env"]
        }

    assert env(checkpoint={"driver": "criu"})["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in env(checkpoint={"driver": "engine"})
    assert "VLLM_SERVER_DEV_MODE" not in env()
    assert "VLLM_SERVER_DEV_MODE" not in env(engine={"type": "sim"}, checkpoint={"driver": "criu"})
    mine = env(
        checkpoint={"driver": "criu"},
        engine={"env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "0"}]},
    )
    assert mine["VLLM_SERVER_DEV_MODE"] == "0"  # the user's setting, once


def test_sim_pod_binds_the_pod_ip_and_runs_sessionfleet() -> None:
    pod = build_pod(worker(engine={"type": "sim"}, gpus=1, capacity={"kvTokens": 500000}), 1)
    engine = container(pod)
    assert engine["command"] == ["sessionfleet"]
    assert engine["args"][:2] == ["sim-engine", "--host=$(POD_IP)"]
    assert "--kv-tokens=500000" in engine["args"]
    assert "--enable-force-include-usage" in engine["args"]
    assert engine["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True


def test_pod_labels_owner_and_overlay() -> None:
    pod = build_pod(
        worker(
            engine={"type": "sim"},
            template={
                "labels": {"team": "a"},
                "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
            },
        ),
        2,
    )
    meta = pod["metadata"]
    assert meta["labels"][WORKER_LABEL] == "qwen-a" and meta["labels"][EPOCH_LABEL] == "2"
    assert meta["labels"]["team"] == "a"
    (owner,) = meta["ownerReferences"]
    assert owner["controller"] is True and owner["uid"] == "u-1"
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    keys = [t["key"] for t in pod["spec"]["tolerations"]]
    assert keys == ["kwok.x-k8s.io/node", "nvidia.com/gpu"]
    assert pod["spec"]["restartPolicy"] == "Never"  # a failed engine is a new epoch


def test_pdb_blocks_eviction_of_healthy_worker_pods_only() -> None:
    pdb = build_pdb(worker())
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["selector"] == {"matchLabels": {WORKER_LABEL: "qwen-a"}}


def test_hold_annotations_set_and_clear() -> None:
    assert hold_annotations(True, True) == {
        "karpenter.sh/do-not-disrupt": "true",
        "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
    }
    assert set(hold_annotations(False, False).values()) == {None}


@pytest.mark.parametrize(
    "session_id",
    ["6f1c2b0e-8d4a", "Session With Spaces", "UPPER/lower:punct", "", "x" * 300, "-"],
)
def test_session_object_names_are_valid_and_stable(session_id: str) -> None:
    name = session_object_name(session_id)
    assert name == session_object_name(session_id)
    assert len(name) <= 63 and name[0].isalnum() and name[-1].isalnum()
    assert all(c.isalnum() or c == "-" for c in name) and name == name.lower()


def test_ids_differing_in_case_get_different_names() -> None:
    assert session_object_name("Abc") != session_object_name("abc")


def test_label_value() -> None:
    assert label_value("Qwen/Qwen3-32B") == "Qwen-Qwen3-32B"
    long = label_value("m" * 100)
    assert len(long) <= 63 and long[-1].isalnum()


def test_a_vllm_worker_with_kv_store_lmcache_gets_the_lmcache_connector() -> None:
    pod = build_pod(
        worker(
            checkpoint={
                "storage": {"remoteUrl": "redis://lmcache:6379"},
                "kvStore": {"type": "LMCache"},
            },
            engine={"env": [{"name": "LMCACHE_CHUNK_SIZE", "value": "512"}]},
        ),
        1,
    )
    engine = container(pod)
    i = engine["args"].index("--kv-transfer-config")
    assert '"LMCacheConnectorV1"' in engine["args"][i + 1]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["LMCACHE_REMOTE_URL"] == "redis://lmcache:6379"
    assert env["LMCACHE_CHUNK_SIZE"] == "512"  # the user's setting wins
    assert env["PYTHONHASHSEED"] == "0"
    plain = container(build_pod(worker(), 1))
    assert "LMCacheConnectorV1" not in " ".join(plain["args"])
    assert not any(e["name"].startswith("LMCACHE_") for e in plain["env"])


def test_a_vllm_worker_gets_the_sessionfleet_kv_store_by_default() -> None:
    from sessionfleet.resources.kvstore import store_root

    engine = container(build_pod(worker(checkpoint={"kvStore": {"maxGiB": 2}}), 1))
    config = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "SessionfleetKVConnector"
    assert config["kv_connector_module_path"] == "sessionfleet.kvstore.connector"
    # A block that fails to load is recomputed; vLLM's default would fail the request.
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    assert extra == {
        "root": "/var/lib/sessionfleet/checkpoints/kv/ns/Qwen-Qwen3-32B",
        "max_bytes": 2 * 2**30,
    }
    assert extra["root"] == store_root(worker())  # every worker of the model: one store
    # The operator's control requests carry the worker's UID, which vLLM reads from here.
    assert {"name": "SESSIONFLEET_KVSTORE_TOKEN", "value": "u-1"} in engine["env"]


def test_no_kv_store_for_the_simulated_engine_driver_none_type_none_or_the_users_own() -> None:
    for spec in (
        {"engine": {"type": "sim"}},
        {"checkpoint": {"driver": "none"}},
        {"checkpoint": {"kvStore": {"type": "None"}}},
    ):
        engine = container(build_pod(worker(**spec), 1))
        assert "--kv-transfer-config" not in engine["args"], spec
        assert not any(e["name"] == "SESSIONFLEET_KVSTORE_TOKEN" for e in engine["env"])
    own = ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}']
    args = container(build_pod(worker(engine={"args": own}), 1))["args"]
    assert args.count("--kv-transfer-config") == 1 and args[-2:] == own


def test_vllm_offloading_puts_its_file_tier_in_the_shared_store() -> None:
    engine = container(build_pod(worker(checkpoint={"kvStore": {"type": "VllmOffloading"}}), 1))
    config = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "OffloadingConnector"
    (tier,) = config["kv_connector_extra_config"]["secondary_tiers"]
    assert tier == {
        "type": "fs",
        "root_dir": "/var/lib/sessionfleet/checkpoints/kv/ns/Qwen-Qwen3-32B",
    }


def test_kv_store_lmcache_needs_the_shared_stores_url() -> None:
    with pytest.raises(ValueError, match="LMCache needs storage.remoteUrl"):
        worker(checkpoint={"kvStore": {"type": "LMCache"}})
    with pytest.raises(ValueError):
        worker(checkpoint={"kvStore": {"maxGiB": -1}})

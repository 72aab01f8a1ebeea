"""The kopf registrations: settings, indexes, and event handlers that wake the fleet loop.

No create/update/resume handlers, no per-object timers or daemons: those make kopf
write diff-base and progress annotations and add finalizers, several PATCHes per
object. Indexes hold what the watches saw; one loop (:mod:`.loop`) reconciles from
them. AgentSessions are not kopf's: the operator watches them itself
(:mod:`.sessionwatch`), and binds a new one straight from its event.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from sessionfleet.api import GROUP, VERSION
from sessionfleet.api.labels import (
    EPOCH_LABEL,
    KOPF_PREFIX,
    SPEC_HASH_ANNOTATION,
    WORKER_LABEL,
)
from sessionfleet.controllers import kvstores, loop
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.policies import worker_view
from sessionfleet.controllers.records import (
    checkpoint_record,
    lease_record,
    policy_record,
    worker_record,
)
from sessionfleet.controllers.served import RetryForever
from sessionfleet.controllers.sessions import worker_brief
from sessionfleet.policy.handshake import ROUTER_COMPONENT, ROUTER_COMPONENT_LABEL
from sessionfleet.policy.observed import node_state, pod_state
from sessionfleet.supervise import Supervisor

log = logging.getLogger(__name__)

WORKERS = (GROUP, VERSION, "inferenceworkers")
POLICIES = (GROUP, VERSION, "drainpolicies")
CHECKPOINTS = (GROUP, VERSION, "workercheckpoints")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    """Tune kopf for many small objects, then start the fleet loop."""
    fleet: Fleet = memo["fleet"]
    settings.posting.loggers = False  # log lines are not Kubernetes Events
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
    settings.watching.chunk_size = 500
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.label_selectors["pods"] = WORKER_LABEL
    settings.watching.label_selectors["poddisruptionbudgets"] = WORKER_LABEL
    settings.watching.label_selectors["networkpolicies"] = WORKER_LABEL
    settings.execution.max_workers = 8
    # Kopf keeps an object's worker for idle_timeout (5 s) after its last event, so a
    # limit below the number of objects changing at once caps throughput at about
    # limit / 5 s objects per second and queues the rest (docs/design.md: the limit goes above
    # the indexed count). Session writes are bounded by SessionBook.writes instead.
    settings.queueing.worker_limit = None
    # Endless, as client-go's reflectors: kopf gives a request's last error to its
    # caller, and for a watch that ends the watcher for good (controllers/served.py).
    settings.networking.error_backoffs = RetryForever((1, 2, 5, 10), then=30)
    fleet.indexes.workers = kwargs["worker_index"]
    fleet.indexes.worker_pods = kwargs["pod_index"]
    fleet.indexes.pdbs = kwargs["pdb_index"]
    fleet.indexes.engine_policies = kwargs["engine_policy_index"]
    fleet.indexes.nodes = kwargs["node_index"]
    fleet.indexes.policies = kwargs["policy_index"]
    fleet.indexes.checkpoints = kwargs["checkpoint_index"]
    fleet.indexes.router_leases = kwargs["router_lease_index"]
    supervisor: Supervisor = memo["supervisor"]
    supervisor.start("fleet loop", loop.run(fleet))
    supervisor.start("engine scraper", loop.scrape_forever(fleet))
    supervisor.start("KV stores", kvstores.kv_stores_forever(fleet))


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """Give kopf the credentials our own client uses: one source, kubeconfig or in-cluster."""
    config = memo["fleet"].kube.config
    return kopf.ConnectionInfo(
        server=config.server,
        ca_path=config.ca_file,
        insecure=not config.verify,
        token=config.bearer_token(),
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    """Stop the loop and spawned work, give the Lease up (a standby takes over), close clients."""
    await memo["supervisor"].stop()
    fleet: Fleet = memo["fleet"]
    # Before the release: once it is sent, a standby may lead while our work still runs.
    await fleet.spawner.cancel_all()
    await fleet.leadership.release()
    await fleet.http.aclose()
    await fleet.kube.aclose()


# --- indexes -------------------------------------------------------------------------


@kopf.index(*WORKERS)
async def worker_index(
    body: kopf.Body, namespace: str | None, name: str, **_: Any
) -> dict[Any, Any]:
    """InferenceWorkers by (namespace, name)."""
    return {(namespace, name): worker_record(body)}


@kopf.index("", "v1", "pods", labels={WORKER_LABEL: kopf.PRESENT})
async def pod_index(
    body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> dict[Any, Any]:
    """Worker pods by (namespace, worker)."""
    return {(namespace, labels[WORKER_LABEL]): pod_state(body, EPOCH_LABEL)}


@kopf.index("policy", "v1", "poddisruptionbudgets", labels={WORKER_LABEL: kopf.PRESENT})
async def pdb_index(
    body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> dict[Any, Any]:
    """Index the drain holds' PodDisruptionBudgets by (namespace, worker): name and uid."""
    metadata = body["metadata"]
    return {(namespace, labels[WORKER_LABEL]): (metadata["name"], metadata.get("uid", ""))}


@kopf.index("networking.k8s.io", "v1", "networkpolicies", labels={WORKER_LABEL: kopf.PRESENT})
async def engine_policy_index(
    body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> dict[Any, Any]:
    """Index the engine fences' NetworkPolicies by (namespace, worker): their spec hash."""
    annotations = body["metadata"].get("annotations") or {}
    return {(namespace, labels[WORKER_LABEL]): annotations.get(SPEC_HASH_ANNOTATION, "")}


@kopf.index("", "v1", "nodes")
async def node_index(body: kopf.Body, name: str, **_: Any) -> dict[Any, Any]:
    """Nodes by name, reduced to readiness, cordon and taints."""
    return {name: node_state(body)}


@kopf.index(*POLICIES)
async def policy_index(body: kopf.Body, namespace: str | None, **_: Any) -> dict[Any, Any]:
    """DrainPolicies by namespace."""
    return {namespace: policy_record(body)}


@kopf.index(*CHECKPOINTS)
async def checkpoint_index(body: kopf.Body, namespace: str | None, **_: Any) -> dict[Any, Any]:
    """WorkerCheckpoints by (namespace, worker)."""
    state = checkpoint_record(body)
    return {(namespace, state.worker): state} if state is not None else {}


@kopf.index(
    "coordination.k8s.io",
    "v1",
    "leases",
    labels={ROUTER_COMPONENT_LABEL: ROUTER_COMPONENT},
)
def router_lease_index(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Router replicas' Leases: the replicas a migration waits for."""
    return {"routers": lease_record(body)}


# --- events ---------------------------------------------------------------------------
# Kopf calls event handlers only once every index is populated from its initial
# list, so the first call tells the loop it may trust what the indexes say (once the
# session watches have listed too: Fleet.update_indexed). Nodes exist in every cluster,
# so a first call comes even where no worker does. Each
# handler marks what its event touched (controllers/sessionfleet/controllers/work.py):
# the next pass reconciles those, not the whole fleet.


def _wake(memo: kopf.Memo) -> Fleet:
    fleet: Fleet = memo["fleet"]
    if not fleet.indexes.kopf_indexed:
        fleet.indexes.kopf_indexed = True
        fleet.update_indexed()
    fleet.wakeup.set()
    return fleet


@kopf.on.event(*WORKERS)
async def worker_event(
    memo: kopf.Memo, event: kopf.RawEvent, namespace: str | None, name: str, **_: Any
) -> None:
    """Mark the worker; and its sessions when what they read of it changed."""
    fleet = _wake(memo)
    key = (namespace or "", name)
    fleet.work.worker(key)
    record = None if event.get("type") == "DELETED" else fleet.indexes.worker(*key)
    fleet.sessions.placement.worker_seen(key, record)
    brief = worker_brief(record) if record is not None else None
    if record is None:
        fleet.work.forget_worker(key)
    if fleet.work.briefs.get(key) != brief:
        # Phase, epoch or pod changed (or the worker is gone): each session's decision
        # reads them. Counters and conditions change nothing for the sessions.
        fleet.work.briefs[key] = brief
        fleet.work.each_session(s.key for s in fleet.sessions.sessions_of(key))
    if brief is None:
        fleet.work.briefs.pop(key, None)
    view = worker_view(record) if record is not None else None
    if fleet.work.views.get(key) != view:
        fleet.work.views[key] = view
        fleet.work.policies = True


@kopf.on.event("", "v1", "pods", labels={WORKER_LABEL: kopf.PRESENT})
async def pod_event(memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    """Mark the pod's worker."""
    _wake(memo).work.worker((namespace or "", labels[WORKER_LABEL]))


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={WORKER_LABEL: kopf.PRESENT})
async def pdb_event(memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    """Mark the hold's worker (a hold someone else deleted is put back)."""
    _wake(memo).work.worker((namespace or "", labels[WORKER_LABEL]))


@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels={WORKER_LABEL: kopf.PRESENT})
async def engine_policy_event(
    memo: kopf.Memo, namespace: str | None, labels: kopf.Labels, **_: Any
) -> None:
    """Mark the fence's worker (a policy deleted or changed by hand is put back)."""
    _wake(memo).work.worker((namespace or "", labels[WORKER_LABEL]))


@kopf.on.event("", "v1", "nodes")
async def node_event(memo: kopf.Memo, name: str, **_: Any) -> None:
    """Mark the workers with a pod on the node (cordons, taints and readiness start drains)."""
    fleet = _wake(memo)
    for record in fleet.indexes.all_workers():
        if any(pod.node == name for pod in fleet.indexes.pods_of(record.key)):
            fleet.work.worker(record.key)


@kopf.on.event(*CHECKPOINTS)
async def checkpoint_event(
    memo: kopf.Memo, body: kopf.Body, namespace: str | None, **_: Any
) -> None:
    """Mark the checkpoint's worker (a user may have asked for one)."""
    fleet = _wake(memo)
    state = checkpoint_record(body)
    if state is not None:
        fleet.work.worker((namespace or "", state.worker))


@kopf.on.event(*POLICIES)
async def policy_event(memo: kopf.Memo, namespace: str | None, **_: Any) -> None:
    """Mark the namespace's workers: which policy governs each may have changed."""
    fleet = _wake(memo)
    fleet.work.policies = True
    for record in fleet.indexes.all_workers():
        if record.namespace == namespace:
            fleet.work.worker(record.key)

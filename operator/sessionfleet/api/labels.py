"""Label and annotation keys: the operator's own, and the platform ones it sets."""

from __future__ import annotations

WORKER_LABEL = "sessionfleet.dev/worker"
"""On a worker's pods and PodDisruptionBudget: the InferenceWorker's name."""

EPOCH_LABEL = "sessionfleet.dev/epoch"
"""On a worker's pods: the incarnation number of the worker the pod belongs to."""

MODEL_LABEL = "sessionfleet.dev/model"
"""On a worker's pods: the served model, sanitised to a label value."""

OWNER_LABEL = "sessionfleet.dev/owner"
"""On an AgentSession the router created for an authenticated client: that client."""

CREATED_BY_ANNOTATION = "sessionfleet.dev/created-by"
"""On an AgentSession: the router replica that created it. Only that replica may delete it
after a failed first turn, and only while no other replica has served it."""

SERVED_BY_ANNOTATION = "sessionfleet.dev/served-by"
"""On an AgentSession another router replica created: a replica that served a turn of it
before any usage of it was written (it keeps the creator from deleting the session)."""

MANAGED_BY = {"app.kubernetes.io/managed-by": "sessionfleet"}

KARPENTER_DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
"""Karpenter treats a pod with this annotation set to "true" like a fully blocking PDB."""

CA_SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
"""cluster-autoscaler never scales down a node with a pod annotated "false"."""

KOPF_PREFIX = "kopf.sessionfleet.dev"
"""The prefix of any annotation kopf itself would write (progress, diff base)."""

SPEC_HASH_ANNOTATION = "sessionfleet.dev/spec-hash"
"""On an object the operator keeps in a wanted shape (a worker's engine NetworkPolicy):
a digest of that shape, so its index tells at a glance whether it must be written."""

PROVENANCE_ANNOTATION = "sessionfleet.dev/provenance"
"""On a WorkerCheckpoint the operator created: a keyed digest (HMAC) of its namespace,
name, spec and signing time, which only holders of the operator's checkpoint key can
make (operator/sessionfleet/policy/provenance.py)."""

"""The AgentSession bodies the router writes, built from the API models: pure functions.

* :func:`agent_session`: the object created for a session's first turn;
* :func:`finished_patch`: the spec patch that marks a session finished;
* :func:`acknowledgement_patch`: a replica's acknowledgement of a migration;
* :func:`served_by_patch`: a replica's claim on a session another replica created.

The usage status patch is in :mod:`.usage`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from sessionfleet.api import AgentSession, AgentSessionSpec
from sessionfleet.api._common import ObjectMeta
from sessionfleet.api.labels import (
    CREATED_BY_ANNOTATION,
    OWNER_LABEL,
    SERVED_BY_ANNOTATION,
)


def agent_session(
    name: str,
    namespace: str,
    spec: AgentSessionSpec,
    *,
    created_by: str,
    owner_label: str | None = None,
) -> dict[str, Any]:
    """Return an AgentSession to create: ``spec``, created by replica ``created_by``.

    ``owner_label`` (the label value of an authenticated client) becomes the owner
    label. Metadata and spec leave out what is empty or defaulted, so the API server
    applies the CRD's defaults.
    """
    session = AgentSession(
        metadata=ObjectMeta(
            name=name,
            namespace=namespace,
            annotations={CREATED_BY_ANNOTATION: created_by},
            labels={} if owner_label is None else {OWNER_LABEL: owner_label},
        ),
        spec=spec,
    )
    # apiVersion and kind are always written; everything else only where not default.
    body = session.model_dump(by_alias=True, mode="json", include={"api_version", "kind"})
    body |= session.model_dump(
        by_alias=True, mode="json", include={"metadata", "spec"}, exclude_defaults=True
    )
    return body


def finished_patch() -> dict[str, Any]:
    """Return the merge patch that marks a session finished (its client said so)."""
    return {"spec": _partial(AgentSessionSpec, finished=True)}


def acknowledgement_patch(key: str, since: str) -> dict[str, Any]:
    """Return the merge patch that sets the annotation ``key`` to ``since``.

    A router replica's acknowledgement that a Migrating session, Migrating since
    ``since``, has no turn in flight through it (``key`` is ``ack.sessionfleet.dev/<replica>``).
    """
    meta = ObjectMeta(annotations={key: since})
    return {"metadata": meta.model_dump(by_alias=True, mode="json", exclude_unset=True)}


def served_by_patch(replica: str, uid: str) -> dict[str, Any]:
    """Return the merge patch by which ``replica`` claims the session of ``uid`` before serving it.

    The uid makes it fail on another incarnation of the name (the API server refuses a
    patch whose ``metadata.uid`` differs), so a claim never lands on a session created
    after the one the replica saw was deleted.
    """
    meta = ObjectMeta(uid=uid, annotations={SERVED_BY_ANNOTATION: replica})
    return {"metadata": meta.model_dump(by_alias=True, mode="json", exclude_unset=True)}


def _partial(model: type[BaseModel], **fields: Any) -> dict[str, Any]:
    """Return only ``fields`` of ``model`` as the API server stores them (part of a patch).

    Not validated as a whole: the other required fields of ``model`` are absent on
    purpose, since a merge patch leaves them as they are.
    """
    part = model.model_construct(_fields_set=set(fields), **fields)
    return part.model_dump(by_alias=True, mode="json", exclude_unset=True)

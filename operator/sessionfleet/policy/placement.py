"""Where a new session goes: who places it, who admits it, and the one rule for both.

**The front places; the operator admits.** A session's first turn arrives at a front (a
router replica or the EPP), which must answer now: it chooses the worker with
:func:`place` on its own view of the fleet, sends the turn there (so the session's KV
cache is built there) and records that choice as the AgentSession's ``spec.workerHint``.
The operator does not rank the workers again for such a session: it **admits** the hint
(:func:`admit_or_place`), binding the session where its first turn already runs, as long
as that worker still takes new sessions and has room under the operator's own count of
pinned sessions and their prefix tokens. That count is the authoritative one: every
bind, from whichever front replica's session, passes through it, while each front only
sees the sessions the watch has shown it so far. Only a session with no hint (created
with kubectl or GitOps) or one whose hint the operator cannot admit is placed by the
operator, with the same :func:`place`, and the refusal is said in its status
(``kubectl describe``).

Affinity is soft for placement and hard afterwards: placement runs once, for a
session's first turn (or when the operator migrates it); every later turn goes back
to the bound worker without asking it again.

:func:`place`'s order of preference (docs/design.md, "Flows", Binding):

1. a pinned worker, or nothing: a pin never falls back elsewhere;
2. the parent session's worker, for a subagent's first turn, when it has room: the
   child shares its parent's system prompt and often much of its context;
3. otherwise the least-loaded Ready worker serving the model, where load is the larger
   of pinned sessions over capacity and KV usage over KV capacity.

A hint is not among them: it is not a preference among workers but a placement made
already, which :func:`admit_or_place` admits before anything else (a pin still wins).

Load, not stickiness alone: hard stickiness without a load gate raised mean TTFT from
1.78 s to 5.05 s in Dynamo's session-routing replay (docs/background.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from sessionfleet.api import Reason


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What placement needs to know of one worker, observed by the caller.

    ``kv_usage`` is the engine's own figure (vLLM's ``kv_cache_usage_perc``, 0-1)
    when it is known; ``kv_tokens_pinned`` is the caller's estimate of the prefix
    tokens its pinned sessions hold, compared against ``kv_tokens_capacity``.
    """

    name: str
    model: str
    ready: bool
    pinned_sessions: int
    max_sessions: int
    kv_tokens_capacity: int = 0
    kv_tokens_pinned: int = 0
    kv_usage: float = 0.0
    load: float = field(init=False, repr=False, compare=False)
    """The worker's load, 0 (idle) to 1 (full) or beyond: the most constrained resource.

    Worked out once, when the load is made: a placement ranks every worker by it, and
    the operator keeps its view of the workers between placements.
    """

    def __post_init__(self) -> None:
        session_load = self.pinned_sessions / self.max_sessions if self.max_sessions else 1.0
        kv_load = self.kv_usage
        if self.kv_tokens_capacity:
            kv_load = max(kv_load, self.kv_tokens_pinned / self.kv_tokens_capacity)
        object.__setattr__(self, "load", max(session_load, kv_load))  # frozen: set once

    def has_room(self, tokens: int = 0) -> bool:
        """Whether one more session (with ``tokens`` of prefix) fits."""
        if self.pinned_sessions >= self.max_sessions:
            return False
        if self.kv_tokens_capacity and self.kv_tokens_pinned + tokens > self.kv_tokens_capacity:
            return False
        return self.kv_usage < 1.0


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """A session to place: its model and its wishes."""

    model: str
    pin: str | None = None
    parent_worker: str | None = None
    expected_tokens: int = 0
    exclude: frozenset[str] = frozenset()
    """Workers not to use, such as the one being drained."""


@dataclass(frozen=True, slots=True)
class Placement:
    """The decision: a worker, or none with the reason and a message for a condition."""

    worker: str | None
    reason: Reason
    message: str

    @property
    def placed(self) -> bool:
        """Whether a worker was chosen."""
        return self.worker is not None


RANK = attrgetter("load", "pinned_sessions", "name")
"""Least loaded first; ties break on fewer pinned sessions, then on the name, so that
every router replica and the operator make the same choice from the same observations.
Every worker's rank differs (names do)."""


def place(
    request: PlacementRequest, workers: Iterable[WorkerLoad], *, ranked: bool = False
) -> Placement:
    """Choose the worker for a new session, or say why there is none.

    ``ranked``: the workers come in :data:`RANK` order, so without a pin or parent the
    first candidate with room is the choice, and the rest are not looked at (the
    operator keeps its view of 500 workers in that order).
    """
    tokens = request.expected_tokens
    if ranked and request.pin is None and request.parent_worker is None:
        seen = 0
        for w in workers:
            if _serves(w, request):
                if w.has_room(tokens):
                    return _least_loaded(w)
                seen += 1
        return _none_with_room(request, seen)
    candidates = {w.name: w for w in workers if _serves(w, request)}

    if request.pin is not None:
        pinned = candidates.get(request.pin)
        if pinned is not None and pinned.has_room(tokens):
            return Placement(pinned.name, Reason.BOUND, f"pinned to worker {pinned.name}")
        return Placement(
            None,
            Reason.PINNED_WORKER_UNAVAILABLE,
            f"pinned worker {request.pin} is not a Ready {request.model} worker with room",
        )

    parent = candidates.get(request.parent_worker) if request.parent_worker is not None else None
    if parent is not None and parent.has_room(tokens):
        return Placement(parent.name, Reason.BOUND, f"placed on the parent's worker {parent.name}")

    with_room = [w for w in candidates.values() if w.has_room(tokens)]
    if not with_room:
        return _none_with_room(request, len(candidates))
    return _least_loaded(min(with_room, key=RANK))


def admit_or_place(
    request: PlacementRequest,
    workers: Sequence[WorkerLoad],
    *,
    hint: str | None,
    ranked: bool = False,
) -> Placement:
    """Bind a new session where a front placed its first turn, or place it here.

    The operator's rule (see the module's docstring): a pin is honoured or nothing, as in
    :func:`place`; then the ``hint`` (``spec.workerHint``, the worker the front sent the
    first turn to) is admitted when that worker is a candidate (Ready and not asked to
    drain, serving the model, not excluded) with room for one more session in
    ``workers``, the caller's own count. Otherwise the session is placed with
    :func:`place`, and the message says why the hint was refused. ``ranked`` as for
    :func:`place`.
    """
    if request.pin is not None or hint is None:
        return place(request, workers, ranked=ranked)
    hinted = next((worker for worker in workers if worker.name == hint), None)
    refusal = hint_refusal(request, hint, hinted)
    if refusal is None:
        return Placement(
            hint, Reason.BOUND, f"admitted to the hinted worker {hint}, where its first turn went"
        )
    placed = place(request, workers, ranked=ranked)
    return Placement(placed.worker, placed.reason, f"{placed.message}; {refusal}")


def hint_refusal(request: PlacementRequest, hint: str, hinted: WorkerLoad | None) -> str | None:
    """Return why the hinted worker cannot take the session (None: it can).

    ``hinted`` is the worker named ``hint`` as the caller sees it, None when it sees none.
    """
    why = f"the hinted worker {hint} was not admitted"
    if hinted is None:
        return f"{why}: it is no valid InferenceWorker of the session's namespace"
    if hinted.model != request.model:
        return f"{why}: it serves {hinted.model}, not {request.model}"
    if hint in request.exclude:
        return f"{why}: it is excluded"
    if not hinted.ready:
        return f"{why}: it takes no new sessions (not Ready, or asked to drain)"
    if not hinted.has_room(request.expected_tokens):
        return f"{why}: it is full ({_fullness(hinted, request.expected_tokens)})"
    return None


def _fullness(worker: WorkerLoad, tokens: int) -> str:
    """Say which of a worker's resources has no room left."""
    if worker.pinned_sessions >= worker.max_sessions:
        return f"{worker.pinned_sessions} of {worker.max_sessions} sessions"
    if worker.kv_tokens_capacity and worker.kv_tokens_pinned + tokens > worker.kv_tokens_capacity:
        return (
            f"{worker.kv_tokens_pinned} of {worker.kv_tokens_capacity} KV tokens held, "
            f"{tokens} more expected"
        )
    return "its KV cache is in full use"


def _serves(worker: WorkerLoad, request: PlacementRequest) -> bool:
    """Whether the worker is a candidate at all: Ready, the model, not excluded."""
    return worker.ready and worker.model == request.model and worker.name not in request.exclude


def _least_loaded(best: WorkerLoad) -> Placement:
    return Placement(best.name, Reason.BOUND, f"placed on the least-loaded worker {best.name}")


def _none_with_room(request: PlacementRequest, candidates: int) -> Placement:
    if not candidates:
        return Placement(None, Reason.NO_READY_WORKER, f"no Ready worker serves {request.model}")
    return Placement(
        None,
        Reason.NO_CAPACITY,
        f"all {candidates} Ready {request.model} workers are at capacity",
    )

"""The discrete-event simulation: a heap of events in virtual time.

One event per turn — the moment its request is sent — plus one when a session's
last answer ends, and a few control events (drains, failures, checkpoints). When a
turn is routed, everything about it is known at once: the worker's prefill queue is
first come first served, so the turn's prefill starts when the queue empties, and
its answer ends a fixed time per output token later. The next turn is then
scheduled a tool pause after that end. Nothing is created per turn but the heap
entry and the in-flight record, which keeps 100,000 sessions of 33 turns within a
minute on one core.

The prefix cache is read and updated when the turn is routed rather than when its
prefill starts: a turn waiting in a queue does not see evictions made meanwhile.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from functools import partial
from heapq import heappop as _heappop
from heapq import heappush
from math import inf
from math import log as _log

from sessionfleet.api import SessionPhase
from sessionfleet.fleetsim._config import (
    Disruption,
    Drain,
    Failure,
    FleetConfig,
    OperatorSettings,
)
from sessionfleet.fleetsim._observed import (
    accepting,
    cordoned_node,
    node_name,
    router_leases,
    running_pod,
    serving_status,
    session_state,
    worker_loads,
    worker_observation,
    worker_spec,
    written,
)
from sessionfleet.fleetsim._observed import at as _at
from sessionfleet.fleetsim._results import (
    _TTFT_BUCKETS,
    _TTFT_MIN,
    _TTFT_SCALE,
    DrainRecord,
    FailureRecord,
    SimResult,
    ttft_bucket,
)
from sessionfleet.fleetsim._state import Live, Worker
from sessionfleet.fleetsim._strategies import STRATEGIES, Operator, Strategy
from sessionfleet.policy.migration import MigrationAction, plan_migration
from sessionfleet.policy.observed import NodeState
from sessionfleet.policy.sessions import SessionState, WorkerBrief, decide_session
from sessionfleet.policy.worker import plan_worker
from sessionfleet.workload import Session

_TTFT_INVERSE_MIN = 1.0 / _TTFT_MIN
_UNTIL_MOVED = inf
"""``Live.hold_until`` of a Migrating session: its next turn waits for the move."""

ProgressCallback = Callable[[int, int | None], None]
"""Called with (sessions finished, sessions expected or None) now and then."""


class Simulation:
    """One run of one strategy over one workload.

    ``sessions`` must give root sessions in arrival order; a child may follow its
    parent anywhere later and starts when the parent finishes turn
    ``spawn_after_turn`` (or at its own ``arrival`` when its parent is unknown). It
    is read lazily, so a generator keeps only live sessions in memory.
    """

    def __init__(
        self,
        sessions: Iterable[Session],
        strategy: Strategy,
        fleet: FleetConfig | None = None,
        operator: OperatorSettings | None = None,
        disruptions: Sequence[Disruption] = (),
        *,
        expected_sessions: int | None = None,
        progress: ProgressCallback | None = None,
        bin_seconds: float = 60.0,
    ) -> None:
        self.config = fleet or FleetConfig()
        self.settings = operator or OperatorSettings()
        self.strategy = strategy
        config = self.config
        self.workers = [
            Worker(i, config.worker_name(i), config.kv_tokens, config.block_size)
            for i in range(config.workers)
        ]
        self.by_name = {w.name: w for w in self.workers}
        for worker in self.workers:
            worker.status = serving_status(worker)
        self._spec = worker_spec(config, self.settings)
        self._drain_checks: set[tuple[int, float]] = set()
        self.up_workers = list(self.workers)
        self.generation = 0
        self.result = SimResult(strategy.label, bin_seconds=bin_seconds)
        self._heap: list[tuple[float, int, Live | Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._sessions: Iterator[Session] = iter(sessions)
        self._lookahead: Live | None = None
        self._last_root_arrival = float("-inf")
        self._live_by_id: dict[str, Live] = {}
        self._groups: dict[str, int] = {}
        self._keys = itertools.count()
        self._active = 0
        self._expected = expected_sessions
        self._progress = progress
        self._progress_every = max(1, (expected_sessions or 10_000) // 200)
        self._bin_scale = 1.0 / bin_seconds
        cost = config.cost
        self._per_token = cost.prefill_seconds_per_token
        self._overhead = cost.prefill_overhead_seconds
        self._tpot = cost.decode_seconds_per_token
        self._block = config.block_size
        # Gateway flow control (FleetConfig.admission_cap): sessions holding a slot, and
        # the sessions waiting for one, first come first served.
        self._cap = config.admission_cap
        self._admitted = 0
        self._queue: deque[Live] = deque()
        self._queue_since = 0.0
        self._timeout = config.client_timeout_seconds or inf
        self._warmup = config.warmup_seconds
        self._until = config.measure_until_seconds
        self.result.workers = config.workers
        self.result.window_start = self._warmup
        for disruption in disruptions:
            if not 0 <= disruption.worker < config.workers:
                raise ValueError(f"{disruption}: no worker {disruption.worker}")
            if isinstance(disruption, Drain):
                self._schedule(disruption.at, partial(self._start_drain, disruption))
            else:
                self._schedule(disruption.at, partial(self._fail, disruption))
        interval = self.settings.checkpoint_interval
        if strategy.operator and self.settings.can_checkpoint and interval:
            self._schedule(interval, self._periodic_checkpoint)

    # --- the event loop -------------------------------------------------------------

    def run(self) -> SimResult:
        """Run until every session has finished; return what was measured."""
        self._admit(0.0)
        heap = self._heap
        heappop = _heappop
        turn = self._turn
        while heap:
            now, _, item = heappop(heap)
            if item.__class__ is Live:
                turn(now, item)
            else:
                item(now)  # type: ignore[operator]
        if self._progress is not None:
            self._progress(self.result.sessions, self._expected)
        result = self.result
        result.window_end = min(self._until, result.end_time)
        return result

    def _schedule(self, when: float, item: Live | Callable[[float], None]) -> None:
        heappush(self._heap, (when, next(self._seq), item))

    def _admit(self, now: float) -> None:
        """Read the workload up to the next root session and schedule it."""
        self._lookahead = None
        block = self.config.block_size
        for session in self._sessions:
            parent = self._live_by_id.get(session.parent_id) if session.parent_id else None
            if parent is not None and parent.turn < session.spawn_after_turn:
                parent.children.append(session)
                parent.next_child_turn = min(c.spawn_after_turn for c in parent.children)
                continue
            live = self._new_live(session, block)
            start = session.arrival if session.arrival > now else now
            live.ready_at = start
            live.arrived = start
            self._schedule(start, live)
            if session.parent_id is None:
                if session.arrival < self._last_root_arrival:
                    raise ValueError(
                        f"session {session.session_id} arrives before the previous root "
                        "session: give root sessions in arrival order"
                    )
                self._last_root_arrival = session.arrival
                self._lookahead = live
                return

    def _new_live(self, session: Session, block: int) -> Live:
        group = self._groups.setdefault(session.prefix_group, -1 - len(self._groups))
        live = Live(session, next(self._keys), group, block)
        self._live_by_id[session.session_id] = live
        self._active += 1
        return live

    def _spawn(self, parent: Live, when: float) -> None:
        """Start the children of ``parent`` that wait for the turn it just finished."""
        block = self.config.block_size
        done = parent.turn
        waiting = []
        for child in parent.children:
            if child.spawn_after_turn > done:
                waiting.append(child)
                continue
            live = self._new_live(child, block)
            live.parent = parent
            shared_with_parent = child.parent_prefix_tokens // block * block
            live.parent_tokens = max(0, shared_with_parent - live.shared)
            live.expect = shared_with_parent
            live.ready_at = when
            live.arrived = when
            self._schedule(when, live)
        parent.children = waiting
        parent.next_child_turn = min((c.spawn_after_turn for c in waiting), default=0)

    def _turn(self, now: float, live: Live) -> None:
        """Send one turn: route it, serve it from the cache, queue its prefill, decode."""
        session = live.session
        k = live.turn
        if k >= live.turns:
            self._finish(now, live)
            return
        result = self.result
        if live.hold_until > now:
            result.held_turns += 1
            if live.hold_until == _UNTIL_MOVED:
                live.parked = True  # the move schedules it (_resume)
            else:
                self._schedule(live.hold_until, live)
            return
        if live is self._lookahead:
            self._admit(now)
        sent = live.ready_at
        if now - sent > self._timeout:
            self._abandon(now, live)
            return
        if k == 0 and not live.admitted:
            if self._cap and self._admitted >= self._cap:
                self._enqueue(now, live)
                return
            live.admitted = True
            self._admitted += 1
        worker = self.strategy.route(self, live, now)
        if worker is None:
            result.retried_turns += 1
            config = self.config
            wait = config.retry_seconds * 2.0**live.retries
            live.retries += 1
            self._schedule(now + min(wait, config.retry_max_seconds), live)
            return
        live.retries = 0
        measured = self._warmup <= now < self._until
        free_at = worker.free_at
        if (free_at if free_at > now else now) - sent > self._timeout:
            # The client gives up before the prefill starts: the engine drops the request.
            self._abandon(now, live)
            return
        if k == 0:
            # The wait for admission (the gateway's queue, retries for room) is reported
            # apart; the first turn's time to first token counts from its placement.
            waited = now - sent
            live.ready_at = now
            if measured:
                result.admitted += 1
                result.admission_histogram[ttft_bucket(waited)] += 1
                if waited > result.admission_max:
                    result.admission_max = waited
        if worker is not live.worker:
            self._bind(live, worker)

        new_tokens = session.new_tokens[k]
        if k == live.next_compaction:
            # The agent compacted its context: only the system prompt still matches.
            prompt = session.system_prompt_tokens + new_tokens
            expect = live.shared
            live.next_compaction = next((c for c in session.compactions if c > k), -1)
            hit = worker.cache.access(live.key, live.group, live.shared, prompt, True)
        else:
            prompt = live.prompt + new_tokens
            expect = live.expect
            if k == 0 and live.parent_tokens:
                parent = live.parent
                assert parent is not None
                hit = worker.cache.access(
                    live.key, live.group, live.shared, prompt, False, parent.key, live.parent_tokens
                )
            else:
                hit = worker.cache.access(live.key, live.group, live.shared, prompt)

        if expect > hit and (expect - hit) * 2 > expect:
            live.lost = True

        # Prefill waits for the worker's queue; decoding follows it.
        busy = self._overhead + (prompt - hit) * self._per_token
        finish = (free_at if free_at > now else now) + busy
        worker.free_at = finish
        ttft = finish - live.ready_at
        output = session.output_tokens[k]
        end = finish + output * self._tpot
        if measured:
            result.turns += 1
            result.input_tokens += prompt
            result.cached_tokens += hit
            if expect > hit:
                result.recomputed_tokens += expect - hit
            result.prefill_busy += busy
            result.output_tokens += output
            result.ttft_sum += ttft
            if ttft > result.ttft_max:
                result.ttft_max = ttft
            if ttft <= self.config.ttft_target_seconds:
                result.turns_on_target += 1
            # ttft_bucket(), inlined: this runs once per turn.
            bucket = (
                int(_log(ttft * _TTFT_INVERSE_MIN) * _TTFT_SCALE) + 1 if ttft > _TTFT_MIN else 0
            )
            result.ttft_histogram[bucket if bucket < _TTFT_BUCKETS else _TTFT_BUCKETS - 1] += 1
            bin_index = int(now * self._bin_scale)
            bin_input = result.bin_input
            if bin_index >= len(bin_input):
                self._grow_bins(bin_index)
            bin_input[bin_index] += prompt
            result.bin_cached[bin_index] += hit
            result.bin_ttft[bin_index] += ttft
            result.bin_turns[bin_index] += 1

        inflight = worker.inflight
        if inflight and inflight[0][0] <= now:
            worker.expire(now)
        heappush(inflight, (end, prompt + output))
        worker.inflight_tokens += prompt + output
        worker.pinned_tokens += prompt - live.prompt
        live.prompt = prompt
        live.expect = prompt - prompt % self._block
        k += 1
        live.turn = k
        live.busy_until = end
        if live.next_child_turn == k:
            self._spawn(live, end)
        if ttft > self._timeout:
            # The engine did the work, but the client had given up before the first token.
            self._abandon(end, live)
            return
        ready = end + session.pauses[k - 1] if k < live.turns else end
        live.ready_at = ready
        heappush(self._heap, (ready, next(self._seq), live))

    # --- gateway flow control and client timeouts ------------------------------------

    def _enqueue(self, now: float, live: Live) -> None:
        """Hold a new session at the gateway until an admission slot frees."""
        self._queue_length_changes(now)
        self._queue.append(live)
        result = self.result
        if len(self._queue) > result.queue_max:
            result.queue_max = len(self._queue)

    def _queue_length_changes(self, now: float) -> None:
        self.result.queue_area += len(self._queue) * (now - self._queue_since)
        self._queue_since = now

    def _release(self, now: float, live: Live) -> None:
        """Free the session's admission slot and let the next waiting session in."""
        if not live.admitted:
            return
        live.admitted = False
        self._admitted -= 1
        if self._queue:
            # The slot passes straight to the session at the head of the queue.
            self._queue_length_changes(now)
            waiting = self._queue.popleft()
            waiting.admitted = True
            self._admitted += 1
            self._schedule(now, waiting)

    def _abandon(self, now: float, live: Live) -> None:
        """End a session whose client gave up: failed, with its sub-agents not yet started."""
        if live.worker is not None:
            self._unbind(live)
        self._release(now, live)
        self._live_by_id.pop(live.session.session_id, None)
        self._active -= 1
        result = self.result
        result.sessions_failed += 1 + len(live.children)
        live.children = []
        if now > result.end_time:
            result.end_time = now

    def _grow_bins(self, index: int) -> None:
        result = self.result
        grow = index + 1 - len(result.bin_input)
        result.bin_input.extend([0] * grow)
        result.bin_cached.extend([0] * grow)
        result.bin_ttft.extend([0.0] * grow)
        result.bin_turns.extend([0] * grow)

    def _finish(self, now: float, live: Live) -> None:
        """Unbind and count a session whose last answer is done."""
        worker = live.worker
        if worker is not None:
            self._unbind(live)
        if live.children:
            self._spawn(live, now)
        self._release(now, live)
        self._live_by_id.pop(live.session.session_id, None)
        self._active -= 1
        result = self.result
        result.sessions += 1
        if self._warmup <= live.arrived < self._until:
            result.completed_measured += 1
            result.session_seconds_histogram[ttft_bucket(now - live.arrived)] += 1
        if live.lost:
            result.sessions_lost_cache += 1
        if now > result.end_time:
            result.end_time = now
        if self._progress is not None and result.sessions % self._progress_every == 0:
            self._progress(result.sessions, self._expected)
        if worker is not None and worker.draining is not None:
            self._drain_step(worker, now)

    def _bind(self, live: Live, worker: Worker) -> None:
        if live.worker is not None:
            self._unbind(live)
        worker.bound[live] = None
        worker.pinned_tokens += live.prompt
        live.worker = worker

    def _unbind(self, live: Live) -> None:
        worker = live.worker
        if worker is not None:
            del worker.bound[live]
            worker.pinned_tokens -= live.prompt
            live.worker = None

    def _refresh_up(self) -> None:
        self.up_workers = [w for w in self.workers if w.up]
        self.generation += 1

    def _take_down(self, worker: Worker) -> None:
        """Remove the worker's pod, its cache with it, and unbind its sessions."""
        worker.up = False
        worker.accepting = False
        worker.cache.clear()
        for live in list(worker.bound):
            self._unbind(live)
        self._refresh_up()

    def _come_back(self, worker: Worker, now: float, new_epoch: bool = True) -> None:
        """Start serving from a new pod of the worker, with an empty cache."""
        worker.up = True
        worker.accepting = True
        worker.recovering = False
        worker.draining = None
        if new_epoch:
            worker.epoch += 1
        worker.status = serving_status(worker)
        worker.cache.clear()
        worker.free_at = now
        worker.inflight.clear()
        worker.inflight_tokens = 0
        self._refresh_up()

    # --- drains ---------------------------------------------------------------------

    def _start_drain(self, drain: Drain, now: float) -> None:
        worker = self.workers[drain.worker]
        if not worker.up or worker.draining is not None:
            return
        record = DrainRecord(worker.name, now, pinned_at_start=len(worker.bound))
        self.result.drains.append(record)
        restart = self.config.restart_seconds
        if not self.strategy.operator:
            # Nothing holds the pod: it is evicted at once. Turns in flight finish
            # within the termination grace period; the cache goes with the pod.
            record.evicted = len(worker.bound)
            last_end = max([now, *(end for end, _ in worker.inflight)])
            record.finished = min(last_end, now + self.config.termination_grace_seconds)
            self._take_down(worker)
            self._schedule(record.finished + restart, partial(self._come_back, worker))
            return
        # The node is cordoned and its pod will be evicted as soon as nothing holds it.
        worker.draining = record
        self._drain_step(worker, now)

    def _drain_step(self, worker: Worker, now: float) -> None:
        """Reconcile a draining worker as the operator does: plan it, then carry the plan out.

        The operator looks at the worker again whenever one of its sessions changes: here
        at once after a batch moved, when a session finishes, when a router acknowledges
        a migration, and when the plan asks to look again.
        """
        record = worker.draining
        assert isinstance(record, DrainRecord)
        while True:
            observation = worker_observation(
                worker, self._spec, self.settings, now, running_pod(worker), cordoned_node(worker)
            )
            plan = plan_worker(observation)
            worker.status = written(worker.status, plan)
            worker.accepting = accepting(plan)
            moved = 0
            if plan.migrate or plan.move_worker:
                # Migration scope Worker is simulated as each session moving on its own.
                names = plan.migrate or tuple(p.name for p in observation.pinned)
                moved = self._migrate_sessions(
                    worker, record, names, plan.migrate_through_checkpoint, now
                )
            if not moved:
                break
        if not plan.holds:
            # Nothing holds the pod: the platform's eviction goes through.
            record.released = 0 if plan.drain_done else len(worker.bound)
            record.finished = now
            worker.draining = None
            for live in worker.bound:
                self._resume(live, now)
            self._take_down(worker)
            self._schedule(now + self.config.restart_seconds, partial(self._come_back, worker))
        elif plan.recheck_after is not None:
            self._look_again(worker, record, now + plan.recheck_after)

    def _look_again(self, worker: Worker, record: DrainRecord, when: float) -> None:
        """Schedule one more drain step at ``when`` (once, however many ask for it)."""
        key = (worker.index, when)
        if key not in self._drain_checks:
            self._drain_checks.add(key)
            self._schedule(when, partial(self._drain_check, worker, record, key))

    def _drain_check(
        self, worker: Worker, record: DrainRecord, key: tuple[int, float], now: float
    ) -> None:
        self._drain_checks.discard(key)
        if worker.draining is record:
            self._drain_step(worker, now)

    def _migrate_sessions(
        self,
        source: Worker,
        record: DrainRecord,
        names: Sequence[str],
        through_checkpoint: bool,
        now: float,
    ) -> int:
        """Carry out the operator's migration plan for ``names``; return how many moved.

        As the operator's ``migrate_sessions``: a session is first marked Migrating (the
        router then holds its next turn, and acknowledges once its turn in flight has
        ended); once acknowledged, or once the acknowledgement is overdue, it moves to
        the worker ``plan_migration`` chose, with its KV when the plan says so.
        """
        by_id = {live.session.session_id: live for live in source.bound}
        batch = [by_id[name] for name in names if name in by_id]
        model = self.config.model
        steps = plan_migration(
            [session_state(live, source, model, now) for live in batch],
            source.name,
            worker_loads(self.workers, self.config, now),
            router_leases(now),
            _at(now),
            timedelta(seconds=self.settings.ack_timeout),
            frozenset(self.by_name) if through_checkpoint else None,
        )
        moved = 0
        for step in steps:
            live = by_id[step.session.name]
            action = step.action
            if action is MigrationAction.START_HANDSHAKE:
                live.migrating_since = now
                live.hold_until = _UNTIL_MOVED
                self._look_again(source, record, self._acknowledged_at(live))
            elif action is MigrationAction.WAIT:
                self._look_again(source, record, self._acknowledged_at(live))
            elif action is MigrationAction.MOVE and step.target is not None:
                self._move(live, source, self.by_name[step.target], through_checkpoint, now, record)
                moved += 1
            else:
                # No worker has room: the operator tries again on its next pass.
                self._look_again(source, record, now + self.settings.resync_seconds)
        return moved

    def _acknowledged_at(self, live: Live) -> float:
        """When the handshake of a Migrating session completes: its turn's end, or timeout."""
        since = live.migrating_since
        assert since is not None
        return min(max(since, live.busy_until), since + self.settings.ack_timeout)

    def _move(
        self,
        live: Live,
        source: Worker,
        target: Worker,
        through_checkpoint: bool,
        now: float,
        record: DrainRecord,
    ) -> None:
        """Rebind a session to ``target``, with its KV through a checkpoint when asked."""
        resume_at = now
        if through_checkpoint:
            tokens = source.cache.cached_tokens(live.key, live.group, live.shared)
            if tokens:
                target.cache.store(live.key, live.group, live.shared, tokens)
                resume_at = now + self.config.cost.transfer_seconds(tokens)
            record.migrated_with_checkpoint += 1
        else:
            record.migrated_without_checkpoint += 1
        self._bind(live, target)
        self._resume(live, resume_at)

    def _resume(self, live: Live, when: float) -> None:
        """End a session's Migrating phase: its held turn goes on at ``when``."""
        if live.migrating_since is None:
            return
        live.migrating_since = None
        live.hold_until = when
        if live.parked:
            live.parked = False
            self._schedule(when, live)

    # --- failures and recovery ------------------------------------------------------

    def _fail(self, failure: Failure, now: float) -> None:
        worker = self.workers[failure.worker]
        if not worker.up:
            return
        record = FailureRecord(worker.name, now, sessions=len(worker.bound))
        self.result.failures.append(record)
        if isinstance(worker.draining, DrainRecord):
            worker.draining.finished = now  # the failure ended the drain
            worker.draining = None
            for live in worker.bound:
                self._resume(live, now)
        checkpoint = worker.checkpoint
        worker.checkpoint = None
        worker.up = False
        worker.accepting = False
        worker.cache.clear()
        self._refresh_up()
        if not self.strategy.operator:
            # The router notices at once and sends the sessions elsewhere; a new pod
            # comes up with an empty cache.
            for live in list(worker.bound):
                self._unbind(live)
            record.detected = now
            record.ready = now + self.config.restart_seconds
            self._schedule(record.ready, partial(self._come_back, worker))
            return
        delay = self.settings.node_not_ready_toleration if failure.node else 0.0
        self._schedule(
            now + delay, partial(self._recover, worker, record, failure.node, checkpoint)
        )

    def _recover(
        self,
        worker: Worker,
        record: FailureRecord,
        node_lost: bool,
        checkpoint: tuple[float, OrderedDict[int, int]] | None,
        now: float,
    ) -> None:
        """Notice the loss as the operator does: a new epoch, restored from a checkpoint."""
        pod = running_pod(worker, ready=node_lost, failed=not node_lost)
        node = NodeState(
            name=node_name(worker),
            ready=not node_lost,
            not_ready_since=_at(record.failed) if node_lost else None,
        )
        plan = plan_worker(worker_observation(worker, self._spec, self.settings, now, pod, node))
        if not plan.create_pod:
            # Not yet beyond the toleration (or backing off): look again shortly.
            again = now + (plan.recheck_after or 1.0)
            self._schedule(again, partial(self._recover, worker, record, node_lost, checkpoint))
            return
        worker.status = written(worker.status, plan)
        worker.recovering = True
        worker.epoch = plan.epoch
        saved = checkpoint[1] if checkpoint is not None and self.settings.can_checkpoint else None
        restored = sum(saved.values()) if saved else 0
        ready = now + self.config.restart_seconds
        if saved:
            ready += self.config.cost.transfer_seconds(restored)
        record.detected = now
        record.ready = ready
        record.restored_tokens = restored
        brief = WorkerBrief(worker.name, plan.phase, plan.epoch, None)
        for live in list(worker.bound):
            session_id = live.session.session_id
            state = SessionState(
                namespace="sim",
                name=session_id,
                session_id=session_id,
                model=self.config.model,
                phase=SessionPhase.BOUND,
                worker=worker.name,
                epoch=worker.epoch - 1,
                last_activity=_at(live.busy_until),
            )
            decision = decide_session(state, brief, _at(now))
            if decision.phase is SessionPhase.RESTORING:
                live.hold_until = max(live.hold_until, ready)
            elif decision.phase is not SessionPhase.BOUND and decision.phase is not None:
                self._unbind(live)
        self._schedule(ready, partial(self._recovered, worker, saved))

    def _recovered(self, worker: Worker, saved: OrderedDict[int, int] | None, now: float) -> None:
        # The epoch was advanced when the recovery started.
        self._come_back(worker, now, new_epoch=False)
        if saved:
            worker.cache.restore(saved)

    def _periodic_checkpoint(self, now: float) -> None:
        """Every worker saves its cache (spec.checkpoint.interval)."""
        result = self.result
        bytes_per_token = self.config.cost.kv_bytes_per_token
        for worker in self.workers:
            if worker.up and not worker.recovering:
                worker.checkpoint = (now, worker.cache.snapshot())
                result.checkpoints += 1
                result.checkpoint_bytes += worker.cache.used * bytes_per_token
        interval = self.settings.checkpoint_interval
        # With nothing else scheduled nothing can change: a session still active then is
        # one the operator left Migrating with its turns held (docs/simulator.md).
        if interval and (self._active or self._lookahead is not None) and self._heap:
            self._schedule(now + interval, self._periodic_checkpoint)


def make_strategy(name: str, operator: OperatorSettings | None = None) -> Strategy:
    """Return a fresh strategy by name (see ``STRATEGIES``)."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}"
        ) from None
    if cls is Operator:
        return Operator((operator or OperatorSettings()).label())
    return cls()


def simulate(
    sessions: Iterable[Session],
    strategy: str | Strategy,
    fleet: FleetConfig | None = None,
    operator: OperatorSettings | None = None,
    disruptions: Sequence[Disruption] = (),
    **options: object,
) -> SimResult:
    """Run one strategy over a workload and return what it measured.

    ``options`` are passed to :class:`Simulation` (``expected_sessions``,
    ``progress``, ``bin_seconds``).
    """
    chosen = make_strategy(strategy, operator) if isinstance(strategy, str) else strategy
    return Simulation(sessions, chosen, fleet, operator, disruptions, **options).run()  # type: ignore[arg-type]

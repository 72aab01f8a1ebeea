"""``kubectl sessionfleet``: the plugin's command line and its I/O, kept thin.

kubectl runs ``kubectl-sessionfleet`` from PATH for ``kubectl sessionfleet ...``. Each
subcommand reads what it needs from the API server with the project's own client
(:class:`~sessionfleet.kube.Kube`), writes at most one object, and hands the rest to
the pure builders of :mod:`sessionfleet.kubectl.views` (one module per part of the
output).

Exit status: 0 when the command did what it says; 1 when an object is missing, the API
server refused, or a checkpoint failed or timed out (with one line on stderr, the
server's own message for API errors, never a traceback); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TextIO

import yaml

from sessionfleet._version import __version__
from sessionfleet.api import InferenceWorker, format_duration, parse, parse_duration
from sessionfleet.kube import (
    CHECKPOINTS,
    CORE_EVENTS,
    DRAIN_POLICIES,
    EVENTS,
    SESSIONS,
    WORKERS,
    ApiUnavailable,
    Gone,
    Kube,
    KubeConfig,
    KubeError,
    NotFound,
    Resource,
)
from sessionfleet.kubectl.views.checkpoints import (
    checkpoint_done,
    checkpoint_phase,
    checkpoint_summary,
    manual_checkpoint,
)
from sessionfleet.kubectl.views.drain import drain_preview, undrain_summary
from sessionfleet.kubectl.views.events import events_about
from sessionfleet.kubectl.views.explain import explain_session, explain_session_record
from sessionfleet.kubectl.views.sessions import matching_sessions, session_record, sessions_text
from sessionfleet.kubectl.views.snapshot import Snapshot, snapshot
from sessionfleet.kubectl.views.status import status_json, status_text
from sessionfleet.resources.names import session_object_name

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

PROG = "kubectl sessionfleet"
FIELD_MANAGER = "kubectl-sessionfleet"
OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
"""A DNS subdomain: what may be read by name (another session id is searched for)."""
OUTPUTS = ("text", "json", "yaml")
"""``-o``: text for people (the default), or the same answer as one JSON or YAML document."""
DEFAULT_CHECKPOINT_TIMEOUT = "15m"
"""As long as the operator gives a checkpoint (its ``--checkpoint-timeout``)."""


class Api(Protocol):
    """The part of :class:`~sessionfleet.kube.Kube` the plugin uses (a fake in tests)."""

    async def get(
        self, resource: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any]:
        """Return one object."""

    async def list(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        chunk: int = 500,
    ) -> tuple[list[dict[str, Any]], str]:
        """Return every object and the list's resourceVersion."""

    async def create(
        self, resource: Resource, body: Mapping[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        """Create an object."""

    async def patch(
        self,
        resource: Resource,
        name: str,
        body: Any,
        namespace: str | None = None,
        *,
        status: bool = False,
        patch_type: Any = "merge",
        resource_version: int | str | None = None,
    ) -> dict[str, Any]:
        """Patch an object."""

    def watch(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        resource_version: str = "",
        timeout_seconds: int = 300,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield ``(type, object)`` events."""

    async def aclose(self) -> None:
        """Close the connections."""


@dataclass(frozen=True)
class Connection:
    """A client and what the kubeconfig says beside it."""

    api: Api
    server: str
    namespace: str | None
    """The kubeconfig context's namespace (or the pod's), if it names one."""


Connect = Callable[[argparse.Namespace], Connection]


def connect(args: argparse.Namespace) -> Connection:
    """Return a client for ``--kubeconfig``/``$KUBECONFIG``/in-cluster and ``--context``."""
    config = KubeConfig.load(args.kubeconfig, args.context)
    api = Kube(
        config, field_manager=FIELD_MANAGER, user_agent=f"kubectl-sessionfleet/{__version__}"
    )
    return Connection(api, config.server, config.namespace)


class Missing(Exception):
    """An object the command needs does not exist: a message, exit status 1."""


@dataclass
class Context:
    """What a subcommand works with."""

    api: Api
    namespace: str | None
    """The namespace, or ``None`` with ``--all-namespaces``."""
    out: TextIO
    err: TextIO
    clock: Callable[[], datetime]

    def print(self, text: str = "") -> None:
        """Write a line (or lines) to the output."""
        print(text, file=self.out, flush=True)

    def note(self, text: str) -> None:
        """Write a line to the error stream: progress beside a JSON or YAML document."""
        print(text, file=self.err, flush=True)

    def document(self, data: Any, output: str) -> None:
        """Write ``data`` as one JSON or YAML document (``output`` is not ``text``)."""
        self.print(render(data, output))

    @property
    def ns(self) -> str:
        """The namespace of a command that acts on one object (never all namespaces)."""
        return self.namespace or "default"


def render(data: Any, output: str) -> str:
    """Return ``data`` (JSON-ready) as ``-o json`` or ``-o yaml`` writes it.

    JSON indented by two, as kubectl writes it; YAML in block style with the keys in the
    order the builders give them (kubectl's own order is the object's), never a Python tag.
    """
    if output == "json":
        return json.dumps(data, indent=2)
    if output == "yaml":
        text: str = yaml.safe_dump(
            data, sort_keys=False, default_flow_style=False, allow_unicode=True
        )
        return text.rstrip("\n")
    raise ValueError(f"no document for output {output!r}")


# --- reading --------------------------------------------------------------------------


async def _items(ctx: Context, resource: Resource, namespace: str | None) -> list[dict[str, Any]]:
    items, _ = await ctx.api.list(resource, namespace)
    return items


async def _fleet(ctx: Context, namespace: str | None) -> Snapshot:
    workers, sessions, policies = await asyncio.gather(
        _items(ctx, WORKERS, namespace),
        _items(ctx, SESSIONS, namespace),
        _items(ctx, DRAIN_POLICIES, namespace),
    )
    return snapshot(workers, sessions, policies)


async def _worker(ctx: Context, name: str) -> dict[str, Any]:
    try:
        return await ctx.api.get(WORKERS, name, ctx.ns)
    except NotFound:
        raise Missing(f'InferenceWorker "{name}" not found in namespace "{ctx.ns}"') from None


def _parsed_worker(body: Mapping[str, Any]) -> InferenceWorker:
    read = parse(InferenceWorker, body)
    if read.obj is None:
        name = (body.get("metadata") or {}).get("name")
        raise Missing(f'InferenceWorker "{name}" cannot be read: {read.message}')
    return read.obj


# --- subcommands ----------------------------------------------------------------------


async def cmd_status(ctx: Context, args: argparse.Namespace) -> int:
    """``status``: the workers, their sessions and drains, and the sessions by phase."""
    snap = await _fleet(ctx, ctx.namespace)
    now = ctx.clock()
    if args.output != "text":
        ctx.document(status_json(snap, now, ctx.namespace), args.output)
    else:
        ctx.print(status_text(snap, now, ctx.namespace))
    return EXIT_OK


async def cmd_sessions(ctx: Context, args: argparse.Namespace) -> int:
    """``sessions``: one row per session, optionally only those bound to one worker."""
    if args.worker and ctx.namespace is not None:
        await _worker(ctx, args.worker)
    snap = snapshot(sessions=await _items(ctx, SESSIONS, ctx.namespace))
    sessions = [s for s in snap.sessions if not args.worker or s.status.worker == args.worker]
    now = ctx.clock()
    if args.output != "text":
        ctx.document([session_record(s, now) for s in sessions], args.output)
    else:
        ctx.print(sessions_text(sessions, now, ctx.namespace))
    for problem in snap.unreadable:
        print(problem.describe(), file=ctx.err)
    return EXIT_OK


async def _find_session(ctx: Context, key: str) -> dict[str, Any]:
    """Return the session named ``key``, or whose ``spec.sessionId`` is ``key``.

    Two reads by name first (``key`` itself, and the name the router gives the session
    id ``key``), then the namespace's sessions searched by id.
    """
    names = [key] if OBJECT_NAME.fullmatch(key) else []
    for name in dict.fromkeys([*names, session_object_name(key)]):
        try:
            return await ctx.api.get(SESSIONS, name, ctx.ns)
        except NotFound:
            continue
    found = matching_sessions(await _items(ctx, SESSIONS, ctx.ns), key)
    if not found:
        raise Missing(
            f'AgentSession "{key}" not found in namespace "{ctx.ns}" '
            "(looked for an object of that name and a spec.sessionId of that value)"
        )
    if len(found) > 1:
        carriers = ", ".join(sorted(str(b["metadata"]["name"]) for b in found))
        raise Missing(f'session id "{key}" is carried by several AgentSessions: {carriers}')
    return dict(found[0])


async def _events(ctx: Context, name: str) -> tuple[list[list[dict[str, Any]]], str | None]:
    """List both event APIs' events about objects called ``name``; a refusal is a note."""
    selectors = ((EVENTS, f"regarding.name={name}"), (CORE_EVENTS, f"involvedObject.name={name}"))
    listings: list[list[dict[str, Any]]] = []
    problems = []
    for resource, selector in selectors:
        try:
            items, _ = await ctx.api.list(resource, ctx.ns, field_selector=selector)
        except KubeError as error:
            problems.append(f"{resource.group or 'core'}/{resource.version}: {error.message}")
            continue
        listings.append(items)
    problem = None
    if problems and not listings:
        problem = "events could not be listed: " + "; ".join(problems)
    return listings, problem


async def cmd_explain(ctx: Context, args: argparse.Namespace) -> int:
    """``explain session S``: why a session is where it is, from conditions and events."""
    body = await _find_session(ctx, args.name)
    read = snapshot(sessions=[body])
    if not read.sessions:
        raise Missing(read.unreadable[0].describe())
    session = read.sessions[0]
    snap, (listings, problem) = await asyncio.gather(
        _fleet(ctx, ctx.ns), _events(ctx, session.metadata.name)
    )
    events = events_about("AgentSession", session.metadata.name, session.metadata.uid, *listings)
    if args.output != "text":
        record = explain_session_record(session, events, snap, ctx.clock(), events_problem=problem)
        ctx.document(record, args.output)
        return EXIT_OK
    ctx.print(explain_session(session, events, snap, ctx.clock(), events_problem=problem))
    return EXIT_OK


async def _set_drain(ctx: Context, args: argparse.Namespace, drain: bool) -> int:
    body = await _worker(ctx, args.worker)
    worker = _parsed_worker(body)
    snap = await _fleet(ctx, ctx.ns)
    if worker.spec.drain != drain and not args.dry_run:
        await ctx.api.patch(WORKERS, args.worker, {"spec": {"drain": drain}}, ctx.ns)
    now = ctx.clock()
    if drain:
        text = drain_preview(snap, worker, now, dry_run=args.dry_run, was_set=worker.spec.drain)
    else:
        text = undrain_summary(snap, worker, now, dry_run=args.dry_run, was_set=worker.spec.drain)
    ctx.print(text)
    return EXIT_OK


async def cmd_drain(ctx: Context, args: argparse.Namespace) -> int:
    """``drain W``: set ``spec.drain`` and show what the governing policy will do."""
    return await _set_drain(ctx, args, True)


async def cmd_undrain(ctx: Context, args: argparse.Namespace) -> int:
    """``undrain W``: clear ``spec.drain`` and say what follows."""
    return await _set_drain(ctx, args, False)


async def cmd_checkpoint(ctx: Context, args: argparse.Namespace) -> int:
    """``checkpoint W``: ask for a Manual checkpoint and, with ``--wait``, see it end.

    With ``-o json|yaml`` the output is the WorkerCheckpoint as the API server last
    returned it (the created object with ``--no-wait``, else the finished one, or the last
    seen at a timeout), and the progress lines go to the error stream.
    """
    say = ctx.print if args.output == "text" else ctx.note
    await _worker(ctx, args.worker)
    created = await ctx.api.create(CHECKPOINTS, manual_checkpoint(args.worker, ctx.ns), ctx.ns)
    name = str(created["metadata"]["name"])
    say(f"WorkerCheckpoint {ctx.ns}/{name} created for worker {args.worker} (reason Manual)")
    if not args.wait:
        if args.output != "text":
            ctx.document(created, args.output)
        return EXIT_OK
    timeout: timedelta = args.timeout
    started = asyncio.get_running_loop().time()
    shown = ""
    latest: Mapping[str, Any] = created

    def show(body: Mapping[str, Any]) -> bool | None:
        """Print the phase when it changed; return whether the checkpoint is over."""
        nonlocal shown, latest
        latest = body
        phase = checkpoint_phase(body)
        if phase != shown:
            elapsed = asyncio.get_running_loop().time() - started
            say(f"{elapsed:6.1f}s  {phase}")
            shown = phase
        return checkpoint_done(body)

    try:
        async with asyncio.timeout(timeout.total_seconds()):
            final = await _watch_until_done(ctx, name, created, show)
    except TimeoutError:
        say(
            f"timed out after {format_duration(timeout)}: the checkpoint is still "
            f"{shown or 'Pending'} (kubectl get wcp {name} -n {ctx.ns})"
        )
        if args.output != "text":
            ctx.document(latest, args.output)
        return EXIT_FAILED
    say(checkpoint_summary(final))
    if args.output != "text":
        ctx.document(final, args.output)
    return EXIT_OK if checkpoint_done(final) else EXIT_FAILED


async def _watch_until_done(
    ctx: Context,
    name: str,
    created: dict[str, Any],
    show: Callable[[Mapping[str, Any]], bool | None],
) -> dict[str, Any]:
    """Watch one checkpoint from its creation until it Succeeded or Failed; return it.

    The watch starts at the creation's resourceVersion, so no change is missed; it is
    resumed when the server ends it, and started again from a fresh read when that
    version has expired or the connection broke.
    """
    current = created
    version = str(created["metadata"].get("resourceVersion", ""))
    if show(current) is not None:
        return current
    while True:
        try:
            async for kind, obj in ctx.api.watch(
                CHECKPOINTS,
                ctx.ns,
                resource_version=version,
                timeout_seconds=60,
                field_selector=f"metadata.name={name}",
            ):
                version = str(obj.get("metadata", {}).get("resourceVersion", version))
                if kind == "DELETED":
                    raise Missing(f"WorkerCheckpoint {ctx.ns}/{name} was deleted")
                if kind in ("ADDED", "MODIFIED"):
                    current = obj
                    if show(current) is not None:
                        return current
        except (Gone, ApiUnavailable):
            await asyncio.sleep(1)
            try:
                current = await ctx.api.get(CHECKPOINTS, name, ctx.ns)
            except NotFound:
                raise Missing(f"WorkerCheckpoint {ctx.ns}/{name} was deleted") from None
            version = str(current["metadata"].get("resourceVersion", ""))
            if show(current) is not None:
                return current


# --- the command line -----------------------------------------------------------------


def _duration(text: str) -> timedelta:
    try:
        value = parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not value:
        raise argparse.ArgumentTypeError(f"must be longer than 0s, not {text}")
    return value


def _connection_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """Add the flags every subcommand takes, before or after its name.

    On the subcommands their default is "not given", so a flag written before the
    subcommand's name is not undone by the subcommand's own default.
    """
    default: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument(
        "--kubeconfig",
        **({"default": None} | default),
        help="the kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)",
    )
    parser.add_argument(
        "--context", **({"default": None} | default), help="the kubeconfig context to use"
    )
    parser.add_argument(
        "-n",
        "--namespace",
        **({"default": None} | default),
        help="the namespace (default: the context's, else default)",
    )


def _all_namespaces(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="every namespace (overrides --namespace)",
    )


def _output(parser: argparse.ArgumentParser, document: str) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="text",
        help=f"text (default), json or yaml; as json or yaml, {document}",
    )


def build_parser() -> argparse.ArgumentParser:
    """Return the plugin's argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Inspect and operate a sessionfleet: workers, sessions, drains and checkpoints. "
            "Run as a kubectl plugin: kubectl sessionfleet COMMAND."
        ),
    )
    parser.add_argument(
        "--version", action="version", version=f"kubectl-sessionfleet {__version__}"
    )
    _connection_flags(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, func: Callable[..., Any]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        _connection_flags(sub, top=False)
        sub.set_defaults(func=func)
        return sub

    status = command(
        "status", "the fleet at a glance: workers, their sessions and drains", cmd_status
    )
    _all_namespaces(status)
    _output(status, "one document: the workers and the sessions by phase")

    sessions = command(
        "sessions", "list sessions: id, phase, worker, turns, context, age", cmd_sessions
    )
    sessions.add_argument("--worker", metavar="W", help="only the sessions bound to worker W")
    _all_namespaces(sessions)
    _output(sessions, "one document: a list of the sessions")

    explain = command("explain", "why a session is Pending, or where it is migrating", cmd_explain)
    explain.add_argument("kind", choices=("session",), help="what to explain: session")
    explain.add_argument("name", metavar="S", help="the AgentSession's name or its session id")
    _output(explain, "one document: the explanation as data")

    for name, verb, func in (
        ("drain", "set spec.drain on a worker and show what its DrainPolicy will do", cmd_drain),
        ("undrain", "clear spec.drain on a worker", cmd_undrain),
    ):
        sub = command(name, verb, func)
        sub.add_argument("worker", metavar="W", help="the InferenceWorker")
        sub.add_argument(
            "--dry-run", action="store_true", help="show what would happen; change nothing"
        )

    checkpoint = command(
        "checkpoint", "take a Manual WorkerCheckpoint of a worker and wait for it", cmd_checkpoint
    )
    checkpoint.add_argument("worker", metavar="W", help="the InferenceWorker")
    checkpoint.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="watch it until Succeeded (exit 0) or Failed (exit 1); default: wait",
    )
    checkpoint.add_argument(
        "--timeout",
        type=_duration,
        default=_duration(DEFAULT_CHECKPOINT_TIMEOUT),
        metavar="D",
        help="give up waiting after D, such as 90s or 15m "
        f"(exit 1; default {DEFAULT_CHECKPOINT_TIMEOUT})",
    )
    _output(
        checkpoint,
        "the WorkerCheckpoint as the API server last returned it; the progress goes to stderr",
    )
    return parser


def _explain_error(error: KubeError, server: str) -> str:
    """Return one line for an API error: the server's own message, with a hint where one helps."""
    if isinstance(error, ApiUnavailable) and not error.status:
        return f"cannot reach the API server at {server}: {error.message}"
    if isinstance(error, NotFound) and "could not find the requested resource" in error.message:
        return f"{error.message} (are the sessionfleet CRDs installed?)"
    return error.message


def main(
    argv: Sequence[str] | None = None,
    *,
    connector: Connect = connect,
    out: TextIO | None = None,
    err: TextIO | None = None,
    clock: Callable[[], datetime] | None = None,
) -> int:
    """Run the plugin; return the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a usage error (already printed)
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    try:
        connection = connector(args)
    except Exception as error:  # kubeconfig missing or malformed: the loader's message says so
        print(f"error: cannot load the Kubernetes configuration: {error}", file=err)
        return EXIT_FAILED
    namespace = (
        None
        if getattr(args, "all_namespaces", False)
        else (args.namespace or connection.namespace or "default")
    )
    ctx = Context(connection.api, namespace, out, err, clock or (lambda: datetime.now(UTC)))

    async def run() -> int:
        try:
            status: int = await args.func(ctx, args)
            return status
        finally:
            await connection.api.aclose()

    try:
        return asyncio.run(run())
    except Missing as error:
        print(f"error: {error}", file=err)
    except KubeError as error:
        print(f"error: {_explain_error(error, connection.server)}", file=err)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_FAILED

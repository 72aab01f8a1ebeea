"""A TCP proxy on loopback that breaks connections on demand, for chaos tests.

``FaultProxy`` listens on ``127.0.0.1:<free port>`` and forwards every connection
to one target (the API server, a backed pod, ...). It forwards bytes only, so TLS
passes through untouched: a client that verifies the API server's certificate still
does. The tests are synchronous, so the proxy runs its own asyncio loop in a
background thread; every method is called from the test's thread::

    with FaultProxy.for_url(cluster.api_server) as proxy:
        kubeconfig = proxied_kubeconfig(cluster.kubeconfig, proxy, tmp_path / "kubeconfig")
        ...                      # a client or the operator uses `kubeconfig`
        proxy.cut()              # every open connection is closed, both sides
        with proxy.blocked():    # new connections are accepted and closed at once
            ...

Faults:

- ``cut()`` closes every current connection at once, on both sides (client and
  target), while new connections are still accepted and forwarded. ``cut(reset=True)``
  makes the close an RST (``SO_LINGER`` 0) instead of a FIN.
- ``block()`` / ``unblock()`` (or the ``blocked()`` context manager): while blocked,
  a new connection is accepted and closed at once, before anything is forwarded (a
  client sees the connection reset or closed, as from a server that is going away).
  Connections open when ``block()`` is called carry on; ``cut()`` them too for a full
  outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import yaml

_BUFFER = 64 * 1024


class _Connection:
    """One proxied connection: the client's side, and the target's once connected."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.target: asyncio.StreamWriter | None = None
        self.cut = False

    def close(self, *, reset: bool) -> None:
        """Abort both sides now, without flushing what is buffered."""
        self.cut = True
        for writer in (self.client, self.target):
            if writer is None:
                continue
            if reset:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
            writer.transport.abort()


class FaultProxy:
    """Forward TCP connections from a loopback port to a target; cut or refuse them.

    Args:
        target_host: where connections are forwarded to.
        target_port: the target's port.
        listen_host: the address to listen on.
        listen_port: the port to listen on; 0 picks a free one (see ``port``).
        connect_timeout: bound of the connection to the target; a client whose target
            connection fails or times out is closed.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self._listen_port = listen_port
        self._connect_timeout = connect_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._live: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._blocked = False
        self._accepted = 0
        self._refused = 0
        self._port = 0

    @classmethod
    def for_url(cls, url: str, **options: Any) -> FaultProxy:
        """A proxy to the host and port of ``url`` (``https://127.0.0.1:6443``).

        A URL without a port gets its scheme's default (443 for https, 80 for http).
        """
        parts = urlsplit(url)
        if parts.hostname is None:
            raise ValueError(f"no host in {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.hostname, port, **options)

    # ------------------------------------------------------------ information

    @property
    def port(self) -> int:
        """The port the proxy listens on (known once started)."""
        if not self._port:
            raise RuntimeError("the proxy is not started")
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        """``(listen_host, port)``."""
        return (self.listen_host, self.port)

    def url(self, scheme: str = "https") -> str:
        """``scheme://listen_host:port``: the target's URL with the proxy in between."""
        return f"{scheme}://{self.listen_host}:{self.port}"

    @property
    def connections(self) -> int:
        """How many connections are open now (accepted and not closed or cut)."""
        return len(self._live)

    @property
    def accepted(self) -> int:
        """How many connections were accepted in all, refused ones (``block``) included."""
        return self._accepted

    @property
    def refused(self) -> int:
        """How many connections were accepted and closed at once while blocked."""
        return self._refused

    @property
    def is_blocked(self) -> bool:
        """Whether new connections are refused now."""
        return self._blocked

    def wait_for_connections(self, at_least: int, timeout: float = 10.0) -> int:
        """Wait until ``connections >= at_least``; returns the count.

        Raises:
            TimeoutError: if there are still fewer after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while self.connections < at_least:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.connections} connections through the proxy after {timeout:.0f} s, "
                    f"waited for {at_least}"
                )
            time.sleep(0.02)
        return self.connections

    # ----------------------------------------------------------------- faults

    def cut(self, *, reset: bool = False) -> int:
        """Close every open connection now, both sides; returns how many.

        New connections are still accepted (unless ``block``). With ``reset`` the
        sockets are closed with an RST rather than a FIN.
        """
        return int(self._call(self._cut(reset)))

    def block(self) -> None:
        """Refuse new connections: accept each and close it at once, forwarding nothing."""
        self._blocked = True

    def unblock(self) -> None:
        """Forward new connections again."""
        self._blocked = False

    @contextlib.contextmanager
    def blocked(self, *, cut: bool = False) -> Iterator[FaultProxy]:
        """``block`` for a ``with`` block (``unblock`` however it ends).

        With ``cut`` the open connections are cut first: a full outage of the target
        as its clients see it.
        """
        self.block()
        try:
            if cut:
                self.cut()
            yield self
        finally:
            self.unblock()

    # -------------------------------------------------------------- lifecycle

    def start(self) -> FaultProxy:
        """Start listening (in a background thread); returns the proxy."""
        if self._loop is not None:
            raise RuntimeError("the proxy is already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever,
            name=f"faultproxy-{self.target_host}:{self.target_port}",
            daemon=True,
        )
        self._thread.start()
        try:
            self._port = self._call(self._listen())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop listening, cut every connection and end the thread; idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
        self._loop = None
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self.listen_host}:{self._port}" if self._port else "not started"
        return (
            f"FaultProxy({where} -> {self.target_host}:{self.target_port}, "
            f"connections={self.connections}, accepted={self.accepted}, "
            f"blocked={self._blocked})"
        )

    # -------------------------------------------------------------- the loop

    def _call(self, coroutine: Any, timeout: float = 10.0) -> Any:
        """Run a coroutine on the proxy's loop and wait for its result."""
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the proxy is not started")
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout)

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(
            self._accept, self.listen_host, self._listen_port, reuse_address=True
        )
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _cut(self, reset: bool) -> int:
        connections = list(self._live)
        for connection in connections:
            connection.close(reset=reset)
        # Gone from the count now, not once their tasks have noticed.
        self._live.difference_update(connections)
        return len(connections)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut(reset=False)
        # Cut connections end their tasks; one still connecting to the target is
        # cancelled.
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accepted += 1
        if self._blocked:
            self._refused += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        connection = _Connection(writer)
        self._live.add(connection)
        try:
            await self._forward(connection, reader)
        except asyncio.CancelledError:
            pass  # stop(): the connection is closed below, like any other
        finally:
            self._live.discard(connection)
            self._tasks.discard(task)
            for side in (connection.client, connection.target):
                if side is not None:
                    side.transport.abort()

    async def _forward(self, connection: _Connection, client_reader: asyncio.StreamReader) -> None:
        try:
            target_reader, target_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port),
                self._connect_timeout,
            )
        except (OSError, TimeoutError):
            return
        connection.target = target_writer
        if connection.cut:  # cut while the target connection was being made
            return
        await asyncio.gather(
            _pipe(client_reader, target_writer),
            _pipe(target_reader, connection.client),
        )


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until EOF, then half-close ``writer``."""
    try:
        while data := await reader.read(_BUFFER):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


def proxied_kubeconfig(kubeconfig: Path, proxy: FaultProxy, dest: Path) -> Path:
    """Write a copy of ``kubeconfig`` whose clusters are reached through ``proxy``.

    Each cluster's ``server`` becomes ``<scheme>://<proxy host>:<proxy port>``;
    credentials and the CA stay as they are. The API server's certificate of this
    harness names ``127.0.0.1`` (e2e/localcluster/_pki.py, ``SERVING_SANS``), so
    the proxy's address verifies as it is; a server whose host is another name gets
    ``tls-server-name`` set to that name, so the certificate is checked against the
    name it was issued for. Returns ``dest``.
    """
    config = yaml.safe_load(kubeconfig.read_text())
    for entry in config.get("clusters") or []:
        cluster = entry["cluster"]
        server = urlsplit(cluster["server"])
        cluster["server"] = proxy.url(server.scheme or "https")
        if (
            server.scheme == "https"
            and server.hostname not in (None, proxy.listen_host)
            and "tls-server-name" not in cluster
        ):
            cluster["tls-server-name"] = server.hostname
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(config, sort_keys=False))
    dest.chmod(0o600)
    return dest

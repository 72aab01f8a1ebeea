"""The EPP's TLS: a certificate from a directory, reloaded when it changes, or one made at start.

Gateways that call an Endpoint Picker connect with TLS: kgateway always puts a TLS context
on the EPP's cluster, NGINX Gateway Fabric connects with TLS unless told otherwise, and
GAIE's sample Envoy configuration and Istio DestinationRule use TLS with verification off.
A plaintext EPP fails their handshake. Upstream's EPP serves TLS by default
(``--secure-serving``) with a self-signed certificate made at start, or the ``tls.crt``
and ``tls.key`` of ``--cert-path`` (a mounted Secret, e.g. one cert-manager issues); so
does this one (docs/gateway.md, "TLS").

The directory's files are read again, when their modification time changes, on the next
TLS handshake (gRPC's dynamic server credentials ask for the certificate per
handshake): a rotated Secret takes effect for new connections without a restart.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sessionfleet import certificates

CERT_FILE: Final = "tls.crt"
KEY_FILE: Final = "tls.key"
SELF_SIGNED_DAYS: Final = 3650
"""Upstream's self-signed certificate is valid for ten years too: nothing verifies it."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A PEM certificate chain and its private key."""

    certificate: bytes
    key: bytes


def self_signed(names: list[str] | None = None) -> KeyPair:
    """Return a new self-signed certificate for ``names`` and loopback.

    ``names`` defaults to this host's name; ``localhost`` and 127.0.0.1 are always in.
    """
    dns = list(dict.fromkeys([*(names or [socket.gethostname()]), "localhost"]))
    certificate, key = certificates.self_signed(dns[0], dns, ("127.0.0.1",), days=SELF_SIGNED_DAYS)
    return KeyPair(certificate, key)


class CertificateDirectory:
    """``tls.crt`` and ``tls.key`` of a directory, read again when either changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self.current = self._read()

    def _files(self) -> tuple[Path, Path]:
        return self.path / CERT_FILE, self.path / KEY_FILE

    def _modified(self) -> tuple[int, int]:
        cert, key = self._files()
        return cert.stat().st_mtime_ns, key.stat().st_mtime_ns

    def _read(self) -> KeyPair:
        cert, key = self._files()
        try:
            stamp = self._modified()
            pair = KeyPair(cert.read_bytes(), key.read_bytes())
        except OSError as error:
            raise ValueError(f"--cert-path {self.path}: {error}") from error
        if b"-----BEGIN" not in pair.certificate or b"-----BEGIN" not in pair.key:
            raise ValueError(f"--cert-path {self.path}: {CERT_FILE} and {KEY_FILE} must be PEM")
        self._stamp = stamp
        return pair

    def changed(self) -> KeyPair | None:
        """Return the new pair when the files changed since the last read, else None.

        A half-written rotation (a file missing or not PEM for a moment) keeps the pair
        in use: the next handshake looks again.
        """
        try:
            if self._modified() == self._stamp:
                return None
            self.current = self._read()
        except (OSError, ValueError):
            return None
        return self.current


def server_credentials(pair: KeyPair, directory: CertificateDirectory | None = None) -> Any:
    """Return gRPC server credentials for ``pair``; reloaded from ``directory`` if given."""
    import grpc

    def configuration(chosen: KeyPair) -> Any:
        return grpc.ssl_server_certificate_configuration([(chosen.key, chosen.certificate)])

    if directory is None:
        return grpc.ssl_server_credentials([(pair.key, pair.certificate)])

    def fetch() -> Any:
        fresh = directory.changed()
        return None if fresh is None else configuration(fresh)

    return grpc.dynamic_ssl_server_credentials(configuration(pair), fetch)


def credentials(cert_path: str | None) -> tuple[Any, str]:
    """Return the server credentials for ``--cert-path`` (or a new self-signed pair).

    Also return a line saying which, for the log.
    """
    if cert_path:
        directory = CertificateDirectory(cert_path)
        return server_credentials(directory.current, directory), f"TLS from {cert_path}"
    return server_credentials(self_signed()), "TLS with a self-signed certificate made at start"

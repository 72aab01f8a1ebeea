"""The node agent's TLS: a certificate from files (a mounted Secret), else one made at start.

A self-signed certificate made at start is new on every start and known to nobody
else, so the operator cannot verify it (docs/checkpoints.md says what that protects
against and what not); one from a Secret signed by a CA the operator is given
(``--agent-ca-file``) can be verified.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from pathlib import Path

from sessionfleet import certificates

SELF_SIGNED_DAYS = 365


def self_signed(node: str, addresses: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """Return a new certificate and its private key (PEM) naming ``node`` and ``addresses``."""
    return certificates.self_signed(
        f"sessionfleet-agent {node}", [node], addresses, days=SELF_SIGNED_DAYS
    )


def server_context(
    node: str,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    addresses: tuple[str, ...] = (),
) -> ssl.SSLContext:
    """Return the agent's TLS context: the given certificate, else a self-signed one."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None and key_file is not None:
        context.load_cert_chain(cert_file, key_file)
        return context
    certificate, key = self_signed(node, addresses)
    # ssl loads a chain only from files: a private directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="sessionfleet-agent-tls-") as directory:
        cert_path, key_path = Path(directory, "tls.crt"), Path(directory, "tls.key")
        cert_path.write_bytes(certificate)
        descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(descriptor, "wb") as file:
            file.write(key)
        context.load_cert_chain(cert_path, key_path)
    return context


__all__ = ["SELF_SIGNED_DAYS", "self_signed", "server_context"]

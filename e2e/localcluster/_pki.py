"""Certificates and keys for the local control plane, made with the ``openssl`` CLI.

One throw-away CA signs the API server's serving certificate and one client
certificate per identity. The control-plane components get the identities that
Kubernetes' bootstrap RBAC roles expect (``system:kube-controller-manager``,
``system:kube-scheduler``), so RBAC is exercised the way a real cluster does; the
admin identity is in ``system:masters``. ECDSA P-256 keys keep generation fast on
two cores. The ``openssl`` CLI is used because the harness may only depend on the
standard library and the project's dev dependencies.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Valid for a year: clusters live minutes, but a debugging cluster may be kept longer.
_DAYS = "365"

#: Names the API server is reached by: loopback, and the ``kubernetes`` Service, whose
#: ClusterIP is the first address of ``--service-cluster-ip-range=127.96.0.0/16``.
SERVING_SANS = (
    "IP:127.0.0.1",
    "IP:127.96.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


class PkiError(RuntimeError):
    """``openssl`` failed to produce a key or certificate."""


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Every credential file the control plane needs."""

    ca: KeyPair
    apiserver: KeyPair
    admin: KeyPair
    controller_manager: KeyPair
    scheduler: KeyPair
    service_account_key: Path
    service_account_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    """Run one openssl command, raising ``PkiError`` with its stderr on failure."""
    result = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60
    )
    if result.returncode != 0:
        raise PkiError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _config(subject: dict[str, str], extensions: dict[str, str]) -> str:
    """Return an openssl config with a fixed subject and one extension section.

    A config file of our own (rather than the system's) means no default extensions
    sneak in: Go's x509 verification rejects, for example, a leaf marked ``CA:TRUE``.
    """
    lines = ["[req]", "distinguished_name = dn", "prompt = no", "[dn]"]
    lines += [f"{key} = {value}" for key, value in subject.items()]
    lines += ["[ext]"]
    lines += [f"{key} = {value}" for key, value in extensions.items()]
    return "\n".join(lines) + "\n"


def _new_key(path: Path, cwd: Path) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        str(path),
        cwd=cwd,
    )
    path.chmod(0o600)


def _make_ca(directory: Path, pair: KeyPair) -> None:
    config = directory / "ca.cnf"
    config.write_text(
        _config(
            {"CN": "sessionfleet-e2e-ca"},
            {
                "basicConstraints": "critical,CA:TRUE",
                "keyUsage": "critical,keyCertSign,cRLSign,digitalSignature",
                "subjectKeyIdentifier": "hash",
            },
        )
    )
    _new_key(pair.key, directory)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-config",
        str(config),
        "-extensions",
        "ext",
        "-key",
        str(pair.key),
        "-days",
        _DAYS,
        "-out",
        str(pair.cert),
        cwd=directory,
    )


def _make_leaf(
    directory: Path,
    ca: KeyPair,
    pair: KeyPair,
    subject: dict[str, str],
    usage: str,
    sans: tuple[str, ...] = (),
) -> None:
    """Create ``pair``: a key and a certificate signed by ``ca`` for ``usage``."""
    name = pair.cert.stem
    extensions = {
        "basicConstraints": "critical,CA:FALSE",
        "keyUsage": "critical,digitalSignature,keyEncipherment",
        "extendedKeyUsage": "serverAuth" if usage == "server" else "clientAuth",
        "authorityKeyIdentifier": "keyid",
    }
    if sans:
        extensions["subjectAltName"] = ",".join(sans)
    config = directory / f"{name}.cnf"
    config.write_text(_config(subject, extensions))
    csr = directory / f"{name}.csr"
    _new_key(pair.key, directory)
    _openssl(
        "req",
        "-new",
        "-config",
        str(config),
        "-key",
        str(pair.key),
        "-out",
        str(csr),
        cwd=directory,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca.cert),
        "-CAkey",
        str(ca.key),
        "-set_serial",
        f"0x{secrets.token_hex(12)}",
        "-days",
        _DAYS,
        "-extfile",
        str(config),
        "-extensions",
        "ext",
        "-out",
        str(pair.cert),
        cwd=directory,
    )
    csr.unlink()


def _pair(directory: Path, name: str) -> KeyPair:
    return KeyPair(directory / f"{name}.crt", directory / f"{name}.key")


def pki_files(directory: Path) -> Pki:
    """The paths of every credential file ``make_pki`` writes into ``directory``.

    Reads nothing: a cluster found through its state directory rebuilds its
    components' command lines from these paths.
    """
    return Pki(
        ca=_pair(directory, "ca"),
        apiserver=_pair(directory, "apiserver"),
        admin=_pair(directory, "admin"),
        controller_manager=_pair(directory, "kube-controller-manager"),
        scheduler=_pair(directory, "kube-scheduler"),
        service_account_key=directory / "service-account.key",
        service_account_pub=directory / "service-account.pub",
    )


def make_pki(directory: Path) -> Pki:
    """Create a CA, serving and client certificates and the service-account key pair.

    Args:
        directory: an existing, empty directory private to this cluster.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = pki_files(directory)
    _make_ca(directory, pki.ca)
    _make_leaf(directory, pki.ca, pki.apiserver, {"CN": "kube-apiserver"}, "server", SERVING_SANS)
    _make_leaf(
        directory,
        pki.ca,
        pki.admin,
        {"O": "system:masters", "CN": "sessionfleet-e2e-admin"},
        "client",
    )
    _make_leaf(
        directory,
        pki.ca,
        pki.controller_manager,
        {"CN": "system:kube-controller-manager"},
        "client",
    )
    _make_leaf(directory, pki.ca, pki.scheduler, {"CN": "system:kube-scheduler"}, "client")
    # The API server verifies service-account tokens with the public key; the
    # controller manager's token controller and the API server's TokenRequest
    # endpoint sign with the private one.
    _new_key(pki.service_account_key, directory)
    _openssl(
        "pkey",
        "-in",
        str(pki.service_account_key),
        "-pubout",
        "-out",
        str(pki.service_account_pub),
        cwd=directory,
    )
    return pki

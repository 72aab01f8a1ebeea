"""Self-signed server certificates, for the processes that serve TLS with none given.

The node agent and the Endpoint Picker each make one at start when no certificate is
mounted; one maker keeps what such a certificate holds the same for both.
"""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(
    common_name: str, dns_names: list[str], addresses: tuple[str, ...] = (), *, days: int
) -> tuple[bytes, bytes]:
    """Return a new ECDSA P-256 certificate and its private key (PEM), valid ``days``.

    The certificate names ``dns_names`` and those of ``addresses`` that are IP addresses
    (anything else is skipped: a host name is named by ``dns_names``).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    alternatives: list[x509.GeneralName] = [x509.DNSName(dns) for dns in dns_names]
    for address in addresses:
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            continue
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem

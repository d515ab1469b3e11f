"""A tiny certificate authority (ECDSA P-256, like envtest's TinyCA) and PEM helpers.

Every cluster the lab starts gets its own CA: serving certificates for the API server and client
certificates for each identity (admin, the kubelet's node identity, the controllers).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


class CA:
    """A tiny CA (ECDSA P-256, like envtest's TinyCA) that writes PEM files."""

    def __init__(self, cn: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, cn: str, *, orgs: Iterable[str] = (), server: bool = False, hosts: Iterable[str] = ()
    ) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        sans: list[x509.GeneralName] = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, b.sign(self.key, hashes.SHA256())


def pem_cert(cert: Any) -> bytes:
    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def pem_key(key: Any) -> bytes:
    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def write_pair(directory: Path, name: str, key: Any, cert: Any) -> tuple[Path, Path]:
    """Write ``<name>.crt`` and ``<name>.key`` (private); return their paths."""
    crt, pem = directory / f"{name}.crt", directory / f"{name}.key"
    crt.write_bytes(pem_cert(cert))
    write_private(pem, pem_key(key))
    return crt, pem

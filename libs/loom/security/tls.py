"""TLS for listeners off the loopback interface: a generated CA, a server certificate, client trust.

A stack that binds NATS to an address other machines can reach (``loom up --nats-host``) requires
TLS there: ``loom up`` generates a private CA once (``<home>/secrets/tls/ca.pem``, its key 0600)
and a certificate for the bound address (and the loopback names) per server, signed by it.
Clients trust that CA only (:func:`client_context`): a client without it does not get past the
handshake, and a server that is not the stack's cannot pass for it. On loopback only, nothing
changes (the traffic never leaves the machine). PostgreSQL stays on loopback: the embedded build
Loom runs has no SSL ("FATAL: SSL is not supported by this build").

The keys are ECDSA P-256; a server certificate lasts ``SERVER_DAYS`` and is reissued at every
start, the CA lasts ``CA_DAYS`` and is kept (clients keep trusting it across restarts).
"""

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from loom.security.credentials import ENV_NATS_CA, write_secret

__all__ = ["ENV_NATS_CA", "TlsFiles", "client_context", "ensure_tls", "is_loopback"]
CA_DAYS = 3650
SERVER_DAYS = 825


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate and key, and the CA that signed it (what clients trust)."""

    ca: Path
    cert: Path
    key: Path


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, "127.0.0.1", "localhost"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def ensure_tls(
    directory: Path, hosts: list[str], *, server: str = "server", now: datetime.datetime | None = None
) -> TlsFiles:
    """The CA under ``directory`` (generated when missing) and a fresh certificate for ``hosts``
    signed by it, in ``<server>.pem`` and ``<server>-key.pem`` (one pair per server: NATS re-reads
    its own at every reload); keys are written 0600 (:func:`write_secret`)."""
    now = now or datetime.datetime.now(datetime.UTC)
    files = TlsFiles(directory / "ca.pem", directory / f"{server}.pem", directory / f"{server}-key.pem")
    ca_key_path = directory / "ca-key.pem"
    if files.ca.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_path} is not the ECDSA key Loom generated")
        ca_key = loaded
    else:
        ca_key = _key()
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Loom stack CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        write_secret(ca_key_path, _pem_key(ca_key))
        write_secret(files.ca, ca_cert.public_bytes(serialization.Encoding.PEM).decode())
        files.ca.chmod(0o644)  # the CA certificate is public: clients get a copy
    server_key = _key()
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "localhost")])
        )
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_secret(files.key, _pem_key(server_key))
    write_secret(files.cert, server_cert.public_bytes(serialization.Encoding.PEM).decode())
    return files


def client_context(ca: Path) -> ssl.SSLContext:
    """A client's TLS context that trusts only the stack's CA (not the system's), hostname checked."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context

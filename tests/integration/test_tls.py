"""TLS on listeners off the loopback interface (issue 18): the stack's generated CA.

A nats-server bound to this machine's non-loopback address with a certificate from
:func:`loom.security.tls.ensure_tls` refuses a client that does not trust the stack's CA (the
system's CAs do not vouch for it), and serves one that was given the CA (``$LOOM_NATS_CA``).
"""

import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from cryptography import x509

from loom.bus import BusError, connect
from loom.runtime.servers import NatsServer
from loom.security import ENV_NATS_CA
from loom.security.tls import TlsFiles, ensure_tls, is_loopback

pytestmark = pytest.mark.security


def _outward_address() -> str:
    """This machine's address on its default route (no packet is sent: UDP connect only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        return str(probe.getsockname()[0])


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, TlsFiles]]:
    home = tmp_path_factory.mktemp("tls-home")
    host = _outward_address()
    assert not is_loopback(host), host
    files = ensure_tls(home / "secrets" / "tls", [host])
    with NatsServer(home / "nats", host=host, tls=files) as server:
        yield server, files


async def test_a_client_without_the_stacks_ca_is_refused(tls_server: tuple[NatsServer, TlsFiles]) -> None:
    server, _ = tls_server
    assert not server.url.startswith("nats://127.")
    with pytest.raises(Exception, match=r"(?i)certificate verify failed"):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)


async def test_a_client_given_the_ca_connects_over_tls(
    tls_server: tuple[NatsServer, TlsFiles], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, files = tls_server
    monkeypatch.setenv(ENV_NATS_CA, str(files.ca))
    nc = await connect(server.url, "tls-client", first_within_s=10)
    try:
        assert nc.is_connected
        sub = await nc.subscribe("tls.check")
        await nc.publish("tls.check", b"over tls")
        assert (await sub.next_msg(timeout=5)).data == b"over tls"
    finally:
        await nc.close()
    monkeypatch.setenv(ENV_NATS_CA, str(files.ca.with_name("missing.pem")))
    with pytest.raises(BusError, match="no CA certificate"):
        await connect(server.url, "tls-client", first_within_s=2)


def test_the_ca_is_kept_and_each_server_certificate_names_its_address(tmp_path: Path) -> None:
    first = ensure_tls(tmp_path, ["10.1.2.3"])
    ca = first.ca.read_bytes()
    second = ensure_tls(tmp_path, ["node.example"])
    assert second.ca.read_bytes() == ca, "clients keep trusting the CA across restarts"
    for secret in (first.key, tmp_path / "ca-key.pem"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(second.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node.example" in names.get_values_for_type(x509.DNSName)
    assert cert.issuer == x509.load_pem_x509_certificate(ca).subject
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("node.example")

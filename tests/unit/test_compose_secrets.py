"""docker-compose is secured as ``loom up`` is (issue 18): every container its own identity and
database role, nothing anonymous, no service as the database owner, NATS's users block the one
``loom up`` writes for the same roles, PostgreSQL only over verified TLS.

No Docker engine here: the compose file is checked against the code, the generator of the ``init``
service (:func:`loom.security.compose.init_compose`) is run into a temporary directory, a real
nats-server is started from the config it wrote, and asyncpg's ``sslmode=verify-full`` is shown
against stand-in servers (the embedded PostgreSQL has no SSL).
"""

import asyncio
import shutil
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg
import nats
import pytest
import yaml
from nats.errors import Error as NatsError

from loom.cli.credentials import add_parser
from loom.runtime.pgsecrets import pgpass_password
from loom.runtime.servers import find_free_port
from loom.security import CredentialStore, admin_identity, identity_for_process, read
from loom.security.compose import (
    CA_FILE,
    CREDS_FILE,
    HTTP_TOKEN_FILE,
    MOUNT,
    PGPASS_FILE,
    SUPERUSER,
    WEBHOOK_SERVICE,
    init_compose,
)
from loom.security.tls import client_context, ensure_tls
from loom.store.roles import role_of
from loom_benchmarks.secured import nats_violations

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
LOOM = {name: svc for name, svc in SERVICES.items() if "build" in svc}
RUNNING = {name: svc for name, svc in LOOM.items() if name not in ("init", "migrate")}


def _env(svc: dict[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in (svc.get("environment") or {}).items()}


def _secrets(svc: dict[str, Any]) -> tuple[Path, str] | None:
    for volume in svc.get("volumes") or []:
        if isinstance(volume, dict) and volume.get("source") == "loom-secrets":
            assert volume.get("read_only") is True
            return Path(volume["target"]), str(volume["volume"]["subpath"])
        if isinstance(volume, str) and volume.split(":", 1)[0] == "loom-secrets":
            return Path(volume.split(":")[1]), ""
    return None


def _init_processes() -> list[str]:
    argv = [str(w) for w in SERVICES["init"]["command"]]
    assert argv[:3] == ["loom", "credentials", "init"]
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv[1:])  # the real parser: unknown flags fail here
    assert args.compose
    assert Path(args.dir) == _secrets(SERVICES["init"])[0]  # type: ignore[index]
    return list(args.process)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int, int]]:
    """init's output for compose's services, with its NATS config runnable here (ports, paths)."""
    root = tmp_path_factory.mktemp("loom-secrets")
    port, http = find_free_port(), find_free_port()
    init_compose(
        root,
        _init_processes(),
        nats_mount=str(root / "nats"),
        nats_listen=f"127.0.0.1:{port}",
        nats_http=f"127.0.0.1:{http}",
        nats_store=str(root / "data"),
    )
    yield root, port, http


# ---- the compose file --------------------------------------------------------------------------------


def test_init_issues_an_identity_to_every_long_running_service_and_only_it_mounts_them_all() -> None:
    assert sorted(_init_processes()) == sorted(RUNNING)
    assert _secrets(SERVICES["init"]) is not None
    assert _secrets(SERVICES["init"])[1] == ""  # type: ignore[index]  # the whole volume
    assert str(SERVICES["init"].get("restart")) == "no"
    for name, svc in SERVICES.items():
        mount = _secrets(svc)
        if name == "init" or mount is None:
            continue
        # Anyone else sees its own directory only, read-only, once init has written it.
        assert mount[1] == name, f"{name} mounts {mount[1]!r}: another container's secrets"
        deps = svc.get("depends_on") or {}
        assert deps.get("init", {}).get("condition") == "service_completed_successfully", name


@pytest.mark.security
@pytest.mark.parametrize("name", sorted(RUNNING))
def test_every_service_connects_as_its_own_identity_and_nothing_is_anonymous(name: str) -> None:
    svc = RUNNING[name]
    env = _env(svc)
    mount = _secrets(svc)
    assert mount is not None, f"{name}: no credentials mounted: it would connect anonymously"
    assert env.get("LOOM_CREDS") == str(mount[0] / CREDS_FILE), name
    assert env.get("LOOM_NATS_CA") == str(mount[0] / CA_FILE), name
    assert str(mount[0]) == MOUNT


@pytest.mark.security
@pytest.mark.parametrize("name", sorted(set(LOOM) - {"init"}))
def test_no_service_uses_the_owner_role_and_every_database_url_demands_verified_tls(name: str) -> None:
    owner = _env(SERVICES["postgres"])["POSTGRES_USER"]
    url = urlsplit(_env(LOOM[name])["LOOM_DATABASE_URL"])
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    mount = _secrets(LOOM[name])
    assert mount is not None
    assert query["sslmode"] == "verify-full", f"{name}: PostgreSQL without verified TLS"
    assert query["sslrootcert"] == str(mount[0] / CA_FILE), name
    if name == "migrate":
        # Migrations, grants and RLS need the superuser: the one container that logs in as it.
        assert url.username == owner == SUPERUSER
    else:
        assert url.username != owner, f"{name} logs in as the database owner"
        assert url.username == (role_of(name) or "loom_none"), f"{name}: not its own role"
    if url.username != "loom_none":
        assert query["passfile"] == str(mount[0] / PGPASS_FILE), name


def test_postgres_serves_tls_and_refuses_plain_tcp_logins(generated: tuple[Path, int, int]) -> None:
    root, _, _ = generated
    pg = SERVICES["postgres"]
    script = pg["command"][-1]
    assert pg["command"][:2] == ["sh", "-c"]
    server = script.split("exec ", 1)[1].split()
    assert server[:2] == ["docker-entrypoint.sh", "postgres"]
    settings = dict(w.split("=", 1) for w in server[2:] if w != "-c")
    assert settings["ssl"] == "on"
    hba = Path(settings["hba_file"])
    assert (root / "postgres" / hba.name).exists()
    lines = [ln.split() for ln in (root / "postgres" / hba.name).read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln[0].startswith("#")]
    assert {r[0] for r in rules} == {"local", "hostssl"}, "a `host` line would accept TCP without TLS"
    assert all(r[-1] == "scram-sha-256" for r in rules), "no trust, no md5"
    for key in ("ssl_cert_file", "ssl_key_file"):
        assert (root / "postgres" / Path(settings[key]).name).exists()
    assert Path(_env(pg)["POSTGRES_PASSWORD_FILE"]).name in script


# ---- what init writes ---------------------------------------------------------------------------------


@pytest.mark.security
def test_each_directory_holds_that_container_s_identity_and_role_only_and_is_private(
    generated: tuple[Path, int, int],
) -> None:
    root, _, _ = generated
    assert stat.S_IMODE(root.stat().st_mode) == 0o700, "the secrets' own directory (it was 0755)"
    for name in RUNNING:
        directory = root / name
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, name
        for path in directory.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert read(directory / CREDS_FILE).identity == identity_for_process(name).name
        role = role_of(name)
        if role is None:
            assert not (directory / PGPASS_FILE).exists(), f"{name} uses no database"
        else:
            line = (directory / PGPASS_FILE).read_text()
            assert line.split(":")[3] == role, name
            # The same password migrate gives that role.
            assert pgpass_password(directory / PGPASS_FILE) == pgpass_password(
                root / "migrate" / "roles" / f"{role}.pgpass"
            )
    assert pgpass_password(root / "migrate" / PGPASS_FILE) == (
        (root / "postgres" / "superuser-password").read_text().strip()
    )
    # The webhook, the one Loom endpoint compose publishes to the host, asks for a token the
    # operator has too; no other container holds it.
    token = (root / "operator" / HTTP_TOKEN_FILE).read_text().strip()
    assert len(token) >= 32 and stat.S_IMODE((root / "operator" / HTTP_TOKEN_FILE).stat().st_mode) == 0o600
    holders = {name for name in RUNNING if (root / name / HTTP_TOKEN_FILE).exists()}
    assert holders == {WEBHOOK_SERVICE}
    assert (root / WEBHOOK_SERVICE / HTTP_TOKEN_FILE).read_text().strip() == token
    env = _env(SERVICES[WEBHOOK_SERVICE])
    assert env["LOOM_WEBHOOK_TOKEN_FILE"] == f"{MOUNT}/{HTTP_TOKEN_FILE}"
    # Not the variable that guards /metrics too: compose's Prometheus scrapes it with no token.
    assert not any("LOOM_HTTP_TOKEN_FILE" in _env(svc) for svc in RUNNING.values())


@pytest.mark.security
def test_the_users_block_is_the_one_loom_up_writes_for_the_same_roles(
    generated: tuple[Path, int, int], tmp_path: Path
) -> None:
    root, _, _ = generated
    # `loom up`'s own path (Supervisor._issue_credentials) with the same seeds.
    store = CredentialStore(tmp_path)
    store.dir.mkdir(parents=True)
    for creds in (root / "store" / "nats").glob("*.creds"):
        shutil.copy(creds, store.dir / creds.name)
    store.ensure_all([admin_identity(), *(identity_for_process(n) for n in _init_processes())])
    assert (root / "nats" / "auth.conf").read_text() == store.auth_path.read_text()


@pytest.mark.security
def test_a_real_nats_server_on_init_s_config_refuses_the_anonymous_and_enforces_roles(
    generated: tuple[Path, int, int],
) -> None:
    root, port, _ = generated
    binary = Path(sys.executable).parent / "nats-server"
    log = root / "nats.log"
    proc = subprocess.Popen([str(binary), "-c", str(root / "nats" / "nats.conf"), "-l", str(log)])
    try:
        asyncio.run(_exercise(root, port))
    finally:
        proc.terminate()
        proc.wait(10)
    # What the benchmarks count to say a secured run was refused nothing (loom_benchmarks.secured).
    assert nats_violations([log]) == 1


async def _exercise(root: Path, port: int) -> None:
    url = f"nats://127.0.0.1:{port}"
    tls = client_context(root / "operator" / CA_FILE)
    for _ in range(100):  # until it listens
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.05)
    with pytest.raises(NatsError):  # no credentials: refused
        await nats.connect(url, tls=tls, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
    with pytest.raises((ssl.SSLError, OSError, NatsError)):  # no TLS: refused
        await nats.connect(url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    creds = read(root / "agent-c-use2-a" / CREDS_FILE)
    agent = await nats.connect(
        url,
        tls=tls,
        nkeys_seed_str=creds.seed,
        inbox_prefix=f"_INBOX.{creds.identity}",
        error_cb=on_error,
        allow_reconnect=False,
    )
    try:
        await agent.publish("loom.clusters.c-use2-a.heartbeat", b"{}")
        await agent.flush()
        assert errors == []
        await agent.publish("loom.clusters.c-euc1-a.heartbeat", b"{}")  # another cluster's
        await agent.flush()
        for _ in range(40):
            if errors:
                break
            await asyncio.sleep(0.05)
        assert any("permissions violation" in e.lower() for e in errors), errors
    finally:
        await agent.close()


# ---- PostgreSQL over TLS: what the services' URLs demand ----------------------------------------------


async def _fake_postgres(ssl_context: ssl.SSLContext | None, seen: list[bytes]) -> asyncio.Server:
    """Answers the SSLRequest as PostgreSQL does: 'S' and a TLS handshake, or 'N' (no SSL: the
    embedded build); records the startup message a client sends after it."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(8)  # SSLRequest
            writer.write(b"S" if ssl_context else b"N")
            await writer.drain()
            if ssl_context is not None:
                await writer.start_tls(ssl_context)
            seen.append(await reader.readexactly(8))
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _connect(server: asyncio.Server, ca: Path) -> None:
    port = server.sockets[0].getsockname()[1]
    url = f"postgresql://loom_placement@127.0.0.1:{port}/loom?sslmode=verify-full&sslrootcert={ca}"
    await asyncpg.connect(url, password="x", timeout=5)


@pytest.mark.security
def test_verify_full_speaks_tls_with_the_generated_ca_and_refuses_anything_else(
    generated: tuple[Path, int, int], tmp_path: Path
) -> None:
    root, _, _ = generated
    ca = root / "postgres" / CA_FILE
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(root / "postgres" / "server.pem", root / "postgres" / "server-key.pem")
    other = ensure_tls(tmp_path / "other-ca", ["postgres"], server="postgres")

    async def scenario() -> None:
        seen: list[bytes] = []
        server = await _fake_postgres(context, seen)
        async with server:
            # The stack's CA: the handshake succeeds and the login goes on inside TLS.
            with pytest.raises((ConnectionError, asyncpg.PostgresError, OSError)):
                await _connect(server, ca)
            assert len(seen) == 1
            # Another CA (a server that is not the stack's): refused before any login is sent.
            with pytest.raises(ssl.SSLCertVerificationError):
                await _connect(server, other.ca)
            assert len(seen) == 1
        plain: list[bytes] = []
        server = await _fake_postgres(None, plain)
        async with server:
            # A server without SSL (as the embedded build): verify-full never falls back to clear.
            with pytest.raises(ConnectionError, match="SSL"):
                await _connect(server, ca)
            assert plain == []

    asyncio.run(scenario())


# ---- the embedded PostgreSQL listens on loopback only ------------------------------------------------


@pytest.mark.security
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "db.example.org", "192.168.0.7"])
def test_loom_up_refuses_a_postgres_listen_address_off_loopback(
    host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loom.runtime import stack

    monkeypatch.delenv("LOOM_DATABASE_URL", raising=False)  # the embedded PostgreSQL, not an external one
    monkeypatch.setenv("LOOM_HOME", str(tmp_path / "cli-home"))
    from loom.runtime.servers import PostgresServer, PublicPostgresError

    with pytest.raises(PublicPostgresError, match="no SSL"):
        stack.up(tmp_path / "home", stack.StackOptions(postgres_host=host))
    assert not (tmp_path / "home").exists(), "refused before anything was written or started"
    with pytest.raises(PublicPostgresError):
        PostgresServer(tmp_path / "pg", host=host)
    # The CLI says why and exits 1.
    from loom.cli.main import main

    assert main(["up", "--postgres-host", host]) == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_postgres_addresses_are_accepted_and_passed_to_the_supervisor(
    host: str, tmp_path: Path
) -> None:
    from loom.runtime import stack
    from loom.runtime.servers import PostgresServer

    server = PostgresServer(tmp_path / "pg", port=5999, host=host)
    assert f"listen_addresses={host}" in server._command()
    assert urlsplit(server.url).hostname == host.strip("[]")
    argv = stack.supervisor_argv(tmp_path, stack.StackOptions(postgres_host=host))
    assert argv[argv.index("--postgres-host") + 1] == host


def test_nats_conf_is_what_loom_up_writes_for_the_same_listener_tls_and_users(tmp_path: Path) -> None:
    from loom.runtime.servers import NatsServer
    from loom.security.compose import NATS_MOUNT, compose_nats_config
    from loom.security.tls import TlsFiles

    mount = Path(NATS_MOUNT)
    tls = TlsFiles(mount / CA_FILE, mount / "server.pem", mount / "server-key.pem")
    # `loom up --nats-host 0.0.0.0` on port 4222, its users block beside its config.
    server = NatsServer(
        tmp_path, 4222, monitor_port=8222, server_name="loom-nats-1", authorization=tmp_path / "auth.conf",
        host="0.0.0.0", tls=tls,
    )  # fmt: skip
    server._prepare(0.0)
    loom_up = server.config_path.read_text().splitlines()[1:]  # without the header comment
    # Compose differs only where a container must: monitoring reachable from the host's port
    # mapping, JetStream on the nats-data volume.
    compose = compose_nats_config(http="127.0.0.1:8222", store_dir=str(tmp_path)).splitlines()[1:]
    assert compose == loom_up


@pytest.mark.security
def test_the_webhook_token_is_kept_across_inits_and_renewed_by_rotate(tmp_path: Path) -> None:
    processes = [WEBHOOK_SERVICE, "placement"]
    init_compose(tmp_path, processes)
    first = (tmp_path / "operator" / HTTP_TOKEN_FILE).read_text()
    init_compose(tmp_path, processes)
    assert (tmp_path / "operator" / HTTP_TOKEN_FILE).read_text() == first  # Alertmanager keeps posting
    init_compose(tmp_path, processes, rotate=True)
    renewed = (tmp_path / "operator" / HTTP_TOKEN_FILE).read_text()
    assert renewed != first and (tmp_path / WEBHOOK_SERVICE / HTTP_TOKEN_FILE).read_text() == renewed


def test_an_unknown_process_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # It exited 2 naming the process but left the secrets directory behind, empty.
    target = tmp_path / "secrets"
    with pytest.raises(ValueError, match="bogus-service"):
        init_compose(target, ["placement", "bogus-service"])
    assert not target.exists()

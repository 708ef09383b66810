"""The local HTTP endpoints' bearer token: `/metrics`, the webhook (the trace store's own test is in
test_spanstore.py). They show every tenant's usage and cost, or raise incidents: on a secured
stack another user of the host must not reach them, and `/metrics` must not listen beyond
loopback unless told."""

import asyncio
import json
import socket
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from loom.runtime.servers import find_free_port
from loom.security.http_token import (
    ENV_HTTP_TOKEN_FILE,
    ENV_TRACES_TOKEN_FILE,
    TokenFile,
    authorized,
    bearer_header,
    ensure_http_token,
    http_token_from_env,
    rotate_http_token,
)
from loom.telemetry.metrics import ENV_METRICS_ADDR, serve_metrics
from loom_services.alert_correlator.receiver import Answer, Receiver


def test_only_the_bearer_token_itself_is_authorized() -> None:
    assert authorized(None, None) and authorized("anything", None)  # nothing asked for: open
    assert authorized("Bearer t0k", "t0k") and authorized("bearer  t0k ", "t0k")
    for header in (None, "", "Bearer", "Bearer t0", "Bearer t0kk", "Basic t0k", "t0k", "Bearer T0K"):
        assert not authorized(header, "t0k"), header


def test_a_stacks_token_file_is_the_owners_alone_and_kept_across_restarts(tmp_path: Path) -> None:
    path = ensure_http_token(tmp_path)
    token = path.read_text().strip()
    assert len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ensure_http_token(tmp_path) == path and path.read_text().strip() == token  # a scraper keeps it
    path.write_text("\n")  # an emptied file gets a new token rather than leaving the endpoints open
    assert ensure_http_token(tmp_path).read_text().strip() not in ("", token)


def test_a_token_variable_that_gives_no_token_is_an_error_not_an_open_endpoint(tmp_path: Path) -> None:
    assert http_token_from_env({}) is None
    assert http_token_from_env({ENV_HTTP_TOKEN_FILE: " "}) is None
    with pytest.raises(ValueError, match=ENV_HTTP_TOKEN_FILE):
        http_token_from_env({ENV_HTTP_TOKEN_FILE: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="no token"):
        http_token_from_env({ENV_HTTP_TOKEN_FILE: str(tmp_path / "empty")})
    (tmp_path / "t").write_text("abc\n")
    assert http_token_from_env({ENV_HTTP_TOKEN_FILE: str(tmp_path / "t")}) == "abc"


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as answer:
            return answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses a TCP socket listens on ``port`` at, from /proc/net/tcp (hex, as the
    kernel writes them: 0100007F is 127.0.0.1, 00000000 every interface)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if int(hex_port, 16) == port and state == "0A":  # LISTEN
            found.add(address)
    return found


def test_metrics_listen_on_loopback_and_answer_only_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_METRICS_ADDR, raising=False)
    port = serve_metrics("guarded", find_free_port(), token="m-token")
    assert port is not None
    # prometheus-client's own server listened on every interface (00000000): every tenant's usage
    # and cost for anyone who can reach the host.
    assert _listening_addresses(port) == {"0100007F"}
    url = f"http://127.0.0.1:{port}/metrics"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, body, answer_headers = _get(url, headers)
        assert status == 401 and b"loom_" not in body
        assert answer_headers.get("WWW-Authenticate", "").startswith("Bearer")
    status, body, _ = _get(url, bearer_header("m-token"))
    assert status == 200 and b'loom_service_info{service="guarded"} 1.0' in body
    assert _get(f"http://127.0.0.1:{port}/other", bearer_header("m-token"))[0] == 404


def test_metrics_take_their_token_from_the_stacks_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = ensure_http_token(tmp_path)
    monkeypatch.setenv(ENV_HTTP_TOKEN_FILE, str(token_file))
    port = serve_metrics("from-env", find_free_port())
    assert port is not None
    url = f"http://127.0.0.1:{port}/metrics"
    assert _get(url)[0] == 401
    assert _get(url, bearer_header(token_file.read_text().strip()))[0] == 200
    monkeypatch.setenv(ENV_HTTP_TOKEN_FILE, str(tmp_path / "gone"))
    with pytest.raises(ValueError, match="gives no token"):
        serve_metrics("broken", find_free_port())


def test_a_rotated_token_is_asked_for_at_once_and_the_old_one_refused_without_a_restart(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = ensure_http_token(tmp_path)
    old = token_file.read_text().strip()
    monkeypatch.setenv(ENV_HTTP_TOKEN_FILE, str(token_file))
    port = serve_metrics("rotated", find_free_port())
    assert port is not None
    url = f"http://127.0.0.1:{port}/metrics"
    assert _get(url, bearer_header(old))[0] == 200
    assert rotate_http_token(tmp_path) == token_file
    new = token_file.read_text().strip()
    assert new != old and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert _get(url, bearer_header(old))[0] == 401
    assert _get(url, bearer_header(new))[0] == 200
    assert rotate_http_token(tmp_path / "not-secured") is None  # no token file: nothing to rotate


def test_a_token_file_that_later_gives_no_token_keeps_the_last_one_never_open(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("first\n")
    source = TokenFile(path)
    assert source() == "first" and authorized("Bearer first", source)
    path.write_text("")  # emptied: the last token holds
    assert source() == "first" and not authorized(None, source)
    path.unlink()
    assert source() == "first"
    path.write_text("second\n")
    assert source() == "second" and not authorized("Bearer first", source)
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="holds no token"):  # at the start it is an error
        TokenFile(tmp_path / "empty")


def test_a_services_span_exporter_sends_the_token_the_file_holds_now(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import requests

    from loom.telemetry.tracing import _token_session

    monkeypatch.delenv(ENV_TRACES_TOKEN_FILE, raising=False)
    assert _token_session() is None  # not secured: the exporter's own session
    token_file = ensure_http_token(tmp_path)
    # A secured stack's service exporting to a collector of the operator's (no --traces): the
    # token of the stack's endpoints is not sent there (a review: it was, replacing the
    # collector's own Authorization).
    monkeypatch.setenv(ENV_HTTP_TOKEN_FILE, str(token_file))
    assert _token_session() is None
    monkeypatch.setenv(ENV_TRACES_TOKEN_FILE, str(token_file))  # exporting to the stack's own store
    session = _token_session()
    request = requests.Request(
        "POST", "http://127.0.0.1:1/v1/traces", headers={"Authorization": "Bearer stale"}
    )
    sent = session.prepare_request(request)
    assert sent.headers["Authorization"] == f"Bearer {token_file.read_text().strip()}"
    rotate_http_token(tmp_path)
    assert (
        session.prepare_request(request).headers["Authorization"]
        == f"Bearer {token_file.read_text().strip()}"
    )


async def _post(port: int, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"alerts": []}'
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /alertmanager HTTP/1.1\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode() + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    status = int(raw.split(b" ", 2)[1])
    return status, json.loads(raw.split(b"\r\n\r\n", 1)[1])


async def test_the_webhook_raises_nothing_for_a_request_without_the_token() -> None:
    posted: list[bytes] = []

    async def on_post(body: bytes) -> Answer:
        posted.append(body)
        return Answer(200, {"accepted": 0})

    receiver = Receiver(on_post, max_body_bytes=1024, token="w-token")
    port = await receiver.start("127.0.0.1", 0)
    try:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            status, answer = await _post(port, headers)
            assert status == 401 and "bearer token" in str(answer["error"])
        assert posted == []
        assert await _post(port, bearer_header("w-token")) == (200, {"accepted": 0})
        assert len(posted) == 1
        assert receiver.counts == {"requests": 3, "accepted": 1, "refused": 2}
    finally:
        await receiver.close()


def test_the_listening_check_sees_a_listener_on_every_interface() -> None:
    """The check above reads /proc/net/tcp; make sure it sees an every-interface listener."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert _listening_addresses(s.getsockname()[1]) == {"00000000"}


def test_metrics_listen_on_the_ipv6_loopback_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """An IPv6 address works as it did with prometheus-client (a review: AF_INET only refused it)."""
    if not socket.has_ipv6:
        pytest.fail("this host has no IPv6: the test cannot check the IPv6 listener")
    monkeypatch.setenv(ENV_METRICS_ADDR, "::1")
    port = serve_metrics("six", find_free_port(), token="t6")
    assert port is not None
    status, body, _ = _get(f"http://[::1]:{port}/metrics", bearer_header("t6"))
    assert status == 200 and b'loom_service_info{service="six"} 1.0' in body


def test_the_webhook_token_may_come_from_its_own_variable(tmp_path: Path) -> None:
    """compose guards the webhook it publishes to the host, not /metrics (its Prometheus scrapes
    them with no token): the correlator reads LOOM_WEBHOOK_TOKEN_FILE first."""
    from loom.security.http_token import ENV_WEBHOOK_TOKEN_FILE

    (tmp_path / "w").write_text("hook\n")
    env = {ENV_WEBHOOK_TOKEN_FILE: str(tmp_path / "w")}
    assert http_token_from_env(env, variable=ENV_WEBHOOK_TOKEN_FILE) == "hook"
    assert http_token_from_env(env) is None  # /metrics stays open there
    with pytest.raises(ValueError, match=ENV_WEBHOOK_TOKEN_FILE):
        http_token_from_env({ENV_WEBHOOK_TOKEN_FILE: str(tmp_path / "gone")}, variable=ENV_WEBHOOK_TOKEN_FILE)

"""One bearer token for a stack's local HTTP endpoints: ``/metrics``, the trace store, the webhook.

A secured stack (``loom up``, the default) keeps ``<home>/secrets/http.token`` (mode 0600 in a
0700 directory) and gives its path to every process it starts in ``$LOOM_HTTP_TOKEN_FILE``. Each
service's Prometheus ``/metrics``, the trace store (``loom up --traces``) and the alert
correlator's Alertmanager webhook then answer only a request that carries
``Authorization: Bearer <token>`` (401 otherwise, with ``WWW-Authenticate: Bearer``): they show
every tenant's usage, cost and jobs, and the webhook raises incidents, so another user of the
host must not reach them. Loom's own readers (``loom trace``, ``loom submit``'s span, the OTLP
exporters of the services) send it; Prometheus and Alertmanager take it as
``authorization: {credentials_file: <home>/secrets/http.token}``.

Without ``$LOOM_HTTP_TOKEN_FILE`` (``loom up --no-secure``, a service started by hand, tests) the
endpoints are open, as NATS is then. A variable naming a file that cannot be read, or an empty
one, is an error at the process's start, never an open endpoint.

The endpoints and the services' span exporters hold a :class:`TokenFile`: the file is read again
whenever it changes, so ``loom credentials rotate`` (which writes a new token) takes effect at
the next request without a restart, and the old token is refused from then on. A file that later
cannot be read or is emptied keeps the last token (never open).
"""

import hmac
import os
import secrets
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from loom.security.credentials import write_secret

__all__ = [
    "CHALLENGE",
    "ENV_HTTP_TOKEN_FILE",
    "ENV_TRACES_TOKEN_FILE",
    "ENV_WEBHOOK_TOKEN_FILE",
    "HTTP_TOKEN_FILE",
    "Token",
    "TokenFile",
    "authorized",
    "bearer_header",
    "ensure_http_token",
    "http_token_from_env",
    "otlp_headers",
    "read_http_token",
    "reply",
    "rotate_http_token",
    "token_file_from_env",
]

ENV_HTTP_TOKEN_FILE = "LOOM_HTTP_TOKEN_FILE"
"""Path of the file holding the bearer token the local HTTP endpoints ask for (unset: open)."""
ENV_WEBHOOK_TOKEN_FILE = "LOOM_WEBHOOK_TOKEN_FILE"
"""The webhook's own token file, before ``$LOOM_HTTP_TOKEN_FILE``: compose protects the webhook it
publishes to the host and leaves ``/metrics`` open to its Prometheus inside its network."""
ENV_TRACES_TOKEN_FILE = "LOOM_TRACES_TOKEN_FILE"
"""Set by a stack started with ``--traces`` for its processes: the token file their span exporters
send to *its* trace store (never to an endpoint of the operator's, which gets no Loom secret)."""
HTTP_TOKEN_FILE = Path("secrets") / "http.token"
"""Where a stack's token lives under its home."""
CHALLENGE = 'Bearer realm="loom"'
"""The ``WWW-Authenticate`` header of a 401."""
OTLP_HEADERS_ENV = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
"""The OpenTelemetry exporter's headers for spans (``key=value``, the value URL-encoded)."""


def ensure_http_token(home: Path) -> Path:
    """The token file of the stack at ``home``, written (0600) with a fresh token on first use;
    kept across restarts so a Prometheus configured with it keeps scraping."""
    path = home / HTTP_TOKEN_FILE
    try:
        if read_http_token(path):
            return path
    except (OSError, ValueError):
        pass
    write_secret(path, secrets.token_urlsafe(32) + "\n")
    return path


def rotate_http_token(home: Path) -> Path | None:
    """A new token in the stack's file at ``home`` (None: the stack has none, it is not secured).
    Every endpoint and exporter holding a :class:`TokenFile` of it uses the new one from its next
    request; the old one is refused."""
    path = home / HTTP_TOKEN_FILE
    if not path.exists():
        return None
    write_secret(path, secrets.token_urlsafe(32) + "\n")
    return path


class TokenFile:
    """The token in a file, read again when the file changes (its inode, size or modification
    time): a rotated token is used from the next call, with no restart. Raises at construction
    when the file gives no token; a later change that gives none keeps the last token. Calling it
    stats the file (microseconds): fine for an endpoint scraped every few seconds."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._token = read_http_token(self.path)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def __call__(self) -> str:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp:
            with self._lock:
                try:
                    self._token = read_http_token(self.path)
                    self._stamp = stamp
                except (OSError, ValueError):
                    pass  # keep the last token: an endpoint never falls open
        return self._token


Token = str | Callable[[], str] | None
"""What an endpoint asks for: a fixed token, one read when asked (:class:`TokenFile`), or None (open)."""


def token_file_from_env(
    environ: "os._Environ[str] | dict[str, str] | None" = None, *, variable: str = ENV_HTTP_TOKEN_FILE
) -> TokenFile | None:
    """The :class:`TokenFile` that ``$LOOM_HTTP_TOKEN_FILE`` (or ``variable``) names, or None (open)
    when the variable is unset or empty; ValueError naming the variable when the file gives no
    token (as :func:`http_token_from_env`)."""
    env = os.environ if environ is None else environ
    name = env.get(variable, "").strip()
    if not name:
        return None
    try:
        return TokenFile(Path(name))
    except (OSError, ValueError) as exc:
        raise ValueError(f"${variable} names {name!r}, which gives no token: {exc}") from exc


def read_http_token(path: Path) -> str:
    """The token in ``path`` (ValueError for an empty file; OSError when it cannot be read)."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token


def http_token_from_env(
    environ: "os._Environ[str] | dict[str, str] | None" = None, *, variable: str = ENV_HTTP_TOKEN_FILE
) -> str | None:
    """The token this process's endpoints ask for: from the file ``$LOOM_HTTP_TOKEN_FILE`` (or
    ``variable``) names, or None (open) when the variable is unset or empty. Raises ValueError
    naming the variable when the file it names cannot be read or is empty: an endpoint never falls
    open by mistake."""
    source = token_file_from_env(environ, variable=variable)
    return source() if source is not None else None


def authorized(header: str | None, token: Token) -> bool:
    """Whether a request whose ``Authorization`` header is ``header`` may be answered: always
    when no token is asked for, else only ``Bearer <token>`` (compared in constant time; a
    :class:`TokenFile` gives its current token)."""
    if token is None:
        return True
    if callable(token):
        token = token()
    if not header:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def bearer_header(token: str | None) -> dict[str, str]:
    """The header a reader sends (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def otlp_headers(token: str) -> dict[str, str]:
    """The environment an OTLP/HTTP span exporter needs to send ``token`` with every export."""
    return {OTLP_HEADERS_ENV: f"Authorization=Bearer%20{token}"}


def reply(handler: BaseHTTPRequestHandler, status: HTTPStatus, body: bytes, content_type: str) -> None:
    """Answer a request of a ``http.server`` handler (``/metrics``, the trace store): the body with
    its type and length, and the bearer challenge on a 401."""
    handler.send_response(status)
    if status == HTTPStatus.UNAUTHORIZED:
        handler.send_header("WWW-Authenticate", CHALLENGE)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)

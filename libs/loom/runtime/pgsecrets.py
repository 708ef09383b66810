"""PostgreSQL passwords as secrets: generated, kept in 0600 files, never in a URL or a log.

A password lives in a libpq *password file* (``host:port:database:user:password``, one line) that
only its owner may read; the URL a process gets names the file (``?passfile=...``, understood by
asyncpg and libpq) instead of carrying the password, so printing or logging a URL discloses
nothing. The server is only ever sent a SCRAM-SHA-256 *verifier* (:func:`scram_verifier`), never
the password itself: an ``ALTER ROLE ... PASSWORD`` that ends up in a server log reveals nothing
that would let anyone log in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from urllib.parse import quote

__all__ = [
    "generate_password",
    "pgpass_password",
    "role_url",
    "scram_verifier",
    "write_pgpass",
    "write_secret",
]

_SCRAM_ITERATIONS = 4096


def generate_password() -> str:
    """A fresh random password (256 bits, URL- and pgpass-safe characters only)."""
    return secrets.token_urlsafe(32)


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = _SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677).

    ``ALTER ROLE r PASSWORD '<verifier>'`` stores it as is (PostgreSQL recognises the format), so
    the server never sees the password. ``password`` is assumed ASCII (SASLprep is then the identity),
    which :func:`generate_password` guarantees.
    """
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600; its directory made 0700).

    The file is created 0600 before anything is written to it, and replaced atomically, so no
    moment exists where the secret sits in a file others can read.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def write_pgpass(path: Path, user: str, password: str) -> None:
    """A password file granting ``user`` its ``password`` on any host, port and database."""
    write_secret(path, f"*:*:*:{user}:{password}\n")


def pgpass_password(path: Path) -> str | None:
    """The password in a file written by :func:`write_pgpass`; None when it does not exist."""
    try:
        line = path.read_text().splitlines()[0]
    except (FileNotFoundError, IndexError):
        return None
    return line.split(":", 4)[4]


def role_url(user: str, port: int, database: str, passfile: Path | None, host: str = "127.0.0.1") -> str:
    """``postgresql://USER@HOST:PORT/DB?passfile=PATH``: a URL that names its password file."""
    url = f"postgresql://{user}@{host}:{port}/{database}"
    if passfile is not None:
        url += f"?passfile={quote(str(passfile), safe='/')}"
    return url

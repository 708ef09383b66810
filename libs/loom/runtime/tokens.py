"""Access tokens of the web console: one operator token, and a token per tenant.

``loom up`` (and the console service, when started on its own as in docker-compose.yml) writes
``<home>/console-tokens.json`` with mode 0600: the operator token and a secret. A tenant's token
is ``tenant.<tenant>.<mac>``, the mac an HMAC-SHA256 of the tenant id under that secret, so every
tenant has a token without a registry and none can be forged or turned into another tenant's.
``loom console`` prints the console's URL with the operator token (``--tenant ID``: that
tenant's). Deleting the file and restarting the stack revokes every token.
"""

import hashlib
import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from loom_proto.ids import ID_PATTERN

TOKENS_FILE = "console-tokens.json"
_MAC_CHARS = 32

Role = Literal["operator", "tenant"]


@dataclass(frozen=True, slots=True)
class Access:
    """Who a token lets in: the operator (every tenant, actions), or one tenant (its jobs, read-only)."""

    role: Role
    tenant: str | None = None

    @property
    def is_operator(self) -> bool:
        """Whether this access may act (cancel, drain) and see every tenant."""
        return self.role == "operator"

    def can_see(self, tenant: str) -> bool:
        """Whether a job of ``tenant`` may be shown."""
        return self.is_operator or self.tenant == tenant


@dataclass(frozen=True, slots=True)
class Tokens:
    """The operator token and the secret that tenant tokens are derived from."""

    operator: str
    secret: str

    def tenant_token(self, tenant: str) -> str:
        """The token of one tenant."""
        if not re.fullmatch(ID_PATTERN, tenant):
            raise ValueError(f"not a tenant id: {tenant!r}")
        return f"tenant.{tenant}.{self._mac(tenant)}"

    def _mac(self, tenant: str) -> str:
        digest = hmac.new(self.secret.encode(), tenant.encode(), hashlib.sha256).hexdigest()
        return digest[:_MAC_CHARS]

    def check(self, token: str | None) -> Access | None:
        """The access a token grants, or None for a missing or wrong token."""
        if not token:
            return None
        if hmac.compare_digest(token.encode(), self.operator.encode()):
            return Access("operator")
        kind, _, rest = token.partition(".")
        tenant, _, mac = rest.rpartition(".")
        if kind != "tenant" or not tenant or not mac:
            return None
        if hmac.compare_digest(mac.encode(), self._mac(tenant).encode()):
            return Access("tenant", tenant)
        return None

    def form_key(self, token: str) -> str:
        """The anti-forgery key the console puts in its forms for one session (one token): an
        HMAC of the token, so another site, which cannot read the page, cannot post a form."""
        digest = hmac.new(self.secret.encode(), b"form:" + token.encode(), hashlib.sha256).hexdigest()
        return digest[:_MAC_CHARS]


def tokens_path(home: Path) -> Path:
    """Where a stack's console tokens live."""
    return home / TOKENS_FILE


def load_tokens(home: Path) -> Tokens:
    """The tokens of the stack at ``home`` (FileNotFoundError when none were written)."""
    raw = json.loads(tokens_path(home).read_text())
    return Tokens(operator=str(raw["operator"]), secret=str(raw["secret"]))


def ensure_tokens(home: Path) -> Tokens:
    """The tokens of the stack at ``home``, written (mode 0600) on first use."""
    path = tokens_path(home)
    home.mkdir(parents=True, exist_ok=True)
    tokens = Tokens(operator=f"op.{secrets.token_urlsafe(24)}", secret=secrets.token_hex(32))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_tokens(home)
    with os.fdopen(fd, "w") as out:
        json.dump({"operator": tokens.operator, "secret": tokens.secret}, out)
    return tokens

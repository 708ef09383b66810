"""Trust boundaries: NATS identities, their permissions and their credentials (issue 18)."""

from loom.security.credentials import (
    ENV_CREDS,
    ENV_NATS_CA,
    Credential,
    CredentialStore,
    admin_identity,
    new_seed,
    parse,
    read,
    tenant_identity,
    users_config,
    write_secret,
)
from loom.security.permissions import (
    SERVICE_ROLES,
    Identity,
    Permissions,
    foreign_cancellation,
    foreign_report,
    identity_for_process,
    may_manage_streams,
    permissions,
    received_cancellation,
)

__all__ = [
    "ENV_CREDS",
    "ENV_NATS_CA",
    "SERVICE_ROLES",
    "Credential",
    "CredentialStore",
    "Identity",
    "Permissions",
    "admin_identity",
    "foreign_cancellation",
    "foreign_report",
    "identity_for_process",
    "may_manage_streams",
    "new_seed",
    "parse",
    "permissions",
    "read",
    "received_cancellation",
    "tenant_identity",
    "users_config",
    "write_secret",
]

"""The Python SDK: submit jobs, follow their events, query jobs and the resource view.

Any NATS client can do the same with raw JSON (see proto/asyncapi.json); this SDK adds strict
validation before anything is sent, so a bad spec fails at the caller with a clear message.
"""

from loom.client.sdk import (
    Admission,
    LoomClient,
    QueryError,
    RefusedQueryError,
    SpecError,
    SubmissionUnsure,
    checked_spec,
    load_specs,
    spec_from_mapping,
)

__all__ = [
    "Admission",
    "LoomClient",
    "QueryError",
    "RefusedQueryError",
    "SpecError",
    "SubmissionUnsure",
    "checked_spec",
    "load_specs",
    "spec_from_mapping",
]

"""Migration events: a job moved off a cluster (drained, failed), from plan to the run elsewhere.

Published on ``loom.migrations.<kind>.<tenant>`` (the MIGRATIONS stream) by the migration service,
each in the trace of the job it moves. One migration goes ``planned`` (chosen, a checkpoint
asked for) → ``started`` (the old run given up, the job queued again from ``resume_step``) →
``completed`` (the next attempt runs elsewhere) or ``failed`` (with the reason).
"""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from loom_proto.ids import Id

MigrationKind = Literal["planned", "started", "completed", "failed"]
MigrationCause = Literal["drain", "failover", "network", "backflow"]


MAX_DRAIN_CONCURRENCY = 64
"""The most moves one drain keeps in flight (``loom drain --concurrency``, the console's form)."""


class MigrationEvent(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One step of one job's migration, with the numbers behind it."""

    migration_id: Annotated[str, Meta(max_length=256)]
    """``<job>:<from attempt>``: one migration per run given up."""
    kind: MigrationKind
    job_id: Id
    tenant: Id
    cause: MigrationCause
    from_cluster: Id
    to_cluster: Annotated[str, Meta(max_length=2048)] = ""
    """Where the next attempt runs (known once ``completed``): every cluster it holds GPUs on,
    comma-separated and sorted (more than one for a pipeline or a gang spanning clusters)."""
    from_attempt: Annotated[int, Meta(ge=1)]
    resume_step: Annotated[int, Meta(ge=0)] = 0
    """The step the next run starts from (its checkpoint)."""
    steps: Annotated[int, Meta(ge=0)] = 0
    progress_lost_steps: Annotated[int, Meta(ge=0)] = 0
    """Steps done by the old run past ``resume_step`` (redone by the next run)."""
    why: Annotated[str, Meta(max_length=2048)] = ""
    moot: bool = False
    """``failed`` only: the move no longer mattered, nothing went wrong with it (no alert is
    raised): its run ended by itself first (completed, failed, cancelled, rejected), the
    operator ended the drain it served before it started, or, judged again as it was to start, a
    voluntary move no longer paid (the job keeps running where it is)."""
    at: Annotated[float, Meta(ge=0)]

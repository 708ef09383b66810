"""Learned speeds in PostgreSQL: the observations placement's speed learner took, replayed on start.

The rows are the learner's whole memory: :func:`load_learner` folds them, in the order they were
taken, into a fresh :class:`~loom.model.learn.SpeedLearner`, which is deterministic, so the
leader after a restart (or any replica answering a query) knows exactly what the last one knew.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import msgspec

from loom.model.family import job_family
from loom.model.learn import LearnSettings, SpeedLearner
from loom.sched.probe import PROBE_LABEL, PROBE_MODEL_LABEL
from loom_proto.jobs import JobSubmitted


@dataclass(frozen=True)
class SpeedObservation:
    """One run's speed of a job family on a GPU model (see :meth:`SpeedLearner.observe`)."""

    event_id: str
    """The run's key (:func:`run_event_id`): a run teaches once, from its first progress report
    with a measured compute step or from its completion, however often either is delivered.
    (Observations stored before 2026-12-03 carry the completion event's message id.)"""
    job_id: str
    family: str
    gpu_model: str
    prior_speed: float
    observed_speed: float
    weight: float = 1.0

    def teach(self, learner: SpeedLearner) -> None:
        """Feed this observation to ``learner``."""
        learner.observe(
            self.family,
            self.gpu_model,
            prior_speed=self.prior_speed,
            observed_speed=self.observed_speed,
            weight=self.weight,
        )


def run_event_id(job_id: str, attempt: int) -> str:
    """The key of a run's one speed observation."""
    return f"{job_id}:speed:{attempt}"


async def record(
    conn: asyncpg.Connection, observations: Sequence[SpeedObservation]
) -> list[SpeedObservation]:
    """Store observations (in order); returns those that were new (an event id seen before, or
    earlier in ``observations``, is skipped)."""
    first: dict[str, SpeedObservation] = {}
    for o in observations:
        first.setdefault(o.event_id, o)
    observations = list(first.values())
    if not observations:
        return []
    rows = await conn.fetch(
        """INSERT INTO speed_observations
               (event_id, job_id, family, gpu_model, prior_speed, observed_speed, weight)
           SELECT e, j, f, g, p, s, w
           FROM unnest($1::text[], $2::text[], $3::text[], $4::text[],
                       $5::float8[], $6::float8[], $7::float8[]) WITH ORDINALITY
                AS o(e, j, f, g, p, s, w, n)
           ORDER BY n
           ON CONFLICT (event_id) DO NOTHING
           RETURNING event_id""",
        [o.event_id for o in observations],
        [o.job_id for o in observations],
        [o.family for o in observations],
        [o.gpu_model for o in observations],
        [o.prior_speed for o in observations],
        [o.observed_speed for o in observations],
        [o.weight for o in observations],
    )
    new = {r["event_id"] for r in rows}
    return [o for o in observations if o.event_id in new]


async def load_learner(
    conn: asyncpg.Connection | asyncpg.Pool, settings: LearnSettings | None = None
) -> SpeedLearner:
    """A learner that has taken every stored observation, in the order they were stored, and knows
    which cells were probed (every probe job stored)."""
    learner = SpeedLearner(settings)
    rows = await conn.fetch(
        """SELECT event_id, job_id, family, gpu_model, prior_speed, observed_speed, weight
           FROM speed_observations ORDER BY seq"""
    )
    for r in rows:
        SpeedObservation(**dict(r)).teach(learner)
    # The cells a speed probe was asked for (loom.sched.probe): each probe is a job, labelled.
    probes = await conn.fetch(
        """SELECT spec FROM jobs WHERE spec->'labels' ? $1 ORDER BY submitted_at, job_id""", PROBE_LABEL
    )
    for r in probes:
        try:
            spec = msgspec.json.decode(r["spec"], type=JobSubmitted)
        except msgspec.DecodeError:
            continue  # not a probe placement made (it makes only valid ones): nothing to remember
        model = spec.labels.get(PROBE_MODEL_LABEL)
        if model:
            learner.probe_asked(job_family(spec), model)
    return learner

"""DAG jobs: check a job's stages form a DAG, split it into one job per stage, and say which may start.

A DAG job is one :class:`~loom_proto.jobs.JobSubmitted` whose ``stages`` depend on each other.
:func:`validate` refuses what cannot run (duplicate names, unknown or self dependencies, cycles)
with a message the submitter can act on, and gives the order the stages run in. :func:`expand`
turns the job into one child job per stage, labelled with the parent and the stage, so the rest of
the scheduler places stages like any other job. :func:`ready` says which stages may start now.
"""

import heapq
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loom.errors import InvalidInputError
from loom_proto.ids import ID_PATTERN
from loom_proto.jobs import JobSubmitted, Stage

__all__ = [
    "DAG_LABEL",
    "MAX_LABELS",
    "STAGE_LABEL",
    "DagError",
    "dependencies",
    "expand",
    "ready",
    "stage_job_id",
    "validate",
]

DAG_LABEL = "loom-dag"
"""Label on every stage job: the parent (DAG) job id."""
STAGE_LABEL = "loom-stage"
"""Label on every stage job: the stage name."""
MAX_LABELS = 64
"""The most labels a job may carry (``JobSpec.labels``); stage jobs add two."""

_ID_RE = re.compile(ID_PATTERN)
_MAX_ID_CHARS = 64
_MAX_NAME_CHARS = 256


class DagError(InvalidInputError):
    """A DAG job that cannot run as written; the message says which stages and what to change."""


class DagCycleError(DagError):
    """The stages depend on each other in a circle (rejected with code ``cyclic``)."""


def dependencies(stages: Sequence[Stage]) -> dict[str, tuple[str, ...]]:
    """Each stage's dependencies, duplicates dropped, in the order they were declared."""
    return {stage.name: tuple(dict.fromkeys(stage.depends_on)) for stage in stages}


def validate(stages: Sequence[Stage]) -> tuple[str, ...]:
    """The order the stages run in (ties broken by declaration order); :class:`DagError` if not a DAG."""
    names = [stage.name for stage in stages]
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise DagError(
            f"stage names must be unique; used more than once: {', '.join(duplicates)}; rename them"
        )
    deps = dependencies(stages)
    known = ", ".join(names)
    for name, wanted in deps.items():
        for dep in wanted:
            if dep == name:
                raise DagError(f"stage {name!r} depends on itself; remove {name!r} from its depends_on")
            if dep not in deps:
                raise DagError(
                    f"stage {name!r} depends on {dep!r}, which is not a stage; stages are: {known}"
                )

    position = {name: i for i, name in enumerate(names)}
    waiting_on = {name: len(wanted) for name, wanted in deps.items()}
    dependents: dict[str, list[str]] = {name: [] for name in names}
    for name, wanted in deps.items():
        for dep in wanted:
            dependents[dep].append(name)
    heap = [position[name] for name in names if waiting_on[name] == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        name = names[heapq.heappop(heap)]
        order.append(name)
        for later in dependents[name]:
            waiting_on[later] -= 1
            if waiting_on[later] == 0:
                heapq.heappush(heap, position[later])
    if len(order) < len(names):
        cycle = _find_cycle(names, deps, done=set(order))
        raise DagCycleError(
            f"stages form a cycle: {' -> '.join([*cycle, cycle[0]])} (each depends on the next);"
            " remove one of these dependencies"
        )
    return tuple(order)


def _find_cycle(names: Sequence[str], deps: Mapping[str, Sequence[str]], *, done: set[str]) -> list[str]:
    """A cycle among the stages Kahn's algorithm could not order, starting at its first-declared stage.

    Every such stage waits on at least one other such stage, so following the first unordered
    dependency from any of them must come back to a stage already on the path.
    """
    start = next(name for name in names if name not in done)
    path: list[str] = []
    on_path: dict[str, int] = {}
    node = start
    while node not in on_path:
        on_path[node] = len(path)
        path.append(node)
        node = next(dep for dep in deps[node] if dep not in done)
    cycle = path[on_path[node] :]
    position = {name: i for i, name in enumerate(names)}
    first = min(range(len(cycle)), key=lambda i: position[cycle[i]])
    return cycle[first:] + cycle[:first]


def stage_job_id(job_id: str, stage_name: str) -> str:
    """The id of a stage's job, ``<job_id>--<stage>``; :class:`DagError` if it is not a valid id."""
    stage_id = f"{job_id}--{stage_name}"
    if len(stage_id) > _MAX_ID_CHARS:
        raise DagError(
            f"stage {stage_name!r} of job {job_id!r} would run as job {stage_id!r}, which has"
            f" {len(stage_id)} characters; ids have at most {_MAX_ID_CHARS}: shorten the job id"
            f" (to at most {_MAX_ID_CHARS - 2 - len(stage_name)} characters) or the stage name"
        )
    if _ID_RE.fullmatch(stage_id) is None:
        raise DagError(
            f"stage {stage_name!r} of job {job_id!r} would run as job {stage_id!r}, which is not a"
            " valid id: use only letters, digits, '_' and '-'"
        )
    return stage_id


def expand(job: JobSubmitted) -> list[JobSubmitted]:
    """One job per stage, in the order they run; each is labelled with the parent job and stage.

    A stage job takes tenant, priority, preemption, multi-cluster permission, labels and
    submission time from the parent, and what it runs (task type, workers, resources, work, data,
    affinity) from its stage. It has no stages of its own.
    """
    if not job.stages:
        raise DagError(f"job {job.job_id!r} has no stages, so it is not a DAG job")
    order = validate(job.stages)
    labels = {k: v for k, v in job.labels.items() if k not in (DAG_LABEL, STAGE_LABEL)}
    if len(labels) + 2 > MAX_LABELS:
        raise DagError(
            f"job {job.job_id!r} has {len(labels)} labels; a DAG job may have at most {MAX_LABELS - 2}"
            f" because each stage job also gets {DAG_LABEL!r} and {STAGE_LABEL!r}"
        )
    by_name = {stage.name: stage for stage in job.stages}
    children: list[JobSubmitted] = []
    for name in order:
        stage = by_name[name]
        title = f"{job.name}/{stage.name}" if job.name else stage.name
        children.append(
            JobSubmitted(
                job_id=stage_job_id(job.job_id, stage.name),
                tenant=job.tenant,
                name=title[:_MAX_NAME_CHARS],
                task_type=stage.task_type,
                priority=job.priority,
                workers=stage.workers,
                resources=stage.resources,
                work=stage.work,
                labels={**labels, DAG_LABEL: job.job_id, STAGE_LABEL: stage.name},
                preemptible=job.preemptible,
                allow_multi_cluster=job.allow_multi_cluster,
                data=stage.data,
                affinity=stage.affinity,
                submitted_at=job.submitted_at,
            )
        )
    return children


def ready(
    order: Sequence[str], deps: Mapping[str, Sequence[str]], completed: set[str], started: set[str]
) -> list[str]:
    """Stages, in ``order``, that have not started and whose dependencies have all completed."""
    return [
        name
        for name in order
        if name not in started
        and name not in completed
        and all(dep in completed for dep in deps.get(name, ()))
    ]


ENDED_BADLY = ("failed", "rejected", "cancelled")


@dataclass(frozen=True, slots=True)
class Advance:
    """What a DAG does after one of its stages ended (:func:`advance`)."""

    failed_stage: str | None = None
    """A stage that ended badly: the DAG fails, and the stages not started yet are cancelled."""
    cancel: tuple[str, ...] = ()
    """Stages still waiting or queued that are cancelled (only with ``failed_stage``)."""
    completed: bool = False
    """Every stage completed: so has the DAG."""
    ready: tuple[str, ...] = ()
    """Stages that may start now (in run order)."""


def advance(stages: Sequence[Stage], states: Mapping[str, str]) -> Advance:
    """The next step of a DAG from its stages' states (``waiting``, ``queued``, ``placed``,
    ``running``, ``completed``, ``failed``, ``rejected``, ``cancelled``); pure, the placement
    service's and any replay's rule."""
    bad = [s for s, st in states.items() if st in ENDED_BADLY]
    if bad:
        return Advance(
            failed_stage=bad[0],
            cancel=tuple(s for s, st in states.items() if st in ("waiting", "queued")),
        )
    if states and all(st == "completed" for st in states.values()):
        return Advance(completed=True)
    completed = {s for s, st in states.items() if st == "completed"}
    started = {s for s, st in states.items() if st != "waiting"}
    order = validate(stages)
    return Advance(ready=tuple(ready(order, dependencies(stages), completed, started)))

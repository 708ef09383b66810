"""Speed probes: deliberate, bounded exploration of the GPU models a job family never ran on.

The speed learner (:mod:`loom.model.learn`) learns a (family, GPU model) cell from runs of that
family on that model; a cell no job ever ran keeps what its profile and the other cells say. That
can be far off where it matters most: on Sia's measurements YOLOv3 scales so badly within an A100
node that 4 GPUs of a T4 node beat 4 of an A100's, while every profile, and every other family,
says the A100 is several times faster. No run ever goes to the T4 to find out, so every YOLOv3 job
takes the A100s the ResNet gangs need (Pollux's workload-6: a mean JCT 73 % above first fit's).

So, as Sia profiles each new job on every GPU type, a job whose family never ran on a GPU model
it may use asks for a **probe** there: a short run of the same family
(:attr:`ProbeSettings.probe_s` of believed time) on one node of that model, as many GPUs as the job
would put on one node (so that the probe measures what a run of the job would: per-GPU speed
within a node depends on how many GPUs share it). The probe is an ordinary job: placed by the same
cycle, run by the agent, accounted to the job's tenant, and its run teaches the learner by the same
rule as any run (:func:`loom.model.learn.run_speed`). By default the job that asked is **not held**:
it is decided at once on what is known, and the probes teach the family's later jobs. Holding it
(:attr:`ProbeSettings.hold_s` > 0: it waits while its family's probes run, or are asked and not yet
decided, at most that long after it was queued) was measured and is off: the held job loses its
turn to jobs that arrive meanwhile (a 16-GPU gang held for its probes on an empty platform waited
4,300 s more for the nodes others took), and on Pollux / Sia's 22 workload files not holding was
the better of the two as well (Loom's mean JCT 0.89 against 0.92 of the code without probes,
geometric mean).

Deliberate: only models whose answer could change the choice are probed. Given the learner's sd of
each cell's log speed, a model is a *rival* when, :attr:`ProbeSettings.z` sds above its belief, it
would be as fast as the believed fastest model :attr:`~ProbeSettings.z` sds below its own; with at
least one rival, the rivals and the believed fastest are probed (the fastest too: a profile can
be as wrong about the model the job would take). A family new to every model (sd 0.5 each) has a
rival within 7.4x of the fastest at the default z of 2; one whose cells the learner shares from
other families' runs (sd about 0.3) within 3.3x.

Bounded, by rule:

* one probe per (family, GPU model) ever (its id is derived from the cell, :func:`probe_id`; the
  learner remembers which cells were probed, :meth:`~loom.model.learn.SpeedLearner.probe_asked`),
  and none for a cell that already has a run of its own;
* with a hold, a job waits only for probes that run, and never beyond :attr:`ProbeSettings.hold_s`
  (a probe runs ``probe_s`` of *believed* time; truly it may take longer); a probe that finds no
  room at its first decision queues on like any job but holds no one;
* only for a job believed to run at least ``probe_s / max_share`` (20 minutes by default): a probe
  is believed to take at most :attr:`ProbeSettings.max_share` of the job's run;
* a probe runs only in room that is free: it preempts no one, shrinks no elastic job and claims no
  pool for itself (the preemption, elastic and backfill post-filters pass it by);
* never on a model where one step of the job is believed longer than ``probe_s``;
* only for a job that names its family (``labels.family`` or ``labels.model``): a job known by
  its task type alone shares its "family" with unlike jobs, whose speeds one probe cannot speak
  for (on Alibaba's trace a probe of one ``training_compute`` job sent every later one to the GPU
  it happened to suit);
* never for a probe, a pipeline, or a job that may use only one GPU model (a DAG's stages are
  jobs of their own and are probed for as any job).

A probe keeps only the job's labels that its speed or its accounting depend on
(:data:`KEPT_LABELS`), and its tenant and priority.

Pure: the snapshot, the cells already known and the families with probes in flight in, the probes
to submit and how long to hold the job out. The placement service and the simulator both call
:func:`probe_gate`.
"""

import hashlib
import math
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field

from loom.errors import InvalidInputError
from loom.model.family import job_family
from loom.sched.snapshot import Snapshot, allowed_pools
from loom_proto.jobs import MAX_GPUS_PER_WORKER, Affinity, JobSpec, Resources, Work

__all__ = [
    "PROBE_LABEL",
    "PROBE_MODEL_LABEL",
    "ProbeGate",
    "ProbeSettings",
    "check_labels",
    "is_probe",
    "plan_probes",
    "probe_gate",
    "probe_id",
]

PROBE_LABEL = "loom.probe-of"
"""Label of a probe: the job it was asked for (a probe is known by this label)."""
PROBE_MODEL_LABEL = "loom.probe-gpu-model"
"""Label of a probe: the GPU model it measures."""
RESERVED_PREFIX = "loom.probe"
"""Labels a submitter may not set (:func:`check_labels`): only placement makes probes."""
KEPT_LABELS = frozenset({"family", "model", "precision", "batch", "batch_size", "project", "team"})
"""The job's labels a probe keeps: its family's (:mod:`loom.model.family`), its batch (what the
speed depends on) and what usage is accounted by (:mod:`loom.metering.usage`)."""


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How speed probes are sized and bounded (see the module's docstring)."""

    probe_s: float = 60.0
    """Believed seconds of work a probe runs (its steps are sized from the belief)."""
    max_share: float = 0.05
    """A job is probed for only when ``probe_s`` is at most this share of its believed run."""
    z: float = 2.0
    """A model is probed only if, this many sds of its learned log speed above its belief, it would
    be as fast as the believed fastest model this many sds below (with a ``log_sd`` given)."""
    hold_s: float = 0.0
    """The longest a job waits for its family's probes, from when it was queued; 0 (the default):
    probes are asked, and the job is decided at once on what is known (see the module docstring)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.probe_s) and self.probe_s > 0):
            raise ValueError(f"probe_s must be positive, got {self.probe_s!r}")
        if not (0 < self.max_share <= 1):
            raise ValueError(f"max_share must be in (0, 1], got {self.max_share!r}")
        if not (math.isfinite(self.hold_s) and self.hold_s >= 0):
            raise ValueError(f"hold_s must be at least 0, got {self.hold_s!r}")


@dataclass(frozen=True, slots=True)
class ProbeGate:
    """What :func:`probe_gate` says of one queued job."""

    probes: list[JobSpec] = field(default_factory=list)
    """Probes to submit now (their cells are then known as probed)."""
    hold_s: float | None = None
    """Hold the job out of this decision and look again after this long; None: decide it now."""
    reason: str = ""


def probe_id(family: str, gpu_model: str) -> str:
    """The id of the probe of ``family`` on ``gpu_model``: one per cell, the same every time (so a
    probe asked twice, by two jobs or after a restart, is one job)."""
    digest = hashlib.sha256(f"{family}\x00{gpu_model}".encode()).hexdigest()[:24]
    return f"probe-{digest}"


def is_probe(labels: Mapping[str, str]) -> bool:
    """Whether a job with these labels is a speed probe."""
    return PROBE_LABEL in labels


def check_labels(labels: Mapping[str, str]) -> None:
    """Refuse a submitted job's labels that only placement may set (a probe's)."""
    taken = sorted(k for k in labels if k.startswith(RESERVED_PREFIX))
    if taken:
        raise InvalidInputError(
            f"label(s) {', '.join(taken)} are placement's own (speed probes); choose other names"
        )


def plan_probes(
    job: JobSpec,
    snap: Snapshot,
    known: Container[tuple[str, str]],
    settings: ProbeSettings,
    log_sd: Callable[[str, str], float] | None = None,
) -> list[JobSpec]:
    """The probes ``job`` calls for now (see the module's docstring for the rules); ``known``: the
    (family, GPU model) cells that need none (a run of their own, or a probe asked before)."""
    if is_probe(job.labels) or job.pipeline is not None or job.stages or job.work.steps <= 1:
        return []
    if not (job.labels.get("family") or job.labels.get("model")):
        return []  # its family is only its task type: one probe would speak for unlike jobs
    family = job_family(job)
    if all((family, m) in known for m in snap.models):
        return []  # the common case, checked first: every cell of the family known
    # Cheap checks first (this runs for every queued job in every cycle until its cells are known).
    allowed, fits = allowed_pools(snap, job)
    wanted = [m for m, ok in zip(snap.models, fits.tolist(), strict=True) if ok]
    speeds = {m: snap.job_gpu_speed(job, m) for m in wanted}
    best = max(speeds.values(), default=0.0)
    work_s = job.work.steps * job.work.step_time_s
    if not best > 0 or work_s / best * settings.max_share < settings.probe_s:
        return []  # too short even on the fastest model anywhere (the exact check follows)
    usable = snap.schedulable & allowed[snap.cluster_of]
    models = [m for m in wanted if (usable & (snap.model_of == snap.model_index[m])).any()]
    if len(models) < 2:
        return []  # one model it may use: nothing to choose between
    fastest = max(speeds[m] for m in models)
    if not fastest > 0 or work_s / fastest * settings.max_share < settings.probe_s:
        return []  # too short a job to wait for a probe (believed on its fastest model)
    if log_sd is not None:
        # Only models that could change the choice: the believed fastest and each model that, at
        # z sds above its belief, would match the fastest at z sds below its own.
        sd = {m: log_sd(family, m) for m in models}
        best_model = max(models, key=lambda m: speeds[m])
        floor = speeds[best_model] * math.exp(-settings.z * sd[best_model])
        rivals = [m for m in models if m != best_model and speeds[m] * math.exp(settings.z * sd[m]) >= floor]
        if not rivals:
            return []
        models = [best_model, *rivals]
    per_job = job.workers * job.resources.gpus
    probes = []
    for m in models:
        if (family, m) in known:
            continue
        on_model = usable & (snap.model_of == snap.model_index[m])
        # As many GPUs as the job would put on one node of the model: per-GPU speed within a node
        # falls with the GPUs sharing it, and the probe must measure what the job's run would.
        gpus = max(job.resources.gpus, 1)
        width = int(min(per_job, int(snap.total[on_model].max()), MAX_GPUS_PER_WORKER)) // gpus * gpus
        if width < gpus:
            continue  # no node of the model holds one of its workers
        share = width // gpus  # the job's workers one node would hold
        speed = speeds[m]
        if job.work.step_time_s / speed > settings.probe_s:
            continue  # one step is believed longer than a probe may take
        steps = max(1, min(job.work.steps, math.ceil(settings.probe_s * speed / job.work.step_time_s)))
        probes.append(
            JobSpec(
                job_id=probe_id(family, m),
                tenant=job.tenant,
                name=f"speed probe of {family} on {m}: {job.name}"[:256],
                task_type=job.task_type,
                priority=job.priority,
                workers=1,
                resources=Resources(
                    gpus=width,
                    gpu_models=[m],
                    cpu_milli=job.resources.cpu_milli * share,
                    memory_mib=job.resources.memory_mib * share,
                    gpu_memory_gib=job.resources.gpu_memory_gib,
                ),
                work=Work(steps=steps, step_time_s=job.work.step_time_s),
                labels={
                    **{k: v for k, v in job.labels.items() if k in KEPT_LABELS},
                    PROBE_LABEL: job.job_id,
                    PROBE_MODEL_LABEL: m,
                },
                affinity=Affinity(
                    clusters=list(job.affinity.clusters),
                    regions=list(job.affinity.regions),
                    avoid_clusters=list(job.affinity.avoid_clusters),
                    avoid_regions=list(job.affinity.avoid_regions),
                ),
            )
        )
    return probes


def probe_gate(
    job: JobSpec,
    snap: Snapshot,
    *,
    known: Container[tuple[str, str]],
    probing: Mapping[str, int],
    queued_s: float,
    settings: ProbeSettings,
    log_sd: Callable[[str, str], float] | None = None,
) -> ProbeGate:
    """Whether ``job`` (queued since ``queued_s`` on the snapshot's clock) is probed for, held out
    while its family's probes run, or decided now.

    ``known``: cells that need no probe; ``probing``: family -> probes of it that hold its jobs
    (running, or asked and not yet decided).
    A job is held while its family has probes in flight (those it asks for now included), until
    ``queued_s + hold_s``.
    """
    if is_probe(job.labels):
        return ProbeGate()
    probes = plan_probes(job, snap, known, settings, log_sd)
    left = queued_s + settings.hold_s - snap.now
    if left <= 0:
        return ProbeGate(probes)  # asked (they teach the family's later jobs), not waited for
    family = job_family(job)
    if probes:
        models = ", ".join(p.resources.gpu_models[0] for p in probes)
        return ProbeGate(
            probes, min(left, settings.probe_s), f"waiting for speed probes of {family} on {models}"
        )
    if probing.get(family, 0) > 0:
        return ProbeGate([], min(left, settings.probe_s), f"waiting for the speed probes of {family}")
    return ProbeGate()

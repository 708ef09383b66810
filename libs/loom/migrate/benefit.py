"""Should a running job move? The migration decision, as numbers (pure, no I/O).

A job is moved only when what it would gain exceeds what moving costs, by a margin:

* **remaining here** — steps left × its predicted step where it runs now (the scheduler's speeds
  from the :class:`~loom.sched.snapshot.Snapshot` and the measured links); infinite when it cannot
  continue there (its cluster failed);
* **remaining there** — the wait before the candidate placement can start (a dataset copy, a
  permit) + steps left × the predicted step there. The candidate is the placement the scheduling
  framework would choose for the job as a new placement;
* **cost** — checkpoint save (an on-demand save, or nothing when the run is lost) + transfer of the
  checkpoint over the measured path between source and target (RTT + bytes at the path's
  bandwidth, slowed by its loss) + restart + progress lost since the last checkpoint (redone at the
  target's pace);
* **gain** = remaining here − remaining there; **threshold** = cost + margin, the margin per job
  class (network-sensitive training lowest, steady inference highest), times the hysteresis factor
  for a job that moved before, + the **queue's loss** (:func:`displacement_s`, 0 when no job
  waits): while jobs wait that the target's pool could hold, the GPUs the move takes there are not
  idle — one of those jobs would have had them — so a voluntary move only changes which job gets
  them, and must also pay what that job loses by running elsewhere (or waiting) instead. ``move``
  iff gain > threshold (margin = gain − threshold > 0).

Forced triggers (the job's cluster failed, or is drained) move the job whatever the margin: the
verdict still carries the numbers, which :func:`plan_migrations` ranks by. A job moved less than
the cool-down ago stays on a voluntary trigger. :class:`MigrationBudget` bounds concurrent
migrations per cluster (source and target) and per link (region pair).

The same core decides in the migration service and in the simulator (``loom.sim``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from loom_proto.jobs import JobSpec
from loom_proto.net import LinkState

__all__ = [
    "FORCED_TRIGGERS",
    "TRIGGERS",
    "Candidate",
    "JobClass",
    "MigrationBudget",
    "MigrationCost",
    "MigrationSettings",
    "MigrationVerdict",
    "PathState",
    "Plan",
    "QueuedOption",
    "RunningJobState",
    "Trigger",
    "checkpoint_bytes_of",
    "decide",
    "displacement_s",
    "job_class_of",
    "link_trigger",
    "migration_cost",
    "plan_migrations",
    "rank_key",
]

Trigger = Literal[
    "cluster_failed",
    "link_degraded",
    "link_improved",
    "cluster_improved",
    "cluster_joined",
    "drain",
    "node_slow",
]
"""Why a job is looked at: its cluster failed; a link it uses degraded (RTT ≥ 2× its baseline or
loss > 1 %); a better link or cluster appeared (a link recovered, a cluster got more GPUs);
a new cluster joined (or a failed or drained one returned); its cluster is drained; a node it
runs on delivers less than half its predicted step rate (its step here is then the observed one)."""

TRIGGERS: tuple[Trigger, ...] = (
    "cluster_failed",
    "link_degraded",
    "link_improved",
    "cluster_improved",
    "cluster_joined",
    "drain",
    "node_slow",
)

FORCED_TRIGGERS: frozenset[Trigger] = frozenset({"cluster_failed", "drain"})
"""The job cannot stay: it moves whatever the margin (no cool-down either)."""

JobClass = Literal["network_training", "training", "pipeline", "inference"]
"""How sensitive a job is to where it runs; sets its margin."""

MoveOrStay = Literal["move", "stay"]


@dataclass(frozen=True, slots=True)
class PathState:
    """The measured path between two regions: what a checkpoint transfer sees."""

    rtt_ms: float
    bandwidth_gbps: float
    loss_rate: float = 0.0

    @classmethod
    def of(cls, links: Sequence[LinkState], *, default_bandwidth_gbps: float = 1.0) -> PathState:
        """A path of link states (network perception's ``LinkState`` hops, in order): RTTs add,
        the narrowest hop sets the bandwidth, losses compound. An empty path is local (same region)."""
        if not links:
            return LOCAL_PATH
        rtt = sum(link.rtt_ms_p50 for link in links)
        bandwidths = [link.bandwidth_gbps for link in links if link.bandwidth_gbps is not None]
        bandwidth = min(bandwidths) if bandwidths else default_bandwidth_gbps
        delivered = 1.0
        for link in links:
            delivered *= 1.0 - min(max(link.loss_rate, 0.0), 1.0)
        return cls(rtt_ms=rtt, bandwidth_gbps=bandwidth, loss_rate=1.0 - delivered)

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes``: one round trip plus the bytes at the bandwidth the loss leaves.

        A path losing everything (a blackholed endpoint) never delivers: infinite."""
        if nbytes <= 0:
            return 0.0
        if self.loss_rate >= 1.0 or self.bandwidth_gbps <= 0:
            return math.inf
        effective_gbps = self.bandwidth_gbps * (1.0 - self.loss_rate)
        return self.rtt_ms / 1000.0 + nbytes * 8.0 / (effective_gbps * 1e9)


LOCAL_PATH = PathState(rtt_ms=0.5, bandwidth_gbps=100.0)
"""Source and target in one region (a checkpoint copied inside a data centre)."""


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    """The knobs of the decision; the defaults are the service's."""

    margin_s: Mapping[JobClass, float] = field(
        default_factory=lambda: {
            "network_training": 30.0,
            "training": 60.0,
            "pipeline": 60.0,
            "inference": 180.0,
        }
    )
    """Seconds the gain must exceed the cost by, per class: network-sensitive training moves most
    readily (its step depends on the links), steady inference least (users see every restart)."""
    margin_fraction: Mapping[JobClass, float] = field(
        default_factory=lambda: {
            "network_training": 0.05,
            "training": 0.10,
            "pipeline": 0.10,
            "inference": 0.25,
        }
    )
    """Plus this share of the cost (a prediction of a long cost is less sure)."""
    hysteresis_factor: float = 2.0
    """A job that moved before needs its margin times this (per earlier move, capped at 3 moves)."""
    cooldown_s: float = 1800.0
    """A job moved less than this ago stays on a voluntary trigger."""
    restart_s: float = 60.0
    """Seconds from the checkpoint's arrival to the first step (containers, model load)."""
    save_gbps: float = 4.0
    """Local write speed of an on-demand checkpoint."""
    save_on_demand: bool = True
    """A voluntary move saves a checkpoint first (losing no progress); else it resumes from the
    last periodic one."""
    degrade_rtt_factor: float = 2.0
    """A link whose RTT reaches this × its baseline is degraded."""
    degrade_loss: float = 0.01
    """Or whose loss exceeds this."""
    improve_factor: float = 1.5
    """A link whose RTT fell by this factor (or bandwidth rose by it) against the one a job was
    placed with is a better link."""
    recheck_s: float = 30.0
    """While a link stays degraded, the running jobs that use it are looked at again this often
    (:class:`loom.migrate.network.DegradedLinks`): one that stayed (no room elsewhere then, or a
    move that did not pay) moves once room appears or a better place frees up."""

    def __post_init__(self) -> None:
        if self.hysteresis_factor < 1:
            raise ValueError(f"hysteresis_factor must be >= 1, got {self.hysteresis_factor}")
        for name in ("cooldown_s", "restart_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.recheck_s) and self.recheck_s > 0):
            raise ValueError(f"recheck_s must be a finite number of seconds > 0, got {self.recheck_s}")
        if self.save_gbps <= 0:
            raise ValueError(f"save_gbps must be > 0, got {self.save_gbps}")


@dataclass(frozen=True, slots=True)
class RunningJobState:
    """A running job as the decision reads it."""

    job_id: str
    job_class: JobClass
    cluster: str
    region: str
    steps: int
    steps_done: float
    step_s: float
    """Predicted seconds per step where it runs now (math.inf: it cannot run there any more)."""
    checkpoint_every_steps: int = 0
    checkpoint_step: int | None = None
    """The latest checkpoint recorded (None: the last interval boundary at or before progress)."""
    checkpoint_bytes: float = 0.0
    attempt: int = 1
    moves: int = 0
    """Migrations so far (hysteresis)."""
    last_moved_s: float | None = None
    """When it last moved (cool-down); None: never."""

    @property
    def steps_left(self) -> float:
        """Steps still to do from where it is now."""
        return max(self.steps - self.steps_done, 0.0)

    @property
    def last_checkpoint_step(self) -> int:
        """The step a run lost now would resume from."""
        if self.checkpoint_step is not None:
            return min(self.checkpoint_step, int(self.steps_done))
        every = self.checkpoint_every_steps
        return int(self.steps_done // every) * every if every > 0 else 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """Where the scheduling framework would place the job now, as a new placement."""

    cluster: str
    region: str
    step_s: float
    """Predicted seconds per step there."""
    start_after_s: float = 0.0
    """Wait before it can start there (dataset copy, permit)."""


@dataclass(frozen=True, slots=True)
class QueuedOption:
    """A waiting job (the scheduler's queue: nothing fits it now) that the move's target pool could
    hold when free, as the scheduler predicts it there and elsewhere."""

    job_id: str
    steps_left: float
    step_target_s: float
    """Predicted seconds per step on the target's pool."""
    step_elsewhere_s: float
    """Predicted seconds per step on the fastest other pool it may use (math.inf: none)."""
    wait_free_s: float = 0.0
    """When the target's pool is expected to have room for it without the move
    (:func:`loom.sched.availability.expected_wait_s`: the running jobs' predicted ends)."""
    wait_taken_s: float = math.inf
    """The same once the move has taken its GPUs there (``ahead_gpus``; math.inf: the known
    releases never make room then)."""


def displacement_s(queued: Sequence[QueuedOption], held_s: float) -> float:
    """What a move that holds the target's GPUs ``held_s`` (its cost + its remaining time there)
    costs the queue, in seconds of one waiting job's completion: the expected loss of the job that
    would have had those GPUs, each job the target could hold equally likely.

    A job's room on the target comes ``delay`` later: from ``wait_free_s`` to ``wait_taken_s``, and
    never later than the move's end (``held_s``, when its GPUs come back); nothing when its room was
    not expected before the move ends anyway. It loses that delay, or what running elsewhere costs
    it, ``steps_left x (step elsewhere − step on the target)`` (nothing when another pool is as
    fast), whichever is less. 0 when no job waits: the GPUs taken were idle. Beliefs only (the
    scheduler's predicted steps and ends), as the rest of the rule."""
    if not queued or held_s <= 0 or math.isinf(held_s):
        return 0.0
    losses = []
    for q in queued:
        delay = max(min(q.wait_taken_s, held_s) - q.wait_free_s, 0.0)
        elsewhere = max(q.steps_left, 0.0) * max(q.step_elsewhere_s - q.step_target_s, 0.0)
        losses.append(min(delay, elsewhere) if math.isfinite(elsewhere) else delay)
    return sum(losses) / len(losses)


@dataclass(frozen=True, slots=True)
class MigrationCost:
    """What a move costs, in seconds of the job's completion, and the bytes it sends."""

    save_s: float
    transfer_s: float
    restart_s: float
    lost_s: float
    """Progress since the last checkpoint, redone at the target's pace."""
    lost_steps: float
    transfer_bytes: float

    @property
    def total_s(self) -> float:
        """The cost's components added up."""
        return self.save_s + self.transfer_s + self.restart_s + self.lost_s


@dataclass(frozen=True, slots=True)
class MigrationVerdict:
    """The decision for one job, with every number that led to it."""

    job_id: str
    trigger: Trigger
    decision: MoveOrStay
    reason: str
    source: str
    target: str | None
    remaining_here_s: float
    remaining_there_s: float
    cost: MigrationCost | None
    gain_s: float
    threshold_s: float
    margin_s: float
    """gain − threshold: positive means the move pays by that much beyond its margin."""
    forced: bool = False
    held_until_s: float | None = None
    """A stay only because of the cool-down, the move otherwise paying: when the cool-down ends
    (on the ``now_s`` clock). None otherwise."""
    queue_s: float = 0.0
    """The queue's loss included in the threshold (:func:`displacement_s`; 0: no job waits that the
    target could hold, or none was given)."""

    @property
    def move(self) -> bool:
        """Whether the job moves."""
        return self.decision == "move"

    @property
    def net_s(self) -> float:
        """Gain − cost: what the move saves the job (ranking key)."""
        return self.gain_s - (self.cost.total_s if self.cost is not None else 0.0)


def job_class_of(spec: JobSpec) -> JobClass:
    """The class a job's margin is taken from: inference by task type; pipelines; gangs that
    exchange gradients (several workers with communication, or allowed across clusters) are
    network-sensitive training; the rest training."""
    if spec.task_type == "inference":
        return "inference"
    if spec.pipeline is not None:
        return "pipeline"
    talks = spec.comm is not None and spec.comm.bytes_per_step > 0
    if talks and (spec.workers > 1 or spec.allow_multi_cluster):
        return "network_training"
    return "training"


DEFAULT_CHECKPOINT_BYTES_PER_GPU = 2e9
"""A job that says nothing of its size: 2 GB per GPU (a mid-size model with its optimiser)."""


def checkpoint_bytes_of(spec: JobSpec) -> float:
    """A job's checkpoint size in bytes: the ``checkpoint_bytes`` label; else from its gradients
    (``bytes_per_step`` is 2 B per parameter in fp16, a mixed-precision Adam checkpoint 16 B per
    parameter: × 8); else from its pipeline layers' memory; else 2 GB per GPU."""
    label = spec.labels.get("checkpoint_bytes")
    if label:
        try:
            value = float(label)
        except ValueError:
            value = -1.0
        if value >= 0:
            return value
    if spec.comm is not None and spec.comm.bytes_per_step > 0:
        return 8.0 * spec.comm.bytes_per_step
    if spec.pipeline is not None and spec.pipeline.layers:
        return sum(layer.memory_gib for layer in spec.pipeline.layers) * 2**30
    return DEFAULT_CHECKPOINT_BYTES_PER_GPU * max(spec.resources.gpus, 1) * max(spec.workers, 1)


def migration_cost(
    job: RunningJobState,
    target: Candidate,
    path: PathState,
    settings: MigrationSettings,
    *,
    run_lost: bool = False,
) -> MigrationCost:
    """The cost of moving ``job`` to ``target`` over ``path`` (from where its checkpoint is).

    ``run_lost``: the run is gone (its cluster failed): nothing can be saved, it resumes from its
    last checkpoint. Otherwise an on-demand save (``settings.save_on_demand``) keeps all progress;
    without it the job resumes from its last periodic checkpoint.
    """
    save_now = not run_lost and settings.save_on_demand and job.checkpoint_every_steps > 0
    nbytes = job.checkpoint_bytes if (save_now or job.last_checkpoint_step > 0) else 0.0
    save_s = nbytes / (settings.save_gbps * 1e9 / 8.0) if save_now else 0.0
    lost_steps = 0.0 if save_now else max(job.steps_done - job.last_checkpoint_step, 0.0)
    return MigrationCost(
        save_s=save_s,
        transfer_s=path.transfer_s(nbytes),
        restart_s=settings.restart_s,
        lost_s=lost_steps * target.step_s,
        lost_steps=lost_steps,
        transfer_bytes=nbytes,
    )


def _remaining(steps_left: float, step_s: float, wait_s: float = 0.0) -> float:
    if math.isinf(step_s):
        return math.inf
    return wait_s + steps_left * step_s


def decide(
    job: RunningJobState,
    target: Candidate | None,
    path: PathState,
    *,
    now_s: float,
    trigger: Trigger,
    settings: MigrationSettings | None = None,
    queued: Sequence[QueuedOption] = (),
) -> MigrationVerdict:
    """Move or stay, with the numbers (see the module docstring). ``target`` None: the framework
    found no placement for the job now; ``path``: from where its checkpoint is to the target;
    ``queued``: the waiting jobs the target's pool could hold (:func:`displacement_s`; none given:
    the rule without the queue's loss)."""
    settings = settings or MigrationSettings()
    forced = trigger in FORCED_TRIGGERS
    here_s = _remaining(job.steps_left, job.step_s)
    if target is None:
        return MigrationVerdict(
            job_id=job.job_id,
            trigger=trigger,
            source=job.cluster,
            remaining_here_s=here_s,
            forced=forced,
            decision="stay",
            reason="no placement elsewhere has room for it now",
            target=None,
            remaining_there_s=math.inf,
            cost=None,
            gain_s=0.0,
            threshold_s=math.inf,
            margin_s=-math.inf,
        )
    run_lost = trigger == "cluster_failed"
    cost = migration_cost(job, target, path, settings, run_lost=run_lost)
    there_s = _remaining(job.steps_left, target.step_s, target.start_after_s)
    gain_s = here_s - there_s
    moves = min(job.moves, 3)
    margin = settings.margin_s[job.job_class] + settings.margin_fraction[job.job_class] * cost.total_s
    margin *= settings.hysteresis_factor**moves
    queue_s = 0.0 if forced else displacement_s(queued, cost.total_s + there_s)
    threshold_s = cost.total_s + margin + queue_s
    verdict = MigrationVerdict(
        job_id=job.job_id,
        trigger=trigger,
        source=job.cluster,
        remaining_here_s=here_s,
        forced=forced,
        decision="stay",
        reason="",
        target=target.cluster,
        remaining_there_s=there_s,
        cost=cost,
        gain_s=gain_s,
        threshold_s=threshold_s,
        margin_s=gain_s - threshold_s,
        queue_s=queue_s,
    )
    numbers = (
        f"gain {_fmt(gain_s)} (here {_fmt(here_s)}, on {target.cluster}, the best candidate now,"
        f" {_fmt(there_s)}) vs cost "
        f"{_fmt(cost.total_s)} + margin {_fmt(margin)} ({job.job_class}"
        + (f", x{settings.hysteresis_factor**moves:g} after {job.moves} move(s)" if moves else "")
        + ")"
        + (
            f" + the queue's loss {_fmt(queue_s)} ({len(queued)} waiting job(s) it could hold)"
            if queue_s
            else ""
        )
    )
    if forced:
        why = "its cluster failed" if run_lost else "its cluster is drained"
        return replace(verdict, decision="move", reason=f"must leave: {why}; {numbers}")
    if math.isinf(cost.total_s):
        return replace(verdict, reason=f"stays: the path to {target.cluster} delivers nothing")
    if job.last_moved_s is not None and now_s - job.last_moved_s < settings.cooldown_s:
        left = settings.cooldown_s - (now_s - job.last_moved_s)
        return replace(
            verdict,
            reason=f"stays: moved {_fmt(now_s - job.last_moved_s)} ago, "
            f"cool-down {_fmt(left)} left; {numbers}",
            held_until_s=job.last_moved_s + settings.cooldown_s if gain_s > threshold_s else None,
        )
    if gain_s > threshold_s:
        return replace(verdict, decision="move", reason=f"moves: {numbers}")
    return replace(verdict, reason=f"stays: {numbers}")


def _fmt(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf" if seconds > 0 else "-inf"
    return f"{seconds:.0f} s"


def link_trigger(
    baseline: PathState, now: PathState, settings: MigrationSettings | None = None
) -> Trigger | None:
    """What a link's change means for the jobs that use it: ``link_degraded`` when its RTT reached
    ``degrade_rtt_factor`` × the baseline or its loss exceeds ``degrade_loss``; ``link_improved``
    when its RTT fell or its bandwidth rose by ``improve_factor`` (and it is not degraded); else
    None."""
    settings = settings or MigrationSettings()
    if now.rtt_ms >= settings.degrade_rtt_factor * baseline.rtt_ms or now.loss_rate > settings.degrade_loss:
        return "link_degraded"
    if now.rtt_ms * settings.improve_factor <= baseline.rtt_ms or (
        now.bandwidth_gbps >= settings.improve_factor * baseline.bandwidth_gbps
    ):
        return "link_improved"
    return None


@dataclass
class MigrationBudget:
    """Bounds migrations in flight: at most ``per_cluster`` touching a cluster (as source or
    target) and ``per_link`` over one region pair (either direction). Not thread-safe: one owner."""

    per_cluster: int = 4
    per_link: int = 4
    clusters: Counter[str] = field(default_factory=Counter)
    links: Counter[tuple[str, str]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.per_cluster < 1 or self.per_link < 1:
            raise ValueError("a migration budget allows at least one migration per cluster and link")

    @staticmethod
    def _link(src_region: str, dst_region: str) -> tuple[str, str]:
        a, b = sorted((src_region, dst_region))
        return (a, b)

    def refusal(self, source: str, target: str, src_region: str, dst_region: str) -> str | None:
        """Why a migration may not start now (None: it may)."""
        for cluster in dict.fromkeys((source, target)):
            if self.clusters[cluster] >= self.per_cluster:
                held = self.clusters[cluster]
                return f"{held} migrations already in flight at cluster {cluster} (limit {self.per_cluster})"
        if src_region != dst_region:
            link = self._link(src_region, dst_region)
            if self.links[link] >= self.per_link:
                held = self.links[link]
                return f"{held} migrations already in flight on {link[0]}-{link[1]} (limit {self.per_link})"
        return None

    def acquire(self, source: str, target: str, src_region: str, dst_region: str) -> bool:
        """Count a migration in flight if the budget allows it."""
        if self.refusal(source, target, src_region, dst_region) is not None:
            return False
        for cluster in dict.fromkeys((source, target)):
            self.clusters[cluster] += 1
        if src_region != dst_region:
            self.links[self._link(src_region, dst_region)] += 1
        return True

    def release(self, source: str, target: str, src_region: str, dst_region: str) -> None:
        """A migration finished (or failed): it no longer counts. Idempotent at zero."""
        for cluster in dict.fromkeys((source, target)):
            if self.clusters[cluster] > 0:
                self.clusters[cluster] -= 1
        if src_region != dst_region:
            link = self._link(src_region, dst_region)
            if self.links[link] > 0:
                self.links[link] -= 1

    @property
    def in_flight(self) -> int:
        """Migrations counted at their source or target clusters (a migration inside one cluster
        counts once, one between two clusters twice)."""
        return sum(self.clusters.values())


def rank_key(verdict: MigrationVerdict) -> tuple[float, float, str]:
    """The order moves start in (smallest first): largest net benefit (gain − cost) first, an
    unbounded one (a failed cluster's job) before all, ties by the cheaper move, then by id. The
    one ranking of every planner: :func:`plan_migrations`, drains (:mod:`loom.migrate.drain`)."""
    cost = verdict.cost.total_s if verdict.cost is not None else 0.0
    net = verdict.net_s
    return (-net if not math.isinf(net) else -math.inf, cost, verdict.job_id)


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`plan_migrations` decided: moves to start now (largest net benefit first),
    moves deferred by the budget (with the reason), and the jobs that stay."""

    start: list[MigrationVerdict]
    deferred: list[tuple[MigrationVerdict, str]]
    stay: list[MigrationVerdict]


def plan_migrations(
    verdicts: Iterable[MigrationVerdict],
    regions: Mapping[str, str],
    budget: MigrationBudget,
) -> Plan:
    """Rank the moving verdicts by net benefit (gain − cost, largest first; forced moves of a failed
    cluster, whose gain is unbounded, by cheapest cost first) and start those the budget allows,
    acquiring it for each. ``regions``: cluster -> region (for the link limit)."""
    moving: list[MigrationVerdict] = []
    stay: list[MigrationVerdict] = []
    for verdict in verdicts:
        (moving if verdict.move and verdict.target is not None else stay).append(verdict)

    moving.sort(key=rank_key)
    start: list[MigrationVerdict] = []
    deferred: list[tuple[MigrationVerdict, str]] = []
    for verdict in moving:
        assert verdict.target is not None
        src, dst = regions.get(verdict.source, verdict.source), regions.get(verdict.target, verdict.target)
        why = budget.refusal(verdict.source, verdict.target, src, dst)
        if why is None:
            budget.acquire(verdict.source, verdict.target, src, dst)
            start.append(verdict)
        else:
            deferred.append((verdict, why))
    return Plan(start=start, deferred=deferred, stay=stay)

"""Migration in the simulator: failures, link changes and drains move running jobs, by a policy.

:func:`loom.sim.engine.simulate` takes ``migration=MigrationPolicy(mode)``. Three modes:

* ``on`` — the benefit rule of :mod:`loom.migrate.benefit`, as the migration service applies it:
  at each trigger every affected job gets a candidate from the policy's own scheduling framework
  (a new placement, not applied: ``Framework.schedule(..., apply=False)``, no preemption), a
  :class:`~loom.migrate.benefit.MigrationVerdict` from the scheduler's *beliefs* (its speeds, the
  links as measured now, the waiting jobs the target's pool could hold: :meth:`Migrator._queued`,
  priced by :func:`~loom.migrate.benefit.displacement_s`), and the moves are started largest net
  benefit first within a
  :class:`~loom.migrate.benefit.MigrationBudget`; moves the budget defers are looked at again at
  each sample. Just before each move its verdict is taken again (the moves before it changed the
  snapshot), its placement avoiding the clusters the job runs on, as the service's re-placement
  does (else GPUs an earlier move of the same review freed there made "where it is" the candidate
  and dropped the move);
* ``never`` — no proactive move ever: only the forced re-placement of a failed cluster's jobs (the
  engine requeues them, they restart elsewhere from their last checkpoint, or where they were once
  the cluster returns if the scheduler places them there); a degraded link is lived with; a
  drained cluster only takes no new work, its jobs finish in place;
* ``always`` — every affected job with a candidate placement moves at every trigger, whatever it
  costs (no margin, cool-down or budget).

**Triggers and the jobs they affect** (the same for ``on`` and ``always``):

* ``cluster_down`` → ``cluster_failed``: every job with a part there is re-placed by the engine
  (forced, in every mode) wherever the scheduler puts it when it is requeued;
* ``cluster_up`` → ``cluster_joined``: running jobs (not pipelines) allowed on that cluster, the
  candidate on that cluster only (backflow: a candidate elsewhere, which the framework falls back
  to when that cluster is full, is none);
* ``link_degrade`` → ``link_degraded``: data-parallel jobs with parts at both ends, and inference
  whose users are at one end and lead at the other; candidate anywhere. While the link stays
  degraded, the jobs using it then are looked at again at the first sample ``recheck_s`` after the
  last look (:class:`~loom.migrate.network.DegradedLinks`, as the migration service rechecks): one
  that found no room, or whose move did not pay, moves once room appears (``always``, which has no
  cool-down, rechecks only the jobs it has not moved off that link yet);
* ``link_restore`` → ``link_improved``: jobs that left because that link degraded; anywhere;
* ``cluster_drain`` → ``drain`` (forced): jobs with a part there, moved as the migration service
  moves a drain's jobs (:func:`loom.migrate.drain.pick_moves`): largest benefit first, at most the
  event's ``concurrency`` in flight (a move is in flight until its new run computes), each only on
  room found now (a job without room keeps running there), a job that declares no checkpoints
  only at the deadline; past the event's ``deadline_s`` every job left moves at once, given up to
  the queue when no room exists. Drain moves are outside the voluntary budget, as in the service.
  A drain looks again when one of its moves lands, at every sample, and past its deadline.
  ``SimResult.migration["drains"]`` says when each drained cluster was empty (in every mode:
  ``never`` shows how long its jobs take to finish in place).

**What a move costs, by the simulator's truth.** A moved job's run stops; with checkpoints
(``work.checkpoint_every_steps`` > 0) and ``save_on_demand`` it saves one first and loses nothing,
else it resumes from its last periodic checkpoint (no checkpoints: from step 0). Its new run holds
its GPUs from the move and starts computing after ``save + transfer + restart``: the transfer is the
checkpoint (``benefit.checkpoint_bytes_of``) over the simulator's network *as it is at that time*
from the old lead region (a failed cluster's jobs: from the region of the copy they resume from,
:mod:`loom.sim.replicas`, with ``MigrationPolicy.replicas``; without it, an ideal replica of the
latest checkpoint in the best-connected other cluster) to the new one. Then the run is timed by
truth like any other (:mod:`loom.sim.truth`). Forced restarts after a failure pay the same
transfer and restart in every mode. Figures (:meth:`Migrator.figures`, in ``SimResult.migration``):
migrations, forced restarts, bytes moved between regions, GPU-hours lost (progress redone + GPUs
held while a checkpoint is saved, copied and restarted), deferred moves, verdicts, the jobs a
trigger concerned, and the replicas' figures.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from loom.migrate.benefit import (
    Candidate,
    MigrationBudget,
    MigrationSettings,
    MigrationVerdict,
    PathState,
    QueuedOption,
    RunningJobState,
    Trigger,
    checkpoint_bytes_of,
    decide,
    job_class_of,
    plan_migrations,
)
from loom.migrate.drain import DrainJob, pick_moves
from loom.migrate.network import DegradedLinks, concerned_by_link, users_of
from loom.migrate.queue import queued_for_part
from loom.migrate.replicas import ReplicaSettings
from loom.model.egress import transfer_price_per_gb
from loom.sim.replicas import SimReplicas

if TYPE_CHECKING:
    from loom.sched.framework import Decision
    from loom.sim.engine import _Job, _Simulation
    from loom.sim.model import SimEvent

__all__ = ["MODES", "MigrationMode", "MigrationPolicy", "Migrator"]

MigrationMode = Literal["on", "never", "always"]
MODES: tuple[MigrationMode, ...] = ("on", "never", "always")

_VERDICTS_KEPT = 200
"""Verdicts kept for the report (the first ones)."""


@dataclass(frozen=True)
class MigrationPolicy:
    """How the simulator moves running jobs (see the module docstring)."""

    mode: MigrationMode = "on"
    settings: MigrationSettings = field(default_factory=MigrationSettings)
    per_cluster: int = 4
    """``on``: migrations in flight per cluster (source or target)."""
    per_link: int = 4
    """``on``: migrations in flight per region pair."""
    replicas: ReplicaSettings | None = field(default_factory=ReplicaSettings)
    """Checkpoint replicas as the migration service keeps them (:mod:`loom.sim.replicas`): a failed
    cluster's jobs resume from the newest replica that was ready. None: an ideal replica, always at
    the latest checkpoint, in the best-connected other cluster (the model before replicas)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown migration mode {self.mode!r}; known: {', '.join(MODES)}")


@dataclass
class _Pending:
    """A move (or forced restart) whose new run has not started yet."""

    source_region: str
    save_s: float
    nbytes: float
    source_cluster: str
    budgeted: bool = False
    drain: str = ""
    """A drain's move: the drained cluster (in flight under its concurrency until the new run computes)."""


@dataclass
class _Drain:
    """A drained cluster, as the migration service keeps a drain (``cluster_drains``)."""

    cluster: str
    started_s: float
    concurrency: int
    deadline_s: float
    moving: dict[str, float] = field(default_factory=dict)
    """Job -> when its moved run computes: a move in flight until then (the service: until the
    job's next attempt starts)."""
    look: bool = True
    """Whether the next pass looks again: the drain began, a sample came, or a move landed."""
    deadline_woken: bool = False
    """Whether the engine was asked for an instant at the deadline (only while a job left there
    would outlive it: a far deadline otherwise kept the simulation sampling until then)."""
    said_waiting: set[str] = field(default_factory=set)
    """Jobs whose wait for capacity was recorded as a ``stay`` verdict (once a run, as the service)."""
    emptied_s: float | None = None
    moved: int = 0
    given_up: int = 0
    """Moves past the deadline with no room anywhere: the run given up, the job queued."""

    def past_deadline(self, now: float) -> bool:
        return self.deadline_s > 0 and now >= self.started_s + self.deadline_s

    def figures(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "at_s": round(self.started_s, 1),
            "concurrency": self.concurrency,
            "deadline_s": self.deadline_s,
            "emptied_after_s": None if self.emptied_s is None else round(self.emptied_s - self.started_s, 1),
            "moved": self.moved,
            "given_up": self.given_up,
        }


@dataclass
class _Figures:
    migrations: int = 0
    forced_restarts: int = 0
    bytes_moved: float = 0.0
    gpu_hours_lost: float = 0.0
    lost_steps: float = 0.0
    deferred: int = 0
    evaluated: int = 0
    stayed: int = 0
    held_by_queue: int = 0
    """Verdicts that stayed only because of the queue's loss (the move paid without it)."""
    by_trigger: Counter[str] = field(default_factory=Counter)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    moved: set[str] = field(default_factory=set)
    """Jobs moved proactively (not the forced restarts of a failure)."""
    touched: set[str] = field(default_factory=set)
    """Jobs a trigger concerned: evaluated, moved or forced to restart."""


class Migrator:
    """Applies a :class:`MigrationPolicy` to one simulation (the engine calls its hooks)."""

    def __init__(self, sim: _Simulation, policy: MigrationPolicy) -> None:
        if sim.fast is None:
            raise ValueError("migration needs a policy with a scheduling framework (FrameworkPolicy)")
        self.sim = sim
        self.policy = policy
        self.settings = policy.settings
        self.budget = MigrationBudget(policy.per_cluster, policy.per_link)
        self.in_flight: list[tuple[float, str, str, str, str]] = []
        """(compute starts at, source cluster, target cluster, source region, target region)."""
        self.pending: dict[str, _Pending] = {}
        self.moves: Counter[str] = Counter()
        self.last_moved: dict[str, float] = {}
        self.left_link: dict[str, frozenset[str]] = {}
        """Job -> the link (region pair) it left when that link degraded."""
        self.deferred: dict[str, tuple[Trigger, str | None]] = {}
        """Job -> (trigger, only this cluster) of a move the budget deferred."""
        self.drains: dict[str, _Drain] = {}
        """Clusters drained now."""
        self.drain_log: list[_Drain] = []
        """Every drain of the run, in order (for the figures)."""
        self.degraded = DegradedLinks(self.settings.recheck_s)
        """The links degraded now; their jobs are looked at again every ``recheck_s`` (at samples)."""
        self.seen: set[tuple[float, str, frozenset[frozenset[str]]]] = set()
        """Link events already handled at an instant (both directions come as two events)."""
        self.out = _Figures()
        self.replicas = SimReplicas(sim, policy.replicas, self._path) if policy.replicas is not None else None
        self.resume_steps: dict[str, int] = {}
        """A failed cluster's jobs -> the step they resume from (set after the engine stopped them)."""
        self.triggered: list[SimEvent] = []
        """Scripted events of this instant whose moves wait for the scheduling pass."""
        self.sampled = False

    # ---- hooks the engine calls ------------------------------------------------------------------

    def before_event(self, event: SimEvent) -> None:
        """Before the engine applies a scripted event: the replicas up to now; what a failure loses."""
        if self.replicas is not None:
            self.replicas.advance(self.sim.t)
        if event.kind == "cluster_down":
            self._failing(event.cluster)

    def after_event(self, event: SimEvent) -> None:
        """After the engine applied a scripted event: the triggers."""
        kind = event.kind
        if kind == "cluster_down":
            jobs = self.sim.jobs
            for job_id, step in sorted(self.resume_steps.items()):
                job = jobs.get(job_id)
                if job is not None and job.run is None:
                    job.steps_left = float(job.spec.work.steps - step)
            self.resume_steps.clear()
        elif kind == "cluster_up" and self.replicas is not None:
            self.replicas.cluster_up(event.cluster)
        if kind in ("cluster_drain", "cluster_undrain"):
            self._drain_event(event)
        elif kind in ("link_degrade", "link_restore"):
            pairs = self._pairs(event)
            for pair in pairs:
                a, b = sorted(pair)
                if kind == "link_degrade":
                    self.degraded.degraded(a, b, self.sim.t)
                else:
                    self.degraded.recovered(a, b)
            key = (self.sim.t, kind, frozenset(pairs))
            if key in self.seen or not pairs:
                return
            self.seen.add(key)
        if self.policy.mode != "never" and kind in (
            "cluster_up",
            "cluster_undrain",
            "cluster_drain",
            "link_degrade",
            "link_restore",
        ):
            self.triggered.append(event)

    def _drain_event(self, event: SimEvent) -> None:
        if event.kind == "cluster_undrain":
            self.drains.pop(event.cluster, None)
        elif event.cluster not in self.drains:  # drained again while draining: the first holds
            drain = _Drain(event.cluster, self.sim.t, event.concurrency, event.deadline_s)
            self.drains[event.cluster] = drain
            self.drain_log.append(drain)

    def on_sample(self) -> None:
        """Periodically: finished migrations free the budget; deferred moves and drains go on
        (after the pass)."""
        now = self.sim.t
        still = []
        for entry in self.in_flight:
            if entry[0] <= now:
                self.budget.release(*entry[1:])
            else:
                still.append(entry)
        self.in_flight = still
        self.sampled = True
        for drain in self.drains.values():
            drain.look = True
        if self.replicas is not None:
            self.replicas.advance(now)

    def after_pass(self) -> bool:
        """After the scheduling pass of an instant (the queue is served first, migrations take
        what is left): the triggers of the instant, then at a sample the drains and deferred moves.
        True when a job moved."""
        before = self.out.migrations
        triggered, self.triggered = self.triggered, []
        sampled, self.sampled = self.sampled, False
        if self.policy.mode != "never":
            for event in triggered:
                self._trigger(event)
            for cluster in sorted(self.drains):
                self._drain_pass(self.drains[cluster])
            if sampled:
                self._retry()
        by_cluster = self.sim.by_cluster
        for drain in self.drains.values():
            if drain.emptied_s is None and not by_cluster.get(drain.cluster):
                drain.emptied_s = self.sim.t
        return self.out.migrations > before

    def _trigger(self, event: SimEvent) -> None:
        kind = event.kind
        if kind in ("cluster_up", "cluster_undrain"):
            # An undrained cluster is offered as a joining one, as the migration service does.
            self._consider(self._allowed_on(event.cluster), "cluster_joined", only=event.cluster)
        elif kind == "link_degrade":
            hit = {
                j for pair in self._pairs(event) for j in self._across(*sorted(pair)) if pair in self.degraded
            }
            self._consider(sorted(hit), "link_degraded")
        elif kind == "link_restore":
            restored = {pair for pair in self._pairs(event) if pair not in self.degraded}
            left = [j for j, link in sorted(self.left_link.items()) if link in restored]
            self._consider(left, "link_improved")

    def _retry(self) -> None:
        looked: set[str] = set()
        if self.deferred:
            retry, self.deferred = self.deferred, {}
            by: dict[tuple[Trigger, str | None], list[str]] = {}
            for job_id, key in retry.items():
                by.setdefault(key, []).append(job_id)
            for (trigger, only), jobs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
                keep = [j for j in jobs if trigger != "link_degraded" or self._still_across(j)]
                looked.update(keep)
                self._consider(keep, trigger, only=only)
        for pair in self.degraded.due(self.sim.t):
            # A link still degraded: its jobs again (one that stayed may move now room appeared),
            # but those just looked at. ``always`` has no cool-down: a job it already moved off
            # this link (to a place that still spans it) would otherwise move at every recheck.
            again = [
                j
                for j in self._across(*sorted(pair))
                if j not in self.deferred
                and j not in looked
                and not (self.policy.mode == "always" and self.left_link.get(j) == pair)
            ]
            self._consider(again, "link_degraded")

    def start_delay(self, job: _Job, d: Decision, *, gpus: int) -> float:
        """Seconds before a moved or re-placed run computes (save + checkpoint transfer + restart);
        0 for a job that did not move."""
        if self.replicas is not None:
            self.replicas.started(job)
        pending = self.pending.pop(job.spec.job_id, None)
        if pending is None:
            return 0.0
        target_region = d.parts[0].region
        transfer_s = self._path(pending.source_region, target_region).transfer_s(pending.nbytes)
        if math.isinf(transfer_s):
            transfer_s = 0.0
        delay = pending.save_s + transfer_s + self.settings.restart_s
        if pending.source_region != target_region:
            self.out.bytes_moved += pending.nbytes
            # The checkpoint crosses regions: in the job's traffic and on its bill.
            job.record.cross_region_bytes += pending.nbytes
            job.record.transfer_cost += (
                pending.nbytes / 1e9 * transfer_price_per_gb(pending.source_region, target_region)
            )
            self.sim.cross_bytes += pending.nbytes
        self.out.gpu_hours_lost += delay * gpus / 3600.0
        drain = self.drains.get(pending.drain)
        if drain is not None:
            drain.moving[job.spec.job_id] = self.sim.t + delay
            self.sim.wake_at(self.sim.t + delay)
        if pending.budgeted:
            self.in_flight.append(
                (
                    self.sim.t + delay,
                    pending.source_cluster,
                    d.parts[0].cluster,
                    pending.source_region,
                    target_region,
                )
            )
        return delay

    def figures(self) -> dict[str, Any]:
        """What migration did in this run."""
        out = self.out
        return {
            "mode": self.policy.mode,
            "migrations": out.migrations,
            "forced_restarts": out.forced_restarts,
            "bytes_moved": out.bytes_moved,
            "gpu_hours_lost": round(out.gpu_hours_lost, 3),
            "lost_steps": round(out.lost_steps, 1),
            "deferred_by_budget": out.deferred,
            "evaluated": out.evaluated,
            "stayed": out.stayed,
            "held_by_queue": out.held_by_queue,
            "by_trigger": dict(out.by_trigger),
            "verdicts": out.verdicts,
            "touched_jobs": sorted(out.touched),
            "moved_jobs": sorted(out.moved),
            "replicas": self.replicas.figures() if self.replicas is not None else None,
            "drains": [drain.figures() for drain in self.drain_log],
        }

    # ---- affected jobs ---------------------------------------------------------------------------

    def _pairs(self, event: SimEvent) -> list[frozenset[str]]:
        """The links (region pairs) a link event changes: one, or every link of ``event.region``."""
        if event.src and event.dst:
            return [frozenset((event.src, event.dst))] if event.src != event.dst else []
        region = event.region or event.src or event.dst
        return [frozenset((region, other)) for other in self.sim.snap.net.regions if other != region]

    def _running(self, job_ids: Any) -> list[str]:
        jobs = self.sim.jobs
        return [
            j
            for j in sorted(job_ids)
            if (job := jobs.get(j)) is not None and job.run is not None and not job.run.pipeline
        ]

    def _on_cluster(self, cluster: str) -> list[str]:
        return self._running(self.sim.by_cluster.get(cluster, set()))

    def _allowed_on(self, cluster: str) -> list[str]:
        c = self.sim.snap.cluster_index.get(cluster)
        if c is None:
            return []
        return self._running(
            job_id
            for job_id, job in self.sim.jobs.items()
            if job.run is not None and bool(job.shape.pools[c].any()) and cluster not in job.record.clusters
        )

    def _across(self, a: str, b: str) -> list[str]:
        out = []
        for job_id, job in self.sim.jobs.items():
            run = job.run
            if run is None or run.pipeline:
                continue
            if concerned_by_link(run.regions, a, b, users=users_of(job.spec)):
                out.append(job_id)
        return sorted(out)

    def _still_across(self, job_id: str) -> bool:
        job = self.sim.jobs.get(job_id)
        if job is None or job.run is None:
            return False
        return any(job_id in self._across(*sorted(pair)) for pair in self.degraded)

    # ---- deciding --------------------------------------------------------------------------------

    def _path(self, src: str, dst: str) -> PathState:
        net = self.sim.snap.net
        rtt_ms, bandwidth_gbps = net.link(src, dst)
        i, j = net.index.get(src), net.index.get(dst)
        loss = float(net.loss[i, j]) if i is not None and j is not None else 0.0
        return PathState(rtt_ms=rtt_ms, bandwidth_gbps=bandwidth_gbps, loss_rate=loss)

    def _candidate(self, job: _Job, only: str | None, *, leaving_for: str | None = None) -> Decision | None:
        """Where the framework would place the job now as a new placement (nothing applied, no
        preemption or shrink); None: nowhere, or where it already is. ``leaving_for``: the job is
        being moved (its verdict's target): like the migration service's re-placement, it avoids
        the clusters it runs on but that one."""
        sim = self.sim
        assert sim.fast is not None
        snap = sim.snap
        snap.now = sim.t
        avoid = [c.id for c in snap.clusters if c.id != only] if only is not None else []
        if leaving_for is not None and job.run is not None:
            avoid += [p.cluster for p in job.run.decision.parts if p.cluster != leaving_for]
        waiting = job.spec.job_id in snap.waiting
        outcome = sim.fast.framework.schedule(job.spec, snap, avoid_clusters=avoid, apply=False)
        if not waiting:
            snap.waiting.discard(job.spec.job_id)
        d = outcome.decision
        if d is None:
            return None
        if d.victims or d.shrunk or (only is not None and any(p.cluster != only for p in d.parts)):
            # ``avoid_clusters`` is a preference of the framework (an avoided cluster is tried
            # again when nothing else fits): a backflow candidate off the returning cluster is no
            # backflow, it is none.
            if d.undo is not None:
                d.undo()
            return None
        run = job.run
        assert run is not None
        here = sorted((p.cluster, p.gpu_model) for p in run.decision.parts)
        if sorted((p.cluster, p.gpu_model) for p in d.parts) == here:
            return None
        return d

    def _state(self, job: _Job) -> RunningJobState:
        run = job.run
        assert run is not None
        spec = job.spec
        steps = spec.work.steps
        done = steps - max(job.steps_left - run.progress(self.sim.t), 0.0)
        return RunningJobState(
            job_id=spec.job_id,
            job_class=job_class_of(spec),
            cluster=run.decision.parts[0].cluster,
            region=run.regions[0],
            steps=steps,
            steps_done=done,
            step_s=self.sim.believed_step_s(spec, run.decision),
            checkpoint_every_steps=spec.work.checkpoint_every_steps,
            checkpoint_bytes=checkpoint_bytes_of(spec),
            attempt=job.record.restarts + 1,
            moves=self.moves[spec.job_id],
            last_moved_s=self.last_moved.get(spec.job_id),
        )

    def _verdict(
        self, job: _Job, trigger: Trigger, only: str | None, *, again: str | None = None, record: bool = True
    ) -> tuple[MigrationVerdict, Decision | None]:
        """The verdict on moving ``job`` now, with the framework's candidate. ``again``: the look
        just before moving it, toward this target (the job's own clusters are avoided, as the
        service's re-placement avoids them: a move of the same review may have freed GPUs there,
        which would otherwise make "where it is" the candidate and drop the move)."""
        state = self._state(job)
        d = self._candidate(job, only, leaving_for=again)
        target = None
        path = PathState(rtt_ms=0.0, bandwidth_gbps=1.0)
        if d is not None:
            lead = d.parts[0]
            target = Candidate(
                cluster=lead.cluster,
                region=lead.region,
                step_s=self.sim.believed_step_s(job.spec, d),
                start_after_s=d.start_after_s + self.sim.data_wait_s(job.spec.job_id, lead.region),
            )
            path = self._path(state.region, lead.region)
        queued = self._queued(job, d) if d is not None else []
        verdict = decide(
            state, target, path, now_s=self.sim.t, trigger=trigger, settings=self.settings, queued=queued
        )
        if again is not None or not record:  # the same look again just before moving, or kept back
            return verdict, d
        self._record(verdict, job.spec.job_id)
        return verdict, d

    def _record(self, verdict: MigrationVerdict, job_id: str) -> None:
        """Count a verdict and keep it for the report (the first :data:`_VERDICTS_KEPT`)."""
        self.out.evaluated += 1
        if _held_by_queue(verdict):
            self.out.held_by_queue += 1
        self.out.touched.add(job_id)
        if len(self.out.verdicts) < _VERDICTS_KEPT:
            self.out.verdicts.append(_summary(verdict, self.sim.t))

    def _queued(self, job: _Job, d: Decision) -> list[QueuedOption]:
        """The waiting jobs the candidate's lead pool could hold, by the rule placement's what-if
        answers the migration service with (:func:`loom.migrate.queue.queued_for_part`: the queue
        and its shapes as the framework recorded them). The snapshot does not hold the candidate
        (``apply=False``)."""
        return queued_for_part(self.sim.snap, job.spec.job_id, d.parts[0])

    def _consider(self, job_ids: list[str], trigger: Trigger, *, only: str | None = None) -> None:
        """Look at the affected jobs for one trigger and move those the mode moves."""
        if not job_ids:
            return
        jobs = self.sim.jobs
        if self.policy.mode == "always":
            self._move_all(job_ids, trigger, only)
            return
        verdicts = []
        for job_id in job_ids:
            job = jobs[job_id]
            if job.run is None:
                continue
            verdict, d = self._verdict(job, trigger, only)
            if d is not None and d.undo is not None:
                d.undo()
            verdicts.append(verdict)
        regions = {c.id: c.region for c in self.sim.snap.clusters}
        plan = plan_migrations(verdicts, regions, self.budget)
        self.out.stayed += len(plan.stay)
        for verdict, _why in plan.deferred:
            self.deferred[verdict.job_id] = (trigger, only)
            self.out.deferred += 1
        for verdict in plan.start:
            job = jobs[verdict.job_id]
            assert verdict.target is not None
            src_region, dst_region = regions[verdict.source], regions[verdict.target]
            fresh, d = (
                self._verdict(job, trigger, only, again=verdict.target)
                if job.run is not None
                else (verdict, None)
            )
            if d is None or not fresh.move:
                self.budget.release(verdict.source, verdict.target, src_region, dst_region)
                continue
            if d.parts[0].cluster != verdict.target:
                # The budget was taken for another target: count the one it goes to.
                self.budget.release(verdict.source, verdict.target, src_region, dst_region)
                if not self.budget.acquire(verdict.source, d.parts[0].cluster, src_region, d.parts[0].region):
                    self.deferred[verdict.job_id] = (trigger, only)
                    self.out.deferred += 1
                    continue
            self._move(job, d, trigger, budgeted=True)

    def _move_all(self, job_ids: list[str], trigger: Trigger, only: str | None) -> None:
        """``always``: every affected job with a candidate moves there."""
        for job_id in job_ids:
            job = self.sim.jobs[job_id]
            if job.run is None:
                continue
            _, d = self._verdict(job, trigger, only)
            if d is not None:
                self._move(job, d, trigger, budgeted=False)

    def _drain_pass(self, drain: _Drain) -> None:
        """One pass of a drain, as the migration service's drain loop makes one
        (:func:`loom.migrate.drain.pick_moves`): every job left on the cluster judged (placement's
        candidate off it now, the ``drain`` verdict), then the largest benefit first up to the
        concurrency, each moved only where room is found again just before it moves; past the
        deadline every job goes, given up to the queue where no room exists."""
        now = self.sim.t
        landed = [job_id for job_id, at in drain.moving.items() if at <= now]
        for job_id in landed:
            del drain.moving[job_id]
        past = drain.past_deadline(now)
        if not (drain.look or landed or past):
            return
        drain.look = False
        if not past and len(drain.moving) >= drain.concurrency:
            return
        jobs = self.sim.jobs
        ids = [j for j in self._on_cluster(drain.cluster) if j not in drain.moving]
        if not ids:
            return
        if not past:
            self._wake_at_deadline(drain, ids)
        verdicts: dict[str, MigrationVerdict] = {}
        for job_id in ids:
            # Recorded below for the jobs that move, and once for a job that waits for capacity.
            verdict, d = self._verdict(jobs[job_id], "drain", None, record=False)
            if d is not None and d.undo is not None:
                d.undo()
            verdicts[job_id] = verdict
        pick = pick_moves(
            drain.cluster,
            [self._drain_job(jobs[j]) for j in ids],
            verdicts,
            fresh=ids,
            in_flight=len(drain.moving),
            concurrency=drain.concurrency,
            past_deadline=past,
        )
        self._record_drain(drain, verdicts, {c.job_id for c in pick.move})
        for chosen in pick.move:
            job = jobs[chosen.job_id]
            if job.run is None:
                continue
            target = verdicts[chosen.job_id].target
            d = None
            if target is not None and target != drain.cluster:
                # Asked again as the move starts (the moves before it took room), as the service's
                # ``_room_elsewhere`` asks once the checkpoint is written.
                _, d = self._verdict(job, "drain", None, again=target)
            if d is not None and all(p.cluster != drain.cluster for p in d.parts):
                drain.moved += 1
                self._move(job, d, "drain", budgeted=False, drain=drain.cluster)
            elif past:
                drain.given_up += 1
                keep = self._leave(job, "drain", budgeted=False, drain=drain.cluster)
                self.sim.requeue(job.spec.job_id, keep_progress=keep)

    def _wake_at_deadline(self, drain: _Drain, ids: list[str]) -> None:
        """Ask the engine for an instant at the drain's deadline, once, while a job left there
        would outlive it (a far deadline otherwise kept the simulation sampling until then)."""
        deadline_at = drain.started_s + drain.deadline_s
        if drain.deadline_s <= 0 or drain.deadline_woken:
            return
        jobs = self.sim.jobs
        if max((run.end_s for j in ids if (run := jobs[j].run) is not None), default=0.0) > deadline_at:
            drain.deadline_woken = True
            self.sim.wake_at(deadline_at)

    def _record_drain(self, drain: _Drain, verdicts: dict[str, MigrationVerdict], moving: set[str]) -> None:
        """A drain pass's verdicts as the service records them: of the jobs that move, and once a
        run of a job that waits for capacity (every job every pass inflated the bench's moves)."""
        for job_id, verdict in verdicts.items():
            waits = verdict.target is None or verdict.target == drain.cluster
            if job_id in moving or (waits and job_id not in drain.said_waiting):
                self._record(verdict, job_id)
                if waits and job_id not in moving:
                    drain.said_waiting.add(job_id)

    def _drain_job(self, job: _Job) -> DrainJob:
        """A running job as a drain candidate (the service reads the same from its run's row)."""
        run = job.run
        assert run is not None
        spec = job.spec
        return DrainJob(
            job_id=spec.job_id,
            attempt=job.record.restarts + 1,
            gpus=run.gpus,
            gpu_models=tuple(spec.resources.gpu_models),
            steps=spec.work.steps,
            step=int(self._state(job).steps_done + 1e-6),
            step_time_s=spec.work.step_time_s,
            checkpoint_every_steps=spec.work.checkpoint_every_steps,
            affinity=spec.affinity,
        )

    def _move(self, job: _Job, d: Decision, trigger: Trigger, *, budgeted: bool, drain: str = "") -> None:
        keep = self._leave(job, trigger, budgeted=budgeted, drain=drain)
        self.sim.move(job.spec.job_id, d, keep_progress=keep)

    def _leave(self, job: _Job, trigger: Trigger, *, budgeted: bool, drain: str = "") -> bool:
        """What a move of ``job`` off its run costs and counts (the checkpoint it saves or the steps
        it loses, the transfer its next run waits for, the move history); returns whether it keeps
        its progress (an on-demand save)."""
        run = job.run
        assert run is not None
        spec = job.spec
        every = spec.work.checkpoint_every_steps
        keep = self.settings.save_on_demand and every > 0
        state = self._state(job)
        nbytes = checkpoint_bytes_of(spec) if (keep or state.last_checkpoint_step > 0) else 0.0
        if not keep:
            lost = max(state.steps_done - state.last_checkpoint_step, 0.0)
            self.out.lost_steps += lost
            self.out.gpu_hours_lost += lost * run.step_s * run.gpus / 3600.0
        self.pending[spec.job_id] = _Pending(
            source_region=run.regions[0],
            save_s=nbytes / (self.settings.save_gbps * 1e9 / 8.0) if keep else 0.0,
            nbytes=nbytes,
            source_cluster=run.decision.parts[0].cluster,
            budgeted=budgeted,
            drain=drain,
        )
        if trigger == "link_degraded":
            for pair in self.degraded:
                if job.spec.job_id in self._across(*sorted(pair)):
                    self.left_link[spec.job_id] = pair
        elif trigger == "link_improved":
            self.left_link.pop(spec.job_id, None)
        self.moves[spec.job_id] += 1
        self.last_moved[spec.job_id] = self.sim.t
        self.out.migrations += 1
        self.out.moved.add(spec.job_id)
        self.out.by_trigger[trigger] += 1
        self.deferred.pop(spec.job_id, None)
        return keep

    def _failing(self, cluster: str) -> None:
        """A cluster fails: its jobs' runs are lost; each restarts (wherever the scheduler puts it)
        from the newest replica of its checkpoints outside the cluster (:mod:`loom.sim.replicas`;
        without the replica model: its last checkpoint, in the best-connected other cluster)."""
        sim = self.sim
        snap = sim.snap
        info = next((c for c in snap.clusters if c.id == cluster), None)
        if info is None:
            return
        others = [c for c in snap.clusters if c.id != cluster]
        ideal = (
            max(others, key=lambda c: (self._path(info.region, c.region).bandwidth_gbps, c.id)).region
            if others
            else info.region
        )
        if self.replicas is not None:
            self.replicas.cluster_down(cluster, sim.t)
        for job_id in sorted(sim.by_cluster.get(cluster, set())):
            job = sim.jobs.get(job_id)
            if job is None or job.run is None:
                continue
            state = self._state(job)
            if self.replicas is not None:
                resume = self.replicas.resume(job, cluster)
                step, source = resume.step, resume.region or ideal
                self.resume_steps[job_id] = step
            else:
                step, source = state.last_checkpoint_step, ideal
            lost = max(state.steps_done - step, 0.0)
            self.out.lost_steps += lost
            self.out.gpu_hours_lost += lost * job.run.step_s * job.run.gpus / 3600.0
            self.out.forced_restarts += 1
            self.out.touched.add(job_id)
            self.out.by_trigger["cluster_failed"] += 1
            # A failover is a move to the rule, as the service's move history counts it: its
            # cool-down and hysteresis start now (before, a job could move straight back when the
            # cluster returned, which the service refuses).
            self.moves[job_id] += 1
            self.last_moved[job_id] = sim.t
            self.pending[job_id] = _Pending(
                source_region=source,
                save_s=0.0,
                nbytes=checkpoint_bytes_of(job.spec) if step > 0 else 0.0,
                source_cluster=cluster,
            )
            self.deferred.pop(job_id, None)


def _held_by_queue(verdict: MigrationVerdict) -> bool:
    """A voluntary stay that the move would have paid for without the queue's loss (not a cool-down)."""
    return (
        not verdict.move
        and verdict.queue_s > 0
        and verdict.margin_s + verdict.queue_s > 0
        and "cool-down" not in verdict.reason
    )


def _summary(verdict: MigrationVerdict, now: float) -> dict[str, Any]:
    def num(x: float) -> float | None:
        return None if math.isinf(x) or math.isnan(x) else round(x, 1)

    return {
        "at_s": round(now, 1),
        "job_id": verdict.job_id,
        "trigger": verdict.trigger,
        "decision": verdict.decision,
        "source": verdict.source,
        "target": verdict.target,
        "remaining_here_s": num(verdict.remaining_here_s),
        "remaining_there_s": num(verdict.remaining_there_s),
        "cost_s": num(verdict.cost.total_s) if verdict.cost is not None else None,
        "gain_s": num(verdict.gain_s),
        "threshold_s": num(verdict.threshold_s),
        "queue_s": num(verdict.queue_s),
        "reason": verdict.reason,
    }

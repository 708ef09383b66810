"""Checkpoint replicas in the simulator: the migration service's copies, timed by the simulator.

The migration service keeps a replica of each running job's latest checkpoint in another cluster
(:mod:`loom.migrate.replicas`); a failed cluster's jobs resume from it
(:func:`loom.migrate.checkpoints.choose`: the original is unreachable with its cluster). This
module runs the same core over the simulated runs:

* every checkpoint a run writes (every ``work.checkpoint_every_steps`` steps past the step it
  started from) may be copied; like the service, one copy per job at a time, always of the job's
  latest checkpoint when the copy starts (checkpoints written meanwhile are skipped);
* where and how many bytes: :func:`~loom.migrate.replicas.plan_copy` (another region first, the
  shortest transfer over the measured path, per-cluster byte budget, deltas onto the cluster's
  older replica of the job) over the simulator's network as it is (the truth links: degraded links
  copy slowly); failed clusters are unreachable;
* a copy is ready ``transfer_s`` after it started (a checkpoint written at ``t`` is safe from
  ``t + transfer_s``); a copy whose source or target cluster fails meanwhile is lost;
* at a cluster failure (:meth:`SimReplicas.resume`), each of its jobs resumes from its newest
  checkpoint that can be read (``choose``): the original where the run leads if that cluster
  survived (a pipeline or spanning gang that lost another part), else the newest ready replica
  outside the failed cluster, else step 0; read from that copy's region.

:meth:`SimReplicas.advance` brings the copies up to an instant; the migration policy calls it
before every scripted event and at every sample (links only change at scripted events, so the
copies planned between two calls see the links they would have seen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from loom.migrate.benefit import PathState, checkpoint_bytes_of
from loom.migrate.checkpoints import Checkpoint, choose
from loom.migrate.replicas import Held, Replica, ReplicaSettings, Site, changed_fraction_of, plan_copy
from loom.model.egress import transfer_price_per_gb

if TYPE_CHECKING:
    from collections.abc import Callable

    from loom.sim.engine import _Job, _Simulation

__all__ = ["ResumeFrom", "SimReplicas"]


@dataclass(frozen=True, slots=True)
class ResumeFrom:
    """Where a failed cluster's job resumes: the step, the region its checkpoint is read from (None:
    nothing to read, step 0), and why."""

    step: int
    region: str | None
    why: str


@dataclass
class _Copy:
    held: Held
    done_s: float
    source: str


@dataclass
class _Figures:
    copies: int = 0
    full_copies: int = 0
    bytes_sent: float = 0.0
    lost_copies: int = 0
    cancelled_copies: int = 0
    """Copies stopped under way because their job ended."""
    unplaced: int = 0
    resumed_from_replica: int = 0
    resumed_from_original: int = 0
    """Its lead's cluster survived (a pipeline or spanning gang lost another part)."""
    resumed_from_zero: int = 0
    steps_behind: float = 0.0
    """Checkpoint steps a failure lost because the newest checkpoint's replica was not ready."""
    reasons: dict[str, int] = field(default_factory=dict)


class SimReplicas:
    """The replicas of one simulation's running jobs (see the module docstring)."""

    def __init__(
        self,
        sim: _Simulation,
        settings: ReplicaSettings,
        path: Callable[[str, str], PathState],
    ) -> None:
        self.sim = sim
        self.settings = settings
        self.path = path
        self.down: set[str] = set()
        self.held: list[Held] = []
        self.copying: dict[str, _Copy] = {}
        self.free_s: dict[str, float] = {}
        """Job -> when its last copy ended (the next may start then)."""
        self.start_step: dict[tuple[str, int], float] = {}
        """(job, attempt) -> the step its run started from (its first own checkpoint is past it)."""
        self.out = _Figures()

    # ---- the runs --------------------------------------------------------------------------------

    def started(self, job: _Job) -> None:
        """A run of ``job`` starts (a new attempt): its own checkpoints are those past this step."""
        spec = job.spec
        self.start_step[(spec.job_id, job.record.restarts + 1)] = spec.work.steps - job.steps_left

    def _sites(self) -> list[Site]:
        return [Site(c.id, c.region) for c in self.sim.snap.clusters]

    def _checkpoint_at(self, job: _Job, at_s: float) -> int:
        """The newest checkpoint the current run has written by ``at_s`` (0: none yet, or a run
        that writes none, as the simulator's own speed probes)."""
        run = job.run
        assert run is not None
        every = job.spec.work.checkpoint_every_steps
        if every <= 0:
            return 0
        start = self.start_step.get((job.spec.job_id, job.record.restarts + 1), 0.0)
        done = job.spec.work.steps - job.steps_left + run.progress(max(at_s, run.seg_start_s))
        step = math.floor(done / every + 1e-9) * every
        return step if step > start else 0

    def _written_s(self, job: _Job, step: int) -> float:
        """When the current run wrote checkpoint ``step`` (within its current segment)."""
        run = job.run
        assert run is not None
        begin = max(run.seg_start_s, run.compute_start_s)
        base = job.spec.work.steps - job.steps_left
        if run.seg_steps <= 0 or run.end_s <= begin:
            return begin
        return begin + max(step - base, 0.0) / run.seg_steps * (run.end_s - begin)

    def advance(self, now: float) -> None:
        """Copies finished by ``now`` become ready; the next ones start where they would have."""
        running = self.sim.jobs
        for job_id, copy in list(self.copying.items()):
            ended_s = self._ended_s(job_id)
            if ended_s is not None and ended_s < copy.done_s:
                # Its job ended before the copy did: of no use, it stopped then (its replica, not
                # yet ready, goes), as the service stops replicating a job that ended.
                del self.copying[job_id]
                self._drop(copy.held)
                self.out.cancelled_copies += 1
            elif copy.done_s <= now:
                self._finish(job_id, copy)
        done = {h.job_id for h in self.held if not h.finished and self._ended_s(h.job_id) is not None}
        if done:
            self.held = [replace(h, finished=True) if h.job_id in done else h for h in self.held]
        # Jobs with no replica yet first, then by id, as the service's replica loop takes them
        # (its copies in flight are capped: ReplicaSettings.concurrency).
        replicated = {h.job_id for h in self.held}
        for job_id in sorted(
            {j for jobs in self.sim.by_cluster.values() for j in jobs}, key=lambda j: (j in replicated, j)
        ):
            job = running.get(job_id)
            if job is None or job.run is None or job.spec.work.checkpoint_every_steps <= 0:
                continue
            self._copies_of(job, now)

    def _copies_of(self, job: _Job, now: float) -> None:
        spec = job.spec
        job_id = spec.job_id
        attempt = job.record.restarts + 1
        run = job.run
        assert run is not None
        every = spec.work.checkpoint_every_steps
        for _ in range(64):  # a bound: each turn starts one copy
            copy = self.copying.get(job_id)
            if copy is not None:
                if copy.done_s > now:
                    return
                self._finish(job_id, copy)
            if len(self.copying) >= self.settings.concurrency:
                return  # every copy slot taken: looked at again at the next call
            mine = [h.step for h in self.held if h.job_id == job_id and h.attempt == attempt]
            have = max(mine, default=0)
            if self._checkpoint_at(job, now) <= have:
                return
            begin = max(self.free_s.get(job_id, -math.inf), run.compute_start_s, run.seg_start_s)
            step = self._checkpoint_at(job, begin)
            if step <= have:
                start = max(have, int(self.start_step.get((job_id, attempt), 0.0)))
                step = (start // every + 1) * every
                begin = max(begin, self._written_s(job, step))
            if begin > now:
                return
            lead = run.decision.parts[0]
            plan, skipped = plan_copy(
                job_id=job_id,
                attempt=attempt,
                step=step,
                source=Site(lead.cluster, lead.region),
                full_bytes=checkpoint_bytes_of(spec),
                checkpoint_every_steps=every,
                changed_fraction=changed_fraction_of(spec.labels, self.settings.changed_fraction),
                sites=self._sites(),
                path=self._path,
                held=self.held,
                unreachable=self.down,
                settings=self.settings,
                # What the service measures between two checkpoints: a target that could not keep
                # up with them is judged lagging (without it, a far region was chosen).
                interval_s=every * run.step_s,
            )
            if plan is None:
                self.out.unplaced += 1
                why = "; ".join(skipped) or "no other cluster"
                self.out.reasons[why[:80]] = self.out.reasons.get(why[:80], 0) + 1
                self.free_s[job_id] = now  # looked at again at the next call
                return
            evicted = set(plan.evict)
            self.held = [h for h in self.held if h not in evicted]
            held = Held(job_id, attempt, step, plan.target, plan.stored_bytes, begin, False, ready=False)
            self.held.append(held)
            self.copying[job_id] = _Copy(held, begin + plan.transfer_s, lead.cluster)
            self.out.copies += 1
            self.out.full_copies += int(plan.full)
            self.out.bytes_sent += plan.transfer_bytes
            target_region = next(
                (c.region for c in self.sim.snap.clusters if c.id == plan.target), lead.region
            )
            if target_region != lead.region:  # a copy to another region: in the job's traffic and bill
                job.record.cross_region_bytes += plan.transfer_bytes
                job.record.transfer_cost += (
                    plan.transfer_bytes / 1e9 * transfer_price_per_gb(lead.region, target_region)
                )
                self.sim.cross_bytes += plan.transfer_bytes

    def _path(self, src: str, dst: str) -> PathState | None:
        path = self.path(src, dst)
        if path.loss_rate >= 1.0 or path.bandwidth_gbps <= 0:
            return None
        return path

    def _finish(self, job_id: str, copy: _Copy) -> None:
        del self.copying[job_id]
        self.free_s[job_id] = copy.done_s
        held = copy.held
        if held.cluster in self.down or copy.source in self.down:
            self._drop(held)
            self.out.lost_copies += 1
            return
        ready = replace(held, ready=True, at_s=copy.done_s)
        # The cluster's older replica of the job is replaced (the delta was applied onto it).
        self.held = [
            h for h in self.held if not (h.job_id == job_id and h.cluster == held.cluster and h is not held)
        ]
        self.held = [ready if h is held else h for h in self.held]

    def _ended_s(self, job_id: str) -> float | None:
        """When ``job_id`` ended (-inf: the simulation holds it no more), None while it is not
        ended (running, or queued again)."""
        job = self.sim.jobs.get(job_id)
        if job is None:
            return -math.inf
        return job.record.end_s if job.run is None else None

    def _drop(self, held: Held) -> None:
        """This replica (the very record, not an equal one) is no longer held."""
        self.held = [h for h in self.held if h is not held]

    # ---- failures --------------------------------------------------------------------------------

    def cluster_down(self, cluster: str, now: float) -> None:
        """``cluster`` fails at ``now``: copies up to now are done; from it or to it they are lost."""
        self.advance(now)
        self.down.add(cluster)
        for job_id, copy in list(self.copying.items()):
            if cluster in (copy.held.cluster, copy.source):
                del self.copying[job_id]
                self._drop(copy.held)
                self.free_s[job_id] = now
                self.out.lost_copies += 1
        self.held = [h for h in self.held if h.cluster != cluster]

    def cluster_up(self, cluster: str) -> None:
        """``cluster`` is back (empty: its replicas went with it)."""
        self.down.discard(cluster)

    def resume(self, job: _Job, failed: str) -> ResumeFrom:
        """Where a job of the failed cluster resumes (call after :meth:`cluster_down`)."""
        spec = job.spec
        job_id = spec.job_id
        attempt = job.record.restarts + 1
        regions = {c.id: c.region for c in self.sim.snap.clusters}
        latest = self._checkpoint_at(job, self.sim.t) if job.run is not None else 0
        # The run writes its checkpoints where it leads (a pipeline or a spanning gang whose lead
        # survives keeps them); a copy's identity is the original's location.
        home = job.run.decision.parts[0].cluster if job.run is not None else failed
        originals = []
        if latest > 0:
            originals.append(
                Checkpoint(job_id, attempt, latest, home, f"sim://{home}/{job_id}/{attempt}/{latest}")
            )
        replicas = [
            Replica(job_id, h.attempt, h.step, h.cluster, home, f"sim://{home}/{job_id}/{h.attempt}/{h.step}")
            for h in self.held
            if h.job_id == job_id and h.ready
        ]
        choice = choose(
            originals, last_step=max(spec.work.steps - 1, 0), replicas=replicas, unreachable=self.down
        )
        if choice is not None and choice.replica is not None:
            self.out.resumed_from_replica += 1
            self.out.steps_behind += max(latest - choice.step, 0)
            return ResumeFrom(choice.step, regions.get(choice.replica.cluster), choice.why)
        if choice is not None and choice.checkpoint is not None:
            self.out.resumed_from_original += 1
            return ResumeFrom(choice.step, regions.get(home), choice.why)
        self.out.resumed_from_zero += 1
        self.out.steps_behind += latest
        why = choice.why if choice is not None else "restarts from step 0: no checkpoint recorded"
        return ResumeFrom(0, None, why)

    def figures(self) -> dict[str, Any]:
        """What the replicas did in this run."""
        out = self.out
        return {
            "copies": out.copies,
            "full_copies": out.full_copies,
            "bytes_sent": out.bytes_sent,
            "lost_copies": out.lost_copies,
            "cancelled_copies": out.cancelled_copies,
            "unplaced": out.unplaced,
            "resumed_from_replica": out.resumed_from_replica,
            "resumed_from_original": out.resumed_from_original,
            "resumed_from_zero": out.resumed_from_zero,
            "steps_behind": round(out.steps_behind, 1),
        }

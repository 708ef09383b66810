"""Checkpoint replicas in another cluster: where a copy goes, how many bytes it sends, how long (pure).

The migration service keeps a replica of each running job's latest checkpoint in another cluster,
so that a whole cluster can vanish without losing more than one checkpoint interval (a resume then
reads the replica: :func:`loom.migrate.checkpoints.choose`). This module decides each copy:

* **Where** (:func:`plan_copy`): any cluster but the checkpoint's own, reachable over a measured
  path (a stale link or one losing everything is no path), with room under its byte budget.
  Among those, a replica must **keep up**: the increment of one checkpoint interval
  (:func:`delta_bytes` over one interval) must cross the measured path (RTT + bytes at the
  bandwidth the loss leaves, :meth:`~loom.migrate.benefit.PathState.transfer_s`) within the
  checkpoint interval ``interval_s``; a target that cannot *lags*: each copy ends after the next
  checkpoint is written, so the replica falls further behind and a cluster's loss costs more
  than one interval. The choice, in order:

  1. targets that keep up before targets that lag;
  2. among those that keep up, a cluster in **another region** first, then the shortest
     transfer of *this* copy: a region is a shared failure domain (its power, its uplinks, its
     probes), and a replica in the source's own region does not cover the loss of that whole
     region — when it is the only one that keeps up, it is chosen (a replica that keeps up in
     the region beats one that lags outside it: the common failure, one cluster, then loses at
     most one interval plus the copy time) and the choice says which regions would lag;
  3. when every target lags, the one whose increment crosses fastest (the least lag), in any
     region.

  When the interval is not known (``interval_s`` None: a job with fewer than two checkpoints),
  nothing is judged lagging. The cluster that already holds the job's previous replica copies
  only the delta, so it usually keeps winning: copies stay incremental unless its path, its
  budget or its keeping up fails. What a cluster's loss costs with a replica that keeps up:
  the time since the latest checkpoint, plus one interval if the failure comes while that
  checkpoint's copy is still in flight — one interval and the copy time at most, on average
  half an interval plus the copy time.
* **Budget**: each cluster holds at most its byte budget of replicas (``stored_bytes``: a replica
  always occupies the checkpoint's full size, the delta being applied onto the previous copy in
  place). The job's own previous replica there is replaced, so it does not count. When a copy
  does not fit, replicas of *finished* jobs are evicted there, oldest first; replicas of running
  jobs never are: a cluster that cannot make room is not a candidate.
* **How many bytes** (:func:`delta_bytes`), the incremental rule: the first copy to a cluster
  sends the full checkpoint; a later one sends ``changed_fraction`` of it per checkpoint interval
  since the step the cluster's copy holds (at least one interval, at most the full size). The
  fraction is the job's ``checkpoint_changed_fraction`` label when it has one (a sparse optimiser
  state changes less than a dense one), else :attr:`ReplicaSettings.changed_fraction`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from loom.migrate.benefit import LOCAL_PATH, PathState
from loom.migrate.checkpoints import checksum_of
from loom_proto.net import LinkState

__all__ = [
    "DEFAULT_CHANGED_FRACTION",
    "CopyPlan",
    "Held",
    "Replica",
    "ReplicaSettings",
    "Site",
    "changed_fraction_of",
    "checkpoint_interval_s",
    "delta_bytes",
    "path_of",
    "plan_copy",
]

DEFAULT_CHANGED_FRACTION = 0.25
"""Share of a checkpoint's bytes that change per checkpoint interval when the job does not say
(a dense model's weights and optimiser moments all move; compressed deltas keep about a quarter)."""

UNMEASURED_PATH = PathState(rtt_ms=250.0, bandwidth_gbps=1.0)
"""A path network perception has not measured yet: priced as a slow WAN link."""


REPLICA_CONCURRENCY = 8
"""Replica copies in flight at most, by default (the migration service's and the simulator's)."""


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """How replicas are placed and sized."""

    budget_bytes: float = 2e12
    """Replica bytes one cluster holds at most (2 TB), unless :attr:`budgets_bytes` names it."""
    budgets_bytes: Mapping[str, float] = field(default_factory=dict)
    """Per-cluster byte budgets overriding :attr:`budget_bytes`."""
    changed_fraction: float = DEFAULT_CHANGED_FRACTION
    """Incremental rule: share of the checkpoint that changes per checkpoint interval."""
    concurrency: int = REPLICA_CONCURRENCY
    """Copies in flight at most, over every job (the simulator's; the migration service's
    ``replica_concurrency`` defaults to the same)."""

    def budget_of(self, cluster: str) -> float:
        """The byte budget of ``cluster``."""
        return float(self.budgets_bytes.get(cluster, self.budget_bytes))


@dataclass(frozen=True, slots=True)
class Site:
    """A cluster a replica may be written to."""

    cluster: str
    region: str


@dataclass(frozen=True, slots=True)
class Held:
    """A replica a cluster holds (or is being copied there): it takes budget."""

    job_id: str
    attempt: int
    step: int
    cluster: str
    stored_bytes: float
    at_s: float
    """When it was copied (eviction takes the oldest first)."""
    finished: bool
    """Its job is finished: the replica may be evicted to make room."""
    ready: bool = True
    """Copied in full (False: the copy is in flight; it takes budget but is no base for a delta)."""


@dataclass(frozen=True, slots=True)
class Replica:
    """A replica, as a resume reads it (:func:`loom.migrate.checkpoints.choose`)."""

    job_id: str
    attempt: int
    step: int
    cluster: str
    """Where the replica lies."""
    source_cluster: str
    source_uri: str
    """The original's location: the content's identity, which its checksum covers."""
    checksum: str = ""
    corrupt: bool = False

    def problem(self) -> str | None:
        """Why this replica cannot be resumed from, or None when it verifies."""
        if self.corrupt:
            return "marked corrupt"
        if self.checksum and self.checksum != checksum_of(
            self.job_id, self.attempt, self.step, self.source_uri
        ):
            return "checksum mismatch"
        return None


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """One replica copy: where, what it sends, how long over the measured path, what it evicts."""

    job_id: str
    attempt: int
    step: int
    source: str
    target: str
    full: bool
    """The first copy to ``target`` (else incremental onto the replica at ``base_step``)."""
    base_step: int | None
    transfer_bytes: float
    stored_bytes: float
    path: PathState
    transfer_s: float
    evict: tuple[Held, ...]
    why: str
    increment_s: float = 0.0
    """Seconds one checkpoint interval's increment takes over :attr:`path` (what keeping up needs)."""
    keeps_up: bool | None = None
    """``increment_s`` ≤ the checkpoint interval (None: the interval is not known)."""


def changed_fraction_of(labels: Mapping[str, str], default: float = DEFAULT_CHANGED_FRACTION) -> float:
    """The job's ``checkpoint_changed_fraction`` label (0-1), else ``default``."""
    raw = labels.get("checkpoint_changed_fraction")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            return default
        if 0.0 <= value <= 1.0:
            return value
    return default


def delta_bytes(
    full_bytes: float,
    *,
    base_step: int | None,
    step: int,
    checkpoint_every_steps: int,
    changed_fraction: float,
) -> float:
    """Bytes a copy of the checkpoint at ``step`` sends to a cluster whose replica is at ``base_step``.

    No base: the full checkpoint. Else ``changed_fraction`` of it per checkpoint interval since the
    base (at least one interval: a base of another attempt at the same step differs too), capped at
    the full size."""
    if base_step is None:
        return full_bytes
    intervals = 1.0
    if checkpoint_every_steps > 0:
        intervals = max((step - base_step) / checkpoint_every_steps, 1.0)
    return min(full_bytes, full_bytes * max(changed_fraction, 0.0) * intervals)


def checkpoint_interval_s(
    *,
    step: int,
    at_s: float,
    previous_step: int | None,
    previous_at_s: float | None,
    checkpoint_every_steps: int,
    time_scale: float = 1.0,
) -> float | None:
    """A job's checkpoint interval in seconds, measured from its two latest checkpoints (``at_s``:
    when each was reported, wall clock): seconds per step between them times the steps of one
    interval, times ``time_scale`` (the agents' seconds per wall second, the clock replica copies
    are timed on). None when it cannot be measured: no earlier checkpoint, no step or no time
    between them, or no interval."""
    if previous_step is None or previous_at_s is None or checkpoint_every_steps <= 0:
        return None
    steps = step - previous_step
    elapsed = at_s - previous_at_s
    if steps <= 0 or not elapsed > 0:
        return None
    return elapsed / steps * checkpoint_every_steps * time_scale


def path_of(links: Mapping[tuple[str, str], LinkState], src: str, dst: str) -> PathState | None:
    """The measured path between two regions for a copy: local inside one region; else the direct
    link's latest live state, the reverse direction's when only it is live (a region without a
    probe collector is measured from the other side only); :data:`UNMEASURED_PATH` when neither
    direction is known. None when every known direction is stale (its probes go unanswered) or
    loses everything: no copy can pass."""
    if src == dst:
        return LOCAL_PATH
    known = [link for link in (links.get((src, dst)), links.get((dst, src))) if link is not None]
    if not known:
        return UNMEASURED_PATH
    live = [link for link in known if not link.stale and link.loss_rate < 1.0]
    if not live:
        return None
    return PathState.of([live[0]])


def plan_copy(
    *,
    job_id: str,
    attempt: int,
    step: int,
    source: Site,
    full_bytes: float,
    checkpoint_every_steps: int,
    changed_fraction: float,
    sites: Sequence[Site],
    path: Callable[[str, str], PathState | None],
    held: Sequence[Held],
    unreachable: Collection[str] = (),
    settings: ReplicaSettings | None = None,
    interval_s: float | None = None,
) -> tuple[CopyPlan | None, list[str]]:
    """The copy of the checkpoint ``job_id`` wrote at ``step`` on ``source``, and why each other
    cluster was passed over (None: no cluster can take it now; the reasons say why).

    ``path(src_region, dst_region)``: the measured path (None: unreachable). ``held``: every
    replica held or in flight, any job. ``unreachable``: clusters known down (failed, stale).
    ``interval_s``: the job's checkpoint interval in seconds, on the clock ``transfer_s`` is
    counted on (None: not known; no target is judged lagging). The order of choice: the module's
    docstring."""
    settings = settings or ReplicaSettings()
    skipped: list[str] = []
    ranked: list[tuple[tuple[bool, bool, float, int, str], CopyPlan]] = []
    judged = interval_s is not None and math.isfinite(interval_s) and interval_s > 0
    for site in sites:
        if site.cluster == source.cluster:
            continue
        if site.cluster in unreachable:
            skipped.append(f"{site.cluster}: unreachable")
            continue
        measured = path(source.region, site.region)
        if measured is None:
            skipped.append(f"{site.cluster}: no path from {source.region}")
            continue
        here = [h for h in held if h.cluster == site.cluster]
        mine = [h for h in here if h.job_id == job_id]
        if any(h.step >= step and h.attempt == attempt for h in mine):
            skipped.append(f"{site.cluster}: holds step {step} already")
            continue
        bases = [h.step for h in mine if h.ready and h.step < step]
        base_step = max(bases) if bases else None
        evict = _make_room(here, job_id, full_bytes, settings.budget_of(site.cluster))
        if isinstance(evict, str):
            skipped.append(f"{site.cluster}: {evict}")
            continue
        nbytes = delta_bytes(
            full_bytes,
            base_step=base_step,
            step=step,
            checkpoint_every_steps=checkpoint_every_steps,
            changed_fraction=changed_fraction,
        )
        transfer_s = measured.transfer_s(nbytes)
        if not math.isfinite(transfer_s):
            skipped.append(f"{site.cluster}: the path from {source.region} delivers nothing")
            continue
        increment_s = measured.transfer_s(
            delta_bytes(
                full_bytes,
                base_step=step,
                step=step,
                checkpoint_every_steps=checkpoint_every_steps,
                changed_fraction=changed_fraction,
            )
        )
        keeps_up = (increment_s <= interval_s) if judged and interval_s is not None else None
        kind = "full copy" if base_step is None else f"delta onto its replica at step {base_step}"
        why = (
            f"{kind}: {nbytes / 1e9:.3g} GB over {source.region}->{site.region}"
            f" ({measured.rtt_ms:.0f} ms, {measured.bandwidth_gbps:.3g} Gbps) in {transfer_s:.2f} s"
        )
        if keeps_up is not None:
            verb, sign = ("keeps up", "<=") if keeps_up else ("lags", ">")
            why += (
                f"; {verb}: an interval's increment takes {increment_s:.3g} s"
                f" {sign} the {interval_s:.3g} s interval"
            )
        if evict:
            why += f"; evicts {len(evict)} replica(s) of finished jobs"
        plan = CopyPlan(
            job_id=job_id,
            attempt=attempt,
            step=step,
            source=source.cluster,
            target=site.cluster,
            full=base_step is None,
            base_step=base_step,
            transfer_bytes=nbytes,
            stored_bytes=full_bytes,
            path=measured,
            transfer_s=transfer_s,
            evict=tuple(evict),
            why=why,
            increment_s=increment_s,
            keeps_up=keeps_up,
        )
        lags = keeps_up is False
        # Keeping up first; then another region (only among those that keep up); then speed:
        # this copy's time among those that keep up, the increment's (the lag) among the others.
        key = (
            lags,
            not lags and site.region == source.region,
            increment_s if lags else transfer_s,
            len(evict),
            site.cluster,
        )
        ranked.append((key, plan))
    if not ranked:
        return None, skipped
    return _choose(ranked, sites, source), skipped


def _make_room(here: Sequence[Held], job_id: str, full_bytes: float, budget: float) -> list[Held] | str:
    """The finished jobs' replicas to evict (oldest first) so that ``full_bytes`` fit a cluster's
    ``budget`` beside what it holds (``here``; the job's own replica there is replaced), or why
    they cannot."""
    used = sum(h.stored_bytes for h in here if h.job_id != job_id)
    room = budget - used
    evict: list[Held] = []
    if full_bytes > room:
        for h in sorted((h for h in here if h.finished and h.job_id != job_id), key=lambda h: h.at_s):
            if full_bytes <= room:
                break
            evict.append(h)
            room += h.stored_bytes
        if full_bytes > room:
            return f"over its byte budget ({budget:.3g} B, {used:.3g} B held by running jobs' replicas)"
    return evict


def _choose(
    ranked: list[tuple[tuple[bool, bool, float, int, str], CopyPlan]], sites: Sequence[Site], source: Site
) -> CopyPlan:
    """The first of the ranked copies, its reason saying what lagged when that shaped the choice."""
    ranked.sort(key=lambda item: item[0])
    chosen = ranked[0][1]
    regions = {s.cluster: s.region for s in sites}
    if chosen.keeps_up is False:
        return replace(chosen, why=f"{chosen.why} (every target lags; this one least)")
    if chosen.keeps_up and regions.get(chosen.target) == source.region:
        lagging = [
            p.target for _, p in ranked if p.keeps_up is False and regions.get(p.target) != source.region
        ]
        if lagging:
            note = f"another region would lag: {', '.join(sorted(lagging))}"
            return replace(chosen, why=f"{chosen.why}; in {source.region}, {note}")
    return chosen

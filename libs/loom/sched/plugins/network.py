"""Network plugins: the joint compute + network score, and predicted job completion time.

Both read the measured network of the snapshot (:class:`~loom.sched.snapshot.NetMatrix`) once per
cycle as region x region arrays (:func:`region_links`) and price, per candidate:

* the **gang link**: a job inside one cluster talks over the cluster fabric
  (:data:`INTRA_CLUSTER_RTT_MS`, :data:`INTRA_CLUSTER_GBPS`); a gang that must span clusters (it
  may, and the candidate holds fewer than its workers) talks over the slowest link from the
  candidate to the partners it would need, taken best link first (:func:`gang_links`);
* the **step time** (:func:`predict_step_s`): ``compute_s = step_time_s / (speed x trust)`` (the work
  is given per reference GPU; workers are data-parallel replicas that do not change the per-step
  time) plus ``comm_s``, a ring all-reduce over the slowest link,
  ``2 x bytes_per_step x 8 / (bandwidth_gbps x 1e9) + rounds_per_step x rtt_ms / 1000`` (zero for a
  single worker);
* the **data delay** (:func:`loom.sched.plugins.data.data_delay_s`) before or while the dataset
  reaches the candidate's region.

The step-time model is plain functions so the simulator predicts with the same numbers.
"""

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from loom.net.linkstate import CostWeights
from loom.sched.availability import (
    MIN_RESERVATION_S,
    Reservation,
    WaitBook,
    expected_wait_s,
    queue_for_pool,
    sole_pool_of_queued,
)
from loom.sched.elastic import pace_scale
from loom.sched.framework import SUCCESS, Candidates, Code, CycleState, Decision, StateKey, Status
from loom.sched.plugins.compute import believed_speed, delivered_speed, speed_key
from loom.sched.plugins.data import data_delay_s, data_key, data_placement
from loom.sched.snapshot import (
    INTRA_REGION_GBPS,
    INTRA_REGION_RTT_MS,
    UNKNOWN_LINK_GBPS,
    UNKNOWN_LINK_RTT_MS,
    BoolArray,
    FloatArray,
    IntArray,
    NetMatrix,
    RunningJob,
    Snapshot,
)
from loom_proto.jobs import JobSpec, TaskType

__all__ = [
    "DEFAULT_ALPHA",
    "INTRA_CLUSTER_GBPS",
    "INTRA_CLUSTER_RTT_MS",
    "AlphaLearner",
    "GangLinks",
    "Jct",
    "Joint",
    "NearJobs",
    "NetworkFactors",
    "PoolOption",
    "RegionLinks",
    "StepEstimate",
    "allreduce_s",
    "believed_jct_s",
    "gang_links",
    "jobs_labelled",
    "latency_quality",
    "link_health",
    "near_jobs",
    "network_factors",
    "network_key",
    "predict_step_s",
    "predicted_jct_s",
    "region_links",
    "single_cluster_options",
    "slowest_link",
    "user_rtt_ms",
    "whole_gang_pools",
]

INTRA_CLUSTER_RTT_MS = 0.1
"""Round trip between two nodes of one cluster (one data-centre fabric)."""
INTRA_CLUSTER_GBPS = 100.0
"""Bandwidth between two nodes of one cluster."""
HALF_QUALITY_RTT_MS = 50.0
"""The round trip at which a latency-sensitive relation (users, neighbouring jobs) keeps half its
quality: :func:`latency_quality` is ``50 / (50 + rtt_ms)``."""
LOSS_MS = CostWeights().loss_ms
"""Milliseconds of effective latency per unit of loss rate (the link-state cost model: 1 % ~ 50 ms)."""
DEGRADED_PENALTY = 0.5
"""Share of a region's link health lost when every link out of it is degraded."""
NOMINAL_EXCHANGE_BYTES = 1e6
"""Bytes per step assumed when ranking partners for a job that declares no communication."""

DEFAULT_ALPHA: Mapping[str, float] = {
    "training_compute": 0.8,
    "training_memory": 0.7,
    "training_comm": 0.4,
    "inference": 0.3,
}
"""Compute's share of the joint score per task type until observed step times teach it."""


# ---- the network as arrays ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegionLinks:
    """The snapshot's network over ``snapshot.regions`` (regions the matrix lacks priced as unknown)."""

    rtt_ms: FloatArray
    bandwidth_gbps: FloatArray
    loss: FloatArray
    degraded: BoolArray
    measured: BoolArray
    """Per region: whether the net matrix knows it (only those count for link health)."""


_LINKS: StateKey[RegionLinks] = StateKey("network.region_links")


def region_links(state: CycleState) -> RegionLinks:
    """The region x region arrays of the cycle's snapshot, built once per cycle."""
    try:
        return state.read(_LINKS)
    except KeyError:
        pass
    links = _build_links(state.snapshot)
    state.write(_LINKS, links)
    return links


def _build_links(snap: Snapshot) -> RegionLinks:
    net = snap.net
    n, r = len(net.regions), len(snap.regions)
    rtt = np.full((r, r), UNKNOWN_LINK_RTT_MS)
    bw = np.full((r, r), UNKNOWN_LINK_GBPS)
    loss = np.zeros((r, r))
    degraded = np.zeros((r, r), dtype=np.bool_)
    rtt[:n, :n] = net.rtt_ms
    bw[:n, :n] = net.bandwidth_gbps
    loss[:n, :n] = net.loss
    degraded[:n, :n] = net.degraded
    np.fill_diagonal(rtt, INTRA_REGION_RTT_MS)
    np.fill_diagonal(bw, INTRA_REGION_GBPS)
    np.fill_diagonal(loss, 0.0)
    np.fill_diagonal(degraded, False)
    measured = np.arange(r) < n
    return RegionLinks(rtt, bw, loss, degraded, measured)


def latency_quality(rtt_ms: FloatArray) -> FloatArray:
    """1 at no latency, 1/2 at :data:`HALF_QUALITY_RTT_MS`, falling toward 0 (a smooth, scale-free map)."""
    quality: FloatArray = HALF_QUALITY_RTT_MS / (HALF_QUALITY_RTT_MS + np.maximum(rtt_ms, 0.0))
    return quality


def link_health(links: RegionLinks) -> FloatArray:
    """Per region, 0-1: mean loss of its measured out-links (as latency) and the share degraded."""
    r = links.measured.size
    out = links.measured[None, :] & ~np.eye(r, dtype=np.bool_)
    count = np.maximum(out.sum(axis=1), 1)
    mean_loss = np.where(out, links.loss, 0.0).sum(axis=1) / count
    degraded_share = np.where(out, links.degraded, False).sum(axis=1) / count
    health: FloatArray = latency_quality(LOSS_MS * mean_loss) * (1.0 - DEGRADED_PENALTY * degraded_share)
    return health


# ---- jobs near which a job should run -------------------------------------------------------


def jobs_labelled(
    snap: Snapshot, selector: Mapping[str, str], *, tenant: str, exclude_job: str = ""
) -> list[RunningJob]:
    """Running jobs of ``tenant`` carrying every label of ``selector`` (an empty selector matches
    none). A tenant's affinity reads its own jobs only: matched against every tenant's, a job could
    be put beside another tenant's on purpose, and ``loom explain`` named that tenant's job and
    labels (a newcomer's walk)."""
    if not selector:
        return []
    return [
        job
        for job in snap.running
        if job.job_id != exclude_job
        and job.tenant == tenant
        and job.cluster in snap.cluster_index
        and all(job.labels.get(k) == v for k, v in selector.items())
    ]


@dataclass(frozen=True, slots=True)
class NearJobs:
    """Per cluster asked about: where the nearest running job matching ``affinity.near_jobs`` is."""

    rtt_ms: FloatArray
    """Round trip to it (:data:`INTRA_CLUSTER_RTT_MS` in the same cluster)."""
    same_cluster: BoolArray


def near_jobs(state: CycleState, clusters: IntArray) -> NearJobs | None:
    """The nearest running job matching ``affinity.near_jobs`` per cluster; None when none runs."""
    snap = state.snapshot
    near = jobs_labelled(
        snap, state.job.affinity.near_jobs, tenant=state.job.tenant, exclude_job=state.job.job_id
    )
    if not near:
        return None
    job_clusters = np.array(sorted({snap.cluster_index[j.cluster] for j in near}), dtype=np.int64)
    links = region_links(state)
    rtt = links.rtt_ms[snap.cluster_region[clusters][:, None], snap.cluster_region[job_clusters][None, :]]
    same = clusters[:, None] == job_clusters[None, :]
    rtt = np.where(same, INTRA_CLUSTER_RTT_MS, rtt)
    return NearJobs(rtt_ms=rtt.min(axis=1), same_cluster=same.any(axis=1))


# ---- the step-time model ----------------------------------------------------------------------


def allreduce_s(
    bytes_per_step: float,
    rounds_per_step: float,
    rtt_ms: FloatArray | float,
    bandwidth_gbps: FloatArray | float,
    workers: IntArray | int,
) -> FloatArray:
    """Seconds per step of a ring all-reduce over the slowest link (0 for a single worker)."""
    rtt = np.asarray(rtt_ms, dtype=np.float64)
    bw = np.maximum(np.asarray(bandwidth_gbps, dtype=np.float64), 1e-9)
    comm = 2.0 * bytes_per_step * 8.0 / (bw * 1e9) + rounds_per_step * rtt / 1000.0
    seconds: FloatArray = np.where(np.asarray(workers) > 1, comm, 0.0)
    return seconds


def _comm_of(job: JobSpec) -> tuple[float, float]:
    if job.comm is None:
        return 0.0, 0.0
    return float(job.comm.bytes_per_step), float(job.comm.rounds_per_step)


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """Predicted seconds of one step: compute on the slowest part, communication over the slowest link."""

    compute_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        """Wall seconds per step."""
        return self.compute_s + self.comm_s

    @property
    def slowdown(self) -> float:
        """Step time over compute time (>= 1): what communication costs the job."""
        return self.step_s / self.compute_s if self.compute_s > 0 else 1.0


def slowest_link(net: NetMatrix, regions: Sequence[str]) -> tuple[float, float]:
    """(rtt_ms, bandwidth_gbps) of the slowest link between the parts' regions (one region per part);
    one part: the cluster fabric."""
    if len(regions) <= 1:
        return INTRA_CLUSTER_RTT_MS, INTRA_CLUSTER_GBPS
    rtt_ms, bandwidth_gbps = 0.0, math.inf
    for i, a in enumerate(regions):
        for j, b in enumerate(regions):
            if i != j:
                rtt, bw = net.link(a, b)
                rtt_ms, bandwidth_gbps = max(rtt_ms, rtt), min(bandwidth_gbps, bw)
    return rtt_ms, bandwidth_gbps


def predict_step_s(
    job: JobSpec,
    *,
    speeds: Sequence[float],
    regions: Sequence[str],
    net: NetMatrix,
    workers: int | None = None,
) -> StepEstimate:
    """The step time of ``job`` on parts with these delivered speeds (SCU x trust) and regions.

    Synchronous data parallelism: the slowest part sets the compute pace; a decision with more
    than one part all-reduces over the slowest link between its parts' regions.
    """
    speed = max(min(speeds, default=1.0), 1e-9)
    compute = job.work.step_time_s / speed
    rtt_ms, bandwidth_gbps = slowest_link(net, regions)
    bytes_per_step, rounds = _comm_of(job)
    comm = _allreduce_one(bytes_per_step, rounds, rtt_ms, bandwidth_gbps, workers or job.workers)
    return StepEstimate(compute_s=compute, comm_s=comm)


def users_wait_s(job: JobSpec, lead_region: str, net: NetMatrix) -> float:
    """Seconds an inference step waits for its users: the mean round trip from its known
    ``affinity.prefer_regions`` (where its users are) to ``lead_region``, as :func:`user_rtt_ms`
    scores it; 0 for other jobs or when no user region is known. The simulator times an inference
    step with it and placement's what-if adds it to both ends of a move, so a degraded link
    between an inference job and its users is a reason to move it, alike in both."""
    users = [u for u in job.affinity.prefer_regions if u in net.index]
    if job.task_type != "inference" or not users:
        return 0.0
    return sum(net.link(u, lead_region)[0] for u in users) / len(users) / 1000.0


def _allreduce_one(
    bytes_per_step: float, rounds_per_step: float, rtt_ms: float, bandwidth_gbps: float, workers: int
) -> float:
    """:func:`allreduce_s` of one link, in plain floats (the same operations, so the same result)."""
    if not workers > 1:
        return 0.0
    bw = max(float(bandwidth_gbps), 1e-9)
    return 2.0 * bytes_per_step * 8.0 / (bw * 1e9) + rounds_per_step * float(rtt_ms) / 1000.0


# ---- the gang's link per candidate --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GangLinks:
    """Per candidate: the link its gang talks over and the slowest part's delivered speed."""

    rtt_ms: FloatArray
    bandwidth_gbps: FloatArray
    speed: FloatArray
    spans: BoolArray
    """Whether the candidate needs partners in other clusters."""


def gang_links(state: CycleState, candidates: Candidates, speed: FloatArray) -> GangLinks:
    """The link each candidate's gang would talk over.

    A candidate that holds the job's minimum alone talks over its cluster fabric. One that does not
    (the job may span clusters) takes partners from other clusters, each cluster once (its
    candidate with the most room), cheapest link from it first, until the job's workers have room;
    the gang then talks over the slowest of those links and computes at its slowest part's speed.
    Partner-to-partner links are not priced.
    """
    job = state.job
    k = len(candidates)
    rtt = np.full(k, INTRA_CLUSTER_RTT_MS)
    bw = np.full(k, INTRA_CLUSTER_GBPS)
    slowest = speed.astype(np.float64)
    may_span = job.allow_multi_cluster and job.pipeline is None
    spans = (candidates.workers < state.min_workers) & may_span
    if not spans.any():
        return GangLinks(rtt, bw, slowest, spans)
    snap = state.snapshot
    links = region_links(state)
    region = snap.cluster_region[candidates.cluster]
    # A ring sends both ways: a pair's link is its slower direction (as in slowest_link).
    pair_rtt = links.rtt_ms[region[:, None], region[None, :]]
    pair_rtt = np.maximum(pair_rtt, pair_rtt.T)
    pair_bw = links.bandwidth_gbps[region[:, None], region[None, :]]
    pair_bw = np.minimum(pair_bw, pair_bw.T)
    index = np.arange(k)
    by_room = np.lexsort((index, -candidates.capacity, candidates.cluster))
    first = np.r_[True, candidates.cluster[by_room][1:] != candidates.cluster[by_room][:-1]]
    representative = np.zeros(k, dtype=np.bool_)
    representative[by_room[first]] = True
    valid = representative[None, :] & (candidates.cluster[:, None] != candidates.cluster[None, :])
    bytes_per_step, rounds = _comm_of(job)
    cost = allreduce_s(max(bytes_per_step, NOMINAL_EXCHANGE_BYTES), max(rounds, 1.0), pair_rtt, pair_bw, 2)
    cost = np.where(valid, cost, np.inf)
    order = np.argsort(cost, axis=1, kind="stable")
    room = np.take_along_axis(np.where(valid, candidates.capacity[None, :], 0), order, axis=1)
    need = np.maximum(job.workers - candidates.workers, 0)
    reached = np.cumsum(room, axis=1) >= need[:, None]
    partners = valid.sum(axis=1)
    last = np.where(reached.any(axis=1), reached.argmax(axis=1), partners - 1)
    rows = np.arange(k)
    pick = np.maximum(last, 0)
    worst_rtt = np.maximum.accumulate(np.take_along_axis(pair_rtt, order, axis=1), axis=1)[rows, pick]
    worst_bw = np.minimum.accumulate(np.take_along_axis(pair_bw, order, axis=1), axis=1)[rows, pick]
    partner_speed = np.take_along_axis(np.broadcast_to(speed, (k, k)), order, axis=1)
    worst_speed = np.minimum.accumulate(partner_speed, axis=1)[rows, pick]
    alone = partners == 0
    rtt = np.where(spans, np.where(alone, UNKNOWN_LINK_RTT_MS, worst_rtt), rtt)
    bw = np.where(spans, np.where(alone, UNKNOWN_LINK_GBPS, worst_bw), bw)
    slowest = np.where(spans & ~alone, np.minimum(slowest, worst_speed), slowest)
    return GangLinks(rtt, bw, slowest, spans)


# ---- alpha --------------------------------------------------------------------------------------


class AlphaLearner:
    """Learns compute's share of the joint score per task type from observed step times.

    Each completed (or progressing) job reports its predicted compute seconds per step and its
    observed wall seconds per step; their ratio is the share of the step that compute took. The
    learner keeps an exponentially weighted mean of that share per task type, clamped to
    [``low``, ``high``] so neither side of the joint score is ever ignored. Pure: no I/O.
    """

    def __init__(
        self,
        defaults: Mapping[str, float] = DEFAULT_ALPHA,
        *,
        smoothing: float = 0.2,
        low: float = 0.1,
        high: float = 0.95,
    ) -> None:
        if not (0.0 < smoothing <= 1.0 and 0.0 <= low <= high <= 1.0):
            raise ValueError("smoothing must be in (0, 1] and 0 <= low <= high <= 1")
        self.smoothing = smoothing
        self.low = low
        self.high = high
        self._alpha = {t: self._clamp(a) for t, a in defaults.items()}
        self.observations: dict[str, int] = {}

    def _clamp(self, value: float) -> float:
        return min(max(value, self.low), self.high)

    def alpha(self, task_type: TaskType | str) -> float:
        """Compute's weight in the joint score for ``task_type`` (0.5 for a type never seen)."""
        return self._alpha.get(task_type, self._clamp(0.5))

    def observe(self, task_type: TaskType | str, compute_s_predicted: float, observed_step_s: float) -> float:
        """Fold one observation in; returns the new alpha. Non-positive or non-finite input is ignored."""
        if not (
            math.isfinite(compute_s_predicted)
            and math.isfinite(observed_step_s)
            and compute_s_predicted > 0
            and observed_step_s > 0
        ):
            return self.alpha(task_type)
        share = min(compute_s_predicted / observed_step_s, 1.0)
        current = self.alpha(task_type)
        updated = self._clamp((1.0 - self.smoothing) * current + self.smoothing * share)
        self._alpha[task_type] = updated
        self.observations[task_type] = self.observations.get(task_type, 0) + 1
        return updated

    def as_dict(self) -> dict[str, float]:
        """The current alpha per task type (to store or show)."""
        return dict(self._alpha)


# ---- Joint -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NetworkFactors:
    """Per candidate, each 0-1 (1 = the network costs this job nothing there)."""

    comm: FloatArray
    data: FloatArray
    near: FloatArray
    users: FloatArray
    health: FloatArray

    @property
    def score(self) -> FloatArray:
        """The network score 0-100: the product of the factors."""
        total: FloatArray = 100.0 * self.comm * self.data * self.near * self.users * self.health
        return total


def network_factors(state: CycleState, candidates: Candidates, speed: FloatArray) -> NetworkFactors:
    """How much of the job survives the network at each candidate (see :class:`Joint`)."""
    snap = state.snapshot
    job = state.job
    k = len(candidates)
    ones = np.ones(k)
    links = region_links(state)
    region = snap.cluster_region[candidates.cluster]
    best_compute_s = job.work.step_time_s / max(float(speed.max(initial=0.0)), 1e-9)
    gang = gang_links(state, candidates, speed)
    bytes_per_step, rounds = _comm_of(job)
    comm_s = allreduce_s(bytes_per_step, rounds, gang.rtt_ms, gang.bandwidth_gbps, job.workers)
    comm = best_compute_s / (best_compute_s + comm_s)
    data = ones
    placement = data_placement(state)
    if placement is not None:
        run_s = job.work.steps * best_compute_s
        delay = data_delay_s(run_s, placement.sync_s[region], placement.start)
        data = run_s / (run_s + delay) if run_s > 0 else ones
    near = ones
    nearest = near_jobs(state, candidates.cluster)
    if nearest is not None:
        near = latency_quality(nearest.rtt_ms)
    users = latency_quality(user_rtt_ms(state, region))
    health = link_health(links)[region]
    return NetworkFactors(comm=comm, data=data, near=near, users=users, health=health)


_NETWORK_KEY: StateKey[tuple[object, ...] | None] = StateKey("network.key")
_NOT_YET: tuple[object, ...] = ("not computed yet",)


def elastic_width_share(state: CycleState, candidates: Candidates) -> FloatArray | None:
    """Per candidate of an elastic job: the share of the workers it asked for that the candidate
    holds (its steps go that much slower there: :func:`~loom.sched.elastic.pace_scale`); None for
    any other job (every candidate holds them all)."""
    job = state.job
    if job.min_workers is None or job.pipeline is not None or job.workers <= 0:
        return None
    width = np.clip(candidates.workers, state.min_workers, job.workers).astype(np.float64)
    share: FloatArray = width / float(job.workers)
    return share


def network_key(state: CycleState) -> tuple[object, ...] | None:
    """Everything :func:`network_factors` and :func:`predicted_jct_s` read of the job, hashable;
    None when they read more than that: the running jobs (``affinity.near_jobs``) or other
    candidates' capacity (a job that may span clusters, :func:`gang_links`). Once per cycle state."""
    held = state.get(_NETWORK_KEY, _NOT_YET)
    if held is not _NOT_YET:
        return held
    job = state.job
    key: tuple[object, ...] | None = None
    if not (job.affinity.near_jobs or (job.allow_multi_cluster and job.pipeline is None)):
        work = job.work
        key = (
            speed_key(state),
            work.step_time_s,
            work.steps,
            _comm_of(job),
            job.workers,
            data_key(job),
            job.task_type,
            tuple(job.affinity.prefer_regions),
        )
    state.write(_NETWORK_KEY, key)
    return key


class Joint:
    """Joint score: ``alpha x compute + (1 - alpha) x network``, both 0-100.

    * compute: the candidate's delivered speed per GPU (SCU x trust) over the best candidate's; for
      an elastic job, times the share of its workers the candidate holds (1 of 4 workers on GPUs
      3x faster delivers 3/4 of all 4 on the slower ones: :func:`elastic_width_share`);
    * network: ``100 x comm x data x near x users x health``, each factor 0-1:

      - comm = c / (c + comm_s): c the step's compute on the best candidate, comm_s the all-reduce
        over the gang's link (:func:`gang_links`);
      - data = R / (R + delay): R the job's run time on the best candidate, delay the wait for (or
        the slowdown while) the dataset reaches the candidate's region from its best holder;
      - near = q(rtt to the nearest running job matching ``affinity.near_jobs``);
      - users (inference only) = q(mean rtt from the ``affinity.prefer_regions``, where users are);
      - health = q(5000 ms x mean loss of the region's out-links) x (1 - 0.5 x share degraded);

      with q(rtt) = 50 / (50 + rtt_ms). A factor that does not apply to the job is 1.
    * alpha: compute's share of the step by task type, learned by :class:`AlphaLearner`.
    """

    name = "joint"

    def normalize_key(self, state: CycleState) -> tuple[()]:
        """Normalising reads the raw scores only (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return ()

    def __init__(self, learner: AlphaLearner | None = None) -> None:
        self.learner = learner if learner is not None else AlphaLearner()

    def score_key(self, state: CycleState) -> tuple[object, ...] | None:
        """:func:`network_key` and alpha (see :class:`~loom.sched.framework.ScorePlugin`)."""
        key = network_key(state)
        return None if key is None else (key, self.learner.alpha(state.job.task_type))

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        speed = delivered_speed(state, candidates)
        pace = elastic_width_share(state, candidates)
        delivered = speed if pace is None else speed * pace
        top = float(delivered.max(initial=0.0))
        compute = delivered / top * 100.0 if top > 0 else np.full(speed.shape, 100.0)
        network = network_factors(state, candidates, speed).score
        alpha = self.learner.alpha(state.job.task_type)
        joint: FloatArray = alpha * compute + (1.0 - alpha) * network
        return joint

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return np.clip(raw, 0.0, 100.0)


# ---- JCT ---------------------------------------------------------------------------------------


_JCT: StateKey[tuple[tuple[bytes, bytes, bytes], FloatArray] | None] = StateKey("network.predicted_jct")


def predicted_jct_s(state: CycleState, candidates: Candidates) -> FloatArray:
    """Per candidate: data delay + steps x (compute_s + comm_s + user round trip for inference).
    Kept in the job's state for the last candidates asked (``jct`` and ``node_fit`` both read it)."""
    signature = candidates.signature()
    held = state.get(_JCT, None)
    if held is not None and held[0] == signature:
        return held[1]
    jct = _predicted_jct_s(state, candidates)
    state.write(_JCT, (signature, jct))
    return jct


def believed_jct_s(state: CycleState, candidates: Candidates) -> FloatArray:
    """:func:`predicted_jct_s` at the believed speeds (``compute.believed_speed``): the same array
    unless the job is at risk (``Snapshot.job_at_risk``), whose handicap only ranks candidates.
    What a hold weighs a run's length and its harm to others by (``rare_fit``, ``gang_fit``)."""
    if not state.snapshot.job_at_risk(state.job):
        return predicted_jct_s(state, candidates)
    return _predicted_jct_s(state, candidates, believed_speed(state, candidates))


def _predicted_jct_s(
    state: CycleState, candidates: Candidates, speed: FloatArray | None = None
) -> FloatArray:
    job = state.job
    if speed is None:
        speed = delivered_speed(state, candidates)
    gang = gang_links(state, candidates, speed)
    bytes_per_step, rounds = _comm_of(job)
    compute_s = job.work.step_time_s / np.maximum(gang.speed, 1e-9)
    comm_s = allreduce_s(bytes_per_step, rounds, gang.rtt_ms, gang.bandwidth_gbps, job.workers)
    region = state.snapshot.cluster_region[candidates.cluster]
    run_s = job.work.steps * (compute_s + comm_s + user_rtt_ms(state, region) / 1000.0)
    share = elastic_width_share(state, candidates)
    if share is not None:
        # An elastic job on a candidate with room for fewer workers than it asked for steps that
        # much slower (pace_scale; a part of a spread counts as the whole gang's width).
        run_s = run_s / np.maximum(share, 1e-9)
    placement = data_placement(state)
    if placement is None:
        return run_s
    jct: FloatArray = run_s + data_delay_s(run_s, placement.sync_s[region], placement.start)
    return jct


def _user_regions(state: CycleState) -> list[int]:
    """An inference job's known user regions (``affinity.prefer_regions`` on the platform), as
    region indices; none for other jobs."""
    if state.job.task_type != "inference":
        return []
    index = state.snapshot.region_index
    return [index[r] for r in state.job.affinity.prefer_regions if r in index]


def _has_users(state: CycleState) -> bool:
    """Whether the job is an inference job with a known user region (``user_rtt_ms`` counts)."""
    return bool(_user_regions(state))


def _users_s(state: CycleState, region: str) -> float:
    """Seconds an inference step led from ``region`` waits for its users (:func:`user_rtt_ms`)."""
    return float(user_rtt_ms(state, np.array([state.snapshot.region_index[region]]))[0]) / 1000.0


def user_rtt_ms(state: CycleState, region: IntArray) -> FloatArray:
    """Per region index given: mean round trip from the users (an inference job's known
    ``affinity.prefer_regions``); 0 for other jobs or when no such region is known."""
    users = _user_regions(state)
    if not users:
        return np.zeros(region.size)
    rtt: FloatArray = region_links(state).rtt_ms[np.array(users)][:, region].mean(axis=0)
    return rtt


class Jct:
    """Predicted job completion time: lower is better; binds the predicted step time.

    Score: ``jct = data delay + steps x (compute_s + comm_s [+ user_rtt])`` (:func:`predicted_jct_s`;
    an inference job answers each step to its users, so the mean round trip from its
    ``prefer_regions`` counts per step); normalised
    as ``100 x best / jct``, so a candidate that takes twice as long as the best scores 50, however
    long the job is. Bind: the step time of the parts actually chosen (:func:`predict_step_s`).
    """

    name = "jct"

    def normalize_key(self, state: CycleState) -> tuple[()]:
        """Normalising reads the raw scores only (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return ()

    def score_key(self, state: CycleState) -> tuple[object, ...] | None:
        """:func:`network_key` (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return network_key(state)

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        return predicted_jct_s(state, candidates)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        if raw.size == 0:
            return raw
        positive = np.maximum(raw, 1e-12)
        best = float(positive.min())
        if not math.isfinite(best):
            return np.full(raw.shape, 100.0)
        scores: FloatArray = np.where(np.isfinite(positive), best / positive * 100.0, 0.0)
        return scores

    def bind(self, state: CycleState, decision: Decision) -> Status:
        if any(part.layers is not None for part in decision.parts):
            # Pipeline stages: the pipeline planner's bottleneck model owns the step time.
            return Status()
        snap = state.snapshot
        speeds = part_speeds(state, decision)
        estimate = predict_step_s(
            state.job,
            speeds=speeds,
            regions=[part.region for part in decision.parts],
            net=snap.net,
            workers=decision.workers,
        )
        decision.predicted_step_s = estimate.step_s
        decision.slowdown = estimate.slowdown
        return Status()


def part_speeds(state: CycleState, decision: Decision) -> list[float]:
    """One GPU's delivered speed (SCU for the job's task type x the cluster's trust) per part."""
    snap = state.snapshot
    return [
        snap.job_gpu_speed(state.job, p.gpu_model) * float(snap.trust[snap.cluster_index[p.cluster]])
        for p in decision.parts
    ]


SPAN_GPU_HOURS_BOUND = 1.25
"""A spread may hold at most this many times the GPU-hours of the same gang in one cluster."""
WAIT_MARGIN = 0.1
"""Waiting must promise to finish at least this share sooner than starting now."""

QUEUE_SLOWDOWN = 3.0
"""While other jobs wait, a job (gang or single worker) waits for faster GPUs when starting now
would take at least this many times as long as its wait behind the queue plus its run there; or,
where no queued job has that pool as its only one, when starting now (less the guard's ``margin``,
``WAIT_MARGIN`` by default) would take at least this many times its wait plus its run there
(:func:`waits_for_pool_alone`; see :class:`SpanGuard`)."""


def waits_behind_queue(busy_now_s: float, completion_behind_s: float, queue_slowdown: float) -> bool:
    """The first way a job in one cluster, a gang or a single worker, may wait for faster GPUs while
    other jobs wait (the second, looser one: :func:`waits_for_pool_alone`, for pools no queued job
    has as its only one): when starting now would take at least ``queue_slowdown`` times as long as
    waiting behind the queue and then running there (``completion_behind_s``: the pool's expected
    wait once the queued jobs ahead of it have taken their room, :func:`behind_queue`, plus the run
    there).

    A single worker followed a rule of its own until 2026-12-04: it waited whenever the slower GPUs
    would take ``queue_slowdown`` x as long to run, whatever its wait. On a truth that disagrees
    with the profiles (``tools/perturb_truth.py`` sigma 0.5, seeds 1 and 2) that rule started a
    54-h single job at once on V100s 2.9x slower than a G2 about to free up (63 GPUs, Philly-like,
    load 1.0: -6.1 % against the best baseline; -3.1 % on the 506-GPU cell of seed 2), and let
    others wait for pools the queue ahead would take first. One rule for every job: those cells
    -0.8 / -1.7 %; grid seeds 0-4 -0.18 % mean JCT, held-out seeds 5-9 +0.47 % (4 cells slower by
    0.5-2.0 %, every margin still positive), ``loom bench contention`` seeds 1-3 -0.08 %.

    Why a wait behind a queue, and why by that factor: the gang's room in the faster pool must come
    whole, from several releases, and nothing keeps the earlier ones for it (no reservation: the
    opt-in backfill plugin, which keeps them, loses), so they go to the queue's jobs ahead of it
    (measured on ``loom bench contention`` ``small3`` net at loads 1.0 and 1.2, seeds 1-3, 108
    gangs held back when the wait left the queue out: predicted wait 251 s on average, actual 686
    s, 28 % never got the pool). The queue-aware wait counts the jobs ahead; the factor was to cover
    what it still cannot see (jobs behind that fit a partial release, arrivals that the queue order
    puts ahead). Measured again on 2026-12-06 (late night), the jobs that wait now get room sooner
    than predicted (:func:`waits_for_pool_alone`): the factor works as a bar on giving up idle
    slower GPUs. Chosen on grid seeds 0-4 and contention seeds 1-3 (margins against greedy_compute,
    gavel_like and first_fit): with the plain margin (wait plus run 10 % sooner) the contention
    bench lost 2.8 points on average (-27 on small3/net/0.5), with 2x 0.7, with 3x it gained 0.2
    (worst cell -4.6, wide6/net/1.0) and kept most of the grid's gain. Held out (contention seeds
    4-6): -0.5 points on average, -5.6 at worst (wide6/mix/0.8); grid seeds 5-9 in the plugins
    README.
    """
    return busy_now_s >= queue_slowdown * completion_behind_s


def waits_for_pool_alone(
    busy_now_s: float, wait_s: float, run_s: float, queue_slowdown: float, margin: float = WAIT_MARGIN
) -> bool:
    """The second, looser way a job may wait for faster GPUs while others wait: the factor on its
    wait behind the queue alone, ``(1 - margin) x busy_now_s >= queue_slowdown x wait_s + run_s``,
    taken only for a pool that no queued job has as its only one (:class:`SpanGuard`,
    :func:`~loom.sched.availability.sole_pool_of_queued`).

    Why (2026-12-06, late night): measured again, the jobs that wait behind a queue get their room
    *sooner* than predicted (actual / predicted 0.10-0.22, geometric, on contention and grid cells
    at load 1.0), so the factor on the whole of :func:`waits_behind_queue` no longer corrects the
    wait; it bars giving up idle slower GPUs. On a job whose run there dominates it barred waits
    that would pay many times over: an inference service with users in the EU started on G2 in
    the US for 10 h rather than wait 33 min for G2 near its users and run 3.3 h there (2.91x, under
    the 3x bar). The factor on the wait alone lets such jobs wait; it also lets 4- and 8-GPU jobs
    with slower GPUs free now wait for the one pool 16-GPU gangs can use, and those gangs, with
    nowhere else to go, then waited thousands of seconds longer (``loom bench contention``
    ``small3`` net 0.5 seed 10: -9.6 % against the best baseline). Hence the condition: a pool
    some queued job can use alone keeps the stricter bar. Measured in ``docs/measurements.md``."""
    return (1.0 - margin) * busy_now_s >= queue_slowdown * wait_s + run_s


@dataclass(frozen=True, slots=True)
class PoolOption:
    """The gang in one (cluster, GPU model) pool: its step there, when the pool is expected to have
    room for it (:func:`loom.sched.availability.expected_wait_s`), its run, and what its dataset's
    first copy to the pool's region adds to the run (``data_s``; 0 when not asked for)."""

    cluster: int
    model: int
    step_s: float
    wait_s: float
    run_s: float
    data_s: float = 0.0
    behind_claims: bool = False
    """Its wait is a queue's: the claims ahead on the pool fill it, and it is their turn first
    (:func:`wait_with_claims`), so the wait is judged as one behind a queue is."""

    @property
    def busy_s(self) -> float:
        """Seconds from its start to its end there: the run plus the data delay."""
        return self.run_s + self.data_s

    @property
    def completion_s(self) -> float:
        """Seconds from now to the end: the wait, the data delay and the run."""
        return self.wait_s + self.busy_s


def single_cluster_options(
    state: CycleState,
    pools: BoolArray,
    workers: int,
    *,
    book: WaitBook | None = None,
    within_s: float = math.inf,
    with_data: bool = False,
    claims: Mapping[tuple[str, str], int] | None = None,
    prune: bool = True,
    pace: float = 1.0,
) -> list[PoolOption]:
    """The gang alone in each of ``pools``, sooner completion first; only pools whose run alone is
    shorter than ``within_s`` are looked at, and a pool's wait is computed only while it can still
    beat the best completion found (waits are the costly part). On a pool that jobs ahead in queue
    order wait for (their claims in ``book``), their GPUs count before this one's. ``with_data``:
    each option's run carries the delay of its dataset's first copy to the pool's region
    (:func:`~loom.sched.plugins.data.data_delay_s`; ``within_s`` then bounds run plus delay).
    ``claims``: the GPUs claimed ahead per (cluster id, GPU model), instead of ``book``'s
    (:func:`claimed_ahead`). ``prune=False``: every pool within ``within_s`` is an option, not only
    those that can beat the best completion found (for a wait that a queue may lengthen). ``pace``:
    how much slower than its step the job goes with ``workers`` (an elastic job given fewer than it
    asked for: :func:`~loom.sched.elastic.pace_scale`); it multiplies each run."""
    snap = state.snapshot
    job = state.job
    c_idx, m_idx = np.nonzero(pools)
    if c_idx.size == 0:
        return []
    speed = snap.believed_speeds(job)[m_idx] * snap.trust[c_idx]
    bytes_per_step, rounds = _comm_of(job)
    comm = float(allreduce_s(bytes_per_step, rounds, INTRA_CLUSTER_RTT_MS, INTRA_CLUSTER_GBPS, workers))
    # An inference job's step also waits its users' round trip from the pool's region (0 else).
    users = user_rtt_ms(state, snap.cluster_region[c_idx]) / 1000.0
    step = job.work.step_time_s / np.maximum(speed, 1e-9) + comm + users
    run = job.work.steps * step * pace
    data = np.zeros(run.shape)
    placement = data_placement(state) if with_data else None
    if placement is not None:
        data = data_delay_s(run, placement.sync_s[snap.cluster_region[c_idx]], placement.start)
    busy = run + data
    if claims is None:
        claims = claimed_ahead(state, book)
    options: list[PoolOption] = []
    best = math.inf
    for k in np.argsort(busy, kind="stable").tolist():
        if busy[k] >= (min(best, within_s) if prune else within_s):
            break
        c, m = int(c_idx[k]), int(m_idx[k])
        ahead = claims.get((snap.clusters[c].id, snap.models[m]), 0)
        wait, in_turn = wait_with_claims(
            snap,
            c,
            m,
            workers,
            state.per_worker,
            ahead_gpus=ahead,
            claimed=functools.partial(_claims_ahead, state, book, c, m),
        )
        option = PoolOption(c, m, float(step[k]), wait, float(run[k]), float(data[k]), behind_claims=in_turn)
        options.append(option)
        best = min(best, option.completion_s)
    options.sort(key=lambda o: (o.completion_s, o.busy_s))
    return options


def _claims_ahead(state: CycleState, book: WaitBook | None, c: int, m: int) -> list[tuple[int, int, float]]:
    """The claims on pool (``c``, ``m``) of the jobs ahead of this one in the book's order (those
    :func:`claimed_ahead` sums), as :func:`claimants` gives them."""
    snap, job = state.snapshot, state.job
    return claimants(
        book,
        snap.clusters[c].id,
        snap.models[m],
        lambda r: r.ahead_of(job.priority, state.submitted_at, job.job_id),
    )


def claimed_ahead(state: CycleState, book: WaitBook | None) -> dict[tuple[str, str], int]:
    """GPUs claimed in ``book`` by jobs ahead of this one in queue order, per (cluster id, GPU
    model)."""
    claims: dict[tuple[str, str], int] = {}
    if book is not None:
        job = state.job
        for held in book.ahead(job.priority, state.submitted_at, job.job_id):
            key = (held.cluster, held.gpu_model)
            claims[key] = claims.get(key, 0) + held.gpus
    return claims


def claimants(
    book: WaitBook | None, cluster: str, model: str, ahead: Callable[[Reservation], bool]
) -> list[tuple[int, int, float]]:
    """The claims on pool (``cluster``, ``model``) in ``book`` that ``ahead`` says come first, in
    the order they expect room, each as (workers, GPUs per worker, its run there) for
    ``expected_wait_s(queue=...)``."""
    if book is None:
        return []
    held = sorted(
        (r for r in book.claims.values() if r.cluster == cluster and r.gpu_model == model and ahead(r)),
        key=lambda r: (r.start_s, r.submitted_at, r.job_id),
    )
    return [(r.workers, r.per_worker, r.run_s) for r in held]


def wait_with_claims(
    snap: Snapshot,
    cluster: int,
    model: int,
    workers: int,
    per_worker: int,
    *,
    ahead_gpus: int,
    claimed: Callable[[], list[tuple[int, int, float]]],
    queue: Sequence[tuple[int, int, float]] = (),
) -> tuple[float, bool]:
    """:func:`~loom.sched.availability.expected_wait_s` with ``ahead_gpus`` claimed ahead, as room
    for this job beside all of them at once; where that never comes (the claims ahead alone fill
    the pool: sixteen short jobs waiting by choice for the 32 GPUs of a pool made its wait "never",
    and the seventeenth started on GPUs 40x slower), the claimants (``claimed()``) are served in
    turn, each holding its GPUs for its run there, before the queue. Also whether the wait is that
    of the claimants served in turn (a queue's: :attr:`PoolOption.behind_claims`)."""
    wait = expected_wait_s(snap, cluster, model, workers, per_worker, ahead_gpus=ahead_gpus, queue=queue)
    if math.isinf(wait) and ahead_gpus > 0:
        served = claimed()
        if served:
            wait = expected_wait_s(snap, cluster, model, workers, per_worker, queue=[*served, *queue])
            return wait, math.isfinite(wait)
    return wait, False


MAX_QUEUE_AHEAD = 64
"""At most this many queued jobs ahead are served before a gang in its queue-aware wait (the
first in queue order; the rest would come after any room a wait worth taking finds)."""


def queue_claims(state: CycleState, book: WaitBook | None) -> tuple[dict[tuple[str, str], int], set[str]]:
    """GPUs claimed in ``book`` by the jobs ahead of this one in the framework's queue order, per
    (cluster id, GPU model), and those jobs' ids: a claimant with a queued shape
    (``Snapshot.queued``, still in ``Snapshot.waiting``) is ahead when its queue key comes before
    ``state.queue_key``, the order :meth:`~loom.sched.snapshot.Snapshot.queue_ahead` walks; one
    without (held back by choice, not queued) by the book's order (priority, then submission)."""
    claims: dict[tuple[str, str], int] = {}
    ids: set[str] = set()
    if book is None or not book.claims:
        return claims, ids
    snap, job, key = state.snapshot, state.job, state.queue_key
    for held in book.claims.values():
        if held.job_id == job.job_id:
            continue
        shape = snap.queued.get(held.job_id)
        if key is not None and shape is not None and held.job_id in snap.waiting:
            try:
                ahead = bool(shape.key < key)
            except TypeError:
                ahead = False
        else:
            ahead = held.ahead_of(job.priority, state.submitted_at, job.job_id)
        if ahead:
            ids.add(held.job_id)
            pool = (held.cluster, held.gpu_model)
            claims[pool] = claims.get(pool, 0) + held.gpus
    return claims, ids


def behind_queue(
    state: CycleState,
    options: Sequence[PoolOption],
    workers: int,
    book: WaitBook | None,
    *,
    claims: tuple[dict[tuple[str, str], int], set[str]] | None = None,
) -> PoolOption | None:
    """The option that ends soonest when each pool's wait also lets the queued jobs ahead of this
    one (``Snapshot.queue_ahead`` by its ``queue_key``; the ones with a claim in ``book`` are
    counted as claims, :func:`queue_claims`) take their room first where their rules allow the pool
    (:func:`~loom.sched.availability.expected_wait_s` with ``queue``); None without options.
    ``options`` sorted by completion (:func:`single_cluster_options`, best with the same claims:
    ``claims``, as :func:`queue_claims` gives them): a queue only lengthens a wait, so the walk
    skips the options whose wait without it cannot beat the best. An option whose wait read
    "never" there (its claimants fill the pool; that count has no book to serve them in turn) is
    weighed with them served in turn, while its run alone could beat the best: the walk stopped at
    the first finite one before, so a pool a queue of claims filled was never looked at (an outside
    evaluator's 8-GPU train ran 48.8 h on a T4 instead of 2.4 h on the H100 its claimants held;
    another's 4 x 2-GPU job 29.5 h on L4s instead of ~3 h on H200s)."""
    snap, job = state.snapshot, state.job
    by_pool, claimed = claims if claims is not None else queue_claims(state, book)
    ahead = (
        snap.queue_ahead(state.queue_key, job.job_id, limit=MAX_QUEUE_AHEAD, skip=claimed)
        if state.queue_key is not None
        else []
    )
    best: PoolOption | None = None

    def is_claimed(held: Reservation) -> bool:
        return held.job_id in claimed

    for option in options:
        if best is not None and option.completion_s >= best.completion_s:
            if math.isfinite(option.wait_s):
                continue
            if option.busy_s >= best.completion_s:
                break  # the rest never free in this count and could not beat the best anyway
        c, m = option.cluster, option.model
        queue = queue_for_pool(snap, ahead, c, m)
        seen = option
        if queue or claims is None or math.isinf(option.wait_s):
            ahead_gpus = by_pool.get((snap.clusters[c].id, snap.models[m]), 0)
            wait, in_turn = wait_with_claims(
                snap,
                c,
                m,
                workers,
                state.per_worker,
                ahead_gpus=ahead_gpus,
                claimed=functools.partial(claimants, book, snap.clusters[c].id, snap.models[m], is_claimed),
                queue=queue,
            )
            seen = dataclasses.replace(option, wait_s=wait, behind_claims=in_turn)
        if best is None or seen.completion_s < best.completion_s:
            best = seen
    return best


def claim(state: CycleState, book: WaitBook, option: PoolOption, workers: int) -> None:
    """Record that the job waits for ``option``'s pool (a claim in the
    :class:`~loom.sched.availability.WaitBook`); none when its wait is not known. A job held back by
    choice is not counted as queued (the queue is the jobs nothing fits: ``waiting_jobs``). A
    what-if (``state.applying`` false) claims nothing."""
    snap = state.snapshot
    now = snap.now
    if not math.isfinite(option.wait_s) or not state.applying:
        return
    book.reserve(
        Reservation(
            job_id=state.job.job_id,
            priority=state.job.priority,
            submitted_at=state.submitted_at if state.submitted_at is not None else now,
            cluster=snap.clusters[option.cluster].id,
            gpu_model=snap.models[option.model],
            workers=workers,
            per_worker=state.per_worker,
            start_s=now + option.wait_s,
            expires_s=now + 2.0 * option.wait_s + MIN_RESERVATION_S,
            run_s=option.busy_s,
        )
    )


class SpanGuard:
    """Permit: start now, wait for better GPUs, or span clusters, by predicted completion time.

    Judged with :func:`predict_step_s` (what the jct plugin and the simulator use) for the
    decision's number of workers; "could hold" means a (cluster, GPU model) pool the policy allows,
    not an avoided cluster, whose schedulable nodes have the GPUs for those workers when idle (CPU
    and memory are not checked). Each such pool is an *option*: the gang alone there, finishing
    after the pool's expected wait (:func:`loom.sched.availability.expected_wait_s`: running jobs'
    predicted ends, and a claim on the pool by a job ahead in queue order) plus its run.

    - *Spread* (the decision spans clusters): allowed only when its run finishes at least
      ``margin`` sooner than the best option's wait plus run, **and** it holds at most
      ``gpu_hours_bound`` times the GPU-hours of the gang in the fastest pool that could hold it;
      otherwise the gang waits for that pool. While other jobs wait (``Snapshot.waiting``), the
      spread is also charged the time it holds its GPUs beyond the run in that pool (the
      opportunity cost: at least one waiting job gets those GPUs that much later), so it must end,
      plus that, ``margin`` sooner than waiting. A gang no pool could ever hold may spread within
      the GPU-hours bound (against the gang in one cluster at its fastest part's speed). Beyond it,
      it never waits for one cluster (none will ever hold it): when no spread over the allowed
      clusters could keep within the bound even on an idle platform
      (:func:`idle_spread_floor`), :meth:`pre_filter` rejects the gang at its first cycle, busy
      platform or not (UNRESOLVABLE, ``span_inflation``, with the factor: it would hold its GPUs
      far longer than its work needs, slowing every job behind it). The floor prices GPUs of
      different speeds as it prices a slow link (a spread runs at its slowest part's pace).
      Otherwise a spread beyond the bound is refused while a spread of like GPUs within it has
      room now (the framework then tries those, :meth:`spread_subsets`) or could have once their
      GPUs free, at most ``LIKE_WAIT_FACTOR`` x what this one would lose (``QUEUED_LIKE_WAIT_FACTOR``
      x while other jobs wait; once where no like spread could ever hold it: the ski-rental bound
      below); then it spreads.
    - *Slower GPUs, or GPUs far from its users* (any job in one cluster; inference only when
      its users are known, ``affinity.prefer_regions``: a service with none serves from when it
      starts, so faster GPUs would not end it sooner; an inference step also waits its users'
      round trip from the pool's region, :func:`user_rtt_ms`, on both sides of the comparison):
      an elastic job the framework would start with fewer workers than it may have is weighed
      against waiting for room for all of them (its run now at the narrow pace,
      :func:`~loom.sched.elastic.pace_scale`; while no other job waits, counting the growth its
      own pool gives it, :func:`grown_run_s`), but an option with room for all of them *now* passes
      like any free option (the scores' choice; plugins README). It
      waits for a faster option only when that option's
      wait plus run beats the run now by ``margin``, and never longer in all than the slower start
      would lose, ``steps x (step_now - step_better)`` since submission (ski rental: at most twice
      the better of the two). While other jobs wait (the snapshot's queue), a job (a gang or, since
      2026-12-04, a single worker) waits only when starting now would take at least
      ``queue_slowdown`` times as long as its wait behind the queue plus its run there
      (:func:`waits_behind_queue`), or, for a pool no queued job has as its only one, when
      starting now (less ``margin``) would take that many times its wait plus its run there
      (:func:`waits_for_pool_alone`, since 2026-12-06): the wait lets
      the queued jobs ahead of it in queue order (``Snapshot.queue_ahead``, by the cycle's
      ``queue_key``; each counted on the pool where its own room comes first) take their room from
      each release before it (:func:`behind_queue`, which passes them to
      :func:`~loom.sched.availability.expected_wait_s` as ``queue``), as its room must come whole
      and nothing keeps the earlier releases for it. Without a queue order (``queue_key`` None)
      or with ``queue_aware`` False, a job never waits under a queue. A moderately slower start
      costs the platform little (the GPUs left free are taken by the jobs waiting), but a long job
      on GPUs several times slower holds them, and ends, that many times later (on the
      truth-timed grid, Philly-like trace at full load, single jobs of tens of hours ran 6-12x
      slower than under ``gavel_like`` when only gangs with ``comm`` and no queue could wait). The
      bound was chosen on that grid and on ``loom bench contention`` (plugins README). An option
      free now passes (the scores chose the
      slower GPUs on purpose, e.g. for the data); one whose room is expected now only because a
      running job overran its predicted end is not free: the job waits for it, within the same
      ski-rental bound (before, such a pool passed as free and single jobs of tens of hours
      started on P100s 6x slower than the G2 about to free up). Each side's run carries what its
      dataset's first copy to the region adds (:func:`~loom.sched.plugins.data.data_delay_s`), so a
      job may also wait for GPUs where its data is rather than start now where a long copy must
      come first, under the same rules (the ski-rental bound then counts the copy time saved).

    A wait is UNSCHEDULABLE with ``wait_s`` the expected wait (none when unknown: the job is decided
    again when capacity frees). A job that waits for faster GPUs claims the pool waited for in the
    shared :class:`~loom.sched.availability.WaitBook` (jobs behind it count its GPUs first; the
    opt-in backfill plugin keeps the pool for it). A refused spread claims nothing: the gang is then
    exactly where spanning forbidden leaves it (the framework queues it, as nothing fits it in one
    cluster now, and goes on to preemption and backfill as for any such job), so allowing spanning
    changes a run only through the spreads it accepts. "Other jobs waiting" are the jobs nothing
    fits in one cluster now (``Snapshot.waiting``), not the ones held back by choice while a
    cluster holds them now. Pipelines pass.
    """

    name = "span_guard"

    def __init__(
        self,
        max_slowdown: float = 1.5,
        *,
        book: WaitBook | None = None,
        gpu_hours_bound: float = SPAN_GPU_HOURS_BOUND,
        margin: float = WAIT_MARGIN,
        queue_slowdown: float = QUEUE_SLOWDOWN,
        queue_aware: bool = True,
    ) -> None:
        if not gpu_hours_bound >= 1.0:
            raise ValueError(f"gpu_hours_bound must be at least 1, got {gpu_hours_bound}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be within [0, 1), got {margin}")
        self.max_slowdown = max_slowdown
        """Kept for configuration compatibility: the ski-rental fallback of gangs no pool holds."""
        self.book = book if book is not None else WaitBook()
        self.gpu_hours_bound = gpu_hours_bound
        self.margin = margin
        if not queue_slowdown >= 1.0:
            raise ValueError(f"queue_slowdown must be at least 1, got {queue_slowdown}")
        self.queue_slowdown = queue_slowdown
        self.queue_aware = queue_aware
        """False: a job (gang or single worker) never waits for faster GPUs under a queue (the
        gangs' rule before the queue-aware wait; kept to measure one against the other)."""

    def spread_subsets(self, state: CycleState, candidates: Candidates) -> list[BoolArray]:
        """Subsets of a gang's candidates to spread it over when the best-scored spread was
        refused, best first (``Framework.banded_spreads``): GPUs of like speed in regions with a
        good link, predicted within the GPU-hours bound (:func:`like_spreads`)."""
        if state.job.pipeline is not None:
            return []
        found = like_spreads(
            state, candidates.cluster, candidates.model, candidates.capacity, bound=self.gpu_hours_bound
        )
        return [mask for _step, mask, _where in found]

    def pre_filter(self, state: CycleState) -> Status:
        """UNRESOLVABLE (``span_inflation``) for a gang that may span clusters, that no allowed
        cluster could ever hold at any size it may run with, and whose every spread over the
        allowed clusters would hold more than ``gpu_hours_bound`` times the GPU-hours of it in one
        cluster even on an idle platform (:func:`idle_spread_floor` over every node): waiting
        cannot help it, and running it would hold its GPUs that many times longer than its work
        needs while the jobs behind it queue. Judged from the platform's capacity and links, never
        from which GPUs are free now, so the verdict stands on every later cycle while nodes, links
        and learned speeds stay as they are (a changed link or speed may turn it, either way)."""
        job = state.job
        if not job.allow_multi_cluster or job.pipeline is not None:
            return SUCCESS
        holders = _idle_workers(state, every_node=True) * _allowed_pools(state, avoided=False)
        low = state.min_workers
        if float(holders.max(initial=0.0)) >= low:
            return SUCCESS  # a cluster could hold it (the permit decides whether to wait for one)
        # The floor only rises with the workers (fewer bands and regions hold more; the all-reduce
        # of 2+ workers does not depend on how many): the least is at the gang's minimum.
        best = idle_spread_floor(state, low, every_node=True)
        if best is None or best.inflation <= self.gpu_hours_bound:
            return SUCCESS  # cannot fit at all (the framework says so), or a spread keeps within it
        cost = f"{best.inflation:.1f}x the GPU-hours of one cluster"
        most = int(holders.max(initial=0.0))
        hint = (
            f"a spread would cost at least {cost}: ask for fewer or smaller workers (one cluster"
            f" holds at most {most} of {state.per_worker} GPU(s)), or less traffic per step; a spread"
            " runs at its slowest GPUs' pace, so GPUs of different speeds count too"
        )
        return Status(
            Code.UNRESOLVABLE,
            f"no allowed cluster can ever hold {low} worker(s) x {state.per_worker} GPU(s), and spread"
            f" over the allowed clusters ({best.where}) the gang would cost at least {cost}, beyond the"
            f" {self.gpu_hours_bound:g}x bound",
            reject="span_inflation",
            hint=hint,
        )

    def permit(self, state: CycleState, decision: Decision) -> Status:
        job = state.job
        spread = len(decision.parts) > 1
        if any(p.layers is not None for p in decision.parts):
            return Status()
        snap = state.snapshot
        if not spread and job.task_type == "inference" and not _has_users(state):
            # A service with no known users starts at once: a policy choice (a service serves
            # from when it starts; the simulator still ends it after its steps, so faster GPUs
            # would end it sooner there), kept for day-long services that never wait (decided
            # before the step-time prediction and the pools, which only the cases below read).
            # One with users waits, like a batch job, for GPUs where its steps end sooner: each
            # step answers its users, so a pool near them may end it far sooner.
            return Status()
        speeds = part_speeds(state, decision)
        chosen = predict_step_s(
            job,
            speeds=speeds,
            regions=[p.region for p in decision.parts],
            net=snap.net,
            workers=decision.workers,
        )
        steps = job.work.steps
        # An elastic job given fewer workers than it asked for steps that much slower (pace_scale).
        run_now = (
            steps
            * (chosen.step_s + _users_s(state, decision.lead.region))
            * pace_scale(job, decision.workers)
        )
        holders = whole_gang_pools(state, decision.workers)
        if spread:
            return self._spread(state, decision, chosen, holders, speeds)
        # An elastic job started with fewer workers than it may have weighs starting so against
        # waiting for room for them all (before 2026-12-06 it was weighed against waiting for the
        # same few workers elsewhere, and its run now counted at full pace: a transformer started
        # with 1 of its 4 workers on a V100 ran 55 h, against 6.4 h with all 4 on G2 an hour later).
        # A narrow start grows back when its own pool has room (the cycle's growth, in the service
        # and the simulator alike), so its run counts that growth (:func:`grown_run_s`); but no job
        # grows in a pool a queued job could use (``cycle.grow_around``), so while other jobs
        # wait its run is the narrow one.
        want = decision.workers
        if job.min_workers is not None and job.pipeline is None and want < state.target_workers:
            want = state.target_workers
            holders = whole_gang_pools(state, want)
            if snap.waiting_count(exclude=job.job_id) == 0:
                run_now = grown_run_s(state, decision, want, run_now, self.book)
        pace = pace_scale(job, want)
        # Here and in every option: the run plus what the dataset's first copy to the region adds
        # (a pool where the data is may end sooner after a wait than one far from it now).
        data_now = _data_delay_s(state, decision.lead.region, run_now)
        busy_now = run_now + data_now
        options = single_cluster_options(
            state, holders, want, book=self.book, within_s=busy_now, with_data=True, pace=pace
        )
        if snap.waiting_count(exclude=job.job_id) == 0:
            options = self._past_claims(
                state, options, holders=holders, want=want, busy_now=busy_now, pace=pace
            )
        if not options:
            return Status()
        best = options[0]
        # A pool "free now" by the running jobs' predicted ends may not be: a job that overran its
        # prediction counts as released at once (expected_wait_s), yet holds its GPUs. Its wait
        # is unknown, not nothing: the job is held back for it as for any wait (ski rental below).
        overdue = best.wait_s < MIN_WAIT_S and not _holds_now(state, best.cluster, best.model, want)
        if (best.wait_s < MIN_WAIT_S and not overdue) or best.busy_s >= busy_now:
            return Status()
        if best.completion_s + MIN_WAIT_S > (1.0 - self.margin) * busy_now:
            return Status()
        if snap.waiting_count(exclude=job.job_id) > 0:
            queued = self._under_queue(state, want, busy_now, holders, pace)
            if queued is None:
                return Status()  # a queue: waiting would not pay by queue_slowdown x (docstring)
            best = queued
        waited = _waited_s(state)
        if waited >= busy_now - best.busy_s:
            return Status()
        claim(state, self.book, best, want)
        models = ", ".join(sorted({p.gpu_model for p in decision.parts}))
        c, m = best.cluster, best.model
        data = f" (with {data_now:.0f} s for its dataset's copy)" if data_now > 0 else ""
        why = _waiting_for(state, decision, best, want, run_now)
        few = f" with {decision.workers} of the {want} workers it may have" if want > decision.workers else ""
        return Status(
            Code.UNSCHEDULABLE,
            f"on {models}{few} it would end in {busy_now:.0f} s{data}; {snap.models[m]} in"
            f" {snap.clusters[c].id} is expected to have room in {best.wait_s:.0f} s and end it"
            f" {best.completion_s:.0f} s from now; waiting for {why}",
            wait_s=best.wait_s,
        )

    def _past_claims(
        self,
        state: CycleState,
        options: list[PoolOption],
        *,
        holders: BoolArray,
        want: int,
        busy_now: float,
        pace: float,
    ) -> list[PoolOption]:
        """``options`` less the pools the claims ahead fill where waiting in turn fails the queue's
        bar (such a wait is a queue's: a review found the job started now on T4s when another A100
        pool would have ended it sooner), the others looked for again without them: the first
        search stopped at pools that could not beat their completion (an outside evaluator: an
        8-GPU job waiting 5.7 h for T4s to end 35 h sooner saw them pruned behind a claimed P100,
        which then failed the bar, and ran 76 h on K80s)."""
        pools = holders
        while dropped := [
            o
            for o in options
            if o.behind_claims and not waits_behind_queue(busy_now, o.completion_s, self.queue_slowdown)
        ]:
            pools = pools.copy()
            for o in dropped:
                pools[o.cluster, o.model] = False
            options = single_cluster_options(
                state, pools, want, book=self.book, within_s=busy_now, with_data=True, pace=pace
            )
        return options

    def _under_queue(
        self, state: CycleState, workers: int, busy_now: float, holders: BoolArray, pace: float = 1.0
    ) -> PoolOption | None:
        """While other jobs wait: the option to wait for, or None (start now): the best option
        behind the queue ahead of the job, gang or single worker, when it pays by
        ``queue_slowdown`` x its wait plus run (:func:`behind_queue`, :func:`waits_behind_queue`),
        or by that factor on its wait alone where no queued job has that pool as its only one
        (:func:`waits_for_pool_alone`, :func:`~loom.sched.availability.sole_pool_of_queued`). A
        pool whose first count read "never" (its claimants fill it), served in turn, is one option
        more: when it is the best and fails those bars, the best of the others is judged, as it was
        before such pools counted. (A pool whose first count was finite and that the queue ahead
        then fills is served in turn too, and failing the bars it starts the job now, as before.)"""
        if not self.queue_aware or state.queue_key is None:
            return None
        # Every pool that ends sooner than starting now is a candidate (a queue may lengthen the
        # best queue-blind option past one that ``options`` left out), with the claims of the jobs
        # ahead in the queue's order.
        claims = queue_claims(state, self.book)
        options = single_cluster_options(
            state,
            holders,
            workers,
            within_s=busy_now,
            with_data=True,
            claims=claims[0],
            prune=False,
            pace=pace,
        )
        behind = behind_queue(state, options, workers, self.book, claims=claims)
        waits = self._worth_waiting(state, behind, workers, busy_now)
        if waits is None and behind is not None and behind.behind_claims:
            # A pool whose claimants fill it, served in turn (its first count was "never"): an
            # option more, not one that hides the others when it fails the bars (those options
            # walked again: the first walk's best among them is what it had before reaching it).
            known = [o for o in options if math.isfinite(o.wait_s)]
            behind = behind_queue(state, known, workers, self.book, claims=claims)
            waits = self._worth_waiting(state, behind, workers, busy_now)
        return waits

    def _worth_waiting(
        self, state: CycleState, behind: PoolOption | None, workers: int, busy_now: float
    ) -> PoolOption | None:
        """``behind`` (:func:`behind_queue`'s choice) when waiting for it pays by the queue's bars
        (:meth:`_under_queue`), else None."""
        if behind is None or behind.busy_s >= busy_now:
            return None
        if behind.wait_s < MIN_WAIT_S and _holds_now(state, behind.cluster, behind.model, workers):
            return None  # room now behind the queue too: the scores chose the slower GPUs
        if waits_behind_queue(busy_now, behind.completion_s, self.queue_slowdown):
            return behind
        if not waits_for_pool_alone(busy_now, behind.wait_s, behind.busy_s, self.queue_slowdown, self.margin):
            return None
        if sole_pool_of_queued(state.snapshot, behind.cluster, behind.model, exclude=state.job.job_id):
            return None  # a queued job can go nowhere else: only the stricter waits_behind_queue
        return behind

    def _spread(
        self,
        state: CycleState,
        decision: Decision,
        chosen: StepEstimate,
        holders: BoolArray,
        speeds: Sequence[float],
    ) -> Status:
        job, snap = state.job, state.snapshot
        steps = job.work.steps
        run_now = steps * (chosen.step_s + _users_s(state, decision.lead.region))
        where = ", ".join(p.cluster for p in decision.parts)
        if not holders.any():
            # No pool could ever hold the gang: judged against it in one cluster at its fastest
            # part's speed (what no spread can beat). Trust is placement's caution about a new
            # cluster's claim, not a speed that spreading loses: both sides carry the least trust
            # of the parts, so only GPUs that really differ (and the network) count as inflation.
            trusts = [max(float(snap.trust[snap.cluster_index[p.cluster]]), 1e-9) for p in decision.parts]
            raw = [s / t for s, t in zip(speeds, trusts, strict=True)]
            ideal = predict_step_s(
                job,
                speeds=[max(raw) * min(trusts)],
                regions=[decision.parts[0].region],
                net=snap.net,
                workers=decision.workers,
            )
            if chosen.step_s <= self.gpu_hours_bound * ideal.step_s:
                return Status()
            # Never rejected here (the pre-filter did that, from the idle platform alone): a
            # verdict that hung on which GPUs are free now would not be final. When a spread of like
            # GPUs within the bound has room now (:func:`free_like_spreads`), this one is refused
            # and the framework tries those next (``Framework.banded_spreads``); when the
            # schedulable nodes could hold one idle, the gang waits for one. Either wait lasts at
            # most ``LIKE_WAIT_FACTOR`` x what spreading now loses against one cluster (ski
            # rental), and a gang no such spread could hold waits at most that once: the filters
            # may rule out pools these count, and a gang that waited without end would never run.
            bound = self.gpu_hours_bound
            now = free_like_spreads(state, bound=bound)
            idle = now or free_like_spreads(state, bound=bound, idle=True)
            queued = snap.waiting_count(exclude=job.job_id) > 0
            floor = idle_spread_floor(state, decision.workers)
            better = floor if floor is not None and floor.inflation <= bound else None
            why = (
                f" of like GPUs within it has room now ({now})"
                if now
                else f" of like GPUs within it is possible when their GPUs free ({idle}); waiting for one"
                if idle
                else ""
                if better is None
                else f" within it may be possible ({better.where}); waiting for one"
            )
            return wait_unless_lost(
                state,
                chosen.step_s,
                ideal.step_s,
                f"spread over {where} a step would take {chosen.step_s:.2f} s against"
                f" {ideal.step_s:.2f} s in one cluster, more than {bound:g}x its GPU-hours"
                + (f"; a spread{why}" if why else ""),
                factor=(QUEUED_LIKE_WAIT_FACTOR if queued else LIKE_WAIT_FACTOR) if idle else 1.0,
            )
        options = single_cluster_options(state, holders, decision.workers, book=self.book)
        fastest = float(np.min([o.run_s for o in options])) if options else math.inf
        best = options[0] if options else None
        # The spread and the single-cluster gang hold the same GPUs: GPU-hours compare as runs.
        within = run_now <= self.gpu_hours_bound * fastest
        cost = spread_cost_s(run_now, best, queued=snap.waiting_count(exclude=job.job_id) > 0)
        if within and (best is None or cost < (1.0 - self.margin) * best.completion_s):
            return Status()
        if best is None:
            return Status()
        # No claim in the wait book: a refused spread leaves the gang exactly where spanning
        # forbidden would (queued, as nothing fits it in one cluster now, and claiming nothing).
        # A claim made jobs behind count its GPUs ahead and start on GPUs several times slower
        # (wide6 mix, load 0.8: a single job on T4 for 1,611 s instead of a G2 72 s later for
        # 289 s), and allowed spanning lost 6.8 % to forbidden while no gang spread at all.
        c, m = best.cluster, best.model
        why = (
            f"more than {self.gpu_hours_bound:g}x the GPU-hours of one cluster"
            if not within
            else f"later than waiting for one cluster ({best.completion_s:.0f} s)"
            if cost == run_now
            else f"{cost:.0f} s with the {cost - run_now:.0f} s its GPUs are held beyond one cluster's run"
            f" while jobs wait, later than waiting for one cluster ({best.completion_s:.0f} s)"
        )
        when = (
            f"room expected in {best.wait_s:.0f} s"
            if math.isfinite(best.wait_s)
            else "when its running jobs end; none has a predicted end"
        )
        return Status(
            Code.UNSCHEDULABLE,
            f"spread over {where} it would end in {run_now:.0f} s, {why}; waiting for one cluster,"
            f" {snap.models[m]} in {snap.clusters[c].id} ({when})",
            wait_s=best.wait_s if math.isfinite(best.wait_s) and best.wait_s >= MIN_WAIT_S else 0.0,
        )


def spread_cost_s(run_s: float, best: PoolOption | None, *, queued: bool) -> float:
    """What a spread running ``run_s`` costs, in seconds of completion time, against the gang in
    one cluster (``best``, its wait and run there): its own run, plus, while other jobs wait
    (``queued``), the time it holds its GPUs beyond the run in that cluster (those GPUs reach a
    waiting job that much later). Both from the scheduler's beliefs (predicted steps and the
    running jobs' predicted ends), never from what a run will really take."""
    if best is None or not queued:
        return run_s
    return run_s + max(run_s - best.run_s, 0.0)


def _data_delay_s(state: CycleState, region: str, run_s: float) -> float:
    """What the job's dataset's first copy to ``region`` adds to a run of ``run_s`` (0 without a
    dataset, or where a copy is)."""
    placement = data_placement(state)
    if placement is None:
        return 0.0
    seconds, _src = placement.copy_to(state.snapshot, region)  # as DataLocality.permit plans it
    return float(data_delay_s(run_s, np.array([seconds]), placement.start)[0])


def _waited_s(state: CycleState) -> float:
    return 0.0 if state.submitted_at is None else max(state.snapshot.now - state.submitted_at, 0.0)


MIN_WAIT_S = 1.0
"""A wait shorter than this is not worth another decision: the job starts now."""


def wait_unless_lost(
    state: CycleState, step_now: float, step_better: float, why: str, *, factor: float = 1.0
) -> Status:
    """UNSCHEDULABLE (``wait_s`` = what is left) while the job has waited, since submission, less
    than ``factor x steps x (step_now - step_better)``: the ski-rental bound both guards use."""
    waited = _waited_s(state)
    left = factor * state.job.work.steps * (step_now - step_better) - waited
    if left < MIN_WAIT_S:
        return Status()
    return Status(Code.UNSCHEDULABLE, f"{why} (at most {left:.0f} s more)", wait_s=left)


_WORKERS: "weakref.WeakKeyDictionary[Snapshot, dict[int, tuple[bytes, FloatArray]]]" = (
    weakref.WeakKeyDictionary()
)
"""Per snapshot and GPUs per worker: the workers each (cluster, model) pool's schedulable nodes hold
when idle, with the schedulable flags it was counted for (totals never change within a snapshot);
under minus the GPUs per worker, what all its nodes hold."""


@dataclass(frozen=True, slots=True)
class SpreadFloor:
    """What the best spread of a gang over the allowed clusters could reach on an idle platform."""

    inflation: float
    """A lower bound of any spread's step over the gang's step in one cluster at its fastest
    part's speed (the GPU-hours ratio the span guard bounds)."""
    where: str
    """The regions the least inflated spread joins and its GPU models, in words ("within r1, on
    T4"; "r1 with r2, on A100 and T4": GPUs of different speeds inflate it too)."""


def idle_spread_floor(state: CycleState, workers: int, *, every_node: bool = False) -> SpreadFloor | None:
    """Lower bounds of what spreading ``workers`` over the allowed clusters (each cluster's one GPU
    model, as :meth:`~loom.sched.framework.Framework.spread` takes them) could reach on an idle
    platform; None when the clusters cannot hold them at all. With ``every_node`` the platform is
    every node whatever its state (unschedulable ones may come back) and avoided clusters count
    (avoiding is a preference): what no later cycle can improve on.

    A spread's step is its slowest part's compute plus the all-reduce over its slowest link, and
    the span guard weighs it against the gang in one cluster at its fastest part's speed
    (:meth:`SpanGuard._spread`), so mixing GPUs of different speeds inflates GPU-hours as a slow
    link does. Every *band* of the job's speeds among the pools that hold workers (slowest ``a``
    to fastest ``b``) whose pools together hold the gang is a candidate: a spread whose GPUs' speeds
    span exactly that band takes at least ``step / a`` to compute against at most ``step / b`` in
    one cluster (with the band's highest and lowest trust where trusts differ). The link of a band:
    the best of the links a spread over its pools must use, i.e. within one region when one
    region's clusters hold the gang, else between the best pair of regions that together hold it,
    else the best link between any two of its regions. The floor is the least inflated band.
    (Before 2026-12-06 the floor took every pool at the slowest speed on both sides, counting only
    the link: on an evaluator's platform a 16 x 2-GPU gang that only G2 GPUs and GPUs 1.8x slower
    could hold waited for a spread "within the bound" that could not exist, then spread at 1.77x.)"""
    counts = _idle_workers(state, every_node=every_node) * _allowed_pools(state, avoided=not every_node)
    return _spread_floor(state, counts, workers)


LIKE_WAIT_FACTOR = 4.0
"""A gang no cluster holds, whose spread now is beyond the span guard's bound while a spread of
like GPUs within it has room now or could once their GPUs free, waits at most this many times
what spreading now loses against one cluster (:func:`wait_unless_lost`)."""

QUEUED_LIKE_WAIT_FACTOR = 16.0
""":data:`LIKE_WAIT_FACTOR` while other jobs wait: a spread beyond the bound then holds GPUs a
waiting job could use, so the gang waits longer for a spread of like GPUs."""


def free_like_spreads(state: CycleState, *, bound: float, idle: bool = False) -> str | None:
    """Where (in words) :func:`like_spreads` finds the fastest spread of ``state``'s gang within
    ``bound`` over the workers' room now on the schedulable nodes of the allowed, not avoided
    clusters (with ``idle``, their whole room: once their jobs end); None when it finds none. Room
    is counted by GPUs, CPU and RAM, as the filters count it (a node whose CPU or RAM is not known
    by its GPUs only)."""
    snap = state.snapshot
    resources = state.job.resources
    workers = snap.room(slice(None), state.per_worker, resources.cpu_milli, resources.memory_mib, idle=idle)
    c_count, m_count = snap.total_sum.shape
    counts = np.bincount(
        snap.pool_of, weights=np.where(snap.schedulable, workers, 0), minlength=c_count * m_count
    ).astype(np.float64)
    free = counts.reshape(c_count, m_count) * _allowed_pools(state)
    c_idx, m_idx = np.nonzero(free > 0)
    capacity = free[c_idx, m_idx].astype(np.int64)
    found = like_spreads(state, c_idx, m_idx, capacity, bound=bound, first=True)
    return found[0][2] if found else None


LIKE_SPREAD_REGIONS = 8
"""Pairs of regions are tried among at most this many (those with the most workers' room in the
speed band): :func:`like_spreads` stays cheap on platforms of many regions."""


def like_spreads(
    state: CycleState,
    cluster: IntArray,
    model: IntArray,
    capacity: IntArray,
    *,
    bound: float,
    first: bool = False,
) -> list[tuple[float, BoolArray, str]]:
    """Subsets of the pools (parallel arrays: cluster, model, workers' room) that could hold
    ``state``'s gang spread over them within ``bound`` x the GPU-hours of it in one cluster, as
    (predicted step, mask, where in words), fastest first; with ``first``, at most one.

    Each subset is a *speed band* (the pools no faster than one pool's delivered speed for the
    job and at most ``bound`` x slower; one band per set of pools it takes) within one region, two
    regions (among the ``LIKE_SPREAD_REGIONS`` with the most room in the band), or every region of
    the band. Predicted from the slowest and fastest pools of the band in those regions and their
    slowest link, each region's own link included (:func:`predict_step_s`'s rule), against the
    gang in one cluster at the fastest speed; one GPU model per cluster as
    :meth:`~loom.sched.framework.Framework.spread` takes them. A spread built from a subset takes
    no slower pools and no slower link than predicted, so the span guard never judges it beyond
    the bound (it may pick fewer pools)."""
    if cluster.size == 0:
        return []
    snap, job = state.snapshot, state.job
    low, workers = state.min_workers, state.target_workers
    speed = snap.believed_speeds(job)[model] * snap.trust[cluster]
    region_of, names = _region_indices(snap)
    r_count, c_count = len(names), len(snap.clusters)
    region = region_of[cluster]
    comm = _region_comm(snap, job, names, workers)
    intra = _allreduce_one(*_comm_of(job), INTRA_CLUSTER_RTT_MS, INTRA_CLUSTER_GBPS, workers)
    step = job.work.step_time_s
    room = capacity.astype(np.float64)
    kept: list[tuple[float, float, list[int]]] = []
    seen: set[bytes] = set()
    # One anchor per 2 % of speed (the fastest pool in it): trust differs per cluster, and a band
    # per pool's own speed costs hundreds of bands on a platform of hundreds of clusters.
    bucket = np.round(np.log(np.maximum(speed, 1e-12)) / math.log(1.02))
    anchors = sorted({float(speed[bucket == q].max()) for q in np.unique(bucket).tolist()}, reverse=True)
    for anchor in anchors:
        band = (speed <= anchor) & (speed >= anchor / bound)
        key = band.tobytes()
        if key in seen:
            continue
        seen.add(key)
        per_cluster = np.zeros(c_count, dtype=np.float64)
        np.maximum.at(per_cluster, cluster[band], room[band])  # one pool per cluster: its largest
        region_room: FloatArray = np.bincount(region_of, weights=per_cluster, minlength=r_count).astype(
            np.float64
        )
        if float(region_room.sum()) < low:
            continue
        slowest = np.full(r_count, np.inf)
        fastest = np.zeros(r_count, dtype=np.float64)
        np.minimum.at(slowest, region[band], speed[band])
        np.maximum.at(fastest, region[band], speed[band])
        sets = _band_sets(region_room, slowest, fastest, comm, low=low, step=step, intra=intra, bound=bound)
        for predicted, members in sets:
            kept.append((predicted, anchor, members))
            if first:
                break
        if first and kept:
            break
    kept.sort(key=lambda k: k[0])
    found: list[tuple[float, BoolArray, str]] = []
    masks: set[bytes] = set()
    for predicted, anchor, members in kept:
        mask = (speed <= anchor) & (speed >= anchor / bound) & np.isin(region, members)
        if mask.tobytes() in masks:
            continue
        masks.add(mask.tobytes())
        words = [names[r] for r in members]
        found.append(
            (predicted, mask, f"within {words[0]}" if len(words) == 1 else "over " + ", ".join(words))
        )
    return found


def _band_sets(
    region_room: FloatArray,
    slowest: FloatArray,
    fastest: FloatArray,
    comm: FloatArray,
    *,
    low: int,
    step: float,
    intra: float,
    bound: float,
) -> list[tuple[float, list[int]]]:
    """For one speed band (:func:`like_spreads`): the region sets that hold ``low`` workers and
    whose predicted step keeps within ``bound``, as (predicted step, region indices), in the
    order tried: each region alone, two of the ``LIKE_SPREAD_REGIONS`` with the most room, all."""
    present = np.nonzero(region_room > 0)[0]
    top = present[np.argsort(-region_room[present], kind="stable")[:LIKE_SPREAD_REGIONS]]
    iu, ju = np.triu_indices(top.size, k=1)
    a, b = top[iu], top[ju]
    diag = np.diagonal(comm)
    # Each region alone, then every two of the top ones (each region's own link counts: two
    # clusters of one region may be parts), as arrays.
    room = np.concatenate([region_room[top], region_room[a] + region_room[b]])
    link = np.concatenate([diag[top], np.maximum(comm[a, b], np.maximum(diag[a], diag[b]))])
    slow = np.concatenate([slowest[top], np.minimum(slowest[a], slowest[b])])
    fast = np.concatenate([fastest[top], np.maximum(fastest[a], fastest[b])])
    predicted = step / np.maximum(slow, 1e-9) + link
    ok = (room >= low) & (predicted <= bound * (step / np.maximum(fast, 1e-9) + intra))
    members = [[int(r)] for r in top] + [[int(x), int(y)] for x, y in zip(a, b, strict=True)]
    found = [(float(predicted[i]), members[i]) for i in np.nonzero(ok)[0].tolist()]
    every = present.tolist()
    if float(region_room[present].sum()) >= low and len(every) > 2:
        whole = float(comm[np.ix_(present, present)].max())
        step_all = step / max(float(slowest[present].min()), 1e-9) + whole
        if step_all <= bound * (step / max(float(fastest[present].max()), 1e-9) + intra):
            found.append((step_all, every))
    return found


def _spread_floor(state: CycleState, counts: FloatArray, workers: int) -> SpreadFloor | None:
    """The floor (:func:`idle_spread_floor`) of spreads over pools holding ``counts`` workers."""
    snap = state.snapshot
    job = state.job
    if float(counts.max(axis=1, initial=0.0).sum()) < workers:
        return None
    raw = snap.believed_speeds(job)[: counts.shape[1]]
    held = counts > 0
    speeds = np.unique(raw[held.any(axis=0)])
    trust = snap.trust
    region_of, regions = _region_indices(snap)
    link_comm = _region_comm(snap, job, regions, workers)
    intra = _allreduce_one(*_comm_of(job), INTRA_CLUSTER_RTT_MS, INTRA_CLUSTER_GBPS, workers)
    step = job.work.step_time_s
    least: tuple[float, str] | None = None
    for i, a in enumerate(speeds.tolist()):
        for b in speeds[i:].tolist():
            models = (raw >= a) & (raw <= b)
            band = np.where(models[None, :], counts, 0.0)
            per_cluster = band.max(axis=1)
            if float(per_cluster.sum()) < workers:
                continue
            in_band = held & models[None, :]
            trusts = trust[np.nonzero(in_band.any(axis=1))[0]]
            t_hi, t_lo = max(float(trusts.max()), 1e-9), max(float(trusts.min()), 1e-9)
            region_workers: FloatArray = np.bincount(
                region_of, weights=per_cluster, minlength=len(regions)
            ).astype(np.float64)
            comm, where = _best_band_link(link_comm, region_workers, regions, workers)
            if not math.isfinite(comm):
                continue
            slow = step / max(a * t_hi, 1e-9)
            inflation = (slow + comm) / max(step / max(b * t_lo, 1e-9) + intra, 1e-12)
            if least is None or inflation < least[0]:
                names = sorted({snap.models[int(m)] for m in np.nonzero(in_band.any(axis=0))[0]})
                least = (inflation, f"{where}, on {' and '.join(names)}")
    if least is None:
        return None
    return SpreadFloor(inflation=least[0], where=least[1])


_REGIONS: "weakref.WeakKeyDictionary[Snapshot, tuple[IntArray, list[str]]]" = weakref.WeakKeyDictionary()
"""Per snapshot: each cluster's region index and the regions' ids, sorted."""


def _region_indices(snap: Snapshot) -> tuple[IntArray, list[str]]:
    cached = _REGIONS.get(snap)
    if cached is None:
        names = sorted({c.region for c in snap.clusters})
        index = {r: i for i, r in enumerate(names)}
        of = np.array([index[c.region] for c in snap.clusters], dtype=np.int64)
        cached = _REGIONS[snap] = (of, names)
    return cached


def _region_comm(snap: Snapshot, job: JobSpec, regions: Sequence[str], workers: int) -> FloatArray:
    """The all-reduce time of one step of ``job`` between every two of ``regions`` (the diagonal:
    within one region, between its clusters), as :func:`slowest_link` reads the links (the slower
    direction; unknown regions as :meth:`NetMatrix.link` takes them). Read afresh each call: the
    service and the simulator change a snapshot's links in place."""
    n = len(regions)
    net = snap.net
    idx = np.array([net.index.get(r, -1) for r in regions], dtype=np.int64)
    known = idx >= 0
    safe = np.where(known, idx, 0)
    if len(net.regions):
        rtt = net.rtt_ms[np.ix_(safe, safe)]
        bw = net.bandwidth_gbps[np.ix_(safe, safe)]
    else:
        rtt = np.zeros((n, n))
        bw = np.ones((n, n))
    both = known[:, None] & known[None, :]
    same = np.eye(n, dtype=np.bool_)
    rtt = np.where(both, rtt, np.where(same, INTRA_REGION_RTT_MS, UNKNOWN_LINK_RTT_MS))
    bw = np.where(both, bw, np.where(same, INTRA_REGION_GBPS, UNKNOWN_LINK_GBPS))
    return allreduce_s(*_comm_of(job), np.maximum(rtt, rtt.T), np.minimum(bw, bw.T), workers)


def _best_band_link(
    comm: FloatArray, region_workers: FloatArray, regions: Sequence[str], workers: int
) -> tuple[float, str]:
    """A lower bound of the all-reduce time any spread over regions holding ``region_workers``
    must pay, and the regions it joins in words (see :func:`idle_spread_floor`): the least of a
    region's own link, where one region holds the gang, and the least link ``T`` at which the
    regions joined by links no faster than ``T`` hold it together (a spread's regions, every two
    joined by a link no slower than its slowest, lie in one such group). Before 2026-12-06 the best
    link between any two regions, when no two held the gang, let a 4-region spread pass as a
    2-region one; and a region that held the gang alone hid a measured link between two others
    faster than a region's default own link."""
    present = np.nonzero(region_workers > 0)[0]
    if present.size == 0:
        return math.inf, ""
    best: tuple[float, str] = (math.inf, "")
    alone = present[region_workers[present] >= workers]
    if alone.size:
        own = comm[alone, alone]
        r = int(alone[int(np.argmin(own))])
        best = (float(comm[r, r]), f"within {regions[r]}")
    parent = {int(r): int(r) for r in present}
    held = {int(r): float(region_workers[r]) for r in present}

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    iu, ju = np.triu_indices(present.size, k=1)
    values = comm[present[iu], present[ju]]
    for k in np.argsort(values, kind="stable").tolist():
        link = float(values[k])
        if link >= best[0]:
            break
        ra, rb = root(int(present[iu[k]])), root(int(present[ju[k]]))
        if ra == rb:
            continue
        parent[rb] = ra
        held[ra] += held.pop(rb)
        if held[ra] >= workers:
            members = sorted(regions[int(r)] for r in present if root(int(r)) == ra)
            return link, " with ".join(members) if len(members) == 2 else "over " + ", ".join(members)
    return best


def _idle_workers(state: CycleState, *, every_node: bool = False) -> FloatArray:
    """Per (cluster, model) pool: the workers of ``state``'s GPUs its schedulable nodes (with
    ``every_node``, all its nodes) hold idle."""
    snap = state.snapshot
    g = state.per_worker
    c_count, m_count = snap.total_sum.shape
    per_g = _WORKERS.setdefault(snap, {})
    usable = np.ones_like(snap.schedulable) if every_node else snap.schedulable
    flags = usable.tobytes()
    key = -g if every_node else g
    cached = per_g.get(key)
    if cached is None or cached[0] != flags:
        counts = np.bincount(
            snap.pool_of, weights=np.where(usable, snap.total // g, 0), minlength=c_count * m_count
        )
        cached = per_g[key] = (flags, counts.astype(np.float64).reshape(c_count, m_count))
    return cached[1]


def _allowed_pools(state: CycleState, *, avoided: bool = True) -> BoolArray:
    """(cluster, model) pools allowed by policy and the job's models, not avoided (unless
    ``avoided`` is False: then clusters an earlier attempt failed in count too)."""
    snap = state.snapshot
    m_count = snap.total_sum.shape[1]
    allowed = (state.policy_mask if state.policy_mask is not None else state.cluster_mask).copy()
    if not avoided and state.held_off is not None:
        # Kept apart from a labelled job only while it runs there (as why_nothing_fits counts).
        allowed |= state.held_off
    for cid in state.avoid_clusters if avoided else ():
        index = snap.cluster_index.get(cid)
        if index is not None:
            allowed[index] = False
    models = state.model_mask[:m_count]
    result: BoolArray = allowed[:, None] & models[None, :]
    return result


def _waiting_for(state: CycleState, decision: Decision, best: PoolOption, want: int, run_now: float) -> str:
    """What a job held back by the span guard waits for, in words (its status's reason)."""
    if want > decision.workers:
        return f"room for all {want} workers"
    snap = state.snapshot
    best_region = snap.regions[int(snap.cluster_region[best.cluster])]
    if _has_users(state) and _users_s(state, best_region) < _users_s(state, decision.lead.region):
        return "GPUs nearer its users"
    return "faster GPUs" if best.run_s < run_now else "GPUs nearer its data"


def grown_run_s(
    state: CycleState, decision: Decision, want: int, run_s: float, book: WaitBook | None
) -> float:
    """The run of an elastic job started with ``decision.workers`` (``run_s`` at that pace,
    :func:`~loom.sched.elastic.pace_scale`) that grows to ``want`` workers once its own pool has
    room for them (:func:`~loom.sched.availability.expected_wait_s`, behind the GPUs claimed ahead
    in ``book``): the work done narrow until then, the rest at full pace. ``run_s`` when the pool
    could never hold ``want`` or no room is expected."""
    snap = state.snapshot
    lead = decision.lead
    c, m = snap.cluster_index.get(lead.cluster), snap.model_index.get(lead.gpu_model)
    if c is None or m is None or not bool(whole_gang_pools(state, want)[c, m]):
        return run_s
    ahead = claimed_ahead(state, book).get((lead.cluster, lead.gpu_model), 0)
    wait = expected_wait_s(snap, c, m, want, state.per_worker, ahead_gpus=ahead)
    if not math.isfinite(wait):
        return run_s
    # Time per unit of work: narrow 1, full width f (< 1). After ``wait`` the work left,
    # (run_s - wait) narrow, takes f x that.
    f = pace_scale(state.job, want) / pace_scale(state.job, decision.workers)
    # The min binds only by rounding (f <= 1): a job that grows nothing (f 1) keeps its run exactly,
    # so that a comparison with another option's run is not decided by the last bit.
    return min(run_s, wait + (run_s - wait) * f) if wait < run_s else run_s


def whole_gang_pools(state: CycleState, workers: int) -> BoolArray:
    """(cluster, model) pools, allowed by policy and not avoided, that hold ``workers`` when idle."""
    result: BoolArray = _allowed_pools(state) & (_idle_workers(state) >= workers)
    return result


def _holds_now(state: CycleState, c: int, m: int, workers: int) -> bool:
    """Whether pool (c, m)'s schedulable nodes have the free GPUs for ``workers`` now."""
    snap = state.snapshot
    nodes = snap.pool(c, m)
    free = np.where(snap.schedulable[nodes], snap.free[nodes], 0) // state.per_worker
    return int(free.sum()) >= workers

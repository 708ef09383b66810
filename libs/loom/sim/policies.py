"""Placement policies for the simulator: Loom's default profile and the baselines it is measured against.

Every policy is a :class:`~loom.sched.framework.Framework` with a plugin profile, so all of them
share the scheduling core: what fits (``resource_fit``, gangs, quotas, the job's hard affinity
rules), elastic shrink and priority preemption. The baselines queue by ``priority_fair_share``
(fair share, then arrival); Loom's profile by ``fair_share_srsf`` (quota band, then shortest
predicted service first with aging), a decision of Loom's own. Otherwise they differ only in how
they *choose* among the candidates that fit, which is what the comparison is about:

========================  ====================================================================
``loom``                  the default profile (:func:`loom.sched.profile.build_framework`):
                          joint compute + network, JCT, data locality, SCU fit, cost, balance
``random``                seeded random scores
``round_robin``           the next cluster (by id) after the one chosen last, cyclically
``first_fit``             the lowest cluster id (then GPU model) that fits
``greedy_compute``        the most free compute (free GPUs x SCU of the pool), like
                          kube-scheduler's LeastAllocated: network- and data-blind
``home_region``           only clusters in the job's home region (``SimJob.home_region``, added
                          to the job as a required region), chosen there by most free compute
``gavel_like``            heterogeneity-aware but network-blind (Gavel): the pool where the
                          job's own throughput (per-job speed x trust) is highest; only
                          candidates within 2 % of it tie, broken by best fit
``oracle``                the ``loom`` profile with the truth as its learned speeds (set by
                          :meth:`OraclePolicy.prepare`): the upper bound of what learning can reach
========================  ====================================================================

A baseline sees the job's hard affinity rules (``affinity.clusters``/``regions``/``avoid_*``/
``apart_from_jobs``) through :class:`HardAffinity`, the pre-filter half of the affinity plugin, but
not its soft preferences. Baselines run no ``jct`` bind and no ``data_locality`` permit: the
simulator times every placement itself with the same step-time and data-copy model
(:mod:`loom.sim.engine`), so a policy cannot win by leaving costs out of its books.

``POLICIES`` maps each name to a factory taking a seed (only ``random`` draws numbers; its
generator is its own, so policies never share random state).
"""

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec
import numpy as np

from loom.model.family import job_family
from loom.model.learn import LearnSettings, SpeedLearner
from loom.model.profiles import library_models
from loom.sched.framework import (
    SUCCESS,
    BindPlugin,
    Candidates,
    CycleState,
    Decision,
    Framework,
    Outcome,
    PreFilterPlugin,
    QueueItem,
    ScorePlugin,
    StateKey,
    Status,
    min_max,
)
from loom.sched.plugins.affinity import Affinity
from loom.sched.plugins.compute import PriorityFairShare, delivered_speed
from loom.sched.plugins.elastic import ElasticShrink
from loom.sched.plugins.network import AlphaLearner
from loom.sched.plugins.quota import Preempt, Quota
from loom.sched.plugins.resources import ResourceFit
from loom.sched.probe import ProbeSettings
from loom.sched.profile import build_framework
from loom.sched.snapshot import FloatArray, Snapshot, job_precision
from loom.sim.model import Policy, SimJob
from loom_proto.jobs import JobSpec

if TYPE_CHECKING:
    from loom.sim.truth import Truth

__all__ = [
    "POLICIES",
    "BestScu",
    "FirstFit",
    "FrameworkPolicy",
    "GavelThroughput",
    "GreedyCompute",
    "HardAffinity",
    "OraclePolicy",
    "RandomScore",
    "RoundRobin",
    "baseline_framework",
    "make_policy",
    "oracle_factors",
]


class FrameworkPolicy:
    """A policy that is a scheduling framework: ``decide`` is :meth:`Framework.schedule_many`.

    ``admit`` turns a trace job into the spec the policy schedules (the home-region baseline adds
    its region rule there); ``learner`` is the joint score's alpha learner, taught by the simulator
    from completed runs as the placement service teaches it; ``speed_learner`` learns each job
    family's speed per GPU model from completed runs (:mod:`loom.model.learn`), as placement does:
    the simulator teaches it and every later decision of this policy reads its factors. Only
    ``loom`` and ``gavel_like`` (Gavel estimates per-job throughputs online too) learn; the other
    baselines schedule on the profiles alone, and ``oracle`` knows the truth from the start.
    ``loom`` alone runs speed probes (``probe``), as placement does; ``gavel_like`` takes Gavel's
    throughput estimates without the profiling runs that feed them.
    """

    def __init__(
        self,
        name: str,
        framework: Framework,
        *,
        admit: Callable[[SimJob], JobSpec] | None = None,
        learner: AlphaLearner | None = None,
        speed_learner: SpeedLearner | None = None,
        probe: ProbeSettings | None = None,
    ) -> None:
        self.name = name
        self.framework = framework
        self.learner = learner
        self.speed_learner = speed_learner
        self.probe = probe
        """Speed probes (:mod:`loom.sched.probe`) before deciding a job whose family never ran on a
        GPU model it may use (with a ``speed_learner`` and truth timing); None: none."""
        self._admit = admit

    def decide(self, queue: Sequence[QueueItem], snap: Snapshot) -> list[tuple[QueueItem, Outcome]]:
        """One cycle over ``queue`` in the framework's queue order (each decision applied at once)."""
        return self.framework.schedule_many(queue, snap)

    def decide_one(self, item: QueueItem, snap: Snapshot) -> Outcome:
        """One job's cycle: what :meth:`decide` does for a one-job queue whose job holds no GPUs,
        without the per-call set of running job ids (the simulator never offers a running job)."""
        return self.framework.schedule(
            item.job, snap, submitted_at=item.submitted_at, queue_key=self.framework.queue_key(item)
        )

    def sort_key(self, item: QueueItem) -> tuple[Any, ...]:
        """The queue order of the framework (lower first)."""
        return self.framework.queue_key(item)

    def admit(self, job: SimJob) -> JobSpec:
        """The spec this policy schedules for a trace job (unchanged unless the policy adds rules)."""
        return self._admit(job) if self._admit is not None else job.spec

    def prepare(self, snap: Snapshot, jobs: Sequence[JobSpec], truth: "Truth | None", seed: int) -> None:
        """Called once by the simulator before the first event, with the run's snapshot, every job as
        this policy schedules it (admitted, DAG jobs as their stages) and the truth (None when jobs
        are timed by belief). Only :class:`OraclePolicy` uses it."""


class OraclePolicy(FrameworkPolicy):
    """Loom's default profile with the truth as what it learned: the bound of what learning can reach.

    Before the run, :meth:`prepare` sets the snapshot's learned factors
    (:meth:`Snapshot.set_learned`) to :func:`oracle_factors`: for every (job family, GPU model) of
    the trace and the platform, the true speed over the profile's. Every decision then reads the
    true speeds through :meth:`Snapshot.job_speeds`, as a perfect learner would make it. It is a
    bound, not a baseline: the scheduler is never told the truth in the service. Timed by belief
    (no truth), it is Loom.
    """

    def prepare(self, snap: Snapshot, jobs: Sequence[JobSpec], truth: "Truth | None", seed: int) -> None:
        if truth is not None:
            factors = oracle_factors(truth, jobs, snap, seed=seed)
            snap.set_learned(factors, factors)  # the truth: every cell as if measured


def oracle_factors(
    truth: "Truth", jobs: Sequence[JobSpec], snap: Snapshot, *, seed: int = 0
) -> dict[tuple[str, str], float]:
    """(family, GPU model) -> true speed / profile speed, over ``jobs`` and the snapshot's models.

    A job's true speed on a model is :meth:`Truth.job_speed` at the GPUs it would hold on one node
    of that model (its workers x GPUs per worker, at most the model's largest node: the simulator
    times a run by the node holding most of its GPUs, run-to-run noise aside); the profile's is the
    snapshot's SCU for its task type and precision. A family whose jobs differ (a family the truth
    does not know is mapped per job id) gets the geometric mean of its jobs' ratios: learning keyed
    by family can reach no more.
    """
    logs: dict[tuple[str, str], list[float]] = {}
    largest = dict.fromkeys(snap.models, 0)
    for model_index, total in zip(snap.model_of.tolist(), snap.total.tolist(), strict=True):
        model = snap.models[model_index]
        largest[model] = max(largest[model], int(total))
    for spec in jobs:
        if spec.stages:
            continue
        family = job_family(spec)
        precision = job_precision(spec)
        held = max(spec.resources.gpus, 1) * max(spec.workers, 1)
        for model in snap.models:
            believed = snap.gpu_speed(model, spec.task_type, precision)
            true = truth.job_speed(
                spec,
                model,
                gpus_per_node=max(min(held, largest[model]), spec.resources.gpus, 1),
                job_id=spec.job_id,
                name=spec.name,
                seed=seed,
            ).speed
            if believed > 0 and true > 0:
                logs.setdefault((family, model), []).append(math.log(true / believed))
    return {key: math.exp(math.fsum(values) / len(values)) for key, values in logs.items()}


# ---- baseline score plugins -------------------------------------------------------------------


class HardAffinity:
    """The affinity plugin's hard rules only (a pre-filter); its soft preferences are not scored."""

    name = "affinity"

    def __init__(self) -> None:
        self._inner = Affinity()

    def pre_filter(self, state: CycleState) -> Status:
        return self._inner.pre_filter(state)


class RandomScore:
    """Seeded random scores, 0-100: a placement that knows nothing."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        scores: FloatArray = self._rng.random(len(candidates)) * 100.0
        return scores

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return np.clip(raw, 0.0, 100.0)


class RoundRobin:
    """Rotate through clusters: the first candidate at or after the cluster after the last one chosen."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        count = max(len(state.snapshot.clusters), 1)
        distance = (candidates.cluster - self._next) % count
        scores: FloatArray = 100.0 - distance.astype(np.float64) * (100.0 / count)
        return scores

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return np.clip(raw, 0.0, 100.0)

    def bind(self, state: CycleState, decision: Decision) -> Status:
        snap = state.snapshot
        lead = snap.cluster_index.get(decision.lead.cluster, -1)
        self._next = (lead + 1) % max(len(snap.clusters), 1)
        return SUCCESS


class FirstFit:
    """The lowest cluster id, then GPU model, that fits (clusters are indexed in id order)."""

    name = "first_fit"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        models = max(len(state.snapshot.models), 1)
        order: FloatArray = -(candidates.cluster * models + candidates.model).astype(np.float64)
        return order

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return min_max(raw)


class GreedyCompute:
    """Most free compute: the candidate pool's free GPUs x one GPU's SCU for the task type (x trust).

    Like kube-scheduler's LeastAllocated, it spreads work onto the emptiest capacity and knows
    nothing of the network or of where the data is.
    """

    name = "greedy_compute"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        free = state.snapshot.free_sum[candidates.cluster, candidates.model].astype(np.float64)
        compute: FloatArray = free * delivered_speed(state, candidates)
        return compute

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return min_max(raw)


class BestScu:
    """Heterogeneity-aware (Gavel-like): the fastest GPU for the job's task type, SCU x trust."""

    name = "best_scu"

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        return delivered_speed(state, candidates)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        top = float(raw.max(initial=0.0))
        return raw / top * 100.0 if top > 0 else np.full(raw.shape, 100.0)


_GAVEL_CANDIDATES: Final = StateKey[Candidates | None]("gavel.candidates")

GAVEL_TIE_TOLERANCE: Final = 0.02
"""Throughputs within this fraction of the best candidate's are a tie for :class:`GavelThroughput`."""


class GavelThroughput:
    """Heterogeneity-aware like Gavel (Narayanan et al., OSDI 2020): the candidate where the job's
    *own* throughput is highest, ties broken by best fit.

    A job's throughput on a pool is its per-GPU speed there (:meth:`Snapshot.job_speeds`: the task
    type's SCU times what was learned for the job's family on that model) times the cluster's
    trust. Gavel allocates by these per-job throughput ratios; placing one job at a time, that is
    the pool that runs it fastest. Only candidates within :data:`GAVEL_TIE_TOLERANCE` of the best
    throughput are a tie; among them the one left with the least free compute after the job's GPUs
    are taken wins (best fit, keeping large pools whole). Network- and data-blind.
    """

    name = "gavel"

    def __init__(self, tolerance: float = GAVEL_TIE_TOLERANCE) -> None:
        self.tolerance = tolerance

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        # normalize sees only the raw scores: the tie-break reads the candidates from the state.
        state.write(_GAVEL_CANDIDATES, candidates)
        return delivered_speed(state, candidates)

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        top = float(raw.max(initial=0.0))
        if top <= 0:
            return np.full(raw.shape, 100.0)
        # Throughput decides (up to 90); a tie within the tolerance is broken by best fit (up to
        # 10 more). A candidate outside the tolerance is at least tolerance x 90 below the best.
        scores: FloatArray = raw / top * 90.0
        tied = raw >= top * (1.0 - self.tolerance)
        if tied.sum() > 1:
            left = self._left_over(state)
            if left is not None and left.shape == raw.shape:
                lo, hi = float(left[tied].min()), float(left[tied].max())
                fit = (
                    np.where(tied, 1.0 - (left - lo) / (hi - lo), 0.0) if hi > lo else tied.astype(np.float64)
                )
                scores = scores + 10.0 * fit
        else:
            scores = scores + 10.0 * tied
        return np.clip(scores, 0.0, 100.0)

    @staticmethod
    def _left_over(state: CycleState) -> FloatArray | None:
        """Per candidate of this cycle: free compute the pool keeps once the job's GPUs are taken."""
        candidates = state.get(_GAVEL_CANDIDATES, None)
        if candidates is None:
            return None
        snap = state.snapshot
        free = snap.free_sum[candidates.cluster, candidates.model].astype(np.float64)
        taken = candidates.workers.astype(np.float64) * state.per_worker
        left: FloatArray = (free - taken) * delivered_speed(state, candidates)
        return left


# ---- profiles ---------------------------------------------------------------------------------


def baseline_framework(scorers: Sequence[object], weights: dict[str, float] | None = None) -> Framework:
    """The shared core of every baseline (queue order, fit, quota, hard affinity, elastic shrink,
    preemption) with ``scorers`` choosing among the candidates."""
    plugins: list[object] = [
        PriorityFairShare(),
        ResourceFit(library_models()),
        Quota(),
        HardAffinity(),
        *scorers,
        ElasticShrink(),
        Preempt(),
    ]
    return Framework(plugins, weights)


def _in_home_region(job: SimJob) -> JobSpec:
    """The job restricted to its home region (unchanged without one, or when the job itself
    requires regions that do not include it: its own rule stands)."""
    home, required = job.home_region, job.spec.affinity.regions
    if home is None or (required and home not in required):
        return job.spec
    affinity = msgspec.structs.replace(job.spec.affinity, regions=[home])
    return msgspec.structs.replace(job.spec, affinity=affinity)


def _loom(_seed: int) -> FrameworkPolicy:
    learner = AlphaLearner()
    return FrameworkPolicy(
        "loom",
        build_framework(context={"alpha_learner": learner}),
        learner=learner,
        speed_learner=SpeedLearner(),
        probe=ProbeSettings(),
    )


def _random(seed: int) -> FrameworkPolicy:
    return FrameworkPolicy("random", baseline_framework([RandomScore(seed)]))


def _round_robin(_seed: int) -> FrameworkPolicy:
    return FrameworkPolicy("round_robin", baseline_framework([RoundRobin()]))


def _first_fit(_seed: int) -> FrameworkPolicy:
    return FrameworkPolicy("first_fit", baseline_framework([FirstFit()]))


def _greedy_compute(_seed: int) -> FrameworkPolicy:
    return FrameworkPolicy("greedy_compute", baseline_framework([GreedyCompute()]))


def _home_region(_seed: int) -> FrameworkPolicy:
    return FrameworkPolicy("home_region", baseline_framework([GreedyCompute()]), admit=_in_home_region)


def _oracle(_seed: int) -> FrameworkPolicy:
    learner = AlphaLearner()
    return OraclePolicy("oracle", build_framework(context={"alpha_learner": learner}), learner=learner)


def _gavel_like(_seed: int) -> FrameworkPolicy:
    return FrameworkPolicy(
        "gavel_like",
        baseline_framework([GavelThroughput()]),
        # Gavel schedules on its completed matrix's estimates as they are: no handicap for a big
        # job on a GPU its family never ran on (Loom's LearnSettings.risk_gpu_hours).
        speed_learner=SpeedLearner(LearnSettings(risk_gpu_hours=0.0)),
    )


POLICIES: dict[str, Callable[[int], Policy]] = {
    "loom": _loom,
    "random": _random,
    "round_robin": _round_robin,
    "first_fit": _first_fit,
    "greedy_compute": _greedy_compute,
    "home_region": _home_region,
    "gavel_like": _gavel_like,
    "oracle": _oracle,
}
"""Policy name -> factory taking a seed. ``oracle`` is a bound (Loom knowing the truth), not a baseline."""


def make_policy(name: str, seed: int = 0) -> Policy:
    """The policy called ``name`` (a key of :data:`POLICIES`), seeded; ValueError for an unknown name."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(seed)


# Conformance: each baseline plugin satisfies the extension points it serves (checked by mypy).
_CONFORMS: tuple[
    PreFilterPlugin, ScorePlugin, ScorePlugin, BindPlugin, ScorePlugin, ScorePlugin, ScorePlugin, ScorePlugin
] = (
    HardAffinity(),
    RandomScore(0),
    RoundRobin(),
    RoundRobin(),
    FirstFit(),
    GreedyCompute(),
    BestScu(),
    GavelThroughput(),
)

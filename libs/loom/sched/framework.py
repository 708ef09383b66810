"""The scheduling framework: extension points, plugins, one scheduling cycle per job.

Modelled on the Kubernetes scheduling framework. A cycle for one job runs

    pre-filter -> (hierarchical prune: region -> zone -> cluster, from aggregates)
    -> filter (per node, vectorised) -> [post-filter: preemption, when nothing fits]
    -> score + normalise (each plugin 0-100, weighted) -> pack nodes -> reserve -> permit -> bind

over a :class:`~loom.sched.snapshot.Snapshot`. Plugins return a :class:`Status` rather than raise;
its :class:`Code` tells the queue what to do with the job. A candidate is one (cluster, GPU model)
pair: network, price, data and trust are properties of a cluster, so scoring happens per
candidate, while filtering happens per node.

Every cycle also produces a :class:`DecisionRecord`: each candidate's per-plugin scores and each
pruned cluster's reason, from which :func:`loom.sched.explain.render` answers "why here, why not
there".
"""

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from loom.sched.snapshot import BoolArray, FloatArray, IntArray, Snapshot
from loom_proto.jobs import JobSpec, SyncPlan

T = TypeVar("T")


class Code(enum.IntEnum):
    """What a plugin's verdict means for the job."""

    SUCCESS = 0
    """The step passed; the cycle goes on."""
    UNSCHEDULABLE = 1
    """Not now: the job stays queued, is retried with backoff, and is woken early by capacity changes."""
    UNRESOLVABLE = 2
    """Never on this platform as it is configured: the job is rejected at once with the reason;
    preemption cannot help."""
    ERROR = 3
    """A plugin failed (a bug or bad state): the job stays queued and the error is counted and logged."""
    SKIP = 4
    """The plugin has nothing to say about this job; its later extension points are skipped for it."""
    WAIT = 5
    """Permit only: the decision stands and capacity stays reserved, but the start waits
    (``wait_s``), e.g. for a dataset's first copy."""


@dataclass(frozen=True, slots=True)
class Status:
    """A plugin's verdict: a code, the reason in plain words, and which plugin said it."""

    code: Code = Code.SUCCESS
    reason: str = ""
    plugin: str = ""
    wait_s: float = 0.0

    @property
    def ok(self) -> bool:
        """SUCCESS (or SKIP, which lets the cycle go on)."""
        return self.code in (Code.SUCCESS, Code.SKIP)


SUCCESS = Status()


class StateKey(Generic[T]):
    """A typed key for :class:`CycleState`: a plugin writes its per-job state once, reads it after."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


@dataclass
class Candidates:
    """The (cluster, model) pairs that passed filtering, as parallel arrays of length K."""

    cluster: IntArray
    model: IntArray
    capacity: IntArray
    """Workers that fit now."""
    workers: IntArray
    """Workers the job would get there (elastic jobs: up to their maximum)."""
    nodes: list[IntArray]
    """Absolute node indices that passed the filters, per candidate."""
    node_workers: list[IntArray]
    """Workers each of those nodes can take."""

    def __len__(self) -> int:
        return int(self.cluster.size)

    def take(self, keep: IntArray) -> "Candidates":
        """The candidates at positions ``keep``."""
        return Candidates(
            cluster=self.cluster[keep],
            model=self.model[keep],
            capacity=self.capacity[keep],
            workers=self.workers[keep],
            nodes=[self.nodes[int(i)] for i in keep],
            node_workers=[self.node_workers[int(i)] for i in keep],
        )


@dataclass
class CycleState:
    """Everything about one job's cycle; expensive per-job state is computed once and read after."""

    job: JobSpec
    snapshot: Snapshot
    cluster_mask: BoolArray
    """Clusters still allowed (pre-filter plugins narrow it)."""
    model_mask: BoolArray
    """GPU models still allowed."""
    pruned: dict[str, str] = field(default_factory=dict)
    """Cluster id -> why it was ruled out (for the decision record)."""
    skipped: set[str] = field(default_factory=set)
    """Plugins that answered SKIP for this job."""
    avoid_clusters: frozenset[str] = frozenset()
    """Clusters that failed to start an earlier attempt of the job."""
    policy_mask: BoolArray | None = None
    """Clusters allowed by policy (pre-filters), before free capacity pruned any: where preemption looks."""
    _data: dict[StateKey[Any], Any] = field(default_factory=dict)

    @property
    def per_worker(self) -> int:
        """GPUs per worker."""
        return self.job.resources.gpus

    @property
    def min_workers(self) -> int:
        """The fewest workers the job can start with (its gang size unless elastic)."""
        return min(self.job.min_workers or self.job.workers, self.job.workers)

    def write(self, key: StateKey[T], value: T) -> None:
        """Store a plugin's per-job state."""
        self._data[key] = value

    def read(self, key: StateKey[T]) -> T:
        """Read a plugin's per-job state; KeyError when it was never written."""
        value: T = self._data[key]
        return value

    def get(self, key: StateKey[T], default: T) -> T:
        """Read a plugin's per-job state, or ``default``."""
        value: T = self._data.get(key, default)
        return value

    def prune(self, clusters: BoolArray, reason: Callable[[int], str]) -> None:
        """Rule out the clusters set in ``clusters`` (still allowed until now), recording why."""
        newly = np.flatnonzero(clusters & self.cluster_mask)
        for c in newly:
            self.pruned.setdefault(self.snapshot.clusters[int(c)].id, reason(int(c)))
        self.cluster_mask &= ~clusters


# ---- extension points ------------------------------------------------------------------------


@runtime_checkable
class QueueSortPlugin(Protocol):
    """Orders the queue: the key of each waiting job (lower first)."""

    name: str

    def sort_key(self, item: "QueueItem") -> tuple[Any, ...]: ...


@runtime_checkable
class PreFilterPlugin(Protocol):
    """Checks the job as a whole and narrows the allowed clusters and models before any node is seen."""

    name: str

    def pre_filter(self, state: CycleState) -> Status: ...


@runtime_checkable
class FilterPlugin(Protocol):
    """Per node, vectorised: which of ``nodes`` (absolute indices, one cluster and model) hold a worker."""

    name: str

    def filter(self, state: CycleState, cluster: int, model: int, nodes: IntArray) -> BoolArray: ...

    def describe(self, state: CycleState) -> str: ...


@runtime_checkable
class PostFilterPlugin(Protocol):
    """Runs when no candidate passed filtering (preemption); may return a decision that frees room."""

    name: str

    def post_filter(self, state: CycleState, framework: "Framework") -> "Decision | None": ...


@runtime_checkable
class ScorePlugin(Protocol):
    """Scores every candidate (raw, any scale) and maps the raw scores to 0-100 (higher is better)."""

    name: str

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray: ...

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray: ...


@runtime_checkable
class ReservePlugin(Protocol):
    """Takes what the decision needs from the plugin's books; ``unreserve`` gives it back (idempotent)."""

    name: str

    def reserve(self, state: CycleState, decision: "Decision") -> Status: ...

    def unreserve(self, state: CycleState, decision: "Decision") -> None: ...


@runtime_checkable
class PermitPlugin(Protocol):
    """Approves, delays (WAIT with ``wait_s``) or denies a reserved decision."""

    name: str

    def permit(self, state: CycleState, decision: "Decision") -> Status: ...


@runtime_checkable
class BindPlugin(Protocol):
    """Fills in what the start commands need (predicted step time, slowdown); pure: sends nothing."""

    name: str

    def bind(self, state: CycleState, decision: "Decision") -> Status: ...


EXTENSION_POINTS: tuple[tuple[str, type], ...] = (
    ("queue_sort", QueueSortPlugin),
    ("pre_filter", PreFilterPlugin),
    ("filter", FilterPlugin),
    ("post_filter", PostFilterPlugin),
    ("score", ScorePlugin),
    ("reserve", ReservePlugin),
    ("permit", PermitPlugin),
    ("bind", BindPlugin),
)


def min_max(raw: FloatArray, *, higher_is_better: bool = True) -> FloatArray:
    """The default normalisation: linear onto 0-100; all equal -> all 100 (nothing to tell apart)."""
    if raw.size == 0:
        return raw.astype(np.float64)
    lo, hi = float(np.min(raw)), float(np.max(raw))
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo < 1e-12:
        return np.full(raw.shape, 100.0)
    scaled = (raw - lo) / (hi - lo) * 100.0
    return scaled if higher_is_better else 100.0 - scaled


# ---- results ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Part:
    """One cluster's share of a decision."""

    cluster: str
    region: str
    gpu_model: str
    allocations: tuple[tuple[str, int], ...]
    layers: tuple[int, int] | None = None


@dataclass
class Decision:
    """Where a job goes: its parts (the first is the lead), workers, and what its start needs."""

    job_id: str
    parts: list[Part]
    workers: int
    score: float = 0.0
    predicted_step_s: float | None = None
    slowdown: float = 1.0
    start_after_s: float = 0.0
    sync: SyncPlan | None = None
    victims: tuple[str, ...] = ()
    """Jobs preempted to make room (their GPUs are already given back in the snapshot)."""

    @property
    def lead(self) -> Part:
        """The part that runs the job's clock."""
        return self.parts[0]

    @property
    def allocations(self) -> list[tuple[str, int]]:
        """Every (node, gpus) of every part."""
        return [a for p in self.parts for a in p.allocations]


@dataclass
class CandidateRecord:
    """One candidate in the audit: where, how many workers fit, and every plugin's score."""

    cluster: str
    region: str
    gpu_model: str
    capacity: int
    scores: dict[str, float]
    """Plugin -> normalised score 0-100."""
    raw: dict[str, float]
    total: float


@dataclass
class DecisionRecord:
    """What a cycle saw and why it chose: the basis of ``loom explain``."""

    job_id: str
    at: float
    outcome: str
    """"placed", "waiting" or "rejected"."""
    reason: str
    weights: dict[str, float]
    candidates: list[CandidateRecord]
    pruned: dict[str, str]
    chosen: list[str]
    """Cluster ids of the decision's parts, lead first."""
    victims: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form for storage."""
        return {
            "job_id": self.job_id,
            "at": self.at,
            "outcome": self.outcome,
            "reason": self.reason,
            "weights": self.weights,
            "candidates": [
                {
                    "cluster": c.cluster,
                    "region": c.region,
                    "gpu_model": c.gpu_model,
                    "capacity": c.capacity,
                    "scores": c.scores,
                    "raw": c.raw,
                    "total": c.total,
                }
                for c in self.candidates
            ],
            "pruned": self.pruned,
            "chosen": self.chosen,
            "victims": self.victims,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DecisionRecord":
        """Inverse of :meth:`to_dict`."""
        return cls(
            job_id=data["job_id"],
            at=float(data["at"]),
            outcome=data["outcome"],
            reason=data["reason"],
            weights=dict(data["weights"]),
            candidates=[CandidateRecord(**c) for c in data["candidates"]],
            pruned=dict(data["pruned"]),
            chosen=list(data["chosen"]),
            victims=list(data.get("victims", [])),
            notes=list(data.get("notes", [])),
        )


@dataclass
class Outcome:
    """A cycle's result: a decision, or a status saying whether to wait or reject; and the record."""

    status: Status
    decision: Decision | None
    record: DecisionRecord

    @property
    def impossible(self) -> bool:
        """Waiting cannot help: reject."""
        return self.status.code == Code.UNRESOLVABLE


@dataclass(frozen=True, slots=True)
class QueueItem:
    """A job waiting in the queue, with what ordering needs."""

    job: JobSpec
    submitted_at: float
    fair_share: float = 0.0
    """The tenant's current share of its quota (lower goes first among equal priorities)."""
    attempts: int = 0


# ---- registry --------------------------------------------------------------------------------


class RegistryError(ValueError):
    """A plugin name registered twice, or asked for but never registered."""


PluginFactory = Callable[[Mapping[str, Any]], object]


class Registry:
    """Plugin name -> factory (taking the plugin's configuration); refuses duplicates."""

    def __init__(self) -> None:
        self._factories: dict[str, PluginFactory] = {}

    def register(self, name: str, factory: PluginFactory) -> None:
        """Add a factory; a name already taken raises :class:`RegistryError`."""
        if name in self._factories:
            raise RegistryError(f"plugin {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        """Registered plugin names, sorted."""
        return sorted(self._factories)

    def build(self, name: str, config: Mapping[str, Any] | None = None) -> object:
        """Instantiate one plugin."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise RegistryError(f"unknown plugin {name!r}; registered: {', '.join(self.names())}") from None
        return factory(config or {})


def extension_points(plugin: object) -> list[str]:
    """Which extension points a plugin serves (by the Protocols it satisfies)."""
    return [name for name, proto in EXTENSION_POINTS if isinstance(plugin, proto)]


# ---- the cycle -------------------------------------------------------------------------------


class Framework:
    """Runs scheduling cycles with a set of plugins and score weights (from configuration)."""

    def __init__(self, plugins: Sequence[object], weights: Mapping[str, float] | None = None) -> None:
        names = [getattr(p, "name", None) for p in plugins]
        if len(set(names)) != len(names):
            raise RegistryError(f"duplicate plugin names in {names}")
        for p in plugins:
            if not extension_points(p):
                raise RegistryError(f"{p!r} implements no extension point")
        self.plugins = list(plugins)
        self.queue_sort = [p for p in plugins if isinstance(p, QueueSortPlugin)]
        self.pre_filters = [p for p in plugins if isinstance(p, PreFilterPlugin)]
        self.filters = [p for p in plugins if isinstance(p, FilterPlugin)]
        self.post_filters = [p for p in plugins if isinstance(p, PostFilterPlugin)]
        self.scorers = [p for p in plugins if isinstance(p, ScorePlugin)]
        self.reservers = [p for p in plugins if isinstance(p, ReservePlugin)]
        self.permits = [p for p in plugins if isinstance(p, PermitPlugin)]
        self.binders = [p for p in plugins if isinstance(p, BindPlugin)]
        given = dict(weights or {})
        for name, w in given.items():
            if not (math.isfinite(w) and w >= 0):
                raise RegistryError(f"weight of {name!r} must be a finite number >= 0, got {w!r}")
        self.weights = {p.name: float(given.get(p.name, 1.0)) for p in self.scorers}

    # ---- queue ---------------------------------------------------------------------------------

    def sort(self, items: Iterable[QueueItem]) -> list[QueueItem]:
        """The queue in the order jobs get their cycles."""
        if not self.queue_sort:
            return sorted(items, key=lambda i: (-i.job.priority, i.submitted_at, i.job.job_id))
        plugin = self.queue_sort[0]
        return sorted(items, key=plugin.sort_key)

    def schedule_many(
        self,
        items: Iterable[QueueItem],
        snap: Snapshot,
        *,
        avoid: Mapping[str, Iterable[str]] | None = None,
    ) -> list[tuple[QueueItem, Outcome]]:
        """One cycle over a queue, in queue order: each job id at most once, and never a job that
        already holds GPUs (``snap.running``); every decision is applied before the next job's turn."""
        running = {r.job_id for r in snap.running}
        seen: set[str] = set()
        results: list[tuple[QueueItem, Outcome]] = []
        for item in self.sort(items):
            job_id = item.job.job_id
            if job_id in seen or job_id in running:
                continue
            seen.add(job_id)
            outcome = self.schedule(item.job, snap, avoid_clusters=(avoid or {}).get(job_id, ()))
            results.append((item, outcome))
        return results

    # ---- one job -------------------------------------------------------------------------------

    def new_state(self, job: JobSpec, snap: Snapshot, avoid_clusters: Iterable[str] = ()) -> CycleState:
        """A fresh cycle state with every cluster and model allowed."""
        return CycleState(
            job=job,
            snapshot=snap,
            cluster_mask=np.ones(len(snap.clusters), dtype=np.bool_),
            model_mask=np.ones(max(len(snap.models), 1), dtype=np.bool_),
            avoid_clusters=frozenset(avoid_clusters),
        )

    def schedule(
        self, job: JobSpec, snap: Snapshot, *, avoid_clusters: Iterable[str] = (), apply: bool = True
    ) -> Outcome:
        """One scheduling cycle for ``job``; with ``apply`` the snapshot takes the decision's GPUs."""
        state = self.new_state(job, snap, avoid_clusters)
        if state.avoid_clusters:
            avoided = np.array([c.id in state.avoid_clusters for c in snap.clusters], dtype=np.bool_)
            if not avoided.all():
                state.prune(avoided, lambda _c: "an earlier attempt failed to start there")
        record = DecisionRecord(
            job_id=job.job_id,
            at=snap.now,
            outcome="waiting",
            reason="",
            weights=dict(self.weights),
            candidates=[],
            pruned=state.pruned,
            chosen=[],
        )
        status = self.run_pre_filters(state)
        if not status.ok:
            return self._fail(record, status)
        state.policy_mask = state.cluster_mask.copy()
        self.prune_hierarchically(state)
        candidates = self.find_candidates(state)
        decision: Decision | None = None
        if len(candidates) == 0 and job.allow_multi_cluster and job.pipeline is None:
            partial = self.find_candidates(state, min_capacity=1)
            if len(partial):
                totals = self.score(state, partial, record)
                decision = self.spread(state, partial, totals)
                if decision is not None:
                    for part in decision.parts:
                        state.pruned.pop(part.cluster, None)
                    record.notes.append(
                        f"no single cluster holds the gang; spread over {len(decision.parts)} clusters"
                    )
        if decision is None and len(candidates) == 0:
            decision = self.run_post_filters(state, record)
            if decision is None:
                return self._fail(record, self.why_nothing_fits(state))
        elif decision is None:
            totals = self.score(state, candidates, record)
            decision = self.choose(state, candidates, totals)
        return self.finish(state, decision, record, apply=apply)

    def run_post_filters(self, state: CycleState, record: DecisionRecord) -> Decision | None:
        """Post-filters in order (preemption) until one makes room."""
        for post in self.post_filters:
            if post.name in state.skipped:
                continue
            decision = post.post_filter(state, self)
            if decision is not None:
                record.notes.append(f"{post.name}: made room by stopping {', '.join(decision.victims)}")
                record.victims = list(decision.victims)
                return decision
        return None

    def run_pre_filters(self, state: CycleState) -> Status:
        """Every pre-filter in order; the first one that is not SUCCESS/SKIP ends the cycle."""
        for plugin in self.pre_filters:
            try:
                status = plugin.pre_filter(state)
            except Exception as exc:  # a plugin bug keeps the job queued and is reported
                return Status(Code.ERROR, f"{type(exc).__name__}: {exc}", plugin.name)
            if status.code == Code.SKIP:
                state.skipped.add(plugin.name)
            elif not status.ok:
                return Status(status.code, status.reason, status.plugin or plugin.name, status.wait_s)
        if not state.cluster_mask.any():
            return Status(Code.UNSCHEDULABLE, "no cluster is allowed for this job", "pre_filter")
        return SUCCESS

    def prune_hierarchically(self, state: CycleState) -> None:
        """Region -> zone -> cluster pruning from aggregates, before any node is looked at."""
        snap = state.snapshot
        if not snap.clusters:
            return
        need = state.per_worker * (1 if self._may_split(state) else state.min_workers)
        models = state.model_mask[: snap.free_sum.shape[1]]
        free = (snap.free_sum * models).sum(axis=1)
        biggest = (snap.max_free * models).max(axis=1)
        region_free = np.zeros(len(snap.regions), np.int64)
        np.add.at(region_free, snap.cluster_region, free)
        poor_regions = region_free[snap.cluster_region] < need
        state.prune(
            poor_regions,
            lambda c: (
                f"region {snap.region_of(c)} has {region_free[snap.cluster_region[c]]} free GPUs"
                f" of the allowed models; the job needs {need}"
            ),
        )
        zone_free: dict[tuple[int, str], int] = {}
        for c, info in enumerate(snap.clusters):
            zone_free[(int(snap.cluster_region[c]), info.zone)] = zone_free.get(
                (int(snap.cluster_region[c]), info.zone), 0
            ) + int(free[c])
        poor_zones = np.array(
            [
                zone_free[(int(snap.cluster_region[c]), info.zone)] < need
                for c, info in enumerate(snap.clusters)
            ],
            dtype=np.bool_,
        )
        state.prune(
            poor_zones, lambda c: f"zone {snap.clusters[c].zone} has too few free GPUs ({need} needed)"
        )
        state.prune(
            free < need,
            lambda c: f"{free[c]} free GPUs of the allowed models; the job needs {need}",
        )
        state.prune(
            biggest < state.per_worker,
            lambda c: (
                f"no node has {state.per_worker} free GPUs of an allowed model for one worker"
                f" (most free on one node: {biggest[c]})"
            ),
        )

    def _may_split(self, state: CycleState) -> bool:
        return state.job.allow_multi_cluster or state.job.pipeline is not None

    def find_candidates(self, state: CycleState, *, min_capacity: int | None = None) -> Candidates:
        """Per (cluster, model) still allowed: filter its nodes and count the workers that fit."""
        snap = state.snapshot
        job = state.job
        g = state.per_worker
        cpu, mem = job.resources.cpu_milli, job.resources.memory_mib
        need = min_capacity if min_capacity is not None else state.min_workers
        clusters: list[int] = []
        models: list[int] = []
        capacity: list[int] = []
        nodes_out: list[IntArray] = []
        workers_out: list[IntArray] = []
        pairs = np.argwhere(
            state.cluster_mask[:, None]
            & state.model_mask[None, : snap.free_sum.shape[1]]
            & (snap.max_free >= g)
        )
        for pair in pairs:
            c, m = int(pair[0]), int(pair[1])
            idx, _ = snap.node_slice(c, m)
            mask = snap.schedulable[idx] & (snap.free[idx] >= g)
            for plugin in self.filters:
                if plugin.name in state.skipped:
                    continue
                mask &= plugin.filter(state, c, m, idx)
            passing = idx[mask]
            per_node = snap.free[passing] // g
            if cpu:
                per_node = np.where(
                    snap.cpu_known[passing], np.minimum(per_node, snap.cpu_free[passing] // cpu), per_node
                )
            if mem:
                per_node = np.where(
                    snap.mem_known[passing], np.minimum(per_node, snap.mem_free[passing] // mem), per_node
                )
            total = int(per_node.sum())
            if total < max(need, 1):
                cid = snap.clusters[c].id
                if cid not in state.pruned:
                    state.pruned[cid] = self._filter_reason(state, c, m, total, need)
                continue
            clusters.append(c)
            models.append(m)
            capacity.append(total)
            keep = per_node > 0
            nodes_out.append(passing[keep])
            workers_out.append(per_node[keep])
        cap = np.array(capacity, dtype=np.int64)
        return Candidates(
            cluster=np.array(clusters, dtype=np.int64),
            model=np.array(models, dtype=np.int64),
            capacity=cap,
            workers=np.minimum(cap, job.workers),
            nodes=nodes_out,
            node_workers=workers_out,
        )

    def _filter_reason(self, state: CycleState, c: int, m: int, fit: int, need: int) -> str:
        snap = state.snapshot
        what = "; ".join(p.describe(state) for p in self.filters if p.name not in state.skipped)
        return f"{snap.models[m]}: room for {fit} worker(s), needs {need}" + (f" ({what})" if what else "")

    def score(
        self, state: CycleState, candidates: Candidates, record: DecisionRecord | None = None
    ) -> FloatArray:
        """Weighted mean of every score plugin's normalised score per candidate (0-100)."""
        k = len(candidates)
        total = np.zeros(k)
        weight_sum = 0.0
        per_plugin: dict[str, tuple[FloatArray, FloatArray]] = {}
        for plugin in self.scorers:
            if plugin.name in state.skipped:
                continue
            w = self.weights.get(plugin.name, 1.0)
            raw = np.asarray(plugin.score(state, candidates), dtype=np.float64)
            norm = np.asarray(plugin.normalize(state, raw), dtype=np.float64)
            if (
                norm.shape != (k,)
                or not np.all(np.isfinite(norm))
                or norm.min(initial=0) < -1e-9
                or norm.max(initial=0) > 100 + 1e-9
            ):
                raise ValueError(f"plugin {plugin.name} produced scores outside 0-100: {norm!r}")
            per_plugin[plugin.name] = (raw, norm)
            if w > 0:
                total += w * norm
                weight_sum += w
        totals = total / weight_sum if weight_sum > 0 else np.full(k, 100.0)
        if record is not None:
            snap = state.snapshot
            names = list(per_plugin)
            norms = [np.round(per_plugin[n][1], 2).tolist() for n in names]
            raws = [_round_raws(per_plugin[n][0]) for n in names]
            tots = np.round(totals, 2).tolist()
            caps = candidates.capacity.tolist()
            for i, (c, m) in enumerate(
                zip(candidates.cluster.tolist(), candidates.model.tolist(), strict=True)
            ):
                info = snap.clusters[c]
                record.candidates.append(
                    CandidateRecord(
                        cluster=info.id,
                        region=info.region,
                        gpu_model=snap.models[m],
                        capacity=caps[i],
                        scores={n: v[i] for n, v in zip(names, norms, strict=True)},
                        raw={n: v[i] for n, v in zip(names, raws, strict=True)},
                        total=tots[i],
                    )
                )
        return totals

    def choose(self, state: CycleState, candidates: Candidates, totals: FloatArray) -> Decision:
        """The best candidate (ties: lowest cluster id, then model), packed onto its nodes."""
        snap = state.snapshot
        order = sorted(
            range(len(candidates)),
            key=lambda i: (
                -round(float(totals[i]), 9),
                snap.clusters[int(candidates.cluster[i])].id,
                int(candidates.model[i]),
            ),
        )
        best = order[0]
        part = self.pack(state, candidates, best, int(candidates.workers[best]))
        return Decision(
            job_id=state.job.job_id,
            parts=[part],
            workers=int(candidates.workers[best]),
            score=round(float(totals[best]), 2),
        )

    def spread(self, state: CycleState, candidates: Candidates, totals: FloatArray) -> Decision | None:
        """A gang over several clusters (one GPU model per cluster): best-scored candidates first,
        until every worker has room; None when even all of them cannot hold the gang."""
        snap = state.snapshot
        order = sorted(
            range(len(candidates)),
            key=lambda i: (-round(float(totals[i]), 9), snap.clusters[int(candidates.cluster[i])].id),
        )
        parts: list[Part] = []
        used_clusters: set[int] = set()
        left = state.job.workers
        placed = 0
        weighted = 0.0
        for i in order:
            c = int(candidates.cluster[i])
            if left <= 0:
                break
            if c in used_clusters:
                continue
            take = min(int(candidates.capacity[i]), left)
            parts.append(self.pack(state, candidates, i, take))
            used_clusters.add(c)
            left -= take
            placed += take
            weighted += take * float(totals[i])
        if placed < state.min_workers:
            return None
        return Decision(
            job_id=state.job.job_id, parts=parts, workers=placed, score=round(weighted / max(placed, 1), 2)
        )

    def pack(self, state: CycleState, candidates: Candidates, i: int, workers: int) -> Part:
        """``workers`` workers on candidate ``i``'s nodes, most room first (a gang on few nodes)."""
        snap = state.snapshot
        nodes, room = candidates.nodes[i], candidates.node_workers[i]
        order = np.lexsort((nodes, -room))
        allocations: list[tuple[str, int]] = []
        left = workers
        for j in order:
            if left <= 0:
                break
            fit = min(int(room[j]), left)
            allocations.append((snap.node_ids[int(nodes[j])], fit * state.per_worker))
            left -= fit
        c, m = int(candidates.cluster[i]), int(candidates.model[i])
        return Part(
            cluster=snap.clusters[c].id,
            region=snap.clusters[c].region,
            gpu_model=snap.models[m],
            allocations=tuple(allocations),
        )

    def finish(
        self, state: CycleState, decision: Decision, record: DecisionRecord, *, apply: bool
    ) -> Outcome:
        """Reserve, permit and bind a chosen decision; on any refusal, unreserve what was reserved."""
        done: list[ReservePlugin] = []
        for plugin in self.reservers:
            if plugin.name in state.skipped:
                continue
            status = plugin.reserve(state, decision)
            if not status.ok:
                for r in reversed(done):
                    r.unreserve(state, decision)
                return self._fail(record, _named(status, plugin.name))
            done.append(plugin)
        for permit in self.permits:
            if permit.name in state.skipped:
                continue
            status = permit.permit(state, decision)
            if status.code == Code.WAIT:
                decision.start_after_s = max(decision.start_after_s, status.wait_s)
                record.notes.append(f"{permit.name}: start waits {status.wait_s:.0f} s ({status.reason})")
            elif not status.ok:
                for r in reversed(done):
                    r.unreserve(state, decision)
                return self._fail(record, _named(status, permit.name))
        for binder in self.binders:
            if binder.name in state.skipped:
                continue
            status = binder.bind(state, decision)
            if not status.ok:
                for r in reversed(done):
                    r.unreserve(state, decision)
                return self._fail(record, _named(status, binder.name))
        if apply:
            for part in decision.parts:
                state.snapshot.take(
                    part.allocations,
                    state.per_worker,
                    state.job.resources.cpu_milli,
                    state.job.resources.memory_mib,
                )
        record.outcome = "placed"
        record.chosen = [p.cluster for p in decision.parts]
        record.reason = _placed_reason(decision)
        return Outcome(SUCCESS, decision, record)

    def why_nothing_fits(self, state: CycleState) -> Status:
        """UNRESOLVABLE when the job could not fit even on an empty platform, else UNSCHEDULABLE."""
        snap = state.snapshot
        g = state.per_worker
        need = state.min_workers
        models = state.model_mask[: snap.total_sum.shape[1]]
        if not snap.clusters:
            return Status(
                Code.UNSCHEDULABLE, "no cluster has joined yet; the job waits for capacity", "framework"
            )
        allowed = state.cluster_mask | np.array(
            [cid in state.pruned for cid in (c.id for c in snap.clusters)], dtype=np.bool_
        )
        # Capacity with every node empty (unschedulable nodes may come back), allowed clusters only.
        best_workers = 0
        best_where = ""
        split = self._may_split(state)
        platform_workers = 0
        largest_node = 0
        for ci in np.flatnonzero(allowed):
            c = int(ci)
            for m in np.flatnonzero(models):
                idx, _ = snap.node_slice(c, int(m))
                if idx.size == 0:
                    continue
                largest_node = max(largest_node, int(snap.total[idx].max()))
                workers = int((snap.total[idx] // g).sum())
                platform_workers += workers
                if workers > best_workers:
                    best_workers = workers
                    best_where = f"{snap.clusters[c].id} ({snap.models[int(m)]})"
        base = f"{need} worker(s) x {g} GPU(s)"
        if largest_node == 0:
            return Status(
                Code.UNRESOLVABLE,
                f"no allowed cluster has GPUs of the allowed models for {base};"
                " allow other models or clusters",
                "framework",
            )
        if g > largest_node:
            return Status(
                Code.UNRESOLVABLE,
                f"{base} can never fit: the largest node has {largest_node} GPUs of an allowed model;"
                f" ask for at most {largest_node} per worker",
                "framework",
            )
        fits_somewhere = platform_workers >= need if split else best_workers >= need
        if not fits_somewhere:
            hint = (
                f"the whole platform holds {platform_workers} such worker(s)"
                if split
                else f"the most any cluster holds is {best_workers} worker(s) on {best_where};"
                " ask for fewer workers or allow the gang to span clusters (allow_multi_cluster)"
            )
            return Status(Code.UNRESOLVABLE, f"{base} can never fit; {hint}", "framework")
        reasons = "; ".join(f"{k}: {v}" for k, v in sorted(state.pruned.items())[:6])
        return Status(
            Code.UNSCHEDULABLE,
            f"{base} would fit but the GPUs are taken now; waiting for capacity"
            + (f" ({reasons})" if reasons else ""),
            "framework",
        )

    def _fail(self, record: DecisionRecord, status: Status) -> Outcome:
        record.outcome = "rejected" if status.code == Code.UNRESOLVABLE else "waiting"
        record.reason = f"{status.plugin}: {status.reason}" if status.plugin else status.reason
        return Outcome(status, None, record)


def _named(status: Status, name: str) -> Status:
    return status if status.plugin else Status(status.code, status.reason, name, status.wait_s)


def _placed_reason(decision: Decision) -> str:
    where = ", ".join(
        f"{p.cluster} ({p.gpu_model}, {sum(g for _, g in p.allocations)} GPUs)" for p in decision.parts
    )
    return f"placed {decision.workers} worker(s) on {where} with score {decision.score:.1f}"


def _round_raws(values: FloatArray) -> list[float]:
    """Raw scores to 6 significant digits for the record (non-finite values as 0)."""
    clean = np.where(np.isfinite(values), values, 0.0)
    magnitude = np.floor(np.log10(np.maximum(np.abs(clean), 1e-300)))
    scale = 10.0 ** (5 - magnitude)
    rounded: list[float] = (np.round(clean * scale) / scale).tolist()
    return rounded

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

import dataclasses
import enum
import itertools
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from loom.sched import pipeline
from loom.sched.probe import is_probe
from loom.sched.snapshot import BoolArray, FloatArray, IntArray, QueuedShape, Snapshot
from loom_proto.jobs import JobSpec, RejectCode, SyncPlan

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
    reject: RejectCode = "impossible"
    """What an UNRESOLVABLE verdict is called to the submitter (``JobRejected.code``): typed by the
    plugin that said it, never read from the reason's words or the plugin's name."""
    hint: str = ""
    """What the submitter could change so that the job fits (empty when the reason says it all)."""

    @property
    def ok(self) -> bool:
        """SUCCESS (or SKIP, which lets the cycle go on)."""
        return self.code in (Code.SUCCESS, Code.SKIP)


SUCCESS = Status()


AVOIDED_REASON = "an earlier attempt left it (a failed or timed-out start, a drain or a migration)"
"""Why a cluster in ``avoid_clusters`` is ruled out for the next attempt (the decision record's
reason; the requeue event says which)."""


class StateKey(Generic[T]):
    """A typed key for :class:`CycleState`: a plugin writes its per-job state once, reads it after."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


IDLE_PIPELINE_PLAN: "StateKey[Callable[[], pipeline.PipelinePlan | None]]" = StateKey("idle_pipeline_plan")
"""Written by :meth:`Framework.schedule_pipeline` before its permits run: the best plan the job would
get on an idle platform (the clusters policy allows, their schedulable nodes), computed only when a
permit calls it."""


NodeLookup = Callable[[int, int], tuple[IntArray, IntArray]]
"""(cluster, model) -> the pair's nodes that pass the filters (absolute indices, ascending) and the
workers each can take (at least one)."""


@dataclass
class Candidates:
    """The (cluster, model) pairs that passed filtering, as parallel arrays of length K."""

    cluster: IntArray
    model: IntArray
    capacity: IntArray
    """Workers that fit now."""
    workers: IntArray
    """Workers the job would get there (elastic jobs: up to their maximum)."""
    nodes: NodeLookup = field(repr=False, compare=False)
    """A pair's passing nodes, looked up only for the pairs a decision packs onto. It reads the
    snapshot when called: pack before the snapshot changes (take, give_back), or find the
    candidates again, or ``capacity`` and the nodes will disagree."""
    _signature: tuple[bytes, bytes, bytes] | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.cluster.size)

    def signature(self) -> tuple[bytes, bytes, bytes]:
        """The clusters, models and workers as bytes (computed once: do not change the arrays)."""
        if self._signature is None:
            self._signature = (self.cluster.tobytes(), self.model.tobytes(), self.workers.tobytes())
        return self._signature

    def nodes_of(self, i: int) -> tuple[IntArray, IntArray]:
        """Candidate ``i``'s passing nodes and the workers each can take."""
        return self.nodes(int(self.cluster[i]), int(self.model[i]))

    def take(self, keep: IntArray) -> "Candidates":
        """The candidates at positions ``keep``."""
        return Candidates(
            cluster=self.cluster[keep],
            model=self.model[keep],
            capacity=self.capacity[keep],
            workers=self.workers[keep],
            nodes=self.nodes,
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
    max_workers: int | None = None
    """At most this many workers (a pre-filter's limit, e.g. the tenant's quota headroom)."""
    policy_mask: BoolArray | None = None
    """Clusters allowed by policy (pre-filters), before free capacity pruned any: where preemption looks."""
    submitted_at: float | None = None
    """When the job was submitted (the queue's clock, like ``snapshot.now``); None: not known."""
    queue_key: tuple[Any, ...] | None = None
    """The job's key in the framework's queue order (:meth:`Framework.queue_key`; lower first);
    None: not known (the jobs queued ahead of it are then not known either)."""
    held_off: BoolArray | None = None
    """Clusters a pre-filter ruled out for now only (a running job the job keeps apart from):
    what the job could never fit is judged with them (:meth:`Framework.why_nothing_fits`)."""
    shared: dict[Hashable, Any] | None = None
    """Within :meth:`Framework.schedule_many`: one store shared by every job of the cycle (None
    outside one), for figures a plugin can reuse from job to job of the cycle. What is kept must be
    checked before reuse against what can change within the cycle: nodes change only through the
    snapshot's ``take``/``give_back``/``set_schedulable``, which bump ``pool_version``; the running
    jobs and books can change too."""
    applying: bool = True
    """False for a what-if (``Framework.schedule(apply=False)``): plugins leave their books (the
    wait book's claims) as they are."""
    _data: dict[StateKey[Any], Any] = field(default_factory=dict)

    @property
    def per_worker(self) -> int:
        """GPUs per worker."""
        return self.job.resources.gpus

    @property
    def target_workers(self) -> int:
        """The most workers the job may get: its size, capped by any pre-filter's limit."""
        cap = self.max_workers if self.max_workers is not None else self.job.workers
        return max(min(cap, self.job.workers), self.min_workers)

    @property
    def min_workers(self) -> int:
        """The fewest workers the job can start with (its gang size unless elastic)."""
        return min(self.job.min_workers or self.job.workers, self.job.workers)

    def allowed_pools(self) -> BoolArray:
        """(cluster, GPU model) pools the job's rules allow (the pre-filters' clusters and models,
        before free capacity pruned any)."""
        clusters = self.policy_mask if self.policy_mask is not None else self.cluster_mask
        models = self.model_mask[: len(self.snapshot.models)]
        return np.asarray(clusters[:, None] & models[None, :], dtype=np.bool_)

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
        newly = (clusters & self.cluster_mask).nonzero()[0]
        if not newly.size:
            return  # nothing still allowed is ruled out: the mask stays as it is
        for c in newly.tolist():
            self.pruned.setdefault(self.snapshot.clusters[c].id, reason(c))
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
    """Per node, vectorised: which of ``nodes`` (absolute indices, any clusters and models) hold a worker.

    Called with nodes that are schedulable and have a worker's GPUs free; a plugin that needs a
    node's cluster or model reads ``snapshot.cluster_of[nodes]``. A plugin whose answer depends only
    on the nodes' state and on a summary of the job may say so with ``filter_key(state) ->
    Hashable`` (equal keys: equal answers for equal nodes); the framework then keeps each pool's
    workers per job shape and recounts only the pools whose nodes changed. Without it, every
    pool is counted afresh each cycle.
    """

    name: str

    def filter(self, state: CycleState, nodes: IntArray) -> BoolArray: ...

    def describe(self, state: CycleState) -> str: ...


@runtime_checkable
class PostFilterPlugin(Protocol):
    """Runs when no candidate passed filtering (preemption); may return a decision that frees room."""

    name: str

    def post_filter(self, state: CycleState, framework: "Framework") -> "Decision | None": ...


@runtime_checkable
class ScorePlugin(Protocol):
    """Scores every candidate (raw, any scale) and maps the raw scores to 0-100 (higher is better).

    Optional, for speed within one :meth:`Framework.schedule_many` (a cycle over a queue): a plugin
    may define ``score_key(state) -> Hashable | None``. A key (not None) promises that ``score``'s
    raw scores depend only on that key, the candidates' ``cluster``, ``model`` and ``workers``
    arrays (all of them: a raw score may compare a candidate with the others; not ``capacity``) and
    on what of the snapshot does not change within a cycle (nodes' totals, clusters and their
    trust, speeds, the network, prices, the clock): never on nodes' free resources or
    schedulability, the running jobs, a book, or any other field of the job. A later job of the
    same cycle with an equal key and equal candidate arrays then reuses the raw scores. None: no
    reuse. With a ``score_key``, ``normalize_key(state) -> Hashable | None`` may promise likewise
    that ``normalize`` reads only the raw scores, what the score key covers and this key (``()``:
    nothing more), so the normalised scores are reused too when both keys are equal.
    """

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
class SpreadPlugin(Protocol):
    """Proposes subsets of a gang's candidates to spread it over, best first, for when the
    best-scored spread was refused (:meth:`Framework.banded_spreads`)."""

    name: str

    def spread_subsets(self, state: CycleState, candidates: "Candidates") -> list[BoolArray]: ...


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
    room_by: str = ""
    """The post-filter that made room (``preemption``, ``rare_room``, ``elastic_shrink``); "" when
    the decision needed none."""
    undo: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Set by a post-filter that changed the snapshot (gave victims' GPUs back): reverses that
    when the decision is refused later in the cycle (reserve, permit or bind)."""
    shrunk: tuple[tuple[str, int, tuple[tuple[str, int], ...]], ...] = ()
    """Elastic jobs shrunk to make room: (job_id, workers, new allocations); given back already."""

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


class CandidateTable:
    """The candidates a record keeps, column-wise, as scoring produced them: the record's
    :class:`CandidateRecord` objects (two dicts each) are built only when someone reads
    ``DecisionRecord.candidates`` (``loom explain``, tests); storing a record
    (:meth:`DecisionRecord.to_dict`) reads the columns directly."""

    __slots__ = ("_raw", "capacity", "cluster", "gpu_model", "names", "region", "scores", "total")

    def __init__(  # noqa: PLR0917
        self,
        names: tuple[str, ...],
        cluster: list[str],
        region: list[str],
        gpu_model: list[str],
        capacity: list[int],
        total: list[float],
        scores: list[list[float]],
        raw: "FloatArray | list[list[float]]",
    ) -> None:
        self.names = names
        """The scorers, in the framework's order (every candidate has a score of each)."""
        self.cluster = cluster
        self.region = region
        self.gpu_model = gpu_model
        self.capacity = capacity
        self.total = total
        self.scores = scores
        """Per scorer (``names`` order), each candidate's normalised score, rounded to 2 places."""
        self._raw = raw

    @property
    def raw(self) -> list[list[float]]:
        """Per scorer, each candidate's raw value (non-finite ones as 0); made lists when first read
        (placement stores records without them)."""
        held = self._raw
        if isinstance(held, list):
            return held
        values = held.copy()
        values[~np.isfinite(values)] = 0.0
        listed: list[list[float]] = values.tolist()
        self._raw = listed
        return listed

    def records(self) -> list[CandidateRecord]:
        """The candidates as :class:`CandidateRecord` objects."""
        names = self.names
        if not names:
            return [
                CandidateRecord(
                    self.cluster[i], self.region[i], self.gpu_model[i], self.capacity[i], {}, {}, t
                )
                for i, t in enumerate(self.total)
            ]
        scores = list(zip(*self.scores, strict=True))
        raw = list(zip(*self.raw, strict=True))
        return [
            CandidateRecord(
                self.cluster[i],
                self.region[i],
                self.gpu_model[i],
                self.capacity[i],
                dict(zip(names, scores[i], strict=True)),
                dict(zip(names, raw[i], strict=True)),
                t,
            )
            for i, t in enumerate(self.total)
        ]


class DecisionRecord:
    """What a cycle saw and why it chose: the basis of ``loom explain``.

    ``candidates`` are kept as :class:`CandidateTable` columns while scoring adds them
    (:meth:`add_table`) and become :class:`CandidateRecord` objects the first time they are read."""

    __slots__ = (
        "_candidates",
        "_tables",
        "at",
        "chosen",
        "considered",
        "job_id",
        "notes",
        "outcome",
        "pruned",
        "queued",
        "reason",
        "refused",
        "victims",
        "weights",
    )

    def __init__(  # noqa: PLR0917
        self,
        job_id: str,
        at: float,
        outcome: str,
        reason: str,
        weights: dict[str, float],
        candidates: list[CandidateRecord],
        pruned: dict[str, str],
        chosen: list[str],
        victims: list[str] | None = None,
        notes: list[str] | None = None,
        considered: int = 0,
    ) -> None:
        self.job_id = job_id
        self.at = at
        self.outcome = outcome
        """"placed", "waiting" or "rejected"."""
        self.reason = reason
        self.weights = weights
        self._candidates = candidates
        self._tables: list[CandidateTable] = []
        self.pruned = pruned
        self.chosen = chosen
        """Cluster ids of the decision's parts, lead first."""
        self.victims: list[str] = victims if victims is not None else []
        self.notes: list[str] = notes if notes is not None else []
        self.considered = considered
        """How many candidates were scored (the record keeps the best of them)."""
        self.queued = False
        """Nothing fitted the job in one cluster, so it joined the queue (``Snapshot.waiting``); a job
        held back by a permit's choice while a cluster holds it (waiting for faster GPUs) is not,
        though it may still be counted there from an earlier decision."""
        self.refused = False
        """A decision that made room (preemption or an elastic shrink) was chosen for the job and a
        reserve, permit or bind plugin refused it: the verdict read the job itself (its own run
        against what the room costs), so a job of the same shape may yet be placed."""

    @property
    def candidates(self) -> list[CandidateRecord]:
        """The candidates kept, best first per scoring pass."""
        if self._tables:
            for table in self._tables:
                self._candidates += table.records()
            self._tables = []
        return self._candidates

    @candidates.setter
    def candidates(self, value: list[CandidateRecord]) -> None:
        self._candidates = value
        self._tables = []

    def add_table(self, table: CandidateTable) -> None:
        """Candidates of one scoring pass, after those kept already."""
        self._tables.append(table)

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.job_id,
            self.at,
            self.outcome,
            self.reason,
            self.weights,
            self.candidates,
            self.pruned,
            self.chosen,
            self.victims,
            self.notes,
            self.considered,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DecisionRecord):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        names = (
            "job_id",
            "at",
            "outcome",
            "reason",
            "weights",
            "candidates",
            "pruned",
            "chosen",
            "victims",
            "notes",
            "considered",
        )
        return (
            "DecisionRecord("
            + ", ".join(f"{n}={v!r}" for n, v in zip(names, self._fields(), strict=True))
            + ")"
        )

    def to_dict(self, *, raw: bool = True) -> dict[str, Any]:
        """Plain JSON-able form for storage, column-wise (a record is written with every decision).

        ``raw=False`` leaves the plugins' raw values out: what placement stores, since ``loom
        explain`` shows the normalised scores only, and the raw values are nearly half the record
        (:meth:`from_dict` reads either form)."""
        columns: dict[str, Any]
        if len(self._tables) == 1 and not self._candidates:
            # straight from the one scoring pass's columns (the same values, no objects built)
            table = self._tables[0]
            plugins = sorted(table.names)
            where = [table.names.index(p) for p in plugins]
            columns = {
                "cluster": list(table.cluster),
                "region": list(table.region),
                "gpu_model": list(table.gpu_model),
                "capacity": list(table.capacity),
                "total": list(table.total),
                "scores": [list(table.scores[j]) for j in where],
            }
            if raw:
                columns["raw"] = [list(table.raw[j]) for j in where]
        else:
            cands = self.candidates
            plugins = sorted({p for c in cands for p in c.scores})
            columns = {
                "cluster": [c.cluster for c in cands],
                "region": [c.region for c in cands],
                "gpu_model": [c.gpu_model for c in cands],
                "capacity": [c.capacity for c in cands],
                "total": [c.total for c in cands],
                "scores": [[c.scores.get(p) for c in cands] for p in plugins],
            }
            if raw:
                columns["raw"] = [[c.raw.get(p) for c in cands] for p in plugins]
        return {
            "job_id": self.job_id,
            "at": self.at,
            "outcome": self.outcome,
            "reason": self.reason,
            "weights": self.weights,
            "plugins": plugins,
            "candidates": columns,
            "pruned": dict(sorted(self.pruned.items())[:PRUNED_KEPT]),
            "pruned_count": len(self.pruned),
            "chosen": self.chosen,
            "victims": self.victims,
            "notes": self.notes,
            "considered": self.considered,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DecisionRecord":
        """Inverse of :meth:`to_dict` (the pruned reasons beyond the first few are not kept)."""
        cols = data["candidates"]
        plugins = list(data["plugins"])
        raws = cols.get("raw") or [[None] * len(cols["cluster"]) for _ in plugins]
        candidates = [
            CandidateRecord(
                cluster=cluster,
                region=cols["region"][i],
                gpu_model=cols["gpu_model"][i],
                capacity=int(cols["capacity"][i]),
                scores={
                    p: cols["scores"][j][i] for j, p in enumerate(plugins) if cols["scores"][j][i] is not None
                },
                raw={p: raws[j][i] for j, p in enumerate(plugins) if raws[j][i] is not None},
                total=float(cols["total"][i]),
            )
            for i, cluster in enumerate(cols["cluster"])
        ]
        return cls(
            job_id=data["job_id"],
            at=float(data["at"]),
            outcome=data["outcome"],
            reason=data["reason"],
            weights=dict(data["weights"]),
            candidates=candidates,
            pruned=dict(data["pruned"]),
            chosen=list(data["chosen"]),
            victims=list(data.get("victims", [])),
            notes=list(data.get("notes", [])),
            considered=int(data.get("considered", len(candidates))),
        )


PRUNED_KEPT = 32
"""Ruled-out clusters whose reasons a stored record keeps (the count of all is kept too)."""

MAX_BANDED_SPREADS = 4
"""At most this many proposed spreads are tried after the best-scored spread is refused
(:meth:`Framework.banded_spreads`): each costs a reserve and the permits."""


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
    own_quota: bool | None = None
    """The tenant's standing in the quota book (:func:`loom.sched.cycle.quota_standing`): None
    when the book lists no quota (an open book: no tenant borrows, and its share is the GPUs it
    holds, which orders it among equals, not behind every tenant holding none); True when the
    tenant has a quota of its own (it borrows at or over it); False when the book lists others' but
    not its (no guarantee: it is in the borrowing band whatever it holds). Built outside
    ``run_cycle`` and the simulator, set it from the book, or the quota band is off."""


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
        self.record_top = 16
        self.spreaders = [p for p in plugins if isinstance(p, SpreadPlugin)]
        """Plugins proposing spreads to try when the best-scored one is refused (:meth:`banded_spreads`)."""
        self.cycle_caches = True
        """Whether :meth:`schedule_many` reuses per-job work between jobs of one cycle (plugins'
        ``score_key``); False decides every job from scratch (the reference the tests compare with)."""
        """Candidates kept in a decision record (the best ones; the count of all is kept too)."""
        self._pool_workers: weakref.WeakKeyDictionary[
            Snapshot, OrderedDict[Hashable, tuple[IntArray, IntArray]]
        ] = weakref.WeakKeyDictionary()
        """Per snapshot and job shape: the pool versions counted, and the workers per pool."""
        self._scorer_info: list[tuple[ScorePlugin, _KeyOf | None, _KeyOf | None]] = [
            (p, getattr(p, "score_key", None), getattr(p, "normalize_key", None)) for p in self.scorers
        ]
        self._cycle: dict[tuple[str, Hashable], _ScoreEntry] | None = None
        """Within :meth:`schedule_many`: raw (and normalised) scores per plugin and ``score_key``."""
        self._shared: dict[Hashable, Any] | None = None
        """Within :meth:`schedule_many`: the store the cycle's states share (``CycleState.shared``)."""
        self._order: tuple[FloatArray, IntArray] | None = None
        """The totals the last record was built from and their order (:meth:`choose` reuses it)."""

    # ---- queue ---------------------------------------------------------------------------------

    def queue_key(self, item: QueueItem) -> tuple[Any, ...]:
        """The item's key in the queue order (lower first): the queue-sort plugin's, else
        priority, then submission, then the job id."""
        if not self.queue_sort:
            return (-item.job.priority, item.submitted_at, item.job.job_id)
        return tuple(self.queue_sort[0].sort_key(item))

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
        placed: "Callable[[QueueItem, Decision], None] | None" = None,
    ) -> list[tuple[QueueItem, Outcome]]:
        """One cycle over a queue, in queue order: each job id at most once, and never a job that
        already holds GPUs (``snap.running``); every decision is applied before the next job's turn.

        ``placed``: called after each placement, before the next job's turn (the caller lists the
        new run in ``snap.running``, so later jobs of the cycle see it as the simulator's do)."""
        running = snap.running_ids()
        seen: set[str] = set()
        results: list[tuple[QueueItem, Outcome]] = []
        outer, outer_shared = self._cycle, self._shared
        if self.cycle_caches:
            self._cycle, self._shared = {}, {}
        try:
            for item in self.sort(items):
                job_id = item.job.job_id
                if job_id in seen or job_id in running:
                    continue
                seen.add(job_id)
                outcome = self.schedule(
                    item.job,
                    snap,
                    avoid_clusters=(avoid or {}).get(job_id, ()),
                    submitted_at=item.submitted_at,
                    queue_key=self.queue_key(item),
                )
                results.append((item, outcome))
                if placed is not None and outcome.decision is not None:
                    placed(item, outcome.decision)
        finally:
            self._cycle, self._shared = outer, outer_shared
            self._order = None
        return results

    # ---- one job -------------------------------------------------------------------------------

    def new_state(
        self,
        job: JobSpec,
        snap: Snapshot,
        avoid_clusters: Iterable[str] = (),
        submitted_at: float | None = None,
        *,
        applying: bool = True,
    ) -> CycleState:
        """A fresh cycle state with every cluster and model allowed (``applying``: false for a
        what-if)."""
        return CycleState(
            job=job,
            snapshot=snap,
            cluster_mask=np.ones(len(snap.clusters), dtype=np.bool_),
            model_mask=np.ones(max(len(snap.models), 1), dtype=np.bool_),
            avoid_clusters=frozenset(avoid_clusters),
            submitted_at=submitted_at,
            shared=self._shared,
            applying=applying,
        )

    def queued_shape(
        self,
        job: JobSpec,
        snap: Snapshot,
        queue_key: tuple[Any, ...],
        *,
        state: CycleState | None = None,
        avoid_clusters: Iterable[str] = (),
        submitted_at: float | None = None,
    ) -> QueuedShape | None:
        """What the jobs behind ``job`` see of it queued (``Snapshot.queued``): its minimum workers,
        GPUs per worker and the pools its pre-filters allow (``state``'s, after them; without one,
        they are run on a fresh state); None for a pipeline (never queued as one shape) or when its
        pre-filters refuse it now. The one rule for the framework and the simulator's skipped
        decisions."""
        if job.pipeline is not None:
            return None
        if state is None:
            state = self.new_state(job, snap, avoid_clusters, submitted_at)
            if not self.run_pre_filters(state).ok:
                return None
        return QueuedShape(
            job.job_id,
            queue_key,
            state.min_workers,
            state.per_worker,
            state.allowed_pools(),
            job,
            float(job.work.steps) * float(job.work.step_time_s),
        )

    # PLR0912: the extension points in order, each may end the cycle.
    def schedule(
        self,
        job: JobSpec,
        snap: Snapshot,
        *,
        avoid_clusters: Iterable[str] = (),
        apply: bool = True,
        submitted_at: float | None = None,
        queue_key: tuple[Any, ...] | None = None,
    ) -> Outcome:
        """One scheduling cycle for ``job``; with ``apply`` the snapshot takes the decision's GPUs,
        and its queue (``Snapshot.waiting``) counts the job from when nothing fits it until it is
        placed or rejected, with its shape and ``queue_key`` (``Snapshot.queued``: the jobs
        behind it count it ahead of them). Applied, the job's worker shape is noted as seen
        (``Snapshot.seen``: what ``rare_fit`` keeps room for)."""
        if apply and job.pipeline is None and job.job_id not in snap.waiting:
            # Once, when it arrives (as the simulator notes it): a job decided again while it
            # waits is not seen again, though a queue longer than the memory has forgotten it.
            snap.seen.note_job(job, snap.now)
        outcome = self._schedule_one(job, snap, avoid_clusters, apply, submitted_at, queue_key=queue_key)
        if apply and (outcome.decision is not None or outcome.status.code == Code.UNRESOLVABLE):
            snap.waiting.discard(job.job_id)
            snap.queued.pop(job.job_id, None)
        return outcome

    def _schedule_one(  # noqa: PLR0912
        self,
        job: JobSpec,
        snap: Snapshot,
        avoid_clusters: Iterable[str],
        apply: bool,
        submitted_at: float | None,
        *,
        queue_key: tuple[Any, ...] | None = None,
    ) -> Outcome:
        state = self.new_state(job, snap, avoid_clusters, submitted_at, applying=apply)
        state.queue_key = queue_key
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
        avoided = np.zeros(len(snap.clusters), dtype=np.bool_)
        for cid in state.avoid_clusters:
            index = snap.cluster_index.get(cid)
            if index is not None:
                avoided[index] = True
        any_avoided = bool(state.avoid_clusters) and bool(avoided.any())
        if any_avoided:
            # Clusters an earlier attempt left (it failed to start or timed out there, or a drain
            # or a migration moved it off): avoided while others can take it (a preference: when
            # nothing else fits, they are tried again below). Which of those it was is in the
            # job's events (`loom explain` shows them beside this reason).
            state.prune(avoided, lambda _c: AVOIDED_REASON)
        self.prune_hierarchically(state)
        if job.pipeline is not None:
            return self.schedule_pipeline(state, record, apply=apply)
        candidates = self.find_candidates(state)
        if len(candidates) == 0 and any_avoided:
            state.cluster_mask = state.policy_mask.copy()
            for c in np.flatnonzero(avoided):
                state.pruned.pop(snap.clusters[int(c)].id, None)
            self.prune_hierarchically(state)
            candidates = self.find_candidates(state)
        decision: Decision | None = None
        if len(candidates) == 0 and apply:
            # Nothing fits it in one cluster now: it is part of the queue, whether a spread is
            # tried or not (placed, schedule() takes it out). A gang the span guard refuses every
            # spread thus waits exactly as with spanning forbidden; a job held back by a permit's
            # choice while a cluster holds it now (waiting for faster GPUs) is not queued.
            self._join_queue(state, record, queue_key)
        partial: Candidates | None = None
        totals = np.zeros(0)
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
        refused: Outcome | None = None
        if decision is not None:
            # A spread: no single cluster holds the gang now.
            outcome = self.finish(state, decision, record, apply=apply)
            if outcome.decision is not None or outcome.status.code != Code.UNSCHEDULABLE:
                return self._settled(decision, outcome)
            # Refused for now (the span guard: waiting for one cluster ends sooner, or the spread
            # holds too many GPU-hours): spreads over GPUs of like speed are tried next, then the
            # gang goes on as it would with spanning forbidden (preemption, a backfill claim),
            # keeping the first refusal's reason and wait if nothing else.
            self._settled(decision, outcome)
            banded = self._banded_spread(state, partial, totals, decision, record, apply=apply)
            if banded is not None:
                return banded
            refused, decision = outcome, None
        if decision is None and len(candidates) == 0:
            why = self.why_nothing_fits(state)
            if why.code == Code.UNRESOLVABLE:
                # Preemption cannot help either; a gang only a spread can ever hold waits for one.
                return refused if refused is not None else self._fail(record, why)
            decision = self.run_post_filters(state, record)
            if decision is None:
                return refused if refused is not None else self._fail(record, why)
        elif decision is None:
            totals = self.score(state, candidates, record)
            decision = self.choose(state, candidates, totals)
        return self._settled(decision, self.finish(state, decision, record, apply=apply))

    def _join_queue(
        self, state: CycleState, record: DecisionRecord, queue_key: tuple[Any, ...] | None
    ) -> None:
        """Nothing fits the job in one cluster: it counts in the queue (``Snapshot.waiting``), with
        its shape at its place in the queue order when it has one (``Snapshot.queued``)."""
        job, snap = state.job, state.snapshot
        snap.join_queue(job.job_id, probe=is_probe(job.labels))
        record.queued = True
        if queue_key is not None:
            shape = self.queued_shape(job, snap, queue_key, state=state)
            if shape is not None:
                snap.queued[job.job_id] = shape

    @staticmethod
    def _settled(decision: Decision, outcome: Outcome) -> Outcome:
        """``outcome`` once ``decision`` is settled: undone when refused, its undo dropped either way
        (no old snapshot state kept alive)."""
        if outcome.decision is None and decision.undo is not None:
            decision.undo()
        decision.undo = None
        return outcome

    def pipeline_sites(
        self,
        state: CycleState,
        *,
        idle: bool = False,
        schedulable_only: bool = False,
        top: int | None = None,
    ) -> list[pipeline.Site]:
        """One site per allowed cluster: its pool of most useful capacity; ``idle``: as if nothing ran
        (with ``schedulable_only``, on the nodes that take work now; else on every node).

        ``top``: only the sites the planner would look at, which is all a decision needs: the
        ``top`` of most :func:`~loom.sched.pipeline.useful_capacity` (ties: cluster order, as
        :func:`pipeline.plan` ranks them with ``max_sites=top``), and the one of most useful
        capacity that holds the whole model (the site :func:`pipeline.best_single` would pick).
        Sites that cannot run a stage (no speed) are left out. At 100,000 nodes this builds nine
        sites instead of about 660.

        Each pool's GPUs are the snapshot's per-pool sums, so only the chosen pools become
        :class:`~loom.sched.pipeline.Site`, listing the nodes that have GPUs to give (a node without
        any can take no stage); a pool unchanged since its last site reuses that site.
        """
        snap = state.snapshot
        c_count, m_count = snap.total_sum.shape
        allowed = state.policy_mask if (idle and state.policy_mask is not None) else state.cluster_mask
        models = state.model_mask[:m_count]
        mode = (
            _SiteMode.IDLE_SCHEDULABLE
            if (idle and schedulable_only)
            else _SiteMode.IDLE
            if idle
            else _SiteMode.FREE
        )
        cpu_milli, memory_mib = state.job.resources.cpu_milli, state.job.resources.memory_mib
        if cpu_milli or memory_mib:
            # A stage's GPUs each ask CPU and RAM: a pool counts what its nodes can give them (its
            # GPUs alone chose a pool whose nodes have too few cores, and left the one that fits).
            per_node = _stage_gpus(snap, slice(None), mode, cpu_milli, memory_mib)
            gpus = np.bincount(snap.pool_of, weights=per_node, minlength=c_count * m_count)
            gpus = gpus.astype(np.int64).reshape(c_count, m_count)
        elif mode is _SiteMode.FREE:
            gpus = snap.free_sum
        elif mode is _SiteMode.IDLE:
            gpus = snap.total_sum
        else:
            up = np.where(snap.schedulable, snap.total, 0)
            gpus = np.bincount(snap.pool_of, weights=up, minlength=c_count * m_count)
            gpus = gpus.astype(np.int64).reshape(c_count, m_count)
        eligible = allowed[:, None] & models[None, :] & (snap.total_sum > 0) & (gpus > 0)
        if not eligible.any():
            return []
        speed = snap.job_speeds(state.job)[None, :] * snap.trust[:, None]
        memory = [snap.gpu_memory_gib.get(m, 0.0) or 16.0 for m in snap.models]
        usable = np.isfinite(speed) & (speed >= 0) & np.array([math.isfinite(g) and g > 0 for g in memory])
        for c, m in np.argwhere(eligible & ~usable)[:1].tolist():
            # Bad figures (a negative speed, no GPU memory): the site refuses them with PipelineError.
            _site(snap, c, m, mode, speed_per_gpu=float(speed[c, m]), memory_gib=memory[m])
        # Per cluster, the first model of most useful capacity (pipeline.useful_capacity): speed x
        # the free GPUs the whole model would need there, never more (argmax keeps the first of equals).
        free = gpus
        whole: IntArray | None = None
        if state.job.pipeline is not None:
            compute_s, whole_gib = pipeline.whole_model(state.job.pipeline.layers)
            # per model, the GPUs the whole model needs (0 where the figures are unusable)
            whole = np.array(
                [pipeline.stage_gpus(whole_gib, g) if g > 0 and math.isfinite(g) else 0 for g in memory],
                dtype=np.int64,
            )
            free = np.minimum(free, whole[None, :])
        useful = speed * free
        best = np.argmax(np.where(eligible, useful, -np.inf), axis=1)
        clusters = np.flatnonzero(eligible.any(axis=1))
        if top is not None and whole is not None:
            chosen = best[clusters]
            clusters = clusters[speed[clusters, chosen] > 0]
            chosen = best[clusters]
            rank = np.lexsort((clusters, -useful[clusters, chosen]))
            keep = set(clusters[rank[:top]].tolist())
            # best_single's pick: the fewest seconds for the whole model, the first cluster of equals
            holds = gpus[clusters, chosen] >= whole[chosen]
            if holds.any():
                at, on = clusters[holds], chosen[holds]
                keep.add(int(at[np.argmin(compute_s / (whole[on] * speed[at, on]))]))
            clusters = np.array(sorted(keep), dtype=np.int64)
        cache = _SITES.setdefault(snap, {})
        return [
            _site(
                snap,
                c,
                int(best[c]),
                mode,
                speed_per_gpu=float(speed[c, best[c]]),
                memory_gib=memory[int(best[c])],
                cpu_milli=state.job.resources.cpu_milli,
                memory_mib=state.job.resources.memory_mib,
                cache=cache,
            )
            for c in clusters.tolist()
        ]

    @staticmethod
    def pipeline_step_now(
        job: JobSpec, parts: Sequence[tuple[str, str, Sequence[tuple[str, int]]]], snap: Snapshot
    ) -> float | None:
        """Seconds a step of a running pipeline takes now on its own stages' GPUs ``parts``
        ((cluster, GPU model, allocations) per stage), with the speeds and links of ``snap``: the
        planner over exactly those GPUs (a site per part holding only the run's own), as
        :meth:`schedule_pipeline` timed the candidates. The split it finds is the best over those
        GPUs, so never slower than the run's own: a move is judged against the run at its best.
        None when they hold no plan (a part's cluster or model unknown to the snapshot)."""
        assert job.pipeline is not None
        speeds = snap.believed_speeds(job)  # a running pipeline: as believed
        sites = []
        for cluster, model, allocations in parts:
            c, m = snap.cluster_index.get(cluster), snap.model_index.get(model)
            if c is None or m is None:
                return None
            memory = snap.gpu_memory_gib.get(model, 0.0) or 16.0
            speed = float(speeds[m]) * float(snap.trust[c])
            if not (math.isfinite(speed) and speed > 0):
                return None
            free = tuple(sorted((node, int(g)) for node, g in allocations))
            sites.append(pipeline.Site(cluster, snap.clusters[c].region, model, speed, memory, free))

        def net(src: str, dst: str) -> tuple[float, float]:
            return snap.net.link(src, dst)

        plan = pipeline.plan(job.pipeline.layers, sites, net, max_stages=job.pipeline.max_stages)
        return None if plan is None else plan.step_s

    def schedule_pipeline(self, state: CycleState, record: DecisionRecord, *, apply: bool) -> Outcome:
        """A model declared as layers: contiguous stages over clusters, the slowest stage fastest."""
        snap = state.snapshot
        job = state.job
        assert job.pipeline is not None
        layers = job.pipeline.layers
        max_stages = job.pipeline.max_stages

        def net(src: str, dst: str) -> tuple[float, float]:
            return snap.net.link(src, dst)

        top = pipeline.DEFAULT_MAX_SITES
        sites = self.pipeline_sites(state, top=top)
        plan = pipeline.plan(layers, sites, net, max_stages=max_stages, max_sites=top) if sites else None
        if plan is None:
            # the reasons speak of every site (their counts included), so they see them all
            idle = self.pipeline_sites(state, idle=True, top=top)
            if idle and pipeline.plan(layers, idle, net, max_stages=max_stages) is not None:
                every = self.pipeline_sites(state)
                reason = pipeline.infeasible_reason(layers, every, net, max_stages=max_stages) or "no room"
                return self._fail(
                    record, Status(Code.UNSCHEDULABLE, f"{reason}; waiting for capacity", "pipeline")
                )
            every = self.pipeline_sites(state, idle=True)
            why = (
                pipeline.infeasible_reason(layers, every, net, max_stages=max_stages, capacity=True)
                or "no cluster has GPUs"
            )
            return self._fail(record, Status(Code.UNRESOLVABLE, why, "pipeline"))

        def idle_plan() -> pipeline.PipelinePlan | None:
            idle = self.pipeline_sites(state, idle=True, schedulable_only=True, top=top)
            return pipeline.plan(layers, idle, net, max_stages=max_stages, max_sites=top) if idle else None

        state.write(IDLE_PIPELINE_PLAN, idle_plan)
        single = pipeline.best_single(layers, sites)
        compute_ref = sum(layer.compute_s for layer in layers)
        parts = [
            Part(
                cluster=st.site.cluster,
                region=st.site.region,
                gpu_model=st.site.gpu_model,
                allocations=st.allocations,
                layers=(st.first_layer, st.last_layer),
            )
            for st in plan.stages
        ]
        lead_speed = plan.stages[0].site.speed_per_gpu or 1.0
        decision = Decision(
            job_id=job.job_id,
            parts=parts,
            workers=job.workers,
            score=100.0,
            predicted_step_s=plan.step_s,
            # The agent times a step as step_time_s x slowdown / speed of the lead's GPUs.
            slowdown=max(plan.step_s * lead_speed / max(job.work.step_time_s, 1e-9), 1e-6),
        )
        for st in plan.stages:
            record.notes.append(
                f"stage layers {st.first_layer}-{st.last_layer} on {st.site.cluster}"
                f" ({st.gpus} {st.site.gpu_model}):"
                f" compute {st.compute_s * 1000:.0f} ms, transfer to the next {st.transfer_s * 1000:.0f} ms"
            )
        record.notes.append(
            f"pipeline of {len(plan.stages)} stage(s): {plan.step_s * 1000:.0f} ms per step"
            + (
                f" vs {single.step_s * 1000:.0f} ms on the best single cluster"
                if single is not None
                else "; the model fits no single cluster"
            )
            + f" (reference compute {compute_ref:.2f} s per step)"
        )
        return self.finish(state, decision, record, apply=apply)

    def run_post_filters(self, state: CycleState, record: DecisionRecord) -> Decision | None:
        """Post-filters in order (preemption) until one makes room."""
        # The running jobs as they were: a post-filter that stops some lists the rest anew.
        before = state.snapshot.running
        for post in self.post_filters:
            if post.name in state.skipped:
                continue
            try:
                decision = post.post_filter(state, self)
            except Exception as exc:  # a plugin bug must not fail the whole cycle
                record.notes.append(f"{post.name} failed: {type(exc).__name__}: {exc}")
                continue
            if decision is not None:
                decision.room_by = post.name
                # The record is the job's tenant's to read (`loom explain`): another tenant's job is
                # counted, never named (its id told one tenant what another runs).
                mine = state.job.tenant
                named_ids = {*decision.victims, *(j for j, _, _ in decision.shrunk)}
                tenant_of = {r.job_id: r.tenant for r in before if r.job_id in named_ids} if named_ids else {}
                if decision.victims:
                    own = [v for v in decision.victims if tenant_of.get(v) == mine]
                    others = len(decision.victims) - len(own)
                    named = own + ([f"{others} job(s) of other tenants"] if others else [])
                    record.notes.append(f"{post.name}: made room by stopping {', '.join(named)}")
                    record.victims = named
                for job_id, workers, _ in decision.shrunk:
                    who = job_id if tenant_of.get(job_id) == mine else "a job of another tenant"
                    record.notes.append(f"{post.name}: made room by shrinking {who} to {workers} worker(s)")
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
                return _named(status, plugin.name)
        if not _any(state.cluster_mask):
            return Status(Code.UNSCHEDULABLE, "no cluster is allowed for this job", "pre_filter")
        return SUCCESS

    def prune_hierarchically(self, state: CycleState) -> None:
        """Region -> zone -> cluster pruning from aggregates, before any node is looked at."""
        snap = state.snapshot
        if not snap.clusters:
            return
        need = state.per_worker * (1 if self._may_split(state) else state.min_workers)
        models = state.model_mask[: snap.free_sum.shape[1]]
        if models.all():
            free = snap.free_sum.sum(axis=1)
            biggest = snap.max_free.max(axis=1)
        else:
            free = (snap.free_sum * models).sum(axis=1)
            biggest = (snap.max_free * models).max(axis=1)
        if int(_min(free)) >= need and int(_min(biggest)) >= state.per_worker:
            return  # every cluster (so every zone and region) has the GPUs: nothing to prune
        if snap.closed:  # said as what they are, not as "0 free" (their nodes are unschedulable)
            shut = np.zeros(len(snap.clusters), np.bool_)
            shut[[snap.cluster_index[c] for c in snap.closed if c in snap.cluster_index]] = True
            state.prune(shut, lambda c: f"{snap.closed[snap.clusters[c].id]}: it takes no new work now")
        # Named by model when the job restricts them: a zone full of free T4s is not "short of
        # GPUs" for a job that needs V100s, it has none of those free.
        kind = (
            "GPUs"
            if models.all()
            else "/".join(snap.models[m] for m in np.flatnonzero(models).tolist()) + " GPUs"
        )
        region_free = np.bincount(snap.cluster_region, weights=free, minlength=len(snap.regions))
        region_free = region_free.astype(np.int64)
        poor_regions = region_free[snap.cluster_region] < need

        # "0 free" reads as all busy: a region, zone or cluster with none of those GPUs at all is
        # said to have none.
        held_by_region = held_by_zone = held = None
        zone_free = np.bincount(snap.cluster_zone, weights=free, minlength=snap.zone_count).astype(np.int64)
        if (free == 0).any():
            held = (snap.total_sum * models).sum(axis=1)
            held_by_region = np.bincount(snap.cluster_region, weights=held, minlength=len(snap.regions))
            held_by_zone = np.bincount(snap.cluster_zone, weights=held, minlength=snap.zone_count)

        def reason(level: str, name: str, index: int, free_at: IntArray, held_at: IntArray | None) -> str:
            if held_at is not None and not held_at[index]:
                return f"{level} {name} has no {kind}; the job needs {need}"
            return f"{level} {name} has {free_at[index]} free {kind}; the job needs {need}"

        state.prune(
            poor_regions,
            lambda c: reason(
                "region", snap.region_of(c), snap.cluster_region[c], region_free, held_by_region
            ),
        )
        state.prune(
            zone_free[snap.cluster_zone] < need,
            lambda c: reason("zone", snap.clusters[c].zone, snap.cluster_zone[c], zone_free, held_by_zone),
        )
        state.prune(
            free < need,
            lambda c: (
                f"no {kind} here; the job needs {need}"
                if held is not None and not held[c]
                else f"{free[c]} free {kind}; the job needs {need}"
            ),
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
        """Per (cluster, model) still allowed: filter its nodes and count the workers that fit.

        The workers each pool holds come from :meth:`pool_workers` (per job shape, recomputed only
        for the pools that changed); a pair's nodes are looked up only when a decision packs onto it.
        """
        snap = state.snapshot
        g = state.per_worker
        need = max(min_capacity if min_capacity is not None else state.min_workers, 1)
        m_count = snap.free_sum.shape[1]
        pair_ok = state.cluster_mask[:, None] & state.model_mask[None, :m_count] & (snap.max_free >= g)
        looked = pair_ok.ravel().nonzero()[0]
        cap_looked = self.pool_workers(state, looked)
        fits = cap_looked >= need
        ok_pairs = looked[fits]
        short = (~fits).nonzero()[0]
        if short.size:
            what = self._filter_needs(state)
            for k in short.tolist():
                c, m = divmod(int(looked[k]), m_count)
                cid = snap.clusters[c].id
                if cid not in state.pruned:
                    state.pruned[cid] = _filter_reason(snap.models[m], int(cap_looked[k]), need, what)
        cap = cap_looked[fits]
        shared = self._shared
        shape = self._shape(state) if shared is not None else None

        def nodes(c: int, m: int) -> tuple[IntArray, IntArray]:
            if shape is not None and shared is not None:
                return self._pool_nodes(state, shape, shared, c * m_count + m)
            pool = snap.pool(c, m)
            room = self._node_workers(state, pool)
            keep = np.flatnonzero(room)
            return keep + pool.start, room[keep]

        return Candidates(
            cluster=ok_pairs // m_count,
            model=ok_pairs % m_count,
            capacity=cap,
            workers=np.minimum(cap, state.target_workers),
            nodes=nodes,
        )

    def pool_workers(self, state: CycleState, pools: IntArray) -> IntArray:
        """Workers of the job's shape each of ``pools`` holds now (pool ``cluster x models + model``).

        Kept per snapshot and job shape (GPUs per worker, and what each filter reads of the job:
        :meth:`_shape`), with the snapshot's pool versions at the time: a later job of the same shape
        recounts only the pools whose nodes changed since. A filter without ``filter_key`` is not
        known to depend only on the shape, so then ``pools`` are counted afresh every time.
        """
        snap = state.snapshot
        shape = self._shape(state)
        if shape is None:
            return self._count_pools(state, pools)
        held = self._pool_workers.setdefault(snap, OrderedDict())
        found = held.get(shape)
        if found is None or found[0].size != snap.pool_version.size:
            workers = _sum_by_pool(snap, self._node_workers(state, slice(0, snap.free.size)))
            found = (snap.pool_version.copy(), workers)
        else:
            held.move_to_end(shape)
            versions, workers = found
            stale = (versions != snap.pool_version).nonzero()[0]
            shared = self._shared
            if shared is not None and 0 < stale.size <= _FEW_POOLS:
                # a few pools changed (the last decisions'): count them node by node, and keep
                # their nodes for packing (the pool a job goes to is often the last one's)
                for p in stale.tolist():
                    workers[p] = int(self._pool_nodes(state, shape, shared, p)[1].sum(dtype=np.int64))
                    versions[p] = snap.pool_version[p]
            elif stale.size:
                workers[stale] = self._count_pools(state, stale)
                versions[stale] = snap.pool_version[stale]
        held[shape] = found
        while len(held) > _SHAPES_KEPT:
            held.popitem(last=False)
        return found[1][pools]

    def _pool_nodes(
        self, state: CycleState, shape: Hashable, shared: dict[Hashable, Any], p: int
    ) -> tuple[IntArray, IntArray]:
        """Pool ``p``'s nodes that take a worker of the job's shape and the workers each can take,
        kept within a cycle per shape and pool while the pool's version stays (its nodes did not
        change; equal shapes: equal answers, see :meth:`pool_workers`)."""
        snap = state.snapshot
        version = int(snap.pool_version[p])
        key = ("pool_nodes", shape, p)
        held = shared.get(key)
        if held is not None and held[0] == version:
            found: tuple[IntArray, IntArray] = held[1]
            return found
        lo = int(snap.pool_bounds[p])
        room = self._node_workers(state, slice(lo, int(snap.pool_bounds[p + 1])))
        keep = room.nonzero()[0]
        found = (keep + lo, room[keep])
        shared[key] = (version, found)
        return found

    def _count_pools(self, state: CycleState, pools: IntArray) -> IntArray:
        """Workers each of ``pools`` holds, counted node by node (one pass over their nodes)."""
        snap = state.snapshot
        lo, hi = snap.pool_bounds[pools], snap.pool_bounds[pools + 1]
        sizes = hi - lo
        # every pool's nodes in one index array, then one sum per pool
        nodes = np.repeat(lo - np.cumsum(sizes) + sizes, sizes) + np.arange(int(sizes.sum()))
        per = self._node_workers(state, nodes)
        return np.bincount(np.repeat(np.arange(pools.size), sizes), per, pools.size).astype(np.int64)

    def _shape(self, state: CycleState) -> Hashable | None:
        """What the workers per node depend on besides the nodes: GPUs, CPU and memory per worker
        and every active filter's ``filter_key``; None when a filter has none."""
        res = state.job.resources
        parts: list[Hashable] = [state.per_worker, res.cpu_milli, res.memory_mib]
        for plugin in self.filters:
            if plugin.name in state.skipped:
                continue
            key_of = getattr(plugin, "filter_key", None)
            key = key_of(state) if key_of is not None else None
            if key is None:
                return None
            parts.append((plugin.name, key))
        return tuple(parts)

    def _node_workers(self, state: CycleState, nodes: "IntArray | slice") -> IntArray:
        """Workers each of ``nodes`` can take: 0 unless it is schedulable, has a worker's GPUs free
        and passes every filter; else its free GPUs, CPU and memory over a worker's."""
        snap = state.snapshot
        g = state.per_worker
        cpu, mem = state.job.resources.cpu_milli, state.job.resources.memory_mib
        free = snap.free[nodes]
        per_node = snap.room(nodes, g, cpu, mem)
        ok = snap.schedulable[nodes] & (free >= g)
        candidates = ok.nonzero()[0]
        if candidates.size:
            index = candidates + nodes.start if isinstance(nodes, slice) else nodes[candidates]
            mask = np.ones(candidates.size, dtype=np.bool_)
            for plugin in self.filters:
                if plugin.name not in state.skipped:
                    mask &= plugin.filter(state, index)
            ok[candidates[~mask]] = False
        return np.where(ok, per_node, 0)

    def _filter_needs(self, state: CycleState) -> str:
        """What the filters ask of a node for this job, in words (the same for every pair)."""
        return "; ".join(p.describe(state) for p in self.filters if p.name not in state.skipped)

    # PLR0912/0915: each scorer's reuse within a cycle (raw, normalised, weighted) is one branch
    # of the same loop; split, the cached and fresh paths would drift apart.
    def score(  # noqa: PLR0912, PLR0915
        self, state: CycleState, candidates: Candidates, record: DecisionRecord | None = None
    ) -> FloatArray:
        """Weighted mean of every score plugin's normalised score per candidate (0-100).

        Within :meth:`schedule_many`, a plugin with ``score_key`` (see :class:`ScorePlugin`) whose key
        and candidates (clusters, models, workers) equal an earlier job's of the same cycle reuses
        that job's raw scores, and with an equal ``normalize_key`` its normalised ones."""
        k = len(candidates)
        cycle = self._cycle
        names: list[str] = []
        raws: list[FloatArray] = []
        norms: list[FloatArray] = []
        total: FloatArray | None = None
        weight_sum = 0.0
        fresh: list[tuple[str, FloatArray]] = []
        """The scores normalised afresh for this job (not reused from an earlier job's)."""
        for plugin, key_of, norm_key_of in self._scorer_info:
            name = plugin.name
            if name in state.skipped:
                continue
            w = self.weights.get(name, 1.0)
            key: Hashable | None = None
            held: _ScoreEntry | None = None
            signature: tuple[bytes, bytes, bytes] | None = None
            norm_key: Hashable | None = None
            if cycle is not None and key_of is not None:
                key = key_of(state)
                if key is not None:
                    signature = candidates.signature()
                    held = cycle.get((name, key))
                    if held is not None and held.signature != signature:
                        held = None
                    if norm_key_of is not None:
                        norm_key = norm_key_of(state)
            if (
                held is not None
                and held.norm is not None
                and norm_key is not None
                and held.norm_key == norm_key
            ):
                raw, norm = held.raw, held.norm
                weighted = held.weighted if held.weight == w else (w * norm if w > 0 else None)
            else:
                if held is not None:
                    raw = held.raw
                else:
                    raw = np.asarray(plugin.score(state, candidates), dtype=np.float64)
                norm = np.asarray(plugin.normalize(state, raw), dtype=np.float64)
                if norm.shape != (k,):
                    raise ValueError(f"plugin {name} produced scores outside 0-100: {norm!r}")
                fresh.append((name, norm))  # their range is checked at once, after the loop
                weighted = w * norm if w > 0 else None
                if key is not None and cycle is not None and signature is not None:
                    kept = norm_key is not None
                    cycle[(name, key)] = _ScoreEntry(
                        signature,
                        raw,
                        norm_key,
                        norm if kept else None,
                        weighted if kept else None,
                        w,
                    )
            names.append(name)
            raws.append(raw)
            norms.append(norm)
            if weighted is not None:
                # one plugin after another, as a running sum (the order of the additions is kept)
                total = weighted + 0.0 if total is None else np.add(total, weighted, out=total)
                weight_sum += w
        if k and fresh:
            _check_range(fresh)
        if total is not None and weight_sum > 0:
            totals: FloatArray = total / weight_sum
        else:
            totals = np.full(k, 100.0)
        if record is not None and k:
            self._record_candidates(state, candidates, totals, names, raws, norms, record)
        return totals

    def _record_candidates(  # noqa: PLR0917
        self,
        state: CycleState,
        candidates: Candidates,
        totals: FloatArray,
        names: list[str],
        raws: list[FloatArray],
        norms: list[FloatArray],
        record: DecisionRecord,
    ) -> None:
        """The best ``record_top`` candidates into the record, with every plugin's scores, as
        columns (:class:`CandidateTable`; the per-candidate objects are built only if read)."""
        snap = state.snapshot
        k = len(candidates)
        order = np.lexsort((candidates.model, candidates.cluster, -totals.round(9)))
        self._order = (totals, order)
        top = order[: self.record_top]
        p = len(names)
        scores: list[list[float]] = []
        raw: FloatArray | list[list[float]] = []
        if p:
            both = np.concatenate(norms + raws).reshape(2 * p, k)[:, top]
            raw = both[p:]  # non-finite values become 0 when first read (CandidateTable.raw)
            scores = both[:p].round(2).tolist()
        ids, regions = self._cluster_names(snap)
        # a column at a time: cheaper than stacking the three and indexing once
        clusters = candidates.cluster[top].tolist()
        models = snap.models
        record.add_table(
            CandidateTable(
                tuple(names),
                list(map(ids.__getitem__, clusters)),
                list(map(regions.__getitem__, clusters)),
                list(map(models.__getitem__, candidates.model[top].tolist())),
                candidates.capacity[top].tolist(),
                totals[top].round(2).tolist(),
                scores,
                raw,
            )
        )
        record.considered = max(record.considered, k)

    def _cluster_names(self, snap: Snapshot) -> tuple[list[str], list[str]]:
        """The snapshot's cluster ids and regions by index (kept within a cycle)."""
        shared = self._shared
        held = shared.get("record.cluster_names") if shared is not None else None
        if held is not None and held[0] is snap.clusters:
            names: tuple[list[str], list[str]] = held[1]
            return names
        names = ([c.id for c in snap.clusters], [c.region for c in snap.clusters])
        if shared is not None:
            shared["record.cluster_names"] = (snap.clusters, names)
        return names

    def choose(self, state: CycleState, candidates: Candidates, totals: FloatArray) -> Decision:
        """The best candidate (ties: lowest cluster id, then model), packed onto its nodes.

        Cluster indices follow cluster ids (the snapshot sorts them), so index order is id order.
        """
        held = self._order
        if held is not None and held[0] is totals:
            best = int(held[1][0])  # the order the record was built from (same totals, same keys)
        else:
            best = int(np.lexsort((candidates.model, candidates.cluster, -np.round(totals, 9)))[0])
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
        return self._spread_from(state, candidates, totals, _by_score(state, candidates, totals))

    def _spread_from(
        self, state: CycleState, candidates: Candidates, totals: FloatArray, order: Sequence[int]
    ) -> Decision | None:
        """The spread taking candidates in ``order`` (:meth:`_spread_in_order`); where that leaves
        the gang short, each cluster's largest pool first."""
        decision = self._spread_in_order(state, candidates, totals, order)
        if decision is None:
            # One GPU model per cluster: the best-scored pool of a cluster may be too small where
            # another of its pools would have completed the gang. Then take each cluster's largest
            # pool first (what why_nothing_fits counts), so a gang that fits is never left waiting.
            by_room = sorted(order, key=lambda i: -int(candidates.capacity[i]))
            decision = self._spread_in_order(state, candidates, totals, by_room)
        return decision

    def banded_spreads(
        self, state: CycleState, candidates: Candidates, totals: FloatArray, tried: Decision
    ) -> list[Decision]:
        """Spreads to try when the best-scored spread (``tried``) was refused: one per subset of
        the candidates that a plugin proposes (``spread_subsets(state, candidates)``, best first;
        the span guard proposes GPUs of like speed in regions with a good link), each built as
        :meth:`spread` builds one (:meth:`_spread_from`) from the subset's candidates.
        At most ``MAX_BANDED_SPREADS``, none on the same pools as ``tried`` or each other.

        Synchronous data parallelism runs at its slowest part's pace, so a spread that mixes GPUs
        of different speeds holds the fast ones idle part of each step, and one over a slow link
        holds all of them: the span guard bounds both. The best-scored spread takes the
        best-scored pools first and fills up with whatever is left (an evaluator's platform:
        16 G2 GPUs beside P100s 7x slower for the job, held 11 h), while a spread of like GPUs
        within the bound had room."""
        if not self.spreaders or len(candidates) == 0:
            return []
        by_score = _by_score(state, candidates, totals)
        seen = {_pools_of(tried)}
        found: list[Decision] = []
        for plugin in self.spreaders:
            if plugin.name in state.skipped:
                continue
            for inside in plugin.spread_subsets(state, candidates):
                decision = self._spread_from(state, candidates, totals, [i for i in by_score if inside[i]])
                if decision is None or _pools_of(decision) in seen:
                    continue
                seen.add(_pools_of(decision))
                found.append(decision)
                if len(found) >= MAX_BANDED_SPREADS:
                    return found
        return found

    def _banded_spread(
        self,
        state: CycleState,
        candidates: Candidates | None,
        totals: FloatArray,
        tried: Decision,
        record: DecisionRecord,
        *,
        apply: bool,
    ) -> Outcome | None:
        """The first of :meth:`banded_spreads` that reserve, permit and bind accept, as its
        outcome; None when none is, with the record (reason, notes) and the clusters ruled out as
        the refusal of ``tried`` left them."""
        if candidates is None:
            return None
        reason, was_refused, outcome_word = record.reason, record.refused, record.outcome
        pruned, notes = dict(state.pruned), list(record.notes)
        for decision in self.banded_spreads(state, candidates, totals, tried):
            for part in decision.parts:
                state.pruned.pop(part.cluster, None)
            outcome = self.finish(state, decision, record, apply=apply)
            if outcome.decision is not None:
                record.notes.append(
                    f"the best-scored spread was refused; spread over {len(decision.parts)} clusters"
                    " of like GPUs instead"
                )
                return self._settled(decision, outcome)
            self._settled(decision, outcome)
            state.pruned.clear()  # the record holds this very dict
            state.pruned.update(pruned)
            record.notes[:] = notes
        record.reason, record.refused, record.outcome = reason, was_refused, outcome_word
        return None

    def _spread_in_order(
        self, state: CycleState, candidates: Candidates, totals: FloatArray, order: Sequence[int]
    ) -> Decision | None:
        """The spread taking candidates in ``order``, the first of each cluster only."""
        parts: list[Part] = []
        used_clusters: set[int] = set()
        left = state.target_workers
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
        """``workers`` workers on candidate ``i``'s nodes: as few nodes as possible, and the workers
        that do not fill a node on the tightest node that holds them all (best fit).

        Nodes are taken most room first while the workers still left need more than one node; the
        rest (all of a job smaller than a node) goes to the node with the least room that still
        holds it, so small jobs fill partly used nodes and leave empty ones whole for gangs of
        whole-node workers (most room first alone would put every small job on an empty node)."""
        snap = state.snapshot
        nodes, room = candidates.nodes_of(i)
        allocations = [
            (snap.node_ids[node], count * state.per_worker)
            for node, count in pack_workers(nodes, room, workers)
        ]
        c, m = int(candidates.cluster[i]), int(candidates.model[i])
        return Part(
            cluster=snap.clusters[c].id,
            region=snap.clusters[c].region,
            gpu_model=snap.models[m],
            allocations=tuple(allocations),
        )

    # PLR0912: reserve, permit, bind in order; every refusal unreserves.
    def finish(  # noqa: PLR0912
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
                return self._refuse(record, decision, _named(status, plugin.name))
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
                return self._refuse(record, decision, _named(status, permit.name))
        for binder in self.binders:
            if binder.name in state.skipped:
                continue
            status = binder.bind(state, decision)
            if not status.ok:
                for r in reversed(done):
                    r.unreserve(state, decision)
                return self._refuse(record, decision, _named(status, binder.name))
        if apply:
            for part in decision.parts:
                state.snapshot.take(
                    part.allocations,
                    state.per_worker,
                    state.job.resources.cpu_milli,
                    state.job.resources.memory_mib,
                )
            if state.snapshot.quota is not None:
                # The tenant's quota counts the decision at once (the next job's check sees it).
                state.snapshot.quota.take(state.job.tenant, sum(g for _, g in decision.allocations))
        record.outcome = "placed"
        record.chosen = [p.cluster for p in decision.parts]
        record.reason = _placed_reason(decision)
        return Outcome(SUCCESS, decision, record)

    def wanted_pools(self, job: JobSpec, snap: Snapshot) -> set[tuple[str, str]]:
        """The pools (cluster id, GPU model) holding GPUs ``job`` could use as its pre-filters
        allow (its affinity, GPU models, memory...), whatever is free now; none when it could
        never run. Where a pre-filter stops short (a job over its quota now), the pools as far as
        the filters before it narrowed them: more, never fewer. Elastic growth leaves these to
        the queued job (:func:`loom.sched.cycle.grow`). A job queued with its shape
        (``Snapshot.queued``) has its allowed pools there already: its pre-filters are not run again."""
        shape = snap.queued.get(job.job_id)
        if shape is not None:
            allowed = shape.pools
        else:
            state = self.new_state(job, snap)
            if self.run_pre_filters(state).code == Code.UNRESOLVABLE:
                return set()
            allowed = state.allowed_pools()
        found = zip(*np.nonzero(allowed & (snap.total_sum > 0)), strict=True)
        return {(snap.clusters[int(c)].id, snap.models[int(m)]) for c, m in found}

    def stage_never_fits(self, stages: Mapping[str, JobSpec], snap: Snapshot) -> tuple[str, Status] | None:
        """The first of a DAG's stages (name -> its job, in order) that could never run as asked on
        ``snap`` (:meth:`never_fits`), with why; None when each could. Placement refuses such a DAG
        whole at admission, and the simulator by the same rule."""
        for name, job in stages.items():
            status = self.never_fits(job, snap)
            if status is not None:
                return name, status
        return None

    def never_fits(self, job: JobSpec, snap: Snapshot) -> Status | None:
        """The UNRESOLVABLE status when ``job`` could not run as asked even on an empty platform
        (a pre-filter's refusal, or no allowed cluster ever holding it: :meth:`why_nothing_fits`),
        else None. Reads ``snap``, changes nothing. A pipeline is planned when it runs: None.
        Placement asks it of a DAG's stages at admission: a stage that could never run was found
        only when its turn came, after the stages before it had run (a newcomer's walk)."""
        if job.pipeline is not None:
            return None
        state = self.new_state(job, snap)
        status = self.run_pre_filters(state)
        if not status.ok:
            return status if status.code == Code.UNRESOLVABLE else None
        state.policy_mask = state.cluster_mask.copy()  # what the job allows, whatever is free now
        why = self.why_nothing_fits(state)
        return why if why.code == Code.UNRESOLVABLE else None

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
        allowed = state.policy_mask if state.policy_mask is not None else state.cluster_mask
        if state.held_off is not None:
            # Ruled out only while a job runs there: a gang kept apart from a job on the one
            # cluster with nodes large enough was rejected as "can never fit" (a review of the
            # service against the simulator).
            allowed = allowed | state.held_off
        # Capacity with every node empty (unschedulable nodes may come back), allowed clusters only.
        m_count = snap.total_sum.shape[1]
        split = self._may_split(state)
        in_scope = np.repeat((allowed[:, None] & models[None, :]).ravel(), np.diff(snap.pool_bounds))
        largest_node = int(snap.total[in_scope].max(initial=0))
        per_pair = np.bincount(
            snap.pool_of[in_scope],
            weights=(snap.total // g)[in_scope],
            minlength=len(snap.clusters) * m_count,
        ).astype(np.int64)
        if split and state.job.pipeline is None:
            # A spread gang takes one GPU model per cluster (see :meth:`spread`): what it could ever
            # get is each allowed cluster's best pool, not every pool of it.
            platform_workers = int(per_pair.reshape(len(snap.clusters), m_count).max(axis=1, initial=0).sum())
        else:
            platform_workers = int(per_pair.sum())
        best = int(np.argmax(per_pair)) if per_pair.size else 0
        best_workers = int(per_pair[best]) if per_pair.size else 0
        best_where = (
            f"{snap.clusters[best // m_count].id} ({snap.models[best % m_count]})" if best_workers else ""
        )
        base = f"{need} worker(s) x {g} GPU(s)"
        if largest_node == 0:
            return Status(
                Code.UNRESOLVABLE,
                f"no allowed cluster has GPUs of the allowed models for {base};"
                " allow other models or clusters",
                "framework",
                hint="allow other models or clusters",
            )
        if g > largest_node:
            return Status(
                Code.UNRESOLVABLE,
                f"{base} can never fit: the largest node has {largest_node} GPUs of an allowed model;"
                f" ask for at most {largest_node} per worker",
                "framework",
                hint=f"ask for at most {largest_node} GPUs per worker",
            )
        fits_somewhere = platform_workers >= need if split else best_workers >= need
        if not fits_somewhere:
            hint = (
                f"the allowed clusters hold {platform_workers} such worker(s)"
                + (" (a spread uses one GPU model per cluster)" if state.job.pipeline is None else "")
                if split
                else f"the most any cluster holds is {best_workers} worker(s) on {best_where};"
                " ask for fewer workers or allow the gang to span clusters (allow_multi_cluster)"
            )
            return Status(Code.UNRESOLVABLE, f"{base} can never fit; {hint}", "framework", hint=hint)
        closed = self._closed_holders(state, in_scope, split=split, m_count=m_count)
        if closed:
            return Status(
                Code.UNSCHEDULABLE,
                f"{base} would fit, but only with nodes that take no new work now ({closed});"
                " waiting until they do",
                "framework",
            )
        reasons = "; ".join(f"{k}: {v}" for k, v in sorted(state.pruned.items())[:6])
        return Status(
            Code.UNSCHEDULABLE,
            f"{base} would fit but the GPUs are taken now; waiting for capacity"
            + (f" ({reasons})" if reasons else ""),
            "framework",
        )

    def _closed_holders(self, state: CycleState, in_scope: BoolArray, *, split: bool, m_count: int) -> str:
        """When the job fits an empty platform only by counting nodes that take no new work (a
        drained or failed cluster, a cordoned or suspect node): those nodes' clusters with why
        (:attr:`Snapshot.closed`), e.g. ``"c-weu-a drained"``; empty when the schedulable nodes
        alone could hold it (then it waits for GPUs taken now)."""
        snap = state.snapshot
        g, need = state.per_worker, state.min_workers
        up_workers = np.where(snap.schedulable, snap.total // g, 0)[in_scope]
        per_pair = np.bincount(
            snap.pool_of[in_scope], weights=up_workers, minlength=len(snap.clusters) * m_count
        ).astype(np.int64)
        if split and state.job.pipeline is None:
            fits = int(per_pair.reshape(len(snap.clusters), m_count).max(axis=1, initial=0).sum()) >= need
        elif split:
            fits = int(per_pair.sum()) >= need
        else:
            fits = int(per_pair.max(initial=0)) >= need
        if fits:
            return ""
        down = in_scope & ~snap.schedulable & (snap.total >= g)
        clusters = sorted({int(p) // m_count for p in snap.pool_of[down]})
        names = []
        for c in clusters[:6]:
            cid = snap.clusters[c].id
            why = snap.closed.get(cid, "nodes unschedulable: `loom status` says which and why")
            names.append(f"{cid} {why}")
        more = f" and {len(clusters) - 6} more" if len(clusters) > 6 else ""
        return ", ".join(names) + more

    def _refuse(self, record: DecisionRecord, decision: Decision, status: Status) -> Outcome:
        """A reserve, permit or bind plugin refused ``decision``: noted on the record when the
        decision made room (``DecisionRecord.refused``), then failed as :meth:`_fail`."""
        record.refused = bool(decision.victims or decision.shrunk)
        return self._fail(record, status)

    def _fail(self, record: DecisionRecord, status: Status) -> Outcome:
        record.outcome = "rejected" if status.code == Code.UNRESOLVABLE else "waiting"
        record.reason = f"{status.plugin}: {status.reason}" if status.plugin else status.reason
        return Outcome(status, None, record)


def _by_score(state: CycleState, candidates: Candidates, totals: FloatArray) -> list[int]:
    """Candidate positions, best total score first (ties by cluster id)."""
    clusters = state.snapshot.clusters
    return sorted(
        range(len(candidates)),
        key=lambda i: (-round(float(totals[i]), 9), clusters[int(candidates.cluster[i])].id),
    )


def _pools_of(decision: Decision) -> tuple[tuple[str, str, int], ...]:
    """A spread's pools and the workers' GPUs on each, to tell spreads apart."""
    return tuple(sorted((p.cluster, p.gpu_model, sum(g for _, g in p.allocations)) for p in decision.parts))


@dataclass(frozen=True, slots=True)
class _ScoreEntry:
    """One plugin's scores for one ``score_key`` within a cycle, and the candidates they are for."""

    signature: tuple[bytes, bytes, bytes]
    """The candidates' cluster, model and workers arrays, as bytes."""
    raw: FloatArray
    norm_key: Hashable | None
    """The plugin's ``normalize_key`` when ``norm`` was computed."""
    norm: FloatArray | None
    """Normalised scores (None unless the plugin has a ``normalize_key``)."""
    weighted: FloatArray | None
    """``weight x norm`` (None unless ``norm`` is kept and the weight is positive)."""
    weight: float


def _check_range(fresh: list[tuple[str, FloatArray]]) -> None:
    """Every score in 0-100, else a ValueError naming the first plugin (in order) out of range.

    All at once (one pass over every plugin's scores): NaN fails both comparisons, so two
    reductions check finiteness and range together; only a failure looks at each plugin."""
    every = fresh[0][1] if len(fresh) == 1 else np.concatenate([norm for _, norm in fresh])
    if _min(every) >= -1e-9 and _max(every) <= 100 + 1e-9:
        return
    for name, norm in fresh:
        if not (_min(norm) >= -1e-9 and _max(norm) <= 100 + 1e-9):
            raise ValueError(f"plugin {name} produced scores outside 0-100: {norm!r}")


def _named(status: Status, name: str) -> Status:
    return status if status.plugin else dataclasses.replace(status, plugin=name)


_KeyOf = Callable[[CycleState], Hashable | None]

# The reductions without numpy's Python-level wrappers (same results; hot paths of a cycle).
_min = np.minimum.reduce
_max = np.maximum.reduce
_any = np.logical_or.reduce

_FEW_POOLS = 2
"""Changed pools recounted one by one (their nodes kept for packing) rather than all at once."""

_SHAPES_KEPT = 64
"""Job shapes whose workers per pool are kept per snapshot (the least recently used goes first)."""


def _sum_by_pool(snap: Snapshot, per_node: IntArray) -> IntArray:
    """Per pool, the sum of a figure given for every node."""
    pools = snap.pool_version.size
    return np.bincount(snap.pool_of, weights=per_node, minlength=pools).astype(np.int64)


class _SiteMode(enum.Enum):
    """Which GPUs a pipeline site lists: free now, or as if idle (all, or on schedulable nodes)."""

    FREE = "free"
    IDLE = "idle"
    IDLE_SCHEDULABLE = "idle_schedulable"


_SiteCache = dict[tuple[_SiteMode, int, int], tuple[IntArray, pipeline.Site]]

_SITES: "weakref.WeakKeyDictionary[Snapshot, _SiteCache]" = weakref.WeakKeyDictionary()
"""Per snapshot, the last site built of each pool (per :class:`_SiteMode`) and the GPUs it lists:
pipeline jobs come one after another while most pools stay as they were, and a site holds every node
of its pool with GPUs, so one equal to the last is not built again."""


def _stage_gpus(
    snap: Snapshot, nodes: "IntArray | slice", mode: _SiteMode, cpu_milli: int, memory_mib: int
) -> IntArray:
    """GPUs each of ``nodes`` can give pipeline stages in ``mode`` (free ones, or all of them when
    idle; schedulable nodes only unless ``IDLE``), each GPU asking ``cpu_milli`` / ``memory_mib``
    of the node's (free, or all when idle; a node whose CPU or RAM is unknown is limited by GPUs)."""
    if mode is _SiteMode.IDLE:
        gpus = snap.total[nodes]
    else:
        gpus = np.where(
            snap.schedulable[nodes],
            snap.total[nodes] if mode is _SiteMode.IDLE_SCHEDULABLE else snap.free[nodes],
            0,
        )
    if cpu_milli:
        cpu = snap.cpu_free[nodes] if mode is _SiteMode.FREE else snap.cpu_cap[nodes]
        gpus = np.where(snap.cpu_known[nodes], np.minimum(gpus, cpu // cpu_milli), gpus)
    if memory_mib:
        mem = snap.mem_free[nodes] if mode is _SiteMode.FREE else snap.mem_cap[nodes]
        gpus = np.where(snap.mem_known[nodes], np.minimum(gpus, mem // memory_mib), gpus)
    return np.asarray(gpus, dtype=np.int64)


def _site(
    snap: Snapshot,
    c: int,
    m: int,
    mode: _SiteMode,
    *,
    speed_per_gpu: float,
    memory_gib: float,
    cpu_milli: int = 0,
    memory_mib: int = 0,
    cache: _SiteCache | None = None,
) -> pipeline.Site:
    """Pool (c, m) as a pipeline site: its nodes that have GPUs to give in ``mode``, each as many
    as its CPU and RAM allow a stage's GPUs of ``cpu_milli`` / ``memory_mib`` each (free ones, or
    all of them when idle). Before, a stage of three GPUs asking 30 cores each went to a node of
    32 cores."""
    pool = snap.pool(c, m)
    gpus = _stage_gpus(snap, pool, mode, cpu_milli, memory_mib)
    held = cache.get((mode, c, m)) if cache is not None else None
    if (
        held is not None
        and held[1].speed_per_gpu == speed_per_gpu
        and held[1].gpu_memory_gib == memory_gib
        and np.array_equal(held[0], gpus)
    ):
        return held[1]
    has = gpus != 0
    site = pipeline.Site(
        cluster=snap.clusters[c].id,
        region=snap.clusters[c].region,
        gpu_model=snap.models[m],
        speed_per_gpu=speed_per_gpu,
        gpu_memory_gib=memory_gib,
        free_gpus=tuple(
            zip(itertools.compress(snap.node_ids[pool], has.tolist()), gpus[has].tolist(), strict=True)
        ),
    )
    if cache is not None:
        cache[(mode, c, m)] = (gpus.copy(), site)
    return site


def pack_workers(nodes: IntArray, room: IntArray, workers: int) -> list[tuple[int, int]]:
    """Where :meth:`Framework.pack` puts ``workers`` workers on ``nodes`` (ascending, each with room
    for ``room`` workers): (node index, workers) in the order taken. One node that holds them all:
    the tightest that does (the first of equals); else nodes with most room first while the workers
    left need more than one, and the rest on the tightest node that holds it. ``rare_fit`` reads the
    same choice."""
    taken: list[tuple[int, int]] = []
    left = workers
    if workers > 0 and room.size and int(_max(room)) >= workers:
        # one node holds them all: the tightest that does (nodes ascend: the first of equals),
        # which is what the loop below picks at its first step
        holds = (room >= workers).nonzero()[0]
        j = int(holds[np.argmin(room[holds])])
        return [(int(nodes[j]), workers)]
    order: list[int] = np.lexsort((nodes, -room)).tolist() if left > 0 else []
    for pos, most in enumerate(order):
        if left <= 0:
            break
        j = most
        if room[most] >= left:
            rest = np.asarray(order[pos:], dtype=np.int64)
            holds = rest[room[rest] >= left]
            j = int(holds[np.lexsort((nodes[holds], room[holds]))[0]])
        fit = min(int(room[j]), left)
        taken.append((int(nodes[j]), fit))
        left -= fit
    return taken


def _filter_reason(model: str, fit: int, need: int, what: str) -> str:
    return f"{model}: room for {fit} worker(s), needs {need}" + (f" ({what})" if what else "")


def _placed_reason(decision: Decision) -> str:
    where = ", ".join(
        f"{p.cluster} ({p.gpu_model}, {sum(g for _, g in p.allocations)} GPUs)" for p in decision.parts
    )
    return f"placed {decision.workers} worker(s) on {where} with score {decision.score:.1f}"

"""The resource ledger: region -> zone -> cluster -> node, folded from agents' heartbeats.

Pure and synchronous: the metrics service feeds it heartbeats and persists what it returns; the
simulator and benchmarks use it directly. A heartbeat that is late, repeated or from the past of
an agent never rolls state back; a heartbeat that claims another cluster's node, or reports
impossible numbers, changes nothing of that node and is counted with its reason.
"""

import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loom_proto.clusters import ClusterHeartbeat, NodeState

MAX_CLOCK_SKEW_S = 300.0
"""A heartbeat stamped further in the future than this is refused."""

MIN_TTL_INTERVALS = 2.0
MAX_TTL_INTERVALS = 4.0
"""A cluster is stale after missing between 2 (volatile) and 4 (stable) of its declared intervals."""

VOLATILITY_ALPHA = 0.2
"""Weight of the newest heartbeat in a cluster's volatility (share of heartbeats carrying changes)."""


@dataclass(slots=True)
class LedgerNode:
    """A node as the ledger holds it."""

    node: str
    cluster: str
    region: str
    zone: str
    gpu_model: str | None
    gpus_total: int
    gpus_used: int
    cpu_milli: int
    memory_mib: int
    healthy: bool
    updated_at: float
    gpus_reserved: int = 0
    """Promised by placement, not yet confirmed started by the agent."""
    down: bool = False
    """Its agent reports it failed: the runs on it are lost (not merely closed to new work)."""

    @property
    def gpus_free(self) -> int:
        """GPUs neither used nor reserved (0 on an unhealthy node)."""
        return max(self.gpus_total - self.gpus_used - self.gpus_reserved, 0) if self.healthy else 0


@dataclass(slots=True)
class LedgerCluster:
    """A cluster: where it is, where its heartbeats stand, and whether it is fresh."""

    cluster: str
    region: str
    agent_epoch: int = 0
    last_seq: int = 0
    version: int = 0
    interval_s: float = 5.0
    last_heartbeat_at: float = 0.0
    stale: bool = False
    volatility: float = 1.0
    """EWMA of the share of heartbeats that changed something; a new cluster counts as volatile."""
    trust: float = 0.3
    """How far the cluster's claimed SCU is believed (progressive onboarding; see loom.model.scu)."""
    scu: dict[str, dict[str, float]] = field(default_factory=dict)
    """SCU of one GPU by model and task type, from the profiles the agent published."""
    nodes: set[str] = field(default_factory=set)

    def ttl_s(self) -> float:
        """How long without a heartbeat before the cluster is stale.

        A volatile cluster's information ages fast, so it goes stale after fewer missed
        intervals; a stable one is given more. The interval is the one the agent declared, which
        itself grows while the cluster is stable.
        """
        intervals = MAX_TTL_INTERVALS - (MAX_TTL_INTERVALS - MIN_TTL_INTERVALS) * self.volatility
        return intervals * self.interval_s


@dataclass(frozen=True, slots=True)
class Change:
    """What applying a heartbeat changed in one cluster, ready to persist and publish."""

    cluster: str
    region: str
    version: int
    full: bool
    nodes: tuple[LedgerNode, ...]
    removed: tuple[str, ...]
    stale: bool


@dataclass(frozen=True, slots=True)
class Applied:
    """The outcome of one heartbeat: a change (maybe empty), or why it was ignored."""

    change: Change | None
    ignored: str | None = None
    node_errors: tuple[str, ...] = ()


def _refresh(owner: LedgerNode, n: NodeState) -> bool:
    """Update a known node in place from its report; whether anything changed.

    In place: a 1,000-node delta must not allocate 1,000 new entries.
    """
    if (
        owner.gpus_used == n.gpus_used
        and owner.healthy == n.healthy
        and owner.down == n.down
        and owner.gpus_total == n.gpus_total
        and owner.gpu_model == n.gpu_model
        and owner.zone == n.zone
        and owner.cpu_milli == n.cpu_milli
        and owner.memory_mib == n.memory_mib
    ):
        return False
    owner.zone = sys.intern(n.zone)
    owner.gpu_model = sys.intern(n.gpu_model) if n.gpu_model else None
    owner.gpus_total = n.gpus_total
    owner.gpus_used = n.gpus_used
    owner.cpu_milli = n.cpu_milli
    owner.memory_mib = n.memory_mib
    owner.healthy = n.healthy
    owner.down = n.down
    return True


def _node_error(n: NodeState) -> str | None:
    if n.gpus_used > n.gpus_total:
        return f"node {n.node}: {n.gpus_used} GPUs used of {n.gpus_total}"
    if n.gpus_total > 0 and not n.gpu_model:
        return f"node {n.node}: {n.gpus_total} GPUs without a model"
    return None


class Ledger:
    """Every cluster and node, and counters of what was refused and why."""

    def __init__(self, *, known_models: frozenset[str] | None = None) -> None:
        self.clusters: dict[str, LedgerCluster] = {}
        self.nodes: dict[str, LedgerNode] = {}
        self.refused: Counter[str] = Counter()
        self.known_models = known_models
        """GPU models with a library profile (None: any model is admitted)."""
        self.published_models: dict[str, frozenset[str]] = {}
        """Per cluster, the GPU models it published a profile for (``loom calibrate``'s or the
        library's): a model outside :attr:`known_models` is admitted in a cluster that published one."""
        self.reservations: dict[str, tuple[tuple[str, int], ...]] = {}
        self.dirty_regions: set[str] = set()
        """Regions whose summary may have changed since :meth:`take_dirty_regions`."""
        """Placement's unconfirmed reservations by run (``job:attempt``): (node, gpus)."""

    def apply(self, hb: ClusterHeartbeat, now: float) -> Applied:
        """Fold one heartbeat in; ``now`` is the receiver's clock."""
        admitted = self._admit(hb, now)
        if isinstance(admitted, Applied):
            return admitted
        cluster = admitted
        # The whole list is re-published only when readers need it: the cluster is new, its agent
        # restarted, or it comes back from stale (a reader that closed its nodes when it went stale,
        # or a new leader that loaded them closed, must see every node's state again, not only
        # what this heartbeat changed). Otherwise only what changed goes out.
        was_stale, cluster.stale = cluster.stale, False
        republish_all = was_stale or (
            hb.full and (cluster.last_seq == 0 or hb.agent_epoch != cluster.agent_epoch)
        )
        cluster.agent_epoch, cluster.last_seq = hb.agent_epoch, hb.seq
        cluster.interval_s = hb.interval_s
        cluster.last_heartbeat_at = now

        changed: list[LedgerNode] = []
        errors: list[str] = []
        for n in hb.nodes:
            owner = self.nodes.get(n.node)
            problem = self._node_refusal(n, owner, hb.cluster)
            if problem is not None:
                errors.append(problem)
                continue
            if owner is not None:
                if _refresh(owner, n):
                    changed.append(owner)
                owner.updated_at = now
                continue
            entry = LedgerNode(
                node=n.node,
                # Shared strings: 100k nodes must not hold 100k copies of a cluster's names.
                cluster=cluster.cluster,
                region=cluster.region,
                zone=sys.intern(n.zone),
                gpu_model=sys.intern(n.gpu_model) if n.gpu_model else None,
                gpus_total=n.gpus_total,
                gpus_used=n.gpus_used,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
                healthy=n.healthy,
                updated_at=now,
                down=n.down,
            )
            changed.append(entry)
            self.nodes[n.node] = entry
            cluster.nodes.add(n.node)
        removed = [r for r in hb.removed if r in cluster.nodes]
        if hb.full:
            listed = {n.node for n in hb.nodes}
            removed += sorted(cluster.nodes - listed - set(removed))
        for name in removed:
            cluster.nodes.discard(name)
            self.nodes.pop(name, None)
        carried_change = bool(changed or removed)
        cluster.volatility += VOLATILITY_ALPHA * (float(carried_change) - cluster.volatility)
        if not changed and not removed and not was_stale and not republish_all:
            return Applied(None, None, tuple(errors))
        cluster.version += 1
        if republish_all:
            changed = [self.nodes[n] for n in sorted(cluster.nodes)]
        change = Change(
            hb.cluster, hb.region, cluster.version, republish_all, tuple(changed), tuple(removed), False
        )
        self.dirty_regions.add(cluster.region)
        return Applied(change, None, tuple(errors))

    def _admit(self, hb: ClusterHeartbeat, now: float) -> LedgerCluster | Applied:
        """The heartbeat's cluster (created when new), or the refusal of the whole heartbeat."""
        if hb.sent_at > now + MAX_CLOCK_SKEW_S:
            self.refused["clock_in_future"] += 1
            return Applied(None, f"sent_at is {hb.sent_at - now:.0f}s in the future")
        cluster = self.clusters.get(hb.cluster)
        if cluster is None:
            cluster = LedgerCluster(cluster=hb.cluster, region=hb.region)
            self.clusters[hb.cluster] = cluster
        elif cluster.region != hb.region:
            self.refused["region_changed"] += 1
            return Applied(None, f"cluster {hb.cluster} is in {cluster.region}, heartbeat says {hb.region}")
        if (hb.agent_epoch, hb.seq) <= (cluster.agent_epoch, cluster.last_seq):
            self.refused["out_of_order"] += 1
            return Applied(
                None,
                f"heartbeat ({hb.agent_epoch}, {hb.seq}) is not newer than "
                f"({cluster.agent_epoch}, {cluster.last_seq})",
            )
        if hb.agent_epoch != cluster.agent_epoch and not hb.full and cluster.last_seq != 0:
            # A restarted agent's first deltas cannot be trusted against the old run's state.
            self.refused["delta_from_new_epoch"] += 1
            return Applied(None, "first heartbeat of a new agent run must be a full snapshot")
        return cluster

    def _node_refusal(self, n: NodeState, owner: LedgerNode | None, cluster_id: str) -> str | None:
        """Why one reported node is refused (counted under its reason), or None when it is taken."""
        if owner is not None and owner.cluster != cluster_id:
            self.refused["node_of_other_cluster"] += 1
            return f"node {n.node} belongs to {owner.cluster}"
        problem = _node_error(n)
        if problem is not None:
            self.refused["impossible_node"] += 1
            return problem
        if (
            self.known_models is not None
            and n.gpu_model
            and n.gpu_model not in self.known_models
            and n.gpu_model not in self.published_models.get(cluster_id, frozenset())
        ):
            # Refused, not guessed: an unprofiled GPU counted at the reference's speed would
            # attract jobs on a promise nobody made.
            self.refused["unknown_gpu_model"] += 1
            return (
                f"node {n.node}: GPU model {n.gpu_model!r} has no library profile and cluster "
                f"{cluster_id} published no calibrated one; run `loom calibrate` on a node of "
                "this model and publish its profile, or name a known model"
            )
        return None

    def expire(self, now: float) -> list[Change]:
        """Mark clusters that missed their heartbeats stale; one change per newly stale cluster."""
        changes = []
        for cluster in self.clusters.values():
            if cluster.stale or cluster.last_heartbeat_at == 0.0:
                continue
            if now - cluster.last_heartbeat_at > cluster.ttl_s():
                cluster.stale = True
                cluster.version += 1
                self.dirty_regions.add(cluster.region)
                changes.append(Change(cluster.cluster, cluster.region, cluster.version, False, (), (), True))
        return changes

    def load(self, clusters: Iterable[LedgerCluster], nodes: Iterable[LedgerNode]) -> None:
        """Rebuild from persisted rows."""
        self.clusters = {c.cluster: c for c in clusters}
        self.nodes = {}
        for n in nodes:
            self.nodes[n.node] = n
            if n.cluster in self.clusters:
                self.clusters[n.cluster].nodes.add(n.node)
        self.dirty_regions = {c.region for c in self.clusters.values()}

    # ---- reservations -------------------------------------------------------------------------

    def reserve(self, run: str, allocations: Sequence[tuple[str, int]]) -> Change | None:
        """Placement promised GPUs to ``run`` (``job:attempt``); repeats change nothing."""
        if run in self.reservations:
            return None
        kept = tuple((node, gpus) for node, gpus in allocations if node in self.nodes)
        self.reservations[run] = kept
        for node, gpus in kept:
            self.nodes[node].gpus_reserved += gpus
        return self._touch([node for node, _ in kept])

    def settle(self, run: str) -> Change | None:
        """The run started (its GPUs now show as used) or ended: drop its reservation."""
        kept = self.reservations.pop(run, None)
        if not kept:
            return None
        for node, gpus in kept:
            entry = self.nodes.get(node)
            if entry is not None:
                entry.gpus_reserved = max(entry.gpus_reserved - gpus, 0)
        return self._touch([node for node, _ in kept])

    def _touch(self, names: Sequence[str]) -> Change | None:
        nodes = [self.nodes[n] for n in names if n in self.nodes]
        if not nodes:
            return None
        cluster = self.clusters[nodes[0].cluster]
        cluster.version += 1
        self.dirty_regions.add(cluster.region)
        return Change(
            cluster.cluster, cluster.region, cluster.version, False, tuple(nodes), (), cluster.stale
        )

    # ---- queries --------------------------------------------------------------------------------

    def query(
        self,
        *,
        now: float,
        region: str | None = None,
        zone: str | None = None,
        gpu_model: str | None = None,
        min_free_gpus: int = 0,
        fresh_only: bool = False,
        with_nodes: bool = True,
    ) -> dict[str, Any]:
        """The view as nested dicts: region -> zone -> cluster (-> nodes), totals at each level.

        Filters: a region, a zone, a GPU model (nodes of other models are left out), nodes with at
        least ``min_free_gpus`` free, and only fresh (not stale) clusters. Each cluster says how
        old its information is and after how long it goes stale.
        """
        regions: dict[str, Any] = {}
        for c in self.clusters.values():
            if (region and c.region != region) or (fresh_only and c.stale):
                continue
            cl: dict[str, Any] | None = None
            for name in c.nodes:
                n = self.nodes[name]
                if (zone and n.zone != zone) or (gpu_model and n.gpu_model != gpu_model):
                    continue
                if min_free_gpus and n.gpus_free < min_free_gpus:
                    continue
                if cl is None or cl["zone"] != n.zone:
                    r = regions.setdefault(c.region, _totals({"zones": {}}))
                    z = r["zones"].setdefault(n.zone, _totals({"clusters": {}}))
                    cl = z["clusters"].setdefault(
                        c.cluster,
                        _totals(
                            {
                                "zone": n.zone,
                                "stale": c.stale,
                                "trust": round(c.trust, 4),
                                "scu_per_gpu": c.scu,
                                "age_s": round(max(now - c.last_heartbeat_at, 0.0), 3),
                                "ttl_s": round(c.ttl_s(), 3),
                                "heartbeat_interval_s": c.interval_s,
                                "last_heartbeat_at": c.last_heartbeat_at,
                                "nodes": [],
                            }
                        ),
                    )
                    levels = (r, z, cl)
                free = 0 if c.stale else n.gpus_free
                for level in levels:
                    level["gpus_total"] += n.gpus_total
                    level["gpus_used"] += n.gpus_used
                    level["gpus_reserved"] += n.gpus_reserved
                    level["gpus_free"] += free
                if with_nodes:
                    cl["nodes"].append(
                        {
                            "node": n.node,
                            "gpu_model": n.gpu_model,
                            "gpus_total": n.gpus_total,
                            "gpus_used": n.gpus_used,
                            "gpus_reserved": n.gpus_reserved,
                            "healthy": n.healthy,
                        }
                    )
        if with_nodes:
            for r in regions.values():
                for z in r["zones"].values():
                    for cl_ in z["clusters"].values():
                        cl_["nodes"].sort(key=lambda node: node["node"])
        return {"regions": regions}

    def tree(self, *, region: str | None = None, gpu_model: str | None = None) -> dict[str, Any]:
        """The whole view (see :meth:`query`), at the time of the newest heartbeat."""
        newest = max((c.last_heartbeat_at for c in self.clusters.values()), default=0.0)
        return self.query(now=newest, region=region, gpu_model=gpu_model)

    def take_dirty_regions(self) -> set[str]:
        """The regions changed since the last call (and forget them)."""
        dirty, self.dirty_regions = self.dirty_regions, set()
        return dirty

    def summaries(
        self, scu_per_gpu: Callable[[str], float], regions: Iterable[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Per region, and per zone inside it: GPUs by model (total, available, reserved) and SCU.

        Stale clusters offer nothing: their GPUs count in the totals, not in what is available.
        ``scu_per_gpu(model)`` converts a model's GPUs into standard compute units.
        """
        out: dict[str, dict[str, Any]] = {}
        wanted = set(regions) if regions is not None else None
        scu_of: dict[str, float] = {}
        for c in self.clusters.values():
            if wanted is not None and c.region not in wanted:
                continue
            region = out.setdefault(c.region, _summary({"zones": {}}))
            for name in c.nodes:
                n = self.nodes[name]
                if not n.gpu_model or not n.gpus_total:
                    continue
                zone = region["zones"].setdefault(n.zone, _summary({}))
                available = 0 if c.stale else n.gpus_free
                scu = scu_of.get(n.gpu_model)
                if scu is None:
                    scu = scu_of[n.gpu_model] = scu_per_gpu(n.gpu_model)
                for level in (region, zone):
                    m = level["models"].setdefault(
                        n.gpu_model, {"gpus_total": 0, "gpus_available": 0, "gpus_reserved": 0}
                    )
                    m["gpus_total"] += n.gpus_total
                    m["gpus_available"] += available
                    m["gpus_reserved"] += n.gpus_reserved
                    level["scu_total"] += n.gpus_total * scu
                    level["scu_available"] += available * scu
        return out


def _totals(d: dict[str, Any]) -> dict[str, Any]:
    d.update(gpus_total=0, gpus_used=0, gpus_reserved=0, gpus_free=0)
    return d


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    d.update(models={}, scu_total=0.0, scu_available=0.0)
    return d

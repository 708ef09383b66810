"""The resource ledger: region -> zone -> cluster -> node, folded from agents' heartbeats.

Pure and synchronous: the metrics service feeds it heartbeats and persists what it returns; the
simulator and benchmarks use it directly. A heartbeat that is late, repeated or from the past of
an agent never rolls state back; a heartbeat that claims another cluster's node, or reports
impossible numbers, changes nothing of that node and is counted with its reason.
"""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from loom_proto.clusters import ClusterHeartbeat, NodeState

MAX_CLOCK_SKEW_S = 300.0
"""A heartbeat stamped further in the future than this is refused."""

STALE_AFTER_INTERVALS = 3.0
"""A cluster that misses this many heartbeat intervals is stale."""


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
    nodes: set[str] = field(default_factory=set)

    def ttl_s(self) -> float:
        """How long without a heartbeat before the cluster is stale."""
        return STALE_AFTER_INTERVALS * self.interval_s


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


def _node_error(n: NodeState) -> str | None:
    if n.gpus_used > n.gpus_total:
        return f"node {n.node}: {n.gpus_used} GPUs used of {n.gpus_total}"
    if n.gpus_total > 0 and not n.gpu_model:
        return f"node {n.node}: {n.gpus_total} GPUs without a model"
    return None


class Ledger:
    """Every cluster and node, and counters of what was refused and why."""

    def __init__(self) -> None:
        self.clusters: dict[str, LedgerCluster] = {}
        self.nodes: dict[str, LedgerNode] = {}
        self.refused: Counter[str] = Counter()

    def apply(self, hb: ClusterHeartbeat, now: float) -> Applied:
        """Fold one heartbeat in; ``now`` is the receiver's clock."""
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
        # A full snapshot is re-published whole only when readers need the whole list: the
        # cluster is new or its agent restarted. Otherwise only what changed goes out.
        republish_all = hb.full and (cluster.last_seq == 0 or hb.agent_epoch != cluster.agent_epoch)
        cluster.agent_epoch, cluster.last_seq = hb.agent_epoch, hb.seq
        cluster.interval_s = hb.interval_s
        cluster.last_heartbeat_at = now
        was_stale, cluster.stale = cluster.stale, False

        changed: list[LedgerNode] = []
        errors: list[str] = []
        for n in hb.nodes:
            owner = self.nodes.get(n.node)
            if owner is not None and owner.cluster != hb.cluster:
                self.refused["node_of_other_cluster"] += 1
                errors.append(f"node {n.node} belongs to {owner.cluster}")
                continue
            problem = _node_error(n)
            if problem is not None:
                self.refused["impossible_node"] += 1
                errors.append(problem)
                continue
            entry = LedgerNode(
                node=n.node,
                cluster=hb.cluster,
                region=hb.region,
                zone=n.zone,
                gpu_model=n.gpu_model,
                gpus_total=n.gpus_total,
                gpus_used=n.gpus_used,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
                healthy=n.healthy,
                updated_at=now,
            )
            if owner is None or _differs(owner, entry):
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
        if not changed and not removed and not was_stale and not republish_all:
            return Applied(None, None, tuple(errors))
        cluster.version += 1
        if republish_all:
            changed = [self.nodes[n] for n in sorted(cluster.nodes)]
        change = Change(
            hb.cluster, hb.region, cluster.version, republish_all, tuple(changed), tuple(removed), False
        )
        return Applied(change, None, tuple(errors))

    def expire(self, now: float) -> list[Change]:
        """Mark clusters that missed their heartbeats stale; one change per newly stale cluster."""
        changes = []
        for cluster in self.clusters.values():
            if cluster.stale or cluster.last_heartbeat_at == 0.0:
                continue
            if now - cluster.last_heartbeat_at > cluster.ttl_s():
                cluster.stale = True
                cluster.version += 1
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

    def tree(self, *, region: str | None = None, gpu_model: str | None = None) -> dict[str, object]:
        """The view as nested dicts: region -> zone -> cluster -> nodes, with GPU totals at each level."""
        regions: dict[str, dict[str, object]] = {}
        for c in sorted(self.clusters.values(), key=lambda c: c.cluster):
            if region and c.region != region:
                continue
            r = regions.setdefault(c.region, {"gpus_total": 0, "gpus_used": 0, "zones": {}})
            for name in sorted(c.nodes):
                n = self.nodes[name]
                if gpu_model and n.gpu_model != gpu_model:
                    continue
                zones: dict[str, dict[str, object]] = r["zones"]  # type: ignore[assignment]
                z = zones.setdefault(n.zone, {"gpus_total": 0, "gpus_used": 0, "clusters": {}})
                clusters: dict[str, dict[str, object]] = z["clusters"]  # type: ignore[assignment]
                cl = clusters.setdefault(
                    c.cluster,
                    {
                        "gpus_total": 0,
                        "gpus_used": 0,
                        "stale": c.stale,
                        "last_heartbeat_at": c.last_heartbeat_at,
                        "nodes": [],
                    },
                )
                nodes: list[dict[str, object]] = cl["nodes"]  # type: ignore[assignment]
                nodes.append(
                    {
                        "node": n.node,
                        "gpu_model": n.gpu_model,
                        "gpus_total": n.gpus_total,
                        "gpus_used": n.gpus_used,
                        "healthy": n.healthy,
                    }
                )
                for level in (r, z, cl):
                    level["gpus_total"] = int(level["gpus_total"]) + n.gpus_total  # type: ignore[call-overload]
                    level["gpus_used"] = int(level["gpus_used"]) + n.gpus_used  # type: ignore[call-overload]
        return {"regions": regions}


def _differs(a: LedgerNode, b: LedgerNode) -> bool:
    return (a.zone, a.gpu_model, a.gpus_total, a.gpus_used, a.cpu_milli, a.memory_mib, a.healthy) != (
        b.zone,
        b.gpu_model,
        b.gpus_total,
        b.gpus_used,
        b.cpu_milli,
        b.memory_mib,
        b.healthy,
    )

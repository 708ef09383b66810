"""What an alert names and which jobs stand on it: resources, the inventory, the placements snapshot.

A **resource** is ``(kind, name)``: a ``region``, ``zone``, ``cluster``, ``node``, an undirected
``link`` between two regions (named ``a~b`` with ``a < b``), a ``job``, a ``service`` of Loom
itself (the bus, the dead-letter queue), or a ``server`` every service stands on (``nats``,
``postgres``: named by the alerts that depend on it, :attr:`Signal.stands_on`). Links are
undirected because a degraded hop hurts the traffic both ways and perception reports each
direction on its own.

:meth:`Inventory.implicated` is the heart of correlation: every resource that, if it failed,
would explain an alert — the resource the alert names and everything it stands on (a node: its
cluster, zone and region; a link: its two regions), and, for a job alert, every node, cluster,
zone and region any part of the job holds plus every link between the regions its parts span
(the direct link, and each hop of the chosen path between them where the snapshot knows it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from loom.model.topology import Topology

ResourceKind = Literal["job", "node", "cluster", "link", "zone", "region", "service", "server"]
Resource = tuple[ResourceKind, str]

SPECIFICITY: dict[str, int] = {
    "job": 0,
    "node": 1,
    "cluster": 2,
    "link": 3,
    "zone": 4,
    "region": 5,
    "service": 6,
    "server": 7,
}
"""Most specific first: the tie-break between root-cause candidates that explain equally well."""


def link_name(a: str, b: str) -> str:
    """The undirected name of the link between regions ``a`` and ``b``."""
    lo, hi = sorted((a, b))
    return f"{lo}~{hi}"


def link_ends(name: str) -> tuple[str, str]:
    """The two regions of a link name."""
    a, _, b = name.partition("~")
    return a, b


def describe(resource: Resource) -> str:
    """``cluster c-use2-a``; a link as ``link a <-> b``."""
    kind, name = resource
    if kind == "link":
        a, b = link_ends(name)
        return f"link {a} <-> {b}"
    return f"{kind} {name}"


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a placed job (the lead, a gang member or a pipeline stage): a cluster and nodes."""

    cluster: str
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class JobPlacement:
    """Where one placed or running job is, part by part; ``parent`` is its DAG job, if any."""

    job_id: str
    tenant: str
    parts: tuple[Part, ...]
    parent: str | None = None


@dataclass(slots=True)
class Inventory:
    """Where each node and cluster is: node -> cluster, cluster -> (zone, region).

    Built from the topology; nodes and clusters seen only in placements are learned on the way.
    """

    cluster_of_node: dict[str, str] = field(default_factory=dict)
    zone_of_cluster: dict[str, str] = field(default_factory=dict)
    region_of_cluster: dict[str, str] = field(default_factory=dict)
    region_of_zone: dict[str, str] = field(default_factory=dict)
    regions: set[str] = field(default_factory=set)

    @classmethod
    def from_topology(cls, topology: Topology) -> Inventory:
        """The inventory of a topology."""
        inv = cls()
        for region in topology.regions:
            inv.regions.add(region.id)
            for zone in region.zones:
                inv.region_of_zone[zone] = region.id
        for cluster in topology.clusters:
            inv.zone_of_cluster[cluster.id] = cluster.zone
            inv.region_of_cluster[cluster.id] = cluster.region
            for node in cluster.nodes:
                inv.cluster_of_node[node.id] = cluster.id
        return inv

    def knows(self, resource: Resource) -> bool:
        """Whether the resource is one Loom knows (unknown ones are kept, unattributed)."""
        kind, name = resource
        if kind == "node":
            return name in self.cluster_of_node
        if kind == "cluster":
            return name in self.region_of_cluster
        if kind == "zone":
            return name in self.region_of_zone
        if kind == "region":
            return name in self.regions
        if kind == "link":
            a, b = link_ends(name)
            return a in self.regions and b in self.regions
        return True

    def above(self, resource: Resource) -> list[Resource]:
        """The resource and everything it stands on (node -> cluster -> zone -> region; link -> regions)."""
        kind, name = resource
        out: list[Resource] = [resource]
        if kind == "node":
            cluster = self.cluster_of_node.get(name)
            if cluster is not None:
                out.extend(self.above(("cluster", cluster)))
        elif kind == "cluster":
            zone = self.zone_of_cluster.get(name)
            if zone is not None:
                out.append(("zone", zone))
            region = self.region_of_cluster.get(name)
            if region is not None:
                out.append(("region", region))
        elif kind == "zone":
            region = self.region_of_zone.get(name)
            if region is not None:
                out.append(("region", region))
        elif kind == "link":
            out.extend(("region", r) for r in link_ends(name))
        return out


class Placements:
    """A snapshot of which jobs run where, indexed by every resource they use.

    ``paths`` (optional) maps an ordered region pair to the regions its traffic crosses, ends
    included (``("a", "c", "b")`` when a→b is relayed through c): a job spanning a and b uses each
    hop and the direct link a~b too; pairs it lacks are taken as direct.
    """

    def __init__(
        self,
        inventory: Inventory,
        jobs: Iterable[JobPlacement] = (),
        *,
        paths: Mapping[tuple[str, str], Sequence[str]] | None = None,
    ) -> None:
        self.inventory = inventory
        self.paths = dict(paths or {})
        self.jobs: dict[str, JobPlacement] = {}
        self.uses: dict[str, frozenset[Resource]] = {}
        self.by_resource: dict[Resource, set[str]] = {}
        self._children: tuple[int, dict[str, set[str]], dict[Resource, set[str]]] | None = None
        for job in jobs:
            self.add(job)

    def _path_links(self, a: str, b: str) -> list[str]:
        # The direct link always: a path relayed around a degraded link was chosen because of it,
        # and the job's traffic crossed it until then.
        hops = self.paths.get((a, b)) or self.paths.get((b, a)) or (a, b)
        return sorted({link_name(a, b)} | {link_name(x, y) for x, y in itertools.pairwise(hops) if x != y})

    def add(self, job: JobPlacement) -> None:
        """Index one job (replacing what was known of it)."""
        self.remove(job.job_id)
        inv = self.inventory
        used: set[Resource] = {("job", job.job_id)}
        regions: set[str] = set()
        for part in job.parts:
            for node in part.nodes:
                inv.cluster_of_node.setdefault(node, part.cluster)
                used.add(("node", node))
            for r in inv.above(("cluster", part.cluster)):
                used.add(r)
                if r[0] == "region":
                    regions.add(r[1])
        ordered = sorted(regions)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1 :]:
                used.update(("link", name) for name in self._path_links(a, b))
        self.jobs[job.job_id] = job
        frozen = frozenset(used)
        self.uses[job.job_id] = frozen
        for r in frozen:
            self.by_resource.setdefault(r, set()).add(job.job_id)

    def remove(self, job_id: str) -> None:
        """Forget a job (it finished or was re-queued)."""
        self.jobs.pop(job_id, None)
        for r in self.uses.pop(job_id, frozenset()):
            holders = self.by_resource.get(r)
            if holders is not None:
                holders.discard(job_id)
                if not holders:
                    del self.by_resource[r]

    def children(self) -> tuple[dict[str, set[str]], dict[Resource, set[str]]]:
        """Nodes of each cluster; clusters of each zone and region (cached while the inventory holds)."""
        inv = self.inventory
        size = len(inv.cluster_of_node) + len(inv.region_of_cluster)
        if self._children is None or self._children[0] != size:
            nodes_of: dict[str, set[str]] = {}
            for node, cluster in inv.cluster_of_node.items():
                nodes_of.setdefault(cluster, set()).add(node)
            clusters_of: dict[Resource, set[str]] = {}
            for cluster, region in inv.region_of_cluster.items():
                clusters_of.setdefault(("region", region), set()).add(cluster)
            for cluster, zone in inv.zone_of_cluster.items():
                clusters_of.setdefault(("zone", zone), set()).add(cluster)
            self._children = (size, nodes_of, clusters_of)
        return self._children[1], self._children[2]

    def jobs_on(self, resource: Resource) -> set[str]:
        """Jobs with any part on (or traffic across) the resource."""
        if resource[0] == "job":
            return {resource[1]} if resource[1] in self.jobs else set()
        return self.by_resource.get(resource, set())

    def tenant_of(self, job_id: str) -> str | None:
        """The tenant of a placed job."""
        job = self.jobs.get(job_id)
        return job.tenant if job else None

    def implicated(self, resource: Resource | None, job_id: str | None) -> frozenset[Resource]:
        """Every resource whose failure would explain an alert naming ``resource`` and/or ``job_id``."""
        out: set[Resource] = set()
        if resource is not None:
            out.update(self.inventory.above(resource))
        if job_id is not None:
            out.add(("job", job_id))
            out.update(self.uses.get(job_id, frozenset()))
        return frozenset(out)

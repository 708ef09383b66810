"""The link-state graph and routing over it: least-cost paths, and path choice with hysteresis.

:class:`LinkGraph` is a networkx ``DiGraph`` of regions whose edges carry each usable link's
priced cost (effective ms, additive) and its measurements. A path's RTT is the sum of its links'
RTTs (a relayed path's round trip), its loss ``1 − Π(1 − loss)``, its bandwidth the bottleneck.

:class:`PathSelector` keeps one chosen path per (src, dst) and changes it only when that pays:

* the chosen path is gone (a link unusable or removed) → switch at once;
* the best path is cheaper than the chosen one by more than ``switch_margin`` (relative) and
  ``min_gain_ms`` (absolute) →

  - switch at once if the chosen path itself got worse (its cost rose by more than the margin
    above the lowest it has had since it was chosen): the network moved under us;
  - otherwise (a better path merely appeared) switch only after the chosen path has been held
    for ``min_dwell_s``.

With link costs that rise at once and fall slowly, a degradation reroutes within the period that
sees it, while a link wobbling around the point where two paths cost the same moves nothing.
"""

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import networkx as nx

from loom.net.linkstate import LinkView

__all__ = ["LinkGraph", "PathInfo", "PathSelector", "Selection", "SelectorConfig"]


@dataclass(frozen=True, slots=True)
class PathInfo:
    """A path and what it costs: the sum of link costs, RTT, loss and bottleneck bandwidth."""

    nodes: tuple[str, ...]
    cost: float
    rtt_ms: float
    loss_rate: float
    bottleneck_gbps: float | None
    """None when no link of the path has a known bandwidth."""
    stale: bool
    """Some link of the path is stale (priced conservatively)."""
    degraded: bool
    """Some link of the path is degraded."""

    @property
    def hops(self) -> int:
        """Links on the path."""
        return len(self.nodes) - 1


class LinkGraph:
    """Regions and the usable links between them, with their current prices."""

    def __init__(self, regions: Iterable[str] = ()) -> None:
        self.graph = nx.DiGraph()
        self.graph.add_nodes_from(regions)
        self._paths: dict[str, dict[str, list[str]]] = {}
        """Least-cost paths from each source asked about since the graph last changed: one
        Dijkstra per source serves every destination (a period selects every pair)."""

    def has_region(self, region: str) -> bool:
        """Whether the region is a node of the graph."""
        return bool(self.graph.has_node(region))

    def update(self, view: LinkView) -> None:
        """Put a link's latest view in the graph; an unusable (or unpriced) link leaves it."""
        self._paths.clear()
        if not view.usable or not math.isfinite(view.cost):
            if self.graph.has_edge(view.src, view.dst):
                self.graph.remove_edge(view.src, view.dst)
            return
        self.graph.add_edge(
            view.src,
            view.dst,
            cost=view.cost,
            rtt_ms=view.rtt_ms,
            loss_rate=view.loss_rate,
            bandwidth_gbps=view.bandwidth_gbps,
            stale=view.stale,
            degraded=view.degraded,
        )

    def remove(self, src: str, dst: str) -> None:
        """Take a link out of the graph (no-op if absent)."""
        self._paths.clear()
        if self.graph.has_edge(src, dst):
            self.graph.remove_edge(src, dst)

    def least_cost(self, src: str, dst: str) -> PathInfo | None:
        """The least-cost path from ``src`` to ``dst``; None if there is none or an end is unknown."""
        if src == dst or not (self.graph.has_node(src) and self.graph.has_node(dst)):
            return None
        paths = self._paths.get(src)
        if paths is None:
            # Every destination's path at once: a path is final when Dijkstra reaches its end,
            # so each is the one a search stopping there finds.
            _, paths = nx.single_source_dijkstra(self.graph, src, weight="cost")
            self._paths[src] = paths
        nodes = paths.get(dst)
        if nodes is None:
            return None
        return self.describe(nodes)

    def describe(self, nodes: Sequence[str]) -> PathInfo | None:
        """Cost, RTT, loss and bottleneck of a given path now; None if one of its links is gone."""
        if len(nodes) < 2:
            return None
        edges = self.graph.edges
        cost = 0.0
        rtt_ms = 0.0
        delivered = 1.0
        bottleneck: float | None = None
        stale = degraded = False
        for a, b in itertools.pairwise(nodes):
            if not self.graph.has_edge(a, b):
                return None
            data = edges[a, b]
            cost += data["cost"]
            rtt_ms += data["rtt_ms"]
            delivered *= 1.0 - data["loss_rate"]
            bandwidth = data["bandwidth_gbps"]
            if bandwidth is not None and (bottleneck is None or bandwidth < bottleneck):
                bottleneck = bandwidth
            stale = stale or data["stale"]
            degraded = degraded or data["degraded"]
        return PathInfo(tuple(nodes), cost, rtt_ms, 1.0 - delivered, bottleneck, stale, degraded)


@dataclass(frozen=True, slots=True)
class SelectorConfig:
    """When a chosen path gives way to a better one."""

    switch_margin: float = 0.05
    """The best path must be cheaper than the chosen one by this fraction of the chosen one's cost."""
    min_gain_ms: float = 1.0
    """... and by at least this much."""
    min_dwell_s: float = 10.0
    """A chosen path that has not got worse is kept at least this long."""


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen path for a pair after one selection, and why it is that one."""

    path: PathInfo | None
    best: PathInfo | None
    changed: bool
    reason: str


@dataclass(slots=True)
class _Choice:
    nodes: tuple[str, ...]
    chosen_at: float
    lowest_cost: float


class PathSelector:
    """The chosen path of every (src, dst) pair asked about, changed with hysteresis."""

    def __init__(self, graph: LinkGraph, config: SelectorConfig | None = None) -> None:
        self.graph = graph
        self.config = config or SelectorConfig()
        self._chosen: dict[tuple[str, str], _Choice] = {}
        self.changes: Counter[tuple[str, str]] = Counter()
        """Path changes per pair, not counting the first choice."""

    def current(self, src: str, dst: str) -> tuple[str, ...] | None:
        """The chosen path's regions for the pair, if one has been chosen."""
        choice = self._chosen.get((src, dst))
        return None if choice is None else choice.nodes

    def select(self, src: str, dst: str, now: float) -> Selection:
        """Choose (or keep) the path from ``src`` to ``dst`` at ``now``."""
        key = (src, dst)
        best = self.graph.least_cost(src, dst)
        choice = self._chosen.get(key)
        if best is None:
            if choice is not None:
                del self._chosen[key]
                self.changes[key] += 1
                return Selection(None, None, True, "no path")
            return Selection(None, None, False, "no path")
        if choice is None:
            self._chosen[key] = _Choice(best.nodes, now, best.cost)
            return Selection(best, best, True, "first choice")
        current = self.graph.describe(choice.nodes)
        if current is None:
            return self._switch(key, best, now, "chosen path lost a link")
        if best.nodes == choice.nodes:
            choice.lowest_cost = min(choice.lowest_cost, current.cost)
            return Selection(current, best, False, "chosen path is the best")
        config = self.config
        gain = current.cost - best.cost
        if gain <= max(config.switch_margin * current.cost, config.min_gain_ms):
            choice.lowest_cost = min(choice.lowest_cost, current.cost)
            return Selection(current, best, False, "best path is not better by the margin")
        if current.cost > choice.lowest_cost * (1.0 + config.switch_margin):
            return self._switch(key, best, now, "chosen path got worse")
        if now - choice.chosen_at >= config.min_dwell_s:
            return self._switch(key, best, now, "a better path appeared")
        return Selection(current, best, False, "better path waits for the dwell time")

    def _switch(self, key: tuple[str, str], best: PathInfo, now: float, reason: str) -> Selection:
        self._chosen[key] = _Choice(best.nodes, now, best.cost)
        self.changes[key] += 1
        return Selection(best, best, True, reason)

    def forget(self, src: str, dst: str) -> None:
        """Drop the pair's chosen path (the next selection starts afresh)."""
        self._chosen.pop((src, dst), None)

"""The link-state graph, path choice with hysteresis, and perception end to end on deterministic probes."""

import math

import pytest

from loom.model.topology import load_topology
from loom.net import (
    CostWeights,
    Expected,
    LinkConfig,
    LinkGraph,
    LinkView,
    PathSelector,
    Perception,
    SelectorConfig,
    UnknownEndpointError,
)
from loom_proto.net import ProbeSample

T0 = 1_767_225_600.0


def view(
    src: str,
    dst: str,
    cost: float,
    *,
    rtt_ms: float | None = None,
    loss: float = 0.0,
    bandwidth: float | None = None,
    usable: bool = True,
    stale: bool = False,
) -> LinkView:
    return LinkView(
        src=src,
        dst=dst,
        cost=cost,
        rtt_ms=cost if rtt_ms is None else rtt_ms,
        jitter_ms=0.0,
        loss_rate=loss,
        bandwidth_gbps=bandwidth,
        stale=stale,
        usable=usable,
        degraded=False,
    )


def triangle(direct: float = 50.0) -> LinkGraph:
    graph = LinkGraph(["a", "b", "c"])
    graph.update(view("a", "b", 10.0, loss=0.01, bandwidth=4.0))
    graph.update(view("b", "c", 15.0, loss=0.02, bandwidth=2.5))
    graph.update(view("a", "c", direct, bandwidth=10.0))
    return graph


def test_least_cost_path_reports_latency_loss_and_bottleneck() -> None:
    path = triangle().least_cost("a", "c")
    assert path is not None
    assert path.nodes == ("a", "b", "c")
    assert path.hops == 2
    assert path.cost == pytest.approx(25.0)
    assert path.rtt_ms == pytest.approx(25.0)
    assert path.loss_rate == pytest.approx(1 - 0.99 * 0.98)
    assert path.bottleneck_gbps == 2.5
    direct = triangle(direct=20.0).least_cost("a", "c")
    assert direct is not None and direct.nodes == ("a", "c") and direct.loss_rate == 0.0


def test_bottleneck_is_unknown_when_no_link_knows_its_bandwidth() -> None:
    graph = LinkGraph(["a", "b"])
    graph.update(view("a", "b", 5.0))
    path = graph.least_cost("a", "b")
    assert path is not None and path.bottleneck_gbps is None


def test_unusable_links_leave_the_graph_and_paths_may_vanish() -> None:
    graph = triangle()
    graph.update(view("a", "b", 10.0, usable=False))
    path = graph.least_cost("a", "c")
    assert path is not None and path.nodes == ("a", "c")
    assert graph.describe(("a", "b", "c")) is None
    graph.update(view("a", "c", math.inf))
    assert graph.least_cost("a", "c") is None
    assert graph.least_cost("a", "nowhere") is None
    assert graph.least_cost("a", "a") is None


def test_selector_keeps_the_chosen_path_while_the_best_is_not_better_by_the_margin() -> None:
    graph = triangle(direct=24.0)
    selector = PathSelector(graph, SelectorConfig(switch_margin=0.05, min_gain_ms=1.0, min_dwell_s=10.0))
    first = selector.select("a", "c", T0)
    assert first.changed and first.path is not None and first.path.nodes == ("a", "c")
    graph.update(view("a", "c", 25.5))  # now 2 % worse than the relay path: not enough to move
    kept = selector.select("a", "c", T0 + 1)
    assert not kept.changed and kept.path is not None and kept.path.nodes == ("a", "c")
    assert kept.best is not None and kept.best.nodes == ("a", "b", "c")


def test_selector_switches_at_once_when_the_chosen_path_gets_worse() -> None:
    graph = triangle(direct=20.0)
    selector = PathSelector(graph)
    selector.select("a", "c", T0)
    graph.update(view("a", "c", 60.0))
    moved = selector.select("a", "c", T0 + 1)
    assert moved.changed and moved.reason == "chosen path got worse"
    assert moved.path is not None and moved.path.nodes == ("a", "b", "c")
    assert selector.changes["a", "c"] == 1


def test_selector_waits_out_the_dwell_time_for_a_merely_better_path() -> None:
    graph = triangle(direct=40.0)
    selector = PathSelector(graph, SelectorConfig(min_dwell_s=10.0))
    selector.select("a", "c", T0)  # via b, cost 25
    graph.update(view("a", "c", 12.0))  # the direct link got much better
    waiting = selector.select("a", "c", T0 + 3)
    assert not waiting.changed and waiting.reason == "better path waits for the dwell time"
    moved = selector.select("a", "c", T0 + 10)
    assert moved.changed and moved.path is not None and moved.path.nodes == ("a", "c")


def test_selector_leaves_a_path_that_lost_a_link_at_once() -> None:
    graph = triangle(direct=40.0)
    selector = PathSelector(graph)
    selector.select("a", "c", T0)
    graph.update(view("b", "c", 15.0, usable=False))
    moved = selector.select("a", "c", T0 + 0.5)
    assert moved.changed and moved.reason == "chosen path lost a link"
    graph.remove("a", "c")
    gone = selector.select("a", "c", T0 + 1)
    assert gone.changed and gone.path is None and gone.reason == "no path"


# ---- perception, end to end on deterministic probes ----------------------------------------------

LINKS = {("a", "b"): 10.0, ("b", "c"): 10.0, ("a", "c"): 15.0, ("b", "a"): 10.0, ("c", "b"): 10.0}


def perception() -> Perception:
    # No bandwidth term, no jitter weight: cost is RTT plus loss, easy to reason about.
    config = LinkConfig(weights=CostWeights(reference_mbytes=0.0))
    expected = {key: Expected(rtt_ms=rtt) for key, rtt in LINKS.items()}
    return Perception(["a", "b", "c"], expected=expected, link_config=config)


class Probes:
    """Five probes per link per one-second period, at the RTTs in ``rtt`` (None: lost)."""

    def __init__(self, p: Perception) -> None:
        self.p = p
        self.now = T0
        self.seq = 0
        self.rtt: dict[tuple[str, str], float | None] = dict(LINKS)

    def period(self) -> None:
        for k in range(5):
            at = self.now + (k + 1) * 0.2
            for (src, dst), rtt in self.rtt.items():
                self.seq += 1
                sample = ProbeSample(
                    src=src,
                    dst=dst,
                    probe="udp_echo",
                    seq=self.seq,
                    sent_at=at,
                    rtt_ms=rtt,
                    lost=0 if rtt is not None else 1,
                )
                assert self.p.ingest(sample, at) is None
        self.now += 1.0
        self.p.tick(self.now)


@pytest.mark.parametrize("step", [60.0, None], ids=["rtt_x4", "outage"])
def test_the_chosen_path_is_right_within_two_periods_after_a_step(step: float | None) -> None:
    p = perception()
    probes = Probes(p)
    for _ in range(10):
        probes.period()
        p.path("a", "c", probes.now)
    before = p.path("a", "c", probes.now)
    assert before.chosen is not None and before.chosen.nodes == ("a", "c")
    probes.rtt["a", "c"] = step
    periods = None
    for period in range(1, 6):
        probes.period()
        answer = p.path("a", "c", probes.now)
        if answer.chosen is not None and answer.chosen.nodes == ("a", "b", "c"):
            periods = period
            break
    assert periods is not None and periods <= 2


def test_path_query_returns_cost_latency_loss_and_bottleneck() -> None:
    p = perception()
    probes = Probes(p)
    probes.rtt["a", "c"] = 100.0
    for _ in range(10):
        probes.period()
    answer = p.path("a", "c", probes.now)
    assert answer.chosen is not None
    assert answer.chosen.nodes == ("a", "b", "c")
    assert answer.chosen.rtt_ms == pytest.approx(20.0)
    assert answer.chosen.loss_rate == 0.0
    assert answer.chosen.bottleneck_gbps is None
    assert not answer.chosen.stale


def test_point_queries_give_windows_and_a_forecast_and_refuse_unknown_endpoints() -> None:
    p = perception()
    probes = Probes(p)
    for _ in range(12):
        probes.period()
    link = p.point_link("a", "b", probes.now)
    assert link.rtt_ms == pytest.approx(10.0)
    assert [w.horizon_s for w, _ in link.windows] == [10.0, 60.0, 300.0]
    assert link.windows[0][0].samples == 50
    assert link.rtt_ms_forecast == pytest.approx(10.0, rel=0.05)
    region = p.point_region("b", probes.now)
    assert {(x.src, x.dst) for x in region.outgoing} == {("b", "a"), ("b", "c")}
    assert {(x.src, x.dst) for x in region.incoming} == {("a", "b"), ("c", "b")}
    assert region.stale_links == 0
    with pytest.raises(UnknownEndpointError):
        p.point_region("mars", probes.now)
    with pytest.raises(UnknownEndpointError):
        p.point_link("c", "a", probes.now)  # no such link
    with pytest.raises(UnknownEndpointError):
        p.path("a", "mars", probes.now)


def test_a_silent_link_goes_stale_and_routing_avoids_it_conservatively() -> None:
    p = perception()
    probes = Probes(p)
    probes.rtt["a", "c"] = 18.0  # cheaper than a-b-c (20), but only by 10 %
    for _ in range(10):
        probes.period()
    fresh = p.path("a", "c", probes.now)
    assert fresh.chosen is not None and fresh.chosen.nodes == ("a", "c")
    del probes.rtt["a", "c"]
    for _ in range(40):
        probes.period()
        p.path("a", "c", probes.now)
    stale = p.point_link("a", "c", probes.now)
    assert stale.stale and stale.cost == pytest.approx(18.0 * 1.5, rel=0.02)
    answer = p.path("a", "c", probes.now)
    assert answer.chosen is not None and answer.chosen.nodes == ("a", "b", "c")


def test_observed_transfers_adjust_link_weights() -> None:
    p = perception()
    probes = Probes(p)
    for _ in range(5):
        probes.period()
    before = p.point_link("a", "c", probes.now).cost
    assert p.observe_transfer("a", "c", observed_gbps=0.5, now=probes.now, expected_gbps=1.0)
    probes.period()
    assert p.point_link("a", "c", probes.now).cost > before * 1.2
    assert not p.observe_transfer("a", "mars", observed_gbps=1.0, now=probes.now)
    assert p.transfers_refused == 1


def test_state_survives_a_restart_through_records() -> None:
    p = perception()
    probes = Probes(p)
    for _ in range(10):
        probes.period()
    records = p.records(probes.now)
    fresh = perception()
    assert fresh.restore(records) == len(LINKS)
    restored = fresh.point_link("a", "b", probes.now)
    assert restored.baseline_rtt_ms == pytest.approx(10.0)
    assert restored.stale


def test_perception_from_the_default_topology_routes_every_pair() -> None:
    topology = load_topology("default")
    p = Perception.from_topology(topology)
    p.tick(T0)
    regions = [r.id for r in topology.regions]
    for src in regions:
        for dst in regions:
            if src != dst:
                answer = p.path(src, dst, T0)
                assert answer.chosen is not None and answer.chosen.stale


def test_least_cost_from_one_search_per_source_equals_a_search_per_pair_as_links_change() -> None:
    # The graph keeps one Dijkstra per source until a link changes: every pair's path and cost
    # must be what a search for that pair alone finds, before and after each change.
    import random

    import networkx as nx

    rng = random.Random(7)
    regions = [f"r{i}" for i in range(7)]
    graph = LinkGraph(regions)
    for _ in range(200):
        src, dst = rng.sample(regions, 2)
        roll = rng.random()
        if roll < 0.15:
            graph.remove(src, dst)
        else:
            cost = rng.choice([5.0, 10.0, 20.0, rng.uniform(1.0, 80.0)])  # ties included
            graph.update(view(src, dst, cost, usable=roll > 0.25))
        for a in regions:
            for b in regions:
                got = graph.least_cost(a, b)
                if a == b:
                    assert got is None
                    continue
                try:
                    length, nodes = nx.single_source_dijkstra(graph.graph, a, b, weight="cost")
                except nx.NetworkXNoPath:
                    assert got is None
                    continue
                assert got is not None
                assert got.nodes == tuple(nodes)
                assert got.cost == pytest.approx(length)

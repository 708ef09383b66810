"""Pipeline split: the slowest stage is as fast as it can be, stages fit their sites, ties are stable."""

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.sched import pipeline
from loom.sched.pipeline import (
    PipelineError,
    PipelinePlan,
    Site,
    best_single,
    infeasible_reason,
    plan,
    stage_gpus,
    transfer_s,
    useful_capacity,
)
from loom_proto.jobs import Layer

LAN = (1.0, 100.0)  # rtt_ms, bandwidth_gbps inside a region
USABLE = 0.9


def site(
    cluster: str,
    region: str = "r1",
    *,
    speed: float = 1.0,
    memory_gib: float = 80.0,
    nodes: Sequence[int] = (8,),
    max_gpus: int | None = None,
) -> Site:
    return Site(
        cluster=cluster,
        region=region,
        gpu_model="A100",
        speed_per_gpu=speed,
        gpu_memory_gib=memory_gib,
        free_gpus=tuple((f"{cluster}-n{i}", free) for i, free in enumerate(nodes)),
        max_gpus_per_stage=max_gpus,
    )


def layers(*compute_s: float, memory_gib: float = 1.0, activation_mb: float = 10.0) -> list[Layer]:
    return [Layer(compute_s=c, memory_gib=memory_gib, activation_mb=activation_mb) for c in compute_s]


def links(
    wan: tuple[float, float], **special: tuple[float, float]
) -> Mapping[tuple[str, str], tuple[float, float]]:
    """Same region: LAN; between regions: ``wan``, or ``special["r1_r2"]`` for that pair (both ways)."""
    regions = ("r1", "r2", "r3")
    table: dict[tuple[str, str], tuple[float, float]] = {}
    for a, b in itertools.product(regions, regions):
        pair = "_".join(sorted((a, b)))
        table[(a, b)] = LAN if a == b else special.get(pair, wan)
    return table


def layout(p: PipelinePlan) -> list[tuple[str, int, int]]:
    return [(s.site.cluster, s.first_layer, s.last_layer) for s in p.stages]


# -- hand-checked examples --------------------------------------------------------------------------


def test_a_model_too_big_for_any_one_cluster_is_split() -> None:
    # 4 x 30 GiB = 120 GiB; each site holds 2 GPUs x 40 GiB x 0.9 = 72 GiB
    model = layers(1, 1, 1, 1, memory_gib=30)
    sites = [site("a", memory_gib=40, nodes=(2,)), site("b", memory_gib=40, nodes=(2,))]
    assert best_single(model, sites) is None
    result = plan(model, sites, links(LAN))
    assert result is not None
    assert layout(result) == [("a", 0, 1), ("b", 2, 3)]
    assert [s.gpus for s in result.stages] == [2, 2]  # 60 GiB over 36 usable GiB per GPU
    assert result.stages[0].compute_s == pytest.approx(1.0)  # 2 s of work on 2 GPUs
    assert result.stages[0].transfer_s == pytest.approx(10 * 8 / (1000 * 100) + 0.001)
    assert result.stages[1].transfer_s == 0
    assert result.bottleneck_s == result.step_s == pytest.approx(1.0)


def test_a_model_that_fits_one_cluster_is_split_when_that_is_faster() -> None:
    model = layers(1, 1)  # 2 s per step on one GPU
    sites = [site("a", nodes=(1,)), site("b", nodes=(1,))]
    single = best_single(model, sites)
    assert single is not None and single.bottleneck_s == pytest.approx(2.0)
    result = plan(model, sites, links(LAN))
    assert result is not None
    assert layout(result) == [("a", 0, 0), ("b", 1, 1)]
    assert result.bottleneck_s == pytest.approx(1.0)


def test_a_model_that_fits_one_cluster_stays_whole_when_splitting_is_slower() -> None:
    model = layers(1, 1, activation_mb=1000)  # 1000 MB over 1 Gbps: 8 s, far slower than 2 s whole
    sites = [site("a", "r1", nodes=(1,)), site("b", "r2", nodes=(1,))]
    result = plan(model, sites, links((50.0, 1.0)))
    assert result is not None
    assert layout(result) == [("a", 0, 1)]
    assert result.bottleneck_s == pytest.approx(2.0)


def test_a_split_only_as_fast_as_one_cluster_is_not_taken() -> None:
    # whole on the fast site: 2 s / 2 = 1 s; split fast|slow: max(0.5, 1) = 1 s: equal, fewer stages win
    model = layers(1, 1)
    sites = [site("fast", speed=2.0, nodes=(1,)), site("slow", speed=1.0, nodes=(1,))]
    result = plan(model, sites, links(LAN))
    assert result is not None
    assert layout(result) == [("fast", 0, 1)]
    assert result.bottleneck_s == pytest.approx(1.0)


def test_the_planner_avoids_cutting_over_a_slow_link() -> None:
    model = layers(1, 1, 1, 1, memory_gib=30, activation_mb=500)
    sites = [
        site("a", "r1", memory_gib=40, nodes=(2,)),
        site("b", "r1", memory_gib=40, nodes=(2,)),
        site("c", "r2", memory_gib=40, nodes=(2,), speed=4.0),  # fastest, but behind a slow link
    ]
    result = plan(model, sites, links((80.0, 0.5)))  # 500 MB over 0.5 Gbps: 8 s per cut
    assert result is not None
    assert layout(result) == [("a", 0, 1), ("b", 2, 3)]
    # with a good link the fast site is used
    fast = plan(model, sites, links((5.0, 400.0)))
    assert fast is not None
    assert "c" in {s.site.cluster for s in fast.stages}


def test_activation_heavy_cut_points_are_avoided() -> None:
    # balanced 2+2 would cut after layer 1, which sends 10 GB; 1+3 or 3+1 cut where little is sent
    model = [
        Layer(compute_s=1, memory_gib=1, activation_mb=10),
        Layer(compute_s=1, memory_gib=1, activation_mb=10_000),
        Layer(compute_s=1, memory_gib=1, activation_mb=10),
        Layer(compute_s=1, memory_gib=1, activation_mb=0),
    ]
    sites = [site("a", "r1", nodes=(1,)), site("b", "r2", nodes=(1,))]
    result = plan(model, sites, links((20.0, 10.0)))  # 10 GB over 10 Gbps: 8 s
    assert result is not None
    assert result.stages[0].last_layer != 1
    assert len(result.stages) == 2
    assert result.bottleneck_s == pytest.approx(3.0)


def test_each_cluster_hosts_at_most_one_stage() -> None:
    # one site could hold everything twice over, but a second stage must go elsewhere
    model = layers(4, 4)
    sites = [site("a", nodes=(1,)), site("b", speed=0.5, nodes=(1,))]
    result = plan(model, sites, links(LAN))
    assert result is not None
    assert len({s.site.key for s in result.stages}) == len(result.stages)


def test_gpus_come_from_the_nodes_with_most_free_first() -> None:
    model = layers(1, memory_gib=100)  # 100 GiB over 36 usable per GPU: 3 GPUs
    sites = [site("a", memory_gib=40, nodes=(1, 2, 2))]
    result = plan(model, sites, links(LAN))
    assert result is not None
    assert result.stages[0].allocations == (("a-n1", 2), ("a-n2", 1))
    assert result.allocations == (("a-n1", 2), ("a-n2", 1))
    (part,) = result.parts()
    assert (part.cluster, part.layers, [a.gpus for a in part.allocations]) == ("a", (0, 0), [2, 1])


def test_max_stages_caps_the_split() -> None:
    model = layers(1, 1, 1, 1)
    sites = [site(c, nodes=(1,)) for c in "abcd"]
    four = plan(model, sites, links(LAN), max_stages=4)
    two = plan(model, sites, links(LAN), max_stages=2)
    assert four is not None and len(four.stages) == 4
    assert two is not None and len(two.stages) == 2
    assert two.bottleneck_s == pytest.approx(2.0)


def test_a_stage_never_takes_more_gpus_than_the_site_allows() -> None:
    model = layers(1, memory_gib=100)  # needs 3 GPUs of 40 GiB
    capped = [site("a", memory_gib=40, nodes=(8,), max_gpus=2)]
    assert plan(model, capped, links(LAN)) is None


def test_the_plan_does_not_depend_on_the_order_sites_are_given() -> None:
    model = layers(1, 2, 3, 2, 1, memory_gib=20)
    sites = [site(c, r, memory_gib=24, nodes=(2,)) for c, r in (("a", "r1"), ("b", "r2"), ("c", "r1"))]
    first = plan(model, sites, links((20.0, 10.0)))
    second = plan(model, sites[::-1], links((20.0, 10.0)))
    assert first is not None and first == second


def test_missing_links_cannot_be_cut_across() -> None:
    model = layers(1, 1, memory_gib=30)
    sites = [site("a", "r1", memory_gib=40, nodes=(1,)), site("b", "r2", memory_gib=40, nodes=(1,))]
    assert plan(model, sites, {("r1", "r1"): LAN, ("r2", "r2"): LAN}) is None
    reason = infeasible_reason(model, sites, {("r1", "r1"): LAN, ("r2", "r2"): LAN})
    assert reason is not None and "link" in reason
    assert plan(model, sites, links((10.0, 10.0))) is not None


def test_a_network_may_be_a_function() -> None:
    model = layers(1, 1)
    sites = [site("a", "r1", nodes=(1,)), site("b", "r2", nodes=(1,))]
    result = plan(model, sites, lambda src, dst: LAN if src == dst else (30.0, 10.0))
    assert result is not None
    assert result.stages[0].transfer_s == pytest.approx(10 * 8 / (1000 * 10) + 0.030)


def test_sites_without_free_gpus_or_speed_are_ignored() -> None:
    model = layers(1)
    sites = [site("a", nodes=(0, 0)), site("b", speed=0.0)]
    assert plan(model, sites, links(LAN)) is None
    assert infeasible_reason(model, sites, links(LAN)) == (
        "none of the 2 site(s) offered has free GPUs with a positive speed for this job"
    )


def test_beyond_max_sites_the_sites_with_most_capacity_are_kept() -> None:
    model = layers(1, 1, 1)
    sites = [site("small", nodes=(1,)), site("big", nodes=(8,), speed=2.0), site("mid", nodes=(4,))]
    result = plan(model, sites, links(LAN), max_sites=1)
    assert result is not None
    assert {s.site.cluster for s in result.stages} == {"big"}


def test_beyond_max_sites_free_gpus_the_model_cannot_use_do_not_count() -> None:
    # 3 GiB of layers on 16 GiB GPUs: one GPU holds the whole model, so a stage never takes more.
    model = layers(1, 1, 1)
    many_slow = site("many-slow", nodes=(8, 8, 8), speed=0.5, memory_gib=16.0)
    few_fast = site("few-fast", nodes=(1,), speed=2.0, memory_gib=16.0)
    assert useful_capacity(many_slow, 3.0) == 0.5
    assert useful_capacity(few_fast, 3.0) == 2.0
    result = plan(model, [many_slow, few_fast], links(LAN), max_sites=1)
    assert result is not None
    assert layout(result) == [("few-fast", 0, 2)]
    # A model needing 40 GiB takes 3 GPUs of 16 GiB: the slow site can use 3, the fast one only its 1.
    big = layers(1, 1, 1, memory_gib=40.0 / 3)
    assert useful_capacity(many_slow, 40.0) == 1.5
    assert useful_capacity(few_fast, 40.0) == 2.0
    assert useful_capacity(site("capped", nodes=(8,), max_gpus=2, memory_gib=16.0), 40.0) == 2.0
    assert plan(big, [many_slow, few_fast], links(LAN), max_sites=2) is not None


def test_infeasible_reason_names_the_memory_shortfall() -> None:
    model = layers(1, 1, 1, memory_gib=100)
    sites = [site("a", memory_gib=40, nodes=(4,)), site("b", memory_gib=40, nodes=(2,))]
    assert plan(model, sites, links(LAN)) is None
    assert infeasible_reason(model, sites, links(LAN)) == (
        "the model needs 300 GiB; the largest free total is 216 GiB across 2 site(s) (a/A100, b/A100)"
        " with at most 8 stage(s) and 90% of each GPU's memory usable"
    )


def test_infeasible_reason_names_a_layer_no_site_can_hold() -> None:
    model = [Layer(name="embed", compute_s=1, memory_gib=500), Layer(compute_s=1)]
    sites = [site("a", memory_gib=40, nodes=(8,))]
    reason = infeasible_reason(model, sites, links(LAN))
    assert reason is not None and reason.startswith("layer 'embed' (#0) needs 500 GiB")


def test_infeasible_reason_is_none_when_a_plan_exists() -> None:
    assert infeasible_reason(layers(1), [site("a")], links(LAN)) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"usable_fraction": 0.0}, "usable_fraction"),
        ({"max_stages": 0}, "max_stages"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(PipelineError, match=message):
        plan(layers(1), [site("a")], links(LAN), **kwargs)  # type: ignore[arg-type]


def test_bad_input_is_refused() -> None:
    with pytest.raises(PipelineError, match="at least one layer"):
        plan([], [site("a")], links(LAN))
    with pytest.raises(PipelineError, match="listed twice"):
        plan(layers(1), [site("a"), site("a")], links(LAN))
    with pytest.raises(PipelineError, match="gpu_memory_gib"):
        site("a", memory_gib=0)
    with pytest.raises(PipelineError, match="listed twice in free_gpus"):
        Site("a", "r1", "A100", 1.0, 80.0, (("n1", 2), ("n1", 2)))
    with pytest.raises(PipelineError, match="max_sites"):
        plan(layers(1), [site("a")], links(LAN), max_sites=17)
    with pytest.raises(PipelineError, match="rtt_ms"):
        plan(layers(1, 1), [site("a", nodes=(1,)), site("b", nodes=(1,))], lambda s, d: (-1.0, 1.0))


def test_the_formulas() -> None:
    assert stage_gpus(0, 80) == 1
    assert stage_gpus(72, 80) == 1  # exactly 90 % of one GPU
    assert stage_gpus(72.5, 80) == 2
    assert transfer_s(1000, 20, 8) == pytest.approx(1.0 + 0.02)
    assert transfer_s(1, 1, 0) == math.inf


# -- against brute force ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Brute:
    bottleneck_s: float
    stages: int
    latency_s: float
    order: tuple[tuple[tuple[str, str], int], ...]
    """(site key, last layer) per stage of the plan the tie-breaks choose."""


def brute_force(
    model: Sequence[Layer],
    sites: Sequence[Site],
    net: Mapping[tuple[str, str], tuple[float, float]],
    max_stages: int,
) -> Brute | None:
    """Every cut into contiguous stages and every ordered choice of distinct sites."""
    n = len(model)
    found: list[tuple[float, int, float, tuple[tuple[tuple[str, str], int], ...]]] = []
    for k in range(1, min(max_stages, n) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            spans = [(bounds[i], bounds[i + 1] - 1) for i in range(k)]
            for chosen in itertools.permutations(sites, k):
                times: list[float] = []
                for idx, ((first, last), where) in enumerate(zip(spans, chosen, strict=True)):
                    memory = sum(layer.memory_gib for layer in model[first : last + 1])
                    gpus = stage_gpus(memory, where.gpu_memory_gib, USABLE)
                    cap = sum(free for _, free in where.free_gpus)
                    if where.max_gpus_per_stage is not None:
                        cap = min(cap, where.max_gpus_per_stage)
                    if where.speed_per_gpu <= 0 or gpus > cap:
                        break
                    times.append(
                        sum(layer.compute_s for layer in model[first : last + 1])
                        / (gpus * where.speed_per_gpu)
                    )
                    if idx + 1 < k:
                        rtt_ms, bandwidth_gbps = net.get((where.region, chosen[idx + 1].region), (0.0, 0.0))
                        times.append(transfer_s(model[last].activation_mb, rtt_ms, bandwidth_gbps))
                        if math.isinf(times[-1]):  # no link: no cut here
                            break
                else:
                    order = tuple((where.key, last) for (_, last), where in zip(spans, chosen, strict=True))
                    found.append((max(times), k, math.fsum(times), order))
    if not found:
        return None
    best = min(b for b, _, _, _ in found)
    near = [(k, total, order) for b, k, total, order in found if b <= best * (1 + 1e-9)]
    fewest = min(k for k, _, _ in near)
    least = min(total for k, total, _ in near if k == fewest)
    first = min(order for k, total, order in near if k == fewest and total <= least * (1 + 1e-9))
    return Brute(best, fewest, least, first)


@st.composite
def instances(
    draw: st.DrawFn, max_layers: int = 5, max_sites: int = 3
) -> tuple[list[Layer], list[Site], dict[tuple[str, str], tuple[float, float]], int]:
    model = [
        Layer(
            compute_s=draw(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])),
            memory_gib=draw(st.sampled_from([0.0, 4.0, 8.0, 12.0, 20.0, 30.0])),
            activation_mb=draw(st.sampled_from([0.0, 10.0, 100.0, 1000.0])),
        )
        for _ in range(draw(st.integers(1, max_layers)))
    ]
    sites = [
        Site(
            cluster=f"c{i}",
            region=draw(st.sampled_from(["r1", "r2"])),
            gpu_model=draw(st.sampled_from(["A100", "T4"])),
            speed_per_gpu=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
            gpu_memory_gib=draw(st.sampled_from([16.0, 24.0, 40.0])),
            free_gpus=tuple((f"c{i}-n{j}", draw(st.integers(0, 3))) for j in range(draw(st.integers(1, 2)))),
            max_gpus_per_stage=draw(st.one_of(st.none(), st.integers(1, 3))),
        )
        for i in range(draw(st.integers(1, max_sites)))
    ]
    net: dict[tuple[str, str], tuple[float, float]] = {}
    for a, b in itertools.product(["r1", "r2"], repeat=2):
        if draw(st.booleans()) or a == b:
            net[(a, b)] = (
                draw(st.sampled_from([1.0, 20.0, 80.0])),
                draw(st.sampled_from([0.5, 10.0, 100.0])),
            )
    return model, sites, net, draw(st.integers(1, 4))


def assert_valid(result: PipelinePlan, model: Sequence[Layer], max_stages: int) -> None:
    """Stages are contiguous and cover every layer once, use each site once and fit its free GPUs."""
    assert result.step_s == result.bottleneck_s
    assert result.stages[0].first_layer == 0 and result.stages[-1].last_layer == len(model) - 1
    for before, after in itertools.pairwise(result.stages):
        assert after.first_layer == before.last_layer + 1
    assert len({s.site.key for s in result.stages}) == len(result.stages) <= max_stages
    for k, stage in enumerate(result.stages):
        assert stage.first_layer <= stage.last_layer
        free = dict(stage.site.free_gpus)
        assert sum(g for _, g in stage.allocations) == stage.gpus
        assert all(0 < g <= free[node] for node, g in stage.allocations)
        assert len({node for node, _ in stage.allocations}) == len(stage.allocations)
        if stage.site.max_gpus_per_stage is not None:
            assert stage.gpus <= stage.site.max_gpus_per_stage
        span = model[stage.first_layer : stage.last_layer + 1]
        memory = sum(layer.memory_gib for layer in span)
        assert memory <= stage.gpus * stage.site.gpu_memory_gib * USABLE * (1 + 1e-9)
        work = sum(layer.compute_s for layer in span)
        assert stage.compute_s == pytest.approx(work / (stage.gpus * stage.site.speed_per_gpu), rel=1e-9)
        assert max(stage.compute_s, stage.transfer_s) <= result.bottleneck_s
        if k + 1 == len(result.stages):
            assert stage.transfer_s == 0


@settings(max_examples=400, deadline=None)
@given(instances())
def test_the_plan_matches_brute_force(
    case: tuple[list[Layer], list[Site], dict[tuple[str, str], tuple[float, float]], int],
) -> None:
    model, sites, net, max_stages = case
    expected = brute_force(model, sites, net, max_stages)
    result = plan(model, sites, net, max_stages=max_stages, usable_fraction=USABLE)
    single = best_single(model, sites, usable_fraction=USABLE)
    if single is not None:  # the same figures as the one-stage plan
        alone = plan(model, sites, net, max_stages=1, usable_fraction=USABLE)
        assert alone == single
    if expected is None:
        assert result is None
        assert infeasible_reason(model, sites, net, max_stages=max_stages, usable_fraction=USABLE)
        return
    assert result is not None
    assert_valid(result, model, max_stages)
    assert result.bottleneck_s == pytest.approx(expected.bottleneck_s, rel=1e-9)
    assert len(result.stages) == expected.stages
    assert result.latency_s == pytest.approx(expected.latency_s, rel=1e-9)
    assert tuple((s.site.key, s.last_layer) for s in result.stages) == expected.order
    assert plan(model, sites[::-1], net, max_stages=max_stages, usable_fraction=USABLE) == result
    if single is not None:
        assert result.bottleneck_s <= single.bottleneck_s
    # searched in blocks, the plan is still valid, and no better than the exact one
    blocked = plan(model, sites, net, max_stages=max_stages, usable_fraction=USABLE, max_layers=2)
    if blocked is not None:
        assert_valid(blocked, model, max_stages)
        assert blocked.bottleneck_s >= result.bottleneck_s * (1 - 1e-9)


def twin(s: Site, extra: int) -> Site:
    """The same site under another name (same key order), on other nodes, ``extra`` more GPUs free."""
    return Site(
        cluster=f"twin-{s.cluster}",
        region=s.region,
        gpu_model=s.gpu_model,
        speed_per_gpu=s.speed_per_gpu,
        gpu_memory_gib=s.gpu_memory_gib,
        free_gpus=(*tuple((f"twin-{node}", free) for node, free in s.free_gpus), ("twin-spare", extra)),
        max_gpus_per_stage=s.max_gpus_per_stage,
    )


@settings(max_examples=200, deadline=None)
@given(instances(max_sites=4), st.integers(0, 64))
def test_a_remembered_search_gives_what_a_fresh_one_would(
    case: tuple[list[Layer], list[Site], dict[tuple[str, str], tuple[float, float]], int], extra: int
) -> None:
    model, sites, net, max_stages = case
    plan(model, sites, net, max_stages=max_stages, usable_fraction=USABLE)  # remembered
    twins = [twin(s, extra) for s in sites]
    served = plan(model, twins, net, max_stages=max_stages, usable_fraction=USABLE)
    pipeline._PLANS.clear()
    assert plan(model, twins, net, max_stages=max_stages, usable_fraction=USABLE) == served
    if served is not None:
        assert_valid(served, model, max_stages)
        assert all(s.site.cluster.startswith("twin-") for s in served.stages)


def test_sites_that_differ_only_in_names_and_unusable_gpus_share_one_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    searches: list[int] = []
    search = pipeline._search

    def counting(*args: object, **kwargs: object) -> object:
        searches.append(1)
        return search(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "_search", counting)
    pipeline._PLANS.clear()
    model = layers(1, 1, 1, 1, memory_gib=30)  # 120 GiB: 4 GPUs of 40 GiB hold it whole
    pair = [site("a", memory_gib=40, nodes=(2,)), site("b", "r2", memory_gib=40, nodes=(2,))]
    first = plan(model, pair, links((20.0, 10.0)))
    assert first is not None and layout(first) == [("a", 0, 1), ("b", 2, 3)]
    others = [site("x", memory_gib=40, nodes=(1, 1)), site("y", "r2", memory_gib=40, nodes=(2,))]
    second = plan(model, others, links((20.0, 10.0)))
    assert second is not None and layout(second) == [("x", 0, 1), ("y", 2, 3)]
    assert second.stages[0].allocations == (("x-n0", 1), ("x-n1", 1))  # the new site's own nodes
    assert len(searches) == 1
    # GPUs the model cannot use (more than the 4 it needs whole) change nothing either ...
    roomy = [site("a", memory_gib=40, nodes=(4,)), site("b", "r2", memory_gib=40, nodes=(2,))]
    plan(model, roomy, links((20.0, 10.0)))
    plan(model, [site("a", memory_gib=40, nodes=(9,)), pair[1]], links((20.0, 10.0)))
    assert len(searches) == 2
    # ... but what the search reads does: a link, a speed, GPUs below the need
    assert plan(model, pair, links((20.0, 0.5))) is not None
    assert plan(model, [site("a", memory_gib=40, nodes=(2,), speed=2.0), pair[1]], links((20.0, 10.0)))
    assert plan(model, [site("a", memory_gib=40, nodes=(3,)), pair[1]], links((20.0, 10.0)))
    assert len(searches) == 5


def test_deep_models_are_cut_only_at_the_quietest_layer_of_each_window() -> None:
    # 8 layers in 4 windows of 2: blocks end after layers 1, 2 and 4, where the least is sent
    sent = [5, 1, 3, 9, 2, 8, 7, 0]
    model = [Layer(compute_s=1, memory_gib=1, activation_mb=mb) for mb in sent]
    sites = [site(c, nodes=(1,)) for c in "abcdefgh"]
    result = plan(model, sites, links(LAN), max_layers=4)
    assert result is not None
    assert {s.last_layer for s in result.stages} <= {1, 2, 4, 7}
    assert result.bottleneck_s == pytest.approx(3.0)  # the last block, layers 5..7, cannot be cut
    exact = plan(model, sites, links(LAN))
    assert exact is not None and len(exact.stages) == 8
    assert exact.bottleneck_s == pytest.approx(1.0)


def test_the_memo_sizes_the_whole_model_as_the_search_does() -> None:
    # 0.1 + 0.2 + 0.3 sums to 0.6 exactly (fsum) but to 0.6000000000000001 as running sums (the
    # search's arithmetic); on GPUs of this memory that is 1 GPU against 2. A site with 2 free and
    # one with 1 must not share a remembered search.
    gpu = 0.6666666659999999
    assert stage_gpus(math.fsum([0.1, 0.2, 0.3]), gpu) == 1
    model = [Layer(compute_s=1.0, memory_gib=m, activation_mb=1.0) for m in (0.1, 0.2, 0.3)]
    two = plan(model, [site("cb", memory_gib=gpu, nodes=(2,))], links(LAN), max_stages=1)
    assert two is not None and two.stages[0].gpus == 2
    assert plan(model, [site("ca", memory_gib=gpu, nodes=(1,))], links(LAN), max_stages=1) is None
    pipeline._PLANS.clear()
    assert plan(model, [site("ca", memory_gib=gpu, nodes=(1,))], links(LAN), max_stages=1) is None
    assert plan(model, [site("cb", memory_gib=gpu, nodes=(2,))], links(LAN), max_stages=1) == two

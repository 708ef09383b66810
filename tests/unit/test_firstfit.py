"""First-fit placement: never over-allocates, places whole gangs or nothing, explains why not."""

from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.model.capacity import NodeCapacity
from loom.sched.firstfit import CapacityIndex, Placement, Unschedulable, place
from loom_proto import JobSpec, Resources, Work

MODELS = ("A100", "V100", "T4")


def job(workers: int = 1, gpus: int = 1, models: Sequence[str] = ()) -> JobSpec:
    return JobSpec(
        job_id="job-1",
        tenant="acme",
        workers=workers,
        resources=Resources(gpus=gpus, gpu_models=list(models)),
        work=Work(steps=10),
    )


def node(
    name: str,
    cluster: str = "c1",
    *,
    model: str | None = "A100",
    total: int = 8,
    reserved: int = 0,
    schedulable: bool = True,
) -> NodeCapacity:
    return NodeCapacity(
        node=name,
        cluster=cluster,
        region=f"r-{cluster}",
        zone="z1",
        gpu_model=model,
        gpus_total=total,
        gpus_reserved=reserved,
        schedulable=schedulable,
    )


def book(*caps: NodeCapacity) -> dict[str, NodeCapacity]:
    return {c.node: c for c in caps}


# -- examples ----------------------------------------------------------------------------------------


def test_places_a_single_worker_on_a_free_node() -> None:
    result = place(job(gpus=4), book(node("n1")))
    assert result == Placement(cluster="c1", region="r-c1", gpu_model="A100", allocations=(("n1", 4),))


def test_packs_workers_onto_the_node_with_most_free_gpus_first() -> None:
    result = place(job(workers=3, gpus=2), book(node("n1", reserved=6), node("n2", reserved=2), node("n3")))
    assert isinstance(result, Placement)
    assert result.allocations == (("n3", 6),)


def test_spreads_a_gang_over_nodes_when_no_single_node_holds_it() -> None:
    result = place(job(workers=4, gpus=4), book(node("n1"), node("n2")))
    assert isinstance(result, Placement)
    assert sorted(result.allocations) == [("n1", 8), ("n2", 8)]


def test_never_splits_one_worker_across_nodes() -> None:
    # 3 + 3 free GPUs, but a worker needs 4 on one node.
    result = place(job(gpus=4), book(node("n1", reserved=5), node("n2", reserved=5)))
    assert isinstance(result, Unschedulable)
    assert not result.impossible


def test_chooses_the_first_cluster_by_id() -> None:
    result = place(job(gpus=2), book(node("b1", "beta"), node("a1", "alpha"), node("g1", "gamma")))
    assert isinstance(result, Placement)
    assert result.cluster == "alpha"


def test_uses_only_allowed_models() -> None:
    result = place(
        job(gpus=2, models=["V100"]), book(node("n1", "a", model="A100"), node("n2", "b", model="V100"))
    )
    assert isinstance(result, Placement)
    assert (result.cluster, result.gpu_model, result.allocations) == ("b", "V100", (("n2", 2),))


def test_never_mixes_models_in_one_gang() -> None:
    # One A100 node and one V100 node in the same cluster: 1 worker fits on each, but not 2 together.
    result = place(job(workers=2, gpus=8), book(node("n1", model="A100"), node("n2", model="V100")))
    assert isinstance(result, Unschedulable)
    assert result.impossible


def test_skips_unschedulable_nodes() -> None:
    result = place(job(gpus=4), book(node("n1", schedulable=False), node("n2", total=4)))
    assert isinstance(result, Placement)
    assert result.allocations == (("n2", 4),)


def test_a_node_reserved_beyond_its_total_offers_nothing() -> None:
    # The total can shrink under existing reservations (a GPU failed).
    cap = node("n1", total=4, reserved=6)
    assert cap.gpus_free == 0
    assert isinstance(place(job(), book(cap)), Unschedulable)


def test_no_nodes_at_all_means_wait() -> None:
    result = place(job(), {})
    assert isinstance(result, Unschedulable)
    assert not result.impossible
    assert "no cluster has joined" in result.reason


def test_no_node_of_an_allowed_model_is_impossible_and_names_the_models() -> None:
    result = place(
        job(models=["H100", "B200"]), book(node("n1", model="A100"), node("cpu1", model=None, total=0))
    )
    assert isinstance(result, Unschedulable)
    assert result.impossible
    assert "B200, H100" in result.reason


def test_cpu_only_nodes_never_host_gpu_work() -> None:
    result = place(job(), book(node("cpu1", model=None, total=0)))
    assert isinstance(result, Unschedulable)
    assert result.impossible


def test_capacity_that_exists_but_is_taken_means_wait_and_says_where() -> None:
    result = place(job(workers=2, gpus=4), book(node("n1", reserved=8), node("n2", reserved=6)))
    assert isinstance(result, Unschedulable)
    assert not result.impossible
    assert "2 worker(s) x 4 GPU(s)" in result.reason
    assert "c1 (A100)" in result.reason


def test_a_drained_node_that_could_fit_means_wait_not_reject() -> None:
    result = place(job(gpus=8), book(node("n1", schedulable=False)))
    assert isinstance(result, Unschedulable)
    assert not result.impossible


def test_a_worker_larger_than_any_node_is_impossible_and_names_the_largest_node() -> None:
    result = place(job(gpus=16), book(node("n1", total=8), node("n2", "c2", total=4)))
    assert isinstance(result, Unschedulable)
    assert result.impossible
    assert "1 worker(s) x 16 GPU(s)" in result.reason
    assert "largest node has 8 GPUs" in result.reason
    assert "at most 8 per worker" in result.reason


def test_a_gang_larger_than_any_cluster_is_impossible_and_names_the_best_cluster() -> None:
    caps = book(node("a1", "a"), node("b1", "b"), node("b2", "b"), node("b3", "b", total=4))
    result = place(job(workers=6, gpus=4), caps)
    assert isinstance(result, Unschedulable)
    assert result.impossible
    assert "6 worker(s) x 4 GPU(s)" in result.reason
    assert "the most any cluster can hold is 5 worker(s) on b (A100)" in result.reason


# -- properties --------------------------------------------------------------------------------------


@st.composite
def capacity_books(draw: st.DrawFn) -> dict[str, NodeCapacity]:
    count = draw(st.integers(min_value=0, max_value=12))
    caps = {}
    for i in range(count):
        total = draw(st.integers(min_value=0, max_value=8))
        model = draw(st.sampled_from((*MODELS, None)))
        cluster = draw(st.sampled_from(("c0", "c1", "c2")))
        caps[f"n{i}"] = NodeCapacity(
            node=f"n{i}",
            cluster=cluster,
            region=f"r-{cluster}",
            zone=draw(st.sampled_from(("z1", "z2"))),
            gpu_model=model,
            gpus_total=total,
            gpus_reserved=draw(st.integers(min_value=0, max_value=total + 2)),
            schedulable=draw(st.booleans()),
        )
    return caps


jobs = st.builds(
    job,
    workers=st.integers(min_value=1, max_value=6),
    gpus=st.integers(min_value=1, max_value=8),
    models=st.lists(st.sampled_from(MODELS), max_size=2, unique=True),
)


def _groups(spec: JobSpec, caps: Mapping[str, NodeCapacity]) -> dict[tuple[str, str], list[NodeCapacity]]:
    allowed = set(spec.resources.gpu_models)
    groups: dict[tuple[str, str], list[NodeCapacity]] = {}
    for cap in caps.values():
        if cap.gpu_model is not None and (not allowed or cap.gpu_model in allowed):
            groups.setdefault((cap.cluster, cap.gpu_model), []).append(cap)
    return groups


def _workers_on(caps: list[NodeCapacity], per_worker: int, *, free: bool) -> int:
    return sum((c.gpus_free if free else c.gpus_total) // per_worker for c in caps)


@settings(max_examples=150, deadline=None)
@given(spec=jobs, caps=capacity_books())
def test_a_placement_respects_capacity_models_cluster_and_gang_size(
    spec: JobSpec, caps: dict[str, NodeCapacity]
) -> None:
    result = place(spec, caps)
    if not isinstance(result, Placement):
        return
    nodes_used = [n for n, _ in result.allocations]
    assert len(nodes_used) == len(set(nodes_used)), "one entry per node"
    per_worker = spec.resources.gpus
    for name, gpus in result.allocations:
        cap = caps[name]
        assert 0 < gpus <= cap.gpus_free, f"{name}: {gpus} allocated, {cap.gpus_free} free"
        assert gpus % per_worker == 0, "workers are never split across nodes"
        assert cap.cluster == result.cluster
        assert cap.region == result.region
        assert cap.gpu_model == result.gpu_model
        assert cap.schedulable
    if spec.resources.gpu_models:
        assert result.gpu_model in spec.resources.gpu_models
    assert sum(g for _, g in result.allocations) == spec.workers * per_worker


@settings(max_examples=150, deadline=None)
@given(spec=jobs, caps=capacity_books())
def test_a_gang_is_placed_whole_exactly_when_some_cluster_can_hold_it_now(
    spec: JobSpec, caps: dict[str, NodeCapacity]
) -> None:
    per_worker = spec.resources.gpus
    groups = _groups(spec, caps)
    fits_now = sorted(k for k, g in groups.items() if _workers_on(g, per_worker, free=True) >= spec.workers)
    result = place(spec, caps)
    if fits_now:
        assert isinstance(result, Placement)
        assert (result.cluster, result.gpu_model) == fits_now[0], "first cluster (then model) by id"
    else:
        assert isinstance(result, Unschedulable), "no partial gang is ever placed"


@settings(max_examples=150, deadline=None)
@given(spec=jobs, caps=capacity_books())
def test_unschedulable_is_impossible_exactly_when_waiting_cannot_help(
    spec: JobSpec, caps: dict[str, NodeCapacity]
) -> None:
    result = place(spec, caps)
    if not isinstance(result, Unschedulable):
        return
    per_worker = spec.resources.gpus
    could_ever_fit = any(
        _workers_on(g, per_worker, free=False) >= spec.workers for g in _groups(spec, caps).values()
    )
    assert result.impossible == (bool(caps) and not could_ever_fit)
    assert result.reason
    if result.impossible and _groups(spec, caps):
        assert f"{spec.workers} worker(s) x {per_worker} GPU(s)" in result.reason


@settings(max_examples=100, deadline=None)
@given(spec=jobs, caps=capacity_books())
def test_the_decision_does_not_depend_on_the_book_order(spec: JobSpec, caps: dict[str, NodeCapacity]) -> None:
    forward, backward = place(spec, caps), place(spec, dict(reversed(list(caps.items()))))
    if isinstance(forward, Placement):
        assert forward == backward
    else:
        assert isinstance(backward, Unschedulable)
        assert forward.impossible == backward.impossible


@pytest.mark.parametrize("order", ["c0 first", "c1 first"])
def test_the_unschedulable_reason_does_not_depend_on_the_book_order(order: str) -> None:
    """The book comes from ``SELECT ... FROM node_allocations`` without ORDER BY, so a reason that
    follows dict order can name a different cluster for the same state from one run to the next."""
    caps = [node("a", "c0", reserved=8), node("b", "c1", reserved=8)]
    if order == "c1 first":
        caps.reverse()
    result = place(job(gpus=8), book(*caps))
    assert isinstance(result, Unschedulable)
    assert "fit on c0 (A100)" in result.reason, "the first cluster by id, as for a placement"


@pytest.mark.parametrize(
    ("total", "reserved", "schedulable", "free"),
    [
        (8, 0, True, 8),
        (8, 3, True, 5),
        (8, 8, True, 0),
        (4, 6, True, 0),
        (8, 0, False, 0),
    ],
)
def test_gpus_free(total: int, reserved: int, schedulable: bool, free: int) -> None:
    assert node("n", total=total, reserved=reserved, schedulable=schedulable).gpus_free == free


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(jobs, min_size=1, max_size=8), caps=capacity_books())
def test_a_cycle_of_placements_never_promises_a_gpu_twice(
    specs: list[JobSpec], caps: dict[str, NodeCapacity]
) -> None:
    index = CapacityIndex(caps)
    promised: dict[str, int] = {}
    for spec in specs:
        result = index.place(spec)
        if isinstance(result, Placement):
            index.take(result)
            for name, gpus in result.allocations:
                promised[name] = promised.get(name, 0) + gpus
    for name, gpus in promised.items():
        assert gpus <= caps[name].gpus_free, f"{name}: {gpus} promised, {caps[name].gpus_free} free"


def test_a_taken_placement_is_seen_by_the_next_job_of_the_cycle() -> None:
    index = CapacityIndex(book(node("a1", "a"), node("b1", "b")))
    first = index.place(job(gpus=6))
    assert isinstance(first, Placement)
    index.take(first)
    second = index.place(job(gpus=6))
    assert isinstance(second, Placement)
    assert (first.cluster, second.cluster) == ("a", "b")
    index.take(second)
    third = index.place(job(gpus=6))
    assert isinstance(third, Unschedulable)
    assert not third.impossible

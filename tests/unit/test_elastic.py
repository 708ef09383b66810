"""Elastic jobs: sizes stay within [min, max], growth fits free GPUs, shrinking frees what is needed."""

from collections import Counter
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.errors import InvalidInputError
from loom.sched.elastic import ElasticError, ElasticJob, Resize, initial_workers, plan_grow, plan_shrink


def elastic(
    job_id: str,
    *allocations: tuple[str, int],
    priority: int = 100,
    gpus_per_worker: int = 2,
    min_workers: int = 1,
    max_workers: int = 8,
    cluster: str = "c1",
) -> ElasticJob:
    return ElasticJob(
        job_id=job_id,
        priority=priority,
        gpus_per_worker=gpus_per_worker,
        min_workers=min_workers,
        max_workers=max_workers,
        workers=sum(g for _, g in allocations) // gpus_per_worker,
        cluster=cluster,
        allocations=tuple(allocations),
    )


# -- initial_workers ---------------------------------------------------------------------------------


def test_starts_with_as_many_workers_as_fit_up_to_max() -> None:
    assert initial_workers({"n1": 8, "n2": 3}, 2, 1, 4) == (4, (("n1", 8),))
    assert initial_workers({"n1": 4, "n2": 3}, 2, 1, 8) == (3, (("n1", 4), ("n2", 2)))


def test_does_not_start_below_min() -> None:
    assert initial_workers({"n1": 4, "n2": 3}, 2, 4, 8) is None


def test_refuses_min_above_max() -> None:
    with pytest.raises(ElasticError, match=r"min_workers \(5\) must be at least 1 and at most workers \(4\)"):
        initial_workers({}, 1, 5, 4)
    assert issubclass(ElasticError, InvalidInputError)


def test_a_job_whose_gpus_are_not_whole_workers_is_refused() -> None:
    with pytest.raises(ElasticError, match="not whole workers"):
        ElasticJob("j", 1, 2, 1, 4, 1, "c1", (("n1", 1), ("n2", 1)))
    with pytest.raises(ElasticError, match="outside"):
        ElasticJob("j", 1, 2, 2, 4, 1, "c1", (("n1", 2),))


# -- plan_grow ---------------------------------------------------------------------------------------


def test_grows_onto_nodes_it_already_uses_first() -> None:
    job = elastic("a", ("n1", 2), max_workers=3)
    [resize] = plan_grow([job], {"c1": {"n1": 2, "n2": 8}})
    assert resize == Resize(
        job_id="a",
        cluster="c1",
        workers=3,
        allocations=(("n1", 4), ("n2", 2)),
        delta_allocations=(("n1", 2), ("n2", 2)),
    )


def test_higher_priority_grows_first() -> None:
    high = elastic("high", ("n1", 2), priority=200)
    low = elastic("low", ("n2", 2), priority=50)
    resizes = plan_grow([low, high], {"c1": {"n3": 4}})
    assert [(r.job_id, r.workers) for r in resizes] == [("high", 3)]


def test_equal_priority_jobs_grow_in_turn() -> None:
    a = elastic("a", ("n1", 2))
    b = elastic("b", ("n2", 2))
    resizes = plan_grow([b, a], {"c1": {"n3": 6}})
    assert [(r.job_id, r.workers) for r in resizes] == [("a", 3), ("b", 2)]
    resizes = plan_grow([b, a], {"c1": {"n3": 8}})
    assert [(r.job_id, r.workers) for r in resizes] == [("a", 3), ("b", 3)]


def test_grows_only_on_its_own_cluster_and_not_past_max() -> None:
    job = elastic("a", ("n1", 2), max_workers=2)
    assert plan_grow([job], {"c2": {"m1": 64}}) == []
    [resize] = plan_grow([job], {"c1": {"n1": 64}})
    assert resize.workers == 2


# -- plan_shrink -------------------------------------------------------------------------------------


def test_shrinks_the_lowest_priority_first_removing_whole_workers() -> None:
    low = elastic("low", ("n1", 4), ("n2", 2), priority=10)
    mid = elastic("mid", ("n3", 8), priority=50)
    [resize] = plan_shrink([mid, low], {"c1": 3}, priority=100)
    assert resize == Resize(
        job_id="low",
        cluster="c1",
        workers=1,
        allocations=(("n1", 2),),
        delta_allocations=(("n1", -2), ("n2", -2)),
    )


def test_moves_on_to_the_next_job_once_one_is_at_its_min() -> None:
    low = elastic("low", ("n1", 4), priority=10, min_workers=1)
    mid = elastic("mid", ("n3", 8), priority=50, min_workers=2)
    resizes = plan_shrink([mid, low], {"c1": 4}, priority=100)
    assert [(r.job_id, r.workers) for r in resizes] == [("low", 1), ("mid", 3)]
    assert plan_shrink([mid, low], {"c1": 7}, priority=100) == []


def test_never_shrinks_higher_priority_jobs() -> None:
    high = elastic("high", ("n1", 8), priority=200)
    assert plan_shrink([high], {"c1": 2}, priority=100) == []
    same = elastic("same", ("n1", 8), priority=100)
    assert [r.workers for r in plan_shrink([same], {"c1": 2}, priority=100)] == [3]


def test_returns_nothing_when_shrinking_cannot_meet_every_need() -> None:
    a = elastic("a", ("n1", 8), min_workers=2)
    b = elastic("b", ("m1", 8), cluster="c2")
    assert plan_shrink([a], {"c1": 8}, priority=100) == []
    assert plan_shrink([a, b], {"c1": 2, "c2": 16}, priority=100) == []
    assert {r.job_id for r in plan_shrink([a, b], {"c1": 2, "c2": 2}, priority=100)} == {"a", "b"}


# -- properties --------------------------------------------------------------------------------------

NODES = ("n0", "n1", "n2", "n3")
CLUSTERS = ("c1", "c2")


@st.composite
def platforms(draw: st.DrawFn) -> tuple[list[ElasticJob], dict[str, dict[str, int]]]:
    """Elastic jobs on nodes of 16 GPUs in two clusters, and what is left free."""
    left = {(c, n): 16 for c in CLUSTERS for n in NODES}
    jobs: list[ElasticJob] = []
    for i in range(draw(st.integers(0, 6))):
        cluster = draw(st.sampled_from(CLUSTERS))
        gpus_per_worker = draw(st.sampled_from([1, 2, 4]))
        allocations: list[tuple[str, int]] = []
        for node in draw(st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True)):
            fit = left[(cluster, node)] // gpus_per_worker
            if fit:
                gpus = draw(st.integers(1, fit)) * gpus_per_worker
                left[(cluster, node)] -= gpus
                allocations.append((node, gpus))
        workers = sum(g for _, g in allocations) // gpus_per_worker
        if not workers:
            continue
        jobs.append(
            ElasticJob(
                job_id=f"j{i}",
                priority=draw(st.sampled_from([10, 50, 100])),
                gpus_per_worker=gpus_per_worker,
                min_workers=draw(st.integers(1, workers)),
                max_workers=workers + draw(st.integers(0, 6)),
                workers=workers,
                cluster=cluster,
                allocations=tuple(allocations),
            )
        )
    free: dict[str, dict[str, int]] = {c: {} for c in CLUSTERS}
    for (cluster, node), gpus in left.items():
        free[cluster][node] = draw(st.integers(0, gpus))
    return jobs, free


def assert_consistent(resize: Resize, job: ElasticJob) -> None:
    assert job.min_workers <= resize.workers <= job.max_workers
    assert resize.cluster == job.cluster
    assert sum(g for _, g in resize.allocations) == resize.workers * job.gpus_per_worker
    assert all(g > 0 and g % job.gpus_per_worker == 0 for _, g in resize.allocations)
    after = Counter(dict(job.allocations))
    for node, delta in resize.delta_allocations:
        after[node] += delta
    assert +after == Counter(dict(resize.allocations))


def by_id(jobs: Sequence[ElasticJob]) -> Mapping[str, ElasticJob]:
    return {job.job_id: job for job in jobs}


@settings(max_examples=150, deadline=None)
@given(platforms())
def test_growth_stays_within_bounds_and_free_capacity_per_node(
    platform: tuple[list[ElasticJob], dict[str, dict[str, int]]],
) -> None:
    jobs, free = platform
    resizes = plan_grow(jobs, free)
    taken: Counter[tuple[str, str]] = Counter()
    for resize in resizes:
        job = by_id(jobs)[resize.job_id]
        assert_consistent(resize, job)
        assert resize.workers > job.workers
        for node, delta in resize.delta_allocations:
            assert delta > 0
            taken[(job.cluster, node)] += delta
    for (cluster, node), gpus in taken.items():
        assert gpus <= free[cluster].get(node, 0)
    # Nothing is left that a job below its max could still use.
    grown = {r.job_id: r.workers for r in resizes}
    for job in jobs:
        if grown.get(job.job_id, job.workers) < job.max_workers:
            left = {n: g - taken[(job.cluster, n)] for n, g in free[job.cluster].items()}
            assert all(g < job.gpus_per_worker for g in left.values())


@settings(max_examples=150, deadline=None)
@given(
    platforms(),
    st.dictionaries(st.sampled_from(CLUSTERS), st.integers(1, 40), min_size=1),
    st.sampled_from([10, 50, 100]),
)
def test_a_shrink_plan_frees_at_least_the_need_never_going_below_min(
    platform: tuple[list[ElasticJob], dict[str, dict[str, int]]], need: dict[str, int], priority: int
) -> None:
    jobs, _ = platform
    resizes = plan_shrink(jobs, need, priority)
    spare = {
        cluster: sum(
            (j.workers - j.min_workers) * j.gpus_per_worker
            for j in jobs
            if j.cluster == cluster and j.priority <= priority
        )
        for cluster in need
    }
    if not resizes:
        assert any(spare[cluster] < gpus for cluster, gpus in need.items())
        return
    freed: Counter[str] = Counter()
    for resize in resizes:
        job = by_id(jobs)[resize.job_id]
        assert_consistent(resize, job)
        assert job.priority <= priority
        assert resize.workers < job.workers
        for _, delta in resize.delta_allocations:
            assert delta < 0
            freed[job.cluster] -= delta
    for cluster, gpus in need.items():
        assert freed[cluster] >= gpus

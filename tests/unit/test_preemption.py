"""Preemption: victims are preemptible and of lower priority, freed whole, needed, and the job then fits."""

from collections.abc import Iterable, Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from loom.sched.firstfit import pack_workers
from loom.sched.preemption import Preemption, RunningJob, choose, select_victims


def running(
    job_id: str,
    priority: int,
    *allocations: tuple[str, int],
    progress: float = 0.5,
    preemptible: bool = True,
    cluster: str = "c1",
    model: str = "A100",
) -> RunningJob:
    return RunningJob(
        job_id=job_id,
        tenant="acme",
        priority=priority,
        progress=progress,
        preemptible=preemptible,
        cluster=cluster,
        gpu_model=model,
        allocations=tuple(allocations),
    )


def ids(victims: Iterable[RunningJob] | None) -> list[str] | None:
    return None if victims is None else [v.job_id for v in victims]


def victim_ids(jobs: list[RunningJob], free: Mapping[str, int], gpus_per_worker: int = 8) -> list[str] | None:
    """Victims for one worker of ``gpus_per_worker`` at priority 9."""
    return ids(
        select_victims(priority=9, gpus_per_worker=gpus_per_worker, workers=1, free=free, running=jobs)
    )


def fits_after(
    free: Mapping[str, int], victims: Iterable[RunningJob], gpus_per_worker: int, workers: int
) -> bool:
    freed = dict(free)
    for victim in victims:
        for node, gpus in victim.allocations:
            freed[node] = freed.get(node, 0) + gpus
    return pack_workers(freed.items(), gpus_per_worker, workers) is not None


# -- select_victims: examples ------------------------------------------------------------------------


def test_no_victims_when_the_job_fits_already() -> None:
    jobs = [running("low", 1, ("n1", 8))]
    assert select_victims(priority=9, gpus_per_worker=4, workers=1, free={"n2": 4}, running=jobs) == ()


def test_stops_the_lowest_priority_job_first() -> None:
    jobs = [running("mid", 5, ("n1", 8)), running("low", 1, ("n2", 8))]
    victims = select_victims(priority=9, gpus_per_worker=8, workers=1, free={}, running=jobs)
    assert ids(victims) == ["low"]


def test_among_equal_priority_stops_the_least_progressed() -> None:
    jobs = [running("far", 1, ("n1", 8), progress=0.9), running("near", 1, ("n2", 8), progress=0.1)]
    assert victim_ids(jobs, {}) == ["near"]


def test_never_stops_equal_or_higher_priority_or_non_preemptible_jobs() -> None:
    jobs = [
        running("same", 5, ("n1", 8)),
        running("higher", 7, ("n2", 8)),
        running("pinned", 1, ("n3", 8), preemptible=False),
    ]
    assert select_victims(priority=5, gpus_per_worker=8, workers=1, free={}, running=jobs) is None


def test_spares_a_cheap_victim_made_unnecessary_by_a_later_one() -> None:
    # "tiny" is cheapest but frees 2 GPUs; "big" alone frees the 8 needed, so "tiny" is spared.
    jobs = [running("tiny", 1, ("n1", 2), progress=0.0), running("big", 2, ("n2", 8))]
    assert victim_ids(jobs, {"n1": 4}) == ["big"]


def test_combines_free_gpus_with_freed_ones_on_the_same_node() -> None:
    jobs = [running("a", 1, ("n1", 4)), running("b", 2, ("n2", 8))]
    assert victim_ids(jobs, {"n1": 4}) == ["a"]


def test_frees_a_gang_whole_across_nodes() -> None:
    gang = running("gang", 1, ("n1", 4), ("n2", 4))
    victims = select_victims(priority=9, gpus_per_worker=4, workers=1, free={}, running=[gang])
    assert victims == (gang,)


def test_none_when_even_every_candidate_is_not_enough() -> None:
    jobs = [running("a", 1, ("n1", 4)), running("b", 1, ("n2", 4))]
    assert select_victims(priority=9, gpus_per_worker=8, workers=1, free={}, running=jobs) is None


# -- choose ------------------------------------------------------------------------------------------


def test_choose_prefers_fewer_victims_then_lower_priority_then_less_progress() -> None:
    jobs = [
        running("x1", 1, ("a1", 4), cluster="a"),
        running("x2", 1, ("a2", 4), cluster="a"),
        running("y", 3, ("b1", 8), cluster="b"),
        running("z", 3, ("c1", 8), cluster="c", progress=0.1),
        running("w", 2, ("d1", 8), cluster="d", model="V100"),
    ]
    free_by_group = {("a", "A100"): {"a1": 4}, ("b", "A100"): {}, ("c", "A100"): {}}
    plan = choose(priority=9, gpus_per_worker=8, workers=1, free_by_group=free_by_group, running=jobs)
    # a needs one victim of priority 1: the least damage.
    assert plan == Preemption(cluster="a", gpu_model="A100", victims=(jobs[0],))
    free_by_group = {("b", "A100"): {}, ("c", "A100"): {}}
    plan = choose(priority=9, gpus_per_worker=8, workers=1, free_by_group=free_by_group, running=jobs)
    assert plan is not None and plan.cluster == "c"
    free_by_group[("d", "V100")] = {}
    plan = choose(priority=9, gpus_per_worker=8, workers=1, free_by_group=free_by_group, running=jobs)
    assert plan is not None and (plan.cluster, plan.gpu_model) == ("d", "V100")


def test_choose_prefers_a_group_where_the_job_fits_without_victims() -> None:
    jobs = [running("x", 1, ("a1", 8), cluster="a")]
    free_by_group = {("a", "A100"): {}, ("b", "A100"): {"b1": 8}}
    plan = choose(priority=9, gpus_per_worker=8, workers=1, free_by_group=free_by_group, running=jobs)
    assert plan == Preemption(cluster="b", gpu_model="A100", victims=())


def test_choose_returns_none_when_no_group_can_make_room() -> None:
    jobs = [running("x", 9, ("a1", 8), cluster="a")]
    free_by_group: dict[tuple[str, str], dict[str, int]] = {("a", "A100"): {}}
    assert choose(priority=9, gpus_per_worker=8, workers=1, free_by_group=free_by_group, running=jobs) is None


# -- properties --------------------------------------------------------------------------------------

NODES = ("n0", "n1", "n2", "n3")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, int], list[RunningJob]]:
    """Nodes of 8 GPUs, each shared by free GPUs and running jobs (some spanning nodes)."""
    left = dict.fromkeys(NODES, 8)
    jobs: list[RunningJob] = []
    for i in range(draw(st.integers(0, 8))):
        allocations = []
        for node in draw(st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True)):
            if left[node] == 0:
                continue
            gpus = draw(st.integers(1, left[node]))
            left[node] -= gpus
            allocations.append((node, gpus))
        if allocations:
            jobs.append(
                running(
                    f"j{i}",
                    draw(st.integers(0, 5)),
                    *allocations,
                    progress=draw(st.floats(0, 1)),
                    preemptible=draw(st.booleans()),
                )
            )
    free = {node: draw(st.integers(0, gpus)) for node, gpus in left.items()}
    return free, jobs


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.integers(0, 6), st.sampled_from([1, 2, 4, 8]), st.integers(1, 4))
def test_victims_are_lower_priority_preemptible_sufficient_and_each_needed(
    scenario: tuple[dict[str, int], list[RunningJob]], priority: int, gpus_per_worker: int, workers: int
) -> None:
    free, jobs = scenario
    victims = select_victims(
        priority=priority, gpus_per_worker=gpus_per_worker, workers=workers, free=free, running=jobs
    )
    candidates = [j for j in jobs if j.preemptible and j.priority < priority]
    if victims is None:
        assert not fits_after(free, candidates, gpus_per_worker, workers)
        return
    assert len({v.job_id for v in victims}) == len(victims)
    for victim in victims:
        assert victim in jobs, "a victim is a whole running job, all its allocations freed"
        assert victim.preemptible and victim.priority < priority
    assert fits_after(free, victims, gpus_per_worker, workers)
    for victim in victims:
        rest = [v for v in victims if v is not victim]
        assert not fits_after(free, rest, gpus_per_worker, workers), f"{victim.job_id} was not needed"

"""DAG jobs: only DAGs pass, errors name what to fix, stages run in order and all of them run."""

import itertools
import random
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.errors import InvalidInputError
from loom.sched.dag import (
    DAG_LABEL,
    STAGE_LABEL,
    DagError,
    dependencies,
    expand,
    ready,
    stage_job_id,
    validate,
)
from loom_proto.jobs import Affinity, DataSpec, JobSubmitted, Resources, Stage, Work


def stage(name: str, *deps: str, workers: int = 1) -> Stage:
    return Stage(name=name, depends_on=list(deps), workers=workers, work=Work(steps=10))


# -- validate: examples ------------------------------------------------------------------------------


def test_orders_a_diamond_with_ties_in_declaration_order() -> None:
    stages = [stage("train", "prep", "fetch"), stage("fetch"), stage("prep"), stage("eval", "train")]
    assert validate(stages) == ("fetch", "prep", "train", "eval")


def test_orders_independent_stages_as_declared() -> None:
    assert validate([stage("c"), stage("a"), stage("b")]) == ("c", "a", "b")


def test_accepts_no_stages() -> None:
    assert validate([]) == ()


def test_accepts_a_dependency_listed_twice() -> None:
    assert validate([stage("a"), stage("b", "a", "a")]) == ("a", "b")


def test_rejects_duplicate_stage_names_naming_them() -> None:
    with pytest.raises(DagError, match=r"used more than once: prep; rename"):
        validate([stage("prep"), stage("train", "prep"), stage("prep")])


def test_rejects_an_unknown_dependency_listing_the_stages() -> None:
    with pytest.raises(DagError) as info:
        validate([stage("prep"), stage("train", "prep2")])
    expected = "stage 'train' depends on 'prep2', which is not a stage; stages are: prep, train"
    assert str(info.value) == expected


def test_rejects_a_stage_that_depends_on_itself() -> None:
    with pytest.raises(DagError, match=r"stage 'a' depends on itself"):
        validate([stage("a", "a")])


def test_names_the_cycle_starting_at_its_first_declared_stage() -> None:
    stages = [stage("x"), stage("c", "a"), stage("a", "b", "x"), stage("b", "c"), stage("d", "a")]
    with pytest.raises(DagError, match=r"stages form a cycle: c -> a -> b -> c \(each depends on the next\)"):
        validate(stages)


def test_dag_error_is_invalid_input_and_never_retryable() -> None:
    with pytest.raises(InvalidInputError) as info:
        validate([stage("a", "b"), stage("b", "a")])
    assert info.value.non_retryable


# -- stage ids and expansion -------------------------------------------------------------------------


def test_stage_job_id_joins_job_and_stage() -> None:
    assert stage_job_id("job-1", "train") == "job-1--train"


def test_stage_job_id_rejects_ids_over_64_characters_saying_how_short() -> None:
    assert len(stage_job_id("j" * 57, "train")) == 64
    with pytest.raises(DagError, match=r"65 characters.*at most 57 characters"):
        stage_job_id("j" * 58, "train")


def test_stage_job_id_rejects_characters_outside_ids() -> None:
    with pytest.raises(DagError, match="not a valid id"):
        stage_job_id("job.1", "train")


def dag_job(**overrides: object) -> JobSubmitted:
    fields: dict[str, object] = {
        "job_id": "pipe",
        "tenant": "acme",
        "name": "nightly",
        "priority": 300,
        "workers": 8,
        "work": Work(steps=1),
        "labels": {"team": "nlp"},
        "preemptible": False,
        "submitted_at": 12.5,
        "stages": [
            Stage(
                name="train",
                depends_on=["prep"],
                task_type="training_comm",
                workers=4,
                resources=Resources(gpus=8, gpu_models=["A100"]),
                work=Work(steps=1000, step_time_s=0.5),
                affinity=Affinity(regions=["eu"]),
            ),
            Stage(
                name="prep",
                task_type="inference",
                work=Work(steps=5),
                data=DataSpec(dataset="d1", region="us", size_gb=10),
            ),
        ],
    }
    fields.update(overrides)
    return msgspec.convert(msgspec.to_builtins(fields), JobSubmitted)


def test_expand_makes_one_labelled_job_per_stage_in_run_order() -> None:
    parent = dag_job()
    prep, train = expand(parent)
    assert [prep.job_id, train.job_id] == ["pipe--prep", "pipe--train"]
    assert train.labels == {"team": "nlp", DAG_LABEL: "pipe", STAGE_LABEL: "train"}
    assert (train.tenant, train.priority, train.preemptible, train.submitted_at) == ("acme", 300, False, 12.5)
    assert train.name == "nightly/train"
    source = parent.stages[0]
    assert (train.task_type, train.workers, train.resources, train.work, train.affinity) == (
        source.task_type,
        source.workers,
        source.resources,
        source.work,
        source.affinity,
    )
    assert prep.data == parent.stages[1].data
    assert train.data is None
    assert prep.stages == [] and train.stages == []


def test_expanded_jobs_survive_the_wire() -> None:
    for child in expand(dag_job()):
        decoded = msgspec.json.decode(msgspec.json.encode(child), type=JobSubmitted)
        assert decoded == child


def test_expand_rejects_a_job_without_stages() -> None:
    with pytest.raises(DagError, match="not a DAG job"):
        expand(dag_job(stages=[]))


def test_expand_rejects_a_cycle() -> None:
    with pytest.raises(DagError, match="cycle"):
        expand(dag_job(stages=[msgspec.to_builtins(stage("a", "b")), msgspec.to_builtins(stage("b", "a"))]))


def test_expand_rejects_a_job_id_too_long_for_its_stages() -> None:
    with pytest.raises(DagError, match="shorten the job id"):
        expand(dag_job(job_id="p" * 60))


def test_expand_rejects_too_many_labels_to_add_its_own() -> None:
    with pytest.raises(DagError, match="at most 62"):
        expand(dag_job(labels={f"k{i}": "v" for i in range(63)}))


# -- ready -------------------------------------------------------------------------------------------


def test_ready_lists_unstarted_stages_whose_dependencies_completed() -> None:
    stages = [stage("a"), stage("b", "a"), stage("c", "a"), stage("d", "b", "c")]
    order, deps = validate(stages), dependencies(stages)
    assert ready(order, deps, completed=set(), started=set()) == ["a"]
    assert ready(order, deps, completed=set(), started={"a"}) == []
    assert ready(order, deps, completed={"a"}, started={"a"}) == ["b", "c"]
    assert ready(order, deps, completed={"a", "b"}, started={"a", "b", "c"}) == []
    assert ready(order, deps, completed={"a", "b", "c"}, started={"a", "b", "c"}) == ["d"]


# -- properties --------------------------------------------------------------------------------------


@st.composite
def random_dags(draw: st.DrawFn) -> tuple[list[Stage], list[tuple[str, str]]]:
    """Stages with edges only from earlier to later nodes, names shuffled; edges are (dep, stage)."""
    size = draw(st.integers(min_value=1, max_value=12))
    names = draw(st.permutations([f"s{i}" for i in range(size)]))
    edges = [(names[i], names[j]) for j in range(size) for i in range(j) if draw(st.booleans())]
    declared = draw(st.permutations(range(size)))
    stages = [stage(names[j], *[dep for dep, s in edges if s == names[j]]) for j in declared]
    return stages, edges


@settings(max_examples=150, deadline=None)
@given(random_dags())
def test_random_dags_validate_and_the_order_respects_every_edge(
    dag: tuple[list[Stage], list[tuple[str, str]]],
) -> None:
    stages, edges = dag
    order = validate(stages)
    assert sorted(order) == sorted(s.name for s in stages)
    position = {name: i for i, name in enumerate(order)}
    for dep, later in edges:
        assert position[dep] < position[later]


def with_dependency(stages: Sequence[Stage], name: str, dep: str) -> list[Stage]:
    return [
        msgspec.structs.replace(s, depends_on=[*s.depends_on, dep]) if s.name == name else s for s in stages
    ]


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.data())
def test_a_back_edge_makes_a_cycle_named_by_real_dependencies(
    dag: tuple[list[Stage], list[tuple[str, str]]], data: st.DataObject
) -> None:
    stages, edges = dag
    if not edges:
        return
    dep, later = data.draw(st.sampled_from(edges))
    broken = with_dependency(stages, dep, later)
    with pytest.raises(DagError) as info:
        validate(broken)
    message = str(info.value)
    assert message.startswith("stages form a cycle: ")
    cycle = message.removeprefix("stages form a cycle: ").split(" (")[0].split(" -> ")
    assert cycle[0] == cycle[-1] and len(cycle) >= 3
    deps = dependencies(broken)
    for a, b in itertools.pairwise(cycle):
        assert b in deps[a], f"{a} does not depend on {b}"


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.randoms(use_true_random=False))
def test_execution_driven_by_ready_respects_dependencies_and_runs_every_stage(
    dag: tuple[list[Stage], list[tuple[str, str]]], rng: random.Random
) -> None:
    stages, _ = dag
    order, deps = validate(stages), dependencies(stages)
    started: set[str] = set()
    completed: set[str] = set()
    running: list[str] = []
    for _ in range(2 * len(stages) + 1):
        for name in ready(order, deps, completed, started):
            assert all(dep in completed for dep in deps[name])
            started.add(name)
            running.append(name)
        if not running:
            break
        # Stages finish in any order; a random subset (at least one) completes each round.
        rng.shuffle(running)
        finished = running[: rng.randint(1, len(running))]
        running = running[len(finished) :]
        completed.update(finished)
    assert completed == {s.name for s in stages}

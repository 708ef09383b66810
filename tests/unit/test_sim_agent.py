"""The sim agent's true-speed knob: a family runs on a GPU model at a speed its profile does not say."""

import pytest

from loom.model.topology import load_topology
from loom_services.cluster_agent.sim import SimCluster, parse_true_speeds


def test_true_speeds_parse_with_families_folded_like_job_families() -> None:
    table = parse_true_speeds(["GRU Speech:T4=0.333", "resnet_50@fp16:A100=1.5"])
    assert table == {("gru-speech", "T4"): 0.333, ("resnet-50@fp16", "A100"): 1.5}


@pytest.mark.parametrize(
    "item", ["gru=0.3", "gru:T4", ":T4=0.3", "gru:=0.3", "gru:T4=0", "gru:T4=-1", "gru:T4=x"]
)
def test_malformed_true_speeds_are_refused(item: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        parse_true_speeds([item])


def test_a_family_with_a_true_speed_runs_slower_and_observes_it_other_families_do_not() -> None:
    cluster = load_topology("small").cluster("c-sea1-a")
    sim = SimCluster(cluster, speed=lambda _m, _t: 2.0, true_speed={("gru-speech", "T4"): 1 / 3})
    assert sim.compute_step_seconds(1.0, "T4", "training_memory", "gru-speech") == pytest.approx(1.5)
    assert sim.compute_step_seconds(1.0, "T4", "training_memory", "resnet") == pytest.approx(0.5)
    assert sim.compute_step_seconds(1.0, "V100M16", "training_memory", "gru-speech") == pytest.approx(0.5)
    # The whole step: compute stretched by the slowdown, over the share of workers the run has.
    step = sim.step_seconds(1.0, "T4", "training_memory", slowdown=2.0, worker_share=0.5, family="gru-speech")
    assert step == pytest.approx(6.0)
    # The cluster's own figure (trust, decay) does not carry the family's truth.
    assert sim.delivered_speed("T4", "training_memory") == pytest.approx(2.0)


def test_an_agents_runs_find_a_jobs_attempts_by_its_index_through_every_change() -> None:
    from loom_services.cluster_agent.agent import RunningJob, _Runs

    def run(job_id: str, attempt: int) -> RunningJob:
        return RunningJob(
            job_id=job_id,
            tenant="t",
            attempt=attempt,
            gpu_model="T4",
            task_type="training",
            steps=10,
            step_time_s=1.0,
            checkpoint_every_steps=0,
            allocations=[("n1", 1)],
            carrier={},
            step=0,
            role="lead",
        )

    runs = _Runs()
    runs["a:1"], runs["a:2"], runs["b:1"] = run("a", 1), run("a", 2), run("b", 1)
    assert [r.attempt for r in runs.attempts_of("a")] == [1, 2]
    assert runs.pop("a:1").attempt == 1
    assert [r.attempt for r in runs.attempts_of("a")] == [2]
    assert runs.pop("a:1", None) is None
    del runs["a:2"]
    assert runs.attempts_of("a") == []
    replaced = run("b", 1)
    runs["b:1"] = replaced  # a key set again (a journal replayed) keeps one entry
    assert runs.attempts_of("b") == [replaced]
    assert set(runs) == {"b:1"}
    assert runs.attempts_of("nobody") == []
    runs.update({"c:1": run("c", 1)})
    runs.setdefault("c:2", run("c", 2))
    assert sorted(r.attempt for r in runs.attempts_of("c")) == [1, 2]
    with pytest.raises(TypeError):  # no change that could bypass the index
        runs |= {"d:1": run("d", 1)}  # type: ignore[operator]
    assert runs.attempts_of("d") == []
    runs.clear()
    assert runs.attempts_of("b") == [] and runs.attempts_of("c") == [] and not runs

"""The simulator retries a job held back by a permit's choice whenever capacity changes, as placement
retries every queued job then: the pool it waited for may have gone to another job meanwhile."""

from loom.model.topology import load_topology
from loom.sched.framework import Outcome, QueueItem
from loom.sched.snapshot import Snapshot
from loom.sim.engine import simulate
from loom.sim.policies import POLICIES, FrameworkPolicy
from loom.sim.scenarios import multi_stage_scenario


def test_a_job_held_back_by_choice_is_decided_again_at_the_next_release() -> None:
    # The seeds' scenario, seed 7: ResNet-50 gangs that may span wait for G3 GPUs whose running
    # gang overran its predicted end ("expected to have room in 0 s": no wake), while G2 pools
    # hold them. When those GPUs come free one gang takes them; the others used to stay queued
    # until a pool that holds them whole was released again (~900-2,800 s later), never re-decided.
    # Learning off: learned at their first progress report, the G3s' true speeds no longer make the
    # gangs wait for them in this scenario; the retry under test is the same either way.
    scenario = multi_stage_scenario(topology=load_topology(), seed=7)
    policy = POLICIES["loom"](7)
    assert isinstance(policy, FrameworkPolicy)
    policy.speed_learner = None
    decided: list[tuple[float, str, bool]] = []  # (time, job, held back by choice)
    inner = policy.decide_one

    def decide_one(item: QueueItem, snap: Snapshot) -> Outcome:
        outcome = inner(item, snap)
        chosen = outcome.decision is None and item.job.job_id not in snap.waiting
        decided.append((snap.now, item.job.job_id, chosen and "faster GPUs" in outcome.status.reason))
        return outcome

    policy.decide_one = decide_one  # type: ignore[method-assign]
    result = simulate(scenario.trace, scenario.platform, policy, seed=7)
    starts = {r.job_id: r.start_s for r in result.records}
    releases = sorted({r.end_s for r in result.records if r.end_s is not None})
    held = [(t, job) for t, job, chosen in decided if chosen]
    assert held  # the scenario does hold gangs back by choice
    # The training gangs are alike (one shape): one is retried for all, the rest wait if it fails.
    gangs = {j.spec.job_id for j in scenario.trace.jobs if j.spec.job_id.endswith("-train")}
    assert {job for _, job in held} <= gangs
    for t, job in held:
        start = starts[job]
        assert start is not None
        nxt = next((r for r in releases if r > t), None)
        if nxt is None or start <= nxt:
            continue  # started by the next release
        assert any(t < when <= nxt and j in gangs for when, j, _ in decided), (job, t, nxt, start)

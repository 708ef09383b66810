"""The simulator retries a job held back by a permit's choice whenever capacity changes, as placement
retries every queued job then: the pool it waited for may have gone to another job meanwhile."""

import json
from pathlib import Path

import msgspec

from loom.model.topology import load_topology
from loom.sched.framework import Outcome, QueueItem
from loom.sched.profile import build_framework
from loom.sched.snapshot import Snapshot
from loom.sim.engine import platform_from_topology, simulate
from loom.sim.model import SimJob, Trace
from loom.sim.policies import FrameworkPolicy
from loom_proto.jobs import JobSpec


def test_a_job_held_back_by_choice_is_decided_again_at_the_next_release() -> None:
    # Gangs that may span, waiting for faster GPUs (or, elastic, for room for all their workers:
    # since 2026-12-06 the span guard weighs a narrow start against that) while other pools hold
    # them (a permit's choice,
    # no wake: "expected to have room in 0 s" when the GPUs they wait for overran their predicted
    # end). When GPUs come free, placement retries every queued job; the simulator once left them
    # queued until a pool that holds them whole was released again, never re-decided. (The seeds'
    # scenario, seed 7, showed it until a DAG's stages kept their DAG's place in the queue, as
    # placement keeps it; this trace, found among the service-vs-simulator test's random ones on
    # the small platform, timed by truth, holds two jobs back past a release; without the retry
    # on a release, neither is decided again by then.)
    raw = json.loads((Path(__file__).parent / "data" / "chosen_wait_trace.json").read_text())
    jobs = [SimJob(spec=msgspec.convert(j["spec"], JobSpec), arrival_s=j["arrival_s"]) for j in raw]
    platform = platform_from_topology(load_topology("small"))
    policy = FrameworkPolicy("loom", build_framework(context={"economics": platform.economics}))
    decided: list[tuple[float, str, bool]] = []  # (time, job, held back by choice)
    inner = policy.decide_one

    def decide_one(item: QueueItem, snap: Snapshot) -> Outcome:
        outcome = inner(item, snap)
        chosen = outcome.decision is None and item.job.job_id not in snap.waiting
        decided.append((snap.now, item.job.job_id, chosen and "; waiting for " in outcome.status.reason))
        return outcome

    policy.decide_one = decide_one  # type: ignore[method-assign]
    result = simulate(Trace(jobs), platform, policy, sample_every_s=0)
    starts = {r.job_id: r.start_s for r in result.records}
    releases = sorted({r.end_s for r in result.records if r.end_s is not None})
    held = [(t, job) for t, job, chosen in decided if chosen]
    retried = 0
    for t, job in held:
        start = starts[job]
        assert start is not None
        nxt = next((r for r in releases if r > t), None)
        if nxt is None or start <= nxt:
            continue  # started by the next release
        assert any(t < when <= nxt and j == job for when, j, _ in decided), (job, t, nxt, start)
        retried += 1
    assert retried >= 2  # the trace does hold jobs back past a release

"""Spanning allowed changes a run only through the spreads Loom accepts (issue 12).

On ``wide6`` (6 regions joined by WAN links) every spread of the contention mix's gangs holds more
than the span guard's GPU-hours bound, so Loom never spreads one: with spanning allowed the run
must then be the very run it is with spanning forbidden, job by job. It was not: a refused gang
was left out of the queue (so ``pool_fit`` let small jobs break the pools it waited for), its
wait-book claim sent jobs behind it to much slower GPUs, and the simulator retried a gang that may
span, while one cluster held it, on more events than one that may not.
"""

import pytest

from loom.sim.engine import simulate
from loom.sim.policies import make_policy
from loom_benchmarks.contention import contention_trace, platform_and_topology


@pytest.mark.parametrize(("load", "seed"), [(0.8, 1), (1.2, 2)])
def test_a_gang_loom_never_spreads_runs_as_with_spanning_forbidden(load: float, seed: int) -> None:
    platform, topology = platform_and_topology("wide6")
    runs = []
    for span in (True, False):
        trace = contention_trace(
            topology, platform, workload="mix", load=load, seed=seed, span=span, units=24
        )
        result = simulate(trace, platform, make_policy("loom", seed), seed=seed)
        runs.append({r.job_id: (r.start_s, r.end_s, r.clusters, r.gpu_model) for r in result.records})
        gangs = {j.spec.job_id for j in trace.jobs if j.spec.comm is not None and j.spec.workers > 1}
        assert gangs and all(j.spec.allow_multi_cluster == span for j in trace.jobs if j.spec.job_id in gangs)
        assert all(len(r.clusters) == 1 for r in result.records if r.job_id in gangs)  # none spread
    allowed, forbidden = runs
    assert all(v[1] is not None for v in forbidden.values())  # every job ran
    assert allowed == forbidden

"""loom.sched.cycle: what one pure cycle decides, and the rules around it."""

import dataclasses

import pytest

from loom.errors import InvalidInputError
from loom.sched import dag
from loom.sched.cycle import (
    CycleSettings,
    Preempted,
    admission_check,
    backoff_s,
    expected_end_s,
    expiry_avoid,
    fair_share_of,
    fold_within,
    quota_standing,
    retry_after_failure,
    run_cycle,
)
from loom.sched.elastic import resized_end_s
from loom.sched.framework import Framework
from loom.sched.plugins.compute import ScuFit
from loom.sched.plugins.elastic import ElasticShrink
from loom.sched.plugins.resources import ResourceFit
from loom.sched.profile import build_framework
from loom.sched.quota import OPEN, QuotaBook, TenantConfig, TenantQuota
from loom.sched.snapshot import RunningJob, Snapshot
from loom_proto.jobs import Communication, JobSpec, JobSubmitted, Layer, Pipeline, Stage, Work
from tests.unit.test_framework import job, two_clusters


@dataclasses.dataclass
class Q:
    """A queued job as the cycle reads it."""

    job: JobSpec
    attempt: int = 1
    avoid: frozenset[str] = frozenset()
    tries: int = 0
    fair_share: float | None = None
    queued_s: float | None = None


def test_a_cycle_places_rejects_with_a_typed_code_and_leaves_the_rest_waiting() -> None:
    snap = two_clusters()  # 2 x 8 A100 on ca, 3 x 4 T4 on cb
    snap.quota = QuotaBook(
        TenantConfig(tenants={"t": TenantQuota(name="t", cohort=None, gpus=64)}, open=False), {}
    )
    queue = [
        Q(job("fits", gpus=8)),
        Q(job("too-big", gpus=16)),  # no node has 16 GPUs: never
        Q(job("stranger", tenant="nobody")),  # unknown tenant on a closed platform
        Q(job("later", gpus=8, workers=2), tries=3),  # fits on an empty platform, not now
    ]
    result = run_cycle(build_framework(), queue, snap)
    assert [p.pending.job.job_id for p in result.placed] == ["fits"]
    rejected = {r.pending.job.job_id: r for r in result.rejected}
    assert rejected["too-big"].code == "impossible" and "at most 8" in rejected["too-big"].hint
    assert rejected["stranger"].code == "unknown_tenant"
    [waiting] = result.waiting
    assert waiting.pending.job.job_id == "later"
    assert waiting.retry_in_s == backoff_s(3, CycleSettings()) == 2.0
    assert snap.quota.held("t") == 8  # the placement counts against the quota at once
    assert snap.waiting == {"later"}  # the queue the contention plugins read


def test_a_gang_whose_every_spread_breaks_the_gpu_hours_bound_is_rejected_as_span_inflation() -> None:
    # No cluster holds 5 workers of 4 GPUs (ca 4, cb 3), and any spread all-reduces 1 GB a step
    # over a 1 Gbit/s ocean link: the cycle rejects it with its own code and the factor, once the
    # clusters settled (before that it waits, as "can never fit" does).
    def ocean() -> Snapshot:
        snap = two_clusters()
        for a, b in (("r1", "r2"), ("r2", "r1")):
            snap.net.set_link(a, b, rtt_ms=100.0, bandwidth_gbps=1.0)
        return snap

    wasteful = job(
        "wasteful", gpus=4, workers=5, allow_multi_cluster=True, comm=Communication(bytes_per_step=10**9)
    )
    result = run_cycle(build_framework(), [Q(wasteful)], ocean())
    [rejected] = result.rejected
    assert rejected.code == "span_inflation" and not result.placed
    assert "x the GPU-hours of one cluster" in rejected.reason and "fewer or smaller workers" in rejected.hint
    early = run_cycle(build_framework(), [Q(wasteful)], ocean(), settings=CycleSettings(settled=False))
    assert not early.rejected and [w.pending.job.job_id for w in early.waiting] == ["wasteful"]


def test_before_the_clusters_settle_only_the_quota_rejects() -> None:
    snap = two_clusters()
    snap.quota = QuotaBook(
        TenantConfig(tenants={"t": TenantQuota(name="t", cohort=None, gpus=64)}, open=False), {}
    )
    queue = [Q(job("too-big", gpus=16, tenant="t")), Q(job("stranger", tenant="nobody"))]
    result = run_cycle(build_framework(), queue, snap, settings=CycleSettings(settled=False))
    # The quota's verdict does not depend on which clusters reported yet; "no node fits" does.
    assert [r.pending.job.job_id for r in result.rejected] == ["stranger"]
    assert [w.pending.job.job_id for w in result.waiting] == ["too-big"]


def test_backoff_doubles_to_its_ceiling() -> None:
    settings = CycleSettings(backoff_s=0.25, max_backoff_s=30.0)
    assert [backoff_s(t, settings) for t in (0, 1, 2, 7, 8, 50)] == [0.25, 0.5, 1.0, 30.0, 30.0, 30.0]


def elastic_running(job_id: str, workers: int, *, min_workers: int = 1, end: float = 2000.0) -> RunningJob:
    return RunningJob(
        job_id=job_id,
        tenant="t",
        priority=100,
        cluster="ca",
        gpu_model="A100",
        allocations=(("a0", workers),),
        workers=workers,
        min_workers=min_workers,
        max_workers=8,
        gpus_per_worker=1,
        expected_end_s=end,
    )


def test_elastic_jobs_grow_only_when_nothing_waits() -> None:
    snap = two_clusters()
    snap.now = 1000.0
    snap.running = [elastic_running("el", 2)]
    snap.take([("a0", 2)])
    fw = Framework([ResourceFit(), ScuFit()])
    waiting = run_cycle(fw, [Q(job("big", gpus=8, workers=2))], snap)  # a0 has only 6 free
    assert waiting.waiting and not waiting.grown  # a queued job has the first claim
    grown = run_cycle(fw, [], snap)
    [g] = grown.grown
    assert (g.job_id, g.workers, g.added) == ("el", 8, (("a0", 6),))
    [r] = snap.running
    assert r.workers == 8 and r.allocations == (("a0", 8),)
    assert r.expected_end_s == pytest.approx(1000.0 + 1000.0 * 2 / 8)  # four times the workers
    assert run_cycle(fw, [], snap, backlog=1).grown == []  # jobs queued outside this cycle: no growth


def test_elastic_jobs_grow_past_waiting_jobs_that_could_never_use_their_pool() -> None:
    # Any waiting job kept every elastic job small, even one no cluster could ever hold (an H100
    # job here, where none have joined) or one only for another cluster's GPUs (a newcomer's walk).
    def platform() -> Snapshot:
        snap = two_clusters()  # 2 x 8 A100 on ca, 3 x 4 T4 on cb
        snap.now = 1000.0
        snap.running = [elastic_running("el", 2)]
        snap.take([("a0", 2), ("b0", 4), ("b1", 4)])  # el's two A100s; eight of the T4s busy
        return snap

    fw = Framework([ResourceFit(known_models=["H100"]), ScuFit()])  # a model the profiles know
    t4_gang = job("t4-gang", gpus=4, workers=2, resources={"gpu_models": ["T4"]})  # 4 T4s free: waits
    h100 = job("h100", gpus=1, resources={"gpu_models": ["H100"]})  # none has joined: waits
    a100_gang = job("a100-gang", gpus=8, workers=2)  # a0 has 6 free: waits, and wants ca's A100s
    for queued, backlog, grows in (
        ([t4_gang, h100], [], True),
        ([], [t4_gang, h100], True),  # queued outside this cycle, named: the same
        ([t4_gang], [a100_gang], False),
        ([a100_gang], [], False),
    ):
        snap = platform()
        result = run_cycle(fw, [Q(j) for j in queued], snap, backlog=backlog)
        assert {w.pending.job.job_id for w in result.waiting} == {j.job_id for j in queued}
        assert [(g.job_id, g.workers) for g in result.grown] == ([("el", 8)] if grows else []), (
            queued,
            backlog,
        )


def test_elastic_growth_leaves_a_waiting_jobs_tenant_its_quota() -> None:
    # Growth elsewhere took the tenant's whole quota (8 GPUs): its T4 job, waiting for T4s, was
    # then refused for quota once they freed (a review).
    snap = two_clusters()
    snap.now = 1000.0
    snap.running = [elastic_running("el", 2)]
    snap.take([("a0", 2), ("b0", 4), ("b1", 4)])
    snap.quota = QuotaBook(
        TenantConfig(tenants={"t": TenantQuota(name="t", cohort=None, gpus=8)}, open=True), {"t": 2}
    )
    fw = Framework([ResourceFit(), ScuFit()])
    t4_gang = job("t4-gang", gpus=3, workers=2, resources={"gpu_models": ["T4"]})  # 4 T4s free: waits
    result = run_cycle(fw, [Q(t4_gang)], snap)
    assert [w.pending.job.job_id for w in result.waiting] == ["t4-gang"]
    assert result.grown == [] and snap.quota.held("t") == 2
    # Another tenant's waiting job leaves "t"'s growth alone.
    other = job("t4-other", gpus=3, workers=2, tenant="u", resources={"gpu_models": ["T4"]})
    grown = run_cycle(fw, [Q(other)], snap)
    assert [(g.job_id, g.workers) for g in grown.grown] == [("el", 8)]


def two_tenants(snap: Snapshot) -> QuotaBook:
    snap.quota = QuotaBook(
        TenantConfig(
            tenants={t: TenantQuota(name=t, cohort=None, gpus=64) for t in ("el-tenant", "gang-tenant")},
            open=False,
        ),
        {},
    )
    return snap.quota


def test_a_run_shrunk_within_its_own_cycle_is_placed_at_the_smaller_size() -> None:
    snap = two_clusters()
    quota = two_tenants(snap)
    fw = Framework([ResourceFit(), ElasticShrink(), ScuFit()])
    first = Q(
        job("el", gpus=1, workers=16, min_workers=4, tenant="el-tenant", resources={"gpu_models": ["A100"]})
    )
    second = Q(job("gang", gpus=8, tenant="gang-tenant", resources={"gpu_models": ["A100"]}))
    placed: list[str] = []

    def listed(p: Q, d: object) -> None:
        placed.append(p.job.job_id)
        snap.running.append(core(p.job, d))  # as the service lists a placement at once

    result = run_cycle(fw, [first, second], snap, placed=listed)
    assert placed == ["el", "gang"]
    assert [s.job_id for s in result.shrunk] == ["el"]
    assert quota.held("el-tenant") == 16  # counted at its placement, before the shrink
    fold_within(result, snap)
    assert result.shrunk == [] and result.preempted == []
    el = next(p for p in result.placed if p.pending.job.job_id == "el")
    assert el.decision.workers == 8 and sum(g for _, g in el.decision.parts[0].allocations) == 8
    # The quota holds what each placement holds now (it kept the 8 the shrink took, for good).
    assert (quota.held("el-tenant"), quota.held("gang-tenant")) == (8, 8)


def test_a_run_preempted_within_its_own_cycle_is_taken_back_and_waits() -> None:
    # The queue goes by priority, so a cycle preempts its own placement only in odd orders; the
    # rule holds whatever the order: the victim waits, as if never placed.
    snap = two_clusters()
    quota = two_tenants(snap)
    fw = Framework([ResourceFit(), ScuFit()])
    low, high = Q(job("low", gpus=8, tenant="el-tenant")), Q(job("high", gpus=8, tenant="gang-tenant"))
    result = run_cycle(fw, [low, high], snap)
    result.preempted.append(Preempted("low", by="high"))
    result.preempted.append(Preempted("running-before", by="high"))
    undone = fold_within(result, snap)
    assert undone == {"low"}
    assert (quota.held("el-tenant"), quota.held("gang-tenant")) == (0, 8)  # the waiting job holds none
    assert [p.pending.job.job_id for p in result.placed] == ["high"]
    assert [w.pending.job.job_id for w in result.waiting] == ["low"]
    assert [p.job_id for p in result.preempted] == ["running-before"]  # still stopped for real


def core(spec: JobSpec, d: object) -> RunningJob:
    parts = d.parts  # type: ignore[attr-defined]
    return RunningJob(
        job_id=spec.job_id,
        tenant=spec.tenant,
        priority=spec.priority,
        cluster=parts[0].cluster,
        gpu_model=parts[0].gpu_model,
        allocations=tuple(a for p in parts for a in p.allocations),
        workers=d.workers,  # type: ignore[attr-defined]
        gpus_per_worker=spec.resources.gpus,
        min_workers=spec.min_workers,
        max_workers=spec.workers,
    )


def test_retry_and_expiry_rules() -> None:
    assert retry_after_failure(retryable=True, attempt=1, current_attempt=1, max_attempts=3)
    assert not retry_after_failure(retryable=False, attempt=1, current_attempt=1, max_attempts=3)
    assert not retry_after_failure(retryable=True, attempt=1, current_attempt=2, max_attempts=3)  # stale
    assert not retry_after_failure(retryable=True, attempt=3, current_attempt=3, max_attempts=3)  # spent
    assert expiry_avoid(["b", "a", "b"], attempt=1, max_attempts=3) == ("a", "b")
    assert expiry_avoid(["a"], attempt=3, max_attempts=3) == ()


def test_predicted_ends_at_placement_and_after_a_resize() -> None:
    spec = job("el", workers=4, min_workers=1)
    assert expected_end_s(spec, start_s=10.0, steps_left=100, predicted_step_s=2.0, workers=4) == 210.0
    # Half the workers asked for: twice as long (the prediction is for the gang as asked).
    assert expected_end_s(spec, start_s=10.0, steps_left=100, predicted_step_s=2.0, workers=2) == 410.0
    assert expected_end_s(spec, start_s=10.0, steps_left=100, predicted_step_s=None, workers=4) is None
    run = elastic_running("el", 2, end=500.0)
    assert resized_end_s(run, 4, now=100.0) == pytest.approx(300.0)  # 400 s left at 2 -> 200 s at 4


def test_fair_share_is_taken_from_the_snapshot_book() -> None:
    snap = two_clusters()
    assert fair_share_of(snap, "t") == 0.0
    snap.quota = QuotaBook(TenantConfig(tenants={"t": TenantQuota(name="t", cohort=None, gpus=8)}), {"t": 4})
    assert fair_share_of(snap, "t") == 0.5


def _submitted(spec: JobSpec, at: float) -> JobSubmitted:
    fields = {f: getattr(spec, f) for f in JobSpec.__struct_fields__}
    return JobSubmitted(**fields, submitted_at=at)


@pytest.mark.parametrize(
    ("book", "busy_share", "first"),
    [
        (None, 8.0, "busy"),
        (OPEN, 8.0, "busy"),
        # 24 GPUs held of a quota of 16: borrowing.
        (
            TenantConfig(tenants={t: TenantQuota(name=t, cohort=None, gpus=16) for t in ("busy", "idle")}),
            1.5,
            "idle",
        ),
    ],
)
def test_only_a_tenant_over_a_listed_quota_queues_behind_the_others(
    book: TenantConfig | None, busy_share: float, first: str
) -> None:
    """A tenant holding GPUs in an open book does not borrow: its job keeps its place by its age,
    its service and the GPUs it holds (``share_s``), not behind every job of a tenant holding none
    (contention seed 7: a 16-GPU gang of a tenant holding 16 GPUs waited 7,800 s while 16-GPU gangs
    of idle tenants queued long after it went first). Over a quota the book lists, it does."""
    snap = two_clusters()  # one 2 x 8 gang fits, on ca's two nodes
    if book is not None:
        snap.quota = QuotaBook(book, {})
    now = snap.now
    busy = _submitted(job("busy", gpus=8, workers=2, tenant="busy"), now - 2000.0)
    idle = _submitted(job("idle", gpus=8, workers=2, tenant="idle"), now - 1000.0)
    # Shares as taken when each was queued (open book: 8 GPUs held, 8 x 60 s of virtual start).
    result = run_cycle(build_framework(), [Q(idle, fair_share=0.0), Q(busy, fair_share=busy_share)], snap)
    assert [p.pending.job.job_id for p in result.placed] == [first]
    assert [w.pending.job.job_id for w in result.waiting] == [({"busy", "idle"} - {first}).pop()]
    assert quota_standing(snap, "busy") is (True if first == "idle" else None)


def test_tenants_without_a_quota_where_others_have_one_queue_among_themselves_by_age() -> None:
    """A book listing one tenant's quota on an open platform: the tenants it does not list have no
    guarantee, so both are behind the listed tenant within its quota, and among themselves the
    one holding a GPU keeps its earlier place (no band between them)."""
    snap = two_clusters()
    snap.quota = QuotaBook(
        TenantConfig(tenants={"owner": TenantQuota(name="owner", cohort=None, gpus=16)}), {}
    )
    now = snap.now
    holding = _submitted(job("holding", gpus=8, workers=2, tenant="u1"), now - 2000.0)
    empty = _submitted(job("empty", gpus=8, workers=2, tenant="u2"), now - 1000.0)
    result = run_cycle(build_framework(), [Q(empty, fair_share=0.0), Q(holding, fair_share=1.0)], snap)
    assert [p.pending.job.job_id for p in result.placed] == ["holding"]
    assert quota_standing(snap, "u1") is False
    # The listed tenant within its quota goes first, though queued last.
    owner = _submitted(job("owner", gpus=8, workers=2, tenant="owner"), now - 10.0)
    snap2 = two_clusters()
    snap2.quota = snap.quota
    result = run_cycle(
        build_framework(),
        [Q(empty, fair_share=0.0), Q(holding, fair_share=1.0), Q(owner, fair_share=0.0)],
        snap2,
    )
    assert [p.pending.job.job_id for p in result.placed] == ["owner"]


def test_admission_refuses_what_no_cluster_state_could_fix() -> None:
    with pytest.raises(InvalidInputError, match="min_workers"):
        admission_check(job("j", workers=2, min_workers=3))
    with pytest.raises(InvalidInputError, match="pipeline"):
        admission_check(job("p", workers=2, pipeline=Pipeline(layers=[Layer(compute_s=1.0, memory_gib=1.0)])))
    cyclic = [
        Stage(name="a", depends_on=["b"], work=Work(steps=1, step_time_s=1.0)),
        Stage(name="b", depends_on=["a"], work=Work(steps=1, step_time_s=1.0)),
    ]
    with pytest.raises(dag.DagCycleError):
        admission_check(job("d", stages=cyclic))
    admission_check(job("ok", workers=2, min_workers=1))


def test_a_dag_advances_from_its_stages_states() -> None:
    stages = [
        Stage(name="prep", work=Work(steps=1, step_time_s=1.0)),
        Stage(name="train", depends_on=["prep"], work=Work(steps=1, step_time_s=1.0)),
        Stage(name="eval", depends_on=["train"], work=Work(steps=1, step_time_s=1.0)),
    ]
    step = dag.advance(stages, {"prep": "completed", "train": "waiting", "eval": "waiting"})
    assert step.ready == ("train",) and not step.completed and step.failed_stage is None
    failed = dag.advance(stages, {"prep": "completed", "train": "failed", "eval": "waiting"})
    assert failed.failed_stage == "train" and failed.cancel == ("eval",)
    assert dag.advance(stages, dict.fromkeys(("prep", "train", "eval"), "completed")).completed


def test_running_ids_follow_appends_and_new_lists() -> None:
    snap = two_clusters()
    snap.running = [elastic_running("a", 1)]
    assert snap.running_ids() == {"a"}
    snap.running.append(elastic_running("b", 1))  # a cycle lists a placement by appending
    assert snap.running_ids() == {"a", "b"}
    snap.running = [elastic_running("c", 1)]  # a new list (a run ended, or was preempted)
    assert snap.running_ids() == {"c"}
    snap.running.clear()  # shorter in place: counted afresh
    assert snap.running_ids() == set()


def test_a_victim_is_told_who_took_its_room_only_when_it_is_its_own_tenants_job() -> None:
    from loom.sched.cycle import room_taker

    assert room_taker("vip", "acme", "acme") == "vip"
    assert room_taker("vip", "beta", "acme") == "a job of another tenant"
    assert room_taker("vip", None, "acme") == "a job of another tenant"  # not known: not named


def test_a_dag_stage_its_tenants_quota_could_never_hold_is_found_at_admission() -> None:
    # It was accepted, ran its first stages and failed at that one (a newcomer's walk).
    from loom.sched.cycle import stage_beyond_quota
    from loom.sched.quota import OPEN, TenantConfig, TenantQuota
    from loom_proto.jobs import JobSpec, Resources, Work

    def stage(gpus: int, workers: int = 1, tenant: str = "acme") -> JobSpec:
        return JobSpec(
            job_id=f"d--s{gpus}",
            tenant=tenant,
            workers=workers,
            resources=Resources(gpus=gpus),
            work=Work(steps=1),
        )

    closed = TenantConfig(tenants={"acme": TenantQuota(name="acme", cohort=None, gpus=32)}, open=False)
    assert stage_beyond_quota({"a": stage(8), "b": stage(8, workers=4)}, closed) is None
    found = stage_beyond_quota({"a": stage(8), "big": stage(64)}, closed)
    assert found is not None and found[0] == "big" and found[1].never
    stranger = stage_beyond_quota({"a": stage(1, tenant="ghost")}, closed)
    assert stranger is not None and stranger[1].unknown_tenant
    assert stage_beyond_quota({"big": stage(64)}, OPEN) is None

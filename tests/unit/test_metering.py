"""The metering core: run records folded from events, usage rows, prices by hour, marks, sums."""

import itertools
from datetime import UTC, datetime

import pytest

from loom.errors import InvalidInputError
from loom.metering import RunRecord, aggregate, fold, meter, month_window_ms, scu_of, statement
from loom.metering.usage import HOUR_MS, gpu_seconds_text
from loom.sched.plugins.cost import PRICE_PER_GPU_HOUR, default_economics
from loom.sched.snapshot import Economics
from loom_proto.jobs import (
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobRequeued,
    JobResized,
    JobStarted,
    NodeAllocation,
    PlacedPart,
)

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC).timestamp()
"""10:00 UTC: an hour boundary."""
REGION = "aws-us-east-2"
FLAT = default_economics().price


def placed(job: str = "j1", attempt: int = 1, gpus: tuple[int, ...] = (2, 2), **kw: object) -> JobPlaced:
    return JobPlaced(
        job_id=job,
        tenant="acme",
        cluster="c-use2-a",
        region=REGION,
        gpu_model="V100M16",
        allocations=[NodeAllocation(f"n{i}", g) for i, g in enumerate(gpus)],
        attempt=attempt,
        placed_at=T0 - 5,
        **kw,  # type: ignore[arg-type]
    )


def started(at: float, job: str = "j1", attempt: int = 1) -> JobStarted:
    return JobStarted(job_id=job, tenant="acme", cluster="c-use2-a", attempt=attempt, started_at=at)


def completed(at: float, job: str = "j1", attempt: int = 1) -> JobCompleted:
    return JobCompleted(job_id=job, tenant="acme", cluster="c-use2-a", attempt=attempt, at=at)


def run_of(
    *events: object, job: str = "j1", attempt: int = 1, labels: dict[str, str] | None = None
) -> RunRecord:
    record = RunRecord(job_id=job, attempt=attempt, tenant="acme", labels=labels or {})
    for event in events:
        record = fold(record, event)  # type: ignore[arg-type]
    return record


def test_a_completed_run_uses_its_gpus_times_its_duration_exactly() -> None:
    run = run_of(placed(), started(T0 + 1.2346), completed(T0 + 61.0004))
    rows = meter(run, FLAT)
    # 4 GPUs from 1.235 s to 61.000 s (whole milliseconds): 4 x 59765 ms.
    assert sum(r.gpu_ms for r in rows) == 4 * (61_000 - 1_235)
    assert {r.outcome for r in rows} == {"completed"}
    assert gpu_seconds_text(sum(r.gpu_ms for r in rows)) == "239.060"


def test_events_fold_to_the_same_record_in_any_order_and_twice() -> None:
    events = [placed(), started(T0), completed(T0 + 30)]
    records = [run_of(*order) for order in itertools.permutations(events)]
    records.append(run_of(*events, *events))
    assert len({r.key for r in records}) == 1
    assert len({(r.parts, r.started_ms, r.ended_ms, r.outcome) for r in records}) == 1


def test_nothing_is_metered_before_the_run_has_started_and_ended() -> None:
    assert meter(run_of(placed(), started(T0)), FLAT) == []
    assert meter(run_of(placed(), completed(T0 + 10)), FLAT) == []
    assert meter(run_of(started(T0), completed(T0 + 10)), FLAT) == []


def test_a_preempted_attempt_is_metered_until_the_requeue_and_marked() -> None:
    requeue = JobRequeued(job_id="j1", tenant="acme", attempt=2, cause="preempted", at=T0 + 100)
    run = run_of(placed(), started(T0), requeue)
    rows = meter(run, FLAT)
    assert run.outcome == "preempted"
    assert sum(r.gpu_ms for r in rows) == 4 * 100_000
    assert {r.outcome for r in rows} == {"preempted"}
    groups = aggregate(rows, "tenant")
    assert groups[0].marked_gpu_ms == {"preempted": 400_000}


def test_a_failed_run_ends_at_its_earliest_end_event_and_is_marked_failed() -> None:
    failed = JobFailed(
        job_id="j1", tenant="acme", cluster="c-use2-a", reason="oom", retryable=True, at=T0 + 50
    )
    requeue = JobRequeued(job_id="j1", tenant="acme", attempt=2, cause="start_failed", at=T0 + 52)
    for order in ([failed, requeue], [requeue, failed]):
        run = run_of(placed(), started(T0), *order)
        assert (run.outcome, run.ended_ms, run.reason) == ("failed", round((T0 + 50) * 1000), "oom")
        assert sum(r.gpu_ms for r in meter(run, FLAT)) == 4 * 50_000


def test_a_cancelled_run_is_marked_cancelled() -> None:
    run = run_of(placed(), started(T0), JobCancelled(job_id="j1", tenant="acme", at=T0 + 7))
    assert {r.outcome for r in meter(run, FLAT)} == {"cancelled"}


def test_rows_never_cross_an_hour_and_each_takes_its_hours_price() -> None:
    factors = [1.0] * 24
    factors[10], factors[11] = 0.5, 2.0  # off-peak at 10:00 UTC, peak at 11:00
    econ = Economics(price_per_gpu_hour={REGION: 3.0}, hourly_price_factor={REGION: factors})
    run = run_of(placed(gpus=(1,)), started(T0 + 1800), completed(T0 + 5400))  # 10:30 -> 11:30
    rows = meter(run, econ.price, lambda _m, _t, _l: 2.0)
    assert [(r.start_ms % HOUR_MS, r.end_ms - r.start_ms) for r in rows] == [
        (1_800_000, 1_800_000),
        (0, 1_800_000),
    ]
    assert [r.price_per_scu_hour for r in rows] == [1.5, 6.0]
    # Half an hour of 2 SCU at 1.5, then half an hour at 6.0.
    assert sum(r.cost for r in rows) == pytest.approx(0.5 * 2 * 1.5 + 0.5 * 2 * 6.0)


def test_the_price_is_the_cost_plugins_table_times_the_scu_of_the_gpu_for_the_task() -> None:
    run = run_of(placed(gpus=(1,)), started(T0), completed(T0 + 3600))
    (row,) = meter(run, FLAT)
    assert row.price_per_scu_hour == PRICE_PER_GPU_HOUR[REGION]
    assert row.scu_per_gpu == pytest.approx(scu_of("V100M16", "training_compute", {}))
    assert row.cost == pytest.approx(row.scu_per_gpu * PRICE_PER_GPU_HOUR[REGION])


def test_mixed_precision_jobs_are_charged_at_their_precisions_scu() -> None:
    fp32 = scu_of("A100", "training_compute", {})
    fp16 = scu_of("A100", "training_compute", {"precision": "bf16"})
    assert fp16 != fp32
    assert scu_of("NOT-A-GPU", "training_compute", {}) < 1.0  # unprofiled: the trust floor


def test_each_part_of_a_multi_cluster_run_is_metered_where_it_ran() -> None:
    parts = [
        PlacedPart(
            cluster="c-use2-a", region=REGION, gpu_model="V100M16", allocations=[NodeAllocation("a", 4)]
        ),
        PlacedPart(
            cluster="c-euc1-a",
            region="aws-eu-central-1",
            gpu_model="A100",
            allocations=[NodeAllocation("b", 2)],
        ),
    ]
    run = run_of(placed(gpus=(4,), parts=parts), started(T0), completed(T0 + 10))
    by_region = {g.key: g.gpu_ms for g in aggregate(meter(run, FLAT), "region")}
    assert by_region == {REGION: 40_000, "aws-eu-central-1": 20_000}
    by_model = {g.key: g.gpu_ms for g in aggregate(meter(run, FLAT), "model")}
    assert by_model == {"V100M16": 40_000, "A100": 20_000}


def test_a_resize_changes_the_gpus_from_its_time_on() -> None:
    resize = JobResized(
        job_id="j1",
        tenant="acme",
        cluster="c-use2-a",
        workers=1,
        allocations=[NodeAllocation("n0", 1)],
        at=T0 + 10,
    )
    run = run_of(placed(gpus=(2, 2)), started(T0), resize, completed(T0 + 30))
    assert sum(r.gpu_ms for r in meter(run, FLAT)) == 4 * 10_000 + 1 * 20_000


def test_usage_sums_by_tenant_and_label_equal_the_sum_of_gpus_times_duration() -> None:
    rows = []
    expected_by_team: dict[str, int] = {}
    for i in range(12):
        team = ["ml", "search", "ads"][i % 3]
        start, end = T0 + i * 377.1234, T0 + i * 377.1234 + 3000 + i * 91.0071
        gpus = 1 + i % 4
        rows += meter(
            run_of(
                placed(job=f"j{i}", gpus=(gpus,)),
                started(start, job=f"j{i}"),
                completed(end, job=f"j{i}"),
                job=f"j{i}",
                labels={"team": team},
            ),
            FLAT,
        )
        expected_by_team[team] = expected_by_team.get(team, 0) + gpus * (
            round(end * 1000) - round(start * 1000)
        )
    by_team = {g.key: g.gpu_ms for g in aggregate(rows, "label:team")}
    assert by_team == expected_by_team
    assert [g.gpu_ms for g in aggregate(rows, "tenant")] == [sum(expected_by_team.values())]
    assert {g.key for g in aggregate(rows, "label:project")} == {"(none)"}


def test_a_window_clips_rows_exactly() -> None:
    rows = meter(run_of(placed(gpus=(3,)), started(T0), completed(T0 + 7200)), FLAT)
    since, until = round((T0 + 600) * 1000), round((T0 + 4000.5) * 1000)
    (group,) = aggregate(rows, "tenant", since_ms=since, until_ms=until)
    assert group.gpu_ms == 3 * (until - since)


def test_an_inverted_window_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="inverted"):
        aggregate([], "tenant", since_ms=2000, until_ms=1000)
    with pytest.raises(InvalidInputError, match="group"):
        aggregate(meter(run_of(placed(), started(T0), completed(T0 + 1)), FLAT), "colour")


def test_a_monthly_statement_takes_only_that_months_hours_of_that_tenant() -> None:
    new_year = datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    run = run_of(
        placed(gpus=(1,)), started(new_year - 1800), completed(new_year + 900), labels={"team": "ml"}
    )
    rows = meter(run, FLAT)
    december = statement(rows, "acme", "2026-12")
    january = statement(rows, "acme", "2027-01")
    assert (december.total.gpu_ms, january.total.gpu_ms) == (1_800_000, 900_000)
    assert [(ln.team, ln.project) for ln in december.lines] == [("ml", "(none)")]
    assert statement(rows, "other", "2026-12").total.gpu_ms == 0
    assert month_window_ms("2026-12")[1] == round(new_year * 1000)
    with pytest.raises(InvalidInputError):
        month_window_ms("2026-13")
    for month in ("0000-01", "9999-12"):  # the right shape, out of datetime's years: was a traceback
        with pytest.raises(InvalidInputError, match="1970-9998"):
            month_window_ms(month)


def test_loom_usage_refuses_an_inverted_range_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli.main import main

    assert main(["usage", "--since", "2026-12-02T00:00", "--until", "2026-12-01T00:00"]) == 2
    assert "inverted" in capsys.readouterr().err


@pytest.mark.parametrize("by", ["bogus", "label:", "label: ", "Tenant"])
def test_loom_usage_refuses_a_grouping_it_cannot_make_before_connecting(
    by: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli.main import main

    # No stack runs here: a refusal after connecting would say so and exit 1.
    assert main(["usage", "--by", by]) == 2
    assert "cannot group usage by" in capsys.readouterr().err


def test_a_grouping_is_checked_even_with_no_rows_to_group() -> None:
    with pytest.raises(InvalidInputError, match="cannot group"):
        aggregate([], "bogus")
    assert aggregate([], "label:team") == []


def test_loom_usage_statement_refuses_a_month_it_cannot_read_with_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loom.cli.main import main

    assert main(["usage", "statement", "--tenant", "acme", "--month", "2026-13"]) == 2
    assert "YYYY-MM" in capsys.readouterr().err


def test_a_start_is_counted_from_no_earlier_than_the_skew_before_its_placement_in_any_order() -> None:
    # An agent's credentials sent a start a year before the run existed: 126 million GPU-s billed.
    from loom.metering.run import CLOCK_SKEW_S

    year_ago = T0 - 365 * 86_400
    for order in ((placed(), started(year_ago)), (started(year_ago), placed())):
        record = run_of(*order, completed(T0 + 60))
        assert record.started_ms == round((T0 - 5 - CLOCK_SKEW_S) * 1000)
    # A start within the skew of the placement (an agent's clock a little behind) counts as sent.
    assert run_of(placed(), started(T0 - 30)).started_ms == round((T0 - 30) * 1000)
    # A record kept before placements were recorded in it is folded as before.
    legacy = RunRecord(job_id="j1", attempt=1, tenant="acme")
    assert fold(legacy, started(year_ago)).started_ms == round(year_ago * 1000)


def test_an_agents_report_is_counted_no_later_than_the_skew_after_the_server_stored_it() -> None:
    from loom.metering.run import CLOCK_SKEW_S, bounded

    stored = T0 + 100
    far = T0 + 10 * 365 * 86_400
    assert bounded(completed(far), stored).at == stored + CLOCK_SKEW_S  # type: ignore[union-attr]
    assert bounded(started(far), stored).started_at == stored + CLOCK_SKEW_S  # type: ignore[union-attr]
    on_time = completed(T0 + 90)
    assert bounded(on_time, stored) is on_time

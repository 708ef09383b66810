"""Metering on the real services (in this process) with real NATS and PostgreSQL.

The must-show: after a run of jobs, metered usage equals the sum over the run records of
GPUs x duration, exactly, by tenant and by label. The run records here are placement's own
history (``job_events``: placed, started and the event that ended each attempt), read
independently of the metering consumer and its core.
"""

import asyncio
import contextlib
import csv
import io
import json
import re
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from opentelemetry import trace
from platform_helpers import Platform
from prometheus_client.parser import text_string_to_metric_families
from waiting import until

from loom.bus import Delivery
from loom.cli.main import main as loom_main
from loom.client import LoomClient
from loom.metering.usage import USAGE_FIELDS
from loom.runtime.config import ENV_DATABASE_URL, ENV_NATS_URL
from loom.runtime.servers import NatsServer
from loom.telemetry.metrics import serve_metrics
from loom_proto.jobs import JobSpec, Resources, Work

JOBS = [
    # (job, tenant, team, project, gpus per worker, workers, steps)
    ("m-1", "acme", "ml", "llm", 2, 1, 60),
    ("m-2", "acme", "search", "rank", 1, 2, 90),
    ("m-3", "acme", "ml", "vision", 4, 1, 40),
    ("m-4", "globex", "ads", "ctr", 1, 1, 120),
    ("m-5", "globex", "ml", "llm", 2, 2, 50),
    ("m-6", "globex", "ads", "ctr", 1, 3, 30),
]


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with NatsServer(tmp_path_factory.mktemp("metering-nats")) as server:
        yield server.url


@pytest.fixture(scope="module")
async def stack(
    nats_url: str,
    fresh_database: Callable[..., Awaitable[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Platform, Any]]:
    p = Platform(nats_url, await fresh_database("metering"), tmp_path_factory.mktemp("agents"))
    metrics = await p.start("metrics")
    for name in ("placement", "agent-c-use2-a", "agent-c-weu-a", "agent-c-sea1-a"):
        await p.start(name)
    yield p, metrics
    for name in list(p.tasks):
        await p.stop(name)


async def _run_records(conn: asyncpg.Connection) -> dict[tuple[str, int], dict[str, Any]]:
    """Per attempt, from placement's job history: GPUs placed, start and earliest end, in ms."""
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for row in await conn.fetch("SELECT job_id, kind, event FROM job_events ORDER BY id"):
        event = json.loads(row["event"]) if isinstance(row["event"], str) else row["event"]
        kind = row["kind"]
        if kind == "requeued":
            key = (row["job_id"], event["attempt"] - 1)
        elif kind in ("placed", "started", "completed", "failed"):
            key = (row["job_id"], event.get("attempt", 1))
        else:
            continue
        run = runs.setdefault(key, {"gpus": 0, "start": None, "end": None})
        if kind == "placed":
            parts = event.get("parts") or [event]
            run["gpus"] = sum(a["gpus"] for part in parts for a in part["allocations"])
        elif kind == "started":
            run["start"] = round(event["started_at"] * 1000)
        else:
            at = round(event["at"] * 1000)
            run["end"] = at if run["end"] is None else min(run["end"], at)
    return runs


@pytest.fixture(scope="module")
async def expected(stack: tuple[Platform, Any], nats_url: str) -> dict[str, dict[str, int]]:
    """Run the jobs to completion; GPU-ms by tenant and by team from the run records, once metered."""
    platform, _ = stack
    client = await LoomClient.connect(nats_url)
    try:
        for job_id, tenant, team, project, gpus, workers, steps in JOBS:
            await client.submit(
                JobSpec(
                    job_id=job_id,
                    tenant=tenant,
                    workers=workers,
                    resources=Resources(gpus=gpus),
                    work=Work(steps=steps, step_time_s=10.0),
                    labels={"team": team, "project": project},
                )
            )

        async def all_completed() -> bool:
            jobs = [await client.job(j[0]) for j in JOBS]
            return all(j is not None and j["state"] == "completed" for j in jobs)

        await until(all_completed, 30, "every job to complete")
    finally:
        await client.close()
    conn = await asyncpg.connect(platform.database_url)
    try:
        records = await _run_records(conn)
        finished = {k: r for k, r in records.items() if r["start"] is not None and r["end"] is not None}
        assert {job for job, _ in finished} == {j[0] for j in JOBS}

        async def metered() -> bool:
            count = await conn.fetchval("SELECT count(DISTINCT (job_id, attempt)) FROM usage_rows")
            return int(count) == len(finished)

        await until(metered, 15, "every attempt to be metered")
    finally:
        await conn.close()
    spec_of = {j[0]: j for j in JOBS}
    by: dict[str, dict[str, int]] = {"tenant": {}, "team": {}}
    for (job_id, _), r in finished.items():
        gpu_ms = r["gpus"] * (r["end"] - r["start"])
        assert gpu_ms > 0
        _, tenant, team, *_ = spec_of[job_id]
        by["tenant"][tenant] = by["tenant"].get(tenant, 0) + gpu_ms
        by["team"][team] = by["team"].get(team, 0) + gpu_ms
    return by


def _placed(job_id: str, placed_at: float, *, gpus: int = 2) -> Any:
    """Placement's ``placed`` of attempt 1 of ``job_id``: ``gpus`` A100s of node n1 on cluster c1."""
    from loom_proto.jobs import JobPlaced, NodeAllocation

    return JobPlaced(
        job_id=job_id,
        tenant="acme",
        cluster="c1",
        region="r1",
        gpu_model="A100",
        allocations=[NodeAllocation("n1", gpus)],
        attempt=1,
        placed_at=placed_at,
    )


def _delivery(seq: int, mid: str, body: bytes) -> Delivery[bytes]:
    """A delivery of ``body`` as the consumer would hand it to a handler (no NATS message needed)."""
    return Delivery(
        msg=None,
        subject="loom.jobs.x.acme",
        message=body,
        headers={},
        msg_id=mid,
        num_delivered=1,
        stream_seq=seq,
        span=trace.get_tracer("test").start_span("x"),
    )  # type: ignore[arg-type]


async def test_usage_of_a_completed_run_equals_gpus_times_duration_by_tenant_and_label(
    stack: tuple[Platform, Any], expected: dict[str, dict[str, int]]
) -> None:
    platform, _ = stack
    conn = await asyncpg.connect(platform.database_url)
    try:
        by_tenant = {
            r["tenant"]: int(r["gpu_ms"])
            for r in await conn.fetch(
                "SELECT tenant, sum(gpu_ms)::bigint AS gpu_ms FROM usage_rows GROUP BY 1"
            )
        }
        by_team = {
            r["team"]: int(r["gpu_ms"])
            for r in await conn.fetch(
                "SELECT labels->>'team' AS team, sum(gpu_ms)::bigint AS gpu_ms FROM usage_rows GROUP BY 1"
            )
        }
    finally:
        await conn.close()
    assert by_tenant == expected["tenant"]
    assert by_team == expected["team"]


_LOG_LINE = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} \[")


def printed(out: io.StringIO) -> str:
    """What the CLI printed: the services of this process log to the same stdout meanwhile (a
    loaded machine's "cluster stale" warning once landed in the middle), and their lines are dropped."""
    return "".join(line for line in out.getvalue().splitlines(keepends=True) if not _LOG_LINE.match(line))


async def test_loom_usage_shows_the_same_figures_and_refuses_an_inverted_range(
    stack: tuple[Platform, Any],
    expected: dict[str, dict[str, int]],
    nats_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    platform, _ = stack
    monkeypatch.setenv(ENV_DATABASE_URL, platform.database_url)
    monkeypatch.setenv(ENV_NATS_URL, nats_url)
    for by, key in (("label:team", "team"), ("tenant", "tenant")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = await asyncio.to_thread(loom_main, ["usage", "--by", by, "--json"])
        assert code == 0
        assert {g["key"]: g["gpu_ms"] for g in json.loads(printed(out))["groups"]} == expected[key]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await asyncio.to_thread(loom_main, ["usage", "--by", "tenant", "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(printed(out))))
    assert list(rows[0]) == ["tenant", *USAGE_FIELDS]  # as the console's /usage.csv
    assert {r["tenant"]: r["gpu_seconds"] for r in rows} == {
        t: f"{ms // 1000}.{ms % 1000:03d}" for t, ms in expected["tenant"].items()
    }
    inverted = ["usage", "--since", "2026-12-02T00:00:00", "--until", "2026-12-01T00:00:00"]
    assert await asyncio.to_thread(loom_main, inverted) == 2
    assert await asyncio.to_thread(loom_main, ["usage", "reconcile"]) == 0
    # One millisecond off in one row, and reconcile says so.
    conn = await asyncpg.connect(platform.database_url)
    try:
        bump = "UPDATE usage_rows SET end_ms = end_ms + $1 WHERE (job_id, attempt, seq) = ('m-1', 1, 0)"
        await conn.execute(bump, 1)
        assert await asyncio.to_thread(loom_main, ["usage", "reconcile"]) == 1
        await conn.execute(bump, -1)
    finally:
        await conn.close()


async def test_metrics_endpoint_answers_with_the_families_the_services_fed(
    stack: tuple[Platform, Any], expected: dict[str, dict[str, int]]
) -> None:
    _, metrics = stack
    await metrics.refresh_gauges()
    port = serve_metrics("test", 0)
    assert port is not None
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in (
        "loom_consumer_messages",
        "loom_consumer_lag_messages",
        "loom_decisions",
        "loom_decision_latency_seconds",
        "loom_placements",
        "loom_queue_depth",
        "loom_cluster_free_gpus",
        "loom_cluster_water_level_ratio",
        "loom_usage_gpu_seconds",
        "loom_metered_runs",
    ):
        assert name in families and families[name].samples, f"{name} missing or empty in /metrics"
    usage: dict[str, float] = {}
    for s in families["loom_usage_gpu_seconds"].samples:
        usage[s.labels["tenant"]] = usage.get(s.labels["tenant"], 0.0) + s.value
    # The registry is the process's: services of other test modules may have fed other tenants.
    assert {t: usage.get(t) for t in expected["tenant"]} == pytest.approx(
        {t: v / 1000 for t, v in expected["tenant"].items()}
    )
    placed = [s for s in families["loom_placements"].samples if s.labels.get("outcome") == "placed"]
    assert sum(s.value for s in placed if s.name.endswith("_total")) >= len(JOBS)


async def test_the_metering_consumer_counts_each_event_once_in_any_order(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    from types import SimpleNamespace

    from loom.store.pool import create_pool
    from loom_proto.jobs import JobCompleted, JobPlaced, JobRequeued, JobStarted, NodeAllocation
    from loom_services.metrics.metering import Metering

    t0 = 1_780_000_000.0
    placed = {
        a: JobPlaced(
            job_id="x",
            tenant="acme",
            cluster="c1",
            region="r1",
            gpu_model="A100",
            allocations=[NodeAllocation("n1", 4)],
            attempt=a,
            placed_at=t0,
        )
        for a in (1, 2)
    }
    events = [
        ("x:placed:1", placed[1]),
        ("x:started:1", JobStarted(job_id="x", tenant="acme", cluster="c1", attempt=1, started_at=t0 + 1)),
        ("x:requeued:2", JobRequeued(job_id="x", tenant="acme", attempt=2, cause="preempted", at=t0 + 11.5)),
        ("x:placed:2", placed[2]),
        ("x:started:2", JobStarted(job_id="x", tenant="acme", cluster="c1", attempt=2, started_at=t0 + 20)),
        ("x:completed:2", JobCompleted(job_id="x", tenant="acme", cluster="c1", attempt=2, at=t0 + 50.25)),
    ]
    pool = await create_pool(await fresh_database("metering-once"), max_size=2)
    try:
        metering = Metering(SimpleNamespace(db=pool), lambda _r, _t: 2.0)  # type: ignore[arg-type]
        # Reversed, in two batches, then everything again (a redelivery, a DLQ replay).
        await metering._apply(events[::-1][:3])
        await metering._apply(events[::-1][3:])
        await metering._apply(events)
        rows = await pool.fetch(
            "SELECT attempt, outcome, sum(gpu_ms)::bigint AS gpu_ms FROM usage_rows GROUP BY 1, 2 ORDER BY 1"
        )
    finally:
        await pool.close()
    assert [(r["attempt"], r["outcome"], r["gpu_ms"]) for r in rows] == [
        (1, "preempted", 4 * 10_500),
        (2, "completed", 4 * 30_250),
    ]
    assert metering.counts["duplicates"] == len(events)


async def test_another_tenants_cancellation_ends_no_run_of_the_job(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    # Placement refuses a cancellation naming another tenant's job; metering must not end the
    # run on it either (before, any cancellation ended every open run of the job it named).
    from types import SimpleNamespace

    from loom.errors import InvalidInputError
    from loom.store.pool import create_pool
    from loom_proto.codec import encode
    from loom_proto.jobs import JobCancelled, JobCompleted, JobStarted
    from loom_services.metrics.metering import Metering

    t0 = 1_780_000_000.0
    placed = _placed("y", t0)
    events = [
        ("y:placed:1", placed),
        ("y:started:1", JobStarted(job_id="y", tenant="acme", cluster="c1", attempt=1, started_at=t0 + 1)),
        ("forged", JobCancelled(job_id="y", tenant="globex", reason="not mine", at=t0 + 5)),
    ]
    pool = await create_pool(await fresh_database("metering-foreign-cancel"), max_size=2)
    try:
        metering = Metering(SimpleNamespace(db=pool), lambda _r, _t: 2.0)  # type: ignore[arg-type]
        folded: list[object] = []

        async def on_folded(seen: list[object], _fresh: list[object]) -> None:
            folded.extend(seen)

        metering.on_folded = on_folded  # type: ignore[assignment]
        # As the consumer delivers them (the forged one on globex's own subject, as its
        # credentials allow): refused, and kept from the reservations overlay too.
        deliveries = [
            SimpleNamespace(
                subject=f"loom.jobs.{kind}.{event.tenant}" + (".c1" if kind == "started" else ""),
                message=encode(event),
                msg_id=mid,
                stream_seq=i,
                msg=None,
            )
            for i, (mid, event) in enumerate(events)
            for kind in [mid.split(":")[1] if ":" in mid else "cancelled"]
        ]
        outcomes = await metering.on_events(deliveries)  # type: ignore[arg-type]
        assert outcomes[:2] == [None, None]
        assert isinstance(outcomes[2], InvalidInputError) and "another tenant's" in str(outcomes[2])
        assert [type(e).__name__ for e in folded] == ["JobPlaced", "JobStarted"]
        assert await pool.fetchval("SELECT count(*) FROM usage_rows") == 0  # still running
        done = JobCompleted(job_id="y", tenant="acme", cluster="c1", attempt=1, at=t0 + 21)
        await metering._apply([("y:completed:1", done)])
        rows = await pool.fetch("SELECT outcome, sum(gpu_ms)::bigint AS gpu_ms FROM usage_rows GROUP BY 1")
    finally:
        await pool.close()
    assert [(r["outcome"], r["gpu_ms"]) for r in rows] == [("completed", 2 * 20_000)]


async def test_an_agents_report_of_a_run_its_cluster_holds_no_part_of_ends_and_claims_nothing(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    # Agent c2's credentials publish only on c2's report subjects, but metering folded whatever
    # came: c2 could end (and so bill short) a run on c1, and take the id c1's own completion is
    # claimed under, so the real end counted as a duplicate. Placement refuses such reports too.
    from types import SimpleNamespace

    import msgspec

    from loom.errors import InvalidInputError, TransientError
    from loom.store.pool import create_pool
    from loom_proto.codec import encode
    from loom_proto.jobs import JobCompleted, JobFailed, JobStarted
    from loom_services.metrics.metering import Metering

    t0 = 1_780_000_000.0
    placed = _placed("z", t0)

    def delivery(seq: int, subject: str, mid: str, event: object) -> object:
        return SimpleNamespace(subject=subject, message=encode(event), msg_id=mid, stream_seq=seq, msg=None)

    pool = await create_pool(await fresh_database("metering-foreign-report"), max_size=2)
    try:
        metering = Metering(SimpleNamespace(db=pool), lambda _r, _t: 2.0)  # type: ignore[arg-type]
        folded: list[object] = []

        async def on_folded(seen: list[object], _fresh: list[object]) -> None:
            folded.extend(seen)

        metering.on_folded = on_folded  # type: ignore[assignment]
        outcomes = await metering.on_events(
            [  # type: ignore[list-item]
                delivery(1, "loom.jobs.placed.acme", "z:placed:1", placed),
                delivery(
                    2,
                    "loom.jobs.started.acme.c1",
                    "z:started:1",
                    JobStarted(job_id="z", tenant="acme", cluster="c1", attempt=1, started_at=t0 + 1),
                ),
                # c2 about the run on c1, first naming its own cluster, then c1 (on c2's subject).
                delivery(
                    3,
                    "loom.jobs.completed.acme.c2",
                    "z:completed:1",
                    JobCompleted(job_id="z", tenant="acme", cluster="c2", attempt=1, at=t0 + 3),
                ),
                delivery(
                    4,
                    "loom.jobs.failed.acme.c2",
                    "z:failed:1",
                    JobFailed(job_id="z", tenant="acme", cluster="c1", attempt=1, reason="x", at=t0 + 4),
                ),
            ]
        )
        assert outcomes[:2] == [None, None]
        assert isinstance(outcomes[2], InvalidInputError) and "holds no part" in str(outcomes[2])
        assert isinstance(outcomes[3], InvalidInputError) and "about a run on c1" in str(outcomes[3])
        assert [type(e).__name__ for e in folded] == ["JobPlaced", "JobStarted"]
        assert await pool.fetchval("SELECT count(*) FROM usage_rows") == 0  # still running
        # A batch of its own this time (the run's clusters read from the stored record).
        late = await metering.on_events(
            [  # type: ignore[list-item]
                delivery(
                    5,
                    "loom.jobs.completed.acme.c2",
                    "z:completed:1",
                    JobCompleted(job_id="z", tenant="acme", cluster="c2", attempt=1, at=t0 + 5),
                )
            ]
        )
        assert isinstance(late[0], InvalidInputError)
        # c2's genuine report of its own run, under the id c1's completion of z will have: claimed
        # under its own job's id (an agent's id is bound to its payload). And a report of a job
        # not placed yet (so of no run its cluster could hold) is refused, claiming nothing.
        own = msgspec.structs.replace(placed, job_id="own", cluster="c2")
        squats = await metering.on_events(
            [  # type: ignore[list-item]
                delivery(7, "loom.jobs.placed.acme", "own:placed:1", own),
                delivery(
                    8,
                    "loom.jobs.completed.acme.c2",
                    "z:completed:1",
                    JobCompleted(job_id="own", tenant="acme", cluster="c2", attempt=1, at=t0 + 6),
                ),
                delivery(
                    9,
                    "loom.jobs.completed.acme.c2",
                    "later:completed:1",
                    JobCompleted(job_id="later", tenant="acme", cluster="c2", attempt=1, at=t0 + 6),
                ),
            ]
        )
        assert squats[:2] == [None, None]
        # Handed back (redelivered later, dead-lettered after the consumer's attempts), unclaimed.
        assert isinstance(squats[2], TransientError) and "no placement" in str(squats[2])
        claimed = {
            r["msg_id"]
            for r in await pool.fetch("SELECT msg_id FROM inbox WHERE consumer = 'metrics-metering'")
        }
        assert "own:completed:1" in claimed and "z:completed:1" not in claimed
        assert not any(m.startswith("later:") for m in claimed)
        # c1's own completion, under the id c2 tried to take: counted, not a duplicate, even with
        # a forgery of it in the same batch, after it (both share the claim id: the forgery's
        # cluster was the one checked, and the genuine completion was acknowledged unfolded).
        real = await metering.on_events(
            [  # type: ignore[list-item]
                delivery(
                    6,
                    "loom.jobs.completed.acme.c1",
                    "z:completed:1",
                    JobCompleted(job_id="z", tenant="acme", cluster="c1", attempt=1, at=t0 + 21),
                ),
                delivery(
                    10,
                    "loom.jobs.completed.acme.c2",
                    "z:completed:1",
                    JobCompleted(job_id="z", tenant="acme", cluster="c2", attempt=1, at=t0 + 7),
                ),
            ]
        )
        assert isinstance(real[1], InvalidInputError) and "holds no part" in str(real[1])
        real = real[:1]
        rows = await pool.fetch("SELECT outcome, sum(gpu_ms)::bigint AS gpu_ms FROM usage_rows GROUP BY 1")
        # A start before its placement in one batch (a redelivery's order): the placement counts.
        early = msgspec.structs.replace(placed, job_id="early")
        order = await metering.on_events(
            [  # type: ignore[list-item]
                delivery(
                    11,
                    "loom.jobs.started.acme.c1",
                    "early:started:1",
                    JobStarted(job_id="early", tenant="acme", cluster="c1", attempt=1, started_at=t0 + 1),
                ),
                delivery(12, "loom.jobs.placed.acme", "early:placed:1", early),
            ]
        )
        assert order == [None, None]
    finally:
        await pool.close()
    assert real == [None] and metering.counts["duplicates"] == 0
    assert [(r["outcome"], r["gpu_ms"]) for r in rows] == [("completed", 2 * 20_000)]


async def test_a_metering_batch_with_one_poison_message_meters_the_others_with_a_fixed_number_of_statements(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    from types import SimpleNamespace

    from loom.store.pool import create_pool
    from loom_proto.codec import encode
    from loom_proto.jobs import JobCompleted, JobPlaced, JobStarted, NodeAllocation
    from loom_services.metrics.metering import Metering

    t0 = 1_780_000_000.0
    jobs = [f"b-{i}" for i in range(5)]
    events: list[tuple[str, object]] = []
    for i, job in enumerate(jobs):
        events += [
            (
                f"{job}:placed:1",
                JobPlaced(
                    job_id=job,
                    tenant="acme",
                    cluster="c1",
                    region="r1",
                    gpu_model="A100",
                    allocations=[NodeAllocation("n1", i + 1)],
                    attempt=1,
                    placed_at=t0,
                ),
            ),
            (
                f"{job}:started:1",
                JobStarted(job_id=job, tenant="acme", cluster="c1", attempt=1, started_at=t0),
            ),
            (
                f"{job}:completed:1",
                JobCompleted(job_id=job, tenant="acme", cluster="c1", attempt=1, at=t0 + 10),
            ),
        ]
    bodies = [(mid, encode(e)) for mid, e in events]
    bodies.insert(7, ("poison", b'{"kind": "placed", "job_id": 7}'))  # not a metered event

    pool = await create_pool(await fresh_database("metering-batch"), max_size=1)
    statements: list[str] = []
    try:
        # The jobs' labels come from their records in ``jobs`` (read for the batch in one go).
        await pool.executemany(
            "INSERT INTO jobs (job_id, tenant, state, spec, submitted_at) "
            "VALUES ($1, 'acme', 'running', $2::jsonb, now())",
            [
                (job, json.dumps({"labels": {"team": f"t{i}"}, "task_type": "inference"}))
                for i, job in enumerate(jobs)
            ],
        )
        metering = Metering(SimpleNamespace(db=pool), lambda _r, _t: 2.0)  # type: ignore[arg-type]

        def logged(q: Any) -> None:
            statements.append(q.query)

        async with pool.acquire() as conn:  # the pool's one connection: what metering uses
            conn.add_query_logger(logged)
        outcomes = await metering.on_events(
            [_delivery(i + 1, mid, body) for i, (mid, body) in enumerate(bodies)]
        )
        async with pool.acquire() as conn:
            conn.remove_query_logger(logged)
        rows = await pool.fetch(
            "SELECT job_id, outcome, labels->>'team' AS team, sum(gpu_ms)::bigint AS gpu_ms "
            "FROM usage_rows GROUP BY 1, 2, 3 ORDER BY 1"
        )
        runs = await pool.fetchval("SELECT count(*) FROM usage_runs")
    finally:
        await pool.close()
    assert [type(o).__name__ if o else None for o in outcomes] == [
        "InvalidInputError" if mid == "poison" else None for mid, _ in bodies
    ]
    assert [(r["job_id"], r["outcome"], r["team"], r["gpu_ms"]) for r in rows] == [
        (job, "completed", f"t{i}", (i + 1) * 10_000) for i, job in enumerate(jobs)
    ]
    assert runs == len(jobs) and metering.counts["events"] == len(events)
    # One read and one write of run records, one read of specs, for the whole batch.
    assert sum("usage_runs" in q for q in statements) == 2
    assert sum("FROM jobs" in q for q in statements) == 1


async def test_the_reservation_overlay_follows_the_metering_deliveries_and_a_redelivery_changes_nothing(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    """One consumer feeds metering and the metrics service's reservation overlay: a placement
    reserves its GPUs until the run starts, a ``placed`` delivered again after the start (a lost
    ack) does not reserve them a second time, and a start delivered again still settles."""
    from types import SimpleNamespace

    from loom.model.ledger import LedgerCluster, LedgerNode
    from loom.store.pool import create_pool
    from loom_proto.codec import encode
    from loom_proto.jobs import JobStarted
    from loom_services.metrics.service import MetricsService

    t0 = 1_780_000_000.0
    placed = _placed("r", t0, gpus=3)
    started = JobStarted(job_id="r", tenant="acme", cluster="c1", attempt=1, started_at=t0 + 1)

    pool = await create_pool(await fresh_database("metering-overlay"), max_size=2)
    try:
        ctx = SimpleNamespace(db=pool, publisher=None, stats={})
        service = MetricsService(ctx)  # type: ignore[arg-type]
        node = LedgerNode("n1", "c1", "r1", "z1", "A100", 8, 0, 0, 0, True, t0)
        service.ledger.load([LedgerCluster(cluster="c1", region="r1")], [node])
        on_events = service.metering.on_events
        await on_events([_delivery(1, "r:placed:1", encode(placed))])
        reserved_after_placed = service.ledger.nodes["n1"].gpus_reserved
        await on_events([_delivery(2, "r:started:1", encode(started))])
        reserved_after_started = service.ledger.nodes["n1"].gpus_reserved
        # The placement again, alone, after the start (its ack was lost): nothing changes.
        await on_events([_delivery(1, "r:placed:1", encode(placed))])
        reserved_after_redelivery = service.ledger.nodes["n1"].gpus_reserved
        # A restarted service rebuilds the reservation from placement's table (not yet confirmed
        # there); the start metering already counted, delivered again, still settles it.
        service.ledger.reserve("r:1", [("n1", 3)])
        await on_events([_delivery(2, "r:started:1", encode(started))])
        reserved_after_restart = service.ledger.nodes["n1"].gpus_reserved
    finally:
        await pool.close()
    assert (reserved_after_placed, reserved_after_started, reserved_after_redelivery) == (3, 0, 0)
    assert reserved_after_restart == 0
    assert service.metering.counts["duplicates"] == 2


async def test_placement_judges_each_report_alone_when_a_forgery_shares_its_claim_id(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    # A forged completion and the genuine one share the claim id `<job>:completed:<attempt>`;
    # keyed by it, the later of the two in a batch decided for both (forged last: the genuine
    # completion was dropped with it, the job stayed running with its GPUs held).
    from loom.store.pool import create_pool
    from loom_proto.jobs import JobCompleted
    from loom_services.placement.service import _foreign_reports

    pool = await create_pool(await fresh_database("placement-foreign-batch"), max_size=1)
    try:
        await pool.execute(
            "INSERT INTO node_allocations (node, cluster, region, zone, gpu_model, gpus_total)"
            " VALUES ('n1', 'c1', 'r1', 'z1', 'A100', 8)"
        )
        await pool.execute(
            "INSERT INTO reservations (job_id, attempt, node, cluster, gpus, state)"
            " VALUES ('r1', 1, 'n1', 'c1', 2, 'confirmed')"
        )

        def done(cluster: str) -> JobCompleted:
            return JobCompleted(job_id="r1", tenant="acme", cluster=cluster, attempt=1, at=1.0)

        async with pool.acquire() as conn:
            for reports in (
                [(0, done("c1"), "c1"), (1, done("c2"), "c2")],
                [(0, done("c2"), "c2"), (1, done("c1"), "c1")],
            ):
                refused = await _foreign_reports(conn, reports)
                forged = next(k for k, _, r in reports if r == "c2")
                assert set(refused) == {forged} and "holds no part" in refused[forged]
    finally:
        await pool.close()


async def test_an_agent_is_told_the_attempts_of_its_own_clusters_runs_only(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    # `loom.placement.attempts` answered any job's state and attempt to any agent (which attempt
    # of another cluster's job to forge a report for). The answer goes to the asker's own inbox.
    from loom.security import attempts_scope
    from loom.store import moves
    from loom.store.pool import create_pool

    assert attempts_scope("_INBOX.agent-c-weu-a.Xyz.1") == (True, "c-weu-a")
    assert attempts_scope("_INBOX.placement.x") == (True, None)
    assert attempts_scope("_INBOX.Rand0m.1") == (True, None)  # an unsecured server's client
    # Subjects an agent reads besides its inbox (an agent's reply there got any job's attempt), a
    # tenant's inbox, none.
    for reply in ("loom.health.agent-c2", "loom.alive.c2", "_INBOX.tenant-acme.x", "_INBOX.agent-", None):
        assert attempts_scope(reply)[0] is False, reply
    pool = await create_pool(await fresh_database("attempts-query"), max_size=1)
    try:
        await pool.execute(
            "INSERT INTO node_allocations (node, cluster, region, zone, gpu_model, gpus_total)"
            " VALUES ('n1', 'c1', 'r1', 'z1', 'A100', 8), ('n2', 'c2', 'r1', 'z1', 'A100', 8)"
        )
        for job, attempt in (("moved", 2), ("other", 1)):
            await pool.execute(
                "INSERT INTO jobs (job_id, tenant, state, spec, attempt, submitted_at)"
                " VALUES ($1, 't', 'running', '{}', $2, now())",
                job,
                attempt,
            )
        # "moved" ran on c1 (attempt 1, released) and runs on c2 now; "other" only ever on c2.
        await pool.execute(
            "INSERT INTO reservations (job_id, attempt, node, cluster, gpus, state) VALUES"
            " ('moved', 1, 'n1', 'c1', 1, 'released'), ('moved', 2, 'n2', 'c2', 1, 'confirmed'),"
            " ('other', 1, 'n2', 'c2', 1, 'confirmed')"
        )
        ids = ["moved", "other", "nothing"]
        async with pool.acquire() as conn:
            everyone = await moves.job_states(conn, ids)
            c1 = await moves.job_states(conn, ids, held_on="c1")
            c2 = await moves.job_states(conn, ids, held_on="c2")
    finally:
        await pool.close()
    assert everyone == {"moved": ("running", 2), "other": ("running", 1)}
    # c1's agent still learns its old run's job moved on (and stops the orphan), nothing else.
    assert c1 == {"moved": ("running", 2)}
    assert c2 == everyone


async def test_reconcile_counts_a_start_from_no_earlier_than_metering_does(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    # A start a year before its placement: metering counts it from 5 minutes before the placement;
    # reconcile, reading placement's history, counted the year and reported a difference.
    import json

    from loom.metering import RunRecord, fold
    from loom.metering.run import CLOCK_SKEW_S
    from loom.store.pool import create_pool
    from loom.store.usage import recorded_runs
    from loom_proto.codec import encode
    from loom_proto.jobs import JobCompleted, JobStarted

    t0 = 1_780_000_000.0
    events = [
        _placed("y1", t0),
        JobStarted(job_id="y1", tenant="acme", cluster="c1", attempt=1, started_at=t0 - 365 * 86_400),
        JobCompleted(job_id="y1", tenant="acme", cluster="c1", attempt=1, at=t0 + 60),
    ]
    pool = await create_pool(await fresh_database("reconcile-bounded"), max_size=1)
    try:
        for i, (kind, event) in enumerate(zip(("placed", "started", "completed"), events, strict=True)):
            await pool.execute(
                "INSERT INTO job_events (job_id, kind, msg_id, event) VALUES ('y1', $1, $2, $3::jsonb)",
                kind,
                f"y1:{kind}:{i}",
                json.dumps(json.loads(encode(event))),
            )
        recorded = await recorded_runs(pool)
    finally:
        await pool.close()
    record = RunRecord(job_id="y1", attempt=1, tenant="acme")
    for event in events:
        record = fold(record, event)  # type: ignore[arg-type]
    assert record.started_ms == round((t0 - CLOCK_SKEW_S) * 1000)
    assert recorded[("y1", 1)] == ("acme", 2 * round((60 + CLOCK_SKEW_S) * 1000))

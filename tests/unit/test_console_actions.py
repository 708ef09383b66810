"""The web console's operator actions, incidents and usage pages: the pure pages, the handlers'
access rules (tenant read-only, forms keyed per session), and the store queries on a real PostgreSQL."""

import asyncio
import csv
import io
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats
import pytest

from loom.bus import Publisher
from loom.metering.usage import USAGE_FIELDS, UsageRow, aggregate
from loom.model.topology import load_topology
from loom.runtime.service import ServiceContext
from loom.runtime.tokens import Access, Tokens, ensure_tokens
from loom.store import console as console_store
from loom.store import usage as usage_store
from loom.store.console import UsageTotal
from loom.store.incidents import save_incidents
from loom_proto import subjects
from loom_proto.alerts import AffectedJob, IncidentChange, TimelineEntry
from loom_services.console import pages
from loom_services.console.http import Request, Response
from loom_services.console.service import COOKIE, Console

OPERATOR = Access("operator")
ALPHA = Access("tenant", "alpha")


def _incident(**over: Any) -> IncidentChange:
    base: dict[str, Any] = {
        "incident_id": "inc-1",
        "change": "opened",
        "reason": "link degraded",
        "state": "open",
        "root_kind": "link",
        "root": "aws-us-east-2~gcp-europe-west4",
        "root_reason": "3 alerts name it",
        "severity": "critical",
        "summary": "link aws-us-east-2 <-> gcp-europe-west4 degraded",
        "jobs": [AffectedJob(job_id="a-1", tenant="alpha"), AffectedJob(job_id="b-1", tenant="beta")],
        "jobs_total": 2,
        "tenants": ["alpha", "beta"],
        "dags": ["b-dag"],
        "alerts": 3,
        "distinct_alerts": 2,
        "opened_at": 1000.0,
        "updated_at": 1010.0,
        "timeline": [
            TimelineEntry(at=1000.0, what="opened: link degraded"),
            TimelineEntry(at=1005.0, what="job b-1 failed on c-euw4-a"),
        ],
    }
    base.update(over)
    return IncidentChange(**base)


def _row(job: str, tenant: str, *, team: str, model: str, hours: float, price: float = 2.0) -> UsageRow:
    return UsageRow(
        job_id=job,
        attempt=1,
        seq=0,
        tenant=tenant,
        labels={"team": team},
        cluster="c-1",
        region="r-1",
        gpu_model=model,
        start_ms=1_000_000,
        end_ms=1_000_000 + round(hours * 3_600_000),
        gpus=2,
        scu_per_gpu=1.5,
        price_per_scu_hour=price,
        outcome="completed",
    )


# ---- pages ----------------------------------------------------------------------------------------


def test_a_tenant_sees_only_its_own_jobs_of_an_incident_and_no_text_naming_others() -> None:
    mine = pages.scoped_incident(_incident(), "alpha")
    assert [j.job_id for j in mine.jobs] == ["a-1"] and mine.jobs_total == 1
    assert mine.tenants == ["alpha"] and mine.dags == []
    assert mine.timeline[0].what == "opened: link degraded"
    assert mine.timeline[1].what == pages.WITHHELD  # it names beta's job
    html = pages.incident_page(ALPHA, mine, form_key="k")
    assert "b-1" not in html and "beta" not in html and "b-dag" not in html
    assert "Acknowledge" not in html and "link aws-us-east-2 ↔ gcp-europe-west4" in html
    assert pages.scoped_incident(_incident(), None) == _incident()  # the operator: all of it


def test_the_operator_acknowledges_an_open_incident_with_the_sessions_form_key() -> None:
    html = pages.incident_page(
        OPERATOR, _incident(), form_key="key-1", notice=pages.notice_of("ack", "incident")
    )
    assert 'action="/incidents/inc-1/ack"' in html and 'name=form_key value="key-1"' in html
    assert "Acknowledged." in html and "b-dag" in html and 'href="/jobs/b-1"' in html
    acked = pages.incident_page(OPERATOR, _incident(state="acknowledged", acked_by="op"), form_key="k")
    assert "/ack" not in acked and "by op" in acked
    listing = pages.incidents_page(OPERATOR, [_incident()], open_only=False)
    assert 'data-incident="inc-1"' in listing and "critical" in listing
    assert "touches your jobs" in pages.incidents_page(ALPHA, [], open_only=True)


def test_a_notice_comes_only_from_the_fixed_list_never_from_the_query() -> None:
    assert pages.notice_of("cancel", "job") == pages.NOTICES["cancel"]
    assert (
        pages.notice_of("<script>alert(1)</script>", "job") is None and pages.notice_of(None, "job") is None
    )
    # Only on the page the action redirects to, and only while it holds (a crafted link showed
    # "Cancelled" on a completed job's page, "Draining" on a job's).
    assert pages.notice_of("drain", "job") is None and pages.notice_of("ack", "cluster") is None
    assert pages.notice_of("cancel", "job", holds=False) is None


def test_the_job_page_leads_the_operator_to_a_confirmation_and_lists_migrations() -> None:
    job = {
        "job_id": "j-1",
        "tenant": "alpha",
        "state": "running",
        "attempt": 2,
        "spec": {},
        "events": [],
        "migrations": [
            {
                "migration_id": "m-1",
                "cause": "drain",
                "state": "completed",
                "from_cluster": "c-a",
                "to_cluster": "c-b",
                "resume_step": 40,
                "lost_steps": 3,
                "why": "c-a draining",
                "planned_at": 1000.0,
            }
        ],
    }
    html = pages.job_page(OPERATOR, job, [], trace_url=None, notice=pages.notice_of("cancel-pending", "job"))
    assert 'href="/jobs/j-1/cancel"' in html and "<form method=post" not in html  # a confirmation first
    assert 'data-migration="m-1"' in html and "c-a → c-b" in html and "c-a draining" in html
    assert "has not recorded it yet" in html
    assert "/cancel" not in pages.job_page(ALPHA, job, [], trace_url=None)
    # The page's script confirms and sends the cancel itself, with the session's form key.
    live = pages.job_page(OPERATOR, job, [], trace_url=None, form_key="key-9")
    assert 'data-form-key="key-9"' in live and 'data-confirm="Cancel j-1?' in live
    confirm = pages.confirm_cancel(OPERATOR, job, "key-9")
    assert 'action="/jobs/j-1/cancel"' in confirm and 'value="key-9"' in confirm
    ended = pages.confirm_cancel(OPERATOR, dict(job, state="completed"), "key-9")
    assert "<form" not in ended and "already ended" in ended


def test_a_drained_cluster_is_marked_and_offers_undrain() -> None:
    cluster = {"gpus_total": 8, "gpus_used": 0, "gpus_reserved": 0, "gpus_free": 8, "nodes": []}
    view = {"regions": {"r": {"zones": {"z": {"clusters": {"c": cluster, "d": cluster}}}}}}
    table = pages.resources_page(OPERATOR, view, ["r", "z"], drains={"c": "draining"})
    assert 'data-drain="draining"' in table and table.count("data-drain=") == 1
    page = pages.resources_page(OPERATOR, view, ["r", "z", "c"], drains={"c": "drained"})
    assert "is <b>drained</b>" in page and 'href="/clusters/c/undrain"' in page
    assert 'href="/clusters/d/drain"' in pages.resources_page(OPERATOR, view, ["r", "z", "d"], drains={})
    assert "/drain" not in pages.resources_page(ALPHA, view, ["r", "z", "d"])
    confirm = pages.confirm_drain(OPERATOR, "c", "drain", 4, "key")
    assert (
        "4 running job(s)" in confirm and "name=force" in confirm and 'action="/clusters/c/drain"' in confirm
    )


def test_usage_is_charted_and_exported_by_the_chosen_key() -> None:
    rows = [
        _row("a-1", "alpha", team="cv", model="A100", hours=3.0),
        _row("a-2", "alpha", team="nlp", model="T4", hours=1.0),
        _row("b-1", "beta", team="cv", model="A100", hours=0.5),
    ]
    groups = [
        UsageTotal(g.key, len(g.runs), g.gpu_ms, g.scu_seconds, g.cost) for g in aggregate(rows, "model")
    ]
    total = UsageTotal("total", 3, sum(g.gpu_ms for g in groups), 17.0 * 3600, 27.0)
    html = pages.usage_page(
        OPERATOR,
        groups,
        total,
        by="model",
        tenant=None,
        since="30d",
        until="",
        by_choices=("tenant", "model"),
    )
    assert html.count("<svg class=chart") == 2 and 'data-key="A100"' in html
    # The total row shows every column (runs as given: distinct runs, counted by the store).
    assert "<tr class=total><td>total</td><td>3</td><td>9.00</td><td>17.00</td><td>27.00</td></tr>" in html
    assert "<td>7.00</td><td>10.50</td><td>21.00</td>" in html  # A100: 2 GPUs x 3.5 h, x 1.5 SCU, x 2/SCU-h
    assert pages.amount(0.0012345) == "0.00123" and pages.amount(1234.5) == "1,234"
    assert 'href="/usage.csv?by=model&amp;since=30d&amp;until="' in html and "name=tenant" in html
    parsed = list(csv.DictReader(io.StringIO(pages.usage_csv(groups, "model"))))
    assert list(parsed[0]) == ["model", *USAGE_FIELDS]  # as `loom usage --csv`
    assert [(r["model"], r["gpu_hours"], r["cost"]) for r in parsed] == [
        ("A100", "7.0", "21.0"),
        ("T4", "2.0", "6.0"),
    ]
    bars = pages.bar_chart("x", [("big", 4.0), ("small", 1.0)], "h")
    assert 'width="560.0"' in bars and 'width="140.0"' in bars
    tenant = pages.usage_page(
        ALPHA,
        [],
        UsageTotal("total", 0, 0, 0.0, 0.0),
        by="model",
        tenant="alpha",
        since="",
        until="",
        by_choices=("model",),
    )
    assert "name=tenant" not in tenant and "your own usage only" in tenant


# ---- handlers -------------------------------------------------------------------------------------


async def _console(tmp_path: Path, nats_url: str) -> tuple[Console, Tokens, Any]:
    """A console on the session's NATS, without a store: the requests below are refused before
    they would read it."""
    tokens = ensure_tokens(tmp_path)
    nc = await nats.connect(nats_url)
    ctx = ServiceContext(name="console", nc=nc, publisher=Publisher(nc), pool=None, stopping=asyncio.Event())
    return Console(ctx, load_topology("small"), tokens, jaeger_url=None), tokens, nc


def _request(method: str, path: str, token: str, *, form: dict[str, str] | None = None) -> Request:
    return Request(
        method=method, path=path, query={}, headers={"cookie": f"{COOKIE}={token}"}, form=form or {}
    )


async def test_a_tenant_cannot_act_nor_open_a_confirmation(tmp_path: Path, nats_url: str) -> None:
    console, tokens, nc = await _console(tmp_path, nats_url)
    alpha = tokens.tenant_token("alpha")
    for path in (
        "/jobs/j-1/cancel",
        "/clusters/c-use2-a/drain",
        "/clusters/c-use2-a/undrain",
        "/incidents/i/ack",
    ):
        answer = await console.handle(
            _request("POST", path, alpha, form={"form_key": tokens.form_key(alpha)})
        )
        assert isinstance(answer, Response) and answer.status == 403, path
    confirm = await console.handle(_request("GET", "/jobs/j-1/cancel", alpha))
    assert isinstance(confirm, Response) and confirm.status == 403
    await nc.close()


async def test_an_operator_form_without_this_sessions_key_is_refused(tmp_path: Path, nats_url: str) -> None:
    console, tokens, nc = await _console(tmp_path, nats_url)
    op = tokens.operator
    for form in ({}, {"form_key": "guess"}, {"form_key": tokens.form_key(tokens.tenant_token("alpha"))}):
        answer = await console.handle(_request("POST", "/clusters/c-use2-a/drain", op, form=form))
        assert isinstance(answer, Response) and answer.status == 403
        assert b"stale" in answer.body
        live = await console.handle(_request("POST", "/jobs/j-1/cancel", op, form={**form, "live": "1"}))
        assert isinstance(live, Response) and live.status == 403  # the page's own cancel too
    assert tokens.form_key(op) != tokens.form_key(op + "x") and op not in tokens.form_key(op)
    await nc.close()


async def test_a_drain_form_outside_the_concurrency_range_is_refused_before_asking(
    tmp_path: Path, nats_url: str
) -> None:
    # Before: 65 was taken (the form says max 64), 0 answered 409, 99999999999 the database's int32 error.
    console, tokens, nc = await _console(tmp_path, nats_url)
    op = tokens.operator
    for value in ("0", "-1", "65", "99999999999"):
        form = {"form_key": tokens.form_key(op), "concurrency": value}
        answer = await console.handle(_request("POST", "/clusters/c-use2-a/drain", op, form=form))
        assert isinstance(answer, Response) and answer.status == 400, value
        assert b"concurrency must be within 1-64" in answer.body
    await nc.close()


async def test_list_pages_refuse_query_values_they_cannot_use(tmp_path: Path, nats_url: str) -> None:
    # Before: limit 0 and -1 showed one row, ?tenant=';-- an empty list and ?open=abc every incident.
    console, tokens, nc = await _console(tmp_path, nats_url)
    op = tokens.operator
    for path, query, said in (
        ("/jobs", {"limit": "0"}, b"limit must be 1 or more"),
        ("/jobs", {"limit": "-1"}, b"limit must be 1 or more"),
        ("/jobs", {"tenant": "';--"}, b"tenant must be an id"),
        ("/incidents", {"open": "abc"}, b"open must be 1 or 0"),
    ):
        request = Request(method="GET", path=path, query=query, headers={"cookie": f"{COOKIE}={op}"}, form={})
        answer = await console.handle(request)
        assert isinstance(answer, Response) and answer.status == 400, (path, query)
        assert said in answer.body
    await nc.close()


# ---- on the real store and bus ----------------------------------------------------------------------


def _check_exported(body: bytes) -> None:
    """The console's CSV by team of the usage below: the columns of `loom usage --csv` (they
    differed: no preempted or failed GPU time there)."""
    rows = list(csv.DictReader(io.StringIO(body.decode())))
    assert [r["label_team"] for r in rows] == ["cv", "nlp"]
    assert list(rows[0]) == ["label_team", *USAGE_FIELDS]
    assert [r["preempted_gpu_ms"] for r in rows] == ["0", str(2 * 3_600_001)]


async def test_incidents_and_usage_pages_show_a_tenant_its_own_only(
    fresh_database: Callable[..., Awaitable[str]], nats_url: str, tmp_path: Path
) -> None:
    url = await fresh_database("console")
    pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
    nc = await nats.connect(nats_url)
    acks: list[bytes] = []

    async def correlator(msg: Any) -> None:  # the correlator's answer on ``loom.incidents.ack``
        acks.append(msg.data)
        await msg.respond(b'{"ok": true, "changed": true, "state": "acknowledged"}')

    sub = await nc.subscribe(subjects.INCIDENTS_ACK, cb=correlator)
    try:
        async with pool.acquire() as conn:
            await save_incidents(
                conn,
                [
                    _incident(),
                    _incident(
                        incident_id="inc-2", tenants=["beta"], jobs=[AffectedJob(job_id="b-2", tenant="beta")]
                    ),
                ],
            )
            now_ms = round(time.time() * 1000)
            for n, (tenant, team, outcome) in enumerate(
                (("alpha", "cv", "completed"), ("beta", "nlp", "preempted"))
            ):
                row = msgspec.structs.replace(
                    _row(f"{tenant}-j", tenant, team=team, model="A100", hours=1.0),
                    start_ms=now_ms - 7_200_000,
                    end_ms=now_ms - 3_600_000 + n,
                    outcome=outcome,
                )
                await usage_store.replace_rows(conn, row.job_id, 1, [row])
        assert [i.incident_id for i in await console_store.incidents_of(pool, "alpha")] == ["inc-1"]
        assert len(await console_store.incidents_of(pool, None)) == 2
        briefs = await console_store.incident_briefs(pool, open_only=True, limit=10)
        assert {i.incident_id: (i.incident_id, i.jobs, i.jobs_total, i.tenants) for i in briefs}["inc-1"] == (
            "inc-1",
            [],
            2,
            ["alpha", "beta"],
        )

        tokens = ensure_tokens(tmp_path)
        ctx = ServiceContext(
            name="console", nc=nc, publisher=Publisher(nc), pool=pool, stopping=asyncio.Event()
        )
        console = Console(ctx, load_topology("small"), tokens, jaeger_url=None)
        alpha = tokens.tenant_token("alpha")

        async def get(path: str, token: str, query: dict[str, str] | None = None) -> Response:
            request = Request("GET", path, query or {}, {"cookie": f"{COOKIE}={token}"})
            answer = await console.handle(request)
            assert isinstance(answer, Response)
            return answer

        listing = await get("/incidents", alpha)
        assert listing.status == 200 and b"inc-1" in listing.body and b"inc-2" not in listing.body
        assert (await get("/incidents/inc-2", alpha)).status == 403
        assert (await get("/incidents/inc-2", tokens.operator)).status == 200
        usage = await get("/usage", alpha, {"tenant": "beta", "by": "tenant"})
        assert usage.status == 200 and b'data-key="alpha"' in usage.body and b"beta" not in usage.body
        exported = await get("/usage.csv", tokens.operator, {"by": "label:team", "since": "1d"})
        assert exported.content_type.startswith("text/csv")
        _check_exported(exported.body)
        assert (await get("/usage", alpha, {"since": "yesterday-ish"})).status == 400

        op = tokens.operator
        ack = await console.handle(
            Request(
                "POST",
                "/incidents/inc-1/ack",
                {},
                {"cookie": f"{COOKIE}={op}"},
                {"form_key": tokens.form_key(op)},
            )
        )
        assert isinstance(ack, Response) and ack.status == 303
        assert ("Location", "/incidents/inc-1?done=ack") in ack.headers
        assert b'"incident_id": "inc-1"' in acks[0]
        await sub.unsubscribe()
        refused = await console.handle(
            Request("POST", "/incidents/inc-1/ack", {}, {"authorization": f"Bearer {op}"}, {})
        )
        assert isinstance(refused, Response) and refused.status == 409 and b"did not answer" in refused.body
    finally:
        await nc.close()
        await pool.close()


async def test_the_usage_sums_of_the_database_are_those_of_metering(
    fresh_database: Callable[..., Awaitable[str]],
) -> None:
    pool = await asyncpg.create_pool(await fresh_database("usage"), min_size=1, max_size=2)
    now_ms = round(time.time() * 1000)
    try:
        async with pool.acquire() as conn:
            for n in range(30):  # rows of several hours, labels and models, for the sums below
                tenant, team = ("alpha", "beta", "gamma")[n % 3], ("cv", None, "nlp")[n % 3]
                start = now_ms - 40 * 3_600_000 + n * 1_234_567
                await usage_store.replace_rows(
                    conn,
                    f"sum-{n}",
                    1 + n % 2,
                    [
                        UsageRow(
                            job_id=f"sum-{n}",
                            attempt=1 + n % 2,
                            seq=k,
                            tenant=tenant,
                            labels={"team": team} if team else {},
                            cluster=f"c-{n % 4}",
                            # Every seventh run spans both regions, an hour in each by turns.
                            region=f"r-{(n + (k if n % 7 == 0 else 0)) % 2}",
                            gpu_model=("A100", "T4", "H100")[n % 3],
                            start_ms=start + k * 3_600_000,
                            end_ms=start + k * 3_600_000 + 1_000 + n * 77_777,
                            gpus=1 + n % 8,
                            scu_per_gpu=0.5 + n / 10,
                            price_per_scu_hour=1.0 + n % 5,
                            outcome="completed" if n % 5 else "preempted",
                        )
                        for k in range(3)
                    ],
                )
        every = await usage_store.read_rows(pool)
        since, until = now_ms - 30 * 3_600_000, now_ms - 3 * 3_600_000
        for by in console_store.USAGE_KEYS:  # the database's sums are aggregate()'s, window cut alike
            for tenant, window in ((None, (None, None)), ("gamma", (since, until)), (None, (since, None))):
                mine = [r for r in every if tenant is None or r.tenant == tenant]
                expected = aggregate(mine, by, since_ms=window[0], until_ms=window[1])
                got, total = await console_store.usage_totals(
                    pool, by, tenant=tenant, since_ms=window[0], until_ms=window[1]
                )
                whole = aggregate(mine, "tenant", since_ms=window[0], until_ms=window[1])
                runs = set().union(*(g.runs for g in whole))
                assert (total.key, total.runs, total.gpu_ms) == (
                    "total",
                    len(runs),
                    sum(g.gpu_ms for g in whole),
                )
                assert total.cost == pytest.approx(sum(g.cost for g in whole), rel=1e-9)
                assert total.scu_seconds == pytest.approx(sum(g.scu_seconds for g in whole), rel=1e-9)
                if by == "region" and window == (None, None):  # spanning runs are in two groups, once in all
                    assert sum(t.runs for t in got) > total.runs
                assert [(t.key, t.runs, t.gpu_ms) for t in got] == [
                    (g.key, len(g.runs), g.gpu_ms) for g in expected
                ]
                assert [t.cost for t in got] == pytest.approx([g.cost for g in expected], rel=1e-9)
                assert [t.scu_seconds for t in got] == pytest.approx(
                    [g.scu_seconds for g in expected], rel=1e-9
                )
        # A window no row reaches: no group, and a total of nothing.
        got, total = await console_store.usage_totals(
            pool, "region", tenant=None, since_ms=now_ms + 3_600_000, until_ms=None
        )
        assert got == []
        assert (total.runs, total.gpu_ms, total.scu_seconds, total.cost) == (0, 0, 0.0, 0.0)
    finally:
        await pool.close()


async def test_acknowledging_an_unknown_incident_is_404_as_its_page_is(tmp_path: Path, nats_url: str) -> None:
    # It answered 409 ("ack refused: no such incident") where GET /incidents/<unknown> is 404.
    console, tokens, nc = await _console(tmp_path, nats_url)
    op = tokens.operator
    correlator = await nats.connect(nats_url)
    answers = iter(
        [
            {"ok": False, "code": "unknown", "error": "no such incident in the correlator"},
            {"ok": False, "error": "bad request: nope"},
        ]
    )

    async def reply(msg: Any) -> None:
        await msg.respond(json.dumps(next(answers)).encode())

    await correlator.subscribe(subjects.INCIDENTS_ACK, cb=reply)
    await correlator.flush()
    form = {"form_key": tokens.form_key(op)}
    unknown = await console.handle(_request("POST", "/incidents/nope/ack", op, form=form))
    assert isinstance(unknown, Response) and unknown.status == 404 and b"no such incident" in unknown.body
    refused = await console.handle(_request("POST", "/incidents/nope/ack", op, form=form))
    assert isinstance(refused, Response) and refused.status == 409
    await correlator.close()
    await nc.close()

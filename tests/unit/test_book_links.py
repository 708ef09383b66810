"""Placement's book adopts link-state events: forecast first, else the median RTT; a stale link doubles it."""

from types import SimpleNamespace

from loom_proto.net import LinkState
from loom_services.placement.book import Book


def link(*, forecast: float | None = None, stale: bool = False) -> LinkState:
    return LinkState(
        src="eu",
        dst="us",
        rtt_ms_p50=80.0,
        rtt_ms_p95=95.0,
        rtt_ms_p99=120.0,
        jitter_ms=2.0,
        loss_rate=0.0,
        bandwidth_gbps=10.0,
        rtt_ms_forecast=forecast,
        cost=1.0,
        stale=stale,
        updated_at=1_700_000_000.0,
    )


def rtt_ms(book: Book) -> float:
    return float(book.net.rtt_ms[book.net.index["eu"], book.net.index["us"]])


def test_a_link_without_a_forecast_is_adopted_at_its_median_rtt() -> None:
    book = Book()
    book.on_link(link())
    assert rtt_ms(book) == 80.0


def test_a_forecast_takes_precedence_over_the_median() -> None:
    book = Book()
    book.on_link(link(forecast=60.0))
    assert rtt_ms(book) == 60.0


def test_a_stale_link_is_taken_at_twice_its_median_and_marked_degraded() -> None:
    book = Book()
    book.on_link(link(forecast=60.0, stale=True))
    assert rtt_ms(book) == 160.0
    assert bool(book.net.degraded[book.net.index["eu"], book.net.index["us"]])


def test_closed_clusters_reach_the_snapshot_with_why_and_their_nodes_take_no_work() -> None:
    from loom.model.capacity import NodeCapacity

    book = Book()
    book.nodes = {
        n: NodeCapacity(node=n, cluster=c, region="eu", zone="eu-a", gpu_model="A100", gpus_total=8)
        for n, c in (("a0", "ca"), ("b0", "cb"))
    }
    assert book.close({"ca": "drained"}) is True
    assert book.close({"ca": "drained"}) is False  # unchanged: the snapshot is kept
    snap = book.snapshot(1000.0)
    assert snap.closed == {"ca": "drained"}
    assert [bool(s) for s in snap.schedulable] == [False, True]  # sorted by cluster: ca, cb
    assert book.close({"ca": "failed"}) is True  # the why changing is a change
    assert book.snapshot(1000.0).closed == {"ca": "failed"}


async def test_a_link_that_degrades_or_recovers_has_every_waiting_job_decided_again() -> None:
    """As the simulator retries every waiting shape at a link's change (placement weighs the
    network): before, the service retried only on each job's backoff, up to 30 s later."""
    import msgspec

    from loom.model.topology import load_topology
    from loom_services.placement.service import PlacementService

    ctx = SimpleNamespace(db=None, publisher=None, stats={}, nc=None, debug={})
    svc = PlacementService(ctx, topology=load_topology("small"))  # type: ignore[arg-type]
    regions = list(svc.book.net.regions)[:2]

    def event(**changes: object) -> SimpleNamespace:
        state = msgspec.structs.replace(link(), src=regions[0], dst=regions[1], **changes)
        return SimpleNamespace(data=msgspec.json.encode(state), subject="loom.net.link.x")

    await svc.on_link(event())  # the first word on a link: what the book assumed may change
    svc.capacity_changed = False
    await svc.on_link(event(rtt_ms_p50=81.0))  # a window's small move: nothing to retry
    assert not svc.capacity_changed
    await svc.on_link(event(degraded=True))
    assert svc.capacity_changed
    svc.capacity_changed = False
    await svc.on_link(event(degraded=True, rtt_ms_p50=200.0))
    assert not svc.capacity_changed
    await svc.on_link(event())  # recovered
    assert svc.capacity_changed
    svc.capacity_changed = False
    await svc.on_link(event(loss_rate=1.0, lost_run=50))  # unreachable, though not marked degraded
    assert svc.capacity_changed


def test_the_service_gives_its_snapshots_the_learners_rule_for_a_big_jobs_untried_gpus() -> None:
    """As the simulator's engine does for Loom (``Snapshot.set_risk`` from ``LearnSettings``)."""
    from loom.model.capacity import NodeCapacity
    from loom.model.topology import load_topology
    from loom_services.placement.service import PlacementService

    ctx = SimpleNamespace(db=None, publisher=None, stats={}, nc=None, debug={})
    svc = PlacementService(ctx, topology=load_topology("small"))  # type: ignore[arg-type]
    settings = svc.learner.settings
    assert svc.book.risk == (settings.risk_gpu_hours, settings.risk_factor) == (16.0, 0.8)
    svc.book.nodes = {
        "a0": NodeCapacity(node="a0", cluster="ca", region="eu", zone="eu-a", gpu_model="A100", gpus_total=8)
    }
    assert svc.book.snapshot(1000.0).risk == (16.0, 0.8)
    assert Book().snapshot(1000.0).risk is None  # a book nobody set: off


def test_loom_explain_notes_the_big_job_handicap_even_where_nothing_was_learned_yet() -> None:
    """The speed note a decision record carries says when a big job weighed its chosen model, one
    its family never ran on, at the handicap, also on a model with no learned factor at all."""
    from loom.model.capacity import NodeCapacity
    from loom.model.topology import load_topology
    from loom_proto.jobs import JobSubmitted, Work
    from loom_services.placement.service import PlacementService

    ctx = SimpleNamespace(db=None, publisher=None, stats={}, nc=None, debug={})
    svc = PlacementService(ctx, topology=load_topology("small"))  # type: ignore[arg-type]
    svc.book.nodes = {
        n: NodeCapacity(node=n, cluster="ca", region="eu", zone="eu-a", gpu_model=m, gpus_total=8)
        for n, m in (("a0", "A100"), ("v0", "V100M16"))
    }
    svc.book.set_learned({("bert", "V100M16"): 1.0}, [("bert", "V100M16")])
    snap = svc.book.snapshot(1000.0)

    def bert(hours: float) -> JobSubmitted:
        return JobSubmitted(
            job_id="j", tenant="t", work=Work(steps=3600, step_time_s=hours), labels={"model": "BERT"}
        )

    note = svc._speed_note(bert(20.0), "A100", snap)
    assert note.startswith("speed of family bert on A100: the profile's (nothing learned yet)")
    assert "counted at x0.8 in the choice (this one among them)" in note
    assert "counted at x0.8 in the choice" in svc._speed_note(bert(20.0), "V100M16", snap)
    assert "(this one among them)" not in svc._speed_note(bert(20.0), "V100M16", snap)
    assert svc._speed_note(bert(1.0), "A100", snap).endswith("(nothing learned yet)")  # a small job

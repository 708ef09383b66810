"""The pure alert correlator: attribution, grouping, root cause, lifecycle, rate limits, bounds."""

import json

import msgspec
import pytest

from loom.alerts import (
    Correlator,
    CorrelatorConfig,
    Inventory,
    JobPlacement,
    MalformedPayloadError,
    Part,
    Placements,
    link_name,
    parse_payload,
)
from loom.model.topology import load_topology
from loom_proto.alerts import Alert

TOPOLOGY = load_topology("small")
# small: c-sea1-a (gcp-asia-southeast1), c-use2-a (aws-us-east-2), c-weu-a (azure-westeurope)
SEA, USE, WEU = "gcp-asia-southeast1", "aws-us-east-2", "azure-westeurope"
NODES = {c.id: [n.id for n in c.nodes] for c in TOPOLOGY.clusters}


def placements(jobs: list[JobPlacement]) -> Placements:
    return Placements(Inventory.from_topology(TOPOLOGY), jobs)


def job(job_id: str, *parts: tuple[str, int], tenant: str = "t1", parent: str | None = None) -> JobPlacement:
    return JobPlacement(
        job_id, tenant, tuple(Part(cluster, (NODES[cluster][i],)) for cluster, i in parts), parent=parent
    )


def alert(n: int, at: float = 0.0, **kw: object) -> Alert:
    fields: dict[str, object] = {"alert_id": f"a{n}", "source": "test", "severity": "warning", "summary": "x"}
    fields.update(kw)
    return Alert(at=at, **fields)  # type: ignore[arg-type]


def run(c: Correlator, alerts: list[tuple[float, Alert]], until: float) -> list[str]:
    """Feed alerts at their times, ticking every 0.1 s; the notification kinds in order."""
    kinds: list[str] = []
    t = 0.0
    pending = sorted(alerts, key=lambda x: x[0])
    i = 0
    while t <= until:
        while i < len(pending) and pending[i][0] <= t:
            kinds.extend(n.kind for n in c.ingest(pending[i][1], t))
            i += 1
        kinds.extend(n.kind for n in c.tick(t))
        t = round(t + 0.1, 3)
    return kinds


def test_a_job_is_attributed_to_every_resource_its_parts_use_including_the_link_between_them() -> None:
    p = placements([job("gang", ("c-use2-a", 0), ("c-weu-a", 1))])
    used = p.implicated(None, "gang")
    assert ("cluster", "c-use2-a") in used and ("cluster", "c-weu-a") in used
    assert ("node", NODES["c-weu-a"][1]) in used
    assert ("link", link_name(USE, WEU)) in used
    assert ("link", link_name(USE, SEA)) not in used
    assert p.jobs_on(("link", link_name(WEU, USE))) == {"gang"}


def test_a_relayed_path_puts_the_job_on_each_hop_and_on_the_direct_link() -> None:
    inv = Inventory.from_topology(TOPOLOGY)
    jobs = [job("j", ("c-use2-a", 0), ("c-weu-a", 0)), job("k", ("c-use2-a", 1), ("c-sea1-a", 0))]
    p = Placements(inv, jobs, paths={(USE, WEU): (USE, SEA, WEU)})
    assert p.jobs_on(("link", link_name(USE, SEA))) == {"j", "k"}
    assert p.jobs_on(("link", link_name(SEA, WEU))) == {"j"}
    assert p.jobs_on(("link", link_name(USE, WEU))) == {"j"}


def test_a_cluster_storm_makes_one_incident_with_every_job_and_one_notification() -> None:
    jobs = [job(f"j{i}", ("c-use2-a", i % 6)) for i in range(60)] + [job("other", ("c-weu-a", 0))]
    c = Correlator(placements(jobs))
    storm: list[tuple[float, Alert]] = []
    n = 0
    for rep in range(5):
        for i in range(60):
            n += 1
            storm.append((rep * 2 + i * 0.01, alert(n, job_id=f"j{i}", dedup_key=f"job-{i}-{rep}")))
        for k in range(6):
            n += 1
            storm.append((rep * 2 + 0.3, alert(n, node=NODES["c-use2-a"][k], dedup_key=f"node-{k}")))
        n += 1
        storm.append((rep * 2 + 0.5, alert(n, cluster="c-use2-a", severity="critical", dedup_key="cl")))
    kinds = run(c, storm, 12.0)
    assert len(c.incidents) == 1
    inc = next(iter(c.incidents.values()))
    assert inc.root == ("cluster", "c-use2-a")
    assert set(inc.jobs) == {f"j{i}" for i in range(60)}
    assert inc.alert_count == len(storm)
    assert kinds.count("opened") == 1
    assert len(kinds) <= 3


def test_jobs_on_several_clusters_degrading_together_across_one_link_point_at_the_link() -> None:
    jobs = [
        job("g1", ("c-use2-a", 0), ("c-weu-a", 0)),
        job("g2", ("c-use2-a", 1), ("c-weu-a", 2)),
        job("g3", ("c-use2-a", 2), ("c-weu-a", 3)),
        job("local-use", ("c-use2-a", 3)),
        job("local-weu", ("c-weu-a", 4)),
        job("other-link", ("c-use2-a", 4), ("c-sea1-a", 0)),
    ]
    c = Correlator(placements(jobs))
    # Three jobs alerting seconds apart: the first waits for company and the link is recognised.
    run(c, [(0.0, alert(1, job_id="g1")), (3.0, alert(2, job_id="g2")), (6.0, alert(3, job_id="g3"))], 12.0)
    [inc] = c.incidents.values()
    assert inc.root == ("link", link_name(USE, WEU))
    assert set(inc.jobs) == {"g1", "g2", "g3"}


def test_a_link_alert_names_the_jobs_whose_parts_span_it() -> None:
    jobs = [job("g1", ("c-use2-a", 0), ("c-weu-a", 0)), job("solo", ("c-use2-a", 1))]
    c = Correlator(placements(jobs))
    kinds = run(c, [(0.0, alert(1, link=(WEU, USE), dedup_key="link"))], 1.0)
    [inc] = c.incidents.values()
    assert inc.root == ("link", link_name(USE, WEU)) and set(inc.jobs) == {"g1"}
    assert kinds == ["opened"]
    assert run(c, [(0.0, alert(2, link=(USE, WEU), status="resolved", dedup_key="link"))], 0.0) == [
        "resolved"
    ]
    assert inc.state == "resolved"


def test_a_node_whose_jobs_fail_is_the_root_not_its_cluster() -> None:
    jobs = [job("a", ("c-use2-a", 0)), job("b", ("c-use2-a", 0)), job("c", ("c-use2-a", 1))]
    c = Correlator(placements(jobs))
    run(c, [(0.0, alert(1, job_id="a")), (0.1, alert(2, job_id="b"))], 1.0)
    [inc] = c.incidents.values()
    assert inc.root == ("node", NODES["c-use2-a"][0])


def test_a_job_alert_under_an_open_cluster_incident_is_attached_not_notified() -> None:
    c = Correlator(placements([job("a", ("c-use2-a", 0)), job("b", ("c-use2-a", 1))]))
    kinds = run(c, [(0.0, alert(1, cluster="c-use2-a")), (5.0, alert(2, job_id="b", momentary=True))], 60.0)
    assert kinds == ["opened"]
    [inc] = c.incidents.values()
    assert inc.alert_count == 2 and c.counts["attached"] == 1


def test_lifecycle_ack_then_auto_resolve_on_recovery_then_reopen_on_relapse() -> None:
    c = Correlator(placements([job("a", ("c-use2-a", 0))]))
    run(c, [(0.0, alert(1, cluster="c-use2-a", dedup_key="cl"))], 1.0)
    [inc] = c.incidents.values()
    note = c.ack(inc.incident_id, "ops", 2.0)
    assert note is not None and note.incident.state == "acknowledged"
    notes = c.ingest(alert(2, cluster="c-use2-a", status="resolved", dedup_key="cl"), 3.0)
    assert [n.kind for n in notes] == ["resolved"] and inc.state == "resolved"
    kinds = run(c, [(4.0, alert(3, cluster="c-use2-a", dedup_key="cl"))], 5.0)
    assert kinds == ["opened"] and inc.state == "open" and inc.reopened == 1
    assert len(c.incidents) == 1


def test_a_lone_job_alert_waits_for_company_then_resolves_after_the_quiet_period() -> None:
    c = Correlator(placements([job("a", ("c-use2-a", 0))]), CorrelatorConfig(quiet_s=10.0, weak_wait_s=2.0))
    assert run(c, [(0.0, alert(1, job_id="a", momentary=True))], 1.5) == []
    assert len(c.waiting) == 1
    c2 = Correlator(placements([job("a", ("c-use2-a", 0))]), CorrelatorConfig(quiet_s=10.0, weak_wait_s=2.0))
    kinds = run(c2, [(0.0, alert(1, job_id="a", momentary=True))], 14.0)
    assert kinds == ["opened", "resolved"]
    [inc] = c2.incidents.values()
    assert inc.root == ("job", "a") and inc.opened_at >= 2.0


def test_updates_are_rate_limited_per_incident_and_coalesced() -> None:
    jobs = [job(f"j{i}", ("c-use2-a", i % 6)) for i in range(20)]
    c = Correlator(placements(jobs), CorrelatorConfig(min_update_interval_s=10.0))
    # Severity climbs twice within the interval: one coalesced update, after the interval.
    kinds = run(
        c,
        [
            (0.0, alert(1, cluster="c-use2-a", severity="info", dedup_key="a")),
            (1.0, alert(2, cluster="c-use2-a", severity="warning", dedup_key="b")),
            (2.0, alert(3, cluster="c-use2-a", severity="critical", dedup_key="c")),
        ],
        30.0,
    )
    assert kinds == ["opened", "updated"]


def test_a_storm_of_distinct_unknown_alerts_keeps_memory_and_notifications_bounded() -> None:
    config = CorrelatorConfig(max_open=50, max_notifications_per_min=20, max_fingerprints=1_000)
    c = Correlator(placements([]), config)
    kinds: list[str] = []
    for i in range(10_000):
        t = i * 0.006  # 10,000 alerts in a minute
        kinds.extend(n.kind for n in c.ingest(alert(i, node=f"ghost-{i}", dedup_key=f"g{i}"), t))
        if i % 10 == 0:
            kinds.extend(n.kind for n in c.tick(t))
    kinds.extend(n.kind for n in c.tick(61.0))
    assert len(c.open_by_root) <= 51
    assert len(c.fingerprints) <= 1_000
    assert len(kinds) <= 20 + 20 + 1  # the bucket's burst, a minute's refill, and rounding
    overflow = c.incidents[c.open_by_root[("service", "overflow")]]
    assert overflow.alert_count > 9_000


def test_unknown_resources_are_kept_unattributed_and_visible() -> None:
    c = Correlator(placements([job("a", ("c-use2-a", 0))]))
    run(c, [(0.0, alert(1, cluster="c-nowhere"))], 1.0)
    [inc] = c.incidents.values()
    change = inc.change("opened", "x")
    assert change.root == "c-nowhere" and not change.root_known and change.unattributed and change.jobs == []


def test_a_clock_skewed_alert_is_correlated_on_receipt_time_and_flagged() -> None:
    c = Correlator(placements([job("a", ("c-use2-a", 0))]))
    kinds = run(c, [(0.0, alert(1, at=10_000_000.0, cluster="c-use2-a"))], 1.0)
    [inc] = c.incidents.values()
    assert kinds == ["opened"] and inc.opened_at == pytest.approx(0.5, abs=0.11)
    assert c.counts["skewed"] == 1 and any("clock skewed" in e.what for e in inc.timeline)


def test_a_dag_stage_incident_names_its_dag_and_tenant() -> None:
    c = Correlator(placements([job("dag-s1", ("c-weu-a", 0), tenant="acme", parent="dag")]))
    run(c, [(0.0, alert(1, node=NODES["c-weu-a"][0]))], 1.0)
    [inc] = c.incidents.values()
    change = inc.change("opened", "x")
    assert change.dags == ["dag"] and change.tenants == ["acme"]


def test_a_narrow_incident_is_promoted_when_its_cluster_turns_out_to_be_the_root() -> None:
    jobs = [job(f"j{i}", ("c-use2-a", i % 6)) for i in range(12)]
    c = Correlator(placements(jobs))
    kinds = run(
        c,
        [
            (0.0, alert(1, node=NODES["c-use2-a"][0])),
            (3.0, alert(2, cluster="c-use2-a", severity="critical")),
        ],
        40.0,
    )
    [inc] = c.incidents.values()
    assert inc.root == ("cluster", "c-use2-a") and len(inc.jobs) == 12
    assert kinds == ["opened", "updated"]


def _am(alerts: list[dict[str, object]], version: str = "4") -> bytes:
    return json.dumps(
        {
            "version": version,
            "groupKey": "{}:{}",
            "truncatedAlerts": 0,
            "status": "firing",
            "receiver": "loom",
            "groupLabels": {},
            "commonLabels": {},
            "commonAnnotations": {},
            "externalURL": "http://am:9093",
            "alerts": alerts,
        }
    ).encode()


def test_an_alertmanager_v4_payload_becomes_loom_alerts() -> None:
    body = _am(
        [
            {
                "status": "firing",
                "labels": {
                    "alertname": "NodeDown",
                    "node": "n-1",
                    "cluster": "c-use2-a",
                    "severity": "page",
                    "instance": "10.0.0.1:9100",
                    "job": "node-exporter",
                },
                "annotations": {"summary": "node n-1 down"},
                "startsAt": "2026-12-01T10:00:00.123456789Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://prom/graph",
                "fingerprint": "a1b2c3d4e5f60718",
            }
        ]
    )
    [a] = parse_payload(body)
    assert (a.node, a.cluster, a.severity, a.job_id) == ("n-1", "c-use2-a", "critical", None)
    assert a.dedup_key == "am-a1b2c3d4e5f60718" and a.summary == "node n-1 down"
    assert a.at == pytest.approx(1_796_119_200.123456)


def test_the_readmes_example_alertmanager_payload_is_one_critical_alert_on_a_cluster() -> None:
    """README's ``curl ... --data @examples/alertmanager-payload.json`` sends a payload the receiver takes."""
    from pathlib import Path

    body = (Path(__file__).parents[2] / "examples" / "alertmanager-payload.json").read_bytes()
    [a] = parse_payload(body)
    assert (a.cluster, a.node, a.severity, a.source) == ("c-weu-a", None, "critical", "alertmanager")


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        _am([], version="3"),
        json.dumps({"version": "4"}).encode(),
        _am([{"status": "weird", "labels": {}, "startsAt": "2026-12-01T10:00:00Z"}]),
        _am([{"status": "firing", "labels": {}, "startsAt": "yesterday"}]),
        _am([{"status": "firing", "labels": "x", "startsAt": "2026-12-01T10:00:00Z"}]),
    ],
)
def test_malformed_alertmanager_payloads_are_refused_with_a_reason(body: bytes) -> None:
    with pytest.raises(MalformedPayloadError):
        parse_payload(body)


def test_both_directions_of_a_degraded_link_share_one_fingerprint_and_recovery_resolves_it() -> None:
    from loom.alerts.sources import from_link_event
    from loom_proto.net import LinkDegraded, LinkRecovered

    there = from_link_event(
        LinkDegraded(src=USE, dst=WEU, at=1.0, reason="r", baseline_rtt_ms=90, loss_rate=0.0)
    )
    back = from_link_event(
        LinkDegraded(src=WEU, dst=USE, at=1.0, reason="r", baseline_rtt_ms=90, loss_rate=0.0)
    )
    over = from_link_event(
        LinkRecovered(src=USE, dst=WEU, at=2.0, reason="r", baseline_rtt_ms=90, loss_rate=0.0)
    )
    assert there.dedup_key == back.dedup_key == over.dedup_key
    assert (there.status, over.status) == ("firing", "resolved")


def test_only_lost_or_unstarted_runs_become_job_alerts() -> None:
    from loom.alerts.sources import from_job_requeued
    from loom_proto.jobs import JobRequeued

    def requeued(cause: str) -> Alert | None:
        return from_job_requeued(JobRequeued(job_id="j", tenant="t", attempt=2, cause=cause, at=1.0))  # type: ignore[arg-type]

    assert requeued("cluster_lost") is not None and requeued("start_timeout") is not None
    assert requeued("preempted") is None and requeued("resized") is None


def test_only_failed_migrations_become_job_alerts_once_per_migration() -> None:
    from loom.alerts.sources import from_migration_failed
    from loom_proto.migrations import MigrationEvent

    def event(kind: str) -> MigrationEvent:
        return MigrationEvent(
            migration_id="j:1",
            kind=kind,  # type: ignore[arg-type]
            job_id="j",
            tenant="t",
            cause="drain",
            from_cluster="c-weu-a",
            from_attempt=1,
            why="no checkpoint before the deadline",
            at=5.0,
        )

    failed = from_migration_failed(event("failed"))
    assert failed is not None and failed.job_id == "j" and failed.momentary
    assert "c-weu-a" in failed.summary and failed.labels["tenant"] == "t"
    again = from_migration_failed(event("failed"))
    assert again is not None and again.dedup_key == failed.dedup_key
    assert all(from_migration_failed(event(k)) is None for k in ("planned", "started", "completed"))
    # The job's run ended by itself before it moved: nothing to alert (a failed job has its own).
    assert from_migration_failed(msgspec.structs.replace(event("failed"), moot=True)) is None


def test_stale_views_unhealthy_nodes_and_dead_letters_fire_once_and_resolve() -> None:
    from loom.alerts.sources import ConditionTracker
    from loom_proto.view import NodeView, ViewDelta

    track = ConditionTracker(dlq_threshold=3, dlq_window_s=10.0)

    def delta(stale: bool, healthy: bool, version: int) -> ViewDelta:
        node = NodeView(node="n1", zone="z", healthy=healthy, updated_at=1.0)
        return ViewDelta(
            region="r", cluster="c1", version=version, nodes=[node], stale=stale, at=float(version)
        )

    assert [(a.cluster, a.node, a.status) for a in track.view_delta(delta(True, False, 1))] == [
        ("c1", None, "firing"),
        ("c1", "n1", "firing"),
    ]
    assert track.view_delta(delta(True, False, 2)) == []  # no change, no alert
    assert [a.status for a in track.view_delta(delta(False, True, 3))] == ["resolved", "resolved"]
    fired = [a for t in (0.0, 1.0, 2.0, 3.0) for a in track.dead_letter(t)]
    assert [a.status for a in fired] == ["firing"]
    assert [a.status for a in track.tick(20.0)] == ["resolved"]


def test_compose_runs_the_alert_correlator_with_arguments_its_parser_accepts() -> None:
    from pathlib import Path

    import yaml

    from loom.runtime.stack import StackOptions, service_argvs
    from loom_services.alert_correlator.main import parse_args

    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
    service = compose["services"]["alert-correlator"]
    args = parse_args(service["command"][1:])
    assert (args.http_host, args.http_port) == ("0.0.0.0", 9095)
    assert service["ports"] == ["127.0.0.1:9095:9095"]
    assert parse_args(service_argvs(StackOptions())["alert-correlator"][3:]).topology == "default"


def test_each_embedded_stack_takes_its_own_webhook_port_unless_one_is_fixed() -> None:
    # Before, every `loom up` took 9095: on a shared machine one stack's webhook answered alerts
    # meant for another (the README's curl reached the wrong stack, 200 and all).
    from loom.runtime.stack import StackOptions, choose_alerts_port, service_argvs
    from loom_services.alert_correlator.main import parse_args

    fixed = choose_alerts_port({"LOOM_ALERTS_HTTP_PORT": "19095"})
    assert fixed == 19095
    free = choose_alerts_port({})
    assert 0 < free < 65536
    assert choose_alerts_port({"LOOM_ALERTS_HTTP_PORT": "nope"}) not in (0, 9095)
    # The port this home's stack had last time, kept while nothing else listens there (an
    # Alertmanager pointed at it keeps reaching it across `loom down` / `loom up`).
    assert choose_alerts_port({}, previous=free) == free
    assert choose_alerts_port({"LOOM_ALERTS_HTTP_PORT": "19095"}, previous=free) == 19095
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert choose_alerts_port({}, previous=taken.getsockname()[1]) != taken.getsockname()[1]
    argv = service_argvs(StackOptions(alerts_port=free))["alert-correlator"]
    assert parse_args(argv[3:]).http_port == free


def test_the_root_recovers_only_when_every_alert_naming_it_has_resolved() -> None:
    c = Correlator(placements([job("a", ("c-use2-a", 0))]))
    run(
        c,
        [
            (0.0, alert(1, cluster="c-use2-a", dedup_key="down")),
            (0.1, alert(2, cluster="c-use2-a", dedup_key="cpu")),
        ],
        1.0,
    )
    [inc] = c.incidents.values()
    assert c.ingest(alert(3, cluster="c-use2-a", status="resolved", dedup_key="cpu"), 2.0) == []
    assert inc.state == "open"
    notes = c.ingest(alert(4, cluster="c-use2-a", status="resolved", dedup_key="down"), 3.0)
    assert [n.kind for n in notes] == ["resolved"] and "recovered" in notes[0].incident.reason


def test_a_restored_incident_keeps_attracting_its_alerts_and_relapses_reopen_it() -> None:
    from loom.alerts import Incident

    p = placements([job("a", ("c-use2-a", 0))])
    first = Correlator(p)
    run(first, [(0.0, alert(1, cluster="c-use2-a", dedup_key="down"))], 1.0)
    [inc] = first.incidents.values()
    record = inc.change("updated", "persisted")

    again = Correlator(p)  # a restarted correlator
    again.restore(Incident.from_change(record))
    assert again.ingest(alert(2, job_id="a", momentary=True), 10.0) == []
    assert again.incidents[inc.incident_id].alert_count == 2 and len(again.incidents) == 1
    assert [n.kind for n in again.ingest(alert(3, cluster="c-use2-a", status="resolved"), 11.0)] == [
        "resolved"
    ]
    kinds = [n.kind for n in again.ingest(alert(4, cluster="c-use2-a", dedup_key="down"), 12.0)]
    kinds += [n.kind for n in again.tick(13.0)]
    assert kinds == ["opened"] and again.incidents[inc.incident_id].reopened == 1


def test_a_run_loom_stopped_raises_no_alert_but_a_failed_run_does() -> None:
    from loom.alerts.sources import from_job_failed
    from loom_proto.jobs import JobFailed

    failed = JobFailed(job_id="j1", tenant="acme", cluster="c1", reason="exit 3", at=1.0, exit_code=3)
    alert = from_job_failed(failed)
    assert alert is not None and alert.job_id == "j1" and "exit 3" in alert.summary
    stopped = JobFailed(
        job_id="j1", tenant="acme", cluster="c1", reason="cancelled: by the operator", at=1.0, stopped=True
    )
    assert from_job_failed(stopped) is None


def test_a_service_missing_its_health_answers_fires_once_after_the_misses_and_resolves_on_ok() -> None:
    from loom.alerts.sources import HealthWatch

    watch = HealthWatch(misses=3, startup_grace_s=60.0)
    # Still starting: an instance that never answered fires only after the grace.
    assert [watch.missed("placement", t, 2.0) for t in (0.0, 5.0, 10.0, 55.0)] == [[], [], [], []]
    assert [a.status for a in watch.missed("placement", 60.0, 2.0)] == ["firing"]
    assert watch.answered("migration", "ok", 0.0) == []
    assert watch.missed("migration", 5.0, 2.0) == [] and watch.missed("migration", 10.0, 2.0) == []
    [fired] = watch.missed("migration", 15.0, 2.0)
    assert (fired.status, fired.severity, fired.labels["service"]) == ("firing", "critical", "migration")
    assert "3 times in a row" in fired.summary
    assert watch.missed("migration", 20.0, 2.0) == []  # still missing: no repeat
    [resolved] = watch.answered("migration", "ok", 25.0)
    assert resolved.status == "resolved" and resolved.dedup_key == fired.dedup_key
    # One late answer between misses starts the count again: not an outage.
    for t in (30.0, 35.0):
        assert watch.missed("migration", t, 2.0) == []
    assert watch.answered("migration", "ok", 40.0) == []
    assert watch.missed("migration", 45.0, 2.0) == []


def test_a_degraded_answer_fires_a_warning_and_a_silent_agent_names_its_cluster() -> None:
    from loom.alerts.correlate import signal_of
    from loom.alerts.sources import HealthWatch

    watch = HealthWatch(misses=1, startup_grace_s=0.0)
    [degraded] = watch.answered("placement", "degraded: postgres unavailable", 0.0)
    assert degraded.severity == "warning" and "postgres unavailable" in degraded.summary
    assert watch.answered("placement", "degraded: postgres unavailable", 5.0) == []
    assert [a.status for a in watch.answered("placement", "ok", 10.0)] == ["resolved"]
    [agent] = watch.missed("agent-c-use2-a", 0.0, 2.0)
    assert signal_of(agent).resource == ("cluster", "c-use2-a")
    assert signal_of(degraded).resource == ("service", "placement")


def test_a_silent_agent_and_its_stale_cluster_make_one_cluster_incident_with_its_jobs() -> None:
    from loom.alerts.sources import HealthWatch, from_cluster_health
    from loom_proto.clusters import ClusterHealthChanged

    c = Correlator(
        placements([job("a", ("c-use2-a", 0)), job("b", ("c-use2-a", 1)), job("x", ("c-weu-a", 0))])
    )
    [silent] = HealthWatch(misses=1, startup_grace_s=0.0).missed("agent-c-use2-a", 0.0, 2.0)
    suspect = from_cluster_health(
        ClusterHealthChanged(cluster="c-use2-a", state="suspect", reason="no heartbeat", at=0.2)
    )
    failed = from_cluster_health(
        ClusterHealthChanged(cluster="c-use2-a", state="failed", reason="no heartbeat, probes lost", at=3.0)
    )
    kinds = run(c, [(0.0, silent), (0.2, suspect), (3.0, failed)], 40.0)
    [inc] = c.incidents.values()
    assert inc.root == ("cluster", "c-use2-a") and set(inc.jobs) == {"a", "b"}
    assert inc.severity == "critical"  # failed raised it
    assert kinds[0] == "opened" and len(kinds) <= 3
    healthy = from_cluster_health(ClusterHealthChanged(cluster="c-use2-a", state="healthy", at=50.0))
    assert healthy.status == "resolved" and healthy.dedup_key == failed.dedup_key == suspect.dedup_key


def test_a_slow_run_on_one_node_points_at_the_node_and_one_on_several_at_its_job() -> None:
    from loom.alerts.correlate import signal_of
    from loom.alerts.sources import from_slow_run
    from loom_proto.clusters import SlowRun

    node = NODES["c-use2-a"][0]
    one = from_slow_run(
        SlowRun(job_id="a", attempt=1, observed_step_s=4.0, predicted_step_s=1.0, nodes=[node], tenant="t1"),
        7.0,
    )
    assert one.momentary and one.at == 7.0 and signal_of(one).resource == ("node", node)
    assert "4 s a step (predicted 1 s)" in one.summary and one.labels["tenant"] == "t1"
    many = from_slow_run(
        SlowRun(job_id="b", attempt=2, observed_step_s=3.0, nodes=NODES["c-use2-a"][:2], cluster="c-use2-a"),
        8.0,
    )
    assert signal_of(many).resource == ("cluster", "c-use2-a") and many.job_id == "b"
    c = Correlator(placements([job("a", ("c-use2-a", 0)), job("b", ("c-use2-a", 0))]))
    run(
        c,
        [
            (0.0, one),
            (0.1, from_slow_run(SlowRun(job_id="b", attempt=1, observed_step_s=3.0, nodes=[node]), 0.1)),
        ],
        2.0,
    )
    [inc] = c.incidents.values()
    assert inc.root == ("node", node) and set(inc.jobs) == {"a", "b"}


def test_busy_says_when_a_tick_has_near_work_and_clears_once_it_is_done() -> None:
    c = Correlator(placements([job("a", ("c-use2-a", 0))]), CorrelatorConfig(min_update_interval_s=10.0))
    assert not c.busy()  # nothing ingested: the service may tick slowly
    c.ingest(alert(1, cluster="c-use2-a", severity="info", dedup_key="a"), 0.0)
    assert c.busy()  # waiting to be grouped
    assert [n.kind for n in c.tick(1.0)] == ["opened"]
    assert c.busy()  # changed, not yet persisted
    c.take_changed()
    assert not c.busy()  # open, nothing to send: only the quiet period can resolve it
    c.ingest(alert(2, cluster="c-use2-a", severity="critical", dedup_key="b"), 2.0)
    c.tick(3.0)
    c.take_changed()
    assert c.busy()  # an update held back by the rate limit
    assert [n.kind for n in c.tick(12.0)] == ["updated"]
    c.take_changed()
    assert not c.busy()


def test_ticking_slowly_while_not_busy_sends_the_same_notifications_as_soon() -> None:
    """The service ticks every 0.05 s while busy, else every 0.5 s, and at once on an input: the
    notifications are a steady tick's, opens and updates as soon, quiet resolves within 0.5 s."""

    def drive(
        c: Correlator, alerts: list[tuple[float, Alert]], until: float, adaptive: bool
    ) -> list[tuple[str, float]]:
        sent: list[tuple[str, float]] = []
        pending = sorted(alerts, key=lambda x: x[0])
        t, i = 0.0, 0
        while t <= until:
            while i < len(pending) and pending[i][0] <= t:
                sent.extend((n.kind, t) for n in c.ingest(pending[i][1], t))
                i += 1
            sent.extend((n.kind, t) for n in c.tick(t))
            c.take_changed()  # the service persists at least once a second
            step = 0.05 if c.busy() or not adaptive else 0.5
            nxt = pending[i][0] if i < len(pending) else until + 1
            t = round(min(t + step, max(nxt, t + 0.01)), 3)
        return sent

    def config() -> CorrelatorConfig:
        return CorrelatorConfig(quiet_s=10.0, weak_wait_s=2.0, min_update_interval_s=5.0)

    jobs = [job(f"j{i}", ("c-use2-a", i % 6)) for i in range(10)] + [job("a", ("c-weu-a", 0))]
    alerts = [
        (0.3, alert(1, cluster="c-use2-a", severity="info", dedup_key="a")),
        (1.2, alert(2, cluster="c-use2-a", severity="warning", dedup_key="b")),
        (2.0, alert(3, cluster="c-use2-a", severity="critical", dedup_key="c")),
        (4.1, alert(4, job_id="a", momentary=True)),
    ]
    steady = drive(Correlator(placements(jobs), config()), alerts, 30.0, adaptive=False)
    slow = drive(Correlator(placements(jobs), config()), alerts, 30.0, adaptive=True)
    kinds = [k for k, _ in steady]
    assert kinds.count("opened") == 2 and "updated" in kinds and "resolved" in kinds
    assert [k for k, _ in slow] == kinds
    for (kind, at), (_, slow_at) in zip(steady, slow, strict=True):
        assert at <= slow_at <= at + (0.5 if kind == "resolved" else 0.06), (kind, at, slow_at)


def test_the_condition_tracker_is_busy_while_dead_letters_are_in_its_window_or_its_alert_fires() -> None:
    from loom.alerts.sources import ConditionTracker

    track = ConditionTracker(dlq_threshold=2, dlq_window_s=10.0)
    assert not track.busy()
    track.dead_letter(0.0)
    assert track.busy()  # below the threshold, but the window must be ticked empty
    assert track.tick(11.0) == [] and not track.busy()
    track.dead_letter(20.0)
    track.dead_letter(21.0)
    assert track.busy()
    assert [a.status for a in track.tick(40.0)] == ["resolved"]
    assert not track.busy()


def test_an_ended_jobs_own_alert_lists_its_tenant_and_a_raw_alerts_label_never_does() -> None:
    from loom.alerts.sources import from_job_requeued
    from loom_proto.jobs import JobRequeued

    # Placement requeued the job (its run lost) and no longer holds it when the alert is correlated.
    own = from_job_requeued(
        JobRequeued(job_id="gone", tenant="vision", attempt=2, cause="cluster_lost", at=0.0)  # type: ignore[arg-type]
    )
    assert own is not None
    c = Correlator(placements([]), CorrelatorConfig(quiet_s=10.0, weak_wait_s=2.0))
    c.ingest(own, 0.0, own=True)
    kinds = [n.kind for n in c.tick(3.0)]
    [inc] = c.incidents.values()
    change = inc.change("opened", "x")
    assert kinds == ["opened"] and change.tenants == ["vision"]
    assert [(j.job_id, j.tenant) for j in change.jobs] == [("gone", "vision")]

    # The same labels on a raw alert (anyone may send one) name no tenant: the job is listed alone;
    # a later alert of Loom's own about the job names it.
    c2 = Correlator(placements([]), CorrelatorConfig(quiet_s=10.0, weak_wait_s=2.0))
    c2.ingest(msgspec.structs.replace(own, source="alertmanager"), 0.0)
    c2.tick(3.0)
    [raw] = c2.incidents.values()
    claimed = raw.change("opened", "x")
    assert claimed.tenants == [] and [(j.job_id, j.tenant) for j in claimed.jobs] == [("gone", None)]
    c2.ingest(msgspec.structs.replace(own, alert_id="again", dedup_key="again"), 4.0, own=True)
    assert raw.change("updated", "x").tenants == ["vision"]


def test_services_silent_together_are_one_nats_incident_and_one_silent_service_is_its_own() -> None:
    # A 40 s NATS freeze opened one critical incident per service (12), none naming NATS; a
    # PostgreSQL outage, whose services answer "degraded: postgres unavailable", likewise.
    from loom.alerts.sources import HealthWatch

    services = ["placement", "metrics", "migration", "network-perception", "alert-correlator"]
    watch = HealthWatch(misses=1, startup_grace_s=0.0)
    silent = [a for name in services for a in watch.missed(name, 0.0, 2.0)]
    c = Correlator(placements([job("a", ("c-use2-a", 0))]))
    run(c, [(0.1 * i, a) for i, a in enumerate(silent)], 40.0)
    [inc] = c.incidents.values()
    assert inc.root == ("server", "nats") and inc.severity == "critical"

    watch = HealthWatch(misses=1, startup_grace_s=0.0)
    degraded = [a for name in services for a in watch.answered(name, "degraded: postgres unavailable", 0.0)]
    c = Correlator(placements([job("a", ("c-use2-a", 0))]))
    run(c, [(0.1 * i, a) for i, a in enumerate(degraded)], 40.0)
    [inc] = c.incidents.values()
    assert inc.root == ("server", "postgres")

    # One service dying alone is that service, not NATS (the more specific root of equals).
    c = Correlator(placements([job("a", ("c-use2-a", 0))]))
    [alone] = HealthWatch(misses=1, startup_grace_s=0.0).missed("migration", 0.0, 2.0)
    run(c, [(0.0, alone)], 40.0)
    [inc] = c.incidents.values()
    assert inc.root == ("service", "migration")


def test_a_restored_incident_holds_its_firing_alerts_and_resolves_when_they_recover() -> None:
    """A region incident of two link alerts, persisted and restored: the recovery of one keeps it
    open, of both resolves it (before, a restored incident knew none of its alerts and waited
    ``quiet_s`` whatever the links did)."""
    from loom.alerts import Incident

    p = placements([])
    first = Correlator(p)
    links = [alert(n, link=(src, SEA), dedup_key=f"l-{src}") for n, src in ((1, USE), (2, WEU))]
    run(first, [(0.0, a) for a in links], 1.0)
    [inc] = first.incidents.values()
    assert inc.root == ("region", SEA) and inc.held().firing == [
        ("l-aws-us-east-2", False),
        ("l-azure-westeurope", False),
    ]
    assert inc.held().last_momentary_at is None

    again = Correlator(p)
    again.restore(Incident.from_change(inc.change("updated", "persisted"), inc.held()))
    resolved = [alert(3, link=(USE, SEA), dedup_key="l-aws-us-east-2", status="resolved")]
    assert again.ingest(resolved[0], 20.0) == [] and again.incidents[inc.incident_id].is_open
    [note] = again.ingest(alert(4, link=(WEU, SEA), dedup_key="l-azure-westeurope", status="resolved"), 21.0)
    assert note.kind == "resolved" and note.incident.incident_id == inc.incident_id

    # A restored alert whose recovery never comes (a stream's retention passed while the
    # correlator was down) would hold it for ever: held only by alerts not heard since the
    # restart, the quiet period resolves it, as before they were kept ...
    quiet = CorrelatorConfig().quiet_s
    stuck = Correlator(p)
    stuck.restore(Incident.from_change(inc.change("updated", "persisted"), inc.held()))
    assert stuck.tick(inc.updated_at + quiet - 1.0) == []
    [lapsed] = stuck.tick(inc.updated_at + quiet)
    assert lapsed.kind == "resolved" and "since the correlator restarted" in lapsed.incident.reason
    # ... unless one of them is heard firing again (a re-told state, a repeated Alertmanager alert).
    heard = Correlator(p)
    heard.restore(Incident.from_change(inc.change("updated", "persisted"), inc.held()))
    heard.ingest(alert(9, link=(USE, SEA), dedup_key="l-aws-us-east-2"), inc.updated_at + 5.0)
    assert heard.tick(inc.updated_at + quiet + 10.0) == []
    # A record an older version wrote (nothing held): the quiet period resolves it, as before.
    old = Correlator(p)
    old.restore(Incident.from_change(inc.change("updated", "persisted")))
    assert old.tick(inc.updated_at + 1.0) == []
    [quiet] = old.tick(inc.updated_at + CorrelatorConfig().quiet_s)
    assert quiet.kind == "resolved"


def test_the_sources_resolve_what_was_firing_before_a_restart() -> None:
    from loom.alerts.sources import ConditionTracker, HealthWatch, health_key
    from loom_proto.view import NodeView, ViewDelta

    track = ConditionTracker()
    track.restore(["loom-stale-c1", "loom-node-n1", "loom-dead-letters", "something-else"], 0.0)
    node = NodeView(node="n1", zone="z", healthy=True, updated_at=1.0)
    fresh = ViewDelta(region="r", cluster="c1", version=9, nodes=[node], stale=False, at=9.0)
    assert [(a.dedup_key, a.status) for a in track.view_delta(fresh)] == [
        ("loom-stale-c1", "resolved"),
        ("loom-node-n1", "resolved"),
    ]
    # The dead-letter window restarts empty: the backlog may not be delivered yet, so a whole
    # window passes before the restored alert resolves (it resolved at the first tick and flapped).
    assert track.tick(10.0) == []
    assert [(a.dedup_key, a.status) for a in track.tick(60.0)] == [("loom-dead-letters", "resolved")]

    watch = HealthWatch()
    watch.restore([health_key("placement"), health_key("agent-c1")], ["placement", "metrics", "agent-c1"])
    assert watch.answered("metrics", "ok", 1.0) == []  # was not firing
    [ok] = watch.answered("placement", "ok", 1.0)
    assert ok.status == "resolved" and ok.dedup_key == health_key("placement")
    assert watch.missed("agent-c1", 1.0, 2.0) == []  # still missing after the restart: one miss is no news


def test_placements_cluster_health_is_a_lease_it_renews_by_telling_it_again() -> None:
    from loom.alerts.sources import ClusterHealthLeases
    from loom_proto.clusters import ClusterHealthChanged

    leases = ClusterHealthLeases(lease_s=90.0)

    def told(state: str, at: float) -> list[Alert]:
        return leases.notice(ClusterHealthChanged(cluster="c1", state=state, region="r", at=at), at)  # type: ignore[arg-type]

    assert [a.status for a in told("suspect", 0.0)] == ["firing"]
    assert told("suspect", 30.0) == []  # told again: renewed, no new alert
    assert [a.severity for a in told("failed", 40.0)] == ["critical"]  # a change is an alert
    assert leases.tick(129.0) == []
    [lapsed] = leases.tick(130.0)
    assert lapsed.status == "resolved" and lapsed.dedup_key == "loom-health-c1"
    assert "not reported it unhealthy for 90 s" in lapsed.summary
    assert leases.tick(400.0) == []
    assert [a.status for a in told("healthy", 401.0)] == ["resolved"]  # harmless when nothing fires

    # Placement itself silent (its health answers missed): its silence lapses nothing, and the
    # lease restarts when it answers again.
    told("failed", 450.0)
    assert leases.tick(600.0, teller_silent=True) == []
    assert leases.tick(689.0) == []
    assert [a.status for a in leases.tick(690.0)] == ["resolved"]
    leases.restore(["loom-health-c2", "loom-stale-c3"], 500.0)
    assert leases.held == {"c2": ("restored", 500.0)}
    assert [a.cluster for a in leases.tick(590.0)] == ["c2"]


def test_a_regions_links_degrading_seconds_apart_make_one_region_incident() -> None:
    # Two links of one region alerting together point at the region (2 of its 2 links here);
    # seconds apart, each opened its own link incident (a region cut off live: 5 link incidents).
    # The earlier link's open incident is now evidence: the region takes it over.
    c = Correlator(placements([]))
    kinds = run(
        c,
        [
            (0.0, alert(1, link=(USE, SEA), dedup_key="l-1")),
            (5.0, alert(2, link=(WEU, SEA), dedup_key="l-2")),
        ],
        40.0,
    )
    [inc] = [i for i in c.incidents.values() if i.is_open]
    assert inc.root == ("region", SEA) and inc.active == {"l-1", "l-2"}
    assert kinds == ["opened", "updated"]
    # Together, the same incident at once (as before).
    together = Correlator(placements([]))
    run(together, [(0.0, alert(1, link=(USE, SEA))), (0.1, alert(2, link=(WEU, SEA)))], 5.0)
    assert [i.root for i in together.incidents.values()] == [("region", SEA)]
    # Two link incidents (far apart), both resolved; half an hour later the region is cut off,
    # link by link: the first link's incident re-opens (a relapse) and, re-opened now, is
    # evidence for the second (live, 5 links re-opened 5 link incidents).
    again = Correlator(placements([]))
    for t, n, src in ((0.0, 1, USE), (100.0, 2, WEU)):
        again.ingest(alert(n, link=(src, SEA), dedup_key=f"l-{n}"), t)
        again.tick(t + 0.6)
        again.ingest(alert(n + 10, link=(src, SEA), dedup_key=f"l-{n}", status="resolved"), t + 10.0)
    assert sorted(i.root[0] for i in again.incidents.values()) == ["link", "link"]
    for t, n, src in ((1800.0, 3, USE), (1805.0, 4, WEU)):
        again.ingest(alert(n, link=(src, SEA), dedup_key=f"l-{n}"), t)
        again.tick(t + 0.6)
    [relapsed] = [i for i in again.incidents.values() if i.is_open]
    assert relapsed.root == ("region", SEA) and relapsed.reopened == 1
    # A node of the region alerting before its links fail keeps its own incident: link evidence
    # takes over link incidents only (it was renamed "region" and held open by the node's alert).
    mixed = Correlator(placements([]))
    node = NODES["c-sea1-a"][0]
    mixed.ingest(alert(1, node=node, dedup_key="n"), 0.0)
    mixed.tick(0.6)
    for t, n, src in ((20.0, 2, USE), (25.0, 3, WEU)):
        mixed.ingest(alert(n, link=(src, SEA), dedup_key=f"l-{n}"), t)
        mixed.tick(t + 0.6)
    assert sorted(i.root for i in mixed.incidents.values() if i.is_open) == [("node", node), ("region", SEA)]
    # A link alone stays a link incident, and a link far apart in time is its own.
    apart = Correlator(placements([]))
    run(apart, [(0.0, alert(1, link=(USE, SEA))), (100.0, alert(2, link=(WEU, SEA)))], 110.0)
    assert sorted(i.root[0] for i in apart.incidents.values()) == ["link", "link"]

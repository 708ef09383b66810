"""The permission table and the credential files of loom.security (issue 18), without a server."""

import json
import stat
from pathlib import Path

import nkeys
import pytest

from loom.security import (
    CredentialStore,
    Identity,
    foreign_report,
    identity_for_process,
    may_manage_streams,
    new_seed,
    parse,
    permissions,
    read,
    tenant_identity,
    users_config,
)
from loom_proto import subjects

pytestmark = pytest.mark.security


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def may_publish(identity: Identity, subject: str) -> bool:
    perms = permissions(identity)
    allowed = any(_matches(p, subject) for p in perms.publish)
    return allowed and not any(_matches(p, subject) for p in perms.publish_deny)


def may_subscribe(identity: Identity, subject: str) -> bool:
    return any(_matches(p, subject) for p in permissions(identity).subscribe)


def test_matcher_follows_nats_wildcards() -> None:
    assert _matches("loom.jobs.*.acme", "loom.jobs.started.acme")
    assert not _matches("loom.jobs.*.acme", "loom.jobs.started.acme.x")
    assert _matches("loom.>", "loom.a.b")
    assert not _matches("loom.>", "loom")


def test_tenant_submits_and_reads_only_its_own() -> None:
    acme = tenant_identity("acme")
    assert may_publish(acme, subjects.job_submitted("acme"))
    assert may_publish(acme, subjects.jobs_query("acme"))
    assert may_publish(acme, subjects.job_event("cancelled", "acme"))  # its own jobs (placement checks)
    for forged in (
        subjects.job_event("cancelled", "globex"),
        subjects.job_submitted("globex"),
        subjects.jobs_query("globex"),
        subjects.JOBS_QUERY,  # every tenant's jobs
        subjects.job_event("completed", "acme"),
        subjects.cluster_heartbeat("c1"),
        subjects.cluster_command("c1", "stop"),
        subjects.job_placed("c1"),
        "$JS.API.STREAM.DELETE.JOBS",
    ):
        assert not may_publish(acme, forged), forged
    for kind in subjects.JOB_EVENT_KINDS:
        if kind != "placed":
            assert may_subscribe(acme, subjects.job_event(kind, "acme"))
            assert not may_subscribe(acme, subjects.job_event(kind, "globex"))
    for kind in subjects.REPORT_KINDS:  # the agents' reports of its jobs, from any cluster
        assert may_subscribe(acme, subjects.job_report(kind, "acme", "c1"))
        assert may_subscribe(acme, subjects.job_reports(kind, "acme"))
        assert not may_subscribe(acme, subjects.job_report(kind, "globex", "c1"))
        assert not may_publish(acme, subjects.job_report(kind, "acme", "c1"))
    assert not may_subscribe(acme, subjects.JOBS_REPORTS_ALL)
    assert may_subscribe(acme, subjects.job_placed("acme"))  # where its job went
    assert not may_subscribe(acme, subjects.job_placed("globex"))
    assert not may_subscribe(acme, subjects.JOBS_PLACED_ALL)
    assert may_subscribe(acme, "_INBOX.tenant-acme.abc")
    assert not may_subscribe(acme, "_INBOX.tenant-globex.abc")
    assert not may_subscribe(acme, "_INBOX.>")


def test_agent_speaks_only_for_its_cluster() -> None:
    c1 = Identity("agent", "c1")
    for own in (
        subjects.cluster_heartbeat("c1"),
        subjects.cluster_profiles("c1"),
        subjects.cluster_status("c1"),
        subjects.job_report("completed", "acme", "c1"),
    ):
        assert may_publish(c1, own)
    for forged in (
        subjects.cluster_heartbeat("c2"),
        subjects.cluster_status("c2"),
        subjects.cluster_command("c1", "start"),
        subjects.cluster_command("c2", "stop"),
        subjects.job_submitted("acme"),
        subjects.job_placed("c1"),
        subjects.job_event("rejected", "acme"),
        subjects.job_event("completed", "acme"),  # a report without its cluster
        subjects.job_report("completed", "acme", "c2"),  # another cluster's report
        "$JS.API.CONSUMER.MSG.NEXT.CLUSTERS.agent-c2",
        "$JS.ACK.CLUSTERS.agent-c2.1.1.1.1.1",
        "$JS.API.STREAM.UPDATE.CLUSTERS",
    ):
        assert not may_publish(c1, forged), forged
    assert may_publish(c1, "$JS.API.CONSUMER.MSG.NEXT.CLUSTERS.agent-c1")
    assert may_subscribe(c1, subjects.net_endpoints("c1"))
    assert not may_subscribe(c1, subjects.net_endpoints("c2"))
    assert not may_subscribe(c1, subjects.cluster_commands("c2"))


def test_each_service_publishes_only_within_its_role() -> None:
    start = subjects.cluster_command("c1", "start")
    assert may_publish(Identity("placement"), start)
    assert may_publish(Identity("placement"), subjects.job_placed("c1"))
    for role in ("metrics", "console", "network-perception", "alert-correlator", "probe-collector"):
        service = Identity(role)  # type: ignore[arg-type]
        assert not may_publish(service, start), role
        assert not may_publish(service, subjects.job_submitted("acme")), role
        assert not may_publish(service, subjects.job_event("completed", "acme")), role
    assert may_publish(Identity("metrics"), subjects.view_delta("eu"))
    assert not may_publish(Identity("console"), subjects.view_delta("eu"))
    assert may_publish(Identity("network-perception"), subjects.link_state("a", "b"))
    assert not may_publish(Identity("probe-collector"), subjects.link_state("a", "b"))


def test_the_migration_service_may_announce_the_links_in_use_to_the_collectors() -> None:
    """``loom.net.use`` (links running jobs span: the collectors probe them harder) is published by
    the migration service; a secured stack refused it (nats-server logged a Publish Violation every
    5 s in ``loom bench failover``), so links in use were probed like idle ones."""
    assert may_publish(Identity("migration"), subjects.NET_USE)
    assert may_subscribe(Identity("probe-collector", "eu"), subjects.NET_USE)
    for role in ("metrics", "console", "alert-correlator", "probe-collector"):
        assert not may_publish(Identity(role), subjects.NET_USE), role  # type: ignore[arg-type]
    assert not may_publish(Identity("tenant", "acme"), subjects.NET_USE)
    assert not may_publish(Identity("agent", "c1"), subjects.NET_USE)


def test_permissions_follow_the_subject_map() -> None:
    """Every kind and command of the subject map is covered by some role, none by a tenant's publish."""
    for kind in subjects.CLUSTER_COMMAND_KINDS:
        assert may_publish(Identity("placement"), subjects.cluster_command("x", kind))
    agent = Identity("agent", "c")
    assert not any(
        may_publish(agent, subjects.job_placed("c") if k == "placed" else subjects.job_event(k, "acme"))
        for k in subjects.JOB_EVENT_KINDS
    ), "an agent reports only on subjects naming its cluster"
    agent_kinds = [
        k for k in subjects.REPORT_KINDS if may_publish(agent, subjects.job_report(k, "acme", "c"))
    ]
    assert agent_kinds == list(subjects.REPORT_KINDS)
    assert not any(may_publish(agent, subjects.job_report(k, "acme", "c2")) for k in subjects.REPORT_KINDS)


def test_a_report_is_recorded_only_from_the_cluster_of_its_run() -> None:
    assert foreign_report(None, "c1") is None, "a service's event (no cluster token) is not checked here"
    assert foreign_report("c1", "c1") is None
    assert foreign_report("c1", "c1", {"c1", "c2"}) is None  # a multi-cluster run's member part
    assert "c2" in (foreign_report("c1", "c2") or ""), "the payload names another cluster"
    assert foreign_report("c1", None) is not None
    assert "no part" in (foreign_report("c1", "c1", {"c2"}) or ""), "c1's agent reports c2's run"
    assert foreign_report("c1", "c1", set()) is not None, "no run of that attempt at all"
    assert subjects.report_cluster(subjects.job_report("completed", "acme", "c1")) == "c1"
    assert subjects.report_cluster(subjects.job_event("completed", "acme")) is None
    assert subjects.report_cluster(subjects.jobs_query("acme")) is None


def test_process_names_map_to_identities() -> None:
    assert identity_for_process("agent-c-weu-a") == Identity("agent", "c-weu-a")
    assert identity_for_process("placement-eu-standby") == Identity("placement")
    assert identity_for_process("probe-aws-us-east-2") == Identity("probe-collector", "aws-us-east-2")
    assert identity_for_process("network-perception") == Identity("network-perception")
    with pytest.raises(ValueError, match="no identity"):
        identity_for_process("mystery")
    assert not may_manage_streams("agent-c1")
    assert not may_manage_streams("tenant-acme")
    assert may_manage_streams("placement")


def test_credential_files_are_secret_and_round_trip(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path)
    acme = tenant_identity("acme")
    store.ensure_all([acme, Identity("admin")])
    path = store.path(acme)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.auth_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.dir.stat().st_mode) == 0o700
    credential = read(path)
    assert credential.identity == "tenant-acme"
    assert nkeys.from_seed(bytearray(credential.seed.encode())).public_key.decode() == credential.public_key
    auth = store.auth_path.read_text()
    assert credential.public_key in auth and credential.seed not in auth  # only public keys
    first = path.read_text()
    store.ensure(acme)  # kept
    assert path.read_text() == first
    store.rotate()
    assert read(path).seed != credential.seed
    assert read(path).public_key in store.auth_path.read_text()
    assert credential.public_key not in store.auth_path.read_text()


def test_seeds_are_fresh_user_seeds() -> None:
    seeds = {new_seed() for _ in range(20)}
    assert len(seeds) == 20
    assert all(s.startswith("SU") for s in seeds)
    with pytest.raises(ValueError, match="identity"):
        parse("seed: SUAAA\n")


def test_users_block_is_what_nats_server_reads() -> None:
    block = users_config([(tenant_identity("acme"), "UABC")])
    users = json.loads(block[block.index("[") : block.rindex("]") + 1])
    assert users[0]["nkey"] == "UABC"
    assert users[0]["permissions"]["publish"]["allow"][0] == subjects.job_submitted("acme")
    assert users[0]["permissions"]["allow_responses"] is True


def test_the_attempts_bucket_is_writable_by_services_and_by_an_agent_for_its_own_consumer_only() -> None:
    from loom.bus.attempts import ATTEMPTS_BUCKET
    from loom.security.permissions import ATTEMPTS_BUCKET as NAMED

    assert NAMED == ATTEMPTS_BUCKET
    service = permissions(Identity("metrics"))
    assert f"$KV.{ATTEMPTS_BUCKET}.>" in service.publish
    agent = permissions(Identity("agent", "c1"))
    assert f"$KV.{ATTEMPTS_BUCKET}.CLUSTERS.agent-c1.>" in agent.publish
    assert not any(p.startswith(f"$KV.{ATTEMPTS_BUCKET}.") and "agent-c1" not in p for p in agent.publish)


def test_services_call_only_the_jetstream_api_of_their_streams() -> None:
    for role in ("placement", "metrics", "network-perception", "migration", "alert-correlator", "console"):
        service = Identity(role)  # type: ignore[arg-type]
        for stream in subjects.STREAMS:  # every service makes sure the streams exist
            assert may_publish(service, f"$JS.API.STREAM.INFO.{stream.name}"), role
            assert may_publish(service, f"$JS.API.STREAM.UPDATE.{stream.name}"), role
            for forbidden in ("DELETE", "PURGE", "MSG.DELETE"):
                assert not may_publish(service, f"$JS.API.STREAM.{forbidden}.{stream.name}"), role
        assert not may_publish(service, "$JS.API.STREAM.CREATE.ELSEWHERE"), role
        assert not may_publish(service, "$JS.API.ACCOUNT.PURGE.x"), role
    metrics = Identity("metrics")
    assert may_publish(
        metrics, "$JS.API.CONSUMER.CREATE.CLUSTERS.metrics-heartbeats.loom.clusters.*.heartbeat"
    )
    assert may_publish(metrics, "$JS.API.CONSUMER.MSG.NEXT.JOBS.metrics-metering")
    assert may_publish(metrics, "$JS.ACK.CLUSTERS.metrics-heartbeats.1.2.3.4.5")
    assert not may_publish(metrics, "$JS.API.CONSUMER.CREATE.NET.x")  # it reads no NET stream
    assert not may_publish(metrics, "$JS.ACK.NET.network-perception-probes.1.2.3.4.5")
    assert not may_publish(metrics, "$JS.API.CONSUMER.DELETE.CLUSTERS.agent-c1")
    console = Identity("console")
    assert not any(
        may_publish(console, f"$JS.API.CONSUMER.CREATE.{stream.name}.x") for stream in subjects.STREAMS
    )
    placement = Identity("placement")
    assert may_publish(placement, "$JS.API.CONSUMER.CREATE.JOBS.placement-lifecycle-eu.loom.jobs.started.>")
    assert may_publish(placement, "$JS.API.STREAM.INFO.KV_loom_leases")
    assert may_publish(placement, "$JS.API.DIRECT.GET.KV_loom_leases.$KV.loom_leases.global")
    assert not may_publish(metrics, "$JS.API.STREAM.INFO.KV_loom_leases")
    assert not may_publish(placement, "$JS.API.STREAM.DELETE.KV_loom_leases")
    assert may_subscribe(placement, "$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.JOBS.placement-submitted")
    assert not may_subscribe(console, "$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.JOBS.placement-submitted")


def test_loom_tenant_add_warns_when_the_stacks_tenants_file_will_refuse_the_tenant(tmp_path: Path) -> None:
    # Before: credentials were issued without a word, and every job of the tenant was then
    # rejected as unknown_tenant by a stack started with a closed tenants file.
    import json

    from loom.cli.credentials import _closed_to

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("open: false\ntenants:\n  acme: {gpus: 8}\n")
    (tmp_path / "stack.json").write_text(json.dumps({"status": "ready", "tenants_file": str(tenants)}))
    refusal = _closed_to(tmp_path, "beta")
    assert refusal is not None and "does not list beta" in refusal and "unknown_tenant" in refusal
    assert _closed_to(tmp_path, "acme") is None
    tenants.write_text("open: true\ntenants:\n  acme: {gpus: 8}\n")
    assert _closed_to(tmp_path, "beta") is None
    (tmp_path / "stack.json").write_text(json.dumps({"status": "ready"}))  # no tenants file: all admitted
    assert _closed_to(tmp_path, "beta") is None


def test_a_cancellation_is_taken_at_the_servers_time_and_refused_for_a_nul_or_a_foreign_tenant() -> None:
    from loom.security import received_cancellation, tenant_claim_id
    from loom_proto.jobs import JobCancelled

    event = JobCancelled(job_id="j", tenant="acme", reason="done", at=1.0)
    taken, why = received_cancellation("loom.jobs.cancelled.acme", event, 50.0)
    assert (taken.at, why) == (50.0, None)
    _, why = received_cancellation("loom.jobs.cancelled.beta", event, 50.0)
    assert why is not None and "names tenant 'acme'" in why
    # A NUL decodes but no text column stores it: it failed the whole lifecycle batch's write.
    nul = JobCancelled(job_id="j", tenant="acme", reason="a\x00b", at=1.0)
    _, why = received_cancellation("loom.jobs.cancelled.acme", nul, 50.0)
    assert why is not None and "NUL" in why
    # A tenant's message ids are claimed within its tenant: another's same id is another claim.
    assert tenant_claim_id("loom.jobs.submitted.acme", "x") != tenant_claim_id(
        "loom.jobs.submitted.beta", "x"
    )
    assert tenant_claim_id("loom.jobs.cancelled.acme", "x") == tenant_claim_id(
        "loom.jobs.submitted.acme", "x"
    )


def test_an_agents_report_is_claimed_under_an_id_its_own_payload_makes() -> None:
    from loom.security import report_claim_id
    from loom_proto.jobs import JobCheckpointed, JobCompleted, JobFailed

    done = JobCompleted(job_id="mine", tenant="t", cluster="c2", attempt=2, at=1.0)
    on = "loom.jobs.completed.t.c2"
    assert report_claim_id(on, done, "mine:completed:2") == "mine:completed:2"
    # Another job's id (taken first, the other job's real report was dropped as its duplicate),
    # another attempt's, or none at all: the payload's own.
    for sent in ("victim:completed:1", "mine:completed:3", "mine:placed:2", None):
        assert report_claim_id(on, done, sent) == "mine:completed:2"
    failed = JobFailed(job_id="mine", tenant="t", cluster="c2", attempt=1, reason="x", at=1.0)
    on = "loom.jobs.failed.t.c2"
    for sent in ("mine:failed:1", "mine:failed:1:c2"):  # a lead's, a member part's
        assert report_claim_id(on, failed, sent) == sent
    assert report_claim_id(on, failed, "mine:failed:1:c9") == "mine:failed:1"
    point = JobCheckpointed(
        job_id="mine", tenant="t", cluster="c2", attempt=1, step=40, checkpoint_uri="s3://x", at=1.0
    )
    on = "loom.jobs.checkpointed.t.c2"
    assert report_claim_id(on, point, "mine:checkpointed:1:40") == "mine:checkpointed:1:40"
    assert report_claim_id(on, point, "mine:checkpointed:1:80") == "mine:checkpointed:1:40"

"""``loom bench nats-cluster``: SIGKILL one node of a 3-node JetStream cluster, per node role, and
time where the stall goes.

Three real ``nats-server`` nodes (:class:`loom.runtime.servers.NatsCluster`, what ``loom up
--nats-cluster 3`` runs), Loom's streams at R3, and Loom's own client pieces shaped like
placement's: a :class:`~loom.bus.Publisher` submitting on ``REQUESTS`` at a steady rate, a
callback-pull :class:`~loom.bus.ConsumerRunner` consuming them (placement's submissions consumer),
and a :class:`~loom.bus.LeaderLease` with placement's TTL. Each trial kills the node holding one
role and records a timeline from the kill:

* ``disconnect_s`` / ``reconnect_s``: a client on the dead node saw its connection go / come back;
* ``stream_leader_s`` / ``consumer_leader_s``: the ``LEADER_ELECTED`` advisory of REQUESTS / of the
  consumer arrived (else a survivor first answered ``$JS.API.STREAM.INFO`` / ``CONSUMER.INFO``
  with a live leader, polled every 50 ms);
* ``first_ack_s``: the first publish sent after the kill was acknowledged;
* ``first_consumed_s``: the first message published after the kill that reached the consumer;
* ``client_after_leaders_s``: what the client side adds: first ack minus the stream's election,
  first consumption minus the later of both elections (the rest of the stall is the server's Raft
  election timeout, a random 4-9 s after the last heartbeat in nats-server);
* ``publish_stall_s``: the longest gap between two acks; ``consume_stall_s``: the longest gap
  between two messages reaching the consumer (placement's stall: nothing placed meanwhile);
* ``lease_lost`` / ``lease_back_s``: whether the lease holder lost its lease, and when it held one
  again; ``lease_recreated``: times it kept the lease by re-creating the key after a leaderless
  spell of the bucket (``--lease-grace``, placement's 10 s; see :mod:`loom.bus.lease`, "Grace").

Roles: ``stream-leader`` (of REQUESTS), ``consumer-leader`` (of the durable consumer), ``lease-leader``
(of the ``loom_leases`` bucket's stream), ``meta-leader``
(the JetStream meta group) and ``follower`` (none of them, when some node holds none). A node often
holds several roles: each trial lists what its victim held. The victim is restarted on its port
and caught up before the next trial. It measures; it asserts nothing.

Secured as ``loom up`` secures a cluster (issue 18): the nodes include the users block of
:mod:`loom.security` and every client connects as the identity whose permissions it needs, none
as the operator except the observer: the publisher as the trial's tenant (it may publish only
``loom.jobs.submitted.<tenant>``), the consumer and the lease as placement.
"""

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery, Publisher, connect, ensure_streams
from loom.bus.lease import LEASE_BUCKET, LeaderLease
from loom.runtime.servers import NatsCluster, NatsServer
from loom.security import CredentialStore, Identity, admin_identity, tenant_identity
from loom_benchmarks.secured import nats_violations
from loom_proto import JobSubmitted, Work
from loom_proto import subjects as s

ROLES = ("stream-leader", "consumer-leader", "lease-leader", "meta-leader", "follower")
POLL_S = 0.05


def _meta_leader(node: NatsServer) -> str | None:
    try:
        with urllib.request.urlopen(f"{node.monitor_url}/jsz", timeout=1.0) as reply:
            leader = json.loads(reply.read()).get("meta_cluster", {}).get("leader")
    except OSError:
        return None
    return str(leader) if leader else None


async def _roles(cluster: NatsCluster, nc: Client, durable: str) -> dict[str, str | None]:
    js = nc.jetstream(timeout=2.0)
    stream = await js.stream_info("REQUESTS")
    consumer = await js.consumer_info("REQUESTS", durable)
    leases = await js.stream_info(f"KV_{LEASE_BUCKET}")
    meta = next((m for n in cluster.nodes if n.running and (m := _meta_leader(n))), None)
    return {
        "stream-leader": stream.cluster.leader if stream.cluster else None,
        "consumer-leader": consumer.cluster.leader if consumer.cluster else None,
        "lease-leader": leases.cluster.leader if leases.cluster else None,
        "meta-leader": meta,
    }


async def _leader_back(nc: Client, durable: str, victim: str, t0: float) -> dict[str, float | None]:
    """Seconds from the kill until a survivor names a live stream and consumer leader."""
    js = nc.jetstream(timeout=0.5)
    found: dict[str, float | None] = {"stream_leader_s": None, "consumer_leader_s": None}
    deadline = t0 + 30.0
    while time.monotonic() < deadline and None in found.values():
        for key, ask in (
            ("stream_leader_s", lambda: js.stream_info("REQUESTS")),
            ("consumer_leader_s", lambda: js.consumer_info("REQUESTS", durable)),
        ):
            if found[key] is not None:
                continue
            try:
                info = await ask()
            except Exception:  # no leader yet: no responders, 503 or a timeout
                continue
            leader = info.cluster.leader if info.cluster else None
            if leader and leader != victim:
                found[key] = round(time.monotonic() - t0, 3)
        await asyncio.sleep(POLL_S)
    return found


def _watch_connection(nc: Client, t0_box: list[float], out: dict[str, float | None]) -> asyncio.Task[None]:
    async def watch() -> None:
        reconnects = nc.stats["reconnects"]
        while True:
            await asyncio.sleep(0.005)
            if not t0_box:
                reconnects = nc.stats["reconnects"]
                continue
            t0 = t0_box[0]
            if out["disconnect_s"] is None and not nc.is_connected:
                out["disconnect_s"] = round(time.monotonic() - t0, 3)
            if nc.stats["reconnects"] != reconnects and out["reconnect_s"] is None:
                out["reconnect_s"] = round(time.monotonic() - t0, 3)
                if out["disconnect_s"] is None:
                    out["disconnect_s"] = out["reconnect_s"]
                return

    return asyncio.create_task(watch())


def _max_gap(times: list[float], t0: float) -> float:
    around = [t for t in times if t >= t0 - 1.0]
    gaps = [b - a for a, b in itertools.pairwise(around)]
    return round(max(gaps, default=0.0), 3)


# PLR0912, PLR0915: one trial's script, kill to restore, kept in one piece to read as a timeline.
async def _trial(  # noqa: PLR0912, PLR0915
    cluster: NatsCluster,
    role: str,
    rate: float,
    ttl_s: float,
    grace_s: float,
    *,
    store: CredentialStore,
    tenant: str,
) -> dict[str, Any] | None:
    subject = s.job_submitted(tenant)
    durable = f"bench-{tenant}"
    admin, placement = store.path(admin_identity()), store.path(PLACEMENT)
    observer = await connect(cluster.url, "bench-observer", creds=admin)
    pub_nc = await connect(cluster.url, "bench-publisher", creds=store.path(tenant_identity(tenant)))
    con_nc = await connect(cluster.url, "bench-consumer", creds=placement)
    lease_nc = await connect(cluster.url, "bench-lease", creds=placement)
    received: dict[str, float] = {}
    received_times: list[float] = []

    async def handle(delivery: Delivery[JobSubmitted]) -> None:
        now = time.monotonic()
        assert delivery.msg_id is not None
        if delivery.msg_id not in received:
            received[delivery.msg_id] = now
            received_times.append(now)

    spec = ConsumerSpec(stream="REQUESTS", durable=durable, filter_subjects=[subject], ack_wait_s=5.0)
    runner: ConsumerRunner[JobSubmitted] = ConsumerRunner(
        con_nc, spec, JobSubmitted, handler=handle, callback_pull=True, linger_s=0.0
    )
    await runner.start()
    lease = LeaderLease(
        lease_nc.jetstream(),
        f"bench{tenant[2:]}",
        "bench",
        ttl_s=ttl_s,
        renew_s=ttl_s / 4,
        poll_s=min(0.2, ttl_s / 10),
        grace_s=grace_s,
    )
    await lease.acquire()
    publisher = Publisher(pub_nc)
    sent_at: dict[str, float] = {}
    acked_times: list[float] = []
    stop = asyncio.Event()

    async def publish_loop() -> None:
        n = 0
        while not stop.is_set():
            msg_id = f"{tenant}-{n}"
            sent_at[msg_id] = time.monotonic()
            message = JobSubmitted(job_id=f"job-{n}", tenant=tenant, name="", work=Work(steps=1))
            await publisher.publish(subject, message, msg_id=msg_id)
            acked_times.append(time.monotonic())
            n += 1
            await asyncio.sleep(1.0 / rate)

    lease_box: dict[str, Any] = {"lost_s": None, "back_s": None}
    t0_box: list[float] = []

    async def lease_loop() -> None:
        await lease.lost.wait()
        lease_box["lost_s"] = round(time.monotonic() - t0_box[0], 3) if t0_box else -1.0
        await lease.acquire()
        lease_box["back_s"] = round(time.monotonic() - t0_box[0], 3) if t0_box else -1.0

    tasks = [asyncio.create_task(publish_loop()), asyncio.create_task(lease_loop())]
    try:
        await asyncio.sleep(1.5)  # steady flow first
        roles = await _roles(cluster, observer, durable)
        by_name = {n.server_name: n for n in cluster.nodes}
        if role == "follower":
            held = set(roles.values())
            victim = next((n for n in cluster.nodes if n.server_name not in held), None)
            if victim is None:
                return None
        else:
            name = roles[role]
            if name is None:
                return None
            victim = by_name[name]
        # Observe from a survivor.
        if observer.connected_url is not None and observer.connected_url.port == victim.port:
            await observer.close()
            observer = await connect(
                ",".join(n.url for n in cluster.nodes if n is not victim), "bench-observer", creds=admin
            )
        conns = {"publisher": pub_nc, "consumer": con_nc, "lease": lease_nc}
        on_victim = [
            k for k, c in conns.items() if c.connected_url is not None and c.connected_url.port == victim.port
        ]
        watch_out: dict[str, dict[str, float | None]] = {
            k: {"disconnect_s": None, "reconnect_s": None} for k in on_victim
        }
        watchers = [_watch_connection(conns[k], t0_box, watch_out[k]) for k in on_victim]
        elected: dict[str, float] = {}

        async def on_elected(msg: Any) -> None:
            kind = "stream" if ".STREAM." in msg.subject else "consumer"
            elected.setdefault(kind, time.monotonic())

        advisories = [
            await observer.subscribe("$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.REQUESTS", cb=on_elected),
            await observer.subscribe(
                f"$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.REQUESTS.{durable}", cb=on_elected
            ),
        ]
        assert victim.pid is not None
        t0 = time.monotonic()
        t0_box.append(t0)
        os.kill(victim.pid, signal.SIGKILL)
        leaders = await _leader_back(observer, durable, victim.server_name or "", t0)
        await asyncio.sleep(max(0.0, t0 + 10.0 - time.monotonic()))  # past the longest election
        stop.set()
        await asyncio.wait_for(tasks[0], 30.0)
        deadline = time.monotonic() + 30.0
        while set(sent_at) - set(received) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        for w in watchers:
            w.cancel()
        for sub in advisories:
            await sub.unsubscribe()
        if "stream" in elected:
            leaders["stream_leader_s"] = round(elected["stream"] - t0, 3)
        if "consumer" in elected:
            leaders["consumer_leader_s"] = round(elected["consumer"] - t0, 3)
        moved = [v for k in ("stream_leader_s", "consumer_leader_s") if (v := leaders[k]) is not None]
        serving_s = max(moved, default=0.0)
        after = [a for m, a in zip(sent_at, acked_times, strict=False) if sent_at[m] > t0]
        after_sent = [m for m, t in sent_at.items() if t > t0 and m in received]
        lost = sorted(set(sent_at) - set(received))
        return {
            "role": role,
            "victim": victim.server_name,
            "victim_roles": sorted(k for k, v in roles.items() if v == victim.server_name),
            "clients_on_victim": on_victim,
            "connections": watch_out,
            **leaders,
            "first_ack_s": round(after[0] - t0, 3) if after else None,
            "first_consumed_s": round(min(received[m] for m in after_sent) - t0, 3) if after_sent else None,
            "publish_stall_s": _max_gap(acked_times, t0),
            "consume_stall_s": _max_gap(sorted(received_times), t0),
            "client_after_leaders_s": {
                "publish": round(after[0] - t0 - (leaders["stream_leader_s"] or 0.0), 3) if after else None,
                "consume": round(min(received[m] for m in after_sent) - t0 - serving_s, 3)
                if after_sent
                else None,
            },
            "lease_lost": lease_box["lost_s"] is not None,
            "lease_lost_s": lease_box["lost_s"],
            "lease_back_s": lease_box["back_s"],
            "lease_recreated": lease.recreated,
            "published": len(acked_times),
            "pull_requests": getattr(runner, "pulls", None),  # None: a runner that does not count them
            "unconsumed": len(lost),
        }
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.stop()
        await lease.release()
        for c in (pub_nc, con_nc, lease_nc):
            await c.close()
        await _restore(cluster, observer)
        await observer.close()


async def _restore(cluster: NatsCluster, nc: Client) -> None:
    """Restart a killed node on its port and wait until every REQUESTS replica is current again."""
    for node in cluster.nodes:
        if node.pid is not None and node.poll_exit() is None:
            continue
        for _ in range(100):
            if node.poll_exit() is not None:
                break
            await asyncio.sleep(0.1)
        node.clean_after_exit()
        await asyncio.to_thread(node.start)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        try:
            info = await nc.jetstream(timeout=1.0).stream_info("REQUESTS")
            peers = info.cluster.replicas if info.cluster else None
            if (
                info.cluster
                and info.cluster.leader
                and peers
                and len(peers) == 2
                and all(p.current and not p.offline for p in peers)
            ):
                return
        except Exception:  # a leader is still being elected
            pass
        await asyncio.sleep(0.2)


def _summary(trials: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    values = [t[key] for t in trials if t.get(key) is not None]
    if not values:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(values), 3), "max": round(max(values), 3)}


PLACEMENT = Identity("placement")


async def _run(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    os.environ["LOOM_STREAM_REPLICAS"] = "3"
    data = Path(tempfile.mkdtemp(prefix="loom-bench-cluster-"))
    trials: list[dict[str, Any]] = []
    skipped: list[str] = []
    roles = [r for r in args.roles.split(",") if r]
    # One tenant per trial (its own subject and durable), each with its credentials, issued
    # before the nodes start: the same users block `loom up --nats-cluster 3` includes.
    tenants = [f"t-{uuid.uuid4().hex[:8]}" for _ in range(args.trials * len(roles))]
    store = CredentialStore(data)
    store.ensure_all([admin_identity(), PLACEMENT, *(tenant_identity(t) for t in tenants)])
    with NatsCluster(data / "nats", 3, authorization=store.auth_path) as cluster:
        nc = await connect(cluster.url, "bench-setup", creds=store.path(admin_identity()))
        await ensure_streams(nc.jetstream())
        await nc.close()
        for trial in range(args.trials):
            for role in roles:
                progress(f"trial {trial + 1}/{args.trials}: killing the {role}")
                result = await _trial(
                    cluster,
                    role,
                    args.rate,
                    args.lease_ttl,
                    args.lease_grace,
                    store=store,
                    tenant=tenants.pop(),
                )
                if result is None:
                    skipped.append(role)
                else:
                    trials.append(result)
                    progress(json.dumps(result))
        # What the servers refused: a client of the bench lacking a permission it needs.
        violations = nats_violations([node.log_path for node in cluster.nodes])
    keys = (
        "stream_leader_s",
        "consumer_leader_s",
        "first_ack_s",
        "first_consumed_s",
        "publish_stall_s",
        "consume_stall_s",
        "lease_back_s",
    )
    by_role = {
        role: {
            "trials": len(rows),
            **{key: _summary(rows, key) for key in keys},
            "leases_lost": sum(1 for r in rows if r["lease_lost"]),
            "unconsumed": sum(r["unconsumed"] for r in rows),
        }
        for role in ROLES
        if (rows := [t for t in trials if t["role"] == role])
    }
    return {
        "bench": "nats-cluster",
        "secured": True,  # NKEY users with per-role permissions (loom.security), as `loom up`
        "permission_violations": violations,
        "rate": args.rate,
        "lease_ttl_s": args.lease_ttl,
        "lease_grace_s": args.lease_grace,
        "by_role": by_role,
        "all": {key: _summary(trials, key) for key in keys},
        "skipped": skipped,
        "trials": trials,
    }


def main(args: argparse.Namespace) -> int:
    """``loom bench nats-cluster``: JSON on stdout; progress on stderr unless ``--json``."""

    def progress(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr, flush=True)

    result = asyncio.run(_run(args, progress))
    print(json.dumps(result, indent=2))
    return 0

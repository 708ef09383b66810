"""``loom bench alerts``: the alert correlator on a storm, on injected faults, and on the real stack.

* **storm** (in process, the pure core on a simulated clock): cluster ``c-use2-a`` of the default
  topology fails with 500 jobs on it (gangs and pipelines with parts elsewhere among them) and
  1,000 jobs on other clusters. The storm: per-job alerts (missing heartbeats repeated, failed,
  restarted), node-down alerts from every node, the cluster's own alerts from t = 15 s (after the
  heartbeat TTL), in random order over two minutes, 5 % of them with a source clock an hour off.
  Measured: incidents, jobs attached, notifications, alerts per second, peak memory of the core.
* **faults** (in process): 200 faults with known roots (link, cluster, node, a third each), one
  after another on the default topology with 2,000 placed jobs. Each makes what such a fault makes:
  the resource's own alert (60 % of the time), some node alerts (cluster faults), alerts of a
  random 30-100 % of the jobs standing on it, plus 0-2 unrelated job failures as noise. An incident
  holding the fault's alerts is right when its root is the fault's resource. Precision: right
  incidents / incidents holding fault alerts; recall: faults with a right incident / faults.
* **latency** (real stack: ``loom up`` with the small topology): probe alerts, each naming a node
  of its own so each opens an incident, half published on ``loom.alerts.raw.bench`` and half posted
  to the Alertmanager webhook, under a background of repeats attached to an open incident; latency
  is from the publish (or POST) to ``loom.incidents.opened`` arriving. It includes the grouping
  wait (``group_wait_s``, 0.5 s by default). ``--skip-stack`` leaves this part out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from loom.alerts import Correlator, Inventory, JobPlacement, Part, Placements, link_name
from loom.alerts.resources import Resource
from loom.model.topology import Topology, load_topology
from loom.runtime.servers import find_free_port
from loom.security.http_token import bearer_header
from loom_benchmarks.secured import stack_security
from loom_proto.alerts import Alert

FAILED_CLUSTER = "c-use2-a"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _jobs(topology: Topology, rng: random.Random, *, on_failed: int, elsewhere: int) -> list[JobPlacement]:
    """Placements: ``on_failed`` jobs with a part on the failed cluster (10 % gangs and 5 % pipelines
    reaching another cluster), ``elsewhere`` on the other clusters (10 % cross-region gangs)."""
    nodes = {c.id: [n.id for n in c.nodes] for c in topology.clusters}
    others = [c.id for c in topology.clusters if c.id != FAILED_CLUSTER]
    jobs: list[JobPlacement] = []

    def part(cluster: str) -> Part:
        return Part(cluster, tuple(rng.sample(nodes[cluster], rng.randint(1, 2))))

    for i in range(on_failed):
        roll = rng.random()
        parts = [part(FAILED_CLUSTER)]
        if roll < 0.15:
            parts.append(part(rng.choice(others)))
        jobs.append(
            JobPlacement(f"hit-{i}", f"t{i % 7}", tuple(parts), parent=f"dag-{i}" if roll < 0.05 else None)
        )
    for i in range(elsewhere):
        first = rng.choice(others)
        parts = [part(first)]
        if rng.random() < 0.1:
            parts.append(part(rng.choice([c for c in others if c != first])))
        jobs.append(JobPlacement(f"ok-{i}", f"t{i % 7}", tuple(parts)))
    return jobs


def _alert(n: int, at: float, **kw: Any) -> Alert:
    fields: dict[str, Any] = {
        "alert_id": f"b{n}",
        "source": "bench",
        "severity": "warning",
        "summary": "bench",
    }
    fields.update(kw)
    return Alert(at=at, **fields)


def _run_clock(
    c: Correlator, timed: list[tuple[float, Alert]], until_s: float, tick_s: float = 0.05
) -> tuple[list[str], int]:
    """Feed alerts at their times on a simulated clock; notification kinds and the peak waiting list."""
    timed.sort(key=lambda x: x[0])
    kinds: list[str] = []
    peak = 0
    i = 0
    t = 0.0
    while t <= until_s:
        while i < len(timed) and timed[i][0] <= t:
            kinds.extend(n.kind for n in c.ingest(timed[i][1], t))
            i += 1
        peak = max(peak, len(c.waiting))
        kinds.extend(n.kind for n in c.tick(t))
        t = round(t + tick_s, 6)
    return kinds, peak


def storm(seed: int) -> dict[str, Any]:
    """Part (a): one cluster failure and the storm it causes."""
    rng = random.Random(seed)
    topology = load_topology("default")
    inv = Inventory.from_topology(topology)
    jobs = _jobs(topology, rng, on_failed=500, elsewhere=1000)
    placements = Placements(inv, jobs)
    c = Correlator(placements)
    cluster = topology.cluster(FAILED_CLUSTER)
    timed: list[tuple[float, Alert]] = []
    n = 0
    skewed = 0

    def add(at: float, **kw: Any) -> None:
        nonlocal n, skewed
        n += 1
        stamp = at
        if rng.random() < 0.05:
            stamp += rng.choice((-3600.0, 3600.0))
            skewed += 1
        timed.append((at, _alert(n, stamp, **kw)))

    hit = [j for j in jobs if j.job_id.startswith("hit-")]
    for j in hit:
        start = rng.uniform(0.0, 20.0)
        for k in range(7):  # JobHeartbeatMissing, re-sent every 15 s by the source
            add(
                start + 15.0 * k, job_id=j.job_id, dedup_key=f"hb-{j.job_id}", summary="job heartbeat missing"
            )
        add(
            start + rng.uniform(0, 5),
            job_id=j.job_id,
            momentary=True,
            summary="job failed",
            dedup_key=f"f-{j.job_id}",
        )
        add(
            start + rng.uniform(20, 60),
            job_id=j.job_id,
            momentary=True,
            summary="job restarted",
            dedup_key=f"r-{j.job_id}",
        )
    for node in cluster.nodes:
        start = rng.uniform(0.0, 20.0)
        for k in range(3):
            add(start + 30.0 * k, node=node.id, dedup_key=f"node-{node.id}", summary="node down")
    for k in range(8):
        add(
            15.0 + 10.0 * k,
            cluster=FAILED_CLUSTER,
            severity="critical",
            dedup_key="cluster-down",
            summary="cluster down",
        )
        add(
            16.0 + 10.0 * k,
            cluster=FAILED_CLUSTER,
            region=cluster.region,
            dedup_key="stale",
            summary="no heartbeat",
        )
    tracemalloc.start()
    started = time.perf_counter()
    kinds, peak_waiting = _run_clock(c, timed, 180.0)
    wall_s = time.perf_counter() - started
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    incidents = list(c.incidents.values())
    alive = [i for i in incidents if i.merged_into is None]
    main = max(alive, key=lambda i: len(i.jobs)) if alive else None
    hit_ids = {j.job_id for j in hit}
    return {
        "alerts": len(timed),
        "alerts_skewed_1h": skewed,
        "distinct_fingerprints": len({a.dedup_key for _, a in timed}),
        "jobs_on_failed_cluster": len(hit_ids),
        "incidents": len(alive),
        "incidents_merged": len(incidents) - len(alive),
        "root": f"{main.root[0]} {main.root[1]}" if main else None,
        "jobs_attached": len(set(main.jobs) & hit_ids) if main else 0,
        "jobs_attached_not_on_cluster": len(set(main.jobs) - hit_ids) if main else 0,
        "notifications": len(kinds),
        "notification_kinds": dict(Counter(kinds)),
        "alerts_per_s_in_process": round(len(timed) / wall_s),
        "peak_waiting_alerts": peak_waiting,
        "core_peak_mib": round(peak_bytes / 2**20, 1),
        "counts": dict(c.counts),
    }


def _fault_alerts(
    rng: random.Random, topology: Topology, placements: Placements, kind: str, *, n0: int, t0: float
) -> tuple[Resource, list[tuple[float, Alert]]]:
    """One fault's alerts (module docstring), with its true root."""
    inv = placements.inventory
    out: list[tuple[float, Alert]] = []
    n = n0
    regions = sorted(inv.regions)

    def at() -> float:
        return t0 + rng.uniform(0.0, 20.0)

    def add(**kw: Any) -> None:
        nonlocal n
        n += 1
        out.append((at(), _alert(n, t0, dedup_key=f"{n}", **kw)))

    if kind == "link":
        spanned = sorted(r for r in placements.by_resource if r[0] == "link")
        name = (
            rng.choice(spanned)
            if spanned and rng.random() < 0.9
            else ("link", link_name(*rng.sample(regions, 2)))
        )
        root: Resource = name
        a, _, b = name[1].partition("~")
        on = sorted(placements.jobs_on(root))
        explicit = rng.random() < 0.6 or not on
        if explicit:
            add(link=(a, b), summary="link degraded")
    elif kind == "cluster":
        cluster = rng.choice(topology.clusters)
        root = ("cluster", cluster.id)
        on = sorted(placements.jobs_on(root))
        if rng.random() < 0.6 or not on:
            add(cluster=cluster.id, severity="critical", summary="cluster down")
        for node in rng.sample(cluster.nodes, int(len(cluster.nodes) * rng.uniform(0.0, 0.3))):
            add(node=node.id, summary="node down")
    else:
        busy = sorted(r for r in placements.by_resource if r[0] == "node")
        root = rng.choice(busy)
        on = sorted(placements.jobs_on(root))
        if rng.random() < 0.6 or not on:
            add(node=root[1], summary="node down")
    if on:
        # A node that fails takes all its jobs down; a link or cluster fault shows on some of them.
        share = rng.uniform(0.6, 1.0) if kind == "node" else rng.uniform(0.3, 1.0)
        for job_id in rng.sample(on, max(1, round(len(on) * share))):
            add(job_id=job_id, summary="job degraded", momentary=rng.random() < 0.5)
    return root, out


def faults(seed: int, count: int) -> dict[str, Any]:
    """Part (b): root-cause precision and recall on faults with known roots."""
    rng = random.Random(seed + 1)
    topology = load_topology("default")
    inv = Inventory.from_topology(topology)
    jobs = _jobs(topology, rng, on_failed=300, elsewhere=1700)
    placements = Placements(inv, jobs)
    c = Correlator(placements)
    kinds = ["link", "cluster", "node"]
    per_kind: dict[str, Counter[str]] = {k: Counter() for k in kinds}
    t0 = 0.0
    n = 0
    wrong: list[str] = []
    for i in range(count):
        kind = kinds[i % 3]
        root, timed = _fault_alerts(rng, topology, placements, kind, n0=n, t0=t0)
        n += len(timed) + 10
        # One job alert and nothing else: the same evidence as that job failing on its own.
        lone = len(timed) == 1 and timed[0][1].job_id is not None
        fault_fps = {a.dedup_key for _, a in timed}
        for _ in range(rng.randint(0, 2)):  # noise: unrelated single job failures
            n += 1
            job = rng.choice(jobs)
            timed.append(
                (t0 + rng.uniform(0, 20), _alert(n, t0, job_id=job.job_id, momentary=True, dedup_key=f"{n}"))
            )
        timed = [(t - t0, a) for t, a in timed]
        clock = _Shifted(c, t0)
        clock.run(timed, 30.0)
        holding = {c.fingerprints[fp] for fp in fault_fps if fp in c.fingerprints}
        roots = [c.incidents[i].root for i in holding if i in c.incidents]
        right = sum(1 for r in roots if r == root)
        stats = per_kind[kind]
        stats["faults"] += 1
        stats["incidents"] += len(roots)
        stats["right_incidents"] += right
        stats["found"] += 1 if right else 0
        stats["lone_job_alert"] += 1 if lone else 0
        stats["found_lone"] += 1 if lone and right else 0
        if not right:
            wrong.append(f"{root[0]} {root[1]} -> {', '.join(f'{r[0]} {r[1]}' for r in roots) or 'nothing'}")
        # Everything recovers, then a quiet gap longer than quiet_s and reopen_s.
        for inc_id in list(c.open_by_root.values()):
            c.resolve(inc_id, "bench: fault over", t0 + 31.0)
        t0 += 4_000.0
    total = sum(per_kind.values(), Counter())
    precision = total["right_incidents"] / total["incidents"] if total["incidents"] else 0.0
    recall = total["found"] / total["faults"] if total["faults"] else 0.0
    return {
        "faults": count,
        "placed_jobs": len(jobs),
        "precision": round(precision, 4),
        "recall": round(recall, 4),
        "faults_with_one_job_alert_only": total["lone_job_alert"],
        "recall_without_those": round(
            (total["found"] - total["found_lone"]) / max(total["faults"] - total["lone_job_alert"], 1), 4
        ),
        "by_kind": {
            k: {
                "faults": v["faults"],
                "precision": round(v["right_incidents"] / v["incidents"], 4) if v["incidents"] else None,
                "recall": round(v["found"] / v["faults"], 4) if v["faults"] else None,
                "incidents_per_fault": round(v["incidents"] / v["faults"], 3) if v["faults"] else None,
                "one_job_alert_only": v["lone_job_alert"],
            }
            for k, v in per_kind.items()
        },
        "misses": wrong[:20],
    }


class _Shifted:
    """Runs a trial's alerts on the correlator's clock from ``t0``."""

    def __init__(self, c: Correlator, t0: float) -> None:
        self.c = c
        self.t0 = t0

    def run(self, timed: list[tuple[float, Alert]], until_s: float) -> None:
        timed.sort(key=lambda x: x[0])
        i = 0
        t = 0.0
        while t <= until_s:
            while i < len(timed) and timed[i][0] <= t:
                self.c.ingest(timed[i][1], self.t0 + t)
                i += 1
            self.c.tick(self.t0 + t)
            t = round(t + 0.1, 6)


# ---- (c) the real stack -------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def _post_probe(http_port: int, node: str, now: float, token: str | None) -> int:
    """An Alertmanager v4 payload with one alert naming ``node``, posted to the webhook (with the
    stack's bearer token when it asks for one)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    alert = {
        "status": "firing",
        "labels": {"alertname": "Probe", "node": node},
        "startsAt": stamp,
        "fingerprint": node,
    }
    body = json.dumps({"version": "4", "status": "firing", "receiver": "loom", "alerts": [alert]}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/alertmanager",
        data=body,
        headers={"Content-Type": "application/json", **bearer_header(token)},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


async def _measure(
    nats_url: str, http_port: int, probes: int, probe_hz: float, background_hz: float, *, token: str | None
) -> dict[str, Any]:
    import msgspec

    from loom.bus import Publisher, connect
    from loom_proto import subjects
    from loom_proto.alerts import IncidentChange

    nc = await connect(nats_url, "bench-alerts")
    pub = Publisher(nc)
    sent: dict[str, tuple[float, str]] = {}
    got: dict[str, float] = {}
    sending, all_in = asyncio.Event(), asyncio.Event()

    async def on(msg: Any) -> None:
        change = msgspec.json.decode(msg.data, type=IncidentChange)
        if change.root in sent and change.root not in got:
            got[change.root] = time.time()
            if sending.is_set() and len(got) >= len(sent):
                all_in.set()

    await nc.subscribe(subjects.incident("opened"), cb=on)
    # The background: one open incident and repeats attached to it.
    await pub.publish(
        subjects.alert_raw("bench"),
        _alert(0, time.time(), cluster="c-weu-a", dedup_key="bg"),
        msg_id=f"bg-{time.time()}",
    )
    stop = asyncio.Event()

    async def background() -> None:
        k = 0
        while not stop.is_set() and background_hz > 0:
            k += 1
            alert = _alert(k, time.time(), cluster="c-weu-a", dedup_key="bg")
            await pub.publish(subjects.alert_raw("bench"), alert, msg_id=f"bg-{k}-{time.time_ns()}")
            await asyncio.sleep(1 / background_hz)

    bg = asyncio.create_task(background())

    run_id = int(time.time())
    for i in range(probes):
        node = f"probe-{run_id}-{i}"
        now = time.time()
        if i % 2:
            sent[node] = (now, "webhook")
            await asyncio.to_thread(_post_probe, http_port, node, now, token)
        else:
            sent[node] = (now, "bus")
            await pub.publish(
                subjects.alert_raw("bench"), _alert(i, now, node=node, dedup_key=node), msg_id=node
            )
        await asyncio.sleep(1 / probe_hz)
    sending.set()
    if len(got) >= len(sent):
        all_in.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_in.wait(), timeout=10)
    stop.set()
    await bg
    health = await nc.request(subjects.service_health("alert-correlator"), b"", timeout=5)
    await nc.drain()
    lat = {
        path: [got[n] - t for n, (t, p) in sent.items() if p == path and n in got]
        for path in ("bus", "webhook")
    }
    every = lat["bus"] + lat["webhook"]
    stats = json.loads(health.data)
    return {
        "probes": probes,
        "probe_hz": probe_hz,
        "background_alerts_per_s": background_hz,
        "incidents_seen": len(got),
        "latency_s_p50": _percentile(every, 0.5),
        "latency_s_p99": _percentile(every, 0.99),
        "latency_s_max": _percentile(every, 1.0),
        "bus_p99_s": _percentile(lat["bus"], 0.99),
        "webhook_p99_s": _percentile(lat["webhook"], 0.99),
        "ingest_ms_p99_in_service": stats.get("correlation_ms_p99"),
        "service_counts": stats.get("core"),
    }


def latency(args: argparse.Namespace) -> dict[str, Any]:
    """Part (c): publish -> incident opened through ``loom up`` (small topology)."""
    from loom.runtime import stack

    home = Path(tempfile.mkdtemp(prefix="loom-bench-alerts-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    saved = {k: os.environ.pop(k) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL") if k in os.environ}
    port = find_free_port()
    os.environ["LOOM_ALERTS_HTTP_PORT"] = str(port)
    try:
        _say("stack: starting (small topology)")
        state = stack.up(home, stack.StackOptions(topology="small", placement_standby=False))
        _say("stack: ready; measuring")
        token = stack.local_http_token(home)
        out = asyncio.run(
            _measure(state["nats_url"], port, args.probes, args.probe_hz, args.background_hz, token=token)
        )
        return {**out, "security": stack_security(home)}
    finally:
        stack.down(home)
        shutil.rmtree(home, ignore_errors=True)  # ~50 MB of a stack nobody reads again
        os.environ.pop("LOOM_ALERTS_HTTP_PORT", None)
        os.environ.update(saved)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All three parts."""
    _say("storm: one cluster failure, 500 jobs")
    out: dict[str, Any] = {"storm": storm(args.seed)}
    _say(f"faults: {args.faults} injected faults")
    out["faults"] = faults(args.seed, args.faults)
    out["latency"] = None if args.skip_stack else latency(args)
    return out


def report(result: dict[str, Any]) -> None:
    """A readable summary on stderr."""
    s, f, lat = result["storm"], result["faults"], result["latency"]
    _say(
        f"storm: {s['alerts']} alerts -> {s['incidents']} incident(s) on {s['root']}, "
        f"{s['jobs_attached']}/{s['jobs_on_failed_cluster']} jobs, {s['notifications']} notification(s), "
        f"{s['alerts_per_s_in_process']} alerts/s in process, core peak {s['core_peak_mib']} MiB"
    )
    _say(f"faults: precision {f['precision']:.1%}, recall {f['recall']:.1%} over {f['faults']}")
    for kind, v in f["by_kind"].items():
        _say(
            f"  {kind}: precision {v['precision']}, recall {v['recall']},"
            f" incidents/fault {v['incidents_per_fault']}"
        )
    if lat:
        _say(
            f"latency (real stack): p50 {lat['latency_s_p50']} s, p99 {lat['latency_s_p99']} s,"
            f" max {lat['latency_s_max']} s"
        )

"""``loom bench e2e``: placements per second and submit -> placed latency through the real stack.

A private stack (its own NATS, PostgreSQL and service processes, in a temporary home) is
started; jobs are published as raw events exactly as any client would, and the ``JobPlaced``
events are observed on the bus. Latency is measured from the client's publish to the arrival
of the placed event at the same client (one clock). Jobs are long, so the clusters' only work
during the measurement is starting them.

``--shards N`` starts N placement shards (the topology's regions split by GPUs,
:func:`loom.runtime.stack.placement_groups`) and gives every job a one-region affinity, regions
taken in proportion to their GPUs (:func:`_regions`), so the jobs spread over the shards; give
``--shards 1`` for the single-shard figure with the same jobs.

Every run reports each process's CPU share (:mod:`loom.runtime.cpu`) at rest and under the burst;
``--baseline`` also measures the raw consume/store/publish path (:mod:`loom_benchmarks.e2e_baseline`)
in the same stack, with a burst of as many records just before Loom's burst and another after it,
and Loom's rate as a share of their mean: the raw path's rate moves with the host and with what the
stack is doing (after Loom's burst, thousands of runs report progress), so one burst on either side
alone was measured ~10 % apart on the same run, in either direction.
"""

import argparse
import asyncio
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from loom.bus.connection import credentials_path
from loom.bus.publisher import Outgoing
from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime import cpu, stack
from loom.security import ENV_CREDS
from loom_benchmarks import e2e_baseline
from loom_benchmarks.secured import stack_security
from loom_proto import subjects
from loom_proto.codec import encode
from loom_proto.jobs import Affinity, JobSpec, JobSubmitted, Resources, Work

BURST_BATCH = 256
"""Submissions the burst publishes at once (their acks awaited together)."""
JOB_STREAMS = ("REQUESTS", "JOBS", "CLUSTERS")
"""The streams a job's path goes through: once every consumer of theirs has nothing pending,
the burst's consequences are through (the running jobs' periodic reports are consumed as they
come; a rate threshold was not enough: 3,000 running jobs report over 200 messages a second)."""

PACED_SETTLE_S = 10.0
"""Pause between the burst's jobs all running and the paced phase (the stack's backlog drains)."""

QUIET_MARGIN_PCT = 15.0
"""After :data:`PACED_SETTLE_S`, the paced phase waits (up to :data:`QUIET_LIMIT_S`) until the
stack's processes together use no more than their CPU at rest plus this much of one core over a
second: on a slow host a burst's backlog (metering, migration, the agents' reports) outlasts the
fixed pause, and the paced phase then measured that backlog, not 50 jobs/s."""

QUIET_LIMIT_S = 60.0

NEIGHBOUR_PREFIXES = ("probe-", "agent-", "network-perception", "metrics")
"""The non-scheduling Loom services whose CPU at rest ``neighbours_at_rest_pct`` sums."""

NON_PLACEMENT_PREFIXES = (*NEIGHBOUR_PREFIXES, "migration", "alert-correlator", "console")
"""Every Loom service but placement (leader and standbys): what ``non_placement_at_rest_pct`` sums."""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(round(q / 100 * (len(ordered) - 1)), len(ordered) - 1)
    return ordered[index]


def _job(prefix: str, i: int, regions: list[str] | None = None) -> JobSpec:
    return JobSpec(
        job_id=f"{prefix}-{i}",
        tenant="bench",
        task_type="inference",
        resources=Resources(gpus=1),
        work=Work(steps=1, step_time_s=86_400.0),
        affinity=Affinity(regions=[regions[i % len(regions)]]) if regions else Affinity(),
    )


def job_spec(prefix: str, i: int) -> JobSpec:
    """Job ``i`` of a phase as the benchmark submits it (what ``loom bench decide`` decides too)."""
    return _job(prefix, i)


def _regions(topology: str) -> list[str]:
    """Regions in proportion to their GPUs (one entry per 50 GPUs, at least one), interleaved:
    job ``i`` is allowed in entry ``i % len`` (``--shards``: the jobs spread over the shards)."""
    gpus: dict[str, int] = {}
    for cluster in load_topology(topology).clusters:
        gpus[cluster.region] = gpus.get(cluster.region, 0) + sum(n.gpus for n in cluster.nodes)
    slots = sorted(
        ((k + 0.5) / max(round(g / 50), 1), region)
        for region, g in gpus.items()
        for k in range(max(round(g / 50), 1))
    )
    return [region for _, region in slots]


class _PlacedId(msgspec.Struct):
    """What the bench reads of a ``JobPlaced`` (any other field is skipped unparsed)."""

    job_id: str


_PLACED_ID = msgspec.json.Decoder(_PlacedId)


class _Run:
    """What one bench run observes: when each job was sent and when its placed event arrived."""

    def __init__(self, client: LoomClient, regions: list[str] | None = None) -> None:
        self.client = client
        self.regions = regions
        """With ``--shards``: each job's one allowed region, in turn (:func:`_regions`)."""
        self.sent: dict[str, float] = {}
        self.placed: dict[str, float] = {}
        self.expected: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.waiter: dict[str, asyncio.Event] = {}
        self.wall: dict[str, tuple[float, float]] = {}
        """Paced submissions one by one: wall-clock seconds sent and acked (:func:`path_breakdown`)."""
        self.placed_wall: dict[str, float] = {}

    def expect(self, prefix: str, count: int) -> asyncio.Event:
        self.expected[prefix] = count
        self.waiter[prefix] = asyncio.Event()
        if self.seen.get(prefix, 0) >= count:
            self.waiter[prefix].set()
        return self.waiter[prefix]

    async def on_placed(self, msg: Any) -> None:
        now = time.perf_counter()
        wall = time.time()
        # Only the job id: the bench client's own CPU counts in the figures, and the placed
        # events are placement's (decoded strictly by every consumer that acts on them).
        job_id = _PLACED_ID.decode(msg.data).job_id
        if job_id in self.placed:
            return
        self.placed[job_id] = now
        self.placed_wall[job_id] = wall
        prefix = job_id.split("-", 1)[0]
        self.seen[prefix] = self.seen.get(prefix, 0) + 1
        if self.seen[prefix] == self.expected.get(prefix) and prefix in self.waiter:
            self.waiter[prefix].set()

    async def submit_loom(self, spec: JobSpec) -> None:
        sent = time.time()
        self.sent[spec.job_id] = time.perf_counter()
        await self.client.submit(spec)
        self.wall[spec.job_id] = (sent, time.time())

    async def submit_baseline(self, spec: JobSpec) -> None:
        # The same record and the same publish call as LoomClient.submit, on the baseline's subject.
        fields = {f: getattr(spec, f) for f in JobSpec.__struct_fields__}
        job = JobSubmitted(**fields, submitted_at=time.time())
        self.sent[spec.job_id] = time.perf_counter()
        await self.client.publisher.publish(
            e2e_baseline.submitted_subject(spec.tenant), job, msg_id=spec.job_id
        )

    async def submit_batch(self, specs: list[JobSpec], *, baseline: bool = False) -> None:
        """Publish submissions at once, their acks awaited together (:meth:`Publisher.publish_batch`,
        what a client with many jobs does), the same records as :meth:`submit_loom` /
        :meth:`submit_baseline` send one by one; one that failed is sent again by that path."""
        subject_of = e2e_baseline.submitted_subject if baseline else subjects.job_submitted
        messages = []
        for spec in specs:
            fields = {f: getattr(spec, f) for f in JobSpec.__struct_fields__}
            job = JobSubmitted(**fields, submitted_at=time.time())
            messages.append(Outgoing(subject_of(spec.tenant), encode(job), spec.job_id, {}))
            self.sent[spec.job_id] = time.perf_counter()
        outcomes = await self.client.publisher.publish_batch(messages)
        for spec, error in zip(specs, outcomes, strict=True):
            if error is not None:
                await (self.submit_baseline if baseline else self.submit_loom)(spec)

    async def burst(
        self, prefix: str, jobs: int, sampler: cpu.CpuSampler, *, baseline: bool = False
    ) -> dict[str, Any]:
        """Everything at once: batches of ``BURST_BATCH`` submissions, two batches in flight; the
        CPU shares while it lasts (the bench client's own included)."""
        done = self.expect(prefix, jobs)
        sem = asyncio.Semaphore(2)

        async def batch(first: int) -> None:
            async with sem:
                last = min(first + BURST_BATCH, jobs)
                await self.submit_batch(
                    [_job(prefix, i, self.regions) for i in range(first, last)], baseline=baseline
                )

        before = sampler.sample()
        t0 = time.perf_counter()
        await asyncio.gather(*(batch(k) for k in range(0, jobs, BURST_BATCH)))
        t_published = time.perf_counter()
        # Generous: on a shared machine (load average 30+) a burst can take minutes.
        await asyncio.wait_for(done.wait(), timeout=max(600.0, jobs / 5))
        after = sampler.sample()
        shares = cpu.shares(before, after)
        t_done = max(self.placed[f"{prefix}-{i}"] for i in range(jobs))
        lat = [(self.placed[f"{prefix}-{i}"] - self.sent[f"{prefix}-{i}"]) * 1000 for i in range(jobs)]
        return {
            "placements_per_s": round(jobs / (t_done - t0), 1),
            "publish_per_s": round(jobs / (t_published - t0), 1),
            "burst_latency_ms_p50": round(_percentile(lat, 50), 2),
            "burst_latency_ms_p99": round(_percentile(lat, 99), 2),
            "cpu": shares,
            "cpu_ms_per_job": cpu_ms_per_job(before, after, jobs),
        }

    async def paced(
        self, prefix: str, jobs: int, rate: float, submit: Callable[[JobSpec], Awaitable[None]]
    ) -> dict[str, Any]:
        """``jobs`` jobs at ``rate`` per second."""
        done = self.expect(prefix, jobs)
        interval = 1.0 / rate
        start = time.perf_counter()
        for i in range(jobs):
            delay = start + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await submit(_job(prefix, i, self.regions))
        await asyncio.wait_for(done.wait(), timeout=max(60.0, jobs / 5))
        by_job = {
            f"{prefix}-{i}": (self.placed[f"{prefix}-{i}"] - self.sent[f"{prefix}-{i}"]) * 1000
            for i in range(jobs)
        }
        lat = list(by_job.values())
        return {
            "latency_ms_p50": round(_percentile(lat, 50), 2),
            "latency_ms_p99": round(_percentile(lat, 99), 2),
            "latency_ms_mean": round(statistics.fmean(lat), 2),
            "by_job": by_job,
        }


PATH = ("stored", "received", "handled", "admitted", "cycle", "decided", "committed", "sent")
"""Placement's stamps of a job's path (its ``job_timings`` debug section)."""


async def _job_timings(client: LoomClient, names: list[str], prefix: str) -> dict[str, dict[str, float]]:
    """Each placement instance's kept path of the jobs whose id starts with ``prefix``."""
    out: dict[str, dict[str, float]] = {}
    for name in names:
        try:
            reply = await client.nc.request(
                subjects.service_health(name), f"job_timings:{prefix}".encode(), timeout=5.0
            )
        except Exception:  # an instance that does not answer has nothing to report
            continue
        out.update(json.loads(reply.data).get("job_timings") or {})
    return out


def path_breakdown(
    latency_ms: dict[str, float],
    client: dict[str, tuple[float, float]],
    placed: dict[str, float],
    timings: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """Where each job's submit -> placed time went, from the client's clock and placement's stamps
    (one host, one wall clock): per segment p50, p99 and max, and the mean of each over the jobs
    at or above the latency p99 (``tail``). A segment runs from one stamp to the next, the stamps
    in the order they happen (:data:`PATH`; a placement that stamps ``cycle``, the lock taken,
    before ``admitted`` gives ``handled_to_cycle``, ``cycle_to_admitted``, ``admitted_to_decided``):
    ``publish_to_stored`` (the client's publish until JetStream stored it), ``stored_to_received``
    (delivered to placement's consumer), ``received_to_handled`` (waiting for a pipeline slot),
    then placement's steps to ``decided``, ``decided_to_committed`` (the batch before it ending,
    the write, the commit), ``committed_to_sent`` (the book, the relay), ``sent_to_observed``
    (NATS to the bench); ``ack`` is the client's publish until JetStream's ack (beside the path).
    ``order`` lists the stamps as they came; ``missing`` counts the jobs left out for want of a
    stamp (``sent`` when a relay round, not the fast path after the commit, published the job's
    events; any when placement no longer kept the job or did not answer)."""
    missing = {
        k: n for k in PATH if (n := sum(1 for job_id in latency_ms if not (timings.get(job_id) or {}).get(k)))
    }
    complete = {
        job_id: stamps
        for job_id, stamps in timings.items()
        if job_id in client and job_id in placed and all(stamps.get(k) for k in PATH)
    }
    if not complete:
        return {"jobs": 0, "missing": missing}
    order = sorted(PATH, key=lambda k: statistics.fmean(s[k] - s["stored"] for s in complete.values()))
    names = ["publish_to_stored", *(f"{a}_to_{b}" for a, b in itertools.pairwise(order)), "sent_to_observed"]
    rows: dict[str, dict[str, float]] = {}
    for job_id, stamps in complete.items():
        sent, acked = client[job_id]
        points = [sent, *(stamps[k] for k in order), placed[job_id]]
        row = {n: (b - a) * 1000 for n, (a, b) in zip(names, itertools.pairwise(points), strict=True)}
        row["ack"] = (acked - sent) * 1000
        rows[job_id] = row
    cut = _percentile([latency_ms[j] for j in rows], 99)
    tail = [j for j in rows if latency_ms[j] >= cut]
    segments = {}
    for name in [*names, "ack"]:
        values = [row[name] for row in rows.values()]
        segments[name] = {
            "p50": round(_percentile(values, 50), 2),
            "p99": round(_percentile(values, 99), 2),
            "max": round(max(values), 2),
            "tail": round(statistics.fmean(rows[j][name] for j in tail), 2),
        }
    return {"jobs": len(rows), "tail_jobs": len(tail), "order": order, "missing": missing, "ms": segments}


async def _pipeline_stats(client: LoomClient, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each placement instance's submission-path counters (its health answer's ``pipeline``),
    with its collector's pauses (``gc``) under ``pipeline["gc"]``."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            reply = await client.nc.request(subjects.service_health(name), b"", timeout=2.0)
        except Exception:  # an instance that does not answer has nothing to report
            continue
        answer = json.loads(reply.data)
        pipeline = answer.get("pipeline")
        if isinstance(pipeline, dict):
            out[name] = {**pipeline, "gc": answer.get("gc") or {}}
    return out


def gc_between(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The placement instances' collector pauses between two readings, per generation, summed
    over the instances: how many and their total (ms); and the longest each had since it started."""
    out: dict[str, dict[str, float]] = {}
    for name, now in after.items():
        then = before.get(name, {}).get("gc", {})
        for gen, entry in (now.get("gc") or {}).items():
            old = then.get(gen, {})
            row = out.setdefault(gen, {"count": 0, "total_ms": 0.0, "max_ms_since_start": 0.0})
            row["count"] += int(entry.get("count", 0)) - int(old.get("count", 0))
            spent = entry.get("total_ms", 0.0) - old.get("total_ms", 0.0)
            row["total_ms"] = round(row["total_ms"] + spent, 2)
            row["max_ms_since_start"] = max(row["max_ms_since_start"], entry.get("max_ms", 0.0))
    return out


def phases_between(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the placement instances' submission paths did between two readings, summed over the
    instances: batches, how many overlapped the one before, how many were discarded, and per
    phase the count and mean (milliseconds; ``jobs`` is jobs per batch)."""
    totals: dict[str, list[float]] = {}
    counts = {"batches": 0, "overlapped": 0, "discarded": 0}
    for name, now in after.items():
        then = before.get(name, {})
        for key in counts:
            counts[key] += int(now.get(key, 0)) - int(then.get(key, 0))
        for phase, (n, total, _) in now.get("ms", {}).items():
            n0, total0, _ = then.get("ms", {}).get(phase, (0, 0.0, 0.0))
            entry = totals.setdefault(phase, [0, 0.0])
            entry[0] += n - n0
            entry[1] += total - total0
    return {
        **counts,
        "mean": {phase: round(total / n, 2) for phase, (n, total) in sorted(totals.items()) if n},
        "count": {phase: int(n) for phase, (n, _) in sorted(totals.items()) if n},
    }


def cpu_ms_per_job(before: cpu.Sample, after: cpu.Sample, jobs: int) -> dict[str, float]:
    """CPU milliseconds (user + system) each process group spent per job between two samples:
    on a shared machine a steadier figure than the wall-clock rate."""
    elapsed = after.at - before.at
    return {
        name: round(share / 100.0 * elapsed * 1000.0 / jobs, 3)
        for name, share in _sorted_shares(cpu.shares(before, after)).items()
        if share > 0
    }


def _sorted_shares(shares: dict[str, float]) -> dict[str, float]:
    return dict(sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])))


def neighbours_pct(shares: dict[str, float]) -> float:
    """The summed share of the non-scheduling Loom services (probe collectors, network
    perception, cluster agents, metrics)."""
    return round(sum(v for k, v in shares.items() if k.startswith(NEIGHBOUR_PREFIXES)), 2)


def non_placement_pct(shares: dict[str, float]) -> float:
    """The summed share of every Loom service but placement: the neighbours of
    :func:`neighbours_pct` and migration, the alert correlator and the console (not NATS,
    PostgreSQL, the supervisor nor the bench's own processes)."""
    return round(sum(v for k, v in shares.items() if k.startswith(NON_PLACEMENT_PREFIXES)), 2)


async def _until_quiet(sampler: cpu.CpuSampler, rest_pct: float) -> tuple[float, float]:
    """Wait until the stack uses at most ``rest_pct`` + :data:`QUIET_MARGIN_PCT` of one core over a
    second, or :data:`QUIET_LIMIT_S` passed: (seconds waited, the last second's CPU in % of one core)."""
    start = time.perf_counter()
    used = math.inf
    before = sampler.sample()
    while time.perf_counter() - start < QUIET_LIMIT_S:
        await asyncio.sleep(1.0)
        after = sampler.sample()
        used = sum(cpu.shares(before, after).values())
        if used <= rest_pct + QUIET_MARGIN_PCT:
            break
        before = after
    return round(time.perf_counter() - start, 1), round(used, 1)


async def _paced_phase(
    run: _Run,
    paced_jobs: int,
    rate: float,
    *,
    running: int,
    placement: list[str],
    sampler: cpu.CpuSampler,
    rest_pct: float,
) -> dict[str, Any]:
    """The paced phase, once the burst's ``running`` jobs all run: latency at ``rate`` jobs/s."""
    client = run.client
    # Steady state first: the burst's jobs are all started (their agents and the lifecycle
    # consumers have caught up), so the paced phase measures 50 jobs/s, not the backlog.
    settle_start = time.perf_counter()
    while time.perf_counter() - settle_start < 120:
        counts = await client.counts()
        if counts.get("running", 0) >= running:
            break
        await asyncio.sleep(0.25)
    settle_s = round(time.perf_counter() - settle_start, 2)
    # "Running" is placement's view; metering, migration, the agents' reports and the heartbeats
    # of a fast burst are still being worked off for a few seconds after it, and a paced phase
    # started 1 s later measured that backlog (p99 90-300 ms against 24 ms 10 s later).
    await asyncio.sleep(PACED_SETTLE_S)
    quiet_s, quiet_pct = await _until_quiet(sampler, rest_pct)
    stats0 = await _pipeline_stats(client, placement)
    machine0, sample0 = cpu.read_machine(), sampler.sample()
    paced = await run.paced("paced", paced_jobs, rate, run.submit_loom)
    machine1, sample1 = cpu.read_machine(), sampler.sample()
    timings = await _job_timings(client, placement, "paced-")
    return {
        "settle_s": settle_s,
        # The wait for a quiet stack after the fixed pause, and the stack's CPU (% of one core)
        # over its last second: above its CPU at rest + QUIET_MARGIN_PCT when it gave up.
        "paced_quiet_wait_s": quiet_s,
        "paced_quiet_stack_cpu_pct": quiet_pct,
        "paced_host_cpu_pct": cpu.machine_shares(machine0, machine1) if machine0 and machine1 else {},
        # Every process's CPU over the paced phase a job (the stack's periodic work included: at
        # a low rate each job is a batch of its own and pays every per-batch cost).
        "cpu_ms_per_job_paced": cpu_ms_per_job(sample0, sample1, paced_jobs),
        "paced_rate_per_s": rate,
        "paced_jobs": paced_jobs,
        "paced_latency_ms_p50": paced["latency_ms_p50"],
        "paced_latency_ms_p99": paced["latency_ms_p99"],
        "paced_latency_ms_mean": paced["latency_ms_mean"],
        "placement_phases_paced": phases_between(stats0, stats1 := await _pipeline_stats(client, placement)),
        "placement_gc_paced": gc_between(stats0, stats1),
        "paced_path": path_breakdown(paced["by_job"], run.wall, run.placed_wall, timings),
    }


async def _baseline_after(
    run: "_Run",
    *,
    jobs: int,
    sampler: cpu.CpuSampler,
    base_before: dict[str, Any],
    tp: dict[str, Any],
    paced_jobs: int,
    rate: float,
) -> dict[str, Any]:
    """The raw path's second burst (after Loom's phases) and its paced phase; the rates of both
    bursts, and Loom's burst rate as a share of their mean."""
    out: dict[str, Any] = {}
    await asyncio.sleep(1.0)
    base = await run.burst("btp", jobs, sampler, baseline=True)
    bracket = (base_before["placements_per_s"] + base["placements_per_s"]) / 2
    out.update(
        {
            "baseline_placements_per_s": round(bracket, 1),
            "baseline_before_per_s": base_before["placements_per_s"],
            "baseline_after_per_s": base["placements_per_s"],
            "baseline_publish_per_s": base["publish_per_s"],
            "baseline_latency_ms_p50": base["burst_latency_ms_p50"],
            "baseline_latency_ms_p99": base["burst_latency_ms_p99"],
            "share_of_baseline": round(tp["placements_per_s"] / bracket, 3),
            "cpu_ms_per_job_baseline": base["cpu_ms_per_job"],
        }
    )
    if paced_jobs:
        await asyncio.sleep(1.0)
        bpaced = await run.paced("bpaced", paced_jobs, rate, run.submit_baseline)
        out.update(
            {
                "baseline_paced_latency_ms_p50": bpaced["latency_ms_p50"],
                "baseline_paced_latency_ms_p99": bpaced["latency_ms_p99"],
                "baseline_paced_latency_ms_mean": bpaced["latency_ms_mean"],
            }
        )
    out["cpu_baseline_under_load"] = _sorted_shares(base["cpu"])
    return out


def nats_counts(monitor_url: str) -> dict[str, int]:
    """The server's message counters (``/varz``): messages in (published) and out (delivered),
    every subject, JetStream's own API traffic and acks included."""
    with urllib.request.urlopen(f"{monitor_url}/varz", timeout=5) as reply:
        varz = json.loads(reply.read())
    return {"in": int(varz["in_msgs"]), "out": int(varz["out_msgs"])}


def consumers_pending(monitor_url: str, streams: tuple[str, ...] = JOB_STREAMS) -> int:
    """Messages the consumers of ``streams`` have not been delivered or have not acked, summed
    (``/jsz?consumers=true``)."""
    with urllib.request.urlopen(f"{monitor_url}/jsz?consumers=true", timeout=5) as reply:
        jsz = json.loads(reply.read())
    return sum(
        int(c.get("num_pending", 0)) + int(c.get("num_ack_pending", 0))
        for account in jsz.get("account_details") or []
        for stream in account.get("stream_detail") or []
        if stream.get("name") in streams
        for c in stream.get("consumer_detail") or []
    )


async def _nats_settled(
    monitor_url: str, quiet_s: float = 0.5, limit_s: float = 30.0, streams: tuple[str, ...] = JOB_STREAMS
) -> tuple[dict[str, int], bool]:
    """The counters once the burst's last consequences are through: every consumer of the job
    streams caught up at two readings ``quiet_s`` apart; and whether that happened (False: the
    counters when ``limit_s`` passed)."""
    deadline = time.monotonic() + limit_s
    idle = 0
    while time.monotonic() < deadline:
        idle = idle + 1 if await asyncio.to_thread(consumers_pending, monitor_url, streams) == 0 else 0
        if idle >= 2:
            return await asyncio.to_thread(nats_counts, monitor_url), True
        await asyncio.sleep(quiet_s)
    return await asyncio.to_thread(nats_counts, monitor_url), False


async def _nats_figures(
    monitor_url: str, before: dict[str, int], jobs: int, streams: tuple[str, ...] = JOB_STREAMS
) -> dict[str, Any]:
    """``nats_msgs_per_job`` (with ``settled``), or nothing when the monitor does not answer: a
    counter is a figure, not worth the run it ends."""
    try:
        after, settled = await _nats_settled(monitor_url, streams=streams)
    except (OSError, ValueError, KeyError):
        return {}
    return {"nats_msgs_per_job": {**msgs_per_job(before, after, jobs), "settled": settled}}


def msgs_per_job(before: dict[str, int], after: dict[str, int], jobs: int) -> dict[str, float]:
    """NATS messages in and out per placed job between two counter readings."""
    return {k: round((after[k] - before[k]) / max(jobs, 1), 2) for k in ("in", "out")}


async def _measure(
    nats_url: str,
    jobs: int,
    rate: float,
    paced_jobs: int,
    sampler: cpu.CpuSampler,
    *,
    rest_s: float,
    baseline: bool,
    regions: list[str] | None = None,
    placement: list[str] | None = None,
    monitor_url: str | None = None,
) -> dict[str, Any]:
    client = await LoomClient.connect(nats_url, name="loom-bench")
    placement = placement or []
    run = _Run(client, regions)
    subs = [await client.nc.subscribe(subjects.JOBS_PLACED_ALL, cb=run.on_placed)]
    if baseline:
        subs.append(await client.nc.subscribe(f"{e2e_baseline.PLACED}.*", cb=run.on_placed))
    try:
        # Warm up: the first placement needs the capacity view; wait until one job goes through.
        # With shards, one per region, so every shard has its view before the burst.
        warm_regions = sorted(set(regions)) if regions else None
        warm = run.expect("warm", len(warm_regions or [None]))
        for i in range(len(warm_regions or [None])):
            await run.submit_loom(_job("warm", i, warm_regions))
        await asyncio.wait_for(warm.wait(), timeout=60)
        if baseline:
            bwarm = run.expect("bwarm", 1)
            await run.submit_baseline(_job("bwarm", 0))
            await asyncio.wait_for(bwarm.wait(), timeout=60)

        # At rest: the stack idle (one job running), every service doing only its periodic work
        # (after a few seconds, so every collector has found its peers and is probing).
        await asyncio.sleep(3.0)
        before = sampler.sample()
        await asyncio.sleep(rest_s)
        at_rest = cpu.shares(before, sampler.sample())

        base_before: dict[str, Any] | None = None
        if baseline:
            base_before = await run.burst("btq", jobs, sampler, baseline=True)
            await asyncio.sleep(1.0)
        stats0 = await _pipeline_stats(client, placement)
        try:
            msgs0 = await asyncio.to_thread(nats_counts, monitor_url) if monitor_url else None
        except (OSError, ValueError, KeyError):
            msgs0 = None
        tp = await run.burst("tp", jobs, sampler)
        stats1 = await _pipeline_stats(client, placement)
        result: dict[str, Any] = {
            "jobs": jobs,
            **{k: v for k, v in tp.items() if k != "cpu"},
            "placement_phases_burst": phases_between(stats0, stats1),
            "placement_gc_burst": gc_between(stats0, stats1),
        }
        if monitor_url is not None and msgs0 is not None:
            # The whole burst's traffic, the agents' starts and the consumers' folds included.
            result.update(await _nats_figures(monitor_url, msgs0, jobs))
        if paced_jobs:
            result.update(
                await _paced_phase(
                    run,
                    paced_jobs,
                    rate,
                    running=jobs + len(warm_regions or [None]),
                    placement=placement,
                    sampler=sampler,
                    rest_pct=sum(at_rest.values()),
                )
            )
        if base_before is not None:
            result.update(
                await _baseline_after(
                    run,
                    jobs=jobs,
                    sampler=sampler,
                    base_before=base_before,
                    tp=tp,
                    paced_jobs=paced_jobs,
                    rate=rate,
                )
            )
        result["cpu_rest_s"] = rest_s
        result["cpu_at_rest"] = _sorted_shares(at_rest)
        result["cpu_under_load"] = _sorted_shares(tp["cpu"])
        result["cpu_ms_per_job"] = tp["cpu_ms_per_job"]
        result["neighbours_at_rest_pct"] = neighbours_pct(at_rest)
        result["neighbours_under_load_pct"] = neighbours_pct(tp["cpu"])
        result["non_placement_at_rest_pct"] = non_placement_pct(at_rest)
        result["non_placement_under_load_pct"] = non_placement_pct(tp["cpu"])
        return result
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await client.close()


def stack_groups(state: dict[str, Any], extra: dict[str, int] | None = None) -> dict[str, list[int]]:
    """The stack's processes by name for a :class:`cpu.CpuSampler`: every service, NATS,
    PostgreSQL (the postmaster and its backends) and the supervisor, plus ``extra``."""
    groups: dict[str, list[int]] = {
        name: [int(svc["pid"])] for name, svc in state.get("services", {}).items() if svc.get("pid")
    }
    for name in ("nats", "postgres"):
        if state.get(f"{name}_pid"):
            groups[name] = [int(state[f"{name}_pid"])]
    # A group counts its descendants too, unless an earlier group claimed them: the supervisor
    # (parent of the services) and the bench's own process (parent of the supervisor and of the
    # baseline consumer) come after the processes they started, so those keep their own names.
    bench_pid = os.getpid()
    for name, pid in (extra or {}).items():
        if pid != bench_pid:
            groups[name] = [pid]
    groups["supervisor"] = [int(state["supervisor_pid"])]
    for name, pid in (extra or {}).items():
        if pid == bench_pid:
            groups[name] = [pid]
    return groups


def _with_credentials(nats_url: str) -> dict[str, str]:
    """This process's environment, plus the operator's credentials of a secured stack it started."""
    creds = credentials_path(nats_url)
    return {**os.environ, ENV_CREDS: str(creds)} if creds is not None else dict(os.environ)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a private stack, measure, stop it."""
    home = Path(tempfile.mkdtemp(prefix="loom-bench-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL") if k in os.environ}
    baseline: subprocess.Popen[bytes] | None = None
    baseline_on = bool(getattr(args, "baseline", False))
    try:
        options = stack.StackOptions(
            topology=args.topology,
            time_scale=1.0,
            heartbeat_s=2.0,
            durable=True,
            network=not args.without_network,
            placement_shards=getattr(args, "shards", None) or 1,
        )
        # The host as it was before the stack started: its single-thread speed and its load.
        host: dict[str, Any] = {
            "loop_ms": cpu.loop_ms(),
            "load_average_1m_before": round(os.getloadavg()[0], 2),
        }
        state = stack.up(home, options)
        started = time.time()
        machine_before = cpu.read_machine()
        extra = {"bench-client": os.getpid()}
        if baseline_on:
            # Its own OS process, like placement, started before anything is measured.
            with open(home / "logs" / "bench-baseline.log", "ab") as log:
                baseline = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "loom_benchmarks.e2e_baseline",
                        "--nats",
                        state["nats_url"],
                        "--database",
                        state["database_url"],
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=_with_credentials(state["nats_url"]),
                )
            extra["bench-baseline"] = baseline.pid
        sampler = cpu.CpuSampler(stack_groups(state, extra))
        result = asyncio.run(
            _measure(
                state["nats_url"],
                args.jobs,
                args.rate,
                args.paced_jobs,
                sampler,
                rest_s=float(getattr(args, "rest_s", 10.0)),
                baseline=baseline_on,
                regions=_regions(args.topology) if getattr(args, "shards", None) else None,
                placement=[name for name in state["services"] if name.startswith("placement")],
                monitor_url=state.get("nats_monitor_url"),
            )
        )
        machine_after = cpu.read_machine()
        if machine_before is not None and machine_after is not None:
            host["cpu_pct"] = cpu.machine_shares(machine_before, machine_after)
        result.update(
            {
                "benchmark": "e2e",
                "topology": args.topology,
                "services": len(state["services"]),
                "placement_shards": options.placement_shards,
                "neighbour_nice": options.neighbour_nice,
                "placement_groups": stack.placement_groups(options),
                "network_services": not args.without_network,
                "cpu_cores": os.cpu_count(),
                "nats_sync": "always",
                "postgres_durable": True,
                "wall_s": round(time.time() - started, 1),
                "security": stack_security(home),
                # Figures differ between hosts by more than any change measured on one: a host's
                # speed (loop_ms: `python -m timeit "sum(range(10**6))"`, lower is faster) and the
                # machine's CPU time over the measured phases (steal: taken by other guests).
                "host": host,
            }
        )
        if baseline_on:
            result["baseline"] = (
                "raw path in its own process: JetStream stream BENCHBASE (placement never sees it), "
                "durable pull consumer, one transaction per fetched batch (inbox claim, record insert, "
                "outbox row) on the same database, placed-like events published with JetStream acks"
            )
        return result
    finally:
        if baseline is not None:
            baseline.terminate()
            try:
                baseline.wait(timeout=10)
            except subprocess.TimeoutExpired:
                baseline.kill()
                baseline.wait()
        stack.down(home)
        os.environ.update(env_backup)
        shutil.rmtree(home, ignore_errors=True)

"""``loom bench chaos``: a bounded, seeded fault campaign on the real stack while jobs flow.

A private stack (its own NATS, PostgreSQL and every service of ``loom up``, the probe collectors and
network perception included, in a temporary home) runs short simulated one-GPU jobs submitted
through the SDK at ``--rate`` per second for the whole campaign. One fault after another, each
waiting for the stack to be healthy first:

* ``sigkill`` / ``sigstop`` (SIGCONT after ``hold_s``) of every service kind: the placement
  leader, the placement standby, metrics, network perception, a probe collector, a cluster agent
  (which ones: the seed);
* PostgreSQL outages (the postmaster and all its backends SIGSTOPped, SIGCONT after ``hold_s``)
  of 5, 15, 60 and 120 s, and a SIGKILL of the postmaster (the supervisor restarts it);
* NATS outages (nats-server SIGSTOPped) of 5, 60 and 120 s, and a SIGKILL of nats-server;
* poison on every consumed subject: deeply nested JSON, a repeated key, over 256 KiB, garbage;
* duplicate and out-of-order redelivery: lifecycle messages and commands of finished jobs
  republished with their own message ids, with new ids, and with new ids in reverse order.

Per fault: ``recovery_s`` from the fault's end (the kill, the SIGCONT, the last message) until a
job submitted after it is placed and every service answers its health subject with ``status:
ok``; the dead letters that arrived meanwhile (each marked injected or not); the acknowledged
submissions of its window that ended lost or run twice; and a check of the state right after
recovery (stuck runs, leaked reservations, overbooked nodes). At the end the submitter stops, the
jobs drain, and the same checks run on the final state, read from PostgreSQL (``jobs``,
``job_events``, ``reservations``, ``node_allocations``, ``ledger_nodes``) and from the agents'
health answers (their live runs, ``running_keys``, and ``nodes_over_capacity``).

A 3-node NATS cluster's faults (node kills, a partition) run only where ``loom up`` has
``--nats-cluster``; otherwise the plan says they are not available.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import asyncpg
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from loom.bus import BusError
from loom.bus.dlq import DeadLetters
from loom.bus.lease import LEASE_BUCKET
from loom.client import LoomClient
from loom.model.topology import load_topology
from loom.runtime import stack
from loom_benchmarks import nats_elections
from loom_benchmarks.secured import stack_security
from loom_benchmarks.takeover import p50_max_mean
from loom_proto import subjects
from loom_proto.jobs import JobSpec, Resources, Work

TENANT: Final = "chaos"
PREFIX: Final = "cx"
INJECTED: Final = "chaos-"
"""Message ids of everything the campaign publishes itself (poison, redeliveries) start so."""
CHAOS_HEADER: Final = "Loom-Chaos"
SERVICE_HOLD_S: Final = 10.0
PG_OUTAGES_S: Final = (5.0, 15.0, 60.0, 120.0)
NATS_OUTAGES_S: Final = (5.0, 60.0, 120.0)
QUICK_HOLD_S: Final = 2.0
RECOVERY_TIMEOUT_S: Final = 240.0
SETTLE_TIMEOUT_S: Final = 120.0
POLL_S: Final = 0.25
STUCK_RECHECK_S: Final = 8.0
"""A run missing on the agents (or a reservation not released) counts only if still so this much later."""
LIVE_SLACK_S: Final = 5.0
"""A run seen live on an agent this long after its job finished in PostgreSQL counts as run twice."""
ROLES: Final = (
    "placement-leader",
    "placement-standby",
    "metrics",
    "network-perception",
    "probe",
    "agent",
)
POISON_KINDS: Final = ("nested", "duplicate-keys", "oversized", "garbage")
REDELIVERY_KINDS: Final = ("same-ids", "new-ids", "out-of-order")
CONTROLS: Final = 3
CLUSTER_TARGETS: Final = ("stream-leader", "lease-leader", "meta-leader", "follower")
"""Which node of a 3-node NATS cluster a ``nats-node-sigkill`` kills: the REQUESTS stream's leader, the
placement leases bucket's leader, the JetStream meta leader, or one leading none of them."""
PLACEMENT_PATH: Final = (
    nats_elections.stream_group("REQUESTS"),
    nats_elections.consumer_group("REQUESTS", "placement-submitted"),
)
"""The Raft groups a job submitted after a node kill needs before placement sees it: the REQUESTS stream
(its publish is acknowledged) and placement's submissions consumer (it is delivered)."""
CATCH_UP_TIMEOUT_S: Final = 60.0
"""Rounds with no fault at all: what recovery_s measures on a healthy stack (placement's own pace)."""


class OptionError(ValueError):
    """An option of ``loom bench chaos`` that cannot be used."""


@dataclasses.dataclass
class Fault:
    """One fault of the plan."""

    index: int
    kind: str
    """``sigkill``, ``sigstop``, ``postgres-outage``, ``postgres-sigkill``, ``nats-outage``,
    ``nats-sigkill``, ``nats-node-sigkill`` (a 3-node cluster), ``poison``, ``redelivery``."""
    target: str
    """A role (``placement-leader``, ``agent-c-use2-a``...), ``postgres``, ``nats``, a subject, or a
    redelivery kind."""
    hold_s: float = 0.0

    @property
    def group(self) -> str:
        """The fault kind the summary groups recovery times by."""
        if self.kind in ("sigkill", "sigstop"):
            role = "agent" if self.target.startswith("agent-") else self.target
            role = "probe" if role.startswith("probe-") else role
            return f"{self.kind} {role}"
        if self.kind == "nats-node-sigkill":
            return f"{self.kind} {self.target}"
        if self.kind.endswith("-outage"):
            return f"{self.kind} {self.hold_s:g}s"
        if self.kind == "poison":
            return "poison"
        if self.kind == "redelivery":
            return f"redelivery {self.target}"
        if self.kind == "control":
            return "control (no fault)"
        return self.kind

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "target": self.target, "hold_s": self.hold_s}


def link_subject(topology: str) -> str:
    """The link-state subject poisoned: placement listens to it on core NATS (no stream)."""
    regions = sorted({c.region for c in load_topology(topology).clusters})
    return subjects.link_state(regions[0], regions[-1])


def consumed_subjects(topology: str) -> list[str]:
    """One concrete subject per consumed subject pattern of the stack's services."""
    topo = load_topology(topology)
    cluster = topo.clusters[0]
    regions = sorted({c.region for c in topo.clusters})
    src, dst = regions[0], regions[-1]
    return [
        subjects.job_submitted(TENANT),
        subjects.job_placed(TENANT),
        *(
            subjects.job_report(kind, TENANT, cluster.id)
            for kind in ("started", "progress", "checkpointed", "completed", "failed")
        ),
        subjects.job_event("cancelled", TENANT),
        subjects.cluster_heartbeat(cluster.id),
        subjects.cluster_profiles(cluster.id),
        subjects.cluster_command(cluster.id, "start"),
        subjects.view_delta(cluster.region),
        subjects.probe_sample(src, dst),
        subjects.net_transfer(src, dst),
        link_subject(topology),
    ]


def nats_cluster_available() -> bool:
    """Whether this build's ``loom up`` can run a 3-node NATS cluster."""
    return any(f.name.startswith("nats_cluster") for f in dataclasses.fields(stack.StackOptions))


def build_plan(
    topology: str,
    seed: int,
    quick: bool,
    faults: int | None,
    *,
    cluster_kills: int = 0,
    cluster_only: bool = False,
) -> list[Fault]:
    """The seeded campaign: every fault kind, shuffled; the first ``faults`` of it.

    ``cluster_kills`` (a stack with a 3-node NATS cluster) adds that many SIGKILLs of each cluster
    node role and leaves out the single nats-server's faults; ``cluster_only`` keeps only those
    (and the controls).
    """
    if cluster_kills:
        plan = [
            Fault(0, "nats-node-sigkill", target) for target in CLUSTER_TARGETS for _ in range(cluster_kills)
        ]
        if cluster_only:
            plan += [Fault(0, "control", "none") for _ in range(CONTROLS)]
        else:
            plan += [
                f
                for f in build_plan(topology, seed, quick, None)
                if f.kind not in ("nats-outage", "nats-sigkill")
            ]
        random.Random(seed).shuffle(plan)
        plan = plan[:faults] if faults is not None else plan
        for i, fault in enumerate(plan):
            fault.index = i + 1
        return plan
    rng = random.Random(seed)
    topo = load_topology(topology)
    agent = f"agent-{rng.choice([c.id for c in topo.clusters])}"
    probe = f"probe-{rng.choice(sorted({c.region for c in topo.clusters}))}"
    hold = QUICK_HOLD_S if quick else SERVICE_HOLD_S
    roles = {"agent": agent, "probe": probe}
    plan = []
    for role in ROLES:
        target = roles.get(role, role)
        plan.append(Fault(0, "sigkill", target))
        plan.append(Fault(0, "sigstop", target, hold))
    plan += [Fault(0, "postgres-outage", "postgres", QUICK_HOLD_S if quick else s) for s in PG_OUTAGES_S]
    plan.append(Fault(0, "postgres-sigkill", "postgres"))
    plan += [Fault(0, "nats-outage", "nats", QUICK_HOLD_S if quick else s) for s in NATS_OUTAGES_S]
    plan.append(Fault(0, "nats-sigkill", "nats"))
    plan += [Fault(0, "poison", subject) for subject in consumed_subjects(topology)]
    plan += [Fault(0, "redelivery", kind) for kind in REDELIVERY_KINDS]
    plan += [Fault(0, "control", "none") for _ in range(CONTROLS)]
    rng.shuffle(plan)
    if faults is not None:
        plan = plan[:faults]
    for i, fault in enumerate(plan):
        fault.index = i + 1
    return plan


def _http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return bytes(reply.read())


def poison_payloads(subject: str, rng: random.Random) -> dict[str, bytes]:
    """The hostile payloads sent to one subject."""
    nested = b'{"kind":"x","x":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    if subject == subjects.job_submitted(TENANT):
        dup = (
            b'{"job_id":"chaos-dupkey","tenant":"chaos","tenant":"other","task_type":"inference",'
            b'"resources":{"gpus":1},"work":{"steps":1},"submitted_at":1.0}'
        )
    else:
        dup = b'{"kind":"heartbeat","cluster":"a","cluster":"b","job_id":"x","job_id":"y"}'
    oversized = b'{"kind":"x","pad":"' + b"a" * (300 * 1024) + b'"}'
    return {"nested": nested, "duplicate-keys": dup, "oversized": oversized, "garbage": rng.randbytes(512)}


# ---- the running campaign ----------------------------------------------------------------------


@dataclasses.dataclass
class Captured:
    subject: str
    data: bytes
    headers: dict[str, str]


class Campaign:
    """The campaign against one running stack."""

    def __init__(
        self, state: dict[str, Any], home: Path, args: argparse.Namespace, say: Callable[[str], None]
    ) -> None:
        self.state = state
        self.home = home
        self.args = args
        self.say = say
        self.database_url: str = state["database_url"]
        self.services: list[str] = sorted(state["services"])
        self.agents = [s for s in self.services if s.startswith("agent-")]
        self.rng = random.Random(args.seed)
        self.acked: dict[str, float] = {}
        """job_id -> time.time() of its JetStream ack."""
        self.submit_retries = 0
        self.live_seen: dict[str, dict[str, float]] = {}
        """job:attempt -> agent -> last time.time() seen live."""
        self.live_twice: dict[str, list[str]] = {}
        """job:attempt live on two agents at once (or a job live in two attempts at once)."""
        self.captured: list[Captured] = []
        self.rejected_on_bus: set[str] = set()
        self.client: LoomClient | None = None

    # ---- helpers -----------------------------------------------------------------------------

    @property
    def nc(self) -> Client:
        assert self.client is not None
        return self.client.nc

    async def db(self, sql: str, *params: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.database_url, timeout=5)
        try:
            return list(await conn.fetch(sql, *params, timeout=30))
        finally:
            await conn.close()

    async def health(self, name: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
        try:
            reply = await self.nc.request(subjects.service_health(name), b"", timeout=timeout_s)
            answer: dict[str, Any] = json.loads(reply.data)
        except (TimeoutError, nats.errors.Error, OSError, ValueError):
            return None
        return answer

    async def all_health(self) -> dict[str, dict[str, Any] | None]:
        answers = await asyncio.gather(*(self.health(name) for name in self.services))
        return dict(zip(self.services, answers, strict=True))

    async def leader(self) -> str | None:
        for name in ("placement", "placement-standby"):
            answer = await self.health(name)
            if answer and answer.get("leadership", {}).get("is_leader"):
                return name
        return None

    def server_pid(self, name: str) -> int:
        state = stack.read_state(self.home) or {}
        pid = state.get("servers", {}).get(name, {}).get("pid")
        if not pid:
            raise RuntimeError(f"no pid for server {name}")
        return int(pid)

    # ---- background: jobs, live runs, captured messages ----------------------------------------

    async def submit_loop(self, stop: asyncio.Event) -> None:
        """One short job every 1/rate s (slots missed while the bus is down are not made up)."""
        assert self.client is not None
        interval = 1.0 / self.args.rate
        i = 0
        next_at = time.perf_counter()
        while not stop.is_set():
            delay = next_at - time.perf_counter()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                continue
            spec = JobSpec(
                job_id=f"{PREFIX}-{i}",
                tenant=TENANT,
                task_type="inference",
                resources=Resources(gpus=1),
                work=Work(steps=self.args.job_steps, step_time_s=60.0),
            )
            msg_id = f"{spec.job_id}:{secrets.token_hex(8)}"  # one per job, kept across its retries
            while True:
                try:
                    await asyncio.wait_for(self.client.submit(spec, msg_id=msg_id), 30)
                    self.acked[spec.job_id] = time.time()
                    break
                except (BusError, TimeoutError, nats.errors.Error):
                    if stop.is_set():
                        break  # never acknowledged: not counted
                    self.submit_retries += 1  # the same msg id again: the stream keeps one copy
                    await asyncio.sleep(0.5)
            i += 1
            next_at = max(next_at + interval, time.perf_counter())

    async def live_loop(self, stop: asyncio.Event) -> None:
        """Every second: each agent's live runs; a run live twice at one moment is recorded."""
        while not stop.is_set():
            answers = await asyncio.gather(*(self.health(a) for a in self.agents))
            now = time.time()
            by_job: dict[str, list[str]] = {}
            for agent, answer in zip(self.agents, answers, strict=True):
                for key in (answer or {}).get("running_keys", []):
                    self.live_seen.setdefault(key, {})[agent] = now
                    by_job.setdefault(key.rsplit(":", 1)[0], []).append(f"{agent}/{key}")
            for job_id, where in by_job.items():
                if job_id.startswith(f"{PREFIX}-") and len(where) > 1:
                    self.live_twice.setdefault(job_id, sorted(where))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def on_message(self, msg: Msg) -> None:
        """Keep the recent lifecycle messages and commands (for redelivery), and note rejections."""
        headers = dict(msg.headers or {})
        if headers.get("Nats-Msg-Id", "").startswith(INJECTED):
            return
        if msg.subject == subjects.job_event("rejected", TENANT):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                self.rejected_on_bus.add(str(json.loads(msg.data)["job_id"]))
        self.captured.append(Captured(msg.subject, msg.data, headers))
        if len(self.captured) > 4000:
            del self.captured[:1000]

    # ---- faults ------------------------------------------------------------------------------

    async def wait_healthy(self, timeout_s: float) -> tuple[float | None, dict[str, str]]:
        """Seconds until every service answers ``ok``; None (and who does not) after ``timeout_s``."""
        started = time.perf_counter()
        bad: dict[str, str] = {}
        while time.perf_counter() - started < timeout_s:
            answers = await self.all_health()
            bad = {n: ("no answer" if a is None else str(a.get("status"))) for n, a in answers.items()}
            bad = {n: s for n, s in bad.items() if s != "ok"}
            if not bad:
                return time.perf_counter() - started, {}
            await asyncio.sleep(POLL_S)
        return None, bad

    async def placed_after(self, since: float, timeout_s: float) -> float | None:
        """time.time() when a job acknowledged after ``since`` was first seen placed; None on timeout."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            ids = [j for j, at in self.acked.items() if at >= since]
            if ids:
                with contextlib.suppress(OSError, asyncpg.PostgresError, TimeoutError):
                    rows = await self.db(
                        "SELECT 1 FROM jobs WHERE job_id = ANY($1::text[]) AND placed_at IS NOT NULL LIMIT 1",
                        ids,
                    )
                    if rows:
                        return time.time()
            await asyncio.sleep(POLL_S * 2)
        return None

    async def recover(self, released: float) -> dict[str, Any]:
        """Recovery after a fault ends at ``released`` (time.time())."""
        placed = await self.placed_after(released, RECOVERY_TIMEOUT_S)
        remaining = max(RECOVERY_TIMEOUT_S - (time.time() - released), 5.0)
        healthy_s, bad = await self.wait_healthy(remaining)
        done = time.time()
        ok = placed is not None and healthy_s is not None
        return {
            "recovered": ok,
            "recovery_s": round(done - released, 2) if ok else None,
            "first_placement_s": round(placed - released, 2) if placed is not None else None,
            "unhealthy": bad,
        }

    def _tree(self, pid: int) -> list[int]:
        """``pid`` and its children (PostgreSQL's backends)."""
        children = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry.name))
        return [pid, *children]

    async def hold(self, pids: list[int], hold_s: float) -> float:
        """SIGSTOP ``pids`` (in order), wait, SIGCONT them (in reverse order), whatever happens; when
        the last was stopped (wall clock): the fault's true start, a placement stall's origin."""
        stopped = []
        try:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            stopped_at = time.time()
            await asyncio.sleep(hold_s)
            return stopped_at
        finally:
            for pid in reversed(stopped):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    async def service_pid(self, fault: Fault) -> tuple[str, int]:
        name = fault.target
        if fault.target == "placement-leader":
            name = await self.leader() or "placement"
        elif fault.target == "placement-standby":
            lead = await self.leader()
            name = "placement-standby" if lead != "placement-standby" else "placement"
        answer = await self.health(name, timeout_s=2.0)
        if answer is None:
            raise RuntimeError(f"{name} does not answer before the fault")
        return name, int(answer["pid"])

    async def cluster_node(self, target: str) -> str:
        """The NATS cluster node (``nats-N``) holding ``target`` (see :data:`CLUSTER_TARGETS`)."""
        js = self.nc.jetstream(timeout=5.0)
        stream = (await js.stream_info("REQUESTS")).cluster
        leases = (await js.stream_info(f"KV_{LEASE_BUCKET}")).cluster
        leaders = {
            "stream-leader": stream.leader if stream else None,
            "lease-leader": leases.leader if leases else None,
            "meta-leader": await self._meta_leader(),
        }
        if target in leaders:
            name = leaders[target]
        else:
            nodes = sorted(n for n in (self.state.get("servers") or {}) if n.startswith("nats-"))
            name = next((n for n in nodes if n not in leaders.values()), None)
            name = name or next((n for n in nodes if n != leaders["stream-leader"]), None)
        if not name:
            raise RuntimeError(f"no cluster node holds {target}: {leaders}")
        return name

    async def _meta_leader(self) -> str | None:
        """The JetStream meta leader, from a live node's monitoring endpoint (its port is in the
        config ``loom up`` wrote for it)."""
        for config in sorted((self.home / "nats").glob("nats-*/nats.conf")):
            found = re.search(r'^\s*http: "127\.0\.0\.1:(\d+)"', config.read_text(), re.MULTILINE)
            if not found:
                continue
            url = f"http://127.0.0.1:{found.group(1)}/jsz"
            with contextlib.suppress(OSError, ValueError):
                body = await asyncio.to_thread(_http_get, url)
                leader = json.loads(body).get("meta_cluster", {}).get("leader")
                if leader:
                    return str(leader)
        return None

    async def cluster_caught_up(self, timeout_s: float) -> bool:
        """Whether every replica of REQUESTS and the leases bucket is current (a killed node restarted
        by the supervisor has rejoined), waiting up to ``timeout_s``: the next kill must not take
        a second node of a majority."""
        js = self.nc.jetstream(timeout=2.0)
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                infos = [await js.stream_info(name) for name in ("REQUESTS", f"KV_{LEASE_BUCKET}")]
                if all(
                    i.cluster
                    and i.cluster.leader
                    and len(i.cluster.replicas or []) == 2
                    and all(p.current and not p.offline for p in i.cluster.replicas or [])
                    for i in infos
                ):
                    return True
            await asyncio.sleep(0.5)
        return False

    async def placement_stall(self, result: dict[str, Any], start: float) -> float | None:
        """From the fault's start (a node kill: the kill itself, a few look-ups later; a SIGSTOP: when
        the last process was stopped, after finding them: a job acknowledged meanwhile could still be
        placed, and a database outage then showed no stall) until the first placement of a job
        acknowledged after it."""
        done = result["done"]
        since = float(done.get("killed_at", done.get("stopped_at", start)))
        first = await self.db(
            "SELECT min(placed_at) AS at FROM jobs WHERE job_id = ANY($1::text[])",
            [j for j, at in self.acked.items() if at >= since],
        )
        placed_at = first[0]["at"] if first else None
        if placed_at is None:
            return None
        # A fault that does not hold placement back (a poison message, an agent elsewhere) may see
        # a job decided a few milliseconds before the client read its acknowledgement: no stall.
        return max(round(float(placed_at.timestamp()) - since, 2), 0.0)

    def split_stalls(self, results: list[dict[str, Any]]) -> None:
        """Adds :meth:`election_split` to every node kill's result (the NATS logs are still there)."""
        events = nats_elections.read_cluster_logs(self.home)
        for result in results:
            if result["kind"] == "nats-node-sigkill" and result["done"].get("node"):
                result.update(self.election_split(result, events))

    @staticmethod
    def election_split(result: dict[str, Any], events: list[nats_elections.LeaderEvent]) -> dict[str, Any]:
        """A node kill's placement stall split into the server's part (the Raft elections of the
        groups a new job needs, REQUESTS and placement's submissions consumer, that the dead node led,
        from the nodes' logs) and Loom's part after them; plus every group the node led."""
        victim, killed_at = result["done"]["node"], float(result["done"]["killed_at"])
        elections = nats_elections.elections_after(events, victim, killed_at)
        path = nats_elections.path_election_s(elections, PLACEMENT_PATH)
        from_kill = result.get("placement_stall_s")  # counted from the kill
        return {
            "elections": {
                g: {"elected_s": e.elected_s, "new_leader": e.new_leader} for g, e in elections.items()
            },
            "path_election_s": None if path == float("inf") else round(path, 2),
            "loom_part_s": None if from_kill is None or path == float("inf") else round(from_kill - path, 2),
        }

    async def inject(self, fault: Fault) -> dict[str, Any]:
        """Apply the fault; returns what was done. Ends when the fault ends (its ``released`` time)."""
        if fault.kind == "nats-node-sigkill":
            name = await self.cluster_node(fault.target)
            pid = self.server_pid(name)
            os.kill(pid, signal.SIGKILL)
            return {"node": name, "pid": pid, "killed_at": time.time()}
        if fault.kind in ("sigkill", "sigstop"):
            name, pid = await self.service_pid(fault)
            if fault.kind == "sigkill":
                os.kill(pid, signal.SIGKILL)
                return {"service": name, "pid": pid}
            return {"service": name, "pid": pid, "stopped_at": await self.hold([pid], fault.hold_s)}
        if fault.kind == "postgres-outage":
            pids = self._tree(self.server_pid("postgres"))
            return {"pids_stopped": len(pids), "stopped_at": await self.hold(pids, fault.hold_s)}
        if fault.kind == "nats-outage":
            pid = self.server_pid("nats")
            return {"pid": pid, "stopped_at": await self.hold([pid], fault.hold_s)}
        if fault.kind in ("postgres-sigkill", "nats-sigkill"):
            server = fault.kind.split("-")[0]
            pid = self.server_pid(server)
            os.kill(pid, signal.SIGKILL)
            return {"pid": pid}
        if fault.kind == "poison":
            return await self.poison(fault)
        if fault.kind == "redelivery":
            return await self.redeliver(fault)
        if fault.kind == "control":
            return {}
        raise ValueError(f"unknown fault kind {fault.kind}")

    async def poison(self, fault: Fault) -> dict[str, Any]:
        payloads = poison_payloads(fault.target, self.rng)
        js = self.nc.jetstream()
        sent = []
        for kind, data in payloads.items():
            msg_id = f"{INJECTED}poison-{fault.index}-{kind}"
            headers = {CHAOS_HEADER: f"poison {kind}", "Nats-Msg-Id": msg_id}
            if fault.target == link_subject(self.args.topology):  # core NATS: placement has no stream here
                await self.nc.publish(fault.target, data, headers=headers)
            else:
                await js.publish(fault.target, data, headers=headers)
            sent.append(kind)
        await self.nc.flush()
        return {"subject": fault.target, "payloads": sent}

    async def redeliver(self, fault: Fault) -> dict[str, Any]:
        """Republish the messages of up to 5 finished jobs: same ids, new ids, or new ids reversed."""
        by_job: dict[str, list[Captured]] = {}
        for c in self.captured:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                job_id = str(json.loads(c.data)["job_id"])
                if job_id.startswith(f"{PREFIX}-"):
                    by_job.setdefault(job_id, []).append(c)
        rows = await self.db(
            "SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1::text[]) AND state = 'completed'",
            list(by_job),
        )
        # The five most recent (by submission number) of the completed jobs still captured.
        chosen = sorted((str(r["job_id"]) for r in rows), key=lambda j: int(j.rsplit("-", 1)[1]))[-5:]
        before = {
            str(r["job_id"]): (str(r["state"]), int(r["attempt"])) for r in rows if r["job_id"] in chosen
        }
        js = self.nc.jetstream()
        sent = duplicates = 0
        for job_id in chosen:
            messages = list(by_job[job_id])
            if fault.target == "out-of-order":
                messages.reverse()
            for n, c in enumerate(messages):
                headers = dict(c.headers)
                if fault.target != "same-ids":
                    headers["Nats-Msg-Id"] = f"{INJECTED}{fault.target}-{fault.index}-{job_id}-{n}"
                headers[CHAOS_HEADER] = f"redelivery {fault.target}"
                ack = await js.publish(c.subject, c.data, headers=headers)
                sent += 1
                duplicates += bool(ack.duplicate)
        self.redelivered[fault.index] = before
        return {"jobs": chosen, "messages": sent, "dropped_by_stream_dedup": duplicates}

    redelivered: dict[int, dict[str, tuple[str, int]]]

    # ---- invariants --------------------------------------------------------------------------

    async def _sample(self) -> dict[str, Any]:
        """One look at the state: PostgreSQL's running jobs and active reservations, the agents' runs."""
        answers = await asyncio.gather(*(self.health(a, timeout_s=2.0) for a in self.agents))
        live: set[str] = set()
        over_agents: list[str] = []
        unanswered = []
        for agent, answer in zip(self.agents, answers, strict=True):
            if answer is None or "running_keys" not in answer:
                unanswered.append(agent)
                continue
            live.update(answer["running_keys"])
            over_agents += [f"{agent}/{n}" for n in answer.get("nodes_over_capacity", [])]
        running = await self.db("SELECT job_id, attempt FROM jobs WHERE state = 'running'")
        leaked = await self.db(
            """SELECT r.job_id, r.attempt, r.node, r.gpus, r.state,
                      j.state AS job_state, j.attempt AS job_attempt
               FROM reservations r LEFT JOIN jobs j USING (job_id)
               WHERE r.state <> 'released'
                 AND (j.job_id IS NULL OR j.state NOT IN ('placed', 'running') OR r.attempt <> j.attempt)"""
        )
        over_book = await self.db(
            "SELECT node, gpus_reserved, gpus_total FROM node_allocations WHERE gpus_reserved > gpus_total"
        )
        over_res = await self.db(
            """SELECT r.node, sum(r.gpus) AS held, n.gpus_total FROM reservations r
               JOIN node_allocations n USING (node) WHERE r.state <> 'released'
               GROUP BY r.node, n.gpus_total HAVING sum(r.gpus) > n.gpus_total"""
        )
        over_ledger = await self.db(
            "SELECT node, gpus_used, gpus_total FROM ledger_nodes WHERE gpus_used > gpus_total"
        )
        return {
            "stuck": (set() if unanswered else {f"{r['job_id']}:{r['attempt']}" for r in running} - live),
            "agents_unanswered": unanswered,
            "leaked": {f"{r['job_id']}:{r['attempt']}:{r['node']}" for r in leaked},
            "overbooked": sorted(
                [f"book {r['node']} {r['gpus_reserved']}/{r['gpus_total']}" for r in over_book]
                + [f"reservations {r['node']} {r['held']}/{r['gpus_total']}" for r in over_res]
                + [f"ledger {r['node']} {r['gpus_used']}/{r['gpus_total']}" for r in over_ledger]
                + [f"agent {n}" for n in over_agents]
            ),
        }

    async def check_state(self) -> dict[str, Any]:
        """Stuck runs and leaked reservations that persist over two samples; overbooking in either."""
        first = await self._sample()
        await asyncio.sleep(self.args.recheck_s)
        second = await self._sample()
        stuck = sorted(first["stuck"] & second["stuck"])
        leaked = sorted(first["leaked"] & second["leaked"])
        overbooked = sorted(set(first["overbooked"]) | set(second["overbooked"]))
        return {
            "stuck": len(stuck),
            "leaked": len(leaked),
            "overbooked": len(overbooked),
            "stuck_examples": stuck[:10],
            "leaked_examples": leaked[:10],
            "overbooked_examples": overbooked[:10],
            "agents_unanswered": sorted(set(first["agents_unanswered"]) | set(second["agents_unanswered"])),
        }

    async def jobs_outcome(self, job_ids: list[str]) -> dict[str, Any]:
        """Acknowledged submissions lost or run twice, from PostgreSQL (and the agents' live runs)."""
        rows = await self.db(
            "SELECT job_id, state, attempt, reason, finished_at FROM jobs WHERE job_id = ANY($1::text[])",
            job_ids,
        )
        by_id = {str(r["job_id"]): r for r in rows}
        rejected_events = {
            str(r["job_id"])
            for r in await self.db(
                "SELECT DISTINCT job_id FROM job_events WHERE kind = 'rejected' AND job_id = ANY($1::text[])",
                job_ids,
            )
        } | self.rejected_on_bus
        lost = []
        rejected = []
        unfinished = []
        states: dict[str, int] = {}
        for job_id in job_ids:
            row = by_id.get(job_id)
            if row is None:
                lost.append(job_id)
                continue
            state = str(row["state"])
            states[state] = states.get(state, 0) + 1
            if state in ("rejected", "cancelled"):
                if job_id in rejected_events:
                    rejected.append(f"{job_id}: {row['reason']}")
                else:
                    lost.append(job_id)
            elif state not in ("completed", "failed"):
                unfinished.append(f"{job_id}: {state}")
        started_twice = await self.db(
            f"""SELECT job_id, event->>'attempt' AS attempt, count(*) AS n FROM job_events
                WHERE kind = 'started' AND job_id = ANY($1::text[]) AND msg_id NOT LIKE '{INJECTED}%'
                GROUP BY 1, 2 HAVING count(*) > 1""",
            job_ids,
        )
        doubled = {f"{r['job_id']}: {r['n']} started for attempt {r['attempt']}" for r in started_twice}
        wanted = set(job_ids)
        for job_id, where in self.live_twice.items():
            if job_id in wanted:
                doubled.add(f"{job_id}: live at once as {', '.join(where)}")
        # A run live on an agent well after its job finished in PostgreSQL: run again.
        for key, seen in self.live_seen.items():
            job_id, _, attempt = key.rpartition(":")
            row = by_id.get(job_id)
            if row is None or row["finished_at"] is None or job_id not in wanted:
                continue
            last = max(seen.values())
            if last > row["finished_at"].timestamp() + LIVE_SLACK_S:
                doubled.add(
                    f"{job_id}: attempt {attempt} live on {', '.join(sorted(seen))} "
                    f"{last - row['finished_at'].timestamp():.1f} s after it finished ({row['state']})"
                )
        return {
            "acknowledged": len(job_ids),
            "lost": len(lost),
            "doubled": len(doubled),
            "rejected": len(rejected),
            "unfinished": len(unfinished),
            "states": states,
            "lost_examples": lost[:10],
            "doubled_examples": sorted(doubled)[:10],
            "rejected_examples": rejected[:10],
            "unfinished_examples": unfinished[:10],
        }

    async def dead_letters(self, since: float) -> list[dict[str, Any]]:
        letters = await DeadLetters(self.nc).entries()
        out = []
        for letter in letters:
            at = letter.time.timestamp() if letter.time else 0.0
            if at < since:
                continue
            injected = (letter.original_msg_id or "").startswith(INJECTED) or CHAOS_HEADER in letter.headers
            out.append(
                {
                    "at": at,
                    "seq": letter.seq,
                    "subject": letter.original_subject,
                    "consumer": letter.consumer,
                    "error_type": letter.error_type,
                    "msg_id": letter.original_msg_id,
                    "injected": injected,
                }
            )
        return out

    # ---- the campaign ------------------------------------------------------------------------

    async def run_fault(self, fault: Fault) -> dict[str, Any]:
        self.say(f"fault {fault.index}: {fault.kind} {fault.target} {fault.hold_s:g}s")
        settle_s, bad = await self.wait_healthy(SETTLE_TIMEOUT_S)
        if fault.kind == "nats-node-sigkill" and not await self.cluster_caught_up(CATCH_UP_TIMEOUT_S):
            self.say("the NATS cluster's replicas did not catch up before the kill")
        start = time.time()
        error = None
        done: dict[str, Any] = {}
        try:
            done = await self.inject(fault)
        except (RuntimeError, OSError, BusError, nats.errors.Error, asyncpg.PostgresError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        released = time.time()
        recovery = await self.recover(released)
        state = await self.check_state()
        changed = []
        for job_id, (was, attempt) in getattr(self, "redelivered", {}).get(fault.index, {}).items():
            rows = await self.db("SELECT state, attempt FROM jobs WHERE job_id = $1", job_id)
            now = (str(rows[0]["state"]), int(rows[0]["attempt"])) if rows else ("missing", 0)
            if now != (was, attempt):
                changed.append(f"{job_id}: {was}/{attempt} -> {now[0]}/{now[1]}")
        return {
            **fault.describe(),
            "group": fault.group,
            "done": done,
            "error": error,
            "healthy_before": settle_s is not None,
            "unhealthy_before": bad,
            "start": start,
            "released": released,
            "fault_s": round(released - start, 2),
            **recovery,
            "state_after": state,
            "redelivered_jobs_changed": changed,
        }

    async def campaign(
        self, plan: list[Fault], before_final: Callable[[str], Awaitable[None]] | None
    ) -> dict[str, Any]:
        self.redelivered = {}
        self.client = await LoomClient.connect(self.state["nats_url"], name="loom-bench-chaos")
        subs = [
            await self.nc.subscribe(subjects.JOBS_LIFECYCLE_ALL, cb=self.on_message),
            await self.nc.subscribe(subjects.JOBS_REPORTS_ALL, cb=self.on_message),
            *[
                await self.nc.subscribe(
                    subjects.cluster_commands(agent.removeprefix("agent-")), cb=self.on_message
                )
                for agent in self.agents
            ],
        ]
        stop = asyncio.Event()
        began = time.time()
        background = [
            asyncio.create_task(self.submit_loop(stop)),
            asyncio.create_task(self.live_loop(stop)),
        ]
        results: list[dict[str, Any]] = []
        try:
            self.say("warming up: waiting for the first placement")
            warm = await self.placed_after(0.0, SETTLE_TIMEOUT_S)
            if warm is None:
                raise RuntimeError("no job placed after warm-up")
            await asyncio.sleep(self.args.warmup_s)
            for fault in plan:
                results.append(await self.run_fault(fault))
                await asyncio.sleep(self.args.gap_s)
        finally:
            stop.set()
            await asyncio.gather(*background)
        self.say(f"draining: {len(self.acked)} acknowledged jobs")
        drain_started = time.perf_counter()
        job_ids = sorted(self.acked)
        while time.perf_counter() - drain_started < self.args.drain_s:
            rows = await self.db(
                "SELECT count(*) AS n FROM jobs WHERE job_id = ANY($1::text[]) "
                "AND state IN ('completed', 'failed', 'rejected', 'cancelled')",
                job_ids,
            )
            if int(rows[0]["n"]) == len(job_ids):
                break
            await asyncio.sleep(1.0)
        drain_s = time.perf_counter() - drain_started
        if before_final is not None:
            await before_final(self.database_url)
        # The live-run sampler has stopped: one more look for runs that came back after finishing.
        stop2 = asyncio.Event()
        sampler = asyncio.create_task(self.live_loop(stop2))
        final_state = await self.check_state()
        stop2.set()
        await sampler
        final_jobs = await self.jobs_outcome(job_ids)
        letters = await self.dead_letters(began)
        for sub in subs:
            await sub.unsubscribe()
        await self.client.close()
        # Per fault: the jobs acknowledged and the dead letters from its start to the next one's.
        bounds = [r["start"] for r in results] + [float("inf")]
        for i, result in enumerate(results):
            lo, hi = bounds[i], bounds[i + 1]
            window = [j for j, at in self.acked.items() if lo <= at < hi]
            outcome = await self.jobs_outcome(window)
            result["placement_stall_s"] = await self.placement_stall(result, lo)
            result["jobs"] = {k: outcome[k] for k in ("acknowledged", "lost", "doubled")} | {
                "lost_examples": outcome["lost_examples"],
                "doubled_examples": outcome["doubled_examples"],
            }
            mine = [d for d in letters if lo <= d["at"] < hi]
            result["dead_letters"] = {
                "count": len(mine),
                "injected": sum(d["injected"] for d in mine),
                "not_injected": [d for d in mine if not d["injected"]][:10],
            }
        self.split_stalls(results)
        return {
            "faults": results,
            "final_jobs": final_jobs,
            "final_state": final_state,
            "dead_letters": {
                "count": len(letters),
                "injected": sum(d["injected"] for d in letters),
                "not_injected": sum(not d["injected"] for d in letters),
                "not_injected_examples": [d for d in letters if not d["injected"]][:10],
            },
            "drain_s": round(drain_s, 1),
            "submit_retries": self.submit_retries,
        }


def _stats(values: list[float]) -> dict[str, float | None]:
    return p50_max_mean(values, digits=2)


def summarize(measured: dict[str, Any], plan: list[Fault]) -> dict[str, Any]:
    """Per fault kind: count, recovery times, anything lost, doubled, stuck, leaked or overbooked."""
    faults = measured["faults"]
    by_group: dict[str, dict[str, Any]] = {}
    for f in faults:
        g = by_group.setdefault(
            f["group"],
            {"faults": 0, "recovered": 0, "recovery": [], "stall": [], "lost": 0, "doubled": 0, "stuck": 0,
             "leaked": 0, "overbooked": 0, "dead_letters": 0, "dead_letters_not_injected": 0},
        )  # fmt: skip
        g["faults"] += 1
        g["recovered"] += bool(f["recovered"])
        if f["recovery_s"] is not None:
            g["recovery"].append(f["recovery_s"])
        if f.get("placement_stall_s") is not None:
            g["stall"].append(f["placement_stall_s"])
        if f.get("path_election_s") is not None:
            g.setdefault("election", []).append(f["path_election_s"])
        if f.get("loom_part_s") is not None:
            g.setdefault("loom_part", []).append(f["loom_part_s"])
        g["lost"] += f["jobs"]["lost"]
        g["doubled"] += f["jobs"]["doubled"]
        for key in ("stuck", "leaked", "overbooked"):
            g[key] += f["state_after"][key]
        g["dead_letters"] += f["dead_letters"]["count"]
        g["dead_letters_not_injected"] += f["dead_letters"]["count"] - f["dead_letters"]["injected"]
    for g in by_group.values():
        g["recovery_s"] = _stats(g.pop("recovery"))
        g["placement_stall_s"] = _stats(g.pop("stall"))
        if "election" in g:
            g["path_election_s"] = _stats(g.pop("election"))
        if "loom_part" in g:
            g["loom_part_s"] = _stats(g.pop("loom_part"))
    final_jobs, final_state = measured["final_jobs"], measured["final_state"]
    real = [f for f in faults if f["kind"] != "control"]
    controls = [f for f in faults if f["kind"] == "control"]
    headline = {
        "faults": len(real),
        "recovered": sum(bool(f["recovered"]) for f in real),
        "controls": len(controls),
        "acknowledged": final_jobs["acknowledged"],
        "lost": final_jobs["lost"],
        "doubled": final_jobs["doubled"],
        "stuck": final_state["stuck"],
        "leaked": final_state["leaked"],
        "overbooked": final_state["overbooked"],
        "stuck_after_faults": sum(f["state_after"]["stuck"] for f in faults),
        "leaked_after_faults": sum(f["state_after"]["leaked"] for f in faults),
        "overbooked_after_faults": sum(f["state_after"]["overbooked"] for f in faults),
        "unfinished": final_jobs["unfinished"],
        "rejected": final_jobs["rejected"],
        "dead_letters": measured["dead_letters"]["count"],
        "dead_letters_not_injected": measured["dead_letters"]["not_injected"],
        "redelivered_jobs_changed": sum(len(f["redelivered_jobs_changed"]) for f in faults),
        "recovery_s": _stats([f["recovery_s"] for f in real if f["recovery_s"] is not None]),
        "control_recovery_s": _stats([f["recovery_s"] for f in controls if f["recovery_s"] is not None]),
    }
    headline["pass"] = (
        all(f["recovered"] for f in faults)
        and all(
            headline[k] == 0
            for k in (
                "lost", "doubled", "stuck", "leaked", "overbooked", "stuck_after_faults",
                "leaked_after_faults", "overbooked_after_faults", "dead_letters_not_injected",
                "redelivered_jobs_changed", "unfinished",
            )
        )
    )  # fmt: skip
    return {"headline": headline, "by_kind": dict(sorted(by_group.items()))}


def not_available(nats_servers: int = 1) -> list[str]:
    """Fault sets a campaign on ``nats_servers`` nats-servers does not run, each with why."""
    if nats_servers > 1:
        return []
    if nats_cluster_available():
        why = "not in this run: it has one nats-server (run it with --nats-cluster 3 for the node kills)"
    else:
        why = "not available: this build's `loom up` has no --nats-cluster"
    return [f"nats cluster faults (kill one node, kill all three, partition one): {why}"]


def run(
    args: argparse.Namespace,
    progress: Callable[[str], None] | None = None,
    before_final: Callable[[str], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """Start a private stack, run the campaign, stop it; the JSON result.

    ``before_final(database_url)`` runs after the drain, before the final checks (tests use it to
    plant a defect the checks must find).
    """
    if args.faults is not None and args.faults < 1:
        raise OptionError(f"--faults must be at least 1, got {args.faults!r}")
    if not args.rate > 0:
        raise OptionError(f"--rate must be above 0 jobs/s, got {args.rate!r}")
    say = progress or (lambda _s: None)
    plan = build_plan(
        args.topology,
        args.seed,
        args.quick,
        args.faults,
        cluster_kills=args.cluster_kills if args.nats_cluster > 1 else 0,
        cluster_only=args.cluster_only,
    )
    home = Path(tempfile.mkdtemp(prefix="loom-bench-chaos-", dir="/tmp"))
    os.chmod(home, 0o755)  # PostgreSQL runs as an unprivileged user when we are root
    env_backup = {k: os.environ.pop(k) for k in ("LOOM_NATS_URL", "LOOM_DATABASE_URL") if k in os.environ}
    started = time.perf_counter()
    try:
        options = stack.StackOptions(
            topology=args.topology,
            time_scale=60.0,
            heartbeat_s=1.0,
            max_heartbeat_s=5.0,
            durable=True,
            nats_cluster=args.nats_cluster,
        )
        say("starting the stack")
        state = stack.up(home, options, progress=lambda s: say(f"stack: {s}"))
        campaign = Campaign(state, home, args, say)
        measured = asyncio.run(campaign.campaign(plan, before_final))
        services = sorted(state["services"])
        security = stack_security(home)
    finally:
        say("stopping the stack")
        stack.down(home)
        os.environ.update(env_backup)
        if getattr(args, "keep_home", False):
            say(f"kept the stack's home (logs, NATS stores): {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    summary = summarize(measured, plan)
    return {
        "benchmark": "chaos",
        **summary,
        "security": security,
        "not_available": not_available(args.nats_cluster),
        "final_jobs": measured["final_jobs"],
        "final_state": measured["final_state"],
        "dead_letters": measured["dead_letters"],
        "faults": measured["faults"],
        "drain_s": measured["drain_s"],
        "submit_retries": measured["submit_retries"],
        "method": {
            "recovery_s": "from the fault's end (the kill, the SIGCONT, the last message sent) until a job "
            "acknowledged after it is placed in PostgreSQL and every service answers health with status ok",
            "placement_stall_s": "from the fault's start (a node kill: the kill) until the first placement "
            "of a job acknowledged after it (placed_at in PostgreSQL): what the fault cost placement, holds "
            "included",
            "path_election_s": "nats-node-sigkill: from the kill until the last of the REQUESTS stream and "
            "placement's submissions consumer that the dead node led had a new leader (the nodes' logs); 0 "
            "when it led neither: the server's Raft election, 4-9 s after the last heartbeat",
            "loom_part_s": "nats-node-sigkill: placement stall (counted from the kill) minus "
            "path_election_s: what Loom (clients, placement) adds after the elections",
            "elections": "nats-node-sigkill: every Raft group the dead node led, seconds until a survivor "
            "led it",
            "control": f"{CONTROLS} rounds with no fault, measured the same way: the pace of a healthy stack "
            "(control_recovery_s); not counted in faults",
            "lost": "an acknowledged submission with no jobs row, or rejected/cancelled with no rejection "
            "event (job_events or the bus)",
            "doubled": "two started events (not injected) for one attempt, a job live on two agents (or "
            f"in two attempts) at once, or live on an agent over {LIVE_SLACK_S:g} s after it finished",
            "stuck": "jobs running in PostgreSQL with no live run on any agent, in two looks "
            f"{STUCK_RECHECK_S:g} s apart",
            "leaked": "reservations not released whose job is not placed/running in that attempt, in two "
            f"looks {STUCK_RECHECK_S:g} s apart",
            "overbooked": "node_allocations reserved > total, active reservations > total, ledger_nodes "
            "used > total, or an agent's nodes_over_capacity",
            "postgres-outage": "the postmaster and every backend SIGSTOPped, SIGCONT after hold_s",
            "nats-outage": "nats-server SIGSTOPped, SIGCONT after hold_s",
            "nats-node-sigkill": "with --nats-cluster 3: the node leading REQUESTS, the leases bucket, the "
            "JetStream meta group, or none of them SIGKILLed once every replica is current; the supervisor "
            "restarts it",
            "poison": f"{', '.join(POISON_KINDS)} on the subject, ids {INJECTED}poison-*",
            "redelivery": "the captured lifecycle messages and commands of up to 5 completed jobs "
            "republished: same-ids (their own Nats-Msg-Id), new-ids, out-of-order (new ids, reverse order)",
        },
        "config": {
            "topology": args.topology,
            "seed": args.seed,
            "quick": args.quick,
            "rate_per_s": args.rate,
            "nats_cluster": args.nats_cluster,
            "job_steps": args.job_steps,
            "time_scale": 60.0,
            "services": services,
            "plan": [f.describe() for f in plan],
        },
        "environment": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``loom bench chaos``."""
    parser.add_argument(
        "--faults", type=int, default=None, help="run the first N faults of the plan (default all)"
    )
    parser.add_argument("--seed", type=int, default=7, help="order of the faults and their targets")
    parser.add_argument("--quick", action="store_true", help=f"every hold and outage {QUICK_HOLD_S:g} s")
    parser.add_argument("--rate", type=float, default=3.0, help="jobs submitted per second throughout")
    parser.add_argument("--job-steps", type=int, default=4, help="steps of 60 simulated s (1 s real) per job")
    parser.add_argument("--topology", default="small")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="jobs flowing before the first fault")
    parser.add_argument("--gap-s", type=float, default=2.0, help="pause after each fault's checks")
    parser.add_argument(
        "--drain-s", type=float, default=180.0, help="longest wait for the last jobs to finish"
    )
    parser.add_argument(
        "--recheck-s",
        type=float,
        default=STUCK_RECHECK_S,
        help="a stuck run or leaked reservation counts only if still there this much later",
    )
    parser.add_argument(
        "--nats-cluster", type=int, default=1, help="3: run on a 3-node NATS cluster (R3) with its node kills"
    )
    parser.add_argument(
        "--cluster-kills", type=int, default=2, help="with --nats-cluster 3: SIGKILLs of each node role"
    )
    parser.add_argument(
        "--cluster-only", action="store_true", help="with --nats-cluster 3: only the node kills and controls"
    )
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument(
        "--keep-home", action="store_true", help="keep the stack's temporary home (its logs) after the run"
    )


def print_table(result: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="chaos campaign by fault kind", box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ("kind", "faults", "recovered", "recovery p50/max s", "lost", "doubled", "stuck", "leaked",
            "overbooked", "DLQ (not injected)")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for kind, g in result["by_kind"].items():
        r = g["recovery_s"]
        table.add_row(
            kind, str(g["faults"]), str(g["recovered"]), f"{r['p50']}/{r['max']}", str(g["lost"]),
            str(g["doubled"]),
            str(g["stuck"]), str(g["leaked"]), str(g["overbooked"]),
            f"{g['dead_letters']} ({g['dead_letters_not_injected']})",
        )  # fmt: skip
    console = Console(stderr=True)
    console.print(table)
    console.print(json.dumps(result["headline"]))
    for line in result["not_available"]:
        console.print(line)


def main(args: argparse.Namespace) -> int:
    """``loom bench chaos``: JSON on stdout, a table on stderr unless ``--json``; progress on stderr."""
    if args.list:
        plan = build_plan(
            args.topology,
            args.seed,
            args.quick,
            args.faults,
            cluster_kills=args.cluster_kills if args.nats_cluster > 1 else 0,
            cluster_only=args.cluster_only,
        )
        print(
            json.dumps(
                {
                    "plan": [f.describe() | {"group": f.group} for f in plan],
                    "not_available": not_available(args.nats_cluster),
                },
                indent=2,
            )
        )
        return 0
    try:
        result = run(
            args,
            progress=lambda s: print(f"[chaos {time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True),
        )
    except OptionError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if not args.json:
        print_table(result)
    sys.stdout.flush()
    return 0

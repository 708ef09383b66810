"""A cluster agent's commands on real NATS: member parts, slowdown and workers, resize, stop,
refused starts and delayed starts.

The agent runs in this process on the "small" topology's c-weu-a (T4 nodes of 4 and 2 GPUs, P100
nodes of 2), at reference speed, so a run's simulated seconds are exactly
``steps * step_time_s * slowdown / (workers / spec.workers)``. The test watches heartbeats and job
events on core subscriptions and knows a command was handled when the agent's consumer acked it.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import PubAck
from nats.js.errors import NotFoundError
from structlog.testing import capture_logs
from waiting import until

from loom.bus import Delivery, Publisher
from loom.bus.connection import connect
from loom.model.topology import Cluster, load_topology
from loom.runtime.servers import NatsServer
from loom.runtime.service import ServiceContext, close_context, open_context
from loom_proto import subjects
from loom_proto.clusters import ClusterCommand, ClusterHeartbeat, ResizeJob, StartJob, StartJobs, StopJob
from loom_proto.codec import encode
from loom_proto.jobs import JobCompleted, JobSpec, NodeAllocation, Resources, Work
from loom_proto.subjects import ClusterCommandKind
from loom_services.cluster_agent.agent import Agent, read_journal
from loom_services.cluster_agent.backend import PartLaunch, PartStatus, Phase
from loom_services.cluster_agent.sim import SimCluster

CLUSTER = "c-weu-a"
BIG_T4 = "openb-node-0243"  # 4 T4
T4_A, T4_B, T4_C = "openb-node-0522", "openb-node-0783", "openb-node-0945"  # 2 T4 each
P100 = "openb-node-0123"  # 2 P100
TIME_SCALE = 1000.0


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS of this module's own: the agent's durable consumer starts from a clean stream."""
    with NatsServer(tmp_path_factory.mktemp("agent-nats")) as server:
        yield server.url


@dataclass
class Seen:
    """What the test saw on the bus: the cluster's nodes as heartbeats tell them, and job events."""

    used: dict[str, int] = field(default_factory=dict)
    running_jobs: list[str] = field(default_factory=list)
    epoch: int = 0
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    msg_ids: list[tuple[str, str, str]] = field(default_factory=list)
    """(kind, job, Nats-Msg-Id) of every job event, in order."""
    statuses: list[dict[str, Any]] = field(default_factory=list)

    def kinds(self, job_id: str) -> list[str]:
        return [kind for kind, e in self.events if e["job_id"] == job_id]

    def ids(self, job_id: str, kind: str) -> list[str]:
        return [msg_id for k, j, msg_id in self.msg_ids if k == kind and j == job_id]

    def event(self, job_id: str, kind: str) -> dict[str, Any] | None:
        return next((e for k, e in self.events if k == kind and e["job_id"] == job_id), None)


@dataclass
class Harness:
    """One agent of c-weu-a (restartable on its state dir) and a client connection commanding it."""

    nats_url: str
    state_dir: Path
    nc: Client
    publisher: Publisher
    seen: Seen
    agent: Agent | None = None
    task: asyncio.Task[None] | None = None
    ctx: ServiceContext | None = None

    async def start_agent(self, agent_class: type[Agent] = Agent, backend: SimCluster | None = None) -> Agent:
        self.ctx = await open_context(f"agent-{CLUSTER}", nats_url=self.nats_url, database_url=None)
        cluster = load_topology("small").cluster(CLUSTER)
        self.agent = agent_class(
            self.ctx,
            backend or SimCluster(cluster),
            region=cluster.region,
            time_scale=TIME_SCALE,
            heartbeat_s=0.05,
            max_heartbeat_s=0.2,
            state_dir=self.state_dir,
        )
        self.task = asyncio.create_task(self.agent.run())
        return self.agent

    async def stop_agent(self) -> None:
        assert self.task is not None and self.ctx is not None
        self.ctx.stopping.set()
        await asyncio.wait_for(self.task, timeout=15)
        await close_context(self.ctx)
        self.task = self.ctx = None

    async def command(self, message: StartJob | StartJobs | StopJob | ResizeJob) -> PubAck:
        """Publish a command (each under a new id: a repeat is the agent's to ignore, not the stream's)."""
        kinds: dict[type[Any], ClusterCommandKind] = {
            StartJob: "start",
            StartJobs: "starts",
            StopJob: "stop",
            ResizeJob: "resize",
        }
        kind = kinds[type(message)]
        return await self.publisher.publish(
            subjects.cluster_command(CLUSTER, kind),
            message,
            msg_id=f"test-{uuid.uuid4().hex}",
        )

    async def handled(self, ack: PubAck) -> None:
        """Wait until the agent acknowledged the command (its handler has finished)."""

        async def acked() -> bool:
            info = await self.nc.jetstream().consumer_info("CLUSTERS", f"agent-{CLUSTER}")
            return info.ack_floor is not None and (info.ack_floor.stream_seq or 0) >= ack.seq

        # The consumer does not exist until the first agent has started.
        await until(acked, 10, f"the agent to handle command #{ack.seq}", retry_on=(NotFoundError,))

    async def heartbeat_shows(
        self, used: dict[str, int], *, running: set[str], absent: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """Wait for heartbeats to show these nodes with these GPUs used and these jobs running."""

        async def check() -> bool:
            return (
                all(self.seen.used.get(n) == g for n, g in used.items())
                and running <= set(self.seen.running_jobs)
                and not absent & set(self.seen.running_jobs)
            )

        await until(check, 10, f"a heartbeat with {used}, running {running}, not running {absent}")

    def journal(self) -> list[dict[str, Any]]:
        return list(read_journal(self.state_dir / f"agent-{CLUSTER}.jsonl"))


@pytest.fixture
async def h(nats_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    """A running agent with a fresh state dir, and what the test sees of it."""
    nc = await connect(nats_url, "agent-commands-test")
    seen = Seen()

    async def on_heartbeat(msg: Msg) -> None:
        beat = msgspec.json.decode(msg.data, type=ClusterHeartbeat)
        if beat.agent_epoch != seen.epoch or beat.full:
            seen.epoch = beat.agent_epoch
            seen.used = {}
        seen.used.update({n.node: n.gpus_used for n in beat.nodes})
        seen.running_jobs = beat.running_jobs

    async def on_event(msg: Msg) -> None:
        kind, event = msg.subject.split(".")[2], json.loads(msg.data)
        seen.events.append((kind, event))
        seen.msg_ids.append((kind, event["job_id"], (msg.headers or {}).get("Nats-Msg-Id", "")))

    async def on_status(msg: Msg) -> None:
        seen.statuses.append(json.loads(msg.data))

    await nc.subscribe(subjects.cluster_heartbeat(CLUSTER), cb=on_heartbeat)
    await nc.subscribe(f"{subjects.PREFIX}.jobs.>", cb=on_event)
    await nc.subscribe(subjects.cluster_status(CLUSTER), cb=on_status)
    h = Harness(nats_url, tmp_path, nc, Publisher(nc), seen)
    await h.start_agent()
    yield h
    if h.task is not None:
        await h.stop_agent()
    await nc.close()


def start(
    job_id: str,
    allocations: dict[str, int],
    *,
    steps: int = 10,
    step_time_s: float = 10.0,
    spec_workers: int = 1,
    gpu_model: str = "T4",
    **extra: Any,
) -> StartJob:
    spec = JobSpec(
        job_id=job_id,
        tenant="t1",
        workers=spec_workers,
        work=Work(steps=steps, step_time_s=step_time_s),
    )
    return StartJob(
        job_id=job_id,
        spec=spec,
        gpu_model=gpu_model,
        allocations=[NodeAllocation(node=n, gpus=g) for n, g in allocations.items()],
        **extra,
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def completed(h: Harness, job_id: str, timeout_s: float = 15) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        return h.seen.event(job_id, "completed")

    result: dict[str, Any] = await until(check, timeout_s, f"{job_id} completed")
    return result


async def test_a_member_part_holds_its_gpus_publishes_no_event_and_frees_them_on_stop(h: Harness) -> None:
    member, sentinel = unique("member"), unique("sentinel")
    # A lead with this work would finish in 1 ms of wall time; the member must not run at all.
    await h.handled(await h.command(start(member, {BIG_T4: 4}, steps=1, step_time_s=1.0, role="member")))
    await h.heartbeat_shows({BIG_T4: 4}, running={member})
    # Events of one agent arrive in order: once a later lead has completed, anything the member
    # published would have been seen.
    await h.command(start(sentinel, {T4_A: 2}, steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(member) == []
    assert h.seen.used[BIG_T4] == 4 and member in h.seen.running_jobs, "a member runs until it is stopped"

    await h.handled(await h.command(StopJob(job_id=member, reason="job done")))
    await h.heartbeat_shows({BIG_T4: 0}, running=set(), absent={member})
    stopped_lead = unique("stopped")
    await h.command(start(stopped_lead, {T4_B: 2}, steps=100, step_time_s=1000.0))
    await until(lambda: _true(h.seen.event(stopped_lead, "started")), 10, "the later lead started")
    assert h.seen.kinds(member) == [], "a stopped member reports nothing either"


async def test_a_restarted_agent_keeps_holding_a_member_parts_gpus(h: Harness) -> None:
    member = unique("member")
    await h.handled(await h.command(start(member, {T4_C: 2}, role="member")))
    await h.heartbeat_shows({T4_C: 2}, running={member})
    await h.stop_agent()
    agent = await h.start_agent()
    await until(lambda: _true(h.seen.epoch == agent.epoch), 10, "a heartbeat of the restarted agent")
    await h.heartbeat_shows({T4_C: 2}, running={member})
    # Its health answer lists the restored run (computed when asked).
    reply = await h.nc.request(subjects.service_health(f"agent-{CLUSTER}"), b"", timeout=2.0)
    health = json.loads(reply.data)
    assert (health["running"], health["running_keys"], health["nodes_over_capacity"]) == (
        1,
        [f"{member}:1"],
        [],
    )
    await h.handled(await h.command(StopJob(job_id=member)))
    await h.heartbeat_shows({T4_C: 0}, running=set(), absent={member})
    assert h.seen.kinds(member) == []
    reply = await h.nc.request(subjects.service_health(f"agent-{CLUSTER}"), b"", timeout=2.0)
    assert json.loads(reply.data)["running_keys"] == []


async def test_a_stopped_lead_frees_its_gpus_and_reports_failed_once_and_nothing_after(h: Harness) -> None:
    lead, sentinel = unique("lead"), unique("sentinel")
    await h.command(start(lead, {BIG_T4: 4}, steps=1000, step_time_s=1000.0))  # 1000 s of wall time
    await until(lambda: _true(h.seen.event(lead, "started")), 10, "the lead started")
    await h.heartbeat_shows({BIG_T4: 4}, running={lead})
    await h.handled(await h.command(StopJob(job_id=lead, reason="preempted")))
    await h.heartbeat_shows({BIG_T4: 0}, running=set(), absent={lead})
    await h.command(start(sentinel, {T4_A: 2}, steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(lead) == ["started", "failed"]
    assert h.seen.event(lead, "failed")["retryable"] is True  # type: ignore[index]
    assert h.seen.event(lead, "failed")["stopped"] is True  # type: ignore[index]  # Loom stopped it: no fault


async def test_a_run_takes_slowdown_times_longer_and_speeds_with_its_share_of_workers(h: Harness) -> None:
    steps, step_time_s, gpus = 10, 20.0, 2
    # (slowdown, workers given, workers asked for, how many times the compute time the run takes)
    # (each run's GPUs are its workers' here, one a worker: an elastic job grown to 2 of 1 asked)
    cases = [(1.0, None, 1, 1.0), (2.0, None, 1, 2.0), (1.0, 1, 2, 2.0), (3.0, 2, 4, 6.0), (1.0, 2, 1, 0.5)]
    nodes = [{BIG_T4: gpus}, {BIG_T4: gpus}, {T4_A: gpus}, {T4_B: gpus}, {T4_C: gpus}]
    job_ids = [unique("timed") for _ in cases]
    for job_id, (slowdown, workers, spec_workers, _), allocations in zip(job_ids, cases, nodes, strict=True):
        await h.command(
            start(
                job_id,
                allocations,
                steps=steps,
                step_time_s=step_time_s,
                spec_workers=spec_workers,
                slowdown=slowdown,
                workers=workers,
            )
        )
    for job_id, (*_, factor) in zip(job_ids, cases, strict=True):
        done = await completed(h, job_id)
        # GPU-seconds are the run's simulated duration times its GPUs: exact, not a timing.
        assert done["gpu_seconds"] == pytest.approx(steps * step_time_s * factor * gpus, rel=1e-9), factor
        # Delivered speed is per-GPU compute: slowdown and workers must not teach metrics distrust.
        assert done["delivered_speed"] == pytest.approx(1.0)


async def test_a_run_checkpoints_as_often_as_its_job_asks_not_only_at_each_tenth(h: Harness) -> None:
    job_id = unique("ckpt")
    command = start(job_id, {BIG_T4: 1}, steps=30, step_time_s=1.0)
    spec = msgspec.structs.replace(
        command.spec, work=Work(steps=30, step_time_s=1.0, checkpoint_every_steps=2)
    )
    await h.command(msgspec.structs.replace(command, spec=spec))
    await completed(h, job_id)
    steps = [e["step"] for kind, e in h.seen.events if kind == "checkpointed" and e["job_id"] == job_id]
    # Every 2 steps (chunks of a tenth, 3 steps, checkpointed at 3, 6, 9, ... only).
    assert steps == list(range(2, 31, 2))


def test_the_sim_stretches_a_steps_time_by_slowdown_and_shrinks_it_with_workers() -> None:
    sim = SimCluster(load_topology("small").cluster(CLUSTER))
    base = sim.wall_seconds(10, 5.0, "T4", "training_compute", 100.0)
    assert sim.wall_seconds(10, 5.0, "T4", "training_compute", 100.0, slowdown=2.0) == pytest.approx(2 * base)
    assert sim.wall_seconds(10, 5.0, "T4", "training_compute", 100.0, worker_share=0.5) == pytest.approx(
        2 * base
    )
    assert sim.step_seconds(5.0, "T4", "training_compute", slowdown=3.0, worker_share=2.0) == pytest.approx(
        7.5
    )


async def test_a_resize_moves_gpus_changes_speed_keeps_progress_and_a_repeat_changes_nothing(
    h: Harness,
) -> None:
    job_id = unique("elastic")
    steps, step_time_s = 100, 30.0  # 3 s of wall time with all 4 workers, 6 s with 2
    await h.command(start(job_id, {T4_A: 2}, steps=steps, step_time_s=step_time_s, spec_workers=4, workers=2))
    await until(lambda: _true(h.seen.event(job_id, "progress")), 10, "the first progress")
    assert h.agent is not None
    run = h.agent.running[f"{job_id}:1"]
    assert h.agent.step_seconds(run) == pytest.approx(2 * step_time_s)

    grow = ResizeJob(
        job_id=job_id,
        workers=4,
        allocations=[NodeAllocation(node=T4_A, gpus=2), NodeAllocation(node=T4_B, gpus=2)],
    )
    await h.handled(await h.command(grow))
    step_at_resize = run.step
    await h.heartbeat_shows({T4_A: 2, T4_B: 2}, running={job_id})
    assert h.agent.step_seconds(run) == pytest.approx(step_time_s), "twice the workers, twice the speed"
    assert run.step >= step_at_resize, "progress is kept"

    await h.handled(await h.command(grow))  # the same resize again
    assert run.workers == 4 and run.allocations == [(T4_A, 2), (T4_B, 2)]
    assert h.agent.backend.nodes[T4_A].gpus_used == 2 and h.agent.backend.nodes[T4_B].gpus_used == 2
    resizes = [e for e in h.journal() if e["op"] == "resize" and e["key"] == f"{job_id}:1"]
    assert len(resizes) == 1, "a repeated resize is not even journaled"

    done = await completed(h, job_id)
    # Every step costs 4 reference GPU-seconds whatever the size (2 GPUs at half speed, or 4 at
    # full), so the total shows all steps were done exactly once, across the resize.
    assert done["gpu_seconds"] == pytest.approx(steps * step_time_s * 4, rel=1e-6)
    progress = [e["step"] for k, e in h.seen.events if k == "progress" and e["job_id"] == job_id]
    assert progress == sorted(progress) and progress[-1] < steps
    await h.heartbeat_shows({T4_A: 0, T4_B: 0}, running=set(), absent={job_id})


async def test_a_restarted_agent_keeps_a_runs_resized_allocation(h: Harness) -> None:
    job_id = unique("elastic")
    await h.handled(
        await h.command(start(job_id, {T4_A: 2}, steps=100, step_time_s=1000.0, spec_workers=2, workers=1))
    )
    shrink_grow = ResizeJob(job_id=job_id, workers=2, allocations=[NodeAllocation(node=BIG_T4, gpus=4)])
    await h.handled(await h.command(shrink_grow))
    await h.heartbeat_shows({T4_A: 0, BIG_T4: 4}, running={job_id})
    await h.stop_agent()
    agent = await h.start_agent()
    await until(lambda: _true(h.seen.epoch == agent.epoch), 10, "a heartbeat of the restarted agent")
    await h.heartbeat_shows({T4_A: 0, BIG_T4: 4}, running={job_id})
    assert agent.running[f"{job_id}:1"].workers == 2
    await h.handled(await h.command(StopJob(job_id=job_id)))
    await h.heartbeat_shows({BIG_T4: 0}, running=set(), absent={job_id})


async def test_a_resize_of_an_unknown_run_is_ignored_and_one_that_does_not_fit_leaves_the_run_as_it_was(
    h: Harness,
) -> None:
    job_id = unique("elastic")
    await h.handled(
        await h.command(start(job_id, {T4_A: 2}, steps=100, step_time_s=1000.0, spec_workers=2, workers=1))
    )
    with capture_logs() as logs:
        await h.handled(
            await h.command(
                ResizeJob(job_id="nobody", workers=2, allocations=[NodeAllocation(node=T4_B, gpus=2)])
            )
        )
        await h.handled(
            await h.command(
                ResizeJob(
                    job_id=job_id, attempt=2, workers=2, allocations=[NodeAllocation(node=T4_B, gpus=2)]
                )
            )
        )
    ignored = [e for e in logs if e["event"] == "resize of a run not here ignored"]
    assert [(e["job_id"], e["attempt"]) for e in ignored] == [("nobody", 1), (job_id, 2)]
    assert h.agent is not None and h.agent.backend.nodes[T4_B].gpus_used == 0

    # P100s are not the run's model: the agent refuses and says so on the cluster's status subject.
    onto_p100 = ResizeJob(
        job_id=job_id,
        workers=2,
        allocations=[NodeAllocation(node=T4_A, gpus=2), NodeAllocation(node=P100, gpus=2)],
    )
    with capture_logs() as logs:
        await h.handled(await h.command(onto_p100))
    await until(lambda: _true(any(s["job_id"] == job_id for s in h.seen.statuses)), 10, "the refusal")
    refused = [e for e in logs if e["event"] == "resize refused"]
    assert [(e["job_id"], e["attempt"]) for e in refused] == [(job_id, 1)]
    assert "P100" in refused[0]["reason"]
    run = h.agent.running[f"{job_id}:1"]
    assert run.workers == 1 and run.allocations == [(T4_A, 2)]
    assert h.agent.backend.nodes[P100].gpus_used == 0
    await h.handled(await h.command(StopJob(job_id=job_id)))


async def failed(h: Harness, job_id: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        return h.seen.event(job_id, "failed")

    result: dict[str, Any] = await until(check, 10, f"{job_id} failed")
    return result


async def test_a_member_part_that_cannot_start_fails_its_attempt_retryably_under_an_id_of_its_own(
    h: Harness,
) -> None:
    holder, busy, lost = unique("holder"), unique("busy"), unique("lost")
    await h.handled(await h.command(start(holder, {BIG_T4: 4}, role="member")))
    await h.handled(await h.command(start(busy, {BIG_T4: 2}, role="member", attempt=3)))
    await h.handled(await h.command(start(lost, {"no-such-node": 2}, role="member", attempt=2)))

    for job_id, attempt, why in [(busy, 3, "0 free GPUs, 2 asked"), (lost, 2, "not part of cluster")]:
        event = await failed(h, job_id)
        assert event["cluster"] == CLUSTER and event["attempt"] == attempt and event["tenant"] == "t1"
        assert event["retryable"] is True, "placement must give the attempt up and place the job again"
        assert event["reason"].startswith(f"member part on {CLUSTER} could not start: ")
        assert why in event["reason"]
        # Not the lead's id: the lead's own failure of the attempt must not be dropped as a duplicate.
        assert h.seen.ids(job_id, "failed") == [f"{job_id}:failed:{attempt}:{CLUSTER}"]
        await until(lambda j=job_id: _true(any(s["job_id"] == j for s in h.seen.statuses)), 10, "the status")
        assert h.seen.kinds(job_id) == ["failed"]
    assert h.agent is not None and h.agent.backend.nodes[BIG_T4].gpus_used == 4, "the holder keeps its GPUs"
    await h.handled(await h.command(StopJob(job_id=holder)))
    await h.heartbeat_shows({BIG_T4: 0}, running=set(), absent={holder, busy, lost})


async def test_a_lead_that_cannot_start_fails_its_attempt_retryably_and_stays_refused_after_a_restart(
    h: Harness,
) -> None:
    lead, sentinel = unique("lead"), unique("sentinel")
    command = start(lead, {P100: 2})  # asks for T4 on a P100 node
    await h.handled(await h.command(command))
    event = await failed(h, lead)
    assert event["retryable"] is True and event["cluster"] == CLUSTER and event["attempt"] == 1
    assert event["reason"].startswith("cannot start: ") and "P100" in event["reason"]
    assert h.seen.ids(lead, "failed") == [f"{lead}:failed:1"]
    assert {"op": "finish", "key": f"{lead}:1"} in h.journal()

    await h.stop_agent()
    agent = await h.start_agent()
    with capture_logs() as logs:
        await h.handled(await h.command(command))  # the same command, delivered again
    assert [e["job_id"] for e in logs if e["event"] == "start of a finished run refused"] == [lead]
    await h.command(start(sentinel, {T4_A: 2}, steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(lead) == ["failed"], "a refused attempt is refused without a word"
    assert agent.backend.nodes[P100].gpus_used == 0


async def test_a_stop_for_a_run_not_here_is_remembered_across_a_restart_and_refuses_its_late_start(
    h: Harness,
) -> None:
    job_id, sentinel = unique("overtaken"), unique("sentinel")
    await h.handled(await h.command(StopJob(job_id=job_id, attempt=2, reason="placement gave up")))
    assert {"op": "finish", "key": f"{job_id}:2"} in h.journal()
    await h.stop_agent()
    agent = await h.start_agent()
    await until(lambda: _true(h.seen.epoch == agent.epoch), 10, "a heartbeat of the restarted agent")
    assert f"{job_id}:2" in agent.finished

    with capture_logs() as logs:
        await h.handled(await h.command(start(job_id, {T4_A: 2}, attempt=2)))
    refused = [e for e in logs if e["event"] == "start of a finished run refused"]
    assert [(e["job_id"], e["attempt"]) for e in refused] == [(job_id, 2)]
    assert f"{job_id}:2" not in agent.running and agent.backend.nodes[T4_A].gpus_used == 0
    await h.command(start(sentinel, {T4_B: 2}, steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(job_id) == [], "the given-up attempt neither starts nor fails"

    # Only that attempt: the next one starts.
    await h.command(start(job_id, {T4_A: 2}, attempt=3, steps=10, step_time_s=20.0))
    assert (await completed(h, job_id))["attempt"] == 3


async def test_a_start_of_the_next_attempt_before_the_old_ones_stop_supersedes_it_and_is_not_refused(
    h: Harness,
) -> None:
    """A failover re-places a cross-cluster gang on the same GPUs its old attempt's member part
    holds on a live cluster; the old attempt's stop can come after the new start (its first
    publish failed and the outbox sent it later). Placement gives an attempt up before it places
    the next, so the start stops the older attempt here and starts (before: refused against the
    old part's GPUs, and the next attempt avoided this cluster)."""
    gang, sentinel = unique("gang"), unique("sentinel")
    await h.handled(await h.command(start(gang, {BIG_T4: 4}, role="member", attempt=1)))
    await h.heartbeat_shows({BIG_T4: 4}, running={gang})
    await h.handled(await h.command(start(gang, {BIG_T4: 4}, role="member", attempt=2)))
    assert h.agent is not None
    assert set(h.agent.running) == {f"{gang}:2"} and f"{gang}:1" in h.agent.finished
    assert h.agent.backend.nodes[BIG_T4].gpus_used == 4  # attempt 2's, not both
    # The late stop of attempt 1 changes nothing; a late start of attempt 1 is refused too.
    await h.handled(await h.command(StopJob(job_id=gang, attempt=1, reason="cluster failed")))
    with capture_logs() as logs:
        await h.handled(await h.command(start(gang, {T4_C: 2}, role="member", attempt=1)))
    assert {k for k in h.agent.running if k.startswith(gang)} == {f"{gang}:2"}
    assert [e["event"] for e in logs if e.get("job_id") == gang] == ["start of a finished run refused"]
    await h.command(start(sentinel, {P100: 2}, gpu_model="P100", steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(gang) == [], "no refusal reported: attempt 2 was never refused"
    await h.handled(await h.command(StopJob(job_id=gang, attempt=2)))
    await h.heartbeat_shows({BIG_T4: 0}, running=set(), absent={gang})


async def test_a_start_of_an_attempt_older_than_the_one_running_here_is_refused_without_a_word(
    h: Harness,
) -> None:
    job_id, sentinel = unique("late"), unique("sentinel")
    await h.handled(await h.command(start(job_id, {T4_A: 2}, role="member", attempt=3)))
    with capture_logs() as logs:
        await h.handled(await h.command(start(job_id, {T4_B: 2}, role="member", attempt=2)))
    assert [e["event"] for e in logs if e.get("job_id") == job_id] == [
        "start of a superseded attempt refused"
    ]
    assert h.agent is not None and {k for k in h.agent.running if k.startswith(job_id)} == {f"{job_id}:3"}
    assert h.agent.backend.nodes[T4_B].gpus_used == 0
    await h.command(start(sentinel, {P100: 2}, gpu_model="P100", steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(job_id) == []
    await h.handled(await h.command(StopJob(job_id=job_id, attempt=3)))


async def test_a_delayed_start_holds_its_gpus_reports_started_when_the_wait_ends_and_times_only_the_work(
    h: Harness,
) -> None:
    job_id = unique("delayed")
    steps, step_time_s, start_after_s = 10, 20.0, 3000.0  # 3 s of wall time waiting, 0.2 s working
    sent_at = time.time()
    await h.handled(
        await h.command(
            start(job_id, {T4_A: 2}, steps=steps, step_time_s=step_time_s, start_after_s=start_after_s)
        )
    )
    assert h.agent is not None
    run = h.agent.running[f"{job_id}:1"]
    assert run.waiting and run.start_at >= sent_at + start_after_s / TIME_SCALE
    start_at = run.start_at
    await h.heartbeat_shows({T4_A: 2}, running={job_id})  # held while waiting

    done = await completed(h, job_id)
    started = h.seen.event(job_id, "started")
    assert started is not None and started["started_at"] >= start_at - 0.01, "started when the wait ended"
    kinds = h.seen.kinds(job_id)
    assert kinds[0] == "started" and kinds[-1] == "completed" and kinds.count("started") == 1
    # GPU-seconds count the work only, not the wait.
    assert done["gpu_seconds"] == pytest.approx(steps * step_time_s * 2, rel=1e-9)
    assert {"op": "began", "key": f"{job_id}:1"} in h.journal()
    await h.heartbeat_shows({T4_A: 0}, running=set(), absent={job_id})


async def test_a_stop_during_a_delayed_starts_wait_frees_the_gpus_and_reports_only_the_failure(
    h: Harness,
) -> None:
    job_id, sentinel = unique("delayed"), unique("sentinel")
    await h.handled(await h.command(start(job_id, {BIG_T4: 4}, start_after_s=1_000_000.0)))  # 1000 s
    await h.heartbeat_shows({BIG_T4: 4}, running={job_id})
    await h.handled(await h.command(StopJob(job_id=job_id, reason="preempted")))
    await h.heartbeat_shows({BIG_T4: 0}, running=set(), absent={job_id})
    assert h.agent is not None and f"{job_id}:1" not in h.agent.tasks
    await h.command(start(sentinel, {T4_A: 2}, steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(job_id) == ["failed"], "never started, so no started nor progress"
    assert h.seen.event(job_id, "failed")["reason"] == "preempted"  # type: ignore[index]


async def test_a_restarted_agent_resumes_a_delayed_starts_wait_until_the_same_start_time(h: Harness) -> None:
    job_id = unique("delayed")
    await h.handled(
        await h.command(start(job_id, {T4_B: 2}, steps=10, step_time_s=20.0, start_after_s=4000.0))
    )
    assert h.agent is not None
    start_at = h.agent.running[f"{job_id}:1"].start_at
    await h.stop_agent()
    agent = await h.start_agent()
    await until(lambda: _true(h.seen.epoch == agent.epoch), 10, "a heartbeat of the restarted agent")
    restored = agent.running[f"{job_id}:1"]
    # The copy went on while the agent was down: the wait ends when it would have, not later.
    assert restored.start_at == start_at
    await h.heartbeat_shows({T4_B: 2}, running={job_id})
    await completed(h, job_id)
    started = h.seen.event(job_id, "started")
    assert started is not None and started["started_at"] >= start_at - 0.01
    assert h.seen.kinds(job_id).count("started") == 1


async def test_reports_journalled_but_not_sent_before_a_restart_are_sent_after_it_and_sent_ones_are_not(
    h: Harness,
) -> None:
    unsent, sent, sentinel = unique("unsent"), unique("sent"), unique("sentinel")
    await h.stop_agent()
    with (h.state_dir / f"agent-{CLUSTER}.jsonl").open("a") as journal:
        for job_id in (unsent, sent):
            report = {
                "op": "report",
                "msg_id": f"{job_id}:completed:1",
                "subject": subjects.job_report("completed", "t1", CLUSTER),
                "payload": encode(
                    JobCompleted(
                        job_id=job_id, tenant="t1", cluster=CLUSTER, attempt=1, gpu_seconds=1.0, at=1.0
                    )
                ).decode(),
                "carrier": {},
            }
            journal.write(json.dumps(report) + "\n")
        journal.write(json.dumps({"op": "sent", "id": f"{sent}:completed:1"}) + "\n")
    await h.start_agent()
    assert (await completed(h, unsent))["gpu_seconds"] == 1.0
    await h.command(start(sentinel, {T4_A: 2}, steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert h.seen.kinds(sent) == [], "a report the stream took before the restart is not sent again"
    assert h.seen.ids(unsent, "completed") == [f"{unsent}:completed:1"]
    assert h.agent is not None and h.agent.reports == {}


async def test_a_journal_compacted_while_runs_go_on_restores_the_same_runs_and_resends_nothing(
    h: Harness,
) -> None:
    assert h.agent is not None
    h.agent.compact_after_lines = 4  # compacted many times over by the runs below
    held, done = unique("held"), unique("done")
    await h.handled(await h.command(start(held, {T4_C: 2}, role="member")))
    await h.command(start(done, {T4_A: 2}, steps=10, step_time_s=20.0))
    await completed(h, done)
    agent = h.agent
    await until(lambda: _true(not agent.reports), 10, "every report sent")
    assert len(h.journal()) < 4 + 3, "the journal holds what matters, not every change"

    await h.stop_agent()
    restarted = await h.start_agent()
    await until(lambda: _true(h.seen.epoch == restarted.epoch), 10, "a heartbeat of the restarted agent")
    await h.heartbeat_shows({T4_C: 2, T4_A: 0}, running={held}, absent={done})
    assert set(restarted.running) == {f"{held}:1"} and f"{done}:1" in restarted.finished
    assert restarted.reports == {}
    assert h.seen.ids(done, "completed") == [f"{done}:completed:1"], "nothing sent twice"
    await h.handled(await h.command(StopJob(job_id=held)))


class _LoopKiller(BaseException):
    """Escapes the handler's ``except Exception``, so the consumer loop itself dies (as it did on a
    RecursionError while decoding a deeply nested command)."""


class _DyingAgent(Agent):
    """Kills its command loop on the first start of a job named ``kill-...``."""

    killed = False

    async def on_command(self, d: Delivery[ClusterCommand]) -> None:
        if isinstance(d.message, StartJob) and d.message.job_id.startswith("kill-") and not self.killed:
            type(self).killed = True
            raise _LoopKiller("the command loop dies")
        await super().on_command(d)


async def test_a_command_consumer_whose_loop_dies_is_logged_restarted_and_shown_in_health(h: Harness) -> None:
    await h.stop_agent()
    await h.start_agent(_DyingAgent)
    after = unique("after")
    with capture_logs() as logs:
        await h.command(start(unique("kill"), {T4_A: 2}))

        async def died_logged() -> bool:
            return any(e["event"] == "task died; restarting" for e in logs)

        await until(died_logged, 10, "the death of the command loop to be logged")
        # Commands sent after the death are carried out: the loop came back.
        await h.command(start(after, {T4_B: 2}, steps=10, step_time_s=20.0))
        await completed(h, after)
    died = [e for e in logs if e["event"] == "task died; restarting" and e["task"] == "commands"]
    assert len(died) == 1 and died[0]["log_level"] == "error"
    assert died[0]["error"] == "_LoopKiller: the command loop dies"

    reply = await h.nc.request(subjects.service_health(f"agent-{CLUSTER}"), b"", timeout=2.0)
    health = json.loads(reply.data)
    assert health["tasks"]["commands"] == {
        "state": "recovering",
        "restarts": 1,
        "last_error": "_LoopKiller: the command loop dies",
    }
    assert health["status"].startswith("degraded: task commands recovering (1 restarts)")
    assert any(p.startswith("task commands recovering (1 restarts)") for p in health["problems"])


async def _true(value: object) -> bool:
    return bool(value)


class Misreporting(SimCluster):
    """A backend without a clock (as Slurm) whose parts do not run as Loom chose: what each job's
    part looks like is scripted; what the agent stops is recorded."""

    def __init__(self, cluster: Cluster, answers: dict[str, PartStatus]) -> None:
        super().__init__(cluster)
        self.clock = False
        self.poll_s = 0.02
        self.answers = answers
        self.stopped: list[str] = []

    async def launch(self, part: PartLaunch) -> str:
        return f"ref-{part.job_id}"

    async def poll(self, ref: str, key: str) -> PartStatus:
        return self.answers[key.rpartition(":")[0]]

    async def stop(self, ref: str) -> None:
        self.stopped.append(ref)

    async def running(self) -> dict[str, str]:
        return {}


async def test_a_part_the_backend_runs_elsewhere_or_loses_is_stopped_and_reported_failed_never_started(
    h: Harness,
) -> None:
    elsewhere, gone = unique("elsewhere"), unique("gone")
    other = "openb-node-0123"
    backend = Misreporting(
        load_topology("small").cluster(CLUSTER),
        {
            elsewhere: PartStatus(phase=Phase.RUNNING, nodes=(other,)),
            gone: PartStatus(
                phase=Phase.VANISHED, reason="Slurm job 7 is gone (and not in Slurm's accounting)"
            ),
        },
    )
    await h.stop_agent()
    await h.start_agent(backend=backend)
    # Not waited by the consumer's ack floor: an earlier test's command (the one that killed the
    # loop) may still be unacknowledged; the failed reports below are what the test waits for.
    for job_id in (elsewhere, gone):
        await h.command(start(job_id, {BIG_T4: 1}))
    moved = await failed(h, elsewhere)
    assert f"ran on ['{other}'], not on ['{BIG_T4}']" in moved["reason"] and moved["retryable"] is True
    lost = await failed(h, gone)
    assert "vanished" in lost["reason"] and "is gone" in lost["reason"] and lost["retryable"] is True
    assert h.seen.kinds(elsewhere) == ["failed"] and h.seen.kinds(gone) == ["failed"]  # never "running"
    assert {f"ref-{elsewhere}", f"ref-{gone}"} <= set(backend.stopped)  # taken out of the backend too
    await h.heartbeat_shows({BIG_T4: 0}, running=set(), absent={elsewhere, gone})


async def test_a_batch_of_starts_starts_each_once_and_the_same_batch_again_changes_nothing(
    h: Harness,
) -> None:
    a, b = unique("batched"), unique("batched")
    batch = StartJobs(
        starts=[
            start(a, {BIG_T4: 4}, steps=100, step_time_s=1000.0),
            start(b, {T4_A: 2}, steps=100, step_time_s=1000.0),
        ]
    )
    await h.command(batch)
    await h.heartbeat_shows({BIG_T4: 4, T4_A: 2}, running={a, b})
    await until(lambda: _true(h.seen.event(b, "started")), 10, "both started")
    await h.command(batch)  # delivered again, under another id
    sentinel = unique("sentinel")
    await h.command(start(sentinel, {T4_B: 2}, steps=10, step_time_s=20.0))
    await completed(h, sentinel)
    assert (h.seen.kinds(a), h.seen.kinds(b)) == (["started"], ["started"])
    assert h.seen.ids(a, "started") == [f"{a}:started:1"]
    assert h.agent is not None and h.agent.backend.nodes[BIG_T4].gpus_used == 4, "started once, not twice"
    for job_id in (a, b):
        await h.command(StopJob(job_id=job_id))
    await h.heartbeat_shows({BIG_T4: 0, T4_A: 0}, running=set(), absent={a, b})


async def test_a_start_in_a_batch_that_cannot_start_fails_alone_and_a_malformed_one_dead_letters_the_batch(
    h: Harness,
) -> None:
    ok, no_room, malformed = unique("ok"), unique("noroom"), unique("malformed")
    broken = msgspec.structs.replace(
        start(malformed, {T4_C: 2}), job_id=unique("other")
    )  # another job's spec
    dead: list[Msg] = []

    async def on_dead(msg: Msg) -> None:
        dead.append(msg)

    sub = await h.nc.subscribe(subjects.dead_letter(subjects.cluster_command(CLUSTER, "starts")), cb=on_dead)
    await h.command(
        StartJobs(
            starts=[
                start(no_room, {P100: 2}),  # asks for T4 on a P100 node
                broken,
                start(ok, {T4_A: 2}, steps=100, step_time_s=1000.0),
            ]
        )
    )
    await until(lambda: _true(h.seen.event(ok, "started")), 10, "the good start to run")
    event = await failed(h, no_room)
    assert event["retryable"] is True and event["reason"].startswith("cannot start: ")
    await until(lambda: _true(dead), 10, "the batch to be dead-lettered")
    assert malformed in (dead[0].headers or {}).get("Loom-Error", "")
    assert h.seen.kinds(malformed) == [] and h.seen.kinds(ok) == ["started"]
    await sub.unsubscribe()
    await h.command(StopJob(job_id=ok))
    await h.heartbeat_shows({T4_A: 0}, running=set(), absent={ok})


async def test_a_batch_starts_every_run_before_it_waits_for_the_attempts_one_of_them_supersedes(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Attempt 1 of `old` runs; a batch brings attempt 2 of it (superseding attempt 1, whose stop
    # is not here) and a start of `other`. While the superseded run's halt is still being waited
    # for, `other` must already run here: a command behind the batch (a resize of it) finds it.
    old, other = unique("superseded"), unique("other")
    await h.command(start(old, {T4_A: 2}, steps=100, step_time_s=1000.0))
    await h.heartbeat_shows({T4_A: 2}, running={old})
    assert h.agent is not None
    agent = h.agent
    release = asyncio.Event()
    real_halted = agent._halted

    async def slow_halted(job: Any, task: Any) -> None:
        await release.wait()
        await real_halted(job, task)

    monkeypatch.setattr(agent, "_halted", slow_halted)
    await h.command(
        StartJobs(
            starts=[
                start(old, {T4_A: 2}, steps=100, step_time_s=1000.0, attempt=2),
                start(other, {T4_B: 2}, steps=100, step_time_s=1000.0),
            ]
        )
    )

    async def both_in() -> bool:
        return f"{old}:2" in agent.running and f"{other}:1" in agent.running

    await until(both_in, 10, "both starts of the batch in while the halt is still awaited")
    assert f"{old}:1" not in agent.running and not release.is_set()
    release.set()
    # Effects, not the consumer's ack floor (an earlier test's unsettled command can hold it back).
    await until(lambda: _true(f"{old}:1" not in agent.tasks), 10, "the superseded run halted")
    await h.heartbeat_shows({T4_A: 2, T4_B: 2}, running={old, other})
    for job_id in (old, other):
        await h.command(StopJob(job_id=job_id, attempt=2 if job_id == old else 1))
    await h.heartbeat_shows({T4_A: 0, T4_B: 0}, running=set(), absent={old, other})


async def test_the_lead_part_of_a_gang_over_clusters_counts_every_parts_gpus(h: Harness) -> None:
    # A gang of 4 workers x 2 GPUs with one worker here (the lead) and three elsewhere: its
    # completion counted the lead's 2 GPUs only, so `loom job` showed a quarter of the GPU-seconds.
    job_id = unique("span-lead")
    steps, step_time_s = 10, 20.0
    spec = JobSpec(
        job_id=job_id,
        tenant="t1",
        workers=4,
        resources=Resources(gpus=2),
        work=Work(steps=steps, step_time_s=step_time_s),
    )
    command = StartJob(
        job_id=job_id,
        spec=spec,
        gpu_model="T4",
        allocations=[NodeAllocation(node=T4_A, gpus=2)],
        role="lead",
    )
    await h.command(command)
    done = await completed(h, job_id)
    assert done["gpu_seconds"] == pytest.approx(steps * step_time_s * 4 * 2, rel=1e-6)

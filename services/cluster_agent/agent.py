"""The cluster agent: heartbeats its cluster, executes commands, reports each job's life.

Commands arrive on a durable consumer, so an agent that was down misses none; a repeated command
(same job and attempt) changes nothing. Running jobs are written to a state file, so a restarted
agent resumes them instead of losing them. Every event about a job continues the trace the job
was submitted in.

A job placed on several clusters has one *lead* part, which runs the job's clock and reports its
life (started, progress, checkpointed, completed, failed), and *member* parts, which only hold
their GPUs (they show as used in heartbeats) until a stop command. Event ids are
``<job>:<kind>:<attempt>[...]``, the same on every cluster, so a member's event would collide with
the lead's: a member publishes one event only, the retryable ``failed`` of a part that could not
start, under an id of its own (``<job>:failed:<attempt>:<cluster>``), so that placement gives the
attempt up and places the job elsewhere.

A start may be delayed (``start_after_s``, simulated seconds: the dataset is still being copied).
The run holds its GPUs from the command on, and reports ``started`` when the wait ends, so
``started`` always means the work began; placement's confirmation deadline includes the delay.

A run stopped here, or refused here, is remembered (in the journal too) as finished: a start
command for that attempt delivered later is refused without a word, since placement has given
the attempt up.

Reports never wait on the bus. Every report about a job (started, progress, checkpointed,
completed, failed, and a refusal on the cluster's status subject) is first appended to the
journal, then sent by one sender task in the order written, each under its deterministic id, so a
resend is dropped by the stream's dedup window or the consumers' inbox. While NATS is down the
runs go on, a run that ends frees its GPUs at once, and the reports wait in the journal (across a
restart too); health says ``nats unavailable, N reports journalled`` until they are out. The
heartbeat loop, the report sender, the command consumer and every run's task are supervised
(:mod:`loom.runtime.watchdog`): one that dies is logged, restarted and shown in health.
"""

import asyncio
import contextlib
import itertools
import json
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping, ValuesView
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import msgspec
import structlog
from msgspec import Struct
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind

from loom.bus import BusError, ConsumerRunner, ConsumerSpec, Delivery
from loom.bus.publisher import Outgoing, refused
from loom.bus.reply import respond
from loom.errors import InvalidInputError, LoomError
from loom.migrate.checkpoints import checksum_of
from loom.model.family import job_family
from loom.model.heartbeat import next_interval_s
from loom.runtime.service import ServiceContext
from loom.tasks import cancel_and_wait
from loom.telemetry import span_name
from loom_proto import subjects
from loom_proto.clusters import (
    AcceleratorProfile,
    CheckpointJob,
    ClusterCommand,
    ClusterHeartbeat,
    ClusterProfiles,
    ClusterStatus,
    DrainCluster,
    ResizeJob,
    StartJob,
    StartJobs,
    StopJob,
)
from loom_proto.codec import encode
from loom_proto.jobs import JobCheckpointed, JobCompleted, JobFailed, JobProgress, JobStarted, NodeAllocation
from loom_services.cluster_agent.backend import BackendError, ClusterBackend, PartLaunch, PartStatus, Phase

STALL_S = 5.0
"""A simulated chunk of steps ending this much later than its time: the agent stalled (its
progress report then carries no step time: the node was not slow)."""

log = structlog.get_logger("cluster_agent")
_tracer = trace.get_tracer("loom.cluster_agent")

REPORT_BATCH = 64
"""Reports sent at once: written to the connection in order, acknowledged together."""

MAX_CHECKPOINTS = 100
"""The most checkpoints a run writes: a job that asks for one every few steps gets one every so
many of its intervals."""

RUNNER_STOP_S = 30.0
"""A stop waits at most this long for the command consumer's in-flight handlers (each Slurm
command is bounded by its own timeout; this bounds a handler hung elsewhere, on the bus say)."""


@dataclass
class Report:
    """One message about a job, kept in the journal until the stream has acknowledged it."""

    msg_id: str
    subject: str
    payload: str
    """The encoded message (JSON text)."""
    carrier: dict[str, str]
    """The trace context the message continues (empty: none)."""


@dataclass
class RunningJob:
    """A job's run on this cluster, as kept in the state file."""

    job_id: str
    tenant: str
    attempt: int
    gpu_model: str
    task_type: str
    steps: int
    step_time_s: float
    checkpoint_every_steps: int
    allocations: list[tuple[str, int]]
    carrier: dict[str, str]
    step: int = 0
    started_at: float = field(default_factory=time.time)
    # Defaults below keep state files written before these fields existed readable.
    role: str = "lead"
    """``lead`` runs the job's clock and reports its life; ``member`` only holds its GPUs."""
    slowdown: float = 1.0
    workers: int = 1
    """Workers this run has now (an elastic run is resized)."""
    spec_workers: int = 1
    """Workers the job asked for: with all of them it runs at full speed."""
    gpu_seconds: float = 0.0
    """Simulated GPU-seconds this run has used up to ``step``."""
    start_at: float = 0.0
    """Wall-clock time (Unix seconds) a delayed run begins its work; 0 once it has begun (or for a
    run that never waited). Absolute, so a restarted agent waits only what is left."""
    family: str = ""
    """The job's family (:func:`loom.model.family.job_family`): picks a sim true speed."""
    labels: dict[str, str] = field(default_factory=dict)
    """The job's labels (a backend that runs real work passes them on)."""
    gpus_per_worker: int = 0
    """GPUs each worker of the job holds (0: a pipeline, whose stages differ, or a state file from
    before): the lead part counts the whole job's GPU-seconds, every part's, by it."""
    backend_ref: str = ""
    """The backend's id of this part (a Slurm job id); empty until launched (or for ``sim``)."""
    backend_phase: str = ""
    """The last :class:`~loom_services.cluster_agent.backend.Phase` the backend reported."""
    paced_at: float = 0.0
    """Wall time of the previous progress report (0: none yet), for its observed step."""
    paced_step: int = -1
    """Step of the previous progress report (-1: none yet)."""

    @property
    def key(self) -> str:
        """Job and attempt: one run."""
        return f"{self.job_id}:{self.attempt}"

    @property
    def lead(self) -> bool:
        """Whether this run reports the job's life (a member part reports nothing)."""
        return self.role == "lead"

    @property
    def waiting(self) -> bool:
        """Whether the run holds its GPUs but has not begun its work yet."""
        return self.start_at > 0

    @property
    def gpus(self) -> int:
        """GPUs the run holds now."""
        return sum(g for _, g in self.allocations)

    @property
    def job_gpus(self) -> int:
        """GPUs the whole job holds now, every part's (a lead's count; its own when not known): a
        gang over two clusters counted only the lead's part (a newcomer's walk: 9.9 M of ~18.8 M)."""
        return max(self.workers * self.gpus_per_worker, self.gpus)

    @property
    def worker_share(self) -> float:
        """The workers it has over the workers it asked for; its speed is proportional to it."""
        return self.workers / max(self.spec_workers, 1)

    def node_allocations(self) -> list[NodeAllocation]:
        """The run's allocations as wire structs."""
        return [NodeAllocation(node=n, gpus=g) for n, g in self.allocations]


Halt = tuple[RunningJob, "asyncio.Task[None] | None"]
"""A superseded run being halted, and its task to await (:meth:`Agent._halted`)."""


class Agent:
    """One cluster's agent; :meth:`run` is the service body."""

    def __init__(
        self,
        ctx: ServiceContext,
        backend: ClusterBackend,
        *,
        region: str,
        time_scale: float = 60.0,
        heartbeat_s: float = 2.0,
        max_heartbeat_s: float = 10.0,
        full_every: int = 10,
        progress_every: float = 0.1,
        state_dir: Path | None = None,
        profile_of: Callable[[str], AcceleratorProfile | None] = lambda _model: None,
    ) -> None:
        self.ctx = ctx
        self.backend = backend
        self.cluster = backend.cluster_id
        self.region = region
        self.time_scale = time_scale
        self.profile_of = profile_of
        self.heartbeat_s = heartbeat_s
        """The shortest interval between heartbeats (used while the cluster changes)."""
        self.max_heartbeat_s = max(max_heartbeat_s, heartbeat_s)
        self.interval_s = heartbeat_s
        self._last_beat = 0.0
        self._changed = asyncio.Event()
        self.full_every = full_every
        self._refreshes = 0
        self.progress_every = progress_every
        self.epoch = time.time_ns() // 1_000_000
        self.seq = 0
        self.running = _Runs()
        self.finished: set[str] = set()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._closing = False
        """Set as the agent stops: a run's task (restarted by the watchdog, say) follows no more."""
        self._resized: dict[str, asyncio.Event] = {}
        """Per run: set when a resize changes its speed, so the sleeping run recomputes it."""
        self.state_file = (state_dir / f"agent-{self.cluster}.jsonl") if state_dir else None
        self._journal: IO[bytes] | None = None
        self._journal_lines = 0
        self.compact_after_lines = 100_000
        """The journal is rewritten with only what still matters after this many appends."""
        self.reports: dict[str, Report] = {}
        """Reports not yet acknowledged by the stream, by message id, in the order written."""
        self._reported = asyncio.Event()
        self._all_sent = asyncio.Event()
        self._all_sent.set()
        self.send_error: str | None = None
        """Why the last attempt to send reports failed; None once one succeeds."""
        self.report_backoff_s = (0.2, 5.0)
        """First and longest pause between rounds of sending while the bus fails."""
        ctx.live_stats.append(self._run_stats)
        ctx.stats.update(
            {
                "cluster": self.cluster,
                "completed": 0,
                "reports_pending": 0,
                "reports_sent": 0,
            }
        )

    # ---- lifecycle of the agent ------------------------------------------------------------------

    async def run(self) -> None:
        """Heartbeat and execute commands until asked to stop."""
        self._restore()
        runner: ConsumerRunner[ClusterCommand] = ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="CLUSTERS",
                durable=f"agent-{self.cluster}",
                filter_subjects=[subjects.cluster_commands(self.cluster)],
                batch=50,
            ),
            ClusterCommand,
            handler=self.on_command,
            publisher=self.ctx.publisher,
            # Each command changes state before its first await, so a batch's publishes can overlap.
            concurrent=True,
            # One standing pull request, commands landing in a plain callback: the fetch path
            # spent two tasks and a timer on each command.
            callback_pull=True,
        )
        watchdog = self.ctx.watchdog
        watchdog.condition("reports", self.bus_problem)
        watchdog.condition("backend", self.backend.problem)
        await self._refresh()
        await self._reconcile()
        sender = watchdog.supervise("reports", self._send_reports)
        await self.heartbeat(full=True)
        # Placement's liveness ping (loom.migrate.health): answered while this connection lives.
        alive = await self.ctx.nc.subscribe(subjects.agent_alive(self.cluster), cb=_answer_alive)
        await self.publish_profiles()
        await self._fence_restored()
        await runner.start()
        commands = watchdog.watch_consumer("commands", runner)
        for job in list(self.running.values()):
            self._launch(job)
        beat = watchdog.supervise("heartbeat", self._heartbeat_loop)
        try:
            await self.ctx.stopping.wait()
        finally:
            self._closing = True
            # In a task of its own, shielded: a cancellation of this stop (a second one, or one
            # arriving while it runs) cannot cut the cleanup short (the command consumer left
            # running, runs and their Slurm polls never cancelled); it is re-raised once done.
            await _complete(self._shut_down(alive, beat, commands, runner, sender))

    async def _shut_down(
        self,
        alive: Subscription,
        beat: "asyncio.Task[None]",
        commands: "asyncio.Task[None]",
        runner: ConsumerRunner[ClusterCommand],
        sender: "asyncio.Task[None]",
    ) -> None:
        """The stop's cleanup (:meth:`run`): the heartbeat, the commands, the runs, the reports."""
        watchdog = self.ctx.watchdog
        with contextlib.suppress(Exception):
            await alive.unsubscribe()
        beat.cancel()
        await asyncio.wait([beat])
        if not beat.cancelled() and beat.exception() is not None:  # retrieved: never "never retrieved"
            log.warning("heartbeat ended with an error", error=repr(beat.exception()))
        commands.cancel()
        try:  # bounded: a command handler hung on the bus must not hold the stop for ever
            async with asyncio.timeout(RUNNER_STOP_S):
                await runner.stop()
        except TimeoutError:
            log.warning("command consumer did not stop in time", timeout_s=RUNNER_STOP_S)
        await cancel_and_wait(self.tasks.values())
        # What is still unsent stays in the journal for the next start; give it a moment.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_sent.wait(), timeout=2.0)
        sender.cancel()
        await asyncio.gather(sender, commands, return_exceptions=True)
        watchdog.drop_condition("reports")
        watchdog.drop_condition("backend")
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    async def _fence_restored(self) -> None:
        """A returning agent checks its restored runs' attempts with placement before resuming them:
        a run whose attempt placement gave up while the agent was away (failed over, moved) is an
        orphan, stopped here without a report, so the job never runs twice. Without an answer the
        runs resume and the stops placement sent (on the durable command consumer) fence them."""
        if not self.running:
            return
        job_ids = sorted({j.job_id for j in self.running.values()})
        try:
            reply = await self.ctx.nc.request(
                subjects.PLACEMENT_ATTEMPTS, json.dumps({"job_ids": job_ids}).encode(), timeout=2.0
            )
            answer = json.loads(reply.data)
            if not answer.get("ok"):
                raise ValueError(answer.get("error", "refused"))
            current: dict[str, list[Any]] = answer["result"]
        except Exception as exc:  # nats raises several unrelated types; the durable stops fence them
            log.warning("restored runs' attempts not checked", error=repr(exc))
            return
        for job in list(self.running.values()):
            state, attempt = current.get(job.job_id, (None, None))
            if attempt is None:
                continue  # the store does not know the job: nothing says the run is stale
            if job.attempt < attempt or (job.attempt == attempt and state not in ("placed", "running")):
                log.warning(
                    "orphaned run stopped",
                    job_id=job.job_id,
                    attempt=job.attempt,
                    current_attempt=attempt,
                    state=state,
                )
                self._finish(job)
                self.ctx.stats["orphans_stopped"] = self.ctx.stats.get("orphans_stopped", 0) + 1

    async def publish_profiles(self) -> None:
        """Tell the platform what each accelerator model of this cluster delivers."""
        models = sorted({n.gpu_model for n in self.backend.nodes.values() if n.gpu_model})
        profiles = [p for p in (self.profile_of(m) for m in models) if p is not None]
        await self.ctx.publisher.publish(
            subjects.cluster_profiles(self.cluster),
            ClusterProfiles(
                cluster=self.cluster,
                agent_epoch=self.epoch,
                source="library",
                profiles=profiles,
                measured_at=time.time(),
            ),
            msg_id=f"profile-{self.cluster}-{self.epoch}",
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            # A change wakes the loop early, but beats never come closer than the minimum interval.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.interval_s)
            await asyncio.sleep(max(self.heartbeat_s - (time.monotonic() - self._last_beat), 0.0))
            self._changed.clear()
            await self._refresh()
            self.interval_s = next_interval_s(
                self.interval_s, self.backend.changed(), min_s=self.heartbeat_s, max_s=self.max_heartbeat_s
            )
            try:
                await self.heartbeat(full=self.seq % self.full_every == 0)
            except BusError as exc:
                log.warning("heartbeat failed", error=str(exc))

    async def heartbeat(self, *, full: bool) -> None:
        """Publish the cluster's state: every node, or just the ones that changed."""
        self.seq += 1
        self._last_beat = time.monotonic()
        beat = ClusterHeartbeat(
            cluster=self.cluster,
            region=self.region,
            agent_epoch=self.epoch,
            seq=self.seq,
            sent_at=time.time(),
            full=full or self.seq == 1,
            nodes=self.backend.report(full or self.seq == 1),
            running_jobs=sorted({j.job_id for j in self.running.values()}),
            interval_s=self.interval_s,
        )
        await self.ctx.publisher.publish(
            subjects.cluster_heartbeat(self.cluster),
            beat,
            msg_id=f"hb-{self.cluster}-{self.epoch}-{self.seq}",
        )

    # ---- commands ------------------------------------------------------------------------------

    async def on_command(self, d: Delivery[ClusterCommand]) -> None:
        """Carry out one command; repeats of a command already carried out change nothing."""
        command = d.message
        if isinstance(command, StartJob):
            await self._start(command)
        elif isinstance(command, StartJobs):
            await self._start_all(command, d)
        elif isinstance(command, StopJob):
            await self._stop(command.job_id, command.attempt, command.reason or "stopped by command")
        elif isinstance(command, ResizeJob):
            await self._resize(command)
        elif isinstance(command, CheckpointJob):
            job = self.running.get(f"{command.job_id}:{command.attempt}")
            if job is not None and job.lead and not job.waiting:
                if self.backend.clock:
                    self._checkpoint(job)
                elif job.backend_ref:
                    await self.backend.signal_checkpoint(job.backend_ref)  # the job reports it
        elif isinstance(command, DrainCluster):
            await self.backend.drain(command.nodes)
            self._changed.set()

    async def _start_all(self, command: StartJobs, d: Delivery[ClusterCommand]) -> None:
        """Carry out each start of a batch as its own command would be, under a CONSUMER span in
        its own job's trace (linked to the batch's delivery). A start that fails does not keep
        the others from starting; afterwards the batch fails with it (a start that cannot
        succeed: dead-lettered; anything else: redelivered, and the starts carried out already
        change nothing the second time)."""
        refused: list[str] = []
        retry: Exception | None = None
        halts: list[Halt] = []  # awaited once every start of the batch is in
        link = [Link(d.span.get_span_context())]
        for i, start in enumerate(command.starts):
            carrier = command.traces[i] if i < len(command.traces) else {}
            with _tracer.start_as_current_span(
                span_name("process", d.subject),
                context=propagate.extract(carrier) if carrier else d.context,
                kind=SpanKind.CONSUMER,
                links=link,
                attributes={"messaging.destination.name": d.subject},
            ) as span:
                if span.is_recording():  # as the bus's own spans: the rest only where it records
                    span.set_attributes(
                        {
                            "messaging.system": "nats",
                            "messaging.operation.type": "process",
                            "messaging.message.id": d.msg_id or "",
                            "loom.job_id": start.job_id,
                        }
                    )
                try:
                    await self._start(start, halts)
                except LoomError as exc:
                    if not exc.non_retryable:
                        retry = retry or exc
                        continue
                    log.error("start in a batch refused", job_id=start.job_id, error=str(exc))
                    refused.append(f"{start.job_id}: {exc}")
                except Exception as exc:  # the batch is redelivered; what started stays started
                    retry = retry or exc
        await self._await_halts(halts, None)
        if retry is not None:
            raise retry
        if refused:
            raise InvalidInputError(
                f"{len(refused)} of {len(command.starts)} starts refused: {'; '.join(refused)}"
            )

    async def _start(self, command: StartJob, halts: list[Halt] | None = None) -> None:
        """Carry out one start. The older attempts it supersedes are halted; their halts are
        awaited here, or, given ``halts``, added to it for the caller to await (a batch starts every
        run first, so a command behind it that names a later start finds it here)."""
        key = f"{command.job_id}:{command.attempt}"
        if key in self.running:
            return
        if key in self.finished:
            # Stopped, ended or refused already: placement has moved on from this attempt.
            log.info("start of a finished run refused", job_id=command.job_id, attempt=command.attempt)
            return
        spec = command.spec
        if spec.job_id != command.job_id:
            raise InvalidInputError(f"start command for {command.job_id} carries the spec of {spec.job_id}")
        attempts = self.running.attempts_of(command.job_id)
        if any(r.attempt > command.attempt for r in attempts):
            # A later attempt runs here: placement gave this one up before placing that one.
            log.info("start of a superseded attempt refused", job_id=command.job_id, attempt=command.attempt)
            self.finished.add(key)
            self._record({"op": "finish", "key": key})
            return
        # Placement gives an attempt up before it places the next one, so a start of attempt N
        # supersedes this job's older attempts here: their stops may not have come yet (published
        # after it when their first publish failed, or redelivered). Stopped first, their GPUs are
        # free for it; before, the start was refused against them and the next attempt avoided
        # this cluster (a failed-over cross-cluster gang then waited for the failed cluster).
        halted = [
            (old, self._halt(old, f"superseded by attempt {command.attempt} (its own stop not here yet)"))
            for old in attempts
            if old.attempt < command.attempt
        ]
        for old, _ in halted:
            log.warning(
                "older attempt superseded", job_id=old.job_id, attempt=old.attempt, by=command.attempt
            )
        refusal = self.backend.refusal(command.gpu_model, command.allocations)
        if refusal is not None:
            await self._refuse_start(command, refusal)
            await self._await_halts(halted, halts)
            return
        # Only a lead waits: a member has no clock, it just holds its GPUs from now on.
        wait_s = command.start_after_s / self.time_scale if command.role == "lead" else 0.0
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        job = RunningJob(
            job_id=spec.job_id,
            tenant=spec.tenant,
            attempt=command.attempt,
            gpu_model=command.gpu_model,
            task_type=spec.task_type,
            steps=spec.work.steps,
            step_time_s=spec.work.step_time_s,
            checkpoint_every_steps=spec.work.checkpoint_every_steps,
            allocations=[(a.node, a.gpus) for a in command.allocations],
            carrier=carrier,
            step=command.resume_from_step,
            role=command.role,
            slowdown=command.slowdown,
            workers=command.workers or spec.workers,
            spec_workers=spec.workers,
            gpus_per_worker=spec.resources.gpus if spec.pipeline is None else 0,
            start_at=time.time() + wait_s if wait_s > 0 else 0.0,
            family=job_family(spec),
            labels=dict(spec.labels),
        )
        self.backend.allocate(command.allocations)
        self._changed.set()
        self.running[key] = job
        self._record({"op": "start", "key": key, "job": _fields(job)})
        # A waiting run reports ``started`` from its task, when the wait ends; a backend without a
        # clock, when it says the part runs.
        if job.lead and not job.waiting and self.backend.clock:
            self._report_started(job)
        self._launch(job)
        await self._await_halts(halted, halts)

    async def _await_halts(self, halted: list[Halt], halts: list[Halt] | None) -> None:
        """Await the halts of superseded runs, or hand them to a batch's ``halts`` to await later."""
        if halts is not None:
            halts.extend(halted)
            return
        for old, task in halted:
            await self._halted(old, task)

    async def _refuse_start(self, command: StartJob, refusal: str) -> None:
        """Tell placement a part cannot start here, so it gives the attempt up and places it elsewhere.

        The attempt is finished here from now on: a redelivered command is refused without a word.
        """
        key = f"{command.job_id}:{command.attempt}"
        spec = command.spec
        lead = command.role == "lead"
        log.warning(
            "start refused", job_id=command.job_id, attempt=command.attempt, role=command.role, reason=refusal
        )
        if lead:
            self._report_failed(
                spec.job_id, spec.tenant, command.attempt, f"cannot start: {refusal}", retryable=True
            )
        else:
            self._report_failed(
                spec.job_id,
                spec.tenant,
                command.attempt,
                f"member part on {self.cluster} could not start: {refusal}",
                retryable=True,
                msg_id=f"{spec.job_id}:failed:{command.attempt}:{self.cluster}",
            )
            self._report_refusal(command.job_id, command.attempt, f"cannot start member part: {refusal}")
        # After the reports: a crash in between redoes the refusal (same ids) from the redelivery.
        self.finished.add(key)
        self._record({"op": "finish", "key": key})

    def _run_stats(self) -> dict[str, Any]:
        """The live runs in health answers: their count, their ``job:attempt`` keys, and any node
        holding more GPUs than it has (never expected; a chaos campaign checks it). Computed when
        asked (:attr:`ServiceContext.live_stats`): sorting every run on each start and end cost
        a burst of thousands of starts time quadratic in the runs."""
        return {
            "running": len(self.running),
            "running_keys": sorted(self.running),
            "nodes_over_capacity": sorted(
                name for name, node in self.backend.nodes.items() if node.gpus_used > node.gpus_total
            ),
        }

    def _launch(self, job: RunningJob) -> None:
        if not self.backend.clock:  # the backend runs the part (a member's too); the agent follows it
            self.tasks[job.key] = self.ctx.watchdog.supervise(
                f"job-{job.key}", lambda: self._follow(job), finishes=True, listed=False
            )
        # A member part has no clock: it holds its GPUs until stopped.
        elif job.lead:
            self.tasks[job.key] = self.ctx.watchdog.supervise(
                f"job-{job.key}", lambda: self._execute(job), finishes=True, listed=False
            )

    async def _stop(self, job_id: str, attempt: int, reason: str) -> None:
        key = f"{job_id}:{attempt}"
        job = self.running.get(key)
        if job is None:
            if key not in self.finished:
                # Its start command may still come (redelivered, or overtaken by this stop): it
                # must then not start an attempt placement has given up.
                log.info("stop of a run not here recorded", job_id=job_id, attempt=attempt, reason=reason)
                self.finished.add(key)
                self._record({"op": "finish", "key": key})
            return
        await self._halted(job, self._halt(job, reason))

    def _halt(self, job: RunningJob, reason: str) -> "asyncio.Task[None] | None":
        """Stop a run's task and free its GPUs, before any await (a command handled alongside, a
        resize growing into them or a start of its next attempt, sees them free); its task to await."""
        task = self.tasks.pop(job.key, None)
        if task is not None:
            task.cancel()
        if job.lead:
            self._report_failed(
                job.job_id, job.tenant, job.attempt, reason, retryable=True, carrier=job.carrier, stopped=True
            )
        self._finish(job)
        return task

    async def _halted(self, job: RunningJob, task: "asyncio.Task[None] | None") -> None:
        """The rest of a stop: its task ended, its part stopped in the backend (no clock)."""
        if task is not None:
            await cancel_and_wait([task])  # its end, whatever it was; a cancellation of this one propagates
        if not self.backend.clock:
            await self._stop_part(job)

    async def _resize(self, command: ResizeJob) -> None:
        """Give a run new workers and GPUs; its progress stays, its speed changes from now on."""
        key = f"{command.job_id}:{command.attempt}"
        job = self.running.get(key)
        if job is None:
            log.info("resize of a run not here ignored", job_id=command.job_id, attempt=command.attempt)
            return
        wanted = _per_node((a.node, a.gpus) for a in command.allocations)
        if command.workers == job.workers and wanted == _per_node(job.allocations):
            return  # already this size: a repeated resize changes nothing
        refusal = self.backend.resize_refusal(job.gpu_model, job.node_allocations(), command.allocations)
        if refusal is not None:
            log.warning("resize refused", job_id=job.job_id, attempt=job.attempt, reason=refusal)
            self._report_refusal(job.job_id, job.attempt, f"cannot resize: {refusal}")
            return
        self.backend.free(job.node_allocations())
        job.allocations = sorted(wanted.items())
        job.workers = command.workers
        # The next progress report carries no step time, the one after it is measured at the new
        # size only (placement compares it with the new size's prediction; a mean over both sizes
        # read as a slow node).
        job.paced_step = -1  # mid-chunk, its step is the chunk's start: the next report says none
        self.backend.allocate(job.node_allocations())
        self._changed.set()
        self._record({"op": "resize", "key": key, "workers": job.workers, "allocations": job.allocations})
        wakeup = self._resized.get(key)
        if wakeup is not None:
            wakeup.set()
        log.info("run resized", job_id=job.job_id, attempt=job.attempt, workers=job.workers, gpus=job.gpus)

    # ---- running a job -------------------------------------------------------------------------

    def step_seconds(self, job: RunningJob) -> float:
        """Simulated seconds one step of the run takes here now (slowdown and workers included)."""
        return self.backend.step_seconds(
            job.step_time_s,
            job.gpu_model,
            job.task_type,
            slowdown=job.slowdown,
            worker_share=job.worker_share,
            family=job.family,
        )

    async def _execute(self, job: RunningJob) -> None:
        """Wait out a delayed start, then advance the job in chunks of ``progress_every`` of its
        work, reporting each chunk. Run again by the watchdog if it died, it goes on from the
        run's last step."""
        if self.running.get(job.key) is not job or self._closing:
            return  # ended (stopped) while its task was down, or the agent stops
        chunk = max(int(job.steps * self.progress_every), 1)
        wakeup = self._resized.setdefault(job.key, asyncio.Event())
        try:
            if job.waiting:
                await self._begin(job)
            await self._run_steps(job, chunk, wakeup)
        finally:
            self._resized.pop(job.key, None)

    async def _begin(self, job: RunningJob) -> None:
        """Hold the GPUs until the run's start time, then report it started."""
        wait_s = job.start_at - time.time()
        if wait_s > 0:
            log.info(
                "run waits before starting", job_id=job.job_id, attempt=job.attempt, wait_s=round(wait_s, 3)
            )
            await asyncio.sleep(wait_s)
        self._report_started(job)
        job.start_at = 0.0
        job.started_at = time.time()
        self._record({"op": "began", "key": job.key})

    def _report_started(self, job: RunningJob) -> None:
        self._report(
            subjects.job_report("started", job.tenant, self.cluster),
            JobStarted(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=self.cluster,
                attempt=job.attempt,
                started_at=time.time(),
            ),
            msg_id=f"{job.job_id}:started:{job.attempt}",
            carrier=job.carrier,
        )

    async def _work(self, job: RunningJob, steps: int, wakeup: asyncio.Event) -> None:
        """Spend the time ``steps`` take, at the run's speed; a resize changes the speed midway."""
        loop = asyncio.get_running_loop()
        left = float(steps)
        while left > 0:
            step_s = self.step_seconds(job)
            gpus = job.job_gpus
            wakeup.clear()
            began = loop.time()
            wait_s = left * step_s / self.time_scale
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=wait_s)
            except TimeoutError:
                done = left
                if loop.time() - began - wait_s > STALL_S:
                    # This process did not run for a while (stopped, or starved): the steps were
                    # not slow, the agent was. The next report says no step time (a 20 s SIGSTOP
                    # of an agent made 7 runs "slow", moved them and closed 3 nodes for 10 min).
                    job.paced_step = -1
            else:  # resized: count what was done at the old speed, go on at the new one
                done = min((loop.time() - began) * self.time_scale / step_s, left)
            job.gpu_seconds += done * step_s * gpus
            left -= done

    async def _run_steps(self, job: RunningJob, chunk: int, wakeup: asyncio.Event) -> None:
        # Progress is reported every ``chunk`` steps; checkpoints are written as often as the job
        # asks (a drain or a migration resumes from the last one), at most MAX_CHECKPOINTS a run:
        # advancing a tenth at a time, a job checkpointing every 2,000 of 30,000 steps was
        # checkpointed every 3,000 only.
        every = job.checkpoint_every_steps
        stride = every * math.ceil(math.ceil(job.steps / MAX_CHECKPOINTS) / every) if every else 0
        while job.step < job.steps:
            target = min((job.step // chunk + 1) * chunk, job.steps)
            if stride:
                target = min(target, (job.step // stride + 1) * stride)
            await self._work(job, target - job.step, wakeup)
            before = job.step
            job.step = target
            if every and job.step // every > before // every:
                self._checkpoint(job)
            if job.step < job.steps and job.step // chunk > before // chunk:
                self._report_progress(job)
            self._record({"op": "step", "key": job.key, "step": job.step, "gpu_seconds": job.gpu_seconds})
        # Per-GPU compute speed, without slowdown or worker share: metrics compares it with the
        # model's claimed SCU to learn how much this cluster really delivers.
        speed = self.backend.delivered_speed(job.gpu_model, job.task_type)
        # Compute seconds per step on this model with all workers: what the job's family really
        # gets here, for placement's speed learner.
        observed_step_s = self.backend.compute_step_seconds(
            job.step_time_s, job.gpu_model, job.task_type, job.family
        )
        self._report_completed(job, speed, observed_step_s)
        # Journalled: the run is over here whether or not the bus takes the report now.
        self._finish(job)
        self.tasks.pop(job.key, None)
        self.ctx.stats["completed"] = self.ctx.stats.get("completed", 0) + 1

    def _report_completed(self, job: RunningJob, delivered_speed: float, observed_step_s: float) -> None:
        """Report the run completed, with the speed the cluster delivered and the step it took."""
        self._report(
            subjects.job_report("completed", job.tenant, self.cluster),
            JobCompleted(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=self.cluster,
                attempt=job.attempt,
                gpu_seconds=job.gpu_seconds,
                at=time.time(),
                gpu_model=job.gpu_model,
                task_type=job.task_type,  # type: ignore[arg-type]  # validated when the job was accepted
                delivered_speed=round(delivered_speed, 6),
                observed_step_s=min(max(observed_step_s, 1e-9), 86_400.0),
            ),
            msg_id=f"{job.job_id}:completed:{job.attempt}",
            carrier=job.carrier,
        )

    def _report_progress(self, job: RunningJob, *, followed: bool = False) -> None:
        """Report the run's step (one message id per attempt and step: a repeat is a duplicate),
        with the seconds of the job's clock each step took since the previous report, and the
        compute step measured for the speed learner: what this agent's clock runs the job at, or,
        for a part a real backend runs (``followed``: only its steps are seen), the seconds per step
        since the previous report, as its completion measures the whole run (None on the first)."""
        now = time.time()
        observed_step_s = None
        if 0 <= job.paced_step < job.step and now > job.paced_at:
            observed_step_s = (now - job.paced_at) * self.time_scale / (job.step - job.paced_step)
        job.paced_at, job.paced_step = now, job.step
        compute_step_s = (
            observed_step_s
            if followed
            else self.backend.compute_step_seconds(job.step_time_s, job.gpu_model, job.task_type, job.family)
        )
        self._report(
            subjects.job_report("progress", job.tenant, self.cluster),
            JobProgress(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=self.cluster,
                attempt=job.attempt,
                step=job.step,
                steps=job.steps,
                at=now,
                observed_step_s=observed_step_s,
                compute_step_s=None if compute_step_s is None else min(max(compute_step_s, 1e-9), 86_400.0),
            ),
            msg_id=f"{job.job_id}:progress:{job.attempt}:{job.step}",
            carrier=job.carrier,
        )

    def _checkpoint(self, job: RunningJob) -> None:
        uri = f"sim://{self.cluster}/{job.job_id}/{job.attempt}/{job.step}"
        self._report(
            subjects.job_report("checkpointed", job.tenant, self.cluster),
            JobCheckpointed(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=self.cluster,
                attempt=job.attempt,
                step=job.step,
                checkpoint_uri=uri,
                checksum=checksum_of(job.job_id, job.attempt, job.step, uri),
                at=time.time(),
            ),
            msg_id=f"{job.job_id}:checkpointed:{job.attempt}:{job.step}",
            carrier=job.carrier,
        )

    def _finish(self, job: RunningJob) -> None:
        if self.running.get(job.key) is not job:
            return  # already finished (a stop and the run's own end can race)
        self.running.pop(job.key)
        self.finished.add(job.key)
        self.backend.free(job.node_allocations())
        self._changed.set()
        self._record({"op": "finish", "key": job.key})

    def _report_failed(
        self,
        job_id: str,
        tenant: str,
        attempt: int,
        reason: str,
        *,
        retryable: bool,
        carrier: dict[str, str] | None = None,
        msg_id: str | None = None,
        exit_code: int | None = None,
        stopped: bool = False,
    ) -> None:
        self._report(
            subjects.job_report("failed", tenant, self.cluster),
            JobFailed(
                job_id=job_id,
                tenant=tenant,
                cluster=self.cluster,
                attempt=attempt,
                reason=reason[:1024],
                retryable=retryable,
                at=time.time(),
                exit_code=exit_code,
                stopped=stopped,
            ),
            msg_id=msg_id or f"{job_id}:failed:{attempt}",
            carrier=carrier or {},
        )

    def _report_refusal(self, job_id: str, attempt: int, detail: str) -> None:
        """Say on the cluster's status subject that a command about a run could not be carried out
        (for a member part, which must not publish job events)."""
        self._report(
            subjects.cluster_status(self.cluster),
            ClusterStatus(
                cluster=self.cluster, state="ready", detail=detail[:2048], job_id=job_id, at=time.time()
            ),
            msg_id=f"refused-{self.cluster}-{job_id}-{attempt}-{self.epoch}-{time.time_ns()}",
            carrier={},
        )

    # ---- following a part a backend runs --------------------------------------------------------

    async def _refresh(self) -> None:
        """Read the backend's inventory again; one that cannot be read shows in health, and the
        agent goes on (its nodes are reported unavailable until it can)."""
        try:
            await self.backend.refresh()
        except BackendError as exc:
            log.warning("backend inventory unavailable", backend=self.backend.name, error=str(exc))
            return
        self._refreshes += 1
        if self._refreshes % self.full_every == 0:
            await self._reconcile()  # now and then: parts of runs that ended here stop in the backend too

    async def _stop_part(self, job: RunningJob) -> None:
        """Stop a run's part in the backend; one stopped while its launch was in flight (no id
        journalled yet) is looked up by its name."""
        ref = job.backend_ref
        if not ref:
            try:
                ref = (await self.backend.running()).get(job.key, "")
            except BackendError as exc:
                log.warning(
                    "part to stop not found; the next reconciliation stops it", key=job.key, error=str(exc)
                )
        if ref:
            await self.backend.stop(ref)

    async def _reconcile(self) -> None:
        """Adopt the parts the backend runs for runs whose launch was not journalled, and stop
        those it runs for runs this agent does not have (finished or given up: while it was
        down, or stopped while their launch was in flight). At start, then every ``full_every``
        heartbeats."""
        if self.backend.clock:
            return
        try:
            found = await self.backend.running()
        except BackendError as exc:
            log.warning("backend parts unknown at start", error=str(exc))
            return
        for key, ref in found.items():
            job = self.running.get(key)
            if job is None:
                log.info("backend part with no run here stopped", key=key, ref=ref)
                await self.backend.stop(ref)
            elif not job.backend_ref:
                job.backend_ref = ref
                self._record({"op": "launched", "key": key, "ref": ref})

    def _part(self, job: RunningJob) -> PartLaunch:
        step_s = self.step_seconds(job) / self.time_scale if job.steps else 0.0
        return PartLaunch(
            key=job.key,
            job_id=job.job_id,
            tenant=job.tenant,
            attempt=job.attempt,
            role=job.role,
            gpu_model=job.gpu_model,
            allocations=tuple(job.allocations),
            steps=job.steps,
            start_step=job.step,
            step_time_s=step_s,
            checkpoint_every_steps=job.checkpoint_every_steps,
            labels=job.labels,
        )

    async def _launch_part(self, job: RunningJob) -> bool:
        """Wait out a delayed start, then launch the part; False when the backend refused it (the
        refusal is reported)."""
        if job.waiting:
            await asyncio.sleep(max(job.start_at - time.time(), 0.0))
            job.start_at = 0.0
            self._record({"op": "began", "key": job.key})
        try:
            ref = await self.backend.launch(self._part(job))
        except BackendError as exc:
            if not exc.non_retryable:
                raise  # the watchdog runs the task again
            self._part_failed(job, f"cannot start: {exc}", retryable=True)
            return False
        job.backend_ref = ref
        self._record({"op": "launched", "key": job.key, "ref": ref})
        log.info("part launched", job_id=job.job_id, attempt=job.attempt, backend=self.backend.name, ref=ref)
        return True

    async def _follow(self, job: RunningJob) -> None:
        """Launch a part on a backend without a clock, then follow it until it ends: report it
        started when the backend runs it where Loom chose, its progress and checkpoints from what
        the work reports, and its end. A part the backend refuses, runs elsewhere, loses or
        leaves pending for a reason of its own is stopped and reported failed, never left running.
        Run again by the watchdog (or after a restart), it goes on from the journalled state."""
        if self.running.get(job.key) is not job or self._closing:
            return
        if not job.backend_ref and not await self._launch_part(job):
            return
        chosen = {node for node, _ in job.allocations}
        checkpoints_seen = 0
        while self.running.get(job.key) is job and not self._closing:
            try:
                status = await self.backend.poll(job.backend_ref, job.key)
            except BackendError as exc:
                if exc.non_retryable:
                    raise
                # A failed poll (the backend unreachable, a command timed out): tried again later.
                self.ctx.stats["poll_failures"] = self.ctx.stats.get("poll_failures", 0) + 1
                log.warning("part state unknown", key=job.key, error=str(exc))
                await asyncio.sleep(max(self.backend.poll_s, 1.0))
                continue
            if status.phase is Phase.RUNNING and set(status.nodes) - chosen:
                await self.backend.stop(job.backend_ref)
                elsewhere = sorted(set(status.nodes) - chosen)
                self._part_failed(job, f"ran on {elsewhere}, not on {sorted(chosen)}", retryable=True)
                return
            if status.phase != job.backend_phase:
                if status.phase is Phase.RUNNING:
                    job.started_at = time.time()
                    if job.lead:
                        self._report_started(job)
                job.backend_phase = status.phase
                self._record({"op": "phase", "key": job.key, "phase": status.phase, "at": job.started_at})
            if status.phase is Phase.RUNNING and job.lead:
                checkpoints_seen = self._follow_progress(job, status, checkpoints_seen)
            elif status.phase.terminal:
                await self._part_ended(job, status, checkpoints_seen)
                return
            await asyncio.sleep(self.backend.poll_s)

    async def _part_ended(self, job: RunningJob, status: PartStatus, checkpoints_seen: int) -> None:
        """Report how a followed part ended: completed, or failed with the backend's reason (the
        exit code of work that exited non-zero; the node of a node failure)."""
        if status.phase is Phase.COMPLETED:
            if job.lead:
                self._report_started(job)  # a short run may end between two looks (a repeat is dropped)
                self._follow_progress(job, status, checkpoints_seen)
                self._part_completed(job)
            else:
                self._part_failed(job, "member part ended on its own", retryable=True)
            return
        detail = status.reason or status.phase.value
        if status.phase is Phase.FAILED and status.exit_code is not None:
            detail = f"exit code {status.exit_code} ({detail})"
        elif status.phase is Phase.NODE_FAIL:
            detail = f"node failure on {', '.join(status.nodes) or 'its node'}: {detail}"
        # Work that failed by itself would fail again; anything else may run elsewhere.
        retryable = status.phase is not Phase.FAILED
        await self.backend.stop(job.backend_ref)
        self._part_failed(
            job,
            f"{self.backend.name} {status.phase.value}: {detail}",
            retryable=retryable,
            exit_code=status.exit_code,
        )

    def _follow_progress(self, job: RunningJob, status: PartStatus, checkpoints_seen: int) -> int:
        """Report the steps and checkpoints the work reported since the last look; returns how
        many checkpoints are reported now."""
        if status.step is not None and status.step > job.step:
            job.step = min(status.step, job.steps)
            self._record({"op": "step", "key": job.key, "step": job.step, "gpu_seconds": job.gpu_seconds})
            if job.step < job.steps:
                self._report_progress(job, followed=True)
        for step, uri in status.checkpoints[checkpoints_seen:]:
            self._report(
                subjects.job_report("checkpointed", job.tenant, self.cluster),
                JobCheckpointed(
                    job_id=job.job_id,
                    tenant=job.tenant,
                    cluster=self.cluster,
                    attempt=job.attempt,
                    step=step,
                    checkpoint_uri=uri,
                    at=time.time(),
                ),
                msg_id=f"{job.job_id}:checkpointed:{job.attempt}:{step}",
                carrier=job.carrier,
            )
        return len(status.checkpoints)

    def _part_completed(self, job: RunningJob) -> None:
        """A followed lead part ended well: report it completed with what it really took."""
        elapsed_s = max(time.time() - job.started_at, 1e-6) * self.time_scale
        job.gpu_seconds = elapsed_s * job.job_gpus
        observed_step_s = elapsed_s / max(job.steps, 1)
        self._report_completed(
            job, self.backend.delivered_speed(job.gpu_model, job.task_type), observed_step_s
        )
        self._finish(job)
        self.tasks.pop(job.key, None)
        self.ctx.stats["completed"] = self.ctx.stats.get("completed", 0) + 1

    def _part_failed(
        self, job: RunningJob, reason: str, *, retryable: bool, exit_code: int | None = None
    ) -> None:
        """A followed part ended badly (or could not start): report it (a member under its own id,
        so placement gives the attempt up) and free its GPUs."""
        log.warning("part failed", job_id=job.job_id, attempt=job.attempt, role=job.role, reason=reason)
        if job.lead:
            self._report_failed(
                job.job_id,
                job.tenant,
                job.attempt,
                reason,
                retryable=retryable,
                carrier=job.carrier,
                exit_code=exit_code,
            )
        else:
            self._report_failed(
                job.job_id,
                job.tenant,
                job.attempt,
                f"member part on {self.cluster}: {reason}",
                retryable=True,
                msg_id=f"{job.job_id}:failed:{job.attempt}:{self.cluster}",
            )
        self._finish(job)
        self.tasks.pop(job.key, None)

    # ---- reports -------------------------------------------------------------------------------

    def _report(self, subject: str, message: Struct, *, msg_id: str, carrier: dict[str, str]) -> None:
        """Journal a report and hand it to the sender; one already pending under its id is kept.

        Without a carrier the report continues the current trace (the command being handled).
        """
        if msg_id in self.reports:
            return
        if not carrier:
            carrier = {}
            propagate.inject(carrier)
        report = Report(msg_id=msg_id, subject=subject, payload=encode(message).decode(), carrier=carrier)
        self._record({"op": "report", **_fields(report)})
        self._queue(report)

    def _queue(self, report: Report) -> None:
        self.reports[report.msg_id] = report
        self._pending_changed()
        self._reported.set()

    def _pending_changed(self) -> None:
        self.ctx.stats["reports_pending"] = len(self.reports)
        if self.reports:
            self._all_sent.clear()
        else:
            self._all_sent.set()

    async def _send_reports(self) -> None:
        """Send the journalled reports in order, a batch at a time, until cancelled; while the bus
        fails, try again with a growing pause (the reports wait in the journal meanwhile).

        A batch is written to the connection in order; only a report that fails inside a batch
        whose later reports succeed (a timeout, not an outage) can arrive after them.
        """
        first_backoff_s, max_backoff_s = self.report_backoff_s
        backoff_s = first_backoff_s
        while True:
            if not self.reports:
                self._reported.clear()
                await self._reported.wait()
                continue
            # While the bus fails, one report probes it: a batch would only pile up retries.
            size = REPORT_BATCH if self.send_error is None else 1
            batch = list(itertools.islice(self.reports.values(), size))
            # While the bus works: one attempt each, the batch written at once and its acks
            # awaited together (Publisher.publish_batch: no task and timer per report); what
            # failed stays in the journal and goes again, under its id, after the backoff. The
            # one report that probes a failing bus keeps the retrying publish (which waits out a
            # cluster's leader election and resends as soon as one is elected).
            batched = self.send_error is None
            outcomes: list[BaseException | None]
            if batched:
                outcomes = await self._send_batch(batch)
            else:
                outcomes = await asyncio.gather(*(self._send(r) for r in batch), return_exceptions=True)
            failure: BusError | None = None
            for report, outcome in zip(batch, outcomes, strict=True):
                failure = self._settle_report(report, outcome, batched=batched) or failure
            if failure is None:
                if self.send_error is not None:
                    log.info("reports flowing again", pending=len(self.reports))
                self.send_error = None
                backoff_s = first_backoff_s
                continue
            if self.send_error is None:
                log.warning(
                    "reports cannot be sent; kept in the journal",
                    pending=len(self.reports),
                    error=str(failure),
                )
            self.send_error = str(failure)
            await asyncio.sleep(backoff_s)  # the bus is failing: pause before the next round
            backoff_s = min(backoff_s * 2, max_backoff_s)

    def _settle_report(
        self, report: Report, outcome: BaseException | None, *, batched: bool
    ) -> BusError | None:
        """A sent report's outcome: sent (or refused for good, then dropped) leaves the journal;
        a failure of the bus is returned (the report stays for the next round)."""
        if outcome is None:
            self._sent(report)
        elif refused(outcome):
            # Refused by the stream (no such subject, too large): no retry can deliver it.
            log.error("report refused by the bus; dropped", msg_id=report.msg_id, error=str(outcome))
            self._sent(report)
            self.ctx.stats["reports_dropped"] = self.ctx.stats.get("reports_dropped", 0) + 1
        elif isinstance(outcome, BusError):
            return outcome
        elif batched:
            return BusError(f"report {report.msg_id} not acknowledged: {outcome!r}")
        else:
            raise outcome  # not the bus: a bug for the watchdog to report
        return None

    async def _send(self, report: Report) -> None:
        await self.ctx.publisher.publish_bytes(
            report.subject,
            report.payload.encode(),
            msg_id=report.msg_id,
            parent=propagate.extract(report.carrier) if report.carrier else None,
        )

    async def _send_batch(self, batch: list[Report]) -> list[BaseException | None]:
        """Send reports at once, in order; per report None once the stream acknowledged it."""
        try:
            return await self.ctx.publisher.publish_batch(
                [
                    Outgoing(
                        r.subject,
                        r.payload.encode(),
                        r.msg_id,
                        {},
                        propagate.extract(r.carrier) if r.carrier else None,
                    )
                    for r in batch
                ]
            )
        except Exception as exc:  # the connection is closed: every one failed
            return [exc] * len(batch)

    def _sent(self, report: Report) -> None:
        if self.reports.pop(report.msg_id, None) is None:
            return
        self._record({"op": "sent", "id": report.msg_id})
        self._pending_changed()
        self.ctx.stats["reports_sent"] = self.ctx.stats.get("reports_sent", 0) + 1

    def bus_problem(self) -> str | None:
        """For health: reports waiting because the bus cannot take them, or None."""
        if not self.reports:
            return None
        if self.send_error is None and self.ctx.nc.is_connected:
            return None  # in flight
        return f"nats unavailable, {len(self.reports)} reports journalled"

    # ---- journal -------------------------------------------------------------------------------
    # One JSON line per change (start, began, step, resize, finish, report, sent), appended before
    # the command is acknowledged, so a restarted agent resumes its runs and sends the reports it
    # had not sent; compacted on start and whenever it has grown by ``compact_after_lines``.
    # Appending keeps the cost of a change constant however many jobs run. "began" ends a delayed
    # run's wait. "finish" also records runs stopped or refused before they ran here. "report"
    # holds a message until "sent" says the stream took it. "forget" (written by older agents)
    # undid a start whose event could not be published.

    def _record(self, entry: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.write(journal_line(entry))
            self._journal.flush()
            self._journal_lines += 1
            if self._journal_lines >= self.compact_after_lines:
                self._compact()

    def _restore(self) -> None:
        if self.state_file is None:
            return
        if self.state_file.exists():
            for entry in read_journal(self.state_file):
                self._replay(entry)
            for job in self.running.values():
                self.backend.allocate(job.node_allocations())
            log.info(
                "state restored",
                running=len(self.running),
                finished=len(self.finished),
                reports_pending=len(self.reports),
            )
        self._compact()

    def _compact(self) -> None:
        """Rewrite the journal with what still matters, then append to it."""
        assert self.state_file is not None
        if self._journal is not None:
            self._journal.close()
        tmp = self.state_file.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            for key in sorted(self.finished)[-10_000:]:
                out.write(journal_line({"op": "finish", "key": key}))
            for job in self.running.values():
                out.write(journal_line({"op": "start", "key": job.key, "job": _fields(job)}))
            for report in self.reports.values():
                out.write(journal_line({"op": "report", **_fields(report)}))
        os.replace(tmp, self.state_file)
        self._journal = open(self.state_file, "ab")  # noqa: SIM115 - held for the agent's lifetime
        self._journal_lines = 0

    def _replay(self, entry: dict[str, Any]) -> None:
        """Apply one journal entry (written by :meth:`_record`) to the runs and the reports."""
        if entry["op"] == "report":
            self._queue(Report(**{k: v for k, v in entry.items() if k != "op"}))
            return
        if entry["op"] == "sent":
            self.reports.pop(entry["id"], None)
            self._pending_changed()
            return
        key: str = entry["key"]  # every other entry :meth:`_record` writes has one
        if entry["op"] == "start":
            job = entry["job"]
            job["allocations"] = [tuple(a) for a in job["allocations"]]
            self.running[key] = RunningJob(**job)
        elif entry["op"] == "launched" and key in self.running:
            self.running[key].backend_ref = entry["ref"]
        elif entry["op"] == "phase" and key in self.running:
            self.running[key].backend_phase = entry["phase"]
            self.running[key].started_at = entry.get("at", self.running[key].started_at)
        elif entry["op"] == "began" and key in self.running:
            self.running[key].start_at = 0.0
        elif entry["op"] == "step" and key in self.running:
            self.running[key].step = entry["step"]
            self.running[key].gpu_seconds = entry.get("gpu_seconds", self.running[key].gpu_seconds)
        elif entry["op"] == "resize" and key in self.running:
            self.running[key].workers = entry["workers"]
            self.running[key].allocations = [tuple(a) for a in entry["allocations"]]
        elif entry["op"] == "finish":
            self.running.pop(key, None)
            self.finished.add(key)
        elif entry["op"] == "forget":
            self.running.pop(key, None)
            self.finished.discard(key)


class _Runs(MutableMapping[str, "RunningJob"]):
    """The agent's runs by key (``job:attempt``), indexed by job id as well: a start looks up its
    job's other attempts without walking every run (thousands on a large cluster). Every change
    goes through item assignment or deletion (the mapping mixins build the rest on them), which
    keep the index; reads go straight to the dict."""

    def __init__(self) -> None:
        self._runs: dict[str, RunningJob] = {}
        self._by_job: dict[str, dict[str, RunningJob]] = {}

    def __getitem__(self, key: str) -> "RunningJob":
        return self._runs[key]

    def __setitem__(self, key: str, job: "RunningJob") -> None:
        if key in self._runs:
            del self[key]
        self._runs[key] = job
        self._by_job.setdefault(job.job_id, {})[key] = job

    def __delitem__(self, key: str) -> None:
        job = self._runs.pop(key)
        same = self._by_job[job.job_id]
        del same[key]
        if not same:
            del self._by_job[job.job_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, key: object) -> bool:
        return key in self._runs

    def values(self) -> ValuesView["RunningJob"]:
        return self._runs.values()

    def attempts_of(self, job_id: str) -> list["RunningJob"]:
        """Every run of ``job_id`` here (its attempts)."""
        return list(self._by_job.get(job_id, {}).values())


_JOURNAL_ENCODER = msgspec.json.Encoder()


def journal_line(entry: dict[str, Any]) -> bytes:
    """One journal line: the entry as compact JSON in UTF-8 (:func:`read_journal` reads it back),
    newline ended. msgspec's encoder, not ``json.dumps``: an agent writes ~4 lines a job it starts
    (start, began, report, sent), the report's with the whole event as an escaped string, 5-10x
    slower through ``json.dumps``. Every value is finite (the protocol bounds steps, step times and
    slowdowns), so msgspec's ``null`` for a non-finite float never applies. Unlike ``json.dumps``'s,
    the text is not escaped to ASCII: a label may hold U+2028 or any other character, so a reader
    must split on newline bytes only (:func:`read_journal`)."""
    return _JOURNAL_ENCODER.encode(entry) + b"\n"


def read_journal(path: Path) -> Iterator[dict[str, Any]]:
    """The entries of a journal written by :func:`journal_line` (or, before 2026-12-06, by
    ``json.dumps``), in order. Lines are split on newline bytes alone (``str.splitlines`` also
    splits at U+2028, U+2029 and U+0085, which a label may hold), and each is decoded on its own:
    a line that is not a JSON object (a torn last line from a crash, cut even inside a character)
    is skipped."""
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:  # UnicodeDecodeError is one
            continue
        if isinstance(entry, dict):
            yield entry


def _fields(record: "RunningJob | Report") -> dict[str, Any]:
    """A journal record's fields, for :func:`journal_line` (which walks the lists and dicts
    itself: no deep copy first, as :func:`dataclasses.asdict` makes)."""
    return {name: getattr(record, name) for name in _FIELD_NAMES[type(record)]}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {
    RunningJob: tuple(f.name for f in fields(RunningJob)),
    Report: tuple(f.name for f in fields(Report)),
}


def _per_node(allocations: Iterable[tuple[str, int]]) -> dict[str, int]:
    """GPUs per node, however the allocations list them."""
    totals: dict[str, int] = {}
    for node, gpus in allocations:
        totals[node] = totals.get(node, 0) + gpus
    return totals


async def _complete(work: Awaitable[None]) -> None:
    """Run ``work`` to its end even if the caller is cancelled meanwhile (once or more), then
    re-raise that cancellation; an error of ``work`` propagates (after any cancellation: a
    cancelled caller ends cancelled)."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])  # raises only the caller's cancellation, never the work's error
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            log.warning("stop cleanup failed", error=repr(task.exception()))
        raise asyncio.CancelledError
    task.result()


async def _answer_alive(msg: Msg) -> None:
    """Answer a liveness ping (empty): this agent's connection is up."""
    await respond(msg, b"")

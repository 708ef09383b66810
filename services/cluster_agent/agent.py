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
"""

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog
from opentelemetry import propagate
from opentelemetry.context import Context

from loom.bus import BusError, ConsumerRunner, ConsumerSpec, Delivery
from loom.errors import InvalidInputError
from loom.model.family import job_family
from loom.model.heartbeat import next_interval_s
from loom.runtime.service import ServiceContext
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
    StopJob,
)
from loom_proto.jobs import JobCheckpointed, JobCompleted, JobFailed, JobProgress, JobStarted, NodeAllocation
from loom_services.cluster_agent.sim import SimCluster

log = structlog.get_logger("cluster_agent")


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
    def worker_share(self) -> float:
        """The workers it has over the workers it asked for; its speed is proportional to it."""
        return self.workers / max(self.spec_workers, 1)

    def node_allocations(self) -> list[NodeAllocation]:
        """The run's allocations as wire structs."""
        return [NodeAllocation(node=n, gpus=g) for n, g in self.allocations]


class Agent:
    """One cluster's agent; :meth:`run` is the service body."""

    def __init__(
        self,
        ctx: ServiceContext,
        sim: SimCluster,
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
        self.sim = sim
        self.cluster = sim.cluster.id
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
        self.progress_every = progress_every
        self.epoch = time.time_ns() // 1_000_000
        self.seq = 0
        self.running: dict[str, RunningJob] = {}
        self.finished: set[str] = set()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._resized: dict[str, asyncio.Event] = {}
        """Per run: set when a resize changes its speed, so the sleeping run recomputes it."""
        self.state_file = (state_dir / f"agent-{self.cluster}.jsonl") if state_dir else None
        self._journal: IO[str] | None = None
        ctx.stats.update({"cluster": self.cluster, "running": 0, "completed": 0})

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
        )
        await self.heartbeat(full=True)
        await self.publish_profiles()
        await runner.start()
        for job in list(self.running.values()):
            self._launch(job)
        beat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self.ctx.stopping.wait()
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await runner.stop()
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            if self._journal is not None:
                self._journal.close()

    async def publish_profiles(self) -> None:
        """Tell the platform what each accelerator model of this cluster delivers."""
        models = sorted({n.gpu_model for n in self.sim.nodes.values() if n.gpu_model})
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
            self.interval_s = next_interval_s(
                self.interval_s, bool(self.sim.dirty), min_s=self.heartbeat_s, max_s=self.max_heartbeat_s
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
            nodes=self.sim.report(full or self.seq == 1),
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
        elif isinstance(command, StopJob):
            await self._stop(command.job_id, command.attempt, command.reason or "stopped by command")
        elif isinstance(command, ResizeJob):
            await self._resize(command)
        elif isinstance(command, CheckpointJob):
            job = self.running.get(f"{command.job_id}:{command.attempt}")
            if job is not None and job.lead and not job.waiting:
                await self._checkpoint(job)
        elif isinstance(command, DrainCluster):
            self.sim.drain(command.nodes)
            self._changed.set()

    async def _start(self, command: StartJob) -> None:
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
        refusal = self.sim.refusal(command.gpu_model, command.allocations)
        if refusal is not None:
            await self._refuse_start(command, refusal)
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
            start_at=time.time() + wait_s if wait_s > 0 else 0.0,
            family=job_family(spec),
        )
        self.sim.allocate(command.allocations)
        self._changed.set()
        self.running[key] = job
        self._record({"op": "start", "key": key, "job": asdict(job)})
        if not job.lead or job.waiting:
            # A waiting run reports ``started`` from its task, when the wait ends.
            self._launch(job)
            return
        try:
            await self._publish_started(job)
        except BaseException:
            # Not started after all: forget the run, so the redelivered command starts it afresh.
            if self.running.get(key) is job:
                self.running.pop(key)
                self.sim.free(job.node_allocations())
                self._changed.set()
                self._record({"op": "forget", "key": key})
            raise
        # A stop handled while the started event was in flight has already ended the run.
        if self.running.get(key) is job:
            self._launch(job)

    async def _refuse_start(self, command: StartJob, refusal: str) -> None:
        """Tell placement a part cannot start here, so it gives the attempt up and places it elsewhere.

        The attempt is finished here from now on (a redelivered command is refused without a
        word), unless the event cannot be published: then the redelivered command tries again.
        """
        key = f"{command.job_id}:{command.attempt}"
        spec = command.spec
        lead = command.role == "lead"
        log.warning(
            "start refused", job_id=command.job_id, attempt=command.attempt, role=command.role, reason=refusal
        )
        self.finished.add(key)
        self._record({"op": "finish", "key": key})
        try:
            if lead:
                await self._publish_failed(
                    spec.job_id, spec.tenant, command.attempt, f"cannot start: {refusal}", retryable=True
                )
            else:
                await self._publish_failed(
                    spec.job_id,
                    spec.tenant,
                    command.attempt,
                    f"member part on {self.cluster} could not start: {refusal}",
                    retryable=True,
                    msg_id=f"{spec.job_id}:failed:{command.attempt}:{self.cluster}",
                )
                await self._publish_refusal(
                    command.job_id, command.attempt, f"cannot start member part: {refusal}"
                )
        except BaseException:
            self.finished.discard(key)
            self._record({"op": "forget", "key": key})
            raise

    def _launch(self, job: RunningJob) -> None:
        # A member part has no clock: it holds its GPUs until stopped.
        if job.lead:
            self.tasks[job.key] = asyncio.create_task(self._execute(job), name=f"job-{job.key}")
        self.ctx.stats["running"] = len(self.running)

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
        task = self.tasks.pop(key, None)
        if task is not None:
            task.cancel()
        # GPUs are free from here on, before any await: a command handled alongside this one (a
        # resize growing into them) sees them free.
        self._finish(job)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if job.lead:
            await self._publish_failed(
                job.job_id, job.tenant, job.attempt, reason, retryable=True, carrier=job.carrier
            )

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
        refusal = self.sim.resize_refusal(job.gpu_model, job.node_allocations(), command.allocations)
        if refusal is not None:
            log.warning("resize refused", job_id=job.job_id, attempt=job.attempt, reason=refusal)
            await self._publish_refusal(job.job_id, job.attempt, f"cannot resize: {refusal}")
            return
        self.sim.free(job.node_allocations())
        job.allocations = sorted(wanted.items())
        job.workers = command.workers
        self.sim.allocate(job.node_allocations())
        self._changed.set()
        self._record({"op": "resize", "key": key, "workers": job.workers, "allocations": job.allocations})
        wakeup = self._resized.get(key)
        if wakeup is not None:
            wakeup.set()
        log.info("run resized", job_id=job.job_id, attempt=job.attempt, workers=job.workers, gpus=job.gpus)

    # ---- running a job -------------------------------------------------------------------------

    def step_seconds(self, job: RunningJob) -> float:
        """Simulated seconds one step of the run takes here now (slowdown and workers included)."""
        return self.sim.step_seconds(
            job.step_time_s,
            job.gpu_model,
            job.task_type,
            slowdown=job.slowdown,
            worker_share=job.worker_share,
            family=job.family,
        )

    async def _execute(self, job: RunningJob) -> None:
        """Wait out a delayed start, then advance the job in chunks of ``progress_every`` of its
        work, reporting each chunk."""
        chunk = max(int(job.steps * self.progress_every), 1)
        parent = propagate.extract(job.carrier)
        wakeup = self._resized.setdefault(job.key, asyncio.Event())
        try:
            if job.waiting:
                await self._begin(job)
            await self._run_steps(job, chunk, parent, wakeup)
        finally:
            self._resized.pop(job.key, None)

    async def _begin(self, job: RunningJob) -> None:
        """Hold the GPUs until the run's start time, then report it started.

        The start command was acknowledged long ago, so a started event that cannot be published
        is retried here until it is (or the run is stopped).
        """
        wait_s = job.start_at - time.time()
        if wait_s > 0:
            log.info(
                "run waits before starting", job_id=job.job_id, attempt=job.attempt, wait_s=round(wait_s, 3)
            )
            await asyncio.sleep(wait_s)
        while True:
            try:
                await self._publish_started(job)
                break
            except BusError as exc:
                log.warning("started event not published; retrying", job_id=job.job_id, error=str(exc))
                await asyncio.sleep(1.0)
        job.start_at = 0.0
        job.started_at = time.time()
        self._record({"op": "began", "key": job.key})

    async def _publish_started(self, job: RunningJob) -> None:
        await self.ctx.publisher.publish(
            subjects.job_event("started", job.tenant),
            JobStarted(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=self.cluster,
                attempt=job.attempt,
                started_at=time.time(),
            ),
            msg_id=f"{job.job_id}:started:{job.attempt}",
            parent=propagate.extract(job.carrier),
        )

    async def _work(self, job: RunningJob, steps: int, wakeup: asyncio.Event) -> None:
        """Spend the time ``steps`` take, at the run's speed; a resize changes the speed midway."""
        loop = asyncio.get_running_loop()
        left = float(steps)
        while left > 0:
            step_s = self.step_seconds(job)
            gpus = job.gpus
            wakeup.clear()
            began = loop.time()
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=left * step_s / self.time_scale)
            except TimeoutError:
                done = left
            else:  # resized: count what was done at the old speed, go on at the new one
                done = min((loop.time() - began) * self.time_scale / step_s, left)
            job.gpu_seconds += done * step_s * gpus
            left -= done

    async def _run_steps(self, job: RunningJob, chunk: int, parent: Context, wakeup: asyncio.Event) -> None:
        while job.step < job.steps:
            steps = min(chunk, job.steps - job.step)
            await self._work(job, steps, wakeup)
            before = job.step
            job.step += steps
            if (
                job.checkpoint_every_steps
                and job.step // job.checkpoint_every_steps > before // job.checkpoint_every_steps
            ):
                await self._checkpoint(job)
            if job.step < job.steps:
                await self.ctx.publisher.publish(
                    subjects.job_event("progress", job.tenant),
                    JobProgress(
                        job_id=job.job_id,
                        tenant=job.tenant,
                        cluster=self.cluster,
                        attempt=job.attempt,
                        step=job.step,
                        steps=job.steps,
                        at=time.time(),
                    ),
                    msg_id=f"{job.job_id}:progress:{job.attempt}:{job.step}",
                    parent=parent,
                )
            self._record({"op": "step", "key": job.key, "step": job.step, "gpu_seconds": job.gpu_seconds})
        # Per-GPU compute speed, without slowdown or worker share: metrics compares it with the
        # model's claimed SCU to learn how much this cluster really delivers.
        speed = self.sim.delivered_speed(job.gpu_model, job.task_type)
        # Compute seconds per step on this model with all workers: what the job's family really
        # gets here, for placement's speed learner.
        observed_step_s = self.sim.compute_step_seconds(
            job.step_time_s, job.gpu_model, job.task_type, job.family
        )
        await self.ctx.publisher.publish(
            subjects.job_event("completed", job.tenant),
            JobCompleted(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=self.cluster,
                attempt=job.attempt,
                gpu_seconds=job.gpu_seconds,
                at=time.time(),
                gpu_model=job.gpu_model,
                task_type=job.task_type,  # type: ignore[arg-type]  # validated when the job was accepted
                delivered_speed=round(speed, 6),
                observed_step_s=min(max(observed_step_s, 1e-9), 86_400.0),
            ),
            msg_id=f"{job.job_id}:completed:{job.attempt}",
            parent=parent,
        )
        self._finish(job)
        self.tasks.pop(job.key, None)
        self.ctx.stats["completed"] = self.ctx.stats.get("completed", 0) + 1

    async def _checkpoint(self, job: RunningJob) -> None:
        await self.ctx.publisher.publish(
            subjects.job_event("checkpointed", job.tenant),
            JobCheckpointed(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=self.cluster,
                attempt=job.attempt,
                step=job.step,
                checkpoint_uri=f"sim://{self.cluster}/{job.job_id}/{job.attempt}/{job.step}",
                at=time.time(),
            ),
            msg_id=f"{job.job_id}:checkpointed:{job.attempt}:{job.step}",
            parent=propagate.extract(job.carrier),
        )

    def _finish(self, job: RunningJob) -> None:
        if self.running.get(job.key) is not job:
            return  # already finished (a stop and the run's own end can race)
        self.running.pop(job.key)
        self.finished.add(job.key)
        self.sim.free(job.node_allocations())
        self._changed.set()
        self.ctx.stats["running"] = len(self.running)
        self._record({"op": "finish", "key": job.key})

    async def _publish_failed(
        self,
        job_id: str,
        tenant: str,
        attempt: int,
        reason: str,
        *,
        retryable: bool,
        carrier: dict[str, str] | None = None,
        msg_id: str | None = None,
    ) -> None:
        await self.ctx.publisher.publish(
            subjects.job_event("failed", tenant),
            JobFailed(
                job_id=job_id,
                tenant=tenant,
                cluster=self.cluster,
                attempt=attempt,
                reason=reason,
                retryable=retryable,
                at=time.time(),
            ),
            msg_id=msg_id or f"{job_id}:failed:{attempt}",
            parent=propagate.extract(carrier) if carrier else None,
        )

    async def _publish_refusal(self, job_id: str, attempt: int, detail: str) -> None:
        """Say on the cluster's status subject that a command about a run could not be carried out
        (for a member part, which must not publish job events)."""
        await self.ctx.publisher.publish(
            subjects.cluster_status(self.cluster),
            ClusterStatus(
                cluster=self.cluster, state="ready", detail=detail[:2048], job_id=job_id, at=time.time()
            ),
            msg_id=f"refused-{self.cluster}-{job_id}-{attempt}-{self.epoch}-{time.time_ns()}",
        )

    # ---- journal -------------------------------------------------------------------------------
    # One JSON line per change (start, began, step, resize, finish, forget), appended before the
    # command is acknowledged, so a restarted agent resumes its runs; compacted on start. Appending
    # keeps the cost of a change constant however many jobs run. "began" ends a delayed run's wait.
    # "finish" also records runs stopped or refused before they ran here. "forget" undoes a start
    # (or a refusal) whose event could not be published, so the redelivered command is handled
    # afresh.

    def _record(self, entry: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.write(json.dumps(entry) + "\n")
            self._journal.flush()

    def _restore(self) -> None:
        if self.state_file is None:
            return
        if self.state_file.exists():
            for line in self.state_file.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a crash
                self._replay(entry)
            for job in self.running.values():
                self.sim.allocate(job.node_allocations())
            log.info("state restored", running=len(self.running), finished=len(self.finished))
        # Compact: rewrite the journal with what still matters, then append to it.
        tmp = self.state_file.with_suffix(".tmp")
        with open(tmp, "w") as out:
            for key in sorted(self.finished)[-10_000:]:
                out.write(json.dumps({"op": "finish", "key": key}) + "\n")
            for job in self.running.values():
                out.write(json.dumps({"op": "start", "key": job.key, "job": asdict(job)}) + "\n")
        os.replace(tmp, self.state_file)
        self._journal = open(self.state_file, "a")  # noqa: SIM115 - held for the agent's lifetime

    def _replay(self, entry: dict[str, Any]) -> None:
        """Apply one journal entry (written by :meth:`_record`) to the running and finished runs."""
        key: str = entry["key"]  # every entry :meth:`_record` writes has one
        if entry["op"] == "start":
            job = entry["job"]
            job["allocations"] = [tuple(a) for a in job["allocations"]]
            self.running[key] = RunningJob(**job)
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


def _per_node(allocations: Iterable[tuple[str, int]]) -> dict[str, int]:
    """GPUs per node, however the allocations list them."""
    totals: dict[str, int] = {}
    for node, gpus in allocations:
        totals[node] = totals.get(node, 0) + gpus
    return totals

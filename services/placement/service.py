"""Placement: admits submitted jobs, decides where they run, reserves capacity, commands agents.

Sole writer of jobs, job events, the capacity book and reservations. Every decision is made in one
PostgreSQL transaction together with the inbox claim of the messages that caused it and the
outbox rows of the messages it implies, so a crash at any point neither loses nor doubles a
decision: the redelivered submission finds its claim, and the outbox is flushed on restart.
"""

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import asyncpg
import msgspec
import structlog
from nats.aio.msg import Msg
from opentelemetry import propagate
from opentelemetry.context import Context

from loom.bus import BusError, ConsumerRunner, ConsumerSpec, Delivery
from loom.errors import InvalidInputError
from loom.runtime.service import ServiceContext
from loom.sched.firstfit import CapacityIndex, NodeCapacity, Placement, Unschedulable
from loom.store import inbox, outbox
from loom.store import jobs as repo
from loom.store.pool import ConflictError, transaction, with_retry
from loom_proto import subjects
from loom_proto.clusters import StartJob
from loom_proto.codec import DecodeError, decode, encode
from loom_proto.ids import InvalidIdError, validate_id
from loom_proto.jobs import (
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobProgress,
    JobRejected,
    JobSpec,
    JobStarted,
    JobSubmitted,
    NodeAllocation,
    RejectCode,
)
from loom_proto.view import ViewDelta

log = structlog.get_logger("placement")

PRODUCER = "placement"
LIFECYCLE_SUBJECTS = [
    f"loom.jobs.{k}.*" for k in ("started", "progress", "checkpointed", "completed", "failed", "cancelled")
]
LifecycleEvent = JobStarted | JobProgress | JobCheckpointed | JobCompleted | JobFailed | JobCancelled


@dataclass(frozen=True)
class QueuedJob:
    """A job accepted and waiting for a placement, with the trace context it arrived in."""

    job: JobSubmitted
    carrier: dict[str, str]

    @property
    def context(self) -> Context:
        """The submission's trace context."""
        return propagate.extract(self.carrier)


def _order(q: QueuedJob) -> tuple[int, float, str]:
    # Higher priority first, then first come, first served.
    return (-q.job.priority, q.job.submitted_at, q.job.job_id)


def rejection(job_id: str, tenant: str, code: RejectCode, reason: str) -> JobRejected:
    """A JobRejected event stamped now."""
    return JobRejected(job_id=job_id[:256], tenant=tenant, code=code, reason=reason, at=time.time())


class PlacementService:
    """The placement service's state and handlers; :meth:`run` is the service body."""

    def __init__(self, ctx: ServiceContext, *, batch: int = 200, settle_s: float = 5.0) -> None:
        self.ctx = ctx
        self.pool = ctx.db
        self.relay = outbox.OutboxRelay(self.pool, ctx.publisher, PRODUCER)
        self.nodes: dict[str, NodeCapacity] = {}
        self.queue: dict[str, QueuedJob] = {}
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.batch = batch
        # A job that fits no known cluster is rejected only once the set of clusters has been
        # stable for ``settle_s``: right after a start (or a cluster joining) the capacity book
        # may simply not know the cluster that fits yet.
        self.settle_s = settle_s
        self.settled_at = time.monotonic() + settle_s
        self.stats = ctx.stats
        # Messages of the cycle in progress; published straight after its commit.
        self._outgoing: list[outbox.OutboxMessage] = []
        self._sending: set[asyncio.Task[int]] = set()
        self.stats.update({"placed": 0, "rejected": 0, "queued": 0, "released": 0})
        self.cluster_trust: dict[str, float] = {}
        """How far each cluster's claimed compute is believed, from the view (a plugin input)."""

    # ---- start-up ------------------------------------------------------------------------------

    async def load(self) -> None:
        """Rebuild the in-memory capacity book and queue from PostgreSQL, then publish leftovers."""
        self.nodes = await repo.load_nodes(self.pool)
        for row in await repo.queued_jobs(self.pool):
            job = msgspec.json.decode(row["spec"], type=JobSubmitted)
            self.queue[job.job_id] = QueuedJob(job, json.loads(row["trace_context"]))
        await self.relay.flush()
        self.stats["queued"] = len(self.queue)
        log.info("state rebuilt", nodes=len(self.nodes), queued=len(self.queue))

    async def run(self) -> None:
        """Consume submissions, view deltas and lifecycle events until asked to stop."""
        await self.load()
        runners = [
            ConsumerRunner(
                self.ctx.nc,
                ConsumerSpec(
                    stream="VIEW", durable="placement-view", filter_subjects=[subjects.VIEW_DELTAS_ALL]
                ),
                ViewDelta,
                handler=self.on_view_delta,
                publisher=self.ctx.publisher,
            ),
            ConsumerRunner(
                self.ctx.nc,
                ConsumerSpec(
                    stream="JOBS",
                    durable="placement-lifecycle",
                    filter_subjects=LIFECYCLE_SUBJECTS,
                    batch=self.batch,
                ),
                bytes,
                batch_handler=self.on_lifecycle,
                publisher=self.ctx.publisher,
            ),
            ConsumerRunner(
                self.ctx.nc,
                ConsumerSpec(
                    stream="JOBS",
                    durable="placement-submitted",
                    filter_subjects=[subjects.JOBS_SUBMITTED_ALL],
                    batch=self.batch,
                ),
                bytes,
                batch_handler=self.on_submitted,
                publisher=self.ctx.publisher,
            ),
        ]
        query_sub = await self.ctx.nc.subscribe(subjects.JOBS_QUERY, cb=self.on_query)
        for runner in runners:
            await runner.start()
        requeue = asyncio.create_task(self._requeue_loop())
        relay_stop = asyncio.Event()
        relay = asyncio.create_task(self.relay.run(relay_stop))
        try:
            await self.ctx.stopping.wait()
        finally:
            requeue.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await requeue
            await query_sub.unsubscribe()
            for runner in reversed(runners):
                await runner.stop()
            await asyncio.gather(*self._sending, return_exceptions=True)
            relay_stop.set()
            self.relay.kick()
            await relay

    # ---- submissions ---------------------------------------------------------------------------

    async def on_submitted(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """Validate a batch of submissions, then admit and place the valid ones in one transaction."""
        outcomes: list[BaseException | None] = [None] * len(deliveries)
        accepted: list[tuple[Delivery[bytes], JobSubmitted]] = []
        for i, d in enumerate(deliveries):
            tenant = d.subject.rsplit(".", 1)[-1]
            try:
                validate_id(tenant, "tenant")
            except InvalidIdError as exc:
                outcomes[i] = InvalidInputError(f"submission on subject {d.subject!r}: {exc}")
                continue
            try:
                job = decode(d.message, JobSubmitted)
                if job.tenant != tenant:
                    raise DecodeError(
                        f"tenant {job.tenant!r} in the job differs from {tenant!r} in the subject"
                    )
            except DecodeError as exc:
                outcomes[i] = await self._reject_invalid(d, tenant, str(exc))
                continue
            accepted.append((d, job))
        if accepted:
            try:
                async with self.lock:
                    await self._retrying(lambda: self._admit(accepted))
            except Exception as exc:
                for d, _ in accepted:
                    outcomes[deliveries.index(d)] = exc
                return outcomes
        return outcomes

    async def _reject_invalid(self, d: Delivery[bytes], tenant: str, reason: str) -> BaseException | None:
        """Tell the submitter why the payload is unusable; nothing is stored."""
        job_id = d.msg_id or _payload_job_id(d.message) or f"seq-{d.stream_seq}"
        event = rejection(job_id, tenant, "invalid", f"invalid job submission: {reason}")
        log.warning("submission rejected", job_id=job_id, tenant=tenant, reason=reason)
        try:
            await self.ctx.publisher.publish(
                subjects.job_event("rejected", tenant),
                event,
                msg_id=f"rejected-{d.msg_id or 'seq'}-{d.stream_seq}",
                parent=d.context,
            )
        except BusError as exc:
            return exc
        self.stats["rejected"] += 1
        return None

    async def _admit(self, accepted: list[tuple[Delivery[bytes], JobSubmitted]]) -> None:
        now = time.time()
        async with transaction(self.pool) as conn:
            msg_ids = [d.msg_id or f"JOBS-{d.stream_seq}" for d, _ in accepted]
            fresh = await inbox.claim_many(conn, PRODUCER, msg_ids)
            candidates: list[QueuedJob] = []
            dup_rejects: list[outbox.OutboxMessage] = []
            new_rows: list[repo.NewJob] = []
            for (d, submitted), msg_id in zip(accepted, msg_ids, strict=True):
                if msg_id not in fresh:
                    continue  # handled before: its decision and messages are already durable
                job = (
                    submitted
                    if submitted.submitted_at
                    else msgspec.structs.replace(submitted, submitted_at=now)
                )
                carrier: dict[str, str] = {}
                propagate.inject(carrier, context=d.context)
                new_rows.append(repo.NewJob(job.job_id, job.tenant, encode(job), job.submitted_at, carrier))
                candidates.append(QueuedJob(job, carrier))
            inserted = await repo.insert_jobs(conn, new_rows)
            admitted = []
            for q in candidates:
                if q.job.job_id in inserted:
                    admitted.append(q)
                else:
                    reason = f"job id {q.job.job_id!r} was already submitted; choose a new job id"
                    dup_rejects.append(
                        outbox.message(
                            subjects.job_event("rejected", q.job.tenant),
                            rejection(q.job.job_id, q.job.tenant, "duplicate", reason),
                            f"{q.job.job_id}:rejected:duplicate:{hash_carrier(q)}",
                            context=q.context,
                        )
                    )
            await repo.append_events(
                conn,
                [
                    repo.JobEventRow(
                        q.job.job_id,
                        "submitted",
                        f"{q.job.job_id}:submitted",
                        encode(q.job),
                        q.job.submitted_at,
                    )
                    for q in admitted
                ],
            )
            await outbox.add(conn, PRODUCER, dup_rejects)
            placements, placed, rejected = await self._schedule(conn, admitted)
        self._commit(placements, admitted, placed, rejected)
        self._send(dup_rejects + self._outgoing)

    # ---- the scheduling cycle --------------------------------------------------------------------

    async def _schedule(
        self, conn: asyncpg.Connection, jobs: list[QueuedJob]
    ) -> tuple[list[Placement], list[str], list[str]]:
        """Decide for ``jobs`` in queue order on the capacity book as it is now; write it all.

        The book itself changes only after the commit (:meth:`_commit`), by the reservations made.
        """
        index = CapacityIndex(self.nodes)
        decisions: list[tuple[QueuedJob, Placement]] = []
        rejected: list[tuple[QueuedJob, str]] = []
        for q in sorted(jobs, key=_order):
            result = index.place(q.job)
            if isinstance(result, Placement):
                index.take(result)
                decisions.append((q, result))
            elif (
                isinstance(result, Unschedulable)
                and result.impossible
                and time.monotonic() >= self.settled_at
            ):
                rejected.append((q, result.reason))
        now = time.time()
        await repo.reserve(conn, [(q.job.job_id, 1, p.cluster, p.allocations) for q, p in decisions])
        await repo.mark_placed(conn, [(q.job.job_id, p.cluster, 1, now) for q, p in decisions])
        await repo.mark_rejected(conn, [(q.job.job_id, reason) for q, reason in rejected])
        messages: list[outbox.OutboxMessage] = []
        events: list[repo.JobEventRow] = []
        for q, p in decisions:
            job = q.job
            allocations = [NodeAllocation(node=n, gpus=g) for n, g in p.allocations]
            placed = JobPlaced(
                job_id=job.job_id,
                tenant=job.tenant,
                cluster=p.cluster,
                region=p.region,
                gpu_model=p.gpu_model,
                allocations=allocations,
                placed_at=now,
                submitted_at=job.submitted_at,
            )
            start = StartJob(
                job_id=job.job_id, spec=_spec_of(job), gpu_model=p.gpu_model, allocations=allocations
            )
            messages.append(
                outbox.message(
                    subjects.job_placed(p.cluster), placed, f"{job.job_id}:placed:1", context=q.context
                )
            )
            messages.append(
                outbox.message(
                    subjects.cluster_command(p.cluster, "start"),
                    start,
                    f"{job.job_id}:start:1",
                    context=q.context,
                )
            )
            events.append(
                repo.JobEventRow(job.job_id, "placed", f"{job.job_id}:placed:1", encode(placed), now)
            )
        for q, reason in rejected:
            event = rejection(q.job.job_id, q.job.tenant, "impossible", reason)
            msg_id = f"{q.job.job_id}:rejected"
            messages.append(
                outbox.message(subjects.job_event("rejected", q.job.tenant), event, msg_id, context=q.context)
            )
            events.append(repo.JobEventRow(q.job.job_id, "rejected", msg_id, encode(event), now))
        await repo.append_events(conn, events)
        await outbox.add(conn, PRODUCER, messages)
        self._outgoing = messages
        return (
            [p for _, p in decisions],
            [q.job.job_id for q, _ in decisions],
            [q.job.job_id for q, _ in rejected],
        )

    def _commit(
        self,
        placements: list[Placement],
        considered: list[QueuedJob],
        placed: list[str],
        rejected: list[str],
    ) -> None:
        """Adopt a committed cycle's outcome in memory.

        Only the reservations made are applied (no await in here), so view deltas and releases
        that changed the book while the cycle's transaction ran are kept.
        """
        for placement in placements:
            for node, gpus in placement.allocations:
                cap = self.nodes[node]
                self.nodes[node] = dataclasses.replace(cap, gpus_reserved=cap.gpus_reserved + gpus)
        done = set(placed) | set(rejected)
        for q in considered:
            if q.job.job_id in done:
                self.queue.pop(q.job.job_id, None)
            else:
                self.queue[q.job.job_id] = q
        self.stats["placed"] += len(placed)
        self.stats["rejected"] += len(rejected)
        self.stats["queued"] = len(self.queue)

    async def _requeue_loop(self) -> None:
        """Retry queued jobs whenever capacity may have changed (and every few seconds regardless)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=1.0)
            self.wake.clear()
            if not self.queue:
                continue
            try:
                async with self.lock:
                    await self._retrying(self._requeue_cycle)
            except Exception as exc:
                log.warning("requeue cycle failed", error=repr(exc))
            self.relay.kick()

    async def _requeue_cycle(self) -> None:
        waiting = list(self.queue.values())
        async with transaction(self.pool) as conn:
            placements, placed, rejected = await self._schedule(conn, waiting)
        self._commit(placements, waiting, placed, rejected)
        self._send(self._outgoing)

    def _send(self, messages: list[outbox.OutboxMessage]) -> None:
        """Publish a committed cycle's messages in the background (the outbox has them anyway)."""
        if not messages:
            return
        task = asyncio.create_task(self.relay.publish_now(messages))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _retrying(self, cycle: Callable[[], Awaitable[None]], attempts: int = 3) -> None:
        """Run a decision cycle; when it lost a race for capacity, reload the book and decide again."""
        for attempt in range(1, attempts + 1):
            try:
                await cycle()
                return
            except ConflictError:
                self.stats["conflicts"] = self.stats.get("conflicts", 0) + 1
                log.info("decision lost a race for capacity; deciding again on a fresh book", attempt=attempt)
                self.nodes = await repo.load_nodes(self.pool)
                if attempt == attempts:
                    raise

    # ---- capacity ------------------------------------------------------------------------------

    async def on_view_delta(self, d: Delivery[ViewDelta]) -> None:
        """Follow the ledger: node totals, models and whether a node takes new work."""
        delta = d.message
        if delta.trust is not None:
            self.cluster_trust[delta.cluster] = delta.trust
            self.stats["trust"] = dict(sorted(self.cluster_trust.items()))
        changed: list[NodeCapacity] = []
        listed = set()
        for n in delta.nodes:
            listed.add(n.node)
            old = self.nodes.get(n.node)
            changed.append(
                NodeCapacity(
                    node=n.node,
                    cluster=delta.cluster,
                    region=delta.region,
                    zone=n.zone,
                    gpu_model=n.gpu_model,
                    gpus_total=n.gpus_total,
                    gpus_reserved=old.gpus_reserved if old else 0,
                    schedulable=n.healthy and not delta.stale,
                )
            )
        if not any(c.cluster == delta.cluster for c in self.nodes.values()):
            self.settled_at = time.monotonic() + self.settle_s
        gone = set(delta.removed)
        for cap in self.nodes.values():
            if cap.cluster != delta.cluster or cap.node in listed:
                continue
            if delta.stale or cap.node in gone or delta.full:
                changed.append(dataclasses.replace(cap, schedulable=False))
        # Only what placement decides on: a delta that just moves used or reserved GPUs changes nothing here.
        changed = [cap for cap in changed if _book_differs(self.nodes.get(cap.node), cap)]
        if not changed:
            return
        async with transaction(self.pool) as conn:
            await repo.upsert_nodes(conn, delta.version, changed)
        # Totals and schedulability come from the view; reservations are placement's, taken as
        # they are at this moment (no await below), so a cycle committed meanwhile is kept.
        # Decision cycles need not wait for this: the store refuses a reservation on a node
        # that became unschedulable, and the cycle then decides again on a fresh book.
        for cap in changed:
            current = self.nodes.get(cap.node)
            reserved = current.gpus_reserved if current else 0
            self.nodes[cap.node] = dataclasses.replace(cap, gpus_reserved=reserved)
        self.wake.set()

    # ---- lifecycle -----------------------------------------------------------------------------

    async def on_lifecycle(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """Record what agents report; a finished run gives its GPUs back."""
        outcomes: list[BaseException | None] = [None] * len(deliveries)
        events: list[tuple[LifecycleEvent, str]] = []
        for i, d in enumerate(deliveries):
            try:
                event = decode(d.message, LifecycleEvent)  # type: ignore[arg-type]
            except DecodeError as exc:
                outcomes[i] = InvalidInputError(f"lifecycle event on {d.subject}: {exc}")
                continue
            events.append((event, d.msg_id or f"JOBS-{d.stream_seq}"))
        if not events:
            return outcomes
        released_any = False

        async def apply() -> None:
            nonlocal released_any
            released: list[tuple[str, int]] = []
            async with transaction(self.pool) as conn:
                fresh = await repo.append_events(
                    conn,
                    [repo.JobEventRow(e.job_id, _kind(e), mid, encode(e), _at(e)) for e, mid in events],
                )
                new = [e for e, mid in events if mid in fresh]
                await repo.confirm(conn, [(e.job_id, e.attempt) for e in new if isinstance(e, JobStarted)])
                await repo.set_progress(
                    conn, [(e.job_id, e.attempt, e.step / e.steps) for e in new if isinstance(e, JobProgress)]
                )
                for e in new:
                    if isinstance(e, JobCompleted | JobFailed):
                        state = "completed" if isinstance(e, JobCompleted) else "failed"
                        reason = e.reason if isinstance(e, JobFailed) else None
                        await repo.finish(conn, e.job_id, e.attempt, state, reason)
                        released += await repo.release(conn, e.job_id, e.attempt)
            if released:
                released_any = True
                for node, gpus in released:
                    cap = self.nodes.get(node)
                    if cap is not None:
                        self.nodes[node] = dataclasses.replace(
                            cap, gpus_reserved=max(cap.gpus_reserved - gpus, 0)
                        )
                self.stats["released"] += len(released)

        try:
            # Releases are applied to the book without an await in between, so they need no lock:
            # a decision cycle running meanwhile adds only its own reservations on commit.
            await with_retry(apply)
        except Exception as exc:
            return [o if o is not None else exc for o in outcomes]
        if released_any:
            self.wake.set()
        return outcomes

    # ---- queries -------------------------------------------------------------------------------

    async def on_query(self, msg: Msg) -> None:
        """``loom.jobs.query``: {"op": "get", "job_id"} or {"op": "list", "tenant"?, "state"?, "limit"?}."""
        try:
            request = json.loads(msg.data or b"{}")
            op = request.get("op", "list")
            if op == "get":
                result: object = await repo.get_job(self.pool, str(request["job_id"]))
            elif op == "list":
                result = await repo.list_jobs(
                    self.pool,
                    tenant=request.get("tenant"),
                    state=request.get("state"),
                    limit=min(int(request.get("limit", 100)), 10_000),
                )
            elif op == "counts":
                result = await repo.count_by_state(self.pool)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as exc:  # any bad request gets an answer, never a crash
            reply = {"ok": False, "error": str(exc)}
        await msg.respond(json.dumps(reply).encode())


def _book_differs(old: NodeCapacity | None, new: NodeCapacity) -> bool:
    """Whether a node's entry in the capacity book changes (reservations aside)."""
    if old is None:
        return True
    return (old.cluster, old.region, old.zone, old.gpu_model, old.gpus_total, old.schedulable) != (
        new.cluster,
        new.region,
        new.zone,
        new.gpu_model,
        new.gpus_total,
        new.schedulable,
    )


def _spec_of(job: JobSubmitted) -> JobSpec:
    fields = {f: getattr(job, f) for f in JobSpec.__struct_fields__}
    return JobSpec(**fields)


def _kind(event: LifecycleEvent) -> str:
    return str(event.__struct_config__.tag)


def _at(event: LifecycleEvent) -> float:
    return event.started_at if isinstance(event, JobStarted) else event.at


def _payload_job_id(payload: bytes) -> str | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    job_id = value.get("job_id") if isinstance(value, dict) else None
    return job_id if isinstance(job_id, str) else None


def hash_carrier(q: QueuedJob) -> str:
    """A short token, the same in every process (``hash()`` is salted), for a duplicate's rejection id."""
    return hashlib.sha256(f"{q.job.job_id}:{q.job.submitted_at!r}".encode()).hexdigest()[:12]

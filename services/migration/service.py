"""The migration service: drains clusters, moves jobs at checkpoint boundaries, records every move.

Thin around the pure core (:mod:`loom.migrate.drain`, :mod:`loom.migrate.checkpoints`):

* **Drains** (``loom drain`` / ``loom undrain``, request-reply on ``loom.migrate.drain``): an
  unknown cluster is refused, and so is a drain that would leave some job without feasible GPUs
  elsewhere (unless forced). A drain is a row in ``cluster_drains``; placement loads the drained
  clusters and offers none of their nodes (this service tells it on ``loom.migrate.drains``,
  again every few seconds while drains exist). The drain loop then moves the cluster's running
  jobs, largest benefit first, at most ``concurrency`` in flight: each move is *planned* (a
  checkpoint asked of the run's lead agent), *started* once that checkpoint is recorded (placement
  gives the run up, ``loom.placement.migrate``, and queues the job again from the checkpoint's
  step, avoiding the drained cluster) and *completed* when the next attempt starts elsewhere.
  Jobs that declare no checkpoints would restart from step 0: they move only at the deadline.
* **Failovers**: placement re-places the runs of a failed cluster itself (one path, in the
  service that owns reservations); this service records each as a migration (cause
  ``failover``) from the ``requeued`` event and completes it when the next attempt starts.

Every step is a row in ``migrations`` written in one transaction with the outbox row of its
``loom.migrations.<kind>.<tenant>`` event (in the job's trace), so a restarted service resumes
from its records: a planned move whose checkpoint came meanwhile is started, one whose run was
already given up is marked started, and placement's attempt fence makes a repeated request
change nothing.
"""

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec
import structlog
from nats.aio.msg import Msg
from opentelemetry import propagate

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.migrate import benefit
from loom.migrate.checkpoints import choose
from loom.migrate.drain import DrainJob, drain_refusal, next_moves, order_moves
from loom.migrate.network import candidate_of, path_between, running_state, spans
from loom.runtime.service import ServiceContext
from loom.store import moves, outbox
from loom.store.pool import transaction
from loom_proto import subjects
from loom_proto.clusters import CheckpointJob
from loom_proto.codec import DecodeError, decode
from loom_proto.jobs import JobRequeued, JobSpec, JobStarted
from loom_proto.migrations import MigrationEvent, MigrationKind
from loom_proto.net import LinkEventMessage, LinkRecovered, LinkState

log = structlog.get_logger("migration")

UNMEASURED_PATH = benefit.PathState(rtt_ms=250.0, bandwidth_gbps=1.0)
"""A path network perception has not measured yet (a region just joined): a slow WAN link."""

PRODUCER = "migration"

JobEvent = JobRequeued | JobStarted


@dataclass(frozen=True)
class MigrationSettings:
    """How the service paces drains."""

    poll_s: float = 0.25
    """Drain loop period."""
    checkpoint_timeout_s: float = 10.0
    """A move waits this long for the checkpoint it asked for, then asks again."""
    ask_timeout_s: float = 3.0
    """How long a request to placement waits for its answer."""
    notice_every_s: float = 5.0
    """While drains exist, placement is reminded of them this often (a lost notice heals)."""
    review_delay_s: float = 0.3
    """A link event is reviewed this long after it arrives (placement takes the link's new state
    from the same tick first, so its what-if prices the path as measured now)."""
    rule: benefit.MigrationSettings = field(default_factory=benefit.MigrationSettings)
    """The move-or-stay rule (margins, hysteresis, cool-down)."""
    per_cluster: int = 4
    """Network moves and backflow in flight touching one cluster at most."""
    per_link: int = 4
    """Network moves and backflow in flight over one region pair at most."""


class MigrationService:
    """The migration service's handlers and loops; :meth:`run` is the service body."""

    def __init__(self, ctx: ServiceContext, settings: MigrationSettings | None = None) -> None:
        self.ctx = ctx
        self.pool = ctx.db
        self.settings = settings or MigrationSettings()
        self.relay = outbox.OutboxRelay(self.pool, ctx.publisher, PRODUCER)
        self._noticed_at = 0.0
        self.stats = ctx.stats
        self.stats.update({"planned": 0, "started": 0, "completed": 0, "failed": 0, "drains": []})
        self.stats.update({"reviews": 0, "verdicts": {"move": 0, "stay": 0, "deferred": 0}})
        self.links: dict[tuple[str, str], LinkState] = {}
        """The latest state of every link network perception published."""
        self._link_events: asyncio.Queue[LinkEventMessage] = asyncio.Queue()
        self._avoid: dict[str, list[str]] = {}
        """migration id -> clusters its re-placement avoids (a network move's source parts)."""

    async def run(self) -> None:
        """Consume job events, answer drain requests and queries, drive drains, until stopped."""
        await self.relay.flush()
        events: ConsumerRunner[bytes] = ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="JOBS",
                durable="migration-jobs",
                filter_subjects=subjects.job_events_of("requeued", "started"),
                batch=200,
            ),
            bytes,
            batch_handler=self.on_job_events,
            publisher=self.ctx.publisher,
            callback_pull=True,
        )
        drain_sub = await self.ctx.nc.subscribe(subjects.MIGRATE_DRAIN, queue="migration", cb=self.on_drain)
        query_sub = await self.ctx.nc.subscribe(subjects.MIGRATE_QUERY, queue="migration", cb=self.on_query)
        link_sub = await self.ctx.nc.subscribe(subjects.LINK_STATES_ALL, cb=self.on_link)
        net_sub = await self.ctx.nc.subscribe(subjects.NET_EVENTS_ALL, cb=self.on_net_event)
        await events.start()
        watchdog = self.ctx.watchdog
        relay_stop = asyncio.Event()
        loops = [
            watchdog.watch_consumer("job-events", events),
            watchdog.supervise("drains", self._drain_loop),
            watchdog.supervise("network", self._network_loop),
            watchdog.supervise("network-moves", self._moves_loop),
            watchdog.supervise("outbox-relay", functools.partial(self.relay.run, relay_stop), finishes=True),
        ]
        try:
            await self.ctx.stopping.wait()
        finally:
            relay_stop.set()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await drain_sub.unsubscribe()
            await query_sub.unsubscribe()
            await link_sub.unsubscribe()
            await net_sub.unsubscribe()
            await events.stop()

    # ---- failovers (recorded from placement's events) -----------------------------------------

    async def on_job_events(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """A run lost with its cluster starts a failover migration; a next attempt's start ends
        every open migration of the job's earlier attempts."""
        decoded: list[JobEvent] = []
        for d in deliveries:
            try:
                decoded.append(decode(d.message, JobEvent))  # type: ignore[arg-type]
            except DecodeError:
                continue  # placement dead-letters bad lifecycle events; nothing to record here
        messages: list[outbox.OutboxMessage] = []
        async with transaction(self.pool) as conn:
            # Consecutive starts end their migrations in one statement per round (a job's second
            # start in the run is in the next round), in event order; a failover between them is
            # recorded in its place.
            starts: list[JobStarted] = []
            for e in decoded:
                if isinstance(e, JobRequeued) and e.cause == "cluster_lost":
                    messages += await self._complete_moves(conn, starts)
                    starts = []
                    messages += await self._record_failover(conn, e)
                elif isinstance(e, JobStarted):
                    starts.append(e)
            messages += await self._complete_moves(conn, starts)
            if messages:
                await outbox.add(conn, PRODUCER, messages)
        await self._publish(messages)
        return [None] * len(deliveries)

    async def _complete_moves(
        self, conn: asyncpg.Connection, starts: list[JobStarted]
    ) -> list[outbox.OutboxMessage]:
        """The migrations that ``starts`` (in order) end, and their ``completed`` messages."""
        rounds: list[dict[str, JobStarted]] = []
        for e in starts:
            for taken in rounds:
                if e.job_id not in taken:
                    break
            else:
                taken = {}
                rounds.append(taken)
            taken[e.job_id] = e
        messages: list[outbox.OutboxMessage] = []
        for taken in rounds:
            rows = await moves.complete_many(conn, [(e.job_id, e.attempt, e.cluster) for e in taken.values()])
            messages += [self._message(row, "completed") for row in rows]
        return messages

    async def _record_failover(self, conn: asyncpg.Connection, e: JobRequeued) -> list[outbox.OutboxMessage]:
        job = await conn.fetchrow(
            "SELECT tenant, spec, progress, resume_step, cluster, trace_context FROM jobs WHERE job_id = $1",
            e.job_id,
        )
        if job is None:
            return []
        steps = int(json.loads(job["spec"]).get("work", {}).get("steps", 0))
        done = int(float(job["progress"]) * steps + 1e-6)
        resume_step = int(job["resume_step"])
        migration_id = f"{e.job_id}:{e.attempt - 1}"
        new = await moves.plan(
            conn,
            migration_id=migration_id,
            job_id=e.job_id,
            tenant=e.tenant,
            cause="failover",
            state="started",
            from_cluster=e.from_cluster or job["cluster"] or "unknown",
            from_attempt=e.attempt - 1,
            steps=steps,
            why=e.reason,
            trace_context=json.loads(job["trace_context"]),
            resume_step=resume_step,
            lost_steps=max(done - resume_step, 0),
        )
        if not new:
            return []
        row = await conn.fetchrow("SELECT * FROM migrations WHERE migration_id = $1", migration_id)
        return [self._message(row, "planned"), self._message(row, "started")]

    # ---- drains --------------------------------------------------------------------------------

    async def on_drain(self, msg: Msg) -> None:
        """``loom.migrate.drain``: drain or undrain a cluster; the answer says why when refused."""
        try:
            request = json.loads(msg.data or b"{}")
            reply = await self._drain_request(request)
        except Exception as exc:  # any bad request gets an answer, never a crash
            reply = {"ok": False, "code": "error", "error": repr(exc)}
        await msg.respond(json.dumps(reply).encode())

    async def _drain_request(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op", "drain")
        cluster = str(request["cluster"])
        known = await moves.known_clusters(self.pool)
        if cluster not in known:
            return {
                "ok": False,
                "code": "unknown_cluster",
                "error": f"unknown cluster {cluster!r} (known: {', '.join(sorted(known)) or 'none'})",
            }
        if op == "undrain":
            async with transaction(self.pool) as conn:
                was = await moves.end_drain(conn, cluster)
                messages = []
                for row in await moves.open_migrations(conn, cluster):
                    if row["cause"] == "drain" and row["state"] == "planned":
                        failed = await moves.fail(conn, row["migration_id"], f"the drain of {cluster} ended")
                        if failed is not None:
                            messages.append(self._message(failed, "failed"))
                await outbox.add(conn, PRODUCER, messages)
            await self._publish(messages)
            await self._notice()
            log.info("cluster undrained", cluster=cluster, was_drained=was)
            return {"ok": True, "cluster": cluster, "was_drained": was}
        if op != "drain":
            return {"ok": False, "code": "bad_request", "error": f"unknown op {op!r}"}
        concurrency = int(request.get("concurrency", 2))
        deadline_s = float(request.get("deadline_s", 0.0))
        force = bool(request.get("force", False))
        if concurrency < 1 or deadline_s < 0:
            return {"ok": False, "code": "bad_request", "error": "concurrency must be >= 1 and deadline >= 0"}
        runs = await moves.runs_on(self.pool, cluster)
        jobs = [_drain_job(r) for r in runs]
        closed = await moves.drained_clusters(self.pool)
        refusal = drain_refusal(cluster, jobs, known, closed)
        if refusal is not None and not force:
            return {"ok": False, "code": "refused", "error": refusal}
        async with transaction(self.pool) as conn:
            new = await moves.start_drain(
                conn, cluster, concurrency=concurrency, deadline_s=deadline_s, forced=force
            )
        await self._notice()
        log.info("cluster draining", cluster=cluster, jobs=len(jobs), concurrency=concurrency, forced=force)
        return {
            "ok": True,
            "cluster": cluster,
            "jobs": len(jobs),
            "new": new,
            "concurrency": concurrency,
            "deadline_s": deadline_s,
            "forced_past": refusal,
        }

    async def _notice(self) -> None:
        """Tell placement the drained clusters changed (it reloads them from the store)."""
        self._noticed_at = time.monotonic()
        await self.ctx.nc.publish(subjects.MIGRATE_DRAINS_CHANGED, b"")

    async def _drain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                drains = await moves.drains(self.pool)
                self.stats["drains"] = [
                    {k: d[k] for k in ("cluster", "state", "concurrency", "deadline_s")} for d in drains
                ]
                if drains and time.monotonic() - self._noticed_at >= self.settings.notice_every_s:
                    await self._notice()
                for d in drains:
                    if d["state"] == "draining":
                        await self._drain_step(d)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("drain cycle failed", error=repr(exc))

    async def _drain_step(self, drain: Mapping[str, Any]) -> None:
        """One pass over a draining cluster: advance its moves, plan more up to its concurrency."""
        cluster = str(drain["cluster"])
        deadline_s = float(drain["deadline_s"])
        past_deadline = deadline_s > 0 and time.time() > float(drain["started_at"]) + deadline_s
        runs = {r["job_id"]: r for r in await moves.runs_on(self.pool, cluster)}
        open_rows = [m for m in await moves.open_migrations(self.pool, cluster) if m["cause"] == "drain"]
        in_flight = 0
        for m in open_rows:
            if m["state"] == "planned":
                still_open = await self._advance(m, cluster, past_deadline=past_deadline)
            else:
                still_open = True  # started: completed when the next attempt starts elsewhere
            in_flight += still_open
        moving = {m["job_id"] for m in open_rows}
        candidates = [
            _drain_job(r) for r in runs.values() if r["state"] == "running" and r["job_id"] not in moving
        ]
        if not runs and not open_rows:
            async with transaction(self.pool) as conn:
                await moves.mark_drained(conn, cluster)
            log.info("cluster drained", cluster=cluster)
            return
        chosen = next_moves(
            order_moves(candidates),
            in_flight=in_flight,
            concurrency=int(drain["concurrency"]),
            past_deadline=past_deadline,
        )
        for job in chosen:
            await self._plan(job, runs[job.job_id], cluster)

    async def _plan(self, job: DrainJob, run: asyncpg.Record, cluster: str) -> None:
        """Plan one move: record it and ask the run's lead agent for a checkpoint now."""
        migration_id = f"{job.job_id}:{job.attempt}"
        context = json.loads(run["trace_context"])
        async with transaction(self.pool) as conn:
            new = await moves.plan(
                conn,
                migration_id=migration_id,
                job_id=job.job_id,
                tenant=run["tenant"],
                cause="drain",
                state="planned",
                from_cluster=cluster,
                from_attempt=job.attempt,
                steps=job.steps,
                why=(
                    f"drain of {cluster}: {job.remaining_gpu_s:.0f} GPU-s left to run"
                    f" (largest benefit first); waits for a checkpoint at step >= {job.step}"
                ),
                trace_context=context,
                resume_step=job.step,
            )
            if not new:
                return
            row = await conn.fetchrow("SELECT * FROM migrations WHERE migration_id = $1", migration_id)
            messages = [
                self._message(row, "planned"),
                outbox.message(
                    subjects.cluster_command(run["lead"], "checkpoint"),
                    CheckpointJob(job_id=job.job_id, attempt=job.attempt),
                    f"{migration_id}:checkpoint",
                    context=propagate.extract(context),
                ),
            ]
            await outbox.add(conn, PRODUCER, messages)
        self.stats["planned"] += 1
        await self._publish(messages)

    async def _advance(
        self, m: asyncpg.Record, cluster: str, *, past_deadline: bool, avoid: Sequence[str] | None = None
    ) -> bool:
        """A planned move: start it once its checkpoint is recorded. Returns whether it is still open."""
        job_id, attempt = m["job_id"], m["from_attempt"]
        state, current = (await moves.job_states(self.pool, [job_id])).get(job_id, ("gone", attempt))
        if current != attempt or state not in ("placed", "running"):
            return await self._settle_moved_on(m, state, current)
        recorded = (await moves.checkpoints_of(self.pool, [job_id])).get(job_id, [])
        chosen = choose([c for c in recorded if c.attempt == attempt])
        waited_s = time.time() - float(m["planned_at"].timestamp())
        wanted = int(m["resume_step"])
        if chosen is not None and chosen.checkpoint is not None and chosen.step >= wanted:
            why = (
                f"drain of {cluster}: {chosen.why}" if m["cause"] == "drain" else f"{m['why']}; {chosen.why}"
            )
            await self._ask_move(m, cluster, chosen.step, why, avoid=avoid)
        elif wanted == 0 and m["cause"] in ("network", "backflow"):
            # No step done yet: nothing to save, it restarts from step 0 losing nothing.
            await self._ask_move(m, cluster, 0, f"{m['why']}; no step done yet", avoid=avoid)
        elif past_deadline:
            step = chosen.step if chosen is not None else 0
            why = chosen.why if chosen is not None else "restarts from step 0 (no checkpoint recorded)"
            await self._ask_move(m, cluster, step, f"drain of {cluster} past its deadline: {why}")
        elif waited_s > self.settings.checkpoint_timeout_s:
            # The request (or its report) may be lost: ask again, under a new id.
            n = int(waited_s // self.settings.checkpoint_timeout_s)
            lead = await self.pool.fetchval("SELECT cluster FROM jobs WHERE job_id = $1", job_id)
            if lead:
                await self.ctx.publisher.publish(
                    subjects.cluster_command(lead, "checkpoint"),
                    CheckpointJob(job_id=job_id, attempt=attempt),
                    msg_id=f"{m['migration_id']}:checkpoint:{n}",
                )
        return True

    async def _settle_moved_on(self, m: asyncpg.Record, state: str, current: int) -> bool:
        """The run of a planned move is no longer live: it was given up (by our request, whose
        answer was lost, or a failover) or it ended."""
        attempt = m["from_attempt"]
        messages: list[outbox.OutboxMessage] = []
        async with transaction(self.pool) as conn:
            if current > attempt or state == "queued":
                resume = await conn.fetchval("SELECT resume_step FROM jobs WHERE job_id = $1", m["job_id"])
                row = await moves.mark_started(
                    conn, m["migration_id"], resume_step=int(resume or 0), lost_steps=0, why=m["why"]
                )
                if row is not None:
                    messages.append(self._message(row, "started"))
                still_open = True
            else:
                row = await moves.fail(conn, m["migration_id"], f"the run ended ({state}) before it moved")
                if row is not None:
                    messages.append(self._message(row, "failed"))
                still_open = False
            await outbox.add(conn, PRODUCER, messages)
        await self._publish(messages)
        return still_open

    async def _ask_move(
        self, m: asyncpg.Record, cluster: str, step: int, why: str, *, avoid: Sequence[str] | None = None
    ) -> None:
        """Ask placement to give the run up and queue the job again from ``step``, avoiding ``cluster``."""
        request = {
            "job_id": m["job_id"],
            "attempt": m["from_attempt"],
            "resume_step": step,
            "reason": why[:1024],
            "avoid": list(avoid) if avoid is not None else [cluster],
            "from_cluster": cluster,
        }
        try:
            reply = await self.ctx.nc.request(
                subjects.PLACEMENT_MIGRATE, json.dumps(request).encode(), timeout=self.settings.ask_timeout_s
            )
            answer = json.loads(reply.data)
        except Exception as exc:  # no answer: the next pass reads the store and asks again if need be
            log.info("move not answered", job_id=m["job_id"], error=repr(exc))
            return
        if not answer.get("ok") or not answer.get("requeued"):
            log.info("move not done", job_id=m["job_id"], answer=answer)
            return
        progress = await self.pool.fetchval("SELECT progress FROM jobs WHERE job_id = $1", m["job_id"])
        lost = max(int(float(progress or 0.0) * int(m["steps"]) + 1e-6) - step, 0)
        async with transaction(self.pool) as conn:
            row = await moves.mark_started(
                conn, m["migration_id"], resume_step=step, lost_steps=lost, why=why
            )
            messages = [self._message(row, "started")] if row is not None else []
            await outbox.add(conn, PRODUCER, messages)
        self.stats["started"] += len(messages)
        await self._publish(messages)

    # ---- network-driven moves ------------------------------------------------------------------

    async def on_link(self, msg: Msg) -> None:
        """``loom.net.link.<src>.<dst>``: keep the latest measured state of each link."""
        try:
            state = decode(msg.data, LinkState)
        except DecodeError:
            return
        self.links[state.src, state.dst] = state

    async def on_net_event(self, msg: Msg) -> None:
        """``loom.net.event.degraded`` / ``recovered``: review the jobs the link concerns."""
        try:
            event: LinkEventMessage = decode(msg.data, LinkEventMessage)  # type: ignore[arg-type]
        except DecodeError:
            return
        self._link_events.put_nowait(event)

    async def _network_loop(self) -> None:
        while True:
            event = await self._link_events.get()
            await asyncio.sleep(self.settings.review_delay_s)
            try:
                await self.review_link(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("link review failed", src=event.src, dst=event.dst, error=repr(exc))

    # PLR0915: the review's steps in order (concerned jobs, what-ifs, verdicts, plan, record, start).
    async def review_link(self, event: LinkEventMessage) -> list[benefit.MigrationVerdict]:  # noqa: PLR0915
        """Decide, for every running job whose parts span the link, whether it moves (degraded:
        ``link_degraded``; recovered: ``link_improved``, which also looks at the jobs moved off
        it, so the cool-down and hysteresis keep them from bouncing back); start the moves the
        budget allows, through the drains' path (checkpoint, give up, re-place); record every
        verdict with its numbers."""
        recovered = isinstance(event, LinkRecovered)
        trigger: benefit.Trigger = "link_improved" if recovered else "link_degraded"
        link = f"{event.src}->{event.dst}"
        rows = await moves.running_spans(self.pool)
        open_ids = {m["job_id"] for m in await moves.open_migrations(self.pool)}
        history = await moves.move_history(self.pool, [r["job_id"] for r in rows])
        concerned = []
        for r in rows:
            if r["job_id"] in open_ids:
                continue
            moved_off = recovered and history.get(r["job_id"], (0, None, ""))[2] == "network"
            if spans(set(r["regions"]), event.src, event.dst) or moved_off:
                concerned.append(r)
        self.stats["reviews"] += 1
        if not concerned:
            return []
        checkpoints = await moves.checkpoints_of(self.pool, [r["job_id"] for r in concerned])
        now = time.time()
        verdicts: list[benefit.MigrationVerdict] = []
        context: dict[str, tuple[asyncpg.Record, dict[str, Any]]] = {}
        for r in concerned:
            answer = await self._whatif(r["job_id"])
            if answer is None:
                continue
            current, candidate = answer["current"], candidate_of(answer.get("candidate"))
            lead = (current.get("clusters") or [r["lead"]])[0]
            lead_region = (current.get("regions") or [""])[0]
            fields = {k: v for k, v in json.loads(r["spec"]).items() if k in JobSpec.__struct_fields__}
            spec = msgspec.convert(fields, JobSpec)
            recorded = [c for c in checkpoints.get(r["job_id"], []) if c.attempt == r["attempt"]]
            chosen = choose(recorded)
            n_moves, last_moved, _ = history.get(r["job_id"], (0, None, ""))
            job = running_state(
                spec,
                attempt=int(r["attempt"]),
                progress=float(r["progress"]),
                cluster=lead,
                region=lead_region,
                step_s=float(current.get("step_s") or 0.0),
                checkpoint_step=chosen.step if chosen is not None and chosen.checkpoint is not None else None,
                moves=n_moves,
                last_moved_s=last_moved,
            )
            if candidate is not None and set(answer["candidate"].get("clusters", [])) == set(
                current.get("clusters", [])
            ):
                path: benefit.PathState | None = benefit.LOCAL_PATH  # it would be placed where it is
            else:
                path = (
                    path_between(self.links, lead_region, candidate.region) if candidate is not None else None
                )
            path = path or UNMEASURED_PATH
            verdict = benefit.decide(
                job, candidate, path, now_s=now, trigger=trigger, settings=self.settings.rule
            )
            verdicts.append(verdict)
            avoid = [c for c in current.get("clusters", []) if candidate is None or c != candidate.cluster]
            context[r["job_id"]] = (r, {"avoid": avoid, "step": int(job.steps_done)})
        budget = benefit.MigrationBudget(
            per_cluster=self.settings.per_cluster, per_link=self.settings.per_link
        )
        for m in await moves.open_migrations(self.pool):
            if m["cause"] in ("network", "backflow"):
                budget.clusters[m["from_cluster"]] += 1
        regions = {v.source: context[v.job_id][0]["regions"][0] for v in verdicts}
        plan = benefit.plan_migrations(verdicts, regions, budget)
        records = [self._verdict_row(v, context[v.job_id][0], "move", link) for v in plan.start]
        records += [
            self._verdict_row(v, context[v.job_id][0], "deferred", link, why) for v, why in plan.deferred
        ]
        records += [self._verdict_row(v, context[v.job_id][0], "stay", link) for v in plan.stay]
        async with transaction(self.pool) as conn:
            await moves.record_verdicts(conn, records)
        for record in records:
            self.stats["verdicts"][record.decision] += 1
        for v in plan.start:
            r, extra = context[v.job_id]
            await self._plan_network(v, r, extra["step"], extra["avoid"], link)
        log.info(
            "link reviewed",
            link=link,
            trigger=trigger,
            moves=[v.job_id for v in plan.start],
            stays=[v.job_id for v in plan.stay],
            deferred=[v.job_id for v, _ in plan.deferred],
        )
        return verdicts

    def _verdict_row(
        self, v: benefit.MigrationVerdict, r: asyncpg.Record, decision: str, link: str, why: str = ""
    ) -> moves.VerdictRow:
        return moves.VerdictRow(
            job_id=v.job_id,
            attempt=int(r["attempt"]),
            trigger=v.trigger,
            decision=decision,
            source=v.source,
            target=v.target,
            reason=v.reason + (f"; deferred: {why}" if why else ""),
            gain_s=v.gain_s,
            cost_s=v.cost.total_s if v.cost is not None else None,
            threshold_s=v.threshold_s,
            margin_s=v.margin_s,
            link=link,
        )

    async def _whatif(self, job_id: str) -> dict[str, Any] | None:
        """Placement's what-if for a running job (None: no answer, the job is looked at next time)."""
        try:
            reply = await self.ctx.nc.request(
                subjects.PLACEMENT_WHATIF,
                json.dumps({"job_id": job_id}).encode(),
                timeout=self.settings.ask_timeout_s,
            )
            answer: dict[str, Any] = json.loads(reply.data)
        except Exception as exc:
            log.info("what-if not answered", job_id=job_id, error=repr(exc))
            return None
        return answer if answer.get("ok") else None

    async def _plan_network(
        self, v: benefit.MigrationVerdict, run: asyncpg.Record, step: int, avoid: list[str], link: str
    ) -> None:
        """Plan a network move: record it and ask the run's lead agent for a checkpoint now (the
        moves loop then gives the run up once that checkpoint is recorded)."""
        attempt = int(run["attempt"])
        migration_id = f"{v.job_id}:{attempt}"
        context = json.loads(run["trace_context"])
        steps = int(json.loads(run["spec"]).get("work", {}).get("steps", 0))
        async with transaction(self.pool) as conn:
            new = await moves.plan(
                conn,
                migration_id=migration_id,
                job_id=v.job_id,
                tenant=run["tenant"],
                cause="network",
                state="planned",
                from_cluster=v.source,
                from_attempt=attempt,
                steps=steps,
                why=f"link {link} ({v.trigger}): {v.reason}",
                trace_context=context,
                resume_step=step,
            )
            if not new:
                return
            row = await conn.fetchrow("SELECT * FROM migrations WHERE migration_id = $1", migration_id)
            messages = [
                self._message(row, "planned"),
                outbox.message(
                    subjects.cluster_command(run["lead"], "checkpoint"),
                    CheckpointJob(job_id=v.job_id, attempt=attempt),
                    f"{migration_id}:checkpoint",
                    context=propagate.extract(context),
                ),
            ]
            await outbox.add(conn, PRODUCER, messages)
        self._avoid[migration_id] = avoid
        self.stats["planned"] += 1
        await self._publish(messages)

    async def _moves_loop(self) -> None:
        """Advance planned network and backflow moves (a drain's are advanced by its own loop)."""
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                for m in await moves.open_migrations(self.pool):
                    if m["cause"] in ("network", "backflow") and m["state"] == "planned":
                        avoid = self._avoid.get(m["migration_id"], [m["from_cluster"]])
                        await self._advance(m, m["from_cluster"], past_deadline=False, avoid=avoid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("moves cycle failed", error=repr(exc))

    # ---- queries and events --------------------------------------------------------------------

    async def on_query(self, msg: Msg) -> None:
        """``loom.migrate.query``: ``list`` (migrations, of a job or from a cluster) or ``drains``."""
        try:
            request = json.loads(msg.data or b"{}")
            op = request.get("op", "list")
            if op == "list":
                result: object = await moves.list_migrations(
                    self.pool,
                    job_id=request.get("job_id"),
                    cluster=request.get("cluster"),
                    limit=min(int(request.get("limit", 200)), 10_000),
                )
            elif op == "drains":
                result = await moves.drains(self.pool)
            elif op == "verdicts":
                result = await moves.list_verdicts(
                    self.pool, job_id=request.get("job_id"), limit=min(int(request.get("limit", 200)), 10_000)
                )
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as exc:  # any bad request gets an answer, never a crash
            reply = {"ok": False, "error": str(exc)}
        await msg.respond(json.dumps(reply).encode())

    def _message(self, row: asyncpg.Record, kind: MigrationKind) -> outbox.OutboxMessage:
        """The migration event of ``row`` at ``kind``, in the job's trace."""
        event = MigrationEvent(
            migration_id=row["migration_id"],
            kind=kind,
            job_id=row["job_id"],
            tenant=row["tenant"],
            cause=row["cause"],
            from_cluster=row["from_cluster"],
            to_cluster=row["to_cluster"] or "",
            from_attempt=row["from_attempt"],
            resume_step=row["resume_step"],
            steps=max(int(row["steps"]), 0),
            progress_lost_steps=max(int(row["lost_steps"]), 0),
            why=row["why"][:2048],
            at=time.time(),
        )
        if kind in ("completed", "failed"):
            self.stats[kind] += 1
        context = propagate.extract(json.loads(row["trace_context"]))
        return outbox.message(
            subjects.migration_event(kind, row["tenant"]),
            event,
            f"{row['migration_id']}:{kind}",
            context=context,
        )

    async def _publish(self, messages: list[outbox.OutboxMessage]) -> None:
        if messages:
            with contextlib.suppress(Exception):  # the relay sends what did not go now
                await self.relay.publish_now(messages)


def _drain_job(row: asyncpg.Record) -> DrainJob:
    """A drain candidate from a ``runs_on`` row."""
    spec = json.loads(row["spec"])
    work = spec.get("work", {})
    resources = spec.get("resources", {})
    steps = int(work.get("steps", 1))
    gpus = int(resources.get("gpus", 1)) * max(int(spec.get("workers", 1) or 1), 1)
    return DrainJob(
        job_id=row["job_id"],
        attempt=int(row["attempt"]),
        gpus=gpus,
        gpu_models=tuple(resources.get("gpu_models") or ()),
        steps=steps,
        step=int(float(row["progress"]) * steps + 1e-6),
        step_time_s=float(work.get("step_time_s", 1.0)),
        checkpoint_every_steps=int(work.get("checkpoint_every_steps", 0)),
    )

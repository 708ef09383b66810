"""Metering inside the metrics service: job lifecycle events -> run records -> priced usage rows.

Two durable consumers, ``metrics-metering`` and ``metrics-metering-cancelled``, read ``placed``,
``started``, ``resized``, ``completed``, ``failed`` and ``requeued`` (the JOBS stream) and clients'
``cancelled`` (the REQUESTS stream), one batch at a time between them (the metrics service's
reservation overlay and its learning are fed from the same deliveries: :attr:`Metering.on_folded`).
Each fetched batch is handled in one PostgreSQL transaction that claims the message ids in the
inbox (a redelivery changes nothing), folds each event into its attempt's run record
(:func:`loom.metering.fold`) and, for every record that is complete, replaces the attempt's
usage rows with :func:`loom.metering.meter`'s. Folding is order-free, so events that arrive out
of order (a redelivered ``started`` after its ``completed``) meter the same rows.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import asyncpg
import msgspec
import structlog

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.bus.consumer import caught_up, stored_at
from loom.errors import InvalidInputError, LoomError, TransientError
from loom.metering import RunRecord, fold, meter
from loom.metering.run import MeteredEvent, bounded
from loom.metering.usage import PriceFn, ScuFn, scu_of
from loom.runtime.service import ServiceContext
from loom.security import (
    foreign_cancellation,
    foreign_report,
    received_cancellation,
    report_claim_id,
    tenant_claim_id,
)
from loom.store import inbox
from loom.store import usage as usage_store
from loom.store.pool import transaction
from loom.telemetry.metrics import METERED_RUNS
from loom_proto import subjects
from loom_proto.codec import DecodeError, decode
from loom_proto.jobs import JobCancelled, JobPlaced, JobRequeued

log = structlog.get_logger("metrics.metering")

CONSUMER = "metrics-metering"
_CANCELLED_PREFIX = subjects.JOBS_CANCELLED_ALL.removesuffix("*")
LINGER_S = 0.1
"""How long a fetched event waits for others to share its transaction: usage rows and the
reserved overlay come up to this much later than the handling alone would make them. At 50
jobs/s each job's two or three events had a transaction each (about 4 ms of the metrics service's
CPU a job, as much again in PostgreSQL)."""


class Metering:
    """The metering consumers; :meth:`runners` builds them."""

    def __init__(
        self,
        ctx: ServiceContext,
        price: PriceFn,
        scu: ScuFn = scu_of,
        on_metered: Callable[[list[str]], None] | None = None,
        on_folded: Callable[[list[MeteredEvent], list[MeteredEvent]], Awaitable[None]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.price = price
        self.scu = scu
        self.on_metered = on_metered
        self.on_folded = on_folded
        """Told, once a batch's transaction committed, every event of the batch that decoded and
        those among them that were new (claimed in the inbox by this batch): the metrics service
        keeps its reservation overlay from the same deliveries (no second consumer of the same
        messages). A redelivery of an event already folded is in the first list only."""
        self.counts = {"events": 0, "duplicates": 0, "runs_metered": 0}
        self._lock = asyncio.Lock()
        """One batch at a time, whichever consumer fetched it (:meth:`on_events`)."""

    def runners(self) -> list[ConsumerRunner[bytes]]:
        """The durable consumers of the metered events: the lifecycle log's and the cancellations'."""
        return [
            self._runner(
                "JOBS",
                subjects.job_events_of("placed", "started", "resized", "completed", "failed", "requeued"),
            ),
            # Its own name (the lag gauge and dead letters say which), the inbox's producer the same.
            self._runner("REQUESTS", [subjects.JOBS_CANCELLED_ALL], f"{CONSUMER}-cancelled"),
        ]

    def _runner(self, stream: str, filters: list[str], durable: str = CONSUMER) -> ConsumerRunner[bytes]:
        return ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(stream=stream, durable=durable, filter_subjects=filters, batch=200),
            bytes,
            batch_handler=self.on_events,
            publisher=self.ctx.publisher,
            callback_pull=True,
            # Off the latency path: at a low rate a few events a transaction, not one each.
            linger_s=LINGER_S,
        )

    async def on_events(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """Fold a fetched batch into run records in one transaction, each message exactly once.

        An event that does not decode is refused alone (dead-lettered); if the transaction fails,
        the runner retries the messages one by one. The two consumers' batches are handled one at
        a time: both read and write the same run records.
        """
        if deliveries and all(d.subject.startswith(_CANCELLED_PREFIX) for d in deliveries):
            await self._events_caught_up()
        async with self._lock:
            return await self._on_events(deliveries)

    async def _events_caught_up(self) -> None:
        """Before a batch of cancellations: wait (at most 2 s) until the lifecycle events stored
        before it are folded (a cancellation folded before its job's ``placed`` left that
        placement's GPUs reserved in the overlay: the two consumers read two streams)."""
        await caught_up(self.ctx.nc.jetstream(), "JOBS", CONSUMER)

    async def _on_events(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(deliveries)
        decoded: list[tuple[str, MeteredEvent]] = []
        delivery_of: list[int] = []
        """Position in ``decoded`` -> the delivery's index (two deliveries may share a claim id)."""
        legacy: dict[str, str] = {}
        """A cancellation's scoped claim id -> its bare message id (claimed so before the scoping)."""
        reporters: dict[int, str] = {}
        """Position in ``decoded`` of a report -> the cluster its subject names (only that agent
        publishes there): judged per delivery, as a forged report and the genuine one it copies
        share their claim id."""
        for i, d in enumerate(deliveries):
            try:
                # A union is not a ``type[T]`` to mypy; decode takes it (msgspec decodes tagged unions).
                event: MeteredEvent = decode(d.message, MeteredEvent)  # type: ignore[arg-type]
            except DecodeError as exc:
                outcomes[i] = InvalidInputError(f"not a metered job event: {exc}")
                continue
            if isinstance(event, JobCancelled):  # as placement takes it
                event, refusal = received_cancellation(d.subject, event, stored_at(d))
                if refusal is not None:
                    outcomes[i] = InvalidInputError(refusal)
                    continue
            reporter = subjects.report_cluster(d.subject)
            if isinstance(event, JobCancelled):  # a tenant's message id: within its tenant
                bare = d.msg_id or f"requests-seq-{d.stream_seq}"
                mid = tenant_claim_id(d.subject, bare)
                legacy[mid] = bare
            elif reporter is not None:  # an agent's: bound to what it reports, its times bounded
                mid = report_claim_id(d.subject, event, d.msg_id)
                reporters[len(decoded)] = reporter
                event = bounded(event, stored_at(d))
            else:
                mid = d.msg_id or f"seq-{d.stream_seq}"
            delivery_of.append(i)
            decoded.append((mid, event))
        if decoded:
            metered, fresh, refused = await self._apply(decoded, legacy, reporters)
            self.counts["runs_metered"] += len(metered)
            for tenant in metered:
                METERED_RUNS.labels(tenant).inc()
            if metered and self.on_metered is not None:
                self.on_metered(metered)
            if self.on_folded is not None:
                # A cancellation delivered again (its first delivery was folded, or refused) is
                # not offered again: only a fresh one was checked against the job's tenant.
                new = {id(e) for e in fresh}
                folded = [
                    event
                    for pos, (_, event) in enumerate(decoded)
                    if pos not in refused and (id(event) in new or not isinstance(event, JobCancelled))
                ]
                await self.on_folded(folded, fresh)
            for pos, error in refused.items():
                outcomes[delivery_of[pos]] = error
        return outcomes

    async def _apply(
        self,
        decoded: list[tuple[str, MeteredEvent]],
        legacy: dict[str, str] | None = None,
        reporters: dict[int, str] | None = None,
    ) -> tuple[list[str], list[MeteredEvent], dict[int, LoomError]]:
        """Claim, fold, save and meter; returns the tenant of each run metered (afresh), the
        events that were new, and those refused (position in ``decoded`` -> why): the cancellations
        of another tenant's job (they end nothing; placement refuses them too), and the reports of
        an agent whose cluster holds no part of the run (``reporters``: position of a report -> the
        cluster its subject names), refused before they are claimed, so that the run's own agent's
        report under the same id still counts, in the same batch too.

        A fixed number of statements per batch, whatever its size: the claim, the run records
        and the job specs the batch needs (each read in one statement), the records written back
        in one; only a ``cancelled`` (the job's open runs) and a complete record (its usage rows)
        cost statements of their own.
        """
        metered: list[str] = []
        async with transaction(self.ctx.db) as conn:
            loaded = await usage_store.load_runs(
                conn, [k for _, e in decoded if (k := _run_key(e)) is not None]
            )
            refused = _foreign_reports(decoded, loaded, reporters or {})
            own = [entry for pos, entry in enumerate(decoded) if pos not in refused]
            position = {id(event): pos for pos, (_, event) in enumerate(decoded)}
            claims = [msg_id for msg_id, _ in own]
            new = await inbox.claim_scoped(conn, CONSUMER, claims, [(legacy or {}).get(m, m) for m in claims])
            fresh: list[MeteredEvent] = []
            for msg_id, event in own:
                if msg_id not in new:
                    self.counts["duplicates"] += 1
                    continue
                new.discard(msg_id)  # the same message twice in one batch counts once
                fresh.append(event)
            # The specs folding will ask for: a placement's job, and a job whose record has no labels.
            wanted = {
                e.job_id
                for e in fresh
                if isinstance(e, JobPlaced)
                or ((k := _run_key(e)) is not None and (k not in loaded or not loaded[k].labels))
            }
            specs = await usage_store.job_specs(conn, sorted(wanted))
            records: dict[tuple[str, int], RunRecord] = {}
            changed: list[tuple[str, int]] = []
            for event in fresh:
                self.counts["events"] += 1
                runs = await self._runs_of(conn, event, records, loaded)
                if isinstance(event, JobCancelled):  # only runs it knows say whose job it is
                    others = {r.tenant for k, r in records.items() if k[0] == event.job_id} - {
                        "",
                        event.tenant,
                    }
                    why = foreign_cancellation(event.tenant, event.job_id, min(others)) if others else None
                    if why is not None:
                        refused[position[id(event)]] = InvalidInputError(why)
                for key in runs:
                    updated = fold(records[key], event)
                    if isinstance(event, JobPlaced) or not updated.labels:
                        if event.job_id not in specs:
                            specs[event.job_id] = await usage_store.job_spec(conn, event.job_id)
                        spec = specs[event.job_id]
                        if spec is not None:
                            updated = msgspec.structs.replace(updated, labels=spec[0], task_type=spec[1])
                    records[key] = updated
                    if key not in changed:
                        changed.append(key)
            await usage_store.save_runs(conn, [records[key] for key in changed])
            for key in changed:
                record = records[key]
                if record.complete:
                    rows = meter(record, self.price, self.scu)
                    await usage_store.replace_rows(conn, record.job_id, record.attempt, rows)
                    metered.append(record.tenant)
        return metered, fresh, refused

    async def _runs_of(
        self,
        conn: asyncpg.Connection,
        event: MeteredEvent,
        records: dict[tuple[str, int], RunRecord],
        loaded: dict[tuple[str, int], RunRecord],
    ) -> list[tuple[str, int]]:
        """The runs an event folds into (put into ``records``): its attempt; the attempt a
        ``requeued`` gave up; every run of the job not yet ended for a ``cancelled``. ``loaded``
        holds the stored records read ahead for the batch (:func:`_run_key`)."""
        if isinstance(event, JobCancelled):
            for record in await usage_store.open_runs(conn, event.job_id):
                records.setdefault((record.job_id, record.attempt), record)
            # Another tenant's cancellation of this job ends nothing (placement refuses it).
            return sorted(
                k
                for k, r in records.items()
                if k[0] == event.job_id and r.ended_ms is None and r.tenant in ("", event.tenant)
            )
        key = _run_key(event)
        if key is None:
            return []
        if key not in records:
            found = loaded.get(key)
            records[key] = found or RunRecord(job_id=event.job_id, attempt=key[1], tenant=event.tenant)
        return [key]


def _foreign_reports(
    decoded: list[tuple[str, MeteredEvent]],
    loaded: dict[tuple[str, int], RunRecord],
    reporters: dict[int, str],
) -> dict[int, LoomError]:
    """The reports (position in ``decoded`` -> why) that name another cluster than their
    subject's, or whose cluster holds no part of the run, as its stored record or a ``placed`` of
    the batch tells the run's clusters (:func:`loom.security.foreign_report`): refused. Without
    this an agent's credentials could end, and so bill short, another cluster's run. Judged per
    delivery: a forged report shares its claim id with the genuine one it copies, and in one batch
    the genuine one was refused, or acknowledged unfolded.

    A report of an attempt no ``placed`` was folded for is not claimed either, but handed back
    (:class:`~loom.errors.TransientError`: redelivered with a growing delay, dead-lettered after
    the consumer's attempts): placement's ``placed`` precedes the agent's reports in the stream,
    but a redelivery may bring a report first; a report of a run never placed (an agent's about a
    job submitted later, whose real run then went unbilled) ends in the dead letters."""
    clusters = {key: {p.cluster for p in r.parts} for key, r in loaded.items() if r.parts}
    for _, event in decoded:
        if isinstance(event, JobPlaced) and (key := _run_key(event)) is not None:
            placed = fold(RunRecord(job_id=event.job_id, attempt=key[1]), event)
            clusters[key] = {p.cluster for p in placed.parts}
    refused: dict[int, LoomError] = {}
    for pos, (_, event) in enumerate(decoded):
        key = _run_key(event)
        if key is None or pos not in reporters:
            continue
        known = clusters.get(key)
        why = foreign_report(reporters[pos], getattr(event, "cluster", None), known or set())
        if why is not None and known is None and reporters[pos] == getattr(event, "cluster", None):
            refused[pos] = TransientError(
                f"no placement of attempt {key[1]} of job {event.job_id} is folded yet: asked again"
            )
        elif why is not None:
            refused[pos] = InvalidInputError(why)
    return refused


def _run_key(event: MeteredEvent) -> tuple[str, int] | None:
    """The one attempt an event folds into (the one a ``requeued`` gave up); None for a
    ``cancelled`` (the job's open runs) and for an attempt below 1."""
    if isinstance(event, JobCancelled):
        return None
    attempt = event.attempt - 1 if isinstance(event, JobRequeued) else event.attempt
    return (event.job_id, attempt) if attempt >= 1 else None

"""Metering inside the metrics service: job lifecycle events -> run records -> priced usage rows.

One durable consumer (``metrics-metering``) reads ``placed``, ``started``, ``resized``,
``completed``, ``failed``, ``cancelled`` and ``requeued``. Each event is handled in one PostgreSQL
transaction that claims its message id in the inbox (a redelivery changes nothing), folds it into
the attempt's run record (:func:`loom.metering.fold`) and, when the record is complete, replaces
the attempt's usage rows with :func:`loom.metering.meter`'s. Folding is order-free, so events that
arrive out of order (a redelivered ``started`` after its ``completed``) meter the same rows.
"""

from collections.abc import Callable

import msgspec
import structlog

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.errors import InvalidInputError
from loom.metering import RunRecord, fold, meter
from loom.metering.run import MeteredEvent
from loom.metering.usage import PriceFn, ScuFn, scu_of
from loom.runtime.service import ServiceContext
from loom.store import inbox
from loom.store import usage as usage_store
from loom.store.pool import transaction
from loom.telemetry.metrics import METERED_RUNS
from loom_proto import subjects
from loom_proto.codec import DecodeError, decode
from loom_proto.jobs import JobCancelled, JobPlaced, JobRequeued

log = structlog.get_logger("metrics.metering")

CONSUMER = "metrics-metering"


class Metering:
    """The metering consumer; :meth:`runner` builds its :class:`ConsumerRunner`."""

    def __init__(
        self,
        ctx: ServiceContext,
        price: PriceFn,
        scu: ScuFn = scu_of,
        on_metered: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.price = price
        self.scu = scu
        self.on_metered = on_metered
        self.counts = {"events": 0, "duplicates": 0, "runs_metered": 0}

    def runner(self) -> ConsumerRunner[bytes]:
        """The durable consumer of the metered lifecycle events."""
        return ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="JOBS",
                durable=CONSUMER,
                filter_subjects=subjects.job_events_of(
                    "placed", "started", "resized", "completed", "failed", "cancelled", "requeued"
                ),
            ),
            bytes,
            handler=self.on_event,
            publisher=self.ctx.publisher,
        )

    async def on_event(self, d: Delivery[bytes]) -> None:
        """Fold one event into its run record(s), exactly once."""
        try:
            # A union is not a ``type[T]`` to mypy; decode takes it (msgspec decodes tagged unions).
            event: MeteredEvent = decode(d.message, MeteredEvent)  # type: ignore[arg-type]
        except DecodeError as exc:
            raise InvalidInputError(f"not a metered job event: {exc}") from exc
        msg_id = d.msg_id or f"seq-{d.stream_seq}"
        metered: list[str] = []
        async with transaction(self.ctx.db) as conn:
            if not await inbox.claim(conn, CONSUMER, msg_id):
                self.counts["duplicates"] += 1
                return
            if isinstance(event, JobCancelled):
                records = await usage_store.open_runs(conn, event.job_id)
            else:
                attempt = event.attempt - 1 if isinstance(event, JobRequeued) else event.attempt
                if attempt < 1:
                    return
                found = await usage_store.load_run(conn, event.job_id, attempt)
                records = [found or RunRecord(job_id=event.job_id, attempt=attempt, tenant=event.tenant)]
            for record in records:
                updated = fold(record, event)
                if isinstance(event, JobPlaced) or not updated.labels:
                    spec = await usage_store.job_spec(conn, event.job_id)
                    if spec is not None:
                        labels, task_type = spec
                        updated = msgspec.structs.replace(updated, labels=labels, task_type=task_type)
                await usage_store.save_run(conn, updated)
                if updated.complete:
                    rows = meter(updated, self.price, self.scu)
                    await usage_store.replace_rows(conn, updated.job_id, updated.attempt, rows)
                    metered.append(updated.tenant)
        self.counts["events"] += 1
        self.counts["runs_metered"] += len(metered)
        for tenant in metered:
            METERED_RUNS.labels(tenant).inc()
        if metered and self.on_metered is not None:
            self.on_metered(metered)

"""The raw path ``loom bench e2e --baseline`` measures: durable consume, store, publish; no scheduling.

Run by the bench as its own OS process (as placement is): ``python -m loom_benchmarks.e2e_baseline
--nats URL --database URL``. It pulls job submissions from a stream of its own (``BENCHBASE``,
subjects ``bench.baseline.>``, the same file storage, limits and duplicate window as Loom's
streams, so placement never sees them) with a durable pull consumer fetched like placement's
(a lingering pull of one, then whatever else is waiting, up to 500). Per fetched batch, one
transaction on Loom's database (same server, same synchronous commit): claim the message ids in
the inbox, insert the records (``bench_baseline_jobs``, idempotent on the job id) and record one
placed-like event per record in the outbox. After the commit the batch is acknowledged and the
events are published to JetStream in the background (each awaited for its ack, then marked
published), exactly the shape of placement's submit path without the decision in the middle.
No tracing spans, no decoding beyond the JSON the events need: the floor Loom is measured against.
"""

import argparse
import asyncio
import contextlib
import signal
import time

import asyncpg
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig

from loom.bus.connection import auth_options, credentials_path, server_urls, stream_config
from loom.store import outbox
from loom.store.inbox import claim_many
from loom_proto.codec import decode, encode
from loom_proto.jobs import JobPlaced, JobSubmitted, NodeAllocation
from loom_proto.subjects import StreamSpec

STREAM = StreamSpec(
    name="BENCHBASE",
    subjects=["bench.baseline.>"],
    description="loom bench e2e --baseline: submissions and placed-like events of the raw path",
    max_age_s=3600,
)
SUBMITTED = "bench.baseline.submitted"
PLACED = "bench.baseline.placed"
DURABLE = "bench-baseline"
PRODUCER = "bench-baseline"
BATCH = 500
"""Placement's fetch batch."""

_TABLE = """CREATE TABLE IF NOT EXISTS bench_baseline_jobs (
    job_id       text        PRIMARY KEY,
    tenant       text        NOT NULL,
    spec         jsonb       NOT NULL,
    state        text        NOT NULL,
    submitted_at timestamptz NOT NULL,
    placed_at    timestamptz NOT NULL
)"""


def submitted_subject(tenant: str) -> str:
    """Where the bench client publishes a baseline submission."""
    return f"{SUBMITTED}.{tenant}"


async def ensure_stream(nc: Client) -> None:
    """Create (or update) the baseline's stream with the limits of Loom's own."""
    js = nc.jetstream()
    try:
        await js.add_stream(stream_config(STREAM))
    except Exception:
        await js.update_stream(stream_config(STREAM))


class Baseline:
    """The consumer loop; :meth:`run` until ``stopping``."""

    def __init__(self, nc: Client, pool: asyncpg.Pool) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.pool = pool
        self.sending: set[asyncio.Task[None]] = set()
        self.handled = 0

    async def run(self, stopping: asyncio.Event) -> None:
        await self.pool.execute(_TABLE)
        await self.js.add_consumer(
            STREAM.name,
            config=ConsumerConfig(
                durable_name=DURABLE,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30.0,
                max_ack_pending=20_000,
                filter_subject=f"{SUBMITTED}.*",
            ),
        )
        sub = await self.js.pull_subscribe_bind(durable=DURABLE, stream=STREAM.name)
        while not stopping.is_set():
            try:
                msgs = await sub.fetch(1, timeout=2.0)
            except (TimeoutError, NatsTimeoutError):
                continue
            with contextlib.suppress(NatsTimeoutError, asyncio.TimeoutError):
                msgs.extend(await sub.fetch(BATCH - 1, timeout=0.002))
            await self.handle(msgs)
        await asyncio.gather(*self.sending, return_exceptions=True)

    async def handle(self, msgs: list[Msg]) -> None:
        now = time.time()
        ids = [
            (m.headers or {}).get("Nats-Msg-Id") or f"{STREAM.name}-{m.metadata.sequence.stream}"
            for m in msgs
        ]
        jobs = [decode(m.data, JobSubmitted) for m in msgs]
        events: list[outbox.OutboxMessage] = []
        async with self.pool.acquire() as conn, conn.transaction():
            fresh = await claim_many(conn, PRODUCER, ids)
            rows = [(job, m) for job, m, msg_id in zip(jobs, msgs, ids, strict=True) if msg_id in fresh]
            await conn.execute(
                """INSERT INTO bench_baseline_jobs (job_id, tenant, spec, state, submitted_at, placed_at)
                   SELECT j, t, s::jsonb, 'placed', to_timestamp(a), to_timestamp($5)
                   FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[]) AS u(j, t, s, a)
                   ON CONFLICT (job_id) DO NOTHING""",
                [job.job_id for job, _ in rows],
                [job.tenant for job, _ in rows],
                [m.data.decode() for _, m in rows],
                [job.submitted_at or now for job, _ in rows],
                now,
            )
            for job, _ in rows:
                event = JobPlaced(
                    job_id=job.job_id,
                    tenant=job.tenant,
                    cluster="c-baseline",
                    region="baseline",
                    gpu_model="H100",
                    allocations=[NodeAllocation("c-baseline-n0", job.resources.gpus)],
                    placed_at=now,
                    submitted_at=job.submitted_at,
                )
                events.append(
                    outbox.OutboxMessage(f"{job.job_id}:placed:1", f"{PLACED}.c-baseline", encode(event), {})
                )
            await outbox.add(conn, PRODUCER, events)
        await asyncio.gather(*(m.ack() for m in msgs))
        self.handled += len(msgs)
        task = asyncio.create_task(self.publish(events))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def publish(self, events: list[outbox.OutboxMessage]) -> None:
        """Publish committed events, each awaited for its JetStream ack, then mark them published."""

        async def one(m: outbox.OutboxMessage) -> str:
            await self.js.publish(m.subject, m.payload, headers={"Nats-Msg-Id": m.msg_id})
            return m.msg_id

        done = await asyncio.gather(*(one(m) for m in events))
        await self.pool.execute(
            "UPDATE outbox SET published_at = now() WHERE msg_id = ANY($1::text[]) AND published_at IS NULL",
            list(done),
        )


async def main_async(nats_url: str, database_url: str) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    nc = await nats.connect(
        server_urls(nats_url), name="bench-baseline", **auth_options(credentials_path(nats_url))
    )
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=8, command_timeout=30)
    assert pool is not None
    try:
        await ensure_stream(nc)
        await Baseline(nc, pool).run(stopping)
    finally:
        await nc.drain()
        await pool.close()


def main(argv: list[str] | None = None) -> None:
    """Process entry point."""
    parser = argparse.ArgumentParser(prog="python -m loom_benchmarks.e2e_baseline")
    parser.add_argument("--nats", required=True)
    parser.add_argument("--database", required=True)
    args = parser.parse_args(argv)
    asyncio.run(main_async(args.nats, args.database))


if __name__ == "__main__":
    main()

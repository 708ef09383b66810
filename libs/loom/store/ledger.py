"""The metrics service's tables: the resource ledger, what it learned of each cluster, their profiles.

``ledger_clusters`` and ``ledger_nodes`` are the ledger (:mod:`loom.model.ledger`) as last
persisted; the trust columns of ``ledger_clusters`` and ``scu_decay`` hold what completed runs
taught (:class:`~loom.model.scu.TrustTracker`, :class:`~loom.model.scu.DecayLearner`);
``cluster_profiles`` the accelerator profiles each agent published. Metrics is their only writer;
it also reads placement's unconfirmed ``reservations`` to show them as reserved.
"""

from collections.abc import Sequence

import asyncpg
import msgspec

from loom.model.ledger import LedgerCluster, LedgerNode
from loom.model.scu import DecayLearner, TrustTracker
from loom.store.jobs import ts
from loom_proto.clusters import AcceleratorProfile
from loom_proto.codec import encode


async def load_clusters(conn: asyncpg.Connection | asyncpg.Pool) -> list[LedgerCluster]:
    """Every cluster of the ledger as last persisted (its nodes are attached by the ledger on load)."""
    return [
        LedgerCluster(
            cluster=r["cluster"],
            region=r["region"],
            agent_epoch=r["agent_epoch"],
            last_seq=r["last_seq"],
            version=r["version"],
            interval_s=r["interval_s"],
            stale=r["stale"],
            volatility=r["volatility"],
            trust=r["trust"],
            last_heartbeat_at=r["last_heartbeat_at"].timestamp() if r["last_heartbeat_at"] else 0.0,
        )
        for r in await conn.fetch("SELECT * FROM ledger_clusters")
    ]


async def load_nodes(conn: asyncpg.Connection | asyncpg.Pool) -> list[LedgerNode]:
    """Every node of the ledger as last persisted."""
    return [
        LedgerNode(
            node=r["node"],
            cluster=r["cluster"],
            region=r["region"],
            zone=r["zone"],
            gpu_model=r["gpu_model"],
            gpus_total=r["gpus_total"],
            gpus_used=r["gpus_used"],
            cpu_milli=r["cpu_milli"],
            memory_mib=r["memory_mib"],
            healthy=r["healthy"],
            updated_at=r["updated_at"].timestamp(),
        )
        for r in await conn.fetch("SELECT * FROM ledger_nodes")
    ]


async def write_cluster(conn: asyncpg.Connection, c: LedgerCluster) -> None:
    """Insert or update a cluster's heartbeat state; an older version never overwrites a newer one.

    Trust is not written here (see :func:`save_learning`): a heartbeat does not change it.
    """
    await conn.execute(
        """INSERT INTO ledger_clusters AS l (cluster, region, agent_epoch, last_seq, version, interval_s,
                                             last_heartbeat_at, stale, volatility)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
           ON CONFLICT (cluster) DO UPDATE SET agent_epoch = EXCLUDED.agent_epoch,
               last_seq = EXCLUDED.last_seq,
               version = EXCLUDED.version, interval_s = EXCLUDED.interval_s,
               last_heartbeat_at = EXCLUDED.last_heartbeat_at, stale = EXCLUDED.stale,
               volatility = EXCLUDED.volatility
           WHERE l.version <= EXCLUDED.version""",
        c.cluster,
        c.region,
        c.agent_epoch,
        c.last_seq,
        c.version,
        c.interval_s,
        ts(c.last_heartbeat_at) if c.last_heartbeat_at else None,
        c.stale,
        c.volatility,
    )


async def write_nodes(conn: asyncpg.Connection, nodes: Sequence[LedgerNode]) -> None:
    """Insert or replace nodes, in one statement whatever their number (a heartbeat after a burst
    of starts changes hundreds); a node listed twice is written as its last entry."""
    if not nodes:
        return
    latest = list({n.node: n for n in nodes}.values())
    await conn.execute(
        """INSERT INTO ledger_nodes (node, cluster, region, zone, gpu_model, gpus_total, gpus_used, cpu_milli,
                                     memory_mib, healthy, updated_at)
           SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[],
                                $7::int[], $8::int[], $9::bigint[], $10::bool[], $11::timestamptz[])
           ON CONFLICT (node) DO UPDATE SET cluster = EXCLUDED.cluster, region = EXCLUDED.region,
               zone = EXCLUDED.zone, gpu_model = EXCLUDED.gpu_model, gpus_total = EXCLUDED.gpus_total,
               gpus_used = EXCLUDED.gpus_used, cpu_milli = EXCLUDED.cpu_milli,
               memory_mib = EXCLUDED.memory_mib,
               healthy = EXCLUDED.healthy, updated_at = EXCLUDED.updated_at""",
        [n.node for n in latest],
        [n.cluster for n in latest],
        [n.region for n in latest],
        [n.zone for n in latest],
        [n.gpu_model for n in latest],
        [n.gpus_total for n in latest],
        [n.gpus_used for n in latest],
        [n.cpu_milli for n in latest],
        [n.memory_mib for n in latest],
        [n.healthy for n in latest],
        [ts(n.updated_at) for n in latest],
    )


async def delete_nodes(conn: asyncpg.Connection, nodes: Sequence[str]) -> None:
    """Remove nodes a cluster no longer reports."""
    await conn.execute("DELETE FROM ledger_nodes WHERE node = ANY($1::text[])", list(nodes))


async def load_trust(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, TrustTracker]:
    """Each persisted cluster's trust tracker, by cluster."""
    rows = await conn.fetch(
        "SELECT cluster, trust, trust_confirmations, trust_mismatches FROM ledger_clusters"
    )
    return {
        r["cluster"]: TrustTracker(
            trust=r["trust"], confirmations=r["trust_confirmations"], mismatches=r["trust_mismatches"]
        )
        for r in rows
    }


async def load_decay(conn: asyncpg.Connection | asyncpg.Pool) -> dict[tuple[str, str], DecayLearner]:
    """Each learned decay factor, by (GPU model, task type)."""
    rows = await conn.fetch("SELECT gpu_model, task_type, factor, observations FROM scu_decay")
    return {
        (r["gpu_model"], r["task_type"]): DecayLearner(factor=r["factor"], observations=r["observations"])
        for r in rows
    }


async def save_learning(
    conn: asyncpg.Connection,
    cluster: str,
    tracker: TrustTracker,
    decay_key: tuple[str, str],
    learner: DecayLearner,
) -> None:
    """Store what one completed run taught: its cluster's trust and its (model, task type) decay."""
    await conn.execute(
        """UPDATE ledger_clusters SET trust = $2, trust_confirmations = $3, trust_mismatches = $4
           WHERE cluster = $1""",
        cluster,
        tracker.trust,
        tracker.confirmations,
        tracker.mismatches,
    )
    await conn.execute(
        """INSERT INTO scu_decay (gpu_model, task_type, factor, observations) VALUES ($1, $2, $3, $4)
           ON CONFLICT (gpu_model, task_type) DO UPDATE
           SET factor = EXCLUDED.factor, observations = EXCLUDED.observations""",
        decay_key[0],
        decay_key[1],
        learner.factor,
        learner.observations,
    )


async def save_profiles(
    conn: asyncpg.Connection,
    cluster: str,
    source: str,
    measured_at: float,
    profiles: Sequence[AcceleratorProfile],
) -> None:
    """Insert or replace the profile of each of a cluster's GPU models."""
    await conn.executemany(
        """INSERT INTO cluster_profiles (cluster, gpu_model, source, profile, measured_at)
           VALUES ($1, $2, $3, $4::jsonb, $5)
           ON CONFLICT (cluster, gpu_model) DO UPDATE SET source = EXCLUDED.source,
               profile = EXCLUDED.profile, measured_at = EXCLUDED.measured_at""",
        [(cluster, p.gpu_model, source, encode(p).decode(), ts(measured_at)) for p in profiles],
    )


async def load_profiles(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, list[AcceleratorProfile]]:
    """Every stored accelerator profile, by cluster (each cluster's in GPU model order)."""
    stored: dict[str, list[AcceleratorProfile]] = {}
    for r in await conn.fetch("SELECT cluster, profile FROM cluster_profiles ORDER BY cluster, gpu_model"):
        stored.setdefault(r["cluster"], []).append(msgspec.json.decode(r["profile"], type=AcceleratorProfile))
    return stored


async def unconfirmed_reservations(
    conn: asyncpg.Connection | asyncpg.Pool,
) -> dict[str, list[tuple[str, int]]]:
    """Placement's reservations not yet confirmed started: (node, GPUs) by run ``job_id:attempt``."""
    rows = await conn.fetch(
        """SELECT job_id, attempt, node, gpus FROM reservations
           WHERE state = 'reserved' ORDER BY job_id, attempt"""
    )
    runs: dict[str, list[tuple[str, int]]] = {}
    for r in rows:
        runs.setdefault(f"{r['job_id']}:{r['attempt']}", []).append((r["node"], r["gpus"]))
    return runs

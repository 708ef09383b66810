"""The queue-aware gang wait's fixes: the service keeps the queued shapes across rebuilt snapshots,
claims ahead follow the framework's queue order, the alone waits are kept per snapshot, keys of
other shapes never break the queue's order, and the simulator records a skipped job's shape by the
framework's rule."""

import math

import numpy as np
import pytest

from loom.sched.availability import Reservation, WaitBook, alone_waits, expected_wait_s, queue_for_pool
from loom.sched.framework import CycleState, Framework
from loom.sched.plugins.affinity import Affinity as AffinityRule
from loom.sched.plugins.compute import ScuFit
from loom.sched.plugins.network import (
    PoolOption,
    SpanGuard,
    behind_queue,
    queue_claims,
    single_cluster_options,
)
from loom.sched.plugins.resources import ResourceFit
from loom.sched.snapshot import QueuedShape
from loom_proto.jobs import Affinity, Communication, JobSpec, Layer, Pipeline, Resources, Work
from loom_services.placement.book import Book
from tests.unit.test_contention import FAST, NOW, SLOW, node, running, snapshot


def gang(
    job_id: str = "g", workers: int = 2, gpus: int = 4, *, priority: int = 100, **extra: object
) -> JobSpec:
    extra.setdefault("resources", Resources(gpus=gpus))
    return JobSpec(
        job_id=job_id,
        tenant="t",
        priority=priority,
        workers=workers,
        work=Work(steps=1000, step_time_s=1.0),
        comm=Communication(bytes_per_step=10**8),
        **extra,  # type: ignore[arg-type]
    )


# ---- 1. the service's book keeps the queue's shapes ----------------------------------------------


def test_the_queued_shapes_survive_a_rebuilt_snapshot_reindexed_by_its_pools() -> None:
    book = Book()
    for cap in (node("b0", "cb", used=8), node("c0", "cc", model=SLOW, used=8)):
        book.nodes[cap.node] = cap
    framework = Framework([AffinityRule(), ResourceFit(), ScuFit()])
    first = book.snapshot(NOW)
    only_cb = gang(affinity=Affinity(clusters=["cb"]), resources=Resources(gpus=4, gpu_models=[FAST]))
    assert framework.schedule(only_cb, first, submitted_at=NOW, queue_key=(0, NOW, "g")).decision is None
    assert "g" in first.queued and "g" in first.waiting
    # A delta rebuilds the snapshot; a cluster sorted first now shifts every pool's index.
    book.nodes["a0"] = node("a0", "ca", model=SLOW, used=8)
    book.invalidate()
    second = book.snapshot(NOW + 1.0)
    assert second is not first
    shape = second.queued["g"]
    assert shape.pools.shape == (3, 2)
    allowed = {
        (second.clusters[c].id, second.models[m]) for c, m in zip(*np.nonzero(shape.pools), strict=True)
    }
    assert allowed == {("cb", FAST)}
    assert [s.job_id for s in second.queue_ahead((0, NOW + 5.0, "x"), "x")] == ["g"]
    # Leaving the queue otherwise than by a decision drops the shape with the place.
    book.leave_queue(["g"])
    assert "g" not in book.queued and "g" not in book.waiting


# ---- 2. the alone waits are kept per snapshot, as computed -----------------------------------------


def test_the_kept_alone_waits_follow_the_pools_that_changed() -> None:
    snap = snapshot(
        [node("a0", "ca", used=8), node("b0", "cb", model=SLOW, used=8)],
        [running("r1", ("a0", 8), ends_in_s=100.0), running("r2", ("b0", 8), ends_in_s=50.0)],
    )
    waits, _ = alone_waits(snap, 1, 8)
    assert waits[snap.cluster_index["ca"], snap.model_index[FAST]] == pytest.approx(100.0)
    assert waits[snap.cluster_index["cb"], snap.model_index[SLOW]] == pytest.approx(50.0)
    snap.give_back([("a0", 8)])
    waits, _ = alone_waits(snap, 1, 8)
    for c in range(len(snap.clusters)):
        for m in range(len(snap.models)):
            assert waits[c, m] == expected_wait_s(snap, c, m, 1, 8)
    assert waits[snap.cluster_index["ca"], snap.model_index[FAST]] == 0.0


def test_a_queued_job_with_room_sooner_elsewhere_is_not_served_by_the_pool() -> None:
    snap = snapshot(
        [node("a0", "ca", used=8), node("b0", "cb", model=SLOW, used=8)],
        [running("r1", ("a0", 8), ends_in_s=100.0), running("r2", ("b0", 8), ends_in_s=50.0)],
    )
    pools = np.ones((2, 2), dtype=np.bool_)
    shape = QueuedShape("q", (0, 0.0, "q"), 1, 8, pools, gang("q", 1, 8), 1000.0)
    a, fast = snap.cluster_index["ca"], snap.model_index[FAST]
    b, slow = snap.cluster_index["cb"], snap.model_index[SLOW]
    assert queue_for_pool(snap, [shape], a, fast) == []  # the T4s come free first
    assert len(queue_for_pool(snap, [shape], b, slow)) == 1
    snap.give_back([("a0", 8)])  # now the A100s are free: the kept answer must follow
    assert len(queue_for_pool(snap, [shape], a, fast)) == 1
    assert queue_for_pool(snap, [shape], b, slow) == []


# ---- 3. claims ahead by the framework's queue order -------------------------------------------------


def test_claims_ahead_follow_the_queue_key_not_the_books_priority_order() -> None:
    snap = snapshot([node("a0", "ca", used=8)], [running("r1", ("a0", 8), ends_in_s=100.0)])
    pools = np.ones((1, 1), dtype=np.bool_)
    # "low" has a lower priority than the gang, yet the queue-sort plugin puts it first (key 0 < 1).
    snap.queued["low"] = QueuedShape("low", (0,), 1, 8, pools, gang("low", 1, 8, priority=1), 1000.0)
    snap.waiting.add("low")
    book = WaitBook()
    book.reserve(Reservation("low", 1, NOW + 50.0, "ca", FAST, 1, 8, NOW + 100.0, NOW + 10_000.0))
    job = gang("g", 1, 8, priority=100)
    state = CycleState(
        job=job,
        snapshot=snap,
        cluster_mask=np.ones(1, dtype=np.bool_),
        model_mask=np.ones(1, dtype=np.bool_),
        submitted_at=NOW,
        queue_key=(1,),
    )
    assert book.ahead(job.priority, NOW, "g") == []  # the book's own order: not ahead
    claims, ids = queue_claims(state, book)
    assert ids == {"low"} and claims == {("ca", FAST): 8}
    option = PoolOption(0, 0, 1.0, 100.0, 333.0, 0.0)
    seen = behind_queue(state, [option], 1, book)
    assert seen is not None
    # Its claim counts (the next release after 100 s is not known): the gang never has room.
    assert math.isinf(seen.wait_s)


# ---- 5. options a queue may make the best -------------------------------------------------------------


def test_unpruned_options_keep_every_pool_within_the_bound() -> None:
    snap = snapshot(
        [node("a0", "ca"), node("b0", "cb", model=SLOW)],
    )
    job = gang("g", 1, 8)
    state = CycleState(
        job=job,
        snapshot=snap,
        cluster_mask=np.ones(2, dtype=np.bool_),
        model_mask=np.ones(2, dtype=np.bool_),
        submitted_at=NOW,
    )
    pools = np.ones((2, 2), dtype=np.bool_)
    pools &= snap.free_sum > 0
    pruned = single_cluster_options(state, pools, 1)
    every = single_cluster_options(state, pools, 1, prune=False)
    assert len(pruned) == 1 and len(every) == 2
    assert every[0] == pruned[0]


# ---- 6. keys of other shapes ------------------------------------------------------------------------


def test_the_queue_ahead_never_raises_on_keys_of_other_shapes() -> None:
    snap = snapshot([node("a0", "ca")])
    pools = np.ones((1, 1), dtype=np.bool_)
    for job_id, key in (("a", (0, 1.0, "a")), ("b", (0, "x")), ("c", (0, 2.0, "c")), ("d", ("z",))):
        snap.queued[job_id] = QueuedShape(job_id, key, 1, 8, pools)
        snap.waiting.add(job_id)
    assert [s.job_id for s in snap.queue_ahead((0, 5.0, "me"), "me")] == ["a", "c"]
    assert [s.job_id for s in snap.queue_ahead((0, 5.0, "me"), "me", limit=1)] == ["a"]
    assert [s.job_id for s in snap.queue_ahead((0, 5.0, "me"), "me", skip={"a"})] == ["c"]
    # Ahead of a key of priority 1, "a" and "b" both compare with it but not with each other.
    assert [s.job_id for s in snap.queue_ahead((1, 5.0, "me"), "me")] == ["a", "c"]


def test_the_kept_queue_order_follows_changes_to_the_queue() -> None:
    snap = snapshot([node("a0", "ca")])
    pools = np.ones((1, 1), dtype=np.bool_)
    snap.queued["a"] = QueuedShape("a", (0, 3.0, "a"), 1, 8, pools)
    snap.waiting |= {"a", "b"}
    assert [s.job_id for s in snap.queue_ahead((0, 5.0, "me"), "me")] == ["a"]
    snap.queued["b"] = QueuedShape("b", (0, 1.0, "b"), 1, 8, pools)
    assert [s.job_id for s in snap.queue_ahead((0, 5.0, "me"), "me")] == ["b", "a"]
    snap.queued.pop("b")
    assert [s.job_id for s in snap.queue_ahead((0, 5.0, "me"), "me")] == ["a"]


# ---- 4. one rule for the queued shape ----------------------------------------------------------------


def test_the_queued_shape_is_the_pre_filters_pools_and_none_for_a_pipeline() -> None:
    snap = snapshot([node("a0", "ca", used=8), node("b0", "cb", model=SLOW, used=8)])
    framework = Framework([AffinityRule(), ResourceFit(), ScuFit()])
    only_ca = gang(affinity=Affinity(clusters=["ca"]))
    shape = framework.queued_shape(only_ca, snap, (0, NOW, "g"))
    assert shape is not None
    allowed = {(snap.clusters[c].id, snap.models[m]) for c, m in zip(*np.nonzero(shape.pools), strict=True)}
    assert allowed == {("ca", FAST), ("ca", SLOW)}
    # The same as the framework's own record when nothing fits the job.
    assert framework.schedule(only_ca, snap, submitted_at=NOW, queue_key=(0, NOW, "g")).decision is None
    assert np.array_equal(snap.queued["g"].pools, shape.pools)
    assert (snap.queued["g"].workers, snap.queued["g"].per_worker) == (shape.workers, shape.per_worker)
    piped = gang("p", pipeline=Pipeline(layers=[Layer(compute_s=1.0)]))
    assert framework.queued_shape(piped, snap, (0, NOW, "p")) is None


_ = SpanGuard  # the guard reads these helpers (imported for the reader's cross-reference)

"""gang_fit: a long job does not pin the nodes a gang of several nodes needs, where another place
does as well for it.

On the 63-GPU grid platform (Philly-like, load 1.2) a one-GPU job of 57 h filled a node a short job
had broken in a cluster of two 8-GPU nodes, and 2 x 8 gangs waited 40-45 h each for that cluster."""

import dataclasses
import math
import pickle

import msgspec
import numpy as np
import pytest

from loom.model.capacity import NodeCapacity
from loom.sched.availability import WaitBook
from loom.sched.framework import Framework
from loom.sched.plugins.gang_room import GangFit, _rooms_delay, gang_shapes
from loom.sched.plugins.network import predicted_jct_s
from loom.sched.plugins.rare import wait_caused
from loom.sched.profile import DEFAULT_PLUGINS, build_framework
from loom.sched.snapshot import (
    SEEN_JOBS,
    SEEN_MIN_SPAN_S,
    NetMatrix,
    QueuedShape,
    QueuedShapes,
    RunningJob,
    SeenShapes,
    Snapshot,
    WorkerShape,
)
from loom_proto.jobs import JobSpec, Resources, Work
from tests.unit.test_contention import FAST, node

NOW = 10_000.0
MODEL = FAST


def running(
    job_id: str, cluster: str, node_name: str, gpus: int, ends_in_s: float, *, model: str = MODEL
) -> RunningJob:
    return RunningJob(
        job_id=job_id, tenant="t", priority=100, cluster=cluster, gpu_model=model,
        allocations=((node_name, gpus),), expected_end_s=NOW + ends_in_s,
    )  # fmt: skip


def spec(job_id: str, *, workers: int = 1, gpus: int = 1, steps: int = 1000) -> JobSpec:
    return JobSpec(
        job_id=job_id, tenant="t", workers=workers, resources=Resources(gpus=gpus),
        work=Work(steps=steps, step_time_s=1.0),
    )  # fmt: skip


def platform(
    *, gangs: int = 2, workers: int = 2, per_worker: int = 8, cb_model: str = MODEL, cb_speed: float = 1.0
) -> Snapshot:
    """Cluster ``ca``: two 8-GPU nodes, one broken by a short job (3 GPUs for 600 s more). Cluster
    ``cb``: three, one free and two busy for 7,200 s. ``gangs`` gangs of ``workers`` x
    ``per_worker`` were seen lately, within the last hour. ``cb_model``: cb's GPUs, at ``cb_speed``."""
    nodes = [
        node("a0", "ca", used=3),
        node("a1", "ca"),
        node("b0", "cb", model=cb_model),
        node("b1", "cb", used=8, model=cb_model),
        node("b2", "cb", used=8, model=cb_model),
    ]
    runs = [
        running("short", "ca", "a0", 3, 600.0),
        running("busy-1", "cb", "b1", 8, 7_200.0, model=cb_model),
        running("busy-2", "cb", "b2", 8, 7_200.0, model=cb_model),
    ]
    speed = {(MODEL, "training_compute"): 1.0, (cb_model, "training_compute"): cb_speed}
    if cb_model == MODEL:
        speed = {(MODEL, "training_compute"): 1.0}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=NOW, running=runs)
    for i in range(gangs):
        at = NOW - 3_000.0 + 1_500.0 * i if gangs <= 2 else NOW - 3_500.0 + 3_500.0 * i / gangs
        snap.seen.note_job(spec(f"gang-{i}", workers=workers, gpus=per_worker), at)
    return snap


def without_gang_fit() -> Framework:
    return build_framework({"plugins": [p for p in DEFAULT_PLUGINS if p != "gang_fit"]})


def test_a_long_job_leaves_the_cluster_of_two_nodes_whole_for_the_gangs_seen_to_need_both() -> None:
    long_job = spec("long", steps=60_000)  # 60,000 s on either cluster's GPUs
    placed = build_framework().schedule(long_job, platform(), submitted_at=NOW)
    assert placed.decision is not None
    assert [(p.cluster, p.allocations) for p in placed.decision.parts] == [("cb", (("b0", 1),))]
    # Without the plugin it fills the node the short job broke (node fit), and no 2 x 8 gang fits
    # cluster ca for its 60,000 s: the next one waits for cb's busy nodes (7,200 s).
    before = without_gang_fit().schedule(long_job, platform(), submitted_at=NOW)
    assert before.decision is not None and before.decision.parts[0].cluster == "ca"


def test_the_harm_is_the_gangs_longer_wait_for_their_soonest_room() -> None:
    snap = platform()
    framework = build_framework()
    state = framework.new_state(spec("long", steps=60_000), snap)
    assert framework.run_pre_filters(state).ok and "gang_fit" not in state.skipped
    candidates = framework.find_candidates(state)
    harm = GangFit().harm(state, candidates, np.full(len(candidates), 60_000.0))
    by_cluster = {snap.clusters[int(c)].id: float(h) for c, h in zip(candidates.cluster, harm, strict=True)}
    # Gangs of 2 x 8 seen twice over the last 1,500 s (a span of at least SEEN_MIN_SPAN_S): one an
    # hour. ca would hold one at 600 s; pinned, the soonest room is cb's at 7,200 s. cb taken moves
    # nothing: ca's 600 s stays the soonest.
    rate = 1.0 / SEEN_MIN_SPAN_S
    assert by_cluster["ca"] == pytest.approx(wait_caused(rate, 600.0, 7_200.0, SEEN_MIN_SPAN_S))
    assert by_cluster["ca"] > 1_000.0
    assert by_cluster["cb"] == 0.0


def test_a_short_job_still_fills_the_broken_node() -> None:
    # 300 s: it ends before the short job does, so ca's room for a gang comes back when it would.
    placed = build_framework().schedule(spec("quick", steps=300), platform(), submitted_at=NOW)
    assert placed.decision is not None
    assert [(p.cluster, p.allocations) for p in placed.decision.parts] == [("ca", (("a0", 1),))]


def test_only_gangs_seen_twice_that_need_several_nodes_are_kept_room_for() -> None:
    assert [(g.shape.gpus, g.workers, g.count) for g in gang_shapes(platform())] == [(8, 2, 2)]
    assert gang_shapes(platform(gangs=1)) == []  # seen once: not known to come again
    assert gang_shapes(platform(per_worker=4)) == []  # 2 x 4 fits one node: node and hole fit keep it
    assert gang_shapes(platform(workers=4)) == []  # 4 x 8: no cluster could ever hold one
    # Seen once, the long job goes where node fit sends it.
    placed = build_framework().schedule(spec("long", steps=60_000), platform(gangs=1), submitted_at=NOW)
    assert placed.decision is not None and placed.decision.parts[0].cluster == "ca"


def test_a_gang_seen_once_is_kept_room_for_while_it_waits() -> None:
    # An outside evaluator (37 GPUs, Philly-like, load 0.3): the first 2 x 8 gang waited 47 h for
    # the only pool that holds it while one-GPU jobs of up to 35 h kept filling it (17 % behind
    # gavel_like). Seen once and queued, the gang is what the room is for.
    snap = platform(gangs=1)
    anywhere = np.ones(snap.free_sum.shape, dtype=np.bool_)
    snap.queued["gang-0"] = QueuedShape("gang-0", (0,), 2, 8, anywhere)
    assert [(g.shape.gpus, g.workers, g.count) for g in gang_shapes(snap)] == [(8, 2, 1)]
    placed = build_framework().schedule(spec("long", steps=60_000), snap, submitted_at=NOW)
    assert placed.decision is not None and placed.decision.parts[0].cluster == "cb"
    # A queued job of other workers or GPUs per worker does not count for the shape.
    other = platform(gangs=1)
    other.queued["q"] = QueuedShape("q", (0,), 2, 4, anywhere)
    other.queued["r"] = QueuedShape("r", (0,), 4, 8, anywhere)
    assert gang_shapes(other) == []
    # The queue read is kept until it changes: the gang leaving the queue ends the room kept.
    del snap.queued["gang-0"]
    assert gang_shapes(snap) == []


@pytest.mark.parametrize(("slower", "moves"), [(1.5, True), (3.0, False)])
def test_a_place_more_than_twice_as_slow_is_no_alternative(slower: float, moves: bool) -> None:
    # Gangs of 2 x 8 seen 40 times within the hour: pinning ca's broken node costs them ~200,000 s
    # of waiting, more than the long job loses on cb's GPUs 1.5x or 3x slower (30,000 / 120,000 s).
    # Beyond 2x its run, cb is no alternative.
    snap = platform(gangs=40, cb_model="T4", cb_speed=1.0 / slower)
    framework = build_framework()
    state = framework.new_state(spec("long", steps=60_000), snap)
    assert framework.run_pre_filters(state).ok
    candidates = framework.find_candidates(state)
    plugin = GangFit()
    marked = plugin.marked(state, candidates)
    jct = predicted_jct_s(state, candidates)
    harm = plugin.harm(state, candidates, jct)
    (ca,) = [k for k in range(len(candidates)) if snap.clusters[int(candidates.cluster[k])].id == "ca"]
    (cb,) = [k for k in range(len(candidates)) if snap.clusters[int(candidates.cluster[k])].id == "cb"]
    assert jct[cb] == pytest.approx(slower * jct[ca])
    assert harm[ca] > jct[cb] - jct[ca] and harm[cb] == 0.0
    assert bool(marked[ca]) is moves and not marked[cb]


def test_seen_gangs_count_by_worker_shape_and_workers_and_are_forgotten_with_their_job() -> None:
    seen = SeenShapes(limit=2)
    eight = WorkerShape(8)
    seen.note_job(spec("g1", workers=2, gpus=8), 0.0)
    seen.note_job(spec("one", gpus=8), 10.0)  # one worker: no gang
    assert seen.teams == {(eight, 2): 1} and seen.gangs == {16: 1, 8: 1}
    seen.note_job(spec("g2", workers=2, gpus=8), 20.0)  # "g1" forgotten
    seen.note_job(spec("g2", workers=4, gpus=8), 30.0)  # a job's first sight counts
    assert seen.teams == {(eight, 2): 1} and len(seen) == 2
    seen.note_job(spec("g3", workers=4, gpus=8), 40.0)  # "one" forgotten
    seen.note_job(spec("solo", gpus=1), 50.0)  # "g2" forgotten
    assert seen.teams == {(eight, 4): 1}


def test_an_elastic_job_is_seen_as_the_gang_of_its_fewest_workers() -> None:
    seen = SeenShapes()
    elastic = msgspec.structs.replace(spec("e", workers=4, gpus=8), min_workers=1)
    seen.note_job(elastic, 0.0)
    seen.note_job(msgspec.structs.replace(spec("f", workers=4, gpus=8), min_workers=2), 1.0)
    assert seen.teams == {(WorkerShape(8), 2): 1} and seen.gangs == {32: 2}


def four_gpu_gangs(*, a0_end_s: float | None) -> Snapshot:
    """Gangs of 3 x 4 GPUs (two 8-GPU nodes) seen twice. ca: a0 half busy (4 GPUs, ending in
    ``a0_end_s``; None: not known), a1 free. cb (GPUs 1.5x slower): b0 free, b1 and b2 busy for
    7,200 s."""
    nodes = [
        node("a0", "ca", used=4),
        node("a1", "ca"),
        node("b0", "cb", model="T4"),
        node("b1", "cb", used=8, model="T4"),
        node("b2", "cb", used=8, model="T4"),
    ]
    half = running("half", "ca", "a0", 4, 0.0)
    runs = [
        dataclasses.replace(half, expected_end_s=None if a0_end_s is None else NOW + a0_end_s),
        running("busy-1", "cb", "b1", 8, 7_200.0, model="T4"),
        running("busy-2", "cb", "b2", 8, 7_200.0, model="T4"),
    ]
    speed = {(MODEL, "training_compute"): 1.0, ("T4", "training_compute"): 1 / 1.5}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=NOW, running=runs)
    snap.seen.note_job(spec("g0", workers=3, gpus=4), NOW - 3_000.0)
    snap.seen.note_job(spec("g1", workers=3, gpus=4), NOW - 1_500.0)
    return snap


def harm_by_cluster(snap: Snapshot, job: JobSpec) -> dict[str, float]:
    framework = build_framework()
    state = framework.new_state(job, snap)
    assert framework.run_pre_filters(state).ok
    candidates = framework.find_candidates(state)
    harm = GangFit().harm(state, candidates, predicted_jct_s(state, candidates))
    return {snap.clusters[int(c)].id: float(h) for c, h in zip(candidates.cluster, harm, strict=True)}


def test_a_job_ending_before_its_nodes_other_jobs_delays_the_gangs_room_only_for_its_own_run() -> None:
    # ca holds a 3 x 4 gang now (a0's 4 free GPUs and a1's 8). A one-GPU job of 300 s on a0 takes
    # that room for its 300 s, not until a0's other job ends (10 h): it delays the gangs by 300 s
    # (at one an hour: 12.5 s expected), less than the 150 s it would lose on cb's GPUs.
    snap = four_gpu_gangs(a0_end_s=36_000.0)
    quick = spec("quick", steps=300)
    harm = harm_by_cluster(snap, quick)
    rate = 1.0 / SEEN_MIN_SPAN_S
    assert harm["ca"] == pytest.approx(wait_caused(rate, 0.0, 300.0, SEEN_MIN_SPAN_S)) and harm["cb"] == 0.0
    placed = build_framework().schedule(quick, four_gpu_gangs(a0_end_s=36_000.0), submitted_at=NOW)
    assert placed.decision is not None and placed.decision.parts[0].cluster == "ca"


def test_a_busy_node_whose_jobs_end_is_not_known_is_never_counted_as_free_soon() -> None:
    # a0 is full with a job of no predicted end: ca's room for a 2 x 8 gang is a1 alone, never both
    # nodes in known time; cb's comes in 7,200 s and a job in ca moves nothing. (Counted as free
    # now, a0 made ca's room look ready and a job on a1 harmful: it was sent to slower GPUs.)
    snap = platform()
    nodes = [node("a0", "ca", used=8)] + [n for n in _nodes(snap) if n.node != "a0"]
    runs = [
        dataclasses.replace(r, allocations=(("a0", 8),), expected_end_s=None) if r.job_id == "short" else r
        for r in snap.running
    ]
    unknown = Snapshot(nodes, net=NetMatrix(["r1"]), speed=dict(snap.speed), now=NOW, running=runs)
    unknown.seen = snap.seen
    assert harm_by_cluster(unknown, spec("long", steps=20_000)) == {"ca": 0.0, "cb": 0.0}


def _nodes(snap: Snapshot) -> list[NodeCapacity]:
    return [
        node(n, snap.clusters[int(snap.cluster_of[i])].id, used=int(snap.total[i] - snap.free[i]))
        for i, n in enumerate(snap.node_ids)
    ]


def test_gangs_already_queued_take_the_soonest_rooms_and_the_next_pool_counts_too() -> None:
    # Two 2 x 8 gangs queue: the first waits for ca's room (600 s), the second for cb's (7,200 s).
    # The long job in ca delays the first to cb's 7,200 s and the second to ca's 60,000 s: 6,600 +
    # 52,800 s; the one-hour arrivals after them wait for the first pool again, as when nothing
    # queues (5,350 s).
    snap = platform()
    for i in range(2):
        snap.queued[f"q{i}"] = QueuedShape(
            f"q{i}", (0, i), 2, 8, np.ones(snap.free_sum.shape, dtype=np.bool_)
        )
    harm = harm_by_cluster(snap, spec("long", steps=60_000))
    rate = 1.0 / SEEN_MIN_SPAN_S
    arrivals = wait_caused(rate, 600.0, 7_200.0, SEEN_MIN_SPAN_S)
    assert harm["ca"] == pytest.approx(6_600.0 + 52_800.0 + arrivals) and harm["cb"] == 0.0
    # Queued gangs of another shape are no one's room.
    other = platform()
    other.queued["q"] = QueuedShape("q", (0,), 4, 4, np.ones(other.free_sum.shape, dtype=np.bool_))
    assert harm_by_cluster(other, spec("long", steps=60_000))["ca"] == pytest.approx(arrivals)


def test_more_gangs_queued_than_pools_hold_them_wait_for_every_pool_in_turn() -> None:
    # Five 3 x 4 gangs queue; ca holds one now, cb (T4) in 7,200 s, and the platform's two other
    # pools (ca's T4, cb's A100) have no node at all. The long job (20,000 s) on a0 moves the
    # soonest room to cb's 7,200 s and the next to a0's 20,000 s. The gangs take the two rooms in
    # turn (three the first, two the second), and a room that moves moves every gang waiting for
    # it: 3 x 7,200 + 2 x 12,800 s; the arrivals (one an hour) after them, the second room's
    # 12,800 s. On cb's free node it leaves room for one worker beside it, and cb's room in
    # 7,200 s stands. (Counting one gang a pool, nine 16 x 8 gangs queued for the only pool that
    # holds one were counted as one: an 8 x 8 gang of 10.6 h took it, and they all waited 8.5 h
    # more; long-tailed gangs on 506 GPUs at load 1.2, 17 % slower than without the plugin.)
    snap = four_gpu_gangs(a0_end_s=36_000.0)
    anywhere = np.ones(snap.free_sum.shape, dtype=np.bool_)
    for i in range(5):
        snap.queued[f"q{i}"] = QueuedShape(f"q{i}", (0, i), 3, 4, anywhere)
    arrivals = wait_caused(1.0 / SEEN_MIN_SPAN_S, 7_200.0, 20_000.0, SEEN_MIN_SPAN_S)
    assert arrivals == pytest.approx(12_800.0)
    assert harm_by_cluster(snap, spec("long", steps=20_000)) == {
        "ca": pytest.approx(3 * 7_200.0 + 2 * 12_800.0 + arrivals),
        "cb": 0.0,
    }
    # A candidate in a pool none of whose nodes could hold a gang's worker (4-GPU nodes for 2 x 8
    # gangs) is no one's room either, however many gangs queue.
    small = platform()
    nodes = [*_nodes(small), node("c0", "cc", gpus=4)]
    cc = Snapshot(nodes, net=NetMatrix(["r1"]), speed=dict(small.speed), now=NOW, running=list(small.running))
    cc.seen = small.seen
    for i in range(5):
        cc.queued[f"q{i}"] = QueuedShape(f"q{i}", (0, i), 2, 8, np.ones(cc.free_sum.shape, dtype=np.bool_))
    harm = harm_by_cluster(cc, spec("long", steps=60_000))
    arrivals = wait_caused(1.0 / SEEN_MIN_SPAN_S, 7_200.0, 60_000.0, SEEN_MIN_SPAN_S)
    assert harm == {"ca": pytest.approx(3 * 6_600.0 + 2 * 52_800.0 + arrivals), "cb": 0.0, "cc": 0.0}


def test_a_long_job_whose_only_room_now_is_the_gangs_waits_for_a_pool_where_it_delays_no_one() -> None:
    # ca's free node is the only room now (cb's three nodes are busy: b0 for another 1,000 s), and
    # two 2 x 8 gangs queue for ca's and cb's rooms. The long job waits 1,000 s for b0 rather than
    # delay the first gang by ~60,000 s; once it has waited the harm, it would start anyway.
    snap = platform()
    nodes = [n if n.node != "b0" else node("b0", "cb", used=8) for n in _nodes(snap)]
    runs = [*snap.running, running("busy-0", "cb", "b0", 8, 1_000.0)]
    busy = Snapshot(nodes, net=NetMatrix(["r1"]), speed=dict(snap.speed), now=NOW, running=runs)
    busy.seen = snap.seen
    anywhere = np.ones(busy.free_sum.shape, dtype=np.bool_)
    for i in range(2):
        busy.queued[f"q{i}"] = QueuedShape(f"q{i}", (0, i), 2, 8, anywhere)
    long_job = spec("long", steps=60_000)
    waits = build_framework().schedule(long_job, busy, submitted_at=NOW)
    assert waits.decision is None and waits.status.wait_s == pytest.approx(1_000.0)
    assert "keeping room for gangs of several nodes" in waits.status.reason
    late = build_framework().schedule(long_job, busy, submitted_at=NOW - 200_000.0)
    assert late.decision is not None and late.decision.parts[0].cluster == "ca"
    # Without gangs queued or seen, it starts in ca at once.
    alone = Snapshot(nodes, net=NetMatrix(["r1"]), speed=dict(snap.speed), now=NOW, running=runs)
    now = build_framework().schedule(long_job, alone, submitted_at=NOW)
    assert now.decision is not None and now.decision.parts[0].cluster == "ca"


def _cb_busy(b0_ends_in_s: float) -> Snapshot:
    """``platform()`` with cb's free node b0 busy too (8 GPUs, ending in ``b0_ends_in_s``): ca's
    nodes are the only room now."""
    snap = platform()
    nodes = [n if n.node != "b0" else node("b0", "cb", used=8) for n in _nodes(snap)]
    runs = [*snap.running, running("busy-0", "cb", "b0", 8, b0_ends_in_s)]
    busy = Snapshot(nodes, net=NetMatrix(["r1"]), speed=dict(snap.speed), now=NOW, running=runs)
    busy.seen = snap.seen
    return busy


def queue_gangs(snap: Snapshot, *, first: int = 0, run_s: float | None = None) -> None:
    """Two 2 x 8 gangs queued anywhere (keys ``(first, 0)``, ``(first, 1)``), each of ``run_s``
    (None: run not known)."""
    anywhere = np.ones(snap.free_sum.shape, dtype=np.bool_)
    for i in range(2):
        if run_s is None:
            snap.queued[f"q{i}"] = QueuedShape(f"q{i}", (first, i), 2, 8, anywhere)
        else:
            gang = spec(f"q{i}", workers=2, gpus=8, steps=int(run_s))
            snap.queued[f"q{i}"] = QueuedShape(f"q{i}", (first, i), 2, 8, anywhere, gang, run_s)


def test_a_job_held_for_gangs_does_not_wait_for_a_pool_the_gangs_take_first() -> None:
    # ca's nodes are the only room now; two 2 x 8 gangs queue, for ca's room (600 s) and cb's
    # (7,200 s, when b1 and b2 end; b0 ends at 8,000 s). A job of 20,000 s in ca delays them, and
    # cb has room for it at 7,200 s -- the moment the second gang takes cb. Gangs of unknown run:
    # it waits for cb. Gangs that each run 50,000 s: its room in cb comes only after 57,200 s, far
    # more than the gangs lose, and it starts in ca now. (An outside evaluator: 1 x 8 jobs of
    # 0.5-1.3 h held for 2 x 8 gangs waited for "room expected" in the other cluster; the gangs
    # took it and ran 4-15 h before them.)
    job = spec("mid", steps=20_000)
    unknown = _cb_busy(8_000.0)
    queue_gangs(unknown)
    waits = build_framework().schedule(job, unknown, submitted_at=NOW)
    assert waits.decision is None and "waiting for" in waits.status.reason
    assert waits.status.wait_s == pytest.approx(7_200.0)

    known = _cb_busy(8_000.0)
    queue_gangs(known, run_s=50_000.0)
    starts = build_framework().schedule(job, known, submitted_at=NOW)
    assert starts.decision is not None and starts.decision.parts[0].cluster == "ca"


def test_a_job_that_ends_before_the_gangs_room_may_wait_for_it() -> None:
    # cb's two nodes end at 1,000 s and 7,200 s; two 2 x 8 gangs of 50,000 s queue, for ca's room
    # and cb's (7,200 s). A job of 3,000 s has room in cb at 1,000 s and is done there at 4,000 s,
    # before the gangs need the pool: it delays no one there, so it waits for it rather than start
    # now in ca (though cb, once idle, holds no gang beside it).
    nodes = [node("a0", "ca", used=3), node("a1", "ca"), node("b1", "cb", used=8), node("b2", "cb", used=8)]
    runs = [
        running("short", "ca", "a0", 3, 600.0),
        running("busy-1", "cb", "b1", 8, 1_000.0),
        running("busy-2", "cb", "b2", 8, 7_200.0),
    ]
    speed = {(MODEL, "training_compute"): 1.0}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=NOW, running=runs)
    for i in range(2):
        snap.seen.note_job(spec(f"gang-{i}", workers=2, gpus=8), NOW - 3_000.0 + 1_500.0 * i)
    queue_gangs(snap, run_s=50_000.0)
    waits = build_framework().schedule(spec("mid", steps=3_000), snap, submitted_at=NOW, queue_key=(0, 9))
    assert waits.decision is None and waits.status.wait_s == pytest.approx(1_000.0)


def test_a_job_held_for_gangs_counts_the_queued_jobs_ahead_on_the_pool_it_waits_for() -> None:
    # As above, with b0 ending at 1,000 s (the long job's room in cb, while a 2 x 8 gang still
    # waits for b1 and b2 there). A 1 x 8 job of 30,000 s queued ahead of it, that only cb may
    # hold, takes b0 first: the long job's room in cb is then b1's, at 7,200 s -- not 1,000 s, as
    # if it were alone.
    long_job = spec("long", steps=60_000)
    alone = _cb_busy(1_000.0)
    queue_gangs(alone, first=1)
    waits = build_framework().schedule(long_job, alone, submitted_at=NOW, queue_key=(0, 9))
    assert waits.decision is None and waits.status.wait_s == pytest.approx(1_000.0)

    behind = _cb_busy(1_000.0)
    queue_gangs(behind, first=1)
    ahead = spec("ahead", gpus=8, steps=30_000)
    only_cb = np.zeros(behind.free_sum.shape, dtype=np.bool_)
    only_cb[behind.cluster_index["cb"], :] = True
    behind.queued["ahead"] = QueuedShape("ahead", (0, 0), 1, 8, only_cb, ahead, 30_000.0)
    behind.join_queue("ahead")
    later = build_framework().schedule(long_job, behind, submitted_at=NOW, queue_key=(0, 9))
    assert later.decision is None and later.status.wait_s == pytest.approx(7_200.0)


def _claims_setup() -> tuple[WaitBook, Framework, Snapshot]:
    """A framework with its wait book, and ``_cb_busy(1_000.0)`` with two 2 x 8 gangs queued (keys
    ``(1, 0)``, ``(1, 1)``): a 1 x 8 long job is held for b0's room at 1,000 s."""
    book = WaitBook()
    snap = _cb_busy(1_000.0)
    queue_gangs(snap, first=1)
    return book, build_framework(context={"wait_book": book}), snap


def test_jobs_held_for_gangs_claim_their_room_and_a_job_held_later_counts_the_claims_ahead() -> None:
    # As above, alone: a 1 x 8 long job waits 1,000 s for b0. Held, it claims b0's room in the wait
    # book; a second long job decided next counts that claim ahead of it, so its room in cb is b1's,
    # at 7,200 s, not the same 1,000 s. (An outside evaluator: three 1 x 8 jobs held for a 2 x 8
    # gang all waited for one node "expected in 27 s".) Placed, the first gives its claim up.
    book, framework, snap = _claims_setup()
    long_job, long_2 = spec("long", gpus=8, steps=60_000), spec("long-2", gpus=8, steps=60_000)
    first = framework.schedule(long_job, snap, submitted_at=NOW - 10.0, queue_key=(0, 8))
    assert first.decision is None and first.status.wait_s == pytest.approx(1_000.0)
    held = book.claims["long"]
    assert (held.cluster, held.gpu_model, held.gpus, held.start_s) == ("cb", MODEL, 8, NOW + 1_000.0)
    second = framework.schedule(long_2, snap, submitted_at=NOW, queue_key=(0, 9))
    assert second.decision is None and second.status.wait_s == pytest.approx(7_200.0)
    # Without the claim (a framework of its own), the second would wait for the same 1,000 s.
    alone = build_framework().schedule(long_2, snap, submitted_at=NOW, queue_key=(0, 9))
    assert alone.decision is None and alone.status.wait_s == pytest.approx(1_000.0)
    placed = framework.schedule(long_job, snap, submitted_at=NOW - 200_000.0)
    assert placed.decision is not None and "long" not in book.claims


def test_a_what_if_leaves_the_claims_as_they_are_and_stale_claims_expire() -> None:
    # A what-if (apply=False: the service's what-if, the migrator's "where would it go") of a job
    # the permit holds claims nothing, and one of a held job does not give its claim up; a claim
    # not renewed in time (the job was cancelled or placed elsewhere) is forgotten at the next
    # decision. (A review: such claims stayed for good and shrank the pool for every later job.)
    book, framework, snap = _claims_setup()
    long_job = spec("long", gpus=8, steps=60_000)
    asked = framework.schedule(long_job, snap, submitted_at=NOW, queue_key=(0, 8), apply=False)
    assert asked.decision is None and "keeping room for gangs" in asked.status.reason
    assert not book.claims
    framework.schedule(long_job, snap, submitted_at=NOW, queue_key=(0, 8))
    assert "long" in book.claims
    placeable = framework.schedule(long_job, snap, submitted_at=NOW - 200_000.0, apply=False)
    assert placeable.decision is not None and "long" in book.claims
    later = _cb_busy(1_000.0)
    later.now = book.claims["long"].expires_s + 1.0
    framework.schedule(spec("small", steps=100), later, submitted_at=later.now)
    assert not book.claims


def test_of_two_held_jobs_submitted_together_only_the_second_counts_the_firsts_claim() -> None:
    # Jobs submitted at the same moment (a burst, a DAG's stages) come in job-id order: before,
    # each counted the other's claim, so both waited for the later room.
    book, framework, snap = _claims_setup()
    first, second = spec("a-long", gpus=8, steps=60_000), spec("b-long", gpus=8, steps=60_000)
    assert framework.schedule(first, snap, submitted_at=NOW).status.wait_s == pytest.approx(1_000.0)
    assert framework.schedule(second, snap, submitted_at=NOW).status.wait_s == pytest.approx(7_200.0)
    assert book.claims["b-long"].start_s == pytest.approx(NOW + 7_200.0)
    again = framework.schedule(first, snap, submitted_at=NOW)
    assert again.decision is None and again.status.wait_s == pytest.approx(1_000.0)


def test_a_gang_of_several_nodes_itself_is_what_the_room_is_kept_for() -> None:
    # A 2 x 8 gang deciding is one of the gangs: which of them goes first is the queue's order.
    # (Judged like a long job, a 4 x 4 gang of 64 h waited 34 h for another pool on the 63-GPU
    # Philly-like grid cell at load 0.5.) A 2 x 4 gang, which one node holds, is judged.
    framework = build_framework()
    for workers, gpus, skipped in ((2, 8, True), (2, 4, False), (1, 8, False)):
        state = framework.new_state(spec("j", workers=workers, gpus=gpus, steps=60_000), platform())
        assert framework.run_pre_filters(state).ok
        assert ("gang_fit" in state.skipped) is skipped


def bigger_gang_waiting(*, queued: bool, mid_speed: float = 1.0 / 1.5) -> Snapshot:
    """Cluster ``big``: four 8-GPU nodes, one busy for 1,000 s more; cluster ``mid``: two free
    8-GPU nodes of GPUs ``mid_speed`` as fast. A 4 x 8 gang (only ``big`` holds one) seen three
    times over the last hour, the last of them queued for ``big`` (``queued``)."""
    nodes = [node(f"g{i}", "big", used=8 if i == 0 else 0) for i in range(4)]
    nodes += [node("m0", "mid", model="T4"), node("m1", "mid", model="T4")]
    runs = [dataclasses.replace(running("busy", "big", "g0", 8, 1_000.0))]
    speed = {(MODEL, "training_compute"): 1.0, ("T4", "training_compute"): mid_speed}
    snap = Snapshot(nodes, net=NetMatrix(["r1"]), speed=speed, now=NOW, running=runs)
    for i in range(3):
        snap.seen.note_job(spec(f"wide-{i}", workers=4, gpus=8), NOW - 3_000.0 + 1_400.0 * i)
    if queued:
        anywhere = np.ones(snap.free_sum.shape, dtype=np.bool_)
        snap.queued["wide-2"] = QueuedShape("wide-2", (0,), 4, 8, anywhere)
    return snap


def test_a_smaller_gang_leaves_a_bigger_queued_gang_its_only_pool() -> None:
    # Long-tailed gangs on 506 GPUs, load 1.2: an 8 x 8 gang of 10.6 h took the only pool that
    # holds a 16 x 8 gang while nine of them queued (17 % slower than without the plugin). A gang of
    # several nodes is judged for the bigger gangs queued: the 2 x 8 gang of 20,000 s would keep
    # the queued 4 x 8 out of ``big`` for 19,000 s more, and loses 10,000 s on ``mid``'s slower GPUs.
    gang = spec("pair", workers=2, gpus=8, steps=20_000)
    placed = build_framework().schedule(gang, bigger_gang_waiting(queued=True), submitted_at=NOW)
    assert placed.decision is not None and placed.decision.parts[0].cluster == "mid"
    before = without_gang_fit().schedule(gang, bigger_gang_waiting(queued=True), submitted_at=NOW)
    assert before.decision is not None and before.decision.parts[0].cluster == "big"
    # Only queued gangs count for a gang (it is not held back for arrivals foreseen): with none
    # queued, it takes the faster GPUs.
    alone = build_framework().schedule(gang, bigger_gang_waiting(queued=False), submitted_at=NOW)
    assert alone.decision is not None and alone.decision.parts[0].cluster == "big"
    # A gang as big as those queued is their peer: which goes first is the queue's order; with no
    # bigger gang queued, a gang is not judged at all.
    framework = build_framework()
    for workers, queued, skipped in ((4, True, True), (2, True, False), (2, False, True)):
        state = framework.new_state(spec("j", workers=workers, gpus=8), bigger_gang_waiting(queued=queued))
        assert framework.run_pre_filters(state).ok
        assert ("gang_fit" in state.skipped) is skipped


def test_a_queued_gang_the_shapes_seen_have_forgotten_is_still_kept_room_for() -> None:
    # SeenShapes remembers the latest 256 jobs: a gang that waits while more are decided is still
    # waiting (a review found it lost its room then).
    snap = platform(gangs=1)
    anywhere = np.ones(snap.free_sum.shape, dtype=np.bool_)
    snap.queued["gang-0"] = QueuedShape("gang-0", (0,), 2, 8, anywhere, spec("gang-0", workers=2, gpus=8))
    for i in range(SEEN_JOBS):
        snap.seen.note_job(spec(f"small-{i}"), NOW - 100.0 + i * 0.1)
    assert not snap.seen.teams  # the gang seen is forgotten
    assert [(g.shape.gpus, g.workers, g.count) for g in gang_shapes(snap)] == [(8, 2, 0)]
    placed = build_framework().schedule(spec("long", steps=60_000), snap, submitted_at=NOW)
    assert placed.decision is not None and placed.decision.parts[0].cluster == "cb"


def test_the_queue_counts_its_gangs_as_entries_come_and_go() -> None:
    queued = QueuedShapes()
    anywhere = np.ones((1, 1), dtype=np.bool_)
    queued["a"] = QueuedShape("a", (0,), 2, 8, anywhere)
    queued["b"] = QueuedShape("b", (1,), 1, 8, anywhere)  # one worker: no gang
    queued.setdefault("c", QueuedShape("c", (2,), 2, 8, anywhere))
    assert queued.teams == {(8, 2): 2}
    queued["a"] = QueuedShape("a", (0,), 3, 4, anywhere)  # replaced: its old shape leaves
    assert queued.teams == {(8, 2): 1, (4, 3): 1}
    queued.pop("c")
    queued.pop("missing", None)
    del queued["a"]
    assert queued.teams == {}
    queued.update({"d": QueuedShape("d", (3,), 2, 2, anywhere)})
    assert queued.teams == {(2, 2): 1}
    assert pickle.loads(pickle.dumps(queued)).teams == {(2, 2): 1}
    queued.clear()
    assert queued.teams == {} and not queued


def test_a_room_that_moves_to_never_for_a_gang_that_waits_for_it_is_infinite_harm() -> None:
    # Only the rooms a queued gang waits for count; a room no one waits for moving to never is no
    # harm (0 x inf was NaN).
    before, after = np.array([0.0, 100.0]), np.array([100.0, math.inf])
    assert _rooms_delay(before, after, queued=1, rate=0.0, horizon=3_600.0) == 100.0
    assert _rooms_delay(before, after, queued=2, rate=0.0, horizon=3_600.0) == math.inf
    assert _rooms_delay(before, after, queued=1, rate=1e-3, horizon=3_600.0) == math.inf


def test_the_big_job_handicap_leaves_the_gang_hold_at_the_believed_runs() -> None:
    """A big job's handicap ranks candidates only: the hold weighs its run and harm at the believed
    speeds (``believed_jct_s``). Handicapped at 0.5, cb's untried T4 (believed 1.5x slower) would
    look 3x slower, beyond the 2x within which a place counts as an alternative, and the hold
    would let the job take the gangs' cluster; at the believed runs it is marked as unhandicapped."""
    from loom.sched.plugins.network import believed_jct_s

    snap = platform(gangs=40, cb_model="T4", cb_speed=1.0 / 1.5)
    snap.set_learned({("bert", MODEL): 1.0, ("bert", "T4"): 1.0}, [("bert", MODEL)])
    snap.set_risk(16.0, 0.5)
    big = JobSpec(
        job_id="long", tenant="t", resources=Resources(gpus=1), work=Work(steps=60_000, step_time_s=1.0),
        labels={"model": "BERT"},
    )  # fmt: skip
    assert snap.job_at_risk(big)
    framework = build_framework()
    state = framework.new_state(big, snap)
    assert framework.run_pre_filters(state).ok
    candidates = framework.find_candidates(state)
    (ca,) = [k for k in range(len(candidates)) if snap.clusters[int(candidates.cluster[k])].id == "ca"]
    (cb,) = [k for k in range(len(candidates)) if snap.clusters[int(candidates.cluster[k])].id == "cb"]
    ranked, believed = predicted_jct_s(state, candidates), believed_jct_s(state, candidates)
    assert ranked[cb] == pytest.approx(3.0 * ranked[ca])  # what the scores see
    assert believed[cb] == pytest.approx(1.5 * believed[ca])  # what the hold weighs
    assert bool(GangFit().marked(state, candidates)[ca]) and not GangFit().marked(state, candidates)[cb]
    small = framework.new_state(spec("short", steps=600), snap)
    assert not snap.job_at_risk(small.job)
    assert believed_jct_s(small, candidates) is predicted_jct_s(small, candidates)  # the same array

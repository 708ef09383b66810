"""Drains (pure): refusal when a job has nowhere to go, largest benefit first, bounded concurrency."""

from dataclasses import replace

from loom.migrate.benefit import MigrationVerdict
from loom.migrate.drain import (
    DrainJob,
    ShardReply,
    drain_refusal,
    next_move_id,
    next_moves,
    open_gpus,
    order_moves,
    shard_confirmation,
    waiting_for_capacity,
)
from loom_proto.jobs import Affinity


def _job(
    job_id: str, *, gpus: int = 1, models: tuple[str, ...] = ("T4",), step: int = 0, every: int = 10
) -> DrainJob:
    return DrainJob(
        job_id, 1, gpus, models, steps=100, step=step, step_time_s=10.0, checkpoint_every_steps=every
    )


GPUS = {"a": {"T4": 8, "P100": 2}, "b": {"T4": 4}, "c": {"G2": 8}}


def test_a_drain_is_refused_when_a_job_would_have_no_feasible_gpus_elsewhere() -> None:
    why = drain_refusal("a", [_job("t4"), _job("p100", models=("P100",))], GPUS, closed=set())
    assert why is not None and "--force" in why
    assert "p100 (1 x P100: 0 on other open clusters it may use)" in why
    assert "1 job(s)" in why  # the T4 job has c-b's T4s


def test_a_drain_is_allowed_when_other_open_clusters_hold_enough() -> None:
    assert drain_refusal("a", [_job("t4", gpus=4), _job("any", models=())], GPUS, closed=set()) is None


def test_closed_clusters_do_not_count_as_somewhere_to_go() -> None:
    assert drain_refusal("a", [_job("t4")], GPUS, closed={"b"}) is not None
    assert drain_refusal("a", [_job("big", gpus=5)], GPUS, closed=set()) is not None


def test_only_the_clusters_a_jobs_affinity_allows_count_as_somewhere_to_go() -> None:
    regions = {"a": "eu", "b": "us", "c": "us"}
    pinned = replace(_job("pinned"), affinity=Affinity(clusters=["a"]))
    why = drain_refusal("a", [pinned], GPUS, closed=set(), regions=regions)
    assert why is not None and "pinned (1 x T4: 0 on other open clusters it may use)" in why
    assert (
        drain_refusal(
            "a", [replace(_job("two"), affinity=Affinity(clusters=["a", "b"]))], GPUS, set(), regions
        )
        is None
    )
    anyg = replace(_job("any", models=()), affinity=Affinity(avoid_regions=["us"]))
    assert drain_refusal("a", [anyg], GPUS, set(), regions) is not None
    assert drain_refusal("a", [replace(anyg, affinity=Affinity())], GPUS, set(), regions) is None
    in_us = replace(_job("in-us", models=()), affinity=Affinity(regions=["us"], avoid_clusters=["b"]))
    assert open_gpus(in_us, "a", GPUS, set(), regions) == {"c": 8}
    # A region list cannot be checked against a cluster whose region is not known: not counted.
    assert open_gpus(in_us, "a", GPUS, set(), {}) == {}
    waiting = waiting_for_capacity("a", [pinned], set(), GPUS, set(), regions=regions)["pinned"]
    assert "no other open cluster it may use has any" in waiting


def test_the_job_with_the_most_work_left_moves_first() -> None:
    jobs = [_job("small", step=90), _job("wide", gpus=4, step=50), _job("long", step=0)]
    assert [j.job_id for j in order_moves(jobs)] == ["wide", "long", "small"]


def test_at_most_concurrency_moves_are_in_flight() -> None:
    ordered = order_moves([_job(f"j{i}", step=i) for i in range(5)])
    assert [j.job_id for j in next_moves(ordered, in_flight=0, concurrency=2, past_deadline=False)] == [
        "j0",
        "j1",
    ]
    assert [j.job_id for j in next_moves(ordered, in_flight=1, concurrency=2, past_deadline=False)] == ["j0"]
    assert next_moves(ordered, in_flight=2, concurrency=2, past_deadline=False) == []


def test_jobs_without_checkpoints_wait_for_the_deadline_then_everything_moves() -> None:
    ordered = order_moves([_job("ck"), _job("nock", every=0)])
    assert [j.job_id for j in next_moves(ordered, in_flight=0, concurrency=5, past_deadline=False)] == ["ck"]
    assert {j.job_id for j in next_moves(ordered, in_flight=5, concurrency=1, past_deadline=True)} == {
        "ck",
        "nock",
    }


def test_drains_rank_by_the_planners_net_benefit_and_jobs_without_a_verdict_come_after() -> None:
    from loom.migrate.benefit import (
        Candidate,
        MigrationBudget,
        PathState,
        RunningJobState,
        decide,
        plan_migrations,
    )

    def verdict(job_id: str, here_s: float) -> MigrationVerdict:
        state = RunningJobState(
            job_id=job_id,
            job_class="training",
            cluster="a",
            region="r",
            steps=100,
            steps_done=10.0,
            step_s=here_s,
            checkpoint_every_steps=10,
            checkpoint_bytes=1e9,
        )
        return decide(state, Candidate("b", "r", 1.0), PathState(1.0, 10.0), now_s=0.0, trigger="drain")

    verdicts = {"slow": verdict("slow", 5.0), "fast": verdict("fast", 1.0), "mid": verdict("mid", 2.0)}
    nowhere = decide(
        RunningJobState(
            job_id="nowhere",
            job_class="training",
            cluster="a",
            region="r",
            steps=100,
            steps_done=0.0,
            step_s=9.0,
        ),
        None,
        PathState(1.0, 10.0),
        now_s=0.0,
        trigger="drain",
    )
    jobs = [_job("fast"), _job("mid"), _job("slow"), _job("unknown", gpus=8), _job("small", step=90)]
    jobs.append(_job("nowhere", step=95))
    ordered = [j.job_id for j in order_moves(jobs, {**verdicts, "nowhere": nowhere})]
    # The same order plan_migrations starts them in (one ranking), then the rest by work left.
    plan = plan_migrations(verdicts.values(), {}, MigrationBudget(per_cluster=10))
    assert ordered[:3] == [v.job_id for v in plan.start] == ["slow", "mid", "fast"]
    # No room elsewhere now (no target): after those that have one, by the work left.
    assert ordered[3:] == ["unknown", "small", "nowhere"]


def _verdict(job_id: str, target: str | None) -> MigrationVerdict:
    from loom.migrate.benefit import Candidate, PathState, RunningJobState, decide

    state = RunningJobState(
        job_id=job_id, job_class="training", cluster="a", region="r", steps=100, steps_done=10.0, step_s=1.0
    )
    candidate = Candidate(target, "r", 1.0) if target is not None else None
    return decide(state, candidate, PathState(1.0, 10.0), now_s=0.0, trigger="drain")


def test_a_job_no_placement_elsewhere_has_room_for_stays_running_until_room_appears_or_the_deadline() -> None:
    from loom.migrate.drain import placeable, waiting_for_capacity

    jobs = [_job("room", step=20), _job("full", gpus=4, step=50), _job("stale", step=10), _job("unasked")]
    verdicts = {
        "room": _verdict("room", "b"),
        "full": _verdict("full", None),
        "stale": _verdict("stale", "a"),
    }
    # A target on the drained cluster itself is a what-if from before placement heard of the drain.
    room = placeable("a", verdicts)
    assert room == {"room"}
    ordered = order_moves(jobs, verdicts)
    # Before the deadline only the job with room elsewhere moves: giving the others' runs up would
    # only queue them, their GPUs lost, with nowhere to go. Past the deadline every job goes.
    now = next_moves(ordered, in_flight=0, concurrency=3, past_deadline=False, room=room)
    assert [j.job_id for j in now] == ["room"]
    late = next_moves(ordered, in_flight=0, concurrency=3, past_deadline=True, room=room)
    assert {j.job_id for j in late} == {"room", "full", "stale", "unasked"}
    # Room appears (placement's next answer names a target): it moves on the next pass.
    again = placeable("a", {**verdicts, "full": _verdict("full", "b")})
    assert [
        j.job_id for j in next_moves(ordered, in_flight=0, concurrency=3, past_deadline=False, room=again)
    ] == [
        "room",
        "full",
    ]

    waiting = waiting_for_capacity("a", jobs, room, GPUS, closed=set())
    assert set(waiting) == {"full", "stale", "unasked"}
    why = waiting["full"]
    assert why.startswith("waits for capacity: needs 4 x T4 on another open cluster it may use")
    assert "4 such GPU(s) on those clusters in all: b 4" in why and "keeps running" in why
    # A closed cluster's GPUs are not counted; a job that takes any GPU counts every model.
    assert (
        "no other open cluster it may use has any"
        in waiting_for_capacity("a", [_job("x")], set(), GPUS, closed={"b"})["x"]
    )
    anyg = waiting_for_capacity("a", [_job("any", models=())], set(), GPUS, closed=set())["any"]
    assert "needs 1 x any GPU" in anyg and "12 such GPU(s)" in anyg and "b 4, c 8" in anyg


def test_a_job_whose_room_was_taken_while_it_waited_for_its_turn_is_asked_again_and_does_not_move() -> None:
    from loom.migrate.drain import Pick, pick_moves, placeable, waiting_for_capacity

    def pick(
        jobs: list[DrainJob], verdicts: dict[str, MigrationVerdict], fresh: set[str], in_flight: int = 0
    ) -> Pick:
        return pick_moves(
            "a",
            jobs,
            verdicts,
            fresh=fresh,
            in_flight=in_flight,
            concurrency=1,
            past_deadline=False,
        )

    def ids(found: list[DrainJob]) -> list[str]:
        return [j.job_id for j in found]

    jobs = [_job("first"), _job("second"), _job("third")]
    # Pass 1: placement finds room for all three (equal benefit: ranked by id); one may move.
    pass1 = {
        "first": _verdict("first", "b"),
        "second": _verdict("second", "b"),
        "third": _verdict("third", "c"),
    }
    p = pick(jobs, pass1, fresh=set(pass1))
    assert ids(p.move) == ["first"] and p.ask_again == []
    # While "second" waits for its turn, other work takes b's room. The slot frees; its verdict,
    # from pass 1, still names b: ranked on it alone it would move now, onto room that is gone
    # (its run given up, the job queued without GPUs) -- the stale verdict.
    left = jobs[1:]
    stale = {k: v for k, v in pass1.items() if k != "first"}
    assert "second" in placeable("a", stale)
    # The pick moves nothing on it: placement is asked again about the job whose turn it is.
    p = pick(left, stale, fresh=set())
    assert p.move == [] and ids(p.ask_again) == ["second"]
    # Asked now, placement has no room for it: it waits for capacity, and the next in rank has
    # its turn -- asked again too, since its room was found in pass 1 as well.
    now = {**stale, "second": _verdict("second", None)}
    p = pick(left, now, fresh={"second"})
    assert p.move == [] and ids(p.ask_again) == ["third"]
    # Its room on c is still there (found now): it moves; "second" stays, waiting for capacity.
    p = pick(left, now, fresh={"second", "third"})
    assert ids(p.move) == ["third"] and p.ask_again == []
    assert set(waiting_for_capacity("a", left, placeable("a", now), GPUS, closed=set())) == {"second"}
    # Had c's room gone too, nothing would move.
    gone = {**now, "third": _verdict("third", None)}
    assert pick(left, gone, fresh={"second", "third"}) == Pick(move=[], ask_again=[])
    # The concurrency holds: with the slot taken nothing is asked or moved.
    assert pick(left, stale, fresh=set(), in_flight=1) == Pick(move=[], ask_again=[])
    # Past the deadline every job moves, room or not, without asking again.
    late = pick_moves("a", left, gone, fresh=set(), in_flight=1, concurrency=1, past_deadline=True)
    assert ids(late.move) == ["second", "third"] and late.ask_again == []


def test_a_what_if_answer_is_room_off_the_drained_cluster_only_when_no_part_lands_there() -> None:
    from loom.migrate.drain import room_off

    assert room_off("a", ["b"]) and room_off("a", ["b", "c"])
    assert not room_off("a", ["a"]) and not room_off("a", ["b", "a"])  # a part on the drained one
    assert not room_off("a", [])  # no candidate: no room anywhere


def test_a_runs_first_move_keeps_the_plain_id_and_one_after_failed_moves_takes_the_next_free_one() -> None:
    assert next_move_id("j", 3, {}) == "j:3"
    assert next_move_id("j", 3, {"j:3": "failed"}) == "j:3:2"  # undrained, then drained again
    assert next_move_id("j", 3, {"j:3": "failed", "j:3:2": "failed"}) == "j:3:3"
    assert next_move_id("j", 3, {"j:3:2": "failed"}) == "j:3"  # the plain id is free: it is taken


def test_no_move_is_named_while_one_of_the_run_is_open_or_done() -> None:
    # A replayed pass (or a second instance) that reads the move it planned plans nothing more.
    for state in ("planned", "started", "completed"):
        assert next_move_id("j", 1, {"j:1": "failed", "j:1:2": state}) is None
        assert next_move_id("j", 1, {"j:1": state}) is None


def _reply(shard: str, **territories: int) -> ShardReply:
    return ShardReply(shard=shard, holder=f"placement-{shard}", territories=territories)


def test_a_drain_is_confirmed_only_when_every_live_shard_leader_answered() -> None:
    live = {"global": 5, "eu": 7}
    first = shard_confirmation(live, [], [_reply("global", **{"global": 5})])
    assert first.confirmed == ("global",) and first.unconfirmed == ("eu",)
    assert not first.complete
    both = shard_confirmation(live, [], [_reply("global", **{"global": 5}), _reply("eu", eu=7)])
    assert both.confirmed == ("eu", "global") and both.unconfirmed == () and both.complete
    assert both.by == {"eu": "placement-eu (eu)", "global": "placement-global (global)"}


def test_a_deposed_leaders_answer_does_not_confirm_its_territory() -> None:
    stale = shard_confirmation({"eu": 9}, [], [_reply("eu", eu=7)])
    assert stale.unconfirmed == ("eu",) and not stale.complete
    # A newer leader than the one read (it took the lease after the read) confirms it.
    newer = shard_confirmation({"eu": 9}, [], [_reply("eu", eu=7), _reply("eu", eu=11)])
    assert newer.complete and newer.confirmed == ("eu",)


def test_a_territory_taken_over_is_confirmed_by_its_holder() -> None:
    # The global leader holds eu's territory (eu's lease and fence token 12) besides its own.
    got = shard_confirmation({"global": 5, "eu": 12}, [], [_reply("global", **{"global": 5, "eu": 12})])
    assert got.complete and got.confirmed == ("eu", "global")
    assert got.by["eu"] == "placement-global (global)"


def test_a_shard_without_a_leader_need_not_confirm_and_is_named() -> None:
    got = shard_confirmation({"global": 5}, ["retired"], [_reply("global", **{"global": 5})])
    assert got.complete and got.leaderless == ("retired",)
    assert got.to_json() == {
        "confirmed": ["global"],
        "unconfirmed": [],
        "leaderless": ["retired"],
        "by": {"global": "placement-global (global)"},
        "known": True,
    }


def test_no_live_leader_or_unknown_shards_is_never_a_confirmation() -> None:
    nobody = shard_confirmation({}, ["global"], [])
    assert not nobody.complete and nobody.leaderless == ("global",) and nobody.unconfirmed == ()
    unknown = shard_confirmation(None, [], [_reply("global", **{"global": 5})])
    assert not unknown.complete and unknown.confirmed == ("global",) and not unknown.known


def test_a_reply_without_territories_counts_for_nothing() -> None:
    assert ShardReply.parse({"ok": True, "drained": ["c-weu-a"]}) is None  # an older placement
    assert ShardReply.parse({"ok": True, "territories": {"eu": "x"}}) is None
    parsed = ShardReply.parse({"ok": True, "shard": "global", "holder": "h", "territories": {"global": 3}})
    assert parsed == ShardReply(shard="global", holder="h", territories={"global": 3})


def test_a_pipeline_waiting_in_a_drain_is_said_to_need_its_stages_gpus() -> None:
    # "pipe3 waits for capacity: needs 1 x any GPU": its resources, not the 7 GPUs its stage held.
    from loom.migrate.drain import needs

    assert needs(_job("gang", gpus=4)) == "4 x T4"
    pipe = replace(_job("pipe", gpus=12, models=()), pipeline=True)
    assert needs(pipe) == "12 GPUs in all for its pipeline's stages (any GPU model)"
    waits = waiting_for_capacity("a", [pipe], set(), GPUS, set())
    assert "needs 12 GPUs in all for its pipeline's stages" in str(waits)


def test_a_job_no_other_open_cluster_can_hold_is_not_told_room_may_appear() -> None:
    # A forced drain of a P100 job (no other cluster has P100s) said "asked about again until room
    # appears": it never could.
    why = waiting_for_capacity("a", [_job("p100", models=("P100",))], set(), GPUS, set())["p100"]
    assert why.startswith("stays: needs 1 x P100, and no other open cluster it may use has any")
    assert "until room appears" not in why and "deadline" in why

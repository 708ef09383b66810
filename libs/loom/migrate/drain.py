"""Draining a cluster: whether it may be drained, which jobs move first, how many at once (pure).

The migration service closes a drained cluster to new placements and moves its jobs a few at a
time, each at a checkpoint boundary. This module holds the decisions:

* :func:`drain_refusal` — a drain is refused when some job on the cluster has no feasible GPUs
  (of a model it accepts) on any other open cluster its affinity allows (``--force`` overrides it);
* :func:`order_moves` — which jobs move first: the largest net benefit first, ranked like every
  other migration plan (:func:`loom.migrate.benefit.rank_key`);
* :func:`next_moves` — how many more may start now, under the drain's concurrency;
* :func:`pick_moves` — the moves a pass starts: those two, on room found on the current snapshot
  only (a verdict from an earlier pass is asked for again first: the room it found may have been
  taken by other work while the job waited for its turn);
* :func:`room_off` — whether a what-if's answer is room off the drained cluster (asked again as a
  planned move is about to start: room can go while its checkpoint is written);
* :func:`next_move_id` — the id of a job's next move from a run: ``job:attempt``, and after moves
  of that run that failed (an undrain fails a drain's planned moves), ``job:attempt:2``, ``:3``…,
  so a cluster drained again plans its jobs again while a replayed pass plans nothing twice;
* :func:`waiting_for_capacity` — the jobs that stay where they are for now, because no placement on
  another open cluster has room for them (they keep running and are asked about again each pass;
  past the drain's deadline they move anyway), each with what it needs;
* :func:`shard_confirmation` — whether every placement shard that leads now has reloaded the
  drained clusters (a drain or undrain is answered once all have, or after a short wait naming
  those that did not): only the territory's holder places on a cluster, but the migration service
  does not know the region groups, and a territory changes holders (a take-over, a hand-back), so
  it asks every live leader rather than guess the one that matters.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loom.migrate.benefit import MigrationVerdict, rank_key
from loom.sched.allowed import cluster_allowed
from loom_proto.jobs import Affinity


@dataclass(frozen=True, slots=True)
class DrainJob:
    """A running job with a part on the cluster being drained."""

    job_id: str
    attempt: int
    gpus: int
    gpu_models: tuple[str, ...]
    """GPU models the job accepts (empty: any)."""
    steps: int
    step: int
    """Steps done (from its progress)."""
    step_time_s: float
    checkpoint_every_steps: int
    affinity: Affinity = field(default_factory=Affinity)
    """Where it may run (its hard rules: :func:`loom.sched.allowed.cluster_allowed`)."""
    pipeline: bool = False
    """A pipeline: ``gpus`` are its stages' GPUs in all, sized from its layers."""

    @property
    def remaining_gpu_s(self) -> float:
        """GPU-seconds the job still needs (reference speed)."""
        return max(self.steps - self.step, 0) * self.step_time_s * self.gpus


def open_gpus(
    job: DrainJob,
    cluster: str,
    gpus_by_cluster: Mapping[str, Mapping[str, int]],
    closed: Collection[str],
    regions: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Cluster -> the GPUs of a model ``job`` accepts on each other open cluster its affinity
    allows (``regions``: cluster -> region, for its region lists), those with none left out."""
    shut = set(closed) | {cluster}
    where = (regions or {}).get
    return {
        c: n
        for c, models in sorted(gpus_by_cluster.items())
        if c not in shut
        and cluster_allowed(job.affinity, c, where(c))
        and (n := sum(k for m, k in models.items() if not job.gpu_models or m in job.gpu_models)) > 0
    }


def drain_refusal(
    cluster: str,
    jobs: Iterable[DrainJob],
    gpus_by_cluster: Mapping[str, Mapping[str, int]],
    closed: Collection[str],
    regions: Mapping[str, str] | None = None,
) -> str | None:
    """Why draining ``cluster`` is refused (it holds some job's only feasible GPUs: of a model it
    accepts, on an open cluster its affinity allows), or None."""
    stuck: list[str] = []
    for job in jobs:
        elsewhere = sum(open_gpus(job, cluster, gpus_by_cluster, closed, regions).values())
        if elsewhere < job.gpus:
            wants = "/".join(job.gpu_models) or "any"
            stuck.append(
                f"{job.job_id} ({job.gpus} x {wants}: {elsewhere} on other open clusters it may use)"
            )
    if not stuck:
        return None
    return (
        f"draining {cluster} would leave {len(stuck)} job(s) without feasible GPUs elsewhere: "
        + ", ".join(stuck[:5])
        + (" ..." if len(stuck) > 5 else "")
        + " (use --force to drain anyway)"
    )


def order_moves(
    jobs: Iterable[DrainJob], verdicts: Mapping[str, MigrationVerdict] | None = None
) -> list[DrainJob]:
    """Largest benefit first, by the planners' one ranking (:func:`loom.migrate.benefit.rank_key`):
    the jobs with a verdict that names a target (the service asks placement's what-if for each and
    decides with the ``drain`` trigger) by net benefit, largest first; then the others (no answer,
    no room elsewhere now) by the GPU-seconds they still need, most first (they lose the most if the
    drain's deadline catches them); ties by id."""
    placed = {job_id: v for job_id, v in (verdicts or {}).items() if v.target is not None}
    judged = [j for j in jobs if j.job_id in placed]
    unjudged = [j for j in jobs if j.job_id not in placed]
    judged.sort(key=lambda j: rank_key(placed[j.job_id]))
    unjudged.sort(key=lambda j: (-j.remaining_gpu_s, j.job_id))
    return judged + unjudged


def placeable(cluster: str, verdicts: Mapping[str, MigrationVerdict]) -> set[str]:
    """The jobs whose ``drain`` verdict names a target off ``cluster``: placement found room for
    them elsewhere now. (A target on the drained cluster itself is a what-if answered before
    placement heard of the drain: no room elsewhere, as far as anyone knows.)"""
    return {job_id for job_id, v in verdicts.items() if v.target is not None and v.target != cluster}


def room_off(cluster: str, candidate_clusters: Collection[str]) -> bool:
    """Whether a what-if's candidate (the clusters its parts would run on) is room off the drained
    ``cluster``: some cluster, none of them the drained one."""
    return bool(candidate_clusters) and cluster not in candidate_clusters


def next_moves(
    ordered: Sequence[DrainJob],
    *,
    in_flight: int,
    concurrency: int,
    past_deadline: bool,
    room: Collection[str] | None = None,
) -> list[DrainJob]:
    """The moves to start now: up to ``concurrency`` in flight, all at once past the deadline.

    A job that declares no checkpoints would restart from step 0: it waits for the deadline.
    ``room``: the jobs placement found room for elsewhere (:func:`placeable`); before the deadline
    the others stay and keep running (giving their run up would only queue them, their GPUs lost
    and nowhere to go): :func:`waiting_for_capacity`. None: every job may move."""
    movable = [
        j
        for j in ordered
        if past_deadline or (j.checkpoint_every_steps > 0 and (room is None or j.job_id in room))
    ]
    if past_deadline:
        return movable
    return movable[: max(concurrency - in_flight, 0)]


@dataclass(frozen=True, slots=True)
class Pick:
    """What a drain pass does next: start ``move``, or first ask placement again about ``ask_again``."""

    move: list[DrainJob]
    """Moves to start now; each job's room elsewhere was found on the current snapshot."""
    ask_again: list[DrainJob]
    """Jobs that would move now on a verdict from an earlier pass: ask placement's what-if again
    about them and pick again (nothing moves until then)."""


def pick_moves(
    cluster: str,
    candidates: Iterable[DrainJob],
    verdicts: Mapping[str, MigrationVerdict],
    *,
    fresh: Collection[str],
    in_flight: int,
    concurrency: int,
    past_deadline: bool,
) -> Pick:
    """The moves a drain pass of ``cluster`` starts: largest benefit first (:func:`order_moves`), up
    to the concurrency (:func:`next_moves`), each only on room that exists now.

    ``fresh``: the jobs whose verdict placement answered in this pass (its current snapshot,
    reservations included). A verdict from an earlier pass may be stale: its room may have been
    taken by other work while the job waited for a slot, and a move on it would give the run up
    and leave the job queued without GPUs. So when any job that would move now has a stale
    verdict, nothing moves yet: :attr:`Pick.ask_again` names them, the caller asks again and picks
    again. A job whose room is gone then waits for capacity (:func:`waiting_for_capacity`) and the
    next in rank takes its turn. Past the deadline every job moves, room or not."""
    ordered = order_moves(candidates, verdicts)
    chosen = next_moves(
        ordered,
        in_flight=in_flight,
        concurrency=concurrency,
        past_deadline=past_deadline,
        room=placeable(cluster, verdicts),
    )
    stale = [] if past_deadline else [j for j in chosen if j.job_id not in fresh]
    return Pick(move=[], ask_again=stale) if stale else Pick(move=chosen, ask_again=[])


def needs(job: DrainJob) -> str:
    """What a job needs elsewhere, in words: ``4 x T4`` (``4 x any GPU`` when it accepts any); a
    pipeline's GPUs as its stages hold them (it said ``1 x any GPU`` of a pipeline on 12 GPUs)."""
    models = "/".join(job.gpu_models)
    if job.pipeline:
        return f"{job.gpus} GPUs in all for its pipeline's stages ({models or 'any GPU model'})"
    return f"{job.gpus} x {models or 'any GPU'}"


def waiting_for_capacity(
    cluster: str,
    jobs: Iterable[DrainJob],
    room: Collection[str],
    gpus_by_cluster: Mapping[str, Mapping[str, int]],
    closed: Collection[str],
    *,
    regions: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Job id -> why it stays on ``cluster`` for now: no placement on another open cluster has
    room for it (it is not in ``room``), with what it needs and how many such GPUs the other open
    clusters its affinity allows have in all (taken now: it moves as soon as some are free, or at
    the deadline)."""
    out: dict[str, str] = {}
    for job in jobs:
        if job.job_id in room:
            continue
        where = open_gpus(job, cluster, gpus_by_cluster, closed, regions)
        total = sum(where.values())
        held = ", ".join(f"{c} {n}" for c, n in where.items()) or "none"
        if total == 0:
            # A forced drain's job no other open cluster can ever hold: room cannot appear.
            out[job.job_id] = (
                f"stays: needs {needs(job)}, and no other open cluster it may use has any; it keeps"
                " running here until the drain's deadline, if it has one (then it is stopped and"
                " queued), an undrain, or until such a cluster opens"
            )
            continue
        out[job.job_id] = (
            f"waits for capacity: needs {needs(job)} on another open cluster it may use; no placement"
            f" has room for it now ({total} such GPU(s) on those clusters in all: {held}); it keeps"
            " running here and is asked about again until room appears"
            + (
                ""
                if job.checkpoint_every_steps > 0
                else " (and declares no checkpoints: it moves at the deadline)"
            )
        )
    return out


def next_move_id(job_id: str, attempt: int, earlier: Mapping[str, str]) -> str | None:
    """The migration id of a new move of ``job_id``'s run ``attempt``, or None when none may be
    planned. ``earlier``: that run's recorded migrations, id -> state.

    None while one of them is not ``failed`` (a move planned or started: a second would double
    it; completed: the run moved already). Otherwise ``job:attempt`` when it is free, else the
    first of ``job:attempt:2``, ``job:attempt:3``, … not taken: a function of the records only,
    so two passes that read the same records name the same move, and the store keeps one.
    """
    if any(state != "failed" for state in earlier.values()):
        return None
    base = f"{job_id}:{attempt}"
    if base not in earlier:
        return base
    n = 2
    while f"{base}:{n}" in earlier:
        n += 1
    return f"{base}:{n}"


@dataclass(frozen=True, slots=True)
class ShardReply:
    """One leading placement instance's answer to the drains notice, after it reloaded them."""

    shard: str
    """The instance's own shard."""
    holder: str
    """The instance (its lease holder id)."""
    territories: Mapping[str, int]
    """Each territory it holds (its own shard's, and any it took over) -> its fence token."""

    @classmethod
    def parse(cls, answer: Mapping[str, Any]) -> ShardReply | None:
        """A reply from its JSON, or None for one that names no territory (an older placement
        answers ``{"ok": true, "drained": [...]}`` only: it counts for nothing here)."""
        territories = answer.get("territories")
        if not answer.get("ok") or not isinstance(territories, Mapping) or not territories:
            return None
        try:
            held = {str(t): int(token) for t, token in territories.items()}
        except (TypeError, ValueError):
            return None
        return cls(shard=str(answer.get("shard", "")), holder=str(answer.get("holder", "")), territories=held)


@dataclass(frozen=True, slots=True)
class ShardConfirmation:
    """Which placement shards confirmed a change of the drained clusters (the drain's answer)."""

    confirmed: tuple[str, ...] = ()
    """Territories whose current leader reloaded the drained clusters and said so."""
    unconfirmed: tuple[str, ...] = ()
    """Territories with a live leader that did not answer (in time): it may still place on a
    cluster just drained (or keep one just undrained closed) until it reloads (a reminder comes
    every few seconds)."""
    leaderless: tuple[str, ...] = ()
    """Territories with no live leader now: whoever leads one next loads the drains from the store
    when it starts, so none needs to confirm."""
    by: Mapping[str, str] = field(default_factory=dict)
    """Confirmed territory -> the instance that confirmed it (``holder`` of ``shard``)."""
    known: bool = True
    """False when the live leaders could not be read (store or bus error): nothing is complete."""

    @property
    def complete(self) -> bool:
        """Every live leader confirmed, and there was at least one (with none, placement is down:
        it loads the drains when it starts, but nobody has confirmed anything)."""
        return self.known and not self.unconfirmed and bool(self.confirmed)

    def to_json(self) -> dict[str, Any]:
        """The ``shards`` part of a drain's (or undrain's) answer."""
        return {
            "confirmed": list(self.confirmed),
            "unconfirmed": list(self.unconfirmed),
            "leaderless": list(self.leaderless),
            "by": dict(self.by),
            "known": self.known,
        }


def shard_confirmation(
    live: Mapping[str, int] | None, leaderless: Collection[str], replies: Iterable[ShardReply]
) -> ShardConfirmation:
    """Which territories' leaders confirmed, from the replies gathered so far.

    ``live``: territory -> the newest fence token claimed for it, for every territory whose lease
    was held when the drain was committed and asked about (None: unknown). ``leaderless``: the
    territories known (a fence was ever claimed) whose lease nobody held then. A territory counts
    as confirmed by a reply that holds it with a token at least that fence's: an older token is a
    deposed leader that has not noticed yet, whose answer says nothing of the one that places now.
    A reply for a territory not in ``live`` (a leader that took it after the read, so it loaded the
    drains after the change) confirms it too."""
    best: dict[str, tuple[int, str]] = {}
    for reply in replies:
        who = f"{reply.holder} ({reply.shard})" if reply.holder else reply.shard
        for territory, token in reply.territories.items():
            if territory not in best or token > best[territory][0]:
                best[territory] = (token, who)
    wanted = dict(live or {})
    confirmed = {t for t, (token, _) in best.items() if token >= wanted.get(t, 0)}
    return ShardConfirmation(
        confirmed=tuple(sorted(confirmed)),
        unconfirmed=tuple(sorted(set(wanted) - confirmed)),
        leaderless=tuple(sorted(set(leaderless) - confirmed - set(wanted))),
        by={t: best[t][1] for t in sorted(confirmed)},
        known=live is not None,
    )

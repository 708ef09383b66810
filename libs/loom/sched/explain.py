"""Decision records in plain words: "why here, and why not there".

:func:`render` turns a :class:`~loom.sched.framework.DecisionRecord` into lines a person reads:
where the job went and which plugins carried it, then for every other candidate the plugins on
which it lost the most (score difference times weight), then every cluster ruled out and why.
"""

from loom.sched.framework import CandidateRecord, DecisionRecord

PLUGIN_WORDS = {
    "scu_fit": "compute (SCU for the task type)",
    "joint": "joint compute + network score",
    "jct": "predicted completion time",
    "data_locality": "data locality",
    "affinity": "affinity",
    "water_level": "load balance",
    "cost_energy": "cost and energy",
    "trust": "trust in the cluster's claimed compute",
    "pool_fit": "keeping large pools whole",
    "free_fit": "packing (fullest of the fastest pools)",
    "hole_fit": "keeping the holes larger jobs need",
    "node_fit": "filling nodes already in use",
}


def _words(plugin: str) -> str:
    return PLUGIN_WORDS.get(plugin, plugin)


def _gaps(
    winner: CandidateRecord, other: CandidateRecord, weights: dict[str, float]
) -> list[tuple[float, str]]:
    """(weighted score the other loses, plugin) for each plugin, biggest loss first."""
    gaps = [
        (weights.get(p, 1.0) * (winner.scores.get(p, 0.0) - other.scores.get(p, 0.0)), p)
        for p in winner.scores
    ]
    return sorted(gaps, reverse=True)


def render(record: DecisionRecord, *, limit: int = 10) -> list[str]:
    """The record as sentences, most important first; at most ``limit`` candidates and pruned clusters."""
    lines: list[str] = []
    if record.outcome != "placed":
        verb = "was rejected" if record.outcome == "rejected" else "is waiting"
        lines.append(f"Job {record.job_id} {verb}: {_headline(record)}.")
    ranked = sorted(record.candidates, key=lambda c: (-c.total, c.cluster, c.gpu_model))
    winner: CandidateRecord | None = None
    if record.outcome == "placed" and record.chosen:
        winner = next((c for c in ranked if c.cluster == record.chosen[0]), None)
        lines += _why_here(record, winner)
    for note in record.notes:
        lines.append(f"Note: {note}.")
    if record.victims:
        # Stopped by priority preemption, or moved by rare_room: the notes above say which.
        lines.append(f"Stopped to make room: {', '.join(record.victims)}.")
        for cluster in record.chosen:
            if cluster in record.pruned:
                # Said as "Why not <it>: ruled out" under "placed on <it>" before: the pruning from
                # before the preemption made room there.
                lines.append(
                    f"{cluster} had no room at first ({record.pruned[cluster]}); stopping them made it."
                )
    lines += _why_not_there(record, ranked, winner or (ranked[0] if ranked else None), limit)
    lines += _ruled_out(record, limit)
    return lines


def _headline(record: DecisionRecord) -> str:
    """The record's reason without the per-cluster reasons it may end with: those are said once,
    cluster by cluster, below it."""
    reason = record.reason
    for cluster in sorted(record.pruned):
        cut = reason.find(f" ({cluster}: ")
        if cut > 0 and reason.endswith(")"):
            return reason[:cut]
    return reason


def _why_here(record: DecisionRecord, winner: CandidateRecord | None) -> list[str]:
    """Where a placed job went, and the plugins that carried the chosen candidate."""
    lines = [f"Job {record.job_id}: {record.reason}."]
    if winner is not None:
        # The plugins that set it apart: one that scored every candidate alike (100 each) decided
        # nothing, though it was cited as a reason.
        telling = {
            p: s
            for p, s in winner.scores.items()
            if len({round(c.scores.get(p, 0.0), 6) for c in record.candidates}) > 1
        } or dict(winner.scores)
        best = sorted(telling.items(), key=lambda kv: -record.weights.get(kv[0], 1.0) * kv[1])[:3]
        carried = ", ".join(
            f"{_words(p)} {s:.0f}/100 (weight {record.weights.get(p, 1.0):g})" for p, s in best
        )
        if len(record.chosen) > 1:
            # A spread's own score is the one in its reason; this is its lead cluster's alone.
            lines.append(
                f"Its lead part, {winner.cluster} ({winner.gpu_model}), scored total {winner.total:.1f} as a"
                f" cluster of its own, the best of {len(record.candidates)} candidate(s);"
                f" it scored {carried}."
            )
        else:
            lines.append(
                f"Why {winner.cluster} ({winner.gpu_model}): total {winner.total:.1f}, the best of"
                f" {len(record.candidates)} candidate(s); it scored {carried}."
            )
    if len(record.chosen) > 1:
        lines.append(f"The job spans {len(record.chosen)} clusters: {', '.join(record.chosen)}.")
    return lines


def _why_not_there(
    record: DecisionRecord, ranked: list[CandidateRecord], reference: CandidateRecord | None, limit: int
) -> list[str]:
    """For each other candidate (at most ``limit``), the plugins it lost most on against ``reference``."""
    lines: list[str] = []
    shown = 0
    for cand in ranked:
        if reference is not None and cand is reference:
            continue
        if cand.cluster in record.chosen:
            continue
        if shown >= limit:
            lines.append(f"... and {len(ranked) - shown - 1} more candidate(s).")
            break
        shown += 1
        if reference is None:
            continue
        losses = [(g, p) for g, p in _gaps(reference, cand, record.weights) if g > 0.05][:2]
        if losses:
            why = "; ".join(
                f"{_words(p)} {cand.scores.get(p, 0.0):.0f} vs {reference.scores.get(p, 0.0):.0f}"
                for _, p in losses
            )
            lines.append(
                f"Why not {cand.cluster} ({cand.gpu_model}): total {cand.total:.1f} vs {reference.total:.1f};"
                f" it lost on {why}."
            )
        else:
            lines.append(
                f"Why not {cand.cluster} ({cand.gpu_model}): total {cand.total:.1f}, tied or behind only by"
                " the deterministic tie-break (cluster id)."
            )
    return lines


def _ruled_out(record: DecisionRecord, limit: int) -> list[str]:
    """Clusters pruned before scoring (at most ``limit``) that are not also candidates, and why."""
    candidates = {c.cluster for c in record.candidates}
    pruned = sorted((c, r) for c, r in record.pruned.items() if c not in record.chosen)
    lines = [
        f"Why not {cluster}: ruled out; {reason}."
        for cluster, reason in pruned[:limit]
        if cluster not in candidates
    ]
    if len(pruned) > limit:
        lines.append(f"... and {len(pruned) - limit} more cluster(s) ruled out.")
    return lines

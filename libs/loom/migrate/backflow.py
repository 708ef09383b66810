"""A cluster joins, returns or grows: which running jobs to look at, and toward where (pure).

The migration service watches the capacity book (schedulable GPUs per cluster). A cluster that
appears, or comes back from none (a failed cluster whose heartbeats resumed, a node pool
restored), is ``cluster_joined``; one whose schedulable GPUs grew by at least a share is
``cluster_improved``; a drain that ends (``loom undrain``) is ``cluster_joined`` too. Each such
change is a review: every running job without a part there is decided by
:func:`loom.migrate.benefit.decide` against the placement the scheduling framework would choose
now, and a move counts only when it goes *to* that cluster (:func:`toward`): a better place
elsewhere is not what the change offered, and is left to its own trigger. Work then flows back
gradually — the budget, the cool-down and the hysteresis apply as for link moves — and only where
the benefit rule says so. A job held back only by its cool-down (it just failed over or drained
off: the move would pay) is looked at again when the cool-down ends (:func:`held_until`): a
review is done again while moves are deferred by the budget or held by a cool-down.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

from loom.migrate.benefit import MigrationVerdict, Trigger

__all__ = ["DEFAULT_IMPROVE_SHARE", "cluster_triggers", "held_until", "not_on", "toward"]

DEFAULT_IMPROVE_SHARE = 0.25
"""A cluster whose schedulable GPUs grew by this share (and at least one GPU) improved."""


def cluster_triggers(
    before: Mapping[str, int], after: Mapping[str, int], *, improve_share: float = DEFAULT_IMPROVE_SHARE
) -> dict[str, Trigger]:
    """What changed between two readings of cluster -> schedulable GPUs: ``cluster_joined`` for a
    cluster new to the reading or back from none, ``cluster_improved`` for one that grew by at
    least ``improve_share`` of what it had. Shrinking is no trigger (failures have their own)."""
    if improve_share < 0:
        raise ValueError(f"improve_share must be >= 0, got {improve_share}")
    out: dict[str, Trigger] = {}
    for cluster, gpus in sorted(after.items()):
        had = before.get(cluster, 0)
        if gpus <= 0:
            continue
        if had <= 0:
            out[cluster] = "cluster_joined"
        elif gpus - had >= max(improve_share * had, 1.0):
            out[cluster] = "cluster_improved"
    return out


def not_on(clusters_of: Mapping[str, Collection[str]], cluster: str) -> list[str]:
    """The jobs a change at ``cluster`` concerns: those with no part there (sorted)."""
    return sorted(job for job, held in clusters_of.items() if cluster not in held)


ELSEWHERE = "stays: the framework's choice now is "


def placed_elsewhere(verdict: MigrationVerdict, cluster: str) -> bool:
    """Whether a review about ``cluster`` kept the job because the framework would place it on
    another cluster (where it runs now, or a third one: :func:`toward`'s stays), not for its
    numbers there."""
    return not verdict.move and (verdict.target != cluster or verdict.reason.startswith(ELSEWHERE))


def settling_recheck(
    stays: Iterable[MigrationVerdict],
    cluster: str,
    *,
    joined_at: float | None,
    now: float,
    settle_s: float,
    recheck_s: float,
) -> float | None:
    """When to review a cluster that joined (or returned) at ``joined_at`` again: ``recheck_s``
    from ``now`` while it settles (``settle_s``), if the framework placed some job elsewhere
    (:func:`placed_elsewhere`): its GPUs show in the view from its first heartbeat, but placement
    may still hold it closed for a moment, and a review then finds nothing moving there. None
    otherwise (a joined cluster's review is then done)."""
    if joined_at is None or now - joined_at >= settle_s:
        return None
    if not any(placed_elsewhere(v, cluster) for v in stays):
        return None
    return now + recheck_s


def toward(verdict: MigrationVerdict, cluster: str) -> MigrationVerdict:
    """A verdict of a review about ``cluster``: a move elsewhere becomes a stay, saying so (the
    numbers are kept). A stay, or a move there, is returned as it is."""
    if not verdict.move or verdict.target == cluster:
        return verdict
    return replace(
        verdict,
        decision="stay",
        reason=f"{ELSEWHERE}{verdict.target}, not {cluster}; " + verdict.reason.removeprefix("moves: "),
    )


def held_until(stays: Iterable[MigrationVerdict], cluster: str) -> float | None:
    """When the review about ``cluster`` should be done again for the jobs its cool-downs held
    back: the earliest end of a cool-down that kept a job from a move there that would pay
    (:attr:`MigrationVerdict.held_until_s`); None when no stay was only the cool-down's."""
    ends = [v.held_until_s for v in stays if v.held_until_s is not None and v.target == cluster]
    return min(ends) if ends else None

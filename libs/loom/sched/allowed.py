"""A job's hard placement rules, one cluster at a time (pure).

``affinity.clusters`` / ``affinity.regions`` (only these) and ``avoid_clusters`` /
``avoid_regions`` (never these), as the affinity plugin applies them over a snapshot
(:mod:`loom.sched.plugins.affinity`), for callers that look at clusters one by one: the staging
planner and the migration service's drains.
"""

from loom_proto.jobs import Affinity

__all__ = ["cluster_allowed"]


def cluster_allowed(affinity: Affinity, cluster: str, region: str | None) -> bool:
    """Whether ``affinity`` lets a job run on ``cluster`` in ``region`` (None: not known, which no
    region list holds and none avoids)."""
    if (affinity.clusters and cluster not in affinity.clusters) or cluster in affinity.avoid_clusters:
        return False
    if affinity.regions and region not in affinity.regions:
        return False
    return region is None or region not in affinity.avoid_regions

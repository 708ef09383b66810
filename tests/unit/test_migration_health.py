"""The migration service hears placement's cluster health: a cluster failed and healthy again is
reviewed as a returning one, even when no reading of its GPUs saw the failure (it lasted under a
reading's period: the jobs it moved never flowed back; a CI run)."""

import time
from types import SimpleNamespace

import msgspec

from loom_proto.clusters import ClusterHealthChanged
from loom_services.migration.service import MigrationService


def _msg(cluster: str, state: str) -> SimpleNamespace:
    change = ClusterHealthChanged(cluster=cluster, state=state, at=time.time())  # type: ignore[arg-type]
    return SimpleNamespace(data=msgspec.json.encode(change))


async def test_a_cluster_back_from_a_failure_is_reviewed_as_returning_and_one_only_suspect_is_not() -> None:
    ctx = SimpleNamespace(db=None, publisher=None, stats={}, nc=None)
    service = MigrationService(ctx)  # type: ignore[arg-type]
    await service.on_cluster_health(_msg("c-a", "suspect"))
    await service.on_cluster_health(_msg("c-a", "healthy"))
    assert service._cluster_reviews == {}  # only suspect: nothing moved off it
    await service.on_cluster_health(_msg("c-a", "failed"))
    await service.on_cluster_health(_msg("c-a", "healthy"))
    assert service._cluster_reviews == {"c-a": ("cluster_joined", "cluster c-a returned from a failure")}
    assert "c-a" in service._joined_at
    await service.on_cluster_health(SimpleNamespace(data=b"not json"))  # ignored, nothing raised

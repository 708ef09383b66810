"""Two real local Slurm clusters for the session, standing in for two of the "small" topology's
clusters (:mod:`loom.runtime.slurmlocal`), and slurm backends aimed at them.

The clusters start once per session, on the first test that asks (about 2 s), and stop at its
end, every slurmd before its slurmctld. When Slurm is not installed the fixture installs it with
apt (as ``make test`` does); when that fails the tests *fail*: they never skip.
"""

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loom.model.topology import Cluster, load_topology
from loom.runtime.slurmlocal import LocalSlurmCluster, LocalSlurms, slurm_nodes
from loom_services.cluster_agent.backend import ClusterBackend
from loom_services.cluster_agent.main import model_speed
from loom_services.cluster_agent.slurm import SlurmBackend

SLURM_CLUSTERS = ("c-weu-a", "c-sea1-a")
"""The small topology's clusters that run on Slurm in the tests."""


@pytest.fixture(scope="session")
def slurm_clusters() -> Iterator[dict[str, LocalSlurmCluster]]:
    """Two independent Slurm clusters (own slurm.conf, ports, state; mknod GPUs), by Loom cluster id."""
    topology = load_topology("small")
    # Under the system temp dir: slurmd and munged must traverse every parent directory.
    root = Path(tempfile.mkdtemp(prefix="loom-slurm-"))
    slurms = LocalSlurms(root, {c: slurm_nodes(topology.cluster(c)) for c in SLURM_CLUSTERS})
    try:
        with slurms:
            yield slurms.clusters
    finally:
        shutil.rmtree(root, ignore_errors=True)


def slurm_backend_factory(
    slurm: LocalSlurmCluster, work_dir: Path, **options: float
) -> Callable[[Cluster], ClusterBackend]:
    """Makes the slurm backend of a Loom cluster on a local Slurm cluster (for Platform.backends)."""

    def make(cluster: Cluster) -> ClusterBackend:
        return SlurmBackend(
            cluster=cluster.id,
            zone=cluster.zone,
            work_dir=work_dir / cluster.id,
            slurm_conf=slurm.conf,
            speed=model_speed,
            poll_s=0.1,
            **options,  # type: ignore[arg-type]
        )

    return make


def slurm(cluster: LocalSlurmCluster, *argv: str) -> str:
    """Run a Slurm command against a local cluster; its stdout."""
    out = subprocess.run(list(argv), env=cluster.env, capture_output=True, text=True, check=True, timeout=15)
    return out.stdout


def slurm_job(cluster: LocalSlurmCluster, name: str) -> dict[str, str] | None:
    """The (only) Slurm job of that name, as ``scontrol show job`` fields; None when there is none."""
    from loom_services.cluster_agent.slurm import parse_record

    ids = slurm(cluster, "squeue", "-h", "-t", "all", "-n", name, "-o", "%i").split()
    if not ids:
        return None
    assert len(ids) == 1, f"{len(ids)} Slurm jobs named {name}"
    return parse_record(slurm(cluster, "scontrol", "-o", "show", "job", ids[0]).splitlines()[0])

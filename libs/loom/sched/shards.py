"""Placement shards by region group: which shard decides a job, and which shard owns a region.

Placement scales out by running one leader per *shard*. A shard is either a **regional shard**,
named after a group of regions in the configuration, or the **global shard** (``global``), which
always exists. The configuration is a small map (a JSON/YAML file or ``--region-group``
options, see :func:`parse_group` and :func:`load_config`)::

    groups:
      americas: [aws-us-east-2, gcp-southamerica-east1]
      europe: [aws-eu-central-1, azure-westeurope]

Design decisions:

* **Territories.** A region belongs to at most one group. The regions of group ``g`` are shard
  ``g``'s territory; every other region (including one nobody configured, or a cluster in a new
  region) is the global shard's. A cluster belongs to the territory of its region. Ownership of a
  territory is not decided here: the service hands a regional territory to the global shard while
  the regional shard has no leader (see ``PlacementService``); this module only says whose it is
  *by default* (:meth:`ShardMap.shard_of_region`).
* **Routing** (:func:`route`) depends on the job and the static configuration only (the groups and
  the topology's cluster -> region map), never on what an instance happens to have seen, so every
  shard computes the same answer for every job and each submission is handled by exactly one.
  A job whose allowed regions all fall in one group goes to that group's shard; anything else
  (allowed everywhere, allowed in several groups, naming a cluster the topology does not know, or
  allowed nowhere) goes to ``global``. The allowed regions are read as the affinity plugin reads
  them (:mod:`loom.sched.plugins.affinity`): ``clusters`` and ``regions`` must both hold when both
  are given, ``avoid_regions`` removes regions; ``prefer_regions`` and the job-to-job rules do not
  restrict, and ``avoid_clusters`` is ignored (a region stays allowed while any of its clusters is).
  A DAG goes where all its stages go, or to ``global`` when they disagree.
* The global shard places what it gets on the territories it owns only: a job allowed in two
  regional groups (and nowhere else) is judged against the global shard's clusters, as if the
  regional clusters did not exist. Choose groups that jobs do not straddle.

The default stack has no groups: one ``global`` shard owns everything, as before sharding.
"""

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loom.errors import InvalidInputError
from loom.model.topology import Topology
from loom_proto.ids import InvalidIdError, validate_id
from loom_proto.jobs import Affinity, JobSubmitted

__all__ = [
    "GLOBAL",
    "ShardMap",
    "allowed_regions",
    "group_options",
    "load_config",
    "parse_group",
    "route",
    "split_regions",
]

GLOBAL = "global"
"""The shard that always exists: it takes every job no regional shard takes and owns every region
no group names."""


@dataclass(frozen=True)
class ShardMap:
    """Region groups (regional shard -> its regions) and what routing needs to read affinities."""

    groups: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Regional shard -> the regions of its territory (disjoint)."""
    cluster_regions: Mapping[str, str] = field(default_factory=dict)
    """Cluster -> region, from the topology: how ``affinity.clusters`` is read."""
    regions: frozenset[str] = frozenset()
    """Every region known (the topology's and the groups'): how ``avoid_regions`` alone is read."""
    _owner: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        owner: dict[str, str] = {}
        for shard, regions in self.groups.items():
            try:
                validate_id(shard, "shard")
            except InvalidIdError as exc:
                raise InvalidInputError(str(exc)) from exc
            if shard == GLOBAL:
                raise InvalidInputError(
                    f"{GLOBAL!r} is the shard of every ungrouped region; it takes no group"
                )
            if not regions:
                raise InvalidInputError(f"region group {shard!r} has no region")
            for region in regions:
                if region in owner:
                    raise InvalidInputError(
                        f"region {region!r} is in two groups ({owner[region]!r} and {shard!r})"
                    )
                owner[region] = shard
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "regions", frozenset(self.regions) | frozenset(owner))

    @classmethod
    def build(
        cls, groups: Mapping[str, Iterable[str]] | None = None, topology: Topology | None = None
    ) -> "ShardMap":
        """A map from groups and (for cluster and avoid affinities) the topology."""
        return cls(
            groups={name: frozenset(regions) for name, regions in (groups or {}).items()},
            cluster_regions={c.id: c.region for c in topology.clusters} if topology is not None else {},
            regions=frozenset(r.id for r in topology.regions) if topology is not None else frozenset(),
        )

    @property
    def shards(self) -> list[str]:
        """Every shard: ``global`` first, then the regional ones in name order."""
        return [GLOBAL, *sorted(self.groups)]

    @property
    def regional(self) -> list[str]:
        """The regional shards, in name order."""
        return sorted(self.groups)

    def shard_of_region(self, region: str | None) -> str:
        """The shard whose territory ``region`` is by default (``global`` for an ungrouped one)."""
        return self._owner.get(region, GLOBAL) if region is not None else GLOBAL

    def to_config(self) -> dict[str, Any]:
        """The configuration this map was made from (groups only), for :func:`load_config`."""
        return {"groups": {name: sorted(regions) for name, regions in sorted(self.groups.items())}}


def allowed_regions(affinity: Affinity, shard_map: ShardMap) -> frozenset[str] | None:
    """The regions a job's hard affinity allows; None when it does not restrict them (or names a
    cluster whose region the map does not know, so that nothing can be concluded)."""
    allowed: set[str] | None = None
    if affinity.clusters:
        regions = [shard_map.cluster_regions.get(c) for c in affinity.clusters]
        if any(r is None for r in regions):
            return None
        allowed = {r for r in regions if r is not None}
    if affinity.regions:
        allowed = set(affinity.regions) if allowed is None else allowed & set(affinity.regions)
    if allowed is None:
        if not affinity.avoid_regions or not shard_map.regions:
            return None
        allowed = set(shard_map.regions)
    return frozenset(allowed - set(affinity.avoid_regions))


def _route_affinity(affinity: Affinity, shard_map: ShardMap) -> str:
    allowed = allowed_regions(affinity, shard_map)
    if not allowed:  # everywhere, or nowhere (the global shard explains why it cannot run)
        return GLOBAL
    shards = {shard_map.shard_of_region(r) for r in allowed}
    return shards.pop() if len(shards) == 1 else GLOBAL


def route(job: JobSubmitted, shard_map: ShardMap) -> str:
    """The shard that admits and places ``job`` (see the module docstring)."""
    return route_of(job.affinity, [stage.affinity for stage in job.stages], shard_map)


def route_of(affinity: Affinity, stage_affinities: Sequence[Affinity], shard_map: ShardMap) -> str:
    """:func:`route` from the only fields it reads: the job's affinity and, for a DAG, each of
    its stages' (a placement shard routes a submission before decoding all of it)."""
    if not shard_map.groups:
        return GLOBAL
    if stage_affinities:
        shards = {_route_affinity(a, shard_map) for a in stage_affinities}
        return shards.pop() if len(shards) == 1 else GLOBAL
    return _route_affinity(affinity, shard_map)


def parse_group(text: str) -> tuple[str, list[str]]:
    """``NAME=r1,r2`` (a ``--region-group`` option) -> (NAME, [r1, r2])."""
    name, sep, regions = text.partition("=")
    listed = [r.strip() for r in regions.split(",") if r.strip()]
    if not sep or not name.strip() or not listed:
        raise InvalidInputError(f"a region group is NAME=region,region,...; got {text!r}")
    return name.strip(), listed


def load_config(path: str | Path) -> dict[str, list[str]]:
    """Region groups from a JSON or YAML file: ``{groups: {NAME: [region, ...]}}`` (or the bare
    mapping)."""
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    data = data or {}
    groups = data.get("groups", data) if isinstance(data, dict) else None
    if not isinstance(groups, dict) or not all(
        isinstance(v, list) and all(isinstance(r, str) for r in v) for v in groups.values()
    ):
        raise InvalidInputError(f"{path}: expected {{groups: {{NAME: [region, ...]}}}}")
    return {str(k): list(v) for k, v in groups.items()}


def split_regions(weights: Mapping[str, float], shards: int) -> tuple[list[str], dict[str, list[str]]]:
    """Split regions into ``shards`` territories of about equal weight (e.g. GPUs): the global
    shard's regions and ``shards - 1`` region groups named ``g1``, ``g2``, ... (heaviest region
    first, each into the lightest territory so far; ties by name, so the split is reproducible)."""
    if shards < 1:
        raise InvalidInputError(f"at least one shard is needed, got {shards}")
    if shards > max(len(weights), 1):
        raise InvalidInputError(f"{shards} shards need at least {shards} regions, got {len(weights)}")
    bins: list[list[str]] = [[] for _ in range(shards)]
    load = [0.0] * shards
    for region in sorted(weights, key=lambda r: (-weights[r], r)):
        i = min(range(shards), key=lambda k: (load[k], k))
        bins[i].append(region)
        load[i] += weights[region]
    return sorted(bins[0]), {f"g{i}": sorted(b) for i, b in enumerate(bins[1:], start=1)}


def group_options(groups: Mapping[str, Sequence[str]]) -> list[str]:
    """``--region-group NAME=r1,r2`` options for a placement process, one per group."""
    argv: list[str] = []
    for name, regions in sorted(groups.items()):
        argv += ["--region-group", f"{name}={','.join(regions)}"]
    return argv

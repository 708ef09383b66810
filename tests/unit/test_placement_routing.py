"""A regional placement shard routes a submission from its affinities alone (``_RouteFields``,
``route_of``) before the strict decode: the same shard as :func:`loom.sched.shards.route` of the
fully decoded job, for every kind of affinity and for DAGs."""

import itertools

import msgspec

from loom.model.topology import load_topology
from loom.sched.shards import GLOBAL, ShardMap, route, route_of
from loom_proto.codec import encode
from loom_proto.jobs import Affinity, JobSubmitted, Resources, Stage, Work
from loom_services.placement.service import _ROUTE_FIELDS

TOPOLOGY = load_topology("default")
EU = ["aws-eu-central-1", "azure-westeurope"]
AMERICAS = ["aws-us-east-2", "gcp-southamerica-east1"]
MAP = ShardMap.build({"eu": EU, "americas": AMERICAS}, TOPOLOGY)
CLUSTERS = [c.id for c in TOPOLOGY.clusters]


def _affinities() -> list[Affinity]:
    regions = [[], ["aws-eu-central-1"], EU, AMERICAS, [EU[0], AMERICAS[0]], ["gcp-asia-southeast1"]]
    out = [Affinity(regions=r) for r in regions]
    out += [Affinity(clusters=[c]) for c in CLUSTERS[:4]]
    out += [Affinity(avoid_regions=[r for r in MAP.regions if r not in EU])]
    out += [Affinity(regions=EU, avoid_regions=[EU[0]]), Affinity(prefer_regions=EU)]
    return out


def _job(affinity: Affinity, stages: list[Stage] | None = None) -> JobSubmitted:
    return JobSubmitted(
        job_id="j",
        tenant="t",
        resources=Resources(gpus=1),
        work=Work(steps=1, step_time_s=1.0),
        affinity=affinity,
        stages=stages or [],
        labels={"family": "x"},
    )


def _stage(name: str, affinity: Affinity) -> Stage:
    return Stage(
        name=name, resources=Resources(gpus=1), work=Work(steps=1, step_time_s=1.0), affinity=affinity
    )


def _routed(payload: bytes) -> str:
    fields = _ROUTE_FIELDS.decode(payload)
    return route_of(fields.affinity, [s.affinity for s in fields.stages], MAP)


def test_the_routing_fields_route_every_job_as_the_full_decode_does() -> None:
    seen = set()
    for affinity in _affinities():
        job = _job(affinity)
        assert _routed(encode(job)) == route(job, MAP)
        seen.add(route(job, MAP))
    for a, b in itertools.product(_affinities()[:6], repeat=2):
        dag = _job(Affinity(), [_stage("a", a), _stage("b", b)])
        assert _routed(encode(dag)) == route(dag, MAP)
        seen.add(route(dag, MAP))
    assert seen == {GLOBAL, "eu", "americas"}  # every shard reached


def test_a_payload_the_routing_fields_cannot_read_is_left_to_the_strict_decode() -> None:
    # Not an object, or an affinity with a field no Affinity has: the regional shard does not
    # skip it on the routing fields; the strict decode refuses it as before.
    for payload in (b"[1, 2]", b'{"affinity": {"regions": ["eu"], "bogus": 1}}', b"{"):
        try:
            _ROUTE_FIELDS.decode(payload)
        except msgspec.DecodeError:
            continue
        raise AssertionError(f"{payload!r} decoded")

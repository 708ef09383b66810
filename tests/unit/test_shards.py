"""The shard map: region groups, routing a job to its shard, splitting regions for the stack."""

import json
from pathlib import Path

import pytest

from loom.errors import InvalidInputError
from loom.model.topology import load_topology
from loom.sched.shards import (
    GLOBAL,
    ShardMap,
    allowed_regions,
    group_options,
    load_config,
    parse_group,
    route,
    split_regions,
)
from loom_proto.jobs import Affinity, JobSubmitted, Resources, Stage, Work

TOPOLOGY = load_topology("default")
EU = ["aws-eu-central-1", "azure-westeurope"]
AMERICAS = ["aws-us-east-2", "gcp-southamerica-east1"]
MAP = ShardMap.build({"eu": EU, "americas": AMERICAS}, TOPOLOGY)


def job(**affinity: list[str]) -> JobSubmitted:
    return JobSubmitted(
        job_id="j",
        tenant="t",
        resources=Resources(gpus=1),
        work=Work(steps=1, step_time_s=1.0),
        affinity=Affinity(**affinity),
    )


def test_a_job_allowed_everywhere_goes_to_the_global_shard() -> None:
    assert route(job(), MAP) == GLOBAL
    assert route(job(prefer_regions=["azure-westeurope"]), MAP) == GLOBAL, "a preference restricts nothing"


def test_a_job_whose_regions_all_fall_in_one_group_goes_to_that_groups_shard() -> None:
    assert route(job(regions=["azure-westeurope"]), MAP) == "eu"
    assert route(job(regions=EU), MAP) == "eu"
    assert route(job(regions=["gcp-southamerica-east1"]), MAP) == "americas"


def test_a_job_straddling_two_groups_or_an_ungrouped_region_goes_to_global() -> None:
    assert route(job(regions=["azure-westeurope", "aws-us-east-2"]), MAP) == GLOBAL
    assert route(job(regions=["azure-westeurope", "gcp-asia-southeast1"]), MAP) == GLOBAL
    assert route(job(regions=["gcp-asia-southeast1"]), MAP) == GLOBAL, "an ungrouped region is global's"


def test_clusters_are_read_through_the_topology_and_must_agree_with_regions() -> None:
    assert route(job(clusters=["c-weu-a", "c-weu-b"]), MAP) == "eu"
    assert route(job(clusters=["c-weu-a", "c-use2-a"]), MAP) == GLOBAL
    # Both given: both must hold, so only azure-westeurope is allowed.
    assert route(job(clusters=["c-weu-a", "c-use2-a"], regions=["azure-westeurope"]), MAP) == "eu"
    # A cluster the topology does not know: nothing can be concluded.
    assert allowed_regions(Affinity(clusters=["c-nowhere"]), MAP) is None
    assert route(job(clusters=["c-nowhere"]), MAP) == GLOBAL


def test_avoided_regions_narrow_what_is_allowed() -> None:
    everything_but_eu = [r.id for r in TOPOLOGY.regions if r.id not in EU]
    assert route(job(avoid_regions=everything_but_eu), MAP) == "eu"
    assert route(job(regions=[*EU, "aws-us-east-2"], avoid_regions=["aws-us-east-2"]), MAP) == "eu"
    assert route(job(avoid_regions=["azure-westeurope"]), MAP) == GLOBAL
    # Allowed nowhere: the global shard explains why it cannot run.
    assert allowed_regions(
        Affinity(regions=["azure-westeurope"], avoid_regions=["azure-westeurope"]), MAP
    ) == (frozenset())
    assert route(job(regions=["azure-westeurope"], avoid_regions=["azure-westeurope"]), MAP) == GLOBAL


def test_a_dag_goes_where_all_its_stages_go() -> None:
    def stage(name: str, regions: list[str]) -> Stage:
        return Stage(
            name=name,
            resources=Resources(gpus=1),
            work=Work(steps=1, step_time_s=1.0),
            affinity=Affinity(regions=regions),
        )

    base = job()
    eu_dag = JobSubmitted(**{**_fields(base), "stages": [stage("a", ["azure-westeurope"]), stage("b", EU)]})
    mixed = JobSubmitted(**{**_fields(base), "stages": [stage("a", EU), stage("b", AMERICAS)]})
    assert route(eu_dag, MAP) == "eu"
    assert route(mixed, MAP) == GLOBAL


def _fields(j: JobSubmitted) -> dict[str, object]:
    return {f: getattr(j, f) for f in JobSubmitted.__struct_fields__}


def test_without_groups_everything_is_global() -> None:
    plain = ShardMap.build({}, TOPOLOGY)
    assert route(job(regions=["azure-westeurope"]), plain) == GLOBAL
    assert plain.shards == [GLOBAL] and plain.regional == []
    assert plain.shard_of_region("azure-westeurope") == GLOBAL


def test_territories_of_regions() -> None:
    assert MAP.shard_of_region("aws-eu-central-1") == "eu"
    assert MAP.shard_of_region("gcp-asia-southeast1") == GLOBAL
    assert MAP.shard_of_region("a-region-nobody-configured") == GLOBAL
    assert MAP.shard_of_region(None) == GLOBAL
    assert MAP.shards == [GLOBAL, "americas", "eu"]


def test_bad_groups_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="two groups"):
        ShardMap.build({"a": ["r1"], "b": ["r1", "r2"]})
    with pytest.raises(InvalidInputError, match="takes no group"):
        ShardMap.build({GLOBAL: ["r1"]})
    with pytest.raises(InvalidInputError, match="no region"):
        ShardMap.build({"a": []})
    with pytest.raises(InvalidInputError, match="shard"):
        ShardMap.build({"a.b": ["r1"]})


def test_group_options_parse_and_print_back() -> None:
    assert parse_group("eu=azure-westeurope, aws-eu-central-1") == (
        "eu",
        ["azure-westeurope", "aws-eu-central-1"],
    )
    for bad in ("eu", "=r1", "eu="):
        with pytest.raises(InvalidInputError):
            parse_group(bad)
    argv = group_options({"eu": EU, "americas": AMERICAS})
    assert argv[0::2] == ["--region-group"] * 2
    assert dict(parse_group(a) for a in argv[1::2]) == {"eu": EU, "americas": AMERICAS}


def test_config_files_in_json_and_yaml(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps(MAP.to_config()))
    (tmp_path / "s.yaml").write_text("eu: [azure-westeurope]\n")
    assert load_config(tmp_path / "s.json") == {"americas": sorted(AMERICAS), "eu": sorted(EU)}
    assert load_config(tmp_path / "s.yaml") == {"eu": ["azure-westeurope"]}
    (tmp_path / "bad.yaml").write_text("groups: [a, b]\n")
    with pytest.raises(InvalidInputError):
        load_config(tmp_path / "bad.yaml")


def test_split_regions_balances_weight_and_covers_every_region_once() -> None:
    weights = {"a": 10.0, "b": 6.0, "c": 5.0, "d": 1.0}
    rest, groups = split_regions(weights, 2)
    assert sorted([*rest, *(r for g in groups.values() for r in g)]) == sorted(weights)
    assert list(groups) == ["g1"]
    loads = [sum(weights[r] for r in rest), sum(weights[r] for r in groups["g1"])]
    assert abs(loads[0] - loads[1]) <= 2.0  # 11 and 11, or close
    rest1, groups1 = split_regions(weights, 1)
    assert rest1 == sorted(weights) and groups1 == {}
    _, groups4 = split_regions(weights, 4)
    assert list(groups4) == ["g1", "g2", "g3"] and all(len(g) == 1 for g in groups4.values())
    with pytest.raises(InvalidInputError):
        split_regions(weights, 5)
    with pytest.raises(InvalidInputError):
        split_regions(weights, 0)

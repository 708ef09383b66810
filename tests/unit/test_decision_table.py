"""Decision records keep their candidates as columns (``CandidateTable``) until read.

What is stored (``to_dict``, read straight from the columns) must be what the per-candidate
objects give (the generic path, once ``candidates`` has been read), for every outcome of a mixed
workload on a nearly full platform (placed, waiting, preempting, spread gangs); the objects must
be what scoring saw (non-finite raw values as 0, scores rounded to 2 places); ``loom bench
decide`` must give the same digest every time it is run from the same start.
"""

import argparse
import math

import msgspec
import numpy as np
import pytest

from loom.model.topology import load_topology
from loom.sched.framework import CandidateRecord, CandidateTable, DecisionRecord, QueueItem
from loom.sched.profile import build_framework
from loom_benchmarks import decide, placement

SEED = 5


@pytest.fixture(scope="module")
def records() -> list[DecisionRecord]:
    """Every record of a mixed workload on a nearly full platform, decided in cycles of 20."""
    topology = load_topology()
    built = placement.build_platform(topology, 300, 0.85, SEED)
    snap = placement.build_snapshot(topology, built)
    jobs = placement.workload(120, SEED, snap.regions, snap.models)
    framework = build_framework()
    out: list[DecisionRecord] = []
    for start in range(0, len(jobs), 20):
        items = [QueueItem(job=j, submitted_at=snap.now) for j in jobs[start : start + 20]]
        out += [o.record for _, o in framework.schedule_many(items, snap)]
    return out


def _fresh_copy(record: DecisionRecord) -> DecisionRecord:
    """The same record with its candidates as objects (the generic path of ``to_dict``)."""
    copy = DecisionRecord(
        record.job_id,
        record.at,
        record.outcome,
        record.reason,
        dict(record.weights),
        [],
        dict(record.pruned),
        list(record.chosen),
        list(record.victims),
        list(record.notes),
        record.considered,
    )
    copy.candidates = list(record.candidates)
    return copy


def test_the_workload_reaches_every_outcome_and_scores_candidates(records: list[DecisionRecord]) -> None:
    outcomes = {r.outcome for r in records}
    assert {"placed", "waiting"} <= outcomes
    assert sum(1 for r in records if r.candidates) > len(records) // 2


def test_stored_form_from_the_columns_equals_the_one_from_the_objects(records: list[DecisionRecord]) -> None:
    for record in records:
        for raw in (False, True):
            fast = msgspec.json.encode(record.to_dict(raw=raw))
            slow = msgspec.json.encode(_fresh_copy(record).to_dict(raw=raw))
            assert fast == slow, record.job_id
        # reading the candidates does not change what is stored
        before = record.to_dict(raw=True)
        assert record.candidates is record.candidates
        assert record.to_dict(raw=True) == before


def test_a_stored_record_reads_back_to_the_same_candidates(records: list[DecisionRecord]) -> None:
    for record in records:
        back = DecisionRecord.from_dict(record.to_dict(raw=True))
        assert back.candidates == record.candidates
        assert back == DecisionRecord.from_dict(back.to_dict(raw=True))


def test_candidate_objects_hold_every_scorer_rounded_and_raw_values_finite(
    records: list[DecisionRecord],
) -> None:
    scored = [c for r in records for c in r.candidates]
    assert scored
    for cand in scored:
        assert set(cand.scores) == set(cand.raw)
        assert all(round(v, 2) == v and -1e-9 <= v <= 100 + 1e-9 for v in cand.scores.values())
        assert all(math.isfinite(v) for v in cand.raw.values())


def test_non_finite_raw_values_read_as_zero_and_tables_keep_their_order() -> None:
    raw = np.array([[1.5, math.inf], [math.nan, -2.0]])
    first = CandidateTable(("a", "b"), ["c1", "c2"], ["r1", "r2"], ["T4", "V100"], [3, 1], [90.0, 80.0],
                           [[10.0, 20.0], [30.0, 40.0]], raw)  # fmt: skip
    second = CandidateTable((), ["c3"], ["r3"], ["A100"], [2], [70.0], [], [])
    record = DecisionRecord("j", 1.0, "placed", "", {}, [], {}, [])
    record.add_table(first)
    record.add_table(second)
    assert record.to_dict(raw=True)["candidates"]["raw"] == [[1.5, 0.0, None], [0.0, -2.0, None]]
    assert record.candidates == [
        CandidateRecord("c1", "r1", "T4", 3, {"a": 10.0, "b": 30.0}, {"a": 1.5, "b": 0.0}, 90.0),
        CandidateRecord("c2", "r2", "V100", 1, {"a": 20.0, "b": 40.0}, {"a": 0.0, "b": -2.0}, 80.0),
        CandidateRecord("c3", "r3", "A100", 2, {}, {}, 70.0),
    ]
    assert raw[0, 1] == math.inf  # the scorer's array is not changed
    record.candidates = []
    assert record.to_dict()["candidates"]["cluster"] == []


def test_bench_decide_gives_the_same_digest_from_the_same_start() -> None:
    args = argparse.Namespace(nodes="200", jobs=60, batch=25, fill=0.5, seed=SEED, repeat=2, json=True)
    first, second = decide.run(args), decide.run(args)
    size = first["sizes"][0]
    assert size["same_across_repeats"] is True
    assert size["digest"] == second["sizes"][0]["digest"]
    assert sum(size["outcomes"].values()) == 60
    assert size["outcomes"]["placed"] > 0
    assert size["cpu_ms_per_job"] <= size["median_cpu_ms_per_job"]
    assert first["headline"]["200"]["decisions_per_s"] == size["decisions_per_s"]

"""The strict codec refuses what can never be a message: too big, too deep, keys repeated.

Hypothesis throws arbitrary, garbled, nested and oversized payloads at the decode path of every
consumed contract: the only error that may come out is DecodeError, and what Loom itself encodes
always comes back.
"""

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom_proto.clusters import ClusterCommand, ClusterHeartbeat, ClusterProfiles, NodeState, StartJob
from loom_proto.codec import MAX_DEPTH, MAX_PAYLOAD_BYTES, DecodeError, decode, encode, nesting_depth
from loom_proto.jobs import JobSubmitted, Work
from loom_proto.net import RawProbeSample, TransferObserved
from loom_proto.view import ViewDelta

# What each service consumer decodes (placement's submissions and lifecycle events, metrics'
# heartbeats and profiles, network perception's samples and transfers, agents' commands, views).
CONSUMED: list[Any] = [
    JobSubmitted,
    ClusterHeartbeat,
    ClusterProfiles,
    ClusterCommand,
    RawProbeSample,
    TransferObserved,
    ViewDelta,
]

SUBMISSION = JobSubmitted(job_id="j-1", tenant="acme", work=Work(steps=3))
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def nested(depth: int, opening: bytes = b"[", closing: bytes = b"]") -> bytes:
    return opening * depth + closing * depth


def test_a_typical_submission_round_trips() -> None:
    assert decode(encode(SUBMISSION), JobSubmitted) == SUBMISSION


@pytest.mark.parametrize("type_", CONSUMED, ids=lambda t: getattr(t, "__name__", "union"))
@pytest.mark.parametrize(
    "payload",
    [
        nested(50_000),
        b"[" * 100_000,
        b'{"a":' * 30_000 + b"1" + b"}" * 30_000,
        b'{"kind":"start","x":' + nested(20_000) + b"}",
        b'{"kind":"heartbeat","cluster":"c","extra":' + nested(5_000, b'{"k":', b"}") + b"}",
    ],
    ids=["arrays", "unclosed", "objects", "under-a-tag", "objects-under-a-key"],
)
def test_deep_nesting_is_a_decode_error_never_a_recursion_error(type_: Any, payload: bytes) -> None:
    with pytest.raises(DecodeError, match="nested"):
        decode(payload, type_)


def test_nesting_up_to_the_limit_is_let_through_to_the_contract() -> None:
    labels = b'"labels":{"k":"v"}'
    ok = b'{"job_id":"j","tenant":"t","work":{"steps":1},' + labels + b"}"
    assert decode(ok, JobSubmitted).labels == {"k": "v"}
    assert nesting_depth(nested(MAX_DEPTH)) == MAX_DEPTH
    with pytest.raises(DecodeError, match="nested 33 levels"):
        decode(nested(MAX_DEPTH + 1), JobSubmitted)


@pytest.mark.parametrize(
    ("payload", "depth"),
    [
        (b"[]", 1),
        (b"[[],[[]]]", 3),
        (b'{"a":"[[[[[[[[["}', 1),
        (b'{"a":"\\"]]]][[[[[["}', 1),
        (b'{"a":[{"b":"]]]]"},[[[]]]]}', 5),
        (b'{"a":"x\\\\","b":[[1]]}', 3),
        (b"[[[", 3),
    ],
)
def test_nesting_depth_ignores_brackets_inside_strings(payload: bytes, depth: int) -> None:
    assert nesting_depth(payload) == depth


def test_an_oversized_payload_is_refused_before_parsing() -> None:
    big = b'{"job_id":"' + b"x" * MAX_PAYLOAD_BYTES + b'"}'
    with pytest.raises(DecodeError, match="exceeds"):
        decode(big, JobSubmitted)


@pytest.mark.parametrize(
    "payload",
    [
        b'{"job_id":"a","tenant":"t","work":{"steps":1},"job_id":"b"}',
        b'{"job_id":"a","tenant":"t","work":{"steps":1,"steps":2}}',
        b'{"job_id":"a","tenant":"t","work":{"steps":1},"labels":{"k":"x:y","k":"z"}}',
        b'{"job_id":"a","tenant":"t","work":{"steps":1},"job_\\u0069d":"b"}',
        b'{"job_id" : "a", "tenant":"t", "work":{"steps":1}, "tenant" : "u"}',
    ],
    ids=["top level", "nested", "colon in a value", "escaped key", "spaces"],
)
def test_a_repeated_key_is_refused_with_its_name(payload: bytes) -> None:
    with pytest.raises(DecodeError, match="appears more than once"):
        decode(payload, JobSubmitted)


@pytest.mark.parametrize(
    "payload",
    [
        b'{"job_id":"a","tenant":"t","work":{"steps":1},"labels":{"k":"x:y","l":"z"}}',
        b'{"job_id":"a","tenant":"t","name":"caf\\u00e9: 1","work":{"steps":1}}',
        b'{ "job_id" : "a" , "tenant" : "t" , "work" : { "steps" : 1 } }',
    ],
    ids=["colon in a value", "escape", "spaces"],
)
def test_the_same_key_in_different_objects_or_colons_in_strings_are_fine(payload: bytes) -> None:
    assert decode(payload, JobSubmitted).job_id == "a"
    stages = json.dumps(
        {
            "job_id": "dag",
            "tenant": "t",
            "work": {"steps": 1},
            "stages": [{"name": "a", "work": {"steps": 1}}, {"name": "b", "work": {"steps": 2}}],
        }
    ).encode()
    assert [s.name for s in decode(stages, JobSubmitted).stages] == ["a", "b"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=30,
)


def garble(payload: bytes, data: st.DataObject) -> bytes:
    """Cut, splice or flip bytes of a valid payload."""
    how = data.draw(st.sampled_from(["cut", "flip", "splice", "repeat-key", "nest"]))
    if how == "cut":
        return payload[: data.draw(st.integers(0, max(len(payload) - 1, 0)))]
    if how == "flip":
        i = data.draw(st.integers(0, len(payload) - 1))
        return payload[:i] + bytes([data.draw(st.integers(0, 255))]) + payload[i + 1 :]
    if how == "splice":
        return payload[:-1] + b"," + json.dumps(data.draw(json_values)).encode() + b"}"
    if how == "repeat-key":
        return payload[:-1] + b',"job_id":"again","kind":"submitted"}'
    depth = data.draw(st.integers(MAX_DEPTH + 1, 3_000))
    return payload[:-1] + b',"x":' + nested(depth) + b"}"


@FUZZ
@given(data=st.data())
def test_fuzzed_payloads_decode_or_raise_decode_error_only(data: st.DataObject) -> None:
    type_ = data.draw(st.sampled_from(CONSUMED))
    valid = [
        encode(SUBMISSION),
        encode(StartJob(job_id="j", spec=SUBMISSION, gpu_model="A100", allocations=[])),
        encode(
            ClusterHeartbeat(
                cluster="c", region="r", seq=1, sent_at=1.0, nodes=[NodeState(node="n", zone="z")]
            )
        ),
    ]
    payload = data.draw(
        st.one_of(
            st.binary(max_size=300),
            st.builds(lambda v: json.dumps(v).encode(), json_values),
            st.sampled_from(valid).flatmap(lambda p: st.builds(lambda d: garble(p, d), st.data())),
        )
    )
    try:
        value = decode(payload, type_)
    except DecodeError:
        return  # refused as a whole: nothing else may come out (RecursionError did)
    assert decode(msgspec.json.encode(value), type_) == value


@FUZZ
@given(job_id=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True), steps=st.integers(1, 10**6))
def test_what_loom_encodes_always_decodes(job_id: str, steps: int) -> None:
    job = JobSubmitted(job_id=job_id, tenant="t", work=Work(steps=steps), labels={"k": "v:w"})
    assert decode(encode(job), JobSubmitted) == job
    by_hand = msgspec.json.encode(msgspec.to_builtins(job))
    assert decode(b" " + by_hand + b"\n", JobSubmitted) == job

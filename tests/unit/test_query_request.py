"""Placement's job queries refuse a bad request in the asker's terms, not Python's or PostgreSQL's."""

import pytest

from loom_services.placement.service import _query_request


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"[]", "a query is a JSON object"),  # was "'list' object has no attribute 'get'"
        (b"not json", "a query is a JSON object"),
        (b'{"op": "list", "limit": "x"}', "limit must be a whole number"),  # was int()'s own message
        (b'{"op": "list", "limit": -1}', "limit must be a whole number"),  # was "LIMIT must not be negative"
        (b'{"op": "list", "limit": true}', "limit must be a whole number"),
        (b'{"op": "get"}', "op 'get' needs a job_id"),  # was "'job_id'"
        (b'{"op": "explain", "job_id": 7}', "op 'explain' needs a job_id"),
        (b'{"op": "list", "state": ["queued"]}', "state must be a string"),
        (b'{"op": "drop"}', "unknown op 'drop'"),
        (b'{"op": "list", "state": "weird"}', "unknown job state 'weird'; one of"),  # was ok, []
    ],
)
def test_a_bad_query_is_refused_saying_what_is_wrong(body: bytes, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        _query_request(body)


def test_a_good_query_is_taken_with_its_defaults_and_a_capped_limit() -> None:
    assert _query_request(b"{}") == {"op": "list", "limit": 100}
    assert _query_request(b'{"op": "list", "limit": 50000}')["limit"] == 10_000
    assert _query_request(b'{"op": "get", "job_id": "j-1"}')["job_id"] == "j-1"
    assert _query_request(b'{"op": "list", "state": "running"}')["state"] == "running"

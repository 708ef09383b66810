"""The pure parts of loom.bus.dlq: reading a dead letter's headers, replay headers, ``--since``."""

from datetime import UTC, datetime, timedelta

import pytest

from loom.bus.dlq import NOT_REPLAYABLE_HEADER, DeadLetter, parse_since, replay_headers, replay_msg_id
from loom.errors import InvalidInputError

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

HEADERS = {
    "Loom-Error": "job_id: expected str",
    "Loom-Error-Type": "DecodeError",
    "Loom-Original-Subject": "loom.jobs.submitted.acme",
    "Loom-Original-Msg-Id": "job-7",
    "Loom-Stream": "JOBS",
    "Loom-Stream-Seq": "42",
    "Loom-Deliveries": "3",
    "Loom-Consumer": "placement",
    "Nats-Msg-Id": "dlq-JOBS-42",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "X-Origin": "sdk",
}


def test_a_dead_letter_reads_its_error_headers_into_fields() -> None:
    letter = DeadLetter.from_message(9, "loom.dlq.loom.jobs.submitted.acme", HEADERS, b"{}", NOW)
    assert (letter.seq, letter.original_subject, letter.consumer) == (
        9,
        "loom.jobs.submitted.acme",
        "placement",
    )
    assert (letter.error_type, letter.error) == ("DecodeError", "job_id: expected str")
    assert (letter.deliveries, letter.stream, letter.stream_seq) == (3, "JOBS", 42)
    assert letter.original_msg_id == "job-7"
    assert letter.summary()["replayed"] is None


def test_without_headers_the_original_subject_comes_from_the_dead_letter_subject() -> None:
    letter = DeadLetter.from_message(1, "loom.dlq.loom.net.probe.a.b", {"Loom-Deliveries": "x"}, b"", None)
    assert letter.original_subject == "loom.net.probe.a.b"
    assert letter.deliveries is None
    assert letter.original_msg_id is None
    assert replay_msg_id(letter) == "dlq-replay-1"


def test_a_dead_letter_whose_header_names_another_subject_than_its_own_is_not_replayable() -> None:
    # An agent may publish dead letters of its own commands only; the headers are its to set. A
    # forged entry on its subject naming another tenant's completion was replayed, as the operator,
    # to that subject: the job ended at 20 % while it ran on, and its GPUs were given to others.
    forged = {**HEADERS, "Loom-Original-Subject": "loom.jobs.completed.victim.c-use2-a"}
    letter = DeadLetter.from_message(4, "loom.dlq.loom.clusters.c-weu-a.cmd.start", forged, b"{}", NOW)
    assert letter.original_subject == "loom.clusters.c-weu-a.cmd.start"
    why = letter.headers[NOT_REPLAYABLE_HEADER]
    assert "loom.jobs.completed.victim.c-use2-a" in why and "not replayed" in why
    # The consumer's own entries name their DLQ subject's original, and a dead letter's dead letter
    # (which stays on its subject) its own: both replayable as before.
    for subject, claimed, original in [
        ("loom.dlq.loom.jobs.submitted.acme", "loom.jobs.submitted.acme", "loom.jobs.submitted.acme"),
        ("loom.dlq.loom.jobs.x.acme", "loom.dlq.loom.jobs.x.acme", "loom.dlq.loom.jobs.x.acme"),
    ]:
        own = DeadLetter.from_message(5, subject, {**HEADERS, "Loom-Original-Subject": claimed}, b"{}", NOW)
        assert own.original_subject == original and NOT_REPLAYABLE_HEADER not in own.headers


def test_a_replay_keeps_the_original_headers_and_id_and_drops_the_dead_letters() -> None:
    letter = DeadLetter.from_message(9, "loom.dlq.loom.jobs.submitted.acme", HEADERS, b"{}", NOW)
    assert replay_headers(letter) == {
        "traceparent": HEADERS["traceparent"],
        "X-Origin": "sdk",
        "Loom-Replayed-From": "9",
    }
    assert replay_msg_id(letter) == "job-7"


@pytest.mark.parametrize(
    ("text", "back"),
    [
        ("90s", timedelta(seconds=90)),
        ("15m", timedelta(minutes=15)),
        ("2h", timedelta(hours=2)),
        ("1d", timedelta(days=1)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("0.5h", timedelta(minutes=30)),
    ],
)
def test_since_takes_a_duration_back_from_now(text: str, back: timedelta) -> None:
    assert parse_since(text, now=NOW) == NOW - back


def test_since_takes_an_iso_time_utc_when_it_names_no_zone() -> None:
    assert parse_since("2026-12-01T10:00", now=NOW) == datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    assert parse_since("2026-12-01T10:00+01:00", now=NOW) == datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize("text", ["yesterday", "15", "m15", "", "2h-"])
def test_since_refuses_anything_else_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(InvalidInputError, match="15m"):
        parse_since(text, now=NOW)


@pytest.mark.parametrize("text", ["800000d", "9" * 400 + "s"])
def test_since_refuses_a_duration_back_past_any_date(text: str) -> None:
    with pytest.raises(InvalidInputError, match="further back than any date"):
        parse_since(text, now=NOW)


def test_loom_dlq_replay_exits_1_when_an_entry_was_not_replayed_or_not_delivered() -> None:
    # "0 of 2 replayed" (one skipped, one inside the stream's duplicate window) exited 0.
    from types import SimpleNamespace

    from loom.cli.dlq import _replay_code

    def results(*outcomes: str) -> list[object]:
        return [SimpleNamespace(outcome=o) for o in outcomes]

    assert _replay_code(results("replayed", "skipped")) == 0
    assert _replay_code(results("skipped", "duplicate")) == 1
    assert _replay_code(results("replayed", "not_replayable")) == 1

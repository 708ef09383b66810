"""The leader changes read from nats-server logs, and a node kill's elections split from them."""

import datetime
from pathlib import Path

from loom_benchmarks import nats_elections as ne


def _at(clock: str) -> float:
    return datetime.datetime.strptime(f"2026/12/02 {clock}", "%Y/%m/%d %H:%M:%S.%f").timestamp()


def _line(clock: str, text: str) -> str:
    return f"[4242] 2026/12/02 {clock} [INF] {text}\n"


NODE1 = [
    _line("01:00:00.100000", "JetStream cluster new metadata leader: nats-2/loom"),
    _line("01:00:01.000000", "JetStream cluster new stream leader for '$G > JOBS'"),
    _line("01:00:02.000000", "127.0.0.1:1 - rid:5 - Route connection created"),
    _line("01:00:10.500000", "JetStream cluster new consumer leader for '$G > JOBS > placement-submitted'"),
    _line("01:00:11.250000", "Self is new JetStream cluster metadata leader"),
]
NODE2 = [
    _line("01:00:00.100000", "Self is new JetStream cluster metadata leader"),
    _line("01:00:01.500000", "JetStream cluster new consumer leader for 'LOOM > JOBS > placement-submitted'"),
    _line("01:00:03.000000", "JetStream cluster new stream leader for '$G > KV_loom_leases'"),
]
NODE3 = [
    _line("01:00:12.000000", "JetStream cluster new stream leader for '$G > KV_loom_leases'"),
    _line("01:00:12.000001", "JetStream cluster new metadata leader: nats-1/loom"),
    # nats-3 killed at 01:00:20 and restarted: it wins the VIEW election itself.
    _line("01:00:19.000000", "JetStream cluster new stream leader for '$G > VIEW'"),
    _line("01:00:27.500000", "JetStream cluster new stream leader for '$G > VIEW'"),
]


def test_parse_log_reads_stream_consumer_and_meta_leaders() -> None:
    events = ne.parse_log("nats-1", NODE1)
    assert [(e.group, e.leader) for e in events] == [
        ("meta", "nats-2"),
        ("stream:JOBS", "nats-1"),
        ("consumer:JOBS>placement-submitted", "nats-1"),
        ("meta", "nats-1"),
    ]
    assert events[1].at == _at("01:00:01.000000")


def test_elections_after_a_kill_name_the_groups_the_victim_led_and_their_new_leaders(tmp_path: Path) -> None:
    for node, lines in (("nats-1", NODE1), ("nats-2", NODE2), ("nats-3", NODE3)):
        (tmp_path / "nats" / node).mkdir(parents=True)
        (tmp_path / "nats" / node / "nats.log").write_text("".join(lines))
    events = ne.read_cluster_logs(tmp_path)
    assert [e.at for e in events] == sorted(e.at for e in events)
    t0 = _at("01:00:05.000000")
    assert ne.leaders_at(events, t0) == {
        "meta": "nats-2",
        "stream:JOBS": "nats-1",
        "consumer:JOBS>placement-submitted": "nats-2",
        "stream:KV_loom_leases": "nats-2",
    }
    elections = ne.elections_after(events, "nats-2", t0)
    assert set(elections) == {"meta", "consumer:JOBS>placement-submitted", "stream:KV_loom_leases"}
    assert elections["consumer:JOBS>placement-submitted"] == ne.Election(
        "consumer:JOBS>placement-submitted", 5.5, "nats-1"
    )
    assert elections["meta"].elected_s == 6.25 and elections["meta"].new_leader == "nats-1"
    assert elections["stream:KV_loom_leases"].new_leader == "nats-3"
    path = (ne.stream_group("JOBS"), ne.consumer_group("JOBS", "placement-submitted"))
    # The victim led the consumer, not the stream: the path waited for the consumer's election.
    assert ne.path_election_s(elections, path) == 5.5
    # Killing nats-1 at the same moment: it led the stream, and no one else took it in the logs.
    other = ne.elections_after(events, "nats-1", t0)
    assert other == {"stream:JOBS": ne.Election("stream:JOBS", None, None)}
    assert ne.path_election_s(other, path) == float("inf")
    # A node leading nothing on the path: the path had no election to wait for.
    assert ne.path_election_s(ne.elections_after(events, "nats-3", t0), path) == 0.0
    # The restarted victim itself won the election: that is when the group had a leader again.
    restarted = ne.elections_after(events, "nats-3", _at("01:00:20.000000"))
    assert restarted["stream:VIEW"] == ne.Election("stream:VIEW", 7.5, "nats-3")

"""When the Raft groups of a 3-node NATS cluster got a new leader after a node was killed, read
from the nodes' own logs.

nats-server logs, on the node that becomes leader, ``JetStream cluster new stream leader for 'ACC
> STREAM'``, ``JetStream cluster new consumer leader for 'ACC > STREAM > DURABLE'`` and ``Self is
new JetStream cluster metadata leader`` (the other nodes log ``JetStream cluster new metadata
leader: NAME/CLUSTER``), each with a microsecond timestamp. From those lines this module rebuilds
who led each group over time, so that for a kill at ``t0`` of node ``victim`` it can say which
groups the victim led and how long after ``t0`` each got a new leader: the server's part of a
stall (its Raft election), as opposed to what the clients add after it.

Pure functions over log text (:func:`parse_log`, :func:`elections_after`) plus
:func:`read_cluster_logs` for ``loom up --nats-cluster`` homes (``nats/nats-N/nats.log``).
"""

import dataclasses
import datetime
import re
from collections.abc import Iterable
from pathlib import Path

_STAMP = r"^\[\d+\] (?P<stamp>\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) \[\w+\] "
_STREAM = re.compile(_STAMP + r"JetStream cluster new stream leader for '[^ ]+ > (?P<stream>[^']+)'")
_CONSUMER = re.compile(
    _STAMP + r"JetStream cluster new consumer leader for '[^ ]+ > (?P<stream>[^ ]+) > (?P<durable>[^']+)'"
)
_META_SELF = re.compile(_STAMP + r"Self is new JetStream cluster metadata leader")
_META_OTHER = re.compile(_STAMP + r"JetStream cluster new metadata leader: (?P<name>[^/\s]+)/")

META: str = "meta"
"""The group name :func:`parse_log` gives the JetStream meta group."""


def stream_group(stream: str) -> str:
    """The group name of a stream's Raft group (``stream:JOBS``)."""
    return f"stream:{stream}"


def consumer_group(stream: str, durable: str) -> str:
    """The group name of a durable consumer's Raft group (``consumer:JOBS>placement-submitted``)."""
    return f"consumer:{stream}>{durable}"


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderEvent:
    """``leader`` became the leader of ``group`` at ``at`` (Unix seconds)."""

    at: float
    group: str
    leader: str


def _stamp(text: str) -> float:
    # nats-server writes local time; naive datetimes' timestamp() reads it as local time too.
    return datetime.datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def parse_log(node: str, lines: Iterable[str]) -> list[LeaderEvent]:
    """The leader changes that node ``node``'s log reports (its own wins; for the meta group also
    the winner it names)."""
    events: list[LeaderEvent] = []
    for line in lines:
        if "leader" not in line:
            continue
        if m := _STREAM.match(line):
            events.append(LeaderEvent(_stamp(m["stamp"]), stream_group(m["stream"]), node))
        elif m := _CONSUMER.match(line):
            events.append(LeaderEvent(_stamp(m["stamp"]), consumer_group(m["stream"], m["durable"]), node))
        elif m := _META_SELF.match(line):
            events.append(LeaderEvent(_stamp(m["stamp"]), META, node))
        elif m := _META_OTHER.match(line):
            events.append(LeaderEvent(_stamp(m["stamp"]), META, m["name"]))
    return events


def read_cluster_logs(home: Path) -> list[LeaderEvent]:
    """Every leader change in the logs of a ``loom up --nats-cluster`` home, in time order."""
    events: list[LeaderEvent] = []
    for log in sorted((home / "nats").glob("nats-*/nats.log")):
        with log.open(errors="replace") as lines:
            events.extend(parse_log(log.parent.name, lines))
    return sorted(events, key=lambda e: e.at)


@dataclasses.dataclass(frozen=True, slots=True)
class Election:
    """One group the killed node led: how long after the kill a node took over (None: not within
    the logs), and which."""

    group: str
    elected_s: float | None
    new_leader: str | None


def leaders_at(events: Iterable[LeaderEvent], at: float) -> dict[str, str]:
    """Each group's leader at time ``at``: the last one named before it."""
    leaders: dict[str, str] = {}
    for e in events:
        if e.at >= at:
            break
        leaders[e.group] = e.leader
    return leaders


def elections_after(events: list[LeaderEvent], victim: str, t0: float) -> dict[str, Election]:
    """For a kill of ``victim`` at ``t0`` (``events`` in time order): every group it led then, with
    the first leader named after ``t0``. That may be the victim itself once restarted (the
    supervisor restarts a killed node within a second or two, before the survivors' election
    timeout, and it can win the election): the dead process logs nothing, so every later line is a
    real new leadership."""
    led = [g for g, leader in leaders_at(events, t0).items() if leader == victim]
    out: dict[str, Election] = {}
    for group in led:
        after = next((e for e in events if e.at >= t0 and e.group == group), None)
        out[group] = Election(
            group,
            round(after.at - t0, 3) if after is not None else None,
            after.leader if after is not None else None,
        )
    return out


def path_election_s(elections: dict[str, Election], path: Iterable[str]) -> float:
    """How long the groups of ``path`` (all needed for one flow) were leaderless after the kill:
    the latest election among those the victim led, 0 when it led none of them. A group the
    victim led that got no new leader in the logs counts as infinitely long."""
    times = [elections[g].elected_s for g in path if g in elections]
    if any(t is None for t in times):
        return float("inf")
    return max((t for t in times if t is not None), default=0.0)

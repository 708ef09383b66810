"""Is a cluster healthy, suspect or failed? A pure classifier over two independent signals.

The signals:

* **heartbeats** — the view ledger marks a cluster stale once no heartbeat came for its TTL;
  ``heartbeat_lost_s`` is how long ago the last heartbeat came (None: heartbeats are fresh).
* **probes** — network perception's link states for the cluster's region: ``probes_reach`` is
  True when at least one link to or from the region is live (not stale), False when every known
  link of the region is stale (the probes cannot reach it), None when there is no link information
  about the region at all. A link is unreachable when it is stale, loses ≥ 99 % over its loss
  window, or lost its latest ``UNREACHABLE_RUN`` probes in a row (:func:`link_unreachable`: the
  run shows a blackhole within about two probe periods, the window only after many).
* **agent liveness** — a faster reading of the same side as the heartbeats: the agent's NATS
  connection. Placement pings each cluster's agent on a request-reply subject every period; while
  the agent is connected it answers, and once its process is gone the server answers *no
  responders* at once. ``agent_gone_s`` is how long the pings have met no responders, counted from
  the first of ``AGENT_GONE_MISSES`` in a row (None: it answers, or too few misses). A ping that
  merely times out (a slow, busy agent) is not evidence of anything and breaks the run, and so is
  a round in which every watched agent (two or more) met no responders: the observer's trouble.

The agent side is bad when its heartbeats are lost past ``ttl_s`` **or** its connection is gone
(see :class:`Liveness`); the rule (:func:`classify`):

* agent side bad **and** probes cannot reach the region → ``failed``;
* heartbeats lost past ``ttl_s`` with no probe information about the region → ``suspect`` until
  the loss lasts ``unknown_probe_factor`` × ``ttl_s`` (2 × TTL by default), then ``failed`` — the
  reason says the probe signal was missing (an agent gone with no probe information stays
  ``suspect``: only lost heartbeats count for this grace);
* exactly one signal bad (agent side bad but probes reach; probes fail but the agent side is fine)
  → ``suspect``, the reason naming the signal — so a healthy but slow cluster (late heartbeats,
  pings timing out, probes answering) is never ``failed``;
* otherwise ``healthy``.

Only ``failed`` moves work; ``suspect`` is reported (a lone bad signal is often the observer's
fault: a probe path down while the cluster runs, a metrics hiccup while probes still answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from loom_proto.clusters import CLUSTER_HEALTH_RETELL_S

HealthState = Literal["healthy", "suspect", "failed"]

PingOutcome = Literal["answered", "no_responders", "timeout"]
"""What one liveness ping of an agent met."""

DEFAULT_UNKNOWN_PROBE_FACTOR = 2.0

AGENT_GONE_MISSES = 3
"""Pings met by *no responders* in a row before the agent's connection counts as gone."""


@dataclass(frozen=True, slots=True)
class Health:
    """A cluster's health and why."""

    cluster: str
    state: HealthState
    reason: str

    @property
    def failed(self) -> bool:
        """Whether its work must be re-placed."""
        return self.state == "failed"


def classify(
    cluster: str,
    *,
    heartbeat_lost_s: float | None,
    ttl_s: float,
    probes_reach: bool | None,
    region: str | None = None,
    unknown_probe_factor: float = DEFAULT_UNKNOWN_PROBE_FACTOR,
    agent_gone_s: float | None = None,
) -> Health:
    """The health of one cluster from its heartbeat age, its agent's connection and its region's
    probe reachability."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    if unknown_probe_factor < 1:
        raise ValueError(f"unknown_probe_factor must be >= 1, got {unknown_probe_factor}")
    where = f"region {region}" if region else "its region"
    lost = heartbeat_lost_s is not None and heartbeat_lost_s >= ttl_s
    if not lost and agent_gone_s is not None:
        gone = f"agent's connection gone (no responders for {agent_gone_s:.1f} s)"
        if probes_reach is False:
            return Health(cluster, "failed", f"{gone} and probes cannot reach {where}")
        if probes_reach is None:
            return Health(cluster, "suspect", f"{gone}; no probe information about {where}")
        return Health(cluster, "suspect", f"{gone} but probes still reach {where}")
    if lost:
        assert heartbeat_lost_s is not None
        age = f"no heartbeat for {heartbeat_lost_s:.1f} s (TTL {ttl_s:g} s)"
        if probes_reach is False:
            return Health(cluster, "failed", f"{age} and probes cannot reach {where}")
        if probes_reach is None:
            grace = unknown_probe_factor * ttl_s
            if heartbeat_lost_s >= grace:
                return Health(
                    cluster,
                    "failed",
                    f"{age}; no probe information about {where}, so failed after {grace:g} s "
                    f"({unknown_probe_factor:g} x TTL) of heartbeat loss alone",
                )
            return Health(
                cluster,
                "suspect",
                f"{age}; no probe information about {where} (failed at {grace:g} s of heartbeat loss)",
            )
        return Health(cluster, "suspect", f"{age} but probes still reach {where}")
    if probes_reach is False:
        return Health(cluster, "suspect", f"probes cannot reach {where} but heartbeats are fresh")
    return Health(cluster, "healthy", "heartbeats fresh" + ("" if probes_reach is None else ", probes reach"))


def region_reachable(links: dict[tuple[str, str], bool], region: str) -> bool | None:
    """Whether probes reach ``region``, from ``{(src, dst): stale}`` link states.

    True when any link to or from the region is live, False when all its known links are stale,
    None when no link touches the region.
    """
    touching = [stale for (src, dst), stale in links.items() if region in (src, dst) and src != dst]
    if not touching:
        return None
    return not all(touching)


def link_unreachable(*, stale: bool, loss_rate: float, lost_run: int = 0) -> bool:
    """Whether a link state says the probes do not get through: no fresh sample, all lost over the
    loss window, or the latest ``UNREACHABLE_RUN`` probes all lost in a row."""
    return stale or loss_rate >= UNREACHABLE_LOSS or lost_run >= UNREACHABLE_RUN


UNREACHABLE_LOSS = 0.99
"""A link losing this share of its probes counts as unreachable (a blackholed endpoint)."""

UNREACHABLE_RUN = 10
"""A link whose latest this-many probes were all lost counts as unreachable: two whole periods of
the collectors' default five probes (a lossy link at 10 % loses ten in a row once in 10^10)."""


class Liveness:
    """Runs of *no responders* to each cluster's agent pings (see :func:`classify`)."""

    def __init__(self, misses: int = AGENT_GONE_MISSES) -> None:
        if misses < 1:
            raise ValueError(f"misses must be >= 1, got {misses}")
        self.misses = misses
        self._run: dict[str, tuple[float, int]] = {}
        """cluster -> (first no-responders of the current run, its length)."""
        self.answered_at: dict[str, float] = {}
        """cluster -> when its agent last answered."""

    def record(self, cluster: str, now: float, outcome: PingOutcome) -> None:
        """One ping's outcome: an answer or a timeout ends the run; no responders extends it."""
        if outcome == "no_responders":
            first, n = self._run.get(cluster, (now, 0))
            self._run[cluster] = (first, n + 1)
            return
        self._run.pop(cluster, None)
        if outcome == "answered":
            self.answered_at[cluster] = now

    def record_round(self, now: float, outcomes: Mapping[str, PingOutcome]) -> None:
        """One ping of every watched cluster. When two or more were watched and *every* one met no
        responders, the observer (its own reconnection, the bus) is the likelier cause than all the
        agents dying at once: the round counts as timeouts, evidence of nothing."""
        everyone_missed = len(outcomes) >= 2 and all(o == "no_responders" for o in outcomes.values())
        for cluster, outcome in outcomes.items():
            self.record(cluster, now, "timeout" if everyone_missed else outcome)

    def gone_s(self, cluster: str, now: float) -> float | None:
        """How long the agent's connection has been gone (from the run's first miss), or None."""
        run = self._run.get(cluster)
        if run is None or run[1] < self.misses:
            return None
        return max(now - run[0], 0.0)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop clusters no longer watched."""
        kept = set(keep)
        for table in (self._run, self.answered_at):
            for cluster in [c for c in table if c not in kept]:
                del table[cluster]


def affected_jobs(clusters_of: Mapping[str, Iterable[str]], failed: Iterable[str]) -> dict[str, str]:
    """Jobs with any part (lead, gang member, pipeline stage) on a failed cluster: job -> the first
    failed cluster it holds (sorted), each job once however many of its clusters failed."""
    down = sorted(set(failed))
    out: dict[str, str] = {}
    for job_id, clusters in clusters_of.items():
        held = set(clusters)
        hit = next((c for c in down if c in held), None)
        if hit is not None:
            out[job_id] = hit
    return out


def reachability(links: Mapping[tuple[str, str], bool]) -> dict[str, bool]:
    """:func:`region_reachable` for every region some link touches, in one pass over the links."""
    live: dict[str, bool] = {}
    for (src, dst), down in links.items():
        if src == dst:
            continue
        for region in (src, dst):
            live[region] = live.get(region, False) or not down
    return live


SUSPECT_ANNOUNCE_S = 5.0
"""How long a cluster stays suspect before it is told to the alert correlator (failed: at once)."""


@dataclass(slots=True)
class HealthNotices:
    """Which clusters' classification to tell (placement to the alert correlator), and when.

    A failed state is told at once; a suspect state once it has lasted ``suspect_after_s`` (links
    not measured yet at start-up, a late heartbeat under load: placement copes, nobody needs
    paging); nothing before placement has ``settled`` after taking the lead; ``healthy`` only for a
    cluster told unhealthy before. A notice counts as told only once :meth:`told` says it went out.
    An unhealthy state already told is told again every ``retell_s`` while it lasts (the notice is
    core NATS: a correlator that was restarting hears it then, and one that hears nothing for a
    while lets the state lapse, :data:`~loom_proto.clusters.CLUSTER_HEALTH_LEASE_S`).
    """

    suspect_after_s: float = SUSPECT_ANNOUNCE_S
    retell_s: float = CLUSTER_HEALTH_RETELL_S
    unhealthy_since: dict[str, float] = field(default_factory=dict)
    """Cluster -> since when it has been suspect or failed without a break (wall s)."""
    announced: dict[str, HealthState] = field(default_factory=dict)
    """Cluster -> the unhealthy state last told."""
    told_at: dict[str, float] = field(default_factory=dict)
    """Cluster -> when its unhealthy state was last told (wall s)."""

    def due(self, health: Mapping[str, Health], now: float, *, settled: bool) -> list[Health]:
        """The notices to send now: changed unhealthy states, then clusters healthy again."""
        since = self.unhealthy_since
        for cluster in [c for c in since if c not in health]:
            del since[cluster]
        for cluster in health:
            since.setdefault(cluster, now)
        out = [
            h
            for c, h in sorted(health.items())
            if settled
            and (
                (self.announced.get(c) != h.state and (h.failed or now - since[c] >= self.suspect_after_s))
                or (self.announced.get(c) == h.state and now - self.told_at.get(c, now) >= self.retell_s)
            )
        ]
        out += [
            Health(c, "healthy", "heartbeats and probes back")
            for c in sorted(set(self.announced) - set(health))
        ]
        return out

    def told(self, notice: Health, now: float) -> None:
        """``notice`` went out at ``now``."""
        if notice.state == "healthy":
            self.announced.pop(notice.cluster, None)
            self.told_at.pop(notice.cluster, None)
        else:
            self.announced[notice.cluster] = notice.state
            self.told_at[notice.cluster] = now

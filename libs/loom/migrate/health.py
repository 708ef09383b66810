"""Is a cluster healthy, suspect or failed? A pure classifier over two independent signals.

The signals:

* **heartbeats** — the view ledger marks a cluster stale once no heartbeat came for its TTL;
  ``heartbeat_lost_s`` is how long ago the last heartbeat came (None: heartbeats are fresh).
* **probes** — network perception's link states for the cluster's region: ``probes_reach`` is
  True when at least one link to or from the region is live (not stale), False when every known
  link of the region is stale (the probes cannot reach it), None when there is no link information
  about the region at all.

The rule (:func:`classify`):

* heartbeats lost past ``ttl_s`` **and** probes cannot reach the region → ``failed``;
* heartbeats lost past ``ttl_s`` with no probe information about the region → ``suspect`` until
  the loss lasts ``unknown_probe_factor`` × ``ttl_s`` (2 × TTL by default), then ``failed`` — the
  reason says the probe signal was missing;
* exactly one signal bad (heartbeats lost but probes reach; probes fail but heartbeats fresh)
  → ``suspect``, the reason naming the signal;
* otherwise ``healthy``.

Only ``failed`` moves work; ``suspect`` is reported (a lone bad signal is often the observer's
fault: a probe path down while the cluster runs, a metrics hiccup while probes still answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

HealthState = Literal["healthy", "suspect", "failed"]

DEFAULT_UNKNOWN_PROBE_FACTOR = 2.0


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
) -> Health:
    """The health of one cluster from its heartbeat age and its region's probe reachability."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    if unknown_probe_factor < 1:
        raise ValueError(f"unknown_probe_factor must be >= 1, got {unknown_probe_factor}")
    where = f"region {region}" if region else "its region"
    lost = heartbeat_lost_s is not None and heartbeat_lost_s >= ttl_s
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


def link_unreachable(*, stale: bool, loss_rate: float) -> bool:
    """Whether a link state says the probes do not get through: no fresh sample, or all lost."""
    return stale or loss_rate >= UNREACHABLE_LOSS


UNREACHABLE_LOSS = 0.99
"""A link losing this share of its probes counts as unreachable (a blackholed endpoint)."""


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

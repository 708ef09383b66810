"""Network perception, the pure core of the ``network-perception`` service (the sole writer of link state).

One object holds everything: admission (:mod:`loom.net.samples`), a :class:`LinkTracker` per
directed link, the link-state graph and the path selector. The service feeds it:

* ``ingest(sample, now)`` for every probe sample (O(1); refused samples counted by reason),
* ``tick(now)`` once per probe period (re-evaluates every link, updates the graph, returns the
  degraded / recovered events to publish), and ``evaluate_shifted(now)`` after a batch of
  samples (only the links whose filter just confirmed a level shift: a step is seen at once),
* ``observe_transfer(...)`` when a job reports a transfer's throughput,

and answers ``point`` (a link or a region: now and forecast) and ``path`` (least-cost path with
hysteresis: cost, RTT, loss, bottleneck) from memory. ``records`` / ``restore`` carry the slowly
learned state (baselines, prices, profiles) across restarts. No I/O, no clock: time is passed in.
"""

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loom.model.topology import Topology
from loom.net.burst import BURST_PROBE
from loom.net.errors import UnknownEndpointError
from loom.net.graph import LinkGraph, PathInfo, PathSelector, Selection, SelectorConfig
from loom.net.linkstate import Expected, LinkConfig, LinkEvent, LinkRecord, LinkTracker
from loom.net.samples import DropReason, SampleLike, SampleValidator, ValidationConfig
from loom.net.window import LossStats, RttStats
from loom_proto.net import LinkState

__all__ = ["LinkPoint", "PathAnswer", "Perception", "RegionPoint"]


@dataclass(frozen=True, slots=True)
class LinkPoint:
    """A point query on a link: its state now, its windows and its forecast."""

    src: str
    dst: str
    cost: float
    rtt_ms: float
    jitter_ms: float
    loss_rate: float
    bandwidth_gbps: float | None
    stale: bool
    degraded: bool
    usable: bool
    baseline_rtt_ms: float | None
    windows: tuple[tuple[RttStats, LossStats], ...]
    """Statistics at every horizon, shortest first."""
    forecast_at: float
    rtt_ms_forecast: float | None


@dataclass(frozen=True, slots=True)
class RegionPoint:
    """A point query on a region: its links out and in."""

    region: str
    outgoing: tuple[LinkPoint, ...]
    incoming: tuple[LinkPoint, ...]

    @property
    def stale_links(self) -> int:
        """Links of the region, either way, that are stale."""
        return sum(link.stale for link in (*self.outgoing, *self.incoming))

    @property
    def degraded_links(self) -> int:
        """Links of the region, either way, that are degraded."""
        return sum(link.degraded for link in (*self.outgoing, *self.incoming))


@dataclass(frozen=True, slots=True)
class PathAnswer:
    """A path query: the chosen path (with hysteresis), the momentary best, and why."""

    src: str
    dst: str
    chosen: PathInfo | None
    best: PathInfo | None
    changed: bool
    reason: str


class Perception:
    """Link state for a set of regions, fed with samples and evaluated once per period."""

    def __init__(
        self,
        regions: Iterable[str],
        *,
        expected: Mapping[tuple[str, str], Expected] | None = None,
        link_config: LinkConfig | None = None,
        validation: ValidationConfig | None = None,
        selector: SelectorConfig | None = None,
    ) -> None:
        self.regions = frozenset(regions)
        self.link_config = link_config or LinkConfig()
        self.validator = SampleValidator.for_regions(self.regions, validation)
        self.expected = dict(expected or {})
        self.links: dict[tuple[str, str], LinkTracker] = {}
        self.graph = LinkGraph(sorted(self.regions))
        self.selector = PathSelector(self.graph, selector)
        self.transfers_refused = 0
        self._shifted: set[tuple[str, str]] = set()
        for (src, dst), prior in self.expected.items():
            if src in self.regions and dst in self.regions and src != dst:
                tracker = LinkTracker(src, dst, self.link_config, prior)
                self.links[src, dst] = tracker
                self.graph.update(tracker.view(0.0))

    @classmethod
    def from_topology(
        cls,
        topology: Topology,
        *,
        link_config: LinkConfig | None = None,
        validation: ValidationConfig | None = None,
        selector: SelectorConfig | None = None,
    ) -> "Perception":
        """Perception over a topology's regions, each link's prior taken from its measurements."""
        return cls(
            [region.id for region in topology.regions],
            expected={(link.src, link.dst): Expected.from_link(link) for link in topology.links},
            link_config=link_config,
            validation=validation,
            selector=selector,
        )

    @property
    def dropped(self) -> Counter[str]:
        """Refused samples (and outlier RTTs) by reason."""
        return self.validator.dropped

    @property
    def accepted(self) -> int:
        """Samples admitted."""
        return self.validator.accepted

    def _tracker(self, src: str, dst: str) -> LinkTracker:
        tracker = self.links.get((src, dst))
        if tracker is None:
            tracker = LinkTracker(src, dst, self.link_config, self.expected.get((src, dst)))
            self.links[src, dst] = tracker
        return tracker

    # ---- input ---------------------------------------------------------------------------------

    def ingest(self, sample: SampleLike, now: float, source: str | None = None) -> DropReason | None:
        """Admit and fold in one sample arriving at ``now``; the reason if it was refused."""
        reason = self.validator.check(sample, now, source)
        if reason is not None:
            return reason
        tracker = self._tracker(sample.src, sample.dst)
        outliers = tracker.add(
            now,
            sample.rtt_ms,
            sample.sent,
            sample.lost,
            bandwidth_gbps=sample.bandwidth_gbps,
            jitter_ms=sample.jitter_ms,
            counts_only=sample.probe == BURST_PROBE,
        )
        if outliers:
            self.validator.dropped[DropReason.OUTLIER] += outliers
        if tracker.shift_pending or tracker.loss_pending:
            self._shifted.add((sample.src, sample.dst))
        return None

    def observe_transfer(
        self, src: str, dst: str, observed_gbps: float, now: float, expected_gbps: float | None = None
    ) -> bool:
        """A job moved data from ``src`` to ``dst`` at ``observed_gbps``; False if refused."""
        if src not in self.regions or dst not in self.regions or src == dst:
            self.transfers_refused += 1
            return False
        ok = self._tracker(src, dst).observe_transfer(now, observed_gbps, expected_gbps)
        if not ok:
            self.transfers_refused += 1
        return ok

    def tick(self, now: float) -> list[LinkEvent]:
        """Evaluate every link at ``now``, refresh the graph; the events to publish, in link order."""
        events = []
        graph = self.graph
        self._shifted.clear()
        for key in sorted(self.links):
            tracker = self.links[key]
            event = tracker.evaluate(now)
            if event is not None:
                events.append(event)
            graph.update(tracker.view(now))
        return events

    def shifted(self) -> list[tuple[str, str]]:
        """Links whose outlier filter confirmed a level shift, or whose extra probes lost some
        (``LinkTracker.loss_pending``), since their last evaluation."""
        links = self.links
        return sorted(key for key in self._shifted if links[key].shift_pending or links[key].loss_pending)

    def evaluate_shifted(self, now: float) -> list[LinkEvent]:
        """Evaluate now only the links with a newly confirmed level shift (event-driven, between
        periods: a step is reported on the sample that confirms it); their events, in link order."""
        events = []
        keys = self.shifted()
        self._shifted.clear()
        for key in keys:
            tracker = self.links[key]
            event = tracker.evaluate(now)
            if event is not None:
                events.append(event)
            self.graph.update(tracker.view(now))
        return events

    # ---- queries -------------------------------------------------------------------------------

    def _check_region(self, region: str) -> None:
        if region not in self.regions:
            raise UnknownEndpointError(f"unknown region {region!r}")

    def point_link(self, src: str, dst: str, now: float, horizon_s: float = 300.0) -> LinkPoint:
        """The link ``src -> dst`` now, and its RTT forecast ``horizon_s`` ahead."""
        self._check_region(src)
        self._check_region(dst)
        tracker = self.links.get((src, dst))
        if tracker is None:
            raise UnknownEndpointError(f"no link {src!r} -> {dst!r} is known")
        return _link_point(tracker, now, horizon_s)

    def point_region(self, region: str, now: float, horizon_s: float = 300.0) -> RegionPoint:
        """A region's links out and in, now and forecast."""
        self._check_region(region)
        ordered = sorted(self.links.items())
        return RegionPoint(
            region=region,
            outgoing=tuple(_link_point(t, now, horizon_s) for (s, _), t in ordered if s == region),
            incoming=tuple(_link_point(t, now, horizon_s) for (_, d), t in ordered if d == region),
        )

    def path(self, src: str, dst: str, now: float) -> PathAnswer:
        """The chosen path from ``src`` to ``dst`` (with hysteresis) and the momentary best."""
        self._check_region(src)
        self._check_region(dst)
        selection: Selection = self.selector.select(src, dst, now)
        return PathAnswer(src, dst, selection.path, selection.best, selection.changed, selection.reason)

    def link_states(self, now: float) -> list[LinkState]:
        """Every link's wire state, in link order."""
        return [self.links[key].link_state(now) for key in sorted(self.links)]

    # ---- persistence ---------------------------------------------------------------------------

    def records(self, now: float) -> list[LinkRecord]:
        """The learned state of every link, to persist."""
        return [self.links[key].record(now) for key in sorted(self.links)]

    def restore(self, records: Iterable[LinkRecord]) -> int:
        """Resume links from persisted records (unknown regions skipped); how many were restored."""
        restored = 0
        for record in records:
            if record.src not in self.regions or record.dst not in self.regions or record.src == record.dst:
                continue
            key = (record.src, record.dst)
            tracker = LinkTracker.from_record(record, self.link_config, self.expected.get(key))
            self.links[key] = tracker
            self.graph.update(tracker.view(record.saved_at))
            restored += 1
        return restored


def _link_point(tracker: LinkTracker, now: float, horizon_s: float) -> LinkPoint:
    view = tracker.view(now)
    return LinkPoint(
        src=tracker.src,
        dst=tracker.dst,
        cost=view.cost,
        rtt_ms=view.rtt_ms,
        jitter_ms=view.jitter_ms,
        loss_rate=view.loss_rate,
        bandwidth_gbps=view.bandwidth_gbps,
        stale=view.stale,
        degraded=view.degraded,
        usable=view.usable and math.isfinite(view.cost),
        baseline_rtt_ms=tracker.baseline_rtt_ms,
        windows=tuple(tracker.window.all_stats(now)),
        forecast_at=now + horizon_s,
        rtt_ms_forecast=tracker.forecast.predict(now + horizon_s, now),
    )

"""Failures and slowness at node scope: which runs a failed node takes down, which run is slow,
and which nodes are suspect for new placements (pure, no I/O).

* **A failed node** — its agent's heartbeat reports it ``down``, or drops it from the inventory
  while the cluster itself still heartbeats: every run with a part on it is lost there
  (:func:`runs_on_nodes`). Placement gives each up like a failed-over cluster's run (next attempt,
  the old one fenced, restarted from its best checkpoint, placed again through the framework).
* **A slow run** — its lead agent reports, with each progress report, the seconds of the job's
  clock one step took (``observed_step_s``). :class:`Pace` keeps the reports covering a window; a
  run whose mean observed step over at least ``min_reports`` reports spanning ``window_s``
  delivers less than ``slow_fraction`` (half) of its predicted step rate is slow (:meth:`Pace.slow`).
  Its nodes become suspect (:class:`SuspectNodes`: no new placements there for ``suspect_s``)
  and the migration service decides whether it moves with the benefit rule (trigger
  ``node_slow``, its step here the observed one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["Pace", "PaceSettings", "SlowRun", "SuspectNodes", "runs_on_nodes"]


def runs_on_nodes(nodes_of: Mapping[str, Iterable[str]], down: Iterable[str]) -> dict[str, str]:
    """Runs with any part on a failed node: job -> the first such node (sorted), each job once."""
    failed = sorted(set(down))
    out: dict[str, str] = {}
    for job_id, nodes in nodes_of.items():
        held = set(nodes)
        hit = next((n for n in failed if n in held), None)
        if hit is not None:
            out[job_id] = hit
    return out


@dataclass(frozen=True, slots=True)
class PaceSettings:
    """When a run counts as slow, and for how long its nodes stay suspect."""

    slow_fraction: float = 0.5
    """A run delivering less than this share of its predicted step rate is slow."""
    window_s: float = 20.0
    """Wall seconds of progress reports judged together (the oldest kept must be this old)."""
    min_reports: int = 3
    """Reports (covering the window) needed before a run is judged."""
    suspect_s: float = 600.0
    """Wall seconds a slow run's nodes stay suspect (no new placements on them)."""

    def __post_init__(self) -> None:
        if not 0 < self.slow_fraction <= 1:
            raise ValueError(f"slow_fraction must be in (0, 1], got {self.slow_fraction}")
        if self.window_s < 0 or self.suspect_s < 0:
            raise ValueError("window_s and suspect_s must be >= 0")
        if self.min_reports < 1:
            raise ValueError(f"min_reports must be >= 1, got {self.min_reports}")


@dataclass(frozen=True, slots=True)
class SlowRun:
    """A run judged slow, with the numbers."""

    job_id: str
    attempt: int
    observed_step_s: float
    """Mean observed step over the window."""
    predicted_step_s: float
    reports: int
    span_s: float

    @property
    def delivered(self) -> float:
        """The share of its predicted step rate it delivers."""
        return self.predicted_step_s / self.observed_step_s

    @property
    def reason(self) -> str:
        """In plain words."""
        return (
            f"delivers {self.delivered:.0%} of its predicted step rate (observed step "
            f"{self.observed_step_s:.3g} s vs predicted {self.predicted_step_s:.3g} s over "
            f"{self.reports} reports in {self.span_s:.0f} s)"
        )


@dataclass
class Pace:
    """The recent progress reports of each run (one owner; not thread-safe)."""

    settings: PaceSettings = field(default_factory=PaceSettings)
    _reports: dict[tuple[str, int], deque[tuple[float, float]]] = field(default_factory=dict)
    _resized: dict[str, float] = field(default_factory=dict)
    """Job -> when its workers last changed: reports up to the first one after it are passed over."""

    def record(self, job_id: str, attempt: int, at_s: float, observed_step_s: float) -> None:
        """One progress report's observed step (reports of an earlier attempt are dropped, a report
        not newer than the run's latest is a repeat)."""
        if observed_step_s <= 0:
            return
        resized = self._resized.get(job_id)
        if resized is not None:
            if at_s <= resized:
                return  # measured at the old worker count
            # The first report after the change averages steps from both sides of it: passed over,
            # the next ones are all at the new count.
            del self._resized[job_id]
            return
        for key in [k for k in self._reports if k[0] == job_id and k[1] != attempt]:
            if key[1] < attempt:
                del self._reports[key]
            else:
                return  # a late report of an attempt that has moved on
        reports = self._reports.setdefault((job_id, attempt), deque())
        if reports and at_s <= reports[-1][0]:
            return  # a redelivered (or reordered) report: counted once
        reports.append((at_s, observed_step_s))
        # Keep one report older than the window, so a window's span can be judged complete.
        while len(reports) > 2 and reports[1][0] <= at_s - self.settings.window_s:
            reports.popleft()

    def slow(self, job_id: str, attempt: int, predicted_step_s: float | None, now_s: float) -> SlowRun | None:
        """The run's verdict: slow (with the numbers) or None (fast enough, too few reports, a
        window not yet covered, or no prediction to compare with)."""
        reports = self._reports.get((job_id, attempt))
        if not reports or not predicted_step_s or predicted_step_s <= 0:
            return None
        s = self.settings
        # The kept reports cover the window (one is at or before its start, see record).
        span_s = now_s - reports[0][0]
        if len(reports) < s.min_reports or span_s < s.window_s:
            return None
        observed = sum(step_s for _, step_s in reports) / len(reports)
        if predicted_step_s / observed >= s.slow_fraction:
            return None
        return SlowRun(job_id, attempt, observed, predicted_step_s, len(reports), span_s)

    def forget(self, job_id: str) -> None:
        """The run ended or moved: drop its reports."""
        for key in [k for k in self._reports if k[0] == job_id]:
            del self._reports[key]
        self._resized.pop(job_id, None)

    def resized(self, job_id: str, at_s: float) -> None:
        """The run's workers changed at ``at_s`` (an elastic job grown or shrunk): its step time
        changes with them, so the reports before are dropped and the window starts again. The
        verdict compared a mean over both worker counts with the new count's prediction: a job
        grown from 2 to 8 workers "delivered 41 %" at exactly its predicted step, and its nodes
        (a whole pool) were closed to new work for 10 minutes (a newcomer's walk)."""
        for key in [k for k in self._reports if k[0] == job_id]:
            del self._reports[key]
        self._resized[job_id] = at_s


@dataclass
class SuspectNodes:
    """Nodes closed to new placements until a time, and why (one owner)."""

    until: dict[str, float] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def mark(self, nodes: Iterable[str], until_s: float, why: str) -> list[str]:
        """Suspect these nodes until ``until_s`` (extending, never shortening); the newly suspect."""
        new = []
        for node in nodes:
            if node not in self.until:
                new.append(node)
            self.until[node] = max(self.until.get(node, 0.0), until_s)
            self.why[node] = why
        return new

    def active(self, now_s: float) -> frozenset[str]:
        """The nodes suspect now (those whose time ran out are forgotten)."""
        for node in [n for n, t in self.until.items() if t <= now_s]:
            del self.until[node]
            self.why.pop(node, None)
        return frozenset(self.until)

"""Probe intensity follows use: the links running jobs depend on are probed densely, within a budget.

A link losing 3 % must be seen, and its jobs moved, within 3 probe periods (issue 15). The loss
rule's sequential test (:func:`loom.net.linkstate.loss_evidence`, ``cusum_h``) needs about 970
probes of a 3 % link on average (1,700 at p95) to tell it from one losing the 1 % threshold with
about 0.01 false alarms per link-hour at 0.9 %; a lost probe counts only at its
deadline, and the verdict must then be published and reviewed, so they must be sent within the
first period or so: a thousand probes a period, where the steady rate is 5. Doing that on every
link would cost the platform at rest what it cannot pay, so only a link **in use** gets them:

* **in use**: a running job's parts span the link's two regions (a cross-region gang, a
  pipeline): :func:`links_in_use` turns the regions of each running job into directed links
  (both directions: a collector probes its outgoing links, and a job's traffic crosses both);
* **rate**: ``probes_per_period`` extra probes a period on each link in use, sent in equal shares
  at the period's send ticks (no wake-up of their own), at most ``max_per_tick`` a tick;
* **budget**: at most ``budget_per_s`` extra probes a second over all of one collector's links in
  use, shared evenly (:func:`dense_plan`): the cost under load is bounded whatever the jobs do,
  and nothing at all is spent while no job spans a link;
* **deadline**: an extra probe unanswered ``overdue_rtts`` smoothed RTTs after it was sent (at
  least ``overdue_min_s``, at most the probe timeout) is lost (:func:`dense_overdue_s`): six RTTs
  and not three, because a probe delayed by a spike (2-5x in the noise model) must not count lost.

The extra probes are reported as the loss bursts' are (counts only, one sample per send tick),
so network perception folds them into the same windows under the same rule; a link probed densely
needs no loss burst. Nothing here knows sockets or clocks.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["UseConfig", "dense_overdue_s", "dense_plan", "links_in_use"]


@dataclass(frozen=True, slots=True)
class UseConfig:
    """How hard a collector probes the links in use; the defaults suit 5 send ticks a 1 s period."""

    enabled: bool = True
    probes_per_period: int = 1200
    """Extra probes a period on one link in use: the sequential test needs about 970 probes on
    average at 3 % (1,700 at p95) to tell it from the 1 % threshold, within about 0.8 periods
    (at 600 a period, 3 % was decided within 3 periods in only 59-76 of 100 model trials)."""
    max_per_tick: int = 240
    """Extra probes sent back to back on one link at one tick (a probed echo socket's buffer
    holds a few hundred; 600 at once lost 83 in the collector's test)."""
    budget_per_s: float = 1200.0
    """Extra probes a second over all links in use of one collector, shared evenly: one link at
    the full rate, two at 600 a period each."""
    overdue_rtts: float = 6.0
    """An extra probe is lost when unanswered this many smoothed RTTs after it was sent ..."""
    overdue_min_s: float = 0.5
    """... and at least this long."""


def links_in_use(spans: Iterable[Sequence[str]]) -> dict[tuple[str, str], int]:
    """The directed links between the regions of each running job's parts (``spans``: one
    sequence of regions a job), both directions, with how many jobs span each; a job in one
    region uses no link."""
    links: dict[tuple[str, str], int] = {}
    for regions in spans:
        distinct = sorted(set(regions))
        for i, src in enumerate(distinct):
            for dst in distinct[i + 1 :]:
                for key in ((src, dst), (dst, src)):
                    links[key] = links.get(key, 0) + 1
    return links


def dense_plan(
    used: Iterable[str], config: UseConfig, period_s: float, limits: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Extra probes to send this period on each link in ``used`` (a collector's links by peer):
    ``probes_per_period`` each, less where the collector's budget (``budget_per_s`` × the period)
    shared evenly among them gives less, and at most ``limits[link]`` (what the collector can
    send on it in a period). Links with none are left out."""
    keys = sorted(set(used))
    if not config.enabled or not keys or period_s <= 0:
        return {}
    budget = int(config.budget_per_s * period_s)
    share = min(config.probes_per_period, budget // len(keys))
    plan = {}
    for key in keys:
        count = share if limits is None else min(share, limits.get(key, share))
        if count > 0:
            plan[key] = count
    return plan


def dense_overdue_s(srtt_ms: float | None, config: UseConfig, timeout_s: float) -> float:
    """How long an extra probe may go unanswered before it is lost: ``overdue_rtts`` smoothed RTTs
    (the probe timeout while the link has no RTT yet), at least ``overdue_min_s``, at most ``timeout_s``."""
    wait = timeout_s if srtt_ms is None else config.overdue_rtts * srtt_ms / 1000.0
    return min(max(wait, config.overdue_min_s), timeout_s) if math.isfinite(wait) else timeout_s

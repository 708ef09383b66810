"""Suspicion-triggered burst probing: when a link may be lossy, probe it harder for a moment.

At ``probes_per_period`` steady probes a link losing 3 % cannot be told from one losing 1 %
for tens of periods (network perception's loss rule, :func:`loom.net.linkstate.loss_evidence`,
needs hundreds of probes). Raising the steady rate costs CPU on every link at rest, so a
collector instead sends a bounded **burst** of extra probes on one link when it has reason:

* **trigger**: a probe of the link was lost since the last period, or the link's loss window
  reads at least ``degrade_loss`` without being significant yet; never while the window is
  already significant (the verdict is in), in a cool-down, or without budget; after an episode
  that found nothing, a single lost probe waits out a back-off that doubles with each such
  episode in a row (``backoff_s`` .. ``backoff_max_s``), so a link with a small loss of its own
  does not burst on every probe it loses (a window at twice ``degrade_loss`` does not wait);
* **size**: each period the burst sends what the loss rule still needs: the fewest extra probes
  ``m`` such that, were the link losing ``target_loss``, the window with them (and with the
  burst probes still in flight) would be significant with ``power_z`` standard deviations to
  spare (:func:`probes_needed`), spread over ``spread_periods``; on a link whose last burst
  found nothing, first only enough to find nothing again (:meth:`LinkBurst.clear_probes`);
* **end**, as soon as the verdict is clear either way: *bad* when the loss rule holds on the
  collector's own copy of the window (the same function network perception applies; its
  window gets the same probes a moment later), *good* when the burst's own probes (those overdue
  counted lost) would show so few losses with probability below ``clear_beta`` were the link
  losing ``clear_loss`` (:func:`binomial_head`), and *capped* at ``max_per_episode`` probes;
  then a ``cooldown_s`` before the link can burst again;
* **limits**: ``max_per_period`` probes a period per link (and what the collector can send on
  it, ``limits``), a token bucket per link (``budget_per_s`` probes a second on average,
  ``max_per_episode`` at most at once) and ``max_per_collector_period`` per collector, shared
  evenly among the links being probed that want more;
* **hold**: no episode starts in a period the collector marks as lagging (its loop stalled, so
  probe timers fired late and answers still in the socket counted lost), nor on any link when
  most of the links (two at least) lost a steady probe since the last period: that is the
  collector's host, not a link.

The burst's probes are ordinary probes: their results go into the same loss window and the same
significance rule on network perception's side, weighed by their sent / lost counts (the
collector reports each period's burst probes of a link as one sample). Nothing here knows about
sockets or clocks: the collector (and ``loom_benchmarks.net_shift``, which models it) calls
:meth:`BurstPlanner.plan` once a period, :meth:`BurstPlanner.on_sent` for the burst probes it
sent and :meth:`BurstPlanner.on_result` for every probe result, and passes the time in.
"""

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from loom.net.linkstate import LinkConfig, LossEvidence, binomial_tail, loss_evidence
from loom.net.samples import TokenBucket
from loom.net.window import LinkWindow

__all__ = [
    "BURST_PROBE",
    "BurstConfig",
    "BurstPlanner",
    "LinkBurst",
    "binomial_head",
    "probes_needed",
]

BURST_PROBE = "udp_burst"
"""The probe kind of a burst's samples: network perception takes their probe counts, not their RTTs."""

DESIGN_PERIOD_S = 1.0
"""The probe period the defaults are tuned for."""

EndReason = Literal["bad", "good", "capped"]


@dataclass(frozen=True, slots=True)
class BurstConfig:
    """When, how hard and how often a collector bursts on a link; the defaults suit 5 probes a 1 s period."""

    enabled: bool = True
    target_loss: float = 0.03
    """The loss a burst is sized to show."""
    power_z: float = 1.0
    """The burst is sized so that ``target_loss`` would be significant with this many standard
    deviations of the lost count to spare (1.0: about 84 % of the time)."""
    spread_periods: float = 1.0
    """What the rule still needs is sent over this many periods (its losses show only at the probe
    timeout, two periods later: sending it at once gives the verdict soonest)."""
    max_per_period: int = 600
    """Burst probes a period on one link."""
    max_per_episode: int = 1500
    """Burst probes of one episode; also the size of a link's token bucket."""
    budget_per_s: float = 1.0
    """A link's token bucket refills at this many burst probes a second (a fifth of the steady
    rate): a link that keeps raising suspicion is throttled to it."""
    max_per_collector_period: int = 1200
    """Burst probes a period over all links of one collector."""
    cooldown_s: float = 10.0
    """After an episode ends, the link does not burst again for this long."""
    backoff_s: float = 30.0
    """After an episode that ends *good*, a single lost probe does not start another for this
    long, doubled for each such episode in a row (a link whose own loss is a steady 0.1 % loses a
    probe every few minutes), at most ``backoff_max_s``; a window at twice ``degrade_loss`` still does."""
    backoff_max_s: float = 600.0
    """The longest back-off; a link that lost no probe for this long starts afresh."""
    clear_beta: float = 0.01
    """An episode ends as *good* when its probes would show this few losses with at most this
    probability were the link losing ``clear_loss``."""
    clear_loss: float = 0.02
    """The loss an episode must rule out to end *good* (twice ``degrade_loss``: a link losing 2 %
    should not be let go as healthy; ruling out only ``target_loss`` let a fifth of them go)."""
    min_tokens: int = 100
    """An episode starts only with at least this many tokens."""
    link: LinkConfig = field(default_factory=LinkConfig)
    """Network perception's link configuration: the loss rule's windows and thresholds."""

    def for_period(self, period_s: float) -> "BurstConfig":
        """The same policy for probe periods of ``period_s`` (the defaults are for 1 s): every
        time constant, the loss rule's windows among them, keeps its length in periods, as
        network perception scales its own (``configs_for_period``)."""
        f = period_s / DESIGN_PERIOD_S
        if f == 1.0:
            return self
        link = replace(
            self.link,
            horizons_s=tuple(h * f for h in self.link.horizons_s),
            loss_horizon_s=self.link.loss_horizon_s * f,
        )
        return replace(
            self,
            budget_per_s=self.budget_per_s / f,
            cooldown_s=self.cooldown_s * f,
            backoff_s=self.backoff_s * f,
            backoff_max_s=self.backoff_max_s * f,
            link=link,
        )


def binomial_head(lost: int, probes: int, rate: float) -> float:
    """P(at most ``lost`` of ``probes`` probes lost) when each is lost with probability ``rate``."""
    if lost < 0:
        return 0.0
    if lost >= probes or rate <= 0.0:
        return 1.0
    if rate >= 1.0:
        return 0.0
    log_p, log_q = math.log(rate), math.log1p(-rate)
    log_n = math.lgamma(probes + 1)
    total = 0.0
    for i in range(lost + 1):
        total += math.exp(
            log_n - math.lgamma(i + 1) - math.lgamma(probes - i + 1) + i * log_p + (probes - i) * log_q
        )
    return min(total, 1.0)


def probes_needed(sent: int, lost: float, config: BurstConfig, limit: int) -> int:
    """The fewest extra probes (at most ``limit``; ``limit`` if even that is not enough) after
    which a window of ``sent`` probes, ``lost`` of them lost (expected losses of probes in flight
    included), would be significant and at least ``degrade_loss`` under network perception's
    rule, were the extra probes lost at ``target_loss`` with ``power_z`` standard deviations to spare."""
    link = config.link
    p = config.target_loss

    def enough(m: int) -> bool:
        n = sent + m
        k = math.floor(lost + p * m - config.power_z * math.sqrt(p * (1.0 - p) * m))
        return (
            n >= link.short_loss_probes
            and k >= 1
            and k >= link.degrade_loss * n
            and binomial_tail(k, n, link.null_loss) < link.loss_alpha
        )

    if enough(0):
        return 0
    if not enough(limit):
        return limit
    low, high = 0, limit  # not enough at low, enough at high (enough is monotone in practice)
    while high - low > 1:
        middle = (low + high) // 2
        if enough(middle):
            high = middle
        else:
            low = middle
    return high


class _Batch:
    """One period's burst probes of a link: network perception gets them as one sample."""

    __slots__ = ("count", "done", "first_at", "last_at", "lost", "open")

    def __init__(self, at: float) -> None:
        self.first_at = self.last_at = at
        self.count = self.done = self.lost = 0
        self.open = True

    def pending(self) -> int:
        return self.count - self.done


class LinkBurst:
    """The burst state of one link: a copy of its loss window, the episode, the budget.

    The copy gets what network perception gets: the steady probes' results as they come, and
    each period's burst probes as one row once all of them are answered or timed out."""

    def __init__(self, config: BurstConfig, now: float) -> None:
        self.config = config
        link = config.link
        self.window = LinkWindow(link.horizons_s)
        self.bucket = TokenBucket(
            config.budget_per_s, float(config.max_per_episode), float(config.max_per_episode), now
        )
        self._rows: list[tuple[int, int]] = []
        """Results not yet in the window: (sent, lost)."""
        self._steady = [0, 0]
        self.new_loss = False
        self.last_loss_at: float | None = None
        self.lost_run = 0
        self.since: float | None = None
        """As network perception's ``loss_since``: the window restarts after an outage."""
        self.active = False
        self.started_at = 0.0
        self.periods = 0
        self.cooldown_until = -math.inf
        self.backoff_until = -math.inf
        self.goods = 0
        """Episodes in a row that ended *good* (the back-off's exponent)."""
        self.episode_sent = 0
        self.episode_done = [0, 0]
        """The episode's burst probes of completed batches: (sent, lost)."""
        self.batches: list[_Batch] = []
        """Burst batches not yet complete, oldest first."""
        self.episodes = 0
        self.ends: dict[str, int] = {"bad": 0, "good": 0, "capped": 0}
        self.probes = 0
        """Burst probes sent in all."""

    # ---- input ---------------------------------------------------------------------------------

    def on_result(self, now: float, lost: bool, burst: bool = False, sent_at: float | None = None) -> None:
        """One probe result (steady or burst) completed at ``now``; a burst probe's ``sent_at``
        (on the clock of :meth:`on_sent`, no earlier than its batch's first send) ties it to its batch."""
        if lost:
            self.new_loss = True
            self.last_loss_at = now
            self.lost_run += 1
        else:
            if self.lost_run >= self.config.link.outage_probes:
                self.since = now  # an outage ended: as network perception, the window restarts
            self.lost_run = 0
        if not burst:
            self._steady[0] += 1
            self._steady[1] += lost
            return
        batches = self.batches
        if sent_at is None or not batches:
            return
        index = bisect.bisect_right(batches, sent_at, key=lambda b: b.first_at) - 1
        batch = batches[max(index, 0)]
        batch.done += 1
        batch.lost += lost
        while batches and not batches[0].open and batches[0].done >= batches[0].count:
            self._complete(batches.pop(0))

    def _complete(self, batch: _Batch) -> None:
        self._rows.append((batch.count, batch.lost))
        if self.active and batch.first_at >= self.started_at:
            self.episode_done[0] += batch.count
            self.episode_done[1] += batch.lost

    def on_sent(self, now: float, count: int) -> None:
        """``count`` burst probes went out at ``now`` (taken before they were sent)."""
        if count <= 0:
            return
        self.probes += count
        batches = self.batches
        if not batches or not batches[-1].open:
            batches.append(_Batch(now))
        batch = batches[-1]
        batch.count += count
        batch.last_at = now
        if self.active:
            self.episode_sent += count

    def _seal(self) -> None:
        batches = self.batches
        if batches and batches[-1].open:
            batches[-1].open = False
        while batches and batches[0].done >= batches[0].count:
            self._complete(batches.pop(0))

    def _episode_batches(self) -> list[_Batch]:
        return [b for b in self.batches if b.first_at >= self.started_at]

    def clear_evidence(self, cut: float) -> tuple[int, int]:
        """The episode's burst probes of batches begun before ``cut``, and how many of them
        were lost or are still unanswered (counted lost: at worst the episode goes on a little longer)."""
        sent, lost = self.episode_done
        for batch in self._episode_batches():
            if batch.first_at < cut:
                sent += batch.count
                lost += batch.lost + batch.pending()
        return sent, lost

    # ---- per period ----------------------------------------------------------------------------

    def steady_lost(self) -> int:
        """Steady probes lost since the last period."""
        return self._steady[1]

    def want(self, now: float, overdue_s: float, hold: bool = False, limit: int | None = None) -> int:
        """Burst probes this link asks for in the period starting at ``now`` (before the
        collector's cap); starts and ends episodes. ``overdue_s``: a burst probe unanswered this
        long counts as lost when deciding whether the loss is clearly low, and when sizing the burst.
        ``hold``: start no episode this period (one going on goes on); ``limit``: at most this many
        (what the collector can send on the link in a period)."""
        config = self.config
        link = config.link
        new_loss = self._flush(now)
        if not config.enabled:
            return 0
        last_loss = self.last_loss_at
        if last_loss is None or now - last_loss > config.backoff_max_s:
            self.goods = 0
        quiet = last_loss is None or now - last_loss > link.loss_horizon_s
        if quiet and not self.active:
            return 0  # at rest: no loss in the window, nothing to look at
        evidence = loss_evidence(self.window, now, link, self.since)
        if self.active:
            self.periods += 1
            if evidence.degrading(link):
                return self._end(now, "bad")
            done, lost = self.clear_evidence(now - overdue_s)
            if done and binomial_head(lost, done, config.clear_loss) < config.clear_beta:
                return self._end(now, "good")
            if self.episode_sent >= config.max_per_episode:
                return self._end(now, "capped")
        elif hold or not self._start(now, evidence, new_loss):
            return 0
        remaining = config.max_per_episode - self.episode_sent
        needed = self._needed(evidence.long.sent, evidence.long.lost, now - overdue_s, remaining)
        if self.goods and not self.episode_sent:
            # Episodes here lately found nothing: first just enough to find nothing again.
            needed = min(needed, self.clear_probes())
        if needed <= 0:
            return 0  # what is in flight should do: wait for it
        spread = max(config.spread_periods - self.periods, 1.0)
        cap = config.max_per_period if limit is None else min(limit, config.max_per_period)
        return min(math.ceil(needed / spread), cap, remaining)

    def clear_probes(self) -> int:
        """Burst probes that end an episode *good* when none of them is lost."""
        config = self.config
        return math.ceil(math.log(config.clear_beta) / math.log1p(-config.clear_loss))

    def _flush(self, now: float) -> bool:
        """Move the results since the last period into the window; whether a probe was lost."""
        self._seal()
        steady = self._steady
        if steady[0]:
            self._rows.insert(0, (steady[0], steady[1]))
            self._steady = [0, 0]
        for sent, lost in self._rows:
            self.window.add_probes(now, sent, lost)
        self._rows = []
        new_loss, self.new_loss = self.new_loss, False
        return new_loss

    def _start(self, now: float, evidence: LossEvidence, new_loss: bool) -> bool:
        """Start an episode if the link is suspect, not cooling down, and has the budget."""
        config = self.config
        link = config.link
        if now < self.cooldown_until or evidence.degrading(link):
            return False
        # A lost probe, or a window reading at least the degrade threshold: suspect once the
        # back-off is over; a window reading twice that (strong suspicion) at any time.
        rate = evidence.long.loss_rate if evidence.long.sent >= link.short_loss_probes else 0.0
        backed_off = now >= self.backoff_until
        suspect = rate >= 2.0 * link.degrade_loss or (backed_off and (new_loss or rate >= link.degrade_loss))
        if not suspect or self._tokens(now) < config.min_tokens:
            return False
        self.active = True
        self.started_at = now
        self.periods = 0
        self.episode_sent = 0
        self.episode_done = [0, 0]
        self.episodes += 1
        return True

    def _needed(self, sent: int, lost: int, cut: float, limit: int) -> int:
        """Burst probes the loss rule still needs to show ``target_loss`` on the window with
        every batch in flight: probes without an answer count as lost once their batch is older
        than ``cut`` (the answers would be back), at ``target_loss`` before."""
        config = self.config
        p = config.target_loss
        total_sent, total_lost = float(sent), float(lost)
        for batch in self.batches:
            total_sent += batch.count
            total_lost += batch.lost + (batch.pending() if batch.first_at < cut else p * batch.pending())
        return probes_needed(int(total_sent), total_lost, config, limit)

    def grant(self, now: float, count: int) -> int:
        """Take up to ``count`` tokens; how many burst probes the link may send this period."""
        if count <= 0:
            return 0
        granted = min(count, int(self._tokens(now)))
        self.bucket.tokens -= granted
        return granted

    def _tokens(self, now: float) -> float:
        self.bucket.take(now, 0.0)  # refills
        return self.bucket.tokens

    def _end(self, now: float, reason: EndReason) -> int:
        config = self.config
        self.active = False
        self.cooldown_until = now + config.cooldown_s
        if reason == "good":
            self.goods += 1
            hold = min(config.backoff_s * 2.0 ** (self.goods - 1), config.backoff_max_s)
            self.backoff_until = now + max(hold, config.cooldown_s)
        else:
            self.goods = 0
            self.backoff_until = self.cooldown_until
        self.ends[reason] += 1
        return 0


class BurstPlanner:
    """The burst policy of one collector: a :class:`LinkBurst` per link, the collector's cap."""

    def __init__(self, config: BurstConfig | None = None) -> None:
        self.config = config or BurstConfig()
        self.links: dict[str, LinkBurst] = {}
        self.retired: dict[str, int] = dict.fromkeys(_TOTALS, 0)
        """The totals of the links forgotten by :meth:`reset` (counts never go backwards)."""
        self.held = 0
        """Periods in which episodes were held (:meth:`plan`'s ``lagging``, or most links lost a probe)."""

    def link(self, key: str, now: float) -> LinkBurst:
        """The burst state of link ``key`` (created on first use)."""
        state = self.links.get(key)
        if state is None:
            state = self.links[key] = LinkBurst(self.config, now)
        return state

    def reset(self, key: str) -> None:
        """Forget link ``key`` (its prober was replaced: probes in flight will not come back);
        its episodes and probes stay in :meth:`counts`."""
        state = self.links.pop(key, None)
        if state is not None:
            for name, value in _link_totals(state).items():
                self.retired[name] += value

    def on_result(
        self, key: str, now: float, lost: bool, burst: bool = False, sent_at: float | None = None
    ) -> None:
        """A probe result of link ``key``."""
        self.link(key, now).on_result(now, lost, burst, sent_at)

    def on_sent(self, key: str, now: float, count: int) -> None:
        """Burst probes sent on link ``key``."""
        self.link(key, now).on_sent(now, count)

    def plan(
        self,
        now: float,
        overdue_s: dict[str, float] | float,
        *,
        lagging: bool = False,
        limits: dict[str, int] | None = None,
    ) -> dict[str, int]:
        """Burst probes to send on each link in the period starting at ``now`` (links with none
        left out). ``overdue_s``: per link being probed (only those are planned), or one for all
        links, when an unanswered probe counts as lost. ``lagging``: the collector's loop lagged
        since the last period (probe timers fired late): no episode starts. ``limits``: per link,
        the most burst probes the collector can send on it in a period."""
        if isinstance(overdue_s, int | float):
            keys = sorted(self.links)
        else:
            keys = sorted(key for key in overdue_s if key in self.links)
        # Most links losing a probe in the same period: the collector's host, not the links.
        lost = sum(1 for key in keys if self.links[key].steady_lost())
        hold = lagging or (lost >= 2 and 2 * lost > len(keys))
        self.held += hold
        wants: dict[str, int] = {}
        for key in keys:
            wait = overdue_s if isinstance(overdue_s, int | float) else overdue_s[key]
            limit = None if limits is None else limits.get(key)
            want = self.links[key].want(now, wait, hold, limit)
            if want > 0:
                wants[key] = want
        if not wants:
            return {}
        shares = _share(wants, self.config.max_per_collector_period)
        granted = {key: self.links[key].grant(now, n) for key, n in shares.items()}
        return {key: n for key, n in granted.items() if n > 0}

    def counts(self) -> dict[str, int]:
        """Episodes, how they ended, burst probes sent: over all links, those forgotten by
        :meth:`reset` included (these never go backwards); episodes going on now; periods held."""
        out = dict(self.retired)
        for state in self.links.values():
            for name, value in _link_totals(state).items():
                out[name] += value
        out["burst_active"] = sum(s.active for s in self.links.values())
        out["burst_held"] = self.held
        return out


_TOTALS = ("burst_episodes", "burst_probes", "burst_ended_bad", "burst_ended_good", "burst_ended_capped")


def _link_totals(state: LinkBurst) -> dict[str, int]:
    return {
        "burst_episodes": state.episodes,
        "burst_probes": state.probes,
        **{f"burst_ended_{reason}": state.ends[reason] for reason in ("bad", "good", "capped")},
    }


def _share(wants: dict[str, int], cap: int) -> dict[str, int]:
    """Split ``cap`` among the wants: each gets what it asks or an equal share of what is left."""
    if sum(wants.values()) <= cap:
        return dict(wants)
    out: dict[str, int] = {}
    left = cap
    pending = sorted(wants, key=lambda key: (wants[key], key))
    while pending:
        share = left // len(pending)
        key = pending[0]
        if wants[key] <= share:
            out[key] = wants[key]
            left -= wants[key]
            pending.pop(0)
            continue
        for i, key in enumerate(pending):
            out[key] = share + (1 if i < left - share * len(pending) else 0)
        break
    return out

"""How fast a degraded link is seen, and how often a healthy one is taken for degraded.

``python -m loom_benchmarks.net_shift [--json]``: a discrete-event model of the chain from an
emulator change to the migration decision, on a simulated clock, through the real code of each
stage: the probe collector's rounds (:class:`loom_services.probe_collector.collector.RoundBuilder`),
network perception's core (:class:`loom.net.Perception`: admission, outlier filter, windows,
per-period ticks and, when enabled, the event-driven evaluation of a link on the sample that
confirms a shift), then the migration service's ``review_delay_s`` and a what-if answer time.

* **timing**: probes every ``period / 5`` at the link's RTT (normal, its measured deviation); at a
  random phase the RTT becomes ``factor`` times the base; the first probe sent after the change
  sees it. Reported per stage in probe periods: change → first sample showing it (published),
  → degraded event, → decision.
* **false positives**: every measured link of ``data/region_rtt_ms.csv`` (min/avg/max/mdev of
  real pings) for ``periods`` periods: RTT ~ N(avg, mdev) clipped to [min, max], plus 1 % (and
  10 %, a harsh case) of probes spiking 2-5x (the noise model of ``loom bench net``); the truth
  never degrades, so every degraded event (and every confirmed level shift) is a false positive.

Options: ``--factors`` (RTT factors of the change, default 5), ``--losses`` (a change that loses
that share of the probes instead; its lost probes come at the collector's probe timeout),
``--base-losses`` (healthy links' own probe loss in the false-positive runs), ``--probes``
(probes per period), ``--chains``; the loss rule's ``--cusum-h`` and ``--null-loss`` and a link in
use's ``--dense-probes`` (extra probes a period), to compare settings without editing defaults.

``before`` is the chain as it was (rounds of 5 only, 3 suspects for any shift, evaluation at
the tick, review 0.3 s); ``steady`` the current defaults without loss bursts; ``after`` the
current defaults: the collector's burst policy (:class:`loom.net.burst.BurstPlanner`, the same
code) sends extra probes on a link it suspects of loss, at most ``burst_max_per_tick`` a send
tick of the period it plans them (a WAN link: no bandwidth cap), their results as one
``udp_burst`` sample per period (:class:`~loom_services.probe_collector.collector.BurstRounds`).
Loss trials also report the periods from the change to the first lost probe sent, and from it
to the event; false-positive runs the burst probes per link-hour (and over the steady probes) and
how the bursts ended.
"""

import argparse
import csv
import heapq
import json
import math
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loom.net import Expected, LinkConfig, Perception
from loom.net.burst import BurstPlanner
from loom.net.intensity import UseConfig, dense_overdue_s, dense_plan
from loom.net.outliers import OutlierConfig
from loom.netemu.probes import ProbeResult
from loom_proto.net import ProbeSample
from loom_services.probe_collector.collector import BurstRounds, CollectorConfig, RoundBuilder, round_sample

T0 = 1_767_225_600.0
PROBES = 5
WHATIF_S = 0.18
"""Placement's what-if and the verdict's write, measured on the real stack (decision 0.47-0.49 s
after the event with a 0.3 s review delay)."""
DATA = Path(__file__).resolve().parent / "data" / "region_rtt_ms.csv"
"""Every measured link's ping spread (packaged: ``data/README.md``; the shared WAN data, verbatim)."""
LINK = LinkConfig()
"""The loss rule network perception and the burst planner run (``--cusum-h``, ``--null-loss``)."""
USE = UseConfig()
"""How hard a link in use is probed (``--dense-probes``)."""


def _collector() -> CollectorConfig:
    """The collector's defaults with the model's :data:`LINK` and :data:`USE`."""
    collector = CollectorConfig()
    return replace(collector, use=USE, burst=replace(collector.burst, link=LINK))


@dataclass(frozen=True)
class Chain:
    """One version of the chain."""

    name: str
    shift_probes: int
    confirm_large: int
    event_driven: bool
    review_delay_s: float
    shift_ratio: float = 0.0
    """The collector's ratio for a shift within a round (0: its default)."""
    burst: bool = False
    """The collector bursts extra probes on a link it suspects of loss (:mod:`loom.net.burst`)."""
    dense: bool = False
    """The link is in use: the collector sends it ``UseConfig.probes_per_period`` extra probes a
    period at its send ticks (:mod:`loom.net.intensity`; a link in use gets no loss bursts)."""


BEFORE = Chain("before", shift_probes=0, confirm_large=3, event_driven=False, review_delay_s=0.3)
STEADY = Chain(
    "steady",
    shift_probes=CollectorConfig().shift_probes,
    confirm_large=OutlierConfig().confirm_large,
    event_driven=True,
    review_delay_s=0.1,
)
"""The chain before burst probing: only the steady probes."""
AFTER = replace(STEADY, name="after", burst=CollectorConfig().burst.enabled)
USED = replace(STEADY, name="used", dense=CollectorConfig().use.enabled)
"""A link in use (a running job spans it): densely probed, no bursts."""
CHAINS = {chain.name: chain for chain in (BEFORE, STEADY, AFTER, USED)}
BURST_SEQ = 10**9
"""Burst probes are numbered from here (the collector's share one counter; only order matters)."""
DENSE_SEQ = 2 * 10**9
"""... and the dense probes of a link in use from here."""


def _perception(chain: Chain, rtt_ms: float, mdev_ms: float) -> Perception:
    config = LINK
    config = replace(config, outliers=replace(config.outliers, confirm_large=chain.confirm_large))
    return Perception(["a", "b"], expected={("a", "b"): Expected(rtt_ms, mdev_ms)}, link_config=config)


def _simulate(  # noqa: PLR0912, PLR0915 (one event loop, its branches are the stages)
    chain: Chain,
    rng: random.Random,
    *,
    period_s: float,
    base_ms: float,
    mdev_ms: float,
    periods: int,
    change_at: float | None,
    factor: float,
    spikes: float = 0.0,
    low_ms: float = 0.0,
    high_ms: float = float("inf"),
    loss: float = 0.0,
    base_loss: float = 0.0,
) -> dict[str, Any]:
    """Run one link; the times (from the start) of the first shifted sample, the first event.

    ``loss``: from the change on, each probe is lost with this probability (the emulator's
    ``--loss``: forward direction only); a lost probe's result comes ``probe_timeout_s`` after
    it was sent, as the collector's. ``base_loss``: the probes' loss before (and under) it."""
    perception = _perception(chain, base_ms, mdev_ms)
    collector = _collector()
    rounds = RoundBuilder("a", "b", PROBES, chain.shift_ratio or collector.shift_ratio, chain.shift_probes)
    bursts = BurstRounds("a", "b")
    planner = BurstPlanner(collector.burst) if chain.burst else None
    dense = BurstRounds("a", "b")
    dense_per_tick = 0
    if chain.dense:
        planned = dense_plan(["b"], collector.use, period_s).get("b", 0)
        dense_per_tick = min(math.ceil(planned / PROBES), collector.use.max_per_tick)
    # As the collector, from the link's smoothed RTT (here its base).
    dense_overdue = dense_overdue_s(base_ms, collector.use, collector.probe_timeout_s)
    overdue_s = min(
        max(collector.burst_overdue_rtts * base_ms / 1000.0, collector.burst_overdue_min_s),
        collector.probe_timeout_s,
    )
    interval = period_s / PROBES
    linger = period_s / 10
    tick_phase = rng.random() * period_s
    events: list[tuple[float, int, str, Any]] = []
    order = 0

    def push(at: float, kind: str, what: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, what))

    def probe(seq: int, sent: float, kind: str, timeout_s: float = collector.probe_timeout_s) -> bool:
        """Send one probe at ``sent``: its result comes back as an event; whether it is lost
        (or answered after ``timeout_s``: counted lost then)."""
        level = base_ms * (factor if change_at is not None and sent >= change_at else 1.0)
        rtt = min(max(rng.gauss(level, mdev_ms * (level / base_ms)), low_ms * level / base_ms), high_ms)
        if spikes and rng.random() < spikes:
            rtt *= rng.uniform(2.0, 5.0)
        lost = base_loss + (loss if change_at is not None and sent >= change_at else 0.0)
        if (lost and rng.random() < lost) or rtt / 1000.0 > timeout_s:
            push(sent + timeout_s, kind, ProbeResult(seq=seq, sent_at=T0 + sent, rtt_ms=None))
            return True
        push(sent + rtt / 1000.0, kind, ProbeResult(seq=seq, sent_at=T0 + sent, rtt_ms=rtt))
        return False

    end = periods * period_s
    first_loss: float | None = None
    for i in range(int(end / interval)):
        sent = i * interval
        if probe(i, sent, "result") and first_loss is None and change_at is not None and sent >= change_at:
            first_loss = sent
    if planner is not None:
        for k in range(periods):
            push(k * period_s, "period", None)
    burst_seq = BURST_SEQ
    dense_seq = DENSE_SEQ
    dense_probes = 0
    if dense_per_tick:
        for i in range(int(end / interval)):
            push(i * interval, "dense", dense_per_tick)
    tick = tick_phase
    while tick < end + period_s:
        push(tick, "tick", None)
        tick += period_s
    first_sample: float | None = None
    degraded: list[float] = []
    shifts = 0
    while events:
        at, _, kind, what = heapq.heappop(events)
        if at > end:
            break
        if kind == "period":
            # The collector's period starts: last period's burst batch closes, the policy plans this one's.
            assert planner is not None
            for sample in bursts.seal():
                push((int(at / interval) + 1) * interval + linger, "ingest", sample)
            # As the collector: at most burst_max_per_tick a send tick (a WAN link: no bandwidth cap).
            per_tick = max(collector.burst_max_per_tick, 1)
            left = planner.plan(T0 + at, overdue_s, limits={"b": per_tick * PROBES}).get("b", 0)
            for j in range(PROBES):
                if left <= 0:
                    break
                push(at + j * interval, "burst", min(per_tick, left))
                left -= per_tick
        elif kind == "burst":
            assert planner is not None
            for _ in range(what):
                bursts.sent(burst_seq)
                probe(burst_seq, at, "bresult")
                burst_seq += 1
            planner.on_sent("b", T0 + at, what)
        elif kind == "dense":
            # This send tick's extra probes: one batch, one counts-only sample once all are in.
            for _ in range(what):
                dense.sent(dense_seq)
                probe(dense_seq, at, "dresult", dense_overdue)
                dense_seq += 1
            dense_probes += what
            for sample in dense.seal():
                push((int(at / interval) + 1) * interval + linger, "ingest", sample)
        elif kind == "dresult":
            for sample in dense.add(what):
                push((int(at / interval) + 1) * interval + linger, "ingest", sample)
        elif kind == "bresult":
            assert planner is not None
            planner.on_result("b", T0 + at, what.rtt_ms is None, True, what.sent_at)
            for sample in bursts.add(what):
                push((int(at / interval) + 1) * interval + linger, "ingest", sample)
        elif kind == "result":
            if planner is not None:
                planner.on_result("b", T0 + at, what.rtt_ms is None)
            closed = rounds.add(what)
            # Queued samples go out at the next send tick, or at once with an urgent one.
            urgent = any(u for _, u in closed)
            publish = at if urgent else (int(at / interval) + 1) * interval
            for sample, _ in closed:
                push(publish + linger, "ingest", sample)
        elif kind == "ingest":
            if (
                first_sample is None
                and change_at is not None
                and (what.lost if loss else what.rtt_ms is not None and what.rtt_ms >= 1.5 * base_ms)
            ):
                first_sample = at - linger
            perception.ingest(what, T0 + at)
            if chain.event_driven and perception.shifted():
                for event in perception.evaluate_shifted(T0 + at):
                    if event.kind == "degraded":
                        degraded.append(at)
        else:
            for event in perception.tick(T0 + at):
                if event.kind == "degraded":
                    degraded.append(at)
    shifts = perception.links["a", "b"].filter.shifts
    counts = planner.counts() if planner is not None else {}
    return {
        "first_sample": first_sample,
        "first_loss": first_loss,
        "degraded": degraded,
        "shifts": shifts,
        "steady_probes": int(end / interval),
        "burst_probes": counts.get("burst_probes", 0) + dense_probes,
        "burst_episodes": counts.get("burst_episodes", 0),
        "burst_ends": {r: counts.get(f"burst_ended_{r}", 0) for r in ("bad", "good", "capped")},
    }


def timing(
    chain: Chain,
    *,
    trials: int,
    seed: int,
    period_s: float,
    base_ms: float,
    mdev_ms: float,
    factor: float = 5.0,
    loss: float = 0.0,
    periods_after: int = 15,
) -> dict[str, Any]:
    """Change → sample → event → decision, in probe periods, over ``trials`` random phases: the
    RTT ``factor`` times the base, or (``loss`` > 0) that share of the probes lost, the RTT as
    before. A trial with no event within ``periods_after`` periods of the change is *missed*."""
    rng = random.Random(seed)
    sample_p, event_p, decision_p = [], [], []
    first_loss_p, after_loss_p, bursts = [], [], []
    missed = 0
    for _ in range(trials):
        change_at = 30 * period_s + rng.random() * period_s
        out = _simulate(
            chain,
            rng,
            period_s=period_s,
            base_ms=base_ms,
            mdev_ms=mdev_ms,
            periods=31 + periods_after,
            change_at=change_at,
            factor=factor,
            loss=loss,
        )
        after = [t for t in out["degraded"] if t >= change_at]
        bursts.append(out["burst_probes"])
        if not after or out["first_sample"] is None:
            missed += 1
            continue
        if out["first_loss"] is not None and out["first_loss"] <= after[0]:
            first_loss_p.append((out["first_loss"] - change_at) / period_s)
            after_loss_p.append((after[0] - out["first_loss"]) / period_s)
        sample_p.append((out["first_sample"] - change_at) / period_s)
        event_p.append((after[0] - change_at) / period_s)
        decision_p.append((after[0] + chain.review_delay_s + WHATIF_S - change_at) / period_s)
    return {
        "chain": chain.name,
        "change": f"loss {loss:g}" if loss else f"rtt x{factor:g}",
        "period_s": period_s,
        "base_rtt_ms": base_ms,
        "trials": trials,
        "missed": missed,
        "first_sample_periods": _summary(sample_p),
        "event_periods": _summary(event_p),
        "decision_periods": _summary(decision_p),
        "decision_within_3_periods": sum(d <= 3.0 for d in decision_p) / max(len(decision_p), 1),
        "detected_within_periods": {
            str(n): sum(d <= n for d in event_p) / trials for n in (3, 5, 10, 15, 20, 30)
        },
        **(
            {
                "first_lost_probe_periods": _summary(first_loss_p),
                "event_after_first_lost_probe_periods": _summary(after_loss_p),
            }
            if loss
            else {}
        ),
        "burst_probes_per_trial": _summary([float(b) for b in bursts]),
    }


def dense_false_positives(
    chain: Chain, *, links: int, periods: int, seed: int, spikes: float, base_loss: float = 0.0
) -> dict[str, Any]:
    """:func:`false_positives` for a link in use, at the level of samples (a heap event per probe
    is too slow for hundreds of probes a period over link-hours): each period one steady round
    and, at each send tick, one counts-only sample of the tick's extra probes, each lost with
    ``base_loss`` or when its RTT (the same noise model: N(avg, mdev) clipped to [min, max],
    ``spikes`` of them 2-5x) is past the deadline; ingested at the deadline, evaluated at once
    when it lost some (as network perception) and at every period's tick."""
    keys = ("min_rtt_ms", "avg_rtt_ms", "max_rtt_ms", "mdev_rtt_ms")
    rows = [r for r in csv.DictReader(DATA.open()) if all(r[k] for k in keys) and float(r["avg_rtt_ms"]) > 0]
    rng = random.Random(seed)
    chosen = rng.sample(rows, min(links, len(rows)))
    collector = _collector()
    per_tick = min(
        math.ceil(dense_plan(["b"], collector.use, 1.0).get("b", 0) / PROBES), collector.use.max_per_tick
    )
    events = flagged = late = dense_probes = 0
    for row in chosen:
        avg, mdev = float(row["avg_rtt_ms"]), float(row["mdev_rtt_ms"])
        low, high = float(row["min_rtt_ms"]), float(row["max_rtt_ms"])
        link_rng = np.random.default_rng(int(rng.random() * 2**32))
        perception = _perception(chain, avg, mdev)
        overdue = dense_overdue_s(avg, collector.use, collector.probe_timeout_s)
        found = 0
        for k in range(periods):
            start = k * 1.0
            rtts = np.clip(link_rng.normal(avg, mdev, PROBES), low, high)
            lost = link_rng.random(PROBES) < base_loss
            results = [
                ProbeResult(
                    seq=k * PROBES + i, sent_at=T0 + start + i / PROBES, rtt_ms=None if lost[i] else rtt
                )
                for i, rtt in enumerate(rtts.tolist())
            ]
            perception.ingest(round_sample("a", "b", results), T0 + start + 1.0)
            for j in range(PROBES):
                sent = start + j / PROBES
                rtts = np.clip(link_rng.normal(avg, mdev, per_tick), low, high)
                spiking = link_rng.random(per_tick) < spikes
                rtts = np.where(spiking, rtts * link_rng.uniform(2.0, 5.0, per_tick), rtts)
                past = rtts / 1000.0 > overdue
                gone = (link_rng.random(per_tick) < base_loss) | past
                late += int(past.sum())
                dense_probes += per_tick
                n_lost = int(gone.sum())
                sample = ProbeSample(
                    src="a",
                    dst="b",
                    probe="udp_burst",  # loom.net.burst.BURST_PROBE, as the contract spells it
                    seq=k * PROBES + j,
                    sent_at=T0 + sent,
                    rtt_ms=None if n_lost == per_tick else avg,
                    sent=per_tick,
                    lost=n_lost,
                )
                perception.ingest(sample, T0 + sent + overdue)
                if perception.shifted():
                    found += sum(
                        e.kind == "degraded" for e in perception.evaluate_shifted(T0 + sent + overdue)
                    )
            found += sum(e.kind == "degraded" for e in perception.tick(T0 + start + 1.0))
        events += found
        flagged += bool(found)
    hours = len(chosen) * periods / 3600.0
    return {
        "chain": chain.name,
        "links": len(chosen),
        "periods_per_link": periods,
        "spike_rate": spikes,
        "base_loss": base_loss,
        "degraded_events": events,
        "links_with_an_event": flagged,
        "degraded_per_link_hour": events / hours,
        "dense_probes_per_link_hour": round(dense_probes / hours, 1),
        "dense_probes_past_deadline": late,
    }


def false_positives(
    chain: Chain, *, links: int, periods: int, seed: int, spikes: float, base_loss: float = 0.0
) -> dict[str, Any]:
    """Degraded events and confirmed shifts on measured links whose truth never changes (each
    probe lost with probability ``base_loss``: a healthy WAN link's own loss)."""
    keys = ("min_rtt_ms", "avg_rtt_ms", "max_rtt_ms", "mdev_rtt_ms")
    rows = [r for r in csv.DictReader(DATA.open()) if all(r[k] for k in keys) and float(r["avg_rtt_ms"]) > 0]
    rng = random.Random(seed)
    chosen = rng.sample(rows, min(links, len(rows)))
    events = shifts = 0
    flagged = 0
    burst_probes = episodes = steady = 0
    ends = {"bad": 0, "good": 0, "capped": 0}
    for row in chosen:
        avg, mdev = float(row["avg_rtt_ms"]), float(row["mdev_rtt_ms"])
        low, high = float(row["min_rtt_ms"]), float(row["max_rtt_ms"])
        out = _simulate(
            chain,
            random.Random(rng.random()),
            period_s=1.0,
            base_ms=avg,
            mdev_ms=mdev,
            periods=periods,
            change_at=None,
            factor=1.0,
            spikes=spikes,
            low_ms=low,
            high_ms=high,
            base_loss=base_loss,
        )
        events += len(out["degraded"])
        shifts += out["shifts"]
        flagged += bool(out["degraded"])
        burst_probes += out["burst_probes"]
        episodes += out["burst_episodes"]
        steady += out["steady_probes"]
        for reason, n in out["burst_ends"].items():
            ends[reason] += n
    hours = len(chosen) * periods / 3600.0
    return {
        "chain": chain.name,
        "links": len(chosen),
        "periods_per_link": periods,
        "spike_rate": spikes,
        "base_loss": base_loss,
        "degraded_events": events,
        "links_with_an_event": flagged,
        "degraded_per_link_hour": events / hours,
        "level_shifts": shifts,
        "burst_episodes_per_link_hour": round(episodes / hours, 2),
        "burst_probes_per_link_hour": round(burst_probes / hours, 1),
        "burst_probes_over_steady": round(burst_probes / max(steady, 1), 4),
        "burst_ends": ends,
    }


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p95": None, "max": None}
    ordered = sorted(values)
    return {
        "mean": round(statistics.fmean(values), 2),
        "p50": round(ordered[len(ordered) // 2], 2),
        "p95": round(ordered[min(int(0.95 * len(ordered)), len(ordered) - 1)], 2),
        "max": round(ordered[-1], 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global PROBES, LINK, USE  # noqa: PLW0603 (the model's knobs: probe rate, loss rule, use)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--links", type=int, default=200)
    parser.add_argument("--periods", type=int, default=600)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--rtt-ms", type=float, default=167.4, help="base RTT (westeurope - asia-southeast1)")
    parser.add_argument("--mdev-ms", type=float, default=10.1)
    parser.add_argument("--spikes", type=float, nargs="*", default=[0.01, 0.1], help="probe spike rates")
    parser.add_argument("--factors", type=float, nargs="*", default=[5.0], help="RTT factors of the change")
    parser.add_argument("--losses", type=float, nargs="*", default=[], help="probe loss rates of the change")
    parser.add_argument(
        "--base-losses", type=float, nargs="*", default=[0.0], help="healthy links' probe loss"
    )
    parser.add_argument(
        "--probes", type=int, default=5, help="probes per period (the collector's probes_per_period)"
    )
    parser.add_argument("--chains", nargs="+", default=["before", "after"], choices=sorted(CHAINS))
    parser.add_argument("--cusum-h", type=float, default=LinkConfig().cusum_h, help="the loss rule's cusum_h")
    parser.add_argument(
        "--null-loss", type=float, default=LinkConfig().null_loss, help="the loss rule's null_loss"
    )
    parser.add_argument(
        "--dense-probes",
        type=int,
        default=UseConfig().probes_per_period,
        help="extra probes a period on a link in use (a fifth of them a tick; the budget at least as many)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    PROBES = args.probes
    LINK = replace(LinkConfig(), cusum_h=args.cusum_h, null_loss=args.null_loss)
    default_use = UseConfig()
    USE = replace(
        default_use,
        probes_per_period=args.dense_probes,
        max_per_tick=max(default_use.max_per_tick, math.ceil(args.dense_probes / PROBES)),
        budget_per_s=max(default_use.budget_per_s, float(args.dense_probes)),
    )
    result: dict[str, Any] = {
        "probes_per_period": PROBES,
        "dense_probes_per_period": USE.probes_per_period,
        "cusum_h": LINK.cusum_h,
        "null_loss": LINK.null_loss,
        "timing": [],
        "false_positives": [],
    }
    changes = [(factor, 0.0) for factor in args.factors] + [(1.0, loss) for loss in args.losses]
    for chain in (c for c in CHAINS.values() if c.name in args.chains):
        for factor, loss in changes:
            result["timing"].append(
                timing(
                    chain,
                    trials=args.trials,
                    seed=args.seed,
                    period_s=1.0,
                    base_ms=args.rtt_ms,
                    mdev_ms=args.mdev_ms,
                    factor=factor,
                    loss=loss,
                    periods_after=60 if loss else 15,
                )
            )
        for spikes in args.spikes:
            for base_loss in args.base_losses:
                result["false_positives"].append(
                    (dense_false_positives if chain.dense else false_positives)(
                        chain,
                        links=args.links,
                        periods=args.periods,
                        seed=args.seed,
                        spikes=spikes,
                        base_loss=base_loss,
                    )
                )
    print(json.dumps(result, indent=None if args.json else 2))
    return result


if __name__ == "__main__":
    main()

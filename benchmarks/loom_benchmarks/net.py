"""``loom bench net``: convergence, stability, accuracy and capacity of network perception.

Two parts, both through the same pure core (:class:`loom.net.Perception`) the service runs:

* **simulated** — probe periods driven by a noisy model of the default topology's links (RTT
  ~ N(mean, mdev) with 1 % spikes of 2–5×, Bernoulli loss, drifting means, degradation episodes,
  links that go silent). The model's *true* link values give the optimum every choice is judged
  against, with the core's own cost function.

  - convergence: a step (RTT × 3, an outage, 20 % loss) on a link that carries optimal paths;
    probe periods until every affected pair's chosen path is right (true cost within 5 % of the
    optimum), and the same after the link recovers (slow by design: costs decay slowly);
  - stability: a link whose cost oscillates around the cost of the second-best path (square
    waves of several amplitudes and half-periods); path changes in any 10 consecutive periods,
    with and without hysteresis; degraded / recovered events of a link oscillating around its
    degrade threshold;
  - accuracy: every pair's chosen path each period under noise, drift, episodes and ~10 %
    stale links; true cost over the true optimum;
  - capacity: ~1,000 links (32 regions) at 5 Hz through admission, filter, windows and the
    per-period evaluation on one Python thread;
  - bad input: floods, NaN / negative values, unknown endpoints, skewed clocks; drops by reason
    and whether link state stays sane.

* **emulator** — a short real run on loopback: four regions of the default topology behind
  :class:`loom.netemu.WanEmulator` (UDP relays shaped like the measured links), UDP probes at
  5 Hz on all twelve links feeding the core; measured vs configured RTT, a step change made on a
  relay at run time and the periods until the chosen path follows, and one TCP bulk transfer
  through a bandwidth-capped relay.

Probe period 1 s, 5 probes per link per period throughout.
"""

import argparse
import asyncio
import itertools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx

from loom.model.topology import Topology, load_topology
from loom.net import (
    CostWeights,
    Expected,
    LinkConfig,
    LinkEvent,
    PathInfo,
    Perception,
    SelectorConfig,
)
from loom.net.linkstate import JITTER_PER_MDEV
from loom_proto.net import ProbeSample

PERIOD_S = 1.0
PROBES_PER_PERIOD = 5
PACKETS_PER_ROUND = 10
"""Simulated probes are rounds of 10 packets (ProbeSample.sent = 10): its median RTT, its losses
and its jitter; single-packet probes are reported too where they differ."""
START_AT = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the simulated clock starts at a UTC midnight
TOLERANCE = 0.05
"""A chosen path is right when its true cost is within this fraction of the optimum's."""

Pair = tuple[str, str]


# ---- the simulated network ----------------------------------------------------------------------


@dataclass(slots=True)
class Truth:
    """What a link really is right now (the simulation's ground truth)."""

    rtt_ms: float
    mdev_ms: float
    loss: float
    bandwidth_gbps: float | None
    blackhole: bool = False


class NetSim:
    """The default topology's links as a noisy, drifting, partly silent network, probed each period."""

    def __init__(
        self,
        topology: Topology,
        *,
        seed: int,
        spike_rate: float = 0.01,
        packets_per_probe: int = 1,
        link_config: LinkConfig | None = None,
        selector: SelectorConfig | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.topology = topology
        self.base = {
            (link.src, link.dst): Truth(link.rtt_ms, link.rtt_mdev_ms, 0.0, link.bandwidth_gbps)
            for link in topology.links
        }
        self.truth = {key: replace(value) for key, value in self.base.items()}
        self.perception = Perception.from_topology(topology, link_config=link_config, selector=selector)
        self.weights: CostWeights = self.perception.link_config.weights
        self.regions = sorted(self.perception.regions)
        self.pairs = [(a, b) for a in self.regions for b in self.regions if a != b]
        self.spike_rate = spike_rate
        self.packets = packets_per_probe
        self.silent: set[Pair] = set()
        self.now = START_AT
        self._seq = 0
        self._optimum_at: float | None = None
        self._optimum: dict[Pair, tuple[float, tuple[str, ...]]] = {}

    def truth_changed(self) -> None:
        """Recompute the optimum at the next question (the truth changed within a period)."""
        self._optimum_at = None

    def _sample(self, key: Pair, at: float) -> ProbeSample:
        truth = self.truth[key]
        rng = self.rng
        received: list[float] = []
        for _ in range(self.packets):
            if truth.blackhole or rng.random() < truth.loss:
                continue
            rtt = max(rng.gauss(truth.rtt_ms, truth.mdev_ms), truth.rtt_ms * 0.5)
            if rng.random() < self.spike_rate:
                rtt *= rng.uniform(2.0, 5.0)
            received.append(rtt)
        self._seq += 1
        rtt_ms = jitter_ms = None
        if received and self.packets > 1:
            # A round reports its median (a spike in one packet does not move it) and the mean
            # absolute difference between consecutive packets as its jitter.
            rtt_ms = statistics.median(received)
            if len(received) > 1:
                jitter_ms = statistics.fmean(abs(a - b) for a, b in itertools.pairwise(received))
        elif received:
            rtt_ms = received[0]
        return ProbeSample(
            src=key[0],
            dst=key[1],
            probe="udp_echo",
            seq=self._seq,
            sent_at=at,
            rtt_ms=rtt_ms,
            jitter_ms=jitter_ms,
            sent=self.packets,
            lost=self.packets - len(received),
        )

    def period(self) -> list[LinkEvent]:
        """One probe period: every probed link's samples in time order, then the evaluation."""
        step = PERIOD_S / PROBES_PER_PERIOD
        keys = [key for key in self.truth if key not in self.silent]
        for k in range(PROBES_PER_PERIOD):
            at = self.now + (k + 1) * step
            for key in keys:
                # Arrives 5 ms after it was sent: a collector in between.
                self.perception.ingest(self._sample(key, at - 0.005), at)
        self.now += PERIOD_S
        return self.perception.tick(self.now)

    def true_cost(self, key: Pair) -> float:
        """The link's cost on its true values (the core's cost function)."""
        truth = self.truth[key]
        if truth.blackhole:
            return math.inf
        return self.weights.cost_ms(
            truth.rtt_ms, truth.mdev_ms * JITTER_PER_MDEV, truth.loss, truth.bandwidth_gbps
        )

    def path_cost(self, nodes: Sequence[str]) -> float:
        """A path's true cost."""
        return sum(self.true_cost((a, b)) for a, b in itertools.pairwise(nodes))

    def optimum(self, pair: Pair) -> tuple[float, tuple[str, ...]]:
        """The least true cost and its path (recomputed once per period)."""
        if self._optimum_at != self.now:
            graph = nx.DiGraph()
            for key in self.truth:
                cost = self.true_cost(key)
                if math.isfinite(cost):
                    graph.add_edge(*key, cost=cost)
            self._optimum = {}
            for source in self.regions:
                lengths, paths = nx.single_source_dijkstra(graph, source, weight="cost")
                for target, length in lengths.items():
                    if target != source:
                        self._optimum[source, target] = (length, tuple(paths[target]))
            self._optimum_at = self.now
        return self._optimum.get(pair, (math.inf, ()))

    def chosen(self, pair: Pair) -> tuple[str, ...]:
        """Ask the core for the pair's path now, as a scheduler would; its regions."""
        answer = self.perception.path(pair[0], pair[1], self.now)
        return answer.chosen.nodes if answer.chosen else ()

    def right(self, pair: Pair, nodes: Sequence[str]) -> bool:
        """Whether a path's true cost is within the tolerance of the optimum."""
        best, _ = self.optimum(pair)
        return bool(nodes) and self.path_cost(nodes) <= best * (1.0 + TOLERANCE)


def _uses(nodes: Sequence[str], key: Pair) -> bool:
    return any((a, b) == key for a, b in itertools.pairwise(nodes))


def _nodes(path: PathInfo | None) -> tuple[str, ...]:
    return () if path is None else path.nodes


def _summary(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "mean": None, "p95": None, "max": None}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "mean": round(statistics.fmean(ordered), 3),
        "p95": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3),
        "max": round(ordered[-1], 3),
    }


# ---- convergence --------------------------------------------------------------------------------

Step = Callable[[Truth], None]


def _rtt_x3(truth: Truth) -> None:
    truth.rtt_ms *= 3.0


def _outage(truth: Truth) -> None:
    truth.blackhole = True


def _loss_20(truth: Truth) -> None:
    truth.loss = 0.2


STEPS: list[tuple[str, Step, int]] = [
    ("rtt_x3", _rtt_x3, PACKETS_PER_ROUND),
    ("outage", _outage, PACKETS_PER_ROUND),
    ("loss_20pct", _loss_20, PACKETS_PER_ROUND),
    ("rtt_x3_single_packet_probes", _rtt_x3, 1),
    ("outage_single_packet_probes", _outage, 1),
]
"""Steps, each probed with rounds of 10 packets and the first two also with single-packet probes."""

STEP_PERIODS = 20
RECOVERY_PERIODS = 90


def convergence(
    topology: Topology, *, seed: int, trials: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Periods until the chosen paths are right after a step, and after the link recovers.

    Each trial steps one link that carries optimal paths (``trials`` of them, spread over the
    list), after 15 periods of warm-up, for 20 periods; the pairs whose optimum changes must get a
    right path (and keep it). The link then returns to normal for 60 periods; the pairs whose
    optimum returns must get a right path again.
    """
    result: dict[str, Any] = {}
    probe = NetSim(topology, seed=seed)
    carriers = sorted(
        {key for pair in probe.pairs for key in probe.truth if _uses(probe.optimum(pair)[1], key)}
    )
    stride = max(1, len(carriers) // max(trials, 1))
    carriers = carriers[::stride][:trials]
    for name, step, packets in STEPS:
        progress(f"convergence: {name}")
        after_step: list[float] = []
        after_recovery: list[float] = []
        never = not_recovered = lost_again = 0
        for index, key in enumerate(carriers):
            sim = NetSim(topology, seed=seed * 1000 + index, packets_per_probe=packets)
            for _ in range(15):
                sim.period()
                for pair in sim.pairs:
                    sim.chosen(pair)
            before = {pair: sim.optimum(pair) for pair in sim.pairs}
            step(sim.truth[key])
            sim.truth_changed()
            affected = [
                p for p in sim.pairs if _uses(before[p][1], key) and sim.optimum(p)[1] != before[p][1]
            ]
            if not affected:
                continue
            periods, stayed = _periods_until_right(sim, affected, periods=STEP_PERIODS)
            if periods is None:
                never += 1
            else:
                after_step.append(periods)
            lost_again += not stayed
            sim.truth[key] = replace(sim.base[key])
            sim.truth_changed()
            back = [p for p in sim.pairs if sim.optimum(p)[1] == before[p][1] and _uses(before[p][1], key)]
            recovered, _ = _periods_until_right(sim, back, periods=RECOVERY_PERIODS)
            if recovered is None:
                not_recovered += 1
            else:
                after_recovery.append(recovered)
        result[name] = {
            "packets_per_probe": packets,
            "trials": len(after_step) + never,
            f"not_right_within_{STEP_PERIODS}": never,
            "periods_after_step": _summary(after_step),
            "right_then_wrong_again": lost_again,
            f"not_right_within_{RECOVERY_PERIODS}_after_recovery": not_recovered,
            "periods_after_recovery": _summary(after_recovery),
        }
    return result


def _periods_until_right(sim: NetSim, pairs: Sequence[Pair], *, periods: int) -> tuple[int | None, bool]:
    """Run ``periods`` periods; the first after which every pair's path is right, and whether it stayed so."""
    first: int | None = None
    stayed = True
    for period in range(1, periods + 1):
        sim.period()
        chosen = {pair: sim.chosen(pair) for pair in sim.pairs}
        right = all(sim.right(pair, chosen[pair]) for pair in pairs)
        if right and first is None:
            first = period
        elif not right and first is not None:
            stayed = False
    return first, stayed


# ---- stability ----------------------------------------------------------------------------------


def _oscillation_pair(sim: NetSim) -> tuple[Pair, float]:
    """A pair served by its direct link, and the true cost of its best path avoiding that link."""
    for pair in sim.pairs:
        cost, nodes = sim.optimum(pair)
        if len(nodes) != 2:
            continue
        graph = nx.DiGraph()
        for key in sim.truth:
            if key != pair:
                graph.add_edge(*key, cost=sim.true_cost(key))
        second = nx.dijkstra_path_length(graph, pair[0], pair[1], weight="cost")
        if second < cost * 1.6:
            return pair, float(second)
    raise RuntimeError("no pair with a close second-best path")


AMPLITUDES = (0.03, 0.1, 0.25)
HALF_PERIODS = (1, 2, 3, 5, 10, 20)


def stability(
    topology: Topology,
    *,
    seed: int,
    periods: int,
    progress: Callable[[str], None],
    packets_per_probe: int = PACKETS_PER_ROUND,
    link_config: LinkConfig | None = None,
) -> dict[str, Any]:
    """Path changes of a pair whose direct link's true cost oscillates around the second-best path's.

    Square waves of ±3/10/25 % around the parity cost with half-periods of 1–20 periods, on top
    of the probe noise. Reported: changes per 10 periods over each run (the target's rate), and
    the most changes in any 10 consecutive periods. The same without hysteresis (no cost decay,
    no switch margin, no dwell) at ±10 % shows what the hysteresis buys.
    """
    progress("stability")
    cases = []
    for hysteresis in (True, False):
        config = (link_config or LinkConfig()) if hysteresis else LinkConfig(decay_tau_s=1e-6)
        selector = SelectorConfig() if hysteresis else SelectorConfig(0.0, 0.0, 0.0)
        for amplitude in AMPLITUDES if hysteresis else (0.1,):
            for half_period in HALF_PERIODS:
                changes = _oscillate(
                    topology,
                    seed=seed,
                    periods=periods,
                    amplitude=amplitude,
                    half_period=half_period,
                    link_config=config,
                    selector=selector,
                    packets_per_probe=packets_per_probe,
                )
                cases.append(
                    {
                        "hysteresis": hysteresis,
                        "amplitude": amplitude,
                        "half_period": half_period,
                        "changes": sum(changes),
                        "changes_per_10_periods": round(10 * sum(changes) / periods, 3),
                        "max_changes_in_any_10_periods": max(
                            sum(changes[i : i + 10]) for i in range(len(changes) - 9)
                        ),
                    }
                )
    with_h = [c for c in cases if c["hysteresis"]]
    without = [c for c in cases if not c["hysteresis"]]
    return {
        "periods_per_case": periods,
        "packets_per_probe": packets_per_probe,
        "max_changes_per_10_periods": max(c["changes_per_10_periods"] for c in with_h),
        "mean_changes_per_10_periods": round(
            statistics.fmean(c["changes_per_10_periods"] for c in with_h), 3
        ),
        "max_changes_in_any_10_periods": max(c["max_changes_in_any_10_periods"] for c in with_h),
        "without_hysteresis_max_changes_per_10_periods": max(c["changes_per_10_periods"] for c in without),
        "without_hysteresis_max_changes_in_any_10_periods": max(
            c["max_changes_in_any_10_periods"] for c in without
        ),
        "degrade_events": _event_flapping(topology, seed=seed, periods=periods),
        "cases": cases,
    }


def _oscillate(
    topology: Topology,
    *,
    seed: int,
    periods: int,
    amplitude: float,
    half_period: int,
    link_config: LinkConfig,
    selector: SelectorConfig,
    packets_per_probe: int,
) -> list[int]:
    sim = NetSim(
        topology, seed=seed, link_config=link_config, selector=selector, packets_per_probe=packets_per_probe
    )
    pair, parity = _oscillation_pair(sim)
    other = sim.true_cost(pair) - sim.truth[pair].rtt_ms  # the non-RTT part of the link's cost
    sim.truth[pair].rtt_ms = parity * (1 - amplitude) - other
    for _ in range(20):
        sim.period()
        sim.chosen(pair)
    changes = []
    for period in range(periods):
        high = (period // half_period) % 2 == 0
        sim.truth[pair].rtt_ms = parity * (1 + amplitude if high else 1 - amplitude) - other
        sim.period()
        changes.append(1 if sim.perception.path(pair[0], pair[1], sim.now).changed else 0)
    return changes


def _event_flapping(topology: Topology, *, seed: int, periods: int) -> dict[str, Any]:
    """Degraded / recovered events of a link whose RTT swings between 1.4x and 1.6x its baseline."""
    sim = NetSim(topology, seed=seed, packets_per_probe=PACKETS_PER_ROUND)
    key = next(iter(sim.truth))
    base = sim.base[key].rtt_ms
    for _ in range(20):
        sim.period()
    kinds: list[str] = []
    for period in range(periods):
        sim.truth[key].rtt_ms = base * (1.6 if (period // 2) % 2 == 0 else 1.4)
        kinds += [event.kind for event in sim.period() if (event.src, event.dst) == key]
    return {
        "link": f"{key[0]}->{key[1]}",
        "rtt_swing": "1.4x <-> 1.6x baseline every 2 periods (degrade at 1.5x, recover at 1.2x)",
        "periods": periods,
        "events": kinds,
    }


# ---- accuracy -----------------------------------------------------------------------------------


def accuracy(
    topology: Topology,
    *,
    seed: int,
    periods: int,
    progress: Callable[[str], None],
    episode_rate: float = 0.002,
    silence_rate: float = 0.005,
    link_config: LinkConfig | None = None,
    selector: SelectorConfig | None = None,
    packets_per_probe: int = PACKETS_PER_ROUND,
) -> dict[str, Any]:
    """True cost of every pair's chosen path over the optimum, under noise, drift, episodes, staleness.

    Each link's mean RTT drifts (±0–10 %, periods of 2–15 min); with probability ``episode_rate``
    per period a link starts a 10–60 period episode of congestion (RTT × 1.5–3) or loss (2–10 %);
    with probability ``silence_rate`` it goes unprobed for 10–40 periods (stale after the TTL).
    """
    progress(f"accuracy ({packets_per_probe}-packet probes{'' if episode_rate else ', no episodes'})")
    sim = NetSim(
        topology, seed=seed, link_config=link_config, selector=selector, packets_per_probe=packets_per_probe
    )
    rng = random.Random(seed + 1)
    drift = {
        key: (rng.uniform(0, 0.1), rng.uniform(120, 900), rng.uniform(0, 2 * math.pi)) for key in sim.truth
    }
    base_loss = {key: rng.uniform(0, 0.002) for key in sim.truth}
    episodes: dict[Pair, tuple[int, bool, float]] = {}
    silent_until: dict[Pair, int] = {}
    chosen_excess: list[float] = []
    best_excess: list[float] = []
    direct_excess: list[float] = []
    stale_fraction: list[float] = []
    warmup = 20
    for period in range(warmup + periods):
        _evolve_truth(
            sim,
            period,
            rng,
            drift=drift,
            base_loss=base_loss,
            episodes=episodes,
            silent_until=silent_until,
            episode_rate=episode_rate,
            silence_rate=silence_rate,
        )
        sim.period()
        if period < warmup:
            for pair in sim.pairs:
                sim.chosen(pair)
            continue
        stale_fraction.append(
            sum(t.is_stale(sim.now) for t in sim.perception.links.values()) / len(sim.perception.links)
        )
        for pair in sim.pairs:
            optimum, _ = sim.optimum(pair)
            answer = sim.perception.path(pair[0], pair[1], sim.now)
            if answer.chosen is not None:
                chosen_excess.append(sim.path_cost(answer.chosen.nodes) / optimum - 1.0)
            if answer.best is not None:
                best_excess.append(sim.path_cost(answer.best.nodes) / optimum - 1.0)
            direct_excess.append(sim.path_cost(pair) / optimum - 1.0)
    within = sum(1 for e in chosen_excess if e <= TOLERANCE) / len(chosen_excess)
    return {
        "packets_per_probe": packets_per_probe,
        "periods": periods,
        "pairs": len(sim.pairs),
        "stale_links_mean_fraction": round(statistics.fmean(stale_fraction), 3),
        "chosen_path_excess": _summary(chosen_excess),
        "chosen_within_5pct_fraction": round(within, 4),
        "momentary_best_excess": _summary(best_excess),
        "direct_link_excess": _summary(direct_excess),
    }


def _evolve_truth(
    sim: NetSim,
    period: int,
    rng: random.Random,
    *,
    drift: dict[Pair, tuple[float, float, float]],
    base_loss: dict[Pair, float],
    episodes: dict[Pair, tuple[int, bool, float]],
    silent_until: dict[Pair, int],
    episode_rate: float,
    silence_rate: float,
) -> None:
    """Move every link's true RTT and loss to ``period`` (drift, episodes) and choose the silent links.

    ``episodes`` (end period, congestion or loss, size) and ``silent_until`` carry over between periods.
    """
    elapsed = period * PERIOD_S
    for key, truth in sim.truth.items():
        depth, cycle, phase = drift[key]
        factor = 1.0 + depth * math.sin(2 * math.pi * elapsed / cycle + phase)
        truth.rtt_ms = sim.base[key].rtt_ms * factor
        truth.loss = base_loss[key]
        if key in episodes and period >= episodes[key][0]:
            del episodes[key]
        elif key not in episodes and rng.random() < episode_rate:
            congestion = rng.random() < 0.5
            size = rng.uniform(1.5, 3.0) if congestion else rng.uniform(0.02, 0.1)
            episodes[key] = (period + rng.randint(10, 60), congestion, size)
        if key in episodes:
            _, congestion, size = episodes[key]
            if congestion:
                truth.rtt_ms *= size
            else:
                truth.loss = size
        if key in silent_until and period >= silent_until[key]:
            del silent_until[key]
        elif key not in silent_until and rng.random() < silence_rate:
            silent_until[key] = period + rng.randint(10, 40)
    sim.silent = set(silent_until)


# ---- capacity -----------------------------------------------------------------------------------


def capacity(
    *, links_wanted: int, seconds: int, seed: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Samples per second through admission, filter, windows and per-period evaluation, one thread."""
    progress("capacity")
    regions = max(2, math.ceil((1 + math.sqrt(1 + 4 * links_wanted)) / 2))
    names = [f"r{i:02d}" for i in range(regions)]
    rng = random.Random(seed)
    keys = [(a, b) for a in names for b in names if a != b]
    base = {key: rng.uniform(5, 300) for key in keys}
    expected = {key: Expected(rtt_ms=base[key]) for key in keys}
    perception = Perception(names, expected=expected)
    batches: list[list[tuple[float, ProbeSample]]] = []
    seq = 0
    for second in range(seconds):
        batch = []
        for k in range(PROBES_PER_PERIOD):
            at = START_AT + second + (k + 1) / PROBES_PER_PERIOD
            for key in keys:
                seq += 1
                lost = rng.random() < 0.005
                rtt = None if lost else max(0.1, rng.gauss(base[key], base[key] * 0.02))
                sample = ProbeSample(
                    src=key[0], dst=key[1], probe="udp_echo", seq=seq, sent_at=at - 0.005,
                    rtt_ms=rtt, lost=1 if lost else 0,
                )  # fmt: skip
                batch.append((at, sample))
        batches.append(batch)
    ingest_s = tick_s = 0.0
    samples = 0
    for second, batch in enumerate(batches):
        started = time.perf_counter()
        for at, sample in batch:
            perception.ingest(sample, at)
        ticked = time.perf_counter()
        perception.tick(START_AT + second + 1)
        done = time.perf_counter()
        ingest_s += ticked - started
        tick_s += done - ticked
        samples += len(batch)
    now = START_AT + seconds
    queries = [(rng.choice(names), rng.choice(names)) for _ in range(200)]
    started = time.perf_counter()
    for a, b in queries:
        if a != b:
            perception.path(a, b, now)
    query_s = time.perf_counter() - started
    started = time.perf_counter()
    for key in keys[:200]:
        perception.point_link(key[0], key[1], now)
    point_s = time.perf_counter() - started
    return {
        "regions": regions,
        "links": len(keys),
        "probe_hz": PROBES_PER_PERIOD / PERIOD_S,
        "samples": samples,
        "samples_per_s": round(samples / (ingest_s + tick_s)),
        "ingest_only_samples_per_s": round(samples / ingest_s),
        "ingest_us_per_sample": round(ingest_s / samples * 1e6, 2),
        "tick_ms_per_period": round(tick_s / seconds * 1000, 1),
        "path_query_us": round(query_s / len(queries) * 1e6),
        "point_query_us": round(point_s / 200 * 1e6),
        "dropped": dict(perception.dropped),
    }


# ---- bad input ----------------------------------------------------------------------------------


# PLR0912: one case per kind of bad input, listed flat.
def bad_input(topology: Topology, *, seed: int, progress: Callable[[str], None]) -> dict[str, Any]:  # noqa: PLR0912
    """Junk, floods and skewed clocks next to honest probes; what was dropped and whether state is sane."""
    progress("bad input")
    sim = NetSim(topology, seed=seed)
    rng = random.Random(seed)
    flooded = next(iter(sim.truth))
    src, dst = flooded
    for _ in range(10):
        sim.period()
    injected = 0

    def inject(sample: ProbeSample, source: str | None = None) -> None:
        nonlocal injected
        injected += 1
        sim.perception.ingest(sample, sim.now, source)

    def probe(**changes: Any) -> ProbeSample:
        fields: dict[str, Any] = {
            "src": src,
            "dst": dst,
            "probe": "udp_echo",
            "seq": 10**9,
            "sent_at": sim.now,
        }
        fields.update(changes)
        return ProbeSample(**fields)

    for period in range(20):
        truth = sim.truth[flooded]
        for i in range(500):
            seq = 10**9 + period * 1000 + i
            kind = i % 10
            if kind == 0:
                inject(probe(seq=seq, rtt_ms=math.nan))
            elif kind == 1:
                inject(probe(seq=seq, rtt_ms=-5.0))
            elif kind == 2:
                inject(probe(src="mars-1", seq=seq, rtt_ms=1.0))
            elif kind == 3:
                inject(probe(seq=seq, sent_at=sim.now + 3600, rtt_ms=1.0))
            elif kind == 4:
                inject(probe(seq=seq, sent_at=sim.now - 3600, rtt_ms=1.0))
            elif kind == 5:
                inject(probe(seq=seq, rtt_ms=1.0, sent=1, lost=2))
            elif kind == 6:
                inject(probe(dst=src, seq=seq, rtt_ms=1.0))
            else:
                # A flood of plausible samples from one source (a prober stuck in a loop),
                # a third of them replays of one sequence number.
                replay = kind == 7
                value = max(rng.gauss(truth.rtt_ms, truth.mdev_ms), 0.1)
                inject(probe(seq=10**9 if replay else seq, sent_at=sim.now - 0.5, rtt_ms=value))
        sim.period()
    tracker = sim.perception.links[flooded]
    errors = []
    for key, link in sim.perception.links.items():
        if key != flooded and link.rtt_ms is not None:
            errors.append(abs(link.rtt_ms / sim.truth[key].rtt_ms - 1.0))
    states = sim.perception.link_states(sim.now)
    sane = all(
        math.isfinite(s.rtt_ms_p50) and s.rtt_ms_p50 >= 0 and 0 <= s.loss_rate <= 1 and math.isfinite(s.cost)
        for s in states
    )
    assert tracker.rtt_ms is not None
    return {
        "injected": injected,
        "dropped_by_reason": dict(sorted(sim.perception.dropped.items())),
        "flooded_link": f"{src}->{dst}",
        "flooded_link_rtt_error": round(abs(tracker.rtt_ms / sim.truth[flooded].rtt_ms - 1.0), 4),
        "other_links_max_rtt_error": round(max(errors), 4),
        "all_link_states_finite_and_in_range": sane,
    }


# ---- the real emulator --------------------------------------------------------------------------

EMULATED_REGIONS = ("aws-eu-central-1", "aws-us-east-2", "azure-westeurope", "gcp-southamerica-east1")
STEPPED_LINK = ("aws-eu-central-1", "aws-us-east-2")


# PLR0915: one emulator session; its closures share the live emulator.
async def _emulated(topology: Topology, *, seconds: float, seed: int) -> dict[str, Any]:  # noqa: PLR0915
    from loom.netemu import UdpProber, WanEmulator, tcp_bulk, to_sample

    regions = list(EMULATED_REGIONS)
    expected = {
        (link.src, link.dst): Expected.from_link(link)
        for link in topology.links
        if link.src in regions and link.dst in regions
    }
    perception = Perception(regions, expected=expected)
    weights = perception.link_config.weights
    async with WanEmulator(topology, regions, seed=seed) as wan:
        configured = {key: wan.link_params(*key)[0] for key in wan.pairs()}

        def true_cost(key: Pair) -> float:
            params = configured[key]
            link = topology.link(*key)
            assert link is not None
            return weights.cost_ms(
                2 * params.delay_ms,
                math.sqrt(2) * params.jitter_ms * JITTER_PER_MDEV,
                0.0,
                link.bandwidth_gbps,
            )

        def optimum(pair: Pair) -> float:
            graph = nx.DiGraph()
            for key in configured:
                graph.add_edge(*key, cost=true_cost(key))
            return float(nx.dijkstra_path_length(graph, pair[0], pair[1], weight="cost"))

        probers = {key: await UdpProber(wan.udp_address(*key), timeout_s=2.0).start() for key in wan.pairs()}
        loop = asyncio.get_running_loop()
        started = loop.time()
        step_at = seconds / 2
        stepped = False
        pairs = [(a, b) for a in regions for b in regions if a != b]
        affected: list[Pair] = []
        converged_after: int | None = None
        periods_after_step = 0
        next_tick = started + PERIOD_S
        samples = 0
        try:
            while loop.time() - started < seconds:
                for prober in probers.values():
                    prober.send()
                await asyncio.sleep(PERIOD_S / PROBES_PER_PERIOD)  # the probe pacing
                for key, prober in probers.items():
                    while not prober.results.empty():
                        perception.ingest(to_sample(key[0], key[1], prober.results.get_nowait()), time.time())
                        samples += 1
                if loop.time() < next_tick:
                    continue
                next_tick += PERIOD_S
                perception.tick(time.time())
                chosen = {pair: perception.path(pair[0], pair[1], time.time()).chosen for pair in pairs}
                if stepped:
                    periods_after_step += 1
                    right = all(
                        (c := chosen[p]) is not None
                        and sum(true_cost(k) for k in itertools.pairwise(c.nodes))
                        <= optimum(p) * (1 + TOLERANCE)
                        for p in affected
                    )
                    if right and converged_after is None:
                        converged_after = periods_after_step
                elif loop.time() - started >= step_at:
                    before = {p: optimum(p) for p in pairs}
                    old = configured[STEPPED_LINK]
                    configured[STEPPED_LINK] = replace(old, delay_ms=old.delay_ms * 3)
                    wan.set_params(*STEPPED_LINK, configured[STEPPED_LINK])
                    affected = [
                        p for p in pairs if optimum(p) != before[p] and _uses(_nodes(chosen[p]), STEPPED_LINK)
                    ]
                    stepped = True
            measured = {}
            for key in wan.pairs():
                point = perception.point_link(key[0], key[1], time.time())
                configured_rtt = 2 * configured[key].delay_ms
                measured[f"{key[0]}->{key[1]}"] = {
                    "configured_rtt_ms": round(configured_rtt, 2),
                    "configured_jitter_ms": round(configured[key].jitter_ms, 2),
                    "measured_p50_ms": round(point.rtt_ms, 2),
                    "excess_ms": round(point.rtt_ms - configured_rtt, 2),
                    "error": round(point.rtt_ms / configured_rtt - 1, 4),
                }
        finally:
            for prober in probers.values():
                await prober.close()
        link = topology.link("azure-westeurope", "aws-eu-central-1")
        assert link is not None
        bulk_key = ("azure-westeurope", "aws-eu-central-1")
        bulk_params = wan.link_params(*bulk_key)[0]
        bulk = await tcp_bulk(wan.tcp_address(*bulk_key), 1_000_000, timeout_s=30.0)
    errors = [abs(m["error"]) for m in measured.values()]
    excess = [m["excess_ms"] for m in measured.values()]
    return {
        "regions": regions,
        "links": len(configured),
        "seconds": seconds,
        "samples": samples,
        "dropped": dict(perception.dropped),
        "rtt_error_max": round(max(errors), 4),
        "rtt_error_mean": round(statistics.fmean(errors), 4),
        "rtt_excess_ms_median": round(statistics.median(excess), 2),
        "rtt_excess_note": "measured minus configured RTT: the relays' scheduling on loopback (both "
        "directions) plus sampling noise of the links' jitter",
        "links_measured": measured,
        "step": {
            "link": "->".join(STEPPED_LINK),
            "change": "delay x3 via set_params at run time",
            "affected_pairs": ["->".join(p) for p in affected],
            "periods_until_right": converged_after,
        },
        "tcp_bulk": {
            "link": "->".join(bulk_key),
            "configured_mbps": round(bulk_params.bandwidth_mbps or 0.0, 3),
            "measured_mbps": round(bulk.mbps, 3),
            "bytes": bulk.nbytes,
            "note": f"measured {link.bandwidth_gbps} Gbps emulated as Mbps (BANDWIDTH_SCALE 1e-3)",
        },
    }


# ---- driver -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure, as one JSON-able dict (headline figures first)."""
    topology = load_topology(args.topology)
    quiet = args.json

    def progress(what: str) -> None:
        if not quiet:
            print(f"  ... {what}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    conv = convergence(topology, seed=args.seed, trials=args.trials, progress=progress)
    stab = stability(topology, seed=args.seed, periods=args.stability_periods, progress=progress)
    acc = accuracy(topology, seed=args.seed, periods=args.periods, progress=progress)
    acc_single = accuracy(
        topology, seed=args.seed, periods=args.periods, progress=progress, packets_per_probe=1
    )
    acc_steady = accuracy(topology, seed=args.seed, periods=args.periods, progress=progress, episode_rate=0.0)
    cap = capacity(links_wanted=args.links, seconds=args.capacity_seconds, seed=args.seed, progress=progress)
    bad = bad_input(topology, seed=args.seed, progress=progress)
    emulated: dict[str, Any] | None = None
    if args.emulator_seconds > 0:
        progress(f"emulator on loopback ({args.emulator_seconds:.0f} s)")
        emulated = asyncio.run(_emulated(topology, seconds=args.emulator_seconds, seed=args.seed))
    return {
        "convergence_periods_max": {name: case["periods_after_step"]["max"] for name, case in conv.items()},
        "stability_path_changes_per_10_periods_max": stab["max_changes_per_10_periods"],
        "stability_path_changes_in_any_10_periods_max": stab["max_changes_in_any_10_periods"],
        "accuracy_chosen_path_excess_mean": acc["chosen_path_excess"]["mean"],
        "accuracy_chosen_path_excess_mean_single_packet_probes": acc_single["chosen_path_excess"]["mean"],
        "capacity_samples_per_s": cap["samples_per_s"],
        "emulator_step_periods_until_right": None
        if emulated is None
        else emulated["step"]["periods_until_right"],
        "emulator_rtt_error_max": None if emulated is None else emulated["rtt_error_max"],
        "targets": {
            "convergence_periods": 2,
            "stability_changes_per_10_periods": 1,
            "accuracy_excess": TOLERANCE,
            "capacity_samples_per_s": 5000,
        },
        "convergence": conv,
        "stability": stab,
        "accuracy": acc,
        "accuracy_single_packet_probes": acc_single,
        "accuracy_without_episodes": acc_steady,
        "capacity": cap,
        "bad_input": bad,
        "emulator": emulated,
        "config": {
            "topology": topology.name,
            "seed": args.seed,
            "period_s": PERIOD_S,
            "probes_per_period": PROBES_PER_PERIOD,
            "packets_per_probe": PACKETS_PER_ROUND,
            "tolerance": TOLERANCE,
            "link": _plain(LinkConfig()),
            "selector": _plain(SelectorConfig()),
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _plain(config: object) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in getattr(config, "__slots__", ()):
        value = getattr(config, name)
        if isinstance(value, int | float | str | bool | tuple):
            out[name] = value
        elif hasattr(value, "__slots__"):
            out[name] = _plain(value)
    return out


def report(result: dict[str, Any]) -> None:
    """A readable table of the headline figures on stderr."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="loom bench net (probe period 1 s)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for name, case in result["convergence"].items():
        step = case["periods_after_step"]
        recovery = case["periods_after_recovery"]
        table.add_row(f"convergence {name}: periods mean / max ({case['trials']} links)", _pair(step), "<= 2")
        table.add_row("  after the link recovers (slow by design)", _pair(recovery), "")
    stab = result["stability"]
    table.add_row(
        "stability: path changes per 10 periods, worst case", str(stab["max_changes_per_10_periods"]), "<= 1"
    )
    table.add_row(
        "  most changes in any 10 consecutive periods", str(stab["max_changes_in_any_10_periods"]), ""
    )
    table.add_row(
        "  without hysteresis: per 10 periods / in any 10",
        f"{stab['without_hysteresis_max_changes_per_10_periods']} / "
        f"{stab['without_hysteresis_max_changes_in_any_10_periods']}",
        "",
    )
    table.add_row("  degrade events, RTT swinging 1.4x-1.6x", str(len(stab["degrade_events"]["events"])), "")
    for key, label in (
        ("accuracy", "10-packet probes"),
        ("accuracy_single_packet_probes", "1-packet probes"),
        ("accuracy_without_episodes", "10-packet probes, no episodes"),
    ):
        acc = result[key]
        excess = acc["chosen_path_excess"]
        table.add_row(
            f"accuracy ({label}): excess mean / p95",
            f"{excess['mean']:.1%} / {excess['p95']:.1%}",
            "<= 5%",
        )
        table.add_row("  pairs within 5% of the optimum", f"{acc['chosen_within_5pct_fraction']:.1%}", "")
    cap = result["capacity"]
    table.add_row(
        f"capacity: samples/s ({cap['links']} links at 5 Hz)", f"{cap['samples_per_s']:,}", ">= 5,000"
    )
    emu = result["emulator"]
    if emu is not None:
        table.add_row(
            "emulator: RTT error max / median excess",
            f"{emu['rtt_error_max']:.1%} / {emu['rtt_excess_ms_median']} ms",
            "",
        )
        table.add_row(
            "emulator: periods until right after a step", str(emu["step"]["periods_until_right"]), "<= 2"
        )
        bulk = emu["tcp_bulk"]
        table.add_row(
            "emulator: TCP bulk Mbps measured / configured",
            f"{bulk['measured_mbps']} / {bulk['configured_mbps']}",
            "",
        )
    Console(stderr=True).print(table)


def _pair(summary: dict[str, Any]) -> str:
    return "-" if not summary["n"] else f"{summary['mean']} / {summary['max']}"

"""Network perception: the sole writer of link state.

A thin shell around the pure core :class:`loom.net.Perception`:

* probe samples (``loom.net.probe.<src>.<dst>``, stream NET) are decoded leniently and fed to the
  core, which refuses bad ones and counts them by reason (a sample that is not even JSON of the
  right shape, or names another link than its subject, is counted here);
* once per probe period the core evaluates every link: each link's :class:`LinkState` goes out
  on ``loom.net.link.<src>.<dst>``, degraded / recovered events on ``loom.net.event.<kind>``
  (and into ``net_link_events``), and the chosen path of every region pair is re-selected, so
  path hysteresis runs on the period's clock rather than on whoever asks; a link whose filter
  confirms a level shift in a batch of samples is evaluated (state, then event) right after that
  batch, without waiting for the tick;
* every ``persist_every_s`` (and on stop) each link's learned record goes to
  ``net_link_records``; on start they are restored, so a restart keeps the learned baselines;
* ``loom.net.query.point`` and ``loom.net.query.path`` are answered from memory (JSON).

The core's time constants are tuned for 1 s periods; :func:`configs_for_period` scales them
to the period in use, so the same behaviour (in periods) holds with the short periods of tests.
"""

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from loom.bus import ConsumerRunner, ConsumerSpec, Delivery
from loom.bus.publisher import Outgoing
from loom.bus.reply import answerable, respond
from loom.model.topology import Topology
from loom.net import (
    LinkConfig,
    LinkEvent,
    NetError,
    PathAnswer,
    Perception,
    SelectorConfig,
    ValidationConfig,
)
from loom.runtime.service import ServiceContext
from loom.store import links
from loom.store.pool import transaction
from loom.telemetry import metrics as prom
from loom_proto import subjects
from loom_proto.codec import DecodeError, decode, encode
from loom_proto.net import LinkDegraded, LinkRecovered, LinkState, RawProbeSample, TransferObserved

log = structlog.get_logger("network-perception")

DESIGN_PERIOD_S = 1.0
"""The probe period the core's defaults are tuned for."""


def configs_for_period(period_s: float) -> tuple[LinkConfig, SelectorConfig, ValidationConfig]:
    """The core's link, path and admission settings with every time constant scaled to ``period_s``.

    Horizons, TTL, hold, decay and dwell times keep their length in periods; the admitted sample
    rate grows as the period shrinks (probes per period stay the same). The forecast's daily
    profile and the job-feedback fade are about wall-clock time and are left alone.
    """
    if not (math.isfinite(period_s) and period_s > 0):
        raise ValueError(f"period_s must be positive, got {period_s!r}")
    f = period_s / DESIGN_PERIOD_S
    link = LinkConfig()
    link = replace(
        link,
        horizons_s=tuple(h * f for h in link.horizons_s),
        ttl_s=link.ttl_s * f,
        stale_ramp_s=link.stale_ramp_s * f,
        decay_tau_s=link.decay_tau_s * f,
        flap_tau_s=link.flap_tau_s * f,
        loss_horizon_s=link.loss_horizon_s * f,
        recover_hold_s=link.recover_hold_s * f,
        baseline_tau_s=link.baseline_tau_s * f,
    )
    selector = SelectorConfig()
    selector = replace(selector, min_dwell_s=selector.min_dwell_s * f)
    validation = ValidationConfig()
    validation = replace(validation, rate_per_link_hz=validation.rate_per_link_hz / f)
    return link, selector, validation


@dataclass(slots=True)
class PathTrack:
    """The chosen path of one region pair as the periods saw it."""

    nodes: tuple[str, ...] | None
    changed_at: float
    changes: int = 0
    reason: str = ""


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def event_message(event: LinkEvent) -> LinkDegraded | LinkRecovered:
    """The wire form of a core event."""
    kind = LinkDegraded if event.kind == "degraded" else LinkRecovered
    return kind(
        src=event.src,
        dst=event.dst,
        at=event.at,
        reason=event.reason[:500],
        rtt_ms=_finite(event.rtt_ms),
        baseline_rtt_ms=max(event.baseline_rtt_ms, 0.0),
        loss_rate=min(max(event.loss_rate, 0.0), 1.0),
    )


def path_json(answer: PathAnswer, track: PathTrack | None) -> dict[str, Any]:
    """A path answer as the query replies it."""
    return {
        "src": answer.src,
        "dst": answer.dst,
        "path": msgspec.to_builtins(answer.chosen) if answer.chosen else None,
        "best": msgspec.to_builtins(answer.best) if answer.best else None,
        "reason": answer.reason,
        "changed_at": track.changed_at if track else None,
        "changes": track.changes if track else 0,
    }


class NetworkPerception:
    """The service; :meth:`run` is its body."""

    def __init__(
        self,
        ctx: ServiceContext,
        topology: Topology,
        *,
        period_s: float = DESIGN_PERIOD_S,
        persist_every_s: float = 10.0,
        forecast_horizon_s: float = 300.0,
    ) -> None:
        self.ctx = ctx
        self.pool = ctx.db
        self.period_s = period_s
        self.persist_every_s = persist_every_s
        self.forecast_horizon_s = forecast_horizon_s
        link, selector, validation = configs_for_period(period_s)
        self.perception = Perception.from_topology(
            topology, link_config=link, validation=validation, selector=selector
        )
        self.regions = sorted(self.perception.regions)
        self.paths: dict[tuple[str, str], PathTrack] = {}
        self.refused = {"undecodable": 0, "subject_mismatch": 0}
        self.counts = {
            "ticks": 0,
            "events": 0,
            "path_changes": 0,
            "states_published": 0,
            "shift_evaluations": 0,
            "state_publish_failures": 0,
        }
        self.restored = 0
        self.transfers = 0
        self.persisted_at = 0.0
        self.epoch = int(time.time() * 1000)
        self._refresh_stats()

    # ---- state ---------------------------------------------------------------------------------

    async def load(self) -> int:
        """Restore every link's learned record from PostgreSQL; how many were restored."""
        records = await links.load_link_records(self.pool)
        self.restored = self.perception.restore(records)
        self._refresh_stats()
        log.info("link records restored", links=self.restored)
        return self.restored

    async def persist(self, now: float) -> None:
        """Write every link's learned record."""
        records = self.perception.records(now)
        async with transaction(self.pool) as conn:
            await links.save_link_records(conn, records)
        self.persisted_at = now

    def _refresh_stats(self) -> None:
        p = self.perception
        self.ctx.stats.update(
            {
                "period_s": self.period_s,
                "accepted": p.accepted,
                "dropped": dict(p.dropped),
                "refused": dict(self.refused),
                "restored": self.restored,
                "transfers": self.transfers,
                "transfers_refused": p.transfers_refused,
                "links": len(p.links),
                "degraded": sorted(f"{s}->{d}" for (s, d), t in p.links.items() if t.degraded),
                **self.counts,
            }
        )

    # ---- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume samples, tick once per period and answer queries until asked to stop."""
        await self.load()
        runner: ConsumerRunner[bytes] = ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="NET",
                durable="network-perception-probes",
                filter_subjects=[subjects.PROBE_SAMPLES_ALL],
                batch=500,
                max_deliver=1,
            ),
            bytes,
            batch_handler=self.on_samples,
            publisher=self.ctx.publisher,
            # Samples are evaluated once per period: gather what arrives within a tenth of one
            # into a batch (two pull requests per batch) rather than pulling each sample alone.
            linger_s=self.period_s / 10,
            callback_pull=True,
        )
        transfers: ConsumerRunner[TransferObserved] = ConsumerRunner(
            self.ctx.nc,
            ConsumerSpec(
                stream="NET",
                durable="network-perception-transfers",
                filter_subjects=[subjects.NET_TRANSFERS_ALL],
                batch=100,
            ),
            TransferObserved,
            handler=self.on_transfer,
            publisher=self.ctx.publisher,
        )
        subs = [
            await self.ctx.nc.subscribe(subjects.NET_QUERY_POINT, cb=self.on_point),
            await self.ctx.nc.subscribe(subjects.NET_QUERY_PATH, cb=self.on_path),
        ]
        await runner.start()
        await transfers.start()
        watchdog = self.ctx.watchdog
        loops = [
            watchdog.watch_consumer("probes", runner),
            watchdog.watch_consumer("transfers", transfers),
            watchdog.supervise("tick", self._tick_loop),
        ]
        try:
            await self.ctx.stopping.wait()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await transfers.stop()
            await runner.stop()
            try:
                await self.persist(time.time())
            except Exception as exc:
                log.warning("final persist failed", error=repr(exc))

    async def on_samples(self, deliveries: list[Delivery[bytes]]) -> Sequence[BaseException | None]:
        """Feed a batch of samples to the core; refusals are counted, never retried."""
        now = time.time()
        for d in deliveries:
            tokens = d.subject.split(".")
            try:
                sample = decode(d.message, RawProbeSample)  # size, depth and repeated keys checked
            except DecodeError:
                self.refused["undecodable"] += 1
                continue
            if len(tokens) != 5 or (sample.src, sample.dst) != (tokens[3], tokens[4]):
                self.refused["subject_mismatch"] += 1
                continue
            self.perception.ingest(sample, now, source=tokens[3])
        if self.perception.shifted():
            await self.on_shift(now)
        return [None] * len(deliveries)

    async def on_shift(self, now: float) -> list[LinkEvent]:
        """Links whose level shift was just confirmed are evaluated at once, not at the next tick:
        their new state goes out first (placement prices the path as measured now), then the
        events."""
        keys = self.perception.shifted()
        events = self.perception.evaluate_shifted(now)
        self.counts["shift_evaluations"] += len(keys)
        await self._log_and_record(events)
        states = [self.perception.links[key].link_state(now) for key in keys]
        await asyncio.gather(*self._state_sends(states, now))
        await asyncio.gather(*self._event_sends(events))
        self.counts["states_published"] += len(states)
        self.counts["events"] += len(events)
        return events

    async def _log_and_record(self, events: list[LinkEvent]) -> None:
        for event in events:
            log.info(
                f"link {event.kind}", src=event.src, dst=event.dst, reason=event.reason, rtt_ms=event.rtt_ms
            )
        if events:
            await self._record_events(events)

    def _state_id(self, state: LinkState, now: float) -> str:
        """A link state's message id: one per link and tick (stamped ``now``) of this epoch."""
        return f"link-{state.src}-{state.dst}-{self.epoch}-{int(now * 1000)}"

    def _state_sends(self, states: list[LinkState], now: float) -> list[Awaitable[Any]]:
        """The retrying publishes of link states stamped ``now``."""
        return [
            self.ctx.publisher.publish(subjects.link_state(s.src, s.dst), s, msg_id=self._state_id(s, now))
            for s in states
        ]

    async def _send_states(self, states: list[LinkState], now: float) -> int:
        """Publish one period's link states as a batch (:meth:`Publisher.publish_batch`): the same
        subjects and message ids as :meth:`_state_sends`; how many the stream acknowledged."""
        outcomes = await self.ctx.publisher.publish_batch(
            [
                Outgoing(subjects.link_state(s.src, s.dst), encode(s), self._state_id(s, now), {})
                for s in states
            ]
        )
        failed = [error for error in outcomes if error is not None]
        if failed:
            log.warning("link states not published", failed=len(failed), error=repr(failed[0]))
        return len(outcomes) - len(failed)

    def _event_sends(self, events: list[LinkEvent]) -> list[Awaitable[Any]]:
        """The publishes of degraded / recovered events (one message id per event)."""
        return [
            self.ctx.publisher.publish(
                subjects.net_event(e.kind),
                event_message(e),
                msg_id=f"net-{e.kind}-{e.src}-{e.dst}-{int(e.at * 1000)}",
            )
            for e in events
        ]

    async def on_transfer(self, d: Delivery[TransferObserved]) -> None:
        """A job's transfer between regions: what the link really carried weighs on its cost."""
        t = d.message
        if d.subject != subjects.net_transfer(t.src, t.dst):
            self.refused["subject_mismatch"] += 1
            return
        if self.perception.observe_transfer(t.src, t.dst, t.observed_gbps, time.time(), t.expected_gbps):
            self.transfers += 1
        self._refresh_stats()

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.period_s
            await asyncio.sleep(max(due - loop.time(), 0.0))  # the period's clock
            try:
                await self.tick(time.time())
            except Exception as exc:
                log.warning("tick failed", error=repr(exc))
            if loop.time() - due > self.period_s:
                due = loop.time()  # fell behind: skip the missed periods rather than rush them

    async def tick(self, now: float) -> list[LinkEvent]:
        """One period: evaluate links, publish states and events, re-select paths, persist."""
        events = self.perception.tick(now)
        self.counts["ticks"] += 1
        await self._log_and_record(events)
        for src in self.regions:
            for dst in self.regions:
                if src != dst:
                    self.select(src, dst, now)
        states = self.perception.link_states(now)
        for st in states:
            prom.LINK_RTT.labels(st.src, st.dst).set(st.rtt_ms_p50)
            prom.LINK_LOSS.labels(st.src, st.dst).set(st.loss_rate)
            prom.LINK_COST.labels(st.src, st.dst).set(st.cost)
        # The period's states go out as one batch, their acks awaited together (one attempt: a
        # state that fails is superseded by the next period's); events keep retrying publishes.
        sent, _ = await asyncio.gather(
            self._send_states(states, now), asyncio.gather(*self._event_sends(events))
        )
        self.counts["state_publish_failures"] += len(states) - sent
        self.counts["states_published"] += sent
        self.counts["events"] += len(events)
        if now - self.persisted_at >= self.persist_every_s:
            await self.persist(now)
        self._refresh_stats()
        return events

    async def _record_events(self, events: list[LinkEvent]) -> None:
        async with transaction(self.pool) as conn:
            await links.append_link_events(conn, events)

    def select(self, src: str, dst: str, now: float) -> tuple[PathAnswer, PathTrack]:
        """The pair's chosen path now (with hysteresis); a change is counted and logged."""
        answer = self.perception.path(src, dst, now)
        nodes = answer.chosen.nodes if answer.chosen else None
        track = self.paths.get((src, dst))
        if track is None:
            track = self.paths[src, dst] = PathTrack(nodes, now, 0, answer.reason)
        elif nodes != track.nodes:
            log.info("path changed", src=src, dst=dst, old=track.nodes, new=nodes, reason=answer.reason)
            track.nodes, track.changed_at, track.reason = nodes, now, answer.reason
            track.changes += 1
            self.counts["path_changes"] += 1
        return answer, track

    # ---- queries -------------------------------------------------------------------------------

    async def on_point(self, msg: Msg) -> None:
        """``loom.net.query.point``: ``{src, dst}`` a link, ``{region}`` a region, ``{}`` every link.

        ``horizon_s`` (default 300) sets how far ahead the RTT forecast looks.
        """
        if not answerable(msg):  # a reply that is no inbox: dropped (loom.bus.reply)
            return
        try:
            body = _request(msg)
            now = time.time()
            horizon_s = float(body.get("horizon_s", self.forecast_horizon_s))
            p = self.perception
            result: Any
            if body.get("src") is not None or body.get("dst") is not None:
                result = p.point_link(str(body.get("src")), str(body.get("dst")), now, horizon_s)
            elif body.get("region") is not None:
                result = p.point_region(str(body["region"]), now, horizon_s)
            else:
                result = [p.point_link(s, d, now, horizon_s) for s, d in sorted(p.links)]
            reply = msgspec.json.encode({"ok": True, "result": result})
        except (NetError, ValueError, TypeError) as exc:  # the request's fault (an unknown region)
            reply = json.dumps({"ok": False, "error": str(exc), "invalid": True}).encode()
        await respond(msg, reply)

    async def on_path(self, msg: Msg) -> None:
        """``loom.net.query.path``: ``{src, dst}`` -> the chosen path, the momentary best, and why."""
        if not answerable(msg):  # a reply that is no inbox: dropped (loom.bus.reply)
            return
        try:
            body = _request(msg)
            src, dst = body.get("src"), body.get("dst")
            if not isinstance(src, str) or not isinstance(dst, str):
                raise ValueError("give src and dst")
            if src == dst:
                raise ValueError("src and dst are the same region")
            answer, track = self.select(src, dst, time.time())
            reply = msgspec.json.encode({"ok": True, "result": path_json(answer, track)})
        except (NetError, ValueError, TypeError) as exc:  # the request's fault (an unknown region)
            reply = json.dumps({"ok": False, "error": str(exc), "invalid": True}).encode()
        await respond(msg, reply)


def _request(msg: Msg) -> dict[str, Any]:
    try:
        body = json.loads(msg.data or b"{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"the request is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("the request must be a JSON object")
    return body

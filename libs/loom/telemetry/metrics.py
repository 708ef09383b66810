"""Prometheus metrics: every family Loom exports, in one registry, and the /metrics endpoint.

Uses ``prometheus-client``, the Prometheus project's own Python client (the standard, well kept,
no dependencies). Every metric a Loom process exports is defined here, once, in :data:`REGISTRY`,
so services never define their own copies, the Grafana dashboards can be checked against the list
(``tests/unit/test_dashboards.py`` reads :func:`exported_names`), and ``/metrics`` of any service
shows the same families (those a service never touches stay empty).

A service process serves ``/metrics`` when ``LOOM_METRICS_PORT`` is set (``loom up`` gives each
service its own port and lists them in ``loom status``; compose sets 9464): :func:`serve_metrics`,
called by :func:`loom.runtime.service.run`. Labels name regions, clusters, links, consumers,
tenants and teams, never jobs, so the number of series stays bounded.

The endpoint shows every tenant's usage and cost, so it listens on 127.0.0.1 unless
``LOOM_METRICS_ADDR`` says otherwise (compose: 0.0.0.0, inside its own network; before, every
service listened on every interface, prometheus-client's default), and on a secured stack it
answers only the stack's bearer token (:mod:`loom.security.http_token`).
"""

import os
import socket
import threading
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.process_collector import ProcessCollector

from loom.security.http_token import Token, authorized, reply, token_file_from_env

__all__ = [
    "CLUSTER_FREE_GPUS",
    "CLUSTER_GPUS",
    "CLUSTER_STALE",
    "CLUSTER_WATER_LEVEL",
    "CONSUMER_LAG",
    "CONSUMER_MESSAGES",
    "CONSUMER_REDELIVERIES",
    "DEAD_LETTERS",
    "DECISIONS",
    "DECISION_LATENCY",
    "ENV_METRICS_ADDR",
    "ENV_METRICS_PORT",
    "LINK_COST",
    "LINK_LOSS",
    "LINK_RTT",
    "METERED_RUNS",
    "PLACEMENTS",
    "QUEUE_AGE",
    "QUEUE_DEPTH",
    "REGISTRY",
    "SERVICE_INFO",
    "USAGE_COST",
    "USAGE_GPU_SECONDS",
    "exported_names",
    "serve_metrics",
]

ENV_METRICS_PORT = "LOOM_METRICS_PORT"
"""The port a service serves ``/metrics`` on (0: any free port); unset: no endpoint."""
ENV_METRICS_ADDR = "LOOM_METRICS_ADDR"
"""The address ``/metrics`` listens on (default 127.0.0.1; compose sets 0.0.0.0)."""

REGISTRY = CollectorRegistry()
"""Every Loom metric (and the process's CPU, memory and file descriptors)."""
ProcessCollector(registry=REGISTRY)

SERVICE_INFO = Gauge(
    "loom_service_info", "1 for each running Loom service process", ["service"], registry=REGISTRY
)

# ---- placement -------------------------------------------------------------------------------------
QUEUE_DEPTH = Gauge("loom_queue_depth", "Jobs waiting in placement's queue", ["shard"], registry=REGISTRY)
QUEUE_AGE = Gauge(
    "loom_queue_oldest_age_seconds",
    "How long the oldest queued job has waited since it was submitted",
    ["shard"],
    registry=REGISTRY,
)
DECISIONS = Counter(
    "loom_decisions",
    "Jobs decided by placement cycles (rate() gives decisions/s)",
    ["shard"],
    registry=REGISTRY,
)
DECISION_LATENCY = Histogram(
    "loom_decision_latency_seconds",
    "Wall time of one placement cycle's decision (the pure core, no I/O)",
    ["shard"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
PLACEMENTS = Counter(
    "loom_placements",
    "Placement outcomes: placed, rejected, waiting, preempted, requeued, resized",
    ["shard", "outcome"],
    registry=REGISTRY,
)

# ---- the bus ---------------------------------------------------------------------------------------
CONSUMER_LAG = Gauge(
    "loom_consumer_lag_messages",
    "Messages still pending for a durable consumer (as of its last fetch)",
    ["consumer"],
    registry=REGISTRY,
)
CONSUMER_REDELIVERIES = Counter(
    "loom_consumer_redeliveries", "Messages delivered more than once", ["consumer"], registry=REGISTRY
)
CONSUMER_MESSAGES = Counter(
    "loom_consumer_messages",
    "Messages settled by a consumer, by outcome (acked, nacked, dead_lettered)",
    ["consumer", "outcome"],
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "loom_dead_letters",
    "Messages parked in the dead-letter stream",
    ["consumer", "stream"],
    registry=REGISTRY,
)

# ---- the network -----------------------------------------------------------------------------------
LINK_RTT = Gauge(
    "loom_link_rtt_ms", "Round-trip time of a region-to-region link", ["src", "dst"], registry=REGISTRY
)
LINK_LOSS = Gauge("loom_link_loss_ratio", "Packet loss of a link (0-1)", ["src", "dst"], registry=REGISTRY)
LINK_COST = Gauge(
    "loom_link_cost",
    "Routing cost of a link (what path finding minimises)",
    ["src", "dst"],
    registry=REGISTRY,
)

# ---- capacity --------------------------------------------------------------------------------------
CLUSTER_GPUS = Gauge("loom_cluster_gpus", "GPUs of a cluster", ["region", "cluster"], registry=REGISTRY)
CLUSTER_FREE_GPUS = Gauge(
    "loom_cluster_free_gpus",
    "GPUs of a cluster neither used nor reserved",
    ["region", "cluster"],
    registry=REGISTRY,
)
CLUSTER_WATER_LEVEL = Gauge(
    "loom_cluster_water_level_ratio",
    "Share of a cluster's GPUs in use or reserved (0-1)",
    ["region", "cluster"],
    registry=REGISTRY,
)
CLUSTER_STALE = Gauge(
    "loom_cluster_stale", "1 when a cluster's heartbeats stopped", ["region", "cluster"], registry=REGISTRY
)

# ---- metering --------------------------------------------------------------------------------------
USAGE_GPU_SECONDS = Gauge(
    "loom_usage_gpu_seconds",
    "GPU-seconds metered so far (all time), by tenant, team label, region and GPU model",
    ["tenant", "team", "region", "gpu_model"],
    registry=REGISTRY,
)
USAGE_COST = Gauge(
    "loom_usage_cost",
    "Charges metered so far (all time, currency of the price table), by tenant, team, region, model",
    ["tenant", "team", "region", "gpu_model"],
    registry=REGISTRY,
)
METERED_RUNS = Counter(
    "loom_metered_runs", "Job attempts metered into usage rows", ["tenant"], registry=REGISTRY
)

INCIDENTS_OPEN = Gauge(
    "loom_incidents_open",
    "Incidents not resolved (open or acknowledged), by severity",
    ["severity"],
    registry=REGISTRY,
)


def _sample_names(metric: MetricWrapperBase) -> Iterable[str]:
    name = metric._name
    kind = metric._type
    if kind == "counter":
        return (f"{name}_total",)
    if kind == "histogram":
        return (f"{name}_bucket", f"{name}_sum", f"{name}_count")
    return (name,)


def exported_names() -> frozenset[str]:
    """Every sample name a Loom ``/metrics`` can show: the families of :data:`REGISTRY` with the
    suffixes their type adds (``_total``; ``_bucket``, ``_sum``, ``_count``)."""
    names: set[str] = set()
    for collector in list(REGISTRY._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            names.update(_sample_names(collector))
        else:
            names.update(sample.name for family in collector.collect() for sample in family.samples)
    return frozenset(names)


def serve_metrics(
    service: str, port: int | None = None, *, addr: str | None = None, token: Token = None
) -> int | None:
    """Serve ``/metrics`` on ``port`` (default ``$LOOM_METRICS_PORT``) of ``addr`` (default
    ``$LOOM_METRICS_ADDR``, else 127.0.0.1); returns the port, or None when no port is configured.
    ``token`` (default: the stack's, from ``$LOOM_HTTP_TOKEN_FILE``; None: open) is the bearer
    token a scrape must carry. The server runs in a daemon thread."""
    if port is None:
        text = os.environ.get(ENV_METRICS_PORT, "").strip()
        if not text:
            SERVICE_INFO.labels(service).set(1)
            return None
        port = int(text)
    if addr is None:
        addr = os.environ.get(ENV_METRICS_ADDR, "").strip() or "127.0.0.1"
    if token is None:
        token = token_file_from_env()
    server_class = _IPv6Server if ":" in addr else ThreadingHTTPServer  # "::" as prometheus-client took it
    server = server_class((addr, port), _metrics_handler(token))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    SERVICE_INFO.labels(service).set(1)
    return int(server.server_address[1])


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _metrics_handler(token: Token) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not authorized(self.headers.get("Authorization"), token):
                self._reply(HTTPStatus.UNAUTHORIZED, b"a bearer token is needed\n", "text/plain")
                return
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self._reply(HTTPStatus.NOT_FOUND, b"only /metrics is served\n", "text/plain")
                return
            self._reply(HTTPStatus.OK, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)

        def _reply(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            reply(self, status, body, content_type)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape every few seconds is not news

    return Handler

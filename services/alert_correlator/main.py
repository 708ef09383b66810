"""Entry point: ``loom-alert-correlator [--topology FILE] [--http-port P] [--webhook URL]...``."""

import argparse
import os
from urllib.parse import urlsplit

from loom.alerts import CorrelatorConfig
from loom.model.topology import load_topology
from loom.runtime.service import ServiceContext, run
from loom.security.http_token import ENV_WEBHOOK_TOKEN_FILE, token_file_from_env
from loom_services.alert_correlator.service import AlertCorrelator

ENV_HTTP_PORT = "LOOM_ALERTS_HTTP_PORT"
ENV_WATCH_HEALTH = "LOOM_WATCH_HEALTH"
"""Comma-separated service instances whose health the correlator watches (docker-compose)."""
DEFAULT_HTTP_PORT = 9095


_DEFAULTS = CorrelatorConfig()


def _webhook(url: str) -> str:
    if urlsplit(url).scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"webhook {url!r}: http:// or https:// only")
    return url


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="loom-alert-correlator", description="Loom alert correlator: alerts in, incidents out"
    )
    parser.add_argument("--topology", default=None, help="topology file or packaged name (default: default)")
    parser.add_argument("--http-host", default="127.0.0.1", help="where the Alertmanager webhook listens")
    parser.add_argument(
        "--http-port",
        type=int,
        default=int(os.environ.get(ENV_HTTP_PORT, DEFAULT_HTTP_PORT)),
        help=f"webhook port (default ${ENV_HTTP_PORT} or {DEFAULT_HTTP_PORT}; 0: any free port; -1: none)",
    )
    parser.add_argument(
        "--webhook", type=_webhook, action="append", default=[], help="POST each incident change here"
    )
    parser.add_argument("--group-wait-s", type=float, default=_DEFAULTS.group_wait_s)
    parser.add_argument("--update-interval-s", type=float, default=_DEFAULTS.min_update_interval_s)
    parser.add_argument("--max-notifications-per-min", type=int, default=_DEFAULTS.max_notifications_per_min)
    parser.add_argument(
        "--refresh-s", type=float, default=2.0, help="how often the placements snapshot is re-read"
    )
    parser.add_argument(
        "--watch-health",
        action="append",
        default=[n for n in os.environ.get(ENV_WATCH_HEALTH, "").split(",") if n],
        metavar="INSTANCE",
        help=f"a Loom service instance whose health answers are watched (repeat; also ${ENV_WATCH_HEALTH})",
    )
    parser.add_argument("--health-period-s", type=float, default=5.0, help="how often each is asked")
    parser.add_argument("--health-timeout-s", type=float, default=2.0, help="how long an answer may take")
    parser.add_argument(
        "--health-misses", type=int, default=3, help="answers missed in a row before the alert fires"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = parse_args(argv)
    topology = load_topology(args.topology)
    config = CorrelatorConfig(
        group_wait_s=args.group_wait_s,
        min_update_interval_s=args.update_interval_s,
        max_notifications_per_min=args.max_notifications_per_min,
    )

    # The webhook answers only a secured stack's token (compose names the webhook's own file).
    http_token = token_file_from_env(variable=ENV_WEBHOOK_TOKEN_FILE) or token_file_from_env()

    async def body(ctx: ServiceContext) -> None:
        await AlertCorrelator(
            ctx,
            topology,
            config=config,
            http_host=args.http_host,
            http_port=None if args.http_port < 0 else args.http_port,
            webhooks=args.webhook,
            refresh_s=args.refresh_s,
            watch_health=args.watch_health,
            health_period_s=args.health_period_s,
            health_timeout_s=args.health_timeout_s,
            health_misses=args.health_misses,
            http_token=http_token,
        ).run()

    run("alert-correlator", body)


if __name__ == "__main__":
    main()

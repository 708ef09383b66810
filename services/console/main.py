"""Entry point of the web console: ``loom-console`` or ``python -m loom_services.console``."""

import argparse
import os
import sys

from loom.model.topology import load_topology
from loom.runtime.config import loom_home
from loom.runtime.service import ServiceContext, run
from loom.runtime.tokens import ensure_tokens
from loom.telemetry.jaeger import DEFAULT_JAEGER_URL, JAEGER_URL_ENV
from loom_services.console.service import serve


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    parser = argparse.ArgumentParser(prog="loom-console")
    parser.add_argument("--topology", default="default")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8420)
    parser.add_argument(
        "--jaeger-url",
        default=os.environ.get(JAEGER_URL_ENV, DEFAULT_JAEGER_URL),
        help=f"base URL of the Jaeger UI for trace links (${JAEGER_URL_ENV}; empty: no links)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    topology = load_topology(args.topology)
    tokens = ensure_tokens(loom_home())

    async def body(ctx: ServiceContext) -> None:
        await serve(ctx, topology, tokens, host=args.host, port=args.port, jaeger_url=args.jaeger_url or None)

    run("console", body)


if __name__ == "__main__":
    main()

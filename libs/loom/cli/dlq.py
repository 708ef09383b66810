"""``loom dlq list|show|replay|purge``: inspect dead letters, replay them idempotently, purge with a reason.

The logic lives in :mod:`loom.bus.dlq`; this module parses arguments and prints.
"""

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import nats.errors
from nats.aio.client import Client
from rich.markup import escape
from rich.table import Table

from loom.bus.connection import BusError, connect
from loom.bus.dlq import DeadLetter, DeadLetters, parse_since
from loom.cli import CONNECT_WITHIN_S
from loom.cli.output import console, err
from loom.errors import InvalidInputError, LoomError
from loom.runtime.config import nats_endpoint
from loom.security import tenant_of

_ERROR_WIDTH = 60


def add_parser(sub: Any) -> None:
    """Register ``loom dlq`` and its subcommands on the top-level subparsers."""
    dlq = sub.add_parser("dlq", help="dead letters: list, show, replay, purge")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = dlq_sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    p = add("list", cmd_list, "dead letters, oldest first, with the error that stopped each")
    p.add_argument("--subject", help="only those of this original subject (wildcards * and > allowed)")
    p.add_argument("--since", help="only those dead-lettered since: a duration (15m, 2h, 1d) or an ISO time")
    p.add_argument("--json", action="store_true")
    p = add("show", cmd_show, "one dead letter: its headers and its payload")
    p.add_argument("seq", type=int, help="the dead letter's sequence number (from `loom dlq list`)")
    p.add_argument("--json", action="store_true")
    p = add(
        "replay",
        cmd_replay,
        "republish dead letters to their original subject with their original message id",
    )
    p.add_argument("seqs", nargs="*", type=int, metavar="SEQ")
    p.add_argument("--subject", help="every dead letter of this original subject")
    p.add_argument("--since", help="every dead letter since: a duration (15m, 2h, 1d) or an ISO time")
    p.add_argument("--all", action="store_true", help="every dead letter")
    p.add_argument("--again", action="store_true", help="replay entries already replayed too")
    p.add_argument("--json", action="store_true")
    p = add("purge", cmd_purge, "delete dead letters for good (a reason is required and logged)")
    p.add_argument("seqs", nargs="*", type=int, metavar="SEQ")
    p.add_argument("--subject", help="every dead letter of this original subject")
    p.add_argument("--all", action="store_true", help="every dead letter")
    p.add_argument("--reason", default="", help="why they can go (required; kept with the purge record)")


def _nats_url() -> str:
    return nats_endpoint()


def _identity(url: str) -> str:
    """The identity of the client's NATS credentials ("" when open or unreadable)."""
    from loom.bus.connection import identity_at

    try:
        return identity_at(url) or ""
    except LoomError:
        return ""


def _with_dead_letters(work: Callable[[DeadLetters], Awaitable[int]]) -> int:
    async def go() -> int:
        url = _nats_url()
        try:
            # Given up within a few seconds, quietly (a bare first connect retried ~60 times and
            # logged a traceback each time: ~3 minutes and thousands of lines with no stack up).
            nc: Client = await connect(url, "loom-dlq", first_within_s=CONNECT_WITHIN_S)
        except BusError as exc:
            err.print(f"[red]{escape(str(exc))}[/red]")
            return 1
        try:
            return await work(DeadLetters(nc))
        except (nats.errors.Error, TimeoutError) as exc:
            # A tenant's credentials may not read the DLQ: a traceback said nothing of why.
            who = _identity(url)
            if tenant_of(who) is not None:
                err.print(f"[red]refused: dead letters are the operator's, and this is {escape(who)}[/red]")
            else:
                err.print(f"[red]the dead letters could not be read: {escape(repr(exc))}[/red]")
            return 1
        finally:
            await nc.close()

    try:
        return asyncio.run(go())
    except InvalidInputError as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    except LoomError as exc:
        err.print(f"[red]{exc}[/red]")
        return 1


def _since(args: argparse.Namespace) -> datetime | None:
    return parse_since(args.since) if args.since else None


def _short(text: str | None, width: int = _ERROR_WIDTH) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def cmd_list(args: argparse.Namespace) -> int:
    """List dead letters."""
    since = _since(args)

    async def work(dlq: DeadLetters) -> int:
        letters = await dlq.entries(subject=args.subject, since=since)
        if args.json:
            print(json.dumps([letter.summary() for letter in letters], indent=2))
            return 0
        table = Table(title=f"{len(letters)} dead letter(s)")
        for col in (
            "seq",
            "time",
            "original subject",
            "consumer",
            "error type",
            "error",
            "deliveries",
            "replayed",
        ):
            table.add_column(col)
        for letter in letters:
            replayed = (
                "-" if letter.replay is None else f"{letter.replay.times}x, {letter.replay.at:%H:%M:%S}"
            )
            table.add_row(
                str(letter.seq),
                f"{letter.time:%Y-%m-%d %H:%M:%S}" if letter.time else "-",
                letter.original_subject,
                letter.consumer or "-",
                letter.error_type or "-",
                _short(letter.error),
                str(letter.deliveries) if letter.deliveries is not None else "-",
                replayed,
            )
        console.print(table)
        return 0

    return _with_dead_letters(work)


def _payload(letter: DeadLetter) -> Any:
    try:
        return json.loads(letter.data)
    except ValueError:
        return letter.data.decode(errors="replace")


def cmd_show(args: argparse.Namespace) -> int:
    """Show one dead letter."""

    async def work(dlq: DeadLetters) -> int:
        letter = await dlq.get(args.seq)
        if args.json:
            print(
                json.dumps(
                    {**letter.summary(), "headers": letter.headers, "payload": _payload(letter)}, indent=2
                )
            )
            return 0
        console.print(f"[bold]dead letter #{letter.seq}[/bold]  {letter.time or ''}")
        table = Table(show_header=False)
        table.add_column("header", style="bold")
        table.add_column("value", overflow="fold")
        for name, value in sorted(letter.headers.items()):
            table.add_row(name, value)
        if letter.replay is not None:
            table.add_row(
                "(replayed)",
                f"{letter.replay.times}x, last at {letter.replay.at.isoformat()} "
                f"(stream seq {letter.replay.stream_seq})",
            )
        console.print(table)
        payload = _payload(letter)
        console.print("[bold]payload[/bold]")
        if isinstance(payload, str):
            console.print(payload, highlight=False, markup=False)
        else:
            console.print_json(data=payload)
        return 0

    return _with_dead_letters(work)


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay dead letters to their original subjects."""
    if not (args.seqs or args.subject or args.since or args.all):
        err.print("[red]name what to replay: SEQ..., --subject, --since or --all[/red]")
        return 2
    since = _since(args)

    async def work(dlq: DeadLetters) -> int:
        letters = await dlq.select(args.seqs, subject=args.subject, since=since)
        results = await dlq.replay(letters, again=args.again)
        if args.json:
            print(json.dumps([r.__dict__ for r in results], indent=2))
            return _replay_code(results)
        for r in results:
            if r.outcome == "replayed":
                console.print(f"#{r.seq}: replayed to {r.subject} (id {r.msg_id}, stream seq {r.stream_seq})")
            elif r.outcome == "not_replayable":
                console.print(f"#{r.seq}: [red]not replayable[/red]: {escape(r.why or '')}")
            elif r.outcome == "skipped":
                console.print(
                    f"#{r.seq}: [yellow]skipped[/yellow], replayed before (--again to replay it anyway)"
                )
            else:
                console.print(
                    f"#{r.seq}: [yellow]not delivered[/yellow]: the stream still holds id {r.msg_id} in its "
                    "duplicate window (the original was published moments ago); replay again later"
                )
        console.print(f"{sum(r.outcome == 'replayed' for r in results)} of {len(results)} replayed")
        return _replay_code(results)

    return _with_dead_letters(work)


def _replay_code(results: list[Any]) -> int:
    """1 when an entry could not be replayed or was not delivered (its id still in the stream's
    duplicate window): "0 of 2 replayed" exited 0. An entry skipped as replayed before is no failure."""
    return 1 if any(r.outcome not in ("replayed", "skipped") for r in results) else 0


def cmd_purge(args: argparse.Namespace) -> int:
    """Delete dead letters, with a reason."""
    if not args.reason.strip():
        err.print("[red]refused: purging dead letters needs --reason TEXT (it is logged and kept)[/red]")
        return 2
    if sum((bool(args.seqs), args.subject is not None, args.all)) != 1:
        err.print("[red]name what to purge: SEQ..., --subject or --all (exactly one)[/red]")
        return 2

    async def work(dlq: DeadLetters) -> int:
        result = await dlq.purge(args.seqs, subject=args.subject, everything=args.all, reason=args.reason)
        console.print(f"purged {result.deleted} dead letter(s); reason: {result.reason}")
        return 0

    return _with_dead_letters(work)

"""Every ``loom ...`` command the READMEs show names a real subcommand and real options.

A newcomer runs what README.md says; a flag renamed in the code and not in the text fails here,
not at their prompt. Options are read off the real parser (``loom.cli.main.build_parser``).
"""

import argparse
import functools
import re
from pathlib import Path

import pytest

from loom.cli.main import build_parser

ROOT = Path(__file__).parents[2]
DOCS = ("README.md", "deploy/README.md", "libs/loom/sim/README.md")

# `loom <sub> [<sub>] <rest of the command up to a backtick, a comment or the line's end>`
COMMAND = re.compile(r"(?<![\w/-])(?:\.venv/bin/)?loom ([a-z][a-z0-9-]*(?: [a-z][a-z0-9-]*)?)([^`#\n]*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands(text: str) -> list[tuple[int, list[str], list[str]]]:
    """(line, subcommand path, options) of every ``loom`` command in ``text``; a command continued
    with a trailing backslash is read as one line."""
    parser = _parser()
    found = []
    for number, line in enumerate(re.sub(r"\\\n\s*", " ", text).splitlines(), 1):
        for match in COMMAND.finditer(line):
            words = match.group(1).split()
            if words[0] not in _subparsers(parser):
                continue  # prose: "loom weaves ...", "loom view" already matched, ...
            path, current = [], parser
            for word in words:
                subs = _subparsers(current)
                if word not in subs:
                    break
                path.append(word)
                current = subs[word]
            found.append((number, path, OPTION.findall(match.group(2))))
    return found


def _options(path: list[str]) -> set[str]:
    parser = _parser()
    for word in path:
        parser = _subparsers(parser)[word]
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("doc", DOCS)
def test_every_loom_command_in_the_docs_exists_with_its_options(doc: str) -> None:
    commands = _commands((ROOT / doc).read_text())
    unknown = [
        f"{doc}:{line}: loom {' '.join(path)} {option}"
        for line, path, options in commands
        for option in options
        if option not in _options(path)
    ]
    assert not unknown, "options the parser does not know:\n" + "\n".join(unknown)


def test_the_check_reads_commands_and_catches_an_unknown_option() -> None:
    text = (
        "run `loom bench policies --grid --json` then\n"
        "```\n.venv/bin/loom usage statement --tenant acme \\\n    --month 2026-12 --bogus\n```\n"
    )
    commands = _commands(text)
    assert (1, ["bench", "policies"], ["--grid", "--json"]) in commands
    [(_, path, options)] = [c for c in commands if c[1] == ["usage", "statement"]]
    assert options == ["--tenant", "--month", "--bogus"]
    assert "--bogus" not in _options(path) and "--month" in _options(path)
    assert len(_commands((ROOT / "README.md").read_text())) > 150  # the README's commands are found

"""Every NATS subject is built by :mod:`loom_proto.subjects`: no ``"loom.…"`` subject literal elsewhere.

A subject spelled by hand drifts from the streams that hold it (a consumer filter that no stream
captures, a kind missing from a list), and skips the id validation of the builders. The scan reads
the shipped source (libs, services, benchmarks, tools), not tests: tests assert what the builders
return, so they spell subjects out on purpose.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

from loom_proto import subjects

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("libs", "services", "benchmarks", "tools")

ALLOWED: frozenset[tuple[str, str]] = frozenset()
"""(file relative to the repository root, literal) pairs that look like subjects but are not; empty today:
logger, tracer and package names (``loom.bus``, ``loom.sim``) and the span attribute ``loom.job.id``
do not start with a subject root, so they need no entry."""


def subject_roots() -> frozenset[str]:
    """The second token of every subject Loom uses (``jobs``, ``net``, ``health`` …), read from proto."""
    names = [subject for stream in subjects.STREAMS for subject in stream.subjects]
    names += [value for value in vars(subjects).values() if isinstance(value, str)]
    names.append(subjects.service_health("x"))
    names.append(subjects.dead_letter("x"))
    return frozenset(
        name.split(".")[1] for name in names if name.startswith(f"{subjects.PREFIX}.") and "." in name
    )


def leading_text(node: ast.AST) -> str | None:
    """The literal start of a string constant or an f-string, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def subject_literals(path: Path, roots: frozenset[str]) -> Iterator[tuple[int, str]]:
    """(line, text) of every string in ``path`` that starts like a Loom subject."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    # The pieces of an f-string are constants too: judge the f-string once, by its start.
    pieces = {
        id(piece) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for piece in node.values
    }
    for node in ast.walk(tree):
        text = leading_text(node)
        if text is None or id(node) in pieces or not text.startswith(f"{subjects.PREFIX}."):
            continue
        tokens = text.split(".")
        if len(tokens) > 1 and tokens[1] in roots:
            yield getattr(node, "lineno", 0), text


def test_subject_roots_cover_every_stream_and_request_subject() -> None:
    roots = subject_roots()
    assert {"jobs", "clusters", "view", "net", "alerts", "dlq", "health"} <= roots


def test_the_scan_finds_a_subject_literal_and_ignores_module_names(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        'import structlog\nlog = structlog.get_logger("loom.bus")\n'
        'A = "loom.jobs.placed.*"\nB = f"loom.net.link.{1}.x"\nC = "loom.sim"\n',
        encoding="utf-8",
    )
    found = [text for _, text in subject_literals(source, subject_roots())]
    assert found == ["loom.jobs.placed.*", "loom.net.link."]


def test_no_subject_literal_outside_proto() -> None:
    roots = subject_roots()
    offenders = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for line, text in subject_literals(path, roots):
                if (relative, text) not in ALLOWED:
                    offenders.append(f"{relative}:{line}: {text!r}")
    assert offenders == [], "build subjects with loom_proto.subjects:\n" + "\n".join(offenders)

"""The cluster agent's journal lines: written compact by msgspec, read back on newline bytes only."""

import json
from pathlib import Path

from loom_services.cluster_agent.agent import journal_line, read_journal


def test_a_label_holding_a_line_separator_survives_the_journal(tmp_path: Path) -> None:
    # msgspec writes U+2028 / U+2029 / U+0085 as they are (json.dumps escaped them); str.splitlines
    # would cut the line there and both halves would be dropped as torn.
    job = {"job_id": "j1", "labels": {"team": "a\u2028b\u2029c\u0085d"}, "allocations": [("n1", 2)]}
    path = tmp_path / "agent.jsonl"
    path.write_bytes(
        journal_line({"op": "start", "key": "j1:1", "job": job}) + journal_line({"op": "sent", "id": "m"})
    )
    entries = list(read_journal(path))
    assert [e["op"] for e in entries] == ["start", "sent"]
    assert entries[0]["job"]["labels"]["team"] == "a\u2028b\u2029c\u0085d"
    assert entries[0]["job"]["allocations"] == [["n1", 2]]


def test_a_last_line_torn_inside_a_character_is_skipped_and_the_rest_read(tmp_path: Path) -> None:
    path = tmp_path / "agent.jsonl"
    whole = journal_line({"op": "finish", "key": "j1:1"})
    torn = journal_line({"op": "start", "key": "j2:1", "job": {"labels": {"x": "\u00e9t\u00e9"}}})
    cut = torn[: torn.index("\u00e9".encode()) + 1]  # the first byte of a two-byte character
    path.write_bytes(whole + cut)
    assert list(read_journal(path)) == [{"op": "finish", "key": "j1:1"}]


def test_a_journal_written_by_json_dumps_reads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "agent.jsonl"
    old = [
        {"op": "start", "key": "j1:1", "job": {"labels": {"team": "\u2028"}}},
        {"op": "began", "key": "j1:1"},
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in old) + '{"op": "fin')
    assert list(read_journal(path)) == old

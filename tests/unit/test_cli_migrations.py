"""``loom drain`` / ``undrain`` / ``migrations``: the command line and the table (no stack)."""

from rich.console import Console

from loom.cli.main import build_parser
from loom.cli.migrations import migrations_table


def test_drain_takes_its_cluster_deadline_concurrency_and_force() -> None:
    args = build_parser().parse_args(
        ["drain", "c-weu-a", "--deadline", "600", "--concurrency", "3", "--force"]
    )
    assert (args.cluster, args.deadline, args.concurrency, args.force) == ("c-weu-a", 600.0, 3, True)
    assert build_parser().parse_args(["undrain", "c-weu-a"]).cluster == "c-weu-a"
    assert build_parser().parse_args(["migrations", "--job", "j1"]).job == "j1"


def test_the_migrations_table_shows_why_and_the_numbers() -> None:
    row = {
        "planned_at": 1_700_000_000.0,
        "job_id": "j1",
        "cause": "drain",
        "state": "completed",
        "from_cluster": "c-weu-a",
        "to_cluster": "c-sea1-a",
        "from_attempt": 1,
        "resume_step": 30,
        "steps": 100,
        "lost_steps": 0,
        "why": "drain of c-weu-a: resumes from its checkpoint at step 30 (recorded)",
    }
    console = Console(record=True, width=400)
    console.print(migrations_table([row]))
    text = console.export_text()
    assert "c-sea1-a" in text and "1 -> 2" in text and "30/100" in text and "step 30 (recorded)" in text

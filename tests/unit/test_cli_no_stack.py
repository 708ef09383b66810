"""A command with no stack to talk to says so within seconds instead of retrying forever."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "argv",
    [
        ["jobs"],
        ["view"],
        ["job", "some-job"],
        ["explain", "some-job"],
        ["net", "links"],
        ["submit", "JOB"],
        # These connected on their own: ~60 tries over ~3 minutes, a traceback logged for each.
        ["dlq", "list"],
        ["dlq", "show", "1"],
        ["ack", "inc-1"],
        ["drains"],
    ],
)
def test_a_command_without_a_stack_says_to_start_one(argv: list[str], tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps({"job_id": "j-1", "tenant": "acme", "resources": {"gpus": 1}, "work": {"steps": 1}})
    )
    argv = [str(job) if a == "JOB" else a for a in argv]
    # A stack that was started once and is gone: its state file names servers nobody answers on.
    port = _closed_port()
    (tmp_path / "stack.json").write_text(
        json.dumps(
            {"nats_url": f"nats://127.0.0.1:{port}", "database_url": f"postgresql://127.0.0.1:{port}/loom"}
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_NATS_URL", "LOOM_DATABASE_URL")}
    env["LOOM_HOME"] = str(tmp_path)
    started = time.monotonic()
    # Before the fix this never returned (reconnects forever, a connect error every 0.5 s).
    done = subprocess.run(
        [sys.executable, "-m", "loom.cli.main", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert "loom up" in done.stderr and "no NATS server answered" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) < 20, done.stderr[:2000]
    assert took < 30, f"took {took:.1f} s"  # a hang guard, not a performance figure


@pytest.mark.parametrize(
    "argv",
    [
        ["drain", "c-1", "--concurrency", "0"],
        ["drain", "c-1", "--concurrency", "65"],
        ["net", "degrade", "a", "b", "--loss", "1.5"],  # said "no emulated link a -> b" of a known link
        ["net", "degrade", "a", "b", "--rtt-factor", "-1"],
        ["net", "degrade", "a", "b", "--gbps", "0"],
        ["net", "degrade", "a", "b", "--rtt-ms", "0"],
        ["drain", "c-1", "--concurrency", "99999999999"],  # was the database's int32 error, exit 1
        ["drain", "c-1", "--deadline", "-5"],
        ["drain", "c-1", "--wait", "--timeout", "0"],
        ["jobs", "--limit", "-1"],
        ["migrations", "--limit", "0"],
        ["incidents", "--limit", "-3"],
        ["explain", "j-1", "--limit", "nan"],
    ],
)
def test_a_number_out_of_its_range_is_bad_usage_before_anything_is_asked(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli.main import main

    # No stack runs here: refused by a service or the database, it would exit 1.
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "must be" in err or "not a whole number" in err, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["usage", "statement", "--tenant", "acme", "--month", "0000-01"], "1970-9998"),  # was a traceback
        (["usage", "statement", "--tenant", "acme", "--month", "9999-12"], "1970-9998"),
        (["console", "--tenant", ""], "--tenant is empty"),  # was the operator's URL, exit 0
        (["drain", "c-1", "--timeout", "5"], "give --wait too"),  # was ignored
    ],
)
def test_input_of_the_right_shape_but_unusable_is_refused_with_exit_2(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_a_time_it_cannot_read_is_bad_input_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli.main import main

    assert main(["dlq", "list", "--since", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "Traceback" not in err


def test_progress_lines_give_a_rate_and_an_eta() -> None:
    from loom.cli.main import _progress_line

    assert _progress_line(0.5, (0.1, 1000.0), 1060.0) == "50% done, 40.0%/min, about 75 s left"
    assert _progress_line(0.2, (0.0, 1000.0), 1002.0) == "20% done, 600.0%/min, about 8 s left"
    assert _progress_line(0.3, (0.3, 1000.0), 1030.0) == "30% done"  # no progress seen yet: no rate


def test_loom_up_on_a_stack_whose_nats_does_not_answer_says_so_instead_of_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: with the stack's NATS frozen, `loom up` printed "a stack is already up" and then
    # "Loom is up", exit 0.
    from loom.cli import main as cli

    port = _closed_port()
    state = {"nats_url": f"nats://127.0.0.1:{port}", "database_url": "postgresql://x", "services": ["p"]}
    monkeypatch.setenv("LOOM_HOME", str(tmp_path))
    monkeypatch.setattr(cli.stack, "is_running", lambda _home: True)
    monkeypatch.setattr(cli.stack, "up", lambda _home, _options, progress=None: state)
    assert cli.main(["up"]) == 1
    captured = capsys.readouterr()
    assert "Loom is up" not in captured.out
    said = " ".join(captured.err.split())
    assert "the stack's processes run, but no NATS server answered" in said
    assert "Start it with" not in said  # it is started: NATS is what does not answer


def test_options_that_cannot_go_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli.main import main

    with pytest.raises(SystemExit) as exit_:  # --replicas alone was shown, --verdicts dropped
        main(["migrations", "--verdicts", "--replicas"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err


def _run(*argv: str, env: dict[str, str], module: str = "loom.cli.main") -> subprocess.CompletedProcess[str]:
    """``python -m module argv`` (the CLI by default) in ``env``, as a user runs it (wide: a path
    or a message stays on one line)."""
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        env={**env, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _loom_jobs(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`loom jobs` in ``env``."""
    return _run("jobs", env=env)


@pytest.mark.parametrize("content", [None, "not a credential file\n"])
def test_a_missing_or_malformed_credentials_file_is_named_without_a_traceback(
    content: str | None, tmp_path: Path
) -> None:
    creds = tmp_path / "tenant.creds"
    if content is not None:
        creds.write_text(content)
    out = _loom_jobs(
        dict(
            os.environ,
            LOOM_HOME=str(tmp_path),
            LOOM_NATS_URL=f"nats://127.0.0.1:{_closed_port()}",
            LOOM_DATABASE_URL="postgresql://127.0.0.1:1/loom",
            LOOM_CREDS=str(creds),
        )
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"cannot use the NATS credentials {creds}" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_command_that_needs_only_nats_does_not_ask_for_a_database_url(tmp_path: Path) -> None:
    # A tenant has a NATS URL and credentials, no database: every command demanded LOOM_DATABASE_URL.
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_DATABASE_URL", "LOOM_CREDS")}
    port = _closed_port()
    out = _loom_jobs({**env, "LOOM_HOME": str(tmp_path), "LOOM_NATS_URL": f"nats://127.0.0.1:{port}"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"no NATS server answered at nats://127.0.0.1:{port}" in out.stderr
    assert "LOOM_DATABASE_URL" not in out.stderr


def test_loom_trace_of_a_job_reads_the_stacks_trace_files_when_the_stack_is_down(tmp_path: Path) -> None:
    # The README: "prints the job's span tree from it (from its files when the stack is down)".
    # It asked placement for the job's trace id first and failed with "no NATS server answered".
    from loom.telemetry.spanstore import SpanFile

    trace_id = "ab" * 16

    def span(span_id: str, parent: str | None, name: str, job: str | None) -> dict[str, object]:
        return {
            "trace_id": trace_id,
            "span_id": span_id,
            "parent_span_id": parent,
            "name": name,
            "kind": "CONSUMER",
            "status": "UNSET",
            "service_name": "placement",
            "scope_name": "loom",
            "attributes": {"loom.job.id": job} if job else {},
            "start_time_unix_nano": 1_000,
            "end_time_unix_nano": 2_000,
        }

    SpanFile(tmp_path / "traces").append(
        [
            span("01" * 8, None, "publish loom.jobs.submitted", None),
            span("02" * 8, "01" * 8, "process loom.jobs.submitted", "j-1"),
        ]
    )
    port = _closed_port()
    (tmp_path / "stack.json").write_text(json.dumps({"nats_url": f"nats://127.0.0.1:{port}"}))
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_NATS_URL", "LOOM_JAEGER_URL")}
    env["LOOM_HOME"] = str(tmp_path)

    done = _run("trace", "j-1", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"trace {trace_id}" in done.stdout
    assert "process loom.jobs.submitted" in done.stdout and "publish loom.jobs.submitted" in done.stdout
    assert "the trace store's files name the job" in done.stderr
    unknown = _run("trace", "j-2", env=env)  # no span names it: the question's own error, exit 1
    assert unknown.returncode == 1 and "no NATS server answered" in unknown.stderr


def test_a_bare_loom_up_starts_a_home_with_the_options_it_was_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After its supervisor died, `loom up` brought a `--topology small --tenants FILE` home back
    # with the default topology and no tenant admission (an outside walk).
    from loom.cli import main

    monkeypatch.setenv("LOOM_HOME", str(tmp_path))
    tenants = tmp_path / "tenants.yaml"
    (tmp_path / main.UP_OPTIONS_FILE).write_text(
        json.dumps({"topology": "small", "tenants": str(tenants), "cluster": ["c-weu-a"], "traces": True})
    )
    parser = main.build_parser()
    bare = parser.parse_args(["up"])
    main._same_options_as_before(bare)
    assert (bare.topology, bare.tenants, bare.cluster, bare.traces) == (
        "small",
        str(tenants),
        ["c-weu-a"],
        True,
    )
    told = parser.parse_args(["up", "--topology", "default"])  # an option given: as given
    told.given = ["--topology"]  # main() notes what the command line said
    main._same_options_as_before(told)
    assert (told.topology, told.tenants, told.traces) == ("default", None, False)
    (tmp_path / main.UP_OPTIONS_FILE).write_text("not json")  # unreadable: the defaults
    again = parser.parse_args(["up"])
    main._same_options_as_before(again)
    assert again.topology == "default"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["up", "--topology", "nope"], "no packaged topology named 'nope'"),
        (["up", "--topology", "small", "--cluster", "c-nope"], "not a cluster of topology small"),
        (["up", "--time-scale", "0"], "--time-scale: must be more than 0"),
        (["up", "--heartbeat-s", "-1"], "--heartbeat-s: must be more than 0"),
        (["up", "--metrics-port-base", "70000"], "--metrics-port-base: must be within 0-65000"),
        (["up", "--neighbour-nice", "25"], "must be within 0-19, got 25"),
    ],
)
def test_loom_up_refuses_a_bad_option_before_starting_anything(
    argv: list[str], said: str, tmp_path: Path
) -> None:
    # They started every service, which crash-looped for two minutes before `loom up` gave up (1).
    done = _run(*argv, env=dict(os.environ, LOOM_HOME=str(tmp_path / "home")))
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "home" / "stack.json").exists()


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgresql://postgres:sekret@127.0.0.1:PORT/loom", "Connect call failed"),
        ("postgresql://postgres@127.0.0.1:PORT/loom?password=sekret", "Connect call failed"),
        ("postgresql://postgres:sekret@[::1/loom", "cannot be read"),  # a ValueError: a traceback
        ("notaurl", "invalid DSN"),
    ],
)
def test_loom_migrate_says_why_it_cannot_reach_the_database_without_a_traceback(url: str, said: str) -> None:
    url = url.replace("PORT", str(_closed_port()))
    env = dict(os.environ, LOOM_NATS_URL=f"nats://127.0.0.1:{_closed_port()}", LOOM_DATABASE_URL=url)
    done = _run("migrate", env=env)
    assert done.returncode == 1 and "cannot migrate the database at" in done.stderr and said in done.stderr
    assert "Traceback" not in done.stderr and "sekret" not in done.stderr


def test_a_slurm_agent_with_a_missing_slurm_conf_is_refused_at_its_start(tmp_path: Path) -> None:
    # scontrol retried the missing file for 60 s, the agent said only "slurm unreachable".
    done = _run(
        "--cluster",
        "c-weu-a",
        "--topology",
        "small",
        "--backend",
        "slurm",
        "--slurm-conf",
        str(tmp_path / "nonexistent.conf"),
        env=dict(os.environ, LOOM_HOME=str(tmp_path)),
        module="loom_services.cluster_agent",
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--slurm-conf" in done.stderr and "no such file" in done.stderr

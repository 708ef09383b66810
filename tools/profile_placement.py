"""Where the placement leader's CPU goes under ``loom bench e2e`` (issue 13): a sampling profile.

Runs ``loom bench e2e`` with the given options (its JSON result goes to ``OUT.json``), attaches
py-spy (in the dev extras' environment: ``.venv/bin/py-spy``; needs ptrace, e.g. root) to the
global shard's two placement instances (``loom_services.placement`` started by this interpreter;
either may win the lease, the one that did the work is reported) as soon as they run, and
records until the stack stops (``OUT.folded``, py-spy's raw collapsed stacks).
Only the samples under the service's event loop count (imports at start-up do not), and each is
put in one category, the first that matches in this order: tracing (OpenTelemetry), logging,
Prometheus, the decide phase (``run_cycle``), the write (``_write``/``apply_cycle``), publishing
(the outbox relay), lifecycle reports, admission (claim, insert, commit), message decoding, acks,
the NATS client, asyncpg, the event loop itself. Prints one JSON object: the share of each, and
with the bench's ``cpu_ms_per_job`` of placement, the CPU milliseconds per job of each::

    .venv/bin/python tools/profile_placement.py --out /tmp/prof -- --jobs 3000 --paced-jobs 0

``--rate`` is py-spy's sampling rate (250/s by default, ``--nonblocking``: the leader is never
paused, so the profile costs it nothing but the samples may be slightly skewed).
"""

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CATEGORIES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    # (name, any frame's file contains one of, any frame's function is one of)
    # py-spy names a site-packages file from its package down: opentelemetry's are trace/...,
    # propagate/..., baggage/..., context/...
    ("tracing", ("opentelemetry", "(trace/", "(propagate/", "(baggage/", "(context/", "(sdk/trace"), ()),
    ("tracing", ("loom/telemetry/tracing.py",), ()),
    ("logging", ("structlog/", "(logging/"), ()),
    ("prometheus", ("prometheus_client",), ()),
    ("decide", (), ("run_cycle",)),
    ("decide_other", (), ("PlacementService._decide",)),
    ("write", (), ("PlacementService._write", "apply_cycle")),
    ("publish", (), ("PlacementService._publish", "OutboxRelay.run")),
    ("lifecycle", (), ("PlacementService.on_lifecycle",)),
    ("admit", (), ("PlacementService._admit_batch",)),
    ("decode", (), ("decode",)),
    ("acks", (), ("ConsumerRunner._settle", "Msg.ack")),
    ("nats_client", ("nats/",), ()),
    ("asyncpg", ("asyncpg",), ()),
]


def categorise(folded: Path) -> dict[str, float]:
    """The share (0-1) of the event loop's samples in each category (``event_loop``: none matched)."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, n_text = line.rpartition(" ")
        if not n_text.isdigit():
            continue
        n = int(n_text)
        frames = stack.split(";")
        names = [f.partition(" (")[0] for f in frames]
        if "Runner.run" not in names:
            continue  # start-up (imports), not the service's loop
        total += n
        name = "event_loop"
        for category, files, functions in CATEGORIES:
            if any(p in f for f in frames for p in files) or any(fn in names for fn in functions):
                name = category
                break
        counts[name] += n
    return {k: round(v / total, 4) for k, v in counts.most_common()} if total else {}


def _global_instances(timeout_s: float) -> list[int]:
    """The global shard's two placement instances this interpreter's bench started (either may win
    the lease: both are recorded, the busier one is reported)."""
    needle = f"{sys.executable} -m loom_services.placement"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cmdline.startswith(needle) and "--shard" not in cmdline:
                found.append(int(entry.name))
        if len(found) >= 2:
            return sorted(found)
        time.sleep(0.5)
    return []


def _loop_samples(folded: Path) -> int:
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, n_text = line.rpartition(" ")
        if n_text.isdigit() and "Runner.run " in stack:
            total += int(n_text)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="path prefix: OUT.json, OUT.folded")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then loom bench e2e's options")
    args = parser.parse_args(argv)
    bench_args = [a for a in args.bench if a != "--"]
    out = Path(args.out)
    bin_dir = Path(sys.executable).parent
    with open(f"{out}.json", "wb") as result:
        bench = subprocess.Popen(
            [str(bin_dir / "loom"), "bench", "e2e", "--json", *bench_args], stdout=result, cwd=ROOT
        )
        pids = _global_instances(120.0)
        spies = [
            subprocess.Popen(
                [
                    str(bin_dir / "py-spy"),
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(args.rate),
                    "--nonblocking",
                    "--format",
                    "raw",
                    "-o",
                    f"{out}.{pid}.folded",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid in pids
        ]
        code = bench.wait()
        for spy in spies:
            try:
                spy.wait(timeout=30)  # it stops when its process exits, with the stack
            except subprocess.TimeoutExpired:
                spy.send_signal(signal.SIGINT)  # writes what it has
                spy.wait(timeout=30)
    report: dict[str, Any] = {"bench_exit": code, "instances": pids}
    recorded = [Path(f"{out}.{pid}.folded") for pid in pids if Path(f"{out}.{pid}.folded").exists()]
    if recorded:
        folded = max(recorded, key=_loop_samples)  # the leader: the instance that did the work
        folded.replace(f"{out}.folded")
        report["leader_pid"] = int(folded.name.rsplit(".", 2)[-2])
        shares = categorise(Path(f"{out}.folded"))
        report["share_of_loop"] = shares
        try:
            bench_result = json.loads(Path(f"{out}.json").read_text())
        except ValueError:
            bench_result = {}
        cpu = bench_result.get("cpu_ms_per_job", {})
        per_job = max(cpu.get("placement", 0.0), cpu.get("placement-standby", 0.0)) or None
        if per_job is not None:
            report["placement_cpu_ms_per_job"] = per_job
            report["cpu_ms_per_job"] = {k: round(v * per_job, 3) for k, v in shares.items()}
    print(json.dumps(report))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""``loom bench codec``: what strict decoding costs per message, before and after its guards.

"before" is a bare cached ``msgspec.json.Decoder(type)`` (what :func:`loom_proto.codec.decode`
did before it refused deep nesting and repeated keys); "after" is ``codec.decode`` as it is now.
Payloads: a typical submission as the SDK writes it (``codec.encode``), the same submission as a
person writes it (spaces, defaults left out), one with a ``:`` inside a string (the slow exact
duplicate check runs), a 200-node heartbeat, and three hostile ones (100 KB of nested arrays,
256 KB of empty arrays side by side, a repeated key). Each figure is the best of ``--repeats``
timings of ``--number`` decodes, in microseconds per decode, before and after timed in turns. It
measures; it asserts nothing.
"""

import argparse
import contextlib
import functools
import json
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

import msgspec

from loom_proto import codec
from loom_proto.clusters import ClusterHeartbeat, NodeState
from loom_proto.jobs import Affinity, JobSubmitted, Resources, Work


def _payloads() -> dict[str, tuple[bytes, Any]]:
    job = JobSubmitted(
        job_id="bench-123456",
        tenant="bench",
        task_type="inference",
        resources=Resources(gpus=1),
        work=Work(steps=1, step_time_s=86_400.0),
        affinity=Affinity(regions=["us-east-2"]),
        submitted_at=1_764_600_000.25,
    )
    heartbeat = ClusterHeartbeat(
        cluster="c-use2-a",
        region="us-east-2",
        seq=1,
        sent_at=1_764_600_000.0,
        full=True,
        nodes=[
            NodeState(node=f"n{i:04d}", zone="use2-az1", gpu_model="A100", gpus_total=8) for i in range(200)
        ],
    )
    by_hand = (
        b'{"kind": "submitted", "job_id": "bench-123456", "tenant": "bench", "task_type": "inference",'
        b' "resources": {"gpus": 1}, "work": {"steps": 1, "step_time_s": 86400.0},'
        b' "affinity": {"regions": ["us-east-2"]}}'
    )
    return {
        "submission_sdk": (codec.encode(job), JobSubmitted),
        "submission_by_hand": (by_hand, JobSubmitted),
        "submission_by_hand_escape": (by_hand[:-1] + b', "name": "caf\\u00e9: run 7"}', JobSubmitted),
        "heartbeat_200_nodes": (codec.encode(heartbeat), ClusterHeartbeat),
        "hostile_nested_100kb": (b"[" * 50_000 + b"]" * 50_000, JobSubmitted),
        "hostile_wide_256kb": (b"[" + b"[]," * 87_000 + b"[]]", JobSubmitted),
        "hostile_repeated_key": (by_hand[:-1] + b', "job_id": "other"}', JobSubmitted),
    }


def _best_us(calls: list[Callable[[], object]], number: int, repeats: int) -> list[float]:
    """Best microseconds per call of each, timed in turns (so load on the machine hits both alike)."""

    def guarded(call: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with contextlib.suppress(msgspec.DecodeError, codec.DecodeError, RecursionError):
                call()

        return run

    runs = [guarded(c) for c in calls]
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            best[i] = min(best[i], timeit.timeit(run, number=number) / number * 1e6)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every payload both ways; microseconds per decode."""
    rows: dict[str, Any] = {}
    for name, (payload, type_) in _payloads().items():
        bare = msgspec.json.Decoder(type_)
        number = args.number if len(payload) < 4096 else max(args.number // 200, 5)
        before, after = _best_us(
            [functools.partial(bare.decode, payload), functools.partial(codec.decode, payload, type_)],
            number,
            args.repeats,
        )
        try:
            codec.decode(payload, type_)
            outcome = "decoded"
        except codec.DecodeError as exc:
            outcome = f"refused: {str(exc)[:60]}"
        rows[name] = {
            "bytes": len(payload),
            "before_us": round(before, 2),
            "after_us": round(after, 2),
            "ratio": round(after / before, 2) if before > 0 else None,
            "after": outcome,
        }
    return {
        "benchmark": "codec",
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
        "number": args.number,
        "repeats": args.repeats,
        "at": time.time(),
        "payloads": rows,
    }


def main(args: argparse.Namespace) -> int:
    """Print the JSON; a table on stderr unless ``--json``."""
    result = run(args)
    print(json.dumps(result, indent=2))
    if not args.json:
        print(f"{'payload':<28}{'bytes':>8}{'before us':>11}{'after us':>10}  after", file=sys.stderr)
        for name, row in result["payloads"].items():
            print(
                f"{name:<28}{row['bytes']:>8}{row['before_us']:>11}{row['after_us']:>10}  {row['after']}",
                file=sys.stderr,
            )
    return 0

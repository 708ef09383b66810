"""Per-process CPU shares from ``/proc``: how much of one core each (group of) process(es) used.

A :class:`CpuSampler` is given named groups of root pids (a service, NATS, the PostgreSQL
postmaster); each group also counts every descendant of its roots (PostgreSQL's backends are
children of the postmaster). :meth:`CpuSampler.sample` reads ``utime + stime`` of every process;
:func:`shares` turns two samples into the percentage of one core each group used in between.

A process born between the two samples counts with all its CPU time (it started inside the
interval); one that ended in between loses its last ticks (``/proc`` forgets it). Linux only.
"""

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the sampler needs."""

    pid: int
    ppid: int
    cpu_s: float
    """User plus system CPU time, in seconds."""


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line (the command name may hold spaces and parentheses)."""
    head, _, rest = text.rpartition(")")
    pid = int(head.split("(", 1)[0])
    fields = rest.split()
    # fields[0] is field 3 (state); ppid is field 4, utime 14 and stime 15 (1-based, man proc).
    ppid = int(fields[1])
    utime, stime = int(fields[11]), int(fields[12])
    return ProcStat(pid=pid, ppid=ppid, cpu_s=(utime + stime) / _CLK_TCK)


def read_all(proc: Path = Path("/proc")) -> dict[int, ProcStat]:
    """Every readable process of the machine, by pid."""
    stats: dict[int, ProcStat] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stats[int(entry.name)] = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # it ended while we looked, or is not ours to read
    return stats


def descendants(stats: Mapping[int, ProcStat], roots: Iterable[int]) -> set[int]:
    """The roots (those alive) and every process below them."""
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)
    found: set[int] = set()
    todo = [r for r in roots if r in stats]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


@dataclass(frozen=True)
class Sample:
    """CPU seconds of every process of every group at one instant."""

    at: float
    cpu_s: dict[str, dict[int, float]] = field(default_factory=dict)
    """Group name -> pid -> CPU seconds."""


class CpuSampler:
    """Samples named groups of processes (each a set of root pids and their descendants).

    A pid claimed by two groups counts in the first group that names it (or one of its
    ancestors), so give specific groups before broad ones.
    """

    def __init__(self, groups: Mapping[str, Iterable[int]], *, proc: Path = Path("/proc")) -> None:
        self.groups = {name: [int(p) for p in pids] for name, pids in groups.items()}
        self._proc = proc

    def sample(self) -> Sample:
        """Read the CPU time of every process of every group now."""
        stats = read_all(self._proc)
        taken: set[int] = set()
        per_group: dict[str, dict[int, float]] = {}
        for name, roots in self.groups.items():
            pids = descendants(stats, roots) - taken
            taken |= pids
            per_group[name] = {pid: stats[pid].cpu_s for pid in pids}
        return Sample(at=time.monotonic(), cpu_s=per_group)


def shares(before: Sample, after: Sample) -> dict[str, float]:
    """Percent of one core each group used between two samples (100 = one core busy throughout)."""
    elapsed = after.at - before.at
    if elapsed <= 0:
        raise ValueError("the second sample must be later than the first")
    result: dict[str, float] = {}
    for name, pids in after.cpu_s.items():
        old = before.cpu_s.get(name, {})
        used = sum(max(cpu - old.get(pid, 0.0), 0.0) for pid, cpu in pids.items())
        result[name] = round(100.0 * used / elapsed, 2)
    return result


def measure(sampler: CpuSampler, seconds: float) -> dict[str, float]:
    """Shares over the next ``seconds`` (blocking)."""
    before = sampler.sample()
    time.sleep(seconds)
    return shares(before, sampler.sample())


MACHINE_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
"""The first eight fields of ``/proc/stat``'s ``cpu`` line (all CPUs together), in order."""


def parse_machine(text: str) -> dict[str, int]:
    """Clock ticks per :data:`MACHINE_FIELDS` from ``/proc/stat``'s text (its aggregate ``cpu``
    line); fields an old kernel lacks read 0. ValueError without that line."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            ticks = [int(p) for p in parts[1 : 1 + len(MACHINE_FIELDS)]]
            ticks += [0] * (len(MACHINE_FIELDS) - len(ticks))
            return dict(zip(MACHINE_FIELDS, ticks, strict=True))
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def read_machine(path: Path = Path("/proc/stat")) -> dict[str, int] | None:
    """:func:`parse_machine` of the machine's ``/proc/stat``; None where it cannot be read."""
    try:
        return parse_machine(path.read_text())
    except (OSError, ValueError):
        return None


def machine_shares(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, float]:
    """The machine's CPU time between two :func:`read_machine` readings, in percent of all of it:
    ``busy`` (user, nice, system, irq, softirq), ``iowait``, ``steal`` (taken by the hypervisor
    for other guests: a host whose steal is high gives a benchmark less than its cores) and
    ``idle``. Empty when no time passed."""
    delta = {k: max(after.get(k, 0) - before.get(k, 0), 0) for k in MACHINE_FIELDS}
    total = sum(delta.values())
    if total <= 0:
        return {}
    busy = delta["user"] + delta["nice"] + delta["system"] + delta["irq"] + delta["softirq"]
    return {
        "busy": round(100.0 * busy / total, 1),
        "iowait": round(100.0 * delta["iowait"] / total, 1),
        "steal": round(100.0 * delta["steal"] / total, 1),
        "idle": round(100.0 * delta["idle"] / total, 1),
    }


def loop_ms(repeat: int = 5) -> float:
    """The host's single-thread speed as the figures in ``docs/measurements.md`` quote it: the best of
    ``repeat`` timings of ``sum(range(10**6))``, in milliseconds (what ``python -m timeit
    "sum(range(10**6))"`` prints; lower is faster)."""
    best = float("inf")
    for _ in range(max(repeat, 1)):
        t = time.perf_counter()
        sum(range(10**6))
        best = min(best, time.perf_counter() - t)
    return round(best * 1000.0, 2)

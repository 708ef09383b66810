"""loom.runtime.cpu: /proc parsing, process groups with their descendants, shares between samples."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom.runtime import cpu

# Measures wall-clock delays and rates: runs after the parallel part of `make test`, alone.
pytestmark = pytest.mark.timing


def _stat(pid: int, comm: str, ppid: int, utime: int, stime: int) -> str:
    # 52 fields as in man proc(5): pid (comm) state ppid ... utime(14) stime(15) ...
    rest = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 37
    return f"{pid} ({comm}) " + " ".join(rest) + "\n"


def _fake_proc(root: Path, procs: dict[int, tuple[str, int, int, int]]) -> None:
    for pid, (comm, ppid, utime, stime) in procs.items():
        (root / str(pid)).mkdir(exist_ok=True)
        (root / str(pid) / "stat").write_text(_stat(pid, comm, ppid, utime, stime))


def test_parse_stat_reads_ppid_and_cpu_even_with_odd_command_names() -> None:
    tck = os.sysconf("SC_CLK_TCK")
    st = cpu.parse_stat(_stat(42, "post gres: (writer) ) x", 7, 3 * tck, 2 * tck))
    assert (st.pid, st.ppid) == (42, 7)
    assert st.cpu_s == pytest.approx(5.0)


def test_groups_take_descendants_and_first_group_wins(tmp_path: Path) -> None:
    # 10 postmaster -> 11, 12 backends; 20 a service; 1 the supervisor above everything.
    _fake_proc(
        tmp_path,
        {1: ("sup", 0, 0, 0), 10: ("postgres", 1, 0, 0), 11: ("postgres", 10, 0, 0), 12: ("pg", 10, 0, 0)}
        | {20: ("svc", 1, 0, 0), 30: ("other", 0, 0, 0)},
    )
    (tmp_path / "self").mkdir()  # non-numeric entries are ignored
    sample = cpu.CpuSampler(
        {"postgres": [10], "svc": [20], "supervisor": [1], "gone": [99]}, proc=tmp_path
    ).sample()
    assert set(sample.cpu_s["postgres"]) == {10, 11, 12}
    assert set(sample.cpu_s["svc"]) == {20}
    assert set(sample.cpu_s["supervisor"]) == {1}  # its children were claimed by earlier groups
    assert sample.cpu_s["gone"] == {}


def test_shares_are_percent_of_one_core_and_count_new_processes() -> None:
    before = cpu.Sample(at=100.0, cpu_s={"a": {1: 1.0}, "b": {2: 5.0}, "c": {3: 2.0}})
    after = cpu.Sample(
        at=102.0,
        # a: +0.5 s of CPU over 2 s; b: +1 s, plus a process born in between with 1 s;
        # c: its only process ended (counts nothing, never negative).
        cpu_s={"a": {1: 1.5}, "b": {2: 6.0, 4: 1.0}, "c": {}},
    )
    assert cpu.shares(before, after) == {"a": 25.0, "b": 100.0, "c": 0.0}
    with pytest.raises(ValueError):
        cpu.shares(after, before)


def test_a_busy_child_process_shows_up_near_one_core() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    try:
        sampler = cpu.CpuSampler({"busy": [child.pid], "me": [os.getpid()]})
        time.sleep(0.3)
        result = cpu.measure(sampler, 1.0)
    finally:
        child.kill()
        child.wait()
    # A spinning process uses up to one core (less when the machine is shared); this test sleeps.
    assert result["busy"] > 20.0
    assert result["me"] < result["busy"]


PROC_STAT = """cpu  100 10 50 800 20 5 5 10 0 0
cpu0 50 5 25 400 10 2 3 5 0 0
intr 12345
"""


def test_the_machine_line_is_read_in_proc_stats_field_order() -> None:
    ticks = cpu.parse_machine(PROC_STAT)
    assert ticks == {
        "user": 100,
        "nice": 10,
        "system": 50,
        "idle": 800,
        "iowait": 20,
        "irq": 5,
        "softirq": 5,
        "steal": 10,
    }
    # An old kernel's shorter line: the missing fields read 0.
    assert cpu.parse_machine("cpu 1 2 3 4\n")["steal"] == 0
    with pytest.raises(ValueError):
        cpu.parse_machine("cpu0 1 2 3 4\n")


def test_machine_shares_split_the_time_between_two_readings() -> None:
    before = cpu.parse_machine(PROC_STAT)
    # +100 ticks in all: busy 40 + 10 + 5 + 2 + 3 = 60, iowait 5, steal 15, idle 20.
    after = dict(before, user=140, nice=20, system=55, irq=7, softirq=8, iowait=25, steal=25, idle=820)
    assert cpu.machine_shares(before, after) == {"busy": 60.0, "iowait": 5.0, "steal": 15.0, "idle": 20.0}
    assert cpu.machine_shares(before, before) == {}
    # This machine's own readings: the shares of a real interval add up to about 100 %.
    first = cpu.read_machine()
    assert first is not None
    sum(range(10**6))
    time.sleep(0.05)
    second = cpu.read_machine()
    assert second is not None
    shares = cpu.machine_shares(first, second)
    assert not shares or abs(sum(shares.values()) - 100.0) <= 0.5


def test_loop_ms_times_the_quoted_loop() -> None:
    ms = cpu.loop_ms(repeat=2)
    # sum(range(10**6)) takes milliseconds on any host this runs on; never 0, never seconds.
    assert 0.1 < ms < 2000.0

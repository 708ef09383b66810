"""A Slurm command that hangs never holds a Slurm agent up: it is killed with its children and
reaped at its timeout, or as soon as the agent stops; the poll counts as failed and is retried.

Slurm's commands are fakes here (shell scripts in the backend's ``bin_dir``): ``scontrol show
node`` answers with one idle T4 node, ``sbatch`` with job id 42, ``squeue`` and ``scancel`` with
nothing, and ``scontrol show job`` hangs, with a child of its own (as a wrapper script's would)
that holds its output pipes open. Each hung call appends ``leader PID`` and ``child PID`` to a
file, so the test can tell whether any of them still lives. The agent runs on real NATS.
"""

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import pytest
from waiting import until

from loom.bus import Publisher
from loom.bus.connection import connect
from loom.runtime.service import close_context, open_context
from loom.tasks import cancel_and_wait
from loom_proto import subjects
from loom_proto.clusters import StartJob
from loom_proto.jobs import JobSpec, NodeAllocation, Work
from loom_services.cluster_agent.agent import Agent, _complete
from loom_services.cluster_agent.backend import BackendUnavailable
from loom_services.cluster_agent.slurm import SlurmBackend

CLUSTER = "c-fake-slurm"
NODE = "fake-node-1"


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """The fake Slurm commands (see the module docstring)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pids = tmp_path / "hung.pids"
    scripts = {
        "scontrol": f"""case "$*" in
  *"show node"*)
    echo "NodeName={NODE} CPUTot=8 RealMemory=16000 Gres=gpu:t4:4 GresUsed=gpu:t4:0 State=IDLE"
    exit 0;;
esac
echo "leader $$" >> {pids}
sleep 100000 &
echo "child $!" >> {pids}
wait
""",
        "sbatch": "echo 42\n",
        "squeue": "exit 0\n",
        "scancel": "exit 0\n",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    return bin_dir


def hung(bin_dir: Path) -> list[tuple[str, int]]:
    """(role, pid) of every process a hung fake command started, in order."""
    path = bin_dir.parent / "hung.pids"
    lines = path.read_text().split("\n") if path.exists() else []
    return [(role, int(pid)) for role, _, pid in (line.partition(" ") for line in lines if line)]


def lives(pid: int) -> bool:
    """Whether the process lives (a zombie does not: it only waits for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def assert_gone(bin_dir: Path, calls: int | None = None) -> None:
    """Nothing the hung commands (the first ``calls`` of them, or all) started lives, and each
    command itself was reaped (it was the agent's child: a zombie left unreaped would keep its
    /proc entry)."""
    started = hung(bin_dir)
    if calls is not None:
        leaders = [i for i, (role, _) in enumerate(started) if role == "leader"]
        started = started[: leaders[calls]] if len(leaders) > calls else started
    assert started, "no hung command ran"
    # The command itself (the agent's child) is killed and reaped before the call returns. What
    # it started (not our child) got the group's SIGKILL too, but is scheduled to die on its own
    # time: on a loaded machine it may still run a moment later (seen once in CI).
    assert [pid for role, pid in started if role == "leader" and Path(f"/proc/{pid}").exists()] == []
    deadline = time.monotonic() + 5.0
    while any(lives(pid) for _, pid in started) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [pid for _, pid in started if lives(pid)] == []


def backend(tmp_path: Path, bin_dir: Path, command_timeout_s: float, cluster: str = CLUSTER) -> SlurmBackend:
    return SlurmBackend(
        cluster=cluster,
        zone="z",
        work_dir=tmp_path / "work",
        bin_dir=bin_dir,
        command_timeout_s=command_timeout_s,
        poll_s=0.1,
    )


async def test_a_poll_past_its_timeout_fails_as_unavailable_with_the_command_and_its_child_reaped(
    tmp_path: Path, fake_bin: Path
) -> None:
    slurm = backend(tmp_path, fake_bin, command_timeout_s=0.5)
    # The child holds the pipes: killing the command alone would leave the poll waiting for them.
    with pytest.raises(BackendUnavailable, match=r"scontrol did not answer in 0\.5 s"):
        await asyncio.wait_for(slurm.poll("42", "job-a:1"), timeout=30)
    assert_gone(fake_bin)
    assert [role for role, _ in hung(fake_bin)] == ["leader", "child"]


async def test_a_cancelled_poll_is_cancelled_with_the_command_and_its_child_reaped(
    tmp_path: Path, fake_bin: Path
) -> None:
    slurm = backend(tmp_path, fake_bin, command_timeout_s=3600.0)
    poll = asyncio.create_task(slurm.poll("42", "job-b:1"))

    async def hanging() -> bool:
        return [role for role, _ in hung(fake_bin)] == ["leader", "child"]

    await until(hanging, 10, "the poll's command to hang")
    poll.cancel()
    await asyncio.wait_for(asyncio.wait([poll]), timeout=30)
    assert poll.cancelled(), f"the cancellation propagated, not {poll.exception()!r}"
    assert_gone(fake_bin)


async def test_a_slurm_agent_retries_a_timed_out_poll_and_stops_at_once_killing_the_poll_in_flight(
    nats_url: str, tmp_path: Path, fake_bin: Path
) -> None:
    cluster = f"{CLUSTER}-{uuid.uuid4().hex[:8]}"  # its own durable consumer on the session's NATS
    slurm = backend(tmp_path, fake_bin, command_timeout_s=1.0, cluster=cluster)
    ctx = await open_context(f"agent-{cluster}", nats_url=nats_url, database_url=None)
    agent = Agent(ctx, slurm, region="r", heartbeat_s=0.2, state_dir=tmp_path)
    task = asyncio.create_task(agent.run())
    nc = await connect(nats_url, "slurm-stop-test")
    try:
        await Publisher(nc).publish(
            subjects.cluster_command(cluster, "start"),
            StartJob(
                job_id="job-c",
                spec=JobSpec(job_id="job-c", tenant="t1", work=Work(steps=10, step_time_s=10.0)),
                gpu_model="T4",
                allocations=[NodeAllocation(node=NODE, gpus=1)],
            ),
            msg_id=f"test-{uuid.uuid4().hex}",
        )

        async def failed_polls() -> int:
            return int(ctx.stats.get("poll_failures", 0))

        await until(failed_polls, 30, "a poll of the part to time out")
        assert_gone(fake_bin, calls=1)  # the timed-out poll's command and child (the next may run)
        # From now on a poll would hang for an hour: only the stop can end the one in flight
        # (the stop is bounded below by 30 s).
        slurm.command_timeout_s = 3600.0
        before = len([r for r, _ in hung(fake_bin) if r == "leader"])

        async def polling_again() -> bool:
            started = [pid for role, pid in hung(fake_bin) if role == "leader"]
            return len(started) > before and lives(started[-1])

        await until(polling_again, 30, "the part to be polled again")
        ctx.stopping.set()
        await asyncio.wait_for(task, timeout=30)
    finally:
        ctx.stopping.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wait([task]), timeout=30)
        await close_context(ctx)
        await nc.close()
    assert_gone(fake_bin)
    assert task.done() and not task.cancelled() and task.exception() is None, "the agent stopped by itself"


async def test_a_task_that_loses_its_cancellation_is_cancelled_again() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # as a cancellation turned into an error a supervisor restarts for
        await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)  # it starts sleeping
    await asyncio.wait_for(cancel_and_wait([task], grace_s=0.05), timeout=30)
    assert swallowed.is_set() and task.cancelled()


async def test_a_stop_cancelled_before_its_cleanup_fails_still_ends_cancelled() -> None:
    finish = asyncio.Event()

    async def cleanup() -> None:
        await finish.wait()
        raise RuntimeError("runner.stop failed")

    async def stop() -> None:
        await _complete(cleanup())

    task = asyncio.create_task(stop())
    await asyncio.sleep(0)
    task.cancel()  # the caller gives up on the stop: the cleanup still runs to its end
    await asyncio.sleep(0)
    assert not task.done(), "the cleanup is still running"
    finish.set()  # ... and then fails
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=30)
    assert task.cancelled(), "a cancelled stop ends cancelled, not with the cleanup's error"


async def test_a_cleanup_error_without_a_cancellation_propagates() -> None:
    async def cleanup() -> None:
        raise RuntimeError("runner.stop failed")

    with pytest.raises(RuntimeError, match=r"runner\.stop failed"):
        await asyncio.wait_for(_complete(cleanup()), timeout=30)


async def test_a_command_cancelled_at_any_moment_ends_cancelled_never_with_a_result_or_another_error(
    tmp_path: Path, fake_bin: Path
) -> None:
    """Cancelled as the command ends, a call once returned its result (``asyncio.wait_for`` on
    Python 3.11) or raised ProcessLookupError (killing a child already gone): the poll loop of a
    stopping agent then polled on. Cancels land over the command's whole life here (``squeue``
    answers at once)."""
    slurm = backend(tmp_path, fake_bin, command_timeout_s=30.0)
    outcomes: dict[str, int] = {}
    for i in range(150):
        call = asyncio.create_task(slurm.running())
        await asyncio.sleep((i % 50) * 0.0005)
        if not call.cancel():
            continue  # it had ended already: nothing to cancel
        await asyncio.wait_for(asyncio.wait([call]), timeout=30)
        outcome = "cancelled" if call.cancelled() else repr(call.exception() or call.result())
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert set(outcomes) <= {"cancelled"}, outcomes


async def test_a_stop_cancelled_while_it_runs_still_cancels_the_runs_and_ends_cancelled(
    nats_url: str, tmp_path: Path, fake_bin: Path
) -> None:
    """The agent's task is cancelled while its stop waits for the heartbeat to end (held here
    until the cancellation came): the stop still stops the command consumer and cancels the runs,
    killing the Slurm poll in flight, and the agent's task then ends cancelled."""
    cluster = f"{CLUSTER}-{uuid.uuid4().hex[:8]}"
    slurm = backend(tmp_path, fake_bin, command_timeout_s=3600.0, cluster=cluster)  # a poll hangs
    ctx = await open_context(f"agent-{cluster}", nats_url=nats_url, database_url=None)
    agent = Agent(ctx, slurm, region="r", heartbeat_s=0.2, state_dir=tmp_path)
    beat_stopping, beat_may_end = asyncio.Event(), asyncio.Event()

    async def heartbeat_slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            beat_stopping.set()
            await beat_may_end.wait()
            raise

    agent._heartbeat_loop = heartbeat_slow_to_stop  # type: ignore[method-assign]
    task = asyncio.create_task(agent.run())
    nc = await connect(nats_url, "slurm-stop-cancel-test")
    try:
        await Publisher(nc).publish(
            subjects.cluster_command(cluster, "start"),
            StartJob(
                job_id="job-d",
                spec=JobSpec(job_id="job-d", tenant="t1", work=Work(steps=10, step_time_s=10.0)),
                gpu_model="T4",
                allocations=[NodeAllocation(node=NODE, gpus=1)],
            ),
            msg_id=f"test-{uuid.uuid4().hex}",
        )

        async def polling() -> bool:
            started = [pid for role, pid in hung(fake_bin) if role == "leader"]
            return bool(started) and lives(started[-1])

        await until(polling, 30, "the part to be polled")
        ctx.stopping.set()
        await asyncio.wait_for(beat_stopping.wait(), timeout=30)
        task.cancel()  # the stop itself is cancelled while it waits for the heartbeat
        await asyncio.sleep(0)  # the cancellation reaches the stop before the heartbeat ends
        beat_may_end.set()
        await asyncio.wait_for(asyncio.wait([task]), timeout=30)
        assert task.cancelled(), "the cancellation was re-raised once the stop was done"
        assert_gone(fake_bin)  # the runs were cancelled, their poll's command killed
        assert agent.tasks == {} or all(t.done() for t in agent.tasks.values())
    finally:
        beat_may_end.set()
        ctx.stopping.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wait([task]), timeout=30)
        left = list(agent.tasks.values())
        if left:  # on a failure: leave nothing running
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cancel_and_wait(left), timeout=30)
        await close_context(ctx)
        await nc.close()

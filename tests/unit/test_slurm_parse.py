"""The slurm backend's reading of Slurm's output: records, host lists, GRES, states, progress files."""

from collections.abc import Mapping
from pathlib import Path

import pytest

from loom.model.topology import load_topology
from loom.runtime.slurmlocal import slurm_nodes
from loom_services.cluster_agent.backend import Phase
from loom_services.cluster_agent.slurm import (
    SlurmBackend,
    SlurmNodeState,
    alloc_gpus,
    expand_hostlist,
    job_name,
    job_phase,
    node_gpus,
    parse_record,
    read_progress,
)


def test_a_record_keeps_values_with_spaces_whole() -> None:
    rec = parse_record(
        "NodeName=n1 Gres=gpu:v100:4(S:0) OS=Linux 6.1 #1 SMP State=IDLE+DRAIN Reason=maintenance [root@x] "
        "AllocTRES=cpu=2,gres/gpu=2"
    )
    assert rec["NodeName"] == "n1" and rec["OS"] == "Linux 6.1 #1 SMP"
    assert rec["Reason"] == "maintenance [root@x]" and rec["AllocTRES"] == "cpu=2,gres/gpu=2"


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("openb-node-0123", ["openb-node-0123"]),
        ("node-[01-03,07]", ["node-01", "node-02", "node-03", "node-07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("", []),
        ("(null)", []),
    ],
)
def test_host_lists_expand_to_names_keeping_zero_padding(hostlist: str, names: list[str]) -> None:
    assert expand_hostlist(hostlist) == names


def test_gres_gives_the_gpu_type_and_count_and_used_gpus_come_from_tres() -> None:
    assert node_gpus("gpu:v100m16:4(S:0-1)") == ("v100m16", 4)
    assert node_gpus("mps:100,gpu:2") == (None, 2)
    assert node_gpus("(null)") == (None, 0)
    assert node_gpus("gpu:t4:2(IDX:0-1)") == ("t4", 2)
    assert alloc_gpus("cpu=1,mem=1G,gres/gpu=3,gres/gpu:t4=3") == 3
    assert alloc_gpus("cpu=1") == 0


@pytest.mark.parametrize(
    ("state", "phase"),
    [
        ("PENDING", Phase.PENDING),
        ("CONFIGURING", Phase.PENDING),
        ("RUNNING", Phase.RUNNING),
        ("COMPLETING", Phase.RUNNING),
        ("COMPLETED", Phase.COMPLETED),
        ("FAILED", Phase.FAILED),
        ("OUT_OF_MEMORY", Phase.FAILED),
        ("CANCELLED by 0", Phase.CANCELLED),
        ("TIMEOUT", Phase.CANCELLED),
        ("PREEMPTED", Phase.CANCELLED),
        ("NODE_FAIL", Phase.NODE_FAIL),
    ],
)
def test_slurm_job_states_map_to_loom_phases(state: str, phase: Phase) -> None:
    assert job_phase(state) is phase


@pytest.mark.parametrize(
    ("state", "healthy"),
    [
        ("IDLE", True),
        ("MIXED", True),
        ("ALLOCATED", True),
        ("IDLE+DRAIN", False),
        ("MIXED+DRAIN", False),
        ("DOWN", False),
        ("IDLE*", False),
        ("DOWN+NOT_RESPONDING", False),
    ],
)
def test_drained_down_and_silent_nodes_are_unavailable(state: str, healthy: bool) -> None:
    node = SlurmNodeState("n", "z", "T4", "t4", 4, 16000, 1000, state)
    assert node.healthy is healthy and node.report().healthy is healthy


@pytest.mark.parametrize(
    ("state", "down"),
    [
        ("IDLE", False),
        ("MIXED+DRAIN", False),
        ("IDLE+DRAIN", False),
        ("IDLE*", False),
        ("DOWN", True),
        ("DOWN*", True),
        ("DOWN+NOT_RESPONDING", True),
        ("DOWN+DRAIN", True),
        ("IDLE+FAIL", True),
        ("ALLOCATED+FAILING", True),
    ],
)
def test_down_and_failing_nodes_are_reported_down_and_drained_ones_are_not(state: str, down: bool) -> None:
    node = SlurmNodeState("n", "z", "T4", "t4", 4, 16000, 1000, state)
    assert node.down is down and node.report().down is down
    if down:
        assert node.report().healthy is False
    node.reachable = False  # an unreachable controller says nothing of the node
    assert node.report().down is False and node.report().healthy is False


def test_a_node_counts_the_gpus_the_agent_holds_before_slurm_does() -> None:
    node = SlurmNodeState("n", "z", "T4", "t4", 4, 16000, 1000, "IDLE", slurm_used=1, held=3)
    assert node.gpus_used == 3
    node.held = 0
    assert node.gpus_used == 1


def test_the_progress_file_gives_the_last_step_and_every_checkpoint(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    assert read_progress(progress) == (None, ())
    progress.write_text("step 1\nstep 2\ncheckpoint 2 file:///c/2\ngarbage line\nstep x\nstep 3\nche")
    assert read_progress(progress) == (3, ((2, "file:///c/2"),))


def test_a_part_is_named_by_job_and_attempt() -> None:
    assert job_name("train-7:3") == "loom-train-7-3"


def test_local_slurm_nodes_take_one_node_of_each_gpu_model_first() -> None:
    nodes = slurm_nodes(load_topology("small").cluster("c-weu-a"), limit=2)
    assert {(n.gpu_type, n.gpus) for n in nodes} == {("p100", 2), ("t4", 4)}


class ScriptedSlurm(SlurmBackend):
    """A slurm backend whose commands answer from a script (command name → (rc, stdout, stderr))."""

    answers: dict[str, tuple[int, str, str]]
    calls: list[tuple[str, ...]]

    async def _command(self, *argv: str, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
        self.calls.append(argv)
        key = " ".join(a for a in argv[:2] if a in ("scontrol", "sacct", "-c"))
        return self.answers.get(key, (1, "", f"no answer scripted for {argv}"))


def _scripted(tmp_path: Path, answers: dict[str, tuple[int, str, str]]) -> ScriptedSlurm:
    backend = ScriptedSlurm(cluster="c1", zone="z1", work_dir=tmp_path)
    backend.answers, backend.calls = answers, []
    return backend


FORGOTTEN = (1, "", "slurm_load_jobs error: Invalid job id specified")
NO_DBD = (1, "", "Slurm accounting storage is disabled")


@pytest.mark.parametrize(
    ("answers", "phase", "exit_code", "reason"),
    [
        # slurmdbd knows it: completed.
        ({"sacct": (0, "41|loom-j-1|COMPLETED|0:0|n1\n", "")}, Phase.COMPLETED, None, "COMPLETED"),
        # No slurmdbd: the job completion log has it, failed with its exit code.
        (
            {"sacct": NO_DBD, "sacct -c": (0, "41|loom-j-1|FAILED|3:0|n[1-2]\n", "")},
            Phase.FAILED,
            3,
            "job completion log",
        ),
        (
            {"sacct": NO_DBD, "sacct -c": (0, "41|loom-j-1|FAILED|0:9|n1\n", "")},
            Phase.FAILED,
            None,
            "signal 9",
        ),
        # Neither knows it, or only another job of that id (a cluster whose ids started again), or
        # accounting still thinks it runs: vanished, reported failed by the agent, never "running".
        ({"sacct": NO_DBD, "sacct -c": (0, "", "")}, Phase.VANISHED, None, "not in Slurm's accounting"),
        ({"sacct": (0, "41|other|COMPLETED|0:0|n1\n", "")}, Phase.VANISHED, None, "is gone"),
        ({"sacct": (0, "41|loom-j-1|RUNNING|0:0|n1\n", "")}, Phase.VANISHED, None, "is gone"),
    ],
)
async def test_a_job_the_controller_forgot_gets_its_end_from_accounting(
    tmp_path: Path, answers: dict[str, tuple[int, str, str]], phase: Phase, exit_code: int | None, reason: str
) -> None:
    backend = _scripted(tmp_path, {"scontrol": FORGOTTEN, **answers})
    backend.part_dir("j:1").mkdir(parents=True)
    (backend.part_dir("j:1") / "progress").write_text("step 7\n")
    status = await backend.poll("41", "j:1")
    assert (status.phase, status.exit_code, status.step) == (phase, exit_code, 7)
    assert reason in status.reason
    if phase is Phase.FAILED:
        assert status.nodes and status.nodes[0] == "n1"
    assert (
        "sacct",
        "-X",
        "-n",
        "-P",
        "-j",
        "41",
        "-o",
        "JobID,JobName,State,ExitCode,NodeList",
    ) in backend.calls


async def test_a_job_the_controller_still_knows_is_not_looked_up_in_accounting(tmp_path: Path) -> None:
    backend = _scripted(
        tmp_path,
        {"scontrol": (0, "JobId=41 JobState=FAILED Reason=NonZeroExitCode ExitCode=2:0 NodeList=n1\n", "")},
    )
    status = await backend.poll("41", "j:1")
    assert (status.phase, status.exit_code, status.nodes) == (Phase.FAILED, 2, ("n1",))
    assert [c[0] for c in backend.calls] == ["scontrol"]

"""Public GPU-cluster traces read as published (Philly, Helios / Acme, Alibaba 2023): told by their
content, turned into jobs by the documented rules, and replayed by ``loom bench policies``.

The rows below follow each trace's published schema (the example entries of msr-fiddle/philly-traces,
S-Lab-System-Group/HeliosData and InternLM/AcmeTrace READMEs, with more rows of the same shape)."""

import argparse
import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest

from loom.model.topology import load_topology
from loom.sim.public_traces import MAX_GPUS_PER_WORKER, load_public, sniff_format
from loom.sim.truth import load_truth
from loom.sim.workloads import (
    PHILLY_FAMILIES,
    WorkloadError,
    alibaba_sample_path,
    load_alibaba,
    load_workload,
    training_mix,
    write_csv,
    write_jsonl,
)

GPUS8 = [f"gpu{i}" for i in range(8)]


def _philly_jobs() -> list[dict[str, object]]:
    return [
        {  # the README's example: two attempts on one 8-GPU server
            "status": "Pass",
            "vc": "ee9e8c",
            "jobid": "application_1506638472019_14199",
            "attempts": [
                {"start_time": "2017-10-07 01:12:09", "end_time": "2017-10-07 01:13:23",
                 "detail": [{"ip": "m47", "gpus": GPUS8}]},
                {"start_time": "2017-10-07 01:13:30", "end_time": "2017-10-09 06:53:12",
                 "detail": [{"ip": "m412", "gpus": GPUS8}]},
            ],
            "submitted_time": "2017-10-07 01:11:39",
            "user": "ce2f4c",
        },
        {  # a gang over two servers of 4 GPUs, killed after an hour
            "status": "Killed",
            "vc": "ee9e8c",
            "jobid": "application_1506638472019_14200",
            "attempts": [
                {"start_time": "2017-10-07 02:00:00", "end_time": "2017-10-07 03:00:00",
                 "detail": [{"ip": "m1", "gpus": GPUS8[:4]}, {"ip": "m2", "gpus": GPUS8[:4]}]}
            ],
            "submitted_time": "2017-10-07 01:30:00",
            "user": "aa11",
        },
        {  # never scheduled
            "status": "Failed", "vc": "b436b2", "jobid": "application_1506638472019_14201",
            "attempts": [], "submitted_time": "2017-10-07 01:40:00", "user": "bb22",
        },
        {  # still running when the trace was taken
            "status": "Pass", "vc": "b436b2", "jobid": "application_1506638472019_14202",
            "attempts": [{"start_time": "2017-10-07 04:00:00", "end_time": None,
                          "detail": [{"ip": "m3", "gpus": ["gpu0"]}]}],
            "submitted_time": "2017-10-07 03:59:00", "user": "cc33",
        },
        {  # one GPU, half an hour
            "status": "Pass", "vc": "b436b2", "jobid": "application_1506638472019_14203",
            "attempts": [{"start_time": "2017-10-07 05:00:00", "end_time": "2017-10-07 05:30:00",
                          "detail": [{"ip": "m3", "gpus": ["gpu0"]}]}],
            "submitted_time": "2017-10-07 04:59:00", "user": "cc33",
        },
    ]  # fmt: skip


HELIOS = """job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue
1425511,uXBbc,vcJkd,1,1,1,COMPLETED,2020-06-09 18:41:01,2020-06-09 18:41:01,2020-06-10 04:55:09,36848,0
1425512,uVMrF,vchbv,4,16,1,FAILED,2020-06-09 18:41:27,2020-06-09 18:41:27,2020-06-09 18:45:36,249,0
1425513,uzqls,vcpDC,1,1,1,CANCELLED,2020-06-09 18:41:28,2020-06-09 18:41:28,2020-06-17 14:15:21,675233,0
1425514,uzqls,vcpDC,0,8,1,COMPLETED,2020-06-09 18:42:28,2020-06-09 18:42:28,2020-06-09 19:15:21,1973,0
1425515,uzqls,vcpDC,16,8,2,COMPLETED,2020-06-09 18:43:28,2020-06-09 18:50:28,2020-06-09 20:15:21,5093,420
1425516,uzqls,vcpDC,12,8,1,COMPLETED,2020-06-09 18:44:28,2020-06-09 18:50:28,2020-06-09 20:15:21,5093,360
1425517,uzqls,vcpDC,2,8,1,PENDING,2020-06-09 18:45:28,,,,
"""

ACME = "".join(
    ",".join(row) + "\n"
    for row in (
        ("job_id,user,node_num,gpu_num,cpu_num,type,state", "submit_time,start_time,end_time",
         "duration,queue,gpu_time"),
        ("5778432,u5907,1,8,128,Other,FAILED", "2023-03-01 00:18:22+08:00", "2023-03-01 00:18:54+08:00",
         "2023-03-01 00:20:51+08:00", "117,32,936.0"),
        ("5778469,u5907,1,8,128,Other,COMPLETED", "2023-03-01 00:23:58+08:00", "2023-03-01 00:24:11+08:00",
         "2023-03-01 01:09:04+08:00", "2693,13,21544.0"),
        ("5778470,u5908,4,32,512,Pretrain,COMPLETED", "2023-03-01 00:25:58+08:00",
         "2023-03-01 00:26:11+08:00", "2023-03-01 03:09:04+08:00", "9773,13,312736.0"),
    )
)  # fmt: skip


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def philly(tmp_path: Path) -> Path:
    return _write(tmp_path, "cluster_job_log", json.dumps(_philly_jobs(), indent=1))


def _utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_formats_are_told_by_content_not_by_name(tmp_path: Path, philly: Path) -> None:
    assert sniff_format(philly) == "philly"
    assert sniff_format(_write(tmp_path, "cluster_log.csv", HELIOS)) == "helios"
    assert sniff_format(_write(tmp_path, "trace_seren.txt", ACME)) == "helios"
    assert sniff_format(alibaba_sample_path()) == "openb"
    mix = training_mix(jobs=5, seed=1)
    write_csv(mix, tmp_path / "mix.csv")
    write_jsonl(mix, tmp_path / "mix.jsonl")
    assert sniff_format(tmp_path / "mix.csv") is None and sniff_format(tmp_path / "mix.jsonl") is None
    assert sniff_format(_write(tmp_path, "other.json", '[{"a": 1}]')) is None
    # the generic format still reads as before, by name
    assert load_workload(tmp_path / "mix.csv") == load_workload(tmp_path / "mix.jsonl")


def test_philly_jobs_become_gangs_of_their_servers_and_attempts_add_up(philly: Path) -> None:
    truth = load_truth()
    trace = load_public(philly, seed=3)
    by_id = {j.spec.job_id: j for j in trace.jobs}
    assert set(by_id) == {
        "application_1506638472019_14199",
        "application_1506638472019_14200",
        "application_1506638472019_14203",
    }
    assert "1 never ran" in trace.source and "1 still running" in trace.source
    single, gang, small = (by_id[f"application_1506638472019_{n}"] for n in ("14199", "14200", "14203"))
    assert (single.spec.workers, single.spec.resources.gpus, single.job_class) == (1, 8, "training")
    assert single.spec.comm is None
    assert (gang.spec.workers, gang.spec.resources.gpus, gang.job_class) == (2, 4, "net_training")
    params = PHILLY_FAMILIES[gang.spec.labels["family"]][0]
    assert gang.spec.comm is not None and gang.spec.comm.bytes_per_step == int(params * 2)
    # Work: both attempts' time on the trace's GPU (P100) at the family's true speed there.
    ran_s = (74.0) + (_utc("2017-10-09 06:53:12") - _utc("2017-10-07 01:13:30"))
    family = single.spec.labels["family"]
    work_s = single.spec.work.steps * single.spec.work.step_time_s
    # Per GPU with its 8 GPUs in one node, as the trace ran it and the simulator times it (at one
    # GPU's speed, which the 8 do not each reach, it replayed far longer than recorded).
    eight = truth.speed(family, "P100", gpus_per_node=8).speed
    assert eight < truth.speed(family, "P100").speed
    assert work_s == pytest.approx(ran_s * eight, rel=1e-9)
    # On a P100 the truth runs it exactly as long as the trace says.
    assert work_s / eight == pytest.approx(ran_s, rel=1e-9)
    # Arrivals from the first submission; tenants are the virtual clusters.
    assert single.arrival_s == 0.0
    assert gang.arrival_s == pytest.approx(_utc("2017-10-07 01:30:00") - _utc("2017-10-07 01:11:39"))
    assert small.spec.tenant == "vc-b436b2" and gang.spec.tenant == "vc-ee9e8c"
    assert {j.home_region for j in trace.jobs} <= {r.id for r in load_topology().regions}


def test_the_trace_gpu_sets_how_much_work_a_measured_duration_was(philly: Path) -> None:
    truth = load_truth()
    p100 = {j.spec.job_id: j for j in load_public(philly, seed=3).jobs}
    a100 = {j.spec.job_id: j for j in load_public(philly, seed=3, trace_gpu="A100").jobs}
    for job_id, job in p100.items():
        family = job.spec.labels["family"]
        ratio = truth.speed(family, "A100").speed / truth.speed(family, "P100").speed
        work = job.spec.work.steps * job.spec.work.step_time_s
        other = a100[job_id].spec.work.steps * a100[job_id].spec.work.step_time_s
        assert other == pytest.approx(work * ratio, rel=1e-6) and ratio > 2
    with pytest.raises(WorkloadError, match="not known to the truth tables"):
        load_public(philly, trace_gpu="Z9000")


def test_helios_rows_skip_cpu_and_unrun_jobs_and_cut_large_jobs_into_nodes(tmp_path: Path) -> None:
    trace = load_public(_write(tmp_path, "cluster_log.csv", HELIOS), seed=1)
    by_id = {j.spec.job_id: j for j in trace.jobs}
    assert set(by_id) == {"1425511", "1425512", "1425513", "1425515", "1425516"}
    assert "1 cpu only" in trace.source and "1 never ran" in trace.source
    assert "1 reshaped" in trace.source
    shapes = {k: (j.spec.workers, j.spec.resources.gpus) for k, j in by_id.items()}
    assert shapes == {
        "1425511": (1, 1),
        "1425512": (1, 4),
        "1425513": (1, 1),
        "1425515": (2, 8),
        "1425516": (2, 6),
    }
    assert all(g <= MAX_GPUS_PER_WORKER for _, g in shapes.values())
    assert by_id["1425515"].job_class == "net_training" and by_id["1425512"].job_class == "training"
    assert by_id["1425511"].spec.tenant == "vc-vcJkd"
    assert by_id["1425513"].arrival_s == 27.0
    # the trace's GPU is the reference V100: work is the duration itself
    j = by_id["1425511"]
    assert j.spec.work.steps * j.spec.work.step_time_s == pytest.approx(36848.0)
    assert {"CANCELLED", "FAILED", "COMPLETED"} == {x.spec.labels["trace_state"] for x in trace.jobs}


def test_acme_times_with_offsets_and_its_a100_default(tmp_path: Path) -> None:
    truth = load_truth()
    trace = load_public(_write(tmp_path, "trace_seren.csv", ACME), seed=2)
    assert "AcmeTrace" in trace.source and "truth speed on A100" in trace.source
    first, second, third = trace.jobs
    assert (second.arrival_s, third.arrival_s) == (336.0, 456.0)
    assert first.spec.tenant == "u-u5907"
    assert (third.spec.workers, third.spec.resources.gpus) == (4, 8)
    family = second.spec.labels["family"]
    work = second.spec.work.steps * second.spec.work.step_time_s
    per_node = second.spec.resources.gpus  # a worker's GPUs in one node, as the trace ran it
    assert work == pytest.approx(2693.0 * truth.speed(family, "A100", gpus_per_node=per_node).speed, rel=1e-9)


def test_a_helios_log_without_duration_uses_start_and_end(tmp_path: Path) -> None:
    text = (
        "job_id,user,gpu_num,node_num,submit_time,start_time,end_time\n"
        "7,u1,2,1,2020-06-09 18:00:00,2020-06-09 18:10:00,2020-06-09 19:10:00\n"
    )
    (job,) = load_public(_write(tmp_path, "log.csv", text)).jobs
    speed = load_truth().speed(job.spec.labels["family"], "V100M16", gpus_per_node=2).speed
    # An hour of its two V100s in one node (Helios' GPU): the simulator times it back to an hour.
    assert job.spec.work.steps * job.spec.work.step_time_s == pytest.approx(3600.0 * speed)


def test_limit_start_and_seed(philly: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, "cluster_log.csv", HELIOS)
    assert [j.spec.job_id for j in load_public(path, limit=2).jobs] == ["1425511", "1425512"]
    later = load_public(path, start_s=27.0)
    assert [j.spec.job_id for j in later.jobs] == ["1425513", "1425515", "1425516"]
    assert later.jobs[0].arrival_s == 0.0 and "2 before start" in later.source
    assert load_public(path, seed=4) == load_public(path, seed=4)
    families = {tuple(j.spec.labels["family"] for j in load_public(path, seed=s).jobs) for s in range(6)}
    assert len(families) > 1
    with pytest.raises(WorkloadError, match="families must be among"):
        load_public(path, families=["resnet-50", "alexnet"])
    only = load_public(path, families=["resnet-50"])
    assert {j.spec.name for j in only.jobs} == {"resnet-50"}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "bad_time.csv",
            "job_id,gpu_num,submit_time,duration\n1,1,yesterday,5\n",
            "submit_time is not a time",
        ),
        (
            "bad_gpus.csv",
            "job_id,gpu_num,submit_time,duration\n1,-2,2020-01-01 00:00:00,5\n",
            "gpu_num must be",
        ),
        ("short.csv", "job_id,gpu_num,submit_time,duration\n1,1\n", "2 cells for 4 columns"),
        (
            "quote.csv",
            'job_id,gpu_num,submit_time,duration\n1,1,"2020-01-01 00:00:00,5\n',
            "malformed CSV",
        ),
    ],
)
def test_bad_rows_name_the_file_and_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(WorkloadError, match=message) as caught:
        load_public(path)
    assert f"{path}:2" in str(caught.value)


def test_bad_philly_input_is_refused_with_a_reason(tmp_path: Path) -> None:
    broken = _write(tmp_path, "log.json", '[{"jobid": "a", "attempts": [], "submitted_time": "x"')
    with pytest.raises(WorkloadError, match="malformed JSON"):
        load_public(broken, "philly")
    with pytest.raises(WorkloadError, match="not a time"):
        load_public(_write(tmp_path, "t.json", '[{"jobid": "a", "attempts": [], "submitted_time": "soon"}]'))
    with pytest.raises(WorkloadError, match="not a known public trace"):
        load_public(_write(tmp_path, "x.json", '[{"a": 1}]'))


def test_an_alibaba_pod_list_is_read_by_its_own_rule_through_load_workload(tmp_path: Path) -> None:
    topology = load_topology()
    sample = alibaba_sample_path()
    renamed = _write(tmp_path, "pods.txt", sample.read_text())
    got = load_workload(renamed, topology=topology, limit=50, seed=5)
    want = load_alibaba(renamed, topology=topology, limit=50, seed=5)
    assert got == want and len(got.jobs) == 50


def _policies_args(*argv: str) -> argparse.Namespace:
    from loom_benchmarks import add_arguments

    parser = argparse.ArgumentParser(prog="loom bench")
    add_arguments(parser)
    return parser.parse_args(["policies", *argv])


def test_bench_policies_replays_a_public_trace_at_a_load(philly: Path, tmp_path: Path) -> None:
    from loom_benchmarks.policies import OptionError, resolve, run

    out = tmp_path / "report"
    result = run(
        _policies_args(
            "--workload", str(philly), "--load", "1.0", "--policies", "loom,first_fit",
            "--topology", "default", "--out", str(out),
        )
    )  # fmt: skip
    workload = result["workload"]
    assert workload["format"] == "philly" and workload["jobs"] == 3
    assert workload["load"]["share"] == 1.0 and workload["load"]["reference_capacity_gpus"] > 0
    assert [s["policy"] for s in result["summaries"]] == ["loom", "first_fit"]
    for summary in result["summaries"]:
        assert summary["overall"]["finished"] == 3
    # spread to the platform's load: the three jobs arrive within a tiny span
    assert workload["arrival_span_s"] < 60
    with pytest.raises(OptionError, match="--trace-gpu applies to a public trace file"):
        resolve(_policies_args("--workload", "mix", "--trace-gpu", "A100"))
    with pytest.raises(OptionError, match="--load must be a positive"):
        resolve(_policies_args("--workload", str(philly), "--load", "0"))


def test_the_grid_takes_trace_files_named_by_their_stem(tmp_path: Path) -> None:
    from loom_benchmarks import grid
    from loom_benchmarks.policies import OptionError, grid_spec

    path = _write(tmp_path, "cluster_log.csv", HELIOS)
    spec = grid_spec(
        _policies_args(
            "--grid", "--grid-workloads", f"philly,{path}", "--grid-platforms", "small",
            "--grid-loads", "1", "--grid-seeds", "1", "--grid-spanning", "forbidden",
            "--policies", "loom,greedy_compute", "--jobs", "4",
        )
    )  # fmt: skip
    assert spec.workloads == ("philly", str(path)) and spec.jobs[str(path)] == 4
    default_jobs = grid_spec(_policies_args("--grid", "--grid-workloads", f"mix,{path}")).jobs
    assert default_jobs[str(path)] == grid.FILE_JOBS and default_jobs["mix"] == grid.CELL_JOBS["mix"]
    result = grid.run_grid(
        grid.GridSpec(
            platforms=("small",),
            loads=(1.0,),
            spanning=(False,),
            workloads=(str(path),),
            seeds=(0,),
            policies=("loom", "greedy_compute"),
            jobs={str(path): 4},
        )
    )
    (line,) = result["lines"]
    assert line["cell"] == "small/1/nospan/cluster_log"
    # a trace file is read once per process and what was drawn from it, not once per cell
    topology = grid.grid_topology("small")
    first = grid.grid_trace(str(path), 4, 0, topology)
    assert grid.grid_trace(str(path), 4, 0, topology) is first
    assert grid.grid_trace(str(path), 4, 1, topology) is not first
    assert all(f["finished"] + f["rejected"] + f["unfinished"] == 4 for f in line["policies"].values())
    assert math.isfinite(line["policies"]["loom"]["jct_mean_s"])
    with pytest.raises(OptionError, match="unknown --grid-workloads"):
        grid_spec(_policies_args("--grid", "--grid-workloads", str(tmp_path / "missing.csv")))


PAI_ROWS = [  # pai_task_table.csv rows (headerless as published): the README's example, and more of its shape
    "4f057009a5d481acec67b088,tensorflow,1.0,Terminated,1739162.0,1739200.0,600.0,29.296875,50.0,MISC",
    "af724763f4f5d0beef445849,worker,4.0,Terminated,2081336.0,2083889.0,400.0,30.0,100.0,V100",
    "af724763f4f5d0beef445849,ps,2.0,Terminated,2081336.0,2083889.0,600.0,30.0,0.0,",
    "b1,worker,1.0,Running,2081400.0,,400.0,30.0,800.0,V100M32",
    "b2,worker,1.0,Failed,2081500.0,2085500.0,400.0,30.0,200.0,T4",
    "b3,worker,1.0,Waiting,,,400.0,30.0,100.0,",
]


def test_pai_tasks_run_on_the_gpu_type_the_trace_names(tmp_path: Path) -> None:
    from loom.sim.public_traces import PAI_COLUMNS

    truth = load_truth()
    path = _write(tmp_path, "pai_task_table.csv", "\n".join(PAI_ROWS) + "\n")
    with_header = _write(
        tmp_path, "with_header.csv", ",".join(PAI_COLUMNS) + "\n" + "\n".join(PAI_ROWS) + "\n"
    )
    assert sniff_format(path) == "pai" and sniff_format(with_header) == "pai"
    trace = load_public(path, seed=1)
    assert load_public(with_header, seed=1).jobs == trace.jobs
    by_id = {j.spec.job_id: j for j in trace.jobs}
    assert set(by_id) == {
        "4f057009a5d481acec67b088-tensorflow",
        "af724763f4f5d0beef445849-worker",
        "b2-worker",
    }
    for part in ("1 cpu only", "1 never ran", "1 still running", "1 fractional-GPU tasks given whole GPUs"):
        assert part in trace.source
    gang = by_id["af724763f4f5d0beef445849-worker"]
    assert (gang.spec.workers, gang.spec.resources.gpus, gang.job_class) == (4, 1, "net_training")
    assert gang.arrival_s == 2081336.0 - 1739162.0 and gang.spec.tenant == "pai"
    # Each task's work is its duration at the true speed of the GPU it ran on (MISC as a K80).
    for job_id, model, ran_s in (
        ("4f057009a5d481acec67b088-tensorflow", "K80", 38.0),
        ("af724763f4f5d0beef445849-worker", "V100M16", 2553.0),
        ("b2-worker", "T4", 4000.0),
    ):
        job = by_id[job_id]
        work = job.spec.work.steps * job.spec.work.step_time_s
        speed = truth.speed(job.spec.labels["family"], model, gpus_per_node=job.spec.resources.gpus).speed
        assert work == pytest.approx(ran_s * speed, rel=1e-9)
    # --trace-gpu puts every task on one GPU instead
    forced = {j.spec.job_id: j for j in load_public(path, seed=1, trace_gpu="A100").jobs}
    t4 = forced["b2-worker"]
    work = t4.spec.work.steps * t4.spec.work.step_time_s
    speed = truth.speed(t4.spec.labels["family"], "A100", gpus_per_node=t4.spec.resources.gpus).speed
    assert work == pytest.approx(4000.0 * speed, rel=1e-9)
    bad = _write(tmp_path, "bad.csv", PAI_ROWS[1].replace("V100", "Z80") + "\n")
    with pytest.raises(WorkloadError, match="unknown gpu_type 'Z80'") as caught:
        load_public(bad, "pai")
    assert f"{bad}:1" in str(caught.value)


def test_a_byte_order_mark_and_windows_line_ends_change_nothing(tmp_path: Path) -> None:
    plain = load_public(_write(tmp_path, "plain.csv", HELIOS), seed=3)
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf" + HELIOS.replace("\n", "\r\n").encode())
    assert sniff_format(path) == "helios"
    assert load_public(path, seed=3).jobs == plain.jobs
    pods = tmp_path / "pods.csv"
    pods.write_bytes(b"\xef\xbb\xbf" + alibaba_sample_path().read_bytes())
    assert sniff_format(pods) == "openb"
    topology = load_topology()
    got = load_workload(pods, topology=topology, limit=20, seed=1)
    assert [j.spec.job_id for j in got.jobs] == [
        j.spec.job_id for j in load_alibaba(alibaba_sample_path(), topology=topology, limit=20, seed=1).jobs
    ]


def test_odd_ids_shapes_and_owners_are_mended_and_counted(tmp_path: Path) -> None:
    text = (
        "job_id,user,vc,gpu_num,node_num,submit_time,duration\n"
        "123_[1-3],u1,None,1,4,2020-06-09 18:00:00,60\n"  # a Slurm array id; 1 GPU over 4 nodes
        "7,u1,vc1,3,2,2020-06-09 18:00:01,60\n"  # 3 GPUs over 2 nodes
        "7,u1,vc1,1,1,2020-06-09 18:00:02,60\n"  # the same id again
        "7-4,u1,vc1,1,1,2020-06-09 18:00:03,60\n"  # the name the repeat would have taken
        '"with, a comma\nand a line end",u2,vc2,2,1,2020-06-09 18:00:04,60\n'
    )
    trace = load_public(_write(tmp_path, "log.csv", text))
    ids = [j.spec.job_id for j in trace.jobs]
    assert ids == ["123__1-3_", "7", "7-4", "7-4-5", "with__a_comma_and_a_line_end"]
    assert len(set(ids)) == len(ids) and "4 job ids renamed" in trace.source
    shapes = [(j.spec.workers, j.spec.resources.gpus) for j in trace.jobs]
    assert shapes == [(1, 1), (2, 2), (1, 1), (1, 1), (1, 2)]
    assert trace.jobs[0].spec.tenant == "u-u1"  # vc "None" is no vc
    long = _write(tmp_path, "long.csv", "job_id,gpu_num,submit_time,duration\n" + "x" * 80 + ",1,0,5\n")
    (job,) = load_public(long).jobs
    assert len(job.spec.job_id) == 64


def test_a_philly_log_is_known_by_its_keys_however_long_its_first_job(tmp_path: Path) -> None:
    jobs = _philly_jobs()
    jobs[0]["attempts"] = jobs[0]["attempts"] * 400  # type: ignore[operator]
    path = _write(tmp_path, "cluster_job_log", json.dumps(jobs, indent=4))
    assert path.stat().st_size > 65_536
    assert sniff_format(path) == "philly"
    # servers of unequal GPU counts share the job's GPUs evenly, counted as reshaped
    one = _philly_jobs()[:1]
    one[0]["attempts"][-1]["detail"] = [{"ip": "m1", "gpus": GPUS8}, {"ip": "m2", "gpus": GPUS8[:4]}]  # type: ignore[index]
    trace = load_public(_write(tmp_path, "uneven.json", json.dumps(one)))
    (job,) = trace.jobs
    assert (job.spec.workers, job.spec.resources.gpus) == (2, 6) and "1 reshaped" in trace.source


def test_review_cases_numbers_comments_servers_and_labels(tmp_path: Path) -> None:
    from loom_benchmarks import grid

    # A plain number is seconds, never a date (20000101 is not 2000-01-01).
    text = "job_id,gpu_num,submit_time,duration\n1,1,0,5\n2,1,20000101,5\n"
    second = load_public(_write(tmp_path, "secs.csv", text)).jobs[1]
    assert second.arrival_s == 20_000_101.0
    # A comment line with a quote in it does not open a cell.
    commented = '# a comment, "with a quote\n' + text
    assert len(load_public(_write(tmp_path, "c.csv", commented)).jobs) == 2
    # A Philly server listed without GPUs is no worker.
    one = _philly_jobs()[4:]
    one[0]["attempts"][0]["detail"] = [{"ip": "m1", "gpus": GPUS8[:4]}, {"ip": "m2", "gpus": []}]  # type: ignore[index]
    (job,) = load_public(_write(tmp_path, "p.json", json.dumps(one))).jobs
    assert (job.spec.workers, job.spec.resources.gpus) == (1, 4)
    # A Philly error names the job's place in the array, not a line of the file.
    bad = _philly_jobs()[:2]
    bad[1]["submitted_time"] = "soon"
    with pytest.raises(WorkloadError, match=r"job 2 of the array: submitted_time is not a time") as caught:
        load_public(_write(tmp_path, "b.json", json.dumps(bad, indent=2)))
    assert f"{tmp_path / 'b.json'}:" in str(caught.value) and f"{tmp_path / 'b.json'}:2" not in str(
        caught.value
    )
    # A file named like a named workload gets its own label.
    assert grid.workload_label(str(tmp_path / "philly.csv")) == "file-philly"
    assert grid.workload_label("philly") == "philly"


def test_trace_start_skips_the_first_seconds_of_a_public_trace(tmp_path: Path) -> None:
    from loom_benchmarks.policies import OptionError, build_workload, command_line, resolve

    path = _write(tmp_path, "cluster_log.csv", HELIOS)
    options = resolve(_policies_args("--workload", str(path), "--trace-start", "27", "--policies", "loom"))
    assert options.trace_start_s == 27.0 and "--trace-start 27" in command_line(options)
    workload = build_workload(options, load_topology())
    assert [j.spec.job_id for j in workload.trace.jobs] == ["1425513", "1425515", "1425516"]
    with pytest.raises(OptionError, match="--trace-start applies to a public trace file"):
        resolve(_policies_args("--workload", "mix", "--trace-start", "5"))
    with pytest.raises(OptionError, match="--trace-start must be seconds"):
        resolve(_policies_args("--workload", str(path), "--trace-start", "-1"))
    mix = training_mix(jobs=5, seed=1)
    write_jsonl(mix, tmp_path / "mix.jsonl")
    generic = resolve(_policies_args("--workload", str(tmp_path / "mix.jsonl"), "--trace-start", "5"))
    with pytest.raises(OptionError, match="the generic format"):
        build_workload(generic, load_topology())


def test_a_philly_attempt_whose_servers_or_gpus_are_not_lists_is_refused_in_one_line(tmp_path: Path) -> None:
    # "detail": 5 failed with a TypeError traceback; "gpus": "gpu0,gpu1" was read as 9 GPUs.
    for detail, said in (
        (5, "detail is not a list of servers"),
        ([{"ip": "m1", "gpus": "gpu0,gpu1"}], "gpus is not a list of GPU names"),
    ):
        jobs = _philly_jobs()[:1]
        jobs[0]["attempts"][-1]["detail"] = detail  # type: ignore[index]
        path = _write(tmp_path, "cluster_job_log", json.dumps(jobs))
        with pytest.raises(WorkloadError, match=said):
            load_public(path)


def test_a_job_recorded_as_running_over_a_year_is_left_out_and_counted(tmp_path: Path) -> None:
    # 1e300 s played out for minutes; 1.7e308 s overflowed (duration x speed) with a traceback.
    text = (
        "job_id,gpu_num,node_num,submit_time,duration\n"
        "1,1,1,2020-04-01 00:00:00,3600\n"
        "2,1,1,2020-04-01 00:01:00,1.7e308\n"
        "3,1,1,2020-04-01 00:02:00,1e300\n"
        f"4,1,1,2020-04-01 00:03:00,{366 * 86_400}\n"
    )
    trace = load_public(_write(tmp_path, "cluster_log.csv", text), trace_gpu="A100")
    assert [j.spec.job_id for j in trace.jobs] == ["1"]
    assert "3 over a year" in trace.source


def test_a_generic_row_of_infinite_or_years_of_work_is_refused_in_its_own_terms(tmp_path: Path) -> None:
    # inf failed with an OverflowError traceback; 1e20 was told of `$.work.steps`, a field the row
    # did not give.
    for value, said in (
        ("inf", "gpu_seconds must be a finite number"),
        ("1e20", r"job 'a' runs .* days at the reference speed \(gpu_seconds 1e\+20 over 1 GPU"),
    ):
        path = _write(tmp_path, "w.csv", f"arrival_s,job_id,gpu_seconds\n0,a,{value}\n")
        with pytest.raises(WorkloadError, match=said) as refused:
            load_workload(path)
        assert "$." not in str(refused.value) and ":2:" in str(refused.value)
    path = _write(tmp_path, "s.csv", "arrival_s,job_id,steps,step_time_s\n0,a,1000000000000,1\n")
    with pytest.raises(
        WorkloadError, match=r"runs .* days at the reference speed \(1000000000000 steps of 1 s\)"
    ):
        load_workload(path)


def test_an_alibaba_pod_out_of_bounds_is_refused_by_its_column_and_one_running_for_years_left_out(
    tmp_path: Path,
) -> None:
    header = (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
        "creation_time,deletion_time,scheduled_time\n"
    )
    ok = "openb-pod-0000,1000,1024,1,1000,,LS,Running,0,3600,10\n"
    # num_gpu 1000 failed with a msgspec traceback naming $.resources.gpus.
    with pytest.raises(WorkloadError, match=r"num_gpu") as refused:
        load_alibaba(
            _write(tmp_path, "p.csv", header + ok + ok.replace("0000,1000,1024,1,", "0001,1000,1024,1000,"))
        )
    assert "$." not in str(refused.value) and ":3" in str(refused.value)
    with pytest.raises(WorkloadError, match=r"pod name 'openb-pod-0000' is given twice \(first on line 2\)"):
        load_alibaba(_write(tmp_path, "d.csv", header + ok + ok))
    forever = ok.replace("0000", "0002").replace(",3600,", ",1e300,")
    trace = load_alibaba(_write(tmp_path, "q.csv", header + ok + forever))
    assert [j.spec.job_id for j in trace.jobs] == ["openb-pod-0000"]
    assert "1 running over a year" in trace.source


def test_a_helios_log_without_any_duration_is_told_so_not_that_its_columns_are_unknown(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path, "log.csv", "job_id,user,gpu_num,node_num,submit_time\n1,u,1,1,2020-01-01 00:00:00\n"
    )
    with pytest.raises(
        WorkloadError, match=r"it needs gpu_num, submit_time and duration .*; missing duration"
    ):
        load_workload(path)

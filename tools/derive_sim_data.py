"""Derive the simulator's packaged data from the reference data (developers only, never at run time).

Reads the shared reference data and writes, under ``libs/loom/sim/data/``:

- ``openb_gpu_tasks_2000.csv``: the first 2,000 GPU tasks (``num_gpu > 0`` or ``gpu_milli > 0``)
  of the Alibaba GPU trace's ``openb_pod_list_default.csv``, in file order (which is creation
  order), columns and values unchanged, under ``#`` comment lines that cite the source. CPU-only
  tasks are left out; every GPU task is kept, including ones the loader later skips (never
  scheduled), so the loader's counts can be tested on real rows.
- ``gavel_v100_step_times.json``: seconds per step of every Gavel job type alone on one V100
  (``1 / "null" throughput``), the reference GPU's step times the training mix is calibrated on.

The output is deterministic: re-running on the same data gives identical bytes.

    .venv/bin/python tools/derive_sim_data.py            # write the files
    .venv/bin/python tools/derive_sim_data.py --check    # exit 1 if they are out of date
"""

import argparse
import csv
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
OUT = REPO / "libs" / "loom" / "sim" / "data"

SAMPLE_NAME = "openb_gpu_tasks_2000.csv"
SAMPLE_TASKS = 2000
STEP_TIMES_NAME = "gavel_v100_step_times.json"

ALIBABA = (
    "alibaba/clusterdata, cluster-trace-gpu-v2023/csv/openb_pod_list_default.csv at commit "
    "7a6c496e4f4b6ce6150be8f881cb051bf2abff42 (Weng et al., 'Beware of Fragmentation: Scheduling "
    "GPU-Sharing Workloads with Fragmentation Gradient Descent', USENIX ATC 2023)"
)
GAVEL = (
    "stanford-futuredata/gavel, scheduler/notebooks/figures/motivation/oracle_throughputs.json at "
    "commit c4fa40097339e9608ab71fd64c8bdea96a5e4a4c (MIT; Narayanan et al., 'Heterogeneity-Aware "
    "Cluster Scheduling Policies for Deep Learning Workloads', OSDI 2020)"
)


def derive_sample(data: Path) -> str:
    """The packaged Alibaba sample as CSV text (comment lines, header, rows)."""
    source = data / "gpu-cluster" / "openb_pod_list_default.csv"
    with source.open(newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader)
        num_gpu, gpu_milli = header.index("num_gpu"), header.index("gpu_milli")
        rows = [row for row in reader if int(row[num_gpu]) > 0 or int(row[gpu_milli]) > 0]
    kept = rows[:SAMPLE_TASKS]
    out = io.StringIO()
    out.write(f"# Source: {ALIBABA}.\n")
    out.write(
        f"# The first {len(kept)} GPU tasks (num_gpu > 0 or gpu_milli > 0) of {len(rows)}, in file "
        "(creation) order; columns and values unchanged. Derived by tools/derive_sim_data.py.\n"
    )
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(kept)
    return out.getvalue()


def derive_step_times(data: Path) -> str:
    """The packaged V100 step times as JSON text."""
    throughputs = json.loads((data / "gpu-throughput" / "gavel_oracle_throughputs.json").read_text())
    step_times = {job: 1.0 / float(by_pair["null"]) for job, by_pair in sorted(throughputs["v100"].items())}
    document = {
        "source": (
            f"{GAVEL}. step_time_s = 1 / the 'null' throughput (steps per second of the job alone on "
            "one V100, the reference GPU). Known artifact of the source: 'Transformer (batch size 256)' "
            "has the same v100 value as on p100. Derived by tools/derive_sim_data.py."
        ),
        "gpu": "v100",
        "step_time_s": step_times,
    }
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with --check, compare) the simulator's packaged data."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the shared reference data folder")
    parser.add_argument("--out", type=Path, default=OUT, help="where the files go")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from a fresh run")
    args = parser.parse_args(argv)

    outputs = {SAMPLE_NAME: derive_sample(args.data), STEP_TIMES_NAME: derive_step_times(args.data)}
    stale = []
    for name, text in outputs.items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    if stale:
        print(f"out of date: {', '.join(stale)}; run tools/derive_sim_data.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Workloads of our own in Loom's generic format (JSON lines). Families named by labels.family /
labels.model, so the learner separates them; task types as the truth tables give them."""
import json, math, random, sys
from pathlib import Path

HERE = Path(__file__).parent / "workloads"
TT = {  # family -> task type (loom.sim.truth packaged families)
    "a3c": "training_comm", "bert-base": "training_compute", "bert-large": "training_compute",
    "cyclegan": "training_compute", "gnmt": "training_memory", "lm": "training_memory",
    "ncf": "training_comm", "recommendation": "training_comm", "resnet-18": "training_compute",
    "resnet-50": "training_compute", "ssd": "training_compute", "tacotron2": "training_memory",
    "transformer": "training_compute", "transformer-xl-base": "training_compute",
    "transformer-xl-large": "training_compute", "waveglow": "training_compute"}
PARAMS_MB = {"a3c": 20, "bert-base": 440, "bert-large": 1340, "cyclegan": 45, "gnmt": 640, "lm": 260,
             "ncf": 120, "recommendation": 300, "resnet-18": 45, "resnet-50": 100, "ssd": 110,
             "tacotron2": 110, "transformer": 260, "transformer-xl-base": 600, "transformer-xl-large": 1100,
             "waveglow": 350}
HOMES = ["aws-us-east-2", "azure-westeurope", "gcp-asia-southeast1"]
FP16_OK = {"bert-base", "bert-large", "gnmt", "ssd", "tacotron2", "transformer-xl-base",
           "transformer-xl-large", "waveglow", "resnet-50"}


def job(rng, i, t, fam, kind, workers, gpus, hours):
    step = rng.uniform(0.15, 0.6)
    steps = max(10, int(hours * 3600 / step))
    row = {"arrival_s": round(t, 1), "job_id": f"{kind}-{i:03d}-{fam}", "tenant": rng.choice(["t1", "t2", "t3"]),
           "class": "net_training" if workers > 1 else "training", "task_type": TT[fam],
           "workers": workers, "gpus": gpus, "steps": steps, "step_time_s": round(step, 4),
           "home_region": rng.choice(HOMES),
           "labels": {"family": fam, "model": fam}}
    if fam in FP16_OK and rng.random() < 0.2:
        row["labels"]["precision"] = "fp16"
    if workers > 1:
        row["bytes_per_step"] = int(PARAMS_MB[fam] * 1e6 * (2 if row["labels"].get("precision") == "fp16" else 4))
        row["rounds_per_step"] = 2
    return row


def build(name, seed, n, p_gang, p_medium, gang_families, fam_weights=None):
    rng = random.Random(seed)
    fams = sorted(TT)
    w = [fam_weights.get(f, 1.0) if fam_weights else 1.0 for f in fams]
    t, rows = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / 300.0) * (0.2 if rng.random() < 0.15 else 1.0)  # some bursts
        u = rng.random()
        if u < p_gang:  # long multi-GPU gangs
            fam = rng.choice(gang_families)
            workers, gpus = rng.choice([(2, 4), (2, 8), (4, 4), (3, 4), (4, 2), (2, 2)])
            hours = math.exp(rng.uniform(math.log(4), math.log(30)))
            rows.append(job(rng, i, t, fam, "gang", workers, gpus, hours))
        elif u < p_gang + p_medium:  # one node, several GPUs, hours
            fam = rng.choices(fams, w)[0]
            rows.append(job(rng, i, t, fam, "node", 1, rng.choice([2, 4, 4, 8]),
                            math.exp(rng.uniform(math.log(1), math.log(8)))))
        else:  # short jobs
            fam = rng.choices(fams, w)[0]
            rows.append(job(rng, i, t, fam, "short", 1, rng.choice([1, 1, 1, 2, 4]),
                            math.exp(rng.uniform(math.log(0.15), math.log(2.5)))))
    path = HERE / f"{name}.jsonl"
    with open(path, "w") as f:
        f.write(f"# source: ev6 evaluator workload {name}, seed {seed}\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    gangs = sum(r["workers"] > 1 for r in rows)
    gh = sum(r["workers"] * r["gpus"] * r["steps"] * r["step_time_s"] for r in rows) / 3600
    print(name, len(rows), "jobs,", gangs, "gangs,", f"{gh:.0f} ref GPU-h,", len({r['labels']['family'] for r in rows}), "families")


# W1: all 16 families, 18 % long gangs among many short jobs
build("famwide", 11, 260, 0.18, 0.22, sorted(TT))
# W2: families that GPUs speed up very differently (memory-bound lm/gnmt/tacotron2, compute-bound
# resnet/ssd, comm-bound a3c/ncf/recommendation); 28 % gangs, lm and gnmt gangs among them
build("diverge", 23, 220, 0.28, 0.22,
      ["lm", "lm", "gnmt", "resnet-50", "transformer", "tacotron2", "bert-large", "recommendation", "cyclegan"],
      {"lm": 3, "gnmt": 2, "tacotron2": 2, "resnet-50": 2, "ssd": 2, "a3c": 2, "ncf": 1.5,
       "recommendation": 1.5, "cyclegan": 1.5})

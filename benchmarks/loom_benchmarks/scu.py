"""``loom bench scu``: the SCU model's predicted speed ratios between GPU models against measured ones.

Data: Gavel's oracle throughputs (``data/gavel_oracle_throughputs.json``, see ``data/README.md``):
steps/s of 26 job types alone on one K80, P100 and V100. For every job type and every model pair
(P100/K80, V100/K80, V100/P100: 78 ratios) the measured ratio is compared with

- the SCU model's prediction, :func:`loom.model.scu.speed_ratio` over the reference library's
  profiles (``K80``, ``P100``, ``V100M16``), with weights fitted per task type by
  :func:`loom.model.scu.fit_weights`, evaluated in-sample and held out;
- the naive ratio of peak FLOPS: datasheet headline FP32 (K80 with GPU Boost), the library's FP32
  (K80 at base clocks, what it sustains), and FP16 (tensor cores where present).

Error is ``|predicted - measured| / measured``; figures are the median and the 90th percentile
(linear interpolation) over the 78 ratios.

Held-out evaluations refit the weights without the job being predicted:

- ``held_out_job_type``: leave one job type out (e.g. ``ResNet-50 (batch size 64)``); the other
  batch sizes of the same model stay in the fit. This is the headline held-out figure.
- ``held_out_job_family``: leave the whole family out (every batch size of ResNet-50); a task type
  with no other family left falls back to the prior weights. The strictest test.
- ``held_out_job_type_with_learned_decay``: as ``held_out_job_type``, then a
  :class:`~loom.model.scu.DecayLearner` per (device, task type) learns from the *other* job types'
  delivered throughput, as the placement service would after running them.

Gavel job families map to Loom task types by what bounds their step time, not by their fit:

- ``training_compute``: ResNet-18, ResNet-50 and CycleGAN (convolutions), Transformer (the
  step is dense GEMMs: projections and feed-forward layers);
- ``training_memory``: LM, an LSTM language model whose every time step re-reads the recurrent
  weights with a small batch, a bandwidth-bound pattern;
- ``training_comm``: Recommendation (embedding lookups and host-to-device transfer of sparse
  batches; in distributed form the all-to-all-bound workload) and A3C (asynchronous actor-learners
  exchanging parameters and rollouts every few steps);
- ``inference``: no Gavel job; it is not evaluated here.

The mapping was chosen after looking at the data, so ``alternative_mapping`` reports the figures for
the mapping suggested in the issue (Transformer, LM and Recommendation as ``training_memory``) too.
"""

import argparse
import importlib.resources
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from loom.model.profiles import DEFAULT_REFERENCE_MODEL, profile_for_model, reference_profile
from loom.model.scu import (
    PRIOR_WEIGHTS,
    TASK_TYPES,
    TASK_WEIGHTS,
    DecayLearner,
    DeviceProfile,
    RatioObservation,
    TaskWeights,
    fit_weights,
    scu,
    speed_ratio,
)
from loom_proto.jobs import TaskType

DATA_FILE: Final = "gavel_oracle_throughputs.json"
SOURCE: Final = (
    "stanford-futuredata/gavel, scheduler/notebooks/figures/motivation/oracle_throughputs.json at commit "
    "c4fa40097339e9608ab71fd64c8bdea96a5e4a4c (MIT); isolated ('null') steps/s"
)
GAVEL_TO_LIBRARY: Final[Mapping[str, str]] = {"k80": "K80", "p100": "P100", "v100": "V100M16"}
PAIRS: Final = (("p100", "k80"), ("v100", "k80"), ("v100", "p100"))
"""(numerator, denominator): the faster model over the slower, every pair of the three."""

FAMILY_TASK_TYPE: Final[Mapping[str, TaskType]] = {
    "ResNet-18": "training_compute",
    "ResNet-50": "training_compute",
    "CycleGAN": "training_compute",
    "Transformer": "training_compute",
    "LM": "training_memory",
    "Recommendation": "training_comm",
    "A3C": "training_comm",
}
ALTERNATIVE_FAMILY_TASK_TYPE: Final[Mapping[str, TaskType]] = {
    **FAMILY_TASK_TYPE,
    "Transformer": "training_memory",
    "Recommendation": "training_memory",
}
"""The issue's suggestion: sequence models and recommendation as memory-bound."""

HEADLINE_FP32_TFLOPS: Final[Mapping[str, float]] = {"K80": 8.73 / 2}
"""Where the datasheet's headline FP32 differs from the library's: K80's GPU Boost figure, per GPU."""

TARGET_MEDIAN_ERROR: Final = 0.15


@dataclass(frozen=True)
class JobType:
    """One Gavel job type: its family, its Loom task type, and its steps/s alone on each GPU model."""

    name: str
    family: str
    task_type: TaskType
    steps_per_s: Mapping[str, float]

    def measured_ratio(self, pair: tuple[str, str]) -> float:
        """Measured throughput of the pair's first model over its second."""
        return self.steps_per_s[pair[0]] / self.steps_per_s[pair[1]]

    def suspect(self, pair: tuple[str, str]) -> bool:
        """True for the source's copied values: two models with bit-identical throughput."""
        return self.steps_per_s[pair[0]] == self.steps_per_s[pair[1]]


def family_of(job_type: str) -> str:
    """``ResNet-50 (batch size 64)`` → ``ResNet-50``."""
    return job_type.split(" (", 1)[0]


def load_jobs(mapping: Mapping[str, TaskType] = FAMILY_TASK_TYPE) -> list[JobType]:
    """Every job type measured on all three models, sorted by name."""
    text = importlib.resources.files("loom_benchmarks").joinpath("data", DATA_FILE).read_text()
    raw: dict[str, dict[str, dict[str, Any]]] = json.loads(text)
    names = sorted(set.intersection(*(set(raw[gpu]) for gpu in GAVEL_TO_LIBRARY)))
    return [
        JobType(
            name=name,
            family=family_of(name),
            task_type=mapping[family_of(name)],
            steps_per_s={gpu: float(raw[gpu][name]["null"]) for gpu in GAVEL_TO_LIBRARY},
        )
        for name in names
    ]


def _profile(gpu: str) -> DeviceProfile:
    return profile_for_model(GAVEL_TO_LIBRARY[gpu])


def _observations(jobs: Sequence[JobType]) -> list[RatioObservation]:
    return [
        RatioObservation(_profile(pair[0]), _profile(pair[1]), job.measured_ratio(pair))
        for job in jobs
        for pair in PAIRS
    ]


def _fit(jobs: Sequence[JobType], task_type: TaskType) -> TaskWeights:
    """Weights for ``task_type`` from the given jobs of that type (the prior when there are none)."""
    return fit_weights(_observations([j for j in jobs if j.task_type == task_type]), PRIOR_WEIGHTS[task_type])


def fitted_weights(jobs: Sequence[JobType]) -> dict[TaskType, TaskWeights]:
    """Each task type's weights fitted on all the jobs: what ``loom.model.scu.TASK_WEIGHTS`` holds."""
    return {t: _fit(jobs, t) for t in TASK_TYPES}


Predictor = Callable[[JobType, tuple[str, str]], float]


def _scu_predictor(weights_for: Callable[[JobType], TaskWeights]) -> Predictor:
    def predict(job: JobType, pair: tuple[str, str]) -> float:
        weights = {job.task_type: weights_for(job)}
        return speed_ratio(_profile(pair[0]), _profile(pair[1]), job.task_type, weights=weights)

    return predict


def _held_out(
    jobs: Sequence[JobType], keep: Callable[[JobType, JobType], bool]
) -> Callable[[JobType], TaskWeights]:
    """Weights for a job fitted on the jobs of its task type that ``keep(job, other)`` allows."""
    cache: dict[str, TaskWeights] = {}

    def weights_for(job: JobType) -> TaskWeights:
        if job.name not in cache:
            cache[job.name] = _fit([o for o in jobs if keep(job, o)], job.task_type)
        return cache[job.name]

    return weights_for


def _learned_decay_predictor(jobs: Sequence[JobType]) -> Predictor:
    """Held-out weights, then per-device decay learned from the other job types' delivered throughput.

    A job's steps/s on the reference model (V100M16) stands for the step time its owner declares;
    the profile predicts every other model's rate from it, and each delivered rate teaches that
    model's decay. The reference's own decay stays 1.
    """
    weights_for = _held_out(jobs, _same_type)
    reference_gpu = next(g for g, m in GAVEL_TO_LIBRARY.items() if m == DEFAULT_REFERENCE_MODEL)
    reference = _profile(reference_gpu)
    decays: dict[str, dict[str, float]] = {}

    def decay_for(job: JobType) -> dict[str, float]:
        if job.name in decays:
            return decays[job.name]
        weights = {job.task_type: weights_for(job)}
        learners = {gpu: DecayLearner() for gpu in GAVEL_TO_LIBRARY if gpu != reference_gpu}
        for other in jobs:
            if other.task_type != job.task_type or other.name == job.name:
                continue
            for gpu, learner in learners.items():
                relative = scu(_profile(gpu), job.task_type, reference=reference, weights=weights)
                learners[gpu] = learner.observe(
                    other.steps_per_s[gpu], other.steps_per_s[reference_gpu] * relative
                )
        decays[job.name] = {reference_gpu: 1.0} | {gpu: lr.factor for gpu, lr in learners.items()}
        return decays[job.name]

    def predict(job: JobType, pair: tuple[str, str]) -> float:
        decay = decay_for(job)
        base = _scu_predictor(weights_for)(job, pair)
        return base * decay[pair[0]] / decay[pair[1]]

    return predict


def _peak_predictor(value: Callable[[str], float]) -> Predictor:
    def predict(_job: JobType, pair: tuple[str, str]) -> float:
        return value(GAVEL_TO_LIBRARY[pair[0]]) / value(GAVEL_TO_LIBRARY[pair[1]])

    return predict


def _errors(
    jobs: Sequence[JobType], predict: Predictor
) -> list[tuple[JobType, tuple[str, str], float, float]]:
    """(job, pair, predicted, relative error) for every job and pair."""
    out = []
    for job in jobs:
        for pair in PAIRS:
            predicted = predict(job, pair)
            measured = job.measured_ratio(pair)
            out.append((job, pair, predicted, abs(predicted - measured) / measured))
    return out


def _stats(errors: Sequence[float]) -> dict[str, float]:
    values = np.asarray(errors, dtype=np.float64)
    return {
        "median_error": round(float(np.median(values)), 4),
        "p90_error": round(float(np.percentile(values, 90)), 4),
        "mean_error": round(float(values.mean()), 4),
        "max_error": round(float(values.max()), 4),
        "ratios": len(values),
    }


def _summary(jobs: Sequence[JobType], predict: Predictor, evaluation: str) -> dict[str, Any]:
    rows = _errors(jobs, predict)
    clean = [e for job, pair, _, e in rows if not job.suspect(pair)]
    return {
        "evaluation": evaluation,
        **_stats([e for *_, e in rows]),
        "without_suspect_ratios": _stats(clean),
        "median_error_by_pair": {
            f"{GAVEL_TO_LIBRARY[a]}/{GAVEL_TO_LIBRARY[b]}": round(
                float(np.median([e for _, p, _, e in rows if p == (a, b)])), 4
            )
            for a, b in PAIRS
        },
        "median_error_by_family": {
            family: round(float(np.median([e for job, _, _, e in rows if job.family == family])), 4)
            for family in sorted({job.family for job in jobs})
        },
    }


def _weights_json(weights: TaskWeights) -> dict[str, float]:
    return {k: round(v, 4) for k, v in zip(TaskWeights.__struct_fields__, weights.vector(), strict=True)}


def _same_type(job: JobType, other: JobType) -> bool:
    return other.task_type == job.task_type and other.name != job.name


def _same_type_other_family(job: JobType, other: JobType) -> bool:
    return other.task_type == job.task_type and other.family != job.family


def _scu_predictors(
    jobs: Sequence[JobType],
) -> tuple[dict[str, tuple[Predictor, str]], dict[TaskType, TaskWeights]]:
    """The SCU predictors (in-sample and held out) with what each evaluates, and the in-sample weights."""
    in_sample = fitted_weights(jobs)
    predictors = {
        "scu_in_sample": (
            _scu_predictor(lambda job: in_sample[job.task_type]),
            f"weights fitted on all {len(jobs)} job types (per task type), then predicting the same ratios",
        ),
        "scu_held_out_job_type": (
            _scu_predictor(_held_out(jobs, _same_type)),
            "leave-one-job-type-out: weights refitted without the predicted job type",
        ),
        "scu_held_out_job_family": (
            _scu_predictor(_held_out(jobs, _same_type_other_family)),
            "leave-one-family-out: weights refitted without any batch size of the predicted model; "
            "prior weights when no other family shares its task type",
        ),
        "scu_held_out_job_type_with_learned_decay": (
            _learned_decay_predictor(jobs),
            "leave-one-job-type-out weights, and per-device decay learned (bounded to [0.5, 1.2]) from "
            "the other job types' delivered throughput",
        ),
    }
    return predictors, in_sample


def _naive_predictors() -> dict[str, tuple[Predictor, str]]:
    return {
        "naive_peak_fp32_headline": (
            _peak_predictor(lambda m: HEADLINE_FP32_TFLOPS.get(m, profile_for_model(m).compute_fp32_tflops)),
            "ratio of datasheet headline FP32 TFLOPS (K80 at GPU Boost clocks, 4.37 per GPU)",
        ),
        "naive_peak_fp32_sustained": (
            _peak_predictor(lambda m: profile_for_model(m).compute_fp32_tflops),
            "ratio of the library's FP32 TFLOPS (K80 at base clocks, 2.8 per GPU)",
        ),
        "naive_peak_fp16": (
            _peak_predictor(lambda m: profile_for_model(m).compute_fp16_tflops),
            "ratio of FP16 TFLOPS (V100 tensor cores)",
        ),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compute every figure; the JSON result."""
    jobs = load_jobs()
    scu_predictors, fitted = _scu_predictors(jobs)
    predictors = scu_predictors | _naive_predictors()
    models = {name: _summary(jobs, predict, evaluation) for name, (predict, evaluation) in predictors.items()}
    alternative_jobs = load_jobs(ALTERNATIVE_FAMILY_TASK_TYPE)
    alternative_predictors, _ = _scu_predictors(alternative_jobs)
    packaged_match = all(
        math.isclose(a, b, abs_tol=1e-6)
        for t in TASK_TYPES
        for a, b in zip(TASK_WEIGHTS[t].normalised().vector(), fitted[t].vector(), strict=True)
    )
    held_out = models["scu_held_out_job_type"]
    baseline = models["naive_peak_fp32_sustained"]
    result: dict[str, Any] = {
        "benchmark": "scu",
        "headline": {
            "held_out_evaluation": "scu_held_out_job_type",
            "scu_median_error": held_out["median_error"],
            "scu_p90_error": held_out["p90_error"],
            "scu_in_sample_median_error": models["scu_in_sample"]["median_error"],
            "scu_held_out_job_family_median_error": models["scu_held_out_job_family"]["median_error"],
            "naive_fp32_headline_median_error": models["naive_peak_fp32_headline"]["median_error"],
            "naive_fp32_sustained_median_error": baseline["median_error"],
            "naive_fp32_sustained_p90_error": baseline["p90_error"],
            "target_median_error": TARGET_MEDIAN_ERROR,
            "held_out_meets_target": held_out["median_error"] <= TARGET_MEDIAN_ERROR,
            "held_out_beats_naive_fp32": held_out["median_error"] < baseline["median_error"]
            and held_out["p90_error"] < baseline["p90_error"],
        },
        "error_definition": "|predicted_ratio - measured_ratio| / measured_ratio over every job type and "
        "every model pair; p90 by linear interpolation",
        "data": {
            "source": SOURCE,
            "job_types": len(jobs),
            "pairs": [f"{GAVEL_TO_LIBRARY[a]}/{GAVEL_TO_LIBRARY[b]}" for a, b in PAIRS],
            "ratios": len(jobs) * len(PAIRS),
            "gavel_gpu_to_library_model": dict(GAVEL_TO_LIBRARY),
            "suspect_ratios": [
                f"{job.name}: {GAVEL_TO_LIBRARY[a]}/{GAVEL_TO_LIBRARY[b]}"
                for job in jobs
                for a, b in PAIRS
                if job.suspect((a, b))
            ],
            "suspect_note": "bit-identical throughput on two models in the source (a copied value, not a "
            "measured ratio of 1); counted in every figure, and left out only under without_suspect_ratios",
        },
        "family_task_type": dict(FAMILY_TASK_TYPE),
        "models": models,
        "weights": {
            "fitted_in_sample": {t: _weights_json(w) for t, w in fitted.items()},
            "prior": {t: _weights_json(w.normalised()) for t, w in PRIOR_WEIGHTS.items()},
            "packaged_equal_fitted": packaged_match,
            "note": "inference has no Gavel job: its fitted weights are the prior",
        },
        "library_profiles": {
            model: {"product": reference_profile(model).product, **_profile_json(profile_for_model(model))}
            for model in GAVEL_TO_LIBRARY.values()
        },
        "alternative_mapping": {
            "family_task_type": dict(ALTERNATIVE_FAMILY_TASK_TYPE),
            **{
                name: {
                    k: v
                    for k, v in _summary(alternative_jobs, *alternative_predictors[name]).items()
                    if k in ("median_error", "p90_error")
                }
                for name in ("scu_in_sample", "scu_held_out_job_type", "scu_held_out_job_family")
            },
        },
    }
    if args.rows:
        result["rows"] = _rows(jobs, {name: predict for name, (predict, _) in predictors.items()})
    return result


def _profile_json(profile: DeviceProfile) -> dict[str, Any]:
    return {k: getattr(profile, k) for k in profile.__struct_fields__ if k != "model"}


def _rows(jobs: Sequence[JobType], predictors: Mapping[str, Predictor]) -> list[dict[str, Any]]:
    return [
        {
            "job_type": job.name,
            "task_type": job.task_type,
            "pair": f"{GAVEL_TO_LIBRARY[pair[0]]}/{GAVEL_TO_LIBRARY[pair[1]]}",
            "measured": round(job.measured_ratio(pair), 4),
            **{name: round(predict(job, pair), 4) for name, predict in predictors.items()},
        }
        for job in jobs
        for pair in PAIRS
    ]


def print_table(result: Mapping[str, Any]) -> None:
    """The figures as a readable table on stderr."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"predicted vs measured speed ratios ({result['data']['ratios']} ratios, Gavel)")
    table.add_column("model", no_wrap=True)
    for col in ("median err", "p90 err", *(f"median {pair}" for pair in result["data"]["pairs"])):
        table.add_column(col, justify="right")
    for name, m in result["models"].items():
        by_pair = (f"{v:.0%}" for v in m["median_error_by_pair"].values())
        table.add_row(name, f"{m['median_error']:.1%}", f"{m['p90_error']:.1%}", *by_pair)
    console = Console(stderr=True)
    console.print(table)
    h = result["headline"]
    console.print(
        f"held out (leave one job type out): median {h['scu_median_error']:.1%}, p90 {h['scu_p90_error']:.1%}"
        f"  vs naive FP32 {h['naive_fp32_sustained_median_error']:.1%} (sustained) /"
        f" {h['naive_fp32_headline_median_error']:.1%} (headline); target {h['target_median_error']:.0%}:"
        f" {'met' if h['held_out_meets_target'] else 'NOT met'}"
    )


def main(args: argparse.Namespace) -> int:
    """``loom bench scu``: JSON on stdout, the table on stderr unless ``--json``."""
    result = run(args)
    print(json.dumps(result, indent=2))
    if not args.json:
        print_table(result)
    sys.stdout.flush()
    return 0

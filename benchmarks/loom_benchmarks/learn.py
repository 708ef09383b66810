"""``loom bench learn``: how fast the speed learner finds a (family, GPU) whose profile is wrong.

Synthetic runs, seeded: a GPU model delivers ``--truth`` times its profile's speed for one job
family (1/3 by default: the profile is 3x too fast) and each run's measured speed carries
log-normal noise of ``--noise-cv``. Reported, over ``--seeds`` seeds:

- ``convergence``: after each run n (1..``--runs``), the median and worst relative error of the
  learned factor, and the share of seeds within 15 %; ``runs_to_15pct``: per seed, the first run
  after which the estimate stays within 15 % up to the last run (median and worst);
- ``sharing``: a family run on GPUs X and Y and another family run on X only (Y delivers
  ``--truth`` for every family): the second family's factor on Y, never run there, and its error;
- ``outlier``: five runs at the truth, then one run 20x too slow: how far the estimate moves;
- ``held_out_cells``: real deviations, not synthetic ones. Every (model, precision, GPU) cell of
  Gavel + Lambda (``loom bench scu``'s data) deviates from its fitted profile by its measured
  ratio; per seed, a share of the cells (5, 15 or 30 %) is run 1-3 times each (noise
  ``--noise-cv``), and every cell never run whose family ran on some GPU and whose GPU ran some
  family (the learner's ``shared`` estimate; the others stay at the profile) is predicted
  (``predicted`` counts them). Reported: the mean and median absolute error of the predicted log
  factor, the share predicted more than 2x too fast or too slow, for the learner's settings, for
  the main effects' priors before 2026-12-07 (sd 0.5, as a cell's plain prior: ``loose_priors``)
  and for the profile alone (no learning); and how honest each estimate's own sd is (the share of
  errors within it, 68 % for a normal error; speed probes and exploration choose cells by it).

The learner is :class:`loom.model.learn.SpeedLearner` with its default settings, the one placement
and the simulator use.
"""

import argparse
import math
import random
import statistics
import sys
from typing import Any, Final

from loom.cli.argtypes import non_negative_float_below, non_negative_int, positive_float, positive_int
from loom.model.learn import LearnSettings, SpeedLearner
from loom_benchmarks.scu import in_sample, load_cells

TOLERANCE = 0.15
NOISE_CV_LIMIT: Final = 1.0
"""``--noise-cv`` is below this: the bound a truth file puts on its run-to-run noise
(:mod:`loom.sim.truth`, ``noise.cv`` in [0, 1))."""


def _noisy(rng: random.Random, truth: float, cv: float) -> float:
    return truth * math.exp(rng.gauss(0.0, cv))


def convergence(truth: float, noise_cv: float, runs: int, seeds: int, first_seed: int = 0) -> dict[str, Any]:
    """Per run count, the learned factor's relative error over seeds."""
    errors: list[list[float]] = [[] for _ in range(runs)]
    needed: list[int | None] = []
    for seed in range(first_seed, first_seed + seeds):
        rng = random.Random(seed)
        learner = SpeedLearner()
        first: int | None = None
        for n in range(runs):
            observed = _noisy(rng, truth, noise_cv)
            learner.observe("family", "gpu", prior_speed=1.0, observed_speed=observed)
            error = abs(learner.estimate("family", "gpu").factor / truth - 1)
            errors[n].append(error)
            within = error <= TOLERANCE
            # The first run of the final streak within the tolerance.
            first = (first or n + 1) if within else None
        needed.append(first)
    reached = [n for n in needed if n is not None]
    return {
        "per_run": [
            {
                "runs": n + 1,
                "median_error": round(statistics.median(e), 4),
                "max_error": round(max(e), 4),
                "share_within_15pct": round(sum(x <= TOLERANCE for x in e) / len(e), 4),
            }
            for n, e in enumerate(errors)
        ],
        "runs_to_15pct": {
            "median": statistics.median(reached) if reached else None,
            "max": max(reached) if len(reached) == len(needed) else None,
            "seeds_never_within": len(needed) - len(reached),
        },
    }


def sharing(truth: float, noise_cv: float, seeds: int, first: int = 0) -> dict[str, Any]:
    """A family never run on a GPU, estimated from other families' runs there."""
    errors = []
    factors = []
    for seed in range(first, first + seeds):
        rng = random.Random(10_000 + seed)
        learner = SpeedLearner()
        for _ in range(5):
            learner.observe("seen", "X", prior_speed=1.0, observed_speed=_noisy(rng, 1.0, noise_cv))
            learner.observe("seen", "Y", prior_speed=1.0, observed_speed=_noisy(rng, truth, noise_cv))
            learner.observe("new", "X", prior_speed=1.0, observed_speed=_noisy(rng, 1.0, noise_cv))
        estimate = learner.estimate("new", "Y")
        factors.append(estimate.factor)
        errors.append(abs(estimate.factor / truth - 1))
    return {
        "median_factor": round(statistics.median(factors), 4),
        "median_error": round(statistics.median(errors), 4),
        "max_error": round(max(errors), 4),
        "error_without_sharing": round(abs(1.0 / truth - 1), 4),
    }


def outlier(truth: float, noise_cv: float, seeds: int, first: int = 0) -> dict[str, Any]:
    """How far one run 20x too slow moves an estimate made of five good runs."""
    moves = []
    for seed in range(first, first + seeds):
        rng = random.Random(20_000 + seed)
        learner = SpeedLearner()
        for _ in range(5):
            learner.observe("family", "gpu", prior_speed=1.0, observed_speed=_noisy(rng, truth, noise_cv))
        before = learner.estimate("family", "gpu").factor
        learner.observe("family", "gpu", prior_speed=1.0, observed_speed=truth / 20)
        moves.append(abs(learner.estimate("family", "gpu").factor / before - 1))
    return {"median_move": round(statistics.median(moves), 4), "max_move": round(max(moves), 4)}


HELD_OUT_SHARES: Final = (0.05, 0.15, 0.3)
"""Shares of the measured cells run per seed in ``held_out_cells``."""
HELD_OUT_SEEDS: Final = 50
"""At most this many of ``--seeds`` for ``held_out_cells`` (each refits the learner per run)."""
LOOSE_PRIORS: Final = LearnSettings(gpu_effect_sd=0.5, family_effect_sd=0.5)
"""The shared fit's main-effect priors before 2026-12-07: the cell's plain prior, sd 0.5."""


def measured_deviations() -> dict[tuple[str, str], float]:
    """Per (``model@precision``, GPU model), the log of Gavel + Lambda's measured ratio over the
    fitted profile's (the mean over Gavel's batch sizes of one model; the sources share no cell)."""
    logs: dict[tuple[str, str], list[float]] = {}
    for cell, predicted in in_sample(load_cells()):
        key = (f"{cell.model}@{cell.precision}", cell.gpu)
        logs.setdefault(key, []).append(math.log(cell.measured_ratio / predicted))
    return {key: statistics.fmean(values) for key, values in logs.items()}


def _errors_summary(errors: list[float], sds: list[float]) -> dict[str, Any]:
    absolute = [abs(e) for e in errors]
    two = math.log(2.0)
    return {
        # how honest the estimate's own sd is (a normal error is within 1 sd 68 % of the time):
        # speed probes and exploration pick cells by it
        "share_within_1_sd": round(statistics.fmean(a <= sd for a, sd in zip(absolute, sds, strict=True)), 4),
        "median_sd": round(statistics.median(sds), 4),
        "mean_abs_log_error": round(statistics.fmean(absolute), 4),
        "median_abs_log_error": round(statistics.median(absolute), 4),
        "share_2x_too_fast": round(sum(e > two for e in errors) / len(errors), 4),
        "share_2x_too_slow": round(sum(e < -two for e in errors) / len(errors), 4),
    }


def held_out_cells(noise_cv: float, seeds: int, first: int = 0) -> dict[str, Any]:
    """How well the shared fit predicts measured cells it never saw (see the module's docstring)."""
    truth = measured_deviations()
    keys = sorted(truth)
    out: dict[str, Any] = {"cells": len(keys), "shares": {}}
    for share in HELD_OUT_SHARES:
        errors: dict[str, list[float]] = {"learner": [], "loose_priors": []}
        sds: dict[str, list[float]] = {"learner": [], "loose_priors": []}
        deviations: list[float] = []
        for seed in range(first, first + seeds):
            rng = random.Random(f"held-out {share} {seed}")
            runs = {
                key: [truth[key] + rng.gauss(0.0, noise_cv) for _ in range(rng.randint(1, 3))]
                for key in keys
                if rng.random() < share
            }
            learners = {"learner": SpeedLearner(), "loose_priors": SpeedLearner(LOOSE_PRIORS)}
            for learner in learners.values():
                for (family, gpu), ys in runs.items():
                    for y in ys:
                        learner.observe(family, gpu, prior_speed=1.0, observed_speed=math.exp(y))
            for key in keys:
                if key in runs or learners["learner"].estimate(*key).source != "shared":
                    continue
                deviations.append(truth[key])
                for name, learner in learners.items():
                    estimate = learner.estimate(*key)
                    errors[name].append(math.log(estimate.factor) - truth[key])
                    sds[name].append(estimate.log_sd)
        if deviations:
            out["shares"][str(share)] = {
                "predicted": len(deviations),
                "profile_alone_mean_abs_log_error": round(statistics.fmean(abs(d) for d in deviations), 4),
            } | {name: _errors_summary(values, sds[name]) for name, values in errors.items()}
    return out


TRUTH_MIN = 1e-4
TRUTH_MAX = 1e4
"""``--truth`` bounds: a GPU 10,000x off its profile is a unit mistake (1e-300 was taken, and the
sharing error read 1.4e297)."""


def _truth_factor(text: str) -> float:
    value = positive_float(text)
    if not TRUTH_MIN <= value <= TRUTH_MAX:
        raise argparse.ArgumentTypeError(f"must be within {TRUTH_MIN:g}-{TRUTH_MAX:g}, got {value:g}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``loom bench learn``; a value out of range is bad usage (exit 2)."""
    parser.add_argument(
        "--truth",
        type=_truth_factor,
        default=1 / 3,
        help=f"true factor on the profile's speed, within {TRUTH_MIN:g}-{TRUTH_MAX:g}"
        " (default 1/3: the profile is 3x too fast)",
    )
    parser.add_argument(
        "--noise-cv",
        type=non_negative_float_below(NOISE_CV_LIMIT),
        default=0.05,
        help=f"run-to-run noise (log sd), in [0, {NOISE_CV_LIMIT:g}) as a truth file's noise.cv"
        " (default 0.05)",
    )
    parser.add_argument("--runs", type=positive_int, default=10, help="runs per seed, 1 or more (default 10)")
    parser.add_argument(
        "--seeds",
        type=positive_int,
        default=200,
        help="how many seeds to run (a count, N: seeds FIRST to FIRST+N-1), 1 or more (default 200)",
    )
    parser.add_argument(
        "--first-seed",
        type=non_negative_int,
        default=0,
        help="the first seed (default 0): seeds never run before, for a held-out check",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's result (see the module's docstring)."""
    truth, cv, seeds = args.truth, args.noise_cv, args.seeds
    first = getattr(args, "first_seed", 0)
    result = {
        "truth": truth,
        "noise_cv": cv,
        "seeds": seeds,
        "first_seed": first,
        "convergence": convergence(truth, cv, args.runs, seeds, first),
        "sharing": sharing(truth, cv, seeds, first),
        "outlier": outlier(truth, cv, seeds, first),
        "held_out_cells": held_out_cells(cv, min(seeds, HELD_OUT_SEEDS), first),
    }
    if not args.json:
        for row in result["convergence"]["per_run"]:
            print(
                f"after {row['runs']:>2} run(s): median error {row['median_error']:.1%},"
                f" worst {row['max_error']:.1%}, within 15 % {row['share_within_15pct']:.0%}",
                file=sys.stderr,
            )
    return result

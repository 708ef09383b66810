"""The speed learner: from a wrong profile to the truth in a few runs, shared, robust and bounded."""

import itertools
import math
import random

import msgspec
import pytest

from loom.errors import InvalidInputError
from loom.model.capacity import NodeCapacity
from loom.model.learn import LearnSettings, SpeedLearner
from loom.model.profiles import relative_speed
from loom.model.topology import load_topology
from loom.sched.plugins.cost import default_economics
from loom.sched.snapshot import ClusterInfo, NetMatrix
from loom.sim.engine import simulate
from loom.sim.model import Platform, SimJob, Trace
from loom.sim.policies import POLICIES
from loom_proto.jobs import JobSpec, Resources, Work

TRUE_FACTOR = 1 / 3
"""The GPU delivers a third of what its profile promises (the profile is 3x too fast)."""
PRIOR_SPEED = 3.0
NOISE_CV = 0.05


def noisy_runs(
    learner: SpeedLearner, family: str, gpu: str, truth: float, runs: int, *, rng: random.Random
) -> None:
    for _ in range(runs):
        observed = PRIOR_SPEED * truth * math.exp(rng.gauss(0.0, NOISE_CV))
        learner.observe(family, gpu, prior_speed=PRIOR_SPEED, observed_speed=observed)


def runs_to_within(truth: float, tolerance: float, seed: int, limit: int = 10) -> int | None:
    """Runs until the estimate is within ``tolerance`` of ``truth`` and stays so up to ``limit``."""
    rng = random.Random(seed)
    learner = SpeedLearner()
    first = None
    for n in range(1, limit + 1):
        noisy_runs(learner, "gru", "A100", truth, 1, rng=rng)
        error = abs(learner.estimate("gru", "A100").factor / truth - 1)
        if error <= tolerance and first is None:
            first = n
        elif error > tolerance:
            first = None
    return first


def test_a_profile_three_times_wrong_is_learned_within_15_percent_in_ten_noisy_runs() -> None:
    for seed in range(20):
        needed = runs_to_within(TRUE_FACTOR, 0.15, seed)
        assert needed is not None, f"seed {seed}: not within 15 % after 10 runs"
        assert needed <= 10


def test_the_estimate_starts_at_the_prior_and_moves_by_far_most_of_the_way_on_one_run() -> None:
    learner = SpeedLearner()
    before = learner.estimate("gru", "A100")
    assert (before.factor, before.log_sd, before.runs, before.source) == (1.0, 0.5, 0, "prior")
    learner.observe("gru", "A100", prior_speed=PRIOR_SPEED, observed_speed=PRIOR_SPEED * TRUE_FACTOR)
    after = learner.estimate("gru", "A100")
    assert after.source == "own"
    assert after.runs == 1
    assert abs(after.factor / TRUE_FACTOR - 1) < 0.15


def test_there_is_no_bound_a_third_or_five_times_the_profile_is_learned_as_such() -> None:
    learner = SpeedLearner()
    for _ in range(10):
        learner.observe("gru", "A100", prior_speed=3.0, observed_speed=1.0)
        learner.observe("bert", "H100", prior_speed=1.0, observed_speed=5.0)
    assert learner.estimate("gru", "A100").factor == pytest.approx(1 / 3, rel=0.03)
    assert learner.estimate("bert", "H100").factor == pytest.approx(5.0, rel=0.05)


def test_a_family_never_run_on_a_gpu_borrows_part_of_that_gpus_effect_from_other_families() -> None:
    learner = SpeedLearner()
    for _ in range(5):
        learner.observe("resnet", "A", prior_speed=1.0, observed_speed=1.0)
        learner.observe("resnet", "B", prior_speed=1.0, observed_speed=0.5)
        learner.observe("bert", "A", prior_speed=1.0, observed_speed=1.0)
    borrowed = learner.estimate("bert", "B")
    assert borrowed.source == "shared"
    assert borrowed.runs == 0
    # One family's halving on B is mostly its own (the GPU effect's prior sd, 0.25, against the
    # interaction's 0.2): bert on B moves part of the way, not all of it.
    assert 0.6 < borrowed.factor < 0.85
    assert borrowed.log_sd < 0.5
    assert ("bert", "B") in learner.factors()
    # A family and a GPU nobody ran stay at the prior.
    assert learner.estimate("llama", "T4").source == "prior"
    assert learner.estimate("llama", "T4").factor == 1.0


def test_a_gpu_effect_shared_by_several_families_carries_further_than_one_familys() -> None:
    def borrowed(families: int) -> float:
        learner = SpeedLearner()
        for _ in range(3):
            for f in range(families + 1):
                learner.observe(f"f{f}", "A", prior_speed=1.0, observed_speed=1.0)
            for f in range(families):
                learner.observe(f"f{f}", "B", prior_speed=1.0, observed_speed=3.0)
        return learner.estimate(f"f{families}", "B").factor

    one, two, five = borrowed(1), borrowed(2), borrowed(5)
    assert 1.0 < one < two < five < 3.0
    assert five > 1.8  # five families 3x faster on B: most of it is B's


def test_one_familys_speed_up_on_a_gpu_is_not_lent_to_a_family_that_never_ran_there() -> None:
    """The fifth evaluator's K80 case: one family ran 3.3x its K80 profile; a family that never
    ran on a K80 must not be believed several times faster there (a long gang was sent to K80s
    believed 10x faster than they were). Measured on Gavel + Lambda's cells, GPU effects vary
    with sd 0.14, family effects 0.24 and the rest 0.18: one family's deviation is mostly its own."""
    loose = SpeedLearner(LearnSettings(gpu_effect_sd=0.5, family_effect_sd=0.5))
    learner = SpeedLearner()
    for each in (loose, learner):
        for _ in range(3):
            for gpu in ("V100", "P100"):
                each.observe("xl", gpu, prior_speed=1.0, observed_speed=1.0)
                each.observe("lm", gpu, prior_speed=1.0, observed_speed=1.0)
            each.observe("xl", "K80", prior_speed=1.0, observed_speed=3.27)
    assert loose.estimate("lm", "K80").factor > 2.2  # the prior sds of before: 0.5 for both effects
    assert learner.estimate("lm", "K80").factor < 1.5
    assert learner.estimate("xl", "K80").factor == pytest.approx(3.27, rel=0.03)


def test_a_family_seen_slow_everywhere_carries_its_effect_to_a_gpu_it_never_ran_on() -> None:
    learner = SpeedLearner()
    for _ in range(5):
        learner.observe("gru", "A", prior_speed=1.0, observed_speed=0.5)
        learner.observe("gru", "B", prior_speed=1.0, observed_speed=0.5)
        learner.observe("resnet", "C", prior_speed=1.0, observed_speed=1.0)
        learner.observe("gru", "C", prior_speed=1.0, observed_speed=0.5)
        learner.observe("bert", "A", prior_speed=1.0, observed_speed=1.0)
        learner.observe("bert", "C", prior_speed=1.0, observed_speed=1.0)
    assert learner.estimate("resnet", "A").factor > 0.8
    assert learner.estimate("gru", "A").factor == pytest.approx(0.5, rel=0.05)
    assert learner.estimate("bert", "B").source == "shared"


def test_uncertainty_shrinks_with_every_run() -> None:
    learner = SpeedLearner()
    rng = random.Random(7)
    sds = [learner.estimate("gru", "A100").log_sd]
    for _ in range(10):
        noisy_runs(learner, "gru", "A100", TRUE_FACTOR, 1, rng=rng)
        sds.append(learner.estimate("gru", "A100").log_sd)
    assert all(later < earlier for earlier, later in itertools.pairwise(sds))
    assert sds[-1] < 0.04


def test_one_wild_run_moves_an_established_estimate_by_a_few_percent_only() -> None:
    def after_outlier(settings: LearnSettings) -> float:
        learner = SpeedLearner(settings)
        for _ in range(5):
            learner.observe("gru", "A100", prior_speed=1.0, observed_speed=1.0)
        learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.05)
        return learner.estimate("gru", "A100").factor

    robust = after_outlier(LearnSettings())
    naive = after_outlier(LearnSettings(clip_sds=100.0))
    assert robust > 0.9
    assert naive < 0.7


@pytest.mark.parametrize("truth", [14.35, 1 / 14.35, 30.0, 8.0, 1 / 8])
def test_a_profile_off_by_far_more_than_the_clip_is_learned_from_two_agreeing_runs(truth: float) -> None:
    # Outside measurements (Sia's NCF on Quadro RTX 6000 against the Azure V100) put one
    # (family, GPU) 14x from its profile; the clip alone needed ~38 runs for that (never, at 1/14).
    for seed in range(20):
        needed = runs_to_within(truth, 0.15, seed)
        assert needed is not None and needed <= 2, f"seed {seed}: {needed}"


def test_two_wild_runs_that_disagree_with_each_other_stay_clipped() -> None:
    learner = SpeedLearner()  # a young cell: the confirmation rule applies
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=1.0)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.05)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=5.0)
    # Counted unclipped the two would have given ~0.63; clipped, the estimate stays near 1.
    assert 0.8 < learner.estimate("gru", "A100").factor < 1.25
    assert learner.state().cells[0].clipped == 2


def test_two_wild_runs_that_agree_confirm_each_other_in_a_young_cell() -> None:
    learner = SpeedLearner()
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=1.0)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.05)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.052)
    # Both count unclipped next to the first run: the geometric mean of 1, 0.05, 0.052 (the prior
    # pulls a little toward 1).
    assert learner.estimate("gru", "A100").factor == pytest.approx((0.05 * 0.052) ** (1 / 3), rel=0.05)


def test_noisy_runs_far_beyond_the_estimate_confirm_each_other_though_further_apart_than_the_noise_says() -> (
    None
):
    # A GPU model 20x slower than its profile, runs 25 % apart (a run-to-run cv of 20-30 %, more
    # than the learner's noise sd of 0.1 assumes). Before, no two runs in a row were within the
    # noise sds of each other, so all stayed clipped, the cell was established after its third run
    # and then moved a clip at a time: still 2x off after ten runs (`loom bench learn --truth 0.05
    # --noise-cv 0.2`: 28 of 200 seeds never within 15 %).
    learner = SpeedLearner()
    truth = 0.05
    for i in range(10):
        learner.observe(
            "gru", "A100", prior_speed=1.0, observed_speed=truth * math.exp(0.25 if i % 2 else -0.25)
        )
    assert learner.estimate("gru", "A100").factor == pytest.approx(truth, rel=0.15)


def test_two_slow_runs_further_apart_than_any_noise_do_not_confirm_each_other() -> None:
    # Both far below the estimate and nearer each other than to it, but 5x apart: no run-to-run
    # noise does that (a review: the first version of the rule took 10x and 50x slower as 0.215).
    learner = SpeedLearner()
    for observed in (1.0, 1.0, 0.1, 0.02):
        learner.observe("gru", "A100", prior_speed=1.0, observed_speed=observed)
    assert learner.state().cells[0].clipped == 2
    assert learner.estimate("gru", "A100").factor > 0.7


def test_two_wild_runs_on_one_side_but_far_apart_stay_clipped() -> None:
    learner = SpeedLearner()  # young
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=1.0)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.15)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.01)
    # One a little beyond the clip, one far beyond it: further apart than the nearer is from the
    # estimate, so neither speaks for the other.
    assert learner.state().cells[0].clipped == 2
    assert learner.estimate("gru", "A100").factor > 0.3


def test_an_established_cell_is_moved_by_the_clip_alone_even_by_two_agreeing_wild_runs() -> None:
    def after_ten_runs_and_two_wild_ones(settings: LearnSettings) -> float:
        learner = SpeedLearner(settings)
        for observed in [1.0] * 10 + [0.05, 0.05]:
            learner.observe("gru", "A100", prior_speed=1.0, observed_speed=observed)
        return learner.estimate("gru", "A100").factor

    assert after_ten_runs_and_two_wild_ones(LearnSettings()) > 0.85
    assert after_ten_runs_and_two_wild_ones(LearnSettings(confirm_within_runs=100.0)) < 0.7


def test_a_wild_run_then_a_normal_one_does_not_confirm_a_later_wild_run() -> None:
    learner = SpeedLearner()  # young: only the run between keeps the two wild ones apart
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=1.0)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.05)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=1.0)
    assert learner.state().cells[0].pending is None
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.05)
    # Each wild run is clipped (at ~0.66 here); confirmed, the two would have pulled it to ~0.22.
    assert learner.estimate("gru", "A100").factor > 0.75


def test_a_short_memory_does_not_keep_a_cell_young_forever() -> None:
    learner = SpeedLearner(LearnSettings(memory_runs=2.5))
    for _ in range(50):
        learner.observe("gru", "A100", prior_speed=1.0, observed_speed=1.0)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.05)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.05)
    assert learner.estimate("gru", "A100").factor > 0.6


def test_a_stored_pending_run_without_a_weight_is_refused() -> None:
    learner = SpeedLearner()
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=50.0)
    data = learner.to_bytes().replace(b'"pending_weight":1.0', b'"pending_weight":0.0')
    with pytest.raises(InvalidInputError, match="pending run"):
        SpeedLearner.from_bytes(data)


def test_a_truth_that_changes_is_followed_not_resisted() -> None:
    learner = SpeedLearner(LearnSettings(memory_runs=10.0))
    rng = random.Random(3)
    noisy_runs(learner, "gru", "A100", 1.0, 10, rng=rng)
    noisy_runs(learner, "gru", "A100", 0.5, 20, rng=rng)
    assert learner.estimate("gru", "A100").factor == pytest.approx(0.5, rel=0.15)


def test_exploration_is_optimistic_only_for_uncertain_cells_and_only_for_a_bounded_share() -> None:
    settings = LearnSettings(explore_share=0.1)
    learner = SpeedLearner(settings)
    for _ in range(5):
        learner.observe("resnet", "A", prior_speed=1.0, observed_speed=1.0)
        learner.observe("resnet", "B", prior_speed=1.0, observed_speed=0.5)
    learner.observe("bert", "A", prior_speed=1.0, observed_speed=1.0)
    plain = learner.factors()
    assert learner.decisions == 0  # plain factors are not decisions
    explored_calls = 0
    for _ in range(100):
        offered = learner.factors(explore=True)
        if offered != plain:
            explored_calls += 1
            # Certain cells keep their plain factor; the uncertain one is offered above it.
            assert offered[("resnet", "A")] == plain[("resnet", "A")]
            assert offered[("resnet", "B")] == plain[("resnet", "B")]
            assert offered[("bert", "B")] > plain[("bert", "B")]
    assert learner.decisions == 100
    assert explored_calls == learner.explored == 10
    assert learner.factors(explore=True) is not None
    # A cell with enough runs of its own is never explored.
    for _ in range(3):
        learner.observe("bert", "B", prior_speed=1.0, observed_speed=0.5)
    for _ in range(50):
        assert learner.factors(explore=True) == learner.factors()


def test_no_exploration_budget_means_no_exploration() -> None:
    learner = SpeedLearner(LearnSettings(explore_share=0.0))
    learner.observe("resnet", "A", prior_speed=1.0, observed_speed=1.0)
    learner.observe("bert", "B", prior_speed=1.0, observed_speed=1.0)
    learner.observe("resnet", "B", prior_speed=1.0, observed_speed=1.0)
    for _ in range(30):
        assert learner.factors(explore=True) == learner.factors()
    assert learner.explored == 0


def test_state_round_trips_through_bytes() -> None:
    learner = SpeedLearner(LearnSettings(rank=2, noise_sd=0.08))
    rng = random.Random(11)
    noisy_runs(learner, "gru", "A100", TRUE_FACTOR, 4, rng=rng)
    noisy_runs(learner, "resnet", "V100", 0.9, 3, rng=rng)
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=50.0)  # clipped
    learner.factors(explore=True)
    data = learner.to_bytes()
    again = SpeedLearner.from_bytes(data)
    assert again.to_bytes() == data
    assert again.estimates() == learner.estimates()
    assert again.settings == learner.settings
    assert again.state().cells[0].clipped == 1
    assert again.state().cells[0].pending == pytest.approx(math.log(50.0 / 1.0))
    with pytest.raises(InvalidInputError):
        SpeedLearner.from_bytes(b'{"version": 99}')
    with pytest.raises(InvalidInputError):
        SpeedLearner.from_bytes(b"not json")


def test_a_family_whose_runs_on_one_model_disagree_has_a_spread_and_no_steady_cells() -> None:
    learner = SpeedLearner()
    # "yolo": runs of one network, within a few percent of each other on each model.
    for observed in (0.80, 0.82, 0.79):
        learner.observe("yolo", "A100", prior_speed=4.0, observed_speed=observed * 4.0)
    learner.observe("yolo", "T4", prior_speed=1.0, observed_speed=0.70)
    # "mixed": jobs of several networks under one label, 1x to 3x apart on the same model.
    for observed in (1.0, 3.0, 1.5):
        learner.observe("mixed", "A100", prior_speed=4.0, observed_speed=observed)
    learner.observe("mixed", "T4", prior_speed=1.0, observed_speed=0.5)
    # A family with one run per model: no spread known yet.
    learner.observe("new", "A100", prior_speed=4.0, observed_speed=2.0)
    yolo, mixed = learner.spread("yolo"), learner.spread("mixed")
    assert yolo is not None and yolo < 0.05
    assert mixed is not None and mixed > 0.4
    assert learner.spread("new") is None and learner.spread("never") is None
    assert learner.steady_cells() == {("yolo", "A100"), ("yolo", "T4"), ("new", "A100")}
    assert learner.measured_cells() == learner.steady_cells() | {("mixed", "A100"), ("mixed", "T4")}
    assert learner.steady_cells(max_spread=1.0) == learner.measured_cells()
    # The spread is kept across a restart; a state stored before it was kept loads without one.
    again = SpeedLearner.from_bytes(learner.to_bytes())
    assert again.spread("mixed") == pytest.approx(mixed) and again.steady_cells() == learner.steady_cells()
    old = msgspec.json.decode(learner.to_bytes())
    for cell in old["cells"]:
        for key in ("logged", "log_sum", "log_sq"):
            cell.pop(key)
    before = SpeedLearner.from_bytes(msgspec.json.encode(old))
    assert before.spread("mixed") is None and before.estimates() == learner.estimates()


def test_the_spread_forgets_as_the_factor_does() -> None:
    learner = SpeedLearner(LearnSettings(memory_runs=10))
    for _ in range(30):
        learner.observe("fam", "A100", prior_speed=1.0, observed_speed=1.0)
    for _ in range(5):
        learner.observe("fam", "A100", prior_speed=1.0, observed_speed=1.6)
    changing = learner.spread("fam")
    assert changing is not None and changing > 0.2 and not learner.steady_cells()
    # Once the truth has been the new one for a while, its runs agree again.
    for _ in range(60):
        learner.observe("fam", "A100", prior_speed=1.0, observed_speed=1.6)
    settled = learner.spread("fam")
    assert settled is not None and settled < 0.05
    assert learner.steady_cells() == {("fam", "A100")}


def test_the_same_observations_give_the_same_state() -> None:
    def build() -> SpeedLearner:
        learner = SpeedLearner()
        rng = random.Random(5)
        for family, gpu, truth in [("gru", "A100", 0.33), ("resnet", "A100", 1.1), ("resnet", "T4", 0.8)]:
            noisy_runs(learner, family, gpu, truth, 6, rng=rng)
        return learner

    one, two = build(), build()
    assert one.to_bytes() == two.to_bytes()
    assert one.factors() == two.factors()
    assert one.estimates() == two.estimates()


@pytest.mark.parametrize(
    ("prior", "observed", "weight"),
    [(0.0, 1.0, 1.0), (1.0, -1.0, 1.0), (1.0, math.nan, 1.0), (1.0, 1.0, 0.0), (math.inf, 1.0, 1.0)],
)
def test_impossible_observations_are_refused(prior: float, observed: float, weight: float) -> None:
    learner = SpeedLearner()
    with pytest.raises(InvalidInputError):
        learner.observe("gru", "A100", prior_speed=prior, observed_speed=observed, weight=weight)
    assert learner.runs() == {}


def test_a_lighter_run_counts_for_less() -> None:
    heavy, light = SpeedLearner(), SpeedLearner()
    heavy.observe("gru", "A100", prior_speed=1.0, observed_speed=0.5, weight=1.0)
    light.observe("gru", "A100", prior_speed=1.0, observed_speed=0.5, weight=0.1)
    assert heavy.estimate("gru", "A100").factor < light.estimate("gru", "A100").factor < 1.0
    assert heavy.estimate("gru", "A100").log_sd < light.estimate("gru", "A100").log_sd


def test_the_simulator_teaches_the_learner_at_every_single_part_completion() -> None:
    region = "aws-us-east-2"
    models = {"c-a": "A100", "c-b": "V100M32"}
    platform = Platform(
        name="learn",
        nodes=[
            NodeCapacity(
                node=f"{cid}-n0", cluster=cid, region=region, zone=f"{region}-a", gpu_model=m, gpus_total=8
            )
            for cid, m in models.items()
        ],
        clusters={cid: ClusterInfo(id=cid, region=region, zone=f"{region}-a") for cid in models},
        net=NetMatrix.from_topology(load_topology()),
        economics=default_economics(),
        speed={(m, "training_compute"): relative_speed(m, "training_compute") for m in models.values()},
        gpu_memory_gib=dict.fromkeys(models.values(), 80.0),
    )
    jobs = [
        SimJob(
            spec=JobSpec(
                job_id=f"j{i}",
                tenant="t",
                labels={"model": "GRU speech"},
                resources=Resources(gpus=4),
                work=Work(steps=100, step_time_s=1.0),
            ),
            arrival_s=10.0 * i,
        )
        for i in range(6)
    ]
    learner = SpeedLearner()
    result = simulate(Trace(jobs), platform, POLICIES["loom"](0), learner=learner)
    done = [r for r in result.records if r.end_s is not None]
    assert len(done) == 6
    runs = learner.runs()
    assert sum(runs.values()) == 6
    assert {family for family, _ in runs} == {"gru-speech"}
    assert {gpu for _, gpu in runs} <= set(models.values())
    assert all(learner.estimate(f, g).source == "own" for f, g in runs)


def test_run_speed_is_the_one_rule_of_which_completed_runs_teach() -> None:
    from loom.model.learn import run_speed
    from loom_proto.jobs import JobSpec, Work

    job = JobSpec(job_id="j", tenant="t", work=Work(steps=10, step_time_s=2.0), labels={"model": "BERT"})
    seen: list[tuple[str, str, str]] = []

    def prior(model: str, task_type: str, precision: str) -> float:
        seen.append((model, task_type, precision))
        return 4.0

    one = run_speed(job, ["A100"], 0.5, pipeline=False, prior_speed=prior)
    assert one is not None and (one.family, one.gpu_model) == ("bert", "A100")
    assert one.prior_speed == 4.0 and one.observed_speed == pytest.approx(4.0)
    assert seen == [("A100", "training_compute", "fp32")]
    half = msgspec.structs.replace(job, labels={"model": "BERT", "precision": "bf16"})
    assert run_speed(half, ["A100"], 0.5, pipeline=False, prior_speed=prior) is not None
    assert seen[-1] == ("A100", "training_compute", "fp16")  # learned against the speed it multiplies
    # Nothing to learn: spread over two parts, a pipeline, no measured step, no GPU model.
    assert run_speed(job, ["A100", "T4"], 0.5, pipeline=False, prior_speed=prior) is None
    assert run_speed(job, ["A100"], 0.5, pipeline=True, prior_speed=prior) is None
    assert run_speed(job, ["A100"], None, pipeline=False, prior_speed=prior) is None
    assert run_speed(job, [""], 0.5, pipeline=False, prior_speed=prior) is None


def test_a_run_teaches_while_running_only_within_twice_its_predicted_step() -> None:
    """The slow-node rule's line: at most 2x the predicted step teaches at the first progress report;
    beyond it (a slow node looks the same mid-run) the completion teaches. No prediction: it teaches."""
    from loom.model.learn import LESSON_MAX_SLOWDOWN, teaches_while_running

    assert LESSON_MAX_SLOWDOWN == 2.0
    assert teaches_while_running(1.0, 1.0)
    assert teaches_while_running(2.0, 1.0)
    assert not teaches_while_running(2.01, 1.0)
    assert teaches_while_running(0.3, 1.0)  # faster than predicted: learned at once
    assert teaches_while_running(50.0, None)
    assert teaches_while_running(50.0, 0.0)


def test_slow_runs_lessons_are_held_until_another_node_of_the_model_agrees() -> None:
    # One slow node is a node (the migration review moves its jobs off); live runs on two nodes of
    # the model that are as slow are the model, taught at once instead of at each completion.
    from loom.model.learn import SLOW_NODES_AGREE, HeldLessons

    assert SLOW_NODES_AGREE == 2
    live = {"r1", "r2", "r3", "r4", "x"}
    held: HeldLessons[str, str] = HeldLessons()

    def hold(cell: tuple[str, str], node: str, run: str) -> list[str]:
        return sorted(k for k, _ in held.hold(cell, node, run, f"lesson-{run}", live=live.__contains__))

    cell = ("resnet-50", "A100")
    assert hold(cell, "a0", "r1") == []
    assert hold(cell, "a0", "r2") == []  # the same node again: still a node
    assert hold(cell, "a0", "r2") == []  # a run holds one lesson, however often it reports
    assert hold(("bert", "A100"), "a1", "x") == []  # another cell agrees on nothing
    assert held.held(cell) == 2
    assert hold(cell, "a1", "r3") == ["r1", "r2", "r3"]
    assert hold(cell, "a1", "r3") == ["r1", "r2", "r3"]  # again (a retried batch): the same
    # Runs that ended no longer count: a node's slow run of weeks ago agrees with nothing.
    live -= {"r1", "r2", "r3"}
    assert hold(cell, "a1", "r4") == [] and held.held(cell) == 1


def test_a_state_saved_before_the_main_effects_priors_loads_with_their_defaults() -> None:
    learner = SpeedLearner()
    learner.observe("gru", "A100", prior_speed=1.0, observed_speed=0.5)
    data = msgspec.json.decode(learner.to_bytes())
    for key in ("gpu_effect_sd", "family_effect_sd"):
        del data["settings"][key]  # what a learner of before 2026-12-07 stored
    loaded = SpeedLearner.from_bytes(msgspec.json.encode(data))
    assert loaded.settings.gpu_effect_sd == 0.25
    assert loaded.settings.family_effect_sd == 0.25
    assert loaded.estimate("gru", "A100") == learner.estimate("gru", "A100")

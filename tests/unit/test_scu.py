"""The SCU model: geometric-mean math, monotonicity, bounded learning, onboarding trust, the library."""

import itertools
from typing import get_args

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.errors import InvalidInputError
from loom.model.profiles import (
    DEFAULT_REFERENCE_MODEL,
    LIBRARY,
    UnknownGpuModelError,
    library_models,
    profile_for_model,
    reference_profile,
    relative_speed,
    scu_per_gpu,
)
from loom.model.scu import (
    DECAY_MAX,
    DECAY_MIN,
    DIMENSIONS,
    INITIAL_TRUST,
    PRIOR_WEIGHTS,
    TASK_TYPES,
    TASK_WEIGHTS,
    DecayLearner,
    DeviceProfile,
    RatioObservation,
    ScuError,
    TaskWeights,
    TrustTracker,
    fit_weights,
    scu,
    speed_ratio,
)
from loom.model.topology import load_topology, packaged_topology_names
from loom_proto.jobs import TaskType

REFERENCE = profile_for_model(DEFAULT_REFERENCE_MODEL)
WEIGHT_FIELDS = TaskWeights.__struct_fields__


def scaled(profile: DeviceProfile, dimension: str, factor: float) -> DeviceProfile:
    return msgspec.structs.replace(profile, **{dimension: getattr(profile, dimension) * factor})


# ---- the SCU formula -------------------------------------------------------------------------------


def test_task_types_are_exactly_the_protos() -> None:
    assert get_args(TaskType) == TASK_TYPES
    assert set(TASK_WEIGHTS) == set(PRIOR_WEIGHTS) == set(TASK_TYPES)


@pytest.mark.parametrize("model", library_models())
@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_the_reference_is_one_scu_for_every_task_type(model: str, task_type: TaskType) -> None:
    profile = profile_for_model(model)
    assert scu(profile, task_type, reference=profile) == pytest.approx(1.0, abs=1e-12)


def test_scu_is_the_weighted_geometric_mean_of_the_ratios_times_decay() -> None:
    device = DeviceProfile(
        model="X",
        compute_fp32_tflops=2 * REFERENCE.compute_fp32_tflops,
        compute_fp16_tflops=8 * REFERENCE.compute_fp16_tflops,
        memory_bandwidth_gbps=0.5 * REFERENCE.memory_bandwidth_gbps,
        memory_gib=REFERENCE.memory_gib,
        interconnect_gbps=REFERENCE.interconnect_gbps,
        network_gbps=REFERENCE.network_gbps,
    )
    # Weights need not sum to 1: 2:1:1 is 0.5, 0.25, 0.25.
    weights: dict[TaskType, TaskWeights] = {
        "inference": TaskWeights(compute_fp32=2, compute_fp16=1, memory_bandwidth=1)
    }
    expected = 2**0.5 * 8**0.25 * 0.5**0.25
    got = scu(device, "inference", reference=REFERENCE, weights=weights)
    assert got == pytest.approx(expected, rel=1e-12)
    decayed = scu(device, "inference", reference=REFERENCE, weights=weights, decay=0.8)
    assert decayed == pytest.approx(0.8 * expected, rel=1e-12)


@pytest.mark.parametrize("task_type", TASK_TYPES)
@pytest.mark.parametrize("dimension", DIMENSIONS)
def test_scu_rises_with_every_positively_weighted_dimension_and_ignores_the_others(
    task_type: TaskType, dimension: str
) -> None:
    weight = dict(zip(DIMENSIONS, TASK_WEIGHTS[task_type].vector(), strict=True))[dimension]
    device = profile_for_model("T4")
    before = scu(device, task_type, reference=REFERENCE)
    after = scu(scaled(device, dimension, 1.5), task_type, reference=REFERENCE)
    if weight > 0:
        assert after > before
    else:
        assert after == pytest.approx(before, rel=1e-12)


positive = st.floats(min_value=0.05, max_value=20.0)


@settings(max_examples=60, deadline=None)
@given(factors=st.lists(positive, min_size=len(DIMENSIONS), max_size=len(DIMENSIONS)), bump=positive)
def test_scu_is_monotone_in_each_dimension_for_any_device(factors: list[float], bump: float) -> None:
    device = REFERENCE
    for dimension, factor in zip(DIMENSIONS, factors, strict=True):
        device = scaled(device, dimension, factor)
    for task_type in TASK_TYPES:
        base = scu(device, task_type, reference=REFERENCE)
        for dimension in DIMENSIONS:
            moved = scu(scaled(device, dimension, bump), task_type, reference=REFERENCE)
            if bump >= 1:
                assert moved >= base * (1 - 1e-12)
            else:
                assert moved <= base * (1 + 1e-12)


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_speed_ratios_do_not_depend_on_the_reference(task_type: TaskType) -> None:
    a, b = profile_for_model("A100"), profile_for_model("T4")
    for reference in ("K80", "V100M16", "H200"):
        ref = profile_for_model(reference)
        ratio = scu(a, task_type, reference=ref) / scu(b, task_type, reference=ref)
        assert ratio == pytest.approx(speed_ratio(a, b, task_type), rel=1e-9)


def test_a_decay_outside_its_bounds_is_refused() -> None:
    with pytest.raises(ScuError):
        scu(REFERENCE, "inference", reference=REFERENCE, decay=DECAY_MAX + 0.01)
    with pytest.raises(ScuError):
        scu(REFERENCE, "inference", reference=REFERENCE, decay=DECAY_MIN - 0.01)


def test_profiles_and_weights_refuse_impossible_numbers() -> None:
    with pytest.raises(ScuError):
        msgspec.structs.replace(REFERENCE, memory_gib=0.0)
    with pytest.raises(ScuError):
        msgspec.structs.replace(REFERENCE, network_gbps=float("nan"))
    with pytest.raises(ScuError):
        TaskWeights()
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            msgspec.json.encode({**msgspec.structs.asdict(REFERENCE), "compute_fp32_tflops": -1}),
            type=DeviceProfile,
        )
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            msgspec.json.encode({**msgspec.structs.asdict(REFERENCE), "surprise": 1}), type=DeviceProfile
        )


def test_packaged_weights_are_normalised() -> None:
    for weights in (*TASK_WEIGHTS.values(), *PRIOR_WEIGHTS.values()):
        assert sum(weights.vector()) == pytest.approx(1.0)


# ---- fitting ------------------------------------------------------------------------------------------


def test_fit_recovers_the_weights_that_generated_the_ratios() -> None:
    truth: dict[TaskType, TaskWeights] = {
        "training_compute": TaskWeights(compute_fp32=0.5, compute_fp16=0.25, memory_bandwidth=0.25)
    }
    models = ("K80", "P100", "V100M16", "T4", "A10", "A100")
    observations = [
        RatioObservation(
            profile_for_model(a),
            profile_for_model(b),
            speed_ratio(profile_for_model(a), profile_for_model(b), "training_compute", weights=truth),
        )
        for a in models
        for b in models
        if a != b
    ]
    uniform = TaskWeights(**dict.fromkeys(WEIGHT_FIELDS, 1.0))
    fitted = fit_weights(observations, uniform, prior_strength=0.0)
    assert fitted.vector() == pytest.approx(truth["training_compute"].vector(), abs=1e-9)


def test_fit_without_observations_is_the_prior_and_never_weighs_what_the_prior_leaves_out() -> None:
    prior = PRIOR_WEIGHTS["training_compute"]
    assert fit_weights([], prior).vector() == pytest.approx(prior.normalised().vector())
    # Ratios only the network could explain: the fit may still not use it.
    a = msgspec.structs.replace(REFERENCE, network_gbps=REFERENCE.network_gbps * 4)
    fitted = fit_weights([RatioObservation(a, REFERENCE, 4.0)], prior)
    assert fitted.network == 0 and fitted.interconnect == 0 and fitted.memory_size == 0


def test_fit_refuses_a_grid_step_that_does_not_divide_one() -> None:
    with pytest.raises(ScuError):
        fit_weights([], PRIOR_WEIGHTS["inference"], grid_step=0.3)


def test_packaged_weights_are_the_fit_on_the_gavel_measurements() -> None:
    from loom_benchmarks.scu import fitted_weights, load_jobs

    fitted = fitted_weights(load_jobs())
    for task_type in TASK_TYPES:
        assert TASK_WEIGHTS[task_type].normalised().vector() == pytest.approx(
            fitted[task_type].vector(), abs=1e-6
        ), f"{task_type}: refit and update TASK_WEIGHTS (loom bench scu shows the fit)"


# ---- decay ---------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(ratios=st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=40))
def test_decay_stays_within_its_bounds_whatever_it_observes(ratios: list[float]) -> None:
    learner = DecayLearner()
    for ratio in ratios:
        learner = learner.observe(observed_rate=ratio, predicted_rate=1.0)
        assert DECAY_MIN <= learner.factor <= DECAY_MAX
    assert learner.observations == len(ratios)


@pytest.mark.parametrize(("ratio", "limit"), [(0.8, 0.8), (1.1, 1.1), (0.2, DECAY_MIN), (3.0, DECAY_MAX)])
def test_decay_converges_to_the_observed_ratio_or_its_bound(ratio: float, limit: float) -> None:
    learner = DecayLearner()
    for _ in range(60):
        learner = learner.observe(observed_rate=ratio * 50.0, predicted_rate=50.0)
    assert learner.factor == pytest.approx(limit, rel=1e-3)


def test_decay_learner_is_immutable_and_refuses_nonsense() -> None:
    learner = DecayLearner()
    learner.observe(2.0, 1.0)
    assert learner.factor == 1.0 and learner.observations == 0
    with pytest.raises(ScuError):
        learner.observe(0.0, 1.0)
    with pytest.raises(ScuError):
        learner.observe(1.0, float("inf"))
    with pytest.raises(ScuError):
        DecayLearner(factor=2.0)


# ---- onboarding trust ----------------------------------------------------------------------------------


def test_a_new_cluster_starts_with_low_trust_that_rises_toward_one_as_claims_confirm() -> None:
    tracker = TrustTracker()
    assert tracker.trust == INITIAL_TRUST < 0.5
    history = [tracker.trust]
    for _ in range(30):
        tracker = tracker.observe(delivered_rate=0.95, claimed_rate=1.0)
        history.append(tracker.trust)
    assert all(b > a for a, b in itertools.pairwise(history))
    assert 0.99 < tracker.trust <= 1.0
    assert tracker.confirmations == 30 and tracker.mismatches == 0


def test_over_delivery_confirms_and_under_delivery_drops_trust() -> None:
    trusted = TrustTracker(trust=0.9)
    assert trusted.observe(delivered_rate=2.0, claimed_rate=1.0).trust > 0.9
    dropped = trusted.observe(delivered_rate=0.5, claimed_rate=1.0)
    assert dropped.trust < 0.9 and dropped.mismatches == 1


def test_trusted_scu_discounts_the_claim_by_trust() -> None:
    assert TrustTracker(trust=0.5).trusted_scu(4.0) == pytest.approx(2.0)


@settings(max_examples=100, deadline=None)
@given(delivered=st.lists(st.floats(min_value=0.0, max_value=10.0), max_size=50))
def test_trust_stays_within_floor_and_one(delivered: list[float]) -> None:
    tracker = TrustTracker()
    for rate in delivered:
        tracker = tracker.observe(delivered_rate=rate, claimed_rate=1.0)
        assert tracker.floor <= tracker.trust <= 1.0


# ---- the reference library -----------------------------------------------------------------------------


def test_the_library_covers_the_accelerators_the_issue_names() -> None:
    required = {"K80", "P100", "V100M16", "T4", "A10", "A100", "H100", "H200", "L40S", "RTX4090", "MI300X"}
    assert required <= set(library_models())
    assert reference_profile("v100").profile.model == "V100M16"


@pytest.mark.parametrize("model", library_models())
def test_every_number_in_the_library_has_a_source(model: str) -> None:
    entry = LIBRARY[model]
    assert set(entry.sources) == set(DIMENSIONS)
    for dimension, source in entry.sources.items():
        assert len(source.strip()) > 20, f"{model}.{dimension} has no real citation"
    assert entry.profile.model == model
    assert entry.product


def test_only_the_undisclosed_trace_models_are_assumed_and_they_say_so() -> None:
    assumed = {name for name, entry in LIBRARY.items() if entry.assumed}
    assert assumed == {"G2", "G3"}
    for name in assumed:
        assert all("ASSUMED" in LIBRARY[name].sources[d] for d in DIMENSIONS if d != "network_gbps")


@pytest.mark.parametrize("topology", packaged_topology_names())
def test_every_gpu_model_in_the_packaged_topologies_has_a_profile(topology: str) -> None:
    models = {n.gpu_model for c in load_topology(topology).clusters for n in c.nodes if n.gpu_model}
    assert models
    for model in models:
        assert profile_for_model(model).model == model


def test_an_unknown_model_or_task_type_is_an_input_error() -> None:
    with pytest.raises(UnknownGpuModelError) as info:
        profile_for_model("B200")
    assert isinstance(info.value, InvalidInputError) and info.value.non_retryable
    with pytest.raises(ScuError):
        relative_speed("T4", "mining")


def test_relative_speed_orders_generations_sensibly() -> None:
    for task_type in TASK_TYPES:
        assert relative_speed(DEFAULT_REFERENCE_MODEL, task_type) == pytest.approx(1.0)
        assert relative_speed("K80", task_type) < relative_speed("P100", task_type) < 1.0
        assert relative_speed("H100", task_type) > relative_speed("A100", task_type) > 1.0


def test_scu_per_gpu_summarises_all_task_types_and_is_one_for_the_reference() -> None:
    assert scu_per_gpu(DEFAULT_REFERENCE_MODEL) == pytest.approx(1.0)
    order = ["K80", "T4", "P100", "V100M16", "A100", "H100", "H200"]
    values = [scu_per_gpu(m) for m in order]
    assert values == sorted(values)
    speeds = [relative_speed("A100", t) for t in TASK_TYPES]
    assert min(speeds) <= scu_per_gpu("A100") <= max(speeds)

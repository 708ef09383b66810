"""The SCU model: geometric-mean math, monotonicity, bounded learning, onboarding trust, the library."""

import itertools
import math
from typing import get_args

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.errors import InvalidInputError
from loom.model.profiles import (
    DEFAULT_REFERENCE_MODEL,
    LIBRARY,
    ReferenceProfile,
    UnknownGpuModelError,
    device_profile,
    library_models,
    profile_for_model,
    reference_profile,
    relative_speed,
    scu_per_gpu,
    speeds_for_model,
    wire_profile,
)
from loom.model.scu import (
    DECAY_MAX,
    DECAY_MIN,
    DIMENSIONS,
    INITIAL_TRUST,
    PRECISION_PRIORS,
    PRECISION_WEIGHTS,
    PRECISIONS,
    PRIOR_WEIGHTS,
    TASK_TYPES,
    TASK_WEIGHTS,
    TRUST_FLOOR,
    UNPROFILED_SPEED,
    DecayLearner,
    DeviceProfile,
    Precision,
    RatioObservation,
    ScuError,
    TaskWeights,
    TrustTracker,
    fit_weights,
    precision_of_family,
    scu,
    speed_ratio,
)
from loom.model.topology import load_topology, packaged_topology_names
from loom_benchmarks.scu import Cell
from loom_proto.clusters import AcceleratorProfile
from loom_proto.jobs import GpuModel, TaskType


class GpuModelHolder(msgspec.Struct):
    gpu_model: GpuModel


REFERENCE = profile_for_model(DEFAULT_REFERENCE_MODEL)
WEIGHT_FIELDS = TaskWeights.__struct_fields__


def scaled(profile: DeviceProfile, dimension: str, factor: float) -> DeviceProfile:
    if dimension == "compute_tf32_tflops":  # absent means "the FP32 rate": scale what counts
        return msgspec.structs.replace(profile, compute_tf32_tflops=profile.fp32_matrix_tflops * factor)
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


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("task_type", TASK_TYPES)
@pytest.mark.parametrize("dimension", DIMENSIONS)
def test_scu_rises_with_every_positively_weighted_dimension_and_ignores_the_others(
    precision: Precision, task_type: TaskType, dimension: str
) -> None:
    weight = dict(zip(DIMENSIONS, PRECISION_WEIGHTS[precision][task_type].vector(), strict=True))[dimension]
    # An A10 has TF32 cores well above its FP32 rate, so scaling FP32 by 1.5 leaves TF32 alone.
    device = profile_for_model("A10")
    before = scu(device, task_type, reference=REFERENCE, precision=precision)
    after = scu(scaled(device, dimension, 1.5), task_type, reference=REFERENCE, precision=precision)
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
    for task_type, precision in itertools.product(TASK_TYPES, PRECISIONS):
        base = scu(device, task_type, reference=REFERENCE, precision=precision)
        for dimension in DIMENSIONS:
            moved = scu(scaled(device, dimension, bump), task_type, reference=REFERENCE, precision=precision)
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
    for table in (*PRECISION_WEIGHTS.values(), *PRECISION_PRIORS.values()):
        for weights in table.values():
            assert sum(weights.vector()) == pytest.approx(1.0)
    assert TASK_WEIGHTS is PRECISION_WEIGHTS["fp32"] and PRIOR_WEIGHTS is PRECISION_PRIORS["fp32"]


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


def test_packaged_weights_are_the_fit_on_the_gavel_and_lambda_measurements() -> None:
    from loom_benchmarks.scu import fitted_weights, load_cells

    fitted = fitted_weights(load_cells())
    for precision in PRECISIONS:
        for task_type in TASK_TYPES:
            assert PRECISION_WEIGHTS[precision][task_type].normalised().vector() == pytest.approx(
                fitted[precision][task_type].vector(), abs=1e-6
            ), f"{precision} {task_type}: refit and update PRECISION_WEIGHTS (loom bench scu shows the fit)"


def test_leave_one_gpu_out_median_error_on_the_packaged_measurements_is_at_most_15_percent() -> None:
    from loom_benchmarks.scu import TARGET_MEDIAN_ERROR, load_cells, logo_median_error

    cells = load_cells()
    assert len({c.gpu for c in cells}) >= 15 and {c.precision for c in cells} == set(PRECISIONS)
    assert logo_median_error(cells) <= TARGET_MEDIAN_ERROR


def test_the_fit_beats_the_peak_fp32_ratio_held_out_in_both_precisions() -> None:
    from loom_benchmarks.scu import leave_one_gpu_out, load_cells, peak_fp32

    cells = load_cells()

    def median(rows: list[tuple[Cell, float]], precision: str) -> float:
        errors = [abs(p - c.measured_ratio) / c.measured_ratio for c, p in rows if c.precision == precision]
        return float(np.median(errors))

    held_out, baseline = leave_one_gpu_out(cells), peak_fp32(cells)
    for precision in PRECISIONS:
        assert median(held_out, precision) < 0.5 * median(baseline, precision)


def test_the_benchmark_data_holds_only_single_gpu_medians_of_known_models() -> None:
    from loom_benchmarks.scu import _gpus_in_row, _lambda_model, load_cells

    assert _gpus_in_row("LambdaOD_8x_Texas_1xH100_80GB_SXM5_192-222-52-149_v2", None) == 1
    assert _gpus_in_row("LambdaOD_8x_Texas_8xH100_80GB_SXM5_192-222-52-149_v2", None) == 8
    assert _gpus_in_row("2x RTX A6000", "2") == 2
    assert _lambda_model("LambdaCloud A100 40GB PCIe") == "A100-40G-PCIE"
    assert _lambda_model("LambdaCloud 1x A10") == "A10"
    assert _lambda_model("A100 80GB SXM4") == "A100"
    for cell in load_cells():
        assert cell.gpu in LIBRARY and cell.gpu != DEFAULT_REFERENCE_MODEL
        assert math.isfinite(cell.measured_ratio) and cell.measured_ratio > 0


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
    required = {
        *("K80", "P100", "V100M16", "V100M32", "T4", "A10", "A40", "L4", "L40S"),
        *("A100", "A100-40G", "A100-40G-PCIE", "A100-80G-PCIE", "H100", "H100-PCIE", "H200", "GH200", "B200"),
        *("RTX2080TI", "QRTX6000", "QRTX8000", "RTXA6000", "RTX3090", "RTX4090", "RTX6000ADA"),
        *("MI250X", "MI300X", "G2", "G3"),
    }
    assert required <= set(library_models())
    assert reference_profile("v100").profile.model == "V100M16"
    assert reference_profile("A100-SXM4-40GB").profile.model == "A100-40G"
    assert reference_profile("a100-pcie-40gb").profile.model == "A100-40G-PCIE"
    assert reference_profile("rtx-2080-ti").profile.model == "RTX2080TI"
    assert reference_profile("Quadro-RTX-6000").profile.model == "QRTX6000"
    assert reference_profile("H100-SXM").profile.model == "H100"


def test_library_names_and_aliases_are_valid_gpu_models_and_never_shadow_each_other() -> None:
    from loom.model.profiles import _ALIASES

    names = {m.casefold() for m in library_models()}
    for name in (*library_models(), *_ALIASES):
        msgspec.json.decode(msgspec.json.encode({"gpu_model": name}), type=GpuModelHolder)
    assert not names & {a.casefold() for a in _ALIASES}
    assert set(_ALIASES.values()) <= set(library_models())


@pytest.mark.parametrize("model", library_models())
def test_every_library_profile_round_trips_through_its_wire_forms(model: str) -> None:
    entry = LIBRARY[model]
    assert msgspec.json.decode(msgspec.json.encode(entry), type=ReferenceProfile) == entry
    p = entry.profile
    wire = wire_profile(p)
    assert wire.gpu_model == p.model and device_profile(wire) == p
    assert msgspec.json.decode(msgspec.json.encode(wire), type=AcceleratorProfile) == wire
    assert p.fp32_matrix_tflops >= p.compute_fp32_tflops
    # Tensor FP16 never below plain FP32, and the sanity order of generations holds.
    assert p.compute_fp16_tflops >= p.compute_fp32_tflops


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
        profile_for_model("Z9000")
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


# ---- precision and unprofiled models -----------------------------------------------------------------


def test_the_fp16_weights_price_a_tensor_core_generation_differently_from_fp32() -> None:
    # Measured (Lambda): an A100 trains BERT ~5x a V100 in FP32 (TF32 vs plain FP32) but ~2.3x in
    # FP16 (tensor cores on both); the fitted weights must carry that difference.
    fp32 = relative_speed("A100", "training_compute", precision="fp32")
    fp16 = relative_speed("A100", "training_compute", precision="fp16")
    assert fp32 > 1.5 * fp16 > 1.5
    # Without TF32 (Turing), FP32 gains nothing over FP16 from the matrix-rate dimension.
    assert relative_speed("QRTX8000", "training_compute", precision="fp32") < fp32 / 3
    with pytest.raises(ScuError):
        scu(REFERENCE, "inference", reference=REFERENCE, precision="fp8")  # type: ignore[arg-type]


def test_a_family_is_half_precision_exactly_when_it_ends_in_fp16() -> None:
    from loom.model.family import family_of

    assert (
        precision_of_family(family_of({"model": "bert", "precision": "bf16"}, "training_compute")) == "fp16"
    )
    assert precision_of_family(family_of({"model": "bert"}, "training_compute")) == "fp32"
    assert precision_of_family("resnet-50@fp16") == "fp16"


def test_an_unprofiled_model_counts_at_the_trust_floor_never_at_the_reference_speed() -> None:
    unknown = speeds_for_model("Z9000")
    assert not unknown.profiled and unknown.memory_gib == 0.0
    assert set(unknown.speed.values()) == set(unknown.half_speed.values()) == {UNPROFILED_SPEED}
    assert UNPROFILED_SPEED == TRUST_FLOOR == TrustTracker().floor < INITIAL_TRUST
    assert scu_per_gpu("Z9000") == pytest.approx(UNPROFILED_SPEED)
    known = speeds_for_model("A100")
    assert known.profiled and known.memory_gib == 80.0
    assert known.speed["training_compute"] == pytest.approx(relative_speed("A100", "training_compute"))
    assert known.half_speed["training_compute"] == pytest.approx(
        relative_speed("A100", "training_compute", precision="fp16")
    )
    # Slowest profiled GPU is still far above the unprofiled floor.
    assert min(speeds_for_model(m).speed["training_memory"] for m in library_models()) > UNPROFILED_SPEED


def test_snapshot_job_speeds_read_the_fp16_table_for_a_half_precision_job() -> None:
    from loom.model.capacity import NodeCapacity
    from loom.model.family import job_family
    from loom.sched.snapshot import Snapshot, job_precision
    from loom.sim.engine import platform_from_topology

    platform = platform_from_topology()
    models = sorted({n.gpu_model for n in platform.nodes if n.gpu_model})
    assert {(m, t) for m in models for t in TASK_TYPES} == set(platform.half_speed) == set(platform.speed)
    snap = platform.snapshot()

    class Job(msgspec.Struct):
        labels: dict[str, str]
        task_type: str

    half = Job({"model": "bert", "precision": "fp16"}, "training_compute")
    single = Job({"model": "bert"}, "training_compute")
    for job in (half, single):
        assert job_precision(job) == precision_of_family(job_family(job))
    for i, model in enumerate(snap.models):
        assert snap.job_speeds(half)[i] == pytest.approx(
            speeds_for_model(model).half_speed["training_compute"]
        )
        assert snap.job_speeds(single)[i] == pytest.approx(speeds_for_model(model).speed["training_compute"])
    # The builders fill a model without a profile at the trust floor, not at the reference's 1.0.
    node = NodeCapacity(node="n1", cluster="c1", region="r1", zone="z1", gpu_model="Z9000", gpus_total=8)
    tables = speeds_for_model("Z9000")
    lone = Snapshot(
        [node],
        speed={("Z9000", t): v for t, v in tables.speed.items()},
        half_speed={("Z9000", t): v for t, v in tables.half_speed.items()},
    )
    assert lone.job_gpu_speed(single, "Z9000") == lone.job_gpu_speed(half, "Z9000") == UNPROFILED_SPEED


def test_the_placement_book_counts_an_unprofiled_model_at_the_trust_floor() -> None:
    from loom_services.placement.book import Book

    book = Book()
    assert book.speed("Z9000", "training_compute") == UNPROFILED_SPEED
    assert book._memory["Z9000"] == 0.0
    assert book.speed("A100", "training_compute") == pytest.approx(relative_speed("A100", "training_compute"))
    assert book._half_speed[("A100", "training_compute")] == pytest.approx(
        relative_speed("A100", "training_compute", precision="fp16")
    )

"""SCU: one unit of delivered compute, and how a device's profile converts to it per task type.

One SCU is the delivered throughput of a configurable reference accelerator (ARCHITECTURE.md §6).
A device is described by a :class:`DeviceProfile` over seven dimensions (FP32, FP16 and FP32-matrix
compute, memory bandwidth, memory size, intra-node interconnect, network). Each (precision, task
type) has a :class:`TaskWeights` vector over those dimensions, and a device's SCU for a task type
is the weighted geometric mean of its ratios to the reference, times a decay factor for the gap
between benchmark and real work::

    scu(device, task, precision) = decay · exp( Σ wᵢ · ln(deviceᵢ / referenceᵢ) / Σ wᵢ )

Because the mean is geometric, the predicted speed ratio of two devices does not depend on the
reference (:func:`speed_ratio`).

**Precision.** The same model gains very differently from a newer GPU in single and in mixed
precision (Lambda's measurements: an A100 trains BERT 5x faster than a V100 in FP32, 2.3x in
FP16, because the V100's FP32 runs on plain FP32 units while the A100's runs on TF32 tensor
cores, and both use tensor cores in FP16). So weights are keyed by precision as well
(:data:`PRECISION_WEIGHTS`): ``fp32`` is FP32 training as the frameworks run it by default (TF32
tensor cores for matrix math where the part has them: the ``compute_tf32`` dimension), ``fp16``
is mixed precision (FP16/BF16 with FP32 master weights). A job's precision comes from its family
(:mod:`loom.model.family`: ``…@fp16``; :func:`precision_of_family`).

**The fit.** The packaged weights were fitted by :func:`fit_weights` (least mean absolute error in
log ratio over a simplex grid) on measured single-GPU training throughput: Gavel's 26 job types on
K80, P100 and V100 (FP32) and Lambda's 10 models on 14 GPU models from V100 to B200 (FP32 and
FP16), each as a ratio to the V100 16 GB; see ``loom bench scu`` and
``benchmarks/loom_benchmarks/data/README.md``. ``loom bench scu`` refits them, checks the packaged
values still equal the fit, and reports in-sample, leave-one-GPU-out and leave-one-model-out
errors. Measured models map to task types by what bounds their single-GPU step (the reasoning is
in the benchmark's docstring):

- ``training_compute``: dense GEMM-bound sequence models: BERT, Transformer, Transformer-XL,
  GNMT, Tacotron 2, WaveGlow;
- ``training_memory``: models whose step follows memory bandwidth: convolutional nets with
  normalisation (ResNet, SSD, CycleGAN), the small-batch LSTM LM, and embedding-bound
  recommendation (NCF, Gavel's Recommendation) and A3C;
- ``training_comm``: no single-GPU measurement can say how communication-bound work speeds up
  (it is bound by links, not the device), so its weights are the prior;
- ``inference``: no measured job; its weights are the prior.

The fit may only weigh the dimensions its prior weighs. Where a dimension's ratio is 1 between
the measured devices (network everywhere), its fitted weight only says how much the other ratios
are damped: ``training_comm``'s network weight is that, and no more, until measurements of
multi-node jobs exist.

:class:`DecayLearner` learns the decay factor, bounded, from observed versus predicted throughput;
:class:`TrustTracker` is the progressive-onboarding weight of a newly joined cluster; its floor is
also the speed a GPU model without any profile is counted at (:data:`UNPROFILED_SPEED`).
Everything here is pure: no clock, no I/O, immutable values in and out.
"""

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Final, Literal, get_args

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import Meta

from loom.errors import InvalidInputError
from loom_proto.jobs import GpuModel, TaskType

__all__ = [
    "DECAY_MAX",
    "DECAY_MIN",
    "DIMENSIONS",
    "INITIAL_TRUST",
    "PRECISIONS",
    "PRECISION_PRIORS",
    "PRECISION_WEIGHTS",
    "PRIOR_WEIGHTS",
    "TASK_TYPES",
    "TASK_WEIGHTS",
    "TRUST_FLOOR",
    "UNPROFILED_SPEED",
    "DecayLearner",
    "DeviceProfile",
    "Precision",
    "RatioObservation",
    "ScuError",
    "TaskWeights",
    "TrustTracker",
    "fit_weights",
    "precision_of_family",
    "scu",
    "scu_by_task_type",
    "speed_ratio",
]

TASK_TYPES: Final[tuple[TaskType, ...]] = get_args(TaskType)
"""Every task type, in the proto's order."""

Precision = Literal["fp32", "fp16"]
"""``fp32``: single precision as frameworks run it by default (TF32 tensor math where the part has
it); ``fp16``: mixed precision (FP16 or BF16 math, FP32 master weights)."""

PRECISIONS: Final[tuple[Precision, ...]] = get_args(Precision)
"""Every precision weights are kept for."""

HALF_PRECISION_SUFFIX: Final = "@fp16"
"""How a job family names mixed precision (see :func:`loom.model.family.family_of`)."""

DIMENSIONS: Final = (
    "compute_fp32_tflops",
    "compute_fp16_tflops",
    "memory_bandwidth_gbps",
    "memory_gib",
    "interconnect_gbps",
    "network_gbps",
    "compute_tf32_tflops",
)
"""The profile dimensions, in the order of :meth:`DeviceProfile.vector` and :meth:`TaskWeights.vector`."""

DECAY_MIN: Final = 0.5
"""Lowest decay factor: real work never counts for less than half the benchmark's prediction."""
DECAY_MAX: Final = 1.2
"""Highest decay factor: real work may beat the benchmark's prediction by at most 20%."""

INITIAL_TRUST: Final = 0.3
"""Trust weight of a newly joined cluster, before any delivered throughput confirms its claim."""

TRUST_FLOOR: Final = 0.05
"""Lowest trust a cluster can fall to (:class:`TrustTracker`'s ``floor``)."""

UNPROFILED_SPEED: Final = TRUST_FLOOR
"""Speed (in SCU) of one GPU of a model with neither a library nor a calibrated profile: the trust
floor, never the reference's 1.0, so that placement prefers any profiled GPU until ``loom
calibrate`` publishes a profile or learned runs say what the model delivers."""

# Upper bounds are sanity limits far above any accelerator, so a typo (bytes for GiB) fails decoding.
Tflops = Annotated[float, Meta(gt=0, le=1e6, description="peak or measured TFLOP/s")]
Gbps = Annotated[float, Meta(gt=0, le=1e7, description="gigabits per second")]
Gib = Annotated[float, Meta(gt=0, le=1e6, description="gibibytes")]
Weight = Annotated[float, Meta(ge=0, le=1e3)]


class ScuError(InvalidInputError):
    """A profile, weight vector or observation that the SCU model cannot use."""


class DeviceProfile(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What one accelerator delivers, per dimension; measured by ``loom calibrate`` or from the library.

    Every bandwidth is in gigabits per second, the unit the topology's links use, so a transfer
    time is ``bytes * 8 / (gbps * 1e9)`` whatever the path. Datasheets quote memory and NVLink
    bandwidth in gigabytes per second: multiply by 8. Bandwidths are aggregate (both directions),
    as NVIDIA quotes NVLink.
    """

    model: GpuModel
    """GPU model as the topology and the agents name it (``V100M32``, ``T4``, ``A100``)."""
    compute_fp32_tflops: Tflops
    """Dense FP32 throughput (no tensor cores)."""
    compute_fp16_tflops: Tflops
    """Dense FP16 throughput with FP32 accumulate, on tensor cores where the part has them."""
    memory_bandwidth_gbps: Gbps
    """Device memory bandwidth."""
    memory_gib: Gib
    """Device memory size."""
    interconnect_gbps: Gbps
    """Intra-node device-to-device bandwidth (NVLink, Infinity Fabric, or PCIe when there is none)."""
    network_gbps: Gbps
    """The node's network bandwidth to other nodes."""
    compute_tf32_tflops: Tflops | None = None
    """Dense FP32-input matrix throughput: TF32 tensor cores (NVIDIA Ampere and later), FP32
    matrix cores (AMD CDNA). None for a part without either: its FP32 matrix math runs at
    :attr:`compute_fp32_tflops` (what :attr:`fp32_matrix_tflops` then returns)."""

    def __post_init__(self) -> None:
        for name, value in zip(DIMENSIONS, self.vector(), strict=True):
            if not (math.isfinite(value) and value > 0):
                raise ScuError(f"{self.model}: {name} must be a positive finite number, got {value!r}")

    @property
    def fp32_matrix_tflops(self) -> float:
        """What FP32 training's matrix math runs at: the TF32/matrix-core rate, never below plain FP32."""
        return max(self.compute_fp32_tflops, self.compute_tf32_tflops or 0.0)

    def vector(self) -> tuple[float, ...]:
        """The seven dimensions in :data:`DIMENSIONS` order (TF32 as :attr:`fp32_matrix_tflops`)."""
        return (
            self.compute_fp32_tflops,
            self.compute_fp16_tflops,
            self.memory_bandwidth_gbps,
            self.memory_gib,
            self.interconnect_gbps,
            self.network_gbps,
            self.fp32_matrix_tflops,
        )


class TaskWeights(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How much each profile dimension counts for one task type; only the proportions matter."""

    compute_fp32: Weight = 0.0
    compute_fp16: Weight = 0.0
    memory_bandwidth: Weight = 0.0
    memory_size: Weight = 0.0
    interconnect: Weight = 0.0
    network: Weight = 0.0
    compute_tf32: Weight = 0.0

    def __post_init__(self) -> None:
        values = self.vector()
        if not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
            raise ScuError(f"weights must be finite, non-negative and not all zero: {values}")

    def vector(self) -> tuple[float, ...]:
        """The seven weights in :data:`DIMENSIONS` order."""
        return (
            self.compute_fp32,
            self.compute_fp16,
            self.memory_bandwidth,
            self.memory_size,
            self.interconnect,
            self.network,
            self.compute_tf32,
        )

    def normalised(self) -> "TaskWeights":
        """The same proportions, summing to 1."""
        return TaskWeights.from_vector(self.vector())

    @staticmethod
    def from_vector(values: Sequence[float]) -> "TaskWeights":
        """Weights from seven numbers in :data:`DIMENSIONS` order, normalised to sum to 1."""
        if len(values) != len(DIMENSIONS):
            raise ScuError(f"need {len(DIMENSIONS)} weights, got {len(values)}")
        total = float(sum(values))
        if not math.isfinite(total) or total <= 0:
            raise ScuError(f"weights must not all be zero: {tuple(values)}")
        # Rounded so that fitted weights print and compare cleanly (the fit's grid is coarser).
        f32, f16, bw, size, ic, net, tf32 = (round(float(v) / total, 6) for v in values)
        return TaskWeights(
            compute_fp32=f32,
            compute_fp16=f16,
            memory_bandwidth=bw,
            memory_size=size,
            interconnect=ic,
            network=net,
            compute_tf32=tf32,
        )


_INFERENCE_PRIOR: Final = TaskWeights(compute_fp16=0.4, memory_bandwidth=0.4, memory_size=0.2)

PRECISION_PRIORS: Final[Mapping[Precision, Mapping[TaskType, TaskWeights]]] = {
    "fp32": {
        # Dense GEMMs at the FP32-matrix rate (TF32 tensor cores where present); the tensor
        # generation (FP16 rate) and bandwidth for the layers around them.
        "training_compute": TaskWeights(compute_tf32=0.5, compute_fp16=0.1, memory_bandwidth=0.4),
        # Step time follows how fast weights and activations stream through memory.
        "training_memory": TaskWeights(compute_tf32=0.2, compute_fp16=0.1, memory_bandwidth=0.7),
        # Gradient, embedding or parameter exchange inside the node and across nodes.
        "training_comm": TaskWeights(
            compute_tf32=0.1, compute_fp16=0.1, memory_bandwidth=0.2, interconnect=0.3, network=0.3
        ),
        # Serving: low-precision math, weight and KV-cache streaming, room for the model and cache.
        "inference": _INFERENCE_PRIOR,
    },
    "fp16": {
        # Tensor-core GEMMs; what autocast keeps in FP32 runs at the FP32 or TF32 rate.
        "training_compute": TaskWeights(
            compute_fp32=0.1, compute_tf32=0.1, compute_fp16=0.4, memory_bandwidth=0.4
        ),
        "training_memory": TaskWeights(
            compute_fp32=0.1, compute_tf32=0.1, compute_fp16=0.1, memory_bandwidth=0.7
        ),
        "training_comm": TaskWeights(compute_fp16=0.2, memory_bandwidth=0.2, interconnect=0.3, network=0.3),
        "inference": _INFERENCE_PRIOR,
    },
}
"""Hand-set weights per precision from what bounds each task type. The fit may weigh only the
dimensions these weigh, is pulled toward them (``prior_strength``), and returns them where there
is no data."""

PRIOR_WEIGHTS: Final[Mapping[TaskType, TaskWeights]] = PRECISION_PRIORS["fp32"]
"""The FP32 priors (the precision a job has unless its family says ``@fp16``)."""

PRECISION_WEIGHTS: Final[Mapping[Precision, Mapping[TaskType, TaskWeights]]] = {
    "fp32": {
        "training_compute": TaskWeights(compute_tf32=0.5, memory_bandwidth=0.5),
        "training_memory": TaskWeights(compute_tf32=0.15, compute_fp16=0.15, memory_bandwidth=0.7),
        "training_comm": PRECISION_PRIORS["fp32"]["training_comm"],
        "inference": _INFERENCE_PRIOR,
    },
    "fp16": {
        "training_compute": TaskWeights(
            compute_fp32=0.2, compute_tf32=0.15, compute_fp16=0.15, memory_bandwidth=0.5
        ),
        "training_memory": TaskWeights(compute_fp32=0.2, memory_bandwidth=0.8),
        "training_comm": PRECISION_PRIORS["fp16"]["training_comm"],
        "inference": _INFERENCE_PRIOR,
    },
}
"""The weights in use: :func:`fit_weights` on the Gavel and Lambda measurements, per precision and
task type (``loom bench scu`` checks them). No measured job is communication-bound or serving:
``training_comm`` and ``inference`` keep their priors. Held out by GPU model, these predict a
job's speed ratio to the V100 within 14.8 % (median over 314 cells; the peak-FP32 ratio: 48 %)."""

TASK_WEIGHTS: Final[Mapping[TaskType, TaskWeights]] = PRECISION_WEIGHTS["fp32"]
"""The FP32 weights in use (``PRECISION_WEIGHTS["fp32"]``)."""


def precision_of_family(family: str) -> Precision:
    """A job family's precision: ``fp16`` when it ends in ``@fp16`` (see :mod:`loom.model.family`)."""
    return "fp16" if family.endswith(HALF_PRECISION_SUFFIX) else "fp32"


def _log_ratios(device: DeviceProfile, reference: DeviceProfile) -> npt.NDArray[np.float64]:
    return np.log(np.asarray(device.vector(), dtype=np.float64)) - np.log(
        np.asarray(reference.vector(), dtype=np.float64)
    )


def _weight_array(weights: TaskWeights) -> npt.NDArray[np.float64]:
    w = np.asarray(weights.vector(), dtype=np.float64)
    normalised: npt.NDArray[np.float64] = w / w.sum()
    return normalised


def scu(
    device: DeviceProfile,
    task_type: TaskType,
    *,
    reference: DeviceProfile,
    decay: float = 1.0,
    weights: Mapping[TaskType, TaskWeights] | None = None,
    precision: Precision = "fp32",
) -> float:
    """The device's SCU for ``task_type``: weighted geometric mean of its ratios to ``reference``, × decay.

    ``weights`` default to the packaged ones of ``precision`` (:data:`PRECISION_WEIGHTS`).
    ``decay`` must lie in [:data:`DECAY_MIN`, :data:`DECAY_MAX`]; take it from a :class:`DecayLearner`.
    """
    if not (DECAY_MIN <= decay <= DECAY_MAX):
        raise ScuError(f"decay {decay!r} is outside [{DECAY_MIN}, {DECAY_MAX}]")
    if weights is None:
        if precision not in PRECISION_WEIGHTS:
            raise ScuError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
        weights = PRECISION_WEIGHTS[precision]
    if task_type not in weights:
        raise ScuError(f"no weights for task type {task_type!r}")
    log_mean = float(_weight_array(weights[task_type]) @ _log_ratios(device, reference))
    return decay * math.exp(log_mean)


def speed_ratio(
    faster: DeviceProfile,
    slower: DeviceProfile,
    task_type: TaskType,
    *,
    weights: Mapping[TaskType, TaskWeights] | None = None,
    precision: Precision = "fp32",
) -> float:
    """Predicted throughput of ``faster`` over ``slower`` for a task type (any reference gives the same)."""
    return scu(faster, task_type, reference=slower, weights=weights, precision=precision)


# ---- fitting --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioObservation:
    """A measured throughput ratio of two devices on one job: ``numerator`` over ``denominator``."""

    numerator: DeviceProfile
    denominator: DeviceProfile
    measured_ratio: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.measured_ratio) and self.measured_ratio > 0):
            raise ScuError(f"a measured ratio must be positive and finite, got {self.measured_ratio!r}")


@functools.lru_cache(maxsize=16)
def _simplex_grid(steps: int, parts: int) -> npt.NDArray[np.float64]:
    """Every vector of ``parts`` multiples of ``1/steps`` that sum to 1."""

    def compositions(total: int, count: int) -> list[list[int]]:
        if count == 1:
            return [[total]]
        return [
            [first, *rest] for first in range(total + 1) for rest in compositions(total - first, count - 1)
        ]

    grid = np.asarray(compositions(steps, parts), dtype=np.float64) / steps
    grid.setflags(write=False)
    return grid


def fit_weights(
    observations: Iterable[RatioObservation],
    prior: TaskWeights,
    *,
    grid_step: float = 0.05,
    prior_strength: float = 0.02,
) -> TaskWeights:
    """The weights that best predict the observed ratios, pulled toward ``prior``.

    Searches every weight vector on a simplex grid of ``grid_step`` over the prior's dimensions
    for the least mean absolute error in log ratio (the loss whose minimiser tracks the median
    error, which is what ``loom bench scu`` reports), plus ``prior_strength`` times the L1
    distance to the (normalised) prior.
    Only the dimensions the prior weights can get weight: the data choose proportions among what
    the prior says matters, and never lean on a dimension merely because its ratio happens to be
    constant in the data. The log error treats over- and under-prediction by the same factor
    alike; the prior decides between vectors the data cannot tell apart and is the answer when
    there are no observations. Ties go to the first vector in grid order (deterministic).
    """
    steps = round(1 / grid_step)
    if steps < 1 or not math.isclose(steps * grid_step, 1.0, rel_tol=1e-9):
        raise ScuError(f"grid_step must divide 1, got {grid_step!r}")
    if prior_strength < 0:
        raise ScuError(f"prior_strength must be non-negative, got {prior_strength!r}")
    rows = [(_log_ratios(o.numerator, o.denominator), math.log(o.measured_ratio)) for o in observations]
    if not rows:
        return prior.normalised()
    prior_w = _weight_array(prior)
    support = np.flatnonzero(prior_w > 0)
    sub = _simplex_grid(steps, len(support))
    grid = np.zeros((len(sub), len(DIMENSIONS)))
    grid[:, support] = sub
    features = np.stack([r[0] for r in rows])
    targets = np.asarray([r[1] for r in rows])
    loss = prior_strength * np.abs(grid - prior_w).sum(axis=1) + np.abs(grid @ features.T - targets).mean(
        axis=1
    )
    return TaskWeights.from_vector(grid[int(np.argmin(loss))].tolist())


# ---- learning from what jobs deliver ------------------------------------------------------------------


@dataclass(frozen=True)
class DecayLearner:
    """The decay factor of one (GPU model, task type), learned from delivered versus predicted throughput.

    Each observation moves the factor's logarithm toward ``ln(observed / predicted)`` by an
    exponentially weighted average: the first few observations count as a running mean (the
    starting factor counting as one), later ones with weight ``smoothing``. The factor always
    stays within [:data:`DECAY_MIN`, :data:`DECAY_MAX`], so a burst of bad measurements cannot
    make a device look worthless or wildly better than its profile.
    """

    factor: float = 1.0
    observations: int = 0
    smoothing: float = 0.2

    def __post_init__(self) -> None:
        if not (DECAY_MIN <= self.factor <= DECAY_MAX):
            raise ScuError(f"decay factor {self.factor!r} is outside [{DECAY_MIN}, {DECAY_MAX}]")
        if not (0 < self.smoothing <= 1):
            raise ScuError(f"smoothing must be in (0, 1], got {self.smoothing!r}")

    def observe(self, observed_rate: float, predicted_rate: float) -> "DecayLearner":
        """The learner after a job delivered ``observed_rate`` where the profile predicted ``predicted_rate``.

        ``predicted_rate`` must come from the SCU without this decay (``decay=1``), in the same
        unit as ``observed_rate`` (steps/s, samples/s, …).
        """
        if not (math.isfinite(observed_rate) and observed_rate > 0):
            raise ScuError(f"observed rate must be positive and finite, got {observed_rate!r}")
        if not (math.isfinite(predicted_rate) and predicted_rate > 0):
            raise ScuError(f"predicted rate must be positive and finite, got {predicted_rate!r}")
        alpha = max(self.smoothing, 1.0 / (self.observations + 2))
        log_factor = (1 - alpha) * math.log(self.factor) + alpha * math.log(observed_rate / predicted_rate)
        factor = min(max(math.exp(log_factor), DECAY_MIN), DECAY_MAX)
        return replace(self, factor=factor, observations=self.observations + 1)


@dataclass(frozen=True)
class TrustTracker:
    """Progressive onboarding: how far placement should believe a cluster's claimed SCU.

    A cluster starts at :data:`INITIAL_TRUST`. Each finished job compares the throughput the cluster
    delivered with what its claimed SCU promised. Delivering at least ``1 - tolerance`` of the claim
    confirms it and closes ``rise`` of the gap to 1; delivering less is a mismatch and multiplies
    trust by ``fall``. Trust stays within [``floor``, 1]. Over-delivery confirms: the claim was, if
    anything, modest. Placement reads :attr:`trust` as a plugin input, or counts on
    :meth:`trusted_scu`.
    """

    trust: float = INITIAL_TRUST
    confirmations: int = 0
    mismatches: int = 0
    tolerance: float = 0.15
    rise: float = 0.2
    fall: float = 0.5
    floor: float = TRUST_FLOOR

    def __post_init__(self) -> None:
        if not (0 < self.floor <= self.trust <= 1):
            raise ScuError(f"trust {self.trust!r} must lie in [floor={self.floor!r}, 1]")
        if not (0 <= self.tolerance < 1 and 0 < self.rise <= 1 and 0 <= self.fall < 1):
            raise ScuError("tolerance and fall must be in [0, 1), rise in (0, 1]")

    def observe(self, delivered_rate: float, claimed_rate: float) -> "TrustTracker":
        """The tracker after a job delivered ``delivered_rate`` where the claim promised ``claimed_rate``."""
        if not (math.isfinite(delivered_rate) and delivered_rate >= 0):
            raise ScuError(f"delivered rate must be non-negative and finite, got {delivered_rate!r}")
        if not (math.isfinite(claimed_rate) and claimed_rate > 0):
            raise ScuError(f"claimed rate must be positive and finite, got {claimed_rate!r}")
        if delivered_rate >= (1 - self.tolerance) * claimed_rate:
            trust = min(1.0, self.trust + self.rise * (1 - self.trust))
            return replace(self, trust=trust, confirmations=self.confirmations + 1)
        trust = max(self.floor, self.trust * self.fall)
        return replace(self, trust=trust, mismatches=self.mismatches + 1)

    def trusted_scu(self, claimed_scu: float) -> float:
        """The SCU placement should count on from this cluster: the claim, discounted by trust."""
        return claimed_scu * self.trust


def scu_by_task_type(
    device: DeviceProfile,
    *,
    reference: DeviceProfile,
    decay: Mapping[str, float] | None = None,
    precision: Precision = "fp32",
) -> dict[str, float]:
    """The device's SCU for every task type, each times its learned decay factor (default 1)."""
    return {
        t: scu(device, t, reference=reference, decay=(decay or {}).get(t, 1.0), precision=precision)
        for t in TASK_TYPES
    }

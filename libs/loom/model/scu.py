"""SCU: one unit of delivered compute, and how a device's profile converts to it per task type.

One SCU is the delivered throughput of a configurable reference accelerator (ARCHITECTURE.md §6).
A device is described by a :class:`DeviceProfile` over six dimensions (FP32 and FP16 compute,
memory bandwidth, memory size, intra-node interconnect, network). Each task type has a
:class:`TaskWeights` vector over those dimensions, and a device's SCU for a task type is the
weighted geometric mean of its ratios to the reference, times a decay factor for the gap between
benchmark and real work::

    scu(device, task) = decay · exp( Σ wᵢ · ln(deviceᵢ / referenceᵢ) / Σ wᵢ )

Because the mean is geometric, the predicted speed ratio of two devices does not depend on the
reference (:func:`speed_ratio`).

The packaged weights (:data:`TASK_WEIGHTS`) were fitted by :func:`fit_weights` on measured training
throughput of 26 job types on K80, P100 and V100 (Gavel's oracle throughputs; see
``benchmarks/loom_benchmarks/data/README.md``), with the reference library's datasheet profiles as
input, starting from the hand-set :data:`PRIOR_WEIGHTS`. ``loom bench scu`` refits them, checks the
packaged values still equal the fit, and reports in-sample and held-out errors. Gavel job families
map to task types as follows (the reasoning is in the benchmark's docstring):

- ``training_compute``: ResNet-18, ResNet-50, CycleGAN, Transformer (dense convolutions and GEMMs);
- ``training_memory``: LM (an LSTM language model: weights re-read every time step);
- ``training_comm``: Recommendation, A3C (step time dominated by moving data, not arithmetic);
- ``inference``: no measured job; its weights are the prior.

The fit may only weigh the dimensions its prior weighs. Where a dimension's ratio is 1 between
the measured devices (network everywhere, interconnect between K80 and P100), its fitted weight
only says how much the other ratios are damped: ``training_comm``'s network weight is that, and
no more, until measurements of multi-node jobs exist.

:class:`DecayLearner` learns the decay factor, bounded, from observed versus predicted throughput;
:class:`TrustTracker` is the progressive-onboarding weight of a newly joined cluster. Everything here
is pure: no clock, no I/O, immutable values in and out.
"""

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Final, get_args

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
    "PRIOR_WEIGHTS",
    "TASK_TYPES",
    "TASK_WEIGHTS",
    "DecayLearner",
    "DeviceProfile",
    "RatioObservation",
    "ScuError",
    "TaskWeights",
    "TrustTracker",
    "fit_weights",
    "scu",
    "speed_ratio",
]

TASK_TYPES: Final[tuple[TaskType, ...]] = get_args(TaskType)
"""Every task type, in the proto's order."""

DIMENSIONS: Final = (
    "compute_fp32_tflops",
    "compute_fp16_tflops",
    "memory_bandwidth_gbps",
    "memory_gib",
    "interconnect_gbps",
    "network_gbps",
)
"""The profile dimensions, in the order of :meth:`DeviceProfile.vector` and :meth:`TaskWeights.vector`."""

DECAY_MIN: Final = 0.5
"""Lowest decay factor: real work never counts for less than half the benchmark's prediction."""
DECAY_MAX: Final = 1.2
"""Highest decay factor: real work may beat the benchmark's prediction by at most 20%."""

INITIAL_TRUST: Final = 0.3
"""Trust weight of a newly joined cluster, before any delivered throughput confirms its claim."""

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

    def __post_init__(self) -> None:
        for name, value in zip(DIMENSIONS, self.vector(), strict=True):
            if not (math.isfinite(value) and value > 0):
                raise ScuError(f"{self.model}: {name} must be a positive finite number, got {value!r}")

    def vector(self) -> tuple[float, ...]:
        """The six dimensions in :data:`DIMENSIONS` order."""
        return (
            self.compute_fp32_tflops,
            self.compute_fp16_tflops,
            self.memory_bandwidth_gbps,
            self.memory_gib,
            self.interconnect_gbps,
            self.network_gbps,
        )


class TaskWeights(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How much each profile dimension counts for one task type; only the proportions matter."""

    compute_fp32: Weight = 0.0
    compute_fp16: Weight = 0.0
    memory_bandwidth: Weight = 0.0
    memory_size: Weight = 0.0
    interconnect: Weight = 0.0
    network: Weight = 0.0

    def __post_init__(self) -> None:
        values = self.vector()
        if not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
            raise ScuError(f"weights must be finite, non-negative and not all zero: {values}")

    def vector(self) -> tuple[float, ...]:
        """The six weights in :data:`DIMENSIONS` order."""
        return (
            self.compute_fp32,
            self.compute_fp16,
            self.memory_bandwidth,
            self.memory_size,
            self.interconnect,
            self.network,
        )

    def normalised(self) -> "TaskWeights":
        """The same proportions, summing to 1."""
        return TaskWeights.from_vector(self.vector())

    @staticmethod
    def from_vector(values: Sequence[float]) -> "TaskWeights":
        """Weights from six numbers in :data:`DIMENSIONS` order, normalised to sum to 1."""
        if len(values) != len(DIMENSIONS):
            raise ScuError(f"need {len(DIMENSIONS)} weights, got {len(values)}")
        total = float(sum(values))
        if not math.isfinite(total) or total <= 0:
            raise ScuError(f"weights must not all be zero: {tuple(values)}")
        # Rounded so that fitted weights print and compare cleanly (the fit's grid is coarser).
        f32, f16, bw, size, ic, net = (round(float(v) / total, 6) for v in values)
        return TaskWeights(
            compute_fp32=f32,
            compute_fp16=f16,
            memory_bandwidth=bw,
            memory_size=size,
            interconnect=ic,
            network=net,
        )


PRIOR_WEIGHTS: Final[Mapping[TaskType, TaskWeights]] = {
    # Dense GEMMs and convolutions; mixed precision is common; normalisation layers and
    # activations are bandwidth-bound.
    "training_compute": TaskWeights(compute_fp32=0.4, compute_fp16=0.3, memory_bandwidth=0.3),
    # Step time follows how fast weights and activations stream through memory.
    "training_memory": TaskWeights(compute_fp32=0.1, compute_fp16=0.1, memory_bandwidth=0.6, memory_size=0.2),
    # Gradient, embedding or parameter exchange inside the node and across nodes.
    "training_comm": TaskWeights(
        compute_fp32=0.1, compute_fp16=0.1, memory_bandwidth=0.2, interconnect=0.3, network=0.3
    ),
    # Serving: low-precision math, weight and KV-cache streaming, room for the model and cache.
    "inference": TaskWeights(compute_fp16=0.4, memory_bandwidth=0.4, memory_size=0.2),
}
"""Hand-set weights from what bounds each task type. The fit may weigh only the dimensions these
weigh, is pulled toward them (``prior_strength``), and returns them where there is no data."""

TASK_WEIGHTS: Final[Mapping[TaskType, TaskWeights]] = {
    "training_compute": TaskWeights(compute_fp32=0.4, compute_fp16=0.15, memory_bandwidth=0.45),
    "training_memory": TaskWeights(compute_fp32=0.2, compute_fp16=0.1, memory_bandwidth=0.7),
    "training_comm": TaskWeights(compute_fp32=0.05, memory_bandwidth=0.1, interconnect=0.25, network=0.6),
    "inference": PRIOR_WEIGHTS["inference"],
}
"""The weights in use: :func:`fit_weights` on the Gavel measurements (``loom bench scu`` checks them)."""


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
    weights: Mapping[TaskType, TaskWeights] = TASK_WEIGHTS,
) -> float:
    """The device's SCU for ``task_type``: weighted geometric mean of its ratios to ``reference``, × decay.

    ``decay`` must lie in [:data:`DECAY_MIN`, :data:`DECAY_MAX`]; take it from a :class:`DecayLearner`.
    """
    if not (DECAY_MIN <= decay <= DECAY_MAX):
        raise ScuError(f"decay {decay!r} is outside [{DECAY_MIN}, {DECAY_MAX}]")
    if task_type not in weights:
        raise ScuError(f"no weights for task type {task_type!r}")
    log_mean = float(_weight_array(weights[task_type]) @ _log_ratios(device, reference))
    return decay * math.exp(log_mean)


def speed_ratio(
    faster: DeviceProfile,
    slower: DeviceProfile,
    task_type: TaskType,
    *,
    weights: Mapping[TaskType, TaskWeights] = TASK_WEIGHTS,
) -> float:
    """Predicted throughput of ``faster`` over ``slower`` for a task type (any reference gives the same)."""
    return scu(faster, task_type, reference=slower, weights=weights)


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


@functools.lru_cache(maxsize=4)
def _simplex_grid(steps: int) -> npt.NDArray[np.float64]:
    """Every weight vector over the dimensions whose entries are multiples of ``1/steps`` and sum to 1."""

    def compositions(total: int, parts: int) -> list[list[int]]:
        if parts == 1:
            return [[total]]
        return [
            [first, *rest] for first in range(total + 1) for rest in compositions(total - first, parts - 1)
        ]

    grid = np.asarray(compositions(steps, len(DIMENSIONS)), dtype=np.float64) / steps
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

    Searches every weight vector on a simplex grid of ``grid_step`` for the least mean absolute
    error in log ratio, plus ``prior_strength`` times the L1 distance to the (normalised) prior.
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
    prior_w = _weight_array(prior)
    grid = _simplex_grid(steps)
    grid = grid[(grid[:, prior_w == 0] == 0).all(axis=1)]
    loss = prior_strength * np.abs(grid - prior_w).sum(axis=1)
    rows = [(_log_ratios(o.numerator, o.denominator), math.log(o.measured_ratio)) for o in observations]
    if rows:
        features = np.stack([r[0] for r in rows])
        targets = np.asarray([r[1] for r in rows])
        loss = loss + np.abs(grid @ features.T - targets).mean(axis=1)
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
    floor: float = 0.05

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
) -> dict[str, float]:
    """The device's SCU for every task type, each times its learned decay factor (default 1)."""
    return {t: scu(device, t, reference=reference, decay=(decay or {}).get(t, 1.0)) for t in TASK_TYPES}

"""The reference library: datasheet profiles of common accelerators, each number with its source.

These are what Loom assumes about a GPU model until an agent publishes a measured profile
(``loom calibrate``). Peak numbers are the vendor's, per device (one GPU as the scheduler counts
it: a K80 board is two), dense (no structured sparsity), converted to the units of
:class:`~loom.model.scu.DeviceProfile`: bandwidths in gigabits per second (datasheet GB/s × 8),
aggregate over both directions as vendors quote NVLink; PCIe 3.0/4.0/5.0 x16 is 32/64/128 GB/s
aggregate. Memory quoted as "GB" on GPU datasheets is binary (16 GB HBM2 = 16 GiB).

Names are the GPU model strings of the topology and the agents (``V100M16``, ``T4``…). ``G2`` and
``G3`` are models the Alibaba trace does not disclose: their profiles are **assumed** (marked so,
with the guess explained), and a cluster of them onboards at low trust like any other until its
delivered throughput confirms the claim.

No accelerator datasheet gives a node's network bandwidth: every library profile carries the same
default (:data:`DEFAULT_NETWORK_GBPS`) until the agent's measurement replaces it.
"""

import functools
import math
from collections.abc import Mapping
from typing import Final

import msgspec

from loom.model.scu import DIMENSIONS, TASK_TYPES, TASK_WEIGHTS, DeviceProfile, ScuError, TaskWeights, scu
from loom_proto.jobs import GpuModel, TaskType

__all__ = [
    "DEFAULT_NETWORK_GBPS",
    "DEFAULT_REFERENCE_MODEL",
    "LIBRARY",
    "ReferenceProfile",
    "UnknownGpuModelError",
    "library_models",
    "profile_for_model",
    "reference_profile",
    "relative_speed",
    "scu_per_gpu",
]

DEFAULT_REFERENCE_MODEL: Final = "V100M16"
"""One SCU: a V100 SXM2 16 GB, measured in the Gavel data and present in the Alibaba trace."""

DEFAULT_NETWORK_GBPS: Final = 25.0
"""A GPU node's network until measured: 25 Gbit/s, a common datacenter NIC (assumed, not a datasheet's)."""

_NETWORK_SOURCE: Final = (
    "not a property of the accelerator: Loom's default node NIC (25 Gbit/s) until the cluster agent "
    "publishes a measured value"
)
_PCIE3 = 32.0 * 8
_PCIE4 = 64.0 * 8
_PCIE5 = 128.0 * 8


class UnknownGpuModelError(ScuError):
    """A GPU model the reference library does not know; publish a calibrated profile for it instead."""


class ReferenceProfile(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A library entry: the profile, the product it describes, and where each number comes from."""

    profile: DeviceProfile
    product: str
    """The exact product the numbers are for (form factor and memory size matter)."""
    sources: dict[str, str]
    """One citation per dimension of :data:`~loom.model.scu.DIMENSIONS`."""
    assumed: bool = False
    """True when the model is undisclosed and the numbers are a documented guess."""
    notes: str = ""


def _entry(
    model: GpuModel,
    product: str,
    *,
    fp32: tuple[float, str],
    fp16: tuple[float, str],
    memory_gbytes_per_s: tuple[float, str],
    memory: tuple[float, str],
    interconnect_gbps: tuple[float, str],
    assumed: bool = False,
    notes: str = "",
) -> ReferenceProfile:
    """One entry; memory bandwidth arrives in datasheet GB/s and is stored in Gbit/s."""
    profile = DeviceProfile(
        model=model,
        compute_fp32_tflops=fp32[0],
        compute_fp16_tflops=fp16[0],
        memory_bandwidth_gbps=memory_gbytes_per_s[0] * 8,
        memory_gib=memory[0],
        interconnect_gbps=interconnect_gbps[0],
        network_gbps=DEFAULT_NETWORK_GBPS,
    )
    sources = dict(
        zip(
            DIMENSIONS,
            (fp32[1], fp16[1], memory_gbytes_per_s[1], memory[1], interconnect_gbps[1], _NETWORK_SOURCE),
            strict=True,
        )
    )
    return ReferenceProfile(profile=profile, product=product, sources=sources, assumed=assumed, notes=notes)


_K80 = "NVIDIA Tesla K80 datasheet (2015)"
_P100 = "NVIDIA Tesla P100 PCIe datasheet (2016)"
_V100 = "NVIDIA Tesla V100 GPU Accelerator datasheet (2017), SXM2 column"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet (2019)"
_A10 = "NVIDIA A10 Tensor Core GPU datasheet (2021)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column"
_L40S = "NVIDIA L40S GPU datasheet (2023)"
_ADA = "NVIDIA Ada GPU Architecture whitepaper v2.1 (2023), Appendix A, GeForce RTX 4090"
_MI300X = "AMD Instinct MI300X Accelerator data sheet (2023)"
_NO_SPARSITY = "dense; the headline figure with sparsity is twice this"


def _a100_class(
    model: GpuModel, memory_gib: float, memory_gbytes_per_s: float, guess: str
) -> ReferenceProfile:
    tag = f"ASSUMED ({guess}); number from {_A100}"
    return _entry(
        model,
        f"undisclosed (assumed A100 SXM4 {memory_gib:.0f} GB class)",
        fp32=(19.5, f"{tag}: FP32 19.5 TFLOPS"),
        fp16=(312.0, f"{tag}: FP16 Tensor Core 312 TFLOPS ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(memory_gbytes_per_s, f"{tag}: {memory_gbytes_per_s:,.0f} GB/s"),
        memory=(memory_gib, f"{tag}: {memory_gib:.0f} GB HBM2/HBM2e"),
        interconnect_gbps=(600.0 * 8, f"{tag}: NVLink 600 GB/s"),
        assumed=True,
        notes=(
            "The Alibaba GPU trace (cluster-trace-gpu-v2023) does not name this model. Nodes carry "
            f"8 GPUs each ({guess}), the shape of an HGX A100 server, so the numbers are an A100 "
            "SXM4's. This is a guess: replace it with a calibrated profile as soon as one is published."
        ),
    )


_LIBRARY: Final[tuple[ReferenceProfile, ...]] = (
    _entry(
        "K80",
        "NVIDIA Tesla K80 (one of the board's two GK210 GPUs)",
        fp32=(
            2.8,
            f"{_K80}: 5.6 TFLOPS single precision per board at base clocks, two GPUs per board. Base, "
            "not the 8.73 TFLOPS GPU Boost figure: K80 application clocks default to base (cloud "
            "guides set 875 MHz by hand with nvidia-smi -ac)",
        ),
        fp16=(
            2.8,
            "Kepler (compute capability 3.7) has no FP16 arithmetic: half-precision data is computed "
            "at the FP32 rate (CUDA C++ Programming Guide, arithmetic instruction throughput table)",
        ),
        memory_gbytes_per_s=(240.0, f"{_K80}: 480 GB/s GDDR5 per board, two GPUs"),
        memory=(12.0, f"{_K80}: 24 GB GDDR5 per board, two GPUs"),
        interconnect_gbps=(
            _PCIE3,
            f"{_K80}: PCI Express 3.0 x16 (32 GB/s both directions); the two GPUs share an on-board switch",
        ),
    ),
    _entry(
        "P100",
        "NVIDIA Tesla P100 PCIe 16 GB",
        fp32=(9.3, f"{_P100}: single precision 9.3 TFLOPS"),
        fp16=(18.7, f"{_P100}: half precision 18.7 TFLOPS"),
        memory_gbytes_per_s=(732.0, f"{_P100}: CoWoS HBM2 at 732 GB/s (16 GB model)"),
        memory=(16.0, f"{_P100}: 16 GB CoWoS HBM2"),
        interconnect_gbps=(_PCIE3, f"{_P100}: interconnect bandwidth, bidirectional, PCIe 32 GB/s"),
        notes="Alibaba gn5 nodes (2 GPUs, 16 vCPU, 120 GiB: the trace's P100 shape) are P100 PCIe 16 GB.",
    ),
    *(
        _entry(
            model,
            f"NVIDIA Tesla V100 SXM2 {memory_gib:.0f} GB",
            fp32=(15.7, f"{_V100}: single precision 15.7 TFLOPS"),
            fp16=(125.0, f"{_V100}: Tensor Performance 125 TFLOPS (FP16 in, FP32 accumulate)"),
            memory_gbytes_per_s=(900.0, f"{_V100}: memory bandwidth 900 GB/s"),
            memory=(memory_gib, f"{_V100}: capacity {memory_gib:.0f} GB HBM2"),
            interconnect_gbps=(300.0 * 8, f"{_V100}: interconnect bandwidth NVLink 300 GB/s"),
            notes=(
                "The trace's V100M16/V100M32. Alibaba gn6v/gn6e nodes carry V100 SXM2 16/32 GB; the "
                "Gavel measurements' v100 is an SXM2 16 GB (AWS p3)."
            ),
        )
        for model, memory_gib in (("V100M16", 16.0), ("V100M32", 32.0))
    ),
    _entry(
        "T4",
        "NVIDIA T4 (PCIe, 70 W)",
        fp32=(8.1, f"{_T4}: single-precision 8.1 TFLOPS"),
        fp16=(65.0, f"{_T4}: mixed-precision (FP16/FP32) 65 TFLOPS"),
        memory_gbytes_per_s=(320.0, f"{_T4}: GPU memory bandwidth 320+ GB/s"),
        memory=(16.0, f"{_T4}: 16 GB GDDR6"),
        interconnect_gbps=(_PCIE3, f"{_T4}: x16 PCIe Gen3 (32 GB/s both directions); no NVLink"),
    ),
    _entry(
        "A10",
        "NVIDIA A10 (PCIe, 150 W)",
        fp32=(31.2, f"{_A10}: FP32 31.2 TFLOPS"),
        fp16=(125.0, f"{_A10}: FP16 Tensor Core 125 TFLOPS ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(600.0, f"{_A10}: GPU memory bandwidth 600 GB/s"),
        memory=(24.0, f"{_A10}: 24 GB GDDR6"),
        interconnect_gbps=(_PCIE4, f"{_A10}: PCIe Gen4 64 GB/s"),
    ),
    _entry(
        "A100",
        "NVIDIA A100 SXM4 80 GB",
        fp32=(19.5, f"{_A100}: FP32 19.5 TFLOPS"),
        fp16=(312.0, f"{_A100}: FP16 Tensor Core 312 TFLOPS ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(2039.0, f"{_A100}: A100 80GB SXM GPU memory bandwidth 2,039 GB/s"),
        memory=(80.0, f"{_A100}: 80 GB HBM2e"),
        interconnect_gbps=(600.0 * 8, f"{_A100}: NVLink 600 GB/s"),
    ),
    _entry(
        "H100",
        "NVIDIA H100 SXM5 80 GB",
        fp32=(67.0, f"{_H100}: FP32 67 TFLOPS"),
        fp16=(989.5, f"{_H100}: FP16 Tensor Core 1,979 TFLOPS with sparsity; dense is half"),
        memory_gbytes_per_s=(3350.0, f"{_H100}: GPU memory bandwidth 3.35 TB/s"),
        memory=(80.0, f"{_H100}: 80 GB HBM3"),
        interconnect_gbps=(900.0 * 8, f"{_H100}: NVLink 900 GB/s"),
    ),
    _entry(
        "H200",
        "NVIDIA H200 SXM 141 GB",
        fp32=(67.0, f"{_H200}: FP32 67 TFLOPS"),
        fp16=(989.5, f"{_H200}: FP16 Tensor Core 1,979 TFLOPS with sparsity; dense is half"),
        memory_gbytes_per_s=(4800.0, f"{_H200}: GPU memory bandwidth 4.8 TB/s"),
        memory=(141.0, f"{_H200}: 141 GB HBM3e"),
        interconnect_gbps=(900.0 * 8, f"{_H200}: NVLink 900 GB/s"),
    ),
    _entry(
        "L40S",
        "NVIDIA L40S (PCIe, 350 W)",
        fp32=(91.6, f"{_L40S}: FP32 91.6 TFLOPS"),
        fp16=(362.05, f"{_L40S}: FP16 Tensor Core 362.05 TFLOPS ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(864.0, f"{_L40S}: memory bandwidth 864 GB/s"),
        memory=(48.0, f"{_L40S}: 48 GB GDDR6 with ECC"),
        interconnect_gbps=(_PCIE4, f"{_L40S}: PCIe Gen4 x16, 64 GB/s bidirectional; no NVLink"),
    ),
    _entry(
        "RTX4090",
        "NVIDIA GeForce RTX 4090",
        fp32=(82.6, f"{_ADA}: peak FP32 TFLOPS (non-Tensor) 82.6"),
        fp16=(
            165.2,
            f"{_ADA}: peak FP16 Tensor TFLOPS with FP32 accumulate 165.2 (330.3 with FP16 accumulate, "
            "which training rarely uses)",
        ),
        memory_gbytes_per_s=(1008.0, f"{_ADA}: memory bandwidth 1008 GB/s"),
        memory=(24.0, f"{_ADA}: 24 GB GDDR6X"),
        interconnect_gbps=(
            _PCIE4,
            f"{_ADA}: PCIe 4.0 x16 host interface (64 GB/s both directions); no NVLink",
        ),
    ),
    _entry(
        "MI300X",
        "AMD Instinct MI300X (OAM)",
        fp32=(163.4, f"{_MI300X}: peak single precision (FP32) vector 163.4 TFLOPS"),
        fp16=(1307.4, f"{_MI300X}: peak half precision (FP16) 1307.4 TFLOPS ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(5300.0, f"{_MI300X}: peak theoretical memory bandwidth 5.3 TB/s"),
        memory=(192.0, f"{_MI300X}: 192 GB HBM3"),
        interconnect_gbps=(
            896.0 * 8,
            f"{_MI300X}: 7 AMD Infinity Fabric links at 128 GB/s peak each, 896 GB/s in all",
        ),
    ),
    _a100_class("G2", 40.0, 1555.0, "96 vCPU and 384 GiB per 8-GPU node"),
    _a100_class("G3", 80.0, 2039.0, "128 vCPU and 768 GiB per 8-GPU node"),
)

LIBRARY: Final[Mapping[str, ReferenceProfile]] = {entry.profile.model: entry for entry in _LIBRARY}
"""Every library entry by GPU model name."""

_ALIASES: Final[Mapping[str, str]] = {"V100": "V100M16", "RTX-4090": "RTX4090", "A100M80": "A100"}


def library_models() -> tuple[str, ...]:
    """The GPU model names the library knows, in library order."""
    return tuple(LIBRARY)


@functools.cache
def _by_folded_name() -> dict[str, ReferenceProfile]:
    table = {name.casefold(): entry for name, entry in LIBRARY.items()}
    table.update({alias.casefold(): LIBRARY[name] for alias, name in _ALIASES.items()})
    return table


def reference_profile(gpu_model: str) -> ReferenceProfile:
    """The library entry for a GPU model (case-insensitive; ``V100`` means ``V100M16``)."""
    entry = _by_folded_name().get(gpu_model.casefold())
    if entry is None:
        raise UnknownGpuModelError(
            f"no reference profile for GPU model {gpu_model!r}; known: {', '.join(LIBRARY)}"
        )
    return entry


def profile_for_model(gpu_model: str) -> DeviceProfile:
    """The profile an agent publishes for a node of ``gpu_model`` until it has a calibrated one."""
    return reference_profile(gpu_model).profile


def relative_speed(
    gpu_model: str,
    task_type: str,
    *,
    reference_model: str = DEFAULT_REFERENCE_MODEL,
    weights: Mapping[TaskType, TaskWeights] = TASK_WEIGHTS,
) -> float:
    """Speed of ``gpu_model`` relative to the reference for a task type: its SCU, with no learned decay.

    Fits the cluster agent simulator's ``SpeedFn`` (``relative_speed(model, task_type)``), which is
    why ``task_type`` is a plain string here; an unknown one raises :class:`~loom.model.scu.ScuError`.
    """
    for known in TASK_TYPES:
        if known == task_type:
            return scu(
                profile_for_model(gpu_model),
                known,
                reference=profile_for_model(reference_model),
                weights=weights,
            )
    raise ScuError(f"unknown task type {task_type!r}; known: {', '.join(TASK_TYPES)}")


def scu_per_gpu(gpu_model: str, *, reference_model: str = DEFAULT_REFERENCE_MODEL) -> float:
    """One GPU's SCU when no task type is known (capacity summaries): the geometric mean over task types.

    Fits the metrics service's ``scu_per_gpu(model)`` callable.
    """
    speeds = [relative_speed(gpu_model, t, reference_model=reference_model) for t in TASK_TYPES]
    return math.exp(sum(math.log(s) for s in speeds) / len(speeds))

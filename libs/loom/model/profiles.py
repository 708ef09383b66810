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

``compute_tf32_tflops`` is the dense FP32-input matrix rate (TF32 tensor cores from NVIDIA Ampere
on, FP32 matrix cores on AMD CDNA): what FP32 training's GEMMs and convolutions run at by default
in NVIDIA's containers. Parts without it (Kepler to Turing) leave it out and count their FP32 rate.
Half-precision rates are FP16 tensor math **with FP32 accumulate**, what mixed-precision training
uses: on GeForce cards that is half the FP16-accumulate figure their spec sheets headline.

Names follow the GPU model strings of topologies and agents; variants that train at different
speeds have distinct names (``A100`` is the SXM4 80 GB, ``A100-40G`` the SXM4 40 GB,
``A100-40G-PCIE`` and ``A100-80G-PCIE`` the PCIe cards; ``H100`` is the SXM5, ``H100-PCIE`` the
card). :func:`reference_profile` also accepts the aliases in ``_ALIASES`` (``V100``,
``A100-SXM4-40GB``, ``RTX-2080-Ti``…), case-insensitively.

No accelerator datasheet gives a node's network bandwidth: every library profile carries the same
default (:data:`DEFAULT_NETWORK_GBPS`) until the agent's measurement replaces it.
"""

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import msgspec

from loom.model.scu import (
    DIMENSIONS,
    TASK_TYPES,
    UNPROFILED_SPEED,
    DeviceProfile,
    Precision,
    ScuError,
    TaskWeights,
    scu,
)
from loom_proto.clusters import AcceleratorProfile
from loom_proto.jobs import GpuModel, TaskType

__all__ = [
    "DEFAULT_NETWORK_GBPS",
    "DEFAULT_REFERENCE_MODEL",
    "LIBRARY",
    "ModelSpeeds",
    "ReferenceProfile",
    "UnknownGpuModelError",
    "device_profile",
    "library_models",
    "profile_for_model",
    "reference_profile",
    "relative_speed",
    "scu_per_gpu",
    "speeds_for_model",
    "wire_profile",
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
    tf32: tuple[float, str] | None = None,
    assumed: bool = False,
    notes: str = "",
) -> ReferenceProfile:
    """One entry; memory bandwidth arrives in datasheet GB/s and is stored in Gbit/s.

    ``tf32``: the dense FP32-input matrix rate (TF32 tensor cores, AMD FP32 matrix cores); None
    for a part without either, whose FP32 matrix math runs at its FP32 rate.
    """
    profile = DeviceProfile(
        model=model,
        compute_fp32_tflops=fp32[0],
        compute_fp16_tflops=fp16[0],
        memory_bandwidth_gbps=memory_gbytes_per_s[0] * 8,
        memory_gib=memory[0],
        interconnect_gbps=interconnect_gbps[0],
        network_gbps=DEFAULT_NETWORK_GBPS,
        compute_tf32_tflops=tf32[0] if tf32 is not None else None,
    )
    tf32_source = tf32[1] if tf32 is not None else _NO_TF32
    sources = dict(
        zip(
            DIMENSIONS,
            (
                fp32[1],
                fp16[1],
                memory_gbytes_per_s[1],
                memory[1],
                interconnect_gbps[1],
                _NETWORK_SOURCE,
                tf32_source,
            ),
            strict=True,
        )
    )
    return ReferenceProfile(profile=profile, product=product, sources=sources, assumed=assumed, notes=notes)


_NO_TF32 = (
    "no TF32 tensor cores or FP32 matrix cores on this architecture (before NVIDIA Ampere): FP32 "
    "matrix math runs at the FP32 rate, so this dimension equals compute_fp32_tflops"
)
_NO_SPARSITY = "dense; the headline figure with sparsity is twice this"
_K80 = "NVIDIA Tesla K80 datasheet (2015)"
_P100 = "NVIDIA Tesla P100 PCIe datasheet (2016)"
_V100 = "NVIDIA Tesla V100 GPU Accelerator datasheet (2017), SXM2 column"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet (2019)"
_TURING = "NVIDIA Turing GPU Architecture whitepaper (2018), Appendix A, GeForce RTX 2080 Ti reference board"
_QRTX6000 = "NVIDIA Quadro RTX 6000 datasheet (2018)"
_QRTX8000 = "NVIDIA Quadro RTX 8000 datasheet (2018)"
_A10 = "NVIDIA A10 Tensor Core GPU datasheet (2021)"
_A40 = "NVIDIA A40 datasheet (2021)"
_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.1 (2021), Appendix A"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021)"
_A100_40 = "NVIDIA A100 Tensor Core GPU datasheet (2020, 40 GB)"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet (2023)"
_L40S = "NVIDIA L40S GPU datasheet (2023)"
_ADA = "NVIDIA Ada GPU Architecture whitepaper v2.1 (2023), Appendix A"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column"
_GH200 = "NVIDIA GH200 Grace Hopper Superchip datasheet (2023), GH200 with 96 GB HBM3"
_B200 = "NVIDIA GB200 NVL72 and HGX B200 datasheet (2024), HGX B200 individual Blackwell GPU column"
_MI250X = "AMD Instinct MI250X Accelerator data sheet (2021)"
_MI300X = "AMD Instinct MI300X Accelerator data sheet (2023)"
_PCIE_CARD = (
    "no NVLink between the GPUs of a server (an NVLink bridge joins pairs at most): collectives run "
    "over the host interface"
)


def _a100_class(
    model: GpuModel, memory_gib: float, memory_gbytes_per_s: float, guess: str
) -> ReferenceProfile:
    tag = f"ASSUMED ({guess}); number from {_A100}"
    return _entry(
        model,
        f"undisclosed (assumed A100 SXM4 {memory_gib:.0f} GB class)",
        fp32=(19.5, f"{tag}: FP32 19.5 TFLOPS"),
        fp16=(312.0, f"{tag}: FP16 Tensor Core 312 TFLOPS ({_NO_SPARSITY})"),
        tf32=(156.0, f"{tag}: TF32 Tensor Core 156 TFLOPS ({_NO_SPARSITY})"),
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


def _a100(
    model: GpuModel, product: str, *, sxm: bool, memory_gib: float, bandwidth: float, source: str
) -> ReferenceProfile:
    """An A100 variant: the same GA100 compute; memory and the interconnect differ by SKU."""
    form = "SXM" if sxm else "PCIe"
    return _entry(
        model,
        product,
        fp32=(19.5, f"{source}: FP32 19.5 TFLOPS"),
        fp16=(312.0, f"{source}: FP16 Tensor Core 312 TFLOPS ({_NO_SPARSITY})"),
        tf32=(156.0, f"{source}: TF32 Tensor Core 156 TFLOPS ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(
            bandwidth,
            f"{source}: A100 {memory_gib:.0f}GB {form} GPU memory bandwidth {bandwidth:,.0f} GB/s",
        ),
        memory=(memory_gib, f"{source}: {memory_gib:.0f} GB {'HBM2e' if memory_gib > 40 else 'HBM2'}"),
        interconnect_gbps=(600.0 * 8, f"{source}: NVLink 600 GB/s")
        if sxm
        else (
            _PCIE4,
            f"{source}: PCIe Gen4 64 GB/s; {_PCIE_CARD} (the NVLink bridge joins 2 GPUs at 600 GB/s)",
        ),
    )


def _v100(model: GpuModel, memory_gib: float) -> ReferenceProfile:
    return _entry(
        model,
        f"NVIDIA Tesla V100 SXM2 {memory_gib:.0f} GB",
        fp32=(15.7, f"{_V100}: single precision 15.7 TFLOPS"),
        fp16=(125.0, f"{_V100}: Tensor Performance 125 TFLOPS (FP16 in, FP32 accumulate)"),
        memory_gbytes_per_s=(900.0, f"{_V100}: memory bandwidth 900 GB/s"),
        memory=(memory_gib, f"{_V100}: capacity {memory_gib:.0f} GB HBM2"),
        interconnect_gbps=(300.0 * 8, f"{_V100}: interconnect bandwidth NVLink 300 GB/s"),
        notes=(
            "The trace's V100M16/V100M32. Alibaba gn6v/gn6e nodes carry V100 SXM2 16/32 GB; the "
            "Gavel measurements' v100 is an SXM2 16 GB (AWS p3), Lambda's an SXM2 16 GB (Lambda Cloud)."
        ),
    )


def _quadro_turing(model: GpuModel, memory_gib: float, source: str) -> ReferenceProfile:
    name = "8000" if memory_gib > 24 else "6000"
    return _entry(
        model,
        f"NVIDIA Quadro RTX {name} (actively cooled board)",
        fp32=(16.3, f"{source}: FP32 performance 16.3 TFLOPS"),
        fp16=(
            130.5,
            f"{source}: Tensor performance 130.5 TFLOPS (Quadro Turing runs FP16 with FP32 "
            "accumulate at the full tensor rate)",
        ),
        memory_gbytes_per_s=(672.0, f"{source}: memory bandwidth 672 GB/s"),
        memory=(memory_gib, f"{source}: GPU memory {memory_gib:.0f} GB GDDR6"),
        interconnect_gbps=(
            _PCIE3,
            f"{source}: PCI Express 3.0 x16 (32 GB/s both directions); {_PCIE_CARD} (bridge: 100 GB/s)",
        ),
    )


def _h100_sxm_class(
    model: GpuModel, product: str, *, memory_gib: float, bandwidth: float, source: str, memory_kind: str
) -> ReferenceProfile:
    return _entry(
        model,
        product,
        fp32=(67.0, f"{source}: FP32 67 TFLOPS"),
        fp16=(989.5, f"{source}: FP16 Tensor Core 1,979 TFLOPS with sparsity; dense is half"),
        tf32=(494.5, f"{source}: TF32 Tensor Core 989 TFLOPS with sparsity; dense is half"),
        memory_gbytes_per_s=(bandwidth, f"{source}: GPU memory bandwidth {bandwidth / 1000:g} TB/s"),
        memory=(memory_gib, f"{source}: {memory_gib:.0f} GB {memory_kind}"),
        interconnect_gbps=(900.0 * 8, f"{source}: NVLink 900 GB/s"),
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
    _v100("V100M16", 16.0),
    _v100("V100M32", 32.0),
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
        "RTX2080TI",
        "NVIDIA GeForce RTX 2080 Ti (reference clocks, 11 GB)",
        fp32=(13.4, f"{_TURING}: peak FP32 TFLOPS 13.4"),
        fp16=(
            53.8,
            f"{_TURING}: peak FP16 Tensor TFLOPS with FP32 accumulate 53.8 (107.6 with FP16 accumulate, "
            "which training does not use: GeForce runs FP32 accumulate at half rate)",
        ),
        memory_gbytes_per_s=(616.0, f"{_TURING}: memory bandwidth 616 GB/s"),
        memory=(11.0, f"{_TURING}: 11 GB GDDR6"),
        interconnect_gbps=(
            _PCIE3,
            f"{_TURING}: PCI Express 3.0 x16 host interface (32 GB/s both directions); {_PCIE_CARD} "
            "(the 2-way NVLink bridge: 100 GB/s)",
        ),
    ),
    _quadro_turing("QRTX6000", 24.0, _QRTX6000),
    _quadro_turing("QRTX8000", 48.0, _QRTX8000),
    _entry(
        "A10",
        "NVIDIA A10 (PCIe, 150 W)",
        fp32=(31.2, f"{_A10}: FP32 31.2 TFLOPS"),
        fp16=(125.0, f"{_A10}: FP16 Tensor Core 125 TFLOPS ({_NO_SPARSITY})"),
        tf32=(62.5, f"{_A10}: TF32 Tensor Core 62.5 TFLOPS ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(600.0, f"{_A10}: GPU memory bandwidth 600 GB/s"),
        memory=(24.0, f"{_A10}: 24 GB GDDR6"),
        interconnect_gbps=(_PCIE4, f"{_A10}: PCIe Gen4 64 GB/s"),
    ),
    _entry(
        "A40",
        "NVIDIA A40 (PCIe, 300 W)",
        fp32=(37.4, f"{_A40}: peak FP32 TFLOPS (non-Tensor) 37.4"),
        fp16=(
            149.7,
            f"{_A40}: peak BF16 Tensor TFLOPS with FP32 accumulate 149.7 ({_NO_SPARSITY}); FP16 the same",
        ),
        tf32=(74.8, f"{_A40}: peak TF32 Tensor TFLOPS 74.8 ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(696.0, f"{_A40}: GPU memory bandwidth 696 GB/s"),
        memory=(48.0, f"{_A40}: 48 GB GDDR6 with ECC"),
        interconnect_gbps=(
            _PCIE4,
            f"{_A40}: PCIe Gen4 x16 64 GB/s; {_PCIE_CARD} (NVLink bridge: 112.5 GB/s bidirectional)",
        ),
    ),
    _entry(
        "RTX3090",
        "NVIDIA GeForce RTX 3090",
        fp32=(35.6, f"{_GA102}: GeForce RTX 3090 peak FP32 TFLOPS 35.6"),
        fp16=(
            71.0,
            f"{_GA102}: GeForce RTX 3090 peak FP16 Tensor TFLOPS with FP32 accumulate 71 ({_NO_SPARSITY}; "
            "142 with FP16 accumulate, which training does not use)",
        ),
        tf32=(35.6, f"{_GA102}: GeForce RTX 3090 peak TF32 Tensor TFLOPS 35.6 ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(936.0, f"{_GA102}: GeForce RTX 3090 memory bandwidth 936 GB/s"),
        memory=(24.0, f"{_GA102}: GeForce RTX 3090 24 GB GDDR6X"),
        interconnect_gbps=(
            _PCIE4,
            f"{_GA102}: PCIe 4.0 x16 host interface (64 GB/s both directions); {_PCIE_CARD}",
        ),
    ),
    _entry(
        "RTXA6000",
        "NVIDIA RTX A6000 (PCIe, 300 W)",
        fp32=(38.7, f"{_GA102}: RTX A6000 peak FP32 TFLOPS 38.7"),
        fp16=(
            154.8,
            f"{_GA102}: RTX A6000 peak FP16 Tensor TFLOPS with FP32 accumulate 154.8 ({_NO_SPARSITY}; "
            "professional parts accumulate in FP32 at the full rate)",
        ),
        tf32=(77.4, f"{_GA102}: RTX A6000 peak TF32 Tensor TFLOPS 77.4 ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(768.0, f"{_GA102}: RTX A6000 memory bandwidth 768 GB/s"),
        memory=(48.0, f"{_GA102}: RTX A6000 48 GB GDDR6 with ECC"),
        interconnect_gbps=(
            _PCIE4,
            f"{_GA102}: PCIe 4.0 x16 (64 GB/s both directions); {_PCIE_CARD} (NVLink bridge: 112.5 GB/s)",
        ),
    ),
    _a100("A100-40G", "NVIDIA A100 SXM4 40 GB", sxm=True, memory_gib=40.0, bandwidth=1555.0, source=_A100_40),
    _a100(
        "A100-40G-PCIE",
        "NVIDIA A100 PCIe 40 GB (250 W)",
        sxm=False,
        memory_gib=40.0,
        bandwidth=1555.0,
        source=_A100_40,
    ),
    _a100("A100", "NVIDIA A100 SXM4 80 GB", sxm=True, memory_gib=80.0, bandwidth=2039.0, source=_A100),
    _a100(
        "A100-80G-PCIE",
        "NVIDIA A100 PCIe 80 GB (300 W)",
        sxm=False,
        memory_gib=80.0,
        bandwidth=1935.0,
        source=_A100,
    ),
    _entry(
        "L4",
        "NVIDIA L4 (PCIe, 72 W)",
        fp32=(30.3, f"{_L4}: FP32 30.3 TFLOPS"),
        fp16=(121.0, f"{_L4}: FP16 Tensor Core 242 TFLOPS with sparsity; dense is half"),
        tf32=(60.0, f"{_L4}: TF32 Tensor Core 120 TFLOPS with sparsity; dense is half"),
        memory_gbytes_per_s=(300.0, f"{_L4}: GPU memory bandwidth 300 GB/s"),
        memory=(24.0, f"{_L4}: 24 GB GDDR6"),
        interconnect_gbps=(_PCIE4, f"{_L4}: PCIe Gen4 x16 64 GB/s; no NVLink"),
    ),
    _entry(
        "L40S",
        "NVIDIA L40S (PCIe, 350 W)",
        fp32=(91.6, f"{_L40S}: FP32 91.6 TFLOPS"),
        fp16=(362.05, f"{_L40S}: FP16 Tensor Core 362.05 TFLOPS ({_NO_SPARSITY})"),
        tf32=(183.0, f"{_L40S}: TF32 Tensor Core 366 TFLOPS with sparsity; dense is half"),
        memory_gbytes_per_s=(864.0, f"{_L40S}: memory bandwidth 864 GB/s"),
        memory=(48.0, f"{_L40S}: 48 GB GDDR6 with ECC"),
        interconnect_gbps=(_PCIE4, f"{_L40S}: PCIe Gen4 x16, 64 GB/s bidirectional; no NVLink"),
    ),
    _entry(
        "RTX4090",
        "NVIDIA GeForce RTX 4090",
        fp32=(82.6, f"{_ADA}: GeForce RTX 4090 peak FP32 TFLOPS (non-Tensor) 82.6"),
        fp16=(
            165.2,
            f"{_ADA}: GeForce RTX 4090 peak FP16 Tensor TFLOPS with FP32 accumulate 165.2 (330.3 with "
            "FP16 accumulate, which training does not use)",
        ),
        tf32=(82.6, f"{_ADA}: GeForce RTX 4090 peak TF32 Tensor TFLOPS 82.6 ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(1008.0, f"{_ADA}: GeForce RTX 4090 memory bandwidth 1008 GB/s"),
        memory=(24.0, f"{_ADA}: GeForce RTX 4090 24 GB GDDR6X"),
        interconnect_gbps=(
            _PCIE4,
            f"{_ADA}: PCIe 4.0 x16 host interface (64 GB/s both directions); no NVLink",
        ),
    ),
    _entry(
        "RTX6000ADA",
        "NVIDIA RTX 6000 Ada Generation (PCIe, 300 W)",
        fp32=(91.1, f"{_ADA}: RTX 6000 Ada peak FP32 TFLOPS (non-Tensor) 91.1"),
        fp16=(
            364.2,
            f"{_ADA}: RTX 6000 Ada peak FP16 Tensor TFLOPS with FP32 accumulate 364.2 ({_NO_SPARSITY})",
        ),
        tf32=(182.1, f"{_ADA}: RTX 6000 Ada peak TF32 Tensor TFLOPS 182.1 ({_NO_SPARSITY})"),
        memory_gbytes_per_s=(960.0, f"{_ADA}: RTX 6000 Ada memory bandwidth 960 GB/s"),
        memory=(48.0, f"{_ADA}: RTX 6000 Ada 48 GB GDDR6 with ECC"),
        interconnect_gbps=(_PCIE4, f"{_ADA}: PCIe 4.0 x16 (64 GB/s both directions); no NVLink"),
    ),
    _entry(
        "H100-PCIE",
        "NVIDIA H100 PCIe 80 GB (350 W)",
        fp32=(51.0, f"{_H100}, H100 PCIe column: FP32 51 TFLOPS"),
        fp16=(
            756.5,
            f"{_H100}, H100 PCIe column: FP16 Tensor Core 1,513 TFLOPS with sparsity; dense is half",
        ),
        tf32=(378.0, f"{_H100}, H100 PCIe column: TF32 Tensor Core 756 TFLOPS with sparsity; dense is half"),
        memory_gbytes_per_s=(2000.0, f"{_H100}, H100 PCIe column: GPU memory bandwidth 2 TB/s"),
        memory=(80.0, f"{_H100}, H100 PCIe column: 80 GB HBM2e"),
        interconnect_gbps=(
            _PCIE5,
            f"{_H100}, H100 PCIe column: PCIe Gen5 128 GB/s; {_PCIE_CARD} (NVLink bridge: 600 GB/s)",
        ),
    ),
    _h100_sxm_class(
        "H100",
        "NVIDIA H100 SXM5 80 GB",
        memory_gib=80.0,
        bandwidth=3350.0,
        source=f"{_H100}, H100 SXM column",
        memory_kind="HBM3",
    ),
    _h100_sxm_class(
        "H200",
        "NVIDIA H200 SXM 141 GB",
        memory_gib=141.0,
        bandwidth=4800.0,
        source=_H200,
        memory_kind="HBM3e",
    ),
    _h100_sxm_class(
        "GH200",
        "NVIDIA GH200 Grace Hopper Superchip, 96 GB HBM3 (the Hopper GPU)",
        memory_gib=96.0,
        bandwidth=4000.0,
        source=_GH200,
        memory_kind="HBM3",
    ),
    _entry(
        "B200",
        "NVIDIA B200 SXM in HGX B200 (1,000 W)",
        fp32=(75.0, f"{_B200}: FP32 75 TFLOPS"),
        fp16=(2250.0, f"{_B200}: FP16/BF16 Tensor Core 4.5 PFLOPS with sparsity; dense is half"),
        tf32=(1100.0, f"{_B200}: TF32 Tensor Core 2.2 PFLOPS with sparsity; dense is half"),
        memory_gbytes_per_s=(7700.0, f"{_B200}: GPU memory bandwidth 7.7 TB/s"),
        memory=(180.0, f"{_B200}: 180 GB HBM3E (192 GB physical)"),
        interconnect_gbps=(1800.0 * 8, f"{_B200}: fifth-generation NVLink 1.8 TB/s"),
    ),
    _entry(
        "MI250X",
        "AMD Instinct MI250X (OAM), one of its two GCDs (the OS shows each as a GPU)",
        fp32=(23.95, f"{_MI250X}: peak FP32 vector 47.9 TFLOPS per OAM, two GCDs"),
        fp16=(191.5, f"{_MI250X}: peak FP16 383 TFLOPS per OAM, two GCDs"),
        tf32=(47.85, f"{_MI250X}: peak FP32 matrix 95.7 TFLOPS per OAM, two GCDs (CDNA 2 has no TF32)"),
        memory_gbytes_per_s=(1638.4, f"{_MI250X}: 3.2768 TB/s HBM2e per OAM, two GCDs"),
        memory=(64.0, f"{_MI250X}: 128 GB HBM2e per OAM, two GCDs"),
        interconnect_gbps=(
            400.0 * 8,
            f"{_MI250X}: up to 8 Infinity Fabric links, 800 GB/s peak aggregate per OAM, two GCDs",
        ),
        notes="Per GCD, as K80 is per GK210: ROCm presents each of the two dies as its own GPU.",
    ),
    _entry(
        "MI300X",
        "AMD Instinct MI300X (OAM)",
        fp32=(163.4, f"{_MI300X}: peak single precision (FP32) vector 163.4 TFLOPS"),
        fp16=(1307.4, f"{_MI300X}: peak half precision (FP16) 1307.4 TFLOPS ({_NO_SPARSITY})"),
        tf32=(653.7, f"{_MI300X}: peak TF32 653.7 TFLOPS ({_NO_SPARSITY})"),
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

_ALIASES: Final[Mapping[str, str]] = {
    # nvidia-smi / calibrate spellings and common short names (matched case-insensitively).
    "V100": "V100M16",
    "V100-16G": "V100M16",
    "V100-SXM2-16GB": "V100M16",
    "V100-32G": "V100M32",
    "V100-SXM2-32GB": "V100M32",
    "RTX-2080-Ti": "RTX2080TI",
    "2080Ti": "RTX2080TI",
    "Quadro-RTX-6000": "QRTX6000",
    "RTX6000": "QRTX6000",
    "Quadro-RTX-8000": "QRTX8000",
    "RTX8000": "QRTX8000",
    "RTX-3090": "RTX3090",
    "RTX-A6000": "RTXA6000",
    "A6000": "RTXA6000",
    "RTX-4090": "RTX4090",
    "RTX-6000-Ada": "RTX6000ADA",
    "RTX-6000-Ada-Generation": "RTX6000ADA",
    "A100M80": "A100",
    "A100-80G": "A100",
    "A100-SXM4-80GB": "A100",
    "A100-SXM4-40GB": "A100-40G",
    "A100-PCIE-40GB": "A100-40G-PCIE",
    "A100-PCIE-80GB": "A100-80G-PCIE",
    "H100-SXM": "H100",
    "H100-SXM5": "H100",
    "H100-80GB-HBM3": "H100",
    "H100-SXM5-80GB": "H100",
    "H100-PCIe-80GB": "H100-PCIE",
    "H200-SXM": "H200",
    "GH200-96GB": "GH200",
    "B200-SXM": "B200",
}
"""Other names of library models; each must not shadow a library name (checked by the tests)."""


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
    weights: Mapping[TaskType, TaskWeights] | None = None,
    precision: Precision = "fp32",
) -> float:
    """Speed of ``gpu_model`` relative to the reference for a task type: its SCU, with no learned decay.

    ``precision`` picks the weights (``fp16`` for a job whose family ends in ``@fp16``) unless
    ``weights`` are given. Fits the cluster agent simulator's ``SpeedFn``
    (``relative_speed(model, task_type)``), which is why ``task_type`` is a plain string here; an
    unknown one raises :class:`~loom.model.scu.ScuError`, as does an unknown GPU model
    (:class:`UnknownGpuModelError`).
    """
    for known in TASK_TYPES:
        if known == task_type:
            return scu(
                profile_for_model(gpu_model),
                known,
                reference=profile_for_model(reference_model),
                weights=weights,
                precision=precision,
            )
    raise ScuError(f"unknown task type {task_type!r}; known: {', '.join(TASK_TYPES)}")


def scu_per_gpu(gpu_model: str, *, reference_model: str = DEFAULT_REFERENCE_MODEL) -> float:
    """One GPU's SCU when no task type is known (capacity summaries): the geometric mean over task
    types, in single precision; :data:`~loom.model.scu.UNPROFILED_SPEED` for a model the library
    does not know (a calibrated-only model counts at the floor in summaries).

    Fits the metrics service's ``scu_per_gpu(model)`` callable.
    """
    speeds = list(speeds_for_model(gpu_model, reference_model=reference_model).speed.values())
    return math.exp(sum(math.log(s) for s in speeds) / len(speeds))


@dataclass(frozen=True)
class ModelSpeeds:
    """What placement believes about one GPU of a model: its SCU per task type and precision."""

    gpu_model: str
    profiled: bool
    """False for a model the library does not know: every speed is :data:`UNPROFILED_SPEED`."""
    memory_gib: float
    """Device memory (0 when unprofiled: no job that states a memory need fits there)."""
    speed: Mapping[str, float]
    """Task type -> SCU for single-precision jobs."""
    half_speed: Mapping[str, float]
    """Task type -> SCU for mixed-precision jobs (family ``…@fp16``)."""


@functools.cache
def speeds_for_model(gpu_model: str, *, reference_model: str = DEFAULT_REFERENCE_MODEL) -> ModelSpeeds:
    """A GPU model's speed tables, the one way the simulator and the placement book build them.

    A model with no library profile is **unprofiled**: counted at :data:`UNPROFILED_SPEED` (the
    trust floor, never the reference's 1.0) with no known memory, so placement prefers every
    profiled GPU until a calibrated profile or learned runs say what it delivers.
    """
    try:
        profile = profile_for_model(gpu_model)
    except UnknownGpuModelError:
        flat: dict[str, float] = dict.fromkeys(TASK_TYPES, UNPROFILED_SPEED)
        return ModelSpeeds(gpu_model, profiled=False, memory_gib=0.0, speed=flat, half_speed=dict(flat))
    reference = profile_for_model(reference_model)
    fp32: dict[str, float] = {t: scu(profile, t, reference=reference, precision="fp32") for t in TASK_TYPES}
    fp16: dict[str, float] = {t: scu(profile, t, reference=reference, precision="fp16") for t in TASK_TYPES}
    return ModelSpeeds(gpu_model, profiled=True, memory_gib=profile.memory_gib, speed=fp32, half_speed=fp16)


_SHARED_FIELDS: Final = (
    "compute_fp32_tflops",
    "compute_fp16_tflops",
    "memory_bandwidth_gbps",
    "memory_gib",
    "interconnect_gbps",
    "network_gbps",
    "compute_tf32_tflops",
)
"""The dimensions a :class:`DeviceProfile` and its wire form (``AcceleratorProfile``) share."""


def wire_profile(profile: DeviceProfile) -> AcceleratorProfile:
    """A profile as agents publish it (``loom_proto.clusters.AcceleratorProfile``)."""
    return AcceleratorProfile(gpu_model=profile.model, **{f: getattr(profile, f) for f in _SHARED_FIELDS})


def device_profile(wire: AcceleratorProfile) -> DeviceProfile:
    """A published profile as the SCU model reads it; :class:`~loom.model.scu.ScuError` if unusable."""
    return DeviceProfile(model=wire.gpu_model, **{f: getattr(wire, f) for f in _SHARED_FIELDS})

"""``loom calibrate``: measure this machine's performance profile on a standard benchmark set.

The set (ARCHITECTURE.md §6): GEMM in FP32 and FP16 at several sizes, a convolution, a
transformer layer forward and backward, and memory bandwidth. Each kernel runs a warm-up, then
``repeats`` timed runs; the report gives its throughput (at the median latency) and the latency
distribution (p50/p90/p99) per kernel, size and batch size, and folds them into a
:class:`~loom.model.scu.DeviceProfile` that an agent can publish.

Backends:

- ``numpy`` (always available) measures the CPU. NumPy has no hardware FP16 matrix multiply: its
  float16 GEMM is an emulation loop, so the CPU's FP16 figure is honest but tiny, and small sizes
  keep it fast.
- ``torch-cuda`` measures GPU 0 when PyTorch with CUDA is importable. **This path is written but
  untested here**: PyTorch is not installed in the development environment.

What cannot be measured on one machine keeps a stated default: the network (the agent's probes
measure it), and, on a CPU, the intra-node interconnect, taken as the measured memory bandwidth
(workers on one CPU node exchange data through shared memory).
"""

import functools
import importlib
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt
from rich.table import Table

from loom.model.profiles import DEFAULT_NETWORK_GBPS
from loom.model.scu import DeviceProfile
from loom_proto.jobs import GpuModel

__all__ = [
    "CalibrationError",
    "CalibrationOptions",
    "CalibrationReport",
    "KernelResult",
    "calibrate",
    "check_model",
    "render_table",
]

Backend = Literal["numpy", "torch-cuda"]
Progress = Callable[[str], None]
FloatArray = npt.NDArray[np.floating[Any]]


class CalibrationError(RuntimeError):
    """The benchmark cannot run as asked (e.g. ``--device cuda`` without a usable GPU)."""


GPU_MODEL_RULE = "1-32 characters of letters, digits, '_', '.', '+' or '-'"
"""What a GPU model name (:data:`loom_proto.jobs.GpuModel`) allows, in words."""


def check_model(model: str) -> str:
    """``model`` unchanged if it is a GPU model name as the wire contract has it
    (:data:`loom_proto.jobs.GpuModel`: the profile's ``model``), else :class:`CalibrationError`."""
    try:
        return msgspec.convert(model, GpuModel)
    except msgspec.ValidationError:
        raise CalibrationError(
            f"--model {model!r} is not a GPU model name: use {GPU_MODEL_RULE} (e.g. H100-80GB)"
        ) from None


class KernelResult(msgspec.Struct, frozen=True, kw_only=True):
    """One kernel at one size and batch size: throughput and latency distribution over the repeats."""

    kernel: str
    """``gemm``, ``conv2d`` (im2col + GEMM on NumPy, cuDNN on GPU), ``transformer_layer`` (forward
    and backward), ``memory_copy`` or ``interconnect_copy``."""
    dtype: str
    shape: str
    """Problem size: GEMM ``n³``; convolution ``channels×side² → filters, kernel``; layer dims; bytes."""
    batch_size: int
    repeats: int
    throughput: float
    """Work per second at the median latency, in ``throughput_unit``."""
    throughput_unit: str
    """``GFLOP/s`` for compute kernels, ``GB/s`` (10⁹ bytes read plus written) for copies."""
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float


class CalibrationReport(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``loom calibrate`` measured, and the profile derived from it."""

    backend: Backend
    device_name: str
    quick: bool
    duration_s: float
    kernels: list[KernelResult]
    profile: DeviceProfile
    derivation: dict[str, str]
    """For each profile dimension, how it was obtained (measured kernel, or the default and why)."""


@dataclass(frozen=True)
class CalibrationOptions:
    """What to run: ``quick`` trades sizes and repeats for speed (< 2 s on the CPU backend)."""

    quick: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: str | None = None
    """GPU model name for the profile; default: derived from the device name."""
    repeats: int | None = None
    seed: int = 0


# ---- timing -----------------------------------------------------------------------------------------

MIN_REPEATS = 3
"""Fewest timed runs per kernel, whatever its time budget."""


def _percentile_ms(samples_s: Sequence[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(samples_s), q)) * 1e3, 4)


def _measure(
    kernel: str,
    dtype: str,
    shape: str,
    batch_size: int,
    run: Callable[[], object],
    *,
    work: float,
    unit: str,
    repeats: int,
    budget_s: float,
    sync: Callable[[], None] = lambda: None,
) -> KernelResult:
    """Time ``run``: one warm-up, then up to ``repeats`` runs; ``work`` is GFLOP or GB per run.

    Stops early, after at least :data:`MIN_REPEATS` runs, once the runs took ``budget_s``: slow
    kernels on slow machines keep the whole calibration inside its time.
    """
    run()
    sync()
    samples_s: list[float] = []
    while len(samples_s) < repeats and (len(samples_s) < MIN_REPEATS or sum(samples_s) < budget_s):
        start = time.perf_counter()
        run()
        sync()
        samples_s.append(time.perf_counter() - start)
    median_s = float(np.median(samples_s))
    return KernelResult(
        kernel=kernel,
        dtype=dtype,
        shape=shape,
        batch_size=batch_size,
        repeats=len(samples_s),
        throughput=round(work / max(median_s, 1e-12), 3),
        throughput_unit=unit,
        latency_p50_ms=_percentile_ms(samples_s, 50),
        latency_p90_ms=_percentile_ms(samples_s, 90),
        latency_p99_ms=_percentile_ms(samples_s, 99),
    )


# ---- numpy kernels ----------------------------------------------------------------------------------


def _conv2d_im2col(images: FloatArray, filters: FloatArray) -> FloatArray:
    """3×3 convolution, stride 1, zero padding 1, as im2col followed by one GEMM (NCHW layout)."""
    batch, channels, height, width = images.shape
    padded = np.pad(images, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    # (batch, channels, H, W, 3, 3) -> (batch·H·W, channels·9): the copy is part of the kernel's cost.
    columns = windows.transpose(0, 2, 3, 1, 4, 5).reshape(batch * height * width, channels * 9)
    out: FloatArray = columns @ filters.reshape(filters.shape[0], -1).T
    return out


@dataclass(frozen=True)
class _LayerShape:
    batch: int
    seq: int
    d_model: int
    heads: int
    d_ff: int

    def text(self) -> str:
        """``S64 D128 H4 F512``: sequence length, model width, heads, feed-forward width."""
        return f"S{self.seq} D{self.d_model} H{self.heads} F{self.d_ff}"

    def matmul_gflop(self) -> float:
        """Forward + backward GEMM work: 3 × forward (backward computes two products per forward one)."""
        tokens = self.batch * self.seq
        forward = (
            2 * tokens * self.d_model * 3 * self.d_model  # q, k, v projections
            + 2 * 2 * self.batch * self.seq * self.seq * self.d_model  # scores and weighted values
            + 2 * tokens * self.d_model * self.d_model  # output projection
            + 2 * 2 * tokens * self.d_model * self.d_ff  # feed-forward
        )
        return 3 * forward / 1e9


def _transformer_layer_step(
    x: FloatArray, params: Mapping[str, FloatArray], grad_out: FloatArray, shape: _LayerShape
) -> dict[str, FloatArray]:
    """One encoder layer (attention + ReLU feed-forward, residuals, no normalisation): forward, backward.

    Returns the gradients of ``sum(y * grad_out)`` with respect to every parameter and the input.
    """
    b, s, d, h = shape.batch, shape.seq, shape.d_model, shape.heads
    dh = d // h
    scale = 1.0 / math.sqrt(dh)
    w_qkv, w_o, w_1, w_2 = params["w_qkv"], params["w_o"], params["w_1"], params["w_2"]

    def heads(t: FloatArray) -> FloatArray:
        return t.reshape(b, s, h, dh).transpose(0, 2, 1, 3)

    def merge(t: FloatArray) -> FloatArray:
        return t.transpose(0, 2, 1, 3).reshape(b, s, d)

    qkv = x @ w_qkv
    q, k, v = (heads(t) for t in np.split(qkv, 3, axis=-1))
    scores = (q @ k.transpose(0, 1, 3, 2)) * scale
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    attended = merge(p @ v)
    hidden = x + attended @ w_o
    pre = hidden @ w_1
    act = np.maximum(pre, 0)
    # y = hidden + act @ w_2; backward from dL/dy = grad_out.
    d_hidden = grad_out.copy()
    g_w2 = act.reshape(-1, shape.d_ff).T @ grad_out.reshape(-1, d)
    d_pre = (grad_out @ w_2.T) * (pre > 0)
    g_w1 = hidden.reshape(-1, d).T @ d_pre.reshape(-1, shape.d_ff)
    d_hidden += d_pre @ w_1.T
    g_wo = attended.reshape(-1, d).T @ d_hidden.reshape(-1, d)
    d_att = heads(d_hidden @ w_o.T)
    d_p = d_att @ v.transpose(0, 1, 3, 2)
    d_v = p.transpose(0, 1, 3, 2) @ d_att
    d_scores = p * (d_p - (d_p * p).sum(axis=-1, keepdims=True)) * scale
    d_q = d_scores @ k
    d_k = d_scores.transpose(0, 1, 3, 2) @ q
    d_qkv = np.concatenate([merge(d_q), merge(d_k), merge(d_v)], axis=-1)
    g_wqkv = x.reshape(-1, d).T @ d_qkv.reshape(-1, 3 * d)
    d_x = d_hidden + d_qkv @ w_qkv.T
    return {"w_qkv": g_wqkv, "w_o": g_wo, "w_1": g_w1, "w_2": g_w2, "x": d_x}


def _numpy_kernels(options: CalibrationOptions, progress: Progress) -> list[KernelResult]:
    rng = np.random.default_rng(options.seed)
    repeats = options.repeats or (3 if options.quick else 10)
    budget_s = 0.05 if options.quick else 0.4
    results: list[KernelResult] = []

    gemm_sizes = {"float32": (256, 512) if options.quick else (256, 512, 1024)}
    # NumPy's float16 matmul is a scalar loop (no BLAS): keep it small.
    gemm_sizes["float16"] = (64, 128) if options.quick else (64, 128, 256)
    for dtype, sizes in gemm_sizes.items():
        for n in sizes:
            progress(f"GEMM {dtype} {n}³")
            a = rng.standard_normal((n, n)).astype(dtype)
            b = rng.standard_normal((n, n)).astype(dtype)
            results.append(
                _measure(
                    "gemm",
                    dtype,
                    f"{n}³",
                    1,
                    functools.partial(np.matmul, a, b),
                    work=2 * n**3 / 1e9,
                    unit="GFLOP/s",
                    repeats=repeats,
                    budget_s=budget_s,
                )
            )

    channels, side, filters_out = 16, 32, 32
    for batch in (8,) if options.quick else (1, 8):
        progress(f"conv2d batch {batch}")
        images = rng.standard_normal((batch, channels, side, side)).astype(np.float32)
        filters = rng.standard_normal((filters_out, channels, 3, 3)).astype(np.float32)
        results.append(
            _measure(
                "conv2d",
                "float32",
                f"{channels}×{side}² → {filters_out}, 3×3",
                batch,
                functools.partial(_conv2d_im2col, images, filters),
                work=2 * batch * side * side * channels * 9 * filters_out / 1e9,
                unit="GFLOP/s",
                repeats=repeats,
                budget_s=budget_s,
            )
        )

    for batch in (2,) if options.quick else (1, 4):
        shape = _LayerShape(batch=batch, seq=64, d_model=128, heads=4, d_ff=512)
        progress(f"transformer layer batch {batch}")
        params = {
            name: (rng.standard_normal(dims) / math.sqrt(dims[0])).astype(np.float32)
            for name, dims in (
                ("w_qkv", (shape.d_model, 3 * shape.d_model)),
                ("w_o", (shape.d_model, shape.d_model)),
                ("w_1", (shape.d_model, shape.d_ff)),
                ("w_2", (shape.d_ff, shape.d_model)),
            )
        }
        x = rng.standard_normal((batch, shape.seq, shape.d_model)).astype(np.float32)
        grad = rng.standard_normal(x.shape).astype(np.float32)
        results.append(
            _measure(
                "transformer_layer",
                "float32",
                shape.text(),
                batch,
                functools.partial(_transformer_layer_step, x, params, grad, shape),
                work=shape.matmul_gflop(),
                unit="GFLOP/s",
                repeats=repeats,
                budget_s=budget_s,
            )
        )

    size_bytes = (32 if options.quick else 256) * 2**20
    progress(f"memory copy {size_bytes // 2**20} MiB")
    source = np.ones(size_bytes // 8)
    target = np.zeros_like(source)  # written once here, so the timed copies do not fault pages in
    results.append(
        _measure(
            "memory_copy",
            "float64",
            f"{size_bytes // 2**20} MiB",
            1,
            lambda: np.copyto(target, source),
            work=2 * size_bytes / 1e9,
            unit="GB/s",
            repeats=max(MIN_REPEATS, repeats // 2),
            budget_s=budget_s,
        )
    )
    return results


# ---- torch kernels (GPU) --------------------------------------------------------------------------


def _torch_cuda() -> Any | None:
    """The ``torch`` module when it is installed and sees a CUDA device; None otherwise."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken CUDA install is the same as none
        return None


def _torch_kernels(torch: Any, options: CalibrationOptions, progress: Progress) -> list[KernelResult]:
    """The same benchmark set on GPU 0 (untested here: PyTorch is not installed in development)."""
    device = torch.device("cuda:0")
    repeats = options.repeats or (5 if options.quick else 20)
    budget_s = 0.1 if options.quick else 0.5
    torch.manual_seed(options.seed)
    sync = torch.cuda.synchronize
    torch.backends.cuda.matmul.allow_tf32 = False  # FP32 means FP32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    results: list[KernelResult] = []
    dtypes = {"float32": torch.float32, "float16": torch.float16}

    def gemm(name: str, dtype: Any, n: int) -> KernelResult:
        progress(f"GEMM {name} {n}³")
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        return _measure(
            "gemm",
            name,
            f"{n}³",
            1,
            functools.partial(torch.matmul, a, b),
            work=2 * n**3 / 1e9,
            unit="GFLOP/s",
            repeats=repeats,
            budget_s=budget_s,
            sync=sync,
        )

    for name, dtype in dtypes.items():
        for n in (1024, 4096) if options.quick else (1024, 4096, 8192):
            results.append(gemm(name, dtype, n))

    # FP32 matrix math as frameworks run FP32 training by default: TF32 tensor cores where the
    # part has them (the profile's compute_tf32_tflops); then back to strict FP32.
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for n in (4096,) if options.quick else (4096, 8192):
            results.append(gemm("tf32", torch.float32, n))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False

    channels, side = 64, 56
    for batch in (32,) if options.quick else (8, 32, 128):
        progress(f"conv2d batch {batch}")
        images = torch.randn(batch, channels, side, side, device=device, dtype=torch.float16)
        filters = torch.randn(channels, channels, 3, 3, device=device, dtype=torch.float16)
        results.append(
            _measure(
                "conv2d",
                "float16",
                f"{channels}×{side}² → {channels}, 3×3",
                batch,
                functools.partial(torch.nn.functional.conv2d, images, filters, padding=1),
                work=2 * batch * side * side * channels * 9 * channels / 1e9,
                unit="GFLOP/s",
                repeats=repeats,
                budget_s=budget_s,
                sync=sync,
            )
        )

    for batch in (8,) if options.quick else (8, 32):
        shape = _LayerShape(batch=batch, seq=512, d_model=1024, heads=16, d_ff=4096)
        progress(f"transformer layer batch {batch}")
        layer = torch.nn.TransformerEncoderLayer(
            shape.d_model, shape.heads, shape.d_ff, dropout=0.0, batch_first=True
        ).to(device=device, dtype=torch.float16)
        x = torch.randn(
            batch, shape.seq, shape.d_model, device=device, dtype=torch.float16, requires_grad=True
        )

        def step(layer: Any = layer, x: Any = x) -> None:
            layer(x).float().sum().backward()

        results.append(
            _measure(
                "transformer_layer",
                "float16",
                shape.text(),
                batch,
                step,
                work=shape.matmul_gflop(),
                unit="GFLOP/s",
                repeats=repeats,
                budget_s=budget_s,
                sync=sync,
            )
        )

    size_bytes = (256 if options.quick else 1024) * 2**20
    progress(f"memory copy {size_bytes // 2**20} MiB")
    source = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    results.append(
        _measure(
            "memory_copy",
            "uint8",
            f"{size_bytes // 2**20} MiB",
            1,
            lambda: target.copy_(source),
            work=2 * size_bytes / 1e9,
            unit="GB/s",
            repeats=repeats,
            budget_s=budget_s,
            sync=sync,
        )
    )

    link_bytes = 256 * 2**20
    if torch.cuda.device_count() >= 2:
        progress("GPU 0 -> GPU 1 copy")
        peer = torch.empty(link_bytes, dtype=torch.uint8, device=torch.device("cuda:1"))
        local = torch.empty(link_bytes, dtype=torch.uint8, device=device)
        copy, shape_text = (lambda: peer.copy_(local)), "256 MiB, GPU 0 -> GPU 1"
    else:
        progress("host -> GPU copy")
        host = torch.empty(link_bytes, dtype=torch.uint8).pin_memory()
        local = torch.empty(link_bytes, dtype=torch.uint8, device=device)
        copy, shape_text = (lambda: local.copy_(host, non_blocking=True)), "256 MiB, pinned host -> GPU 0"
    # One direction is measured; profiles carry both directions' aggregate (as NVLink is quoted).
    results.append(
        _measure(
            "interconnect_copy",
            "uint8",
            shape_text,
            1,
            copy,
            work=link_bytes / 1e9,
            unit="GB/s",
            repeats=repeats,
            budget_s=budget_s,
            sync=sync,
        )
    )
    return results


# ---- profile ---------------------------------------------------------------------------------------


def _best(results: Sequence[KernelResult], kernel: str, dtype: str | None = None) -> KernelResult:
    candidates = [r for r in results if r.kernel == kernel and (dtype is None or r.dtype == dtype)]
    return max(candidates, key=lambda r: r.throughput)


def _model_name(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``H100-80GB-HBM3``: a valid GPU model string (≤ 32 safe characters)."""
    name = re.sub(r"^(NVIDIA|AMD|Tesla|GeForce|Quadro)\s+", "", device_name.strip(), flags=re.IGNORECASE)
    name = re.sub(r"^(Tesla|GeForce|Instinct)\s+", "", name, flags=re.IGNORECASE)
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "-", name).strip("-")
    return name[:32] or "unknown"


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # not POSIX: an unknown but positive size
        return 1.0


def _profile(
    backend: Backend, results: Sequence[KernelResult], model: str, memory_gib: float
) -> tuple[DeviceProfile, dict[str, str]]:
    fp32 = _best(results, "gemm", "float32")
    fp16 = _best(results, "gemm", "float16")
    tf32 = max(
        (r for r in results if r.kernel == "gemm" and r.dtype == "tf32"),
        key=lambda r: r.throughput,
        default=None,
    )
    copy = _best(results, "memory_copy")
    derivation = {
        "compute_fp32_tflops": f"best FP32 GEMM ({fp32.shape})",
        "compute_fp16_tflops": f"best FP16 GEMM ({fp16.shape})"
        + (", NumPy emulation: not hardware FP16" if backend == "numpy" else ""),
        "memory_bandwidth_gbps": f"memory copy ({copy.shape}), bytes read plus written",
        "memory_gib": "host RAM" if backend == "numpy" else "GPU 0 total memory",
        "network_gbps": f"not measured: {DEFAULT_NETWORK_GBPS:g} Gbit/s until the agent measures it",
        "compute_tf32_tflops": f"best FP32 GEMM with TF32 allowed ({tf32.shape})"
        if tf32 is not None
        else "no TF32 measurement (CPU): the FP32 GEMM rate",
    }
    if backend == "numpy":
        interconnect_gbps = copy.throughput * 8
        derivation["interconnect_gbps"] = (
            "memory copy: workers on one CPU node exchange through shared memory"
        )
    else:
        link = _best(results, "interconnect_copy")
        interconnect_gbps = link.throughput * 8 * 2
        derivation["interconnect_gbps"] = f"{link.shape}, one direction measured, doubled for the aggregate"
    profile = DeviceProfile(
        model=model,
        compute_fp32_tflops=max(fp32.throughput / 1e3, 1e-6),
        compute_fp16_tflops=max(fp16.throughput / 1e3, 1e-6),
        memory_bandwidth_gbps=max(copy.throughput * 8, 1e-6),
        memory_gib=max(memory_gib, 1e-6),
        interconnect_gbps=max(interconnect_gbps, 1e-6),
        network_gbps=DEFAULT_NETWORK_GBPS,
        # Below the FP32 rate means the part has no TF32 cores (and the rest is noise).
        compute_tf32_tflops=tf32.throughput / 1e3
        if tf32 is not None and tf32.throughput > fp32.throughput
        else None,
    )
    return profile, derivation


def calibrate(
    options: CalibrationOptions = CalibrationOptions(), progress: Progress | None = None
) -> CalibrationReport:
    """Run the benchmark set on the chosen device and derive its profile."""
    say = progress or (lambda _message: None)
    if options.model is not None:
        check_model(options.model)  # before minutes of measuring, not in the profile written after
    started = time.perf_counter()
    torch = None if options.device == "cpu" else _torch_cuda()
    if options.device == "cuda" and torch is None:
        raise CalibrationError("--device cuda needs PyTorch with a usable CUDA device; neither was found")
    if torch is not None:
        device_name = str(torch.cuda.get_device_name(0))
        results = _torch_kernels(torch, options, say)
        memory_gib = float(torch.cuda.get_device_properties(0).total_memory) / 2**30
        backend: Backend = "torch-cuda"
    else:
        device_name = f"CPU ({os.cpu_count() or 1} logical cores, NumPy {np.__version__})"
        results = _numpy_kernels(options, say)
        memory_gib = _host_memory_gib()
        backend = "numpy"
    model = options.model or (_model_name(device_name) if backend == "torch-cuda" else "CPU")
    profile, derivation = _profile(backend, results, model, memory_gib)
    return CalibrationReport(
        backend=backend,
        device_name=device_name,
        quick=options.quick,
        duration_s=round(time.perf_counter() - started, 3),
        kernels=results,
        profile=profile,
        derivation=derivation,
    )


def render_table(report: CalibrationReport) -> Table:
    """The kernels as a rich table (returned, not printed: the CLI owns the console)."""
    table = Table(title=f"{report.device_name}: {report.backend}, {report.duration_s:.1f} s")
    for col in ("kernel", "dtype", "shape", "batch", "throughput", "latency ms p50/p90/p99"):
        table.add_column(col, justify="left" if col in ("kernel", "dtype", "shape") else "right")
    for r in report.kernels:
        table.add_row(
            r.kernel,
            r.dtype.replace("float", "fp"),
            r.shape,
            str(r.batch_size),
            f"{r.throughput:,.1f} {r.throughput_unit}",
            f"{r.latency_p50_ms:.3g}/{r.latency_p90_ms:.3g}/{r.latency_p99_ms:.3g}",
        )
    return table

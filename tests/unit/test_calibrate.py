"""``loom calibrate``: the quick CPU run measures every kernel and yields a publishable profile.

No timing is asserted beyond "positive": the figures depend on the machine and its load.
"""

import importlib.util
import math
import re

import msgspec
import numpy as np
import pytest

from loom.model.scu import DIMENSIONS, DeviceProfile
from loom.runtime.calibrate import (
    CalibrationError,
    CalibrationOptions,
    CalibrationReport,
    _conv2d_im2col,
    _LayerShape,
    _model_name,
    _transformer_layer_step,
    calibrate,
    render_table,
)


@pytest.fixture(scope="module")
def report() -> CalibrationReport:
    messages: list[str] = []
    result = calibrate(CalibrationOptions(quick=True, device="cpu"), progress=messages.append)
    assert messages, "a run that takes a while reports progress"
    return result


def test_quick_run_measures_every_kernel_with_positive_figures(report: CalibrationReport) -> None:
    assert report.backend == "numpy" and report.quick
    assert {(r.kernel, r.dtype) for r in report.kernels} >= {
        ("gemm", "float32"),
        ("gemm", "float16"),
        ("conv2d", "float32"),
        ("transformer_layer", "float32"),
        ("memory_copy", "float64"),
    }
    for r in report.kernels:
        assert r.throughput > 0 and math.isfinite(r.throughput)
        assert 0 < r.latency_p50_ms <= r.latency_p90_ms <= r.latency_p99_ms
        assert r.repeats >= 3 and r.batch_size >= 1
        assert r.throughput_unit == ("GB/s" if r.kernel == "memory_copy" else "GFLOP/s")


def test_quick_run_yields_a_profile_that_decodes_as_the_wire_contract(report: CalibrationReport) -> None:
    profile = msgspec.json.decode(msgspec.json.encode(report.profile), type=DeviceProfile)
    assert profile.model == "CPU"
    assert all(v > 0 for v in profile.vector())
    assert set(report.derivation) == set(DIMENSIONS)
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=CalibrationReport)
    assert decoded == report
    assert render_table(report).row_count == len(report.kernels)


@pytest.mark.parametrize(
    ("device_name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("AMD Instinct MI300X", "MI300X"),
        ("???", "unknown"),
    ],
)
def test_gpu_names_become_valid_model_strings(device_name: str, model: str) -> None:
    assert _model_name(device_name) == model
    assert re.fullmatch(r"[A-Za-z0-9_.+-]{1,32}", model)


def test_asking_for_cuda_without_it_is_an_error() -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed here: whether CUDA is usable depends on the machine")
    with pytest.raises(CalibrationError):
        calibrate(CalibrationOptions(quick=True, device="cuda"))


def test_the_convolution_kernel_computes_a_convolution() -> None:
    rng = np.random.default_rng(1)
    images, filters = rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((4, 3, 3, 3))
    out = _conv2d_im2col(images, filters).reshape(2, 5, 5, 4)
    padded = np.pad(images, ((0, 0), (0, 0), (1, 1), (1, 1)))
    expected = np.einsum(
        "bchwij,ocij->bhwo",
        np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3)),
        filters,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-10)


def test_the_transformer_layer_backward_matches_numerical_gradients() -> None:
    shape = _LayerShape(batch=2, seq=5, d_model=8, heads=2, d_ff=12)
    rng = np.random.default_rng(2)
    params = {
        name: rng.standard_normal(dims)
        for name, dims in (("w_qkv", (8, 24)), ("w_o", (8, 8)), ("w_1", (8, 12)), ("w_2", (12, 8)))
    }
    x, grad_out = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))

    def loss() -> float:
        # y · grad_out, with y from the same forward pass (the step's backward seeds with grad_out).
        b, s, d, h = 2, 5, 8, 2
        q, k, v = (
            t.reshape(b, s, h, d // h).transpose(0, 2, 1, 3) for t in np.split(x @ params["w_qkv"], 3, -1)
        )
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // h)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        hidden = x + (p @ v).transpose(0, 2, 1, 3).reshape(b, s, d) @ params["w_o"]
        y = hidden + np.maximum(hidden @ params["w_1"], 0) @ params["w_2"]
        return float((y * grad_out).sum())

    grads = _transformer_layer_step(x, params, grad_out, shape)
    eps = 1e-6
    for name in ("w_qkv", "w_o", "w_1", "w_2", "x"):
        array = x if name == "x" else params[name]
        for _ in range(3):
            index = tuple(int(rng.integers(0, n)) for n in array.shape)
            saved = array[index]
            array[index] = saved + eps
            up = loss()
            array[index] = saved - eps
            down = loss()
            array[index] = saved
            assert grads[name][index] == pytest.approx((up - down) / (2 * eps), rel=1e-4, abs=1e-6)

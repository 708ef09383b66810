"""``loom calibrate --model``: a name that breaks the GPU model naming rule of the wire contract
(:data:`loom_proto.jobs.GpuModel`) is refused before anything is measured (exit 2), never written
into a profile that no agent could publish."""

import msgspec
import pytest

from loom.runtime.calibrate import CalibrationError, CalibrationOptions, calibrate, check_model
from loom_proto.jobs import GpuModel

BAD = ["H 100!", "", "A100\n", "x" * 33, "[bold]A100", "V100/16"]


def _no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("measured despite a bad --model")

    monkeypatch.setattr("loom.runtime.calibrate._numpy_kernels", refuse)
    monkeypatch.setattr("loom.runtime.calibrate._torch_kernels", refuse)


@pytest.mark.parametrize("model", BAD)
def test_a_model_name_the_wire_contract_refuses_is_refused_before_measuring(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(model, GpuModel)  # the rule it breaks is the contract's
    _no_measuring(monkeypatch)
    with pytest.raises(CalibrationError, match="is not a GPU model name: use 1-32 characters"):
        calibrate(CalibrationOptions(quick=True, device="cpu", model=model))


@pytest.mark.parametrize("model", ["H100-80GB", "A100", "V100M32", "RTX4090_custom.v2+x", "x" * 32])
def test_a_model_name_within_the_rule_is_kept_as_given(model: str) -> None:
    assert check_model(model) == model


def test_the_command_exits_2_naming_the_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom.cli.main import main

    _no_measuring(monkeypatch)
    rc = main(["calibrate", "--quick", "--device", "cpu", "--model", "H 100!", "--json"])
    out = capsys.readouterr()
    assert rc == 2
    assert out.out == ""
    message = " ".join(out.err.split())
    assert "--model 'H 100!' is not a GPU model name" in message
    assert "Traceback" not in out.err

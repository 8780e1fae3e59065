"""Environment captured with every golden, and differences listed in the report header."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import activation_guard as ag
from activation_guard.api.determinism import PrecisionFlags
from activation_guard.capture import env as envmod


@pytest.fixture(autouse=True)
def _restore_flags():
    flags = PrecisionFlags.capture()
    threads = torch.get_num_threads()
    yield
    flags.restore()
    torch.set_num_threads(threads)


@pytest.fixture
def golden(tmp_path: Path) -> tuple[nn.Module, torch.Tensor, Path]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    p = tmp_path / "g.h5"
    ag.record(model, x, path=p)
    return model, x, p


def test_numerics_flags_capture_what_the_issue_lists() -> None:
    f = envmod.numerics_flags()
    for key in ("cuda_matmul_allow_tf32", "cudnn_allow_tf32", "float32_matmul_precision", "deterministic_algorithms",
                "cudnn_benchmark", "cudnn_deterministic", "default_dtype", "autocast_cpu", "autocast_cuda",
                "num_threads"):
        assert key in f
    assert f["default_dtype"] == "float32" and f["num_threads"] == torch.get_num_threads()
    json.dumps(f)  # stored in the golden's meta JSON
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert envmod.numerics_flags()["autocast_cpu"] is True


def test_golden_meta_has_device_versions_and_flags(golden) -> None:
    _, _, p = golden
    with ag.read_golden(p) as r:
        meta = r.meta
    assert (meta["device"]["device"] == "cpu" and meta["device"]["device_type"] == "cpu"
            and "device_name" in meta["device"])
    assert meta["versions"]["torch"] == torch.__version__
    assert "cuda" in meta["versions"]  # None on CPU-only builds
    assert meta["numerics"]["cuda_matmul_allow_tf32"] is False


def test_tf32_switched_on_is_named_in_the_report_header(golden) -> None:
    model, x, p = golden
    torch.backends.cuda.matmul.allow_tf32 = True
    report = ag.compare(model, x, path=p)
    assert report.ok  # on CPU the flag changes nothing numerically, but it is recorded
    assert any("live run has TF32 matmuls on, golden had them off" in c for c in report.env_changes)
    with torch.no_grad():
        model[0].bias.add_(1.0)
    text = str(ag.compare(model, x, path=p))  # a failure's header explains the environment first
    assert "NOTE environment differs from the recording" in text and "TF32 matmuls on" in text
    assert text.index("TF32 matmuls on") < text.index("  max abs diff  :")
    # the new-API mirror of the same switch is not listed a second time
    assert not any(c.startswith("fp32_precision") for c in report.env_changes)


def test_new_api_precision_change_is_reported(golden) -> None:
    if not hasattr(torch.backends.mkldnn, "matmul"):
        pytest.skip("torch without per-backend fp32_precision")
    model, x, p = golden
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    report = ag.compare(model, x, path=p)
    assert any(c.startswith("fp32_precision.mkldnn.matmul: golden 'none', live 'bf16'") for c in report.env_changes)


def test_numerics_flags_survive_mixed_tf32_apis() -> None:
    """After a program mixes the legacy and new TF32 APIs torch refuses to read the legacy
    flags; recording a golden must not crash on that."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch without per-backend fp32_precision")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    f = envmod.numerics_flags()
    assert f["fp32_precision.cuda.matmul"] == "ieee" and f["fp32_precision.cudnn.conv"] == "ieee"
    json.dumps(f)


def test_other_flag_changes_are_explained(golden) -> None:
    model, x, p = golden
    torch.set_num_threads(max(1, torch.get_num_threads() % 2 + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = ag.compare(model, x, path=p, allow_dtype_change=True)
    changes = "\n".join(report.env_changes)
    assert "live run has CPU autocast (mixed precision) on, golden had it off" in changes
    assert "reduction order" in changes


def test_describe_env_change_edge_cases() -> None:
    live = envmod.numerics_flags()
    assert envmod.describe_env_change(None, live) == []
    assert envmod.describe_env_change({"unknown_flag": 1}, live) == []  # old goldens: only shared keys
    assert envmod.describe_env_change(dict(live), live) == []
    old = dict(live, cudnn_allow_tf32=None)  # a flag torch refused to read when recording
    msgs = envmod.describe_env_change(old, live)
    assert msgs == [f"cudnn_allow_tf32: golden None, live {live['cudnn_allow_tf32']!r}"]
    msgs = envmod.describe_env_change(dict(live, float32_matmul_precision="high"),
                                      dict(live, float32_matmul_precision="highest"))
    assert msgs == ["float32_matmul_precision: golden 'high', live 'highest' "
                    "(live float32 matmuls may use full float32, golden used TF32 (or bf16x3))"]


def test_cuda_device_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA device logic, unit-tested on CPU: name, compute capability, CUDA and cuDNN."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    info = envmod.device_info(torch.device("cuda:0"))
    assert info == {"device": "cuda:0", "device_type": "cuda", "device_name": "NVIDIA H200",
                    "cuda": "12.8", "cudnn": 91002, "capability": "sm_90"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: (_ for _ in ()).throw(RuntimeError("no driver")))
    assert envmod.device_info(torch.device("cuda:0"))["device_name"] == "unknown"


def test_describe_device_change() -> None:
    h100 = {"device": "cuda:0", "device_type": "cuda", "device_name": "NVIDIA H100", "cuda": "12.4", "cudnn": 90100,
            "capability": "sm_90"}
    a100 = dict(h100, device_name="NVIDIA A100", cudnn=8900, capability="sm_80")
    msgs = envmod.describe_device_change(a100, h100)
    assert msgs == ["device name: golden NVIDIA A100, live NVIDIA H100", "compute capability: golden sm_80, live sm_90",
                    "cuDNN: golden 8900, live 90100"]
    cpu = {"device": "cpu", "device_type": "cpu", "device_name": "x86_64"}
    assert envmod.describe_device_change(cpu, h100) == ["device: golden cpu (x86_64), live cuda:0 (NVIDIA H100)"]
    assert envmod.describe_device_change(None, cpu) == []
    assert envmod.describe_device_change({"device_type": "cpu"}, cpu) == []  # unknown fields are not differences


def test_device_change_is_in_the_report(golden, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, p = golden
    real = envmod.device_info
    monkeypatch.setattr(envmod, "device_info", lambda d: dict(real(d), device_name="some-other-cpu"))
    report = ag.compare(model, x, path=p)
    assert any(c.startswith("device name: golden ") and c.endswith(", live some-other-cpu") for c in report.env_changes)


def test_changed_inputs_are_named(golden) -> None:
    model, x, p = golden
    report = ag.compare(model, x + 1, path=p)
    assert report.input_changes == ["input args/0: same dtype and shape, different values"]
    assert "NOTE inputs differ from the recording" in str(report)

"""Calibrated tolerances: float64 noise floors, TF32 emulation, mixed precision.

The central claim, tested on CPU: a float32 golden checked against a run whose float32 matmuls
behave like TF32 fails with strict tolerances and passes with calibrated ones, while the same
TF32 run with a real injected bug fails at exactly the layer that has the bug.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import threading
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import build_cnn, cnn_input
from torch import nn

import activation_guard as ag
from activation_guard._core import devices, tf32
from activation_guard._core.errors import ActivationGuardError, GoldenFormatError
from activation_guard.calibration import calibrate as cal

# --------------------------------------------------------------------------- models


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class TinyTransformer(nn.Module):
    """Pre-norm residual MLP blocks: LayerNorm, GELU and Linear layers with distinct names.
    Outputs have 1024+ elements, so the float32 multiplier (2) is the one exercised."""

    def __init__(self, d: int = 32, depth: int = 3):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tiny_transformer() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer().eval()


def tiny_input() -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("calib") / "tiny.h5"
    ag.record(tiny_transformer(), tiny_input(), path=p, calibrate=True)
    return p


# --------------------------------------------------------------------------- TF32 emulation


@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_tf32_round_keeps_10_mantissa_bits_and_rounds_to_nearest(v: float) -> None:
    x = torch.tensor([v], dtype=torch.float32)
    r = tf32.tf32_round(x)
    assert r.dtype == torch.float32
    if math.isfinite(float(r)):
        assert int(r.view(torch.int32)) & 0x1FFF == 0
        assert abs(float(r) - v) <= max(2.0**-11 * abs(v), 2.0**-137)  # half a TF32 ulp (subnormal: absolute)
        assert torch.equal(tf32.tf32_round(r), r)  # idempotent


def test_tf32_round_leaves_non_float32_and_non_finite_alone() -> None:
    d = torch.tensor([1.0 + 2**-30], dtype=torch.float64)
    assert tf32.tf32_round(d) is d
    special = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float32)
    out = tf32.tf32_round(special)
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2])
    assert tf32.tf32_round(3) == 3


def test_emulate_tf32_changes_float32_matmuls_only() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64)
    exact = lin(x)
    with tf32.emulate_tf32():
        emulated = lin(x)
        emulated_mm = x @ lin.weight.T
        emulated64 = lin.double()(x.double())
    assert not torch.equal(exact, emulated)
    assert (exact - emulated).abs().max() < 1e-2
    assert torch.equal(emulated_mm + lin.bias, emulated) or (emulated_mm + lin.bias - emulated).abs().max() < 1e-5
    assert torch.equal(emulated64, lin(x.double()))  # float64 untouched


# --------------------------------------------------------------------------- record(calibrate=True)


def test_record_calibrate_stores_floors_for_every_float_output(golden: Path, tmp_path: Path) -> None:
    with ag.read_golden(golden) as r:
        rec = r.meta[cal.META_KEY]
        calls = [(c.name, c.call, leaf.path) for c in r.calls for leaf in c.leaves if leaf.kind == "tensor"]
    assert rec["version"] == cal.FORMAT_VERSION and rec["reference_dtype"] == "float64"
    assert rec["reference_device"] == "cpu"
    assert rec["rule"]["multiplier"] == cal.MULTIPLIER and rec["rule"]["abs_term"] == cal.ABS_TERM
    for name, call, path in calls:
        mx, rms = rec["floors"][name][str(call)][path]
        assert 0 < rms <= mx < 1e-5, (name, mx, rms)  # float32 vs float64: a few ulps
    table = cal.FloorTable.from_meta({cal.META_KEY: rec}, golden)
    assert len(table) == len(calls)
    # the golden's values are the same as without calibration (the shadow touches nothing)
    plain = tmp_path / "plain.h5"
    ag.record(tiny_transformer(), tiny_input(), path=plain)
    with ag.read_golden(plain) as a, ag.read_golden(golden) as b:
        assert cal.META_KEY not in a.meta
        for (ca, la, ta), (cb, lb, tb) in zip(a.iter_tensors(), b.iter_tensors()):
            assert (ca.name, la.path) == (cb.name, lb.path) and torch.equal(ta, tb)


def test_calibrated_golden_is_byte_reproducible(golden: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.h5"
    ag.record(tiny_transformer(), tiny_input(), path=again, calibrate=True)
    assert again.read_bytes() == golden.read_bytes()


def test_shadow_does_not_consume_the_models_random_numbers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4)).train()
    x = torch.randn(16, 8)
    torch.manual_seed(7)
    ag.record(model, x, path=tmp_path / "a.h5")
    after_plain = torch.rand(3)
    torch.manual_seed(7)
    ag.record(model, x, path=tmp_path / "b.h5", calibrate=True)
    assert torch.equal(torch.rand(3), after_plain)
    with ag.read_golden(tmp_path / "a.h5") as a, ag.read_golden(tmp_path / "b.h5") as b:
        for (_, _, ta), (_, _, tb) in zip(a.iter_tensors(), b.iter_tensors()):
            assert torch.equal(ta, tb)


# --------------------------------------------------------------------------- the must-show


def test_tf32_run_fails_strict_and_passes_calibrated(golden: Path) -> None:
    model, x = tiny_transformer(), tiny_input()
    with tf32.emulate_tf32():
        strict = ag.compare(model, x, path=golden)
        calibrated = ag.compare(model, x, path=golden, tolerance="calibrated")
    assert not strict.ok
    assert strict.first_divergence is not None and strict.first_divergence.name == "embed"
    assert sum(1 for layer in strict.layers if not layer.ok) >= 10  # strict flags nearly every layer
    assert calibrated.ok, str(calibrated)
    assert calibrated.mode == "calibrated"
    multiples = [layer.error_multiple for layer in calibrated.layers]
    assert all(m is not None and 0 < m <= 1 for m in multiples), multiples
    assert max(multiples) > 0.2  # the TF32 noise is real and measured, not ignored
    assert "x the calibrated allowance" in calibrated.headline()
    assert any("float64 reference on cpu" in n for n in calibrated.notes)


def test_identical_run_is_far_below_the_allowance(golden: Path) -> None:
    report = ag.compare(tiny_transformer(), tiny_input(), path=golden, tolerance="calibrated")
    assert report.ok
    assert max(layer.error_multiple or 0.0 for layer in report.layers) == 0.0


def _eps(m: TinyTransformer) -> None:
    m.blocks[1].norm.eps = 1e-3  # 1e-5 -> 1e-3


def _act(m: TinyTransformer) -> None:
    m.blocks[1].act = nn.SiLU()  # wrong activation


def _weight(m: TinyTransformer) -> None:
    with torch.no_grad():
        m.blocks[1].fc1.weight.mul_(1.01)  # 1% scaled weight


@pytest.mark.parametrize(("bug", "layer"), [(_eps, "blocks.1.norm"), (_act, "blocks.1.act"), (_weight, "blocks.1.fc1")])
def test_real_bug_in_a_tf32_run_fails_at_its_layer(golden: Path, bug, layer: str) -> None:
    model = tiny_transformer()
    bug(model)
    with tf32.emulate_tf32():
        report = ag.compare(model, tiny_input(), path=golden, tolerance="calibrated")
    fd = report.first_divergence
    assert fd is not None and fd.name == layer, str(report)
    assert fd.status == "diverged" and fd.error_multiple is not None and fd.error_multiple > 1
    before = [r for r in report.layers if r.position is not None and r.position < fd.position]
    assert before and all(r.ok for r in before)
    text = str(report)
    assert "x the calibrated noise floor (fails above 1)" in text and "x allowed" in text
    assert "noise floors golden" in (fd.detail or "")
    d = report.to_dict()
    row = next(x for x in d["layers"] if x["name"] == layer)
    assert row["error_multiple"] == pytest.approx(fd.error_multiple)
    json.dumps(d)


def test_fail_fast_stops_at_the_bug(golden: Path) -> None:
    model = tiny_transformer()
    _weight(model)
    report = ag.compare(model, tiny_input(), path=golden, tolerance="calibrated", fail_fast=True)
    assert report.stopped_early and report.first_divergence.name == "blocks.1.fc1"


def test_cnn_tf32_passes_calibrated_and_a_scaled_conv_fails_there(tmp_path: Path) -> None:
    p = tmp_path / "cnn.h5"
    model, x = build_cnn(), cnn_input()
    ag.record(model, x, path=p, calibrate=True)
    with tf32.emulate_tf32():
        assert not ag.compare(model, x, path=p).ok
        assert ag.compare(model, x, path=p, tolerance="calibrated").ok
        bad = copy.deepcopy(model)
        with torch.no_grad():
            bad.conv2.weight.mul_(1.01)
        report = ag.compare(bad, x, path=p, tolerance="calibrated")
    assert report.first_divergence is not None and report.first_divergence.name == "conv2"


def test_compare_models_calibrated(tmp_path: Path) -> None:
    ref, x = tiny_transformer(), tiny_input()
    with tf32.emulate_tf32():
        assert ag.compare_models(ref, copy.deepcopy(ref), x, tolerance="calibrated").ok
        cand = copy.deepcopy(ref)
        _act(cand)
        report = ag.compare_models(ref, cand, x, tolerance="calibrated")
    assert report.first_divergence is not None and report.first_divergence.name == "blocks.1.act"


@pytest.mark.parametrize("replay", ["first", "all"])
def test_a_training_batchnorm_cnn_with_gradients_and_replays_calibrated(tmp_path: Path, replay: str) -> None:
    """The calibrated battery's training-mode CNN: gradients recorded, the replays (live and
    float64) run before the backward that needs the batch norms' saved running statistics, which
    raised autograd's RuntimeError on the unchanged model."""
    p = tmp_path / "cnn.h5"
    x = cnn_input()
    ag.record(build_cnn().train(), x, path=p, calibrate=True, backward=True)
    for tf32_run in (False, True):
        live, plain = build_cnn().train(), build_cnn().train()
        with tf32.emulate_tf32() if tf32_run else contextlib.nullcontext():
            plain(*x)
            report = ag.compare(live, x, path=p, tolerance="calibrated", replay=replay)
        assert report.ok and report.grad_count > 0, str(report)
        after, want = live.state_dict(), plain.state_dict()
        assert [k for k, v in want.items() if not torch.equal(after[k], v)] == []  # statistics updated once
        assert live.training and all(q.grad is None for q in live.parameters())
    bad = build_cnn().train()
    with torch.no_grad():
        bad.bn2.weight.mul_(1.01)
    with tf32.emulate_tf32():
        report = ag.compare(bad, x, path=p, tolerance="calibrated", replay=replay)
    assert report.first_divergence is not None and report.first_divergence.name == "bn2"
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "bn2")


# --------------------------------------------------------------------------- errors and edge cases


def test_calibrated_needs_a_calibrated_golden(tmp_path: Path) -> None:
    p = tmp_path / "plain.h5"
    ag.record(tiny_transformer(), tiny_input(), path=p)
    with pytest.raises(ag.UncalibratedGoldenError) as ei:
        ag.compare(tiny_transformer(), tiny_input(), path=p, tolerance="calibrated")
    assert isinstance(ei.value, GoldenFormatError)
    msg = str(ei.value)
    assert str(p) in msg and "calibrate=True" in msg and "--ag-" not in msg


def test_unknown_tolerance_mode_is_refused(golden: Path) -> None:
    with pytest.raises(ValueError, match=r"tolerance='loose' .*must be 'strict' or 'calibrated'"):
        ag.compare(tiny_transformer(), tiny_input(), path=golden, tolerance="loose")


@pytest.mark.parametrize("rec", [
    {"version": 1},
    {"version": "1", "floors": {}},
    {"version": 1, "floors": {"a": {"x": {"": [1.0, 1.0]}}}},
    {"version": 1, "floors": {"a": {"0": {"": [1.0]}}}},
    {"version": 1, "floors": {"a": {"0": {"": [-1.0, 1.0]}}}},
    {"version": 1, "floors": {"a": {"0": {"": [True, 1.0]}}}},
    [1, 2],
])
def test_malformed_floor_records_are_refused(rec: object) -> None:
    with pytest.raises(GoldenFormatError, match="malformed 'calibration'"):
        cal.FloorTable.from_meta({cal.META_KEY: rec}, "g.h5")


def test_newer_floor_format_is_refused() -> None:
    with pytest.raises(GoldenFormatError, match="newer"):
        cal.FloorTable.from_meta({cal.META_KEY: {"version": 99, "floors": {}}}, "g.h5")


@given(st.dictionaries(
    st.text(max_size=6),
    st.dictionaries(st.integers(0, 5), st.dictionaries(st.text(max_size=4), st.one_of(
        st.none(), st.tuples(st.floats(0, 1e30), st.floats(0, 1e30))), max_size=3), max_size=3),
    max_size=4))
def test_floor_table_round_trips_through_json(data: dict) -> None:
    t = cal.FloorTable()
    for name, calls in data.items():
        for call, paths in calls.items():
            for path, v in paths.items():
                t.add(name, call, path, None if v is None else cal.NoiseFloor(*v))
    back = cal.FloorTable.from_meta(json.loads(json.dumps({cal.META_KEY: t.to_meta()})), "g.h5")
    assert back.floors == t.floors


class MaskFill(nn.Module):
    """Fills masked positions with the dtype's most negative value, as attention masks do: the
    float64 shadow uses another value, so this output has no finite noise floor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y.masked_fill(y < 0, torch.finfo(y.dtype).min)


def test_outputs_without_a_floor_fall_back_to_strict_and_say_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = MaskFill().eval(), torch.randn(4, 8)
    p = tmp_path / "mask.h5"
    ag.record(model, x, path=p, calibrate=True)
    with ag.read_golden(p) as r:
        assert r.meta[cal.META_KEY]["floors"][""]["0"][""] is None
    report = ag.compare(model, x, path=p, tolerance="calibrated")
    assert report.ok
    root = next(layer for layer in report.layers if layer.name == "")
    assert root.error_multiple is None and root.tolerance_source == "float32 default; strict: no noise floor"
    assert any("used strict tolerances" in n and "<root>[0]" in n for n in report.notes)


class ArgmaxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(self.emb(ids))
        return {"logits": logits, "label": logits.argmax(-1)}


def test_integer_inputs_and_outputs_stay_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, ids = ArgmaxHead().eval(), torch.randint(0, 10, (3, 4))
    p = tmp_path / "argmax.h5"
    ag.record(model, ids, path=p, calibrate=True)
    report = ag.compare(model, ids, path=p, tolerance="calibrated")
    assert report.ok
    root = next(layer for layer in report.layers if layer.name == "")
    leaves = {leaf.path: leaf for leaf in root.leaves}
    assert leaves["label"].error_multiple is None and leaves["logits"].error_multiple is not None


def test_shadow_leaves_the_live_model_alone(golden: Path) -> None:
    model = tiny_transformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ag.compare(model, tiny_input(), path=golden, tolerance="calibrated")
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert not model.training


class Float32Only(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError("this kernel only supports float32")
        return self.fc(x)


def test_models_that_cannot_run_in_float64_get_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ActivationGuardError,
                       match=r"float64 shadow forward .* failed .*only supports float32.*while the model runs as it "
                             r"is.*calibrate=False.*tolerance='strict'"):
        ag.record(Float32Only(), torch.randn(2, 4), path=tmp_path / "f.h5", calibrate=True)
    assert not (tmp_path / "f.h5").exists()


class Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_models_that_cannot_be_copied_get_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ActivationGuardError, match=r"copy\.deepcopy\(Locked\) failed"):
        ag.record(Locked(), torch.randn(2, 4), path=tmp_path / "l.h5", calibrate=True)


# --------------------------------------------------------------------------- device logic


def test_reference_device_falls_back_to_cpu_without_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    assert devices.reference_device(None) == torch.device("cpu")
    assert devices.reference_device("cpu") == torch.device("cpu")
    assert devices.reference_device("mps") == torch.device("cpu")  # MPS has no float64

    def no_float64(*a, **kw):
        raise RuntimeError("float64 is not supported on this device")

    monkeypatch.setattr(devices, "_F64_SUPPORT", {})
    monkeypatch.setattr(torch, "ones", no_float64)
    assert not devices.supports_float64("xla:0")  # probed, and the probe failed
    assert devices.reference_device("xla:0") == torch.device("cpu")


def test_supports_float64_probes_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_ones = torch.ones

    def fake_ones(*a, **kw):
        calls.append(kw.get("device"))
        return real_ones(*a, dtype=kw.get("dtype"))

    monkeypatch.setattr(devices, "_F64_SUPPORT", {})
    monkeypatch.setattr(torch, "ones", fake_ones)
    assert devices.supports_float64("cuda:3") and devices.supports_float64("cuda:3")
    assert devices.reference_device("cuda:3") == torch.device("cuda:3")
    assert len(calls) == 1


def test_transfer_plan() -> None:
    cpu, gpu, gpu1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert devices.transfer_plan(cpu, cpu) == "same"
    assert devices.transfer_plan(cpu, gpu) == "pinned"  # page-locked buffer, non-blocking copy
    assert devices.transfer_plan(gpu, cpu) == "plain"
    assert devices.transfer_plan(gpu, gpu1) == "plain"
    t = torch.ones(3)
    assert devices.to_device(t, cpu) is t


def test_diff_stats_values_and_non_finite_handling() -> None:
    a = torch.tensor([1.0, 2.0, math.nan, math.inf, 5.0])
    b = torch.tensor([1.0, 2.5, math.nan, math.inf, 4.0], dtype=torch.float64)
    f = cal.diff_stats(a, b)
    assert f.max_abs == 1.0 and f.rms == pytest.approx(math.sqrt((0.25 + 1.0) / 5))
    assert not cal.diff_stats(torch.tensor([math.nan]), torch.tensor([1.0])).finite
    assert cal.diff_stats(torch.empty(0), torch.empty(0)) == cal.NoiseFloor(0.0, 0.0)
    big = torch.arange(cal.CHUNK + 10, dtype=torch.float32)
    assert cal.diff_stats(big, big.double() + 0.5).rms == pytest.approx(0.5)


def test_multiplier_constants() -> None:
    assert cal.multiplier("float32", 10_000) == 2.0
    assert cal.multiplier("float32", 999) == 3.0  # small tensors: noisier RMS
    assert cal.multiplier("bfloat16", 10_000) == 3.0 and cal.multiplier("float16", 10_000) == 3.0


# --------------------------------------------------------------------------- mixed precision


def _one_layer() -> tuple[nn.Module, torch.Tensor]:
    """Weights and inputs that half types represent exactly: the only difference a bf16/fp16 run
    makes is rounding its outputs, which is what assert_close's half-type tolerances allow. (On
    general weights, fp32-vs-half differences include input and weight rounding and exceed those
    tolerances even for one layer: that is what ``tolerance="calibrated"`` is for.)"""
    model = nn.Sequential(nn.Linear(4, 3)).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8 - 0.625)
        model[0].bias.copy_(torch.tensor([0.25, -0.5, 0.75]))
    return model, torch.tensor([[0.5, -1.0, 2.0, 1.5], [1.0, 0.25, -0.5, 2.0]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_run_against_float32_golden(tmp_path: Path, dtype: torch.dtype) -> None:
    model, x = _one_layer()
    p = tmp_path / "g.h5"
    ag.record(model, x, path=p)
    half = copy.deepcopy(model).to(dtype)
    refused = ag.compare(half, x.to(dtype), path=p)
    assert not refused.ok and refused.first_divergence.status == "dtype"
    report = ag.compare(half, x.to(dtype), path=p, allow_dtype_change=True)
    assert report.ok, str(report)
    layer = report.layers[0]
    name = str(dtype).replace("torch.", "")
    assert f"dtype float32 -> {name} allowed" in layer.detail
    assert name in layer.tolerance_source  # the lower precision's tolerance applies
    with torch.no_grad():
        half[0].weight.mul_(1.1)  # a real bug is still a failure
    assert ag.compare(half, x.to(dtype), path=p, allow_dtype_change=True).first_divergence.status == "diverged"


def test_autocast_run_against_float32_golden(tmp_path: Path) -> None:
    model, x = _one_layer()
    p = tmp_path / "g.h5"
    ag.record(model, x, path=p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not ag.compare(model, x, path=p).ok
        report = ag.compare(model, x, path=p, allow_dtype_change=True)
    assert report.ok
    assert report.layers[0].leaves[0].live_dtype == "bfloat16"
    assert any("CPU autocast" in c for c in report.env_changes)


def test_calibrated_mixed_precision_on_a_deep_model(golden: Path) -> None:
    """bf16 noise through five layers defeats fixed bf16 tolerances; calibrated floors absorb
    it, including the rounding of a cast model's weights, and a bug still fails at its layer."""
    x = tiny_input()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ag.compare(tiny_transformer(), x, path=golden, allow_dtype_change=True, tolerance="calibrated").ok
    cast = tiny_transformer().to(torch.bfloat16)
    assert not ag.compare(cast, x.bfloat16(), path=golden, allow_dtype_change=True).ok
    ok = ag.compare(cast, x.bfloat16(), path=golden, allow_dtype_change=True, tolerance="calibrated")
    assert ok.ok, str(ok)
    _act(cast)
    bad = ag.compare(cast, x.bfloat16(), path=golden, allow_dtype_change=True, tolerance="calibrated")
    assert bad.first_divergence is not None and bad.first_divergence.name == "blocks.1.act"


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bug in my model")


def test_a_models_own_error_keeps_its_type_under_calibration(tmp_path: Path) -> None:
    """The float64 copy runs first: its error once became 'the float64 shadow forward failed ...
    use tolerance=strict', for a model that fails in any dtype."""
    with pytest.raises(ValueError, match="bug in my model") as info:
        ag.record(Broken(), torch.randn(2, 4), path=tmp_path / "b.h5", calibrate=True)
    assert any("the model itself raises on these inputs too" in n for n in getattr(info.value, "__notes__", []))
    assert not (tmp_path / "b.h5").exists()


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_a_golden_recorded_in_half_precision_accepts_the_float32_model(tmp_path: Path, low: torch.dtype) -> None:
    """allow_dtype_change works both ways: a golden stored in bf16/fp16 holds rounded values, so the
    float32 model's exact embedding lookup (no arithmetic noise on either side) once failed at
    hundreds of times the allowance."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8)).eval()
    ids = torch.randint(0, 50, (4, 12))
    p = tmp_path / "half.h5"
    ag.record(copy.deepcopy(model).to(low), ids, path=p, calibrate=True)
    report = ag.compare(model, ids, path=p, tolerance="calibrated", allow_dtype_change=True)
    assert report.ok, str(report)
    with torch.no_grad():
        model[1].weight.mul_(1.2)  # a change far above half-precision rounding is still found
    bad = ag.compare(model, ids, path=p, tolerance="calibrated", allow_dtype_change=True)
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.name == "1"


class Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = torch.fft.rfft(self.fc(x))
        return spec, spec.abs()


def test_a_complex_output_is_scaled_by_its_magnitude_without_a_warning() -> None:
    """Imaginary values have a real part of 0: read as their real part (a cast that also warned),
    their scale was 0, and a floor as large as the values themselves passed as rounding."""
    from activation_guard.store.floors import NoiseFloor

    z = torch.complex(torch.zeros(64), torch.linspace(1.0, 2.0, 64))
    huge = NoiseFloor(max_abs=1.0, rms=0.8)
    tiny = NoiseFloor(max_abs=1e-7, rms=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cal.implausible_floor(z, huge, huge, "complex64") is not None
        assert cal.implausible_floor(z, tiny, tiny, "complex64") is None
        rms = float(z.abs().square().mean().sqrt()) * math.sqrt(2)  # |(1 + 1j) z| = sqrt(2) |z|
        assert f"of the values' RMS {rms:.2e}" in (cal.implausible_floor(z * (1 + 1j), huge, huge, "complex64") or "")


def test_complex_outputs_are_calibrated_too(tmp_path: Path) -> None:
    """A complex output was judged strictly (with no note) under calibration: TF32 noise in the
    Linear before an FFT failed it at 100% of its elements."""
    from activation_guard import emulate_tf32

    torch.manual_seed(0)
    model, x = Spectral().eval(), torch.randn(16, 32)
    p = tmp_path / "c.h5"
    ag.record(model, x, path=p, calibrate=True)
    with emulate_tf32():
        noisy = ag.compare(model, x, path=p, tolerance="calibrated")
    assert noisy.ok, str(noisy)
    leaf = next(r for r in noisy.layers if r.name == "").leaves[0]
    assert leaf.dtype == "complex64" and leaf.error_multiple is not None and 0 < leaf.error_multiple <= 1
    with torch.no_grad():
        model.fc.weight[3].mul_(1.01)
    bad = ag.compare(model, x, path=p, tolerance="calibrated")
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.name == "fc"


@pytest.mark.parametrize("op", ["linalg.matmul", "tensordot", "inner", "multi_dot", "chain_matmul", "addmm_",
                                "addbmm", "Tensor.addbmm"])
def test_emulate_tf32_rounds_every_matmul_family_function(op: str) -> None:
    """Each once ran in full float32 under emulation: a model using it looked quieter than on a
    real TF32 GPU. The emulated result equals the float32 one on pre-rounded operands."""
    torch.manual_seed(0)
    a, b, c = torch.randn(16, 32), torch.randn(32, 32), torch.randn(32, 8)
    ops = {
        "linalg.matmul": lambda a, b, c: torch.linalg.matmul(a, b),
        "tensordot": lambda a, b, c: torch.tensordot(a, b, dims=1),
        "inner": lambda a, b, c: torch.inner(a, b),
        "multi_dot": lambda a, b, c: torch.linalg.multi_dot([a, b, c]),
        "chain_matmul": lambda a, b, c: torch.chain_matmul(a, b, c),
        "addmm_": lambda a, b, c: torch.zeros(16, 32).addmm_(a, b),
        "addbmm": lambda a, b, c: torch.addbmm(torch.zeros(16, 32), a[None], b[None]),
        "Tensor.addbmm": lambda a, b, c: torch.zeros(16, 32).addbmm(a[None], b[None]),
    }
    f = ops[op]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # chain_matmul is deprecated
        with tf32.emulate_tf32():
            emulated = f(a, b, c)
        exact = f(a, b, c)
        rounded = f(*(tf32.tf32_round(t) for t in (a, b, c)))
    assert not torch.equal(emulated, exact)
    assert torch.allclose(emulated, rounded, rtol=1e-5, atol=1e-5)


class _Noise(nn.Module):
    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return x + torch.randn(x.shape, generator=generator, dtype=x.dtype)


class _ProbMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.empty_like(x).bernoulli_(torch.full_like(x, 0.5)) * 2


class _DtypeBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 if x.dtype == torch.float32 else 1.1)


class _Around(nn.Module):
    """a -> mid -> b: ``mid`` is where the float64 reference run could go its own way."""

    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.mid, self.b = nn.Linear(16, 16), mid, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        h = self.a(x)
        h = self.mid(h, generator=generator) if isinstance(self.mid, _Noise) else self.mid(h)
        return self.b(h)


@pytest.mark.parametrize("mid", ["generator", "bernoulli_", "dtype branch"])
def test_a_float64_reference_that_computes_something_else_never_widens_the_verdict(tmp_path: Path, mid: str) -> None:
    """Found by review, each a 10% weight change passing under calibrated tolerances: the float64
    reference run shared a torch.Generator passed to the forward (and advanced it: the calibrated
    record then recorded other values), drew x.bernoulli_(probs) in float64 (another mask), or
    branched on the dtype. Generators are now copied with their state for the reference run,
    bernoulli_ is drawn in float32, and a leaf whose float64 copy computes another function is
    found and its own result stands in for the reference."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    module = {"generator": _Noise, "bernoulli_": _ProbMask, "dtype branch": _DtypeBranch}[mid]()
    m = _Around(module).train(mid == "bernoulli_")
    kw = (lambda: {"generator": torch.Generator().manual_seed(42)}) if mid == "generator" else (lambda: {})
    p = tmp_path / "g.h5"
    torch.manual_seed(5)
    ag.record(m, (x,), kw(), path=p, calibrate=True)
    torch.manual_seed(5)
    assert ag.compare(m, (x,), kw(), path=p).ok  # strict: the calibrated record recorded what the model does
    torch.manual_seed(5)
    same = ag.compare(m, (x,), kw(), path=p, tolerance="calibrated")
    assert same.ok, same
    changed = copy.deepcopy(m)
    with torch.no_grad():
        changed.b.weight.mul_(1.10)
    torch.manual_seed(5)
    rep = ag.compare(changed, (x,), kw(), path=p, tolerance="calibrated")
    assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.name == "b", rep
    if mid == "dtype branch":  # the leaf that branches is found and its float32 result stands in
        differs = "float64 copy computes differently"
        assert any("'mid'[0]" in n and differs in n for n in rep.notes), rep.notes
        # a fingerprint golden holds the values' RMS exactly: the same check applies there
        fp, xb = tmp_path / "fp.h5", torch.randn(128, 16, generator=torch.Generator().manual_seed(2))
        ag.record(m, (xb,), path=fp, calibrate=True, fingerprint=True, inputs=False)
        with ag.read_golden(fp) as r:
            assert r.by_key[("b", 0)].leaves[0].kind == "fingerprint"
        assert ag.compare(m, (xb,), path=fp, tolerance="calibrated").ok
        frep = ag.compare(changed, (xb,), path=fp, tolerance="calibrated")
        assert not frep.ok and frep.first_divergence is not None and frep.first_divergence.name == "b", frep
        assert any("'mid'[0]" in n and differs in n for n in frep.notes), frep.notes


# --------------------------------------------------------------------------- one decision


class _FixedShadow:
    """A live shadow that gives every output the same floor (or none)."""

    device = "cpu"

    def __init__(self, floor: cal.NoiseFloor | None):
        self._floor = floor
        self.differs: list[tuple[str, int, float]] = []

    def floor(self, name: str, call: int, path: str, value: torch.Tensor) -> cal.NoiseFloor | None:
        return self._floor

    def close(self) -> None:
        pass


def _rule(source: str) -> str:
    """Which rule a tolerance source says judged, and why when strict."""
    if "; strict: " in source:
        return "strict: " + source.split("; strict: ", 1)[1]
    return "calibrated" if source.startswith("calibrated") else "strict"


@pytest.mark.parametrize("pattern", [False, True])
@pytest.mark.parametrize("golden_floor", [None, "rounding", "implausible"])
@pytest.mark.parametrize("live_floor", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_every_calibrated_path_decides_alike(pattern: bool, golden_floor: str | None, live_floor: bool,
                                             dtype: str) -> None:
    """Full values, fingerprints, replays against their own floors and a replayed child's inputs
    meet the same decision: which rule judges, why, and what the notes count."""
    from activation_guard.calibration.ownfloor import OwnFloorJudge, judge_input
    from activation_guard.comparison.fingerprints import FingerprintJudge
    from activation_guard.fingerprints.fingerprint import compute_fingerprint
    from activation_guard.judges.strict import LeafContext, StrictJudge
    from activation_guard.options.spec import CompareSpec
    from activation_guard.options.tolerances import ToleranceResolver

    gen = torch.Generator().manual_seed(0)
    g = torch.randn(2048, generator=gen)
    live = g + 1e-6 * torch.randn(2048, generator=gen)
    if dtype == "int64":
        g, live = (g * 100).long(), (g * 100).long()
    floors = {None: None, "rounding": cal.NoiseFloor(1e-7, 1e-7), "implausible": cal.NoiseFloor(0.5, 0.5)}
    gf = floors[golden_floor]
    lf = cal.NoiseFloor(2e-7, 1e-7) if live_floor else None
    spec = CompareSpec.build({"tolerances": {"lay": {"rtol": 1e-3, "atol": 1e-3}}} if pattern else {})

    def judge() -> cal.CalibratedJudge:
        table = cal.FloorTable()
        table.add("lay", 0, "", gf)
        return cal.CalibratedJudge(table, _FixedShadow(lf), StrictJudge(ToleranceResolver(spec)))  # type: ignore[arg-type]

    ctx = LeafContext("lay", "lay", 0, "", dtype, dtype)
    own_ref = (live.double() + 1e-7) if live_floor else None  # the replay's own float64 reference
    seen: dict[str, tuple[str, int, dict[str, int], int]] = {}
    j = judge()
    seen["full"] = (_rule(j.judge(ctx, g, live).tolerance_source), j.judged, dict(j.explicit), len(j.fallbacks))
    j = judge()
    res = OwnFloorJudge(j, {} if own_ref is None else {"": own_ref}).judge(ctx, g, live)
    seen["replay"] = (_rule(res.tolerance_source), j.judged, dict(j.explicit), len(j.fallbacks))
    if dtype == "float32":
        j = judge()
        res = FingerprintJudge(j.strict, j).judge(ctx, compute_fingerprint(g), live)
        seen["fingerprint"] = (_rule(res.tolerance_source), j.judged, dict(j.explicit), len(j.fallbacks))
    full = seen["full"]
    assert all(v == full for v in seen.values()), seen
    if dtype == "int64":  # exactly, under every rule
        assert full == ("strict", 0, {}, 0)
    elif pattern:
        assert full[0] == "strict: a tolerances pattern overrides calibration" and full[2] == {"lay": 1}
    elif golden_floor == "rounding" and live_floor:
        assert full == ("calibrated", 1, {}, 0)
    else:
        assert full[0] in ("strict: no noise floor", "strict: implausible noise floor") and full[3] == 1
    # a replayed child's input that is a stored output: the same decision, never counted in the notes
    if gf is None:  # not a stored output: its golden's rounding is taken equal to the live one's
        return
    j = judge()
    res = judge_input(j.strict, j, ctx, g, live, own_ref, gf)
    assert _rule(res.tolerance_source) == full[0] and (j.judged, j.explicit, j.fallbacks) == (0, {}, [])

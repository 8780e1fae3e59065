"""Quantized and compressed models: error metrics, the SQNR gate, sensitivity ranked by own error,
keep-in-float advice checked in closed loop (tiny BERT and Llama from configs, torchao int8)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import activation_guard as ag
from activation_guard._core.metrics import Energy
from activation_guard.cli import main as cli_main
from activation_guard.judges.metrics import energy_of
from activation_guard.report.sensitivity import SensitivityReport
from activation_guard.report.visual import plot_available

# ----------------------------------------------------------------------------- metrics


def _sums(g: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    g, x = g.double(), x.double()
    return float((g * g).sum()), float(((x - g) ** 2).sum())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=40), st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=40),
       st.floats(1e-3, 1e3), st.integers(1, 39))
def test_each_metric_follows_its_one_formula_and_pools_like_one_value(ref: list[float], noise: list[float],
                                                                    scale: float, cut: int) -> None:
    n = min(len(ref), len(noise))
    g = torch.tensor(ref[:n], dtype=torch.float32)
    x = g + torch.tensor(noise[:n], dtype=torch.float32)
    e = energy_of(g, x)
    gg, dd = _sums(g, x)
    assert e.n == n and math.isclose(e.gg, gg, rel_tol=1e-12, abs_tol=1e-300)
    assert math.isclose(e.dd, dd, rel_tol=1e-12, abs_tol=1e-300)
    if dd == 0:
        assert e.sqnr_db() == math.inf and e.rel_l2() == 0.0 and e.mse() == 0.0
    elif gg == 0:
        assert e.sqnr_db() == -math.inf and e.rel_l2() == math.inf
    else:
        assert math.isclose(e.sqnr_db(), 10 * math.log10(gg / dd), rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(e.rel_l2(), math.sqrt(dd / gg), rel_tol=1e-9)
        assert math.isclose(e.mse(), dd / n, rel_tol=1e-9)
        # SQNR does not depend on the unit: both sides scaled alike keep it (float64 sums)
        e2 = energy_of(g.double() * scale, x.double() * scale)
        assert math.isclose(e2.sqnr_db(), e.sqnr_db(), rel_tol=1e-6, abs_tol=1e-6)
    assert -1.0 <= e.cosine() <= 1.0
    # two outputs of one call are measured as one value: their sums add up
    k = min(cut, n)
    pooled = energy_of(g[:k], x[:k]) + energy_of(g[k:], x[k:]) if k < n else e
    for a, b in ((pooled.gg, e.gg), (pooled.dd, e.dd), (pooled.gl, e.gl), (pooled.ll, e.ll)):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_zero_error_all_zero_reference_and_non_finite_values_have_stated_values() -> None:
    z = torch.zeros(4)
    assert energy_of(z, z).sqnr_db() == math.inf and energy_of(z, z).cosine() == 1.0
    one = torch.tensor([0.0, 0.0, 1.0, 0.0])
    assert energy_of(z, one).sqnr_db() == -math.inf and energy_of(z, one).rel_l2() == math.inf
    assert energy_of(z, one).cosine() == 0.0
    inf = torch.tensor([1.0, math.inf, math.nan, 2.0])
    assert energy_of(inf, inf.clone()).sqnr_db() == math.inf  # the same Inf and NaN: no error
    worse = torch.tensor([1.0, math.inf, 3.0, 2.0])  # a NaN became a number: an error without bound
    assert energy_of(inf, worse).sqnr_db() == -math.inf
    new_nan = torch.tensor([1.0, 2.0, 3.0, math.nan])
    assert energy_of(torch.tensor([1.0, 2.0, 3.0, 4.0]), new_nan).sqnr_db() == -math.inf
    assert Energy.from_dict(energy_of(inf, worse).to_dict()) == energy_of(inf, worse)


# ----------------------------------------------------------------------------- the SQNR gate without torchao


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))
        with torch.no_grad():
            for m in (self.a, self.b, self.c):
                m.weight.copy_(torch.randn(16, 16, generator=g) / 4)
                m.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def fake_quant(module: torch.nn.Linear, step: float) -> None:
    """Weights rounded to a grid of ``step``: a layer's own quantization error, no library needed."""
    with torch.no_grad():
        module.weight.copy_(torch.round(module.weight / step) * step)


@pytest.fixture(scope="module")
def chain_golden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[torch.Tensor]]:
    path = tmp_path_factory.mktemp("chain") / "float.h5"
    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),)
    ag.record(Chain(), x, path=path)
    return path, x


def test_min_sqnr_db_passes_fine_quantization_and_names_the_worsened_layer_with_its_own_error(
        chain_golden: tuple[Path, tuple[torch.Tensor]]) -> None:
    path, x = chain_golden
    fine = Chain()
    for m in (fine.a, fine.b, fine.c):
        fake_quant(m, 1e-3)
    gate = {"*": {"min_sqnr_db": 30}}
    assert ag.compare(fine, x, path=path, tolerances=gate).ok  # the same quantization as before: passes
    pr = copy.deepcopy(fine)
    fake_quant(pr.b, 0.2)  # one layer's quantization made coarser
    report = ag.compare(pr, x, path=path, tolerances=gate)
    assert not report.ok and report.first_divergence is not None and report.first_divergence.name == "b"
    fd = report.first_divergence
    assert fd.min_sqnr_db == 30 and fd.energy is not None and fd.energy.sqnr_db() < 30
    assert fd.own_energy is not None and fd.own_energy.sqnr_db() < 30  # its own error, replayed
    text = str(report)
    assert "SQNR" in text and "< min_sqnr_db 30 dB" in text
    assert "own sqnr" in text and "the layer loses the signal itself" in text
    assert report.origin is not None and (report.origin.name, report.origin.kind) == ("b", "layer")
    assert json.loads(json.dumps(report.to_dict()))["metric"] == "sqnr"


def test_a_layer_under_its_threshold_by_inheritance_is_told_apart_from_its_own_loss(
        chain_golden: tuple[Path, tuple[torch.Tensor]]) -> None:
    path, x = chain_golden
    pr = Chain()
    fake_quant(pr.a, 0.05)  # 'a' loses signal; 'c' is exact but inherits the loss
    loose_then_strict = {"a": {"min_sqnr_db": 5}, "b": {"min_sqnr_db": 5}, "c": {"min_sqnr_db": 60}}
    report = ag.compare(pr, x, path=path, tolerances=loose_then_strict)
    fd = report.first_divergence
    assert fd is not None and fd.name == "c"
    assert fd.own_energy is not None and fd.own_energy.sqnr_db() == math.inf
    assert "the loss is inherited from the layers before it" in str(report)
    # replay="all": each layer judged by its own SQNR: 'c' passes, 'a' (60 dB) would fail
    own = ag.compare(pr, x, path=path, tolerances={"*": {"min_sqnr_db": 60}}, replay="all")
    assert own.first_divergence is not None and own.first_divergence.name == "a"
    assert [r.name for r in own.layers if not r.ok] == ["a"]  # the root and 'c' only inherit
    c = next(r for r in own.layers if r.name == "c")
    assert c.inherited_energy is not None and c.inherited_energy.sqnr_db() < 60


def test_metric_option_measures_every_output_and_round_trips_through_json(
        chain_golden: tuple[Path, tuple[torch.Tensor]]) -> None:
    path, x = chain_golden
    pr = Chain()
    fake_quant(pr.b, 0.2)
    report = ag.compare(pr, x, path=path, metric="cosine")
    assert all(r.energy is not None for r in report.layers)
    assert "cosine" in str(report).split("context")[1].splitlines()[1]  # a column of the context table
    back = ag.Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.metric == "cosine" and [r.energy for r in back.layers] == [r.energy for r in report.layers]
    assert str(back) == str(report)


def test_bad_thresholds_are_option_errors_naming_pattern_and_value(
        chain_golden: tuple[Path, tuple[torch.Tensor]]) -> None:
    path, x = chain_golden
    for bad, words in (({"lm_head": {"min_sqnr_db": -1}}, "tolerances['lm_head']: min_sqnr_db must be a finite "
                                                          "number >= 0, got -1"),
                       ({"*": {"min_sqnr_db": float("nan")}}, "min_sqnr_db must be a finite number >= 0, got nan"),
                       ({"*": {"min_sqnr_db": "30dB"}}, "min_sqnr_db must be a number, got '30dB'")):
        with pytest.raises(ag.OptionError, match="option tolerances=") as ei:
            ag.compare(Chain(), x, path=path, tolerances=bad)
        assert words in str(ei.value)
    with pytest.raises(ag.OptionError, match="choose one"):
        ag.compare(Chain(), x, path=path, tolerances={"*": {"min_sqnr_db": 30}}, tolerance="calibrated")
    with pytest.raises(ag.OptionError, match=r"option metric='mse'.*choose one"):
        ag.compare(Chain(), x, path=path, metric="mse", tolerance="calibrated")


GATE_MODELS = '''
import os
import torch

def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    step = float(os.environ.get("AG_STEP", "0"))
    if step:  # the quantized model: weights on a grid
        with torch.no_grad():
            for lin in (m[0], m[2]):
                lin.weight.copy_(torch.round(lin.weight / step) * step)
    return m.eval()

def inputs():
    return (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),)
'''

GATE_TEST = '''
import pytest
from gatemodels import build, inputs

@pytest.mark.activation_guard(tolerances={"*": {"min_sqnr_db": 35}, "2": {"min_sqnr_db": 30}})
def test_quantized(activation_guard):
    activation_guard.check(build(), inputs())
'''


def test_the_marker_gates_a_quantized_model_by_sqnr(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(gatemodels=GATE_MODELS, test_gate=GATE_TEST)
    monkeypatch.delenv("AG_STEP", raising=False)
    pytester.runpytest("-p", "no:cacheprovider", "--ag-update").assert_outcomes(passed=1)  # the float golden
    monkeypatch.setenv("AG_STEP", "0.002")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv("AG_STEP", "0.05")
    res = pytester.runpytest("-p", "no:cacheprovider", "--ag-report", "summary.md")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*first divergence at layer '0'*", "*SQNR * < min_sqnr_db 35 dB*"])
    summary = (pytester.path / "summary.md").read_text()
    assert "min_sqnr_db 35" in summary and "SQNR " in summary  # the CI page names the rule that judged
    res = pytester.runpytest("-p", "no:cacheprovider", "--ag-report", "report.html")
    res.assert_outcomes(failed=1)
    assert "min_sqnr_db 35 dB" in (pytester.path / "report.html").read_text()


# ----------------------------------------------------------------------------- torchao: tiny BERT and Llama


def _torchao() -> Any:
    return pytest.importorskip("torchao.quantization", reason="quantized models need the quant extra: "
                                                              "pip install 'activation_guard[quant]'")


def _transformers() -> Any:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    return tf


# initializer_range 0.2: each block's output is a real part of the residual stream, as in a trained
# model (at 0.02 a tiny random model's blocks add almost nothing to it, and no block matters)
def build_bert() -> torch.nn.Module:
    tf = _transformers()
    torch.manual_seed(0)
    return tf.BertModel(tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32, initializer_range=0.2,
                                      attn_implementation="eager")).eval()


def build_llama() -> torch.nn.Module:
    tf = _transformers()
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                              max_position_embeddings=32, initializer_range=0.2,
                                              attn_implementation="eager")).eval()


def plant_outliers(model: torch.nn.Module, producer: str, consumer: str, cols: tuple[int, ...] = (1, 5, 9)) -> None:
    """Outlier input columns in ``consumer`` (x50) and the rows of ``producer`` making those inputs
    (x1/50): the float function is unchanged, but the consumer's quantization loses signal."""
    p, c = model.get_submodule(producer), model.get_submodule(consumer)
    with torch.no_grad():
        p.weight[list(cols)] /= 50
        if p.bias is not None:
            p.bias[list(cols)] /= 50
        c.weight[:, list(cols)] *= 50


@dataclass
class Planted:
    name: str
    model: torch.nn.Module  # float, outliers planted
    args: tuple[torch.Tensor]
    golden: Path
    planted: tuple[str, str]


PLANTS = {
    "bert": (build_bert, (("encoder.layer.0.attention.self.value", "encoder.layer.0.attention.output.dense"),
                          ("encoder.layer.1.attention.self.value", "encoder.layer.1.attention.output.dense"))),
    "llama": (build_llama, (("model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"),
                            ("model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj"))),
}


@pytest.fixture(scope="module", params=sorted(PLANTS))
def planted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Planted:
    _torchao()
    build, pairs = PLANTS[request.param]
    model = build()
    args = (torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1)),)
    with torch.no_grad():
        before = model(*args)[0]
    for producer, consumer in pairs:
        plant_outliers(model, producer, consumer)
    with torch.no_grad():
        torch.testing.assert_close(model(*args)[0], before, rtol=1e-4, atol=1e-5)  # the function is unchanged
    golden = tmp_path_factory.mktemp(request.param) / "float.h5"
    ag.record(model, args, path=golden)
    return Planted(request.param, model, args, golden, (pairs[0][1], pairs[1][1]))


def quantizer(kind: str) -> Callable[[torch.nn.Module, set[str]], torch.nn.Module]:
    tq = _torchao()
    config = {"weight-only": tq.Int8WeightOnlyConfig, "dynamic": tq.Int8DynamicActivationInt8WeightConfig}[kind]

    def quantize(model: torch.nn.Module, skip: set[str]) -> torch.nn.Module:
        tq.quantize_(model, config(), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn not in skip)
        return model

    return quantize


@pytest.mark.parametrize("kind", ["weight-only", "dynamic"])
def test_planted_outliers_rank_first_and_second_by_own_error_and_are_advised(planted: Planted, kind: str) -> None:
    q = quantizer(kind)(copy.deepcopy(planted.model), set())
    report = ag.sensitivity(q, planted.args, path=planted.golden)
    assert {r.name for r in report.rows[:2]} == set(planted.planted), [(r.name, r.own_sqnr_db) for r in report.rows]
    assert set(planted.planted) <= set(report.keep_in_float)
    top = report.row(planted.planted[0])
    assert top.quantized and top.own_sqnr_db is not None and top.own_sqnr_db < 25
    assert all(r.quantized is False for r in report.rows if r.type_name in ("LayerNorm", "LlamaRMSNorm", "Embedding"))
    assert report.filter_fn()(torch.nn.Linear(2, 2), planted.planted[0]) is False  # kept in float by the filter
    # ranking by accumulated SQNR would not find both: a later layer inherits as much loss
    by_acc = sorted((r for r in report.rows if r.quantized), key=lambda r: r.sqnr_db or 0.0)
    assert {r.name for r in by_acc[:2]} != set(planted.planted), [(r.name, r.sqnr_db) for r in by_acc[:3]]


def test_keeping_the_advised_modules_in_float_beats_random_and_the_last_ones(planted: Planted) -> None:
    quantize = quantizer("weight-only")
    q = quantize(copy.deepcopy(planted.model), set())

    def in_place(model: torch.nn.Module, skip: set[str]) -> None:  # as torchao's quantize_: returns None
        quantize(model, skip)

    report = ag.sensitivity(q, planted.args, path=planted.golden, quantize=in_place, reference=planted.model)
    cl = report.closed_loop
    assert cl is not None and cl.k == len(report.keep_in_float) and len(cl.random_draws) == 10
    assert cl.advised_gain_db > cl.random_gain_db + 3 and cl.advised_gain_db > cl.last_gain_db + 3, cl
    assert cl.worth_it
    text = str(report)
    assert "closed loop" in text and "k random, median of 10" in text
    back = SensitivityReport.from_dict(json.loads(report.to_json()))
    assert back.to_dict() == report.to_dict()


def test_gpt2_conv1d_projections_left_alone_are_named_not_judged(tmp_path: Path) -> None:
    tq = _torchao()
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.GPT2Model(tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                       attn_implementation="eager")).eval()
    args = (torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(1)),)
    ag.record(model, args, path=tmp_path / "float.h5")
    q = copy.deepcopy(model)
    tq.quantize_(q, tq.Int8WeightOnlyConfig())  # Linear only: GPT-2's Conv1D projections stay float
    report = ag.sensitivity(q, args, path=tmp_path / "float.h5")
    assert report.keep_in_float == [] and report.quantized == {}
    assert {"h.0.attn.c_attn", "h.0.mlp.c_fc"} <= set(report.not_quantized)
    assert any("nothing to advise" in n for n in report.notes)
    assert "not quantized" in str(report)


def test_a_quantized_golden_checks_a_refactor_of_the_quantized_model_strictly(tmp_path: Path) -> None:
    quantize = quantizer("weight-only")
    model = build_llama()
    args = (torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1)),)
    q = quantize(copy.deepcopy(model), set())
    ag.record(q, args, path=tmp_path / "int8.h5")
    assert ag.compare(copy.deepcopy(q), args, path=tmp_path / "int8.h5").ok  # strict, bit for bit
    changed = quantize(copy.deepcopy(model), {"model.layers.1.mlp.up_proj"})  # one module no longer quantized
    report = ag.compare(changed, args, path=tmp_path / "int8.h5")
    assert report.first_divergence is not None and report.first_divergence.name == "model.layers.1.mlp.up_proj"
    assert report.origin is not None and report.origin.kind == "layer"


def test_the_sqnr_gate_fails_a_pr_that_quantizes_an_outlier_layer_at_that_layer(tmp_path: Path) -> None:
    quantize = quantizer("weight-only")
    model = build_llama()
    plant_outliers(model, "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj")  # outliers, as trained
    args = (torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1)),)
    ag.record(model, args, path=tmp_path / "float.h5")
    gate = {"*": {"min_sqnr_db": 30}, "lm_head": {"min_sqnr_db": 20}}
    keep = {"model.layers.1.mlp.down_proj"}  # the layer with outlier inputs stays in float
    base = quantize(copy.deepcopy(model), keep)
    for rerun in (base, copy.deepcopy(base)):  # the release, and an unchanged re-run
        assert ag.compare(rerun, args, path=tmp_path / "float.h5", tolerances=gate, replay="all").ok
    pr = quantize(copy.deepcopy(model), set())  # the PR drops the exception
    report = ag.compare(pr, args, path=tmp_path / "float.h5", tolerances=gate, replay="all")
    assert [r.name for r in report.layers if not r.ok] == ["model.layers.1.mlp.down_proj"]
    assert report.origin is not None and report.origin.name == "model.layers.1.mlp.down_proj"
    assert "< min_sqnr_db 30 dB" in str(report)
    # judged by accumulated SQNR (replay="first"), the same layer is the first under its threshold, its own
    # error is what loses the signal
    acc = ag.compare(pr, args, path=tmp_path / "float.h5", tolerances=gate)
    assert acc.first_divergence is not None and acc.first_divergence.name == "model.layers.1.mlp.down_proj"
    assert "the layer loses the signal itself" in str(acc)


def test_a_half_cast_is_the_simplest_compression(tmp_path: Path) -> None:
    model = build_llama()
    args = (torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1)),)
    ag.record(model, args, path=tmp_path / "float.h5")
    half = copy.deepcopy(model).half()
    report = ag.sensitivity(half, args, path=tmp_path / "float.h5")
    assert report.not_quantized == [] and report.quantized["lm_head"] == "float16"
    own = [r.own_sqnr_db for r in report.rows if r.quantized]
    assert own and all(o is not None and 40 < o < math.inf for o in own)
    assert report.output_sqnr_db is not None and 20 < report.output_sqnr_db < math.inf
    gate = ag.compare(half, args, path=tmp_path / "float.h5", tolerances={"*": {"min_sqnr_db": 40}}, replay="all",
                      allow_dtype_change=True)
    assert gate.ok, str(gate)


def test_a_pt2e_graph_gets_a_sensitivity_report_through_the_graph_source(tmp_path: Path) -> None:
    _torchao()
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    plant_outliers(model, "0", "2")
    args = (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),)
    ag.record(model, args, path=tmp_path / "float.h5")
    quantizer_ = xiq.X86InductorQuantizer()
    quantizer_.set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(torch.export.export(model, args).module(), quantizer_)
    prepared(*args)
    report = ag.sensitivity(convert_pt2e(prepared), args, path=tmp_path / "float.h5")
    assert report.rows[0].name == "2" and report.rows[0].quantized is None
    assert report.keep_in_float[0] == "2"
    assert any("graph" in n for n in report.notes)


def test_sensitivity_refuses_bad_arguments_by_name(chain_golden: tuple[Path, tuple[torch.Tensor]]) -> None:
    path, x = chain_golden
    with pytest.raises(ag.OptionError, match="option reference=None"):
        ag.sensitivity(Chain(), x, path=path, quantize=lambda m, skip: m)
    with pytest.raises(ag.OptionError, match="option explain=0"):
        ag.sensitivity(Chain(), x, path=path, explain=0)
    with pytest.raises(ag.OptionError, match="option metric='snr'"):
        ag.sensitivity(Chain(), x, path=path, metric="snr")
    with pytest.raises(ag.OptionError, match="option draws=0"):
        ag.sensitivity(Chain(), x, path=path, draws=0)
    pr = Chain()
    fake_quant(pr.b, 0.2)
    pr.b.weight.data = pr.b.weight.data.to(torch.float16).float()  # not a compressed parameter: nothing advised
    skipped = ag.sensitivity(pr, x, path=path, quantize=lambda m, skip: None, reference=Chain())
    assert skipped.closed_loop is None and "closed loop skipped: nothing is advised to keep in float" in skipped.notes


def test_goldens_that_cannot_be_measured_are_refused_and_other_inputs_are_said(
        chain_golden: tuple[Path, tuple[torch.Tensor]], tmp_path: Path) -> None:
    path, x = chain_golden
    ag.record(Chain(), x, path=tmp_path / "no-inputs.h5", inputs=False)
    with pytest.raises(ag.GoldenError, match="recorded without each layer call's inputs"):
        ag.sensitivity(Chain(), x, path=tmp_path / "no-inputs.h5")
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    xw = (torch.randn(64, 256, generator=torch.Generator().manual_seed(1)),)
    ag.record(wide, xw, path=tmp_path / "fp.h5", fingerprint=True)
    with pytest.raises(ag.GoldenError, match="stores some outputs as fingerprints"):
        ag.sensitivity(wide, xw, path=tmp_path / "fp.h5")
    # a gate over fingerprinted outputs would be judged by another rule: refused, naming pattern and layer
    with pytest.raises(ag.OptionError, match=r"tolerances\['\*'\] sets min_sqnr_db for layer '0', whose outputs"):
        ag.compare(wide, xw, path=tmp_path / "fp.h5", tolerances={"*": {"min_sqnr_db": 30}})
    pr = Chain()
    fake_quant(pr.b, 0.2)
    other = ag.sensitivity(pr, (x[0] * 2,), path=path)
    assert other.notes[0].startswith("the model's inputs differ from the recording's")
    assert other.rows[0].name == "b"  # own errors are re-runs on the golden's inputs: still ranked right


def test_report_renders_as_text_json_html_and_through_the_cli(chain_golden: tuple[Path, tuple[torch.Tensor]],
                                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    path, x = chain_golden
    pr = Chain()
    fake_quant(pr.b, 0.2)
    fake_quant(pr.a, 0.01)
    report = ag.sensitivity(pr, x, path=path, metric="mse")
    assert report.rows[0].name == "b" and report.rows[0].own_value is not None  # ranked by own MSE
    assert report.keep_in_float == []  # nothing compressed (plain float32 weights): nothing advised
    advised = ag.sensitivity(pr, x, path=path, keep=1)
    page = advised.html()
    assert '<table class="ag sensitivity"' in page and "own SQNR" in page
    assert ("<img class=\"plot\"" in page) == plot_available()  # else a note says matplotlib is missing
    saved = tmp_path / "s.json"
    saved.write_text(report.to_json())
    assert cli_main(["sensitivity", str(saved), "--html", str(tmp_path / "s.html")]) == 0
    assert "ranked by own error" in capsys.readouterr().out and (tmp_path / "s.html").exists()
    (tmp_path / "bad.json").write_text("{}")
    assert cli_main(["sensitivity", str(tmp_path / "bad.json")]) == 2
    assert "not a sensitivity report" in capsys.readouterr().err


def test_advice_becomes_globs_only_where_every_module_a_glob_names_is_advised() -> None:
    from activation_guard.quantization.analysis import keep_globs

    names = ["", "model", "model.layers.0", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj",
             "model.layers.1", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj", "lm_head"]
    both = keep_globs(["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"], names)
    assert both == ["model.layers.*.mlp.down_proj", "lm_head"]
    one = keep_globs(["model.layers.1.mlp.down_proj"], names)
    assert one == ["model.layers.1.mlp.down_proj"]  # a glob would also keep layer 0's in float


def test_a_module_called_twice_is_advised_once_with_its_calls_shares_summed(tmp_path: Path) -> None:
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.shared, self.other = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.other(torch.tanh(self.shared(torch.tanh(self.shared(x)))))

    model, x = Twice().eval(), (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)),)
    ag.record(model, x, path=tmp_path / "float.h5")
    half = copy.deepcopy(model).to(torch.bfloat16)
    report = ag.sensitivity(half, (x[0].to(torch.bfloat16),), path=tmp_path / "float.h5", keep=1)
    shared = [r for r in report.rows if r.name == "shared"]
    assert [r.call for r in sorted(shared, key=lambda r: r.call)] == [0, 1]
    assert all(r.own_sqnr_db is not None and 20 < r.own_sqnr_db < 80 for r in shared)  # bf16 rounding, replayed
    assert report.keep_in_float == ["shared"] and report.quantized == {"shared": "bfloat16", "other": "bfloat16"}


@pytest.mark.slow
def test_the_benchmark_prints_the_three_gains_side_by_side_and_the_cost() -> None:
    _torchao()
    _transformers()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    cp = subprocess.run([sys.executable, str(root / "benchmarks" / "sensitivity.py"), "--quick"], capture_output=True,
                        text=True, timeout=600, cwd=root, env=env, check=False)
    assert cp.returncode == 0, cp.stderr
    rows = [line.split() for line in cp.stdout.splitlines() if line.startswith(("bert ", "llama "))]
    assert len(rows) == 4 and all(r[-1] == "True" and r[4] == "True" for r in rows), cp.stdout
    assert "worst ratio" in cp.stdout and "sensitivity ms" in cp.stdout


def test_a_quantized_recording_is_gated_against_a_float_golden_by_diff(
        chain_golden: tuple[Path, tuple[torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, x = chain_golden
    pr = Chain()
    fake_quant(pr.b, 0.2)
    ag.record(pr, x, path=tmp_path / "int.h5")
    report = ag.diff_recordings(path, tmp_path / "int.h5", tolerances={"*": {"min_sqnr_db": 30}}, metric="sqnr")
    assert report.first_divergence is not None and report.first_divergence.name == "b" and report.metric == "sqnr"
    (tmp_path / "gate.json").write_text(json.dumps({"*": {"min_sqnr_db": 10}}))
    assert cli_main(["diff", str(path), str(tmp_path / "int.h5"), "--tolerances", str(tmp_path / "gate.json")]) == 0
    (tmp_path / "gate.json").write_text(json.dumps({"*": {"min_sqnr_db": 30}}))
    assert cli_main(["diff", str(path), str(tmp_path / "int.h5"), "--tolerances", str(tmp_path / "gate.json")]) == 1
    assert "< min_sqnr_db 30 dB" in capsys.readouterr().out
    assert cli_main(["diff", str(path), str(tmp_path / "int.h5"), "--metric", "snr"]) == 2
    assert "option metric='snr' (--metric)" in capsys.readouterr().err

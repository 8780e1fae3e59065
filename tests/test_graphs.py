"""Exported programs, .pt2 files, flattened FX graphs and PT2E-quantized models compared per eager
module call with a golden recorded from the eager model (the graph source)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import (
    build_cnn,
    build_hf_bert,
    build_hf_gpt2,
    build_hf_llama,
    cnn_input,
    one_thread,
    token_input,
)
from torch import nn

import activation_guard as ag
from activation_guard._core.errors import UnsupportedModelError
from activation_guard.graphs.source import assign, scopes
from activation_guard.store.format import LeafEntry


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


class Twice(nn.Module):
    """One Linear and one GELU called twice, root code between the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        h = self.act(self.fc(h))
        return self.out(h) * 2


class Exported:
    """A model, its inputs, an eager golden and its exported program."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], root: Path):
        self.model, self.args, self.kwargs = model, args, kwargs
        self.golden = root / "eager.h5"
        self.summary = ag.record(model, args, kwargs, path=self.golden)
        self.ep = torch.export.export(model, args, kwargs)
        self.pt2 = root / "model.pt2"
        torch.export.save(self.ep, self.pt2)

    def compare(self, form: Any, **options: Any) -> ag.Report:
        return ag.compare(form, self.args, self.kwargs, path=self.golden, **options)


def _build(make: Callable[[], nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any],
           factory: pytest.TempPathFactory, name: str) -> Exported:
    with one_thread():
        torch.manual_seed(0)
        return Exported(make(), args, kwargs, factory.mktemp(name))


@pytest.fixture(scope="session")
def twice(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _build(lambda: Twice().eval(), (torch.randn(4, 6, generator=torch.Generator().manual_seed(1)),), {},
                  tmp_path_factory, "twice")


@pytest.fixture(scope="session")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _build(build_cnn, cnn_input(), {}, tmp_path_factory, "cnn")


HF: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "bert": (build_hf_bert, {"attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2])}),
    "gpt2": (build_hf_gpt2, {"use_cache": False}),
    "llama": (build_hf_llama, {"use_cache": False}),
}


@pytest.fixture(scope="session", params=sorted(HF))
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    make, kwargs = HF[request.param]
    return _build(make, token_input(), kwargs, tmp_path_factory, request.param)


def _forms(e: Exported) -> dict[str, Any]:
    return {"ExportedProgram": e.ep, ".pt2": str(e.pt2), "ep.module()": e.ep.module(),
            "run_decompositions()": e.ep.run_decompositions()}


def _coverage(e: Exported, report: ag.Report) -> float:
    judged = [r for r in report.layers if r.status not in ("missing", "unexpected")]
    return len(judged) / e.summary.layer_calls


def _assert_same_and_covered(e: Exported, report: ag.Report, form: str) -> None:
    assert report.ok, f"{form}:\n{report}"
    assert report.mode_changes == [], f"{form}: {report.mode_changes}"  # the flattened module's training flag
    assert _coverage(e, report) >= 0.95, f"{form}: {_coverage(e, report):.2f}\n{report.notes}"
    assert not [r for r in report.layers if r.status in ("structure", "missing", "unexpected")]
    assert any(n.startswith("live values from the") for n in report.notes)


def test_every_exported_form_of_a_small_model_matches_its_eager_golden_per_module(twice: Exported) -> None:
    for form, model in _forms(twice).items():
        report = twice.compare(model)
        _assert_same_and_covered(twice, report, form)
        assert [(r.name, r.call) for r in report.layers] == [
            ("fc", 0), ("act", 0), ("fc", 1), ("act", 1), ("out", 0), ("", 0)], form  # hooks' order and numbers


def test_every_exported_form_of_a_cnn_matches_its_eager_golden_per_module(cnn: Exported) -> None:
    for form, model in _forms(cnn).items():
        report = cnn.compare(model, rtol=0, atol=0)
        _assert_same_and_covered(cnn, report, form)
        assert _coverage(cnn, report) == 1.0


def test_every_exported_form_of_a_tiny_transformer_matches_its_eager_golden(hf: Exported) -> None:
    for form, model in _forms(hf).items():
        _assert_same_and_covered(hf, hf.compare(model), form)


def test_attention_weights_used_only_inside_the_module_are_named_not_a_structure_change(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    bert = _build(build_hf_bert, token_input(), dict(HF["bert"][1]), tmp_path_factory, "bert-weights")
    report = bert.compare(bert.ep)
    attn = [r for r in report.layers if r.name == "encoder.layer.0.attention.self"]
    assert [r.status for r in attn] == ["match"]
    assert any("'encoder.layer.0.attention.self' call 0 output '1': the graph consumes it only inside the module"
               in n for n in report.notes), report.notes


def test_a_changed_op_in_the_graph_is_found_at_the_module_that_owns_it(twice: Exported) -> None:
    gm = twice.ep.module()
    node = next(n for n in gm.graph.nodes if n.name == "gelu_1")  # the second call of `act`
    node.kwargs = {"approximate": "tanh"}
    gm.recompile()
    report = twice.compare(gm)
    fd = report.first_divergence
    assert fd is not None and (fd.name, fd.call) == ("act", 1)
    assert report.origin is not None and (report.origin.name, report.origin.call, report.origin.kind) == (
        "act", 1, "layer")
    assert report.origin.own_error is not None and report.origin.own_error > 0


def test_a_scaled_weight_in_the_graph_is_found_at_its_module(cnn: Exported) -> None:
    gm = cnn.ep.module()
    with torch.no_grad():
        gm.get_parameter("conv2.weight").mul_(1.01)
    report = cnn.compare(gm)
    assert report.first_divergence is not None and report.first_divergence.name == "conv2"
    assert report.origin is not None and (report.origin.name, report.origin.kind) == ("conv2", "layer")


@pytest.mark.parametrize("keep_meta", [True, False], ids=["node-with-metadata", "node-without-metadata"])
def test_a_changed_gelu_in_an_exported_gpt2_is_found_at_its_mlp_activation(
        tmp_path_factory: pytest.TempPathFactory, keep_meta: bool) -> None:
    gpt2 = _build(build_hf_gpt2, token_input(), {"use_cache": False}, tmp_path_factory, f"gpt2-{keep_meta}")
    gm = gpt2.ep.module()
    owner = {}
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if stack:
            owner[n] = list(stack.values())[-1][0]
    # GPT-2's NewGELUActivation is the tanh formula written out: change its tanh into a sigmoid-based one
    tanh = [n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default and owner.get(n) == "h.1.mlp.act"]
    assert len(tanh) == 1
    with gm.graph.inserting_after(tanh[0]):
        changed = gm.graph.call_function(torch.ops.aten.mul.Tensor, (tanh[0], 1.001))
    tanh[0].replace_all_uses_with(changed, delete_user_cb=lambda u: u is not changed)
    if keep_meta:
        changed.meta = dict(tanh[0].meta)
    else:  # a pass's new node with no module stack: the module call around it owns it
        changed.meta = {}
    gm.recompile()
    report = gpt2.compare(gm)
    assert report.first_divergence is not None and report.first_divergence.name == "h.1.mlp.act"
    assert report.origin is not None and (report.origin.name, report.origin.kind) == ("h.1.mlp.act", "layer")


def test_root_code_between_layers_is_the_roots_own(twice: Exported) -> None:
    gm = twice.ep.module()
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    assert not mul.meta.get("nn_module_stack") or list(mul.meta["nn_module_stack"].values())[-1][0] == ""
    mul.args = (mul.args[0], 2.001)
    gm.recompile()
    report = twice.compare(gm)
    assert [r.name for r in report.layers if not r.ok] == [""]
    assert report.origin is not None and (report.origin.name, report.origin.kind) == ("", "layer")


def test_a_graph_without_module_metadata_is_refused_with_the_fix(twice: Exported) -> None:
    gm = twice.ep.module()
    for n in gm.graph.nodes:
        n.meta.pop("nn_module_stack", None)
    with pytest.raises(UnsupportedModelError, match=r"no nn_module_stack on any node.*torch\.export\.export"):
        twice.compare(gm)


def test_a_path_that_is_no_exported_program_is_named(twice: Exported, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="could not be loaded as an exported program"):
        twice.compare(str(twice.golden))
    with pytest.raises(UnsupportedModelError, match="is not a file"):
        twice.compare(str(tmp_path / "none.pt2"))


def test_gradients_of_a_graph_are_refused_clearly(twice: Exported) -> None:
    with pytest.raises(UnsupportedModelError, match="backward="):
        twice.compare(twice.ep, backward=True)


def test_a_traced_module_calling_its_submodules_keeps_hooks(twice: Exported) -> None:
    traced = torch.fx.symbolic_trace(twice.model)
    report = twice.compare(traced)
    assert report.ok and not any(n.startswith("live values from the") for n in report.notes)


def test_record_from_an_exported_program_names_layers_as_eager(twice: Exported, tmp_path: Path) -> None:
    summary = ag.record(str(twice.pt2), twice.args, path=tmp_path / "from-graph.h5")
    assert summary.names == twice.summary.names
    assert ag.compare(twice.model, twice.args, path=tmp_path / "from-graph.h5").ok
    with torch.no_grad():
        twice.model.out.bias.add_(1e-3)
    try:
        report = ag.compare(twice.model, twice.args, path=tmp_path / "from-graph.h5")
        assert report.first_divergence is not None and report.first_divergence.name == "out"
    finally:
        with torch.no_grad():
            twice.model.out.bias.sub_(1e-3)


def test_scopes_number_repeated_calls_in_order(twice: Exported) -> None:
    found = [(s.path, s.call) for s in scopes(twice.ep.module())]
    assert found == [("fc", 0), ("act", 0), ("fc", 1), ("act", 1), ("out", 0)]


def _leaf(path: str, shape: tuple[int, ...], dtype: str = "float32") -> LeafEntry:
    return LeafEntry(path, "tensor", dtype, shape)


SHAPES = st.sampled_from([(2,), (3,), (2, 3), (4, 1)])


@settings(max_examples=60, deadline=None)
@given(golden=st.lists(SHAPES, min_size=1, max_size=5), live=st.lists(SHAPES, max_size=5))
def test_outputs_are_paired_only_where_shape_and_dtype_tell_them_apart(
        golden: list[tuple[int, ...]], live: list[tuple[int, ...]]) -> None:
    entries = [_leaf(str(i), s) for i, s in enumerate(golden)]
    values = [torch.zeros(s) for s in live]
    pairs, left = assign(entries, values)
    for path, i in pairs.items():  # a pair has one signature, unique on both sides
        shape = golden[int(path)]
        assert tuple(values[i].shape) == shape
        assert golden.count(shape) == 1 and live.count(shape) == 1
    assert len(set(pairs.values())) == len(pairs)
    assert sorted([*pairs, *(p for p, _ in left)]) == sorted(e.path for e in entries)  # every output accounted


# ----------------------------------------------------------------------------- PT2E


class Plain(nn.Module):
    """Convolutions and Linears with no batch norm to fold: each keeps a node of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.act1 = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.conv2, self.act2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        self.pool, self.flatten = nn.AdaptiveAvgPool2d(2), nn.Flatten()
        self.fc, self.act3, self.out = nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.act2(self.conv2(self.act1(self.conv1(x)))))
        return self.out(self.act3(self.fc(self.flatten(h))))


def _quantized(model: nn.Module, args: tuple[Any, ...]) -> torch.fx.GraphModule:
    pytest.importorskip("torchao", reason="PT2E needs the quant extra: pip install 'activation_guard[quant]'")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(torch.export.export(model, args).module(), quantizer)
    prepared(*args)  # calibration
    return convert_pt2e(prepared)


def test_a_pt2e_quantized_model_gets_each_linear_and_convs_own_and_accumulated_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, args = Plain().eval(), (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)
    ag.record(model, args, path=tmp_path / "float.h5")
    q = _quantized(model, args)
    report = ag.compare(q, args, path=tmp_path / "float.h5", replay="all")
    rows = {r.name: r for r in report.layers}
    for name in ("conv1", "conv2", "fc", "out"):
        r = rows[name]
        assert r.status == "diverged" and r.max_abs_diff is not None and r.max_abs_diff > 0, name
        assert r.own_max_abs_diff is not None and r.own_max_abs_diff > 0, name  # weight quantization, replayed
    assert rows["act1"].own_status == "match"  # a ReLU re-run on the golden's input adds no error of its own
    describe = next(n for n in report.notes if n.startswith("live values from the"))
    m = re.search(r"; (\d+) of \d+ nodes have none of their own \((\d+) given to the module call around them, "
                  r"(\d+) the root's code", describe)
    assert m is not None, describe
    # quantize/dequantize: weights' dequantize belong to their layer, the activations' pairs to the root
    assert int(m[2]) == 4 and int(m[3]) > 0
    assert report.origin is not None and (report.origin.name, report.origin.kind) == ("conv1", "layer")


def test_a_batch_norm_folded_into_its_conv_makes_both_not_comparable(tmp_path: Path, cnn: Exported) -> None:
    q = _quantized(cnn.model, cnn.args)
    report = ag.compare(q, cnn.args, path=cnn.golden)
    names = {r.name for r in report.layers}
    assert {"conv1", "bn1", "conv2", "bn2"}.isdisjoint(names)  # no row claims a fused value is the conv's
    note = next(n for n in report.notes if "not comparable" in n)
    assert "'conv1' call 0 its graph value also carries 'bn1'" in note
    assert report.origin is None or report.origin.name != "conv1"
    assert not [r for r in report.layers if r.status in ("structure", "missing")]



GRAPH_WORKFLOW = '''
import torch
from agmodels import build, inputs

EXPORTED = False
BIAS = 0.0

def test_mlp(activation_guard):
    model = build()
    with torch.no_grad():
        model[2].weight.add_(BIAS)
    if EXPORTED:
        model = torch.export.export(model, inputs())
    activation_guard.check(model, inputs())
'''

PLUGIN_MODELS = '''
import torch

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()

def inputs():
    return (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),)
'''


@pytest.mark.slow
def test_the_plugin_checks_an_exported_program_against_the_eager_golden(pytester: pytest.Pytester) -> None:
    # each run in its own process: torch's structured trace logging asserts when a second export
    # in one process runs under pytester's log capture
    pytester.makepyfile(agmodels=PLUGIN_MODELS)
    pytester.makepyfile(test_graph=GRAPH_WORKFLOW)
    pytester.runpytest_subprocess("--ag-update").assert_outcomes(passed=1)
    pytester.makepyfile(test_graph=GRAPH_WORKFLOW.replace("EXPORTED = False", "EXPORTED = True"))
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    pytester.makepyfile(test_graph=GRAPH_WORKFLOW.replace("EXPORTED = False", "EXPORTED = True")
                        .replace("BIAS = 0.0", "BIAS = 1e-3"))
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*first divergence at layer '2' (Linear) call 0*"])

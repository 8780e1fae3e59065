"""ONNX models (torch.onnx.export(..., dynamo=True)) in ONNX Runtime, compared per module call with
the eager golden: mapping coverage on four real models, faults edited into the ONNX graph found at
the module that owns them with their origin, a float16 conversion under calibrated tolerances, the
CLI command and the pytest path. Each model is exported once per session; faults edit copies of
its ModelProto in memory."""

from __future__ import annotations

import ast
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from models import (  # noqa: E402
    build_cnn,
    build_hf_bert,
    build_hf_gpt2,
    build_hf_llama,
    cnn_input,
    one_thread,
    shared_loop,
    token_input,
)

import activation_guard as ag  # noqa: E402
from activation_guard.api.runtime import compare_onnx, onnx_map  # noqa: E402
from activation_guard.runtimes.ort import SCOPES_KEY, OnnxGraph  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@dataclass
class Exported:
    name: str
    golden: str
    proto: Any  # onnx.ModelProto, never edited: faults edit copies
    onnx_path: str
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]


def _bert_mask() -> dict[str, Any]:
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -2:] = 0
    return {"attention_mask": mask}


Builder = tuple[Callable[[], torch.nn.Module], Callable[[], tuple[Any, ...]], Callable[[], dict[str, Any]]]
BUILDERS: dict[str, Builder] = {
    "cnn": (build_cnn, cnn_input, dict),
    "gpt2": (build_hf_gpt2, token_input, dict),
    "bert": (build_hf_bert, token_input, _bert_mask),
    "llama": (build_hf_llama, token_input, dict),
}


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Exported]:
    """Each model recorded (calibrated) and exported once per session, on first use."""
    done: dict[str, Exported] = {}
    root = tmp_path_factory.mktemp("onnx")

    def get(name: str) -> Exported:
        if name not in done:
            build, inp, kw = BUILDERS[name]
            with one_thread(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = build()
                if hasattr(m, "config"):
                    m.config.use_cache = False  # a KV cache object is no ONNX output
                x, k = inp(), kw()
                golden = str(root / f"{name}.h5")
                ag.record(m, x, k, path=golden, calibrate=True)
                prog = torch.onnx.export(m, x, kwargs=k, dynamo=True, verbose=False)
                path = str(root / f"{name}.onnx")
                onnx.save(prog.model_proto, path)
            done[name] = Exported(name, golden, prog.model_proto, path, x, k)
        return done[name]

    return get


@pytest.fixture(scope="session")
def cnn(exported: Callable[[str], Exported]) -> Exported:
    """The CNN, exported before any function-scoped fixture: ``pytester`` drops every module first
    imported while it is set up (torch.export's and the compiler's among them, which cannot be
    imported twice in one process)."""
    return exported("cnn")


def _copy(proto: Any) -> Any:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out


def _init(proto: Any, name: str) -> Any:
    return next(t for t in proto.graph.initializer if t.name == name)


def _scale_init(proto: Any, name: str, factor: float) -> None:
    from onnx import numpy_helper

    t = _init(proto, name)
    t.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(t) * factor).astype(numpy_helper.to_array(t).dtype),
                                       name))


def _owners(proto: Any, init: str) -> set[str]:
    """The deepest module path of every node reading an initializer (one: not shared)."""
    g = OnnxGraph(proto)
    return {g.stacks[i][-1][0] if g.stacks[i] else "" for i, n in enumerate(g.nodes) if init in n.input}


def _attr(node: Any, name: str) -> Any:
    return next(a for a in node.attribute if a.name == name)


def _first(report: ag.Report) -> tuple[str, str | None]:
    fd = report.first_divergence
    assert fd is not None, str(report)
    return fd.name, None if report.origin is None else report.origin.kind


def _run(proto: Any, e: Exported, **kw: Any) -> ag.Report:
    with one_thread():
        return compare_onnx(proto, path=e.golden, **kw)


# --------------------------------------------------------------------------- every model OK, 90% mapped


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "gpt2", "bert", "llama"])
def test_exported_model_matches_its_eager_golden_and_maps_its_calls(exported: Callable[[str], Exported],
                                                                    name: str) -> None:
    e = exported(name)
    for tolerance in ("strict", "calibrated"):
        report = _run(e.onnx_path, e, tolerance=tolerance)
        assert report.ok, str(report)
        assert report.live_device == "onnxruntime"
        assert any("ONNX Runtime" in n and "optimizations off" in n for n in report.notes)
    with one_thread():
        m = onnx_map(e.onnx_path, e.golden)
    assert m.owned >= 1 and m.compared / m.owned >= 0.9, m
    # every golden call with no comparison is listed with its reason: never a silent gap
    rows = {(x.name, x.call) for x in report.layers}
    listed = {(n, c) for n, c, _ in m.skipped}
    with ag.read_golden(e.golden) as r:
        every = {(c.name, c.call) for c in r.calls if c.name}
    assert every - rows <= listed
    assert all(reason for _, _, reason in m.skipped)


@pytest.mark.slow
def test_unoptimized_export_keeps_dropouts_as_identities_and_compares_them(tmp_path: Any) -> None:
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = build_hf_gpt2()
        m.config.use_cache = False
        golden = str(tmp_path / "g.h5")
        ag.record(m, token_input(), path=golden)
        prog = torch.onnx.export(m, token_input(), dynamo=True, optimize=False, verbose=False)
        assert any(n.op_type == "Identity" for n in prog.model_proto.graph.node)
        report = compare_onnx(prog, path=golden)  # an ONNXProgram as it is
        mapped = onnx_map(prog, golden)
    assert report.ok, str(report)
    assert mapped.owned == mapped.compared == mapped.calls  # the dropouts hand their input on: that is compared
    assert {"drop", "h.0.mlp.dropout"} <= {x.name for x in report.layers}


def test_the_model_proto_and_the_onnx_program_are_read_alike(exported: Callable[[str], Exported]) -> None:
    e = exported("cnn")
    a = _run(e.proto, e)
    b = _run(e.onnx_path, e)
    assert a.ok and b.ok
    assert [(x.name, x.call) for x in a.layers] == [(x.name, x.call) for x in b.layers]
    # the BatchNorm merged into the Conv before it: the Conv is listed, the merged value compared at the BatchNorm
    skipped = " ".join(a.notes)
    assert "'conv1' call 0 no ONNX node carries its scope" in skipped and "'bn1'" in skipped
    assert {"bn1", "bn2"} <= {x.name for x in a.layers}


# --------------------------------------------------------------------------- faults edited into the graph


def test_scaled_initializer_is_found_at_its_module(exported: Callable[[str], Exported]) -> None:
    e = exported("gpt2")
    init = "h.1.mlp.c_fc.weight"
    assert _owners(e.proto, init) == {"h.1.mlp.c_fc"}  # not shared with another module by the exporter
    p = _copy(e.proto)
    _scale_init(p, init, 1.01)
    report = _run(p, e, replay="all")
    assert _first(report) == ("h.1.mlp.c_fc", "layer"), str(report)
    # the fault is not blamed on a later module: every later call outside the faulty one's parents computes the
    # same on the golden's values (its parents contain it, and compute differently)
    fd = report.first_divergence
    assert fd is not None
    later = [x for x in report.layers if x.position > fd.position and x.name and not fd.name.startswith(x.name + ".")]
    parents = [x for x in report.layers if x.name and fd.name.startswith(x.name + ".")]
    assert parents and all(x.own_status == "diverged" for x in parents)
    assert later and all(x.own_status in (None, "match") for x in later), [(x.name, x.own_status) for x in later]


def test_gelu_switched_to_tanh_is_found_at_the_activation(exported: Callable[[str], Exported]) -> None:
    e = exported("bert")
    p = _copy(e.proto)
    g = OnnxGraph(p)
    i = next(i for i, n in enumerate(p.graph.node) if n.op_type == "Gelu")
    owner = g.stacks[i][-1][0]
    node = p.graph.node[i]
    old = [a for a in node.attribute if a.name == "approximate"]
    assert all(a.s == b"none" for a in old)
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("approximate", "tanh"))
    # activations of RMS ~0.03 move by ~1e-6 under the tanh form: the calibrated rule sees it, cross-runtime
    # defaults (rtol 1e-4) do not
    report = _run(p, e, tolerance="calibrated")
    assert _first(report) == (owner, "layer"), str(report)
    assert owner.endswith("intermediate_act_fn")


def test_layernorm_epsilon_is_found_at_the_layernorm(exported: Callable[[str], Exported]) -> None:
    e = exported("gpt2")
    p = _copy(e.proto)
    g = OnnxGraph(p)
    i = next(i for i, n in enumerate(p.graph.node) if n.op_type == "LayerNormalization" and
             g.stacks[i][-1][0] == "h.1.ln_2")
    _attr(p.graph.node[i], "epsilon").f = 0.5
    report = _run(p, e)
    assert _first(report) == ("h.1.ln_2", "layer"), str(report)


def _insert_mul(p: Any, value: str, factor: float) -> str:
    """A Mul by ``factor`` after ``value``, read by every node that read it; it carries the
    producing node's metadata (as a pass keeping metadata would)."""
    nodes = list(p.graph.node)
    j = next(k for k, n in enumerate(nodes) if value in n.output)
    scaled = value + "_scaled"
    const = onnx.helper.make_tensor(value + "_factor", onnx.TensorProto.FLOAT, [], [factor])
    p.graph.initializer.append(const)
    mul = onnx.helper.make_node("Mul", [value, const.name], [scaled], name=value + "_mul")
    mul.metadata_props.extend(nodes[j].metadata_props)
    for n in nodes:
        for k, v in enumerate(n.input):
            if v == value:
                n.input[k] = scaled
    for o in p.graph.output:
        if o.name == value:
            o.name = scaled
    p.graph.node.insert(j + 1, mul)
    md = {x.key: x.value for x in nodes[j].metadata_props}
    return ast.literal_eval(md[SCOPES_KEY])[-2]


def test_mul_after_a_module_output_is_found_at_that_module(exported: Callable[[str], Exported]) -> None:
    e = exported("llama")
    p = _copy(e.proto)
    g = OnnxGraph(p)
    scope = next(s for s in g.scopes if s.path == "model.layers.0.post_attention_layernorm")
    owner = _insert_mul(p, scope.escaping[0], 1.01)
    report = _run(p, e)
    assert _first(report) == (owner, "layer"), str(report)
    assert owner.startswith("model.layers.0.post_attention_layernorm")


def test_a_value_inside_a_module_is_not_taken_for_its_output(exported: Callable[[str], Exported]) -> None:
    e = exported("gpt2")
    p = _copy(e.proto)
    i = next(i for i, n in enumerate(p.graph.node) if n.op_type == "Tanh")  # inside h.0.mlp.act (NewGELU)
    owner = _insert_mul(p, p.graph.node[i].output[0], 1.01)
    assert owner == "h.0.mlp.act"
    report = _run(p, e)
    assert _first(report) == ("h.0.mlp.act", "layer"), str(report)
    assert all(x.name != "h.0.mlp.act" or x.call == 0 for x in report.layers)


def test_a_change_in_the_models_own_code_is_not_blamed_on_the_module_reading_it(
        exported: Callable[[str], Exported]) -> None:
    e = exported("gpt2")
    p = _copy(e.proto)
    g = OnnxGraph(p)
    i = next(i for i, n in enumerate(p.graph.node) if n.op_type == "Add" and g.stacks[i] and len(g.stacks[i]) == 1)
    owner = _insert_mul(p, p.graph.node[i].output[0], 1.01)  # token + position embeddings, summed in the root's code
    assert owner == ""
    report = _run(p, e)
    name, kind = _first(report)
    assert name == "h.0.ln_1" and kind == "parent-code", str(report)


def test_merged_conv_batchnorm_weight_is_found_where_the_output_first_changes(
        exported: Callable[[str], Exported]) -> None:
    e = exported("cnn")
    p = _copy(e.proto)
    assert _owners(p, "conv2.weight") == {"bn2"}  # the exporter merged the BatchNorm into this Conv
    _scale_init(p, "conv2.weight", 1.01)
    report = _run(p, e)
    assert _first(report) == ("bn2", "layer"), str(report)


def test_repeated_module_calls_are_told_apart(tmp_path: Any, exported: Callable[[str], Exported]) -> None:
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, x = shared_loop(), torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
        golden = str(tmp_path / "shared.h5")
        ag.record(m, x, path=golden)
        proto = torch.onnx.export(m, (x,), dynamo=True, verbose=False).model_proto
        ok = compare_onnx(proto, path=golden)
        assert ok.ok, str(ok)
        assert [(r.name, r.call) for r in ok.layers if r.name == "shared"] == [("shared", k) for k in range(3)]
        p = _copy(proto)
        _scale_init(p, "blocks.1.weight", 1.01)
        report = compare_onnx(p, path=golden)
    assert report.first_divergence is not None
    assert (report.first_divergence.name, report.first_divergence.call) == ("blocks.1", 0)
    assert report.origin is not None and report.origin.kind == "layer"
    # a golden of another model: refused naming the input, the recorded shape and the declared one
    with pytest.raises(ag.UnsupportedModelError, match=r"ONNX input 'x' is float32 of shape \(2, 3, 8, 8\).*another"):
        compare_onnx(proto, path=exported("cnn").golden)


def test_upstream_input_change_is_not_blamed_on_the_module(exported: Callable[[str], Exported]) -> None:
    e = exported("cnn")
    x = e.inputs[0].clone()
    x[0, 0, 0, 0] += 1.0
    report = _run(e.onnx_path, e, inputs=(x,))
    assert not report.ok
    assert report.input_changes
    _, kind = _first(report)
    assert kind == "inputs", str(report)  # on the golden's values the module computes the same


# --------------------------------------------------------------------------- float16


def test_float16_model_passes_calibrated_and_fails_a_weight_fault(exported: Callable[[str], Exported]) -> None:
    float16 = pytest.importorskip("onnxconverter_common.float16")
    e = exported("gpt2")
    half = float16.convert_float_to_float16(_copy(e.proto), keep_io_types=True)
    report = _run(half, e, tolerance="calibrated", allow_dtype_change=True)
    assert report.ok, str(report)
    assert sum(1 for x in report.layers if x.name) >= 15
    assert any("borrowed" in n for n in report.notes)
    bad = _copy(e.proto)
    _scale_init(bad, "h.1.mlp.c_fc.weight", 1.01)
    half_bad = float16.convert_float_to_float16(bad, keep_io_types=True)
    report = _run(half_bad, e, tolerance="calibrated", allow_dtype_change=True)
    assert not report.ok
    assert report.first_divergence.name == "h.1.mlp.c_fc", str(report)  # type: ignore[union-attr]
    assert report.origin is not None and report.origin.kind == "layer"  # replayed in float16 on the golden's values


# --------------------------------------------------------------------------- optimizations, errors


def test_default_optimization_says_which_mode_ran(exported: Callable[[str], Exported]) -> None:
    e = exported("bert")
    report = _run(e.onnx_path, e, optimization="default")
    assert report.ok, str(report)
    assert any("every graph optimization" in n for n in report.notes)
    with pytest.raises(ag.UnsupportedModelError, match="optimization='fast'"):
        _run(e.onnx_path, e, optimization="fast")


def test_bad_inputs_and_models_get_clear_errors(exported: Callable[[str], Exported], tmp_path: Any) -> None:
    e = exported("cnn")
    with pytest.raises(ag.UnsupportedModelError, match="takes 1 inputs"):
        _run(e.onnx_path, e, inputs=(e.inputs[0], e.inputs[0]))
    with pytest.raises(ag.UnsupportedModelError, match=r"\['y'\] are not inputs"):
        _run(e.onnx_path, e, inputs={"y": e.inputs[0]})
    with pytest.raises(ag.UnsupportedModelError, match="is not a file"):
        _run(str(tmp_path / "nope.onnx"), e)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ag.UnsupportedModelError, match="could not be read"):
        _run(str(bad), e)
    p = _copy(e.proto)
    prop = next(m for m in p.graph.node[0].metadata_props if m.key == SCOPES_KEY)
    prop.value = "['', oops"
    with pytest.raises(ag.UnsupportedModelError, match="name_scopes is not a Python list"):
        _run(p, e)
    golden = tmp_path / "noinputs.h5"
    with one_thread():
        ag.record(build_cnn(), cnn_input(), path=golden, inputs=False)
    with pytest.raises(ag.UnsupportedModelError, match="no recorded model inputs"):
        _run(e.onnx_path, Exported("cnn", str(golden), e.proto, e.onnx_path, e.inputs, {}))
    ok = _run(e.onnx_path, Exported("cnn", str(golden), e.proto, e.onnx_path, e.inputs, {}), inputs=e.inputs)
    assert ok.ok, str(ok)


def test_no_metadata_is_listed_not_silently_skipped(exported: Callable[[str], Exported]) -> None:
    e = exported("cnn")
    p = _copy(e.proto)
    for n in p.graph.node:
        del n.metadata_props[:]
    report = _run(p, e)
    assert report.ok  # the model's outputs still compared
    assert [x.name for x in report.layers] == [""]
    assert "not comparable" in " ".join(report.notes)


def _node(op: str, ins: list[str], outs: list[str], scopes: list[str] | None, **attrs: Any) -> Any:
    n = onnx.helper.make_node(op, ins, outs, name=outs[0], **attrs)
    if scopes is not None:
        for key, value in ((SCOPES_KEY, repr(scopes)), ("pkg.torch.onnx.class_hierarchy",
                                                       repr(["M"] * (len(scopes) - 1) + [f"aten.{op}"]))):
            entry = n.metadata_props.add()
            entry.key, entry.value = key, value
    return n


def test_scope_analysis_on_a_hand_built_graph() -> None:
    """Which values leave each module call, read from the name scopes of a graph built by hand: a
    value read only inside a subgraph (If) leaves the call making it and is external to the call
    reading it; an input handed on unchanged (Identity, a residual) is not the call's output; a
    module path holding a quote or backslash is read as Python reads it; a node without metadata
    belongs to the calls its neighbours share; and each call's outputs come in graph order."""
    h = onnx.helper
    f = onnx.TensorProto.FLOAT
    then = h.make_graph([h.make_node("Identity", ["a"], ["t"])], "then", [], [h.make_tensor_value_info("t", f, [2])])
    other = h.make_graph([h.make_node("Neg", ["a"], ["e"])], "else", [], [h.make_tensor_value_info("e", f, [2])])
    odd = "blocks.0.it's \\ odd"
    nodes = [
        _node("Relu", ["x"], ["a"], ["", "m1", "relu"]),
        _node("Sigmoid", ["a"], ["b"], ["", "m1", "m1.inner", "sigmoid"]),
        _node("Identity", ["x"], ["handed"], ["", "m1", "identity"]),
        _node("Constant", [], ["c"], None, value=h.make_tensor("cv", onnx.TensorProto.BOOL, [], [True])),
        _node("If", ["c"], ["y"], ["", "m2", "cond"], then_branch=then, else_branch=other),
        _node("Add", ["y", "b"], ["z"], ["", odd, "add"]),
        _node("Mul", ["z", "handed"], ["out"], ["", "mul"]),
    ]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", f, [2])], [h.make_tensor_value_info("out", f, [2])])
    g = OnnxGraph(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    by = {s.path: s for s in g.scopes}
    assert g.reads[4] == ["c", "a", "a"]  # the If's own input, then the outer value each branch reads
    assert by["m1"].escaping == ["a", "b"]  # "handed" is x handed on: not m1's value
    assert by["m1.inner"].escaping == ["b"] and by["m1.inner"].external == ["a"]
    assert by["m2"].external == ["a"] and by["m2"].escaping == ["y"]  # c is a constant: not external
    assert by[odd].escaping == ["z"] and g.stacks[5] == [("", "M"), (odd, "M")]
    assert g.stacks[3] == [("", "M"), ("m2", "M")]  # the Constant, without metadata: its one reader's
    assert [s.path for s in g.scopes] == ["m1.inner", "m1", "m2", odd]


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def fake(name: str, *a: Any, **k: Any) -> Any:
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ag.UnsupportedModelError, match=r"pip install 'activation_guard\[onnx\]'"):
        compare_onnx("model.onnx", path="golden.h5")


# --------------------------------------------------------------------------- CLI and pytest


def test_cli_onnx_command(exported: Callable[[str], Exported], tmp_path: Any,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from activation_guard.cli import main

    e = exported("cnn")
    assert main(["onnx", e.onnx_path, e.golden, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is True
    p = _copy(e.proto)
    _scale_init(p, "conv2.weight", 1.01)
    bad = tmp_path / "bad.onnx"
    onnx.save(p, str(bad))
    html = tmp_path / "r.html"
    assert main(["onnx", str(bad), e.golden, "--html", str(html)]) == 1
    out = capsys.readouterr().out
    assert "bn2" in out and html.is_file()
    assert main(["onnx", str(tmp_path / "missing.onnx"), e.golden]) == 2
    assert "is not a file" in capsys.readouterr().err


@pytest.mark.slow
def test_pytest_check_onnx_uses_the_eager_tests_golden(cnn: Exported, pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    e = cnn
    p = _copy(e.proto)
    _scale_init(p, "conv2.weight", 1.01)
    bad = pytester.path / "bad.onnx"
    onnx.save(p, str(bad))
    pytester.makepyfile(test_deploy=f"""
        from models import build_cnn, cnn_input

        def test_cnn(activation_guard):
            activation_guard.check(build_cnn(), cnn_input(), onnx={e.onnx_path!r})

        def test_bad(activation_guard):
            activation_guard.check(build_cnn(), cnn_input(), onnx={str(bad)!r})

        def test_onnx_alone_never_records(activation_guard):
            activation_guard.check_onnx({e.onnx_path!r}, name="other")
    """)
    import os

    # in a subprocess: an in-process run would also drop the modules it imported first
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    rec = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ag-update", "-q")
    rec.assert_outcomes(passed=1, failed=2)  # recording: the good export passes, the bad one is caught at once
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    res.assert_outcomes(passed=1, failed=2)
    goldens = sorted(p.name for p in pytester.path.rglob("*.h5"))
    assert len(goldens) == 2 and not any("alone" in g for g in goldens), goldens  # the eager checks' only
    res.stdout.fnmatch_lines(["*no golden for the ONNX check*"])
    res.stdout.fnmatch_lines(["*ONNX model bad.onnx*", "*bn2*", "goldens: 4 checked, 3 passed, 1 diverged*",
                              "DIVERGED test_deploy.py::test_bad (onnx): first divergence at layer 'bn2'*"])

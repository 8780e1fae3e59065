"""Compare: the right status at the right layer and call, tolerances, selection, fail_fast,
rename, compare_models and input fingerprints."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from models import one_thread, scale_weight, shared_loop, tiny_mlp
from torch import nn

import activation_guard as ag
from activation_guard._core.kernel import compare_tensors
from activation_guard.options.spec import CompareSpec
from activation_guard.options.tolerances import DTYPE_DEFAULTS, ToleranceResolver


def _resolver(golden_device=None, live_device=None, **options):
    return ToleranceResolver(CompareSpec.build(options), golden_device=golden_device, live_device=live_device)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():  # see models.one_thread: 1000x faster tiny forwards on a loaded machine
        yield


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


def statuses(rep) -> dict[tuple[str, int], str]:
    return {(r.name, r.call): r.status for r in rep.layers}


def where(rep) -> tuple[str, int, str] | None:
    fd = rep.first_divergence
    return None if fd is None else (fd.name, fd.call, fd.status)


# --------------------------------------------------------------------------- a model with switches


class Head(nn.Module):
    """A layer whose *own* output can change shape, dtype or structure; the parent undoes the
    change so that later layers are unaffected."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.mode = "plain"

    def forward(self, x):
        y = self.lin(x)
        if self.mode == "shape":
            return torch.cat([y, y[:, :1]], dim=1)
        if self.mode == "dtype":
            return y.double()
        if self.mode == "struct":
            return (y, y.sum())
        if self.mode == "nan":
            return y.masked_fill(torch.arange(6) == 2, float("nan"))
        return y


class Flex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 6)
        self.opt = nn.Tanh()
        self.new = nn.Identity()
        self.b = Head()
        self.shared = nn.Linear(6, 6)
        self.c = nn.Linear(6, 3)
        self.use_opt, self.use_new, self.loops = True, False, 2

    def forward(self, x):
        h = self.a(x)
        if self.use_opt:
            h = self.opt(h)
        if self.use_new:
            h = self.new(h)
        h = self.b(h)
        if isinstance(h, tuple):
            h = h[0]
        h = h[:, :6].float()
        for _ in range(self.loops):
            h = torch.tanh(self.shared(h))
        return self.c(h)


XF = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))


@pytest.fixture
def flex_golden(tmp_path):
    path = tmp_path / "flex.h5"
    ag.record(Flex(), XF, path=path)
    return path


def test_record_then_compare_passes(flex_golden):
    rep = ag.compare(Flex(), XF, path=flex_golden)
    assert rep.ok and rep.first_divergence is None
    assert all(r.status == "match" for r in rep.layers)
    assert [r.position for r in rep.layers] == list(range(len(rep.layers)))
    assert [(r.name, r.call) for r in rep.layers] == [
        ("a", 0), ("opt", 0), ("b.lin", 0), ("b", 0), ("shared", 0), ("shared", 1), ("c", 0), ("", 0)
    ]
    assert all(r.max_abs_diff == 0 for r in rep.layers)


def test_missing_layer_is_first_and_placed_in_order(flex_golden):
    m = Flex()
    m.use_opt = False  # `opt` no longer runs: everything after it changes too
    rep = ag.compare(m, XF, path=flex_golden)
    assert where(rep) == ("opt", 0, "missing")
    assert statuses(rep)[("b.lin", 0)] == "diverged"
    assert rep.layers[-1].name == "opt"  # golden-only layers come after the live ones
    assert rep.layers[-1].position is None and rep.layers[-1].golden_position == 1
    assert "did not run" in str(rep).splitlines()[0]


def test_added_layer_is_unexpected_at_its_position(flex_golden):
    m = Flex()
    m.use_new = True  # an Identity inserted after `opt`: values downstream are unchanged
    rep = ag.compare(m, XF, path=flex_golden)
    assert where(rep) == ("new", 0, "unexpected")
    assert rep.first_divergence.position == 2
    assert [r.name for r in rep.layers if not r.ok] == ["new"]
    assert "#3 of 9" in str(rep).splitlines()[0]


def test_more_calls_than_recorded(flex_golden):
    m = Flex()
    m.loops = 3
    rep = ag.compare(m, XF, path=flex_golden)
    st_ = statuses(rep)
    assert st_[("shared", 0)] == st_[("shared", 1)] == "match"
    assert where(rep) == ("shared", 2, "unexpected")
    assert "2 call(s)" in rep.first_divergence.detail


def test_fewer_calls_than_recorded(flex_golden):
    m = Flex()
    m.loops = 1
    rep = ag.compare(m, XF, path=flex_golden)
    assert where(rep) == ("shared", 1, "missing")  # before `c`, which now diverges
    assert statuses(rep)[("c", 0)] == "diverged"
    assert "made 1 call(s)" in rep.first_divergence.detail


@pytest.mark.parametrize(
    ("mode", "status", "detail"),
    [("shape", "shape", "[3, 6] -> [3, 7]"), ("dtype", "dtype", "float32 -> float64"),
     ("struct", "structure", "is missing from the live output")],
)
def test_shape_dtype_structure_change_at_that_layer(flex_golden, mode, status, detail):
    m = Flex()
    m.b.mode = mode
    rep = ag.compare(m, XF, path=flex_golden)
    assert where(rep) == ("b", 0, status)
    assert detail in rep.first_divergence.detail
    assert [r.name for r in rep.layers if not r.ok] == ["b"]  # the parent undid the change


def test_allow_dtype_change_compares_in_the_lower_precision(flex_golden):
    m = Flex()
    m.b.mode = "dtype"
    rep = ag.compare(m, XF, path=flex_golden, allow_dtype_change=True)
    assert rep.ok, str(rep)
    b = next(r for r in rep.layers if r.name == "b")
    assert "float32->float64" in b.tolerance_source


def test_new_nan_is_nonfinite_where_it_starts(flex_golden):
    m = Flex()
    m.b.mode = "nan"
    rep = ag.compare(m, XF, path=flex_golden)
    assert where(rep) == ("b", 0, "nonfinite")
    fd = rep.first_divergence
    assert fd.mismatched == 3 and fd.index == (0, 2)
    assert fd.live_value != fd.live_value  # NaN
    assert statuses(rep)[("b.lin", 0)] == "match"
    assert statuses(rep)[("shared", 0)] == "nonfinite"  # downstream layers see NaN too, but later
    assert "new NaN/Inf" in str(rep).splitlines()[0]


def test_golden_nan_matched_by_live_nan(tmp_path):
    m = Flex()
    m.b.mode = "nan"
    path = tmp_path / "nan.h5"
    ag.record(m, XF, path=path)
    rep = ag.compare(m, XF, path=path)
    assert rep.ok, str(rep)
    # NaN in the golden but a number live is a divergence, not a match
    m2 = Flex()
    rep2 = ag.compare(m2, XF, path=path)
    assert where(rep2) == ("b", 0, "diverged")


def test_inf_sign_flip_and_new_inf():
    g = torch.tensor([1.0, float("inf"), float("-inf"), float("nan")])
    assert compare_tensors(g, g.clone(), 1e-5, 1e-8).mismatched == 0
    st_ = compare_tensors(g, torch.tensor([1.0, float("-inf"), float("-inf"), float("nan")]), 1e-5, 1e-8)
    assert st_.mismatched == 1 and st_.nonfinite_new == 0 and st_.worst_flat == 1
    assert st_.max_abs_diff == float("inf")
    st_ = compare_tensors(g, torch.tensor([1.0, 5.0, float("-inf"), float("nan")]), 1e-5, 1e-8)
    assert st_.mismatched == 1 and st_.worst_flat == 1  # a golden inf is not "close" to 5.0
    assert st_.golden_value == float("inf") and st_.live_value == 5.0
    st_ = compare_tensors(g, torch.tensor([float("inf"), float("inf"), float("-inf"), float("nan")]), 1e-5, 1e-8)
    assert st_.mismatched == 1 and st_.nonfinite_new == 1 and st_.worst_flat == 0


# --------------------------------------------------------------------------- one perturbed layer


@pytest.fixture(scope="module")
def mlp_golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "mlp.h5"
    ag.record(tiny_mlp(depth=5), X, path=path)
    return path


@given(k=st.integers(0, 5))
def test_scaled_weight_found_at_exactly_that_layer(mlp_golden, k):
    m = tiny_mlp(depth=5)
    layer = "head" if k == 5 else f"blocks.{k}.fc"
    scale_weight(m, layer, 1 + 1e-3)
    rep = ag.compare(m, X, path=mlp_golden)
    assert where(rep) == (layer, 0, "diverged"), str(rep)
    before = [r for r in rep.layers if r.position < rep.first_divergence.position]
    assert len(before) == rep.first_divergence.position and all(r.ok for r in before)


@pytest.fixture(scope="module")
def loop_golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop") / "loop.h5"
    ag.record(shared_loop(steps=4), X[:, :6], path=path)
    return path


@given(k=st.integers(0, 3))
def test_shared_layer_diverges_at_the_right_call(loop_golden, k):
    m = shared_loop(steps=4)
    scale_weight(m, f"blocks.{k}", 1 + 1e-3)
    rep = ag.compare(m, X[:, :6], path=loop_golden)
    assert where(rep) == (f"blocks.{k}", 0, "diverged")
    calls = {r.call: r.status for r in rep.layers if r.name == "shared"}
    assert [calls[j] for j in range(k + 1)] == ["match"] * k + ["diverged"]
    (first_shared,) = [r for r in rep.divergences if r.name == "shared"][:1]
    assert first_shared.call == k


def test_scaling_the_shared_weight_is_call_0(loop_golden):
    m = shared_loop(steps=4)
    scale_weight(m, "shared", 1 + 1e-3)
    assert where(ag.compare(m, X[:, :6], path=loop_golden)) == ("shared", 0, "diverged")


# --------------------------------------------------------------------------- tolerances


def test_global_rtol_atol(mlp_golden):
    m = tiny_mlp(depth=5)
    scale_weight(m, "blocks.1.fc", 1 + 1e-3)
    assert not ag.compare(m, X, path=mlp_golden).ok
    rep = ag.compare(m, X, path=mlp_golden, rtol=1e-2, atol=1e-3)
    assert rep.ok, str(rep)
    lr = next(r for r in rep.layers if r.name == "blocks.1.fc")
    assert (lr.rtol, lr.atol, lr.tolerance_source) == (1e-2, 1e-3, "rtol/atol option")
    assert lr.max_abs_diff > 0
    # atol alone keeps the float32 default rtol
    rep = ag.compare(m, X, path=mlp_golden, atol=1.0)
    lr = next(r for r in rep.layers if r.name == "blocks.1.fc")
    assert rep.ok and (lr.rtol, lr.atol) == (DTYPE_DEFAULTS["float32"][0], 1.0)


def test_per_layer_patterns_most_specific_wins(mlp_golden):
    m = tiny_mlp(depth=5)
    scale_weight(m, "blocks.1.fc", 1 + 1e-3)
    tols = {
        "*": dict(rtol=1e-2, atol=1e-3),
        "blocks.*.fc": dict(rtol=0, atol=0),  # exact for every fc ...
        "blocks.1.fc": (0.5, 0.5),  # ... except the perturbed one (exact name beats glob)
    }
    rep = ag.compare(m, X, path=mlp_golden, tolerances=tols)
    by = {r.name: r for r in rep.layers}
    assert by["blocks.1.fc"].ok and by["blocks.1.fc"].tolerance_source == "tolerances['blocks.1.fc']"
    assert by["blocks.0.fc"].ok  # exact but untouched
    assert by["blocks.1.act"].ok and by["blocks.1.act"].rtol == 1e-2
    assert where(rep) == ("blocks.2.fc", 0, "diverged")
    fd = rep.first_divergence
    assert (fd.rtol, fd.atol, fd.tolerance_source) == (0.0, 0.0, "tolerances['blocks.*.fc']")
    # a pattern beats the global option
    rep = ag.compare(m, X, path=mlp_golden, rtol=1e-2, atol=1e-6, tolerances={"blocks.1.*": dict(rtol=1e-6)})
    assert where(rep) == ("blocks.1.fc", 0, "diverged")
    assert (rep.first_divergence.rtol, rep.first_divergence.atol) == (1e-6, 1e-6)  # atol from the global


def test_resolver_precedence_and_exact_kinds():
    r = _resolver(rtol=1e-3,
                  tolerances={"enc.*": (1e-2, None), "enc.*.attn": dict(rtol=1e-4), "enc.0.attn": dict(atol=7.0)})
    t = r.resolve("enc.0.attn", "float32")
    assert (t.rtol, t.atol) == (1e-3, 7.0)  # exact name wins; unspecified rtol from the global
    t = r.resolve("enc.1.attn", "float32")
    # the source names where each number came from: the pattern set rtol, atol is the default
    assert (t.rtol, t.atol, t.source) == (1e-4, 1e-5, "rtol: tolerances['enc.*.attn']; atol: float32 default")
    t = _resolver(rtol=1e-3).resolve("x", "float32")
    assert t.source == "rtol: rtol/atol option; atol: float32 default"
    assert _resolver(rtol=1e-3, atol=1e-4).resolve("x", "float32").source == "rtol/atol option"
    assert r.resolve("enc.1.mlp", "float16").rtol == 1e-2
    assert r.resolve("dec", "bfloat16").rtol == 1e-3
    assert (r.resolve("enc.0.attn", "int64", "int").rtol, r.resolve("enc.0.attn", "bool", "bool").atol) == (0.0, 0.0)
    assert _resolver().resolve("x", "float16") == ag.Tolerance(1e-3, 1e-5, "float16 default")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(rtol=-1), ValueError, "rtol"),
        (dict(atol=float("nan")), ValueError, "atol"),
        (dict(rtol="1e-3x"), TypeError, r"rtol='1e-3x' \(argument\): must be a number"),
        (dict(tolerances={"a.*": dict(rtool=1)}), ValueError, r"tolerances\['a\.\*'\].*rtool"),
        (dict(tolerances={"a": 0.1}), TypeError, r"tolerances\['a'\]"),
        (dict(tolerances={"a": {}}), ValueError, "neither"),
        (dict(tolerances={3: (0, 0)}), TypeError, "glob"),
        (dict(tolerances=[("a", (0, 0))]), TypeError, "tolerances"),
    ],
)
def test_bad_tolerances_name_the_option(mlp_golden, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ag.compare(tiny_mlp(depth=5), X, path=mlp_golden, **kwargs)


def test_integers_compare_exactly_even_with_loose_tolerance(tmp_path):
    class Argmax(nn.Module):
        def __init__(self, off=0):
            super().__init__()
            self.off = off

        def forward(self, x):
            return x.argmax(-1) + self.off

    path = tmp_path / "g.h5"
    ag.record(Argmax(), X, path=path)
    rep = ag.compare(Argmax(1), X, path=path, rtol=10.0, atol=10.0)
    assert where(rep) == ("", 0, "diverged")
    assert rep.first_divergence.mismatched == 4 and rep.first_divergence.rtol == 0.0


# --------------------------------------------------------------------------- selection, fail_fast


def test_include_exclude_in_compare(mlp_golden):
    m = tiny_mlp(depth=5)
    scale_weight(m, "blocks.1.fc", 1 + 1e-3)
    rep = ag.compare(m, X, path=mlp_golden, include="blocks.0*")
    assert rep.ok and {r.name for r in rep.layers} == {"blocks.0.fc", "blocks.0.act", "blocks.0"}
    rep = ag.compare(m, X, path=mlp_golden, include=["blocks.1.fc", "head"])
    assert [(r.name, r.status) for r in rep.layers] == [("blocks.1.fc", "diverged"), ("head", "diverged")]
    rep = ag.compare(m, X, path=mlp_golden, exclude=["blocks.[1-4]*", "head", ""])
    assert rep.ok and len(rep.layers) == 3  # only blocks.0.* left, not reported as missing


def test_golden_recorded_with_include_compares_without_repeating_it(tmp_path):
    m = tiny_mlp(depth=3)
    path = tmp_path / "sub.h5"
    ag.record(m, X, path=path, include="blocks.*.fc", exclude="blocks.2*")
    rep = ag.compare(m, X, path=path)
    assert rep.ok, str(rep)
    assert [r.name for r in rep.layers] == ["blocks.0.fc", "blocks.1.fc"]
    scale_weight(m, "blocks.1.fc")
    assert where(ag.compare(m, X, path=path)) == ("blocks.1.fc", 0, "diverged")


def test_a_golden_holding_calls_outside_its_recorded_selection_is_refused(tmp_path):
    """The recorded selection applies to the comparison by default. A golden whose meta was edited
    to claim include=["blocks.0.fc"] while its index still holds every layer would compare one
    layer and pass a changed output; it is refused naming the file and a stray layer. A real
    selective golden passes with a note saying what it holds."""
    import json
    import zlib

    import h5py
    import numpy as np

    m = tiny_mlp(depth=3)
    full, sub = tmp_path / "full.h5", tmp_path / "sub.h5"
    ag.record(m, X, path=full)
    ag.record(m, X, path=sub, include="blocks.0.fc")
    with h5py.File(full, "r+") as f:
        meta = json.loads(f["meta"][()].tobytes())
        meta["include"] = ["blocks.0.fc"]
        raw = json.dumps(meta).encode()
        del f["meta"]
        f.create_dataset("meta", data=np.frombuffer(raw, np.uint8))
        f.attrs["meta_crc32"] = np.int64(zlib.crc32(raw))
    scale_weight(m, "head")
    with pytest.raises(ag.GoldenFormatError, match=r"outside the selection its metadata says it was recorded with"
                                                   r".*include=\['blocks.0.fc'\]") as ei:
        ag.compare(m, X, path=full)
    assert str(full) in str(ei.value)
    with pytest.raises(ag.GoldenFormatError, match="the file was edited"):
        ag.diff_recordings(full, sub)
    rep = ag.compare(m, X, path=sub)
    assert rep.ok and [r.name for r in rep.layers] == ["blocks.0.fc"]
    assert any("recorded with include=['blocks.0.fc']: it holds only those layers' outputs" in n for n in rep.notes)


def test_fail_fast_stops_the_forward(mlp_golden):
    m = tiny_mlp(depth=5)
    scale_weight(m, "blocks.1.fc", 1 + 1e-3)
    ran = []
    h = m.head.register_forward_pre_hook(lambda mod, a: ran.append(1))
    rep = ag.compare(m, X, path=mlp_golden, fail_fast=True)
    h.remove()
    assert ran == []  # the forward never got to the head
    assert rep.stopped_early and not rep.ok
    assert where(rep) == ("blocks.1.fc", 0, "diverged")
    assert rep.layers[-1].name == "blocks.1.fc"
    assert not any(r.status == "missing" for r in rep.layers)  # unreached layers are not "missing"
    assert rep.output is None
    assert "fail_fast" in str(rep)
    full = ag.compare(m, X, path=mlp_golden)
    assert len(full.layers) > len(rep.layers) and not full.stopped_early


def test_fail_fast_on_a_passing_model_runs_everything(mlp_golden):
    rep = ag.compare(tiny_mlp(depth=5), X, path=mlp_golden, fail_fast=True)
    assert rep.ok and not rep.stopped_early and rep.output is not None


# --------------------------------------------------------------------------- rename, compare_models


class Named(nn.Module):
    """The same computation under configurable names: <outer>.<lst>.<i>.<leaf>."""

    def __init__(self, outer: str = "encoder", lst: str = "blocks", leaf: str = "fc", seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.outer, self.lst, self.leaf = outer, lst, leaf
        body = nn.Module()
        blocks = nn.ModuleList()
        for _ in range(3):
            b = nn.Module()
            b.add_module(leaf, nn.Linear(8, 8))
            blocks.append(b)
        body.add_module(lst, blocks)
        self.add_module(outer, body)

    def forward(self, x):
        for b in getattr(getattr(self, self.outer), self.lst):
            x = torch.tanh(getattr(b, self.leaf)(x))
        return x


def test_rename_prefix_rule(tmp_path):
    path = tmp_path / "old.h5"
    ag.record(Named("encoder"), X, path=path)
    live = Named("backbone")
    plain = ag.compare(live, X, path=path)
    assert {r.status for r in plain.layers} == {"match", "unexpected", "missing"}
    rep = ag.compare(live, X, path=path, rename={"encoder": "backbone"})
    assert rep.ok, str(rep)
    fc0 = rep.layers[0]
    assert (fc0.name, fc0.golden_name) == ("backbone.blocks.0.fc", "encoder.blocks.0.fc")
    # prefixes match whole dotted components only
    rep = ag.compare(live, X, path=path, rename={"enc": "backbone"})
    assert not rep.ok


def test_rename_pattern_rule_and_error_is_reported_under_the_live_name(tmp_path):
    path = tmp_path / "old.h5"
    ag.record(Named("encoder", "blocks", "fc"), X, path=path)
    live = Named("encoder", "layers", "linear")
    rep = ag.compare(live, X, path=path, rename={"encoder.blocks.*.fc": "encoder.layers.*.linear"})
    assert rep.ok, str(rep)
    scale_weight(live, "encoder.layers.1.linear")
    rep = ag.compare(live, X, path=path, rename={"encoder.blocks.*.fc": "encoder.layers.*.linear"})
    fd = rep.first_divergence
    assert (fd.name, fd.golden_name, fd.status) == ("encoder.layers.1.linear", "encoder.blocks.1.fc", "diverged")
    assert "encoder.blocks.1.fc" in str(rep)


def test_bad_rename_rules(tmp_path):
    path = tmp_path / "old.h5"
    ag.record(Named(), X, path=path)
    with pytest.raises(ValueError, match="wildcards"):
        ag.compare(Named(), X, path=path, rename={"encoder.*.fc": "a.*.*"})
    with pytest.raises(ValueError, match="both"):
        ag.compare(Named(), X, path=path, rename={"encoder.blocks.*.fc": "same"})
    with pytest.raises(TypeError, match="rename"):
        ag.compare(Named(), X, path=path, rename={"encoder": 3})


def test_compare_models(tmp_path):
    ref = tiny_mlp(depth=4)
    cand = copy.deepcopy(ref)
    rep = ag.compare_models(ref, cand, X)
    assert rep.ok and rep.path.startswith("<reference")
    scale_weight(cand, "blocks.2.fc", 1 + 1e-3)
    rep = ag.compare_models(ref, cand, X)
    assert where(rep) == ("blocks.2.fc", 0, "diverged")
    assert ag.compare_models(ref, cand, X, rtol=1e-2, atol=1e-3).ok
    rep = ag.compare_models(Named("encoder"), Named("backbone"), X, rename={"encoder": "backbone"})
    assert rep.ok, str(rep)


# --------------------------------------------------------------------------- inputs, output


def test_input_fingerprint_change_is_reported_first(mlp_golden):
    m = tiny_mlp(depth=5)
    rep = ag.compare(m, X + 1e-3, path=mlp_golden)
    assert not rep.ok
    assert rep.input_changes == ["input args/0: same dtype and shape, different values"]
    lines = str(rep).splitlines()
    assert lines[1].startswith("  origin        : '<root>' (TinyMLP) the model's inputs differ from the recording")
    assert rep.origin is not None and rep.origin.kind == "inputs"
    assert lines[2].startswith("  NOTE inputs differ")
    assert rep.to_dict()["input_changes"] == rep.input_changes
    rep = ag.compare(m, X[:2], path=mlp_golden)
    assert rep.input_changes == ["input args/0: float32 [4, 8] -> float32 [2, 8]"]
    assert ag.compare(m, X.clone(), path=mlp_golden).input_changes == []


def test_report_output_is_the_model_output(mlp_golden):
    m = tiny_mlp(depth=5)
    rep = ag.compare(m, X, path=mlp_golden)
    with torch.no_grad():
        assert torch.equal(rep.output, m(X))


# --------------------------------------------------------------------------- review regressions


@pytest.mark.parametrize(("change", "first"), [("use_opt", ("opt", 0, "missing")), ("loops", ("shared", 1, "missing"))])
def test_fail_fast_keeps_a_missing_call_that_precedes_the_stop(flex_golden, change, first):
    """A call the golden ran before the layer where fail_fast stopped did not run: it is the
    first divergence with or without fail_fast (not the downstream layer that then diverged)."""
    m = Flex()
    if change == "use_opt":
        m.use_opt = False
    else:
        m.loops = 1
    assert where(ag.compare(m, XF, path=flex_golden)) == first
    rep = ag.compare(m, XF, path=flex_golden, fail_fast=True)
    assert rep.stopped_early
    assert where(rep) == first, str(rep)
    assert "did not run" in str(rep).splitlines()[0]
    assert sum(r.status == "missing" for r in rep.layers) == 1  # unreached calls are still not listed


def test_rename_keeps_the_goldens_recorded_selection(tmp_path):
    """Layers a golden never recorded (its include/exclude) are not "unexpected" because the
    compare also renames layers."""
    path = tmp_path / "sel.h5"
    ag.record(Named("encoder"), X, path=path, include="encoder.blocks.*.fc")
    assert ag.compare(Named("encoder"), X, path=path).ok
    rep = ag.compare(Named("backbone"), X, path=path, rename={"encoder": "backbone"})
    assert rep.ok, str(rep)
    assert [r.name for r in rep.layers] == [f"backbone.blocks.{i}.fc" for i in range(3)]
    path2 = tmp_path / "sel2.h5"
    ag.record(Named("encoder"), X, path=path2, exclude=["", "encoder.blocks.2.fc"])
    assert ag.compare(Named("backbone"), X, path=path2, rename={"encoder": "backbone"}).ok


class Swapped(nn.Module):
    """`old` renamed to `new`, while a different layer now carries the old name."""

    def __init__(self, rename: bool):
        super().__init__()
        torch.manual_seed(0)
        self.old = nn.Linear(8, 8)
        if rename:
            self.new = self.old
            self.old = nn.Identity()

    def forward(self, x):
        if hasattr(self, "new"):
            return self.old(self.new(x))
        return self.old(x)


def test_a_live_layer_named_like_a_renamed_golden_layer_is_unexpected(tmp_path):
    path = tmp_path / "swap.h5"
    ag.record(Swapped(False), X, path=path)
    rep = ag.compare(Swapped(True), X, path=path, rename={"old": "new"})
    st_ = statuses(rep)
    assert st_[("new", 0)] == "match"
    # the live `old` is a new layer: the golden's `old` is the live `new`
    assert st_[("old", 0)] == "unexpected", str(rep)
    assert where(rep) == ("old", 0, "unexpected")
    assert "not in the golden" in rep.first_divergence.detail


def test_exact_compare_reports_the_largest_relative_difference():
    st_ = compare_tensors(torch.tensor([1000, 1]), torch.tensor([1010, 2]), 0.0, 0.0)
    assert (st_.mismatched, st_.max_abs_diff, st_.worst_flat) == (2, 10.0, 0)
    assert st_.max_rel_diff == 1.0  # element 1: |2 - 1| / 1, not just the worst element's 0.01
    big = compare_tensors(torch.tensor([2**62, 0]), torch.tensor([2**62 + 1, 0]), 0.0, 0.0)
    assert big.max_abs_diff == 1.0 and big.max_rel_diff > 0
    b = compare_tensors(torch.tensor([True, False]), torch.tensor([True, True]), 0.0, 0.0)
    assert b.max_rel_diff == math.inf


def test_diff_recordings_keeps_the_goldens_recorded_selection(tmp_path):
    """Like compare, diff defaults to the layers the golden recorded: the other recording's
    extra layers are not "unexpected"."""
    g, o = tmp_path / "g.h5", tmp_path / "o.h5"
    ag.record(tiny_mlp(depth=5), X, path=g, include="blocks.*.fc")
    ag.record(tiny_mlp(depth=5), X, path=o)
    assert ag.compare(tiny_mlp(depth=5), X, path=g).ok
    rep = ag.diff_recordings(g, o)
    assert rep.ok, str(rep)
    assert [r.name for r in rep.layers] == [f"blocks.{i}.fc" for i in range(5)]


def test_diff_keeps_reference_leaves_of_the_other_recording(tmp_path):
    """A repeated container is a ``ref`` leaf; diff must rebuild it with its target path, or a
    recording diffed against itself reports a structure change."""

    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
            d = [x * 2]
            return {"a": d, "b": d}

    g = tmp_path / "g.h5"
    ag.record(Twice(), X, path=g)
    rep = ag.diff_recordings(g, g)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_a_difference_that_overflows_the_dtype_is_its_true_size_not_inf(dtype):
    """3e38 vs -3e38 in float32: the difference is 6e38, which float32 cannot hold; the report
    once said 'max abs diff inf' (and plotted it on the inf / NaN line) with no Inf anywhere."""
    from activation_guard._core.kernel import compare_tensors

    g = torch.tensor([3e38, 1.0]).to(dtype)
    lv = torch.tensor([-3e38, 1.0]).to(dtype)
    st = compare_tensors(g, lv, 1e-5, 1e-5)
    assert st.mismatched == 1 and st.nonfinite_new == 0 and st.worst_flat == 0
    assert st.max_abs_diff == pytest.approx(6e38, rel=1e-6) and st.max_rel_diff == pytest.approx(2.0, rel=1e-6)
    inf = compare_tensors(g, torch.tensor([float("inf"), 1.0]).to(dtype), 1e-5, 1e-5)  # a real Inf stays inf
    assert inf.max_abs_diff == float("inf") and inf.nonfinite_new == 1


_SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-30, 3e38, -3e38, float("inf"), float("-inf"), float("nan"), 1.0000001, 2.5]


def _rule32(a: float, b: float, rtol: float, atol: float) -> bool:
    """The element rule as documented, evaluated as the kernel does in float32 (float64 where a
    float32 difference or tolerance overflows)."""
    import numpy as np

    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    f = np.float32
    with np.errstate(over="ignore"):
        d, tol = abs(f(b) - f(a)), f(atol) + f(rtol) * abs(f(a))
    if math.isinf(d) or math.isinf(tol):
        return abs(b - a) <= atol + rtol * abs(a)
    return bool(d <= tol)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_SPECIAL) | st.floats(-1e6, 1e6, width=32),
                          st.sampled_from(_SPECIAL) | st.floats(-1e6, 1e6, width=32)), min_size=1, max_size=12),
       st.sampled_from([0.0, 1e-5, 0.1]), st.sampled_from([0.0, 1e-6, 1.0]), st.booleans())
@example([(0.0, 1.0)], 0.0, 1.0, False)  # exactly at the tolerance: passes
@example([(3e38, 0.0)], 0.1, 0.0, True)  # a complex64 modulus that overflows must not make the tolerance inf
def test_element_rule_is_the_documented_rule(pairs: list[tuple[float, float]], rtol: float, atol: float,
                                             cplx: bool) -> None:
    """Whichever path the kernel's element rule takes (all differences finite or not), it decides
    each element as documented: NaN matches NaN, an infinity only itself, a new non-finite live
    value never passes, otherwise |live - golden| <= atol + rtol * |golden|."""
    from activation_guard._core.kernel import element_rule

    g = torch.tensor([a for a, _ in pairs], dtype=torch.float32)
    lv = torch.tensor([b for _, b in pairs], dtype=torch.float32)
    if cplx:  # the imaginary part equal on both sides: the real parts decide, the modulus may overflow
        g, lv = torch.complex(g, g), torch.complex(lv, g)
    ok = element_rule(g, lv, g.dtype, rtol, atol)[5].tolist()
    if not cplx:
        for i in range(len(pairs)):
            a, b = float(g[i]), float(lv[i])
            assert ok[i] == _rule32(a, b, rtol, atol), (a, b, rtol, atol)
        return
    for i in range(len(pairs)):
        a, b = float(g[i].real), float(lv[i].real)
        if math.isfinite(a) and math.isfinite(b):  # |d| is the real difference; |golden| is widened if it overflows
            want = abs(b - a) <= atol + rtol * abs(complex(a, a))
            if not (math.isclose(abs(b - a), atol + rtol * abs(complex(a, a)), rel_tol=1e-6)):
                assert ok[i] == want, (a, b, rtol, atol)
    nan = torch.tensor([complex(float("nan"), 0.0)], dtype=g.dtype)  # forces the path that masks non-finite values
    slow = element_rule(torch.cat([g, nan]), torch.cat([lv, nan]), g.dtype, rtol, atol)[5].tolist()[:-1]
    assert ok == slow


_VALUES = st.sampled_from(_SPECIAL) | st.floats(-1e6, 1e6, width=32) | st.sampled_from([1e-7, 2e-7, -1e-7])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_VALUES, _VALUES), min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]),
       st.sampled_from([None, torch.float32, torch.float64]), st.sampled_from([0.0, 1e-5, 0.1]),
       st.sampled_from([0.0, 1e-6, 1.0, 1e39]), st.sampled_from([4, 7, 1 << 18]))
@example([(1.0, 1.0), (2.0, 2.0 + 1e-7), (3.0, 3.0 + 1e-7), (0.0, 0.0)], torch.float32, None, 0.0, 1e-6, 1 << 18)
@example([(0.0, 0.0), (0.0, 1e-7), (3e38, -3e38), (1.0, 1.0)], torch.float32, None, 0.0, 1e39, 2)  # overflow, widened
@example([(0.0, 0.0)] * 5 + [(1.0, 1.0 + 1e-6)] * 5, torch.float64, torch.float32, 0.0, 1.0, 4)  # ties across chunks
def test_one_pass_search_gives_what_the_second_search_gave(pairs: list[tuple[float, float]], dtype: torch.dtype,
                                                           live_dtype: torch.dtype | None, rtol: float, atol: float,
                                                           chunk: int) -> None:
    """The kernel's one-pass position of a passing tensor's largest difference (numpy's argmax on
    the CPU) changes nothing: every statistic, the worst element's position and both its values
    are those of the second search, for any values (NaN, infinities, ties, zeros), dtypes, chunk
    boundaries and tolerances, passing or not."""
    from activation_guard._core import kernel

    g = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    lv = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    if dtype.is_complex:
        g, lv = torch.complex(g, g.flip(0)), torch.complex(lv, g.flip(0))
    g, lv = g.to(dtype), lv.to(live_dtype if live_dtype is not None and not dtype.is_complex else dtype)
    old = kernel.CHUNK
    kernel.CHUNK = chunk  # several chunks: the best one is chosen as before
    try:
        fast = kernel.compare_tensors(g, lv, rtol, atol)
        slow = kernel.compare_tensors(g, lv, rtol, atol, one_pass=False)
    finally:
        kernel.CHUNK = old

    def same(a: object, b: object) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or (
            isinstance(a, complex) and isinstance(b, complex) and same(a.real, b.real) and same(a.imag, b.imag))

    for f in ("numel", "mismatched", "nonfinite_new", "max_abs_diff", "max_rel_diff", "worst_flat", "golden_value",
              "live_value"):
        assert same(getattr(fast, f), getattr(slow, f)), (f, fast, slow)
    assert fast.worst_flat is not None  # and the values shown are the elements at that position
    assert same(fast.golden_value, g.reshape(-1)[fast.worst_flat].item())
    assert same(fast.live_value, lv.reshape(-1)[fast.worst_flat].item())

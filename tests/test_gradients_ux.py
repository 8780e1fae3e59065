"""Gradients through every front end: calibrated mode, the pytest plugin (marker and
``check()``), tolerances and globs, HTML, plot, ``inspect`` and textconv."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models import build_cnn, cnn_input
from test_calibrate import tiny_input, tiny_transformer
from test_gradients_faults import with_scaled_backward
from torch import nn

import activation_guard as ag
from activation_guard._core import tf32
from activation_guard._core.errors import UncalibratedGoldenError
from activation_guard.report import visual
from activation_guard.report.inspect_text import format_inspect, textconv_lines
from activation_guard.report.inspection import inspect_golden

# --------------------------------------------------------------------------- calibrated mode


@pytest.mark.slow
def test_a_tf32_run_fails_strict_gradients_and_passes_calibrated_ones(tmp_path: Path) -> None:
    p = tmp_path / "g.h5"
    model, x = tiny_transformer(), tiny_input()
    ag.record(model, x, path=p, backward=True, calibrate=True)
    with ag.read_golden(p) as r:
        floors = r.meta["backward"]["calibration"]["floors"]
        grads = [(c.grad, c.name, c.call, leaf.path) for c in r.backward for leaf in c.leaves if leaf.kind == "tensor"]
    measured = [floors[name][str(call)][f"{grad}:{path}"] for grad, name, call, path in grads]
    assert all(isinstance(f, list) and f[0] >= 0 for f in measured)  # a float64 backward measured every gradient
    assert sum(1 for f in measured if f[0] > 0) > 0.8 * len(measured)  # (the output's own gradients are exact)
    with tf32.emulate_tf32():
        strict = ag.compare(model, x, path=p)
        calibrated = ag.compare(model, x, path=p, tolerance="calibrated")
    assert not strict.ok
    assert sum(1 for r in strict.layers if r.phase != "forward" and not r.ok) > 10
    assert calibrated.ok, str(calibrated)
    mults = [r.error_multiple for r in calibrated.layers if r.phase != "forward" and r.name]
    assert mults and all(m is not None and 0 <= m <= 1 for m in mults) and max(mults) > 0.2
    assert any(n.startswith("backward: calibrated tolerances") and "gradients judged" in n for n in calibrated.notes)
    with_scaled_backward(model.blocks[1].act)
    with tf32.emulate_tf32():
        bad = ag.compare(model, x, path=p, tolerance="calibrated")
    fd = bad.first_divergence
    assert fd is not None and (fd.phase, fd.name, fd.wrt) == ("backward", "blocks.1.act", "input"), str(bad)
    assert fd.error_multiple is not None and fd.error_multiple > 10


def test_calibrated_gradients_need_a_calibrated_golden(tmp_path: Path) -> None:
    model, x = tiny_transformer(), tiny_input()
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    with pytest.raises(UncalibratedGoldenError):
        ag.compare(model, x, path=tmp_path / "g.h5", tolerance="calibrated")


# --------------------------------------------------------------------------- tolerances and globs


def test_tolerances_and_include_apply_to_gradients(tmp_path: Path) -> None:
    model, x = build_cnn(), cnn_input()
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    with_scaled_backward(model.relu2)
    assert not ag.compare(model, x, path=tmp_path / "g.h5").ok
    loose = ag.compare(model, x, path=tmp_path / "g.h5", rtol=0.02)
    assert loose.ok and loose.grad_count > 0
    only = ag.compare(model, x, path=tmp_path / "g.h5", tolerances={"*": {"rtol": 0.02}, "bn1": {"rtol": 0}})
    assert not only.ok and {r.name for r in only.layers if not r.ok} == {"bn1"}
    # a golden recorded for some layers only: gradients of those layers only
    ag.record(build_cnn(), x, path=tmp_path / "sel.h5", backward=True, include=["conv*", "fc"])
    report = ag.compare(build_cnn(), x, path=tmp_path / "sel.h5")
    assert report.ok and {r.name for r in report.layers if r.phase != "forward"} == {"conv1", "conv2", "fc"}


def test_fail_fast_in_the_forward_skips_the_backward_and_says_so(tmp_path: Path) -> None:
    model, x = build_cnn(), cnn_input()
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    with torch.no_grad():
        model.conv1.weight.mul_(1.01)
    report = ag.compare(model, x, path=tmp_path / "g.h5", fail_fast=True)
    assert report.stopped_early and report.grad_count == 0
    assert any("gradients were not compared: the forward stopped" in n for n in report.notes)
    full = ag.compare(model, x, path=tmp_path / "g.h5")
    assert full.first_divergence is not None and full.first_divergence.phase == "forward"  # the forward first
    assert full.grad_count > 0 and "first divergence at layer 'conv1'" in full.headline()


def test_backward_false_compares_the_forward_only_and_says_so(tmp_path: Path) -> None:
    model, x = build_cnn(), cnn_input()
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    with_scaled_backward(model.relu2)
    report = ag.compare(model, x, path=tmp_path / "g.h5", backward=False)
    assert report.ok and report.grad_count == 0
    assert "backward: the golden has gradients; not compared (backward=False)" in report.notes


def test_compare_models_with_backward(tmp_path: Path) -> None:
    ref, x = build_cnn(), cnn_input()
    cand = build_cnn()
    with_scaled_backward(cand.relu1)
    report = ag.compare_models(ref, cand, x, backward=True)
    assert report.first_divergence is not None and report.first_divergence.name == "relu1"
    assert report.first_divergence.phase == "backward"


def test_diff_of_two_recordings_compares_their_gradients(tmp_path: Path) -> None:
    model, x = build_cnn(), cnn_input()
    for name in ("a", "b"):
        ag.record(model, x, path=tmp_path / f"{name}.h5", backward=True)
    ag.record(model, x, path=tmp_path / "fwd.h5")
    assert ag.diff_recordings(tmp_path / "a.h5", tmp_path / "b.h5").grad_count > 0
    with_scaled_backward(model.relu2)
    ag.record(model, x, path=tmp_path / "bad.h5", backward=True)
    report = ag.diff_recordings(tmp_path / "a.h5", tmp_path / "bad.h5")
    fd = report.first_divergence
    assert fd is not None and (fd.phase, fd.name, fd.wrt) == ("backward", "relu2", "input")
    only = ag.diff_recordings(tmp_path / "a.h5", tmp_path / "fwd.h5")
    assert only.ok and "backward: only the golden has gradients; they were not compared" in only.notes


# --------------------------------------------------------------------------- HTML, plot, inspect


@pytest.fixture
def diverged(tmp_path: Path) -> tuple[Path, ag.Report]:
    model, x = build_cnn(), cnn_input()
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    with_scaled_backward(model.relu2)
    return tmp_path / "g.h5", ag.compare(model, x, path=tmp_path / "g.h5")


def test_html_marks_gradient_rows_and_the_backward_first_divergence(diverged: tuple[Path, ag.Report],
                                                                      tmp_path: Path) -> None:
    _, report = diverged
    page = visual.html_page(report, plots="none")
    assert page.count('<span class="phase">grad in</span>') == sum(
        1 for r in report.layers if r.phase == "backward" and r.wrt == "input")
    assert '<span class="phase">param grads</span>' in page
    assert "First divergence: <a href=\"#first-divergence\">relu2[0] (grad wrt input)</a> (values outside " in page


def test_markdown_summary_names_the_gradient(diverged: tuple[Path, ag.Report]) -> None:
    from activation_guard.report.markdown import _divergence

    _, report = diverged
    assert _divergence(report, None) == ("backward pass: `relu2` (ReLU) call 0, gradient w.r.t. its input args/0: "
                                         "values outside tolerance; origin: layer")


@pytest.mark.slow
def test_plot_draws_the_backward_apart(diverged: tuple[Path, ag.Report], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _, report = diverged
    fwd_only = ag.Report.from_dict(report.to_dict())
    fwd_only.layers = [r for r in fwd_only.layers if r.phase == "forward"]
    a, b = visual.render_png(report), visual.render_png(fwd_only)
    assert a[:8] == b"\x89PNG\r\n\x1a\n" and a != b
    from activation_guard.report.visual import backward_span

    n = sum(1 for r in report.layers if r.position is not None)
    assert backward_span(report) == (report.live_count + 0.5, n + 0.5)
    assert backward_span(fwd_only) is None


def test_inspect_and_textconv_list_gradients(diverged: tuple[Path, ag.Report]) -> None:
    path, _ = diverged
    gi = inspect_golden(path)
    grads = [x for x in gi.leaves if x.section != "forward"]
    assert grads and {x.section for x in grads} == {"grad-output", "grad-input", "param-grad"}
    assert all(x.kind in ("tensor", "none") for x in grads)  # aliases of earlier gradients shown resolved
    assert all(x.stats is not None for x in grads if x.kind == "tensor")
    text = format_inspect(gi)
    assert "backward    : loss = sum of each floating output times a seeded random cotangent (seed 0)" in text
    assert "grad wrt output" in text and "param grad" in text
    assert gi.to_dict()["leaves"][-1]["section"] in ("grad-input", "param-grad", "grad-output")
    json.dumps(gi.to_dict())
    lines = list(textconv_lines(path))
    assert any(ln.startswith("relu2[0] grad wrt input args/0 float32") for ln in lines)
    assert any(ln.startswith("conv2 param grad weight float32") for ln in lines)


# --------------------------------------------------------------------------- the plugin

MODELS = '''
import os
import torch

class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.01

def build():
    """A tiny MLP; AG_BUG (env) gives its Tanh a backward scaled by 1.01 (the forward unchanged)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if os.environ.get("AG_BUG"):
        m[1].forward = lambda t: ScaleGrad.apply(torch.tanh(t))
    return m.eval()

def inputs():
    return (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),)
'''

TEST = '''
import pytest
from agmodels import build, inputs

@pytest.mark.activation_guard(backward=True)
def test_marker(activation_guard):
    activation_guard.check(build(), inputs())

def test_check_kwarg(activation_guard):
    activation_guard.check(build(), inputs(), backward=True)

def test_forward_only(activation_guard):
    activation_guard.check(build(), inputs())
'''


def test_plugin_records_and_compares_gradients(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AG_BUG", raising=False)
    pytester.makepyfile(agmodels=MODELS, test_x=TEST)
    pytester.runpytest("--ag-update").assert_outcomes(passed=3)
    metas = {}
    for p in sorted(pytester.path.rglob("*.h5")):
        with ag.read_golden(p) as r:
            metas[p.stem] = (r.meta.get("backward"), len(r.backward))
    assert metas["test_marker"][0]["loss"] == "cotangent" and metas["test_marker"][1] > 0
    assert metas["test_check_kwarg"][1] == metas["test_marker"][1]
    assert metas["test_forward_only"] == (None, 0)
    pytester.runpytest().assert_outcomes(passed=3)
    monkeypatch.setenv("AG_BUG", "1")
    r = pytester.runpytest()
    r.assert_outcomes(passed=1, failed=2)  # the forward-only golden cannot see a backward fault
    out = r.stdout.str()
    head = "first divergence in the backward pass at layer '1' (Tanh) call 0: gradient w.r.t. its input args/0"
    assert out.count(f"activation_guard: {head}, #") >= 2  # each failing check's report leads with it
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    assert sorted(ln.split(" ")[1] for ln in failed) == ["test_x.py::test_check_kwarg", "test_x.py::test_marker"]
    assert "backward=True (marker)" in out and "backward=True (check())" in out


class _OffGrad(torch.autograd.Function):
    """An exact forward whose weight gradient is 1% off."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, 1.01 * (g.t() @ x), g.sum(0)


class _Lin(torch.nn.Linear):
    off = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OffGrad.apply(x, self.weight, self.bias) if self.off else super().forward(x)


def test_diff_leaves_the_gradients_of_excluded_layers_alone_as_compare_does(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(_Lin(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x = torch.randn(2, 4)
    ag.record(m, x, path=tmp_path / "golden.h5", backward=True)
    m[0].off = True
    ag.record(m, x, path=tmp_path / "new.h5", backward=True)
    assert ag.compare(m, x, path=tmp_path / "golden.h5", exclude="0").ok
    whole = ag.diff_recordings(tmp_path / "golden.h5", tmp_path / "new.h5")
    assert not whole.ok and whole.first_divergence is not None and whole.first_divergence.name == "0"
    for kw in ({"exclude": "0"}, {"include": ["1", "2", ""]}):
        report = ag.diff_recordings(tmp_path / "golden.h5", tmp_path / "new.h5", **kw)
        assert report.ok, str(report)  # once: the excluded layer's weight gradient failed the diff
        assert all(r.name != "0" for r in report.layers)


def test_a_pass_that_left_the_goldens_gradients_out_says_so_with_the_pass(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x = torch.randn(2, 4)
    ag.record(m, x, path=tmp_path / "bwd.h5", backward=True)
    ag.record(m, x, path=tmp_path / "plain.h5")
    report = ag.diff_recordings(tmp_path / "bwd.h5", tmp_path / "plain.h5")
    lines = str(report).splitlines()
    assert report.ok and lines[0].startswith("activation_guard: OK")
    assert lines[1:] == ["  note: backward: only the golden has gradients; they were not compared"]
    assert str(ag.diff_recordings(tmp_path / "plain.h5", tmp_path / "plain.h5")).count("\n") == 0  # else one line


class _Named(torch.nn.Module):
    """Two blocks under a container whose name a refactor changes (``blocks`` -> ``layers``)."""

    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 8)
        self.container = container
        self.add_module(container, torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(getattr(self, self.container)(self.inp(x)))


def test_gradients_of_layers_a_golden_never_recorded_are_not_unexpected_under_rename(tmp_path: Path) -> None:
    """A golden recorded with include= and backward=True, compared with rename=: the forward kept to
    the golden's selection but every other gradient was 'unexpected', and a real backward bug was
    reported at '<root>'."""
    x = torch.randn(2, 4)
    p = tmp_path / "g.h5"
    ag.record(_Named("blocks"), x, path=p, backward=True, include="blocks.*")
    report = ag.compare(_Named("layers"), x, path=p, rename={"blocks": "layers"})
    assert report.ok, str(report)
    assert all(r.status != "unexpected" for r in report.layers)
    assert {r.name for r in report.layers if r.phase != "forward"} <= {"layers.0", "layers.1", "layers.2"}


def test_backward_on_an_output_walked_by_type_only_says_so(tmp_path: Path) -> None:
    """An object holding the output tensor: its tensors are not seen, and 'all parameters frozen?'
    was the only hint (found by review, with a deque, which is walked since)."""
    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    class Q(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> Any:
            return Box(self.lin(x))

    with pytest.raises(ag.ActivationGuardError, match=r"its output holds Box, which activation_guard compares by "
                                                      r"type only.*backward=<a loss function"):
        ag.record(Q(), torch.randn(2, 3), path=tmp_path / "g.h5", backward=True)


def test_calls_run_with_autograd_off_are_named_in_a_note(tmp_path: Path) -> None:
    """Inside a reentrant activation checkpoint the block's calls run with autograd off: no
    gradient of theirs is recorded, and a change in their backward was blamed on the calls around
    them with no word of it (found by review)."""
    import torch.utils.checkpoint as cp

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.blk = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return cp.checkpoint(self.blk, self.inp(x), use_reentrant=True)

    torch.manual_seed(0)
    m, x = M(), torch.randn(2, 4)
    ag.record(m, x, path=tmp_path / "g.h5", backward=True)
    rep = ag.compare(m, x, path=tmp_path / "g.h5")
    assert rep.ok
    assert "3 layer call(s) ran with autograd off ('blk.0', 'blk.1', 'blk'" in str(rep)

"""The report: a failing one names where, why and by how much; a passing one is one line; the
dict form is strict JSON."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from models import one_thread, scale_weight, tiny_mlp
from torch import nn

import activation_guard as ag


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():  # see models.one_thread: 1000x faster tiny forwards on a loaded machine
        yield


GOLDEN = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])


class Emit(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out


class Net(nn.Module):
    """first (matches) -> emit (controlled output) -> after (passes emit's output on) -> root."""

    def __init__(self, out) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        with torch.no_grad():
            self.first.weight.copy_(torch.eye(2))
            self.first.bias.zero_()
        self.emit = Emit(out)
        self.after = nn.Identity()

    def forward(self, x):
        self.first(x)
        return self.after(self.emit(x))


X = torch.ones(1, 2)


def report_for(live_out, tmp_path, golden_out=GOLDEN, **kw):
    path = tmp_path / "g.h5"
    ag.record(Net(golden_out), X, path=path)
    return ag.compare(Net(live_out), X, path=path, **kw)


def test_failing_report_text_has_every_number(tmp_path):
    live = GOLDEN.clone()
    live[1, 2] = 7.5
    rep = report_for(live, tmp_path)
    text = str(rep)
    lines = text.splitlines()
    assert lines[0] == (
        "activation_guard: first divergence at layer 'emit' (Emit) call 0, #2 of 4 in execution order: "
        "values outside tolerance"
    )
    assert "  mismatched    : 1 / 8 elements (12.5%)" in lines
    assert "  max abs diff  : 5.00e-01 at index (1, 2): golden 7, live 7.5" in lines
    assert "  max rel diff  : 7.14e-02" in lines
    assert "  tolerance     : rtol=1.3e-06, atol=1e-05 (float32 default)" in lines
    assert f"recorded on cpu, torch {torch.__version__}" in text
    # context: the matching layer before, the marked one, the ones after with their status
    ctx = [ln for ln in lines if ln.strip().startswith(("1 ", "2 ", "3 ", "4 ", "> "))]
    assert any(ln.startswith("  >") and "emit" in ln and "diverged" in ln for ln in ctx)
    assert any("first" in ln and "match" in ln for ln in ctx)
    assert any("after" in ln and "diverged" in ln for ln in ctx)
    assert lines[-1] == "  totals: 4 live layer calls; 3 diverged, 1 match"
    fd = rep.first_divergence
    assert (fd.mismatched, fd.numel, fd.index, fd.golden_value, fd.live_value) == (1, 8, (1, 2), 7.0, 7.5)
    assert fd.max_abs_diff == 0.5 and math.isclose(fd.max_rel_diff, 0.5 / 7, rel_tol=1e-6)


def test_passing_report_is_one_line(tmp_path):
    rep = report_for(GOLDEN.clone(), tmp_path)
    text = str(rep)
    assert rep.ok and "\n" not in text
    assert text.startswith("activation_guard: OK, 4 layer calls match")
    assert str(tmp_path / "g.h5") in text


def test_passing_report_with_changed_inputs_says_so(tmp_path):
    path = tmp_path / "g.h5"
    ag.record(Net(GOLDEN), X, path=path)
    rep = ag.compare(Net(GOLDEN), X * 1, path=path)  # same values: one line
    assert "\n" not in str(rep)
    rep = ag.compare(Net(GOLDEN), X * 2, path=path, include=["emit", "after"])  # these ignore x
    assert rep.ok
    assert "\n" not in str(rep)  # a pass stays one line, and that line says the inputs changed
    assert "inputs differ from the recording" in str(rep)


def test_nonfinite_report_and_strict_json(tmp_path):
    live = GOLDEN.clone()
    live[0, 1] = float("nan")
    live[0, 3] = float("inf")
    rep = report_for(live, tmp_path)
    fd = rep.first_divergence
    assert (fd.name, fd.status, fd.mismatched) == ("emit", "nonfinite", 2)
    text = str(rep)
    assert "new NaN/Inf values" in text.splitlines()[0]
    assert "2 / 8 elements (25%)" in text
    assert "max abs diff  : inf" in text
    d = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert d["ok"] is False
    assert d["first_divergence"] == {"name": "emit", "call": 0, "status": "nonfinite", "position": 1,
                                   "number": 2, "number_in": "execution order"}
    emit = d["layers"][1]
    assert emit["max_abs_diff"] == "inf"
    assert isinstance(emit["live_value"], str) and emit["live_value"] in ("nan", "inf")
    assert emit["leaves"][0]["shape"] == [2, 4]


def test_to_dict_is_json_for_every_status(tmp_path):
    """One report mixing diverged, missing, unexpected, shape, structure, string and complex
    leaves, NaN golden values and input changes still dumps with allow_nan=False."""

    class Many(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.v = v
            self.a = nn.Identity()
            self.gone = nn.Identity()
            self.new = nn.Identity()
            self.shape = nn.Identity()
            self.struct = nn.Identity()

        def forward(self, x):
            c = torch.tensor([1 + 2j, complex(float("nan"), 0)]) * self.v
            self.a({"c": c, "s": f"tag{self.v}", "n": torch.tensor([float("nan"), self.v])})
            if self.v == 1:
                self.gone(x)
            else:
                self.new(x)
            self.shape(torch.zeros(self.v))
            self.struct((x,) * self.v)
            return x * self.v

    path = tmp_path / "g.h5"
    ag.record(Many(1), X, path=path)
    rep = ag.compare(Many(2), X + 1, path=path)
    st = {(r.name, r.status) for r in rep.layers}
    assert st >= {("a", "diverged"), ("gone", "missing"), ("new", "unexpected"), ("shape", "shape"),
                  ("struct", "structure"), ("", "diverged")}
    d = rep.to_dict()
    s = json.dumps(d, allow_nan=False)
    back = json.loads(s)
    assert back["counts"]["missing"] == 1 and back["input_changes"]
    a = next(layer for layer in back["layers"] if layer["name"] == "a")
    leaves = {leaf["path"]: leaf for leaf in a["leaves"]}
    assert (leaves["c"]["golden_value"], leaves["c"]["live_value"]) == ([1.0, 2.0], [2.0, 4.0])
    assert leaves["c"]["mismatched"] == 1  # the NaN element matched the golden NaN
    assert leaves["s"]["status"] == "diverged" and "'tag1' -> 'tag2'" in leaves["s"]["detail"]
    assert leaves["n"]["status"] == "diverged"
    text = str(rep)
    assert "first divergence at layer 'a'" in text.splitlines()[0]


def test_missing_first_divergence_headline_and_context(tmp_path):
    class M(nn.Module):
        def __init__(self, skip):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
            self.skip = skip

        def forward(self, x):
            x = self.a(x)
            if not self.skip:
                x = self.b(x)
            return self.c(x)

    torch.manual_seed(0)
    m = M(False)
    path = tmp_path / "g.h5"
    ag.record(m, X, path=path)
    m.skip = True
    rep = ag.compare(m, X, path=path)
    lines = str(rep).splitlines()
    assert lines[0] == (
        "activation_guard: first divergence at layer 'b' (Linear) call 0, #2 in the golden's "
        "execution order: layer call did not run in the live run"
    )
    assert any("missing    (did not run; expected here)" in ln for ln in lines)
    marker = next(i for i, ln in enumerate(lines) if "did not run; expected here" in ln)
    assert " a " in lines[marker - 1] and " c " in lines[marker + 1]  # placed where it belongs
    assert "this layer did not run" in str(rep)


def test_renamed_layer_shows_golden_name(tmp_path):
    m = tiny_mlp(depth=2)
    path = tmp_path / "g.h5"

    class Outer(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.net = inner

        def forward(self, x):
            return self.net(x)

    live = Outer(tiny_mlp(depth=2))
    scale_weight(live, "net.blocks.1.fc")
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    ag.record(m, x, path=path)
    rep = ag.compare(live, x, path=path, rename={"blocks": "net.blocks", "head": "net.head", "": "net"})
    fd = rep.first_divergence
    assert (fd.name, fd.golden_name) == ("net.blocks.1.fc", "blocks.1.fc")
    assert "  golden layer  : 'blocks.1.fc' (renamed)" in str(rep).splitlines()


@pytest.mark.parametrize("n_before", [0, 5])
def test_context_is_short(tmp_path, n_before):
    """The context table shows a few layers around the divergence, not the whole model."""
    m = tiny_mlp(depth=8)
    x = torch.randn(2, 8)
    path = tmp_path / "g.h5"
    ag.record(m, x, path=path)
    scale_weight(m, f"blocks.{n_before}.fc")
    rep = ag.compare(m, x, path=path)
    lines = str(rep).splitlines()
    start = lines.index("  context (execution order):")
    rows = [ln for ln in lines[start + 2 :] if ln.strip() and not ln.strip().startswith("totals")]
    assert 1 <= len(rows) <= 8
    assert len(rep.layers) > 20
    assert "#" + str(rep.first_divergence.position + 1) + " of " + str(len(rep.layers)) in lines[0]


def test_report_round_trips_through_json(tmp_path):
    """A JSON report (e.g. from an xdist worker) rebuilds the same report, text included."""
    import json

    from activation_guard.report.report import Report

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
            self.skip = False

        def forward(self, x):
            x = self.a(x)
            if not self.skip:
                x = self.b(x)
            return self.c(x) * 1.5

    torch.manual_seed(0)
    m = M()
    path = tmp_path / "g.h5"
    ag.record(m, X, path=path)
    m.skip = True
    rep = ag.compare(m, X, path=path)
    back = Report.from_dict(json.loads(json.dumps(rep.to_dict(), allow_nan=False)))
    assert back.to_dict() == rep.to_dict()
    assert back.first_divergence.name == "b" and back.first_divergence.status == "missing"
    assert back == rep and back._order == rep._order  # every field, golden metadata included
    assert str(back) == str(rep)  # the text comes from fields alone: "torch ?" never appears
    assert f"torch {torch.__version__}" in str(back)


# --------------------------------------------------------------------------- review regressions


def _abs_line(text: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith("  max abs diff"))


def test_worst_element_line_never_pairs_a_max_diff_with_another_elements_values(tmp_path):
    """Under a relative tolerance the largest difference can sit on a passing element; the line
    must not print it "at" the index of the mismatching element with that element's values."""
    golden = torch.tensor([[1000.0, 0.0], [1.0, 1.0]])
    live = torch.tensor([[1000.5, 0.01], [1.0, 1.0]])
    rep = report_for(live, tmp_path, golden_out=golden, rtol=1e-3)
    fd = rep.first_divergence
    assert (fd.name, fd.mismatched, fd.index) == ("emit", 1, (0, 1))
    assert fd.max_abs_diff == 0.5
    text = str(rep)
    assert "5.00e-01 at index (0, 1)" not in text, text
    assert _abs_line(text) == "  max abs diff  : 5.00e-01"
    assert "  worst element : 1.00e-02 at index (0, 1): golden 0, live 0.01" in text.splitlines()


def test_worst_element_line_names_the_leaf_whose_values_it_shows(tmp_path):
    """Two diverging outputs: the layer's max abs diff comes from the second, the element shown
    from the first; the text keeps each number with its own output (the named output's numbers,
    then the other's on its own line)."""
    golden = (GOLDEN, GOLDEN)
    a, b = GOLDEN.clone(), GOLDEN.clone()
    a[0, 0] = 1.5
    b[1, 1] = 16.0
    rep = report_for((a, b), tmp_path, golden_out=golden)
    fd = rep.first_divergence
    assert fd.max_abs_diff == 10.0 and fd.path == "0" and fd.index == (0, 0)
    lines = str(rep).splitlines()
    assert "  max abs diff  : 5.00e-01 at index (0, 0): golden 1, live 1.5" in lines
    assert "  other outputs : 1: diverged (max abs diff 1.00e+01, 1 / 8 mismatched)" in lines


def test_golden_and_live_values_are_printed_distinguishably(tmp_path):
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    live = torch.tensor([1.0 + 3e-7, 2.0], dtype=torch.float64)  # float64 default tolerance: 2e-7
    rep = report_for(live, tmp_path, golden_out=golden)
    fd = rep.first_divergence
    assert fd.status == "diverged" and fd.index == (0,)
    line = _abs_line(str(rep))
    g, lv = line.split("golden ")[1].split(", live ")
    assert g != lv, line
    assert float(g) == 1.0 and float(lv) == 1.0 + 3e-7


def test_a_pass_says_what_it_does_not_cover(tmp_path):
    """An include pattern that matched nothing, and a golden that holds only some layers, limit what
    an OK means: the pass's text says so (found by review: a changed layer outside a selective
    golden passed with a bare 'OK' line)."""
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)), torch.randn(2, 3)
    ag.record(m, (x,), path=tmp_path / "full.h5")
    typo = ag.compare(m, (x,), path=tmp_path / "full.h5", include=["0", "dec*"])
    assert typo.ok and "include pattern 'dec*' matched no layer" in str(typo)
    ag.record(m, (x,), path=tmp_path / "part.h5", include=["0"])
    with torch.no_grad():
        m[2].bias += 1
    part = ag.compare(m, (x,), path=tmp_path / "part.h5")
    assert part.ok and "holds only those layers' outputs" in str(part)
    assert str(part).splitlines()[0].startswith("activation_guard: OK")


ESC = "\x1b[2J\x1b[H\x1b]0;owned\x07\u202e"  # clear the screen, home, set the title, right-to-left override


def test_control_characters_from_the_model_or_the_golden_never_reach_a_terminal(tmp_path):
    """Layer and class names, output keys and a hand-edited golden's meta reach terminals, CI logs
    and `git diff` (textconv): each text output escapes control characters, so no field can clear
    a screen, reorder text or forge a line (found by review)."""
    import h5py
    from golden_edit import set_json

    from activation_guard.report.inspect_text import format_inspect, textconv_lines
    from activation_guard.report.inspection import inspect_golden

    evil = type("Evil" + ESC, (nn.Module,), {"forward": lambda s, x: {"key" + ESC + "\nforged line": x * s.k}})
    root = nn.Module()
    root.add_module("blk" + ESC, evil())
    blk = getattr(root, "blk" + ESC)
    blk.k = 1.0
    root.forward = lambda x: blk(x)  # type: ignore[method-assign]
    x = torch.randn(2, 3)
    ag.record(root, (x,), path=tmp_path / "g.h5")
    blk.k = 2.0
    text = str(ag.compare(root, (x,), path=tmp_path / "g.h5"))
    with h5py.File(tmp_path / "g.h5", "r+") as f:
        import json

        meta = json.loads(f["meta"][()].tobytes())
        meta["model_class"] += ESC
        meta["extra" + ESC] = ESC
        set_json(f, "meta", meta)
    outputs = {"report": text, "inspect": format_inspect(inspect_golden(tmp_path / "g.h5")),
               "textconv": "\n".join(textconv_lines(tmp_path / "g.h5"))}
    for what, out in outputs.items():
        assert not any(c in out for c in ("\x1b", "\x07", "\u202e")), what
        assert "forged line" not in out or "\\x0aforged line" in out, what
    assert "blk\\x1b[2J" in text and "\\u202e" in text  # escaped, still readable


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bad = False

    def forward(self, x: torch.Tensor) -> dict:
        a, b = x.clone(), x.clone() * 1000
        if self.bad:
            a[0, 0] = float("nan")
            b = b + 100
        return {"a": a, "b": b}


def test_a_multi_output_layer_shows_the_named_outputs_own_numbers(tmp_path):
    """The detail named output 'a' but printed numbers over both outputs ('13 / 24'); the other
    output's numbers go on its own line (found by review)."""
    m, x = _TwoOutputs(), torch.randn(3, 4)
    ag.record(m, (x,), path=tmp_path / "g.h5")
    m.bad = True
    text = str(ag.compare(m, (x,), path=tmp_path / "g.h5", replay="off"))
    assert "  output path   : a" in text
    # (no count out of 24, both outputs' elements; a bare "24" can be in the golden's temporary path)
    assert "  mismatched    : 1 / 12 elements" in text and not re.search(r"\d / 24\b", text.split("context")[0])
    assert "  max abs diff  : inf at index (0, 0)" in text
    assert "  other outputs : b: diverged (max abs diff 1.00e+02, 12 / 12 mismatched)" in text


def test_a_lower_precision_run_reads_whether_an_origin_names_code_from_its_field(tmp_path) -> None:
    """Whether an origin blames code is a field its builder sets (``maybe_code``, ``names_code``),
    not a phrase of its text; old JSON reports, without the field, still load."""
    import copy

    from activation_guard.api.run import lowered_precision
    from activation_guard.results import Origin

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).eval()
    x = torch.randn(8, 64)
    ag.record(m, (x,), path=tmp_path / "g.h5")
    rep = ag.compare(copy.deepcopy(m).to(torch.bfloat16), (x.bfloat16(),), path=tmp_path / "g.h5",
                     allow_dtype_change=True, replay="off")
    assert not rep.ok and rep.mode == "strict"
    for origin, blamed in ((Origin("0", 0, "unknown", detail="one phrase about its own code"), False),
                           (Origin("0", 0, "unknown", detail="this or that", maybe_code=True), True),
                           (Origin("0", 0, "layer"), True), (Origin("", 0, "inputs"), False)):
        r = copy.deepcopy(rep)
        r.origin = origin
        lowered_precision(r)
        assert r.origin is not None
        assert ("rounding of that code can explain as well" in r.origin.detail) == blamed, origin
        assert r.origin.names_code == (blamed or origin.kind == "layer")
    back = Origin.from_dict(Origin("a", 1, "unknown", detail="x", maybe_code=True).to_dict())
    assert back.maybe_code and back.names_code
    old = {k: v for k, v in Origin("a", 1, "unknown", detail="x").to_dict().items() if k != "maybe_code"}
    assert Origin.from_dict(old) == Origin("a", 1, "unknown", detail="x")

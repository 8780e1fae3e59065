"""The shape of a divergence: each pattern is named on real layers changed the way a bug changes
them, a broad change is called broad, and the fields survive the JSON round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import activation_guard as ag
from activation_guard.judges.where import describe
from activation_guard.report.report import Report


class Shift(torch.nn.Module):
    """A layer whose forward a bug changes: ``bug(x)`` is applied to its output."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.bug = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y if self.bug is None else self.bug(y)


def _where(tmp_path: Path, inner: torch.nn.Module, x: torch.Tensor, bug, **kw):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    m = Shift(inner).eval()
    p = tmp_path / "g.h5"
    with torch.no_grad():
        ag.record(m, (x,), path=p)
        m.bug = bug
        r = ag.compare(m, (x,), path=p, replay="off", **kw)
    assert not r.ok
    fd = r.first_divergence
    assert fd is not None and fd.name == "", fd.label  # the model's own output: the changed forward
    leaf = fd.leaves[0]
    assert leaf.where is not None
    return r, leaf.where


def _lin() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(32, 48)


def test_positions_from_a_cutoff(tmp_path: Path) -> None:
    x = torch.randn(2, 96, 32)

    def bug(y: torch.Tensor) -> torch.Tensor:
        y = y.clone()
        y[:, 64:] += 0.01 * torch.randn(y[:, 64:].shape, generator=torch.Generator().manual_seed(3))
        return y
    r, w = _where(tmp_path, _lin(), x, bug)
    assert [d.text for d in w.dims] == ["all positions", "only at 64-95", "all positions"]
    assert w.relation == "broad"
    assert "dim 1 (96): only at 64-95" in str(r)


def test_one_channel(tmp_path: Path) -> None:
    def bug(y: torch.Tensor) -> torch.Tensor:
        y = y.clone()
        y[..., 7] = y[..., 7] * 1.5
        return y
    _, w = _where(tmp_path, _lin(), torch.randn(3, 20, 32), bug)
    assert w.dims[2].text == "index 7 only" and w.dims[0].text == w.dims[1].text == "all positions"
    assert w.relation == "scale" and w.factor == pytest.approx(1.5, rel=1e-5)


def test_one_batch_element(tmp_path: Path) -> None:
    def bug(y: torch.Tensor) -> torch.Tensor:
        y = y.clone()
        y[2] = y[2] + 0.25
        return y
    _, w = _where(tmp_path, _lin(), torch.randn(4, 10, 32), bug)
    assert w.dims[0].text == "index 2 only"
    assert w.relation == "offset" and w.offset == pytest.approx(0.25, rel=1e-4)


def test_scale_factor(tmp_path: Path) -> None:
    r, w = _where(tmp_path, torch.nn.GELU(), torch.randn(2, 16, 64), lambda y: y * 1.01)
    assert w.relation == "scale" and w.factor == pytest.approx(1.01, rel=1e-5)
    assert "live = 1.0100 x golden" in str(r)
    assert all(d.text == "all positions" for d in w.dims)


def test_permutation(tmp_path: Path) -> None:
    perm = torch.tensor([0, 1, 5, 3, 4, 2, 6, 7, 8, 9])
    _, w = _where(tmp_path, _lin(), torch.randn(2, 10, 32), lambda y: y[:, perm])
    assert w.relation == "permutation" and w.perm_dim == 1 and w.moved == 2
    assert w.dims[1].text == "only at 2, 5 (2 of 10)"


def test_sign_flips(tmp_path: Path) -> None:
    def bug(y: torch.Tensor) -> torch.Tensor:
        y = y.clone()
        y[:, 3:6] = -y[:, 3:6]
        return y
    _, w = _where(tmp_path, _lin(), torch.randn(2, 12, 32), bug)
    assert w.relation == "sign" and w.dims[1].text == "only at 3-5"


def test_padding_border(tmp_path: Path) -> None:
    torch.manual_seed(2)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 16, 16)
    p = tmp_path / "g.h5"
    with torch.no_grad():
        ag.record(conv, (x,), path=p)
        conv.padding_mode = "reflect"  # the padding changed: only border pixels differ
        r = ag.compare(conv, (x,), path=p, replay="off")
    w = r.first_divergence.leaves[0].where  # type: ignore[union-attr]
    assert w is not None and w.border == 1
    assert "within 1 position(s) of the edges" in str(r)


def test_broad_random_change_is_broad(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    _, w = _where(tmp_path, _lin(), torch.randn(2, 30, 32), lambda y: y + 0.1 * torch.randn(y.shape, generator=g))
    assert w.relation == "broad" and w.border is None
    assert all(d.text == "all positions" for d in w.dims)


def test_round_trip_and_heatmap_grid(tmp_path: Path) -> None:
    r, w = _where(tmp_path, _lin(), torch.randn(2, 70, 32), lambda y: y * 1.01)
    assert w.heat is not None and len(w.heat.diff) == 32 and len(w.heat.diff[0]) == 32
    d = json.loads(json.dumps(r.to_dict()))
    assert d["where"]["relation"] == "scale"
    assert d["where"]["dims"][1] == {"dim": 1, "size": 70, "count": 70, "ranges": [[0, 69]],
                                                          "text": "all positions"}
    back = Report.from_dict(d)
    assert back.to_dict() == r.to_dict()
    assert back.first_divergence.leaves[0].where == w  # type: ignore[union-attr]


def test_requested_layer_is_described(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(5, 8)
    p = tmp_path / "g.h5"
    with torch.no_grad():
        ag.record(m, (x,), path=p)
        m[0].bias[2] += 1.0
        r = ag.compare(m, (x,), path=p, replay="off", where=["2"])
    text = str(r)
    assert "where in 2[0]:" in text
    leaf = next(x for x in r.layers if x.name == "2").leaves[0]
    assert leaf.where is not None and leaf.where.requested


def test_only_the_first_calls_are_described_unasked(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    x = torch.randn(3, 4)
    p = tmp_path / "g.h5"
    with torch.no_grad():
        ag.record(m, (x,), path=p)
        m[0].weight += 0.1
        r = ag.compare(m, (x,), path=p, replay="off")
    described = r.described()
    assert len(described) == 2
    assert described[0][0] is r.first_divergence


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5), st.integers(1, 6), st.floats(0.5, 3.0).filter(lambda f: abs(f - 1) > 1e-3))
@example(0, 2, 1.008200734449077)  # a factor near 1: float32 products once read it as "broad"
def test_scaled_slab_is_located_and_named(i: int, n: int, factor: float) -> None:
    g = torch.randn(6, 9, 5, generator=torch.Generator().manual_seed(i * 7 + n))
    lv = g.clone()
    lv[:, i : i + n] *= factor
    w = describe(g, lv, 1e-5, 1e-6)
    hi = min(i + n, 9) - 1
    assert w.dims[1].ranges == [[i, hi]]
    assert w.relation == "scale" and w.factor == pytest.approx(factor, rel=1e-5)


def test_fingerprint_says_only_what_samples_prove() -> None:
    from activation_guard.report.report import sampled_where
    from activation_guard.results import LeafResult

    leaf = LeafResult("", "diverged", sampled=64, mismatched=3, index=(1, 2), estimate="l2")
    (line,) = sampled_where(leaf)
    assert "not located" in line and "64 exact samples" in line and "3 lie outside" in line


PLUGIN_TEST = '''
import os
import pytest
import torch


def model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    if os.environ.get("BUG"):
        with torch.no_grad():
            m[2].weight.mul_(-1.0)
            m[2].bias.mul_(-1.0)
    return m


@pytest.mark.activation_guard(where=["2"], replay="off")
def test_m(activation_guard):
    torch.manual_seed(1)
    activation_guard.check(model(), torch.randn(3, 6, 8))
'''


def test_plugin_failure_says_where(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_m=PLUGIN_TEST)
    lean = ("-p", "no:cacheprovider", "-p", "no:randomly")
    pytester.runpytest("--ag-update", *lean).assert_outcomes(passed=1)
    monkeypatch.setenv("BUG", "1")
    r = pytester.runpytest(*lean)
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "where         : dim 0 (3): all positions" in out
    assert "sign flips: live = -golden at every element" in out


def _recordings(tmp_path: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(2, 10, 16)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with torch.no_grad():
        ag.record(m, (x,), path=a)
        m[2].bias[3] += 0.5  # channel 3 of layer 2, by a constant
        ag.record(m, (x,), path=b)
    return a, b


def test_cli_heatmap_and_inspect_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from activation_guard.cli import main

    a, b = _recordings(tmp_path)
    out = tmp_path / "h.png"
    assert main(["diff", str(a), str(b), "--heatmap", "2", str(out)]) == 1
    text = capsys.readouterr()
    assert "dim 2 (8): index 3 only" in text.out and "constant offset: live = golden + 0.5" in text.out
    assert out.read_bytes().startswith(b"\x89PNG") and f"heatmap of 2[0] written to {out}" in text.err
    assert main(["diff", str(a), str(b), "--heatmap", "0", str(tmp_path / "n.png")]) == 2  # layer 0 matches
    assert "--heatmap 0: no heatmap to draw: it matches the recordings there" in capsys.readouterr().err
    assert not (tmp_path / "n.png").exists()
    g = tmp_path / "g.png"
    assert main(["inspect", str(a), "--plot", "0", str(g)]) == 0
    assert g.read_bytes().startswith(b"\x89PNG")
    assert main(["inspect", str(a), "--plot", "nope", str(tmp_path / "x.png")]) == 2
    assert "--plot nope: layer 'nope' is not in the golden" in capsys.readouterr().err


@pytest.mark.slow
def test_gpt2_small_page_stays_small(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    transformers = pytest.importorskip("transformers")
    from activation_guard.report.visual import write_html

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=128, vocab_size=1000)
    m = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 1000, (1, 64))
    p = tmp_path / "g.h5"
    with torch.no_grad():
        ag.record(m, (ids,), path=p)
        m.h[1].ln_1.weight.mul_(1.01)
        r = ag.compare(m, (ids,), path=p, replay="off")
    assert r.first_divergence is not None and r.first_divergence.name == "h.1.ln_1"
    assert len(r.described()) == 2
    page = Path(write_html(r, tmp_path / "r.html"))
    assert page.stat().st_size < 2_000_000
    with torch.no_grad():
        every = ag.compare(m, (ids,), path=p, replay="off", where=["h.*"])
    assert len(every.described()) > 100  # every diverged block layer asked for: the page's worst case
    page = Path(write_html(every, tmp_path / "every.html"))
    assert page.stat().st_size < 2_000_000
    assert "more described calls have no picture on this page" in page.read_text()


def test_new_nans_and_single_elements_claim_no_relation() -> None:
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w = describe(g, torch.tensor([1.0, float("nan"), 3.0, 8.0]), 1e-5, 1e-6)
    assert w.relation == "broad" and "too few" in w.text and "1 mismatched element(s) are NaN/Inf" in w.text
    assert w.dims[0].text == "only at 1, 3 (2 of 4)"
    w = describe(torch.zeros(3, 0), torch.zeros(3, 0), 1e-5, 1e-6)
    assert w.text == "no elements"


def test_a_description_that_fails_leaves_the_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.comparison import comparator

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("boom")
    monkeypatch.setattr(comparator, "describe", broken)
    r, w = _where(tmp_path, _lin(), torch.randn(2, 4, 32), lambda y: y * 2)
    assert r.first_divergence.status == "diverged"  # type: ignore[union-attr]
    assert w.relation == "unknown" and "RuntimeError: boom" in w.text


def _norm_model() -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).eval()


def _first_where(tmp_path: Path, m: torch.nn.Module, change) -> tuple[str, object]:  # type: ignore[no-untyped-def]
    x = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(4))
    p = tmp_path / "n.h5"
    with torch.no_grad():
        ag.record(m, (x,), path=p)
        change(m)
        r = ag.compare(m, (x,), path=p, replay="off")
    fd = r.first_divergence
    assert fd is not None
    return fd.name, fd.leaves[0].where


def test_layernorm_eps_change_reads_as_a_factor_per_row(tmp_path: Path) -> None:
    name, w = _first_where(tmp_path, _norm_model(), lambda m: setattr(m[1], "eps", 0.5))
    assert name == "1"
    assert w.relation == "row-scale", w.text  # type: ignore[attr-defined]
    assert w.factor_min < w.factor_max < 1.0  # type: ignore[attr-defined]  # a larger eps shrinks every row
    assert "a factor per slice along dim 2 (120 slices" in w.text  # type: ignore[attr-defined]


def test_norm_weight_change_reads_as_a_factor_per_channel(tmp_path: Path) -> None:
    def change(m: torch.nn.Module) -> None:
        m[1].weight.mul_(1 + 0.05 * torch.rand(64, generator=torch.Generator().manual_seed(1)))

    name, w = _first_where(tmp_path, _norm_model(), change)
    assert name == "1"
    assert w.relation == "column-scale", w.text  # type: ignore[attr-defined]
    assert 1.0 < w.factor_min < w.factor_max < 1.05  # type: ignore[attr-defined]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(5, 8), (3, 7, 9), (40, 16), (2, 3, 4, 12)]),
       st.floats(1e-4, 1.0))
def test_random_changes_never_read_as_a_factor_per_slice(seed: int, shape: tuple[int, ...], size: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen)
    w = describe(g, g + size * torch.randn(shape, generator=gen), 1e-5, 1e-6)
    assert w.relation == "broad", w.text


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 70), st.integers(1, 70), st.sampled_from([3, 50, 10_000]))
def test_heat_pooled_by_slabs_equals_pooling_the_whole_map(seed: int, r: int, c: int, slab: int) -> None:
    from activation_guard.judges import where as wmod

    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(r, c, generator=gen)
    lv = g + torch.randn(r, c, generator=gen) * (torch.rand(r, c, generator=gen) > 0.7)
    whole = describe(g, lv, 1e-5, 1e-6).heat
    old = wmod.SLAB
    wmod.SLAB = slab  # several slabs, each pooled on its own
    try:
        parts = describe(g, lv, 1e-5, 1e-6).heat
    finally:
        wmod.SLAB = old
    assert whole is not None and parts is not None
    assert parts.bad == whole.bad and parts.reduced == whole.reduced
    for a, b in ((parts.diff, whole.diff), (parts.golden, whole.golden)):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=2e-3, atol=1e-6)
    ref = torch.nn.functional.adaptive_max_pool2d((lv - g).abs()[None, None], (min(r, 32), min(c, 32)))[0, 0]
    assert torch.allclose(torch.tensor(whole.diff), ref, rtol=1e-3, atol=1e-6)


def test_diverged_rows_without_a_picture_say_how_to_get_one(tmp_path: Path) -> None:
    from activation_guard.report.visual import html_page

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])
    x = torch.randn(3, 4)
    p = tmp_path / "g.h5"
    with torch.no_grad():
        ag.record(m, (x,), path=p)
        m[0].weight += 0.1
        r = ag.compare(m, (x,), path=p, replay="off")
    page = html_page([r])
    assert page.count('title="click: heatmap of this output"') == 2  # the first two diverged calls
    assert page.count("no heatmap drawn for this call") == 4  # layers 2, 3, 4 and the root
    assert 'name 4 in the where option' in page


def test_a_1d_output_over_several_slabs_is_described(monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.judges import where as wmod

    monkeypatch.setattr(wmod, "SLAB", 100)  # a 1-D output larger than one slab (a flattened logits vector)
    g = torch.randn(250, generator=torch.Generator().manual_seed(3))
    w = describe(g, g * 1.01, 1e-5, 1e-6)
    assert w.relation == "scale" and w.factor == pytest.approx(1.01, rel=1e-5)
    assert w.dims[0].text == "all positions"


def test_fingerprinted_rows_never_promise_a_picture(tmp_path: Path) -> None:
    from activation_guard.report.visual import html_page

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(32, 64)
    p = tmp_path / "g.h5"
    with torch.no_grad():
        ag.record(m, (x,), path=p, fingerprint=["2", "3"])
        m[0].weight += 0.1
        r = ag.compare(m, (x,), path=p, replay="off")
    assert any(leaf.sampled for layer in r.layers if layer.name == "3" for leaf in layer.leaves)
    page = html_page([r])
    assert "name 3 in the where option" not in page  # its values were never stored: nothing to draw
    assert "name 2 in the where option" not in page

"""Error-by-layer plots and the self-contained HTML report."""

from __future__ import annotations

import base64
import io
import math
import re
import sys
from html.parser import HTMLParser

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import activation_guard as ag
from activation_guard.api.demo import run_demo
from activation_guard.cli import main
from activation_guard.report import visual
from activation_guard.report.report import Report
from activation_guard.results import LayerResult

pytest.importorskip("matplotlib")
import matplotlib.image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEMPLATE_TAGS = {"html", "head", "meta", "title", "style", "script", "body", "h1", "h2", "p", "b", "pre", "section",
                 "div", "table", "thead", "tbody", "tr", "th", "td", "details", "summary", "img", "a", "span", "wbr",
                 "button", "input", "label"}
VOID = {"meta", "img", "br", "hr", "link", "input", "col", "wbr", "source"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    return run_demo(tmp_path_factory.mktemp("vis"), "gelu-tanh")


class Page(HTMLParser):
    """Checks well-formedness (every non-void element closed in order) and collects what matters."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.rows: list[tuple[str | None, list[str]]] = []
        self.text: list[str] = []
        self._row: list[str] | None = None
        self._row_class: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "tr":
            self._row, self._row_class = [], a.get("class")
        elif tag in ("td", "th"):
            self._cell = []

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append((self._row_class, self._row))
            self._row = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    p.close()
    assert not p.errors, p.errors
    assert p.stack == [], f"unclosed elements: {p.stack}"
    return p


def images(p: Page) -> list[bytes]:
    out = []
    for tag, a in p.tags:
        if tag == "img" and a.get("class") != "heat":  # (the divergence's heatmaps: tests/test_where.py)
            src = a.get("src") or ""
            assert src.startswith("data:image/png;base64,")
            out.append(base64.b64decode(src.split(",", 1)[1], validate=True))
    return out


def assert_png(data: bytes) -> None:
    assert data[:8] == PNG_MAGIC
    img = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400


# --------------------------------------------------------------------------- plot


class _Overflow(torch.nn.Module):
    """A ReLU that sends positive values to +inf (float32 overflow): new non-finite values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 1e39


def test_plot_of_a_divergence_is_a_readable_png(demo, tmp_path):
    out = visual.write_plot(demo.report, tmp_path / "e.png")
    with open(out, "rb") as fh:
        data = fh.read()
    assert_png(data)
    assert len(data) > 20_000  # lines, markers, labels: not an empty canvas


@pytest.mark.parametrize("kind", ["ok", "structure", "nonfinite", "empty"])
def test_plot_handles_every_report_shape(kind, tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    x = torch.randn(2, 3)
    p = tmp_path / "g.h5"
    if kind == "empty":
        report = Report(path="nothing.h5", layers=[])
    else:
        ag.record(m, (x,), path=p)
        if kind == "ok":
            report = ag.compare(m, (x,), path=p)
        elif kind == "structure":
            report = ag.compare(torch.nn.Sequential(m[0], torch.nn.Identity(), torch.nn.Linear(3, 2)), (x,), path=p)
        else:
            report = ag.compare(torch.nn.Sequential(m[0], _Overflow()), (x,), path=p)
            assert [layer.status for layer in report.layers] == ["match", "nonfinite", "nonfinite"]
    assert_png(visual.render_png(report))


def test_missing_matplotlib_gives_the_install_hint(demo, tmp_path, monkeypatch, capsys):
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)
    assert not visual.plot_available()
    with pytest.raises(visual.PlotUnavailableError, match=re.escape("pip install 'activation_guard[plot]'")):
        visual.write_plot(demo.report, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    # the CLI: --plot fails up front with one line; --html still writes the page, without the picture
    assert main(["diff", demo.golden, demo.refactored, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and "activation_guard[plot]" in err
    assert main(["diff", demo.golden, demo.refactored, "--html", str(tmp_path / "r.html")]) == 1
    page = parse((tmp_path / "r.html").read_text())
    assert images(page) == [] and "matplotlib is not installed" in "".join(page.text)


# --------------------------------------------------------------------------- HTML


@pytest.mark.slow
def test_diff_html_and_plot_from_the_cli(demo, tmp_path, capsys):
    rc = main(["diff", demo.golden, demo.refactored, "--plot", str(tmp_path / "p.png"),
               "--html", str(tmp_path / "r.html")])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"plot written to {tmp_path / 'p.png'}" in err and f"HTML report written to {tmp_path / 'r.html'}" in err
    assert_png((tmp_path / "p.png").read_bytes())
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", text), "the page must not load anything from the network"
    assert "<link" not in text and "src=" not in text.replace('src="data:image/png;base64,', "")
    assert text.count("<script>") == 1 and text.count("</script>") == 1  # one inline script, at the end
    page = parse(text)
    imgs = images(page)
    assert len(imgs) == 1
    assert_png(imgs[0])
    layer_rows = [(cls, cells) for cls, cells in page.rows if len(cells) == len(visual.COLUMNS) and cells[0] != "#"]
    assert len(layer_rows) == len(demo.report.layers) == 37
    first = [cells for cls, cells in layer_rows if cls == "first"]
    assert len(first) == 1 and first[0][1] == "blocks.1.mlp.act" and first[0][4] == "FIRST diverged"
    assert float(first[0][5]) == pytest.approx(demo.report.first_divergence.max_abs_diff, rel=0.01)
    fails = [cells[1] for cls, cells in layer_rows if cls == "fail"]
    assert len(fails) == sum(1 for x in demo.report.layers if not x.ok) - 1
    assert [c[1] for _, c in layer_rows][:3] == ["embed", "blocks.0.norm1", "blocks.0.attn.qkv"]  # execution order
    assert "first divergence at layer &#x27;blocks.1.mlp.act&#x27;" in text


def test_write_html_many_reports(demo, tmp_path):
    p = visual.write_html({"test_a": demo.report, "test_b": demo.baseline}, tmp_path / "many.html")
    with open(p, encoding="utf-8") as fh:
        page = parse(fh.read())
    links = [a["href"] for tag, a in page.tags if tag == "a"]
    ids = [a["id"] for tag, a in page.tags if a.get("id")]
    # banner -> first divergence; checks table -> each check and the first divergence; section -> its row
    assert links == ["#first-divergence", "#report-0", "#first-divergence", "#report-1", "#first-divergence"]
    assert ids == ["report-0", "first-divergence", "report-1"]
    assert len(images(page)) == 1  # auto: only the failing report is plotted
    summary = [cells for _, cells in page.rows if len(cells) == 3][1:]  # after the header row
    assert summary == [["test_a", "DIVERGED", "blocks.1.mlp.act[0] (values outside tolerance)"], ["test_b", "OK", "-"]]
    assert "2 checks: 1 passed, 1 diverged" in "".join(page.text)
    assert any(tag == "details" for tag, _ in page.tags)  # the passing report's table is folded
    p2 = visual.write_html([demo.baseline], tmp_path / "one.html", plots="none")
    with open(p2, encoding="utf-8") as fh:
        assert images(parse(fh.read())) == []
    with pytest.raises(TypeError, match="write_html needs a Report"):
        visual.write_html([1], tmp_path / "bad.html")
    with pytest.raises(ValueError, match="plots must be"):
        visual.write_html(demo.report, tmp_path / "bad.html", plots="some")


@given(st.text(min_size=1, max_size=30), st.text(max_size=30))
def test_html_escapes_any_layer_name_and_label(name, label):
    layer = LayerResult(name, 0, "diverged", "Linear", position=0, detail=f"{name} & <more>", numel=4, mismatched=1,
                        max_abs_diff=0.5, max_rel_diff=0.1, rtol=1e-5, atol=1e-8)
    report = Report(path=label or "g.h5", layers=[layer, LayerResult("<ok>", 0, "match", "ReLU", position=1)])
    page = parse(visual.html_page([(label, report)], plots="none"))
    row = next(cells for cls, cells in page.rows if cls == "first")
    assert row[1] == name and row[11] == f"{name} & <more>"
    assert {tag for tag, _ in page.tags} <= TEMPLATE_TAGS  # nothing from the name became markup
    names = [a.get("data-name") for tag, a in page.tags if tag == "tr" and "data-bad" in a]
    assert names == [name, "<ok>"]  # the filter's name, unescaped by the parser: exactly the layer name


def test_table_sort_keys_and_defaults(tmp_path):
    """What the page's script sorts and filters by: numbers JavaScript reads back exactly (inf and
    NaN included), 'diverged only' preset on big failing tables, the calibrated column when used."""
    rows = [LayerResult(f"l{i}", 0, "match", "Linear", position=i, numel=4, max_abs_diff=0.0, max_rel_diff=0.0,
                        rtol=1e-5, atol=1e-8)
            for i in range(visual.BIG_TABLE)]
    rows.append(LayerResult("bad", 0, "nonfinite", "Linear", position=len(rows), numel=4, mismatched=1,
                            max_abs_diff=math.inf, max_rel_diff=math.nan, rtol=1e-5, atol=1e-8, error_multiple=7.5))
    rows.append(LayerResult("gone", 0, "missing", "ReLU", detail="did not run"))
    page = parse(visual.html_page(Report(path="g.h5", layers=rows), plots="none"))
    attrs = [(tag, a) for tag, a in page.tags]
    only_bad = [a for tag, a in attrs if tag == "input" and a.get("class") == "only-bad"]
    assert len(only_bad) == 1 and "checked" in only_bad[0]  # > BIG_TABLE rows and diverged: opens filtered
    heads = next(cells for _, cells in page.rows)
    assert heads[-1] == "x allowed" and len(heads) == len(visual.COLUMNS) + 1
    row = next(a for tag, a in attrs if tag == "tr" and a.get("data-name") == "bad")
    assert row["id"] == "first-divergence" and row["data-bad"] == "1"
    bad = next(cells for cls, cells in page.rows if cls == "first")
    assert bad[5] == "inf" and bad[6] == "nan" and bad[-1] == "7.5"
    assert bad[11] == ""  # no free text: the counts have their own column
    gone = next(cells for cls, cells in page.rows if cells[1] == "gone")
    assert gone[0] == "-" and gone[11] == "did not run"
    text = visual.html_page(Report(path="g.h5", layers=rows), plots="none")
    assert 'data-v="Infinity"' in text and 'data-v="NaN"' in text and 'data-v="1e-05"' in text
    small = parse(visual.html_page(Report(path="g.h5", layers=rows[-3:]), plots="none"))
    assert not any("checked" in a for tag, a in small.tags if tag == "input")  # small tables open unfiltered


@pytest.mark.parametrize("name", ["cost$\\x$", "a$b$c", "$", "x" * 300])
def test_layer_and_file_names_are_drawn_as_text_not_formulas(tmp_path, name):
    """matplotlib reads $...$ as mathtext: an unparsable one raised (no plot, no HTML page, and a
    pytest run with --ag-report ended in a traceback); a parsable one drew another name."""
    torch.manual_seed(0)
    m = torch.nn.Sequential()
    m.add_module(name, torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    golden = tmp_path / "p$\\q$.h5"
    ag.record(m, x, path=golden)
    with torch.no_grad():
        m[0].bias += 1
    report = ag.compare(m, x, path=golden)
    png = visual.render_png(report)
    assert matplotlib.image.imread(io.BytesIO(png)).shape[2] in (3, 4)
    page = visual.html_page(report)
    assert "data:image/png;base64," in page
    assert visual._tick(name).replace(r"\$", "$") == (name if len(name) <= 60 else name[:59] + "\u2026")


def test_the_log_axis_keeps_its_math_ticks(monkeypatch):
    """Math rendering was once switched off for the whole figure to draw "$" in names literally;
    the log axis's ticks then read "$\\mathdefault{10^{-4}}$". Names are escaped instead."""
    seen = []
    real = visual._render_png

    def spy(report, **kw):
        seen.append(matplotlib.rcParams["text.parse_math"])
        return real(report, **kw)

    monkeypatch.setattr(visual, "_render_png", spy)
    visual.render_png(Report(path="g.h5", layers=[]))
    assert seen == [True]
    assert visual._lit("a$b") == r"a\$b"


@pytest.mark.slow
def test_the_banner_counts_layer_calls_and_gradients_apart_as_the_text_does(tmp_path):
    """The banner read '130 layer calls, 52 diverged' where the text said 37 calls matched and 52 of
    93 gradients diverged (found by review)."""
    import re

    import torch

    import activation_guard as ag

    torch.manual_seed(0)
    m, x = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3)), torch.randn(2, 3)
    ag.record(m, x, path=tmp_path / "g.h5", backward=True)
    from test_gradients_faults import with_scaled_backward

    with_scaled_backward(m[1])  # the forward is unchanged; the backward through the Tanh is scaled
    rep = ag.compare(m, x, path=tmp_path / "g.h5")
    banner = re.search(r'<p class="state">([^<]*)', visual.html_page(rep))
    assert banner is not None and banner.group(1).endswith(rep.totals_text()), banner.group(1)
    assert "backward:" in banner.group(1) and "gradients" in banner.group(1)
    fd = rep.first_divergence
    assert fd is not None and fd.phase != "forward"
    row = re.search(r'<tr class="first" id="[^"]+"[^>]*><td[^>]*>(\d+)</td>', visual.html_page(rep))
    number = re.search(r"#(\d+) of \d+ in backward order", rep.headline())
    assert row is not None and number is not None and row.group(1) == number.group(1)  # numbered as the text is

"""The HTML report in a real browser: headless Chromium driven over the DevTools protocol.

The page is opened as a person opens it (a file:// URL, JavaScript on) and checked for what they
would notice: errors in the console, anything fetched from elsewhere, the first divergence and the
layer table on screen, sorting and filtering that work, anchors that land on a visible row, and a
layout that fits a laptop screen. One browser serves the module. Skipped where no Chromium-family
browser is installed (``.ci/run`` installs Debian's ``chromium``; ``$AG_CHROMIUM`` picks another).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cdp import Browser, CDPError, find_browser

import activation_guard as ag
from activation_guard.api.demo import DemoResult, run_demo
from activation_guard.report import visual
from activation_guard.report.report import Report

BINARY = find_browser()
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no Chromium-family browser on PATH (apt-get install chromium, or set AG_CHROMIUM)")

NEXT_FRAME = "new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert BINARY is not None
    b = Browser(BINARY)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    return run_demo(tmp_path_factory.mktemp("demo"), "layernorm-eps")


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory, demo: DemoResult) -> dict[str, Path]:
    """Real reports: the demo's LayerNorm bug (single page), that plus a passing check and a
    structural divergence (several checks on one page), and a 1,200-layer model."""
    root = tmp_path_factory.mktemp("pages")
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    small = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    ag.record(small, (x,), path=root / "small.h5")
    grown = torch.nn.Sequential(small[0], small[1], small[2], torch.nn.Tanh())  # a new layer: 'unexpected'
    structural = ag.compare(grown, (x,), path=root / "small.h5")
    assert structural.first_divergence is not None and structural.first_divergence.status == "unexpected"
    deep = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(1200)))
    y = torch.randn(1, 2)
    ag.record(deep, (y,), path=root / "deep.h5")
    with torch.no_grad():
        deep[600].bias[0] += 1e-3
    big = ag.compare(deep, (y,), path=root / "deep.h5")
    out = {
        "one": visual.write_html(demo.report, root / "one.html"),
        "many": visual.write_html([("tests/test_demo.py::test_demo[cpu]", demo.report),
                                   ("tests/test_demo.py::test_unchanged", demo.baseline),
                                   ("tests/test_small.py::test_grown", structural)], root / "many.html"),
        "big": visual.write_html(big, root / "big.html", plots="none"),
    }
    return {k: Path(v) for k, v in out.items()}


def open_page(browser: Browser, path: Path, width: int = 1280) -> None:
    browser.set_viewport(width, 900)
    browser.load(path.as_uri())
    assert browser.problems() == []


def visible_names(browser: Browser, table: str = "table.layers") -> list[str]:
    return browser.eval(f"Array.from(document.querySelector({json.dumps(table)}).tBodies[0].rows)"
                        ".filter(r => !r.hidden && r.getClientRects().length).map(r => r.dataset.name)")


def click(browser: Browser, selector: str) -> None:
    browser.eval(f"document.querySelector({json.dumps(selector)}).click()")


def type_filter(browser: Browser, text: str, box: str = "section.report") -> None:
    browser.eval(f"(() => {{ const q = document.querySelector({json.dumps(box + ' input[type=search]')}); "
                 f"q.value = {json.dumps(text)}; q.dispatchEvent(new Event('input')); }})()")


# --------------------------------------------------------------------------- the harness itself


def test_the_harness_hears_console_errors_exceptions_and_requests(browser: Browser, tmp_path: Path) -> None:
    """A check for "no console errors" proves nothing unless it sees errors when there are some."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><title>x</title><img src='missing.png'>"
                   "<script>console.error('boom'); undefined_function();</script>")
    browser.load(bad.as_uri())
    browser.wait_for("Log.entryAdded")  # the failed image load is reported asynchronously
    problems = browser.problems()
    assert any("boom" in p for p in problems)
    assert any("undefined_function" in p for p in problems)
    assert any("missing.png" in p for p in problems)
    assert any(u.endswith("missing.png") for u in browser.requests())
    with pytest.raises(CDPError, match="threw"):
        browser.eval("no_such_name")


# --------------------------------------------------------------------------- one report


def test_page_loads_clean_and_self_contained(browser: Browser, pages: dict[str, Path]) -> None:
    open_page(browser, pages["one"])
    requested = [u for u in browser.requests() if not u.startswith("data:")]
    assert requested == [pages["one"].as_uri()]  # nothing fetched but the page itself (and its inline plot)
    assert browser.eval("document.querySelectorAll('script[src], link, iframe, object, embed').length") == 0
    assert browser.eval("Array.from(document.images).every(i => i.complete && i.naturalWidth > 400 "
                        "&& i.src.startsWith('data:image/png;base64,'))")
    assert browser.eval("document.querySelectorAll('img.plot').length") == 1  # (and the divergence's heatmaps)
    assert browser.eval("!document.querySelector('.tools').hidden")  # the script ran and showed its controls


def test_first_divergence_is_on_screen_highlighted_and_linked(browser: Browser, pages: dict[str, Path]) -> None:
    open_page(browser, pages["one"])
    text = browser.eval("document.body.innerText")  # what is rendered, not just present
    assert "first divergence at layer 'blocks.1.norm2' (LayerNorm) call 0, #18 of 37" in text
    assert browser.eval("document.querySelector('.banner a').getAttribute('href')") == "#first-divergence"
    assert browser.eval("document.querySelector('.banner a').textContent") == "blocks.1.norm2[0]"
    row = "document.getElementById('first-divergence')"
    assert browser.eval(f"{row}.dataset.name") == "blocks.1.norm2"
    assert browser.eval(f"{row}.className") == "first"
    assert browser.eval(f"{row}.cells[4].innerText.replace(/\\s+/g, ' ')") == "FIRST diverged"
    assert browser.eval(f"getComputedStyle({row}.cells[1]).fontWeight") == "600"
    assert len(visible_names(browser)) == 37
    # following the link lands on the row, visible and not under the sticky header
    assert browser.eval("window.scrollY") == 0
    click(browser, ".banner a")
    assert browser.eval(NEXT_FRAME)
    hit = f"""(() => {{ const r = {row}.getBoundingClientRect();
        const el = document.elementFromPoint(r.left + 40, r.top + r.height / 2);
        return [r.top >= 0 && r.bottom <= innerHeight, el !== null && el.closest('tr') === {row}]; }})()"""
    assert browser.eval(hit) == [True, True]


def test_sorting_by_a_column_and_back(browser: Browser, pages: dict[str, Path]) -> None:
    open_page(browser, pages["one"])
    order = visible_names(browser)
    assert order[:3] == ["embed", "blocks.0.norm1", "blocks.0.attn.qkv"]  # execution order
    keys = "Array.from(document.querySelector('table.layers').tBodies[0].rows).map(r => r.cells[5].dataset.v)"
    max_abs = "document.querySelector('table.layers th:nth-child(6)')"
    click(browser, "table.layers th:nth-child(6) button")  # max abs: largest first
    assert browser.eval(f"{max_abs}.getAttribute('aria-sort')") == "descending"
    values = [float(v) for v in browser.eval(keys)]
    assert values == sorted(values, reverse=True) and values[0] > 0
    assert visible_names(browser)[0] == "blocks.1.norm2"  # the demo's largest difference is at the bug
    click(browser, "table.layers th:nth-child(6) button")
    assert browser.eval(f"{max_abs}.getAttribute('aria-sort')") == "ascending"
    values = [float(v) for v in browser.eval(keys)]
    assert values == sorted(values)
    click(browser, "table.layers th:nth-child(2) button")  # layer name, A to Z
    names = visible_names(browser)
    assert names == sorted(names, key=str.lower)
    assert browser.eval(f"{max_abs}.getAttribute('aria-sort')") == "none"
    click(browser, "table.layers th:nth-child(1) button")  # '#': back to execution order
    assert visible_names(browser) == order


def test_diverged_only_and_the_name_filter(browser: Browser, pages: dict[str, Path]) -> None:
    open_page(browser, pages["one"])
    everything = visible_names(browser)
    click(browser, "section.report input.only-bad")
    bad = visible_names(browser)
    assert len(bad) == 20 and bad[0] == "blocks.1.norm2"
    assert browser.eval("Array.from(document.querySelectorAll('table.layers tbody tr'))"
                        ".filter(r => !r.hidden).every(r => r.dataset.bad === '1')")
    assert browser.eval("document.querySelector('section.report .count').textContent") == "showing 20 of 37 layer calls"
    type_filter(browser, "mlp")  # plain text: a case-insensitive substring, combined with 'diverged only'
    assert visible_names(browser) == ["blocks.1.mlp.fc1", "blocks.1.mlp.act", "blocks.1.mlp.fc2", "blocks.1.mlp",
                                      "blocks.2.mlp.fc1", "blocks.2.mlp.act", "blocks.2.mlp.fc2", "blocks.2.mlp"]
    click(browser, "section.report input.only-bad")
    type_filter(browser, "blocks.0.*")  # a glob matches the whole name
    assert visible_names(browser) == [n for n in everything if n.startswith("blocks.0.")]
    type_filter(browser, "")
    assert visible_names(browser) == everything
    assert browser.eval("document.querySelector('section.report .count').textContent") == "all 37 layer calls"


def test_the_first_divergence_link_clears_a_filter_that_hides_its_row(browser: Browser, pages: dict[str, Path]) -> None:
    open_page(browser, pages["one"])
    type_filter(browser, "no such layer")
    assert visible_names(browser) == []
    click(browser, ".banner a")
    assert browser.eval("document.querySelector('section.report input[type=search]').value") == ""
    assert "blocks.1.norm2" in visible_names(browser)


@pytest.mark.parametrize("width", [1280, 800])
def test_layout_fits_the_window(browser: Browser, pages: dict[str, Path], width: int) -> None:
    """At laptop width nothing scrolls sideways; at 800 px only the table's own box may."""
    open_page(browser, pages["one"], width)
    page = browser.eval("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert page[0] <= page[1] == width
    boxes = browser.eval("Array.from(document.querySelectorAll('.scroll')).map(e => [e.scrollWidth, e.clientWidth])")
    assert boxes
    if width == 1280:
        assert all(sw <= cw for sw, cw in boxes), boxes
    assert browser.eval("document.images[0].getBoundingClientRect().right") <= width
    assert browser.eval("document.querySelector('pre').getBoundingClientRect().right") <= width


# --------------------------------------------------------------------------- several reports, many rows


def test_several_checks_on_one_page(browser: Browser, pages: dict[str, Path]) -> None:
    open_page(browser, pages["many"])
    ids = browser.eval("Array.from(document.querySelectorAll('[id]')).map(e => e.id)")
    assert len(ids) == len(set(ids))
    assert {"report-0", "report-1", "report-2", "first-divergence", "report-2-first"} <= set(ids)
    assert browser.eval("document.querySelectorAll('table.layers').length") == 3
    assert visible_names(browser, "table.checks") == ["tests/test_demo.py::test_demo[cpu]",
                                                      "tests/test_demo.py::test_unchanged",
                                                      "tests/test_small.py::test_grown"]
    browser.eval("document.querySelector('table.checks').closest('.table-box').querySelector('input.only-bad').click()")
    assert visible_names(browser, "table.checks") == ["tests/test_demo.py::test_demo[cpu]",
                                                      "tests/test_small.py::test_grown"]
    assert len(visible_names(browser, "#report-0 table")) == 37  # other tables untouched
    # the passing check's table is folded; the structural one's first divergence is linked from the top table
    assert browser.eval("document.querySelector('#report-1 details').open") is False
    assert browser.eval("document.querySelectorAll('#report-1 img').length") == 0
    click(browser, "table.checks a[href='#report-2-first']")
    assert browser.eval("document.getElementById('report-2-first').dataset.name") == "3"
    assert browser.eval("document.getElementById('report-2-first').getClientRects().length") == 1
    assert browser.problems() == []


def test_a_big_table_opens_filtered_to_its_divergences(browser: Browser, pages: dict[str, Path]) -> None:
    open_page(browser, pages["big"])
    assert browser.eval("document.querySelector('input.only-bad').checked") is True
    shown = visible_names(browser)
    n_bad = browser.eval("document.querySelectorAll('table.layers tr[data-bad=\"1\"]').length")
    assert shown[0] == "600" and len(shown) == n_bad and 0 < n_bad < 100  # the bug and where it propagated
    assert browser.eval("document.querySelector('.count').textContent") == f"showing {len(shown)} of 1201 layer calls"
    click(browser, "input.only-bad")
    assert len(visible_names(browser)) == 1201
    assert browser.eval("[document.documentElement.scrollWidth, document.documentElement.clientWidth]") == [1280, 1280]


def test_report_pages_need_the_script_for_nothing_but_comfort(browser: Browser, pages: dict[str, Path]) -> None:
    """Without JavaScript every row is there and the filter controls (useless then) are hidden."""
    browser.call("Emulation.setScriptExecutionDisabled", {"value": True}, session=True)
    try:
        open_page(browser, pages["one"])
        assert len(visible_names(browser)) == 37
        assert browser.eval("document.querySelector('.tools').getClientRects().length") == 0
    finally:
        browser.call("Emulation.setScriptExecutionDisabled", {"value": False}, session=True)


def test_a_report_rebuilt_from_json_renders_the_same_table(browser: Browser, demo: DemoResult, tmp_path: Path) -> None:
    """The pytest plugin renders the page from JSON reports (xdist workers): same rows, same anchor."""
    rebuilt = Report.from_dict(json.loads(json.dumps(demo.report.to_dict())))
    p = visual.write_html([("tests/test_x.py::test_x", rebuilt)], tmp_path / "rebuilt.html", plots="none")
    open_page(browser, Path(p))
    assert browser.eval("document.getElementById('first-divergence').dataset.name") == "blocks.1.norm2"
    assert len(visible_names(browser)) == 37


# --------------------------------------------------------------------------- heatmaps of a divergence


@pytest.fixture(scope="module")
def heat_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token positions from 6 on changed in a small transformer-like stack: several diverged calls
    with heatmaps."""
    root = tmp_path_factory.mktemp("heat")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 16), torch.nn.Tanh())
    x = torch.randn(2, 12, 16)
    ag.record(m, (x,), path=root / "g.h5")
    x2 = x.clone()
    x2[:, 6:] += 0.05
    r = ag.compare(m, (x2,), path=root / "g.h5", replay="off", where=["2"])
    return Path(visual.write_html(r, root / "heat.html"))


def test_heatmap_renders_and_a_click_shows_another_layers(browser: Browser, heat_page: Path) -> None:
    open_page(browser, heat_page)
    figs = "Array.from(document.querySelectorAll('figure.heat'))"
    assert browser.eval(f"{figs}.length") == 3  # the first two diverged calls, and layer 2 (asked for by `where`)
    shown = f"{figs}.filter(f => !f.hidden && f.getClientRects().length).map(f => f.dataset.fig)"
    first = browser.eval(shown)
    assert len(first) == 1
    fig_id = browser.eval("document.getElementById('first-divergence').dataset.heat")
    assert first[0] == fig_id
    assert browser.eval(f"{figs}.every(f => f.querySelector('img').complete "
                        f"&& f.querySelector('img').naturalWidth > 300)")  # decoded, not a broken image
    caption = browser.eval(f"document.querySelector('figure.heat[data-fig={json.dumps(fig_id)}]').innerText")
    assert "only at 6-11" in caption
    target = browser.eval("document.querySelector('tr[data-name=\"2\"]').dataset.heat")
    click(browser, 'tr[data-name="2"] td.name')
    assert browser.eval(shown) == [target]
    assert browser.problems() == []

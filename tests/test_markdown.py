"""The Markdown summary without pytest: escaping that holds for any text, rows for every kind of
check, plots beside the page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import activation_guard as ag
from activation_guard.plugin.session import CheckRecord
from activation_guard.report import markdown, visual


def _cells(row: str) -> list[str]:
    """A table row split as GitHub splits it: on pipes not escaped by a backslash."""
    assert row.startswith("| ") and row.endswith(" |") and "\n" not in row
    return [c.strip() for c in re.split(r"(?<!\\)\|", row[1:-1])]


@given(st.text())
def test_text_cell_is_one_inert_cell(text: str) -> None:
    cell = markdown.text_cell(text)
    assert "\n" not in cell and "\r" not in cell and not re.search(r"(?<!\\)\|", cell)
    assert "<" not in cell.replace("<br>", "") and not re.search(r"(?<!\\)[`*\[\]]", cell)


@given(st.text())
def test_code_span_keeps_the_text(text: str) -> None:
    span = markdown.code_span(text)
    # GitHub's table parser (cmark-gfm) takes any pipe right after a backslash as escaped
    assert "\n" not in span and "\r" not in span and not re.search(r"(?<!\\)\|", span)
    fence = re.match(r"`+", span)
    assert fence is not None
    n = len(fence.group())
    inner = span[n:-n]
    assert span.endswith("`" * n) and "`" * n not in inner.replace("`" * (n + 1), "")
    flat = " ".join(text.splitlines())
    if flat.strip() and not (flat.startswith("`") or flat.endswith("`")):
        assert inner.replace("\\|", "|") == flat


@given(st.text(min_size=1), st.one_of(st.none(), st.text()), st.text(),
       st.sampled_from(["passed", "diverged", "written", "missing", "error", "deferred"]))
def test_any_check_is_one_row_of_six_cells(nodeid: str, name: str | None, message: str, status: str) -> None:
    rec = CheckRecord(nodeid, name, "/g/x.h5", status, message=message or None, first_divergence=None)
    row = markdown.table_row(rec, None)
    assert len(_cells(row)) == 6


def _diverged_record(tmp_path: Path, nodeid: str, scale: float) -> CheckRecord:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).eval()
    x = torch.linspace(-1, 1, 6).reshape(2, 3)
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.h5"
    ag.record(m, (x,), path=path)
    with torch.no_grad():
        m[2].weight.mul_(scale)
    rep = ag.compare(m, (x,), path=path)
    status = "passed" if rep.ok else "diverged"
    return CheckRecord(nodeid, None, str(path), status, report=rep.to_dict())


def test_rows_details_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "g").mkdir()
    records = [
        _diverged_record(tmp_path / "g", "t.py::test_b", 2.0),
        CheckRecord("t.py::test_e", None, "/g/e.h5", "error", message="golden /g/e.h5: broken | bad\nsecond line"),
        _diverged_record(tmp_path / "g", "t.py::test_a", 1.0),
        CheckRecord("t.py::test_m", "enc", "/g/m.h5", "missing"),
    ]
    out = tmp_path / "out" / "summary.md"
    markdown.write_summary(out, records, counts={"checked": 3})
    md = out.read_text(encoding="utf-8")
    rows = [_cells(ln) for ln in md.splitlines() if ln.startswith("| ")]
    assert [r[0] for r in rows[1:]] == ["`t.py::test_a`", "`t.py::test_b`", "`t.py::test_e`", "`t.py::test_m (enc)`"]
    assert rows[1][1:3] == ["✅ passed", "-"] and rows[1][3] == "0"
    assert rows[2][1] == "❌ diverged" and rows[2][2] == "`2` (Linear) call 0: values outside tolerance; origin: layer"
    assert rows[3][2] == "golden /g/e.h5: broken \\| bad" and rows[4][1] == "❔ missing"
    assert md.count("<details>") == 1 and "<summary>t.py::test_b: first divergence at 2[0] (Linear)" in md
    if visual.plot_available():
        assert "![error by layer: t.py::test_b](summary-plot-2.png)" in md
        assert (tmp_path / "out/summary-plot-2.png").read_bytes().startswith(b"\x89PNG")
    monkeypatch.setattr(visual, "plot_available", lambda: False)
    markdown.write_summary(out, records)
    assert not list((tmp_path / "out").glob("*.png")) and ".png" not in out.read_text(encoding="utf-8")


def test_a_layer_name_cannot_end_the_details_block(tmp_path: Path) -> None:
    """A blank line inside <summary> ended the HTML block, and the rest of the name rendered as
    Markdown: an external image, a link, a heading (found by review). The summary stays one line."""
    import dataclasses

    name = "enc\n\n![pixel](https://evil%2Eexample/t%2Epng)\n\n## All checks passed\x1b[2J"

    class Scale(torch.nn.Module):
        k = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

    root = torch.nn.Sequential()
    root.add_module(name, Scale())
    x = torch.randn(2, 3)
    ag.record(root, (x,), path=tmp_path / "g.h5")
    getattr(root, name).k = 2.0
    report = ag.compare(root, (x,), path=tmp_path / "g.h5")

    @dataclasses.dataclass
    class Check:
        nodeid: str
        name: object
        status: str
        message: object
        first_divergence: object
        report: dict

    md = markdown.render([Check("tests/test_m.py::test_enc", None, "diverged", None, None, report.to_dict())])
    summaries = [line for line in md.splitlines() if "<summary>" in line]
    assert summaries and all(line.startswith("<summary>") and line.endswith("</summary>") for line in summaries)
    assert "\x1b" not in md
    lines = md.splitlines()
    fence = [i for i, line in enumerate(lines) if line.startswith("```")]
    outside = [line for i, line in enumerate(lines) if not any(a < i < b for a, b in zip(fence[::2], fence[1::2]))]
    assert not any(line.startswith(("## All", "![pixel]")) for line in outside)

"""The Markdown form of ``--ag-report`` (a path ending in ``.md``): a CI job summary page.

Made for GitHub Actions' step summary (``cat summary.md >> "$GITHUB_STEP_SUMMARY"``) and any
other renderer of GitHub-flavoured Markdown: one table row per check, then each diverged check's
text report folded under ``<details>``, with its error-by-layer plot written as a PNG beside the
``.md`` and linked (when matplotlib is installed; upload the folder as an artefact to keep them).

Works from the records' report dictionaries (``Report.to_dict()``), so checks run by xdist
workers are included, and never needs pytest. The numbers in a row are those of the first
diverging layer (where a fix starts); for a passing check, those of the layer with the largest
absolute difference (how close it came).
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from ..results import LayerResult
from .report import WHY, Report, fmt_diff, gradient_text, why
from .textfmt import estimate_ratio, estimated_l2, safe_line, sketch_blind

STATUS = {
    "passed": "✅ passed",
    "diverged": "❌ diverged",
    "error": "⚠️ error",
    "missing": "❔ missing",
    "written": "📝 written",
    "deferred": "⏭️ deferred",
}
COLUMNS = ("test", "status", "first divergence", "max abs diff", "max rel diff", "tolerance")
# Markdown punctuation that could start emphasis, code, links or a table cell; "_" only at a word
# edge (GitHub never reads intraword underscores as emphasis, and test names are full of them)
_MD_PUNCT = re.compile(r"([\\`*\[\]|~#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


class CheckLike(Protocol):
    """What a row needs from a check (``session.CheckRecord`` has it)."""

    nodeid: str
    name: str | None
    status: str
    message: str | None
    first_divergence: str | None
    report: dict[str, Any] | None


# --------------------------------------------------------------------------- escaping


def text_cell(text: str) -> str:
    """Plain text for one table cell: Markdown and HTML inert, ``|`` escaped, line breaks as ``<br>``."""
    lines = str(text).splitlines() or [""]
    return "<br>".join(_MD_PUNCT.sub(r"\\\1", html.escape(line, quote=False)) for line in lines)


def code_span(text: str) -> str:
    """``text`` as inline code that survives backticks, ``|`` and line breaks inside a table cell."""
    flat = " ".join(str(text).splitlines())
    runs = [len(m) for m in re.findall(r"`+", flat)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") or not flat.strip() else ""
    return f"{fence}{pad}{flat.replace('|', chr(92) + '|')}{pad}{fence}"


def _fenced(text: str) -> list[str]:
    runs = [len(m) for m in re.findall(r"`{3,}", text)]
    fence = "`" * max(3, max(runs, default=0) + 1)
    return [f"{fence}text", text, fence]


# --------------------------------------------------------------------------- rows


def _shown_layer(report: Report) -> LayerResult | None:
    fd = report.first_divergence
    if fd is not None:
        return fd
    numeric = [layer for layer in report.layers if layer.max_abs_diff is not None]
    if not numeric:  # fingerprints only: the layer whose estimate came closest to its limit
        return max((layer for layer in report.layers if estimate_ratio(layer) is not None),
                   key=lambda layer: estimate_ratio(layer) or 0.0, default=None)
    return max(numeric, key=lambda layer: layer.max_abs_diff or 0.0, default=None)


def _tolerance(layer: LayerResult | None) -> str:
    if layer is None:
        return "-"
    if layer.error_multiple is not None:
        return f"calibrated: error {layer.error_multiple:.3g}x the allowance"
    if layer.rtol is not None and layer.atol is not None:
        return f"rtol={layer.rtol:g}, atol={layer.atol:g}"
    if layer.min_sqnr_db is not None:  # an SQNR gate: the layer's SQNR against its threshold
        sqnr = "-" if layer.energy is None else f"SQNR {layer.energy.sqnr_db():.1f} dB, "
        return f"{sqnr}min_sqnr_db {layer.min_sqnr_db:g}"
    return "-"


def _diff_cells(layer: LayerResult | None) -> tuple[str, str]:
    """The max abs / max rel cells; a fingerprinted output has no measured difference: its
    estimated ||diff||_2 and the estimate over the sketch's limit (fails above 1) instead."""
    if layer is None:
        return "-", "-"
    est, ratio = estimated_l2(layer), estimate_ratio(layer)
    if layer.max_abs_diff is None and est is not None:
        return f"est. L2 {fmt_diff(est)}", "-" if ratio is None else f"est/limit {ratio:.2g}"
    return fmt_diff(layer.max_abs_diff), fmt_diff(layer.max_rel_diff)


def _classes(layer: LayerResult) -> str:
    """The module's class, or golden -> live class when it changed."""
    if layer.golden_type_name is None:
        return layer.type_name
    return f"{layer.golden_type_name} -> {layer.type_name}"


def _divergence(report: Report | None, check: CheckLike) -> str:
    if report is not None:
        fd = report.first_divergence
        if fd is not None:
            kind = f" ({text_cell(_classes(fd))})" if fd.type_name else ""
            cell = f"{code_span(fd.name or '<root>')}{kind} call {fd.call}: {text_cell(WHY.get(fd.status, fd.status))}"
            if fd.phase != "forward":  # gradients: which gradient, in the backward pass
                call = "" if fd.phase == "param-grad" else f" call {fd.call}"
                cell = (f"backward pass: {code_span(fd.name or '<root>')}{kind}{call}, {text_cell(gradient_text(fd))}: "
                        f"{text_cell(why(fd))}")
            blind = sketch_blind(fd)
            if blind is not None:
                cell += f"; **{text_cell(blind)}**"
            o = report.origin
            if o is not None and (o.name, o.call) != (fd.name, fd.call):
                cell += f"; origin: {text_cell(o.kind)} in {code_span(o.name or '<root>')}"
            elif o is not None:
                cell += f"; origin: {text_cell(o.kind)}"
            return cell
        return "-"
    if check.first_divergence:
        return text_cell(check.first_divergence)
    if check.message:
        return text_cell(check.message.splitlines()[0])
    return "-"


def _details_title(check: CheckLike, report: Report) -> str:
    fd = report.first_divergence
    if fd is None:
        return check_label(check)
    kind = f" ({_classes(fd)})" if fd.type_name else ""
    return f"{check_label(check)}: first divergence at {fd.label}{kind}: {why(fd)}"


def _summary_text(title: str) -> str:
    """A ``<summary>`` on one line: a blank line inside it (a layer name with newlines, from the
    model or a hand-edited golden) would end the HTML block and let the rest render as Markdown
    (images, links, headings). Whitespace runs become one space, other controls are escaped."""
    return html.escape(safe_line(" ".join(title.split())), quote=False)


def check_label(check: CheckLike) -> str:
    return check.nodeid + (f" ({check.name})" if check.name else "")


def table_row(check: CheckLike, report: Report | None) -> str:
    layer = _shown_layer(report) if report is not None else None
    cells = [
        code_span(check_label(check)),
        text_cell(STATUS.get(check.status, check.status)),
        _divergence(report, check),
        *_diff_cells(layer),
        text_cell(_tolerance(layer)),
    ]
    return "| " + " | ".join(cells) + " |"


# --------------------------------------------------------------------------- page


def ordered(checks: Sequence[CheckLike]) -> list[CheckLike]:
    """The checks in the order the page lists them: by test id, then check name (xdist merges
    workers' records in arrival order)."""
    return sorted(checks, key=lambda c: (c.nodeid, c.name or ""))


def render(
    checks: Sequence[CheckLike],
    *,
    title: str = "activation_guard",
    counts: Mapping[str, int] | None = None,
    plots: Mapping[int, str] | None = None,
    unused: Sequence[str] = (),
) -> str:
    """The summary page. ``plots`` maps an index into the *sorted* checks (see :func:`ordered`)
    to the relative link of its PNG."""
    rows = ordered(checks)
    reports = [Report.from_dict(c.report) if c.report is not None else None for c in rows]
    out = [f"### {text_cell(title)}", ""]
    if counts:
        out += [text_cell(", ".join(f"{v} {k}" for k, v in counts.items())), ""]
    if rows:
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|" + "|".join("---" for _ in COLUMNS) + "|")
        out += [table_row(c, r) for c, r in zip(rows, reports)]
        out.append("")
    for i, (c, r) in enumerate(zip(rows, reports)):
        if r is None or r.ok:
            continue
        out += ["<details>", f"<summary>{_summary_text(_details_title(c, r))}</summary>", ""]
        if plots and i in plots:
            out += [f"![error by layer: {text_cell(check_label(c))}]({quote(plots[i])})", ""]
        out += [*_fenced(str(r)), "", "</details>", ""]
    if unused:
        out += [f"**{len(unused)} unused golden(s)** (no test that ran used them):", ""]
        out += [f"- {code_span(u)}" for u in unused]
        out.append("")
    # (a GitHub step summary is also read with cat in a terminal: no escape sequence gets through)
    return "\n".join(safe_line(line) for line in "\n".join(out).split("\n"))


def plot_name(md_path: Path, i: int) -> str:
    return f"{md_path.stem}-plot-{i + 1}.png"


def write_summary(
    path: str | os.PathLike[str],
    checks: Sequence[CheckLike],
    *,
    title: str = "activation_guard",
    counts: Mapping[str, int] | None = None,
    unused: Sequence[str] = (),
) -> Path:
    """Write the page to ``path`` and, when matplotlib is installed, each diverged check's
    error-by-layer plot beside it (``<stem>-plot-<n>.png``, stale ones from earlier runs removed)."""
    from . import visual  # matplotlib stays optional

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    stale = re.compile(re.escape(p.stem) + r"-plot-\d+\.png")
    for old in p.parent.iterdir():
        if stale.fullmatch(old.name) and old.is_file():
            old.unlink()
    plots: dict[int, str] = {}
    if visual.plot_available():
        for i, c in enumerate(ordered(checks)):
            if c.report is None:
                continue
            rep = Report.from_dict(c.report)
            if not rep.ok:
                visual.write_plot(rep, p.parent / plot_name(p, i), title=f"error by layer: {check_label(c)}")
                plots[i] = plot_name(p, i)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(render(checks, title=title, counts=counts, plots=plots, unused=unused) + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return p

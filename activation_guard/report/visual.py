"""Pictures of a report: error by layer in execution order, and a self-contained HTML page.

A 300-row table hides what a plot shows at once: where error starts, whether it grows through
depth (a real bug propagating) or stays flat near the tolerance (noise), and which layer first
crossed the line. The plot draws, per layer call in execution order, the largest absolute and
relative difference on a log axis with the tolerances in force, failing calls marked, and the
first divergence labelled.

matplotlib is an optional extra (``pip install 'activation_guard[plot]'``); it is imported only
here, lazily, with the non-interactive Agg canvas (no pyplot, no global backend switch), so
importing activation_guard never needs it. Without it, :func:`write_plot` raises
:class:`PlotUnavailableError` and :func:`write_html` still writes the page, minus the picture.

The page is one file people open from a CI artefact, so it is self-contained: its stylesheet and
its small script (``assets/report.css``, ``assets/report.js``, kept as files so they can be read
and linted as what they are) are inlined, the plot is a base64 PNG. The module is nearly 500
lines because the plot and the page are one presentation of a report with one optional
dependency; splitting them would put the page's plot call behind an import cycle.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any, NamedTuple, Protocol, Union, runtime_checkable

from .._core.errors import ActivationGuardError
from ..results import Heat, IdenticalCall, LayerResult, LeafResult, Origin
from .heatmap import render_heat_png
from .textfmt import fmt_diff, fmt_pair, why


@runtime_checkable
class ReportLike(Protocol):
    """What the pictures read of a report (:class:`~.report.Report` is one). This module does not
    import the Report class, so a Report can show its own HTML page in a notebook without an import
    cycle."""

    path: str
    layers: list[LayerResult]
    origin: Origin | None
    _order: dict[int, tuple[float, int]]

    @property
    def ok(self) -> bool: ...

    @property
    def live_count(self) -> int: ...

    @property
    def first_divergence(self) -> LayerResult | None: ...

    def number(self, layer: LayerResult, live_count: int | None = None) -> int | None: ...

    def headline(self) -> str: ...

    def totals_text(self) -> str: ...

INSTALL_HINT = "pip install 'activation_guard[plot]' (or: pip install matplotlib)"


class PlotUnavailableError(ActivationGuardError, ImportError):
    """matplotlib (the optional ``plot`` extra) is not installed."""


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailableError(f"plots need matplotlib, which is not installed: {INSTALL_HINT}") from e
    return Figure, FigureCanvasAgg


def plot_available() -> bool:
    try:
        _matplotlib()
    except PlotUnavailableError:
        return False
    return True


def heat_png(label: str, leaf: LeafResult, *, golden_only: bool = False) -> bytes | None:
    """The heatmap of a described output (``leaf.where.heat``), or None when it has no grid."""
    if leaf.where is None or leaf.where.heat is None:
        return None
    name = label + (f" output {leaf.path}" if leaf.path else "")
    return render_heat_png(leaf.where.heat, _matplotlib(), title=_lit(name), rtol=leaf.rtol, atol=leaf.atol,
                           golden_only=golden_only)


def golden_png(label: str, heat: Heat) -> bytes:
    """A golden's values alone, as ``inspect --plot`` draws them."""
    return render_heat_png(heat, _matplotlib(), title=_lit(f"golden {label}"), golden_only=True)


MAX_HEATMAPS = 24  # pictures in one check's section: a page of a GPT-2-small compare stays under 2 MB


def _heat_figures(report: ReportLike, i: int) -> tuple[list[str], dict[int, str]]:
    """Heatmaps of the diverged calls whose shape was taken: the first divergence's shown, the
    others hidden until their row is clicked (the first ``MAX_HEATMAPS``; a note counts the rest).
    Returns the figures and each row's figure id."""
    fd = report.first_divergence
    out: list[str] = []
    ids: dict[int, str] = {}
    left = 0
    for k, layer in enumerate(report.layers):
        if layer.ok or (isinstance(layer, IdenticalCall) and not layer.built):
            continue
        if len(ids) >= MAX_HEATMAPS and layer is not fd:
            left += any(x.where is not None and x.where.heat is not None for x in layer.leaves)
            continue
        leaf = next((x for x in layer.leaves if x.where is not None and x.where.heat is not None), None)
        if leaf is None:
            continue
        png = heat_png(layer.label, leaf)
        if png is None:
            continue
        fid = f"heat-{i}-{k}"
        ids[id(layer)] = fid
        b64 = base64.b64encode(png).decode("ascii")
        hidden = "" if layer is fd else " hidden"
        words = "; ".join(leaf.where.lines()) if leaf.where is not None else ""
        out.append(f'<figure class="heat" data-fig="{fid}"{hidden}><img class="heat" '
                   f'alt="heatmap of {_e(layer.label)}" src="data:image/png;base64,{b64}">'
                   f"<figcaption>{_e(layer.label)}: {_e(words)}</figcaption></figure>")
    if left:
        out.append(f'<p class="note">{left} more described calls have no picture on this page (it stays small): '
                   f"<code>activation-guard diff --heatmap LAYER FILE.png</code> draws one</p>")
    return out, ids


# --------------------------------------------------------------------------- plot


def _live_layers(report: ReportLike) -> list[LayerResult]:
    live = [x for x in report.layers if x.position is not None]
    live.sort(key=lambda x: x.position if x.position is not None else 0)
    return live


def _finite_pos(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def _pos_or_nan(v: float | None) -> float:
    return v if v is not None and _finite_pos(v) else math.nan


def backward_span(report: ReportLike) -> tuple[float, float] | None:
    """The x range of the gradient rows (gradients), drawn shaded; None without any."""
    live = _live_layers(report)
    first = next((i for i, x in enumerate(live) if x.phase != "forward"), None)
    return None if first is None else (first + 0.5, len(live) + 0.5)


def _first_x(report: ReportLike, fd: LayerResult, n: int) -> float:
    """Where the first divergence sits on the execution-order axis (1-based)."""
    if fd.position is not None:
        return fd.position + 1.0
    key = report._order.get(report.layers.index(fd), (math.inf, 0))[0]
    return min(key + 1.0, n + 0.5) if math.isfinite(key) else n + 0.5


def render_png(report: ReportLike, *, title: str | None = None, dpi: int = 110) -> bytes:
    """The error-by-layer plot of ``report`` as PNG bytes. Every text from a layer or file name is
    drawn as given (:func:`_lit`); the axis keeps matplotlib's math rendering for its ticks."""
    return _render_png(report, title=title, dpi=dpi)


def _lit(text: str) -> str:
    """``text`` drawn literally: matplotlib reads ``$...$`` as a formula (and raises on one it
    cannot parse), and an escaped dollar is drawn as a dollar. (Switching math off for the whole
    figure, as once done, also drew the log axis's ticks as ``$\\mathdefault{10^{-4}}$``.)"""
    return text.replace("$", r"\$")


def _tick(name: str, limit: int = 60) -> str:
    """A tick label short enough to leave room for the plot (the full names are in the tables),
    drawn literally."""
    return _lit(name if len(name) <= limit else name[: limit - 1] + "\u2026")


def _render_png(report: ReportLike, *, title: str | None, dpi: int) -> bytes:
    figure_cls, canvas_cls = _matplotlib()
    live = _live_layers(report)
    n = len(live)
    xs = list(range(1, n + 1))
    absd = [x.max_abs_diff for x in live]
    reld = [x.max_rel_diff for x in live]
    positives = [v for v in absd + reld + [x.atol for x in live] + [x.rtol for x in live]
                 if v is not None and _finite_pos(v)]
    lo = min(positives) if positives else 1e-8
    hi = max(positives) if positives else 1.0
    floor, ceil = lo / 10.0, hi * 100.0

    def on_axis(v: float | None) -> float:
        if v is None:
            return math.nan
        if math.isnan(v) or v == math.inf:
            return ceil
        return v if v > 0 else floor

    names = [x.label for x in live]
    show_names = 0 < n <= 60
    width = max(8.0, min(22.0, 0.22 * n + 3.0))
    height = 5.2 + (min(2.4, 0.075 * max(len(s) for s in names)) if show_names and names else 0.0)
    fig = figure_cls(figsize=(width, height), dpi=dpi)
    canvas_cls(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_yscale("log")
    c_abs, c_rel, c_bad = "#1f77b4", "#ff7f0e", "#d62728"
    if n:
        ax.plot(xs, [on_axis(v) for v in absd], "o-", color=c_abs, ms=3.5, lw=1.2, label="max abs diff")
        ax.plot(xs, [on_axis(v) for v in reld], "s-", color=c_rel, ms=3.0, lw=1.0, alpha=0.85, label="max rel diff")
        atol = [_pos_or_nan(x.atol) for x in live]
        rtol = [_pos_or_nan(x.rtol) for x in live]
        if any(not math.isnan(v) for v in atol):
            ax.step(xs, atol, where="mid", ls="--", color=c_abs, lw=1.0, alpha=0.7, label="atol (abs tolerance)")
        if any(not math.isnan(v) for v in rtol):
            ax.step(xs, rtol, where="mid", ls=":", color=c_rel, lw=1.3, alpha=0.9, label="rtol (rel tolerance)")
        bad = [(i + 1, x) for i, x in enumerate(live) if not x.ok]
        numeric_bad = [(i, x) for i, x in bad if x.max_abs_diff is not None]
        if numeric_bad:
            ax.scatter([i for i, _ in numeric_bad], [on_axis(x.max_abs_diff) for _, x in numeric_bad], s=60,
                       facecolors="none", edgecolors=c_bad, linewidths=1.3, zorder=5, label="outside tolerance")
        for i, x in bad:
            if x.max_abs_diff is None:  # shape/dtype/structure/unexpected: no numbers to draw
                ax.axvline(i, color=c_bad, alpha=0.25, lw=3)
        missing = [(_first_x(report, x, n), x) for x in report.layers if x.position is None]
        if missing:  # golden calls that did not run: marked where the live run passed their place
            ax.scatter([m for m, _ in missing], [floor] * len(missing), marker="x", s=50, color=c_bad, zorder=6,
                       clip_on=False, label="golden call that did not run")
            for mx, x in missing[:8]:
                ax.annotate(_tick(x.label), xy=(mx, floor), xytext=(0, 8), textcoords="offset points", rotation=90,
                            ha="center", va="bottom", fontsize=7, color=c_bad)
        span = backward_span(report)  # gradients: the backward pass shaded and labelled
        if span is not None:
            ax.axvspan(*span, color="#9467bd", alpha=0.08, lw=0, label="backward pass (gradients, backward order)")
            ax.text(span[0], 0.99, " backward", transform=ax.get_xaxis_transform(), va="top", ha="left",
                    fontsize=8, color="#9467bd")
        if any(v is not None and v == 0 for v in absd + reld):
            ax.axhline(floor, color="0.6", lw=0.8)
            ax.text(0.01, floor, "0 (exact match) drawn on this line", va="bottom", ha="left", fontsize=7, color="0.4",
                    transform=ax.get_yaxis_transform())
        if any(v is not None and not math.isfinite(v) for v in absd + reld):
            ax.axhline(ceil, color=c_bad, lw=0.8, alpha=0.6)
            ax.text(0.01, ceil, "inf / NaN drawn on this line", va="bottom", ha="left", fontsize=7, color=c_bad,
                    transform=ax.get_yaxis_transform())
    fd = report.first_divergence
    if fd is not None:
        fx = _first_x(report, fd, n)
        left = fx <= max(n, 1) * 0.6
        ax.axvline(fx, color=c_bad, ls="-.", lw=1.2)
        ax.annotate(f"first divergence: {_tick(fd.label)} ({_lit(why(fd))})", xy=(fx, 0.91),
                    xycoords=("data", "axes fraction"), xytext=(6 if left else -6, 0), textcoords="offset points",
                    ha="left" if left else "right", va="top", fontsize=9, color=c_bad,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": c_bad, "alpha": 0.9})
    has_nonfinite = any(v is not None and not math.isfinite(v) for v in absd + reld)
    ax.set_ylim(floor / 2, ceil * 4 if has_nonfinite else hi * 20)
    ax.set_xlim(0.5, max(n, 1) + 0.5)
    if show_names:
        ax.set_xticks(xs)
        ax.set_xticklabels([_tick(n) for n in names], rotation=90, fontsize=7)
        ax.set_xlabel("layer call, in execution order" + ("; then gradients, in backward order"
                                                         if backward_span(report) else ""))
    else:
        ax.set_xlabel("layer call # (execution order" + (", then gradients in backward order)"
                                                       if backward_span(report) else ")"))
    ax.set_ylabel("difference (log scale)")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    if title is None:
        status = "OK" if report.ok else f"first divergence at {fd.label}" if fd else "diverged"
        title = f"error by layer: {os.path.basename(report.path) or report.path} ({status})"
    ax.set_title(_tick(title, 120), fontsize=10)
    if n:
        ax.legend(loc="best", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def write_plot(report: ReportLike, path: str | os.PathLike[str], *, title: str | None = None) -> str:
    """Write the error-by-layer plot of ``report`` to ``path`` (PNG). Returns the path."""
    data = render_png(report, title=title)
    p = os.fspath(path)
    with open(p, "wb") as fh:
        fh.write(data)
    return p


# --------------------------------------------------------------------------- HTML

ReportsArg = Union[ReportLike, Sequence[ReportLike], Mapping[str, ReportLike], Sequence[tuple[str, ReportLike]]]

# (header, kind): "num" columns sort numerically (largest first on the first click, except "#"
# and "call"), the others as text. "x allowed" is added for calibrated reports only.
COLUMN_KINDS: tuple[tuple[str, str], ...] = (
    ("#", "num"), ("layer", "text"), ("call", "num"), ("type", "text"), ("status", "text"),
    ("max abs", "num"), ("max rel", "num"), ("mismatched", "num"), ("rtol", "num"), ("atol", "num"),
    ("worst: golden / live", "text"), ("detail", "text"),
)
COLUMNS = tuple(c for c, _ in COLUMN_KINDS)
ALLOWED_COLUMN = ("x allowed", "num")
# A table longer than this opens filtered to its diverged rows (the unfiltered table is one click
# away): a 5,000-row table is slow to scroll through and the diverged rows are what is read.
BIG_TABLE = 500
FIRST_ID = "first-divergence"  # the page's first divergence (of the first diverged check): a stable URL


@functools.cache
def _asset(name: str) -> str:
    text = resources.files("activation_guard.report").joinpath("assets", name).read_text(encoding="utf-8")
    if "</" in text and name.endswith(".js"):  # "</script" would end the inline script early
        raise AssertionError(f"assets/{name} must not contain '</'")
    return text


def _normalize(reports: ReportsArg) -> list[tuple[str, ReportLike]]:
    if isinstance(reports, ReportLike):
        return [(reports.path, reports)]
    if isinstance(reports, Mapping):
        items: Iterable[Any] = reports.items()
    else:
        items = reports
    out = []
    for item in items:
        if isinstance(item, ReportLike):
            out.append((item.path, item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], ReportLike):
            out.append((str(item[0]), item[1]))
        else:
            raise TypeError("write_html needs a Report, a list of Reports, or (label, Report) pairs; "
                            f"got {type(item).__name__}")
    return out


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(v: float | int | None) -> str:
    """A sort key JavaScript's Number() reads back exactly ('' for no value)."""
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return repr(v)


def _td(text: str, cls: str = "", v: float | int | str | None = None, *, keyed: bool = False) -> str:
    c = f' class="{cls}"' if cls else ""
    d = f' data-v="{_e(v if isinstance(v, str) else _num(v))}"' if keyed else ""
    return f"<td{c}{d}>{_e(text)}</td>"


def _head(columns: Sequence[tuple[str, str]], *, plain: Sequence[str] = ()) -> str:
    cells = []
    for name, kind in columns:
        if name in plain:
            cells.append(f"<th>{_e(name)}</th>")
            continue
        first = "descending" if kind == "num" and name not in ("#", "call") else "ascending"
        cells.append(f'<th data-type="{kind}" data-first="{first}" aria-sort="none">'
                     f'<button type="button" title="sort by {_e(name)}">{_e(name)}</button></th>')
    return "<thead><tr>" + "".join(cells) + "</tr></thead>"


def _layer_rows(report: ReportLike, fd_id: str, calibrated: bool, heats: Mapping[int, str] | None = None
                ) -> list[str]:
    fd = report.first_divergence
    ordered = _live_layers(report) + [x for x in report.layers if x.position is None]
    n_live = report.live_count
    rows = []
    for x in ordered:
        name = x.name or "<root>"
        worst = ""
        if (x.golden_value is not None or x.live_value is not None) and (x.max_abs_diff or not x.ok):
            idx = "" if x.index is None else f"{tuple(x.index)}: "
            gv, lv = fmt_pair(x.golden_value, x.live_value)
            worst = f"{idx}{gv} / {lv}"
        status = x.status if x is not fd else f'<span class="badge">FIRST</span> {_e(x.status)}'
        cells = [
            _td("-" if x.position is None else str(report.number(x, n_live)), "num", x.position, keyed=True),
            f'<td class="name">{_e(name).replace(".", ".<wbr>")}{_phase_tag(x)}</td>',  # long names wrap at a dot
            _td(str(x.call), "num", x.call, keyed=True),
            _td(x.type_name if x.golden_type_name is None else f"{x.golden_type_name} -> {x.type_name}"),
            f'<td data-v="{_e(x.status)}">{status}</td>' if x is fd else _td(x.status),
            _td(fmt_diff(x.max_abs_diff), "num", x.max_abs_diff, keyed=True),
            _td(fmt_diff(x.max_rel_diff), "num", x.max_rel_diff, keyed=True),
            _td(f"{x.mismatched} / {x.numel}" if x.numel else "-", "num", x.mismatched if x.numel else None,
                keyed=True),
            _td("-" if x.rtol is None else f"{x.rtol:g}", "num", x.rtol, keyed=True),
            _td("-" if x.atol is None else f"{x.atol:g}", "num", x.atol, keyed=True),
            _td(worst, "num wrap"),
            _td(x.detail, "detail"),  # never the plain mismatch count: that is its own column
        ]
        if calibrated:
            em = x.error_multiple
            cells.append(_td("-" if em is None else f"{em:.3g}", "num", em, keyed=True))
        cls = "first" if x is fd else ("fail" if not x.ok else "")
        attrs = f' class="{cls}"' if cls else ""
        attrs += f' id="{fd_id}"' if x is fd else ""
        attrs += f' data-name="{_e(name)}" data-bad="{0 if x.ok else 1}"'
        if heats and id(x) in heats:  # a click shows its heatmap
            attrs += f' data-heat="{heats[id(x)]}" title="click: heatmap of this output"'
        elif heats and not x.ok and x.phase == "forward" and any(leaf.numel and not leaf.sampled for leaf in x.leaves):
            # pictures cost a pass over the output: say how to get this one rather than stay silent
            attrs += (f' title="no heatmap drawn for this call: name {_e(name or "(root)")} in the where option '
                      f'(where=[...] in compare, the marker or check()) to draw it"')
        rows.append(f"<tr{attrs}>{''.join(cells)}</tr>")
    return rows


def _phase_tag(x: LayerResult) -> str:
    """Gradient rows are marked in the name cell: which gradient the row is."""
    if x.phase == "param-grad":
        return ' <span class="phase">param grads</span>'
    if x.phase == "backward":
        return f' <span class="phase">grad {"out" if x.wrt == "output" else "in"}</span>'
    return ""


def _tools(noun: str, only_bad: bool) -> str:
    """Filter controls; hidden until the script runs (without it they would do nothing)."""
    checked = " checked" if only_bad else ""
    return (f'<div class="tools" hidden><input type="search" placeholder="filter {noun} by name (globs: * ?)" '
            f'aria-label="filter {noun} by name"><label><input type="checkbox" class="only-bad"{checked}> '
            f'diverged only</label><span class="count" aria-live="polite"></span></div>')


def _section(i: int, label: str, report: ReportLike, with_plot: bool, fd_id: str) -> list[str]:
    state = "ok" if report.ok else "bad"
    out = [f'<section class="report" id="report-{i}">', f"<h2>{_e(label)}</h2>",
           f'<p class="headline {state}"><b>{_e(report.headline())}</b></p>']
    fd = report.first_divergence
    if report.origin is not None:
        o = report.origin
        out.append(f'<p class="origin"><b>origin ({_e(o.kind)})</b>: {_e(o.name or "<root>")} '
                   f"({_e(o.type_name or '?')}) {_e(o.detail)}</p>")
    if fd is not None:
        out.append(f'<p><a href="#{fd_id}">jump to the first divergence in the table</a></p>')
    body = str(report).split("\n", 1)[1:]  # the text report below its headline, shown just above
    if body:
        out.append(f"<pre>{_e(body[0])}</pre>")
    if with_plot:
        try:
            png = render_png(report)
            b64 = base64.b64encode(png).decode("ascii")
            out.append(f'<img class="plot" alt="error by layer for {_e(label)}" src="data:image/png;base64,{b64}">')
        except PlotUnavailableError:
            out.append(f'<p class="note">(no plot: matplotlib is not installed; {_e(INSTALL_HINT)})</p>')
    heats: dict[int, str] = {}
    if with_plot and not report.ok and plot_available():
        figures, heats = _heat_figures(report, i)
        if figures:
            out += ['<div class="heats"><p class="note">where the first divergence differs; click a diverged row '
                    "marked &#9638; for its heatmap (the first two diverged calls and the layers the "
                    "<code>where</code> option names have one)</p>", *figures, "</div>"]
    calibrated = any(x.error_multiple is not None for x in report.layers)
    columns = COLUMN_KINDS + ((ALLOWED_COLUMN,) if calibrated else ())
    n = len(report.layers)
    box = ['<div class="table-box">', _tools("layers", only_bad=not report.ok and n > BIG_TABLE),
           f'<div class="scroll"><table class="ag layers" data-noun="layer calls">{_head(columns)}<tbody>',
           *_layer_rows(report, fd_id, calibrated, heats), "</tbody></table></div></div>"]
    if report.ok:  # a passing check's table is rarely read: fold it
        out += [f"<details><summary>{n} layer calls</summary>", *box, "</details>"]
    else:
        out += [f"<p>{n} layer calls; the first divergence is highlighted.</p>", *box]
    out.append("</section>")
    return out


def _fd_ids(items: list[tuple[str, ReportLike]]) -> list[str]:
    """Row anchors of each check's first divergence; the page's first one is ``first-divergence``."""
    ids, taken = [], False
    for i, (_, r) in enumerate(items):
        if r.first_divergence is not None and not taken:
            ids.append(FIRST_ID)
            taken = True
        else:
            ids.append(f"report-{i}-first")
    return ids


# checks that have no report (``Unreported.status``) and fail the run
FAILING_STATUSES = ("diverged", "missing", "error")


class Unreported(NamedTuple):
    """A check the page lists without a report: its golden was missing, it failed before
    comparing (an unreadable golden, a bad option), or it wrote its golden."""

    label: str
    status: str  # missing, error, written, ... (the plugin's CheckRecord.status)
    message: str = ""


def _banner(items: list[tuple[str, ReportLike]], fd_ids: list[str], others: Sequence[Unreported] = ()) -> list[str]:
    nbad = sum(1 for _, r in items if not r.ok)
    failing = Counter(o.status for o in others if o.status in FAILING_STATUSES)
    state = "ok" if nbad == 0 and not failing else "bad"
    if len(items) == 1 and not others:
        r = items[0][1]
        # the text report's totals: live layer calls, then gradients apart (not one count of both)
        summary = f"{'OK' if r.ok else 'DIVERGED'}: {r.totals_text()}"
    else:
        rest = Counter(o.status for o in others if o.status not in FAILING_STATUSES)
        parts = [f"{len(items) - nbad} passed", f"{nbad + failing.pop('diverged', 0)} diverged"]
        parts += [f"{n} {k}" if k != "error" else f"{n} error{'s' if n != 1 else ''}" for k, n in failing.items()]
        parts += [f"{n} {k}" for k, n in rest.items()]
        summary = f"{'FAILED' if state == 'bad' else 'OK'}: {len(items) + len(others)} checks: {', '.join(parts)}"
    out = [f'<div class="banner {state}">', f'<p class="state">{_e(summary)}</p>']
    for i, (label, r) in enumerate(items):
        fd = r.first_divergence
        if fd is not None:
            where = f" in {_e(label)}" if len(items) > 1 else ""
            out.append(f'<p>First divergence: <a href="#{fd_ids[i]}">{_e(fd.label)}</a> '
                       f"({_e(why(fd))}){where}</p>")
            break
    out.append("</div>")
    return out


def _checks_table(items: list[tuple[str, ReportLike]], fd_ids: list[str],
                  others: Sequence[Unreported] = ()) -> list[str]:
    head = _head((("check", "text"), ("result", "text"), ("first divergence", "text")))
    out = ['<div class="table-box">', _tools("checks", only_bad=len(items) + len(others) > BIG_TABLE),
           f'<div class="scroll"><table class="ag checks" data-noun="checks">{head}<tbody>']
    for o in others:  # first: what failed without a report is what a reader must not miss
        bad = o.status in FAILING_STATUSES
        out.append(f'<tr data-name="{_e(o.label)}" data-bad="{int(bad)}"><td>{_e(o.label)}</td>'
                   f'<td class="{"bad" if bad else "ok"}">{_e(o.status.upper())}</td><td>{_e(o.message or "-")}</td>'
                   "</tr>")
    for i, (label, r) in enumerate(items):
        fd = r.first_divergence
        where = "-" if fd is None else f'<a href="#{fd_ids[i]}">{_e(fd.label)}</a> ({_e(why(fd))})'
        cls = "ok" if r.ok else "bad"
        out.append(f'<tr data-name="{_e(label)}" data-bad="{0 if r.ok else 1}">'
                   f'<td><a href="#report-{i}">{_e(label)}</a></td>'
                   f'<td class="{cls}">{"OK" if r.ok else "DIVERGED"}</td><td>{where}</td></tr>')
    out.append("</tbody></table></div></div>")
    return out


def html_page(reports: ReportsArg, *, title: str = "activation_guard report", plots: str = "auto",
              unreported: Sequence[Unreported] = ()) -> str:
    """One self-contained HTML page: inline CSS and script, plots as base64 PNG, nothing loaded
    from anywhere else, so it can be archived as a CI artefact and opened offline.

    Every row is in the HTML (readable without the script); the script makes the tables sortable
    (click a header) and filterable (layer name or glob, "diverged only"), and opens and unfilters
    whatever an anchor link points at. ``#first-divergence`` is the first diverged check's first
    divergence, ``#report-N`` the N-th check. ``plots``: ``"auto"`` plots a single report, or the
    failing ones among several (a plot costs a fraction of a second); ``"all"``; ``"none"``.
    ``unreported``: checks with no report (a missing golden, an error before comparing), listed
    first in the checks table and counted in the banner, which is red when any of them failed.
    """
    if plots not in ("auto", "all", "none"):
        raise ValueError(f"plots must be 'auto', 'all' or 'none', got {plots!r}")
    items = _normalize(reports)
    fd_ids = _fd_ids(items)
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_e(title)}</title>", f"<style>{_asset('report.css')}</style>", "</head>", "<body>",
           f"<h1>{_e(title)}</h1>", *_banner(items, fd_ids, unreported)]
    if len(items) + len(unreported) > 1:
        out += _checks_table(items, fd_ids, unreported)
    for i, (label, r) in enumerate(items):
        with_plot = plots == "all" or (plots == "auto" and (len(items) == 1 or not r.ok))
        out += _section(i, label, r, with_plot, fd_ids[i])
    out += [f"<script>{_asset('report.js')}</script>", "</body>", "</html>", ""]
    return "\n".join(out)


def write_html(report_or_reports: ReportsArg, path: str | os.PathLike[str], *, title: str = "activation_guard report",
               plots: str = "auto") -> str:
    """Write :func:`html_page` to ``path`` (UTF-8). Accepts one Report, a list of Reports, a
    mapping label -> Report, or (label, Report) pairs (the pytest plugin passes test ids)."""
    page = html_page(report_or_reports, title=title, plots=plots)
    p = os.fspath(path)
    with open(p, "w", encoding="utf-8") as fh:
        fh.write(page)
    return p

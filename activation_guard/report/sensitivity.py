"""A sensitivity report (:func:`activation_guard.sensitivity`): the result, and its text, JSON and HTML.

:class:`SensitivityReport` is the contract: ``rows`` (one per module call, ranked by own error:
``name``, ``call``, ``sqnr_db``, ``own_sqnr_db``, ``error_share``), ``keep_in_float`` (module
names) and ``keep_in_float_globs`` (the same as globs for a quantizer's filter), the modules that
were not compressed, and, when a ``quantize`` callable was given, the closed-loop check of the
advice (:class:`~activation_guard.quantization.analysis.ClosedLoop`). The HTML page follows
:mod:`.visual`: one self-contained file, a sortable table, and an SQNR-by-layer plot (accumulated
and own SQNR per call in execution order, advised modules marked).
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .._core.metrics import METRICS, Metric, fmt_value
from ..options.selection import display_name, match_any
from ..quantization.analysis import ClosedLoop, SensitivityRow
from .visual import INSTALL_HINT, PlotUnavailableError, _asset, _e, _head, _matplotlib, _td, _tools

SHOWN = 25  # rows the text report lists (the JSON and HTML have all)


@dataclass
class SensitivityReport:
    """Per-layer sensitivity of a compressed model against its float golden (module docstring)."""

    path: str
    rows: list[SensitivityRow]
    keep_in_float: list[str]
    keep_in_float_globs: list[str] = field(default_factory=list)
    metric: Metric = "sqnr"
    explain: float = 0.9
    output_sqnr_db: float | None = None  # the model's output against the golden's
    not_quantized: list[str] = field(default_factory=list)  # modules with float parameters left as they were
    quantized: dict[str, str] = field(default_factory=dict)  # compressed module -> how (a tensor subclass, a dtype)
    closed_loop: ClosedLoop | None = None
    notes: list[str] = field(default_factory=list)

    def row(self, name: str, call: int = 0) -> SensitivityRow:
        """The row of a module call (KeyError naming it when there is none)."""
        for r in self.rows:
            if (r.name, r.call) == (name, call):
                return r
        raise KeyError(f"no sensitivity row for module {display_name(name)!r} call {call}")

    def filter_fn(self) -> Callable[[Any, str], bool]:
        """A torchao ``filter_fn`` (``quantize_(model, config, filter_fn=...)``): quantize the
        ``torch.nn.Linear`` modules that are not advised to stay in float."""
        import torch

        globs = list(self.keep_in_float_globs or self.keep_in_float)
        return lambda module, fqn: isinstance(module, torch.nn.Linear) and not match_any(fqn, globs)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "golden": self.path, "metric": self.metric, "explain": self.explain,
            "output_sqnr_db": _json(self.output_sqnr_db), "keep_in_float": list(self.keep_in_float),
            "keep_in_float_globs": list(self.keep_in_float_globs), "not_quantized": list(self.not_quantized),
            "quantized": dict(self.quantized), "notes": list(self.notes),
            "closed_loop": None if self.closed_loop is None else self.closed_loop.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SensitivityReport:
        cl = d.get("closed_loop")
        out = d.get("output_sqnr_db")
        return cls(path=str(d.get("golden", "")), rows=[SensitivityRow.from_dict(x) for x in d.get("rows") or []],
                   keep_in_float=list(d.get("keep_in_float") or []),
                   keep_in_float_globs=list(d.get("keep_in_float_globs") or []),
                   metric=d["metric"] if d.get("metric") in METRICS else "sqnr",
                   explain=float(d.get("explain", 0.9)), output_sqnr_db=None if out is None else float(out),
                   not_quantized=list(d.get("not_quantized") or []), quantized=dict(d.get("quantized") or {}),
                   closed_loop=ClosedLoop.from_dict(cl) if isinstance(cl, dict) else None,
                   notes=list(d.get("notes") or []))

    # ------------------------------------------------------------------ text
    def __str__(self) -> str:
        m = self.metric
        lines = [f"activation_guard sensitivity: {len(self.rows)} module calls against {self.path}; output SQNR "
                 f"{fmt_value('sqnr', self.output_sqnr_db)}"]
        if self.keep_in_float:
            lines.append(f"  keep in float : {', '.join(self.keep_in_float)} (their own errors explain "
                         f"{100 * self.advised_share():.0f}% of the summed own errors; globs: "
                         f"{self.keep_in_float_globs})")
        else:
            lines.append("  keep in float : none advised (no compressed module loses signal on its own)")
        cl = self.closed_loop
        if cl is not None:
            lines.append(f"  closed loop   : keeping k={cl.k} in float gains {cl.advised_gain_db:+.1f} dB end to end "
                         f"(advised), {cl.random_gain_db:+.1f} dB (k random, median of {len(cl.random_draws)}), "
                         f"{cl.last_gain_db:+.1f} dB (the last k); baseline {fmt_value('sqnr', cl.baseline_sqnr_db)}"
                         + ("" if cl.worth_it else "; the advice is NOT worth more than those"))
        if self.not_quantized:
            shown = ", ".join(display_name(n) for n in self.not_quantized[:8])
            more = f" and {len(self.not_quantized) - 8} more" if len(self.not_quantized) > 8 else ""
            lines.append(f"  not quantized : {len(self.not_quantized)} module(s) with float parameters left as they "
                         f"were: {shown}{more} (measured, never advised)")
        lines += [f"  note: {n}" for n in self.notes]
        width = min(60, max([12, *(len(display_name(r.name)) for r in self.rows[:SHOWN])]))
        extra = m != "sqnr"
        head = (f"    {'rank':>4}  {'module':<{width}} {'call':>4}  {'own SQNR':>10} {'SQNR':>10} {'share':>7}"
                + (f" {'own ' + m:>12} {m:>12}" if extra else "") + "  quantized")
        lines += ["", "  ranked by own error (re-run on the golden's float inputs):", head]
        for i, r in enumerate(self.rows[:SHOWN], start=1):
            mark = "*" if r.name in self.keep_in_float else " "
            q = {True: "yes", False: "no", None: "?"}[r.quantized]
            row = (f"  {mark} {i:>4}  {display_name(r.name)[-width:]:<{width}} {r.call:>4}  "
                   f"{fmt_value('sqnr', r.own_sqnr_db):>10} {fmt_value('sqnr', r.sqnr_db):>10} "
                   f"{100 * r.error_share:>6.1f}%")
            if extra:
                row += f" {fmt_value(m, r.own_value):>12} {fmt_value(m, r.value):>12}"
            lines.append(row + f"  {q}")
        if len(self.rows) > SHOWN:
            lines.append(f"    ... {len(self.rows) - SHOWN} more (JSON and HTML reports list every call)")
        lines.append("  (* advised to keep in float; share: own noise ratio over the sum of all calls' own noise "
                     "ratios)")
        return "\n".join(lines)

    def advised_share(self) -> float:
        keep = set(self.keep_in_float)
        return sum(r.error_share for r in self.rows if r.name in keep)

    # ------------------------------------------------------------------ HTML
    def html(self, *, title: str = "activation_guard sensitivity", plot: bool = True) -> str:
        """One self-contained page: the text summary, the SQNR-by-layer plot, a sortable table."""
        out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
               f"<title>{_e(title)}</title>", f"<style>{_asset('report.css')}</style>", "</head>", "<body>",
               f"<h1>{_e(title)}</h1>", f"<pre>{_e(str(self).split(chr(10) + chr(10))[0])}</pre>"]
        if plot:
            try:
                b64 = base64.b64encode(self.png()).decode("ascii")
                out.append(f'<img class="plot" alt="SQNR by layer" src="data:image/png;base64,{b64}">')
            except PlotUnavailableError:
                out.append(f'<p class="note">(no plot: matplotlib is not installed; {_e(INSTALL_HINT)})</p>')
        cols = [("rank", "num"), ("module", "text"), ("call", "num"), ("type", "text"), ("own SQNR (dB)", "num"),
                ("SQNR (dB)", "num"), ("share", "num"), ("quantized", "text"), ("keep in float", "text")]
        if self.metric != "sqnr":
            cols += [(f"own {self.metric}", "num"), (self.metric, "num")]
        keep = set(self.keep_in_float)
        body = []
        for i, r in enumerate(self.rows, start=1):
            cells = [_td(str(i), "num", i, keyed=True), _td(display_name(r.name)), _td(str(r.call), "num", r.call,
                                                                                      keyed=True),
                     _td(r.type_name), _td(fmt_value("sqnr", r.own_sqnr_db), "num", r.own_sqnr_db, keyed=True),
                     _td(fmt_value("sqnr", r.sqnr_db), "num", r.sqnr_db, keyed=True),
                     _td(f"{100 * r.error_share:.1f}%", "num", r.error_share, keyed=True),
                     _td({True: "yes", False: "no", None: "?"}[r.quantized]), _td("yes" if r.name in keep else "")]
            if self.metric != "sqnr":
                cells += [_td(fmt_value(self.metric, r.own_value), "num", r.own_value, keyed=True),
                          _td(fmt_value(self.metric, r.value), "num", r.value, keyed=True)]
            cls = ' class="bad"' if r.name in keep else ""
            body.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
        out += ['<div class="table-box">', _tools("modules", only_bad=False),
                f'<div class="scroll"><table class="ag sensitivity" data-noun="module calls">{_head(cols)}<tbody>',
                *body, "</tbody></table></div></div>", f"<script>{_asset('report.js')}</script>", "</body>",
                "</html>", ""]
        return "\n".join(out)

    def write_html(self, path: str | os.PathLike[str], **kw: Any) -> str:
        p = os.fspath(path)
        with open(p, "w", encoding="utf-8") as fh:
            fh.write(self.html(**kw))
        return p

    def png(self, *, dpi: int = 110) -> bytes:
        """SQNR by layer call in execution order: accumulated (its output) and own (re-run on the
        golden's inputs), advised modules marked (matplotlib: the ``plot`` extra)."""
        figure_cls, canvas_cls = _matplotlib()
        rows = sorted((r for r in self.rows if r.position is not None), key=lambda r: r.position or 0)
        xs = list(range(len(rows)))
        fig = figure_cls(figsize=(max(6.0, min(18.0, 0.12 * len(rows) + 4)), 4.0))
        canvas_cls(fig)
        ax = fig.add_subplot(1, 1, 1)
        acc = [_plottable(r.sqnr_db) for r in rows]
        own = [_plottable(r.own_sqnr_db) for r in rows]
        ax.plot(xs, acc, "-", color="#1f77b4", label="SQNR (accumulated)", linewidth=1.2)
        ax.plot(xs, own, "o", color="#ff7f0e", label="own SQNR (re-run on golden inputs)", markersize=3)
        keep = set(self.keep_in_float)
        kx = [x for x, r in zip(xs, rows) if r.name in keep]
        ax.plot(kx, [own[x] for x in kx], "x", color="#d62728", markersize=9, label="keep in float (advised)")
        for x in kx:
            ax.annotate(display_name(rows[x].name)[-40:], (x, own[x]), fontsize=7, rotation=20,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("module call, execution order")
        ax.set_ylabel("SQNR (dB)")
        ax.set_title(f"SQNR by layer ({os.path.basename(self.path)})", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()


def _plottable(v: float | None) -> float:
    """Infinite SQNR (no error) is drawn at no height rather than off the axis."""
    return math.nan if v is None or not math.isfinite(v) else v


def _json(v: float | None) -> Any:
    return v if v is None or math.isfinite(v) else str(v)

"""The comparison report: what failed first, by how much, under which tolerances.

The text leads with one line that answers "where and why", then the numbers a person needs to
act (mismatch count, worst element with golden and live values, tolerances in force), then a
little context and totals. A passing report is one line.

Over the ~400 lines we aim for: the text report, its exact JSON round trip and the notebook view
read the same fields in one class; how single values read is in :mod:`.textfmt`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .._core.metrics import METRICS, Metric, fmt_value
from ..capture.env import recorded_device
from ..options.selection import display_name
from ..results import (
    STATUS_ORDER,
    IdenticalCall,
    LayerResult,
    LeafResult,
    Origin,
    Where,
    from_json_number,
    json_number,
)
from .textfmt import (  # re-exported: the HTML page and the Markdown summary read values the same way
    GRAD_WHY,
    WHY,
    abs_diff,
    estimate_lines,
    estimate_ratio,
    fmt,
    fmt_diff,
    fmt_pair,
    gradient_text,
    row_name,
    safe_line,
    sketch_blind,
    why,
)

__all__ = ["GRAD_WHY", "WHY", "Report", "abs_diff", "fmt", "fmt_diff", "fmt_pair", "gradient_text", "row_name", "why"]

def where_lines(w: Where) -> list[str]:
    """The shape of a divergence, as the text report prints it under the worst element."""
    lines = w.lines()
    return [f"  where         : {lines[0]}", *(f"                  {x}" for x in lines[1:])]


def sampled_where(leaf: LeafResult) -> list[str]:
    """What a fingerprinted output's samples prove about where it differs: only them."""
    if not leaf.sampled:
        return ["  where         : not located: a fingerprint holds no values to compare element by element"]
    at = "" if not leaf.mismatched or leaf.index is None else f", one at index {tuple(leaf.index)}"
    return [f"  where         : not located: checked by fingerprint; of its {leaf.sampled} exact samples, "
            f"{leaf.mismatched} lie outside tolerance{at}; no per-dimension pattern is claimed beyond them"]


def _where_summary(fd: LayerResult) -> dict[str, Any] | None:
    """The first divergence's shape for CI tools (its heatmap grid stays on the leaf)."""
    leaf = next((x for x in fd.leaves if x.path == fd.path and x.where is not None), None)
    if leaf is None or leaf.where is None:
        return None
    return {k: v for k, v in leaf.where.to_dict().items() if k != "heat"}


CONTEXT_BEFORE = 3
CONTEXT_AFTER = 4


NOT_COMPARED = "not compared"  # notes holding it name values a pass did not cover: shown with the pass
# notes that say what a pass does not cover (values not compared, a selection pattern that matched
# nothing, a golden holding only some layers): printed with the pass's one line, not only on failure
PASS_NOTE_MARKERS = (NOT_COMPARED, "matched no layer", "holds only those layers")


@dataclass
class Report:
    """Result of :func:`activation_guard.compare`.

    ``layers`` lists live layer calls in execution order, then golden-only (``missing``) calls.
    ``first_divergence`` is the earliest divergence in execution order; a missing call counts at
    the point where the live run passed its place in the golden's order.
    """

    path: str
    layers: list[LayerResult]
    golden_meta: dict[str, Any] = field(default_factory=dict)
    live_device: str = "cpu"
    input_changes: list[str] = field(default_factory=list)
    env_changes: list[str] = field(default_factory=list)
    mode_changes: list[str] = field(default_factory=list)  # train/eval mode differs from the golden's
    stopped_early: bool = False
    mode: str = "strict"
    notes: list[str] = field(default_factory=list)
    rank: int | None = None  # distributed: this process's rank in a multi-rank run
    world_size: int | None = None
    origin: Origin | None = None  # where the difference was made (replay), None when OK or not replayed
    replay: str = "off"
    metric: Metric | None = None  # the error metric each float output was measured by (metric=, min_sqnr_db)
    output: Any = field(default=None, repr=False, compare=False)
    _order: dict[int, tuple[float, int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return all(layer.ok for layer in self.layers)

    @property
    def live_count(self) -> int:
        """Live forward layer calls (gradient rows are counted by :attr:`grad_count`)."""
        return sum(1 for layer in self.layers if layer.position is not None and layer.phase == "forward")

    def number(self, layer: LayerResult, live_count: int | None = None) -> int | None:
        """A live row's 1-based number: in execution order, or for a gradient in backward order
        (gradient rows follow the forward's). ``live_count``: :attr:`live_count`, when a caller
        numbers many rows (it counts every row)."""
        if layer.position is None:
            return None
        if layer.phase == "forward":
            return layer.position + 1
        return layer.position + 1 - (self.live_count if live_count is None else live_count)

    @property
    def grad_count(self) -> int:
        """Live gradient rows (calls' output/input gradients and modules' parameter gradients)."""
        return sum(1 for layer in self.layers if layer.position is not None and layer.phase != "forward")

    def _key(self, i: int, layer: LayerResult) -> tuple[float, int]:
        if i in self._order:
            return self._order[i]
        return (float(layer.position) if layer.position is not None else math.inf, 0)

    def execution_position(self, layer: LayerResult) -> float:
        """Where ``layer`` (one of :attr:`layers`) sits in live execution order: its position, or
        for a missing call half a step before the live call that passed its place (inf: at the end).
        Comparable across the ranks of one SPMD program, which run the same modules in order."""
        for i, x in enumerate(self.layers):
            if x is layer:
                return self._key(i, x)[0]
        raise ValueError(f"layer {layer.label} is not in this report")

    @property
    def divergences(self) -> list[LayerResult]:
        bad = [(self._key(i, layer), layer) for i, layer in enumerate(self.layers) if not layer.ok]
        bad.sort(key=lambda kv: kv[0])
        return [layer for _, layer in bad]

    @property
    def first_divergence(self) -> LayerResult | None:
        d = self.divergences
        return d[0] if d else None

    def counts(self) -> dict[str, int]:
        c = Counter(layer.status for layer in self.layers)
        return {s: c.get(s, 0) for s in STATUS_ORDER if c.get(s, 0)}

    def type_only(self) -> Counter[str]:
        """Outputs whose values were not compared (opaque objects: caches, generators), by type."""
        return Counter(leaf.type_name or "?" for layer in self._judged_leafwise() for leaf in layer.leaves
                       if leaf.type_only)

    def _judged_leafwise(self) -> list[LayerResult]:
        """Rows whose leaves may say how they were judged: all but the unbuilt IdenticalCalls,
        whose one output was compared byte for byte (never by type only, never by fingerprint),
        and whose leaves would be built by reading them. (A built one is read: a user may have
        given it other leaves.)"""
        return [layer for layer in self.layers if not (isinstance(layer, IdenticalCall) and not layer.built)]

    def type_only_text(self) -> str | None:
        """"3 outputs compared by type only: DynamicCache x2, Foo", or None: an OK always says
        what it did not check."""
        c = self.type_only()
        n = sum(c.values())
        if not n:
            return None
        shown = ", ".join(f"{t} x{k}" if k > 1 else t for t, k in c.most_common())
        return f"{n} output{'s' if n != 1 else ''} compared by type only: {shown}"

    def class_changes(self) -> list[LayerResult]:
        """Layer calls whose module class differs from the golden's (a ``NewGELUActivation``
        replaced by a custom ``FusedGelu``): said on a pass too, since matching values do not
        show that the code behind them changed."""
        seen: set[str] = set()
        out = []
        for layer in self.layers:
            if layer.golden_type_name is not None and layer.name not in seen:
                seen.add(layer.name)
                out.append(layer)
        return out

    def class_change_text(self) -> str | None:
        """"module class changed at 1 layer: 'h.0.mlp.act' NewGELUActivation -> FusedGelu", or None."""
        changed = self.class_changes()
        if not changed:
            return None
        shown = ", ".join(f"{display_name(x.name)!r} {x.golden_type_name} -> {x.type_name}" for x in changed[:5])
        more = f", and {len(changed) - 5} more" if len(changed) > 5 else ""
        return f"module class changed at {len(changed)} layer{'s' if len(changed) != 1 else ''}: {shown}{more}"

    def estimated(self) -> list[LeafResult]:
        """Outputs judged against fingerprints (their numbers are estimates)."""
        return [leaf for layer in self._judged_leafwise() for leaf in layer.leaves if leaf.estimate]

    def fingerprint_text(self) -> str | None:
        """"12 outputs checked by fingerprint (estimates)", or None: an OK says when a pass is a
        fingerprint's, not an element-by-element comparison."""
        est = self.estimated()
        if not est:
            return None
        fa = max((leaf.false_alarm for leaf in est if leaf.false_alarm is not None), default=None)
        bound = f", false alarm <= {fa:.1g} each" if fa is not None else ""
        return f"{len(est)} output{'s' if len(est) != 1 else ''} checked by fingerprint: estimates{bound}"

    def to_dict(self) -> dict[str, Any]:
        fd = self.first_divergence
        return {
            "ok": self.ok,
            "golden": self.path,
            "mode": self.mode,
            "live_device": self.live_device,
            "golden_device": recorded_device(self.golden_meta),
            "first_divergence": None if fd is None else {
                "name": fd.name, "call": fd.call, "status": fd.status, "position": fd.position,
                **self._printed_number(fd),
                **({} if fd.phase == "forward" else {"phase": fd.phase, "wrt": fd.wrt})},  # gradients
            "where": None if fd is None else _where_summary(fd),  # the first divergence's shape, for CI tools
            "counts": self.counts(),
            "stopped_early": self.stopped_early,
            "input_changes": list(self.input_changes),
            "env_changes": list(self.env_changes),
            "mode_changes": list(self.mode_changes),
            "notes": list(self.notes),
            "rank": self.rank,
            "world_size": self.world_size,
            "golden_meta": self.golden_meta,
            "origin": None if self.origin is None else self.origin.to_dict(),
            "replay": self.replay,
            "metric": self.metric,
            "type_only": dict(self.type_only()),
            "layers": [layer.to_dict() for layer in self.layers],
            # where golden-only (missing) calls sit in execution order: layer index -> [at, golden pos]
            "missing_order": {str(i): [json_number(a), b] for i, (a, b) in self._order.items()},
        }

    def _printed_number(self, fd: LayerResult) -> dict[str, Any]:
        """The first divergence's ``#N`` as the text prints it, 1-based (``position`` is the
        0-based index in the live execution order, as every layer row has it), and the order it
        counts in: a missing call is numbered in the golden's order, a gradient in backward order."""
        order = "execution order" if fd.phase == "forward" else "backward order"
        if fd.position is None:
            return {"number": (fd.golden_position or 0) + 1, "number_in": f"the golden's {order}"}
        return {"number": self.number(fd), "number_in": order}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """Rebuild a report from :meth:`to_dict` output, e.g. to render the HTML page of a
        JSON report written by another process (pytest-xdist workers)."""
        order = {int(i): (float(from_json_number(v[0])), int(v[1])) for i, v in (d.get("missing_order") or {}).items()}
        meta = d.get("golden_meta")
        if not isinstance(meta, dict):  # a report written before golden_meta was kept whole
            gdev = d.get("golden_device")
            meta = {"device": {"device": gdev}} if gdev else {}
        return cls(
            path=str(d.get("golden", "")),
            layers=[LayerResult.from_dict(x) for x in d.get("layers") or []],
            golden_meta=meta,
            live_device=str(d.get("live_device", "cpu")),
            input_changes=list(d.get("input_changes") or []),
            env_changes=list(d.get("env_changes") or []),
            mode_changes=list(d.get("mode_changes") or []),
            origin=Origin.from_dict(d["origin"]) if isinstance(d.get("origin"), dict) else None,
            replay=str(d.get("replay", "off")),
            metric=d["metric"] if d.get("metric") in METRICS else None,
            stopped_early=bool(d.get("stopped_early")),
            mode=str(d.get("mode", "strict")),
            notes=list(d.get("notes") or []),
            rank=d.get("rank") if isinstance(d.get("rank"), int) else None,
            world_size=d.get("world_size") if isinstance(d.get("world_size"), int) else None,
            _order=order,
        )

    def _repr_html_(self) -> str:
        """Jupyter's view of a report: the HTML report's page (headline, text report, the layer
        table with the first divergence highlighted, sortable and filterable) without writing a
        file. The page is self-contained (its own CSS and script), so it is shown in an iframe,
        where neither touches the notebook's; the headline stands above it, for a viewer that
        drops iframes."""
        import html as htmlmod

        from .visual import html_page

        page = html_page(self, title=self.path, plots="none")
        rows = len(self.layers)
        height = min(900, 420 + 28 * min(rows, 16))
        state = "#17692b" if self.ok else "#b3261e"
        return (f'<div class="activation-guard-report"><p style="color:{state};font-weight:600;margin:0 0 6px">'
                f"{htmlmod.escape(safe_line(self.headline()))}</p>"
                f'<iframe srcdoc="{htmlmod.escape(page, quote=True)}" title="activation_guard report" '
                f'style="width:100%;height:{height}px;border:1px solid #d0d7de;border-radius:6px"></iframe></div>')

    # ------------------------------------------------------------------ text
    def headline(self) -> str:
        text = self._headline()
        if self.rank is not None and self.world_size is not None:  # name the rank
            text = text.replace("activation_guard: ", f"activation_guard: rank {self.rank} of {self.world_size}: ", 1)
        return text

    def _headline(self) -> str:
        fd = self.first_divergence
        n = self.live_count
        ng = self.grad_count
        if fd is None:
            exact = [layer.max_abs_diff for layer in self.layers if layer.max_abs_diff is not None]
            worst = max(exact, default=0.0)
            mults = [layer.error_multiple for layer in self.layers if layer.error_multiple is not None]
            tail = "" if self.type_only_text() is None else f"; {self.type_only_text()}"
            fp = self.fingerprint_text()
            largest = f"largest abs diff {fmt_diff(worst)}"
            if fp and not exact:  # fingerprints only: no difference was measured, never "largest abs diff 0"
                largest = fp
            elif fp:
                tail = f"; {fp}{tail}"
            what = f"{n} layer calls" + (f" and {ng} gradients" if ng else "")  # gradients
            if mults:  # calibrated mode: how close the worst layer came to its noise allowance
                return (f"activation_guard: OK, {what} match {self.path} ({largest}, "
                        f"largest error {max(mults):.3g}x the calibrated allowance){tail}")
            if self.input_changes:
                tail += "; NOTE inputs differ from the recording"
            return f"activation_guard: OK, {what} match {self.path} ({largest}){tail}"
        if fd.phase != "forward":  # gradients: the forward matched
            call = "" if fd.phase == "param-grad" else f" call {fd.call}"
            head = (f"activation_guard: first divergence in the backward pass at layer {display_name(fd.name)!r} "
                    f"({fd.type_name or '?'}){call}: {gradient_text(fd)}")
            fwd_ok = all(layer.ok for layer in self.layers if layer.phase == "forward")
            tail = f"; the forward matches ({n} layer calls)" if fwd_ok else ""
            if fd.position is None:
                return f"{head}, #{(fd.golden_position or 0) + 1} in the golden's backward order: {why(fd)}{tail}"
            return f"{head}, #{self.number(fd)} of {ng} in backward order: {why(fd)}{tail}"
        cls = fd.type_name or "?"
        if fd.golden_type_name is not None:  # the module's class changed: what the golden ran, then what ran now
            cls = f"{fd.golden_type_name} -> {cls}"
        head = f"activation_guard: first divergence at layer {display_name(fd.name)!r} ({cls}) call {fd.call}"
        if fd.position is None:
            return (f"{head}, #{(fd.golden_position or 0) + 1} in the golden's execution order: "
                    f"{WHY.get(fd.status, fd.status)} in the live run")
        return f"{head}, #{self.number(fd)} of {n} in execution order: {WHY.get(fd.status, fd.status)}"

    def __str__(self) -> str:
        fd = self.first_divergence
        if fd is None:  # a pass is one line; environment notes matter only when explaining a failure
            # ... but what the pass does not cover is said with it (gradients the golden has, not compared)
            classes = self.class_change_text()
            return "\n".join(safe_line(x) for x in [self.headline(), *(f"  note: {m}" for m in self.notes
                                                                         if any(k in m for k in PASS_NOTE_MARKERS)),
                                                     *([] if classes is None else [f"  note: {classes}"])])
        lines = [self.headline()]
        lines += self._origin_lines(fd)
        blind = sketch_blind(fd)
        if blind is not None:  # right under the headline: it changes what the rows after it mean
            lines.append(f"  NOTE {blind}")
        lines += [f"  NOTE {m}" for m in self.mode_changes]
        if self.input_changes:
            lines.append("  NOTE inputs differ from the recording, so every layer may differ for that reason:")
            lines += [f"    - {m}" for m in self.input_changes[:8]]
        if self.env_changes:
            lines.append("  NOTE environment differs from the recording:")
            lines += [f"    - {m}" for m in self.env_changes[:12]]
        lines += [f"  note: {m}" for m in self.notes]
        if self.type_only_text():
            lines.append(f"  note: {self.type_only_text()}")
        if self.class_change_text():
            lines.append(f"  note: {self.class_change_text()}")
        meta = self.golden_meta
        dev = recorded_device(meta) or "?"
        tv = meta.get("versions", {}).get("torch", "?") if isinstance(meta.get("versions"), dict) else "?"
        lines.append(f"  golden        : {self.path} (recorded on {dev}, torch {tv}; live run on {self.live_device})")
        if fd is None:
            return "\n".join(map(safe_line, lines))
        lines += self._detail(fd)
        lines += self._requested_where(fd)
        lines += self._context(fd)
        lines += ["", self._totals()]
        if self.stopped_early:
            lines.append("  (stopped at the first divergence: fail_fast)")
        return "\n".join(map(safe_line, lines))

    def _origin_lines(self, fd: LayerResult) -> list[str]:
        """Where the difference was made, first: it is what a person acts on."""
        o = self.origin
        if o is None:
            return []
        who = f"{display_name(o.name)!r} ({o.type_name or '?'})" + (f" call {o.call}" if o.call else "")
        if fd.phase != "forward":  # gradients: not a replay
            return [f"  origin        : {who} {o.detail}"]
        if (o.name, o.call) == (fd.name, fd.call) and (o.kind == "layer" or (
                o.kind == "unknown" and o.detail.startswith(("re-run", "not replayed")))):  # its own replay
            return [f"  replayed      : {o.detail}"]
        return [f"  origin        : {who} {o.detail}"]

    def _detail(self, fd: LayerResult) -> list[str]:
        out = []
        if fd.golden_name is not None and fd.golden_name != fd.name:
            out.append(f"  golden layer  : {fd.golden_name!r} (renamed)")
        if fd.phase != "forward":  # gradients
            out.append(f"  gradient      : {gradient_text(fd).replace('gradient ', '', 1)}")
        elif fd.path is not None:
            out.append(f"  output path   : {fd.path or '(the output itself)'}")
        if fd.detail:
            out.append(f"  what          : {fd.detail}")
        focus = next((leaf for leaf in fd.leaves if leaf.path == fd.path and leaf.status == fd.status), None)
        # a call of several outputs: the numbers shown are the named output's own (the layer's
        # aggregates mixed outputs: 13 mismatched of 24 under a path holding 12)
        src: LayerResult | LeafResult = focus if focus is not None and len(fd.leaves) > 1 else fd
        if focus is not None and focus.estimate:
            out += estimate_lines(focus)
            out += sampled_where(focus)
        elif not (focus is not None and focus.dtype is None and not focus.numel) and (
                fd.status in ("diverged", "nonfinite", "match") or src.mismatched):
            # (a string, dtype, enum or bytes value that changed has no numbers: its "what" line says it)
            pct = 100.0 * src.mismatched / src.numel if src.numel else 0.0
            out.append(f"  mismatched    : {src.mismatched} / {src.numel} elements ({pct:.3g}%)")
            if src.nonfinite_new:
                out.append(f"  new NaN/Inf   : {src.nonfinite_new} values that are finite in the golden")
            idx = "" if src.index is None else f" at index {tuple(src.index)}"
            gv, lv = fmt_pair(src.golden_value, src.live_value)
            at = abs_diff(src.golden_value, src.live_value)
            if (at is None or src.max_abs_diff is None or at == src.max_abs_diff
                    or math.isclose(at, src.max_abs_diff, rel_tol=1e-5)):
                out.append(f"  max abs diff  : {fmt_diff(src.max_abs_diff)}{idx}: golden {gv}, live {lv}")
            else:  # the largest difference is elsewhere (a passing element under rtol)
                out.append(f"  max abs diff  : {fmt_diff(src.max_abs_diff)}")
                out.append(f"  worst element : {fmt_diff(at)}{idx}: golden {gv}, live {lv}")
            out.append(f"  max rel diff  : {fmt_diff(src.max_rel_diff)}")
            if src.rtol is not None and src.atol is not None:
                out.append(f"  tolerance     : rtol={src.rtol:g}, atol={src.atol:g} ({src.tolerance_source})")
            if src.error_multiple is not None:
                out.append(f"  error / noise : {src.error_multiple:.3g}x the calibrated noise floor (fails above 1)")
            if focus is not None and focus.where is not None:
                out += where_lines(focus.where)
        out += self._metric_lines(fd)
        if fd.inherited_status is not None:
            out.append(f"  judged by     : its own error (replayed on the golden's inputs); its output, with what it "
                       f"inherited: {fd.inherited_status}, max abs diff {fmt_diff(fd.inherited_max_abs_diff)}")
        others = [leaf for leaf in fd.leaves if leaf.status != "match" and leaf is not focus]
        if others:
            out.append("  other outputs : " + ", ".join(
                f"{leaf.path or '(output)'}: {leaf.status}"
                + (f" (max abs diff {fmt_diff(leaf.max_abs_diff)}, {leaf.mismatched} / {leaf.numel} mismatched)"
                   if leaf.max_abs_diff is not None and leaf.status in ("diverged", "nonfinite") else "")
                for leaf in others[:5]) + (f", and {len(others) - 5} more" if len(others) > 5 else ""))
        return out

    def _metric_lines(self, fd: LayerResult) -> list[str]:
        """The first divergence's error by the report's metric: what its output accumulated, and its
        own error (re-run on the golden's inputs), which tells a layer that loses signal itself from
        one that inherits the loss."""
        m = self.metric
        if m is None or fd.energy is None:
            return []
        acc = fd.inherited_energy if fd.inherited_energy is not None else fd.energy
        own = fd.own_energy
        line = f"  {m:<14}: {fmt_value(m, acc.value(m))} accumulated (its output against the golden)"
        if fd.min_sqnr_db is not None and m != "sqnr":
            line += f", SQNR {fmt_value('sqnr', acc.sqnr_db())}"
        out = [line]
        if own is not None:
            if fd.min_sqnr_db is not None:
                mine = own.sqnr_db() < fd.min_sqnr_db
                why = ("its own error is under the threshold: the layer loses the signal itself" if mine else
                       "its own error is within the threshold: the loss is inherited from the layers before it")
            else:
                why = "re-run on the golden's inputs"
            out.append(f"  own {m:<10}: {fmt_value(m, own.value(m))} ({why})")
        if fd.min_sqnr_db is not None:
            out.append(f"  threshold     : min_sqnr_db {fd.min_sqnr_db:g} dB ({fd.tolerance_source})")
        return out

    def described(self) -> list[tuple[LayerResult, LeafResult]]:
        """Diverged outputs whose shape of divergence was taken (``LeafResult.where``), in order."""
        return [(layer, leaf) for layer in self.divergences if not isinstance(layer, IdenticalCall)
                for leaf in layer.leaves if leaf.where is not None]

    def _requested_where(self, fd: LayerResult) -> list[str]:
        """Layers the ``where`` option named: their shape of divergence too."""
        out = []
        for layer, leaf in self.described():
            if layer is fd or leaf.where is None or not leaf.where.requested:
                continue
            out.append(f"  where in {layer.label}" + (f" output {leaf.path}" if leaf.path else "") + ":")
            out += [f"    {x}" for x in leaf.where.lines()]
        return out

    def _context(self, fd: LayerResult) -> list[str]:
        live = [layer for layer in self.layers if layer.position is not None and
                (layer.phase == "forward") == (fd.phase == "forward")]  # gradients: same pass
        live.sort(key=lambda x: x.position or 0)
        if not live:
            return []
        insert_at: int | None = None  # for a missing call: the live row it belongs before
        if fd.position is not None:
            i = next(k for k, x in enumerate(live) if x is fd)
        else:
            k = self._order.get(self.layers.index(fd), (math.inf, 0))[0] - (live[0].position or 0)
            insert_at = math.ceil(k) if math.isfinite(k) else len(live)
            i = min(insert_at, len(live) - 1)
        lo, hi = max(0, i - CONTEXT_BEFORE), min(len(live), i + CONTEXT_AFTER + 1)
        width = max(12, *(len(row_name(layer)) for layer in [*live[lo:hi], fd]))
        width = min(width, 60)
        calibrated = any(layer.error_multiple is not None for layer in live[lo:hi])
        estimated = any(estimate_ratio(layer) is not None for layer in live[lo:hi])
        metric = self.metric if any(layer.energy is not None for layer in live[lo:hi]) else None
        head = f"    {'#':>5}  {'layer':<{width}} {'call':>4}  {'status':<10} {'max abs':>9} {'max rel':>9}"
        head += f" {metric:>10}" if metric else ""
        head += f" {'x allowed':>10}" if calibrated else ""
        head += f" {'est/limit':>10}" if estimated else ""
        order = "execution order" if fd.phase == "forward" else "backward order"
        out = ["", f"  context ({order}):", head]
        missing_row = (f"  > {'-':>5}  {row_name(fd)[-width:]:<{width}} {fd.call:>4}  "
                       f"missing    ({'did not run' if fd.phase == 'forward' else 'not computed'}; expected here)")
        n_live = self.live_count
        for j, layer in enumerate(live[lo:hi], start=lo):
            if insert_at == j:
                out.append(missing_row)
            mark = ">" if layer is fd else " "
            nm = row_name(layer)[-width:]
            row = (f"  {mark} {self.number(layer, n_live):>5}  {nm:<{width}} {layer.call:>4}  {layer.status:<10} "
                   f"{fmt_diff(layer.max_abs_diff):>9} {fmt_diff(layer.max_rel_diff):>9}")
            if metric:  # the metric of what it was judged on (its own error under replay="all")
                row += f" {fmt_value(metric, None if layer.energy is None else layer.energy.value(metric)):>10}"
            if calibrated:  # error as a multiple of the calibrated noise allowance (fails above 1)
                row += f" {'-' if layer.error_multiple is None else f'{layer.error_multiple:.3g}':>10}"
            if estimated:  # fingerprinted outputs: the sketch's estimate over its threshold (fails above 1)
                ratio = estimate_ratio(layer)
                row += f" {'-' if ratio is None else f'~{ratio:.3g}':>10}"
            out.append(row)
        if insert_at is not None and insert_at >= hi:
            out.append(missing_row)
        return out

    def _totals(self) -> str:
        return f"  totals: {self.totals_text()}"

    def totals_text(self) -> str:
        """"37 live layer calls; 37 match; backward: 93 gradients; 52 diverged, 41 match": the
        counts every form of the report gives (forward calls and gradients apart)."""
        fwd = [layer for layer in self.layers if layer.phase == "forward"]
        c = Counter(layer.status for layer in fwd)
        parts = ", ".join(f"{c[k]} {k}" for k in STATUS_ORDER if c.get(k))
        out = f"{self.live_count} live layer calls; {parts}"
        if len(fwd) != len(self.layers):  # gradients
            g = Counter(layer.status for layer in self.layers if layer.phase != "forward")
            out += (f"; backward: {self.grad_count} gradients; "
                    + ", ".join(f"{g[k]} {k}" for k in STATUS_ORDER if g.get(k)))
        return out

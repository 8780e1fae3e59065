"""Comparing gradients with a golden's: verdicts in backward order, and where a gradient changed.

:class:`GradComparator` is the :class:`~activation_guard.gradients.hooks.GradSink` of a compare. Each
gradient is judged the moment the backward hands it over (by the same judge as the forward's
outputs: strict rtol/atol per layer, or calibrated against float64 noise floors of gradients), so
memory stays near one gradient. Once the backward is done, :meth:`GradComparator.results` turns
them into :class:`~activation_guard.results.LayerResult` rows after the forward's: phase
``backward`` (a call's gradient w.r.t. its output or input, ``wrt``) or ``param-grad`` (a module's
parameter gradients, leaf path = parameter name), positioned in backward execution order.

Attribution (:meth:`GradComparator.origin`), when the forward matched: the first diverging
gradient in backward order says where the backward changed, because everything the backward
computed before it matched. A call whose input gradient differs while its output gradient
matched computes its gradients differently (kind ``layer``); an output gradient that differs
while every consumer's input gradient matched was changed by the enclosing module's own code
(``parent-code``); a parameter gradient that differs while the gradients through its module
matched was changed outside the module's backward (``layer``: a hook on the parameter, or a
weight shared with another module).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from .._core.dtypes import BY_NAME, dtype_name, tensor_bytes, tensor_from_bytes
from ..calibration.calibrate import CalibratedJudge
from ..calibration.shadow import ShadowRun
from ..gradients.hooks import Event
from ..gradients.loss import LossRule
from ..gradients.store import describe_leaf, floor_path
from ..judges.strict import Judge, LeafContext, dtype_change_allowed
from ..options.selection import selected
from ..options.spec import CompareSpec
from ..results import LayerResult, LeafResult, Origin, Phase
from ..store import CallEntry, GoldenReader, LeafEntry
from ..store.floors import NoiseFloor

REPLAYABLE = frozenset({"diverged", "nonfinite", "shape", "dtype", "structure"})
WHY = {
    "diverged": "values outside tolerance",
    "nonfinite": "new NaN/Inf values",
    "shape": "gradient shape changed",
    "dtype": "gradient dtype changed",
    "structure": "gradient structure changed",
    "missing": "gradient not computed in the live run",
    "unexpected": "gradient not in the golden",
}


def what(grad: str | None, path: str | None) -> str:
    """'gradient w.r.t. its input args/0', 'gradient w.r.t. its output', "gradient of parameter 'weight'"."""
    if grad in ("param", None) and path is not None:
        return f"gradient of parameter {path!r}"
    where = f" {path}" if path else ""
    return f"gradient w.r.t. its {grad}{where}"


class GradNoise(ShadowRun):
    """The float64 shadow's gradients as the calibrated rule reads a shadow: ``floor(name, call,
    path, value)`` with ``path`` = :func:`~activation_guard.gradients.store.floor_path`. A view of a
    :class:`ShadowRun` that ran the backward too (one float64 copy serves outputs and gradients);
    closing it leaves that run to its owner."""

    def __init__(self, shadow: ShadowRun):  # no second float64 run: ShadowRun.__init__ is not called
        self.inner = shadow
        self.device = shadow.device
        self.live_device = shadow.live_device
        self.model = None
        self.reader = None
        self.scratch = None
        self.differs = shadow.differs

    def floor(self, name: str, call: int, path: str, value: torch.Tensor) -> NoiseFloor | None:
        return self.inner.grad_floor(name, call, path, value)

    def close(self) -> None:
        pass


class GradComparator:
    """Judges each live gradient against the golden's as the backward delivers it."""

    def __init__(self, reader: GoldenReader, spec: CompareSpec, judge: Judge, rule: LossRule,
                 live_to_golden: Mapping[str, str],
                 golden_filter: tuple[Sequence[str] | None, Sequence[str] | None] | None = None):
        """``golden_filter``: the golden's recorded selection when the hooks could not apply it
        (under ``rename``), as the forward comparator has it: gradients of layers outside it were
        never stored, so they are not "unexpected"."""
        self.reader = reader
        self.golden_filter = golden_filter
        self.spec = spec
        self.judge = judge
        self.rule = rule
        self.live_to_golden = live_to_golden
        self.calibrated = isinstance(judge, CalibratedJudge)
        self.events: list[Event] = []
        self.leaves: dict[int, dict[str, LeafResult]] = {}
        self.met: set[tuple[str, str, int]] = set()
        # golden gradients of calls that ran with autograd off live: (kind, layer, call), not judged
        self.unjudged: list[tuple[str, str, int]] = []
        self._golden_leaves: dict[int, dict[str, LeafEntry]] = {}
        self.parents: dict[tuple[str, str, int], tuple[tuple[str, int] | None, int]] = {}

    def _entry(self, ev: Event) -> CallEntry | None:
        return self.reader.by_grad.get((ev.grad, self.live_to_golden.get(ev.name, ev.name), ev.call))

    # ------------------------------------------------------------------ the sink
    def leaf(self, event: Event, path: str, grad: torch.Tensor | None) -> None:
        entry = self._entry(event)
        if entry is None:
            return  # reported as unexpected by results()
        self.met.add((event.grad, entry.name, event.call))
        gl = self._golden_leaves.get(id(entry))
        if gl is None:
            gl = self._golden_leaves[id(entry)] = {x.path: x for x in entry.leaves}
        self.leaves.setdefault(id(event), {})[path] = self._compare(event, entry, gl.get(path), path, grad)

    def finish(self, events: list[Event]) -> None:
        self.events = events
        for ev in events:
            self.parents[(ev.grad, ev.name, ev.call)] = (ev.parent_key, ev.children)

    def _compare(self, ev: Event, entry: CallEntry, g: LeafEntry | None, path: str,
                 grad: torch.Tensor | None) -> LeafResult:
        w = what(ev.grad, path)
        if g is not None and g.kind == "alias":  # the same values as a gradient stored before
            g = self.reader.resolve(g, describe_leaf(ev, path))
        if g is None:
            return LeafResult(path, "structure", f"the {w} is new: the golden has no gradient at this place")
        if g.kind == "none":
            if grad is None:
                return LeafResult(path, "match", type_name="None")
            return LeafResult(path, "structure", f"no gradient reached this place in the golden; the {w} is one now")
        if grad is None:
            return LeafResult(path, "structure", f"the golden has a {w} ({g.dtype} {list(g.shape)}); now no gradient "
                                                 f"reaches it (a detach, or its path to the loss is cut)")
        ldt = dtype_name(grad)
        shape = tuple(int(s) for s in grad.shape)
        if shape != g.shape:
            return LeafResult(path, "shape", f"{w} shape {list(g.shape)} -> {list(shape)}", dtype=g.dtype,
                              live_dtype=ldt, shape=g.shape, live_shape=shape, numel=g.numel)
        assert g.dtype is not None
        if ldt != g.dtype and not (self.spec.allow_dtype_change and dtype_change_allowed(g.dtype, ldt)):
            return LeafResult(path, "dtype", f"{w} dtype {g.dtype} -> {ldt}", dtype=g.dtype, live_dtype=ldt,
                              shape=g.shape, live_shape=shape, numel=g.numel)
        ctx = LeafContext(ev.name, entry.name, ev.call, floor_path(ev.grad, path) if self.calibrated else path,
                          g.dtype, ldt)
        label = describe_leaf(ev, path)
        if g.pack is not None and ldt == g.dtype and grad.device.type == "cpu":
            raw = self.reader.packed_bytes(g, label)
            if raw.tobytes() == tensor_bytes(grad).tobytes():
                res = self.judge.identical(ctx, grad)
            else:
                res = self.judge.judge(ctx, tensor_from_bytes(raw.copy(), BY_NAME[g.dtype], g.shape), grad)
        else:
            res = self.judge.judge(ctx, self.reader.load(g, label), grad)
        res.path = path
        return res

    # ------------------------------------------------------------------ results
    def results(self, offset: int, wanted: Callable[[str], bool],
                off: frozenset[str] = frozenset()) -> tuple[list[LayerResult], dict[int, tuple[float, int]]]:
        """Live gradients in backward order (positions from ``offset``), then golden gradients the
        live backward never produced (``missing``), each placed where the live one passed its spot;
        the second value maps those to their sort keys, as :meth:`Comparator.finish` does."""
        out: list[LayerResult] = []
        for ev in self.events:
            phase: Phase = "param-grad" if ev.grad == "param" else "backward"
            wrt = None if ev.grad == "param" else ev.grad
            entry = self._entry(ev)
            pos = offset + len(out)
            if entry is None and self.golden_filter is not None and not selected(
                    self.live_to_golden.get(ev.name) or ev.name, *self.golden_filter):
                continue
            if entry is None:
                out.append(LayerResult(ev.name, ev.call, "unexpected", ev.type_name, position=pos, phase=phase, wrt=wrt,
                                       detail=f"the golden has no {what(ev.grad, '' if wrt else None)} for this call"))
                continue
            got = self.leaves.get(id(ev), {})
            leaves = [got[p] for p in ev.paths if p in got]
            leaves += [LeafResult(x.path, "structure", f"the golden's {what(ev.grad, x.path)} is missing from the live "
                                                       f"backward") for x in entry.leaves if x.path not in got]
            lr = LayerResult.from_leaves(ev.name, ev.call, ev.type_name, leaves, position=pos,
                                         golden_position=entry.position, phase=phase, wrt=wrt,
                                         golden_name=entry.name if entry.name != ev.name else None)
            if entry.type_name and entry.type_name != ev.type_name and lr.ok:
                lr.detail = f"module type changed {entry.type_name} -> {ev.type_name} (gradients still match)"
            out.append(lr)
        golden_to_live = {g: live for live, g in self.live_to_golden.items()}
        live_at = sorted((r.golden_position, r.position) for r in out
                         if r.golden_position is not None and r.position is not None)
        order: dict[int, tuple[float, int]] = {}
        n = len(out)
        missing: list[LayerResult] = []
        for c in self.reader.backward:
            assert c.grad is not None
            live = golden_to_live.get(c.name, c.name)
            if (c.grad, c.name, c.call) in self.met or not wanted(live):
                continue
            if live in off:  # ran with autograd off live (a reentrant checkpoint): no gradient to judge
                self.unjudged.append((c.grad, live, c.call))
                continue
            later = [p for gp, p in live_at if gp > c.position]
            at = min(later) - 0.5 if later else math.inf
            phase = "param-grad" if c.grad == "param" else "backward"
            order[n + len(missing)] = (at, c.position)
            missing.append(LayerResult(live, c.call, "missing", c.type_name, golden_position=c.position, phase=phase,
                                       wrt=None if c.grad == "param" else c.grad,
                                       golden_name=c.name if c.name != live else None,
                                       detail="the live backward computed no such gradient (the layer did not run, or "
                                              "this path no longer requires grad: frozen parameters, a detach)"))
        return out + missing, order

    def origin(self, first: LayerResult, results: list[LayerResult]) -> Origin | None:
        """Where the backward changed, when ``first`` (the first divergence, in the backward) says."""
        if first.status not in REPLAYABLE:
            return None
        err = first.max_abs_diff
        nums = "" if err is None or first.status not in ("diverged", "nonfinite") else f" (max abs diff {err:.3g})"
        if first.phase == "param-grad":
            return Origin(first.name, first.call, "layer", err, type_name=first.type_name, detail=(
                f"backward: its {what('param', first.path)} differs{nums} while the gradients w.r.t. its outputs and "
                f"inputs match; something changes that parameter's gradient outside the gradient flow through the "
                f"module (a hook on the parameter, a weight shared with another module, or inputs saved for the "
                f"backward that differ from the forward's: a checkpoint recomputation that differs)"))
        parent, children = self.parents.get((first.wrt or "", first.name, first.call), (None, 0))
        if first.wrt == "input":
            out = next((r for r in results if r.phase == "backward" and r.wrt == "output" and r.name == first.name
                        and r.call == first.call), None)
            if out is not None and not out.ok:
                return None
            inside = (f"its {children} child call(s) pass back the gradients they passed back before, so the change "
                      f"is in its own code between them" if children else
                      "the change is in how it computes gradients")
            return Origin(first.name, first.call, "layer", err, type_name=first.type_name, detail=(
                f"backward changed: the gradient w.r.t. its output matches the golden, but its "
                f"{what('input', first.path)} differs{nums}; {inside} (a custom autograd Function, a .detach(), "
                f"a checkpoint recomputation that differs)"))
        if parent is None:
            return Origin(first.name, first.call, "unknown", err, type_name=first.type_name, detail=(
                "backward: the gradient reaching the model's output differs, so the loss differs (a custom loss "
                "function changed, or the output's structure did)"))
        ptype = next((r.type_name for r in results if r.name == parent[0] and r.phase == "forward"), "")
        child = first.name[len(parent[0]) + 1:] if parent[0] and first.name.startswith(parent[0] + ".") else first.name
        return Origin(parent[0], parent[1], "parent-code", err, type_name=ptype, child=first.name, detail=(
            f"backward: its own code after {child!r} changes the gradient flowing back into {child!r}: the gradient "
            f"w.r.t. the output of {child!r} differs{nums} while the layers that used that output pass back what they "
            f"passed back before"))

    def notes(self) -> list[str]:
        out = [f"backward: loss = {self.rule.describe()}"]
        if isinstance(self.judge, CalibratedJudge):
            out += [f"backward: {x}".replace("outputs", "gradients") for x in self.judge.notes()]
        return out

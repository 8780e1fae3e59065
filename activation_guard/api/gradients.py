"""Gradients in ``record`` and ``compare``: which loss, and the glue around the one backward.

:mod:`activation_guard.api.run` calls into here at three points (the forward's callbacks, the
backward after it, the report's rows and notes), so the gradient logic stays out of the API.

The loss at compare time is the golden's: ``backward=True`` recorded the seeded-cotangent loss
and its seed (meta ``backward``), which compare reuses; a custom loss function cannot be stored,
so compare needs it again (``backward=<the same function>``) and refuses without it. Compare
checks gradients whenever the golden has them (``backward=None``, the default), and never with
``backward=False``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch

from .._core.errors import ActivationGuardError, GoldenFormatError, UnsupportedModelError
from ..calibration.calibrate import CalibratedJudge
from ..calibration.shadow import ShadowRun
from ..capture.hooks import EnterCallback, LayerCallback, Target
from ..comparison.gradients import GradComparator, GradNoise
from ..gradients.hooks import Event, GradCapture
from ..gradients.loss import BY_PATH, DEFAULT_SEED, META_KEY, LossRule, loss_rule
from ..gradients.store import CALIBRATION_KEY, GradRecorder, grad_floors
from ..judges.strict import Judge
from ..options.selection import display_name, few, selected
from ..options.spec import CompareSpec, RecordSpec
from ..results import LayerResult, Origin
from ..store import GoldenReader, GoldenWriter
from ..store.floors import FloorTable

ADOPTED = "unrun_params"  # in the meta's backward record: parameters of modules that never ran are in it
RERECORD = "re-record the golden with the record option backward=True (or backward=<loss function>)"


def _refuse_compiled(target: Target) -> None:
    if target.compiled:
        regions = ", ".join(repr(c or "<root>") for c in target.compiled)
        raise UnsupportedModelError(
            f"gradients cannot be captured per layer inside compiled regions ({regions}): torch.compile fuses the "
            f"backward of the whole region; check the eager module with backward=..., or leave backward off for the "
            f"compiled one")


def chain(first: Any, grads: Any) -> Any:
    """A capture callback that runs ``first`` (the recorder's or comparator's, without building
    autograd graph for its own work) and then the gradient capture's."""
    def both(*a: Any) -> None:
        with torch.no_grad():
            first(*a)
        grads(*a)
    return both


def detached(out: Any) -> Any:
    """The model's output without its graph, so the caller's reference does not keep the
    backward's nodes (and their hooks) alive."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out)


# --------------------------------------------------------------------------- record


class RecordGradients:
    """The gradients of one recording: hooks during the forward, then the backward into the golden."""

    def __init__(self, rule: LossRule, writer: GoldenWriter, shadow: ShadowRun | None, floors: FloorTable | None,
                 wanted: Callable[[str], bool] | None = None):
        self.rule = rule
        self.recorder = GradRecorder(writer, shadow=shadow, floors=floors)
        self.floors = floors if shadow is not None else None
        self.capture = GradCapture(self.recorder, wanted=wanted)

    @staticmethod
    def loss_for(spec: RecordSpec, target: Target) -> LossRule | None:
        rule = loss_rule(spec.backward)
        if rule is not None:
            _refuse_compiled(target)
        return rule

    def callbacks(self, on_enter: EnterCallback, on_output: LayerCallback) -> tuple[EnterCallback, LayerCallback]:
        return chain(on_enter, self.capture.on_enter), chain(on_output, self.capture.on_output)

    def run(self, model: torch.nn.Module, output: Any, args: Any, kwargs: Any) -> dict[str, Any]:
        """The backward; returns the golden meta's ``backward`` record."""
        try:
            self.capture.backward(model, output, self.rule, args, kwargs)
        finally:
            self.capture.close()
        meta = self.rule.to_meta()
        meta["gradients"] = self.recorder.count
        meta[ADOPTED] = True  # parameters of modules that never ran are in it (gradients.GradCapture)
        if self.floors is not None:
            meta[CALIBRATION_KEY] = self.floors.to_meta()
        return meta


# --------------------------------------------------------------------------- compare


def compare_rule(spec: CompareSpec, meta: Mapping[str, Any], path: str, target: Target) -> LossRule | None:
    """The loss compare runs (the golden's), or None when gradients are not compared."""
    rec = meta.get(META_KEY)
    asked = spec.backward
    if asked is False:
        return None
    if rec is None:
        if asked is None:
            return None
        raise ActivationGuardError(f"{path}: the golden has no gradients, so backward={_shown(asked)} has nothing to "
                                   f"compare them with; {RERECORD}, or compare without backward")
    if not isinstance(rec, Mapping) or rec.get("loss") not in ("cotangent", "custom"):
        raise GoldenFormatError(path, f"has a malformed {META_KEY!r} record in its meta", fix=RERECORD)
    _refuse_compiled(target)
    if rec["loss"] == "cotangent":
        if callable(asked):  # (True is no callable)
            raise ActivationGuardError(
                f"{path}: the golden's gradients were recorded with backward=True (seeded random cotangents), but "
                f"compare was given the loss function {_shown(asked)}; pass backward=True, or re-record the golden "
                f"with that loss")
        seed = rec.get("seed", DEFAULT_SEED)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise GoldenFormatError(path, f"has a malformed {META_KEY!r} record in its meta (seed {seed!r})",
                                    fix=RERECORD)
        return LossRule("cotangent", seed, by_path=rec.get("cotangents") == BY_PATH)
    if not callable(asked):
        raise ActivationGuardError(
            f"{path}: the golden's gradients were recorded with a custom loss function ({rec.get('function', '?')}), "
            f"which a golden cannot store; pass the same function again as backward=<function> to compare them "
            f"(or backward=False to compare the forward only)")
    return loss_rule(asked)


def _shown(v: Any) -> str:
    return repr(v) if isinstance(v, bool) else getattr(v, "__qualname__", repr(v))


class CompareGradients:
    """The gradients of one compare: hooks during the forward, the backward judged as it runs,
    then rows for the report."""

    def __init__(self, rule: LossRule, reader: GoldenReader, spec: CompareSpec, judge: Judge,
                 live_to_golden: Mapping[str, str], path: str,
                 golden_filter: tuple[Sequence[str] | None, Sequence[str] | None] | None = None):
        self.rule = rule
        self.spec = spec
        gjudge: Judge = judge
        if isinstance(judge, CalibratedJudge):  # the same float64 run holds the gradients' references
            gjudge = CalibratedJudge(grad_floors(reader.meta, path), GradNoise(judge.shadow), judge.strict)
        self.comparator = GradComparator(reader, spec, gjudge, rule, live_to_golden, golden_filter)
        rec = reader.meta.get(META_KEY)
        self.capture = GradCapture(self.comparator, adopt=isinstance(rec, dict) and rec.get(ADOPTED) is True,
                                   wanted=lambda n: selected(n, spec.include, spec.exclude))
        self.ran = False

    def callbacks(self, on_enter: EnterCallback, on_output: LayerCallback) -> tuple[EnterCallback, LayerCallback]:
        return chain(on_enter, self.capture.on_enter), chain(on_output, self.capture.on_output)

    def run(self, model: torch.nn.Module, output: Any, args: Any, kwargs: Any) -> None:
        try:
            self.capture.backward(model, output, self.rule, args, kwargs)
            self.ran = True
        finally:
            self.capture.close()

    def rows(self, layers: list[LayerResult],
             order: dict[int, tuple[float, int]]) -> tuple[list[LayerResult], dict[int, tuple[float, int]]]:
        """``layers``/``order`` (the forward's) with the gradients' rows after them."""
        if not self.ran:
            return layers, order
        offset = 1 + max((r.position for r in layers if r.position is not None), default=-1)
        extra, more = self.comparator.results(offset, lambda n: selected(n, self.spec.include, self.spec.exclude),
                                              frozenset(self.capture.no_autograd))
        base = len(layers)
        merged = dict(order)
        merged.update({base + k: v for k, v in more.items()})
        return layers + extra, merged

    def origin(self, first: LayerResult | None, layers: list[LayerResult]) -> Origin | None:
        if first is None or first.phase == "forward" or not self.ran:
            return None
        return self.comparator.origin(first, layers)

    def notes(self, stopped: bool) -> list[str]:
        if not self.ran:
            return [f"backward: the golden's gradients were not compared: "
                    f"{'the forward stopped at its first divergence (fail_fast)' if stopped else 'no backward ran'}"]
        out = self.comparator.notes()
        off = self.capture.no_autograd
        if off:
            names = list(dict.fromkeys(off))  # (a layer called twice is named once)
            shown = few(names)
            regions = few([display_name(n) for n in self.capture.autograd_off_regions()])
            skipped = self.comparator.unjudged
            params = sum(1 for kind, _, _ in skipped if kind == "param")
            held = (f"; the golden's {len(skipped) - params} gradient(s) w.r.t. their outputs and inputs and "
                    f"{params} of their parameter gradient(s) were not judged (not failed: the live capture saw none "
                    f"computed)" if skipped else "")
            out.append(f"backward: {len(off)} layer call(s) ran with autograd off ({shown}), inside the calls of "
                       f"{regions}: torch.no_grad, or an activation checkpoint with use_reentrant=True, which "
                       f"re-runs them inside the backward out of the capture's sight. Their gradients are not "
                       f"compared{held}; the gradients of the calls around them are, and a change in their "
                       f"backward shows there")
        left = self.capture.unadopted
        if left:
            shown = few(left)
            out.append(f"backward: the golden holds no gradients for {len(left)} parameter(s) of modules that never "
                       f"ran ({shown}; an nn.ParameterList, or weights used through F.linear): they were not "
                       f"compared; re-record to compare them")
        return out


def diff_rows(golden: GoldenReader, other: GoldenReader, spec: CompareSpec, judge: Judge,
              live_to_golden: Mapping[str, str], layers: list[LayerResult],
              order: dict[int, tuple[float, int]]) -> tuple[list[LayerResult], dict[int, tuple[float, int]], list[str]]:
    """``diff`` of two recordings: the other recording's gradients, in its backward order, judged
    against the golden's as a live backward would be (when both have gradients)."""
    mine, theirs = golden.meta.get(META_KEY), other.meta.get(META_KEY)
    if mine is None and theirs is None:
        return layers, order, []
    if mine is None or theirs is None:
        which = "the golden" if mine is not None else "the other recording"
        return layers, order, [f"backward: only {which} has gradients; they were not compared"]
    if not (isinstance(mine, Mapping) and isinstance(theirs, Mapping)) or any(
            mine.get(k) != theirs.get(k) for k in ("loss", "seed", "function", "cotangents")):
        return layers, order, ["backward: the two recordings used different losses; gradients not compared"]
    sink = GradComparator(golden, spec, judge, LossRule("cotangent"), live_to_golden)
    events = []
    for c in other.backward:
        assert c.grad is not None
        if not selected(c.name, spec.include, spec.exclude):  # as a live capture hooks only selected layers
            continue
        ev = Event(c.grad, c.name, c.call, c.type_name, [x.path for x in c.leaves], c.position)
        for x in c.leaves:
            where = f"layer {c.name!r} call {c.call} {c.grad} gradient {x.path!r}"
            t = None if x.kind == "none" else other.load(x, where)
            sink.leaf(ev, x.path, t)
        events.append(ev)
    sink.finish(events)
    offset = 1 + max((r.position for r in layers if r.position is not None), default=-1)
    extra, more = sink.results(offset, lambda n: selected(n, spec.include, spec.exclude))
    merged = dict(order)
    merged.update({len(layers) + k: v for k, v in more.items()})
    return layers + extra, merged, []


def skipped_note(spec: CompareSpec, meta: Mapping[str, Any]) -> list[str]:
    """A golden with gradients compared with backward=False says so."""
    if spec.backward is False and meta.get(META_KEY) is not None:
        return ["backward: the golden has gradients; not compared (backward=False)"]
    return []


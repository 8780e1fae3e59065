"""Judging outputs stored as fingerprints: the comparator's dispatch target for ``fingerprint`` leaves.

The comparator hands every leaf that is a fingerprint on either side (a fingerprinted golden, or
in ``diff`` a fingerprinted recording) to :meth:`FingerprintJudge.compare_leaf`. The judge:

- checks what the comparator checks for tensors (output kind, Python type, shape, dtype under
  ``allow_dtype_change``) with the same wording;
- gets the two fingerprints: the golden's from the file; the live side's computed on the live
  tensor's device with the golden's parameters (:func:`judge_fingerprint` does it), or read from
  the second recording; a full golden tensor met by a fingerprinted recording is fingerprinted
  with that recording's parameters;
- resolves tolerances exactly as the strict judge does (``StrictJudge.tolerance``: dtype and
  cross-device defaults, ``rtol``/``atol``, ``tolerances`` globs), or under
  ``tolerance="calibrated"`` applies the calibrated rule in its L2 form with the golden's noise
  floors (stored as norms) and the live shadow's, where :meth:`CalibratedJudge.decide` (the one
  decision for full values, fingerprints and replays) says so; explicit patterns and outputs
  without a floor are judged strictly, and its notes count them;
- maps the :class:`FingerprintVerdict` onto a :class:`LeafResult` whose numbers are fields
  (``estimate``, ``estimated_l2``, ``l2_bound``...), so reports say they are estimates.

There is no bit-identical fast path: equal fingerprints do not prove equal tensors, and the checks
cost little next to fingerprinting the live tensor.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from .._core.dtypes import BY_NAME, BY_TORCH
from ..calibration.calibrate import CalibratedJudge, allowance, cast_rounding
from ..fingerprints.fingerprint import Fingerprint, FingerprintError, compute_fingerprint
from ..fingerprints.soundness import FingerprintVerdict, judge_fingerprint, judge_fingerprint_calibrated
from ..judges.strict import PRECISION, Judge, LeafContext, StrictJudge, dtype_change_allowed
from ..options.tolerances import Tolerance
from ..results import LeafResult, Status, out_name
from ..store import CallEntry, GoldenReader, LeafEntry
from ..store.floors import ABS_TERM, NoiseFloor, rule_text
from ..values.leaves import Leaf

STATUS: dict[str, Status] = {
    "ok": "match", "diverged": "diverged", "nonfinite": "nonfinite", "shape": "shape", "dtype": "dtype",
}
VALUE_KINDS = ("tensor", "fingerprint")


def _describe(kind: str, dtype: str | None, type_name: str) -> str:
    what = "tensor" if type_name in ("", "Tensor") else type_name
    if kind == "fingerprint":
        return f"a fingerprinted {dtype} {what}"
    if kind == "tensor":
        return f"a {dtype} {what}"
    return type_name or kind


class FingerprintJudge:
    """The fingerprint rule, built over the comparison's strict judge (and its calibrated judge,
    when ``tolerance="calibrated"``), so tolerances resolve exactly as for full goldens."""

    def __init__(self, strict: StrictJudge, calibrated: CalibratedJudge | None = None):
        self.strict = strict
        self.calibrated = calibrated
        self._judged: set[tuple[str, int, str]] = set()  # (layer, call, path): a replay judges one again
        self._failed: set[tuple[str, int, str, str]] = set()  # (layer, call, path, the check that failed)
        self.false_alarm: float | None = None

    @classmethod
    def for_judge(cls, judge: Judge) -> FingerprintJudge:
        """The fingerprint rule matching a comparison's judge."""
        if isinstance(judge, CalibratedJudge):
            return cls(judge.strict, judge)
        if isinstance(judge, StrictJudge):
            return cls(judge)
        strict = getattr(judge, "strict", None)
        if isinstance(strict, StrictJudge):  # another rule built over the strict one
            return cls(strict)
        raise TypeError(f"no fingerprint rule for a {type(judge).__name__}: give Comparator a FingerprintJudge")

    # ------------------------------------------------------------------ the comparator's dispatch
    def compare_leaf(self, reader: GoldenReader, g: LeafEntry, lv: Leaf, name: str, entry: CallEntry,
                     allow_dtype_change: bool) -> LeafResult:
        """Compare one golden leaf with one live leaf when either is a fingerprint."""
        p = g.path
        if g.kind not in VALUE_KINDS or lv.kind not in VALUE_KINDS:
            return LeafResult(p, "structure", f"{out_name(p)} was {_describe(g.kind, g.dtype, g.type_name)}, "
                                              f"is now {_describe(lv.kind, None, lv.type_name)}")
        if g.type_name != lv.type_name:
            return LeafResult(p, "structure", f"{out_name(p)} type changed {g.type_name} -> {lv.type_name}",
                              type_name=lv.type_name)
        assert g.dtype is not None
        lshape, ldt = _shape_dtype(lv)
        if lshape != g.shape:
            return LeafResult(p, "shape", f"{out_name(p)} shape {list(g.shape)} -> {list(lshape)}", dtype=g.dtype,
                              live_dtype=ldt, shape=g.shape, live_shape=lshape, numel=g.numel)
        if ldt != g.dtype and not (allow_dtype_change and dtype_change_allowed(g.dtype, ldt)):
            return LeafResult(p, "dtype", f"{out_name(p)} dtype {g.dtype} -> {ldt}", dtype=g.dtype, live_dtype=ldt,
                              shape=g.shape, live_shape=lshape, numel=g.numel)
        ctx = LeafContext(name, entry.name, entry.call, p, g.dtype, ldt)
        live: torch.Tensor | Fingerprint
        if lv.kind == "fingerprint":
            assert isinstance(lv.fingerprint, Fingerprint)  # a compare computes its fingerprints inline
            live = lv.fingerprint
        else:
            assert lv.tensor is not None
            live = lv.tensor
        if g.kind == "fingerprint":
            golden = reader.fingerprint(g, ctx.label)
        else:  # a full golden met by a fingerprinted recording: fingerprint the golden side alike
            assert isinstance(live, Fingerprint)
            golden = compute_fingerprint(reader.load(g, ctx.label), live.params)
        try:
            return self.judge(ctx, golden, live)
        except FingerprintError as e:  # e.g. two recordings fingerprinted with different parameters
            raise FingerprintError(f"{ctx.label}: {e}") from None

    # ------------------------------------------------------------------ the rule
    def judge(self, ctx: LeafContext, golden: Fingerprint, live: torch.Tensor | Fingerprint) -> LeafResult:
        """Judge ``live`` (a tensor on any device, or a fingerprint) against ``golden``."""
        cal = self.calibrated
        if cal is None:
            tol = self.strict.tolerance(ctx)
            return self._strict(ctx, golden, live, tol, tol.source)

        def floors(gf: NoiseFloor) -> tuple[NoiseFloor, NoiseFloor | None]:
            if not isinstance(live, torch.Tensor):  # a fingerprinted recording: no live shadow
                return gf, None
            lf = cal.shadow.floor(ctx.name, ctx.call, ctx.path, live)
            if lf is not None:
                lf = _with_cast_rounding(lf, golden, ctx)
            if PRECISION.get(ctx.golden_dtype, 0) < PRECISION.get(ctx.live_dtype, 0):
                # the golden was stored rounded (a bf16 recording, a float32 run): the live value
                # rounded to the golden's dtype is as close as the golden can be (full goldens alike)
                rf = cast_rounding(live.detach(), BY_NAME[ctx.golden_dtype].torch_dtype)
                gf = NoiseFloor(gf.max_abs + rf.max_abs, gf.rms + rf.rms)
            return gf, lf if lf is not None and lf.finite else None

        d = cal.decide(ctx, floors, lambda: math.sqrt(golden.sq_sum / golden.count) if golden.count else None)
        if not d.calibrated:
            return self._strict(ctx, golden, live, d.tolerance, d.source)
        gf, lf = d.golden_floor, d.live_floor
        assert gf is not None and lf is not None
        a = allowance(ctx.golden_dtype, ctx.live_dtype, golden.numel, gf, lf, ABS_TERM)
        v = judge_fingerprint_calibrated(golden, live, golden_rms_floor=gf.rms, live_rms_floor=lf.rms,
                                         multiplier=a.multiplier, abs_term=ABS_TERM, golden_max_floor=gf.max_abs,
                                         live_max_floor=lf.max_abs, allow_dtype_change=True)
        res = self._result(ctx, golden, v, "rms", 0.0, a.max_abs, f"{rule_text(a.multiplier)} (L2 form)")
        # the sketch's ratio, or the worst sampled element's error over the max-abs allowance if larger
        diffs = [abs(complex(m.live) - complex(m.golden)) for m in v.mismatches]
        worst = max((math.inf if math.isnan(d) else d for d in diffs), default=0.0) / a.max_abs
        ratio = v.ratio if math.isfinite(v.ratio) else None
        res.error_multiple = worst if v.mismatches and (ratio is None or worst > ratio) else ratio
        return res

    def _strict(self, ctx: LeafContext, golden: Fingerprint, live: torch.Tensor | Fingerprint, tol: Tolerance,
                source: str) -> LeafResult:
        v = judge_fingerprint(golden, live, tol.rtol, tol.atol, allow_dtype_change=ctx.golden_dtype != ctx.live_dtype)
        return self._result(ctx, golden, v, "l2", tol.rtol, tol.atol, source)

    def _result(self, ctx: LeafContext, golden: Fingerprint, v: FingerprintVerdict, form: str, rtol: float,
                atol: float, source: str) -> LeafResult:
        where = (ctx.name, ctx.call, ctx.path)
        self._judged.add(where)
        self.false_alarm = v.false_alarm if math.isfinite(v.false_alarm) else self.false_alarm
        status = STATUS[v.status]
        if status != "match" and v.check:
            self._failed.add((*where, v.check))
        shape = golden.shape
        res = LeafResult(
            ctx.path, status, dtype=ctx.golden_dtype, live_dtype=ctx.live_dtype, shape=shape, live_shape=shape,
            numel=golden.numel, mismatched=len(v.mismatches),
            nonfinite_new=_nonfinite_new(golden, v.live) if status == "nonfinite" else 0,
            rtol=rtol, atol=atol, tolerance_source=source, estimate=form, fingerprint_check=v.check,
            estimated_l2=_num(v.estimate), l2_bound=_num(v.bound), l2_threshold=_num(v.threshold),
            sketch_rows_over=v.rows_over, sketch_rows=v.rows, sampled=v.sampled, false_alarm=_num(v.false_alarm),
        )
        if v.mismatches:  # a sampled element outside tolerance: exact values, bit for bit
            first = v.mismatches[0]
            res.index, res.golden_value, res.live_value = tuple(first.index), first.golden, first.live
        if status != "match" and v.check not in ("sketch", "sample"):
            res.detail = v.reason  # a certain check's sentence; the sketch's and samples' numbers are fields
        notes = [n for n in (v.note, f"dtype {ctx.golden_dtype} -> {ctx.live_dtype} allowed"
                             if ctx.golden_dtype != ctx.live_dtype else "") if n]
        if notes and status != "match" and v.check in ("sketch", "sample"):
            # a note alone on the "what" line would read as the reason it failed: name the check first
            res.detail = (f"{len(v.mismatches)} of {v.sampled} sampled elements outside tolerance (certain)"
                          if v.check == "sample" else "the sketch's estimate exceeds its threshold (an estimate)")
        if notes:
            res.detail = "; ".join([res.detail, *notes] if res.detail else notes)
        return res

    # ------------------------------------------------------------------ report
    @property
    def judged(self) -> int:
        """Outputs compared by fingerprint, each once (a replay compares a call's output again)."""
        return len(self._judged)

    @property
    def failed_by(self) -> dict[str, int]:
        """Check -> outputs it failed (each output once)."""
        return dict(Counter(check for *_, check in self._failed))

    def notes(self) -> list[str]:
        if not self.judged:
            return []
        fa = f"{self.false_alarm:.1g}" if self.false_alarm is not None else "?"
        out = [f"{self.judged} outputs were compared by fingerprint (the golden stores fingerprints, not values): "
               f"their numbers are estimates; a failure by a certain check (samples, max, min, sum, NaN/Inf) "
               f"proves a divergence, one by the sketch has a false-alarm probability <= {fa} per output, and a "
               "pass does not prove every element within tolerance (docs/fingerprint.md)"]
        if self.failed_by:
            out.append("fingerprint checks that failed: "
                       + ", ".join(f"{k} x{n}" for k, n in sorted(self.failed_by.items())))
        return out


def _shape_dtype(lv: Leaf) -> tuple[tuple[int, ...], str]:
    if lv.kind == "fingerprint":
        assert lv.fingerprint is not None
        return lv.fingerprint.shape, lv.fingerprint.dtype
    assert lv.tensor is not None
    t = lv.tensor
    info = BY_TORCH.get(t.dtype)
    return tuple(int(s) for s in t.shape), info.name if info is not None else str(t.dtype).replace("torch.", "")


def _num(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else float(x)


def _nonfinite_new(g: Fingerprint, lf: Fingerprint | None) -> int:
    """NaN/Inf values the golden does not have at their places: per kind, the surplus; at least
    one when they only moved (or only vanished: then a finite live value sits where the golden
    has a NaN/Inf, which the element rule counts as a mismatch too)."""
    if lf is None:
        return 1
    return max(1, sum(max(a - b, 0) for a, b in zip((lf.nan, lf.posinf, lf.neginf), (g.nan, g.posinf, g.neginf))))


def _with_cast_rounding(lf: NoiseFloor, golden: Fingerprint, ctx: LeafContext) -> NoiseFloor:
    """A live result stored in a lower precision than the golden cannot be closer to the truth
    than the golden rounded to it (``CalibratedJudge`` adds that rounding to the live floor,
    measured on the golden tensor). Here only the golden's fingerprint exists, so the rounding is
    bounded from its statistics: at most half a unit in the last place of the lower dtype times
    the largest finite magnitude (max abs) or the RMS (Minkowski), plus half the smallest
    subnormal. An upper bound: the allowance can only grow, never make a false alarm."""
    if PRECISION.get(ctx.live_dtype, 0) >= PRECISION.get(ctx.golden_dtype, 0):
        return lf
    info = BY_NAME.get(ctx.live_dtype)
    if info is None or info.kind != "float" or golden.count == 0:
        return lf
    fi = torch.finfo(info.torch_dtype)
    u = fi.eps / 2
    sub = fi.tiny * fi.eps / 2
    big = max(abs(golden.min), abs(golden.max))
    if big > fi.max:  # the golden does not fit the lower dtype: no finite floor
        return NoiseFloor(math.inf, math.inf)
    rms = math.sqrt(golden.sq_sum / golden.real_numel) * (1 + 1e-12) if golden.real_numel else 0.0
    return NoiseFloor(lf.max_abs + u * big * (1 + 1e-12) + sub, lf.rms + u * rms + sub)


"""Judging a live tensor (or a second fingerprint) against a golden fingerprint, soundly.

A fingerprint cannot see every element, so each check states what it guarantees (derivations
in docs/fingerprint.md):

- certain: any failure of these proves that some element is outside tolerance. Shape, dtype and
  the non-finite counts/positions are compared exactly; every sampled element is checked with the
  comparator's own rule ``|live - golden| <= atol + rtol * |golden|``; the finite max and min
  cannot move by more than ``atol + rtol * |max|`` (``|min|``), nor the sum by more than
  ``atol * n + rtol * sum|golden|``, when every element is within tolerance.
- probabilistic: if every element is within tolerance then ``||live - golden||_2 <= T`` with
  ``T^2 = atol^2 n + 2 atol rtol sum|g| + rtol^2 sum g^2``. The sketch estimates that norm (the
  median over R rows); a run fails when a majority of rows exceed ``c * T`` plus a rigorous
  float64 rounding allowance, and ``c`` is chosen so that a within-tolerance run does so with
  probability at most ``params.false_alarm`` (1e-6 by default). A change too small or too sparse
  to move the norm beyond ``c * T`` (a few unsampled elements) can pass: the report says the
  numbers are estimates.

The same machinery judges the calibrated rule in its L2 form (:func:`judge_fingerprint_calibrated`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .._core import dtypes
from .._core.kernel import element_rule, pair_dtype
from .fingerprint import Fingerprint, FingerprintError, compute_fingerprint, fingerprintable_dtype

U = 2.0**-53  # float64 unit roundoff
# The comparator evaluates the element rule in float32 for float32 and narrower dtypes: an
# element it accepts is within (1 + 3 * 2**-24) times the exact tolerance, plus float32
# underflow of rtol * |golden| (at most 2**-149). Both are covered with room to spare:
TOL_SLACK = 1.0 + 2.0**-20
ELEM_EPS = 2.0**-140
ELEM_EPS_F64 = 2.0**-1070  # float64 arithmetic (a float64 side): rtol * |golden| underflows by < 2**-1074
_F64 = ("float64", "complex128")


def _elem_eps(g: Fingerprint, lf: Fingerprint) -> float:
    """The underflow allowance of the precision the comparator evaluates in (the wider side's)."""
    return ELEM_EPS_F64 if (g.dtype in _F64 or lf.dtype in _F64) else ELEM_EPS


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of k float64 additions."""
    ku = k * U
    return ku / (1.0 - ku) if ku < 0.5 else math.inf


def _up(x: float, ops: int = 16) -> float:
    """``x`` (>= 0) raised past the rounding of ``ops`` float64 operations used to compute it."""
    return x * (1.0 + 4.0 * ops * U)


@dataclass
class SampleMismatch:
    """A sampled element outside tolerance: proof that the run diverged."""

    flat: int
    index: tuple[int, ...]
    golden: Any
    live: Any


@dataclass
class FingerprintVerdict:
    """The judgement of one tensor against its golden fingerprint, with the numbers behind it."""

    status: str  # ok | diverged | nonfinite | shape | dtype
    check: str | None  # the check that failed: shape, dtype, nonfinite, sample, max, min, sum, sketch
    detail: str  # one human sentence for the report
    reason: str = ""  # the failing check's own sentence (without the sketch numbers), "" when ok
    estimate: float = math.nan  # sketch estimate of ||live - golden||_2 (median over rows)
    bound: float = math.nan  # ||live - golden||_2 can be at most this if every element is within tolerance
    threshold: float = math.nan  # what the row estimates were compared with: c * bound + rounding
    multiplier: float = math.nan  # c
    rows_over: int = 0  # sketch rows above the threshold (a majority fails)
    rows: int = 0
    sampled: int = 0
    mismatches: list[SampleMismatch] = field(default_factory=list)
    sum_diff: float = math.nan
    sum_bound: float = math.nan
    false_alarm: float = math.nan  # the bound on P(a within-tolerance run fails this verdict)
    numel: int = 0
    rule: str = ""
    note: str = ""  # why a check could not be made
    live: Fingerprint | None = None  # the live side's fingerprint (computed when a tensor was given)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ratio(self) -> float:
        """estimate / threshold: > 1 on a majority of rows fails the sketch check."""
        return self.estimate / self.threshold if self.threshold > 0 else math.inf if self.estimate > 0 else 0.0

    @property
    def estimated_rms(self) -> float:
        return self.estimate / math.sqrt(self.numel) if self.numel else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able numbers (non-finite floats as strings, sample values as floats or [re, im])."""
        d = {k: v for k, v in asdict(self).items() if k != "live"}
        for k, v in list(d.items()):
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = str(v)
        d["mismatches"] = [{"flat": m.flat, "index": list(m.index), "golden": _json(m.golden), "live": _json(m.live)}
                           for m in self.mismatches]
        return d


def _json(x: Any) -> Any:
    if isinstance(x, complex):
        return [_json(x.real), _json(x.imag)]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


# --------------------------------------------------------------------------- public entry points


def judge_fingerprint(golden: Fingerprint, live: torch.Tensor | Fingerprint, rtol: float, atol: float, *,
                      allow_dtype_change: bool = False) -> FingerprintVerdict:
    """Judge ``live`` (a tensor on any device, fingerprinted there with the golden's parameters,
    or a fingerprint of a second recording) against ``golden`` with the element-wise tolerance
    ``|live - golden| <= atol + rtol * |golden|``."""
    _check_tol(rtol, atol)
    lf = _prepare(golden, live, allow_dtype_change)
    if isinstance(lf, FingerprintVerdict):
        return lf
    n = golden.count if not golden.is_complex else golden.numel  # elements that can differ
    a, sq = _inflated_abs(golden), _root_sq(golden)
    eps = _elem_eps(golden, lf)
    # T = sqrt(atol^2 n + 2 atol rtol a + rtol^2 q), scaled by its largest term: float64 squares of
    # tiny values (1e-300) would underflow to zero and make T too small (a false alarm)
    s = max(atol, rtol * sq)
    t = 0.0 if s == 0 else s * math.sqrt(_up((atol / s) ** 2 * n + 2.0 * (atol / s) * (rtol * a / s)
                                             + (rtol * sq / s) ** 2))
    bound = _up(t) * TOL_SLACK + eps * math.sqrt(n)
    root2 = math.sqrt(2.0) if golden.is_complex else 1.0  # a complex difference moves re + im by <= sqrt(2)|d|
    sum_bound = _up(root2 * ((atol * n + rtol * a) * TOL_SLACK + eps * n))
    rule = f"|live - golden| <= {atol:g} + {rtol:g} * |golden|"
    return _judge(golden, lf, elem=(rtol, atol), bound=bound, sum_bound=sum_bound, rule=rule, rms=False)


def judge_fingerprint_calibrated(golden: Fingerprint, live: torch.Tensor | Fingerprint, *,
                                 golden_rms_floor: float, live_rms_floor: float, multiplier: float,
                                 abs_term: float = 1e-5, golden_max_floor: float | None = None,
                                 live_max_floor: float | None = None,
                                 allow_dtype_change: bool = True) -> FingerprintVerdict:
    """The calibrated rule in L2 form: fail when the sketch's estimate of the RMS error
    ``||live - golden||_2 / sqrt(n)`` exceeds the allowance ``m (golden floor + live floor) +
    abs_term`` by the false-alarm margin. With both max-abs floors given, the samples, max, min
    and sum are also checked (certain) against ``m (golden max floor + live max floor) + abs_term``.
    """
    for name, v in (("golden_rms_floor", golden_rms_floor), ("live_rms_floor", live_rms_floor),
                    ("multiplier", multiplier), ("abs_term", abs_term)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if (golden_max_floor is None) != (live_max_floor is None):
        raise ValueError("give both golden_max_floor and live_max_floor, or neither")
    lf = _prepare(golden, live, allow_dtype_change)
    if isinstance(lf, FingerprintVerdict):
        return lf
    n = golden.numel
    allow_rms = multiplier * (golden_rms_floor + live_rms_floor) + abs_term
    # the full rule's RMS is itself a float64 sum of n squares: allow for its rounding too
    bound = _up(allow_rms * math.sqrt(n) * (1.0 + gamma(n + 4)))
    real_n = golden.real_numel
    sum_bound = _up(math.sqrt(real_n) * bound)  # |sum d| <= sqrt(#values) ||d||_2
    elem = None
    rule = (f"calibrated (L2): RMS error <= {multiplier:g} x (golden floor + live floor) + {abs_term:g} "
            f"= {allow_rms:.3g}")
    if golden_max_floor is not None and live_max_floor is not None:
        for name, v in (("golden_max_floor", golden_max_floor), ("live_max_floor", live_max_floor)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        allow_max = multiplier * (golden_max_floor + live_max_floor) + abs_term
        elem = (0.0, allow_max)
        root2 = math.sqrt(2.0) if golden.is_complex else 1.0
        sum_bound = min(sum_bound, _up(root2 * (allow_max * n * TOL_SLACK + _elem_eps(golden, lf) * n)))
        rule += f"; max abs error <= {allow_max:.3g}"
    return _judge(golden, lf, elem=elem, bound=bound, sum_bound=sum_bound, rule=rule, rms=True)


# --------------------------------------------------------------------------- internals


def _check_tol(rtol: float, atol: float) -> None:
    for name, v in (("rtol", rtol), ("atol", atol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def _prepare(golden: Fingerprint, live: torch.Tensor | Fingerprint,
             allow_dtype_change: bool) -> Fingerprint | FingerprintVerdict:
    """The live fingerprint, or the verdict when shape or dtype already decide (nothing is read)."""
    if isinstance(live, Fingerprint):
        if live.params != golden.params:
            raise FingerprintError(
                f"the two fingerprints were taken with different parameters ({golden.params} vs {live.params}) "
                "and cannot be compared; re-record one of them with the other's parameters")
        shape, dtype_name, is_complex = live.shape, live.dtype, live.is_complex
    elif isinstance(live, torch.Tensor):
        shape = tuple(int(s) for s in live.shape)
        info = dtypes.BY_TORCH.get(live.dtype)
        dtype_name = info.name if info is not None else str(live.dtype).replace("torch.", "")
        is_complex = live.dtype.is_complex
        if not fingerprintable_dtype(live.dtype):
            return FingerprintVerdict("dtype", "dtype", f"dtype {dtype_name} differs from the golden's {golden.dtype}")
    else:
        raise TypeError(f"live must be a torch.Tensor or a Fingerprint, got {type(live).__name__}")
    if shape != golden.shape:
        return FingerprintVerdict("shape", "shape",
                                  f"shape {list(shape)} differs from the golden's {list(golden.shape)}")
    if dtype_name != golden.dtype and (not allow_dtype_change or is_complex != golden.is_complex):
        return FingerprintVerdict("dtype", "dtype", f"dtype {dtype_name} differs from the golden's {golden.dtype}")
    return live if isinstance(live, Fingerprint) else compute_fingerprint(live, golden.params)


def _inflated_abs(f: Fingerprint) -> float:
    """An upper bound on the exact sum of |x| from its computed value."""
    return _up(f.abs_sum / (1.0 - gamma(f.depth))) if f.abs_sum else 0.0


def _inflated_sq(f: Fingerprint) -> float:
    return _up(f.sq_sum * (1.0 + U) / (1.0 - gamma(f.depth + 1))) if f.sq_sum else 0.0


def _root_sq(f: Fingerprint) -> float:
    """An upper bound on ``sqrt(sum |x|^2)``. The stored float64 sum of squares loses each square
    that underflows (values below ~1e-154), at most 2**-1074 each; for a real leaf
    ``sum x^2 <= max|x| sum|x|`` bounds it without squaring, which is tight for tiny values."""
    root = _up(math.sqrt(_inflated_sq(f) + _up(f.real_numel * 2.0**-1074)))
    big = max(abs(f.min), abs(f.max)) if f.count else 0.0
    if not f.is_complex and math.isfinite(big):
        root = min(root, _up(math.sqrt(big) * math.sqrt(_inflated_abs(f))))
    return root


def _row_norms(d: np.ndarray) -> np.ndarray:
    """||row||_2 of each row, scaled so that no square overflows or underflows to zero."""
    scale = np.abs(d).max(axis=1, initial=0.0)
    safe = np.where(scale > 0, scale, 1.0)
    return scale * np.sqrt(np.sum((d / safe[:, None]) ** 2, axis=1))


def _judge(g: Fingerprint, lf: Fingerprint, *, elem: tuple[float, float] | None, bound: float,
           sum_bound: float, rule: str, rms: bool) -> FingerprintVerdict:
    p = g.params
    v = FingerprintVerdict("ok", None, "", bound=bound, multiplier=p.multiplier, rows=p.rows,
                           false_alarm=p.false_alarm_bound, numel=g.numel, rule=rule, live=lf)
    failures: list[tuple[str, str]] = []  # (check, sentence), in order of certainty
    # non-finite values: the same counts at the same positions (position hashes)
    if (g.nan, g.posinf, g.neginf) != (lf.nan, lf.posinf, lf.neginf):
        failures.append(("nonfinite", f"non-finite values changed: golden {g.nan} NaN, {g.posinf} +Inf, "
                                      f"{g.neginf} -Inf; live {lf.nan} NaN, {lf.posinf} +Inf, {lf.neginf} -Inf"))
    elif g.nonfinite_hash != lf.nonfinite_hash:
        failures.append(("nonfinite", f"non-finite values moved: the same counts ({g.nan} NaN, {g.posinf} +Inf, "
                                      f"{g.neginf} -Inf) at different positions"))
    # samples
    gs, ls = g.sample_values(), lf.sample_values()
    v.sampled = int(gs.numel())
    if elem is not None and v.sampled:
        bad = _sample_mismatches(gs, ls, *elem)
        pos = g.positions
        for i in bad:
            flat = pos[i]
            v.mismatches.append(SampleMismatch(flat, _unravel(flat, g.shape), _py(gs[i]), _py(ls[i])))
        if v.mismatches:
            m = v.mismatches[0]
            failures.append(("sample", f"{len(bad)} of {v.sampled} sampled elements outside tolerance (certain); "
                                       f"first at {list(m.index)}: golden {m.golden!r}, live {m.live!r}"))
    # finite max / min: an element-wise tolerance bounds how far they can move
    if elem is not None and g.count and lf.count:
        rtol, atol = elem
        big = max(abs(g.min), abs(g.max)) * (math.sqrt(2.0) if g.is_complex else 1.0)
        for name, gv, lv in (("max", g.max, lf.max), ("min", g.min, lf.min)):
            mag = abs(gv) if (rtol <= 1.0 and not g.is_complex) else big
            allowed = _up((atol + rtol * mag) * TOL_SLACK + _elem_eps(g, lf))
            if abs(lv - gv) > allowed:
                failures.append((name, f"the {name}imum moved from {gv:.7g} to {lv:.7g}, by {abs(lv - gv):.3g} > "
                                       f"{allowed:.3g}, impossible if every element were within tolerance (certain)"))
    # sum: exact up to float64 rounding of both sums
    depth = max(g.depth, lf.depth)
    round_sum = _up(gamma(depth + 1) * (_inflated_abs(g) + _inflated_abs(lf)))
    v.sum_diff = abs(lf.sum - g.sum)
    v.sum_bound = _up(sum_bound + round_sum)
    if math.isfinite(v.sum_bound) and v.sum_diff > v.sum_bound:
        failures.append(("sum", f"the sum moved from {g.sum:.7g} to {lf.sum:.7g}, by {v.sum_diff:.3g} > "
                                f"{v.sum_bound:.3g}, impossible if every element were within tolerance (certain)"))
    # sketch
    _sketch(g, lf, v, bound, depth, failures, rms)
    if failures:
        check, sentence = failures[0]
        v.status = "nonfinite" if check == "nonfinite" else "diverged"
        v.check = check
        v.reason = sentence
        v.detail = sentence if check == "sketch" else f"{sentence}; {_sketch_phrase(v, rms)}"
    else:
        v.detail = f"{_sketch_phrase(v, rms)}; {v.sampled} sampled elements within tolerance"
    if v.note:
        v.detail += f" ({v.note})"
    return v


def _sketch(g: Fingerprint, lf: Fingerprint, v: FingerprintVerdict, bound: float, depth: int,
            failures: list[tuple[str, str]], rms: bool) -> None:
    p = g.params
    eps = _up(gamma(depth + 2) * (_inflated_abs(g) + _inflated_abs(lf)))
    norms = _row_norms(np.asarray(lf.sketch, dtype=np.float64) - np.asarray(g.sketch, dtype=np.float64))
    v.estimate = float(np.median(norms))
    # a computed row norm above this proves the exact one exceeds c * bound (docs/fingerprint.md)
    v.threshold = _up((p.multiplier * bound + eps) * (1.0 + U) * (1.0 + gamma(p.buckets + 4)))
    if not (math.isfinite(v.threshold) and np.isfinite(norms).all()):
        v.note = "the sketch is not usable: sums overflow float64"
        return
    v.rows_over = int((norms > v.threshold).sum())
    if v.rows_over >= p.rows // 2 + 1:
        failures.append(("sketch", _sketch_phrase(v, rms) + f" ({v.rows_over} of {p.rows} rows over the threshold "
                                   f"{_scaled(v.threshold, v, rms):.2e}; a run within tolerance fails this with "
                                   f"probability <= {v.false_alarm:.1g})"))


def _scaled(x: float, v: FingerprintVerdict, rms: bool) -> float:
    return x / math.sqrt(v.numel) if rms and v.numel else x


def _sketch_phrase(v: FingerprintVerdict, rms: bool) -> str:
    if rms:
        return (f"estimated RMS error {_scaled(v.estimate, v, rms):.2e}, allowance {_scaled(v.bound, v, rms):.2e} "
                "(sketch)")
    return f"estimated ||diff||_2 {v.estimate:.2e}, bound {v.bound:.2e} (sketch)"


def _sample_mismatches(g: torch.Tensor, lv: torch.Tensor, rtol: float, atol: float) -> list[int]:
    """Indices of samples failing the comparator's element rule (same NaN/Inf at the same place ok)."""
    ok = element_rule(g, lv, pair_dtype(g.dtype, lv.dtype), rtol, atol)[-1]
    return [int(i) for i in torch.nonzero(~ok).view(-1)]


def _py(x: torch.Tensor) -> Any:
    val = x.to(torch.complex128 if x.dtype.is_complex else torch.float64).item()
    return complex(val) if isinstance(val, complex) else float(val)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(flat % s)
        flat //= s
    return tuple(reversed(out))

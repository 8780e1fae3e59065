"""Calibrated tolerances: judge a live-vs-golden difference against both runs' own numerical noise.

A float32 (or TF32, bf16, fp16) forward differs from the exact result by rounding noise that
depends on the kernels used. Each run's noise is measured the same way: the model is deep-copied
to float64 and run on the same inputs (the *shadow* forward), and per layer call and output the
run's error against that float64 reference is kept as a *noise floor* (max abs and RMS).

The rule (see docs/cross-device.md) is adapted from the float64-reference check that PyTorch's
compiler uses for accuracy (``torch._dynamo.utils.same``)::

    RMSE(res, fp64) <= m * RMSE(ref, fp64) + tol / 10

Here both sides have a floor, and the live-vs-golden error itself is judged::

    err(live, golden) <= m * (floor(golden) + floor(live)) + ABS_TERM * min(1, RMS(golden))   (max-abs, RMS)

By the triangle inequality ``|live - golden| <= |live - ref| + |ref - golden|`` this holds with
``m = 1`` whenever the two float64 references agree, i.e. whenever the model computes the same
function: noise alone can never fail it. A real change (weights, epsilon, activation) moves the
float64 reference itself, and the error at that layer exceeds the floors. ``m`` is a safety
margin for references that differ slightly (float32 segments inside model code, float64 kernels
of another device); the constants are Dynamo's.

The golden's floors are stored in its meta JSON under ``META_KEY`` (``record(calibrate=True)``);
the live floors are measured during ``compare(tolerance="calibrated")``.

About 450 lines, over the ~400 we aim for: the one decision (:meth:`CalibratedJudge.decide`), the
allowance, the verdict and the scales it needs (the values' RMS, the plausibility of a floor, the
absolute term) are one rule, kept together so that full values, fingerprints and replays judge
alike; the float64 run is :mod:`.shadow`, replays' own floors :mod:`.ownfloor`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import numpy as np
import torch

from .._core import native
from .._core.devices import golden_on, stats_device, to_device
from .._core.kernel import CHUNK, compare_tensors
from ..judges.strict import PRECISION, LeafContext, StrictJudge
from ..options.selection import few
from ..options.tolerances import Tolerance
from ..results import LeafResult, leaf_from_stats
from ..store.floors import (
    ABS_TERM,
    CALIBRATED_DTYPES,
    FORMAT_VERSION,
    META_KEY,
    MULTIPLIER,
    MULTIPLIER_REDUCED,
    MULTIPLIER_SMALL,
    REDUCED_DTYPES,
    SMALL_NUMEL,
    FloorTable,
    NoiseFloor,
    compiled_diff,
    diff_stats,
    multiplier,
    rule_text,
)
from .shadow import ShadowRun

__all__ = [
    "ABS_TERM", "CALIBRATED_DTYPES", "CHUNK", "DIFFERS_KEY", "FORMAT_VERSION", "META_KEY", "MULTIPLIER",
    "MULTIPLIER_REDUCED", "MULTIPLIER_SMALL", "REDUCED_DTYPES", "SMALL_NUMEL", "CalibratedJudge", "FloorTable",
    "NoiseFloor", "ShadowRun", "diff_stats", "multiplier", "rule_text",
]


# --------------------------------------------------------------------------- judging


LiveFloors = Callable[[NoiseFloor], tuple[NoiseFloor, "NoiseFloor | None"]]
"""Given the golden's floor of an output: the golden's and the live floors the rule weighs."""


@dataclass(frozen=True)
class Decision:
    """Which rule judges one output, and with what (:meth:`CalibratedJudge.decide`)."""

    tolerance: Tolerance  # the strict rule's numbers, used when not calibrated
    source: str  # the strict rule's tolerance source, saying why it judged
    calibrated: bool = False
    golden_floor: NoiseFloor | None = None
    live_floor: NoiseFloor | None = None  # None for a bit-identical value


@dataclass(frozen=True)
class Allowance:
    """The calibrated rule's allowance for one output: ``m x (golden floor + live floor) + absolute``."""

    multiplier: float
    max_abs: float
    rms: float


def allowance(golden_dtype: str, live_dtype: str, numel: int, gf: NoiseFloor, lf: NoiseFloor,
              absolute: float) -> Allowance:
    """The allowance for floors ``gf``/``lf``; ``m`` follows the lower-precision side's dtype."""
    low = golden_dtype if PRECISION.get(golden_dtype, 0) < PRECISION.get(live_dtype, 0) else live_dtype
    m = multiplier(low, numel)
    return Allowance(m, m * (gf.max_abs + lf.max_abs) + absolute, m * (gf.rms + lf.rms) + absolute)


class CalibratedJudge:
    """The calibrated rule behind the :class:`~activation_guard.judges.strict.Judge` protocol.

    What explicit numbers mean here (docs/architecture.md): a layer matched by a ``tolerances``
    pattern is judged strictly with that pattern's numbers (the user named that layer, so the
    user's numbers win), and the report's tolerance source says so; integer and bool outputs
    compare exactly; float outputs without a noise floor on either side fall back to the strict
    rule, whose numbers are the ``rtol``/``atol`` options when given. The report's notes count
    each case, so no option is ever silently ignored.
    """

    def __init__(self, golden: FloorTable, shadow: ShadowRun, strict: StrictJudge):
        self.golden = golden
        self.shadow = shadow
        self.strict = strict
        self.fallbacks: list[str] = []
        self.explicit: dict[str, int] = {}  # tolerances pattern -> outputs it judged strictly
        self.judged = 0
        self._rms: torch.Tensor | None = None  # the goldens' RMS: one float64 buffer, the largest output's

    def _rms_buffer(self, golden: torch.Tensor) -> torch.Tensor | None:
        """A float64 buffer of ``golden``'s size on its device, reused from output to output: a
        fresh one per output cost its page faults (about the squaring's own time)."""
        n = golden.numel()
        if golden.is_complex() or n == 0:
            return None
        if self._rms is None or self._rms.numel() < n or self._rms.device != golden.device:
            self._rms = None  # the old buffer goes before the larger one comes
            self._rms = torch.empty(n, dtype=torch.float64, device=golden.device)
        return self._rms[:n]

    def decide(self, ctx: LeafContext, live: LiveFloors | None, scale: Callable[[], float | None] | None = None, *,
               golden_floor: NoiseFloor | EllipsisType | None = ..., tally: bool = True) -> Decision:
        """The one place the calibrated rule decides which rule judges an output, and with which floors.

        In order: outputs of a dtype without floors (integers, bools: exactly; complex32: strictly, noted) and
        outputs a ``tolerances`` pattern names are judged strictly; then the golden's floor (``golden_floor``,
        else the one recorded for ``ctx``), and ``live(golden floor)`` gives the two floors the rule weighs
        (a floor widened by the rounding a value was stored with; the live one None when there is no finite
        one), unless ``live`` is None (a bit-identical value: no error to weigh); floors the values' RMS
        (``scale()``) says cannot be rounding are not used. Any missing floor: strictly, noted. ``tally``
        counts the decision in this judge's notes (a replay's check of a child's inputs does not)."""
        tol = self.strict.tolerance(ctx)
        gdt, ldt = ctx.golden_dtype, ctx.live_dtype
        if gdt not in CALIBRATED_DTYPES or ldt not in CALIBRATED_DTYPES:
            if "complex" in gdt or "complex" in ldt:  # not silently: the report lists them
                return self._strict(ctx, tol, "complex values have no noise floor",
                                    "complex values have no noise floor", tally)
            return Decision(tol, tol.source)
        if tol.rule is not None:
            if tally:
                self.explicit[tol.rule.pattern] = self.explicit.get(tol.rule.pattern, 0) + 1
            return Decision(tol, f"{tol.source}; strict: a tolerances pattern overrides calibration")
        gf = self.golden.get(ctx.golden_name, ctx.call, ctx.path) if golden_floor is ... else golden_floor
        if gf is None:
            return self._strict(ctx, tol, "no noise floor", "the golden has no finite noise floor", tally)
        if live is None:
            return self._calibrated(tol, gf, None, tally)
        gf, lf = live(gf)
        if lf is None:
            return self._strict(ctx, tol, "no noise floor", "the live float64 shadow gave no finite noise floor",
                                tally)
        rms = None if scale is None else scale()
        odd = None if rms is None else floor_beyond_rounding(rms, gf, lf, gdt)
        if odd is not None:  # the float64 reference computed something else: its floors measure that
            return self._strict(ctx, tol, "implausible noise floor", odd, tally)
        return self._calibrated(tol, gf, lf, tally)

    def _strict(self, ctx: LeafContext, tol: Tolerance, why: str, fallback: str, tally: bool) -> Decision:
        if tally:
            self.fallbacks.append(f"{_where(ctx)}: {fallback}")
        return Decision(tol, f"{tol.source}; strict: {why}")

    def _calibrated(self, tol: Tolerance, gf: NoiseFloor, lf: NoiseFloor | None, tally: bool) -> Decision:
        if tally:
            self.judged += 1
        return Decision(tol, tol.source, calibrated=True, golden_floor=gf, live_floor=lf)

    def strict_verdict(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor,
                       decision: Decision) -> LeafResult:
        """The strict rule's verdict where :meth:`decide` chose it, its tolerance source saying why."""
        res = self.strict.judge_with(ctx, golden, live, decision.tolerance)
        res.tolerance_source = decision.source
        return res

    def judge(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        if _same_bits(golden, live):  # no error to weigh: neither floor nor allowance is needed
            return self.identical(ctx, live)
        err, rms = _error_and_rms(golden, live)  # one compiled pass for both, where it takes them
        fast: list[float | None] = [rms]  # the golden's RMS, taken once for the scale and the absolute term

        def scale() -> float | None:
            if fast[0] is None:
                fast[0] = _all_finite_rms(golden, self._rms_buffer(golden))
            return fast[0] if fast[0] is not None else _masked_rms(golden)

        d = self.decide(ctx, lambda gf: (gf, self.shadow.floor(ctx.name, ctx.call, ctx.path, live)), scale)
        if not d.calibrated:
            return self.strict_verdict(ctx, golden, live, d)
        assert d.golden_floor is not None and d.live_floor is not None
        return calibrated_verdict(ctx, golden, live, d.golden_floor, d.live_floor, fast[0], err)

    def identical_tolerance(self, name: str, dtype: str) -> None:
        return None  # it counts what it judged, in order, for its notes

    def identical(self, ctx: LeafContext, live: torch.Tensor, view: np.ndarray | None = None) -> LeafResult:
        res = self.strict.identical(ctx, live, view)
        d = self.decide(ctx, None)
        res.tolerance_source = d.source
        if d.calibrated:  # bit-identical: no error to weigh against the floors
            res.error_multiple = 0.0
            res.rtol, res.atol = 0.0, 0.0
            res.tolerance_source = "calibrated: bit-identical to the golden"
        return res

    def notes(self) -> list[str]:
        """Report notes: the calibrated rule, and every output some other rule judged."""
        out = [f"calibrated tolerances: error <= m x (golden floor + live floor) + {ABS_TERM:g} x min(1, the values' "
               f"RMS), m = "
               f"{MULTIPLIER:g} ({MULTIPLIER_REDUCED:g} for half types and outputs under {SMALL_NUMEL} elements); "
               f"float64 reference on {self.shadow.device}; {self.judged} outputs judged"]
        for pat, n in self.explicit.items():
            out.append(f"tolerances[{pat!r}] judged {n} output(s) strictly with its own numbers (explicit "
                       f"per-layer tolerances override calibration)")
        diff = differs_note(self.golden.info.get(DIFFERS_KEY), self.shadow.differs)
        if diff:
            out.append(diff)
        if self.fallbacks:
            shown = few(self.fallbacks, sep="; ", show=str)
            out.append(f"{len(self.fallbacks)} outputs had no noise floor and used strict tolerances ({shown})")
        spec = self.strict.resolver.spec
        given = [k for k in ("rtol", "atol") if getattr(spec, k) is not None]
        if given:
            what = "/".join(given)
            out.append(f"{what} ({spec.source(given[0])}) apply only to outputs judged strictly "
                       f"({len(self.fallbacks)} without a noise floor); calibrated outputs are judged by their floors")
        return out

    def close(self) -> None:
        self._rms = None
        self.shadow.close()


DIFFERS_KEY = "computes_differently"  # calibration meta: [[layer, call, departure share], ...]


def differs_note(golden: Any, live: list[tuple[str, int, float]]) -> str | None:
    """The note naming the leaf calls whose float64 copy computes another function than the run's
    dtype (golden's record and live shadow): their low-precision result stood in for the float64
    one, so later floors measure rounding only. ``golden`` is the meta's list, validated here."""
    seen: dict[tuple[str, int], float] = {}
    rows = golden if isinstance(golden, list) else []
    for row in [*rows, *live]:
        if (isinstance(row, (list, tuple)) and len(row) == 3 and isinstance(row[0], str)
                and isinstance(row[1], int) and isinstance(row[2], (int, float))):
            key = (row[0], row[1])
            seen[key] = max(seen.get(key, 0.0), float(row[2]))
    if not seen:
        return None
    shown = few([f"{n or '<root>'!r}[{c}] ({r:.2%} of its RMS)" for (n, c), r in seen.items()], show=str)
    return (f"{len(seen)} layer call(s) whose float64 copy computes differently from the run's dtype on the same "
            f"inputs, beyond rounding ({shown}: an epsilon from torch.finfo(dtype), a branch on the dtype): "
            f"their own result stood in for the float64 reference, so later layers' floors measure rounding only")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(golden: torch.Tensor, live: torch.Tensor) -> bool:
    """Whether two real floating tensors hold the same bytes (what the comparator's fast path for
    small values checks): -0.0 is not 0.0, and a NaN is itself."""
    if (golden.dtype != live.dtype or golden.device != live.device or golden.shape != live.shape
            or not golden.is_floating_point() or golden.element_size() not in _BITS):
        return False
    bits = _BITS[golden.element_size()]
    return bool(torch.equal(golden.detach().view(bits), live.detach().view(bits)))


def _where(ctx: LeafContext) -> str:
    return f"{ctx.name or '<root>'}[{ctx.call}]{'/' + ctx.path if ctx.path else ''}"


def cast_rounding(x: torch.Tensor, dtype: torch.dtype) -> NoiseFloor:
    """How far rounding ``x`` to ``dtype`` moves it (max abs, RMS). A value the cast overflows
    (70000 to float16) gets no allowance: the element rule then meets a new inf where a finite
    value was, and fails it, instead of the whole tensor getting an infinite allowance."""
    low = x.to(dtype)
    over = torch.isinf(low) & torch.isfinite(x)
    if bool(over.any()):
        low = torch.where(over, x, low.to(x.dtype))
    return diff_stats(low, x)


def _ratio(err: float, allow: float) -> float:
    if err == 0:
        return 0.0
    return err / allow if math.isfinite(allow) else (math.inf if math.isinf(err) else 0.0)


# a noise floor above this share of the values' RMS is more than rounding gives (float32 rounding
# through a deep model stays near 1e-5 of it; bfloat16's own step is 0.4%)
PLAUSIBLE_FLOOR = {"float16": 0.1, "bfloat16": 0.1}
PLAUSIBLE_FLOOR_DEFAULT = 0.01


def implausible_floor(golden: torch.Tensor, gf: NoiseFloor, lf: NoiseFloor, dtype: str) -> str | None:
    """Why the floors cannot be rounding error, or None. A float64 reference run that drew other
    random numbers (a ``torch.Generator`` it shared, a draw it makes in float64) or branched on the
    dtype has floors the size of the values, and judging with them passes real changes (a 10% weight
    change passed). Such an output is judged strictly instead."""
    rms = values_rms(golden)
    return None if rms is None else floor_beyond_rounding(rms, gf, lf, dtype)


def _all_finite_rms(golden: torch.Tensor, buf: torch.Tensor | None = None) -> float | None:
    """The RMS of a real tensor whose every square is finite, else None: then both masked
    definitions below (:func:`values_rms`, :func:`abs_term`) keep every element. The compiled
    pass's one read gives it where it takes the tensor (its sum in fixed lanes: the masked
    definitions' value to the last bit or two); else the torch path, their value bit for bit (the
    same elements, in order, through the same reduction) without their masks and copies. ``buf``:
    a float64 tensor of ``golden``'s element count on its device for the torch path to square in
    (else a fresh copy): the reduction sees the same values in the same order."""
    g = golden.detach()
    if g.is_complex() or g.numel() == 0:
        return None
    lib = native.available() if g.device.type == "cpu" else None
    got = None if lib is None else lib.diff(g, None)  # the sum of squares in one read (fixed lanes)
    if got is not None and math.isfinite(got[1]):
        return math.sqrt(got[1] / g.numel())
    if (buf is not None and buf.numel() == g.numel() and buf.device == g.device and buf.dtype == torch.float64
            and buf.dim() == 1 and buf.is_contiguous()):
        buf.view(g.shape).copy_(g)  # in the values' logical order, as reshape(-1) below has them
        m = buf.square_().mean()
    else:
        m = g.to(torch.float64, copy=True).square_().reshape(-1).mean()  # one float64 buffer, squared in place
    return float(m.sqrt()) if bool(torch.isfinite(m)) else None


def values_rms(golden: torch.Tensor) -> float | None:
    """The RMS of the finite values (a complex value's magnitude), or None when there are none."""
    fast = _all_finite_rms(golden)
    return fast if fast is not None else _masked_rms(golden)


def _masked_rms(golden: torch.Tensor) -> float | None:
    """:func:`values_rms` where :func:`_all_finite_rms` found a value whose square is not finite
    (or a complex tensor): the RMS of the finite squares only."""
    g = golden.detach()
    # a complex value's scale is its magnitude: its real part alone (what a cast to float64 keeps)
    # is 0 for imaginary values, and a floor can never be implausible against a scale of 0
    sq = torch.view_as_real(g).to(torch.float64).square().sum(-1) if g.is_complex() else g.to(torch.float64).square()
    sq = sq[torch.isfinite(sq)]
    if sq.numel() == 0:
        return None
    return float(sq.mean().sqrt())


def floor_beyond_rounding(scale: float, gf: NoiseFloor, lf: NoiseFloor, dtype: str) -> str | None:
    """:func:`implausible_floor` given the values' RMS (a fingerprint holds it exactly)."""
    worst = max(gf.rms, lf.rms)
    limit = PLAUSIBLE_FLOOR.get(dtype, PLAUSIBLE_FLOOR_DEFAULT)
    if scale <= 0 or worst <= limit * scale:
        return None
    return (f"noise floor RMS {worst:.2e} is {worst / scale:.1%} of the values' RMS {scale:.2e}, more than rounding "
            f"gives: the float64 reference run computed something else (random numbers it does not share, a "
            f"branch on the dtype), so it was judged strictly")


def abs_term(golden: torch.Tensor, rms: float | None = None) -> float:
    """The rule's absolute term for these values: ``ABS_TERM`` times their RMS, at most
    ``ABS_TERM``. It covers the two float64 references' own difference, which is relative to the
    values; a fixed 1e-5 against activations of RMS 0.01 allowed 0.1% of them, and a GELU swapped
    for its tanh approximation (6e-6 there) passed under TF32. ``rms``: these values'
    :func:`_all_finite_rms`, when the caller has it."""
    fast = _all_finite_rms(golden) if rms is None else rms
    if fast is not None:
        return ABS_TERM * min(1.0, fast) if fast > 0 else ABS_TERM
    g = golden.detach()
    if g.is_complex():
        g = g.abs()
    g = g.to(torch.float64)
    g = g[torch.isfinite(g)]
    if g.numel() == 0:
        return ABS_TERM
    scale = float(g.square().mean().sqrt())
    return ABS_TERM * min(1.0, scale) if scale > 0 else ABS_TERM


def _error_and_rms(golden: torch.Tensor, live: torch.Tensor) -> tuple[NoiseFloor | None, float | None]:
    """``diff_stats(live, golden)`` and ``golden``'s :func:`_all_finite_rms`, from one read of both
    by the compiled pass (the same numbers it gives each alone); None for either it does not give."""
    if golden.numel() != live.numel():
        return None, None
    return compiled_diff(live.detach().reshape(-1), golden.detach().reshape(-1))


def calibrated_verdict(ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor,
                        gf: NoiseFloor, lf: NoiseFloor, rms: float | None = None,
                        err: NoiseFloor | None = None) -> LeafResult:
    """The calibrated rule's verdict on two tensors, given the floors :meth:`CalibratedJudge.decide` chose.
    ``rms``: ``golden``'s :func:`_all_finite_rms` when the caller took it (None: taken here if needed);
    ``err``: ``diff_stats(live, golden)`` when the caller took it."""
    gdt, ldt = ctx.golden_dtype, ctx.live_dtype
    shape = tuple(int(s) for s in live.shape)
    dev = stats_device(live)
    g = golden_on(golden, dev)
    lv = to_device(live.detach(), dev)
    if PRECISION.get(ldt, 0) < PRECISION.get(gdt, 0):
        # a result stored in a lower precision cannot be closer to the truth than rounding
        # it: a cast model's exactly computed outputs (an embedding lookup of rounded
        # weights) are off by that much with zero arithmetic noise
        rf = cast_rounding(g, lv.dtype)
        lf = NoiseFloor(lf.max_abs + rf.max_abs, lf.rms + rf.rms)
    elif PRECISION.get(gdt, 0) < PRECISION.get(ldt, 0):  # the reverse: the golden was stored rounded
        rf = cast_rounding(lv, g.dtype)
        gf = NoiseFloor(gf.max_abs + rf.max_abs, gf.rms + rf.rms)
    # the caller's RMS was taken where the golden is: on another device a reduction may round otherwise
    a = allowance(gdt, ldt, live.numel(), gf, lf, abs_term(g, rms if g.device == golden.device else None))
    allow_max, allow_rms = a.max_abs, a.rms
    if g.dtype != lv.dtype:
        g, lv = g.to(torch.float64), lv.to(torch.float64)
    st = compare_tensors(g, lv, 0.0, allow_max)
    # equal values (NaN is never equal) subtract to zeros: the statistics diff_stats would give
    if err is None:
        err = NoiseFloor(0.0, 0.0) if g.dtype == lv.dtype and torch.equal(g, lv) else diff_stats(lv, g)
    multiple = max(_ratio(err.max_abs, allow_max), _ratio(err.rms, allow_rms))
    res = leaf_from_stats(ctx.path, gdt, ldt, shape, st, 0.0, allow_max, rule_text(a.multiplier))
    res.error_multiple = multiple
    if multiple > 1 and res.status == "match":
        res.status = "diverged"
    if res.status != "match":
        which = "RMS" if err.rms / allow_rms >= err.max_abs / allow_max else "max abs"
        res.detail = (
            f"error is {multiple:.3g}x the calibrated allowance ({which}): max abs {err.max_abs:.2e} vs "
            f"{allow_max:.2e}, RMS {err.rms:.2e} vs {allow_rms:.2e}; noise floors golden "
            f"{gf.max_abs:.2e}/{gf.rms:.2e}, live {lf.max_abs:.2e}/{lf.rms:.2e} (max abs/RMS)"
        )
    if gdt != ldt:
        res.detail = (res.detail + "; " if res.detail else "") + f"dtype {gdt} -> {ldt} allowed"
    return res

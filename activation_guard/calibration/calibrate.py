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
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .._core.devices import golden_on, stats_device, to_device
from .._core.kernel import CHUNK, compare_tensors
from ..judges.strict import PRECISION, LeafContext, StrictJudge
from ..options.selection import few
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

    def judge(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        gdt, ldt = ctx.golden_dtype, ctx.live_dtype
        if gdt not in CALIBRATED_DTYPES or ldt not in CALIBRATED_DTYPES:  # integers, bools: exact; complex: strict
            if golden.is_complex() or live.is_complex():  # not silently: the report lists them
                self.fallbacks.append(f"{_where(ctx)}: complex values have no noise floor")
                res = self.strict.judge(ctx, golden, live)
                res.tolerance_source = f"{res.tolerance_source}; strict: complex values have no noise floor"
                return res
            return self.strict.judge(ctx, golden, live)
        tol = self.strict.tolerance(ctx)
        if tol.rule is not None:
            self.explicit[tol.rule.pattern] = self.explicit.get(tol.rule.pattern, 0) + 1
            res = self.strict.judge_with(ctx, golden, live, tol)
            res.tolerance_source = f"{tol.source}; strict: a tolerances pattern overrides calibration"
            return res
        gf = self.golden.get(ctx.golden_name, ctx.call, ctx.path)
        lf = None if gf is None else self.shadow.floor(ctx.name, ctx.call, ctx.path, live)
        if gf is None or lf is None:
            side = "the golden has" if gf is None else "the live float64 shadow gave"
            self.fallbacks.append(f"{_where(ctx)}: {side} no finite noise floor")
            res = self.strict.judge_with(ctx, golden, live, tol)
            res.tolerance_source = f"{tol.source}; strict: no noise floor"
            return res
        odd = implausible_floor(golden, gf, lf, ctx.golden_dtype)
        if odd is not None:  # the float64 reference computed something else: its floors measure that
            self.fallbacks.append(f"{_where(ctx)}: {odd}")
            res = self.strict.judge_with(ctx, golden, live, tol)
            res.tolerance_source = f"{tol.source}; strict: implausible noise floor"
            return res
        self.judged += 1
        return calibrated_verdict(ctx, golden, live, gf, lf)

    def identical_tolerance(self, name: str, dtype: str) -> None:
        return None  # it counts what it judged, in order, for its notes

    def identical(self, ctx: LeafContext, live: torch.Tensor, view: np.ndarray | None = None) -> LeafResult:
        res = self.strict.identical(ctx, live, view)
        if ctx.golden_dtype not in CALIBRATED_DTYPES:
            return res
        rule = self.strict.tolerance(ctx).rule
        if rule is not None:
            self.explicit[rule.pattern] = self.explicit.get(rule.pattern, 0) + 1
            res.tolerance_source = f"{res.tolerance_source}; strict: a tolerances pattern overrides calibration"
            return res
        if self.golden.get(ctx.golden_name, ctx.call, ctx.path) is None:
            self.fallbacks.append(f"{_where(ctx)}: the golden has no finite noise floor")
            res.tolerance_source = f"{res.tolerance_source}; strict: no noise floor"
            return res
        self.judged += 1  # bit-identical: no error to weigh against the floors
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
    g = golden.detach()
    # a complex value's scale is its magnitude: its real part alone (what a cast to float64 keeps)
    # is 0 for imaginary values, and a floor can never be implausible against a scale of 0
    sq = torch.view_as_real(g).to(torch.float64).square().sum(-1) if g.is_complex() else g.to(torch.float64).square()
    sq = sq[torch.isfinite(sq)]
    if sq.numel() == 0:
        return None
    return floor_beyond_rounding(float(sq.mean().sqrt()), gf, lf, dtype)


def floor_beyond_rounding(scale: float, gf: NoiseFloor, lf: NoiseFloor, dtype: str) -> str | None:
    """:func:`implausible_floor` given the values' RMS (a fingerprint holds it exactly)."""
    worst = max(gf.rms, lf.rms)
    limit = PLAUSIBLE_FLOOR.get(dtype, PLAUSIBLE_FLOOR_DEFAULT)
    if scale <= 0 or worst <= limit * scale:
        return None
    return (f"noise floor RMS {worst:.2e} is {worst / scale:.1%} of the values' RMS {scale:.2e}, more than rounding "
            f"gives: the float64 reference run computed something else (random numbers it does not share, a "
            f"branch on the dtype), so it was judged strictly")


def abs_term(golden: torch.Tensor) -> float:
    """The rule's absolute term for these values: ``ABS_TERM`` times their RMS, at most
    ``ABS_TERM``. It covers the two float64 references' own difference, which is relative to the
    values; a fixed 1e-5 against activations of RMS 0.01 allowed 0.1% of them, and a GELU swapped
    for its tanh approximation (6e-6 there) passed under TF32."""
    g = golden.detach()
    if g.is_complex():
        g = g.abs()
    g = g.to(torch.float64)
    g = g[torch.isfinite(g)]
    if g.numel() == 0:
        return ABS_TERM
    scale = float(g.square().mean().sqrt())
    return ABS_TERM * min(1.0, scale) if scale > 0 else ABS_TERM


def calibrated_verdict(ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor,
                        gf: NoiseFloor, lf: NoiseFloor) -> LeafResult:
    gdt, ldt = ctx.golden_dtype, ctx.live_dtype
    low = gdt if PRECISION.get(gdt, 0) < PRECISION.get(ldt, 0) else ldt
    shape = tuple(int(s) for s in live.shape)
    m = multiplier(low, live.numel())
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
    absolute = abs_term(g)
    allow_max = m * (gf.max_abs + lf.max_abs) + absolute
    allow_rms = m * (gf.rms + lf.rms) + absolute
    if g.dtype != lv.dtype:
        g, lv = g.to(torch.float64), lv.to(torch.float64)
    st = compare_tensors(g, lv, 0.0, allow_max)
    err = diff_stats(lv, g)
    multiple = max(_ratio(err.max_abs, allow_max), _ratio(err.rms, allow_rms))
    res = leaf_from_stats(ctx.path, gdt, ldt, shape, st, 0.0, allow_max, rule_text(m))
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

"""Judges: given a golden value, a live value and the spec, return a verdict with its numbers.

The comparator decides *which* values meet (layer names, calls, output paths, shapes, dtypes);
a judge decides whether two values that met are close enough, and records why. Keeping that
behind one small protocol is what lets new kinds of evidence plug in without touching the
comparator: the strict rule (rtol/atol), the calibrated rule (noise floors, in
:mod:`activation_guard.calibration.calibrate`), and any later one (fingerprints, replayed own errors).

A judge is built once per comparison and sees every leaf in execution order; it may keep notes
(``notes()``) that the report prints, and must release what it holds in ``close()``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from .._core.dtypes import BY_NAME, dtype_name, numpy_view
from .._core.kernel import compare_tensors
from ..options.tolerances import Tolerance, ToleranceResolver
from ..results import LeafResult, leaf_from_stats

# precision rank for allow_dtype_change: the lower precision's tolerance applies
PRECISION = {"float64": 4, "float32": 3, "float16": 2, "bfloat16": 1}


class LeafContext(NamedTuple):
    """Where a leaf sits: the live layer name, the golden name it is compared with (they differ
    under ``rename``), the call, the output path, and the two dtype names. (A named tuple: one is
    made per compared output, and a frozen dataclass cost ~1.5 us of that.)"""

    name: str
    golden_name: str
    call: int
    path: str
    golden_dtype: str
    live_dtype: str

    @property
    def label(self) -> str:
        return f"layer {self.name or '<root>'!r} call {self.call} output {self.path!r}"


class Judge(Protocol):
    """The verdict rule for tensors that met with the same shape (and an allowed dtype pair)."""

    def judge(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        """Compare ``live`` with ``golden``; ``golden`` may sit on another device."""
        ...

    def identical(self, ctx: LeafContext, live: torch.Tensor, view: np.ndarray | None = None) -> LeafResult:
        """The verdict for a live value whose bytes equal the golden's (the comparator's fast
        path: no golden tensor is built). ``view``: the live value's numpy view, when the caller
        has made one already."""
        ...

    def identical_tolerance(self, name: str, dtype: str) -> Tolerance | None:
        """The tolerance a bit-identical value of ``dtype`` in layer ``name`` (live) has its
        verdict name, when that verdict follows from it alone: the comparator then keeps the call
        as plain facts (this tolerance, the value's shape and first element) and builds its result
        only when a report reads it (:class:`~activation_guard.results.IdenticalCall`). None for a
        rule that must see every value as it comes (the calibrated one counts what it judged, for
        its notes)."""
        ...

    def notes(self) -> list[str]:
        """Lines for the report: the rule applied, what fell back to another rule."""
        ...

    def close(self) -> None: ...


def dtype_change_allowed(golden_dtype: str, live_dtype: str) -> bool:
    """``allow_dtype_change`` covers changes between floating precisions only."""
    return golden_dtype in PRECISION and live_dtype in PRECISION


class StrictJudge:
    """``|live - golden| <= atol + rtol * |golden|`` element-wise, with the numbers the spec's
    tolerances give this layer and dtype (integers and bools exactly)."""

    def __init__(self, resolver: ToleranceResolver):
        self.resolver = resolver

    def tolerance(self, ctx: LeafContext) -> Tolerance:
        gdt, ldt = ctx.golden_dtype, ctx.live_dtype
        if gdt != ldt and dtype_change_allowed(gdt, ldt):
            low = gdt if PRECISION[gdt] < PRECISION[ldt] else ldt
            tol = self.resolver.resolve(ctx.name, low, "float")
            return Tolerance(tol.rtol, tol.atol, tol.source + f" (dtype change {gdt}->{ldt})", tol.rule)
        return self._same_dtype(ctx.name, gdt)

    def _same_dtype(self, name: str, dtype: str) -> Tolerance:
        info = BY_NAME.get(dtype)
        return self.resolver.resolve(name, dtype, info.kind if info is not None else "float")

    def judge(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        tol = self.tolerance(ctx)
        return self.judge_with(ctx, golden, live, tol)

    def judge_with(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor, tol: Tolerance) -> LeafResult:
        changed = ctx.live_dtype != ctx.golden_dtype
        if changed:
            # in the wider of the two (float32 at least): casting a float64 side down to float32
            # would turn a finite 1e300 into inf and pass an inf that appeared on the other side
            wide = torch.promote_types(torch.promote_types(golden.dtype, live.dtype), torch.float32)
            golden, live = golden.to(wide), live.to(wide)
        st = compare_tensors(golden, live, tol.rtol, tol.atol)
        shape = tuple(int(s) for s in live.shape)
        res = leaf_from_stats(ctx.path, ctx.golden_dtype, ctx.live_dtype, shape, st, tol.rtol, tol.atol, tol.source)
        if changed:
            res.detail = (f"dtype {ctx.golden_dtype} -> {ctx.live_dtype} allowed "
                          f"(compared in {dtype_name(golden)})")
        return res

    def identical(self, ctx: LeafContext, live: torch.Tensor, view: np.ndarray | None = None) -> LeafResult:
        arr = view if view is not None else numpy_view(live)
        if arr is not None:  # shape, size and first element from numpy: ~2x faster than from torch
            shape = arr.shape
            first = arr.item(0) if arr.size else None
        else:
            shape = tuple(live.shape)
            first = live.detach().reshape(-1)[0].item() if live.numel() else None
        return identical_leaf(ctx, shape, first, self.tolerance(ctx))

    def identical_tolerance(self, name: str, dtype: str) -> Tolerance | None:
        return self._same_dtype(name, dtype)

    def notes(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def identical_leaf(ctx: LeafContext, shape: tuple[int, ...], first: Any, tol: Tolerance) -> LeafResult:
    """The verdict on a value bit-identical to its golden: zero differences, its first element
    as the worst, the tolerance that was in force. Built from plain values only, so that a
    deferred row (:class:`~activation_guard.results.IdenticalCall`) holds no judge, spec or model."""
    numel = math.prod(shape)
    return LeafResult(
        ctx.path, "match", dtype=ctx.golden_dtype, live_dtype=ctx.live_dtype, shape=shape, live_shape=shape,
        numel=numel, max_abs_diff=0.0, max_rel_diff=0.0,
        index=(0,) * len(shape) if numel else None, golden_value=first, live_value=first,
        rtol=tol.rtol, atol=tol.atol, tolerance_source=tol.source,
    )

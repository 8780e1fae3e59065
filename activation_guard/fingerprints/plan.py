"""Prepared compiled fingerprints: one C call and a few numpy reads per leaf.

The general kernel (:func:`activation_guard.fingerprints.sketch.run_kernel`) walks a leaf in Python, chunk by
chunk, with a dozen small torch ops. On the fingerprint worker thread each of those ops releases
the GIL and takes it back, and every time the forward's thread then wants it, it waits for the
worker's Python to finish plus a thread wake-up: on GPT-2 small that cost the forward more than
the kernel itself (docs/performance.md). A :class:`LeafPlan` is built once per (dtype, size,
parameters, chunk): the leaf's hash tables, sample positions, rounding depth and the compiled
call's fixed arguments. Then a leaf costs one ctypes call (``ag_leaf``, the GIL released) and
numpy reads, with no torch op. The same bits as the general path: the same C chunk function, hash
tables, fold rule and sample positions.

A plan applies to a contiguous, unconjugated, unnegated, aligned CPU leaf (a plain
``torch.Tensor`` whose storage holds its elements) of float32, float64, complex64 or complex128
with at most ``LEAF_ELEMENTS`` real values, whose hash tables fit a quarter of ``PLAN_BUDGET``,
where the compiled pass is available (:mod:`activation_guard._core.native`); everything else takes
the general path.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._core import native
from .._core.lru import ByteLRU
from .._core.native import Native
from . import sketch
from .params import FingerprintParams
from .sketch import (
    KernelResult,
    _constants,
    _sample_array,
    block_hashes,
    fold_first,
    rounding_depth,
    storage_holds,
    workspace,
)

LEAF_ELEMENTS = 1 << 22  # real values: hash tables of ~1.25 bytes per value at 5 x 64 (5 MB at the limit)
PLAN_BUDGET = 32 << 20  # bytes of hash tables the cached plans may hold
_CPU = torch.device("cpu")
_REAL: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.float32, 1), torch.float64: (torch.float64, 1),
    torch.complex64: (torch.float32, 2), torch.complex128: (torch.float64, 2),
}


def window_counts(n: int, chunk: int, buckets: int, flush: int) -> tuple[int, int]:
    """(folds, widest window in blocks) of ``sketch._Sketcher._reserve`` over ``n`` values."""
    window = widest = folds = 0
    for off in range(0, n, chunk):
        K = -(-min(chunk, n - off) // buckets)
        if fold_first(window, K, flush):
            folds, window = folds + 1, 0
        window += K
        widest = max(widest, window)
    return folds + (1 if window else 0), widest


class LeafPlan:
    """The compiled fingerprint of any leaf of one real dtype and size (see the module docstring)."""

    __slots__ = (
        "_args",
        "_keep",
        "chunk",
        "depth",
        "fast",
        "flush",
        "folds",
        "n",
        "nbytes",
        "npos",
        "numel",
        "params",
        "per",
        "real_dtype",
        "widest",
    )

    def __init__(self, fast: Native, dtype: torch.dtype, numel: int, params: FingerprintParams, chunk: int):
        real_dtype, per = _REAL[dtype]
        R, B = params.rows, params.buckets
        n = numel * per
        if not (0 < n <= LEAF_ELEMENTS and 0 < B <= 4096 and R > 0 and chunk >= B and chunk % B == 0):
            raise ValueError(f"no compiled plan for {numel} elements of {dtype} with {params} and chunk {chunk}")
        K = -(-n // B)
        w, route = block_hashes(params.seed, R, B, _CPU, 0, K)
        u = _constants(params.seed, R, B, _CPU)[1]
        pos = _sample_array(params.seed, numel, params.samples, per)
        # the C side trusts these: checked here once, each run checks only the data it is given
        ok = (w.dtype == torch.float64 and w.stride(1) == 1 and w.shape[0] == R and w.shape[1] >= K + B - 1
              and route.dtype == torch.int64 and route.stride(1) == 1 and route.shape[0] == R
              and route.shape[1] >= K and int(route.min()) >= 0 and int(route.max()) < R * 2 * B
              and u.dtype == torch.float64 and u.is_contiguous() and u.numel() == R * B
              and pos.dtype == np.int64 and pos.flags.c_contiguous
              and (pos.size == 0 or (int(pos.min()) >= 0 and int(pos.max()) < n)))
        if not ok:
            raise ValueError("fingerprint plan: hash tables or sample positions of the wrong shape")
        self.fast, self.params, self.chunk = fast, params, chunk
        self.real_dtype, self.per, self.numel, self.n = real_dtype, per, numel, n
        self.npos = int(pos.size)
        self.flush = sketch.FLUSH_BLOCKS  # read now (tests lower it), and part of the plan's key
        self.folds, self.widest = window_counts(n, chunk, B, self.flush)
        self.depth = rounding_depth(self.widest, self.folds, B, min(chunk, n), -(-n // chunk))
        self._keep = (w, route, u, pos)
        self.nbytes = w.numel() * 8 + route.numel() * 8 + pos.nbytes
        self._args = (fast.simd, int(real_dtype == torch.float64), n, chunk, self.flush, R, B, w.data_ptr(),
                      w.stride(0), route.data_ptr(), route.stride(0), u.data_ptr(), pos.ctypes.data, self.npos)

    def run(self, ptr: int) -> KernelResult | None:
        """The kernel result for the ``n`` contiguous real values at address ``ptr`` (the caller
        guarantees they are there: ``compute_fingerprint`` and ``fingerprint_buffer`` check), or None
        when they hold NaN or Inf (the masked torch pass then counts them)."""
        simd, f64, n, chunk, flush, R, B, w, ws_, route, rs, u, pos, npos = self._args
        space = workspace(_CPU, R, B, self.chunk)  # this thread's routing matrix and scratch
        out = np.empty(7 + npos + R * B)
        self.fast.leaf_fn(simd, f64, ptr, n, chunk, flush, R, B, w, ws_, route, rs, space.route.data_ptr(), u,
                          space.a.data_ptr(), pos, npos, out.ctypes.data)
        info = out[5:7].view(np.int64)
        if int(info[0]) != self.folds or int(info[1]) != self.widest:  # a library that folds elsewhere
            raise RuntimeError(f"the compiled fingerprint pass folded {info.tolist()}, expected "
                               f"{[self.folds, self.widest]}: {native.status()}")
        total = float(out[0])
        if not math.isfinite(total):
            return None
        return KernelResult(
            sum=total, abs_sum=float(out[1]), sq_sum=float(out[2]), min=float(out[3]), max=float(out[4]),
            sketch=out[7 + npos:].reshape(R, B).copy(), counts=(0, 0, 0), hashes=(0,) * 6,
            samples=out[7 : 7 + npos].view(np.int64).copy(), depth=self.depth, all_finite=True,
        )


# plans by (library, dtype, numel, the kernel's parameters, chunk)
PLANS: ByteLRU[LeafPlan] = ByteLRU(PLAN_BUDGET)


def plan_for(dtype: torch.dtype, numel: int, params: FingerprintParams, chunk: int) -> LeafPlan | None:
    """The plan for a contiguous CPU leaf of this dtype and size, or None where the general path
    runs: also when the plan's hash tables would take more than a quarter of the budget (many rows
    of few buckets: a plan that is never kept would be rebuilt for every leaf)."""
    if dtype not in _REAL or not 0 < numel * _REAL[dtype][1] <= LEAF_ELEMENTS:
        return None
    K = -(-numel * _REAL[dtype][1] // params.buckets)
    if params.rows * (2 * K + params.buckets - 1) * 8 > PLAN_BUDGET // 4:
        return None
    fast = native.get()
    if fast is None:
        return None
    key = (fast, dtype, numel, params.seed, params.rows, params.buckets, params.samples, chunk, sketch.FLUSH_BLOCKS)
    plan = PLANS.get(key)
    if plan is None:
        plan = LeafPlan(fast, dtype, numel, params, chunk)  # outside the lock: torch ops (two threads may both build)
        PLANS.put(key, plan, plan.nbytes)
    return plan


def in_order(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values in logical order, as a plan reads them: a plain,
    contiguous, aligned CPU tensor of a plan's dtype, not lazily conjugated or negated. Says
    nothing of its storage: :func:`takes` adds that check."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu" and t.dtype in _REAL
            and t.is_contiguous() and not t.is_conj() and not t.is_neg() and t.data_ptr() % t.element_size() == 0)


def takes(t: torch.Tensor) -> bool:
    """Whether a plan can read ``t``: its values in order (:func:`in_order`) at a real pointer
    into storage that holds them all."""
    return in_order(t) and storage_holds(t)

"""The numeric comparison kernel: two same-shape tensors in, mismatch statistics out.

The kernel is chunked and fused: each chunk (a few hundred KB, cache resident) is checked with
``|live - golden|.max() <= atol``, which decides most passing chunks in two cheap ops; only
chunks that fail that test pay for the exact ``|d| <= atol + rtol*|g|`` rule, NaN/Inf handling
and the worst-element search. (``torch.isclose`` ran at ~80 MB/s here; this runs near memory
bandwidth.) On the CPU a passing chunk's largest difference and its position come from one numpy
``argmax`` (as fast as ``max``; torch's ``argmax`` and ``max(dim)`` are not vectorized and cost 5-10x
``max``), so a passing tensor is read once, not searched again for the element a report shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import devices

CHUNK = 1 << 18


@dataclass
class TensorStats:
    numel: int
    mismatched: int = 0
    nonfinite_new: int = 0
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    worst_flat: int | None = None
    golden_value: Any = None
    live_value: Any = None


# dtypes torch.equal supports on CPU (it raises for float8 and complex32)
_EQUAL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}


def _compute_dtype(dt: torch.dtype) -> torch.dtype:
    if dt.is_complex:
        return torch.complex128 if dt == torch.complex128 else torch.complex64
    if dt.is_floating_point:
        return torch.float64 if dt == torch.float64 else torch.float32
    return torch.float64


def pair_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype two sides are compared in: the wider's, complex if either is (a float64 golden
    against a complex64 run must not drop the imaginary part). The fingerprint's sampled check
    uses it too, so both evaluate the element rule in one precision."""
    if a.is_complex or b.is_complex:
        return torch.complex128 if {a, b} & {torch.float64, torch.complex128} else torch.complex64
    return _compute_dtype(a if a.itemsize >= b.itemsize else b)


def compare_tensors(golden: torch.Tensor, live: torch.Tensor, rtol: float, atol: float, *,
                    one_pass: bool = True) -> TensorStats:
    """Compare two same-shape tensors. ``golden`` may live on another device than ``live``.

    Integer and bool tensors compare exactly; floats by ``|live - golden| <= atol + rtol*|golden|``
    with NaN matching NaN and an infinite golden matched only by the same infinity.
    ``one_pass=False`` finds a passing tensor's largest difference by a second search of its chunk
    (the reference the one-pass search is tested against; the results are the same)."""
    live = live.detach()
    golden = devices.golden_on(golden, live.device)
    g = golden.reshape(-1)
    lv = live.reshape(-1)
    if lv.is_conj():
        lv = lv.resolve_conj()
    if lv.is_neg():
        lv = lv.resolve_neg()
    n = g.numel()
    st = TensorStats(numel=n)
    if n == 0:
        return st
    if not (g.dtype.is_floating_point or g.dtype.is_complex):
        return _compare_exact(g, lv, st)
    if g.dtype == lv.dtype and g.dtype in _EQUAL_DTYPES and torch.equal(g, lv):
        # the usual case (same code, same inputs): one pass, stopping at the first difference
        # otherwise. NaN != NaN here, so goldens holding NaN take the chunked path below.
        st.worst_flat = 0
        st.golden_value = _item(g[0])
        st.live_value = _item(lv[0])
        return st
    cdt = pair_dtype(g.dtype, lv.dtype)
    worst_d = -1.0
    max_abs = 0.0
    max_rel = 0.0
    best_m, best_i = -1.0, 0  # the chunk holding the largest difference, if nothing mismatches
    best_j: int | None = None  # the largest difference's place in that chunk, when its pass found it
    whole = n <= CHUNK  # one chunk: the tensors themselves, not slices of them
    for i in range(0, n, CHUNK):
        gc = g if whole else g[i : i + CHUNK]
        lc = lv if whole else lv[i : i + CHUNK]
        gc = gc if gc.dtype == cdt else gc.to(cdt)  # (.to returns the tensor itself when it is cdt)
        lc = lc if lc.dtype == cdt else lc.to(cdt)
        d = (lc - gc).abs()
        m, j = _max_at(d, one_pass)
        if m == math.inf and cdt in _WIDER and bool((torch.isinf(d) & torch.isfinite(gc) & torch.isfinite(lc)).any()):
            # two finite float32 values whose difference overflows (3e38 vs -3e38): it is 6e38, not inf
            gc, lc = g[i : i + CHUNK].to(_WIDER[cdt]), lv[i : i + CHUNK].to(_WIDER[cdt])
            d = (lc - gc).abs()
            m = float(d.max())
            j = None  # (the position is searched as in cdt, below, as it always was)
        if m <= atol and m != math.inf:  # False for NaN: falls through to the exact rule
            max_abs = max(max_abs, m)
            if m > best_m:
                best_m, best_i, best_j = m, i, j
            if m > 0:
                r = gc.abs()
                torch.div(d, r, out=r)  # 0/0 -> NaN -> 0 below; d/0 -> inf is kept
                max_rel = max(max_rel, _max_not_nan(r, one_pass))
            continue
        gc, lc, d, ga, eq, ok = element_rule(g[i : i + CHUNK], lv[i : i + CHUNK], cdt, rtol, atol)
        bad = ~ok
        nb = int(bad.sum())
        fin_d = torch.where(eq, torch.zeros_like(d), d)
        fin_d = torch.nan_to_num(fin_d, nan=math.inf, posinf=math.inf)  # keep inf, not float max
        cm = float(fin_d.max())
        max_abs = max(max_abs, cm)
        if cm > best_m:
            best_m, best_i, best_j = cm, i, None
        r = fin_d / ga
        r = torch.where(fin_d == 0, torch.zeros_like(r), r)
        max_rel = max(max_rel, float(torch.nan_to_num(r, nan=math.inf, posinf=math.inf).max()))
        if nb:
            st.mismatched += nb
            newnf = ~torch.isfinite(lc) & torch.isfinite(gc)
            st.nonfinite_new += int(newnf.sum())
            score = torch.where(bad, fin_d, torch.full_like(fin_d, -1.0))
            j = int(score.argmax())
            sj = float(score[j])
            if sj > worst_d:
                worst_d = sj
                st.worst_flat = i + j
    st.max_abs_diff = max_abs
    st.max_rel_diff = max_rel
    if st.worst_flat is None:
        # no mismatch: still point at the largest difference, it is what a reader wants to see;
        # searched only inside the chunk known to hold it (no second pass over the tensor)
        st.worst_flat = best_i
        if best_j is not None:
            st.worst_flat += best_j
        elif best_m > 0:
            st.worst_flat += _argmax_abs(g[best_i : best_i + CHUNK], lv[best_i : best_i + CHUNK], cdt)
    st.golden_value = _value_at(g, st.worst_flat)
    st.live_value = _value_at(lv, st.worst_flat)
    return st


def _value_at(t: torch.Tensor, k: int) -> Any:
    """``t[k].item()``, through numpy's view of a CPU tensor where it has one (a quarter of the cost)."""
    if t.dtype in _NUMPY_REAL and t.device.type == "cpu" and not t.requires_grad and not t.is_neg():
        return t.numpy()[k].item()
    return _item(t[k])


_WIDER = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def element_rule(g: torch.Tensor, lv: torch.Tensor, cdt: torch.dtype, rtol: float, atol: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``|live - golden| <= atol + rtol*|golden|`` element by element, in ``cdt`` (widened where
    ``cdt`` would overflow), as the comparator decides it; the fingerprint's sampled check calls
    this too, so a sample fails exactly when the comparator would fail it.

    NaN matches NaN (a complex number part by part) and an infinite golden only the same infinity;
    a live value that is not finite where the golden is never passes, whatever the tolerance (an
    infinite allowance must not accept a new inf). Returns the cast values, ``|d|``, ``|golden|``,
    the "same value" mask and the "within tolerance" mask."""
    gc, lc = g.to(cdt), lv.to(cdt)
    d, ga = (lc - gc).abs(), gc.abs()
    if d.numel() and math.isfinite(float(d.amax())) and (not cdt.is_complex or math.isfinite(float(ga.amax()))):
        # every difference finite: both sides are finite everywhere (an infinity or NaN on either
        # side makes the difference Inf or NaN), so the masks below reduce to this; a complex
        # modulus can still overflow (3e38+3e38j), which the widening below handles
        eq = gc == lc
        return gc, lc, d, ga, eq, (d <= atol + rtol * ga) | eq
    if cdt in _WIDER and bool(((torch.isinf(d) | torch.isinf(ga)) & torch.isfinite(gc) & torch.isfinite(lc)).any()):
        # two finite float32 values whose difference overflows (3e38 vs -3e38 is 6e38, not inf), or
        # the modulus of a finite complex64 (3e38+3e38j), which would make the tolerance inf
        gc, lc = g.to(_WIDER[cdt]), lv.to(_WIDER[cdt])
        d, ga = (lc - gc).abs(), gc.abs()
    eq = _same(gc, lc)
    ok = ((d <= atol + rtol * ga) & torch.isfinite(gc) & torch.isfinite(lc)) | eq
    return gc, lc, d, ga, eq, ok


def _same(gc: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
    """Equal, NaN matching NaN; a complex number part by part (``isnan`` of a complex is true when
    either part is NaN, which would let a NaN real part hide any change of the imaginary one)."""
    if gc.is_complex():
        return _same(gc.real, lc.real) & _same(gc.imag, lc.imag)
    return (gc == lc) | (torch.isnan(gc) & torch.isnan(lc))


def _item(x: torch.Tensor) -> Any:
    return x.item()


def _max_at(d: torch.Tensor, one_pass: bool) -> tuple[float, int | None]:
    """A chunk of differences' largest element (NaN when it holds one, as ``torch.max`` says) and,
    on the CPU, its first position from the same pass (numpy's ``argmax`` takes the first NaN, the
    first of equal maxima, as ``torch.argmax``); elsewhere the position is None (searched later,
    only if needed)."""
    if one_pass and d.device.type == "cpu" and not d.requires_grad and d.dtype in _NUMPY_REAL:
        a = d.numpy()
        j = int(a.argmax())
        return float(a[j]), j
    return float(d.max()), None


_NUMPY_REAL = {torch.float32, torch.float64}


def _max_not_nan(r: torch.Tensor, one_pass: bool) -> float:
    """The largest element of a non-negative tensor, NaN (0/0) counting as 0."""
    if one_pass and r.device.type == "cpu" and not r.requires_grad and r.dtype in _NUMPY_REAL:
        m = float(np.fmax.reduce(r.numpy()))  # one pass that skips NaN; NaN only when every element is
        return 0.0 if math.isnan(m) else m
    return float(r.nan_to_num_(nan=0.0, posinf=math.inf).max())


def _argmax_abs(g: torch.Tensor, lv: torch.Tensor, cdt: torch.dtype) -> int:
    best, where = -1.0, 0
    for i in range(0, g.numel(), CHUNK):
        d = (lv[i : i + CHUNK].to(cdt) - g[i : i + CHUNK].to(cdt)).abs()
        d = torch.nan_to_num(d, nan=0.0)
        j = int(d.argmax())
        if float(d[j]) > best:
            best, where = float(d[j]), i + j
    return where


def _compare_exact(g: torch.Tensor, lv: torch.Tensor, st: TensorStats) -> TensorStats:
    """Integers and bools: any difference is a mismatch."""
    if g.dtype == lv.dtype and torch.equal(g, lv):
        st.golden_value = _item(g[0])
        st.live_value = _item(lv[0])
        st.worst_flat = 0
        return st
    worst_d, n, max_rel = -1.0, g.numel(), 0.0
    cdt = torch.complex128 if (g.dtype.is_complex or lv.dtype.is_complex) else torch.float64
    for i in range(0, n, CHUNK):
        gc = g[i : i + CHUNK]
        lc = lv[i : i + CHUNK]
        # same-dtype integers compare natively: float64 cannot tell 2**60 from 2**60 + 1
        ne = (gc != lc) if gc.dtype == lc.dtype else (gc.to(cdt) != lc.to(cdt))
        nb = int(ne.sum())
        if not nb:
            continue
        st.mismatched += nb
        d = torch.nan_to_num((lc.to(cdt) - gc.to(cdt)).abs(), nan=math.inf)
        d = torch.where(ne, d, torch.full_like(d, -1.0))
        r = torch.where(ne, d / gc.to(cdt).abs(), torch.zeros_like(d))  # x/0 -> inf is kept
        max_rel = max(max_rel, float(r.nan_to_num_(nan=0.0, posinf=math.inf).max()))
        j = int(d.argmax())
        st.max_abs_diff = max(st.max_abs_diff, float(d[j]))
        if float(d[j]) > worst_d:
            worst_d, st.worst_flat = float(d[j]), i + j
    if st.worst_flat is None:
        st.worst_flat = 0
    if st.mismatched and not st.max_abs_diff:
        # float64 rounding hid the difference of two huge integers: take it from Python ints
        st.max_abs_diff = float(abs(int(lv[st.worst_flat].item()) - int(g[st.worst_flat].item())))
    denom = abs(complex(g[st.worst_flat].to(cdt).item()))
    st.max_rel_diff = max(max_rel, (st.max_abs_diff / denom) if denom else (math.inf if st.max_abs_diff else 0.0))
    st.golden_value = _item(g[st.worst_flat])
    st.live_value = _item(lv[st.worst_flat])
    return st


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for s in reversed(shape):
        if s == 0:
            return ()
        idx.append(flat % s)
        flat //= s
    return tuple(reversed(idx))

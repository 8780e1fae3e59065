"""Per-leaf numeric comparison and per-layer results.

The kernel is chunked and fused: each chunk (a few hundred KB, cache resident) is checked with
``|live - golden|.max() <= atol``, which decides most passing chunks in two cheap ops; only
chunks that fail that test pay for the exact ``|d| <= atol + rtol*|g|`` rule, NaN/Inf handling
and the worst-element search. (``torch.isclose`` ran at ~80 MB/s here; this runs near memory
bandwidth.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import dtypes

STATUS_ORDER = ("structure", "shape", "dtype", "missing", "unexpected", "nonfinite", "diverged", "match")
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


def _py(x: torch.Tensor) -> Any:
    v = x.item()
    return v


def compare_tensors(golden: torch.Tensor, live: torch.Tensor, rtol: float, atol: float, exact: bool = False) -> TensorStats:
    """Compare two same-shape tensors. ``golden`` may live on another device than ``live``."""
    live = live.detach()
    if golden.device != live.device:
        if live.device.type == "cuda":
            golden = golden.pin_memory().to(live.device, non_blocking=True)
        else:
            golden = golden.to(live.device)
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
    if exact or not (g.dtype.is_floating_point or g.dtype.is_complex):
        return _compare_exact(g, lv, st)
    if g.dtype == lv.dtype and g.dtype in _EQUAL_DTYPES and torch.equal(g, lv):
        # the usual case (same code, same inputs): one pass, stopping at the first difference
        # otherwise. NaN != NaN here, so goldens holding NaN take the chunked path below.
        st.worst_flat = 0
        st.golden_value = _py(g[0])
        st.live_value = _py(lv[0])
        return st
    cdt = _compute_dtype(g.dtype if g.dtype.itemsize >= lv.dtype.itemsize else lv.dtype)
    worst_d = -1.0
    max_abs = 0.0
    max_rel = 0.0
    best_m, best_i = -1.0, 0  # the chunk holding the largest difference, if nothing mismatches
    for i in range(0, n, CHUNK):
        gc = g[i : i + CHUNK].to(cdt)
        lc = lv[i : i + CHUNK].to(cdt)
        d = (lc - gc).abs()
        m = float(d.max())
        if m <= atol:  # False for NaN: falls through to the exact rule
            max_abs = max(max_abs, m)
            if m > best_m:
                best_m, best_i = m, i
            if m > 0:
                r = gc.abs()
                torch.div(d, r, out=r)  # 0/0 -> NaN -> 0 below; d/0 -> inf is kept
                max_rel = max(max_rel, float(r.nan_to_num_(nan=0.0, posinf=math.inf).max()))
            continue
        ga = gc.abs()
        eq = (gc == lc) | (torch.isnan(gc) & torch.isnan(lc))
        # an infinite golden is only matched by the same infinity (rtol * inf would accept anything)
        ok = ((d <= atol + rtol * ga) & torch.isfinite(gc)) | eq
        bad = ~ok
        nb = int(bad.sum())
        fin_d = torch.where(eq, torch.zeros_like(d), d)
        fin_d = torch.nan_to_num(fin_d, nan=math.inf, posinf=math.inf)  # keep inf, not float max
        cm = float(fin_d.max())
        max_abs = max(max_abs, cm)
        if cm > best_m:
            best_m, best_i = cm, i
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
        if best_m > 0:
            st.worst_flat += _argmax_abs(g[best_i : best_i + CHUNK], lv[best_i : best_i + CHUNK], cdt)
    st.golden_value = _py(g[st.worst_flat])
    st.live_value = _py(lv[st.worst_flat])
    return st


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
    if g.dtype == lv.dtype and torch.equal(g, lv):
        st.golden_value = _py(g[0])
        st.live_value = _py(lv[0])
        st.worst_flat = 0
        return st
    worst_d, n, max_rel = -1.0, g.numel(), 0.0
    cdt = torch.complex128 if (g.dtype.is_complex or lv.dtype.is_complex) else torch.float64
    for i in range(0, n, CHUNK):
        gc = g[i : i + CHUNK]
        lc = lv[i : i + CHUNK]
        if g.dtype.is_floating_point or g.dtype.is_complex:  # exact float (bit) comparison
            ne = ~((gc == lc) | (torch.isnan(gc) & torch.isnan(lc)))
        else:  # same-dtype integers compare natively: float64 cannot tell 2**60 from 2**60 + 1
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
    if st.mismatched and not st.max_abs_diff and not (g.dtype.is_floating_point or g.dtype.is_complex):
        # float64 rounding hid the difference of two huge integers: take it from Python ints
        st.max_abs_diff = float(abs(int(lv[st.worst_flat].item()) - int(g[st.worst_flat].item())))
    gv, lvv = g[st.worst_flat].to(cdt), lv[st.worst_flat].to(cdt)
    denom = abs(complex(gv.item()))
    st.max_rel_diff = max(max_rel, (st.max_abs_diff / denom) if denom else (math.inf if st.max_abs_diff else 0.0))
    st.golden_value = _py(g[st.worst_flat])
    st.live_value = _py(lv[st.worst_flat])
    del lvv
    return st


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for s in reversed(shape):
        if s == 0:
            return ()
        idx.append(flat % s)
        flat //= s
    return tuple(reversed(idx))


def json_number(x: Any) -> Any:
    """Numbers as JSON allows them (NaN/Inf as strings, complex as [re, im])."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, complex):
        return [json_number(x.real), json_number(x.imag)]
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return x
    if isinstance(x, int):
        return x
    return str(x)


def from_json_number(x: Any) -> Any:
    """Inverse of :func:`json_number` for values read back from a JSON report."""
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, list) and len(x) == 2:
        return complex(from_json_number(x[0]), from_json_number(x[1]))
    return x


def _fields_from_dict(cls: Any, d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise TypeError(f"expected a dict for {cls.__name__}, got {type(d).__name__}")
    names = set(cls.__dataclass_fields__)
    out = {k: v for k, v in d.items() if k in names}
    for k in ("max_abs_diff", "max_rel_diff", "golden_value", "live_value", "error_multiple"):
        if k in out:
            out[k] = from_json_number(out[k])
    for k in ("shape", "live_shape", "index"):
        if isinstance(out.get(k), list):
            out[k] = tuple(out[k])
    return out


@dataclass
class LeafResult:
    """One output leaf of one layer call."""

    path: str
    status: str
    detail: str = ""
    dtype: str | None = None
    live_dtype: str | None = None
    shape: tuple[int, ...] | None = None
    live_shape: tuple[int, ...] | None = None
    numel: int = 0
    mismatched: int = 0
    nonfinite_new: int = 0
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    index: tuple[int, ...] | None = None
    golden_value: Any = None
    live_value: Any = None
    rtol: float | None = None
    atol: float | None = None
    tolerance_source: str | None = None
    error_multiple: float | None = None  # calibrated mode: error / allowed noise

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("max_abs_diff", "max_rel_diff", "golden_value", "live_value", "error_multiple"):
            d[k] = json_number(d[k])
        for k in ("shape", "live_shape", "index"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LeafResult:
        """Rebuild from :meth:`to_dict` output (e.g. a JSON report read back)."""
        return cls(**_fields_from_dict(cls, d))


def worst_status(statuses: list[str]) -> str:
    for s in STATUS_ORDER:
        if s in statuses:
            return s
    return "match"


@dataclass
class LayerResult:
    """The verdict for one call of one module.

    ``max_abs_diff``/``max_rel_diff``/``mismatched``/``numel`` aggregate over the call's output
    leaves; ``path``/``index``/``golden_value``/``live_value`` describe the worst element of the
    worst leaf, and ``rtol``/``atol`` the tolerance applied to it.
    """

    name: str
    call: int
    status: str
    type_name: str = ""
    position: int | None = None  # 0-based index in the live execution order
    golden_position: int | None = None
    golden_name: str | None = None  # differs from name when `rename` mapped it
    detail: str = ""
    numel: int = 0
    mismatched: int = 0
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    path: str | None = None
    index: tuple[int, ...] | None = None
    golden_value: Any = None
    live_value: Any = None
    rtol: float | None = None
    atol: float | None = None
    tolerance_source: str | None = None
    error_multiple: float | None = None  # calibrated mode: error / allowed noise
    leaves: list[LeafResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "match"

    @property
    def label(self) -> str:
        return f"{self.name or '<root>'}[{self.call}]"

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "leaves"}
        for k in ("max_abs_diff", "max_rel_diff", "golden_value", "live_value", "error_multiple"):
            d[k] = json_number(d[k])
        if d["index"] is not None:
            d["index"] = list(d["index"])
        d["leaves"] = [leaf.to_dict() for leaf in self.leaves]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerResult:
        """Rebuild from :meth:`to_dict` output (e.g. a JSON report read back)."""
        kw = _fields_from_dict(cls, d)
        kw["leaves"] = [LeafResult.from_dict(x) for x in d.get("leaves") or []]
        return cls(**kw)

    @classmethod
    def from_leaves(cls, name: str, call: int, type_name: str, leaves: list[LeafResult], **kw: Any) -> LayerResult:
        status = worst_status([leaf.status for leaf in leaves]) if leaves else "match"
        lr = cls(name, call, status, type_name, leaves=leaves, **kw)
        lr.numel = sum(leaf.numel for leaf in leaves)
        lr.mismatched = sum(leaf.mismatched for leaf in leaves)
        numeric = [leaf for leaf in leaves if leaf.max_abs_diff is not None]
        if numeric:
            lr.max_abs_diff = max(leaf.max_abs_diff for leaf in numeric)  # type: ignore[type-var]
            lr.max_rel_diff = max(leaf.max_rel_diff or 0.0 for leaf in numeric)
        multiples = [leaf.error_multiple for leaf in leaves if leaf.error_multiple is not None]
        if multiples:
            lr.error_multiple = max(multiples)
        # the leaf to show: first leaf with the worst status, largest excess within it
        focus = [leaf for leaf in leaves if leaf.status == status] or leaves
        if focus:
            best = max(focus, key=lambda x: (x.max_abs_diff if x.max_abs_diff is not None and not math.isnan(x.max_abs_diff) else -1.0))
            if status != "match":
                best = next((x for x in focus if x.status == status and x.mismatched), best)
            lr.path = best.path
            lr.index = best.index
            lr.golden_value = best.golden_value
            lr.live_value = best.live_value
            lr.rtol, lr.atol, lr.tolerance_source = best.rtol, best.atol, best.tolerance_source
            if not lr.detail:
                lr.detail = best.detail
        return lr


def leaf_from_stats(path: str, dtype: str, live_dtype: str, shape: tuple[int, ...], st: TensorStats, rtol: float, atol: float, source: str) -> LeafResult:
    status = "match"
    detail = ""
    if st.mismatched:
        status = "nonfinite" if st.nonfinite_new else "diverged"
        pct = 100.0 * st.mismatched / max(st.numel, 1)
        detail = f"{st.mismatched} / {st.numel} elements ({pct:.3g}%) outside tolerance"
        if st.nonfinite_new:
            detail = f"{st.nonfinite_new} new NaN/Inf values; " + detail
    return LeafResult(
        path=path, status=status, detail=detail, dtype=dtype, live_dtype=live_dtype,
        shape=shape, live_shape=shape, numel=st.numel, mismatched=st.mismatched,
        nonfinite_new=st.nonfinite_new, max_abs_diff=st.max_abs_diff, max_rel_diff=st.max_rel_diff,
        index=unravel(st.worst_flat, shape) if st.worst_flat is not None and st.numel else None,
        golden_value=st.golden_value, live_value=st.live_value, rtol=rtol, atol=atol,
        tolerance_source=source,
    )


def dtype_name(t: torch.Tensor) -> str:
    try:
        return dtypes.info_for(t.dtype).name
    except dtypes.UnsupportedDtypeError:
        return str(t.dtype).replace("torch.", "")

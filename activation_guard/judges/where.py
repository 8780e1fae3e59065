"""Where inside a tensor two values differ: per dimension, and how (a scale, an offset, a permutation, sign flips).

A pure function of (golden, live, rtol, atol), using the kernel's element rule, so "mismatched"
means exactly what the verdict counted. One pass over the two tensors in slabs along the first
dimension (each at most ``SLAB`` elements, so the temporaries stay bounded for large layers), plus
one verifying pass only when a permutation is a candidate. The pattern names the bug: mismatches
only at token positions from 64 on, one output channel, one batch element, a border of a feature
map, every element by one factor.
"""

from __future__ import annotations

import math

import torch

from .._core import devices
from .._core.kernel import compare_tensors, element_rule, pair_dtype
from ..results import DimWhere, Heat, Relation, Where

SLAB = 1 << 22  # elements per slab of the one pass
MAX_CELLS = 32  # a heatmap's grid side at most: small images, small JSON
RUNS_SHOWN = 4
# a relation (scale, offset) explains the difference when what is left over is this small a
# fraction of it (sums of squares: 1e-4 is a residual of 1% of the difference's RMS)
EXPLAINED = 1e-4
FEWEST = 3  # mismatched elements a relation is named from, at least
PER_SLICE = 8  # mismatched elements in each slice a per-slice factor is named from, at least


def describe(golden: torch.Tensor, live: torch.Tensor, rtol: float, atol: float, *, heat: bool = True) -> Where:
    """The shape of the difference between two same-shape tensors (``golden`` may sit on another
    device). ``heat``: also reduce it to a grid for a heatmap."""
    live = live.detach()
    golden = devices.golden_on(golden.detach(), live.device)
    shape = tuple(int(s) for s in live.shape)
    if tuple(golden.shape) != shape:
        raise ValueError(f"describe: shapes differ: golden {list(golden.shape)}, live {list(shape)}")
    cdt = pair_dtype(golden.dtype, live.dtype)
    if not (cdt.is_floating_point or cdt.is_complex):
        cdt = torch.float64
    scalar = live.ndim == 0
    if scalar:
        golden, live = golden.reshape(1), live.reshape(1)
    nd = golden.ndim
    if golden.numel() == 0:
        return Where("broad", "no elements")
    n0 = golden.shape[0]
    rest = max(1, golden.numel() // n0)
    step = max(1, SLAB // rest)
    real = not cdt.is_complex
    any_bad = [torch.zeros(s, dtype=torch.bool, device=live.device) for s in golden.shape]
    sums = torch.zeros(len(_TOTALS), dtype=torch.float64, device=live.device)
    last = int(golden.shape[-1]) if nd >= 2 else None  # per-slice factors need slices
    rows: list[torch.Tensor] = []  # per slice along the last dim: n, gg, dg, dd over its mismatched elements
    cols = None if last is None else torch.zeros(4, last, dtype=torch.float64, device=live.device)  # per position
    nonfinite = 0  # mismatched elements where either side is NaN/Inf: outside the relations
    rows_cols = golden.shape[-2:] if nd >= 2 else (1, golden.shape[0])
    cells = min(int(rows_cols[1]), MAX_CELLS)
    hd = hg = hl = hb = None
    for i in range(0, n0, step):
        g, lv = golden[i : i + step], live[i : i + step]
        gc, lc, d, ga, _, ok = element_rule(g, lv, cdt, rtol, atol)
        bad = ~ok
        for k in range(nd):
            other = [j for j in range(nd) if j != k]
            a = bad.amax(dim=other) if other else bad
            if k == 0:
                any_bad[0][i : i + step] = a
            else:
                any_bad[k] |= a
        if real:
            part = _slab_sums(gc, lc, ga, bad, rtol, atol, last, exact=False)
            if not bool(torch.isfinite(part[0]).all()):  # (rare) NaN/Inf or an overflowing square: the exact path
                fin = torch.isfinite(gc) & torch.isfinite(lc)
                nonfinite += int((bad & ~fin).sum())
                part = _slab_sums(torch.where(fin, gc, 0), torch.where(fin, lc, 0), ga, bad & fin, rtol, atol, last,
                                  exact=True)
            sums += part[0]
            if part[1] is not None and part[2] is not None and cols is not None:
                rows.append(part[1])
                cols += part[2]
        if heat:
            dd = torch.nan_to_num(d, nan=math.inf)
            gv = gc if real else gc.abs()
            lvv = lc if real else lc.abs()
            if nd >= 3:  # leading dimensions are reduced: max of |d|, sums of values, any mismatch
                m = dd.reshape(-1, *rows_cols).amax(0)
                sg2 = gv.reshape(-1, *rows_cols).sum(0, dtype=torch.float64)
                sl2 = lvv.reshape(-1, *rows_cols).sum(0, dtype=torch.float64)
                sb = bad.reshape(-1, *rows_cols).any(0)
                hd = m if hd is None else torch.maximum(hd, m)
                hg = sg2 if hg is None else hg + sg2
                hl = sl2 if hl is None else hl + sl2
                hb = sb if hb is None else hb | sb
            else:  # 2-D: the slab's rows are rows of the map, their columns pooled at once (bounded memory)
                parts = [_pool_cols(x, cells, how) if nd == 2 else x
                         for x, how in ((dd, "max"), (gv, "mean"), (lvv, "mean"), (bad, "max"))]
                hd, hg, hl, hb = (p if h is None else torch.cat([h, p]) for h, p in zip((hd, hg, hl, hb), parts))
        elif nd >= 3:  # the border test reads the mismatches of the last two dimensions
            sb = bad.reshape(-1, *rows_cols).any(0)
            hb = sb if hb is None else hb | sb
    dims = [] if scalar else [_dim_where(k, any_bad[k]) for k in range(nd)]
    totals = dict(zip(_TOTALS, (float(x) for x in sums.tolist())))
    gs, ls, gss, lss = totals["g"], totals["l"], totals["gg_all"], totals["ll_all"]
    # a permutation keeps the sum and the sum of squares (the slices' own sums are looked at only then)
    perm_candidate = math.isclose(gs, ls, rel_tol=1e-4, abs_tol=1e-6 * math.sqrt(gss * golden.numel()) + atol) \
        and math.isclose(gss, lss, rel_tol=1e-4, abs_tol=1e-12)
    per = {"row": torch.cat(rows, dim=1) if rows else None, "column": cols if real and rows else None}
    where = _relation(golden, live, rtol, atol, real, totals, perm_candidate, any_bad, golden.numel(), per)
    where.dims = dims
    if nonfinite:
        where.text = where.text.replace("every mismatched element", "every finite mismatched element")
        where.text += f"; {nonfinite} mismatched element(s) are NaN/Inf on one side, outside this"
    if nd == 4 and hb is not None:  # (N, C, H, W) feature maps
        where.border = _border(hb)
    if heat and hd is not None:
        lead = golden.numel() // (rows_cols[0] * rows_cols[1])
        assert hg is not None and hl is not None and hb is not None
        where.heat = _heat(hd, hg / lead, hl / lead, hb, nd, real, int(rows_cols[1]))
    return where


# the totals one pass keeps, over the mismatched elements (n .. flips) then over all elements
_TOTALS = ("n", "gg", "dg", "ll", "dd", "d", "flips", "g", "l", "gg_all", "ll_all")


def _slab_sums(gc: torch.Tensor, lc: torch.Tensor, ga: torch.Tensor, bad: torch.Tensor, rtol: float, atol: float,
               last: int | None, *, exact: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One slab's totals (``_TOTALS``), its per-row sums (n, gg, dg, dd per slice along the last
    dimension) and per-column sums (the same per position of the last dimension); ``last``: that
    dimension's size, None for a 1-D or 0-D tensor (no slices: no per-row or per-column sums).

    Sums run in the values' own float32 (torch's reductions sum pairwise: their error is far below
    the 1e-4 share of the difference a relation may leave unexplained) and are only widened to
    float64 when a total is not finite (``exact``: NaN/Inf masked out, squares that overflow float32)."""
    f64 = torch.float64
    if exact:
        gc, lc = gc.to(f64), lc.to(f64)
    every = int(bad.sum()) == bad.numel()
    bg, bl = (gc, lc) if every else (gc * bad, lc * bad)  # every element mismatched (usual): no masking
    bd = bl - bg
    flip = ((bl + bg).abs() <= atol + rtol * ga) & bad
    products = (bg * bg, bd * bg, bd * bd)
    row = col = None
    if last is None:
        n, gg, dg, dd = bad.sum(), *(x.sum() for x in products)
    else:
        b2 = bad.reshape(-1, last)
        if every:
            rn, cn = gc.new_full((b2.shape[0],), last), gc.new_full((last,), b2.shape[0])
        else:
            rn, cn = b2.sum(-1).to(gc.dtype), b2.sum(0).to(gc.dtype)
        row = torch.stack([rn, *(x.reshape(-1, last).sum(-1) for x in products)]).to(f64)
        col = torch.stack([cn, *(x.reshape(-1, last).sum(0) for x in products)]).to(f64)
        n, gg, dg, dd = row.sum(1)
    ll = (bl * bl).sum()
    gg_all = gg if every else (gc * gc).sum()
    ll_all = ll if every else (lc * lc).sum()
    tot = torch.stack([x.to(f64) for x in (n, gg, dg, ll, dd, bd.sum(), flip.sum(), gc.sum(), lc.sum(), gg_all,
                                           ll_all)])
    return tot, row, col


def _pool_cols(x: torch.Tensor, cells: int, how: str) -> torch.Tensor:
    """Columns of a 2-D slab reduced to ``cells`` as adaptive pooling would (max or mean); the rows
    are pooled at the end, which gives the same cells (both poolings are separable)."""
    t = x.to(torch.float32) if x.dtype == torch.bool else x
    n = t.shape[1]
    if n == cells:
        return t.clone()
    if n % cells == 0:
        v = t.reshape(t.shape[0], cells, n // cells)
        return v.amax(-1) if how == "max" else v.mean(-1)
    f = torch.nn.functional
    u = t.unsqueeze(0)
    if how == "max":
        return f.adaptive_max_pool1d(torch.nan_to_num(u.to(torch.float32), posinf=3e38), cells)[0]
    return f.adaptive_avg_pool1d(u.to(torch.float32), cells)[0]


def _runs(flags: torch.Tensor) -> list[list[int]]:
    idx = torch.nonzero(flags).reshape(-1).tolist()
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def _dim_where(k: int, flags: torch.Tensor) -> DimWhere:
    size = int(flags.numel())
    runs = _runs(flags.cpu())
    count = sum(b - a + 1 for a, b in runs)
    if count == size:
        text = "all positions" if size > 1 else "its one position"
    elif count == 1:
        text = f"index {runs[0][0]} only"
    elif len(runs) == 1:
        text = f"only at {runs[0][0]}-{runs[0][1]}"
    elif len(runs) <= RUNS_SHOWN:
        text = "only at " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + f" ({count} of {size})"
    else:
        text = f"at {count} of {size} positions, scattered ({len(runs)} runs)"
    return DimWhere(k, size, count, runs[:RUNS_SHOWN], text)


def _relation(golden: torch.Tensor, live: torch.Tensor, rtol: float, atol: float, real: bool, t: dict[str, float],
              perm_candidate: bool, any_bad: list[torch.Tensor], numel: int,
              per: dict[str, torch.Tensor | None]) -> Where:
    nbad, gg, dg, ll, dd, dsum, flips = t["n"], t["gg"], t["dg"], t["ll"], t["dd"], t["d"], int(t["flips"])
    at = "every element" if nbad == numel else f"every mismatched element ({int(nbad)} of {numel})"
    if not real:
        return Where("broad", "complex values: no scale, offset or permutation is looked for")
    if nbad < FEWEST:  # one or two values fit any factor or offset: naming one would claim too much
        return Where("broad", f"{int(nbad)} mismatched finite element(s): too few to name a relation", sign_flips=flips)
    perm = _permutation(golden, live, rtol, atol, any_bad) if perm_candidate else None
    if perm is not None:
        k, moved, pairs = perm
        return Where("permutation", f"permutation along dim {k}: the golden's values moved between {moved} "
                                    f"positions ({pairs})", perm_dim=k, moved=moved)
    if nbad and gg > 0 and ll > 0 and dd > 0:
        c = 1.0 + dg / gg
        resid = max(dd - dg * dg / gg, 0.0)
        if resid <= EXPLAINED * dd and abs(c - 1.0) > 0:
            if math.isclose(c, -1.0, rel_tol=1e-3) and flips == int(nbad):
                return Where("sign", f"sign flips: live = -golden at {at}", factor=c, sign_flips=flips)
            return Where("scale", f"common factor: live = {c:.4f} x golden at {at} (within rounding: the rest is "
                                  f"{math.sqrt(resid / dd):.2%} of the difference)", factor=c, sign_flips=flips)
    if nbad and dd > 0:
        b = dsum / nbad
        resid = max(dd - dsum * dsum / nbad, 0.0)
        if resid <= EXPLAINED * dd:
            return Where("offset", f"constant offset: live = golden {'+' if b >= 0 else '-'} {abs(b):.4g} at {at}",
                         offset=b, sign_flips=flips)
    if nbad and flips == int(nbad):
        return Where("sign", f"sign flips: live = -golden at {at}", sign_flips=flips)
    if dd > 0 and golden.ndim >= 2:
        kinds: tuple[tuple[str, Relation], ...] = (("column", "column-scale"), ("row", "row-scale"))
        for kind, relation in kinds:
            found = _per_slice_factor(per[kind], dd)
            if found is not None:
                lo, hi, slices = found
                last = golden.ndim - 1
                what = (f"a factor per position of dim {last} ({slices} positions; a per-channel scale?)"
                        if kind == "column" else
                        f"a factor per slice along dim {last} ({slices} slices; a normalisation change?)")
                return Where(relation, f"{what}: live = c x golden, c from {lo:.4f} to {hi:.4f}, at {at}",
                             factor_min=lo, factor_max=hi, sign_flips=flips)
    tail = f"; {flips} of them are sign flips" if flips else ""
    return Where("broad", f"no common factor, offset, permutation or sign flip explains the mismatches{tail}",
                 sign_flips=flips)


def _per_slice_factor(s: torch.Tensor | None, dd: float) -> tuple[float, float, int] | None:
    """Whether one factor per slice (rows ``s`` = n, gg, dg, dd of each slice's mismatched elements)
    explains the difference: at least two slices with mismatches, each with ``PER_SLICE`` or more of
    them (one factor fits a few values whatever they are), and together leaving at most ``EXPLAINED``
    of the difference unexplained. Returns the factors' range and the number of slices."""
    if s is None:
        return None
    n, gg, dg, sdd = s[0], s[1], s[2], s[3]
    hit = n > 0
    slices = int(hit.sum())
    if slices < 2 or float(n[hit].min()) < PER_SLICE:
        return None
    fit = gg > 0
    resid = torch.where(fit, (sdd - dg * dg / torch.where(fit, gg, 1.0)).clamp(min=0.0), sdd)
    if float(resid.sum()) > EXPLAINED * dd:
        return None
    c = 1.0 + dg[hit & fit] / gg[hit & fit]
    lo, hi = float(c.min()), float(c.max())
    if math.isclose(lo, hi, rel_tol=1e-6) or not (math.isfinite(lo) and math.isfinite(hi)):
        return None  # one factor for all is a common factor, which the fit above would have named
    return lo, hi, slices


def _permutation(golden: torch.Tensor, live: torch.Tensor, rtol: float, atol: float,
                 any_bad: list[torch.Tensor]) -> tuple[int, int, str] | None:
    """A dimension along which live holds the golden's slices in another order: the slices' sums
    agree as multisets (a candidate), then the reordered golden is compared in full (the proof)."""
    for k in range(golden.ndim):
        if golden.shape[k] < 2 or int(any_bad[k].sum()) < 2:
            continue
        other = [j for j in range(golden.ndim) if j != k]
        sg = golden.to(torch.float64).sum(dim=other) if other else golden.to(torch.float64)
        sl = live.to(torch.float64).sum(dim=other) if other else live.to(torch.float64)
        og, ol = torch.sort(sg), torch.sort(sl)
        scale = float(sg.abs().max()) or 1.0
        if not torch.allclose(og.values, ol.values, rtol=max(rtol, 1e-6), atol=max(atol, 1e-6 * scale)):
            continue
        perm = torch.empty_like(ol.indices)
        perm[ol.indices] = og.indices  # live slice j holds golden slice perm[j]
        moved_at = torch.nonzero(perm != torch.arange(perm.numel(), device=perm.device)).reshape(-1)
        if moved_at.numel() < 2:
            continue
        st = compare_tensors(golden.index_select(k, perm.to(golden.device)), live, rtol, atol)
        if st.mismatched:
            continue
        pairs = ", ".join(f"{int(j)}<-{int(perm[j])}" for j in moved_at[:4])
        more = ", ..." if moved_at.numel() > 4 else ""
        return k, int(moved_at.numel()), f"live <- golden: {pairs}{more}"
    return None


def _border(spatial: torch.Tensor) -> int | None:
    """The width of the frame of the last two dimensions holding every mismatch, when the
    mismatches touch all four edges and leave an untouched interior (a padding or border-handling
    change), else None."""
    h, w = spatial.shape
    idx = torch.nonzero(spatial)
    if idx.numel() == 0 or min(h, w) < 4:
        return None
    r, c = idx[:, 0], idx[:, 1]
    if not (bool((r == 0).any()) and bool((r == h - 1).any()) and bool((c == 0).any()) and bool((c == w - 1).any())):
        return None  # a frame touches all four edges (one changed row or column is not padding)
    depth = torch.minimum(torch.minimum(r, h - 1 - r), torch.minimum(c, w - 1 - c))
    width = int(depth.max()) + 1
    return width if width <= min(h, w) // 4 else None


def _pool(x: torch.Tensor, rows: int, cols: int, how: str) -> torch.Tensor:
    t = x.reshape(1, 1, *x.shape).to(torch.float32)
    f = torch.nn.functional
    if how == "max":
        return f.adaptive_max_pool2d(torch.nan_to_num(t, posinf=3e38), (rows, cols))[0, 0]
    return f.adaptive_avg_pool2d(t, (rows, cols))[0, 0]


def _significant(x: torch.Tensor, digits: int = 4) -> torch.Tensor:
    """``x`` rounded to ``digits`` significant digits, element-wise (a picture's cells need no more,
    and the JSON stays short); zeros and non-finite values are kept as they are."""
    a = x.abs()
    ok = torch.isfinite(x) & (a >= 1e-300)  # (subnormals: their scale would overflow)
    k = (digits - 1 - torch.floor(torch.log10(torch.where(ok, a, 1.0)))).clamp(-300, 300)
    up = torch.pow(10.0, k.clamp(min=0))  # scale up to an integer, round, and back (exact powers of 10)
    down = torch.pow(10.0, (-k).clamp(min=0))
    r = torch.where(k >= 0, torch.round(x * up) / up, torch.round(x / down) * down)
    return torch.where(ok, r, x)


def _heat(hd: torch.Tensor, hg: torch.Tensor, hl: torch.Tensor, hb: torch.Tensor, nd: int, real: bool,
          c0: int) -> Heat:
    """``c0``: the map's columns before pooling (a 1-D or 2-D map arrives with its columns pooled)."""
    if nd < 2:
        hd, hg, hl, hb = (x.reshape(1, -1) for x in (hd, hg, hl, hb))
    hb = hb.to(torch.float32)
    r0 = hd.shape[0]
    rows, cols = min(r0, MAX_CELLS), min(c0, MAX_CELLS)
    names = {2: ("dim 0", "dim 1"), 3: ("dim 1 (tokens)", "dim 2 (channels)"),
             4: ("dim 2 (height)", "dim 3 (width)")}.get(nd, (f"dim {nd - 2}", f"dim {nd - 1}"))
    if nd < 2:
        names = ("-", "dim 0")
    reduced = {3: "dim 0 (batch)", 4: "dims 0-1 (batch, channels)"}.get(nd, f"dims 0-{nd - 3}" if nd > 4 else "")
    how = (f"max |d| and mean value over {reduced}; " if reduced else "") + (
        f"{r0} x {c0} pooled to {rows} x {cols} cells" if (rows, cols) != (r0, c0) else f"{r0} x {c0}")
    if not real:
        how += "; values are moduli"

    def grid(x: torch.Tensor, mode: str) -> list[list[float]]:
        return _significant(_pool(x, rows, cols, mode).cpu().to(torch.float64)).tolist()

    bad = [[int(v > 0) for v in row] for row in _pool(hb, rows, cols, "max").cpu().tolist()]
    return Heat(f"rows: {names[0]}", f"columns: {names[1]}", how, grid(hd, "max"), grid(hg, "mean"),
                grid(hl, "mean"), bad)

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
from ..results import DimWhere, Heat, Where

SLAB = 1 << 22  # elements per slab of the one pass
MAX_CELLS = 32  # a heatmap's grid side at most: small images, small JSON
RUNS_SHOWN = 4
# a relation (scale, offset) explains the difference when what is left over is this small a
# fraction of it (sums of squares: 1e-4 is a residual of 1% of the difference's RMS)
EXPLAINED = 1e-4
FEWEST = 3  # mismatched elements a relation is named from, at least


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
    # nbad, gg, dg, ll, dd, d (over mismatched elements), flips; then sums of g, l, g^2, l^2 over all
    sums = torch.zeros(11, dtype=torch.float64, device=live.device)
    nonfinite = 0  # mismatched elements where either side is NaN/Inf: outside the relations
    rows_cols = golden.shape[-2:] if nd >= 2 else (1, golden.shape[0])
    hd = hg = hl = hb = None
    f64 = torch.float64
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
            if not bool(torch.isfinite(d).all()):  # (rare) NaN/Inf take no part in the relations
                fin = torch.isfinite(gc) & torch.isfinite(lc)
                nonfinite += int((bad & ~fin).sum())
                gc, lc = torch.where(fin, gc, 0), torch.where(fin, lc, 0)
                bad = bad & fin
            bg, bl = gc * bad, lc * bad
            bd = bl - bg
            flip = ((bl + bg).abs() <= atol + rtol * ga) & bad
            # the scale fit is made on the difference (d = (c - 1) g): fitted on the values (l = c g),
            # its residual ll - lg^2 / gg cancels by 1 / (c - 1)^2, and a factor of 1.008 read as "broad"
            sums += torch.stack([bad.sum(dtype=f64), (bg * bg).sum(dtype=f64), (bd * bg).sum(dtype=f64),
                                 (bl * bl).sum(dtype=f64), (bd * bd).sum(dtype=f64), bd.sum(dtype=f64),
                                 flip.sum(dtype=f64), gc.sum(dtype=f64), lc.sum(dtype=f64),
                                 (gc * gc).sum(dtype=f64), (lc * lc).sum(dtype=f64)])
        if heat:
            dd = torch.nan_to_num(d, nan=math.inf)
            gv = gc if real else gc.abs()
            lvv = lc if real else lc.abs()
            if nd >= 3:  # leading dimensions are reduced: max of |d|, sums of values, any mismatch
                m = dd.reshape(-1, *rows_cols).amax(0)
                sg2, sl2 = gv.reshape(-1, *rows_cols).sum(0, dtype=f64), lvv.reshape(-1, *rows_cols).sum(0, dtype=f64)
                sb = bad.reshape(-1, *rows_cols).any(0)
                hd = m if hd is None else torch.maximum(hd, m)
                hg = sg2 if hg is None else hg + sg2
                hl = sl2 if hl is None else hl + sl2
                hb = sb if hb is None else hb | sb
            else:  # 1-D or 2-D: the slab's rows are rows of the map
                hd = dd if hd is None else torch.cat([hd, dd])
                hg = gv if hg is None else torch.cat([hg, gv])
                hl = lvv if hl is None else torch.cat([hl, lvv])
                hb = bad if hb is None else torch.cat([hb, bad])
        elif nd >= 3:  # the border test reads the mismatches of the last two dimensions
            sb = bad.reshape(-1, *rows_cols).any(0)
            hb = sb if hb is None else hb | sb
    dims = [] if scalar else [_dim_where(k, any_bad[k]) for k in range(nd)]
    nbad, gg, dg, ll, ddsum, dsum, flips, gs, ls, gss, lss = (float(x) for x in sums.tolist())
    # a permutation keeps the sum and the sum of squares (the slices' own sums are looked at only then)
    perm_candidate = math.isclose(gs, ls, rel_tol=1e-4, abs_tol=1e-6 * math.sqrt(gss * golden.numel()) + atol) \
        and math.isclose(gss, lss, rel_tol=1e-4, abs_tol=1e-12)
    where = _relation(golden, live, rtol, atol, real, nbad, gg, dg, ll, ddsum, dsum, int(flips), perm_candidate,
                      any_bad, golden.numel())
    where.dims = dims
    if nonfinite:
        where.text = where.text.replace("every mismatched element", "every finite mismatched element")
        where.text += f"; {nonfinite} mismatched element(s) are NaN/Inf on one side, outside this"
    if nd == 4 and hb is not None:  # (N, C, H, W) feature maps
        where.border = _border(hb)
    if heat and hd is not None:
        lead = golden.numel() // (rows_cols[0] * rows_cols[1])
        assert hg is not None and hl is not None and hb is not None
        where.heat = _heat(hd, hg / lead, hl / lead, hb, nd, real)
    return where


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


def _relation(golden: torch.Tensor, live: torch.Tensor, rtol: float, atol: float, real: bool, nbad: float, gg: float,
              dg: float, ll: float, dd: float, dsum: float, flips: int, perm_candidate: bool,
              any_bad: list[torch.Tensor], numel: int) -> Where:
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
    tail = f"; {flips} of them are sign flips" if flips else ""
    return Where("broad", f"no common factor, offset, permutation or sign flip explains the mismatches{tail}",
                 sign_flips=flips)


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


def _heat(hd: torch.Tensor, hg: torch.Tensor, hl: torch.Tensor, hb: torch.Tensor, nd: int, real: bool) -> Heat:
    if nd < 2:
        hd, hg, hl, hb = (x.reshape(1, -1) for x in (hd, hg, hl, hb))
    hb = hb.to(torch.float32)
    r0, c0 = hd.shape
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

    def grid(x: torch.Tensor, mode: str, digits: int = 4) -> list[list[float]]:
        p = _pool(x, rows, cols, mode).cpu().tolist()
        return [[float(f"{v:.{digits}g}") for v in row] for row in p]

    bad = [[int(v > 0) for v in row] for row in _pool(hb, rows, cols, "max").cpu().tolist()]
    return Heat(f"rows: {names[0]}", f"columns: {names[1]}", how, grid(hd, "max"), grid(hg, "mean"),
                grid(hl, "mean"), bad)

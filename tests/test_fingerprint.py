"""Fingerprints: exact statistics, bit-exact samples, the seeded sketch, sound judging.

The central claim is the false-alarm property: a live tensor whose every element is within the
comparator's tolerance (checked with the comparator itself) is never failed, whatever the
perturbation's structure, dtype, shape, tolerance regime or summation order; and broad real
changes (weights, activation function, epsilon) are failed far above the bound.
"""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from activation_guard._core import native
from activation_guard._core.kernel import compare_tensors
from activation_guard.fingerprints import hashing as sh
from activation_guard.fingerprints import sketch
from activation_guard.fingerprints.fingerprint import (
    Fingerprint,
    FingerprintError,
    FingerprintFormatError,
    FingerprintParams,
    binomial_tail,
    compute_fingerprint,
    row_false_alarm,
    should_fingerprint,
    solve_multiplier,
)
from activation_guard.fingerprints.soundness import judge_fingerprint, judge_fingerprint_calibrated

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 17), (1031,), (64, 129), (5, 0, 3), (4, 1, 513)]

# --------------------------------------------------------------------------- helpers


def element_ok(g: torch.Tensor, lv: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """The comparator's element rule (kernel.py), elementwise."""
    cdt = torch.float64 if torch.float64 in (g.dtype, lv.dtype) else torch.float32
    gc, lc = g.to(cdt), lv.to(cdt)
    eq = (gc == lc) | (torch.isnan(gc) & torch.isnan(lc))
    return (((lc - gc).abs() <= atol + rtol * gc.abs()) & torch.isfinite(gc)) | eq


def within_tolerance(g: torch.Tensor, delta: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """``g + delta`` rounded to g's dtype, with every element the comparator would reject put back
    to the golden value: a live tensor that is within tolerance by construction."""
    cand = (g.double() + delta).to(g.dtype)
    live = torch.where(element_ok(g, cand, rtol, atol), cand, g)
    st_ = compare_tensors(g, live, rtol, atol)
    assert st_.mismatched == 0  # the real comparator agrees: this run must pass
    return live


def perturbation(kind: str, g: torch.Tensor, rtol: float, atol: float, gen: torch.Generator) -> torch.Tensor:
    """Float64 perturbations at (or near) the element-wise bound, with several structures."""
    g64 = torch.nan_to_num(g.double(), nan=0.0, posinf=0.0, neginf=0.0)
    tol = atol + rtol * g64.abs()
    n = g.numel()
    shape = g.shape
    rnd = torch.rand(shape, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    at = 0.9999 * tol
    if kind == "random_sign":
        return at * sign
    if kind == "same_sign":
        return at
    if kind == "toward_zero":
        return -at * torch.sign(g64)
    if kind == "away_from_zero":
        return at * torch.sign(g64)
    if kind == "uniform":
        return tol * (2 * rnd - 1)
    if kind == "sparse":
        return torch.where(rnd < 0.01, at * sign, torch.zeros_like(at))
    if kind in ("column", "row", "alternating") and g.dim() >= 1 and n:
        idx = torch.arange(n).view(shape)
        last = idx % shape[-1]
        if kind == "column":
            return torch.where(last == 0, at, torch.zeros_like(at))
        if kind == "row":
            return torch.where(idx < shape[-1], at, torch.zeros_like(at))
        return torch.where(last % 2 == 0, at, -at)
    return at * sign


KINDS = ["random_sign", "same_sign", "toward_zero", "away_from_zero", "uniform", "sparse", "column", "row",
         "alternating"]


def golden_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, scale: float,
                  nonfinite: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if x.numel():
        x.view(-1)[:: 7] = 0.0  # exact zeros: rtol-only tolerances are 0 there
        if nonfinite:
            flat = x.view(-1)
            k = torch.randint(0, x.numel(), (3,), generator=gen)
            flat[k[0]] = math.nan
            flat[k[1]] = math.inf
            flat[k[2]] = -math.inf
    return x.to(dtype)


# --------------------------------------------------------------------------- the false-alarm property


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from(SHAPES),
    kind=st.sampled_from(KINDS),
    regime=st.sampled_from(["rtol", "atol", "both", "default", "exact"]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    nonfinite=st.booleans(),
    as_fingerprint=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    fp_seed=st.integers(0, 2**64 - 1),
)
def test_within_tolerance_never_fails(dtype, shape, kind, regime, scale, nonfinite, as_fingerprint, seed,
                                      fp_seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    rtol, atol = {"rtol": (1e-3, 0.0), "atol": (0.0, 1e-3 * scale), "both": (1e-4, 1e-4 * scale),
                  "default": {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5),
                              torch.bfloat16: (1.6e-2, 1e-5), torch.float64: (1e-7, 1e-7)}[dtype],
                  "exact": (0.0, 0.0)}[regime]
    g = golden_tensor(shape, dtype, gen, scale, nonfinite)
    live = within_tolerance(g, perturbation(kind, g, rtol, atol, gen), rtol, atol)
    params = FingerprintParams(seed=fp_seed)
    golden = compute_fingerprint(g, params, chunk=1024)  # golden and live sum in different orders
    other: torch.Tensor | Fingerprint = compute_fingerprint(live, params) if as_fingerprint else live
    v = judge_fingerprint(golden, other, rtol, atol)
    assert v.ok, v.detail
    assert v.estimate <= v.threshold or v.rows_over <= params.rows // 2


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1), fp_seed=st.integers(0, 2**64 - 1))
def test_within_tolerance_never_fails_multi_chunk(kind, seed, fp_seed) -> None:
    """Large enough for several chunks and several folds of the routing matrix."""
    gen = torch.Generator().manual_seed(seed)
    g = golden_tensor((96, 3001), torch.float32, gen, 1.0, False)
    rtol, atol = 1.3e-6, 1e-5
    live = within_tolerance(g, perturbation(kind, g, rtol, atol, gen), rtol, atol)
    params = FingerprintParams(seed=fp_seed, samples=16)
    v = judge_fingerprint(compute_fingerprint(g, params, chunk=1 << 12), live.t().contiguous().t(), rtol, atol)
    assert v.ok, v.detail


def test_worst_case_at_the_bound_over_many_seeds() -> None:
    """Every element exactly at its bound: the sketch estimates sit near the bound, and over 200
    independent seeds no row median comes near c x bound (the threshold)."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(20_000, generator=gen, dtype=torch.float64)
    rtol, atol = 1e-3, 1e-4
    tol = atol + rtol * g.abs()
    sign = torch.where(torch.rand(g.shape, generator=gen) < 0.5, -1.0, 1.0).double()
    live = within_tolerance(g, tol * sign * (1 - 1e-12), rtol, atol)
    assert torch.equal(live != g, torch.ones_like(g, dtype=torch.bool))  # every element moved
    ratios = []
    for s in range(200):
        v = judge_fingerprint(compute_fingerprint(g, FingerprintParams(seed=s, samples=0)), live, rtol, atol)
        assert v.ok, v.detail
        ratios.append(v.estimate / v.bound)
    assert 0.8 < float(np.median(ratios)) < 1.01  # the bound is tight for this d: ||d|| = T
    assert max(ratios) < FingerprintParams().multiplier


# --------------------------------------------------------------------------- detection of real changes


def _no_samples(seed: int = 0) -> FingerprintParams:
    return FingerprintParams(seed=seed, samples=0)  # only sums and the sketch can see the change


def _assert_detected(g: torch.Tensor, live: torch.Tensor, rtol: float, atol: float, factor: float = 3.0) -> None:
    assert compare_tensors(g, live, rtol, atol).mismatched > 0  # the full comparator fails it
    v = judge_fingerprint(compute_fingerprint(g, _no_samples()), live, rtol, atol)
    assert v.status == "diverged", v.detail
    assert v.estimate > factor * v.threshold, v.detail
    full = judge_fingerprint(compute_fingerprint(g), live, rtol, atol)
    assert full.status == "diverged"


def test_detects_a_one_percent_weight_change() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 512)
    x = torch.randn(64, 256)
    with torch.no_grad():
        g = lin(x)
        lin.weight.mul_(1 + 0.01 * torch.randn_like(lin.weight))
        live = lin(x)
    _assert_detected(g, live, 1.3e-6, 1e-5, factor=50)


def test_detects_a_gelu_tanh_swap_on_transformer_activations() -> None:
    torch.manual_seed(0)
    norm, fc = nn.LayerNorm(128), nn.Linear(128, 512)
    with torch.no_grad():
        pre = fc(norm(torch.randn(32, 128)))
        g = nn.functional.gelu(pre)
        live = nn.functional.gelu(pre, approximate="tanh")
    _assert_detected(g, live, 1.3e-6, 1e-5)


def test_detects_an_eps_change() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 256) * 0.01  # small activations: epsilon matters
    g = nn.functional.layer_norm(x, (256,), eps=1e-5)
    live = nn.functional.layer_norm(x, (256,), eps=1e-6)
    _assert_detected(g, live, 1.3e-6, 1e-5)


@pytest.mark.slow
def test_detects_a_change_in_a_tiny_transformer() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 128, (2, 48))
    with torch.no_grad():
        g = model(ids).last_hidden_state
        model.h[0].mlp.c_fc.weight.mul_(1.001)  # a 0.1% weight change early in the model
        live = model(ids).last_hidden_state
    _assert_detected(g, live, 1.3e-6, 1e-5)


def test_single_large_element_change_is_certain_via_max_or_samples() -> None:
    g = torch.randn(100_000)
    live = g.clone()
    live[12345] = 1e3
    v = judge_fingerprint(compute_fingerprint(g, _no_samples()), live, 1.3e-6, 1e-5)
    assert v.status == "diverged" and v.check == "max", v.detail
    assert "certain" in v.detail


def test_sum_check_is_certain_for_a_shift() -> None:
    g = torch.randn(50_000, dtype=torch.float64)
    live = g + 3e-4  # every element off by 3x atol: sum moves by 15 vs bound 5 + rtol * sum|g|
    v = judge_fingerprint(compute_fingerprint(g, _no_samples()), live, 0.0, 1e-4)
    assert v.status == "diverged" and v.check in ("sum", "max", "min"), v.detail


def test_sampled_mismatch_reports_index_and_values() -> None:
    g = torch.arange(6000, dtype=torch.float32).view(60, 100)
    params = FingerprintParams(samples=8)
    fp = compute_fingerprint(g, params)
    live = g.clone()
    flat = fp.positions[3]
    live.view(-1)[flat] += 1.0
    v = judge_fingerprint(fp, live, 0.0, 0.5)
    assert v.status == "diverged" and v.check == "sample"
    (m,) = v.mismatches
    assert m.flat == flat and m.index == (flat // 100, flat % 100)
    assert m.golden == float(g.view(-1)[flat]) and m.live == m.golden + 1.0
    assert "certain" in v.detail and "estimated ||diff||_2" in v.detail and "(sketch)" in v.detail


# --------------------------------------------------------------------------- non-finite values


def test_nonfinite_positions_and_counts() -> None:
    g = torch.randn(10_000)
    g[[5, 900]] = math.nan
    g[77] = math.inf
    g[78] = -math.inf
    fp = compute_fingerprint(g)
    assert (fp.nan, fp.posinf, fp.neginf, fp.count) == (2, 1, 1, 9996)
    assert fp.min == float(g[torch.isfinite(g)].min()) and fp.max == float(g[torch.isfinite(g)].max())
    assert judge_fingerprint(fp, g.clone(), 0.0, 0.0).ok
    moved = g.clone()
    moved[[5, 6]] = moved[[6, 5]]
    v = judge_fingerprint(fp, moved, 1.0, 1.0)
    assert v.status == "nonfinite" and "different positions" in v.detail
    new = g.clone()
    new[10] = math.nan
    v = judge_fingerprint(fp, new, 1.0, 1.0)
    assert v.status == "nonfinite" and "3 NaN" in v.detail
    flipped = g.clone()
    flipped[77] = -math.inf
    flipped[78] = math.inf
    assert judge_fingerprint(fp, flipped, 1.0, 1.0).status == "nonfinite"


def test_all_nonfinite_and_empty_and_scalar() -> None:
    allnan = torch.full((3000,), math.nan)
    fp = compute_fingerprint(allnan)
    assert fp.count == 0 and fp.nan == 3000 and fp.min == math.inf and fp.max == -math.inf
    assert judge_fingerprint(fp, allnan.clone(), 0.0, 0.0).ok
    empty = torch.zeros(4, 0)
    fe = compute_fingerprint(empty)
    assert fe.numel == 0 and fe.samples.shape == (0,) and judge_fingerprint(fe, empty, 0.0, 0.0).ok
    s = torch.tensor(2.5)
    fs = compute_fingerprint(s)
    assert fs.shape == () and fs.sum == 2.5 and fs.sample_values().tolist() == [2.5]
    assert judge_fingerprint(fs, torch.tensor(2.5), 0.0, 0.0).ok
    assert judge_fingerprint(fs, torch.tensor(2.6), 0.0, 0.01).status == "diverged"


# --------------------------------------------------------------------------- exactness and determinism


def test_statistics_are_exact_float64_sums() -> None:
    g = torch.randn(300_001, dtype=torch.float32) * 3
    fp = compute_fingerprint(g)
    vals = g.double().numpy()
    for got, want in ((fp.sum, math.fsum(vals)), (fp.abs_sum, math.fsum(np.abs(vals))),
                      (fp.sq_sum, math.fsum(vals * vals))):
        assert abs(got - want) <= 1e-12 * math.fsum(np.abs(vals) if got != fp.sq_sum else vals * vals)
    assert fp.min == vals.min() and fp.max == vals.max() and fp.count == g.numel()


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64])
def test_samples_are_bit_exact(dtype: torch.dtype) -> None:
    g = (torch.randn(5000, dtype=torch.complex64) if dtype.is_complex else torch.randn(5000) * 4).to(dtype)
    fp = compute_fingerprint(g)
    got = fp.sample_values()
    want = g[list(fp.positions)]
    view = torch.float32 if dtype.is_complex else dtype
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[view.itemsize]
    a = torch.view_as_real(got) if dtype.is_complex else got
    b = torch.view_as_real(want) if dtype.is_complex else want
    assert torch.equal(a.contiguous().view(width), b.contiguous().view(width))


def test_same_tensor_identical_bits() -> None:
    g = torch.randn(200_000)
    assert compute_fingerprint(g).identical(compute_fingerprint(g.clone()))


@pytest.mark.parametrize("layout", ["transpose", "step", "expand", "channels_last", "offset", "conj"])
def test_memory_layout_does_not_change_the_fingerprint(layout: str) -> None:
    torch.manual_seed(0)
    if layout == "transpose":
        base = torch.randn(700, 513)
        view = base.t()
    elif layout == "step":
        base = torch.randn(300, 2000)
        view = base[::3, 5::2]
    elif layout == "expand":
        view = torch.randn(1, 3001).expand(90, 3001)
    elif layout == "channels_last":
        view = torch.randn(4, 33, 40, 41).to(memory_format=torch.channels_last)
    elif layout == "offset":
        view = torch.randn(400_000)[12345:345678]
    else:
        view = torch.randn(300, 700, dtype=torch.complex64).conj()
    contiguous = view.contiguous()
    assert compute_fingerprint(view).identical(compute_fingerprint(contiguous))


def test_chunk_size_changes_only_rounding() -> None:
    g = torch.randn(123_457) * 100
    fps = [compute_fingerprint(g, chunk=c) for c in (1024, 1 << 14, 1 << 17, 1 << 20)]
    for a, b in itertools.combinations(fps, 2):
        assert np.array_equal(a.samples, b.samples) and (a.min, a.max, a.count) == (b.min, b.max, b.count)
        assert np.abs(a.sketch - b.sketch).max() <= 1e-9 * a.abs_sum
        assert judge_fingerprint(a, b, 0.0, 0.0).ok  # exact tolerance: only rounding differs


def test_many_folds_match_one_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.randn(200_000, dtype=torch.float64)
    one = compute_fingerprint(g)
    monkeypatch.setattr(sketch, "FLUSH_BLOCKS", 64)
    sketch.HASHES.clear()
    many = compute_fingerprint(g, chunk=4096)
    assert many.depth < one.depth
    assert np.abs(one.sketch - many.sketch).max() <= 1e-10 * one.abs_sum
    assert judge_fingerprint(one, many, 0.0, 0.0).ok


def test_sketch_is_linear() -> None:
    a, b = torch.randn(50_000, dtype=torch.float64), torch.randn(50_000, dtype=torch.float64)
    fa, fb, fab = compute_fingerprint(a), compute_fingerprint(b), compute_fingerprint(a + b)
    assert np.allclose(fa.sketch + fb.sketch, fab.sketch, rtol=0, atol=1e-9)


# --------------------------------------------------------------------------- the hash and the sketch


def test_device_hash_matches_host_reference() -> None:
    rng = np.random.default_rng(0)
    idx = [0, 1, 2, 2**31, 2**32 + 5, 2**62, 2**63 - 1, *map(int, rng.integers(0, 2**62, 200))]
    keys = [0, 1, sh.MASK64, 0x8000_0000_0000_0000, *map(int, rng.integers(0, 2**63, 20))]
    for key in keys:
        got = sh.prf_tensor(torch.tensor(sh.signed64(key)), torch.tensor(idx, dtype=torch.int64))
        want = [sh.signed64(sh.prf(key, i)) for i in idx]
        assert got.tolist() == want


def _reference_sketch(x: np.ndarray, seed: int, rows: int, buckets: int) -> np.ndarray:
    """The sketch as documented, element by element, with host hashing."""
    out = np.zeros((rows, buckets))
    n = x.size
    for r, (key, ukey) in enumerate(zip(sh.row_keys(seed, rows), sh.u_keys(seed, rows))):
        u = [1 - 2 * (sh.prf(ukey, j) & 1) for j in range(buckets)]
        h = [sh.prf(key, c) for c in range(n // buckets + buckets + 1)]
        for i in range(n):
            k, j = divmod(i, buckets)
            m = h[k] & (buckets - 1)
            v = 1 - 2 * ((h[k] >> sh.V_BIT) & 1)
            w = 1 - 2 * ((h[k + j] >> sh.W_BIT) & 1)
            out[r, j ^ m] += u[j] * v * w * x[i]
    return out


def test_kernel_computes_the_documented_sketch() -> None:
    x = torch.randn(2 * 4096 + 77, dtype=torch.float64)
    params = FingerprintParams(seed=99, rows=3, buckets=16, samples=4)
    fp = compute_fingerprint(x, params, chunk=1024)
    ref = _reference_sketch(x.numpy(), 99, 3, 16)
    assert np.allclose(fp.sketch, ref, rtol=0, atol=1e-10)


def test_tabulation_signs_are_four_wise_independent_by_peeling() -> None:
    """The proof's combinatorial step, checked exhaustively on a grid: among any 2, 3 or 4
    distinct keys (k, j) some key owns a table entry (k, j or k + j) no other key uses."""
    keys = [(k, j) for k in range(7) for j in range(5)]
    for size in (2, 3, 4):
        for group in itertools.combinations(keys, size):
            rest = list(group)
            while rest:
                chars = [(0, k) for k, _ in rest] + [(1, j) for _, j in rest] + [(2, k + j) for k, j in rest]
                lone = next((key for key in rest if any(chars.count(c) == 1 for c in
                                                       ((0, key[0]), (1, key[1]), (2, key[0] + key[1])))), None)
                assert lone is not None, group
                rest.remove(lone)


def test_row_estimate_is_unbiased_and_buckets_do_not_collide_within_a_block() -> None:
    d = np.zeros(4096)
    B = FingerprintParams().buckets
    d[B : 2 * B] = 1.0  # one whole block: its elements never share a bucket, so every row is exact
    est = []
    for s in range(20):
        fp = compute_fingerprint(torch.from_numpy(d), FingerprintParams(seed=s, samples=0))
        assert np.allclose((fp.sketch**2).sum(1), float(B))
    rng = np.random.default_rng(0)
    d = rng.standard_normal(4096)
    for s in range(300):
        fp = compute_fingerprint(torch.from_numpy(d), FingerprintParams(seed=s, samples=0, rows=1))
        est.append(float((fp.sketch**2).sum()))
    mean, truth = float(np.mean(est)), float((d * d).sum())
    sd = truth * math.sqrt(2 / B) / math.sqrt(len(est))
    assert abs(mean - truth) < 5 * sd
    assert float(np.var(est)) <= 2 * truth**2 / B * 1.5  # Var(Y) <= 2 ||d||^4 / B


def test_sample_positions_are_stratified_and_reproducible() -> None:
    pos = sh.sample_positions(7, 10_000, 64)
    assert pos == sh.sample_positions(7, 10_000, 64) and len(pos) == 64
    for s, p in enumerate(pos):
        assert s * 10_000 // 64 <= p < (s + 1) * 10_000 // 64
    assert pos != sh.sample_positions(8, 10_000, 64)
    assert sh.sample_positions(7, 10, 64) == tuple(range(10))


# --------------------------------------------------------------------------- parameters and the binomial tail


def test_default_false_alarm_bound_is_exact_and_tight() -> None:
    p = FingerprintParams()
    c = p.multiplier
    tail = binomial_tail(p.rows, row_false_alarm(c, p.buckets))
    assert isinstance(tail, Fraction) and tail <= Fraction(1, 10**6)
    assert binomial_tail(p.rows, row_false_alarm(c * (1 - 1e-9), p.buckets)) > Fraction(1, 10**6) or c == 1.0
    # cross-check the closed form with floats: P(>= 3 of 5 rows) for the per-row bound
    q = 2 / (2 + p.buckets * (c * c - 1) ** 2)
    assert math.isclose(float(tail), sum(math.comb(5, k) * q**k * (1 - q) ** (5 - k) for k in (3, 4, 5)),
                        rel_tol=1e-9)
    assert 1.85 < c < 1.95


@pytest.mark.parametrize("rows,buckets,alpha", [(1, 4096, 1e-3), (3, 256, 1e-6), (7, 64, 1e-9), (9, 128, 1e-6)])
def test_custom_parameters_meet_their_bound(rows: int, buckets: int, alpha: float) -> None:
    p = FingerprintParams(rows=rows, buckets=buckets, false_alarm=alpha)
    assert binomial_tail(rows, row_false_alarm(p.multiplier, buckets)) <= Fraction(alpha)
    assert p.multiplier == solve_multiplier(rows, buckets, alpha)


@pytest.mark.parametrize("kwargs,needle", [
    ({"rows": 4}, "odd"), ({"rows": 0}, "rows"), ({"buckets": 100}, "power of two"), ({"buckets": 8}, "buckets"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": True}, "seed"), ({"samples": -1}, "samples"),
    ({"false_alarm": 0.0}, "false_alarm"), ({"false_alarm": math.nan}, "false_alarm"),
    ({"false_alarm": 0.7}, "false_alarm"), ({"samples": 1.5}, "samples"), ({"buckets": 8192}, "buckets"),
    ({"rows": 31, "buckets": 4096}, "workspace"), ({"rows": 17, "buckets": 1024}, "256 MiB"),
])
def test_bad_parameters_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(FingerprintError, match=needle):
        FingerprintParams(**kwargs)


def test_a_numpy_false_alarm_is_a_number() -> None:
    assert FingerprintParams(false_alarm=np.float32(1e-6)).false_alarm == pytest.approx(1e-6)


def test_mismatched_parameters_cannot_be_compared() -> None:
    g = torch.randn(5000)
    with pytest.raises(FingerprintError, match="different parameters"):
        judge_fingerprint(compute_fingerprint(g), compute_fingerprint(g, FingerprintParams(seed=1)), 0, 0)
    with pytest.raises(FingerprintError, match="chunk"):
        compute_fingerprint(g, chunk=1000)
    with pytest.raises(FingerprintError, match="integers and bools are stored exactly"):
        compute_fingerprint(torch.arange(10))


def test_should_fingerprint() -> None:
    p = FingerprintParams()
    assert not should_fingerprint(torch.zeros(10**6, dtype=torch.int64), p)
    assert not should_fingerprint(torch.zeros(10**6, dtype=torch.bool), p)
    assert not should_fingerprint(torch.zeros(100), p)
    small = p.nbytes(4) // 4
    assert not should_fingerprint(torch.zeros(small), p) and should_fingerprint(torch.zeros(2 * small), p)
    assert should_fingerprint(torch.zeros(10**5, dtype=torch.complex64), p)
    assert should_fingerprint(torch.zeros(10**5, dtype=torch.bfloat16), p)


# --------------------------------------------------------------------------- structure, dtypes, complex


def test_shape_and_dtype_verdicts() -> None:
    g = torch.randn(40, 100)
    fp = compute_fingerprint(g)
    assert judge_fingerprint(fp, g.view(100, 40), 1, 1).status == "shape"
    assert judge_fingerprint(fp, g.double(), 1, 1).status == "dtype"
    assert judge_fingerprint(fp, g.to(torch.int32), 1, 1).status == "dtype"
    assert judge_fingerprint(fp, g.double(), 1.3e-6, 1e-5, allow_dtype_change=True).ok
    assert judge_fingerprint(fp, g.to(torch.complex64), 1, 1, allow_dtype_change=True).status == "dtype"


def test_complex_tensors() -> None:
    torch.manual_seed(0)
    g = torch.randn(20_000, dtype=torch.complex64)
    fp = compute_fingerprint(g)
    assert fp.real_numel == 40_000 and fp.samples.shape == (64, 2)
    rtol, atol = 1e-4, 1e-5
    tol = atol + rtol * g.abs()
    phase = torch.exp(1j * 2 * math.pi * torch.rand(g.shape))
    live = (g + 0.999 * tol * phase).to(torch.complex64)
    ok = compare_tensors(g, live, rtol, atol)
    live = torch.where(element_ok_complex(g, live, rtol, atol), live, g)
    assert ok.numel and compare_tensors(g, live, rtol, atol).mismatched == 0
    assert judge_fingerprint(fp, live, rtol, atol).ok
    assert judge_fingerprint(fp, g * (1 + 1e-3), rtol, atol).status == "diverged"


def element_ok_complex(g: torch.Tensor, lv: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    return ((lv - g).abs() <= atol + rtol * g.abs()) | (g == lv)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8(dtype: torch.dtype) -> None:
    g = (torch.randn(20_000) * 4).to(dtype)
    fp = compute_fingerprint(g)
    assert fp.sum == math.fsum(g.double().tolist())
    assert judge_fingerprint(fp, g.clone(), 0.0, 0.0).ok
    changed = (g.float() * 1.5).to(dtype)
    assert judge_fingerprint(fp, changed, 0.125, 1e-3).status == "diverged"


# --------------------------------------------------------------------------- calibrated (L2) mode


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), frac=st.floats(0.0, 0.999), kind=st.sampled_from(KINDS))
def test_calibrated_within_allowance_never_fails(seed: int, frac: float, kind: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(30_000, generator=gen, dtype=torch.float64)
    gf, lf, m, abs_term = 1e-6, 2e-6, 2.0, 1e-5
    allow = m * (gf + lf) + abs_term
    d = perturbation(kind, g, 0.0, 1.0, gen)  # any structure, then scaled to RMS = frac * allowance
    rms = float(d.norm()) / math.sqrt(d.numel())
    live = g + (d * (frac * allow / rms) if rms else d)
    v = judge_fingerprint_calibrated(compute_fingerprint(g, FingerprintParams(seed=seed)), live,
                                     golden_rms_floor=gf, live_rms_floor=lf, multiplier=m, abs_term=abs_term)
    assert v.ok, v.detail
    assert "estimated RMS error" in v.detail


def test_calibrated_detects_and_reports_rms() -> None:
    g = torch.randn(30_000, dtype=torch.float64)
    fp = compute_fingerprint(g)
    v = judge_fingerprint_calibrated(fp, g + 1e-3 * torch.randn_like(g), golden_rms_floor=1e-6, live_rms_floor=1e-6,
                                     multiplier=2.0)
    assert v.status == "diverged" and v.check in ("sketch", "sum")
    assert 0.8e-3 < v.estimated_rms < 1.2e-3
    assert "allowance 1.40e-05" in v.detail
    spike = g.clone()
    spike[fp.positions[0]] += 1.0
    w = judge_fingerprint_calibrated(fp, spike, golden_rms_floor=1e-6, live_rms_floor=1e-6, multiplier=2.0,
                                     golden_max_floor=1e-5, live_max_floor=1e-5)
    assert w.status == "diverged" and w.check == "sample"
    with pytest.raises(ValueError, match="both"):
        judge_fingerprint_calibrated(fp, g, golden_rms_floor=0, live_rms_floor=0, multiplier=2, golden_max_floor=1.0)


# --------------------------------------------------------------------------- serialization


def test_round_trip_is_plain_data_and_identical() -> None:
    g = torch.randn(3000, 7, dtype=torch.bfloat16)
    g[0, 0] = math.nan
    fp = compute_fingerprint(g)
    arrays, meta = fp.to_arrays()
    assert all(isinstance(a, np.ndarray) and a.dtype.kind in "fiu" for a in arrays.values())
    back = Fingerprint.from_arrays(arrays, json.loads(json.dumps(meta)))
    assert back.identical(fp) and back.params == fp.params
    assert judge_fingerprint(back, g, 0.0, 0.0).ok


def _corrupt(name: str):
    fp = compute_fingerprint(torch.randn(5000))
    arrays, meta = fp.to_arrays()
    arrays = {k: v.copy() for k, v in arrays.items()}
    meta = json.loads(json.dumps(meta))
    if name == "missing":
        del arrays["sketch"]
    elif name == "sketch dtype":
        arrays["sketch"] = arrays["sketch"].astype(np.float32)
    elif name == "sketch shape":
        arrays["sketch"] = arrays["sketch"][:4]
    elif name == "samples dtype":
        arrays["samples"] = arrays["samples"].astype(np.uint16)
    elif name == "counts":
        arrays["counts"][1] = 3
    elif name == "negative count":
        arrays["counts"][0] = -1
    elif name == "nan stat":
        arrays["stats"][2] = math.nan
    elif name == "min max":
        arrays["stats"][3], arrays["stats"][4] = 5.0, -5.0
    elif name == "sketch nan":
        arrays["sketch"][0, 0] = math.nan
    elif name == "sketch too big":
        arrays["sketch"][0, 0] = 1e30
    elif name == "abs sum inf":
        arrays["stats"][1] = math.inf  # sum of |x|: the sketch check would then be skipped
    elif name == "sq sum big":
        arrays["stats"][2] = 1e300
    elif name == "hash":
        arrays["nonfinite_hash"][0] = 5
    elif name == "depth":
        arrays["counts"][4] = 10**9
    elif name == "version":
        meta["version"] = 99
    elif name == "format":
        meta["format"] = "something else"
    elif name == "dtype":
        meta["dtype"] = "int32"
    elif name == "shape":
        meta["shape"] = [-1, 5]
    elif name == "shape mismatch":
        meta["shape"] = [5001]
    elif name == "params":
        meta["params"]["rows"] = 4
    elif name == "params keys":
        meta["params"]["extra"] = 1
    elif name == "not array":
        arrays["stats"] = list(arrays["stats"])
    return arrays, meta


@pytest.mark.parametrize("name,needle", [
    ("missing", "missing array"), ("sketch dtype", "'sketch' has dtype"), ("sketch shape", "'sketch' has shape"),
    ("samples dtype", "'samples' has dtype"), ("counts", "add up"), ("negative count", "non-negative"),
    ("nan stat", "NaN"), ("min max", "min <= max"), ("sketch nan", "sketch holds NaN"),
    ("sketch too big", "exceed the sum"), ("hash", "position hash"), ("depth", "rounding depth"),
    ("version", "newer"), ("format", "'format'"), ("dtype", "'dtype'"), ("shape", "'shape'"),
    ("shape mismatch", "'samples' has shape|add up"), ("params", "odd"), ("params keys", "params must be"),
    ("not array", "not a numpy array"), ("abs sum inf", "can add up to"), ("sq sum big", "can add up to"),
])
def test_malformed_arrays_are_rejected(name: str, needle: str) -> None:
    arrays, meta = _corrupt(name)
    with pytest.raises(FingerprintFormatError, match=needle):
        Fingerprint.from_arrays(arrays, meta)


# --------------------------------------------------------------------------- the device path, on CPU


class _Watch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op and the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.ops.add(func._schema.name)
        fresh = all(r.alias_info is None for r in func._schema.returns)  # views and in-place ops alias
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if fresh and isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# aten ops the kernel may use: each has a CUDA kernel for the dtypes used (int64, float64, the
# input's dtype); anything else appearing here must be checked before it is added. aten::cumsum
# only outside deterministic algorithms (CUDA's floating cumsum raises under them; the fold then
# adds in order: test_devices.py).
CUDA_OPS = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::slice", "aten::select", "aten::as_strided",
    "aten::expand", "aten::t", "aten::transpose", "aten::unsqueeze", "aten::alias", "aten::detach",
    "aten::view_as_real", "aten::empty", "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_",
    "aten::arange", "aten::copy_", "aten::_to_copy", "aten::to", "aten::lift_fresh", "aten::clone",
    "aten::mul", "aten::add", "aten::sub", "aten::rsub", "aten::abs", "aten::sum", "aten::dot", "aten::aminmax",
    "aten::min", "aten::max", "aten::stack", "aten::cat", "aten::isfinite", "aten::all", "aten::index_add_",
    "aten::gather", "aten::index", "aten::bitwise_and", "aten::bitwise_xor", "aten::bitwise_right_shift",
    "aten::cumsum", "aten::index_select", "aten::new_zeros", "aten::eq", "aten::ne", "aten::abs_", "aten::add_",
    "aten::mul_",
}


def test_device_path_moves_only_the_fingerprint_and_uses_cuda_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "get", lambda: None)  # the torch-ops path, which is what runs on a GPU
    transfers: list[int] = []
    real_to_host = sketch.to_host

    def spy(t: torch.Tensor) -> np.ndarray:
        transfers.append(t.numel())
        return real_to_host(t)

    monkeypatch.setattr(sketch, "to_host", spy)
    x = torch.randn(1_500_000)
    sketch.HASHES.clear()
    params = FingerprintParams()
    chunk = 1 << 16
    with _Watch() as watch:
        fp = compute_fingerprint(x, params, chunk=chunk)
    assert len(transfers) == 1  # one transfer, at the end: no per-chunk syncs
    assert transfers[0] * 8 <= params.nbytes(8)  # of fingerprint size, not tensor size
    assert "aten::_local_scalar_dense" not in watch.ops  # no .item()/bool() sync on the device
    assert "aten::nonzero" not in watch.ops  # data-dependent shapes only in the non-finite pass
    assert watch.ops <= CUDA_OPS, watch.ops - CUDA_OPS
    assert watch.largest <= max(chunk, 2 * params.rows * params.buckets**2)  # bounded memory
    assert fp.count == x.numel()


def test_device_path_with_nonfinite_values_syncs_only_in_its_second_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "get", lambda: None)  # the torch-ops path, which is what runs on a GPU
    transfers: list[int] = []
    real_to_host = sketch.to_host
    monkeypatch.setattr(sketch, "to_host", lambda t: transfers.append(t.numel()) or real_to_host(t))
    x = torch.randn(300_000)
    x[123_456] = math.nan
    fp = compute_fingerprint(x, chunk=1 << 16)
    assert len(transfers) == 2 and fp.nan == 1


def test_strided_input_is_staged_chunk_by_chunk() -> None:
    x = torch.randn(3000, 1000).t()  # not contiguous
    with _Watch() as watch:
        fp = compute_fingerprint(x, chunk=1 << 14)
    p = FingerprintParams()
    assert watch.largest <= max(1 << 14, 2 * p.rows * p.buckets**2)
    assert fp.identical(compute_fingerprint(x.contiguous(), chunk=1 << 14))

"""What a calibrated run costs: the float64 copy, the leaf checks' parameters, the floors, the scratch file.

The figures are in docs/performance.md (benchmarks/scale.py); these tests pin the mechanisms that
give them and that the verdicts and goldens stay what they were.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import activation_guard as ag
from activation_guard._core import native
from activation_guard._core.kernel import CHUNK
from activation_guard.store.floors import NoiseFloor, diff_stats


def masked_stats(x: torch.Tensor, ref: torch.Tensor) -> NoiseFloor:
    """diff_stats' definition, every position masked (equal or both-NaN positions count as zero,
    any other non-finite difference as infinite), chunk by chunk as it sums."""
    wide = torch.complex128 if (x.is_complex() or ref.is_complex()) else torch.float64
    xs, rs = x.reshape(-1), ref.reshape(-1)
    n = xs.numel()
    if n == 0:
        return NoiseFloor(0.0, 0.0)
    mx = torch.zeros((), dtype=torch.float64)
    ss = torch.zeros((), dtype=torch.float64)
    for i in range(0, n, CHUNK):
        a, b = xs[i : i + CHUNK].to(wide), rs[i : i + CHUNK].to(wide)
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        d = torch.nan_to_num(torch.where(same, torch.zeros_like(a), a - b).abs(), nan=math.inf)
        mx = torch.maximum(mx, d.max())
        ss = ss + (d * d).sum()
    m, r = torch.stack([mx, torch.sqrt(ss / n)]).tolist()
    return NoiseFloor(float(m), float(r))


SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e38, -1e38]


@contextlib.contextmanager
def torch_passes() -> Iterator[None]:
    """The torch path of the floors' arithmetic, as a process without the compiled library runs
    it (the compiled pass sums in another order: its own tests are in tests/test_native.py)."""
    with mock.patch.object(native, "available", lambda: None):
        yield


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1), specials=st.lists(
    st.tuples(st.integers(0, 2999), st.sampled_from(SPECIALS), st.booleans()), max_size=6),
    equal=st.floats(0, 1), dtype=st.sampled_from([torch.float32, torch.float16, torch.complex64]))
def test_diff_stats_is_the_masked_definition_bit_for_bit(n: int, seed: int, specials: list, equal: float,
                                                         dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    ref = x.to(torch.complex128 if dtype.is_complex else torch.float64) + 1e-3 * torch.randn(n, generator=g)
    keep = torch.rand(n, generator=g) < equal  # positions where the run equals its reference
    ref[keep] = x[keep].to(ref.dtype)
    for i, v, both in specials:
        if i < n:
            x[i] = v
            if both:
                ref[i] = v
    with torch_passes():
        got, want = diff_stats(x, ref), masked_stats(x, ref)
    assert np.array([got.max_abs, got.rms]).tobytes() == np.array([want.max_abs, want.rms]).tobytes()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 2 * CHUNK + 7), seed=st.integers(0, 2**31 - 1),
       xdt=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       rdt=st.sampled_from([torch.float16, torch.float32, torch.float64]), zeros=st.booleans(),
       specials=st.lists(st.tuples(st.integers(0, 10**7), st.sampled_from(SPECIALS)), max_size=3))
def test_diff_stats_of_every_dtype_pair_is_the_masked_definition(n: int, seed: int, xdt: torch.dtype,
                                                                 rdt: torch.dtype, zeros: bool, specials: list) -> None:
    """Either side narrower or wider (a cast's rounding measures a narrow value against a wide
    one), several chunks, all-equal values (a -0.0 maximum), and NaN or Inf anywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(xdt)
    noise = 1e-3 * torch.randn(n, generator=g, dtype=torch.float64)
    ref = x.to(rdt) if zeros else (x.to(torch.float64) + noise).to(rdt)
    if zeros and n:
        x[0], ref[0] = -0.0, 0.0
    for i, v in specials:
        if n:
            x[i % n] = v
    with torch_passes():
        got, want = diff_stats(x, ref), masked_stats(x, ref)
    assert np.array([got.max_abs, got.rms]).tobytes() == np.array([want.max_abs, want.rms]).tobytes()
    # the compiled pass: the same maximum, the sum in another order (eight fixed lanes)
    fast = diff_stats(x, ref)
    assert np.array([fast.max_abs]).tobytes() == np.array([want.max_abs]).tobytes()
    assert fast.rms == pytest.approx(want.rms, rel=1e-12, abs=0) or (math.isnan(fast.rms) and math.isnan(want.rms))


def test_diff_stats_over_several_chunks_with_a_late_nan() -> None:
    x = torch.randn(3 * CHUNK + 5, dtype=torch.float32)
    ref = x.double() + 1e-6
    x[-1] = math.nan
    assert diff_stats(x, ref).max_abs == math.inf
    ref[-1] = math.nan
    got, want = diff_stats(x, ref), masked_stats(x, ref)
    assert (got.max_abs, got.rms) == (want.max_abs, want.rms) and math.isfinite(got.rms)


SEEN: list[tuple[str, int, torch.dtype]] = []  # module-level: the float64 copy's probes note here too


class Probe(nn.Linear):
    """A Linear that notes the address and dtype of the weight each call of it sees."""

    def __init__(self, tag: str, *args: int):
        super().__init__(*args)
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((self.tag, self.weight.data_ptr(), self.weight.dtype))
        return super().forward(x)


def probe_model() -> nn.Module:
    torch.manual_seed(0)
    SEEN.clear()
    return nn.Sequential(Probe("a", 32, 64), nn.GELU(), Probe("b", 64, 8)).eval()


def test_the_leaf_checks_read_the_models_own_parameters(tmp_path: Path) -> None:
    """The float32 run of each leaf of the float64 copy uses the model's float32 weights as they
    are, not a conversion of the copy's (a model's worth of conversions per shadow forward)."""
    m = probe_model()
    ptr = m[0].weight.data_ptr()
    ag.record(m, torch.randn(4, 32), path=tmp_path / "g.h5", calibrate=True)
    seen = [(p, dt) for tag, p, dt in SEEN if tag == "a"]
    # the float64 copy's forward, its leaf check and the live forward; the last two on the
    # model's own weight
    assert [dt for _, dt in seen] == [torch.float64, torch.float32, torch.float32], seen
    assert [p for p, _ in seen[1:]] == [ptr, ptr], seen


def test_the_float64_copy_is_made_without_a_float32_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cloned: list[torch.dtype] = []
    real = nn.Parameter.__deepcopy__

    def counting(self: nn.Parameter, memo: dict) -> nn.Parameter:
        if id(self) not in memo:
            cloned.append(self.dtype)
        return real(self, memo)

    monkeypatch.setattr(nn.Parameter, "__deepcopy__", counting)
    m = probe_model()
    ag.record(m, torch.randn(4, 32), path=tmp_path / "g.h5", calibrate=True)
    assert cloned == []


class Drifting(nn.Module):
    """Writes into its own parameter on every call (a model that updates state in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w.add_(0.5)
        return x * self.w


def test_a_leaf_writing_its_parameter_leaves_the_model_as_a_plain_record_does(tmp_path: Path) -> None:
    a = nn.Sequential(nn.Linear(8, 8), Drifting()).eval()
    b = copy.deepcopy(a)
    x = torch.randn(3, 8)
    ag.record(a, x, path=tmp_path / "plain.h5")
    ag.record(b, x, path=tmp_path / "cal.h5", calibrate=True)
    assert torch.equal(a[1].w, b[1].w) and torch.equal(b[1].w, torch.full((8,), 1.5))


def test_the_shadows_scratch_file_is_not_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the golden is made durable: the shadow's float64 outputs are read back and deleted."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else str(fd))
        real(fd)

    m = probe_model()
    x = torch.randn(4, 32)
    monkeypatch.setattr(os, "fsync", spy)
    ag.record(m, x, path=tmp_path / "plain.h5")
    plain = len(synced)
    synced.clear()
    ag.record(m, x, path=tmp_path / "cal.h5", calibrate=True)
    assert len(synced) == plain and not any("activation_guard-shadow" in s for s in synced), synced


# --------------------------------------------------------------------------- the leaf checks' reach


class _EpsNorm(nn.Module):
    """Branches on the dtype: its float64 copy computes another function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.abs().mean() + torch.finfo(x.dtype).eps ** 0.5)


class _OwnForward(nn.Linear):
    """A Linear subclass with its own forward (that reads no weight's address: the per-call
    widened copy trips on that, and the leaves before it would run twice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_only_leaves_that_can_compute_differently_per_dtype_are_run_again(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.nn's own Linear, GELU, LayerNorm and Embedding compute one function in every dtype:
    the leaf checks skip them. The model's own code, a subclass with its own forward and nn.RMSNorm
    (its default epsilon follows the dtype) are re-run; a forward replaced on the instance is left
    alone by the leaf checks whatever its class."""
    from activation_guard.calibration import shadow

    ran: list[str] = []
    real = shadow._run_low

    def spy(mod: nn.Module, *args: object, **kwargs: object) -> object:
        ran.append(type(mod).__name__)
        return real(mod, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(shadow, "_run_low", spy)
    torch.manual_seed(0)
    patched = nn.Tanh()
    patched.forward = lambda x: torch.tanh(x)  # type: ignore[method-assign]
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), _EpsNorm(), _OwnForward(64, 64), patched,
                      nn.RMSNorm(64), nn.Linear(64, 8)).eval()
    ag.record(m, torch.randn(4, 32), path=tmp_path / "g.h5", calibrate=True)
    assert sorted(ran) == ["RMSNorm", "_EpsNorm", "_OwnForward"], ran


def test_a_default_epsilon_rmsnorm_is_still_found_computing_differently(tmp_path: Path) -> None:
    """nn.RMSNorm(eps=None) adds torch.finfo(x.dtype).eps: on small activations its float64 copy is
    another function, found by the leaf check, and a later 1% weight change still fails."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64, bias=False), nn.RMSNorm(64), nn.Linear(64, 16), nn.Tanh(),
                      nn.Linear(16, 8)).eval()
    x = torch.randn(8, 32) * 3e-4
    p = tmp_path / "g.h5"
    ag.record(m, (x,), path=p, calibrate=True)
    with ag.read_golden(p) as r:
        assert [row[:2] for row in r.meta["calibration"]["computes_differently"]] == [["1", 0]]
    assert ag.compare(m, (x,), path=p, tolerance="calibrated").ok
    changed = copy.deepcopy(m)
    with torch.no_grad():
        changed[4].weight.mul_(1.01)
    rep = ag.compare(changed, (x,), path=p, tolerance="calibrated")
    assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.name == "4", rep
    assert any("'1'[0]" in n and "computes differently" in n for n in rep.notes), rep.notes


# --------------------------------------------------------------------------- the scratch file


def test_the_shadows_outputs_never_have_a_path_and_are_gone_after(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The float64 outputs go to a file that is unlinked as it is created (no other process can
    open it, nothing is left even if this one dies) and closed when the run ends."""
    import tempfile

    from activation_guard.calibration import scratch

    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    seen: list[list[str]] = []
    opened: list[scratch.Scratch] = []
    real_add = scratch.Scratch.add

    def add(self: scratch.Scratch, name: str, call: int, path: str, t: torch.Tensor) -> None:
        seen.append([str(q) for q in private.rglob("*")])
        if self not in opened:
            opened.append(self)
        real_add(self, name, call, path, t)

    monkeypatch.setattr(scratch.Scratch, "add", add)
    m = probe_model()
    x = torch.randn(4, 32)
    ag.record(m, x, path=tmp_path / "g.h5", calibrate=True)
    assert ag.compare(m, x, path=tmp_path / "g.h5", tolerance="calibrated").ok
    assert seen and all(s == [] for s in seen), seen  # no name on disk while it is written
    assert len(opened) == 2 and all(s._fd is None for s in opened)  # one per run, closed after
    assert list(private.iterdir()) == []


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.complex128]),
       transpose=st.booleans())
def test_the_scratch_file_gives_back_every_value_bit_for_bit(shape: list[int], seed: int, dtype: torch.dtype,
                                                             transpose: bool) -> None:
    from activation_guard.calibration.scratch import Scratch

    g = torch.Generator().manual_seed(seed)
    s = Scratch()
    try:
        kept = []
        for k in range(3):
            t = torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)
            if transpose and t.dim() >= 2:
                t = t.transpose(0, -1)  # not contiguous
            s.add("layer", k, "", t)
            kept.append(t)
        for k, t in enumerate(kept):
            e = s.get("layer", k, "")
            assert e is not None
            back = s.load(e)
            assert back.dtype == t.dtype and back.shape == t.shape and back.is_contiguous()
            assert back.reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist()
            shared = s.load(e, shared=True)  # the floors' read: one buffer, reused
            assert shared.reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist()
        assert s.get("layer", 3, "") is None
    finally:
        s.close()


# --------------------------------------------------------------------------- one RMS per output


VALUE_SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 3e38, 1e-40]


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(0, 40), min_size=0, max_size=3), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64]),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([*VALUE_SPECIALS, 1e200])), max_size=3),
       transpose=st.booleans())
def test_the_rms_taken_once_is_both_masked_definitions_bit_for_bit(shape: list[int], seed: int, dtype: torch.dtype,
                                                                  specials: list, transpose: bool) -> None:
    """values_rms and abs_term (the allowance's absolute term) mask non-finite values; the judge
    takes the RMS once without masks where every square is finite: the same bits as both."""
    from activation_guard.calibration import calibrate as cal

    g = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    flat = g.view(-1)
    for i, v in specials:
        if flat.numel():
            flat[i % flat.numel()] = torch.tensor(v, dtype=torch.float64).to(dtype)  # 1e200: inf below float64
    if transpose and g.dim() >= 2:
        g = g.transpose(0, -1)

    def masked_rms(x: torch.Tensor) -> float | None:
        wide = torch.view_as_real(x).to(torch.float64) if x.is_complex() else x.to(torch.float64)
        sq = wide.square().sum(-1) if x.is_complex() else wide.square()
        sq = sq[torch.isfinite(sq)]
        return None if sq.numel() == 0 else float(sq.mean().sqrt())

    def masked_abs_term(x: torch.Tensor) -> float:
        y = (x.abs() if x.is_complex() else x).to(torch.float64)
        y = y[torch.isfinite(y)]
        if y.numel() == 0:
            return cal.ABS_TERM
        scale = float(y.square().mean().sqrt())
        return cal.ABS_TERM * min(1.0, scale) if scale > 0 else cal.ABS_TERM

    def bits(v: float | None) -> bytes | None:
        return None if v is None else np.float64(v).tobytes()

    with torch_passes():
        fast = cal._all_finite_rms(g)
        assert bits(cal.values_rms(g)) == bits(masked_rms(g))
        assert bits(cal.abs_term(g)) == bits(masked_abs_term(g))
        if fast is not None:
            assert bits(fast) == bits(masked_rms(g))
            assert bits(cal.abs_term(g, fast)) == bits(masked_abs_term(g))
    compiled = cal._all_finite_rms(g)  # the compiled pass where it takes the tensor: another summation order
    assert (compiled is None) == (fast is None)
    if fast is not None and compiled is not None:
        assert compiled == pytest.approx(fast, rel=1e-12, abs=0)


def test_a_full_disk_under_the_scratch_file_names_the_layer_and_the_fix(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from activation_guard.calibration import scratch

    m = probe_model()
    x = torch.randn(4, 32)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p, calibrate=True)
    before = p.read_bytes()

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(scratch.os, "pwrite", full)
    with pytest.raises(ag.ActivationGuardError, match=r"layer '0' call 0 .*No space left.*set TMPDIR"):
        ag.record(m, x, path=p, calibrate=True)
    assert p.read_bytes() == before  # the golden already there is untouched
    with pytest.raises(ag.ActivationGuardError, match="No space left"):
        ag.compare(m, x, path=p, tolerance="calibrated")


def test_the_scratch_file_without_positioned_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the OS has no pwrite/preadv (Windows) the file object seeks, with the same bytes."""
    from activation_guard.calibration.scratch import Scratch

    monkeypatch.delattr(os, "pwrite", raising=False)
    monkeypatch.delattr(os, "preadv", raising=False)
    s = Scratch()
    try:
        a, b = torch.randn(300, dtype=torch.float64), torch.randn(7, 5).to(torch.bfloat16)
        s.add("x", 0, "", a)
        s.add("x", 1, "0", b)
        ea, eb = s.get("x", 0, ""), s.get("x", 1, "0")
        assert ea is not None and eb is not None
        assert torch.equal(s.load(eb), b) and torch.equal(s.load(ea, shared=True), a)
    finally:
        s.close()


def test_a_dropout_in_training_is_still_run_again() -> None:
    """A training-mode Dropout draws its mask from the generator, and one stream per dtype is not
    promised on every device: it is re-run like the model's own code; in eval mode (the identity)
    or with p=0 it is not."""
    from activation_guard.calibration.shadow import same_in_every_dtype

    assert not same_in_every_dtype(nn.Dropout(0.1).train())
    assert same_in_every_dtype(nn.Dropout(0.1).eval())
    assert same_in_every_dtype(nn.Dropout(0.0).train())
    assert same_in_every_dtype(nn.Linear(2, 2).train())


@pytest.mark.parametrize("dt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("swap", [False, True])
def test_diff_stats_of_a_float8_value_against_its_float64_reference(dt: str, swap: bool) -> None:
    """diff_stats' one-buffer pass leaves torch to promote a narrow side to float64 inside the
    subtraction, which torch does not do for float8: those are widened first."""
    import torch

    from activation_guard.store.floors import diff_stats

    x = torch.randn(64, dtype=torch.float64)
    lo = x.to(getattr(torch, dt))
    a, b = (x, lo) if swap else (lo, x)
    got = diff_stats(a, b)
    want = (lo.to(torch.float64) - x).abs()
    assert got.max_abs == float(want.max())


def test_a_calibrated_record_of_a_model_with_a_float8_output(tmp_path: Path) -> None:
    """End to end: a calibrated record of a model whose last layer returns float8 activations
    measures its floors (torch does not promote float8 with float64 by itself): it records, compares OK
    unchanged and fails a 20% weight change at layer '0'."""
    import copy

    import torch
    from torch import nn

    import activation_guard as ag

    class Cast8(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.float8_e4m3fn)

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), Cast8()).eval()
    x = torch.randn(4, 8)
    p = tmp_path / "g.h5"
    ag.record(m, (x,), path=p, calibrate=True)
    assert ag.compare(m, (x,), path=p, tolerance="calibrated").ok
    ch = copy.deepcopy(m)
    with torch.no_grad():
        ch[0].weight.mul_(1.2)
    rep = ag.compare(ch, (x,), path=p, tolerance="calibrated")
    assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.name == "0"


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       transpose=st.booleans(), spare=st.integers(0, 64))
def test_the_golden_rms_in_a_reused_buffer_has_the_same_bits(shape: list[int], seed: int, dtype: torch.dtype,
                                                              transpose: bool, spare: int) -> None:
    """The judge squares each golden in one float64 buffer it keeps (the largest output's size),
    not a fresh copy per output: the same values in the same order, so the same RMS bit for bit."""
    from activation_guard.calibration.calibrate import _all_finite_rms

    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    if transpose and g.dim() > 1:
        g = g.transpose(0, -1)
    buf = torch.full((g.numel() + spare,), math.nan, dtype=torch.float64)[: g.numel()]
    with torch_passes():
        assert _all_finite_rms(g, buf) == _all_finite_rms(g)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1), gdt=st.sampled_from([torch.float32, torch.float64]),
       special=st.sampled_from([None, math.nan, math.inf, 1e200]))
def test_the_judges_one_pass_gives_what_each_alone_gives(n: int, seed: int, gdt: torch.dtype,
                                                         special: float | None) -> None:
    """The calibrated judge reads live and golden once for the error's statistics and the golden's
    RMS: the very numbers diff_stats and the RMS alone give, or None where one is not finite."""
    from activation_guard.calibration.calibrate import _all_finite_rms, _error_and_rms

    g = torch.Generator().manual_seed(seed)
    golden = torch.randn(n, generator=g, dtype=torch.float64).to(gdt)
    live = (golden.double() + 1e-4 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    if special is not None:
        golden[seed % n] = torch.tensor(special, dtype=torch.float64).to(gdt)  # 1e200: inf in float32
    err, rms = _error_and_rms(golden, live)
    if native.available() is None:
        assert (err, rms) == (None, None)
        return
    if err is not None:
        alone = diff_stats(live, golden)
        assert (err.max_abs, err.rms) == (alone.max_abs, alone.rms)
    else:
        assert special is not None
    assert rms == _all_finite_rms(golden)

"""What a calibrated run costs: the float64 copy, the leaf checks' parameters, the floors, the scratch file.

The figures are in docs/performance.md (benchmarks/scale.py); these tests pin the mechanisms that
give them and that the verdicts and goldens stay what they were.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import activation_guard as ag
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
    got, want = diff_stats(x, ref), masked_stats(x, ref)
    assert np.array([got.max_abs, got.rms]).tobytes() == np.array([want.max_abs, want.rms]).tobytes()


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

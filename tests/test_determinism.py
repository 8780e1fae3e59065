"""deterministic(): seeds, flags, and a complete restore on exit; check_determinism()."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import activation_guard as ag
from activation_guard._core import numerics
from activation_guard.api import determinism as det


def _observe() -> dict[str, object]:
    """Every setting deterministic() touches, as a comparable snapshot."""
    p = numerics.PrecisionFlags.capture()
    return {
        "det": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_det": torch.backends.cudnn.deterministic,
        "bench": torch.backends.cudnn.benchmark,
        "legacy": p.legacy,
        "fp32_precision": p.fp32_precision,
        "env": os.environ.get(det.CUBLAS_ENV),
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.get_state()[1].copy(),
        "py_rng": random.getstate(),
    }


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
        else bool(np.array_equal(a[k], b[k])) if isinstance(a[k], np.ndarray)
        else a[k] == b[k]
        for k in a
    )


@pytest.fixture(autouse=True)
def _guard_global_state():
    """Whatever a test does, leave the process as it found it (xdist workers are shared)."""
    flags = numerics.PrecisionFlags.capture()
    d, w = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cd, cb = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    env = os.environ.get(det.CUBLAS_ENV)
    yield
    torch.use_deterministic_algorithms(d, warn_only=w)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cd, cb
    flags.restore()
    if env is None:
        os.environ.pop(det.CUBLAS_ENV, None)
    else:
        os.environ[det.CUBLAS_ENV] = env


def test_seeds_torch_numpy_and_random() -> None:
    def draw() -> tuple[list[float], float, float]:
        return torch.rand(3).tolist(), float(np.random.rand()), random.random()

    with ag.deterministic(5) as state:
        first = draw()
        assert state.seed == 5
    with ag.deterministic(5):
        assert draw() == first
    with ag.deterministic(6):
        assert draw() != first


def test_sets_the_documented_flags() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    with ag.deterministic():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
        assert os.environ.get(det.CUBLAS_ENV) in (det.CUBLAS_DETERMINISTIC, os.environ.get(det.CUBLAS_ENV))
    with ag.deterministic(warn_only=True):
        assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_restores_everything_including_rng_states() -> None:
    torch.manual_seed(123)
    np.random.seed(9)
    random.seed(4)
    before = _observe()
    with ag.deterministic(0):
        torch.rand(10)
        np.random.rand(5)
        random.random()
    assert _same(_observe(), before)


def test_restores_on_exception() -> None:
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("medium")
    before = _observe()
    with pytest.raises(KeyError), ag.deterministic():
        torch.rand(2)
        raise KeyError("boom")
    assert _same(_observe(), before)


def test_usable_as_a_decorator() -> None:
    @ag.deterministic(3)
    def f() -> list[float]:
        assert torch.are_deterministic_algorithms_enabled()
        return torch.rand(2).tolist()

    before = _observe()
    assert f() == f()
    assert _same(_observe(), before)


@given(
    det_on=st.booleans(), warn_only=st.booleans(), cudnn_det=st.booleans(), bench=st.booleans(),
    mm_tf32=st.booleans(), cudnn_tf32=st.booleans(),
    precision=st.sampled_from(["highest", "high", "medium"]),
    env=st.sampled_from([None, ":16:8", ":4096:8"]),
)
def test_restores_any_starting_configuration(det_on, warn_only, cudnn_det, bench, mm_tf32, cudnn_tf32, precision,
                                             env) -> None:
    torch.use_deterministic_algorithms(det_on, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, bench
    torch.set_float32_matmul_precision(precision)
    torch.backends.cuda.matmul.allow_tf32 = mm_tf32
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    if env is None:
        os.environ.pop(det.CUBLAS_ENV, None)
    else:
        os.environ[det.CUBLAS_ENV] = env
    before = _observe()
    with ag.deterministic(1):
        assert os.environ[det.CUBLAS_ENV] == (env or det.CUBLAS_DETERMINISTIC)
    assert _same(_observe(), before)


@pytest.mark.slow
def test_restores_tf32_state_set_through_the_new_and_mixed_apis() -> None:
    """torch >= 2.9 has per-backend ``fp32_precision`` next to the legacy switches, and refuses
    to read legacy ones after a program mixed the two. Every such state must survive exactly.
    Runs in a separate interpreter (each scenario from a restored clean state) so that no
    mixed-API state can leak into other tests of this worker."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has only the legacy TF32 API")
    scenarios = [
        "b.cuda.matmul.allow_tf32 = True",
        "b.cudnn.allow_tf32 = False",
        "torch.set_float32_matmul_precision('medium')",
        "b.cuda.matmul.fp32_precision = 'tf32'",
        "b.cudnn.conv.fp32_precision = 'ieee'",
        "b.mkldnn.matmul.fp32_precision = 'bf16'",
        "b.fp32_precision = 'tf32'",
        "b.cuda.matmul.allow_tf32 = True; b.cudnn.rnn.fp32_precision = 'ieee'",
    ]
    driver = textwrap.dedent('''
        import sys, torch
        import activation_guard as ag
        from activation_guard.api.determinism import PrecisionFlags
        b = torch.backends
        clean = PrecisionFlags.capture()
        def obs():
            p = PrecisionFlags.capture()
            return p.legacy, p.fp32_precision
        for scenario in sys.argv[1:]:
            clean.restore()
            assert obs() == (clean.legacy, clean.fp32_precision), scenario
            exec(scenario)
            before = obs()
            with ag.deterministic():
                during = PrecisionFlags.capture()
                assert set(during.fp32_precision.values()) <= {"ieee", "none"}, (scenario, during)
                assert during.legacy.get("float32_matmul_precision", "highest") == "highest", scenario
                assert not during.legacy.get("cuda_matmul_allow_tf32") and not during.legacy.get("cudnn_allow_tf32")
            after = obs()
            assert after == before, (scenario, before, after)
        print("ok", len(sys.argv) - 1)
    ''')
    res = subprocess.run([sys.executable, "-c", driver, *scenarios], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == f"ok {len(scenarios)}"


def test_restores_cuda_rng_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA paths, unit-tested on CPU: saved states are put back when CUDA was initialized;
    otherwise the lazily seeded generators are re-seeded with the seed they had."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["state0"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: calls.append(("set", s)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: calls.append(("seed", s)))
    with ag.deterministic(11):
        pass
    assert ("seed", 11) in calls and calls[-1] == ("set", ["state0"])
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    torch.manual_seed(77)
    calls.clear()
    with ag.deterministic(11):
        pass
    assert calls == [("seed", 11), ("seed", 77)]


def test_bad_seed() -> None:
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="seed"), ag.deterministic(bad):  # type: ignore[arg-type]
            pass


def test_full_fp32_precision_is_scoped() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    before = _observe()
    with numerics.full_fp32_precision():
        assert not torch.backends.cuda.matmul.allow_tf32
    assert _same(_observe(), before)


# --------------------------------------------------------------------------- check_determinism


class Noisy(nn.Module):
    """``noise`` adds fresh random values on every call: the only nondeterministic layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.noise = NoiseLayer()
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.noise(self.fc1(x)))


class NoiseLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-3 * torch.rand_like(x)


def test_check_determinism_lists_only_layers_that_differ() -> None:
    torch.manual_seed(0)
    model, x = Noisy().eval(), torch.randn(3, 4)
    bad = ag.check_determinism(model, x)
    assert [r.name for r in bad] == ["noise", "fc2", ""]
    assert all(r.max_abs_diff and r.max_abs_diff > 0 for r in bad)
    assert ag.check_determinism(model, x, exclude=["noise", "fc2", ""]) == []
    assert [r.name for r in ag.check_determinism(model, x, include="noise", runs=3)] == ["noise"]


def test_check_determinism_on_a_deterministic_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.5)).eval()
    assert ag.check_determinism(model, torch.randn(2, 4)) == []
    model.train()  # dropout in training mode is nondeterministic, and found
    assert "2" in [r.name for r in ag.check_determinism(model, torch.randn(2, 4))]


@pytest.mark.parametrize("runs", [1, 0, 2.5, True])
def test_check_determinism_runs_validated(runs: object) -> None:
    with pytest.raises(ValueError, match="runs"):
        ag.check_determinism(nn.Linear(2, 2), torch.randn(1, 2), runs=runs)  # type: ignore[arg-type]


def test_deterministic_makes_a_noisy_model_repeatable(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Noisy().eval(), torch.randn(3, 4)
    with ag.deterministic(0):
        ag.record(model, x, path=tmp_path / "g.h5")
    with ag.deterministic(0):
        assert ag.compare(model, x, path=tmp_path / "g.h5", rtol=0, atol=0).ok


def test_check_determinism_leaves_the_callers_random_state_alone() -> None:
    """--ag-check-determinism runs it before a test's real compare: a seeded dropout model once
    failed only with the flag, because the check advanced the generator."""
    import random

    import numpy as np

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expect = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    assert [r.name for r in ag.check_determinism(model, torch.ones(2, 4))] == ["1", ""]
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == expect

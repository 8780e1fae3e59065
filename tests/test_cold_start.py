"""The first fingerprint recording of a process: the compiled pass is built beside the forward.

A build costs about a CPU-second (more than a 271M-parameter model's forward); a recording starts
it on a thread of its own and the forward goes on, its leaves held by the fingerprint worker
until the library is there. The golden is the one a process with the library already built
writes, byte for byte. Figures: docs/performance.md (benchmarks/scale.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import activation_guard as ag
from activation_guard._core import native
from activation_guard.capture import fingerprints as capture_fingerprints
from activation_guard.fingerprints import worker as fingerprint_worker

HAVE = native.get() is not None
needs_native = pytest.mark.skipif(not HAVE, reason=f"no compiled pass here: {native.status()}")


def model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU()]
    return nn.Sequential(*layers).eval(), torch.randn(300, 256)  # 76,800-element outputs


@pytest.fixture
def slow_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    """A build that finishes only once ``state["go"]`` is set (or after a few seconds): whether
    the forward reached its last layer while the compiler was still at work."""
    real = native.build
    state: dict[str, object] = {"go": threading.Event(), "timed_out": None, "threads": []}

    def build(extra_flags: tuple[str, ...] = ()) -> tuple[native.Native | None, str]:
        state["threads"].append(threading.current_thread().name)  # type: ignore[attr-defined]
        go = state["go"]
        assert isinstance(go, threading.Event)
        state["timed_out"] = not go.wait(timeout=5)
        return real(extra_flags)

    monkeypatch.delenv(fingerprint_worker.ENV, raising=False)
    monkeypatch.delenv(native.ENV, raising=False)
    native.reset()
    monkeypatch.setattr(native, "build", build)
    yield state
    monkeypatch.undo()
    native.reset()


@needs_native
@pytest.mark.parametrize("free_core", [False, True])
def test_the_forward_goes_on_while_the_compiled_pass_is_built(
        slow_build: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free_core: bool) -> None:
    """With a free core (the worker's case) and without one (the hook would compute inline): the
    forward's last layer runs before the build is done, and the golden equals a warm one."""
    monkeypatch.setattr(capture_fingerprints, "wanted", lambda: free_core)
    m, x = model()
    go = slow_build["go"]
    assert isinstance(go, threading.Event)
    m[-1].register_forward_hook(lambda *_: go.set())
    cold = tmp_path / "cold.h5"
    ag.record(m, x, path=cold, fingerprint=True)
    assert slow_build["timed_out"] is False, "the forward waited for the build at its first leaf"
    assert slow_build["threads"] == ["activation_guard-native-build"]
    assert native.ready() and native.built() is not None
    warm = tmp_path / "warm.h5"
    ag.record(m, x, path=warm, fingerprint=True)
    assert cold.read_bytes() == warm.read_bytes()
    with ag.read_golden(cold) as g:
        assert sum(leaf.kind == "fingerprint" for c in g.calls for leaf in c.leaves) == 9  # 8 layers and the root


@needs_native
def test_start_never_blocks_and_builds_once(slow_build: dict[str, object]) -> None:
    assert native.start() is False and native.start() is False and not native.ready()
    assert native.built() is None
    go = slow_build["go"]
    assert isinstance(go, threading.Event)
    go.set()
    assert native.get() is not None and native.start() is True
    assert slow_build["threads"] == ["activation_guard-native-build"]


def test_the_avx512_functions_are_built_only_where_the_cpu_has_them(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    import builtins

    real_open = builtins.open
    cpuinfo = tmp_path / "cpuinfo"

    def fake_open(path: object, *a: object, **k: object) -> object:
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", fake_open)
    cpuinfo.write_text("processor : 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert native._unused_widths() == ("-DAG_NO_AVX512",)
    cpuinfo.write_text("processor : 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n")
    assert native._unused_widths() == ()
    cpuinfo.unlink()
    assert native._unused_widths() == ()  # unreadable: everything is built, ag_simd picks

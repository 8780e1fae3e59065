"""The compiled fingerprint pass (native.py, csrc/fpchunk.c) against the torch ops it replaces.

The sketch must be the torch path's bit for bit (same hashes, same order of additions), the
statistics equal within their rounding depth, min, max, samples, counts and depth equal; so a
golden recorded on a machine with a compiler compares clean on one without, and the reverse.
Where no compiler is found the tests of the compiled pass skip, and the fallback tests still run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from activation_guard._core import native
from activation_guard._core.errors import OptionError
from activation_guard.api import run as api
from activation_guard.fingerprints import plan as fingerprint_plan
from activation_guard.fingerprints import sketch
from activation_guard.fingerprints import worker as fingerprint_worker
from activation_guard.fingerprints.fingerprint import Fingerprint, FingerprintParams, compute_fingerprint

HAVE = native.get() is not None
needs_native = pytest.mark.skipif(not HAVE, reason=f"no compiled pass here: {native.status()}")


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The torch ops path for the duration of a test, then whatever this process had."""
    monkeypatch.setenv(native.ENV, "0")
    native.reset()
    yield
    monkeypatch.undo()
    native.reset()


@pytest.fixture
def no_prebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """As in a source tree or an install that had no compiler: no library built at install time,
    so the process builds its own (what these tests are about)."""
    monkeypatch.setattr(native, "PREBUILT", tmp_path / "absent" / native.PREBUILT.name)
    native.reset()
    yield
    monkeypatch.undo()
    native.reset()


def both(t: torch.Tensor, params: FingerprintParams | None = None, chunk: int = sketch.CHUNK
         ) -> tuple[Fingerprint, Fingerprint]:
    """The fingerprint of ``t`` by the compiled pass, then by torch ops."""
    assert native.get() is not None
    fast = compute_fingerprint(t, params, chunk=chunk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "get", lambda: None)  # what sketch.py asks; no rebuild afterwards
        slow = compute_fingerprint(t, params, chunk=chunk)
    return fast, slow


def assert_same(fast: Fingerprint, slow: Fingerprint) -> None:
    assert fast.sketch.tobytes() == slow.sketch.tobytes()  # bit for bit
    assert (fast.min, fast.max, fast.count, fast.nan, fast.posinf, fast.neginf) == (
        slow.min, slow.max, slow.count, slow.nan, slow.posinf, slow.neginf)
    assert fast.samples.tobytes() == slow.samples.tobytes() and fast.depth == slow.depth
    assert fast.nonfinite_hash == slow.nonfinite_hash
    eps = 2.0**-52
    for a, b, size in ((fast.sum, slow.sum, fast.abs_sum), (fast.abs_sum, slow.abs_sum, fast.abs_sum),
                       (fast.sq_sum, slow.sq_sum, fast.sq_sum)):
        assert abs(a - b) <= 2 * fast.depth * eps * size + 1e-300, (a, b)  # both within their rounding bound


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("shape", [(), (1,), (1031,), (64, 129), (4, 1, 513), (3, 70000)])
def test_compiled_pass_matches_torch_ops(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 3).to(dtype)
    assert_same(*both(t))


@needs_native
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5000), buckets=st.sampled_from([16, 64, 256]), rows=st.sampled_from([1, 3, 5]),
       chunk=st.sampled_from([1024, 2048]), seed=st.integers(0, 2**31), f64=st.booleans(),
       strided=st.booleans())
def test_compiled_pass_matches_torch_ops_everywhere(n: int, buckets: int, rows: int, chunk: int, seed: int,
                                                  f64: bool, strided: bool) -> None:
    """Any length (partial last block, several chunks; one fold: several are the next test's),
    parameters and layout."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(2 * n if strided else n, generator=g, dtype=torch.float64 if f64 else torch.float32)
    t = t[::2] if strided else t
    p = FingerprintParams(seed=seed, rows=rows, buckets=buckets, samples=8)
    assert_same(*both(t, p, chunk=max(chunk, buckets)))


@pytest.fixture(scope="module")
def every_build() -> list[native.Native]:
    """The baseline build (two-lane vectors), one without AVX-512 (four lanes on an AVX2 CPU), one
    converting floats through memory, and the one this process uses (eight lanes on an AVX-512 CPU;
    on a CPU without AVX-512 the comparison covers the narrower widths only)."""
    libs = []
    for flags in (("-DAG_NO_AVX2",), ("-DAG_NO_AVX512",), ("-DAG_NO_CONVERT",)):
        lib, why = native.build(flags)
        assert lib is not None, why
        libs.append(lib)
    fast = native.get()
    assert fast is not None
    return [*libs, fast]


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [5, 3, 7])  # five: rows routed beside the statistics; others row by row
def test_every_build_computes_the_same_bits(every_build: list[native.Native], dtype: torch.dtype,
                                            rows: int) -> None:
    """Every vector width sums each lane in the same order and routes each element alone: statistics
    and sketch agree bit for bit, so a golden does not depend on the CPU or the compiler."""
    buckets, n = 64, 64 * 700 + 13  # a partial last block: the scalar tail too
    K = -(-n // buckets)
    g = torch.Generator().manual_seed(3 + rows)
    x = (torch.randn(n, generator=g) * 10).to(dtype)
    w = torch.randint(0, 2, (rows, K + buckets - 1), generator=g).double() * 2 - 1
    route = torch.randint(0, 2 * buckets, (rows, K), generator=g) + (torch.arange(rows) * 2 * buckets).view(-1, 1)
    out = []
    for lib in every_build:
        routed = torch.zeros(rows * 2 * buckets, buckets, dtype=torch.float64)
        stats = torch.empty(5, dtype=torch.float64)
        lib.chunk(x, rows, buckets, w, route, routed, stats, torch.empty(buckets, dtype=torch.float64))
        out.append((routed.numpy().tobytes(), stats.numpy().tobytes()))
    assert all(o == out[0] for o in out[1:])
    assert torch.frombuffer(bytearray(out[0][1]), dtype=torch.float64)[3].item() == x.double().min().item()


@needs_native
@pytest.mark.parametrize(("dtype", "buckets"), [(torch.float32, 16), (torch.float64, 16), (torch.bfloat16, 32)])
@pytest.mark.parametrize("one_call", [True, False])  # ag_leaf, or a compiled call per chunk from Python
def test_several_fold_windows_match_torch_ops(dtype: torch.dtype, buckets: int, one_call: bool) -> None:
    """A window holds FLUSH_BLOCKS blocks (262,144 values at 16 buckets): 600,000 values take three
    folds, the compiled fold's and cumsum's sums over m in order agree at each, and the depth
    counts them alike (ag_leaf folds in C: its count shows in the depth)."""
    # float64 values with all 53 bits: float32 values sum exactly in float64 whatever the order, so
    # only these make a fold at another block change a bit
    t = torch.randn(600_000, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    p = FingerprintParams(buckets=buckets, rows=3, samples=16)
    folds = []
    real_fold = sketch._Sketcher.fold

    def counting(self: sketch._Sketcher) -> None:
        folds.append(self.window)
        real_fold(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sketch._Sketcher, "fold", counting)
        if not one_call:
            mp.setattr(fingerprint_plan, "LEAF_ELEMENTS", 0)
        fast, slow = both(t, p)
    windows = -(-600_000 // (sketch.FLUSH_BLOCKS * buckets))
    in_python = 1 if one_call and dtype in (torch.float32, torch.float64) else 2  # bf16 is widened chunk by chunk
    assert len(folds) == in_python * windows
    assert_same(fast, slow)


@needs_native
def test_nonfinite_values_take_the_masked_torch_pass_and_agree() -> None:
    t = torch.randn(50000)
    t[[3, 40000]] = float("nan")
    t[7] = float("inf")
    t[49999] = float("-inf")
    fast, slow = both(t)
    assert (fast.nan, fast.posinf, fast.neginf) == (2, 1, 1)
    assert_same(fast, slow)


@pytest.mark.slow
@needs_native
def test_status_names_the_compiled_pass_and_the_env_switch_turns_it_off(no_prebuilt: None, torch_path: None) -> None:
    assert native.get() is None
    assert native.status() == f"torch ops (disabled by {native.ENV}=0)"
    native.reset()
    os.environ[native.ENV] = "1"
    assert native.status().startswith("compiled C pass (built at run time with ")


@pytest.mark.parametrize(("value", "built"), [("off", False), ("No", False), ("auto", True), ("on", True),
                                              (" true ", True)])
@pytest.mark.slow
def test_the_env_switch_speaks_the_workers_words(monkeypatch: pytest.MonkeyPatch, value: str, built: bool) -> None:
    """One vocabulary for both switches (switches.py): off/0/false/no, on/1/true/yes, auto or unset."""
    monkeypatch.setenv(native.ENV, value)
    monkeypatch.setenv(fingerprint_worker.ENV, value)
    lib, why = native.build()
    if built:  # (or it says why not: a machine without a compiler)
        assert lib is not None or "compiler" in why or "failed" in why, why
    else:
        assert lib is None and why == f"disabled by {native.ENV}={value}"
    assert fingerprint_worker.wanted() == (built if value.strip().lower() != "auto" else fingerprint_worker.free_core())


def test_an_unknown_env_value_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to mean "on" here and was an error for the worker's switch."""
    monkeypatch.setenv(native.ENV, "maybe")
    with pytest.raises(OptionError, match=rf"{native.ENV}='maybe' \(environment variable\): expected auto, on"):
        native.build()


def test_a_bad_native_switch_is_refused_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With the worker on, the first fingerprint is taken on the worker thread: the switch is read
    before, so the error is the OptionError itself, not a failed fingerprint (found by review)."""
    monkeypatch.setenv(fingerprint_worker.ENV, "on")
    monkeypatch.setenv(native.ENV, "maybe")
    native.reset()
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.ReLU())
    with pytest.raises(OptionError, match=native.ENV):
        api.record(model, (torch.randn(400, 300),), path=tmp_path / "g.h5", fingerprint=True)
    assert not (tmp_path / "g.h5").exists()
    monkeypatch.undo()
    native.reset()


def test_without_a_compiler_the_torch_path_runs_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path, no_prebuilt: None) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv(native.ENV, raising=False)
    native.reset()
    try:
        assert native.get() is None
        assert native.status() == f"torch ops ($CC={str(tmp_path / 'no-such-cc')!r}: " \
                                  f"{str(tmp_path / 'no-such-cc')!r} was not found on the PATH)"
        t = torch.randn(3000)
        assert compute_fingerprint(t).count == 3000
    finally:
        monkeypatch.undo()
        native.reset()


@pytest.mark.slow
@needs_native
def test_a_library_that_does_not_load_falls_back_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A temporary folder mounted noexec: the build succeeds and the load fails."""
    def noexec(path: str) -> None:
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(native.ctypes, "CDLL", noexec)
    lib, why = native.build()
    assert lib is None and "could not be loaded" in why and "failed to map segment" in why, why


@needs_native
def test_cc_may_carry_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CC="gcc -m64"`` is a compiler and its arguments, as make reads it."""
    found = native.compiler()
    assert found is not None
    monkeypatch.setenv("CC", f"{Path(found[0]).name} -DAG_NO_AVX2")
    lib, why = native.build()
    assert lib is not None and why == f"built at run time with {found[0]} -DAG_NO_AVX2", why


def test_a_failing_build_falls_back_and_names_the_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           no_prebuilt: None) -> None:
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'broken-cc: cannot build' >&2\nexit 3\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.delenv(native.ENV, raising=False)
    native.reset()
    try:
        assert native.get() is None
        assert native.status() == f"torch ops (the build with {cc} failed: exit 3: broken-cc: cannot build)"
    finally:
        monkeypatch.undo()
        native.reset()


@pytest.mark.parametrize(("cc", "says"), [
    ('gcc "-DX', "cannot read $CC='gcc \"-DX': No closing quotation"),
    ("ccache-that-is-not-here gcc", "'ccache-that-is-not-here' was not found on the PATH"),
    ("cc -O2 -ffast-math", "carries -ffast-math, which would turn on flush-to-zero"),
    ("cc -Ofast", "carries -Ofast"),
])
def test_a_cc_that_cannot_be_used_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch, cc: str,
                                                               says: str) -> None:
    """Never an exception from a fingerprint: the torch path, and status() says why."""
    monkeypatch.setenv("CC", cc)
    monkeypatch.delenv(native.ENV, raising=False)
    lib, why = native.build()
    assert lib is None and says in why, why


def test_a_fork_during_the_build_leaves_the_child_a_free_lock() -> None:
    saved_lock, saved = native._lock, dict(native._state)
    try:
        native._lock.acquire()  # as if another thread were building when the process forked
        native._state.clear()
        native._after_fork_in_child()
        assert not native._lock.locked() and native._state == {}
    finally:
        saved_lock.release()
        native._lock = saved_lock
        native._state.clear()
        native._state.update(saved)


@pytest.mark.slow
@needs_native
def test_a_thread_with_the_smallest_stack_survives(tmp_path: Path) -> None:
    """The C side keeps no large array on its stack (a review crashed a 32 KiB-stack thread)."""
    script = tmp_path / "small_stack.py"
    script.write_text(
        "import threading, torch\n"
        "from activation_guard.fingerprints.fingerprint import compute_fingerprint, FingerprintParams\n"
        "threading.stack_size(32768)\n"
        "out = []\n"
        "p = FingerprintParams(buckets=4096, rows=1)\n"
        "t = threading.Thread(target=lambda: out.append(compute_fingerprint(torch.randn(300000), p)))\n"
        "t.start(); t.join()\n"
        "print(out[0].count)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.returncode == 0 and r.stdout.strip() == "300000", (r.returncode, r.stderr[-2000:])


@pytest.mark.slow
@needs_native
def test_a_misaligned_tensor_is_widened_first_and_agrees() -> None:
    """``torch.frombuffer`` at an odd offset gives float32 values the C side must not read in place."""
    raw = bytearray(4 * 50001 + 1)
    t = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=50001)
    t.copy_(torch.randn(50001))
    assert t.data_ptr() % 4 != 0
    assert_same(*both(t))


@needs_native
@pytest.mark.parametrize("bad", ["meta stats", "int stats", "short w", "short route", "strided x", "small routed",
                                 "small scratch", "misaligned x", "buckets"])
def test_bad_arguments_are_refused_before_reaching_c(bad: str) -> None:
    """The C side trusts its pointers: a wrong tensor must raise, not write out of bounds."""
    lib = native.get()
    assert lib is not None
    rows, buckets, n = 3, 16, 160
    K = n // buckets
    args = dict(x=torch.randn(n), w=torch.ones(rows, K + buckets - 1, dtype=torch.float64),
                route=torch.zeros(rows, K, dtype=torch.int64),
                routed=torch.zeros(rows * 2 * buckets, buckets, dtype=torch.float64),
                stats=torch.empty(5, dtype=torch.float64), scratch=torch.empty(buckets, dtype=torch.float64))
    lib.chunk(args["x"], rows, buckets, args["w"], args["route"], args["routed"], args["stats"],
              args["scratch"])  # well formed: runs
    assert args["stats"][0].item() == pytest.approx(args["x"].double().sum().item())
    b = buckets
    if bad == "meta stats":
        args["stats"] = torch.empty(5, dtype=torch.float64, device="meta")
    elif bad == "int stats":
        args["stats"] = torch.empty(5, dtype=torch.int64)
    elif bad == "short w":
        args["w"] = args["w"][:, :-1]
    elif bad == "short route":
        args["route"] = args["route"][:2]
    elif bad == "strided x":
        args["x"] = torch.randn(2 * n)[::2]
    elif bad == "small routed":
        args["routed"] = args["routed"][:-1]
    elif bad == "small scratch":
        args["scratch"] = args["scratch"][:-1]
    elif bad == "misaligned x":
        args["x"] = torch.frombuffer(bytearray(4 * n + 1), dtype=torch.float32, offset=1, count=n)
    else:
        b = 8192
    with pytest.raises(ValueError, match="wrong dtype, device, shape or layout"):
        lib.chunk(args["x"], rows, b, args["w"], args["route"], args["routed"], args["stats"], args["scratch"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 512)
        self.b = nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.slow
@needs_native
def test_goldens_cross_between_the_two_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded by one pass, compared by the other: the unchanged model passes both ways with
    every layer fingerprinted, and a 1% weight change fails at its layer."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(256, 64)
    for record_native in (True, False):
        path = tmp_path / f"g{record_native}.h5"
        monkeypatch.setenv(native.ENV, "1" if record_native else "0")
        native.reset()
        api.record(model, (x,), path=path, fingerprint=True)
        monkeypatch.setenv(native.ENV, "0" if record_native else "1")
        native.reset()
        assert (native.get() is None) == record_native
        report = api.compare(model, (x,), path=path)
        assert report.ok and report.counts()["match"] >= 3 and report.estimated(), str(report)
        with torch.no_grad():
            model.b.weight.mul_(1.01)
        report = api.compare(model, (x,), path=path)
        with torch.no_grad():
            model.b.weight.div_(1.01)
        first = report.first_divergence
        assert not report.ok and first is not None and first.name == "b", str(report)
    monkeypatch.undo()
    native.reset()


@pytest.fixture(scope="module")
def copy_builds() -> list[native.Native]:
    """The copy with streaming stores (this process's build) and without (``-DAG_NO_STREAM``)."""
    plain, why = native.build(("-DAG_NO_STREAM",))
    fast = native.get()
    assert plain is not None and fast is not None, why
    return [fast, plain]


@needs_native
@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(0, 200), st.integers(65536 - 70, 65536 + 70), st.integers(0, 300_000)),
       src_off=st.integers(0, 63), dst_off=st.integers(0, 63), seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_the_workers_copy_puts_every_byte_in_place(copy_builds: list[native.Native], n: int, src_off: int,
                                                    dst_off: int, seed: int) -> None:
    """``ag_copy`` at any alignment and length (its aligned head, the streamed blocks and the tail),
    streaming or not: exactly the n bytes land, nothing beside them is touched."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=g)
    for lib in copy_builds:
        dst = torch.full((n + 192,), 0xA5, dtype=torch.uint8)
        lib.copy_fn(dst.data_ptr() + 64 + dst_off, src.data_ptr() + src_off, n)
        assert torch.equal(dst[64 + dst_off : 64 + dst_off + n], src[src_off : src_off + n])
        assert bool((dst[: 64 + dst_off] == 0xA5).all()) and bool((dst[64 + dst_off + n :] == 0xA5).all())


@needs_native
@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), xf64=st.booleans(),
       rkind=st.sampled_from(["f32", "f64", None]), scale=st.sampled_from([1e-30, 1.0, 1e30]))
def test_the_compiled_noise_floor_sums_are_the_float64_definition(n: int, seed: int, xf64: bool, rkind: str | None,
                                                                  scale: float) -> None:
    """``Native.diff``: the largest |x - ref| exactly, and the sum of squares of the float64 differences
    within the rounding of its order (eight lanes, in index order)."""
    lib = native.get()
    assert lib is not None
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(torch.float64 if xf64 else torch.float32)
    ref = None if rkind is None else (x.double() + 1e-3 * scale * torch.randn(n, generator=g, dtype=torch.float64)).to(
        torch.float64 if rkind == "f64" else torch.float32)
    got = lib.diff(x, ref)
    assert got is not None
    d = x.double() - (0.0 if ref is None else ref.double())
    assert got[0] == float(d.abs().max())
    exact = math.fsum(v * v for v in d.tolist())
    assert got[1] == pytest.approx(exact, rel=1e-13, abs=0)


@needs_native
def test_the_compiled_noise_floor_refuses_what_it_does_not_take() -> None:
    lib = native.get()
    assert lib is not None
    x = torch.randn(64)
    assert lib.diff(x[::2], None) is None  # strided
    assert lib.diff(x.half(), None) is None  # another dtype
    assert lib.diff(x, torch.randn(63)) is None  # another size
    assert lib.diff(x, x.double()) is not None


@pytest.mark.slow
@needs_native
def test_every_build_computes_the_same_noise_floor_bits(every_build: list[native.Native]) -> None:
    """The floors' sums in eight fixed lanes: the baseline and every vector width agree bit for bit,
    so a golden's floors do not depend on the CPU the compiled pass runs on."""
    g = torch.Generator().manual_seed(5)
    n = 8 * 9000 + 5  # the scalar tail too
    x = torch.randn(n, generator=g)
    ref = x.double() + 1e-7 * torch.randn(n, generator=g, dtype=torch.float64)
    for args in ((x, ref), (x, x + 1e-6), (ref, None), (x, None)):
        outs = {lib.diff(*args) for lib in every_build}
        assert len(outs) == 1, outs


@needs_native
def test_the_compiled_noise_floor_gives_the_same_bits_on_one_thread_or_two() -> None:
    """Its sums go block by block in block order, whichever thread takes a block."""
    lib = native.get()
    assert lib is not None
    g = torch.Generator().manual_seed(11)
    n = 5 * native.DIFF_BLOCK + 77
    x = torch.randn(n, generator=g)
    ref = x.double() + 1e-7 * torch.randn(n, generator=g, dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lib.diff(x, ref)
        torch.set_num_threads(2)
        two = lib.diff(x, ref)
    finally:
        torch.set_num_threads(before)
    assert one == two and one is not None
    assert one[2] == pytest.approx(float((ref * ref).sum()), rel=1e-12)

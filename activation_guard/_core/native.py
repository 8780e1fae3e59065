"""The optional compiled fingerprint pass: built at install time, else at first use with the system C compiler.

Fingerprinting in torch ops reads every element ~15 times (a float64 copy, min/max, three sums,
and per sketch row a signed copy and an ``index_add_`` of 64-element slices); one fused C pass
(``csrc/fpchunk.c``) reads each block once. The kernel alone went from 2.3x to 0.33x a plain
forward on the ``wide`` benchmark and from 0.96x to 0.15x on GPT-2 small (docs/performance.md).
It is an accelerator, never a requirement:

- no compiler, a failed build or ``ACTIVATION_GUARD_NATIVE=0`` leaves the torch path, which
  computes the same fingerprint (the sketch bit for bit, the statistics within their rounding
  bound); :func:`status` says which path runs and why;
- an install (``pip install``, a wheel, ``python setup.py build_ext --inplace``) builds the library
  next to this file (``_fpchunk.so``: every vector width, ``ag_simd`` picks at run time). It is
  package code, as trusted as the .py files beside it, and used only while the SHA-256 of
  ``csrc/fpchunk.c`` and the flags it embeds equal this tree's (an edited source in a development
  tree, or a library left from an older install, is refused, and :func:`status` says why);
- without one (no compiler at install time, a refused one, a source tree), the library is built
  into a fresh private temporary folder per process and unlinked once loaded: no shared cache to
  go stale, to race on under xdist, or for another user to plant a library in. That build
  compiles only the vector widths this CPU runs (plain C, no torch headers; a third of a second
  of CPU to a second, docs/performance.md), so :func:`start` begins it on a thread of its own as
  a recording starts, and the fingerprint worker holds leaves until it is done
  (:mod:`..fingerprints.worker`).

The call goes through ctypes, which releases the GIL: the fingerprint worker thread then runs
beside the forward on another core.

The same library also has the calibrated noise floors' one pass (``ag_diff``: the largest
``|x - ref|`` and the sum of squares, in fixed lanes, where torch takes four passes); the floors
use it only where the library is at hand without a build (:func:`available`), and the torch path
otherwise (the same maximum; the sum in torch's order, within the same rounding depth).

About 440 lines, over the ~400 we aim for: finding, checking (source hash, flags, version) and
loading a library, building one where none fits, and binding its entry points with the checks
the C side trusts are one concern: which native code this process runs, and why.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import functools
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import switches
from .nativebuild import FLAGS, PREBUILT_NAME, SOURCE, compile_library, compiler, source_sha
from .nativebuild import BuildError as _BuildError

VERSION = 8  # ag_version() of the source this module speaks to
ENV = "ACTIVATION_GUARD_NATIVE"
PREBUILT = Path(__file__).with_name(PREBUILT_NAME)  # the library an install built (setup.py)
_P = ctypes.c_void_p
_I = ctypes.c_int64
_ARGTYPES = [_P, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P]


@dataclass(frozen=True, eq=False)  # hashed by identity: plans are cached per library
class Native:
    """The loaded library's entry points: a chunk of float32 or float64 values, the fold, a whole
    leaf (``ag_leaf``), the worker's copy (``ag_copy``), and which vector width they use."""

    f32: Callable[..., None]
    f64: Callable[..., None]
    fold_fn: Callable[..., None]
    leaf_fn: Callable[..., None]  # ag_leaf: called by fingerprint_plan.LeafPlan, which checks its arguments
    simd: int  # ag_simd(): which chunk functions ag_leaf calls (all compute the same bits)
    # ag_copy(dst, src, n) as a PYFUNCTYPE function, which keeps the GIL: the fingerprint worker's
    # snapshot, on the forward's thread (fingerprint_worker.FingerprintWorker._copy says why)
    copy_fn: Callable[[int, int, int], None]
    lib: ctypes.CDLL  # keeps the library mapped for copy_fn, which holds only its address
    diff_fn: Callable[..., None]  # ag_diff: a noise floor's max |x - ref| and sum of squares

    def diff(self, x: torch.Tensor, ref: torch.Tensor | None) -> tuple[float, float, float] | None:
        """``max |x - ref|``, ``sum((x - ref) ** 2)`` and ``sum(ref ** 2)`` in float64 in one pass
        (``ref`` None: of ``x`` itself, the last 0), or None where the C side does not take these
        tensors (not float32/float64, not contiguous, not on the CPU, of other sizes): the caller's
        torch path then runs. A non-finite result means a NaN, an infinity or an overflow somewhere:
        the caller's torch path says which. The sums go block by block (:data:`DIFF_BLOCK` elements,
        added in block order), the blocks shared with a second thread when torch has more than
        one: the same bits with any number of threads."""
        ok = (x.device.type == "cpu" and x.dtype in _DIFF_DTYPES and x.is_contiguous() and not x.is_conj()
              and not x.is_neg() and x.data_ptr() % x.element_size() == 0
              and (ref is None or (ref.device.type == "cpu" and ref.dtype in _DIFF_DTYPES and ref.is_contiguous()
                                   and ref.numel() == x.numel() and not ref.is_neg()
                                   and ref.data_ptr() % ref.element_size() == 0)))
        if not ok:
            return None
        n = x.numel()
        xf64, rf64 = int(x.dtype == torch.float64), int(ref is not None and ref.dtype == torch.float64)
        xp, xs = x.data_ptr(), x.element_size()
        rp, rs = (0, 0) if ref is None else (ref.data_ptr(), ref.element_size())
        nb = max(1, -(-n // DIFF_BLOCK))
        outs = (ctypes.c_double * (3 * nb))()
        base = ctypes.addressof(outs)

        def run(lo: int, hi: int) -> None:
            for k in range(lo, hi):
                i = k * DIFF_BLOCK
                self.diff_fn(self.simd, xf64, rf64, xp + i * xs, rp + i * rs if rp else 0,
                             min(DIFF_BLOCK, n - i), base + 24 * k)

        half = nb // 2 if nb >= 4 and torch.get_num_threads() > 1 else 0
        if half:
            other = _diff_pool().submit(run, 0, half)
            try:
                run(half, nb)
            finally:
                other.result()
        else:
            run(0, nb)
        mx, ss, qq = 0.0, 0.0, 0.0
        for k in range(nb):
            m = outs[3 * k]
            mx = m if (m > mx or m != m) else mx
            ss += outs[3 * k + 1]
            qq += outs[3 * k + 2]
        return mx, ss, qq

    def chunk(self, x: torch.Tensor, rows: int, buckets: int, w: torch.Tensor, route: torch.Tensor,
              routed: torch.Tensor, stats: torch.Tensor, scratch: torch.Tensor) -> None:
        """Statistics of ``x`` into ``stats`` (sum, sum of absolute values, sum of squares, min, max)
        and each row's signed blocks added to ``routed`` at their routes. The C side trusts the
        pointers and strides it is given, so they are checked here, once per chunk (the route
        values are not: they are sketch.py's own hashes, ``row * 2B + bucket`` by construction).
        ``scratch``: at least ``buckets`` float64 values the C side may overwrite."""
        fn = self.f32 if x.dtype == torch.float32 else self.f64
        K = (x.numel() + buckets - 1) // buckets
        ok = (x.is_contiguous() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
              and x.data_ptr() % x.element_size() == 0 and _scratch_ok(scratch, buckets)
              and w.dtype == torch.float64 and w.device.type == "cpu" and w.stride(1) == 1
              and w.shape[0] >= rows and w.shape[1] >= K + buckets - 1
              and route.dtype == torch.int64 and route.device.type == "cpu" and route.stride(1) == 1
              and route.shape[0] >= rows and route.shape[1] >= K
              and routed.dtype == torch.float64 and routed.is_contiguous() and routed.device.type == "cpu"
              and routed.numel() >= rows * 2 * buckets * buckets
              and stats.dtype == torch.float64 and stats.is_contiguous() and stats.numel() >= 5
              and stats.device.type == "cpu"
              and 0 < buckets <= 4096)
        if not ok:  # not an assert: it must hold under python -O, the C side trusts these pointers
            raise ValueError("native fingerprint chunk: arguments of the wrong dtype, device, shape or layout")
        fn(x.data_ptr(), x.numel(), rows, buckets, w.data_ptr(), w.stride(0), route.data_ptr(), route.stride(0),
           routed.data_ptr(), stats.data_ptr(), scratch.data_ptr())

    def fold(self, rows: int, buckets: int, routed: torch.Tensor, u: torch.Tensor, total: torch.Tensor,
             scratch: torch.Tensor) -> None:
        """sketch.py's fold of the routing matrix into ``total`` (the same bits), and ``routed`` zeroed."""
        ok = (0 < buckets <= 4096 and rows > 0
              and all(t.dtype == torch.float64 and t.device.type == "cpu" and t.is_contiguous()
                      for t in (routed, u, total))
              and routed.numel() == rows * 2 * buckets * buckets and u.numel() == rows * buckets
              and total.numel() == rows * buckets and _scratch_ok(scratch, buckets))
        if not ok:
            raise ValueError("native fingerprint fold: arguments of the wrong dtype, device, shape or layout")
        self.fold_fn(rows, buckets, routed.data_ptr(), u.data_ptr(), total.data_ptr(), scratch.data_ptr())


_DIFF_DTYPES = (torch.float32, torch.float64)
DIFF_BLOCK = 1 << 16  # elements per call of ag_diff: the unit of its sums' order, and of its two threads' shares
_diff_executor: list[concurrent.futures.ThreadPoolExecutor] = []


def _diff_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One thread beside the caller's for :meth:`Native.diff` (ctypes releases the GIL)."""
    if not _diff_executor:
        _diff_executor.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="activation_guard-diff"))
    return _diff_executor[0]


def _scratch_ok(t: torch.Tensor, buckets: int) -> bool:
    return t.dtype == torch.float64 and t.device.type == "cpu" and t.is_contiguous() and t.numel() >= buckets


_lock = threading.Lock()
_state: dict[str, object] = {}


class _Refused(Exception):
    """Why a loaded library is not used: the message ends up in :func:`status`."""


def _load(path: Path) -> ctypes.CDLL:
    """``ctypes.CDLL(path)`` with the loading thread's floating-point environment put back after:
    a library's constructors run at load, before anything in it can be checked, and one linked
    with ``crtfastmath.o`` (built with -ffast-math) turns on flush-to-zero for this thread, which
    would change the model's own subnormal arithmetic even if the library is then refused."""
    libm = _libm()
    if libm is None:
        return ctypes.CDLL(str(path))
    env = ctypes.create_string_buffer(_FENV_BYTES)
    saved = libm.fegetenv(env) == 0
    try:
        return ctypes.CDLL(str(path))
    finally:
        if saved:
            libm.fesetenv(env)


_FENV_BYTES = 512  # more than any C library's fenv_t (glibc x86-64: 32 bytes, aarch64: 8)


@functools.lru_cache(maxsize=1)
def _libm() -> ctypes.CDLL | None:
    """The C math library with ``fegetenv``/``fesetenv``, where there is one."""
    for name in (None, ctypes.util.find_library("m")):  # the process's own symbols first: Python links libm
        try:
            lib = ctypes.CDLL(name)
        except (OSError, TypeError):
            continue
        if hasattr(lib, "fegetenv") and hasattr(lib, "fesetenv"):
            return lib
    return None


def _bind(dll: ctypes.CDLL) -> Native:
    """The entry points of a loaded library; :class:`_Refused` if it speaks another version."""
    if dll.ag_version() != VERSION:
        raise _Refused(f"it speaks version {dll.ag_version()}, this module {VERSION}")
    simd = dll.ag_simd()
    if simd not in _SIMD_SUFFIX:
        raise _Refused(f"it has no functions this CPU runs (ag_simd() = {simd})")
    fns = []
    for name in ("ag_chunk_f32", "ag_chunk_f64"):
        fn = getattr(dll, name + _SIMD_SUFFIX[simd])
        fn.argtypes = _ARGTYPES
        fn.restype = None
        fns.append(fn)
    fold = dll.ag_fold
    fold.argtypes = [_I, _I, _P, _P, _P, _P]
    fold.restype = None
    leaf = dll.ag_leaf
    leaf.argtypes = [_I, _I, _P, _I, _I, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P]
    leaf.restype = None
    address = ctypes.cast(dll.ag_copy, _P).value
    if not address:
        raise AttributeError("ag_copy has no address")
    copy = ctypes.PYFUNCTYPE(None, _P, _P, _I)(address)
    diff = dll.ag_diff
    diff.argtypes = [_I, _I, _I, _P, _P, _I, _P]
    diff.restype = None
    return Native(fns[0], fns[1], fold, leaf, simd, copy, dll, diff)


def build(extra_flags: tuple[str, ...] = ()) -> tuple[Native | None, str]:
    """A fresh build at run time, never the prebuilt library (``extra_flags`` for tests:
    ``-DAG_NO_AVX512``, ``-DAG_NO_AVX2`` leave out the wider vector functions, ``-DAG_NO_CONVERT``
    converts floats through memory), and what happened; :func:`get` keeps the first library of the
    process. Whatever goes wrong with the build leaves the torch path and says why; only a value of
    ``ENV`` that is not on, off or auto raises (an
    :class:`~activation_guard._core.errors.OptionError` naming it), as the worker's switch does."""
    if switches.read(ENV) is False:  # unset, auto or on: build (an unknown value raises, naming ENV)
        return None, f"disabled by {ENV}={os.environ[ENV]}"
    if sys.platform == "win32":
        return None, "not built on Windows (the torch path runs)"
    try:
        argv = compiler()
    except _BuildError as e:
        return None, str(e)
    cc = " ".join(argv)
    try:
        lib = _bind(_compile_and_load(argv, (*_unused_widths(), *extra_flags)))
    except _BuildError as e:
        return None, f"the build with {cc} failed: {e}"
    except _Refused as e:
        return None, f"the library built with {cc} is not used: {e}"
    except (OSError, AttributeError) as e:  # no writable temporary folder, a noexec one, a missing symbol
        return None, f"the build with {cc} could not be loaded: {e}"
    return lib, f"built at run time with {cc}{_SIMD_SAYS[lib.simd]}"


def prebuilt() -> tuple[Native | None, str]:
    """The library an install built next to this module, if it is there and was built from this
    tree's ``csrc/fpchunk.c`` with this module's flags and version; else None and why not ("" when
    there is none). Loading it costs a millisecond: no compiler runs."""
    if switches.read(ENV) is False:
        return None, f"disabled by {ENV}={os.environ[ENV]}"
    path = PREBUILT
    if sys.platform == "win32" or not path.is_file():
        return None, ""
    try:
        try:
            here = source_sha()
        except OSError as e:
            raise _Refused(f"the source it must match cannot be read ({e})") from e
        dll = _load(path)
        for name in ("ag_source_sha", "ag_flags"):
            if not hasattr(dll, name):
                raise _Refused(f"it has no {name}() (built before libraries recorded their source)")
            getattr(dll, name).restype = ctypes.c_char_p
        built_from, flags = dll.ag_source_sha().decode(), dll.ag_flags().decode()
        if built_from != here:
            raise _Refused(f"it was built from another {SOURCE.name} (sha256 {built_from[:12] or 'not recorded'}, "
                           f"the source here is {here[:12]})")
        if flags != " ".join(FLAGS):
            raise _Refused(f"it was built with the flags {flags!r}, this module builds with {' '.join(FLAGS)!r}")
        lib = _bind(dll)
    except _Refused as e:
        return None, f"the prebuilt {path} is not used: {e}"
    except (OSError, AttributeError) as e:  # not a library for this machine, a missing symbol
        return None, f"the prebuilt {path} could not be loaded: {e}"
    return lib, f"prebuilt {path}{_SIMD_SAYS[lib.simd]}"


def _settle_quickly() -> None:
    """Under ``_lock``: settle the process's library in ``_state`` (``native``, ``why``) where that
    takes no compiler run: the switch is off, or the prebuilt library (:func:`prebuilt`, its
    verdict kept in ``_state["prebuilt"]``) is used. Otherwise :func:`get` builds."""
    if "native" in _state:
        return
    if switches.read(ENV) is False:
        _state["native"], _state["why"] = None, f"disabled by {ENV}={os.environ[ENV]}"
        return
    if "prebuilt" not in _state:
        _state["prebuilt"] = prebuilt()
    found: tuple[Native | None, str] = _state["prebuilt"]  # type: ignore[assignment]
    if found[0] is not None:
        _state["native"], _state["why"] = found


# ag_simd(): the widest vector functions the CPU runs and the build has (all compute the same bits)
_SIMD_SUFFIX = {0: "", 1: "_avx2", 2: "_avx512"}
_SIMD_SAYS = {0: "", 1: ", AVX2", 2: ", AVX-512"}

def _unused_widths() -> tuple[str, ...]:
    """The vector functions a build at run time leaves out because they could never run on this
    CPU (Linux's /proc/cpuinfo): ``-DAG_NO_BASELINE`` where it has AVX2 (the two-lane functions
    were half the build's CPU time), ``-DAG_NO_AVX512`` where it has no AVX-512 (a quarter).
    Anywhere the flags cannot be read, everything is built (``ag_simd`` picks at run time)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return ((("-DAG_NO_BASELINE",) if "avx2" in flags else ())
                            + (() if "avx512f" in flags else ("-DAG_NO_AVX512",)))
    except OSError:
        pass
    return ()


def _compile_and_load(argv: list[str], extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    with tempfile.TemporaryDirectory(prefix="activation_guard-native-") as tmp:
        lib = Path(tmp) / "fpchunk.so"
        compile_library(argv, lib, extra_flags)
        return _load(lib)  # mapped: the file can go with the folder


def get() -> Native | None:
    """The compiled pass, built on first call (once per process); None where it is not available.
    Waits for a build :func:`start` began."""
    with _lock:
        _settle_quickly()
        if "native" not in _state:
            fresh, says = build()
            refused = _state["prebuilt"][1]  # type: ignore[index]
            _state["native"], _state["why"] = fresh, f"{says}; {refused}" if refused else says
        return _state["native"]  # type: ignore[return-value]


_starting = threading.Lock()  # guards _builder only: never held while building
_builder: list[threading.Thread] = []


def start() -> bool:
    """Settle the process's library: the prebuilt one (or the switch) at once, else begin the
    build on a thread of its own, if it has not run and is not running, so the compiler works
    while the recording gets going (a build can cost more than a 271M-parameter model's forward:
    docs/performance.md). True when there is nothing to wait for (loaded, built, or known
    unavailable); never blocks."""
    if ready():
        return True
    with _starting:
        if not _builder and _lock.acquire(blocking=False):  # (held: get() is at work on another thread)
            try:  # a prebuilt library (or the switch) settles it here and now, with no thread
                _settle_quickly()
            finally:
                _lock.release()
        if not _builder and not ready():
            t = threading.Thread(target=get, name="activation_guard-native-build", daemon=True)
            _builder.append(t)
            t.start()
    return ready()


def available() -> Native | None:
    """The library where having it costs no compiler run: loaded or built already in this process,
    or the install's prebuilt one (loaded now: a millisecond). Never starts a build: for work that
    takes the compiled pass when it is there anyway, as the calibrated floors do."""
    if ready():
        return built()
    if not _lock.acquire(blocking=False):  # a build is running on another thread: not now
        return None
    try:
        _settle_quickly()
    finally:
        _lock.release()
    return built()


def ready() -> bool:
    """Whether the build has finished (built or not): :func:`get` then returns at once."""
    return "native" in _state


def built() -> Native | None:
    """The library if the build has finished and succeeded; never waits for one."""
    return _state.get("native") if ready() else None  # type: ignore[return-value]


def status() -> str:
    """Which fingerprint pass runs, and why: for reports, benchmarks and bug reports."""
    native = get()
    return f"compiled C pass ({_state['why']})" if native else f"torch ops ({_state['why']})"


def _after_fork_in_child() -> None:
    """A fork while another thread was building leaves the child's lock held forever: the child
    starts over with a fresh lock (and builds again if the build had not finished)."""
    global _lock, _starting
    _lock = threading.Lock()
    _starting = threading.Lock()
    _builder.clear()  # (its thread did not come along)
    _diff_executor.clear()  # (nor the diff's)
    if "why" not in _state:
        _state.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def reset() -> None:
    """Forget the build (tests switch :data:`ENV` and build again)."""
    with _lock:
        _state.clear()
    with _starting:
        _builder.clear()

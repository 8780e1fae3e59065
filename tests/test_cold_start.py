"""The first fingerprint recording of a process: the compiled pass is there, or built beside the forward.

An install builds the library once (setup.py): a process loads it in a millisecond, if it was
built from this tree's fpchunk.c with native.py's flags, and refuses it otherwise, saying why.
Without one, a build can cost more than a 271M-parameter model's forward; a recording starts it
on a thread of its own and the forward goes on, its leaves held by the fingerprint worker until
the library is there. The golden is the one a process with the library
already built writes, byte for byte. Figures: docs/performance.md (benchmarks/scale.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import activation_guard as ag
from activation_guard._core import native, nativebuild
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
def slow_build(monkeypatch: pytest.MonkeyPatch,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """No library built at install time, and a build at run time that finishes only once
    ``state["go"]`` is set (or after a few seconds): whether the forward reached its last layer
    while the compiler was still at work."""
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
    monkeypatch.setattr(native, "PREBUILT", Path(tmp_path_factory.mktemp("no-prebuilt")) / native.PREBUILT.name)
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


def test_a_build_at_run_time_leaves_out_the_widths_the_cpu_cannot_use(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    import builtins

    real_open = builtins.open
    cpuinfo = tmp_path / "cpuinfo"

    def fake_open(path: object, *a: object, **k: object) -> object:
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", fake_open)
    cpuinfo.write_text("processor : 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert native._unused_widths() == ("-DAG_NO_BASELINE", "-DAG_NO_AVX512")
    cpuinfo.write_text("processor : 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n")
    assert native._unused_widths() == ("-DAG_NO_BASELINE",)
    cpuinfo.write_text("processor : 0\nflags\t\t: fpu sse2 sse4_2\n")
    assert native._unused_widths() == ("-DAG_NO_AVX512",)
    cpuinfo.unlink()
    assert native._unused_widths() == ()  # unreadable: everything is built, ag_simd picks


ROOT = Path(__file__).resolve().parent.parent


def cc_or_skip() -> None:
    try:
        nativebuild.compiler()
    except nativebuild.BuildError as e:
        pytest.skip(f"no C compiler here: {e}")


def install_build(tmp: Path, cc: str | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``setup.py build_ext`` (what ``pip install`` and a wheel run) into ``tmp``, the tree untouched:
    the command's result and where the library lands (relative to a package's root, as in a wheel)."""
    env = {k: v for k, v in os.environ.items() if k != "CC"} | ({"CC": cc} if cc is not None else {})
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp / "lib"),
                        "--build-temp", str(tmp / "temp")], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=120)
    return r, tmp / "lib" / "activation_guard" / "_core" / native.PREBUILT.name


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A library as an install builds it from this tree (built once for the module)."""
    cc_or_skip()
    r, lib = install_build(tmp_path_factory.mktemp("install"))
    assert r.returncode == 0 and lib.is_file(), r.stderr[-2000:]
    return lib


@pytest.fixture
def prebuilt_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """Point native.py at a prebuilt library (as if installed next to it) and forget this process's."""
    def use(path: Path) -> None:
        monkeypatch.setattr(native, "PREBUILT", path)
        native.reset()

    monkeypatch.delenv(native.ENV, raising=False)
    yield use
    monkeypatch.undo()
    native.reset()


def test_the_library_an_install_builds_is_found_and_used_with_no_compiler_run(
        installed: Path, prebuilt_at: Callable[[Path], None], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """Where an install put it, native.py loads it: start() settles at once (no build thread, no
    compiler), status() names it, and its fingerprints are a run-time build's, byte for byte."""
    m, x = model()
    warm = tmp_path / "runtime.h5"
    ag.record(m, x, path=warm, fingerprint=True)  # this process's library (prebuilt or not: the same bits)
    prebuilt_at(installed)

    def no_build(extra_flags: tuple[str, ...] = ()) -> tuple[native.Native | None, str]:
        raise AssertionError("a compiler ran although an install built the library")

    monkeypatch.setattr(native, "build", no_build)
    before = {t.name for t in threading.enumerate()}
    assert native.start() is True and native.ready()
    assert "activation_guard-native-build" not in {t.name for t in threading.enumerate()} - before
    lib = native.get()
    assert lib is not None and Path(lib.lib._name) == installed
    assert native.status() == f"compiled C pass (prebuilt {installed}{native._SIMD_SAYS[lib.simd]})"
    cold = tmp_path / "prebuilt.h5"
    ag.record(m, x, path=cold, fingerprint=True)
    assert cold.read_bytes() == warm.read_bytes()


def test_a_prebuilt_library_from_another_source_is_refused_and_status_says_why(
        prebuilt_at: Callable[[Path], None], tmp_path: Path) -> None:
    """An edited fpchunk.c in a development tree (or a library left from an older install): the
    library is never used, the process builds its own, and status() names the refused one."""
    cc_or_skip()
    edited = tmp_path / "fpchunk.c"
    edited.write_text(nativebuild.SOURCE.read_text() + "\nint ag_edited(void) { return 1; }\n")
    stale = tmp_path / native.PREBUILT.name
    nativebuild.compile_library(nativebuild.compiler(), stale, source=edited)
    prebuilt_at(stale)
    lib = native.get()
    assert lib is not None and Path(lib.lib._name) != stale
    said = native.status()
    assert said.startswith("compiled C pass (built at run time with "), said
    assert (f"the prebuilt {stale} is not used: it was built from another fpchunk.c "
            f"(sha256 {nativebuild.source_sha(edited)[:12]}, the source here is {nativebuild.source_sha()[:12]})"
            in said), said


@pytest.mark.parametrize("what", ["version", "flags"])
def test_a_prebuilt_library_of_another_version_or_flags_is_refused(
        installed: Path, prebuilt_at: Callable[[Path], None], monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    if what == "version":
        monkeypatch.setattr(native, "VERSION", native.VERSION + 1)
        says = f"it speaks version {native.VERSION - 1}, this module {native.VERSION}"
    else:
        monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-DAG_OTHER"])
        says = f"it was built with the flags {' '.join(nativebuild.FLAGS)!r}, this module builds with"
    prebuilt_at(installed)
    lib, why = native.prebuilt()
    assert lib is None and why.startswith(f"the prebuilt {installed} is not used: {says}"), why
    native.get()
    assert f"; the prebuilt {installed} is not used: {says}" in native.status()


@pytest.mark.parametrize("older", [False, True])
def test_a_library_that_records_no_source_is_refused(prebuilt_at: Callable[[Path], None], tmp_path: Path,
                                                     older: bool) -> None:
    """A library built some other way (no embedded hash), or by a version before libraries
    recorded their source (no such function): not used, whatever it computes."""
    cc_or_skip()
    source = nativebuild.SOURCE
    if older:
        source = tmp_path / "fpchunk.c"
        source.write_text("".join(line for line in nativebuild.SOURCE.read_text().splitlines(keepends=True)
                                  if "ag_source_sha(void)" not in line and "ag_flags(void)" not in line))
    plain = tmp_path / native.PREBUILT.name
    r = subprocess.run([*nativebuild.compiler(), *nativebuild.FLAGS, "-o", str(plain), str(source), "-lm"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    prebuilt_at(plain)
    lib, why = native.prebuilt()
    said = ("it has no ag_source_sha() (built before libraries recorded their source)" if older
            else "it was built from another fpchunk.c (sha256 not recorded")
    assert lib is None and f"the prebuilt {plain} is not used: {said}" in why, why


def test_the_env_switch_disables_the_prebuilt_library_too(installed: Path, prebuilt_at: Callable[[Path], None],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    prebuilt_at(installed)
    monkeypatch.setenv(native.ENV, "0")
    assert native.start() is True
    assert native.get() is None and native.status() == f"torch ops (disabled by {native.ENV}=0)"
    assert native.prebuilt() == (None, f"disabled by {native.ENV}=0")


@pytest.mark.parametrize("cc", ["broken", "cc -ffast-math"])
def test_a_failed_install_build_still_installs_and_the_process_builds_its_own(tmp_path: Path, cc: str) -> None:
    """The build is optional: a compiler that fails (or a $CC carrying fast-math flags, refused)
    leaves the install's build command successful with a warning and no library; native.py then
    finds none and builds per process, as in a source tree."""
    if cc == "broken":
        script = tmp_path / "broken-cc"
        script.write_text("#!/bin/sh\necho 'broken-cc: cannot build' >&2\nexit 3\n")
        script.chmod(0o755)
        cc = str(script)
    elif shutil.which("cc") is None:
        pytest.skip("no cc on the PATH")
    r, lib = install_build(tmp_path, cc)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the compiled fingerprint pass was not built" in r.stderr, r.stderr[-2000:]
    assert ("broken-cc: cannot build" if "broken" in cc else "carries -ffast-math") in r.stderr
    assert not lib.exists()


def test_an_installed_tree_uses_its_prebuilt_library() -> None:
    """In an installed tree (pip install, pip install -e, a wheel: CI's .ci/run) the library an
    install built is the one that runs."""
    if not native.PREBUILT.is_file():
        pytest.skip(f"no library built at install time at {native.PREBUILT} (a source tree: "
                    "python setup.py build_ext --inplace builds one)")
    native.reset()
    assert native.status().startswith(f"compiled C pass (prebuilt {native.PREBUILT}"), native.status()


def test_a_build_at_run_time_on_an_avx2_cpu_leaves_the_baseline_out() -> None:
    """Half the compiler's work: the two-lane functions never run on a CPU with AVX2 (their bits
    are the same: test_native's every build)."""
    cc_or_skip()
    if "-DAG_NO_BASELINE" not in native._unused_widths():
        pytest.skip("this CPU has no AVX2 (or Linux's /proc/cpuinfo cannot be read): the baseline is built")
    lib, why = native.build()
    assert lib is not None and lib.simd >= 1, why
    assert hasattr(lib.lib, "ag_chunk_f32_avx2") and not hasattr(lib.lib, "ag_chunk_f32")


def test_a_library_with_no_functions_for_this_cpu_is_refused() -> None:
    """A build without the baseline on a CPU without AVX2 (ag_simd() is -1): refused, never called."""
    class Fake:
        def ag_version(self) -> int:
            return native.VERSION

        def ag_simd(self) -> int:
            return -1

    with pytest.raises(native._Refused, match=r"it has no functions this CPU runs \(ag_simd\(\) = -1\)"):
        native._bind(Fake())  # type: ignore[arg-type]


def test_an_in_place_build_replaces_the_library_by_a_rename(tmp_path: Path) -> None:
    """``build_ext --inplace`` (and ``pip install -e``) never rewrites in place the library a
    running process has mapped (the old file stays intact; the new one is copied under a temporary
    name and renamed, so no process ever loads a half-written one), and leaves nothing beside it."""
    cc_or_skip()
    tree = tmp_path / "tree"
    core = tree / "activation_guard" / "_core"
    (core / "csrc").mkdir(parents=True)
    shutil.copy(ROOT / "setup.py", tree)
    shutil.copy(nativebuild.SOURCE, core / "csrc")
    shutil.copy(Path(nativebuild.__file__), core)
    (tree / "activation_guard" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    lib = core / native.PREBUILT.name
    lib.write_bytes(b"the library a running process has mapped")
    os.link(lib, tmp_path / "mapped")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True,
                       text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "CC"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "mapped").read_bytes() == b"the library a running process has mapped"
    assert lib.read_bytes()[:4] == b"\x7fELF" or sys.platform == "darwin"
    assert sorted(p.name for p in core.iterdir()) == sorted(["__init__.py", "csrc", "nativebuild.py", lib.name])


def _a_compiler() -> list[str]:
    try:
        return nativebuild.compiler()
    except nativebuild.BuildError as e:
        pytest.skip(str(e))


@pytest.mark.skipif(sys.platform in ("win32", "darwin"), reason="GCC's crtfastmath (Linux)")
def test_loading_a_library_leaves_the_floating_point_environment_as_it_was(tmp_path: Path) -> None:
    """Whatever a library's constructors do to the loading thread's floating-point environment
    (flush-to-zero from crtfastmath.o) is undone as it is loaded, before any check can run."""
    lib = tmp_path / "fast.so"
    nativebuild.compile_library(_a_compiler(), lib, flags=[*nativebuild.FLAGS, "-ffast-math"])
    code = f"""
import ctypes, torch
from pathlib import Path
from activation_guard._core import native
x = torch.tensor([1e-40])
native._load(Path({str(lib)!r}))
print((x * 1.0).item(), 1e-310 * 1.0)
ctypes.CDLL({str(lib)!r})  # (a second dlopen of a loaded library runs no constructor)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert all(float(v) != 0.0 for v in r.stdout.split()), r.stdout
    plain = subprocess.run([sys.executable, "-c", f"import ctypes, torch; ctypes.CDLL({str(lib)!r}); "
                            "print((torch.tensor([1e-40]) * 1.0).item())"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and float(plain.stdout) == 0.0, "the library does not flush: the test proves nothing"


@pytest.mark.skipif(sys.platform == "win32" or sys.platform == "darwin", reason="GCC's crtfastmath (Linux)")
def test_a_refused_prebuilt_library_leaves_the_floating_point_environment_alone(tmp_path: Path) -> None:
    """A prebuilt library built with other flags (-ffast-math links crtfastmath.o, whose constructor
    turns on flush-to-zero for the loading thread as it is loaded, before it can be checked) is
    refused, and the loading thread's floating-point environment is as it was: the model's own
    subnormal values stay what they are."""
    lib = tmp_path / "_fpchunk.so"
    nativebuild.compile_library(_a_compiler(), lib, flags=[*nativebuild.FLAGS, "-ffast-math"])
    code = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from activation_guard._core import native
        native.PREBUILT = Path({str(lib)!r})
        x = torch.tensor([1e-40], dtype=torch.float32)
        assert (x * 1.0).item() != 0.0
        got, why = native.prebuilt()
        assert got is None and "flags" in why, why
        print((x * 1.0).item(), 1e-310 * 1.0)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    torch_value, python_value = (float(v) for v in r.stdout.split())
    assert torch_value != 0.0 and python_value != 0.0, (
        f"after refusing the library, subnormals flush to zero: torch {torch_value}, python {python_value}")



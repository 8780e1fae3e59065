"""How the compiled fingerprint pass is built: the compiler, its flags and the build's identity.

Shared by ``native.py`` (the per-process build, and the check of a prebuilt library) and by
``setup.py`` (the library built at install time), which loads this file by its path: it imports
nothing but the standard library, so a build with no torch installed can use it.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "fpchunk.c"
# The library built at install time, next to this file (a plain shared library loaded with ctypes,
# never imported): package code, as trusted as the .py files beside it.
PREBUILT_NAME = "_fpchunk.so"
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu99", "-Wno-psabi"]
# Flags that make GCC link crtfastmath.o, whose constructor turns on flush-to-zero for the thread
# that loads the library: the model's own subnormal arithmetic would change after the first
# fingerprint (a false alarm against a golden recorded without it).
FAST_MATH = ("-ffast-math", "-Ofast", "-funsafe-math-optimizations")
BUILD_TIMEOUT = 30  # seconds: a compiler that hangs must not hold fingerprints (or an install) up long


class BuildError(Exception):
    """Why there is no library: the message ends up in ``native.status()`` or the install's warning."""


def compiler() -> list[str]:
    """The C compiler's command line: ``$CC`` (which may carry arguments: ``ccache gcc``), else
    ``cc``, ``gcc`` or ``clang`` on the PATH. Raises :class:`BuildError` saying what is wrong."""
    cc = os.environ.get("CC", "").strip()
    if not cc:
        found = next((p for p in (shutil.which(c) for c in ("cc", "gcc", "clang")) if p), None)
        if found is None:
            raise BuildError("no C compiler found ($CC, cc, gcc, clang)")
        return [found]
    try:
        argv = shlex.split(cc)
    except ValueError as e:
        raise BuildError(f"cannot read $CC={cc!r}: {e}") from e
    found = shutil.which(argv[0])
    if found is None:
        raise BuildError(f"$CC={cc!r}: {argv[0]!r} was not found on the PATH")
    bad = [a for a in argv[1:] if a in FAST_MATH]
    if bad:
        raise BuildError(f"$CC={cc!r} carries {' '.join(bad)}, which would turn on flush-to-zero for the "
                         "thread that loads the library (maybe the model's own): not built")
    return [found, *argv[1:]]


def source_sha(source: Path = SOURCE) -> str:
    """The SHA-256 of the C source as it is on disk now: a prebuilt library carries the one it was
    built from, and is used only while they agree."""
    return hashlib.sha256(source.read_bytes()).hexdigest()


def identity_flags(source: Path = SOURCE, flags: list[str] = FLAGS) -> list[str]:
    """The defines that embed the build's identity (``ag_source_sha()``, ``ag_flags()``)."""
    return [f'-DAG_SOURCE_SHA="{source_sha(source)}"', f'-DAG_FLAGS="{" ".join(flags)}"']


def compile_library(argv: list[str], out: Path, extra_flags: tuple[str, ...] = (), *, flags: list[str] = FLAGS,
                    source: Path = SOURCE) -> None:
    """``source`` into the shared library ``out`` with ``flags`` (and ``extra_flags`` after them).
    Raises :class:`BuildError` with the compiler's first error line."""
    try:
        r = subprocess.run([*argv, *flags, *identity_flags(source, flags), *extra_flags, "-o", str(out), str(source),
                            "-lm"], capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(str(e)) from e
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines() or ["no message"]
        said = next((x for x in lines if "error" in x.lower()), lines[-1])
        raise BuildError(f"exit {r.returncode}: {said.strip()}")

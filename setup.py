"""The compiled fingerprint pass, built at install time (everything else is in pyproject.toml).

``pip install .``, ``pip install -e .``, a wheel and ``python setup.py build_ext --inplace`` build
``activation_guard/_core/csrc/fpchunk.c`` into ``activation_guard/_core/_fpchunk.so``: a plain
shared library that ``_core/native.py`` loads with ctypes (no Python headers, never imported),
carrying every vector width (``ag_simd`` picks one at run time: a wheel runs on other CPUs), built
with native.py's own flags (``$CFLAGS`` is not read: a flag there could change a bit of a
fingerprint or the CPUs the library runs on; a ``$CC`` carrying fast-math flags is refused). The
build is optional: without a compiler, or when it fails, the install goes on with a warning and
native.py builds the library per process, as it does in a source tree.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
NAME = "activation_guard._core._fpchunk"


def _nativebuild() -> ModuleType:
    """``activation_guard/_core/nativebuild.py`` by its path: the package (and torch) is not imported."""
    spec = importlib.util.spec_from_file_location("_ag_nativebuild", HERE / "activation_guard/_core/nativebuild.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildFingerprintPass(build_ext):
    def copy_file(self, infile: str, outfile: str, *args: Any, **kwargs: Any) -> tuple[str, bool]:  # type: ignore[override]
        """The library into the source tree (``--inplace``, ``pip install -e``) by an atomic rename:
        a process that has the old one loaded keeps its mapping instead of reading a file being
        rewritten under it."""
        if Path(outfile).name != _nativebuild().PREBUILT_NAME or self.dry_run:
            return super().copy_file(infile, outfile, *args, **kwargs)  # type: ignore[no-any-return]
        tmp = Path(outfile).with_name(f".{Path(outfile).name}.{os.getpid()}.tmp")
        try:
            shutil.copyfile(infile, tmp)
            tmp.chmod(0o755)
            os.replace(tmp, outfile)
        finally:
            tmp.unlink(missing_ok=True)
        return outfile, True

    def get_ext_filename(self, fullname: str) -> str:
        # a plain library, not a Python module: no ABI tag (asked with the full dotted name, or the last part only)
        if fullname in (NAME, NAME.rsplit(".", 1)[1]):
            return str(Path(*fullname.split(".")[:-1], _nativebuild().PREBUILT_NAME))
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if ext.name != NAME:
            super().build_extension(ext)
            return
        out = Path(self.get_ext_fullpath(ext.name))
        nb = _nativebuild()
        try:
            if sys.platform == "win32":
                raise nb.BuildError("not built on Windows (the torch path runs)")
            out.parent.mkdir(parents=True, exist_ok=True)
            nb.compile_library(nb.compiler(), out)
        except nb.BuildError as e:  # never fails the install: native.py builds per process instead
            out.unlink(missing_ok=True)
            self.warn(f"activation_guard: the compiled fingerprint pass was not built ({e}); it will be built "
                      "at run time in each process that fingerprints, or the torch path runs")


setup(
    ext_modules=[Extension(NAME, sources=["activation_guard/_core/csrc/fpchunk.c"], optional=True)],
    cmdclass={"build_ext": BuildFingerprintPass},
)

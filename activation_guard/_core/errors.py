"""Exception types. Every error about a golden names the file and says how to fix it.

The fix is worded for any caller (API, CLI, plugin), so these messages never name pytest or a plugin
flag: front ends that know their own re-record command append it.
"""

from __future__ import annotations

import os

UPDATE_HINT = "re-record the golden"  # neutral: the plugin and the CLI append their own command


class ActivationGuardError(Exception):
    """Base class for all activation_guard errors."""


class ActivationGuardWarning(UserWarning):
    """Something was done as asked but probably not as meant (a golden re-recorded without the
    fingerprints it had, a fingerprint pattern that matched no layer)."""


class UnsupportedModelError(ActivationGuardError, TypeError):
    """The model cannot be hooked faithfully (torch.compile, TorchScript, DataParallel...)."""


class SelectionError(ActivationGuardError, ValueError):
    """``include``/``exclude`` selected no layer call: the check would pass vacuously."""


class DistributedError(ActivationGuardError, ValueError):
    """A request that cannot work in this torch.distributed run: it would race (every rank
    writing one file), hang (one rank leaving the model's collectives) or compare pieces that are
    not shards of one tensor. See docs/distributed.md."""


class GoldenError(ActivationGuardError):
    """A golden file could not be used. ``path`` is the file at fault."""

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str | None = UPDATE_HINT):
        self.path = os.fspath(path)
        self.problem = problem
        self.fix = fix
        msg = f"golden {self.path}: {problem}"
        if fix:
            msg += f"; to fix: {fix}"
        super().__init__(msg)


class GoldenNotFoundError(GoldenError, FileNotFoundError):
    pass


class GoldenFormatError(GoldenError):
    """Not a golden, a golden of an unknown/newer format version, or inconsistent contents."""


class UncalibratedGoldenError(GoldenFormatError):
    """``tolerance="calibrated"`` met a golden recorded without noise floors: re-recording it
    needs calibration on (the plugin adds ``--ag-calibrate`` to the command it prints)."""


class GoldenCorruptError(GoldenError):
    """Stored bytes fail their checksum: the file was damaged after it was written."""


class GoldenSecurityError(GoldenError):
    """The file uses HDF5 features a golden never uses and that could read other files
    (external links, external storage, virtual datasets) or load code (filter plugins)."""


class GoldenWriteError(GoldenError, OSError):
    """Writing failed; the previous golden (if any) is untouched."""


class OptionError(ActivationGuardError, TypeError, ValueError):
    """A bad option value. Raised by :mod:`activation_guard.options.spec`, wherever the option was set
    (API argument, marker, ``check()``, ``--ag-*`` flag, ini key, CLI), and for the environment
    switches (:mod:`activation_guard._core.switches`), with one message format: the option, the value,
    where it came from, and what is wrong.

    It is a ``TypeError`` and a ``ValueError`` too, so code written against the plain built-in
    errors of earlier releases keeps catching it."""

    def __init__(self, option: str, value: object, source: str, problem: str):
        self.option = option
        self.value = value
        self.source = source
        self.problem = problem
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        super().__init__(f"option {option}={shown} ({source}): {problem}")

    @classmethod
    def usage(cls, option: str, message: str) -> OptionError:
        """A usage error of the pytest layer or the CLI that is not one value's (a folder where a file
        belongs, an empty flag): ``message`` already names the option, its value and the fix."""
        e = cls.__new__(cls)
        e.option, e.value, e.source, e.problem = option, None, "command line", message
        Exception.__init__(e, message)
        return e

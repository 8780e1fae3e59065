"""activation_guard: catch the first layer where a PyTorch model's computation changed.

Record every module's outputs once (``record``), then check later runs layer by layer
(``compare``) against that HDF5 golden, or two live models against each other
(``compare_models``). The pytest plugin (``activation_guard.plugin``) is thin glue over these.

Public names are imported lazily (PEP 562): the plugin is loaded by every pytest run in an
environment that has this package installed, and must not make those runs pay for importing
torch and h5py unless a test actually uses it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

_LAZY: dict[str, str] = {
    "RecordSummary": "api",
    "compare": "api",
    "compare_models": "api",
    "read_golden": "api",
    "record": "api",
    "LayerResult": "results",
    "LeafResult": "results",
    "CompareSpec": "spec",
    "RecordSpec": "spec",
    "OptionError": "errors",
    "emulate_tf32": "tf32",
    "check_determinism": "determinism",
    "deterministic": "determinism",
    "ActivationGuardError": "errors",
    "ActivationGuardWarning": "errors",
    "GoldenCorruptError": "errors",
    "GoldenError": "errors",
    "GoldenFormatError": "errors",
    "GoldenNotFoundError": "errors",
    "GoldenSecurityError": "errors",
    "GoldenWriteError": "errors",
    "SelectionError": "errors",
    "UncalibratedGoldenError": "errors",
    "UnsupportedModelError": "errors",
    "Report": "report",
    "CROSS_DEVICE_DEFAULTS": "tolerances",
    "DTYPE_DEFAULTS": "tolerances",
    "Tolerance": "tolerances",
    "diff_recordings": "diff",
}

__all__ = [
    "CROSS_DEVICE_DEFAULTS",
    "DTYPE_DEFAULTS",
    "ActivationGuardError",
    "ActivationGuardWarning",
    "CompareSpec",
    "GoldenCorruptError",
    "GoldenError",
    "GoldenFormatError",
    "GoldenNotFoundError",
    "GoldenSecurityError",
    "GoldenWriteError",
    "LayerResult",
    "LeafResult",
    "OptionError",
    "RecordSpec",
    "RecordSummary",
    "Report",
    "SelectionError",
    "Tolerance",
    "UncalibratedGoldenError",
    "UnsupportedModelError",
    "__version__",
    "check_determinism",
    "compare",
    "compare_models",
    "deterministic",
    "diff_recordings",
    "emulate_tf32",
    "read_golden",
    "record",
]

if TYPE_CHECKING:
    from .api import RecordSummary, compare, compare_models, read_golden, record
    from .determinism import check_determinism, deterministic
    from .diff import diff_recordings
    from .errors import (
        ActivationGuardError,
        GoldenCorruptError,
        GoldenError,
        GoldenFormatError,
        GoldenNotFoundError,
        GoldenSecurityError,
        GoldenWriteError,
        OptionError,
        SelectionError,
        UncalibratedGoldenError,
        UnsupportedModelError,
    )
    from .report import Report
    from .results import LayerResult, LeafResult
    from .spec import CompareSpec, RecordSpec
    from .tf32 import emulate_tf32
    from .tolerances import CROSS_DEVICE_DEFAULTS, DTYPE_DEFAULTS, Tolerance


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'activation_guard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

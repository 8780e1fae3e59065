"""activation_guard: catch the first layer where a PyTorch model's computation changed.

Record every module's outputs once (``record``), then check later runs layer by layer
(``compare``) against that HDF5 golden, or two live models against each other
(``compare_models``). The pytest plugin (``activation_guard.plugin.hooks``) is thin glue over these.

Public names are imported lazily (PEP 562): the plugin is loaded by every pytest run in an
environment that has this package installed, and must not make those runs pay for importing
torch and h5py unless a test actually uses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._core.lazy import lazy_names
from ._version import __version__

_LAZY: dict[str, str] = {
    "RecordSummary": "api.run",
    "compare": "api.run",
    "compare_models": "api.run",
    "read_golden": "api.run",
    "record": "api.run",
    "LayerResult": "results",
    "LeafResult": "results",
    "CompareSpec": "options.spec",
    "RecordSpec": "options.spec",
    "OptionError": "_core.errors",
    "emulate_tf32": "_core.tf32",
    "check_determinism": "api.determinism",
    "deterministic": "api.determinism",
    "ActivationGuardError": "_core.errors",
    "ActivationGuardWarning": "_core.errors",
    "GoldenCorruptError": "_core.errors",
    "GoldenError": "_core.errors",
    "GoldenFormatError": "_core.errors",
    "GoldenNotFoundError": "_core.errors",
    "GoldenSecurityError": "_core.errors",
    "GoldenWriteError": "_core.errors",
    "SelectionError": "_core.errors",
    "UncalibratedGoldenError": "_core.errors",
    "UnsupportedModelError": "_core.errors",
    "Report": "report.report",
    "CROSS_DEVICE_DEFAULTS": "options.tolerances",
    "DTYPE_DEFAULTS": "options.tolerances",
    "Tolerance": "options.tolerances",
    "diff_recordings": "api.diff",
    "sensitivity": "api.sensitivity",
    "SensitivityReport": "report.sensitivity",
    "compare_onnx": "api.runtime",
    "onnx_map": "api.runtime",
    "OnnxMap": "api.runtime",
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
    "OnnxMap",
    "OptionError",
    "RecordSpec",
    "RecordSummary",
    "Report",
    "SelectionError",
    "SensitivityReport",
    "Tolerance",
    "UncalibratedGoldenError",
    "UnsupportedModelError",
    "__version__",
    "check_determinism",
    "compare",
    "compare_models",
    "compare_onnx",
    "deterministic",
    "diff_recordings",
    "emulate_tf32",
    "onnx_map",
    "read_golden",
    "record",
    "sensitivity",
]

if TYPE_CHECKING:
    from ._core.errors import (
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
    from ._core.tf32 import emulate_tf32
    from .api.determinism import check_determinism, deterministic
    from .api.diff import diff_recordings
    from .api.run import RecordSummary, compare, compare_models, read_golden, record
    from .api.runtime import OnnxMap, compare_onnx, onnx_map
    from .api.sensitivity import sensitivity
    from .options.spec import CompareSpec, RecordSpec
    from .options.tolerances import CROSS_DEVICE_DEFAULTS, DTYPE_DEFAULTS, Tolerance
    from .report.report import Report
    from .report.sensitivity import SensitivityReport
    from .results import LayerResult, LeafResult


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())

"""activation_guard: catch the first layer where a PyTorch model's computation changed.

Record every module's outputs once (``record``), then check later runs layer by layer
(``compare``) against that HDF5 golden, or two live models against each other
(``compare_models``). The pytest plugin (``activation_guard.plugin``) is thin glue over these.
"""

from ._version import __version__
from .api import RecordSummary, compare, compare_models, read_golden, record
from .compare import LayerResult, LeafResult
from .determinism import check_determinism, deterministic
from .errors import (
    ActivationGuardError,
    GoldenCorruptError,
    GoldenError,
    GoldenFormatError,
    GoldenNotFoundError,
    GoldenSecurityError,
    GoldenWriteError,
    UnsupportedModelError,
)
from .report import Report
from .tolerances import CROSS_DEVICE_DEFAULTS, DTYPE_DEFAULTS, Tolerance

__all__ = [
    "CROSS_DEVICE_DEFAULTS",
    "DTYPE_DEFAULTS",
    "ActivationGuardError",
    "GoldenCorruptError",
    "GoldenError",
    "GoldenFormatError",
    "GoldenNotFoundError",
    "GoldenSecurityError",
    "GoldenWriteError",
    "LayerResult",
    "LeafResult",
    "RecordSummary",
    "Report",
    "Tolerance",
    "UnsupportedModelError",
    "__version__",
    "check_determinism",
    "compare",
    "compare_models",
    "deterministic",
    "read_golden",
    "record",
]

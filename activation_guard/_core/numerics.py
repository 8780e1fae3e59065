"""Switches that change what a float32 forward computes: TF32, reduced-precision oneDNN math.

Read and restored exactly (both the legacy ``allow_tf32``/``set_float32_matmul_precision`` API
and the per-backend ``fp32_precision`` strings of newer torch), because both
:func:`activation_guard.deterministic` and the float64 shadow forward of calibrated tolerances
must turn TF32 off for a while and leave the caller's settings as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# New-style (torch >= 2.9) per-backend float32 precision switches, parents before children:
# restoring a parent can reset its children, so children are written after it.
_FP32_PRECISION_PATHS: tuple[tuple[str, ...], ...] = (
    ("",),
    ("cuda", "matmul"),
    ("cudnn",),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn",),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)

_MISSING = object()


def _backend(path: tuple[str, ...]) -> Any:
    obj: Any = torch.backends
    for part in path:
        if not part:
            continue
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _fp32_of(backend: Any) -> Any:
    return _try(lambda: backend.fp32_precision)


def _try(fn: Callable[[], Any]) -> Any:
    """Read a flag; ``_MISSING`` when torch refuses (mixed legacy/new TF32 APIs) or lacks it."""
    try:
        return fn()
    except Exception:
        return _MISSING


# legacy flag name -> (getter, setter); restored in this order
_LEGACY: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "cuda_matmul_allow_tf32": (
        lambda: torch.backends.cuda.matmul.allow_tf32,
        lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v),
    ),
    "cudnn_allow_tf32": (
        lambda: torch.backends.cudnn.allow_tf32,
        lambda v: setattr(torch.backends.cudnn, "allow_tf32", v),
    ),
}


@dataclass
class PrecisionFlags:
    """Everything that selects TF32 / reduced-precision float32 kernels, as read now.

    Both the legacy switches (``allow_tf32``, ``set_float32_matmul_precision``) and the per-backend
    ``fp32_precision`` strings of newer torch are kept: torch refuses to *read* the legacy ones
    after a program mixed the two APIs, so each is stored only when it could be read.
    """

    legacy: dict[str, Any] = field(default_factory=dict)
    fp32_precision: dict[tuple[str, ...], str] = field(default_factory=dict)

    @classmethod
    def capture(cls) -> PrecisionFlags:
        legacy: dict[str, Any] = {}
        for k, (get, _set) in _LEGACY.items():
            v = _try(get)
            if v is not _MISSING:
                legacy[k] = v
        new: dict[tuple[str, ...], str] = {}
        for path in _FP32_PRECISION_PATHS:
            b = _backend(path)
            v = _MISSING if b is None else _fp32_of(b)
            if isinstance(v, str):
                new[path] = v
        return cls(legacy, new)

    def restore(self) -> None:
        """Put every flag back. Legacy first, then any new-style string that still differs, then
        legacy again: measured on torch 2.13 as the order that reproduces both views exactly."""
        self._restore_legacy()
        for path, v in self.fp32_precision.items():
            b = _backend(path)
            if b is not None and _fp32_of(b) != v:
                b.fp32_precision = v
        self._restore_legacy()

    def _restore_legacy(self) -> None:
        for k, (get, put) in _LEGACY.items():
            if k in self.legacy and _try(get) != self.legacy[k]:
                put(self.legacy[k])


REDUCED_FP32 = frozenset({"tf32", "bf16"})


def precise_fp32() -> None:
    """Turn TF32 (cuBLAS, cuDNN) and reduced-precision oneDNN float32 math off.

    The legacy switches first (they keep the legacy flags readable); then any per-backend
    ``fp32_precision`` still set to TF32/bf16 (set through the new API, which the legacy
    switches do not override) is set to ``ieee`` explicitly."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for path in _FP32_PRECISION_PATHS:
        b = _backend(path)
        if b is not None and _fp32_of(b) in REDUCED_FP32:
            b.fp32_precision = "ieee"


@contextmanager
def full_fp32_precision() -> Iterator[None]:
    """Within the block, float32 matmuls and convolutions use full float32 (no TF32)."""
    saved = PrecisionFlags.capture()
    try:
        precise_fp32()
        yield
    finally:
        saved.restore()

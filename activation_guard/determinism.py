"""Run-to-run determinism: seed every RNG, force deterministic kernels, restore it all on exit.

``deterministic(seed)`` is for tests that must produce the same bits every run on one machine.
It is *not* a way to make two different machines agree (a CPU golden and a CUDA run use
different kernels whatever the flags say): that is what ``compare(..., tolerance="calibrated")``
is for. ``check_determinism`` tells which layers of a model differ between two identical runs.

What ``deterministic()`` cannot make deterministic (see docs/cross-device.md):

* ops with no deterministic implementation: they raise ``RuntimeError`` (or only warn with
  ``warn_only=True``) instead of running nondeterministically;
* random generators it does not own: ``numpy.random.Generator`` / ``torch.Generator`` objects
  created by user code, other libraries' RNGs, DataLoader worker processes started elsewhere;
* ``PYTHONHASHSEED`` (set iteration order), which is fixed when the interpreter starts;
* cuBLAS handles created before entry: ``CUBLAS_WORKSPACE_CONFIG`` is set on entry (as
  deterministic cuBLAS requires) but a handle that already exists keeps its workspace;
* custom CUDA/Triton extensions that ignore ``torch.use_deterministic_algorithms``;
* the thread count, hardware and library versions: results stay machine specific.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"

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


def _precise_fp32() -> None:
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
        _precise_fp32()
        yield
    finally:
        saved.restore()


@dataclass
class DeterministicState:
    """Yielded by :func:`deterministic`: the seed, and the settings as they were on entry."""

    seed: int
    previous: dict[str, Any] = field(default_factory=dict)


def _cuda_initialized() -> bool:
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global RNG and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # also seeds all CUDA devices (lazily when CUDA is not initialized)


@contextmanager
def deterministic(seed: int = 0, *, warn_only: bool = False) -> Iterator[DeterministicState]:
    """Seed torch, numpy and random; use deterministic algorithms; TF32 and cudnn.benchmark off.

    Everything is restored on exit, also when the block raises: RNG states (Python, numpy global,
    torch CPU and CUDA), ``torch.use_deterministic_algorithms`` (and its ``warn_only``), cuDNN's
    ``deterministic``/``benchmark``/TF32 flags, cuBLAS TF32, ``float32_matmul_precision`` and the
    ``CUBLAS_WORKSPACE_CONFIG`` environment variable. ``warn_only=True`` makes ops without a
    deterministic implementation warn instead of raise. Usable as a decorator as well.

    See the module docstring for what this cannot make deterministic.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"deterministic(seed=...) needs an int >= 0, got {seed!r}")
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.get_rng_state()
    initial_seed = torch.initial_seed()
    cuda_was_init = _cuda_initialized()
    cuda_states = torch.cuda.get_rng_state_all() if cuda_was_init else None
    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn_det = torch.backends.cudnn.deterministic
    cudnn_bench = torch.backends.cudnn.benchmark
    precision = PrecisionFlags.capture()
    env_before = os.environ.get(CUBLAS_ENV)
    state = DeterministicState(seed, {
        "deterministic_algorithms": det, "deterministic_warn_only": det_warn,
        "cudnn_deterministic": cudnn_det, "cudnn_benchmark": cudnn_bench,
        "precision": dict(precision.legacy), CUBLAS_ENV: env_before,
    })
    try:
        if env_before is None:
            os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        _precise_fp32()
        seed_everything(seed)
        yield state
    finally:
        torch.use_deterministic_algorithms(det, warn_only=det_warn)
        torch.backends.cudnn.deterministic = cudnn_det
        torch.backends.cudnn.benchmark = cudnn_bench
        precision.restore()
        if env_before is None:
            os.environ.pop(CUBLAS_ENV, None)
        else:
            os.environ[CUBLAS_ENV] = env_before
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        elif torch.cuda.is_available():
            # never used before entry: a fresh generator seeded as it would have been is exact
            torch.cuda.manual_seed_all(initial_seed)


def check_determinism(
    model: torch.nn.Module,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    runs: int = 2,
) -> list[Any]:
    """Run the forward ``runs`` times and return the layer calls whose outputs differ bitwise.

    Returns :class:`~activation_guard.compare.LayerResult` objects in execution order, each with
    the largest difference seen (``max_abs_diff``) and the leaf where it occurred. An empty list
    means every selected layer produced identical bits on every run. Layers listed here need a
    looser tolerance, ``deterministic()``, or ``tolerance="calibrated"``.
    """
    import tempfile

    from .api import compare, record

    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ValueError(f"check_determinism(runs=...) needs an int >= 2, got {runs!r}")
    worst: dict[tuple[str, int], Any] = {}
    order: dict[tuple[str, int], int] = {}
    with tempfile.TemporaryDirectory(prefix="activation_guard-det-") as d:
        path = os.path.join(d, "run0.h5")
        record(model, args, kwargs, path=path, include=include, exclude=exclude)
        for _ in range(runs - 1):
            report = compare(model, args, kwargs, path=path, rtol=0.0, atol=0.0, include=include, exclude=exclude)
            for i, layer in enumerate(report.layers):
                key = (layer.name, layer.call)
                order.setdefault(key, i)
                if layer.ok:
                    continue
                prev = worst.get(key)
                if prev is None or (layer.max_abs_diff or 0.0) > (prev.max_abs_diff or 0.0):
                    worst[key] = layer
    return sorted(worst.values(), key=lambda layer: order[(layer.name, layer.call)])

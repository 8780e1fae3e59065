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
* cuBLAS set up before entry: ``CUBLAS_WORKSPACE_CONFIG`` is set on entry (as deterministic
  cuBLAS requires), but torch sizes cuBLAS's workspace when CUDA first runs a matmul, so a
  process whose CUDA was initialised without it gets a warning on entry saying what to do (the
  pytest plugin sets it at start-up, before any test touches CUDA), and a matmul that raises for
  it inside the block is re-raised as a :class:`CublasWorkspaceError` naming the fix;
* custom CUDA/Triton extensions that ignore ``torch.use_deterministic_algorithms``;
* the thread count, hardware and library versions: results stay machine specific.
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._core.errors import ActivationGuardError, ActivationGuardWarning
from .._core.numerics import PrecisionFlags, precise_fp32
from ..calibration.shadow import isolated_rng
from ..capture.env import model_device
from .run import compare, record

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"
CUBLAS_DETERMINISTIC_VALUES = (":4096:8", ":16:8")  # the two settings torch accepts as deterministic
CUBLAS_FIX = (f"set {CUBLAS_ENV}={CUBLAS_DETERMINISTIC} in the environment before the process starts (the "
              f"activation_guard pytest plugin sets it at start-up unless a conftest or plugin initialised CUDA "
              f"first), or call deterministic() before any CUDA work")


class CublasWorkspaceError(ActivationGuardError, RuntimeError):
    """A CUDA matmul inside :func:`deterministic` refused to run: cuBLAS was set up before
    ``CUBLAS_WORKSPACE_CONFIG`` was."""


def _late_cublas(env_before: str | None) -> str | None:
    """Why cuBLAS may not honour the workspace setting deterministic() makes (None: it will)."""
    if env_before in CUBLAS_DETERMINISTIC_VALUES or not _cuda_initialized():
        return None
    now = "unset" if env_before is None else f"{env_before!r}"
    return (f"deterministic(): CUDA was initialised while {CUBLAS_ENV} was {now}; cuBLAS may keep the workspace "
            f"it chose then, so CUDA matmuls in this block may raise or not be deterministic: {CUBLAS_FIX}")

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
    late = _late_cublas(env_before)
    if late is not None:
        warnings.warn(ActivationGuardWarning(late), stacklevel=3)
    try:
        if env_before is None:
            os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        precise_fp32()
        seed_everything(seed)
        try:
            yield state
        except RuntimeError as e:
            if CUBLAS_ENV in str(e) and not isinstance(e, CublasWorkspaceError):
                raise CublasWorkspaceError(f"a CUDA matmul inside deterministic() needs {CUBLAS_ENV}, and cuBLAS "
                                           f"was set up before it was set: {CUBLAS_FIX}") from e
            raise
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
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ValueError(f"check_determinism(runs=...) needs an int >= 2, got {runs!r}")
    worst: dict[tuple[str, int], Any] = {}
    order: dict[tuple[str, int], int] = {}
    # the caller's generators are left as they were: a diagnostic run before a test's real compare
    # must not change what that compare sees (a seeded dropout would draw other masks)
    device = model_device(model, args if isinstance(args, tuple) else (args,), dict(kwargs or {}))
    with isolated_rng(device), tempfile.TemporaryDirectory(prefix="activation_guard-det-") as d:
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

"""Where float64 work can run, and how tensors move between devices.

The calibrated rule needs float64 (a shadow forward, error statistics); some accelerators have
no float64 kernels, so the work moves to the CPU there. Host-to-CUDA copies go through pinned
memory so they overlap the caller's work.
"""

from __future__ import annotations

import itertools

import torch

# device types known to lack float64 kernels: their shadow forward runs on the CPU instead
NO_FLOAT64_DEVICE_TYPES = frozenset({"mps"})

_F64_SUPPORT: dict[str, bool] = {}


def supports_float64(device: torch.device | str) -> bool:
    """Whether float64 tensors work on ``device`` (probed once per device, then cached)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type in NO_FLOAT64_DEVICE_TYPES:
        return False
    key = str(dev)
    if key not in _F64_SUPPORT:
        try:
            t = torch.ones(2, dtype=torch.float64, device=dev)
            _F64_SUPPORT[key] = bool(float((t * t).sum().item()) == 2.0)
        except Exception:
            _F64_SUPPORT[key] = False
    return _F64_SUPPORT[key]


def reference_device(device: torch.device | str | None) -> torch.device:
    """Where the float64 shadow forward runs: the live device, or the CPU if it lacks float64."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return dev if supports_float64(dev) else torch.device("cpu")


def transfer_plan(src: torch.device, dst: torch.device) -> str:
    """How a tensor moves: ``same`` (no copy), ``pinned`` (host -> CUDA through a page-locked
    buffer, non-blocking, so the copy overlaps the caller's work) or ``plain``."""
    if src == dst:
        return "same"
    if src.type == "cpu" and dst.type == "cuda":
        return "pinned"
    return "plain"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    plan = transfer_plan(t.device, device)
    if plan == "same":
        return t
    if plan == "pinned":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def golden_on(golden: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None, *,
              copy: bool = False) -> torch.Tensor:
    """A golden tensor (read from the file, so on the CPU) placed on the live ``device``, in
    ``dtype`` (default: its own), a tensor of its own when ``copy`` (the caller may change it).

    The one place golden values cross to the live device: CUDA refuses ops that mix devices
    (``torch.equal`` of a CPU golden and a CUDA output raises), and this keeps every such meeting
    behind one call that a test on a CPU-only machine can watch."""
    moved = golden.device != device
    if moved:
        golden = to_device(golden, device)
    if dtype is not None and golden.dtype != dtype:
        return golden.to(dtype)
    return golden.clone() if copy and not moved else golden


def module_device(module: torch.nn.Module, default: torch.device) -> torch.device:
    """Where a module's tensors live: its first parameter's device, else its first buffer's (a
    module without parameters can hold CUDA tables: RoPE frequencies, masks), else ``default``."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return default


def stats_device(t: torch.Tensor) -> torch.device:
    return t.device if supports_float64(t.device) else torch.device("cpu")

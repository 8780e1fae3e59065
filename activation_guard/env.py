"""What was true when a golden was recorded: versions, device, numerics flags, input fingerprint.

Stored with every golden and diffed against the live run, because "every layer diverged" is
usually an input or TF32 change, not a model bug, and the report should say so first.
Nothing time- or process-dependent is recorded: goldens must be byte-reproducible.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from typing import Any

import h5py
import numpy as np
import torch

from . import dtypes
from ._version import __version__
from .capture import flatten


def _safe(fn: Any, default: Any = None) -> Any:
    try:
        return fn()
    except Exception:
        return default


def numerics_flags() -> dict[str, Any]:
    """Flags that change what a float32 forward computes."""
    cuda_ok = torch.cuda.is_available()
    return {
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "default_dtype": str(torch.get_default_dtype()).replace("torch.", ""),
        "autocast_cpu": bool(_safe(lambda: torch.is_autocast_enabled("cpu"), _safe(torch.is_autocast_cpu_enabled, False))),
        "autocast_cuda": bool(_safe(lambda: torch.is_autocast_enabled("cuda"), False)) if cuda_ok else False,
        "num_threads": int(torch.get_num_threads()),
    }


def device_info(device: torch.device | None) -> dict[str, Any]:
    dev = device or torch.device("cpu")
    d: dict[str, Any] = {"device": str(dev), "device_type": dev.type}
    if dev.type == "cuda":
        d["device_name"] = _safe(lambda: torch.cuda.get_device_name(dev), "unknown")
        d["cuda"] = torch.version.cuda
        d["cudnn"] = _safe(torch.backends.cudnn.version)
    else:
        d["device_name"] = platform.processor() or platform.machine()
    return d


def versions() -> dict[str, str]:
    return {
        "activation_guard": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "python": platform.python_version(),
        "platform": sys.platform,
    }


def model_device(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    for leaf in flatten((args, kwargs)):
        if leaf.tensor is not None and leaf.type_name == "Tensor":
            return leaf.tensor.device
    return torch.device("cpu")


def input_fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per input leaf: dtype, shape and a SHA-256 of the exact bytes (device independent)."""
    out = []
    for leaf in flatten({"args": list(args), "kwargs": kwargs}):
        if leaf.kind == "tensor" and leaf.tensor is not None:
            t = leaf.tensor
            try:
                raw = dtypes.tensor_bytes(t)
                dt = dtypes.info_for(t.dtype).name
            except Exception:
                out.append({"path": leaf.path, "kind": "tensor", "dtype": str(t.dtype), "shape": list(t.shape)})
                continue
            out.append({"path": leaf.path, "kind": "tensor", "dtype": dt, "shape": [int(s) for s in t.shape],
                        "sha256": hashlib.sha256(raw).hexdigest()})
        elif leaf.kind == "str":
            out.append({"path": leaf.path, "kind": "str", "sha256": hashlib.sha256((leaf.value or "").encode()).hexdigest()})
        else:
            out.append({"path": leaf.path, "kind": leaf.kind, "type": leaf.type_name})
    return out


def describe_input_change(golden: list[dict[str, Any]] | None, live: list[dict[str, Any]]) -> list[str]:
    if golden is None:
        return []
    g = {e.get("path"): e for e in golden if isinstance(e, dict)}
    lv = {e["path"]: e for e in live}
    msgs = []
    for p in sorted(set(g) | set(lv)):
        a, b = g.get(p), lv.get(p)
        if a == b:
            continue
        if a is None:
            msgs.append(f"input {p} is new")
        elif b is None:
            msgs.append(f"input {p} is missing")
        elif a.get("shape") != b.get("shape") or a.get("dtype") != b.get("dtype"):
            msgs.append(f"input {p}: {a.get('dtype')} {a.get('shape')} -> {b.get('dtype')} {b.get('shape')}")
        else:
            msgs.append(f"input {p}: same dtype and shape, different values")
    return msgs


def describe_env_change(golden: dict[str, Any] | None, live: dict[str, Any]) -> list[str]:
    if not isinstance(golden, dict):
        return []
    msgs = []
    for k in sorted(live):
        if k in golden and golden[k] != live[k]:
            msgs.append(f"{k}: golden {golden[k]!r}, live {live[k]!r}")
    return msgs

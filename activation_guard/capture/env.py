"""What was true when a golden was recorded: versions, device, numerics flags, input fingerprint.

Stored with every golden and diffed against the live run, because "every layer diverged" is
usually an input or TF32 change, not a model bug, and the report should say so first.
Nothing time- or process-dependent is recorded: goldens must be byte-reproducible.

Over the ~400 lines we aim for: every fact a golden records about its run (versions, device,
numerics switches, the precision each op family really runs in, inputs, modes) is recorded and
described as a change in one place, so a report's description reads the fields it was recorded from.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np
import torch

from .._core import dtypes
from .._version import __version__
from ..options.selection import few
from ..values.leaves import flatten, value_at
from ..values.paths import stored_by_repr


def _safe(fn: Any, default: Any = None) -> Any:
    try:
        return fn()
    except Exception:
        return default


def _autocast_cpu() -> bool:
    """Ask the device-generic API first: the old ``is_autocast_cpu_enabled`` warns (deprecated)."""
    v = _safe(lambda: torch.is_autocast_enabled("cpu"))
    return bool(v if v is not None else _safe(torch.is_autocast_cpu_enabled, False))


def _fp32_precision() -> dict[str, str]:
    """torch >= 2.9 per-backend float32 precision ("ieee", "tf32", "bf16", "none" = inherit).

    Recorded as well as the legacy TF32 switches because torch refuses to read the legacy ones
    once a program has mixed both APIs, and oneDNN's setting changes CPU float32 math."""
    out: dict[str, str] = {}
    for key, path in (("fp32_precision", ()), ("fp32_precision.cuda.matmul", ("cuda", "matmul")),
                      ("fp32_precision.cudnn.conv", ("cudnn", "conv")), ("fp32_precision.cudnn.rnn", ("cudnn", "rnn")),
                      ("fp32_precision.mkldnn.matmul", ("mkldnn", "matmul")),
                      ("fp32_precision.mkldnn.conv", ("mkldnn", "conv")),
                      ("fp32_precision.mkldnn.rnn", ("mkldnn", "rnn"))):
        obj: Any = torch.backends
        for part in path:
            obj = getattr(obj, part, None)
        v = _safe(lambda obj=obj: obj.fp32_precision) if obj is not None else None
        if isinstance(v, str):
            out[key] = v
    return out


def numerics_flags() -> dict[str, Any]:
    """Flags that change what a float32 forward computes.

    A legacy TF32 flag that torch refuses to read (mixed legacy/new APIs) is recorded as None;
    the ``fp32_precision.*`` keys then carry the information."""
    cuda_ok = torch.cuda.is_available()
    tf32_mm = _safe(lambda: torch.backends.cuda.matmul.allow_tf32)
    tf32_cudnn = _safe(lambda: torch.backends.cudnn.allow_tf32)
    return {
        "cuda_matmul_allow_tf32": None if tf32_mm is None else bool(tf32_mm),
        "cudnn_allow_tf32": None if tf32_cudnn is None else bool(tf32_cudnn),
        "float32_matmul_precision": _safe(torch.get_float32_matmul_precision),
        **_fp32_precision(),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "default_dtype": str(torch.get_default_dtype()).replace("torch.", ""),
        "autocast_cpu": _autocast_cpu(),
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
        cap = _safe(lambda: torch.cuda.get_device_capability(dev))
        d["capability"] = f"sm_{cap[0]}{cap[1]}" if cap else None
    else:
        d["device_name"] = platform.processor() or platform.machine()
    return d


# op families whose float32 precision a backend switch can lower: (legacy bool, per-backend key)
_CUDA_FAMILIES = {"matmul": ("cuda_matmul_allow_tf32", "fp32_precision.cuda.matmul"),
                  "conv": ("cudnn_allow_tf32", "fp32_precision.cudnn.conv"),
                  "rnn": ("cudnn_allow_tf32", "fp32_precision.cudnn.rnn")}
_CPU_FAMILIES = {"matmul": "fp32_precision.mkldnn.matmul", "conv": "fp32_precision.mkldnn.conv",
                 "rnn": "fp32_precision.mkldnn.rnn"}
REDUCED = ("tf32", "bf16")


def _backend_value(numerics: dict[str, Any], key: str) -> str | None:
    """A per-backend fp32_precision switch, "none" resolved to the global one."""
    v = numerics.get(key)
    if v in (None, "none"):
        v = numerics.get("fp32_precision")
    return v if isinstance(v, str) and v != "none" else None


def effective_precision(numerics: Any, device: Any) -> dict[str, str]:
    """What float32 matmuls, convolutions and RNNs really compute in on a run's device ("ieee",
    "tf32", "bf16"), from its recorded numerics flags and device. The same flags mean different
    things per device: cuDNN's TF32 switch, on by default, changes nothing on a CPU (nor on a GPU
    before sm_80, which has no TF32), and makes every float32 convolution on a recent GPU round
    its operands to a 10-bit mantissa."""
    num = numerics if isinstance(numerics, dict) else {}
    dev = device if isinstance(device, dict) else {}
    out = {f: "ieee" for f in _CUDA_FAMILIES}
    if dev.get("device_type") == "cuda":
        cap = dev.get("capability")
        if isinstance(cap, str) and cap.startswith("sm_") and cap[3:].isdigit() and int(cap[3:]) < 80:
            return out  # no TF32 units: the switches change nothing
        for fam, (legacy, key) in _CUDA_FAMILIES.items():
            new = _backend_value(num, key)
            on = new == "tf32" if new is not None else bool(num.get(legacy))
            if fam == "matmul" and num.get("float32_matmul_precision") in ("high", "medium"):
                on = True
            if on:
                out[fam] = "tf32"
    elif dev.get("device_type", "cpu") == "cpu":
        for fam, key in _CPU_FAMILIES.items():
            v = _backend_value(num, key)
            if v in REDUCED:
                out[fam] = v
        if out["matmul"] == "ieee" and num.get("float32_matmul_precision") == "medium":
            out["matmul"] = "bf16"  # oneDNN may run float32 matmuls in bf16 where the CPU has it
    return out


def op_families(type_names: Any) -> set[str]:
    """The op families a model's layers show it uses, from their class names: matmuls always
    (any model may call one), convolutions for a ``Conv*`` layer, RNNs for an ``RNN``/``LSTM``/
    ``GRU`` one. A convolution called from a model's own code, with no conv layer, is missed: the
    defaults stay strict there (a false alarm, never a widened tolerance it did not need)."""
    out = {"matmul"}
    for name in type_names:
        n = str(name)
        if "Conv" in n:
            out.add("conv")
        if n in ("RNNCell", "LSTMCell", "GRUCell") or n.endswith(("RNN", "LSTM", "GRU")):
            out.add("rnn")
    return out


def precision_change(golden_numerics: Any, golden_device: Any, live_numerics: Any, live_device: Any,
                     cross_device: bool, families: set[str] | None = None) -> tuple[str, str] | None:
    """Why float32 results may differ by reduced-precision rounding between a golden and a live
    run: ("TF32" or "bf16", a line for the report) naming the op families (of ``families``, the
    ones the model uses; None: all) whose effective precision differs, or (across devices) is
    reduced on either side. None when both compute in full float32."""
    g = effective_precision(golden_numerics, golden_device)
    v = effective_precision(live_numerics, live_device)
    fams = [f for f in g if (families is None or f in families)
            and (g[f] != v[f] or (cross_device and (g[f] in REDUCED or v[f] in REDUCED)))]
    if not fams:
        return None
    names = {"matmul": "matmuls", "conv": "convolutions", "rnn": "RNNs"}
    parts = [f"{names[f]} {g[f].upper()} on the golden's {_dev(golden_device)}, {v[f].upper()} on the live "
             f"{_dev(live_device)}" for f in fams]
    tag = "bf16" if any("bf16" in (g[f], v[f]) for f in fams) else "TF32"
    fix = ("set torch.backends.cudnn.allow_tf32 = False and torch.backends.cuda.matmul.allow_tf32 = False (or "
           "fp32_precision 'ieee') for full float32" if tag == "TF32" else
           "set the oneDNN fp32_precision to 'ieee' and float32_matmul_precision to 'highest' for full float32")
    return tag, (f"float32 precision: {'; '.join(parts)}: {tag} rounding alone moves float32 results by about "
                 f"1e-3 relative, which can explain differences of that size; float32 defaults are widened for it "
                 f"({fix}, or use tolerance='calibrated')")


def _dev(device: Any) -> str:
    d = device if isinstance(device, dict) else {}
    cap = f" {d['capability']}" if d.get("capability") else ""
    return f"{d.get('device', '?')}{cap}"


def different_device(golden: Any, live: Any) -> bool:
    """Another device type, or the same type with another name or compute capability (another
    GPU model runs other kernels, so its float32 rounding differs as a CPU's does from a GPU's)."""
    g = golden if isinstance(golden, dict) else {}
    v = live if isinstance(live, dict) else {}
    if (g.get("device_type") or "cpu") != (v.get("device_type") or "cpu"):
        return True
    return any(g.get(k) is not None and v.get(k) is not None and g[k] != v[k] for k in ("device_name", "capability"))


def other_model(golden: Any, live: Any) -> str | None:
    """The pair's label when both runs have one device type but another model, else None."""
    g = golden if isinstance(golden, dict) else {}
    v = live if isinstance(live, dict) else {}
    if (g.get("device_type") or "cpu") != (v.get("device_type") or "cpu") or not different_device(g, v):
        return None

    def name(d: dict[str, Any]) -> str:
        model = ", ".join(str(d[k]) for k in ("device_name", "capability") if d.get(k))
        return f"{d.get('device_type') or 'cpu'} ({model})"
    return f"{name(g)}->{name(v)}"


def versions() -> dict[str, str]:
    return {
        "activation_guard": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # the CUDA torch was built with; None for CPU-only builds
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
    walked = {"args": list(args), "kwargs": kwargs}
    for leaf in flatten(walked):
        if leaf.kind == "tensor" and leaf.tensor is not None:
            t = leaf.tensor
            try:
                raw = dtypes.tensor_bytes(t)
                dt = dtypes.info_for(t.dtype).name
            except Exception:
                out.append({"path": leaf.path, "kind": "tensor", "dtype": str(t.dtype), "shape": list(t.shape)})
                continue
            out.append({"path": leaf.path, "kind": "tensor", "dtype": dt, "shape": [int(s) for s in t.shape],
                        "sha256": hashlib.sha256(raw.data).hexdigest()})
        elif leaf.kind == "str":
            digest = hashlib.sha256((leaf.value or "").encode()).hexdigest()
            e: dict[str, Any] = {"path": leaf.path, "kind": "str", "sha256": digest}
            if stored_by_repr(leaf.type_name):  # a dtype, device, enum or bytes, stored by value
                e["type"] = leaf.type_name
            out.append(e)
        else:
            e = {"path": leaf.path, "kind": leaf.kind, "type": leaf.type_name}
            held = _held_tensors_digest(value_at(walked, leaf.path)) if leaf.kind == "object" else None
            if held is not None:  # a KV cache and the like: what it holds, not only its type
                e["sha256"] = held
            out.append(e)
    return out


MAX_HELD_DEPTH = 4  # attribute levels searched for tensors inside an object input


def _held_tensors_digest(obj: Any) -> str | None:
    """SHA-256 over the tensors an opaque input object holds through its attributes (and lists,
    tuples and dicts of them), in attribute order; None when it holds none. A changed KV cache
    passed to the model was not an input change: the first layer that read it
    was blamed instead."""
    h = hashlib.sha256()
    seen: set[int] = set()
    found = False

    def walk(o: Any, depth: int) -> None:
        nonlocal found
        if depth > MAX_HELD_DEPTH or id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            try:
                raw = dtypes.tensor_bytes(o)
            except Exception:
                return
            h.update(f"{o.dtype}{tuple(o.shape)}".encode())
            h.update(raw.data)
            found = True
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif isinstance(o, dict):
            for k, v in o.items():
                h.update(repr(k).encode())
                walk(v, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, (type, torch.nn.Module)):
            try:
                attrs = list(vars(o).items())
            except TypeError:  # (a __dict__ that is not a dict)
                return
            for k, v in attrs:
                h.update(repr(k).encode())
                walk(v, depth + 1)

    walk(obj, 0)
    return h.hexdigest() if found else None


def _changed_inputs(golden: list[dict[str, Any]] | None,
                    live: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]:
    """(path, recorded, live) of each model input whose record differs (None: absent on that side)."""
    if golden is None:
        return []
    g = {str(e.get("path")): e for e in golden if isinstance(e, dict)}
    lv = {str(e["path"]): e for e in live}
    return [(p, g.get(p), lv.get(p)) for p in sorted(set(g) | set(lv)) if not _same_input(g.get(p), lv.get(p))]


def _same_input(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a == b:
        return True
    if a is None or b is None:
        return False
    if a.get("kind") == b.get("kind") == "object" and "sha256" not in a:  # recorded before objects' tensors were
        return a.get("type") == b.get("type")
    # a recording from before dtypes, devices, enums and bytes were stored by value: by type only
    return (a.get("kind") == "object" and b.get("kind") == "str"
            and a.get("type") is not None and a.get("type") == b.get("type"))


def describe_input_change(golden: list[dict[str, Any]] | None, live: list[dict[str, Any]]) -> list[str]:
    msgs = []
    for p, a, b in _changed_inputs(golden, live):
        if a is None:
            msgs.append(f"input {p} is new")
        elif b is None:
            msgs.append(f"input {p} is missing")
        elif a.get("kind") == b.get("kind") == "object" and a.get("type") == b.get("type"):
            msgs.append(f"input {p} ({a.get('type')}): the tensors it holds differ")
        elif a.get("kind") == "str" or b.get("kind") == "str":
            what = b.get("type") or a.get("type") or "str"
            msgs.append(f"input {p}: a different {what}" if what != "str" else f"input {p}: a different string")
        elif a.get("shape") != b.get("shape") or a.get("dtype") != b.get("dtype"):
            msgs.append(f"input {p}: {a.get('dtype')} {a.get('shape')} -> {b.get('dtype')} {b.get('shape')}")
        else:
            msgs.append(f"input {p}: same dtype and shape, different values")
    return msgs


def objects_changed(golden: list[dict[str, Any]] | None, live: list[dict[str, Any]]) -> bool:
    """An opaque input object (a KV cache) holds other tensors than the recording's. Replays get
    the live object (an opaque object cannot be rebuilt from the golden), so a layer that reads it
    differs on replay too: its own error then says nothing about its code."""
    return any(a is not None and b is not None and a.get("kind") == b.get("kind") == "object"
               for _, a, b in _changed_inputs(golden, live))


def inputs_replaced(golden: list[dict[str, Any]] | None, live: list[dict[str, Any]]) -> bool | None:
    """Whether the model's inputs differ from the recording's by more than their precision: True
    for an input added, removed or reshaped, other values in the same dtype, or an integer or bool
    input whose dtype changed; None when only floating dtypes changed, which is the same inputs cast (what
    ``replay="all"`` judges across precisions) only if the values agree: the record holds digests,
    so the caller checks the values (``replay_args.root_inputs_match``); also None for a golden with
    no record of its inputs (nothing to tell them by but the values); False otherwise."""
    if golden is None:
        return None
    changed = [(a, b) for _, a, b in _changed_inputs(golden, live) if not _precision_arg(a, b)]
    if any(a is None or b is None or a.get("shape") != b.get("shape") or a.get("dtype") == b.get("dtype")
           or not (_floating(a.get("dtype")) and _floating(b.get("dtype"))) for a, b in changed):
        return True
    return None if changed else False


def _floating(name: Any) -> bool:
    info = dtypes.BY_NAME.get(name) if isinstance(name, str) else None
    return info is not None and info.kind == "float"


def _precision_arg(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """A ``torch.dtype`` or ``torch.device`` argument that changed: the model asked to run in
    another precision or on another device, which is what a cross-precision replay judges."""
    return (a is not None and b is not None and a.get("kind") == b.get("kind") == "str"
            and a.get("type") == b.get("type") and a.get("type") in ("dtype", "device"))


def _on(v: Any) -> str:
    return "on" if v else "off"


_PRECISION_RANK = {"highest": "full float32", "high": "TF32 (or bf16x3)", "medium": "bf16"}

# why a changed flag matters, phrased for the report header
_EXPLAIN: dict[str, Any] = {
    "cuda_matmul_allow_tf32": lambda g, v: f"live run has TF32 matmuls {_on(v)}, golden had them {_on(g)}",
    "cudnn_allow_tf32": lambda g, v: f"live run has TF32 cuDNN convolutions {_on(v)}, golden had them {_on(g)}",
    "float32_matmul_precision": lambda g, v: (f"live float32 matmuls may use {_PRECISION_RANK.get(v, v)}, "
                                              f"golden used {_PRECISION_RANK.get(g, g)}"),
    "deterministic_algorithms": lambda g, v: (f"live run has deterministic algorithms {_on(v)}, "
                                              f"golden had them {_on(g)}"),
    "cudnn_benchmark": lambda g, v: (f"live run has cudnn.benchmark {_on(v)} (algorithm choice may vary), "
                                     f"golden had it {_on(g)}"),
    "cudnn_deterministic": lambda g, v: f"live run has cudnn.deterministic {_on(v)}, golden had it {_on(g)}",
    "autocast_cpu": lambda g, v: f"live run has CPU autocast (mixed precision) {_on(v)}, golden had it {_on(g)}",
    "autocast_cuda": lambda g, v: f"live run has CUDA autocast (mixed precision) {_on(v)}, golden had it {_on(g)}",
    "num_threads": lambda g, v: "a different CPU thread count can change reduction order and so float rounding",
    "default_dtype": lambda g, v: "the default dtype changed: new tensors and parameters get a different precision",
}


def describe_env_change(golden: dict[str, Any] | None, live: dict[str, Any]) -> list[str]:
    """One line per numerics flag that differs, with why it matters when that is known."""
    if not isinstance(golden, dict):
        return []
    msgs = []
    legacy = ("cuda_matmul_allow_tf32", "cudnn_allow_tf32", "float32_matmul_precision")
    # the fp32_precision.* keys mirror the legacy switches: list them only when those say nothing
    legacy_told = any(golden.get(k) is not None and live.get(k) is not None and golden[k] != live[k] for k in legacy)
    for k in sorted(live):
        if legacy_told and k.startswith("fp32_precision"):
            continue
        if k in golden and golden[k] != live[k]:
            msg = f"{k}: golden {golden[k]!r}, live {live[k]!r}"
            why = _EXPLAIN.get(k)
            if why is None and k.startswith("fp32_precision"):
                why = lambda g, v: "float32 math of this backend uses a different precision"  # noqa: E731
            if why is not None and golden[k] is not None and live[k] is not None:
                msg += f" ({_safe(lambda why=why, k=k: why(golden[k], live[k]), '')})"
            msgs.append(msg)
    return msgs


def recorded_device(meta: dict[str, Any]) -> str | None:
    """The device a golden was recorded on (``meta["device"]["device"]``), if it says."""
    d = meta.get("device")
    return d.get("device") if isinstance(d, dict) else None


def describe_version_change(golden: Any, other: Any, other_label: str = "live") -> list[str]:
    """torch/CUDA version differences between a golden's ``versions`` record and another's."""
    g = golden if isinstance(golden, dict) else {}
    o = other if isinstance(other, dict) else {}
    return [f"{k}: golden {g[k]}, {other_label} {o[k]}"
            for k in ("torch", "cuda") if g.get(k) and o.get(k) and g[k] != o[k]]


def describe_device_change(golden: dict[str, Any] | None, live: dict[str, Any]) -> list[str]:
    """Device, device name, compute capability, CUDA and cuDNN versions that differ."""
    if not isinstance(golden, dict):
        return []
    msgs = []
    gt, lt = golden.get("device_type"), live.get("device_type")
    if gt is not None and gt != lt:
        msgs.append(f"device: golden {golden.get('device')} ({golden.get('device_name')}), "
                    f"live {live.get('device')} ({live.get('device_name')})")
        return msgs
    for k, label in (("device_name", "device name"), ("capability", "compute capability"), ("cuda", "CUDA"),
                     ("cudnn", "cuDNN")):
        if golden.get(k) is not None and live.get(k) is not None and golden[k] != live[k]:
            msgs.append(f"{label}: golden {golden[k]}, live {live[k]}")
    return msgs


MAX_LISTED_MODES = 50  # module names kept in a golden's training-mode record


def training_modes(model: torch.nn.Module, modules: Any = None) -> dict[str, Any]:
    """The model's train/eval mode, and the modules whose mode differs from the root's (dropout
    on in one block of an eval model): both change what a forward computes."""
    root = bool(model.training)
    odd = [n for n, m in (modules or model.named_modules()) if n and bool(m.training) != root]
    return {"training": root, "training_differs": odd[:MAX_LISTED_MODES], "training_differs_count": len(odd)}


def _mode(flag: bool) -> str:
    return "training" if flag else "eval"


_READS_TRAINING: dict[type, bool] = {}


def mode_dependent(module: torch.nn.Module) -> bool:
    """Whether a module computes differently in training and eval mode: dropout, batch norm, or
    a forward whose code reads ``self.training`` (a GELU does not). A forward whose source
    cannot be read counts as dependent: the note is then shown rather than hidden."""
    if isinstance(module, (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm)):
        return True
    cls = type(module)
    known = _READS_TRAINING.get(cls)
    if known is None:
        import inspect

        try:
            known = "self.training" in inspect.getsource(cls.forward)
        except (OSError, TypeError):
            known = True
        _READS_TRAINING[cls] = known
    return known


def _dependent_under(name: str, modules: Sequence[tuple[str, torch.nn.Module]]) -> list[str]:
    """The mode-dependent modules in the subtree ``name`` (``""``: the whole model)."""
    return [n for n, m in modules if (not name or n == name or n.startswith(name + ".")) and mode_dependent(m)]


def describe_training_change(golden_meta: dict[str, Any], live: dict[str, Any],
                              live_is: str = "the live model is",
                              modules: Sequence[tuple[str, torch.nn.Module]] | None = None) -> list[str]:
    """The first note of a report when the live model runs in another mode than the golden's
    (``live_is``: how the other side is named, e.g. by ``diff``: "the other recording was").
    With the live model's named ``modules``, only a switch of a subtree holding a module whose
    computation depends on the mode is worth a note, and those modules are named."""
    g = golden_meta.get("training")
    if not isinstance(g, bool):
        return []
    if g != live["training"]:
        which = ""
        if modules is not None:
            dependent = _dependent_under("", modules)
            if not dependent:
                return []
            which = f" (mode-dependent modules: {few(dependent)})"
        return [f"golden recorded in {_mode(g)} mode; {live_is} in {_mode(live['training'])} mode: "
                f"dropout and batch-norm statistics differ{which}"]
    gd = golden_meta.get("training_differs")
    if isinstance(gd, list) and gd != live["training_differs"]:
        changed = sorted(set(map(str, gd)) ^ set(live["training_differs"]))
        if modules is None:
            return [f"modules switched between training and eval mode since the golden was recorded: "
                    f"{few(changed)} (dropout and batch-norm behave differently)"]
        now_training = set(live["training_differs"]) if not live["training"] else set(gd)
        known = {n for n, _ in modules}
        parts, dependent = [], []
        for name in changed:
            under = _dependent_under(name, modules) if name in known else [name]
            if not under:  # (a GELU built in training mode: computes the same in both)
                continue
            dependent += under
            mode = "training" if name in now_training else "eval"
            parts.append(f"{name!r} now in {mode} mode")
        if not parts:
            return []
        return [f"modules switched between training and eval mode since the golden was recorded: "
                f"{few(parts, show=str)}; they hold modules that compute differently in the two modes: "
                f"{few(list(dict.fromkeys(dependent)))}"]
    return []

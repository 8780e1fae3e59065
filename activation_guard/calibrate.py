"""Calibrated tolerances: judge a live-vs-golden difference against both runs' own numerical noise.

A float32 (or TF32, bf16, fp16) forward differs from the exact result by rounding noise that
depends on the kernels used. Each run's noise is measured the same way: the model is deep-copied
to float64 and run on the same inputs (the *shadow* forward), and per layer call and output the
run's error against that float64 reference is kept as a *noise floor* (max abs and RMS).

The rule (see docs/cross-device.md) is adapted from the float64-reference check that PyTorch's
compiler uses for accuracy (``torch._dynamo.utils.same``)::

    RMSE(res, fp64) <= m * RMSE(ref, fp64) + tol / 10

Here both sides have a floor, and the live-vs-golden error itself is judged::

    err(live, golden) <= m * (floor(golden) + floor(live)) + ABS_TERM    (for max-abs and for RMS)

By the triangle inequality ``|live - golden| <= |live - ref| + |ref - golden|`` this holds with
``m = 1`` whenever the two float64 references agree, i.e. whenever the model computes the same
function: noise alone can never fail it. A real change (weights, epsilon, activation) moves the
float64 reference itself, and the error at that layer exceeds the floors. ``m`` is a safety
margin for references that differ slightly (float32 segments inside model code, float64 kernels
of another device); the constants are Dynamo's.

The golden's floors are stored in its meta JSON under ``META_KEY`` (``record(calibrate=True)``);
the live floors are measured during ``compare(tolerance="calibrated")``.
"""

from __future__ import annotations

import copy
import math
import os
import random
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .capture import Leaf, flatten, hooked, run_forward
from .compare import CHUNK, LeafResult, compare_tensors, dtype_name, leaf_from_stats
from .determinism import full_fp32_precision
from .errors import ActivationGuardError, GoldenFormatError
from .store import GoldenReader, GoldenWriter

# --------------------------------------------------------------------------- constants

META_KEY = "calibration"  # key of the golden's meta JSON that holds the noise floors
FORMAT_VERSION = 1
MULTIPLIER = 2.0  # Dynamo same(): 2 for float32 results
MULTIPLIER_REDUCED = 3.0  # Dynamo same(): 3 when the result is float16/bfloat16 (AMP false alarms)
MULTIPLIER_SMALL = 3.0  # Dynamo same(): 3 for tensors of fewer than SMALL_NUMEL elements
SMALL_NUMEL = 1000
ABS_TERM = 1e-5  # Dynamo same(): tol / 10 with its float32 default tol = 1e-4
REDUCED_DTYPES = frozenset({
    "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu",
})
CALIBRATED_DTYPES = REDUCED_DTYPES | {"float32", "float64"}  # real floating outputs get floors

# device types known to lack float64 kernels: their shadow forward runs on the CPU instead
NO_FLOAT64_DEVICE_TYPES = frozenset({"mps"})


def multiplier(dtype_name: str, numel: int) -> float:
    """The margin ``m`` for an output of this (lower-precision side) dtype and size."""
    if dtype_name in REDUCED_DTYPES:
        return MULTIPLIER_REDUCED
    if numel < SMALL_NUMEL:
        return MULTIPLIER_SMALL
    return MULTIPLIER


def rule_text(m: float) -> str:
    return f"calibrated: {m:g} x (golden floor + live floor) + {ABS_TERM:g}"


# --------------------------------------------------------------------------- devices

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


def _stats_device(t: torch.Tensor) -> torch.device:
    return t.device if supports_float64(t.device) else torch.device("cpu")


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class NoiseFloor:
    """A run's error against the float64 reference for one output: max |x - ref| and RMS."""

    max_abs: float
    rms: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.max_abs) and math.isfinite(self.rms)


def diff_stats(x: torch.Tensor, ref: torch.Tensor) -> NoiseFloor:
    """Max abs and RMS of ``x - ref`` in float64, on ``x``'s device (CPU if it lacks float64).

    Positions where both are equal, or both NaN, count as zero; any other non-finite difference
    makes the result infinite. Chunked so memory stays bounded, with a single device sync.
    """
    dev = _stats_device(x)
    xs = to_device(x.detach(), dev).reshape(-1)
    rs = to_device(ref.detach(), dev).reshape(-1)
    n = xs.numel()
    if n != rs.numel():
        raise ValueError(f"diff_stats: {n} elements vs {rs.numel()}")
    if n == 0:
        return NoiseFloor(0.0, 0.0)
    mx = torch.zeros((), dtype=torch.float64, device=dev)
    ss = torch.zeros((), dtype=torch.float64, device=dev)
    for i in range(0, n, CHUNK):
        a = xs[i : i + CHUNK].to(torch.float64)
        b = rs[i : i + CHUNK].to(torch.float64)
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        d = torch.nan_to_num(torch.where(same, torch.zeros_like(a), a - b).abs(), nan=math.inf)
        mx = torch.maximum(mx, d.max())
        ss = ss + (d * d).sum()
    m, r = torch.stack([mx, torch.sqrt(ss / n)]).tolist()
    return NoiseFloor(float(m), float(r))


# --------------------------------------------------------------------------- floor table


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


class FloorTable:
    """Noise floors per layer name, call index and output path (the JSON layout of META_KEY)."""

    def __init__(self) -> None:
        self.floors: dict[str, dict[int, dict[str, NoiseFloor | None]]] = {}
        self.info: dict[str, Any] = {}

    def add(self, name: str, call: int, path: str, floor: NoiseFloor | None) -> None:
        self.floors.setdefault(name, {}).setdefault(call, {})[path] = floor if floor is not None and floor.finite else None

    def get(self, name: str, call: int, path: str) -> NoiseFloor | None:
        return self.floors.get(name, {}).get(call, {}).get(path)

    def __len__(self) -> int:
        return sum(len(p) for c in self.floors.values() for p in c.values())

    def to_meta(self) -> dict[str, Any]:
        floors = {
            name: {str(call): {p: (None if f is None else [_num(f.max_abs), _num(f.rms)]) for p, f in paths.items()}
                   for call, paths in calls.items()}
            for name, calls in self.floors.items()
        }
        return {
            "version": FORMAT_VERSION,
            "reference_dtype": "float64",
            **self.info,
            "rule": {"multiplier": MULTIPLIER, "multiplier_reduced": MULTIPLIER_REDUCED,
                     "multiplier_small": MULTIPLIER_SMALL, "small_numel": SMALL_NUMEL, "abs_term": ABS_TERM},
            "floors": floors,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], path: str | os.PathLike[str]) -> FloorTable:
        """Read the floors of a golden; a clear error when it has none or they are malformed."""
        rec = meta.get(META_KEY) if isinstance(meta, Mapping) else None
        if rec is None:
            raise GoldenFormatError(
                path, 'has no calibrated noise floors, which tolerance="calibrated" needs',
                fix="re-record it with calibration: `activation_guard.record(..., calibrate=True)` "
                    "or `pytest --ag-update --ag-calibrate`",
            )
        bad = GoldenFormatError(path, f"has a malformed {META_KEY!r} record in its meta", fix="re-record it with calibrate=True")
        if not isinstance(rec, Mapping) or not isinstance(rec.get("floors"), Mapping):
            raise bad
        ver = rec.get("version")
        if not isinstance(ver, int) or isinstance(ver, bool):
            raise bad
        if ver > FORMAT_VERSION:
            raise GoldenFormatError(path, f"has calibration format version {ver}, newer than this activation_guard understands ({FORMAT_VERSION})",
                                    fix="upgrade activation_guard")
        table = cls()
        table.info = {k: v for k, v in rec.items() if k not in ("floors",)}
        for name, calls in rec["floors"].items():
            if not isinstance(name, str) or not isinstance(calls, Mapping):
                raise bad
            for call, paths in calls.items():
                if not isinstance(call, str) or not call.isdigit() or not isinstance(paths, Mapping):
                    raise bad
                for p, v in paths.items():
                    if not isinstance(p, str):
                        raise bad
                    if v is None:
                        table.add(name, int(call), p, None)
                        continue
                    if (not isinstance(v, list) or len(v) != 2
                            or not all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0) for x in v)):
                        raise bad
                    if v[0] is None or v[1] is None:
                        table.add(name, int(call), p, None)
                    else:
                        table.add(name, int(call), p, NoiseFloor(float(v[0]), float(v[1])))
        return table


# --------------------------------------------------------------------------- shadow forward


def _to_reference(obj: Any, device: torch.device, depth: int = 0) -> Any:
    """Inputs for the shadow: floating tensors become float64 copies on ``device``; other
    tensors are copied (the model may modify its inputs in place); containers are rebuilt."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_floating_point():
            return t.to(device=device, dtype=torch.float64, copy=True)
        return t.to(device=device, copy=True)
    if depth > 32:
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_reference(v, device, depth + 1) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_reference(v, device, depth + 1) for v in obj)
    if isinstance(obj, Mapping):
        items = {k: _to_reference(v, device, depth + 1) for k, v in obj.items()}
        ctor: Any = type(obj)
        try:
            return ctor(items)
        except Exception:
            return items
    return obj


@contextmanager
def _isolated_rng(device: torch.device) -> Iterator[None]:
    """The shadow forward must not advance any RNG the real forward will use."""
    py, npst = random.getstate(), np.random.get_state()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npst)


@contextmanager
def _no_autocast() -> Iterator[None]:
    with ExitStack() as stack:
        for dev_type in ("cpu", "cuda"):
            if dev_type == "cuda" and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(device_type=dev_type, enabled=False))
        yield


class ShadowRun:
    """The float64 copy of a model, run once on the inputs; its outputs kept in a temporary
    golden file so memory stays near one layer's worth, as for the real golden."""

    def __init__(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 include: Sequence[str] | None, exclude: Sequence[str] | None, live_device: torch.device):
        self.live_device = live_device
        self.device = reference_device(live_device)
        self._tmp = tempfile.TemporaryDirectory(prefix="activation_guard-shadow-")
        self.reader: GoldenReader | None = None
        self._calls: dict[tuple[str, int], dict[str, Any]] = {}
        try:
            self._run(model, args, kwargs, include, exclude)
        except BaseException:
            self.close()
            raise

    def _run(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             include: Sequence[str] | None, exclude: Sequence[str] | None) -> None:
        try:
            shadow = copy.deepcopy(model)
        except Exception as e:
            raise ActivationGuardError(
                f"calibrated tolerances need a float64 copy of the model, but copy.deepcopy({type(model).__name__}) "
                f"failed ({type(e).__name__}: {e}); use tolerance='strict' for this model") from e
        try:
            if self.device != self.live_device:
                shadow.to(self.device)
            shadow.double()
            a = _to_reference(args, self.device)
            kw = _to_reference(kwargs, self.device)
            path = os.path.join(self._tmp.name, "shadow.h5")
            writer = GoldenWriter(path)

            def on_output(name: str, call: int, module: torch.nn.Module, output: Any) -> None:
                writer.add_call(name, call, type(module).__name__, flatten(output))

            try:
                with _isolated_rng(self.live_device), _no_autocast(), full_fp32_precision(), \
                        hooked(shadow, on_output, include, exclude) as state:
                    run_forward(shadow, a, kw, state)
                writer.commit({})
            except BaseException:
                writer.abort()
                raise
        except ActivationGuardError:
            raise
        except Exception as e:
            raise ActivationGuardError(
                f"the float64 shadow forward for calibrated tolerances failed on {self.device} "
                f"({type(e).__name__}: {e}); use tolerance='strict' for this model") from e
        finally:
            del shadow
        self.reader = GoldenReader(path)

    def reference(self, name: str, call: int, path: str) -> torch.Tensor | None:
        """The float64 output of layer ``name`` call ``call`` at ``path`` (CPU), if recorded."""
        if self.reader is None:
            return None
        entry = self.reader.by_key.get((name, call))
        if entry is None:
            return None
        leaves = self._calls.get((name, call))
        if leaves is None:
            leaves = {leaf.path: leaf for leaf in entry.leaves}
            self._calls = {(name, call): leaves}  # keep one call's index at a time
        leaf = leaves.get(path)
        if leaf is None or leaf.kind != "tensor" or leaf.dtype not in CALIBRATED_DTYPES:
            return None
        return self.reader.load(leaf, f"shadow layer {name!r} call {call} output {path!r}")

    def floor(self, name: str, call: int, path: str, value: torch.Tensor) -> NoiseFloor | None:
        """``value``'s noise floor against the shadow's float64 output at the same place."""
        ref = self.reference(name, call, path)
        if ref is None or tuple(ref.shape) != tuple(value.shape):
            return None
        f = diff_stats(value, ref)
        return f if f.finite else None

    def measure(self, name: str, call: int, leaves: list[Leaf], table: FloorTable) -> None:
        """Record-time: floors of every real floating leaf of one layer call into ``table``."""
        for leaf in leaves:
            if leaf.kind != "tensor" or leaf.tensor is None or leaf.type_name != "Tensor":
                continue
            if dtype_name(leaf.tensor) not in CALIBRATED_DTYPES:
                continue
            table.add(name, call, leaf.path, self.floor(name, call, leaf.path, leaf.tensor))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        self._tmp.cleanup()


# --------------------------------------------------------------------------- judging


@dataclass
class Calibrator:
    """Compare-time state: the golden's floors, the live shadow, and what fell back to strict."""

    golden: FloorTable
    shadow: ShadowRun
    fallbacks: list[str] = field(default_factory=list)
    judged: int = 0

    def judge(self, golden_name: str, name: str, call: int, path: str, golden: torch.Tensor,
              live: torch.Tensor, gdt: str, ldt: str) -> LeafResult | None:
        """The calibrated verdict for one output, or None when a floor is missing (the caller
        then applies its strict tolerance and this output is listed in ``fallbacks``)."""
        where = f"{name or '<root>'}[{call}]{'/' + path if path else ''}"
        if gdt not in CALIBRATED_DTYPES or ldt not in CALIBRATED_DTYPES:
            return None
        gf = self.golden.get(golden_name, call, path)
        if gf is None:
            self.fallbacks.append(f"{where}: the golden has no finite noise floor")
            return None
        lf = self.shadow.floor(name, call, path, live)
        if lf is None:
            self.fallbacks.append(f"{where}: no finite live noise floor (the float64 shadow did not produce it)")
            return None
        self.judged += 1
        low = gdt if _rank(gdt) < _rank(ldt) else ldt
        shape = tuple(int(s) for s in live.shape)
        numel = live.numel()
        m = multiplier(low, numel)
        dev = _stats_device(live)
        g = to_device(golden, dev)
        lv = to_device(live.detach(), dev)
        if _rank(ldt) < _rank(gdt):
            # a result stored in a lower precision cannot be closer to the truth than rounding
            # it: a cast model's exactly computed outputs (an embedding lookup of rounded
            # weights) are off by that much with zero arithmetic noise
            rf = diff_stats(g.to(lv.dtype), g)
            lf = NoiseFloor(lf.max_abs + rf.max_abs, lf.rms + rf.rms)
        allow_max = m * (gf.max_abs + lf.max_abs) + ABS_TERM
        allow_rms = m * (gf.rms + lf.rms) + ABS_TERM
        if g.dtype != lv.dtype:
            g, lv = g.to(torch.float64), lv.to(torch.float64)
        st = compare_tensors(g, lv, 0.0, allow_max)
        err = diff_stats(lv, g)
        multiple = max(err.max_abs / allow_max, err.rms / allow_rms)
        res = leaf_from_stats(path, gdt, ldt, shape, st, 0.0, allow_max, rule_text(m))
        res.error_multiple = multiple
        if multiple > 1 and res.status == "match":
            res.status = "diverged"
        if res.status != "match":
            which = "RMS" if err.rms / allow_rms >= err.max_abs / allow_max else "max abs"
            res.detail = (
                f"error is {multiple:.3g}x the calibrated allowance ({which}): max abs {err.max_abs:.2e} vs "
                f"{allow_max:.2e}, RMS {err.rms:.2e} vs {allow_rms:.2e}; noise floors golden "
                f"{gf.max_abs:.2e}/{gf.rms:.2e}, live {lf.max_abs:.2e}/{lf.rms:.2e} (max abs/RMS)"
                + (f"; {res.detail}" if res.detail else "")
            )
        if gdt != ldt:
            res.detail = (res.detail + "; " if res.detail else "") + f"dtype {gdt} -> {ldt} allowed"
        return res

    def notes(self) -> list[str]:
        """Report notes: what the calibrated rule was, and which outputs fell back to strict."""
        out = [f"calibrated tolerances: error <= m x (golden floor + live floor) + {ABS_TERM:g}, m = "
               f"{MULTIPLIER:g} ({MULTIPLIER_REDUCED:g} for half types and outputs under {SMALL_NUMEL} elements); "
               f"float64 reference on {self.shadow.device}; {self.judged} outputs judged"]
        if self.fallbacks:
            shown = "; ".join(self.fallbacks[:5]) + ("; ..." if len(self.fallbacks) > 5 else "")
            out.append(f"{len(self.fallbacks)} outputs had no noise floor and used strict tolerances ({shown})")
        return out

    def close(self) -> None:
        self.shadow.close()


_RANK = {"float64": 4, "float32": 3, "float16": 2, "bfloat16": 1}


def _rank(dt: str) -> int:
    return _RANK.get(dt, 0)


# --------------------------------------------------------------------------- TF32 emulation


def tf32_round(t: Any) -> Any:
    """Round a float32 tensor to TF32 precision (10 explicit mantissa bits, round to nearest
    even), as TF32 tensor cores do with matmul inputs. Anything else is returned unchanged, so a
    float64 shadow forward is untouched."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        return t
    bits = t.detach().contiguous().view(torch.int32)
    lsb = torch.bitwise_and(torch.bitwise_right_shift(bits, 13), 1)
    rounded = torch.bitwise_and(bits + 0x0FFF + lsb, -0x2000).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded, t).view(t.shape)


def _operand_table() -> dict[Any, tuple[int, ...]]:
    F = torch.nn.functional
    two = (0, 1)
    table: dict[Any, tuple[int, ...]] = {
        F.linear: two, F.bilinear: two,
        F.conv1d: two, F.conv2d: two, F.conv3d: two,
        F.conv_transpose1d: two, F.conv_transpose2d: two, F.conv_transpose3d: two,
        torch.matmul: two, torch.mm: two, torch.bmm: two,
        torch.Tensor.matmul: two, torch.Tensor.mm: two, torch.Tensor.bmm: two,
        torch.Tensor.__matmul__: two, torch.Tensor.__rmatmul__: two,
        torch.addmm: (1, 2), torch.baddbmm: (1, 2), torch.addbmm: (1, 2),
        torch.Tensor.addmm: (1, 2), torch.Tensor.baddbmm: (1, 2),
        F.scaled_dot_product_attention: (0, 1, 2),
    }
    return table


class emulate_tf32(TorchFunctionMode):
    """Within this block, float32 matmul/convolution/attention operands are rounded to TF32
    first: a CPU simulation of a GPU run with ``allow_tf32`` on. float64 math is unaffected.

    >>> with activation_guard.calibrate.emulate_tf32():
    ...     report = activation_guard.compare(model, x, path=golden, tolerance="calibrated")
    """

    _ops: dict[Any, tuple[int, ...]] | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if emulate_tf32._ops is None:
            emulate_tf32._ops = _operand_table()
        idx = emulate_tf32._ops.get(func)
        if idx is not None:
            args = tuple(tf32_round(a) if i in idx else a for i, a in enumerate(args))
            names = ("weight", "other", "mat1", "mat2", "batch1", "batch2", "query", "key", "value")
            for k in (("input", *names) if 0 in idx else names):
                if k in kwargs:
                    kwargs[k] = tf32_round(kwargs[k])
        elif func is torch.einsum and args and isinstance(args[0], str):
            if len(args) == 2 and isinstance(args[1], (list, tuple)):
                args = (args[0], [tf32_round(a) for a in args[1]])
            else:
                args = (args[0], *(tf32_round(a) for a in args[1:]))
        return func(*args, **kwargs)

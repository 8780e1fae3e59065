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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .capture import hooked, run_forward
from .devices import reference_device, stats_device, to_device
from .dtypes import dtype_name
from .errors import ActivationGuardError, GoldenFormatError, UncalibratedGoldenError
from .judges import PRECISION, LeafContext, StrictJudge
from .kernel import CHUNK, compare_tensors
from .leaves import Leaf, flatten
from .numerics import full_fp32_precision
from .results import LeafResult, leaf_from_stats
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


def multiplier(dtype_name: str, numel: int) -> float:
    """The margin ``m`` for an output of this (lower-precision side) dtype and size."""
    if dtype_name in REDUCED_DTYPES:
        return MULTIPLIER_REDUCED
    if numel < SMALL_NUMEL:
        return MULTIPLIER_SMALL
    return MULTIPLIER


def rule_text(m: float) -> str:
    return f"calibrated: {m:g} x (golden floor + live floor) + {ABS_TERM:g}"


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
    dev = stats_device(x)
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
        kept = floor if floor is not None and floor.finite else None
        self.floors.setdefault(name, {}).setdefault(call, {})[path] = kept

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
            raise UncalibratedGoldenError(
                path, 'has no calibrated noise floors, which tolerance="calibrated" needs',
                fix="re-record the golden with calibration (record option calibrate=True)",
            )
        bad = GoldenFormatError(path, f"has a malformed {META_KEY!r} record in its meta",
                                fix="re-record it with calibrate=True")
        if not isinstance(rec, Mapping) or not isinstance(rec.get("floors"), Mapping):
            raise bad
        ver = rec.get("version")
        if not isinstance(ver, int) or isinstance(ver, bool):
            raise bad
        if ver > FORMAT_VERSION:
            raise GoldenFormatError(path, f"has calibration format version {ver}, newer than this activation_guard "
                                          f"understands ({FORMAT_VERSION})",
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
                            or not all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0)
                                       for x in v)):
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
    devices = ([device.index if device.index is not None else torch.cuda.current_device()]
               if device.type == "cuda" else [])
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
                 include: Sequence[str] | None, exclude: Sequence[str] | None, live_device: torch.device,
                 *, grad: bool = False):
        self.live_device = live_device
        self.grad = grad
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
            for m in shadow.modules():  # `m.compile()` in place: its compiled call runs the original
                if getattr(m, "_compiled_call_impl", None) is not None:
                    m._compiled_call_impl = None
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
                    run_forward(shadow, a, kw, state, grad=self.grad)
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


class CalibratedJudge:
    """The calibrated rule behind the :class:`~activation_guard.judges.Judge` protocol.

    What explicit numbers mean here (docs/architecture.md): a layer matched by a ``tolerances``
    pattern is judged strictly with that pattern's numbers (the user named that layer, so the
    user's numbers win), and the report's tolerance source says so; integer and bool outputs
    compare exactly; float outputs without a noise floor on either side fall back to the strict
    rule, whose numbers are the ``rtol``/``atol`` options when given. The report's notes count
    each case, so no option is ever silently ignored.
    """

    def __init__(self, golden: FloorTable, shadow: ShadowRun, strict: StrictJudge):
        self.golden = golden
        self.shadow = shadow
        self.strict = strict
        self.fallbacks: list[str] = []
        self.explicit: dict[str, int] = {}  # tolerances pattern -> outputs it judged strictly
        self.judged = 0

    def judge(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        gdt, ldt = ctx.golden_dtype, ctx.live_dtype
        if gdt not in CALIBRATED_DTYPES or ldt not in CALIBRATED_DTYPES:
            return self.strict.judge(ctx, golden, live)  # integers, bools, complex: exact/strict
        tol = self.strict.tolerance(ctx)
        if tol.rule is not None:
            self.explicit[tol.rule.pattern] = self.explicit.get(tol.rule.pattern, 0) + 1
            res = self.strict.judge_with(ctx, golden, live, tol)
            res.tolerance_source = f"{tol.source}; strict: a tolerances pattern overrides calibration"
            return res
        gf = self.golden.get(ctx.golden_name, ctx.call, ctx.path)
        lf = None if gf is None else self.shadow.floor(ctx.name, ctx.call, ctx.path, live)
        if gf is None or lf is None:
            side = "the golden has" if gf is None else "the live float64 shadow gave"
            self.fallbacks.append(f"{_where(ctx)}: {side} no finite noise floor")
            res = self.strict.judge_with(ctx, golden, live, tol)
            res.tolerance_source = f"{tol.source}; strict: no noise floor"
            return res
        self.judged += 1
        return _calibrated_verdict(ctx, golden, live, gf, lf)

    def identical(self, ctx: LeafContext, live: torch.Tensor) -> LeafResult:
        res = self.strict.identical(ctx, live)
        if ctx.golden_dtype not in CALIBRATED_DTYPES:
            return res
        rule = self.strict.tolerance(ctx).rule
        if rule is not None:
            self.explicit[rule.pattern] = self.explicit.get(rule.pattern, 0) + 1
            res.tolerance_source = f"{res.tolerance_source}; strict: a tolerances pattern overrides calibration"
            return res
        if self.golden.get(ctx.golden_name, ctx.call, ctx.path) is None:
            self.fallbacks.append(f"{_where(ctx)}: the golden has no finite noise floor")
            res.tolerance_source = f"{res.tolerance_source}; strict: no noise floor"
            return res
        self.judged += 1  # bit-identical: no error to weigh against the floors
        res.error_multiple = 0.0
        res.rtol, res.atol = 0.0, 0.0
        res.tolerance_source = "calibrated: bit-identical to the golden"
        return res

    def notes(self) -> list[str]:
        """Report notes: the calibrated rule, and every output some other rule judged."""
        out = [f"calibrated tolerances: error <= m x (golden floor + live floor) + {ABS_TERM:g}, m = "
               f"{MULTIPLIER:g} ({MULTIPLIER_REDUCED:g} for half types and outputs under {SMALL_NUMEL} elements); "
               f"float64 reference on {self.shadow.device}; {self.judged} outputs judged"]
        for pat, n in self.explicit.items():
            out.append(f"tolerances[{pat!r}] judged {n} output(s) strictly with its own numbers (explicit "
                       f"per-layer tolerances override calibration)")
        if self.fallbacks:
            shown = "; ".join(self.fallbacks[:5]) + ("; ..." if len(self.fallbacks) > 5 else "")
            out.append(f"{len(self.fallbacks)} outputs had no noise floor and used strict tolerances ({shown})")
        spec = self.strict.resolver.spec
        given = [k for k in ("rtol", "atol") if getattr(spec, k) is not None]
        if given:
            what = "/".join(given)
            out.append(f"{what} ({spec.source(given[0])}) apply only to outputs judged strictly "
                       f"({len(self.fallbacks)} without a noise floor); calibrated outputs are judged by their floors")
        return out

    def close(self) -> None:
        self.shadow.close()


def _where(ctx: LeafContext) -> str:
    return f"{ctx.name or '<root>'}[{ctx.call}]{'/' + ctx.path if ctx.path else ''}"


def _calibrated_verdict(ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor,
                        gf: NoiseFloor, lf: NoiseFloor) -> LeafResult:
    gdt, ldt = ctx.golden_dtype, ctx.live_dtype
    low = gdt if PRECISION.get(gdt, 0) < PRECISION.get(ldt, 0) else ldt
    shape = tuple(int(s) for s in live.shape)
    m = multiplier(low, live.numel())
    dev = stats_device(live)
    g = to_device(golden, dev)
    lv = to_device(live.detach(), dev)
    if PRECISION.get(ldt, 0) < PRECISION.get(gdt, 0):
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
    res = leaf_from_stats(ctx.path, gdt, ldt, shape, st, 0.0, allow_max, rule_text(m))
    res.error_multiple = multiple
    if multiple > 1 and res.status == "match":
        res.status = "diverged"
    if res.status != "match":
        which = "RMS" if err.rms / allow_rms >= err.max_abs / allow_max else "max abs"
        res.detail = (
            f"error is {multiple:.3g}x the calibrated allowance ({which}): max abs {err.max_abs:.2e} vs "
            f"{allow_max:.2e}, RMS {err.rms:.2e} vs {allow_rms:.2e}; noise floors golden "
            f"{gf.max_abs:.2e}/{gf.rms:.2e}, live {lf.max_abs:.2e}/{lf.rms:.2e} (max abs/RMS)"
        )
    if gdt != ldt:
        res.detail = (res.detail + "; " if res.detail else "") + f"dtype {gdt} -> {ldt} allowed"
    return res

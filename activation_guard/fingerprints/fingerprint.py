"""Fixed-size fingerprints of floating tensors, for goldens too large to keep in full.

A fingerprint keeps, per tensor: exact float64 statistics of the finite values, the counts and
position hashes of its NaN/+Inf/-Inf values, K elements at seeded stratified positions (raw bits,
bit-exact in the tensor's own dtype) and a seeded linear sketch (CountSketch, R rows of B
buckets). It is a few KiB whatever the tensor's size, is computed where the tensor lives
(:mod:`activation_guard.fingerprints.sketch`), and supports a comparison that never false-alarms on a
within-tolerance run except with a stated probability (:mod:`activation_guard.fingerprints.soundness`,
derivation in docs/fingerprint.md).

Complex tensors are fingerprinted as pairs of reals (``torch.view_as_real``): statistics, counts
and the sketch run over the real and imaginary components; samples are whole complex elements.
Integer and bool tensors are never fingerprinted: the store keeps them exactly.

Serialization is plain data (numpy arrays plus a JSON-able dict, no pickle), validated field by
field on the way back in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._core import dtypes
from . import plan as fingerprint_plan
from .params import (
    DEFAULT_SEED,
    MAX_BUCKETS,
    MAX_ROWS,
    MAX_SAMPLES,
    MIN_BUCKETS,
    FingerprintError,
    FingerprintFormatError,
    FingerprintParams,
    binomial_tail,
    is_int,
    row_false_alarm,
    solve_multiplier,
)
from .sketch import CHUNK, KernelResult, real_view, run_kernel, sample_positions

__all__ = [
    "ARRAY_NAMES", "COUNT_FIELDS", "DEFAULT_SEED", "FORMAT", "FORMAT_VERSION", "MAX_BUCKETS", "MAX_ROWS",
    "MAX_SAMPLES", "MIN_BUCKETS", "STATS_FIELDS", "Fingerprint", "FingerprintError", "FingerprintFormatError",
    "FingerprintParams", "binomial_tail", "compute_fingerprint", "fingerprintable_dtype", "row_false_alarm",
    "should_fingerprint", "solve_multiplier",
]

FORMAT = "activation_guard.fingerprint"
FORMAT_VERSION = 1
STATS_FIELDS = ("sum", "abs_sum", "sq_sum", "min", "max")
COUNT_FIELDS = ("count", "nan", "posinf", "neginf", "depth")
ARRAY_NAMES = ("sketch", "samples", "stats", "counts", "nonfinite_hash")
_UNSIGNED: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


# --------------------------------------------------------------------------- the fingerprint


def _real_dtype(info: dtypes.DtypeInfo) -> torch.dtype:
    return {"complex128": torch.float64, "complex64": torch.float32, "complex32": torch.float16}.get(
        info.name, info.torch_dtype)


def fingerprintable_dtype(dtype: torch.dtype) -> bool:
    info = dtypes.BY_TORCH.get(dtype)
    return info is not None and info.kind in ("float", "complex")


@dataclass(frozen=True, eq=False)
class Fingerprint:
    """The fingerprint of one tensor. Floats are float64 sums over the finite real values
    (complex: over both components); ``samples`` holds raw bits, (k,) or (k, 2) for complex."""

    dtype: str
    shape: tuple[int, ...]
    params: FingerprintParams
    count: int  # finite real values
    nan: int
    posinf: int
    neginf: int
    nonfinite_hash: tuple[int, ...]  # per class (nan, +inf, -inf): two sums of 31-bit position hashes
    sum: float
    abs_sum: float
    sq_sum: float
    min: float  # over finite values; +inf when there are none
    max: float  # -inf when there are none
    depth: int  # longest chain of float64 additions behind any sum: bounds their rounding error
    samples: np.ndarray
    sketch: np.ndarray

    def __post_init__(self) -> None:
        for name in ("samples", "sketch"):
            arr = np.array(getattr(self, name), copy=True)
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_complex(self) -> bool:
        return dtypes.BY_NAME[self.dtype].kind == "complex"

    @property
    def real_numel(self) -> int:
        return self.numel * (2 if self.is_complex else 1)

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def positions(self) -> tuple[int, ...]:
        """Flat indices of the sampled elements (recomputed from the seed and the size)."""
        return sample_positions(self.params.seed, self.numel, self.params.samples)

    def sample_values(self) -> torch.Tensor:
        """The sampled elements as a 1-D CPU tensor of the fingerprint's dtype (bit-exact)."""
        info = dtypes.BY_NAME[self.dtype]
        real = _real_dtype(info)
        raw = torch.from_numpy(np.ascontiguousarray(self.samples).copy())
        vals = raw.view(real)
        if info.kind == "complex":
            if real == torch.float16:  # complex32: no view_as_complex kernel; rebuild through float32
                return torch.complex(vals[:, 0].float(), vals[:, 1].float()).to(info.torch_dtype)
            return torch.view_as_complex(vals.contiguous())
        return vals.reshape(-1)

    @property
    def nbytes(self) -> int:
        return int(self.samples.nbytes + self.sketch.nbytes) + 8 * (5 + 5 + 6)

    def identical(self, other: Fingerprint) -> bool:
        """Bit-for-bit equality (floats by their bits, so equal NaNs and signed zeros count)."""
        a, am = self.to_arrays()
        b, bm = other.to_arrays()
        return am == bm and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                and a[k].tobytes() == b[k].tobytes() for k in ARRAY_NAMES)

    def summary(self) -> dict[str, Any]:
        """The statistics as JSON-able numbers (non-finite floats as strings), for reports."""
        def num(x: float) -> Any:
            return x if math.isfinite(x) else str(x)
        n = self.count
        return {"dtype": self.dtype, "shape": list(self.shape), "finite": n, "nan": self.nan, "posinf": self.posinf,
                "neginf": self.neginf, "sum": num(self.sum), "min": num(self.min), "max": num(self.max),
                "mean": num(self.sum / n) if n else None, "rms": num(math.sqrt(self.sq_sum / n)) if n else None}

    # ----------------------------------------------------------------------- serialization

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Plain arrays (for HDF5 datasets) and a JSON-able dict; :meth:`from_arrays` inverts it."""
        arrays = {
            "sketch": np.ascontiguousarray(self.sketch, dtype=np.float64),
            "samples": np.ascontiguousarray(self.samples),
            "stats": np.array([getattr(self, f) for f in STATS_FIELDS], dtype=np.float64),
            "counts": np.array([getattr(self, f) for f in COUNT_FIELDS], dtype=np.int64),
            "nonfinite_hash": np.array(self.nonfinite_hash, dtype=np.int64),
        }
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": self.dtype, "shape": list(self.shape),
                "params": self.params.to_dict()}
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> Fingerprint:
        """Rebuild a fingerprint, validating every field; :class:`FingerprintFormatError` names
        the first problem found."""
        return _from_arrays(arrays, meta)


def _bad(what: str) -> FingerprintFormatError:
    return FingerprintFormatError(f"malformed fingerprint: {what}")


def _from_arrays(arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> Fingerprint:
    if not isinstance(meta, Mapping):
        raise _bad(f"meta must be an object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise _bad(f"meta 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    ver_raw: Any = meta.get("version")
    if not is_int(ver_raw) or int(ver_raw) < 1:
        raise _bad(f"meta 'version' must be a positive integer, got {ver_raw!r}")
    ver = int(ver_raw)
    if ver > FORMAT_VERSION:
        raise FingerprintFormatError(f"fingerprint format version {ver} is newer than this activation_guard "
                                     f"understands ({FORMAT_VERSION}); upgrade activation_guard")
    name = meta.get("dtype")
    info = dtypes.BY_NAME.get(name) if isinstance(name, str) else None
    if info is None or info.kind not in ("float", "complex"):
        raise _bad(f"meta 'dtype' {name!r} is not a floating or complex dtype")
    shape_raw = meta.get("shape")
    if (not isinstance(shape_raw, list) or len(shape_raw) > 64
            or not all(is_int(s) and 0 <= s < 1 << 62 for s in shape_raw)):
        raise _bad(f"meta 'shape' must be a list of at most 64 non-negative integers, got {shape_raw!r:.200}")
    shape = tuple(int(s) for s in shape_raw)
    numel = math.prod(shape)
    if numel >= 1 << 62:
        raise _bad(f"shape {shape} has too many elements")
    params = FingerprintParams.from_dict(meta.get("params"))
    if not isinstance(arrays, Mapping):
        raise _bad(f"arrays must be a mapping of name -> array, got {type(arrays).__name__}")
    missing = [k for k in ARRAY_NAMES if k not in arrays]
    if missing:
        raise _bad(f"missing array(s) {', '.join(missing)}")
    per = 2 if info.kind == "complex" else 1
    real_n = numel * per
    k = len(sample_positions(params.seed, numel, params.samples)) if numel else 0
    udt = _UNSIGNED[_real_dtype(info).itemsize]
    expect: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
        "sketch": (np.dtype("<f8"), (params.rows, params.buckets)),
        "samples": (udt, (k, 2) if per == 2 else (k,)),
        "stats": (np.dtype("<f8"), (len(STATS_FIELDS),)),
        "counts": (np.dtype("<i8"), (len(COUNT_FIELDS),)),
        "nonfinite_hash": (np.dtype("<i8"), (6,)),
    }
    arr: dict[str, np.ndarray] = {}
    for key, (dt, shp) in expect.items():
        a = arrays[key]
        if not isinstance(a, np.ndarray):
            raise _bad(f"array {key!r} is a {type(a).__name__}, not a numpy array")
        if a.dtype.kind != dt.kind or a.dtype.itemsize != dt.itemsize:
            raise _bad(f"array {key!r} has dtype {a.dtype}, expected {dt}")
        if a.shape != shp:
            raise _bad(f"array {key!r} has shape {a.shape}, expected {shp}")
        arr[key] = a.astype(dt, copy=False)
    count, nan, posinf, neginf, depth = (int(v) for v in arr["counts"])
    if min(count, nan, posinf, neginf) < 0 or count + nan + posinf + neginf != real_n:
        raise _bad(f"counts finite {count} + nan {nan} + inf {posinf} + -inf {neginf} must be non-negative and "
                   f"add up to the {real_n} real values of shape {shape}")
    if not 0 <= depth <= real_n + params.buckets + 64 or (real_n and depth < 2):
        raise _bad(f"rounding depth {depth} is impossible for {real_n} values")
    hashes = tuple(int(v) for v in arr["nonfinite_hash"])
    for c, cnt in enumerate((nan, posinf, neginf)):
        for h in hashes[2 * c : 2 * c + 2]:
            if (cnt == 0 and h != 0) or (cnt < 1 << 32 and not 0 <= h <= cnt * ((1 << 31) - 1)):
                raise _bad(f"non-finite position hash {h} is impossible for {cnt} positions")
    s, a_sum, q, lo, hi = (float(v) for v in arr["stats"])
    if any(math.isnan(v) for v in (s, a_sum, q, lo, hi)):
        raise _bad("a statistic is NaN")
    if a_sum < 0 or q < 0 or (math.isfinite(a_sum) and abs(s) > a_sum * (1 + 1e-9)):
        raise _bad(f"statistics are inconsistent: sum {s}, sum of |x| {a_sum}, sum of squares {q}")
    if count == 0 and (lo != math.inf or hi != -math.inf or a_sum != 0):
        raise _bad("min/max/sums of a fingerprint without finite values must be +inf/-inf/0")
    if count and not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
        raise _bad(f"min {lo} / max {hi} must be finite with min <= max")
    if count:
        big = max(abs(lo), abs(hi))  # every finite value is within [min, max]: the sums are bounded by it
        if a_sum > count * big * (1 + 1e-9) + 1e-300 or q > count * big * big * (1 + 1e-9) + 1e-300:
            raise _bad(f"statistics are inconsistent: sum of |x| {a_sum} or sum of squares {q} exceeds what "
                       f"{count} values within [{lo}, {hi}] can add up to")
    sk = arr["sketch"]
    if np.isnan(sk).any() or (math.isfinite(a_sum) and not np.isfinite(sk).all()):
        raise _bad("sketch holds NaN or infinite values")
    if math.isfinite(a_sum) and np.abs(sk).sum(axis=1).max(initial=0.0) > a_sum * (1 + 1e-9) + 1e-300:
        raise _bad("sketch rows exceed the sum of |x| (a row holds each value once)")
    return Fingerprint(dtype=info.name, shape=shape, params=params, count=count, nan=nan, posinf=posinf,
                       neginf=neginf, nonfinite_hash=hashes, sum=s, abs_sum=a_sum, sq_sum=q, min=lo, max=hi,
                       depth=depth, samples=arr["samples"], sketch=sk)


# --------------------------------------------------------------------------- computing


def should_fingerprint(t: torch.Tensor, params: FingerprintParams | None = None) -> bool:
    """Whether a leaf is worth fingerprinting: floating or complex (integers and bools are kept
    exactly), and its raw bytes larger than the fingerprint would be."""
    if not isinstance(t, torch.Tensor) or not fingerprintable_dtype(t.dtype):
        return False
    p = params or FingerprintParams()
    return t.numel() * t.dtype.itemsize > p.nbytes(t.dtype.itemsize, t.numel())


def compute_fingerprint(t: torch.Tensor, params: FingerprintParams | None = None, *, chunk: int = CHUNK) -> Fingerprint:
    """The fingerprint of ``t``, computed on ``t``'s device in chunks of ``chunk`` elements.

    Memory beyond ``t`` stays O(chunk x rows); only the fingerprint crosses to the host, in one
    transfer (two when the tensor holds NaN/Inf: a second pass then masks them). A contiguous CPU
    leaf goes through a prepared compiled call where there is one (:mod:`.plan`).
    """
    p = params or FingerprintParams()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"compute_fingerprint needs a torch.Tensor, got {type(t).__name__}")
    if not fingerprintable_dtype(t.dtype):
        raise FingerprintError(f"cannot fingerprint a {t.dtype} tensor: only floating and complex tensors are "
                               "fingerprinted (integers and bools are stored exactly)")
    _check_chunk(p, chunk)
    if _transformed(t):
        raise FingerprintError("cannot fingerprint a tensor inside a torch.func transform (functionalize, vmap, "
                               "grad): its memory is not its values; fingerprint outside the transform")
    if fingerprint_plan.takes(t):
        plan = fingerprint_plan.plan_for(t.dtype, t.numel(), p, chunk)
        if plan is not None:
            res = plan.run(t.data_ptr())
            return _from_kernel(t.dtype, tuple(t.shape), p, res) if res is not None else _general(t, p, chunk, True)
    return _general(t, p, chunk, False)


def fingerprint_buffer(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                       params: FingerprintParams, *, chunk: int = CHUNK) -> Fingerprint:
    """The fingerprint of the ``dtype`` tensor of ``shape`` whose values lie in order at the start
    of ``buf`` (a contiguous CPU uint8 tensor: the fingerprint worker's copy). Through a plan,
    no torch op runs: on the worker thread that keeps the GIL's hand-offs with the forward few."""
    numel = math.prod(shape)
    if not (type(buf) is torch.Tensor and buf.dtype == torch.uint8 and buf.device.type == "cpu"
            and buf.is_contiguous() and buf.numel() >= numel * dtype.itemsize):
        raise ValueError(f"fingerprint_buffer: {numel} values of {dtype} do not fit the buffer given")
    _check_chunk(params, chunk)
    plan = fingerprint_plan.plan_for(dtype, numel, params, chunk) if buf.data_ptr() % dtype.itemsize == 0 else None
    res = plan.run(buf.data_ptr()) if plan is not None else None
    if res is not None:
        return _from_kernel(dtype, shape, params, res)
    view = buf[: numel * dtype.itemsize].view(dtype).view(shape)
    if plan is not None:  # NaN or Inf: straight to the masked pass
        return _general(view, params, chunk, True)
    return compute_fingerprint(view, params, chunk=chunk)


def _transformed(t: torch.Tensor) -> bool:
    """A functionalized or functorch-wrapped tensor: ops on it are right, but reading its memory
    (numpy, a pointer) reads the wrapper's, not its values (it would fingerprint garbage)."""
    functional = getattr(torch, "_is_functional_tensor", None)
    wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return bool((functional is not None and functional(t)) or (wrapped is not None and wrapped(t)))


def _check_chunk(p: FingerprintParams, chunk: int) -> None:
    if not isinstance(chunk, int) or chunk < max(p.buckets, 1024) or chunk & (chunk - 1):
        raise FingerprintError(f"chunk must be a power of two >= max(buckets, 1024), got {chunk!r}")


def _general(t: torch.Tensor, p: FingerprintParams, chunk: int, nonfinite: bool) -> Fingerprint:
    """The chunked kernel (any device, layout and float dtype); ``nonfinite``: known to hold NaN or
    Inf, so straight to the masked pass."""
    per = 2 if t.dtype.is_complex else 1
    real = real_view(t.detach())
    args = (p.seed, p.rows, p.buckets, p.samples, chunk)
    res = None if nonfinite else run_kernel(real, *args, masked=False, per=per)
    if res is None or not res.all_finite:
        res = run_kernel(real, *args, masked=True, per=per)
    return _from_kernel(t.dtype, tuple(int(s) for s in t.shape), p, res)


def _from_kernel(dtype: torch.dtype, shape: tuple[int, ...], p: FingerprintParams, res: KernelResult) -> Fingerprint:
    info = dtypes.info_for(dtype)
    per = 2 if info.kind == "complex" else 1
    itemsize = dtype.itemsize // per
    udt = _UNSIGNED[itemsize]
    width = 8 * itemsize
    raw = res.samples.astype(np.int64)
    bits = (raw & ((1 << width) - 1) if width < 64 else raw).astype(np.uint64).astype(udt)
    if per == 2:
        bits = bits.reshape(-1, 2)
    nan, posinf, neginf = res.counts
    return Fingerprint(
        dtype=info.name, shape=shape, params=p,
        count=math.prod(shape) * per - nan - posinf - neginf, nan=nan, posinf=posinf, neginf=neginf,
        nonfinite_hash=res.hashes, sum=res.sum, abs_sum=res.abs_sum, sq_sum=res.sq_sum, min=res.min, max=res.max,
        depth=res.depth, samples=bits, sketch=res.sketch,
    )

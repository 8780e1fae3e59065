"""Fixed-size fingerprints of floating tensors, for goldens too large to keep in full.

A fingerprint keeps, per tensor: exact float64 statistics of the finite values, the counts and
position hashes of its NaN/+Inf/-Inf values, K elements at seeded stratified positions (raw bits,
bit-exact in the tensor's own dtype) and a seeded linear sketch (CountSketch, R rows of B
buckets). It is a few KiB whatever the tensor's size, is computed where the tensor lives
(:mod:`activation_guard.sketch`), and supports a comparison that never false-alarms on a
within-tolerance run except with a stated probability (:mod:`activation_guard.fingerprint_judge`,
derivation in docs/fingerprint.md).

Complex tensors are fingerprinted as pairs of reals (``torch.view_as_real``): statistics, counts
and the sketch run over the real and imaginary components; samples are whole complex elements.
Integer and bool tensors are never fingerprinted: the store keeps them exactly.

Serialization is plain data (numpy arrays plus a JSON-able dict, no pickle), validated field by
field on the way back in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from . import dtypes
from .errors import ActivationGuardError
from .sketch import CHUNK, real_view, run_kernel, sample_positions

FORMAT = "activation_guard.fingerprint"
FORMAT_VERSION = 1
DEFAULT_SEED = 0x5EED_F16E_1234_ABCD
MAX_ROWS = 31
MIN_BUCKETS, MAX_BUCKETS = 16, 4096
MAX_SAMPLES = 1 << 16
STATS_FIELDS = ("sum", "abs_sum", "sq_sum", "min", "max")
COUNT_FIELDS = ("count", "nan", "posinf", "neginf", "depth")
ARRAY_NAMES = ("sketch", "samples", "stats", "counts", "nonfinite_hash")
_UNSIGNED: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class FingerprintError(ActivationGuardError, ValueError):
    """Bad fingerprint parameters, or fingerprints that cannot be compared."""


class FingerprintFormatError(FingerprintError):
    """A fingerprint read back from storage is malformed (the message names the field)."""


# --------------------------------------------------------------------------- false-alarm math


def row_false_alarm(multiplier: float, buckets: int) -> Fraction:
    """Cantelli's bound on one row's false alarm: P(Y > c^2 T^2) <= 2 / (2 + B (c^2 - 1)^2),
    exactly, for the float ``multiplier`` c (see docs/fingerprint.md)."""
    x = Fraction(multiplier) ** 2 - 1
    return Fraction(2) / (2 + buckets * x * x)


def binomial_tail(rows: int, p: Fraction) -> Fraction:
    """P(at least a majority of ``rows`` independent rows fail), each with probability ``p``:
    the false-alarm probability of the median test, in exact rational arithmetic."""
    need = rows // 2 + 1
    return sum((math.comb(rows, k) * p**k * (1 - p) ** (rows - k) for k in range(need, rows + 1)), Fraction(0))


@functools.lru_cache(maxsize=64)
def solve_multiplier(rows: int, buckets: int, false_alarm: float) -> float:
    """The smallest multiplier c (to about 1e-12) whose exact median-test false-alarm bound is
    <= ``false_alarm``; the returned float itself satisfies the bound exactly."""
    alpha = Fraction(false_alarm)

    def ok(c: float) -> bool:
        return binomial_tail(rows, row_false_alarm(c, buckets)) <= alpha

    lo, hi = 1.0, 2.0
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    assert ok(hi)
    return hi


# --------------------------------------------------------------------------- parameters


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class FingerprintParams:
    """How fingerprints are taken; golden and live must use the same parameters.

    Defaults: 5 rows of 64 buckets (2.5 KiB of float64) and 64 samples, a false-alarm bound of
    1e-6 per compared tensor, which makes the sketch threshold 1.89x the tolerance bound.
    (7 x 64 gives 1.59x for about 25% more time; see docs/fingerprint.md.)
    """

    seed: int = DEFAULT_SEED
    samples: int = 64
    rows: int = 5
    buckets: int = 64
    false_alarm: float = 1e-6

    def __post_init__(self) -> None:
        if not _is_int(self.seed) or not 0 <= self.seed < 1 << 64:
            raise FingerprintError(f"fingerprint seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.samples) or not 0 <= self.samples <= MAX_SAMPLES:
            raise FingerprintError(f"fingerprint samples must be an integer in [0, {MAX_SAMPLES}], "
                                   f"got {self.samples!r}")
        if not _is_int(self.rows) or not 1 <= self.rows <= MAX_ROWS or self.rows % 2 == 0:
            raise FingerprintError(f"fingerprint rows must be an odd integer in [1, {MAX_ROWS}] (the median "
                                   f"of the rows is the estimate), got {self.rows!r}")
        b = self.buckets
        if not _is_int(b) or not MIN_BUCKETS <= b <= MAX_BUCKETS or b & (b - 1):
            raise FingerprintError(f"fingerprint buckets must be a power of two in [{MIN_BUCKETS}, {MAX_BUCKETS}], "
                                   f"got {b!r}")
        fa = self.false_alarm
        if isinstance(fa, bool) or not isinstance(fa, (int, float)) or not math.isfinite(fa) or not 1e-15 <= fa < 0.5:
            raise FingerprintError(f"fingerprint false_alarm must be a probability in [1e-15, 0.5), got {fa!r}")
        for name in ("seed", "samples", "rows", "buckets"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "false_alarm", float(fa))
        binomial = binomial_tail(self.rows, row_false_alarm(self.multiplier, self.buckets))
        if binomial > Fraction(self.false_alarm):  # solve_multiplier guarantees this; kept as a check
            raise FingerprintError(f"fingerprint parameters {self}: false-alarm bound {float(binomial):.3g} "
                                   f"exceeds {self.false_alarm:g}")

    @property
    def multiplier(self) -> float:
        """c: the sketch fails a run whose estimated ||diff||_2 exceeds c x the tolerance bound."""
        return solve_multiplier(self.rows, self.buckets, self.false_alarm)

    @property
    def false_alarm_bound(self) -> float:
        """The exact binomial tail for these parameters (<= ``false_alarm``)."""
        return float(binomial_tail(self.rows, row_false_alarm(self.multiplier, self.buckets)))

    def nbytes(self, itemsize: int = 4, numel: int | None = None) -> int:
        """Stored size of a fingerprint of elements of ``itemsize`` bytes (complex: both parts)."""
        k = self.samples if numel is None else min(self.samples, numel)
        return 8 * self.rows * self.buckets + k * itemsize + 8 * (5 + 5 + 6) + 256  # + meta JSON

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "samples": self.samples, "rows": self.rows, "buckets": self.buckets,
                "false_alarm": self.false_alarm}

    @classmethod
    def from_dict(cls, d: Any) -> FingerprintParams:
        if not isinstance(d, Mapping) or set(d) != {"seed", "samples", "rows", "buckets", "false_alarm"}:
            raise FingerprintFormatError(f"fingerprint params must be an object with keys seed, samples, rows, "
                                         f"buckets, false_alarm; got {d!r:.200}")
        try:
            return cls(**d)
        except FingerprintError as e:
            raise FingerprintFormatError(str(e)) from None


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
    if not _is_int(ver_raw) or int(ver_raw) < 1:
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
            or not all(_is_int(s) and 0 <= s < 1 << 62 for s in shape_raw)):
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
    transfer (two when the tensor holds NaN/Inf: a second pass then masks them).
    """
    p = params or FingerprintParams()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"compute_fingerprint needs a torch.Tensor, got {type(t).__name__}")
    if not fingerprintable_dtype(t.dtype):
        raise FingerprintError(f"cannot fingerprint a {t.dtype} tensor: only floating and complex tensors are "
                               "fingerprinted (integers and bools are stored exactly)")
    if not isinstance(chunk, int) or chunk < max(p.buckets, 1024) or chunk & (chunk - 1):
        raise FingerprintError(f"chunk must be a power of two >= max(buckets, 1024), got {chunk!r}")
    info = dtypes.info_for(t.dtype)
    per = 2 if info.kind == "complex" else 1
    real = real_view(t.detach())
    args = (p.seed, p.rows, p.buckets, p.samples, chunk)
    res = run_kernel(real, *args, masked=False, per=per)
    if not res.all_finite:
        res = run_kernel(real, *args, masked=True, per=per)
    udt = _UNSIGNED[real.dtype.itemsize]
    width = 8 * real.dtype.itemsize
    raw = res.samples.astype(np.int64)
    bits = (raw & ((1 << width) - 1) if width < 64 else raw).astype(np.uint64).astype(udt)
    if per == 2:
        bits = bits.reshape(-1, 2)
    nan, posinf, neginf = res.counts
    return Fingerprint(
        dtype=info.name, shape=tuple(int(s) for s in t.shape), params=p,
        count=real.numel() - nan - posinf - neginf, nan=nan, posinf=posinf, neginf=neginf,
        nonfinite_hash=res.hashes, sum=res.sum, abs_sum=res.abs_sum, sq_sum=res.sq_sum, min=res.min, max=res.max,
        depth=res.depth, samples=bits, sketch=res.sketch,
    )

"""Noise floors: how far a run's outputs are from their float64 reference, and where a golden
keeps those numbers.

A floor is measured per layer call and output (max abs and RMS of ``run - float64 reference``);
:class:`FloorTable` is the golden's record of them (meta JSON key ``calibration``), read back with
validation. The calibrated rule that uses them is in :mod:`activation_guard.calibration.calibrate`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._core import native
from .._core.devices import stats_device, to_device
from .._core.errors import GoldenFormatError, UncalibratedGoldenError
from .._core.kernel import CHUNK

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
# floating outputs get floors; complex ones too (their floors measure |a - b|, the modulus)
CALIBRATED_DTYPES = REDUCED_DTYPES | {"float32", "float64", "complex64", "complex128"}


def multiplier(dtype_name: str, numel: int) -> float:
    """The margin ``m`` for an output of this (lower-precision side) dtype and size."""
    if dtype_name in REDUCED_DTYPES:
        return MULTIPLIER_REDUCED
    if numel < SMALL_NUMEL:
        return MULTIPLIER_SMALL
    return MULTIPLIER


def rule_text(m: float) -> str:
    return f"calibrated: {m:g} x (golden floor + live floor) + {ABS_TERM:g} x min(1, values' RMS)"


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class NoiseFloor:
    """A run's error against the float64 reference for one output: max |x - ref| and RMS."""

    max_abs: float
    rms: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.max_abs) and math.isfinite(self.rms)


_PROMOTES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def diff_stats(x: torch.Tensor, ref: torch.Tensor) -> NoiseFloor:
    """Max abs and RMS of ``x - ref`` in float64, on ``x``'s device (CPU if it lacks float64).

    Positions where both are equal, or both NaN, count as zero; any other non-finite difference
    makes the result infinite. Chunked so memory stays bounded, with a single device sync.
    """
    dev = stats_device(x)
    xs = to_device(x.detach(), dev).reshape(-1)
    rs = to_device(ref.detach(), dev).reshape(-1)
    wide = torch.complex128 if (xs.is_complex() or rs.is_complex()) else torch.float64  # |a - b| as the kernel has it
    n = xs.numel()
    if n != rs.numel():
        raise ValueError(f"diff_stats: {n} elements vs {rs.numel()}")
    if n == 0:
        return NoiseFloor(0.0, 0.0)
    fast, _ = compiled_diff(xs, rs)
    if fast is not None:
        return fast
    # Where every difference is finite, |a - b| is already the masked difference below (equal
    # finite values subtract to +0.0): four passes per chunk instead of a dozen, the same bits. A
    # non-finite value anywhere (NaN or Inf in either side) shows in the maximum, and then the
    # masked pass runs from the start.
    buf = torch.empty(min(n, CHUNK), dtype=wide, device=dev) if wide == torch.float64 else None
    for masked in (False, True):
        mx = torch.zeros((), dtype=torch.float64, device=dev)
        ss = torch.zeros((), dtype=torch.float64, device=dev)
        for i in range(0, n, CHUNK):
            if not masked and buf is not None:
                # the same bits in one buffer and three passes: widening is exact, so the
                # subtraction may widen its operands itself; max |d| is max(max d, -min d); and
                # d * d is |d| * |d| (a -0.0 maximum is made +0.0 below)
                a, b = xs[i : i + CHUNK], rs[i : i + CHUNK]
                # torch promotes these with float64 inside the subtraction; float8 it does not
                a = a if a.dtype in _PROMOTES else a.to(wide)
                b = b if b.dtype in _PROMOTES else b.to(wide)
                d = torch.sub(a if wide in (a.dtype, b.dtype) else a.to(wide), b, out=buf[: a.numel()])
                lo, hi = torch.aminmax(d)
                mx = torch.maximum(mx, torch.maximum(hi, lo.neg()))
                ss = ss + d.mul_(d).sum()
                continue
            a = xs[i : i + CHUNK].to(wide)
            b = rs[i : i + CHUNK].to(wide)
            if masked:
                same = (a == b) | (torch.isnan(a) & torch.isnan(b))
                d = torch.nan_to_num(torch.where(same, torch.zeros_like(a), a - b).abs(), nan=math.inf)
            else:
                d = (a - b).abs()
            mx = torch.maximum(mx, d.max())
            ss = ss + (d * d).sum()
        m, r = torch.stack([mx, torch.sqrt(ss / n)]).tolist()
        if masked or math.isfinite(m):
            break
    return NoiseFloor(float(m) + 0.0, float(r))


def compiled_diff(xs: torch.Tensor, rs: torch.Tensor) -> tuple[NoiseFloor | None, float | None]:
    """:func:`diff_stats` of two flat CPU float32/float64 tensors, and the RMS of ``rs``, from the
    compiled pass's one read of both (``native.Native.diff``: its sums in eight fixed lanes,
    another order than torch's, the same maximum), where the library is at hand without a build;
    None for either that is not finite (the torch passes define those cases), or where the
    compiled pass does not take these tensors."""
    if xs.device.type != "cpu" or rs.device.type != "cpu" or xs.numel() == 0:
        return None, None
    lib = native.available()
    got = None if lib is None else lib.diff(xs, rs)
    if got is None:
        return None, None
    n = xs.numel()
    mx, ss, rr = got
    floor = NoiseFloor(mx + 0.0, math.sqrt(ss / n)) if math.isfinite(mx) and math.isfinite(ss) else None
    return floor, (math.sqrt(rr / n) if math.isfinite(rr) else None)


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

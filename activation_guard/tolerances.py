"""Which rtol/atol applies to a layer: dtype defaults, device-pair defaults, overrides.

Precedence (highest first): a per-layer glob pattern in ``tolerances`` (most specific pattern
wins), the global ``rtol``/``atol`` arguments, the device-pair default (a CUDA run checked
against a CPU golden gets looser float defaults), the dtype default of
``torch.testing.assert_close``. Integers and bools always compare exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .capture import match_any

# torch.testing.assert_close defaults; float8 ones follow the same "about one unit in the last
# place" reasoning (e4m3 has a 3-bit mantissa, e5m2 a 2-bit one).
DTYPE_DEFAULTS: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-3, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
    "float8_e4m3fn": (1.25e-1, 1e-3),
    "float8_e4m3fnuz": (1.25e-1, 1e-3),
    "float8_e5m2": (2.5e-1, 1e-3),
    "float8_e5m2fnuz": (2.5e-1, 1e-3),
    "float8_e8m0fnu": (1.0, 0.0),
}

# A golden recorded on one device type and checked on another (e.g. CPU golden, CUDA run):
# kernels differ in reduction order and fused-multiply-add use, so errors of a few float32 ulps
# per op accumulate through depth. These defaults are deliberately ~100x the same-device ones
# for float32 and ~10x for half types; TF32 needs `tolerance="calibrated"` instead.
CROSS_DEVICE_DEFAULTS: dict[str, tuple[float, float]] = {
    "float16": (1e-2, 1e-4),
    "bfloat16": (5e-2, 1e-3),
    "float32": (1e-4, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-2, 1e-4),
    "complex64": (1e-4, 1e-5),
    "complex128": (1e-7, 1e-7),
}

EXACT_KINDS = {"int", "bool"}


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    source: str  # why these numbers, shown in the report

    def to_dict(self) -> dict[str, Any]:
        return {"rtol": self.rtol, "atol": self.atol, "source": self.source}


def _check_value(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {v!r}")
    return f


def _parse_spec(pattern: str, spec: Any) -> tuple[float | None, float | None]:
    where = f"tolerances[{pattern!r}]"
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"rtol", "atol"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; use rtol and atol")
        r, a = spec.get("rtol"), spec.get("atol")
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        r, a = spec
    else:
        raise TypeError(f"{where} must be a dict(rtol=..., atol=...) or an (rtol, atol) pair, got {spec!r}")
    if r is None and a is None:
        raise ValueError(f"{where} sets neither rtol nor atol")
    return (
        None if r is None else _check_value(r, f"{where} rtol"),
        None if a is None else _check_value(a, f"{where} atol"),
    )


def specificity(pattern: str) -> tuple[int, int]:
    """Rank patterns: exact names beat globs, then more literal characters win."""
    wild = sum(pattern.count(c) for c in "*?[")
    return (1 if wild == 0 else 0, len(pattern) - wild)


class ToleranceResolver:
    def __init__(
        self,
        rtol: float | None = None,
        atol: float | None = None,
        tolerances: Mapping[str, Any] | None = None,
        golden_device: str | None = None,
        live_device: str | None = None,
    ):
        self.rtol = None if rtol is None else _check_value(rtol, "rtol")
        self.atol = None if atol is None else _check_value(atol, "atol")
        if tolerances is not None and not isinstance(tolerances, Mapping):
            raise TypeError(f"tolerances must be a dict of glob pattern -> dict(rtol=, atol=), got {type(tolerances).__name__}")
        specs = []
        for pat, spec in (tolerances or {}).items():
            if not isinstance(pat, str):
                raise TypeError(f"tolerances keys must be glob strings, got {pat!r}")
            specs.append((pat, *_parse_spec(pat, spec)))
        # most specific first; stable for ties (dict order)
        self.patterns = sorted(specs, key=lambda s: specificity(s[0]), reverse=True)
        gd = (golden_device or "cpu").split(":")[0]
        ld = (live_device or gd).split(":")[0]
        self.cross_device = gd != ld
        self.device_pair = f"{gd}->{ld}"

    def unmatched(self, names: Any) -> list[str]:
        """The ``tolerances`` patterns that match none of ``names`` (a typo loosens nothing)."""
        names = list(names)
        return [p for p, _, _ in self.patterns if not any(match_any(n, [p]) for n in names)]

    def base(self, dtype_name: str) -> Tolerance:
        if self.cross_device and dtype_name in CROSS_DEVICE_DEFAULTS:
            r, a = CROSS_DEVICE_DEFAULTS[dtype_name]
            return Tolerance(r, a, f"{dtype_name} default for {self.device_pair}")
        r, a = DTYPE_DEFAULTS.get(dtype_name, (0.0, 0.0))
        return Tolerance(r, a, f"{dtype_name} default")

    def resolve(self, name: str, dtype_name: str, kind: str = "float") -> Tolerance:
        if kind in EXACT_KINDS:
            return Tolerance(0.0, 0.0, f"{dtype_name}: exact")
        base = self.base(dtype_name)
        # where each of rtol and atol came from, so the report never credits an option with a
        # number it did not set
        r, a = base.rtol, base.atol
        r_src = a_src = base.source
        if self.rtol is not None:
            r, r_src = self.rtol, "rtol/atol option"
        if self.atol is not None:
            a, a_src = self.atol, "rtol/atol option"
        for pat, pr, pa in self.patterns:
            if match_any(name, [pat]):
                if pr is not None:
                    r, r_src = pr, f"tolerances[{pat!r}]"
                if pa is not None:
                    a, a_src = pa, f"tolerances[{pat!r}]"
                break
        src = r_src if r_src == a_src else f"rtol: {r_src}; atol: {a_src}"
        return Tolerance(r, a, src)

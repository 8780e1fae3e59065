"""Which rtol/atol applies to a layer: dtype defaults, device-pair defaults, overrides.

Precedence (highest first): a per-layer glob pattern in ``tolerances`` (most specific pattern
wins), the global ``rtol``/``atol`` options, the device-pair default (a CUDA run checked
against a CPU golden, or one from another GPU model, gets looser float defaults; looser still
when one side computes float32 in TF32 or bf16), the dtype default of
``torch.testing.assert_close``. Integers and bools always compare exactly.

Values were validated when the :class:`~activation_guard.options.spec.CompareSpec` was built; this module
only decides which numbers apply where, and says why (the ``source`` shown in reports).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .selection import matches
from .spec import ARGUMENT, CompareSpec, ToleranceRule

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
    "float8_e8m0fnu": (0.0, 0.0),  # powers of two only: one unit in the last place is a factor of 2
}

# A golden recorded on one device type and checked on another (e.g. CPU golden, CUDA run):
# kernels differ in reduction order and fused-multiply-add use, so errors of a few float32 ulps
# per op accumulate through depth. These defaults are deliberately ~100x the same-device ones
# for float32 and ~10x for half types; TF32 or bf16 float32 math on one side gets
# REDUCED_PRECISION_DEFAULTS below (and `tolerance="calibrated"` judges it far more finely).
CROSS_DEVICE_DEFAULTS: dict[str, tuple[float, float]] = {
    "float16": (1e-2, 1e-4),
    "bfloat16": (5e-2, 1e-3),
    "float32": (1e-4, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-2, 1e-4),
    "complex64": (1e-4, 1e-5),
    "complex128": (1e-7, 1e-7),
}

# One side computes float32 matmuls/convolutions/RNNs in a reduced precision (TF32 on a GPU, by
# default for cuDNN convolutions and RNNs; bf16 through oneDNN on a CPU): each product rounds its
# operands to a 10-bit (TF32) or 7-bit (bf16) mantissa, about 5e-4 or 4e-3 relative, and sums of
# such products compound it through depth. Measured with emulate_tf32 on the example CNN, a
# TransformerEncoder and a 6-layer MLP: the smallest of the tried pairs that passed every layer
# was rtol 1e-2, atol 1e-3 (docs/performance.md). Loose: calibrated tolerances catch far smaller
# bugs under TF32 (docs/cross-device.md).
REDUCED_PRECISION_DEFAULTS: dict[str, dict[str, tuple[float, float]]] = {
    "TF32": {"float32": (1e-2, 1e-3), "complex64": (1e-2, 1e-3)},
    "bf16": {"float32": (5e-2, 1e-3), "complex64": (5e-2, 1e-3)},
}

EXACT_KINDS = {"int", "bool"}


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    source: str  # why these numbers, shown in the report
    rule: ToleranceRule | None = None  # the tolerances pattern that set them, if any

    def to_dict(self) -> dict[str, Any]:
        return {"rtol": self.rtol, "atol": self.atol, "source": self.source}


class ToleranceResolver:
    """Which numbers a spec gives each layer, on this pair of devices."""

    def __init__(self, spec: CompareSpec, golden_device: str | None = None, live_device: str | None = None, *,
                 other_model: str | None = None, reduced: str | None = None):
        """``other_model``: the pair's label when both devices have one type but another model
        (name or compute capability): cross-device too. ``reduced``: "TF32" or "bf16" when one
        side's float32 math runs in that precision and the other's does not (or across devices)."""
        self.spec = spec
        gd = (golden_device or "cpu").split(":")[0]
        ld = (live_device or gd).split(":")[0]
        self.cross_device = gd != ld or other_model is not None
        self.device_pair = other_model if gd == ld and other_model is not None else f"{gd}->{ld}"
        self.reduced = reduced
        # an argument of compare() is "rtol/atol option"; elsewhere the place it was set
        self._cache: dict[tuple[str, str, str], Tolerance] = {}
        self._option_label = {k: "rtol/atol option" if spec.source(k) == ARGUMENT else spec.source(k)
                              for k in ("rtol", "atol")}

    def unmatched(self, names: Iterable[str]) -> list[str]:
        """The ``tolerances`` patterns that match none of ``names`` (a typo loosens nothing)."""
        names = list(names)
        return [r.pattern for r in self.spec.tolerances if not any(matches(n, r.pattern) for n in names)]

    def rule_for(self, name: str) -> ToleranceRule | None:
        """The most specific ``tolerances`` pattern naming layer ``name``."""
        for rule in self.spec.tolerances:
            if matches(name, rule.pattern):
                return rule
        return None

    def base(self, dtype_name: str) -> Tolerance:
        wide = REDUCED_PRECISION_DEFAULTS.get(self.reduced or "", {})
        if dtype_name in wide:
            r, a = wide[dtype_name]
            where = f" for {self.device_pair}" if self.cross_device else ""
            return Tolerance(r, a, f"{dtype_name} default{where} with {self.reduced} float32 math on one side")
        if self.cross_device and dtype_name in CROSS_DEVICE_DEFAULTS:
            r, a = CROSS_DEVICE_DEFAULTS[dtype_name]
            return Tolerance(r, a, f"{dtype_name} default for {self.device_pair}")
        r, a = DTYPE_DEFAULTS.get(dtype_name, (0.0, 0.0))
        return Tolerance(r, a, f"{dtype_name} default")

    def resolve(self, name: str, dtype_name: str, kind: str = "float") -> Tolerance:
        # the answer depends on the name only through the tolerances patterns: cached per
        # (dtype, kind) without patterns, per layer with them (one lookup per compared output)
        key = (name if self.spec.tolerances else "", dtype_name, kind)
        tol = self._cache.get(key)
        if tol is None:
            tol = self._cache[key] = self._resolve(name, dtype_name, kind)
        return tol

    def _resolve(self, name: str, dtype_name: str, kind: str) -> Tolerance:
        if kind in EXACT_KINDS:
            return Tolerance(0.0, 0.0, f"{dtype_name}: exact")
        base = self.base(dtype_name)
        # where each of rtol and atol came from, so the report never credits an option with a
        # number it did not set
        r, a = base.rtol, base.atol
        r_src = a_src = base.source
        if self.spec.rtol is not None:
            r, r_src = self.spec.rtol, self._option_label["rtol"]
        if self.spec.atol is not None:
            a, a_src = self.spec.atol, self._option_label["atol"]
        rule = self.rule_for(name)
        if rule is not None:
            if rule.rtol is not None:
                r, r_src = rule.rtol, rule.label
            if rule.atol is not None:
                a, a_src = rule.atol, rule.label
        src = r_src if r_src == a_src else f"rtol: {r_src}; atol: {a_src}"
        return Tolerance(r, a, src, rule)

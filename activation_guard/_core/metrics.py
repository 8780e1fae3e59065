"""Error metrics of a live value against its golden, from five sums (one formula each).

A value's *energy* is what every metric here follows from: ``n`` the element count, ``gg`` the
reference's energy ``sum(g^2)``, ``dd`` the error's energy ``sum((l - g)^2)``, ``gl`` ``sum(g*l)``
and ``ll`` ``sum(l^2)`` (sums in float64). Energies of several outputs add up, so a layer call
with several outputs is measured pooled, as one value. The formulas:

* ``sqnr`` (dB): ``10 log10(gg / dd)``; ``inf`` at zero error (both all-zero included), ``-inf``
  for an error on an all-zero reference (no signal to measure it against);
* ``cosine``: ``gl / sqrt(gg * ll)``; 1 when both are all-zero, 0 when only one is;
* ``mse``: ``dd / n`` (0 for an empty value);
* ``rel_l2``: ``sqrt(dd / gg)``; 0 at zero error, ``inf`` for an error on an all-zero reference.

Non-finite values and sentinels: an element equal in both (the same Inf, NaN in both) is no error,
and so is an element at its dtype's extreme on both sides with one sign (``finfo.max`` in
magnitude or infinite: the "minus infinity" of an attention mask in float32 against float16);
any other element that is non-finite or extreme on either side makes ``dd`` infinite (SQNR
``-inf``, relative L2 ``inf``); ``gg``, ``gl`` and ``ll`` sum finite, non-extreme elements only
(a mask's 3e38 would drown any error). :func:`activation_guard.judges.metrics.energy_of`
computes the sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

Metric = Literal["sqnr", "cosine", "mse", "rel_l2"]
METRICS: tuple[Metric, ...] = get_args(Metric)
# metrics where a larger value is a smaller error
HIGHER_IS_BETTER: frozenset[Metric] = frozenset({"sqnr", "cosine"})
UNITS: dict[Metric, str] = {"sqnr": " dB", "cosine": "", "mse": "", "rel_l2": ""}


@dataclass(frozen=True)
class Energy:
    """The sums every metric follows from (module docstring)."""

    n: int
    gg: float
    dd: float
    gl: float
    ll: float

    def __add__(self, other: Energy) -> Energy:
        return Energy(self.n + other.n, self.gg + other.gg, self.dd + other.dd, self.gl + other.gl,
                      self.ll + other.ll)

    def sqnr_db(self) -> float:
        if self.dd == 0:
            return math.inf
        if self.gg == 0 or math.isinf(self.dd):
            return -math.inf
        return 10.0 * math.log10(self.gg / self.dd)

    def cosine(self) -> float:
        if self.gg == 0 and self.ll == 0:
            return 1.0
        if self.gg == 0 or self.ll == 0:
            return 0.0
        return max(-1.0, min(1.0, self.gl / math.sqrt(self.gg * self.ll)))

    def mse(self) -> float:
        return self.dd / self.n if self.n else 0.0

    def rel_l2(self) -> float:
        if self.dd == 0:
            return 0.0
        if self.gg == 0:
            return math.inf
        return math.sqrt(self.dd / self.gg)

    def noise_ratio(self) -> float:
        """``dd / gg``: the error's energy per unit of the reference's (``10^(-sqnr/10)``)."""
        if self.dd == 0:
            return 0.0
        return math.inf if self.gg == 0 else self.dd / self.gg

    def value(self, metric: Metric) -> float:
        if metric == "sqnr":
            return self.sqnr_db()
        if metric == "cosine":
            return self.cosine()
        if metric == "mse":
            return self.mse()
        return self.rel_l2()

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "gg": _num(self.gg), "dd": _num(self.dd), "gl": _num(self.gl), "ll": _num(self.ll)}

    @classmethod
    def from_dict(cls, d: Any) -> Energy | None:
        if not isinstance(d, dict):
            return None
        return cls(int(d.get("n", 0)), *(float(d.get(k, 0.0)) for k in ("gg", "dd", "gl", "ll")))


def total(energies: Any) -> Energy | None:
    """The pooled energy of several values (None when none was measured)."""
    out: Energy | None = None
    for e in energies:
        if e is not None:
            out = e if out is None else out + e
    return out


def worse(metric: Metric, a: float, b: float) -> bool:
    """Whether value ``a`` of ``metric`` is a larger error than ``b``."""
    return a < b if metric in HIGHER_IS_BETTER else a > b


def fmt_value(metric: Metric, v: float | None) -> str:
    if v is None:
        return "-"
    if math.isnan(v):
        return "nan"
    if metric == "sqnr":
        return f"{v:.1f} dB" if math.isfinite(v) else ("inf dB" if v > 0 else "-inf dB")
    if metric == "cosine":
        return f"{v:.6f}"
    return f"{v:.3g}"


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)

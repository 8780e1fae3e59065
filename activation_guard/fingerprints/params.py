"""Fingerprint parameters and the false-alarm math behind them, free of torch and numpy.

Kept apart from :mod:`activation_guard.fingerprints.fingerprint` because option validation
(:mod:`activation_guard.options.spec`) checks a user's ``fingerprint_params`` while the pytest plugin starts,
which must not import torch. The derivation of the bound is in docs/fingerprint.md.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .._core.errors import ActivationGuardError

DEFAULT_SEED = 0x5EED_F16E_1234_ABCD
MAX_ROWS = 31
MIN_BUCKETS, MAX_BUCKETS = 16, 4096
MAX_FOLD = 1 << 24  # rows x buckets^2: the fold's routing workspace (16 bytes each) stays <= 256 MiB
MAX_SAMPLES = 1 << 16
PARAM_KEYS = ("seed", "samples", "rows", "buckets", "false_alarm")


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


@functools.lru_cache(maxsize=64)
def _exact_bound(rows: int, buckets: int, false_alarm: float) -> Fraction:
    """The binomial tail at the solved multiplier (exact; cached: every compared leaf reports it)."""
    return binomial_tail(rows, row_false_alarm(solve_multiplier(rows, buckets, false_alarm), buckets))


# --------------------------------------------------------------------------- parameters


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


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
        if not is_int(self.seed) or not 0 <= self.seed < 1 << 64:
            raise FingerprintError(f"fingerprint seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not is_int(self.samples) or not 0 <= self.samples <= MAX_SAMPLES:
            raise FingerprintError(f"fingerprint samples must be an integer in [0, {MAX_SAMPLES}], "
                                   f"got {self.samples!r}")
        if not is_int(self.rows) or not 1 <= self.rows <= MAX_ROWS or self.rows % 2 == 0:
            raise FingerprintError(f"fingerprint rows must be an odd integer in [1, {MAX_ROWS}] (the median "
                                   f"of the rows is the estimate), got {self.rows!r}")
        b = self.buckets
        if not is_int(b) or not MIN_BUCKETS <= b <= MAX_BUCKETS or b & (b - 1):
            raise FingerprintError(f"fingerprint buckets must be a power of two in [{MIN_BUCKETS}, {MAX_BUCKETS}], "
                                   f"got {b!r}")
        if self.rows * b * b > MAX_FOLD:
            raise FingerprintError(f"fingerprint rows x buckets^2 must be at most {MAX_FOLD:,} (the fold's workspace "
                                   f"is 16 x rows x buckets^2 bytes: {16 * MAX_FOLD >> 20} MiB at most; earlier "
                                   f"versions accepted more and could need {16 * self.rows * b * b / 2**30:.3g} GiB "
                                   f"here), got rows {self.rows} x buckets {b}^2 = {self.rows * b * b:,}")
        fa = self.false_alarm
        if isinstance(fa, bool) or not isinstance(fa, numbers.Real) or not math.isfinite(fa) or not 1e-15 <= fa < 0.5:
            raise FingerprintError(f"fingerprint false_alarm must be a probability in [1e-15, 0.5), got {fa!r}")
        for name in ("seed", "samples", "rows", "buckets"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "false_alarm", float(fa))
        binomial = _exact_bound(self.rows, self.buckets, self.false_alarm)
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
        return float(_exact_bound(self.rows, self.buckets, self.false_alarm))

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

"""The SQNR gate and error metrics as a judge: each float output's error energy, and a verdict by SQNR.

:class:`MetricJudge` is the strict rule plus two things. Every float output it judges gets its error
energy (:class:`~activation_guard._core.metrics.Energy`: the sums SQNR, cosine similarity, MSE and
relative L2 follow from), so reports show the chosen ``metric`` per layer and a sensitivity
analysis ranks layers by it. A layer whose most specific ``tolerances`` pattern sets
``min_sqnr_db`` is judged by SQNR instead of element-wise: it passes when its SQNR against the
golden is at least that many dB (a new NaN or Inf is an error without bound, SQNR ``-inf``, unless
both sides hold their dtype's sentinel there: ``energy_of``). Integer and bool outputs stay exact.

Under ``replay="first"`` the gate judges what each layer's output accumulated; under
``replay="all"`` each layer's own error (the layer re-run on the golden's inputs), and the report
keeps both energies either way.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from .._core.errors import OptionError
from .._core.metrics import Energy, Metric, fmt_value
from ..options.selection import display_name
from ..options.spec import CompareSpec
from ..options.tolerances import Tolerance, ToleranceResolver
from ..results import LeafResult
from ..store import CallEntry
from .strict import LeafContext, StrictJudge, identical_leaf

_REAL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def measurable(t: torch.Tensor) -> bool:
    """Real floating tensors (float8 and complex are judged but not measured)."""
    return t.dtype in _REAL


def energy_of(golden: torch.Tensor, live: torch.Tensor) -> Energy:
    """The sums of :mod:`activation_guard._core.metrics` for two tensors of one shape, in float64
    on the live tensor's device (the golden is moved there).

    An element at its dtype's extreme (``finfo.max`` in magnitude, or infinite: an attention mask's
    "minus infinity" in float32, float16 or bfloat16) is a sentinel, not a number: sentinels of one
    sign on both sides are the same value (no error), a sentinel on one side only is an error
    without bound, and sentinels add nothing to the signal sums (a mask's 3e38 would drown any
    error in ``gg``). NaN in both is no error; NaN on one side is an error without bound."""
    dev = live.device if live.device.type not in ("mps", "meta") else torch.device("cpu")
    g = golden.detach().to(device=dev, dtype=torch.float64)
    lv = live.detach().to(device=dev, dtype=torch.float64)
    gx, lx = _extreme(g, golden.dtype), _extreme(lv, live.dtype)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    same = (g == lv) | (torch.isnan(g) & torch.isnan(lv)) | (gx & lx & (torch.sign(g) == torch.sign(lv)))
    d = torch.where(same, zero, lv - g)
    d = torch.where(~same & (gx | lx), torch.full((), float("inf"), dtype=torch.float64, device=dev), d)
    dd = float((d * d).sum()) if bool(torch.isfinite(d).all()) else float("inf")
    gf = torch.where(torch.isfinite(g) & ~gx, g, zero)
    lf = torch.where(torch.isfinite(lv) & ~lx, lv, zero)
    return Energy(int(g.numel()), float((gf * gf).sum()), dd, float((gf * lf).sum()), float((lf * lf).sum()))


def _extreme(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elements at the extreme of ``dtype`` (``t`` holds them in float64): infinite, or as large
    in magnitude as the dtype's largest finite value."""
    return torch.isinf(t) | (t.abs() >= torch.finfo(dtype).max)


def _zero(t: torch.Tensor) -> Energy:
    """A bit-identical value's energy: no error (``dd`` = 0), the rest from the value."""
    v = t.detach().to(torch.float64)
    v = torch.where(torch.isfinite(v) & ~_extreme(v, t.dtype), v, torch.zeros((), dtype=v.dtype, device=v.device))
    e = float((v * v).sum())
    return Energy(int(v.numel()), e, 0.0, e, e)


class MetricJudge(StrictJudge):
    """The strict rule, each float output's error energy, and the SQNR gate (module docstring)."""

    def __init__(self, resolver: ToleranceResolver, metric: Metric | None = None):
        super().__init__(resolver)
        self.metric: Metric = metric or "sqnr"
        self.gated = 0  # outputs judged by SQNR (replays' own outputs included)

    def threshold(self, ctx: LeafContext) -> tuple[float, str] | None:
        rule = self.resolver.rule_for(ctx.name)
        if rule is None or rule.min_sqnr_db is None:
            return None
        return rule.min_sqnr_db, f"{rule.label}: min_sqnr_db {rule.min_sqnr_db:g}"

    def judge(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        gate = self.threshold(ctx)
        if not (measurable(golden) and measurable(live)):
            return super().judge(ctx, golden, live) if gate is None else self._exact(ctx, golden, live)
        energy = energy_of(golden, live)
        if gate is None:
            res = super().judge(ctx, golden, live)
            res.energy = energy
            return res
        thr, source = gate
        # element numbers (worst element, counts) as an exact compare reports them; the verdict is the SQNR's
        res = self.judge_with(ctx, golden, live, Tolerance(0.0, 0.0, source))
        res.energy = energy
        res.min_sqnr_db = thr
        res.rtol = res.atol = None
        sqnr = energy.sqnr_db()
        self.gated += 1
        # a new NaN/Inf is an unbounded error (SQNR -inf), unless both sides hold their dtype's sentinel there
        if sqnr >= thr:
            res.status = "match"
        else:
            res.status = "nonfinite" if res.nonfinite_new else "diverged"
        if res.status != "match":
            res.detail = f"SQNR {fmt_value('sqnr', sqnr)} < min_sqnr_db {thr:g} dB"
        if res.status == "match":
            res.mismatched = res.nonfinite_new = 0
        return res

    def _exact(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        """An integer, bool or complex output of a layer the gate names: compared exactly (it has no
        SQNR that would mean what the threshold means)."""
        return self.judge_with(ctx, golden, live, Tolerance(0.0, 0.0, f"{ctx.golden_dtype}: exact"))

    def identical(self, ctx: LeafContext, live: torch.Tensor, view: np.ndarray | None = None) -> LeafResult:
        gate = self.threshold(ctx)
        tol = self.tolerance(ctx) if gate is None else Tolerance(0.0, 0.0, gate[1])
        shape = tuple(live.shape)
        first = live.detach().reshape(-1)[0].item() if live.numel() else None
        res = identical_leaf(ctx, shape, first, tol)
        if measurable(live):
            res.energy = _zero(live)
            if gate is not None:
                res.min_sqnr_db, res.rtol, res.atol = gate[0], None, None
                self.gated += 1
        return res

    def identical_tolerance(self, name: str, dtype: str) -> None:
        return None  # every output is measured as it comes

    def notes(self) -> list[str]:
        if not self.gated:
            return []
        return ["layers a min_sqnr_db pattern names are judged by SQNR = 10 log10(sum(golden^2) / "
                "sum((live - golden)^2)) over all elements of each output: their output's (accumulated), or under "
                "replay=\"all\" their own (re-run on the golden's inputs)"]


def refuse_fingerprinted_gate(spec: CompareSpec, resolver: ToleranceResolver, calls: Iterable[CallEntry],
                              path: str) -> None:
    """An SQNR gate needs the golden's values: a layer it names whose golden outputs are
    fingerprints (their SQNR cannot be measured from a sketch) is an option error naming both,
    rather than a layer silently judged by another rule."""
    if not spec.sqnr_gate:
        return
    for c in calls:
        rule = resolver.rule_for(c.name)
        if rule is not None and rule.min_sqnr_db is not None and any(g.kind == "fingerprint" for g in c.leaves):
            raise OptionError("tolerances", spec.given.get("tolerances"), spec.source("tolerances"),
                              f"{rule.label} sets min_sqnr_db for layer {display_name(c.name)!r}, whose outputs the "
                              f"golden {path} stores as fingerprints: an SQNR needs the values (re-record without "
                              f"fingerprint= for the layers the gate names, or exclude them from the pattern)")


def judge_for(spec: CompareSpec, resolver: ToleranceResolver) -> StrictJudge:
    """The strict rule, or the metric judge when the spec asks for a metric or an SQNR gate."""
    if spec.metric is None and not spec.sqnr_gate:
        return StrictJudge(resolver)
    return MetricJudge(resolver, spec.measured)


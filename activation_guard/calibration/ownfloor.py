"""Calibrated judging of replays: each replayed value against its own noise floor.

A replay re-runs one call on the golden's inputs, so the noise that matters is that call's own,
not the floor accumulated through depth: the live side's floor is measured against the float64
copy of the module re-run on the same golden inputs (:mod:`activation_guard.replay.replay`). Why the
golden side is its recorded floor, not one measured against that float64 replay, is in
:class:`OwnFloorJudge`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._core.devices import stats_device
from ..judges.strict import LeafContext, StrictJudge
from ..results import LeafResult
from ..store.floors import CALIBRATED_DTYPES, NoiseFloor, diff_stats
from .calibrate import CalibratedJudge, calibrated_verdict, values_rms


class OwnFloorJudge:
    """Calibrated mode for replays: a replayed output is weighed against the live module's own
    noise floor (its float64 copy on the same golden inputs), not the live floor accumulated
    through depth, plus the golden's recorded floor for that output.

    The golden side cannot be measured against the live float64 replay: that reference is the
    *live* module's, so a changed module (a 1% weight) would move it by exactly the change and
    widen the allowance to cover it (a false pass). The golden's recorded floor (its error
    against the float64 forward of the recorded model) bounds its own rounding on its inputs
    (for the first layer they are equal; deeper, it adds what its inputs inherited)."""

    def __init__(self, calibrated: CalibratedJudge, refs: dict[str, Any]):
        self.calibrated = calibrated
        self.refs = refs

    def judge(self, ctx: LeafContext, golden: torch.Tensor, live: torch.Tensor) -> LeafResult:
        cal = self.calibrated
        own: list[NoiseFloor] = []

        def floors(gf: NoiseFloor) -> tuple[NoiseFloor, NoiseFloor | None]:
            lf = _own_floor(live, self.refs.get(ctx.path))
            if lf is None:  # no usable float64 replay of this output: the shadow forward's floor
                return gf, cal.shadow.floor(ctx.name, ctx.call, ctx.path, live)
            own.append(lf)
            return gf, lf

        d = cal.decide(ctx, floors, lambda: values_rms(golden))
        if not d.calibrated:
            return cal.strict_verdict(ctx, golden, live, d)
        assert d.golden_floor is not None and d.live_floor is not None
        res = calibrated_verdict(ctx, golden, live, d.golden_floor, d.live_floor)
        if own:
            res.tolerance_source = (f"{res.tolerance_source} (live floor: its own, the float64 module re-run on the "
                                    f"golden inputs; golden floor: recorded)")
        return res

    def identical(self, ctx: LeafContext, live: torch.Tensor, view: np.ndarray | None = None) -> LeafResult:
        return self.calibrated.identical(ctx, live, view)

    def identical_tolerance(self, name: str, dtype: str) -> None:
        return None

    def notes(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def judge_input(strict: StrictJudge, cal: CalibratedJudge | None, ctx: LeafContext, golden: torch.Tensor,
                live: torch.Tensor, ref: torch.Tensor | None, floor: NoiseFloor | None) -> LeafResult:
    """A child's input against the golden's: strictly, or in calibrated mode against the live
    code's own floor (the float64 replay's input) and the golden's recorded floor of that value
    when it is a stored output; else the golden's own rounding is taken to be the live one's.
    The calibrated judge decides as for outputs, without counting it in its notes."""
    if cal is None:
        return strict.judge(ctx, golden, live)
    calibrated = ctx.golden_dtype in CALIBRATED_DTYPES and ctx.live_dtype in CALIBRATED_DTYPES
    own = _own_floor(live, ref) if calibrated else None
    d = cal.decide(ctx, lambda gf: (gf, own), lambda: values_rms(golden), golden_floor=floor or own, tally=False)
    if not d.calibrated:
        return cal.strict_verdict(ctx, golden, live, d)
    assert d.golden_floor is not None and d.live_floor is not None
    res = calibrated_verdict(ctx, golden, live, d.golden_floor, d.live_floor)
    res.tolerance_source = (f"{res.tolerance_source} (live floor: its own code's, from the float64 replay; golden "
                            f"floor: {'recorded' if floor else 'taken equal to the live one'})")
    return res


def _own_floor(live: torch.Tensor, ref: torch.Tensor | None) -> NoiseFloor | None:
    """``live``'s floor against its own float64 reference, when there is one of its shape and it is finite."""
    if ref is None or tuple(ref.shape) != tuple(live.shape):
        return None
    lf = diff_stats(live, ref.to(stats_device(live)))
    return NoiseFloor(lf.max_abs, lf.rms) if lf.finite else None

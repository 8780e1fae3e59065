"""Live noise floors taken from the golden's, for a live run that has no float64 shadow (a runtime).

An ONNX Runtime session cannot be re-run in float64 the way an eager model is copied to it, so the
calibrated rule's live floor is borrowed: the golden's floor for the same output when the live
value has the golden's precision (the same computation rounds alike), and the golden's floor
scaled by the two dtypes' unit roundoffs when the live value is stored in a lower precision (a
float16-converted model rounds every op ``eps(float16) / eps(float32)`` times as coarsely). The
report says so (``describe``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..store.floors import FloorTable, NoiseFloor


def _eps(dtype: torch.dtype) -> float | None:
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else None


class BorrowedFloors:
    """The live side of :class:`~activation_guard.calibration.calibrate.CalibratedJudge` when the
    live run has no float64 shadow (module docstring). ``golden_name`` maps a live layer name to
    the golden's (a rename)."""

    def __init__(self, golden: FloorTable, golden_dtype: Callable[[str, int, str], str | None],
                 golden_name: Callable[[str], str] = lambda name: name, runtime: str = "the runtime",
                 computes_in: torch.dtype | None = None):
        """``computes_in``: the lowest float precision the live run computes in, when lower than
        its outputs show (a float16 model that keeps float32 inputs and outputs)."""
        self.golden, self.golden_dtype, self.golden_name = golden, golden_dtype, golden_name
        self.computes_in = computes_in
        self.device = f"none for {runtime} (live floors borrowed from the golden's)"
        self.differs: list[tuple[str, int, float]] = []
        self.scaled = 0
        self.model = None

    def floor(self, name: str, call: int, path: str, value: torch.Tensor) -> NoiseFloor | None:
        gname = self.golden_name(name)
        gf = self.golden.get(gname, call, path)
        gdt = self.golden_dtype(gname, call, path)
        if gf is None or gdt is None:
            return None
        ge, le = _eps(getattr(torch, gdt, torch.float32)), _eps(value.dtype)
        if le is not None and self.computes_in is not None:
            le = max(le, _eps(self.computes_in) or le)
        if ge is None or le is None or le <= ge:
            return gf
        self.scaled += 1
        return NoiseFloor(gf.max_abs * le / ge, gf.rms * le / ge)

    def describe(self) -> str:
        return ("calibrated tolerances without a live float64 run: each live noise floor is the golden's for the same "
                "output" + (f", scaled by the ratio of unit roundoffs for {self.scaled} outputs computed in a lower "
                            f"precision than the golden's" if self.scaled else "")
                + (f" (the model computes in {str(self.computes_in).removeprefix('torch.')})"
                   if self.computes_in is not None else ""))

    def close(self) -> None:
        pass

"""Compare two recordings (for example a CPU golden and a CUDA recording) without a model.

The second recording plays the part of the live run: its layer calls are fed, in its own
execution order, to the same comparator that :func:`activation_guard.compare` drives from
forward hooks. Tolerances (including the cross-device defaults when the two were recorded on
different device types), renames, verdicts and the first-divergence report are therefore exactly
those of a live compare, and one layer's values are in memory at a time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

from .._core.gcpause import with_frozen_gc
from ..capture import env as envmod
from ..comparison.comparator import Comparator
from ..comparison.golden_selection import selective_note
from ..judges.metrics import judge_for, refuse_fingerprinted_gate
from ..options.selection import Selector, nothing_selected
from ..options.spec import ARGUMENT, CompareSpec
from ..options.tolerances import ToleranceResolver
from ..report.report import Report
from ..store import CallEntry, GoldenReader
from ..values.calls import LiveCall
from ..values.leaves import Leaf
from .gradients import diff_rows
from .run import report_meta


class RecordingSource:
    """A recording as a :class:`~activation_guard.values.calls.LiveSource`: its calls in recorded
    order, the selected ones only, each call's leaves read from the file when asked for."""

    def __init__(self, reader: GoldenReader, wanted: Callable[[str], bool]):
        self.reader = reader
        self.wanted = wanted

    def calls(self) -> Iterator[LiveCall]:
        for c in self.reader.calls:
            if self.wanted(c.name):
                yield LiveCall(c.name, c.call, c.type_name, functools.partial(_leaves, self.reader, c))

    def describe(self) -> str:
        return f"live values read from the recording {os.fspath(self.reader.path)}"


def _leaves(reader: GoldenReader, c: CallEntry) -> list[Leaf]:
    """Rebuild the flattened live output of one recorded call from its stored leaves."""
    out = []
    for e in c.leaves:
        if e.kind == "tensor":
            t = reader.load(e, f"layer {c.name!r} call {c.call} output {e.path!r}")
            out.append(Leaf(e.path, "tensor", tensor=t, type_name=e.type_name or "Tensor"))
        elif e.kind == "fingerprint":  # judged fingerprint against fingerprint (or a full golden, fingerprinted)
            fp = reader.fingerprint(e, f"layer {c.name!r} call {c.call} output {e.path!r}")
            out.append(Leaf(e.path, "fingerprint", type_name=e.type_name or "Tensor", fingerprint=fp))
        elif e.kind == "str":
            out.append(Leaf(e.path, "str", type_name=e.type_name or "str", value=e.value))
        else:
            out.append(Leaf(e.path, e.kind, type_name=e.type_name, value=e.value))
    return out


@with_frozen_gc
def diff_recordings(
    golden: str | os.PathLike[str],
    other: str | os.PathLike[str],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    tolerances: Mapping[str, Any] | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
    allow_dtype_change: bool = False,
    spec: CompareSpec | None = None,
    where: str | Sequence[str] | None = None,
    metric: str | None = None,
) -> Report:
    """Compare recording ``other`` against ``golden`` as if ``other`` were a live run.

    Options mean what they mean for :func:`activation_guard.compare`; ``include``/``exclude``
    select layers by the names in ``other``. ``spec`` replaces the keyword options (the command
    line builds one, naming its flags as the options' source).
    """
    if spec is None:
        spec = CompareSpec.build(dict(rtol=rtol, atol=atol, tolerances=tolerances, include=include, exclude=exclude,
                                      rename=rename, allow_dtype_change=allow_dtype_change, where=where,
                                      metric=metric), ARGUMENT)
    if spec.calibrated:
        raise ValueError("diff compares two recordings with the strict rule; calibrated tolerances need a live "
                         "model (its float64 shadow forward): use activation_guard.compare")
    inc, exc = spec.include, spec.exclude
    with GoldenReader(golden) as ga, GoldenReader(other) as gb:
        gmeta, bmeta = ga.meta, gb.meta
        gdev, bdev = envmod.recorded_device(gmeta), envmod.recorded_device(bmeta)
        binfo = bmeta.get("device") if isinstance(bmeta.get("device"), dict) else gmeta.get("device")
        reduced = envmod.precision_change(gmeta.get("numerics"), gmeta.get("device"), bmeta.get("numerics"), binfo,
                                          envmod.different_device(gmeta.get("device"), binfo),
                                          envmod.op_families({c.type_name for c in gb.calls}))
        resolver = ToleranceResolver(spec, golden_device=gdev, live_device=bdev or gdev,
                                     other_model=envmod.other_model(gmeta.get("device"), binfo),
                                     reduced=None if reduced is None else reduced[0])
        # as compare: default to the layers the golden recorded
        golden_filter = Comparator.default_filter(gmeta, spec) if inc is None and exc is None else None
        refuse_fingerprinted_gate(spec, resolver, [*ga.calls, *gb.calls], os.fspath(golden))
        comp = Comparator(ga, spec, judge_for(spec, resolver), golden_filter=golden_filter)
        source = RecordingSource(gb, Selector(inc, exc, [c.name for c in gb.calls]))
        comp.consume(source)
        layers, order = comp.finish()
        if not layers:
            raise nothing_selected(inc, exc, [c.name for c in gb.calls if c.call == 0])
        fp_notes = comp.notes()
        # gradients: the other recording's backward, judged the same way
        layers, order, grad_notes = diff_rows(ga, gb, spec, comp.judge, comp.live_to_golden, layers, order)
    env_changes = envmod.describe_env_change(
        gmeta.get("numerics"), bmeta.get("numerics") if isinstance(bmeta.get("numerics"), dict) else {})
    env_changes += envmod.describe_version_change(gmeta.get("versions"), bmeta.get("versions"), "other")
    if reduced is not None:
        env_changes.append(reduced[1].replace("the live ", "the other's "))
    if isinstance(bmeta.get("device"), dict):  # as compare: the device first among what differs
        env_changes = envmod.describe_device_change(gmeta.get("device"), bmeta["device"]) + env_changes
    gin, bin_ = gmeta.get("inputs"), bmeta.get("inputs")
    bin_ = [e for e in bin_ if isinstance(e, dict) and isinstance(e.get("path"), str)] if isinstance(bin_, list) else []
    input_changes = envmod.describe_input_change(gin if isinstance(gin, list) else None, bin_)
    report = Report(
        path=os.fspath(golden), layers=layers, golden_meta=report_meta(gmeta), live_device=bdev or "?",
        input_changes=input_changes, env_changes=env_changes, _order=order, metric=spec.measured,
    )
    b_modes = {"training": bmeta.get("training"), "training_differs": bmeta.get("training_differs")}
    if isinstance(b_modes["training"], bool) and isinstance(b_modes["training_differs"], list):
        report.mode_changes = envmod.describe_training_change(gmeta, b_modes, "the other recording was")
    report.notes.append(source.describe())
    report.notes += selective_note(gmeta)
    report.notes += fp_notes
    report.notes += grad_notes
    if not report.ok:
        report.notes.append("not replayed: a diff of two recordings has no model to re-run on the golden's inputs; "
                            "compare the model itself (activation_guard.compare) to tell whether the first diverging "
                            "layer changed or inherited the difference")
    gcls, bcls = gmeta.get("model_class"), bmeta.get("model_class")
    if gcls and bcls and gcls != bcls:
        report.notes.append(f"model class differs: golden {gcls}, other {bcls}")
    report.notes += [f"tolerances pattern {p!r} matched no layer" for p in resolver.unmatched(r.name for r in layers)]
    if resolver.cross_device:
        report.notes.append(f"golden recorded on {gdev}, other on {bdev}: "
                            f"{resolver.device_pair} default tolerances apply")
    return report

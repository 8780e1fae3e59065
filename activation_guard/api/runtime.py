"""ONNX models run in ONNX Runtime, compared per eager module call against an eager golden.

:func:`compare_onnx` reads an ``.onnx`` file, an ``onnx.ModelProto`` or a ``torch.onnx.ONNXProgram``,
feeds it the model inputs the golden recorded (or the given ones), and drives the comparator from
a :class:`~activation_guard.runtimes.ort.OrtSource`: the same matching, judges and report as every
other source. The first diverging module call is re-run alone in ONNX Runtime on the golden's
values (:meth:`~activation_guard.runtimes.ort.OrtSource.replay`) for ``report.origin``.
:func:`onnx_map` answers which golden module calls the ONNX model can be compared on, without
running it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from .._core.errors import UnsupportedModelError
from .._core.gcpause import with_frozen_gc
from ..calibration.borrowed import BorrowedFloors
from ..calibration.calibrate import CalibratedJudge
from ..calibration.shadow import ShadowRun
from ..capture import env as envmod
from ..comparison.comparator import Comparator
from ..comparison.golden_selection import recorded_selection, selective_note
from ..judges.strict import Judge, StrictJudge
from ..options.selection import Selector, nothing_selected
from ..options.spec import CompareSpec
from ..options.tolerances import ToleranceResolver
from ..report.report import Report
from ..results import LayerResult, Origin
from ..runtimes.ort import (
    OPTIMIZATIONS,
    FinalRun,
    OnnxGraph,
    OnnxScope,
    Optimization,
    OrtSource,
    load_model,
    require_onnx,
)
from ..store import CallEntry, GoldenReader
from ..store.floors import FloorTable
from .replays import ScopeReplays
from .run import golden_path, report_meta

RUNTIME = "onnxruntime"  # the live "device" the report names: golden device -> onnxruntime


def _array(value: Any, where: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    raise UnsupportedModelError(f"{where}: an ONNX model input is a tensor or a numpy array, got "
                                f"{type(value).__name__}")


def golden_inputs(reader: GoldenReader, names: Sequence[str]) -> dict[str, np.ndarray] | str:
    """The model inputs the golden recorded (its root call's arguments), by ONNX input name, or
    why they are not there: ``kwargs/<name>`` feeds the input of that name, ``args/<i>`` the
    remaining inputs in order."""
    entry = reader.by_key.get(("", 0))
    if entry is None:
        return "the golden has no call of the model itself (it was recorded with include/exclude)"
    if entry.inputs is None:
        return "the golden has no recorded model inputs (recorded with inputs=False)"
    leaves = [reader.resolve(x) for x in entry.inputs if x.kind in ("tensor", "alias")]
    by_name = {x.path.removeprefix("kwargs/"): x for x in leaves if x.path.startswith("kwargs/")}
    positional = [x for x in leaves if x.path.startswith("args/")]
    out: dict[str, np.ndarray] = {}
    for name in names:
        x = by_name.get(name) or (positional.pop(0) if positional else None)
        if x is None:
            return (f"ONNX input {name!r} has no recorded model input (the golden recorded "
                    f"{', '.join(y.path for y in leaves) or 'no tensor'})")
        out[name] = reader.load(x, f"model input {x.path!r}").cpu().numpy()
    return out


def live_inputs(inputs: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Given inputs by ONNX input name: a mapping by name, a sequence in the model's input order,
    or one tensor for a model with one input."""
    if isinstance(inputs, Mapping):
        unknown = [k for k in inputs if k not in names]
        if unknown:
            raise UnsupportedModelError(f"inputs: {unknown} are not inputs of the ONNX model (it takes {list(names)})")
        missing = [n for n in names if n not in inputs]
        if missing:
            raise UnsupportedModelError(f"inputs: the ONNX model also takes {missing}")
        return {k: _array(v, f"inputs[{k!r}]") for k, v in inputs.items()}
    seq = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    if len(seq) != len(names):
        raise UnsupportedModelError(f"inputs: the ONNX model takes {len(names)} inputs {list(names)}, got {len(seq)}")
    return {n: _array(v, f"inputs[{i}]") for i, (n, v) in enumerate(zip(names, seq))}


@dataclass
class OnnxMap:
    """Which golden module calls an ONNX model can be compared on: ``owned`` calls own at least one
    ONNX node; ``compared`` of them are judged on at least one output; ``skipped`` names the rest
    (and every golden call with no node) with the reason."""

    owned: int
    compared: int
    calls: int  # golden module calls (the root excluded)
    skipped: list[tuple[str, int, str]]

    @property
    def share(self) -> float:
        return self.compared / self.owned if self.owned else 1.0


def _spec_for(spec: CompareSpec, gmeta: Mapping[str, Any]) -> CompareSpec:
    if spec.include is None and spec.exclude is None and not spec.rename:
        return spec.with_selection(*recorded_selection(gmeta))
    return spec


class OnnxReplays(ScopeReplays):
    """The first diverging module call re-run alone in ONNX Runtime on the golden's values."""

    def __init__(self, source: OrtSource, comp: Comparator, reader: GoldenReader, golden: Any,
                 model_inputs: Mapping[str, np.ndarray] | None, mode: str):
        super().__init__(comp, golden, source.mapped, mode)
        self.source, self.reader, self.model_inputs = source, reader, model_inputs

    def after(self, scope: OnnxScope) -> None:
        def run(entry: CallEntry) -> dict[str, torch.Tensor] | str:
            return self.source.replay(scope, entry, self.reader.load, self.reader.resolve, self.model_inputs)

        judged = self.judge_alone(scope.path, scope.call, run)
        if judged is None:
            return
        res, own, first = judged
        outside = self.source.replayed_outside
        extra = (f"; nodes outside it computed live as well: code of {', '.join(repr(p or '<root>') for p in outside)}"
                 if outside else "")
        if own.status != "match":
            self.first = Origin(res.name, res.call, "layer", own.max_abs_diff, type_name=res.type_name,
                                detail=f"re-run alone in ONNX Runtime on the golden's values, this module call's ONNX "
                                       f"nodes compute differently: its ONNX translation differs{extra}")
        elif first and self.comp.inputs_changed:
            self.first = Origin(res.name, res.call, "inputs", own.max_abs_diff, type_name=res.type_name,
                                detail=f"re-run alone in ONNX Runtime on the golden's values, {res.name!r} computes "
                                       f"the same: the model's inputs differ from the golden's recorded ones")
        elif first:
            self.first = Origin(res.name, res.call, "parent-code", own.max_abs_diff, child=res.name,
                                type_name=res.type_name,
                                detail=f"re-run alone in ONNX Runtime on the golden's values, {res.name!r} computes "
                                       f"the same: its inputs differ, made earlier by ONNX nodes outside any compared "
                                       f"module call (a module call not comparable, or the enclosing code){extra}")

    def origin(self, first_divergence: LayerResult | None) -> Origin | None:
        if first_divergence is None or self.mode == "off":
            return None
        if self.first is None and first_divergence.name == "":
            whole = [k for k in self.source.skipped if k.whole]
            named = ", ".join(repr(k.name) for k in whole[:8])
            why = (f"the model's own code outside them, a module call that is not comparable ({named}), or "
                   if whole else "the model's own code outside them, or ")
            return Origin("", 0, "unknown", type_name=first_divergence.type_name, maybe_code=True,
                          detail=f"every compared module call matches; {why}ONNX Runtime's optimizations of the "
                                 f"unmarked run (the model's outputs come from it) made the difference")
        return self.first


def computes_in(proto: Any) -> torch.dtype | None:
    """The lowest float precision among the model's weights (float16, bfloat16), if any: a
    converted model computes in it even where its inputs and outputs stay float32."""
    onnx, _ = require_onnx()
    kinds = {t.data_type for t in proto.graph.initializer}
    for code, dtype in ((onnx.TensorProto.FLOAT16, torch.float16), (onnx.TensorProto.BFLOAT16, torch.bfloat16)):
        if code in kinds:
            return dtype
    return None


def _judge(spec: CompareSpec, resolver: ToleranceResolver, gmeta: Mapping[str, Any], path: str,
           reader: GoldenReader, golden_name: Any, low: torch.dtype | None = None) -> Judge:
    strict = StrictJudge(resolver)
    if not spec.calibrated:
        return strict
    floors = FloorTable.from_meta(gmeta, path)

    def dtype_of(name: str, call: int, leaf: str) -> str | None:
        entry = reader.by_key.get((name, call))
        for g in entry.leaves if entry is not None else ():
            if g.path == leaf:
                return g.dtype
        return None

    borrowed = BorrowedFloors(floors, dtype_of, golden_name, runtime="ONNX Runtime", computes_in=low)
    # the judge reads only floor(), device, differs and close() of its live side: the borrowed floors have them
    return CalibratedJudge(floors, cast(ShadowRun, borrowed), strict)


def _optimization(value: Any) -> Optimization:
    if value not in OPTIMIZATIONS:
        raise UnsupportedModelError(f"optimization={value!r}: one of {', '.join(map(repr, OPTIMIZATIONS))}")
    return cast(Optimization, value)


def compare_onnx(
    model: Any,
    inputs: Any = None,
    *,
    path: str | os.PathLike[str],
    optimization: str = "off",
    rtol: float | None = None,
    atol: float | None = None,
    tolerances: Mapping[str, Any] | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    fail_fast: bool = False,
    allow_dtype_change: bool = False,
    tolerance: str = "strict",
    replay: str = "first",
) -> Report:
    """Run an ONNX model in ONNX Runtime and compare it with an eager golden, module by module.

    ``model``: an ``.onnx`` path, an ``onnx.ModelProto`` or a ``torch.onnx.ONNXProgram`` exported
    with ``torch.onnx.export(..., dynamo=True)`` (its nodes name their module calls). ``inputs``:
    None feeds the model inputs the golden recorded; else a mapping by ONNX input name, a sequence
    in input order, or one tensor. Every value leaving a module call's scope is fetched in one run
    and judged as eager outputs are; calls that cannot be compared are named in a note with the
    reason. ``optimization``: ``"off"`` (default) runs with ONNX Runtime's graph optimizations
    disabled, a faithful map; ``"basic"`` or ``"default"`` compares the optimized graph where the
    marked values survive. The model's final outputs are always taken from a second run with every
    optimization on and no value marked (the deployed computation). Tolerances are the
    cross-device defaults; ``tolerance="calibrated"`` uses the golden's noise floors, the live
    floor borrowed from the golden's. See docs/onnx.md."""
    spec = CompareSpec.build(dict(
        rtol=rtol, atol=atol, tolerances=tolerances, include=include, exclude=exclude, fail_fast=fail_fast,
        allow_dtype_change=allow_dtype_change, tolerance=tolerance, replay=replay))
    return compare_onnx_spec(model, inputs, path=path, spec=spec, optimization=optimization)


def compare_onnx_spec(model: Any, inputs: Any = None, *, path: str | os.PathLike[str], spec: CompareSpec,
                      optimization: str = "off") -> Report:
    """:func:`compare_onnx` with its options in a :class:`CompareSpec` (the plugin's and CLI's entry)."""
    return _compare(model, inputs, path, spec, optimization)[0]


@with_frozen_gc  # as every compare: collections do not rescan the model, torch and onnx (gcpause)
def _compare(model: Any, inputs: Any, path: str | os.PathLike[str], spec: CompareSpec,
             optimization: str) -> tuple[Report, OrtSource]:
    opt = _optimization(optimization)
    require_onnx()
    for given, why in ((spec.backward not in (None, False), "backward=: an ONNX Runtime session computes no "
                                                             "gradients per module call"),
                       (spec.grad, "grad=True: an ONNX Runtime session computes no gradients"),
                       (bool(spec.rename), "rename=: an ONNX model's module paths are the eager model's")):
        if given:
            raise UnsupportedModelError(f"comparing an ONNX model: {why}")
    proto, label = load_model(model)
    path = golden_path(path)
    final = FinalRun(proto)  # the deployed model's session, built while the rest is prepared
    try:
        return _compare_with(proto, label, inputs, path, spec, opt, final)
    finally:
        final.cancel()


def _compare_with(proto: Any, label: str, inputs: Any, path: str, spec: CompareSpec, opt: Optimization,
                  final: FinalRun) -> tuple[Report, OrtSource]:
    with GoldenReader(path) as reader:
        gmeta = reader.meta
        spec = _spec_for(spec, gmeta)
        gdev = envmod.recorded_device(gmeta)
        resolver = ToleranceResolver(spec, golden_device=gdev, live_device=RUNTIME)
        judge = _judge(spec, resolver, gmeta, path, reader, lambda n: n, computes_in(proto))
        comp = Comparator(reader, spec, judge)
        counts: dict[str, int] = {}
        for c in reader.calls:
            counts[c.name] = counts.get(c.name, 0) + 1
        graph = OnnxGraph(proto, lambda p: counts.get(p, 0))
        recorded = golden_inputs(reader, graph.inputs)
        input_changes: list[str] = []
        if inputs is None:
            if isinstance(recorded, str):
                raise UnsupportedModelError(f"golden {path}: {recorded}; pass inputs= to compare_onnx")
            feeds = recorded
            graph.check_feeds(feeds, f"golden {path}: the recorded model input")
        else:
            feeds = live_inputs(inputs, graph.inputs)
            graph.check_feeds(feeds, "inputs: the value")
            if isinstance(recorded, Mapping):
                input_changes = [f"model input {n!r} differs from the golden's recorded one" for n in graph.inputs
                                 if not (feeds[n].shape == recorded[n].shape and np.array_equal(feeds[n], recorded[n]))]
                if input_changes:  # a replay feeds the golden's own model inputs only where they fit the model
                    try:
                        graph.check_feeds(recorded, "")
                    except UnsupportedModelError:
                        recorded = "the golden's recorded model inputs do not fit the model"
        comp.inputs_changed = bool(input_changes)

        def golden(name: str, call: int) -> Any:
            return reader.by_key.get((name, call))

        names = sorted({s.path for s in graph.scopes} | {""})
        wanted = Selector(spec.include, spec.exclude, names)
        expected = [(c.name, c) for c in comp.golden_selected]
        source = OrtSource(graph, feeds, golden=golden, golden_calls=expected, wanted=wanted, optimization=opt,
                           label=label, same_dtype=not spec.allow_dtype_change, resolve=reader.resolve,
                           final_run=final)
        replays = OnnxReplays(source, comp, reader, golden, recorded if isinstance(recorded, Mapping) else None,
                              spec.replay)
        if spec.replay != "off":
            source.after = replays.after
        comp.consume(source)
        layers, order = comp.finish()
        if not layers:
            raise nothing_selected(spec.include, spec.exclude, names)
        notes = [source.describe(), *source.notes(), *judge.notes(), *comp.notes()]
        if isinstance(judge, CalibratedJudge):
            borrowed = cast(Any, judge.shadow)
            notes.append(borrowed.describe())
        judge.close()
    env_changes = envmod.describe_version_change(gmeta.get("versions"), envmod.versions())
    report = Report(path=path, layers=layers, golden_meta=report_meta(gmeta), live_device=RUNTIME,
                    input_changes=input_changes, env_changes=env_changes, stopped_early=source.output is None,
                    output=source.output, _order=order, mode=spec.tolerance, replay=spec.replay)
    report.origin = replays.origin(report.first_divergence)
    if resolver.cross_device and not spec.calibrated:
        report.notes.append(f"golden recorded on {gdev}, live run in ONNX Runtime: {resolver.device_pair} default "
                            f"tolerances apply")
    report.notes += notes
    report.notes += selective_note(gmeta)
    return report, source


def onnx_map(model: Any, path: str | os.PathLike[str], inputs: Any = None) -> OnnxMap:
    """Which of the golden's module calls the ONNX model can be compared on, and why not the rest
    (a :func:`compare_onnx` run with replay off, read for its mapping)."""
    spec = CompareSpec.build(dict(replay="off"))
    report, source = _compare(model, inputs, path, spec, "off")
    golden_calls = {(name, c.call) for name, c in source.golden_calls if name}
    owned = source.graph.owned() & golden_calls
    compared = {(x.name, x.call) for x in report.layers if x.name and x.status != "missing"} & owned
    skipped = [(k.name, k.call, k.reason) for k in source.skipped if k.name]
    return OnnxMap(owned=len(owned), compared=len(compared), calls=len(golden_calls), skipped=skipped)

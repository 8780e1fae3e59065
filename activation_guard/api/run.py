"""The plain Python API: record, compare, compare_models. Everything else is glue over these.

Each function turns its keyword arguments into a :class:`~activation_guard.options.spec.RecordSpec` or
:class:`~activation_guard.options.spec.CompareSpec` first (the one place options are validated), then
wires capture -> store (record) or capture -> comparator -> judge -> report (compare).

A little over 400 lines because this is the one module where every capability is wired into the
two flows (inputs, replay, gradients, fingerprints, ranks): each keeps its logic in its own module
and adds a few lines here, and splitting the flows apart would scatter the order they run in.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.gcpause import with_frozen_gc
from ..calibration import calibrate as calmod
from ..capture import buffers
from ..capture import env as envmod
from ..capture.fingerprints import Fingerprinter, meta_entry
from ..capture.hooks import Target, check_model, hook_notes, hooked, layer_name, normalize_inputs, run_forward
from ..capture.recorder import Recorder
from ..comparison.comparator import Comparator, LiveInputs, StopForward
from ..comparison.golden_selection import recorded_selection, selective_note
from ..distributed import transform as distcap  # distributed
from ..fingerprints.fingerprint import FingerprintParams
from ..judges.metrics import judge_for, refuse_fingerprinted_gate
from ..judges.strict import Judge, StrictJudge
from ..options.selection import Selector, nothing_selected, parent_hint, selected, unmatched
from ..options.spec import ARGUMENT, CompareSpec, RecordSpec
from ..options.tolerances import ToleranceResolver
from ..replay.replay import Replayer
from ..report.report import Report
from ..results import LayerResult
from ..store import GoldenReader, GoldenWriter
from ..values.rebuild import clone_inputs
from . import gradients as grad_api
from . import graph as graph_api

# an eager module (hooks), or an ExportedProgram, a .pt2 path, a flattened GraphModule (api/graph.py)
Model = torch.nn.Module | torch.export.ExportedProgram | str | os.PathLike[str]


@dataclass
class RecordSummary:
    """What :func:`record` wrote."""

    path: str
    layer_calls: int
    leaves: int
    nbytes: int  # raw bytes of all stored tensors (and of the stored fingerprints)
    file_bytes: int
    names: list[str] = field(default_factory=list)
    output: Any = field(default=None, repr=False, compare=False)
    fingerprints: int = 0  # outputs stored as fingerprints (``nbytes`` counts their stored bytes)
    notes: list[str] = field(default_factory=list)
    gradients: int = 0  # gradient records (backward=...): calls' output/input gradients, modules' parameter gradients

    def to_dict(self) -> dict[str, Any]:
        d = {"path": self.path, "layer_calls": self.layer_calls, "leaves": self.leaves, "nbytes": self.nbytes,
             "file_bytes": self.file_bytes, "fingerprints": self.fingerprints, "notes": list(self.notes)}
        if self.gradients:
            d["gradients"] = self.gradients
        return d

    def __str__(self) -> str:
        stored = (f"{self.fingerprints} of them as fingerprints, {self.nbytes / 1e6:.3g} MB stored" if self.fingerprints
                  else f"{self.nbytes / 1e6:.3g} MB of values")
        grads = f" and {self.gradients} gradients" if self.gradients else ""
        text = (f"activation_guard: recorded {self.layer_calls} layer calls{grads} ({self.leaves} values, {stored}) "
                f"to {self.path} ({self.file_bytes / 1e6:.3g} MB)")
        return "\n".join([text, *(f"  note: {n}" for n in self.notes)])


# --------------------------------------------------------------------------- record


def _build_meta(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                spec: RecordSpec, modules: Any = None) -> dict[str, Any]:
    dev = envmod.model_device(model, args, kwargs)
    m = type(model)
    return {
        "versions": envmod.versions(),
        "device": envmod.device_info(dev),
        "model_class": f"{m.__module__}.{m.__qualname__}",
        **envmod.training_modes(model, modules),
        "inputs": envmod.input_fingerprint(args, kwargs),
        "numerics": envmod.numerics_flags(),
        "layer_inputs": spec.inputs,  # whether each call's inputs are recorded (replay needs them)
        "include": None if spec.include is None else list(spec.include),
        "exclude": None if spec.exclude is None else list(spec.exclude),
    }


def record(
    model: Model,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    path: str | os.PathLike[str],
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    compression: str | None = None,
    calibrate: bool = False,
    grad: bool = False,
    inputs: bool = True,
    fingerprint: bool | str | Sequence[str] = False,
    fingerprint_params: FingerprintParams | Mapping[str, Any] | None = None,
    backward: Any = False,
) -> RecordSummary:
    """Run ``model(*args, **kwargs)`` once and write every layer's outputs to a golden.

    ``calibrate=True`` also runs a float64 copy of the model and stores each output's noise
    floor (its error against float64) in the meta under ``"calibration"``, which
    ``compare(..., tolerance="calibrated")`` needs. See docs/cross-device.md.

    ``args`` follows ``torch.export``: a tuple holds the positional arguments, anything else is
    the one positional argument. The forward runs under ``torch.no_grad()`` unless ``grad=True``
    (forwards that call ``torch.autograd.grad`` themselves, e.g. forces from an energy).

    ``inputs=True`` (the default) also records each layer call's inputs, so a later compare can
    re-run a diverging layer on exactly what it received (``replay=``) and say whether the layer
    itself changed; inputs that are already stored values are kept as references, not again.

    ``fingerprint=True`` stores a fixed-size fingerprint (a few KiB) instead of the values of every
    floating output larger than that; layer globs (``"encoder.*"`` or a list) fingerprint only
    those layers and keep the rest exact. Integer and bool outputs are always exact. A compare
    against fingerprints is sound but probabilistic (docs/fingerprint.md); ``fingerprint_params``
    (``samples``, ``rows``, ``buckets``, ``false_alarm``, ``seed``) sets their size and bound. The
    inputs of fingerprinted layers are fingerprinted alike (replay needs full inputs: such a
    layer is not replayed).

    ``backward=True`` also runs one backward after the forward and records, per layer call, the
    gradients w.r.t. its outputs and inputs, and each parameter's gradient, in backward order; the
    loss is the sum of every floating output times a seeded random cotangent (the seed is stored).
    ``backward=<fn>`` uses ``fn(output) -> scalar`` as the loss instead (compare needs it again).
    The model is left as it was: ``.grad`` values, grad mode, training flag and RNG state.

    ``model`` may also be an exported program (an ``ExportedProgram``, the path of a ``.pt2``
    file, ``ep.module()`` or any ``GraphModule`` whose nodes carry ``nn_module_stack``): its
    module calls are recorded with the eager names from the graph (docs: "Compiled, exported and
    quantized models").

    The write is atomic: the golden at ``path`` is replaced only after the new one is complete,
    so an error or a kill mid-forward leaves the previous golden as it was. In a multi-rank
    torch.distributed run each rank writes its own local values to ``<golden>.rank<r>-of-<w>.h5``
    (the summary's ``path``; docs/distributed.md).
    """
    spec = RecordSpec.build(dict(include=include, exclude=exclude, compression=compression, calibrate=calibrate,
                                 grad=grad, inputs=inputs, fingerprint=None if fingerprint is False else fingerprint,
                                 fingerprint_params=fingerprint_params, backward=backward))
    return record_spec(model, args, kwargs, path=path, spec=spec)


@with_frozen_gc
def record_spec(model: Model, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
                path: str | os.PathLike[str], spec: RecordSpec, per_rank: bool = True) -> RecordSummary:
    """:func:`record` with its options already in a :class:`RecordSpec` (the plugin's entry).

    ``per_rank=False``: in a multi-rank run write ``path`` itself, with full values, as
    a single-device golden (only for a path no other rank writes: compare_models' private one)."""
    graph = graph_api.as_graph(model)  # an exported program, a .pt2 file, a flattened graph: no modules to hook
    if graph is not None:
        a, kw = normalize_inputs(args, kwargs)
        return RecordSummary(**graph_api.record_graph(*graph, a, kw, path=golden_path(path), spec=spec))
    target = check_model(model)
    model = target.root
    a, kw = normalize_inputs(args, kwargs)
    inc, exc = spec.include, spec.exclude
    meta = _build_meta(model, a, kw, spec, target.modules)  # fingerprint inputs before the forward can mutate them
    path, dcap = distcap.for_record(golden_path(path), per_rank)  # a multi-rank run: this rank's golden
    if dcap is not None:
        meta["distributed"] = dcap.meta()
    rule = grad_api.RecordGradients.loss_for(spec, target)  # gradients: None without backward
    if dcap is not None:
        distcap.refuse_sharded_backward(model, rule is not None)
    fingerprinter = Fingerprinter.for_spec(spec)  # its worker thread starts with the first leaf it takes
    writer = GoldenWriter(path, compression=spec.compression)  # a bad path fails before the forward
    try:
        shadow = (calmod.ShadowRun(model, a, kw, inc, exc, envmod.model_device(model, a, kw), grad=spec.grad,
                                   backward=rule)
                  if spec.calibrate else None)
    except BaseException:
        writer.abort()
        raise
    floors = calmod.FloorTable()
    rec = Recorder(writer, inputs=spec.inputs, shadow=shadow, floors=floors, fingerprinter=fingerprinter,
                   transform=None if dcap is None else dcap.convert)
    grads = None if rule is None else grad_api.RecordGradients(rule, writer, shadow, calmod.FloorTable(),
                                                               wanted=lambda n: selected(n, inc, exc))
    on_enter, on_output = (rec.on_enter, rec.on_output) if grads is None else grads.callbacks(rec.on_enter,
                                                                                                 rec.on_output)
    before = buffers.versions(target.modules)
    try:
        with hooked(target, on_output, inc, exc, on_enter=on_enter, on_abandon=rec.on_abandon) as state:
            out = run_forward(target, a, kw, state, grad=spec.grad or grads is not None)
        state_notes = buffers.updated_note(target.modules, before)
        if not writer.calls:
            raise nothing_selected(inc, exc, [n for n, _ in model.named_modules()])
        if grads is not None:  # gradients: the one backward, after the forward
            meta[grad_api.META_KEY] = grads.run(model, out, a, kw)
            out = grad_api.detached(out)
        meta["layer_calls"] = len(writer.calls)
        meta.update(meta_entry(fingerprinter))
        if shadow is not None:
            floors.info = {"reference_device": str(shadow.device)}
            if shadow.differs:  # leaves whose float64 copy computes another function (calibrate.differs_note)
                floors.info[calmod.DIFFERS_KEY] = [[n, c, r] for n, c, r in shadow.differs]
            meta[calmod.META_KEY] = floors.to_meta()
        writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
    finally:
        if grads is not None:
            grads.capture.close()
        if shadow is not None:
            shadow.close()
        if fingerprinter is not None:
            fingerprinter.close()
    return RecordSummary(
        path=writer.path, layer_calls=len(writer.calls), leaves=writer.nleaves, nbytes=writer.nbytes,
        file_bytes=os.path.getsize(writer.path), names=rec.names, output=out, fingerprints=writer.nfingerprints,
        notes=state_notes + ([] if fingerprinter is None else [f"fingerprint pattern {p!r} matched no layer"
                                                               for p in fingerprinter.unmatched()]),
        gradients=len(writer.backward),
    )


def compare(
    model: Model,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    path: str | os.PathLike[str],
    rtol: float | None = None,
    atol: float | None = None,
    tolerances: Mapping[str, Any] | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    fail_fast: bool = False,
    rename: Mapping[str, str] | None = None,
    allow_dtype_change: bool = False,
    tolerance: str = "strict",
    grad: bool = False,
    placements: Mapping[str, Any] | None = None,
    replay: str = "first",
    backward: Any = None,
    where: str | Sequence[str] | None = None,
    metric: str | None = None,
) -> Report:
    """Run the model with hooks and compare every layer call against the golden at ``path``.

    ``metric`` (``"sqnr"``, ``"cosine"``, ``"mse"``, ``"rel_l2"``) also measures every float output's
    error by that metric (shown per layer); a ``tolerances`` pattern with ``min_sqnr_db`` judges its
    layers by SQNR instead of element-wise (an SQNR gate for quantized models: docs/quantization.md).

    The first diverged calls get the shape of their divergence (``LeafResult.where``: per
    dimension where the mismatches lie, a common factor, offset, permutation or sign flips, and a
    heatmap grid); ``where`` (layer globs) asks for it on those layers' diverged calls too.

    ``tolerance="calibrated"`` judges each float output against both runs' noise floors
    (measured with float64 shadow forwards) instead of fixed rtol/atol; the golden must have
    been recorded with ``calibrate=True``. See docs/cross-device.md.

    ``replay`` re-runs layers on the golden's recorded inputs: ``"first"`` (default) the first
    diverging call, to tell whether the layer itself changed or inherited the difference
    (``report.origin``); ``"all"`` every call, judging each by its own error (immune to drift
    across devices and precisions); ``"off"``. See :mod:`activation_guard.replay.replay`.

    Gradients are compared whenever the golden has them (``backward=None``): the forward first,
    then one backward with the golden's loss; when every forward output matches, the first
    diverging gradient in backward order is the first divergence. A golden recorded with a custom
    loss needs that function again (``backward=<fn>``); ``backward=False`` compares the forward only.

    ``model`` may also be an exported program (an ``ExportedProgram``, the path of a ``.pt2``
    file, ``ep.module()``, a PT2E model or any ``GraphModule`` whose nodes carry
    ``nn_module_stack``): it runs node by node and each eager module call is compared on the
    values leaving its scope; what cannot be compared is named in a note with the reason.

    Comparison streams: each layer's golden is read when that layer returns, and compared while
    its output is still as the layer produced it. Memory stays near one layer's worth of data.

    In a torch.distributed run (docs/distributed.md) each rank compares with its own per-rank
    golden (``<golden>.rank<r>-of-<w>.h5``) when one exists, else with the single-device golden at
    ``path``: then ``DTensor`` outputs are compared as full tensors, and ``placements``
    (``{glob: Shard(dim) | Replicate()}``) says how plain local shards are placed, so they are
    gathered and compared too.
    """
    spec = CompareSpec.build(dict(
        rtol=rtol, atol=atol, tolerances=tolerances, include=include, exclude=exclude, fail_fast=fail_fast,
        rename=rename, allow_dtype_change=allow_dtype_change, tolerance=tolerance, grad=grad, replay=replay,
        placements=placements, backward=backward, where=where, metric=metric))
    return compare_spec(model, args, kwargs, path=path, spec=spec)


def _judge(spec: CompareSpec, resolver: ToleranceResolver, gmeta: Mapping[str, Any], path: Any,
           model: torch.nn.Module, a: tuple[Any, ...], kw: dict[str, Any], dev: torch.device,
           backward: Any = None) -> Judge:
    strict = judge_for(spec, resolver)
    if not spec.calibrated:
        return strict
    floors = calmod.FloorTable.from_meta(gmeta, path)
    if backward is not None:
        grad_api.grad_floors(gmeta, path)  # refuse a golden without them before the float64 run
    shadow = calmod.ShadowRun(model, a, kw, spec.include, spec.exclude, dev, grad=spec.grad,
                              keep_model=spec.replay != "off", backward=backward)
    return calmod.CalibratedJudge(floors, shadow, strict)


def _replayer(spec: CompareSpec, reader: GoldenReader, judge: Judge, resolver: ToleranceResolver) -> Replayer | None:
    if spec.replay == "off":
        return None
    if isinstance(judge, calmod.CalibratedJudge):
        return Replayer(reader, judge.strict, grad=spec.grad, calibrated=judge, reference=judge.shadow.model)
    return Replayer(reader, judge if isinstance(judge, StrictJudge) else StrictJudge(resolver), grad=spec.grad)


@with_frozen_gc
def compare_spec(model: Model, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
                 path: str | os.PathLike[str], spec: CompareSpec) -> Report:
    """:func:`compare` with its options already in a :class:`CompareSpec` (the plugin's entry)."""
    graph = graph_api.as_graph(model)  # an exported program, a .pt2 file, a flattened graph: no modules to hook
    if graph is not None:
        a, kw = normalize_inputs(args, kwargs)
        return graph_api.compare_graph(*graph, a, kw, path=golden_path(path), spec=spec, report_meta=report_meta)
    target = check_model(model)
    model = target.root
    a, kw = normalize_inputs(args, kwargs)
    live_inputs = envmod.input_fingerprint(a, kw)
    live_modes = envmod.training_modes(model, target.modules)
    user_hooks = hook_notes(target)  # before ours are added
    dev = envmod.model_device(model, a, kw)
    judge: Judge | None = None
    # the golden this rank compares with (replay is off in a multi-rank run)
    path, dcap, spec = distcap.for_compare(golden_path(path), spec)
    grads: grad_api.CompareGradients | None = None
    reader = GoldenReader(path)
    try:
        gmeta = reader.meta
        golden_filter = None
        if spec.include is None and spec.exclude is None:
            if spec.rename:  # the golden's selection names golden layers: the comparator applies it
                golden_filter = Comparator.default_filter(gmeta, spec)
            else:  # layers the golden never stored are not "unexpected"
                spec = spec.with_selection(*recorded_selection(gmeta))
        gdev = envmod.recorded_device(gmeta)
        # the device model and the precision each op family really runs in, not only the device type
        live_info = envmod.device_info(dev)
        reduced = envmod.precision_change(gmeta.get("numerics"), gmeta.get("device"), envmod.numerics_flags(),
                                          live_info, envmod.different_device(gmeta.get("device"), live_info),
                                          envmod.op_families(type(m).__name__ for _, m in target.modules))
        resolver = ToleranceResolver(spec, golden_device=gdev, live_device=str(dev),
                                     other_model=envmod.other_model(gmeta.get("device"), live_info),
                                     reduced=None if reduced is None else reduced[0])
        refuse_fingerprinted_gate(spec, resolver, reader.calls, path)
        rule = grad_api.compare_rule(spec, gmeta, path, target)  # gradients: the golden's loss, or None
        if dcap is not None:
            distcap.refuse_sharded_backward(model, rule is not None)
        judge = _judge(spec, resolver, gmeta, path, model, a, kw, dev, backward=rule)
        inputs_raw = gmeta.get("inputs")
        recorded_inputs = inputs_raw if isinstance(inputs_raw, list) else None
        input_changes = envmod.describe_input_change(recorded_inputs, live_inputs)
        replaced = envmod.inputs_replaced(recorded_inputs, live_inputs)
        comp = Comparator(reader, spec, judge, golden_filter=golden_filter,
                          transform=None if dcap is None else dcap.convert,
                          replayer=_replayer(spec, reader, judge, resolver),
                          inputs=LiveInputs(changed=bool(input_changes), replaced=replaced is True,
                                            unverified=replaced is None,
                                            objects_changed=envmod.objects_changed(recorded_inputs, live_inputs)),
                          partial_selection=partial_selection(spec, target, golden_filter))
        grads = None if rule is None else grad_api.CompareGradients(rule, reader, spec, judge, comp.live_to_golden,
                                                                    path, golden_filter)
        on_enter, on_output = (comp.on_enter, comp.on_output) if grads is None else grads.callbacks(comp.on_enter,
                                                                                                      comp.on_output)
        stopped = False
        out = None
        before = buffers.versions(target.modules)
        try:
            with hooked(target, on_output, spec.include, spec.exclude, on_enter=on_enter,
                        want_rng=comp.replayer is not None) as state:
                if comp.replayer is not None:
                    comp.replayer.state = state
                out = run_forward(target, a, kw, state, grad=spec.grad or grads is not None)
        except StopForward:
            stopped = True
        state_notes = buffers.updated_note(target.modules, before)
        if grads is not None and not stopped:  # gradients: the one backward, after the forward
            grads.run(model, out, a, kw)
            out = grad_api.detached(out)
        layers, order = comp.finish()
        origin = comp.replay_origin()
        if not layers:
            raise nothing_selected(spec.include, spec.exclude, [n for n, _ in model.named_modules()])
        if stopped:  # golden-only calls after the stop were never reached: not "missing"; those
            # the golden ran before a call the live run did reach are (their place is finite)
            keep = [i for i, layer in enumerate(layers)
                    if layer.status != "missing" or math.isfinite(order.get(i, (math.inf, 0))[0])]
            order = {k: order[i] for k, i in enumerate(keep) if i in order}
            layers = [layers[i] for i in keep]
        notes = judge.notes() + comp.notes() + ([] if comp.replayer is None else comp.replayer.notes())
        notes += grad_api.skipped_note(spec, gmeta)
        if grads is not None:  # gradients: rows after the forward's, attribution, notes
            layers, order = grads.rows(layers, order)
            notes += grads.notes(stopped)
    finally:
        if grads is not None:
            grads.capture.close()
        reader.close()
        if judge is not None:
            judge.close()
    env_changes = envmod.describe_env_change(gmeta.get("numerics"), envmod.numerics_flags())
    env_changes += envmod.describe_device_change(gmeta.get("device"), live_info)
    env_changes += envmod.describe_version_change(gmeta.get("versions"), envmod.versions())
    if reduced is not None:
        env_changes.append(reduced[1])
    report = Report(
        path=path, layers=layers, golden_meta=report_meta(gmeta), live_device=str(dev), input_changes=input_changes,
        env_changes=env_changes, stopped_early=stopped, output=out, _order=order, mode=spec.tolerance,
        origin=origin, replay=spec.replay, metric=spec.measured,
    )
    report.mode_changes = envmod.describe_training_change(gmeta, live_modes, modules=target.modules)
    if grads is not None and report.origin is None:  # gradients: where the backward changed
        report.origin = grads.origin(report.first_divergence, layers)
    if resolver.cross_device:
        report.notes.append(f"golden recorded on {gdev}, live run on {dev}: "
                            f"{resolver.device_pair} default tolerances apply")
    report.notes += selective_note(gmeta)
    report.notes += selection_notes(spec, resolver, layers)
    report.notes += notes
    report.notes += user_hooks
    report.notes += state_notes
    if dcap is not None:  # distributed: the report names the rank
        report.rank, report.world_size = dcap.info.rank, dcap.info.world_size
        report.notes += dcap.notes()
    lowered_precision(report)
    return report


def _eps(dtype: str | None) -> float | None:
    t = getattr(torch, dtype, None) if dtype else None
    if not isinstance(t, torch.dtype) or not (t.is_floating_point or t.is_complex):
        return None
    return torch.finfo(t).eps


def _lowered(report: Report) -> tuple[str, str] | None:
    """(golden dtype, live dtype) of an output the live run computed in a lower precision than
    the golden's (bfloat16 against float32), the first divergence's first; None when none did."""
    fd = report.first_divergence
    rows = ([] if fd is None else [fd]) + report._judged_leafwise()
    for layer in rows:
        for leaf in layer.leaves:
            g, live = _eps(leaf.dtype), _eps(leaf.live_dtype)
            if g is not None and live is not None and live > g:
                return str(leaf.dtype), str(leaf.live_dtype)
    return None


def lowered_precision(report: Report) -> None:
    """A failing strict compare of a lower-precision run (``allow_dtype_change``: bfloat16 against
    a float32 golden): its rounding changes every layer, and a replay on the golden's inputs, run
    in the lower precision, differs from the golden by that rounding too. So the origin does not
    claim a code change (a layer's own computation, a parent's code between its children) that
    the rounding explains as well, and a note points to the rule that can tell them apart."""
    if report.ok or report.mode != "strict":
        return
    pair = _lowered(report)
    if pair is None:
        return
    golden, live = pair
    hint = (f"tolerance=\"calibrated\" (a golden recorded with calibrate=True) allows for {live} rounding "
            f"layer by layer and still finds real changes")
    o = report.origin
    # an origin that names code (a layer's own, a parent's between its children), even as one of two
    # possibilities, is one the rounding explains as well
    if o is not None and o.names_code:
        where = "its own computation differs on the golden's inputs" if o.kind == "layer" else o.detail
        o.detail = (f"{where}, which {live} rounding of that code can explain as well (the live run computes in "
                    f"{live} against a {golden} golden): strict tolerances cannot tell a code change from rounding "
                    f"here; see the note on tolerance=\"calibrated\"")
        o.kind, o.maybe_code = "unknown", True
    report.notes.insert(0, f"the live run computes in {live}, the golden in {golden}: strict tolerances judge "
                           f"{live} rounding as divergence; {hint}")


def partial_selection(spec: CompareSpec, target: Target, golden_filter: Any) -> bool:
    """Whether some module of the model is left out of the comparison (``replay="all"`` cannot then
    vouch for the code between the selected layers)."""
    if golden_filter is not None:
        return True
    if spec.include is None and spec.exclude is None:
        return False
    names = [layer_name(n) for n, _ in target.modules]
    wanted = Selector(spec.include, spec.exclude, names)
    return not all(wanted(n) for n in names)


def selection_notes(spec: CompareSpec, resolver: ToleranceResolver, layers: Sequence[LayerResult]) -> list[str]:
    """Patterns that matched no layer (a typo would otherwise select or loosen nothing, silently),
    and a ``parent.*`` tolerances pattern that misses the failing ``parent`` itself."""
    names = [r.name for r in layers]
    out = [f"tolerances pattern {p!r} matched no layer" for p in resolver.unmatched(names)]
    for option in ("include", "exclude"):
        pats = spec.given.get(option) and getattr(spec, option)  # patterns the user gave, not the golden's
        out += [f"{option} pattern {p!r} matched no layer" for p in unmatched(pats, names)]
    failing = next((r for r in layers if not r.ok and r.status in ("diverged", "nonfinite")), None)
    if failing is not None:
        hint = parent_hint(failing.name, [r.pattern for r in spec.tolerances], names)
        if hint is not None:
            out.append(hint)
    return out


def golden_path(path: Any) -> str:
    """A golden's path as given: ``str``, ``bytes`` or ``os.PathLike``; anything else is refused."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str, bytes or os.PathLike naming a golden file, got {type(path).__name__}")
    return os.fsdecode(path)


def report_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The golden meta a report keeps: everything but the bulky per-output calibration floors."""
    out = dict(meta)
    cal = out.get(calmod.META_KEY)
    if isinstance(cal, Mapping):
        out[calmod.META_KEY] = {k: v for k, v in cal.items() if k != "floors"}
    bwd = out.get(grad_api.META_KEY)  # gradients: their floors too
    if isinstance(bwd, Mapping) and isinstance(bwd.get(grad_api.CALIBRATION_KEY), Mapping):
        out[grad_api.META_KEY] = {**bwd, grad_api.CALIBRATION_KEY: {
            k: v for k, v in bwd[grad_api.CALIBRATION_KEY].items() if k != "floors"}}
    return out


def compare_models(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Report:
    """Refactor verification without files on disk: where does ``candidate`` depart from
    ``reference`` on the same inputs? The reference is recorded to a temporary golden (bounded
    memory, same code path as a stored golden) and the candidate compared against it, both
    starting from the same random state (a training-mode model draws the same numbers)."""
    spec = CompareSpec.build(options, ARGUMENT)
    # with `rename` the patterns name candidate layers: record all of the reference's
    sel = (None, None) if spec.rename else (spec.include, spec.exclude)
    rspec = RecordSpec.build(dict(include=sel[0], exclude=sel[1], calibrate=spec.calibrated, grad=spec.grad,
                                  backward=spec.backward or None))
    with tempfile.TemporaryDirectory(prefix="activation_guard-") as d:
        p = os.path.join(d, "reference.h5")
        # the reference runs on its own copy: a forward that changes its inputs in place must
        # not hand the candidate different inputs
        a, kw = normalize_inputs(args, kwargs)
        # per_rank=False: a private file holding full values, so a parallel candidate is compared
        # with it as with a single-device golden
        # both models start from one random state: a training-mode Dropout draws the same mask
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda else None)
        record_spec(reference, clone_inputs(a), clone_inputs(kw), path=p, spec=rspec, per_rank=False)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        report = compare_spec(candidate, args, kwargs, path=p, spec=spec)
    report.path = f"<reference {type(reference).__name__}>"
    return report


def read_golden(path: str | os.PathLike[str]) -> GoldenReader:
    """Open a golden for reading (validated; use as a context manager)."""
    return GoldenReader(golden_path(path))  # which refuses a golden without a metadata record

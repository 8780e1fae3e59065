"""Exported programs, ``.pt2`` files and flattened FX graphs, compared per eager module call.

:func:`as_graph` tells a model hooks can see (an eager module, an unflattened exported program, a
symbolically traced module calling its submodules) from a flattened graph whose module calls live
only in its nodes' ``nn_module_stack``; :func:`compare_graph` drives the comparator from a
:class:`~activation_guard.graphs.source.GraphSource` and builds the report as
:func:`~activation_guard.api.run.compare` does. The user never chooses: ``compare`` and ``record``
pick hooks where modules exist and the graph where they do not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from .._core.errors import UnsupportedModelError
from ..capture import env as envmod
from ..comparison.comparator import Comparator
from ..comparison.golden_selection import recorded_selection, selective_note
from ..gradients.loss import META_KEY as BACKWARD_KEY
from ..graphs.replay import replay_scope
from ..graphs.source import GUARDS, STACK, GraphSource, Scope, has_module_stack, type_name
from ..judges.metrics import judge_for, refuse_fingerprinted_gate
from ..options.selection import Selector, nothing_selected
from ..options.spec import CompareSpec, RecordSpec
from ..options.tolerances import ToleranceResolver
from ..report.report import Report
from ..results import LayerResult, Origin
from ..store import CallEntry, GoldenReader, GoldenWriter
from .replays import ScopeReplays

NO_METADATA_FIX = ("export it with torch.export.export(model, args) and pass the ExportedProgram, its .module() or "
                   "the .pt2 file, or keep nn_module_stack when transforming a graph (copy node.meta to the nodes a "
                   "pass creates)")


def _is_pt2(obj: Any) -> bool:
    return isinstance(obj, (str, os.PathLike))


def maybe_graph(model: Any) -> bool:
    """Whether ``model`` is a form :func:`as_graph` reads (cheap: nothing is loaded or checked)."""
    return _is_pt2(model) or isinstance(model, (torch.export.ExportedProgram, fx.GraphModule))


def as_graph(model: Any) -> tuple[fx.GraphModule, str] | None:
    """The flattened graph to run node by node, and what it is (for notes and errors); None for a
    model whose module calls hooks can see. A path is read as a ``.pt2`` exported program; a
    ``GraphModule`` with no module stack on any node and no submodule to hook is refused."""
    label = "graph"
    if _is_pt2(model):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise UnsupportedModelError(f"model {path!r} is not a file: a path names an exported program saved with "
                                        f"torch.export.save (.pt2)")
        try:
            model = torch.export.load(path)
        except Exception as e:
            raise UnsupportedModelError(f"model {path!r} could not be loaded as an exported program "
                                        f"(torch.export.load: {type(e).__name__}: {e})") from e
        label = f"exported program {os.path.basename(path)}"
    if isinstance(model, torch.export.ExportedProgram):
        label = "exported program" if label == "graph" else label
        model = model.module()
    if not isinstance(model, fx.GraphModule):
        return None
    if any(n.op == "call_module" and n.target != GUARDS for n in model.graph.nodes):
        return None  # a traced module that still calls its submodules (symbolic_trace): hooks see them
    if has_module_stack(model):
        return model, label if label != "graph" else "graph module"
    raise UnsupportedModelError(
        f"{type(model).__name__}: a torch.fx.GraphModule with no nn_module_stack on any node and no submodule it "
        f"calls: "
        f"its values cannot be named by the eager modules that computed them; {NO_METADATA_FIX}")


def root_type(gm: fx.GraphModule) -> str:
    """The eager root module's class name, as the graph's module stacks record it."""
    for node in gm.graph.nodes:
        for path, mtype in (node.meta.get(STACK) or {}).values():
            if path == "":
                return type_name(mtype)
    return type(gm).__name__


def _device(gm: fx.GraphModule, args: tuple[Any, ...]) -> torch.device:
    for t in [*args, *gm.parameters(), *gm.buffers()]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _parent(scope: Scope) -> str:
    """The module call a scope's code runs in (its stack's previous entry; the root's is "")."""
    for node in scope.nodes:
        paths = [p for p, _ in (node.meta.get(STACK) or {}).values()]
        if scope.path in paths:
            i = paths.index(scope.path)
            return paths[i - 1] if i > 0 else ""
    return ""


def _type_of(scope: Scope, path: str) -> str:
    for node in scope.nodes:
        for p, mtype in (node.meta.get(STACK) or {}).values():
            if p == path:
                return type_name(mtype)
    return ""


class GraphReplays(ScopeReplays):
    """Replays of module calls of a graph (``replay="first"``: the first diverging call; ``"all"``:
    every compared call, its own error beside its accumulated one), run while the call's live
    values are still at hand, and the origin they give."""

    def __init__(self, gm: fx.GraphModule, source: GraphSource, comp: Comparator, reader: GoldenReader,
                 golden: Callable[[str, int], CallEntry | None], mode: str, inputs_same: bool):
        super().__init__(comp, golden, source.mapped, mode)
        self.gm, self.source, self.reader, self.inputs_same = gm, source, reader, inputs_same
        self.memo: dict[fx.Node, bool] = {}

    def after(self, scope: Scope, env: Mapping[fx.Node, Any]) -> None:
        def run(entry: CallEntry) -> dict[str, torch.Tensor] | str:
            mapped = self.source.mapped[(scope.path, scope.call)]
            return replay_scope(self.gm, scope, env, entry, mapped, self.reader.load, self.reader.resolve,
                                self.source.golden_of.get, self.inputs_same, self.memo)

        judged = self.judge_alone(scope.path, scope.call, run)
        if judged is None:
            return
        res, own, first = judged
        if own.status != "match":
            self.first = Origin(res.name, res.call, "layer", own.max_abs_diff, type_name=res.type_name,
                                detail="re-run on the golden's values, the graph's nodes of this module call differ: "
                                       "its own computation changed")
        elif first:
            parent = _parent(scope)
            self.first = Origin(parent, 0, "parent-code", own.max_abs_diff, child=res.name,
                                type_name=self.source.root_type if parent == "" else _type_of(scope, parent),
                                detail=f"re-run on the golden's values, {res.name!r} computes the same: its inputs "
                                       f"differ, made by code of {parent or 'the model'!r} outside any compared module "
                                       f"call (the graph's nodes of that scope, or a call not comparable)")

    def origin(self, first_divergence: LayerResult | None) -> Origin | None:
        if first_divergence is None or self.mode == "off":
            return None
        if self.first is None and first_divergence.name == "":  # every compared module call matches
            whole = [k for k in self.source.skipped if k.whole]
            if whole:
                return Origin("", 0, "unknown", type_name=first_divergence.type_name, maybe_code=True,
                              detail=f"every compared module call matches; the model's own code outside them, or a "
                                     f"module call that is not comparable ({', '.join(repr(k.name) for k in whole)}), "
                                     f"made the difference")
            return Origin("", 0, "layer", first_divergence.max_abs_diff, type_name=first_divergence.type_name,
                          detail="every module call matches: the model's own code outside them (the graph's nodes "
                                 "with no module call of their own) made the difference")
        return self.first


def compare_graph(gm: fx.GraphModule, label: str, a: tuple[Any, ...], kw: dict[str, Any], *, path: str,
                  spec: CompareSpec, report_meta: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Report:
    """Compare a flattened graph with the golden at ``path``, module call by module call."""
    if spec.calibrated:
        raise UnsupportedModelError(f"tolerance='calibrated' needs an eager model for its float64 shadow forward; "
                                    f"the {label} is compared with strict tolerances (or compare "
                                    f"torch.export.unflatten(ep), whose modules run in float64)")
    if spec.backward not in (None, False):
        raise UnsupportedModelError(f"backward=: gradients of a {label} are not captured per module call (its "
                                    f"graph is an inference graph without autograd nodes per module); compare the "
                                    f"eager model or torch.export.unflatten(ep) with backward=, or pass "
                                    f"backward=False")
    dev = _device(gm, a)
    live_inputs = envmod.input_fingerprint(a, kw)
    with GoldenReader(path) as reader:
        gmeta = reader.meta
        golden_filter = None
        if spec.include is None and spec.exclude is None:
            if spec.rename:
                golden_filter = Comparator.default_filter(gmeta, spec)
            else:
                spec = spec.with_selection(*recorded_selection(gmeta))
        gdev = envmod.recorded_device(gmeta)
        resolver = ToleranceResolver(spec, golden_device=gdev, live_device=str(dev))
        refuse_fingerprinted_gate(spec, resolver, reader.calls, path)
        comp = Comparator(reader, spec, judge_for(spec, resolver), golden_filter=golden_filter)
        inputs_raw = gmeta.get("inputs")
        input_changes = envmod.describe_input_change(inputs_raw if isinstance(inputs_raw, list) else None, live_inputs)
        comp.inputs_changed = bool(input_changes)

        def golden(name: str, call: int) -> Any:
            g = comp.live_to_golden.get(name)
            return None if g is None else reader.by_key.get((g, call))

        names = _names(gm)
        wanted = Selector(spec.include, spec.exclude, names)
        expected = [(comp.golden_to_live.get(c.name, c.name), c) for c in comp.golden_selected]
        source = GraphSource(gm, a, kw, golden, expected, wanted=wanted, label=label, root_type=root_type(gm))
        replays = GraphReplays(gm, source, comp, reader, golden, spec.replay, inputs_same=not input_changes)
        if spec.replay != "off":
            source.after = replays.after
        comp.consume(source)
        layers, order = comp.finish()
        if not layers:
            raise nothing_selected(spec.include, spec.exclude, names)
        stopped = source.output is None
        notes = [source.describe(), *source.notes(), *comp.notes()]
    if gmeta.get(BACKWARD_KEY) is not None and spec.backward is None:
        notes.append(f"the golden has gradients; the {label} is compared on its forward only (gradients need the "
                     f"eager model or torch.export.unflatten(ep))")
    env_changes = envmod.describe_env_change(gmeta.get("numerics"), envmod.numerics_flags())
    env_changes += envmod.describe_version_change(gmeta.get("versions"), envmod.versions())
    report = Report(path=path, layers=layers, golden_meta=report_meta(gmeta), live_device=str(dev),
                    input_changes=input_changes, env_changes=env_changes, stopped_early=stopped,
                    output=source.output, _order=order, mode=spec.tolerance, replay=spec.replay,
                    metric=spec.measured)
    report.origin = replays.origin(report.first_divergence)
    report.notes += notes
    report.notes += selective_note(gmeta)
    return report


def record_graph(gm: fx.GraphModule, label: str, a: tuple[Any, ...], kw: dict[str, Any], *, path: str,
                 spec: RecordSpec) -> dict[str, Any]:
    """Record a flattened graph's module calls to a golden at ``path``, with the eager layer names
    (the fields of :class:`~activation_guard.api.run.RecordSummary`). A call whose one value leaves
    its scope is stored as that tensor, as eager stores a one-tensor output; several values, as a
    tuple in graph order. The mode a graph runs in was fixed when it was exported: no mode is stored."""
    for given, why in ((spec.calibrate, "calibrate=True needs an eager model for its float64 shadow forward"),
                       (bool(spec.backward), "backward=: gradients per module call need the eager model (or "
                                             "torch.export.unflatten(ep), whose modules fire hooks)"),
                       (spec.fingerprint is not False, "fingerprint=: record the full values of a graph")):
        if given:
            raise UnsupportedModelError(f"recording the {label}: {why}")
    dev = _device(gm, a)
    wanted = Selector(spec.include, spec.exclude, _names(gm))
    source = GraphSource(gm, a, kw, lambda name, call: None, (), wanted=wanted, label=label, root_type=root_type(gm))
    writer = GoldenWriter(path, compression=spec.compression)
    names: list[str] = []
    try:
        for c in source.calls():
            if c.name == "" and not wanted(""):
                continue
            writer.add_call(c.name, c.call, c.type_name, c.leaves())
            if c.call == 0:
                names.append(c.name)
        if not writer.calls:
            raise nothing_selected(spec.include, spec.exclude, _names(gm))
        meta = {"versions": envmod.versions(), "device": envmod.device_info(dev), "model_class": _root_class(gm),
                "inputs": envmod.input_fingerprint(a, kw), "numerics": envmod.numerics_flags(),
                "layer_inputs": False, "include": None if spec.include is None else list(spec.include),
                "exclude": None if spec.exclude is None else list(spec.exclude), "layer_calls": len(writer.calls),
                "source": source.describe()}
        writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
    notes = [f"recorded from the {label}: the mode it runs in was fixed at export and is not stored"]
    if spec.inputs:
        notes.append(f"layer inputs are not recorded from the {label} (its values have no eager argument names): "
                     f"a compare against this golden cannot replay layers")
    return dict(path=writer.path, layer_calls=len(writer.calls), leaves=writer.nleaves, nbytes=writer.nbytes,
                file_bytes=os.path.getsize(writer.path), names=names, output=source.output, notes=notes)


def _names(gm: fx.GraphModule) -> list[str]:
    return sorted({p for n in gm.graph.nodes for p, _ in (n.meta.get(STACK) or {}).values()} | {""})


def _root_class(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        for p, mtype in (node.meta.get(STACK) or {}).values():
            if p == "":
                return mtype if isinstance(mtype, str) else f"{mtype.__module__}.{mtype.__qualname__}"
    return f"{type(gm).__module__}.{type(gm).__qualname__}"

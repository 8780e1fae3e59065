"""``sensitivity()``: which layers of a quantized model lose the most signal, which to keep in float.

One compare with ``replay="all"`` and the metric judge measures every module call's accumulated
and own error against the float golden (:mod:`activation_guard.quantization.analysis` ranks them
and advises); with a ``quantize(model, skip)`` callable and the float ``reference`` model the
advice is checked in closed loop: the model is quantized again without the advised modules,
without as many random ones and without the last ones, and each end-to-end SQNR is measured.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._core.errors import GoldenError, OptionError
from .._core.metrics import METRICS, Energy, Metric, total
from ..capture.hooks import normalize_inputs
from ..judges.metrics import energy_of, measurable
from ..options.spec import ARGUMENT, CompareSpec
from ..quantization import analysis as an
from ..report.sensitivity import SensitivityReport
from ..store import GoldenReader
from ..values.leaves import flatten
from ..values.rebuild import clone_inputs
from . import graph as graph_api
from .run import Model, compare_spec, golden_path

Quantize = Callable[[torch.nn.Module, set[str]], torch.nn.Module | None]


def sensitivity(
    model: Model,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    path: str | os.PathLike[str],
    metric: str = "sqnr",
    explain: float = 0.9,
    keep: int | None = None,
    quantize: Quantize | None = None,
    reference: torch.nn.Module | None = None,
    draws: int = 10,
    seed: int = 0,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
) -> SensitivityReport:
    """Rank the module calls of a quantized (or cast, or otherwise compressed) ``model`` by their
    own error against the float golden at ``path`` (recorded from the float model with inputs,
    the default), and advise which modules to keep in float.

    Each row has ``sqnr_db`` (its output against the golden, accumulated), ``own_sqnr_db`` (the
    module re-run on the golden's float inputs: its own error) and ``error_share``; ``metric``
    (``"sqnr"``, ``"cosine"``, ``"mse"``, ``"rel_l2"``) chooses what the rows are ranked by.
    ``keep_in_float`` names the fewest compressed modules whose own errors explain ``explain``
    of the total (or the ``keep`` largest). With ``quantize(model, skip) -> model`` and the float
    ``reference``, the advice is checked: quantized again without the advised modules, without
    ``keep`` random ones (median of ``draws``, seeded) and without the last ones in execution
    order (``report.closed_loop``); ``quantize`` gets a copy of ``reference`` and may return it
    quantized, or None having quantized it in place. ``model`` may also be an exported or PT2E
    graph.
    """
    if metric not in METRICS:
        raise OptionError("metric", metric, ARGUMENT, f"must be one of {', '.join(map(repr, METRICS))}")
    if isinstance(explain, bool) or not isinstance(explain, (int, float)) or not 0 < explain <= 1:
        raise OptionError("explain", explain, ARGUMENT, "must be a number in (0, 1]: the share of the summed own "
                                                        "errors the advised modules must explain")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        raise OptionError("keep", keep, ARGUMENT, "must be a whole number >= 0 of modules to advise, or None")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise OptionError("draws", draws, ARGUMENT, "must be a whole number >= 1")
    if quantize is not None and not callable(quantize):
        raise OptionError("quantize", quantize, ARGUMENT, "must be a callable quantize(model, skip: set[str]) -> model")
    if quantize is not None and not isinstance(reference, torch.nn.Module):
        raise OptionError("reference", reference, ARGUMENT, "the closed loop (quantize=) quantizes the float model "
                                                            "again: pass it as reference=")
    m: Metric = metric  # type: ignore[assignment]
    p = golden_path(path)
    with GoldenReader(p) as reader:
        if reader.meta.get("layer_inputs") is False:
            raise GoldenError(p, "it was recorded without each layer call's inputs (inputs=False): sensitivity re-runs "
                                 "every module on the golden's inputs to measure its own error",
                              "re-record it from the float model with inputs=True (the default)")
        if reader.fingerprinted:
            raise GoldenError(p, "it stores some outputs as fingerprints: an SQNR, and a replay on the golden's "
                                 "inputs, need the values", "re-record it from the float model without fingerprint=")
    spec = CompareSpec.build(dict(replay="all", metric=m, allow_dtype_change=True, include=include,
                                  exclude=exclude))
    a, kw = normalize_inputs(args, kwargs)
    report = compare_spec(model, clone_inputs(a), clone_inputs(kw), path=p, spec=spec)
    graph = graph_api.as_graph(model)
    if graph is None and isinstance(model, torch.nn.Module):
        quantized, left = an.compressed_modules(model)
        compressed: set[str] | None = set(quantized)
        names = [n for n, _ in model.named_modules()]
    else:  # a graph's modules are gone: every measured call is a candidate
        quantized, left, compressed, names = {}, [], None, []
    rows = an.rows_of(report.layers, m, compressed)
    advice = an.advise(rows, explain=float(explain), keep=keep)
    root = next((r for r in report.layers if r.name == "" and r.call == 0), None)
    out_energy = None if root is None else an.accumulated(root)
    notes = list(report.notes)  # what the compare could not do (calls not replayed, and why), as it said it
    if report.input_changes:  # own errors are still measured on the golden's inputs; accumulated ones are not
        notes.insert(0, "the model's inputs differ from the recording's (" + "; ".join(report.input_changes[:2]) +
                     "): each accumulated SQNR compares outputs of other inputs and means nothing; own SQNRs are "
                     "re-runs on the golden's inputs and stand")
    unreplayed = [r for r in rows if r.own_sqnr_db is None]
    if unreplayed:
        notes.append(f"{len(unreplayed)} module call(s) have no own error (not replayed: see the notes above); "
                     f"they are ranked last and never advised")
    if compressed is not None and not compressed:
        notes.append("no module of the model has a compressed parameter (a tensor subclass, or a reduced dtype): "
                     "nothing to advise; is this the quantized model?")
    if compressed is None:
        notes.append("the model is a graph: which modules were quantized is not known, so every measured module "
                     "call is a candidate for the advice")
    result = SensitivityReport(
        path=p, rows=rows, keep_in_float=advice, keep_in_float_globs=an.keep_globs(advice, names) if names else advice,
        metric=m, explain=float(explain), output_sqnr_db=None if out_energy is None else out_energy.sqnr_db(),
        not_quantized=left, quantized=quantized, notes=notes)
    if quantize is not None and reference is not None and not advice:
        notes.append("closed loop skipped: nothing is advised to keep in float")
    elif quantize is not None and reference is not None:
        result.closed_loop = closed_loop(quantize, reference, a, kw, p, rows, advice, compressed, draws, seed)
    return result


def closed_loop(quantize: Quantize, reference: torch.nn.Module, a: tuple[Any, ...], kw: dict[str, Any], path: str,
                rows: Sequence[an.SensitivityRow], advice: Sequence[str], compressed: set[str] | None, draws: int,
                seed: int) -> an.ClosedLoop:
    """The advice checked end to end (:class:`~activation_guard.quantization.analysis.ClosedLoop`)."""
    golden = golden_output(path)
    first: dict[str, int] = {}  # module -> its first call's place in execution order
    for r in rows:
        first[r.name] = min(first.get(r.name, r.position or 0), r.position or 0)
    candidates = [n for n in sorted(first, key=lambda n: first[n])
                  if (n in compressed if compressed is not None else n != "")]
    k = len(advice)

    def sqnr(skip: Sequence[str]) -> float:
        fresh = copy.deepcopy(reference)
        model = quantize(fresh, set(skip))
        if model is None:  # a quantizer that works in place (torchao's quantize_ returns None)
            model = fresh
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"quantize(model, skip) must return the quantized model (or None, having quantized "
                            f"the model it was given in place), got {type(model).__name__}")
        with torch.no_grad():
            out = model(*clone_inputs(a), **clone_inputs(kw))
        e = output_energy(golden, out)
        return e.sqnr_db()

    baseline = sqnr(())
    advised = sqnr(advice)
    random_draws = [sqnr(s) for s in an.draw_random(candidates, k, draws, seed)]
    last = candidates[len(candidates) - k:] if k else []
    return an.ClosedLoop(k=k, advised=list(advice), baseline_sqnr_db=baseline, advised_sqnr_db=advised,
                         random_sqnr_db=an.median(random_draws), last=last, last_sqnr_db=sqnr(last),
                         random_draws=random_draws)


def golden_output(path: str) -> dict[str, torch.Tensor]:
    """The golden's model output (its root call's float tensors, by output path)."""
    with GoldenReader(path) as reader:
        entry = reader.by_key.get(("", 0))
        if entry is None:
            raise ValueError(f"golden {path}: it has no call of the model itself (recorded with include/exclude?): "
                             f"the closed loop measures the model's output against it")
        out = {}
        for g in entry.leaves:
            g = reader.resolve(g)
            if g.kind == "tensor":
                out[g.path] = reader.load(g, f"the model's output {g.path!r}")
        return out


def output_energy(golden: Mapping[str, torch.Tensor], out: Any) -> Energy:
    """The pooled error energy of a model output against the golden's output tensors."""
    live = {leaf.path: leaf.tensor for leaf in flatten(out, fields=True)
            if leaf.kind == "tensor" and leaf.tensor is not None}
    found = []
    for p, g in golden.items():
        t = live.get(p)
        if t is not None and tuple(t.shape) == tuple(g.shape) and measurable(g) and measurable(t):
            found.append(energy_of(g, t))
    e = total(found)
    if e is None:
        raise ValueError("the quantized model's output has no float tensor at the paths of the golden's output")
    return e

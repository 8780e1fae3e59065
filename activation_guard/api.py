"""The plain Python API: record, compare, compare_models. Everything else is glue over these."""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import calibrate as calmod
from . import env as envmod
from .capture import (
    Leaf,
    check_model,
    flatten,
    hooked,
    normalize_inputs,
    normalize_patterns,
    nothing_selected,
    run_forward,
    selected,
)
from .compare import LayerResult, LeafResult, compare_tensors, dtype_name, leaf_from_stats
from .dtypes import BY_NAME, tensor_bytes, tensor_from_bytes
from .errors import ActivationGuardError
from .report import Report
from .store import CallEntry, GoldenReader, GoldenWriter, LeafEntry
from .tolerances import DTYPE_DEFAULTS, Tolerance, ToleranceResolver

# precision rank for allow_dtype_change: the lower precision's tolerance applies
_PRECISION = {"float64": 4, "float32": 3, "float16": 2, "bfloat16": 1}


@dataclass
class RecordSummary:
    """What :func:`record` wrote."""

    path: str
    layer_calls: int
    leaves: int
    nbytes: int  # raw bytes of all stored tensors
    file_bytes: int
    names: list[str] = field(default_factory=list)
    output: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "layer_calls": self.layer_calls, "leaves": self.leaves, "nbytes": self.nbytes, "file_bytes": self.file_bytes}

    def __str__(self) -> str:
        return (f"activation_guard: recorded {self.layer_calls} layer calls ({self.leaves} outputs, "
                f"{self.nbytes / 1e6:.3g} MB of values) to {self.path} ({self.file_bytes / 1e6:.3g} MB)")


class _StopForward(Exception):
    """Raised from a hook to end the forward early (fail_fast)."""


# --------------------------------------------------------------------------- record


def _build_meta(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], include: Any, exclude: Any) -> dict[str, Any]:
    dev = envmod.model_device(model, args, kwargs)
    m = type(model)
    meta: dict[str, Any] = {
        "versions": envmod.versions(),
        "device": envmod.device_info(dev),
        "model_class": f"{m.__module__}.{m.__qualname__}",
        "training": bool(model.training),
        "inputs": envmod.input_fingerprint(args, kwargs),
        "numerics": envmod.numerics_flags(),
        "include": include,
        "exclude": exclude,
    }
    return meta


def record(
    model: torch.nn.Module,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    path: str | os.PathLike[str],
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    compression: str | None = None,
    calibrate: bool = False,
) -> RecordSummary:
    """Run ``model(*args, **kwargs)`` once and write every layer's outputs to a golden.

    ``calibrate=True`` also runs a float64 copy of the model and stores each output's noise
    floor (its error against float64) in the meta under ``"calibration"``, which
    ``compare(..., tolerance="calibrated")`` needs. See docs/cross-device.md.

    The write is atomic: the golden at ``path`` is replaced only after the new one is complete,
    so an error or a kill mid-forward leaves the previous golden as it was.
    """
    model = check_model(model)
    a, kw = normalize_inputs(args, kwargs)
    inc = normalize_patterns(include, "include")
    exc = normalize_patterns(exclude, "exclude")
    meta = _build_meta(model, a, kw, inc, exc)  # fingerprint inputs before the forward can mutate them
    shadow = calmod.ShadowRun(model, a, kw, inc, exc, envmod.model_device(model, a, kw)) if calibrate else None
    floors = calmod.FloorTable()
    try:
        writer = GoldenWriter(path, compression=compression)
    except BaseException:
        if shadow is not None:
            shadow.close()
        raise
    names: list[str] = []

    def on_output(name: str, call: int, module: torch.nn.Module, output: Any) -> None:
        try:
            leaves = flatten(output)
            writer.add_call(name, call, type(module).__name__, leaves)
            if shadow is not None:
                shadow.measure(name, call, leaves, floors)
        except ActivationGuardError:
            raise
        except Exception as e:
            raise ActivationGuardError(f"recording layer {name or '<root>'!r} call {call} failed: {e}") from e
        if call == 0:
            names.append(name)

    try:
        with hooked(model, on_output, inc, exc) as state:
            out = run_forward(model, a, kw, state)
        if not writer.calls:
            raise nothing_selected(inc, exc, [n for n, _ in model.named_modules()])
        meta["layer_calls"] = len(writer.calls)
        if shadow is not None:
            floors.info = {"reference_device": str(shadow.device)}
            meta[calmod.META_KEY] = floors.to_meta()
        writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
    finally:
        if shadow is not None:
            shadow.close()
    return RecordSummary(
        path=writer.path, layer_calls=len(writer.calls), leaves=writer.nleaves, nbytes=writer.nbytes,
        file_bytes=os.path.getsize(writer.path), names=names, output=out,
    )


# --------------------------------------------------------------------------- rename


def _compile_rename(rename: Mapping[str, str] | None) -> list[tuple[re.Pattern[str], str]]:
    rules = []
    for src, dst in (rename or {}).items():
        if not isinstance(src, str) or not isinstance(dst, str):
            raise TypeError(f"rename maps golden names to live names (str -> str), got {src!r}: {dst!r}")
        if any(c in src for c in "*?"):
            rx = "".join("(.*)" if c == "*" else "(.)" if c == "?" else re.escape(c) for c in src)
            nstar = src.count("*") + src.count("?")
            if dst.count("*") + dst.count("?") not in (0, nstar):
                raise ValueError(f"rename[{src!r}]: the target {dst!r} must use as many wildcards as the pattern")
            k = iter(range(1, nstar + 1))
            repl = "".join(f"\\g<{next(k)}>" if c in "*?" else c.replace("\\", "\\\\") for c in dst)
            rules.append((re.compile(rx + r"\Z"), repl))
        else:  # prefix rule on whole dotted components
            rules.append((re.compile(re.escape(src) + r"(?=\.|\Z)"), dst.replace("\\", "\\\\")))
    return rules


def apply_rename(name: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for rx, repl in rules:
        m = rx.match(name)
        if m:
            new = m.expand(repl) + name[m.end():]
            return new.strip(".") if new.startswith(".") or new.endswith(".") else new
    return name


# --------------------------------------------------------------------------- compare


class _Comparator:
    """Compares each live layer call against its golden as soon as the layer returns."""

    calib: Any = None  # a calibrate.Calibrator in tolerance="calibrated" mode
    # (include, exclude) the golden was recorded with, by golden name: a live layer outside it
    # was never stored, so it is not "unexpected" (set when the hooks cannot apply it: rename)
    golden_filter: tuple[list[str] | None, list[str] | None] | None = None

    def __init__(self, reader: GoldenReader, resolver: ToleranceResolver, rules: list[tuple[re.Pattern[str], str]],
                 include: list[str] | None, exclude: list[str] | None, fail_fast: bool, allow_dtype_change: bool):
        self.reader = reader
        self.resolver = resolver
        self.fail_fast = fail_fast
        self.allow_dtype_change = allow_dtype_change
        self.results: list[LayerResult] = []
        self.seen: set[tuple[str, int]] = set()
        self.live_to_golden: dict[str, str] = {}
        self.golden_calls: dict[str, int] = {}
        for c in reader.calls:
            live = apply_rename(c.name, rules)
            prev = self.live_to_golden.get(live)
            if prev is not None and prev != c.name:
                raise ValueError(f"rename maps golden layers {prev!r} and {c.name!r} both to {live!r}")
            self.live_to_golden[live] = c.name
            self.golden_calls[c.name] = max(self.golden_calls.get(c.name, 0), c.call + 1)
        self.golden_selected = [c for c in reader.calls if selected(apply_rename(c.name, rules), include, exclude)]
        self.golden_to_live = {g: live for live, g in self.live_to_golden.items()}

    def on_output(self, name: str, call: int, module: torch.nn.Module, output: Any) -> None:
        self.on_leaves(name, call, type(module).__name__, lambda: flatten(output))

    def on_leaves(self, name: str, call: int, tname: str, get_leaves: Callable[[], list[Leaf]]) -> None:
        """Compare one layer call given its flattened outputs. Shared by the live hooks and by
        ``activation_guard.diff`` (two recordings), so both produce the same verdicts; ``get_leaves``
        runs only when the golden has this call."""
        pos = len(self.results)
        # a live name no golden name maps to is new, even if a golden layer had that name
        # before `rename` mapped it elsewhere
        gname = self.live_to_golden.get(name)
        entry = None if gname is None else self.reader.by_key.get((gname, call))
        if entry is None:
            if self.golden_filter is not None and not selected(gname or name, *self.golden_filter):
                return
            known = None if gname is None else self.golden_calls.get(gname)
            detail = (f"the golden has {known} call(s) of this layer; this is call {call}" if known
                      else "this layer is not in the golden (new layer, or renamed: see `rename=`)")
            res = LayerResult(name, call, "unexpected", tname, position=pos, detail=detail)
        else:
            assert gname is not None  # an entry was found under it
            self.seen.add((gname, call))
            leaves = self._compare_call(entry, get_leaves(), name)
            res = LayerResult.from_leaves(name, call, tname, leaves, position=pos, golden_position=entry.position,
                                          golden_name=gname if gname != name else None)
            if entry.type_name and entry.type_name != tname and res.ok:
                res.detail = f"module type changed {entry.type_name} -> {tname} (values still match)"
        self.results.append(res)
        if self.fail_fast and not res.ok:
            raise _StopForward

    def _tolerance(self, name: str, gdt: str, ldt: str) -> Tolerance:
        kind = "float"
        info = BY_NAME.get(gdt)  # (a function-level import here cost ~2 us per layer call)
        if info is not None:
            kind = info.kind
        if gdt != ldt and self.allow_dtype_change and _PRECISION.get(gdt) and _PRECISION.get(ldt):
            low = gdt if _PRECISION[gdt] < _PRECISION[ldt] else ldt
            tol = self.resolver.resolve(name, low, "float")
            return Tolerance(tol.rtol, tol.atol, tol.source + f" (dtype change {gdt}->{ldt})")
        return self.resolver.resolve(name, gdt, kind)

    def _compare_call(self, entry: CallEntry, leaves: list[Leaf], name: str) -> list[LeafResult]:
        live = {leaf.path: leaf for leaf in leaves}
        results: list[LeafResult] = []
        gpaths = {g.path for g in entry.leaves}
        for g in entry.leaves:
            lv = live.get(g.path)
            if lv is None:
                results.append(LeafResult(g.path, "structure", f"{_out(g.path)} ({_kind(g)}) is missing from the live output"))
                continue
            results.append(self._compare_leaf(g, lv, name, entry.call))
        for leaf in leaves:
            if leaf.path not in gpaths:
                results.append(LeafResult(leaf.path, "structure", f"{_out(leaf.path)} ({leaf.type_name}) is new in the live output"))
        return results

    def _compare_leaf(self, g: LeafEntry, lv: Leaf, name: str, call: int) -> LeafResult:
        p = g.path
        if g.kind != lv.kind:
            return LeafResult(p, "structure", f"{_out(p)} was {_kind(g)}, is now {lv.type_name}")
        if g.kind == "none":
            return LeafResult(p, "match")
        if g.kind == "object":
            if g.type_name != lv.type_name:
                return LeafResult(p, "structure", f"{_out(p)} type changed {g.type_name} -> {lv.type_name}")
            return LeafResult(p, "match", f"{g.type_name} object: recorded by type only")
        if g.kind == "str":
            if g.value != lv.value:
                return LeafResult(p, "diverged", f"{_out(p)} {g.value!r} -> {lv.value!r}")
            return LeafResult(p, "match")
        t = lv.tensor
        assert t is not None and g.dtype is not None
        ldt = dtype_name(t)
        lshape = tuple(int(s) for s in t.shape)
        if lshape != g.shape:
            return LeafResult(p, "shape", f"{_out(p)} shape {list(g.shape)} -> {list(lshape)}",
                              dtype=g.dtype, live_dtype=ldt, shape=g.shape, live_shape=lshape, numel=g.numel)
        if ldt != g.dtype and not (self.allow_dtype_change and _PRECISION.get(ldt) and _PRECISION.get(g.dtype)):
            return LeafResult(p, "dtype", f"{_out(p)} dtype {g.dtype} -> {ldt}",
                              dtype=g.dtype, live_dtype=ldt, shape=g.shape, live_shape=lshape, numel=g.numel)
        label = f"layer {name!r} call {call} output {p!r}"
        if g.pack is not None and ldt == g.dtype and self.calib is None and t.device.type == "cpu":
            # small leaves (thousands of tiny layers): settle the common bit-identical case with
            # one memcmp of the stored bytes against the live ones, before building any tensor
            graw = self.reader.packed_bytes(g, label)
            if graw.tobytes() == tensor_bytes(t).tobytes():
                return _identical_leaf(g, t, self._tolerance(name, g.dtype, ldt))
            golden = tensor_from_bytes(graw.copy(), BY_NAME[g.dtype], g.shape)
        else:
            golden = self.reader.load(g, label)
        if self.calib is not None:
            cres = self.calib.judge(self.live_to_golden.get(name, name), name, call, p, golden, t, g.dtype, ldt)
            if cres is not None:
                return cres
        tol = self._tolerance(name, g.dtype, ldt)
        if ldt != g.dtype:
            golden, t = golden.float(), t.float()
        exact = tol.rtol == 0 and tol.atol == 0 and g.dtype not in DTYPE_DEFAULTS
        st = compare_tensors(golden, t, tol.rtol, tol.atol, exact=exact)
        res = leaf_from_stats(p, g.dtype, ldt, g.shape, st, tol.rtol, tol.atol, tol.source)
        if ldt != g.dtype:
            res.detail = (res.detail + "; " if res.detail else "") + f"dtype {g.dtype} -> {ldt} allowed (compared in float32)"
        return res

    def finish(self) -> tuple[list[LayerResult], dict[int, tuple[float, int]]]:
        results = list(self.results)
        order: dict[int, tuple[float, int]] = {}
        # place each missing call where the live run passed its spot in the golden order
        live_gpos = [(r.golden_position, r.position) for r in results
                     if r.golden_position is not None and r.position is not None]
        for c in self.golden_selected:
            if (c.name, c.call) in self.seen:
                continue
            later = [lp for gp, lp in live_gpos if gp is not None and lp is not None and gp > c.position]
            at = float(min(later)) - 0.5 if later else math.inf
            ran = self.golden_calls.get(c.name, 0)
            live_name = self.golden_to_live.get(c.name, c.name)
            made = sum(1 for r in results if r.name == live_name)
            detail = (f"the live run made {made} call(s) of this layer; the golden has {ran}" if made
                      else "this layer did not run (removed, renamed, or skipped by control flow)")
            lr = LayerResult(live_name, c.call, "missing", c.type_name, golden_position=c.position, detail=detail,
                             golden_name=c.name if c.name != live_name else None)
            order[len(results)] = (at, c.position)
            results.append(lr)
        return results, order


def _recorded_patterns(value: Any) -> list[str] | None:
    """include/exclude patterns stored in a golden's meta (ignored unless a list of strings)."""
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return list(value)
    return None


def _golden_filter(gmeta: Mapping[str, Any], rules: list[tuple[re.Pattern[str], str]]) -> tuple[list[str] | None, list[str] | None] | None:
    """The golden's recorded include/exclude, each pattern also under `rename` (for live layers
    that have no golden counterpart), or None when it recorded every layer."""
    pats = [_recorded_patterns(gmeta.get("include")), _recorded_patterns(gmeta.get("exclude"))]
    if pats == [None, None]:
        return None
    inc, exc = (None if p is None else p + [r for r in (apply_rename(x, rules) for x in p) if r not in p] for p in pats)
    return inc, exc


def _identical_leaf(g: LeafEntry, t: torch.Tensor, tol: Tolerance) -> LeafResult:
    """The result compare_tensors gives for bit-identical tensors, without running it."""
    assert g.dtype is not None
    first = t.reshape(-1)[0].item() if g.numel else None
    return LeafResult(
        g.path, "match", dtype=g.dtype, live_dtype=g.dtype, shape=g.shape, live_shape=g.shape,
        numel=g.numel, max_abs_diff=0.0, max_rel_diff=0.0,
        index=tuple(0 for _ in g.shape) if g.numel else None, golden_value=first, live_value=first,
        rtol=tol.rtol, atol=tol.atol, tolerance_source=tol.source,
    )


def _out(path: str) -> str:
    """How a report names an output leaf: the bare output, or the one at a path inside it."""
    return f"output {path}" if path else "the output"


def _kind(g: LeafEntry) -> str:
    if g.kind == "tensor":
        return f"a {g.dtype} tensor"
    return g.type_name or g.kind


def compare(
    model: torch.nn.Module,
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
) -> Report:
    """Run the model with hooks and compare every layer call against the golden at ``path``.

    ``tolerance="calibrated"`` judges each float output against both runs' noise floors
    (measured with float64 shadow forwards) instead of fixed rtol/atol; the golden must have
    been recorded with ``calibrate=True``. See docs/cross-device.md.

    Comparison streams: each layer's golden is read when that layer returns, and compared while
    its output is still as the layer produced it. Memory stays near one layer's worth of data.
    """
    model = check_model(model)
    a, kw = normalize_inputs(args, kwargs)
    inc = normalize_patterns(include, "include")
    exc = normalize_patterns(exclude, "exclude")
    live_inputs = envmod.input_fingerprint(a, kw)
    dev = envmod.model_device(model, a, kw)
    if tolerance not in ("strict", "calibrated"):
        raise ValueError(f"tolerance must be 'strict' or 'calibrated', got {tolerance!r}")
    calib: Any = None
    reader = GoldenReader(path)
    try:
        gmeta = reader.meta
        if inc is None and exc is None and not rename:
            # default to the selection the golden was recorded with: layers it never stored are
            # not "unexpected" (its patterns name golden layers, hence not under `rename`)
            inc, exc = _recorded_patterns(gmeta.get("include")), _recorded_patterns(gmeta.get("exclude"))
        gdev = envmod.recorded_device(gmeta)
        resolver = ToleranceResolver(rtol, atol, tolerances, golden_device=gdev, live_device=str(dev))
        rules = _compile_rename(rename)
        comp = _Comparator(reader, resolver, rules, inc, exc, fail_fast, allow_dtype_change)
        if inc is None and exc is None and rename:  # the golden's selection, applied by the comparator
            comp.golden_filter = _golden_filter(gmeta, rules)
        if tolerance == "calibrated":
            calib = calmod.Calibrator(calmod.FloorTable.from_meta(gmeta, path), calmod.ShadowRun(model, a, kw, inc, exc, dev))
            comp.calib = calib
        stopped = False
        out = None
        with hooked(model, comp.on_output, inc, exc) as state:
            try:
                out = run_forward(model, a, kw, state)
            except _StopForward:
                stopped = True
        layers, order = comp.finish()
        if not layers:
            raise nothing_selected(inc, exc, [n for n, _ in model.named_modules()])
        if stopped:  # golden-only calls after the stop were never reached: not "missing"; those
            # the golden ran before a call the live run did reach are (their place is finite)
            keep = [i for i, layer in enumerate(layers)
                    if layer.status != "missing" or math.isfinite(order.get(i, (math.inf, 0))[0])]
            order = {k: order[i] for k, i in enumerate(keep) if i in order}
            layers = [layers[i] for i in keep]
    finally:
        reader.close()
        if calib is not None:
            calib.close()
    env_changes = envmod.describe_env_change(gmeta.get("numerics"), envmod.numerics_flags())
    env_changes += envmod.describe_device_change(gmeta.get("device"), envmod.device_info(dev))
    env_changes += envmod.describe_version_change(gmeta.get("versions"), envmod.versions())
    inputs_raw = gmeta.get("inputs")
    report = Report(
        path=os.fspath(path), layers=layers, golden_meta=gmeta, live_device=str(dev),
        input_changes=envmod.describe_input_change(inputs_raw if isinstance(inputs_raw, list) else None, live_inputs),
        env_changes=env_changes, stopped_early=stopped, output=out, _order=order,
    )
    if resolver.cross_device:
        report.notes.append(f"golden recorded on {gdev}, live run on {dev}: {resolver.device_pair} default tolerances apply")
    report.notes += [f"tolerances pattern {p!r} matched no layer" for p in resolver.unmatched(r.name for r in layers)]
    report.mode = tolerance
    if calib is not None:
        report.notes += calib.notes()
    return report


def compare_models(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Report:
    """Refactor verification without files on disk: where does ``candidate`` depart from
    ``reference`` on the same inputs? The reference is recorded to a temporary golden (bounded
    memory, same code path as a stored golden) and the candidate compared against it."""
    include, exclude = options.get("include"), options.get("exclude")
    if options.get("rename"):  # the patterns name candidate layers: record all the reference's
        include = exclude = None
    with tempfile.TemporaryDirectory(prefix="activation_guard-") as d:
        p = os.path.join(d, "reference.h5")
        record(reference, args, kwargs, path=p, include=include, exclude=exclude,
               calibrate=options.get("tolerance") == "calibrated")
        report = compare(candidate, args, kwargs, path=p, **options)
    report.path = f"<reference {type(reference).__name__}>"
    return report


def read_golden(path: str | os.PathLike[str]) -> GoldenReader:
    """Open a golden for reading (validated; use as a context manager)."""
    return GoldenReader(path)  # which refuses a golden without a metadata record

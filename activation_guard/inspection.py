"""Look inside a golden without running a model: metadata, per-leaf statistics, textconv.

``inspect`` answers "what did this golden record, on what, and do the values look sane?" (a
column of NaN counts finds a NaN-producing layer at a glance). ``textconv`` renders the same
information as one stable line per output for git's diff driver, so a re-recorded golden shows
up in ``git diff`` as the layers whose values changed instead of "Binary files differ".

Statistics are computed with numpy in float64 over the finite values, chunk by chunk, so they
are deterministic for given bytes (no thread-count dependent reductions) and memory stays near
one chunk beyond the leaf itself. Complex leaves are summarised by their magnitude ``|z|``.
"""

from __future__ import annotations

import hashlib
import math
import os
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from . import dtypes
from .fingerprint import Fingerprint
from .fingerprint_judge import gamma
from .results import json_number
from .selection import match_any
from .store import FORMAT_VERSION, CallEntry, GoldenReader, LeafEntry
from .store.fingerprints import encode as fingerprint_bytes

CHUNK = 1 << 20


@dataclass
class LeafStats:
    """Summary of one stored tensor. min/max/mean/std ignore NaN and +-Inf (counted apart).

    ``fingerprint``: the statistics come from a fingerprint (exact float64 sums over the finite
    values; for complex tensors over the real and imaginary parts, not ``|z|``), and ``sha256``
    is that of the stored fingerprint, not of the values."""

    numel: int
    nonfinite: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    sha256: str = ""
    fingerprint: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("min", "max", "mean", "std"):
            d[k] = json_number(d[k])
        return d


@dataclass
class LeafInfo:
    """One output leaf of one recorded layer call, as ``inspect`` shows it."""

    layer: str
    call: int
    type_name: str
    position: int
    path: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    value: str | None = None  # str leaves, or the type name of an object leaf
    stats: LeafStats | None = None
    section: str = "forward"  # gradients (issue 14): "grad-output", "grad-input" or "param-grad"
    py: str | None = None  # a str leaf's stored type when not str (dtype, device, an enum, bytes, int)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "layer": self.layer, "call": self.call, "type": self.type_name, "position": self.position,
            "path": self.path, "kind": self.kind, "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape), "value": self.value,
            "stats": None if self.stats is None else self.stats.to_dict(),
        }
        if self.section != "forward":
            d["section"] = self.section
        if self.py is not None:
            d["py"] = self.py
        return d

    @property
    def shown_path(self) -> str:
        """The path as tables show it; gradients say which gradient they are."""
        if self.section == "grad-output":
            return "grad wrt output" + (f" {self.path}" if self.path else "")
        if self.section == "grad-input":
            return f"grad wrt input {self.path}"
        if self.section == "param-grad":
            return f"param grad {self.path}"
        return path_str(self.path)


@dataclass
class GoldenInfo:
    """Everything ``inspect`` reports about one golden."""

    path: str
    file_bytes: int
    meta: dict[str, Any]
    layer_calls: int
    leaves: list[LeafInfo] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "format_version": FORMAT_VERSION, "file_bytes": self.file_bytes,
            "layer_calls": self.layer_calls, "meta": self.meta, "leaves": [x.to_dict() for x in self.leaves],
        }


def tensor_stats(t: torch.Tensor) -> LeafStats:
    """Deterministic float64 statistics and a SHA-256 of the exact stored bytes."""
    raw = dtypes.tensor_bytes(t)
    st = LeafStats(numel=int(t.numel()), sha256=hashlib.sha256(raw.tobytes()).hexdigest())
    if st.numel == 0:
        return st
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = flat.abs()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    n = 0
    mean = 0.0
    m2 = 0.0
    lo, hi = math.inf, -math.inf
    for i in range(0, st.numel, CHUNK):
        a = flat[i : i + CHUNK].to(torch.float64).numpy()
        fin = np.isfinite(a)
        k = int(fin.sum())
        st.nonfinite += a.size - k
        if k == 0:
            continue
        if k != a.size:
            a = a[fin]
        cm = float(a.mean())
        cm2 = float(((a - cm) ** 2).sum())
        lo, hi = min(lo, float(a.min())), max(hi, float(a.max()))
        # Chan et al. parallel update: stable merge of chunk moments
        tot = n + k
        delta = cm - mean
        mean += delta * k / tot
        m2 += cm2 + delta * delta * n * k / tot
        n = tot
    if n:
        st.min, st.max, st.mean, st.std = lo, hi, mean, math.sqrt(m2 / n)
    return st


def fingerprint_stats(fp: Fingerprint) -> LeafStats:
    """The statistics a fingerprint holds, shaped like :func:`tensor_stats`'s (std from the exact
    sums: ``sqrt(sum x^2 / n - mean^2)``). Where that difference is below the float64 rounding of
    the sums (values far from zero that vary little: 1e4 +- 1e-4), the std cannot be known from
    them and is left unknown (``None``), never shown as 0."""
    st = LeafStats(numel=fp.numel, nonfinite=fp.nonfinite, fingerprint=True,
                   sha256=hashlib.sha256(fingerprint_bytes(fp)).hexdigest())
    n = fp.count
    if n:
        mean = fp.sum / n
        st.min, st.max, st.mean = fp.min, fp.max, mean
        var = fp.sq_sum / n - mean * mean
        noise = 4 * gamma(fp.depth + 2) * (fp.sq_sum / n + abs(mean) * fp.abs_sum / n + mean * mean)
        st.std = 0.0 if fp.min == fp.max else (math.sqrt(var) if var > noise else None)
    return st


SECTIONS = {"output": "grad-output", "input": "grad-input", "param": "param-grad"}


def _leaf_info(reader: GoldenReader, c: CallEntry, leaf: LeafEntry, with_stats: bool) -> LeafInfo:
    info = LeafInfo(c.name, c.call, c.type_name, c.position, leaf.path, leaf.kind)
    if c.grad is not None:  # gradients (issue 14): positions continue after the forward's
        info.section = SECTIONS[c.grad]
        info.position = len(reader.calls) + c.position
        if leaf.kind == "alias":  # the same values as a gradient stored before: shown as what they are
            leaf = reader.resolve(leaf, f"layer {c.name!r} call {c.call} {c.grad} gradient {leaf.path!r}")
            info.kind = leaf.kind
    if leaf.kind == "fingerprint":
        info.dtype, info.shape = leaf.dtype, leaf.shape
        if with_stats:
            info.stats = fingerprint_stats(reader.fingerprint(leaf, f"layer {c.name!r} call {c.call} output "
                                                                    f"{leaf.path!r}"))
    elif leaf.kind == "tensor":
        info.dtype, info.shape = leaf.dtype, leaf.shape
        if with_stats:
            t = reader.load(leaf, f"layer {c.name!r} call {c.call} output {leaf.path!r}")
            info.stats = tensor_stats(t)
    elif leaf.kind == "str":
        info.value = leaf.value
        if leaf.type_name not in ("", "str"):
            info.py = leaf.type_name
    elif leaf.kind == "object":
        info.value = leaf.type_name
    return info


def iter_leaves(reader: GoldenReader, layer: str | Sequence[str] | None = None,
                with_stats: bool = True) -> Iterator[LeafInfo]:
    """Leaves in golden execution order, optionally only layers matching the glob(s) ``layer``.

    One leaf's values are loaded at a time, so inspecting a large golden needs little memory.
    """
    pats = [layer] if isinstance(layer, str) else list(layer or [])
    for c in [*reader.calls, *reader.backward]:  # gradients (issue 14) after the forward, in backward order
        if pats and not match_any(c.name, pats):
            continue
        for leaf in c.leaves:
            yield _leaf_info(reader, c, leaf, with_stats)


def inspect_golden(path: str | os.PathLike[str], layer: str | Sequence[str] | None = None) -> GoldenInfo:
    """Read a golden's metadata and every (selected) leaf with statistics."""
    with GoldenReader(path) as reader:
        gi = GoldenInfo(os.fspath(path), reader.file_size, reader.meta, len(reader.calls))
        gi.leaves = list(iter_leaves(reader, layer))
    return gi


# --------------------------------------------------------------------------- text


def num(x: float | None, digits: int = 6) -> str:
    """Compact, platform-stable number formatting for tables and textconv."""
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def shape_str(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "[" + ",".join(str(s) for s in shape) + "]"


def path_str(path: str) -> str:
    return path if path else "(output)"


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def meta_lines(meta: dict[str, Any]) -> list[str]:
    """The metadata a person checks first: what model, where, with which versions and flags."""
    out = []
    mode = ("training" if meta.get("training") else "eval") + " mode"
    odd = meta.get("training_differs")
    if isinstance(odd, list) and odd:
        other = "eval" if meta.get("training") else "training"
        n = meta.get("training_differs_count", len(odd))
        mode += f"; {n} module(s) in {other} mode: {', '.join(map(str, odd[:5]))}{', ...' if n > 5 else ''}"
    out.append(f"model class : {meta.get('model_class', '?')} ({mode})")
    dev: dict[str, Any] = meta["device"] if isinstance(meta.get("device"), dict) else {}
    extra = ", ".join(f"{k} {dev[k]}" for k in ("device_name", "cuda", "cudnn") if dev.get(k))
    out.append(f"device      : {dev.get('device', '?')}" + (f" ({extra})" if extra else ""))
    vers: dict[str, Any] = meta["versions"] if isinstance(meta.get("versions"), dict) else {}
    if vers:
        out += textwrap.wrap(", ".join(f"{k} {v}" for k, v in vers.items()), width=110,
                             initial_indent="versions    : ", subsequent_indent=" " * 14, break_on_hyphens=False)
    inputs: list[Any] = meta["inputs"] if isinstance(meta.get("inputs"), list) else []
    for i, inp in enumerate(inputs):
        head = "inputs      : " if i == 0 else "              "
        if not isinstance(inp, dict):
            continue
        desc = f"{inp.get('path', '?')}: "
        if inp.get("kind") == "tensor":
            desc += f"{inp.get('dtype')} {shape_str(tuple(inp.get('shape') or ()))}"
        else:
            desc += str(inp.get("type") or inp.get("kind"))
        if inp.get("sha256"):
            desc += f" sha256:{str(inp['sha256'])[:16]}"
        out.append(head + desc)
    num_flags: dict[str, Any] = meta["numerics"] if isinstance(meta.get("numerics"), dict) else {}
    if num_flags:
        out += textwrap.wrap(", ".join(f"{k}={v}" for k, v in num_flags.items()), width=110,
                             initial_indent="numerics    : ", subsequent_indent=" " * 14, break_on_hyphens=False)
    for k in ("include", "exclude"):
        if meta.get(k):
            out.append(f"{k:<12}: {meta[k]}")
    bwd = meta.get("backward")  # gradients (issue 14)
    if isinstance(bwd, dict):
        loss = (f"sum of each floating output times a seeded random cotangent (seed {bwd.get('seed')})"
                if bwd.get("loss") == "cotangent" else f"the custom loss {bwd.get('function', '?')}")
        cal = " (with float64 noise floors)" if isinstance(bwd.get("calibration"), dict) else ""
        out.append(f"backward    : loss = {loss}; {bwd.get('gradients', '?')} gradient records{cal}")
    fp = meta.get("fingerprint")
    if isinstance(fp, dict):
        layers = fp.get("layers")
        which = "every layer" if layers is True else f"layers {layers}"
        prm = fp.get("params") if isinstance(fp.get("params"), dict) else {}
        size = (f"; {prm.get('rows')} x {prm.get('buckets')} sketch, {prm.get('samples')} samples, false alarm "
                f"{prm.get('false_alarm')}, seed {prm.get('seed')}" if prm else "")
        out.append(f"fingerprint : {which}{size}")
    known = {"model_class", "training", "training_differs", "training_differs_count", "device", "versions", "inputs",
             "numerics", "include", "exclude", "layer_calls", "fingerprint",
             "backward"}
    for k in sorted(set(meta) - known):
        out.append(f"{k:<12}: {meta[k]}")
    return out


TABLE_COLUMNS = ("#", "layer", "call", "type", "path", "dtype", "shape", "min", "max", "mean", "std", "nonfinite")


def _row(x: LeafInfo) -> list[str]:
    s = x.stats
    if x.kind not in ("tensor", "fingerprint"):
        shown = x.value if x.kind == "str" else (x.value or x.kind)
        return [str(x.position + 1), x.layer or "<root>", str(x.call), x.type_name, x.shown_path, x.py or x.kind,
                "-", repr(shown)[:40] if x.kind == "str" else str(shown), "", "", "", ""]
    dtype = (x.dtype or "?") + (" (fp)" if x.kind == "fingerprint" else "")
    return [str(x.position + 1), x.layer or "<root>", str(x.call), x.type_name, x.shown_path, dtype,
            shape_str(x.shape), num(s.min if s else None, 4), num(s.max if s else None, 4),
            num(s.mean if s else None, 4), num(s.std if s else None, 4), str(s.nonfinite) if s else "-"]


def format_table(leaves: Sequence[LeafInfo]) -> list[str]:
    rows = [list(TABLE_COLUMNS)] + [_row(x) for x in leaves]
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(TABLE_COLUMNS))]
    right = {0, 2, 7, 8, 9, 10, 11}
    out = []
    for r in rows:
        cells = []
        for i, c in enumerate(r):
            c = c if len(c) <= widths[i] else "..." + c[-(widths[i] - 3):]
            cells.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        out.append("  ".join(cells).rstrip())
    return out


def format_inspect(gi: GoldenInfo, layer: str | Sequence[str] | None = None) -> str:
    lines = [f"golden      : {gi.path} ({gi.file_bytes / 1e6:.3g} MB, format version {FORMAT_VERSION}, "
             f"{gi.layer_calls} layer calls)"]
    lines += meta_lines(gi.meta)
    lines.append("")
    if not gi.leaves:
        lines.append(f"no layer matches {layer!r}" if layer else "the golden records no layer outputs")
        return "\n".join(lines)
    fwd = [x for x in gi.leaves if x.section == "forward"]
    calls = {(x.layer, x.call) for x in fwd}
    ngrad = len(gi.leaves) - len(fwd)  # gradients (issue 14)
    grads = f", then {ngrad} gradients in backward order" if ngrad else ""
    lines.append(f"{len(calls)} layer calls, {len(fwd)} outputs, in execution order{grads}"
                 + (f" (layers matching {layer!r})" if layer else "") + "; stats over finite values:")
    lines += format_table(gi.leaves)
    nfp = sum(1 for x in gi.leaves if x.kind == "fingerprint")
    if nfp:
        lines.append(f"(fp): {nfp} outputs stored as fingerprints, not values; their stats are the fingerprint's "
                     "exact float64 sums (complex: over real and imaginary parts)")
    nonfinite = [x for x in gi.leaves if x.stats and x.stats.nonfinite]
    if nonfinite:
        first = nonfinite[0]
        lines.append("")
        what = f"output {path_str(first.path)}" if first.section == "forward" else first.shown_path
        lines.append(f"first NaN/Inf in execution order: layer {first.layer or '<root>'!r} call {first.call} "
                     f"{what} ({first.stats.nonfinite if first.stats else 0} values)")
    return "\n".join(lines)


def textconv_lines(path: str | os.PathLike[str]) -> Iterator[str]:
    """Stable line-per-leaf rendering for ``git diff`` (see ``activation-guard textconv``).

    Only content goes into it (never the file name or size, which change with HDF5 layout), one
    leaf per line, so an unchanged layer is an unchanged line whatever happened elsewhere.
    """
    with GoldenReader(path) as reader:
        meta = reader.meta
        yield f"# activation_guard golden, format {FORMAT_VERSION}, {len(reader.calls)} layer calls"
        yield f"# model_class {meta.get('model_class', '?')} training={bool(meta.get('training'))}"
        dev = _dig(meta, "device", "device") or "?"
        yield f"# device {dev} torch {_dig(meta, 'versions', 'torch') or '?'}"
        for inp in meta.get("inputs") if isinstance(meta.get("inputs"), list) else []:
            if not isinstance(inp, dict):
                continue
            line = f"# input {inp.get('path', '?')} {inp.get('kind', '?')}"
            if isinstance(inp.get("shape"), list):
                line += f" {inp.get('dtype')} {shape_str(tuple(inp['shape']))}"
            elif inp.get("type"):
                line += f" {inp['type']}"
            if inp.get("sha256"):
                line += f" sha256:{str(inp['sha256'])[:16]}"
            yield line
        flags = meta.get("numerics") if isinstance(meta.get("numerics"), dict) else {}
        for k, v in sorted(flags.items()):  # one per line: a changed flag is one changed line
            yield f"# numerics {k}={v}"
        fp = meta.get("fingerprint")
        if isinstance(fp, dict) and isinstance(fp.get("params"), dict):
            yield f"# fingerprint params {' '.join(f'{k}={v}' for k, v in sorted(fp['params'].items()))}"
        for x in iter_leaves(reader):
            head = f"{x.layer or '<root>'}[{x.call}] {x.shown_path}"
            if x.section == "param-grad":
                head = f"{x.layer or '<root>'} {x.shown_path}"
            if x.kind in ("tensor", "fingerprint"):
                s = x.stats
                assert s is not None
                what = "fingerprint " if x.kind == "fingerprint" else ""
                yield (f"{head} {what}{x.dtype} {shape_str(x.shape)} sha256:{s.sha256[:16]} "
                       f"min={num(s.min)} max={num(s.max)} mean={num(s.mean)} std={num(s.std)} nonfinite={s.nonfinite}")
            elif x.kind == "str":
                yield f"{head} {x.py or 'str'} {x.value!r}"
            else:
                yield f"{head} {x.kind} {x.value or ''}".rstrip()

"""Golden inspection as text: the ``inspect`` table and the ``textconv`` lines for git.

:mod:`.inspection` computes what a golden holds (per-leaf statistics, metadata); this module
only renders it. The two are apart because the renderings change for readers (column layout,
wording) while the statistics must stay byte-stable for ``git diff``: a change to one should not
touch the other's tests.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

from ..store import GoldenReader
from .inspection import GoldenInfo, LeafInfo, iter_leaves, path_str
from .textfmt import safe_line


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
    bwd = meta.get("backward")  # gradients
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
    lines = [f"golden      : {gi.path} ({gi.file_bytes / 1e6:.3g} MB, format version {gi.format_version}, "
             f"{gi.layer_calls} layer calls)"]
    lines += meta_lines(gi.meta)
    lines.append("")
    if not gi.leaves:
        lines.append(f"no layer matches {layer!r}" if layer else "the golden records no layer outputs")
        return "\n".join(map(safe_line, lines))
    fwd = [x for x in gi.leaves if x.section == "forward"]
    calls = {(x.layer, x.call) for x in fwd}
    ngrad = len(gi.leaves) - len(fwd)  # gradients
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
    return "\n".join(map(safe_line, lines))


def textconv_lines(path: str | os.PathLike[str]) -> Iterator[str]:
    return map(safe_line, _textconv_lines(path))


def _textconv_lines(path: str | os.PathLike[str]) -> Iterator[str]:
    """Stable line-per-leaf rendering for ``git diff`` (see ``activation-guard textconv``).

    Only content goes into it (never the file name or size, which change with HDF5 layout), one
    leaf per line, so an unchanged layer is an unchanged line whatever happened elsewhere.
    """
    with GoldenReader(path) as reader:
        meta = reader.meta
        yield f"# activation_guard golden, format {reader.version}, {len(reader.calls)} layer calls"
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

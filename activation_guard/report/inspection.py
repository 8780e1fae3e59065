"""Look inside a golden without running a model: metadata, per-leaf statistics, textconv.

``inspect`` answers "what did this golden record, on what, and do the values look sane?" (a
column of NaN counts finds a NaN-producing layer at a glance). ``textconv`` renders the same
information as one stable line per output for git's diff driver, so a re-recorded golden shows
up in ``git diff`` as the layers whose values changed instead of "Binary files differ". This
module computes that information; :mod:`.inspect_text` renders both.

Statistics are computed with numpy in float64 over the finite values, chunk by chunk, so they
are deterministic for given bytes (no thread-count dependent reductions) and memory stays near
one chunk beyond the leaf itself. Complex leaves are summarised by their magnitude ``|z|``.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .._core import dtypes
from .._core.errors import GoldenError
from ..fingerprints.fingerprint import Fingerprint
from ..fingerprints.soundness import gamma
from ..judges.where import describe
from ..options.selection import display_name, match_any
from ..results import Heat, json_number
from ..store import CallEntry, GoldenReader, LeafEntry
from ..store.fingerprints import encode as fingerprint_bytes

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
    section: str = "forward"  # gradients: "grad-output", "grad-input" or "param-grad"
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
    format_version: int = 0  # the file's own (an older golden is read as it was written)
    damaged: list[str] = field(default_factory=list)  # stored values read past that fail their checks

    def to_dict(self) -> dict[str, Any]:
        out = {
            "path": self.path, "format_version": self.format_version, "file_bytes": self.file_bytes,
            "layer_calls": self.layer_calls, "meta": self.meta, "leaves": [x.to_dict() for x in self.leaves],
        }
        if self.damaged:
            out["damaged"] = list(self.damaged)
        return out


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
    if c.grad is not None:  # gradients: positions continue after the forward's
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
    for c in [*reader.calls, *reader.backward]:  # gradients after the forward, in backward order
        if pats and not match_any(c.name, pats):
            continue
        for leaf in c.leaves:
            yield _leaf_info(reader, c, leaf, with_stats)


def inspect_golden(path: str | os.PathLike[str], layer: str | Sequence[str] | None = None) -> GoldenInfo:
    """Read a golden's metadata and every (selected) leaf with statistics; what it does not show
    (the calls' stored inputs) is read and checked too, and damage found there is listed in
    ``damaged`` (a value that fails its checksum must not pass unnoticed because no table row shows it)."""
    with GoldenReader(path) as reader:
        gi = GoldenInfo(os.fspath(path), reader.file_size, reader.meta, len(reader.calls),
                        format_version=reader.version)
        gi.leaves = list(iter_leaves(reader, layer))
        gi.damaged = verify_values(reader, outputs=False)[1]
    return gi


def verify_values(reader: GoldenReader, *, outputs: bool = True) -> tuple[int, list[str]]:
    """Every stored value of a golden read and checked: each call's outputs (``outputs``), its
    inputs and its gradients; tensors and fingerprints against their checksums and index entries,
    aliases to what they name. Returns how many values were checked and one line per damaged one
    (the file's error, naming the file and the value); opening the golden checked its index tables."""
    checked, damaged = 0, []
    for c in [*reader.calls, *reader.backward]:
        what = "output" if c.grad is None else f"{c.grad} gradient"
        sections: list[tuple[str, Sequence[LeafEntry]]] = []
        if outputs or c.grad is not None:
            sections.append((what, c.leaves))
        try:
            sections.append(("input", c.inputs or []))
        except GoldenError as e:
            damaged.append(str(e))
        for section, leaves in sections:
            for leaf in leaves:
                where = f"layer {display_name(c.name)!r} call {c.call} {section} {leaf.path!r}"
                try:
                    target = reader.resolve(leaf, where)
                    if target.kind == "tensor":
                        reader.load(target, where)
                    elif target.kind == "fingerprint":
                        reader.fingerprint(target, where)
                    checked += 1
                except GoldenError as e:
                    damaged.append(str(e))
    return checked, damaged
def golden_heat(path: str | os.PathLike[str], layer: str) -> tuple[str, Heat]:
    """The heatmap grid of the first stored tensor of the first call of ``layer`` (a name or a
    glob), reduced to 2-D as a divergence's is: what ``inspect --plot`` draws. A ValueError says
    why there is none (no such layer, or it holds no values: a fingerprint, a non-tensor output)."""
    with GoldenReader(path) as reader:
        calls = [c for c in reader.calls if c.name == layer or match_any(c.name, [layer])]
        if not calls:
            raise ValueError(f"layer {layer!r} is not in the golden")
        for c in calls:
            for leaf in c.leaves:
                if leaf.kind == "tensor":
                    label = f"layer {c.name!r} call {c.call} output {leaf.path!r}"
                    t = reader.load(leaf, label)
                    heat = describe(t, t, 0.0, 0.0).heat
                    if heat is not None:
                        return f"{c.name or '<root>'}[{c.call}]" + (f" output {leaf.path}" if leaf.path else ""), heat
        kinds = sorted({leaf.kind for c in calls for leaf in c.leaves})
        raise ValueError(f"layer {layer!r} holds no stored tensor values to draw (its outputs: {', '.join(kinds)}; "
                         f"a fingerprint keeps no values)")


def path_str(path: str) -> str:
    return path if path else "(output)"

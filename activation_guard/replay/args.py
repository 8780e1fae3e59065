"""Which golden tensors a replay passes a call, and when its arguments differ in structure.

A replay re-runs a call on the inputs it received when the golden was recorded, placed where the
live call has its own. That is only the same call if the arguments line up: a tensor argument
dropped, added or turned into something else, or a changed dtype, device or enum argument, is the
caller's doing (:class:`ArgsChanged`), and attribution then names the caller. Other reasons a call
cannot be replayed (no recorded inputs, a fingerprinted input, a changed shape) are plain texts.
"""

from __future__ import annotations

import torch

from .._core import devices
from .._core.dtypes import tensor_bytes
from ..capture.hooks import Frame
from ..options.selection import display_name
from ..store import CallEntry, GoldenReader
from ..values.leaves import flatten_inputs
from ..values.paths import stored_by_repr
from .children import GoldenCache

PYTHON_NUMBERS = frozenset({"bool", "int", "float", "complex"})
NO_INPUTS = ("the golden has no recorded inputs (recorded with inputs=False, or before inputs were recorded): "
             "re-record it to replay layers and attribute divergences")


class ArgsChanged(str):
    """Why a call cannot be replayed on the golden's inputs: its arguments differ in structure from
    the golden's (a tensor argument dropped, added or retyped), which is its caller's doing."""


def string_changes(entry: CallEntry, frame: Frame) -> list[str]:
    """Plain string arguments that differ from the recorded call's. A replay passes them as given
    (a request id or a path may differ every run), so a call re-run on a changed ``mode="b"``
    differs, and the layer looks like its own code changed: the origin says which strings differ."""
    recorded = {e.path: e for e in entry.inputs or () if e.kind == "str" and not stored_by_repr(e.type_name)}
    if not recorded:
        return []
    out = []
    for lv in flatten_inputs(frame.args, frame.kwargs):
        g = recorded.get(lv.path)
        if g is not None and lv.kind == "str" and lv.value != g.value:
            out.append(f"{lv.path} {short(g.value)} -> {short(lv.value)}")
    return out


def golden_inputs(reader: GoldenReader, cache: GoldenCache, frame: Frame,
                  entry: CallEntry) -> dict[str, torch.Tensor] | str:
    """Golden tensors by input path, placed like the live ones, or why that is impossible."""
    if entry.inputs is None:
        return NO_INPUTS
    golden = {e.path: e for e in entry.inputs}
    out: dict[str, torch.Tensor] = {}
    live = flatten_inputs(frame.args, frame.kwargs)
    paths = {lv.path for lv in live}
    gone = [p for p, e in golden.items() if p not in paths and e.kind in ("tensor", "alias", "fingerprint")]
    if gone:
        return ArgsChanged(f"the golden's call had the tensor argument(s) {', '.join(gone)}, which the live call "
                           f"does not pass")
    live_by_path = {lv.path: lv for lv in live}
    for p, e in golden.items():
        # a dtype, device or enum argument: the replay passes the live one, so a change of it is
        # the caller's (plain strings are not judged: a request id or a path may differ every run)
        if e.kind == "str" and stored_by_repr(e.type_name):
            lv_ = live_by_path.get(p)
            now = None if lv_ is None else (lv_.value if lv_.kind == "str" else lv_.type_name)
            if lv_ is None or (lv_.kind, lv_.type_name, lv_.value) != ("str", e.type_name, e.value):
                return ArgsChanged(f"its argument {p} was {short(e.value)}, is now "
                                   f"{'absent' if lv_ is None else short(now)}")
    for lv in live:
        if lv.kind == "str" and stored_by_repr(lv.type_name) and lv.path not in golden:
            return ArgsChanged(f"its argument {lv.path} ({short(lv.value)}) is not in the golden's call")
        if lv.kind != "tensor" or lv.tensor is None:
            continue
        given = golden.get(lv.path)
        g = None if given is None else reader.resolve(
            given, f"layer {display_name(entry.name)!r} call {entry.call} input {lv.path!r}")
        if g is not None and g.kind == "fingerprint":
            return f"replay needs full inputs, but its input {lv.path} is stored as a fingerprint"
        if given is None or g is None or g.kind != "tensor":
            return ArgsChanged(f"its argument {lv.path} ({lv.type_name}) is not a tensor or number in the "
                               f"golden's call")
        if given.type_name != lv.type_name and PYTHON_NUMBERS.intersection((given.type_name, lv.type_name)):
            return ArgsChanged(f"its argument {lv.path} was a {given.type_name}, is now a {lv.type_name}")
        if g.shape != tuple(lv.tensor.shape):
            return f"its input {lv.path} changed shape {list(g.shape)} -> {list(lv.tensor.shape)}"
        t = cache.load(g, f"layer {display_name(entry.name)!r} call {entry.call} input {lv.path!r}")
        # a copy: the module may change it
        out[lv.path] = devices.golden_on(t, lv.tensor.device, lv.tensor.dtype, copy=True)
    return out


def short(text: str | None, limit: int = 60) -> str:
    """A value as a note shows it: its repr, cut to ``limit`` characters (notes had reached 19 KB)."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 1] + "\u2026"


def root_inputs_match(reader: GoldenReader, entry: CallEntry | None, frame: Frame) -> bool | None:
    """Whether the model's call received the golden's recorded inputs (``replay="all"``): every
    tensor argument bit-identical, or, where only the floating dtype changed, identical to the
    golden's value cast to the live dtype (the cross-precision case). None where it cannot be
    told (no recorded inputs, a fingerprinted one).

    ``replay="all"`` judges each call by its own computation on the golden's inputs, so it may
    only do that when the model's inputs are the recording's. The inputs' record in the meta is
    taken before the model's own forward pre-hooks run and holds no values to check a dtype
    change against; the root call's recorded inputs are what the forward got, with values.
    """
    if entry is None or entry.inputs is None:
        return None
    live = {lv.path: lv for lv in flatten_inputs(frame.args, frame.kwargs) if lv.kind == "tensor"}
    where = "the model's recorded inputs"
    for given in entry.inputs:
        if given.kind not in ("tensor", "alias", "fingerprint"):
            continue  # other arguments: the inputs' record in the meta compares them
        g = reader.resolve(given, where)
        lv = live.pop(given.path, None)
        if g.kind != "tensor":
            return None
        if lv is None or lv.tensor is None or tuple(lv.tensor.shape) != g.shape:
            return False
        t = lv.tensor.detach().cpu()
        golden = reader.load(g, where)
        if golden.dtype != t.dtype:
            if not (golden.is_floating_point() and t.is_floating_point()):
                return False
            golden = golden.to(t.dtype)
        if tensor_bytes(golden).tobytes() != tensor_bytes(t).tobytes():
            return False
    return not live  # a tensor argument the recording did not have

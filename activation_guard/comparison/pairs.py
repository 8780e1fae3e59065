"""Per-kind comparers: one function per kind of golden leaf (like torch.testing's pairs), chosen by
the comparator after the cases every kind shares (fingerprints on either side, objects older
goldens held by type, a leaf whose kind changed)."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .._core.dtypes import dtype_name
from ..distributed.transform import shard_verdict
from ..judges.strict import Judge, LeafContext, dtype_change_allowed
from ..options.spec import CompareSpec
from ..results import LeafResult, out_name
from ..store import CallEntry, LeafEntry
from ..values.leaves import Leaf


class PairHost(Protocol):
    """What a comparer needs of the comparator: the spec, and a stored tensor judged."""

    spec: CompareSpec

    def judge_tensor(self, ctx: LeafContext, g: LeafEntry, live: torch.Tensor, judge: Judge,
                     describe_it: bool) -> LeafResult: ...


def kind_name(g: LeafEntry) -> str:
    if g.kind == "tensor":
        return f"a {g.dtype} tensor" if g.type_name == "Tensor" else f"a {g.dtype} {g.type_name}"
    if g.kind == "ref":
        return f"a reference to output {g.value}"
    return g.type_name or g.kind



# One function per kind of golden leaf, like torch.testing's pairs: the golden and live leaves
# already have the same kind (the comparator settled fingerprints, legacy objects and kind changes).
PairFn = Callable[["PairHost", LeafEntry, Leaf, str, CallEntry, Judge, bool], LeafResult]


def none_pair(c: PairHost, g: LeafEntry, lv: Leaf, name: str, entry: CallEntry, judge: Judge,
              describe: bool = False) -> LeafResult:
    return LeafResult(g.path, "match")


def object_pair(c: PairHost, g: LeafEntry, lv: Leaf, name: str, entry: CallEntry, judge: Judge,
                describe: bool = False) -> LeafResult:
    """An object held by type name only (a KV cache, a generator): its type, or nothing at all."""
    p = g.path
    if g.type_name != lv.type_name:
        return LeafResult(p, "structure", f"{out_name(p)} type changed {g.type_name} -> {lv.type_name}")
    if not lv.type_only:  # an empty container: nothing else to compare
        return LeafResult(p, "match", type_name=lv.type_name)
    return LeafResult(p, "match", f"{g.type_name} object: compared by type only", type_name=lv.type_name,
                      type_only=True)


def ref_pair(c: PairHost, g: LeafEntry, lv: Leaf, name: str, entry: CallEntry, judge: Judge,
             describe: bool = False) -> LeafResult:
    """A repeated or cyclic container: the same output it referred to."""
    p = g.path
    if g.value != lv.value:
        return LeafResult(p, "structure", f"{out_name(p)} was a reference to output {g.value}, "
                                          f"is now a reference to output {lv.value}")
    return LeafResult(p, "match", type_name=lv.type_name)


def type_changed(g: LeafEntry, lv: Leaf) -> LeafResult:
    """A value of another Python type at the same path (a tensor subclass, ``str`` for an enum)."""
    return LeafResult(g.path, "structure", f"{out_name(g.path)} type changed {g.type_name} -> {lv.type_name}",
                      type_name=lv.type_name)


def str_pair(c: PairHost, g: LeafEntry, lv: Leaf, name: str, entry: CallEntry, judge: Judge,
             describe: bool = False) -> LeafResult:
    """Text (and values written as text: dtypes, devices, enum members): equal or diverged."""
    p = g.path
    if g.type_name != lv.type_name:
        return type_changed(g, lv)
    if g.value != lv.value:
        return LeafResult(p, "diverged", f"{out_name(p)} {g.value!r} -> {lv.value!r}")
    return LeafResult(p, "match")


def tensor_pair(c: PairHost, g: LeafEntry, lv: Leaf, name: str, entry: CallEntry, judge: Judge,
                describe: bool = False) -> LeafResult:
    """A stored tensor: its type, shape (or a rank's local shard of it) and dtype, then the judge."""
    p = g.path
    if g.type_name != lv.type_name:
        return type_changed(g, lv)
    t = lv.tensor
    assert t is not None and g.dtype is not None
    ldt = dtype_name(t)
    lshape = tuple(int(s) for s in t.shape)
    if lshape != g.shape:  # distributed: a rank's piece of the golden's value is a local shard
        why = None if lv.dist is None else shard_verdict(lv.dist, name, p, g.shape)
        detail = why or f"{out_name(p)} shape {list(g.shape)} -> {list(lshape)}"
        return LeafResult(p, "local_shard" if why else "shape", detail,
                          dtype=g.dtype, live_dtype=ldt, shape=g.shape, live_shape=lshape, numel=g.numel)
    if ldt != g.dtype and not (c.spec.allow_dtype_change and dtype_change_allowed(g.dtype, ldt)):
        return LeafResult(p, "dtype", f"{out_name(p)} dtype {g.dtype} -> {ldt}",
                          dtype=g.dtype, live_dtype=ldt, shape=g.shape, live_shape=lshape, numel=g.numel)
    ctx = LeafContext(name, entry.name, entry.call, p, g.dtype, ldt)
    return c.judge_tensor(ctx, g, t, judge, describe)


PAIRS: dict[str, PairFn] = {"none": none_pair, "object": object_pair, "ref": ref_pair, "str": str_pair,
                            "tensor": tensor_pair}

"""What a module call's scope in a flattened graph shares with every graph format.

A flattened graph (an FX graph's ``nn_module_stack``, an ONNX model's name scopes) says which
module calls each node ran inside. Two questions are the same whatever the graph: which module
calls a node that no scope names belongs to (:func:`common_prefix` of its neighbours' stacks), and
which value leaving a module call's scope is which of the golden's recorded outputs
(:func:`assign_outputs`, by shape and dtype, never by guess).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

# the golden leaf kinds that hold a tensor's values (or its fingerprint): those a graph value can be
TENSOR_KINDS = ("tensor", "fingerprint")

Signature = tuple[tuple[int, ...], str]  # (shape, dtype name without "torch.")
T = TypeVar("T")
K = TypeVar("K")  # what names a live value in a source: an FX node, an ONNX value name
G = TypeVar("G", bound="GoldenOutput")


class GoldenOutput(Protocol):
    """What :func:`assign_outputs` reads of a golden leaf (``store.format.LeafEntry``)."""

    @property
    def path(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str | None: ...

    @property
    def type_name(self) -> str: ...


def common_prefix(stacks: Sequence[Sequence[T]]) -> list[T]:
    """The entries every stack starts with: the module calls shared by all of a node's neighbours
    (an empty list when there are none, or they share nothing but the root)."""
    if not stacks:
        return []
    common = list(stacks[0])
    for other in stacks[1:]:
        k = 0
        while k < min(len(common), len(other)) and common[k] == other[k]:
            k += 1
        common = common[:k]
    return common


def assign_outputs(golden: Sequence[GoldenOutput], sigs: Sequence[Signature | None],
                   same_dtype: bool = True) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Which value (index into ``sigs``) is which golden tensor output (path), and the golden
    outputs left out with the reason. Two outputs with one shape and dtype cannot be told apart by
    the graph: both are left out rather than paired by guess. ``same_dtype=False`` matches by shape
    alone (a graph converted to another float precision)."""
    def key(shape: tuple[int, ...], dtype: str | None) -> tuple[tuple[int, ...], str]:
        return tuple(shape), (dtype or "") if same_dtype else ""

    keys = [None if s is None else key(*s) for s in sigs]
    out: dict[str, int] = {}
    left: list[tuple[str, str]] = []
    for g in golden:
        if g.kind == "ref":  # the same tensor as another output: judged there
            continue
        if g.kind not in TENSOR_KINDS:
            left.append((g.path, f"a constant {g.type_name or g.kind} output is not a value in the graph"))
            continue
        want = key(g.shape, g.dtype)
        peers = [h for h in golden if h.kind in TENSOR_KINDS and key(h.shape, h.dtype) == want]
        hits = [i for i, s in enumerate(keys) if s == want]
        what = "shape and dtype" if same_dtype else "shape"
        if len(hits) == 1 and len(peers) == 1:
            out[g.path] = hits[0]
        elif not hits:
            left.append((g.path, f"the graph consumes it only inside the module (no value of its {what} leaves the "
                                 f"module's scope)"))
        else:
            left.append((g.path, f"{len(hits)} values leaving the module's scope and {len(peers)} outputs have its "
                                 f"{what}: they cannot be told apart"))
    return out, left


@dataclass
class Skipped:
    """A golden module call (or some of its outputs) a graph source cannot be compared on, and why."""

    name: str
    call: int
    reason: str
    whole: bool  # no output of the call was compared


def output_name(path: str) -> str:
    """How a skipped output is named: the call's only output, or the one at ``path``."""
    return "output" if path == "" else f"output {path!r}"


def book_outputs(path: str, call: int, escaping: Sequence[K], golden: Sequence[G], mapped: Mapping[str, int],
                 left: Sequence[tuple[str, str]], skipped: list[Skipped],
                 mapped_of: dict[tuple[str, int], dict[str, K]], golden_of: dict[K, G]) -> bool:
    """One call's pairing (:func:`assign_outputs`) written into a source's books: each output left
    out, with why, in ``skipped``; the paired ones under (``path``, ``call``) in ``mapped_of``; each
    live value's golden output in ``golden_of`` (its first). True when an output was paired."""
    for out, why in left:
        skipped.append(Skipped(path, call, f"{output_name(out)}: {why}", not mapped))
    if not mapped:
        return False
    mapped_of[(path, call)] = {out: escaping[i] for out, i in mapped.items()}
    by_path = {g.path: g for g in golden}
    for out, i in mapped.items():
        golden_of.setdefault(escaping[i], by_path[out])
    return True

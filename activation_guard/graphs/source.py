"""A flattened ``torch.fx.GraphModule`` as a source of live values, module call by module call.

An exported program's ``.module()``, a graph after user or library passes, or a PT2E prepared or
converted model has no submodules for hooks to fire on, but each node still carries
``meta["nn_module_stack"]``: the eager module calls it ran inside (opaque keys -> (path, type); a
repeated call gets its own key). :class:`GraphSource` runs the graph node by node under a
``torch.fx.Interpreter`` and, when a module call's last node has run, yields that call with the
values that leave its scope (produced inside it and used outside it, or returned), named by the
eager path, numbered among that path's calls. Nodes without a stack belong to the enclosing scope's
own code (the root's, for a quantize/dequantize pair between two layers): they are computed and
feed what follows, and the root's output is the model's whole output, compared as eager returns it.

Which escaping value is which eager output is read from the golden's leaves by shape and dtype,
never guessed: an output the graph consumes only inside the module (attention weights), outputs
that cannot be told apart, a constant output (None, a number) or a module call with no node (one
returning its input, or whose metadata a pass stripped) is not comparable, and :attr:`skipped`
names it with the reason. The root is always compared, so a change anywhere still shows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx import _pytree as fx_pytree

from ..store.format import CallEntry, LeafEntry
from ..values.calls import LiveCall
from ..values.leaves import Leaf, flatten
from ..values.scopes import (
    TENSOR_KINDS,
    Signature,
    Skipped,
    assign_outputs,
    book_outputs,
    common_prefix,
)

STACK = "nn_module_stack"
# the guard a flattened exported module runs on its inputs first: a node in no module's code
GUARDS = "_guards_fn"


def has_module_stack(gm: fx.GraphModule) -> bool:
    """Whether any node of ``gm`` says which module call it belongs to."""
    return any(n.meta.get(STACK) for n in gm.graph.nodes)


def type_name(t: Any) -> str:
    """A stack entry's module type as hooks name it: its class name (a class after export, a
    dotted string after deserialization)."""
    name = t if isinstance(t, str) else getattr(t, "__qualname__", str(t))
    return name.rsplit(".", 1)[-1]


@dataclass
class Scope:
    """One module call in the graph: the nodes in it (its children's included), in graph order."""

    key: str
    path: str
    type_name: str
    depth: int
    call: int = 0
    nodes: list[fx.Node] = field(default_factory=list)
    escaping: list[fx.Node] = field(default_factory=list)


def _is_guard(node: fx.Node) -> bool:
    return node.op == "call_module" and node.target == GUARDS


# ops that return their input itself when nothing changes (``x.to(x.dtype)``): such a node inside a
# module, read outside it, is the module's input handed on (a residual), not a value it computed
_ALIASING = ("to", "alias", "detach", "_assert_tensor_metadata")


def _passthrough(node: fx.Node, inside: set[fx.Node]) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function" or getattr(packet, "__name__", None) not in _ALIASING or not node.args:
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node) or src in inside:
        return False
    a, b = node.meta.get("val"), src.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype


def _stack(node: fx.Node) -> list[tuple[str, Any]]:
    """A node's module calls, outermost first, as (key, (path, type))."""
    return list((node.meta.get(STACK) or {}).items())


def enclosing(gm: fx.GraphModule) -> dict[fx.Node, list[tuple[str, Any]]]:
    """Every computing node's module calls: its own stack, or, for a node with none (made by a
    pass, a quantize/dequantize), the calls shared by every node it reads and every node reading
    it (parameters and inputs aside): the enclosing scope whose code it is. A PT2E weight's
    dequantize, read by one Linear only, is that Linear's; a quantize/dequantize pair between two
    layers is their common parent's (the root's)."""
    out: dict[fx.Node, list[tuple[str, Any]]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or _is_guard(node):
            continue
        out[node] = _stack(node)
    for node, stack in out.items():
        if stack:
            continue
        near = [m for m in node.all_input_nodes if m in out] + [u for u in node.users if u in out]
        stacks = [[(key, tuple(entry)) for key, entry in out[m]] for m in near]  # (one unresolved: the root's)
        if not stacks:
            continue
        out[node] = common_prefix(stacks)
    return out


def scopes(gm: fx.GraphModule, around: Mapping[fx.Node, list[tuple[str, Any]]] | None = None) -> list[Scope]:
    """Every module call named in the graph's module stacks (the root excluded: its output is the
    graph's), each with the values leaving it, in the order the calls finish (children first).
    ``around``: :func:`enclosing`'s answer, when already at hand."""
    found: dict[str, Scope] = {}
    for node, stack in (enclosing(gm) if around is None else around).items():
        for depth, (key, entry) in enumerate(stack):
            path, mtype = entry[0], entry[1]
            if path == "":
                continue
            s = found.get(key)
            if s is None:
                s = found[key] = Scope(key, path, type_name(mtype), depth)
            s.nodes.append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    calls: dict[str, int] = {}
    for s in sorted(found.values(), key=lambda s: order[s.nodes[0]]):  # a path's calls numbered as they start
        s.call = calls.get(s.path, 0)
        calls[s.path] = s.call + 1
        inside = set(s.nodes)
        s.escaping = [n for n in s.nodes if any(u not in inside for u in n.users) and not _passthrough(n, inside)]
    return sorted(found.values(), key=lambda s: (order[s.nodes[-1]], -s.depth))


def _sig(t: Any) -> Signature | None:
    if not isinstance(t, torch.Tensor):
        return None
    return tuple(t.shape), str(t.dtype).removeprefix("torch.")


def assign(golden: Sequence[LeafEntry], values: Sequence[Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Which escaping value (index) is which golden tensor output (path), by shape and dtype, and
    the golden outputs left out with the reason (:func:`~activation_guard.values.scopes.assign_outputs`)."""
    return assign_outputs(golden, [_sig(v) for v in values])


class GraphSource:
    """A :class:`~activation_guard.values.calls.LiveSource` over a flattened graph (module docstring).

    ``golden`` answers a golden call's entry by (name, call) (None when the golden has no such
    call); ``golden_calls`` lists the golden's selected calls as (live name, entry), so
    those the graph never produces are named in :attr:`skipped` (and marked as met: not comparable
    is not missing). ``wanted`` filters module paths (include/exclude)."""

    def __init__(self, gm: fx.GraphModule, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 golden: Callable[[str, int], CallEntry | None], golden_calls: Sequence[tuple[str, CallEntry]],
                 wanted: Callable[[str], bool] = lambda name: True, label: str = "graph", root_type: str = ""):
        self.gm, self.args, self.kwargs = gm, args, dict(kwargs)
        self.golden, self.golden_calls, self.wanted, self.label = golden, golden_calls, wanted, label
        self.skipped: list[Skipped] = []
        # per compared call: which node is which golden output; per node, the golden output it is
        self.mapped: dict[tuple[str, int], dict[str, fx.Node]] = {}
        self.folded: dict[tuple[str, int], str] = {}
        self.golden_of: dict[fx.Node, LeafEntry] = {}
        # called with each compared call and the live values once the comparator has judged it (replay)
        self.after: Callable[[Scope, Mapping[fx.Node, Any]], None] | None = None
        self.compared = 0  # module calls judged on at least one output
        self.output: Any = None
        around = enclosing(gm)
        self.scopes = scopes(gm, around)
        # nodes with no module stack of their own: given to the one module call around them, or the root's
        self.stackless = sum(1 for n in around if not n.meta.get(STACK))
        self.inherited = sum(1 for n, st in around.items() if st and not n.meta.get(STACK))
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.root_type = root_type
        self.nodes = sum(1 for _ in gm.graph.nodes)

    def describe(self) -> str:
        return (f"live values from the {self.label} run node by node under torch.fx.Interpreter: "
                f"{len(self.scopes)} module calls named by the graph's module stacks; {self.stackless} of "
                f"{self.nodes} nodes have none of their own ({self.inherited} given to the module call around "
                f"them, {self.stackless - self.inherited} the root's code, judged in its output)")

    def _flat_inputs(self) -> list[Any]:
        codegen = self.gm.graph._codegen
        info = codegen.pytree_info if isinstance(codegen, fx.graph._PyTreeCodeGen) else None
        if info is not None and info.in_spec is not None:
            # as the graph's own forward does: its parameters bound by name, then flattened by the
            # input spec recorded at export ((positional, keyword) as the export was called)
            try:
                bound = inspect.signature(self.gm.forward).bind(*self.args, **self.kwargs).arguments
            except TypeError as e:
                raise TypeError(f"the {self.label} takes {inspect.signature(self.gm.forward)}: {e}") from None
            spec = info.in_spec
            kids = spec.children()
            if len(kids) == 2 and kids[1].type is dict:
                npos, names = kids[0].num_children, kids[1].context
                values = [bound[n] for n in info.orig_args if n in bound]
                return list(fx_pytree.tree_flatten_spec((values[:npos], {n: bound[n] for n in names}), spec))
            return list(fx_pytree.tree_flatten_spec([bound[n] for n in info.orig_args if n in bound], spec))
        if self.kwargs:
            raise TypeError(f"this {self.label} takes positional inputs only; got keyword inputs "
                            f"{sorted(self.kwargs)}")
        return list(self.args)

    def calls(self) -> Iterator[LiveCall]:
        self.folded = self._folding()
        interp = fx.Interpreter(self.gm, garbage_collect_values=False)
        flat = self._flat_inputs()
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(flat) != len(placeholders):
            raise TypeError(f"the {self.label} takes {len(placeholders)} input tensors, got {len(flat)}")
        interp.args_iter = iter(flat)
        env: dict[fx.Node, Any] = {}
        interp.env = env
        ends: dict[fx.Node, list[Scope]] = {}
        for s in self.scopes:
            ends.setdefault(s.nodes[-1], []).append(s)
        # a value is kept until its last reader has run and every scope it leaves has been yielded
        last: dict[fx.Node, fx.Node] = {}
        for node in self.gm.graph.nodes:
            for a in node.all_input_nodes:
                last[a] = node
        for s in self.scopes:  # (and its inputs, while a replay may re-run it)
            inside = set(s.nodes)
            keep = s.escaping + ([a for n in s.nodes for a in n.all_input_nodes if a not in inside]
                                 if self.after is not None else [])
            for e in keep:
                if self.order.get(last.get(e), -1) < self.order[s.nodes[-1]]:  # type: ignore[arg-type]
                    last[e] = s.nodes[-1]
        drop: dict[fx.Node, list[fx.Node]] = {}
        for value, reader in last.items():
            drop.setdefault(reader, []).append(value)
        met: set[tuple[str, int]] = set()
        with torch.no_grad():
            for node in self.gm.graph.nodes:
                if node.op == "output":
                    flat_out = interp.run_node(node)
                    break
                if node.op == "call_function":  # the common case, without the interpreter's per-node bookkeeping
                    a, kw = interp.fetch_args_kwargs_from_env(node)
                    env[node] = node.target(*a, **kw)  # type: ignore[operator]
                else:
                    env[node] = interp.run_node(node)
                for s in ends.get(node, ()):
                    if not self.wanted(s.path):
                        continue
                    met.add((s.path, s.call))
                    yield self._call(s, env)
                    if self.after is not None and (s.path, s.call) in self.mapped:
                        self.after(s, env)
                for value in drop.get(node, ()):
                    env.pop(value, None)
            else:  # pragma: no cover - every graph ends in an output node
                raise RuntimeError(f"the {self.label} has no output node")
            codegen = self.gm.graph._codegen
            out = codegen.process_outputs(flat_out) if isinstance(codegen, fx.graph._PyTreeCodeGen) else flat_out
        env.clear()
        self.output = out
        # golden calls no graph node belongs to: not comparable, and said so (met, not missing)
        for name, c in self.golden_calls:
            if name and (name, c.call) not in met and self.wanted(name):
                why = self.folded.get((name, c.call), "no node of the graph belongs to this module call (it returns "
                                                      "its input unchanged)")
                self.skipped.append(Skipped(name, c.call, why, True))
                yield LiveCall(name, c.call, c.type_name, list, only=frozenset())
        self.compared += 1
        yield LiveCall("", 0, self.root_type or type(self.gm).__name__, lambda: flatten(out, fields=True))

    def _folding(self) -> dict[tuple[str, int], str]:
        """Golden calls with no node in the graph that computed something in eager (their output
        is not their input, by the golden's checksums): a pass folded that computation into the
        call that produced their input (a batch norm into the conv before it), whose graph value
        then carries both; neither is comparable. Without recorded inputs the call just before
        is suspect alike."""
        present = {(s.path, s.call) for s in self.scopes}
        out: dict[tuple[str, int], str] = {}
        previous: tuple[str, int] | None = None
        live_of = {(c.name, c.call): name for name, c in self.golden_calls}
        for name, c in self.golden_calls:
            key = (name, c.call)
            if not name or key in present:
                previous = key
                continue
            inputs = [i for i in c.inputs or () if i.kind in ("tensor", "alias")]
            crcs = {(i.crc32, tuple(i.shape), i.dtype) for i in inputs if i.kind == "tensor"}
            producers = [live_of.get((i.alias[0], i.alias[1])) for i in inputs if i.alias is not None]
            # (a fingerprint has no checksum of the values: it proves nothing, and the call stays suspect)
            if c.inputs is not None and all(g.kind not in TENSOR_KINDS or (g.kind == "tensor" and (
                    (g.crc32, tuple(g.shape), g.dtype) in crcs or self._same_as_input(g, c))) for g in c.leaves):
                previous = key
                continue  # returns its input: nothing of it is missing from the graph
            suspects = [p for p in producers if p is not None] if c.inputs is not None else (
                [previous[0]] if previous is not None and previous[0] else [])
            out[key] = ("no node of the graph belongs to this module call, and in eager it computed something: "
                        "a pass folded it into " + (", ".join(repr(p) for p in suspects) or "a neighbour")
                        + " or removed it")
            for p in suspects:
                for k, cc in self.golden_calls:
                    if k == p:
                        out.setdefault((k, cc.call), f"its graph value also carries {name!r} (a module with no node "
                                                     f"of its own: folded across the module boundary)")
            previous = key
        return out

    def _same_as_input(self, g: LeafEntry, c: CallEntry) -> bool:
        """Whether output leaf ``g`` of call ``c`` is, by checksum, one of the golden outputs its
        input aliases (a module handing its input on)."""
        for i in c.inputs or ():
            if i.alias is None:
                continue
            src = self.golden(i.alias[0], i.alias[1])
            if src is None:
                continue
            for h in src.leaves:
                if h.path == i.alias[3] and (h.crc32, tuple(h.shape), h.dtype) == (g.crc32, tuple(g.shape), g.dtype):
                    return True
        return False

    def _call(self, s: Scope, env: Mapping[fx.Node, Any]) -> LiveCall:
        entry = self.golden(s.path, s.call)
        folded = self.folded.get((s.path, s.call))
        if entry is not None and folded is not None:
            self.skipped.append(Skipped(s.path, s.call, folded, True))
            return LiveCall(s.path, s.call, s.type_name, list, only=frozenset())
        if entry is None:  # not in the golden: the comparator names it unexpected
            values = [env[e] for e in s.escaping]
            leaves: list[Leaf] = (flatten(values[0], fields=True) if len(values) == 1
                                  else flatten(tuple(values), fields=True))
            return LiveCall(s.path, s.call, s.type_name, lambda: leaves)
        values = [env[e] for e in s.escaping]
        mapped, left = assign(entry.leaves, values)
        if book_outputs(s.path, s.call, s.escaping, entry.leaves, mapped, left, self.skipped, self.mapped,
                        self.golden_of):
            self.compared += 1
        leaves = [Leaf(path, "tensor", tensor=values[i]) for path, i in mapped.items()]
        only = frozenset(mapped)
        return LiveCall(s.path, s.call, s.type_name, lambda: leaves, only=only)

    def notes(self) -> list[str]:
        """What the graph could not be compared on, per module call, with the reason."""
        if not self.skipped:
            return []
        shown = self.skipped[:20]
        more = len(self.skipped) - len(shown)
        head = (f"{self.label}: {self.compared} module calls compared; not comparable: "
                + "; ".join(f"{k.name!r} call {k.call} {k.reason}" for k in shown))
        return [head + (f"; and {more} more" if more else "")]


"""Re-running one module call's nodes of a graph on the golden's values (attribution for graphs).

A module call in a flattened graph is the set of nodes its ``nn_module_stack`` names. Its inputs
are the nodes outside that set it reads: parameters and constants (and values computed from them
alone, such as a PT2E weight's dequantize) are the module's own and are taken live; every other
input is taken from the golden: the call's own recorded arguments (told apart by shape and dtype,
as its outputs are), else an earlier call's golden output the graph maps to that node, else the
model's input when it is unchanged. An input found nowhere, or told apart from no other, stops the
replay with the reason, never a guess: when the live value is bit-identical to the one golden
candidate of its shape, it is that value whichever it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from ..store.format import CallEntry, LeafEntry
from .source import Scope, assign


def _const_only(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether ``node`` is computed from parameters and constants alone (no model input)."""
    if node in memo:
        return memo[node]
    if node.op == "get_attr":
        ok = True
    elif node.op == "placeholder":
        ok = False
    else:
        ok = all(_const_only(a, memo) for a in node.all_input_nodes)
    memo[node] = ok
    return ok


def externals(scope: Scope) -> list[fx.Node]:
    """The nodes outside a module call that its nodes read, in the order first read."""
    inside = set(scope.nodes)
    seen: dict[fx.Node, None] = {}
    for n in scope.nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                seen.setdefault(a, None)
    return list(seen)


def _bitwise(a: Any, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.detach().cpu(), b))


def replay_scope(gm: fx.GraphModule, scope: Scope, env: Mapping[fx.Node, Any], entry: CallEntry,
                 mapped: Mapping[str, fx.Node], load: Callable[[LeafEntry, str], torch.Tensor],
                 resolve: Callable[[LeafEntry], LeafEntry], golden_of: Callable[[fx.Node], LeafEntry | None],
                 inputs_same: bool, memo: dict[fx.Node, bool]) -> dict[str, torch.Tensor] | str:
    """The call's outputs (by golden path) re-computed on the golden's values, or why it cannot be."""
    where = f"layer {scope.path!r} call {scope.call}"
    ext = externals(scope)
    own = [a for a in ext if _const_only(a, memo)]
    acts = [a for a in ext if a not in own]
    if acts and entry.inputs is None:
        return "the golden has no recorded inputs for this call (recorded with inputs=False)"
    recorded = [resolve(g) for g in entry.inputs or () if g.kind in ("tensor", "alias")]
    by_path = {g.path: g for g in recorded}
    pairs, _ = assign(recorded, [env[a] for a in acts])
    values: dict[fx.Node, Any] = {a: env[a] for a in own}
    for path, i in pairs.items():
        values[acts[i]] = load(by_path[path], f"{where} input {path!r}")
    for a in acts:
        if a in values:
            continue
        g = golden_of(a)
        if g is not None:
            values[a] = load(g, f"{where} input {a.name!r}")
            continue
        if a.op == "placeholder" and inputs_same:
            values[a] = env[a]
            continue
        live = env[a]
        same = [g for g in recorded if tuple(g.shape) == tuple(getattr(live, "shape", ()))
                and g.dtype == str(getattr(live, "dtype", "")).removeprefix("torch.")]
        hit = next((g for g in same if _bitwise(live, load(g, f"{where} input {g.path!r}"))), None)
        if hit is None:
            return (f"its input {a.name!r} (computed by {a.op} {getattr(a.target, '__name__', a.target)}) is not "
                    f"told apart from the call's other recorded arguments, nor an earlier call's output the graph "
                    f"maps to the golden")
        values[a] = live
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    interp.env = values
    with torch.no_grad():
        for n in scope.nodes:
            values[n] = interp.run_node(n)
    return {path: values[node] for path, node in mapped.items()}

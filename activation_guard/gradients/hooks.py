"""Gradient capture: per module call, the gradient w.r.t. its outputs and w.r.t. its inputs, and
each parameter's gradient, in backward execution order, without changing what the model computes.

Why not ``register_full_backward_hook``: it routes a module's inputs and outputs through an
identity autograd Function and hands the module (and its caller) *views* of them. A model that
then modifies such a tensor in place fails: transformers' ResNet does ``hidden_state +=
residual`` and gets "Output 0 of BackwardHookFunction is a view and is being modified inplace";
``nn.ReLU(inplace=True)`` fails the same way on its input. Capturing gradients must never make a
working model fail, so nothing here wraps, replaces or re-creates a tensor the model sees. Only
hooks on autograd graph nodes that the forward built anyway are added:

* **output gradients**: in the forward post-hook, each floating output's gradient edge
  (``get_gradient_edge``: its ``grad_fn`` and output number *now*, before any later in-place op)
  gets a pre-hook; it fires with the gradient of that version. Measured on torch 2.13: after
  ``y = conv(x); y += r`` (and after ``y.mul_(2)``) both a tensor hook registered before the
  in-place op and this node pre-hook receive the gradient of the pre-modification ``y``, which
  is the gradient w.r.t. the module's output. Leaf outputs (a parameter returned as is) get a
  tensor hook.
* **input gradients** (the module's own vector-Jacobian product, as a full backward hook would
  report it, not the input tensor's total gradient, which also holds what other consumers sent
  back): the nodes the call created are those with an autograd sequence number at or after the
  number when it started (``torch._C._autograd._get_sequence_nr``; thread-local, and calls run on
  one thread). Walking back from its outputs through those nodes finds every edge into an input's
  gradient edge; a post-hook on each such node reads the gradient it sends to the input, and the
  contributions are summed. An output that *is* an input (``Identity``, eval ``Dropout``) passes
  its gradient through. The walk stays inside the call, so its cost is the call's own nodes,
  once per enclosing module call (depth x nodes: 4 ms per recording of the 4-layer GPT-2 of
  ``benchmarks/backward_cost.py``).

Rejected: a re-entrant ``torch.autograd.grad(outputs, inputs, retain_graph=True)`` per call
re-runs each call's backward (a second backward for leaf modules alone, depth x more with
parents) and needs the graph retained; attributing through recorded input aliases gives the
tensor's total gradient, which differs from the module's own wherever a residual branches.

The backward itself is ``torch.autograd.backward`` (``torch.autograd.grad`` misses parameters
inside re-entrant ``torch.utils.checkpoint`` regions, whose backward calls ``backward`` itself),
so it accumulates into ``.grad``: every leaf it can reach has its ``.grad`` set aside first and put
back after, and post-accumulate-grad hooks (optimizer steps in backward) are held off meanwhile.
The RNG state is restored after it (a checkpoint's recomputation may draw), grad mode and the
training flag are never changed, every hook is removed, and the graph is freed (no
``retain_graph``).

About 450 lines, most of them :class:`GradCapture`: its forward hooks, the graph walk and the
backward share one set of per-call records (the nodes each call created, the edges into its
inputs, the gradients arriving), and each half is only correct given the other's order of
events. The loss rule and the comparison live in :mod:`.loss` and :mod:`..comparison.gradients`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Protocol

import torch
from torch.autograd.graph import get_gradient_edge

from ..capture.hooks import Frame
from ..values.leaves import UnsupportedTensorError, flatten, flatten_inputs, wrapper_type
from .loss import LossRule

GRAD_KINDS = ("output", "input", "param")
_NO_SEQ = 1 << 63  # nodes without a sequence number (AccumulateGrad) report 2**64 - 1


def _next_node_nr() -> int:
    """The sequence number the next autograd node will get (torch's private counter, read
    without creating a node; older/newer torch without it: create one and read its number)."""
    with torch.enable_grad():
        node = torch.zeros((), requires_grad=True).mul(1).grad_fn
    assert node is not None
    return int(node._sequence_nr()) + 1


_sequence_nr: Callable[[], int] = getattr(torch._C._autograd, "_get_sequence_nr", _next_node_nr)


# --------------------------------------------------------------------------- events


class Event:
    """One gradient record: a module call's gradient w.r.t. its outputs (``output``) or inputs
    (``input``), or a module's parameter gradients (``param``, call 0), leaf by leaf."""

    __slots__ = ("acc", "call", "children", "delivered", "fwd", "grad", "key", "name", "parent", "paths",
                 "pending", "type_name")

    def __init__(self, grad: str, name: str, call: int, type_name: str, paths: list[str], fwd: int):
        self.grad, self.name, self.call, self.type_name = grad, name, call, type_name
        self.paths = paths
        self.fwd = fwd  # the call's position in the forward's execution order
        self.key: tuple[float, int, int] = (float("inf"), GRAD_KINDS.index(grad), fwd)
        self.delivered: set[str] = set()
        self.pending = 0  # input events: contributions still to come
        self.acc: dict[str, torch.Tensor] = {}
        self.parent: Frame | None = None  # the enclosing call (output events)
        self.children = 0

    @property
    def parent_key(self) -> tuple[str, int] | None:
        p = self.parent
        return None if p is None or p.call < 0 else (p.name, p.call)


class GradSink(Protocol):
    """Where captured gradients go: ``leaf`` once per event and path, as soon as it is known (the
    gradient tensor, valid only during the call, or ``None``: no gradient reached it); ``finish``
    once with every event in backward execution order."""

    def leaf(self, event: Event, path: str, grad: torch.Tensor | None) -> None: ...

    def finish(self, events: list[Event]) -> None: ...


def _wants(t: Any) -> bool:
    # complex values too: their gradients are complex (an FFT's real input gets a real one back)
    return (isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())
            and type(t) is torch.Tensor)


class GradCapture:
    """Registers the node hooks during a forward (``on_enter``/``on_output`` from the capture's
    module hooks), then runs the backward (:meth:`backward`) and feeds ``sink``."""

    def __init__(self, sink: GradSink, *, adopt: bool = True, wanted: Callable[[str], bool] | None = None):
        self.sink = sink
        self.wanted = wanted  # the layer selection: a module it leaves out keeps its parameters out too
        # parameters of modules that never run (an nn.ParameterList, a submodule used through
        # F.linear(x, sub.weight)) go to the nearest running ancestor, under their path from it;
        # goldens from before that leave them out, and ``unadopted`` names them for a note
        self.adopt = adopt
        self.unadopted: list[str] = []
        self.events: list[Event] = []
        self.handles: list[Any] = []
        self.modules: dict[str, torch.nn.Module] = {}  # called modules, by layer name (their parameters)
        self._starts: dict[int, tuple[int, list[tuple[str, Any]]]] = {}
        self._tick = 0
        self._last: tuple[int, int] = (0, 0)
        self._fwd = 0
        # calls that ran with autograd off although the forward had it on: their gradients never
        # exist (a reentrant checkpoint re-runs them inside the backward, out of the capture's sight)
        self.no_autograd: list[str] = []
        self.no_autograd_parent: dict[str, str | None] = {}  # each of them -> the call it ran inside

    @staticmethod
    def _floating(output: Any) -> bool:
        if type(output) is torch.Tensor:
            return output.is_floating_point() or output.is_complex()
        return any(leaf.tensor is not None and (leaf.tensor.is_floating_point() or leaf.tensor.is_complex())
                   for leaf in flatten(output))

    def autograd_off_regions(self) -> list[str]:
        """The calls with autograd on whose own code turned it off for the calls inside them (a
        reentrant checkpoint around a block's forward, a ``torch.no_grad`` block): the callers of
        the outermost calls that ran with it off ("" for the model itself)."""
        off = set(self.no_autograd)
        tops = [self.no_autograd_parent.get(n) for n in dict.fromkeys(self.no_autograd)]
        return list(dict.fromkeys(p or "" for p in tops if p not in off))

    # ------------------------------------------------------------------ forward side
    def on_enter(self, frame: Frame) -> None:
        args = frame.args
        if not frame.kwargs and type(args) is tuple and all(type(a) is torch.Tensor for a in args):
            pairs = [(f"args/{i}", a) for i, a in enumerate(args)]  # the common case, as flatten_inputs names it
        else:
            with torch.no_grad():
                pairs = [(leaf.path, leaf.tensor) for leaf in flatten_inputs(args, frame.kwargs)
                         if leaf.tensor is not None]
        edges = [(path, get_gradient_edge(t)) for path, t in pairs if _wants(t)]
        self._starts[id(frame)] = (_sequence_nr(), edges)

    def on_output(self, frame: Frame, output: Any) -> None:
        start, ins = self._starts.pop(id(frame), (_sequence_nr(), []))
        name, call, tname = frame.name, frame.call, type(frame.module).__name__
        if call == 0:
            self.modules.setdefault(name, frame.module)
        fwd = self._fwd
        self._fwd += 1
        if type(output) is torch.Tensor:
            outs = [("", output)] if _wants(output) else []
        else:
            sub = wrapper_type(output)
            if sub is not None:
                raise UnsupportedTensorError(
                    f"layer {name or '<root>'!r} call {call} returns a {sub} (a wrapper tensor subclass): its "
                    f"gradients cannot be read as values; compare the forward only, or exclude the layer "
                    f"(exclude=[...])")
            with torch.no_grad():
                outs = [(leaf.path, leaf.tensor) for leaf in flatten(output)
                        if leaf.tensor is not None and _wants(leaf.tensor)]
        if not outs:  # nothing of it is differentiated: no gradient flows through it
            if not torch.is_grad_enabled() and self._floating(output):
                self.no_autograd.append(name)  # torch.no_grad, or a reentrant activation checkpoint
                self.no_autograd_parent[name] = None if frame.parent is None else frame.parent.name
            return
        targets: dict[tuple[int, int], list[str]] = {}
        for path, e in ins:
            targets.setdefault((id(e.node), e.output_nr), []).append(path)
        ev_in = Event("input", name, call, tname, [p for p, _ in ins], fwd) if ins else None
        ev_out = Event("output", name, call, tname, [p for p, _ in outs], fwd)
        ev_out.parent, ev_out.children = frame.parent, frame.children
        self.events.append(ev_out)
        self._hook_outputs(ev_out, outs, targets, ev_in)
        if ev_in is not None:
            ev_in.children = frame.children
            self.events.append(ev_in)
            self._hook_inputs(ev_in, [o for _, o in outs], start, targets)

    def _hook_outputs(self, ev: Event, outs: list[tuple[str, torch.Tensor]],
                      targets: Mapping[tuple[int, int], list[str]], ev_in: Event | None) -> None:
        by_node: dict[int, tuple[Any, list[tuple[str, int, list[str]]]]] = {}
        for path, t in outs:
            edge = get_gradient_edge(t)
            through = targets.get((id(edge.node), edge.output_nr), [])  # an output that is an input
            if ev_in is not None:
                ev_in.pending += len(through)
            if t.grad_fn is None:  # a leaf returned as is: its tensor hook
                self.handles.append(t.register_hook(self._tensor_hook(ev, path, through, ev_in)))
                continue
            by_node.setdefault(id(edge.node), (edge.node, []))[1].append((path, edge.output_nr, through))
        for node, items in by_node.values():
            self.handles.append(node.register_prehook(self._output_hook(node, ev, items, ev_in)))

    def _output_hook(self, node: Any, ev: Event, items: list[tuple[str, int, list[str]]],
                     ev_in: Event | None) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            self._at(node, 0)
            for path, nr, through in items:
                g = grad_outputs[nr]
                self._arrive(ev, path, g)
                if ev_in is not None:
                    for p in through:
                        self._contribute(ev_in, p, g)
        return hook

    def _tensor_hook(self, ev: Event, path: str, through: list[str], ev_in: Event | None) -> Callable[[Any], None]:
        def hook(g: torch.Tensor) -> None:
            self._at(ev, 0)
            self._arrive(ev, path, g)
            if ev_in is not None:
                for p in through:
                    self._contribute(ev_in, p, g)
        return hook

    def _hook_inputs(self, ev: Event, outs: list[torch.Tensor], start: int,
                     targets: Mapping[tuple[int, int], list[str]]) -> None:
        stack = [t.grad_fn for t in outs if t.grad_fn is not None and start <= t.grad_fn._sequence_nr() < _NO_SEQ]
        seen: dict[int, Any] = {}
        hits: dict[int, tuple[Any, list[tuple[int, list[str]]]]] = {}
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen[id(n)] = n  # held, so its id is not reused during the walk
            for i, (m, nr) in enumerate(n.next_functions):
                if m is None:
                    continue
                paths = targets.get((id(m), nr))
                if paths is not None:
                    hits.setdefault(id(n), (n, []))[1].append((i, paths))
                elif start <= m._sequence_nr() < _NO_SEQ:
                    stack.append(m)
        ev.pending += len(hits)
        for n, items in hits.values():
            self.handles.append(n.register_hook(self._input_hook(n, ev, items)))

    def _input_hook(self, node: Any, ev: Event, items: list[tuple[int, list[str]]]) -> Callable[[Any, Any], None]:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            self._at(node, 1)
            for i, paths in items:
                for p in paths:
                    self._add(ev, p, grad_inputs[i])
            self._done_one(ev)
        return hook

    # ------------------------------------------------------------------ backward side
    def _at(self, node: Any, phase: int) -> None:
        """One tick per node execution (its pre-hooks share one, its post-hooks another)."""
        k = (id(node), phase)
        if k != self._last:
            self._tick += 1
            self._last = k

    def _arrive(self, ev: Event, path: str, g: torch.Tensor | None) -> None:
        if path in ev.delivered:
            return
        if not ev.delivered:
            ev.key = (float(self._tick), 0, -ev.fwd)  # outer calls first: their gradient arrives first
        ev.delivered.add(path)
        self.sink.leaf(ev, path, g)

    def _add(self, ev: Event, path: str, g: torch.Tensor | None) -> None:
        if g is None:
            return
        prev = ev.acc.get(path)
        if prev is None:
            # the engine may reuse a gradient buffer once this hook returns: keep a copy unless this
            # is the only contribution still to come (then it is delivered before the hook returns)
            ev.acc[path] = g if ev.pending <= 1 else g.detach().clone()
        else:
            ev.acc[path] = prev + g

    def _contribute(self, ev: Event, path: str, g: torch.Tensor | None) -> None:
        self._add(ev, path, g)
        self._done_one(ev)

    def _done_one(self, ev: Event) -> None:
        ev.pending -= 1
        if ev.pending <= 0:
            ev.key = (float(self._tick), 1, ev.fwd)  # inner calls first: they complete first
            self._deliver_inputs(ev)

    def _deliver_inputs(self, ev: Event) -> None:
        for p in ev.paths:
            if p not in ev.delivered:
                ev.delivered.add(p)
                self.sink.leaf(ev, p, ev.acc.pop(p, None))
        ev.acc.clear()

    def backward(self, model: torch.nn.Module, output: Any, rule: LossRule, args: Any = (), kwargs: Any = None) -> None:
        """Run the one backward (see the module docstring for what it leaves untouched), then the
        parameter gradients, then ``sink.finish``."""
        roots, grads = rule.roots(output)
        params = self._param_events(model)
        leaves = _reachable_leaves(roots)
        for param in model.parameters():
            leaves.setdefault(id(param), param)
        for leaf in flatten_inputs(args, kwargs or {}):
            if leaf.tensor is not None and leaf.tensor.requires_grad and leaf.tensor.grad_fn is None:
                leaves.setdefault(id(leaf.tensor), leaf.tensor)
        with _set_aside(list(leaves.values())):
            with _rng_kept(roots), torch.enable_grad():
                torch.autograd.backward(roots, grads)
            for ev, tensors in params:  # read before the set-aside gradients are put back
                for pname, p in zip(ev.paths, tensors):
                    ev.delivered.add(pname)
                    self.sink.leaf(ev, pname, p.grad)
        self._finish()

    def _param_events(self, model: torch.nn.Module) -> list[tuple[Event, list[torch.Tensor]]]:
        """One event per called module with parameters that require grad (a parameter shared by
        several modules belongs to the one that returned first), with the parameters of modules
        that never ran (``adopt``)."""
        out: list[tuple[Event, list[torch.Tensor]]] = []
        seen: set[int] = set()
        fwd_of = {ev.name: ev.fwd for ev in self.events if ev.call == 0}
        owned: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for mname, mod in self.modules.items():
            for pname, p in mod.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    owned.setdefault(mname, []).append((pname, p))
        for full, p in model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            anc = full.rpartition(".")[0]
            if self.wanted is not None and not self.wanted(anc):
                continue
            while anc and anc not in self.modules:
                anc = anc.rpartition(".")[0]
            if anc not in self.modules:  # the model itself did not run as a selected layer
                continue
            if not self.adopt:
                self.unadopted.append(full)
                continue
            owned.setdefault(anc, []).append((full[len(anc) + 1:] if anc else full, p))
        for mname, mod in self.modules.items():
            named = owned.get(mname)
            if named:
                ev = Event("param", mname, 0, type(mod).__name__, [n for n, _ in named], fwd_of.get(mname, self._fwd))
                self.events.append(ev)
                out.append((ev, [p for _, p in named]))
        return out

    def _finish(self) -> None:
        last: dict[str, float] = {}
        for ev in self.events:
            if ev.grad != "param" and ev.key[0] != float("inf"):
                last[ev.name] = max(last.get(ev.name, -1.0), ev.key[0])
        for ev in self.events:
            if ev.grad == "param":
                ev.key = (last.get(ev.name, float("inf")), 2, ev.fwd)
            elif ev.grad == "input" and ev.key[0] == float("inf"):
                # no contribution ever ran: right after its output gradient, if that arrived
                out = next((e for e in self.events if e.grad == "output" and e.name == ev.name and e.call == ev.call),
                           None)
                if out is not None:
                    ev.key = (out.key[0], 1, ev.fwd)
            for p in ev.paths:
                if p not in ev.delivered:
                    ev.delivered.add(p)
                    self.sink.leaf(ev, p, ev.acc.pop(p, None))
        order = sorted(range(len(self.events)), key=lambda i: (*self.events[i].key, i))
        self.sink.finish([self.events[i] for i in order])

    def close(self) -> None:
        """Remove every hook and drop every reference into the graph."""
        for h in self.handles:
            with contextlib.suppress(Exception):
                h.remove()
        self.handles.clear()
        self._starts.clear()
        for ev in self.events:
            ev.parent = None
            ev.acc.clear()
        self.modules.clear()


# --------------------------------------------------------------------------- state kept


def _reachable_leaves(roots: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every leaf tensor the backward from ``roots`` accumulates into (AccumulateGrad nodes)."""
    out: dict[int, torch.Tensor] = {}
    seen: dict[int, Any] = {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    for r in roots:
        if r.grad_fn is None and r.requires_grad:
            out[id(r)] = r
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen[id(n)] = n
        var = getattr(n, "variable", None)
        if isinstance(var, torch.Tensor):
            out.setdefault(id(var), var)
            continue
        stack.extend(m for m, _ in n.next_functions if m is not None)
    return out


@contextlib.contextmanager
def _set_aside(leaves: list[torch.Tensor]) -> Iterator[None]:
    """Each leaf's ``.grad`` set aside (the backward starts from none) and its post-accumulate-grad
    hooks held off (an optimizer step in backward must not run); all put back after."""
    saved = []
    try:
        for t in leaves:
            hooks = getattr(t, "_post_accumulate_grad_hooks", None)
            saved.append((t, t.grad, hooks))
            if hooks is not None:
                t._post_accumulate_grad_hooks = OrderedDict()
            t.grad = None
        yield
    finally:
        for t, g, hooks in saved:
            t.grad = g
            if hooks is not None:
                t._post_accumulate_grad_hooks = hooks


@contextlib.contextmanager
def _rng_kept(roots: list[torch.Tensor]) -> Iterator[None]:
    """The backward leaves every RNG as the forward left it (a checkpoint may draw again)."""
    cuda = sorted({r.device.index or 0 for r in roots if r.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        yield

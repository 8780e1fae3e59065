"""A replayed call's children return the golden's outputs, so the replay measures its own code alone.

Re-running a parent on the golden's inputs re-runs its children too, and their noise (TF32,
another reduction order) swamps a small change in the parent's own code between them: a GELU
swapped for its tanh approximation inside a ``TransformerEncoderLayer.forward`` moves values by
about 2e-4, a TF32 ``Linear`` before it by 1e-3. So while a parent replays, each of its direct
child calls returns what the golden recorded for that call (it still runs, then its output is
replaced), and the inputs the parent's code hands it are kept: compared with the golden's inputs
of that call, the first child whose inputs differ says where in the parent's forward the change
is, whatever its children's noise.

A child call is matched to the live call it replays by name and order (the k-th call of child
``a`` in the replay is the k-th that returned inside the live call). Only outermost calls count:
a child called again inside another child is left alone. A call whose output does not have the
golden's tensors (another structure or shape: the code took another branch) keeps its own output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .leaves import flatten, flatten_inputs, rebuild
from .selection import display_name
from .store import CallEntry, GoldenReader


@dataclass
class ChildCall:
    """A direct child call of a live call, as it returned: its module, name and golden entry."""

    module: torch.nn.Module
    name: str
    entry: CallEntry


class GoldenOutputs:
    """The golden output tensors of a call's children, read once per replay (by path)."""

    def __init__(self, reader: GoldenReader, calls: Sequence[ChildCall]):
        self.reader = reader
        self.calls = calls
        self._loaded: dict[int, dict[str, torch.Tensor]] = {}

    def get(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self._loaded:
            c = self.calls[i].entry
            where = f"layer {display_name(c.name)!r} call {c.call} output"
            self._loaded[i] = {leaf.path: self.reader.load(leaf, f"{where} {leaf.path!r}")
                               for leaf in c.leaves if leaf.kind == "tensor"}
        return self._loaded[i]


class ChildHooks:
    """Hooks on the direct children of one replayed call (see the module docstring). After the
    replay, ``inputs[i]`` holds the tensors child call ``i`` received (copies, by input path) and
    ``substituted`` how many calls returned the golden's output."""

    def __init__(self, calls: Sequence[ChildCall], golden: GoldenOutputs):
        self.calls = calls
        self.golden = golden
        self.queues: dict[str, deque[int]] = {}
        for i, c in enumerate(calls):
            self.queues.setdefault(c.name, deque()).append(i)
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.active: list[int | None] = []  # calls of listed children in progress (outermost first)
        self.substituted = 0

    @contextmanager
    def installed(self, modules: Mapping[str, torch.nn.Module]) -> Iterator[None]:
        """Hooks on ``modules`` (child name -> the module to hook: the live one, or its float64 copy)."""
        handles = []
        try:
            for name, mod in modules.items():
                if name in self.queues:
                    handles.append(mod.register_forward_pre_hook(partial(self._pre, name), with_kwargs=True))
                    handles.append(mod.register_forward_hook(partial(self._post, name), with_kwargs=True))
            yield
        finally:
            for h in handles:
                h.remove()

    def _pre(self, name: str, mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        queue = self.queues[name]
        if self.active or not queue:  # inside another child, or a call the live run did not make
            self.active.append(None)
            return
        i = queue.popleft()
        self.inputs[i] = {leaf.path: leaf.tensor.detach().clone() for leaf in flatten_inputs(args, kwargs)
                          if leaf.kind == "tensor" and leaf.tensor is not None}
        self.active.append(i)

    def _post(self, name: str, mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        i = self.active.pop()
        if i is None:
            return None
        golden = self.golden.get(i)
        live = {leaf.path: leaf.tensor for leaf in flatten(output) if leaf.kind == "tensor" and leaf.tensor is not None}
        if set(live) != set(golden) or any(tuple(golden[p].shape) != tuple(t.shape) for p, t in live.items()):
            return None  # another structure: this call keeps its own output
        self.substituted += 1
        # a copy each time: the parent may change what it gets in place
        return rebuild(output, {p: golden[p].to(device=t.device, dtype=t.dtype, copy=True) for p, t in live.items()})

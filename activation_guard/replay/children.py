"""A replayed call's children return the golden's outputs, so the replay measures its own code alone.

Re-running a parent on the golden's inputs re-runs its children too, and their noise (TF32,
another reduction order) swamps a small change in the parent's own code between them: a GELU
swapped for its tanh approximation inside a ``TransformerEncoderLayer.forward`` moves values by
about 2e-4, a TF32 ``Linear`` before it by 1e-3. So while a parent replays, each of its direct
child calls returns what the golden recorded for that call (it still runs, then its output is
replaced), and the inputs the parent's code hands it are kept: compared with the golden's inputs
of that call, the first child whose inputs differ says where in the parent's forward the change
is, whatever its children's noise.

With ``replay="all"`` a child does not even run: its call returns a *skeleton* of the output it
gave in the live run (containers rebuilt, tensors replaced by placeholders) filled with the
golden's tensors, so a replay costs the call's own code, not its whole subtree again. A call whose
output holds opaque objects (a cache) has no skeleton: it runs, and its output is replaced.

A child call is matched to the live call it replays by name and order (the k-th call of child
``a`` in the replay is the k-th that returned inside the live call). Only outermost calls count:
a child called again inside another child is left alone. A call whose output does not have the
golden's tensors (another structure or shape: the code took another branch) keeps its own output.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .._core import devices
from .._core.slots import SLOTS
from ..capture.hooks import RngState, set_rng_state
from ..options.selection import display_name
from ..store import CallEntry, GoldenReader, LeafEntry
from ..values.leaves import UnsupportedTensorError, flatten, flatten_inputs
from ..values.rebuild import rebuild

PLACEHOLDER = torch.empty(0)
# shape, dtype and device of a tensor placeholder; a number's is ((), None, cpu): the stub takes the
# golden's value as stored, and rebuild() gives it the live number's Python type
TensorMeta = tuple[tuple[int, ...], "torch.dtype | None", torch.device]
_CPU = torch.device("cpu")


@dataclass
class Skeleton:
    """A call's output with its tensors replaced by placeholders (``meta``: each one's path,
    shape, dtype and device), to be filled with the golden's tensors."""

    output: Any
    meta: dict[str, TensorMeta]


class _Placeholders(Mapping[str, torch.Tensor]):
    # rebuild() looks each tensor up as values.get(path, tensor): every one becomes the placeholder
    def __init__(self) -> None:
        self.meta: dict[str, TensorMeta] = {}

    def get(self, path: str, default: Any = None) -> Any:
        if isinstance(default, torch.Tensor):
            self.meta[path] = (tuple(default.shape), default.dtype, default.device)
            return PLACEHOLDER
        if default is None:  # a number (rebuild asks for it without a default): the golden's value too
            self.meta[path] = ((), None, _CPU)
        return default

    def __contains__(self, path: object) -> bool:  # numpy arrays stay as they are
        return False

    def __getitem__(self, path: str) -> torch.Tensor:
        raise KeyError(path)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


class _Opaque(Mapping[int, Any]):
    # rebuild() asks `id(obj) in objects` for each opaque object it meets: note that one was met
    def __init__(self) -> None:
        self.met = False

    def __contains__(self, key: object) -> bool:
        self.met = True
        return False

    def __getitem__(self, key: int) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


def skeleton(output: Any) -> Skeleton | None:
    """The skeleton of a call's output, or None when it holds opaque objects (the call must run)."""
    values, opaque = _Placeholders(), _Opaque()
    try:
        out = rebuild(output, values, objects=opaque)
    except Exception:  # a container that cannot be rebuilt: the call will run
        return None
    return None if opaque.met else Skeleton(out, values.meta)


@dataclass(**SLOTS)
class ChildCall:
    """A direct child call of a live call, as it returned: its module, name, golden entry and
    (``replay="all"``) the skeleton of its output."""

    module: torch.nn.Module
    name: str
    entry: CallEntry
    skeleton: Skeleton | None = None
    # the RNG state the live call left (a training-mode child that drew random numbers): a stub
    # that does not run sets it, so the parent's later draws are the live run's
    rng_end: RngState | None = None
    # its output shared memory with its input (a view, or the input itself: Identity, eval Dropout):
    # in the parent's replay it runs and keeps its own output, so the parent's later in-place ops
    # reach it as in the live run (a golden copy broke that: a false alarm)
    aliased: bool = False


class GoldenCache:
    """Golden tensors read for replays, the most recent ones up to ``budget`` bytes. One stored
    output is wanted up to four times: for its parent's replay (as the child's output), as the
    next call's input (an alias of it) in that call's replay and again when the parent judges
    what its code passed on. Callers copy before anything may change what they get."""

    def __init__(self, reader: GoldenReader, budget: int = 64 << 20):
        self.reader = reader
        self.budget = budget
        self.held = 0
        self._lru: OrderedDict[int, tuple[LeafEntry, torch.Tensor]] = OrderedDict()  # by id of the stored entry

    def load(self, entry: LeafEntry, where: str) -> torch.Tensor:
        target = self.reader.resolve(entry, where)
        hit = self._lru.get(id(target))
        if hit is not None:
            self._lru.move_to_end(id(target))
            return hit[1]
        t = self.reader.load(target, where)
        n = t.numel() * t.element_size()
        if n <= self.budget // 4:
            self._lru[id(target)] = (target, t)  # the entry is kept, so its id is not reused
            self.held += n
            while self.held > self.budget:
                _, (_, old) = self._lru.popitem(last=False)
                self.held -= old.numel() * old.element_size()
        return t


class GoldenOutputs:
    """The golden output tensors of a call's children, read once per replay (by path)."""

    def __init__(self, reader: GoldenCache, calls: Sequence[ChildCall]):
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
    replay, ``inputs[i]`` holds the tensors child call ``i`` received (copies, by input path)."""

    def __init__(self, calls: Sequence[ChildCall], golden: GoldenOutputs):
        self.calls = calls
        self.golden = golden
        self.queues: dict[str, deque[int]] = {}
        for i, c in enumerate(calls):
            self.queues.setdefault(c.name, deque()).append(i)
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.active: list[int | None] = []  # calls of hooked children in progress (outermost first)

    @contextmanager
    def installed(self, modules: Mapping[str, torch.nn.Module], *, widen: bool = False) -> Iterator[None]:
        """Hooks on ``modules`` (child name -> the module to hook: the live one, or its float64 copy,
        ``widen``: whose floating outputs are float64). A child whose every call has a skeleton
        does not run: its ``forward`` is replaced, for the replay, by one returning the golden's
        output (no hooks needed); the others get a pre- and a post-hook."""
        handles = []
        stubbed: list[torch.nn.Module] = []
        stub = self.stubbed(modules)
        try:
            for name, mod in modules.items():
                if name not in self.queues:
                    continue
                if id(mod) in stub:
                    mod.forward = partial(self._stub, name, mod, widen)  # type: ignore[method-assign]
                    stubbed.append(mod)
                    continue
                handles.append(mod.register_forward_pre_hook(partial(self._pre, name), with_kwargs=True))
                # prepended: the golden output replaces what the child's forward returned, before
                # the child's own forward hooks rewrite it as they did in the live run
                handles.append(mod.register_forward_hook(partial(self._post, name), with_kwargs=True, prepend=True))
            yield
        finally:
            for h in handles:
                h.remove()
            for mod in stubbed:
                del mod.forward

    def stubbed(self, modules: Mapping[str, torch.nn.Module]) -> set[int]:
        """The ids of the modules that will not run during the replay (every call has a skeleton).
        None while a global forward hook is registered: it runs after a stub too and would rewrite
        the golden output a second time (the capture read it after that hook)."""
        if torch.nn.modules.module._global_forward_hooks:
            return set()
        return {id(mod) for name, mod in modules.items() if name in self.queues and "forward" not in mod.__dict__
                and all(self.calls[i].skeleton is not None for i in self.queues[name])}

    def _next(self, name: str, args: Any, kwargs: Any) -> int | None:
        """The live call a call of child ``name`` replays (its inputs kept), or None."""
        queue = self.queues[name]
        if self.active or not queue:  # inside another child, or a call the live run did not make
            return None
        i = queue.popleft()
        self.inputs[i] = {leaf.path: leaf.tensor.detach().clone() for leaf in flatten_inputs(args, kwargs)
                          if leaf.kind == "tensor" and leaf.tensor is not None}
        return i

    def _pre(self, name: str, mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self.active.append(self._next(name, args, kwargs))

    def _post(self, name: str, mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        i = self.active.pop()
        if i is None or self.calls[i].aliased:
            return None
        golden = self.golden.get(i)
        live = {leaf.path: leaf.tensor for leaf in flatten(output) if leaf.kind == "tensor" and leaf.tensor is not None}
        if not _fits({p: (tuple(t.shape), t.dtype, t.device) for p, t in live.items()}, golden):
            return None  # another structure: this call keeps its own output
        # a copy each time: the parent may change what it gets in place
        try:
            return rebuild(output, {p: devices.golden_on(golden[p], t.device, t.dtype, copy=True)
                                    for p, t in live.items()})
        except UnsupportedTensorError:  # a wrapper subclass that cannot be rebuilt: it keeps its own output
            return None

    def _stub(self, name: str, mod: torch.nn.Module, widen: bool, *args: Any, **kwargs: Any) -> Any:
        i = self._next(name, args, kwargs)
        sk = None if i is None else self.calls[i].skeleton
        golden = None if i is None else self.golden.get(i)
        if i is None or sk is None or golden is None or not _fits(sk.meta, golden):
            # it runs after all (calls inside it are not its parent's); the replay did not plan to
            # restore its buffers, so this does
            self.active.append(None)
            mods = list(mod.modules())
            saved = saved_buffers([b for m in mods for b in m._buffers.values() if b is not None])
            aside = buffers_aside(mods)
            try:
                return type(mod).forward(mod, *args, **kwargs)
            finally:
                self.active.pop()
                buffers_back(aside)
                restore_buffers(saved)
        end = self.calls[i].rng_end
        if end is not None:
            set_rng_state(end)
        return rebuild(sk.output, {p: golden[p].clone() if dt is None
                                   else devices.golden_on(golden[p], dev, _wide(dt) if widen else dt, copy=True)
                                   for p, (_, dt, dev) in sk.meta.items()})


Aside = list[tuple[torch.nn.Module, dict[str, "torch.Tensor | None"]]]


def buffers_aside(modules: Iterable[torch.nn.Module]) -> Aside:
    """Each module's buffers replaced by copies while a replay runs (:func:`buffers_back` puts the
    live tensors back). A replayed forward may write its buffers (BatchNorm's running statistics in
    training mode), and so may the rewind to the values they had at the call's start; autograd may
    have saved the live tensor for the backward (a training-mode batch norm saves its running
    statistics), which raises if its in-place version moved, even when its value is put back after.
    A buffer registered twice gets one copy; one that cannot be copied (an odd subclass) stays."""
    out: Aside = []
    copies: dict[int, torch.Tensor] = {}
    for m in modules:
        if not m._buffers:  # (most modules have none)
            continue
        live = dict(m._buffers)
        for k, b in live.items():
            if b is None:
                continue
            c = copies.get(id(b))
            if c is None:
                try:
                    c = b.detach().clone().requires_grad_(b.requires_grad)
                except (RuntimeError, TypeError, NotImplementedError):
                    continue
                copies[id(b)] = c
            m._buffers[k] = c
        out.append((m, live))
    return out


def buffers_back(aside: Aside) -> None:
    """The live buffers back in their modules, as they were before :func:`buffers_aside` (a buffer
    the replay assigned or registered anew is dropped with its copy)."""
    for m, live in reversed(aside):
        m._buffers.clear()
        m._buffers.update(live)


SavedBuffer = tuple[torch.Tensor, torch.Tensor, "int | None"]


def saved_buffers(buffers: Sequence[torch.Tensor]) -> list[SavedBuffer]:
    """Each buffer with a copy of its value and its in-place version, before a replay runs: with
    its copy set aside (:func:`buffers_aside`) the live tensor changes only through a reference
    the modules' registries do not hold, and then its value is put back."""
    out = []
    for b in buffers:
        try:
            version: int | None = b._version
        except RuntimeError:  # an inference tensor has no version counter
            version = None
        out.append((b, b.detach().clone(), version))
    return out


def restore_buffers(saved: Sequence[SavedBuffer]) -> None:
    """Put back the values of the buffers a replay changed, and only those: a copy into one it
    left alone would bump the version of a tensor autograd saved for the backward (BERT's
    embedding saves a slice of its ``position_ids``), and the backward would raise."""
    with torch.no_grad():
        for b, v, version in saved:
            # by value too: a kernel may write a buffer without bumping its version (batch norm's
            # running statistics on the CPU)
            if (version is None or b._version == version) and torch.equal(b, v):
                continue
            b.copy_(v)


def _fits(meta: Mapping[str, TensorMeta], golden: Mapping[str, torch.Tensor]) -> bool:
    """The golden's tensors have the places and shapes of the live output's."""
    return set(meta) == set(golden) and all(tuple(golden[p].shape) == m[0] for p, m in meta.items())


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype.is_floating_point and not dtype.is_complex else dtype

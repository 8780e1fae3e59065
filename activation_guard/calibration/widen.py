"""The float64 copy's parameters, widened per module call into reused buffers instead of all at once.

A float64 copy of a 271M-parameter model is 2.17 GB of fresh pages: making it cost about half a
float64 forward (page faults, not arithmetic), and holding it is most of a calibrated run's memory.
Yet a module's parameters are needed only while that module runs. Here the copy's plain floating
parameters are *placeholders* (float64, the right shape and device, no data: one NaN broadcast), and
a forward pre-hook on each module widens the model's own parameters into buffers taken from a pool
kept by size, swapped in for the call and returned when it ends. Modules of one shape (every layer
of a transformer) share one buffer, so the pages are faulted once and the copy's memory is about
one layer's parameters plus the largest matrix.

This is only right while every use of a parameter's values happens inside its own module's call.
The copy's torch-function mode (:class:`.shadow.float32_random`) calls :func:`check_call` on every
operation, and any operation on a placeholder's data (anything but reading its shape, dtype or
device) trips the copy: it raises :class:`PlaceholderUsed` and records it, so that the caller runs
the model again with a whole float64 copy (:func:`.shadow._float64_copy`). A module that writes
into its own parameter during its call, or replaces it, trips it too (the whole copy would keep
that write for the next call), and so does reading a widened parameter's ``.data`` (a write no
version counter sees), address or storage (a cache keyed by them would meet the same buffer under
the next module of its size). A widened parameter has the whole copy's strides. The
placeholders' NaN makes any use the check could miss show up as a non-finite noise floor (judged
strictly, never more leniently).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LazyFloat64", "PlaceholderUsed", "check_call", "lazy_float64_copy"]


class PlaceholderUsed(RuntimeError):
    """A float64 copy's placeholder parameter was used outside its own module's call."""


# reading these of a placeholder is reading what the whole copy's parameter would say
_METADATA: frozenset[Any] = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.nelement, torch.Tensor.get_device, torch.Tensor.__hash__,
})

# the copies whose placeholders are live in this process: id(placeholder) -> (copy, "module.name");
# the copy weakly, so that a run dropped without closing it keeps nothing (the model's own
# parameters, the buffers) alive through this table, and its entries go when it is collected
_LIVE: dict[int, tuple[weakref.ref[LazyFloat64], str]] = {}

# the parameters widened for the module calls running now: id(parameter) -> (copy, "module.name")
_WIDE: dict[int, tuple[weakref.ref[LazyFloat64], str]] = {}

# reading these of a widened parameter escapes what the copy can see: ``.data`` is written without
# the version counter (a write the whole copy would keep for the next call), and an address or a
# storage may key a cache, while the buffer behind it serves the next module of its size
_UNTRACKED: dict[Any, str] = {
    torch.Tensor.data.__get__: ".data", torch.Tensor.data.__set__: ".data =",  # type: ignore[attr-defined]
    torch.Tensor.data_ptr: ".data_ptr()", torch.Tensor.untyped_storage: ".untyped_storage()",
    torch.Tensor.storage: ".storage()", torch.Tensor._typed_storage: "._typed_storage()",
}


def check_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
    """Raise :class:`PlaceholderUsed` when ``func`` would read a placeholder's data. Called for
    every operation under the float64 copy's torch-function mode while a lazy copy is alive."""
    if not _LIVE or func in _METADATA:
        return
    untracked = _UNTRACKED.get(func) if _WIDE else None
    for a in (*args, *(kwargs or {}).values()):
        found = _LIVE.get(id(a)) if isinstance(a, torch.Tensor) else None
        if found is None and isinstance(a, (list, tuple)):
            found = next((_LIVE[id(x)] for x in a if isinstance(x, torch.Tensor) and id(x) in _LIVE), None)
        if found is not None:
            owner = found[0]()
            if owner is not None:
                owner.trip(f"{found[1]} used outside its module's call ({getattr(func, '__name__', func)!s})")
        if untracked is not None and isinstance(a, torch.Tensor) and id(a) in _WIDE:
            owner = _WIDE[id(a)][0]()
            if owner is not None:
                owner.trip(f"{_WIDE[id(a)][1]} read through {untracked} during its call (a write no version counter "
                           f"sees, or a cache keyed by its address)")


class _Pool:
    """Buffers by (element count, device), taken for a module call and given back after it."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self.nbytes = 0

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        kept = self.free.get((numel, device))
        if kept:
            return kept.pop()
        self.nbytes += numel * 8
        return torch.empty(numel, dtype=torch.float64, device=device)

    def give(self, buf: torch.Tensor) -> None:
        self.free.setdefault((buf.numel(), buf.device), []).append(buf)


class LazyFloat64:
    """The pre- and post-hooks that give a float64 copy's modules their parameters per call."""

    def __init__(self) -> None:
        self.pool = _Pool()
        self.tripped: str | None = None  # why a placeholder was used, if one was
        self.nbytes = 0  # what the whole copy's placeholders stand for, in bytes
        # module of the copy -> [(key, placeholder, the model's own parameter, the whole copy's strides)]
        self.own: dict[int, list[tuple[str, torch.nn.Parameter, torch.Tensor, tuple[int, ...]]]] = {}
        # id(module) -> [(key, the parameter swapped in, its version then, its buffer)] while it runs
        self.active: dict[int, list[tuple[str, torch.nn.Parameter, int, torch.Tensor]]] = {}
        # id(module) -> [(a parameter widened for an earlier call that something still holds (an
        # output, a cache), its version then, its name)]: written since, the whole copy's would be too
        self.lent: dict[int, list[tuple[weakref.ref[torch.nn.Parameter], int, str]]] = {}
        self.handles: list[Any] = []
        self._forget: weakref.finalize[Any, Any] | None = None

    def trip(self, why: str) -> None:
        if self.tripped is None:
            self.tripped = why
        raise PlaceholderUsed(f"the lazily widened float64 copy needs a whole copy: {why}")

    def install(self, shadow: torch.nn.Module, names: dict[int, str]) -> None:
        me = weakref.ref(self)
        for mod in shadow.modules():
            entries = self.own.get(id(mod))
            if not entries:
                continue
            self.handles.append(mod.register_forward_pre_hook(self._pre, prepend=True))
            self.handles.append(mod.register_forward_hook(self._post, always_call=True))
            for key, ph, _, _ in entries:
                _LIVE[id(ph)] = (me, f"parameter {key!r} of {names.get(id(mod)) or '<root>'!r}")
        # on close, or when collected unclosed; only this copy's entries (an id may be reused after)
        self._forget = weakref.finalize(self, _forget, me, [id(ph) for e in self.own.values() for _, ph, _, _ in e])

    def widened(self, mod: torch.nn.Module, key: str, p: torch.Tensor) -> bool:
        """Whether ``p`` is parameter ``key`` of ``mod`` as widened for the call now running,
        unchanged since (so it holds the model's own parameter's values exactly)."""
        for k, q, version, _ in self.active.get(id(mod), ()):
            if k == key:
                return q is p and q._version == version
        return False

    def _pre(self, mod: torch.nn.Module, args: Any) -> None:
        if id(mod) in self.active:  # re-entered (a module calling itself): its buffers are in place
            self.trip("a module re-entered while running")
        self.check_lent(id(mod))
        swapped = []
        with torch.no_grad():
            for key, ph, orig, stride in self.own[id(mod)]:
                if mod._parameters.get(key) is not ph:  # other weights put in place for this call (functional_call)
                    continue
                buf = self.pool.take(ph.numel(), ph.device)
                # the whole copy's strides (a transposed or channels_last weight keeps its layout):
                # kernels pick their summation order by them
                view = buf.as_strided(ph.shape, stride)
                view.copy_(orig.detach())
                # requires_grad as the whole copy's: matmul folds a strided input by it (other bits)
                p = torch.nn.Parameter(view, requires_grad=ph.requires_grad)
                mod._parameters[key] = p
                swapped.append((key, p, p._version, buf))
                _WIDE[id(p)] = _LIVE[id(ph)]
        self.active[id(mod)] = swapped

    def _post(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        swapped = self.active.pop(id(mod), None)
        if swapped is None:
            return
        phs = {key: ph for key, ph, _, _ in self.own[id(mod)]}
        changed = replaced = None
        bufs = []
        p: torch.nn.Parameter | None = None  # bound even when no parameter was swapped in
        for key, p, version, buf in swapped:
            _WIDE.pop(id(p), None)
            if mod._parameters.get(key) is not p:  # the whole copy would keep the new one for the next call
                replaced = key
            elif p._version != version:
                changed = key
            mod._parameters[key] = phs[key]
            bufs.append((buf, weakref.ref(p), version, _LIVE[id(phs[key])][1]))  # written: tripped below
        del swapped, p
        for buf, ref, version, name in bufs:
            # a buffer something still refers to (an output that is a view of the parameter, a
            # cache of it on the module) is left to it, never handed to the next module
            if _alone(buf):
                self.pool.give(buf)
            else:
                self.lent.setdefault(id(mod), []).append((ref, version, name))
        if replaced is not None:
            self.trip(f"a module replaced its own parameter {replaced!r} during its call")
        if changed is not None:
            self.trip(f"a module wrote into its own parameter {changed!r} during its call")

    def check_lent(self, module: int | None = None) -> None:
        """Trip when a parameter an earlier call of ``module`` (None: of any module) left to what
        still holds it was written since (``a = table(); a += 1``): the whole copy's parameter
        would hold that write at the module's next call, or a replay's. A write through an alias
        that is no view of the parameter (``.detach()``) once the parameter itself is gone is not seen."""
        for mod in ([module] if module is not None else list(self.lent)):
            alive = []
            for ref, version, name in self.lent.get(mod, ()):
                p = ref()
                if p is None:
                    continue
                if p._version != version:
                    self.trip(f"{name} was written after its module's call returned it")
                alive.append((ref, version, name))
            if alive:
                self.lent[mod] = alive
            else:
                self.lent.pop(mod, None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self._forget is not None:  # its placeholders, and what calls an exception left unfinished had widened
            self._forget()
        self.own = {}
        self.active = {}
        self.lent = {}
        self.pool = _Pool()


def _forget(owner: weakref.ref[LazyFloat64], ids: list[int]) -> None:
    """Drop a copy's placeholders from the table (entries another copy took over since stay)."""
    for i in ids:
        if i in _LIVE and _LIVE[i][0] is owner:
            del _LIVE[i]
    for i in [i for i, (o, _) in _WIDE.items() if o is owner]:
        del _WIDE[i]


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _alone(buf: torch.Tensor) -> bool:
    """Whether ``buf`` is the only tensor on its storage (the count includes the storage object
    asked); unknown (no such function in this torch) is not alone."""
    if _USE_COUNT is None:
        return False
    return bool(_USE_COUNT(buf.untyped_storage()._cdata) <= 2)


def _eligible(p: torch.Tensor, device: torch.device) -> bool:
    return (type(p) is torch.nn.Parameter and p.is_floating_point() and p.dtype != torch.float64
            and p.device == device and p.layout == torch.strided and p.numel() > 0)


def lazy_float64_copy(model: torch.nn.Module, device: torch.device,
                      convert: Callable[[torch.nn.Module], None]) -> tuple[torch.nn.Module, LazyFloat64]:
    """``copy.deepcopy(model)`` whose plain floating parameters on ``device`` are placeholders,
    widened per call by the returned :class:`LazyFloat64` (installed by the caller once the copy
    is final); ``convert(copy)`` makes the rest of the copy float64 (buffers, other parameters)."""
    lazy = LazyFloat64()
    memo: dict[int, Any] = {}
    nan = torch.full((1,), float("nan"), dtype=torch.float64, device=device)
    # recurrent modules keep their own list of weight tensors (``_flat_weights``) beside
    # ``_parameters``: they get whole float64 parameters, as in a whole copy
    rnn = {id(q) for m in model.modules() if isinstance(m, torch.nn.RNNBase) for q in m.parameters()}
    for p in model.parameters():
        if _eligible(p, device) and id(p) not in rnn:
            ph = torch.nn.Parameter(nan.expand(p.shape), p.requires_grad)
            memo[id(p)] = ph
    placeholders: dict[int, torch.nn.Parameter] = {id(ph): ph for ph in memo.values()}
    # what ``p.detach().to(torch.float64)`` gives (the whole copy): the same strides where ``p`` is
    # dense and non-overlapping (a contiguous one is), else contiguous ones
    strides = {id(memo[id(p)]): tuple(p.stride() if p.is_contiguous() else
                                      torch.empty_like(p, dtype=torch.float64, device="meta").stride())
               for p in model.parameters() if id(p) in memo}
    originals: dict[int, torch.Tensor] = {id(memo[id(p)]): p for p in model.parameters() if id(p) in memo}
    shadow = copy.deepcopy(model, memo)
    names: dict[int, str] = {}
    for name, mod in shadow.named_modules():
        names[id(mod)] = name
        entries = [(k, placeholders[id(v)], originals[id(v)], strides[id(v)]) for k, v in mod._parameters.items()
                   if v is not None and id(v) in placeholders]
        if entries:
            lazy.own[id(mod)] = entries
    # only the placeholders the copy holds (a module's own ``__deepcopy__`` may copy its parameters whole)
    held = {id(ph): ph for entries in lazy.own.values() for _, ph, _, _ in entries}
    lazy.nbytes = sum(ph.numel() * 8 for ph in held.values())
    convert(shadow)
    # the conversion must leave the placeholders in place (a module's own ``_apply`` might not)
    if any(mod._parameters.get(k) is not ph for mod in shadow.modules() for k, ph, _, _ in lazy.own.get(id(mod), [])):
        raise PlaceholderUsed("converting the copy replaced a placeholder parameter")
    lazy.install(shadow, names)
    return shadow, lazy

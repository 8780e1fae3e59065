"""Putting values back into a call's own structures: a copy of model inputs with their tensors
cloned (so a run that changes its inputs cannot change what another run sees), and a call's
arguments or output rebuilt around the golden's tensors at the paths :func:`~.leaves.flatten`
gives them (how a replay hands a layer the golden's inputs, and a child the golden's output).

Taken out of ``leaves`` (which flattens values into leaves): this is the way back.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from .leaves import MAX_DEPTH, UnsupportedTensorError, is_wrapper, plain_namespace, walked_sequence
from .paths import SUBCLASS_CTX, encode_key, encode_str_key, join_path


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], depth: int = 0) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``, numpy arrays and ``torch.Generator``
    objects copied (the latter with their state); lists, tuples,
    named tuples, mappings and dataclasses are rebuilt (a mapping whose type cannot be rebuilt from
    a dict becomes one), other objects are shared. Model inputs go through this before a run that may change them."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, torch.Generator):
        # a copy with the same state: the run on these copies draws what the real run will draw,
        # and does not advance the caller's generator (a calibrated record once changed what it
        # recorded, and its floors measured two different noises)
        g = torch.Generator(device=obj.device)
        g.set_state(obj.get_state())
        return g
    if depth > MAX_DEPTH:
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn, depth + 1) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, depth + 1) for v in obj)
    if type(obj) is deque:
        return deque((map_tensors(v, fn, depth + 1) for v in obj), maxlen=obj.maxlen)
    if plain_namespace(obj):
        return SimpleNamespace(**{k: map_tensors(v, fn, depth + 1) for k, v in vars(obj).items()})
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn, depth + 1) for k, v in obj.items()}
        ctor: Any = type(obj)
        try:
            return ctor(items)
        except Exception:
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # a dataclass argument: its tensors copied too (a pre-hook that changes one in place)
        try:
            return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn, depth + 1)
                                               for f in dataclasses.fields(obj) if f.init})
        except Exception:  # a dataclass that cannot be rebuilt this way is shared, as before
            return obj
    return obj


def clone_inputs(obj: Any) -> Any:
    """A copy of model inputs whose tensors are cloned, so a forward that modifies its inputs in
    place cannot change what another run sees."""
    return map_tensors(obj, lambda t: t.detach().clone())


def rebuild(obj: Any, values: Mapping[str, torch.Tensor], prefix: str = "", *,
            objects: Mapping[int, Any] | None = None, copy_objects: bool = True) -> Any:
    """``obj`` with each tensor (or number: flattened as a 0-d tensor) whose :func:`flatten` path is
    in ``values`` replaced by that value: the same structure (containers rebuilt, repeated and cyclic
    references kept), other data. How replay hands a layer the golden's inputs in the shape of the live call's own
    arguments. ``objects``: opaque objects (a KV cache) are replaced by a fresh copy of the one
    given for them (by ``id``), so a replay sees them as they were and cannot mutate the live one;
    ``copy_objects=False`` hands over the given ones themselves (their last use)."""
    return _Rebuilder(values, objects, copy_objects).walk(obj, prefix, 0)


class _Rebuilder:
    # a class, not a recursive closure: a closure that calls itself is a reference cycle, which
    # would keep the golden tensors alive until the cyclic collector runs
    def __init__(self, values: Mapping[str, torch.Tensor], objects: Mapping[int, Any] | None,
                 copy_objects: bool = True):
        self.values = values
        self.objects = objects
        self.copy_objects = copy_objects
        self.seen: dict[int, Any] = {}

    def walk(self, o: Any, path: str, depth: int) -> Any:
        values, seen = self.values, self.seen
        if isinstance(o, torch.Tensor):
            if path in values or not is_wrapper(o) or depth >= MAX_DEPTH:
                return values.get(path, o)
            # a wrapper subclass was flattened into its inner tensors: rebuilt around the given ones
            attrs, live_ctx = o.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = {a: self.walk(getattr(o, a), join_path(path, encode_str_key(a)), depth + 1) for a in attrs}
            # its metadata too: numbers in it (a scale) are the golden's
            ctx = None if live_ctx is None else self.walk(live_ctx, join_path(path, SUBCLASS_CTX), depth + 1)
            if all(inner[a] is getattr(o, a) for a in attrs) and ctx is live_ctx:
                return o
            try:
                return type(o).__tensor_unflatten__(inner, ctx, o.size(), o.stride())  # type: ignore[attr-defined]
            except Exception as e:
                raise UnsupportedTensorError(f"a {type(o).__name__} cannot be rebuilt from the golden's tensors "
                                             f"({type(e).__name__}: {e})") from None
        if isinstance(o, np.ndarray):
            return values[path].numpy() if path in values else o
        if isinstance(o, (bool, int, float, complex, np.generic)):  # a number: stored as a 0-d tensor
            v = values.get(path)
            return o if v is None else type(o)(v.item())
        if o is None or isinstance(o, (str, bytes)):
            return o
        if id(o) in seen:
            return seen[id(o)]
        is_map = isinstance(o, Mapping)
        is_seq = walked_sequence(o)
        is_ns = plain_namespace(o)  # (leaves walks its attributes as str keys)
        is_dc = dataclasses.is_dataclass(o) and not isinstance(o, type)
        if depth >= MAX_DEPTH or not (is_map or is_seq or is_dc or is_ns):
            if self.objects is not None and id(o) in self.objects:
                given = self.objects[id(o)]
                return _private(given) if self.copy_objects else given
            return o
        if type(o) is dict:  # registered before its items: a cycle through it comes back to it
            new: Any = {}
            seen[id(o)] = new
            for k, v in o.items():
                new[k] = self.walk(v, join_path(path, encode_key(k)), depth + 1)
            return new
        if type(o) is list:
            new = []
            seen[id(o)] = new
            new.extend(self.walk(v, join_path(path, str(i)), depth + 1) for i, v in enumerate(o))
            return new
        seen[id(o)] = o  # other containers are rebuilt after their items (a cycle meets the original)
        if is_ns:
            new = SimpleNamespace(**{k: self.walk(v, join_path(path, encode_key(k)), depth + 1)
                                     for k, v in vars(o).items()})
        elif is_map:
            items = {k: self.walk(v, join_path(path, encode_key(k)), depth + 1) for k, v in o.items()}
            ctor: Any = type(o)
            try:
                new = ctor(items)
            except Exception:
                new = items
        elif is_seq:
            parts = [self.walk(v, join_path(path, str(i)), depth + 1) for i, v in enumerate(o)]
            if type(o) is deque:
                new = deque(parts, maxlen=o.maxlen)
            else:
                new = type(o)(*parts) if isinstance(o, tuple) and hasattr(o, "_fields") else type(o)(parts)
        else:
            changes = {f.name: self.walk(getattr(o, f.name, None), join_path(path, encode_str_key(f.name)), depth + 1)
                       for f in dataclasses.fields(o) if f.init}
            new = dataclasses.replace(o, **changes)
        seen[id(o)] = new
        return new


def _private(o: Any) -> Any:
    try:
        return copy.deepcopy(o)
    except Exception:  # an object that cannot be copied is shared (the replay may change it)
        return o


def rebuild_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any], values: Mapping[str, torch.Tensor],
                   *, objects: Mapping[int, Any] | None = None,
                   copy_objects: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments with the tensors at :func:`flatten_inputs` paths replaced."""
    new = rebuild({"args": list(args), "kwargs": kwargs}, values, objects=objects, copy_objects=copy_objects)
    return tuple(new["args"]), dict(new["kwargs"])

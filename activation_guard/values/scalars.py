"""Python numbers as 0-d tensors, one tensor per value, shared by every leaf that holds it.

A layer called with ``use_cache=True`` (every block and attention layer of a Hugging Face
transformer) gives a number leaf per call, stored like a 0-d tensor (:mod:`.leaves`). Making that
tensor in a hook during a real forward is not the 2-3 us it costs in a loop: the forward has
evicted the caches (~50-130 us for ``torch.tensor(True)`` after streaming 64 MB), and torch
releases the GIL, which the fingerprint worker then holds for its Python. On GPT-2 small, making
its 24 such tensors once instead of per call took the recording with fingerprints from 1.296x to
1.272x the forward (docs/performance.md, "tenth session").

The shared tensors are values to read, never to write: nothing in this package writes into a
leaf's tensor, and the recorder never keeps a number leaf as a value a later input may refer to
(one shared tensor would otherwise look like the same value passed on from call to call). A
tensor is only shared where ``torch.tensor`` would make a plain CPU tensor: under a torch function
or dispatch mode (``torch.set_default_device``, a fake-tensor mode) each number gets a fresh one,
made by that mode, as before.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import torch

MAX_KEPT = 4096  # values kept; then the table starts afresh (a model passing a new float each call)

_SHARED = frozenset({bool, int, float, complex})  # exact types: a subclass (an IntEnum member) gets its own
_KEPT: dict[tuple[Any, ...], torch.Tensor] = {}
_PACK_D = struct.Struct("<d").pack
_PACK_DD = struct.Struct("<dd").pack


# how many torch function and dispatch modes are on; a torch without these counts one: never share
_fn_stack: Callable[[], int] = getattr(torch._C, "_len_torch_function_stack", lambda: 1)
_dispatch_stack: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)


def _modes_off() -> bool:
    return _fn_stack() == 0 and _dispatch_stack() == 0


def _key(obj: bool | int | float | complex) -> tuple[Any, ...]:
    """Exact: a float by its bits (``-0.0`` and ``0.0``, NaN payloads stay apart)."""
    kind = type(obj)
    if kind is float:
        return (float, _PACK_D(obj))
    if kind is complex:
        return (complex, _PACK_DD(obj.real, obj.imag))  # type: ignore[union-attr]
    return (kind, obj)


def number_tensor(obj: bool | int | float | complex, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(obj, dtype=dtype)``: the walker's 0-d tensor of a Python number (bool, int64,
    float64 or complex128; an int must fit int64: the walker checks). Shared for exact
    ``bool``/``int``/``float``/``complex`` values outside any torch mode; fresh otherwise (a
    subclass such as an ``IntEnum`` member, a mode)."""
    if type(obj) not in _SHARED or not _modes_off():
        return torch.tensor(obj, dtype=dtype)
    key = _key(obj)
    t = _KEPT.get(key)
    if t is None:
        with torch.inference_mode(False):  # a plain tensor whatever mode the first caller ran in
            t = torch.tensor(obj, dtype=dtype)
        if len(_KEPT) >= MAX_KEPT:
            _KEPT.clear()
        _KEPT[key] = t
    return t

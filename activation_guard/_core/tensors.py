"""Predicates on torch tensors shared by the recorder, the fingerprint worker and the comparator."""

from __future__ import annotations

from typing import Any, Callable

import torch

_STRIDED = torch.strided
# a tensor inside vmap/grad (no storage of its own); both names guarded: torch>=2.1 is supported
wrapped: Callable[[torch.Tensor], bool] = getattr(getattr(torch._C, "_functorch", None),
                                                  "is_functorch_wrapped_tensor", lambda t: False)


def version_counter(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter: what tells an unchanged tensor from one written in
    place since (None for inference tensors, and anything else without one)."""
    try:
        return int(t._version)
    except (AttributeError, RuntimeError):
        return None


def is_plain_tensor(t: Any) -> bool:
    """A plain strided tensor on a real device: its own leaf, as is (the common case, decided
    without the walker: most layers take and return one such tensor)."""
    return (type(t) is torch.Tensor and t.layout is _STRIDED and not t.is_quantized and not t.is_nested
            and not t.is_meta and not wrapped(t))

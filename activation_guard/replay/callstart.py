"""What a layer call looked like when it started, for replaying it later (compare with replay).

A replay re-runs a call after it returned, so anything the call (or a later one) changed in place
must be known as it was at the start: the versions of its input tensors (did the layer change its
inputs?), copies of opaque objects it may mutate (a KV cache), and its module's own buffers (a
running statistic it updates). Kept apart from :mod:`activation_guard.replay.replay`, which decides what a
replay means; this module only takes the snapshot, at every call's start.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.slots import SLOTS
from ..capture.hooks import Frame
from .children import ChildCall


@dataclass(**SLOTS)
class CallStart:
    """What a call's arguments were when it started, beyond their tensors' values: the tensors'
    in-place versions (did the layer change its inputs?) and copies of opaque objects (a KV cache
    the layer appends to), so a replay sees them as the live call did."""

    versions: list[tuple[torch.Tensor, int]]
    objects: dict[int, Any]
    children: list[ChildCall] = field(default_factory=list)  # its direct child calls, as they returned
    # the module's own buffers: (name, buffer, in-place version at the start or None when it has
    # none, a copy of the starting value when small enough): a call that updates a running
    # statistic is replayed from the state it started in, not from the one it left
    buffers: list[tuple[str, torch.Tensor, int | None, torch.Tensor | None]] = field(default_factory=list)


def modified_in_place(frame: Frame) -> bool:
    """Whether a tensor the call received changed in place since it started."""
    start = frame.data
    if not isinstance(start, CallStart):
        return False
    return any(t._version != v for t, v in start.versions)


_PLAIN = (str, bytes, bool, int, float, complex, type(None))


SNAPSHOT_NUMEL = 1 << 14  # a buffer up to this size is copied at each call's start (replay modes)


def remember_start(frame: Frame) -> None:
    """At a call's start (compare with replay): see :class:`CallStart`. (Runs at every layer
    call: plain tensor arguments, the common case, are taken without a call of :func:`_scan`.)"""
    start = CallStart([], {}, [], [])
    versions = start.versions
    for group in (frame.args, frame.kwargs.values()):
        for v in group:
            if type(v) is torch.Tensor:
                try:  # noqa: SIM105  (as in _scan)
                    versions.append((v, v._version))
                except RuntimeError:  # inference tensors have no version counter
                    pass
            else:
                _scan(start, v, 0)
    own = frame.module._buffers
    if own:
        for name, b in own.items():
            if b is None:
                continue
            try:
                version: int | None = b._version
            except RuntimeError:  # an inference tensor has no version counter
                version = None
            snap = b.detach().clone() if b.numel() <= SNAPSHOT_NUMEL else None
            start.buffers.append((name, b, version, snap))
    frame.data = start


def start_values(start: CallStart, module: torch.nn.Module) -> list[tuple[str, torch.Tensor]] | str:
    """The starting values of the buffers the call changed, in place or by assigning another tensor
    (``self.count = self.count + 1``), by name; or why it cannot be replayed from its starting state."""
    out = []
    for name, b, version, snap in start.buffers:
        in_place = True if version is None else b._version != version
        if not in_place and module._buffers.get(name) is b:
            continue
        if snap is None:
            how = "in place" if in_place else "by assigning another tensor"
            return (f"it changed its buffer {name!r} {how} during the call (a running statistic?), and the "
                    f"buffer is too large to copy at every call's start, so a re-run would start from another state")
        out.append((name, snap))
    return out


def _scan(start: CallStart, v: Any, depth: int) -> None:
    # a module-level function, not a closure: a recursive closure is a reference cycle that would
    # keep every call's input tensors alive until the cyclic collector runs (+46 MiB measured)
    if isinstance(v, torch.Tensor):
        try:  # noqa: SIM105  (contextlib.suppress costs ~0.7 us per input of every call)
            start.versions.append((v, v._version))
        except RuntimeError:  # inference tensors have no version counter
            pass
    elif isinstance(v, (*_PLAIN, torch.nn.Module)) or depth > 2:
        return
    elif type(v) in (list, tuple, dict):
        for x in (v.values() if isinstance(v, dict) else v):
            _scan(start, x, depth + 1)
    elif id(v) not in start.objects:
        try:
            start.objects[id(v)] = copy.deepcopy(v)
        except Exception:  # cannot be copied: the replay is told it may differ
            start.objects[id(v)] = None

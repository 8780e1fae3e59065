"""What a forward changed in the model's own state: buffers updated in place.

A golden holds what each layer returned. A forward can also change the model itself: BatchNorm's
running statistics in training mode, a cache or a step counter kept in a buffer. Those new values
are what the next forward (or eval mode) computes with, but no layer returns them, so a refactor
that updates them differently passes every layer of this forward (a BatchNorm
port with a wrong momentum passed record and compare). The report says so instead of staying
silent; comparing the state itself would need a section of its own in the golden.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .._core.tensors import version_counter
from ..options.selection import few

# copies of buffers to look for in-place writes (BatchNorm updates its running statistics in its
# native kernel without bumping their version counters); beyond this, version counters only
SNAPSHOT_BYTES = 64 * 1024 * 1024


Modules = Sequence[tuple[str, torch.nn.Module]]


def _buffers(modules: Modules) -> Iterator[tuple[str, torch.Tensor]]:
    """Every buffer once, by its dotted name, from the modules walked once (``Target.modules``):
    ``named_buffers()`` walks the model again, ~6,000 instructions per module, twice per run."""
    seen: set[int] = set()
    for prefix, mod in modules:
        if not mod._buffers:  # (most modules have none)
            continue
        for k, buf in mod._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield (f"{prefix}.{k}" if prefix else k), buf


Snapshot = tuple[int, "int | None", "torch.Tensor | None"]  # (id, version counter, copy of the bytes)


def versions(modules: Modules) -> dict[str, Snapshot]:
    """Each buffer's identity, version counter (None where it has none: an inference-mode tensor)
    and, within :data:`SNAPSHOT_BYTES` in all, a copy of its bytes."""
    out: dict[str, Snapshot] = {}
    budget = SNAPSHOT_BYTES
    for name, buf in _buffers(modules):
        copy = None
        try:
            raw = _bytes(buf)
            if raw is not None and raw.numel() <= budget:
                copy = raw.clone()
                budget -= raw.numel()
        except (RuntimeError, TypeError):  # a tensor subclass, an odd layout: by its counter only
            copy = None
        out[name] = (id(buf), version_counter(buf), copy)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    if type(t) is not torch.Tensor or t.is_meta:
        return None
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _changed(buf: torch.Tensor, was: Snapshot) -> bool:
    """Its values changed: by its bytes where copied, else by its counter (same tensor) or identity
    (a tensor put in its place, e.g. an equal clone, counts only if no copy can tell)."""
    ident, version, copy = was
    try:
        if copy is not None:
            now = _bytes(buf)
            return now is None or now.numel() != copy.numel() or not torch.equal(now, copy)
        if id(buf) != ident:
            return True
        return version is not None and version_counter(buf) != version
    except (RuntimeError, TypeError):
        return False


def updated_note(modules: Modules, before: dict[str, Snapshot]) -> list[str]:
    """A note naming the buffers whose values the forward replaced, or nothing."""
    changed = []
    for name, buf in _buffers(modules):
        was = before.get(name)
        if was is None or _changed(buf, was):  # (None: a buffer assigned during the forward)
            changed.append(name)
    if not changed:
        return []
    shown = few(changed, 4)
    return [f"the forward updated {len(changed)} buffer(s) of the model in place ({shown}): their new values are "
            f"not compared (what the next forward starts from, e.g. BatchNorm running statistics in training mode)"]

"""What a forward changed in the model's own state: buffers updated in place.

A golden holds what each layer returned. A forward can also change the model itself: BatchNorm's
running statistics in training mode, a cache or a step counter kept in a buffer. Those new values
are what the next forward (or eval mode) computes with, but no layer returns them, so a refactor
that updates them differently passes every layer of this forward (found by review: a BatchNorm
port with a wrong momentum passed record and compare). The report says so instead of staying
silent; comparing the state itself would need a section of its own in the golden.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

# copies of buffers to look for in-place writes (BatchNorm updates its running statistics in its
# native kernel without bumping their version counters); beyond this, version counters only
SNAPSHOT_BYTES = 64 * 1024 * 1024


Modules = Sequence[tuple[str, torch.nn.Module]]


def _buffers(modules: Modules) -> Iterator[tuple[str, torch.Tensor]]:
    """Every buffer once, by its dotted name, from the modules walked once (``Target.modules``):
    ``named_buffers()`` walks the model again, ~6,000 instructions per module, twice per run."""
    seen: set[int] = set()
    for prefix, mod in [pm for pm in modules if pm[1]._buffers]:  # (most modules have none)
        for k, buf in mod._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield (f"{prefix}.{k}" if prefix else k), buf


def versions(modules: Modules) -> dict[str, tuple[int, torch.Tensor | None]]:
    """Each buffer's version counter and, within :data:`SNAPSHOT_BYTES` in all, a copy of its bytes."""
    out: dict[str, tuple[int, torch.Tensor | None]] = {}
    budget = SNAPSHOT_BYTES
    for name, buf in _buffers(modules):
        try:
            raw = _bytes(buf)
            copy = None
            if raw is not None and raw.numel() <= budget:
                copy = raw.clone()
                budget -= raw.numel()
            out[name] = (buf._version, copy)
        except (AttributeError, RuntimeError, TypeError):  # inference or meta tensors, tensor subclasses
            continue
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    if type(t) is not torch.Tensor or t.is_meta:
        return None
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def updated_note(modules: Modules, before: dict[str, tuple[int, torch.Tensor | None]]) -> list[str]:
    """A note naming the buffers whose values the forward replaced, or nothing."""
    changed = []
    for name, buf in _buffers(modules):
        was = before.get(name)
        if was is None:
            changed.append(name)  # a buffer assigned during the forward
            continue
        version, copy = was
        try:
            now = _bytes(buf) if copy is not None else None
            if buf._version != version or (now is not None and copy is not None and not torch.equal(now, copy)):
                changed.append(name)
        except (AttributeError, RuntimeError, TypeError):
            continue
    if not changed:
        return []
    shown = ", ".join(repr(n) for n in changed[:4]) + (", ..." if len(changed) > 4 else "")
    return [f"the forward updated {len(changed)} buffer(s) of the model in place ({shown}): their new values are "
            f"not compared (what the next forward starts from, e.g. BatchNorm running statistics in training mode)"]

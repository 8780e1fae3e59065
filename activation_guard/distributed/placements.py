"""Placements the user declares for plain local shards, and their reassembly into full tensors.

A module between parallelized ones returns this rank's piece of a value as a plain tensor; to
compare it with a single-device golden the user says how it is placed
(``placements={"*.act": Shard(-1)}``, glob patterns over dotted layer names) and every rank
gathers the pieces. Patterns and values are validated by the compare spec (option ``placements``);
this module matches them to layers and gathers. The gather is a collective: it runs for each
matching hooked output in hook order, which is the same on every rank, and every decision that
could raise (shapes, dtypes, dimension) is taken from data all ranks gathered, so either all ranks
raise or none does.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._core.errors import DistributedError
from ..options.spec import PlacementTable
from .ranks import ShardLayout

MAX_DIMS = 64  # shape slots in the fixed-size header every rank gathers first


def _replicate_type() -> Any:
    from torch.distributed.tensor import Replicate  # lazy: seconds of import, only when used

    return Replicate


class Placements(Mapping[str, Any]):
    """``{glob: Shard(dim) | Replicate()}`` with the group the pieces come from, for a 2-D mesh:
    ``compare(..., placements=Placements({"*.act": Shard(-1)}, group=mesh["tp"]))``.

    A plain dict is enough when the pieces come from the whole world. Values are validated by the
    compare spec (:mod:`activation_guard.options.spec`, option ``placements``), like every option.
    """

    def __init__(self, mapping: Mapping[str, Any], *, group: Any = None):
        if not isinstance(mapping, Mapping):
            raise TypeError("Placements needs a dict of layer-name glob patterns -> Shard(dim) or Replicate(), "
                            f"got {type(mapping).__name__}")
        self._items = dict(mapping)
        self.group = _as_group(group)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Placements({self._items!r})"


class PlacementMatcher:
    """Which declared placement applies to a layer's output, and which patterns matched nothing.

    Patterns are globs of dotted layer names, or of ``layer/path`` for one output of a layer that
    returns several (see :meth:`for_leaf`). A layer matched by patterns giving different
    placements is an error naming them, never a silent choice.
    """

    def __init__(self, table: PlacementTable):
        self.items = [(r.pattern, r.placement) for r in table.rules]
        self.group = table.group
        self.used: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.items)

    def for_leaf(self, name: str, path: str = "") -> tuple[str, Any] | None:
        """``(pattern, placement)`` declared for output ``path`` of layer ``name``, or None.

        A pattern matches a layer name (every tensor in the layer's output) or ``name/path``, one
        output inside a tuple or dict (``"*.self_attn/1"``: the second element).
        """
        full = f"{name}/{path}" if path else None
        hits = [(p, v) for p, v in self.items
                if fnmatch.fnmatchcase(name, p) or (full is not None and fnmatch.fnmatchcase(full, p))]
        if not hits:
            return None
        self.used.update(p for p, _ in hits)
        first = hits[0][1]
        for p, v in hits[1:]:
            if v != first:
                raise DistributedError(
                    f"layer {full or name!r} matches placements patterns {hits[0][0]!r} ({first!r}) and {p!r} "
                    f"({v!r}); make the patterns select disjoint layers")
        return hits[0]

    def unmatched(self) -> list[str]:
        return [p for p, _ in self.items if p not in self.used]


def _as_group(group: Any) -> Any:
    if group is None:
        return None
    if type(group).__name__ == "DeviceMesh":
        if group.ndim != 1:
            raise DistributedError(f"placements group: a {group.ndim}-D DeviceMesh; pass the one-dimensional "
                                   "mesh that shards the values (e.g. mesh['tp'])")
        return group.get_group()
    return group


def comm_device(group: Any, device: torch.device) -> torch.device:
    """Where a gather's buffers must be for ``group``'s backend: a group with NCCL alone (no gloo
    for CPU tensors) takes the current CUDA device's; anything else, the value's own device."""
    if device.type == "cuda":
        return device
    try:
        backend = str(torch.distributed.get_backend(group))
    except (RuntimeError, ValueError):
        return device
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else device


def group_ranks(group: Any) -> list[int]:
    dist = torch.distributed
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def reassemble(t: torch.Tensor, placement: Any, *, group: Any = None,
               where: str = "") -> tuple[torch.Tensor, ShardLayout]:
    """Gather the pieces of a value placed as ``placement`` over ``group``; return the full tensor
    and its layout. Collective: every rank of the group must call it for the same value.

    Pieces may be uneven (torch.chunk-style or any sizes): shapes are gathered first, then the
    bytes, padded to the longest piece. Bytes, not values, travel: any dtype, bit-exact.
    ``where`` names the layer and pattern in errors.
    """
    dist = torch.distributed
    ranks = group_ranks(group)
    n = len(ranks)
    if isinstance(placement, _replicate_type()) or n == 1:
        return t, ShardLayout((n,), tuple(ranks), (("replicate",),), f"{placement!r} over {n} ranks")
    t = t.detach()
    home = t.device
    t = t.to(comm_device(group, home))  # an NCCL-only group moves CUDA tensors only
    if t.ndim > MAX_DIMS:
        raise DistributedError(f"{where}: a {t.ndim}-dimensional output cannot be gathered (at most {MAX_DIMS})")
    header = torch.full((3 + MAX_DIMS,), -1, dtype=torch.int64)
    header[0] = t.ndim
    header[1] = zlib.crc32(str(t.dtype).encode())
    header[2] = t.element_size()
    header[3 : 3 + t.ndim] = torch.tensor(list(t.shape), dtype=torch.int64)
    header = header.to(t.device)
    headers = [torch.empty_like(header) for _ in range(n)]
    dist.all_gather(headers, header, group=group)
    shapes = [tuple(int(s) for s in h[3 : 3 + int(h[0])].tolist()) for h in (x.cpu() for x in headers)]
    dim = _checked_dim(placement.dim, shapes, [int(h[1]) for h in headers], ranks, where, placement)
    itemsize = t.element_size()
    counts = [itemsize * _numel(s) for s in shapes]
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    longest = max(counts)
    buf = torch.zeros(longest, dtype=torch.uint8, device=t.device)
    buf[: flat.numel()] = flat.to(t.device)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    pieces = [b[:c].clone().view(t.dtype).reshape(s) for b, c, s in zip(bufs, counts, shapes)]
    full = torch.cat(pieces, dim=dim).to(home)
    sizes = tuple(s[dim] for s in shapes)
    return full, ShardLayout((n,), tuple(ranks), (("shard", dim, sizes),), f"{placement!r} over {n} ranks")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _checked_dim(dim: int, shapes: list[tuple[int, ...]], dtypes: list[int], ranks: list[int], where: str,
                 placement: Any) -> int:
    if len(set(dtypes)) > 1:
        raise DistributedError(f"{where}: the ranks' pieces have different dtypes; they are not shards of one tensor")
    ndims = {len(s) for s in shapes}
    listed = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, shapes))
    if len(ndims) > 1:
        raise DistributedError(f"{where}: the ranks' pieces differ in rank (dimensions): {listed}")
    ndim = ndims.pop()
    if not -ndim <= dim < ndim:
        raise DistributedError(f"{where}: {placement!r} is out of range for a {ndim}-dimensional output {shapes[0]}")
    d = dim % ndim
    others = {tuple(x for i, x in enumerate(s) if i != d) for s in shapes}
    if len(others) > 1:
        raise DistributedError(f"{where}: the ranks' pieces differ outside dimension {d}, so they are not shards "
                         f"of one tensor along it: {listed}")
    return d

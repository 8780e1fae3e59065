"""torch.distributed: which golden a rank uses, and what value a parallel run's hooked tensor holds.

Facts that shape this module (torch 2.13, gloo, 2 ranks; measured in tests/distributed and
written up in docs/distributed.md):

* Under tensor parallelism (``parallelize_module``) a parallelized module returns a ``DTensor``,
  and the parallel style's own forward hook turns it into a local tensor (or an
  ``AsyncCollectiveTensor``) before hooks registered after it run. Capture hooks are registered
  with ``prepend=True`` and so see the ``DTensor``, whose full value can be compared with a
  single-device golden.
* A module *between* parallelized ones (the ``ReLU`` of a Colwise/Rowwise pair) returns a plain
  tensor holding only this rank's piece. Nothing in the tensor says so; only a shape that differs
  from the golden's in one dimension, by a factor dividing the world size, does (:class:`LocalShard`).
* Turning a ``DTensor`` into its full tensor (``full_tensor()``) is a collective: every rank must
  reach it, in the same order. Hooks fire in module execution order, which is the same on every
  rank of an SPMD program, and :mod:`activation_guard.distributed.transform` converts every hooked output
  before and whatever the golden holds, so that order never depends on a rank's data or verdicts.

Nothing here imports ``torch.distributed.tensor`` (about a second): a ``DTensor`` or an
``AsyncCollectiveTensor`` can only exist once the user's program has loaded its module, so the
types are looked up in ``sys.modules``.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

import torch

from .._core.errors import DistributedError
from ..store import naming as paths

SUFFIX = paths.SUFFIX

PathT = TypeVar("PathT", str, Path)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the default process group."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        ints = isinstance(self.rank, int) and isinstance(self.world_size, int)
        if not ints or not 0 <= self.rank < self.world_size:
            raise ValueError(f"RankInfo needs 0 <= rank < world_size, got rank={self.rank!r}, "
                             f"world_size={self.world_size!r}")

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def rank_info() -> RankInfo | None:
    """The default process group's rank and size, or None when none is initialized."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    return RankInfo(dist.get_rank(), dist.get_world_size())


# --------------------------------------------------------------------------- golden paths


def rank_golden_path(path: PathT, info: RankInfo | None) -> PathT:
    """The golden a rank records and compares: ``<golden>.h5`` -> ``<golden>.rank<r>-of-<w>.h5``.

    Exact rules, so a path maps to one file and back (:func:`split_rank_path`):

    * no process group, or a world of one process: ``path`` itself, unchanged;
    * otherwise the path must end in ``.h5`` (lower case); that final ``.h5`` is replaced by
      ``.rank<r>-of-<w>.h5`` (``a.b.h5`` -> ``a.b.rank1-of-2.h5``), folders are untouched;
    * a path that already names a per-rank golden, or whose file name is only ``.h5``, is refused.

    Returns the same type it was given (``str`` or ``pathlib.Path``).
    """
    if info is None or info.world_size == 1:
        return path
    text = os.fspath(path)
    base = os.path.basename(text)
    if not base.endswith(SUFFIX):
        raise DistributedError(f"golden path {text!r}: per-rank goldens are named <golden>.rank<r>-of-<w>.h5, "
                               f"so a golden path in a multi-rank run must end in '.h5'")
    if base == SUFFIX:
        raise DistributedError(f"golden path {text!r}: the file name has nothing before '.h5'")
    parsed = split_rank_path(text)
    if parsed is not None:
        raise DistributedError(f"golden path {text!r} already names the golden of {parsed[1]}; pass the "
                               f"path without the rank part: {parsed[0]!r}")
    out = f"{text[: -len(SUFFIX)]}.rank{info.rank}-of-{info.world_size}{SUFFIX}"
    return Path(out) if isinstance(path, Path) else out  # type: ignore[return-value]


def split_rank_path(path: str | os.PathLike[str]) -> tuple[str, RankInfo] | None:
    """``a.rank1-of-2.h5`` -> ``("a.h5", RankInfo(1, 2))``; None for any other path (also for
    non-canonical spellings such as ``rank01`` or a rank outside the world)."""
    text = os.fspath(path)
    head, base = os.path.split(text)
    parts = paths.split_rank_part(base[: -len(SUFFIX)]) if base.endswith(SUFFIX) else None
    if parts is None or not parts[0]:
        return None
    stem, rank, world = parts
    return os.path.join(head, stem + SUFFIX) if head else stem + SUFFIX, RankInfo(rank, world)


def other_rank_goldens(path: str | os.PathLike[str]) -> list[str]:
    """Per-rank goldens of ``path`` on disk, whatever world size recorded them (sorted)."""
    text = os.fspath(path)
    if not text.endswith(SUFFIX):
        return []
    folder, base = os.path.split(text)
    stem = base[: -len(SUFFIX)]
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    found = []
    for n in names:
        parsed = split_rank_path(n)
        if parsed is not None and parsed[0] == stem + SUFFIX:
            found.append(os.path.join(folder, n) if folder else n)
    return sorted(found)


def resolve_golden_path(path: str | os.PathLike[str], info: RankInfo | None, *,
                        agree: bool = True) -> tuple[str, bool]:
    """The golden a compare in this process reads, and whether it is a per-rank golden.

    A multi-rank run reads its own per-rank golden if one exists (regression against an earlier
    parallel run), else the plain ``path`` (a golden recorded on a single device, compared through
    full tensors). A path naming a per-rank golden is used as given, after checking it is this
    rank's. When neither file exists the per-rank path is returned, so the not-found error names
    the file a ``record`` in this run would write. ``agree=False`` skips the check that every rank
    makes the same choice (while the ranks are writing their files, some exist before others).
    """
    text = os.fspath(path)
    parsed = split_rank_path(text)
    if parsed is not None:
        if info != parsed[1]:
            raise DistributedError(f"golden {text!r} belongs to {parsed[1]}; this process is "
                                   f"{info or 'not part of a process group'}")
        return text, True
    if info is None or info.world_size == 1:
        return text, False
    own = rank_golden_path(text, info)
    # every rank must make the same choice, or one compares local values while another waits in
    # the collectives that gather full ones: decided from the files alone, which all ranks see
    ranks = [r for r in range(info.world_size) if r != info.rank]
    have = [r for r in ranks if os.path.exists(rank_golden_path(text, RankInfo(r, info.world_size)))]
    lack = [r for r in ranks if r not in have]
    mine = os.path.exists(own)
    if agree and ((not mine and have) or (mine and lack and os.path.exists(text))):
        present = sorted(have + ([info.rank] if mine else []))
        absent = sorted(lack + ([] if mine else [info.rank]))
        raise DistributedError(
            f"per-rank goldens of {text!r} exist for rank(s) {present} but not for rank(s) {absent} (world size "
            f"{info.world_size}): those ranks would compare with another kind of golden than the rest, and wait "
            f"for each other's collectives until the process group times out. Re-record every rank (the same "
            f"record on all ranks), or delete the per-rank files to compare every rank with the single-device "
            f"golden. (Ranks on machines that do not share the golden folder each need all the files.)")
    if mine:
        return own, True
    if os.path.exists(text):
        return text, False
    return own, True


# --------------------------------------------------------------------------- tensor kinds


def _dtensor_type() -> Any:
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def _async_type() -> Any:
    mod = sys.modules.get("torch.distributed._functional_collectives")
    return getattr(mod, "AsyncCollectiveTensor", None)


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def wait_async(t: torch.Tensor) -> torch.Tensor:
    """The result of an ``AsyncCollectiveTensor`` once its collective completed (anything else as is).

    ``trigger_wait`` (not ``wait``) also marks it completed, so torch does not warn about an
    unwaited collective at exit when the model's caller never touched the output.
    """
    cls = _async_type()
    for _ in range(8):  # a wait yields the plain result; bounded in case a subclass nests them
        if cls is None or not isinstance(t, cls):
            return t
        trigger = getattr(t, "trigger_wait", None)
        t = trigger() if callable(trigger) else t.wait()
    return t


@dataclass(frozen=True)
class LocalShard:
    """A plain tensor captured on one rank of a multi-rank run and not gathered.

    It may be the full value (replicated, or data parallel on the same input) or only this rank's
    piece of a sharded one (the activation between a Colwise and a Rowwise layer). Nothing in the
    tensor tells which: the comparator compares it as is when its shape is the golden's, and
    reports :meth:`verdict` instead of a shape divergence when it is a shard of the golden's shape.
    """

    tensor: torch.Tensor
    rank: int
    world_size: int

    def verdict(self, layer: str, path: str, golden_shape: Sequence[int]) -> str | None:
        return local_shard_message(layer, path, golden_shape, tuple(self.tensor.shape), self.world_size)


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk``-style pieces (DTensor's ``Shard`` split): ceil-sized, the last
    ones short or empty."""
    size = -(-length // parts)
    return [max(0, min(size * (k + 1), length) - size * k) for k in range(parts)]


def shard_factor(golden_shape: Sequence[int], live_shape: Sequence[int], world_size: int) -> tuple[int, int] | None:
    """``(dim, ranks)`` when ``live_shape`` is one piece of ``golden_shape`` split along ``dim``
    over ``ranks`` processes (``ranks`` > 1 divides the world size, as any mesh dimension's size
    does); None otherwise. Exactly one dimension may differ."""
    g, lv = tuple(int(s) for s in golden_shape), tuple(int(s) for s in live_shape)
    if len(g) != len(lv) or world_size < 2:
        return None
    diff = [d for d in range(len(g)) if g[d] != lv[d]]
    if len(diff) != 1 or lv[diff[0]] >= g[diff[0]]:
        return None
    d = diff[0]
    for n in range(2, world_size + 1):
        if world_size % n == 0 and lv[d] in chunk_sizes(g[d], n):
            return d, n
    return None


def placement_text(dim: int, ndim: int) -> str:
    return "Shard(-1)" if dim == ndim - 1 else f"Shard({dim})"


def local_shard_message(layer: str, path: str, golden_shape: Sequence[int], live_shape: Sequence[int],
                        world_size: int) -> str | None:
    """The ``local shard`` verdict for a plain tensor that is a piece of the golden's, or None."""
    found = shard_factor(golden_shape, live_shape, world_size)
    if found is None:
        return None
    dim, n = found
    where = f" (output {path!r})" if path else ""
    key = f"{layer}/{path}" if path else layer  # one output of several: a layer-wide pattern would gather all
    return (f"layer {layer!r}{where} returned a local shard {tuple(live_shape)} of a tensor sharded over {n} ranks; "
            f"the golden holds the full {tuple(golden_shape)}; tell activation_guard how it is placed: "
            f"placements={{{key!r}: {placement_text(dim, len(live_shape))}}}")


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class ShardLayout:
    """Which ranks hold which part of a gathered tensor, to name the rank behind a divergence.

    ``ranks`` are global ranks in row-major order over ``mesh_shape``; ``placements`` has one
    entry per mesh dimension: ``("shard", tensor_dim, sizes)`` (piece sizes in coordinate order),
    ``("replicate",)`` or ``("partial",)``.
    """

    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[tuple[Any, ...], ...]
    text: str

    def owners(self, index: Sequence[int]) -> tuple[list[int], bool]:
        """Ranks whose local value holds (or, for a partial sum, contributes to) element ``index``,
        and whether the element is a sum of partial values."""
        partial = any(p[0] == "partial" for p in self.placements)
        out = []
        for flat, coord in enumerate(itertools.product(*(range(n) for n in self.mesh_shape))):
            if all(_holds(p, c, index) for p, c in zip(self.placements, coord)):
                out.append(self.ranks[flat])
        return sorted(out), partial

    def describe(self, index: Sequence[int]) -> str:
        ranks, partial = self.owners(index)
        at = f"element {list(index)}"
        names = ", ".join(str(r) for r in ranks)
        if partial:
            return f"{at} is a sum of partial values from ranks {names} ({self.text}): any of them can be at fault"
        if len(ranks) == 1:
            return f"{at} lies in the shard of rank {ranks[0]} ({self.text})"
        return f"{at} is held by ranks {names} ({self.text})"


def _holds(p: tuple[Any, ...], coord: int, index: Sequence[int]) -> bool:
    if p[0] != "shard":
        return True
    dim, sizes = p[1], p[2]
    start = sum(sizes[:coord])
    return start <= index[dim] < start + sizes[coord]


def layout_of(t: torch.Tensor) -> ShardLayout | None:
    """The layout of a ``DTensor`` over its mesh; None for other tensors, and for layouts this
    module cannot map (a tensor dimension sharded by two mesh dimensions, strided shards)."""
    if not is_dtensor(t):
        return None
    mesh: Any = t.device_mesh  # type: ignore[attr-defined]
    shape = tuple(int(s) for s in mesh.shape)
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    out: list[tuple[Any, ...]] = []
    sharded: set[int] = set()
    for n, p in zip(shape, t.placements):  # type: ignore[attr-defined]
        kind = type(p).__name__
        if kind == "Shard":
            dim = p.dim % t.ndim
            if dim in sharded:
                return None
            sharded.add(dim)
            out.append(("shard", dim, tuple(chunk_sizes(int(t.shape[dim]), n))))
        elif kind == "Replicate":
            out.append(("replicate",))
        elif kind == "Partial":
            out.append(("partial",))
        else:
            return None
    text = ", ".join(repr(p) for p in t.placements) + f" over mesh {list(shape)}"  # type: ignore[attr-defined]
    return ShardLayout(shape, ranks, tuple(out), text)


# --------------------------------------------------------------------------- values


Materialized = Union[torch.Tensor, LocalShard]


def materialize(t: torch.Tensor, *, local: bool = False, info: RankInfo | None = None) -> Materialized:
    """The value to store or compare for a tensor a capture hook received.

    * ``DTensor``: its full tensor (``full_tensor()``: a collective, reached by every rank in hook
      order), or with ``local=True`` (per-rank goldens) this rank's local tensor, no collective;
    * ``AsyncCollectiveTensor``: waited on, then treated as a plain tensor;
    * a plain tensor in a multi-rank run (``info.world_size > 1``) when not ``local``: a
      :class:`LocalShard`, since it may be a piece of the single-device value;
    * anything else unchanged (the same object).
    """
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        if is_dtensor(t):
            dt: Any = t
            return wait_async(dt.to_local() if local else dt.full_tensor())
        t = wait_async(t)  # e.g. a RowwiseParallel output: a reduced value, yet plain like any other
    if not local and info is not None and info.world_size > 1:
        return LocalShard(t, info.rank, info.world_size)
    return t

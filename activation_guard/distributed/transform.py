"""One object per record/compare run that turns a parallel run's hooked tensors into comparable
values, the golden path each rank uses, and the comparator's two uses of what was learned
(local-shard verdicts, rank attribution).

Why it converts every hooked output, before the golden is consulted: the conversions of a
single-device comparison are collectives (``DTensor.full_tensor()``, the gather of a placed
shard). Hooks fire in the same module order on every rank; converting unconditionally keeps the
ranks' collectives in that order even where one rank's golden lacks a layer or one rank's
verdict differs. Per-rank goldens (``*.rank<r>-of-<w>.h5``) store and compare each rank's local
values instead: no collective at all, and a divergence is seen on the rank that computed it.

Outside an initialized process group :func:`for_record` and :func:`for_compare` return no
capture, and nothing here runs: a single-process run pays one ``is_initialized()`` call.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Union

from .._core.errors import DistributedError
from ..options.spec import CompareSpec
from ..results import LeafResult
from ..values.leaves import Leaf
from .placements import PlacementMatcher, reassemble
from .ranks import (
    LocalShard,
    RankInfo,
    ShardLayout,
    is_dtensor,
    layout_of,
    materialize,
    rank_golden_path,
    rank_info,
    resolve_golden_path,
    split_rank_path,
    wait_async,
)

LeafInfo = Union[ShardLayout, LocalShard]


class RankCapture:
    """Converts the tensor leaves of each hooked output on this rank (see the module docstring).

    ``local=True`` (per-rank goldens): a ``DTensor`` becomes its local tensor, nothing is gathered.
    Otherwise a ``DTensor`` becomes its full tensor, a plain tensor of a layer with a declared
    placement is gathered, and any other plain tensor is marked as a possible :class:`LocalShard`.
    What is known about how a value was distributed goes on the leaf (``Leaf.dist``).
    """

    def __init__(self, info: RankInfo, *, local: bool, placements: PlacementMatcher | None = None):
        self.info = info
        self.local = local
        self.placements = placements
        self.replay_off = False  # for_compare switched a default replay off

    def convert(self, name: str, leaves: list[Leaf]) -> None:
        """Replace each tensor leaf's tensor (in place) by its value; collectives in leaf order."""
        for leaf in leaves:
            t = leaf.tensor
            if leaf.kind != "tensor" or t is None:
                continue
            found = None if self.local or not self.placements else self.placements.for_leaf(name, leaf.path)
            if found is not None and not is_dtensor(t):
                assert self.placements is not None
                where = f"layer {name!r}" + (f" output {leaf.path!r}" if leaf.path else "") + \
                    f" (placements[{found[0]!r}] = {found[1]!r})"
                leaf.tensor, leaf.dist = reassemble(wait_async(t), found[1], group=self.placements.group, where=where)
                continue
            layout = None if self.local else layout_of(t)
            value = materialize(t, local=self.local, info=self.info)
            if isinstance(value, LocalShard):
                leaf.tensor, leaf.dist = value.tensor, value
            else:
                leaf.tensor, leaf.dist = value, layout

    def meta(self) -> dict[str, Any]:
        """What a golden records about the run that wrote it."""
        return {"rank": self.info.rank, "world_size": self.info.world_size,
                "values": "local" if self.local else "full"}

    def notes(self) -> list[str]:
        """Report notes: how this rank's values were compared; placements patterns never used."""
        if self.info.world_size == 1:
            how = []
        elif self.local:
            how = [f"{self.info}: every output compared as this rank's local value (per-rank golden)"]
        else:
            how = [f"{self.info}: DTensor outputs and placed shards compared as full tensors, other outputs "
                   "as this rank's local values"]
        if self.replay_off:
            how.append("replay is off in a multi-rank run (a layer re-run on one rank would leave the others out "
                       "of its collectives)")
        if not self.placements:
            return how
        return how + [f"placements pattern {p!r} matched no layer" for p in self.placements.unmatched()]


def for_record(path: str, per_rank: bool = True) -> tuple[str, RankCapture | None]:
    """The golden a record in this process writes, and its capture (None outside a process group).

    In a multi-rank run every rank writes its own ``<golden>.rank<r>-of-<w>.h5`` of local values;
    a path naming another rank's golden is refused (two processes would write one file).
    ``per_rank=False``: ``path`` itself, of full values (DTensors gathered), for a private path
    that only this process writes (compare_models' temporary reference)."""
    info = rank_info()
    if info is None:
        return path, None
    if not per_rank:
        return path, RankCapture(info, local=False)
    parsed = split_rank_path(path)
    if parsed is not None and parsed[1] != info:
        raise DistributedError(f"recording golden {path!r} ({parsed[1]}'s file) in {info}: every rank records "
                               f"its own golden; pass the plain path {parsed[0]!r}")
    own = path if parsed is not None else rank_golden_path(path, info)
    return own, RankCapture(info, local=info.world_size > 1)


def for_compare(path: str, spec: CompareSpec) -> tuple[str, RankCapture | None, CompareSpec]:
    """The golden a compare in this process reads, its capture (None outside a process group), and
    the spec to compare with.

    A multi-rank run reads its own per-rank golden when one exists (local values, no collective),
    else the single-device golden at ``path`` (full values: ``DTensor`` outputs gathered, plain
    ones placed through ``spec.placements``). Refuses what would hang; replay is turned off there:
    re-running a layer that holds a shard issues its collectives on the ranks that replay it only,
    and which ranks diverge first differs (``replay="first"``, the default, is switched off with a
    report note; ``replay="all"`` is refused)."""
    info = rank_info()
    if info is None:
        if spec.placements:
            raise DistributedError("placements describe how the local shards of a multi-rank run are placed, but "
                                   "no torch.distributed process group is initialized")
        return path, None, spec
    if info.world_size > 1 and spec.replay != "off":
        if spec.replay == "all":  # judging every layer by its replay: nothing left to judge without it
            raise DistributedError(f"replay={spec.replay!r} in a multi-rank run ({info}): re-running a layer on one "
                                   "rank would leave the others out of its collectives; use replay='off'")
        spec = replace(spec, replay="off")
        switched = True
    else:
        switched = False
    try:
        resolved, local = resolve_golden_path(path, info)
    except ValueError as e:
        raise DistributedError(str(e)) from None
    if local and spec.placements:
        raise DistributedError(f"placements apply when comparing with a single-device golden; {resolved!r} is a "
                               "per-rank golden, which holds each rank's local values")
    if spec.fail_fast and info.world_size > 1:
        raise DistributedError(f"fail_fast in a multi-rank run ({info}): stopping one rank's forward would leave "
                               "the others waiting in the model's collectives; compare without fail_fast")
    matcher = PlacementMatcher(spec.placements) if spec.placements else None
    cap = RankCapture(info, local=local, placements=matcher)
    cap.replay_off = switched
    return resolved, cap, spec


def refuse_sharded_backward(model: Any, backward: bool) -> None:
    """Gradient goldens of a model whose parameters are ``DTensor`` shards (tensor
    parallelism, FSDP2) are not supported: their gradients are sharded ``DTensor`` values, which
    the gradient capture does not convert. Said before the forward, with what works."""
    if not backward:
        return
    sharded = next((name for name, p in model.named_parameters() if is_dtensor(p)), None)
    if sharded is not None:
        raise DistributedError(
            f"backward=True with sharded parameters (parameter {sharded!r} is a DTensor: tensor parallelism or "
            f"FSDP2) is not supported: gradient goldens are recorded and compared on models with plain "
            f"parameters (a single device, or data parallel); check this model's forward without backward")


def shard_verdict(dist: Any, layer: str, path: str, golden_shape: tuple[int, ...]) -> str | None:
    """The local-shard message for a live leaf whose shape differs from the golden's, or None
    (then it is an ordinary shape divergence)."""
    return dist.verdict(layer, path, golden_shape) if isinstance(dist, LocalShard) else None


def attribute(res: LeafResult, dist: Any) -> None:
    """Name the rank(s) behind a diverged gathered leaf: the owners of its worst element."""
    if not isinstance(dist, ShardLayout) or res.status == "match" or res.index is None:
        return
    res.ranks = dist.owners(res.index)[0]
    res.detail = (res.detail + "; " if res.detail else "") + dist.describe(res.index)

"""Each rank's verdict, gathered to one rank that states the first divergence across ranks.

Why the process group's key-value store and not a collective: the exchange must also work when a
rank failed. Every rank *posts* a small JSON verdict (a divergence summary, or the exception it
raised) and only the destination rank *waits*, with a timeout, for the others; on its own error
path a rank posts and never waits. A rank that died without posting costs the destination rank
at most ``timeout`` seconds and is reported as silent, never a hang. No pickle: JSON only.

Ranks run the same modules in the same order (SPMD), so live execution positions are comparable
across ranks: the first divergence across ranks is the one with the smallest position (ties go to
the rank holding the worst element of a gathered value, else the lowest rank).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any, Literal

import torch

from ..distributed.ranks import RankInfo, rank_info
from ..report.report import WHY, Report

KEY_ROOT = "activation_guard/verdicts"
DETAIL_CHARS = 600
_SEQ = itertools.count()


@dataclass
class RankVerdict:
    """One rank's outcome, small enough for the store. ``first`` is the rank's first divergence:
    name, call, status, position (live execution order; a missing call sits half a step before
    the live call that passed its place), detail, and ``ranks`` holding its worst element."""

    rank: int
    world_size: int
    ok: bool
    golden: str = ""
    layers: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, Any] | None = None
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankVerdict:
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("rank"), int) or not isinstance(d.get("ok"), bool):
            raise ValueError(f"not a rank verdict: {str(text)[:200]!r}")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def verdict_of(report: Report, info: RankInfo) -> RankVerdict:
    """This rank's verdict from its compare report."""
    fd = report.first_divergence
    first = None
    if fd is not None:
        leaf = next((x for x in fd.leaves if x.path == fd.path and x.status == fd.status), None)
        pos = report.execution_position(fd)
        first = {
            "name": fd.name, "call": fd.call, "status": fd.status,
            "position": pos if math.isfinite(pos) else None,
            "detail": (fd.detail or "")[:DETAIL_CHARS], "ranks": None if leaf is None else leaf.ranks,
            "max_abs_diff": fd.max_abs_diff if fd.max_abs_diff is None or math.isfinite(fd.max_abs_diff) else None,
        }
    return RankVerdict(info.rank, info.world_size, report.ok, report.path, report.live_count, report.counts(), first)


def error_verdict(exc: BaseException, info: RankInfo) -> RankVerdict:
    text = f"raised {type(exc).__name__}: {exc}"
    return RankVerdict(info.rank, info.world_size, False, error=text[:DETAIL_CHARS])


@dataclass
class CrossRankDivergence:
    """The first divergence across ranks: where, on which rank, and which ranks reported it."""

    rank: int
    name: str
    call: int
    status: str
    position: float | None
    detail: str
    seen_on: list[int]


@dataclass
class MergedVerdict:
    """All ranks' verdicts as the destination rank received them."""

    world_size: int
    verdicts: list[RankVerdict]
    silent: list[int]  # ranks that posted nothing within the timeout
    timeout: float

    @property
    def ok(self) -> bool:
        return not self.silent and all(v.ok and v.error is None for v in self.verdicts)

    @property
    def errors(self) -> list[RankVerdict]:
        return [v for v in self.verdicts if v.error is not None]

    @property
    def first(self) -> CrossRankDivergence | None:
        cands = [v for v in self.verdicts if v.first is not None]
        if not cands:
            return None

        def pos(v: RankVerdict) -> float:
            p = v.first["position"] if v.first else None
            return math.inf if p is None else float(p)

        best = min(pos(v) for v in cands)
        at = [v for v in cands if pos(v) == best]
        ref = min(at, key=lambda v: v.rank)
        f = ref.first or {}
        # a gathered value diverges on every rank alike; the rank whose shard holds the worst
        # element is the one that computed it
        owners = f.get("ranks") or []
        rank = owners[0] if len(owners) == 1 else ref.rank
        return CrossRankDivergence(rank, f.get("name", ""), int(f.get("call", 0)), f.get("status", ""),
                                   f.get("position"), f.get("detail", ""), sorted(v.rank for v in at))

    def message(self) -> str:
        """The summary a person reads on the destination rank."""
        n = self.world_size
        lines = []
        first = self.first
        if self.ok:
            calls = sorted({v.layers for v in self.verdicts})
            each = f"{calls[0]} layer calls each" if len(calls) == 1 else "layer calls: " + ", ".join(map(str, calls))
            return f"activation_guard: all {n} ranks match their goldens ({each})"
        if first is not None:
            where = "" if first.position is None else f" (#{int(first.position) + 1} in execution order)"
            lines.append(f"activation_guard: first divergence across {n} ranks at layer {first.name or '<root>'!r} "
                         f"call {first.call}{where} on rank {first.rank}: {WHY.get(first.status, first.status)}")
            if first.seen_on != [first.rank]:
                lines.append(f"  reported by ranks {', '.join(map(str, first.seen_on))}")
            if first.detail:
                lines.append(f"  what: {first.detail}")
        else:
            lines.append(f"activation_guard: {n} ranks did not all complete their checks")
        for v in sorted(self.verdicts, key=lambda v: v.rank):
            if v.error is not None:
                lines.append(f"  rank {v.rank}: {v.error}")
            elif v.first is not None:
                lines.append(f"  rank {v.rank}: first divergence at {v.first['name'] or '<root>'!r} "
                             f"call {v.first['call']}: {v.first['status']} ({v.counts})")
            else:
                lines.append(f"  rank {v.rank}: ok ({v.layers} layer calls)")
        for r in self.silent:
            lines.append(f"  rank {r}: sent no verdict within {self.timeout:g} s (it failed before its check, "
                         "crashed, or is still running)")
        return "\n".join(lines)


def default_store() -> Any:
    """The default process group's store (private in torch: ``_get_default_store``)."""
    getter = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise RuntimeError("this torch has no default process-group store; pass store= explicitly")
    return getter()


def next_tag() -> str:
    """A per-process sequence tag: equal on all ranks only while every rank runs the same exchanges."""
    return f"seq{next(_SEQ)}"


def post(verdict: RankVerdict, tag: str, store: Any = None) -> None:
    (store or default_store()).set(f"{KEY_ROOT}/{tag}/{verdict.rank}", verdict.to_json())


def collect(world_size: int, tag: str, *, timeout: float, store: Any = None) -> MergedVerdict:
    """Wait up to ``timeout`` seconds for every rank's verdict under ``tag``; never longer."""
    store = store or default_store()
    keys = [f"{KEY_ROOT}/{tag}/{r}" for r in range(world_size)]
    with contextlib.suppress(RuntimeError):  # DistStoreError / "Wait timeout": a rank is silent, see below
        store.wait(keys, timedelta(seconds=timeout))
    got, silent = [], []
    for r, k in enumerate(keys):
        if store.check([k]):
            got.append(RankVerdict.from_json(store.get(k)))
            with contextlib.suppress(RuntimeError):  # a store without delete: keys are unique per tag anyway
                store.delete_key(k)
        else:
            silent.append(r)
    return MergedVerdict(world_size, got, silent, timeout)


def exchange(verdict: RankVerdict, *, tag: str | None = None, timeout: float = 60.0, dst: int = 0,
             store: Any = None) -> MergedVerdict | None:
    """Post this rank's verdict; on rank ``dst`` also collect everyone's (else return None).

    ``tag`` must be equal on all ranks and unique per exchange (a test's node id); by default a
    per-process counter, which stays aligned only while every rank reaches every exchange.
    """
    tag = tag or next_tag()
    post(verdict, tag, store)
    if verdict.rank != dst:
        return None
    return collect(verdict.world_size, tag, timeout=timeout, store=store)


class gather_verdicts:  # lower case: used as a context manager, like contextlib's
    """``with gather_verdicts(tag=...) as g: g.report = compare(...)``; then ``g.merged`` on rank 0.

    On an exception inside the block this rank posts the error and re-raises at once (no wait),
    so the destination rank learns of it without its timeout; outside a process group it does
    nothing.
    """

    def __init__(self, *, tag: str | None = None, timeout: float = 60.0, dst: int = 0, store: Any = None):
        self.tag = tag
        self.timeout = timeout
        self.dst = dst
        self.store = store
        self.report: Report | None = None
        self.merged: MergedVerdict | None = None
        self.info: RankInfo | None = None

    def __enter__(self) -> gather_verdicts:
        self.info = rank_info()
        if self.info is not None and self.tag is None:
            self.tag = next_tag()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if self.info is None:
            return False
        assert self.tag is not None
        if ev is not None:
            try:
                post(error_verdict(ev, self.info), self.tag, self.store)
            except Exception as e:  # the store itself failed: the original error matters more
                if hasattr(ev, "add_note"):
                    ev.add_note(f"activation_guard: could not post this rank's error verdict: {e}")
            return False
        if self.report is None:
            raise ValueError("gather_verdicts: set .report to the compare report inside the block")
        self.merged = exchange(verdict_of(self.report, self.info), tag=self.tag, timeout=self.timeout,
                               dst=self.dst, store=self.store)
        return False

"""The first diverging module call of a graph run outside module hooks (an exported graph, an ONNX
model) re-run alone on the golden's values, and under ``replay="all"`` every diverging call: the
bookkeeping both sources share; each says in its own words what the verdict means (``origin``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..comparison.comparator import Comparator
from ..replay.replay import keep_own
from ..results import LayerResult, Origin
from ..store import CallEntry
from ..values.leaves import Leaf

# re-runs one module call on the golden's values, given its golden entry (only the outputs the
# source maps): the outputs by path, or why it could not run
RunAlone = Callable[[CallEntry], "dict[str, torch.Tensor] | str"]


class ScopeReplays:
    """Which calls are re-run and how their own verdicts are kept; ``first`` is the origin so far."""

    def __init__(self, comp: Comparator, golden: Callable[[str, int], CallEntry | None],
                 mapped: Mapping[tuple[str, int], Mapping[str, Any]], mode: str):
        self.comp, self.golden, self.mapped, self.mode = comp, golden, mapped, mode
        self.first: Origin | None = None

    def judge_alone(self, path: str, call: int, run: RunAlone) -> tuple[LayerResult, LayerResult, bool] | None:
        """The call just judged (``path``, ``call``) re-run alone by ``run`` and judged on its own
        (its own verdict kept on its row). Returns (its row, its own verdict, whether it is the first
        divergence) when an origin is to be given from them; None otherwise (an ``unknown`` origin is
        set here when the first divergence could not be re-run)."""
        res = self.comp.results[-1] if self.comp.results else None
        if res is None or (res.name, res.call) != (path, call):
            return None
        first = self.first is None and not res.ok
        if not (first or self.mode == "all"):
            return None
        entry = self.golden(path, call)
        mapped = self.mapped[(path, call)]
        if entry is None:
            return None
        entry = dataclasses.replace(entry, leaves=[g for g in entry.leaves if g.path in mapped])
        got = run(entry)
        if isinstance(got, str):
            if first:
                self.first = Origin(res.name, res.call, "unknown", type_name=res.type_name,
                                    detail=f"not replayed: {got}")
            return None
        leaves = [Leaf(p, "tensor", tensor=t) for p, t in got.items()]
        own = LayerResult.from_leaves(res.name, res.call, res.type_name,
                                      self.comp.compare_leaves(entry, leaves, res.name))
        keep_own(res, own)
        if not first and not (self.mode == "all" and self.first is None and own.status != "match"):
            return None
        return res, own, first

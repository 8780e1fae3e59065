"""Goldens of formats 1 and 2 met by today's live leaves: the live paths as such a golden names them.

An older golden cannot be rewritten into today's paths on its own: format 1's paths are not
injective (two values could share one), format 2 wrote an empty mapping key as an empty path
component (a top-level ``""`` key vanished from the path), and containers that are walked now
(:data:`~activation_guard.values.leaves.WALKED_SINCE`) were once held by their type only. Which
golden path a live leaf is depends on the live value, so :meth:`GoldenReader.live_view` reads
these rules from the reader's version and hands the comparator the live leaves under the
golden's paths; matching then knows one scheme.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..results import LeafResult, out_name
from ..values.leaves import WALKED_SINCE, Leaf, value_at
from ..values.paths import EMPTY_KEY, first_duplicate, match_old_empty_keys
from .format import CallEntry


@dataclass
class LiveView:
    """One call's live leaves as an older golden names them."""

    leaves: dict[str, Leaf]  # by the golden's path (the leaves' ``path`` renamed to it)
    # golden paths whose verdict the format settles: containers it holds by type only, still
    # that type live (the leaves inside them are not the golden's to judge)
    settled: dict[str, LeafResult] = field(default_factory=dict)
    conflict: LeafResult | None = None  # the call cannot be matched against this golden

    def inside_settled(self, path: str) -> bool:
        return any(w == "" or path.startswith(w + "/") for w in self.settled)


def live_view(version: int, entry: CallEntry, leaves: list[Leaf], output: Any) -> LiveView | None:
    """``leaves`` (one live call of ``entry``; ``output``: its live output, None in ``diff``) as a
    golden of format ``version`` names them; None for a format that names them as the walker does."""
    if version >= 3:
        return None
    if version < 2:  # format 1 names leaves by its own (non-injective) paths
        for leaf in leaves:
            if leaf.legacy_path is not None:
                leaf.path = leaf.legacy_path
        dup = first_duplicate(leaf.path for leaf in leaves)
        if dup is not None:  # two live values under one name: one would go unjudged
            why = (f"{out_name(dup)}: two live values have this path in a format-1 golden, which cannot tell them "
                   f"apart; re-record the golden")
            return LiveView({}, conflict=LeafResult(dup, "structure", why))
    live = {leaf.path: leaf for leaf in leaves}
    gpaths = {g.path for g in entry.leaves}
    if version == 2 and any(EMPTY_KEY in p for p in live):
        live = match_old_empty_keys(live, gpaths)
    settled: dict[str, LeafResult] = {}
    for g in entry.leaves:
        if (g.path not in live and g.kind == "object" and g.type_name in WALKED_SINCE
                and type(value_at(output, g.path)).__name__ == g.type_name):
            # an older golden's deque or namespace, still one live (checked by type: anything else
            # there is a structure change, as before those were walked)
            settled[g.path] = LeafResult(g.path, "match", f"{g.type_name} object: compared by type only (a golden "
                                                          f"from before its values were stored; re-record to compare "
                                                          f"them)", type_name=g.type_name, type_only=True)
    return LiveView(live, settled)

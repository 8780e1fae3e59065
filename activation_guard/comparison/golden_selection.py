"""The selection a golden was recorded with (``include``/``exclude`` in its meta), and the check
that its index keeps to it.

A compare applies the golden's recorded selection by default (the layers it never stored are
not "unexpected"), so the meta's patterns decide what is compared: an index holding calls
outside them means the file was edited, and those calls would be neither compared nor missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._core.errors import GoldenFormatError
from ..gradients.loss import META_KEY as GRAD_META_KEY
from ..options.selection import Selector
from ..store import GoldenReader

Selection = tuple[Sequence[str] | None, Sequence[str] | None]


def recorded_selection(meta: Mapping[str, Any]) -> Selection:
    """The include/exclude patterns a golden was recorded with (ignored unless lists of str)."""

    def pats(value: Any) -> list[str] | None:
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return list(value)
        return None

    return pats(meta.get("include")), pats(meta.get("exclude"))


def refuse_strays(reader: GoldenReader) -> None:
    """A golden whose index holds a call outside the selection its meta says it was recorded with
    was edited: the recorded selection is applied to the comparison by default, so those calls
    (the model's output among them) would be neither compared nor reported missing. Likewise a
    golden whose index holds gradients but whose meta lost its record of them: gradients are
    compared when the meta says how they were taken, so they would go unjudged, with no note."""
    if reader.backward and not isinstance(reader.meta.get(GRAD_META_KEY), dict):
        raise GoldenFormatError(reader.path, f"holds {len(reader.backward)} gradient entries but its metadata has no "
                                             f"record of how they were taken: the file was edited")
    inc, exc = recorded_selection(reader.meta)
    if inc is None and exc is None:
        return
    wanted = Selector(inc, exc, [c.name for c in reader.calls])
    stray = next((c for c in reader.calls if not wanted(c.name)), None)
    if stray is not None:
        raise GoldenFormatError(reader.path, f"holds layer {stray.name or '<root>'!r} call {stray.call}, outside the "
                                             f"selection its metadata says it was recorded with (include={inc}, "
                                             f"exclude={exc}): the file was edited")


def selective_note(meta: Mapping[str, Any]) -> list[str]:
    """The report note for a golden recorded with a layer selection: an OK covers those layers
    only (the model's output may not be one of them)."""
    inc, exc = recorded_selection(meta)
    if inc is None and exc is None:
        return []
    shown = " and ".join(f"{k}={v}" for k, v in (("include", inc), ("exclude", exc)) if v is not None)
    return [f"the golden was recorded with {shown}: it holds only those layers' outputs"]

"""Which layers a pattern names: the one matching rule shared by include/exclude, tolerances,
rename and ``inspect --layer``.

Patterns are :mod:`fnmatch` globs of dotted module names, matched case-sensitively. Two rules make
them do what a person means:

* an exact name wins over glob reading: a module literally named ``x[0]`` (registered through
  ``_modules``) is selected by ``"x[0]"``, although ``[0]`` is a character class to fnmatch;
* the root module is shown as ``<root>`` in every report, so ``"<root>"`` names it (its real
  name is the empty string, which also still works).

Kept free of torch so that option validation and the pytest plugin can use it cheaply.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Any, Callable

from .._core.errors import SelectionError

ROOT_LABEL = "<root>"


def display_name(name: str) -> str:
    """How reports show a layer name: the root module (``""``) as ``<root>``."""
    return name or ROOT_LABEL


def matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` names layer ``name`` (exact name first, then the glob)."""
    if pattern == name or (pattern == ROOT_LABEL and name == ""):
        return True
    return fnmatch.fnmatchcase(name, pattern)


def match_any(name: str, patterns: Sequence[str] | None) -> bool:
    return bool(patterns) and any(matches(name, p) for p in patterns or ())


def selected(name: str, include: Sequence[str] | None, exclude: Sequence[str] | None) -> bool:
    if include and not match_any(name, include):
        return False
    return not (exclude and match_any(name, exclude))


class Selector:
    """include/exclude for a known set of layer names: a pattern that *is* one of the names is
    that name only (``"x[0]"`` selects the module named ``x[0]``, not ``x0``); others are globs."""

    def __init__(self, include: Sequence[str] | None, exclude: Sequence[str] | None, names: Iterable[str]):
        known = set(names)
        self.include = None if not include else self._split(include, known)
        self.exclude = None if not exclude else self._split(exclude, known)

    @staticmethod
    def _split(patterns: Sequence[str], known: set[str]) -> tuple[frozenset[str], tuple[str, ...]]:
        literal = {p for p in patterns if p in known}
        if ROOT_LABEL in patterns:
            literal.add("")
        return frozenset(literal), tuple(p for p in patterns if p not in literal and p != ROOT_LABEL)

    @staticmethod
    def _hit(name: str, split: tuple[frozenset[str], tuple[str, ...]]) -> bool:
        return name in split[0] or any(fnmatch.fnmatchcase(name, p) for p in split[1])

    def __call__(self, name: str) -> bool:
        if self.include is not None and not self._hit(name, self.include):
            return False
        return not (self.exclude is not None and self._hit(name, self.exclude))


def unmatched(patterns: Sequence[str] | None, names: Iterable[str]) -> list[str]:
    """The patterns that match none of ``names``: a typo selects or loosens nothing, silently."""
    if not patterns:
        return []
    names = list(names)
    return [p for p in patterns if not any(matches(n, p) for n in names)]


def few(items: Sequence[Any], limit: int = 5, *, sep: str = ", ", show: Callable[[Any], str] = repr) -> str:
    """The first ``limit`` of ``items`` as a note names them, "..." standing for the rest (the
    note gives the count)."""
    return sep.join(show(x) for x in items[:limit]) + (sep + "..." if len(items) > limit else "")


def nothing_selected(include: Sequence[str] | None, exclude: Sequence[str] | None,
                     names: Sequence[str]) -> SelectionError:
    """The error for an include/exclude selection that matched no layer call: a check of
    nothing would pass vacuously (usually a typo in a pattern)."""
    names = [n for n in names if n]  # the root ("") is no pattern target
    shown = few(names, 6)
    inc = None if include is None else list(include)
    exc = None if exclude is None else list(exclude)
    return SelectionError(
        f"include={inc!r}, exclude={exc!r} selected no layer call, so nothing would be "
        f"checked; patterns are globs of dotted module names such as {shown or 'none'}"
    )


def parent_hint(name: str, patterns: Iterable[str], matched_names: Iterable[str]) -> str | None:
    """A hint for a layer that a ``parent.*``-style pattern was meant to cover but does not.

    fnmatch's ``encoder.*`` matches ``encoder.layer`` but not ``encoder`` itself; when a failing
    layer's name is the prefix of such a pattern and the pattern matched other layers, the report
    suggests ``encoder*`` (or ``encoder``) instead of leaving the user to guess.
    """
    matched = list(matched_names)
    for p in patterns:
        if not name or matches(name, p):
            continue
        prefix = name + "."
        if p.startswith(prefix) and any(matches(n, p) for n in matched):
            return (f"the pattern {p!r} matches layers inside {name!r} but not {name!r} itself; "
                    f"use {name + '*'!r} (or add {name!r}) to cover it too")
    return None

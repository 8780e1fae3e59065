"""``rename``: compare a golden layer with a live layer that has another name.

A refactor that renames modules (``encoder.layer`` -> ``encoder.layers``) would otherwise turn
every layer into a pair of missing and unexpected calls. The rules were parsed and validated by
:mod:`activation_guard.options.spec`; this module applies them.
"""

from __future__ import annotations

from collections.abc import Sequence

from .spec import RenameRule


def apply_rename(name: str, rules: Sequence[RenameRule]) -> str:
    """The live name a golden layer ``name`` is compared with (the first rule that matches)."""
    for rule in rules:
        m = rule.regex.match(name)
        if m:
            new = m.expand(rule.replacement) + name[m.end():]
            return new.strip(".") if new.startswith(".") or new.endswith(".") else new
    return name


def renamed_patterns(patterns: Sequence[str] | None, rules: Sequence[RenameRule]) -> list[str] | None:
    """Patterns naming golden layers, plus each one under ``rename`` (naming their live layers)."""
    if patterns is None:
        return None
    return list(patterns) + [r for r in (apply_rename(p, rules) for p in patterns) if r not in patterns]

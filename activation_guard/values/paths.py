"""Path components of output leaves: how a mapping key, an index or a marker becomes one part of
a leaf's path (the scheme is in :mod:`activation_guard.values.leaves` and docs/format.md), enum members
and other values written as text, and how earlier writers spelled the empty key.

Taken out of ``leaves`` (which walks values) so that each module has one job: this one decides
names, and no name it gives can be another's.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

import torch

FIELDS = "#fields"  # a named tuple's field names (no key encodes to it: ``#`` is encoded in str keys)
SUBCLASS_TYPE = "#type"  # a wrapper subclass's class
SUBCLASS_CTX = "#ctx"  # a wrapper subclass's metadata: no str key encodes to it (``#`` is encoded)


class _HasPath(Protocol):
    path: str


L = TypeVar("L", bound=_HasPath)


def _pct(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


EMPTY_KEY = "#str:''"  # the empty string key: an empty component would vanish at the top level


def encode_str_key(key: str) -> str:
    if not key:
        return EMPTY_KEY
    out = key.replace("%", "%25").replace("/", "%2F").replace("#", "%23")
    if out[:1].isdigit():
        out = _pct(out[0]) + out[1:]
    return out


def old_empty_key_path(path: str) -> str:
    """``path`` as version-2 writers before the ``#str:''`` component wrote it: an empty component
    for each ``""`` key, dropped where nothing precedes it (``#str:''/x`` was ``x``)."""
    out = ""
    for comp in path.split("/"):
        out = join_path(out, "" if comp == EMPTY_KEY else comp)
    return out


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def stored_by_repr(type_name: str) -> bool:
    """A ``str`` leaf of this Python type holds a value written as text (a dtype, device, enum,
    bytes, a named tuple's fields, a subclass's class), not a string or an int beyond int64."""
    return type_name not in ("", "str", "int")


def enum_text(member: enum.Enum) -> str:
    """An enum member as stored: class, name and value. ``repr`` would not do: a member's value
    may be an object whose ``repr`` holds a memory address (never equal in another process); and a
    member without a name (a combined or out-of-range flag) is told apart by its value."""
    value = member.value
    shown = _stable_repr(value, 0)
    if shown is None:
        shown = f"<{type(value).__qualname__}>"
    return f"{type(member).__qualname__}.{member.name}={shown}"


def _stable_repr(v: Any, depth: int) -> str | None:
    """``repr(v)`` where it is the same in every process (plain values, and tuples, lists and sets
    of them, sets sorted: their order follows the string hash seed), else None."""
    if isinstance(v, _PLAIN_VALUES):
        return repr(v)
    if depth > 4 or not isinstance(v, (tuple, list, set, frozenset)):
        return None
    parts = [_stable_repr(x, depth + 1) for x in v]
    if any(p is None for p in parts):
        return None
    texts = [p for p in parts if p is not None]
    if isinstance(v, (set, frozenset)):
        return f"{type(v).__name__}({{{', '.join(sorted(texts))}}})"
    if isinstance(v, tuple):
        return f"({', '.join(texts)}{',' if len(texts) == 1 else ''})"
    return f"[{', '.join(texts)}]"


def encode_key(key: Any) -> str:
    """The path component of a mapping key (see the module docstring)."""
    if isinstance(key, str):
        return encode_str_key(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return f"#{key}"
    text = repr(key)
    if isinstance(key, enum.Enum) and (_ADDRESS.search(text) or isinstance(key.value, (set, frozenset))):
        text = enum_text(key)  # an address, or a set's order, is not the same in another process
    return f"#{type(key).__name__}:" + text.replace("%", "%25").replace("/", "%2F")


def legacy_key(key: Any) -> str:
    return str(key).replace("%", "%25").replace("/", "%2F")


def join_path(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def is_fields(path: str) -> bool:
    return path == FIELDS or path.endswith("/" + FIELDS)


def match_old_empty_keys(live: dict[str, L], gpaths: set[str]) -> dict[str, L]:
    """Live leaves under ``""`` keys named as earlier version-2 writers named them (an empty
    component), where the golden has that path and no other live leaf does: so an older golden
    still compares. Only a path with an empty component is taken, one no current writer makes; a
    top-level ``""`` key was dropped from the path altogether (``{"": t}`` was ``t``'s path), which
    is the ambiguity the new encoding fixed: such a golden fails as changed and is re-recorded."""
    old = {p: q for p in live if EMPTY_KEY in p and p not in gpaths
           for q in (old_empty_key_path(p),) if q and "" in q.split("/")}
    counts: dict[str, int] = {}
    for p in live:
        q = old.get(p, p)
        counts[q] = counts.get(q, 0) + 1
    out: dict[str, L] = {}
    for p, leaf in live.items():
        was = old.get(p)
        if was is not None and was in gpaths and counts[was] == 1:
            leaf.path = was
            out[was] = leaf
        else:
            out[p] = leaf
    return out


def first_duplicate(paths: Iterable[str]) -> str | None:
    """The first path that occurs a second time, or None: two values under one path would be
    compared as one, and the other never (the store's index parser has its own, being below this)."""
    seen: set[str] = set()
    for p in paths:
        if p in seen:
            return p
        seen.add(p)
    return None

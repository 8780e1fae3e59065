"""Option values: each option's parser and the rule types its values become.

A parser takes a value as given (Python, or text from an ini key or a flag) and returns the
normalized value or raises :class:`Bad` with the problem; :mod:`activation_guard.options.spec` turns that
into one :class:`~activation_guard._core.errors.OptionError` naming the option and where it was set.
Kept apart from the option table so each reads in one sitting; nothing here imports torch.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..fingerprints.params import PARAM_KEYS, FingerprintError, FingerprintParams

TOLERANCE_MODES = ("strict", "calibrated")
REPLAY_MODES = ("first", "all", "off")
COMPRESSIONS = (None, "gzip", "lzf")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class Bad(Exception):
    """A parser's complaint; :func:`_parse` turns it into an :class:`OptionError`."""


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if callable(v) and not isinstance(v, type) and hasattr(v, "__qualname__"):  # backward=<loss function>
        return str(v.__qualname__)
    return repr(v)


# --------------------------------------------------------------------------- value parsers


def _number(v: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise Bad(f"must be a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise Bad(f"must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise Bad(f"must be a finite number >= 0, got {fmt(f)}")
    return f


def _optional_number(v: Any) -> float | None:
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    return _number(v)


def _flag(v: Any) -> bool:
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if not isinstance(v, bool):
        raise Bad(f"must be True or False, got {v!r}")
    return v


def _patterns(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return (v,)
    if isinstance(v, (bytes, Mapping)):
        raise Bad(f"must be a glob string or a list of them, got {v!r}")
    try:
        pats = tuple(v)
    except TypeError:
        raise Bad(f"must be a glob string or a list of them, got {v!r}") from None
    for p in pats:
        if not isinstance(p, str):
            raise Bad(f"must contain glob strings, got {p!r}")
    return pats


def _choice(options: tuple[Any, ...]) -> Callable[[Any], Any]:
    def parse(v: Any) -> Any:
        if v not in options:
            shown = " or ".join(repr(o) for o in options)
            raise Bad(f"must be {shown}, got {v!r}")
        return v

    return parse


# --- gradients
def _backward(v: Any) -> bool | Callable[[Any], Any]:
    """``backward``: True/False (also as text from ini and flags) or a loss function."""
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if isinstance(v, bool):
        return v
    if callable(v) and not isinstance(v, type):
        return v  # type: ignore[no-any-return]
    raise Bad(f"must be True, False or a callable(output) -> scalar loss, got {v!r}")
# --- end gradients


@dataclass(frozen=True)
class ToleranceRule:
    """One ``tolerances`` entry: a layer glob and the rtol and/or atol it sets, or the SQNR (dB) its
    float outputs must reach at least (``min_sqnr_db``: the layer is judged by SQNR instead)."""

    pattern: str
    rtol: float | None
    atol: float | None
    min_sqnr_db: float | None = None

    @property
    def label(self) -> str:
        return f"tolerances[{self.pattern!r}]"


def specificity(pattern: str) -> tuple[int, int]:
    """Rank patterns: exact names beat globs, then more literal characters win."""
    wild = sum(pattern.count(c) for c in "*?[")
    return (1 if wild == 0 else 0, len(pattern) - wild)


def _tolerances(v: Any) -> tuple[ToleranceRule, ...]:
    if v is None:
        return ()
    if not isinstance(v, Mapping):
        raise Bad(f"must be a dict of layer glob -> dict(rtol=..., atol=...) or dict(min_sqnr_db=...), "
                  f"got {type(v).__name__}")
    rules = []
    for pat, rule in v.items():
        if not isinstance(pat, str):
            raise Bad(f"keys must be glob strings, got {pat!r}")
        where = f"tolerances[{pat!r}]"
        if isinstance(rule, Mapping):
            unknown = set(rule) - {"rtol", "atol", "min_sqnr_db"}
            if unknown:
                raise Bad(f"{where}: unknown keys {sorted(map(str, unknown))}; use rtol and atol, or min_sqnr_db")
            r, a = rule.get("rtol"), rule.get("atol")
            if "min_sqnr_db" in rule:
                if r is not None or a is not None:
                    raise Bad(f"{where} sets min_sqnr_db and rtol/atol: a layer is judged by one rule, its SQNR "
                              f"or its elements; give them to separate patterns")
                rules.append(ToleranceRule(pat, None, None, _sqnr(rule["min_sqnr_db"], where)))
                continue
        elif isinstance(rule, (tuple, list)) and len(rule) == 2:
            r, a = rule
        else:
            raise Bad(f"{where} must be a dict(rtol=..., atol=...) or an (rtol, atol) pair, got {rule!r}")
        if r is None and a is None:
            raise Bad(f"{where} sets neither rtol nor atol (nor min_sqnr_db)")
        rules.append(ToleranceRule(pat, _rule_number(r, where, "rtol"), _rule_number(a, where, "atol")))
    # most specific first; stable for ties (dict order)
    return tuple(sorted(rules, key=lambda r: specificity(r.pattern), reverse=True))


def _sqnr(v: Any, where: str) -> float:
    """A ``min_sqnr_db`` threshold: a finite number of dB >= 0 (an SQNR below 0 dB is an error larger
    than the signal: no threshold there means anything)."""
    if v is None:
        raise Bad(f"{where}: min_sqnr_db must be a number of dB, got None")
    try:
        return _number(v)
    except Bad as e:
        raise Bad(f"{where}: min_sqnr_db {e}") from None


def _rule_number(v: Any, where: str, what: str) -> float | None:
    if v is None:
        return None
    try:
        return _number(v)
    except Bad as e:
        raise Bad(f"{where}: {what} {e}") from None


@dataclass(frozen=True)
class RenameRule:
    """``rename`` entry: golden layer names matching ``source`` are compared with live ``target``.

    A source with ``*``/``?`` is a glob whose wildcards the target may reuse in order; otherwise it
    renames a prefix of whole dotted components (``encoder.layer`` -> ``encoder.layers`` also
    renames ``encoder.layer.0.attn``)."""

    source: str
    target: str
    regex: re.Pattern[str] = field(compare=False, repr=False)
    replacement: str = field(compare=False, repr=False)


def _rename(v: Any) -> tuple[RenameRule, ...]:
    if v is None:
        return ()
    if not isinstance(v, Mapping):
        raise Bad(f"must map golden layer names to live names (a dict of str -> str), got {type(v).__name__}")
    rules = []
    for src, dst in v.items():
        if not isinstance(src, str) or not isinstance(dst, str):
            raise Bad(f"maps golden names to live names (str -> str), got {src!r}: {dst!r}")
        if any(c in src for c in "*?"):
            rx = "".join("(.*)" if c == "*" else "(.)" if c == "?" else re.escape(c) for c in src)
            nstar = src.count("*") + src.count("?")
            if dst.count("*") + dst.count("?") not in (0, nstar):
                raise Bad(f"rename[{src!r}]: the target {dst!r} must use as many wildcards as the pattern")
            k = iter(range(1, nstar + 1))
            repl = "".join(f"\\g<{next(k)}>" if c in "*?" else c.replace("\\", "\\\\") for c in dst)
            rules.append(RenameRule(src, dst, re.compile(rx + r"\Z"), repl))
        else:  # prefix rule on whole dotted components
            rules.append(RenameRule(src, dst, re.compile(re.escape(src) + r"(?=\.|\Z)"), dst.replace("\\", "\\\\")))
    return tuple(rules)


# --------------------------------------------------------------------------- placements (distributed)


@dataclass(frozen=True)
class PlacementRule:
    """One ``placements`` entry: a glob over layer names (or ``layer/path``) and how the matching
    plain local shards are placed: a ``torch.distributed.tensor`` ``Shard(dim)`` or ``Replicate()``."""

    pattern: str
    placement: Any


@dataclass(frozen=True)
class PlacementTable:
    """The validated ``placements`` option; ``group`` is the process group (or 1-D mesh) the pieces
    come from (None: the whole world), set by passing an ``activation_guard.distributed.placements.Placements``."""

    rules: tuple[PlacementRule, ...] = ()
    group: Any = field(default=None, compare=False)

    def __bool__(self) -> bool:
        return bool(self.rules)


# torch's placement classes, named without importing torch.distributed.tensor (seconds): a value
# of them can only exist once the user's program imported it
_PLACEMENT_WHY = {
    "Partial": "a partial (unreduced) value cannot be reassembled by gathering; compare the reduced output of "
               "the layer that reduces it",
    "_StridedShard": "strided shards (FSDP + TP) are not supported",
}


def _placement(pattern: str, value: Any) -> Any:
    where = f"placements[{pattern!r}]"
    cls = value if isinstance(value, type) else type(value)
    ours = getattr(cls, "__module__", "").startswith("torch.distributed")
    if isinstance(value, type):
        hint = {"Shard": " (call it: Shard(-1))", "Replicate": " (call it: Replicate())"}.get(cls.__name__, "")
        raise Bad(f"{where}: got the class {cls.__name__}, not a placement{hint if ours else ''}")
    if ours and cls.__name__ == "Shard":
        dim = getattr(value, "dim", None)
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise Bad(f"{where}: Shard needs an integer dimension, got {dim!r}")
        return value
    if ours and cls.__name__ == "Replicate":
        return value
    why = _PLACEMENT_WHY.get(cls.__name__) if ours else None
    raise Bad(f"{where}: {why or 'expected Shard(dim) or Replicate() from torch.distributed.tensor'}, got {value!r}")


def _placements(v: Any) -> PlacementTable:
    if v is None:
        return PlacementTable()
    if not isinstance(v, Mapping):
        raise Bad("must map layer-name glob patterns to Shard(dim) or Replicate() (torch.distributed.tensor), "
                   f"got {type(v).__name__}")
    rules = []
    for pattern, value in v.items():
        if not isinstance(pattern, str):
            raise Bad(f"keys are glob patterns of layer names, got {pattern!r}")
        rules.append(PlacementRule(pattern, _placement(pattern, value)))
    return PlacementTable(tuple(rules), getattr(v, "group", None))


# --------------------------------------------------------------------------- fingerprints

_FP_TRUE = _TRUE | {"all"}
_FP_FALSE = (_FALSE - {""}) | {"none"}


def _fingerprint(v: Any) -> bool | tuple[str, ...]:
    """``True`` (every eligible output), ``False`` (none), or layer globs. Text (an ini value, a
    flag) is a boolean word or globs separated by commas or whitespace; so is a Python string."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        word = v.strip().lower()
        if word in _FP_TRUE:
            return True
        if word in _FP_FALSE:
            return False
        words = tuple(p for p in re.split(r"[\s,]+", v.strip()) if p)
        if not words:
            raise Bad("must be True, False, or layer globs (e.g. 'encoder.*'), got an empty string")
        return words
    if isinstance(v, (bytes, Mapping)) or not isinstance(v, Iterable):
        raise Bad(f"must be True, False, a layer glob or a list of them, got {v!r}")
    pats = _patterns(v)
    if not pats:
        raise Bad(f"an empty list fingerprints no layer; use False to keep every output exact, got {v!r}")
    if any(not p.strip() for p in pats):
        raise Bad(f"layer globs must not be empty, got {v!r}")
    return pats


def _fingerprint_params(v: Any) -> FingerprintParams:
    if isinstance(v, FingerprintParams):
        return v
    if not isinstance(v, Mapping):
        raise Bad(f"must be a dict with some of the keys {', '.join(PARAM_KEYS)}, got {v!r}")
    unknown = sorted(str(k) for k in v if k not in PARAM_KEYS)
    if unknown:
        raise Bad(f"unknown keys {unknown}; use {', '.join(PARAM_KEYS)}")
    try:
        return FingerprintParams(**{str(k): x for k, x in v.items()})
    except FingerprintError as e:
        raise Bad(str(e)) from None

"""Every record and compare option, validated once: :class:`RecordSpec` and :class:`CompareSpec`.

Options reach the engine from five places: keyword arguments of the Python API, the pytest
marker, ``check()`` arguments, ``--ag-*`` flags and ini keys, and the command line's ``diff``.
Each of them builds a spec with :func:`build_specs` (or ``CompareSpec.build``), and nothing else
checks an option's value. A bad value therefore gets the same message wherever it was set, and
that message names the option, the value and where it came from (its *source*)::

    activation_guard option rtol=-1 (marker): must be a finite number >= 0, got -1

Specs are frozen: the comparator, judges and reports read them and never change them. Options
given as text (ini keys, command-line flags) are parsed here too, so ``"1e-3"`` from an ini file
and ``1e-3`` from Python are one value with one set of rules.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import OptionError
from .fingerprint_params import PARAM_KEYS, FingerprintError, FingerprintParams

ARGUMENT = "argument"  # the source of a keyword argument of record/compare/compare_models
TOLERANCE_MODES = ("strict", "calibrated")
REPLAY_MODES = ("first", "all", "off")
COMPRESSIONS = (None, "gzip", "lzf")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class _Bad(Exception):
    """A parser's complaint; :func:`_parse` turns it into an :class:`OptionError`."""


def _fmt(v: Any) -> str:
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
            raise _Bad(f"must be a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise _Bad(f"must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise _Bad(f"must be a finite number >= 0, got {_fmt(f)}")
    return f


def _optional_number(v: Any) -> float | None:
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    return _number(v)


def _flag(v: Any) -> bool:
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if not isinstance(v, bool):
        raise _Bad(f"must be True or False, got {v!r}")
    return v


def _patterns(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return (v,)
    if isinstance(v, (bytes, Mapping)):
        raise _Bad(f"must be a glob string or a list of them, got {v!r}")
    try:
        pats = tuple(v)
    except TypeError:
        raise _Bad(f"must be a glob string or a list of them, got {v!r}") from None
    for p in pats:
        if not isinstance(p, str):
            raise _Bad(f"must contain glob strings, got {p!r}")
    return pats


def _choice(options: tuple[Any, ...]) -> Callable[[Any], Any]:
    def parse(v: Any) -> Any:
        if v not in options:
            shown = " or ".join(repr(o) for o in options)
            raise _Bad(f"must be {shown}, got {v!r}")
        return v

    return parse


# --- gradients (issue 14)
def _backward(v: Any) -> bool | Callable[[Any], Any]:
    """``backward``: True/False (also as text from ini and flags) or a loss function."""
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if isinstance(v, bool):
        return v
    if callable(v) and not isinstance(v, type):
        return v  # type: ignore[no-any-return]
    raise _Bad(f"must be True, False or a callable(output) -> scalar loss, got {v!r}")
# --- end gradients


@dataclass(frozen=True)
class ToleranceRule:
    """One ``tolerances`` entry: a layer glob and the rtol and/or atol it sets."""

    pattern: str
    rtol: float | None
    atol: float | None

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
        raise _Bad(f"must be a dict of layer glob -> dict(rtol=..., atol=...), got {type(v).__name__}")
    rules = []
    for pat, rule in v.items():
        if not isinstance(pat, str):
            raise _Bad(f"keys must be glob strings, got {pat!r}")
        where = f"tolerances[{pat!r}]"
        if isinstance(rule, Mapping):
            unknown = set(rule) - {"rtol", "atol"}
            if unknown:
                raise _Bad(f"{where}: unknown keys {sorted(map(str, unknown))}; use rtol and atol")
            r, a = rule.get("rtol"), rule.get("atol")
        elif isinstance(rule, (tuple, list)) and len(rule) == 2:
            r, a = rule
        else:
            raise _Bad(f"{where} must be a dict(rtol=..., atol=...) or an (rtol, atol) pair, got {rule!r}")
        if r is None and a is None:
            raise _Bad(f"{where} sets neither rtol nor atol")
        rules.append(ToleranceRule(pat, _rule_number(r, where, "rtol"), _rule_number(a, where, "atol")))
    # most specific first; stable for ties (dict order)
    return tuple(sorted(rules, key=lambda r: specificity(r.pattern), reverse=True))


def _rule_number(v: Any, where: str, what: str) -> float | None:
    if v is None:
        return None
    try:
        return _number(v)
    except _Bad as e:
        raise _Bad(f"{where}: {what} {e}") from None


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
        raise _Bad(f"must map golden layer names to live names (a dict of str -> str), got {type(v).__name__}")
    rules = []
    for src, dst in v.items():
        if not isinstance(src, str) or not isinstance(dst, str):
            raise _Bad(f"maps golden names to live names (str -> str), got {src!r}: {dst!r}")
        if any(c in src for c in "*?"):
            rx = "".join("(.*)" if c == "*" else "(.)" if c == "?" else re.escape(c) for c in src)
            nstar = src.count("*") + src.count("?")
            if dst.count("*") + dst.count("?") not in (0, nstar):
                raise _Bad(f"rename[{src!r}]: the target {dst!r} must use as many wildcards as the pattern")
            k = iter(range(1, nstar + 1))
            repl = "".join(f"\\g<{next(k)}>" if c in "*?" else c.replace("\\", "\\\\") for c in dst)
            rules.append(RenameRule(src, dst, re.compile(rx + r"\Z"), repl))
        else:  # prefix rule on whole dotted components
            rules.append(RenameRule(src, dst, re.compile(re.escape(src) + r"(?=\.|\Z)"), dst.replace("\\", "\\\\")))
    return tuple(rules)


# --------------------------------------------------------------------------- placements (issue 16, distributed)


@dataclass(frozen=True)
class PlacementRule:
    """One ``placements`` entry: a glob over layer names (or ``layer/path``) and how the matching
    plain local shards are placed: a ``torch.distributed.tensor`` ``Shard(dim)`` or ``Replicate()``."""

    pattern: str
    placement: Any


@dataclass(frozen=True)
class PlacementTable:
    """The validated ``placements`` option; ``group`` is the process group (or 1-D mesh) the pieces
    come from (None: the whole world), set by passing an ``activation_guard.placements.Placements``."""

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
        raise _Bad(f"{where}: got the class {cls.__name__}, not a placement{hint if ours else ''}")
    if ours and cls.__name__ == "Shard":
        dim = getattr(value, "dim", None)
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise _Bad(f"{where}: Shard needs an integer dimension, got {dim!r}")
        return value
    if ours and cls.__name__ == "Replicate":
        return value
    why = _PLACEMENT_WHY.get(cls.__name__) if ours else None
    raise _Bad(f"{where}: {why or 'expected Shard(dim) or Replicate() from torch.distributed.tensor'}, got {value!r}")


def _placements(v: Any) -> PlacementTable:
    if v is None:
        return PlacementTable()
    if not isinstance(v, Mapping):
        raise _Bad("must map layer-name glob patterns to Shard(dim) or Replicate() (torch.distributed.tensor), "
                   f"got {type(v).__name__}")
    rules = []
    for pattern, value in v.items():
        if not isinstance(pattern, str):
            raise _Bad(f"keys are glob patterns of layer names, got {pattern!r}")
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
            raise _Bad("must be True, False, or layer globs (e.g. 'encoder.*'), got an empty string")
        return words
    if isinstance(v, (bytes, Mapping)) or not isinstance(v, Iterable):
        raise _Bad(f"must be True, False, a layer glob or a list of them, got {v!r}")
    pats = _patterns(v)
    if not pats:
        raise _Bad(f"an empty list fingerprints no layer; use False to keep every output exact, got {v!r}")
    if any(not p.strip() for p in pats):
        raise _Bad(f"layer globs must not be empty, got {v!r}")
    return pats


def _fingerprint_params(v: Any) -> FingerprintParams:
    if isinstance(v, FingerprintParams):
        return v
    if not isinstance(v, Mapping):
        raise _Bad(f"must be a dict with some of the keys {', '.join(PARAM_KEYS)}, got {v!r}")
    unknown = sorted(str(k) for k in v if k not in PARAM_KEYS)
    if unknown:
        raise _Bad(f"unknown keys {unknown}; use {', '.join(PARAM_KEYS)}")
    try:
        return FingerprintParams(**{str(k): x for k, x in v.items()})
    except FingerprintError as e:
        raise _Bad(str(e)) from None


# --------------------------------------------------------------------------- the option table


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    record: bool  # RecordSpec has it
    compare: bool  # CompareSpec has it
    help: str


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("rtol", _optional_number, False, True, "relative tolerance for every float output"),
    Option("atol", _optional_number, False, True, "absolute tolerance for every float output"),
    Option("tolerances", _tolerances, False, True, "per-layer {glob: dict(rtol=, atol=)}; most specific wins"),
    Option("include", _patterns, True, True, "only layers matching these globs"),
    Option("exclude", _patterns, True, True, "skip layers matching these globs"),
    Option("rename", _rename, False, True, "{golden name or glob: live name}: compare renamed layers"),
    Option("fail_fast", _flag, False, True, "stop at the first diverging layer call"),
    Option("allow_dtype_change", _flag, False, True, "compare float outputs whose dtype changed, in float32"),
    Option("tolerance", _choice(TOLERANCE_MODES), False, True, "'strict' rtol/atol or 'calibrated' noise floors"),
    Option("compression", _choice(COMPRESSIONS), True, False, "HDF5 compression of large outputs: gzip or lzf"),
    Option("calibrate", _flag, True, False, "also store float64 noise floors (for tolerance='calibrated')"),
    Option("grad", _flag, True, True, "run the forward with autograd on (forwards that call torch.autograd.grad)"),
    Option("placements", _placements, False, True,
           "multi-rank runs: {glob: Shard(dim) | Replicate()} for plain local shards, gathered to compare"),
    Option("inputs", _flag, True, False, "also record each layer call's inputs (needed to replay and attribute)"),
    Option("replay", _choice(REPLAY_MODES), False, True,
           "re-run diverging layers on the golden's inputs: 'first' (attribute the first divergence), "
           "'all' (judge every layer by its own error) or 'off'"),
    Option("fingerprint", _fingerprint, True, False,
           "store fixed-size fingerprints instead of values: True (every large float output) or layer globs"),
    Option("fingerprint_params", _fingerprint_params, True, False,
           "fingerprint size and false-alarm bound: dict(samples=, rows=, buckets=, false_alarm=, seed=)"),
    Option("backward", _backward, True, True,  # gradients (issue 14)
           "also record (compare) gradients: True (loss = outputs x seeded random cotangents), a callable(output) "
           "-> scalar loss, or False"),
)}


def _parse(name: str, value: Any, source: str) -> Any:
    opt = OPTIONS[name]
    try:
        return opt.parse(value)
    except _Bad as e:
        raise OptionError(name, value, source, str(e)) from None


def _source_of(sources: Mapping[str, str] | str, key: str) -> str:
    return sources if isinstance(sources, str) else sources.get(key, ARGUMENT)


class _SpecBase:
    """Shared construction: parse each given option, remember where it came from."""

    sources: Mapping[str, str]
    given: Mapping[str, Any]

    @classmethod
    def build(cls, values: Mapping[str, Any] | None = None, sources: Mapping[str, str] | str = ARGUMENT) -> Any:
        """A spec from option values (``None`` means "not set": the default applies)."""
        values = values or {}
        mine = {f.name for f in fields(cls)} - {"sources", "given"}  # type: ignore[arg-type]
        unknown = sorted(k for k in values if k not in mine)
        if unknown:
            k = unknown[0]
            raise OptionError(k, values[k], _source_of(sources, k),
                              f"is not an option of {cls.__name__} (it takes {', '.join(sorted(mine))})")
        kw: dict[str, Any] = {}
        src: dict[str, str] = {}
        given: dict[str, Any] = {}
        for k, v in values.items():
            if v is None:
                continue
            s = _source_of(sources, k)
            kw[k] = _parse(k, v, s)
            src[k] = s
            given[k] = v
        return cls(**kw, sources=src, given=given)  # type: ignore[call-arg]

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def explicit(self) -> dict[str, tuple[str, str]]:
        """Each option set explicitly: ``name -> (value as shown, source)``. Scalars are shown
        parsed (``--ag-rtol 1e-5`` is ``1e-05``), structures as given."""
        out = {}
        for k, src in self.sources.items():
            v = getattr(self, k)
            out[k] = (_fmt(v) if v is None or isinstance(v, (bool, int, float, str)) else _fmt(self.given[k]), src)
        return out

    def describe(self) -> str:
        """The options set explicitly, with their sources: "rtol=0.001 (marker), ..."."""
        return describe(self)


@dataclass(frozen=True)
class RecordSpec(_SpecBase):
    """How a golden is recorded."""

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    compression: str | None = None
    calibrate: bool = False
    grad: bool = False
    inputs: bool = True
    fingerprint: bool | tuple[str, ...] = False
    fingerprint_params: FingerprintParams = field(default_factory=FingerprintParams)
    backward: bool | Callable[[Any], Any] = False  # gradients (issue 14): False, True or a loss function
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    given: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if "fingerprint_params" in self.sources and "fingerprint" not in self.sources:
            raise OptionError("fingerprint_params", self.given.get("fingerprint_params"),
                              self.sources["fingerprint_params"],
                              "has no effect unless fingerprint is set too (True, or layer globs)")


@dataclass(frozen=True)
class CompareSpec(_SpecBase):
    """How a live run (or a second recording) is judged against a golden.

    ``tolerance="calibrated"`` judges float outputs against noise floors; there, explicit numbers
    keep a precise meaning (docs/architecture.md): a layer matched by a ``tolerances`` pattern is
    judged strictly with that pattern's numbers, and ``rtol``/``atol`` are the strict numbers for
    outputs that have no noise floor. The report says which rule judged each output.
    """

    rtol: float | None = None
    atol: float | None = None
    tolerances: tuple[ToleranceRule, ...] = ()
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    rename: tuple[RenameRule, ...] = ()
    fail_fast: bool = False
    allow_dtype_change: bool = False
    tolerance: str = "strict"
    grad: bool = False
    placements: PlacementTable = PlacementTable()  # issue 16 (distributed): docs/distributed.md
    replay: str = "first"
    # gradients (issue 14): None checks them when the golden has them; False never; True or a loss function
    backward: bool | Callable[[Any], Any] | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    given: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def calibrated(self) -> bool:
        return self.tolerance == "calibrated"

    def with_selection(self, include: Iterable[str] | None, exclude: Iterable[str] | None) -> CompareSpec:
        """A copy selecting these layers (the golden's recorded selection, applied by default)."""
        return replace(self, include=None if include is None else tuple(include),
                                   exclude=None if exclude is None else tuple(exclude))


def describe(*specs: _SpecBase) -> str:
    """The options set explicitly in any of ``specs``, with their sources, sorted by name."""
    items: dict[str, tuple[str, str]] = {}
    for spec in specs:
        items.update(spec.explicit())
    if not items:
        return "engine defaults"
    return ", ".join(f"{k}={v} ({src})" for k, (v, src) in sorted(items.items()))


def build_specs(values: Mapping[str, Any],
                sources: Mapping[str, str] | str = ARGUMENT) -> tuple[RecordSpec, CompareSpec]:
    """Split one set of options (a marker's, a ``check()``'s, merged) into both specs.

    An option neither spec knows is an error naming it and its source."""
    for k, v in values.items():
        if k not in OPTIONS:
            raise OptionError(k, v, _source_of(sources, k),
                              f"is not an activation_guard option (options: {', '.join(sorted(OPTIONS))})")
    rec = RecordSpec.build({k: v for k, v in values.items() if OPTIONS[k].record}, sources)
    cmp_ = CompareSpec.build({k: v for k, v in values.items() if OPTIONS[k].compare}, sources)
    return rec, cmp_

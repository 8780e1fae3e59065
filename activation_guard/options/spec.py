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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from .._core.errors import OptionError
from .._core.metrics import METRICS, Metric
from ..fingerprints.params import FingerprintParams
from .parse import (
    COMPRESSIONS,
    REPLAY_MODES,
    TOLERANCE_MODES,
    Bad,
    PlacementRule,
    PlacementTable,
    RenameRule,
    ToleranceRule,
    _backward,
    _choice,
    _fingerprint,
    _fingerprint_params,
    _flag,
    _optional_number,
    _patterns,
    _placements,
    _rename,
    _tolerances,
    fmt,
    specificity,
)

ARGUMENT = "argument"  # the source of a keyword argument of record/compare/compare_models
__all__ = [
    "ARGUMENT",
    "COMPRESSIONS",
    "OPTIONS",
    "REPLAY_MODES",
    "TOLERANCE_MODES",
    "CompareSpec",
    "Option",
    "PlacementRule",
    "PlacementTable",
    "RecordSpec",
    "RenameRule",
    "ToleranceRule",
    "build_specs",
    "describe",
    "markdown_table",
    "specificity",
]


# --------------------------------------------------------------------------- the option table


FlagTakes = Literal["switch", "value", "values"]  # a bare flag; one value; a value per repetition


@dataclass(frozen=True)
class Option:
    """One option, declared once: where it can be given and what it means. The API keyword, the
    marker and ``check()`` take every option by ``name``; ``flag`` and ``ini`` are the pytest
    command-line flag and ini key that also set it, ``cli`` the flag of ``activation-guard diff``
    (None: none). pytest's ``--help``, the command line's parser and docs/options.md are generated
    from this table (:meth:`pytest_help`, :meth:`cli_help`, :func:`markdown_table`), ``help`` being
    the one text."""

    name: str
    parse: Callable[[Any], Any]
    record: bool  # RecordSpec has it
    compare: bool  # CompareSpec has it
    help: str
    flag: str | None = None
    ini: str | None = None
    cli: str | None = None
    metavar: str | None = None  # a flag's value in --help (default: the choices, or the name in capitals)
    choices: tuple[str, ...] = ()  # the values a flag takes (checked by ``parse``, shown in --help)
    takes: FlagTakes | None = None  # None: a switch when the option is True/False, else one value
    from_file: bool = False  # the command line's flag names a JSON file holding the value

    @property
    def flag_takes(self) -> FlagTakes:
        if self.takes is not None:
            return self.takes
        return "switch" if self.parse is _flag else "value"

    @property
    def flag_metavar(self) -> str:
        if self.metavar is not None:
            return self.metavar
        return "{" + ",".join(self.choices) + "}" if self.choices else self.name.upper()

    @property
    def dest(self) -> str:
        """The attribute pytest keeps the flag's value under."""
        assert self.flag is not None
        return self.flag.lstrip("-").replace("-", "_")

    def pytest_help(self) -> str:
        """The pytest flag's help: the option's text, when it applies, and what it overrides."""
        side = ("when recording" if not self.compare else "when comparing" if not self.record
                else "when recording and comparing")
        ini = f"overrides ini {self.ini}, " if self.ini else ""
        return _escape(f"{side}: {self.help}; {ini}overridden by markers and check() arguments.")

    def ini_help(self) -> str:
        over = f"{self.flag} overrides it, and so do " if self.flag else "overridden by "
        return f"activation_guard {self.name}: {self.help}; {over}markers and check() arguments"  # printed as is

    def cli_help(self) -> str:
        """The command line's flag help: the option's text, and how the flag gives it."""
        how = " (a JSON file)" if self.from_file else " (repeatable)" if self.flag_takes == "values" else ""
        return _escape(self.help + how)


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help texts with %


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("rtol", _optional_number, False, True,
           "relative tolerance for every float output no tolerances pattern names",
           "--ag-rtol", "ag_rtol", cli="--rtol"),
    Option("atol", _optional_number, False, True,
           "absolute tolerance for every float output no tolerances pattern names",
           "--ag-atol", "ag_atol", cli="--atol"),
    Option("tolerances", _tolerances, False, True,
           "per-layer {glob: dict(rtol=, atol=)} or {glob: dict(min_sqnr_db=)} (judged by SQNR, dB); most specific "
           "wins",
           cli="--tolerances", metavar="FILE.json", from_file=True),
    Option("include", _patterns, True, True, "only layers matching these globs", cli="--include", metavar="GLOB",
           takes="values"),
    Option("exclude", _patterns, True, True, "skip layers matching these globs", cli="--exclude", metavar="GLOB",
           takes="values"),
    Option("rename", _rename, False, True, "{golden name or glob: live name}: compare renamed layers"),
    Option("fail_fast", _flag, False, True, "stop at the first diverging layer call", "--ag-fail-fast"),
    Option("allow_dtype_change", _flag, False, True, "compare float outputs whose dtype changed, in float32",
           cli="--allow-dtype-change"),
    Option("tolerance", _choice(TOLERANCE_MODES), False, True,
           "'strict' rtol/atol (per dtype and layer) or 'calibrated': each output's error against the golden's and "
           "the live run's float64 noise floors (cross-device, TF32, reduced precision)", "--ag-tolerance",
           choices=TOLERANCE_MODES),
    Option("compression", _choice(COMPRESSIONS), True, False, "HDF5 compression of large outputs: gzip or lzf"),
    Option("calibrate", _flag, True, False,
           "also store float64 noise floors (for tolerance='calibrated', which turns this on when recording)",
           "--ag-calibrate"),
    Option("grad", _flag, True, True, "run the forward with autograd on (forwards that call torch.autograd.grad)"),
    Option("placements", _placements, False, True,
           "multi-rank runs: {glob: Shard(dim) | Replicate()} for plain local shards, gathered to compare"),
    Option("inputs", _flag, True, False, "also record each layer call's inputs (needed to replay and attribute)"),
    Option("replay", _choice(REPLAY_MODES), False, True,
           "re-run diverging layers on the golden's recorded inputs: 'first' (the first divergence: whether it "
           "changed itself or inherited the difference, its origin), 'all' (judge every layer by its own error: a "
           "cross-device or precision gate immune to drift) or 'off'", "--ag-replay", "ag_replay",
           choices=REPLAY_MODES),
    Option("fingerprint", _fingerprint, True, False,
           "store fixed-size fingerprints (a few KiB) instead of the values of float outputs larger than that "
           "(integer, bool and small outputs stay exact): True (every layer; the bare flag) or layer globs (in text: "
           "separated by commas or spaces); comparing needs no option (sound but probabilistic: docs/fingerprint.md)",
           "--ag-fingerprint", "ag_fingerprint",
           takes="switch"),
    Option("fingerprint_params", _fingerprint_params, True, False,
           "fingerprint size and false-alarm bound: dict(samples=, rows=, buckets=, false_alarm=, seed=)"),
    Option("where", _patterns, False, True,
           "layer globs whose diverged calls also get the shape of their divergence (per-dimension words, heatmap); "
           "the first two diverged calls always do"),
    Option("metric", _choice((None, *METRICS)), False, True,
           "also measure each float output's error as 'sqnr' (dB), 'cosine', 'mse' or 'rel_l2' "
           "(docs/quantization.md; min_sqnr_db patterns measure SQNR)", cli="--metric", choices=tuple(METRICS)),
    Option("backward", _backward, True, True,  # gradients
           "also record (compare) gradients: True (loss = outputs x seeded random cotangents), a callable(output) "
           "-> scalar loss, or False"),
)}


def markdown_table() -> str:
    """docs/options.md's table: every option, what it means, and where it can be given."""
    rows = ["| option | record | compare | pytest flag | ini key | `diff` flag | meaning |",
            "|---|---|---|---|---|---|---|"]
    for o in OPTIONS.values():
        flag = f"`{o.flag}`" if o.flag else ""
        ini = f"`{o.ini}`" if o.ini else ""
        cli = f"`{o.cli}`" if o.cli else ""
        meaning = o.help.replace("|", "\\|")
        rows.append(f"| `{o.name}` | {'yes' if o.record else ''} | {'yes' if o.compare else ''} | {flag} | {ini} "
                    f"| {cli} | {meaning} |")
    return "\n".join(rows) + "\n"


def _parse(name: str, value: Any, source: str) -> Any:
    opt = OPTIONS[name]
    try:
        return opt.parse(value)
    except Bad as e:
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
            out[k] = (fmt(v) if v is None or isinstance(v, (bool, int, float, str)) else fmt(self.given[k]), src)
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
    backward: bool | Callable[[Any], Any] = False  # gradients: False, True or a loss function
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
    placements: PlacementTable = field(default_factory=PlacementTable)  # distributed: docs/distributed.md
    replay: str = "first"
    where: tuple[str, ...] | None = None  # layers described beyond the first diverged calls
    metric: Metric | None = None  # an error metric every float output is measured by (_core/metrics.py)
    # gradients: None checks them when the golden has them; False never; True or a loss function
    backward: bool | Callable[[Any], Any] | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    given: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def calibrated(self) -> bool:
        return self.tolerance == "calibrated"

    @property
    def sqnr_gate(self) -> bool:
        """Whether a ``tolerances`` pattern judges its layers by SQNR (``min_sqnr_db``)."""
        return any(r.min_sqnr_db is not None for r in self.tolerances)

    @property
    def measured(self) -> Metric | None:
        """The metric outputs are measured by: the one asked for, else SQNR under an SQNR gate."""
        return self.metric or ("sqnr" if self.sqnr_gate else None)

    def __post_init__(self) -> None:
        if self.sqnr_gate and self.calibrated:
            raise OptionError("tolerances", self.given.get("tolerances"), self.sources.get("tolerances", ARGUMENT),
                              "min_sqnr_db judges a layer by SQNR, tolerance='calibrated' by noise floors: choose "
                              "one")
        if self.metric is not None and self.calibrated:
            raise OptionError("metric", self.metric, self.sources.get("metric", ARGUMENT),
                              "is measured by the strict rule's judge; tolerance='calibrated' judges by noise floors "
                              "(its report gives each output's error as a multiple of its floor): choose one")

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

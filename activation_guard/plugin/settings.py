"""The pytest layer's options: session settings, per-check precedence, and the one place that
turns merged option values into the record and compare specs.

Layering (as in syrupy): ``plugin.py`` reads pytest's config and hands plain values here;
:mod:`activation_guard.plugin.session` keeps the run's bookkeeping; :mod:`activation_guard.plugin.check` is the
fixture object. Nothing here imports pytest or torch, so unit tests drive it directly and the
plugin starts without torch.

Every option value carries the place it was set (``ini ag_rtol``, ``command line --ag-rtol``,
``marker``, ``check()``) so an error can point at the line the user must change. Option values
are judged in exactly one place, :mod:`activation_guard.options.spec` (via :func:`engine_specs`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from .._core.errors import OptionError
from ..options.spec import OPTIONS, CompareSpec, RecordSpec, build_specs
from ..store.naming import is_hdf5_file


def _report_path(p: Path, golden_dir: Path) -> Path:
    """``--ag-report``'s file, refused where writing it would destroy something: a folder, an
    HDF5 file (a golden: the report would replace it on a run that asked for no golden write), a
    name a golden would have, or a place inside the golden folder."""
    if p.is_dir():
        raise OptionError.usage("--ag-report", f"--ag-report {p}: is a folder; give a file name")
    if p.suffix.lower() in (".h5", ".hdf5") or golden_dir in p.parents:
        raise OptionError.usage("--ag-report", f"--ag-report {p}: names a golden file or a place in the golden "
                                f"folder {golden_dir}; a report (.json, .html, .md) goes elsewhere")
    if is_hdf5_file(p):
        raise OptionError.usage("--ag-report", f"--ag-report {p}: is an HDF5 file (a golden?), which a report "
                                f"never overwrites; give another file name")
    return p

DEVICE_FIXTURE = "ag_device"
RECORD_DEVICE = "cpu"  # the ag_device variant that writes goldens under --ag-update
UPDATE_MODES = (None, "all", "missing")
UNUSED_MODES = (None, "fail", "list")
# the flags that take an optional value, and the values a separate word may give them
OPTIONAL_VALUES = {"--ag-update": ("all", "missing"), "--ag-unused": ("fail", "list")}


def join_optional_values(args: list[str], exists: Callable[[str], bool]) -> None:
    """``--ag-update missing`` read as ``--ag-update=missing`` (in place): argparse would take the word
    for a test path. A word that names an existing file or folder stays a path."""
    i = 0
    while i < len(args) - 1:
        values = OPTIONAL_VALUES.get(args[i])
        if values is not None and args[i + 1] in values and not exists(args[i + 1]):
            args[i : i + 2] = [f"{args[i]}={args[i + 1]}"]
        i += 1
# Options the plugin itself consumes (never forwarded as-is to record/compare).
PLUGIN_KEYS = frozenset({"path", "model", "args", "kwargs"})
PREFIX = "activation_guard"

# Where an option set in ini or on the command line came from, per key (shown in errors).
INI_KEYS = {o.name: o.ini for o in OPTIONS.values() if o.ini}  # the option table is the one place they are declared
CLI_FLAGS = {o.name: o.flag for o in OPTIONS.values() if o.flag}


DEFAULT_RANK_TIMEOUT = 120.0


def _rank_timeout(value: str | float | None) -> float:
    if value is None:
        return DEFAULT_RANK_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise OptionError.usage("--ag-rank-timeout",
                                f"--ag-rank-timeout must be a number of seconds > 0, got {value!r}")
    return seconds


def prefixed(message: str) -> str:
    """A failure text with exactly one ``activation_guard`` prefix (engine messages such as
    "activation_guard needs a torch.nn.Module" already carry the name)."""
    return message if message.startswith(PREFIX) else f"{PREFIX}: {message}"


# --------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """Session-wide settings, already resolved from the command line and ini."""

    golden_dir: Path
    update: str | None = None  # None, "all" or "missing"
    report_path: Path | None = None
    unused: str | None = None  # None, "fail" or "list"
    check_determinism: bool = False  # run each checked forward twice and list unstable layers
    rank_timeout: float = DEFAULT_RANK_TIMEOUT  # seconds rank 0 waits for other ranks' verdicts
    ini_options: dict[str, Any] = field(default_factory=dict)  # from [tool.pytest.ini_options]
    cli_options: dict[str, Any] = field(default_factory=dict)  # from --ag-rtol/--ag-atol/--ag-fail-fast/...
    rootdir: Path = field(default_factory=Path.cwd)
    cli_golden_dir: str | None = None  # --ag-golden-dir as typed (repeated in re-record commands)
    invocation_dir: Path | None = None  # where pytest was started: re-record commands are typed there
    cli_rootdir: str | None = None  # pytest's --rootdir as typed (repeated in re-record commands)
    has_config_file: bool = True  # False: pytest found no ini/pyproject, so its rootdir follows the start folder

    def __post_init__(self) -> None:
        if self.update not in UPDATE_MODES:
            raise OptionError.usage("--ag-update",
                                    f"--ag-update must be given alone or as --ag-update=missing, got {self.update!r}")
        if self.unused not in UNUSED_MODES:
            raise OptionError.usage("--ag-unused",
                                    f"--ag-unused must be given alone or as --ag-unused=list, got {self.unused!r}")

    @classmethod
    def build(
        cls,
        *,
        rootdir: Path,
        invocation_dir: Path,
        ini_golden_dir: str,
        ini: Mapping[str, str | None] | None = None,
        cli: Mapping[str, Any] | None = None,
        cli_golden_dir: str | None = None,
        update: str | None = None,
        report_path: str | None = None,
        unused: str | None = None,
        check_determinism: bool = False,
        rank_timeout: str | float | None = None,
        cli_rootdir: str | None = None,
        has_config_file: bool = True,
    ) -> Settings:
        """Command-line paths are relative to where pytest was invoked; ini paths to the rootdir.
        ``ini`` and ``cli``: option name -> its ini key's text and its pytest flag's value (a
        switch's False, a value flag's None: not given), for the options of ``OPTIONS`` with one."""
        ini, cli = dict(ini or {}), dict(cli or {})
        value_flags = [(OPTIONS[k].flag or k, v) for k, v in cli.items() if OPTIONS[k].flag_takes != "switch"]
        for option, given in (("--ag-golden-dir", cli_golden_dir), *value_flags, ("--ag-report", report_path)):
            if isinstance(given, str) and not given.strip():  # `--ag-golden-dir=$DIR` with DIR unset
                raise OptionError.usage(option, f"{option} is empty; give a value or leave the option out")
        if cli_golden_dir:
            gdir = Path(invocation_dir, cli_golden_dir)
        else:
            if not ini_golden_dir or not ini_golden_dir.strip():
                raise OptionError.usage(
                    "ag_golden_dir",
                    'ini option ag_golden_dir is empty; set it to a folder, e.g. ag_golden_dir = "golden"',
                )
            gdir = Path(rootdir, ini_golden_dir.strip())
        if gdir.exists() and not gdir.is_dir():
            src = "--ag-golden-dir" if cli_golden_dir else "ini option ag_golden_dir"
            raise OptionError.usage(
                src,
                f"{src}: {gdir} exists and is not a folder; point it at a folder (created when goldens are written)",
            )
        # raw values (ini text, flags as typed), judged once by the spec right here, so a bad one
        # is a usage error before any test runs, worded as from every other source
        ini = {k: v for k, v in ini.items() if v is not None and str(v).strip()}
        cli = {k: v for k, v in cli.items() if v is not None and v is not False}
        build_specs(ini, {k: source_label("ini", k) for k in ini})
        build_specs(cli, {k: source_label("command line", k) for k in cli})
        golden_dir = Path(os.path.abspath(gdir))
        return cls(
            golden_dir=golden_dir,
            update=update,
            report_path=(_report_path(Path(os.path.abspath(Path(invocation_dir, report_path))), golden_dir)
                         if report_path else None),
            unused=unused,
            check_determinism=check_determinism,
            rank_timeout=_rank_timeout(rank_timeout),
            ini_options=ini,
            cli_options=cli,
            rootdir=rootdir,
            cli_golden_dir=cli_golden_dir or None,
            invocation_dir=invocation_dir,
            cli_rootdir=cli_rootdir or None,
            has_config_file=has_config_file,
        )

    def display(self, p: str | os.PathLike[str]) -> str:
        """A path as a person wants to read it: relative to the rootdir when inside it."""
        p = Path(p)
        try:
            return p.relative_to(self.rootdir).as_posix()
        except ValueError:
            return str(p)


# --------------------------------------------------------------------------- precedence


@dataclass
class ResolvedOptions:
    """The options of one check, with where each came from (shown when something is wrong)."""

    values: dict[str, Any]
    sources: dict[str, str]

    def describe(self) -> str:
        if not self.values:
            return "engine defaults"
        return ", ".join(f"{k}={v!r} ({self.sources[k]})" for k, v in sorted(self.values.items()))

    def where(self, *keys: str) -> str:
        """``key=value (source)`` for the given keys that are set."""
        return ", ".join(f"{k}={self.values[k]!r} ({self.sources[k]})" for k in keys if k in self.values)


def source_label(level: str, key: str) -> str:
    """The name of the place an option was set: ``ini ag_rtol``, ``command line --ag-rtol``..."""
    if level == "ini":
        return f"ini {INI_KEYS[key]}" if key in INI_KEYS else "ini"
    if level == "command line":
        return f"command line {CLI_FLAGS[key]}" if key in CLI_FLAGS else "command line"
    return level


def resolve_options(
    ini: Mapping[str, Any],
    cli: Mapping[str, Any],
    marker: Mapping[str, Any],
    call: Mapping[str, Any],
) -> ResolvedOptions:
    """Merge per key, highest first: ``check()`` kwargs > marker > command line > ini > engine
    defaults. A value of ``None`` means "not set at this level" (the next level applies)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for level, layer in (("ini", ini), ("command line", cli), ("marker", marker), ("check()", call)):
        for k, v in layer.items():
            if v is None:
                continue
            values[k] = v
            sources[k] = source_label(level, k)
    return ResolvedOptions(values, sources)


def marker_options(marks: Iterable[Any], where: str) -> dict[str, Any]:
    """Merge ``activation_guard`` marks, closest first (as ``item.iter_markers`` yields them):
    a function's mark overrides its class's, which overrides the module's."""
    merged: dict[str, Any] = {}
    for mark in list(marks)[::-1]:
        if mark.args:
            raise OptionError.usage(
                "marker", f"{where}: @pytest.mark.activation_guard takes keyword options only "
                f"(e.g. rtol=1e-4), got positional {mark.args!r}"
            )
        merged.update(mark.kwargs)
    return merged


# --------------------------------------------------------------------------- the one judge of option values


def engine_specs(opts: ResolvedOptions) -> tuple[RecordSpec, CompareSpec]:
    """The record and compare specs of one check. Option values are judged by
    :func:`activation_guard.options.spec.build_specs` alone (the same rules and messages as the API and
    the command line), with each value's source; this adds only what is the plugin's own: the
    keys it sets itself, and that a calibrated comparison records the golden's noise floors."""
    bad = sorted(k for k in opts.values if k in PLUGIN_KEYS)
    if bad:
        raise OptionError.usage(", ".join(bad),
                                f"option(s) {bad} are set by the plugin and cannot be given ({opts.describe()})")
    rec, cmp_ = build_specs(opts.values, opts.sources)
    if cmp_.calibrated and "calibrate" not in opts.values:
        rec = replace(rec, calibrate=True,
                      sources={**rec.sources,
                               "calibrate": f"implied by tolerance='calibrated' ({cmp_.source('tolerance')})"},
                      given={**rec.given, "calibrate": True})
    return rec, cmp_


# --------------------------------------------------------------------------- commands shown to the user


def rerecord_command(
    settings: Settings,
    opts: ResolvedOptions | None = None,
    nodeid: str | None = None,
    *,
    missing_only: bool = False,
    fingerprinted: bool = False,
) -> str:
    """The shell command that (re)records a golden with the options in force that change what is
    recorded or where: ``--ag-golden-dir`` when it was given on the command line,
    ``--ag-calibrate`` when the comparison is calibrated (which needs a calibrated golden) or
    calibration was asked for, and ``--ag-fingerprint`` when it was given, or when the golden
    being replaced fingerprinted every layer (``fingerprinted``) and no option sets ``fingerprint``
    now (a re-record must not silently turn a 100 KB golden into a 100 MB one). Options from ini,
    markers and ``check()`` apply again by themselves; tolerances do not change what is recorded.
    ``nodeid=None``: every test."""
    values = opts.values if opts is not None else settings.cli_options
    argv = ["pytest", "--ag-update=missing" if missing_only else "--ag-update"]
    if settings.cli_rootdir:  # the golden folder hangs from the rootdir
        argv.append(f"--rootdir={settings.cli_rootdir}")
    if settings.cli_golden_dir:
        argv.append(f"--ag-golden-dir={settings.cli_golden_dir}")
    if values.get("tolerance") == "calibrated" or values.get("calibrate") is True:
        argv.append("--ag-calibrate")
    if settings.cli_options.get("fingerprint") is True or (fingerprinted and values.get("fingerprint") is None):
        argv.append("--ag-fingerprint")
    if nodeid is not None:
        argv.append(_from_invocation(settings, nodeid))
    return " ".join(shlex.quote(a) for a in argv)


def _from_invocation(settings: Settings, nodeid: str) -> str:
    """A node id (its file relative to the rootdir) as typed where pytest was started, so the
    command runs from there (pytest started in a subfolder, or given --rootdir)."""
    here = settings.invocation_dir
    if here is None or "::" not in nodeid:
        return nodeid
    module, rest = nodeid.split("::", 1)
    target = Path(settings.rootdir, module)
    try:
        rel = os.path.relpath(target, here)
    except ValueError:  # another drive (Windows)
        return str(target) + "::" + rest
    return Path(rel).as_posix() + "::" + rest

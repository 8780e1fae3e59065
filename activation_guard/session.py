"""The pytest session layer: settings, option precedence, check bookkeeping, summary, unused goldens.

Layering (as in syrupy): ``plugin.py`` is hook/fixture glue only; this module holds everything
with logic, as plain objects that unit tests can drive without running pytest; the numerical
work is :mod:`activation_guard.api`. All state lives on one :class:`GuardSession` per pytest
``Config`` (never in module globals), so nested pytest runs (``pytester``) and xdist workers
each have their own, and workers ship theirs to the controller as JSON.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shlex
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import paths

DEVICE_FIXTURE = "ag_device"
RECORD_DEVICE = "cpu"  # the ag_device variant that writes goldens under --ag-update
DEVICES = ("cpu", "cuda")
UPDATE_MODES = (None, "all", "missing")
UNUSED_MODES = (None, "fail", "list")
STATUSES = ("passed", "diverged", "written", "missing", "error", "deferred")
# Options the plugin itself consumes (never forwarded as-is to record/compare).
PLUGIN_KEYS = frozenset({"path", "model", "args", "kwargs"})


class OptionError(ValueError):
    """A bad activation_guard option; the message names where it was set."""


# --------------------------------------------------------------------------- settings


def parse_float(value: Any, where: str) -> float | None:
    """An rtol/atol from ini or the command line: a finite number >= 0, or empty for unset."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{where} must be a number, got {value!r}") from None
    if not math.isfinite(f) or f < 0:
        raise OptionError(f"{where} must be a finite number >= 0, got {value!r}")
    return f


@dataclass
class Settings:
    """Session-wide settings, already resolved from the command line and ini."""

    golden_dir: Path
    update: str | None = None  # None, "all" or "missing"
    fail_fast: bool = False
    report_path: Path | None = None
    unused: str | None = None  # None, "fail" or "list"
    check_determinism: bool = False  # run each checked forward twice and list unstable layers
    ini_options: dict[str, Any] = field(default_factory=dict)  # from [tool.pytest.ini_options]
    cli_options: dict[str, Any] = field(default_factory=dict)  # from --ag-rtol/--ag-atol/--ag-fail-fast
    rootdir: Path = field(default_factory=Path.cwd)

    def __post_init__(self) -> None:
        if self.update not in UPDATE_MODES:
            raise OptionError(f"--ag-update must be given alone or as --ag-update=missing, got {self.update!r}")
        if self.unused not in UNUSED_MODES:
            raise OptionError(f"--ag-unused must be given alone or as --ag-unused=list, got {self.unused!r}")

    @classmethod
    def build(
        cls,
        *,
        rootdir: Path,
        invocation_dir: Path,
        ini_golden_dir: str,
        ini_rtol: str | None,
        ini_atol: str | None,
        cli_golden_dir: str | None = None,
        cli_rtol: float | None = None,
        cli_atol: float | None = None,
        cli_fail_fast: bool = False,
        update: str | None = None,
        report_path: str | None = None,
        unused: str | None = None,
        cli_calibrate: bool = False,
        cli_tolerance: str | None = None,
        check_determinism: bool = False,
    ) -> Settings:
        """Command-line paths are relative to where pytest was invoked; ini paths to the rootdir."""
        if cli_golden_dir:
            gdir = Path(invocation_dir, cli_golden_dir)
        else:
            if not ini_golden_dir or not ini_golden_dir.strip():
                raise OptionError("ini option ag_golden_dir is empty; set it to a folder, e.g. ag_golden_dir = \"golden\"")
            gdir = Path(rootdir, ini_golden_dir.strip())
        if gdir.exists() and not gdir.is_dir():
            src = "--ag-golden-dir" if cli_golden_dir else "ini option ag_golden_dir"
            raise OptionError(f"{src}: {gdir} exists and is not a folder; point it at a folder (created when goldens are written)")
        ini: dict[str, Any] = {}
        for key, raw in (("rtol", ini_rtol), ("atol", ini_atol)):
            v = parse_float(raw, f"ini option ag_{key}")
            if v is not None:
                ini[key] = v
        cli: dict[str, Any] = {}
        for key, num in (("rtol", cli_rtol), ("atol", cli_atol)):
            v = parse_float(num, f"--ag-{key}")
            if v is not None:
                cli[key] = v
        if cli_fail_fast:
            cli["fail_fast"] = True
        if cli_calibrate:
            cli["calibrate"] = True
        if cli_tolerance is not None:
            if cli_tolerance not in ("strict", "calibrated"):
                raise OptionError(f"--ag-tolerance must be 'strict' or 'calibrated', got {cli_tolerance!r}")
            cli["tolerance"] = cli_tolerance
        return cls(
            golden_dir=Path(os.path.abspath(gdir)),
            update=update,
            fail_fast=cli_fail_fast,
            report_path=Path(os.path.abspath(Path(invocation_dir, report_path))) if report_path else None,
            unused=unused,
            check_determinism=check_determinism,
            ini_options=ini,
            cli_options=cli,
            rootdir=rootdir,
        )

    def display(self, p: str | os.PathLike[str]) -> str:
        """A path as a person wants to read it: relative to the rootdir when inside it."""
        p = Path(p)
        try:
            return p.relative_to(self.rootdir).as_posix()
        except ValueError:
            return str(p)


# --------------------------------------------------------------------------- options


@dataclass
class ResolvedOptions:
    """The options of one check, with where each came from (shown when something is wrong)."""

    values: dict[str, Any]
    sources: dict[str, str]

    def describe(self) -> str:
        if not self.values:
            return "engine defaults"
        return ", ".join(f"{k}={v!r} ({self.sources[k]})" for k, v in sorted(self.values.items()))


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
    for label, layer in (("ini", ini), ("command line", cli), ("marker", marker), ("check()", call)):
        for k, v in layer.items():
            if v is None:
                continue
            values[k] = v
            sources[k] = label
    return ResolvedOptions(values, sources)


def marker_options(marks: Iterable[Any], where: str) -> dict[str, Any]:
    """Merge ``activation_guard`` marks, closest first (as ``item.iter_markers`` yields them):
    a function's mark overrides its class's, which overrides the module's."""
    merged: dict[str, Any] = {}
    for mark in list(marks)[::-1]:
        if mark.args:
            raise OptionError(
                f"{where}: @pytest.mark.activation_guard takes keyword options only "
                f"(e.g. rtol=1e-4), got positional {mark.args!r}"
            )
        merged.update(mark.kwargs)
    return merged


def _accepted(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    names: set[str] = set()
    var_kw = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.add(p.name)
    return names - PLUGIN_KEYS, var_kw


def route_options(
    opts: ResolvedOptions, record_fn: Callable[..., Any], compare_fn: Callable[..., Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split options into ``record`` and ``compare`` keyword arguments by their signatures.

    Options are passed straight through: whatever ``record``/``compare`` accept (including
    options added to the engine later) works in ``check()`` and markers with no plugin change.
    An option neither accepts is an error naming it and where it was set.
    """
    bad = sorted(k for k in opts.values if k in PLUGIN_KEYS)
    if bad:
        raise OptionError(f"option(s) {bad} are set by the plugin and cannot be given ({opts.describe()})")
    r_names, r_any = _accepted(record_fn)
    c_names, c_any = _accepted(compare_fn)
    rec = {k: v for k, v in opts.values.items() if r_any or k in r_names}
    cmp_ = {k: v for k, v in opts.values.items() if c_any or k in c_names}
    unknown = sorted(set(opts.values) - set(rec) - set(cmp_))
    if unknown:
        where = ", ".join(f"{k} ({opts.sources[k]})" for k in unknown)
        raise OptionError(
            f"unknown activation_guard option(s): {where}. activation_guard.compare accepts "
            f"{sorted(c_names)}; activation_guard.record accepts {sorted(r_names)}"
        )
    return rec, cmp_


def validate_options(opts: ResolvedOptions) -> None:
    """Check option values before anything runs, so a bad value fails with one line naming the
    option and where it was set (also under ``--ag-update``, which would otherwise record a
    golden that every later comparison rejects). The spec is the one validation path."""
    from .spec import build_specs

    build_specs(opts.values, opts.sources)


# --------------------------------------------------------------------------- records


@dataclass
class CheckRecord:
    """One ``check()`` call: what happened, for the summary, the JSON report and xdist."""

    nodeid: str
    name: str | None
    golden: str  # absolute path
    status: str  # one of STATUSES
    device: str | None = None
    first_divergence: str | None = None  # one line, for the summary
    message: str | None = None
    report: dict[str, Any] | None = None  # Report.to_dict(), only with --ag-report
    nondeterministic: list[str] | None = None  # with --ag-check-determinism: layers that differ run to run
    seconds: float = 0.0

    def label(self) -> str:
        return self.nodeid + (f" ({self.name})" if self.name else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckRecord:
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in keys})


def jsonable(obj: Any) -> Any:
    """Strict JSON: non-finite floats become the strings "nan", "inf", "-inf"."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def update_command(nodeid: str, missing_only: bool = False) -> str:
    flag = "--ag-update=missing" if missing_only else "--ag-update"
    return f"pytest {flag} {shlex.quote(nodeid)}"


# --------------------------------------------------------------------------- session


class GuardSession:
    """Everything one pytest process (or the xdist controller) knows about activation_guard."""

    def __init__(self, settings: Settings, *, is_worker: bool = False):
        self.settings = settings
        self.is_worker = is_worker
        self.records: list[CheckRecord] = []
        self.used: set[str] = set()  # golden paths relative to golden_dir, posix
        self.claims: dict[str, tuple[str, str | None, str]] = {}  # casefolded path -> (owner, name, nodeid)
        # unused-golden bookkeeping (only filled with --ag-unused)
        self.owners: dict[str, set[str]] = {}  # test stem -> node ids that own it
        self.module_dirs: dict[str, str] = {}  # golden module dir (rel) -> module path
        self.outcomes: dict[str, str] = {}  # nodeid -> "clean" | "dirty"
        self.unused: list[str] = []
        self.worker_failures: list[str] = []
        self.report_error: str | None = None

    # -- checks
    def claim(self, path: Path, nodeid: str, name: str | None, owner: str | None = None) -> None:
        """One golden per (test, name), and never two tests on one file, even on a
        case-insensitive filesystem (within this process; under xdist each test owns its file).

        ``owner`` is the test's identity without its ag_device id: the cpu and cuda variants
        of one test share their golden by design."""
        key = os.path.normcase(str(path)).casefold()
        me = (owner or nodeid, name)
        prev = self.claims.get(key)
        if prev is None:
            self.claims[key] = (*me, nodeid)
            return
        if prev[:2] == me:
            if prev[2] != nodeid:
                return  # another device variant of the same test
            what = f"name={name!r}" if name else "no name"
            raise OptionError(
                f"{nodeid}: two checks with {what} in one test would share the golden "
                f"{self.settings.display(path)}; give each check its own name=..."
            )
        raise OptionError(
            f"{nodeid} (name={name!r}) and {prev[2]} (name={prev[1]!r}) map to golden files that "
            f"differ only by letter case ({self.settings.display(path)}); rename one of the tests"
        )

    def add(self, rec: CheckRecord) -> None:
        self.records.append(rec)
        self.used.add(self.rel(rec.golden))

    def rel(self, golden: str | os.PathLike[str]) -> str:
        return Path(golden).relative_to(self.settings.golden_dir).as_posix()

    # -- collection / outcomes, for --ag-unused
    def note_items(self, entries: Iterable[tuple[str, paths.NodeKey]]) -> None:
        for nodeid, key in entries:
            stem = paths.stem_of(key)
            self.owners.setdefault(stem, set()).add(nodeid)
            self.module_dirs.setdefault(stem.rpartition("/")[0], key.module)

    def note_outcome(self, nodeid: str, when: str, outcome: str, xfail: bool = False) -> None:
        if outcome == "passed" and not xfail:
            if when == "call" and self.outcomes.get(nodeid) != "dirty":
                self.outcomes[nodeid] = "clean"
            return
        self.outcomes[nodeid] = "dirty"  # failed, skipped, xfailed/xpassed: protects its goldens

    # -- xdist
    def to_worker_output(self) -> str:
        return json.dumps({
            "records": [jsonable(r.to_dict()) for r in self.records],
            "used": sorted(self.used),
            "owners": {k: sorted(v) for k, v in self.owners.items()},
            "module_dirs": self.module_dirs,
        })

    def merge_worker_output(self, raw: str | None, worker: str) -> None:
        if not raw:
            self.worker_failures.append(worker)
            return
        data = json.loads(raw)
        self.records.extend(CheckRecord.from_dict(d) for d in data.get("records", []))
        self.used.update(data.get("used", []))
        for stem, ids in data.get("owners", {}).items():
            self.owners.setdefault(stem, set()).update(ids)
        for d, m in data.get("module_dirs", {}).items():
            self.module_dirs.setdefault(d, m)

    # -- end of session
    def counts(self) -> dict[str, int]:
        c = Counter(r.status for r in self.records)
        out = {
            "checked": sum(c[s] for s in ("passed", "diverged", "error")),
            "passed": c["passed"],
            "diverged": c["diverged"],
            "written": c["written"],
            "missing": c["missing"],
        }
        for s in ("error", "deferred"):
            if c[s]:
                out[s + ("s" if s == "error" else "")] = c[s]
        return out

    def find_unused(self, partial_modules: set[str]) -> list[str]:
        """Golden files (rel posix paths) no test that ran used.

        Only tests that ran are considered: a golden whose owning test was deselected, skipped,
        failed, xfailed or not reached is never unused. A golden owned by no known test (its
        test was deleted or renamed) is unused only if its module was collected in full (not
        narrowed to single tests with ``file.py::test``) and at least one of its tests ran.
        """
        root = self.settings.golden_dir
        if not root.is_dir():
            return []
        clean_modules = {
            self.module_dirs.get(stem.rpartition("/")[0])
            for stem, ids in self.owners.items()
            if any(self.outcomes.get(i) == "clean" for i in ids)
        }
        unused = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for fn in sorted(filenames):
                if not fn.endswith(paths.SUFFIX) or fn.startswith("."):
                    continue
                rel = Path(dirpath, fn).relative_to(root).as_posix()
                if rel in self.used:
                    continue
                stem = paths.owner_stem(rel)
                owners = self.owners.get(stem)
                if owners:
                    if all(self.outcomes.get(i) == "clean" for i in owners):
                        unused.append(rel)
                    continue
                module = self.module_dirs.get(stem.rpartition("/")[0])
                if module is not None and module not in partial_modules and module in clean_modules:
                    unused.append(rel)
        self.unused = unused
        return unused

    def summary_lines(self, verbose: int = 0) -> list[str]:
        if not self.records and not self.unused and self.settings.unused is None:
            return []
        c = self.counts()
        lines = ["goldens: " + ", ".join(f"{v} {k}" for k, v in c.items())]
        for r in self.records:
            if r.status == "diverged":
                lines.append(f"DIVERGED {r.label()}: {r.first_divergence}")
        for r in self.records:
            if r.status == "missing":
                lines.append(f"MISSING  {r.label()}: no golden {self.settings.display(r.golden)}")
            elif r.status == "error":
                lines.append(f"ERROR    {r.label()}: {(r.message or '').splitlines()[0] if r.message else ''}")
        for r in self.records:
            if r.nondeterministic:
                shown = ", ".join(r.nondeterministic[:5]) + (f" and {len(r.nondeterministic) - 5} more" if len(r.nondeterministic) > 5 else "")
                lines.append(f"NONDETERMINISTIC {r.label()}: {len(r.nondeterministic)} layer call(s) differ between two runs: {shown}")
        if self.settings.check_determinism and not any(r.nondeterministic for r in self.records):
            lines.append("determinism: every checked layer gave bit-identical outputs on two runs")
        written = [r for r in self.records if r.status == "written"]
        limit = None if verbose > 0 else 10
        for r in written[:limit]:
            lines.append(f"WRITTEN  {self.settings.display(r.golden)}")
        if limit is not None and len(written) > limit:
            lines.append(f"WRITTEN  ... and {len(written) - limit} more (-v lists all)")
        deferred = [r for r in self.records if r.status == "deferred"]
        if deferred:
            lines.append(
                f"{len(deferred)} check(s) on a non-{RECORD_DEVICE} ag_device were not compared during "
                f"--ag-update (goldens are recorded by the {RECORD_DEVICE} variant); rerun without --ag-update"
            )
        if self.settings.unused is not None:
            if self.unused:
                lines.append(f"{len(self.unused)} unused golden(s) in {self.settings.display(self.settings.golden_dir)} (no test that ran used them):")
                lines += [f"UNUSED   {u}" for u in self.unused]
            else:
                lines.append("no unused goldens among the tests that ran")
        if self.worker_failures:
            lines.append(f"results of xdist worker(s) {', '.join(self.worker_failures)} were lost (worker crashed?)")
        return lines

    def report_json(self) -> dict[str, Any]:
        return jsonable({
            "activation_guard_report": 1,
            "golden_dir": str(self.settings.golden_dir),
            "update": self.settings.update,
            "counts": self.counts(),
            "checks": [r.to_dict() for r in self.records],
            "unused": list(self.unused) if self.settings.unused is not None else None,
        })

    def write_report(self) -> Path | None:
        p = self.settings.report_path
        if p is None:
            return None
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
        if p.suffix.lower() in (".html", ".htm"):
            tmp.write_text(self.report_html(), encoding="utf-8")
        else:
            tmp.write_text(json.dumps(self.report_json(), indent=1, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, p)
        return p

    def report_html(self) -> str:
        """One self-contained page: every compared check, failing ones plotted (if matplotlib
        is installed). Built from the JSON report dicts, so xdist workers' checks are included."""
        from .report import Report
        from .visual import html_page

        pairs = [(r.label(), Report.from_dict(r.report)) for r in self.records if r.report is not None]
        c = self.counts()
        title = "activation_guard: " + ", ".join(f"{v} {k}" for k, v in c.items())
        return html_page(pairs, title=title)


def now() -> float:
    return time.perf_counter()


# --------------------------------------------------------------------------- the fixture object


class GoldenCheck:
    """What the ``activation_guard`` fixture returns: bound to one test and its golden file(s).

    ``check(model, args, kwargs=None, *, name=None, **options)`` runs the model once and returns
    its output. With ``--ag-update`` (or ``--ag-update=missing`` and no golden yet) it records;
    otherwise it compares and fails the test with the engine's report, which names the first
    diverging layer, and ends with the command that re-records the golden if the change was
    intended. Several checks per test need distinct ``name=`` values.
    """

    def __init__(
        self,
        session: GuardSession,
        nodeid: str,
        key: paths.NodeKey,
        *,
        marker: Mapping[str, Any] | None = None,
        device: str | None = None,
        record_nodeid: str | None = None,
    ):
        self._session = session
        self.nodeid = nodeid
        self.key = key
        self.device = device
        self.marker = dict(marker or {})
        # the node id whose --ag-update writes this test's golden (the cpu variant under ag_device)
        self.record_nodeid = record_nodeid or nodeid

    @property
    def update(self) -> str | None:
        return self._session.settings.update

    def path(self, name: str | None = None) -> Path:
        """The golden file of this test's check called ``name`` (None: the unnamed check)."""
        return paths.golden_path(self._session.settings.golden_dir, self.key, name)

    def options(self, **call: Any) -> ResolvedOptions:
        s = self._session.settings
        return resolve_options(s.ini_options, s.cli_options, self.marker, call)

    def check(
        self,
        model: Any,
        args: Any = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        **options: Any,
    ) -> Any:
        __tracebackhide__ = True
        import pytest

        from . import api
        from .capture import check_model
        from .errors import ActivationGuardError, GoldenError, UnsupportedModelError

        s = self._session
        problem = None
        try:
            path = self.path(name)
            s.claim(path, self.nodeid, name, owner=self.key.nodeid)
            opts = self.options(**options)
            rec_kw, cmp_kw = route_options(opts, api.record, api.compare)
            validate_options(opts)
            check_model(model)  # a lambda, torch.compile or TorchScript model: one line, not a traceback
        except (OptionError, ValueError, UnsupportedModelError) as e:
            problem = str(e)
        if problem is not None:  # outside the except block: no chained traceback in the report
            pytest.fail(f"activation_guard: {problem}", pytrace=False)
        shown = s.settings.display(path)
        base = CheckRecord(self.nodeid, name, str(path), "error", device=self.device)
        t0 = now()

        def done(status: str, **kw: Any) -> None:
            base.status = status
            base.seconds = round(now() - t0, 6)
            for k, v in kw.items():
                setattr(base, k, v)
            s.add(base)

        exists = path.is_file()
        mode = self.update
        if mode == "all" or (mode == "missing" and not exists):
            if self.device not in (None, RECORD_DEVICE):
                import torch

                with torch.no_grad():  # as record/compare run it
                    out = model(*(tuple(args) if isinstance(args, (tuple, list)) else (args,)), **dict(kwargs or {}))
                done("deferred", message=f"golden is recorded by the {RECORD_DEVICE} variant: {self.record_nodeid}")
                return out
            if cmp_kw.get("tolerance") == "calibrated" and "calibrate" not in rec_kw:
                rec_kw["calibrate"] = True  # a calibrated comparison needs the golden's noise floors
            try:
                summary = api.record(model, args, kwargs, path=path, **rec_kw)
            except ActivationGuardError as e:  # ours (unwritable folder, bad selection...): the message says what to fix
                done("error", message=f"recording failed: {e}")
                problem = str(e)
            except Exception as e:  # the model's own error: keep its traceback
                done("error", message=f"recording failed: {type(e).__name__}: {e}")
                raise
            if problem is not None:
                pytest.fail(f"activation_guard: {problem}", pytrace=False)
            done("written")
            return summary.output
        if not exists:
            done("missing")
            pytest.fail(
                f"activation_guard: no golden for this check: {shown}\n"
                f"  nothing was written (goldens are only written when asked). To create it, run:\n"
                f"    {update_command(self.record_nodeid)}\n"
                f"  or create every missing golden with `pytest --ag-update=missing`.",
                pytrace=False,
            )
        if s.settings.check_determinism:
            from .determinism import check_determinism

            unstable = check_determinism(model, args, kwargs, include=cmp_kw.get("include"), exclude=cmp_kw.get("exclude"))
            base.nondeterministic = [f"{r.name or '<root>'}[{r.call}] (max abs diff {r.max_abs_diff:.3g})"
                                     if r.max_abs_diff is not None else f"{r.name or '<root>'}[{r.call}]" for r in unstable]
        try:
            report = api.compare(model, args, kwargs, path=path, **cmp_kw)
        except ActivationGuardError as e:  # a bad golden, a bad selection, an uncalibrated golden...
            done("error", message=str(e))
            problem = str(e)
            if isinstance(e, GoldenError):
                problem += f"\n  re-record it with: {update_command(self.record_nodeid)}"
        except Exception as e:  # the model's own error, or a bad option value: keep the traceback
            done("error", message=f"{type(e).__name__}: {e}")
            if hasattr(e, "add_note"):
                e.add_note(f"activation_guard options in force: {opts.describe()}")
            raise
        if problem is not None:
            pytest.fail(f"activation_guard: {problem}", pytrace=False)
        report_dict = report.to_dict() if s.settings.report_path is not None else None
        if report.ok:
            done("passed", report=report_dict)
            return report.output
        headline = report.headline().replace("activation_guard: ", "", 1)
        done("diverged", first_divergence=headline, report=report_dict)
        pytest.fail(
            f"{report}\n\n"
            f"  options in force: {opts.describe()}\n"
            f"  If this change is intended, re-record the golden: {update_command(self.record_nodeid)}",
            pytrace=False,
        )

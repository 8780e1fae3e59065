"""The run's bookkeeping: one record per check, xdist merging, unused goldens, the summary and
the ``--ag-report`` file.

All state lives on one :class:`GuardSession` per pytest ``Config`` (never in module globals), so
nested pytest runs (``pytester``) and xdist workers each have their own, and workers ship theirs
to the controller as JSON. Plain objects, no pytest or torch imports: unit tests drive them
directly, and the report writers (HTML, Markdown) are imported only when a report is written.

A little over the ~400 lines we aim for: the per-check records, xdist merging and the search for
unused goldens (renamed test modules included) share the session's bookkeeping.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._core.errors import OptionError
from ..store import naming as paths
from .settings import RECORD_DEVICE, Settings

MARKDOWN_SUFFIXES = (".md", ".markdown")
HTML_SUFFIXES = (".html", ".htm")
# summary lines the terminal shows in red
ALERT_PREFIXES = ("DIVERGED", "MISSING", "ERROR", "UNUSED", "exit status 1:")


# --------------------------------------------------------------------------- records


@dataclass
class CheckRecord:
    """One ``check()`` call: what happened, for the summary, the JSON report and xdist."""

    nodeid: str
    name: str | None
    golden: str  # absolute path
    status: str  # passed, diverged, written, missing, error or deferred
    device: str | None = None
    first_divergence: str | None = None  # one line, for the summary
    message: str | None = None
    report: dict[str, Any] | None = None  # Report.to_dict(), only with --ag-report
    nondeterministic: list[str] | None = None  # with --ag-check-determinism: layers that differ run to run
    seconds: float = 0.0
    rank: int | None = None  # distributed: the rank that ran it, in a multi-rank run

    def label(self) -> str:
        rank = "" if self.rank is None else f" [rank {self.rank}]"
        return self.nodeid + (f" ({self.name})" if self.name else "") + rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckRecord:
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in keys})


def counted(counts: Mapping[str, int]) -> str:
    """The summary's counts as words ("1 error", not "1 errors"; the JSON keeps its keys)."""
    return ", ".join(f"{v} {'error' if k == 'errors' and v == 1 else k}" for k, v in counts.items())


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


# --------------------------------------------------------------------------- session


class GuardSession:
    """Everything one pytest process (or the xdist controller) knows about activation_guard."""

    def __init__(self, settings: Settings, *, is_worker: bool = False):
        self.settings = settings
        self.is_worker = is_worker
        self.records: list[CheckRecord] = []
        self.used: set[str] = set()  # golden paths relative to golden_dir, posix
        self.claims: dict[str, tuple[str, str | None, str]] = {}  # casefolded path -> (owner, name, nodeid)
        self.planned: dict[str, list[tuple[str, Path]]] = {}  # casefolded path -> (owner, path) of unnamed checks
        # unused-golden bookkeeping (only filled with --ag-unused)
        self.owners: dict[str, set[str]] = {}  # test stem -> node ids that own it
        self.module_dirs: dict[str, str] = {}  # golden module dir (rel) -> module path
        self.outcomes: dict[str, str] = {}  # nodeid -> "clean" | "dirty"
        self.unused: list[str] = []
        self.gone_modules: dict[str, str] = {}  # unused golden (rel) -> its test module, which no longer exists
        self.unused_blocked: str | None = None  # why --ag-unused could not tell this run (then nothing is listed)
        self.worker_failures: list[str] = []
        self.report_error: str | None = None
        # distributed: a rank_session.RankContext once a check ran in a multi-rank process group
        self.ranks: Any = None

    # -- checks
    def plan(self, keys: Iterable[paths.NodeKey]) -> None:
        """The collected tests that use the check fixture (keys without their ag_device id): the
        golden files of their unnamed checks, for :meth:`claim`."""
        for key in keys:
            path = paths.golden_path(self.settings.golden_dir, key, None)
            entry = (key.nodeid, path)
            planned = self.planned.setdefault(os.path.normcase(str(path)).casefold(), [])
            if entry not in planned:
                planned.append(entry)

    def claim(self, path: Path, nodeid: str, name: str | None, owner: str | None = None) -> None:
        """One golden per (test, name), and never two tests on one file, even on a
        case-insensitive filesystem: among the checks this process ran, and among the unnamed
        checks of every collected test (which xdist may run in other workers).

        ``owner`` is the test's identity without its ag_device id: the cpu and cuda variants
        of one test share their golden by design."""
        key = os.path.normcase(str(path)).casefold()
        me = (owner or nodeid, name)
        prev = self.claims.get(key)
        if prev is None:
            other = next((o for o, p in self.planned.get(key, ()) if p != path), None)
            if other is not None:
                raise OptionError.usage(
                    "name", f"{nodeid} (name={name!r}) and {other} map to golden files that differ only by letter case "
                    f"({self.settings.display(path)}); rename one of the tests")
            self.claims[key] = (*me, nodeid)
            return
        if prev[:2] == me:
            if prev[2] != nodeid:
                return  # another device variant of the same test
            what = f"name={name!r}" if name else "no name"
            raise OptionError.usage(
                "name", f"{nodeid}: two checks with {what} in one test would share the golden "
                f"{self.settings.display(path)}; give each check its own name=..."
            )
        raise OptionError.usage(
            "name", f"{nodeid} (name={name!r}) and {prev[2]} (name={prev[1]!r}) map to golden files that "
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

    def find_unused(self, partial_modules: set[str], collected_dirs: Sequence[str] = ()) -> list[str]:
        """Golden files (rel posix paths) no test that ran used.

        Only tests that ran are considered: a golden whose owning test was deselected, skipped,
        failed, xfailed or not reached is never unused. A golden owned by no known test (its
        test was deleted or renamed) is unused only if its module was collected in full (not
        narrowed to single tests with ``file.py::test``) and at least one of its tests ran.
        A golden whose test module no longer exists (the module was renamed or deleted) is
        unused when its directory was collected: ``collected_dirs`` are the rootdir-relative
        directories the run collected in full (``""`` for the rootdir itself).
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
                module_dir = stem.rpartition("/")[0]
                module = self.module_dirs.get(module_dir)
                if module is not None and module not in partial_modules and module in clean_modules:
                    unused.append(rel)
                elif module is None:
                    gone = self._gone_module(module_dir)
                    if gone is not None and any(d == "" or gone.startswith(d + "/") for d in collected_dirs):
                        unused.append(rel)
                        self.gone_modules[rel] = gone
        self.unused = unused
        return unused

    def _gone_module(self, module_dir: str) -> str | None:
        """The test module a golden directory belongs to, if that file no longer exists (None
        while it exists, or when the directory's name does not say which module it was)."""
        source = paths.module_source(module_dir)
        if source is None or Path(self.settings.rootdir, source).exists():
            return None
        return source

    def moved_from(self, golden: str | os.PathLike[str]) -> list[str]:
        """Goldens (rel posix paths) with ``golden``'s file name whose test module no longer
        exists: where a missing golden was left when its test module was renamed or moved."""
        root = self.settings.golden_dir
        name = Path(golden).name
        if not root.is_dir():
            return []
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if name in filenames:
                rel = Path(dirpath, name).relative_to(root).as_posix()
                if self._gone_module(rel.rpartition("/")[0]) is not None:
                    out.append(rel)
        return out

    def move_hint(self, golden: str | os.PathLike[str]) -> str | None:
        """``git mv`` for a missing golden whose test module was renamed (one candidate), or a
        list of the candidates; None when there is none."""
        found = self.moved_from(golden)
        if not found:
            return None
        root = self.settings.golden_dir
        new = self.settings.display(golden)
        if len(found) == 1:
            old = self.settings.display(root / found[0])
            return (f"was its test module renamed? {old} (same test, test module gone) moves here with: "
                    f"git mv {old} {new}")
        olds = ", ".join(self.settings.display(root / f) for f in found)
        return f"was its test module renamed? goldens of the same test whose test modules are gone: {olds}"

    def summary_lines(self, verbose: int = 0) -> list[str]:
        if not self.records and not self.unused and self.settings.unused is None:
            return []
        c = self.counts()
        lines = ["goldens: " + counted(c)]
        for r in self.records:
            if r.status == "diverged":
                lines.append(f"DIVERGED {r.label()}: {r.first_divergence}")
        for r in self.records:
            if r.status == "missing":
                lines.append(f"MISSING  {r.label()}: no golden {self.settings.display(r.golden)}")
                hint = self.move_hint(r.golden)
                if hint is not None:
                    lines.append(f"         {hint}")
            elif r.status == "error":
                lines.append(f"ERROR    {r.label()}: {(r.message or '').splitlines()[0] if r.message else ''}")
        for r in self.records:
            if r.nondeterministic:
                n = len(r.nondeterministic)
                shown = ", ".join(r.nondeterministic[:5]) + (f" and {n - 5} more" if n > 5 else "")
                lines.append(f"NONDETERMINISTIC {r.label()}: {n} layer call(s) differ between two runs: {shown}")
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
        lines += self._unused_lines()
        if self.worker_failures:
            lines.append(f"results of {', '.join(self.worker_failures)} were lost (crashed?)")
        return lines

    def unused_fail_the_run(self) -> bool:
        """``--ag-unused`` (not ``=list``) and some golden went unused: the run must not pass."""
        return self.settings.unused == "fail" and bool(self.unused)

    def _unused_lines(self) -> list[str]:
        if self.settings.unused is not None and self.unused_blocked:
            return [f"unused goldens not listed: {self.unused_blocked}; run without it to find them"]
        if self.settings.unused is None:
            return []
        if not self.unused:
            return ["no unused goldens among the tests that ran"]
        where = self.settings.display(self.settings.golden_dir)
        lines = [f"{len(self.unused)} unused golden(s) in {where} (no test that ran used them):"]
        lines += [f"UNUSED   {u}" + (f"  (its test module {self.gone_modules[u]} no longer exists)"
                                       if u in self.gone_modules else "") for u in self.unused]
        if self.unused_fail_the_run():
            lines.append(
                "exit status 1: the unused goldens above fail the run (--ag-unused); delete them, "
                + ("or move them (git mv) to the test module's new name, " if self.gone_modules else "")
                + "or use --ag-unused=list to only list them"
            )
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

    def title(self) -> str:
        return "activation_guard: " + counted(self.counts())

    def write_report(self) -> Path | None:
        """``--ag-report``: HTML for ``.html``/``.htm``, Markdown (plus plots beside it) for
        ``.md``, JSON otherwise. The report writers are imported only here (they need torch)."""
        p = self.settings.report_path
        if p is None:
            return None
        p.parent.mkdir(parents=True, exist_ok=True)
        suffix = p.suffix.lower()
        if suffix in MARKDOWN_SUFFIXES:
            from ..report.markdown import write_summary

            unused = self.unused if self.settings.unused is not None else ()
            return write_summary(p, self.records, title="activation_guard", counts=self.counts(), unused=unused)
        tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
        try:
            if suffix in HTML_SUFFIXES:
                tmp.write_text(self.report_html(), encoding="utf-8")
            else:
                text = json.dumps(self.report_json(), indent=1, sort_keys=True, allow_nan=False)
                tmp.write_text(text + "\n", encoding="utf-8")
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)  # (gone after the replace; left by a failed write or replace)
        return p

    def report_html(self) -> str:
        """One self-contained page: every compared check, failing ones plotted (if matplotlib
        is installed). Built from the JSON report dicts, so xdist workers' checks are included."""
        from ..report.report import Report
        from ..report.visual import Unreported, html_page

        pairs = [(r.label(), Report.from_dict(r.report)) for r in self.records if r.report is not None]
        # a missing golden or an error before comparing has no report, but fails the run: listed too
        others = [Unreported(r.label(), r.status, r.message or "") for r in self.records if r.report is None]
        return html_page(pairs, title=self.title(), unreported=others)


def partial_modules(args: Sequence[str], invocation_dir: Path, rootdir: Path) -> set[str]:
    """Modules narrowed to single tests on the command line (``file.py::test``), as rootdir-relative
    posix paths: their unknown goldens are never called unused."""
    out = set()
    for arg in args:
        if "::" not in arg:
            continue
        f = Path(invocation_dir, arg.split("::", 1)[0])
        try:
            out.add(Path(os.path.abspath(f)).relative_to(rootdir).as_posix())
        except ValueError:
            out.add(arg.split("::", 1)[0])
    return out


def collected_dirs(args: Sequence[str], invocation_dir: Path, rootdir: Path) -> list[str]:
    """The directories among the command line's paths (pytest's ``testpaths`` or the start
    folder when none is given), rootdir-relative posix (``""`` for the rootdir): everything under
    them was collected, so a test module missing there was renamed or deleted."""
    out = []
    for arg in args:
        if "::" in arg:
            continue
        d = Path(os.path.abspath(Path(invocation_dir, arg)))
        if not d.is_dir():
            continue
        try:
            rel = d.relative_to(os.path.abspath(rootdir)).as_posix()
        except ValueError:
            continue
        out.append("" if rel == "." else rel)
    return out

"""The per-test object behind the ``activation_guard`` fixture, and how a test item maps to its
golden.

:class:`GoldenCheck` records or compares one check, turns the outcome into one clean failure text
(the engine's report, the options in force, the command that re-records), and leaves a
:class:`~activation_guard.plugin.session.CheckRecord` for the summary and ``--ag-report``. The engine
(torch) is imported on the first check, never when pytest starts.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .._core.errors import (
    UPDATE_HINT,
    ActivationGuardError,
    ActivationGuardWarning,
    GoldenError,
    OptionError,
    UnsupportedModelError,
)
from ..options.spec import describe
from ..store import naming as paths
from .session import CheckRecord, GuardSession
from .settings import (
    DEVICE_FIXTURE,
    RECORD_DEVICE,
    ResolvedOptions,
    engine_specs,
    prefixed,
    rerecord_command,
    resolve_options,
)

if TYPE_CHECKING:
    from ..options.spec import CompareSpec
    from ..report.report import Report
    from .ranks import RankContext

PROPERTY_PREFIX = "activation_guard."


def now() -> float:
    return time.perf_counter()


# --------------------------------------------------------------------------- test item -> golden key


def item_key(item: Any) -> tuple[paths.NodeKey, str | None, str]:
    """(golden key without the ag_device id, device type or None, node id that records).

    The cpu and cuda variants of a test share one golden, so the device's id is cut out of the
    test id. Only public attributes are read: ``callspec.id`` joins one id per parametrisation
    in the order they were made, which is also the order of ``callspec.params``. Our own
    ``pytest_generate_tests`` runs first, so the device id normally leads; a user's own
    ``ag_device`` parametrisation may lead or trail. When the device id cannot be told apart,
    it stays in the key (separate goldens per device, never a wrong shared one).
    """
    key = paths.NodeKey.parse(item.nodeid)
    callspec = getattr(item, "callspec", None)
    if callspec is None or DEVICE_FIXTURE not in callspec.params:
        return key, None, item.nodeid
    dev_s = str(callspec.params[DEVICE_FIXTURE])
    dev_type = dev_s.split(":")[0]
    full = str(callspec.id)
    order = list(callspec.params)
    for cand in (dev_s, f"{DEVICE_FIXTURE}{callspec.indices.get(DEVICE_FIXTURE, -1)}"):
        if full == cand:
            before, after = "", ""
        elif order[0] == DEVICE_FIXTURE and full.startswith(cand + "-"):
            before, after = "", full[len(cand) + 1:]
        elif order[-1] == DEVICE_FIXTURE and full.endswith("-" + cand):
            before, after = full[: -len(cand) - 1], ""
        else:
            continue
        break
    else:  # cannot tell which part is the device: keep it (separate goldens per device)
        return key, dev_type, item.nodeid
    base = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    rest = "-".join(x for x in (before, after) if x)
    stripped = paths.NodeKey(key.module, (*key.parts[:-1], base + (f"[{rest}]" if rest else "")))
    rec_id = "-".join(x for x in (before, RECORD_DEVICE if cand == dev_s else cand, after) if x)
    record_nodeid = item.nodeid[: len(item.nodeid) - len(item.name)] + f"{base}[{rec_id}]"
    return stripped, dev_type, record_nodeid


# --------------------------------------------------------------------------- the fixture object


def _golden_error_fix(e: Exception) -> bool:
    """Whether the engine's fix for this error is the generic "re-record the golden", so the
    plugin adds its command; a specific fix (``git lfs pull``) stands alone."""
    fix = getattr(e, "fix", None) if isinstance(e, GoldenError) else None
    return isinstance(fix, str) and fix.startswith(UPDATE_HINT)


def divergence_properties(report: Report) -> list[tuple[str, Any]]:
    """``user_properties`` of a diverged check (``--junitxml`` shows them): the first divergence,
    its origin (where replay says the difference was made) and numbers."""
    fd = report.first_divergence
    head = report.headline().replace("activation_guard: ", "", 1)
    props: list[tuple[str, Any]] = [("status", "diverged"), ("first_divergence", head)]
    if fd is not None:
        props += [
            ("layer", fd.name or "<root>"),
            ("call", fd.call),
            ("origin", None if report.origin is None else
             f"{report.origin.kind} {report.origin.name or '<root>'}[{report.origin.call}]: {report.origin.detail}"),
        ]
        from ..report.textfmt import estimate_ratio, estimated_l2, sketch_blind  # (imports torch: only after a compare)

        est = estimated_l2(fd)
        if fd.max_abs_diff is None and est is not None:  # a fingerprint's numbers are estimates, not differences
            props += [("estimated_l2", est), ("estimate_limit_ratio", estimate_ratio(fd))]
            blind = sketch_blind(fd)
            if blind is not None:
                props.append(("note", blind))
        else:
            props += [("max_abs_diff", fd.max_abs_diff), ("max_rel_diff", fd.max_rel_diff)]
        props += [("rtol", fd.rtol), ("atol", fd.atol)]
    return [(PROPERTY_PREFIX + k, v) for k, v in props]


def _fingerprinted_everywhere(report: Report) -> bool:
    """The golden was recorded with ``fingerprint=True`` (its meta says so)."""
    fp = report.golden_meta.get("fingerprint")
    return isinstance(fp, dict) and fp.get("layers") is True


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
        user_properties: list[tuple[str, object]] | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        self._session = session
        self.progress = progress  # a live line in the terminal (pytest's), for long work; None: stderr
        self.nodeid = nodeid
        self.key = key
        self.device = device
        self.marker = dict(marker or {})
        # the node id whose --ag-update writes this test's golden (the cpu variant under ag_device)
        self.record_nodeid = record_nodeid or nodeid
        # the test report's user_properties (pytest's item.user_properties), for --junitxml
        self.user_properties = user_properties if user_properties is not None else []
        self.last_report: Report | None = None  # the latest check's compare report

    @property
    def update(self) -> str | None:
        return self._session.settings.update

    def path(self, name: str | None = None) -> Path:
        """The golden file of this test's check called ``name`` (None: the unnamed check)."""
        return paths.golden_path(self._session.settings.golden_dir, self.key, name)

    def options(self, **call: Any) -> ResolvedOptions:
        s = self._session.settings
        return resolve_options(s.ini_options, s.cli_options, self.marker, call)

    def rerecord_command(self, opts: ResolvedOptions | None = None, *, fingerprinted: bool = False) -> str:
        cmd = rerecord_command(self._session.settings, opts, self.record_nodeid, fingerprinted=fingerprinted)
        ranks = self._session.ranks
        if ranks is not None and cmd.startswith("pytest "):  # every rank re-records its own golden
            cmd = f"torchrun --nproc-per-node {ranks.info.world_size} -m {cmd}"
        return cmd

    def _property(self, key: str, value: Any) -> None:
        self.user_properties.append((PROPERTY_PREFIX + key, value))

    def check(
        self,
        model: Any,
        args: Any = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        onnx: Any = None,
        **options: Any,
    ) -> Any:
        __tracebackhide__ = True
        if onnx is not None:  # the eager check first (it records under --ag-update), then the ONNX model against it
            out = self.check(model, args, kwargs, name=name, **options)
            self.check_onnx(onnx, name=name, **options)
            return out
        from .ranks import rank_context  # lazy: torch is imported by the first check, not at start-up

        self.last_report = None
        ranks = rank_context(self._session)  # None outside a multi-rank torch.distributed run
        from ..capture.hooks import COMPILE_NOTICE

        token = COMPILE_NOTICE.set(self.progress)
        try:
            if ranks is None:
                return self._check(model, args, kwargs, name, options, None)
            return ranks.gate(self._session, self.nodeid, name,
                              lambda: self._check(model, args, kwargs, name, options, ranks),
                              lambda: self.last_report)
        finally:
            COMPILE_NOTICE.reset(token)

    def _check(self, model: Any, args: Any, kwargs: Mapping[str, Any] | None, name: str | None,
               options: dict[str, Any], ranks: RankContext | None) -> Any:
        __tracebackhide__ = True
        from ..api import run as api
        from ..capture.hooks import check_model

        s = self._session
        problem = None
        where = ""  # the golden's path, once known
        try:
            path = self.path(name)
            where = str(path)
            s.claim(path, self.nodeid, name, owner=self.key.nodeid)
            # in a multi-rank run, this rank's golden (record) and the one it compares with
            if ranks is None:
                rec_path = path
            else:
                rec_path, path = ranks.golden_paths(path, updating=self.update is not None)
            opts = self.options(**options)
            rec_spec, cmp_spec = engine_specs(opts)
            if not api.graph_api.maybe_graph(model):  # an exported program is read by record/compare
                check_model(model)  # a lambda, torch.compile or TorchScript model: one line, not a traceback
        except (OptionError, ValueError, UnsupportedModelError) as e:
            problem = str(e)
        if problem is not None:  # outside the except block: no chained traceback in the report
            # counted and listed like every other error (two goldens differing only by letter case)
            s.add(CheckRecord(self.nodeid, name, where, "error", device=self.device, message=problem))
            pytest.fail(prefixed(problem), pytrace=False)
        shown = s.settings.display(path)
        base = CheckRecord(self.nodeid, name, str(path), "error", device=self.device)
        t0 = now()

        def done(status: str, **kw: Any) -> None:
            base.status = status
            base.seconds = round(now() - t0, 6)
            for k, v in kw.items():
                setattr(base, k, v)
            s.add(base)
            if status in ("missing", "error"):
                self._property("status", status)
                self._property("golden", shown)
                if base.message:
                    self._property("message", base.message)

        if path.is_dir():  # never "no golden" when something is there: say what it is
            msg = f"the golden path {shown} is a directory, not a golden file; remove or rename it"
            done("error", message=msg)
            pytest.fail(prefixed(msg), pytrace=False)
        exists = path.is_file()
        mode = self.update
        if mode == "all" or (mode == "missing" and not exists):
            if self.device not in (None, RECORD_DEVICE):
                import torch

                from ..capture.hooks import normalize_inputs

                a, kw = normalize_inputs(args, kwargs)  # the one rule: a tuple is the arguments, a list one argument
                with torch.no_grad():  # as record/compare run it
                    out = model(*a, **kw)
                done("deferred", message=f"golden is recorded by the {RECORD_DEVICE} variant: {self.record_nodeid}")
                return out
            had_fingerprints = exists and _fingerprinted(rec_path)
            try:
                summary = api.record_spec(model, args, kwargs, path=rec_path, spec=rec_spec)
            except ActivationGuardError as e:  # ours (unwritable folder, bad selection...): the message says the fix
                done("error", message=f"recording failed: {e}")
                problem = str(e)
            except Exception as e:  # the model's own error: keep its traceback
                done("error", message=f"recording failed: {type(e).__name__}: {e}")
                raise
            if problem is not None:
                pytest.fail(prefixed(problem), pytrace=False)
            done("written", golden=summary.path)
            for note in summary.notes:  # a fingerprint pattern that matched no layer: stored in full
                warnings.warn(ActivationGuardWarning(f"{self.nodeid}: {note}; {shown} holds those outputs in full"),
                              stacklevel=2)
            if had_fingerprints and not summary.fingerprints:
                warnings.warn(ActivationGuardWarning(
                    f"{self.nodeid}: {shown} held fingerprints and was re-recorded with full values (much larger); "
                    f"to keep fingerprints, re-record with --ag-fingerprint (or the ag_fingerprint ini "
                    f"option, or the marker option fingerprint=...)"), stacklevel=2)
            return summary.output
        if not exists:
            done("missing")
            moved = s.move_hint(path)
            pytest.fail(
                prefixed(
                    f"no golden for this check: {shown}\n"
                    + ("" if moved is None else f"  {moved}\n") +
                    f"  nothing was written (goldens are only written when asked). To create it, run:\n"
                    f"    {self.rerecord_command(opts)}\n"
                    f"  or create every missing golden with `{rerecord_command(s.settings, missing_only=True)}`."
                    + ("" if s.settings.has_config_file or s.settings.cli_golden_dir else
                       f"\n  note: pytest found no configuration file (pytest.ini, pyproject.toml, tox.ini, "
                       f"setup.cfg), so its rootdir, {s.settings.rootdir}, and with it the golden folder depend "
                       f"on where pytest is started: started elsewhere, goldens that exist are not found. Add "
                       f"one at the project root.")
                ),
                pytrace=False,
            )
        if s.settings.check_determinism:
            base.nondeterministic = self._unstable_layers(model, args, kwargs, cmp_spec)
        try:
            report = api.compare_spec(model, args, kwargs, path=path, spec=cmp_spec)
            self.last_report = report
        except ActivationGuardError as e:  # a bad golden, a bad selection, an uncalibrated golden...
            done("error", message=str(e))
            problem = str(e)
            if _golden_error_fix(e):
                problem += f"\n  re-record it with: {self.rerecord_command(opts)}"
        except Exception as e:  # the model's own error: keep the traceback
            done("error", message=f"{type(e).__name__}: {e}")
            if hasattr(e, "add_note"):
                e.add_note(f"activation_guard options in force: {describe(rec_spec, cmp_spec)}")
            raise
        if problem is not None:
            pytest.fail(prefixed(problem), pytrace=False)
        report_dict = report.to_dict() if s.settings.report_path is not None else None
        if report.ok:
            done("passed", report=report_dict)
            changed = report.class_change_text()
            if changed is not None:  # matching values do not show that the code behind them changed
                warnings.warn(ActivationGuardWarning(f"{self.nodeid}: {changed} (values still match {shown})"),
                              stacklevel=2)
            return report.output
        headline = report.headline().replace("activation_guard: ", "", 1)
        done("diverged", first_divergence=headline, report=report_dict)
        self.user_properties.extend(divergence_properties(report))
        self._property("golden", shown)
        pytest.fail(
            prefixed(
                f"{report}\n\n"
                f"  options in force: {describe(rec_spec, cmp_spec)}\n"
                f"  If this change is intended, re-record the golden: "
                f"{self.rerecord_command(opts, fingerprinted=_fingerprinted_everywhere(report))}"
            ),
            pytrace=False,
        )

    def check_onnx(self, model: Any, inputs: Any = None, *, name: str | None = None, optimization: str = "off",
                   **options: Any) -> Report:
        """Run an ONNX model (an ``.onnx`` path, a ModelProto, an ONNXProgram) in ONNX Runtime and
        compare it per module call with this test's golden (the eager check's ``name``), on the
        model inputs the golden recorded unless ``inputs`` are given; fail the test with the report
        when it diverges. It never records: the eager check writes the golden."""
        __tracebackhide__ = True
        problem = None
        try:
            path = self.path(name)
            opts = self.options(**options)
            _, cmp_spec = engine_specs(opts)
        except (OptionError, ValueError) as e:
            problem = str(e)
        if problem is not None:
            pytest.fail(prefixed(problem), pytrace=False)
        s = self._session
        shown = s.settings.display(path)
        # the summary and --ag-report list it beside the eager check of the same golden
        rec = CheckRecord(self.nodeid, f"{name} (onnx)" if name else "onnx", str(path), "error", device=self.device)
        t0 = now()

        def done(status: str, **kw: Any) -> None:
            rec.status = status
            rec.seconds = round(now() - t0, 6)
            for k, v in kw.items():
                setattr(rec, k, v)
            s.add(rec)

        if not path.is_file():
            msg = f"no golden for the ONNX check: {shown}; the eager check writes it: {self.rerecord_command(opts)}"
            done("missing", message=msg)
            pytest.fail(prefixed(msg), pytrace=False)
        from ..api.runtime import compare_onnx_spec

        try:
            report = compare_onnx_spec(model, inputs, path=path, spec=cmp_spec, optimization=optimization)
        except ActivationGuardError as e:
            problem = f"ONNX check against {shown}: {e}"
            done("error", message=problem)
        if problem is not None:
            pytest.fail(prefixed(problem), pytrace=False)
        self.last_report = report
        report_dict = report.to_dict() if s.settings.report_path is not None else None
        if report.ok:
            done("passed", report=report_dict)
            return report
        done("diverged", first_divergence=report.headline().replace("activation_guard: ", "", 1), report=report_dict)
        self.user_properties.extend(divergence_properties(report))
        pytest.fail(prefixed(f"{report}\n\n  options in force: {describe(*engine_specs(opts))}; "
                             f"ONNX Runtime optimization={optimization!r}"), pytrace=False)

    @staticmethod
    def _unstable_layers(model: Any, args: Any, kwargs: Any, spec: CompareSpec) -> list[str]:
        from ..api.determinism import check_determinism

        unstable = check_determinism(model, args, kwargs, include=spec.include, exclude=spec.exclude)
        out = []
        for r in unstable:
            diff = f" (max abs diff {r.max_abs_diff:.3g})" if r.max_abs_diff is not None else ""
            out.append(f"{r.name or '<root>'}[{r.call}]{diff}")
        return out


def _fingerprinted(path: Path) -> bool:
    """Whether the golden about to be replaced holds fingerprints (a damaged one: no, it is
    replaced anyway)."""
    from ..store import GoldenReader

    try:
        reader = GoldenReader(path)
    except Exception:
        return False
    try:
        return reader.fingerprinted
    finally:
        reader.close()

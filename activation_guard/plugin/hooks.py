"""pytest plugin glue: command-line options, ini keys, the marker, fixtures and hooks.

Only wiring lives here (as in syrupy): :mod:`activation_guard.plugin.settings` holds settings and option
precedence, :mod:`activation_guard.plugin.session` the run's bookkeeping, summary and ``--ag-report``,
:mod:`activation_guard.plugin.check` the fixture object and the test item -> golden key mapping, and
:mod:`activation_guard.store.naming` the golden file names. Registered through the ``pytest11`` entry
point; importing it must not import torch (a project that never checks a model pays nothing).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .._core.errors import OptionError
from ..options.spec import OPTIONS
from ..store import naming as paths
from .check import GoldenCheck, item_key
from .session import ALERT_PREFIXES, GuardSession, collected_dirs, partial_modules
from .settings import (
    DEVICE_FIXTURE,
    RECORD_DEVICE,
    Settings,
    join_optional_values,
    marker_options,
    prefixed,
)

SESSION_KEY = pytest.StashKey[GuardSession]()
WORKER_KEY = "activation_guard"

MARKER_DOC = (
    "activation_guard(**options): per-test options for activation_guard checks (rtol=, atol=, "
    "tolerances={glob: dict(rtol=, atol=)}, include=, exclude=, fail_fast=, rename=, "
    "allow_dtype_change=, fingerprint=True or [layer globs], fingerprint_params=, and any other "
    "activation_guard.compare/record option); "
    "check() keyword arguments override them"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("activation_guard", "activation_guard: layer-by-layer activation goldens")
    g.addoption("--ag-update", action="store_const", const="all", dest="ag_update", default=None,
                help="(re)write the goldens of the tests that run instead of comparing; those tests pass and the "
                     "summary lists what was written (non-cpu ag_device variants run but are not compared).")
    g.addoption("--ag-update=missing", action="store_const", const="missing", dest="ag_update",
                help="only create goldens that do not exist yet; existing ones are compared as usual.")
    g.addoption("--ag-golden-dir", dest="ag_golden_dir", default=None, metavar="DIR",
                help="golden directory (relative to the invocation directory); overrides ini ag_golden_dir.")
    for o in OPTIONS.values():  # every record/compare option with a flag, from its row
        if o.flag is None:
            continue
        if o.flag_takes == "switch":
            g.addoption(o.flag, dest=o.dest, action="store_true", default=False, help=o.pytest_help())
        else:
            g.addoption(o.flag, dest=o.dest, default=None, metavar=o.flag_metavar, help=o.pytest_help())
    g.addoption("--ag-report", dest="ag_report", default=None, metavar="PATH",
                help="after the run, write every check's per-layer results to PATH, by suffix: .html one "
                     "self-contained HTML page, .md a Markdown summary for CI job pages (error-by-layer plots as "
                     "PNG files beside it), anything else JSON.")
    g.addoption("--ag-unused", action="store_const", const="fail", dest="ag_unused", default=None,
                help="list golden files that no test that ran used, and fail the run (exit status 1) if there "
                     "are any. Deselected, skipped and failed tests never make a golden unused.")
    g.addoption("--ag-unused=list", action="store_const", const="list", dest="ag_unused",
                help="like --ag-unused but only list them; the exit status is unchanged.")
    g.addoption("--ag-check-determinism", dest="ag_check_determinism", action="store_true", default=False,
                help="run each checked forward twice more and list layers whose outputs differ between runs "
                     "(reported in the summary, never failed).")
    g.addoption("--ag-rank-timeout", dest="ag_rank_timeout", default=None, metavar="SECONDS",
                help="under torchrun: how long rank 0 waits for the other ranks' verdict of each check and for their "
                     "results at the end (default 120); a rank silent that long is reported, never waited on forever.")
    parser.addini("ag_golden_dir", "activation_guard golden directory, relative to the rootdir", default="golden")
    for o in OPTIONS.values():  # every record/compare option with an ini key, from its row
        if o.ini is not None:
            parser.addini(o.ini, o.ini_help(), default="")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    join_optional_values(args, lambda word: Path(early_config.invocation_params.dir, word).exists())


# deterministic() needs cuBLAS's deterministic workspace, which torch takes from the environment
# when CUDA first runs a matmul: the plugin sets it before any test can touch CUDA (the same
# names as determinism.py, which imports torch; the plugin starts without it)
CUBLAS_ENV, CUBLAS_DETERMINISTIC = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
_CUBLAS_SET = pytest.StashKey[bool]()


def _cuda_started() -> bool:
    """Whether CUDA was initialised in this process already (torch imported and CUDA touched)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _set_cublas_workspace(config: pytest.Config) -> None:
    """Unless the user set it (an empty value keeps torch's own default) or CUDA already started
    (then deterministic() warns with the fix)."""
    if CUBLAS_ENV in os.environ or _cuda_started():
        return
    os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC
    config.stash[_CUBLAS_SET] = True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_DOC)
    _set_cublas_workspace(config)
    opts = config.option
    try:
        settings = Settings.build(
            rootdir=Path(config.rootpath),
            invocation_dir=Path(config.invocation_params.dir),
            ini_golden_dir=str(config.getini("ag_golden_dir")),
            ini={o.name: str(config.getini(o.ini)) for o in OPTIONS.values() if o.ini is not None},
            cli={o.name: getattr(opts, o.dest) for o in OPTIONS.values() if o.flag is not None},
            cli_golden_dir=opts.ag_golden_dir,
            update=opts.ag_update,
            report_path=opts.ag_report,
            unused=opts.ag_unused,
            check_determinism=opts.ag_check_determinism,
            rank_timeout=opts.ag_rank_timeout,
            cli_rootdir=getattr(opts, "rootdir", None),
            has_config_file=config.inipath is not None,
        )
    except OptionError as e:
        raise pytest.UsageError(prefixed(str(e))) from None
    gs = GuardSession(settings, is_worker=hasattr(config, "workerinput"))
    config.stash[SESSION_KEY] = gs
    if settings.unused is not None and not gs.is_worker:
        config.pluginmanager.register(_OutcomeTracker(gs), "activation_guard-outcomes")


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_CUBLAS_SET, False):
        os.environ.pop(CUBLAS_ENV, None)
    tracker = config.pluginmanager.get_plugin("activation_guard-outcomes")
    if tracker is not None:
        config.pluginmanager.unregister(tracker)


def _session(config: pytest.Config) -> GuardSession:
    return config.stash[SESSION_KEY]


def pytest_report_header(config: pytest.Config) -> str | None:
    s = _session(config).settings
    if not (s.update or config.option.verbose > 0):
        return None
    return f"activation_guard: goldens in {s.display(s.golden_dir)}, update: {s.update or 'off'}"


# --------------------------------------------------------------------------- ag_device


def _device_already_parametrized(metafunc: pytest.Metafunc) -> bool:
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0] if m.args else m.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if DEVICE_FIXTURE in names:
            return True
    # pytest has no public view of a fixture's definitions; without it a params= override is missed
    defs = list(getattr(metafunc, "_arg2fixturedefs", {}).get(DEVICE_FIXTURE) or ())
    return bool(defs) and getattr(defs[-1], "params", None) is not None  # a user's params= override


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``ag_device`` over cpu and cuda. Runs first, so the device id is the first
    part of the test id (``test_x[cpu-...]``), and it is left out of the golden path."""
    if DEVICE_FIXTURE not in metafunc.fixturenames or _device_already_parametrized(metafunc):
        return
    import torch

    skip = pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="ag_device=cuda: CUDA is not available here (torch.cuda.is_available() is False)",
    )
    # module scope: a module-scoped fixture (a model built once per device) may use ag_device
    metafunc.parametrize(DEVICE_FIXTURE, [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=skip)],
                         scope="module")


@pytest.fixture
def ag_device(request: pytest.FixtureRequest) -> str:
    """The device to run on: "cpu" or "cuda" (the test runs once per device; cuda is skipped
    when unavailable). Goldens are shared across devices and recorded by the cpu variant."""
    return str(getattr(request, "param", RECORD_DEVICE))


# --------------------------------------------------------------------------- the check fixture


@pytest.fixture
def activation_guard(request: pytest.FixtureRequest) -> GoldenCheck:
    """Check a model's layer outputs against this test's golden: ``activation_guard.check(model,
    args, kwargs=None, *, name=None, **options)`` returns the model output, records with
    ``--ag-update`` and otherwise fails the test at the first diverging layer."""
    item = request.node
    key, device, record_nodeid = item_key(item)
    problem: str | None = None
    marker: dict[str, Any] = {}
    try:
        marker = marker_options(item.iter_markers("activation_guard"), item.nodeid)
    except OptionError as e:
        problem = str(e)
    if problem is not None:
        pytest.fail(prefixed(problem), pytrace=False)
    return GoldenCheck(_session(request.config), item.nodeid, key, marker=marker, device=device,
                       record_nodeid=record_nodeid, user_properties=item.user_properties,
                       progress=_progress_writer(request.config))


def _progress_writer(config: pytest.Config) -> Callable[[str], None] | None:
    """A line in the terminal now, while a test runs (long work, such as torch.compile compiling
    the model, says what it is doing): past pytest's output capture, on a line of its own. None
    where there is no terminal reporter (xdist workers: the work's line goes to captured stderr)."""
    if hasattr(config, "workerinput"):
        return None
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    if tr is None or capman is None:
        return None

    def write(line: str) -> None:
        with capman.global_and_fixture_disabled():
            tr.ensure_newline()
            tr.write_line(line)

    return write


@pytest.fixture(scope="session")
def ag_process_group(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Under ``torchrun``: the default torch.distributed process group, created from torchrun's
    environment if the run has none (gloo on CPU) and destroyed at the end; None outside torchrun.
    Each rank then checks its own goldens and rank 0 prints one summary (docs/distributed.md)."""
    from .ranks import process_group

    with process_group(_session(request.config).settings.rank_timeout) as group:
        yield group


@pytest.fixture
def ag_deterministic(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Seeds torch/numpy/random (seed 0, or the fixture's indirect param), turns on deterministic
    algorithms, turns TF32 and cudnn.benchmark off, and restores every setting after the test."""
    from ..api.determinism import deterministic

    with deterministic(int(getattr(request, "param", 0))) as state:
        yield state


# --------------------------------------------------------------------------- bookkeeping hooks


def _keys(items: list[pytest.Item]) -> list[tuple[str, paths.NodeKey]]:
    out = []
    for it in items:
        if "::" in it.nodeid:
            try:
                out.append((it.nodeid, item_key(it)[0]))
            except ValueError:
                continue
    return out


def pytest_deselected(items: list[pytest.Item]) -> None:
    if not items:
        return
    s = _session(items[0].config)
    if s.settings.unused is not None:
        s.note_items(_keys(items))


def pytest_collection_finish(session: pytest.Session) -> None:
    s = _session(session.config)
    if s.settings.unused is not None:
        s.note_items(_keys(session.items))
    # every process collects every test (each xdist worker too): the unnamed checks' golden files
    # are known here, so two tests whose files differ only by letter case are told apart even when
    # different workers run them
    planned = []
    for it in session.items:
        if "::" in it.nodeid and "activation_guard" in getattr(it, "fixturenames", ()):
            try:
                planned.append(item_key(it)[0])
            except ValueError:
                continue
    s.plan(planned)


class _OutcomeTracker:
    """Per-config plugin object: pytest_runtest_logreport gets no config, so bind it here.
    Outcomes arrive in the controller for xdist runs too, so unused detection sees them all."""

    def __init__(self, session: GuardSession):
        self.session = session

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.session.note_outcome(report.nodeid, report.when, report.outcome, xfail=hasattr(report, "wasxfail"))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: merge a finished worker's checks (JSON) into the session."""
    s = _session(node.config)
    out = getattr(node, "workeroutput", None) or {}
    s.merge_worker_output(out.get(WORKER_KEY), f"xdist worker {getattr(node, 'gateway', None) and node.gateway.id}")


def _unused_blocker(config: pytest.Config, s: GuardSession) -> str | None:
    """Why this run cannot tell which goldens are unused, or None. ``--lf`` and ``--sw`` leave
    tests out without reporting them as deselected, and a crashed xdist worker's used goldens are
    lost: a golden of a test that passed would be listed (and the advice is to delete it)."""
    if config.getoption("lf", False):
        return "--lf runs only the tests that failed last time, and pytest does not tell which it left out"
    if config.getoption("stepwise", False) or config.getoption("stepwise_skip", False):
        return "--sw runs from the last failure on, and pytest does not tell which tests it left out"
    if s.worker_failures:
        return f"the results of {', '.join(s.worker_failures)} were lost"
    return None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    s = _session(config)
    if s.is_worker:
        config.workeroutput[WORKER_KEY] = s.to_worker_output()  # type: ignore[attr-defined]
        return
    if s.ranks is not None:  # torchrun: ranks > 0 send their results, rank 0 merges and reports
        if s.ranks.follower:
            s.ranks.send_session(s)
            return
        s.ranks.merge_sessions(s)
    if s.settings.unused is not None:
        s.unused_blocked = _unused_blocker(config, s)
        if s.unused_blocked is None:
            s.find_unused(partial_modules(config.args, Path(config.invocation_params.dir), Path(config.rootpath)),
                          collected_dirs(config.args, Path(config.invocation_params.dir), Path(config.rootpath)))
        if s.unused_fail_the_run() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if config.getoption("collectonly", False):  # nothing ran: no report, and no file written
        return
    try:
        s.write_report()
    except OSError as e:
        s.report_error = f"could not write --ag-report {s.settings.report_path}: {e}"
        if session.exitstatus == pytest.ExitCode.OK:  # CI must not go green without the report it asked for
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    s = _session(config)
    if s.is_worker:
        return
    if s.ranks is not None and s.ranks.follower:  # torchrun
        terminalreporter.line(f"activation_guard: {s.ranks.info}: results sent to rank 0, which prints the summary")
        return
    lines = s.summary_lines(verbose=config.option.verbose)
    if not lines and not s.report_error:
        return
    from ..report.textfmt import safe_line  # (imports torch: only once activation_guard has something to say)

    terminalreporter.section("activation_guard")
    for line in lines:
        markup = {"red": True} if line.startswith(ALERT_PREFIXES) else {}
        terminalreporter.line(safe_line(line), **markup)  # layer names come from the model or the golden
    if s.report_error:
        terminalreporter.line(s.report_error, red=True)
    elif s.settings.report_path is not None and not config.getoption("collectonly", False):
        terminalreporter.line(f"report written to {s.settings.display(s.settings.report_path)}")

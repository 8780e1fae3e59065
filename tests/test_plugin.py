"""The pytest plugin end to end (pytester): update workflow, xdist, precedence, paths, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from activation_guard.plugin.settings import join_optional_values
from activation_guard.testing import check_golden_workflow, golden_files

MODELS = '''
import os
import torch

def build(scale=None):
    """A tiny MLP; AG_SCALE (env) scales the last layer's weights to simulate a model change."""
    scale = float(os.environ.get("AG_SCALE", "1.0")) if scale is None else scale
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 3, bias=False))
    with torch.no_grad():
        m[2].weight.mul_(scale)
    return m.eval()

def inputs(n=2):
    return (torch.randn(n, 4, generator=torch.Generator().manual_seed(1)),)
'''

WORKFLOW = '''
from agmodels import build, inputs
SCALE = 1.0

def test_mlp(activation_guard):
    out = activation_guard.check(build(SCALE), inputs())
    assert out.shape == (2, 3)
'''


@pytest.fixture
def ag(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("AG_SCALE", raising=False)
    pytester.makepyfile(agmodels=MODELS)
    return pytester


def test_workflow(ag: pytest.Pytester) -> None:
    res = check_golden_workflow(ag, WORKFLOW, WORKFLOW.replace("SCALE = 1.0", "SCALE = 1.5"), layer="2")
    assert [p.relative_to(ag.path).as_posix() for p in res.goldens] == ["golden/test_workflow/test_mlp.h5"]
    out = res.steps["modified"].stdout.str()
    assert "If this change is intended, re-record the golden: pytest --ag-update test_workflow.py::test_mlp" in out
    # the failure is the engine's report, without plugin frames
    assert not [f for f in ("session.py", "plugin.py", "check.py", "options.py") if f in out]
    assert "__tracebackhide__" not in out
    res.steps["modified"].stdout.fnmatch_lines(["*goldens: 1 checked, 0 passed, 1 diverged, 0 written, 0 missing*"])


XDIST = '''
import pytest
from agmodels import build, inputs
SCALE = 1.0

@pytest.mark.parametrize("n", [1, 2, 3])
def test_mlp(activation_guard, ag_device, n):
    (x,) = inputs(n)
    out = activation_guard.check(build(SCALE).to(ag_device), (x.to(ag_device),))
    assert out.shape == (n, 3)
'''


# Worker processes start cold; skipping plugins the inner runs do not use saves ~1 s each.
LEAN = ("-p", "no:hypothesispytest", "-p", "no:regressions", "-p", "no:pytest-datadir", "-p", "no:anyio")


@pytest.mark.slow
def test_workflow_xdist(ag: pytest.Pytester) -> None:
    """Same life cycle under `-n 2`: workers write their own files atomically, the controller
    prints one merged summary and writes one merged JSON report."""
    args = ("-n", "2", "--ag-report=out/report.json", "--ag-unused=list", *LEAN)

    def modify() -> None:
        ag.makepyfile(test_workflow=XDIST.replace("SCALE = 1.0", "SCALE = 2.0"))
        gdir = ag.path / "golden/test_workflow"
        (gdir / "test_gone.h5").write_bytes((gdir / "test_mlp[1].h5").read_bytes())  # a deleted test's

    res = check_golden_workflow(ag, XDIST, modify, args=args, layer="2", final_rerun=False)
    assert sorted(p.name for p in res.goldens) == ["test_mlp[1].h5", "test_mlp[2].h5", "test_mlp[3].h5"]
    # the controller merged the workers' collected items and outcomes: only the orphan is unused
    res.steps["rerun"].stdout.fnmatch_lines(["no unused goldens among the tests that ran"])
    regen_unused = [ln for ln in res.steps["regen"].outlines if ln.startswith("UNUSED")]
    assert regen_unused == ["UNUSED   test_workflow/test_gone.h5"]
    modified = res.steps["modified"]
    modified.stdout.fnmatch_lines(["*goldens: 3 checked, 0 passed, 3 diverged, 0 written, 0 missing*"])
    assert modified.stdout.str().count("== activation_guard ==") == 1  # once, by the controller
    assert len([ln for ln in modified.outlines if ln.startswith("DIVERGED test_workflow.py::test_mlp[cpu-")]) == 3
    report = json.loads((ag.path / "out/report.json").read_text())  # from the last (regen) run
    assert report["counts"]["written"] == 3
    assert sorted(c["nodeid"] for c in report["checks"]) == [f"test_workflow.py::test_mlp[cpu-{n}]" for n in (1, 2, 3)]


def test_missing_golden_and_update_missing(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_two='''
        from agmodels import build, inputs
        def test_a(activation_guard):
            activation_guard.check(build(), inputs())
        def test_b(activation_guard):
            activation_guard.check(build(), inputs(3))
    ''')
    ag.runpytest("--ag-update", "-k", "test_a").assert_outcomes(passed=1, deselected=1)
    r = ag.runpytest()
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines([
        "*no golden for this check: golden/test_two/test_b.h5",
        "*nothing was written*",
        "    pytest --ag-update test_two.py::test_b",
        "*goldens: 1 checked, 1 passed, 0 diverged, 0 written, 1 missing*",
        "MISSING  test_two.py::test_b: no golden golden/test_two/test_b.h5",
    ])
    assert not (ag.path / "golden/test_two/test_b.h5").exists()
    # --ag-update=missing creates test_b's golden but still compares test_a's existing one
    monkeypatch.setenv("AG_SCALE", "1.5")
    r = ag.runpytest("--ag-update=missing")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*goldens: 1 checked, 0 passed, 1 diverged, 1 written, 0 missing*"])
    assert (ag.path / "golden/test_two/test_b.h5").is_file()



@pytest.mark.parametrize("flag, word, joined", [("--ag-update", "missing", "--ag-update=missing"),
                                                 ("--ag-update", "all", "--ag-update=all"),
                                                 ("--ag-unused", "list", "--ag-unused=list")])
def test_an_optional_value_may_follow_as_its_own_word(flag: str, word: str, joined: str) -> None:
    args = ["-q", flag, word, "tests/"]
    join_optional_values(args, lambda w: False)
    assert args == ["-q", joined, "tests/"]
    kept = [flag, word]  # a file or folder of that name stays a path
    join_optional_values(kept, lambda w: w == word)
    assert kept == [flag, word]
    other = [flag, "tests/", word]  # a value only right after its flag
    join_optional_values(other, lambda w: False)
    assert other == [flag, "tests/", word]


def test_ag_update_missing_as_two_words(ag: pytest.Pytester) -> None:
    """``pytest --ag-update missing`` creates the missing golden and compares the existing one, as
    ``--ag-update=missing`` does; without the join, argparse took ``missing`` for a test path."""
    ag.makepyfile(test_two='''
        from agmodels import build, inputs
        def test_a(activation_guard):
            activation_guard.check(build(), inputs())
        def test_b(activation_guard):
            activation_guard.check(build(), inputs(3))
    ''')
    ag.runpytest("--ag-update", "-k", "test_a").assert_outcomes(passed=1, deselected=1)
    r = ag.runpytest("--ag-update", "missing")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*goldens: 1 checked, 1 passed, 0 diverged, 1 written, 0 missing*"])
    assert (ag.path / "golden/test_two/test_b.h5").is_file()

PRECEDENCE = '''
import pytest
from agmodels import build, inputs
LOOSE, TIGHT = 1e-2, 1e-5  # the change below is a 1e-3 relative one

def test_none(activation_guard):
    activation_guard.check(build(), inputs())

@pytest.mark.activation_guard(rtol=LOOSE)
def test_mark_loose(activation_guard):
    activation_guard.check(build(), inputs())

@pytest.mark.activation_guard(rtol=TIGHT)
def test_mark_tight(activation_guard):
    activation_guard.check(build(), inputs())

@pytest.mark.activation_guard(rtol=TIGHT)
def test_call_loose(activation_guard):
    activation_guard.check(build(), inputs(), rtol=LOOSE)

@pytest.mark.activation_guard(rtol=LOOSE)
def test_call_tight(activation_guard):
    activation_guard.check(build(), inputs(), rtol=TIGHT)

@pytest.mark.activation_guard(rtol=TIGHT)
class TestClassMark:
    @pytest.mark.activation_guard(rtol=LOOSE)
    def test_function_mark_wins(self, activation_guard):
        activation_guard.check(build(), inputs())
'''


def _verdicts(r: pytest.RunResult) -> dict[str, str]:
    out = {}
    for line in r.outlines:
        for verdict in ("PASSED", "FAILED"):
            if line.startswith("test_prec.py::") and f" {verdict}" in line:
                out[line.split("::")[-1].split()[0]] = verdict
    return out


def test_precedence_check_marker_cli_ini(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """check() kwargs > marker (function > class) > command line > ini > engine defaults."""
    ag.makepyfile(test_prec=PRECEDENCE)
    ag.makeini("[pytest]\nag_atol = 0\n")  # isolate rtol: only ini sets atol
    ag.runpytest("--ag-update").assert_outcomes(passed=6)
    monkeypatch.setenv("AG_SCALE", str(1 + 1e-3))
    expected_common = {"test_mark_loose": "PASSED", "test_mark_tight": "FAILED", "test_call_loose": "PASSED",
                       "test_call_tight": "FAILED", "test_function_mark_wins": "PASSED"}
    # engine defaults: float32 rtol 1.3e-6
    assert _verdicts(ag.runpytest("-v")) == {"test_none": "FAILED", **expected_common}
    # ini beats the engine default
    ag.makeini("[pytest]\nag_atol = 0\nag_rtol = 0.01\n")
    assert _verdicts(ag.runpytest("-v")) == {"test_none": "PASSED", **expected_common}
    # the command line beats ini; markers and check() still beat the command line
    r = ag.runpytest("-v", "--ag-rtol=1e-5")
    assert _verdicts(r) == {"test_none": "FAILED", **expected_common}
    r.stdout.fnmatch_lines(["*tolerance     : rtol=1e-05, atol=0 (rtol: command line --ag-rtol; atol: ini ag_atol)*",
                            "*options in force: atol=0 (ini ag_atol), rtol=1e-05 (command line --ag-rtol)*"])


def test_parametrised_and_odd_ids_get_separate_goldens(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_odd='''
        import pytest
        from agmodels import build, inputs
        IDS = ["../../escape", "a/b", "x::y", "sp ace", "ünï", "CON", "-", "a--b", "%2F", "y" * 300, "[]"]

        @pytest.mark.parametrize("n", range(len(IDS)), ids=IDS)
        def test_p(activation_guard, n):
            activation_guard.check(build(), inputs(n + 1))

        class TestK:
            @pytest.mark.parametrize("n", [1, 2])
            def test_p(self, activation_guard, n):
                activation_guard.check(build(), inputs(n), name="enc")
                activation_guard.check(build(), inputs(n + 1), name="dec")
    ''')
    ag.runpytest("--ag-update").assert_outcomes(passed=13)
    files = golden_files(ag.path / "golden")
    assert len(files) == 11 + 4  # one per test and check: none shared
    for p in files:
        assert p.resolve().is_relative_to((ag.path / "golden/test_odd").resolve())
        assert len(p.name) < 150
    assert not list(ag.path.glob("escape*")) and not (ag.path / "a").exists()
    names = {p.name for p in files}
    assert {"test_p[a%2Fb].h5", "test_p[x%3A%3Ay].h5", "test_p[..%2F..%2Fescape].h5",
            "TestK.test_p[1]--dec.h5"} <= names
    ag.runpytest().assert_outcomes(passed=13)


def test_two_checks_with_one_name_is_an_error(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_dup='''
        from agmodels import build, inputs
        def test_same_name(activation_guard):
            activation_guard.check(build(), inputs(), name="x")
            activation_guard.check(build(), inputs(), name="x")
        def test_unnamed_twice(activation_guard):
            activation_guard.check(build(), inputs())
            activation_guard.check(build(), inputs())
    ''')
    r = ag.runpytest("--ag-update")
    r.assert_outcomes(failed=2)
    r.stdout.fnmatch_lines([
        "*test_dup.py::test_same_name: two checks with name='x' in one test would share the golden "
        "golden/test_dup/test_same_name--x.h5*",
        "*test_dup.py::test_unnamed_twice: two checks with no name in one test would share*",
    ])


def test_a_list_argument_is_one_argument_on_every_path(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """``check(model, [a, b])`` passes the list as the one positional argument, as record and
    compare do, also in a non-cpu variant that only runs the model while the cpu one records."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a cuda variant, run on the CPU here
    ag.makepyfile(test_list='''
        import torch

        class Sum(torch.nn.Module):
            def forward(self, xs):
                assert isinstance(xs, list), type(xs)
                return xs[0] + xs[1]

        def test_l(activation_guard, ag_device):
            xs = [torch.ones(2), torch.full((2,), 2.0)]
            out = activation_guard.check(Sum(), xs)
            assert out.tolist() == [3.0, 3.0]
    ''')
    r = ag.runpytest("--ag-update", "-rs")
    r.assert_outcomes(passed=2)
    r = ag.runpytest("-k", "cpu")
    r.assert_outcomes(passed=1, deselected=1)


@pytest.mark.parametrize("gpu", [False, True], ids=["as-is", "cuda-available"])
def test_ag_device(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    """cpu/cuda parametrisation, cuda skipped with a reason where there is no CUDA and run where
    there is; the device is not in the golden path and the update hint names the cpu variant,
    which records. ``cuda-available`` runs the check as on a GPU machine (on one without CUDA,
    torch says it is available and the cuda variants then fail or error on ``.to("cuda")``)."""
    import torch

    if gpu and not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ag.makepyfile(test_dev='''
        import pytest
        from agmodels import build, inputs

        @pytest.mark.parametrize("n", [2])
        def test_d(activation_guard, ag_device, n):
            assert isinstance(ag_device, str)
            activation_guard.check(build().to(ag_device), tuple(t.to(ag_device) for t in inputs(n)))

        @pytest.mark.parametrize("ag_device", ["cpu"])
        def test_own_param(activation_guard, ag_device):
            activation_guard.check(build().to(ag_device), inputs())

        @pytest.fixture(scope="module")
        def model(ag_device):  # built once per device
            return build().to(ag_device)

        def test_module_scoped_model(activation_guard, model, ag_device):
            activation_guard.check(model, tuple(t.to(ag_device) for t in inputs()))
    ''')
    r = ag.runpytest("-rs")
    lines = [
        "*no golden for this check: golden/test_dev/test_d[[]2].h5",
        "    pytest --ag-update 'test_dev.py::test_d[[]cpu-2]'",
        "*no golden for this check: golden/test_dev/test_own_param.h5",
    ]
    if torch.cuda.is_available():  # the two cuda variants run: no golden (a GPU), no CUDA in torch (faked)
        outcomes = r.parseoutcomes()
        assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 5 and "skipped" not in outcomes, outcomes
        assert outcomes.get("failed", 0) >= 4  # test_d[cuda-2] fails, whatever the machine
        r.stdout.no_fnmatch_line("*CUDA is not available here*")
        r.stdout.fnmatch_lines(lines)
        return
    r.assert_outcomes(failed=3, skipped=2)
    r.stdout.fnmatch_lines([
        *lines, "SKIPPED *ag_device=cuda: CUDA is not available here (torch.cuda.is_available() is False)",
    ])


def test_marker_and_option_errors_name_the_culprit(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_err='''
        import pytest
        from agmodels import build, inputs

        @pytest.mark.activation_guard(1e-3)
        def test_positional(activation_guard):
            activation_guard.check(build(), inputs())

        @pytest.mark.activation_guard(bogus_option=1)
        def test_unknown(activation_guard):
            activation_guard.check(build(), inputs())

        def test_path_kwarg(activation_guard):
            activation_guard.check(build(), inputs(), path="elsewhere.h5")
    ''')
    r = ag.runpytest("--ag-update")
    r.assert_outcomes(failed=2, errors=1)  # the bad marker is reported while setting up the fixture
    assert "During handling" not in r.stdout.str()
    r.stdout.fnmatch_lines([
        "*takes keyword options only (e.g. rtol=1e-4), got positional (0.001,)*",
        "*option bogus_option=1 (marker): is not an activation_guard option*",
        "*option(s) [[]'path'] are set by the plugin*",
    ])
    assert golden_files(ag.path / "golden") == []


def test_bad_ini_and_cli_values(ag: pytest.Pytester) -> None:
    ag.makeini("[pytest]\nag_rtol = tight\n")
    r = ag.runpytest()
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*activation_guard: option rtol='tight' (ini ag_rtol): must be a number, got 'tight'*"])
    ag.makeini("[pytest]\n")
    r = ag.runpytest("--ag-update=sometimes")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r = ag.runpytest("--ag-atol=-1")
    r.stderr.fnmatch_lines(["*option atol=* (command line --ag-atol): must be a finite number >= 0*"])


def test_help_lists_options_in_their_group(ag: pytest.Pytester) -> None:
    out = ag.runpytest("--help").stdout.str()
    section = out.split("activation_guard: layer-by-layer activation goldens:", 1)[1]
    for opt in ("--ag-update ", "--ag-update=missing", "--ag-golden-dir", "--ag-rtol", "--ag-atol",
                "--ag-fail-fast", "--ag-report", "--ag-unused ", "--ag-unused=list"):
        assert opt in section, opt
    assert "ag_golden_dir" in out and "ag_rtol" in out


def test_golden_dir_ini_and_cli(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_gd=WORKFLOW)
    ag.makeini("[pytest]\nag_golden_dir = refs/act\n")
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    assert (ag.path / "refs/act/test_gd/test_mlp.h5").is_file()
    ag.runpytest("--ag-update", "--ag-golden-dir=cli_dir").assert_outcomes(passed=1)
    assert (ag.path / "cli_dir/test_gd/test_mlp.h5").is_file()


def test_ag_report_never_replaces_a_golden_and_a_failed_write_fails_the_run(ag: pytest.Pytester) -> None:
    """Found by review: --ag-report=<a golden> replaced the golden with a JSON report on a run
    that asked for no golden write; a report that could not be written left its temp file and the
    run exited 0. Empty option values (`--ag-golden-dir=$DIR` with DIR unset) were ignored."""
    ag.makepyfile(test_rep=WORKFLOW)
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    golden = ag.path / "golden/test_rep/test_mlp.h5"
    before = golden.read_bytes()
    for target, words in ((str(golden), "golden"), ("elsewhere/x.h5", "names a golden file"),
                          ("golden/summary.json", "golden folder"), ("golden", "is a folder")):
        r = ag.runpytest(f"--ag-report={target}")
        assert r.ret == pytest.ExitCode.USAGE_ERROR, (target, r.ret)
        r.stderr.fnmatch_lines([f"*--ag-report*{words}*"])
    assert golden.read_bytes() == before
    (ag.path / "blocker").write_text("a file where the report's folder would be")
    r = ag.runpytest("--ag-report=blocker/r.json")
    assert r.ret != 0
    r.stdout.fnmatch_lines(["*could not write --ag-report*"])
    leftovers = [p for p in ag.path.rglob("*") if ".tmp" in p.name]
    assert not leftovers, leftovers
    for option in ("--ag-golden-dir=", "--ag-rtol=", "--ag-atol=", "--ag-report="):
        r = ag.runpytest(option)
        assert r.ret == pytest.ExitCode.USAGE_ERROR, option
        r.stderr.fnmatch_lines([f"*{option[:-1]} is empty*"])


def test_json_report_and_fail_fast(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_rep=WORKFLOW)
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    monkeypatch.setenv("AG_SCALE", "3.0")
    ag.makepyfile(test_rep=WORKFLOW.replace("build(SCALE)", "build()"))
    r = ag.runpytest("--ag-report=ci/ag.json")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["report written to ci/ag.json"])
    data = json.loads((ag.path / "ci/ag.json").read_text())  # strict JSON (no NaN tokens)
    (check,) = data["checks"]
    assert check["status"] == "diverged" and check["nodeid"] == "test_rep.py::test_mlp"
    assert check["golden"].endswith("golden/test_rep/test_mlp.h5")
    layers = check["report"]["layers"]
    assert [(x["name"], x["status"]) for x in layers] == [
        ("0", "match"), ("1", "match"), ("2", "diverged"), ("", "diverged")]
    assert check["report"]["first_divergence"]["name"] == "2"
    # --ag-fail-fast stops at the first diverging layer
    ag.runpytest("--ag-report=ci/ff.json", "--ag-fail-fast").assert_outcomes(failed=1)
    ff = json.loads((ag.path / "ci/ff.json").read_text())["checks"][0]["report"]
    assert ff["stopped_early"] is True and [x["name"] for x in ff["layers"]] == ["0", "1", "2"]


UNUSED = '''
import os
import pytest
from agmodels import build, inputs

def test_a(activation_guard):
    activation_guard.check(build(), inputs())

@pytest.mark.skipif(os.environ.get("SKIP_B") == "1", reason="skipped on purpose")
def test_b(activation_guard):
    activation_guard.check(build(), inputs(3))

def test_c(activation_guard):
    if os.environ.get("C_STOPS_CHECKING") != "1":
        activation_guard.check(build(), inputs(4))
'''


def _unused(r: pytest.RunResult) -> list[str]:
    return [ln.split()[1] for ln in r.outlines if ln.startswith("UNUSED ")]


def test_unused_goldens(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_un=UNUSED)
    ag.runpytest("--ag-update").assert_outcomes(passed=3)
    gdir = ag.path / "golden/test_un"
    (gdir / "test_gone.h5").write_bytes((gdir / "test_a.h5").read_bytes())  # a deleted test's golden
    r = ag.runpytest("--ag-unused")
    assert _unused(r) == ["test_un/test_gone.h5"] and r.ret == pytest.ExitCode.TESTS_FAILED
    r = ag.runpytest("--ag-unused=list")
    assert _unused(r) == ["test_un/test_gone.h5"] and r.ret == pytest.ExitCode.OK
    # narrowing the module to single tests: unknown files are never reported
    r = ag.runpytest("--ag-unused", "test_un.py::test_a")
    assert _unused(r) == [] and r.ret == pytest.ExitCode.OK
    r.stdout.fnmatch_lines(["no unused goldens among the tests that ran"])
    # deselected and skipped tests never make their golden unused
    monkeypatch.setenv("SKIP_B", "1")
    r = ag.runpytest("--ag-unused", "-k", "not test_c")
    r.assert_outcomes(passed=1, skipped=1, deselected=1)
    assert _unused(r) == ["test_un/test_gone.h5"]
    # a test that ran and stopped using its golden does
    monkeypatch.setenv("C_STOPS_CHECKING", "1")
    r = ag.runpytest("--ag-unused=list")
    assert _unused(r) == ["test_un/test_c.h5", "test_un/test_gone.h5"]


def test_unused_finds_goldens_of_a_renamed_test_module(ag: pytest.Pytester) -> None:
    """``git mv tests/test_gpt2.py tests/test_gpt2_model.py``: the old module's goldens are unused
    once its directory was collected, and the renamed test's MISSING golden says how to move it."""
    ag.makeconftest("")  # puts the rootdir, with agmodels, on sys.path
    (ag.path / "tests").mkdir()
    (ag.path / "tests/test_gpt2.py").write_text(UNUSED)
    (ag.path / "tests/test_other.py").write_text(WORKFLOW)
    ag.runpytest("--ag-update").assert_outcomes(passed=4)
    (ag.path / "tests/test_gpt2.py").rename(ag.path / "tests/test_gpt2_model.py")
    # only a sibling module named on the command line: its directory was not collected, nothing is listed
    r = ag.runpytest("--ag-unused=list", "tests/test_other.py")
    assert _unused(r) == []
    r = ag.runpytest("--ag-unused")
    r.assert_outcomes(passed=1, failed=3)
    assert _unused(r) == [f"tests/test_gpt2/test_{t}.h5" for t in "abc"]
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines([
        "*no golden for this check: golden/tests/test_gpt2_model/test_a.h5",
        "*git mv golden/tests/test_gpt2/test_a.h5 golden/tests/test_gpt2_model/test_a.h5",
        "MISSING  tests/test_gpt2_model.py::test_a: no golden golden/tests/test_gpt2_model/test_a.h5",
        "         was its test module renamed? golden/tests/test_gpt2/test_a.h5 (same test, test module gone) "
        "moves here with: git mv golden/tests/test_gpt2/test_a.h5 golden/tests/test_gpt2_model/test_a.h5",
        "UNUSED   tests/test_gpt2/test_a.h5  (its test module tests/test_gpt2.py no longer exists)",
        "exit status 1: *delete them, or move them (git mv) to the test module's new name, or*",
    ])
    # the whole folder as the argument counts as collecting it; after the move nothing is unused
    r = ag.runpytest("--ag-unused=list", "tests")
    assert len(_unused(r)) == 3
    for t in "abc":
        (ag.path / "golden/tests/test_gpt2_model").mkdir(exist_ok=True)
        (ag.path / f"golden/tests/test_gpt2/test_{t}.h5").rename(ag.path / f"golden/tests/test_gpt2_model/test_{t}.h5")
    r = ag.runpytest("--ag-unused")
    r.assert_outcomes(passed=4)
    assert _unused(r) == [] and "git mv" not in r.stdout.str()


@given(st.lists(st.text(min_size=1, max_size=12).filter(lambda t: "/" not in t and "\x00" not in t),
                min_size=1, max_size=3), st.booleans())
@settings(max_examples=200, deadline=None)
def test_module_source_inverts_the_golden_directory(parts: list[str], py: bool) -> None:
    from activation_guard.store import naming as paths

    module = "/".join(parts) + (".py" if py else "")
    if module.endswith(".py") and parts[-1] == "":
        return
    rel = paths.relative_golden_path(paths.NodeKey(module, ("test_x",)))
    source = paths.module_source(rel.rpartition("/")[0])
    # a shortened (hashed) component is the only case it cannot tell, and then it says so
    assert source == module or (source is None and "~" in rel.replace("~/", "/"))


def test_cross_device_defaults_through_the_plugin(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A golden recorded on another device type is checked with the documented, looser
    device-pair defaults (CROSS_DEVICE_DEFAULTS); the same change fails against a CPU golden."""
    import activation_guard.capture.env as envmod

    ag.makepyfile(test_xd=WORKFLOW.replace("build(SCALE)", "build()"))
    real = envmod.device_info
    fake = {"device": "cuda:0", "device_type": "cuda", "device_name": "fake"}
    monkeypatch.setattr(envmod, "device_info", lambda dev: fake)
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    monkeypatch.setattr(envmod, "device_info", real)
    monkeypatch.setenv("AG_SCALE", str(1 + 9e-5))
    r = ag.runpytest("--ag-report=r.json")
    r.assert_outcomes(passed=1)
    notes = json.loads((ag.path / "r.json").read_text())["checks"][0]["report"]["notes"]
    assert any("cuda->cpu default tolerances apply" in n for n in notes)
    monkeypatch.delenv("AG_SCALE")
    ag.runpytest("--ag-update").assert_outcomes(passed=1)  # now a CPU golden
    monkeypatch.setenv("AG_SCALE", str(1 + 9e-5))
    r = ag.runpytest()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*tolerance     : rtol=1.3e-06, atol=1e-05 (float32 default)*"])


def test_corrupt_golden_fails_with_the_file_and_the_fix(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_bad=WORKFLOW)
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    golden = ag.path / "golden/test_bad/test_mlp.h5"
    golden.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 10\n")
    r = ag.runpytest()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*golden*test_mlp.h5*is a Git LFS pointer*to fix: run `git lfs pull`*",
                            "ERROR    test_bad.py::test_mlp: *"])
    assert "re-record it with" not in r.stdout.str()  # one fix: re-recording would not help
    golden.write_bytes(b"not a golden" * 10)
    r = ag.runpytest()
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*golden*test_mlp.h5*", "*re-record it with: pytest --ag-update test_bad.py::test_mlp*"])


def test_not_using_the_plugin_costs_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_x():\n    assert True\n")
    r = pytester.runpytest()
    r.assert_outcomes(passed=1)
    assert "== activation_guard ==" not in r.stdout.str()
    assert not (pytester.path / "golden").exists()


def test_repository_goldens_stay_small() -> None:
    root = Path(__file__).resolve().parents[1] / "golden"
    total = sum(p.stat().st_size for p in root.rglob("*.h5"))
    assert 0 < total < 600_000, f"committed goldens take {total} bytes; keep examples tiny"


def test_a_golden_path_that_is_a_directory_is_named_not_reported_missing(ag: pytest.Pytester) -> None:
    """Something is at the golden's path; the failure says what it is."""
    ag.makepyfile(test_dir='''
        from agmodels import build, inputs

        def test_mlp(activation_guard):
            activation_guard.check(build(), inputs())
    ''')
    (ag.path / "golden" / "test_dir" / "test_mlp.h5").mkdir(parents=True)
    for args in ((), ("--ag-update",)):
        r = ag.runpytest(*args)
        r.assert_outcomes(failed=1)
        r.stdout.fnmatch_lines(["*activation_guard: the golden path golden/test_dir/test_mlp.h5 is a directory, "
                                "not a golden file; remove or rename it*"])
        assert "no golden for this check" not in r.stdout.str()


CASE = '''
import pytest
from agmodels import build, inputs

@pytest.mark.parametrize("v", ["a", "A", "b"])
def test_ids(activation_guard, v):
    activation_guard.check(build(), inputs())
'''


@pytest.mark.slow
@pytest.mark.parametrize("xdist", [False, True])
def test_golden_files_differing_only_by_case_are_refused_with_and_without_xdist(ag: pytest.Pytester,
                                                                                 xdist: bool) -> None:
    """On a case-insensitive filesystem test_ids[a].h5 and test_ids[A].h5 are one file: each would
    overwrite the other. Every process collects every test, so the pair is refused even when two
    xdist workers run them (the per-process check alone let both write)."""
    ag.makepyfile(test_case=CASE)
    res = ag.runpytest("--ag-update", *(("-n", "2") if xdist else ()), *LEAN)
    res.assert_outcomes(passed=1, failed=2)
    res.stdout.fnmatch_lines(["*test_ids?a? (name=None) and *test_ids?A? map to golden files that differ only by "
                              "letter case*"])
    assert [p.name for p in golden_files(ag.path)] == ["test_ids[b].h5"]
    # counted and listed as errors (the summary once said "0 checked ... 1 written" and nothing else)
    res.stdout.fnmatch_lines(["*goldens: 2 checked, 0 passed, 0 diverged, 1 written, 0 missing, 2 errors*"])
    one = ag.runpytest("-k", "test_ids and not b", *LEAN)  # a plain run: both refused, as errors
    one.assert_outcomes(failed=2)
    one.stdout.fnmatch_lines(["*goldens: 2 checked, 0 passed, 0 diverged, 0 written, 0 missing, 2 errors*"])


LF = '''
import os
from agmodels import build, inputs

def test_pass(activation_guard):
    activation_guard.check(build(), inputs())

def test_flaky(activation_guard):
    activation_guard.check(build(), inputs(), name="f")
    assert os.environ.get("FAIL") != "1"
'''


def test_unused_goldens_are_not_listed_after_lf(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """--lf leaves passing tests out without telling plugins: test_pass's golden was listed as
    unused, the run failed, and the advice was to delete it."""
    ag.makepyfile(test_lf=LF)
    ag.runpytest("--ag-update", *LEAN).assert_outcomes(passed=2)
    monkeypatch.setenv("FAIL", "1")
    ag.runpytest(*LEAN).assert_outcomes(passed=1, failed=1)  # the cache now holds test_flaky's failure
    monkeypatch.setenv("FAIL", "0")
    res = ag.runpytest("--lf", "--ag-unused", *LEAN)
    res.assert_outcomes(passed=1)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*unused goldens not listed: --lf runs only the tests that failed last time*"])
    assert "UNUSED" not in res.stdout.str()
    assert len(golden_files(ag.path)) == 2


def test_the_rerecord_command_runs_where_pytest_was_started(ag: pytest.Pytester,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """From a subfolder the command named the test by its rootdir-relative path, which does not
    exist from there ("file or directory not found"); --rootdir was dropped."""
    import shlex

    ag.makeini("[pytest]\n")
    sub = ag.path / "tests"
    (sub / "a").mkdir(parents=True)
    (sub / "a" / "test_x.py").write_text(WORKFLOW)
    monkeypatch.syspath_prepend(str(ag.path))  # agmodels, from the subfolder too
    monkeypatch.chdir(sub / "a")
    res = ag.runpytest(*LEAN)
    res.assert_outcomes(failed=1)
    line = next(ln for ln in res.stdout.lines if "pytest --ag-update" in ln and "test_mlp" in ln)
    cmd = shlex.split(line.strip())
    assert cmd[:2] == ["pytest", "--ag-update"] and cmd[2] == "test_x.py::test_mlp", line
    ag.runpytest(*cmd[1:], *LEAN).assert_outcomes(passed=1)  # the command, typed where we are
    assert [p.relative_to(ag.path).as_posix() for p in golden_files(ag.path)] == [
        "golden/tests/a/test_x/test_mlp.h5"]


@pytest.mark.parametrize("ini", [False, True])
def test_no_golden_without_a_config_file_says_the_folder_moves_with_the_start(ag: pytest.Pytester, ini: bool) -> None:
    """Without an ini file pytest's rootdir is the start folder's: started from a subfolder,
    existing goldens were not found and --ag-update=missing wrote second copies, with no hint."""
    if ini:
        ag.makeini("[pytest]\n")
    ag.makepyfile(test_x=WORKFLOW)
    res = ag.runpytest(*LEAN)
    res.assert_outcomes(failed=1)
    said = "pytest found no configuration file" in res.stdout.str()
    assert said is (not ini)


def test_collect_only_writes_no_report(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_x=WORKFLOW)
    res = ag.runpytest("--collect-only", "--ag-report=out/report.json", *LEAN)
    assert res.ret == 0
    assert not (ag.path / "out").exists() and "report written" not in res.stdout.str()
    assert golden_files(ag.path) == []

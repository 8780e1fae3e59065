"""What a user and a CI job read from the plugin (pytester, end to end): re-record commands that
work as printed, one fix per problem, explained exit statuses, one message prefix, a truthful
--help, the Markdown summary (also under xdist) and JUnit XML properties."""

from __future__ import annotations

import json
import re
import shlex
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

# inner runs here build these models; their first import registers torch ops (with torchao
# installed, quantized ones), which cannot happen twice, so it must not first happen inside a run
from transformers import BertModel, GPT2Model  # noqa: F401

from activation_guard.report import visual
from activation_guard.testing import golden_files

MODELS = '''
import os
import torch

def build():
    """A tiny MLP; AG_SCALE (env) scales the last layer's weights to simulate a model change."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        m[2].weight.mul_(float(os.environ.get("AG_SCALE", "1.0")))
    return m.eval()

def inputs(n=2):
    return (torch.randn(n, 4, generator=torch.Generator().manual_seed(1)),)
'''

TEST = '''
from agmodels import build, inputs

def test_mlp(activation_guard):
    activation_guard.check(build(), inputs())
'''

LEAN = ("-p", "no:hypothesispytest", "-p", "no:regressions", "-p", "no:pytest-datadir", "-p", "no:anyio")


@pytest.fixture
def ag(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("AG_SCALE", raising=False)
    pytester.makepyfile(agmodels=MODELS, test_x=TEST)
    return pytester


def _one_prefix(r: pytest.RunResult) -> str:
    out = r.stdout.str()
    assert "activation_guard: activation_guard" not in out
    return out


def _printed_command(out: str, after: str) -> list[str]:
    """The shell command printed after ``after`` on one line, split as a shell would."""
    line = next(ln for ln in out.splitlines() if after in ln)
    return shlex.split(line.split(after, 1)[1].strip().strip("`."))


# ---------------------------------------------------------------------------- 1. re-record commands


def test_rerecord_command_carries_golden_dir_and_calibration_and_works(ag: pytest.Pytester,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The printed command is run exactly as printed: it must write a golden the failing
    comparison accepts (a calibrated one, in the --ag-golden-dir in force)."""
    opts = ("--ag-golden-dir=my goldens", "--ag-tolerance=calibrated")
    r = ag.runpytest(*opts)
    r.assert_outcomes(failed=1)
    lines = _one_prefix(r).splitlines()
    cmd = shlex.split(lines[next(i for i, ln in enumerate(lines) if "To create it, run:" in ln) + 1].strip())
    assert cmd == ["pytest", "--ag-update", "--ag-golden-dir=my goldens", "--ag-calibrate", "test_x.py::test_mlp"]
    every = _printed_command("\n".join(lines), "or create every missing golden with")
    assert every == ["pytest", "--ag-update=missing", "--ag-golden-dir=my goldens", "--ag-calibrate"]
    ag.runpytest(*cmd[1:]).assert_outcomes(passed=1)
    assert [p.relative_to(ag.path).as_posix() for p in golden_files(ag.path)] == ["my goldens/test_x/test_mlp.h5"]
    ag.runpytest(*opts).assert_outcomes(passed=1)
    monkeypatch.setenv("AG_SCALE", "1.01")
    r = ag.runpytest(*opts)
    r.assert_outcomes(failed=1)
    cmd = _printed_command(_one_prefix(r), "If this change is intended, re-record the golden:")
    assert cmd == ["pytest", "--ag-update", "--ag-golden-dir=my goldens", "--ag-calibrate", "test_x.py::test_mlp"]
    ag.runpytest(*cmd[1:]).assert_outcomes(passed=1)
    ag.runpytest(*opts).assert_outcomes(passed=1)


# ---------------------------------------------------------------------------- 2. one fix per problem


def test_lfs_pointer_gets_only_git_lfs_pull_and_a_broken_golden_the_command(ag: pytest.Pytester) -> None:
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    golden = ag.path / "golden/test_x/test_mlp.h5"
    golden.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 10\n")
    r = ag.runpytest()
    r.assert_outcomes(failed=1)
    out = _one_prefix(r)
    failure = out.split("= FAILURES =", 1)[1].split("= activation_guard =", 1)[0]
    assert "git lfs pull" in failure and "--ag-update" not in failure and "re-record" not in failure
    golden.write_bytes(b"not a golden at all" * 8)  # a generic problem: re-recording is the fix
    r = ag.runpytest("--ag-golden-dir=golden")
    r.assert_outcomes(failed=1)
    out = _one_prefix(r)
    assert _printed_command(out, "re-record it with:") == [
        "pytest", "--ag-update", "--ag-golden-dir=golden", "test_x.py::test_mlp"]


# ---------------------------------------------------------------------------- 3. --ag-unused exit status


def test_unused_exit_status_is_explained(ag: pytest.Pytester) -> None:
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    gdir = ag.path / "golden/test_x"
    (gdir / "test_gone.h5").write_bytes((gdir / "test_mlp.h5").read_bytes())
    r = ag.runpytest("--ag-unused")
    r.assert_outcomes(passed=1)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines([
        "UNUSED   test_x/test_gone.h5",
        "exit status 1: the unused goldens above fail the run (--ag-unused); delete them, "
        "or use --ag-unused=list to only list them",
    ])
    r = ag.runpytest("--ag-unused=list")
    assert r.ret == pytest.ExitCode.OK and "exit status 1" not in r.stdout.str()
    (gdir / "test_gone.h5").unlink()
    r = ag.runpytest("--ag-unused")
    assert r.ret == pytest.ExitCode.OK and "exit status 1" not in r.stdout.str()


# ---------------------------------------------------------------------------- 4. one prefix


def test_every_failure_has_exactly_one_prefix(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_x='''
        import pytest
        from agmodels import build, inputs

        def test_function(activation_guard):
            activation_guard.check(lambda t: t, inputs())

        @pytest.mark.activation_guard(1e-3)
        def test_positional_marker(activation_guard):
            activation_guard.check(build(), inputs())

        def test_bad_value(activation_guard):
            activation_guard.check(build(), inputs(), rtol=-1)

        def test_missing(activation_guard):
            activation_guard.check(build(), inputs())
    ''')
    r = ag.runpytest("-rfE")
    r.assert_outcomes(failed=3, errors=1)
    _one_prefix(r)
    for failure in (
        "activation_guard: needs a torch.nn.Module, got function*",
        "activation_guard: test_x.py::test_positional_marker: @pytest.mark.activation_guard takes keyword options*",
        "activation_guard: option rtol=-1 (check()): must be a finite number >= 0, got -1",
        "activation_guard: no golden for this check: golden/test_x/test_missing.h5",
    ):
        r.stdout.fnmatch_lines([failure])
    ag.makeini("[pytest]\nag_rtol = -1\n")
    r = ag.runpytest()
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: activation_guard: option rtol='-1' (ini ag_rtol): "
                            "must be a finite number >= 0, got -1"])


# ---------------------------------------------------------------------------- 5. --help


def _help_options(text: str) -> dict[str, str]:
    """--ag-* option -> its help text, re-joined from pytest's wrapped columns."""
    section = text.split("activation_guard: layer-by-layer activation goldens:", 1)[1].split("\n\n", 1)[0]
    opts: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        m = re.match(r"^  (--ag-[a-z-]+(?:=[a-z]+)?)(=(?:[A-Z]+|\{[^}]*\}))?(?:\s+(.*))?$", line)
        if m:
            current = m.group(1)
            opts[current] = f"{m.group(2) or ''} {m.group(3) or ''}"
        elif current is not None and line.strip():
            opts[current] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in opts.items()}


def test_help_describes_what_each_option_does(ag: pytest.Pytester) -> None:
    out = ag.runpytest("--help").stdout.str()
    opts = _help_options(out)
    assert set(opts) == {"--ag-update", "--ag-update=missing", "--ag-golden-dir", "--ag-rtol", "--ag-atol",
                         "--ag-fail-fast", "--ag-report", "--ag-unused", "--ag-unused=list", "--ag-calibrate",
                         "--ag-tolerance", "--ag-check-determinism", "--ag-replay", "--ag-rank-timeout",
                         "--ag-fingerprint"}
    must_say = {
        "--ag-update": ["write the goldens", "non-cpu ag_device"],
        "--ag-update=missing": ["only create goldens that do not exist", "compared"],
        "--ag-rtol": ["relative", "tolerances pattern", "ini ag_rtol", "markers and check()"],
        "--ag-atol": ["absolute", "tolerances pattern", "ini ag_atol", "markers and check()"],
        "--ag-fail-fast": ["first diverging layer"],
        "--ag-report": ["=PATH", ".html", "HTML", ".md", "Markdown", "PNG", "JSON"],
        "--ag-unused": ["no test that ran used", "exit status 1", "Deselected, skipped and failed"],
        "--ag-unused=list": ["only list", "exit status is unchanged"],
        "--ag-calibrate": ["when recording", "noise floor", "tolerance='calibrated'"],
        "--ag-tolerance": ["={strict,calibrated}", "noise floors"],
        "--ag-golden-dir": ["=DIR", "invocation directory", "ag_golden_dir"],
        "--ag-check-determinism": ["twice", "differ between runs", "never failed"],
        "--ag-rank-timeout": ["=SECONDS", "torchrun", "rank 0 waits", "never waited on forever"],
        "--ag-replay": ["={first,all,off}", "recorded inputs", "origin", "own error"],
        "--ag-fingerprint": ["when recording", "fixed-size fingerprint", "integer, bool and small outputs stay exact",
                             "needs no option", "ini ag_fingerprint", "layer globs"],
    }
    for opt, phrases in must_say.items():
        for phrase in phrases:
            assert phrase in opts[opt], (opt, phrase, opts[opt])
    for ini in ("ag_golden_dir", "ag_rtol", "ag_atol", "ag_replay", "ag_fingerprint"):
        assert re.search(rf"^  {ini} \(", out, re.M), ini


# ---------------------------------------------------------------------------- 10. Markdown summary


SUMMARY_TESTS = '''
import pytest
from agmodels import build, inputs

def test_same(activation_guard):
    activation_guard.check(build(), inputs(), rtol=1.0, atol=1.0)

def test_changed(activation_guard):
    activation_guard.check(build(), inputs())

@pytest.mark.parametrize("n", [3], ids=["a|b"])
def test_pipe(activation_guard, n):
    activation_guard.check(build(), inputs(n), name="enc")
'''


def _table(md: str) -> list[list[str]]:
    """Rows of the page's table, split on unescaped pipes as GitHub does."""
    rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip()[1:-1])] for ln in rows]


@pytest.mark.slow
def test_markdown_summary_also_under_xdist(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_x=SUMMARY_TESTS)
    ag.runpytest("--ag-update").assert_outcomes(passed=3)
    monkeypatch.setenv("AG_SCALE", "1.5")
    (ag.path / "ci").mkdir()
    (ag.path / "ci/summary-plot-9.png").write_bytes(b"stale")  # from an earlier run: removed
    r = ag.runpytest("--ag-report=ci/summary.md")
    r.assert_outcomes(passed=1, failed=2)
    r.stdout.fnmatch_lines(["report written to ci/summary.md"])
    md = (ag.path / "ci/summary.md").read_text(encoding="utf-8")
    table = _table(md)
    assert table[0] == ["test", "status", "first divergence", "max abs diff", "max rel diff", "tolerance"]
    rows = {row[0]: row for row in table[1:]}
    assert list(rows) == ["`test_x.py::test_changed`", "`test_x.py::test_pipe[a\\|b] (enc)`", "`test_x.py::test_same`"]
    assert all(len(row) == 6 for row in table)
    changed = rows["`test_x.py::test_changed`"]
    assert changed[1] == "❌ diverged" and changed[2].startswith("`2` (Linear) call 0: values outside tolerance")
    assert changed[5] == "rtol=1.3e-06, atol=1e-05"
    assert rows["`test_x.py::test_same`"][1] == "✅ passed" and rows["`test_x.py::test_same`"][5] == "rtol=1, atol=1"
    assert md.count("<details>") == 2 and md.count("</details>") == 2
    assert "<summary>test_x.py::test_changed: first divergence at 2[0] (Linear): values outside tolerance<" in md
    assert "<summary>test_x.py::test_pipe[a|b] (enc): first divergence at 2[0] (Linear)" in md
    assert "max abs diff  :" in md  # the text report, folded
    plots = sorted(p.name for p in (ag.path / "ci").glob("*.png"))
    if visual.plot_available():
        assert plots == ["summary-plot-1.png", "summary-plot-2.png"]
        assert "](summary-plot-1.png)" in md and "](summary-plot-2.png)" in md
        assert (ag.path / "ci/summary-plot-1.png").read_bytes().startswith(b"\x89PNG")
    else:
        assert plots == [] and ".png" not in md
    # the same page from two xdist workers (records merged by the controller, rows in test order)
    r = ag.runpytest("-n", "2", "--ag-report=ci/summary.md", *LEAN)
    r.assert_outcomes(passed=1, failed=2)
    md_xdist = (ag.path / "ci/summary.md").read_text(encoding="utf-8")
    assert _table(md_xdist) == table and md_xdist.count("<details>") == 2  # (workers' thread count notes differ)
    assert sorted(p.name for p in (ag.path / "ci").glob("*.png")) == plots
    ag.runpytest("--ag-report=ci/r.json").assert_outcomes(passed=1, failed=2)
    report = json.loads((ag.path / "ci/r.json").read_text())
    fd_layer = next(c for c in report["checks"] if c["nodeid"].endswith("test_changed"))["report"]["layers"][2]
    assert changed[3] == f"{fd_layer['max_abs_diff']:.2e}" and changed[4] == f"{fd_layer['max_rel_diff']:.2e}"


# ---------------------------------------------------------------------------- 11. JUnit XML


def test_junit_xml_carries_the_first_divergence(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_y='''
        from agmodels import build, inputs

        def test_nothing_recorded(activation_guard):
            activation_guard.check(build(), inputs(3))
    ''')
    ag.runpytest("--ag-update", "test_x.py").assert_outcomes(passed=1)
    monkeypatch.setenv("AG_SCALE", "1.5")
    ag.runpytest("--junitxml=out/junit.xml", "--ag-report=out/r.json").assert_outcomes(failed=2)
    cases = {c.get("name"): c for c in ET.parse(ag.path / "out/junit.xml").getroot().iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_mlp"].iter("property")}
    layer = json.loads((ag.path / "out/r.json").read_text())["checks"][0]["report"]["layers"][2]
    assert props["activation_guard.status"] == "diverged"
    assert props["activation_guard.first_divergence"].startswith("first divergence at layer '2' (Linear) call 0")
    assert props["activation_guard.layer"] == "2" and props["activation_guard.call"] == "0"
    assert props["activation_guard.origin"].startswith("layer 2[0]: re-run on the golden's own inputs it still differs")
    assert float(props["activation_guard.max_abs_diff"]) == layer["max_abs_diff"]
    assert float(props["activation_guard.max_rel_diff"]) == layer["max_rel_diff"]
    assert (float(props["activation_guard.rtol"]), float(props["activation_guard.atol"])) == (1.3e-06, 1e-05)
    assert props["activation_guard.golden"] == "golden/test_x/test_mlp.h5"
    missing = {p.get("name"): p.get("value") for p in cases["test_nothing_recorded"].iter("property")}
    assert missing["activation_guard.status"] == "missing"
    assert missing["activation_guard.golden"] == "golden/test_y/test_nothing_recorded.h5"


# ---------------------------------------------------------------------------- golden keys from public ids


CLASS_CHANGE = '''
import os
import torch

class FusedGelu(torch.nn.Module):
    def forward(self, x):
        y = torch.nn.functional.gelu(x, approximate="tanh")
        return y * 1.01 if os.environ.get("AG_WRONG") else y

def test_act(activation_guard):
    torch.manual_seed(0)
    act = FusedGelu() if os.environ.get("AG_FUSED") else torch.nn.GELU(approximate="tanh")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), act, torch.nn.Linear(8, 3)).eval()
    activation_guard.check(model, (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),))
'''


def test_module_class_change_is_said_on_a_pass_and_in_the_failure_header(ag: pytest.Pytester,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_cls=CLASS_CHANGE)
    ag.runpytest("--ag-update", "test_cls.py").assert_outcomes(passed=1)
    monkeypatch.setenv("AG_FUSED", "1")
    r = ag.runpytest("test_cls.py", "--ag-report=r.json")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*ActivationGuardWarning: test_cls.py::test_act: module class changed at 1 layer: "
                            "'1' GELU -> FusedGelu (values still match golden/test_cls/test_act.h5)"])
    layer = json.loads((ag.path / "r.json").read_text())["checks"][0]["report"]["layers"][1]
    assert (layer["golden_type_name"], layer["type_name"]) == ("GELU", "FusedGelu")
    monkeypatch.setenv("AG_WRONG", "1")
    r = ag.runpytest("test_cls.py")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*first divergence at layer '1' (GELU -> FusedGelu) call 0, #2 of 4*",
                            "*note: module class changed at 1 layer: '1' GELU -> FusedGelu"])


def test_device_id_is_cut_from_real_pytest_ids(ag: pytest.Pytester) -> None:
    """item_key reads only callspec.id/params: checked against the ids pytest really builds for
    our parametrisation, a user's own before or after other parameters, and fixture params."""
    ag.makepyfile(test_ids='''
        import pytest
        from agmodels import build, inputs

        @pytest.fixture(params=[2], ids=["two"])
        def n(request):
            return request.param

        def test_ours(activation_guard, ag_device, n):
            activation_guard.check(build().to(ag_device), inputs(n))

        @pytest.mark.parametrize("k", ["a-b"])
        @pytest.mark.parametrize("ag_device", ["cpu"])
        def test_user_first(activation_guard, ag_device, k):
            activation_guard.check(build().to(ag_device), inputs())

        @pytest.mark.parametrize("ag_device", ["cpu"])
        @pytest.mark.parametrize("k", ["a-b"])
        def test_user_last(activation_guard, ag_device, k):
            activation_guard.check(build().to(ag_device), inputs())

        @pytest.mark.parametrize("j", ["x"])
        @pytest.mark.parametrize("ag_device", ["cpu"])
        @pytest.mark.parametrize("k", ["y"])
        def test_user_middle(activation_guard, ag_device, k, j):
            activation_guard.check(build().to(ag_device), inputs())
    ''')
    r = ag.runpytest("--ag-update", "test_ids.py", "-v")
    r.assert_outcomes(passed=4, skipped=1)
    r.stdout.fnmatch_lines(["*test_ids.py::test_ours[[]cpu-two[]] PASSED*",
                            "*test_ids.py::test_user_first[[]cpu-a-b[]] PASSED*",
                            "*test_ids.py::test_user_last[[]a-b-cpu[]] PASSED*",
                            "*test_ids.py::test_user_middle[[]y-cpu-x[]] PASSED*"], consecutive=False)
    names = sorted(p.name for p in golden_files(ag.path / "golden/test_ids"))
    # the middle one cannot be told apart from a user id: it keeps the device (its own golden per device)
    assert names == ["test_ours[two].h5", "test_user_first[a-b].h5", "test_user_last[a-b].h5",
                     "test_user_middle[y-cpu-x].h5"]


DICT_ARGS = '''
import torch
from transformers import BertConfig, BertModel

def test_bert(activation_guard):
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=50)
    model = BertModel(cfg).eval()
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(1))
    activation_guard.check(model, {"input_ids": ids})

class Batched(torch.nn.Module):
    def forward(self, batch: dict):
        return batch["x"].size(5)

def test_takes_a_dict(activation_guard):
    activation_guard.check(Batched(), {"x": torch.ones(2)})
'''


def test_a_dict_as_args_suggests_kwargs(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_dict=DICT_ARGS)
    r = ag.runpytest("--ag-update", "test_dict.py", *LEAN)
    r.assert_outcomes(failed=2)
    out = r.stdout.str()
    assert "AttributeError: 'dict' object has no attribute 'size'" in out
    r.stdout.fnmatch_lines(["*activation_guard: args is a dict, so the model was called with it as its one positional "
                            "argument, model({'input_ids': ...}); to pass its entries as keyword arguments, model(**d),"
                            " give it as kwargs=: check(model, kwargs=d)*"])
    # a forward meant to take a dict gets no such hint (its error is its own); each failure's own
    # section is read (under CI, pytest's short summary repeats the whole message)
    parts = re.split(r"\n_{3,} (test_\w+) _{3,}\n", out.split("short test summary info")[0])
    sections = dict(zip(parts[1::2], parts[2::2]))
    assert "give it as kwargs=" in sections["test_bert"]
    assert "give it as kwargs=" not in sections["test_takes_a_dict"] and "IndexError" in sections["test_takes_a_dict"]


MODES = '''
import os
import torch

class Scaled(torch.nn.Module):
    """Mode-dependent by its own code (reads self.training), like an attention's dropout switch."""
    def forward(self, x):
        return x * (0.5 if self.training else 1.0)

def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                            torch.nn.Sequential(torch.nn.Linear(8, 8), Scaled()), torch.nn.Linear(8, 3)).eval()
    which = os.environ.get("AG_SWITCH")
    if which == "gelu":  # a GELU built in training mode swapped into the eval model: computes the same
        m[1] = torch.nn.GELU()
    elif which == "block":
        m[2].train()
    if os.environ.get("AG_CHANGE"):
        with torch.no_grad():
            m[0].weight.mul_(1.5)
    return m

def test_modes(activation_guard):
    activation_guard.check(build(), (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),))
'''


def test_mode_note_names_the_switched_modules_that_compute_differently(ag: pytest.Pytester,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_modes=MODES)
    ag.runpytest("--ag-update", "test_modes.py", *LEAN).assert_outcomes(passed=1)
    monkeypatch.setenv("AG_CHANGE", "1")  # a real change, so that the report (and its notes) is printed
    monkeypatch.setenv("AG_SWITCH", "gelu")
    r = ag.runpytest("test_modes.py", *LEAN)
    r.assert_outcomes(failed=1)
    assert "NOTE modules switched" not in r.stdout.str()
    monkeypatch.setenv("AG_SWITCH", "block")
    r = ag.runpytest("test_modes.py", *LEAN)
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["  NOTE modules switched between training and eval mode since the golden was recorded: "
                            "'2' now in training mode, '2.1' now in training mode; they hold modules that compute "
                            "differently in the two modes: '2.1'"])


COMPILED = '''
import torch

def test_compiled(activation_guard):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).eval()
    activation_guard.check(torch.compile(model, backend="eager"), (torch.ones(2, 4),))
'''


@pytest.mark.slow
def test_compiling_says_what_it_is_doing(ag: pytest.Pytester) -> None:
    """Compiling with the hooks in is the long silent part of a check of a compiled model: one live
    line says so (past output capture), on record and on compare."""
    ag.makepyfile(test_comp=COMPILED)
    line = ("activation_guard: torch.compile is compiling Sequential with activation_guard's hooks "
            "(compiled: '<root>'); this can take a while")
    # (in a subprocess: in process, a second run would re-import half of dynamo, which fails)
    r = ag.runpytest_subprocess("--ag-update", "test_comp.py", *LEAN)
    r.assert_outcomes(passed=1)
    assert r.outlines.count(line) == 1
    r = ag.runpytest_subprocess("test_comp.py", *LEAN)
    r.assert_outcomes(passed=1)
    assert r.outlines.count(line) == 1
    assert line not in r.errlines  # (the terminal line, not the stderr one)


def test_json_first_divergence_number_is_the_printed_one(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.runpytest("--ag-update", "test_x.py", *LEAN).assert_outcomes(passed=1)
    monkeypatch.setenv("AG_SCALE", "1.5")
    r = ag.runpytest("test_x.py", "--ag-report=r.json", *LEAN)
    r.assert_outcomes(failed=1)
    printed = re.search(r"first divergence at layer '2' \(Linear\) call 0, #(\d+) of \d+ in (execution order)",
                        r.stdout.str())
    assert printed is not None
    fd = json.loads((ag.path / "r.json").read_text())["checks"][0]["report"]["first_divergence"]
    assert (fd["number"], fd["number_in"]) == (int(printed.group(1)), printed.group(2))
    assert fd["position"] == fd["number"] - 1  # the 0-based index every layer row has


NOTEBOOK = '''
from agmodels import build, inputs

def test_mlp(activation_guard):
    try:
        activation_guard.check(build(), inputs())
    finally:  # what a notebook shows for the report: its _repr_html_
        if activation_guard.last_report is not None:
            with open("nb.html", "w", encoding="utf-8") as f:
                f.write(activation_guard.last_report._repr_html_())
'''


class _Rows(HTMLParser):
    """The iframe's page and, in a page, each table row's class and cells."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.srcdoc: str | None = None
        self.rows: list[tuple[str | None, list[str]]] = []
        self._cells: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "iframe":
            self.srcdoc = a.get("srcdoc")
        elif tag == "tr":
            self.rows.append((a.get("class"), []))
        elif tag == "td" and self.rows:
            self._cells = self.rows[-1][1]
            self._cells.append("")

    def handle_data(self, data: str) -> None:
        if self._cells is not None and self._cells:
            self._cells[-1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cells = None


def test_a_report_shows_as_the_html_page_in_a_notebook(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_nb=NOTEBOOK)
    ag.runpytest("--ag-update", "test_nb.py", *LEAN).assert_outcomes(passed=1)
    monkeypatch.setenv("AG_SCALE", "1.5")
    r = ag.runpytest("test_nb.py", *LEAN)
    r.assert_outcomes(failed=1)
    outer = _Rows()
    outer.feed((ag.path / "nb.html").read_text(encoding="utf-8"))
    assert outer.srcdoc is not None and outer.srcdoc.startswith("<!DOCTYPE html>")
    page = _Rows()
    page.feed(outer.srcdoc)
    first = [cells for cls, cells in page.rows if cls == "first"]
    assert len(first) == 1 and first[0][1] == "2" and first[0][4].startswith("FIRST")
    assert [cells[1] for _, cells in page.rows if cells] == ["0", "1", "2", "<root>"]
    assert "first divergence at layer &#x27;2&#x27; (Linear)" in (ag.path / "nb.html").read_text(encoding="utf-8")


BF16 = '''
import copy
import os
import pytest
import torch
from transformers import GPT2Config, GPT2Model

@pytest.mark.activation_guard(allow_dtype_change=True, calibrate=True)
def test_gpt2(activation_guard):
    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100)).eval()
    if os.environ.get("AG_BF16"):
        model = copy.deepcopy(model).to(torch.bfloat16)
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    activation_guard.check(model, (ids,), tolerance=os.environ.get("AG_TOLERANCE", "strict"))
'''


def test_a_lower_precision_run_is_not_blamed_on_code_and_points_to_calibrated(
        ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:

    ag.makepyfile(test_bf=BF16)
    ag.runpytest("--ag-update", "test_bf.py", *LEAN).assert_outcomes(passed=1)
    monkeypatch.setenv("AG_BF16", "1")
    r = ag.runpytest("test_bf.py", *LEAN)
    r.assert_outcomes(failed=1)
    origin = next(ln for ln in r.outlines if ln.startswith(("  origin        :", "  replayed      :")))
    assert "which bfloat16 rounding of that code can explain as well" in origin
    assert "strict tolerances cannot tell a code change from rounding" in origin
    r.stdout.fnmatch_lines(["  note: the live run computes in bfloat16, the golden in float32: strict tolerances judge "
                            "bfloat16 rounding as divergence; tolerance=\"calibrated\"*"])
    monkeypatch.setenv("AG_TOLERANCE", "calibrated")  # the rule the note points to: the same run passes
    ag.runpytest("test_bf.py", *LEAN).assert_outcomes(passed=1)

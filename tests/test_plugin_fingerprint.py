"""Fingerprint goldens through the pytest plugin (pytester): --ag-fingerprint, ini ag_fingerprint,
the marker and check() option, their precedence, validation with the source named, and the
re-record command that keeps a fingerprinted golden fingerprinted."""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import activation_guard as ag

MODELS = '''
import os
import torch

def build():
    """Large enough outputs to fingerprint (16 x 256 floats); AG_SCALE changes the last layer."""
    torch.manual_seed(0)
    m = torch.nn.Sequential()
    m.add_module("enc", torch.nn.Linear(32, 256))
    m.add_module("act", torch.nn.Tanh())
    m.add_module("out", torch.nn.Linear(256, 128))
    with torch.no_grad():
        m.out.weight.mul_(float(os.environ.get("AG_SCALE", "1.0")))
    return m.eval()

def inputs():
    return (torch.randn(16, 32, generator=torch.Generator().manual_seed(1)),)
'''

TEST = '''
import pytest
from agmodels import build, inputs

def test_mlp(activation_guard):
    activation_guard.check(build(), inputs())
'''

LEAN = ("-p", "no:hypothesispytest", "-p", "no:regressions", "-p", "no:pytest-datadir", "-p", "no:anyio")
GOLDEN = Path("golden/test_x/test_mlp.h5")


@pytest.fixture
def ag_(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("AG_SCALE", raising=False)
    pytester.makepyfile(agmodels=MODELS, test_x=TEST)
    return pytester


def kinds(path: Path) -> dict[str, str]:
    with ag.read_golden(path) as r:
        return {c.name: c.leaves[0].kind for c in r.calls}


def test_flag_records_fingerprints_and_compare_needs_no_flag(ag_: pytest.Pytester, monkeypatch) -> None:
    ag_.runpytest("--ag-update", "--ag-fingerprint", *LEAN).assert_outcomes(passed=1)
    assert kinds(ag_.path / GOLDEN) == {"enc": "fingerprint", "act": "fingerprint", "out": "fingerprint",
                                        "": "fingerprint"}
    ag_.runpytest(*LEAN).assert_outcomes(passed=1)
    monkeypatch.setenv("AG_SCALE", "1.001")
    r = ag_.runpytest(*LEAN)
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "first divergence at layer 'out'" in out
    assert "estimated ||diff||_2" in out and "(sketch)" in out and "compared by fingerprint" in out
    # the golden fingerprinted every layer: re-recording it keeps it small, flag or not
    line = next(ln for ln in out.splitlines() if "re-record the golden:" in ln)
    argv = shlex.split(line.split("re-record the golden:", 1)[1])
    assert argv[:3] == ["pytest", "--ag-update", "--ag-fingerprint"]
    monkeypatch.delenv("AG_SCALE")
    ag_.runpytest(*argv[1:], *LEAN).assert_outcomes(passed=1)
    assert set(kinds(ag_.path / GOLDEN).values()) == {"fingerprint"}


def test_ini_globs_fingerprint_those_layers_only(ag_: pytest.Pytester) -> None:
    ag_.makeini("[pytest]\nag_fingerprint = enc, act\n")
    ag_.runpytest("--ag-update", *LEAN).assert_outcomes(passed=1)
    assert kinds(ag_.path / GOLDEN) == {"enc": "fingerprint", "act": "fingerprint", "out": "tensor", "": "tensor"}


def test_precedence_check_over_marker_over_flag_over_ini(ag_: pytest.Pytester) -> None:
    ag_.makeini("[pytest]\nag_fingerprint = out\n")
    ag_.makepyfile(test_x='''
import pytest
from agmodels import build, inputs

def test_ini(activation_guard):
    activation_guard.check(build(), inputs())

@pytest.mark.activation_guard(fingerprint=["enc"])
def test_marker(activation_guard):
    activation_guard.check(build(), inputs())

@pytest.mark.activation_guard(fingerprint=["enc"])
def test_call(activation_guard):
    activation_guard.check(build(), inputs(), fingerprint=False)
''')
    ag_.runpytest("--ag-update", *LEAN).assert_outcomes(passed=3)
    g = ag_.path / "golden/test_x"
    assert kinds(g / "test_ini.h5") == {"enc": "tensor", "act": "tensor", "out": "fingerprint", "": "tensor"}
    assert kinds(g / "test_marker.h5") == {"enc": "fingerprint", "act": "tensor", "out": "tensor", "": "tensor"}
    assert set(kinds(g / "test_call.h5").values()) == {"tensor"}
    ag_.runpytest("--ag-update", "--ag-fingerprint", *LEAN).assert_outcomes(passed=3)
    assert set(kinds(g / "test_ini.h5").values()) == {"fingerprint"}  # the flag beats ini
    assert kinds(g / "test_marker.h5")["act"] == "tensor"  # the marker beats the flag
    assert set(kinds(g / "test_call.h5").values()) == {"tensor"}


def test_fingerprint_params_from_a_marker(ag_: pytest.Pytester) -> None:
    ag_.makepyfile(test_x='''
import pytest
from agmodels import build, inputs

@pytest.mark.activation_guard(fingerprint=True, fingerprint_params=dict(rows=7, samples=8))
def test_mlp(activation_guard):
    activation_guard.check(build(), inputs())
''')
    ag_.runpytest("--ag-update", *LEAN).assert_outcomes(passed=1)
    with ag.read_golden(ag_.path / GOLDEN) as r:
        assert r.fingerprint_params is not None and (r.fingerprint_params.rows, r.fingerprint_params.samples) == (7, 8)
    ag_.runpytest(*LEAN).assert_outcomes(passed=1)


@pytest.mark.parametrize("where,text,message", [
    ("ini", "[pytest]\nag_fingerprint = ,\n", "option fingerprint=',' (ini ag_fingerprint): must be True, False, or "
                                               "layer globs"),
    ("marker", "fingerprint=3", "option fingerprint=3 (marker): must be True, False, a layer glob or a list of them"),
    ("check", "fingerprint_params=dict(rows=4)", "option fingerprint_params={'rows': 4} (check()): fingerprint rows "
                                                 "must be an odd integer"),
    ("check", "fingerprint_params=dict(rows=5)", "option fingerprint_params={'rows': 5} (check()): has no effect "
                                                 "unless fingerprint is set too"),
])
def test_bad_values_name_the_option_and_where_it_was_set(ag_: pytest.Pytester, where, text, message) -> None:
    if where == "ini":
        ag_.makeini(text)
    elif where == "marker":
        ag_.makepyfile(test_x=f'''
import pytest
from agmodels import build, inputs

@pytest.mark.activation_guard({text})
def test_mlp(activation_guard):
    activation_guard.check(build(), inputs())
''')
    else:
        ag_.makepyfile(test_x=TEST.replace("inputs())", f"inputs(), {text})"))
    r = ag_.runpytest("--ag-update", *LEAN)
    out = r.stdout.str() + r.stderr.str()
    assert message in out, out
    assert "activation_guard: activation_guard" not in out
    if where == "ini":
        assert r.ret == pytest.ExitCode.USAGE_ERROR
    else:
        r.assert_outcomes(failed=1)
        assert not (ag_.path / GOLDEN).exists()


def test_corrupt_fingerprint_fails_the_test_naming_the_file(ag_: pytest.Pytester) -> None:
    import h5py

    ag_.runpytest("--ag-update", "--ag-fingerprint", *LEAN).assert_outcomes(passed=1)
    path = ag_.path / GOLDEN
    with ag.read_golden(path) as r:
        enc = r.by_key[("enc", 0)].leaves[0]
    assert enc.kind == "fingerprint" and enc.pack is not None
    with h5py.File(path, "r+") as f:
        data = f[f"packs/{enc.pack:04d}"][()]
        data[enc.offset + 200] ^= 0x01
        f[f"packs/{enc.pack:04d}"][...] = data
    r = ag_.runpytest(*LEAN)
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "checksum" in out and "test_mlp.h5" in out and "layer 'enc' call 0" in out
    assert "re-record it with: pytest --ag-update" in out


def test_a_plain_update_of_a_fingerprinted_golden_warns_that_it_is_now_full(ag_: pytest.Pytester) -> None:
    ag_.runpytest("--ag-update", "--ag-fingerprint", *LEAN).assert_outcomes(passed=1)
    res = ag_.runpytest("--ag-update", *LEAN)
    res.assert_outcomes(passed=1, warnings=1)
    res.stdout.fnmatch_lines(["*ActivationGuardWarning*test_mlp: golden/test_x/test_mlp.h5 held fingerprints and "
                              "was re-recorded with full values*--ag-fingerprint*"])
    assert set(kinds(ag_.path / GOLDEN).values()) == {"tensor"}
    again = ag_.runpytest("--ag-update", *LEAN)  # full -> full: nothing to say
    again.assert_outcomes(passed=1)
    assert "ActivationGuardWarning" not in again.stdout.str()


def test_a_fingerprint_pattern_matching_no_layer_warns(ag_: pytest.Pytester) -> None:
    ag_.makeini("[pytest]\nag_fingerprint = true false\n")  # two words: taken as layer patterns
    res = ag_.runpytest("--ag-update", *LEAN)
    res.assert_outcomes(passed=1, warnings=2)
    res.stdout.fnmatch_lines(["*ActivationGuardWarning*fingerprint pattern 'true' matched no layer; "
                              "golden/test_x/test_mlp.h5 holds those outputs in full*"])


SPARSE = '''
import os
import torch

class Sparse(torch.nn.Module):
    """AG_SPARSE moves every 8th element by 3x its tolerance: samples see it, the sketch does not."""
    def forward(self, x):
        if os.environ.get("AG_SPARSE"):
            mask = torch.zeros_like(x)
            mask.view(-1)[::8] = 1
            x = x + mask * 3 * (1e-5 + 1.3e-6 * x.abs())
        return x

def test_sparse(activation_guard):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), Sparse(), torch.nn.Linear(256, 128)).eval()
    activation_guard.check(m, (torch.randn(16, 32, generator=torch.Generator().manual_seed(1)),))
'''


def test_fingerprint_numbers_in_junit_and_markdown_and_a_difference_only_samples_saw(
        ag_: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag_.makepyfile(test_sparse=SPARSE)
    ag_.runpytest("--ag-update", "--ag-fingerprint", "test_sparse.py", *LEAN).assert_outcomes(passed=1)
    r = ag_.runpytest("test_sparse.py", "--ag-report=ok.md", *LEAN)
    r.assert_outcomes(passed=1)
    ok_row = next(ln for ln in (ag_.path / "ok.md").read_text().splitlines() if ln.startswith("| `test_sparse"))
    assert "| est. L2 " in ok_row and "| est/limit " in ok_row
    monkeypatch.setenv("AG_SPARSE", "1")
    ag_.runpytest("test_sparse.py", "--ag-report=r.md", *LEAN).assert_outcomes(failed=1)
    r = ag_.runpytest("test_sparse.py", "--junitxml=junit.xml", "--ag-report=r.json", *LEAN)
    r.assert_outcomes(failed=1)
    note = "NOTE only * of 64 sampled elements saw this difference; the sketch stayed under its limit (est/limit *)"
    r.stdout.fnmatch_lines(["*first divergence at layer '2' (Sparse)*", "  replayed*", f"  {note}, so later layers "
                            "whose fingerprints \"match\" are not evidence that they are unchanged*"])
    case = next(ET.parse(ag_.path / "junit.xml").getroot().iter("testcase"))
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert "activation_guard.max_abs_diff" not in props
    leaf = json.loads((ag_.path / "r.json").read_text())["checks"][0]["report"]["layers"][2]["leaves"][0]
    assert float(props["activation_guard.estimated_l2"]) == leaf["estimated_l2"]
    ratio = float(props["activation_guard.estimate_limit_ratio"])
    assert ratio == leaf["estimated_l2"] / leaf["l2_threshold"] and 0 < ratio < 1
    assert props["activation_guard.note"].startswith(f"only {leaf['mismatched']} of 64 sampled elements")
    row = next(ln for ln in (ag_.path / "r.md").read_text().splitlines() if ln.startswith("| `test_sparse"))
    cells = [c.strip() for c in row.split(" | ")]
    assert cells[3] == f"est. L2 {leaf['estimated_l2']:.2e}" and cells[4] == f"est/limit {ratio:.2g}"
    assert "**only " in cells[2] and "are not evidence that they are unchanged" in cells[2]

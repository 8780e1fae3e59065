"""Plugin options that sit on the cross-device work: calibrated goldens, determinism checks,
the ag_deterministic fixture, and the HTML form of --ag-report."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

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

def inputs():
    return (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),)
'''

TEST = '''
from agmodels import build, inputs

def test_mlp(activation_guard):
    activation_guard.check(build(), inputs())
'''


@pytest.fixture
def ag(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("AG_SCALE", raising=False)
    pytester.makepyfile(agmodels=MODELS, test_mlp=TEST)
    return pytester


def test_calibrated_workflow(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # recording for a calibrated comparison stores the noise floors automatically
    ag.runpytest("--ag-update", "--ag-tolerance=calibrated").assert_outcomes(passed=1)
    ag.runpytest("--ag-tolerance=calibrated").assert_outcomes(passed=1)
    monkeypatch.setenv("AG_SCALE", "1.01")
    res = ag.runpytest("--ag-tolerance=calibrated")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*first divergence at layer '2' (Linear)*", "*calibrated noise floor*"])


def test_calibrated_without_floors_says_how_to_fix(ag: pytest.Pytester) -> None:
    ag.runpytest("--ag-update").assert_outcomes(passed=1)  # strict golden: no floors
    res = ag.runpytest("--ag-tolerance=calibrated")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*--ag-calibrate*"])
    ag.runpytest("--ag-update", "--ag-calibrate").assert_outcomes(passed=1)
    ag.runpytest("--ag-tolerance=calibrated").assert_outcomes(passed=1)


def test_bad_tolerance_mode_is_a_usage_error(ag: pytest.Pytester) -> None:
    res = ag.runpytest("--ag-tolerance=loose")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*activation_guard: option tolerance='loose' (command line --ag-tolerance): "
                              "must be 'strict' or 'calibrated', got 'loose'*"])


def test_check_determinism_lists_unstable_layers(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_noisy='''
import torch
from agmodels import build, inputs

class Noisy(torch.nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x) * 1e-3   # differs every run

def test_noisy(activation_guard):
    m = torch.nn.Sequential(build(), Noisy())
    activation_guard.check(m, inputs(), include=["0.*"])   # compare only the stable part
''')
    ag.runpytest("--ag-update").assert_outcomes(passed=2)
    res = ag.runpytest("--ag-check-determinism")
    res.assert_outcomes(passed=2)
    out = res.stdout.str()
    assert "NONDETERMINISTIC" not in out  # the included layers are stable
    res.stdout.fnmatch_lines(["*determinism: every checked layer gave bit-identical outputs on two runs*"])


def test_check_determinism_flags_a_noisy_layer(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_mlp='''
import torch
from agmodels import build, inputs

class Noisy(torch.nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x) * 1e-3

def test_mlp(activation_guard):
    m = torch.nn.Sequential(build(), Noisy())
    activation_guard.check(m, inputs(), atol=1e-2)   # loose enough that the noise passes
''')
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    res = ag.runpytest("--ag-check-determinism")
    res.assert_outcomes(passed=1)  # reported, not failed
    res.stdout.fnmatch_lines(
        ["*NONDETERMINISTIC test_mlp.py::test_mlp: * layer call(s) differ between two runs: 1[[]0[]]*"])


def test_ag_deterministic_fixture_restores_settings(ag: pytest.Pytester) -> None:
    ag.makepyfile(test_det='''
import torch

def test_inside(ag_deterministic):
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.initial_seed() == 0

def test_after():
    assert not torch.are_deterministic_algorithms_enabled()
''')
    ag.runpytest("test_det.py").assert_outcomes(passed=2)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.imgs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs).get("src") or "")


@pytest.mark.slow
def test_html_report_covers_every_check_also_under_xdist(ag: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    ag.makepyfile(test_two='''
from agmodels import build, inputs

def test_other(activation_guard):
    activation_guard.check(build(), inputs())
''')
    ag.runpytest("--ag-update").assert_outcomes(passed=2)
    monkeypatch.setenv("AG_SCALE", "1.5")
    res = ag.runpytest("-n", "2", "--ag-report=out/report.html")
    res.assert_outcomes(failed=2)
    html = (ag.path / "out" / "report.html").read_text()
    p = _Tags()
    p.feed(html)
    assert "table" in p.tags
    assert "test_mlp.py::test_mlp" in html and "test_two.py::test_other" in html
    assert "blocks" not in html  # nothing from another model
    assert p.imgs and all(src.startswith("data:image/png;base64,") for src in p.imgs)
    assert "http://" not in html and "https://" not in html


def test_html_report_is_red_when_a_check_failed_without_a_report(ag: pytest.Pytester) -> None:
    """A missing golden and an unreadable one have no report, but fail the run: the page lists them
    and its banner says FAILED. Before, they were left off and the banner read OK (found by review)."""
    import re

    ag.makepyfile(test_two='''
from agmodels import build, inputs

def test_new(activation_guard):
    activation_guard.check(build(), inputs())

def test_broken(activation_guard):
    activation_guard.check(build(), inputs())
''')
    ag.runpytest("--ag-update", "test_mlp.py", "test_two.py::test_broken").assert_outcomes(passed=2)
    (ag.path / "golden" / "test_two" / "test_broken.h5").write_bytes(b"garbage")
    res = ag.runpytest("--ag-report=report.html")
    res.assert_outcomes(passed=1, failed=2)
    page = (ag.path / "report.html").read_text()
    banner = re.search(r'<div class="banner (\w+)">\s*<p class="state">([^<]*)', page)
    assert banner is not None and banner.group(1) == "bad", banner
    assert banner.group(2) == "FAILED: 3 checks: 1 passed, 0 diverged, 1 missing, 1 error", banner.group(2)
    assert "test_two.py::test_new" in page and "test_two.py::test_broken" in page and "MISSING" in page
    assert "ERROR" in page and "is not a readable HDF5 file" in page


def test_our_own_errors_fail_in_one_clean_block(ag: pytest.Pytester) -> None:
    """A selection that matches nothing is the user's mistake, not the model's: the test fails
    with the engine's message and no traceback into activation_guard's internals, and the
    existing golden is left as it was."""
    ag.runpytest("--ag-update").assert_outcomes(passed=1)
    golden = ag.path / "golden" / "test_mlp" / "test_mlp.h5"
    before = golden.read_bytes()
    ag.makepyfile(test_mlp='''
from agmodels import build, inputs

def test_mlp(activation_guard):
    activation_guard.check(build(), inputs(), include=["encoder.*"])
''')
    for args in (("--ag-update",), ()):
        res = ag.runpytest(*args)
        res.assert_outcomes(failed=1)
        res.stdout.fnmatch_lines(["*activation_guard: include=*encoder.* selected no layer call*"])
        out = res.stdout.str()
        assert "Traceback" not in out and "capture.py" not in out and "api.py" not in out
    assert golden.read_bytes() == before

"""The docs' example outputs come from real runs: docs/build_examples.py --check fails on drift.

The first test reruns every example (the demo, inspect, diff, a failing ``pytest -n 2`` in a
scratch project, ``git diff`` through textconv) and compares with README.md and docs/*.md. The
others pin the comparison itself: what it forgives (versions, digests, whitespace, last digits,
temporary paths, durations) and what it must not (a changed, added or removed line or word).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_examples", ROOT / "docs" / "build_examples.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gen = load_generator()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="the git diff example needs git")
def test_every_example_block_matches_a_real_run() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "build_examples.py"), "--check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "examples, all current" in r.stdout


def test_every_marked_block_names_a_known_example_and_the_pages_use_them_all() -> None:
    used = gen.used_examples(gen.PAGES)
    assert sorted(used) == sorted(gen.EXAMPLES)
    for page in gen.PAGES:  # markers pair up: every opening marker has its closing one
        text = page.read_text(encoding="utf-8")
        assert text.count("<!-- example: ") == text.count("<!-- /example -->"), page


REPORT = """activation_guard: first divergence at layer 'blocks.1.norm2' (LayerNorm) call 0
  golden        : demo/golden.h5 (recorded on cpu, torch 2.13.0+cpu; live run on cpu)
  mismatched    : 509 / 512 elements (99.4%)
  max abs diff  : 4.43e-03 at index (0, 4, 19): golden -2.666404, live -2.661974
  versions      : h5py 3.16.0, platform linux, cuda None, sha256:deba7b7791adf2f7
  mean          : -3.683e-09"""


@pytest.mark.parametrize("changed", [
    REPORT.replace("torch 2.13.0+cpu", "torch 2.14.1+cu128").replace("h5py 3.16.0", "h5py 3.17.2"),
    REPORT.replace("deba7b7791adf2f7", "0123456789abcdef"),
    REPORT.replace("platform linux, cuda None", "platform darwin, cuda 12.8"),
    REPORT.replace("  golden        :", "  golden    :").replace("\n", "\n  "),  # whitespace only
    REPORT.replace("-2.661974", "-2.661975").replace("-3.683e-09", "3.719e-09"),  # last digits, noise near 0
    REPORT.replace("(0, 4, 19)", "(1, 0, 7)"),  # which of near-equal differences is the worst: another CPU's pick
    REPORT.replace("4.43e-03", "4.56e-03"),  # a largest difference moved 3% (seen: 1.01 -> 1.04e-02)
])
def test_check_forgives_what_depends_on_the_machine(changed: str) -> None:
    assert gen.same(REPORT, changed)


@pytest.mark.parametrize("changed", [
    REPORT.replace("  mismatched    : 509 / 512 elements (99.4%)\n", ""),  # a line gone
    REPORT + "\n  what          : 509 / 512 elements (99.4%) outside tolerance",  # a line added
    REPORT.replace("live run on cpu", "live run on cuda"),  # a word
    REPORT.replace("509 / 512", "480 / 512"),  # a count
    REPORT.replace("509 / 512", "499 / 512"),  # a count, by 2%: whole numbers agree within 1%
    REPORT.replace("4.43e-03", "4.70e-03"),  # a measured number, by 6%
    REPORT.replace("4.43e-03", "4.43e-02"),  # a number, beyond noise
    REPORT.replace("(0, 4, 19)", "(0, 4)"),  # a column
])
def test_check_catches_drift(changed: str) -> None:
    assert not gen.same(REPORT, changed)


def test_only_the_worst_elements_index_is_masked() -> None:
    """A sample's or a mismatch list's "first at index" is deterministic: it is compared."""
    line = "  samples       : 3 of 64 sampled elements outside tolerance; first at index (0, 0, 24): golden 1.0"
    assert not gen.same(line, line.replace("(0, 0, 24)", "(0, 1, 24)"))
    worst = "  max abs diff  : 4.43e-03 at index (0, 4, 19): golden -2.666404, live -2.661974"
    assert gen.same(worst, worst.replace("(0, 4, 19)", "(1, 0, 3)"))


def test_normalize_hides_scratch_and_temporary_paths_durations_and_workers() -> None:
    scratch = Path(tempfile.gettempdir()) / "ag-docs-abc123"
    tmp = tempfile.gettempdir()
    raw = (f"  golden : {scratch}/project/golden/t.h5 (recorded on cpu)   \n"
           f"recorded to {tmp}/activation_guard-demo-k2j4h5l6/golden.h5\n"
           "[gw1] linux -- Python 3.11.7 /usr/bin/python3\n"
           "===== 1 failed, 1 passed, 2 skipped in 13.15s =====\n\n")
    assert gen.normalize(raw, scratch).splitlines() == [
        "  golden : /path/to/project/golden/t.h5 (recorded on cpu)",
        "recorded to /tmp/activation_guard-demo-XXXXXXXX/golden.h5",
        pytest_sep("1 failed, 1 passed, 2 skipped in X.XXs")]


def pytest_sep(title: str) -> str:
    import io

    from _pytest._io import TerminalWriter

    buf = io.StringIO()
    tw = TerminalWriter(buf)
    tw.fullwidth = 80
    tw.sep("=", title)
    return buf.getvalue().rstrip("\n")


@pytest.mark.parametrize("title", ["FAILURES", "activation_guard", "1 failed, 1 passed, 2 skipped in X.XXs", "x" * 90])
def test_a_rule_is_recentred_as_pytest_draws_it(title: str) -> None:
    """A duration's length changes a rule's padding; the rebuilt rule is pytest's own."""
    assert gen.pytest_rule(f"== {title} ==") == pytest_sep(title)


def test_update_rewrites_only_drifted_blocks_and_check_writes_nothing(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    current, stale = "$ activation-guard demo\nOK torch 2.14.0", "$ activation-guard inspect x\nold line"
    page.write_text(f"intro\n<!-- example: demo -->\n```text\n{current}\n```\n<!-- /example -->\nmiddle\n"
                    f"<!-- example: inspect -->\n```text\n{stale}\n```\n<!-- /example -->\nend\n")
    before = page.read_text()
    outputs = {"demo": "$ activation-guard demo\nOK torch 2.13.0", "inspect": "$ activation-guard inspect x\nnew line"}
    drift = gen.update([page], outputs, check=True)
    assert len(drift) == 1 and "'inspect' drifted" in drift[0] and "-old line" in drift[0] and "+new line" in drift[0]
    assert page.read_text() == before
    gen.update([page], outputs, check=False)
    after = page.read_text()
    assert "OK torch 2.14.0" in after  # matched up to the version: left byte for byte
    assert "new line" in after and "old line" not in after
    assert after.startswith("intro\n") and "\nmiddle\n" in after and after.endswith("<!-- /example -->\nend\n")
    gen.update([page], outputs, check=False, force=True)
    assert "OK torch 2.13.0" in page.read_text()


def test_an_unknown_example_name_is_an_error_naming_the_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    page = tmp_path / "bad.md"
    page.write_text("<!-- example: no-such-thing -->\n```text\n```\n<!-- /example -->\n")
    with pytest.raises(SystemExit, match=r"bad\.md: unknown example 'no-such-thing'"):
        gen.used_examples([page])

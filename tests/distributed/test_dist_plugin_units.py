"""The pytest layer's multi-rank pieces without torchrun: two pretend ranks in one process
exchanging through a FileStore (check verdicts, sessions), options, the process-group fixture."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import activation_guard as ag
from activation_guard.distributed.ranks import RankInfo
from activation_guard.plugin.ranks import RankContext, process_group
from activation_guard.plugin.session import CheckRecord, GuardSession
from activation_guard.plugin.settings import DEFAULT_RANK_TIMEOUT, OptionError, Settings

pytestmark = pytest.mark.distributed


def _ranks(tmp_path: Path, timeout: float = 5.0) -> tuple[GuardSession, GuardSession, RankContext, RankContext]:
    store = torch.distributed.FileStore(str(tmp_path / "store"), 2)
    settings = Settings(golden_dir=tmp_path / "golden", rootdir=tmp_path)
    s0, s1 = GuardSession(settings), GuardSession(settings)
    s0.ranks = RankContext(RankInfo(0, 2), store, timeout)
    s1.ranks = RankContext(RankInfo(1, 2), store, timeout)
    return s0, s1, s0.ranks, s1.ranks


def _diverged_report(tmp_path: Path) -> ag.Report:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    ag.record(m, x, path=tmp_path / "g.h5")
    with torch.no_grad():
        m[0].weight.mul_(1.01)
    return ag.compare(m, x, path=tmp_path / "g.h5")


def test_a_rank_failing_fails_rank_0_with_every_verdict(tmp_path: Path) -> None:
    s0, s1, r0, r1 = _ranks(tmp_path)
    report = _diverged_report(tmp_path)
    gd = tmp_path / "golden"

    def fails_on_rank1() -> None:
        s1.add(CheckRecord("t.py::a", None, str(gd / "t/a.rank1-of-2.h5"), "diverged"))
        pytest.fail("activation_guard: rank 1 diverged", pytrace=False)

    with pytest.raises(pytest.fail.Exception, match="rank 1 diverged"):  # a follower fails alone, no wait
        r1.gate(s1, "t.py::a", None, fails_on_rank1, lambda: report)
    assert s1.records[0].rank == 1

    def passes_on_rank0() -> str:
        s0.add(CheckRecord("t.py::a", None, str(gd / "t/a.rank0-of-2.h5"), "passed"))
        return "output"

    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as ei:
        r0.gate(s0, "t.py::a", None, passes_on_rank0, lambda: None)
    assert time.monotonic() - t0 < 5  # rank 1 had posted: no timeout spent
    text = str(ei.value.msg)
    assert text.startswith("activation_guard: this check passed on rank 0 but not on every rank of 2:\n"
                           "activation_guard: first divergence across 2 ranks at layer '0' call 0 "
                           "(#1 in execution order) on rank 1: values outside tolerance")
    assert "rank 0: ok (0 layer calls)" in text and "rank 1: first divergence at '0' call 0: diverged" in text

    # the next check of the same test has its own tag: both pass, nothing raised, value returned
    r1.gate(s1, "t.py::a", None, lambda: s1.add(CheckRecord("t.py::a", None, str(gd / "x.h5"), "written")),
            lambda: None)
    assert r0.gate(s0, "t.py::a", None, passes_on_rank0, lambda: None) == "output"


def test_a_silent_rank_costs_rank_0_its_timeout_and_is_named(tmp_path: Path) -> None:
    s0, _, r0, _ = _ranks(tmp_path, timeout=0.5)

    def own_failure() -> None:
        s0.add(CheckRecord("t.py::b", "dec", str(tmp_path / "golden" / "g.h5"), "missing",
                           message="no golden for this check: g"))
        pytest.fail("activation_guard: no golden for this check: g", pytrace=False)

    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as ei:
        r0.gate(s0, "t.py::b", "dec", own_failure, lambda: None)
    assert time.monotonic() - t0 < 10
    text = str(ei.value.msg)
    assert text.startswith("activation_guard: no golden for this check: g\n\n")  # its own failure first
    assert "rank 0: missing: no golden for this check: g" in text
    assert "rank 1: sent no verdict within 0.5 s" in text


def test_other_errors_keep_their_type_and_gain_the_verdicts(tmp_path: Path) -> None:
    s0, _, r0, _ = _ranks(tmp_path, timeout=0.2)

    def model_error() -> None:
        raise RuntimeError("boom in the model")

    with pytest.raises(RuntimeError, match="boom in the model") as ei:
        r0.gate(s0, "t.py::c", None, model_error, lambda: None)
    assert any("rank 0: raised RuntimeError: boom in the model" in n for n in ei.value.__notes__)


def test_sessions_merge_on_rank_0(tmp_path: Path) -> None:
    s0, s1, r0, r1 = _ranks(tmp_path)
    gd = tmp_path / "golden"
    s0.add(CheckRecord("t.py::a", None, str(gd / "t/a.rank0-of-2.h5"), "passed", rank=0))
    s1.add(CheckRecord("t.py::a", None, str(gd / "t/a.rank1-of-2.h5"), "diverged", rank=1,
                       first_divergence="rank 1 of 2: first divergence at layer '0'"))
    r1.send_session(s1)
    r0.merge_sessions(s0)
    assert s0.counts() == {"checked": 2, "passed": 1, "diverged": 1, "written": 0, "missing": 0}
    assert s0.used == {"t/a.rank0-of-2.h5", "t/a.rank1-of-2.h5"}
    assert "DIVERGED t.py::a [rank 1]: rank 1 of 2: first divergence at layer '0'" in s0.summary_lines()


def test_a_rank_that_never_sends_its_session_is_reported_lost(tmp_path: Path) -> None:
    s0, _, r0, _ = _ranks(tmp_path, timeout=0.2)
    s0.add(CheckRecord("t.py::a", None, str(tmp_path / "golden" / "a.rank0-of-2.h5"), "passed", rank=0))
    r0.merge_sessions(s0)
    assert "results of rank 1 were lost (crashed?)" in s0.summary_lines()


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "nan", "inf"])
def test_rank_timeout_must_be_positive_seconds(tmp_path: Path, bad: str) -> None:
    with pytest.raises(OptionError, match=rf"--ag-rank-timeout must be a number of seconds > 0, got '{bad}'"):
        Settings.build(rootdir=tmp_path, invocation_dir=tmp_path, ini_golden_dir="golden", rank_timeout=bad)
    ok = Settings.build(rootdir=tmp_path, invocation_dir=tmp_path, ini_golden_dir="golden", rank_timeout="2.5")
    assert ok.rank_timeout == 2.5
    assert Settings(golden_dir=tmp_path).rank_timeout == DEFAULT_RANK_TIMEOUT


def test_process_group_fixture_outside_torchrun_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with process_group(5.0) as group:
        assert group is None
    assert not torch.distributed.is_initialized()

"""Smoke run of the replay benchmark (benchmarks/replay_table.py --quick): it runs, prints both
tables and the cost table, and its JSON agrees with what it printed.

No timing and no detection rate is asserted from the quick run (one seed, shared machines); the
full table is quoted in docs/replay.md. What is asserted is that every fault the quick run injects
is found by replay="all" at its place and that no noise-only run alarms, because a regression
there is a bug in replay, not noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "replay_table.py"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out_json = tmp_path_factory.mktemp("replay-bench") / "replay.json"
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out_json)], capture_output=True,
                        text=True, timeout=600, cwd=ROOT, env=env, check=False)
    assert cp.returncode == 0, f"benchmark failed:\n{cp.stdout}\n{cp.stderr}"
    return cp.stdout, json.loads(out_json.read_text())


@pytest.mark.slow
def test_quick_replay_benchmark_prints_its_tables(quick_run: tuple[str, dict]) -> None:
    stdout, _ = quick_run
    for needle in ('**replay="all", tolerance="calibrated"**', '**replay="off", tolerance="calibrated"**',
                   "| BERT (token ids) | tf32 |", "| ResNet (pixel values) | reorder |", "Injected places",
                   "| bert | GELU -> tanh in parent |", 'Misses with replay="all": none',
                   'False alarms with replay="all": none', "| model | off (ms) | first | all |",
                   'replay="all" <= 3x a plain compare'):
        assert needle in stdout, f"{needle!r} missing from the benchmark output:\n{stdout}"


def test_quick_replay_benchmark_json_matches_what_it_printed(quick_run: tuple[str, dict]) -> None:
    stdout, data = quick_run
    res = data["results"]
    assert set(res) == {"bert", "resnet"} and data["seeds"] == 1
    for model, conds in res.items():
        assert set(conds) == {"tf32", "reorder"}
        for cond, cases in conds.items():
            assert cases["clean"]["all"] == [{"ok": True, "found": False, "got": "-"}], (model, cond)
            faults = [c for c in cases if c != "clean"]
            assert len(faults) >= 3, (model, cond, faults)  # weight, eps and one activation at least
            for fault in faults:
                (outcome,) = cases[fault]["all"]
                assert outcome["found"] and not outcome["ok"], (model, cond, fault, outcome)
                assert len(cases[fault]["off"]) == 1
    assert "GELU -> tanh" in res["bert"]["tf32"] and "ReLU -> leaky" in res["resnet"]["tf32"]
    assert "ReLU -> leaky" not in res["bert"]["tf32"]  # n/a: BERT has no ReLU
    for model in ("bert", "resnet"):
        t = data["cost"][model]
        assert all(t[k] > 0 for k in ("off", "first", "all", "cal off", "cal all"))
        assert f"| {model} | {t['off'] * 1e3:.0f} |" in stdout

"""Smoke run of the benchmark (benchmarks/run.py --quick): it runs and prints every figure.

No timing is asserted here (the suite runs on shared machines); the real figures come from the
full benchmark and are quoted in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "run.py"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    d = tmp_path_factory.mktemp("bench")
    out_json = d / "figures.json"
    env = dict(os.environ, PYTHONHASHSEED="0")
    cp = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out_json), "--workdir", str(d)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env, check=False,
    )
    assert cp.returncode == 0, f"benchmark failed:\n{cp.stdout}\n{cp.stderr}"
    with open(out_json) as f:
        return cp.stdout, json.load(f)


@pytest.mark.slow
def test_quick_benchmark_prints_every_figure(quick_run):
    stdout, _ = quick_run
    for needle in (
        "== wide:", "== deep:", "== llama: skipped with --quick",
        "forward", "limit record", "limit compare", "peer record", "peer check",
        "x limit", "x activation_guard's record", "x activation_guard's compare",
        "per layer call above the forward", "in CPU time (steadier on a shared machine)", "x raw bytes",
        "compression=gzip", "compression=lzf",
        "== scaling with layers", "== scaling with bytes", "== peak memory", "above the forward",
        "== fingerprints, wide:", "golden size", "fingerprint kernel alone", "fp / full",
        "== fingerprints, gpt2: skipped with --quick", "record with fingerprints <= 1.3x the plain forward",
        "== targets",
    ):
        assert needle in stdout, f"{needle!r} missing from the benchmark output:\n{stdout}"


def test_quick_benchmark_json_has_consistent_figures(quick_run):
    _, data = quick_run
    res = data["results"]
    assert data["output"] and data["output"][0].startswith("activation_guard")
    assert res["quick"] is True and res["threads"] == 1
    for name in ("wide", "deep"):
        r = res[name]
        for k in ("forward", "limit record", "record", "limit compare", "compare"):
            assert r[k] > 0, (name, k)
        for k in ("forward", "record", "compare", "peer record", "peer check", "file_bytes"):
            assert r["peer"][k] > 0, (name, k)
        assert r["layer_calls"] > 0 and r["nbytes"] > 0
        assert r["file_bytes"] >= r["nbytes"]  # uncompressed: at least the raw bytes
    assert res["deep"]["layer_calls"] == 61  # 60 Linear + the Sequential
    wide = res["wide"]
    assert set(wide["compression"]["file_bytes"]) == {"gzip", "lzf"}
    assert wide["compression"]["record gzip"] > 0 and wide["compression"]["compare lzf"] > 0
    assert wide["largest_leaf_bytes"] == 64 * 64 * 4
    assert "compression" not in res["deep"]
    mem = res["memory"]
    assert mem["record"]["op_peak"] > 0 and mem["compare"]["op_peak"] > 0
    assert mem["total_bytes"] > mem["largest_leaf_bytes"] > 0
    names = [t["target"] for t in res["targets"]]
    assert any("fixed cost" in n for n in names)
    assert sum("per layer call above the forward" in n for n in names) == 2
    assert any("peak above forward" in n for n in names)
    assert sum("linear in" in n for n in names) == 4
    fp = res["fingerprint"]["wide"]
    for k in ("forward", "kernel", "record full", "record fp", "compare full", "compare fp"):
        assert fp[k] > 0, k
    assert fp["fingerprints"] >= 9 and 0 < fp["fp_bytes"] < fp["full_bytes"]  # 9 outputs (+ inputs, if recorded)
    assert any("fingerprint golden <= 1% of full" in n for n in names)



@pytest.mark.slow
def test_ab_script_times_two_checkouts_in_one_process(tmp_path: Path) -> None:
    """benchmarks/ab.py (side-by-side timing of two checkouts): runs, prints both and the ratio."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    cp = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), str(ROOT), str(ROOT), "--layers", "20",
                         "--repeat", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
                        check=False)
    assert cp.returncode == 0, cp.stderr
    for needle in ("21 layer calls", "record old", "record new", "compare old", "compare new", "record: new / old =",
                   "compare: new / old ="):
        assert needle in cp.stdout, cp.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode != 0 and "is not a checkout of activation_guard" in bad.stderr


@pytest.mark.slow
def test_instruction_count_script_child_and_refusals(tmp_path: Path) -> None:
    """benchmarks/instructions.py: what it runs under valgrind (each op on a small `deep`,
    importing the checkout it names) works without valgrind; bad arguments are refused by name
    before any valgrind run. (The counting itself takes minutes under valgrind: not run here.)"""
    script = str(ROOT / "benchmarks" / "instructions.py")
    env = dict(os.environ, PYTHONHASHSEED="0")
    for op in ("forward", "record", "compare", "open"):
        cp = subprocess.run([sys.executable, script, "--child", str(ROOT), op, "1", "5"], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path, env=env, check=False)
        assert cp.returncode == 0, (op, cp.stderr)
    for args, needle in (([str(tmp_path)], "is not a checkout of activation_guard"),
                         ([str(ROOT), "--ops", "compare,bogus"], "unknown op(s) ['bogus']"),
                         ([str(ROOT)] * 3, "give one checkout, or two")):
        bad = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300,
                             check=False)
        assert bad.returncode != 0 and needle in bad.stderr, (args, bad.stderr)


@pytest.mark.slow
def test_ab_script_times_fingerprint_recordings_as_multiples_of_the_forward(tmp_path: Path) -> None:
    cp = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), str(ROOT), str(ROOT), "--fingerprint",
                         "wide", "--quick", "--repeat", "2"], capture_output=True, text=True, timeout=300,
                        cwd=tmp_path, check=False)
    assert cp.returncode == 0, cp.stderr
    for needle in ("record with fingerprints on the worker", "forward", "record old", "record new", "x the forward",
                   "new / old ="):
        assert needle in cp.stdout, cp.stdout


GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"


def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the check would run for real")
    log = tmp_path / "gpu.log"
    cp = subprocess.run([sys.executable, str(GPU_CHECK), "--log", str(log)], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "no CUDA: torch.cuda.is_available() is False" in log.read_text()


@pytest.mark.slow
def test_gpu_check_dry_run_on_the_cpu_passes_every_section(tmp_path: Path) -> None:
    """Every section's own logic (the verdicts it expects) on the CPU; the pytest section is for CUDA."""
    log = tmp_path / "gpu.log"
    cp = subprocess.run([sys.executable, str(GPU_CHECK), "--device", "cpu", "--quick", "--log", str(log)],
                        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    text = log.read_text()
    assert cp.returncode == 0, text + cp.stderr
    assert "== summary: tests ok, replay ok, determinism ok, fingerprints ok, calibrated ok, stream-race ok" in text
    assert "origin ('1.1', 'parent-code')" in text and "10 of 10 calls re-run" in text
    assert "fingerprints under deterministic(): 5 stored, bit-exact compare ok=True" in text

"""The plugin under ``torchrun --nproc-per-node 2 -m pytest``: per-rank goldens written by
``--ag-update``, a change on one rank caught (on that rank and, through the store, on rank 0),
one merged summary on rank 0, per-rank goldens attributed to their tests by ``--ag-unused``.

Two torchrun runs of a small project (each: two pytest processes on gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = '''
import pytest


@pytest.fixture(scope="session", autouse=True)
def process_group(ag_process_group):
    assert ag_process_group is not None, "not under torchrun"
    return ag_process_group
'''

TESTS = '''
import os

import torch
import torch.distributed as dist
from torch import nn

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def tp_mlp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def bugged(weight):
    if os.environ.get("AG_BUG_RANK") == str(dist.get_rank()):
        with torch.no_grad():
            weight.mul_(1.01)


def test_tp(activation_guard):
    model = tp_mlp()
    bugged(model[0].weight.to_local())  # this rank's shard of the Colwise weight
    activation_guard.check(model, X)


def test_tp_unchanged(activation_guard):
    activation_guard.check(tp_mlp(), X)


def test_replica(activation_guard):
    model = mlp()  # every rank its own copy: a change on rank 1 leaves rank 0's values alone
    bugged(model[2].weight)
    activation_guard.check(model, X)
'''


def _torchrun(project: Path, *args: str, bug_rank: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "AG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if bug_rank is not None:
        env["AG_BUG_RANK"] = str(bug_rank)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "pytest", "-p", "no:cacheprovider", "-q", "--ag-rank-timeout", "60", *args]
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_per_rank_goldens_under_torchrun(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nag_golden_dir = golden\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_par.py").write_text(TESTS)

    r = _torchrun(tmp_path, "--ag-update")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    files = sorted(p.name for p in (tmp_path / "golden" / "test_par").iterdir())
    assert files == [f"{t}.rank{k}-of-2.h5" for t in ("test_replica", "test_tp", "test_tp_unchanged") for k in (0, 1)]
    assert out.count("goldens: ") == 1  # one summary, on rank 0, with both ranks' checks
    assert "goldens: 0 checked, 0 passed, 0 diverged, 6 written, 0 missing" in out
    assert "activation_guard: rank 1 of 2: results sent to rank 0, which prints the summary" in out
    assert out.count("3 passed") == 2

    # a stale per-rank golden of a deleted test: --ag-unused attributes rank files to their tests
    stale = tmp_path / "golden" / "test_par" / "test_gone.rank1-of-2.h5"
    stale.write_bytes((tmp_path / "golden" / "test_par" / "test_tp.rank1-of-2.h5").read_bytes())
    r = _torchrun(tmp_path, "--ag-unused=list", bug_rank=1)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count("2 failed, 1 passed") == 2, out  # test_tp and test_replica, on both ranks
    # rank 1 finds its own divergence at the changed layer
    assert "activation_guard: rank 1 of 2: first divergence at layer '0' (Linear) call 0, #1 of 4" in out
    # rank 0's values change only after the Rowwise all-reduce; its failure adds every rank's verdict
    assert "activation_guard: rank 0 of 2: first divergence at layer '<root>' (Sequential) call 0, #4 of 4" in out
    assert ("activation_guard: first divergence across 2 ranks at layer '0' call 0 (#1 in execution order) "
            "on rank 1: values outside tolerance") in out
    # a replica changed on rank 1 only: rank 0 passed its own check and fails through the exchange
    assert "activation_guard: this check passed on rank 0 but not on every rank of 2:" in out
    assert ("activation_guard: first divergence across 2 ranks at layer '2' call 0 (#3 in execution order) "
            "on rank 1") in out
    assert "re-record the golden: torchrun --nproc-per-node 2 -m pytest --ag-update test_par.py::test_tp" in out
    # one merged summary on rank 0
    assert out.count("goldens: ") == 1
    assert "goldens: 6 checked, 3 passed, 3 diverged, 0 written, 0 missing" in out
    assert "DIVERGED test_par.py::test_tp [rank 0]: rank 0 of 2: first divergence at layer '<root>'" in out
    assert "DIVERGED test_par.py::test_tp [rank 1]: rank 1 of 2: first divergence at layer '0'" in out
    assert "DIVERGED test_par.py::test_replica [rank 1]: rank 1 of 2: first divergence at layer '2'" in out
    assert "UNUSED   test_par/test_gone.rank1-of-2.h5" in out
    assert "1 unused golden(s)" in out  # the other tests' rank files were used (by rank 0 or rank 1)

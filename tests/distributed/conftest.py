"""Shared by the distributed tests: run an expensive multi-rank scenario once per test run."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import dist_ranks
import pytest
from filelock import FileLock

import activation_guard as ag
from activation_guard.distributed.spawn import run_distributed


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[], Any]], Any]:
    """``once_per_run(key, compute)``: the JSON result of ``compute()``, computed once per run.

    Under pytest-xdist every worker has its own session, and a module's tests may be spread over
    workers; a spawned process group costs seconds, so the first worker computes under a file lock
    in the run's shared temporary folder and the others read its result.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent

    def get(key: str, compute: Callable[[], Any]) -> Any:
        path = root / f"ag-dist-{key}.json"
        with FileLock(str(path) + ".lock"):
            if path.is_file():
                return json.loads(path.read_text(encoding="utf-8"))
            value = compute()
            path.write_text(json.dumps(value), encoding="utf-8")
            return value

    return get


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory, once_per_run: Callable[..., Any]) -> Any:
    """Both ranks' results of dist_ranks.parallel_suite: one process group for every scenario."""

    def run() -> Any:
        folder = tmp_path_factory.mktemp("dist")
        ag.record(dist_ranks.mlp(), dist_ranks.mlp_input(), path=folder / "mlp.h5")
        ag.record(dist_ranks.tiny_llama(), (), dist_ranks.llama_inputs(), path=folder / "llama.h5")
        (folder / "per_rank").mkdir()
        goldens = (str(folder / "mlp.h5"), str(folder / "llama.h5"), str(folder / "per_rank" / "tp.h5"))
        return {"folder": str(folder), "ranks": run_distributed(dist_ranks.parallel_suite, world_size=2,
                                                                args=goldens, timeout=240)}

    return once_per_run("parallel-suite", run)

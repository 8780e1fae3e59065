"""Shared by the distributed tests: run an expensive multi-rank scenario once per test run."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import pytest
from filelock import FileLock


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

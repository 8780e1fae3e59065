"""Reusable pytester workflow for plugins and projects built on activation_guard.

Like pytest-regressions' ``check_regression_fixture_workflow``: one call proves the whole golden
life cycle of a test file, so a project (or this repository's own tests, also under
``pytest -n 2``) can assert that a missing golden fails, ``--ag-update`` writes it, reruns pass,
a model change fails naming the layer, and re-recording makes it pass again::

    from activation_guard.testing import check_golden_workflow

    def test_workflow(pytester):
        check_golden_workflow(pytester, SOURCE, MODIFIED_SOURCE, layer="2")

``run_distributed(fn, world_size=2)`` runs a module-level function on N ranks of a fresh CPU
(gloo) process group, so a CI without GPUs or torchrun can test parallel models
(:mod:`activation_guard.distributed.spawn`, docs/distributed.md).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

import pytest

# N-rank tests from a plain pytest run (docs/distributed.md); spawn imports no torch
from .distributed.spawn import DistributedRunError, DistributedTimeout, run_distributed

__all__ = ["DistributedRunError", "DistributedTimeout", "WorkflowResult", "check_golden_workflow", "golden_files",
           "run_distributed"]

Modifier = Union[str, Callable[[], Any]]


@dataclass
class WorkflowResult:
    """What each step produced, for further assertions by the caller."""

    steps: dict[str, pytest.RunResult] = field(default_factory=dict)
    goldens: list[Path] = field(default_factory=list)
    mtimes: dict[Path, int] = field(default_factory=dict)


def golden_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.h5") if not p.name.startswith("."))


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    o = result.parseoutcomes()
    return {k: o.get(k, 0) for k in ("passed", "failed", "errors")}


def _expect(result: pytest.RunResult, step: str, *, passed: int, failed: int) -> None:
    got = _outcomes(result)
    want = {"passed": passed, "failed": failed, "errors": 0}
    if got != want:
        out = "\n".join(result.outlines[-60:])
        raise AssertionError(f"workflow step {step!r}: expected {want}, got {got}\n--- output tail ---\n{out}")


def check_golden_workflow(
    pytester: pytest.Pytester,
    source: str,
    modify: Modifier,
    *,
    args: Sequence[str] = (),
    layer: str | None = None,
    golden_dir: str = "golden",
    module_name: str = "test_workflow",
    final_rerun: bool = True,
) -> WorkflowResult:
    """Run the golden life cycle on ``source`` (a test module using the ``activation_guard``
    fixture) and assert every step; ``args`` are added to every pytest run (e.g. ``-n 2``).

    1. no golden: every test fails, the failure names ``--ag-update``, and nothing is written;
    2. ``--ag-update``: every test passes and goldens appear, listed as written in the summary;
    3. rerun: passes, and the goldens are untouched;
    4. ``modify`` (new module source text, or a callable that changes what the test computes):
       every test fails; with ``layer``, the report names it as the first divergence;
    5. ``--ag-update``: passes again; 6. (``final_rerun``) rerun: passes.
    """
    # In-process pytester runs drop modules first imported inside them; h5py cannot be imported
    # twice in one process, so import the engine (torch, h5py) out here, before the inner runs.
    import activation_guard.api.run  # noqa: F401

    res = WorkflowResult()
    root = pytester.path / golden_dir
    pytester.makepyfile(**{module_name: source})

    r = pytester.runpytest(*args)
    res.steps["missing"] = r
    n = _outcomes(r)["failed"]
    assert n > 0, "the test module must contain at least one test using activation_guard"
    _expect(r, "missing", passed=0, failed=n)
    r.stdout.fnmatch_lines(["*no golden for this check*", "*pytest --ag-update *"])
    assert golden_files(root) == [], "a missing golden must never be written without --ag-update"

    r = pytester.runpytest("--ag-update", *args)
    res.steps["update"] = r
    _expect(r, "update", passed=n, failed=0)
    res.goldens = golden_files(root)
    assert res.goldens, f"--ag-update wrote no golden under {root}"
    r.stdout.fnmatch_lines(["*activation_guard*", f"*{len(res.goldens)} written*", "WRITTEN *"])
    res.mtimes = {p: p.stat().st_mtime_ns for p in res.goldens}

    r = pytester.runpytest(*args)
    res.steps["rerun"] = r
    _expect(r, "rerun", passed=n, failed=0)
    assert {p: p.stat().st_mtime_ns for p in golden_files(root)} == res.mtimes, "a passing run rewrote a golden"

    if isinstance(modify, str):
        pytester.makepyfile(**{module_name: modify})
    else:
        modify()
    # an edit of the same size within the same mtime second would let a stale bytecode cache
    # (pytest's assertion rewriting caches by mtime and size) run the old source
    shutil.rmtree(pytester.path / "__pycache__", ignore_errors=True)
    r = pytester.runpytest(*args)
    res.steps["modified"] = r
    failed = _outcomes(r)["failed"]
    assert failed > 0, "the modification did not make any check fail:\n" + "\n".join(r.outlines[-40:])
    _expect(r, "modified", passed=n - failed, failed=failed)
    r.stdout.fnmatch_lines(["*first divergence at layer*", "DIVERGED *"])
    if layer is not None:
        r.stdout.fnmatch_lines([f"*first divergence at layer {layer!r}*"])

    r = pytester.runpytest("--ag-update", *args)
    res.steps["regen"] = r
    _expect(r, "regen", passed=n, failed=0)

    if final_rerun:
        r = pytester.runpytest(*args)
        res.steps["final"] = r
        _expect(r, "final", passed=n, failed=0)
    return res

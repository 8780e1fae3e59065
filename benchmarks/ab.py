#!/usr/bin/env python
"""Two checkouts of activation_guard timed side by side, in one process (`deep` or `llama`).

A change worth 2-3 us per layer call (5-10% of the per-call cost) is invisible in separate runs
on a shared VM: the same code measured 31-47 us per record call in back-to-back processes here.
This script imports both packages under other names (copies of each checkout's
``activation_guard/``, whose imports are relative), then alternates their record and compare in
one loop, so both see the same load, caches and allocator state. It reports the cost per layer
call above the plain forward, from CPU time of this thread (steadier than wall time when other
tenants take the CPU) and wall time, as the minimum and the 25th percentile of the repetitions.

    python benchmarks/ab.py OLD_CHECKOUT NEW_CHECKOUT [--layers 1500] [--repeat 30] [--workload llama]
    python benchmarks/ab.py OLD_CHECKOUT NEW_CHECKOUT --fingerprint gpt2|wide [--repeat 15] [--quick]

``--fingerprint``: a recording with fingerprints on the worker thread,
as a multiple of the plain forward, from wall-time medians (the worker's CPU time is on another
thread); ``gpt2`` is benchmarks/fingerprints.py's GPT-2-small-shaped model, ``wide`` run.py's.

e.g. ``git worktree add /tmp/old HEAD~1 && python benchmarks/ab.py /tmp/old .``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(tree: str, alias: str, root: str) -> Any:
    src = os.path.join(os.path.abspath(tree), "activation_guard")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        raise SystemExit(f"{tree!r} is not a checkout of activation_guard (no activation_guard/__init__.py)")
    shutil.copytree(src, os.path.join(root, alias), ignore=shutil.ignore_patterns("__pycache__"))
    return importlib.import_module(alias)


def _q(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[int(p * (len(s) - 1))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--layers", type=int, default=1500, help="Linear(8, 8) layers of the deep model (default 1500)")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--workload", choices=("deep", "llama"), default="deep",
                    help="deep (per-call cost) or llama (a tiny transformers Llama: mixed sizes, 58 calls)")
    ap.add_argument("--fingerprint", choices=("gpt2", "wide"), default=None,
                    help="time record(fingerprint=True) on the worker thread instead, as a multiple of the forward")
    ap.add_argument("--quick", action="store_true", help="with --fingerprint: tiny sizes (a smoke test)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    if a.fingerprint is not None:
        return _fingerprint_ab(a)
    from run import deep, transformer

    w = deep(False, a.layers) if a.workload == "deep" else transformer()
    with tempfile.TemporaryDirectory() as d:
        sys.path.insert(0, d)
        pkgs = {"old": _load(a.old, "ag_ab_old", d), "new": _load(a.new, "ag_ab_new", d)}
        ops: dict[str, Callable[[], Any]] = {"forward": w.forward}
        for k, m in pkgs.items():
            golden = os.path.join(d, f"{k}.h5")
            calls = m.record(w.model, w.args, path=golden).layer_calls
            if not m.compare(w.model, w.args, path=golden).ok:
                raise SystemExit(f"{k}: compare against its own fresh golden failed")
            ops[f"record {k}"] = lambda m=m, k=k: m.record(w.model, w.args, path=os.path.join(d, f"{k}2.h5"))
            ops[f"compare {k}"] = lambda m=m, golden=golden: m.compare(w.model, w.args, path=golden)
        cpu: dict[str, list[float]] = {k: [] for k in ops}
        wall: dict[str, list[float]] = {k: [] for k in ops}
        names = list(ops)
        for i in range(a.repeat):
            for k in (names if i % 2 == 0 else names[::-1]):
                c, t = time.thread_time(), time.perf_counter()
                ops[k]()
                cpu[k].append(time.thread_time() - c)
                wall[k].append(time.perf_counter() - t)
    print(f"{w.name}: {w.note}, {calls} layer calls, {a.repeat} repetitions alternated")
    print("us per layer call above the forward (CPU time: min / 25th percentile; wall: min / 25th percentile)")
    for op in ("record", "compare"):
        for k in pkgs:
            name = f"{op} {k}"
            fig = [(f(series[name]) - f(series["forward"])) / calls * 1e6
                   for series in (cpu, wall) for f in (min, lambda v: _q(v, 0.25))]
            print(f"   {name:<12} cpu {fig[0]:6.1f} / {fig[1]:6.1f}   wall {fig[2]:6.1f} / {fig[3]:6.1f}")
        o = _q(cpu[f"{op} old"], 0.25) - _q(cpu["forward"], 0.25)
        n = _q(cpu[f"{op} new"], 0.25) - _q(cpu["forward"], 0.25)
        print(f"   {op}: new / old = {n / o:.2f}x (CPU time, 25th percentiles)")
    return 0


def _fingerprint_ab(a: argparse.Namespace) -> int:
    import statistics

    import torch

    os.environ["ACTIVATION_GUARD_FINGERPRINT_WORKER"] = "on"  # what ``auto`` picks with a core free
    if a.fingerprint == "gpt2":
        from fingerprints import gpt2_small

        name, model, args, note = gpt2_small(a.quick)
    else:
        from run import wide

        w = wide(a.quick)
        name, model, args, note = w.name, w.model, w.args, w.note

    def forward() -> None:
        with torch.no_grad():
            model(*args)

    with tempfile.TemporaryDirectory() as d:
        sys.path.insert(0, d)
        pkgs = {"old": _load(a.old, "ag_ab_old", d), "new": _load(a.new, "ag_ab_new", d)}
        ops: dict[str, Callable[[], Any]] = {"forward": forward}
        for k, m in pkgs.items():
            golden = os.path.join(d, f"{k}.h5")
            ops[k] = lambda m=m, golden=golden: m.record(model, args, path=golden, fingerprint=True)
            ops[k]()  # builds the compiled pass, fills the copy-buffer pool
            if not m.compare(model, args, path=golden).ok:
                raise SystemExit(f"{k}: compare against its own fresh golden failed")
        wall: dict[str, list[float]] = {k: [] for k in ops}
        names = list(ops)
        for i in range(a.repeat):
            for k in (names if i % 2 == 0 else names[::-1]):
                t = time.perf_counter()
                ops[k]()
                wall[k].append(time.perf_counter() - t)
    f = statistics.median(wall["forward"])
    print(f"{name}: {note}; record with fingerprints on the worker, {a.repeat} repetitions alternated (wall medians)")
    print(f"   forward {f * 1e3:8.1f} ms")
    for k in pkgs:
        r = statistics.median(wall[k])
        print(f"   record {k:<4} {r * 1e3:7.1f} ms = {r / f:.3f}x the forward")
    print(f"   new / old = {statistics.median(wall['new']) / statistics.median(wall['old']):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

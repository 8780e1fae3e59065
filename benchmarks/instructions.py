#!/usr/bin/env python
"""Instructions per layer call on `deep`, counted by valgrind (callgrind): a measure that does not move.

Timings on this shared 2-core VM swing by half from one minute to the next (the same code
measured 31-47 us per record call in back-to-back runs), so a change worth 1-3 us per layer call,
which is what is left to gain on the per-layer target, cannot be seen in wall or CPU
time, not even interleaved in one process (:mod:`ab`). The number of instructions executed is
nearly the same on every run of one checkout (hash seed fixed, address randomization off: ~0.02%
apart at the default size). Between two
checkouts about 1% still moves with the code's layout in memory: the plain forward, which runs
no code of ours, read 0.993x. So trust differences above ~1-2%. It does not see cache misses, so
confirm a real gain with ``ab.py`` on a quiet minute. A whole run also varies by a few hundred
thousand instructions, which is noise only against the defaults' ~1e9 measured: a tiny
``--layers``/``--repeat`` (20 layers, 1 run gave a negative forward) measures nothing.

Each figure is ``(I(setup + K ops) - I(setup)) / (K * layer calls)``: the setup (importing torch,
building the model, recording its golden, one warm-up of each op) cancels out. ``record`` and
``compare`` are also shown above the plain forward; ``open`` is opening the golden alone
(``GoldenReader``), which is part of every compare.

    python benchmarks/instructions.py [OLD_CHECKOUT] NEW_CHECKOUT [--layers 1500] [--ops ...]

Needs ``valgrind`` (``apt install valgrind``). A run takes a few minutes: torch's import alone
runs for about a minute under valgrind, and the runs go two at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ("forward", "record", "compare", "open")


def child(tree: str, op: str, k: int, layers: int) -> None:
    """Inside valgrind: the setup, then ``k`` runs of ``op``."""
    tree = os.path.abspath(tree)
    sys.path.insert(0, tree)
    sys.path.insert(0, HERE)
    import torch

    torch.set_num_threads(1)
    import activation_guard as ag

    if not os.path.abspath(ag.__file__).startswith(tree + os.sep):
        raise SystemExit(f"imported activation_guard from {ag.__file__}, not from {tree}")
    from run import deep

    from activation_guard.store import GoldenReader

    w = deep(False, layers)
    with tempfile.TemporaryDirectory() as d:
        golden, scratch = os.path.join(d, "g.h5"), os.path.join(d, "r.h5")
        ag.record(w.model, w.args, path=golden)
        ops = {
            "forward": w.forward,
            "record": lambda: ag.record(w.model, w.args, path=scratch),
            "compare": lambda: ag.compare(w.model, w.args, path=golden),
            "open": lambda: GoldenReader(golden).close(),
        }
        for fn in ops.values():  # warm-up: every op's first-call costs fall in the setup
            fn()
        for _ in range(k):
            ops[op]()


def count(tree: str, op: str, k: int, layers: int) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", ACTIVATION_GUARD_FINGERPRINT_WORKER="off")
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, os.path.abspath(__file__),
           "--child", tree, op, str(k), str(layers)]
    if shutil.which("setarch"):  # addresses fixed too: ids (hence dict layouts keyed by them) repeat
        cmd = ["setarch", os.uname().machine, "-R", *cmd]
    cp = subprocess.run(cmd, capture_output=True, text=True, env=env)
    m = re.search(r"Collected\s*:\s*(\d+)", cp.stderr)
    if cp.returncode != 0 or m is None:
        raise SystemExit(f"valgrind run failed ({' '.join(cmd)}):\n{cp.stderr[-3000:]}")
    return int(m.group(1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("trees", nargs="+", metavar="CHECKOUT", help="one checkout, or OLD NEW")
    ap.add_argument("--layers", type=int, default=1500, help="Linear(8, 8) layers of the deep model (default 1500)")
    ap.add_argument("--repeat", type=int, default=4, help="runs of each op counted (default 4)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {','.join(OPS)}")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="valgrind runs at once")
    a = ap.parse_args(argv)
    if len(a.trees) > 2:
        ap.error("give one checkout, or two (OLD NEW)")
    ops = [o for o in a.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        ap.error(f"unknown op(s) {bad}; choose from {list(OPS)}")
    for t in a.trees:
        if not os.path.isfile(os.path.join(t, "activation_guard", "__init__.py")):
            ap.error(f"{t!r} is not a checkout of activation_guard (no activation_guard/__init__.py)")
    if shutil.which("valgrind") is None:
        print("benchmarks/instructions.py needs valgrind (apt install valgrind)", file=sys.stderr)
        return 2
    if "forward" not in ops and ({"record", "compare"} & set(ops)):
        ops.insert(0, "forward")  # record and compare are shown above it
    trees = range(len(a.trees))  # by position: the same checkout may be given twice (a repeatability check)
    with tempfile.TemporaryDirectory() as d:
        # each checkout's package copied to a path of the same length: the path's length moves
        # allocations, and with them id()-keyed dict layouts (2.6% on the forward alone, measured)
        copies = [os.path.join(d, f"t{i}") for i in trees]
        for t, copy in zip(a.trees, copies):
            shutil.copytree(os.path.join(t, "activation_guard"), os.path.join(copy, "activation_guard"),
                            ignore=shutil.ignore_patterns("__pycache__"))
        runs = [(i, op, a.repeat) for i in trees for op in ops] + [(i, "forward", 0) for i in trees]
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            got = dict(zip(runs, pool.map(lambda r: count(copies[r[0]], r[1], r[2], a.layers), runs)))
    calls = a.layers + 1
    per = {(i, op): (got[(i, op, a.repeat)] - got[(i, "forward", 0)]) / (a.repeat * calls) for i in trees for op in ops}
    rows: list[tuple[str, list[float]]] = []
    for op in ops:
        rows.append((op, [per[(i, op)] for i in trees]))
        if op in ("record", "compare"):
            rows.append((f"{op} above the forward", [per[(i, op)] - per[(i, "forward")] for i in trees]))
    print(f"deep{a.layers}: {calls} layer calls; instructions per layer call (callgrind, hash seed 0, "
          f"{a.repeat} runs of each op)")
    head = "".join(f"{name:>14}" for name in (["old", "new"] if len(a.trees) == 2 else ["count"]))
    print(f"   {'':<26}{head}" + ("   new / old" if len(a.trees) == 2 else ""))
    for label, vals in rows:
        ratio = f"   {vals[1] / vals[0]:.3f}x" if len(vals) == 2 and vals[0] else ""
        print(f"   {label:<26}" + "".join(f"{v:14,.0f}" for v in vals) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the shape of a divergence costs a failing compare, on the ``wide`` workload of run.py.

A/B in one process: the same failing compare (the first Linear's bias changed, so every layer
diverges) with the usual described calls (the first ``DESCRIBED`` diverged ones, words and
heatmap grids) and with none, alternated, medians compared. Replay is off so the ratio is over
the compare itself (the smaller denominator: the conservative figure).

    python benchmarks/where_cost.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from run import wide

import activation_guard as ag
from activation_guard._core.kernel import compare_tensors
from activation_guard.comparison import comparator
from activation_guard.judges.where import describe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    w = wide(a.quick)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "wide.h5"
        with torch.no_grad():
            ag.record(w.model, w.args, path=path)
            w.model[0].bias += 1e-2  # every layer after it diverges
        times: dict[str, list[float]] = {"with": [], "without": []}
        described = comparator.DESCRIBED
        for _ in range(a.repeat):
            for mode in ("with", "without"):
                comparator.DESCRIBED = described if mode == "with" else 0
                t0 = time.perf_counter()
                r = ag.compare(w.model, w.args, path=path, replay="off")
                times[mode].append(time.perf_counter() - t0)
                assert not r.ok
                assert (len(r.described()) > 0) == (mode == "with")
        comparator.DESCRIBED = described
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"wide ({w.note}), failing compare, replay off, median of {a.repeat}:")
    print(f"  without the shape of divergence: {med['without'] * 1e3:.1f} ms")
    print(f"  with it ({described} described calls): {med['with'] * 1e3:.1f} ms")
    print(f"  ratio: {med['with'] / med['without']:.3f} (target <= 1.05)")
    # the description alone, against the kernel's comparison of the same pair (less exposed to a busy machine)
    g = torch.randn(w.args[0].shape[0], w.model[0].out_features)
    lv = g + 1e-2
    one: dict[str, list[float]] = {"describe": [], "compare": []}
    for _ in range(9):
        t0 = time.perf_counter()
        describe(g, lv, 1.3e-6, 1e-5)
        one["describe"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compare_tensors(g, lv, 1.3e-6, 1e-5)
        one["compare"].append(time.perf_counter() - t0)
    d, c = statistics.median(one["describe"]), statistics.median(one["compare"])
    print(f"  one output {list(g.shape)}: describe {d * 1e3:.1f} ms, the kernel's compare {c * 1e3:.1f} ms; "
          f"{described} described calls = {described * d / med['without']:.1%} of the compare without them")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Comparing against a golden whose layers are all missing must stay linear.

A golden of N layer calls is compared (a) with the same model, (b) through a wrapper module (every
golden layer is "missing", every live layer "unexpected"), and (c) with ``fail_fast`` on a model
whose last layer changed. Round 1 took 98.7 s for (b) at N = 16,000 (2.9 s for (a)), because each
missing call counted its live calls with a scan of all results. Prints times side by side and the
ratio (b)/(a) at two sizes: linear code keeps the ratio flat as N grows.

    python benchmarks/missing_layers.py [--sizes 4000,16000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from torch import nn

import activation_guard as ag


class Chain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4000,16000")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(1, 2)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in (int(s) for s in args.sizes.split(",")):
            model = Chain(n)
            p = os.path.join(d, f"g{n}.h5")
            ag.record(model, x, path=p)
            plain, _ = timed(ag.compare, model, x, path=p)
            wrapped, rep = timed(ag.compare, Wrapper(model), x, path=p)
            counts = rep.counts()
            with torch.no_grad():
                model.layers[-1].weight.mul_(1.01)
            late, _ = timed(ag.compare, model, x, path=p, fail_fast=True)
            rows.append((n, plain, wrapped, late, counts))
    print(f"{'layers':>7} {'plain':>9} {'wrapper':>9} {'fail_fast':>9} {'wrapper/plain':>14}  counts (wrapper)")
    for n, plain, wrapped, late, counts in rows:
        print(f"{n:>7} {plain:>8.2f}s {wrapped:>8.2f}s {late:>8.2f}s {wrapped / plain:>13.2f}x  {counts}")
    if len(rows) > 1:
        (n0, _, w0, _, _), (n1, _, w1, _, _) = rows[0], rows[-1]
        print(f"per-layer wrapper cost grows {w1 / n1 / (w0 / n0):.2f}x from {n0} to {n1} layers (1.0 = linear)")


if __name__ == "__main__":
    main()

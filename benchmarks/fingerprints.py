#!/usr/bin/env python
"""Fingerprint goldens next to full goldens, side by side in one process.

For each workload: the plain forward, ``record`` and ``compare`` with full goldens and with
``fingerprint=True``, interleaved and repeated (medians), plus the fingerprint kernel alone (every
fingerprinted output of one forward, fingerprinted outside any hook) so the kernel's share of the
record time is visible. Printed: golden sizes and their ratio, each time as a multiple of the
plain forward, and fingerprint vs full for record and compare. A recording with fingerprints is
timed both ways (``ACTIVATION_GUARD_FINGERPRINT_WORKER``): the kernel inline in the hooks, and on
the worker thread beside the forward, with the process CPU time of each (the worker's second core
shows there); the target line uses what ``auto`` picks under the chosen thread count.

Workloads: ``wide`` (benchmarks/run.py's: 48 x (Linear 512->512 + ReLU) on 1024 rows) and a
GPT-2-small-shaped model (``transformers.GPT2Config()`` defaults: 12 layers, hidden 768, random
weights) on 128 tokens. ``--quick`` runs tiny sizes and skips GPT-2 (importing transformers alone
takes seconds). Called by ``benchmarks/run.py`` (section ``fingerprint``) or on its own::

    python benchmarks/fingerprints.py [--quick] [--repeat N] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

try:
    import resource
except ImportError:  # Windows: no page-fault counts
    resource = None  # type: ignore[assignment]

import torch

import activation_guard as ag
from activation_guard._core import native
from activation_guard.fingerprints import worker as fingerprint_worker
from activation_guard.fingerprints.fingerprint import FingerprintParams, compute_fingerprint, should_fingerprint
from activation_guard.values.leaves import flatten

SIZE_TARGET = 0.01  # golden with fingerprints <= 1% of the full golden
TIME_TARGET = 1.3  # record with fingerprints <= 1.3x the plain forward


def gpt2_small(quick: bool) -> tuple[str, torch.nn.Module, tuple[Any, ...], str]:
    from transformers import GPT2Config, GPT2Model, logging  # imported only here: seconds

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4) if quick else GPT2Config()
    tokens = 16 if quick else 128
    model = GPT2Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    return ("gpt2", model, (ids,),
            f"GPT2Model from GPT2Config() ({cfg.n_layer} layers, hidden {cfg.n_embd}, random weights), "
            f"{tokens} tokens")


def _outputs(model: torch.nn.Module, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """Copies of every output tensor a recording with fingerprints would fingerprint."""
    got: list[torch.Tensor] = []

    def hook(_m: Any, _i: Any, out: Any) -> None:
        got.extend(leaf.tensor.clone() for leaf in flatten(out)
                   if leaf.kind == "tensor" and leaf.tensor is not None and should_fingerprint(leaf.tensor))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return got


def _worker(mode: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the fingerprint worker switched ``on`` or ``off``."""
    def run() -> Any:
        with mock.patch.dict(os.environ, {fingerprint_worker.ENV: mode}):
            return fn()
    return run


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _interleaved(ops: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median wall seconds per op, its median process CPU seconds under ``"<op> cpu"`` and its
    median minor page faults under ``"<op> faults"`` (docs/performance.md, "ninth session: page
    faults": what ran before an op can make it fault, the forward not); each repetition rotates
    the order (records before compares)."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    cpu: dict[str, list[float]] = {k: [] for k in ops}
    faults: dict[str, list[float]] = {k: [] for k in ops}
    names = list(ops)
    records = [n for n in names if not n.startswith("compare")]
    compares = [n for n in names if n.startswith("compare")]
    for r in range(repeat):
        for phase in (records, compares):
            k = r % len(phase)
            for name in phase[k:] + phase[:k]:
                f0, t0, c0 = _minor_faults(), time.perf_counter(), time.process_time()
                ops[name]()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                faults[name].append(_minor_faults() - f0)
    return {**{k: statistics.median(v) for k, v in times.items()},
            **{f"{k} cpu": statistics.median(v) for k, v in cpu.items()},
            **{f"{k} faults": statistics.median(v) for k, v in faults.items()}}


def measure(name: str, model: torch.nn.Module, args: tuple[Any, ...], d: str, repeat: int) -> dict[str, Any]:
    full, fp = os.path.join(d, f"{name}.full.h5"), os.path.join(d, f"{name}.fp.h5")
    s_full = ag.record(model, args, path=full)
    s_fp = ag.record(model, args, path=fp, fingerprint=True)
    for p in (full, fp):  # warm every path, and never time a failing compare
        rep = ag.compare(model, args, path=p)
        if not rep.ok:
            raise RuntimeError(f"{name}: compare against its own fresh golden {p} failed:\n{rep}")
    leaves = _outputs(model, args)
    params = FingerprintParams()

    def forward() -> None:
        with torch.no_grad():
            model(*args)

    def kernel() -> None:
        for t in leaves:
            compute_fingerprint(t, params)

    def kernel_torch() -> None:  # the same, with the compiled pass switched off (native.py)
        with mock.patch.object(native, "get", return_value=None):
            kernel()

    med = _interleaved({
        "forward": forward,
        "kernel": kernel,
        "kernel torch": kernel_torch,
        "record full": lambda: ag.record(model, args, path=full),
        "record fp inline": _worker("off", lambda: ag.record(model, args, path=fp, fingerprint=True)),
        "record fp worker": _worker("on", lambda: ag.record(model, args, path=fp, fingerprint=True)),
        "compare full": lambda: ag.compare(model, args, path=full),
        "compare fp": lambda: ag.compare(model, args, path=fp),
    }, repeat)
    auto = "worker" if fingerprint_worker.wanted() else "inline"
    med["record fp"] = med[f"record fp {auto}"]
    return {**med, "auto": auto, "pass": native.status(), "full_bytes": s_full.file_bytes, "fp_bytes": s_fp.file_bytes,
            "layer_calls": s_fp.layer_calls, "outputs": s_fp.leaves, "fingerprints": s_fp.fingerprints,
            "raw_bytes": s_full.nbytes,
            "elements": sum(t.numel() for t in leaves)}


def report(out: Callable[[str], None], name: str, note: str, r: dict[str, Any],
           targets: list[tuple[str, str, bool]]) -> None:
    fwd = r["forward"]
    out(f"\n== fingerprints, {name}: {note}")
    out(f"   {r['layer_calls']} layer calls, {r['outputs']} stored values ({r['fingerprints']} fingerprinted, "
        f"{r['elements'] / 1e6:.1f} M elements), {r['raw_bytes'] / 1e6:.1f} MB of activations")
    size = r["fp_bytes"] / r["full_bytes"]
    out(f"   golden size      full {r['full_bytes'] / 1e6:9.2f} MB   fingerprints {r['fp_bytes'] / 1e6:9.3f} MB   "
        f"= {size:.2%} of full")
    out(f"   {'':16} {'full':>10} {'fingerprints':>13} {'fp / full':>10}")
    for op in ("record", "compare"):
        a, b = r[f"{op} full"], r[f"{op} fp"]
        out(f"   {op:<16} {a * 1e3:7.1f} ms {b * 1e3:10.1f} ms {b / a:9.2f}x   "
            f"(x forward: full {a / fwd:.2f}x, fingerprints {b / fwd:.2f}x)")
    inl, wrk, ci, cw = (r[k] * 1e3 for k in ("record fp inline", "record fp worker", "record fp inline cpu",
                                              "record fp worker cpu"))
    f = fwd * 1e3
    out(f"   fp record inline {inl:7.1f} ms = {inl / f:.2f}x forward (CPU {ci:.0f} ms);  on the worker "
        f"{wrk:.1f} ms = {wrk / f:.2f}x (CPU {cw:.0f} ms);  auto: {r['auto']}")
    if resource is not None:
        out(f"   page faults      per run (median): forward {r['forward faults']:.0f}, fp record inline "
            f"{r['record fp inline faults']:.0f}, on the worker {r['record fp worker faults']:.0f}")
    out(f"   forward          {fwd * 1e3:7.1f} ms;  fingerprint kernel alone {r['kernel'] * 1e3:.1f} ms "
        f"= {r['kernel'] / fwd:.2f}x forward ({r['kernel'] / max(r['elements'], 1) * 1e9:.1f} ns per element)")
    out(f"   kernel pass      {r['pass']};  torch ops {r['kernel torch'] * 1e3:.1f} ms = "
        f"{r['kernel torch'] / fwd:.2f}x forward, {r['kernel torch'] / r['kernel']:.2f}x the kernel's time")
    targets.append((f"{name}: fingerprint golden <= {SIZE_TARGET:.0%} of full", f"{size:.2%}", size <= SIZE_TARGET))
    q = r["record fp"] / fwd
    targets.append((f"{name}: record with fingerprints <= {TIME_TARGET:g}x the plain forward", f"{q:.2f}x",
                    q <= TIME_TARGET))


def run(out: Callable[[str], None], targets: list[tuple[str, str, bool]], quick: bool, repeat: int,
        d: str, wide: Callable[[bool], Any]) -> dict[str, Any]:
    """The fingerprint section of benchmarks/run.py: prints, appends targets, returns figures.
    ``wide`` builds run.py's workload of that name, so the figures describe the same model."""
    results: dict[str, Any] = {}
    w = wide(quick)
    results["wide"] = measure("wide", w.model, w.args, d, repeat)
    report(out, "wide", w.note, results["wide"], targets)
    if quick:
        out("\n== fingerprints, gpt2: skipped with --quick (importing transformers alone takes ~5 s)")
        return results
    try:
        name, model, args, note = gpt2_small(quick)
    except ImportError:
        out("\n== fingerprints, gpt2: skipped (transformers is not installed)")
        return results
    results[name] = measure(name, model, args, d, repeat)
    report(out, name, note, results[name], targets)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition, no GPT-2")
    ap.add_argument("--repeat", type=int, default=None, help="repetitions (median reported); default 5")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from run import wide

    targets: list[tuple[str, str, bool]] = []
    d = tempfile.mkdtemp(prefix="ag-bench-fp-")
    try:
        print(f"torch {torch.__version__}, {a.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
        run(print, targets, a.quick, a.repeat or (1 if a.quick else 5), d, wide)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    for name, val, ok in targets:
        print(f"   [{'met ' if ok else 'MISS'}] {name}: {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

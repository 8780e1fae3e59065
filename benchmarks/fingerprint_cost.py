#!/usr/bin/env python
"""What a fingerprint costs next to keeping the bytes: time and size, side by side in one run.

For float32 tensors of 1 KB to 100 MB this prints, per size, the median time of
``compute_fingerprint``, of a plain ``clone`` (one memory copy) and of writing the raw bytes to a
file (``tofile``, page cache, no fsync), measured interleaved and repeated because the machines
this runs on are shared; and the fingerprint's stored size against the raw size. With
``--model`` it also records a GPT-2-small-shaped model (random weights, from config; needs
``transformers``) both ways: a plain forward, and a forward whose hook fingerprints every
floating output leaf larger than a fingerprint (clones the rest), the issue's target being at
most 1.3x the plain forward.

    python benchmarks/fingerprint_cost.py [--quick] [--model] [--threads N] [--repeats N] [--rows R --buckets B]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activation_guard.fingerprints.fingerprint import FingerprintParams, compute_fingerprint, should_fingerprint

SIZES = [1_000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000]  # bytes of float32


def _interleaved(ops: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per op; ops alternate within each repeat so load spikes hit all alike."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for f in ops.values():
        f()  # warm up (allocator, hash cache)
    for _ in range(repeats):
        for name, f in ops.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _stored_bytes(fp: Any) -> int:
    arrays, meta = fp.to_arrays()
    return sum(a.nbytes for a in arrays.values()) + len(json.dumps(meta))


def tensors_table(sizes: list[int], repeats: int, params: FingerprintParams) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raw.bin")
        for nbytes in sizes:
            x = torch.randn(max(1, nbytes // 4))
            arr = x.numpy()
            med = _interleaved({
                "fingerprint": lambda x=x: compute_fingerprint(x, params),
                "clone": lambda x=x: x.clone(),
                "write": lambda arr=arr: arr.tofile(path),
            }, repeats)
            fp = compute_fingerprint(x, params)
            rows.append({"bytes": x.numel() * 4, "numel": x.numel(), **med, "fp_bytes": _stored_bytes(fp),
                         "worth_it": should_fingerprint(x, params)})
    return rows


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} TB"


def print_tensors(rows: list[dict[str, Any]]) -> None:
    print(f"{'raw size':>9} | {'fingerprint':>11} {'ns/elem':>7} | {'clone':>9} | {'write':>9} | "
          f"{'fp/clone':>8} {'fp/write':>8} | {'fp size':>8} {'fp/raw':>7}")
    for r in rows:
        n = r["numel"]
        print(f"{_fmt_bytes(r['bytes']):>9} | {r['fingerprint'] * 1e3:>8.3f} ms {r['fingerprint'] / n * 1e9:>7.2f} | "
              f"{r['clone'] * 1e3:>6.3f} ms | {r['write'] * 1e3:>6.3f} ms | "
              f"{r['fingerprint'] / r['clone']:>8.1f} {r['fingerprint'] / r['write']:>8.2f} | "
              f"{_fmt_bytes(r['fp_bytes']):>8} {r['fp_bytes'] / r['bytes']:>7.2%}"
              + ("" if r["worth_it"] else "  (kept exactly: raw is smaller)"))


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _leaves(o)]
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        values = out.values() if isinstance(out, dict) else out.to_tuple()
        return [t for o in values for t in _leaves(o)]
    return []


def model_table(repeats: int, params: FingerprintParams) -> dict[str, Any] | None:
    try:
        import transformers
    except ImportError:
        print("(transformers is not installed: no model row)")
        return None
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config()).eval()
    ids = torch.randint(0, 50257, (1, 128))
    counts = {"elements": 0, "leaves": 0, "raw": 0, "fp": 0}
    mode = {"on": False, "count": False}

    def hook(_m: Any, _i: Any, out: Any) -> None:
        if not mode["on"]:
            return
        for t in _leaves(out):
            if not t.is_floating_point():
                continue
            if should_fingerprint(t, params):
                fp = compute_fingerprint(t, params)
                if mode["count"]:
                    counts["elements"] += t.numel()
                    counts["leaves"] += 1
                    counts["raw"] += t.numel() * t.element_size()
                    counts["fp"] += _stored_bytes(fp)
            else:
                t.detach().clone()
                if mode["count"]:
                    counts["raw"] += t.numel() * t.element_size()
                    counts["fp"] += t.numel() * t.element_size()

    for m in model.modules():
        m.register_forward_hook(hook)

    def plain() -> None:
        mode["on"] = False
        with torch.no_grad():
            model(ids)

    def fingerprinted() -> None:
        mode["on"] = True
        with torch.no_grad():
            model(ids)
        mode["on"] = False

    mode["count"] = True
    fingerprinted()
    mode["count"] = False
    med = _interleaved({"forward": plain, "forward + fingerprints": fingerprinted}, repeats)
    return {**med, **counts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes up to 1 MB, few repeats (seconds)")
    ap.add_argument("--model", action="store_true", help="also time a GPT-2-small-shaped forward (minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--rows", type=int, default=FingerprintParams.rows, help="sketch rows R")
    ap.add_argument("--buckets", type=int, default=FingerprintParams.buckets, help="sketch buckets B")
    ap.add_argument("--no-sizes", action="store_true", help="skip the per-size table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = FingerprintParams(rows=args.rows, buckets=args.buckets)
    sizes = SIZES[:4] if args.quick else SIZES
    repeats = args.repeats or (3 if args.quick else 7)
    print(f"torch {torch.__version__}, {args.threads} thread(s); fingerprint: {params.rows} rows x {params.buckets} "
          f"buckets, {params.samples} samples, threshold {params.multiplier:.3f} x bound, "
          f"false alarm <= {params.false_alarm_bound:.2g}; medians of {repeats} interleaved repeats, float32")
    if not args.no_sizes:
        print_tensors(tensors_table(sizes, repeats, params))
    if args.model:
        r = model_table(max(3, repeats // 2), params)
        if r is not None:
            print(f"\nGPT-2 small shape, 128 tokens, random weights: forward {r['forward'] * 1e3:.0f} ms, forward + "
                  f"fingerprints {r['forward + fingerprints'] * 1e3:.0f} ms = "
                  f"{r['forward + fingerprints'] / r['forward']:.2f}x ({r['leaves']} leaves fingerprinted, "
                  f"{r['elements'] / 1e6:.1f} M elements); golden {_fmt_bytes(r['fp'])} vs {_fmt_bytes(r['raw'])} raw "
                  f"({r['fp'] / r['raw']:.2%})")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())

#!/usr/bin/env python
"""activation_guard benchmark: record/compare cost against the physical limit, the peer, memory.

Run ``python benchmarks/run.py`` (a few minutes) or ``nox -s bench``; ``--quick`` runs tiny sizes
in seconds (the test suite's smoke run). Everything is measured side by side in one process,
interleaved and repeated, and medians are reported, because the 2-core machines this project
runs on are shared and single timings are noise.

What is compared (see docs/performance.md for the reasoning and the recorded output):

- ``forward``        plain ``model(*args)`` under ``no_grad``.
- ``limit record``   forward with a hook per module that clones every output tensor, then one
                     sequential ``tofile`` of all bytes and an ``fsync`` (the golden write is
                     durable too), no compression: what recording cannot beat.
- ``limit compare``  forward with a hook per module that reads that output's bytes from the flat
                     file (one sequential pass, reused buffer) and computes ``|live - golden|.max()``
                     in cache-sized chunks: what checking cannot beat.
- ``peer``           pytest-regressions' ``ndarrays_regression`` storing and checking the same
                     captured arrays (what a user writes by hand today).

Peak memory is measured in a fresh subprocess per operation, from Linux's peak-RSS counter
(``VmHWM``, reset through ``/proc/self/clear_refs`` before each phase).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fingerprints import run as run_fingerprints  # benchmarks/fingerprints.py: the figures

import activation_guard as ag

CHUNK = 1 << 18  # elements per step of the limit's max-abs-diff kernel (1 MB of float32)
MB = 1e6


# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def forward(self) -> Any:
        with torch.no_grad():
            return self.model(*self.args, **self.kwargs)


def mlp(blocks: int, width: int, rows: int, relu: bool = True, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """``blocks`` x (Linear(width, width) [+ ReLU]) as one Sequential, and its input."""
    g = torch.Generator().manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        lin = torch.nn.Linear(width, width)
        with torch.no_grad():
            # keep activations O(1) through depth, so values stay finite and representative
            lin.weight.copy_(torch.randn(width, width, generator=g) / width**0.5)
            lin.bias.copy_(torch.randn(width, generator=g) * 0.1)
        layers.append(lin)
        if relu:
            layers.append(torch.nn.ReLU())
    x = torch.randn(rows, width, generator=g)
    return torch.nn.Sequential(*layers).eval(), x


def wide(quick: bool) -> Workload:
    blocks, rows = (4, 64) if quick else (48, 1024)
    width = 64 if quick else 512
    m, x = mlp(blocks, width, rows)
    return Workload("wide", m, (x,), note=f"{blocks} x (Linear {width}->{width} + ReLU) on {rows} rows")


def deep(quick: bool, layers: int | None = None) -> Workload:
    n = layers if layers is not None else (60 if quick else 1500)
    m, x = mlp(n, 8, 4, relu=False)
    return Workload(f"deep{'' if layers is None else n}", m, (x,), note=f"{n} x Linear 8->8 on 4 rows")


def transformer() -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM  # imported only here: ~5 s

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(1))
    return Workload("llama", m, (ids,),
                    note="tiny LlamaForCausalLM from a config: 4 layers, hidden 128, batch 4 x 128 tokens")


def bytes_workload(total_bytes: float) -> Workload:
    """8 x (Linear 64->64 + ReLU): 17 outputs of equal size adding up to ``total_bytes``."""
    rows = max(1, int(total_bytes / (17 * 64 * 4)))
    m, x = mlp(8, 64, rows)
    return Workload(f"bytes{total_bytes / MB:g}MB", m, (x,), note=f"8 x (Linear 64->64 + ReLU) on {rows} rows")


def memory_spec(quick: bool) -> dict[str, int]:
    """The >= 1 GB workload of the peak-memory figure: 64 x (Linear 64->64 + ReLU), 8 MB outputs."""
    return {"blocks": 64, "width": 64, "rows": 512 if quick else 32768}


# --------------------------------------------------------------------------- baselines


def tensors_of(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_of(v, out)
    elif isinstance(obj, dict):  # includes Hugging Face ModelOutput
        for v in obj.values():
            tensors_of(v, out)
    return out


def _raw(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


class _Hooks:
    """Post-forward hooks on every module (the minimum a layer-level tool must install)."""

    def __init__(self, model: torch.nn.Module, fn: Callable[[str, Any], None]):
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_hook(lambda m, a, o, _n=name: fn(_n, o)))

    def __enter__(self) -> _Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()


def limit_record(w: Workload, path: str) -> None:
    saved: list[torch.Tensor] = []

    def grab(name: str, out: Any) -> None:
        for t in tensors_of(out, []):
            saved.append(t.detach().clone())  # clone: the only way to survive later in-place ops

    with _Hooks(w.model, grab):
        w.forward()
    with open(path, "wb") as f:
        for t in saved:
            _raw(t).tofile(f)
        f.flush()
        os.fsync(f.fileno())


def absmax(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in cache-sized chunks (sub, abs and max in cache: about one pass over memory)."""
    a, b = a.reshape(-1), b.reshape(-1)
    m = 0.0
    for i in range(0, a.numel(), CHUNK):
        m = max(m, float((a[i : i + CHUNK] - b[i : i + CHUNK]).abs().max()))
    return m


def limit_compare(w: Workload, path: str) -> float:
    worst = [0.0]
    buf = [np.empty(0, np.uint8)]
    with open(path, "rb", buffering=0) as f:

        def check(name: str, out: Any) -> None:
            for t in tensors_of(out, []):
                t = t.detach()
                n = t.numel() * t.element_size()
                if buf[0].size < n:
                    buf[0] = np.empty(n, np.uint8)
                view = buf[0][:n]
                if f.readinto(memoryview(view)) != n:
                    raise RuntimeError("limit file shorter than the activations")
                if n == 0:
                    continue
                g = torch.from_numpy(view).view(t.dtype).reshape(t.shape)
                if t.is_floating_point() or t.is_complex():
                    worst[0] = max(worst[0], absmax(t, g))
                elif not torch.equal(t, g):
                    worst[0] = float("inf")

        with _Hooks(w.model, check):
            w.forward()
    if worst[0] != 0.0:
        raise RuntimeError(f"limit compare saw a difference ({worst[0]}): the model is not deterministic")
    return worst[0]


def _peer_fixture(datadir: Path, name: str) -> Any:
    from pytest_regressions.ndarrays_regression import NDArraysRegressionFixture

    request = types.SimpleNamespace(config=types.SimpleNamespace(getoption=lambda opt: False),
                                    node=types.SimpleNamespace(name=name, cls=None))
    return NDArraysRegressionFixture(datadir, datadir, request)  # type: ignore[arg-type]


def _peer_capture(w: Workload) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    calls: dict[str, int] = {}

    def grab(name: str, out: Any) -> None:
        k = calls.get(name, 0)
        calls[name] = k + 1
        for i, t in enumerate(tensors_of(out, [])):
            t = t.detach().cpu()
            if t.dtype == torch.bfloat16:
                t = t.float()
            arrays[f"{name or 'root'}.{k}.{i}"] = t.numpy().copy()

    with _Hooks(w.model, grab):
        w.forward()
    return arrays


def peer_record(w: Workload, path: str) -> None:
    import pytest

    if os.path.exists(path):
        os.unlink(path)
    fx = _peer_fixture(Path(path).parent, f"bench_{w.name}")
    try:
        fx.check(_peer_capture(w), fullpath=path)
    except pytest.fail.Exception:  # first run: "File not found in data directory, created"
        return
    raise RuntimeError("ndarrays_regression did not create its file")


def peer_check(w: Workload, path: str) -> None:
    fx = _peer_fixture(Path(path).parent, f"bench_{w.name}")
    fx.check(_peer_capture(w), fullpath=path, default_tolerance={"rtol": 1.3e-6, "atol": 1e-5})


# --------------------------------------------------------------------------- timing


def _time(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process). CPU time does not count waiting for a core
    that another process holds, nor waiting for the disk (fsync), so it is the steadier view of
    the work done on a shared machine, and the wall time the honest one."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def interleaved(variants: dict[str, Callable[[], Any]], repeat: int, phases: Iterable[Iterable[str]]) -> dict[str, Any]:
    """Median seconds per variant, and under ``"best"`` the fastest run of each (contention only
    ever adds time, so best-of-N is the least disturbed view). Each repetition runs every phase
    in order (records before the compares that read their files) and rotates the order inside a
    phase, so slow spells of a shared machine spread over all variants instead of hitting one."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    phase_list = [list(p) for p in phases]
    for r in range(repeat):
        for phase in phase_list:
            k = r % len(phase)
            for name in phase[k:] + phase[:k]:
                wall, c = _time(variants[name])
                times[name].append(wall)
                cpu[name].append(c)
    res: dict[str, Any] = {k: statistics.median(v) for k, v in times.items() if v}
    res["best"] = {k: min(v) for k, v in times.items() if v}
    res["cpu"] = {k: statistics.median(v) for k, v in cpu.items() if v}
    return res


def run_workload(w: Workload, d: str, repeat: int, peer_repeat: int = 0, comp_repeat: int = 0) -> dict[str, Any]:
    """Time one workload: forward, limits and activation_guard (``repeat`` times); then, each in
    its own interleaved set that re-times the forward and activation_guard alongside so their
    ratios come from the same minutes, the peer and the compression options."""
    p_ag, p_lim, p_peer = (os.path.join(d, f"{w.name}.{ext}") for ext in ("h5", "bin", "npz"))
    summary = ag.record(w.model, w.args, w.kwargs, path=p_ag)  # also warms up every code path
    limit_record(w, p_lim)
    limit_compare(w, p_lim)
    rep = ag.compare(w.model, w.args, w.kwargs, path=p_ag)
    if not rep.ok:
        raise RuntimeError(f"{w.name}: compare against its own fresh golden failed:\n{rep}")
    variants: dict[str, Callable[[], Any]] = {
        "forward": w.forward,
        "limit record": lambda: limit_record(w, p_lim),
        "record": lambda: ag.record(w.model, w.args, w.kwargs, path=p_ag),
        "limit compare": lambda: limit_compare(w, p_lim),
        "compare": lambda: ag.compare(w.model, w.args, w.kwargs, path=p_ag),
    }
    res: dict[str, Any] = interleaved(variants, repeat,
                                      [["forward", "limit record", "record"], ["limit compare", "compare"]])
    if peer_repeat:
        variants["peer record"] = lambda: peer_record(w, p_peer)
        variants["peer check"] = lambda: peer_check(w, p_peer)
        res["peer"] = interleaved(variants, peer_repeat,
                                  [["forward", "record", "peer record"], ["compare", "peer check"]])
        res["peer"]["file_bytes"] = os.path.getsize(p_peer)
    if comp_repeat:
        sizes = {}
        for c in ("gzip", "lzf"):
            pc = os.path.join(d, f"{w.name}.{c}.h5")
            sizes[c] = ag.record(w.model, w.args, w.kwargs, path=pc, compression=c).file_bytes
            variants[f"record {c}"] = lambda pc=pc, c=c: ag.record(w.model, w.args, w.kwargs, path=pc, compression=c)
            variants[f"compare {c}"] = lambda pc=pc: ag.compare(w.model, w.args, w.kwargs, path=pc)
        res["compression"] = interleaved(variants, comp_repeat, [["record", "record gzip", "record lzf"],
                                                                 ["compare", "compare gzip", "compare lzf"]])
        res["compression"]["file_bytes"] = sizes
    res["layer_calls"] = summary.layer_calls
    res["leaves"] = summary.leaves
    res["nbytes"] = summary.nbytes
    res["file_bytes"] = summary.file_bytes
    res["largest_leaf_bytes"] = _largest_leaf(p_ag)
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    return res


def _largest_leaf(path: str) -> int:
    with ag.read_golden(path) as g:
        return max((leaf.nbytes for c in g.calls for leaf in c.leaves), default=0)


# --------------------------------------------------------------------------- peak memory (child)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: for each op in ``spec["ops"]``, the peak RSS of a plain forward and
    then of that op, each phase starting from a reset peak counter."""
    torch.set_num_threads(int(spec["threads"]))
    m, x = mlp(spec["blocks"], spec["width"], spec["rows"])
    w = Workload("mem", m, (x,))
    res: dict[str, Any] = {}
    for op in spec["ops"]:
        out: dict[str, Any] = {"clean": _reset_peak()}  # False: no clear_refs, peaks are cumulative
        w.forward()
        out["forward_peak"] = _status_kb("VmHWM") * 1024
        out["clean"] &= _reset_peak()
        if op == "record":
            s = ag.record(w.model, w.args, path=spec["path"])
            res["total_bytes"], res["layer_calls"] = s.nbytes, s.layer_calls
        else:
            r = ag.compare(w.model, w.args, path=spec["path"])
            if not r.ok:
                raise SystemExit(f"memory workload compare failed:\n{r}")
        out["op_peak"] = _status_kb("VmHWM") * 1024
        res[op] = out
    return res


def measure_memory(quick: bool, d: str, threads: int) -> dict[str, Any]:
    """A fresh process per operation (so neither inherits the other's heap); with --quick one
    process does both, to keep the smoke run short."""
    spec = dict(memory_spec(quick), threads=threads, path=os.path.join(d, "mem.h5"))
    res: dict[str, Any] = {"spec": {k: spec[k] for k in ("blocks", "width", "rows")}, "fresh_process_per_op": not quick}
    for ops in ([["record", "compare"]] if quick else [["record"], ["compare"]]):
        cp = subprocess.run([sys.executable, __file__, "--rss-child", json.dumps(dict(spec, ops=ops))],
                            capture_output=True, text=True, check=False)
        if cp.returncode != 0:
            raise RuntimeError(f"memory child ({ops}) failed:\n{cp.stdout}\n{cp.stderr}")
        res.update(json.loads(cp.stdout.strip().splitlines()[-1]))
    res["largest_leaf_bytes"] = _largest_leaf(spec["path"])
    os.unlink(spec["path"])
    return res


# --------------------------------------------------------------------------- report


def fmt_s(s: float) -> str:
    return f"{s * 1e3:9.1f} ms" if s < 10 else f"{s:9.2f} s "


class Out:
    """Prints and keeps the lines, so docs/performance.md can quote them verbatim."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, s: str = "") -> None:
        self.lines.append(s)
        print(s, flush=True)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def report_workload(out: Out, w: Workload, r: dict[str, Any], targets: list[tuple[str, str, bool]],
                    limit_target: float) -> None:
    out(f"\n== {w.name}: {w.note}")
    out(f"   {r['layer_calls']} layer calls, {r['leaves']} outputs, {r['nbytes'] / MB:.1f} MB of activations, "
        f"largest output {r['largest_leaf_bytes'] / MB:.2f} MB")
    best, cpu = r["best"], r["cpu"]
    for k in ("forward", "limit record", "record", "limit compare", "compare"):
        extra = (f"  = {_ratio(r[k], r['limit ' + k]):.2f}x limit "
                 f"(best runs {_ratio(best[k], best['limit ' + k]):.2f}x, "
                 f"CPU time {_ratio(cpu[k], cpu['limit ' + k]):.2f}x)" if k in ("record", "compare") else "")
        out(f"   {k:<16}{fmt_s(r[k])}{extra}")
    calls, fwd = r["layer_calls"], r["forward"]
    out(f"   per layer call above the forward: record {(r['record'] - fwd) / calls * 1e6:.1f} us "
        f"(limit {(r['limit record'] - fwd) / calls * 1e6:.1f}), compare {(r['compare'] - fwd) / calls * 1e6:.1f} us "
        f"(limit {(r['limit compare'] - fwd) / calls * 1e6:.1f})")
    cf = cpu["forward"]
    out(f"   ... in CPU time (steadier on a shared machine): record {(cpu['record'] - cf) / calls * 1e6:.1f} us "
        f"(limit {(cpu['limit record'] - cf) / calls * 1e6:.1f}), compare {(cpu['compare'] - cf) / calls * 1e6:.1f} us "
        f"(limit {(cpu['limit compare'] - cf) / calls * 1e6:.1f})")
    out(f"   golden {r['file_bytes'] / MB:.2f} MB = {_ratio(r['file_bytes'], r['nbytes']):.3f}x raw bytes")
    for op in ("record", "compare"):
        q = _ratio(r[op], r["limit " + op])
        targets.append((f"{w.name}: {op} <= {limit_target:g}x its limit", f"{q:.2f}x", q <= limit_target))
    if "peer" in r:
        pr = r["peer"]
        out(f"   peer (pytest-regressions ndarrays_regression, .npz {pr['file_bytes'] / MB:.2f} MB), timed alongside "
            f"forward {fmt_s(pr['forward']).strip()}, record {fmt_s(pr['record']).strip()}, "
            f"compare {fmt_s(pr['compare']).strip()}:")
        for k, op in (("peer record", "record"), ("peer check", "compare")):
            total = _ratio(pr[k], pr[op])
            above = _ratio(pr[k] - pr["forward"], pr[op] - pr["forward"])
            out(f"   {k:<16}{fmt_s(pr[k])}  = {total:.1f}x activation_guard's {op}; "
                f"cost above the forward {above:.1f}x")
            targets.append((f"{w.name}: >= 10x faster than the peer ({op}, cost above the forward)", f"{above:.1f}x",
                            above >= 10))
    if "compression" in r:
        cr = r["compression"]
        for c in ("gzip", "lzf"):
            size = cr["file_bytes"][c]
            out(f"   compression={c}: {size / MB:.2f} MB = {_ratio(size, r['nbytes']):.3f}x raw; "
                f"record {fmt_s(cr['record ' + c]).strip()} = {_ratio(cr['record ' + c], cr['record']):.2f}x, "
                f"compare {fmt_s(cr['compare ' + c]).strip()} = {_ratio(cr['compare ' + c], cr['compare']):.2f}x "
                "the uncompressed time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition: a smoke run in seconds")
    ap.add_argument("--repeat", type=int, default=None,
                    help="repetitions per timing (median reported); default 5, 1 with --quick")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-core machine OpenMP regions "
                         "wait for a busy core and small ops slow down up to 100x; see docs/performance.md)")
    ap.add_argument("--only", default="",
                    help="comma-separated sections: wide,deep,llama,layers,bytes,memory,fingerprint")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--workdir", default=None, help="where goldens are written (default: a temporary folder)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rss_child:
        spec = json.loads(a.rss_child)
        print(json.dumps(rss_child(spec)))
        return 0

    torch.set_num_threads(a.threads)
    quick = a.quick
    repeat = a.repeat or (1 if quick else 5)
    peer_repeat = comp_repeat = 1 if quick else max(1, min(3, repeat))
    only = {s.strip() for s in a.only.split(",") if s.strip()}

    def want(section: str) -> bool:
        return not only or section in only

    out = Out()
    results: dict[str, Any] = {"quick": quick, "repeat": repeat, "threads": a.threads}
    targets: list[tuple[str, str, bool]] = []
    d = tempfile.mkdtemp(prefix="ag-bench-", dir=a.workdir)
    t_start = time.perf_counter()
    try:
        out(f"activation_guard {ag.__version__} "
            f"benchmark{' (--quick: tiny sizes, timings meaningless)' if quick else ''}")
        out(f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
            f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch threads {a.threads}, "
            f"repeat {repeat} (medians), load average at start {os.getloadavg()[0]:.2f}")

        workloads: list[tuple[Workload, float, bool]] = []
        if want("wide"):
            workloads.append((wide(quick), 1.5, True))
        if want("deep"):
            workloads.append((deep(quick), 2.0, False))
        if want("llama") and not quick:
            workloads.append((transformer(), 2.0, False))
        elif want("llama"):
            out("\n== llama: skipped with --quick (importing transformers alone takes ~5 s)")
        for w, lim, comp in workloads:
            # the small workloads are cheap: more repetitions steady their medians
            r = run_workload(w, d, repeat if w.name == "wide" else 2 * repeat + 1, peer_repeat,
                             comp_repeat if comp else 0)
            results[w.name] = r
            report_workload(out, w, r, targets, lim)
            if w.name == "deep":
                fixed = max(r["record"] - r["forward"], r["compare"] - r["forward"]) / r["layer_calls"] * 1e6
                targets.append(("deep: fixed cost <= 60 us per layer call", f"{fixed:.1f} us", fixed <= 60))
                for op in ("record", "compare"):  # the per-layer target
                    per = (r[op] - r["forward"]) / r["layer_calls"] * 1e6
                    targets.append((f"deep: {op} <= 30 us per layer call above the forward",
                                    f"{per:.1f} us", per <= 30))
            if w.name == "wide":
                q = _ratio(r["file_bytes"], r["nbytes"])
                targets.append(("wide: golden <= 1.05x raw bytes", f"{q:.3f}x", q <= 1.05))

        if want("layers"):
            counts = (10, 50, 200) if quick else (100, 1000, 10000)
            cols = ("forward", "record", "compare", "limit record", "limit compare")
            out("\n== scaling with layers: N x Linear 8->8 on 4 rows (whole operation, ms)")
            out(f"   {'calls':>8} " + " ".join(f"{k:>13}" for k in cols))
            runs: list[dict[str, Any]] = []
            for n in counts:
                r = run_workload(deep(quick, n), d, max(1, repeat - 2) if n >= 10000 else repeat)
                runs.append(r)
                results[f"layers_{n}"] = r
                out(f"   {r['layer_calls']:>8} " + " ".join(f"{r[k] * 1e3:>13.1f}" for k in cols))
            # linear = a constant cost per added layer: compare the slope over each decade
            for op in ("record", "compare"):
                slopes = [(b[op] - a[op]) / (b["layer_calls"] - a["layer_calls"]) * 1e6 for a, b in zip(runs, runs[1:])]
                g = slopes[-1] / slopes[0] if slopes[0] > 0 else math.nan  # nan: noise swamped the first step
                out(f"   {op}: us per added layer call " + ", ".join(f"{x:.1f}" for x in slopes)
                    + f" ({counts[0]}->{counts[1]}, ...); last/first = {g:.2f}")
                targets.append((f"linear in layers ({op}: us per added layer, "
                                f"{counts[-2]}->{counts[-1]} vs {counts[0]}->{counts[1]})",
                                f"{g:.2f}x", 0.67 <= g <= 1.5))

        if want("bytes"):
            sizes = (0.1 * MB, 1 * MB, 3 * MB) if quick else (10 * MB, 100 * MB, 1000 * MB)
            out("\n== scaling with bytes: 8 x (Linear 64->64 + ReLU), 17 outputs "
                "(GB/s of activations, whole operation)")
            out(f"   {'MB':>8} {'forward':>10} {'record':>10} {'compare':>10} "
                f"{'limit rec':>10} {'limit cmp':>10} {'rec/lim':>8} {'cmp/lim':>8}")
            cols = ("forward", "record", "compare", "limit record", "limit compare")
            for size in sizes:
                w = bytes_workload(size)
                rr = repeat if size < 500 * MB else max(1, min(3, repeat))
                r = run_workload(w, d, rr)
                row = {k: r["nbytes"] / r[k] / 1e9 for k in cols}
                results[f"bytes_{size / MB:g}MB"] = r
                out(f"   {r['nbytes'] / MB:>8.1f} " + " ".join(f"{row[k]:>10.2f}" for k in cols)
                    + f" {_ratio(r['record'], r['limit record']):>8.2f}"
                    + f" {_ratio(r['compare'], r['limit compare']):>8.2f}")
            runs_b = [results[f"bytes_{size / MB:g}MB"] for size in sizes]
            for op in ("record", "compare"):
                slopes = [(b[op] - a[op]) / (b["nbytes"] - a["nbytes"]) * 1e9 for a, b in zip(runs_b, runs_b[1:])]
                g = slopes[-1] / slopes[0] if slopes[0] > 0 else math.nan
                out(f"   {op}: seconds per added GB " + ", ".join(f"{x:.2f}" for x in slopes)
                    + f"; last/first = {g:.2f}")
                targets.append((f"linear in bytes ({op}: s per added GB, {sizes[-2] / MB:g}->{sizes[-1] / MB:g} MB "
                                f"vs {sizes[0] / MB:g}->{sizes[1] / MB:g} MB)", f"{g:.2f}x", 0.67 <= g <= 1.5))

        if want("memory"):
            mem = measure_memory(quick, d, a.threads)
            results["memory"] = mem
            sp = mem["spec"]
            big = mem["largest_leaf_bytes"]
            budget = 2 * big + 64 * 2**20
            out(f"\n== peak memory: {sp['blocks']} x (Linear {sp['width']}->{sp['width']} + ReLU) "
                f"on {sp['rows']} rows, {mem['total_bytes'] / MB:.0f} MB of activations, "
                f"largest output {big / MB:.2f} MB "
                f"({'fresh process per operation' if mem['fresh_process_per_op'] else 'one process for both'})")
            for op in ("record", "compare"):
                m = mem[op]
                above = m["op_peak"] - m["forward_peak"]
                out(f"   {op:<8} peak RSS {m['op_peak'] / 2**20:8.1f} MiB, "
                    f"plain forward {m['forward_peak'] / 2**20:8.1f} MiB, "
                    f"above the forward {above / 2**20:7.1f} MiB "
                    f"(budget 2 x largest + 64 MiB = {budget / 2**20:.1f} MiB)"
                    + ("" if m["clean"] else "  [no /proc/self/clear_refs: upper bound]"))
                if op == "compare":
                    targets.append((f"compare peak above forward <= 2x largest + 64 MiB "
                                    f"({mem['total_bytes'] / 1e9:.2f} GB total)",
                                    f"{above / 2**20:.1f} MiB of {budget / 2**20:.1f}", above <= budget))

        if want("fingerprint"):
            results["fingerprint"] = run_fingerprints(out, targets, quick, repeat, d, wide)

        out("\n== targets" + (" (--quick sizes: not the real figures)" if quick else ""))
        for name, val, ok in targets:
            out(f"   [{'met ' if ok else 'MISS'}] {name}: {val}")
        out(f"\nload average at end {os.getloadavg()[0]:.2f}; total {time.perf_counter() - t_start:.0f} s")
        results["targets"] = [{"target": n, "value": v, "met": ok} for n, v, ok in targets]
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"results": results, "output": out.lines}, f, indent=1, default=str)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

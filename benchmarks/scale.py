#!/usr/bin/env python
"""activation_guard at a realistic size: a 271M-parameter Llama, cold and warm, default threads and one.

Run ``python benchmarks/scale.py`` (several minutes on a 2-core machine); ``--large`` uses a ~1B
variant, ``--quick`` a tiny one (a smoke run). Every mode is printed beside its limit, measured in
the same process and interleaved with it, repeated, as medians with the spread (min-max):

- ``forward``          plain ``model(ids)`` under ``no_grad``.
- ``f64 forward``      the same forward of a float64 copy of the model (the copy made beforehand).
- full record          ``record()`` against ``limit record`` (the forward with hooks that clone every
                       output, then one sequential write of all bytes and an ``fsync``: benchmarks/run.py).
- full compare         ``compare()`` against ``limit compare`` (hooks reading those bytes back in one
                       sequential pass and taking ``max |live - golden|``).
- fingerprint          ``record(fingerprint=True)`` and its compare, against the forward.
- calibrated           ``record(calibrate=True)`` against the f64 forward + the full record;
                       ``compare(tolerance="calibrated")`` against the f64 forward + the full compare.
                       Each also beside the f64 copy + those (``f64 copy``: ``copy.deepcopy(model).double()``,
                       timed in the same rounds, shown as information: the calibrated modes make
                       their own float64 copy, the limit's f64 forward has its copy made beforehand).
- calibrated (noise)   ``compare(tolerance="calibrated")`` of a copy of the model whose floating weights
                       are multiplied by (1 + 2**-21) (``--noise-exp``; made once per process, untimed),
                       against the same limit: every output differs from the golden by about rounding
                       noise, as on another device or kernel, so every output goes through the
                       calibrated rule (the unchanged model's outputs are bit-identical to the
                       golden's). It must pass, as the unchanged compares must. 2**-21 is 4 float32
                       ulps per weight, all in one direction: at 2**-20 (8 ulps) the change is no
                       longer noise to the rule, and ``o_proj`` of the first layer fails at 1.3x its
                       allowance at every size here (docs/performance.md). Its limit is the f64
                       forward + ``full compare (noise)``: the strict compare of the same copy with
                       ``atol`` 1e-3 (it passes), where, as in the calibrated one, no output is
                       bit-identical and every one takes the kernel's whole pass (the unchanged
                       model's full compare settles each output with one equality test).
- replay="all"         ``compare(replay="all")`` (nothing diverged) against the full compare.
- backward             ``record(backward=True)`` and its compare against a plain forward + backward
                       (grad mode, the same kind of seeded-cotangent loss) + the full record/compare
                       less one forward (the forward is in both).

Cold = a fresh ``python`` process that builds the model, runs two plain forwards (torch's own first-call
costs are not activation_guard's), times a third, then makes ONE activation_guard call: the first of the
process, with every lazy import, the compiled fingerprint pass's build and every per-size plan in it.
Its peak memory above the model (Linux ``VmHWM`` reset before the call, minus the RSS before it) is
printed beside it. Warm = the same calls repeated in one process after a first untimed round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from run import Workload, _reset_peak, _status_kb, limit_compare, limit_record  # benchmarks/run.py

import activation_guard as ag

MB = 1e6
SIZES: dict[str, dict[str, Any]] = {
    # the model: 16 layers, hidden 1024, intermediate 2816, vocab 32000 (271M parameters)
    "base": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000, tokens=128),
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000, tokens=128),
    "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512, tokens=16),
}
# mode -> (the activation_guard call, the golden it reads or writes)
RECORDS = {"full record": "full", "fingerprint record": "fp", "calibrated record": "cal", "backward record": "bwd"}
COMPARES = {"full compare": "full", "fingerprint compare": "fp", "calibrated compare": "cal",
            "calibrated compare (noise)": "cal", "full compare (noise)": "full", 'replay="all" compare': "full",
            "backward compare": "bwd"}
NOISE_ATOL = 1e-3  # full compare (noise): a strict tolerance the noisy copy passes (its outputs differ by ~1e-5)
NOISE_EXP = 21  # calibrated compare (noise): every floating weight of the live copy times (1 + 2**-NOISE_EXP)
LIMITS = {  # mode -> the limit's parts (summed), measured in the same run
    "full record": ["limit record"], "full compare": ["limit compare"],
    "fingerprint record": ["forward"], "fingerprint compare": ["forward"],
    "calibrated record": ["f64 forward", "full record"], "calibrated compare": ["f64 forward", "full compare"],
    "calibrated compare (noise)": ["f64 forward", "full compare (noise)"],
    'replay="all" compare': ["full compare"],
    "backward record": ["forward+backward", "full record", "-forward"],
    "backward compare": ["forward+backward", "full compare", "-forward"],
}
# a second ratio, for information: the limit with the float64 copy of the model (which the limit's
# f64 forward has made beforehand, and a calibrated call makes itself)
WITH_COPY = {m: ["f64 copy", *LIMITS[m]] for m in ("calibrated record", "calibrated compare",
                                                   "calibrated compare (noise)")}
TARGETS = {"fingerprint record": 1.5, "calibrated record": 1.3, "calibrated compare": 1.3,
           "calibrated compare (noise)": 1.3, 'replay="all" compare': 2.5, "full record": 1.5}


def build(size: str) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    s = dict(SIZES[size])
    tokens = s.pop("tokens")
    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=max(256, tokens), use_cache=False, **s)
    m = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    n = sum(p.numel() for p in m.parameters())
    return Workload(size, m, (ids,), note=f"LlamaForCausalLM from a config: {n / 1e6:.0f}M parameters, "
                    f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
                    f"vocab {cfg.vocab_size}, 1 x {tokens} tokens, float32")


def paths(d: str) -> dict[str, str]:
    return {k: os.path.join(d, f"{k}.h5") for k in ("full", "fp", "cal", "bwd", "scratch")} | {
        "limit": os.path.join(d, "limit.bin")}


def ag_call(mode: str, w: Workload, p: dict[str, str]) -> Any:
    """One activation_guard call of ``mode``; records write their own golden (the compares' goldens
    are written by an untimed first round)."""
    m, a = w.model, w.args
    if mode == "full record":
        return ag.record(m, a, path=p["full"])
    if mode == "fingerprint record":
        return ag.record(m, a, path=p["fp"], fingerprint=True)
    if mode == "calibrated record":
        return ag.record(m, a, path=p["cal"], calibrate=True)
    if mode == "backward record":
        return ag.record(m, a, path=p["bwd"], backward=True)
    kw: dict[str, Any] = {}
    if mode in ("calibrated compare", "calibrated compare (noise)"):
        kw["tolerance"] = "calibrated"
    if mode == 'replay="all" compare':
        kw["replay"] = "all"
    if mode in ("calibrated compare (noise)", "full compare (noise)"):
        m = noisy(w)
    if mode == "full compare (noise)":
        kw.update(atol=NOISE_ATOL, rtol=0.0)
    r = ag.compare(m, a, path=p[COMPARES[mode]], **kw)
    if not r.ok:
        which = (f"the model with every floating weight x(1 + 2**-{NOISE_EXP})" if "(noise)" in mode
                 else "an unchanged model")
        raise SystemExit(f"{mode} failed on {which}:\n{r}")
    return r


_NOISY: dict[int, torch.nn.Module] = {}


def noisy(w: Workload) -> torch.nn.Module:
    """The model with every floating parameter multiplied by (1 + 2**-NOISE_EXP): outputs that differ from
    the golden's by about rounding noise everywhere. Made once per process (untimed: the first
    call makes it, and every caller makes that call before timing)."""
    import copy

    key = id(w.model)
    if key not in _NOISY:
        m = copy.deepcopy(w.model)
        with torch.no_grad():
            for q in m.parameters():
                if q.is_floating_point():
                    q.mul_(1 + 2.0**-NOISE_EXP)
        _NOISY[key] = m
    return _NOISY[key]


def forward_backward(w: Workload) -> None:
    """A plain forward and backward, the loss a seeded cotangent on the logits (what backward=True
    does on every floating output), the gradients dropped afterwards."""
    with torch.enable_grad():
        out = w.model(*w.args).logits
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
        (out * cot).sum().backward()
    for q in w.model.parameters():
        q.grad = None


def f64_copy(w: Workload) -> None:
    """What a calibrated call does before its float64 forward: a float64 copy of the model (dropped)."""
    import copy

    copy.deepcopy(w.model).double()


class F64:
    """A float64 copy of the model, made once; its forward is the calibrated modes' extra pass."""

    def __init__(self, w: Workload):
        import copy

        self.model = copy.deepcopy(w.model).double()
        self.args = w.args

    def forward(self) -> None:
        with torch.no_grad():
            self.model(*self.args)


def basic(name: str, w: Workload, p: dict[str, str], f64: F64 | None) -> Callable[[], Any]:
    if name == "forward":
        return w.forward
    if name == "f64 forward":
        assert f64 is not None
        return f64.forward
    if name == "forward+backward":
        return lambda: forward_backward(w)
    if name == "f64 copy":
        return lambda: f64_copy(w)
    if name == "limit record":
        return lambda: limit_record(w, p["limit"])
    if name == "limit compare":
        return lambda: limit_compare(w, p["limit"])
    return lambda: ag_call(name, w, p)


def wanted_modes(groups: list[str]) -> list[str]:
    key = {"full": ("full record", "full compare"), "fingerprint": ("fingerprint record", "fingerprint compare"),
           "calibrated": ("calibrated record", "calibrated compare", "calibrated compare (noise)"),
           "replay": ('replay="all" compare',),
           "backward": ("backward record", "backward compare")}
    out: list[str] = []
    for g in groups:
        out += [m for m in key[g] if m not in out]
    return out


def needs(modes: list[str]) -> list[str]:
    """Every timed variant ``modes`` need: the modes, their limits' parts, the records whose goldens
    the compares read, in an order where each golden is written before it is read."""
    names = ["forward"]
    for m in modes:
        for part in WITH_COPY.get(m, LIMITS[m]):
            part = part.lstrip("-")
            if part not in names:
                names.append(part)
        if m not in names:
            names.append(m)
    return names


# --------------------------------------------------------------------------- warm


def warm(w: Workload, p: dict[str, str], modes: list[str], repeat: int) -> dict[str, list[float]]:
    names = needs(modes)
    f64 = F64(w) if "f64 forward" in names else None
    if "calibrated compare (noise)" in names or "full compare (noise)" in names:
        noisy(w)  # made once, untimed
    calls = {n: basic(n, w, p, f64) for n in names}
    recs = [n for n in names if n in RECORDS or n == "limit record"]
    for n in recs:  # the goldens every compare reads, and each code path's first call (untimed)
        calls[n]()
    for n in names:
        if n not in recs:
            calls[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat):
        # records first (the compares read their files), the order rotated each round so a slow
        # spell of a shared machine spreads over every variant
        for group in ([n for n in names if n not in COMPARES and n != "limit compare"],
                      [n for n in names if n in COMPARES or n == "limit compare"]):
            k = r % max(1, len(group))
            for n in group[k:] + group[:k]:
                gc.collect()
                t0 = time.perf_counter()
                calls[n]()
                times[n].append(time.perf_counter() - t0)
    del f64
    return times


# --------------------------------------------------------------------------- cold (one call per process)


def cold_child(spec: dict[str, Any]) -> dict[str, Any]:
    global NOISE_EXP
    NOISE_EXP = int(spec["noise_exp"])
    if spec["threads"]:
        torch.set_num_threads(int(spec["threads"]))
    w = build(spec["size"])
    p = spec["paths"]
    if spec["mode"] == "calibrated compare (noise)":
        noisy(w)  # untimed, and before the memory baseline: the live copy is the model compared
    w.forward()
    w.forward()
    gc.collect()
    t0 = time.perf_counter()
    w.forward()
    fwd = time.perf_counter() - t0
    gc.collect()
    clean = _reset_peak()
    rss0 = _status_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    ag_call(spec["mode"], w, p)
    took = time.perf_counter() - t0
    peak = _status_kb("VmHWM") * 1024
    return {"forward": fwd, "call": took, "above": peak - rss0, "clean": clean}


def cold(size: str, p: dict[str, str], modes: list[str], threads: int | None, repeat: int,
         noise_exp: int = NOISE_EXP) -> dict[str, Any]:
    order = [m for m in modes if m in RECORDS] + [m for m in modes if m in COMPARES]
    res: dict[str, list[dict[str, Any]]] = {m: [] for m in order}
    for _ in range(repeat):
        for m in order:
            spec = dict(size=size, paths=p, mode=m, threads=threads, noise_exp=noise_exp)
            cp = subprocess.run([sys.executable, __file__, "--cold-child", json.dumps(spec)], capture_output=True,
                                text=True, check=False)
            if cp.returncode != 0:
                raise RuntimeError(f"cold child {m!r} failed:\n{cp.stdout}\n{cp.stderr}")
            res[m].append(json.loads(cp.stdout.strip().splitlines()[-1]))
    return res


# --------------------------------------------------------------------------- report


def fmt(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:7.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def limit_of(mode: str, t: dict[str, list[float]]) -> float:
    total = 0.0
    for part in LIMITS[mode]:
        sign = -1.0 if part.startswith("-") else 1.0
        total += sign * statistics.median(t[part.lstrip("-")])
    return total


def limit_text(mode: str, parts: dict[str, list[str]] = LIMITS) -> str:
    return " + ".join(parts[mode]).replace("+ -", "- ")


def limit_with_copy(mode: str, t: dict[str, list[float]]) -> float:
    return sum(statistics.median(t[part]) for part in WITH_COPY[mode])


@dataclass
class Target:
    what: str
    ratio: float
    limit: float

    def line(self) -> str:
        verdict = "met " if self.ratio <= self.limit else "MISS"
        return f"   {verdict} {self.what}: {self.ratio:.2f}x (<= {self.limit:g}x)"


def report_warm(out: Callable[[str], None], label: str, t: dict[str, list[float]], modes: list[str],
                targets: list[Target]) -> None:
    out(f"\n== warm, {label}: median (min-max) of {len(t['forward'])} interleaved repeats in one process")
    for n in t:
        if n in modes:
            continue
        out(f"   {n:<28}{fmt(t[n])}")
    for m in modes:
        lim = limit_of(m, t)
        q = statistics.median(t[m]) / lim
        with_copy = ""
        if m in WITH_COPY:
            lc = limit_with_copy(m, t)
            with_copy = (f"; {statistics.median(t[m]) / lc:.2f}x ({limit_text(m, WITH_COPY)} = {lc:.2f} s, "
                         "for information)")
        out(f"   {m:<28}{fmt(t[m])}  = {q:.2f}x its limit ({limit_text(m)} = {lim:.2f} s); "
            f"{statistics.median(t[m]) / statistics.median(t['forward']):.1f}x the forward{with_copy}")
        if m in TARGETS and m != "fingerprint record":
            targets.append(Target(f"warm, {label}: {m} vs {limit_text(m)}", q, TARGETS[m]))
    if "fingerprint record" in modes:
        q = statistics.median(t["fingerprint record"]) / statistics.median(t["forward"])
        targets.append(Target(f"warm, {label}: fingerprint record vs the forward", q, TARGETS["fingerprint record"]))


def report_cold(out: Callable[[str], None], label: str, c: dict[str, Any], model_bytes: int,
                targets: list[Target]) -> None:
    n = len(next(iter(c.values())))
    out(f"\n== cold, {label}: each call the first of a fresh process ({n} process(es) per mode), "
        "beside that process's own forward")
    for m, runs in c.items():
        calls = [r["call"] for r in runs]
        fwds = [r["forward"] for r in runs]
        ratios = [r["call"] / r["forward"] for r in runs]
        above = max(r["above"] for r in runs)
        out(f"   {m:<28}{fmt(calls)}  = {statistics.median(ratios):.2f}x its process's forward "
            f"({statistics.median(fwds):.2f} s); peak {above / MB:,.0f} MB above the model "
            f"({above / model_bytes:.2f}x the model's parameters)"
            + ("" if all(r["clean"] for r in runs) else " [peak counter not resettable: cumulative]"))
    if "fingerprint record" in c:
        q = statistics.median(r["call"] / r["forward"] for r in c["fingerprint record"])
        targets.append(Target(f"cold, {label}: fingerprint record vs the forward", q, TARGETS["fingerprint record"]))


def bytecode(compile_first: bool) -> str:
    """Whether the cold processes read activation_guard's modules as bytecode or compile them from
    source: ``pip install`` compiles the bytecode, and a process writes what it compiled unless
    ``PYTHONDONTWRITEBYTECODE`` is set, in which case an editable install or a source tree without
    ``__pycache__`` compiles every module again in every process (0.17 s of CPU on the benchmark
    machine: docs/performance.md). ``compile_first``: compile it now, as an install does."""
    import compileall
    import importlib.util

    pkg = os.path.dirname(os.path.abspath(ag.__file__))
    if compile_first:
        compileall.compile_dir(pkg, quiet=1)
    sources = [os.path.join(r, f) for r, _, fs in os.walk(pkg) for f in fs if f.endswith(".py")]
    cached = sum(1 for f in sources if os.path.exists(importlib.util.cache_from_source(f))
                 and os.path.getmtime(importlib.util.cache_from_source(f)) >= os.path.getmtime(f))
    said = "compiled first, as pip install does" if compile_first else "not compiled first (--no-compile)"
    return (f"activation_guard's bytecode {said}: {cached} of {len(sources)} modules cached"
            + ("; PYTHONDONTWRITEBYTECODE is set" if sys.flags.dont_write_bytecode else ""))


def main(argv: list[str] | None = None) -> int:
    global NOISE_EXP
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a tiny Llama (a smoke run in seconds)")
    size.add_argument("--large", action="store_true", help="the ~1B variant (hidden 2048, intermediate 5632)")
    ap.add_argument("--modes", default="full,fingerprint,calibrated,replay,backward",
                    help="comma-separated: full,fingerprint,calibrated,replay,backward")
    ap.add_argument("--threads", default="default,1", help="comma-separated: default (torch's) and/or numbers")
    ap.add_argument("--repeat", type=int, default=3, help="warm repeats (medians)")
    ap.add_argument("--cold-repeat", type=int, default=1, help="fresh processes per cold mode")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-compile", action="store_true",
                    help="do not compile activation_guard's bytecode before the cold processes (an install does)")
    ap.add_argument("--noise-exp", type=int, default=NOISE_EXP,
                    help=f"calibrated compare (noise): weights x(1 + 2**-N) (default {NOISE_EXP})")
    ap.add_argument("--cold-child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    NOISE_EXP = ns.noise_exp
    if ns.cold_child is not None:
        print(json.dumps(cold_child(json.loads(ns.cold_child))))
        return 0
    size_name = "quick" if ns.quick else "large" if ns.large else "base"
    modes = wanted_modes(ns.modes.split(","))
    d = ns.workdir or tempfile.mkdtemp(prefix="ag-scale-")
    os.makedirs(d, exist_ok=True)
    p = paths(d)
    default_threads = torch.get_num_threads()
    w = build(size_name)
    model_bytes = sum(q.numel() * q.element_size() for q in w.model.parameters())
    print(f"activation_guard {ag.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"model: {w.note}; parameters {model_bytes / MB:,.0f} MB")
    from activation_guard._core import native

    print(f"threads: default = torch.get_num_threads() = {default_threads}; fingerprint pass: {native.status()}")
    if not ns.no_cold:
        print(f"cold processes: {bytecode(compile_first=not ns.no_compile)}")
    targets: list[Target] = []
    try:
        for th in ns.threads.split(","):
            n = None if th == "default" else int(th)
            label = f"{default_threads if n is None else n} thread(s){' (default)' if n is None else ''}"
            torch.set_num_threads(default_threads if n is None else n)
            if not ns.no_cold:
                # the goldens the cold compares read come from the cold records of the same modes
                needed = [m for m in needs(modes) if m in RECORDS and m not in modes]
                c = cold(size_name, p, needed + modes, n, ns.cold_repeat, NOISE_EXP)
                for m in needed:
                    c.pop(m)
                report_cold(print, label, c, model_bytes, targets)
            if not ns.no_warm:
                t = warm(w, p, modes, ns.repeat)
                report_warm(print, label, t, modes, targets)
            sizes = {k: os.path.getsize(v) for k, v in p.items() if os.path.exists(v) and k != "scratch"}
        print("\n== golden sizes: " + ", ".join(f"{k} {v / MB:,.1f} MB" for k, v in sizes.items()))
        print("\n== targets (issue: cold fingerprint record <= 1.5x the forward, calibrated <= 1.3x, "
              "replay='all' <= 2.5x a strict compare, full record <= 1.5x its limit)")
        for tg in targets:
            print(tg.line())
    finally:
        torch.set_num_threads(default_threads)
        if ns.workdir is None:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

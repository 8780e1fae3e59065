#!/usr/bin/env python
"""The GPU check: what only a machine with CUDA can show, in one run (under 8 minutes), one log.

    python benchmarks/gpu_check.py [--log gpu_check.log] [--device cuda|cpu] [--quick]

Without CUDA it writes so to the log and exits 0. ``--device cpu`` runs the in-process sections
on the CPU: a dry run of this script's own logic (the smoke test's); nothing it prints is a GPU
finding. With CUDA the exit status is 1 when a section failed.

Sections, each timed, its failure logged with the traceback and the next one run:

1. ``tests``: the cuda variants of the example tests (``ag_device``), tests/test_devices.py and
   test_plugin.py::test_ag_device, in a pytest subprocess.
2. ``replay``: a nested model recorded on the CPU and compared on the device: ``replay="first"``
   with a change in a parent's own code (origin ``parent-code`` at that parent) and
   ``replay="all"`` unchanged (passes, every call re-run).
3. ``determinism``: fresh interpreters: a device matmul before ``deterministic()`` with
   ``CUBLAS_WORKSPACE_CONFIG`` unset (what torch and activation_guard do then), and a record and
   compare with fingerprints inside ``deterministic()`` with it set.
4. ``fingerprints``: one tensor fingerprinted on the CPU and on the device; both judged against
   the other side's tensor, clean and with one element changed (same verdicts); the time of each.
5. ``calibrated``: a conv model recorded with ``calibrate=True`` on the CPU, compared with
   ``tolerance="calibrated"`` on the device (passes) and strictly (what TF32 does); peak device
   memory over the parameters' bytes.
6. ``stream-race``: CPU-golden vs device compares while the current stream is kept busy, and from
   a side stream: the clean model passes and a changed one fails at its layer, every round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import activation_guard as ag  # noqa: E402
from activation_guard.fingerprints.fingerprint import FingerprintParams, compute_fingerprint  # noqa: E402
from activation_guard.fingerprints.soundness import judge_fingerprint  # noqa: E402

BUDGET_S = 450.0  # the whole run; sections still to come are skipped past it


class Log:
    def __init__(self, path: Path):
        self.path = path
        self.f = path.open("w")

    def __call__(self, *parts: Any) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


class Block(nn.Module):
    """Two children and code of its own after the last (``scale``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


def nested(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Sequential(Block(width), Block(width)),
                         nn.Linear(width, 8)).eval()


def conv_model(channels: int) -> nn.Module:
    torch.manual_seed(0)
    c = channels
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10),
    ).eval()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# --------------------------------------------------------------------------- sections
def section_tests(dev: torch.device, log: Log, quick: bool, left: float) -> None:
    if dev.type != "cuda":
        log("  skipped: the pytest run is for a CUDA machine")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           "tests/examples", "-k", "cuda", "tests/test_devices.py", "tests/test_plugin.py::test_ag_device"]
    log("  $", " ".join(cmd[1:]))
    cp = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(30.0, min(240.0, left)),
                        check=False)
    for line in (cp.stdout + cp.stderr).strip().splitlines()[-40:]:
        log("  |", line)
    expect(cp.returncode == 0, f"pytest exited {cp.returncode}")


def section_replay(dev: torch.device, log: Log, quick: bool, left: float) -> None:
    model, x = nested(), torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "g.h5"
        ag.record(model, (x,), path=p)  # on the CPU
        live, xl = model.to(dev), x.to(dev)
        t0 = time.perf_counter()
        clean = ag.compare(live, (xl,), path=p, replay="all")
        log(f"  replay=all, unchanged: ok={clean.ok}, {sum(1 for r in clean.layers if r.own_status)} of "
            f"{len(clean.layers)} calls re-run, {time.perf_counter() - t0:.2f} s")
        for n in clean.notes:
            log("    note:", n)
        expect(clean.ok, "replay=all on the unchanged model failed:\n" + str(clean))
        expect(all(r.own_status for r in clean.layers), "a call was not re-run")
        live[1][1].scale = 1.5
        first = ag.compare(live, (xl,), path=p, replay="first")
        o = first.origin
        log(f"  replay=first, code after the last child of '1.1' changed: ok={first.ok}, origin "
            f"{None if o is None else (o.name, o.kind)}")
        expect(not first.ok and o is not None and (o.name, o.kind) == ("1.1", "parent-code"),
               "wrong attribution:\n" + str(first))


DET_CHILD = r'''
import os, sys, tempfile, warnings
import torch
import activation_guard as ag
dev = torch.device(sys.argv[1])
a = torch.randn(64, 64, device=dev)
print("earlier matmul:", float((a @ a).sum()) == float((a @ a).sum()))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    try:
        with ag.deterministic():
            print("matmul inside deterministic():", float((a @ a).sum()) == float((a @ a).sum()))
    except Exception as e:
        print("inside deterministic() raised", type(e).__name__ + ":", str(e)[:300])
    for x in w:
        print("warning:", str(x.message)[:300])
if os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512)).to(dev).eval()
    x = torch.randn(64, 512, device=dev)
    with tempfile.TemporaryDirectory() as d, ag.deterministic():
        p = os.path.join(d, "g.h5")
        rec = ag.record(m, (x,), path=p, fingerprint=True)
        r = ag.compare(m, (x,), path=p, rtol=0.0, atol=0.0)
        print(f"fingerprints under deterministic(): {rec.fingerprints} stored, bit-exact compare ok={r.ok}")
        if not r.ok:
            print(r)
            sys.exit(1)
'''


def section_determinism(dev: torch.device, log: Log, quick: bool, left: float) -> None:
    for label, value in (("CUBLAS_WORKSPACE_CONFIG unset at start", None),
                         ("CUBLAS_WORKSPACE_CONFIG=:4096:8 at start", ":4096:8")):
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        if value is not None:
            env["CUBLAS_WORKSPACE_CONFIG"] = value
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cp = subprocess.run([sys.executable, "-c", DET_CHILD, str(dev)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=max(30.0, min(120.0, left)), check=False)
        log(f"  {label}: exit {cp.returncode}")
        for line in (cp.stdout + cp.stderr).strip().splitlines()[-12:]:
            log("  |", line)
        if value is not None:
            expect(cp.returncode == 0, "record/compare with fingerprints under deterministic() failed")


def section_fingerprints(dev: torch.device, log: Log, quick: bool, left: float) -> None:
    n = 1 << 20 if quick else 1 << 24
    params = FingerprintParams()
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    xd = x.to(dev)
    bad, badd = x.clone(), xd.clone()
    bad[n // 3] += 1.0
    badd[n // 3] += 1.0
    timings = {}
    for name, t in (("cpu", x), (str(dev), xd)):
        compute_fingerprint(t, params)  # warm-up (hash tables, kernels)
        sync(t.device)
        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            compute_fingerprint(t, params)
        sync(t.device)
        timings[name] = (time.perf_counter() - t0) / reps
    fc, fd = compute_fingerprint(x, params), compute_fingerprint(xd, params)
    rtol, atol = 1.3e-6, 1e-5
    verdicts = {
        "cpu fingerprint vs device tensor": judge_fingerprint(fc, xd, rtol, atol).status,
        "device fingerprint vs cpu tensor": judge_fingerprint(fd, x, rtol, atol).status,
        "cpu fingerprint vs changed device tensor": judge_fingerprint(fc, badd, rtol, atol).status,
        "device fingerprint vs changed cpu tensor": judge_fingerprint(fd, bad, rtol, atol).status,
    }
    mb = n * 4 / 1e6
    for name, s in timings.items():
        log(f"  compute_fingerprint on {name}: {s * 1e3:.2f} ms for {mb:.0f} MB ({mb / s / 1e3:.2f} GB/s)")
    log(f"  sums: cpu {fc.sum!r}, {dev} {fd.sum!r} (difference {abs(fc.sum - fd.sum):.3g})")
    for k, v in verdicts.items():
        log(f"  {k}: {v}")
    expect(list(verdicts.values()) == ["ok", "ok", "diverged", "diverged"], f"verdicts differ: {verdicts}")


def section_calibrated(dev: torch.device, log: Log, quick: bool, left: float) -> None:
    c = 16 if quick else 64
    model = conv_model(c)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "g.h5"
        ag.record(model, (x,), path=p, calibrate=True)  # on the CPU
        live, xl = model.to(dev), x.to(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        r = ag.compare(live, (xl,), path=p, tolerance="calibrated")
        sync(dev)
        took = time.perf_counter() - t0
        worst = max((layer.error_multiple or 0.0) for layer in r.layers)
        log(f"  calibrated compare cpu -> {dev}: ok={r.ok}, worst layer at {worst:.3g}x its allowance, {took:.2f} s")
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) - base
            log(f"  peak device memory above the model and inputs: {peak / 1e6:.1f} MB = {peak / pbytes:.2f}x the "
                f"parameters' {pbytes / 1e6:.2f} MB")
        expect(r.ok, "calibrated compare failed:\n" + str(r))
        strict = ag.compare(live, (xl,), path=p, replay="off")
        log(f"  strict compare cpu -> {dev}: ok={strict.ok}; environment lines:")
        for line in strict.env_changes:
            log("    -", line)
        if not strict.ok:
            fd = strict.first_divergence
            log(f"    first divergence {None if fd is None else fd.name}, max abs {fd and fd.max_abs_diff}")


def section_stream_race(dev: torch.device, log: Log, quick: bool, left: float) -> None:
    model = nested(256)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    rounds = 3 if quick else 10
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "g.h5"
        ag.record(model, (x,), path=p)
        live, xl = model.to(dev), x.to(dev)
        changed = nested(256).to(dev)
        with torch.no_grad():
            changed[2].weight.mul_(1.01)
        side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        bad = []
        for i in range(rounds):
            for where in ("current stream busy", "side stream"):
                if where == "side stream" and side is None:
                    continue
                ctx: Any = torch.cuda.stream(side) if where == "side stream" and side is not None else _null()
                with ctx:
                    if side is not None:
                        torch.cuda.current_stream(dev).wait_stream(torch.cuda.default_stream(dev))
                        torch.cuda._sleep(20_000_000)  # keeps the stream busy while the golden is copied in
                    ok = ag.compare(live, (xl,), path=p, replay="off", rtol=1e-4, atol=1e-5)
                    if side is not None:
                        torch.cuda._sleep(20_000_000)
                    no = ag.compare(changed, (xl,), path=p, replay="off", rtol=1e-4, atol=1e-5)
                fd = no.first_divergence
                if not ok.ok or no.ok or fd is None or fd.name != "2":
                    bad.append((i, where, ok.ok, no.ok, None if fd is None else fd.name))
        log(f"  {rounds} rounds: {len(bad)} wrong verdicts {bad[:5]}")
        expect(not bad, f"wrong verdicts under a busy stream: {bad}")


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


SECTIONS: list[tuple[str, Callable[[torch.device, Log, bool, float], None]]] = [
    ("tests", section_tests), ("replay", section_replay), ("determinism", section_determinism),
    ("fingerprints", section_fingerprints), ("calibrated", section_calibrated), ("stream-race", section_stream_race),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", default="gpu_check.log", help="the log file (default gpu_check.log)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    ap.add_argument("--quick", action="store_true", help="small sizes and few rounds")
    ap.add_argument("--only", default="", help="comma-separated section names")
    a = ap.parse_args(argv)
    log = Log(Path(a.log))
    start = time.perf_counter()
    dev = torch.device(a.device)
    log(f"activation_guard gpu_check: torch {torch.__version__}, CUDA build {torch.version.cuda}, "
        f"activation_guard {ag.__version__}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA: torch.cuda.is_available() is False here; nothing to check (exit 0)")
        return 0
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        dev = torch.device("cuda", idx)
        cap = torch.cuda.get_device_capability(dev)
        log(f"device {dev}: {torch.cuda.get_device_name(dev)}, sm_{cap[0]}{cap[1]}, cuDNN "
            f"{torch.backends.cudnn.version()}, cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
            f"cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}")
    else:
        log(f"dry run on {dev}: the script's own logic; no GPU finding")
    only = {s for s in a.only.split(",") if s}
    results = {}
    for name, fn in SECTIONS:
        if only and name not in only:
            continue
        left = BUDGET_S - (time.perf_counter() - start)
        log(f"== {name}")
        if left <= 0:
            log("  skipped: out of time")
            results[name] = "skipped"
            continue
        t0 = time.perf_counter()
        try:
            fn(dev, log, a.quick, left)
            results[name] = "ok"
        except Exception:
            results[name] = "FAILED"
            for line in traceback.format_exc().rstrip().splitlines():
                log("  !", line)
        log(f"  {results[name]} in {time.perf_counter() - t0:.1f} s")
    log("== summary: " + ", ".join(f"{k} {v}" for k, v in results.items())
        + f"; {time.perf_counter() - start:.0f} s in all")
    return 1 if "FAILED" in results.values() else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Same decisions in two checkouts: calibrated record/compare outcomes, diffed key by key.

A change meant to make ``record(calibrate=True)`` and ``compare(tolerance="calibrated")`` cheaper
must not change a floor, a verdict, a tolerance, an origin or a note. This script runs one seeded
battery of small models against each checkout in a fresh process (``PYTHONPATH=<checkout>``, this
interpreter, one torch thread), each writing one canonical JSON, then compares the two JSONs key
by key and prints the verdict: exit 0 when identical, 1 when any key differs (the first ~20
differing keys are printed with both values).

    python benchmarks/calibration_ab.py OLD_CHECKOUT NEW_CHECKOUT [--keep DIR]
    python benchmarks/calibration_ab.py --one CHECKOUT --json F      # one side only
    python benchmarks/calibration_ab.py --diff A.json B.json         # two sides written before

The battery, per model (below): ``record(calibrate=True)``, also with ``fingerprint=True`` and with
``backward=True``; against each golden ``compare(tolerance="calibrated")`` of the unchanged model
and of copies with every floating parameter scaled by (1+1e-6), (1+1e-3) and (1+3e-2), each under
``replay="first"``, ``"all"`` and ``"off"``. Every call gets a fresh deep copy of the pristine
model and the RNG seeded the same way, so no call sees another's side effects (BatchNorm running
statistics, dropout's generator). A call that raises is recorded as its error's type and message.

Written per golden: its record summary (less path and file size) and its whole meta less the
library versions (the calibration record: floors per output exactly as stored, ``computes_differently``,
the rule; the backward record's gradient floors), and the model's state afterwards (a SHA-256 of
its parameters and buffers: the library must leave the live model as the forward left it). Per
compare: the report's own ``Report.to_dict()`` (ok, first divergence, origin, notes, counts, and
every layer call and output leaf: status, error_multiple, rtol/atol, tolerance_source, detail and
the differences) less the golden's path and meta, and the model's state afterwards. Floats are
written by ``json`` as ``repr`` writes them (the shortest string that reads back to the same
bits), so a one-ulp change shows. The temporary directory is written as ``<tmp>``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCALES = {"x(1+1e-6)": 1e-6, "x(1+1e-3)": 1e-3, "x(1+3e-2)": 3e-2}
REPLAYS = ("first", "all", "off")
GOLDENS = {"plain": {}, "fingerprint": {"fingerprint": True}, "backward": {"backward": True}}
SHOWN = 20  # differing keys printed


# --------------------------------------------------------------------------- the models (child process)


def _models_module() -> Any:
    """tests/models.py of the checkout this script is in (both sides build the same models)."""
    spec = importlib.util.spec_from_file_location("ab_test_models", os.path.join(REPO, "tests", "models.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Case:
    name: str
    build: Callable[[], Any]  # -> the pristine model
    inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]  # -> fresh (args, kwargs)


def cases() -> list[Case]:
    import torch
    from torch import nn

    tm = _models_module()

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def seeded(seed: int = 0) -> None:
        torch.manual_seed(seed)

    class DtypeBranch(nn.Module):
        """A norm whose epsilon depends on the input's dtype: its float64 copy computes another function."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 8)
            self.fc2 = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x) * 1e-3  # a small variance, so epsilon matters
            eps = 1e-12 if x.dtype == torch.float64 else 1e-5
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return self.fc2(h)

    class RMS(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.norm = nn.RMSNorm(16)  # eps=None: torch.finfo(x.dtype).eps, another value in float64
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.norm(self.fc1(x) * 1e-4))

    def cancellation() -> nn.Module:
        seeded()
        m = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
        w = torch.randn(8, 8, generator=gen(3)) * 1e4
        with torch.no_grad():  # large equal-and-opposite weights: outputs are tiny differences of huge sums
            m[0].weight.copy_(torch.cat([w, -w], dim=1))
        return m.eval()

    def cancellation_in() -> tuple[tuple[Any, ...], dict[str, Any]]:
        a = torch.randn(4, 8, generator=gen(4))
        return (torch.cat([a, a + 1e-4 * torch.randn(4, 8, generator=gen(5))], dim=1),), {}

    def mlp(dtype: torch.dtype) -> Callable[[], nn.Module]:
        return lambda: tm.tiny_mlp(width=16, depth=3).to(dtype)

    def mlp_in(dtype: torch.dtype) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
        return lambda: ((torch.randn(4, 16, generator=gen(1)).to(dtype),), {})

    def big() -> nn.Module:  # 4 outputs of 10,000 x 256 float32: ~41 MB of activations
        seeded()
        return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh()).eval()

    def llama() -> nn.Module:  # benchmarks/scale.py's "quick" size
        tf = tm._quiet_transformers()
        seeded()
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=512, max_position_embeddings=256, use_cache=False)
        return tf.LlamaForCausalLM(cfg).eval()

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.act = nn.Tanh()
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight  # one Parameter, two modules

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.act(self.a(x)))

    class ReadsChildWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(8, 8)
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.child(x) + x @ self.child.weight.T)  # the child's weight used outside it

    class CallsForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(8, 8)
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.child.forward(x)))  # bypasses __call__: no hooks on child

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            y += 1  # changes a's output after its hook saw it
            return self.b(y)

    def dropout() -> nn.Module:
        seeded()
        m = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).eval()
        m[1].train()
        return m

    def plain(cls: type[nn.Module]) -> Callable[[], nn.Module]:
        def b() -> nn.Module:
            seeded()
            return cls().eval()
        return b

    def x8() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(4, 8, generator=gen(1)),), {}

    out = [Case(r.name, r.build, (lambda r=r: (r.inputs(), r.kwargs() if r.kwargs else {})))
           for r in tm.REAL_MODELS]
    out += [
        Case("dtype_branch", plain(DtypeBranch), x8),
        Case("rmsnorm_default_eps", plain(RMS), x8),
        Case("cancellation", cancellation, cancellation_in),
        Case("mlp_bfloat16", mlp(torch.bfloat16), mlp_in(torch.bfloat16)),
        Case("mlp_float64", mlp(torch.float64), mlp_in(torch.float64)),
        Case("cnn_batchnorm_train", lambda: tm.build_cnn().train(), lambda: (tm.cnn_input(), {})),
        Case("mlp_41MB_activations", big, lambda: ((torch.randn(10_000, 256, generator=gen(1)),), {})),
        Case("hf_llama_quick", llama,
             lambda: ((torch.randint(0, 512, (1, 16), generator=gen(1)),), {})),
        Case("tied_weights", plain(Tied), x8),
        Case("reads_child_weight", plain(ReadsChildWeight), x8),
        Case("calls_child_forward", plain(CallsForward), x8),
        Case("inplace_on_output", plain(InPlace), x8),
        Case("dropout_train_seeded", dropout, x8),
    ]
    return out


# --------------------------------------------------------------------------- the battery (child process)


def state_digest(model: Any) -> str:
    """SHA-256 of every parameter and buffer, names and bytes: whether a call changed the model."""
    h = hashlib.sha256()
    for k, t in sorted(model.state_dict(keep_vars=False).items()):
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def scaled(model: Any, eps: float) -> Any:
    """A deep copy with every floating parameter (shared ones once) multiplied by (1 + eps)."""
    import torch

    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():  # parameters() yields a tied parameter once
            if p.is_floating_point():
                p.mul_(1 + eps)
    return m


def scrub(obj: Any, names: dict[str, str]) -> Any:
    """``obj`` with each path in ``names`` written as its placeholder (the temporary directory,
    the checkout: they differ between the two sides)."""
    if isinstance(obj, str):
        for path, placeholder in names.items():
            obj = obj.replace(path, placeholder)
        return obj
    if isinstance(obj, dict):
        return {str(k): scrub(v, names) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, names) for v in obj]
    return obj


def error(e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "message": str(e)}


def layer_key(d: dict[str, Any], seen: set[str]) -> str:
    key = f"{d.get('name') or '<root>'}[{d.get('call')}]"
    if d.get("phase", "forward") != "forward":
        key += f" {d['phase']}" + (f" wrt {d['wrt']}" if d.get("wrt") else "")
    if d.get("position") is None:
        key += " (golden only)"
    k, n = key, 1
    while k in seen:  # never expected; kept apart rather than overwritten
        n += 1
        k = f"{key} #{n}"
    seen.add(k)
    return k


def report_dict(rep: Any) -> dict[str, Any]:
    """The report's own dict, layers and leaves keyed by their names (a missing row does not shift
    every later key), less the golden's path and meta (the golden's record holds its meta)."""
    d = rep.to_dict()
    for k in ("golden", "golden_meta"):
        d.pop(k, None)
    seen: set[str] = set()
    layers = {}
    for lay in d.pop("layers"):
        leaves = {}
        for leaf in lay.pop("leaves"):
            p = leaf.get("path") or "<output>"
            while p in leaves:
                p += " #2"
            leaves[p] = leaf
        lay["leaves"] = leaves
        layers[layer_key(lay, seen)] = lay
    d["layers"] = layers
    return d


def battery(checkout: str, only: list[str] | None = None) -> dict[str, Any]:
    import torch

    import activation_guard as ag

    torch.set_num_threads(1)
    todo = cases()
    unknown = sorted(set(only or []) - {c.name for c in todo})
    if unknown:
        raise SystemExit(f"--only: no model named {', '.join(map(repr, unknown))}; "
                         f"the models: {', '.join(c.name for c in todo)}")
    tmp = tempfile.mkdtemp(prefix="ag-calab-")
    out: dict[str, Any] = {}
    try:
        for case in todo:
            if only and case.name not in only:
                continue
            t0 = time.perf_counter()
            torch.manual_seed(0)
            pristine = case.build()
            res: dict[str, Any] = {}
            for gname, opts in GOLDENS.items():
                path = os.path.join(tmp, f"{case.name}-{gname}.h5")
                g: dict[str, Any] = {}
                m = copy.deepcopy(pristine)
                a, kw = case.inputs()
                torch.manual_seed(0)
                try:
                    s = ag.record(m, a, kw, path=path, calibrate=True, **opts)
                    summ = s.to_dict()
                    for k in ("path", "file_bytes"):
                        summ.pop(k, None)
                    g["record"] = summ
                    with ag.read_golden(path) as r:
                        meta = dict(r.meta)
                    meta.pop("versions", None)
                    g["meta"] = meta
                except Exception as e:  # an error is an outcome to compare
                    g["record"] = error(e)
                g["state_after_record"] = state_digest(m)
                if "error" not in g["record"]:
                    cmp: dict[str, Any] = {}
                    for vname, eps in {"unchanged": None, **SCALES}.items():
                        for rp in REPLAYS:
                            live = copy.deepcopy(pristine) if eps is None else scaled(pristine, eps)
                            a, kw = case.inputs()
                            torch.manual_seed(0)
                            c: dict[str, Any]
                            try:
                                c = report_dict(ag.compare(live, a, kw, path=path, tolerance="calibrated", replay=rp))
                            except Exception as e:
                                c = error(e)
                            c["state_after"] = state_digest(live)
                            cmp[f"{vname} replay={rp}"] = c
                    g["compare"] = cmp
                res[gname] = g
            out[case.name] = res
            print(f"  {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return scrub(out, {tmp: "<tmp>", os.path.realpath(checkout): "<checkout>", checkout: "<checkout>"})


def canonical(obj: Any) -> str:
    # json writes a float as repr does: the shortest text that reads back to the same bits
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


# --------------------------------------------------------------------------- the parent


def run_one(checkout: str, json_path: str, only: list[str] | None = None) -> float:
    """Run the battery against ``checkout`` in a fresh process; returns its wall time."""
    checkout = os.path.abspath(checkout)
    if not os.path.isfile(os.path.join(checkout, "activation_guard", "__init__.py")):
        raise SystemExit(f"{checkout!r} is not a checkout of activation_guard (no activation_guard/__init__.py)")
    env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--battery", checkout, "--json", os.path.abspath(json_path)]
    if only:
        cmd += ["--only", ",".join(only)]
    t0 = time.perf_counter()
    cp = subprocess.run(cmd, env=env, check=False, cwd=tempfile.gettempdir())
    if cp.returncode != 0:
        raise SystemExit(f"the battery failed against {checkout} (exit {cp.returncode})")
    return time.perf_counter() - t0


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict) and obj:
        for k in sorted(obj):
            yield from flatten(obj[k], f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, list) and obj and any(isinstance(x, (dict, list)) for x in obj):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


ABSENT = "<absent>"
DECISIONS = {"ok", "status", "own_status", "inherited_status", "error", "computes_differently"}


def same(x: Any, y: Any) -> bool:
    """Equal values of one type (0 and 0.0 differ); two NaNs are the same (``json`` reads NaN back)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and x != x and y != y:
        return True
    return bool(x == y)


def is_decision(key: str) -> bool:
    """A verdict, a first divergence, an origin, an error, a layer computing differently (not a number)."""
    parts = key.split("/")
    if "origin" in parts:  # which layer, which kind; its own error and its words are numbers and text
        return parts[-1] not in ("own_error", "detail")
    return bool(DECISIONS.intersection(parts)) or "first_divergence" in parts


def diff(a_path: str, b_path: str, label_a: str = "old", label_b: str = "new") -> int:
    with open(a_path, encoding="utf-8") as f:
        a = dict(flatten(json.load(f)))
    with open(b_path, encoding="utf-8") as f:
        b = dict(flatten(json.load(f)))
    keys = sorted(set(a) | set(b))
    differ = [k for k in keys if not same(a.get(k, ABSENT), b.get(k, ABSENT))]
    n_gold = sum(1 for k in keys if k.count("/") >= 2 and k.split("/")[2] == "record" and k.endswith("layer_calls"))
    n_cmp = len({"/".join(k.split("/")[:4]) for k in keys if len(k.split("/")) > 3 and k.split("/")[2] == "compare"})
    print(f"{len(keys)} keys: {n_gold} goldens, {n_cmp} compares ({label_a}: {a_path}, {label_b}: {b_path})")
    if not differ:
        print("IDENTICAL: every floor, verdict, tolerance, origin and note is the same")
        return 0
    decisive = [k for k in differ if is_decision(k)]
    print(f"DIFFERENT: {len(differ)} of {len(keys)} keys differ, {len(decisive)} of them decisions (a verdict, "
          f"a first divergence, an origin, an error); the first {min(SHOWN, len(differ))}, decisions first:")
    for k in (decisive + [k for k in differ if k not in set(decisive)])[:SHOWN]:
        print(f"  {k}\n    {label_a}: {a.get(k, ABSENT)!r}\n    {label_b}: {b.get(k, ABSENT)!r}")
    models = sorted({k.split("/")[0] for k in differ})
    print(f"models with differences: {', '.join(models)}")
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("checkouts", nargs="*", help="OLD NEW: two checkouts of activation_guard")
    ap.add_argument("--one", metavar="CHECKOUT", help="run the battery against one checkout (with --json)")
    ap.add_argument("--json", metavar="F", help="with --one: where to write its JSON")
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two JSONs written before")
    ap.add_argument("--keep", metavar="DIR", help="keep both JSONs in DIR (old.json, new.json)")
    ap.add_argument("--only", default=None, help="comma-separated model names (a quicker partial run)")
    ap.add_argument("--battery", metavar="CHECKOUT", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    only = ns.only.split(",") if ns.only else None
    if ns.battery is not None:  # the child: PYTHONPATH is the checkout
        import activation_guard as ag

        where = os.path.dirname(os.path.dirname(os.path.abspath(ag.__file__)))
        if os.path.realpath(where) != os.path.realpath(ns.battery):
            raise SystemExit(f"imported activation_guard from {where}, not from {ns.battery}")
        data = battery(ns.battery, only)
        tmpname = ns.json + ".part"
        with open(tmpname, "w", encoding="utf-8") as f:
            f.write(canonical(data))
        os.replace(tmpname, ns.json)
        return 0
    if ns.diff:
        return diff(*ns.diff, label_a="A", label_b="B")
    if ns.one:
        if not ns.json:
            ap.error("--one needs --json F")
        took = run_one(ns.one, ns.json, only)
        print(f"{ns.one}: {took:.1f} s -> {ns.json}")
        return 0
    if len(ns.checkouts) != 2:
        ap.error("give OLD and NEW checkouts (or --one CHECKOUT --json F, or --diff A B)")
    d = ns.keep or tempfile.mkdtemp(prefix="ag-calab-json-")
    os.makedirs(d, exist_ok=True)
    try:
        paths = [os.path.join(d, "old.json"), os.path.join(d, "new.json")]
        for checkout, p in zip(ns.checkouts, paths):
            took = run_one(checkout, p, only)
            print(f"{checkout}: battery {took:.1f} s")
        return diff(*paths)
    finally:
        if not ns.keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

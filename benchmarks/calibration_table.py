"""False-alarm and detection rates of strict, hand-tuned and calibrated tolerances.

For each model family (a ResNet-style CNN, and BERT and GPT-2 from transformers, all randomly
initialised from configs: no downloads), and each seed (model init, inputs, bug location):

1. record a float32 golden with ``calibrate=True``;
2. re-run the same model under a *benign* perturbation that real cross-device runs have:
   ``tf32``      float32 matmul/conv operands rounded to TF32 (10-bit mantissa), as on Ampere+
   ``reorder``   float32 reductions summed in another order (permuted contraction dimension),
                 as a different kernel/library/thread count does
   ``bf16-amp``  CPU autocast to bfloat16 (``allow_dtype_change=True``)
   and count how often each tolerance mode flags it (a false alarm);
3. re-run it under the same perturbation *with a real bug* at a random layer (1% scaled
   weight, 0.1% scaled weight, norm epsilon 1e-5 -> 1e-3, wrong activation) and count how often
   each mode reports the first divergence at exactly that layer (detection).

Modes: ``strict`` (torch.testing.assert_close dtype defaults, what compare() does by default),
``loose`` (a hand-tuned rtol = atol = 1e-2), ``calibrated`` (tolerance="calibrated").

    python benchmarks/calibration_table.py --seeds 5 [--models resnet,bert,gpt2] [--json out.json]

Prints a markdown table (docs/cross-device.md quotes it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import activation_guard as ag
from activation_guard._core.tf32 import emulate_tf32

# --------------------------------------------------------------------------- models


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(y)) + idt)


class ResNetMini(nn.Module):
    """ResNet (BasicBlock, [2, 2, 2] stages of 16/32/64 channels) for 32x32 images."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_resnet(seed: int) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(seed)
    m = ResNetMini()
    g = torch.Generator().manual_seed(seed)
    for bn in (mod for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)):
        n = bn.num_features  # trained-looking statistics, so eval-mode BN does something
        bn.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
        bn.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        bn.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
        bn.bias.data.copy_(torch.randn(n, generator=g) * 0.1)
    return m.eval(), (torch.randn(4, 3, 32, 32, generator=g),)


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def build_bert(seed: int) -> tuple[nn.Module, tuple[Any, ...]]:
    tf = _transformers()
    cfg = tf.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    torch.manual_seed(seed)
    m = tf.BertModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    return m, (torch.randint(5, 512, (2, 16), generator=g),)


def build_gpt2(seed: int) -> tuple[nn.Module, tuple[Any, ...]]:
    tf = _transformers()
    cfg = tf.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(seed)
    m = tf.GPT2Model(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    return m, (torch.randint(5, 512, (2, 16), generator=g),)


MODELS: dict[str, tuple[str, Callable[[int], tuple[nn.Module, tuple[Any, ...]]]]] = {
    "resnet": ("CNN: ResNet (BasicBlock, BN, ReLU)", build_resnet),
    "bert": ("Transformer: BERT encoder (HF)", build_bert),
    "gpt2": ("Transformer: GPT-2 decoder (HF)", build_gpt2),
}

# --------------------------------------------------------------------------- perturbations


class ReorderedReductions(TorchFunctionMode):
    """Float32 matmuls/convolutions sum their products in another order (the contraction
    dimension is permuted consistently on both operands): the same math, different rounding,
    as another kernel, BLAS library or thread count gives. float64 is left alone."""

    def __init__(self, seed: int):
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)
        self.perms: dict[int, torch.Tensor] = {}

    def _perm(self, n: int) -> torch.Tensor:
        if n not in self.perms:
            self.perms[n] = torch.randperm(n, generator=self.gen)
        return self.perms[n]

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        F = torch.nn.functional
        a = list(args)
        f32 = [isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in a]
        if func is F.linear and len(a) >= 2 and f32[0] and f32[1]:
            p = self._perm(a[1].shape[1])
            a[0], a[1] = a[0][..., p], a[1][:, p]
        elif func in (F.conv1d, F.conv2d, F.conv3d) and len(a) >= 2 and f32[0] and f32[1]:
            groups = a[6] if len(a) > 6 else kwargs.get("groups", 1)
            if groups == 1:
                p = self._perm(a[1].shape[1])
                a[0], a[1] = a[0][:, p], a[1][:, p]
        elif func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(a) >= 2 and f32[0] \
                and f32[1] and a[0].dim() >= 1 and a[1].dim() >= 2:
            p = self._perm(a[0].shape[-1])
            a[0], a[1] = a[0][..., p], a[1][..., p, :]
        elif func is torch.addmm and len(a) >= 3 and f32[1] and f32[2]:
            p = self._perm(a[1].shape[1])
            a[1], a[2] = a[1][:, p], a[2][p, :]
        return func(*a, **kwargs)


NOISES = ("tf32", "reorder", "bf16-amp")


def noise_context(noise: str, seed: int) -> Any:
    if noise == "tf32":
        return emulate_tf32()
    if noise == "reorder":
        return ReorderedReductions(seed)
    if noise == "bf16-amp":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


# --------------------------------------------------------------------------- bugs

WEIGHT_TYPES = ("Linear", "Conv2d", "Conv1D")
NORM_TYPES = ("BatchNorm2d", "LayerNorm")
ACT_TYPES = ("ReLU", "GELUActivation", "NewGELUActivation")


def _pick(model: nn.Module, types: tuple[str, ...], rng: random.Random) -> str:
    names = [n for n, m in model.named_modules() if type(m).__name__ in types and n]
    return rng.choice(names)


def bug_weight(factor: float) -> Callable[[nn.Module, random.Random], str]:
    def apply(model: nn.Module, rng: random.Random) -> str:
        name = _pick(model, WEIGHT_TYPES, rng)
        with torch.no_grad():
            model.get_submodule(name).weight.mul_(factor)
        return name

    return apply


def bug_eps(model: nn.Module, rng: random.Random) -> str:
    name = _pick(model, NORM_TYPES, rng)
    model.get_submodule(name).eps = 1e-3
    return name


def bug_activation(model: nn.Module, rng: random.Random) -> str:
    name = _pick(model, ACT_TYPES, rng)
    old = model.get_submodule(name)
    new: nn.Module = nn.SiLU() if isinstance(old, nn.ReLU) else nn.ReLU()
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)
    return name


BUGS: dict[str, Callable[[nn.Module, random.Random], str]] = {
    "weight x1.01": bug_weight(1.01),
    "weight x1.001": bug_weight(1.001),
    "norm eps -> 1e-3": bug_eps,
    "wrong activation": bug_activation,
}

MODES: dict[str, dict[str, Any]] = {
    "strict": {},
    "loose 1e-2": {"rtol": 1e-2, "atol": 1e-2},
    "calibrated": {"tolerance": "calibrated"},
}

# --------------------------------------------------------------------------- runs


def run(models: list[str], seeds: int, log: Any = sys.stderr) -> dict[str, Any]:
    # results[model][noise][case][mode] -> list of (flagged, localized)
    results: dict[str, Any] = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    multiples: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as d:
        for mname in models:
            build = MODELS[mname][1]
            for seed in range(seeds):
                t0 = time.time()
                model, x = build(seed)
                path = os.path.join(d, f"{mname}-{seed}.h5")
                ag.record(model, x, path=path, calibrate=True)
                for noise in NOISES:
                    cases: list[tuple[str, nn.Module, str | None]] = [("clean", model, None)]
                    for bi, (bname, bug) in enumerate(BUGS.items()):
                        bad = copy.deepcopy(model)
                        layer = bug(bad, random.Random(seed * 100 + bi))
                        cases.append((bname, bad, layer))
                    for case, m, layer in cases:
                        for mode, opts in MODES.items():
                            with noise_context(noise, seed):
                                rep = ag.compare(m, x, path=path, allow_dtype_change=True, **opts)
                            fd = rep.first_divergence
                            flagged = not rep.ok
                            localized = flagged and layer is not None and fd is not None and fd.name == layer
                            results[mname][noise][case][mode].append((flagged, localized))
                            if mode == "calibrated":
                                if case == "clean":
                                    multiples[f"{mname}/{noise}/clean"].append(
                                        max(r.error_multiple or 0.0 for r in rep.layers))
                                elif fd is not None and fd.error_multiple is not None and localized:
                                    multiples[f"{mname}/{noise}/{case}"].append(fd.error_multiple)
                print(f"  {mname} seed {seed}: {time.time() - t0:.1f}s", file=log, flush=True)
    return {"results": results, "multiples": multiples}


def _pct(xs: list[bool]) -> str:
    return f"{100.0 * sum(xs) / len(xs):.0f}%" if xs else "-"


def table(models: list[str], seeds: int, data: dict[str, Any]) -> str:
    res = data["results"]
    modes = list(MODES)
    lines = [
        f"Seeds per cell: {seeds}. False alarm = clean run flagged. Detection = first divergence "
        "reported at exactly the layer with the bug (a flag elsewhere does not count).",
        "",
        "| model | perturbation | " + " | ".join(f"false alarm: {m}" for m in modes) + " | "
        + " | ".join(f"detected: {m}" for m in modes) + " |",
        "|---|---|" + "---:|" * (2 * len(modes)),
    ]
    for mname in models:
        for noise in NOISES:
            cell = res[mname][noise]
            fa = [_pct([f for f, _ in cell["clean"][m]]) for m in modes]
            det = [_pct([loc for b in BUGS for _, loc in cell[b][m]]) for m in modes]
            lines.append(f"| {model_label(mname)} | {noise} | " + " | ".join(fa) + " | " + " | ".join(det) + " |")
    lines += ["", "Detection by bug and perturbation (all models pooled):", "",
              "| bug | perturbation | " + " | ".join(modes) + " |", "|---|---|" + "---:|" * len(modes)]
    for b in BUGS:
        for nz in NOISES:
            row = [_pct([loc for mn in models for _, loc in res[mn][nz][b][m]]) for m in modes]
            lines.append(f"| {b} | {nz} | " + " | ".join(row) + " |")
    lines += ["", "Calibrated error multiples (error / allowance; fails above 1), median [min, max]:", "",
              "| case | median | min | max |", "|---|---:|---:|---:|"]
    for key in sorted(data["multiples"]):
        v = sorted(data["multiples"][key])
        if v:
            lines.append(f"| {key} | {v[len(v) // 2]:.3g} | {v[0]:.3g} | {v[-1]:.3g} |")
    return "\n".join(lines)


def model_label(mname: str) -> str:
    return MODELS[mname][0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json", help="also write the raw counts here")
    ap.add_argument("--from-json", help="print the tables of an earlier --json run instead of running")
    ns = ap.parse_args(argv)
    models = [m for m in ns.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {sorted(MODELS)}")
    if ns.from_json:
        with open(ns.from_json) as fh:
            data = json.load(fh)
        first = data["results"][models[0]][NOISES[0]]["clean"]["strict"]
        print(table(models, len(first), data))
        return 0
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    data = run(models, ns.seeds)
    print(table(models, ns.seeds, data))
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(json.loads(json.dumps(data)), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Replay benchmark: does ``report.origin`` name the layer that really changed, under drift?

For tiny random-weight models built from ``transformers`` configs (no downloads) -- BERT, GPT-2,
ViT, T5, Llama, Whisper, ResNet, ConvNeXt -- a calibrated golden is recorded on the CPU in float32,
then each model is compared under two benign noise conditions that make every layer drift:

- ``tf32``: float32 matmul/convolution operands rounded to TF32 (``activation_guard.emulate_tf32``),
  what a GPU with ``allow_tf32`` computes;
- ``reorder``: every float32 matmul/convolution sums its products in another order (the contraction
  dimension permuted on both operands; ``calibration_table.ReorderedReductions``), as another
  kernel, BLAS or thread count does.

Under each condition the model runs once clean (several seeds: false alarms) and once per injected
fault; the fault's *expected origin* is what the origin semantics define (docs/replay.md):

==========================  =====================================================  ==============
fault                       injected                                               expected origin
==========================  =====================================================  ==============
``weight x1.01``            one called Linear/Conv weight scaled by 1.01            that layer (layer)
``GELU -> tanh``            one GELU module replaced by the tanh-approximate one    that module (layer)
                            (GPT-2's GELU is the tanh one: replaced by the exact)
``GELU -> tanh in parent``  that activation module removed, the parent calls the   the parent (parent-code)
                            tanh function in its own forward (the issue's case)
``norm eps -> 1e-4``        one called LayerNorm/RMSNorm/BatchNorm epsilon         that norm (layer)
``dropout left on``         one called Dropout/DropPath (p > 0) put in train mode;  that module (layer) /
                            Llama, Whisper (functional dropout): one attention or  that module (parent-code)
                            layer module's own ``training`` flag set
``ReLU -> leaky``           one called ReLU replaced by LeakyReLU(0.01)             that module (layer)
==========================  =====================================================  ==============

A fault is *found* when ``compare(..., tolerance="calibrated", replay="all")`` reports an origin
with the expected name and kind. For contrast, plain calibrated ``replay="off"`` counts as found
when its first divergence is the expected layer (it has no origin). A false alarm is a clean run
that is not OK. ``--cost`` part: compare time with ``replay="all"`` and ``"first"`` against a plain
``replay="off"`` compare, interleaved and repeated in one process (medians), so the ratios hold on
a shared machine.

    python benchmarks/replay_table.py [--seeds 3] [--models bert,gpt2] [--repeat 5] [--json out.json]
    python benchmarks/replay_table.py --quick    # a smoke run in seconds (the test suite's)

Prints markdown tables (docs/replay.md quotes them). One file of about 570 lines on purpose: a
script whose models, faults and tables are read together when a row changes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from datetime import date
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import activation_guard as ag

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calibration_table import ReorderedReductions  # a sibling script, not a package

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

# --------------------------------------------------------------------------- models


def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _ids(g: torch.Generator, n: int = 12) -> torch.Tensor:
    return torch.randint(5, 128, (2, n), generator=g)


# initializer_range 0.2 (not 0.02): activations of order 1, as in trained models, so that a GELU
# approximation or an epsilon is a real change on these inputs and not one below float32 noise.
INIT = 0.2


def build_bert(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32, initializer_range=INIT,
                           attn_implementation="eager")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return _tf().BertModel(cfg).eval(), ((_ids(g),), {})


def build_gpt2(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=32, initializer_range=INIT,
                           attn_implementation="eager")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return _tf().GPT2Model(cfg).eval(), ((_ids(g),), {})


def build_vit(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                          initializer_range=INIT, attn_implementation="eager")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return _tf().ViTModel(cfg).eval(), ((torch.randn(2, 3, 16, 16, generator=g),), {})


def build_t5(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                         decoder_start_token_id=0)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    ids = _ids(g)
    return _tf().T5Model(cfg).eval(), ((ids,), {"decoder_input_ids": ids[:, :6]})


def build_llama(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                            attention_dropout=0.1, initializer_range=INIT, attn_implementation="eager")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return _tf().LlamaModel(cfg).eval(), ((_ids(g),), {})


def build_whisper(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().WhisperConfig(vocab_size=128, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                              decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, dropout=0.1, init_std=INIT,
                              attn_implementation="eager")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(2, 16, 32, generator=g)  # log-mel features: batch, mel bins, 2 x source positions
    return _tf().WhisperModel(cfg).eval(), ((features,), {"decoder_input_ids": _ids(g, 6)})


def _trained_batchnorm(model: nn.Module, g: torch.Generator) -> None:
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        n = bn.num_features  # trained-looking statistics, so eval-mode BN does something
        bn.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
        bn.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        bn.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
        bn.bias.data.copy_(torch.randn(n, generator=g) * 0.1)


def build_resnet(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = _tf().ResNetModel(cfg).eval()
    _trained_batchnorm(model, g)
    return model, ((torch.randn(2, 3, 32, 32, generator=g),), {})


def build_convnext(seed: int) -> tuple[nn.Module, Inputs]:
    # layer scale 1 (not 1e-6): a trained block's branch contributes at order 1
    cfg = _tf().ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, drop_path_rate=0.1,
                               layer_scale_init_value=1.0, initializer_range=INIT)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return _tf().ConvNextModel(cfg).eval(), ((torch.randn(2, 3, 32, 32, generator=g),), {})


MODELS: dict[str, tuple[str, Callable[[int], tuple[nn.Module, Inputs]]]] = {
    "bert": ("BERT (token ids)", build_bert),
    "gpt2": ("GPT-2 (token ids)", build_gpt2),
    "vit": ("ViT (pixel values)", build_vit),
    "t5": ("T5 (ids + decoder ids)", build_t5),
    "llama": ("Llama (token ids, KV cache)", build_llama),
    "whisper": ("Whisper (audio features + decoder ids)", build_whisper),
    "resnet": ("ResNet (pixel values)", build_resnet),
    "convnext": ("ConvNeXt (pixel values)", build_convnext),
}

def build_bert_medium(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                           intermediate_size=1024, max_position_embeddings=256, attn_implementation="eager")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return _tf().BertModel(cfg).eval(), ((torch.randint(5, 1000, (2, 128), generator=g),), {})


def build_llama_medium(seed: int) -> tuple[nn.Module, Inputs]:
    cfg = _tf().LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            attn_implementation="eager")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return _tf().LlamaModel(cfg).eval(), ((torch.randint(5, 1000, (2, 128), generator=g),), {})


# larger models for the cost table only: compute, not per-call overhead, dominates
MEDIUM: dict[str, tuple[str, Callable[[int], tuple[nn.Module, Inputs]]]] = {
    "bert-256": ("BERT, hidden 256, 4 layers, 2x128 tokens", build_bert_medium),
    "llama-256": ("Llama, hidden 256, 4 layers, 2x128 tokens", build_llama_medium),
}

# --------------------------------------------------------------------------- faults


@dataclass
class Fault:
    """An injected change and where replay should say it was made."""

    target: str
    kind: str  # "layer" or "parent-code"
    what: str


def called_modules(model: nn.Module, inputs: Inputs) -> dict[str, nn.Module]:
    """Modules the forward actually calls (a registered but unused Dropout changes nothing)."""
    names = {id(m): n for n, m in model.named_modules()}
    seen: dict[str, nn.Module] = {}

    def pre(mod: nn.Module, _: Any) -> None:
        seen[names[id(mod)]] = mod

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*inputs[0], **inputs[1])
    finally:
        for h in handles:
            h.remove()
    return seen


def _replace(model: nn.Module, name: str, new: Any) -> None:
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if isinstance(new, nn.Module):
        setattr(owner, attr, new)
    else:  # a plain function: no longer a child module, it runs as the parent's own code
        del owner._modules[attr]
        object.__setattr__(owner, attr, new)


def _pick(called: dict[str, nn.Module], rng: random.Random, keep: Callable[[str, nn.Module], bool]) -> str | None:
    names = sorted(n for n, m in called.items() if n and keep(n, m))
    return rng.choice(names) if names else None


def _is_gelu(m: nn.Module) -> bool:
    return type(m).__name__ in ("GELUActivation", "NewGELUActivation", "GELU")


def _gelu_swap(m: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    if type(m).__name__ == "NewGELUActivation" or getattr(m, "approximate", "none") == "tanh":
        return gelu_exact, "tanh GELU -> exact GELU"
    return gelu_tanh, "GELU -> tanh GELU"


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


class Activation(nn.Module):
    """An activation module around a function (what a fixed-up activation class looks like)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def fault_weight(model: nn.Module, called: dict[str, nn.Module], rng: random.Random) -> Fault | None:
    name = _pick(called, rng, lambda _, m: type(m).__name__ in ("Linear", "Conv1D", "Conv1d", "Conv2d"))
    if name is None:
        return None
    with torch.no_grad():
        model.get_submodule(name).weight.mul_(1.01)
    return Fault(name, "layer", "weight x1.01")


def fault_gelu(model: nn.Module, called: dict[str, nn.Module], rng: random.Random) -> Fault | None:
    name = _pick(called, rng, lambda _, m: _is_gelu(m))
    if name is None:
        return None
    fn, what = _gelu_swap(model.get_submodule(name))
    _replace(model, name, Activation(fn))
    return Fault(name, "layer", what)


def fault_gelu_in_parent(model: nn.Module, called: dict[str, nn.Module], rng: random.Random) -> Fault | None:
    name = _pick(called, rng, lambda _, m: _is_gelu(m))
    if name is None:
        return None
    fn, what = _gelu_swap(model.get_submodule(name))
    _replace(model, name, fn)
    return Fault(name.rpartition(".")[0], "parent-code", f"{what} as a function in the parent")


NORMS = ("LayerNorm", "BatchNorm2d", "T5LayerNorm", "LlamaRMSNorm", "ConvNextLayerNorm")


def fault_eps(model: nn.Module, called: dict[str, nn.Module], rng: random.Random) -> Fault | None:
    name = _pick(called, rng, lambda _, m: type(m).__name__ in NORMS)
    if name is None:
        return None
    m = model.get_submodule(name)
    attr = "eps" if hasattr(m, "eps") else "variance_epsilon"
    old = getattr(m, attr)
    setattr(m, attr, 1e-4)
    return Fault(name, "layer", f"{type(m).__name__} eps {old:g} -> 1e-4")


FUNCTIONAL_DROPOUT = {"LlamaAttention": "attention_dropout", "WhisperEncoderLayer": "dropout",
                      "WhisperDecoderLayer": "dropout"}


def fault_dropout(model: nn.Module, called: dict[str, nn.Module], rng: random.Random) -> Fault | None:
    def stochastic(_: str, m: nn.Module) -> bool:
        return ((isinstance(m, nn.Dropout) and m.p > 0)
                or (type(m).__name__ == "ConvNextDropPath" and getattr(m, "drop_prob", 0) > 0))

    name = _pick(called, rng, stochastic)
    if name is not None:
        model.get_submodule(name).train()
        return Fault(name, "layer", f"{type(called[name]).__name__} in train mode")
    name = _pick(called, rng, lambda _, m: getattr(m, FUNCTIONAL_DROPOUT.get(type(m).__name__, ""), 0) > 0)
    if name is None:
        return None
    model.get_submodule(name).training = True  # this module only: its own F.dropout calls draw
    return Fault(name, "parent-code", f"{type(called[name]).__name__}.training = True (functional dropout)")


def fault_relu(model: nn.Module, called: dict[str, nn.Module], rng: random.Random) -> Fault | None:
    name = _pick(called, rng, lambda _, m: isinstance(m, nn.ReLU))
    if name is None:
        return None
    _replace(model, name, nn.LeakyReLU(0.01))
    return Fault(name, "layer", "ReLU -> LeakyReLU(0.01)")


FAULTS: dict[str, Callable[[nn.Module, dict[str, nn.Module], random.Random], Fault | None]] = {
    "weight x1.01": fault_weight,
    "GELU -> tanh": fault_gelu,
    "GELU -> tanh in parent": fault_gelu_in_parent,
    "norm eps -> 1e-4": fault_eps,
    "dropout left on": fault_dropout,
    "ReLU -> leaky": fault_relu,
}

# --------------------------------------------------------------------------- runs

CONDITIONS = ("tf32", "reorder")
MODES: dict[str, dict[str, Any]] = {
    "all": {"tolerance": "calibrated", "replay": "all"},
    "off": {"tolerance": "calibrated", "replay": "off"},
}


def noise(condition: str, seed: int) -> AbstractContextManager[Any]:
    return ag.emulate_tf32() if condition == "tf32" else ReorderedReductions(seed)


@dataclass
class Outcome:
    ok: bool
    found: bool
    got: str  # what the run named: "kind name" of the origin (all) or the first divergence (off)


def judge_run(report: ag.Report, mode: str, fault: Fault | None) -> Outcome:
    if mode == "all":
        o = report.origin
        got = "-" if o is None else f"{o.kind} {o.name or '<root>'}"
        found = fault is not None and o is not None and (o.name, o.kind) == (fault.target, fault.kind)
    else:
        fd = report.first_divergence
        got = "-" if fd is None else f"first divergence {fd.name or '<root>'}"
        found = fault is not None and fd is not None and fd.name == fault.target
    return Outcome(report.ok, found, got)


def run(models: list[str], seeds: int, log: Any = sys.stderr) -> dict[str, Any]:
    """results[model][condition][case][mode] -> [Outcome...]; targets[model][fault] -> [Fault...]."""
    results: Any = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    targets: Any = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory() as d:
        for mname in models:
            for seed in range(seeds):
                t0 = time.perf_counter()
                model, inputs = MODELS[mname][1](seed)
                path = os.path.join(d, f"{mname}-{seed}.h5")
                ag.record(model, *inputs, path=path, calibrate=True)
                called = called_modules(model, inputs)
                cases: list[tuple[str, nn.Module, Fault | None]] = [("clean", model, None)]
                for i, (fname, inject) in enumerate(FAULTS.items()):
                    bad = copy.deepcopy(model)
                    fault = inject(bad, called, random.Random(1000 * seed + i))
                    targets[mname][fname].append(fault)
                    if fault is not None:
                        cases.append((fname, bad, fault))
                for condition in CONDITIONS:
                    for case, m, fault in cases:
                        for mode, opts in MODES.items():
                            with noise(condition, seed):
                                report = ag.compare(m, *inputs, path=path, **opts)
                            results[mname][condition][case][mode].append(judge_run(report, mode, fault))
                print(f"  {mname} seed {seed}: {time.perf_counter() - t0:.1f}s", file=log, flush=True)
    return {"results": results, "targets": targets}


# --------------------------------------------------------------------------- cost


def cost(models: list[str], repeat: int, log: Any = sys.stderr) -> dict[str, dict[str, float]]:
    """Best compare seconds of ``repeat`` runs per replay setting (strict and calibrated), interleaved:
    on a shared machine other processes only ever add time, so the best run is the steadiest figure."""
    out: dict[str, dict[str, float]] = {}
    settings = {"off": {"replay": "off"}, "first": {"replay": "first"}, "all": {"replay": "all"},
                "cal off": {"replay": "off", "tolerance": "calibrated"},
                "cal all": {"replay": "all", "tolerance": "calibrated"}}
    with tempfile.TemporaryDirectory() as d:
        for mname in models:
            model, inputs = {**MODELS, **MEDIUM}[mname][1](0)
            path = os.path.join(d, f"{mname}.h5")
            ag.record(model, *inputs, path=path, calibrate=True)
            times: dict[str, list[float]] = defaultdict(list)
            for opts in settings.values():  # warm-up (first-call imports and allocations)
                ag.compare(model, *inputs, path=path, **opts)
            for _ in range(repeat):
                for k, opts in settings.items():
                    t0 = time.perf_counter()
                    ag.compare(model, *inputs, path=path, **opts)
                    times[k].append(time.perf_counter() - t0)
            out[mname] = {k: min(v) for k, v in times.items()}
            print(f"  cost {mname}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in out[mname].items()),
                  file=log, flush=True)
    return out


# --------------------------------------------------------------------------- tables


def _frac(xs: list[bool]) -> str:
    return f"{sum(xs)}/{len(xs)}" if xs else "n/a"


def tables(models: list[str], seeds: int, data: dict[str, Any]) -> str:
    res, targets = data["results"], data["targets"]
    faults = list(FAULTS)
    head = "| model | noise | false alarms | " + " | ".join(faults) + " |"
    rule = "|---|---|---:|" + "---:|" * len(faults)
    lines = [f"Seeds: {seeds} per model (weights, inputs, which layer gets the fault, reduction order). "
             "Cells: runs whose verdict named the injected place / runs; n/a: the model has no such layer.", "",
             '**replay="all", tolerance="calibrated"**: found = `report.origin` has the expected name and kind; '
             "false alarm = a clean run not OK.", "", head, rule]
    for mode in MODES:
        if mode == "off":
            lines += ["", '**replay="off", tolerance="calibrated"** (contrast): found = the first divergence is '
                      "the expected layer; in brackets, runs flagged at all.", "", head, rule]
        for mname in models:
            for cond in CONDITIONS:
                cell = res[mname][cond]
                fa = _frac([not o.ok for o in cell["clean"][mode]])
                row = []
                for f in faults:
                    outs = cell[f][mode]
                    s = _frac([o.found for o in outs])
                    if outs and mode == "off":
                        s += f" ({sum(not o.ok for o in outs)})"
                    row.append(s)
                lines.append(f"| {MODELS[mname][0]} | {cond} | {fa} | " + " | ".join(row) + " |")
    lines += ["", "Injected places (seed 0) and the expected origin:", "", "| model | fault | change | expected |",
              "|---|---|---|---|"]
    for mname in models:
        for f in faults:
            fl = targets[mname][f]
            if fl and fl[0] is not None:
                lines.append(f"| {mname} | {f} | {fl[0].what} | {fl[0].kind} `{fl[0].target}` |")
    misses = [f"- {mname} / {cond} / {f} (seed {i}): expected {targets[mname][f][i].kind} "
              f"`{targets[mname][f][i].target}`, got {o.got}"
              for mname in models for cond in CONDITIONS for f in faults
              for i, o in enumerate(res[mname][cond][f]["all"]) if not o.found]
    alarms = [f"- {mname} / {cond} (seed {i}): clean run named {o.got}"
              for mname in models for cond in CONDITIONS for i, o in enumerate(res[mname][cond]["clean"]["all"])
              if not o.ok]
    lines += ["", 'Misses with replay="all": ' + ("none" if not misses else ""), *misses,
              'False alarms with replay="all": ' + ("none" if not alarms else ""), *alarms]
    return "\n".join(lines)


def cost_table(data: dict[str, dict[str, float]]) -> str:
    lines = ["| model | off (ms) | first | all | cal off (ms) | cal all |", "|---|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for mname, t in data.items():
        ratio = t["all"] / t["off"]
        worst = max(worst, ratio)
        lines.append(f"| {mname} | {t['off'] * 1e3:.0f} | {t['first'] / t['off']:.2f}x | {ratio:.2f}x | "
                     f"{t['cal off'] * 1e3:.0f} | {t['cal all'] / t['cal off']:.2f}x |")
    lines += ["", f"[{'met' if worst <= 3 else 'MISS'}] replay=\"all\" <= 3x a plain compare (replay=\"off\", strict): "
              f"worst {worst:.2f}x"]
    return "\n".join(lines)


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeat", type=int, default=11, help="timed repeats per setting for the cost table")
    ap.add_argument("--no-cost", action="store_true", help="skip the cost table")
    ap.add_argument("--no-table", action="store_true", help="skip the attribution table")
    ap.add_argument("--quick", action="store_true", help="bert and resnet, one seed, one repeat: seconds")
    ap.add_argument("--json", help="also write the raw outcomes and timings here")
    ns = ap.parse_args(argv)
    models = [m for m in ns.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {sorted(MODELS)}")
    if ns.quick:
        models, ns.seeds, ns.repeat = ["bert", "resnet"], 1, 1
    out: dict[str, Any] = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                           "torch": torch.__version__, "date": date.today().isoformat(), "seeds": ns.seeds}
    print(f"activation_guard {ag.__version__}, torch {torch.__version__}, {out['machine']}, 1 thread, {out['date']}")
    with threads(1):
        if not ns.no_table:
            data = run(models, ns.seeds)
            print(tables(models, ns.seeds, data))
            out["results"] = {m: {c: {case: {mode: [asdict(o) for o in v] for mode, v in modes.items()}
                                      for case, modes in cs.items() if any(modes.values())}  # not n/a
                                  for c, cs in conds.items()}
                              for m, conds in data["results"].items()}
        if not ns.no_cost:
            timings = cost(models + ([] if ns.quick else list(MEDIUM)), ns.repeat)
            print(f"\nCompare time, best of {ns.repeat} interleaved runs; ratios to the compare on their left "
                  f"(off: strict, replay=\"off\"):\n")
            print(cost_table(timings))
            out["cost"] = timings
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

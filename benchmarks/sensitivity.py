#!/usr/bin/env python
"""Sensitivity of int8-quantized tiny BERT and Llama (torchao): is the keep-in-float advice worth it,
and what does the report cost?

Advice: outliers are planted in two Linear modules of each model (a few input columns of the
module's weight x50, the rows producing those inputs x1/50: the float function is unchanged), the
model is quantized (torchao int8 weight-only and int8 dynamic), and ``activation_guard.sensitivity``
closes the loop: the model quantized again without the k advised modules, without k random ones
(median of 10 seeded draws) and without the last k, each end-to-end SQNR gain beside the others.

Cost: ``sensitivity(q, x, path=golden)`` (no closed loop) against ``compare(q, x, path=golden,
replay="all")`` on the same quantized model, alternately ``--repeat`` times each in one process
(a busy machine slows both alike): the ratio of the fastest runs and of the medians. Target: at
most 2x. Models: the two tiny ones above and a Llama of 4 layers, hidden 128, 64 tokens.

    python benchmarks/sensitivity.py [--repeat 5] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import activation_guard as ag

TARGET = 2.0
Quantize = Callable[[torch.nn.Module, set[str]], torch.nn.Module]


def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def bert() -> torch.nn.Module:
    tf = _tf()
    torch.manual_seed(0)
    return tf.BertModel(tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32, initializer_range=0.2,
                                      attn_implementation="eager")).eval()


def llama(hidden: int = 32, layers: int = 2, vocab: int = 64) -> torch.nn.Module:
    tf = _tf()
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                              num_attention_heads=2, num_key_value_heads=2,
                                              intermediate_size=2 * hidden, max_position_embeddings=64,
                                              initializer_range=0.2, attn_implementation="eager")).eval()


PLANTS = {
    "bert": (bert, (("encoder.layer.0.attention.self.value", "encoder.layer.0.attention.output.dense"),
                    ("encoder.layer.1.attention.self.value", "encoder.layer.1.attention.output.dense"))),
    "llama": (llama, (("model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"),
                      ("model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj"))),
}


def plant(model: torch.nn.Module, producer: str, consumer: str, cols: tuple[int, ...] = (1, 5, 9)) -> None:
    p, c = model.get_submodule(producer), model.get_submodule(consumer)
    with torch.no_grad():
        p.weight[list(cols)] /= 50
        if p.bias is not None:
            p.bias[list(cols)] /= 50
        c.weight[:, list(cols)] *= 50


def quantizer(kind: str) -> Quantize:
    import torchao.quantization as tq

    config = {"int8 weight-only": tq.Int8WeightOnlyConfig, "int8 dynamic": tq.Int8DynamicActivationInt8WeightConfig}

    def quantize(model: torch.nn.Module, skip: set[str]) -> torch.nn.Module:
        tq.quantize_(model, config[kind](), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn not in skip)
        return model

    return quantize


def tokens(n: int, vocab: int = 64) -> tuple[torch.Tensor]:
    return (torch.randint(3, vocab, (2, n), generator=torch.Generator().manual_seed(1)),)


def advice(d: str) -> list[dict[str, Any]]:
    rows = []
    for name, (build, pairs) in PLANTS.items():
        model = build()
        for producer, consumer in pairs:
            plant(model, producer, consumer)
        x = tokens(7)
        golden = os.path.join(d, f"{name}.h5")
        ag.record(model, x, path=golden)
        for kind in ("int8 weight-only", "int8 dynamic"):
            quantize = quantizer(kind)
            q = quantize(copy.deepcopy(model), set())
            rep = ag.sensitivity(q, x, path=golden, quantize=quantize, reference=model)
            cl = rep.closed_loop
            assert cl is not None
            top2 = {r.name for r in rep.rows[:2]} == {c for _, c in pairs}
            rows.append({"model": name, "kind": kind, "k": cl.k, "top2 planted": top2,
                         "baseline": cl.baseline_sqnr_db, "advised": cl.advised_gain_db, "random": cl.random_gain_db,
                         "last": cl.last_gain_db, "worth": cl.worth_it})
    return rows


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cost(d: str, name: str, model: torch.nn.Module, x: tuple[torch.Tensor], repeat: int) -> dict[str, Any]:
    golden = os.path.join(d, f"cost-{name}.h5")
    ag.record(model, x, path=golden)
    q = quantizer("int8 weight-only")(copy.deepcopy(model), set())
    ag.sensitivity(q, x, path=golden)  # warm both paths
    ag.compare(q, x, path=golden, replay="all")
    runs: dict[str, list[float]] = {"compare": [], "sensitivity": []}
    for _ in range(repeat):
        runs["compare"].append(_time(lambda: ag.compare(q, x, path=golden, replay="all")))
        runs["sensitivity"].append(_time(lambda: ag.sensitivity(q, x, path=golden)))
    best = {k: min(v) for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"model": name, "compare ms": 1e3 * best["compare"], "sensitivity ms": 1e3 * best["sensitivity"],
            "ratio": best["sensitivity"] / best["compare"], "ratio of medians": med["sensitivity"] / med["compare"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one repeat, tiny models only")
    opts = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        rows = advice(d)
        print("== keep-in-float advice: end-to-end SQNR gain (dB) from keeping k modules in float")
        print(f"{'model':<6} {'quantization':<17} {'k':>2} {'top-2 = planted':>15} {'baseline dB':>11} "
              f"{'advised':>8} {'random (median of 10)':>22} {'last k':>7}  worth it")
        for r in rows:
            print(f"{r['model']:<6} {r['kind']:<17} {r['k']:>2} {r['top2 planted']!s:>15} {r['baseline']:>11.1f} "
                  f"{r['advised']:>+8.1f} {r['random']:>+22.1f} {r['last']:>+7.1f}  {r['worth']}")
        models: list[tuple[str, torch.nn.Module, tuple[torch.Tensor]]] = [
            ("bert-2x32", bert(), tokens(7)), ("llama-2x32", llama(), tokens(7))]
        if not opts.quick:
            models.append(("llama-4x128", llama(hidden=128, layers=4, vocab=512), tokens(64, 512)))
        costs = [cost(d, n, m, x, 1 if opts.quick else opts.repeat) for n, m, x in models]
    print("== cost: sensitivity() against compare(replay='all') on the same int8 weight-only model")
    print(f"{'model':<12} {'compare ms':>10} {'sensitivity ms':>14} {'ratio':>6} {'(median)':>8}")
    for c in costs:
        print(f"{c['model']:<12} {c['compare ms']:>10.1f} {c['sensitivity ms']:>14.1f} {c['ratio']:>6.2f} "
              f"{c['ratio of medians']:>8.2f}")
    print(f"worst ratio {max(c['ratio'] for c in costs):.2f} (target <= {TARGET})")


if __name__ == "__main__":
    main()

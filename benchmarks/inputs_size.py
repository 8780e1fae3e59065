#!/usr/bin/env python
"""Golden size with each layer call's inputs recorded, against outputs only.

Inputs make replay possible; most of them are aliases of values already stored (the previous
layer's output, the model input passed on). Target: <= 1.5x the outputs-only golden on BERT, GPT-2
and a ResNet built from transformers configs (random weights, no downloads). Prints sizes, the
ratio, how many input leaves were stored as aliases, and record times side by side.

    python benchmarks/inputs_size.py
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from typing import Any

import torch

import activation_guard as ag


def _models() -> dict[str, tuple[torch.nn.Module, tuple[Any, ...]]]:
    from transformers import (
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2LMHeadModel,
        ResNetConfig,
        ResNetModel,
    )

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 64))
    bert = BertModel(BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_size=512)).eval()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4, n_positions=128)).eval()
    resnet = ResNetModel(ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                                      layer_type="basic")).eval()
    return {
        "BERT (4 layers, hidden 128, 2x64 tokens)": (bert, (ids,)),
        "GPT-2 (4 layers, hidden 128, 2x64 tokens)": (gpt2, (ids,)),
        "ResNet (basic, 4 stages, 2x3x64x64)": (resnet, (torch.randn(2, 3, 64, 64),)),
    }


def _aliases(path: str) -> tuple[int, int]:
    with ag.read_golden(path) as g:
        leaves = [leaf for c in g.calls for leaf in (c.inputs or [])]
    return sum(1 for leaf in leaves if leaf.kind == "alias"), sum(1 for leaf in leaves if leaf.kind == "tensor")


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"{'model':<44} {'outputs only':>12} {'with inputs':>12} {'ratio':>6} {'aliased':>8} {'stored':>7}"
          f" {'rec t ratio':>11}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as d:
        for name, (model, args) in _models().items():
            a, b = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
            t0 = time.perf_counter()
            ag.record(model, args, path=a, inputs=False)
            t1 = time.perf_counter()
            ag.record(model, args, path=b)
            t2 = time.perf_counter()
            sa, sb = os.path.getsize(a), os.path.getsize(b)
            aliased, stored = _aliases(b)
            worst = max(worst, sb / sa)
            print(f"{name:<44} {sa / 1e6:>10.2f}MB {sb / 1e6:>10.2f}MB {sb / sa:>5.2f}x {aliased:>8} {stored:>7}"
                  f" {(t2 - t1) / (t1 - t0):>10.2f}x")
    print(f"[{'met ' if worst <= 1.5 else 'MISS'}] golden with inputs <= 1.5x outputs only: worst {worst:.2f}x")


if __name__ == "__main__":
    main()

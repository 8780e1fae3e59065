#!/usr/bin/env python
"""What comparing through the graph source costs: ``compare(ep.module(), ...)`` (the flattened
exported graph, run node by node under an FX interpreter) against ``compare(model, ...)`` (the
eager model with hooks), both against one eager golden, on the same model and inputs.

Target: at most 1.5x. Both compares run alternately, ``--repeat`` times each, in one process, so a
busy shared machine slows both alike; the ratio is that of the fastest run of each (the least
disturbed), printed next to the ratio of the medians, with a plain eager forward and a plain run
of the graph for scale. Models: the README's demo model (``activation_guard.api.demo.build``), a
GPT-2 (transformers, random weights from a config, 4 layers, hidden 128, 64 tokens) and a Llama
of the same size.

    python benchmarks/graph_cost.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import activation_guard as ag
from activation_guard.api.demo import build as build_demo

TARGET = 1.5


def demo() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    model, x = build_demo()
    return model, (x,), {}


def _tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1)),)


def gpt2() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2Model(cfg).eval(), _tokens(), {"use_cache": False}


def llama() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval(), _tokens(), {"use_cache": False}


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(name: str, build: Callable[[], tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]],
            repeat: int) -> dict[str, Any]:
    model, args, kwargs = build()
    with tempfile.TemporaryDirectory() as d:
        golden = os.path.join(d, "golden.h5")
        ag.record(model, args, kwargs, path=golden)
        graph = torch.export.export(model, args, kwargs).module()
        eager_report = ag.compare(model, args, kwargs, path=golden)
        graph_report = ag.compare(graph, args, kwargs, path=golden)
        assert eager_report.ok and graph_report.ok, (eager_report, graph_report)
        runs: dict[str, list[float]] = {"hooks": [], "graph": [], "forward": [], "graph run": []}
        with torch.no_grad():
            for _ in range(repeat):
                runs["hooks"].append(_time(lambda: ag.compare(model, args, kwargs, path=golden)))
                runs["graph"].append(_time(lambda: ag.compare(graph, args, kwargs, path=golden)))
                runs["forward"].append(_time(lambda: model(*args, **kwargs)))
                runs["graph run"].append(_time(lambda: graph(*args, **kwargs)))
    best = {k: min(v) for k, v in runs.items()}
    median = {k: statistics.median(v) for k, v in runs.items()}
    compared = sum(1 for r in graph_report.layers if r.status == "match")
    return {"model": name, "calls": len(eager_report.layers), "graph compared": compared, **{
        f"{k} ms": 1e3 * best[k] for k in runs}, "ratio": best["graph"] / best["hooks"],
        "ratio of medians": median["graph"] / median["hooks"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=7)
    opts = p.parse_args()
    torch.set_num_threads(1)
    rows = [measure(n, b, opts.repeat) for n, b in (("demo", demo), ("gpt2-4x128", gpt2), ("llama-4x128", llama))]
    print(f"{'model':<12} {'calls':>5} {'graph':>5} {'hooks ms':>9} {'graph ms':>9} {'ratio':>6} {'(median)':>8} "
          f"{'forward ms':>10} {'graph run ms':>12}")
    for r in rows:
        print(f"{r['model']:<12} {r['calls']:>5} {r['graph compared']:>5} {r['hooks ms']:>9.1f} {r['graph ms']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['ratio of medians']:>8.2f} {r['forward ms']:>10.1f} {r['graph run ms']:>12.1f}")
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio {worst:.2f} (target <= {TARGET})")


if __name__ == "__main__":
    main()

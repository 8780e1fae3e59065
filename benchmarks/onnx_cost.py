#!/usr/bin/env python
"""What ``compare_onnx`` costs against the least any per-module ONNX check must do: one ONNX
Runtime session and run with the same values marked as outputs, plus reading every value of the
golden.

Target: at most 1.5x. ``compare_onnx`` also runs a second, unmarked session with every
optimization on (the deployed model's outputs) and judges every value; the baseline does neither.
Both run alternately, ``--repeat`` times each, in one process, so a busy machine slows both alike;
the ratio of the fastest runs (the least disturbed) is printed next to the ratio of the medians.
Models: a GPT-2 and a Llama (transformers, random weights from a config, 4 layers, hidden 128,
64 tokens), exported once with ``torch.onnx.export(..., dynamo=True)``.

    python benchmarks/onnx_cost.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import activation_guard as ag
from activation_guard.api.runtime import compare_onnx
from activation_guard.runtimes.ort import OnnxGraph, OrtSource, session

TARGET = 1.5


def _tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1)),)


def gpt2() -> torch.nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                  attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2Model(cfg).eval()


def llama() -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, max_position_embeddings=128,
                                   attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def baseline(proto: Any, golden: str) -> Callable[[], None]:
    """One session with the values compare_onnx marks, one run, and every golden value read."""
    import onnx

    with ag.read_golden(golden) as reader:
        counts: dict[str, int] = {}
        for c in reader.calls:
            counts[c.name] = counts.get(c.name, 0) + 1
    graph = OnnxGraph(proto, lambda p: counts.get(p, 0))
    src = OrtSource(graph, {}, golden=lambda n, c: None, golden_calls=())
    extra = src._fetch()
    marked = onnx.ModelProto()
    marked.CopyFrom(proto)
    marked.graph.output.extend(onnx.ValueInfoProto(name=v) for v in extra)
    feeds = {graph.inputs[0]: _tokens()[0].numpy()}
    names = [*graph.outputs, *extra]

    def run() -> None:
        session(marked, "off").run(names, feeds)
        with ag.read_golden(golden) as reader:
            for _ in reader.iter_tensors():
                pass

    return run


def measure(name: str, build: Callable[[], torch.nn.Module], repeat: int, tmp: str) -> None:
    model = build()
    x = _tokens()
    golden = os.path.join(tmp, f"{name}.h5")
    ag.record(model, x, path=golden)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(model, x, dynamo=True, verbose=False).model_proto
    base = baseline(proto, golden)

    def ours() -> None:
        report = compare_onnx(proto, path=golden)
        assert report.ok, str(report)

    times: dict[str, list[float]] = {"baseline": [], "compare_onnx": []}
    for fn in (base, ours):  # warm-up
        fn()
    for _ in range(repeat):
        for key, fn in (("baseline", base), ("compare_onnx", ours)):
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    b, o = times["baseline"], times["compare_onnx"]
    best = min(o) / min(b)
    med = statistics.median(o) / statistics.median(b)
    verdict = "ok" if best <= TARGET else f"over the {TARGET}x target"
    feeds = {proto.graph.input[0].name: x[0].numpy()}
    unmarked = proto.SerializeToString()
    parts = {"unmarked optimized session + run": lambda: session(unmarked, "default").run(None, feeds),
             "scope analysis": lambda: OnnxGraph(proto)}
    extra = {k: min(_time(fn) for _ in range(repeat)) for k, fn in parts.items()}
    print(f"{name}: {len(proto.graph.node)} ONNX nodes")
    print(f"  baseline (1 marked session + run, golden read)  best {min(b) * 1e3:7.1f} ms  median "
          f"{statistics.median(b) * 1e3:7.1f} ms")
    print(f"  compare_onnx                                    best {min(o) * 1e3:7.1f} ms  median "
          f"{statistics.median(o) * 1e3:7.1f} ms")
    print("  of which, alone: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in extra.items()))
    print(f"  ratio: best {best:.2f}x, medians {med:.2f}x ({verdict})")


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in (("gpt2", gpt2), ("llama", llama)):
            measure(name, build, args.repeat, tmp)


if __name__ == "__main__":
    main()

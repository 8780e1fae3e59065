#!/usr/bin/env python
"""What ``compare_onnx`` costs against the least any per-module ONNX check must do: one ONNX
Runtime session and run with the same values marked as outputs, plus reading every value of the
golden.

Target: at most 1.5x. ``compare_onnx`` also runs a second, unmarked session with every
optimization on (the deployed model's outputs), on a second thread, and judges every value; the
baseline does neither. The baseline runs with ONNX Runtime's default thread pool and with one
thread, and the faster of the two (by median) is the baseline. All run alternately, ``--repeat``
times each, in one process, so a busy machine slows them alike; the ratio of the fastest runs (the
least disturbed) is printed next to the ratio of the medians, and the ratio of CPU time (every
thread's: what the ratio tends to when no core is free for the second thread). Models: a GPT-2
and a Llama (transformers, random weights from a config), tiny (4 layers, hidden 128, 2x64
tokens, the size the ONNX tests use) and realistic (GPT-2 hidden 768 x 6 layers, Llama hidden 512 x 8 layers,
1x128 tokens), each recorded and exported once with ``torch.onnx.export(..., dynamo=True)`` into
a temporary directory.

    python benchmarks/onnx_cost.py [--repeat 7] [--sizes tiny,realistic]
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
from activation_guard.runtimes.ort import OnnxGraph, OrtSource, session, split_cores

TARGET = 1.5


def _tokens(shape: tuple[int, int] = (2, 64)) -> tuple[torch.Tensor]:
    return (torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(1)),)


def gpt2(hidden: int = 128, layers: int = 4, heads: int = 4, vocab: int = 512) -> torch.nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=256,
                                  attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2Model(cfg).eval()


def llama(hidden: int = 128, layers: int = 4, heads: int = 4, vocab: int = 512) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   intermediate_size=hidden * 2 if hidden <= 128 else hidden * 8 // 3,
                                   max_position_embeddings=256, attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


# (name, builder, tokens' shape): tiny models (the ONNX tests' size), and models at a realistic size (hidden
# 512-768, 6-8 layers, 128 tokens)
MODELS: dict[str, list[tuple[str, Callable[[], torch.nn.Module], tuple[int, int]]]] = {
    "tiny": [("gpt2", gpt2, (2, 64)), ("llama", llama, (2, 64))],
    "realistic": [("gpt2 768x6", lambda: gpt2(768, 6, 12, 8192), (1, 128)),
                  ("llama 512x8", lambda: llama(512, 8, 8, 8192), (1, 128))],
}


def baseline(proto: Any, golden: str, x: torch.Tensor, threads: int) -> Callable[[], None]:
    """One session with the values compare_onnx marks (``threads`` intra-op threads, 0: ONNX
    Runtime's default), one run, and every golden value read."""
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
    feeds = {graph.inputs[0]: x.numpy()}
    names = [*graph.outputs, *extra]

    def run() -> None:
        session(marked, "off", threads).run(names, feeds)
        with ag.read_golden(golden) as reader:
            for _ in reader.iter_tensors():
                pass

    return run


def measure(name: str, build: Callable[[], torch.nn.Module], shape: tuple[int, int], repeat: int, tmp: str) -> None:
    model = build()
    x = _tokens(shape)
    golden = os.path.join(tmp, f"{name}.h5")
    ag.record(model, x, path=golden)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(model, x, dynamo=True, verbose=False).model_proto
    del model
    # the baseline at its best: ONNX Runtime's default thread pool or one thread, whichever is faster
    # here (a pool costs a small model more than it saves on a busy machine)
    bases = {t: baseline(proto, golden, x[0], t) for t in (0, 1)}

    def ours() -> None:
        report = compare_onnx(proto, path=golden)
        assert report.ok, str(report)

    runs: dict[str, Callable[[], None]] = {"baseline default threads": bases[0], "baseline 1 thread": bases[1],
                                           "compare_onnx": ours}
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # CPU time of every thread of the process
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(repeat):
        for key, fn in runs.items():
            c = time.process_time()
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
            cpu[key].append(time.process_time() - c)
    key = min(("baseline default threads", "baseline 1 thread"), key=lambda k: statistics.median(times[k]))
    b, o = times[key], times["compare_onnx"]
    best = min(o) / min(b)
    med = statistics.median(o) / statistics.median(b)
    verdict = "ok" if best <= TARGET and med <= TARGET else f"over the {TARGET}x target"
    feeds = {proto.graph.input[0].name: x[0].numpy()}
    unmarked = proto.SerializeToString()
    threads = split_cores()[1]
    parts = {f"unmarked optimized session + run ({threads} thread{'s' if threads > 1 else ''})":
             lambda: session(unmarked, "default", threads).run(None, feeds),
             "scope analysis": lambda: OnnxGraph(proto)}
    extra = {k: min(_time(fn) for _ in range(repeat)) for k, fn in parts.items()}
    mb = sum(t.ByteSize() for t in proto.graph.initializer) / 1e6
    print(f"{name}: {len(proto.graph.node)} ONNX nodes, {mb:.0f} MB of weights, tokens {shape[0]}x{shape[1]}, golden "
          f"{os.path.getsize(golden) / 1e6:.0f} MB")
    for k in ("baseline default threads", "baseline 1 thread"):
        print(f"  {k + (' (the baseline)' if k == key else ''):50s} best {min(times[k]) * 1e3:7.1f} ms  median "
              f"{statistics.median(times[k]) * 1e3:7.1f} ms")
    print(f"  {'compare_onnx':50s} best {min(o) * 1e3:7.1f} ms  median {statistics.median(o) * 1e3:7.1f} ms")
    print("  of which, alone: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in extra.items()))
    print(f"  ratio: best {best:.2f}x, medians {med:.2f}x ({verdict}); CPU time (all threads) medians "
          f"{statistics.median(cpu['compare_onnx']) * 1e3:.1f} / {statistics.median(cpu[key]) * 1e3:.1f} ms = "
          f"{statistics.median(cpu['compare_onnx']) / statistics.median(cpu[key]):.2f}x", flush=True)


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--sizes", default="tiny,realistic", help="comma-separated: tiny, realistic")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{len(os.sched_getaffinity(0))} cores; load average {os.getloadavg()[0]:.1f} at start", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for name, build, shape in MODELS[size]:
                measure(name, build, shape, args.repeat, tmp)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

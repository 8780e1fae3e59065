#!/usr/bin/env python
"""What recording gradients costs: ``record(backward=True)`` against ``record()``.

Target: at most 2.5x (a backward costs about two forwards, and the gradients are written like the
outputs). For each model both recordings run alternately, ``--repeat`` times each, in one process,
so a busy shared machine slows both alike. The ratio is that of the fastest run of each (the least
disturbed by other work on the machine; the target applies to it), printed next to the ratio of
the medians, with a plain forward and a plain forward + backward for scale. Models: the README's demo model
(``activation_guard.api.demo.build``), a GPT-2 (transformers, random weights from a config, 4 layers,
hidden 128, 64 tokens) and, for a wide layer-light case, transformers' ResNet (from a config).
``--large`` adds GPT-2 small's size (124M parameters, 64 tokens): there the parameter gradients
(500 MB, written like outputs) dwarf the activations (7 MB), and writing them sets the ratio.

    python benchmarks/backward_cost.py [--repeat 7] [--large]
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

TARGET = 2.5


def gpt2() -> tuple[torch.nn.Module, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    return model, torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))


def gpt2_small() -> tuple[torch.nn.Module, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    return model, torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))


def resnet() -> tuple[torch.nn.Module, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1],
                                    layer_type="basic")
    torch.manual_seed(0)
    return transformers.ResNetModel(cfg).eval(), torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
    "demo (README)": build_demo, "gpt2 4x128, 64 tokens": gpt2, "resnet 3 stages, 64x64": resnet,
}


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else next(v for v in out.values() if isinstance(v, torch.Tensor))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--large", action="store_true", help="also GPT-2 small's size (minutes; ~1.3 GB of disk)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    models = dict(MODELS, **({"gpt2-small size, 64 tok": gpt2_small} if args.large else {}))
    with tempfile.TemporaryDirectory(prefix="ag-bwd-") as d:
        for label, make in models.items():
            model, x = make()
            fwd_path, bwd_path = os.path.join(d, "fwd.h5"), os.path.join(d, "bwd.h5")
            ag.record(model, x, path=fwd_path)  # warm-up: imports, allocator, first-call paths
            ag.record(model, x, path=bwd_path, backward=True)
            plain: list[float] = []
            plain_bwd: list[float] = []
            rec: list[float] = []
            rec_bwd: list[float] = []
            for _ in range(args.repeat):  # alternate, so load on the machine hits both alike
                t = time.perf_counter()
                with torch.no_grad():
                    model(x)
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                first_tensor(model(x)).sum().backward()
                plain_bwd.append(time.perf_counter() - t)
                model.zero_grad(set_to_none=True)
                t = time.perf_counter()
                ag.record(model, x, path=fwd_path)
                rec.append(time.perf_counter() - t)
                t = time.perf_counter()
                summary = ag.record(model, x, path=bwd_path, backward=True)
                rec_bwd.append(time.perf_counter() - t)
            m = {k: min(v) for k, v in (("fwd", plain), ("fwd+bwd", plain_bwd), ("rec", rec), ("rec_bwd", rec_bwd))}
            m["median ratio"] = statistics.median(rec_bwd) / statistics.median(rec)
            rows.append((label, summary.layer_calls, summary.gradients, m, os.path.getsize(fwd_path),
                         os.path.getsize(bwd_path)))
    print(f"torch {torch.__version__}, 1 thread, fastest of {args.repeat} alternating runs (ratio of medians "
          f"in brackets)\n")
    head = (f"{'model':<24} {'calls':>5} {'grads':>5} {'forward':>9} {'fwd+bwd':>9} {'record':>9} "
            f"{'record+bwd':>11} {'ratio':>14} {'golden MB':>14}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for label, calls, grads, m, fsize, bsize in rows:
        ratio = m["rec_bwd"] / m["rec"]
        if label in MODELS:  # the target is for these; --large shows where parameter gradients dominate
            worst = max(worst, ratio)
        print(f"{label:<24} {calls:>5} {grads:>5} {m['fwd'] * 1e3:>7.2f}ms {m['fwd+bwd'] * 1e3:>7.2f}ms "
              f"{m['rec'] * 1e3:>7.1f}ms {m['rec_bwd'] * 1e3:>9.1f}ms {ratio:>5.2f}x ({m['median ratio']:.2f}x) "
              f"{fsize / 1e6:>6.2f} -> {bsize / 1e6:<5.2f}")
    print(f"\nworst ratio {worst:.2f}x (target <= {TARGET}x, the models above --large): "
          f"{'OK' if worst <= TARGET else 'OVER'}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())

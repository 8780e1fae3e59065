"""The built-in example: a tiny pre-norm transformer and a realistic refactor bug.

``activation-guard demo`` records goldens from :class:`TinyTransformer`, applies one bug that a
refactor really introduces, compares, and prints the report. The bugs are the quiet kind that
pass a loose end-to-end check but change every activation downstream of one layer:

- ``layernorm-eps`` (default): one LayerNorm rebuilt with ``eps=1e-3`` (the Keras/TF default,
  a common slip when porting weights) instead of PyTorch's ``1e-5``.
- ``gelu-tanh``: one GELU swapped for its tanh approximation (what a "fused" kernel or another
  framework's GELU computes).
- ``gelu-backward``: one GELU replaced by a "fused" kernel (a custom ``autograd.Function``) whose
  forward is exact and whose backward is 1% off: the forward is bit-identical, so only a golden
  with gradients (``backward=True``) sees it.

Everything is seeded and tiny (37 layer calls, a 140 KB golden), so the demo runs in well under
a second after imports and gives the same report on every machine.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..report.report import Report
from .run import compare, record

DIM = 32
HEADS = 4
SEQ = 8
BATCH = 2


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = self.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Embedding projection, a few pre-norm transformer blocks, final norm and a head."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, depth: int = 3, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(seed: int = 0) -> tuple[TinyTransformer, torch.Tensor]:
    """The reference model (eval mode) and its input, both from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyTransformer().eval()
    # small activations, as in a real pre-norm network early in training: variance ~0.01,
    # which is what makes an eps change visible
    x = 0.1 * torch.randn(BATCH, SEQ, DIM, generator=g)
    return model, x


def _eps_bug(m: TinyTransformer) -> None:
    cast(Block, m.blocks[1]).norm2.eps = 1e-3


def _gelu_bug(m: TinyTransformer) -> None:
    cast(Block, m.blocks[1]).mlp.act = nn.GELU(approximate="tanh")


class FusedGELU(torch.autograd.Function):
    """A "fused" GELU kernel as refactors introduce them: the exact forward, a backward whose
    derivative is 1% off (a wrong constant in a hand-written gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return nn.functional.gelu(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return g * (cdf + x * pdf) * 1.01


def _fused_gelu(x: torch.Tensor) -> torch.Tensor:
    return cast(torch.Tensor, FusedGELU.apply(x))


def _gelu_backward_bug(m: TinyTransformer) -> None:
    cast(Block, m.blocks[1]).mlp.act.forward = _fused_gelu  # type: ignore[method-assign,assignment]  # still a GELU module


@dataclass(frozen=True)
class Bug:
    name: str
    layer: str  # where the first divergence must be found
    description: str
    apply: Callable[[TinyTransformer], None]
    backward: bool = False  # the bug is in the backward pass only: record and compare gradients


BUGS: dict[str, Bug] = {
    "layernorm-eps": Bug("layernorm-eps", "blocks.1.norm2",
                         "blocks.1.norm2 rebuilt as LayerNorm(eps=1e-3) (the Keras default) instead of eps=1e-5",
                         _eps_bug),
    "gelu-tanh": Bug("gelu-tanh", "blocks.1.mlp.act",
                     "blocks.1.mlp.act swapped for GELU(approximate='tanh')", _gelu_bug),
    "gelu-backward": Bug("gelu-backward", "blocks.1.mlp.act",
                         "blocks.1.mlp.act runs a 'fused' GELU kernel (a custom autograd.Function): the exact forward, "
                         "a backward 1% off; the goldens hold gradients (backward=True)", _gelu_backward_bug,
                         backward=True),
}


@dataclass
class DemoResult:
    golden: str
    refactored: str
    bug: Bug
    baseline: Report  # unchanged model vs its golden: must pass
    report: Report  # buggy model vs the golden: must name bug.layer first

    @property
    def worked(self) -> bool:
        fd = self.report.first_divergence
        return self.baseline.ok and fd is not None and fd.name == self.bug.layer


def run_demo(out_dir: str | os.PathLike[str], bug: str = "layernorm-eps", seed: int = 0) -> DemoResult:
    """Record the reference, apply ``bug`` to a copy, compare, and record the copy too.

    Writes ``golden.h5`` (reference) and ``refactored.h5`` (the buggy model's recording, for
    trying ``activation-guard diff``) into ``out_dir``.
    """
    if bug not in BUGS:
        raise ValueError(f"unknown demo bug {bug!r}; choose one of {sorted(BUGS)}")
    b = BUGS[bug]
    os.makedirs(out_dir, exist_ok=True)
    golden = os.path.join(os.fspath(out_dir), "golden.h5")
    refactored = os.path.join(os.fspath(out_dir), "refactored.h5")
    model, x = build(seed)
    record(model, (x,), path=golden, backward=b.backward)
    baseline = compare(model, (x,), path=golden)
    buggy = copy.deepcopy(model)
    b.apply(buggy)
    report = compare(buggy, (x,), path=golden)
    record(buggy, (x,), path=refactored, backward=b.backward)
    return DemoResult(golden, refactored, b, baseline, report)

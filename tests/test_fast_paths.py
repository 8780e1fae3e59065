"""Every shortcut of the per-call path writes and judges exactly what the general path does.

The fast paths exist for models of thousands of small layers: one
aliased positional input recorded without building leaves (``Recorder._one_alias``). A golden
recorded with the shortcut switched off must be byte-identical, on models that exercise the
cases the shortcut has to hand back: inputs changed in place, inputs of a call still running,
recursion, shared modules, keyword arguments, several arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import build_cnn, cnn_input, one_thread, shared_loop, tiny_mlp
from torch import nn

import activation_guard as ag
from activation_guard.capture.recorder import Recorder


class Recursive(nn.Module):
    """A module that calls itself: its inner call returns first, with another call number."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        y = self.lin(x)
        return y if depth == 0 else self(y, depth - 1) + x


class Mixed(nn.Module):
    """Inputs changed in place between layers, keyword arguments, two arguments, a parent's own
    input passed to its first child (an alias of a call still running)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Bilinear(4, 4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.rec = Recursive()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(2)  # in place: b's input is not an alias of a's output any more
        g = self.b(input=h)  # keyword argument
        k = self.c(g, h)  # two arguments
        return self.rec(self.inner(k))


MODELS: dict[str, Any] = {
    "mixed": lambda: (Mixed().eval(), (torch.randn(3, 4),)),
    "mlp": lambda: (tiny_mlp(), (torch.randn(2, 8),)),
    "shared": lambda: (shared_loop(), (torch.randn(2, 6),)),
    "cnn": lambda: (build_cnn(), cnn_input()),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_alias_shortcut_writes_the_same_golden(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, args = MODELS[name]()
    taken: list[bool] = []
    real = Recorder._one_alias

    def spy(self: Recorder, frame: Any) -> bool:
        hit = real(self, frame)
        taken.append(hit)
        return hit

    with one_thread():
        monkeypatch.setattr(Recorder, "_one_alias", spy)
        ag.record(model, args, path=tmp_path / "fast.h5")
        monkeypatch.setattr(Recorder, "_one_alias", lambda self, frame: False)
        ag.record(model, args, path=tmp_path / "general.h5")
        assert ag.compare(model, args, path=tmp_path / "fast.h5").ok
    assert any(taken)  # the shortcut ran on this model
    if name == "mixed":
        assert not all(taken)  # and handed calls back to the general path
    assert (tmp_path / "fast.h5").read_bytes() == (tmp_path / "general.h5").read_bytes()

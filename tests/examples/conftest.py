"""Shared helpers for the example tests: weights that do not depend on torch's init code.

Default initialisers may change between torch/transformers releases; drawing every parameter
and buffer from one seeded generator in a fixed order keeps the committed goldens about the
*computation*, so they only diverge when the model's arithmetic does.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch


def _init(model: torch.nn.Module, seed: int = 0, scale: float = 0.5) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()]):
            if not t.is_floating_point():
                continue
            v = torch.randn(t.shape, generator=g, dtype=torch.float32) * scale
            if name.endswith("running_var"):
                v = v.abs() + 0.5  # a variance must be positive
            t.copy_(v)
    return model


@pytest.fixture
def init_weights() -> Callable[..., torch.nn.Module]:
    return _init


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator for inputs (never the global RNG)."""
    return torch.Generator().manual_seed(1234)

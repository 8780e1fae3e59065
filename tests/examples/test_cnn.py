"""A small CNN with BatchNorm and in-place ReLU, checked layer by layer on each device.

In-place ReLU overwrites the BatchNorm output it is given; activation_guard compares (or
records) every layer's output inside its forward hook, so the BatchNorm golden holds the
values BatchNorm produced, not the ones ReLU left behind.
"""

import pytest
import torch
from torch import nn


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


@pytest.mark.parametrize("batch", [1, 3])
def test_small_cnn(activation_guard, ag_device, init_weights, gen, batch):
    model = init_weights(small_cnn()).eval().to(ag_device)
    x = torch.randn(batch, 3, 8, 8, generator=gen).to(ag_device)
    logits = activation_guard.check(model, (x,))
    assert logits.shape == (batch, 5)


def test_batchnorm_output_is_recorded_before_inplace_relu(activation_guard, init_weights, gen):
    import activation_guard as ag

    model = init_weights(small_cnn()).eval()
    activation_guard.check(model, (torch.randn(2, 3, 8, 8, generator=gen),))
    with ag.read_golden(activation_guard.path()) as golden:
        by_name = {c.name: c for c in golden.calls}
        bn = golden.load(by_name["1"].leaves[0])
    assert (bn < 0).any(), "BatchNorm's golden must keep negative values that ReLU(inplace) later zeroes"

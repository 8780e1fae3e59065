"""nn.TransformerEncoder: keyword inputs (padding mask), several named checks, per-layer tolerances."""

import pytest
import torch
from torch import nn


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


# softmax attention is the numerically touchiest part: give it its own, slightly looser tolerance
@pytest.mark.activation_guard(tolerances={"layers.*.self_attn": {"rtol": 1e-5, "atol": 1e-5}})
def test_encoder(activation_guard, ag_device, init_weights, gen):
    model = init_weights(encoder(), scale=0.3).eval().to(ag_device)
    x = torch.randn(2, 6, 16, generator=gen).to(ag_device)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2], device=ag_device)

    full = activation_guard.check(model, (x,), name="no_mask")
    masked = activation_guard.check(model, (x,), {"src_key_padding_mask": pad}, name="padding_mask")
    assert full.shape == masked.shape == (2, 6, 16)
    # sequence 0 has no padding, so the mask must not change it
    torch.testing.assert_close(full[0], masked[0])

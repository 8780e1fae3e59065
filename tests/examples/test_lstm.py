"""An LSTM whose layer output is a nested tuple (output, (h_n, c_n)); one golden per sequence length."""

import pytest
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size=6, hidden_size=8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (_h_n, _c_n) = self.lstm(x)
        return self.head(out)


@pytest.mark.parametrize("seq_len", [3, 7])
def test_lstm_tagger(activation_guard, ag_device, init_weights, gen, seq_len):
    model = init_weights(Tagger(), scale=0.4).eval().to(ag_device)
    x = torch.randn(2, seq_len, 6, generator=gen).to(ag_device)
    tags = activation_guard.check(model, (x,))
    assert tags.shape == (2, seq_len, 3)

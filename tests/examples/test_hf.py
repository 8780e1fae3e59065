"""A tiny Hugging Face BERT built from a config (no download): dict-like ModelOutput outputs,
keyword inputs, ~50 hooked modules."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def tiny_bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )
    return transformers.BertModel(cfg)


def test_tiny_bert(activation_guard, ag_device, init_weights, gen):
    model = init_weights(tiny_bert(), scale=0.2).eval().to(ag_device)
    ids = torch.randint(0, 64, (2, 8), generator=gen).to(ag_device)
    mask = torch.ones(2, 8, dtype=torch.long, device=ag_device)
    mask[1, 6:] = 0
    out = activation_guard.check(model, kwargs={"input_ids": ids, "attention_mask": mask})
    assert out.last_hidden_state.shape == (2, 8, 16)

"""Small real models shared by the test suite (and importable by other test files).

Every builder is seeded, returns a model in eval mode, and is tiny (a few KB of activations) so
the whole suite stays fast on a loaded 2-core machine. Hugging Face models are built offline from
configs: no hub access, no downloaded weights.

``REAL_MODELS`` lists, per model, a builder, an input factory, and an inner layer whose weight a
test can perturb to check that activation_guard points at exactly that layer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch single-threaded for the duration.

    On a shared 2-core machine under ``pytest -n 2`` torch's default intra-op threads spin
    against each other: a tiny forward measured 0.16 s with 2 threads and 0.16 ms with 1.
    Recording and comparing under the same setting keeps the goldens' numerics consistent.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- generic tiny models


class Mixed(nn.Module):
    """Every storage path of a golden at once: small packed leaves, one large leaf in /data
    (65.6 KB), and str/None outputs. The corruption tests damage goldens of this model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4100)
        self.c = nn.Linear(4100, 3)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"out": self.c(self.b(self.a(x))), "tag": "v1", "none": None}


class TinyMLP(nn.Module):
    """A stack of Linear+Tanh blocks: every block is a distinct, named layer (`blocks.k.fc`)."""

    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(OrderedDict(fc=nn.Linear(width, width), act=nn.Tanh())) for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tiny_mlp(width: int = 8, depth: int = 4, seed: int = 0) -> TinyMLP:
    _seeded(seed)
    return TinyMLP(width, depth).eval()


class SharedLoop(nn.Module):
    """One ``shared`` Linear applied ``steps`` times, with a distinct block before each use.

    Perturbing ``blocks.k`` makes ``shared`` diverge first at call k, which lets tests check
    that calls are counted per module.
    """

    def __init__(self, width: int = 6, steps: int = 3):
        super().__init__()
        self.steps = steps
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(steps))
        self.shared = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in range(self.steps):
            x = self.act(self.shared(self.blocks[k](x)))
        return x


def shared_loop(width: int = 6, steps: int = 3, seed: int = 0) -> SharedLoop:
    _seeded(seed)
    return SharedLoop(width, steps).eval()


# --------------------------------------------------------------------------- real architectures


class SmallCNN(nn.Module):
    """Conv + BatchNorm + in-place ReLU, twice, then pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.relu2 = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(6 * 2 * 2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.pool(x)))


def build_cnn(seed: int = 0) -> SmallCNN:
    g = _seeded(seed)
    m = SmallCNN()
    for bn in (m.bn1, m.bn2):  # non-trivial running statistics, so eval-mode BN does something
        n = bn.num_features
        bn.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
        bn.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        bn.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
        bn.bias.data.copy_(torch.randn(n, generator=g) * 0.1)
    return m.eval()


def cnn_input(seed: int = 1) -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),)


def build_transformer_encoder(seed: int = 0) -> nn.TransformerEncoder:
    _seeded(seed)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def transformer_input(seed: int = 1) -> tuple[torch.Tensor]:
    return (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed)),)


class LSTMTagger(nn.Module):
    """Embedding -> 2-layer LSTM -> Linear; the LSTM returns ``(output, (h, c))``."""

    def __init__(self, vocab: int = 20, emb: int = 8, hidden: int = 12, tags: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(ids))
        return self.head(out)


def build_lstm(seed: int = 0) -> LSTMTagger:
    _seeded(seed)
    return LSTMTagger().eval()


def lstm_input(seed: int = 1) -> tuple[torch.Tensor]:
    return (torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(seed)),)


def _quiet_transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def build_hf_bert(seed: int = 0) -> nn.Module:
    """A 2-layer BERT encoder with hidden size 16, built from a config (offline)."""
    tf = _quiet_transformers()
    cfg = tf.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )
    _seeded(seed)
    return tf.BertModel(cfg).eval()


def build_hf_llama(seed: int = 0) -> nn.Module:
    """A 2-layer Llama causal LM (grouped-query attention, RoPE, SwiGLU), hidden size 16."""
    tf = _quiet_transformers()
    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
    )
    _seeded(seed)
    return tf.LlamaForCausalLM(cfg).eval()


def build_hf_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 (Conv1D projections, learned positions), hidden size 16."""
    tf = _quiet_transformers()
    cfg = tf.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=1,
        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )
    _seeded(seed)
    return tf.GPT2Model(cfg).eval()


def token_input(seed: int = 1, vocab: int = 64) -> tuple[torch.Tensor]:
    return (torch.randint(3, vocab, (2, 7), generator=torch.Generator().manual_seed(seed)),)


def bert_mask() -> dict[str, Any]:
    """Keyword inputs for BERT: an attention mask that pads out the last two tokens of row 1."""
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -2:] = 0
    return {"attention_mask": mask}


@dataclass(frozen=True)
class RealModel:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    inner: str  # qualified name of an inner layer with a ``weight`` to perturb
    needs_transformers: bool = False
    kwargs: Callable[[], dict[str, Any]] | None = None  # keyword inputs, if the model takes any


REAL_MODELS: list[RealModel] = [
    RealModel("cnn_batchnorm_inplace_relu", build_cnn, cnn_input, "conv2"),
    RealModel("transformer_encoder", build_transformer_encoder, transformer_input, "layers.1.linear1"),
    RealModel("lstm", build_lstm, lstm_input, "lstm"),
    RealModel("hf_bert", build_hf_bert, token_input, "encoder.layer.1.intermediate.dense", True, bert_mask),
    RealModel("hf_llama", build_hf_llama, token_input, "model.layers.1.mlp.up_proj", True),
    RealModel("hf_gpt2", build_hf_gpt2, token_input, "h.0.mlp.c_fc", True),
]


def scale_weight(model: nn.Module, layer: str, factor: float = 1 + 1e-3) -> None:
    """Multiply every weight-like parameter of ``layer`` (not its children) by ``factor``."""
    mod = model.get_submodule(layer)
    with torch.no_grad():
        touched = 0
        for pname, p in mod.named_parameters(recurse=False):
            if "weight" in pname:
                p.mul_(factor)
                touched += 1
    if not touched:
        raise ValueError(f"layer {layer!r} has no weight to scale")

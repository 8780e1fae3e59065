"""Localization with fingerprint goldens on tiny transformers.

For BERT, GPT-2 and Llama built from configs (random weights, hidden 64, 2 layers, 2 x 32
tokens: every hidden state is large enough to be fingerprinted), each case changes the model and
compares it against a full golden and a fingerprint golden of the original:

- a 0.1% change of one module's weight, for every module that has a weight;
- a GELU swap (exact <-> tanh approximation; Llama's SiLU -> GELU), one layer at a time;
- an epsilon change of one normalization module (to 1e-3), for every norm.

Both goldens must name the same first divergence in every case (and the full golden must see
each change: a case it passes would test nothing). No false alarms: a model rebuilt from its
config and seed, and runs with another torch thread count, pass against both goldens (these
transformers compute bit-identical outputs with 1 and 2 threads on CPU, so a model whose outputs
depend on a thread-split reduction is checked too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import activation_guard as ag

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2Model(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return transformers.BertModel(cfg)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg)


@dataclass(frozen=True)
class Spec:
    name: str
    factory: Callable[[], nn.Module]
    act: Callable[[nn.Module], list[str]]  # names of the activation modules, one per layer
    swap: Callable[[nn.Module], nn.Module]  # the replacement activation


def _acts(kind: str) -> Callable[[nn.Module], list[str]]:
    return lambda m: [n for n, mod in m.named_modules() if type(mod).__name__ in kind.split("|")]


SPECS = {
    "bert": Spec("bert", _bert, _acts("GELUActivation"), lambda old: nn.GELU(approximate="tanh")),
    "gpt2": Spec("gpt2", _gpt2, _acts("NewGELUActivation"), lambda old: nn.GELU()),
    "llama": Spec("llama", _llama, _acts("SiLU|SiLUActivation"), lambda old: nn.GELU(approximate="tanh")),
}


def build(name: str) -> nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return SPECS[name].factory().eval()


IDS = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(SPECS))
def goldens(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    name = request.param
    d = tmp_path_factory.mktemp(f"loc_{name}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build(name)
        ag.record(model, (IDS,), path=d / "full.h5")
        s = ag.record(model, (IDS,), path=d / "fp.h5", fingerprint=True)
    finally:
        torch.set_num_threads(before)
    assert s.fingerprints >= 20, f"{name}: only {s.fingerprints} outputs fingerprinted: the suite would test little"
    return name, d / "full.h5", d / "fp.h5"


def first(rep: ag.Report) -> tuple[str, int, str] | None:
    fd = rep.first_divergence
    return None if fd is None else (fd.name, fd.call, fd.status)


def _run_cases(goldens: tuple[str, Path, Path], cases: list[tuple[str, Callable[[nn.Module], Any]]]) -> int:
    name, full, fp = goldens
    problems = []
    for label, change in cases:
        m = copy.deepcopy(build(name))
        change(m)
        m.eval()
        a, b = first(ag.compare(m, (IDS,), path=full)), first(ag.compare(m, (IDS,), path=fp))
        if a is None:
            problems.append(f"{label}: the full golden does not see this change")
        elif a != b:
            problems.append(f"{label}: full golden {a}, fingerprint golden {b}")
    assert not problems, f"{name}: {len(problems)} of {len(cases)} cases differ:\n" + "\n".join(problems)
    return len(cases)


def _scale(layer: str) -> Callable[[nn.Module], None]:
    def change(m: nn.Module) -> None:
        with torch.no_grad():
            m.get_submodule(layer).weight.mul_(1.001)
    return change


def test_weight_changes_localize_like_full_goldens(goldens) -> None:
    name = goldens[0]
    layers = [n for n, mod in build(name).named_modules()
              if isinstance(getattr(mod, "weight", None), torch.Tensor) and n]
    assert len(layers) >= 15
    assert _run_cases(goldens, [(f"weight x1.001 in {n}", _scale(n)) for n in layers]) == len(layers)


def test_gelu_swaps_localize_like_full_goldens(goldens) -> None:
    name = goldens[0]
    spec = SPECS[name]
    acts = spec.act(build(name))
    assert len(acts) == 2, acts

    def swap(layer: str) -> Callable[[nn.Module], None]:
        def change(m: nn.Module) -> None:
            parent, _, attr = layer.rpartition(".")
            owner = m.get_submodule(parent)
            setattr(owner, attr, spec.swap(getattr(owner, attr)))
        return change

    _run_cases(goldens, [(f"activation swap in {n}", swap(n)) for n in acts])


def test_eps_changes_localize_like_full_goldens(goldens) -> None:
    name = goldens[0]
    norms = [n for n, mod in build(name).named_modules() if hasattr(mod, "variance_epsilon") or
             isinstance(mod, nn.LayerNorm)]
    assert len(norms) >= 4

    def eps(layer: str) -> Callable[[nn.Module], None]:
        def change(m: nn.Module) -> None:
            mod = m.get_submodule(layer)
            setattr(mod, "variance_epsilon" if hasattr(mod, "variance_epsilon") else "eps", 1e-3)
        return change

    _run_cases(goldens, [(f"eps 1e-3 in {n}", eps(n)) for n in norms])


@pytest.mark.parametrize("threads", [1, 2])
def test_no_false_alarm_on_rebuilt_models_and_other_thread_counts(goldens, threads: int) -> None:
    name, full, fp = goldens
    torch.set_num_threads(threads)
    model = build(name)  # rebuilt from the config and the seed
    for path in (full, fp):
        rep = ag.compare(model, (IDS,), path=path)
        assert rep.ok, f"{name}, {threads} thread(s), {path.name}:\n{rep}"
    assert ag.compare(model, (IDS,), path=fp).estimated()


def test_no_false_alarm_when_the_golden_was_recorded_with_two_threads(goldens, tmp_path) -> None:
    name = goldens[0]
    torch.set_num_threads(2)
    ag.record(build(name), (IDS,), path=tmp_path / "fp2.h5", fingerprint=True)
    torch.set_num_threads(1)
    rep = ag.compare(build(name), (IDS,), path=tmp_path / "fp2.h5")
    assert rep.ok, str(rep)


class GlobalStd(nn.Module):
    """Standardize by the mean and std of the whole tensor: a reduction torch splits across threads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean()) / x.std()


def test_no_false_alarm_where_the_thread_count_changes_the_values(tmp_path) -> None:
    """The transformers above compute bit-identical outputs with 1 and 2 threads on CPU (no output
    depends on a thread-split reduction); this model's do differ, everywhere a little."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), GlobalStd(), nn.Linear(512, 256), GlobalStd()).eval()
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))
    ag.record(model, x, path=tmp_path / "full.h5")
    ag.record(model, x, path=tmp_path / "fp.h5", fingerprint=True)
    torch.set_num_threads(2)
    full = ag.compare(model, x, path=tmp_path / "full.h5")
    assert full.ok and max(layer.max_abs_diff or 0.0 for layer in full.layers) > 0  # the values did change
    fp = ag.compare(model, x, path=tmp_path / "fp.h5")
    assert fp.ok, str(fp)
    assert len(fp.estimated()) == 5 and max(leaf.estimated_l2 or 0.0 for leaf in fp.estimated()) > 0

"""Backward-only faults on real models: each leaves the forward bit-identical, changes
only gradients, and must be found at its module, in the backward phase, with the forward
reported as matching.

Faults: a custom ``autograd.Function`` whose forward is identical but whose backward scales by
1.01; a ``.detach()`` on a residual branch; a gradient hook that scales one parameter's gradient;
a checkpointed block whose recomputation differs (dropout without the RNG state preserved, a
flag read again at recomputation). Models: transformers BERT/GPT-2/Llama from configs, a CNN.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import bert_mask, build_cnn, build_hf_bert, build_hf_gpt2, build_hf_llama, cnn_input, token_input
from torch import nn
from torch.utils.checkpoint import checkpoint

import activation_guard as ag


class ScaleGrad(torch.autograd.Function):
    """The identity forward (the values a refactored fused kernel returns), a backward off by 1%."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 1.01


def with_scaled_backward(module: nn.Module) -> None:
    """The module's own forward, then ScaleGrad: its output values are unchanged."""
    orig = module.forward
    module.forward = lambda *a, **k: ScaleGrad.apply(orig(*a, **k))  # type: ignore[method-assign]


def golden_then(model: nn.Module, args: Any, tmp_path: Path, kwargs: Any = None, seed: int | None = None) -> Path:
    p = tmp_path / "g.h5"
    if seed is not None:
        torch.manual_seed(seed)
    ag.record(model, args, kwargs, path=p, backward=True)
    if seed is not None:
        torch.manual_seed(seed)
    assert ag.compare(model, args, kwargs, path=p).ok
    return p


def found(report: ag.Report, layer: str, wrt: str | None, phase: str = "backward") -> None:
    """The first divergence is ``layer``'s gradient (``wrt``), in the backward, the forward matching."""
    fd = report.first_divergence
    assert fd is not None, str(report)
    assert (fd.phase, fd.name, fd.wrt) == (phase, layer, wrt), str(report)
    assert all(r.ok for r in report.layers if r.phase == "forward") and report.live_count > 0
    head = str(report).splitlines()[0]
    assert head.startswith(f"activation_guard: first divergence in the backward pass at layer {layer!r}"), head
    assert head.endswith(f"the forward matches ({report.live_count} layer calls)"), head


# --------------------------------------------------------------------------- a custom autograd Function


@pytest.mark.parametrize("build, inputs, layer, kwargs", [
    (build_hf_gpt2, token_input, "h.0.mlp.act", None),
    (build_hf_llama, token_input, "model.layers.0.mlp.act_fn", None),
    (build_hf_bert, token_input, "encoder.layer.1.intermediate.intermediate_act_fn", bert_mask),
    (build_cnn, cnn_input, "relu1", None),
], ids=["gpt2", "llama", "bert", "cnn"])
def test_a_custom_function_with_a_scaled_backward_is_found_at_its_module(
        tmp_path: Path, build: Any, inputs: Any, layer: str, kwargs: Any) -> None:
    if build is not build_cnn:
        pytest.importorskip("transformers")
    model = build()
    args, kw = inputs(), kwargs() if kwargs else None
    p = golden_then(model, args, tmp_path, kw)
    with_scaled_backward(model.get_submodule(layer))
    report = ag.compare(model, args, kw, path=p)
    found(report, layer, "input")
    fd = report.first_divergence
    assert fd is not None and fd.max_rel_diff is not None and 0.009 < fd.max_rel_diff < 0.011
    o = report.origin
    assert o is not None and (o.kind, o.name) == ("layer", layer)
    assert o.detail.startswith("backward changed: the gradient w.r.t. its output matches the golden, but its "
                               "gradient w.r.t. its input args/0 differs")
    assert "call 0: gradient w.r.t. its input args/0, #" in str(report).splitlines()[0]


# --------------------------------------------------------------------------- a .detach() on a residual branch


def test_a_detached_residual_in_bert_is_found_at_the_module_that_adds_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = build_hf_bert()
    args, kw = token_input(), bert_mask()
    p = golden_then(model, args, tmp_path, kw)
    layer = "encoder.layer.0.attention.output"  # BertSelfOutput: LayerNorm(dropout(dense(h)) + input_tensor)
    so = model.get_submodule(layer)

    def forward(hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return so.LayerNorm(so.dropout(so.dense(hidden_states)) + input_tensor.detach())

    so.forward = forward
    report = ag.compare(model, args, kw, path=p)
    found(report, layer, "input")
    fd = report.first_divergence
    assert fd is not None and fd.status == "structure" and fd.path == "args/1"
    assert "now no gradient reaches it (a detach" in fd.detail
    o = report.origin
    assert o is not None and (o.kind, o.name) == ("layer", layer) and "its 3 child call(s) pass back" in o.detail
    assert "  gradient      : w.r.t. its input args/1" in str(report)


class DetachBlock(nn.Module):
    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.detach = detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x) + (x.detach() if self.detach else x))


class ResCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(DetachBlock(), DetachBlock())
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def test_a_detached_residual_in_a_cnn_is_found_at_its_block(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResCNN().eval()
    args = cnn_input()
    p = golden_then(model, args, tmp_path)
    model.blocks[1].detach = True
    report = ag.compare(model, args, path=p)
    found(report, "blocks.1", "input")
    assert report.first_divergence is not None and report.first_divergence.status == "diverged"
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "blocks.1")


# --------------------------------------------------------------------------- a hook on a parameter's gradient


@pytest.mark.parametrize("build, inputs, layer", [
    (build_hf_gpt2, token_input, "h.1.mlp.c_fc"),
    (build_cnn, cnn_input, "conv2"),
], ids=["gpt2", "cnn"])
def test_a_hook_scaling_one_parameter_gradient_is_a_param_grad_divergence(
        tmp_path: Path, build: Any, inputs: Any, layer: str) -> None:
    if build is not build_cnn:
        pytest.importorskip("transformers")
    model = build()
    args = inputs()
    p = golden_then(model, args, tmp_path)
    weight = model.get_submodule(layer).weight
    handle = weight.register_hook(lambda g: g * 1.01)
    try:
        report = ag.compare(model, args, path=p)
    finally:
        handle.remove()
    found(report, layer, None, phase="param-grad")
    fd = report.first_divergence
    assert fd is not None and fd.path == "weight" and fd.call == 0
    head = str(report).splitlines()[0]
    tname = type(model.get_submodule(layer)).__name__
    assert f"at layer {layer!r} ({tname}): gradient of parameter 'weight', #" in head
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", layer)
    assert "a hook on the parameter" in report.origin.detail
    bad = [r for r in report.layers if not r.ok]
    assert [(r.phase, r.name) for r in bad] == [("param-grad", layer)]  # nothing else moved


# --------------------------------------------------------------------------- checkpoint recomputation


def _checkpointed(module: nn.Module, **kw: Any) -> None:
    orig = module.forward
    module.forward = functools.partial(checkpoint, orig, use_reentrant=False, **kw)  # type: ignore[method-assign]


def test_a_checkpoint_that_does_not_preserve_the_rng_is_found_at_the_dropout(tmp_path: Path) -> None:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    cfg = tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.2,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.GPT2Model(cfg).train()  # dropout on: the seed fixes the masks
    args = token_input()
    p = golden_then(model, args, tmp_path, seed=7)
    reference = copy.deepcopy(model)
    _checkpointed(reference.get_submodule("h.1.mlp"), preserve_rng_state=True)  # a correct checkpoint
    torch.manual_seed(7)
    assert ag.compare(reference, args, path=p).ok
    _checkpointed(model.get_submodule("h.1.mlp"), preserve_rng_state=False)  # recomputes with other masks
    torch.manual_seed(7)
    report = ag.compare(model, args, path=p)
    found(report, "h.1.mlp.dropout", "input")
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "h.1.mlp.dropout")


def test_a_flag_read_again_at_recomputation_is_found_in_the_checkpointed_block(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = build_hf_llama()
    args = token_input()
    p = golden_then(model, args, tmp_path)
    block = "model.layers.1.mlp"
    act = model.get_submodule(f"{block}.act_fn")
    seen = {"calls": 0}

    def scaled_on_recompute(t: torch.Tensor) -> torch.Tensor:
        seen["calls"] += 1  # a flag the forward reads: it has changed by the time the checkpoint recomputes
        return F.silu(t) * torch.tensor(1.0 if seen["calls"] == 1 else 1.01)

    act.forward = scaled_on_recompute
    _checkpointed(model.get_submodule(block))
    report = ag.compare(model, args, path=p)
    fd = report.first_divergence
    assert seen["calls"] == 2  # one forward, one recomputation
    # the recomputed act_fn output (x1.01) is what down_proj saved for its weight gradient
    assert fd is not None and (fd.phase, fd.name) == ("param-grad", f"{block}.down_proj"), str(report)
    assert all(r.ok for r in report.layers if r.phase == "forward")
    assert report.origin is not None and report.origin.name == f"{block}.down_proj"
    assert "a checkpoint recomputation that differs" in report.origin.detail
    before = [r for r in report.layers if r.position is not None and fd.position is not None
              and report.live_count <= r.position < fd.position]
    assert before and all(r.ok for r in before)


def test_the_report_round_trips_through_json_with_gradients(tmp_path: Path) -> None:
    model = build_cnn()
    args = cnn_input()
    p = golden_then(model, args, tmp_path)
    with_scaled_backward(model.relu2)
    report = ag.compare(model, args, path=p)
    d = report.to_dict()
    assert d["first_divergence"]["phase"] == "backward" and d["first_divergence"]["wrt"] == "input"
    back = ag.Report.from_dict(d)
    assert str(back) == str(report) and back.first_divergence is not None
    assert (back.first_divergence.phase, back.first_divergence.wrt) == ("backward", "input")


class _UnrunParams(nn.Module):
    """Parameters whose module never runs: an nn.ParameterList and a Linear used through F.linear
    (its weights only). ``scale`` changes only their gradients (a refactor's custom backward)."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(8))])
        self.side = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        if scale != 1.0:
            for p in (self.scales[0], self.side.weight):
                p.register_hook(lambda g: g * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self.a(x) * self.scales[0], self.side.weight, self.side.bias)
        return self.b(torch.tanh(h))


def test_gradients_of_parameters_whose_module_never_runs_are_compared(tmp_path: Path) -> None:
    """Found by review: parameter gradients were collected per *called* module, so these were
    never stored or compared and a change to them passed. They now go to the nearest running
    ancestor under their path from it; a golden from before says in a note that it lacks them;
    a module left out by exclude= keeps its parameters out."""
    import json
    import zlib

    import h5py
    import numpy as np

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    p = tmp_path / "g.h5"
    ag.record(_UnrunParams(), x, path=p, backward=True)
    with ag.read_golden(p) as r:
        root = next(c for c in r.backward if c.name == "" and c.grad == "param")
        assert [leaf.path for leaf in root.leaves] == ["scales.0", "side.weight", "side.bias"]
    assert ag.compare(_UnrunParams(), x, path=p).ok
    rep = ag.compare(_UnrunParams(scale=3.0), x, path=p)
    assert not rep.ok and rep.first_divergence is not None
    assert rep.first_divergence.phase == "param-grad" and rep.first_divergence.name == ""
    assert rep.first_divergence.path in ("scales.0", "side.weight")

    with h5py.File(p, "r+") as f:  # a golden from before: its backward record lacks the marker
        meta = json.loads(f["meta"][()].tobytes())
        del meta["backward"]["unrun_params"]
        raw = json.dumps(meta).encode()
        del f["meta"]
        f.create_dataset("meta", data=np.frombuffer(raw, np.uint8))
        f.attrs["meta_crc32"] = np.int64(zlib.crc32(raw))
    old = ag.compare(_UnrunParams(scale=3.0), x, path=p)  # what it does not hold cannot fail it, but is named
    assert any("no gradients for 3 parameter(s) of modules that never ran ('scales.0', 'side.weight'" in n
               for n in old.notes), old.notes

    q = tmp_path / "excluded.h5"
    ag.record(_UnrunParams(), x, path=q, backward=True, exclude=["side"])
    with ag.read_golden(q) as r:
        root = next(c for c in r.backward if c.name == "" and c.grad == "param")
        assert [leaf.path for leaf in root.leaves] == ["scales.0"]

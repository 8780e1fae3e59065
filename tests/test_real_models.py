"""Real architectures: a CNN with BatchNorm and in-place ReLU, nn.TransformerEncoder, an LSTM and
tiny Hugging Face models built offline. Each records, compares clean, and a 1e-3 change to one
inner layer's weight is reported at exactly that layer."""

from __future__ import annotations

import json

import pytest
import torch
from models import (
    REAL_MODELS,
    RealModel,
    build_cnn,
    build_transformer_encoder,
    cnn_input,
    one_thread,
    scale_weight,
    transformer_input,
)

import activation_guard as ag


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():  # see models.one_thread: 1000x faster tiny forwards on a loaded machine
        yield



def _params(spec: RealModel) -> object:
    marks = [pytest.mark.filterwarnings("ignore::DeprecationWarning")] if spec.needs_transformers else []
    return pytest.param(spec, id=spec.name, marks=marks)


@pytest.fixture(params=[_params(s) for s in REAL_MODELS])
def spec(request) -> RealModel:
    s = request.param
    if s.needs_transformers:
        pytest.importorskip("transformers")
    return s


def _inputs(spec: RealModel):
    return spec.inputs(), (spec.kwargs() if spec.kwargs else None)


def test_record_then_compare_is_clean(spec, tmp_path):
    model = spec.build()
    args, kwargs = _inputs(spec)
    path = tmp_path / f"{spec.name}.h5"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    summary = ag.record(model, args, kwargs, path=path)
    assert summary.layer_calls >= 4
    assert spec.inner in summary.names
    rep = ag.compare(model, args, kwargs, path=path)
    assert rep.ok, str(rep)
    assert str(rep).count("\n") == 0
    assert rep.live_count == summary.layer_calls
    assert not model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    json.dumps(rep.to_dict(), allow_nan=False)
    # a fresh, identically seeded model matches too (the golden is not tied to the object)
    assert ag.compare(spec.build(), args, kwargs, path=path).ok


def test_perturbed_inner_layer_is_found_there(spec, tmp_path):
    args, kwargs = _inputs(spec)
    path = tmp_path / f"{spec.name}.h5"
    ag.record(spec.build(), args, kwargs, path=path)
    model = spec.build()
    scale_weight(model, spec.inner, 1 + 1e-3)
    rep = ag.compare(model, args, kwargs, path=path)
    fd = rep.first_divergence
    assert fd is not None, str(rep)
    assert (fd.name, fd.call, fd.status) == (spec.inner, 0, "diverged"), str(rep)
    assert all(r.ok for r in rep.layers if r.position is not None and r.position < fd.position)
    assert f"layer {spec.inner!r}" in str(rep).splitlines()[0]
    ff = ag.compare(model, args, kwargs, path=path, fail_fast=True)
    assert ff.stopped_early and ff.first_divergence.name == spec.inner
    assert len(ff.layers) == fd.position + 1


def test_cnn_inplace_relu_and_batchnorm_golden_values(tmp_path):
    model = build_cnn()
    (x,) = cnn_input()
    path = tmp_path / "cnn.h5"
    ag.record(model, x, path=path)
    with torch.no_grad():
        bn1 = model.bn1(model.conv1(x))
    with ag.read_golden(path) as r:
        g_bn1 = r.load(r.by_key[("bn1", 0)].leaves[0])
        g_relu1 = r.load(r.by_key[("relu1", 0)].leaves[0])
    assert (g_bn1 < 0).any(), "in-place ReLU must not have zeroed BatchNorm's captured output"
    assert torch.equal(g_bn1, bn1) and torch.equal(g_relu1, bn1.relu())
    # a BatchNorm statistics change shows up at that BatchNorm, not at the conv before it
    with torch.no_grad():
        model.bn2.running_var.mul_(1.01)
    rep = ag.compare(model, x, path=path)
    assert (rep.first_divergence.name, rep.first_divergence.status) == ("bn2", "diverged")


def test_transformer_encoder_hooks_inner_layers(tmp_path):
    """The encoder's fused fast path would bypass submodules; capture must still see them."""
    model = build_transformer_encoder()
    path = tmp_path / "enc.h5"
    summary = ag.record(model, transformer_input(), path=path)
    for name in ("layers.0.self_attn", "layers.0.linear1", "layers.1.norm2", "layers.1"):
        assert name in summary.names
    with ag.read_golden(path) as r:
        attn = r.by_key[("layers.0.self_attn", 0)]
        assert [(leaf.path, leaf.kind) for leaf in attn.leaves] == [("0", "tensor"), ("1", "none")]


def test_hf_outputs_and_cache_objects(tmp_path):
    pytest.importorskip("transformers")
    from models import build_hf_bert, build_hf_llama, token_input

    path = tmp_path / "bert.h5"
    ag.record(build_hf_bert(), token_input(), path=path)
    with ag.read_golden(path) as r:
        root = r.by_key[("", 0)]
        assert [leaf.path for leaf in root.leaves] == ["last_hidden_state", "pooler_output"]
    path = tmp_path / "llama.h5"
    ag.record(build_hf_llama(), token_input(), path=path)
    with ag.read_golden(path) as r:
        root = r.by_key[("", 0)]
        kinds = {leaf.path: (leaf.kind, leaf.type_name) for leaf in root.leaves}
    assert kinds["logits"][0] == "tensor"
    objects = [v for v in kinds.values() if v[0] == "object"]
    assert objects and all("Cache" in t for _, t in objects)  # KV cache: recorded by type name

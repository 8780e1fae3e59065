"""Replay and attribution: did this layer change, or did it inherit the difference?"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from models import (
    bert_mask,
    build_cnn,
    build_hf_bert,
    build_hf_gpt2,
    build_hf_llama,
    cnn_input,
    scale_weight,
    token_input,
)
from torch import nn

import activation_guard as ag
from activation_guard.calibration.shadow import float32_random
from activation_guard.replay.children import PLACEHOLDER, skeleton
from activation_guard.report.report import Report


def _check(model: nn.Module, changed: nn.Module, args: Any, tmp_path: Path, kwargs: Any = None,
           **options: Any) -> ag.Report:
    p = tmp_path / "g.h5"
    ag.record(model, args, kwargs, path=p)
    assert ag.compare(model, args, kwargs, path=p, **options).ok
    return ag.compare(changed, args, kwargs, path=p, **options)


# --------------------------------------------------------------------------- code between children


def _encoder_layer() -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True).eval()


X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))


def test_a_changed_activation_function_inside_a_parent_is_the_parents_code(tmp_path: Path) -> None:
    """The issue's measured failure: a GELU passed as a function lives in the parent's forward;
    the first diverging module ('dropout') computes what it always did on what it was given."""
    layer = _encoder_layer()
    changed = copy.deepcopy(layer)
    changed.activation = lambda t: F.gelu(t, approximate="tanh")
    report = _check(layer, changed, X, tmp_path)
    assert report.first_divergence is not None and report.first_divergence.name == "dropout"
    o = report.origin
    assert o is not None and (o.kind, o.name, o.child, o.previous) == ("parent-code", "", "dropout", "linear1")
    assert report.first_divergence.own_status == "match" and report.first_divergence.own_max_abs_diff == 0.0
    line = str(report).splitlines()[1]
    assert line == ("  origin        : '<root>' (TransformerEncoderLayer) own code between 'linear1' and 'dropout': "
                    "its children compute the same on the golden inputs, but the inputs of 'dropout' differ")


class ResidualBlock(nn.Module):
    def __init__(self, scale: float = 1.0, eps: float = 1e-5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 8)
        self.scale, self.eps = scale, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.act(self.fc1(x)))
        y = F.layer_norm(x + self.scale * h, (8,), eps=self.eps)  # functional: the parent's own code
        return y


class Net(nn.Module):
    def __init__(self, scale: float = 1.0, eps: float = 1e-5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = ResidualBlock(scale, eps)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@pytest.mark.parametrize("change", [dict(scale=0.99), dict(eps=1e-2)])
def test_a_scaled_residual_or_a_functional_eps_is_the_parents_own_code(tmp_path: Path, change: dict) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    report = _check(Net(), Net(**change), x, tmp_path)
    assert report.first_divergence is not None and report.first_divergence.name == "block"
    o = report.origin
    assert o is not None and (o.kind, o.name, o.previous) == ("parent-code", "block", "block.fc2")
    assert "its 3 child call(s) computed what they computed before" in o.detail


# --------------------------------------------------------------------------- real models


def test_bert_attention_scaling_is_the_attention_modules_code(tmp_path: Path) -> None:
    model = build_hf_bert()
    changed = copy.deepcopy(model)
    changed.encoder.layer[0].attention.self.scaling *= 1.05
    report = _check(model, changed, token_input(), tmp_path, bert_mask())
    o = report.origin
    assert o is not None and (o.kind, o.name) == ("parent-code", "encoder.layer.0.attention.self")


def test_gpt2_attention_scaling_is_found_between_its_projections(tmp_path: Path) -> None:
    model = build_hf_gpt2()
    changed = copy.deepcopy(model)
    changed.h[0].attn.scaling *= 1.5
    report = _check(model, changed, token_input(), tmp_path)
    o = report.origin
    assert o is not None and o.kind == "parent-code" and o.name == "h.0.attn"


def test_llama_replay_with_a_kv_cache_leaves_the_live_cache_alone(tmp_path: Path) -> None:
    """Llama's attention appends to a DynamicCache: the replay gets a copy of the cache as it was
    when the call started, so it neither fails nor corrupts the live run's cache."""
    model = build_hf_llama()
    changed = copy.deepcopy(model)
    changed.model.layers[0].self_attn.scaling *= 1.05
    report = _check(model, changed, token_input(), tmp_path)
    o = report.origin
    assert o is not None and (o.kind, o.name) == ("parent-code", "model.layers.0.self_attn")
    assert not any("not replayed" in n for n in report.notes)
    plain = ag.compare(changed, token_input(), path=tmp_path / "g.h5", replay="off")
    assert [r.to_dict() | {"own_status": None, "own_max_abs_diff": None, "own_max_rel_diff": None}
            for r in report.layers] == [r.to_dict() for r in plain.layers]  # replay changed nothing live


@pytest.mark.parametrize(("build", "inputs", "layer"), [
    (build_hf_bert, token_input, "encoder.layer.1.intermediate.dense"),
    (build_cnn, cnn_input, "conv2"),
])
def test_a_changed_weight_is_its_own_layer(tmp_path: Path, build: Any, inputs: Any, layer: str) -> None:
    model = build()
    changed = copy.deepcopy(model)
    scale_weight(changed, layer, 1.01)
    report = _check(model, changed, inputs(), tmp_path)
    o = report.origin
    assert o is not None and (o.kind, o.name) == ("layer", layer)
    assert o.own_error is not None and o.own_error > 0
    line = str(report).splitlines()[1]
    assert line.startswith("  replayed      : re-run on the golden's own inputs it still differs")


def test_changed_model_inputs_are_the_inputs(tmp_path: Path) -> None:
    layer = _encoder_layer()
    p = tmp_path / "g.h5"
    ag.record(layer, X, path=p)
    report = ag.compare(layer, X * 1.001, path=p)
    o = report.origin
    assert o is not None and o.kind == "inputs" and o.name == ""


def test_a_golden_without_inputs_says_it_needs_a_re_record(tmp_path: Path) -> None:
    p = tmp_path / "g.h5"
    ag.record(Net(), torch.randn(4, 8), path=p, inputs=False)
    report = ag.compare(Net(scale=0.9), torch.randn(4, 8), path=p)
    o = report.origin
    assert o is not None and o.kind == "unknown" and "re-record it" in o.detail


def test_corrupted_input_bytes_are_corruption_not_an_attribution(tmp_path: Path) -> None:
    p = tmp_path / "g.h5"
    x = torch.randn(4, 8)
    ag.record(Net(), x, path=p)
    with ag.read_golden(p) as g:
        block = g.by_key[("block", 0)]
        stored = [g.resolve(e) for e in block.inputs or [] if e.kind in ("tensor", "alias")]
    # the block's input is the model's input (an alias): damage the model input's bytes
    target = next(e for e in stored if e.pack is not None)
    with h5py.File(p, "r") as f:
        off = f[f"packs/{target.pack:04d}"].id.get_offset() + target.offset
    data = bytearray(p.read_bytes())
    data[off] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(ag.GoldenCorruptError, match="checksum"):
        ag.compare(Net(scale=0.9), x, path=p)


# --------------------------------------------------------------------------- the live run is untouched


class TrainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.bn(self.fc(x))))


def test_replay_restores_rng_buffers_and_leaves_the_live_results_alone(tmp_path: Path) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    p = tmp_path / "g.h5"
    torch.manual_seed(5)
    ag.record(TrainNet().train(), x, path=p)
    changed = TrainNet().train()
    scale_weight(changed, "bn", 1.01)
    stats = changed.bn.running_mean.clone()
    torch.manual_seed(5)
    with_replay = ag.compare(changed, x, path=p)
    after = changed.bn.running_mean.clone()
    changed.bn.running_mean.copy_(stats)
    torch.manual_seed(5)
    without = ag.compare(changed, x, path=p, replay="off")
    assert torch.equal(after, changed.bn.running_mean)  # the replay restored the batch-norm statistics
    assert with_replay.origin is not None and (with_replay.origin.kind, with_replay.origin.name) == ("layer", "bn")
    strip = ("own_status", "own_max_abs_diff", "own_max_rel_diff")
    assert [{k: v for k, v in r.to_dict().items() if k not in strip} for r in with_replay.layers] == \
           [{k: v for k, v in r.to_dict().items() if k not in strip} for r in without.layers]
    assert torch.equal(with_replay.output, without.output)  # the dropout after it drew the same numbers


# --------------------------------------------------------------------------- replays and the backward


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_as_after_one_forward(live: nn.Module, plain: nn.Module) -> None:
    """The compared model's parameters and buffers are what one plain forward of ``plain`` (its
    twin) left, its training flags unchanged and no ``.grad`` written."""
    got, want = _state(live), _state(plain)
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert [m.training for m in live.modules()] == [m.training for m in plain.modules()]
    assert all(q.grad is None for q in live.parameters())


@pytest.mark.parametrize("changed", [None, "bn2", "conv2"])
@pytest.mark.parametrize("replay", ["first", "all"])
def test_a_training_batchnorm_replayed_before_the_backward(tmp_path: Path, replay: str, changed: str | None) -> None:
    """A training-mode batch norm saves its running statistics for the backward; its replay wrote
    them (the update, the rewind to the call's start, the values put back), their in-place
    versions moved and the compare's backward raised autograd's RuntimeError."""
    x = cnn_input()
    p = tmp_path / "g.h5"
    ag.record(build_cnn().train(), x, path=p, backward=True)
    live = build_cnn().train()
    if changed is not None:
        scale_weight(live, changed, 1.01)
    plain = copy.deepcopy(live)
    plain(*x)
    report = ag.compare(live, x, path=p, replay=replay)
    assert report.grad_count > 0
    if changed is None:
        assert report.ok, str(report)
    else:
        assert report.first_divergence is not None and report.first_divergence.name == changed
        assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", changed)
    _assert_as_after_one_forward(live, plain)


def test_the_callers_backward_after_a_replayed_compare_in_grad_mode(tmp_path: Path) -> None:
    """``grad=True`` hands back an output that requires grad: the caller's own backward through
    the training-mode batch norms runs after the replays, as after a plain forward."""
    x = cnn_input()
    p = tmp_path / "g.h5"
    ag.record(build_cnn().train(), x, path=p)
    live, plain = build_cnn().train(), build_cnn().train()
    report = ag.compare(live, x, path=p, replay="all", grad=True)
    assert report.ok, str(report)
    plain_out = plain(*x)
    _assert_as_after_one_forward(live, plain)
    report.output.sum().backward()
    plain_out.sum().backward()
    for (name, q), r in zip(live.named_parameters(), plain.parameters()):
        assert q.grad is not None and r.grad is not None and torch.equal(q.grad, r.grad), name


def test_a_child_run_in_its_parents_replay_leaves_the_backward_its_statistics(tmp_path: Path) -> None:
    """A child whose output changed structure runs during its parent's replay (no golden to
    return): its training-mode batch norm writes copies, and the compare's backward runs."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    p = tmp_path / "g.h5"
    ag.record(Trunk().train(), x, path=p, backward=True)
    live = Trunk(extra=True).train()
    plain = copy.deepcopy(live)
    plain(x)
    report = ag.compare(live, x, path=p, replay="all")
    assert report.first_divergence is not None and report.first_divergence.name == "branch"
    _assert_as_after_one_forward(live, plain)


class _Steps(nn.Module):
    """Counts its calls in a buffer it reassigns (not in place), and scales by the count."""

    def __init__(self, step: float = 1.0) -> None:
        super().__init__()
        self.step = step
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + self.step
        return x * self.count


class _Stepped(nn.Module):
    def __init__(self, step: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.steps, self.out = nn.Linear(4, 4), _Steps(step), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.steps(self.fc(x)))


@pytest.mark.parametrize("backward", [False, True])
def test_a_buffer_its_call_reassigns_is_replayed_from_the_calls_start(tmp_path: Path, backward: bool) -> None:
    """``self.count = self.count + 1``: the replay started from the count the live call left
    (a false alarm under replay="all") and left the replay's tensor in the module (the count
    advanced twice)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    p = tmp_path / "g.h5"
    ag.record(_Stepped(), x, path=p, backward=backward)
    live, plain = _Stepped(), _Stepped()
    plain(x)
    report = ag.compare(live, x, path=p, replay="all")
    assert report.ok, str(report)
    _assert_as_after_one_forward(live, plain)
    changed, plain = _Stepped(step=2.0), _Stepped(step=2.0)
    plain(x)
    report = ag.compare(changed, x, path=p, replay="all")
    assert report.first_divergence is not None and report.first_divergence.name == "steps"
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "steps")
    _assert_as_after_one_forward(changed, plain)


_NORMS = {
    "bn": lambda: nn.BatchNorm1d(6),
    "bn_cumulative": lambda: nn.BatchNorm1d(6, momentum=None),
    "bn_plain": lambda: nn.BatchNorm1d(6, affine=False),
    "bn_no_stats": lambda: nn.BatchNorm1d(6, track_running_stats=False),
    "steps": lambda: _Steps(0.5),
}


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(_NORMS)), st.booleans()), min_size=1, max_size=3),
       st.sampled_from(["first", "all"]), st.booleans(), st.integers(0, 2**16))
def test_stateful_layers_replayed_pass_unchanged_and_keep_one_forwards_state(
        norms: list[tuple[str, bool]], replay: str, backward: bool, seed: int) -> None:
    """Any stack of normalizations that update their buffers (in place, or by reassigning them), each
    in training or eval mode: recorded, then compared unchanged with replays (and gradients) passes,
    and leaves the model as one plain forward does."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 6)]
    for kind, training in norms:
        layers += [_NORMS[kind]().train(training), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(6, 2))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed + 1))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "g.h5"
        ag.record(copy.deepcopy(model), x, path=p, backward=backward)
        live, plain = copy.deepcopy(model), copy.deepcopy(model)
        plain(x)
        report = ag.compare(live, x, path=p, replay=replay)
    assert report.ok, str(report)
    _assert_as_after_one_forward(live, plain)


def _count_calls(mod: nn.Module, args: Any) -> None:
    mod.calls.add_(1)


def test_a_stubbed_childs_own_hook_writes_copies_of_its_buffers(tmp_path: Path) -> None:
    """A child that returns the golden's output in its parent's replay does not run its forward,
    but its own forward pre-hook does (as an old-style spectral norm's power iteration): what the
    hook writes in its buffers is the replay's, not the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 2)))
    model[1].register_buffer("calls", torch.zeros((), dtype=torch.int64))
    model[1].register_forward_pre_hook(_count_calls)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    p = tmp_path / "g.h5"
    ag.record(copy.deepcopy(model), x, path=p)
    live, plain = copy.deepcopy(model), copy.deepcopy(model)
    plain(x)
    report = ag.compare(live, x, path=p, replay="all")
    assert report.ok, str(report)
    assert int(live[1].calls) == 1
    _assert_as_after_one_forward(live, plain)


# --------------------------------------------------------------------------- replay="all"


def test_replay_all_judges_each_call_by_its_own_error_immune_to_inherited_drift(tmp_path: Path) -> None:
    model = build_cnn()
    changed = copy.deepcopy(model)
    scale_weight(changed, "conv1", 1.001)
    p = tmp_path / "g.h5"
    ag.record(model, cnn_input(), path=p)
    plain = ag.compare(changed, cnn_input(), path=p, replay="off")
    inherited = {r.name for r in plain.layers if not r.ok}
    assert len(inherited) > 3  # the change propagates through everything after conv1
    report = ag.compare(changed, cnn_input(), path=p, replay="all")
    bad = [r.name for r in report.layers if not r.ok]
    assert "conv1" in bad and report.first_divergence.name == "conv1"
    leaves_after = [r for r in report.layers if r.name in inherited and r.name not in ("conv1", "")
                    and r.type_name not in ("SmallCNN",)]
    assert leaves_after and all(r.inherited_status != "match" for r in leaves_after)
    assert all(r.ok for r in leaves_after if r.type_name in ("ReLU", "BatchNorm2d", "Conv2d", "Linear"))
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "conv1")
    text = str(report)
    assert "judged by     : its own error" in text


def test_origin_round_trips_through_json(tmp_path: Path) -> None:
    layer = _encoder_layer()
    changed = copy.deepcopy(layer)
    changed.activation = lambda t: F.gelu(t, approximate="tanh")
    report = _check(layer, changed, X, tmp_path)
    back = Report.from_dict(json.loads(json.dumps(report.to_dict(), allow_nan=False)))
    assert back.origin == report.origin and back == report and str(back) == str(report)


# --------------------------------------------------------------------------- calibrated replays


@pytest.mark.slow
def test_calibrated_replay_all_catches_a_weight_change_under_tf32_and_passes_noise(tmp_path: Path) -> None:
    """Regression: the golden side of a replay's own floor was measured against the *live*
    module's float64 replay, which a changed weight moves by the change itself: the allowance
    grew with the bug and a 1% weight passed (a false pass), while replay="first" called it
    "unknown"."""
    model = build_hf_bert()
    layer = "encoder.layer.1.intermediate.dense"
    changed = copy.deepcopy(model)
    scale_weight(changed, layer, 1.01)
    p = tmp_path / "g.h5"
    ag.record(model, token_input(), path=p, calibrate=True)
    with ag.emulate_tf32():
        clean = ag.compare(model, token_input(), path=p, tolerance="calibrated", replay="all")
        report = ag.compare(changed, token_input(), path=p, tolerance="calibrated", replay="all")
        first = ag.compare(changed, token_input(), path=p, tolerance="calibrated", replay="first")
    assert clean.ok and clean.origin is None
    assert not report.ok and report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", layer)
    assert first.origin is not None and (first.origin.kind, first.origin.name) == ("layer", layer)
    judged = next(r for r in report.layers if r.name == layer)
    assert judged.own_status == "diverged" and judged.leaves[0].error_multiple is not None
    assert judged.leaves[0].error_multiple > 10
    assert "golden floor: recorded" in (judged.leaves[0].tolerance_source or "")


def test_calibrated_replay_keeps_an_explicit_tolerances_pattern(tmp_path: Path) -> None:
    """A layer the user gave numbers for is judged strictly with them, replayed or not."""
    model = build_hf_bert()
    layer = "encoder.layer.1.intermediate.dense"
    changed = copy.deepcopy(model)
    scale_weight(changed, layer, 1.01)
    p = tmp_path / "g.h5"
    ag.record(model, token_input(), path=p, calibrate=True)
    report = ag.compare(changed, token_input(), path=p, tolerance="calibrated", replay="all",
                        tolerances={layer: dict(rtol=0.05, atol=0.05)})
    judged = next(r for r in report.layers if r.name == layer)
    assert judged.own_status == "match" and "overrides calibration" in (judged.leaves[0].tolerance_source or "")


def _gelu_layer(seed: int = 0) -> nn.TransformerEncoderLayer:
    torch.manual_seed(seed)
    return nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, activation="gelu", batch_first=True).eval()


X64 = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(1))


def test_replay_all_finds_a_tanh_gelu_in_the_parents_code_under_tf32_drift(tmp_path: Path) -> None:
    """The issue's measured failure under drift: replaying the parent re-ran its TF32 Linear
    (noise about 1e-3), which hid the tanh approximation (about 3e-4). Its children now return
    the golden's outputs during its replay, and the inputs its code gives 'dropout' are judged."""
    layer = _gelu_layer()
    changed = copy.deepcopy(layer)
    changed.activation = lambda t: F.gelu(t, approximate="tanh")
    p = tmp_path / "g.h5"
    ag.record(layer, X64, path=p, calibrate=True)
    with ag.emulate_tf32():
        clean = ag.compare(layer, X64, path=p, tolerance="calibrated", replay="all")
        report = ag.compare(changed, X64, path=p, tolerance="calibrated", replay="all")
    assert clean.ok, str(clean)
    o = report.origin
    assert o is not None and (o.kind, o.name, o.previous, o.child) == ("parent-code", "", "linear1", "dropout")
    assert "own code between 'linear1' and 'dropout'" in o.detail
    root = next(r for r in report.layers if r.name == "")
    assert root.path == "input args/0 of 'dropout'" and root.error_multiple is not None and root.error_multiple > 5
    assert all(r.ok for r in report.layers if r.name)  # each child computes what it did, TF32 Linears too


def test_a_parents_replay_judges_only_its_own_code_not_its_childrens(tmp_path: Path) -> None:
    """A changed weight in a child is that child's; its parent, replayed with the child returning
    the golden's output, computes what it computed before."""
    model = Net()
    changed = copy.deepcopy(model)
    scale_weight(changed, "block.fc1", 1.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    report = _check(model, changed, x, tmp_path, replay="all")
    status = {r.name: r.status for r in report.layers}
    assert status["block.fc1"] == "diverged" and status["block"] == "match" and status[""] == "match"
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "block.fc1")


def test_calibrated_replay_of_a_layer_with_a_kv_cache_has_its_float64_floor(tmp_path: Path) -> None:
    """The float64 replay runs on its own copy of the inputs and of the cache: run after the live
    replay, it got the cache the live replay had appended to and failed, silently (no own floor)."""
    model = build_hf_gpt2()
    p = tmp_path / "g.h5"
    ag.record(model, token_input(), path=p, calibrate=True)
    with ag.emulate_tf32():
        report = ag.compare(model, token_input(), path=p, tolerance="calibrated", replay="all")
    assert report.ok, str(report)
    assert not any("no own noise floor" in n for n in report.notes), report.notes
    attn = next(r for r in report.layers if r.name == "h.0.attn")
    assert "live floor: its own, the float64 module re-run" in (attn.tolerance_source or "")


class InPlaceScale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.factor)


def test_calibrated_replay_of_a_layer_that_changes_its_input_in_place(tmp_path: Path) -> None:
    """The float64 reference used to run after the live replay, on inputs the live replay had
    scaled in place: its floor measured that (a 2x error), and a 1% change passed."""
    def net(factor: float) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), InPlaceScale(factor), nn.Linear(8, 4)).eval()

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    p = tmp_path / "g.h5"
    ag.record(net(2.0), x, path=p, calibrate=True)
    assert ag.compare(net(2.0), x, path=p, tolerance="calibrated", replay="all").ok
    report = ag.compare(net(2.02), x, path=p, tolerance="calibrated", replay="all")
    assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "1")


class DropPath(nn.Module):
    """Stochastic depth as timm and transformers write it: a per-sample mask from torch.rand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = 0.5 + torch.rand(x.shape[0], 1, dtype=x.dtype, device=x.device)
        return x / 0.5 * keep.floor()


def test_float64_references_draw_the_float32_random_numbers(tmp_path: Path) -> None:
    """torch.rand in float64 gives other numbers than in float32 from one generator state: the
    float64 reference of a drop path in train mode drew another mask, its floor measured the mask,
    and the drop path left on passed its own replay."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), DropPath(), nn.Linear(8, 4)).eval()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(5))
    p = tmp_path / "g.h5"
    ag.record(model, x, path=p, calibrate=True)
    model[1].train()
    for seed in range(3):
        torch.manual_seed(seed)
        report = ag.compare(model, x, path=p, tolerance="calibrated", replay="all")
        assert report.origin is not None and (report.origin.kind, report.origin.name) == ("layer", "1"), str(report)
    for draw in (lambda dt: torch.rand(5, dtype=dt), lambda dt: torch.randn(5, dtype=dt),
                 lambda dt: torch.rand_like(torch.zeros(5, dtype=dt)), lambda dt: torch.zeros(5, dtype=dt).uniform_(),
                 lambda dt: torch.bernoulli(torch.full((64,), 0.5, dtype=dt)),
                 lambda dt: torch.normal(torch.zeros(64, dtype=dt), torch.ones(64, dtype=dt)),
                 lambda dt: torch.normal(torch.zeros(64, dtype=dt), 2.0),
                 lambda dt: torch.normal(0.5, torch.ones(64, dtype=dt)),
                 lambda dt: torch.normal(0.0, 1.0, (64,), dtype=dt),
                 lambda dt: torch.zeros(64, dtype=dt).log_normal_(),
                 lambda dt: torch.zeros(64, dtype=dt).cauchy_(),
                 lambda dt: torch.zeros(64, dtype=dt).geometric_(0.3)):
        torch.manual_seed(1)
        with float32_random():
            wide = draw(torch.float64)
        torch.manual_seed(1)
        narrow = draw(torch.float32)
        assert wide.dtype == torch.float64 and torch.equal(wide, narrow.double())


class Counting(nn.Linear):
    """A Linear that counts how often its forward runs."""

    runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counting.runs += 1
        return super().forward(x)


class Deep(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = Deep(depth - 1) if depth > 1 else Counting(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = self.inner(x)
        y = y[0] if isinstance(y, tuple) else y
        return y * 2, {"half": y / 2}


def test_replay_all_does_not_rerun_children_for_their_parents(tmp_path: Path) -> None:
    """Each parent's replay gets its children's golden outputs without running them (a skeleton
    of the live output filled with the golden's tensors): a replay costs a call's own code, not
    its subtree again. The leaf runs twice (live, and its own replay), not once per ancestor."""
    model = Deep(4)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(6))
    p = tmp_path / "g.h5"
    ag.record(model, x, path=p)
    Counting.runs = 0
    report = ag.compare(model, x, path=p, replay="all")
    assert report.ok and Counting.runs == 2
    changed = copy.deepcopy(model)
    scale_weight(changed, "inner.inner.inner.inner", 1.01)
    report = ag.compare(changed, x, path=p, replay="all")
    o = report.origin
    assert o is not None and (o.kind, o.name) == ("layer", "inner.inner.inner.inner")
    assert [r.name for r in report.layers if not r.ok] == ["inner.inner.inner.inner"]


def test_a_skeleton_keeps_the_structure_and_refuses_opaque_objects() -> None:
    t = torch.ones(2, 3)
    sk = skeleton((t, {"a": [t * 2, None, "s"]}))
    assert sk is not None and set(sk.meta) == {"0", "1/a/0"} and sk.meta["0"][0] == (2, 3)
    assert sk.output[0] is PLACEHOLDER and sk.output[1]["a"][1:] == [None, "s"]
    assert skeleton((t, object())) is None


class Branch(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(8)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.bn(x)
        return (y, y * 2, y * 3) if self.extra else (y, y * 2)


class Trunk(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.branch = Branch(extra)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.branch(self.fc(x))[0])


def test_a_child_whose_output_changed_structure_runs_in_its_parents_replay_and_keeps_state(tmp_path: Path) -> None:
    """A child whose live output does not have the golden's places cannot return the golden's
    output: it runs during its parent's replay, and what it changes (batch-norm statistics in
    training mode) is put back."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    p = tmp_path / "g.h5"
    ag.record(Trunk().train(), x, path=p)
    live = Trunk(extra=True).train()
    before = live.branch.bn.running_mean.clone()
    report = ag.compare(live, x, path=p, replay="all")
    after_one_forward = Trunk(extra=True).train()
    after_one_forward(x)
    assert torch.equal(live.branch.bn.running_mean, after_one_forward.branch.bn.running_mean)
    assert not torch.equal(before, live.branch.bn.running_mean)  # the live forward itself did update them
    status = {r.name: r.status for r in report.layers}
    assert status["branch"] == "structure" and status[""] == "match", status


class _Bump(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.v


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = _Bump(), _Bump(), _Bump()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


class _Renamed(nn.Module):
    def __init__(self, fc1: nn.Linear, proj: nn.Linear) -> None:
        super().__init__()
        self.fc1, self.proj = fc1, proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc1(x)))


def test_origin_names_the_layer_that_passed_a_difference_on(tmp_path: Path) -> None:
    """A child that changed but passed (a looser tolerances entry), or that the golden does not
    have (renamed), hands its difference on without failing: the origin names it, not its parent's
    code or randomness (found by review)."""
    torch.manual_seed(0)
    m, x = _Three(), torch.randn(3, 4)
    ag.record(m, (x,), path=tmp_path / "g.h5")
    m.b.v = 1e-3
    rep = ag.compare(m, (x,), path=tmp_path / "g.h5", tolerances={"b": {"atol": 1.0}})
    assert rep.first_divergence is not None and rep.first_divergence.name == "c"
    assert rep.origin is not None and rep.origin.name == "b" and "passed under" in rep.origin.detail
    assert "tolerances['b']" in str(rep)

    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    x2 = torch.randn(2, 3)
    ag.record(seq, (x2,), path=tmp_path / "s.h5")
    with torch.no_grad():
        seq[2].bias += 1
    last = ag.compare(seq, (x2,), path=tmp_path / "s.h5", tolerances={"2": {"atol": 10.0}})
    assert last.origin is not None and last.origin.name == "2" and "randomness" not in str(last)

    old = _Renamed(nn.Linear(4, 4), nn.Linear(4, 4))
    x3 = torch.randn(2, 4)
    ag.record(old, (x3,), path=tmp_path / "r.h5")
    proj = copy.deepcopy(old.proj)
    with torch.no_grad():
        proj.bias += 0.5
    new = _Renamed(old.fc1, proj)
    new.proj2 = new.proj  # (same module, another name: the golden's 'proj' is not what runs)
    del new.proj
    new.forward = lambda x: new.proj2(torch.relu(new.fc1(x)))  # type: ignore[method-assign]
    moved = ag.compare(new, (x3,), path=tmp_path / "r.h5")
    assert moved.origin is not None and moved.origin.name == "proj2" and "not in the golden" in moved.origin.detail
    assert "computed what they computed before" not in str(moved)


class _Cache:
    def __init__(self, t: torch.Tensor) -> None:
        self.layers = [{"k": t}]


class _ReadsCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mix = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        return self.mix(self.lin(x) + cache.layers[0]["k"])


def test_a_changed_cache_object_passed_to_the_model_is_an_input_change(tmp_path: Path) -> None:
    """An opaque input (a KV cache) was recorded by type only: a changed one was not an input
    change, and the first layer reading it was blamed (found by review). Its tensors are digested
    now; a golden from before (no digest) still compares it by type."""
    torch.manual_seed(0)
    m, x, k = _ReadsCache(), torch.randn(2, 4), torch.randn(2, 4)
    ag.record(m, (x,), {"cache": _Cache(k)}, path=tmp_path / "g.h5")
    assert ag.compare(m, (x,), {"cache": _Cache(k.clone())}, path=tmp_path / "g.h5").ok
    for replay in ("first", "all"):
        rep = ag.compare(m, (x,), {"cache": _Cache(k * 1.05)}, path=tmp_path / "g.h5", replay=replay)
        assert rep.input_changes == ["input kwargs/cache (_Cache): the tensors it holds differ"], replay
        assert rep.origin is not None and rep.origin.kind == "inputs", (replay, rep.origin)
    with h5py.File(tmp_path / "g.h5", "r+") as f:
        from golden_edit import set_json

        meta = json.loads(f["meta"][()].tobytes())
        for e in meta["inputs"]:
            e.pop("sha256", None) if e.get("kind") == "object" else None
        set_json(f, "meta", meta)
    old = ag.compare(m, (x,), {"cache": _Cache(k * 1.05)}, path=tmp_path / "g.h5")
    assert not old.ok and old.input_changes == []


class _AddsAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Bump(), _Bump()
        self.k = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + self.k


def test_a_parent_whose_own_code_changed_is_blamed_over_a_loose_child(tmp_path: Path) -> None:
    """The parent adds 0.5 after its last child; the child passed a 1e-4 change under a looser
    tolerances entry. The parent's replay (children returning the golden's values) differs by 0.5:
    its own code, not the child (found by review of the fix above)."""
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = _AddsAfter()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.p(x)

    torch.manual_seed(0)
    m, x = Root(), torch.randn(3, 4)
    ag.record(m, (x,), path=tmp_path / "g.h5")
    m.p.b.v, m.p.k = 1e-4, 0.5
    rep = ag.compare(m, (x,), path=tmp_path / "g.h5", tolerances={"p.b": {"atol": 1.0}})
    assert rep.origin is not None and rep.origin.name == "p" and rep.origin.kind == "parent-code", rep.origin


class _View(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1) if self.scale == 1.0 else x.transpose(0, 1) * self.scale


class _InPlaceAfterView(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.l, self.t, self.l2 = nn.Linear(4, 4), child, nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        v = self.t(h)
        h.mul_(3)  # in place on the base after the child returned a view of it (or it itself)
        return self.l2(v.reshape(-1, 3)[:4]) if v.shape[-1] != 3 else self.l2(v)


def test_replay_all_keeps_a_childs_view_of_its_input(tmp_path: Path) -> None:
    """A child returning a view of its input (or the input itself), changed in place by the parent
    afterwards: in the parent's replay the child's golden copy did not see the change, and the
    unchanged model failed at the parent (found by review). Such a child now runs in the replay."""
    torch.manual_seed(0)
    for child in (_View(), nn.Identity()):
        m, x = _InPlaceAfterView(child), torch.randn(3, 4)
        ag.record(m, (x,), path=tmp_path / "g.h5")
        same = ag.compare(m, (x,), path=tmp_path / "g.h5", replay="all")
        assert same.ok, (type(child).__name__, str(same))
    m = _InPlaceAfterView(_View())
    ag.record(m, (x,), path=tmp_path / "v.h5")
    m.t.scale = 1.01  # a real change in the child is still found, at the child
    bad = ag.compare(m, (x,), path=tmp_path / "v.h5", replay="all")
    assert not bad.ok and bad.origin is not None and bad.origin.name == "t", bad.origin


class _NumberChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        return self.lin(x), n


class _NumberParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.out = _NumberChild(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, n = self.c(x, 3)
        return self.out(y) * n


def test_a_child_returning_a_number_is_stubbed_and_its_parent_not_blamed(tmp_path: Path) -> None:
    """replay="all": a child whose output holds a Python number returns the golden's output in its
    parent's replay, number included (found by review: its skeleton left the number out, so the
    child ran live and its own change was blamed on the parent as well)."""
    torch.manual_seed(0)
    m = nn.Sequential(_NumberParent()).eval()
    x = torch.randn(4, 8)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    with torch.no_grad():
        m[0].c.lin.weight.mul_(1.01)
    report = ag.compare(m, x, path=p, replay="all")
    own = {(lr.name, lr.call): lr.own_status for lr in report.layers}
    assert own[("0.c.lin", 0)] == "diverged"
    assert own[("0", 0)] == "match" and own[("0.c", 0)] == "match", own
    assert report.origin is not None and report.origin.name == "0.c.lin" and report.origin.kind == "layer"

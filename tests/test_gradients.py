"""Gradient goldens: what the capture records, and that it leaves the model alone.

The captured gradients are checked against ``register_full_backward_hook`` on out-of-place
twins of the models (which that hook can run), including a property test over random stacks;
the in-place models themselves (transformers' ResNet, ``y = conv(x); y += r``) break that hook
and must run unchanged under the capture.
"""

from __future__ import annotations

import gc
import json
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from golden_edit import index_dict, set_index
from hypothesis import given
from hypothesis import strategies as st
from models import build_hf_gpt2, build_lstm, lstm_input, shared_loop, token_input
from torch import nn

import activation_guard as ag
from activation_guard._core.errors import ActivationGuardError, OptionError
from activation_guard.capture.hooks import hooked, run_forward
from activation_guard.gradients.hooks import Event, GradCapture
from activation_guard.gradients.loss import LossRule, path_seed


class Collect:
    """A GradSink that keeps every gradient (cloned) and the backward order."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str, int, str], torch.Tensor | None] = {}
        self.order: list[tuple[str, str, int]] = []

    def leaf(self, event: Event, path: str, grad: torch.Tensor | None) -> None:
        self.values[(event.grad, event.name, event.call, path)] = None if grad is None else grad.detach().clone()

    def finish(self, events: list[Event]) -> None:
        self.order = [(e.grad, e.name, e.call) for e in events]


def capture(model: nn.Module, *args: Any, rule: LossRule | None = None) -> Collect:
    sink = Collect()
    cap = GradCapture(sink)
    try:
        with hooked(model, cap.on_output, on_enter=cap.on_enter) as state:
            out = run_forward(model, args, {}, state, grad=True)
        cap.backward(model, out, rule or LossRule("cotangent"), args)
    finally:
        cap.close()
    return sink


def cotangent_of(out: torch.Tensor, seed: int = 0, path: str = "") -> torch.Tensor:
    """The cotangent of the model output's leaf at ``path`` (a single tensor output: ``""``)."""
    return torch.randn(tuple(out.shape), generator=torch.Generator().manual_seed(path_seed(seed, path)))


def full_hooks(model: nn.Module, *args: Any) -> tuple[dict[str, tuple[Any, Any]], dict[str, torch.Tensor]]:
    """Each module's (grad_input, grad_output) from register_full_backward_hook (calls: the last
    one wins; used on models without weight sharing), and the parameters' gradients."""
    seen: dict[str, tuple[Any, Any]] = {}
    handles = [m.register_full_backward_hook(lambda m, gi, go, n=n: seen.__setitem__(n, (gi, go)))
               for n, m in model.named_modules()]
    try:
        x = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        out = model(*x)
        with warnings.catch_warnings():  # "firing ... since no inputs require gradients": as wanted
            warnings.simplefilter("ignore", UserWarning)
            out.backward(cotangent_of(out))
    finally:
        for h in handles:
            h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return seen, grads


# --------------------------------------------------------------------------- the in-place trap


class AddInPlace(nn.Module):
    """``y = self.conv(x); y += r``: a module's output modified in place after it returned."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.act = nn.ReLU(inplace=inplace)
        self.fc = nn.Linear(3 * 4 * 4, 2)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x
        y = self.conv(x)
        if self.inplace:
            y += r
        else:
            y = y + r
        return self.fc(self.act(y).flatten(1))


def test_full_backward_hooks_break_the_in_place_model_and_the_capture_does_not() -> None:
    torch.manual_seed(0)
    model = AddInPlace()
    x = torch.randn(2, 3, 4, 4)
    handles = [m.register_full_backward_hook(lambda *a: None) for m in model.modules()]
    with pytest.raises(RuntimeError, match="view and is being modified inplace"):
        model(x)
    for h in handles:
        h.remove()
    twin = AddInPlace(inplace=False)
    twin.load_state_dict(model.state_dict())
    got = capture(model, x)
    ref, pgrads = full_hooks(twin, x)
    for name in ("conv", "act", "fc"):
        _, go = ref[name]
        assert torch.equal(got.values[("output", name, 0, "")], go[0]), name  # pre-modification gradient
    for name in ("act", "fc"):  # conv's input (the model input) needs no gradient
        assert torch.allclose(got.values[("input", name, 0, "args/0")], ref[name][0][0], atol=1e-7), name
    assert ("input", "conv", 0, "args/0") not in got.values
    for pname, g in pgrads.items():
        mod, leaf = pname.rsplit(".", 1)
        assert torch.allclose(got.values[("param", mod, 0, leaf)], g, atol=1e-7), pname
    assert got.order[0] == ("output", "", 0)  # the model's output first, then inward
    assert got.order.index(("output", "fc", 0)) < got.order.index(("output", "act", 0)) < \
        got.order.index(("output", "conv", 0))


class MulAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y.mul_(2)  # after fc returned: fc's output gradient is that of the value fc returned
        return y


def test_an_output_modified_in_place_gets_the_gradient_of_the_value_the_module_returned() -> None:
    torch.manual_seed(0)
    got = capture(MulAfter(), torch.randn(2, 3))
    c = got.values[("output", "", 0, "")]
    assert c is not None and torch.equal(got.values[("output", "fc", 0, "")], 2 * c)


def test_transformers_resnet_records_and_compares_with_gradients(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic")
    torch.manual_seed(0)
    model = transformers.ResNetModel(cfg).eval()
    x = torch.randn(2, 3, 16, 16)
    handles = [m.register_full_backward_hook(lambda *a: None) for m in model.modules()]
    with pytest.raises(RuntimeError, match="BackwardHookFunction is a view and is being modified inplace"):
        model(x)
    for h in handles:
        h.remove()
    summary = ag.record(model, x, path=tmp_path / "r.h5", backward=True)
    assert summary.gradients > 50
    report = ag.compare(model, x, path=tmp_path / "r.h5")
    assert report.ok and report.grad_count == summary.gradients, str(report)
    # across `hidden_state += residual`: what reaches the block's inner stack is what its
    # activation (which reads the sum) sends back
    got = capture(model, x)
    layer = "encoder.stages.1.layers.0"
    assert torch.equal(got.values[("output", f"{layer}.layer", 0, "")],
                       got.values[("input", f"{layer}.activation", 0, "args/0")])


def test_the_fallback_node_counter_captures_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's private counter read without a node, or a node made to read it: the same gradients."""
    from activation_guard.gradients import hooks as gradients

    torch.manual_seed(0)
    model = nn.Sequential(Residual(nn.Sequential(nn.Linear(4, 4), nn.Tanh())), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    want = capture(model, x)
    monkeypatch.setattr(gradients, "_sequence_nr", gradients._next_node_nr)
    got = capture(model, x)
    assert got.order == want.order and got.values.keys() == want.values.keys()
    assert all(torch.equal(v, want.values[k]) for k, v in got.values.items() if v is not None)


# --------------------------------------------------------------------------- property: random stacks


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


BLOCKS = ("linear", "tanh", "relu", "identity", "residual", "double")


def _block(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(4, 4)
    if kind == "tanh":
        return nn.Tanh()
    if kind == "relu":
        return nn.ReLU()
    if kind == "identity":
        return nn.Identity()
    if kind == "residual":
        return Residual(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 4)))


@given(st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=6), st.integers(0, 2**16))
def test_captured_gradients_equal_full_backward_hooks_on_random_stacks(kinds: list[str], seed: int) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), *(_block(k) for k in kinds))
    x = torch.randn(3, 4)
    got = capture(model, x)
    ref, pgrads = full_hooks(model, x)
    for name, (gi, go) in ref.items():
        assert torch.allclose(got.values[("output", name, 0, "")], go[0], atol=1e-6), name
        if gi[0] is not None:
            assert torch.allclose(got.values[("input", name, 0, "args/0")], gi[0], atol=1e-6), name
    for pname, g in pgrads.items():
        mod, leaf = pname.rsplit(".", 1)
        assert torch.allclose(got.values[("param", mod, 0, leaf)], g, atol=1e-6), pname


# --------------------------------------------------------------------------- weight sharing, integers


def test_weight_sharing_has_per_call_gradients_and_accumulated_parameter_gradients() -> None:
    model = shared_loop()
    x = torch.randn(2, 6)
    got = capture(model, x)
    calls = [k for k in got.order if k[1] == "shared"]
    assert calls == [("output", "shared", 2), ("input", "shared", 2), ("output", "shared", 1), ("input", "shared", 1),
                     ("output", "shared", 0), ("input", "shared", 0), ("param", "shared", 0)]
    outs = [got.values[("output", "shared", k, "")] for k in range(3)]
    assert not torch.equal(outs[0], outs[1])  # each call its own gradient
    y = model(x)
    y.backward(cotangent_of(y))
    for pname in ("weight", "bias"):
        ref = getattr(model.shared, pname).grad
        assert ref is not None and torch.allclose(got.values[("param", "shared", 0, pname)], ref, atol=1e-7)
        # the accumulated gradient is the sum over the calls: weight grad = sum_k g_k^T x_k
    assert torch.allclose(got.values[("param", "shared", 0, "bias")], sum(o.sum(0) for o in outs), atol=1e-6)


def test_integer_inputs_have_no_gradient_and_no_error(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = build_hf_gpt2()
    ids = token_input()[0]
    got = capture(model, ids)
    assert ("output", "wte", 0, "") in got.values and not any(k[0] == "input" and k[1] == "wte" for k in got.values)
    assert not any(k[0] == "input" and k[1] == "" for k in got.values)  # the root takes only token ids
    ag.record(model, ids, path=tmp_path / "g.h5", backward=True)
    assert ag.compare(model, ids, path=tmp_path / "g.h5").ok


def test_equal_gradients_are_stored_once_and_read_back_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model, ids = build_hf_gpt2(), token_input()[0]
    got = capture(model, ids)  # every gradient as delivered, nothing shared
    ag.record(model, ids, path=tmp_path / "g.h5", backward=True)
    with ag.read_golden(tmp_path / "g.h5") as r:
        aliases = 0
        for c in r.backward:
            for leaf in c.leaves:
                want = got.values[(c.grad or "", c.name, c.call, leaf.path)]
                aliases += leaf.kind == "alias"
                if leaf.kind == "none":
                    assert want is None
                else:
                    assert want is not None and torch.equal(r.load(leaf), want), (c.grad, c.name, leaf.path)
    assert aliases > 20  # e.g. a block's output gradient is its last child's


class TwoHeads(nn.Module):
    """Returns a tuple and a dict inside it; one output is an integer tensor (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.a = nn.Linear(6, 2)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.body(x)
        return self.a(h), {"b": self.b(h), "argmax": self.b(h).argmax(-1)}


def test_tuple_outputs_and_unused_outputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(2, 4)
    got = capture(model, x)
    assert {k[3] for k in got.values if k[:3] == ("output", "", 0)} == {"0", "1/b"}  # no integer leaf
    # the root's output gradients are the seeded cotangents, each seeded by its leaf's path
    for path, shape in (("0", (2, 2)), ("1/b", (2, 3))):
        gen = torch.Generator().manual_seed(path_seed(0, path))
        assert torch.equal(got.values[("output", "", 0, path)], torch.randn(*shape, generator=gen))
    lstm = build_lstm()
    ids = lstm_input()[0]
    got = capture(lstm, ids)
    assert got.values[("output", "lstm", 0, "1/0")] is None and got.values[("output", "lstm", 0, "1/1")] is None
    assert got.values[("output", "lstm", 0, "0")] is not None  # (h, c) unused: no gradient reached them
    ag.record(lstm, ids, path=tmp_path / "l.h5", backward=True)
    assert ag.compare(lstm, ids, path=tmp_path / "l.h5").ok


def test_rename_and_missing_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 3), b=nn.Tanh(), c=nn.Linear(3, 2)))
    x = torch.randn(2, 3)
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    renamed = nn.Sequential(OrderedDict(first=model.a, b=model.b, c=model.c))
    report = ag.compare(renamed, x, path=tmp_path / "g.h5", rename={"a": "first"})
    assert report.ok and any(r.name == "first" and r.phase == "param-grad" for r in report.layers)
    model.a.requires_grad_(False)  # a frozen first layer: nothing of it is differentiated any more
    report = ag.compare(model, x, path=tmp_path / "g.h5")
    missing = [(r.name, r.wrt) for r in report.layers if r.status == "missing"]
    # the first gradient the live backward no longer computes: what 'c' sends back into 'b'
    assert missing == [("c", "input"), ("b", "output"), ("b", "input"), ("a", "output"), ("a", None)]
    assert all(r.ok for r in report.layers if r.status != "missing")
    fd = report.first_divergence
    assert fd is not None and (fd.name, fd.wrt, fd.status) == ("c", "input", "missing")
    assert "gradient not computed in the live run" in report.headline()
    assert "in the golden's backward order" in report.headline()


# --------------------------------------------------------------------------- the model is left alone


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 4)
        self.keep: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))  # saved for the backward
        self.keep = weakref.ref(h)
        return self.fc2(self.drop(h))


@pytest.mark.slow
def test_state_is_left_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Dropper().train()
    x = torch.randn(4, 8)
    before = torch.full_like(model.fc1.weight, 7.0)
    model.fc1.weight.grad = before
    fired: list[int] = []
    model.fc2.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))  # an optimizer step in backward
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with torch.no_grad():
        ag.record(model, x, path=tmp_path / "g.h5", backward=True)
        assert not torch.is_grad_enabled()
    assert model.training and all(m.training for m in model.modules())
    assert model.fc1.weight.grad is before and torch.all(before == 7.0)  # the very tensor, unchanged
    assert model.fc1.bias.grad is None and model.fc2.weight.grad is None
    assert fired == [] and all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    gc.collect()
    assert model.keep() is None  # nothing holds the graph's saved tensors
    torch.manual_seed(5)
    assert ag.compare(model, x, path=tmp_path / "g.h5").ok
    gc.collect()
    assert model.keep() is None and model.fc1.weight.grad is before and model.training
    # the RNG moved by the forward's dropout only, exactly as a forward-only recording moves it
    after = torch.get_rng_state()
    torch.set_rng_state(rng)
    ag.record(model, x, path=tmp_path / "f.h5")
    assert torch.equal(torch.get_rng_state(), after)
    (model.fc2.weight * 1).sum().backward()
    assert fired == [1]  # the user's hook is still there


def test_dropout_in_train_mode_under_a_fixed_seed_matches_forward_and_backward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Dropper().train()
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    out = ag.record(model, x, path=tmp_path / "g.h5", backward=True).output
    torch.manual_seed(3)
    assert torch.equal(out, model(x))  # the same masks as a plain forward under that seed
    torch.manual_seed(3)
    assert ag.compare(model, x, path=tmp_path / "g.h5").ok
    torch.manual_seed(4)  # other masks: the forward diverges first
    report = ag.compare(model, x, path=tmp_path / "g.h5")
    assert not report.ok and report.first_divergence is not None and report.first_divergence.phase == "forward"


def test_the_returned_output_holds_no_graph(tmp_path: Path) -> None:
    model = shared_loop()
    out = ag.record(model, torch.randn(2, 6), path=tmp_path / "g.h5", backward=True).output
    assert out.grad_fn is None and not out.requires_grad
    report = ag.compare(model, torch.randn(2, 6), path=tmp_path / "g.h5")
    assert report.output.grad_fn is None


# --------------------------------------------------------------------------- options and goldens


def test_backward_option_is_validated_once() -> None:
    with pytest.raises(OptionError, match=r"backward=3 \(argument\): must be True, False or a callable"):
        ag.record(nn.Linear(2, 2), torch.randn(1, 2), path="x.h5", backward=3)
    with pytest.raises(OptionError, match="must be True, False or a callable"):
        ag.compare(nn.Linear(2, 2), torch.randn(1, 2), path="x.h5", backward="sometimes")
    from activation_guard.options.spec import build_specs

    rec, cmp_ = build_specs({"backward": "true"}, "ini")
    assert rec.backward is True and cmp_.backward is True
    rec, _ = build_specs({"backward": loss_first_row}, "marker")
    assert rec.backward is loss_first_row and rec.describe() == "backward=loss_first_row (marker)"


def test_a_golden_without_gradients_still_compares_forward_only(tmp_path: Path) -> None:
    model = shared_loop()
    x = torch.randn(2, 6)
    ag.record(model, x, path=tmp_path / "g.h5")
    with h5py.File(tmp_path / "g.h5") as f:
        assert "backward" not in index_dict(f)
    report = ag.compare(model, x, path=tmp_path / "g.h5")
    assert report.ok and report.grad_count == 0 and all(r.phase == "forward" for r in report.layers)
    with pytest.raises(ActivationGuardError, match="the golden has no gradients"):
        ag.compare(model, x, path=tmp_path / "g.h5", backward=True)


def loss_first_row(out: torch.Tensor) -> torch.Tensor:
    return (out[0] ** 2).sum()


def test_a_custom_loss_is_needed_again_at_compare(tmp_path: Path) -> None:
    model = shared_loop()
    x = torch.randn(2, 6)
    ag.record(model, x, path=tmp_path / "g.h5", backward=loss_first_row)
    with h5py.File(tmp_path / "g.h5") as f:
        meta = json.loads(f["meta"][()].tobytes())
    assert meta["backward"]["loss"] == "custom" and meta["backward"]["function"].endswith("loss_first_row")
    with pytest.raises(ActivationGuardError, match=r"custom loss function .*loss_first_row.* pass the same function"):
        ag.compare(model, x, path=tmp_path / "g.h5")
    assert ag.compare(model, x, path=tmp_path / "g.h5", backward=loss_first_row).ok
    report = ag.compare(model, x, path=tmp_path / "g.h5", backward=lambda out: (out[1] ** 2).sum())
    assert not report.ok and report.first_divergence is not None
    assert report.first_divergence.phase == "backward" and report.origin is not None
    assert report.origin.kind == "unknown" and "loss differs" in report.origin.detail
    with pytest.raises(ActivationGuardError, match="backward=False to compare the forward only"):
        ag.compare(model, x, path=tmp_path / "g.h5", backward=True)
    assert ag.compare(model, x, path=tmp_path / "g.h5", backward=False).ok


def test_seeded_cotangent_is_stored_and_reused(tmp_path: Path) -> None:
    model = shared_loop()
    x = torch.randn(2, 6)
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    with h5py.File(tmp_path / "g.h5") as f:
        meta = json.loads(f["meta"][()].tobytes())
        index = index_dict(f)
    assert meta["backward"]["loss"] == "cotangent" and meta["backward"]["seed"] == 0
    assert "randn" in meta["backward"]["rule"] and meta["backward"]["gradients"] == len(index["backward"])
    first = index["backward"][0]
    assert (first["grad"], first["name"], first["call"]) == ("output", "", 0)
    # the root's output gradient is the cotangent itself
    with ag.read_golden(tmp_path / "g.h5") as r:
        g = r.load(r.by_grad[("output", "", 0)].leaves[0])
    assert torch.equal(g, cotangent_of(g))
    assert ag.compare(model, x, path=tmp_path / "g.h5").ok
    with pytest.raises(ActivationGuardError, match=r"recorded with backward=True .* given the loss function"):
        ag.compare(model, x, path=tmp_path / "g.h5", backward=lambda out: out.sum())


def test_frozen_model_with_backward_is_a_clear_error(tmp_path: Path) -> None:
    model = shared_loop().requires_grad_(False)
    with pytest.raises(ActivationGuardError, match="no floating or complex tensor in the model's output requires grad"):
        ag.record(model, torch.randn(2, 6), path=tmp_path / "g.h5", backward=True)
    assert not (tmp_path / "g.h5").exists()


def test_compiled_models_are_refused_with_backward(tmp_path: Path) -> None:
    model = torch.compile(nn.Linear(2, 2), backend="eager")
    with pytest.raises(ag.UnsupportedModelError, match="compiled regions"):
        ag.record(model, torch.randn(1, 2), path=tmp_path / "g.h5", backward=True)


def test_malformed_backward_sections_are_refused(tmp_path: Path) -> None:
    ag.record(shared_loop(), torch.randn(2, 6), path=tmp_path / "g.h5", backward=True)
    with h5py.File(tmp_path / "g.h5", "r+") as f:  # (a format-2 index: the tables have no code for it)
        index = index_dict(f)
        index["backward"][0]["grad"] = "sideways"
        set_index(f, index)
    with pytest.raises(ag.GoldenFormatError, match="backward entry #0 is malformed"):
        ag.read_golden(tmp_path / "g.h5")


def test_param_grads_follow_their_modules_last_gradient() -> None:
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 3), b=nn.Linear(3, 2)))
    got = capture(model, torch.randn(2, 3))
    assert got.order == [("output", "", 0), ("output", "b", 0), ("input", "b", 0), ("param", "b", 0),
                         ("output", "a", 0), ("param", "a", 0)]


def test_gradients_without_their_meta_record_are_refused_not_skipped(tmp_path: Path) -> None:
    """Gradients are compared when the meta says how they were taken: with that record deleted, a
    changed backward passed with no note (found by review). Such a file was edited: refused."""
    from golden_edit import set_json

    model = shared_loop()
    x = torch.randn(2, 6)
    ag.record(model, x, path=tmp_path / "g.h5", backward=True)
    with h5py.File(tmp_path / "g.h5", "r+") as f:
        meta = json.loads(f["meta"][()].tobytes())
        del meta["backward"]
        set_json(f, "meta", meta)
    with pytest.raises(ag.GoldenFormatError, match="gradient entries but its metadata has no record"):
        ag.compare(model, x, path=tmp_path / "g.h5")


def test_a_gradient_alias_to_a_layer_output_is_refused(tmp_path: Path) -> None:
    ag.record(shared_loop(), torch.randn(2, 6), path=tmp_path / "g.h5", backward=True)
    with h5py.File(tmp_path / "g.h5", "r+") as f:
        index = index_dict(f)
        first = index["calls"][0]
        index["backward"][0]["leaves"][0] = {"kind": "alias", "path": "", "name": first["name"],
                                             "call": first["call"], "section": "out", "of": ""}
        set_index(f, index)
    with pytest.raises(ag.GoldenFormatError, match="a gradient can only equal a gradient"):
        ag.read_golden(tmp_path / "g.h5")

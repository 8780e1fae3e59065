"""Capture: which modules are hooked, how outputs are flattened and addressed, in-place safety,
hook hygiene, and that the model is left exactly as it was."""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import one_thread, shared_loop, tiny_mlp
from torch import nn

import activation_guard as ag
from activation_guard.capture.hooks import hooked, normalize_inputs
from activation_guard.values.leaves import flatten


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():  # see models.one_thread: 1000x faster tiny forwards on a loaded machine
        yield



def golden_calls(path) -> list[tuple[str, int]]:
    with ag.read_golden(path) as r:
        return [(c.name, c.call) for c in r.calls]


def golden_leaf(path, name: str, call: int = 0, leaf_path: str = "") -> torch.Tensor:
    with ag.read_golden(path) as r:
        entry = r.by_key[(name, call)]
        (leaf,) = [lf for lf in entry.leaves if lf.path == leaf_path]
        return r.load(leaf)


def all_hooks_gone(model: nn.Module) -> bool:
    return all(
        not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()
    )


# --------------------------------------------------------------------------- flatten / paths


@dataclass
class Pair:
    left: torch.Tensor
    right: Any


class Opaque:
    """An object activation_guard knows nothing about (like a KV cache)."""

    def __iter__(self):
        raise AssertionError("capture must not iterate unknown objects")


def test_flatten_nested_outputs_with_stable_paths():
    t = torch.ones(2)
    gen = (i for i in range(3))
    out = (
        t,
        [t * 2, None, {"a": t, "b/c": 3, "d%": "text"}],
        OrderedDict(z=Pair(t, 1.5), y=(True, 2 + 1j)),
        Opaque(),
        gen,
        [],
        {},
        2**70,
    )
    leaves = flatten(out)
    got = {lf.path: (lf.kind, lf.type_name) for lf in leaves}
    assert [lf.path for lf in leaves] == [
        "0", "1/0", "1/1", "1/2/a", "1/2/b%2Fc", "1/2/d%25", "2/z/left", "2/z/right",
        "2/y/0", "2/y/1", "3", "4", "5", "6", "7",
    ]
    assert got["1/1"] == ("none", "None")
    assert got["1/2/b%2Fc"] == ("tensor", "int")  # numbers become 0-d tensors
    assert got["1/2/d%25"] == ("str", "str")
    assert got["2/z/right"] == ("tensor", "float")
    assert got["2/y/0"] == ("tensor", "bool")
    assert got["2/y/1"] == ("tensor", "complex")
    assert got["3"] == ("object", "Opaque")
    assert got["4"] == ("object", "generator")
    assert got["5"] == ("object", "empty list")
    assert got["6"] == ("object", "empty dict")
    assert got["7"] == ("str", "int")  # too big for int64: kept exactly, as text
    assert list(gen) == [0, 1, 2]  # the generator was not consumed
    assert [lf.path for lf in flatten(out)] == [lf.path for lf in leaves]  # stable
    assert flatten(t)[0].path == ""  # a bare tensor output has the empty path


def test_flatten_hf_model_output():
    transformers = pytest.importorskip("transformers")
    o = transformers.modeling_outputs.BaseModelOutputWithPooling(
        last_hidden_state=torch.zeros(1, 2, 3), pooler_output=torch.ones(1, 3)
    )
    assert [(lf.path, lf.kind) for lf in flatten(o)] == [("last_hidden_state", "tensor"), ("pooler_output", "tensor")]


class OddOutputs(nn.Module):
    """A layer whose output mixes every kind of value."""

    def __init__(self, scale: float = 1.0, tag: str = "v1"):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = scale
        self.tag = tag

    def forward(self, x):
        y = self.lin(x) * self.scale
        return {
            "tensor": y,
            "tuple": (y.sum(), None, [y[0], 7]),
            "pair": Pair(y[:, 0], 0.25),
            "tag": self.tag,
            "cache": Opaque(),
        }


class Wrap(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_odd_outputs_record_and_compare(tmp_path):
    torch.manual_seed(0)
    m = Wrap(OddOutputs())
    x = torch.randn(2, 3)
    path = tmp_path / "odd.h5"
    ag.record(m, x, path=path)
    with ag.read_golden(path) as r:
        leaves = {lf.path: lf for lf in r.by_key[("inner", 0)].leaves}
    assert sorted(leaves) == sorted(
        ["tensor", "tuple/0", "tuple/1", "tuple/2/0", "tuple/2/1", "pair/left", "pair/right", "tag", "cache"]
    )
    assert leaves["cache"].kind == "object" and leaves["cache"].type_name == "Opaque"
    assert leaves["tag"].value == "v1"
    assert leaves["tuple/1"].kind == "none"
    assert ag.compare(m, x, path=path).ok

    # a changed string is a divergence at that output path
    m.inner.tag = "v2"
    rep = ag.compare(m, x, path=path)
    fd = rep.first_divergence
    assert (fd.name, fd.status, fd.path) == ("inner", "diverged", "tag")


def test_object_type_change_is_a_structure_change(tmp_path):
    class Other:
        pass

    class M(nn.Module):
        def __init__(self, obj):
            super().__init__()
            self.obj = obj

        def forward(self, x):
            return x + 1, self.obj

    path = tmp_path / "g.h5"
    ag.record(M(Opaque()), torch.zeros(2), path=path)
    assert ag.compare(M(Opaque()), torch.zeros(2), path=path).ok
    fd = ag.compare(M(Other()), torch.zeros(2), path=path).first_divergence
    assert (fd.name, fd.status, fd.path) == ("", "structure", "1")
    assert "Opaque -> Other" in fd.detail


@st.composite
def nested(draw, depth=0):
    if depth >= 3 or draw(st.booleans()):
        kind = draw(st.sampled_from(["tensor", "none", "int", "float", "str"]))
        if kind == "tensor":
            shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            return torch.arange(float(torch.Size(shape).numel())).reshape(shape) * draw(st.integers(1, 5))
        return {"none": None, "int": draw(st.integers(-5, 5)), "float": 0.5, "str": "s"}[kind]
    container = draw(st.sampled_from(["tuple", "list", "dict"]))
    items = draw(st.lists(nested(depth + 1), min_size=1, max_size=3))
    if container == "dict":
        keys = draw(st.lists(st.text("ab/%.", min_size=1, max_size=3), min_size=len(items), max_size=len(items),
                             unique=True))
        return dict(zip(keys, items))
    return tuple(items) if container == "tuple" else list(items)


class Const(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out


@given(out=nested())
def test_nested_outputs_property(tmp_path_factory, out):
    """Paths are unique and stable, and a golden of any nesting reads back the same leaves."""
    leaves = flatten(out)
    paths = [lf.path for lf in leaves]
    assert len(set(paths)) == len(paths)
    assert paths == [lf.path for lf in flatten(copy.deepcopy(out))]
    path = tmp_path_factory.mktemp("nest") / "g.h5"
    ag.record(Const(out), torch.zeros(1), path=path)
    with ag.read_golden(path) as r:
        (entry,) = r.calls
        assert [lf.path for lf in entry.leaves] == paths
        for lf, orig in zip(entry.leaves, leaves):
            assert lf.kind == orig.kind
            if lf.kind == "tensor":
                assert torch.equal(r.load(lf), orig.tensor)
    assert ag.compare(Const(copy.deepcopy(out)), torch.zeros(1), path=path).ok


# --------------------------------------------------------------------------- in-place aliasing


class InPlaceAfter(nn.Module):
    """``lin``'s output is mutated in place after its hook fired: relu_, add_, and an
    in-place ReLU module, plus a view of it returned by ``view``."""

    def __init__(self, bump: float = 1.0):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.view = nn.Identity()  # returns its input: an alias of lin's output
        self.relu = nn.ReLU(inplace=True)
        self.bump = bump

    def forward(self, x):
        y = self.lin(x)
        v = self.view(y[:, ::2])  # a strided view into y
        y = self.relu(y)  # in-place module
        y.add_(self.bump)
        v.relu_()
        return y.clone()


def test_inplace_ops_do_not_change_captured_values(tmp_path):
    torch.manual_seed(0)
    m = InPlaceAfter()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expect_lin = m.lin(x)
    assert (expect_lin < 0).any()  # otherwise relu would not change anything
    path = tmp_path / "g.h5"
    ag.record(m, x, path=path)
    assert torch.equal(golden_leaf(path, "lin"), expect_lin)
    assert torch.equal(golden_leaf(path, "view"), expect_lin[:, ::2])
    assert torch.equal(golden_leaf(path, "relu"), expect_lin.relu())
    assert torch.equal(golden_leaf(path, ""), expect_lin.relu() + 1)
    assert ag.compare(m, x, path=path).ok


def test_inplace_ops_do_not_leak_into_compare(tmp_path):
    """Compare sees each output as the layer produced it: a change *after* a layer (a different
    in-place bump) must not be blamed on that layer or on the in-place ReLU."""
    torch.manual_seed(0)
    m = InPlaceAfter(bump=1.0)
    x = torch.randn(3, 4)
    path = tmp_path / "g.h5"
    ag.record(m, x, path=path)
    m.bump = 2.0
    rep = ag.compare(m, x, path=path)
    status = {(r.name, r.call): r.status for r in rep.layers}
    assert status[("lin", 0)] == "match"
    assert status[("view", 0)] == "match"
    assert status[("relu", 0)] == "match"
    assert status[("", 0)] == "diverged"
    assert rep.first_divergence.name == ""


def test_tensor_method_inplace_relu_then_compare(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            h.relu_()
            h.mul_(3)
            return self.b(h)

    torch.manual_seed(1)
    m = M()
    x = torch.randn(5, 4)
    path = tmp_path / "g.h5"
    ag.record(m, x, path=path)
    with torch.no_grad():
        assert torch.equal(golden_leaf(path, "a"), m.a(x))
    rep = ag.compare(m, x, path=path)
    assert rep.ok, str(rep)


# --------------------------------------------------------------------------- calls / sharing


def test_weight_shared_module_yields_calls_0_to_k_minus_1(tmp_path):
    m = shared_loop(steps=4)
    path = tmp_path / "g.h5"
    ag.record(m, torch.randn(2, 6), path=path)
    calls = golden_calls(path)
    assert [c for n, c in calls if n == "shared"] == [0, 1, 2, 3]
    assert [c for n, c in calls if n == "act"] == [0, 1, 2, 3]
    assert [c for n, c in calls if n == "blocks.2"] == [0]
    # post-order: children before parents, root last; the shared layer interleaves with blocks
    assert calls[:3] == [("blocks.0", 0), ("shared", 0), ("act", 0)]
    assert calls[-1] == ("", 0)


def test_module_registered_under_two_names_uses_the_first(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(3, 3)
            self.alias = self.first  # the same module object under a second name

        def forward(self, x):
            return self.alias(self.first(x))

    path = tmp_path / "g.h5"
    ag.record(M(), torch.randn(1, 3), path=path)
    assert golden_calls(path) == [("first", 0), ("first", 1), ("", 0)]


def test_module_called_from_a_functional_loop_and_recursion(tmp_path):
    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.Linear(2, 2)

        def forward(self, x, n: int = 3):
            for _ in range(n):
                x = torch.tanh(self.cell(x))
            return x

    m = Rec()
    path = tmp_path / "g.h5"
    ag.record(m, (torch.ones(1, 2),), {"n": 5}, path=path)
    assert golden_calls(path) == [("cell", k) for k in range(5)] + [("", 0)]
    assert ag.compare(m, (torch.ones(1, 2),), {"n": 5}, path=path).ok


# --------------------------------------------------------------------------- include / exclude


def test_include_exclude_globs_select_layers(tmp_path):
    m = tiny_mlp(depth=3)
    x = torch.randn(2, 8)
    p1, p2, p3 = tmp_path / "a.h5", tmp_path / "b.h5", tmp_path / "c.h5"
    ag.record(m, x, path=p1, include="blocks.*.fc")
    assert golden_calls(p1) == [("blocks.0.fc", 0), ("blocks.1.fc", 0), ("blocks.2.fc", 0)]
    ag.record(m, x, path=p2, exclude=["blocks.*", ""])
    assert golden_calls(p2) == [("head", 0)]
    ag.record(m, x, path=p3, include=["blocks.1*", "head"], exclude="*.act")
    assert golden_calls(p3) == [("blocks.1.fc", 0), ("blocks.1", 0), ("head", 0)]
    rep = ag.compare(m, x, path=p3, include=["blocks.1*", "head"], exclude="*.act")
    assert rep.ok and [r.name for r in rep.layers] == ["blocks.1.fc", "blocks.1", "head"]


def test_selection_matching_nothing_is_an_error_not_a_vacuous_pass(tmp_path):
    m, x = tiny_mlp(depth=2), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"include=\['blokcs\.\*'\].*selected no layer call.*'blocks\.0'"):
        ag.record(m, x, path=tmp_path / "g.h5", include="blokcs.*")
    assert not (tmp_path / "g.h5").exists()
    ag.record(m, x, path=tmp_path / "g.h5")
    with pytest.raises(ValueError, match="selected no layer call"):
        ag.compare(m, x, path=tmp_path / "g.h5", include="blokcs.*")
    with pytest.raises(ValueError, match="selected no layer call"):
        ag.compare(m, x, path=tmp_path / "g.h5", exclude="*")


def test_tolerance_pattern_matching_no_layer_is_noted(tmp_path):
    m, x = tiny_mlp(depth=2), torch.randn(2, 8)
    ag.record(m, x, path=tmp_path / "g.h5")
    rep = ag.compare(m, x, path=tmp_path / "g.h5", tolerances={"blokcs.*": {"rtol": 1}, "head": {"rtol": 1}})
    assert rep.notes == ["tolerances pattern 'blokcs.*' matched no layer"]


def test_compare_models_include_names_candidate_layers_under_rename():
    torch.manual_seed(0)
    ref = nn.Sequential(OrderedDict(enc=nn.Sequential(nn.Linear(4, 4), nn.ReLU()), head=nn.Linear(4, 2))).eval()
    cand = nn.Sequential(OrderedDict(encoder=copy.deepcopy(ref.enc), head=copy.deepcopy(ref.head))).eval()
    rep = ag.compare_models(ref, cand, torch.randn(3, 4), rename={"enc": "encoder"}, include="encoder.*")
    assert rep.ok and [r.name for r in rep.layers] == ["encoder.0", "encoder.1"]


def test_bad_include_is_rejected_with_the_option_name(tmp_path):
    with pytest.raises(TypeError, match="include"):
        ag.record(tiny_mlp(), torch.randn(1, 8), path=tmp_path / "g.h5", include=[3])
    with pytest.raises(TypeError, match="exclude"):
        ag.record(tiny_mlp(), torch.randn(1, 8), path=tmp_path / "g.h5", exclude=5)
    assert not (tmp_path / "g.h5").exists()


# --------------------------------------------------------------------------- hook hygiene / model untouched


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(3, 3)
        self.bad = nn.Linear(3, 3)

    def forward(self, x):
        x = self.ok(x)
        if getattr(self, "explode", False):
            x = self.bad(x)[:, 99]  # IndexError inside forward, after `ok` ran
        return self.bad(x)


def test_hooks_removed_after_success_and_after_exception(tmp_path):
    m = Boom()
    x = torch.randn(2, 3)
    path = tmp_path / "g.h5"
    ag.record(m, x, path=path)
    assert all_hooks_gone(m)
    ag.compare(m, x, path=path)
    assert all_hooks_gone(m)
    m.explode = True
    with pytest.raises(IndexError) as ei:
        ag.record(m, x, path=path)
    assert all_hooks_gone(m)
    if sys.version_info >= (3, 11):  # the error names the innermost layer that was running
        assert any("'<root>'" in n for n in getattr(ei.value, "__notes__", []))
    with pytest.raises(IndexError):
        ag.compare(m, x, path=path)
    assert all_hooks_gone(m)
    m.explode = False
    with torch.no_grad():
        m.ok.weight.mul_(2)
    rep = ag.compare(m, x, path=path, fail_fast=True)  # stopped by raising from a hook
    assert rep.stopped_early and not rep.ok
    assert all_hooks_gone(m)


def test_error_names_the_inner_layer_that_raised(tmp_path):
    class Bad(nn.Module):
        def forward(self, x):
            raise RuntimeError("kaput")

    m = nn.Sequential(nn.Linear(2, 2), Bad())
    with pytest.raises(RuntimeError, match="kaput") as ei:
        ag.record(m, torch.ones(1, 2), path=tmp_path / "g.h5")
    if sys.version_info >= (3, 11):
        assert any("'1'" in n for n in ei.value.__notes__)
    assert all_hooks_gone(m)


def test_user_hooks_survive(tmp_path):
    m = tiny_mlp(depth=1)
    seen = []
    h = m.head.register_forward_hook(lambda mod, a, o: seen.append(o.shape))
    ag.record(m, torch.randn(2, 8), path=tmp_path / "g.h5")
    assert seen == [torch.Size([2, 3])]
    assert len(m.head._forward_hooks) == 1
    h.remove()


@pytest.mark.parametrize("train", [False, True])
def test_model_mode_params_and_grad_mode_untouched(tmp_path, train):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    m.train(train)
    m[2].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    req = {k: p.requires_grad for k, p in m.named_parameters()}
    x = torch.randn(3, 4)
    path = tmp_path / "g.h5"
    summary = ag.record(m, x, path=path)
    rep = ag.compare(m, x, path=path)
    assert rep.ok
    assert torch.is_grad_enabled()
    for mod in m.modules():
        assert mod.training == train
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]) and v.device.type == "cpu"
    assert {k: p.requires_grad for k, p in m.named_parameters()} == req
    assert all(p.grad is None for p in m.parameters())
    with torch.no_grad():
        expect = m(x)
    assert torch.equal(summary.output, expect) and torch.equal(rep.output, expect)
    assert not summary.output.requires_grad  # the forward ran under no_grad


def test_inputs_are_not_modified_and_forms_are_equivalent(tmp_path):
    m = tiny_mlp(depth=1)
    x = torch.randn(2, 8)
    keep = x.clone()
    ag.record(m, x, path=tmp_path / "g.h5")
    assert torch.equal(x, keep)
    assert ag.compare(m, (x,), path=tmp_path / "g.h5").ok
    assert ag.compare(m, (), {"x": x}, path=tmp_path / "g.h5").ok  # same forward, passed by keyword
    assert normalize_inputs(x, None)[0][0] is x
    # args as torch.export reads them: a tuple is the positional arguments, anything else is ONE
    assert normalize_inputs([x], None) == (([x],), {})
    assert normalize_inputs({"a": x}, None)[0][0].keys() == {"a"}
    with pytest.raises(TypeError, match="kwargs"):
        normalize_inputs((x,), [1, 2])


def test_unsupported_models_are_refused_with_a_fix(tmp_path):
    path = tmp_path / "g.h5"
    with pytest.raises(ag.UnsupportedModelError, match=r"nn\.Module"):
        ag.record(lambda x: x, torch.ones(1), path=path)
    m = tiny_mlp(depth=1)
    with pytest.raises(ag.UnsupportedModelError, match=r"model\.module"):
        ag.record(nn.DataParallel(m), torch.ones(1, 8), path=path)
    assert not path.exists()


def test_hooked_context_manager_counts_and_removes():
    m = shared_loop(steps=2)
    seen = []
    with hooked(m, lambda f, out: seen.append((f.name, f.call)), include=["shared", "act"]) as state, \
            torch.no_grad():
        m(torch.randn(1, 6))
    assert seen == [("shared", 0), ("act", 0), ("shared", 1), ("act", 1)]
    assert state.calls["blocks.1"] == 1  # unselected modules are still counted
    assert all_hooks_gone(m)


def test_hooks_go_in_before_a_users_own_and_leave_them_as_they_were(tmp_path):
    """Capture inserts its hooks without handles (hook_install.install); a user's hooks keep their
    ids and order, ours run first on the output, and nothing of ours is left behind."""
    m = tiny_mlp(depth=1)
    seen: list[str] = []
    user = m.head.register_forward_hook(lambda mod, a, out: seen.append("user") or out * 2)
    before = (dict(m.head._forward_hooks), dict(m.head._forward_pre_hooks))

    def ours(frame, out):
        if frame.name == "head":
            seen.append("ours")

    with hooked(m, ours) as state, torch.no_grad():
        m(torch.randn(1, 8))
    assert seen == ["ours", "user"] and state.calls["head"] == 1
    assert (dict(m.head._forward_hooks), dict(m.head._forward_pre_hooks)) == before
    assert all_hooks_gone(m.blocks)
    user.remove()
    assert not m.head._forward_hooks


class _CopiesInForward(nn.Module):
    """Calls copies of its own layers: a deep copy made once and kept (an EMA teacher, made
    lazily), and a shallow copy made at every call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.teacher: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.teacher is None:
            object.__setattr__(self, "teacher", copy.deepcopy(self.a))  # not registered: not a layer
        assert self.teacher is not None
        return self.a(x) - self.teacher(x) + copy.copy(self.b)(x) + self.b(x)


def test_copies_of_hooked_layers(tmp_path):
    """copy.copy shares a module's hook dicts (ours included): the copy runs under the name of the
    layer it was copied from. copy.deepcopy copies them: a deep copy is not a module of the model
    and carries our hooks only if it was made during a capture, so it drops them and is not a
    layer; record and compare then see the same layers whenever the copy was made. (The capture's
    hooks are one shared pair; these copies used to make it fail on a lookup.)"""
    m, x = _CopiesInForward().eval(), torch.randn(2, 4)
    seen = []
    with hooked(m, lambda f, out: seen.append((f.name, f.call))), torch.no_grad():
        m(x)
    assert seen == [("a", 0), ("b", 0), ("b", 1), ("", 0)]
    teacher = m.teacher
    assert teacher is not None
    assert not teacher._forward_hooks and not teacher._forward_pre_hooks
    assert not teacher._forward_hooks_with_kwargs and not teacher._forward_pre_hooks_with_kwargs
    assert all_hooks_gone(m)
    with torch.no_grad():
        expected = m(x)
    p = tmp_path / "g.h5"
    fresh = _CopiesInForward().eval()  # its teacher is made during the record, not before
    ag.record(fresh, x, path=p)
    for model in (fresh, m):
        rep = ag.compare(model, x, path=p)
        assert rep.ok, rep
        assert [(r.name, r.call) for r in rep.layers] == seen
    with torch.no_grad():
        assert torch.equal(m(x), expected)
        m.b.weight.add_(1e-3)  # both calls of b, the copy's included, see the change
    assert ag.compare(m, x, path=p).first_divergence.label == "b[0]"


def test_a_deep_copy_made_during_a_capture_runs_plain_afterwards():
    m = tiny_mlp()
    copies = []
    with hooked(m, lambda f, out: copies.append(copy.deepcopy(f.module)) if f.name == "head" else None), \
            torch.no_grad():
        m(torch.randn(1, 8))
    head = copies[0]
    assert head._forward_hooks  # copied with ours while they were installed
    with torch.no_grad():
        head(torch.randn(1, head.in_features))
    assert not head._forward_hooks and not head._forward_pre_hooks and all_hooks_gone(m)


def test_a_shallow_copy_called_from_another_thread_is_refused_by_name():
    """A data-parallel replica (a shallow copy sharing the hook dicts) run on a worker thread gets
    the usual error naming the layer, not a lookup failure."""
    import threading

    class Threaded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: list[torch.Tensor] = []
            t = threading.Thread(target=lambda: out.append(copy.copy(self.a)(x)))
            t.start()
            t.join()
            return out[0]

    m = Threaded().eval()
    with pytest.raises(ag.ActivationGuardError, match=r"another thread.*'a' \(1 call"), \
            hooked(m, lambda f, out: None), torch.no_grad():
        m(torch.randn(2, 4))
    assert all_hooks_gone(m)

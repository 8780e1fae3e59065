"""Odd models and outputs: each is either supported (recorded, compared, a change detected) or
refused with a clear UnsupportedModelError; a forward that raises leaves nothing behind."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import one_thread
from torch import nn

import activation_guard as ag
from activation_guard import store


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(11))


def no_hooks_left(m: nn.Module) -> bool:
    return all(not (s._forward_hooks or s._forward_pre_hooks) for s in m.modules())


def open_fds_on(path: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                n += 1
        except OSError:
            pass
    return n


def roundtrip(m: nn.Module, x: Any, path: Path) -> ag.Report:
    ag.record(m, x, path=path)
    rep = ag.compare(m, x, path=path)
    assert rep.ok, str(rep)
    return rep


# --------------------------------------------------------------------------- forward raises


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed is not None:
            raise self.armed
        return x * 2


def boom_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Boom()), nn.Linear(4, 2)).eval()


@pytest.mark.parametrize("stage", ["record", "compare"])
def test_forward_raises_names_the_layer_and_leaves_nothing_behind(tmp_path, stage):
    m = boom_model()
    path = tmp_path / "g.h5"
    ag.record(m, X, path=path)
    before = path.read_bytes()
    m[1][1].armed = ValueError("bad shape in user code")
    with pytest.raises(ValueError, match="bad shape in user code") as ei:  # the user's own type
        if stage == "record":
            ag.record(m, X, path=path)
        else:
            ag.compare(m, X, path=path)
    assert "activation_guard: raised inside layer '1.1'" in getattr(ei.value, "__notes__", [])
    assert no_hooks_left(m)
    assert path.read_bytes() == before  # the previous golden is untouched
    assert [n for n in os.listdir(tmp_path) if store.TMP_MARK in n] == []
    assert open_fds_on(path) == 0  # compare closed the golden
    # the model is usable afterwards, with and without activation_guard
    m[1][1].armed = None
    assert m(X).shape == (2, 2)
    assert ag.compare(m, X, path=path).ok


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)])
def test_interrupt_in_forward_cleans_up(tmp_path, exc):
    m = boom_model()
    path = tmp_path / "g.h5"
    ag.record(m, X, path=path)
    before = path.read_bytes()
    m[1][1].armed = exc
    with pytest.raises(type(exc)):
        ag.record(m, X, path=path)
    with pytest.raises(type(exc)):
        ag.compare(m, X, path=path)
    assert no_hooks_left(m) and path.read_bytes() == before
    assert [n for n in os.listdir(tmp_path) if store.TMP_MARK in n] == [] and open_fds_on(path) == 0


# --------------------------------------------------------------------------- shapes of models


def test_model_without_submodules(tmp_path):
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    m = Bare()
    rep = roundtrip(m, X, tmp_path / "g.h5")
    assert [(r.name, r.call) for r in rep.layers] == [("", 0)]
    with torch.no_grad():
        m.w[2] = 1.01
    rep = ag.compare(m, X, path=tmp_path / "g.h5")
    assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.name == ""
    lin = nn.Linear(4, 3)
    assert [r.name for r in roundtrip(lin, X, tmp_path / "l.h5").layers] == [""]


class Gen(nn.Module):
    def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        return (x * k for k in (1, 2, 3))


class UsesGen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = Gen()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.lin(t) for t in self.gen(x))


def test_generator_output_is_recorded_by_type_and_not_consumed(tmp_path):
    m = UsesGen().eval()
    expected = m(X)
    summary = ag.record(m, X, path=tmp_path / "g.h5")
    assert torch.equal(summary.output, expected)  # the parent still iterated all 3 items
    rep = ag.compare(m, X, path=tmp_path / "g.h5")
    assert rep.ok and torch.equal(rep.output, expected)
    # `gen` returns (its hook fires) before the parent consumes the generator
    assert [(r.name, r.call) for r in rep.layers] == [("gen", 0), ("lin", 0), ("lin", 1), ("lin", 2), ("", 0)]


class Thing:
    def __init__(self, v: torch.Tensor) -> None:
        self.v = v


class Other:
    pass


class ReturnsObject(nn.Module):
    def __init__(self, kind: type = Thing) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return {"obj": self.kind(x) if self.kind is Thing else self.kind(), "t": x + 1}


def test_arbitrary_object_output(tmp_path):
    path = tmp_path / "g.h5"
    rep = roundtrip(ReturnsObject(), X, path)
    leaf = next(lf for lr in rep.layers for lf in lr.leaves if lf.path == "obj")
    assert "Thing" in (leaf.detail or "")
    rep = ag.compare(ReturnsObject(Other), X, path=path)
    assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.status == "structure"


def test_outputs_that_require_grad_in_grad_mode(tmp_path):
    class ReturnsParam(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.arange(3.0))
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.p, self.lin(x)

    m = ReturnsParam().train()
    assert torch.is_grad_enabled()
    roundtrip(m, X, tmp_path / "g.h5")
    assert torch.is_grad_enabled() and m.training
    assert all(p.grad is None for p in m.parameters())
    out = m(X)  # still trainable afterwards
    out[1].sum().backward()
    assert m.lin.weight.grad is not None


class Exotic(nn.Module):
    def __init__(self, kind: str, bump: float = 0.0) -> None:
        super().__init__()
        self.kind, self.bump = kind, bump

    def forward(self, x: torch.Tensor) -> Any:
        x = x.clone()
        x[0, 0] += self.bump
        if self.kind == "sparse_coo":
            return (x * (x > 0)).to_sparse()
        if self.kind == "sparse_csr":
            return (x * (x > 0)).to_sparse_csr()
        if self.kind == "quantized":
            return torch.quantize_per_tensor(x, 0.05, 10, torch.quint8)
        if self.kind == "nested":
            return torch.nested.nested_tensor([x[0, :2], x[1]])
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "quantized", "nested"])
def test_sparse_quantized_nested_outputs(tmp_path, kind):
    x = X.abs() + 0.5  # the bumped element stays non-zero and inside the quantized range
    path = tmp_path / "g.h5"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR / nested tensors are "beta" and say so
        roundtrip(Exotic(kind), x, path)
        rep = ag.compare(Exotic(kind, bump=0.5), x, path=path)
    assert not rep.ok
    assert rep.first_divergence is not None and rep.first_divergence.status == "diverged"


def test_meta_device_outputs_are_recorded_as_structure_only(tmp_path):
    """Meta tensors hold no values: recorded by shape, compared by shape."""
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to("meta")
    path = tmp_path / "g.h5"
    rep = roundtrip(m, X.to("meta"), path)
    assert len(rep.layers) == 3
    wider = nn.Sequential(nn.Linear(4, 5), nn.ReLU()).to("meta")
    rep = ag.compare(wider, X.to("meta"), path=path)
    assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.name == "0"
    # a real model against a meta golden is a structure change, not a pass
    assert not ag.compare(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), X, path=path).ok


# --------------------------------------------------------------------------- refused wrappers


def _eager() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU())


REFUSED = {
    # torch.compile is supported: tests/test_compiled.py
    "torch.jit.script": (lambda: torch.jit.script(_eager()), "eager"),
    "torch.jit.trace": (lambda: torch.jit.trace(_eager(), X), "eager"),
    "DataParallel": (lambda: nn.DataParallel(_eager()), "model.module"),
    "nested torch.jit.script": (lambda: nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Linear(4, 4))),
                                "submodule '1'"),
    "nested DataParallel": (lambda: nn.Sequential(nn.Sequential(nn.DataParallel(nn.Linear(4, 4)))), "submodule '0.0'"),
    "not a module": (lambda: (lambda x: x), "needs a torch.nn.Module"),
}


def check_refused(m: Any, words: str, path: Path) -> None:
    for call in (lambda: ag.record(m, X, path=path), lambda: ag.compare(m, X, path=path)):
        with pytest.raises(ag.UnsupportedModelError) as ei:
            call()
        assert words in str(ei.value)
        assert isinstance(ei.value, TypeError)
    assert not path.exists()
    if isinstance(m, nn.Module):
        assert no_hooks_left(m)


@pytest.mark.parametrize("case", list(REFUSED))
def test_wrappers_that_bypass_hooks_are_refused(tmp_path, case):
    build, words = REFUSED[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = build()
    check_refused(m, words, tmp_path / "g.h5")


# --------------------------------------------------------------------------- 10,000 layer calls


class LongLoop(nn.Module):
    """One small layer called 10,000 times; ``bump_at`` nudges one call's output."""

    def __init__(self, n: int = 10_000, bump_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.n, self.bump_at = n, bump_at
        self.step = nn.Linear(2, 2)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n // 2):
            x = self.step(x)
            if i == self.bump_at:
                x = x + 1e-3
            x = self.act(x)
        return x


@pytest.mark.slow
def test_ten_thousand_layer_calls(tmp_path):
    """10,001 layer calls record and compare; a change at call 4,900 of `act` is found there
    (fail_fast: the 9,801 calls before it all matched)."""
    path = tmp_path / "g.h5"
    x = torch.randn(1, 2, generator=torch.Generator().manual_seed(0))
    summary = ag.record(LongLoop(), x, path=path)
    assert summary.layer_calls == 10_001
    rep = ag.compare(LongLoop(bump_at=4_900), x, path=path, fail_fast=True)
    assert not rep.ok and rep.first_divergence is not None
    # the nudge is added after `step` returned: its first consumer is call 4,900 of `act`
    assert (rep.first_divergence.name, rep.first_divergence.call) == ("act", 4_900)
    assert sum(r.ok for r in rep.layers) == 9_801  # step 0..4900 and act 0..4899


class _NoKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("kernel unavailable")


class _Fallback(nn.Module):
    """Tries a fast path and falls back when it raises: a common pattern in kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.fast, self.slow, self.k = _NoKernel(), nn.Linear(4, 4), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            y = self.fast(x)
        except RuntimeError:
            y = self.slow(x)
        return y * self.k


class _Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p, self.head = _Fallback(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.p(x))


@pytest.mark.parametrize("replay", ["off", "first", "all"])
def test_a_call_that_raised_and_was_caught_is_not_recorded_under_another_name(tmp_path: Path, replay: str) -> None:
    """The failed call's frame stayed on the call stack: every later output was filed under the
    wrong layer ('p.fast' held p's output, '<root>' was missing) and compare crashed on the
    golden's dangling references to the failed call's inputs."""
    torch.manual_seed(0)
    m, x = _Top().eval(), torch.randn(2, 4)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    with ag.read_golden(p) as r:
        assert [c.name for c in r.calls] == ["p.slow", "p", "head", ""]
    assert ag.compare(m, x, path=p, replay=replay).ok
    m.p.k = 2.0
    report = ag.compare(m, x, path=p, replay=replay)
    assert not report.ok and report.first_divergence is not None and report.first_divergence.name == "p"


def test_the_models_own_forward_hooks_are_named_in_the_report(tmp_path: Path) -> None:
    """Our hooks read each output before the model's own forward hooks run (tensor parallelism's
    hook turns outputs into shards after us). What a hook on the model itself changes reaches no
    layer: a pass once said nothing of it."""
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), torch.randn(2, 4)
    scale = {"v": 1.0}
    m.register_forward_hook(lambda mod, a, out: out * scale["v"])
    m[0].register_forward_hook(lambda mod, a, out: out + 0.0)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    scale["v"] = 2.0
    report = ag.compare(m, x, path=p)
    text = str(report).splitlines()
    assert report.ok and text[0].startswith("activation_guard: OK")
    assert ("  note: the model itself has forward hooks of its own, which run after its output is read: what they "
            "change in the output the caller receives is not compared") in text
    assert any("1 layer(s) have forward hooks of their own ('0')" in n for n in report.notes)
    plain = nn.Sequential(nn.Linear(4, 4)).eval()
    ag.record(plain, x, path=tmp_path / "plain.h5")
    assert not ag.compare(plain, x, path=tmp_path / "plain.h5").notes  # no hooks, no note


class _Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        return x if depth == 0 else self(self.a(x), depth - 1)


@pytest.mark.parametrize("replay", ["off", "first", "all"])
def test_a_module_that_calls_itself(tmp_path: Path, replay: str) -> None:
    """Calls are numbered as they return, so the outer call of a recursive module returns last:
    references to its inputs, stored under the number it would have had when it started, named
    another call, and any divergence crashed the compare ('the golden does not hold' them)."""
    torch.manual_seed(0)
    m, x = _Recursive().eval(), torch.randn(2, 4)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    assert ag.compare(m, x, path=p, replay=replay).ok
    with torch.no_grad():
        m.a.bias[0] += 1e-3
    report = ag.compare(m, x, path=p, replay=replay)
    assert not report.ok and report.first_divergence is not None
    assert (report.first_divergence.name, report.first_divergence.call) == ("a", 0)


class _SkipsHooks(nn.Module):
    """A model whose ``__call__`` calls ``forward`` directly (a wrapper that skips hooks for speed)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.k = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.k

    def __call__(self, *a: Any, **kw: Any) -> Any:
        return self.forward(*a, **kw)


class _CallsForward(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(x)


def test_a_model_whose_call_skips_its_hooks_is_refused_not_passed(tmp_path: Path) -> None:
    """Its own code after its last layer (`* k`) would go uncompared while `lin` matched: a change
    of k passed as "OK, 1 layer calls match" (found by review). The suggested wrapper catches it."""
    torch.manual_seed(0)
    m, x = _SkipsHooks(), torch.randn(3, 4)
    with pytest.raises(ag.UnsupportedModelError, match=r"_SkipsHooks overrides __call__.*wrapper module"):
        ag.record(m, x, path=tmp_path / "g.h5")
    assert not (tmp_path / "g.h5").exists()
    wrapped = _CallsForward(m)
    ag.record(wrapped, x, path=tmp_path / "g.h5")
    assert ag.compare(wrapped, x, path=tmp_path / "g.h5").ok
    m.k = 3.0
    bad = ag.compare(wrapped, x, path=tmp_path / "g.h5")
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.name == ""


def test_buffers_the_forward_updates_are_named_as_not_compared(tmp_path: Path) -> None:
    """A BatchNorm port whose running statistics update differently passes every layer of this
    forward (found by review); record and compare say which buffers went unjudged, and the note
    prints with a pass. In eval mode nothing is updated and nothing is said."""
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train(), torch.randn(8, 4)
    summary = ag.record(m, x, path=tmp_path / "g.h5")
    assert any("'1.running_mean'" in n and "not compared" in n for n in summary.notes), summary.notes
    m[1].momentum = 0.5  # updates its running statistics differently: the outputs are the same
    rep = ag.compare(m, x, path=tmp_path / "g.h5")
    assert rep.ok and "buffer(s) of the model in place ('1.running_mean', '1.running_var'" in str(rep)
    m.eval()
    ag.record(m, x, path=tmp_path / "e.h5")
    quiet = ag.compare(m, x, path=tmp_path / "e.h5")
    assert quiet.ok and not any("buffer" in n for n in quiet.notes)


class _Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Any:
        import collections
        import types

        return collections.deque([self.a(x), types.SimpleNamespace(h=self.b(x) * 2, tag="t")])


def test_deques_and_namespaces_are_walked_not_compared_by_type_only(tmp_path: Path) -> None:
    """A deque or SimpleNamespace output was an opaque object: a 50% change to the code filling it
    passed (found by review). Their values are compared now, and replay rebuilds them."""
    torch.manual_seed(0)
    m, x = _Containers(), torch.randn(2, 3)
    ag.record(m, x, path=tmp_path / "g.h5")
    ok = ag.compare(m, x, path=tmp_path / "g.h5", replay="all")
    assert ok.ok and not ok.type_only_text()
    m.forward = lambda x: __import__("collections").deque(  # type: ignore[method-assign]
        [m.a(x), __import__("types").SimpleNamespace(h=m.b(x) * 3, tag="t")])
    bad = ag.compare(m, x, path=tmp_path / "g.h5")
    fd = bad.first_divergence
    assert fd is not None and fd.name == "" and fd.path == "1/h" and fd.status == "diverged"


def test_a_golden_holding_a_deque_by_type_only_still_compares_by_type(tmp_path: Path) -> None:
    """Goldens recorded before deques were walked hold one object leaf: compared by type, with a
    note to re-record, not failed as a changed structure."""
    from golden_edit import index_dict, set_index

    torch.manual_seed(0)
    m, x = _Containers(), torch.randn(2, 3)
    ag.record(m, x, path=tmp_path / "g.h5")
    import h5py

    with h5py.File(tmp_path / "g.h5", "r+") as f:
        idx = index_dict(f)
        root = idx["calls"][-1]
        assert root["name"] == "" and all(leaf["path"].startswith(("0", "1/")) for leaf in root["leaves"])
        root["leaves"] = [{"kind": "object", "path": "", "type": "deque"}]
        set_index(f, idx, force_v2=True)  # (format 3 writers never stored a deque by type)
    rep = ag.compare(m, x, path=tmp_path / "g.h5")
    assert rep.ok and rep.type_only_text() == "1 output compared by type only: deque"
    assert "re-record to compare them" in rep.layers[-1].leaves[0].detail



def test_an_older_goldens_deque_held_by_type_does_not_pass_another_container(tmp_path: Path) -> None:
    """The compatibility path once took any live container at that path as the deque and dropped
    its leaves from the structure check: a layer returning a dict of other values passed (found by
    review). It applies only when the live value there is still a deque."""
    import collections

    import h5py
    from golden_edit import index_dict, set_index

    torch.manual_seed(0)
    lin, x = nn.Linear(3, 3), torch.randn(2, 3)

    class Out(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin
            self.as_dict = False

        def forward(self, x: torch.Tensor) -> Any:
            y = self.lin(x)
            return {"a": y * 100} if self.as_dict else collections.deque([y, y * 2])

    m = Out()
    ag.record(m, x, path=tmp_path / "g.h5")
    with h5py.File(tmp_path / "g.h5", "r+") as f:
        idx = index_dict(f)
        idx["calls"][-1]["leaves"] = [{"kind": "object", "path": "", "type": "deque"}]
        set_index(f, idx, force_v2=True)
    assert ag.compare(m, x, path=tmp_path / "g.h5").ok
    m.as_dict = True
    bad = ag.compare(m, x, path=tmp_path / "g.h5")
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.status == "structure"


def test_deque_and_namespace_inputs_are_rebuilt_as_they_were(tmp_path: Path) -> None:
    """compare_models copies inputs: a deque kept its maxlen, a namespace subclass or one with a
    non-str attribute is shared as before, not rebuilt into a crash (found by review)."""
    import collections
    import types

    class Cfg(types.SimpleNamespace):
        def __init__(self, scale: float) -> None:
            super().__init__(scale=scale, bias=torch.ones(3))

    class Uses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, q: Any, cfg: Any, ns: Any) -> torch.Tensor:
            q.append(self.lin(q[-1]))
            return q[0] + cfg.bias * cfg.scale + ns.t

    odd = types.SimpleNamespace(t=torch.zeros(3))
    odd.__dict__[1] = "x"
    torch.manual_seed(0)
    m = Uses()
    args = (collections.deque([torch.randn(2, 3)], maxlen=1), Cfg(2.0), odd)
    assert ag.compare_models(m, m, args).ok
    ag.record(m, (collections.deque([torch.randn(2, 3)], maxlen=1), Cfg(2.0), odd), path=tmp_path / "g.h5")


def test_buffers_made_in_inference_mode_or_replaced_by_equal_values_are_not_called_updated(tmp_path: Path) -> None:
    """An inference-mode buffer has no version counter: it was taken for one assigned during the
    forward, and every pass carried the note (found by review). So was a buffer replaced by an
    equal clone."""
    class Clones(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("s", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.s = self.s.clone()
            return x * self.s

    with torch.inference_mode():
        frozen = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).eval()
    x = torch.randn(4, 3)
    for m in (frozen, Clones()):
        summary = ag.record(m, x, path=tmp_path / "g.h5")
        assert not any("buffer" in n for n in summary.notes), summary.notes
        rep = ag.compare(m, x, path=tmp_path / "g.h5")
        assert rep.ok and not any("buffer" in n for n in rep.notes), rep.notes

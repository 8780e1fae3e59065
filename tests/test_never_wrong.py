"""Never silently wrong: each reproduced false pass or crash, then properties.

Every case ends in a correct verdict or a clear error naming the layer and the fix.
"""

from __future__ import annotations

import enum
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import tiny_mlp
from torch import nn

import activation_guard as ag
from activation_guard.values.leaves import flatten

X = torch.randn(3, generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------- 1. numpy and opaque leaves


class Post(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> Any:
        return (x * self.k).numpy()


def test_a_layer_returning_a_numpy_array_is_compared_by_value(tmp_path: Path) -> None:
    p = tmp_path / "np.h5"
    ag.record(Post(1.0), (X,), path=p)
    assert ag.compare(Post(1.0), (X,), path=p).ok
    report = ag.compare(Post(2.0), (X,), path=p)
    assert not report.ok
    fd = report.first_divergence
    assert fd is not None and fd.name == "" and fd.status == "diverged" and fd.mismatched == 3


class Scalars(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> Any:
        return {"f32": np.float32(self.k), "i8": np.int8(3), "arr16": np.arange(4, dtype=">u2") * int(self.k)}


def test_numpy_scalars_and_byte_orders_keep_their_dtype(tmp_path: Path) -> None:
    leaves = {leaf.path: leaf for leaf in flatten(Scalars(2.0)(X))}
    assert leaves["f32"].tensor.dtype == torch.float32 and leaves["f32"].type_name == "numpy.float32"
    assert leaves["i8"].tensor.dtype == torch.int8
    assert leaves["arr16"].tensor.dtype == torch.uint16 and leaves["arr16"].tensor.tolist() == [0, 2, 4, 6]
    p = tmp_path / "s.h5"
    ag.record(Scalars(2.0), (X,), path=p)
    assert ag.compare(Scalars(2.0), (X,), path=p).ok
    bad = ag.compare(Scalars(3.0), (X,), path=p)
    assert {leaf.path for leaf in bad.layers[0].leaves if leaf.status != "match"} == {"f32", "arr16"}


class Cache:
    """An opaque object, like a KV cache: recorded by type only."""


class WithObjects(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return {"out": x * 2, "cache": [Cache(), Cache()], "gen": (i for i in range(3))}


def test_outputs_compared_by_type_only_are_counted_in_the_passing_line_and_the_report(tmp_path: Path) -> None:
    p = tmp_path / "o.h5"
    ag.record(WithObjects(), (X,), path=p)
    report = ag.compare(WithObjects(), (X,), path=p)
    assert report.ok
    assert report.type_only() == {"Cache": 2, "generator": 1}
    assert str(report).endswith("; 3 outputs compared by type only: Cache x2, generator")
    assert report.to_dict()["type_only"] == {"Cache": 2, "generator": 1}
    fail = ag.compare(tiny_mlp(), torch.randn(2, 8), path=_golden(tmp_path))
    assert fail.type_only_text() is None  # nothing opaque: nothing said


def _golden(tmp_path: Path) -> Path:
    p = tmp_path / "mlp.h5"
    ag.record(tiny_mlp(), torch.randn(2, 8), path=p)
    return p


# --------------------------------------------------------------------------- 2. injective paths


class Keys(nn.Module):
    def __init__(self, bump: Any = None):
        super().__init__()
        self.bump = bump

    def forward(self, x: torch.Tensor) -> Any:
        out = {1: x, "1": x + 1, (1, 2): x + 2, Color.RED: x + 3, "a/b": x + 4, "#1": x + 5, "%31": x + 6}
        if self.bump is not None:
            out[self.bump] = out[self.bump] + 1e-3
        return out


class Color(enum.Enum):
    RED = 1


def test_keys_of_different_types_never_share_a_path(tmp_path: Path) -> None:
    paths = [leaf.path for leaf in flatten(Keys()(X))]
    assert len(set(paths)) == len(paths) == 7
    assert paths[:2] == ["#1", "%31"]
    p = tmp_path / "k.h5"
    ag.record(Keys(), (X,), path=p)
    assert ag.compare(Keys(), (X,), path=p).ok  # no longer fails against its own golden
    for key in (1, "1", (1, 2), Color.RED, "#1"):
        report = ag.compare(Keys(bump=key), (X,), path=p)
        bad = [leaf.path for leaf in report.layers[0].leaves if leaf.status != "match"]
        assert bad == [paths[list(Keys()(X)).index(key)]]


def test_keys_with_one_type_and_one_repr_are_refused_not_merged(tmp_path: Path) -> None:
    class Same:
        def __repr__(self) -> str:
            return "same"

    class TwoKeys(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return {Same(): x, Same(): x}

    with pytest.raises(ag.ActivationGuardError, match=r"output keys same and same .* both encode to the path"):
        ag.record(TwoKeys(), (X,), path=tmp_path / "s.h5")


# --------------------------------------------------------------------------- 3. repeated and cyclic references


class SelfRef(nn.Module):
    def __init__(self, k: float = 1.0):
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> Any:
        d: dict[str, Any] = {"x": x * self.k}
        d["a"] = d
        d["b"] = d
        return d


def test_an_output_that_contains_itself_is_stored_as_references(tmp_path: Path) -> None:
    leaves = flatten(SelfRef()(X))
    assert [(leaf.path, leaf.kind, leaf.value) for leaf in leaves] == [("x", "tensor", None), ("a", "ref", ""),
                                                                        ("b", "ref", "")]
    p = tmp_path / "c.h5"
    summary = ag.record(SelfRef(), (X,), path=p)
    assert summary.file_bytes < 100_000
    assert ag.compare(SelfRef(), (X,), path=p).ok
    report = ag.compare(SelfRef(1.5), (X,), path=p)
    assert report.first_divergence is not None and report.first_divergence.path == "x"


# --------------------------------------------------------------------------- 5. forwards that need autograd


class Forces(nn.Module):
    """An energy model whose forward returns forces: -dE/dx, computed with autograd."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.energy = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        pos = pos.detach().requires_grad_(True)
        e = self.energy(pos).sum()
        (g,) = torch.autograd.grad(e, pos)
        return -g


def test_a_forward_that_needs_autograd_says_which_option_fixes_it(tmp_path: Path) -> None:
    pos = torch.randn(5, 3)
    with pytest.raises(RuntimeError) as ei:
        ag.record(Forces(), (pos,), path=tmp_path / "f.h5")
    assert "pass the option grad=True" in "\n".join(getattr(ei.value, "__notes__", []))
    assert not (tmp_path / "f.h5").exists()
    ag.record(Forces(), (pos,), path=tmp_path / "f.h5", grad=True)
    report = ag.compare(Forces(), (pos,), path=tmp_path / "f.h5", grad=True)
    assert report.ok and report.output.shape == (5, 3) and not report.output.requires_grad
    broken = Forces()
    with torch.no_grad():
        broken.energy[0].weight.mul_(1.01)
    assert ag.compare(broken, (pos,), path=tmp_path / "f.h5", grad=True).first_divergence.name == "energy.0"
    assert torch.is_grad_enabled()  # the caller's grad mode is left as it was


# --------------------------------------------------------------------------- 7. compare_models and in-place inputs


class Doubler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # modifies its input in place
        return self.lin(x)


def test_compare_models_gives_each_side_its_own_inputs() -> None:
    x = torch.randn(2, 3)
    assert ag.compare_models(Doubler(), Doubler(), (x,)).ok


# --------------------------------------------------------------------------- 8. threads


class Threaded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = [x, x]

        def run(i: int) -> None:
            outs[i] = self.parts[i](x)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return outs[0] + outs[1]


def test_a_module_called_from_other_threads_is_an_error_not_a_false_divergence(tmp_path: Path) -> None:
    with pytest.raises(ag.ActivationGuardError, match=r"called from another thread .* 'parts\.0' \(1 call\(s\)\)"):
        ag.record(Threaded(), (torch.randn(2, 3),), path=tmp_path / "t.h5")
    assert not (tmp_path / "t.h5").exists()
    # excluding them (as the message says) works
    ag.record(Threaded(), (torch.randn(2, 3),), path=tmp_path / "t.h5", exclude="parts.*")


# --------------------------------------------------------------------------- 9-11. arguments and paths


class TakesList(nn.Module):
    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return xs[0] + xs[1]


def test_args_follow_torch_export_a_list_is_one_argument(tmp_path: Path) -> None:
    p = tmp_path / "l.h5"
    ag.record(TakesList(), [X, X], path=p)  # m([X, X]), not m(X, X)
    assert ag.compare(TakesList(), ([X, X],), path=p).ok


def test_paths_may_be_str_bytes_or_pathlike_and_nothing_else(tmp_path: Path) -> None:
    p = tmp_path / "b.h5"
    ag.record(tiny_mlp(), torch.randn(2, 8), path=os.fsencode(p))
    assert ag.compare(tiny_mlp(), torch.randn(2, 8), path=os.fsencode(p)).path == str(p)
    with pytest.raises(TypeError, match=r"path must be a str, bytes or os\.PathLike"):
        ag.compare(tiny_mlp(), torch.randn(2, 8), path=3)  # type: ignore[arg-type]


def test_a_golden_path_that_is_a_directory_fails_before_the_forward(tmp_path: Path) -> None:
    ran = []
    m = tiny_mlp()
    m.register_forward_hook(lambda *a: ran.append(1))
    (tmp_path / "d.h5").mkdir()
    with pytest.raises(ag.GoldenWriteError, match=r"d\.h5: is a directory, not a golden file"):
        ag.record(m, torch.randn(2, 8), path=tmp_path / "d.h5")
    assert ran == []  # checked before the forward
    with pytest.raises(ag.GoldenFormatError, match="is a directory"):
        ag.compare(m, torch.randn(2, 8), path=tmp_path / "d.h5")


# --------------------------------------------------------------------------- 12-14. selection, names, modes


def test_include_exclude_patterns_that_match_nothing_get_a_note(tmp_path: Path) -> None:
    p = _golden(tmp_path)
    report = ag.compare(tiny_mlp(), torch.randn(2, 8), path=p, include=["blocks.*", "blokcs.9"], exclude="nope")
    assert "include pattern 'blokcs.9' matched no layer" in report.notes
    assert "exclude pattern 'nope' matched no layer" in report.notes


class Bracketed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module("x[0]", nn.Linear(2, 2))
        self.add_module("x0", nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "x[0]")(x) + self.x0(x)


def test_an_exact_name_wins_over_glob_reading(tmp_path: Path) -> None:
    ag.record(Bracketed(), torch.randn(1, 2), path=tmp_path / "b.h5", include="x[0]")
    names = [c.name for c in ag.read_golden(tmp_path / "b.h5").calls]
    assert names == ["x[0]"]  # not 'x0', which the glob character class [0] would match


def test_two_modules_under_one_qualified_name_are_refused(tmp_path: Path) -> None:
    m = nn.Sequential()
    m.add_module("a", nn.Sequential(nn.Linear(2, 2)))
    m._modules["a.0"] = nn.ReLU()  # collides with the nested 'a.0'
    with pytest.raises(ag.UnsupportedModelError, match=r"under the name 'a\.0': Linear and ReLU"):
        ag.record(m, torch.randn(1, 2), path=tmp_path / "n.h5")


def test_train_eval_mode_change_is_the_first_note(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    ag.record(m, torch.randn(8, 4), path=tmp_path / "d.h5")
    torch.manual_seed(1)
    report = ag.compare(m.train(), torch.randn(8, 4), path=tmp_path / "d.h5")
    assert report.mode_changes == ["golden recorded in eval mode; the live model is in training mode: dropout and "
                                   "batch-norm statistics differ (mode-dependent modules: '1')"]
    notes = [line for line in str(report).splitlines() if line.startswith("  NOTE")]
    assert notes[0] == "  NOTE " + report.mode_changes[0]  # the first note, before the layer table
    m.eval()
    m[1].train()
    report = ag.compare(m, torch.randn(8, 4), path=tmp_path / "d.h5")
    assert report.mode_changes and "'1'" in report.mode_changes[0]


# --------------------------------------------------------------------------- properties


def _leaf_values(draw: Any) -> Any:
    return draw(st.sampled_from(["tensor", "float", "int", "numpy", "npscalar", "str", "none", "bool"]))


class Structured(nn.Module):
    """Returns a nested structure built from a recipe; ``bump`` adds 1 to one value leaf."""

    def __init__(self, recipe: Any, bump: int | None = None):
        super().__init__()
        self.recipe = recipe
        self.bump = bump

    def forward(self, x: torch.Tensor) -> Any:
        counter = [0]
        built: dict[int, Any] = {}
        return _build(self.recipe, x, counter, self.bump, built)


def _build(r: Any, x: torch.Tensor, counter: list[int], bump: int | None, built: dict[int, Any]) -> Any:
    kind = r[0]
    if kind == "leaf":
        v = r[1]
        if v == "none":
            return None
        i = counter[0]
        counter[0] += 1
        d = 1 if i == bump else 0
        if v == "tensor":
            return x * (i + 1) + d
        if v == "float":
            return float(i) + d
        if v == "int":
            return i + d
        if v == "bool":
            return bool((i + d) % 2)
        if v == "numpy":
            return (np.arange(3, dtype=np.float32) * i) + d
        if v == "npscalar":
            return np.int16(i + d)
        return f"s{i + d}"
    if kind == "ref":  # the container built for recipe node r[1] (an ancestor or an earlier one)
        return built.get(r[1], "missing")
    items = r[2]
    if kind == "list":
        out: Any = []
        built[r[1]] = out
        out.extend(_build(c, x, counter, bump, built) for c in items)
        return out
    if kind == "tuple":
        return tuple(_build(c, x, counter, bump, built) for c in items)
    out = {}
    built[r[1]] = out
    for k, c in items:
        out[k] = _build(c, x, counter, bump, built)
    return out


KEYS = st.one_of(st.text(max_size=4), st.integers(-3, 30), st.tuples(st.integers(0, 2), st.integers(0, 2)),
                 st.sampled_from(list(Color)))


@st.composite
def recipes(draw: Any, depth: int = 0, ids: list[int] | None = None) -> Any:
    ids = ids if ids is not None else [0]
    if depth >= 3 or draw(st.integers(0, 3)) == 0:
        if ids[0] > 1 and draw(st.integers(0, 5)) == 0:
            return ("ref", draw(st.integers(1, ids[0] - 1)))
        return ("leaf", _leaf_values(draw))
    ids[0] += 1
    me = ids[0]
    kind = draw(st.sampled_from(["list", "tuple", "dict"]))
    n = draw(st.integers(1, 3))
    if kind == "dict":
        keys = draw(st.lists(KEYS, min_size=n, max_size=n, unique_by=lambda k: (type(k), repr(k))))
        return ("dict", me, [(k, draw(recipes(depth + 1, ids))) for k in keys])
    return (kind, me, [draw(recipes(depth + 1, ids)) for _ in range(n)])


def _count_leaves(r: Any) -> int:
    if r[0] == "leaf":
        return 0 if r[1] == "none" else 1
    if r[0] == "ref":
        return 0
    items = r[2]
    return sum(_count_leaves(c[1] if r[0] == "dict" else c) for c in items)


@settings(max_examples=40)
@given(recipe=recipes(), data=st.data())
def test_any_nested_output_round_trips_self_compares_and_any_changed_value_fails(
        tmp_path_factory: pytest.TempPathFactory, recipe: Any, data: Any) -> None:
    p = tmp_path_factory.mktemp("prop") / "g.h5"
    x = torch.arange(2.0)
    ag.record(Structured(recipe), (x,), path=p)
    assert ag.compare(Structured(recipe), (x,), path=p).ok
    n = _count_leaves(recipe)
    if n == 0:
        return
    bump = data.draw(st.integers(0, n - 1))
    report = ag.compare(Structured(recipe, bump), (x,), path=p)
    assert not report.ok and report.first_divergence is not None and report.first_divergence.name == ""


class LazyView(nn.Module):
    """Returns a lazily conjugated, lazily negated or transposed view of its input: memory that
    holds other values (or another order) than the tensor shows."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "conj":
            return x.conj()
        if self.kind == "neg":
            return torch._neg_view(x)
        return x.t()


@pytest.mark.parametrize("kind, dtype", [("conj", torch.complex64), ("neg", torch.float32),
                                         ("neg", torch.complex128), ("t", torch.float64)])
def test_lazy_views_compare_by_the_values_they_show(tmp_path: Path, kind: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=dtype)
    p = tmp_path / "g.h5"
    ag.record(LazyView(kind), x, path=p)
    ok = ag.compare(LazyView(kind), x, path=p)
    assert ok.ok and ok.layers[0].max_abs_diff == 0.0
    shown = LazyView(kind)(x).resolve_conj().resolve_neg()
    assert ok.layers[0].leaves[0].live_value == shown.reshape(-1)[0].item()  # the value, not the memory
    bumped = x.clone()
    bumped[1, 2] += 1
    bad = ag.compare(LazyView(kind), bumped, path=p)
    assert not bad.ok and bad.layers[0].max_abs_diff == pytest.approx(1.0)
    assert bad.layers[0].index == ((2, 1) if kind == "t" else (1, 2))
    # a golden of the plain values matches the view's values, not its memory
    class Plain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return LazyView(kind)(x).resolve_conj().resolve_neg().clone()

    ag.record(Plain(), x, path=tmp_path / "plain.h5")
    assert ag.compare(LazyView(kind), x, path=tmp_path / "plain.h5").ok


def test_allow_dtype_change_float64_to_float32_compares_in_float64(tmp_path):
    """A finite float64 golden (1e300) against a live float32 inf is a new non-finite value:
    casting the golden down to float32 made it inf too, and the pair passed."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dt = torch.float64

        def forward(self, x):
            return (x * 1e300).to(self.dt)

    m, x = M(), torch.ones(2, dtype=torch.float64)
    p = tmp_path / "g.h5"
    ag.record(m, (x,), path=p)
    assert ag.compare(m, (x,), path=p).ok
    m.dt = torch.float32
    rep = ag.compare(m, (x,), path=p, allow_dtype_change=True)
    assert not rep.ok
    assert rep.first_divergence.status == "nonfinite"

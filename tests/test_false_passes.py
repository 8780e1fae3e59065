"""False passes found by adversarial review in round 2, each reproduced end to end.

Each test failed (passed a changed model) before its fix.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import activation_guard as ag
from activation_guard._core.kernel import compare_tensors
from activation_guard.values.leaves import PathCollisionError, flatten

X = torch.randn(4, generator=torch.Generator().manual_seed(0))


class Returns(nn.Module):
    """A model whose output is built by ``make(x, k)``: ``k`` is the change under test."""

    def __init__(self, make: Any, k: Any):
        super().__init__()
        self.make = make
        self.k = k

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(x, self.k)


def _passes(tmp_path: Path, make: Any, k_golden: Any, k_live: Any, **kw: Any) -> bool:
    p = tmp_path / "g.h5"
    ag.record(Returns(make, k_golden), (X,), path=p, **kw)
    assert ag.compare(Returns(make, k_golden), (X,), path=p, **kw).ok, "an unchanged model must pass"
    return ag.compare(Returns(make, k_live), (X,), path=p, **kw).ok


# ----------------------------------------------------------------------------- the empty dict key


def test_an_empty_key_never_shares_a_path() -> None:
    a, b = torch.ones(1), torch.zeros(1)
    paths = [leaf.path for leaf in flatten({"": {"x": a}, "x": b})]
    assert len(set(paths)) == 2, paths
    assert flatten({"": a})[0].path != flatten(a)[0].path


def test_a_change_under_an_empty_key_fails(tmp_path: Path) -> None:
    assert not _passes(tmp_path, lambda x, k: {"": {"x": x * k}, "x": x}, 1.0, 2.0)


def test_a_bare_tensor_is_not_a_dict_with_an_empty_key(tmp_path: Path) -> None:
    assert not _passes(tmp_path, lambda x, k: x if k else {"": x}, True, False)


def test_nested_empty_keys_round_trip(tmp_path: Path) -> None:
    leaves = flatten({"a": {"": {"": X}}, "b": {"": X * 2}})
    assert [leaf.path for leaf in leaves] == ["a/#str:''/#str:''", "b/#str:''"]
    assert not _passes(tmp_path, lambda x, k: {"a": {"": {"": x * k}}}, 1.0, 3.0)


@dataclasses.dataclass
class _Pair:
    a: torch.Tensor
    b: torch.Tensor


def test_a_duplicate_path_is_refused_not_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: were the encoding ever to repeat a path, flatten refuses."""
    import activation_guard.values.leaves as leaves_mod
    monkeypatch.setattr(leaves_mod, "encode_str_key", lambda key: "same")
    with pytest.raises(PathCollisionError, match="share the path 'same'"):
        flatten(_Pair(X, X * 2))


# ----------------------------------------------------------------------------- complex numbers


def test_a_nan_real_part_does_not_hide_the_imaginary_part() -> None:
    g = torch.tensor([complex(float("nan"), 1.0)], dtype=torch.complex64)
    lv = torch.tensor([complex(float("nan"), 5.0)], dtype=torch.complex64)
    assert compare_tensors(g, lv, 1e-5, 1e-8).mismatched == 1
    assert compare_tensors(g, g.clone(), 1e-5, 1e-8).mismatched == 0
    g2 = torch.tensor([complex(2.0, float("nan"))], dtype=torch.complex128)
    assert compare_tensors(g2, torch.tensor([complex(-2.0, float("nan"))], dtype=torch.complex128),
                           1e-5, 1e-8).mismatched == 1


def test_a_nan_part_end_to_end(tmp_path: Path) -> None:
    def make(x: torch.Tensor, k: float) -> torch.Tensor:
        return torch.complex(torch.full_like(x, float("nan")), x * k)
    assert not _passes(tmp_path, make, 1.0, 2.0)


def test_a_complex64_modulus_overflow_does_not_make_the_tolerance_infinite() -> None:
    g = torch.tensor([complex(3e38, 3e38)], dtype=torch.complex64)
    lv = torch.tensor([complex(1e38, 3e38)], dtype=torch.complex64)
    st = compare_tensors(g, lv, 1e-5, 1e-8)
    assert st.mismatched == 1 and st.max_abs_diff == pytest.approx(2e38, rel=1e-6)
    assert compare_tensors(g, g.clone(), 1e-5, 1e-8).mismatched == 0


# ----------------------------------------------------------------------------- values compared by type only


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@pytest.mark.parametrize("golden,live", [
    (torch.float32, torch.float16),
    (torch.device("cpu"), torch.device("meta")),
    (Color.RED, Color.BLUE),
    (b"\x00\x01", b"\x00\x02"),
    (bytes(10_000), bytes(9_999) + b"\x01"),
    (torch.strided, torch.sparse_coo),
])
def test_dtypes_devices_enums_and_bytes_are_compared_by_value(tmp_path: Path, golden: Any, live: Any) -> None:
    assert not _passes(tmp_path, lambda x, k: (x, k), golden, live)


def test_a_str_is_not_a_dtype(tmp_path: Path) -> None:
    assert not _passes(tmp_path, lambda x, k: (x, k), torch.float32, "torch.float32")


def test_float8_e8m0_is_exact(tmp_path: Path) -> None:
    def make(x: torch.Tensor, k: float) -> torch.Tensor:
        return (torch.ones(4) * k).to(torch.float8_e8m0fnu)
    assert not _passes(tmp_path, make, 2.0, 4.0)


def test_a_golden_from_before_still_compares_dtypes_by_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import activation_guard.values.leaves as leaves_mod
    p = tmp_path / "old.h5"
    with monkeypatch.context() as m:  # how older versions recorded a dtype: an object leaf
        m.setattr(leaves_mod, "_BY_REPR", ())
        ag.record(Returns(lambda x, k: (x, k), torch.float32), (X,), path=p)
    report = ag.compare(Returns(lambda x, k: (x, k), torch.float16), (X,), path=p)
    assert report.ok
    assert "compared by type only: dtype" in str(report)
    details = [leaf.detail for layer in report.layers for leaf in layer.leaves]
    assert any("re-record to compare its value" in (d or "") for d in details), details
    assert not ag.compare(Returns(lambda x, k: (x, k), torch.device("cpu")), (X,), path=p).ok


# ----------------------------------------------------------------------------- kernel and samples agree


def test_an_infinite_allowance_never_accepts_a_new_inf() -> None:
    g = torch.tensor([7e4, 1.0])
    lv = torch.tensor([float("inf"), 1.0])
    assert compare_tensors(g, lv, 0.0, float("inf")).mismatched == 1
    assert compare_tensors(g, g.clone(), 0.0, float("inf")).mismatched == 0


def test_the_sampled_check_widens_where_float32_overflows() -> None:
    """rtol 1.5: 3e38 -> -3e38 moves by 6e38 > 4.5e38 (the comparator widens to float64 and fails
    it); the fingerprint's sample of that element once computed inf <= inf in float32 and passed."""
    from activation_guard.fingerprints.fingerprint import compute_fingerprint
    from activation_guard.fingerprints.soundness import judge_fingerprint
    g = torch.full((8,), 3e38)
    lv = -g
    assert compare_tensors(g, lv, 1.5, 0.0).mismatched == 8
    v = judge_fingerprint(compute_fingerprint(g), lv, 1.5, 0.0)
    assert v.status != "ok" and v.mismatches, v


def test_tiny_float64_values_are_not_below_the_fingerprints_resolution() -> None:
    """The float32-underflow allowance (2**-140) once applied to float64 leaves: a float64 leaf of
    1e-300 values could change by 1e-290 at an unsampled place and pass."""
    from activation_guard.fingerprints.fingerprint import compute_fingerprint
    from activation_guard.fingerprints.soundness import judge_fingerprint
    g = torch.full((50_000,), 1e-300, dtype=torch.float64)
    fp = compute_fingerprint(g)
    j = next(i for i in range(g.numel()) if i not in set(fp.positions))
    lv = g.clone()
    lv[j] = 1e-290
    assert judge_fingerprint(fp, g.clone(), 1e-7, 0.0).status == "ok"
    assert judge_fingerprint(fp, lv, 1e-7, 0.0).status != "ok"


# ----------------------------------------------------------------------------- calibrated, with dtype changes


class Times(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1000.0


def test_a_half_precision_overflow_is_not_hidden_by_an_infinite_floor(tmp_path: Path) -> None:
    """One output element beyond float16's range made the cast-rounding allowance inf, so the fp16
    run's inf (and any other change) passed the calibrated rule."""
    import copy
    torch.manual_seed(0)
    model = Times().eval()
    with torch.no_grad():
        model.fc.bias.copy_(torch.tensor([70.0, 0.0, 0.0, 0.0]))
        model.fc.weight.mul_(0.01)
    x = torch.randn(2, 4)
    p = tmp_path / "g.h5"
    ag.record(model, x, path=p, calibrate=True)
    half = copy.deepcopy(model).half()
    report = ag.compare(half, x.half(), path=p, tolerance="calibrated", allow_dtype_change=True)
    assert not report.ok
    fd = report.first_divergence
    assert fd is not None and fd.status == "nonfinite", str(report)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_a_fingerprinted_half_precision_golden_accepts_the_float32_model(tmp_path: Path, low: torch.dtype) -> None:
    import copy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).eval()
    ids = torch.randint(0, 50, (4, 64))
    p = tmp_path / "half.h5"
    ag.record(copy.deepcopy(model).to(low), ids, path=p, calibrate=True, fingerprint=True)
    report = ag.compare(model, ids, path=p, tolerance="calibrated", allow_dtype_change=True)
    assert report.ok, str(report)
    with torch.no_grad():
        model[1].weight.mul_(1.2)
    bad = ag.compare(model, ids, path=p, tolerance="calibrated", allow_dtype_change=True)
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.name == "1"


@pytest.mark.parametrize("scale", [1e-300, 1e-170, 1e-160, 1e-20, 1e300])
def test_tiny_and_huge_float64_values_within_tolerance_pass(scale: float) -> None:
    """Squares of values below ~1e-154 underflow in the stored sum of squares: the norm bound must
    not shrink to zero with them (that would be a false alarm)."""
    from activation_guard.fingerprints.fingerprint import compute_fingerprint
    from activation_guard.fingerprints.soundness import judge_fingerprint
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(40_000, generator=gen, dtype=torch.float64) * scale
    lv = g * (1 + 0.99e-7 * (2 * torch.rand(40_000, generator=gen, dtype=torch.float64) - 1))
    assert compare_tensors(g, lv, 1e-7, 0.0).mismatched == 0
    v = judge_fingerprint(compute_fingerprint(g), lv, 1e-7, 0.0)
    assert v.status == "ok", v.detail


# ----------------------------------------------------------------------------- tensors a hook cannot read


class Vmapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(self.fc)(x)


def test_a_layer_inside_vmap_is_refused_by_name_and_can_be_excluded(tmp_path: Path) -> None:
    from activation_guard._core.errors import ActivationGuardError
    x = torch.randn(3, 2, 4)
    with pytest.raises(ActivationGuardError, match=r"layer 'fc' call 0: an input is a tensor inside a torch.func "
                                                   r"transform .*exclude="):
        ag.record(Vmapped(), x, path=tmp_path / "v.h5")
    assert not (tmp_path / "v.h5").exists()
    torch.manual_seed(0)
    ag.record(Vmapped(), x, path=tmp_path / "v.h5", exclude=["fc"])
    torch.manual_seed(0)
    assert ag.compare(Vmapped(), x, path=tmp_path / "v.h5", exclude=["fc"]).ok


def test_a_wrapper_tensor_subclass_is_compared_by_the_tensors_it_holds(tmp_path: Path) -> None:
    from torch.testing._internal.two_tensor import TwoTensor
    leaves = flatten(TwoTensor(X, X * 2))
    assert [leaf.path for leaf in leaves] == ["#type", "a", "b"]
    assert leaves[0].value == "TwoTensor"
    assert not _passes(tmp_path, lambda x, k: TwoTensor(x, x * k), 2.0, 3.0)


# ----------------------------------------------------------------------------- second review of the fixes


class Act(enum.Enum):
    RELU = (torch.relu,)  # a value whose repr holds a memory address
    TANH = (torch.tanh,)


class Mode(enum.Enum):
    X = 1


class Mode2(enum.Enum):
    X = 2


Mode2.__qualname__ = "Mode"  # the same class name and member name, another value


class Bits(enum.Flag, boundary=enum.KEEP):
    A = 1
    B = 2


def test_an_enum_is_compared_by_class_name_and_value_not_by_an_address_in_its_repr(tmp_path: Path) -> None:
    leaf = flatten(Act.RELU)[0]
    assert (leaf.kind, leaf.value, leaf.type_name) == ("str", "Act.RELU=<tuple>", "Act")
    assert "0x" not in leaf.value
    assert not _passes(tmp_path, lambda x, k: (x, k), Act.RELU, Act.TANH)
    assert not _passes(tmp_path, lambda x, k: (x, k), Mode.X, Mode2.X)  # a member's value changed
    assert not _passes(tmp_path, lambda x, k: (x, k), Bits(0), Bits(8))  # members without a name


def test_an_enum_key_whose_repr_holds_an_address_gets_a_stable_path() -> None:
    path = flatten({Act.RELU: X})[0].path
    assert path == "#Act:Act.RELU=<tuple>", path
    assert flatten({Mode.X: X})[0].path == "#Mode:<Mode.X: 1>"  # keys with a stable repr keep their path


def test_a_float64_golden_against_a_complex_run_keeps_the_imaginary_part() -> None:
    g = torch.tensor([1.0], dtype=torch.float64)
    assert compare_tensors(g, torch.tensor([1 + 5j], dtype=torch.complex64), 1e-5, 1e-8).mismatched == 1
    assert compare_tensors(torch.tensor([1 + 5j], dtype=torch.complex64), g, 1e-5, 1e-8).mismatched == 1


class Scaled(torch.Tensor):
    """A wrapper subclass whose values are ``data_ * scale``: the scale lives in its metadata."""

    @staticmethod
    def __new__(cls, d: torch.Tensor, s: float) -> Scaled:
        return torch.Tensor._make_wrapper_subclass(cls, d.shape, dtype=d.dtype)  # type: ignore[attr-defined]

    def __init__(self, d: torch.Tensor, s: float) -> None:
        self.data_ = d
        self.scale = s

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, float]]:
        return ["data_"], {"scale": self.scale}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: dict[str, float], *_: Any) -> Scaled:
        return Scaled(inner["data_"], ctx["scale"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = torch.utils._pytree.tree_map_only(Scaled, lambda x: x.data_ * x.scale, args)
        return func(*unwrap, **(kwargs or {}))


def test_a_wrapper_subclass_s_metadata_is_compared(tmp_path: Path) -> None:
    assert [leaf.path for leaf in flatten(Scaled(X, 1.0))] == ["#type", "data_", "#ctx/scale"]
    assert not _passes(tmp_path, lambda x, k: Scaled(x, k), 1.0, 100.0)


def test_a_dtype_argument_is_a_change_of_precision_not_of_inputs() -> None:
    from activation_guard.capture import env
    a = env.input_fingerprint((torch.ones(2),), {"dtype": torch.float32})
    b = env.input_fingerprint((torch.ones(2, dtype=torch.bfloat16),), {"dtype": torch.bfloat16})
    assert not env.inputs_replaced(a, b)
    assert "input kwargs/dtype: a different dtype" in env.describe_input_change(a, b)
    c = env.input_fingerprint((torch.zeros(2),), {"dtype": torch.float32})
    assert env.inputs_replaced(a, c)  # other values in the same dtype are other inputs


def test_a_golden_from_before_the_empty_key_encoding_still_compares(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import activation_guard.values.paths as paths_mod
    old_encode = paths_mod.encode_str_key

    def before(key: str) -> str:  # how earlier version-2 writers encoded keys: "" stayed ""
        return "" if key == "" else old_encode(key)

    def make(x: torch.Tensor, k: float) -> Any:
        return {"n": {"": {"k": x}}, "m": {"": x * k}}

    def top(x: torch.Tensor, k: float) -> Any:  # a top-level "" key had no path component at all
        return {"": x * k}

    p, q = tmp_path / "old.h5", tmp_path / "old_top.h5"
    with monkeypatch.context() as m:
        m.setattr(paths_mod, "encode_str_key", before)  # mapping keys are encoded there
        ag.record(Returns(make, 1.0), (X,), path=p)
        ag.record(Returns(top, 1.0), (X,), path=q)
    import h5py
    from golden_edit import to_v2

    for path in (p, q):  # those writers wrote format 2 (format 3 always encodes "" as #str:'')
        with h5py.File(path, "r+") as f:
            to_v2(f)
    assert ag.compare(Returns(make, 1.0), (X,), path=p).ok
    bad = ag.compare(Returns(make, 2.0), (X,), path=p)
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.status == "diverged"
    ambiguous = ag.compare(Returns(top, 1.0), (X,), path=q)  # the old path "" is also a bare tensor's
    assert not ambiguous.ok and ambiguous.first_divergence is not None
    assert ambiguous.first_divergence.status == "structure"


def _as_format_1(path: Path, rename: dict[str, str]) -> None:
    """Turn a golden into what a format-1 writer stored: its own paths for keys (``str(key)``)."""

    import h5py
    import numpy as np
    from golden_edit import index_dict, set_index

    with h5py.File(path, "r+") as f:
        idx = index_dict(f)
        for c in idx["calls"]:
            for leaf in c["leaves"]:
                leaf["path"] = rename.get(leaf["path"], leaf["path"])
        set_index(f, idx, force_v2=True)
        f.attrs["ag_format_version"] = np.int64(1)


def test_the_reader_names_live_leaves_as_an_older_golden_does(tmp_path: Path) -> None:
    """Older formats are the reader's business: it hands the comparator a call's live leaves under
    the golden's own paths (format 1's ``str(key)``), settles a container an older golden holds by
    type only, and says nothing for a golden of today's format."""
    import h5py
    from golden_edit import index_dict, set_index

    def out(x: torch.Tensor, k: float) -> Any:
        return {1: x * k, "d": collections.deque([x])}

    p, q = tmp_path / "old.h5", tmp_path / "new.h5"
    ag.record(Returns(out, 1.0), (X,), path=p)
    ag.record(Returns(out, 1.0), (X,), path=q)
    leaves = flatten(out(X, 1.0))
    key1 = next(leaf.path for leaf in leaves if not leaf.path.startswith("d"))
    _as_format_1(p, {key1: "1"})
    with h5py.File(p, "r+") as f:  # and the deque as a writer before deques were walked stored it
        idx = index_dict(f)
        root = idx["calls"][-1]
        root["leaves"] = [leaf for leaf in root["leaves"] if not leaf["path"].startswith("d/")]
        root["leaves"].append({"kind": "object", "path": "d", "type": "deque"})
        set_index(f, idx, force_v2=True)
    from activation_guard.store import GoldenReader

    with GoldenReader(q) as r:
        assert r.live_view(r.calls[-1], flatten(out(X, 1.0)), out(X, 1.0)) is None
    with GoldenReader(p) as r:
        live = out(X, 1.0)
        view = r.live_view(r.calls[-1], flatten(live), live)
    assert view is not None and view.conflict is None
    assert "1" in view.leaves and key1 not in view.leaves
    assert list(view.settled) == ["d"] and view.settled["d"].type_only
    assert view.inside_settled("d/0") and not view.inside_settled("1")


def test_matching_never_reads_the_golden_format_version() -> None:
    """Only the store knows golden formats: matching, judging and replay never read a reader's
    version (``inspect`` shows it, as a fact about the file)."""
    import ast

    import activation_guard

    root = Path(activation_guard.__file__).parent
    readers = []
    for src in root.rglob("*.py"):
        if src.parent.name not in ("comparison", "replay", "judges", "calibration", "values", "graphs"):
            continue
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "version" and "reader" in ast.unparse(node.value):
                readers.append(f"{src.relative_to(root)}:{node.lineno}")
    assert readers == []


def test_format_1_paths_that_collide_are_never_compared_as_one(tmp_path: Path) -> None:
    """Format 1 named a key by str(key): {1: a, "1": b} stored both as "1". Such a golden is
    refused (which value is which is lost); a live output whose two values collide under a
    format-1 golden is a structure failure. Before, one of the two values was never compared
    (found by review: a changed value at key 1 passed)."""
    def both(x: torch.Tensor, k: float) -> Any:
        return {1: x * k, "1": x}

    def one(x: torch.Tensor, k: float) -> Any:
        return {1: x * k}

    p, q = tmp_path / "both.h5", tmp_path / "one.h5"
    ag.record(Returns(both, 1.0), (X,), path=p)
    ag.record(Returns(one, 1.0), (X,), path=q)
    paths = [leaf.path for leaf in flatten(both(X, 1.0))]
    _as_format_1(p, {paths[0]: "1", paths[1]: "1"})
    _as_format_1(q, {flatten(one(X, 1.0))[0].path: "1"})
    with pytest.raises(ag.GoldenFormatError, match=r"lists output path '1' twice"):
        ag.compare(Returns(both, 5.0), (X,), path=p)
    assert ag.compare(Returns(one, 1.0), (X,), path=q).ok
    assert not ag.compare(Returns(one, 5.0), (X,), path=q).ok
    rep = ag.compare(Returns(both, 1.0), (X,), path=q)  # a second live value under the old name "1"
    assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.status == "structure"
    assert "cannot tell them apart" in str(rep)


# ----------------------------------------------------------------------------- named tuples


Pair = collections.namedtuple("Pair", ["logits", "loss"])
Swapped = collections.namedtuple("Swapped", ["loss", "logits"])


def test_a_named_tuples_field_names_are_compared(tmp_path: Path) -> None:
    """Values keep their indices while the names swap: ``out.logits`` is now the old ``loss``."""
    leaves = {leaf.path: leaf for leaf in flatten(Pair(X, X), fields=True)}
    assert leaves["#fields"].value == "logits,loss" and leaves["#fields"].kind == "str"
    assert not _passes(tmp_path, lambda x, k: k(x, x * 2), Pair, Swapped)


def test_field_names_are_compared_only_where_both_sides_have_them(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import activation_guard.capture.recorder as recorder_mod
    import activation_guard.values.leaves as leaves_mod
    p = tmp_path / "old.h5"
    with monkeypatch.context() as m:  # a golden from before field names were stored
        m.setattr(recorder_mod, "flatten", lambda out, fields=False: leaves_mod.flatten(out))
        ag.record(Returns(lambda x, k: k(x, x * 2), Pair), (X,), path=p)
    assert ag.compare(Returns(lambda x, k: k(x, x * 2), Pair), (X,), path=p).ok
    assert not ag.compare(Returns(lambda x, k: k(x, x * 3), Pair), (X,), path=p).ok
    assert _passes(tmp_path, lambda x, k: k((x, x * 2)) if k is tuple else k(x, x * 2), Pair, tuple)


# ----------------------------------------------------------------------------- third review: leaf consumers


def test_a_wrapper_subclass_is_not_a_dict_of_its_inner_tensors(tmp_path: Path) -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    def make(x: torch.Tensor, k: bool) -> Any:
        return TwoTensor(x, x * 2) if k else {"a": x, "b": x * 2}
    assert not _passes(tmp_path, make, True, False)


class Wrapped(nn.Module):
    """Layers that take and return a TwoTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l3 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.testing._internal.two_tensor import TwoTensor
        return self.l3(self.l2(self.l1(TwoTensor(x, x * 2))))


def test_replay_all_rebuilds_a_wrapper_subclass_from_the_golden(tmp_path: Path) -> None:
    """Layers after a changed one were judged diverged by their own error: the replay ran them on
    the live TwoTensor, since the golden holds its inner tensors, not the wrapper itself."""
    torch.manual_seed(0)
    model = Wrapped().eval()
    x = torch.randn(2, 4)
    p = tmp_path / "w.h5"
    ag.record(model, x, path=p)
    with torch.no_grad():
        model.l1.weight.mul_(1.5)
    report = ag.compare(model, x, path=p, replay="all")
    by_name = {layer.name: layer.status for layer in report.layers}
    assert by_name["l1"] == "diverged" and by_name["l2"] == "match" and by_name["l3"] == "match", by_name


def test_gradients_through_a_wrapper_subclass_are_refused_by_name(tmp_path: Path) -> None:
    from activation_guard._core.errors import ActivationGuardError
    torch.manual_seed(0)
    with pytest.raises(ActivationGuardError, match=r"layer 'l1' call 0 returns a TwoTensor .*forward only"):
        ag.record(Wrapped().train(), torch.randn(2, 4), path=tmp_path / "g.h5", backward=True)
    assert not (tmp_path / "g.h5").exists()


def test_a_changed_string_value_reports_no_numbers(tmp_path: Path) -> None:
    p = tmp_path / "s.h5"
    ag.record(Returns(lambda x, k: (x, k), "a"), (X,), path=p)
    text = str(ag.compare(Returns(lambda x, k: (x, k), "b"), (X,), path=p))
    assert "what          : output 1 'a' -> 'b'" in text
    assert "mismatched    :" not in text and "max abs diff  :" not in text, text


def test_inspect_and_textconv_show_the_stored_type_of_a_str_leaf(tmp_path: Path) -> None:
    from activation_guard.report.inspect_text import textconv_lines
    p = tmp_path / "t.h5"
    ag.record(Returns(lambda x, k: (x, k, "torch.float32"), torch.float32), (X,), path=p)
    lines = list(textconv_lines(p))
    assert any("dtype 'torch.float32'" in line for line in lines), lines
    assert any("str 'torch.float32'" in line for line in lines), lines


def test_diff_of_a_new_golden_against_an_older_recording_compares_by_type(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import activation_guard.values.leaves as leaves_mod
    new, old = tmp_path / "new.h5", tmp_path / "old.h5"
    ag.record(Returns(lambda x, k: (x, k), torch.float32), (X,), path=new)
    with monkeypatch.context() as m:
        m.setattr(leaves_mod, "_BY_REPR", ())
        ag.record(Returns(lambda x, k: (x, k), torch.float32), (X,), path=old)
    assert ag.diff_recordings(new, old).ok and ag.diff_recordings(old, new).ok


class Planet(enum.Enum):
    EARTH = (1, 2)


class Planet2(enum.Enum):
    EARTH = (1, 9)


Planet2.__qualname__ = "Planet"


class Tags(enum.Enum):
    X = frozenset({"alpha", "beta", "gamma"})


def test_an_enum_whose_value_is_a_tuple_is_compared_by_that_value(tmp_path: Path) -> None:
    assert flatten(Planet.EARTH)[0].value == "Planet.EARTH=(1, 2)"
    assert not _passes(tmp_path, lambda x, k: (x, k), Planet.EARTH, Planet2.EARTH)


def test_an_enum_key_holding_a_set_gets_a_path_independent_of_the_hash_seed() -> None:
    assert flatten({Tags.X: X})[0].path == "#Tags:Tags.X=frozenset({'alpha', 'beta', 'gamma'})"


@dataclasses.dataclass
class Holder:
    y: torch.Tensor


class HoldsWrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Holder:
        from torch.testing._internal.two_tensor import TwoTensor
        y = self.l1(x)
        return Holder(TwoTensor(y, y * 2))  # only the model's own output holds the wrapper


def test_gradients_through_a_wrapper_inside_a_dataclass_are_refused_by_name(tmp_path: Path) -> None:
    from activation_guard._core.errors import ActivationGuardError
    with pytest.raises(ActivationGuardError, match=r"layer '<root>' call 0 returns a TwoTensor"):
        ag.record(HoldsWrapped().train(), torch.randn(2, 4), path=tmp_path / "g.h5", backward=True)


class ScaledParent(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(Scaled(x, self.k))


def test_a_replay_rebuilds_a_wrapper_with_the_golden_metadata(tmp_path: Path) -> None:
    """The scale in a wrapper's metadata changed in the caller: the layer consuming it was re-run
    with the live scale and blamed for its own computation."""
    torch.manual_seed(0)
    model = ScaledParent(1.0).eval()
    x = torch.randn(2, 4)
    p = tmp_path / "s.h5"
    ag.record(model, x, path=p)
    model.k = 2.0
    report = ag.compare(model, x, path=p, replay="first")
    assert not report.ok and report.origin is not None and report.origin.name == "", str(report)

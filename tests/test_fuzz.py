"""Property tests (hypothesis).

1. Any output structure, of any supported dtype and shape, with NaN/Inf/-0.0/subnormals and
   non-contiguous views: record -> compare is ``ok``.
2. Any single element changed beyond tolerance, in any layer: the first divergence is that layer.
3. Corruption: random byte flips, overwritten runs and truncations of real goldens never pass on
   altered contents, never produce a failing report (corruption is not a model divergence), and
   never raise anything but a GoldenError.
"""

from __future__ import annotations

import copy
import math
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from models import Mixed, one_thread
from torch import nn

import activation_guard as ag
from activation_guard.values.leaves import flatten


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


# --------------------------------------------------------------------------- values

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int8, torch.int32, torch.int64, torch.uint8]
DTYPES = [*FLOATS, *INTS, torch.bool, torch.complex64, torch.complex128]

SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-40, 6e-8, 1e-45, -1.5, 1.0, 1e30, 65504.0, 448.0]


def float_values(n: int) -> st.SearchStrategy[list[float]]:
    return st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True, width=64)),
                    min_size=n, max_size=n)


@st.composite
def tensors(draw: Any, nonempty: bool = False) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1 if nonempty else 0, 4), max_size=3)))
    n = math.prod(shape)
    if dtype.is_floating_point:
        t = torch.tensor(draw(float_values(n)), dtype=torch.float64).to(dtype)
    elif dtype.is_complex:
        re_, im_ = draw(float_values(n)), draw(float_values(n))
        t = torch.complex(torch.tensor(re_, dtype=torch.float64), torch.tensor(im_, dtype=torch.float64)).to(dtype)
    elif dtype == torch.bool:
        t = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    else:
        info = torch.iinfo(dtype)
        t = torch.tensor(draw(st.lists(st.integers(info.min, info.max), min_size=n, max_size=n)), dtype=dtype)
    t = t.reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous
    elif t.dim() == 1 and t.numel() > 1 and draw(st.booleans()):
        t = t[::2]  # strided view
    return t


scalars = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),  # beyond int64 too (stored as text)
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=5),
)

structures = st.recursive(
    st.one_of(tensors(), scalars),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.text("ab/%._", min_size=1, max_size=3), kids, max_size=3),
    ),
    max_leaves=8,
)


class Emit(nn.Module):
    def __init__(self, out: Any) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> Any:
        return self.out


class Emitters(nn.Module):
    """Layers that each return a fixed output; the root returns all of them."""

    def __init__(self, outs: list[Any]) -> None:
        super().__init__()
        self.emit = nn.ModuleList(Emit(o) for o in outs)

    def forward(self, x: torch.Tensor) -> Any:
        return tuple(m(x) for m in self.emit)


X0 = torch.zeros(1)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@given(outs=st.lists(structures, min_size=1, max_size=4))
def test_record_then_compare_is_always_ok(scratch, outs):
    path = scratch / "roundtrip.h5"
    ag.record(Emitters(outs), X0, path=path)
    rep = ag.compare(Emitters(copy.deepcopy(outs)), X0, path=path)
    assert rep.ok, str(rep)
    assert len(rep.layers) == len(outs) + 1


# --------------------------------------------------------------------------- one perturbation


def perturbed(t: torch.Tensor, flat: int) -> torch.Tensor:
    """A copy of ``t`` with element ``flat`` moved well beyond any default tolerance: NaN and
    infinities become 0, finite values move by max(1, |v|) (up, or down where the dtype
    saturates), integers by one, bools flip."""
    out = t.detach().clone().contiguous()
    view = out.reshape(-1)
    v = view[flat].clone()
    if t.dtype == torch.bool:
        view[flat] = ~v
    elif not (t.dtype.is_floating_point or t.dtype.is_complex):
        view[flat] = v + 1 if int(v) < torch.iinfo(t.dtype).max else v - 1
    else:
        w = v.to(torch.complex128 if t.dtype.is_complex else torch.float64)
        if not bool(torch.isfinite(w).all()):
            view[flat] = torch.zeros_like(w).to(t.dtype)
        else:
            m = max(1.0, float(w.abs()))
            up = (w + m).to(t.dtype)  # float8_e4m3fn saturates at 448: then move down instead
            view[flat] = up if not torch.equal(up, v) else (w - m).to(t.dtype)
    assert not torch.equal(view[flat], v) or bool(torch.isnan(view[flat].to(torch.complex128)).any())
    return out.reshape(t.shape)


def tensor_slots(obj: Any) -> list[tuple[Any, Any]]:
    """(container, key) pairs of every non-empty tensor inside ``obj``."""
    slots: list[tuple[Any, Any]] = []
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        return slots
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.numel() > 0:
            slots.append((obj, k))
        else:
            slots.extend(tensor_slots(v))
    return slots


def listify(obj: Any) -> Any:
    """Tuples -> lists, so a leaf can be replaced in place (output types are kept by a wrapper)."""
    if isinstance(obj, tuple):
        return [listify(v) for v in obj]
    if isinstance(obj, list):
        return [listify(v) for v in obj]
    if isinstance(obj, dict):
        return {k: listify(v) for k, v in obj.items()}
    return obj


@given(outs=st.lists(structures.map(listify), min_size=1, max_size=4), extra=tensors(nonempty=True), data=st.data())
def test_single_perturbation_is_found_at_its_layer(scratch, outs, extra, data):
    outs = [*outs, [extra]]  # at least one layer holds a non-empty tensor
    path = scratch / "perturb.h5"
    ag.record(Emitters(outs), X0, path=path)
    live = copy.deepcopy(outs)
    candidates = [(k, slot) for k, o in enumerate(live) for slot in tensor_slots(o)]
    k, (container, key) = data.draw(st.sampled_from(candidates))
    t = container[key]
    flat = data.draw(st.integers(0, t.numel() - 1))
    container[key] = perturbed(t, flat)
    rep = ag.compare(Emitters(live), X0, path=path)
    assert not rep.ok
    fd = rep.first_divergence
    assert fd is not None and (fd.name, fd.call) == (f"emit.{k}", 0), str(rep)
    assert fd.status in ("diverged", "nonfinite"), fd.status


# --------------------------------------------------------------------------- corruption


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)


XC = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
MODELS = {"small": Small, "mixed": Mixed, "mixed-lzf": Mixed}


def snapshot(path: Path) -> Any:
    """Everything a reader serves, for 'the contents are unaltered' checks."""
    with ag.read_golden(path) as r:
        return r.meta, [(c.name, c.call, c.type_name,
                         [(lf.path, lf.kind, lf.dtype, lf.shape, lf.value, lf.type_name) for lf in c.leaves])
                        for c in r.calls], \
            [(c.name, lf.path, zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0)
             for c, lf, t in r.iter_tensors()]


@pytest.fixture(scope="module")
def real_goldens(tmp_path_factory) -> dict[str, tuple[bytes, Any]]:
    d = tmp_path_factory.mktemp("fuzz_goldens")
    out = {}
    with one_thread():
        for name, cls in MODELS.items():
            p = d / f"{name}.h5"
            ag.record(cls().eval(), XC, path=p, compression="lzf" if name.endswith("lzf") else None)
            out[name] = (p.read_bytes(), snapshot(p))
    return out


def check_damaged(path: Path, name: str, original: Any) -> str:
    """The one allowed outcome besides a GoldenError: contents exactly as recorded, and a pass."""
    try:
        got = snapshot(path)
        rep = ag.compare(MODELS[name]().eval(), XC, path=path)
    except ag.GoldenError as e:
        assert str(path) in str(e) and "to fix" in str(e)
        return type(e).__name__
    # Reaching here means the damage hit bytes no reader uses (free space, padding, the unread
    # vlen heap): everything served must be exactly what was recorded, and the check must pass.
    assert got == original, "damaged golden served altered contents"
    assert rep.ok, f"corruption misreported as a model divergence:\n{rep}"
    return "unaltered"


@given(name=st.sampled_from(list(MODELS)), data=st.data())
def test_byte_flips_never_pass_on_altered_contents(scratch, real_goldens, name, data):
    raw, original = real_goldens[name]
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    p = scratch / f"flip-{name}.h5"
    p.write_bytes(bytes(buf))
    check_damaged(p, name, original)


@given(name=st.sampled_from(list(MODELS)), data=st.data())
def test_overwritten_runs_never_pass_on_altered_contents(scratch, real_goldens, name, data):
    raw, original = real_goldens[name]
    start = data.draw(st.integers(0, len(raw) - 1))
    n = data.draw(st.integers(1, 512))
    fill = data.draw(st.sampled_from([b"\x00", b"\xff", b"random"]))
    chunk = bytes(data.draw(st.binary(min_size=n, max_size=n))) if fill == b"random" else fill * n
    buf = bytearray(raw)
    buf[start : start + n] = chunk[: len(buf) - start]
    assume(bytes(buf) != raw)
    p = scratch / f"run-{name}.h5"
    p.write_bytes(bytes(buf))
    check_damaged(p, name, original)


@given(name=st.sampled_from(list(MODELS)), data=st.data())
def test_truncations_are_always_refused(scratch, real_goldens, name, data):
    raw, _ = real_goldens[name]
    n = data.draw(st.integers(0, len(raw) - 1))
    p = scratch / f"trunc-{name}.h5"
    p.write_bytes(raw[:n])
    with pytest.raises(ag.GoldenError):
        ag.compare(MODELS[name]().eval(), XC, path=p)


def test_flatten_sees_every_fuzzed_leaf_kind():
    """Guards the strategies: the structures really contain the special values and kinds."""
    t = torch.tensor([math.nan, math.inf, -0.0, 5e-324], dtype=torch.float64)
    kinds = {lf.kind for lf in flatten({"t": t, "n": None, "s": "x", "big": 2**70, "o": object()})}
    assert kinds == {"tensor", "none", "str", "object"}

"""Every torch dtype round-trips bit-exactly through a golden, in every memory layout.

Values are compared as raw bytes (``view(torch.uint8)``), never with ``==``: NaN payloads and the
sign of zero must survive, and ``==`` would hide both.
"""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from models import one_thread

import activation_guard as ag
from activation_guard._core import dtypes
from activation_guard.store import SMALL_LEAF_BYTES


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():  # see models.one_thread: 1000x faster tiny forwards on a loaded machine
        yield


ALL_DTYPES = sorted(dtypes.BY_NAME)

# what each torch version must at least offer; the optional ones are tested when torch has them
REQUIRED = {
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "bool",
    "int8", "int16", "int32", "int64", "uint8",
}
OPTIONAL = {
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex32", "uint16", "uint32", "uint64",
}


@pytest.fixture(autouse=True)
def _no_complexhalf_warning():
    # complex32 tensors make torch warn "ComplexHalf support is experimental"; that is expected
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
        yield


class Emit(torch.nn.Module):
    """Returns fixed tensors as its output, whatever the input."""

    def __init__(self, *outs: torch.Tensor):
        super().__init__()
        self.outs = outs

    def forward(self, x: torch.Tensor):
        return self.outs[0] if len(self.outs) == 1 else tuple(self.outs)


def random_tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Uniformly random *bits* of the dtype: includes NaNs with payloads, infs, -0.0, subnormals."""
    info = dtypes.BY_NAME[name]
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * info.storage.itemsize,), dtype=torch.uint8, generator=g)
    if name == "bool":  # a bool byte other than 0/1 is not a valid bool
        raw = raw & 1
    return raw.view(info.torch_dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def roundtrip(tmp_path, *outs: torch.Tensor, name: str = "g.h5") -> list[torch.Tensor]:
    """Record a module emitting ``outs`` and read its root-call tensors back."""
    path = tmp_path / name
    ag.record(Emit(*outs), torch.zeros(1), path=path)
    with ag.read_golden(path) as r:
        (root,) = [c for c in r.calls if c.name == ""]
        return [r.load(leaf) for leaf in root.leaves]


def test_dtype_table_covers_what_torch_has():
    assert set(dtypes.BY_NAME) >= REQUIRED
    for name in OPTIONAL:
        assert (name in dtypes.BY_NAME) == (getattr(torch, name, None) is not None), name
    for name, info in dtypes.BY_NAME.items():
        assert info.storage.itemsize == info.torch_dtype.itemsize, name


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)], ids=lambda s: "x".join(map(str, s)) or "0d")
def test_every_dtype_roundtrips_bit_exactly(tmp_path, name, shape):
    t = random_tensor(name, shape, seed=len(shape))
    (back,) = roundtrip(tmp_path, t)
    assert back.dtype == t.dtype
    assert tuple(back.shape) == shape
    assert bits(back) == bits(t)


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_large_leaf_gets_its_own_dataset_and_roundtrips(tmp_path, name):
    info = dtypes.BY_NAME[name]
    n = SMALL_LEAF_BYTES // info.storage.itemsize + 7  # just over the packing threshold
    t = random_tensor(name, (n,), seed=3)
    small = random_tensor(name, (4,), seed=4)
    big_back, small_back = roundtrip(tmp_path, t, small)
    assert bits(big_back) == bits(t) and bits(small_back) == bits(small)
    with h5py.File(tmp_path / "g.h5", "r") as f:  # plain h5py sees the value type where numpy has one
        (ds,) = f["data"].values()
        assert ds.shape == (n,)
        assert ds.dtype == info.storage
        if info.native:
            np.testing.assert_array_equal(ds[()].view(np.uint8), t.view(torch.uint8).numpy())


def test_special_float_values_and_nan_payloads(tmp_path):
    f32 = torch.tensor(
        [0x7FC00000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x00000000],
        dtype=torch.int64,
    ).to(torch.int32).view(torch.float32)  # quiet/signalling NaNs with payloads, +-inf, -0.0, subnormal
    f64 = torch.tensor([0x7FF8000000000001, -0x0007_FFFF_FFFF_FFFF, -(2**63)], dtype=torch.int64).view(torch.float64)
    f16 = torch.tensor([0x7E01, 0xFC00, 0x8000, 0x0001], dtype=torch.int32).to(torch.int16).view(torch.float16)
    bf16 = torch.tensor([0x7FC1, 0xFF81, 0x8000], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert torch.isnan(f32[:4]).all() and torch.isnan(f64[:2]).all()
    assert f64[2].item() == 0.0 and str(f64[2].item()) == "-0.0"
    outs = (f32, f64, f16, bf16)
    back = roundtrip(tmp_path, *outs)
    for a, b in zip(outs, back):
        assert bits(a) == bits(b)
    # and a live run producing the same bits matches its golden, NaNs included
    rep = ag.compare(Emit(*(o.clone() for o in outs)), torch.zeros(1), path=tmp_path / "g.h5")
    assert rep.ok, str(rep)


def test_complex_values_including_conj_and_neg_views(tmp_path):
    c = torch.complex(torch.tensor([1.0, -0.0, float("nan")]), torch.tensor([2.0, 3.0, -1.0]))
    conj = c.conj()  # lazy conjugation bit: the golden must store the conjugated values
    assert conj.is_conj()
    back_conj, back_c = roundtrip(tmp_path, conj, c.to(torch.complex128))
    assert not back_conj.is_conj()
    assert bits(back_conj) == bits(conj.resolve_conj())
    assert bits(back_c) == bits(c.to(torch.complex128))
    neg = torch._neg_view(conj)  # negative-bit view
    assert neg.is_neg()
    (back_neg,) = roundtrip(tmp_path, neg, name="neg.h5")
    assert bits(back_neg) == bits(neg.resolve_neg().resolve_conj())


def _layouts() -> dict[str, torch.Tensor]:
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) - 60.5
    return {
        "transposed": base.transpose(1, 3),
        "strided_slice": base[:, ::2, 1:, ::3],
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "expanded_stride0": torch.tensor([1.5, -2.0]).expand(3, 2),
        "storage_offset_view": base.reshape(-1)[7:19],
        "diagonal": torch.diagonal(base[0, 0]),
        "flipped_negative_stride_copy": base.flip(0),
        "as_strided_overlap": torch.arange(6.0).as_strided((3, 3), (1, 1)),
    }


@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_memory_layouts_store_logical_values(tmp_path, layout):
    t = _layouts()[layout]
    (back,) = roundtrip(tmp_path, t)
    assert back.shape == t.shape
    assert back.is_contiguous()
    assert torch.equal(back, t)
    rep = ag.compare(Emit(t.clone()), torch.zeros(1), path=tmp_path / "g.h5")  # live contiguous copy
    assert rep.ok, str(rep)


def test_channels_last_bfloat16_and_int_views(tmp_path):
    x = random_tensor("bfloat16", (2, 3, 4, 4), seed=9).contiguous(memory_format=torch.channels_last)
    i = random_tensor("int64", (4, 6), seed=10)[:, 1::2]
    bx, bi = roundtrip(tmp_path, x, i)
    assert bits(bx) == bits(x) and bits(bi) == bits(i)


dtype_names = st.sampled_from(ALL_DTYPES)
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@given(name=dtype_names, shape=shapes, data=st.data())
def test_roundtrip_property_random_bits(tmp_path_factory, name, shape, data):
    info = dtypes.BY_NAME[name]
    n = 1
    for s in shape:
        n *= s
    raw = data.draw(st.binary(min_size=n * info.storage.itemsize, max_size=n * info.storage.itemsize))
    if name == "bool":
        raw = bytes(b & 1 for b in raw)
    t = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(info.torch_dtype).reshape(shape) if n
         else torch.empty(shape, dtype=info.torch_dtype))
    (back,) = roundtrip(tmp_path_factory.mktemp("rt"), t)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert bits(back) == bits(t)


@given(name=dtype_names, data=st.data())
def test_record_then_compare_matches_for_any_bits(tmp_path_factory, name, data):
    """A golden always matches a live run that produces the very same bits (NaN == NaN)."""
    n = data.draw(st.integers(1, 6))
    info = dtypes.BY_NAME[name]
    raw = data.draw(st.binary(min_size=n * info.storage.itemsize, max_size=n * info.storage.itemsize))
    if name == "bool":
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(info.torch_dtype)
    path = tmp_path_factory.mktemp("cmp") / "g.h5"
    ag.record(Emit(t), torch.zeros(1), path=path)
    rep = ag.compare(Emit(t.clone()), torch.zeros(1), path=path)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("name", ["int64", "uint64", "int32", "uint32"])
def test_large_integers_differing_in_the_last_bit_diverge(tmp_path, name):
    """Integers compare exactly: 2**60 vs 2**60 + 1 differs even though float64 cannot tell."""
    dt = dtypes.BY_NAME[name].torch_dtype
    big = 2**60 if dt.itemsize == 8 else 2**30
    g = (torch.tensor([big, 5], dtype=torch.int64).to(dt) if name != "uint64"
         else torch.tensor([big, 5], dtype=torch.int64).view(torch.uint64))
    live = (torch.tensor([big + 1, 5], dtype=torch.int64).to(dt) if name != "uint64"
            else torch.tensor([big + 1, 5], dtype=torch.int64).view(torch.uint64))
    ag.record(Emit(g), torch.zeros(1), path=tmp_path / "g.h5")
    rep = ag.compare(Emit(live), torch.zeros(1), path=tmp_path / "g.h5")
    fd = rep.first_divergence
    assert fd is not None and fd.status == "diverged", str(rep)
    assert fd.mismatched == 1 and fd.index == (0,)
    assert fd.golden_value == big and fd.live_value == big + 1
    assert fd.max_abs_diff == 1.0

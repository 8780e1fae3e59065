"""Python numbers as shared 0-d tensors (scalars.py): one per exact value, fresh under a torch mode,
and never taken by the recorder for a value passed on from call to call."""

from __future__ import annotations

import enum
import math
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import activation_guard as ag
from activation_guard.values import scalars
from activation_guard.values.leaves import flatten, flatten_inputs

_NUMBERS = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True),
                     st.complex_numbers(allow_nan=True))
_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _bits(x: object) -> bytes:
    if isinstance(x, complex):
        return struct.pack("<dd", x.real, x.imag)
    if isinstance(x, float):
        return struct.pack("<d", x)
    return repr(x).encode()


@settings(max_examples=200, deadline=None)
@given(a=_NUMBERS, b=_NUMBERS)
def test_one_tensor_per_exact_value_and_type(a: bool | int | float | complex, b: bool | int | float | complex) -> None:
    ta, tb = scalars.number_tensor(a, _DTYPE[type(a)]), scalars.number_tensor(b, _DTYPE[type(b)])
    assert ta.dtype == _DTYPE[type(a)] and ta.shape == () and ta.device.type == "cpu"
    assert scalars.number_tensor(a, _DTYPE[type(a)]) is ta  # shared
    got = ta.item()
    assert _bits(complex(got) if isinstance(a, complex) else type(a)(got)) == _bits(a)  # the value, bit for bit
    same = type(a) is type(b) and _bits(a) == _bits(b)
    assert (ta is tb) == same  # 0.0 and -0.0, 1 and True and 1.0, NaN payloads: never one tensor


def test_nan_payloads_and_signed_zeros_stay_apart() -> None:
    quiet, other = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000))[0], struct.unpack(
        "<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    assert math.isnan(quiet) and math.isnan(other)
    assert scalars.number_tensor(quiet, torch.float64) is not scalars.number_tensor(other, torch.float64)
    assert scalars.number_tensor(0.0, torch.float64) is not scalars.number_tensor(-0.0, torch.float64)
    assert math.copysign(1.0, scalars.number_tensor(-0.0, torch.float64).item()) == -1.0


class Color(enum.IntEnum):
    RED = 1


def test_subclasses_and_torch_modes_get_fresh_tensors() -> None:
    assert scalars.number_tensor(Color.RED, torch.int64) is not scalars.number_tensor(Color.RED, torch.int64)
    assert scalars.number_tensor(Color.RED, torch.int64).dtype == torch.int64
    with torch.device("meta"):  # a torch function mode: the mode makes the tensor, as torch.tensor would
        t = scalars.number_tensor(7, torch.int64)
    assert t.device.type == "meta"
    assert scalars.number_tensor(7, torch.int64).device.type == "cpu"


def test_a_value_first_met_in_inference_mode_is_a_plain_tensor() -> None:
    value = 123456.789e-3
    with torch.inference_mode():
        t = scalars.number_tensor(value, torch.float64)
    assert not t.is_inference()


def test_the_table_stays_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scalars, "MAX_KEPT", 8)
    monkeypatch.setattr(scalars, "_KEPT", {})
    for i in range(100):
        scalars.number_tensor(float(i) + 0.5, torch.float64)
        assert len(scalars._KEPT) <= 8


def test_the_walker_uses_them_for_inputs_and_outputs() -> None:
    leaves = flatten_inputs((torch.ones(2), True), {"n": 3, "eps": 1e-5})
    by_path = {leaf.path: leaf for leaf in leaves}
    assert by_path["args/1"].tensor is scalars.number_tensor(True, torch.bool)
    assert by_path["kwargs/n"].tensor is scalars.number_tensor(3, torch.int64)
    assert by_path["kwargs/eps"].type_name == "float"
    assert flatten((True, 2**70))[1].kind == "str"  # past int64: text, as before
    assert flatten(Color.RED)[0].tensor.dtype == torch.int64  # an IntEnum member: int64, a fresh tensor


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_cache: bool = False, k: int = 0) -> tuple[torch.Tensor, bool, int]:
        return self.fc(x) * (k + 1), use_cache, k


class Stack(nn.Module):
    """Every layer gets the same numbers, as a transformer's blocks get ``use_cache=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Flagged(), Flagged(), Flagged()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x, use_cache=True, k=2)[0]
        x = self.b(x, True, 2)[0]
        return self.c(x, use_cache=True, k=2)[0]


def test_shared_numbers_are_stored_as_values_never_as_references(tmp_path: Path) -> None:
    """One shared tensor for ``True`` must not make a later call's ``use_cache`` an alias of the first
    call's: each call stores its own value (with its Python type), and a changed number is found."""
    p = tmp_path / "g.h5"
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    ag.record(Stack(), x, path=p)
    with ag.read_golden(p) as g:
        for name in ("a", "b", "c"):
            c = g.by_key[(name, 0)]
            numbers = [e for e in c.inputs or [] if e.path in ("kwargs/use_cache", "kwargs/k", "args/1", "args/2")]
            assert [e.kind for e in numbers] == ["tensor", "tensor"], (name, numbers)
            assert sorted(e.type_name for e in numbers) == ["bool", "int"]
            outs = [e for e in c.leaves if e.path in ("1", "2")]
            assert [e.kind for e in outs] == ["tensor", "tensor"] and outs[0].type_name == "bool"
    torch.manual_seed(0)
    assert ag.compare(Stack(), x, path=p).ok


def test_a_number_passed_through_a_call_is_not_memory_it_shares() -> None:
    """replay="all" treats a child whose output shares memory with its inputs as aliased (no stub):
    the same number in and out (one shared tensor) must not count; a real view still does."""
    from activation_guard.capture.hooks import Frame
    from activation_guard.replay import replay

    assert not replay._shares_memory(Frame("c", nn.Identity(), (torch.randn(2), 3), {"flag": True}, None),
                                     (torch.randn(2), 3, True))
    x = torch.randn(4)
    assert replay._shares_memory(Frame("c", nn.Identity(), (x, 3), {}, None), (x[:2], 3))

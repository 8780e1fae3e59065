"""The pack buffer (store/pack.py): the bytes of small leaves and fingerprint blobs, kept in a
mapping of the writer's own until their pack is written."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import activation_guard as ag
from activation_guard.fingerprints import staging
from activation_guard.store import GoldenReader, writer
from activation_guard.store.pack import PackBuffer


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.binary(min_size=0, max_size=700)), max_size=40),
       st.integers(min_value=1, max_value=4096))
def test_appended_and_reserved_bytes_land_at_their_offsets(parts: list[tuple[bool, bytes]], capacity: int) -> None:
    """Whatever the capacity (the buffer grows past it), the pack is the parts in order."""
    buf = PackBuffer(capacity)
    later = []
    for reserve, raw in parts:
        if reserve:
            later.append((buf.reserve(len(raw)), raw))
        else:
            assert buf.append(raw) == buf.len - len(raw)
    for off, raw in later:
        buf.write_at(off, raw)
    view = buf.view()
    assert view.tobytes() == b"".join(raw for _, raw in parts)
    del view
    buf.reset()
    assert buf.len == 0 and buf.append(b"xyz") == 0 and buf.view().tobytes() == b"xyz"
    buf.close()


def test_a_write_outside_the_pack_is_refused_and_close_survives_a_live_view() -> None:
    buf = PackBuffer(16)
    with pytest.raises(ValueError, match="do not fit"):
        buf.write_at(0, b"a")  # nothing reserved yet
    off = buf.reserve(4)
    with pytest.raises(ValueError, match="do not fit"):
        buf.write_at(off + 1, b"abcd")
    buf.write_at(off, b"abcd")
    view = buf.view()
    buf.close()  # a view still exported (as a traceback may hold one): no error, unmapped later
    assert view.tobytes() == b"abcd"
    assert buf.view().size == 0


class ManySmall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(40))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("fingerprint", [False, True])
def test_goldens_spanning_many_packs_read_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               fingerprint: bool) -> None:
    """Packs of a few hundred bytes: dozens of packs, each reusing the mapping after a reset,
    and leaves as large as a whole pack. The golden reads back value for value and compares OK."""
    torch.manual_seed(3)
    model, x = ManySmall(), torch.randn(64, 16)
    monkeypatch.setattr(writer, "PACK_BYTES", 600)
    small, big = tmp_path / "small_packs.h5", tmp_path / "default.h5"
    ag.record(model, (x,), path=small, fingerprint=fingerprint)
    monkeypatch.undo()
    ag.record(model, (x,), path=big, fingerprint=fingerprint)
    with GoldenReader(small) as a, GoldenReader(big) as b:
        assert len([k for k in a.f["packs"]]) > 20 > len([k for k in b.f["packs"]])
        assert [c.name for c in a.calls] == [c.name for c in b.calls] and len(a.calls) == 41
        leaves = 0
        for ca, cb in zip(a.calls, b.calls):
            for la, lb in zip(ca.leaves, cb.leaves):
                assert la.kind == lb.kind and la.nbytes == lb.nbytes
                if la.kind == "tensor":
                    assert torch.equal(a.load(la), b.load(lb))
                elif la.kind == "fingerprint":
                    assert a.fingerprint(la).identical(b.fingerprint(lb))
                leaves += la.kind in ("tensor", "fingerprint")
        assert leaves >= 41
    assert ag.compare(model, (x,), path=small).ok


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("populate", [True, False])
def test_mappings_are_private_to_a_forked_child(monkeypatch: pytest.MonkeyPatch, populate: bool) -> None:
    """A shared mapping let two forked children take the same idle copy buffer and fingerprint each
    other's values. Without MAP_POPULATE (Python 3.9, macOS) the mappings must still be private."""
    if not populate:
        monkeypatch.delattr(mmap, "MAP_POPULATE", raising=False)
    pool = staging.StagingPool()
    monkeypatch.setattr(staging, "POOL", pool)
    copy = pool.take(4096)
    copy[:] = 1
    pool.give(copy)
    pack = PackBuffer(64)
    pack.append(b"parent")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: writes into its copies of both, and reports what its pool holds
        try:
            os.close(r)
            held = staging.POOL.held + len(staging.POOL._idle)
            copy[:] = 2
            pack.write_at(0, b"child!")
            os.write(w, str(held).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child_held = int(f.read() or -1)
    os.waitpid(pid, 0)
    assert child_held == 0  # a child starts with an empty pool (nothing held, no idle buffer)
    assert int(copy.min()) == int(copy.max()) == 1
    assert pack.view().tobytes() == b"parent"
    assert pool.take(4096).data_ptr() == copy.data_ptr()  # the parent's pool is as it was

"""The collector freeze around record/compare: nothing stays frozen, a caller's freeze stands."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import activation_guard as ag
from activation_guard._core.gcpause import collector_off, frozen_gc


@pytest.fixture
def no_freeze() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).eval()


def test_record_and_compare_leave_nothing_frozen(tmp_path: Path, no_freeze: None) -> None:
    m, x = model(), torch.randn(3, 4)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    assert gc.get_freeze_count() == 0
    assert ag.compare(m, x, path=p).ok
    assert gc.get_freeze_count() == 0


def test_a_failing_compare_unfreezes_too(tmp_path: Path, no_freeze: None) -> None:
    with pytest.raises(ag.GoldenNotFoundError):
        ag.compare(model(), torch.randn(3, 4), path=tmp_path / "absent.h5")
    assert gc.get_freeze_count() == 0


def test_a_callers_own_freeze_is_left_alone(tmp_path: Path, no_freeze: None) -> None:
    keep = [object() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        m, x = model(), torch.randn(3, 4)
        ag.record(m, x, path=tmp_path / "g.h5")
        assert ag.compare(m, x, path=tmp_path / "g.h5").ok
        # not unfrozen, and not grown by ours (objects that died meanwhile leave the frozen set)
        assert frozen - 1000 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    del keep


def test_nested_blocks_unfreeze_once_at_the_outermost(no_freeze: None) -> None:
    with frozen_gc():
        outer = gc.get_freeze_count()
        assert outer > 0
        made = [[i] for i in range(1000)]  # created inside: frozen by the nested block
        with frozen_gc():
            assert gc.get_freeze_count() >= outer + len(made)
        assert gc.get_freeze_count() > 0  # the inner block does not unfreeze the outer one's
    assert gc.get_freeze_count() == 0


def test_cycles_made_inside_a_block_are_still_collected(no_freeze: None) -> None:
    import weakref

    class Node:
        pass

    with frozen_gc():
        a, b = Node(), Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]
        ref = weakref.ref(a)
        del a, b
        gc.collect()
        assert ref() is None


def test_a_golden_opened_inside_a_frozen_block_is_frozen_until_the_block_ends(tmp_path: Path, no_freeze: None) -> None:
    """A compare opens its golden inside the freeze: the parsed index (thousands of containers on a
    deep model) is frozen with it rather than scanned by the next collections; outside a frozen
    block opening a golden freezes nothing."""
    from activation_guard.store import GoldenReader

    m, x = model(), torch.randn(3, 4)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    r = GoldenReader(p)
    assert gc.get_freeze_count() == 0
    r.close()
    with frozen_gc():
        r = GoldenReader(p)
        ids = {id(c) for c in r.calls} | {id(leaf) for c in r.calls for leaf in c.leaves}
        assert ids and all(gc.is_tracked(c) for c in r.calls)
        assert not any(id(o) in ids for g in range(3) for o in gc.get_objects(g))  # none in a scanned generation
        r.close()
    assert gc.get_freeze_count() == 0
    assert any(id(o) in ids for o in gc.get_objects(2))  # back in sight of the collector


def test_collector_off_switches_back_on_at_the_outermost_block() -> None:
    assert gc.isenabled()
    with collector_off():
        assert not gc.isenabled()
        with collector_off():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block does not switch it on under the outer one
    assert gc.isenabled()


def test_collector_off_leaves_a_callers_disabled_collector_off() -> None:
    gc.disable()
    try:
        with collector_off():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_opening_a_golden_leaves_the_collector_on_even_when_the_index_is_bad(tmp_path: Path) -> None:
    """The reader parses the index with the collector off: a malformed index must not leave it off."""
    import h5py
    import numpy as np

    m, x = model(), torch.randn(3, 4)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    with h5py.File(p, "r+") as f:  # valid JSON under a valid checksum, but not an index
        import zlib

        raw = b'{"calls": 7}'
        del f["index"]
        f.create_dataset("index", data=np.frombuffer(raw, dtype=np.uint8))
        f.attrs["index_crc32"] = np.int64(zlib.crc32(raw))
    with pytest.raises(ag.GoldenFormatError, match="malformed index"):
        ag.compare(m, x, path=p)
    assert gc.isenabled()


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"replay": "all"}, {"tolerance": "calibrated"}])
def test_a_finished_record_or_compare_is_freed_without_the_collector(tmp_path: Path, options: dict) -> None:
    """Nothing of a record or compare outlives it in a reference cycle: with the collector frozen
    around the run, such a cycle (the capture's two hooks once named each other) kept the whole
    comparator alive until a full collection, with a calibrated compare's float64 model copy."""
    from activation_guard.capture.recorder import Recorder
    from activation_guard.comparison.comparator import Comparator
    from activation_guard.store import GoldenReader, GoldenWriter

    m, x = model(), torch.randn(3, 4)
    p = tmp_path / "g.h5"
    ours = (Comparator, Recorder, GoldenReader, GoldenWriter)
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) in ours}  # another test's, kept by a live reference
    gc.disable()
    try:
        ag.record(m, x, path=p, calibrate="tolerance" in options)
        rep = ag.compare(m, x, path=p, **options)
        assert rep.ok
        left = [type(o).__name__ for o in gc.get_objects() if type(o) in ours and id(o) not in before]
    finally:
        gc.enable()
    assert left == []

"""Distributed support without a process group: golden paths, shard arithmetic, placements
validation, verdict merging and the store exchange (a FileStore, no ranks needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import activation_guard as ag
from activation_guard._core.errors import DistributedError, OptionError
from activation_guard.api import rank_summary as rs
from activation_guard.distributed.placements import PlacementMatcher, Placements
from activation_guard.distributed.ranks import (
    LocalShard,
    RankInfo,
    ShardLayout,
    chunk_sizes,
    local_shard_message,
    materialize,
    other_rank_goldens,
    rank_golden_path,
    rank_info,
    resolve_golden_path,
    shard_factor,
    split_rank_path,
    wait_async,
)
from activation_guard.distributed.transform import for_compare, for_record
from activation_guard.options.spec import CompareSpec

pytestmark = pytest.mark.distributed

# --------------------------------------------------------------------------- paths


def test_rank_path_examples():
    two = RankInfo(1, 2)
    assert rank_golden_path("golden/a.h5", two) == "golden/a.rank1-of-2.h5"
    assert rank_golden_path("x.tar.h5", RankInfo(0, 4)) == "x.tar.rank0-of-4.h5"
    assert rank_golden_path("d.h5/x.h5", two) == "d.h5/x.rank1-of-2.h5"  # only the file name changes
    p = rank_golden_path(Path("g/a.h5"), two)
    assert isinstance(p, Path) and p == Path("g/a.rank1-of-2.h5")


def test_single_process_keeps_the_plain_path():
    assert rank_golden_path("a.h5", None) == "a.h5"
    assert rank_golden_path("anything", RankInfo(0, 1)) == "anything"
    assert rank_info() is None  # the pytest process has no process group


@pytest.mark.parametrize("bad", ["a.H5", "a.hdf5", "a", "a.h5 ", "dir/.h5", ".h5"])
def test_rank_path_refuses_paths_it_cannot_name_exactly(bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        rank_golden_path(bad, RankInfo(0, 2))


def test_rank_path_refuses_a_rank_path():
    with pytest.raises(ValueError, match=r"already names the golden of rank 0 of 2; .*'a\.h5'"):
        rank_golden_path("a.rank0-of-2.h5", RankInfo(1, 2))


@pytest.mark.parametrize("name", ["a.rank01-of-2.h5", "a.rank2-of-2.h5", "a.rank0-of-1.h5", "a.rank0-of-02.h5",
                                  "a.rank0-of-2.H5", ".rank0-of-2.h5", "a.rank-1-of-2.h5"])
def test_non_canonical_rank_names_are_not_rank_paths(name):
    assert split_rank_path(name) is None


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (2, 2), (0, 0), (True, 2)])
def test_rank_info_validates(rank, world):
    if rank is True:  # bool is an int: accepted as 1, and 1 < 2
        assert RankInfo(rank, world).rank == 1
        return
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        RankInfo(rank, world)


names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1, max_size=30)


@given(folder=st.sampled_from(["", "g", "a/b.h5"]), stem=names,
       info=st.integers(2, 64).flatmap(lambda w: st.tuples(st.integers(0, w - 1), st.just(w))))
def test_rank_path_round_trips_and_never_collides(folder, stem, info):
    base = os.path.join(folder, stem + ".h5") if folder else stem + ".h5"
    ri = RankInfo(*info)
    if split_rank_path(base) is not None:  # the stem itself spells a rank part: refused
        with pytest.raises(ValueError):
            rank_golden_path(base, ri)
        return
    p = rank_golden_path(base, ri)
    assert p != base and p.endswith(".h5") and os.path.dirname(p) == os.path.dirname(base)
    assert split_rank_path(p) == (base, ri)
    other = RankInfo((ri.rank + 1) % ri.world_size, ri.world_size)
    assert rank_golden_path(base, other) != p
    assert rank_golden_path(base, RankInfo(ri.rank, ri.world_size + 1)) != p


def test_resolve_prefers_own_per_rank_golden(tmp_path):
    plain = str(tmp_path / "g.h5")
    me = RankInfo(1, 2)
    assert resolve_golden_path(plain, None) == (plain, False)
    assert resolve_golden_path(plain, me) == (str(tmp_path / "g.rank1-of-2.h5"), True)  # neither exists
    Path(plain).write_bytes(b"")
    assert resolve_golden_path(plain, me) == (plain, False)  # a single-device golden, compared in full
    (tmp_path / "g.rank1-of-2.h5").write_bytes(b"")
    (tmp_path / "g.rank0-of-2.h5").write_bytes(b"")
    (tmp_path / "g.rank0-of-4.h5").write_bytes(b"")
    assert resolve_golden_path(plain, me) == (str(tmp_path / "g.rank1-of-2.h5"), True)
    assert other_rank_goldens(plain) == [str(tmp_path / "g.rank0-of-2.h5"), str(tmp_path / "g.rank0-of-4.h5"),
                                         str(tmp_path / "g.rank1-of-2.h5")]
    with pytest.raises(ValueError, match=r"belongs to rank 0 of 4; this process is rank 1 of 2"):
        resolve_golden_path(tmp_path / "g.rank0-of-4.h5", me)


@pytest.mark.parametrize("single", [True, False])
def test_ranks_that_would_choose_different_goldens_are_refused_on_every_rank(tmp_path, single):
    """One rank's per-rank file missing: that rank would gather full values from the single-device
    golden while the others compare local ones, and both would wait in collectives until the
    process group timed out. Each rank sees the same files, so each refuses, naming them."""
    plain = str(tmp_path / "g.h5")
    if single:
        Path(plain).write_bytes(b"")
    (tmp_path / "g.rank1-of-2.h5").write_bytes(b"")
    with pytest.raises(DistributedError, match=r"exist for rank\(s\) \[1\] but not for rank\(s\) \[0\]"):
        resolve_golden_path(plain, RankInfo(0, 2))
    if single:  # rank 1 has its file, but rank 0 would take the single-device golden
        with pytest.raises(DistributedError, match=r"\[1\] but not for rank\(s\) \[0\]"):
            resolve_golden_path(plain, RankInfo(1, 2))
    else:  # no other kind of golden to take: rank 0's is simply missing (its not-found error names it)
        assert resolve_golden_path(plain, RankInfo(1, 2)) == (str(tmp_path / "g.rank1-of-2.h5"), True)
    (tmp_path / "g.rank0-of-2.h5").write_bytes(b"")
    assert resolve_golden_path(plain, RankInfo(0, 2)) == (str(tmp_path / "g.rank0-of-2.h5"), True)


# --------------------------------------------------------------------------- shards


def test_the_local_shard_message():
    assert local_shard_message("x", "", (4, 16), (4, 8), 2) == (
        "layer 'x' returned a local shard (4, 8) of a tensor sharded over 2 ranks; the golden holds the full "
        "(4, 16); tell activation_guard how it is placed: placements={'x': Shard(-1)}")
    msg = local_shard_message("blk.attn", "0", (8, 4, 6), (2, 4, 6), 4)
    assert msg is not None and "(output '0')" in msg and "over 4 ranks" in msg
    assert msg.endswith("placements={'blk.attn/0': Shard(0)}")  # that output only, not the whole layer


@pytest.mark.parametrize(("golden", "live", "world"), [
    ((4, 16), (4, 16), 2),  # same shape: compared, not a shard
    ((4, 16), (4, 32), 2),  # larger
    ((4, 16), (2, 8), 2),  # two dimensions differ
    ((4, 16), (4, 8, 1), 2),  # another rank
    ((4, 16), (4, 8), 1),  # one process
    ((4, 16), (4, 5), 2),  # no split of 16 over 2 gives 5
    ((4, 16), (4, 4), 2),  # a quarter needs 4 ranks
])
def test_not_a_local_shard(golden, live, world):
    assert shard_factor(golden, live, world) is None


@given(length=st.integers(1, 40), world=st.sampled_from([2, 3, 4, 6, 8]), data=st.data())
def test_every_dtensor_style_piece_is_recognised(length, world, data):
    n = data.draw(st.sampled_from([d for d in range(2, world + 1) if world % d == 0]))
    pieces = torch.arange(length).chunk(n)
    assert chunk_sizes(length, n) == [len(p) for p in pieces] + [0] * (n - len(pieces))
    k = data.draw(st.integers(0, len(pieces) - 1))
    size = len(pieces[k])
    found = shard_factor((3, length), (3, size), world)
    if size == length:
        assert found is None
    else:
        assert found is not None and found[0] == 1 and size in chunk_sizes(length, found[1])


def test_layout_owners():
    # a 2x2 mesh: rows split over mesh dim 0, replicated over mesh dim 1
    lay = ShardLayout((2, 2), (0, 1, 2, 3), (("shard", 0, (3, 2)), ("replicate",)), "S(0), R")
    assert lay.owners((0, 5)) == ([0, 1], False)
    assert lay.owners((4, 0)) == ([2, 3], False)
    assert "held by ranks 2, 3" in lay.describe((3, 0))
    part = ShardLayout((2,), (4, 5), (("partial",),), "Partial(sum)")
    assert part.owners((0,)) == ([4, 5], True)
    assert "a sum of partial values from ranks 4, 5" in part.describe((0,))
    one = ShardLayout((2,), (0, 1), (("shard", 1, (8, 8)),), "S(1)")
    assert one.describe((3, 12)) == "element [3, 12] lies in the shard of rank 1 (S(1))"


def test_materialize_plain_and_async_tensors():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = torch.ones(2, 3)
    assert materialize(t) is t
    assert materialize(t, info=RankInfo(0, 1)) is t
    ls = materialize(t, info=RankInfo(1, 2))
    assert isinstance(ls, LocalShard) and ls.tensor is t and ls.rank == 1
    assert ls.verdict("a", "", (2, 6)) is not None and ls.verdict("a", "", (2, 3)) is None
    assert materialize(t, local=True, info=RankInfo(1, 2)) is t  # per-rank goldens hold local values
    act = AsyncCollectiveTensor(torch.arange(3.0))
    out = wait_async(act)
    assert type(out) is torch.Tensor and torch.equal(out, torch.arange(3.0)) and act.completed


# --------------------------------------------------------------------------- placements


def _placements(value, source="argument"):
    return CompareSpec.build({"placements": value}, source).placements


def test_placements_validation_names_the_pattern_and_the_source():
    from torch.distributed.tensor import Partial, Replicate, Shard

    cases = [
        ([("x", Shard(0))], "must map layer-name glob patterns to Shard(dim) or Replicate() "
                            "(torch.distributed.tensor), got list"),
        ({"*.act": Shard}, "placements['*.act']: got the class Shard, not a placement (call it: Shard(-1))"),
        ({"a": Partial()}, "placements['a']: a partial (unreduced) value cannot be reassembled by gathering; "
                           "compare the reduced output of the layer that reduces it, got Partial(sum)"),
        ({"a": "Shard(-1)"}, "placements['a']: expected Shard(dim) or Replicate() from torch.distributed.tensor, "
                             "got 'Shard(-1)'"),
        ({3: Shard(0)}, "keys are glob patterns of layer names, got 3"),
    ]
    for value, problem in cases:
        for source in ("argument", "marker", "check()"):
            with pytest.raises(OptionError) as ei:
                _placements(value, source)
            assert (ei.value.option, ei.value.source, ei.value.problem) == ("placements", source, problem)
    assert not _placements(None) and not _placements({})
    table = _placements({"blk.*": Shard(-1), "*.act": Shard(0), "head": Replicate()})
    assert [r.pattern for r in table.rules] == ["blk.*", "*.act", "head"]
    p = PlacementMatcher(table)
    assert p.for_leaf("head") == ("head", Replicate())
    assert p.for_leaf("head", "0") == ("head", Replicate())  # a layer pattern covers each of its outputs
    assert p.for_leaf("other") is None
    with pytest.raises(DistributedError, match=r"layer 'blk\.act' matches placements patterns 'blk\.\*' "
                                               r"\(Shard\(dim=-1\)\) and '\*\.act' \(Shard\(dim=0\)\)"):
        p.for_leaf("blk.act")
    assert p.unmatched() == []
    leaf = PlacementMatcher(_placements({"*.attn/1": Shard(1)}))
    assert leaf.for_leaf("l0.attn", "1") == ("*.attn/1", Shard(1))
    assert leaf.for_leaf("l0.attn", "0") is None and leaf.for_leaf("l0.attn") is None
    assert PlacementMatcher(_placements({"x": Shard(0), "y": Shard(0)})).unmatched() == ["x", "y"]
    # a Placements object (for a group other than the world) is a mapping the spec validates alike
    table = _placements(Placements({"x": Shard(0)}))
    assert table.rules[0].placement == Shard(0) and table.group is None
    with pytest.raises(OptionError, match=r"placements\['x'\]: got the class Replicate"):
        _placements(Placements({"x": Replicate}))


def test_no_process_group_means_no_distributed_capture(tmp_path):
    from torch.distributed.tensor import Shard

    g = str(tmp_path / "g.h5")
    spec = CompareSpec()
    assert for_record(g) == (g, None) and for_compare(g, spec) == (g, None, spec)
    with pytest.raises(DistributedError, match=r"no torch\.distributed process group is initialized"):
        for_compare(g, _spec(placements={"x": Shard(0)}))
    m = torch.nn.Linear(2, 2)
    s = ag.record(m, torch.ones(1, 2), path=g)
    assert s.path == g
    with ag.read_golden(g) as r:
        assert "distributed" not in r.meta  # a single-process golden says nothing about ranks
    rep = ag.compare(m, torch.ones(1, 2), path=g)
    assert rep.ok and rep.rank is None and "rank" not in rep.headline()
    with pytest.raises(DistributedError, match=r"no torch\.distributed process group"):
        ag.compare(m, torch.ones(1, 2), path=g, placements={"x": Shard(0)})


# --------------------------------------------------------------------------- verdicts


def _v(rank, first=None, error=None, layers=4):
    return rs.RankVerdict(rank, 2, first is None and error is None, "g.h5", layers, {}, first, error)


def _first(name, position, ranks=None, status="diverged"):
    return {"name": name, "call": 0, "status": status, "position": position, "detail": "d", "ranks": ranks,
            "max_abs_diff": 1.0}


def test_verdict_json_round_trip():
    v = _v(1, _first("a.b", 3, [1]))
    assert rs.RankVerdict.from_json(v.to_json()) == v
    with pytest.raises(ValueError, match="not a rank verdict"):
        rs.RankVerdict.from_json('{"rank": "1"}')


def test_first_divergence_across_ranks():
    m = rs.MergedVerdict(2, [_v(0, _first("late", 5)), _v(1, _first("early", 2))], [], 1.0)
    assert (m.first.rank, m.first.name, m.first.seen_on) == (1, "early", [1])
    # the same gathered layer on both ranks: the owner of the worst element wins the tie
    m = rs.MergedVerdict(2, [_v(0, _first("x", 0, [1])), _v(1, _first("x", 0, [1]))], [], 1.0)
    assert (m.first.rank, m.first.seen_on) == (1, [0, 1])
    # no owner: the lowest rank; a missing call (no position) sorts last
    m = rs.MergedVerdict(2, [_v(0, _first("m", None, status="missing")), _v(1, _first("y", 7))], [], 1.0)
    assert (m.first.rank, m.first.name) == (1, "y")
    assert "on rank 1: values outside tolerance" in m.message()
    ok = rs.MergedVerdict(2, [_v(0), _v(1)], [], 1.0)
    assert ok.ok and ok.first is None
    assert ok.message() == "activation_guard: all 2 ranks match their goldens (4 layer calls each)"
    bad = rs.MergedVerdict(2, [_v(0), _v(1, error="raised OSError: gone")], [], 1.0)
    assert not bad.ok and "rank 1: raised OSError: gone" in bad.message()
    silent = rs.MergedVerdict(2, [_v(0)], [1], 2.5)
    assert not silent.ok and "rank 1: sent no verdict within 2.5 s" in silent.message()


def test_verdict_of_a_real_report(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    ag.record(m, x, path=tmp_path / "g.h5")
    with torch.no_grad():
        m[0].weight.mul_(1.01)
    v = rs.verdict_of(ag.compare(m, x, path=tmp_path / "g.h5"), RankInfo(1, 2))
    assert not v.ok and v.first["name"] == "0" and v.first["position"] == 0 and v.layers == 3
    assert rs.RankVerdict.from_json(v.to_json()) == v


def test_store_exchange_and_its_timeout(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 2)
    rs.post(_v(1, _first("a", 1)), "t1", store)
    merged = rs.exchange(_v(0), tag="t1", timeout=5, store=store)
    assert merged is not None and [v.rank for v in merged.verdicts] == [0, 1] and merged.first.name == "a"
    assert rs.exchange(_v(1), tag="t2", store=store) is None  # only the destination rank collects
    t0 = time.monotonic()
    merged = rs.exchange(_v(0), tag="t3", timeout=0.2, store=store)  # rank 1 never posts
    assert merged is not None and merged.silent == [1]
    assert time.monotonic() - t0 < 10  # bounded by the timeout (FileStore checks about once a second)


def test_gather_verdicts_outside_a_process_group_is_inert():
    with rs.gather_verdicts() as g:
        g.report = None
    assert g.merged is None


# --------------------------------------------------------------------------- imports


@pytest.mark.slow
def test_imports_stay_light():
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "import activation_guard, activation_guard.distributed.spawn\n"
        "assert 'torch' not in sys.modules, 'torch imported by import activation_guard'\n"
        "import activation_guard.distributed.ranks, activation_guard.distributed.transform\n"
        "import activation_guard.api.rank_summary\n"
        "import activation_guard.api.run\n"
        "heavy = [m for m in ('torch.distributed.tensor', 'torch.distributed.fsdp') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- in-process, a pretend rank


@pytest.fixture
def pretend_rank1_of_2(monkeypatch):
    """dist_capture as it behaves on rank 1 of 2 (no collective runs on plain tensors)."""
    from activation_guard.distributed import transform as dist_capture

    monkeypatch.setattr(dist_capture, "rank_info", lambda: RankInfo(1, 2))


def _spec(**options):
    return CompareSpec.build(options)


def test_rank_paths_and_refusals_of_what_would_hang_or_race(tmp_path, pretend_rank1_of_2):
    from torch.distributed.tensor import Shard

    g, own = str(tmp_path / "g.h5"), str(tmp_path / "g.rank1-of-2.h5")
    path, cap = for_record(g)  # every rank records its own file
    assert path == own and cap.local and cap.meta() == {"rank": 1, "world_size": 2, "values": "local"}
    assert for_record(own)[0] == own
    path, cap = for_record(g, per_rank=False)  # a private file (compare_models): full values at the path itself
    assert path == g and not cap.local and cap.meta()["values"] == "full"
    with pytest.raises(DistributedError, match=r"\(rank 0 of 2's file\) in rank 1 of 2: every rank records its own"):
        for_record(str(tmp_path / "g.rank0-of-2.h5"))
    with pytest.raises(DistributedError, match=r"must end in '\.h5'"):
        for_record(str(tmp_path / "g.hdf5"))
    with pytest.raises(DistributedError, match="fail_fast in a multi-rank run"):
        for_compare(g, _spec(fail_fast=True))
    with pytest.raises(DistributedError, match=r"is a per-rank golden, which holds each rank's local values"):
        for_compare(own, _spec(placements={"x": Shard(0)}))
    with pytest.raises(DistributedError, match=r"belongs to rank 0 of 2; this process is rank 1 of 2"):
        for_compare(str(tmp_path / "g.rank0-of-2.h5"), _spec())
    assert for_compare(g, _spec())[0] == own  # neither exists: the error will name its own file
    Path(g).write_bytes(b"")
    path, cap, spec = for_compare(g, _spec())  # a single-device golden: full values
    assert spec.replay == "off" and cap.replay_off and "replay is off in a multi-rank run" in cap.notes()[-1]
    with pytest.raises(DistributedError, match=r"replay='all' in a multi-rank run \(rank 1 of 2\)"):
        for_compare(g, _spec(replay="all"))
    assert not for_compare(g, _spec(replay="off"))[1].replay_off
    assert path == g and not cap.local and cap.meta()["values"] == "full"
    Path(own).write_bytes(b"")
    with pytest.raises(DistributedError, match=r"exist for rank\(s\) \[1\] but not for rank\(s\) \[0\]"):
        for_compare(g, _spec())  # rank 0 would take the single-device golden: refused on every rank
    Path(tmp_path / "g.rank0-of-2.h5").write_bytes(b"")
    path, cap, _ = for_compare(g, _spec())  # its own per-rank golden wins
    assert path == own and cap.local


def test_comparator_reports_local_shards_and_compares_full_ones(tmp_path, pretend_rank1_of_2):
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    x = torch.randn(3, 4)
    with pytest.MonkeyPatch.context() as mp:  # a single-device golden
        from activation_guard.distributed import transform as dist_capture

        mp.setattr(dist_capture, "rank_info", lambda: None)
        ag.record(wide, x, path=tmp_path / "g.h5")
    half = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    with torch.no_grad():  # this rank's columns of the same computation
        half[0].weight.copy_(wide[0].weight[4:])
        half[0].bias.copy_(wide[0].bias[4:])
    rep = ag.compare(half, x, path=tmp_path / "g.h5")
    assert [(r.name, r.status) for r in rep.layers] == [("0", "local_shard"), ("1", "local_shard"),
                                                        ("", "local_shard")]
    assert rep.first_divergence.detail.endswith("placements={'0': Shard(-1)}")
    assert "rank 1 of 2: DTensor outputs and placed shards compared as full tensors" in rep.notes[0]
    assert rep.rank == 1 and rep.world_size == 2
    assert rep.headline().startswith("activation_guard: rank 1 of 2: first divergence at layer '0'")
    assert ag.Report.from_dict(rep.to_dict()).headline() == rep.headline()
    assert ag.compare(wide, x, path=tmp_path / "g.h5").ok  # same-shape plain tensors: compared as they are
    narrow = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())  # 3 is no piece of 8 over 2
    assert {r.status for r in ag.compare(narrow, x, path=tmp_path / "g.h5").layers} == {"shape"}


# --------------------------------------------------------------------------- plugin golden names


@given(stem=names, info=st.integers(2, 64).flatmap(lambda w: st.tuples(st.integers(0, w - 1), st.just(w))))
def test_the_plugin_and_the_engine_agree_on_rank_parts(stem, info):
    from activation_guard.store import naming as paths

    ranked = rank_golden_path(stem + ".h5", RankInfo(*info)) if split_rank_path(stem + ".h5") is None else None
    for name in filter(None, [ranked, stem + ".h5"]):
        engine = split_rank_path(name)
        plugin = paths.split_rank_part(name[:-3])
        assert (engine is None) == (plugin is None)
        if engine is not None and plugin is not None:
            assert (engine[0], engine[1].rank, engine[1].world_size) == (plugin[0] + ".h5", plugin[1], plugin[2])


@given(parts=st.lists(names, min_size=1, max_size=3), name=st.none() | names,
       info=st.integers(2, 64).flatmap(lambda w: st.tuples(st.integers(0, w - 1), st.just(w))))
def test_no_test_or_check_name_spells_a_rank_golden(parts, name, info):
    """A name ending in '.rank0-of-2' must not give the file another check's rank 0 would write."""
    from activation_guard.store import naming as paths

    try:
        fname = paths.file_component(parts, name)
    except ValueError:
        return
    assert split_rank_path(fname) is None  # only a multi-rank run adds a rank part
    ranked = rank_golden_path(fname, RankInfo(*info))
    assert paths.owner_stem(ranked) == paths.owner_stem(fname)


def test_rank_like_names_are_escaped_and_rank_goldens_have_owners():
    from activation_guard.store import naming as paths

    assert paths.file_component(["test_a"], "x.rank0-of-2") == "test_a--x%2Erank0-of-2.h5"
    assert paths.file_component(["T", "rank1-of-2"]) == "T%2Erank1-of-2.h5"
    assert paths.file_component(["test_a"], "rank0-of-2") == "test_a--rank0-of-2.h5"  # no dot: no rank part
    assert paths.owner_stem("m/test_a[p]--dec.rank1-of-2.h5") == "m/test_a[p]"
    assert paths.owner_stem("m/test_a.rank0-of-4.h5") == "m/test_a"
    assert paths.owner_stem("m/test_a%2Erank0-of-4.h5") == "m/test_a%2Erank0-of-4"


def test_gradient_goldens_of_sharded_parameters_are_refused_before_the_forward(monkeypatch):
    from activation_guard.distributed import transform as dist_capture

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dist_capture.refuse_sharded_backward(model, True)  # plain parameters: fine
    monkeypatch.setattr(dist_capture, "is_dtensor", lambda t: t.dim() == 2)  # as under tensor parallelism
    dist_capture.refuse_sharded_backward(model, False)  # no backward: nothing to refuse
    with pytest.raises(DistributedError, match=r"backward=True with sharded parameters \(parameter '0.weight' is a "
                                               r"DTensor"):
        dist_capture.refuse_sharded_backward(model, True)

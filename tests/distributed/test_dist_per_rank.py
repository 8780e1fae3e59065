"""Per-rank regression goldens: record on 2 ranks, compare on 2 ranks, a changed rank caught."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


def test_record_then_compare_per_rank(suite):
    tmp_path = Path(suite["folder"]) / "per_rank"
    rec = [r["per_rank"]["record"] for r in suite["ranks"]]
    assert [r["path"] for r in rec] == [str(tmp_path / "tp.rank0-of-2.h5"), str(tmp_path / "tp.rank1-of-2.h5")]
    assert all(r["calls"] == 4 for r in rec)
    assert sorted(os.listdir(tmp_path)) == ["tp.rank0-of-2.h5", "tp.rank1-of-2.h5"]  # no shared file, no temps
    assert all("every rank records its own golden" in r["refused_other"] for r in rec)
    assert [r["meta"] for r in rec] == [{"rank": k, "world_size": 2, "values": "local"} for k in (0, 1)]

    clean, changed = suite["ranks"][0]["per_rank"]["compare"]
    assert clean["merged"]["ok"] and clean["merged"]["text"] == (
        "activation_guard: all 2 ranks match their goldens (4 layer calls each)")
    assert clean["path"] == str(tmp_path / "tp.rank0-of-2.h5")
    assert clean["max_abs"] == 0.0  # same ranks, same local math: bit-identical
    assert clean["notes"] == ["rank 0 of 2: every output compared as this rank's local value (per-rank golden)",
                              "replay is off in a multi-rank run (a layer re-run on one rank would leave the others "
                              "out of its collectives)"]
    merged = changed["merged"]
    assert not merged["ok"]
    assert merged["first"]["rank"] == 1 and merged["first"]["name"] == "0" and merged["first"]["seen_on"] == [1]
    assert "at layer '0' call 0 (#1 in execution order) on rank 1" in merged["text"]
    # rank 0's own values only change after the Rowwise all-reduce: its first divergence is the root
    assert "rank 0: first divergence at '<root>'" in merged["text"]

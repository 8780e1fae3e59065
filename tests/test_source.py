"""The live-value source seam: a source that is not module hooks (a recording, a graph, a runtime
session) yields layer calls, and the comparator judges them exactly as it judges hooked ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import activation_guard as ag
from activation_guard.api.diff import RecordingSource
from activation_guard.comparison.comparator import Comparator
from activation_guard.judges.strict import StrictJudge
from activation_guard.options.spec import ARGUMENT, CompareSpec
from activation_guard.options.tolerances import ToleranceResolver
from activation_guard.store import GoldenReader
from activation_guard.values.calls import LiveCall, LiveSource
from activation_guard.values.leaves import flatten


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()


class ManualSource:
    """Runs a Sequential's children one by one, outside any hook: what a graph interpreter does."""

    def __init__(self, model: nn.Sequential, x: torch.Tensor, scale: dict[str, float] | None = None):
        self.model, self.x, self.scale = model, x, scale or {}

    def calls(self) -> Iterator[LiveCall]:
        h = self.x
        with torch.no_grad():
            outs = []
            for name, child in self.model.named_children():
                h = child(h) * self.scale.get(name, 1.0)
                outs.append((name, type(child).__name__, h))
            for name, tname, out in outs:  # children first, then the root, as hooks return them
                yield LiveCall(name, 0, tname, lambda out=out: flatten(out, fields=True))
            yield LiveCall("", 0, type(self.model).__name__, lambda: flatten(h, fields=True))

    def describe(self) -> str:
        return "live values computed child by child"


def _compare(path: Path, source: LiveSource) -> list:
    spec = CompareSpec.build({}, ARGUMENT)
    with GoldenReader(path) as reader:
        comp = Comparator(reader, spec, StrictJudge(ToleranceResolver(spec)))
        comp.consume(source)
        layers, _ = comp.finish()
    return layers


def test_a_source_other_than_hooks_is_compared_call_by_call(tmp_path: Path) -> None:
    m, x = _model(), torch.randn(4, 6)
    ag.record(m, (x,), path=tmp_path / "g.h5")
    same = ManualSource(m, x)
    assert isinstance(same, LiveSource)
    layers = _compare(tmp_path / "g.h5", same)
    assert [(r.name, r.status) for r in layers] == [("0", "match"), ("1", "match"), ("2", "match"), ("", "match")]
    changed = _compare(tmp_path / "g.h5", ManualSource(m, x, scale={"1": 1.01}))
    assert [r.name for r in changed if not r.ok] == ["1", "2", ""]  # the first divergence is the scaled call


def test_fail_fast_stops_a_source_at_its_first_divergence(tmp_path: Path) -> None:
    m, x = _model(), torch.randn(4, 6)
    ag.record(m, (x,), path=tmp_path / "g.h5")
    spec = CompareSpec.build({"fail_fast": True}, ARGUMENT)
    with GoldenReader(tmp_path / "g.h5") as reader:
        comp = Comparator(reader, spec, StrictJudge(ToleranceResolver(spec)))
        comp.consume(ManualSource(m, x, scale={"0": 1.5}))
        assert [(r.name, r.ok) for r in comp.results] == [("0", False)]


def test_a_recording_is_a_source(tmp_path: Path) -> None:
    m, x = _model(), torch.randn(4, 6)
    ag.record(m, (x,), path=tmp_path / "a.h5")
    with torch.no_grad():
        m[2].weight.mul_(1.01)
    ag.record(m, (x,), path=tmp_path / "b.h5")
    with GoldenReader(tmp_path / "b.h5") as other:
        src = RecordingSource(other, lambda name: name != "1")
        assert isinstance(src, LiveSource)
        assert [(c.name, c.call) for c in src.calls()] == [("0", 0), ("2", 0), ("", 0)]
        assert "b.h5" in src.describe()
        layers = _compare(tmp_path / "a.h5", src)
    assert [(r.name, r.ok) for r in layers if r.status != "missing"] == [("0", True), ("2", False), ("", False)]
    report = ag.diff_recordings(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.first_divergence is not None and report.first_divergence.name == "2"

"""What lives in the engine: the displayed root name selects the root, and a
``parent.*`` tolerances pattern that misses ``parent`` itself gets a hint."""

from __future__ import annotations

from pathlib import Path

import torch
from models import tiny_mlp
from torch import nn

import activation_guard as ag
from activation_guard.cli import main
from activation_guard.report.inspection import inspect_golden

X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def test_the_displayed_root_name_selects_the_root_everywhere(tmp_path: Path, capsys) -> None:
    p = tmp_path / "g.h5"
    ag.record(tiny_mlp(), X, path=p)
    assert [leaf.layer for leaf in inspect_golden(p, "<root>").leaves] == [""]
    assert [leaf.layer for leaf in inspect_golden(p, "").leaves] == [""]
    assert main(["inspect", str(p), "--layer", "<root>"]) == 0
    assert "<root>" in capsys.readouterr().out
    report = ag.compare(tiny_mlp(), X, path=p, include="<root>")
    assert [r.name for r in report.layers] == [""]
    report = ag.compare(tiny_mlp(), X, path=p, tolerances={"<root>": dict(rtol=0.5)})
    root = next(r for r in report.layers if r.name == "")
    assert root.rtol == 0.5 and root.tolerance_source == "rtol: tolerances['<root>']; atol: float32 default"


class Encoder(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.scale


class Model(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.encoder = Encoder(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def test_a_parent_glob_that_misses_the_failing_parent_gets_a_hint(tmp_path: Path) -> None:
    p = tmp_path / "e.h5"
    ag.record(Model(), X, path=p)
    report = ag.compare(Model(1.001), X, path=p, tolerances={"encoder.*": dict(rtol=1e-2)})
    assert report.first_divergence is not None and report.first_divergence.name == "encoder"
    hint = ("the pattern 'encoder.*' matches layers inside 'encoder' but not 'encoder' itself; use 'encoder*' "
            "(or add 'encoder') to cover it too")
    assert hint in report.notes and hint in str(report)
    assert ag.compare(Model(1.001), X, path=p, tolerances={"encoder*": dict(rtol=1e-2), "": dict(rtol=1e-2)}).ok

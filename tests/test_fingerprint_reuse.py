"""A recording fingerprints a tensor once, however many layers hand it on unchanged
(fingerprint_leaves.Fingerprinter._taken), and again whenever it may have changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import activation_guard as ag
from activation_guard.capture import fingerprints as fingerprint_leaves
from activation_guard.capture.fingerprints import Fingerprinter
from activation_guard.fingerprints import worker as fingerprint_worker
from activation_guard.fingerprints.fingerprint import FingerprintParams, compute_fingerprint
from activation_guard.store import GoldenReader


class PassOn(nn.Module):
    """A block whose dropout (eval) and own output hand on its projection's output object."""

    def __init__(self, n: int = 300) -> None:
        super().__init__()
        self.proj = nn.Linear(n, n)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(x))


class Changes(nn.Module):
    """Returns its child's output object after writing it in place, or resized."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.inner, self.how = PassOn(), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.how == "mul_":
            y.mul_(2.0)
        elif self.how == "resize_":
            y.resize_(y.shape[0] // 2, y.shape[1])
        elif self.how == "data":  # other memory, and no version bump: only where the values are tells
            y.data = y.detach()[: y.shape[0] // 2].clone()
        return y


def _fingerprints(path: Path) -> dict[str, Any]:
    with GoldenReader(path) as r:
        return {c.name: r.fingerprint(c.leaves[0]) for c in r.calls if c.leaves and c.leaves[0].kind == "fingerprint"}


@pytest.mark.parametrize("worker", ["on", "off"])
def test_a_tensor_handed_on_is_fingerprinted_once_and_stored_alike(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path, worker: str) -> None:
    monkeypatch.setenv(fingerprint_worker.ENV, worker)
    monkeypatch.setattr(fingerprint_worker, "MIN_ELEMENTS", 1)
    torch.manual_seed(0)
    model, x = nn.Sequential(PassOn(), PassOn()).eval(), torch.randn(200, 300)
    made: list[Fingerprinter] = []
    real_init = Fingerprinter.__init__

    def spy(self: Fingerprinter, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(Fingerprinter, "__init__", spy)
    ag.record(model, (x,), path=tmp_path / "reused.h5", fingerprint=True)
    assert made[-1].reused == 5  # per block drop's output and its own (proj's output), and the root's
    monkeypatch.setattr(Fingerprinter, "_taken", lambda self, t: None)
    ag.record(model, (x,), path=tmp_path / "computed.h5", fingerprint=True)
    assert made[-1].reused == 0
    assert (tmp_path / "reused.h5").read_bytes() == (tmp_path / "computed.h5").read_bytes()
    assert ag.compare(model, (x,), path=tmp_path / "reused.h5").ok


@pytest.mark.parametrize("how", ["mul_", "resize_", "data"])
def test_a_tensor_changed_in_place_is_fingerprinted_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          how: str) -> None:
    monkeypatch.setattr(fingerprint_worker, "MIN_ELEMENTS", 1)
    torch.manual_seed(1)
    model, x = Changes(how).eval(), torch.randn(200, 300)
    path = tmp_path / "g.h5"
    ag.record(model, (x,), path=path, fingerprint=True)
    fps = _fingerprints(path)
    with torch.no_grad():
        y = model.inner.proj(x)
    p = FingerprintParams()
    assert fps["inner.proj"].identical(compute_fingerprint(y, p))
    changed = y * 2.0 if how == "mul_" else y[: y.shape[0] // 2]
    assert fps[""].identical(compute_fingerprint(changed, p))  # the root's output as it was returned
    assert not fps[""].identical(fps["inner.proj"])
    assert ag.compare(model, (x,), path=path).ok


def test_only_tensors_with_a_version_counter_are_remembered() -> None:
    fp = Fingerprinter(True, FingerprintParams(), worker=False)
    try:
        with torch.inference_mode():
            t = torch.randn(100, 100)
        out = fp("layer", [fingerprint_leaves.Leaf("", "tensor", tensor=t)])
        assert out[0].kind == "fingerprint" and fp._taken(t) is None and not fp._seen
        u = torch.randn(100, 100)
        fp("layer", [fingerprint_leaves.Leaf("", "tensor", tensor=u)])
        assert fp._taken(u) is not None
        u.add_(1)  # a write: the version moves on
        assert fp._taken(u) is None
    finally:
        fp.close()
    assert not fp._seen

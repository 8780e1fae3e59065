"""The float64 copy whose parameters are widened per module call: the same references as a whole copy.

Every model here runs both ways (:attr:`ShadowRun.widen_per_call`) and must give bit-identical
float64 outputs and the same leaf-check notes; models that use a parameter outside its own module's
call must trip the per-call copy and fall back to the whole one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import activation_guard as ag
from activation_guard.calibration import widen
from activation_guard.calibration.shadow import ShadowRun
from tests import models

CPU = torch.device("cpu")


class Pos(nn.Module):
    """A learned position table whose output is a view of its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))

    def forward(self, n: int) -> torch.Tensor:
        return self.weight[:n]


class ViewOut(nn.Module):
    """The position table's output used after a module whose weight has the table's size."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = Pos()
        self.a = nn.Linear(8, 16)  # 128 weights, as the table: the pool's first candidate
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pos(4)
        return self.b(self.a(x)) + p


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class ReadsChild(nn.Module):
    """Reads a child's weight in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x) + x @ self.child.weight.T


class CallsForward(nn.Module):
    """Calls a child's forward directly: no hooks run around it."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.child.forward(x))


class SwallowsErrors(nn.Module):
    """Tries a fast path that reads a child's weight, and takes another path when it raises."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return x @ self.child.weight.T * 2
        except Exception:
            return self.child(x)


class WritesOwn(nn.Module):
    """Writes into its own parameter during its call (a running clamp)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.5, 0.5)
        return x @ self.weight


def seq(*mods: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*mods).eval()


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]], bool]] = {
    # name: (model, inputs, whether the per-call copy must trip)
    "mlp": (lambda: models.tiny_mlp(), lambda: (torch.randn(4, 8),), False),
    "shared loop": (lambda: models.shared_loop(), lambda: (torch.randn(3, 6),), False),
    "cnn": (lambda: models.build_cnn(), models.cnn_input, False),
    "transformer encoder": (lambda: models.build_transformer_encoder(), models.transformer_input, True),
    "lstm": (lambda: models.build_lstm(), models.lstm_input, False),
    "view of a parameter": (lambda: (torch.manual_seed(0), ViewOut().eval())[1], lambda: (torch.randn(4, 8),), False),
    "tied weights": (lambda: (torch.manual_seed(0), Tied().eval())[1], lambda: (torch.randint(0, 32, (2, 5)),),
                     False),
    "reads a child's weight": (lambda: (torch.manual_seed(0), ReadsChild().eval())[1], lambda: (torch.randn(4, 8),),
                               True),
    "calls a child's forward": (lambda: (torch.manual_seed(0), CallsForward().eval())[1],
                                lambda: (torch.randn(4, 8),), True),
    "swallows the error": (lambda: (torch.manual_seed(0), SwallowsErrors().eval())[1], lambda: (torch.randn(4, 8),),
                           True),
    "writes its own parameter": (lambda: (torch.manual_seed(0), WritesOwn().eval())[1], lambda: (torch.randn(4, 8),),
                                 True),
}


def references(run: ShadowRun) -> dict[tuple[str, int, str], torch.Tensor]:
    assert run.scratch is not None
    return {k: run.reference(*k) for k in run.scratch.entries}  # type: ignore[misc]


def run(model: nn.Module, args: tuple[Any, ...], per_call: bool,
        monkeypatch: pytest.MonkeyPatch) -> tuple[ShadowRun, list[str | None]]:
    """The shadow run, and per attempt: None for a whole copy, else why it tripped ("ok": it did not)."""
    seen: list[str | None] = []
    orig = ShadowRun._attempt

    def attempt(self: ShadowRun, *a: Any, lazy: bool, **k: Any) -> None:
        try:
            orig(self, *a, lazy=lazy, **k)
        finally:
            seen.append(None if not lazy or self.lazy is None else (self.lazy.tripped or "ok"))

    with monkeypatch.context() as m:
        m.setattr(ShadowRun, "widen_per_call", per_call)
        m.setattr(ShadowRun, "_attempt", attempt)
        return ShadowRun(model, args, {}, None, None, CPU), seen


def shadow(model: nn.Module, args: tuple[Any, ...], per_call: bool, monkeypatch: pytest.MonkeyPatch) -> ShadowRun:
    return run(model, args, per_call, monkeypatch)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_per_call_widening_gives_the_whole_copys_references(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build, inputs, trips = CASES[case]
    model, args = build(), inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    whole = shadow(model, args, False, monkeypatch)
    per_call, seen = run(model, args, True, monkeypatch)
    try:
        assert (seen[0] != "ok") is trips, seen  # tripped (or raised) exactly where a parameter is used outside
        assert len(seen) == (2 if trips else 1)
        ref_w, ref_p = references(whole), references(per_call)
        assert ref_w.keys() == ref_p.keys() and ref_w
        for k in ref_w:
            assert ref_w[k].dtype == torch.float64
            assert torch.equal(ref_w[k], ref_p[k]), k
        assert whole.differs == per_call.differs
        for k, v in model.state_dict().items():  # the model itself is untouched either way
            assert torch.equal(v, before[k]), k
    finally:
        whole.close()
        per_call.close()
    assert not widen._LIVE  # closed copies leave no placeholder registered


def test_a_buffer_an_output_still_views_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The position table's output is a view of its widened parameter: handing that buffer to the
    next module of its size would rewrite the output under the model."""
    torch.manual_seed(0)
    model, x = ViewOut().eval(), torch.randn(4, 8)
    whole = references(shadow(model, (x,), False, monkeypatch))
    right = references(shadow(model, (x,), True, monkeypatch))
    monkeypatch.setattr(widen, "_alone", lambda buf: True)  # what ignoring the view would do
    wrong = references(shadow(model, (x,), True, monkeypatch))
    key = ("", 0, "")
    assert torch.equal(right[key], whole[key])
    assert not torch.equal(wrong[key], whole[key])


def test_the_per_call_copy_holds_one_layer_of_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).eval()
    run = shadow(model, (torch.randn(4, 64),), True, monkeypatch)
    try:
        assert run.lazy is not None and run.lazy.tripped is None
        assert run.lazy.nbytes == 8 * (64 * 64 + 64) * 8  # what a whole copy would hold
        assert run.lazy.pool.nbytes == (64 * 64 + 64) * 8  # one layer's weight and bias, reused by all
        assert run.scratch is not None and run.scratch._fd is None  # outputs in memory, no file
        assert run.scratch.held == 8 * 4 * 64 * 8 + 4 * 64 * 8  # every layer's output and the model's
    finally:
        run.close()


def test_outputs_beyond_the_budget_go_to_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Activations larger than the parameters: what the whole copy would have held is kept in
    memory, the rest is written to the scratch file, and both read back the same."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).eval(), torch.randn(16, 16)
    whole = shadow(model, (x,), False, monkeypatch)
    run = shadow(model, (x,), True, monkeypatch)
    try:
        assert run.lazy is not None and run.scratch is not None
        assert run.scratch.held <= run.lazy.nbytes - run.lazy.pool.nbytes
        assert run.scratch.held > 0 and run.scratch.size > 0  # some of each
        a, b = references(whole), references(run)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        whole.close()
        run.close()


def test_hf_llama_widens_per_call_and_its_verdicts_stay(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, args = models.build_hf_llama(), models.token_input()
    tripped: list[str | None] = []
    orig = ShadowRun._attempt

    def attempt(self: ShadowRun, *a: Any, lazy: bool, **k: Any) -> None:
        orig(self, *a, lazy=lazy, **k)
        tripped.append(None if self.lazy is None else self.lazy.tripped)

    monkeypatch.setattr(ShadowRun, "_attempt", attempt)
    ag.record(model, args, path=tmp_path / "g.h5", calibrate=True)
    assert tripped == [None]
    assert ag.compare(model, args, path=tmp_path / "g.h5", tolerance="calibrated").ok
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    r = ag.compare(model, args, path=tmp_path / "g.h5", tolerance="calibrated")
    assert not r.ok and r.first_divergence is not None
    assert r.first_divergence.name.startswith("model.layers.1")

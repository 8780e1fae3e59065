"""replay="all" with the model's own hooks and random numbers (adversarial review, round 2).

A replay must run a call the way the capture saw it: user pre-hooks had already changed the
recorded inputs, user forward hooks change outputs only after they are read, and a child that
is not re-run still moves the random stream as the live call did.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

import activation_guard as ag


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def _shift(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] + 1.0,)


def _double(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2.0


def _hooked(pre: bool, post: bool) -> Net:
    net = _net()
    for m in (net.block, net.block.a, net.head):
        if pre:
            m.register_forward_pre_hook(_shift)
        if post:
            m.register_forward_hook(_double)
    return net


def test_user_pre_hooks_are_not_applied_twice(tmp_path: Path) -> None:
    p = tmp_path / "g.h5"
    ag.record(_hooked(True, False), X, path=p)
    report = ag.compare(_hooked(True, False), X, path=p, replay="all")
    assert report.ok, str(report)


def test_user_forward_hooks_rewrite_outputs_after_they_are_read(tmp_path: Path) -> None:
    p = tmp_path / "g.h5"
    ag.record(_hooked(False, True), X, path=p)
    report = ag.compare(_hooked(False, True), X, path=p, replay="all")
    assert report.ok, str(report)


def test_a_change_under_user_hooks_is_attributed_to_its_layer(tmp_path: Path) -> None:
    p = tmp_path / "g.h5"
    ag.record(_hooked(True, True), X, path=p)
    bad = _hooked(True, True)
    with torch.no_grad():
        bad.block.b.weight.mul_(1.01)
    for replay in ("first", "all"):
        report = ag.compare(bad, X, path=p, replay=replay)
        assert not report.ok
        assert report.origin is not None and report.origin.name == "block.b", (replay, str(report))


class Noisy(nn.Module):
    """A parent whose forward draws random numbers after a Dropout child."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        return self.out(h + 0.1 * torch.randn_like(h))


def _noisy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Noisy(), nn.Linear(8, 2)).train()


def test_a_child_not_rerun_still_moves_the_random_stream(tmp_path: Path) -> None:
    p = tmp_path / "g.h5"
    model = _noisy()
    torch.manual_seed(5)
    ag.record(model, X, path=p)
    model = _noisy()
    torch.manual_seed(5)
    report = ag.compare(model, X, path=p, replay="all")
    assert report.ok, str(report)
    bad = _noisy()
    with torch.no_grad():
        bad[0].out.bias.add_(0.5)
    torch.manual_seed(5)
    report = ag.compare(bad, X, path=p, replay="all")
    assert not report.ok and report.origin is not None and report.origin.name == "0.out", str(report)


def test_compare_models_gives_both_models_the_same_random_stream() -> None:
    """A training-mode Dropout: the candidate once ran on the stream the reference had advanced."""
    ref = _noisy()
    cand = _noisy()
    torch.manual_seed(3)
    report = ag.compare_models(ref, cand, X)
    assert report.ok, str(report)
    with torch.no_grad():
        cand[1].bias.add_(1.0)
    torch.manual_seed(3)
    bad = ag.compare_models(ref, cand, X)
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.name == "1"


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = Blk()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blk(x)
        return self.out(h * torch.rand_like(h))


def test_an_eval_child_holding_a_training_dropout_still_moves_the_stream(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Outer().train()
    model.blk.eval()
    model.blk.drop.train()
    p = tmp_path / "g.h5"
    torch.manual_seed(1)
    ag.record(model, X, path=p)
    torch.manual_seed(1)
    report = ag.compare(model, X, path=p, replay="all")
    assert report.ok, str(report)


def test_a_pre_hook_changing_its_input_in_place_runs_once_per_replay(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    model[2].register_forward_pre_hook(lambda mod, a: a[0].mul_(2))
    p = tmp_path / "g.h5"
    ag.record(model, X, path=p)
    for replay in ("first", "all"):
        report = ag.compare(model, X, path=p, replay=replay)
        assert report.ok, (replay, str(report))
    with torch.no_grad():
        model[2].bias.add_(0.1)
    bad = ag.compare(model, X, path=p, replay="all")
    assert not bad.ok and bad.origin is not None and bad.origin.name == "2", str(bad)


class Caster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return self.lin(x).to(dt).float()


class CastParent(nn.Module):
    def __init__(self, dt: torch.dtype) -> None:
        super().__init__()
        self.child = Caster()
        self.dt = dt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x, self.dt)


def test_a_changed_dtype_argument_is_blamed_on_the_caller(tmp_path: Path) -> None:
    """The replay ran the unchanged child on the live dtype argument and blamed the child."""
    torch.manual_seed(0)
    model = CastParent(torch.float32).eval()
    p = tmp_path / "g.h5"
    ag.record(model, X, path=p)
    model.dt = torch.bfloat16
    report = ag.compare(model, X, path=p, replay="first")
    assert not report.ok and report.origin is not None
    assert report.origin.name == "" and "args/1 was 'torch.float32', is now 'torch.bfloat16'" in (
        report.origin.detail or ""), str(report)
    every = ag.compare(model, X, path=p, replay="all")  # the child is not judged by a replay on the live dtype
    assert not every.ok and "not replayed: its argument args/1 was 'torch.float32'" in str(every), str(every)


class Tagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bump = 0.0

    def forward(self, x: torch.Tensor, request_id: str = "") -> torch.Tensor:
        return self.lin(x) + self.bump


class TagParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = Tagged()
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.c(x, request_id=f"request-{self.n}")  # another string on every run


def test_a_string_argument_that_differs_every_run_does_not_move_the_blame(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TagParent().eval()
    p = tmp_path / "g.h5"
    ag.record(model, X, path=p)
    assert ag.compare(model, X, path=p, replay="all").ok
    model.c.bump = 1.0
    report = ag.compare(model, X, path=p, replay="first")
    assert report.origin is not None and report.origin.name == "c", str(report)  # its own code


class DtypeCaller(nn.Module):
    def __init__(self, passes: bool) -> None:
        super().__init__()
        self.child = Caster()
        self.passes = passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x, torch.float32) if self.passes else self.child(x, dt=torch.float32)


@dataclasses.dataclass
class Box:
    x: torch.Tensor


class Unbox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, box: Box) -> torch.Tensor:
        return self.lin(box.x)


class Boxer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.u = Unbox()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.u(Box(x.clone())))


def test_a_pre_hook_changing_a_dataclass_argument_in_place_runs_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Boxer().eval()
    def double(mod: nn.Module, a: tuple[Any, ...]) -> None:
        a[0].x.mul_(2)  # in place, returns nothing: the call gets the changed dataclass

    model.u.register_forward_pre_hook(double)
    p = tmp_path / "g.h5"
    ag.record(model, X, path=p)
    report = ag.compare(model, X, path=p, replay="all")
    assert report.ok, str(report)


def test_a_global_forward_hook_is_not_applied_twice_in_a_replay(tmp_path: Path) -> None:
    from torch.nn.modules.module import register_module_forward_hook

    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(8, 4)).eval()
    handle = register_module_forward_hook(lambda mod, a, out: out + 1 if isinstance(mod, nn.Linear) else None)
    try:
        p = tmp_path / "g.h5"
        ag.record(model, X, path=p)
        report = ag.compare(model, X, path=p, replay="all")
        assert report.ok, str(report)
        with torch.no_grad():
            model[1].bias.add_(0.5)
        bad = ag.compare(model, X, path=p, replay="all")
        assert not bad.ok and bad.origin is not None and bad.origin.name == "1", str(bad)
    finally:
        handle.remove()


class PassesDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Caster()

    def forward(self, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return self.child(x, dt)


def test_an_argument_passed_on_from_the_models_own_inputs_points_at_the_inputs(tmp_path: Path) -> None:
    """The model was called with another dtype, which it passed on: the root's code was blamed."""
    torch.manual_seed(0)
    model = PassesDtype().eval()
    p = tmp_path / "g.h5"
    ag.record(model, (X, torch.float32), path=p)
    report = ag.compare(model, (X, torch.bfloat16), path=p, replay="first")
    assert not report.ok and report.origin is not None and report.origin.kind == "inputs", str(report)
    assert "args/1 was 'torch.float32'" in (report.origin.detail or "")


class CastOnly(nn.Module):
    def forward(self, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return (x * 1.5).to(dt).float()


class CastFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cast = CastOnly()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return self.lin(self.cast(x, dt))


def test_an_inputs_origin_does_not_claim_a_replay_that_did_not_happen(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = CastFirst().eval()
    p = tmp_path / "g.h5"
    ag.record(model, (X, torch.float32), path=p)
    report = ag.compare(model, (X * 2, torch.bfloat16), path=p, replay="all")
    assert not report.ok and report.origin is not None and report.origin.kind == "inputs", str(report)
    assert "was not re-run on the golden's inputs" in (report.origin.detail or ""), report.origin.detail

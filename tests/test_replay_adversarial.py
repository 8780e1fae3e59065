"""Replay under an adversarial review: each case once gave a false pass, a false alarm or a wrong
origin. Stateful modules, changed model inputs under ``replay="all"``, changed non-tensor or
dropped arguments, and layers that draw random numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import activation_guard as ag

MODES = ("off", "first", "all")


class RunningNorm(nn.Module):
    """Keeps a running mean in a buffer (an EMA normaliser, a quantisation observer) and subtracts
    it; ``use_before_update`` is the off-by-one-step refactor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))
        self.lin = nn.Linear(8, 8)
        self.use_before_update = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.use_before_update:
            out = h - self.ema
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
            return out
        self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.ema


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RunningNorm()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _norm_model(tmp_path: Path) -> tuple[WithNorm, torch.Tensor, Path]:
    torch.manual_seed(0)
    m = WithNorm().eval()
    x = torch.randn(4, 8) + 1.0
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    return m, x, p


@pytest.mark.parametrize("mode", MODES)
def test_a_module_updating_its_buffer_passes_a_clean_run_in_every_mode(tmp_path: Path, mode: str) -> None:
    m, x, p = _norm_model(tmp_path)
    m.norm.ema.zero_()  # the state the recording started from
    report = ag.compare(m, x, path=p, replay=mode)
    assert report.ok, str(report)
    assert torch.allclose(m.norm.ema, 0.1 * m.norm.lin(x).mean(0))  # the replay left the live update alone


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_used_before_its_update_is_found_in_every_mode(tmp_path: Path, mode: str) -> None:
    m, x, p = _norm_model(tmp_path)
    m.norm.ema.zero_()
    m.norm.use_before_update = True
    report = ag.compare(m, x, path=p, replay=mode)
    assert not report.ok  # replay="all" once re-ran it on the updated buffer and called it a match
    assert report.first_divergence is not None and report.first_divergence.name == "norm"
    if mode != "off":
        assert report.origin is not None and report.origin.name == "norm"


def test_a_large_buffer_changed_in_place_is_not_replayed_and_says_why(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.replay import callstart

    monkeypatch.setattr(callstart, "SNAPSHOT_NUMEL", 4)  # the 8-element buffer counts as large
    m, x, p = _norm_model(tmp_path)
    m.norm.ema.zero_()
    m.norm.use_before_update = True
    report = ag.compare(m, x, path=p, replay="all")
    assert not report.ok and report.first_divergence is not None and report.first_divergence.name == "norm"
    assert any("changed its buffer 'ema' in place" in n for n in report.notes), report.notes


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()


@pytest.mark.parametrize("mode", MODES)
def test_changed_model_inputs_never_pass_and_are_the_origin(tmp_path: Path, mode: str) -> None:
    m, x = _mlp(), torch.randn(2, 8)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    x2 = x.clone()
    x2[0, 0] += 1.0
    report = ag.compare(m, x2, path=p, replay=mode)
    assert not report.ok  # replay="all" once passed: every layer computes what it did, on other inputs
    if mode != "off":
        assert report.origin is not None and report.origin.kind == "inputs"


def test_changed_inputs_with_gradients_under_replay_all_are_the_inputs(tmp_path: Path) -> None:
    m, x = _mlp(), torch.randn(2, 8)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p, backward=True)
    report = ag.compare(m, x + 0.5, path=p, backward=True, replay="all")
    assert not report.ok and report.origin is not None and report.origin.kind == "inputs"


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s


class PassesAScalar(nn.Module):
    def __init__(self, s: float):
        super().__init__()
        self.fc, self.scale, self.out, self.s = nn.Linear(8, 8), Scale(), nn.Linear(8, 4), s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.scale(self.fc(x), self.s))


@pytest.mark.parametrize("mode", ("first", "all"))
def test_a_changed_number_argument_is_the_callers_code(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    m, x = PassesAScalar(0.5).eval(), torch.randn(2, 8)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    m.s = 0.6
    report = ag.compare(m, x, path=p, replay=mode)
    assert not report.ok
    o = report.origin
    assert o is not None and (o.name, o.kind, o.child) == ("", "parent-code", "scale"), o  # once: 'scale' (layer)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(x)
        return h if mask is None else h * mask


class DropsAMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.child, self.drop_mask = nn.Linear(8, 8), Masked(), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        mask = torch.ones_like(h)
        mask[0, 0] = 0.0
        return self.child(h) if self.drop_mask else self.child(h, mask=mask)


@pytest.mark.parametrize("mode", ("first", "all"))
def test_a_dropped_tensor_argument_is_the_callers_code(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    m, x = DropsAMask().eval(), torch.randn(2, 8)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p)
    m.drop_mask = True
    report = ag.compare(m, x, path=p, replay=mode)
    o = report.origin
    assert not report.ok and o is not None
    assert (o.name, o.kind, o.child) == ("", "parent-code", "child"), o  # once: 'child' (layer)
    assert "kwargs/mask" in o.detail


class ExtraDraw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b, self.extra = nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.extra:
            torch.rand(3)  # the parent's code draws random numbers: the stream shifts
        return self.b(self.drop(h))


def test_a_layer_drawing_random_numbers_says_a_shifted_stream_looks_the_same(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m, x = ExtraDraw().train(), torch.randn(4, 8)
    p = tmp_path / "g.h5"
    torch.manual_seed(1)
    ag.record(m, x, path=p)
    torch.manual_seed(1)
    assert ag.compare(m, x, path=p).ok
    m.extra = True
    torch.manual_seed(1)
    report = ag.compare(m, x, path=p)
    assert not report.ok and report.origin is not None and report.origin.name == "drop"
    assert "draws random numbers" in report.origin.detail and "shift" in report.origin.detail


def test_inputs_only_cast_to_another_dtype_are_a_precision_change_not_new_inputs() -> None:
    """replay="all" is the cross-precision gate: the same inputs in bfloat16 keep it judging each
    layer by its own error; other values, shapes or inputs make the outputs' verdicts stand."""
    from activation_guard.capture.env import input_fingerprint, inputs_replaced

    x = torch.randn(2, 4)
    golden = input_fingerprint((x,), {})
    assert inputs_replaced(golden, input_fingerprint((x,), {})) is False
    # the record holds digests: a dtype change is a cast only if the values say so (the caller checks)
    assert inputs_replaced(golden, input_fingerprint((x.bfloat16(),), {})) is None
    assert inputs_replaced(None, input_fingerprint((x + 1,), {})) is None  # an old golden without the record
    ids = torch.tensor([[1, 2, 3]])
    assert inputs_replaced(input_fingerprint((ids,), {}), input_fingerprint((ids.int(),), {})) is True
    assert inputs_replaced(golden, input_fingerprint((x.long(),), {})) is True
    for live in ((x + 1,), (x[:1],), (x, x), ()):
        assert inputs_replaced(golden, input_fingerprint(live, {})) is True, live
    assert inputs_replaced(golden, input_fingerprint((x,), {"mask": x})) is True


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_replay_all_never_passes_other_inputs_whatever_their_dtype(tmp_path: Path) -> None:
    """replay="all" judges each call by its own computation only when the model got the
    recording's inputs. Found by review, each a false pass before: other token ids passed as
    int32, other values cast to float16, a golden whose meta lost its inputs record, and a change
    in the model's own forward pre-hook (the record is taken before it runs). The same inputs
    cast to float16 are still the cross-precision case."""
    import copy

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    m = _Two().eval()
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p, calibrate=True)
    half = copy.deepcopy(m).half()  # the port: runs in float16 on float16 inputs
    opts: dict[str, Any] = {"tolerance": "calibrated", "replay": "all", "allow_dtype_change": True}
    assert ag.compare(half, x.half(), path=p, **opts).ok  # the same inputs, cast
    other = ag.compare(half, (5 * x).half(), path=p, **opts)
    assert not other.ok and other.first_divergence is not None

    class Emb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lin(self.emb(ids))

    e, pe = Emb().eval(), tmp_path / "e.h5"
    ag.record(e, torch.tensor([[1, 2, 3]]), path=pe)
    assert not ag.compare(e, torch.tensor([[7, 8, 9]], dtype=torch.int32), path=pe, replay="all").ok

    import json
    import zlib

    import h5py
    import numpy as np

    pn = tmp_path / "noinputs.h5"
    ag.record(m, x, path=pn)
    with h5py.File(pn, "r+") as f:  # an edit (or an old golden): no record of the model's inputs
        meta = json.loads(f["meta"][()].tobytes())
        del meta["inputs"]
        raw = json.dumps(meta).encode()
        del f["meta"]
        f.create_dataset("meta", data=np.frombuffer(raw, np.uint8))
        f.attrs["meta_crc32"] = np.int64(zlib.crc32(raw))
    assert ag.compare(m, x, path=pn, replay="all").ok  # the recorded root inputs say they are the same
    assert not ag.compare(m, x + 1, path=pn, replay="all").ok

    k = {"k": 1.0}
    hooked_model = _Two().eval()
    hooked_model.register_forward_pre_hook(lambda mod, args: (args[0] * k["k"],))  # input normalisation
    ph = tmp_path / "hook.h5"
    ag.record(hooked_model, x, path=ph)
    assert ag.compare(hooked_model, x, path=ph, replay="all").ok
    k["k"] = 1.5
    rep = ag.compare(hooked_model, x, path=ph, replay="all")
    assert not rep.ok
    assert any("after its own forward pre-hooks" in n for n in rep.notes), rep.notes


def test_replay_all_with_a_layer_selection_keeps_output_verdicts(tmp_path: Path) -> None:
    """With include/exclude, code outside the selected layers (here layer a, not selected) is
    judged by no layer: replay="all" must not turn b's changed output into a match on b's own
    unchanged computation (found by review: "OK, largest abs diff 0")."""
    import copy

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(4))
    m = _Two().eval()
    full, sub = tmp_path / "full.h5", tmp_path / "sub.h5"
    ag.record(m, x, path=full)
    ag.record(m, x, path=sub, include=["b"])
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        m2.a.weight.mul_(1.1)
    for path, kw in ((sub, {}), (full, {"include": ["b"]})):
        rep = ag.compare(m2, x, path=path, replay="all", **kw)
        assert not rep.ok and rep.first_divergence is not None and rep.first_divergence.name == "b", rep
        assert rep.first_divergence.max_abs_diff is not None and rep.first_divergence.max_abs_diff > 0
        assert any("with a layer selection" in n for n in rep.notes), rep.notes
    assert ag.compare(m, x, path=sub, replay="all").ok
    assert not ag.compare(m2, x, path=full, replay="all").ok


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.norm = nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(32, 64), nn.Linear(64, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.mark.parametrize("calibrated", [False, True])
def test_replay_all_with_some_layers_fingerprinted(tmp_path: Path, calibrated: bool) -> None:
    """A parent whose children are stored as fingerprints cannot be replayed (its children return
    the golden's values during its replay): an unchanged model once failed as 'structure changed'
    at that parent, and a real change elsewhere was reported there."""
    torch.manual_seed(0)
    m, x = Blocks().eval(), torch.randn(4, 16, 32)
    p = tmp_path / "g.h5"
    ag.record(m, x, path=p, fingerprint=["blocks.1.*"], calibrate=calibrated)
    tol = "calibrated" if calibrated else "strict"
    clean = ag.compare(m, x, path=p, replay="all", tolerance=tol)
    assert clean.ok, str(clean)
    assert any("child 'blocks.1.fc1' is stored as a fingerprint" in n for n in clean.notes), clean.notes
    with torch.no_grad():
        m.blocks[2].fc2.weight.mul_(1.01)
    bad = ag.compare(m, x, path=p, replay="all", tolerance=tol)
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.name == "blocks.2.fc2"

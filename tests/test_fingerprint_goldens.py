"""Fingerprint goldens end to end: record, store, compare (strict and calibrated), diff, inspect.

The fingerprint math (sketch, bounds, kernel) is tested in test_fingerprint.py; this file tests
that goldens holding fingerprints behave like goldens: mixed with exact leaves, exact where they
must be (integers, bools, small outputs), corruption reported as corruption naming the file and
layer, first divergences where full goldens put them, reports that say their numbers are
estimates, and round trips through JSON, diff, inspect and textconv.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from golden_edit import index_dict, set_index
from hypothesis import given, settings
from hypothesis import strategies as st
from models import one_thread
from torch import nn

import activation_guard as ag
from activation_guard.comparison import fingerprints as fingerprint_rule
from activation_guard.fingerprints.fingerprint import FingerprintParams, compute_fingerprint
from activation_guard.report.inspect_text import format_inspect, textconv_lines
from activation_guard.report.inspection import inspect_golden
from activation_guard.store import fingerprints as fpstore


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


class Head(nn.Module):
    """Outputs of every kind in one dict: a large float tensor (fingerprinted), large int64 and
    bool tensors and a small float tensor (always exact), a string and None."""

    def forward(self, h: torch.Tensor) -> dict[str, Any]:
        return {"logits": h * 2.0, "ids": h.argmax(-1).repeat(1, 64), "pos": h > 0,
                "small": h[:2, :3].clone(), "tag": "ok", "none": None}


class Net(nn.Module):
    def __init__(self, seed: int = 0, gelu: str = "none", eps: float = 1e-5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.enc = nn.Sequential(nn.Linear(32, 128), nn.GELU(approximate=gelu), nn.Linear(128, 64))
        self.norm = nn.LayerNorm(64, eps=eps)
        self.head = Head()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return self.head(self.norm(self.enc(x)))


X = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))


def kinds(path: Path) -> dict[tuple[str, str], str]:
    with ag.read_golden(path) as r:
        return {(c.name, leaf.path): leaf.kind for c in r.calls for leaf in c.leaves}


@pytest.fixture(scope="module")
def goldens(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fp_goldens")
    out = {"full": d / "full.h5", "fp": d / "fp.h5", "mixed": d / "mixed.h5", "cal": d / "cal.h5"}
    with one_thread():
        ag.record(Net(), X, path=out["full"])
        ag.record(Net(), X, path=out["fp"], fingerprint=True)
        ag.record(Net(), X, path=out["mixed"], fingerprint=["enc.*", "norm"])
        ag.record(Net(), X, path=out["cal"], fingerprint=True, calibrate=True)
    return out


# --------------------------------------------------------------------------- what is stored


def test_mixed_golden_fingerprints_only_the_named_layers(goldens):
    k = kinds(goldens["mixed"])
    assert k[("enc.0", "")] == k[("enc.1", "")] == k[("enc.2", "")] == k[("norm", "")] == "fingerprint"
    assert k[("head", "logits")] == "tensor"  # not named: kept exact
    assert k[("", "logits")] == "tensor"


def test_integers_bools_small_and_non_tensors_stay_exact(goldens):
    k = kinds(goldens["fp"])
    assert k[("head", "logits")] == "fingerprint"
    assert k[("head", "ids")] == "tensor" and k[("head", "pos")] == "tensor"  # 3072 int64 / bool: exact
    assert k[("head", "small")] == "tensor"  # 6 floats: smaller than a fingerprint
    assert k[("head", "tag")] == "str" and k[("head", "none")] == "none"


def test_fingerprint_golden_is_small_reproducible_and_says_how_it_was_made(goldens, tmp_path):
    full, fp = goldens["full"].stat().st_size, goldens["fp"].stat().st_size
    assert fp < full
    again = tmp_path / "again.h5"
    ag.record(Net(), X, path=again, fingerprint=True)
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(goldens["fp"].read_bytes()).digest()
    with ag.read_golden(goldens["mixed"]) as r:
        rec = r.meta["fingerprint"]
        assert rec["layers"] == ["enc.*", "norm"] and rec["version"] == 1
        assert FingerprintParams.from_dict(rec["params"]) == FingerprintParams() == r.fingerprint_params
        assert r.fingerprinted and r.fingerprint_leaves == 4  # enc.0, enc.1, enc.2, norm


def test_fingerprint_params_are_stored_and_used_by_the_compare(tmp_path):
    p = tmp_path / "g.h5"
    s = ag.record(Net(), X, path=p, fingerprint=True, fingerprint_params={"rows": 7, "samples": 16})
    assert s.fingerprints == 8 and "8 of them as fingerprints" in str(s)  # enc.0-2, enc, norm, head, root + its input
    with ag.read_golden(p) as r:
        assert r.fingerprint_params == FingerprintParams(rows=7, samples=16)
        stored = sum(x.nbytes for c in r.calls for x in (*c.leaves, *(c.inputs or ())) if x.kind != "alias")
        assert s.nbytes == stored > 0  # the summary counts fingerprint blobs too (once it said "0 MB stored")
        fp = r.fingerprint(r.by_key[("enc.0", 0)].leaves[0])
        assert fp.sketch.shape == (7, 64) and fp.samples.shape == (16,)
    rep = ag.compare(Net(), X, path=p)
    assert rep.ok
    leaf = rep.layers[0].leaves[0]
    assert leaf.estimate == "l2" and leaf.sketch_rows == 7 and leaf.sampled == 16


def test_unmatched_fingerprint_glob_is_noted(tmp_path):
    s = ag.record(Net(), X, path=tmp_path / "g.h5", fingerprint=["enc.0", "decoder.*"])
    assert s.notes == ["fingerprint pattern 'decoder.*' matched no layer"]
    assert s.fingerprints == 1


# --------------------------------------------------------------------------- compare


def first(rep: ag.Report) -> tuple[str, int] | None:
    fd = rep.first_divergence
    return None if fd is None else (fd.name, fd.call)


@pytest.mark.parametrize("which", ["fp", "mixed", "full"])
def test_unchanged_model_passes_and_the_pass_says_it_is_an_estimate(goldens, which):
    rep = ag.compare(Net(), X, path=goldens[which])
    assert rep.ok, str(rep)
    if which == "full":
        assert rep.fingerprint_text() is None
        return
    est = rep.estimated()
    assert est and all(leaf.estimate == "l2" and leaf.estimated_l2 == 0.0 for leaf in est)
    assert "checked by fingerprint: estimates, false alarm <= 1e-06 each" in rep.headline()
    if which == "fp":
        assert "largest abs diff" in rep.headline()  # the exact int/bool/small leaves were measured


@pytest.mark.parametrize("change,layer", [
    (lambda m: m.enc[2].weight.data.mul_(1.001), "enc.2"),
    (lambda m: setattr(m.enc, "1", nn.GELU(approximate="tanh")), "enc.1"),
    (lambda m: setattr(m.norm, "eps", 1e-3), "norm"),
])
def test_first_divergence_is_the_same_as_with_a_full_golden(goldens, change, layer):
    reports = {}
    for which in ("full", "fp", "mixed"):
        m = Net()
        change(m)
        m.eval()
        reports[which] = ag.compare(m, X, path=goldens[which])
    assert first(reports["full"]) == first(reports["fp"]) == first(reports["mixed"]) == (layer, 0)
    fd = reports["fp"].first_divergence
    assert fd is not None and fd.status == "diverged"
    leaf = next(x for x in fd.leaves if x.status != "match")
    assert leaf.estimate == "l2" and leaf.fingerprint_check is not None
    assert leaf.estimated_l2 is not None and leaf.l2_bound is not None and leaf.estimated_l2 > leaf.l2_bound


def test_report_prints_estimates_from_fields_and_round_trips(goldens):
    m = Net()
    with torch.no_grad():
        m.enc[0].bias.add_(0.05)
    rep = ag.compare(m, X, path=goldens["fp"])
    text = str(rep)
    assert "first divergence at layer 'enc.0'" in text
    assert "estimated ||diff||_2" in text and "(sketch)" in text
    assert "sampled elements outside tolerance" in text
    assert "mismatched    :" not in text  # a fingerprint cannot count mismatches; it never pretends to
    assert "est/limit" in text and "compared by fingerprint" in text
    back = ag.Report.from_dict(json.loads(json.dumps(rep.to_dict())))
    assert str(back) == text
    leaf = rep.first_divergence.leaves[0]  # type: ignore[union-attr]
    again = back.first_divergence.leaves[0]  # type: ignore[union-attr]
    assert again == leaf


def test_a_change_only_the_sketch_sees_is_reported_as_a_sketch_estimate(goldens):
    """1,000 unsampled mid-range elements moved by +-1e-3 (100x atol), signs alternating: no
    sampled element, no max/min and no sum can prove it, but ||diff||_2 is ~50x the bound. The
    sketch fails it, and the report says that is an estimate with its false-alarm bound."""
    from activation_guard.fingerprints.hashing import sample_positions

    with torch.no_grad():
        g = Net().enc(X).reshape(-1)
    big = float(g.abs().max())
    sampled = set(sample_positions(FingerprintParams().seed, g.numel(), FingerprintParams().samples))
    where = [i for i in range(g.numel()) if i not in sampled and abs(float(g[i])) < 0.5 * big][:1000]
    d = torch.zeros(g.numel())
    d[where] = torch.tensor([1e-3 if k % 2 else -1e-3 for k in range(len(where))])

    class Shift(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + d.view(x.shape)

    m = Net()
    m.enc = nn.Sequential(*m.enc, Shift())  # enc.3 shifts; enc (the Sequential) carries the change
    rep = ag.compare(m, X, path=goldens["fp"], include=["enc"])
    (layer,) = rep.layers
    assert layer.status == "diverged"
    leaf = layer.leaves[0]
    assert leaf.fingerprint_check == "sketch" and leaf.mismatched == 0 and leaf.sketch_rows_over >= 3
    assert leaf.estimated_l2 is not None and leaf.l2_bound is not None and leaf.estimated_l2 > 10 * leaf.l2_bound
    text = str(rep)
    assert "a run within tolerance fails the sketch check with probability <= 1e-06" in text
    assert "0 of 64 sampled elements outside tolerance" in text


def test_integer_leaf_is_compared_exactly_inside_a_fingerprint_golden(goldens):
    class OneOff(Head):
        def forward(self, h: torch.Tensor) -> dict[str, Any]:
            out = super().forward(h)
            out["ids"][0, 0] += 1
            return out
    m = Net()
    m.head = OneOff()
    rep = ag.compare(m, X, path=goldens["fp"])
    fd = rep.first_divergence
    assert fd is not None and fd.name == "head"
    bad = [leaf for leaf in fd.leaves if leaf.status != "match"]
    assert [(b.path, b.mismatched, b.estimate) for b in bad] == [("ids", 1, None)]
    assert bad[0].tolerance_source == "int64: exact"


def test_shape_dtype_and_structure_changes_of_a_fingerprinted_output(goldens):
    class Cast(nn.Module):
        def __init__(self, to: Any):
            super().__init__()
            self.to_ = to

        def forward(self, x: torch.Tensor) -> Any:
            return self.to_(x)

    cases = {
        "shape": (lambda x: x[:-1], "shape"),
        "dtype": (lambda x: x.double(), "dtype"),
        "int": (lambda x: x.long(), "dtype"),
        "none": (lambda x: None, "structure"),
    }
    for name, (fn, status) in cases.items():
        m = Net()
        m.norm = nn.Sequential(m.norm, Cast(fn))
        m.head = nn.Identity()  # only norm is compared; what follows must accept any output
        rep = ag.compare(m, X, path=goldens["fp"], include=["norm"], exclude=["norm.*"])
        (layer,) = rep.layers
        assert layer.status == status, (name, str(rep))
    m = Net().double()
    rep = ag.compare(m, X.double(), path=goldens["fp"], allow_dtype_change=True)
    assert rep.ok, str(rep)  # float32 golden fingerprints, float64 live: compared
    assert any("dtype float32 -> float64 allowed" in leaf.detail for leaf in rep.estimated())


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), frac=st.floats(0.0, 0.99))
def test_within_tolerance_noise_never_fails_a_fingerprint_golden(tmp_path_factory, seed, frac):
    """End to end through the comparator: a live output within the element-wise tolerance of the
    golden everywhere (noise up to ``frac`` x atol) passes."""
    d = tmp_path_factory.mktemp("noise")

    class Noisy(nn.Module):
        def __init__(self, amp: float):
            super().__init__()
            self.amp = amp

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed)
            return x + self.amp * (2 * torch.rand(x.shape, generator=g) - 1)

    base = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))
    ag.record(Noisy(0.0), base, path=d / "g.h5", fingerprint=True)
    rep = ag.compare(Noisy(frac * 1e-3), base, path=d / "g.h5", atol=1e-3, rtol=0.0)
    assert rep.ok, str(rep)


def test_live_tensor_is_fingerprinted_where_it_lives(goldens, monkeypatch):
    """The comparator hands the live tensor itself (same object, same device) to the fingerprint
    rule, which fingerprints it there; nothing copies it to the host first."""
    seen: list[torch.Tensor] = []
    real = fingerprint_rule.judge_fingerprint

    def spy(golden: Any, live: Any, *a: Any, **kw: Any) -> Any:
        seen.append(live)
        return real(golden, live, *a, **kw)

    class Keep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.outs: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1.0
            self.outs.append(y)
            return y

    monkeypatch.setattr(fingerprint_rule, "judge_fingerprint", spy)
    m = Net()
    keep = Keep()
    m.norm = nn.Sequential(m.norm, keep)
    ag.compare(m, X, path=goldens["fp"], include=["norm"], exclude=["norm.0"])
    assert len(seen) == 1 and seen[0] is keep.outs[0]


# --------------------------------------------------------------------------- calibrated (L2 form)


def test_calibrated_l2_form_passes_and_catches_an_eps_change(goldens):
    rep = ag.compare(Net(), X, path=goldens["cal"], tolerance="calibrated")
    assert rep.ok, str(rep)
    est = rep.estimated()
    assert est and {leaf.estimate for leaf in est} == {"rms"}
    assert all(leaf.error_multiple is not None and "(L2 form)" in (leaf.tolerance_source or "") for leaf in est)
    bad = ag.compare(Net(eps=1e-2), X, path=goldens["cal"], tolerance="calibrated")
    assert first(bad) == ("norm", 0)
    text = str(bad)
    assert "estimated RMS error" in text and "allowance" in text
    leaf = next(x for x in bad.first_divergence.leaves if x.status != "match")  # type: ignore[union-attr]
    assert leaf.estimate == "rms" and leaf.error_multiple is not None and leaf.error_multiple > 1


def test_calibrated_explicit_pattern_judges_fingerprints_strictly(goldens):
    rep = ag.compare(Net(), X, path=goldens["cal"], tolerance="calibrated", tolerances={"enc.*": {"atol": 1e-4}})
    assert rep.ok
    enc = [leaf for layer in rep.layers if layer.name.startswith("enc.") for leaf in layer.leaves]
    assert enc and all(leaf.estimate == "l2" and leaf.atol == 1e-4 for leaf in enc)
    assert all("a tolerances pattern overrides calibration" in (leaf.tolerance_source or "") for leaf in enc)
    assert any("judged 3 output(s) strictly" in n for n in rep.notes)


def test_calibrated_without_floors_falls_back_to_strict_with_a_note(goldens, tmp_path):
    p = tmp_path / "g.h5"
    shutil.copy(goldens["cal"], p)
    rewrite(p, meta=lambda m: {**m, "calibration": {**m["calibration"], "floors": {}}})
    rep = ag.compare(Net(), X, path=p, tolerance="calibrated")
    assert rep.ok
    assert {leaf.estimate for leaf in rep.estimated()} == {"l2"}
    assert any("had no noise floor and used strict tolerances" in n for n in rep.notes)


# --------------------------------------------------------------------------- diff


def test_diff_full_vs_fingerprint_and_fingerprint_vs_fingerprint(goldens, tmp_path):
    changed_full, changed_fp = tmp_path / "cf.h5", tmp_path / "cfp.h5"
    ag.record(Net(eps=1e-2), X, path=changed_full)
    ag.record(Net(eps=1e-2), X, path=changed_fp, fingerprint=True)
    for golden, other in [("full", "fp"), ("fp", "full"), ("fp", "mixed"), ("mixed", "fp")]:
        rep = ag.diff_recordings(goldens[golden], goldens[other])
        assert rep.ok, (golden, other, str(rep))
        assert rep.estimated()
    expected = first(ag.diff_recordings(goldens["full"], changed_full))
    assert expected == ("norm", 0)
    for golden, other in [(goldens["full"], changed_fp), (goldens["fp"], changed_fp), (goldens["fp"], changed_full)]:
        rep = ag.diff_recordings(golden, other)
        assert first(rep) == expected, str(rep)


def test_diff_of_fingerprints_with_different_parameters_names_the_layer(goldens, tmp_path):
    other = tmp_path / "o.h5"
    ag.record(Net(), X, path=other, fingerprint=True, fingerprint_params={"rows": 3})
    with pytest.raises(ag.ActivationGuardError, match=r"layer 'enc.0' call 0 .*different parameters"):
        ag.diff_recordings(goldens["fp"], other)


def test_full_golden_is_fingerprinted_with_the_recordings_parameters(goldens, tmp_path):
    other = tmp_path / "o.h5"
    ag.record(Net(), X, path=other, fingerprint=True, fingerprint_params={"rows": 3, "buckets": 32})
    rep = ag.diff_recordings(goldens["full"], other)
    assert rep.ok and {leaf.sketch_rows for leaf in rep.estimated()} == {3}


# --------------------------------------------------------------------------- inspect, textconv, replay hook


def test_inspect_and_textconv_show_fingerprint_statistics(goldens):
    full = {(x.layer, x.path): x for x in inspect_golden(goldens["full"]).leaves}
    gi = inspect_golden(goldens["fp"])
    fps = [x for x in gi.leaves if x.kind == "fingerprint"]
    assert len(fps) == 7
    for x in fps:
        ref = full[(x.layer, x.path)].stats
        assert x.stats is not None and ref is not None and x.stats.fingerprint and not ref.fingerprint
        assert x.stats.min == ref.min and x.stats.max == ref.max and x.stats.nonfinite == ref.nonfinite == 0
        assert math.isclose(x.stats.mean, ref.mean, rel_tol=1e-9, abs_tol=1e-12)  # type: ignore[arg-type]
        assert math.isclose(x.stats.std, ref.std, rel_tol=1e-6)  # type: ignore[arg-type]
    text = format_inspect(gi)
    assert "float32 (fp)" in text and "stored as fingerprints, not values" in text
    assert "fingerprint : every layer; 5 x 64 sketch, 64 samples" in text
    lines = list(textconv_lines(goldens["fp"]))
    assert any(line.startswith("# fingerprint params buckets=64") for line in lines)
    assert any(line.startswith("enc.0[0] (output) fingerprint float32 [48,128] sha256:") for line in lines)
    assert any(line.startswith("head[0] ids int64 [1,3072]") for line in lines)  # exact leaves as before


def test_replay_hook_says_a_fingerprint_golden_needs_full_inputs(goldens):
    with ag.read_golden(goldens["full"]) as r:
        assert r.replay_blocker() is None and not any(c.fingerprinted for c in r.calls)
    with ag.read_golden(goldens["fp"]) as r:
        msg = r.replay_blocker()
        assert msg is not None and msg.startswith("replay needs full inputs")
        assert "'enc.1'" in msg and "pytest" not in msg
    with ag.read_golden(goldens["mixed"]) as r:
        # enc.1, enc.2 and head take fingerprinted outputs (aliases of enc.0's, enc.1's, norm's); enc.0
        # and norm take full values (the model input; enc's output, stored in full): they can be replayed
        msg = r.replay_blocker()
        assert msg is not None and "the inputs of 3 layer calls ('enc.1', 'enc.2', 'head')" in msg
        assert [c.name for c in r.calls if c.fingerprinted] == ["enc.0", "enc.1", "enc.2", "norm"]
        assert all(leaf.is_fingerprint for leaf in r.by_key[("norm", 0)].leaves)


def test_replay_attributes_where_inputs_are_full_and_says_why_not_elsewhere(goldens):
    rep = ag.compare(Net(eps=1e-2), X, path=goldens["mixed"])  # norm: full inputs, fingerprinted output
    assert rep.origin is not None and (rep.origin.name, rep.origin.kind) == ("norm", "layer")
    rep = ag.compare(Net(eps=1e-2), X, path=goldens["fp"])  # norm's input is a fingerprint too
    assert rep.origin is not None and (rep.origin.name, rep.origin.kind) == ("norm", "unknown")
    assert "replay needs full inputs, but its input args/0 is stored as a fingerprint" in rep.origin.detail


# --------------------------------------------------------------------------- damaged and forged files


def rewrite(path: Path, *, index: Any = None, meta: Any = None, pack: Any = None) -> None:
    """Edit a golden in place, keeping every checksum valid (a forged file, not a damaged one)."""
    with h5py.File(path, "r+") as f:
        if index is not None:
            set_index(f, index(index_dict(f)))
        for key, fn in (("meta", meta),):
            if fn is None:
                continue
            obj = fn(json.loads(f[key][()].tobytes()))
            raw = fpstore_json(obj)
            del f[key]
            f.create_dataset(key, data=np.frombuffer(raw, dtype=np.uint8), track_times=False)
            f.attrs[f"{key}_crc32"] = np.int64(zlib.crc32(raw))
        if pack is not None:
            data = f["packs/0000"][()]
            pack(data)
            f["packs/0000"][...] = data


def fpstore_json(obj: Any) -> bytes:
    from activation_guard.store import json_bytes

    return json_bytes(obj)


def fp_entry(index: dict[str, Any], layer: str) -> dict[str, Any]:
    call = next(c for c in index["calls"] if c["name"] == layer)
    return call["leaves"][0]


def entry_of(path: Path, layer: str) -> dict[str, Any]:
    with h5py.File(path, "r") as f:
        return fp_entry(index_dict(f), layer)


def test_flipped_bit_in_a_fingerprint_is_corruption_naming_file_and_layer(goldens, tmp_path):
    p = tmp_path / "g.h5"
    shutil.copy(goldens["fp"], p)
    e = entry_of(p, "enc.2")

    def flip(data: np.ndarray) -> None:
        data[e["offset"] + 100] ^= 0x10

    rewrite(p, pack=flip)
    with pytest.raises(ag.GoldenCorruptError) as ei:
        ag.compare(Net(), X, path=p)
    msg = str(ei.value)
    assert str(p) in msg and "layer 'enc.2' call 0" in msg and "checksum" in msg
    with pytest.raises(ag.GoldenCorruptError, match=r"enc\.2"):
        inspect_golden(p)


def test_forged_fingerprint_that_passes_its_checksum_is_a_format_error(goldens, tmp_path):
    """Valid CRC, impossible content (counts that do not add up): not written by activation_guard."""
    p = tmp_path / "g.h5"
    shutil.copy(goldens["fp"], p)
    e = entry_of(p, "norm")
    params = FingerprintParams()
    lay = fpstore.layout("float32", tuple(e["shape"]), params)
    counts_at = e["offset"] + sum(dt.itemsize * int(np.prod(s)) for name, dt, s in lay[:3])
    blob = bytearray()

    def forge(data: np.ndarray) -> None:
        counts = data[counts_at : counts_at + 40].view("<i8")
        counts[1] += 1  # one more NaN than there are values
        blob.extend(data[e["offset"] : e["offset"] + e["nbytes"]].tobytes())

    rewrite(p, pack=forge)

    def fix_crc(index: dict[str, Any]) -> dict[str, Any]:
        fp_entry(index, "norm")["crc32"] = zlib.crc32(bytes(blob))
        return index

    rewrite(p, index=fix_crc)
    with pytest.raises(ag.GoldenFormatError) as ei:
        ag.compare(Net(), X, path=p)
    msg = str(ei.value)
    assert str(p) in msg and "layer 'norm' call 0" in msg and "counts" in msg


@pytest.mark.parametrize("case,words", [
    ("size", "fingerprint record has"),
    ("dtype", "only float and complex are fingerprinted"),
    ("location", "malformed pack location"),
    ("no params", "no 'fingerprint' record"),
    ("bad params", "invalid fingerprint parameters"),
    ("newer", "newer than this activation_guard"),
])
def test_malformed_fingerprint_records_fail_at_open(goldens, tmp_path, case, words):
    p = tmp_path / "g.h5"
    shutil.copy(goldens["fp"], p)

    def index(ix: dict[str, Any]) -> dict[str, Any]:
        e = fp_entry(ix, "enc.0")
        if case == "size":
            e["nbytes"] += 8
        elif case == "dtype":
            e["dtype"] = "int32"
        elif case == "location":
            del e["pack"]
        return ix

    def meta(m: dict[str, Any]) -> dict[str, Any]:
        if case == "no params":
            del m["fingerprint"]
        elif case == "bad params":
            m["fingerprint"]["params"]["rows"] = 4
        elif case == "newer":
            m["fingerprint"]["version"] = 99
        return m

    rewrite(p, index=index, meta=meta)
    with pytest.raises(ag.GoldenFormatError) as ei:
        ag.read_golden(p)
    assert str(p) in str(ei.value) and words in str(ei.value)


def test_blob_codec_round_trips_every_float_kind():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64):
        t = torch.randn(40, 50, generator=torch.Generator().manual_seed(2)).to(dtype)
        fp = compute_fingerprint(t)
        raw = fpstore.encode(fp)
        assert len(raw) == fpstore.blob_nbytes(fp.dtype, fp.shape, fp.params)
        back = fpstore.decode(np.frombuffer(raw, dtype=np.uint8), fp.dtype, fp.shape, fp.params)
        assert back.identical(fp)


def test_compare_models_style_reuse_keeps_the_model(goldens):
    """A compare against a fingerprint golden leaves the model and its outputs untouched."""
    m = Net()
    before = copy.deepcopy(m.state_dict())
    out = ag.compare(m, X, path=goldens["fp"]).output
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert torch.equal(out["logits"], Net()(X)["logits"])


def test_a_sample_failure_with_a_note_says_which_check_failed_first(tmp_path: Path) -> None:
    """A note (the allowed dtype change) was once the whole "what" line of a failing fingerprint."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256)).eval()
    x = torch.randn(16, 64)
    p = tmp_path / "fp.h5"
    ag.record(model, x, path=p, fingerprint=True)
    bad = copy.deepcopy(model).bfloat16()
    with torch.no_grad():
        bad[0].weight.mul_(2.0)
    report = ag.compare(bad, x.bfloat16(), path=p, allow_dtype_change=True)
    fd = report.first_divergence
    assert fd is not None and not report.ok
    assert fd.detail is not None and fd.detail.startswith("64 of 64 sampled elements outside tolerance (certain)")
    assert fd.detail.endswith("dtype float32 -> bfloat16 allowed")


def test_inspect_never_shows_a_std_lost_to_rounding_as_zero() -> None:
    from activation_guard.report.inspection import fingerprint_stats
    gen = torch.Generator().manual_seed(0)
    close = 1e4 + 1e-4 * torch.randn(100_000, generator=gen, dtype=torch.float64)
    assert fingerprint_stats(compute_fingerprint(close)).std is None  # sum x^2/n - mean^2 is all rounding
    spread = torch.randn(100_000, generator=gen, dtype=torch.float64)
    assert fingerprint_stats(compute_fingerprint(spread)).std == pytest.approx(float(spread.std(unbiased=False)))
    assert fingerprint_stats(compute_fingerprint(torch.full((1000,), 3.0))).std == 0.0


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.act = torch.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def test_the_fingerprint_note_counts_each_output_once_with_replays(tmp_path: Path) -> None:
    """A replay compares the replayed call's output again: the note once counted it twice."""
    torch.manual_seed(0)
    model = nn.Sequential(_Blk()).eval()
    x = torch.randn(16, 64)
    p = tmp_path / "fp.h5"
    ag.record(model, x, path=p, fingerprint=["0"])  # only the block's own output is fingerprinted
    bad = copy.deepcopy(model)
    bad[0].act = torch.tanh  # the block's own code changed: its replay judges its output again
    report = ag.compare(bad, x, path=p, replay="all")
    assert not report.ok and report.origin is not None and report.origin.name == "0", str(report)
    notes = [n for n in report.notes if "compared by fingerprint" in n]
    assert notes and notes[0].startswith("1 outputs were compared by fingerprint"), report.notes

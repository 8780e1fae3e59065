"""The `activation-guard` command line on real goldens: demo, inspect, diff, textconv, errors."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import activation_guard as ag
from activation_guard.api.demo import BUGS, build, run_demo
from activation_guard.api.diff import diff_recordings as diff
from activation_guard.cli import main
from activation_guard.report.inspection import tensor_stats
from activation_guard.store import FORMAT_VERSION


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    """golden.h5 (reference) and refactored.h5 (LayerNorm eps bug) from the built-in demo."""
    return run_demo(tmp_path_factory.mktemp("demo"), "layernorm-eps")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# --------------------------------------------------------------------------- demo


def test_demo_finds_the_injected_bug_and_keeps_files(tmp_path, capsys):
    rc, out, err = run(capsys, "demo", "--out", tmp_path / "d")
    assert rc == 0, out + err
    assert "first divergence at layer 'blocks.1.norm2' (LayerNorm) call 0, #18 of 37" in out
    assert re.search(r"max abs diff  : \d\.\d\de-0\d at index \(\d, \d, \d+\): golden -?\d", out)
    assert "re-ran the unchanged model against it: OK" in out
    assert "torch.allclose(rtol=1e-3, atol=1e-3) passes" in out  # the bug is quiet end to end
    assert "demo OK" in out
    assert (tmp_path / "d" / "golden.h5").is_file() and (tmp_path / "d" / "refactored.h5").is_file()
    assert f"diff {tmp_path / 'd' / 'golden.h5'} {tmp_path / 'd' / 'refactored.h5'}" in out


def test_demo_gelu_bug_without_out_leaves_nothing_behind(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc, out, _ = run(capsys, "demo", "--bug", "gelu-tanh")
    assert rc == 0
    assert "first divergence at layer 'blocks.1.mlp.act' (GELU)" in out
    assert "pass --out DIR" in out
    assert list(tmp_path.iterdir()) == []  # the temporary folder was removed


def test_demo_bug_layers_are_what_each_bug_changes(tmp_path):
    for name, bug in BUGS.items():
        res = run_demo(tmp_path / name, name)
        assert res.worked, (name, res.report.first_divergence)
        fd = res.report.first_divergence
        assert fd is not None and fd.name == bug.layer and fd.status == "diverged"
        # every layer before the bug matches exactly, every layer depending on it diverges
        assert all(x.ok and x.max_abs_diff == 0 for x in res.report.layers[: fd.position])
        assert not res.report.layers[-1].ok


def test_demo_out_must_be_a_folder(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, out, err = run(capsys, "demo", "--out", f)
    assert rc == 2 and out == "" and err == (f"activation-guard: error: --out {f}: is a file; "
                                             "give a folder (it is created if needed)\n")


def test_demo_is_deterministic():
    m1, x1 = build(0)
    m2, x2 = build(0)
    assert torch.equal(x1, x2)
    assert torch.equal(m1(x1), m2(x2))


# --------------------------------------------------------------------------- inspect


def test_inspect_shows_metadata_and_every_layer(demo, capsys):
    rc, out, _ = run(capsys, "inspect", demo.golden)
    assert rc == 0
    assert "model class : activation_guard.api.demo.TinyTransformer (eval mode)" in out
    assert f"torch {torch.__version__}" in out
    assert re.search(r"inputs      : args/0: float32 \[2,8,32\] sha256:[0-9a-f]{16}", out)
    assert "float32_matmul_precision=" in out and "deterministic_algorithms=" in out
    assert "37 layer calls, 37 outputs, in execution order" in out
    rows = [ln for ln in out.splitlines() if re.match(r"\s*\d+  ", ln)]
    assert len(rows) == 37
    names = [r.split()[1] for r in rows]
    assert names[0] == "embed" and names[-1] == "<root>" and names.index("blocks.1.norm2") == 17
    norm = next(r for r in rows if r.split()[1] == "blocks.1.norm2").split()
    # layer, call, type, path, dtype, shape, min, max, mean, std, nonfinite
    assert norm[2:7] == ["0", "LayerNorm", "(output)", "float32", "[2,8,32]"]
    assert float(norm[10]) == pytest.approx(1.0, abs=1e-3)  # a LayerNorm output has std ~1
    assert norm[11] == "0"


def test_inspect_layer_filter_and_json_stats_are_right(demo, capsys):
    rc, out, _ = run(capsys, "inspect", demo.golden, "--layer", "blocks.1.*", "--json")
    assert rc == 0
    d = json.loads(out)
    names = [x["layer"] for x in d["leaves"]]
    assert names and all(n.startswith("blocks.1.") for n in names)
    assert "blocks.1" not in names and "blocks.0.norm1" not in names
    assert d["meta"]["model_class"] == "activation_guard.api.demo.TinyTransformer"
    leaf = next(x for x in d["leaves"] if x["layer"] == "blocks.1.mlp.act")
    with ag.read_golden(demo.golden) as r:
        entry = next(c for c in r.calls if c.name == "blocks.1.mlp.act")
        t = r.load(entry.leaves[0]).double()
    s = leaf["stats"]
    assert leaf["shape"] == [2, 8, 128] and leaf["dtype"] == "float32" and s["numel"] == 2048
    assert s["min"] == pytest.approx(float(t.min())) and s["max"] == pytest.approx(float(t.max()))
    assert s["mean"] == pytest.approx(float(t.mean()), abs=1e-12)
    assert s["std"] == pytest.approx(float(t.std(unbiased=False)), rel=1e-9)
    assert s["nonfinite"] == 0 and len(s["sha256"]) == 64


def test_inspect_layer_filter_matching_nothing_exits_1(demo, capsys):
    rc, out, _ = run(capsys, "inspect", demo.golden, "--layer", "decoder.*")
    assert rc == 1 and "no layer matches 'decoder.*'" in out


class _NaNs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.act(self.lin(x))
        return {"log": torch.log(h - 0.5), "n": torch.tensor(3), "h": h}


def test_inspect_counts_nonfinite_and_names_the_first(tmp_path, capsys):
    torch.manual_seed(0)
    p = tmp_path / "nan.h5"
    ag.record(_NaNs(), (torch.randn(3, 4),), path=p)
    rc, out, _ = run(capsys, "inspect", p)
    assert rc == 0
    row = next(ln for ln in out.splitlines() if " log " in ln)
    assert int(row.split()[-1]) > 0
    assert "first NaN/Inf in execution order: layer '<root>' call 0 output log" in out
    rc, out, _ = run(capsys, "inspect", p, "--json")
    leaves = {x["path"]: x for x in json.loads(out)["leaves"] if x["layer"] == ""}
    assert leaves["n"]["dtype"] == "int64" and leaves["n"]["stats"]["mean"] == 3.0
    assert leaves["log"]["stats"]["nonfinite"] > 0


@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=40),
                  elements=st.floats(-1e6, 1e6, width=32) | st.sampled_from([math.nan, math.inf, -math.inf])))
def test_tensor_stats_match_numpy_over_finite_values(a):
    s = tensor_stats(torch.from_numpy(a.copy()))
    fin = a[np.isfinite(a)].astype(np.float64)
    assert s.numel == a.size and s.nonfinite == a.size - fin.size
    if fin.size == 0:
        assert s.min is None and s.mean is None
    else:
        assert s.min == fin.min() and s.max == fin.max()
        assert s.mean == pytest.approx(fin.mean(), rel=1e-9, abs=1e-6)
        assert s.std == pytest.approx(fin.std(), rel=1e-7, abs=1e-6)


# --------------------------------------------------------------------------- diff


def test_diff_reports_first_divergence_and_exits_1(demo, capsys):
    rc, out, _ = run(capsys, "diff", demo.golden, demo.refactored)
    assert rc == 1
    assert out.startswith("activation_guard: first divergence at layer 'blocks.1.norm2' (LayerNorm) call 0, #18 of 37")
    assert f"live values read from the recording {demo.refactored}" in out
    assert re.search(r"mismatched    : \d+ / 512 elements", out)
    assert "tolerance     : rtol=1.3e-06, atol=1e-05 (float32 default)" in out


def test_diff_is_the_compare_engine(demo):
    """diff of two recordings gives the same verdicts and numbers as the live compare did."""
    rep = diff(demo.golden, demo.refactored)
    live = demo.report
    strip = ("leaves", "own_status", "own_max_abs_diff", "own_max_rel_diff")  # diff has no model to replay
    assert [{k: v for k, v in x.to_dict().items() if k not in strip} for x in rep.layers] == \
           [{k: v for k, v in x.to_dict().items() if k not in strip} for x in live.layers]
    assert rep.first_divergence is not None and rep.first_divergence.name == "blocks.1.norm2"


def test_diff_names_b_as_the_recording_when_b_is_not_readable(demo, capsys, tmp_path):
    """B is the recording being checked: 'golden B ... re-record the golden' pointed at the wrong
    file (found by review)."""
    folder, text = tmp_path / "adir", tmp_path / "notes.txt"
    folder.mkdir()
    text.write_text("x")
    for b, why in ((folder, "is a directory"), (text, "is not a readable HDF5 file")):
        rc, _, err = run(capsys, "diff", demo.golden, b)
        assert rc == 2 and f"recording {b}: {why}" in err and "re-record the golden" not in err, err
        assert f"the recording to check against the golden {demo.golden}" in err


def test_diff_identical_exits_0(demo, capsys):
    rc, out, _ = run(capsys, "diff", demo.golden, demo.golden)
    assert rc == 0 and out.startswith("activation_guard: OK, 37 layer calls match")


def test_diff_json(demo, capsys):
    rc, out, _ = run(capsys, "diff", demo.golden, demo.refactored, "--json")
    assert rc == 1
    d = json.loads(out)
    assert d["ok"] is False and d["other"] == str(demo.refactored)
    assert d["first_divergence"] == {"name": "blocks.1.norm2", "call": 0, "status": "diverged", "position": 17,
                                   "number": 18, "number_in": "execution order"}
    assert d["counts"] == {"diverged": 20, "match": 17}
    first = next(x for x in d["layers"] if x["name"] == "blocks.1.norm2")
    assert 1e-3 < first["max_abs_diff"] < 1e-2


def test_diff_tolerance_options(demo, capsys, tmp_path):
    assert run(capsys, "diff", demo.golden, demo.refactored, "--atol", "0.01")[0] == 0
    tol = tmp_path / "tol.json"
    tol.write_text(json.dumps({"*": {"rtol": 0, "atol": 0.01}}))
    assert run(capsys, "diff", demo.golden, demo.refactored, "--tolerances", tol)[0] == 0
    # a per-layer loosening moves the first divergence to the next layer
    tol.write_text(json.dumps({"blocks.1.norm2": [0.1, 0.1]}))
    rc, out, _ = run(capsys, "diff", demo.golden, demo.refactored, "--tolerances", tol)
    assert rc == 1 and "first divergence at layer 'blocks.1.mlp.fc1'" in out
    rc, out, _ = run(capsys, "diff", demo.golden, demo.refactored,
                     "--exclude", "blocks.1.norm2", "--exclude", "blocks.1.mlp*")
    assert rc == 1 and "first divergence at layer 'blocks.1' (Block)" in out


def test_diff_notes_input_and_structure_changes(tmp_path, capsys):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    ag.record(m, (x,), path=tmp_path / "a.h5")
    ag.record(m, (x + 1,), path=tmp_path / "b.h5")
    rc, out, _ = run(capsys, "diff", tmp_path / "a.h5", tmp_path / "b.h5")
    assert (rc == 1 and "inputs differ from the recording" in out
            and "input args/0: same dtype and shape, different values" in out)
    m2 = torch.nn.Sequential(m[0], m[1], torch.nn.Linear(4, 2))  # same weights, one layer added
    ag.record(m2, (x,), path=tmp_path / "c.h5")
    rc, out, _ = run(capsys, "diff", tmp_path / "a.h5", tmp_path / "c.h5", "--json")
    d = json.loads(out)
    assert rc == 1 and d["first_divergence"]["name"] == "2"
    assert {x["name"]: x["status"] for x in d["layers"]} == {"0": "match", "1": "match", "2": "unexpected", "": "shape"}


def test_diff_bad_options_exit_2_naming_the_option(demo, capsys, tmp_path):
    bad = tmp_path / "t.json"
    for content, head, needle in [
        ("{nope", f"tolerances file {bad}: ", "is not valid JSON"),
        ("[1, 2]", f"tolerances file {bad}: ", "must hold a JSON object"),
        ('{"x": {"rtol": -1}}', "option tolerances=",
         f"(--tolerances {bad}): tolerances['x']: rtol must be a finite number >= 0"),
    ]:
        bad.write_text(content)
        rc, out, err = run(capsys, "diff", demo.golden, demo.refactored, "--tolerances", bad)
        assert rc == 2 and out == ""
        assert err.startswith(f"activation-guard: error: {head}") and needle in err
    rc, _, err = run(capsys, "diff", demo.golden, demo.refactored, "--tolerances", tmp_path / "none.json")
    assert rc == 2 and "none.json: does not exist" in err
    rc, _, err = run(capsys, "diff", demo.golden, demo.refactored, "--rtol", "nan")
    assert rc == 2 and "option rtol='nan' (--rtol): must be a finite number >= 0, got nan" in err
    rc, out, err = run(capsys, "diff", demo.golden, demo.refactored, "--include", "blokcs.*")
    assert rc == 2 and out == "" and "selected no layer call" in err  # not "OK, 0 layer calls match"
    rc, _, err = run(capsys, "diff", demo.golden, demo.refactored, "--plot", tmp_path / "no" / "p.png")
    assert rc == 2 and "--plot" in err and "does not exist" in err
    with pytest.raises(SystemExit) as e:
        main(["diff", str(demo.golden)])
    assert e.value.code == 2


# --------------------------------------------------------------------------- textconv


def _textconv(capsys, path) -> list[str]:
    rc, out, _ = run(capsys, "textconv", path)
    assert rc == 0
    return out.splitlines()


def test_textconv_is_stable_and_line_per_leaf(demo, capsys, tmp_path):
    lines = _textconv(capsys, demo.golden)
    body = [ln for ln in lines if not ln.startswith("#")]
    assert len(body) == 37
    assert lines[0] == f"# activation_guard golden, format {FORMAT_VERSION}, 37 layer calls"
    assert re.fullmatch(r"blocks\.1\.norm2\[0\] \(output\) float32 \[2,8,32\] sha256:[0-9a-f]{16} "
                        r"min=\S+ max=\S+ mean=\S+ std=\S+ nonfinite=0", body[17])
    # re-recording the same model gives the same text, whatever file it is in
    model, x = build(0)
    ag.record(model, (x,), path=tmp_path / "again.h5")
    assert _textconv(capsys, tmp_path / "again.h5") == lines


def test_textconv_diff_shows_exactly_the_changed_layers(demo, capsys):
    a = _textconv(capsys, demo.golden)
    b = _textconv(capsys, demo.refactored)
    changed = {ln[1:].split("[")[0] for ln in difflib.unified_diff(a, b, lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))}
    diverged = {x.name or "<root>" for x in demo.report.layers if not x.ok}
    assert changed == diverged and "blocks.1.norm2" in changed and "blocks.1.norm1" not in changed


# --------------------------------------------------------------------------- errors


def _newer(src: Path, dst: Path) -> Path:
    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        f.attrs["ag_format_version"] = np.int64(99)
    return dst


@pytest.fixture
def bad_files(demo, tmp_path):
    lfs = tmp_path / "lfs.h5"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 138262\n")
    noth5 = tmp_path / "notes.h5"
    noth5.write_text("just some text\n")
    return {
        "missing": (tmp_path / "missing.h5", "does not exist"),
        "not hdf5": (noth5, "HDF5"),
        "lfs": (lfs, "git lfs pull"),
        "newer": (_newer(Path(demo.golden), tmp_path / "newer.h5"), "newer"),
        "folder": (tmp_path, "directory"),
    }


@pytest.mark.parametrize("kind", ["missing", "not hdf5", "lfs", "newer", "folder"])
def test_unusable_files_exit_2_with_one_clean_line(demo, bad_files, capsys, kind):
    path, needle = bad_files[kind]
    for argv in (["inspect", path], ["inspect", path, "--json"], ["textconv", path],
                 ["diff", path, demo.golden], ["diff", demo.golden, path]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2, argv
        assert out == ""
        who = "recording" if argv[0] == "diff" and argv[-1] == path else "golden"  # B: the recording checked
        assert err.count("\n") == 1 and err.startswith(f"activation-guard: error: {who} {path}: ")
        assert needle in err and "Traceback" not in err


# --------------------------------------------------------------------------- real processes


def _python_m(*argv: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "activation_guard", *map(str, argv)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.slow
def test_python_m_diff_and_error_in_a_real_process(demo, tmp_path):
    p = _python_m("diff", demo.golden, demo.refactored)
    assert p.returncode == 1, p.stderr
    assert "first divergence at layer 'blocks.1.norm2' (LayerNorm)" in p.stdout
    p = _python_m("inspect", tmp_path / "nope.h5")
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"activation-guard: error: golden {tmp_path / 'nope.h5'}: ")
    assert "does not exist" in lines[0]


@pytest.mark.parametrize("option", ["--plot", "--html"])
def test_diff_never_writes_a_report_over_a_golden(demo, tmp_path, capsys, option):
    """`diff a.h5 b.h5 --plot b.h5` once replaced b.h5 with a PNG."""
    import hashlib
    import shutil

    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    shutil.copy(demo.golden, a)
    shutil.copy(demo.refactored, b)
    other = tmp_path / "other.h5"
    shutil.copy(demo.golden, other)
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b, other)}
    for target, why in ((b, "is another file of this command"), (a, "is another file of this command"),
                        (other, "is an HDF5 file (a golden?)")):
        rc, _, err = run(capsys, "diff", a, b, option, target)
        assert rc == 2 and f"{option} {target}: {why}" in err, err
    if option == "--html":
        rc, _, err = run(capsys, "diff", a, b, "--plot", tmp_path / "r.png", "--html", tmp_path / "r.png")
        assert rc == 2 and "is another file of this command" in err
    assert before == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b, other)}
    rc, _, err = run(capsys, "diff", a, b, option, tmp_path / "report.out")  # an ordinary file name: written
    assert rc == 1 and (tmp_path / "report.out").stat().st_size > 0


def test_an_output_that_cannot_be_written_exits_2_not_1(demo, capsys, monkeypatch):
    """1 means "diverged": a full disk while printing matching recordings once exited 1, with a traceback."""
    import errno

    class Full:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["diff", str(demo.golden), str(demo.golden), "--json"]) == 2
    assert "cannot write the output: No space left on device" in capsys.readouterr().err


def test_diff_names_a_missing_second_recording_as_the_recording(demo, tmp_path, capsys):
    rc, _, err = run(capsys, "diff", demo.golden, tmp_path / "absent.h5")
    assert rc == 2 and f"recording {tmp_path / 'absent.h5'}: file does not exist" in err
    assert "re-record the golden" not in err


def test_diff_reports_mode_changes_and_a_selective_golden_as_compare_does(tmp_path):
    """diff said nothing of a recording made in another mode, nor of a golden that holds only some
    layers (found by review); docs/cli.md says differences are reported first, as in compare."""
    torch.manual_seed(0)
    m, x = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.0)), torch.randn(2, 3)
    ag.record(m.eval(), (x,), path=tmp_path / "a.h5", include=["0"])
    ag.record(m.train(), (x,), path=tmp_path / "b.h5", include=["0"])
    rep = diff(tmp_path / "a.h5", tmp_path / "b.h5")
    assert rep.mode_changes == ["golden recorded in eval mode; the other recording was in training mode: dropout "
                                "and batch-norm statistics differ"]
    assert any("holds only those layers' outputs" in n for n in rep.notes)

"""The compare/record spec: one validation path, one error format, and what explicit numbers mean
in calibrated mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import tiny_mlp
from torch import nn

import activation_guard as ag
from activation_guard._core.errors import OptionError
from activation_guard.cli import main
from activation_guard.options.spec import OPTIONS, CompareSpec, RecordSpec, build_specs

X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))

BAD = [
    ("rtol", -1, "must be a finite number >= 0, got -1"),
    ("rtol", "abc", "must be a number, got 'abc'"),
    ("atol", float("nan"), "must be a finite number >= 0, got nan"),
    ("tolerances", {"a.*": {"rtool": 1}},
     "tolerances['a.*']: unknown keys ['rtool']; use rtol and atol, or min_sqnr_db"),
    ("tolerances", {"*": {"min_sqnr_db": -3}}, "tolerances['*']: min_sqnr_db must be a finite number >= 0, got -3"),
    ("tolerances", {"lm_head": {"min_sqnr_db": float("nan")}},
     "tolerances['lm_head']: min_sqnr_db must be a finite number >= 0, got nan"),
    ("tolerances", {"*": {"min_sqnr_db": float("inf")}},
     "tolerances['*']: min_sqnr_db must be a finite number >= 0, got inf"),
    ("tolerances", {"*": {"min_sqnr_db": "loud"}}, "tolerances['*']: min_sqnr_db must be a number, got 'loud'"),
    ("tolerances", {"*": {"min_sqnr_db": True}}, "tolerances['*']: min_sqnr_db must be a number, got True"),
    ("tolerances", {"*": {"min_sqnr_db": None}}, "tolerances['*']: min_sqnr_db must be a number of dB, got None"),
    ("tolerances", {"fc": {"min_sqnr_db": 30, "rtol": 1e-3}},
     "tolerances['fc'] sets min_sqnr_db and rtol/atol: a layer is judged by one rule, its SQNR or its elements; "
     "give them to separate patterns"),
    ("metric", "snr", "must be None or 'sqnr' or 'cosine' or 'mse' or 'rel_l2', got 'snr'"),
    ("tolerances", {"a": 0.1}, "tolerances['a'] must be a dict(rtol=..., atol=...) or an (rtol, atol) pair, got 0.1"),
    ("include", [3], "must contain glob strings, got 3"),
    ("exclude", 5, "must be a glob string or a list of them, got 5"),
    ("rename", {"a.*": "b.*.*"}, "rename['a.*']: the target 'b.*.*' must use as many wildcards as the pattern"),
    ("fail_fast", "maybe", "must be True or False, got 'maybe'"),
    ("tolerance", "loose", "must be 'strict' or 'calibrated', got 'loose'"),
    ("compression", "zip", "must be None or 'gzip' or 'lzf', got 'zip'"),
]


@pytest.mark.parametrize(("option", "value", "problem"), BAD)
def test_every_bad_value_gets_one_message_naming_option_value_and_source(option: str, value: Any, problem: str) -> None:
    for source in ("argument", "marker", "check()", "ini ag_x", "--ag-x"):
        with pytest.raises(OptionError) as ei:
            build_specs({option: value}, {option: source})
        e = ei.value
        assert (e.option, e.source, e.problem) == (option, source, problem)
        assert str(e).startswith(f"option {option}=") and str(e).endswith(f"({source}): {problem}")
        assert isinstance(e, ValueError) and isinstance(e, TypeError)  # code catching either still works


def _api_problem(tmp_path: Path, **bad: Any) -> str:
    p = tmp_path / "g.h5"
    if not p.exists():
        ag.record(tiny_mlp(depth=2), X, path=p)
    compare_keys = {k for k in bad if OPTIONS[k].compare}
    with pytest.raises(OptionError) as ei:
        if compare_keys:
            ag.compare(tiny_mlp(depth=2), X, path=p, **bad)
        else:
            ag.record(tiny_mlp(depth=2), X, path=tmp_path / "new.h5", **bad)
    assert not (tmp_path / "new.h5").exists()  # refused before anything ran
    return ei.value.problem


def test_the_api_and_the_cli_give_the_same_problem_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _api_problem(tmp_path, rtol=-1) == "must be a finite number >= 0, got -1"
    assert _api_problem(tmp_path, compression="zip") == "must be None or 'gzip' or 'lzf', got 'zip'"
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    ag.record(tiny_mlp(depth=2), X, path=a)
    ag.record(tiny_mlp(depth=2), X, path=b)
    assert main(["diff", str(a), str(b), "--rtol", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "activation-guard: error: option rtol='-1' (--rtol): must be a finite number >= 0, got -1"


def test_text_values_and_python_values_are_one_value() -> None:
    from_ini = CompareSpec.build({"rtol": "1e-3", "fail_fast": "true"}, "ini")
    from_api = CompareSpec.build({"rtol": 1e-3, "fail_fast": True})
    assert from_ini == from_api
    assert CompareSpec.build({"rtol": np.float32(0.5), "atol": np.int64(1)}).rtol == 0.5  # any real number


def test_specs_are_frozen_and_remember_where_options_came_from() -> None:
    rec, cmp_ = build_specs({"rtol": 1e-3, "include": "a.*", "compression": "lzf"},
                            {"rtol": "marker", "include": "check()", "compression": "--ag-x"})
    assert rec == RecordSpec(include=("a.*",), compression="lzf")
    assert cmp_.include == ("a.*",) and cmp_.rtol == 1e-3
    assert cmp_.source("rtol") == "marker" and cmp_.source("atol") == "default"
    assert cmp_.describe() == "include='a.*' (check()), rtol=0.001 (marker)"
    with pytest.raises(AttributeError):
        cmp_.rtol = 1.0  # type: ignore[misc]


def test_an_unknown_option_names_itself_and_its_source() -> None:
    with pytest.raises(OptionError, match=r"option nope=1 \(marker\): is not an activation_guard option"):
        build_specs({"nope": 1}, "marker")
    with pytest.raises(OptionError, match=r"option compression='lzf' \(argument\): is not an option of CompareSpec"):
        CompareSpec.build({"compression": "lzf"})


# --------------------------------------------------------------------------- calibrated mode


class Scale(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.k


def _scaled(k: float) -> Scale:
    torch.manual_seed(0)
    return Scale(k)


@pytest.fixture
def calibrated_golden(tmp_path: Path) -> Path:
    p = tmp_path / "cal.h5"
    ag.record(_scaled(1.0), X, path=p, calibrate=True)
    return p


def test_calibrated_mode_judges_a_layer_named_by_a_tolerances_pattern_strictly_with_its_numbers(
        calibrated_golden: Path) -> None:
    # a 1% change: far outside the calibrated noise allowance
    plain = ag.compare(_scaled(1.01), X, path=calibrated_golden, tolerance="calibrated")
    assert not plain.ok and plain.first_divergence is not None and plain.first_divergence.name == ""
    assert plain.first_divergence.error_multiple is not None and plain.first_divergence.error_multiple > 1
    loose = ag.compare(_scaled(1.01), X, path=calibrated_golden, tolerance="calibrated",
                       tolerances={"*": (10, 10)}, rtol=10, atol=10)
    assert loose.ok, str(loose)
    root = next(r for r in loose.layers if r.name == "")
    assert (root.rtol, root.atol) == (10.0, 10.0) and root.error_multiple is None
    assert root.tolerance_source == "tolerances['*']; strict: a tolerances pattern overrides calibration"
    assert any("tolerances['*'] judged 2 output(s) strictly" in n for n in loose.notes)
    # a pattern naming one layer only: the other is still judged by the calibrated rule
    one = ag.compare(_scaled(1.01), X, path=calibrated_golden, tolerance="calibrated", tolerances={"": (10, 10)})
    assert one.ok
    root = next(r for r in one.layers if r.name == "")
    assert root.error_multiple is None and root.rtol == 10.0
    lin = next(r for r in one.layers if r.name == "lin")
    assert lin.error_multiple == 0.0  # unchanged layer, calibrated (bit-identical)


def test_calibrated_mode_says_global_rtol_atol_only_apply_where_no_floor_exists(calibrated_golden: Path) -> None:
    rep = ag.compare(_scaled(1.01), X, path=calibrated_golden, tolerance="calibrated", rtol=10, atol=10)
    assert not rep.ok  # the numbers did not silently loosen the calibrated judgement
    assert any(n.startswith("rtol/atol (argument) apply only to outputs judged strictly") for n in rep.notes), rep.notes
    assert "rtol/atol (argument) apply only" in str(rep)

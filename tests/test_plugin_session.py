"""Unit tests of the plugin's logic layer (no nested pytest runs): options, routing, records,
xdist merging, unused goldens, ag_device id stripping and device-pair tolerances."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import activation_guard as ag
from activation_guard._core.errors import OptionError as SpecOptionError
from activation_guard.options.spec import CompareSpec, RecordSpec
from activation_guard.options.tolerances import CROSS_DEVICE_DEFAULTS, DTYPE_DEFAULTS, ToleranceResolver
from activation_guard.plugin.check import GoldenCheck, item_key
from activation_guard.plugin.session import CheckRecord, GuardSession, jsonable
from activation_guard.plugin.settings import (
    OptionError,
    Settings,
    engine_specs,
    marker_options,
    rerecord_command,
    resolve_options,
)
from activation_guard.store import naming as paths


def _resolver(golden_device=None, live_device=None, **options):
    return ToleranceResolver(CompareSpec.build(options), golden_device=golden_device, live_device=live_device)


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(golden_dir=tmp_path / "golden", rootdir=tmp_path, **kw)


# ---------------------------------------------------------------------------- options

LEVELS = ("ini ag_rtol", "command line --ag-rtol", "marker", "check()")


@given(st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=4, max_size=4))
def test_precedence_is_per_key_highest_set_level(vals: list[float | None]) -> None:
    layers = [{"rtol": v} for v in vals]
    r = resolve_options(*layers)
    set_levels = [i for i, v in enumerate(vals) if v is not None]
    if not set_levels:
        assert r.values == {} and r.describe() == "engine defaults"
    else:
        top = set_levels[-1]
        assert r.values == {"rtol": vals[top]} and r.sources == {"rtol": LEVELS[top]}


def test_precedence_merges_keys_across_levels() -> None:
    r = resolve_options({"rtol": 1e-1, "atol": 0.0}, {"rtol": 1e-2, "fail_fast": True}, {"rtol": 1e-3},
                        {"include": "enc*"})
    assert r.values == {"rtol": 1e-3, "atol": 0.0, "fail_fast": True, "include": "enc*"}
    assert r.sources == {"rtol": "marker", "atol": "ini ag_atol", "fail_fast": "command line --ag-fail-fast",
                         "include": "check()"}
    assert "rtol=0.001 (marker)" in r.describe()


def test_marker_merge_closest_wins() -> None:
    def mark(*args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(args=args, kwargs=kwargs)

    # item.iter_markers yields the closest first: function, then class, then module
    marks = [mark(rtol=1), mark(rtol=2, atol=3), mark(exclude="x", atol=4)]
    assert marker_options(marks, "t") == {"rtol": 1, "atol": 3, "exclude": "x"}
    with pytest.raises(OptionError, match=r"t: @pytest\.mark\.activation_guard takes keyword options only"):
        marker_options([mark(1e-3)], "t")


def test_engine_specs_route_options_and_imply_calibration() -> None:
    """Options reach the record and compare specs by the spec's own table; a calibrated
    comparison records noise floors; an unknown option names itself and where it was set."""
    opts = resolve_options({}, {}, {"tolerance": "calibrated"}, {"include": "a*", "rtol": 0.1})
    rec, cmp_ = engine_specs(opts)
    assert rec == RecordSpec(include=("a*",), calibrate=True)
    assert rec.source("calibrate") == "implied by tolerance='calibrated' (marker)"
    assert cmp_ == CompareSpec(tolerance="calibrated", include=("a*",), rtol=0.1)
    assert cmp_.source("rtol") == "check()"
    rec, _ = engine_specs(resolve_options({}, {}, {"tolerance": "calibrated"}, {"calibrate": False}))
    assert rec.calibrate is False  # an explicit choice wins
    with pytest.raises(SpecOptionError, match=r"option nope=1 \(marker\): is not an activation_guard option"):
        engine_specs(resolve_options({}, {}, {"nope": 1}, {}))
    with pytest.raises(OptionError, match="set by the plugin"):
        engine_specs(resolve_options({}, {}, {}, {"path": "x"}))


def test_settings_paths_and_validation(tmp_path: Path) -> None:
    inv = tmp_path / "sub"
    s = Settings.build(rootdir=tmp_path, invocation_dir=inv, ini_golden_dir="refs", ini={"rtol": " ", "atol": "0"})
    assert s.golden_dir == tmp_path / "refs" and s.ini_options == {"atol": "0"} and s.cli_options == {}
    s = Settings.build(rootdir=tmp_path, invocation_dir=inv, ini_golden_dir="refs", ini={"rtol": "", "atol": ""},
                       cli_golden_dir="g", cli={"rtol": "1e-3", "fail_fast": True, "calibrate": False},
                       report_path="r.json")
    assert s.golden_dir == inv / "g" and s.report_path == inv / "r.json"
    assert s.cli_options == {"rtol": "1e-3", "fail_fast": True}  # raw: judged (again) by the spec, one way
    for bad, problem in (("abc", "must be a number, got 'abc'"), ("-1", "must be a finite number >= 0, got -1"),
                         ("nan", "must be a finite number >= 0, got nan"), ("inf", "must be a finite number >= 0")):
        with pytest.raises(SpecOptionError, match=f"option rtol='{bad}' \\(ini ag_rtol\\): {re.escape(problem)}"):
            Settings.build(rootdir=tmp_path, invocation_dir=inv, ini_golden_dir="g", ini={"rtol": bad})
        with pytest.raises(SpecOptionError, match=f"\\(command line --ag-rtol\\): {re.escape(problem)}"):
            Settings.build(rootdir=tmp_path, invocation_dir=inv, ini_golden_dir="g", cli={"rtol": bad})
    with pytest.raises(OptionError, match="ag_golden_dir is empty"):
        Settings.build(rootdir=tmp_path, invocation_dir=inv, ini_golden_dir=" ")
    with pytest.raises(OptionError, match="--ag-update"):
        _settings(tmp_path, update="sometimes")


def test_golden_dir_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "g").write_text("not a folder")
    for kw in ({"ini_golden_dir": "g"}, {"ini_golden_dir": "x", "cli_golden_dir": "g"}):
        with pytest.raises(OptionError, match="exists and is not a folder"):
            Settings.build(rootdir=tmp_path, invocation_dir=tmp_path, **kw)


@pytest.mark.parametrize("update", [None, "all"])
@pytest.mark.parametrize("marker, match", [
    ({"rtol": "abc"}, r"^activation_guard: option rtol='abc' \(marker\): must be a number, got 'abc'$"),
    ({"atol": -1}, r"option atol=-1 \(marker\): must be a finite number >= 0"),
    ({"tolerance": "calibrate"}, r"option tolerance='calibrate' \(marker\): must be 'strict' or 'calibrated'"),
    ({"tolerances": {"0": {"atl": 1}}}, r"unknown keys \['atl'\]"),
    ({"rename": {"a": 1}}, r"option rename=\{'a': 1\} \(marker\): maps golden names to live names"),
    ({"include": [3]}, r"option include=\[3\] \(marker\): must contain glob strings"),
    ({"fail_fast": "maybe"}, r"option fail_fast='maybe' \(marker\): must be True or False"),
])
def test_bad_option_values_fail_cleanly_before_anything_runs(tmp_path: Path, update: Any, marker: Any,
                                                             match: str) -> None:
    """A bad value fails in one line naming option and source, and --ag-update writes nothing."""
    s = GuardSession(_settings(tmp_path, update=update))
    gc = GoldenCheck(s, "t.py::test_a", paths.NodeKey.parse("t.py::test_a"), marker=marker)
    with pytest.raises(pytest.fail.Exception, match=match) as ei:
        gc.check(_model(), (torch.ones(1, 3),))
    assert not gc.path().exists()
    # nothing ran; the summary counts and lists it as an error, with the same words
    assert [(r.status, r.nodeid) for r in s.records] == [("error", "t.py::test_a")]
    assert s.records[0].message and s.records[0].message in str(ei.value)


def test_not_a_module_fails_cleanly(tmp_path: Path) -> None:
    gc = GoldenCheck(GuardSession(_settings(tmp_path)), "t.py::test_a", paths.NodeKey.parse("t.py::test_a"))
    with pytest.raises(pytest.fail.Exception, match=r"needs a torch\.nn\.Module, got function"):
        gc.check(lambda t: t, (torch.ones(1, 3),))


def test_rerecord_command_carries_the_options_that_change_recording(tmp_path: Path) -> None:
    plain = _settings(tmp_path)
    assert rerecord_command(plain, None, "t.py::test_a") == "pytest --ag-update t.py::test_a"
    assert rerecord_command(plain, None, "t.py::test_a[cpu-x y]") == "pytest --ag-update 't.py::test_a[cpu-x y]'"
    assert rerecord_command(plain, None, "t.py::t", missing_only=True) == "pytest --ag-update=missing t.py::t"
    assert rerecord_command(plain, missing_only=True) == "pytest --ag-update=missing"
    cli = {"tolerance": "calibrated", "rtol": 1e-3}  # tolerances do not change what is recorded
    s = _settings(tmp_path, cli_golden_dir="/x y", cli_options=cli)
    opts = resolve_options({}, cli, {}, {})
    assert rerecord_command(s, opts, "t.py::a") == "pytest --ag-update '--ag-golden-dir=/x y' --ag-calibrate t.py::a"
    assert rerecord_command(s, None, "t.py::a") == rerecord_command(s, opts, "t.py::a")  # session-wide options
    # a calibrated comparison set by a marker or check() also needs a calibrated golden
    for marker, call in (({"tolerance": "calibrated"}, {}), ({}, {"calibrate": True})):
        assert rerecord_command(plain, resolve_options({}, {}, marker, call), "t.py::a") == \
            "pytest --ag-update --ag-calibrate t.py::a"
    # check() can turn a command-line calibrated comparison back to strict
    strict = resolve_options({}, cli, {}, {"tolerance": "strict"})
    assert "--ag-calibrate" not in rerecord_command(s, strict, "t.py::a")


@given(st.text(min_size=1), st.one_of(st.none(), st.text(min_size=1)), st.booleans())
def test_rerecord_command_survives_the_shell(nodeid: str, gdir: str | None, calibrated: bool) -> None:
    s = Settings(golden_dir=Path("/g"), rootdir=Path("/"), cli_golden_dir=gdir)
    opts = resolve_options({}, {}, {"tolerance": "calibrated"} if calibrated else {}, {})
    argv = shlex.split(rerecord_command(s, opts, nodeid))
    assert argv[:2] == ["pytest", "--ag-update"] and argv[-1] == nodeid
    assert (f"--ag-golden-dir={gdir}" in argv) == bool(gdir) and ("--ag-calibrate" in argv) == calibrated


# ---------------------------------------------------------------------------- records, xdist


def test_worker_output_roundtrip_and_counts(tmp_path: Path) -> None:
    st_ = _settings(tmp_path)
    gd = st_.golden_dir
    worker = GuardSession(st_, is_worker=True)
    worker.add(CheckRecord("t.py::a", None, str(gd / "t/a.h5"), "passed", report={"x": math.nan}))
    worker.add(CheckRecord("t.py::b", "dec", str(gd / "t/b--dec.h5"), "diverged", first_divergence="layer '2'"))
    worker.note_items([("t.py::a", paths.NodeKey.parse("t.py::a"))])
    raw = worker.to_worker_output()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    ctl = GuardSession(st_)
    ctl.add(CheckRecord("u.py::c", None, str(gd / "u/c.h5"), "written"))
    ctl.merge_worker_output(raw, "gw0")
    ctl.merge_worker_output(None, "gw1")
    assert ctl.counts() == {"checked": 2, "passed": 1, "diverged": 1, "written": 1, "missing": 0}
    assert ctl.used == {"t/a.h5", "t/b--dec.h5", "u/c.h5"} and ctl.owners == {"t/a": {"t.py::a"}}
    lines = ctl.summary_lines()
    assert "DIVERGED t.py::b (dec): layer '2'" in lines and "WRITTEN  golden/u/c.h5" in lines
    assert any("gw1" in ln and "lost" in ln for ln in lines)


def test_claim_rejects_shared_and_case_colliding_files(tmp_path: Path) -> None:
    s = GuardSession(_settings(tmp_path))
    s.claim(tmp_path / "golden/t/test_a.h5", "t.py::test_a", None)
    with pytest.raises(OptionError, match="two checks with no name"):
        s.claim(tmp_path / "golden/t/test_a.h5", "t.py::test_a", None)
    with pytest.raises(OptionError, match="differ only by letter case"):
        s.claim(tmp_path / "golden/t/test_A.h5", "t.py::test_A", None)


def test_jsonable_is_strict() -> None:
    got = jsonable({"a": [math.inf, -math.inf, math.nan, 1.5], 2: (None, Path("p"))})
    assert got == {"a": ["inf", "-inf", "nan", 1.5], "2": [None, "p"]}


def test_find_unused_rules(tmp_path: Path) -> None:
    s = GuardSession(_settings(tmp_path, unused="fail"))
    gd = s.settings.golden_dir
    for rel in ("m/test_ok.h5", "m/test_ok--dec.h5", "m/test_skip.h5", "m/test_gone.h5", "other/test_x.h5",
                "m/.test_ok.h5.x.ag-tmp.1"):
        (gd / rel).parent.mkdir(parents=True, exist_ok=True)
        (gd / rel).write_bytes(b"")
    s.note_items([(n, paths.NodeKey.parse(n)) for n in ("m.py::test_ok", "m.py::test_skip")])
    s.note_outcome("m.py::test_ok", "setup", "passed")
    s.note_outcome("m.py::test_ok", "call", "passed")
    s.note_outcome("m.py::test_skip", "setup", "skipped")
    s.used.add("m/test_ok.h5")
    assert s.find_unused(set()) == ["m/test_gone.h5", "m/test_ok--dec.h5"]
    assert s.find_unused({"m.py"}) == ["m/test_ok--dec.h5"]  # narrowed module: unknown files left alone
    s.note_outcome("m.py::test_ok", "teardown", "failed")  # a failing test protects its goldens
    assert s.find_unused({"m.py"}) == []


# ---------------------------------------------------------------------------- GoldenCheck without pytest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()).eval()


def test_non_cpu_variant_defers_recording(tmp_path: Path) -> None:
    """Under --ag-update only the cpu variant of an ag_device test writes the shared golden."""
    s = GuardSession(_settings(tmp_path, update="all"))
    key = paths.NodeKey.parse("t.py::test_a")
    x = torch.ones(1, 3)
    gc = GoldenCheck(s, "t.py::test_a[cuda]", key, device="cuda", record_nodeid="t.py::test_a[cpu]")
    out = gc.check(_model(), (x,))
    assert torch.equal(out, _model()(x).detach()) and not gc.path().exists()
    assert s.records[0].status == "deferred"
    assert any("rerun without --ag-update" in ln for ln in s.summary_lines())
    cpu = GoldenCheck(s, "t.py::test_a[cpu]", key, device="cpu")
    cpu.check(_model(), (x,))
    assert cpu.path().is_file() and s.records[1].status == "written"


# ---------------------------------------------------------------------------- ag_device id stripping


def _item(nodeid: str, name: str, original: str, params: dict[str, Any], cid: str) -> Any:
    """Only the public attributes item_key may read (dict order = parametrisation order)."""
    cs = SimpleNamespace(params=params, indices={k: 0 for k in params}, id=cid)
    return SimpleNamespace(nodeid=nodeid, name=name, originalname=original, callspec=cs)


def test_item_key_strips_the_device() -> None:
    it = _item("t.py::T::test_a[cuda-p1]", "test_a[cuda-p1]", "test_a", {"ag_device": "cuda", "n": 1}, "cuda-p1")
    key, dev, rec = item_key(it)
    assert key == paths.NodeKey("t.py", ("T", "test_a[p1]")) and dev == "cuda" and rec == "t.py::T::test_a[cpu-p1]"
    it = _item("t.py::test_b[cpu]", "test_b[cpu]", "test_b", {"ag_device": "cpu"}, "cpu")
    assert item_key(it)[0] == paths.NodeKey("t.py", ("test_b",))
    # a user's own ag_device parametrisation made last: the device id trails
    it = _item("t.py::test_c[p-1-cuda:1]", "test_c[p-1-cuda:1]", "test_c", {"n": "p-1", "ag_device": "cuda:1"},
               "p-1-cuda:1")
    assert item_key(it) == (paths.NodeKey("t.py", ("test_c[p-1]",)), "cuda", "t.py::test_c[p-1-cpu]")
    # a device object without an id of its own gets pytest's generated one
    it = _item("t.py::test_d[ag_device0-x]", "test_d[ag_device0-x]", "test_d", {"ag_device": object(), "k": "x"},
               "ag_device0-x")
    assert item_key(it)[0].parts == ("test_d[x]",) and item_key(it)[2] == "t.py::test_d[ag_device0-x]"


def test_item_key_user_param_named_like_a_device() -> None:
    # ours is parametrised first (tryfirst), so the leading id is the device's
    it = _item("t.py::test_c[cpu-cpu]", "test_c[cpu-cpu]", "test_c", {"ag_device": "cpu", "kind": "cpu"}, "cpu-cpu")
    assert item_key(it)[0].parts == ("test_c[cpu]",)


def test_item_key_keeps_a_device_it_cannot_place() -> None:
    """A device id in the middle of three (or hidden behind a custom id) cannot be cut out
    reliably: the key keeps it, so each device gets its own golden rather than a wrong shared one."""
    it = _item("t.py::test_m[a-cuda-b]", "test_m[a-cuda-b]", "test_m", {"x": "a", "ag_device": "cuda", "y": "b"},
               "a-cuda-b")
    assert item_key(it) == (paths.NodeKey("t.py", ("test_m[a-cuda-b]",)), "cuda", "t.py::test_m[a-cuda-b]")
    it = _item("t.py::test_n[GPU]", "test_n[GPU]", "test_n", {"ag_device": "cuda"}, "GPU")
    assert item_key(it)[0].parts == ("test_n[GPU]",)


def test_item_key_without_device_is_the_node_id() -> None:
    it = SimpleNamespace(nodeid="t.py::test_d[x]", name="test_d[x]", originalname="test_d",
                         callspec=SimpleNamespace(params={"x": 1}, indices={"x": 0}))
    assert item_key(it) == (paths.NodeKey("t.py", ("test_d[x]",)), None, "t.py::test_d[x]")


# ---------------------------------------------------------------------------- device-pair tolerances


def test_cross_device_defaults_apply_only_across_device_types() -> None:
    same = _resolver(golden_device="cuda:0", live_device="cuda:1")
    assert not same.cross_device and same.resolve("l", "float32").rtol == DTYPE_DEFAULTS["float32"][0]
    cross = _resolver(golden_device="cpu", live_device="cuda:0")
    assert cross.cross_device and cross.device_pair == "cpu->cuda"
    for dt, (r, a) in CROSS_DEVICE_DEFAULTS.items():
        t = cross.resolve("l", dt)
        assert (t.rtol, t.atol) == (r, a) and "cpu->cuda" in t.source
        assert r >= DTYPE_DEFAULTS[dt][0]  # never tighter than the same-device default
    assert cross.resolve("l", "int64", "int").rtol == 0  # integers stay exact
    # explicit options beat the device-pair defaults
    t = _resolver(rtol=1e-9, golden_device="cpu", live_device="cuda").resolve("l", "float32")
    assert t.rtol == 1e-9 and t.atol == CROSS_DEVICE_DEFAULTS["float32"][1]


def test_golden_recorded_on_cuda_is_checked_with_device_pair_defaults(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import activation_guard.capture.env as envmod

    m = _model()
    x = torch.linspace(-3, 3, 12).reshape(4, 3)
    monkeypatch.setattr(envmod, "device_info", lambda dev: {"device": "cuda:0", "device_type": "cuda"})
    ag.record(m, (x,), path=tmp_path / "g.h5")
    monkeypatch.undo()
    with torch.no_grad():
        m[0].weight.mul_(1 + 5e-5)
    rep = ag.compare(m, (x,), path=tmp_path / "g.h5")
    assert rep.ok and any("cuda->cpu" in n for n in rep.notes)
    assert rep.layers[0].tolerance_source == "float32 default for cuda->cpu"


def test_unused_goldens_are_not_judged_when_the_run_cannot_tell(tmp_path: Path) -> None:
    """A crashed xdist worker's used goldens are lost (its passed outcomes are not): a golden a
    passing test used was listed as unused. --lf and --sw leave tests out silently."""
    from activation_guard.plugin.hooks import _unused_blocker

    class Config:
        def __init__(self, **opts: bool) -> None:
            self.opts = opts

        def getoption(self, name: str, default: object = None) -> object:
            return self.opts.get(name, default)

    s = GuardSession(_settings(tmp_path, unused="fail"))
    assert _unused_blocker(Config(), s) is None  # type: ignore[arg-type]
    assert "--lf" in (_unused_blocker(Config(lf=True), s) or "")  # type: ignore[arg-type]
    assert "--sw" in (_unused_blocker(Config(stepwise=True), s) or "")  # type: ignore[arg-type]
    s.merge_worker_output(None, "xdist worker gw1")
    why = _unused_blocker(Config(), s)  # type: ignore[arg-type]
    assert why is not None and "gw1" in why and "lost" in why
    s.unused_blocked = why
    assert "unused goldens not listed: the results of xdist worker gw1 were lost; run without it to find them" \
        in s.summary_lines()
    assert not s.unused_fail_the_run()


def test_summary_counts_read_as_words() -> None:
    from activation_guard.plugin.session import counted

    assert counted({"checked": 1, "passed": 0, "errors": 1}) == "1 checked, 0 passed, 1 error"
    assert counted({"checked": 2, "errors": 2}) == "2 checked, 2 errors"

"""One option table: every option is declared once (options/spec.py's OPTIONS), and the API
keywords, the pytest flags and ini keys, and docs/options.md agree with it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import activation_guard as ag
from activation_guard.options.spec import OPTIONS, CompareSpec, RecordSpec, markdown_table
from activation_guard.plugin.settings import CLI_FLAGS, INI_KEYS

DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"
NOT_OPTIONS = {"model", "args", "kwargs", "path"}


def test_docs_table_is_generated_from_the_option_table() -> None:
    text = DOC.read_text(encoding="utf-8")
    m = re.search(r"<!-- options table: generated -->\n(.*)<!-- end of options table -->", text, re.S)
    assert m is not None, "docs/options.md lost its generated-table markers"
    assert m.group(1) == markdown_table(), "docs/options.md is stale: regenerate it from OPTIONS"


@pytest.mark.parametrize("fn, side", [(ag.record, "record"), (ag.compare, "compare")])
def test_api_keywords_are_the_table_s_options(fn, side: str) -> None:
    params = set(inspect.signature(fn).parameters) - NOT_OPTIONS
    wanted = {o.name for o in OPTIONS.values() if getattr(o, side)}
    assert params == wanted


def test_specs_hold_exactly_the_table_s_options() -> None:
    for spec, side in ((RecordSpec, "record"), (CompareSpec, "compare")):
        fields = {f for f in spec.__dataclass_fields__} - {"sources", "given"}
        assert fields == {o.name for o in OPTIONS.values() if getattr(o, side)}


def _flat(text: str) -> str:
    """--help text with its line wrapping undone."""
    return " ".join(text.split())


def test_every_flag_and_ini_key_is_registered_with_pytest_with_the_row_s_help(pytester: pytest.Pytester) -> None:
    assert {o.name: o.flag for o in OPTIONS.values() if o.flag} == CLI_FLAGS
    assert {o.name: o.ini for o in OPTIONS.values() if o.ini} == INI_KEYS
    out = pytester.runpytest("--help").stdout.str()
    flat = _flat(out)
    for o in OPTIONS.values():
        if o.flag:
            shown = o.flag if o.flag_takes == "switch" else f"{o.flag}={o.flag_metavar}"
            assert re.search(rf"^\s+{re.escape(shown)}(\s|$)", out, re.M), shown
            assert _flat(o.pytest_help()) in flat, o.flag
            assert o.help.split(":")[0] in o.pytest_help()  # the row's own text
        if o.ini:
            assert re.search(rf"^\s+{re.escape(o.ini)} \(", out, re.M), o.ini
            assert _flat(o.ini_help()) in flat, o.ini


def test_the_diff_command_s_flags_are_the_table_s() -> None:
    from activation_guard.cli import build_parser

    diff = build_parser()._subparsers._group_actions[0].choices["diff"]  # type: ignore[union-attr]
    flags = {a.option_strings[0]: a for a in diff._actions if a.option_strings}
    flat = _flat(diff.format_help())
    for o in OPTIONS.values():
        if o.cli is None:
            assert f"--{o.name.replace('_', '-')}" not in flags, o.name
            continue
        assert o.compare and o.cli in flags, o.name
        assert flags[o.cli].help == o.cli_help() and _flat(o.cli_help()) in flat
        assert (flags[o.cli].nargs == 0) == (o.flag_takes == "switch")
    # a command taking some of the options (names=) gets those flags only
    import argparse

    from activation_guard.cli import add_option_flags, option_values

    some = argparse.ArgumentParser()
    add_option_flags(some, "compare", names={"rtol", "include"})
    assert [a.option_strings[0] for a in some._actions if a.dest != "help"] == ["--rtol", "--include"]
    assert option_values(some.parse_args(["--include", "a", "--include", "b"]), "compare", {"rtol", "include"}) == (
        {"include": ["a", "b"]}, {"include": "--include"})


def test_every_option_is_a_marker_key_judged_by_the_table(pytester: pytest.Pytester) -> None:
    """The marker takes every option by name, and a bad value is refused naming the option and the marker."""
    from activation_guard._core.errors import OptionError
    from activation_guard.plugin.settings import engine_specs, resolve_options

    class Odd:
        pass

    for o in OPTIONS.values():
        with pytest.raises(OptionError, match=rf"option {o.name}=.* \(marker\)"):
            engine_specs(resolve_options({}, {}, {o.name: Odd()}, {}))
    with pytest.raises(OptionError, match="is not an activation_guard option"):
        engine_specs(resolve_options({}, {}, {"not_an_option": 1}, {}))


def test_a_new_row_gets_its_flags_everywhere(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row added to the table shows up in pytest's --help (flag and ini key), in the command
    line's diff, in the docs table and as a marker key, with its help text, and nothing else to edit."""
    import argparse

    from activation_guard.cli import add_option_flags, option_values
    from activation_guard.options import spec as specmod
    from activation_guard.options.parse import _flag

    row = specmod.Option("probe_option", _flag, False, True, "a probe 100% made of table", "--ag-probe-option",
                         "ag_probe_option", cli="--probe-option")
    monkeypatch.setitem(specmod.OPTIONS, row.name, row)
    out = _flat(pytester.runpytest("--help").stdout.str())
    assert "--ag-probe-option when comparing: a probe 100% made of table;" in out
    assert "ag_probe_option (string): activation_guard probe_option: a probe 100% made of table;" in out
    parser = argparse.ArgumentParser()
    add_option_flags(parser, "compare")
    assert "a probe 100% made of table" in _flat(parser.format_help())
    assert option_values(parser.parse_args(["--probe-option"]), "compare") == (
        {"probe_option": True}, {"probe_option": "--probe-option"})
    assert "| `probe_option` |  | yes | `--ag-probe-option` | `ag_probe_option` | `--probe-option` |" in \
        specmod.markdown_table()


def test_switches_and_values_reach_the_settings_from_the_table(pytester: pytest.Pytester) -> None:
    """Each table flag given on pytest's command line reaches the session's options under its name."""
    pytester.makeconftest(
        "import json\n"
        "def pytest_sessionfinish(session):\n"
        "    from activation_guard.plugin.hooks import SESSION_KEY\n"
        "    s = session.config.stash[SESSION_KEY].settings\n"
        "    print('OPTS=' + json.dumps(s.cli_options, sort_keys=True))\n"
    )
    pytester.makepyfile("def test_x(): pass")
    r = pytester.runpytest("-s", "--ag-rtol", "1e-3", "--ag-fail-fast", "--ag-tolerance=calibrated",
                           "--ag-replay", "all", "--ag-fingerprint", "--ag-calibrate")
    found = re.search(r"OPTS=\{.*?\}", r.stdout.str())
    assert found is not None, r.stdout.str()
    assert found.group(0) == ('OPTS={"calibrate": true, "fail_fast": true, "fingerprint": true, "replay": "all", '
                              '"rtol": "1e-3", "tolerance": "calibrated"}')

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


def test_every_flag_and_ini_key_is_registered_with_pytest(pytester: pytest.Pytester) -> None:
    assert {o.name: o.flag for o in OPTIONS.values() if o.flag} == CLI_FLAGS
    assert {o.name: o.ini for o in OPTIONS.values() if o.ini} == INI_KEYS
    out = pytester.runpytest("--help").stdout.str()
    for flag in CLI_FLAGS.values():
        assert re.search(rf"^\s+{re.escape(flag)}\b", out, re.M), flag
    for key in INI_KEYS.values():
        assert re.search(rf"^\s+{re.escape(key)} \(", out, re.M), key

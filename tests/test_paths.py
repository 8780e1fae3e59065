"""Node id -> golden path: readable, lossless, injective, never outside the golden directory."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from activation_guard.store import naming as paths
from activation_guard.store.naming import NodeKey, golden_path, owner_stem, relative_golden_path, stem_of


@pytest.mark.parametrize(
    ("nodeid", "name", "expected"),
    [
        ("tests/test_cnn.py::test_small", None, "tests/test_cnn/test_small.h5"),
        ("tests/test_cnn.py::test_small[batch2-float32]", None, "tests/test_cnn/test_small[batch2-float32].h5"),
        ("tests/test_cnn.py::TestCNN::test_small[0.5]", None, "tests/test_cnn/TestCNN.test_small[0.5].h5"),
        ("tests/test_cnn.py::test_small[2]", "decoder", "tests/test_cnn/test_small[2]--decoder.h5"),
        ("test_x.py::test_a[a/b]", None, "test_x/test_a[a%2Fb].h5"),
        ("test_x.py::test_a[x y]", None, "test_x/test_a[x%20y].h5"),
        ("test_x.py::test_a[..]", None, "test_x/test_a[..].h5"),
        ("test_x.py::test_a[a::b]", None, "test_x/test_a[a%3A%3Ab].h5"),
        ("test_x.py::test_a[café]", None, "test_x/test_a[caf%C3%A9].h5"),
        ("test_x.py::test_a[a--b]", None, "test_x/test_a[a-%2Db].h5"),
        ("../outside/test_x.py::test_a", None, "%2E%2E/outside/test_x/test_a.h5"),
        ("test_x.py::CON", None, "test_x/%43ON.h5"),
        ("doc/readme.txt::readme.txt", None, "doc/readme.txt~/readme%2Etxt.h5"),
        ("data.h5/test_x.py::t", None, "data%2Eh5/test_x/t.h5"),
    ],
)
def test_readable_examples(nodeid: str, name: str | None, expected: str) -> None:
    assert relative_golden_path(NodeKey.parse(nodeid), name) == expected


def test_param_id_with_double_colon_is_one_part() -> None:
    key = NodeKey.parse("t.py::TestA::test_b[x::y]")
    assert key.parts == ("TestA", "test_b[x::y]")
    assert key.nodeid == "t.py::TestA::test_b[x::y]"


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="no '::'"):
        NodeKey.parse("tests/test_x.py")
    with pytest.raises(ValueError, match="check name"):
        relative_golden_path(NodeKey.parse("t.py::a"), "")
    with pytest.raises(ValueError, match="non-empty"):
        relative_golden_path(NodeKey("t.py", ("A", "")))


def test_long_ids_are_shortened_with_a_hash(tmp_path: Path) -> None:
    long_a = "t.py::test_a[" + "x" * 300 + "a]"
    long_b = "t.py::test_a[" + "x" * 300 + "b]"
    pa, pb = golden_path(tmp_path, long_a), golden_path(tmp_path, long_b)
    assert pa != pb
    assert all(len(c) <= paths.MAX_COMPONENT + len(paths.SUFFIX) for c in pa.relative_to(tmp_path).parts)
    assert "~" in pa.name and pa.name.startswith("test_a[xxxx")
    # a long check name is shortened on its own: the owning test stays visible
    pn = golden_path(tmp_path, "t.py::test_a", "n" * 400)
    assert pn.name.startswith("test_a--nnn") and len(pn.name) < 200
    assert owner_stem(pn.relative_to(tmp_path).as_posix()) == stem_of(NodeKey.parse("t.py::test_a"))


def test_escaped_components_stay_inside(tmp_path: Path) -> None:
    for nodeid in ["../../etc/passwd.py::x", "/abs/test.py::x", "a/../../b.py::x[../../..]", "t.py::..", "t.py::x[/]"]:
        p = golden_path(tmp_path / "golden", nodeid)
        assert os.path.commonpath([tmp_path / "golden", p]) == str(tmp_path / "golden")
        assert p.suffix == ".h5"


def test_owner_stem_of_named_checks() -> None:
    key = NodeKey.parse("tests/t.py::TestA::test_b[p--q]")
    stem = stem_of(key)
    for name in (None, "decoder", "x--y", "-lead", "trail-"):
        assert owner_stem(relative_golden_path(key, name)) == stem


# ---------------------------------------------------------------------------- properties

_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=24)
_module = st.lists(
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="/"), min_size=1, max_size=12),
    min_size=1, max_size=3,
).map("/".join)
_parts = st.lists(_text.filter(lambda s: "::" not in s and "[" not in s), min_size=0, max_size=2).flatmap(
    lambda head: st.one_of(
        _text, st.tuples(_text.filter(lambda s: "[" not in s), _text).map(lambda t: f"{t[0]}[{t[1]}]")
    ).map(lambda last: (*head, last))
)
_key = st.builds(NodeKey, _module, _parts)
_name = st.one_of(st.none(), _text)


@given(_key, _name, _key, _name)
def test_injective(k1: NodeKey, n1: str | None, k2: NodeKey, n2: str | None) -> None:
    if (k1, n1) != (k2, n2):
        assert relative_golden_path(k1, n1) != relative_golden_path(k2, n2)


@given(_key, _name)
def test_safe_and_lossless(key: NodeKey, name: str | None) -> None:
    rel = relative_golden_path(key, name)
    comps = rel.split("/")
    assert rel.endswith(".h5")
    for c in comps:
        assert c and c not in (".", "..") and not c.startswith(".") and not c.endswith((".", " "))
        assert set(c) <= paths.SAFE | {"%", "~"}, c
    for c in comps[:-1]:
        assert not c.endswith(".h5")  # a directory never looks like a golden: no file/dir clash
    # lossless: percent-decoding the file name gives back the test part (when not shortened)
    f = comps[-1][: -len(".h5")]
    if "~" not in f:
        stem = f.split("--", 1)[0]
        decoded = urllib.parse.unquote(stem, errors="surrogatepass")
        joined = ".".join(key.parts)
        assert decoded == joined
        if name is not None:
            assert urllib.parse.unquote(f.split("--", 1)[1], errors="surrogatepass") == name


@given(_key, _name)
def test_never_leaves_golden_dir(key: NodeKey, name: str | None) -> None:
    base = Path("/srv/golden")
    p = golden_path(base, key, name)
    assert os.path.commonpath([base, p]) == str(base) and p != base
    assert owner_stem(p.relative_to(base).as_posix()) == stem_of(key)

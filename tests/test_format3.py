"""Format 3's row-encoded index (activation_guard/store/rows.py): same records as format 2's JSON,
decoded to the same entries, and every malformed table refused with the file, table and row named."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from golden_edit import index_dict, set_index, set_json, to_v2
from hypothesis import given, settings
from hypothesis import strategies as st
from models import Mixed, one_thread

import activation_guard as ag
from activation_guard.store import GoldenReader, rows
from activation_guard.store.format import GRAD_KINDS, parse_backward, parse_calls

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("g3") / "g.h5"
    ag.record(Mixed().eval(), X, path=p)
    return p


def forged(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


def refused(path: Path, err: type[ag.GoldenError], *words: str) -> str:
    with pytest.raises(err) as ei:
        GoldenReader(path).close()
    msg = str(ei.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def put_table(f: h5py.File, name: str, arr: np.ndarray, fix_crc: bool = True) -> None:
    """Replace one index table, with the header's size and checksum made to match (a forger's edit)."""
    del f[name]
    f.create_dataset(name, data=arr)
    head = json.loads(f["index"][()].tobytes())
    head["rows"][name] = int(arr.shape[0])
    if fix_crc:
        head["crc32"][name] = zlib.crc32(np.ascontiguousarray(arr).tobytes())
    set_json(f, "index", head)


# --------------------------------------------------------------------------- the same records


def entries_equal(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.name, x.call, x.type_name, x.position, x.grad) == (y.name, y.call, y.type_name, y.position, y.grad)
        assert x.leaves == y.leaves
        assert x.inputs == y.inputs


def test_a_real_golden_decodes_to_the_entries_its_format_2_twin_gives(golden, tmp_path):
    twin = tmp_path / "v2.h5"
    shutil.copyfile(golden, twin)
    with h5py.File(twin, "r+") as f:
        to_v2(f)
        assert int(f.attrs["ag_format_version"]) == 2 and "calls" not in f
    with GoldenReader(golden) as r3, GoldenReader(twin) as r2:
        assert (r3.version, r2.version) == (3, 2)
        entries_equal(r3.calls, r2.calls)
        assert any(c.inputs for c in r3.calls)  # inputs, decoded lazily from their rows
    assert ag.compare(Mixed().eval(), X, path=twin).ok  # a format-2 golden still compares


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
_dtype = st.sampled_from(["float32", "float16", "bfloat16", "int64", "bool", "complex64", "float8_e4m3fn"])
_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "bool": 1, "complex64": 8, "float8_e4m3fn": 1}


@st.composite
def leaf_dicts(draw: Any, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """A leaf record as the writer makes it; ``aliases``: the sections an alias may name (outputs
    hold none: only inputs and gradients refer to stored values)."""
    kind = draw(st.sampled_from(["tensor", "tensor", "none", "str", "object", "ref", *(["alias"] if aliases else [])]))
    e: dict[str, Any] = {"kind": kind, "path": draw(_names)}
    if kind == "tensor":
        dt = draw(_dtype)
        shape = draw(st.lists(st.integers(0, 5), max_size=4))
        e.update(dtype=dt, shape=shape, nbytes=_SIZES[dt] * int(np.prod(shape, dtype=np.int64)),
                 crc32=draw(st.integers(0, 2**32 - 1)))
        if draw(st.booleans()):
            e.update(pack=draw(st.integers(0, 9)), offset=draw(st.integers(0, 2**40)))
        else:
            e["dataset"] = f"data/{draw(st.integers(0, 999999)):06d}"
        if draw(st.booleans()):
            e["py"] = draw(st.sampled_from(["Parameter", "MyTensor"]))
    elif kind == "str":
        e.update(value=draw(_names), py=draw(st.sampled_from(["str", "dtype", "device"])))
    elif kind in ("object", "none"):
        e["type"] = draw(st.sampled_from(["NoneType", "DynamicCache", "empty dict"]))
    elif kind == "ref":
        e.update(value=draw(_names), type=draw(st.sampled_from(["Tensor", "list"])))
    else:
        e.update(name=draw(_names), call=draw(st.integers(0, 3)), of=draw(_names),
                 section=draw(st.sampled_from(aliases)))
        if draw(st.booleans()):
            e["py"] = "Parameter"
    return e


@st.composite
def index_dicts(draw: Any) -> dict[str, Any]:
    calls = []
    for i in range(draw(st.integers(0, 5))):
        leaves = draw(st.lists(leaf_dicts(), max_size=3, unique_by=lambda e: e["path"]))
        c: dict[str, Any] = {"name": draw(_names), "call": i, "type": draw(_names), "leaves": leaves}
        if draw(st.booleans()):
            c["inputs"] = draw(st.lists(leaf_dicts(aliases=("out", "in")), max_size=3))
        calls.append(c)
    index: dict[str, Any] = {"calls": calls}
    backward = []
    for i in range(draw(st.integers(0, 3))):
        grads = ("grad-output", "grad-input", "grad-param")
        leaves = draw(st.lists(leaf_dicts(aliases=grads).filter(lambda e: e["kind"] in ("tensor", "none", "alias")),
                               max_size=2,
                               unique_by=lambda e: e["path"]))
        backward.append({"grad": draw(st.sampled_from(GRAD_KINDS)), "name": draw(_names), "call": i,
                         "type": "Linear", "leaves": leaves})
    if backward:
        index["backward"] = backward
    return index


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(index_dicts())
def test_tables_hold_exactly_what_format_2_json_holds(index):
    """Every index a writer can make: the tables decode to the entries the JSON decodes to, and
    back to the same dicts (what tests and plain-h5py readers see)."""
    header, arrays = rows.encode(index)
    header = json.loads(json.dumps(header))  # as stored
    tables = rows.Tables("g.h5", header, arrays)
    forward, backward = tables.entries()
    entries_equal(forward, parse_calls("g.h5", index["calls"]))
    entries_equal(backward, parse_backward("g.h5", index.get("backward")))
    assert tables.to_dict() == index


def test_the_writer_refuses_what_the_tables_cannot_hold():
    with pytest.raises(ValueError, match="cannot hold"):
        rows.encode({"calls": [{"name": "a", "call": 0, "type": "T",
                                "leaves": [{"kind": "none", "path": "", "type": "NoneType", "extra": 1}]}]})
    with pytest.raises(ValueError, match="integer"):
        rows.encode({"calls": [{"name": "a", "call": 0.5, "type": "T", "leaves": []}]})


@pytest.mark.parametrize("py", [None, "float"])
@pytest.mark.parametrize("kind", ["tensor", "alias"])
def test_an_extra_field_on_a_common_leaf_is_refused_too(kind, py):
    """The packed tensor and the alias are recognized by their field count, not by comparing key
    sets: one field too many (with or without ``py``) must still be refused, not dropped."""
    leaf = ({"kind": "tensor", "path": "", "dtype": "float32", "shape": [2], "nbytes": 8, "crc32": 1, "pack": 0,
             "offset": 0} if kind == "tensor" else
            {"kind": "alias", "path": "args/0", "name": "a", "call": 0, "section": "out", "of": ""})
    if py is not None:
        leaf["py"] = py
    rows.encode({"calls": [{"name": "a", "call": 0, "type": "T", "leaves": [leaf] if kind == "tensor" else [],
                            "inputs": [leaf] if kind == "alias" else None}]})  # valid as it is
    with pytest.raises(ValueError, match=r"cannot hold.*extra"):
        rows.encode({"calls": [{"name": "a", "call": 0, "type": "T",
                                "leaves": [{**leaf, "extra": 1}] if kind == "tensor" else [],
                                "inputs": [{**leaf, "extra": 1}] if kind == "alias" else None}]})


# --------------------------------------------------------------------------- malformed tables


def _col(name: str) -> int:
    return rows.LEAF_COLUMNS.index(name)


@pytest.mark.parametrize("column,value,words", [
    ("kind", 9, ["/leaves row 0", "'kind'", "layer"]),
    ("path", 10**6, ["'path'"]),
    ("dtype", -5, ["'dtype'"]),
    ("ndim", 65, ["'ndim'"]),
    ("crc32", 2**33, ["'crc32'"]),
    ("alias_section", 99, ["'alias_section'"]),
])
def test_a_leaf_column_out_of_range_is_refused_naming_table_row_and_layer(golden, tmp_path, column, value, words):
    def edit(f: h5py.File) -> None:
        t = f["leaves"][()]
        t[0, _col(column)] = value
        put_table(f, "leaves", t)

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, "index table", *words)


def test_a_packed_tensor_whose_size_disagrees_is_refused_like_format_2(golden, tmp_path):
    def edit(f: h5py.File) -> None:
        t = f["leaves"][()]
        row = int(np.flatnonzero((t[:, _col("kind")] == 0) & (t[:, _col("pack")] >= 0))[0])
        t[row, _col("nbytes")] += 4
        put_table(f, "leaves", t)

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, "inconsistent size")


@pytest.mark.parametrize("table,edit_rows,words", [
    ("calls", lambda t: t.__setitem__((0, rows.CALL_COLUMNS.index("leaves")), t[0, 4] + 1), ["/calls lists"]),
    ("calls", lambda t: t.__setitem__((0, rows.CALL_COLUMNS.index("name")), -1), ["/calls row 0", "'name'"]),
    ("calls", lambda t: t.__setitem__((-1, rows.CALL_COLUMNS.index("grad")), 0), ["backward entry with inputs"]),
    ("calls", lambda t: t.__setitem__((0, rows.CALL_COLUMNS.index("grad")), 0), ["forward call after the backward"]),
    ("dims", lambda t: t.__setitem__(0, -3), ["/dims entry 0 is negative"]),
])
def test_inconsistent_tables_are_refused(golden, tmp_path, table, edit_rows, words):
    def edit(f: h5py.File) -> None:
        t = f[table][()]
        edit_rows(t)
        put_table(f, table, t)

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, *words)


def test_a_flipped_bit_in_a_table_is_corruption(golden, tmp_path):
    def edit(f: h5py.File) -> None:
        t = f["leaves"][()]
        t[1, _col("offset")] ^= 1 << 3
        put_table(f, "leaves", t, fix_crc=False)

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenCorruptError, "/leaves fails its checksum")


@pytest.mark.parametrize("dtype", ["<f8", ">i8", "<i4"])
def test_a_table_of_another_dtype_is_refused(golden, tmp_path, dtype):
    def edit(f: h5py.File) -> None:
        t = f["calls"][()]
        del f["calls"]
        f.create_dataset("calls", data=t.astype(dtype))

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, "/calls is", "int64")


def test_a_compressed_or_missing_table_is_refused(golden, tmp_path):
    def compress(f: h5py.File) -> None:
        t = f["leaves"][()]
        del f["leaves"]
        f.create_dataset("leaves", data=t, chunks=True, compression="gzip")

    refused(forged(golden, tmp_path / "c.h5", compress), ag.GoldenFormatError, "/leaves is chunked or compressed")
    refused(forged(golden, tmp_path / "m.h5", lambda f: f.__delitem__("dims")), ag.GoldenFormatError,
            "has no /dims table")


def test_a_malformed_header_is_refused(golden, tmp_path):
    def edit(f: h5py.File) -> None:
        head = json.loads(f["index"][()].tobytes())
        head["columns"]["leaves"] = head["columns"]["leaves"][::-1]
        set_json(f, "index", head)

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, "malformed index record")


def test_tables_in_a_format_2_file_are_unexpected(golden, tmp_path):
    def edit(f: h5py.File) -> None:
        calls = f["calls"][()]
        to_v2(f)
        f.create_dataset("calls", data=calls)

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, "unexpected object /calls")


def test_an_edit_the_tables_cannot_hold_is_a_format_2_file(golden, tmp_path):
    """(golden_edit's contract, which the hostile-file tests rely on.)"""
    def edit(f: h5py.File) -> None:
        idx = index_dict(f)
        idx["calls"][0]["leaves"][0]["shape"] = "abc"
        set_index(f, idx)
        assert int(f.attrs["ag_format_version"]) == 2

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, "malformed shape")


def test_counts_whose_int64_sum_wraps_to_the_row_count_are_refused(golden, tmp_path):
    """Three extra calls claiming 2**63-1, 2**63-1 and 2 input leaves add up to 2**64: an int64 sum
    wrapped to the true row count and the golden opened, then raised IndexError (found by review)."""
    def edit(f: h5py.File) -> None:
        t = f["calls"][()]
        extra = np.repeat(t[:1], 3, axis=0)
        extra[:, rows.CALL_COLUMNS.index("call")] = [100, 101, 102]
        extra[:, rows.CALL_COLUMNS.index("leaves")] = 0
        extra[:, rows.CALL_COLUMNS.index("inputs")] = [2**63 - 1, 2**63 - 1, 2]
        put_table(f, "calls", np.concatenate([t, extra]))

    refused(forged(golden, tmp_path / "g.h5", edit), ag.GoldenFormatError, "/calls lists")


def test_an_alias_among_a_calls_outputs_is_refused_in_both_versions(golden, tmp_path):
    """Only inputs and gradients refer to stored values; `diff` hit an assertion on such a golden
    (found by review)."""
    for version in (3, 2):
        def edit(f: h5py.File, version: int = version) -> None:
            idx = index_dict(f)
            idx["calls"][1]["leaves"][0] = {"kind": "alias", "path": "", "name": "a", "call": 0, "section": "out",
                                            "of": ""}
            set_index(f, idx, force_v2=version == 2)

        refused(forged(golden, tmp_path / f"v{version}.h5", edit), ag.GoldenFormatError, "is an alias")

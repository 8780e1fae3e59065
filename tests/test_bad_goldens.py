"""Bad golden files: every one is a clear GoldenError naming the file, the problem and the fix,
or (for a golden that lacks a layer the model has) a failing report. Never a pass, never a raw
h5py/json/numpy traceback, and silent data corruption is reported as corruption, not as a
model divergence."""

from __future__ import annotations

import faulthandler
import json
import os
import random
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest
import torch
from golden_edit import index_dict, set_index
from models import Mixed, one_thread

import activation_guard as ag
from activation_guard.store import FORMAT_VERSION


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


X = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad_base")
    with one_thread():
        ag.record(Mixed().eval(), X, path=d / "g.h5")
        ag.record(Mixed().eval(), X, path=d / "g_lzf.h5", compression="lzf")
        ag.record(Mixed().eval(), X, path=d / "g_gzip.h5", compression="gzip")
    return {"plain": d / "g.h5", "lzf": d / "g_lzf.h5", "gzip": d / "g_gzip.h5"}


def check_error(path: Path, err: type[ag.GoldenError] = ag.GoldenError, *words: str,
                report_ok: bool = False) -> ag.GoldenError:
    """Both entry points (read_golden + full read, and compare) raise ``err`` with a useful text.

    With ``report_ok``, compare may instead return a failing report: a consistently forged index
    (valid checksum) that declares other shapes is indistinguishable from another model's golden,
    and compare stops at the shape difference without reading the stored values.
    """
    with pytest.raises(err) as ei, ag.read_golden(path) as r:
        for _ in r.iter_tensors():
            pass
    errors = [ei.value]
    try:
        rep = ag.compare(Mixed().eval(), X, path=path)
    except err as e:
        errors.append(e)
    else:
        assert report_ok, f"compare did not raise {err.__name__}"
        assert not rep.ok, "a bad golden passed"
    for e in errors:
        msg = str(e)
        assert e.path == os.fspath(path) and os.fspath(path) in msg
        assert e.problem and e.problem in msg
        assert "to fix" in msg
        for w in words:
            assert w in msg, (w, msg)
    return ei.value


def edited(src: Path, dst: Path, edit: Callable[[h5py.File], Any]) -> Path:
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


def set_json(f: h5py.File, key: str, obj: Any, fix_crc: bool = True) -> None:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    del f[key]
    f.create_dataset(key, data=np.frombuffer(raw, dtype=np.uint8))
    if fix_crc:
        f.attrs[f"{key}_crc32"] = np.int64(zlib.crc32(raw))


def index_of(f: h5py.File) -> dict[str, Any]:
    return index_dict(f)


def with_index(edit_index: Callable[[dict[str, Any]], Any]) -> Callable[[h5py.File], None]:
    """An edit that rewrites the index consistently (valid checksum): a semantic change only."""

    def edit(f: h5py.File) -> None:
        idx = index_of(f)
        edit_index(idx)
        set_index(f, idx)

    return edit


def tensor_leaves(idx: dict[str, Any]) -> list[dict[str, Any]]:
    return [leaf for c in idx["calls"] for leaf in c["leaves"] if leaf["kind"] == "tensor"]


def packed_leaf(idx: dict[str, Any]) -> dict[str, Any]:
    return next(leaf for leaf in tensor_leaves(idx) if "pack" in leaf)


def data_leaf(idx: dict[str, Any]) -> dict[str, Any]:
    return next(leaf for leaf in tensor_leaves(idx) if "dataset" in leaf)


# --------------------------------------------------------------------------- not a golden at all


def test_missing_file(tmp_path):
    p = tmp_path / "nope.h5"
    with pytest.raises(ag.GoldenNotFoundError) as ei:
        ag.compare(Mixed().eval(), X, path=p)
    assert str(p) in str(ei.value) and "to fix" in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)


def test_zero_length(tmp_path):
    p = tmp_path / "g.h5"
    p.write_bytes(b"")
    check_error(p, ag.GoldenFormatError, "empty")


def test_directory_and_lfs_pointer(tmp_path):
    d = tmp_path / "dir.h5"
    d.mkdir()
    check_error(d, ag.GoldenFormatError, "directory")
    p = tmp_path / "lfs.h5"
    p.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    check_error(p, ag.GoldenFormatError, "git lfs pull")


@pytest.mark.parametrize("n", [1, 8, 100, 4096, 70_000])
def test_random_bytes(tmp_path, n):
    p = tmp_path / "g.h5"
    p.write_bytes(random.Random(n).randbytes(n))
    check_error(p, ag.GoldenFormatError, "not a readable HDF5 file")


@pytest.mark.parametrize("keep", [1, 7, 8, 9, 64, 512, 0.25, 0.5, 0.75, 0.99, -1])
def test_truncated(base, tmp_path, keep):
    data = base["plain"].read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    p = tmp_path / "g.h5"
    p.write_bytes(data[:n])
    check_error(p, ag.GoldenError)


def test_truncated_is_called_truncated(base, tmp_path):
    data = base["plain"].read_bytes()
    p = tmp_path / "g.h5"
    p.write_bytes(data[: len(data) // 2])
    check_error(p, ag.GoldenCorruptError, "truncated")


def test_hdf5_signature_then_garbage(tmp_path):
    p = tmp_path / "g.h5"
    p.write_bytes(b"\x89HDF\r\n\x1a\n" + random.Random(0).randbytes(5000))
    check_error(p, ag.GoldenError)


def test_valid_hdf5_from_another_tool(tmp_path):
    p = tmp_path / "g.h5"
    with h5py.File(p, "w") as f:  # what a Keras/pandas-style file looks like: no ag_format
        f.attrs["backend"] = "tensorflow"
        f.create_group("model_weights").create_dataset("dense/kernel:0", data=np.ones((4, 4), "f4"))
        f["index"] = np.arange(10, dtype=np.uint8)
    check_error(p, ag.GoldenFormatError, "not an activation_guard golden")


def test_newer_format_version(base, tmp_path):
    newer = np.int64(FORMAT_VERSION + 1)
    p = edited(base["plain"], tmp_path / "g.h5", lambda f: f.attrs.__setitem__("ag_format_version", newer))
    check_error(p, ag.GoldenFormatError, "newer", "upgrade activation_guard")


@pytest.mark.parametrize("v", [0, -1])
def test_invalid_format_version(base, tmp_path, v):
    p = edited(base["plain"], tmp_path / "g.h5", lambda f: f.attrs.__setitem__("ag_format_version", np.int64(v)))
    check_error(p, ag.GoldenFormatError, "invalid format version")


# --------------------------------------------------------------------------- wrong attribute types


@pytest.mark.parametrize(
    "name,value",
    [
        ("ag_format", np.int64(1)),
        ("ag_format", np.bytes_(b"some.other.format")),
        ("ag_format", np.array(["activation_guard.golden"] * 2, dtype="S23")),
        ("ag_format_version", "1"),
        ("ag_format_version", np.float64(1.0)),
        ("ag_format_version", np.array([1, 1])),
        ("ag_format_version", np.bool_(True)),
        ("index_crc32", "12345"),
        ("index_crc32", np.float32(1.5)),
        ("meta_crc32", np.array([1, 2, 3], dtype=np.int64)),
    ],
)
def test_wrong_attribute_types(base, tmp_path, name, value):
    p = edited(base["plain"], tmp_path / "g.h5", lambda f: f.attrs.__setitem__(name, value))
    check_error(p, ag.GoldenFormatError)


@pytest.mark.parametrize("name", ["ag_format", "ag_format_version", "index_crc32", "meta_crc32"])
def test_missing_attribute(base, tmp_path, name):
    p = edited(base["plain"], tmp_path / "g.h5", lambda f: f.attrs.__delitem__(name))
    check_error(p, ag.GoldenFormatError)


@pytest.mark.parametrize("name", ["index_crc32", "meta_crc32"])
def test_wrong_checksum_attribute(base, tmp_path, name):
    def edit(f: h5py.File) -> None:
        f.attrs[name] = np.int64(int(f.attrs[name]) ^ 1)

    check_error(edited(base["plain"], tmp_path / "g.h5", edit), ag.GoldenCorruptError, "checksum")


# --------------------------------------------------------------------------- missing parts


@pytest.mark.parametrize("obj", ["index", "meta"])
def test_missing_record(base, tmp_path, obj):
    p = edited(base["plain"], tmp_path / "g.h5", lambda f: f.__delitem__(obj))
    check_error(p, ag.GoldenFormatError, f"no /{obj} record")


@pytest.mark.parametrize("obj", ["packs/0000", "packs", "data/000000", "data"])
def test_missing_dataset(base, tmp_path, obj):
    p = edited(base["plain"], tmp_path / "g.h5", lambda f: f.__delitem__(obj))
    check_error(p, ag.GoldenCorruptError, "missing")


def test_golden_missing_a_layer_fails_at_that_layer(base, tmp_path):
    """A golden that lost a layer's entry (consistently, checksums fixed) is never a pass: the
    live layer is reported as unexpected, first in execution order."""

    def drop(idx: dict[str, Any]) -> None:
        idx["calls"] = [c for c in idx["calls"] if c["name"] != "b"]

    p = edited(base["plain"], tmp_path / "g.h5", with_index(drop))
    rep = ag.compare(Mixed().eval(), X, path=p)
    assert not rep.ok
    assert rep.first_divergence is not None
    assert (rep.first_divergence.name, rep.first_divergence.status) == ("b", "unexpected")
    assert "not in the golden" in str(rep)


def test_golden_missing_a_leaf_fails_as_structure(base, tmp_path):
    def drop(idx: dict[str, Any]) -> None:
        root = next(c for c in idx["calls"] if c["name"] == "")
        root["leaves"] = [leaf for leaf in root["leaves"] if leaf["path"] != "tag"]

    rep = ag.compare(Mixed().eval(), X, path=edited(base["plain"], tmp_path / "g.h5", with_index(drop)))
    assert not rep.ok and rep.first_divergence is not None
    assert rep.first_divergence.name == "" and rep.first_divergence.status == "structure"


# --------------------------------------------------------------------------- malformed index


def _set(key: str, value: Any, which: Callable[[dict[str, Any]], dict[str, Any]] = packed_leaf):
    def e(idx: dict[str, Any]) -> None:
        which(idx)[key] = value

    return e


MALFORMED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "calls not a list": lambda idx: idx.__setitem__("calls", {"a": 1}),
    "call not a dict": lambda idx: idx["calls"].__setitem__(0, ["a"]),
    "call negative": lambda idx: idx["calls"][0].__setitem__("call", -1),
    "call is bool": lambda idx: idx["calls"][0].__setitem__("call", True),
    "name not str": lambda idx: idx["calls"][0].__setitem__("name", 5),
    "leaves missing": lambda idx: idx["calls"][0].pop("leaves"),
    "duplicate layer": lambda idx: idx["calls"].append(idx["calls"][0]),
    "leaf kind unknown": _set("kind", "pickle"),
    "dtype unknown": _set("dtype", "float128"),
    "shape negative": _set("shape", [-1, 4]),
    "shape not ints": _set("shape", [2.0, 4]),
    "shape too deep": _set("shape", [1] * 65),
    "nbytes inconsistent": _set("nbytes", 3),
    "crc not int": _set("crc32", "abc"),
    "offset beyond pack": _set("offset", 10**9),
    "pack missing": _set("pack", 7),
    "pack negative": _set("pack", -1),
    "dataset path escape": _set("dataset", "../../etc/passwd", data_leaf),
    "dataset not in data": _set("dataset", "index", data_leaf),
    "dataset absent": _set("dataset", "data/999999", data_leaf),
    "dataset shape lies": _set("shape", [4, 4099], data_leaf),
    "dataset shape and nbytes lie": lambda idx: data_leaf(idx).update(shape=[4100, 4], nbytes=4100 * 16),
    "huge shape": lambda idx: packed_leaf(idx).update(shape=[2**62, 2**62], nbytes=2**126),
    "str leaf without value": lambda idx: next(
        lf for c in idx["calls"] for lf in c["leaves"] if lf["kind"] == "str").pop("value"),
    "no storage location": lambda idx: packed_leaf(idx).pop("pack"),
    "crc wrong": lambda idx: packed_leaf(idx).__setitem__("crc32", packed_leaf(idx)["crc32"] ^ 1),
}


SHAPE_LIES = {"dataset shape and nbytes lie", "huge shape"}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_index(base, tmp_path, case):
    check_error(edited(base["plain"], tmp_path / "g.h5", with_index(MALFORMED[case])), ag.GoldenError,
                report_ok=case in SHAPE_LIES)


@pytest.mark.parametrize("meta", [[], "x", None, 5])
def test_meta_not_a_record(base, tmp_path, meta):
    check_error(edited(base["plain"], tmp_path / "g.h5", lambda f: set_json(f, "meta", meta)),
                ag.GoldenFormatError, "malformed")


@pytest.mark.parametrize("key", ["meta", "index"])
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_non_numbers_are_not_json(base, tmp_path, key, constant):
    """Python's json reads NaN and Infinity, JSON has no such values and the writer never writes
    them; accepted in meta, a NaN crashed `inspect --json` and `diff --json` (found by review)."""
    def edit(f: h5py.File) -> None:
        obj = json.loads(f[key][()].tobytes())
        obj["x"] = "@@"
        raw = json.dumps(obj).replace('"@@"', constant).encode()
        del f[key]
        f.create_dataset(key, data=np.frombuffer(raw, dtype=np.uint8))
        f.attrs[f"{key}_crc32"] = np.int64(zlib.crc32(raw))

    check_error(edited(base["plain"], tmp_path / "g.h5", edit), ag.GoldenCorruptError, f"/{key} is not valid JSON",
                constant)


@pytest.mark.parametrize("raw", [b"\xff\xfe not utf8", b"{not json", b'{"calls": NaN}'])
def test_index_not_json(base, tmp_path, raw):
    def edit(f: h5py.File) -> None:
        del f["index"]
        f.create_dataset("index", data=np.frombuffer(raw, dtype=np.uint8))
        f.attrs["index_crc32"] = np.int64(zlib.crc32(raw))

    check_error(edited(base["plain"], tmp_path / "g.h5", edit), ag.GoldenError)


@pytest.mark.parametrize("obj,dtype", [("index", "<u2"), ("meta", "<f4"), ("packs/0000", "<i4")])
def test_record_of_the_wrong_type(base, tmp_path, obj, dtype):
    def edit(f: h5py.File) -> None:
        n = f[obj].shape[0]
        del f[obj]
        f.create_dataset(obj, data=np.zeros(n, dtype=dtype))

    check_error(edited(base["plain"], tmp_path / "g.h5", edit), ag.GoldenError, "wrong type")


def test_stored_dataset_with_other_dtype(base, tmp_path):
    def edit(f: h5py.File) -> None:
        name = data_leaf(index_of(f))["dataset"]
        v = f[name][()]
        del f[name]
        f.create_dataset(name, data=v.astype("<f8"))

    check_error(edited(base["plain"], tmp_path / "g.h5", edit), ag.GoldenCorruptError, "index says")


# --------------------------------------------------------------------------- silent data corruption


def _value_offsets(path: Path, which: str) -> list[int]:
    """File offsets of stored leaf values (uncompressed packs/data, or the compressed chunks)."""
    with h5py.File(path, "r") as f:
        idx = index_of(f)
        if which == "pack":
            leaf = packed_leaf(idx)
            base = f[f"packs/{leaf['pack']:04d}"].id.get_offset()
            return [base + leaf["offset"] + k for k in (0, leaf["nbytes"] // 2, leaf["nbytes"] - 1)]
        ds = f[data_leaf(idx)["dataset"]]
        if ds.chunks is None:
            off, n = ds.id.get_offset(), ds.id.get_storage_size()
        else:
            info = ds.id.get_chunk_info(0)
            off, n = info.byte_offset, info.size
        return [off, off + n // 2, off + n - 1]


@pytest.mark.parametrize("which,kind", [("pack", "plain"), ("data", "plain"), ("data", "lzf"), ("data", "gzip")])
@pytest.mark.parametrize("xor", [0x01, 0x80, 0xFF])
def test_flipped_value_bytes_are_corruption_not_divergence(base, tmp_path, which, kind, xor):
    src = base[kind]
    for k, off in enumerate(_value_offsets(src, which)):
        data = bytearray(src.read_bytes())
        data[off] ^= xor
        p = tmp_path / f"g{k}.h5"
        p.write_bytes(bytes(data))
        e = check_error(p, ag.GoldenCorruptError)
        assert "checksum" in str(e) or "could not read" in str(e)
        assert "layer" in str(e)  # the leaf whose bytes are damaged is named


def _legacy_vlen_golden(base, tmp_path):
    """Goldens written before ag_format became fixed-length ASCII store it as a variable-length
    string (in the global heap); readers must still handle those files safely."""
    p = tmp_path / "legacy.h5"
    shutil.copy(base["plain"], p)
    with h5py.File(p, "r+") as f:
        del f.attrs["ag_format"]
        f.attrs["ag_format"] = "activation_guard.golden"  # h5py writes str as a vlen string
    assert ag.compare(Mixed().eval(), X, path=p).ok
    return p


def test_new_goldens_have_no_global_heap(base):
    """ag_format is written as a fixed-length string: a new golden holds no variable-length
    data at all, so the global-heap hang above cannot be reached through one."""
    for p in base.values():
        assert b"GCOL" not in p.read_bytes()


def test_flipped_global_heap_byte_does_not_hang(base, tmp_path):
    """Regression: ``ag_format`` is a variable-length string, kept in the file's global heap.
    Flipping that heap object's size byte made libhdf5 2.0 loop forever inside the attribute
    read (found by the byte-flip sweep). The reader checks the attribute's type and never reads
    a variable-length value, so the file opens and, its checked contents intact, passes."""
    data = bytearray(_legacy_vlen_golden(base, tmp_path).read_bytes())
    heap = data.find(b"GCOL")
    assert heap > 0, "no global heap: ag_format is no longer a vlen string (drop this test)"
    data[heap + 24] ^= 0xFF  # size field of heap object 1 (16-byte collection header + 8)
    p = tmp_path / "g.h5"
    p.write_bytes(bytes(data))
    faulthandler.dump_traceback_later(300, exit=True)  # a regression kills the worker, not CI time
    try:
        assert ag.compare(Mixed().eval(), X, path=p).ok
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_flipped_attribute_type_class_is_refused_before_reading(base, tmp_path):
    """Regression: a flipped bit turned ``ag_format``'s string type into a vlen sequence and
    h5py's attribute read segfaulted; the type class is now checked first."""
    data = bytearray(_legacy_vlen_golden(base, tmp_path).read_bytes())
    name = data.find(b"ag_format\x00")
    # version-1 attribute message: name (padded to 8), then the datatype message: class byte 0x19
    # (version 1, class 9 = variable-length), then flags whose low nibble says 1 = string
    dt = name + 16
    assert data[dt] == 0x19 and data[dt + 1] & 0x0F == 1, "layout changed; update the offset"
    data[dt + 1] &= 0xF0  # 0 = a variable-length *sequence* of the base type
    p = tmp_path / "g.h5"
    p.write_bytes(bytes(data))
    check_error(p, ag.GoldenFormatError, "ag_format", "wrong type")


def test_the_base_goldens_pass(base):
    """Guards every test above: the unedited files are fine, so each failure is the edit's."""
    for p in base.values():
        assert ag.compare(Mixed().eval(), X, path=p).ok

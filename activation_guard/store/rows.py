"""Format 3's row-encoded index: layer calls and their leaves as integer tables.

Why: a compare opens the golden before its forward, and on a model of thousands of small layers
decoding the JSON index of format 2 (a dict per call and per leaf) and checking each field's type
cost ~5 us per layer call, about a third of the per-call compare budget (docs/performance.md).
In format 3 the same records are three ``int64`` tables, each read with one HDF5 read: their
dtype guarantees every field is an integer, whole tables are range-checked with numpy, and the
common leaf (a packed tensor) becomes an entry with no per-field type checks. Strings (layer
names, types, paths, dtypes, string values) are kept once each in the JSON ``/index``, which
now holds only that table of strings and the tables' sizes and checksums.

Every other leaf, and a packed tensor that fails the quick check, is turned back into the
format-2 dict and decoded by :func:`.format.parse_leaf`: one set of rules for what a valid entry
is, whichever form it was stored in. :func:`to_dict` gives the whole index in format 2's JSON
shape (tests edit goldens through it; docs/format.md shows a reader in plain numpy).

Layout (documented for users in docs/format.md)::

    /index   uint8 JSON {"strings": [...], "columns": {"calls": [...], "leaves": [...]},
                         "rows": {"calls": n, "leaves": m, "dims": d},
                         "crc32": {"calls": .., "leaves": .., "dims": ..}}
    /calls   int64[n, 6]   one row per call: forward calls in execution order, then the
                           ``backward`` section's entries in backward execution order
    /leaves  int64[m, 15]  each call's output leaves, then its input leaves, call after call
    /dims    int64[d]      every leaf's shape, one after the other (``ndim`` values each)

-1 means "absent" in every column that may be absent.
"""

from __future__ import annotations

import math
import zlib
from array import array
from typing import Any

import numpy as np

from .._core.errors import GoldenFormatError
from .format import (
    GRAD_KINDS,
    ITEMSIZE,
    LEAF_KINDS,
    ROW_TABLES,
    SECTIONS,
    CallEntry,
    LeafEntry,
    check_backward,
    check_forward,
    parse_leaf,
    refuse_twice,
)

CALL_COLUMNS = ("name", "call", "type", "grad", "leaves", "inputs")
LEAF_COLUMNS = ("kind", "path", "type", "dtype", "ndim", "nbytes", "crc32", "pack", "offset", "dataset", "value",
                "alias_name", "alias_call", "alias_section", "alias_of")
TABLE_DTYPE = np.dtype("<i8")
ALIAS_SECTIONS = SECTIONS + tuple(f"grad-{k}" for k in GRAD_KINDS)
# which key of the format-2 dict holds a leaf's type name: "type" for opaque values, "py" otherwise
_TYPE_KEY = {"tensor": "py", "fingerprint": "py", "str": "py", "alias": "py", "none": "type", "object": "type",
             "ref": "type"}
_KEYS = {  # the keys a writer's leaf dict of each kind may have (anything else cannot be encoded)
    "tensor": {"kind", "path", "dtype", "shape", "nbytes", "crc32", "pack", "offset", "dataset", "py"},
    "fingerprint": {"kind", "path", "dtype", "shape", "nbytes", "crc32", "pack", "offset", "py"},
    "none": {"kind", "path", "type"},
    "object": {"kind", "path", "type"},
    "ref": {"kind", "path", "value", "type"},
    "str": {"kind", "path", "value", "py"},
    "alias": {"kind", "path", "name", "call", "section", "of", "py"},
}
_K_TENSOR = LEAF_KINDS.index("tensor")
(_KIND, _PATH, _TYPE, _DTYPE, _NDIM, _NBYTES, _CRC, _PACK, _OFFSET, _DATASET, _VALUE, _ANAME, _ACALL, _ASECTION,
 _AOF) = range(len(LEAF_COLUMNS))


# ---------------------------------------------------------------------------------------- encode
def encode(index: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header (for ``/index``) and the three tables of a format-2-shaped index dict, as the
    writer builds it. A field the tables cannot hold is a writer bug: ``ValueError``.

    (Record's end: ~1 us per layer call, against ~4 us for format 2's JSON encoding. Types are
    checked in bulk: every string field must be a ``str`` and every integer field an ``int``.)"""
    strings: dict[Any, int] = {}
    sid = strings.setdefault
    call_rows: list[Any] = []  # flat: the tables' rows one after the other
    leaf_rows: list[Any] = []
    dims: list[Any] = []
    tensor, alias = LEAF_KINDS.index("tensor"), LEAF_KINDS.index("alias")
    packed_fields = len(_KEYS["tensor"] - {"dataset", "py"})  # kind, path, dtype, shape, nbytes, crc32, pack, offset
    alias_fields = len(_KEYS["alias"] - {"py"})  # kind, path, name, call, section, of
    sections_code = {k: i for i, k in enumerate(ALIAS_SECTIONS)}
    sections = [(-1, c) for c in index["calls"]]
    sections += [(GRAD_KINDS.index(c["grad"]), c) for c in index.get("backward") or ()]
    for grad, c in sections:
        inputs = c.get("inputs")
        leaves = c["leaves"]
        call_rows += (sid(c["name"], len(strings)), c["call"], sid(c.get("type", ""), len(strings)), grad,
                      len(leaves), -1 if inputs is None else len(inputs))
        for e in (*leaves, *inputs) if inputs else leaves:
            # the two common leaves: their fields are all read below (a missing one is a KeyError),
            # so a count that matches means no other field (a set comparison cost 0.25 us a call)
            kind = e["kind"]
            if kind == "tensor" and "pack" in e and len(e) == packed_fields + ("py" in e):
                shape = e["shape"]
                dims.extend(shape)
                py = e.get("py")
                leaf_rows += (tensor, sid(e["path"], len(strings)), -1 if py is None else sid(py, len(strings)),
                              sid(e["dtype"], len(strings)), len(shape), e["nbytes"], e["crc32"], e["pack"],
                              e["offset"], -1, -1, -1, -1, -1, -1)
            elif kind == "alias" and len(e) == alias_fields + ("py" in e):  # a deep model's every input
                py = e.get("py")
                leaf_rows += (alias, sid(e["path"], len(strings)), -1 if py is None else sid(py, len(strings)), -1, 0,
                              -1, -1, -1, -1, -1, -1, sid(e["name"], len(strings)), e["call"],
                              sections_code[e["section"]], sid(e["of"], len(strings)))
            else:
                leaf_rows += _leaf_row(e, strings, dims)
    bad = next((k for k in strings if type(k) is not str), None)
    if bad is not None:
        raise ValueError(f"index string field holds {type(bad).__name__} {bad!r}")
    tables = {
        "calls": _int_table(call_rows, (-1, len(CALL_COLUMNS))),
        "leaves": _int_table(leaf_rows, (-1, len(LEAF_COLUMNS))),
        "dims": _int_table(dims, (-1,)),
    }
    header = {
        "strings": list(strings),
        "columns": {"calls": list(CALL_COLUMNS), "leaves": list(LEAF_COLUMNS)},
        "rows": {k: int(t.shape[0]) for k, t in tables.items()},
        "crc32": {k: zlib.crc32(t.tobytes()) for k, t in tables.items()},
    }
    return header, tables


def _int_table(flat: list[Any], shape: tuple[int, ...]) -> np.ndarray:
    """``flat`` as little-endian int64 of ``shape``. ``array('q')`` refuses floats, strings and
    ints beyond 64 bits, where numpy would cast a float without a word (a bool would pass as 0 or
    1; the writer makes none)."""
    try:
        packed = array("q", flat)
    except (TypeError, OverflowError) as e:
        bad = next((v for v in flat if type(v) is not int or not -(2**63) <= v < 2**63), None)
        raise ValueError(f"index integer field holds {type(bad).__name__} {bad!r}") from e
    return np.frombuffer(packed, dtype=np.int64).astype(TABLE_DTYPE).reshape(shape)


def _leaf_row(e: dict[str, Any], strings: dict[Any, int], dims: list[Any]) -> tuple[int, ...]:
    def sid(x: Any) -> int:
        return strings.setdefault(x, len(strings))

    kind = e["kind"]
    extra = set(e) - _KEYS[kind]
    if extra:
        raise ValueError(f"a {kind} leaf has fields the index tables cannot hold: {sorted(extra)}")
    row = [-1] * len(LEAF_COLUMNS)
    row[_KIND] = LEAF_KINDS.index(kind)
    row[_PATH] = sid(e["path"])
    tkey = _TYPE_KEY[kind]
    if tkey in e:
        row[_TYPE] = sid(e[tkey])
    row[_NDIM] = 0
    if kind in ("tensor", "fingerprint"):
        row[_DTYPE] = sid(e["dtype"])
        shape = list(e["shape"])
        row[_NDIM] = len(shape)
        dims.extend(shape)
        row[_NBYTES], row[_CRC] = e["nbytes"], e["crc32"]
        if "pack" in e:
            row[_PACK], row[_OFFSET] = e["pack"], e["offset"]
        else:
            ds = e["dataset"]
            if not (type(ds) is str and ds.startswith("data/") and ds[5:].isdigit() and len(ds) == 11):
                raise ValueError(f"dataset name {ds!r}")
            row[_DATASET] = int(ds[5:])
    elif kind in ("str", "ref"):
        row[_VALUE] = sid(e["value"])
    elif kind == "alias":
        row[_ANAME], row[_ACALL] = sid(e["name"]), e["call"]
        row[_ASECTION], row[_AOF] = ALIAS_SECTIONS.index(e["section"]), sid(e["of"])
    return tuple(row)


# ---------------------------------------------------------------------------------------- decode
class Tables:
    """A format-3 index, range-checked: the tables as Python lists plus where each leaf's shape starts."""

    def __init__(self, path: str, header: Any, arrays: dict[str, np.ndarray]):
        self.path = path
        self.strings: list[str] = header["strings"]
        calls, leaves, dims = arrays["calls"], arrays["leaves"], arrays["dims"]
        self._check_calls(calls, leaves)
        self.calls: list[list[int]] = calls.tolist()  # (the leaves' checks name a row's layer call from it)
        self._check_leaves(leaves, dims)
        self.leaves: list[list[int]] = leaves.tolist()
        self.dims: list[int] = dims.tolist()
        ndim = leaves[:, _NDIM]
        self.dim_start: list[int] = (np.cumsum(ndim) - ndim).tolist()

    def _fail(self, msg: str) -> GoldenFormatError:
        return GoldenFormatError(self.path, f"index table {msg}")

    def _check_calls(self, calls: np.ndarray, leaves: np.ndarray) -> None:
        """Every id within its table, every count consistent, before any row is used."""
        ns = len(self.strings)
        grads = len(GRAD_KINDS)
        for col, lo, hi in (("name", 0, ns), ("call", 0, None), ("type", 0, ns), ("grad", -1, grads),
                            ("leaves", 0, None), ("inputs", -1, None)):
            self._in_range("/calls", calls, CALL_COLUMNS.index(col), col, lo, hi)
        grad = calls[:, CALL_COLUMNS.index("grad")]
        backward = np.flatnonzero(grad >= 0)
        if backward.size and np.any(grad[backward[0]:] < 0):
            i = int(backward[0] + np.flatnonzero(grad[backward[0]:] < 0)[0])
            raise self._fail(f"/calls row {i}: a forward call after the backward section began")
        n_in = calls[:, CALL_COLUMNS.index("inputs")]
        if np.any(n_in[backward] >= 0):
            raise self._fail(f"/calls row {int(backward[np.flatnonzero(n_in[backward] >= 0)[0]])}: a backward entry "
                             f"with inputs")
        # (Python ints: int64 sums wrap, and counts near 2**63 could add up to the row count)
        want = sum(calls[:, CALL_COLUMNS.index("leaves")].tolist()) + sum(np.maximum(n_in, 0).tolist())
        if want != leaves.shape[0]:
            raise self._fail(f"/calls lists {want} leaves, /leaves has {leaves.shape[0]} rows")

    def _check_leaves(self, leaves: np.ndarray, dims: np.ndarray) -> None:
        ns = len(self.strings)
        for col, lo, hi in (("kind", 0, len(LEAF_KINDS)), ("path", 0, ns), ("type", -1, ns), ("dtype", -1, ns),
                            ("ndim", 0, 65), ("nbytes", -1, None), ("crc32", -1, 2**32), ("pack", -1, None),
                            ("offset", -1, None), ("dataset", -1, 10**6), ("value", -1, ns), ("alias_name", -1, ns),
                            ("alias_call", -1, None), ("alias_section", -1, len(ALIAS_SECTIONS)),
                            ("alias_of", -1, ns)):
            self._in_range("/leaves", leaves, LEAF_COLUMNS.index(col), col, lo, hi)
        total = int(leaves[:, _NDIM].sum())
        if total != dims.shape[0]:
            raise self._fail(f"/leaves gives {total} dimensions in all, /dims holds {dims.shape[0]}")
        bad = np.flatnonzero(dims < 0)
        if bad.size:
            raise self._fail(f"/dims entry {int(bad[0])} is negative ({int(dims[bad[0]])})")

    def _in_range(self, table: str, arr: np.ndarray, j: int, col: str, lo: int, hi: int | None) -> None:
        if arr.shape[0] == 0:
            return
        c = arr[:, j]
        bad = c < lo if hi is None else (c < lo) | (c >= hi)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            where = "" if table == "/calls" else self._owner(i)
            raise self._fail(f"{table} row {i}{where}: column {col!r} holds {int(c[i])}, outside "
                             f"[{lo}, {'...' if hi is None else hi - 1}]")

    def _owner(self, leaf_row: int) -> str:
        """`` (layer 'x' call 0)`` for a leaf row, when the calls table is valid enough to say."""
        r = 0
        for nsid, call, _t, _g, nl, ni in self.calls:
            r += nl + max(ni, 0)
            if leaf_row < r:
                return f" (layer {self.strings[nsid]!r} call {call})"
        return ""

    # -- rows back into entries
    def leaf_dict(self, j: int) -> dict[str, Any]:
        """Leaf row ``j`` as format 2's index dict (the form :func:`.format.parse_leaf` checks)."""
        row, s = self.leaves[j], self.strings
        kind = LEAF_KINDS[row[_KIND]]
        d: dict[str, Any] = {"kind": kind, "path": s[row[_PATH]]}
        if row[_TYPE] >= 0:
            d[_TYPE_KEY[kind]] = s[row[_TYPE]]
        if kind in ("tensor", "fingerprint"):
            a = self.dim_start[j]
            d["dtype"] = None if row[_DTYPE] < 0 else s[row[_DTYPE]]
            d["shape"] = self.dims[a:a + row[_NDIM]]
            d["nbytes"], d["crc32"] = _opt(row[_NBYTES]), _opt(row[_CRC])
            if row[_PACK] >= 0:
                d["pack"], d["offset"] = row[_PACK], _opt(row[_OFFSET])
            elif row[_DATASET] >= 0:
                d["dataset"] = f"data/{row[_DATASET]:06d}"
        elif kind in ("str", "ref"):
            d["value"] = None if row[_VALUE] < 0 else s[row[_VALUE]]
        elif kind == "alias":
            d["name"] = None if row[_ANAME] < 0 else s[row[_ANAME]]
            d["call"] = _opt(row[_ACALL])
            d["section"] = None if row[_ASECTION] < 0 else ALIAS_SECTIONS[row[_ASECTION]]
            d["of"] = None if row[_AOF] < 0 else s[row[_AOF]]
        return d

    def entries(self) -> tuple[list[CallEntry], list[CallEntry]]:
        """The forward calls and the backward section's entries, each checked as format 2's are.
        (The hot loop of opening a golden: entries are built positionally, a packed tensor leaf
        without its dict, and a call's inputs stay rows until replay reads them.)"""
        p, s, rows, dims, dim_start = self.path, self.strings, self.leaves, self.dims, self.dim_start
        itemsize, prod, tensor = ITEMSIZE, math.prod, _K_TENSOR
        forward: list[CallEntry] = []
        backward: list[CallEntry] = []
        r = 0
        for nsid, call, tsid, grad, nl, ni in self.calls:
            name = s[nsid]
            leaves: list[LeafEntry] = []
            common = True  # every output leaf a packed tensor (none can be an alias: nothing to check)
            for j in range(r, r + nl):
                kind, path, tp, dt, ndim, nbytes, crc, pack, offset = rows[j][:9]
                if kind == tensor and pack >= 0 and offset >= 0 and crc >= 0 and dt >= 0:  # the common leaf
                    a = dim_start[j]
                    shape = tuple(dims[a:a + ndim])
                    dtype = s[dt]
                    size = itemsize.get(dtype)
                    if size is not None and nbytes == size * prod(shape):
                        leaves.append(LeafEntry(s[path], "tensor", dtype, shape, nbytes, crc, pack, offset, None,
                                                "Tensor" if tp < 0 else s[tp]))
                        continue
                common = False
                leaves.append(parse_leaf(p, self.leaf_dict(j), name, call))
            r += nl
            if nl > 1:
                refuse_twice(p, leaves, name, call)
            if grad < 0:
                raw = None if ni < 0 else range(r, r + ni)
                entry = CallEntry(name, call, s[tsid], leaves, len(forward), None, raw, p, self)
                if not common:
                    check_forward(p, entry)
                forward.append(entry)
                if ni > 0:
                    r += ni
            else:
                entry = CallEntry(name, call, s[tsid], leaves, len(backward), GRAD_KINDS[grad], None, p)
                check_backward(p, entry, len(backward))
                backward.append(entry)
        return forward, backward

    def to_dict(self) -> dict[str, Any]:
        """The whole index in format 2's JSON shape (``{"calls": [...], "backward": [...]}``)."""
        out: dict[str, Any] = {"calls": []}
        r = 0
        for nsid, call, tsid, grad, nl, ni in self.calls:
            c: dict[str, Any] = {"name": self.strings[nsid], "call": call, "type": self.strings[tsid],
                                 "leaves": [self.leaf_dict(j) for j in range(r, r + nl)]}
            r += nl
            if ni >= 0:
                c["inputs"] = [self.leaf_dict(j) for j in range(r, r + ni)]
                r += ni
            if grad >= 0:
                out.setdefault("backward", []).append({"grad": GRAD_KINDS[grad], **c})
            else:
                out["calls"].append(c)
        return out


def _opt(v: int) -> int | None:
    return None if v < 0 else v


def check_header(path: str, header: Any) -> dict[str, Any]:
    """The ``/index`` record of a format-3 golden, checked: its string table, columns and table sizes."""
    ok = (isinstance(header, dict) and isinstance(header.get("strings"), list)
          and all(type(x) is str for x in header["strings"])
          and header.get("columns") == {"calls": list(CALL_COLUMNS), "leaves": list(LEAF_COLUMNS)}
          and isinstance(header.get("rows"), dict) and isinstance(header.get("crc32"), dict))
    if ok:
        for k in ROW_TABLES:
            for part in ("rows", "crc32"):
                v = header[part].get(k)
                ok = ok and type(v) is int and v >= 0
    if not ok:
        raise GoldenFormatError(path, "has a malformed index record (format 3's /index: its string table, "
                                      "columns or table sizes)")
    return header


def table_shape(header: dict[str, Any], name: str) -> tuple[int, ...]:
    n = header["rows"][name]
    return (n,) if name == "dims" else (n, len(CALL_COLUMNS if name == "calls" else LEAF_COLUMNS))


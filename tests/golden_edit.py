"""Editing a golden's index in tests, whatever its format version.

Tests that forge goldens edit the index in format 2's JSON shape (a dict per call and per leaf,
docs/format.md). Format 3 stores that index as integer tables beside a JSON table of strings;
:func:`index_dict` reads either form into the dict, and :func:`set_index` writes an edited dict
back in the file's own form, with valid checksums (a deliberate forger's edit). An edit that the
integer tables cannot hold (a shape that is a string, a call count that is a float) is written as
a format-2 file, whose JSON index can hold anything: the reader reads both, and the rules for a
valid entry are the same (:func:`activation_guard.store.format.parse_leaf`).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import h5py
import numpy as np

from activation_guard.store import rows
from activation_guard.store.format import ROW_TABLES


def version(f: h5py.File) -> int:
    return int(f.attrs["ag_format_version"])


def index_dict(f: h5py.File) -> dict[str, Any]:
    """The index of an open golden in format 2's JSON shape."""
    header = json.loads(f["index"][()].tobytes())
    if version(f) < 3:
        return header  # type: ignore[no-any-return]
    arrays = {k: f[k][()] for k in ROW_TABLES}
    return rows.Tables(f.filename, header, arrays).to_dict()


def set_json(f: h5py.File, key: str, obj: Any) -> None:
    """Replace /index or /meta with ``obj`` as JSON, and its checksum attribute."""
    raw = json.dumps(obj, separators=(",", ":")).encode()
    del f[key]
    f.create_dataset(key, data=np.frombuffer(raw, dtype=np.uint8))
    f.attrs[f"{key}_crc32"] = np.int64(zlib.crc32(raw))


def set_index(f: h5py.File, idx: dict[str, Any], *, force_v2: bool = False) -> None:
    """Write ``idx`` (format 2's shape) as the index of the open golden ``f``, checksums fixed."""
    if version(f) >= 3 and not force_v2 and not _has_bool(idx):  # (the tables would store a bool as 0 or 1)
        try:
            header, tables = rows.encode(idx)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError):
            pass  # not representable as integer tables: a format-2 file below
        else:
            for k in ROW_TABLES:
                del f[k]
                f.create_dataset(k, data=tables[k])
            set_json(f, "index", header)
            return
    for k in ROW_TABLES:
        if k in f:
            del f[k]
    if version(f) >= 3:
        f.attrs["ag_format_version"] = np.int64(2)
    set_json(f, "index", idx)


def to_v2(f: h5py.File) -> None:
    """Rewrite an open format-3 golden as format 2 (same records, JSON index)."""
    set_index(f, index_dict(f), force_v2=True)


def _has_bool(obj: Any) -> bool:
    if isinstance(obj, bool):
        return True
    if isinstance(obj, dict):
        return any(_has_bool(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_bool(v) for v in obj)
    return False

"""The checks that decide whether an object in a golden file may be touched at all.

A golden is an HDF5 file from anywhere (a pull request, a downloaded artifact), and HDF5 can do
far more than a golden needs: external links and virtual datasets read other files, external
storage reads raw bytes from other paths, filter ids load plugins from disk and run their code,
a few bytes can declare terabytes, and some damaged attributes crash or hang libhdf5 when read.
Goldens use none of that, so the reader refuses every such file before reading any value.

Why one module: this is the one place that vets a file's HDF5 objects. The reader calls these
checks on every object when it opens a golden and on every size before it allocates; a new
reader path must go through them too, and a reviewer can audit the whole policy here. (The JSON
index is vetted by :func:`.format.parse_calls`; every stored byte by its CRC32 in the reader.)
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from .._core.errors import GoldenCorruptError, GoldenFormatError, GoldenSecurityError
from .format import ALLOWED_FILTERS

DELETE_FIX = "delete this file and re-record the golden"
# deflate cannot exceed ~1032:1 and lzf far less; a dataset claiming more is an allocation bomb
MAX_COMPRESSION_RATIO = 1100
_ATTR_CLASSES = {"int": h5py.h5t.INTEGER, "str": h5py.h5t.STRING}
# the filters that make stored bytes fewer than the values' (what h5py's ``Dataset.compression``
# names: gzip, szip, lzf); shuffle and fletcher32 keep the size
COMPRESSION_FILTERS = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SZIP, h5py.h5z.FILTER_LZF}
VLEN_UNREAD = object()  # a variable-length string attribute whose value was deliberately not read


def scalar_attr(path: str, obj: h5py.h5o.ObjectID, name: str, kind: str) -> Any:
    """Read an attribute of ``obj`` (a low-level id: the reader opens the root group once) only
    after checking its declared type and shape.

    A damaged or hostile file can declare an attribute of another type class (a bit flip in
    the datatype message turned ``ag_format`` into a vlen sequence, and reading it segfaulted
    libhdf5) or an absurd size; both are refused before any value is read.

    Variable-length strings are never read: their bytes live in the file's global heap, and
    libhdf5 loops forever on a global heap whose object size byte was flipped (measured with
    HDF5 2.0). Such an attribute returns :data:`VLEN_UNREAD`; its presence and type are checked.
    """
    # the low-level calls: ``obj.attrs`` makes an AttributeManager (it opens the root group) per
    # use, and reading through it converts types; 4 root attributes cost ~340 us per opened golden
    # that way, ~100 us this way (the checks are the same)
    key = name.encode()
    if not h5py.h5a.exists(obj, key):
        return None
    aid = h5py.h5a.open(obj, key)
    tid = aid.get_type()
    cls = tid.get_class()
    size = tid.get_size()
    if aid.shape != () or cls != _ATTR_CLASSES[kind] or size > 1024 or (kind == "int" and size not in (1, 2, 4, 8)):
        raise GoldenFormatError(
            path, f"attribute {name!r} has the wrong type or shape (a golden stores a scalar {kind})"
        )
    if kind == "str" and tid.is_variable_str():
        return VLEN_UNREAD
    value = np.empty((), dtype=aid.dtype)  # a fixed-size integer or string of <= 1024 bytes, checked above
    aid.read(value)
    return value[()]


def hard_member(path: str, group: h5py.Group, key: str, where: str) -> Any:
    """``group[key]`` as h5py's low-level object id (a ``GroupID``, ``DatasetID``...) when it is
    reached by a hard link, None when absent, else an error: soft and external links (which can
    point into other files) are refused before they are followed.

    Low-level ids because a golden is opened once per compare: the high-level objects cost ~35 us
    each to make (``group.get(key, getlink=True)`` another ~10 us), a quarter of opening a small
    golden; the reader wraps the two groups it keeps (``h5py.Group(gid)``) and reads the rest
    through the ids."""
    name = key.encode()
    try:
        kind = group.id.links.get_info(name).type
    except KeyError:
        return None
    if kind != h5py.h5l.TYPE_HARD:
        link = {h5py.h5l.TYPE_SOFT: "SoftLink", h5py.h5l.TYPE_EXTERNAL: "ExternalLink"}.get(kind, "user-defined link")
        raise GoldenSecurityError(
            path,
            f"{where}{key} is a {link}; goldens contain only plain datasets and groups",
            fix=DELETE_FIX,
        )
    return h5py.h5o.open(group.id, name)


def check_dataset(path: str, ds: h5py.h5d.DatasetID, what: str) -> h5py.h5p.PropDCID:
    """Refuse a dataset that would read other files (virtual layout, external storage) or load
    code (a filter outside :data:`.format.ALLOWED_FILTERS`) when its values are read. Returns its
    creation properties (layout, filters), which callers check further."""
    dcpl = ds.get_create_plist()
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise GoldenSecurityError(
            path, f"{what} is a virtual dataset (it would read other files); goldens never use them", fix=DELETE_FIX
        )
    if dcpl.get_external_count() > 0:
        raise GoldenSecurityError(
            path, f"{what} uses external raw storage (it would read other files); goldens never use it", fix=DELETE_FIX
        )
    for i in range(dcpl.get_nfilters()):
        fid = dcpl.get_filter(i)[0]
        if fid not in ALLOWED_FILTERS:
            raise GoldenSecurityError(
                path,
                f"{what} uses HDF5 filter id {fid}, which goldens never use (it would load a plugin from disk)",
                fix=DELETE_FIX,
            )
    return dcpl


def check_storage(path: str, ds: h5py.h5d.DatasetID, nbytes: int, file_size: int, what: str,
                  dcpl: h5py.h5p.PropDCID | None = None) -> None:
    """Refuse a dataset whose declared size the bytes it stores cannot back, before allocating.
    ``dcpl``: its creation properties, when the caller has them already (:func:`check_dataset`).

    A 3.7 KB file can declare a 4 TiB gzip dataset (unwritten chunks read as fill value), and a
    contiguous layout can declare storage past the end of the file; both are caught here.
    """
    stored = ds.get_storage_size()
    if stored > file_size:
        raise GoldenCorruptError(path, f"{what} claims {stored} stored bytes in a {file_size}-byte file")
    plist = ds.get_create_plist() if dcpl is None else dcpl
    if not any(plist.get_filter(i)[0] in COMPRESSION_FILTERS for i in range(plist.get_nfilters())):
        if stored != nbytes:
            raise GoldenCorruptError(path, f"{what} declares {nbytes} bytes but stores {stored}")
    elif nbytes > stored * MAX_COMPRESSION_RATIO + 4096:
        raise GoldenSecurityError(
            path,
            f"{what} declares {nbytes} bytes backed by only {stored} stored bytes (an allocation bomb or a damaged "
            "file); refusing to allocate it",
            fix=DELETE_FIX,
        )


def direct_location(ds: h5py.h5d.DatasetID) -> tuple[int, int, tuple[int, ...], np.dtype] | None:
    """(file offset, stored bytes, shape, dtype) of a contiguous, unfiltered dataset, or None.

    Why: reopening a dataset through HDF5 to read it costs ~100-200 us plus h5py's property calls;
    for a contiguous dataset without filters the bytes sit at one offset, so the reader reads them
    with one ``pread`` (the checksum in the index still verifies every byte). Only call this on a
    dataset that passed :func:`check_dataset`; the reader still bounds offset + size by the file.
    """
    dcpl = ds.get_create_plist()
    if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or dcpl.get_nfilters() or dcpl.get_external_count():
        return None
    off = ds.get_offset()
    if off is None:  # storage never allocated (empty dataset): read through HDF5
        return None
    return int(off), int(ds.get_storage_size()), tuple(int(n) for n in ds.shape), ds.dtype

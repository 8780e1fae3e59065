"""The HDF5 golden format: atomic, byte-reproducible writes and defensive, streaming reads.

Layout (version 1, documented in docs/format.md)::

    /            attrs: ag_format="activation_guard.golden", ag_format_version=1,
                        index_crc32, meta_crc32
    /meta        uint8[]  UTF-8 JSON: versions, device, model class, input fingerprint, environment
    /index       uint8[]  UTF-8 JSON: layer calls in execution order, each with its leaves
    /packs/NNNN  uint8[]  small leaves' raw bytes packed back to back (<= PACK_BYTES each)
    /data/NNNNNN one dataset per large leaf, in its numpy dtype (or an unsigned view of the
                 same width for bfloat16/float8/complex32), shape as the tensor

Small leaves are packed because HDF5 costs ~60-80 us per dataset; large ones get their own
dataset so plain h5py users can slice them. Every stored leaf carries a CRC32 of its bytes in the
index, so a flipped bit in the file is reported as a corrupt golden, never as a model divergence.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import re
import socket
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch

from . import dtypes
from .capture import Leaf
from .errors import (
    GoldenCorruptError,
    GoldenError,
    GoldenFormatError,
    GoldenNotFoundError,
    GoldenSecurityError,
    GoldenWriteError,
)

FORMAT_NAME = "activation_guard.golden"
FORMAT_VERSION = 1
PACK_BYTES = 8 * 1024 * 1024  # small leaves are packed into datasets of at most this size
SMALL_LEAF_BYTES = 64 * 1024  # leaves up to this size go into packs
MAX_JSON_BYTES = 256 * 1024 * 1024
TMP_MARK = ".ag-tmp."
LFS_SIGNATURE = b"version https://git-lfs"
# HDF5 filter ids a golden may use: deflate, shuffle, fletcher32, lzf. Anything else would make
# libhdf5 look for a filter plugin on disk and run its code.
ALLOWED_FILTERS = {1, 2, 3, 32000}
COMPRESSIONS = {None, "gzip", "lzf"}


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


TRIM_BYTES = 32 * 1024 * 1024  # release freed heap memory after this many bytes written/read
_malloc_trim: Any = None


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; no-op elsewhere).

    Why: hooks that write or read HDF5 datasets interleave libhdf5's small long-lived allocations
    with torch's layer outputs on glibc's heap. The freed outputs are then split by those small
    blocks, can be neither reused whole nor returned, and RSS grew by the total size of all
    activations (+156 MB while recording 170 MB, in a test). One trim costs ~0.4 ms, so the
    store calls it once per ``TRIM_BYTES`` and memory stays bounded by that, not the model size.
    """
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            with contextlib.suppress(Exception):
                _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    if _malloc_trim:
        _malloc_trim(0)


# --------------------------------------------------------------------------- writing


def _tmp_name_re(base: str) -> re.Pattern[str]:
    return re.compile(re.escape(f".{base}.") + r".*?(?:\.h-([A-Za-z0-9-]+))?" + re.escape(TMP_MARK) + r"(\d+)$")


def _host_tag() -> str:
    """This machine's name, reduced to [A-Za-z0-9-]: temp files carry it so that a writer on
    another machine sharing the folder (NFS, a container volume) is never judged dead by pid."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


STALE_FOREIGN_SECONDS = 24 * 3600  # another host's temp file is removed only when this old


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_temps(path: str) -> list[str]:
    """Remove temporary files left by interrupted writes of ``path`` (their writer is dead)."""
    d = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    pat = _tmp_name_re(base)
    removed: list[str] = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    me = _host_tag()
    for n in names:
        m = pat.match(n)
        if not m:
            continue
        host, pid = m.group(1), int(m.group(2))
        full = os.path.join(d, n)
        if host is None or host == me:
            stale = not _pid_alive(pid)
        else:
            try:
                stale = time.time() - os.stat(full).st_mtime > STALE_FOREIGN_SECONDS
            except OSError:
                continue
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(full)
                removed.append(n)
    return removed


def _default_mode(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


class GoldenWriter:
    """Writes one golden into a temporary file next to the target, then atomically replaces it.

    Leaves are written as they are captured (inside the forward hook), so the bytes on disk are
    the snapshot: later in-place ops on the live tensors cannot change them, and nothing needs
    to be cloned.
    """

    def __init__(self, path: str | os.PathLike[str], *, compression: str | None = None):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(map(str, COMPRESSIONS))}, got {compression!r}")
        self.path = os.path.abspath(os.fspath(path))
        self.compression = compression
        d = os.path.dirname(self.path)
        base = os.path.basename(self.path)
        try:
            os.makedirs(d, exist_ok=True)
            cleanup_stale_temps(self.path)
            fd, self.tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=f".h-{_host_tag()}{TMP_MARK}{os.getpid()}", dir=d)
            os.close(fd)
            self.f = h5py.File(self.tmp, "w")
        except OSError as e:
            with contextlib.suppress(Exception):
                os.unlink(self.tmp)
            raise GoldenWriteError(self.path, f"cannot create a temporary file in {d}: {e}", fix="check the folder exists and is writable") from e
        self.calls: list[dict[str, Any]] = []
        self._pack: list[bytes] = []
        self._pack_len = 0
        self._pack_id = 0
        self._data_id = 0
        self._packs_group: h5py.Group | None = None
        self._data_group: h5py.Group | None = None
        self.nbytes = 0
        self.nleaves = 0
        self._untrimmed = 0  # bytes written since the last release_freed_memory()
        self._closed = False

    # -- leaves
    def _flush_pack(self) -> None:
        if not self._pack:
            return
        if self._packs_group is None:
            self._packs_group = self.f.create_group("packs")
        buf = np.frombuffer(b"".join(self._pack), dtype=np.uint8)
        self._packs_group.create_dataset(f"{self._pack_id:04d}", data=buf, track_times=False)
        self._pack_id += 1
        self._pack = []
        self._pack_len = 0

    def _write_tensor(self, t: torch.Tensor) -> dict[str, Any]:
        info = dtypes.info_for(t.dtype)
        raw = dtypes.tensor_bytes(t)
        nbytes = int(raw.size)
        crc = zlib.crc32(raw.data) if nbytes else 0
        entry: dict[str, Any] = {
            "kind": "tensor",
            "dtype": info.name,
            "shape": [int(s) for s in t.shape],
            "nbytes": nbytes,
            "crc32": crc,
        }
        if nbytes <= SMALL_LEAF_BYTES:
            if self._pack_len + nbytes > PACK_BYTES:
                self._flush_pack()
            entry["pack"] = self._pack_id
            entry["offset"] = self._pack_len
            self._pack.append(raw.tobytes())  # copy: the snapshot
            self._pack_len += nbytes
        else:
            if self._data_group is None:
                self._data_group = self.f.create_group("data")
            name = f"{self._data_id:06d}"
            self._data_id += 1
            arr = raw.view(info.storage).reshape(tuple(t.shape))
            kw: dict[str, Any] = {"track_times": False}
            if self.compression is not None:
                kw["compression"] = self.compression
                kw["shuffle"] = True
            self._data_group.create_dataset(name, data=arr, **kw)
            entry["dataset"] = f"data/{name}"
            self._untrimmed += nbytes
            if self._untrimmed >= TRIM_BYTES:
                self._untrimmed = 0
                release_freed_memory()
        self.nbytes += nbytes
        return entry

    def add_call(self, name: str, call: int, module_type: str, leaves: list[Leaf]) -> None:
        out = []
        for leaf in leaves:
            if leaf.kind == "tensor":
                assert leaf.tensor is not None
                try:
                    e = self._write_tensor(leaf.tensor)
                except OSError as err:  # disk full, file size limit, I/O error: not a model problem
                    raise GoldenWriteError(self.path, f"could not write layer {name or '<root>'!r} call {call} ({err}); the previous golden, if any, is unchanged", fix="free disk space or fix permissions, then re-record") from err
                if leaf.type_name != "Tensor":
                    e["py"] = leaf.type_name
            elif leaf.kind == "str":
                e = {"kind": "str", "value": leaf.value, "py": leaf.type_name}
            else:
                e = {"kind": leaf.kind, "type": leaf.type_name}
            e["path"] = leaf.path
            out.append(e)
            self.nleaves += 1
        self.calls.append({"name": name, "call": call, "type": module_type, "leaves": out})

    # -- finishing
    def commit(self, meta: dict[str, Any]) -> None:
        try:
            self._flush_pack()
            index = {"calls": self.calls}
            ib = _json_bytes(index)
            mb = _json_bytes(meta)
            self.f.create_dataset("index", data=np.frombuffer(ib, dtype=np.uint8), track_times=False)
            self.f.create_dataset("meta", data=np.frombuffer(mb, dtype=np.uint8), track_times=False)
            # fixed-length ASCII: no global-heap object for a reader to trip over (see _scalar_attr)
            self.f.attrs["ag_format"] = np.bytes_(FORMAT_NAME)
            self.f.attrs["ag_format_version"] = np.int64(FORMAT_VERSION)
            self.f.attrs["index_crc32"] = np.int64(zlib.crc32(ib))
            self.f.attrs["meta_crc32"] = np.int64(zlib.crc32(mb))
            self.f.close()
            self._closed = True
            os.chmod(self.tmp, _default_mode(self.path))
            with open(self.tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(self.tmp, self.path)
        except (OSError, RuntimeError) as e:  # h5py reports a failed flush on close as RuntimeError
            self.abort()
            raise GoldenWriteError(self.path, f"could not write the golden ({e}); the previous golden, if any, is unchanged", fix="free disk space or fix permissions, then re-record") from e
        except BaseException:
            self.abort()
            raise
        try:
            dfd = os.open(os.path.dirname(self.path), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def abort(self) -> None:
        if not self._closed:
            with contextlib.suppress(Exception):
                self.f.close()
            self._closed = True
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


# --------------------------------------------------------------------------- reading


@dataclass
class LeafEntry:
    path: str
    kind: str  # tensor | none | str | object
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    crc32: int = 0
    pack: int | None = None
    offset: int = 0
    dataset: str | None = None
    type_name: str = ""
    value: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class CallEntry:
    name: str
    call: int
    type_name: str
    leaves: list[LeafEntry]
    position: int  # 0-based position in the golden's execution order


def is_lfs_pointer(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(LFS_SIGNATURE)) == LFS_SIGNATURE
    except OSError:
        return False


_ATTR_CLASSES = {"int": h5py.h5t.INTEGER, "str": h5py.h5t.STRING}
VLEN_UNREAD = object()  # a variable-length string attribute whose value was deliberately not read


def _scalar_attr(path: str, obj: h5py.HLObject, name: str, kind: str) -> Any:
    """Read a root attribute only after checking its declared type and shape.

    A damaged or hostile file can declare an attribute of another type class (a bit flip in
    the datatype message turned ``ag_format`` into a vlen sequence, and reading it segfaulted
    libhdf5) or an absurd size; both are refused before any value is read.

    Variable-length strings are never read: their bytes live in the file's global heap, and
    libhdf5 loops forever on a global heap whose object size byte was flipped (measured with
    HDF5 2.0). Such an attribute returns :data:`VLEN_UNREAD`; its presence and type are checked.
    """
    if name not in obj.attrs:
        return None
    aid = obj.attrs.get_id(name)
    tid = aid.get_type()
    cls = tid.get_class()
    size = tid.get_size()
    if aid.shape != () or cls != _ATTR_CLASSES[kind] or size > 1024 or (kind == "int" and size not in (1, 2, 4, 8)):
        raise GoldenFormatError(path, f"attribute {name!r} has the wrong type or shape (a golden stores a scalar {kind})")
    if kind == "str" and tid.is_variable_str():
        return VLEN_UNREAD
    return obj.attrs[name]


def _check_dataset(path: str, ds: h5py.Dataset, what: str) -> None:
    dcpl = ds.id.get_create_plist()
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise GoldenSecurityError(path, f"{what} is a virtual dataset (it would read other files); goldens never use them", fix="delete this file and re-record the golden")
    if dcpl.get_external_count() > 0:
        raise GoldenSecurityError(path, f"{what} uses external raw storage (it would read other files); goldens never use it", fix="delete this file and re-record the golden")
    for i in range(dcpl.get_nfilters()):
        fid = dcpl.get_filter(i)[0]
        if fid not in ALLOWED_FILTERS:
            raise GoldenSecurityError(path, f"{what} uses HDF5 filter id {fid}, which goldens never use (it would load a plugin from disk)", fix="delete this file and re-record the golden")


# deflate cannot exceed ~1032:1 and lzf far less; a dataset claiming more is an allocation bomb
MAX_COMPRESSION_RATIO = 1100


def _check_storage(path: str, ds: h5py.Dataset, nbytes: int, file_size: int, what: str) -> None:
    """Refuse a dataset whose declared size the bytes it stores cannot back, before allocating.

    A 3.7 KB file can declare a 4 TiB gzip dataset (unwritten chunks read as fill value), and a
    contiguous layout can declare storage past the end of the file; both are caught here.
    """
    stored = ds.id.get_storage_size()
    if stored > file_size:
        raise GoldenCorruptError(path, f"{what} claims {stored} stored bytes in a {file_size}-byte file")
    if ds.compression is None:
        if stored != nbytes:
            raise GoldenCorruptError(path, f"{what} declares {nbytes} bytes but stores {stored}")
    elif nbytes > stored * MAX_COMPRESSION_RATIO + 4096:
        raise GoldenSecurityError(path, f"{what} declares {nbytes} bytes backed by only {stored} stored bytes (an allocation bomb or a damaged file); refusing to allocate it", fix="delete this file and re-record the golden")


def _direct_location(ds: h5py.Dataset) -> tuple[int, int, tuple[int, ...], np.dtype] | None:
    """(file offset, stored bytes, shape, dtype) of a contiguous, unfiltered dataset, or None.

    Why: reopening a dataset through HDF5 to read it costs ~100-200 us plus h5py's property calls;
    for a contiguous dataset without filters the bytes sit at one offset, so ``load`` reads them
    with one ``pread`` (the checksum in the index still verifies every byte).
    """
    dcpl = ds.id.get_create_plist()
    if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or dcpl.get_nfilters() or dcpl.get_external_count():
        return None
    off = ds.id.get_offset()
    if off is None:  # storage never allocated (empty dataset): read through HDF5
        return None
    return int(off), int(ds.id.get_storage_size()), tuple(int(n) for n in ds.shape), ds.dtype


def _pread_into(path: str, fd: int, arr: np.ndarray, offset: int, what: str) -> None:
    view = arr.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise GoldenCorruptError(path, f"{what}: the file ends before the stored values do (truncated)")
        done += n


def _hard_member(path: str, group: h5py.Group, key: str, where: str) -> Any:
    link = group.get(key, getlink=True)
    if link is None:
        return None
    if not isinstance(link, h5py.HardLink):
        raise GoldenSecurityError(path, f"{where}{key} is a {type(link).__name__}; goldens contain only plain datasets and groups", fix="delete this file and re-record the golden")
    return group[key]


class GoldenReader:
    """Opens a golden defensively and serves leaves one at a time (streaming compare).

    Every object is reached through hard links only (checked at every level), datasets are
    checked for external storage, virtual layout and unexpected filters before any data is
    read, and nothing is allocated beyond the size the index declares and the caller asked for.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        p = self.path
        if not os.path.exists(p):
            raise GoldenNotFoundError(p, "file does not exist")
        if os.path.isdir(p):
            raise GoldenFormatError(p, "is a directory, not a golden file", fix="pass the path of a .h5 golden")
        if is_lfs_pointer(p):
            raise GoldenFormatError(p, "is a Git LFS pointer, not the golden itself", fix="run `git lfs pull` to fetch the real file")
        size = os.path.getsize(p)
        if size == 0:
            raise GoldenFormatError(p, "is empty (0 bytes)")
        self.file_size = size
        try:
            self.f = h5py.File(p, "r", locking=False)
        except OSError as e:
            msg = str(e)
            if "truncated" in msg:
                raise GoldenCorruptError(p, f"is truncated ({msg})") from None
            raise GoldenFormatError(p, f"is not a readable HDF5 file ({msg})") from None
        try:
            self._open()
        except GoldenError:
            self.f.close()
            raise
        except Exception as e:
            self.f.close()
            raise GoldenCorruptError(p, f"is damaged or inconsistent ({type(e).__name__}: {e})") from None
        self._pack_cache: tuple[int, np.ndarray] | None = None
        self._untrimmed = 0  # bytes loaded since the last release_freed_memory()
        self._fd: int | None = None  # libhdf5's own descriptor (sec2 driver), for direct reads
        if hasattr(os, "preadv"):
            with contextlib.suppress(Exception):
                fd = self.f.id.get_vfd_handle()
                self._fd = fd if isinstance(fd, int) and fd >= 0 else None

    # -- validation
    def _open(self) -> None:
        p, f = self.path, self.f
        fmt = _scalar_attr(p, f, "ag_format", "str")
        if isinstance(fmt, bytes):
            fmt = fmt.decode(errors="replace")
        if fmt is not VLEN_UNREAD and fmt != FORMAT_NAME:
            raise GoldenFormatError(p, "is an HDF5 file but not an activation_guard golden (no ag_format attribute)", fix="point at a golden written by activation_guard, or re-record it")
        ver = _scalar_attr(p, f, "ag_format_version", "int")
        if not isinstance(ver, (int, np.integer)):
            raise GoldenFormatError(p, f"has a malformed ag_format_version attribute ({ver!r})")
        if int(ver) > FORMAT_VERSION:
            raise GoldenFormatError(p, f"was written in golden format version {int(ver)}, newer than this activation_guard understands ({FORMAT_VERSION})", fix="upgrade activation_guard (pip install -U activation_guard)")
        if int(ver) < 1:
            raise GoldenFormatError(p, f"has an invalid format version {int(ver)}")
        root: dict[str, Any] = {}  # each root object opened once: a lookup by name costs ~50 us
        for key in f:
            if key not in ("index", "meta", "packs", "data"):
                raise GoldenFormatError(p, f"contains an unexpected object /{key}")
            root[key] = _hard_member(p, f, key, "/")
        self._groups: dict[str, h5py.Group] = {}
        self._direct: dict[str, tuple[int, int, tuple[int, ...], np.dtype]] = {}
        for grp_name in ("packs", "data"):
            g = root.get(grp_name)
            if g is None:
                continue
            if not isinstance(g, h5py.Group):
                raise GoldenFormatError(p, f"/{grp_name} should be a group")
            self._groups[grp_name] = g
            for key in g:
                obj = _hard_member(p, g, key, f"/{grp_name}/")
                if not isinstance(obj, h5py.Dataset):
                    raise GoldenFormatError(p, f"/{grp_name}/{key} should be a dataset")
                _check_dataset(p, obj, f"/{grp_name}/{key}")  # refuse hostile files at open
                if grp_name == "data":
                    loc = _direct_location(obj)
                    if loc is not None:
                        self._direct[key] = loc
        self.meta = self._read_json("meta", root.get("meta"))
        index = self._read_json("index", root.get("index"))
        if not isinstance(self.meta, dict) or not isinstance(index, dict) or not isinstance(index.get("calls"), list):
            raise GoldenFormatError(p, "has a malformed index or meta record")
        self.calls = [self._parse_call(c, i) for i, c in enumerate(index["calls"])]
        self.by_key: dict[tuple[str, int], CallEntry] = {}
        for c in self.calls:
            if (c.name, c.call) in self.by_key:
                raise GoldenFormatError(p, f"lists layer {c.name!r} call {c.call} twice")
            self.by_key[(c.name, c.call)] = c

    def _read_json(self, key: str, ds: Any) -> Any:
        p = self.path
        if ds is None:
            raise GoldenFormatError(p, f"has no /{key} record (incomplete or not written by activation_guard)")
        if not isinstance(ds, h5py.Dataset) or ds.dtype != np.uint8 or ds.ndim != 1:
            raise GoldenFormatError(p, f"/{key} has the wrong type")
        _check_dataset(p, ds, f"/{key}")
        if ds.size > min(MAX_JSON_BYTES, self.file_size) or ds.id.get_storage_size() != ds.size:
            raise GoldenCorruptError(p, f"/{key} declares {ds.size} bytes but stores {ds.id.get_storage_size()}")
        raw = ds[()].tobytes()
        want = _scalar_attr(p, self.f, f"{key}_crc32", "int")
        if not isinstance(want, (int, np.integer)):
            raise GoldenFormatError(p, f"has a malformed {key}_crc32 attribute ({want!r})")
        if zlib.crc32(raw) != int(want):
            raise GoldenCorruptError(p, f"/{key} fails its checksum (the file was modified or damaged)")
        try:
            return json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise GoldenCorruptError(p, f"/{key} is not valid JSON ({e})") from None

    def _parse_call(self, c: Any, position: int) -> CallEntry:
        p = self.path
        if not isinstance(c, dict):
            raise GoldenFormatError(p, f"index entry #{position} is malformed")
        name, call, tname, leaves = c.get("name"), c.get("call"), c.get("type", ""), c.get("leaves")
        if not isinstance(name, str) or not isinstance(call, int) or isinstance(call, bool) or call < 0 or not isinstance(leaves, list) or not isinstance(tname, str):
            raise GoldenFormatError(p, f"index entry #{position} is malformed")
        return CallEntry(name, call, tname, [self._parse_leaf(leaf, name, call) for leaf in leaves], position)

    def _parse_leaf(self, e: Any, lname: str, call: int) -> LeafEntry:
        p = self.path
        where = f"layer {lname!r} call {call}"
        if not isinstance(e, dict) or not isinstance(e.get("path"), str) or e.get("kind") not in ("tensor", "none", "str", "object"):
            raise GoldenFormatError(p, f"index entry for {where} has a malformed leaf")
        kind = e["kind"]
        if kind == "none":
            return LeafEntry(e["path"], kind, type_name="None")
        if kind == "object":
            return LeafEntry(e["path"], kind, type_name=str(e.get("type", "")))
        if kind == "str":
            v = e.get("value")
            if not isinstance(v, str):
                raise GoldenFormatError(p, f"index entry for {where} has a malformed string leaf")
            return LeafEntry(e["path"], kind, type_name=str(e.get("py", "str")), value=v)
        dt, shape, nbytes, crc = e.get("dtype"), e.get("shape"), e.get("nbytes"), e.get("crc32")
        if dt not in dtypes.BY_NAME:
            raise GoldenFormatError(p, f"{where} path {e['path']!r} has unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape) or len(shape) > 64:
            raise GoldenFormatError(p, f"{where} path {e['path']!r} has a malformed shape {shape!r}")
        info = dtypes.BY_NAME[dt]
        n = 1
        for s in shape:
            n *= s
        if not isinstance(nbytes, int) or nbytes != n * info.storage.itemsize or not isinstance(crc, int):
            raise GoldenFormatError(p, f"{where} path {e['path']!r} has an inconsistent size or checksum record")
        entry = LeafEntry(e["path"], kind, dt, tuple(shape), nbytes, crc, type_name=str(e.get("py", "Tensor")))
        if "pack" in e:
            pk, off = e.get("pack"), e.get("offset")
            if not isinstance(pk, int) or not isinstance(off, int) or pk < 0 or off < 0:
                raise GoldenFormatError(p, f"{where} path {e['path']!r} has a malformed pack location")
            entry.pack, entry.offset = pk, off
        elif isinstance(e.get("dataset"), str) and re.fullmatch(r"data/\d{6}", e["dataset"]):
            entry.dataset = e["dataset"]
        else:
            raise GoldenFormatError(p, f"{where} path {e['path']!r} has no valid storage location")
        return entry

    # -- data
    def _pack_bytes(self, pack: int) -> np.ndarray:
        if self._pack_cache is not None and self._pack_cache[0] == pack:
            return self._pack_cache[1]
        p = self.path
        key = f"{pack:04d}"
        ds = self._member("packs", key)  # every member was walked (hard links only) in _open
        if ds is None:
            raise GoldenCorruptError(p, f"pack /packs/{key} referenced by the index is missing")
        if ds.dtype != np.uint8 or ds.ndim != 1 or ds.size > PACK_BYTES * 4:
            raise GoldenFormatError(p, f"/packs/{key} has the wrong type or size")
        _check_storage(p, ds, int(ds.size), self.file_size, f"/packs/{key}")
        arr = ds[()]
        self._pack_cache = (pack, arr)
        return arr

    def _member(self, group: str, key: str) -> Any:
        """``/group/key`` with one HDF5 lookup. ``_open`` walked every member (hard links only)
        and vetted it with ``_check_dataset``, so reads do not repeat those checks."""
        g = self._groups.get(group)
        if g is None:
            return None
        try:
            return g[key]
        except KeyError:
            return None

    def packed_bytes(self, entry: LeafEntry, where: str = "") -> np.ndarray:
        """The checksum-verified raw bytes of a packed (small) leaf, without copying them: lets
        the comparator settle bit-identical outputs with one memcmp, no tensor built."""
        p = self.path
        assert entry.pack is not None
        label = where or entry.path
        buf = self._pack_bytes(entry.pack)
        if entry.offset + entry.nbytes > buf.size:
            raise GoldenCorruptError(p, f"{label}: pack /packs/{entry.pack:04d} is shorter than the index says")
        raw = buf[entry.offset : entry.offset + entry.nbytes]
        if entry.nbytes and zlib.crc32(raw.data) != entry.crc32:
            raise GoldenCorruptError(p, f"{label}: stored values fail their checksum (the file was modified or damaged after recording)")
        return raw

    def load(self, entry: LeafEntry, where: str = "") -> torch.Tensor:
        """Read one leaf, verify its checksum, return a CPU tensor of its recorded dtype."""
        p = self.path
        assert entry.kind == "tensor" and entry.dtype is not None
        info = dtypes.BY_NAME[entry.dtype]
        label = where or entry.path
        try:
            if entry.pack is not None:
                return dtypes.tensor_from_bytes(self.packed_bytes(entry, label).copy(), info, entry.shape)
            assert entry.dataset is not None
            key = entry.dataset.split("/", 1)[1]
            loc = self._direct.get(key) if self._fd is not None else None
            if loc is not None:  # contiguous and unfiltered, vetted in _open: one pread, no HDF5
                off, stored, shape, dt = loc
                if shape != entry.shape or dt != info.storage:
                    raise GoldenCorruptError(p, f"{label}: /{entry.dataset} has shape {shape} dtype {dt}, index says {entry.shape} {info.storage}")
                if stored != entry.nbytes or off + stored > self.file_size:
                    raise GoldenCorruptError(p, f"{label}: /{entry.dataset} stores {stored} bytes at offset {off} of a {self.file_size}-byte file; the index says {entry.nbytes}")
            else:
                ds = self._member("data", key)
                if ds is None:
                    raise GoldenCorruptError(p, f"{label}: dataset /{entry.dataset} is missing")
                if ds.shape != entry.shape or ds.dtype != info.storage:
                    raise GoldenCorruptError(p, f"{label}: /{entry.dataset} has shape {ds.shape} dtype {ds.dtype}, index says {entry.shape} {info.storage}")
                _check_storage(p, ds, entry.nbytes, self.file_size, f"{label}: /{entry.dataset}")
            self._untrimmed += entry.nbytes
            if self._untrimmed >= TRIM_BYTES:  # see release_freed_memory: keeps compare's RSS bounded
                self._untrimmed = 0
                release_freed_memory()
            arr = np.empty(entry.shape, dtype=info.storage)
            if arr.size and loc is not None:
                assert self._fd is not None
                _pread_into(p, self._fd, arr, off, f"{label}: /{entry.dataset}")
            elif arr.size:
                ds.read_direct(arr)
            if entry.nbytes and zlib.crc32(arr.reshape(-1).view(np.uint8).data) != entry.crc32:
                raise GoldenCorruptError(p, f"{label}: stored values fail their checksum (the file was modified or damaged after recording)")
            return dtypes.tensor_from_storage(arr, info)
        except GoldenError:
            raise
        except Exception as e:
            raise GoldenCorruptError(p, f"{label}: could not read stored values ({type(e).__name__}: {e})") from None

    def iter_tensors(self) -> Iterator[tuple[CallEntry, LeafEntry, torch.Tensor]]:
        for c in self.calls:
            for leaf in c.leaves:
                if leaf.kind == "tensor":
                    yield c, leaf, self.load(leaf, f"layer {c.name!r} call {c.call} path {leaf.path!r}")

    def close(self) -> None:
        self._pack_cache = None
        with contextlib.suppress(Exception):
            self.f.close()

    def __enter__(self) -> GoldenReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

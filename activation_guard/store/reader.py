"""Reading one golden: opened defensively, then served one leaf at a time (streaming compare).

Opening vets the whole file's structure once (through :mod:`.safety`), checks the index and meta
checksums and decodes the index (:func:`.format.parse_calls`); loading a leaf then costs one read
and one CRC32. Two tricks keep compare fast without weakening that: a contiguous, unfiltered
dataset is read with one ``pread`` at the offset vetted at open (no HDF5 call per leaf), and the
last pack read is cached, so consecutive small leaves cost one memcmp-ready slice each
(:meth:`GoldenReader.packed_bytes`).

About 470 lines: the defensive opening (format 3's index tables read and vetted like every other
dataset), the index checks and the per-leaf reads share the vetted locations and the pack cache of
one open file; the structure checks themselves are in :mod:`.safety`, the index format in
:mod:`.format` and format 3's tables in :mod:`.rows`.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import torch

from .._core import dtypes
from .._core.errors import GoldenCorruptError, GoldenError, GoldenFormatError, GoldenNotFoundError
from .._core.gcpause import collector_off
from ..fingerprints.fingerprint import Fingerprint, FingerprintFormatError, FingerprintParams
from . import fingerprints as fpstore
from . import rows
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LFS_SIGNATURE,
    MAX_JSON_BYTES,
    PACK_BYTES,
    ROOT_MEMBERS,
    ROW_TABLES,
    CallEntry,
    LeafEntry,
    parse_backward,
    parse_calls,
)
from .memory import TrimCounter
from .safety import (
    VLEN_UNREAD,
    check_dataset,
    check_storage,
    direct_location,
    hard_member,
    scalar_attr,
)

if TYPE_CHECKING:
    from ..values.leaves import Leaf
    from .legacy import LiveView

CORRUPT_VALUES = "stored values fail their checksum (the file was modified or damaged after recording)"


def is_lfs_pointer(path: str) -> bool:
    """Whether ``path`` is a Git LFS pointer file (the golden was checked out without ``git lfs pull``)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(LFS_SIGNATURE)) == LFS_SIGNATURE
    except OSError:
        return False


def _pread_into(path: str, fd: int, arr: np.ndarray, offset: int, what: str) -> None:
    view = arr.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise GoldenCorruptError(path, f"{what}: the file ends before the stored values do (truncated)")
        done += n


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
            raise GoldenFormatError(
                p, "is a Git LFS pointer, not the golden itself", fix="run `git lfs pull` to fetch the real file"
            )
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
        self._trim = TrimCounter()  # keeps compare's RSS bounded (see memory.release_freed_memory)
        self._fd: int | None = None  # libhdf5's own descriptor (sec2 driver), for direct reads
        if hasattr(os, "preadv"):
            with contextlib.suppress(Exception):
                fd = self.f.id.get_vfd_handle()
                self._fd = fd if isinstance(fd, int) and fd >= 0 else None

    # -- validation
    def _open(self) -> None:
        p, f = self.path, self.f
        # the root group opened as such: a damaged root header fails here (the file's attributes
        # read through the file id would just seem absent, and the file "not a golden")
        self._root_id = h5py.h5o.open(f.id, b"/")
        fmt = scalar_attr(p, self._root_id, "ag_format", "str")
        if isinstance(fmt, bytes):
            fmt = fmt.decode(errors="replace")
        if fmt is not VLEN_UNREAD and fmt != FORMAT_NAME:
            raise GoldenFormatError(
                p,
                "is an HDF5 file but not an activation_guard golden (no ag_format attribute)",
                fix="point at a golden written by activation_guard, or re-record it",
            )
        ver = scalar_attr(p, self._root_id, "ag_format_version", "int")
        if not isinstance(ver, (int, np.integer)):
            raise GoldenFormatError(p, f"has a malformed ag_format_version attribute ({ver!r})")
        if int(ver) > FORMAT_VERSION:
            raise GoldenFormatError(
                p,
                f"was written in golden format version {int(ver)}, newer than this activation_guard understands "
                f"({FORMAT_VERSION})",
                fix="upgrade activation_guard (pip install -U activation_guard)",
            )
        if int(ver) < 1:
            raise GoldenFormatError(p, f"has an invalid format version {int(ver)}")
        self.version = int(ver)
        root: dict[str, Any] = {}  # each root object opened once, as a low-level id (safety.hard_member)
        members = ROOT_MEMBERS + ROW_TABLES if self.version >= 3 else ROOT_MEMBERS
        for key in f:
            if key not in members:
                raise GoldenFormatError(p, f"contains an unexpected object /{key}")
            root[key] = hard_member(p, f, key, "/")
        self._groups: dict[str, h5py.Group] = {}
        self._direct: dict[str, tuple[int, int, tuple[int, ...], np.dtype]] = {}
        for grp_name in ("packs", "data"):
            gid = root.get(grp_name)
            if gid is None:
                continue
            if not isinstance(gid, h5py.h5g.GroupID):
                raise GoldenFormatError(p, f"/{grp_name} should be a group")
            g = self._groups[grp_name] = h5py.Group(gid)
            for key in g:
                if not isinstance(key, str):  # h5py gives a name that is not UTF-8 as bytes
                    raise GoldenFormatError(p, f"/{grp_name} holds a member named {key!r}, not UTF-8; goldens name "
                                               f"theirs with digits")
                obj = hard_member(p, g, key, f"/{grp_name}/")
                if not isinstance(obj, h5py.h5d.DatasetID):
                    raise GoldenFormatError(p, f"/{grp_name}/{key} should be a dataset")
                dcpl = check_dataset(p, obj, f"/{grp_name}/{key}")  # refuse hostile files at open
                if grp_name == "packs" and dcpl.get_layout() == h5py.h5d.CHUNKED:  # (filters need chunks)
                    # the writer keeps packs contiguous; a compressed one is decompressed whole for
                    # every leaf read from it (a 580 KB file cost minutes of CPU, textconv included)
                    raise GoldenFormatError(p, f"/packs/{key} is chunked or compressed; goldens store packs "
                                               f"contiguous (only /data/* may be compressed)")
                if grp_name == "data":
                    loc = direct_location(obj)
                    if loc is not None:
                        self._direct[key] = loc
        with collector_off():  # thousands of acyclic containers (gcpause.collector_off)
            self._read_index(root)
        self._open_fingerprints()

    def _read_index(self, root: dict[str, Any]) -> None:
        p = self.path
        self.meta = self._read_json("meta", root.get("meta"))
        index = self._read_json("index", root.get("index"))
        if not isinstance(self.meta, dict):
            raise GoldenFormatError(p, "has a malformed index or meta record")
        if self.version >= 3:  # the index as integer tables beside a table of strings (store.rows)
            header = rows.check_header(p, index)
            arrays = {k: self._read_table(k, root.get(k), rows.table_shape(header, k), header["crc32"][k])
                      for k in ROW_TABLES}
            self.calls, self.backward = rows.Tables(p, header, arrays).entries()
        else:
            if not isinstance(index, dict) or not isinstance(index.get("calls"), list):
                raise GoldenFormatError(p, "has a malformed index or meta record")
            self.calls = parse_calls(p, index["calls"])
            self.backward = parse_backward(p, index.get("backward"))  # gradients
        self.by_key: dict[tuple[str, int], CallEntry] = {}
        for c in self.calls:
            if (c.name, c.call) in self.by_key:
                raise GoldenFormatError(p, f"lists layer {c.name!r} call {c.call} twice")
            self.by_key[(c.name, c.call)] = c
        # --- gradients: the optional backward section, in backward execution order
        self.by_grad: dict[tuple[str, str, int], CallEntry] = {}
        for c in self.backward:
            assert c.grad is not None
            if (c.grad, c.name, c.call) in self.by_grad:
                raise GoldenFormatError(p, f"lists the {c.grad} gradient of layer {c.name!r} call {c.call} twice")
            self.by_grad[(c.grad, c.name, c.call)] = c
        # --- end gradients

    # -- fingerprints
    def _open_fingerprints(self) -> None:
        """The golden's fingerprint parameters, when it has fingerprint leaves, and every such
        leaf's stored size checked against them (so a bad entry fails at open, naming it)."""
        self.fingerprint_params: FingerprintParams | None = None
        self.fingerprint_leaves = 0
        # inputs are decoded lazily (replay reads them): only a golden recorded with fingerprints
        # can hold fingerprinted inputs, so only then are they decoded here
        with_inputs = fpstore.META_KEY in self.meta
        for c in self.calls:
            for leaf in (*c.leaves, *((c.inputs or ()) if with_inputs else ())):
                if leaf.kind != "fingerprint":
                    continue
                if self.fingerprint_params is None:
                    self.fingerprint_params = fpstore.params_from_meta(self.path, self.meta)
                assert leaf.dtype is not None
                want = fpstore.blob_nbytes(leaf.dtype, leaf.shape, self.fingerprint_params)
                if leaf.nbytes != want:
                    raise GoldenFormatError(self.path, f"layer {c.name!r} call {c.call} path {leaf.path!r}: its "
                                                       f"fingerprint record has {leaf.nbytes} bytes, its dtype, shape "
                                                       f"and the golden's fingerprint parameters need {want}")
                self.fingerprint_leaves += 1

    @property
    def fingerprinted(self) -> bool:
        """Some outputs are stored as fingerprints, not values."""
        return self.fingerprint_leaves > 0

    def live_view(self, entry: CallEntry, leaves: list[Leaf], output: Any = None) -> LiveView | None:
        """One live call's leaves as this golden's format names them (formats 1 and 2:
        :mod:`.legacy`), or None when it names them as today's walker does. ``output``: the
        live output itself (None when the live side is a recording)."""
        if self.version >= 3:
            return None
        from .legacy import live_view  # only older goldens load the live walker's path rules

        return live_view(self.version, entry, leaves, output)

    def replay_blocker(self) -> str | None:
        """Why some calls of this golden cannot be replayed (re-run on their recorded inputs), or None.

        Replay needs full inputs; a fingerprint cannot be turned back into a tensor. A call whose
        recorded inputs are (or alias) fingerprints is not replayed; the replay names the input
        per call, this says it for the whole golden (neutral wording, front ends add a command)."""
        if not self.fingerprinted:
            return None
        calls = [c for c in self.calls if self._fingerprint_inputs(c)]
        if not calls:
            return None
        shown = ", ".join(f"{c.name or '<root>'!r}" for c in calls[:3]) + (", ..." if len(calls) > 3 else "")
        return (f"replay needs full inputs, but the inputs of {len(calls)} layer calls ({shown}) are stored as "
                "fingerprints; re-record the golden without fingerprints for the layers to replay")

    def _fingerprint_inputs(self, c: CallEntry) -> bool:
        for e in c.inputs or ():
            try:
                if self.resolve(e).kind == "fingerprint":
                    return True
            except GoldenError:  # a broken alias: the replay reports it when it gets there
                continue
        return False

    def fingerprint(self, entry: LeafEntry, where: str = "") -> Fingerprint:
        """Read one fingerprint leaf: checksum-verified bytes (a mismatch is corruption), then
        every field validated (a blob that passes its checksum but not that was not written by
        activation_guard: a format error). Both name the file and ``where``."""
        assert entry.kind == "fingerprint" and entry.dtype is not None
        label = where or entry.path
        if self.fingerprint_params is None:
            raise GoldenFormatError(self.path, f"{label}: a fingerprint, but the golden has no fingerprint record")
        raw = self.packed_bytes(entry, label)
        try:
            return fpstore.decode(raw, entry.dtype, entry.shape, self.fingerprint_params)
        except FingerprintFormatError as e:
            raise GoldenFormatError(self.path, f"{label}: {e}") from None

    def _read_json(self, key: str, ds: Any) -> Any:
        p = self.path
        if ds is None:
            raise GoldenFormatError(p, f"has no /{key} record (incomplete or not written by activation_guard)")
        if not isinstance(ds, h5py.h5d.DatasetID) or ds.dtype != np.uint8 or ds.rank != 1:  # (shape: None if NULL)
            raise GoldenFormatError(p, f"/{key} has the wrong type")
        check_dataset(p, ds, f"/{key}")
        size = int(ds.shape[0])
        if size > min(MAX_JSON_BYTES, self.file_size) or ds.get_storage_size() != size:
            raise GoldenCorruptError(p, f"/{key} declares {size} bytes but stores {ds.get_storage_size()}")
        raw = _read_all(ds).tobytes()
        want = scalar_attr(p, self._root_id, f"{key}_crc32", "int")
        if not isinstance(want, (int, np.integer)):
            raise GoldenFormatError(p, f"has a malformed {key}_crc32 attribute ({want!r})")
        if zlib.crc32(raw) != int(want):
            raise GoldenCorruptError(p, f"/{key} fails its checksum (the file was modified or damaged)")
        try:  # the writer never writes NaN or Infinity (allow_nan=False); JSON itself has no such values
            return json.loads(raw.decode(), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError) as e:
            raise GoldenCorruptError(p, f"/{key} is not valid JSON ({e})") from None

    def _read_table(self, key: str, ds: Any, shape: tuple[int, ...], crc: int) -> np.ndarray:
        """One of format 3's index tables: little-endian int64 of the shape ``/index`` gives,
        contiguous and unfiltered, stored in full in this file, and passing its checksum."""
        p = self.path
        if ds is None:
            raise GoldenFormatError(p, f"has no /{key} table (format 3 keeps its index in /index, /calls, /leaves "
                                       f"and /dims; incomplete or not written by activation_guard)")
        if not isinstance(ds, h5py.h5d.DatasetID) or ds.dtype != rows.TABLE_DTYPE or ds.shape != shape:
            got = f"{ds.dtype} {ds.shape}" if isinstance(ds, h5py.h5d.DatasetID) else "a group"
            raise GoldenFormatError(p, f"/{key} is {got}; its /index record says int64 {shape}")
        dcpl = check_dataset(p, ds, f"/{key}")
        if dcpl.get_layout() == h5py.h5d.CHUNKED:  # (filters need chunks)
            raise GoldenFormatError(p, f"/{key} is chunked or compressed; goldens store index tables contiguous")
        nbytes = 8 * int(np.prod(shape))
        check_storage(p, ds, nbytes, self.file_size, f"/{key}", dcpl)
        arr = _read_all(ds) if nbytes else np.zeros(shape, dtype=rows.TABLE_DTYPE)
        if zlib.crc32(arr.tobytes()) != crc:
            raise GoldenCorruptError(p, f"/{key} fails its checksum (the file was modified or damaged)")
        return arr

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
        check_storage(p, ds.id, int(ds.size), self.file_size, f"/packs/{key}")
        arr = ds[()]
        self._pack_cache = (pack, arr)
        return arr

    def _member(self, group: str, key: str) -> Any:
        """``/group/key`` with one HDF5 lookup. ``_open`` walked every member (hard links only)
        and vetted it with ``check_dataset``, so reads do not repeat those checks."""
        g = self._groups.get(group)
        if g is None:
            return None
        try:
            return g[key]
        except KeyError:
            return None

    def packed_bytes(self, entry: LeafEntry, where: str | Callable[[], str] = "") -> np.ndarray:
        """The checksum-verified raw bytes of a packed (small) leaf, without copying them: lets
        the comparator settle bit-identical outputs with one memcmp, no tensor built. ``where``
        (the label errors use) may be a function: it is called only when something is wrong."""
        p = self.path
        assert entry.pack is not None
        buf = self._pack_bytes(entry.pack)
        end = entry.offset + entry.nbytes
        if end > buf.size:
            raise GoldenCorruptError(p, f"{_label(where, entry)}: pack /packs/{entry.pack:04d} is shorter than the "
                                        f"index says")
        raw = buf[entry.offset : end]
        if entry.nbytes and zlib.crc32(raw.data) != entry.crc32:
            raise GoldenCorruptError(p, f"{_label(where, entry)}: {CORRUPT_VALUES}")
        return raw

    def resolve(self, entry: LeafEntry, where: str = "") -> LeafEntry:
        """The stored leaf an ``alias`` entry (an input that was already stored) stands for."""
        if entry.kind != "alias":
            return entry
        assert entry.alias is not None
        name, call, section, path = entry.alias
        if section.startswith("grad-"):  # gradients: a gradient stored before
            c = self.by_grad.get((section[5:], name, call))
            leaves = None if c is None else c.leaves
            what = f"{section[5:]} gradient"
        else:
            c = self.by_key.get((name, call))
            leaves = None if c is None else (c.leaves if section == "out" else c.inputs)
            what = "output" if section == "out" else "input"
        target = next((x for x in leaves or () if x.path == path), None)
        if target is None or target.kind == "alias":
            raise GoldenFormatError(self.path, f"{where or entry.path}: refers to layer {name!r} call {call} "
                                               f"{what} {path!r}, which the golden does not hold")
        return target

    def load(self, entry: LeafEntry, where: str = "") -> torch.Tensor:
        """Read one leaf, verify its checksum, return a CPU tensor of its recorded dtype."""
        p = self.path
        label = where or entry.path
        entry = self.resolve(entry, label)
        if entry.kind != "tensor" or entry.dtype is None:  # an alias that names a str or None value
            raise GoldenFormatError(p, f"{label}: refers to a stored {entry.kind} value where a tensor is read")
        info = dtypes.BY_NAME[entry.dtype]
        try:
            if entry.pack is not None:
                return dtypes.tensor_from_bytes(self.packed_bytes(entry, label).copy(), info, entry.shape)
            assert entry.dataset is not None
            at = f"{label}: /{entry.dataset}"
            key = entry.dataset.split("/", 1)[1]
            loc = self._direct.get(key) if self._fd is not None else None
            if loc is not None:  # contiguous and unfiltered, vetted in _open: one pread, no HDF5
                off, stored, shape, dt = loc
                if shape != entry.shape or dt != info.storage:
                    raise GoldenCorruptError(
                        p, f"{at} has shape {shape} dtype {dt}, index says {entry.shape} {info.storage}"
                    )
                if stored != entry.nbytes or off + stored > self.file_size:
                    raise GoldenCorruptError(
                        p,
                        f"{at} stores {stored} bytes at offset {off} of a {self.file_size}-byte file; "
                        f"the index says {entry.nbytes}",
                    )
            else:
                ds = self._member("data", key)
                if ds is None:
                    raise GoldenCorruptError(p, f"{label}: dataset /{entry.dataset} is missing")
                if ds.shape != entry.shape or ds.dtype != info.storage:
                    raise GoldenCorruptError(
                        p, f"{at} has shape {ds.shape} dtype {ds.dtype}, index says {entry.shape} {info.storage}"
                    )
                check_storage(p, ds.id, entry.nbytes, self.file_size, at)
            self._trim.add(entry.nbytes)
            arr = np.empty(entry.shape, dtype=info.storage)
            if arr.size and loc is not None:
                assert self._fd is not None
                _pread_into(p, self._fd, arr, off, at)
            elif arr.size:
                ds.read_direct(arr)
            if entry.nbytes and zlib.crc32(arr.reshape(-1).view(np.uint8).data) != entry.crc32:
                raise GoldenCorruptError(p, f"{label}: {CORRUPT_VALUES}")
            return dtypes.tensor_from_storage(arr, info)
        except GoldenError:
            raise
        except Exception as e:
            raise GoldenCorruptError(p, f"{label}: could not read stored values ({type(e).__name__}: {e})") from None

    def iter_tensors(self) -> Iterator[tuple[CallEntry, LeafEntry, torch.Tensor]]:
        """Every tensor leaf in execution order, each loaded and checksum-verified."""
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


def _read_all(ds: h5py.h5d.DatasetID) -> np.ndarray:
    """A vetted dataset's values, through its low-level id (its size was checked by the caller)."""
    arr = np.empty(ds.shape, dtype=ds.dtype)
    if arr.size:
        ds.read(h5py.h5s.ALL, h5py.h5s.ALL, arr)
    return arr


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _label(where: str | Callable[[], str], entry: LeafEntry) -> str:
    return (where() if callable(where) else where) or entry.path

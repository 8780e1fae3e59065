"""Writing one golden: leaves as they are captured, then an atomic, byte-reproducible commit.

Byte-reproducible: datasets carry no timestamps, names are counters, JSON is canonical, and
attributes are fixed-length, so recording an unchanged model gives an identical file (a clean
``git diff``). Atomic: everything goes to a temp file next to the target (see
:mod:`.tempfiles`), which is fsynced and renamed over the old golden only when complete.

The writer takes plain data (:class:`LeafLike`), not capture's types: the store is the bottom
layer, and anything with these five attributes (a capture ``Leaf``, a replayed or synthesized
leaf) can be recorded without a conversion step per leaf.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterable
from typing import Any, Protocol

import h5py
import numpy as np
import torch

from .._core import dtypes
from .._core.errors import GoldenWriteError
from ..fingerprints.fingerprint import Fingerprint, FingerprintParams
from . import fingerprints as fpstore
from . import rows
from .format import (
    COMPRESSIONS,
    FORMAT_NAME,
    FORMAT_VERSION,
    PACK_BYTES,
    ROW_TABLES,
    SMALL_LEAF_BYTES,
    json_bytes,
)
from .memory import TrimCounter
from .pack import PackBuffer
from .tempfiles import create_temp, default_mode

WRITE_FIX = "free disk space or fix permissions, then re-record"


class LeafLike(Protocol):
    """What the writer needs of one leaf of a layer's output.

    ``kind`` is ``tensor`` (``tensor`` set), ``str`` (``value`` set), ``ref`` (``value`` is the path
    of a container seen before), ``alias`` (``alias`` names a stored value: layer, call, section,
    path), ``none`` or ``object`` (recorded by ``type_name`` only). ``leaves.Leaf`` has exactly
    these attributes. A ``fingerprint`` leaf also has a ``fingerprint`` attribute (a
    :class:`Fingerprint`, or a :class:`PendingLike` still being computed).
    """

    @property
    def path(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def tensor(self) -> torch.Tensor | None: ...
    @property
    def type_name(self) -> str: ...
    @property
    def value(self) -> str | None: ...
    @property
    def alias(self) -> dict[str, Any] | None: ...


class PendingLike(Protocol):
    """A fingerprint still being computed (``fingerprint_worker.PendingFingerprint``): its size is
    known now, its bytes when :meth:`result` returns."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def params(self) -> FingerprintParams: ...
    def result(self) -> Fingerprint: ...


class _Reserved:
    """A pending fingerprint's place in a pack: filled, and its entry's checksum set, when the
    pack is written. Packs are written in order, so the file is the one an inline recording makes."""

    __slots__ = ("entry", "nbytes", "offset", "pending")

    def __init__(self, pending: PendingLike, entry: dict[str, Any], nbytes: int):
        self.pending, self.entry, self.nbytes = pending, entry, nbytes
        self.offset = -1  # in the pack, once placed

    def fill(self) -> bytes:
        raw = fpstore.encode(self.pending.result())
        if len(raw) != self.nbytes:  # the layout is a function of dtype, shape and parameters
            raise ValueError(f"a fingerprint blob has {len(raw)} bytes where {self.nbytes} were reserved")
        self.entry["crc32"] = zlib.crc32(raw)
        return raw


def _dataset(parent: Any, name: str, data: np.ndarray) -> None:
    """What ``create_dataset(name, data=data, track_times=False)`` writes for an uncompressed
    array, byte for byte, through h5py's low-level calls: the high-level path cost ~75 us a
    dataset (a third of recording a small model) for its option handling and the ``Dataset``
    object it returns. ``parent``: a low-level group or file id."""
    data = np.asarray(data, order="C")  # (as h5py does; ``ascontiguousarray`` makes a 0-d array 1-d)
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    ds = h5py.h5d.create(parent, name.encode("ascii"), h5py.h5t.py_create(data.dtype, logical=1),
                         h5py.h5s.create_simple(data.shape), dcpl=dcpl)
    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, data)


def _group(parent: Any, name: str) -> Any:
    """A new group without timestamps (as ``create_group`` makes it), low-level, as above."""
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return h5py.h5g.create(parent, name.encode("ascii"), gcpl=gcpl)


def _attribute(obj: Any, name: str, value: np.generic) -> None:
    """A new scalar attribute, as ``obj.attrs[name] = value`` writes it (low-level, as above).
    ``obj``: a group's id, never the file's: on the file id a write that fails for want of
    space (a file-size limit hit while committing) left HDF5 unable to close the file, and the
    process crashed instead of raising (h5py's ``File.attrs`` uses the root
    group for the same reason)."""
    data = np.asarray(value)
    attr = h5py.h5a.create(obj, name.encode("ascii"), h5py.h5t.py_create(data.dtype, logical=True),
                           h5py.h5s.create_simple(()))
    attr.write(data, mtype=h5py.h5t.py_create(data.dtype))


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
        self.tmp = ""
        if os.path.isdir(self.path):
            raise GoldenWriteError(self.path, "is a directory, not a golden file",
                                   fix=f"pass a file path, e.g. {os.path.join(self.path, 'model.h5')}")
        try:
            self.tmp = create_temp(self.path)
            self.f = h5py.File(self.tmp, "w")
        except OSError as e:
            if self.tmp:
                with contextlib.suppress(OSError):
                    os.unlink(self.tmp)
            d = os.path.dirname(self.path)
            raise GoldenWriteError(
                self.path, f"cannot create a temporary file in {d}: {e}", fix="check the folder exists and is writable"
            ) from e
        self.calls: list[dict[str, Any]] = []
        self.backward: list[dict[str, Any]] = []  # gradients, in backward execution order
        self._pack = PackBuffer(PACK_BYTES)  # the current pack's bytes (pack.py: not one allocation per leaf)
        self._reserved: list[_Reserved] = []  # places in it still to fill
        self._pack_id = 0
        self._data_id = 0
        self._packs_group: h5py.h5g.GroupID | None = None
        self._data_group: h5py.h5g.GroupID | None = None
        self.nbytes = 0
        self.nleaves = 0
        self.nfingerprints = 0
        self.fingerprint_params: FingerprintParams | None = None  # the one set a golden's fingerprints use
        self._trim = TrimCounter()
        self._closed = False

    # -- leaves
    def _flush_pack(self) -> None:
        if not self._pack.len:
            return
        if self._packs_group is None:
            self._packs_group = _group(self.f.id, "packs")
        for r in self._reserved:
            self._pack.write_at(r.offset, r.fill())
        self._reserved = []
        buf = self._pack.view()
        _dataset(self._packs_group, f"{self._pack_id:04d}", buf)
        del buf  # (a view of the mapping)
        self._pack_id += 1
        self._pack.reset()

    def _write_tensor(self, t: torch.Tensor, pack_up_to: int = SMALL_LEAF_BYTES) -> dict[str, Any]:
        info = dtypes.info_for(t.dtype)
        small = dtypes.numpy_view(t) if t.numel() * t.element_size() <= pack_up_to else None
        packed: bytes | None
        if small is not None:  # thousands of tiny layers: their bytes in logical order, copied once
            packed = small.tobytes()
            nbytes = len(packed)
            crc = zlib.crc32(packed) if nbytes else 0
        else:
            raw = dtypes.tensor_bytes(t)
            nbytes = int(raw.size)
            crc = zlib.crc32(raw.data) if nbytes else 0
            packed = raw.tobytes() if nbytes <= pack_up_to else None  # copy: the snapshot
        entry: dict[str, Any] = {
            "kind": "tensor",
            "dtype": info.name,
            "shape": list(t.shape),  # (torch.Size holds ints)
            "nbytes": nbytes,
            "crc32": crc,
        }
        if packed is not None:
            self._pack_small(entry, packed)
        else:
            if self._data_group is None:
                self._data_group = _group(self.f.id, "data")
            name = f"{self._data_id:06d}"
            self._data_id += 1
            arr = raw.view(info.storage).reshape(tuple(t.shape))
            if self.compression is None:
                _dataset(self._data_group, name, arr)
            else:  # (chunked, with h5py's choice of chunk shape)
                h5py.Group(self._data_group).create_dataset(name, data=arr, compression=self.compression,
                                                            shuffle=True, track_times=False)
            entry["dataset"] = f"data/{name}"
            self._trim.add(nbytes)
        self.nbytes += nbytes
        return entry

    def _pack_small(self, entry: dict[str, Any], raw: bytes | _Reserved) -> None:
        """Append a small leaf's bytes to the current pack; its location goes into ``entry``."""
        nbytes = raw.nbytes if isinstance(raw, _Reserved) else len(raw)
        if self._pack.len + nbytes > PACK_BYTES:
            self._flush_pack()
        entry["pack"] = self._pack_id
        if isinstance(raw, _Reserved):
            entry["offset"] = raw.offset = self._pack.reserve(nbytes)
            self._reserved.append(raw)
        else:
            entry["offset"] = self._pack.append(raw)

    def _write_fingerprint(self, fp: Fingerprint | PendingLike) -> dict[str, Any]:
        """A fingerprint leaf: its blob goes into the packs (see :mod:`.fingerprints`); a pending
        one gets its place now and its bytes when the pack is written."""
        if self.fingerprint_params is None:
            self.fingerprint_params = fp.params
        elif fp.params != self.fingerprint_params:
            raise ValueError(f"one golden holds fingerprints of one set of parameters: {fp.params} differs from "
                             f"{self.fingerprint_params}")
        head = {"kind": "fingerprint", "dtype": fp.dtype, "shape": list(fp.shape)}
        if isinstance(fp, Fingerprint):
            raw = fpstore.encode(fp)
            nbytes = len(raw)
            entry: dict[str, Any] = {**head, "nbytes": nbytes, "crc32": zlib.crc32(raw)}
            self._pack_small(entry, raw)
        else:
            nbytes = fpstore.blob_nbytes(fp.dtype, fp.shape, fp.params)
            entry = {**head, "nbytes": nbytes, "crc32": 0}  # the checksum comes with the bytes
            self._pack_small(entry, _Reserved(fp, entry, nbytes))
        self.nbytes += nbytes
        self.nfingerprints += 1
        return entry

    def write_leaves(self, leaves: Iterable[LeafLike], where: str,
                     pack_up_to: int = SMALL_LEAF_BYTES) -> list[dict[str, Any]]:
        """Write the values of ``leaves`` now (the snapshot) and return their index entries.
        An :class:`AliasLike` leaf (an input that is an already stored value) writes nothing.
        Tensors up to ``pack_up_to`` bytes go into packs (gradients pack more: see grad_store)."""
        out = []
        for leaf in leaves:
            if leaf.kind == "tensor":
                assert leaf.tensor is not None
                try:
                    e = self._write_tensor(leaf.tensor, pack_up_to)
                except OSError as err:  # disk full, file size limit, I/O error: not a model problem
                    raise GoldenWriteError(
                        self.path,
                        f"could not write {where} ({err}); the previous golden, if any, is unchanged",
                        fix=WRITE_FIX,
                    ) from err
                if leaf.type_name != "Tensor":
                    e["py"] = leaf.type_name
            elif leaf.kind == "fingerprint":
                fp: Fingerprint | PendingLike | None = getattr(leaf, "fingerprint", None)
                if fp is None or not (isinstance(fp, Fingerprint) or callable(getattr(fp, "result", None))):
                    raise TypeError(f"{where} path {leaf.path!r}: a fingerprint leaf needs a Fingerprint, "
                                    f"got {type(fp).__name__}")
                e = self._write_fingerprint(fp)
                if leaf.type_name != "Tensor":
                    e["py"] = leaf.type_name
            elif leaf.kind == "str":
                e = {"kind": "str", "value": leaf.value, "py": leaf.type_name}
            elif leaf.kind == "ref":
                e = {"kind": "ref", "value": leaf.value, "type": leaf.type_name}
            elif leaf.kind == "alias":
                out.append(self.write_alias(leaf.alias or {}, leaf.path))
                continue
            else:
                e = {"kind": leaf.kind, "type": leaf.type_name}
            e["path"] = leaf.path
            out.append(e)
            self.nleaves += 1
        return out

    def write_alias(self, alias: dict[str, Any], path: str) -> dict[str, Any]:
        """The index entry of an input that is an already stored value (``alias``: where it is)."""
        self.nleaves += 1
        return {"kind": "alias", **alias, "path": path}

    def add_call(self, name: str, call: int, module_type: str, leaves: Iterable[LeafLike],
                 inputs: list[dict[str, Any]] | None = None) -> None:
        """Record one layer call (``name``, 0-based ``call`` count) with its output leaves, in
        order, and the index entries of its inputs (written earlier by :meth:`write_leaves`)."""
        out = self.write_leaves(leaves, f"layer {name or '<root>'!r} call {call}")
        rec: dict[str, Any] = {"name": name, "call": call, "type": module_type, "leaves": out}
        if inputs is not None:
            rec["inputs"] = inputs
        self.calls.append(rec)

    # --- gradients
    def add_backward(self, grad: str, name: str, call: int, module_type: str, leaves: list[dict[str, Any]]) -> None:
        """Record one gradient entry of the index's ``backward`` section (``grad``: output, input or
        param), with the index entries of its leaves (written earlier by :meth:`write_leaves`).
        Entries are listed in the order they are added: backward execution order."""
        self.backward.append({"grad": grad, "name": name, "call": call, "type": module_type, "leaves": leaves})
    # --- end gradients

    # -- finishing
    def commit(self, meta: dict[str, Any], *, durable: bool = True) -> None:
        """Write the index and ``meta``, then fsync and rename over the target; on any failure
        the temp file is removed and the previous golden, if any, is left as it was.
        ``durable=False`` skips the fsyncs, for a private scratch file that is read back in the
        same process and deleted (the calibrated shadow's float64 outputs): never for a golden."""
        try:
            self._flush_pack()
            self._pack.close()
            if self.fingerprint_params is not None:  # the parameters every fingerprint here was taken with
                meta = {**meta, fpstore.META_KEY: fpstore.meta_record(self.fingerprint_params,
                                                                      meta.get(fpstore.META_KEY))}
            header, tables = rows.encode({"calls": self.calls, "backward": self.backward})
            ib = json_bytes(header, sort_keys=False, acyclic=True)
            mb = json_bytes(meta)
            root = self.f.id
            _dataset(root, "index", np.frombuffer(ib, dtype=np.uint8))
            for key in ROW_TABLES:
                _dataset(root, key, tables[key])
            _dataset(root, "meta", np.frombuffer(mb, dtype=np.uint8))
            # fixed-length ASCII: no global-heap object for a reader to trip over (see safety.scalar_attr)
            group = h5py.h5g.open(root, b"/")
            _attribute(group, "ag_format", np.bytes_(FORMAT_NAME))
            _attribute(group, "ag_format_version", np.int64(FORMAT_VERSION))
            _attribute(group, "index_crc32", np.int64(zlib.crc32(ib)))
            _attribute(group, "meta_crc32", np.int64(zlib.crc32(mb)))
            self.f.close()
            self._closed = True
            os.chmod(self.tmp, default_mode(self.path))
            if durable:
                with open(self.tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
            os.replace(self.tmp, self.path)
        except (OSError, RuntimeError) as e:  # h5py reports a failed flush on close as RuntimeError
            self.abort()
            raise GoldenWriteError(
                self.path, f"could not write the golden ({e}); the previous golden, if any, is unchanged", fix=WRITE_FIX
            ) from e
        except BaseException:
            self.abort()
            raise
        if not durable:
            return
        try:  # make the rename itself durable
            dfd = os.open(os.path.dirname(self.path), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def abort(self) -> None:
        """Drop the temp file; the target is untouched. Safe to call more than once."""
        self._pack.close()
        if not self._closed:
            with contextlib.suppress(Exception):
                self.f.close()
            self._closed = True
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)

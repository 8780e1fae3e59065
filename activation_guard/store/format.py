"""The golden file format, version 2: its constants, its index entries, and the index codec.

Layout (documented for users in docs/format.md)::

    /            attrs: ag_format="activation_guard.golden", ag_format_version=2,
                        index_crc32, meta_crc32
    /meta        uint8[]  UTF-8 JSON: versions, device, model class, input fingerprint, environment
    /index       uint8[]  UTF-8 JSON: layer calls in execution order, each with its leaves
    /packs/NNNN  uint8[]  small leaves' raw bytes packed back to back (<= PACK_BYTES each)
    /data/NNNNNN one dataset per large leaf, in its numpy dtype (or an unsigned view of the
                 same width for bfloat16/float8/complex32), shape as the tensor

Small leaves are packed because HDF5 costs ~60-80 us per dataset; large ones get their own
dataset so plain h5py users can slice them. Every stored leaf carries a CRC32 of its bytes in the
index, so a flipped bit in the file is reported as a corrupt golden, never as a model divergence.
A ``fingerprint`` leaf stores a fixed-size fingerprint of a tensor instead of its values, as one
blob in the packs; its layout and the meta record of its parameters are in :mod:`.fingerprints`.

Why one module: the writer and the reader must agree on every name, size and field here, and a
format change (a new leaf kind, a version bump) should be a change to this file first. The index
is decoded here too, so the rules for what a valid entry is sit next to the entry types.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core import dtypes
from .._core.errors import GoldenFormatError
from .._core.kinds import LEAF_KINDS, LeafKind
from .._core.slots import SLOTS

FORMAT_NAME = "activation_guard.golden"
FORMAT_VERSION = 3
# Versions this reader understands. 2 added injective leaf paths (non-string keys), ``ref`` leaves
# (repeated and cyclic references) and numpy leaves; a version-1 golden is read and compared by
# its own paths (the comparator maps live leaves to them). 3 stores the same index as integer
# tables (/calls, /leaves, /dims) beside a JSON table of strings (:mod:`.rows`): a third of the
# time a compare of many small layers spent opening the golden went to decoding format 2's JSON.
ROW_TABLES = ("calls", "leaves", "dims")  # format 3's index tables, root members beside /index
PACK_BYTES = 8 * 1024 * 1024  # small leaves are packed into datasets of at most this size
SMALL_LEAF_BYTES = 64 * 1024  # leaves up to this size go into packs
MAX_JSON_BYTES = 256 * 1024 * 1024
LFS_SIGNATURE = b"version https://git-lfs"
# HDF5 filter ids a golden may use: deflate, shuffle, fletcher32, lzf. Anything else would make
# libhdf5 look for a filter plugin on disk and run its code.
ALLOWED_FILTERS = {1, 2, 3, 32000}
COMPRESSIONS = {None, "gzip", "lzf"}
ROOT_MEMBERS = ("index", "meta", "packs", "data")  # formats 1 and 2; format 3 adds ROW_TABLES
SECTIONS = ("out", "in")  # a call's outputs ("leaves") and its inputs ("inputs")
# --- gradients: the index's optional "backward" list, in backward execution order; each
# entry is a call entry with "grad": "output" | "input" (a module call's gradient w.r.t. its
# outputs / inputs) or "param" (a module's parameter gradients, call 0, leaf path = parameter name)
GRAD_KINDS = ("output", "input", "param")
# a gradient equal to one stored before (a parent's and its last child's output gradient, a layer's input
# gradient and its producer's output gradient) is an alias with section "grad-<kind>" naming that entry
GRAD_SECTIONS = tuple(f"grad-{k}" for k in GRAD_KINDS)
# --- end gradients
_DATASET_NAME = re.compile(r"data/\d{6}")


def json_bytes(obj: Any, *, sort_keys: bool = True, acyclic: bool = False) -> bytes:
    """Canonical JSON (sorted keys, no spaces, no NaN): the same record always gives the same
    bytes, which is what makes re-recording an unchanged model byte-identical. The index, built
    by the writer in one fixed key order, is written unsorted (sorting its thousands of small
    objects cost ~2.4 us per layer call) and ``acyclic``: the writer builds it of fresh dicts and
    lists, so the encoder's check for reference cycles is skipped (~0.9 us per layer call)."""
    return json.dumps(obj, sort_keys=sort_keys, separators=(",", ":"), allow_nan=False,
                      check_circular=not acyclic).encode()


@dataclass(**SLOTS)
class LeafEntry:
    """One leaf of a recorded layer call, as the index describes it (no values)."""

    path: str
    kind: LeafKind
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    crc32: int = 0
    pack: int | None = None
    offset: int = 0
    dataset: str | None = None
    type_name: str = ""
    value: str | None = None
    alias: tuple[str, int, str, str] | None = None  # (layer, call, section, path) of the stored value

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_fingerprint(self) -> bool:
        """A fingerprint of a tensor (``dtype``/``shape`` are the tensor's; the stored bytes are
        the fingerprint's, see :mod:`.fingerprints`), not its values."""
        return self.kind == "fingerprint"


@dataclass(**SLOTS)
class CallEntry:
    """One recorded layer call and its leaves, in the golden's execution order."""

    name: str
    call: int
    type_name: str
    leaves: list[LeafEntry]
    position: int  # 0-based position in the golden's execution order
    grad: str | None = None  # entries of the "backward" section: what the gradient is taken w.r.t. (GRAD_KINDS)
    # the call's arguments ("args/0", "kwargs/mask") as the index holds them; decoded (and checked)
    # on first use: a compare reads them only to replay, and decoding every call's inputs at open
    # cost ~10 us per layer call
    # (format 3: a range of rows of ``rows``, the index tables, turned into those dicts when read)
    raw_inputs: Sequence[Any] | None = field(default=None, repr=False, compare=False)
    source: str = field(default="", repr=False, compare=False)
    rows: Any = field(default=None, repr=False, compare=False)
    _inputs: list[LeafEntry] | None = field(default=None, repr=False, compare=False)

    @property
    def inputs(self) -> list[LeafEntry] | None:
        """The call's arguments' leaves, if recorded (validated when first read)."""
        if self._inputs is None and self.raw_inputs is not None:
            raw = self.raw_inputs if self.rows is None else map(self.rows.leaf_dict, self.raw_inputs)
            self._inputs = [parse_leaf(self.source, leaf, self.name, self.call, "inputs") for leaf in raw]
        return self._inputs

    @inputs.setter
    def inputs(self, value: list[LeafEntry] | None) -> None:
        self._inputs = value

    @property
    def fingerprinted(self) -> bool:
        """Some output or input of this call is stored as a fingerprint (an input may also be an
        alias of a fingerprint: :meth:`GoldenReader.resolve` tells)."""
        return any(leaf.kind == "fingerprint" for leaf in (*self.leaves, *(self.inputs or ())))


def parse_calls(path: str, calls: list[Any]) -> list[CallEntry]:
    """Decode the index's ``calls`` list, refusing any entry the writer could not have produced.

    The index passed its checksum, so a malformed entry means a foreign or hand-edited file; each
    error names the layer call and leaf path at fault. Storage locations are checked for shape
    here and for existence by the reader when the leaf is loaded.
    """
    out = [_parse_call(path, c, i) for i, c in enumerate(calls)]
    for entry in out:
        check_forward(path, entry)
    return out


def check_forward(path: str, entry: CallEntry) -> None:
    """A layer call's outputs are stored values: an ``alias`` (an input or gradient that is a value
    stored before) never stands among them (``diff`` then hit an assertion)."""
    for leaf in entry.leaves:
        if leaf.kind == "alias":
            raise GoldenFormatError(path, f"layer {entry.name!r} call {entry.call} output path {leaf.path!r} is an "
                                          f"alias; only inputs and gradients refer to stored values")


# --- gradients
def parse_backward(path: str, entries: Any) -> list[CallEntry]:
    """Decode the index's optional ``backward`` list (absent: a golden without gradients)."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise GoldenFormatError(path, "has a malformed backward section in its index")
    out = []
    for i, c in enumerate(entries):
        grad = c.get("grad") if isinstance(c, dict) else None
        if grad not in GRAD_KINDS or (isinstance(c, dict) and "inputs" in c):
            raise GoldenFormatError(path, f"backward entry #{i} is malformed")
        entry = _parse_call(path, c, i)
        entry.grad = grad
        check_backward(path, entry, i)
        out.append(entry)
    return out


def check_backward(path: str, entry: CallEntry, i: int) -> None:
    """A gradient entry holds tensors, Nones and aliases of gradients stored before, nothing else."""
    for leaf in entry.leaves:
        if leaf.kind not in ("tensor", "none", "alias"):
            raise GoldenFormatError(path, f"backward entry #{i} ({entry.name!r}) holds a {leaf.kind} leaf")
        if leaf.alias is not None and not leaf.alias[2].startswith("grad-"):
            raise GoldenFormatError(path, f"backward entry #{i} ({entry.name!r}) path {leaf.path!r} refers to a "
                                          f"layer's {leaf.alias[2]!r} values; a gradient can only equal a gradient")
# --- end gradients


def _parse_call(p: str, c: Any, position: int) -> CallEntry:
    if not isinstance(c, dict):
        raise GoldenFormatError(p, f"index entry #{position} is malformed")
    name, call, tname, leaves = c.get("name"), c.get("call"), c.get("type", ""), c.get("leaves")
    inputs = c.get("inputs")
    if (
        not isinstance(name, str)
        or not isinstance(call, int)
        or isinstance(call, bool)
        or call < 0
        or not isinstance(leaves, list)
        or not isinstance(tname, str)
        or not (inputs is None or isinstance(inputs, list))
    ):
        raise GoldenFormatError(p, f"index entry #{position} is malformed")
    parsed = [parse_leaf(p, leaf, name, call) for leaf in leaves]
    refuse_twice(p, parsed, name, call)
    return CallEntry(name, call, tname, parsed, position, raw_inputs=inputs, source=p)


def refuse_twice(p: str, parsed: list[LeafEntry], name: str, call: int) -> None:
    """One output path listed twice: its values cannot be told apart (a format-1 writer could do
    this: ``{1: a, "1": b}`` both became ``"1"``; which is which is lost)."""
    if len(parsed) > 1 and len({leaf.path for leaf in parsed}) != len(parsed):
        seen: set[str] = set()  # one pass: a call of 60,000 leaves took 20 s to refuse, scanning prefixes
        dup = ""
        for x in parsed:
            if x.path in seen:
                dup = x.path
                break
            seen.add(x.path)
        raise GoldenFormatError(p, f"layer {name!r} call {call} lists output path {dup!r} twice: its values cannot "
                                   f"be told apart")


def parse_leaf(p: str, e: Any, lname: str, call: int, section: str = "outputs") -> LeafEntry:
    if type(e) is dict and e.get("kind") == "tensor" and "pack" in e:
        fast = _packed_tensor(e)  # the common leaf, checked without building error texts
        if fast is not None:
            return fast
    where = f"layer {lname!r} call {call}" + (" inputs" if section == "inputs" else "")
    if not isinstance(e, dict) or not isinstance(e.get("path"), str) or e.get("kind") not in LEAF_KINDS:
        raise GoldenFormatError(p, f"index entry for {where} has a malformed leaf")
    kind = e["kind"]
    if kind == "none":
        return LeafEntry(e["path"], kind, type_name="None")
    if kind == "object":
        return LeafEntry(e["path"], kind, type_name=str(e.get("type", "")))
    if kind == "alias":
        tgt = (e.get("name"), e.get("call"), e.get("section"), e.get("of"))
        if (not isinstance(tgt[0], str) or not isinstance(tgt[1], int) or isinstance(tgt[1], bool) or tgt[1] < 0
                or tgt[2] not in SECTIONS + GRAD_SECTIONS or not isinstance(tgt[3], str)):
            raise GoldenFormatError(p, f"index entry for {where} has a malformed alias leaf")
        return LeafEntry(e["path"], kind, type_name=str(e.get("py", "Tensor")),
                         alias=(str(tgt[0]), int(tgt[1]), str(tgt[2]), str(tgt[3])))
    if kind == "ref":
        v = e.get("value")
        if not isinstance(v, str):
            raise GoldenFormatError(p, f"index entry for {where} has a malformed reference leaf")
        return LeafEntry(e["path"], kind, type_name=str(e.get("type", "")), value=v)
    if kind == "str":
        v = e.get("value")
        if not isinstance(v, str):
            raise GoldenFormatError(p, f"index entry for {where} has a malformed string leaf")
        return LeafEntry(e["path"], kind, type_name=str(e.get("py", "str")), value=v)
    at = f"{where} path {e['path']!r}"
    dt, shape, nbytes, crc = e.get("dtype"), e.get("shape"), e.get("nbytes"), e.get("crc32")
    if dt not in dtypes.BY_NAME:
        raise GoldenFormatError(p, f"{at} has unknown dtype {dt!r}")
    if kind == "fingerprint":
        return _parse_fingerprint(p, e, at)
    if (
        not isinstance(shape, list)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        or len(shape) > 64
    ):
        raise GoldenFormatError(p, f"{at} has a malformed shape {shape!r}")
    info = dtypes.BY_NAME[dt]
    n = 1
    for s in shape:
        n *= s
    if not isinstance(nbytes, int) or nbytes != n * info.storage.itemsize or not isinstance(crc, int):
        raise GoldenFormatError(p, f"{at} has an inconsistent size or checksum record")
    entry = LeafEntry(e["path"], kind, dt, tuple(shape), nbytes, crc, type_name=str(e.get("py", "Tensor")))
    if "pack" in e:
        pk, off = e.get("pack"), e.get("offset")
        if not isinstance(pk, int) or not isinstance(off, int) or pk < 0 or off < 0:
            raise GoldenFormatError(p, f"{at} has a malformed pack location")
        entry.pack, entry.offset = pk, off
    elif isinstance(e.get("dataset"), str) and _DATASET_NAME.fullmatch(e["dataset"]):
        entry.dataset = e["dataset"]
    else:
        raise GoldenFormatError(p, f"{at} has no valid storage location")
    return entry


ITEMSIZE = {name: info.storage.itemsize for name, info in dtypes.BY_NAME.items()}  # stored bytes per element


def _packed_tensor(e: dict[str, Any]) -> LeafEntry | None:
    """A well-formed packed tensor leaf, or None (the full check then names what is wrong)."""
    get = e.get
    path, dt, shape, nbytes, crc, pk, off = (get("path"), get("dtype"), get("shape"), get("nbytes"), get("crc32"),
                                             get("pack"), get("offset"))
    size = ITEMSIZE.get(dt) if type(dt) is str else None
    if (size is None or type(path) is not str or type(shape) is not list or len(shape) > 64 or type(nbytes) is not int
            or type(crc) is not int or type(pk) is not int or type(off) is not int or pk < 0 or off < 0):
        return None
    n = size
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        n *= d
    if nbytes != n:
        return None
    py = e.get("py", "Tensor")
    return LeafEntry(path, "tensor", dt, tuple(shape), nbytes, crc, pk, off,
                     type_name=py if type(py) is str else str(py))


def _parse_fingerprint(p: str, e: dict[str, Any], at: str) -> LeafEntry:
    """A fingerprint leaf: the tensor's dtype (floating or complex) and shape, and the stored blob's
    size, CRC and pack location (fingerprints always sit in packs). That the size matches the
    golden's fingerprint parameters is checked by the reader, which knows them."""
    dt, shape, nbytes, crc = e["dtype"], e.get("shape"), e.get("nbytes"), e.get("crc32")
    if dtypes.BY_NAME[dt].kind not in ("float", "complex"):
        raise GoldenFormatError(p, f"{at} is a fingerprint of a {dt} tensor (only float and complex are fingerprinted)")
    if (
        not isinstance(shape, list)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        or len(shape) > 64
    ):
        raise GoldenFormatError(p, f"{at} has a malformed shape {shape!r}")
    if (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0 or not isinstance(crc, int)
            or isinstance(crc, bool)):
        raise GoldenFormatError(p, f"{at} has an inconsistent size or checksum record")
    pk, off = e.get("pack"), e.get("offset")
    if not isinstance(pk, int) or not isinstance(off, int) or isinstance(pk, bool) or pk < 0 or off < 0:
        raise GoldenFormatError(p, f"{at} has a malformed pack location (fingerprints are stored in packs)")
    return LeafEntry(e["path"], "fingerprint", dt, tuple(shape), nbytes, crc, pack=pk, offset=off,
                     type_name=str(e.get("py", "Tensor")))

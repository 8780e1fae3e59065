"""How a fingerprint leaf is laid out in a golden: one byte blob per leaf, parameters in the meta.

A fingerprinted output is stored as a single blob in the packs (like a small tensor leaf), with a
CRC-32 of its bytes in the index entry. The blob is the fingerprint's five arrays back to back,
little-endian, in this order (sizes follow from the leaf's ``dtype`` and ``shape`` and the
golden's fingerprint parameters, so the blob carries no header)::

    sketch          float64  [rows, buckets]
    samples         uint{8*w} [k] (complex: [k, 2]), raw bits of the sampled elements, w = the
                    byte width of one real component; k = min(samples, numel)
    stats           float64  [5]   sum, sum |x|, sum x^2, min, max of the finite values
    counts          int64    [5]   finite, NaN, +Inf, -Inf, rounding depth
    nonfinite_hash  int64    [6]   two position-hash sums per NaN/+Inf/-Inf

The parameters (seed, samples, rows, buckets, false_alarm) are per golden, in the meta under
``"fingerprint"``: a golden is recorded with one set, and every live run is fingerprinted with
the golden's. Decoding goes through :meth:`Fingerprint.from_arrays`, which validates every field;
a blob that passes its CRC but not that validation was not written by activation_guard and is a
format error naming the layer.

The largest blob the parameters allow (31 x 4096 sketch, 65,536 complex128 samples) is about
2.1 MB, well under a pack's 8 MiB, so fingerprints always go into packs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._core import dtypes
from .._core.errors import GoldenFormatError
from ..fingerprints.fingerprint import (
    ARRAY_NAMES,
    COUNT_FIELDS,
    FORMAT,
    FORMAT_VERSION,
    STATS_FIELDS,
    Fingerprint,
    FingerprintFormatError,
    FingerprintParams,
)

META_KEY = "fingerprint"  # key of the golden's meta JSON: {"version", "params", "layers"}
META_VERSION = 1
_REAL_ITEMSIZE = {"complex128": 8, "complex64": 4, "complex32": 2}
_UNSIGNED = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def layout(dtype: str, shape: tuple[int, ...], params: FingerprintParams) -> list[tuple[str, np.dtype[Any],
                                                                                     tuple[int, ...]]]:
    """``(array name, dtype, shape)`` of each array in the blob, in blob order."""
    info = dtypes.BY_NAME[dtype]
    cplx = info.kind == "complex"
    width = _REAL_ITEMSIZE[dtype] if cplx else info.storage.itemsize
    k = min(params.samples, math.prod(shape))
    return [
        ("sketch", np.dtype("<f8"), (params.rows, params.buckets)),
        ("samples", np.dtype(_UNSIGNED[width]), (k, 2) if cplx else (k,)),
        ("stats", np.dtype("<f8"), (len(STATS_FIELDS),)),
        ("counts", np.dtype("<i8"), (len(COUNT_FIELDS),)),
        ("nonfinite_hash", np.dtype("<i8"), (6,)),
    ]


def blob_nbytes(dtype: str, shape: tuple[int, ...], params: FingerprintParams) -> int:
    return sum(dt.itemsize * math.prod(shp) for _, dt, shp in layout(dtype, shape, params))


def encode(fp: Fingerprint) -> bytes:
    """The blob of one fingerprint (deterministic: the same fingerprint gives the same bytes)."""
    arrays, _ = fp.to_arrays()
    out = []
    for name, dt, shp in layout(fp.dtype, fp.shape, fp.params):
        a = arrays[name]
        if a.shape != shp or a.dtype.kind != dt.kind or a.dtype.itemsize != dt.itemsize:
            raise ValueError(f"fingerprint array {name!r} is {a.dtype}{list(a.shape)}, expected {dt}{list(shp)}")
        out.append(np.ascontiguousarray(a, dtype=dt).tobytes())
    return b"".join(out)


def decode(raw: np.ndarray, dtype: str, shape: tuple[int, ...], params: FingerprintParams) -> Fingerprint:
    """The fingerprint in ``raw`` (uint8, already checksum-verified); raises
    :class:`FingerprintFormatError` naming the field at fault."""
    parts = layout(dtype, shape, params)
    want = sum(dt.itemsize * math.prod(shp) for _, dt, shp in parts)
    if raw.size != want:
        raise FingerprintFormatError(f"malformed fingerprint: the blob has {raw.size} bytes, its dtype, shape and "
                                     f"parameters need {want}")
    arrays: dict[str, np.ndarray] = {}
    off = 0
    for name, dt, shp in parts:
        n = dt.itemsize * math.prod(shp)
        arrays[name] = raw[off : off + n].view(dt).reshape(shp).copy()
        off += n
    assert set(arrays) == set(ARRAY_NAMES)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "shape": list(shape),
            "params": params.to_dict()}
    return Fingerprint.from_arrays(arrays, meta)


def meta_record(params: FingerprintParams, existing: Any = None) -> dict[str, Any]:
    """The meta's ``"fingerprint"`` record with these parameters (keeping other keys the caller
    set, such as ``layers``)."""
    rec = dict(existing) if isinstance(existing, Mapping) else {}
    rec.update(version=META_VERSION, params=params.to_dict())
    return rec


def params_from_meta(path: str, meta: Mapping[str, Any]) -> FingerprintParams:
    """The golden's fingerprint parameters; a format error naming the file when they are missing
    or invalid (a golden with fingerprint leaves always has them)."""
    rec = meta.get(META_KEY)
    if not isinstance(rec, Mapping) or "params" not in rec:
        raise GoldenFormatError(path, f"stores fingerprints but its meta has no {META_KEY!r} record with their "
                                      "parameters")
    ver = rec.get("version")
    if not isinstance(ver, int) or isinstance(ver, bool) or ver < 1:
        raise GoldenFormatError(path, f"has a malformed {META_KEY!r} record in its meta (version {ver!r})")
    if ver > META_VERSION:
        raise GoldenFormatError(path, f"has fingerprint format version {ver}, newer than this activation_guard "
                                      f"understands ({META_VERSION})", fix="upgrade activation_guard")
    try:
        return FingerprintParams.from_dict(rec["params"])
    except FingerprintFormatError as e:
        raise GoldenFormatError(path, f"has invalid fingerprint parameters in its meta ({e})") from None

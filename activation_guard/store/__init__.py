"""The HDF5 golden store: atomic, byte-reproducible writes and defensive, streaming reads.

One job per module, each importable alone:

- :mod:`.format`: the on-disk format (constants, index entries, canonical JSON, index decoding);
- :mod:`.rows`: format 3's index as integer tables;
- :mod:`.writer`: :class:`GoldenWriter`, fed plain :class:`LeafLike` data;
- :mod:`.reader`: :class:`GoldenReader`, streaming checksum-verified leaves;
- :mod:`.legacy`: a live call's leaves as a golden of format 1 or 2 names them (loaded only for one);
- :mod:`.fingerprints`: how a fingerprint leaf is stored (blob layout, meta record of its parameters);
- :mod:`.floors`: noise floors and where a golden keeps them;
- :mod:`.naming`: a pytest node id's golden file name, and telling an HDF5 file by its first bytes;
- :mod:`.safety`: the checks that vet every HDF5 object of a file before it is read;
- :mod:`.tempfiles`: temp-file naming for atomic writes and cleanup after interrupted ones;
- :mod:`.memory`, :mod:`.pack`: freed heap memory back to the OS; the pack being filled.

The store imports only ``_core`` and the fingerprint value type (``fingerprints``) from the
package (and, for an older golden only, the walker's paths and the verdict type), never capture,
the comparator or the pytest plugin; its error messages name the file and
a neutral fix, and front ends (plugin, CLI) add their own command. Names are imported lazily, so
the pytest plugin can use :mod:`.naming` without importing h5py and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core.lazy import lazy_names

_LAZY: dict[str, str] = {
    "ALLOWED_FILTERS": "format",
    "COMPRESSIONS": "format",
    "FORMAT_NAME": "format",
    "FORMAT_VERSION": "format",
    "LFS_SIGNATURE": "format",
    "MAX_JSON_BYTES": "format",
    "PACK_BYTES": "format",
    "SMALL_LEAF_BYTES": "format",
    "CallEntry": "format",
    "LeafEntry": "format",
    "json_bytes": "format",
    "parse_calls": "format",
    "TRIM_BYTES": "memory",
    "release_freed_memory": "memory",
    "GoldenReader": "reader",
    "is_lfs_pointer": "reader",
    "MAX_COMPRESSION_RATIO": "safety",
    "STALE_FOREIGN_SECONDS": "tempfiles",
    "TMP_MARK": "tempfiles",
    "cleanup_stale_temps": "tempfiles",
    "GoldenWriter": "writer",
    "LeafLike": "writer",
}

__all__ = [
    "ALLOWED_FILTERS",
    "COMPRESSIONS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LFS_SIGNATURE",
    "MAX_COMPRESSION_RATIO",
    "MAX_JSON_BYTES",
    "PACK_BYTES",
    "SMALL_LEAF_BYTES",
    "STALE_FOREIGN_SECONDS",
    "TMP_MARK",
    "TRIM_BYTES",
    "CallEntry",
    "GoldenReader",
    "GoldenWriter",
    "LeafEntry",
    "LeafLike",
    "cleanup_stale_temps",
    "is_lfs_pointer",
    "json_bytes",
    "parse_calls",
    "release_freed_memory",
]

if TYPE_CHECKING:
    from .format import (
        ALLOWED_FILTERS,
        COMPRESSIONS,
        FORMAT_NAME,
        FORMAT_VERSION,
        LFS_SIGNATURE,
        MAX_JSON_BYTES,
        PACK_BYTES,
        SMALL_LEAF_BYTES,
        CallEntry,
        LeafEntry,
        json_bytes,
        parse_calls,
    )
    from .memory import TRIM_BYTES, release_freed_memory
    from .reader import GoldenReader, is_lfs_pointer
    from .safety import MAX_COMPRESSION_RATIO
    from .tempfiles import STALE_FOREIGN_SECONDS, TMP_MARK, cleanup_stale_temps
    from .writer import GoldenWriter, LeafLike


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())

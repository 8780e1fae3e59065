"""The HDF5 golden store: atomic, byte-reproducible writes and defensive, streaming reads.

One job per module, each importable alone:

- :mod:`.format`: the on-disk format (constants, index entries, canonical JSON, index decoding);
- :mod:`.writer`: :class:`GoldenWriter`, fed plain :class:`LeafLike` data;
- :mod:`.reader`: :class:`GoldenReader`, streaming checksum-verified leaves;
- :mod:`.fingerprints`: how a fingerprint leaf is stored (blob layout, meta record of its parameters);
- :mod:`.safety`: the checks that vet every HDF5 object of a file before it is read;
- :mod:`.tempfiles`: temp-file naming for atomic writes and cleanup after interrupted ones;
- :mod:`.memory`: giving freed heap memory back to the OS during long reads and writes.

The store is the bottom layer: it imports only ``dtypes``, ``errors`` and the fingerprint value
type (``fingerprint`` with its ``fingerprint_params``, ``sketch`` and ``seeded_hash``) from the
package (never ``capture``, the comparator or the pytest plugin), and its error messages name the
file and a neutral fix; front ends (plugin, CLI) add their own command.
"""

from __future__ import annotations

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

"""Anonymous memory mappings private to this process (the worker's copy buffers, a writer's pack).

Private matters: ``mmap.mmap(-1, n)`` alone is a *shared* mapping on POSIX, so a process forked
later would write into the same pages. Two forked children recording at once then took the same
idle copy buffer and fingerprinted each other's values (where ``MAP_POPULATE``
is missing: Python 3.9 on Linux, macOS). Windows has no fork; there the plain call is used.
"""

from __future__ import annotations

import mmap


def private_anonymous(nbytes: int, *, populate: bool = False) -> mmap.mmap:
    """A zero-filled private mapping of ``nbytes`` (> 0); ``populate``: its pages faulted in by one
    system call, where the OS offers it, rather than one fault per page at first touch."""
    private = getattr(mmap, "MAP_PRIVATE", None)
    anonymous = getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", None))
    if private is None or anonymous is None:  # Windows
        return mmap.mmap(-1, nbytes)
    flags = private | anonymous | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(-1, nbytes, flags=flags)

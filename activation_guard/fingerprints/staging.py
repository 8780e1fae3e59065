"""The fingerprint worker's copy buffers: memory mappings of their own, kept across recordings.

A snapshot lives from the hook that copies a leaf until the worker has fingerprinted it: longer
than the model's activations allocated around it. Taken from malloc's heap (``torch.empty``),
those buffers sat between the activations, and after anything that grew and shrank the heap (a
full recording of 200 MB) the next recording's activations landed on fresh pages: page faults
that cost the ``wide`` benchmark tens of milliseconds per recording (docs/performance.md,
"ninth session: page faults"; with the per-job locks of that time, 45-49 K faults). In mappings
of their own they leave malloc's heap to the model; and kept for the next recording (at most
``KEEP`` bytes), a buffer pays its page faults once per process, not once per recording.

A buffer comes back only when no kernel reads it any more (the worker's job finished), so a
later copy can never overwrite values still being fingerprinted.
"""

from __future__ import annotations

import os
import threading

import torch

from .._core.mapping import private_anonymous

KEEP = 32 << 20  # bytes of idle buffers kept for later copies (the wide benchmark keeps a few of 2 MiB)


def _new_mapping(nbytes: int) -> torch.Tensor:
    """A fresh private mapping as a uint8 tensor (which keeps the mapping alive), populated up front."""
    return torch.frombuffer(private_anonymous(nbytes, populate=True), dtype=torch.uint8)


class StagingPool:
    """Idle copy buffers by exact size, within ``keep`` bytes; to make room, whole sizes go, in
    the order they were first given back (while they kept an idle buffer). Shared by the
    recordings of all threads, hence the lock."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.held = 0  # bytes of idle buffers
        self.lock = threading.Lock()
        self._idle: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` (> 0) that nobody else holds: an idle one, else a new mapping."""
        with self.lock:
            bufs = self._idle.get(nbytes)
            if bufs:
                self.held -= nbytes
                buf = bufs.pop()
                if not bufs:
                    del self._idle[nbytes]
                return buf
        return _new_mapping(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        """Take back a buffer from :meth:`take` that nothing reads or writes any more; dropped
        (unmapped once unreferenced) when keeping it would pass ``keep``."""
        size = buf.numel()
        with self.lock:
            if size * (len(self._idle.get(size, ())) + 1) > self.keep:
                return  # that size alone would pass the bound: evict nothing for it
            for other in [s for s in self._idle if s != size]:  # oldest sizes first (insertion order)
                if self.held + size <= self.keep:
                    break
                self.held -= other * len(self._idle.pop(other))
            if self.held + size <= self.keep:
                self._idle.setdefault(size, []).append(buf)
                self.held += size

    def clear(self) -> None:
        """Drop every idle buffer (their memory goes back to the OS)."""
        with self.lock:
            self._idle.clear()
            self.held = 0


POOL = StagingPool()


def _after_fork_in_child() -> None:
    POOL.lock = threading.Lock()  # a fork while another thread held it would leave it held
    POOL._idle.clear()  # private copies (mapping.py), but a child starts with nothing of its parent's
    POOL.held = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

"""The bytes of the pack being filled: one memory mapping per writer, not one allocation per leaf.

A recording keeps each small leaf's bytes (and each ~3 KB fingerprint blob) until its pack is
written. Kept as one ``bytes`` object per leaf, made in the forward hooks between the model's
activations, they split the activations' freed blocks in malloc's heap, so that the next
activations came from fresh memory: an inline recording of the ``wide`` benchmark with
fingerprints faulted ~32 K pages per run where the plain forward faulted none
(docs/performance.md, "ninth session: page faults"). Copied into a private anonymous mapping of
the writer's own (:mod:`activation_guard._core.mapping`), each leaf's bytes are temporary: malloc
reuses their block for the next leaf.

Only the pages written become resident; the mapping is reused for every pack of the golden and
unmapped when the writer closes.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

from .._core.mapping import private_anonymous


class PackBuffer:
    """Appends bytes at known offsets; :meth:`view` is the pack to write, :meth:`reset` starts
    the next one. Grows (a new mapping, contents copied) for a pack larger than ``capacity``."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.len = 0
        self._mm: mmap.mmap | None = None  # made at the first append: many goldens have no small leaf
        self._size = 0  # of the mapping

    def _room(self, nbytes: int) -> mmap.mmap:
        need = self.len + nbytes
        if self._mm is None or need > self._size:
            size = max(need, self.capacity if self._mm is None else 2 * self._size)
            grown = private_anonymous(size)
            if self._mm is not None:
                grown[: self.len] = self._mm[: self.len]
                self._mm.close()
            self._mm, self._size = grown, size
        return self._mm

    def append(self, raw: bytes | bytearray | memoryview) -> int:
        """Copy ``raw`` to the end of the pack; its offset (called per leaf: the common case first)."""
        off = self.len
        end = off + len(raw)
        mm = self._mm
        if mm is None or end > self._size:
            mm = self._room(len(raw))
        mm[off:end] = raw
        self.len = end
        return off

    def reserve(self, nbytes: int) -> int:
        """Room for ``nbytes``, to be filled with :meth:`write_at` before :meth:`view`; its offset."""
        self._room(nbytes)
        off = self.len
        self.len = off + nbytes
        return off

    def write_at(self, offset: int, raw: bytes) -> None:
        if self._mm is None or offset < 0 or offset + len(raw) > self.len:
            raise ValueError(f"{len(raw)} bytes at offset {offset} do not fit a pack of {self.len}")
        self._mm[offset : offset + len(raw)] = raw

    def view(self) -> np.ndarray:
        """The pack's bytes (a view: drop it before :meth:`reset` or :meth:`close`)."""
        if self._mm is None:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(self._mm, dtype=np.uint8, count=self.len)

    def reset(self) -> None:
        """Start the next pack in the same mapping."""
        self.len = 0

    def close(self) -> None:
        """Unmap now, or when the last view goes (a traceback may still hold one)."""
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # exported: unmapped when the views are collected
                self._mm.close()
            self._mm, self._size = None, 0
        self.len = 0

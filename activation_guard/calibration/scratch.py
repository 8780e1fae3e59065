"""The float64 shadow's outputs kept on disk while a calibrated run needs them: raw bytes in a private file.

The shadow forward writes every floating output once and the live run reads each back once, in
the same process. An HDF5 golden (datasets, checksums, an index, then a verified reader) cost
about as much as a strict record of the same bytes on top of the float64 forward; here each
tensor is appended as raw bytes with one ``pwrite`` and read back with one ``pread``, so memory
stays at one output's worth, as with the golden. The file has no name (``tempfile.TemporaryFile``:
created 0600 and unlinked at once): nobody else can open it, and it is gone even when the
process dies. There is no checksum: the bytes never leave this process's own file, and a short
read is an error.

When the float64 copy's parameters are widened per call (:mod:`.widen`) on the CPU, most of the
memory a whole copy would take is free: outputs are then kept in memory, as copies, while they and
the copy's buffers stay within what the whole copy would have held (``budget``), and only the rest
goes to the file (created on the first such output). A copy on an accelerator held device memory,
not host memory: there every output goes to the file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._core.dtypes import BY_NAME, info_for, tensor_bytes, tensor_from_bytes
from .._core.errors import ActivationGuardError


@dataclass(frozen=True)
class ScratchEntry:
    """Where one tensor's bytes are: offset and size in the file, its dtype name and shape; or the
    tensor itself (``held``), kept in memory."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    held: torch.Tensor | None = None


class Scratch:
    """An append-only private file of raw tensor bytes, keyed by (layer, call, output path)."""

    def __init__(self, budget: Callable[[], int] | None = None) -> None:
        """``budget()``: how many bytes may be kept in memory now (None: none, all to the file)."""
        self.budget = budget
        self.held = 0  # bytes kept in memory
        self._file: Any = None
        self._fd: int | None = None
        self.closed = False
        self.entries: dict[tuple[str, int, str], ScratchEntry] = {}
        self.size = 0
        self._buf: np.ndarray | None = None  # load(shared=True)'s buffer: the largest output read so far

    def _open(self) -> int:
        try:
            # a file without a name: created 0600 and unlinked at once (on Linux never named), so
            # no other process can open it and the system frees it however this process ends
            self._file = tempfile.TemporaryFile(prefix="activation_guard-shadow-", buffering=0)  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise ActivationGuardError(
                f"calibrated tolerances keep the float64 shadow's outputs in a private file under "
                f"{tempfile.gettempdir()!r}, which could not be created ({e}); set TMPDIR to a writable "
                f"directory") from e
        self._fd = self._file.fileno()
        return self._fd

    def add(self, name: str, call: int, path: str, t: torch.Tensor) -> None:
        """Keep a copy of ``t`` (any device: copied to the CPU) under (``name``, ``call``, ``path``):
        in memory while the budget allows, else appended to the file."""
        if self.closed:
            raise ActivationGuardError("the float64 shadow's scratch file is closed")
        nbytes = t.numel() * t.element_size()
        if self.budget is not None and self.held + nbytes <= self.budget():
            kept = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            kept.copy_(t.detach())
            self.entries[(name, call, path)] = ScratchEntry(-1, nbytes, info_for(t.dtype).name,
                                                            tuple(int(s) for s in t.shape), kept)
            self.held += nbytes
            return
        if self._fd is None:
            self._open()
        raw = tensor_bytes(t)
        view = raw.data
        done = 0
        try:
            while done < len(view):
                n = self._write(view[done:], self.size + done)
                if n <= 0:
                    raise OSError("the write made no progress")
                done += n
        except OSError as e:  # disk full, file size limit: the run's setting, not the model
            raise ActivationGuardError(
                f"could not write the float64 output of layer {name or '<root>'!r} call {call} to the "
                f"calibrated shadow's scratch file under {tempfile.gettempdir()!r} ({e}; "
                f"{self.size + done:,} bytes written so far); free space there or set TMPDIR") from e
        self.entries[(name, call, path)] = ScratchEntry(self.size, len(view), info_for(t.dtype).name,
                                                        tuple(int(s) for s in t.shape))
        self.size += len(view)

    def get(self, name: str, call: int, path: str) -> ScratchEntry | None:
        return self.entries.get((name, call, path))

    def load(self, entry: ScratchEntry, *, shared: bool = False) -> torch.Tensor:
        """The tensor ``entry`` names, a CPU tensor of its dtype: a fresh one, or with ``shared``
        one in a buffer the next shared load overwrites (for a caller done with it before then:
        a fresh float64 output's worth of pages per output cost about as much as reading it)."""
        if self.closed:
            raise ActivationGuardError("the float64 shadow's scratch file is closed")
        if entry.held is not None:  # the caller only reads it (a shared load) or gets its own copy
            return entry.held if shared else entry.held.clone()
        if not shared:
            raw = np.empty(entry.nbytes, dtype=np.uint8)
        else:
            if self._buf is None or self._buf.size < entry.nbytes:
                self._buf = None  # the old buffer goes before the larger one comes
                self._buf = np.empty(entry.nbytes, dtype=np.uint8)
            raw = self._buf[: entry.nbytes]
        view = raw.data
        done = 0
        while done < entry.nbytes:
            n = self._read(view[done:], entry.offset + done)
            if n <= 0:
                raise ActivationGuardError(
                    f"the float64 shadow's scratch file ends at {entry.offset + done} bytes, before the "
                    f"{entry.nbytes} bytes at offset {entry.offset} it holds")
            done += n
        return tensor_from_bytes(raw, BY_NAME[entry.dtype], entry.shape)

    def _write(self, view: memoryview, offset: int) -> int:
        assert self._fd is not None
        if hasattr(os, "pwrite"):
            return os.pwrite(self._fd, view, offset)
        self._file.seek(offset)  # Windows: no positioned writes
        return int(self._file.write(view))

    def _read(self, view: memoryview, offset: int) -> int:
        assert self._fd is not None
        if hasattr(os, "preadv"):
            return os.preadv(self._fd, [view], offset)
        self._file.seek(offset)
        return int(self._file.readinto(view) or 0)

    def close(self) -> None:
        self.closed = True
        self.entries = {}
        self.held = 0
        self._buf = None
        if self._fd is not None:
            self._file.close()
            self._fd = None

"""Fingerprints computed beside the forward, on one worker thread (issue 15's record-time target).

On CPU the fingerprint kernel costs half to three quarters of a plain forward
(docs/performance.md, "Fingerprint goldens"); computed inline in the hook, a recording waits for
all of it. When torch leaves a core free (fewer intra-op threads than the cores this process may
use), the recorder hands each CPU leaf to one worker thread instead: the hook takes a private copy
(one memory pass, and the snapshot: a later in-place op cannot reach it) and returns, and the
kernel runs on the copy while the forward goes on. torch ops release the GIL, so the two overlap.

The golden is byte-identical to an inline recording: the kernel is a pure function of the values
in logical order, and the writer reserves each fingerprint's place in its pack (the blob's size
follows from dtype, shape and parameters) and fills it before the pack is written
(:meth:`GoldenWriter._flush_pack`). A kernel that fails there raises with the layer, call and path
it was computing for.

Leaves under ``MIN_ELEMENTS`` stay inline (their kernel is mostly Python: the GIL does not let it
overlap). Bounds: the copies waiting for the worker hold at most ``MAX_PENDING`` bytes; a leaf whose copy
would pass that is fingerprinted inline, without a copy (the worker is behind, or the leaf is huge).
Tensors on other devices are fingerprinted inline as before: there the kernel is queued on the
device and the hook waits only for its few-KiB result. Without a free core the worker stays off
(it would compete with torch's own threads for the same cores). The environment variable
``ACTIVATION_GUARD_FINGERPRINT_WORKER`` (``auto``, ``on``, ``off``) overrides that choice.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from . import dtypes
from .errors import ActivationGuardError, OptionError
from .fingerprint import Fingerprint, FingerprintParams, compute_fingerprint
from .leaves import is_plain_tensor

MAX_PENDING = 256 << 20  # bytes of copies waiting for the worker: past that the hook computes inline
MIN_ELEMENTS = 1 << 16  # smaller leaves stay inline: their kernel is mostly Python, which holds the GIL
ENV = "ACTIVATION_GUARD_FINGERPRINT_WORKER"
_SWITCH = {"": None, "auto": None, "on": True, "1": True, "true": True, "yes": True,
           "off": False, "0": False, "false": False, "no": False}


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_core() -> bool:
    """Whether torch's intra-op threads leave a core for the worker."""
    return torch.get_num_threads() < usable_cores()


def wanted() -> bool:
    """Whether a recording uses the worker: ``ENV`` when set to on or off, else a free core."""
    raw = os.environ.get(ENV, "")
    if raw.strip().lower() not in _SWITCH:
        raise OptionError(ENV, raw, "environment variable", "expected auto, on or off")
    switch = _SWITCH[raw.strip().lower()]
    return free_core() if switch is None else switch


class _Job:
    __slots__ = ("buf", "copy", "future", "nbytes", "params")

    def __init__(self, copy: torch.Tensor, buf: torch.Tensor, params: FingerprintParams, nbytes: int):
        self.copy: torch.Tensor | None = copy  # a view of buf
        self.buf: torch.Tensor | None = buf  # given back to the worker's pool when the job is done
        self.params, self.nbytes = params, nbytes
        self.future: Future[Fingerprint] = Future()

    def run(self) -> None:
        """Compute, once: whichever thread claimed the job (``set_running_or_notify_cancel``)."""
        copy, self.copy = self.copy, None
        assert copy is not None
        try:
            self.future.set_result(compute_fingerprint(copy, self.params))
        except Exception as e:  # delivered where the writer fills the fingerprint's place
            self.future.set_exception(e)
        except BaseException as e:  # Ctrl-C while the caller helps: stop now, fail the result too
            self.future.set_exception(e)
            raise


@dataclass(frozen=True)
class PendingFingerprint:
    """A fingerprint being computed on the worker; what the writer needs to reserve its place."""

    dtype: str
    shape: tuple[int, ...]
    params: FingerprintParams
    future: Future[Fingerprint]
    where: str
    worker: FingerprintWorker

    def result(self) -> Fingerprint:
        """The fingerprint (the calling thread takes over jobs the worker has not started rather
        than wait idle); a failed kernel raises naming the leaf."""
        self.worker.help_until(self.future)
        try:
            return self.future.result()
        except Exception as e:
            raise ActivationGuardError(f"fingerprinting {self.where} failed: {e}") from e


class FingerprintWorker:
    """One recording's worker thread and the copies queued for it (first in, first out).

    Work is shared: when the copies waiting would pass ``max_pending`` bytes (the worker is
    behind), the hook computes the leaf inline, without a copy; and a thread waiting for a result
    (the writer, at the end) takes over queued jobs from the back. So a kernel slower than the
    forward costs about half its time on two cores, not all of it after the forward.
    """

    def __init__(self, max_pending: int | None = None):
        self.max_pending = MAX_PENDING if max_pending is None else max_pending
        self._jobs: deque[_Job] = deque()  # not started
        self._live: deque[_Job] = deque()  # submitted, in order; their copies count against max_pending
        self._live_bytes = 0
        # copy buffers by size, reused: a fresh multi-megabyte buffer costs its page faults on every
        # leaf (a 1.5 MB copy kept alive: 540 us, into a reused buffer: 38 us)
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None  # started with the first job
        self._stop = False
        self.submitted = 0
        self.inline = 0

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the worker: a plain CPU tensor (a subclass's or a transform's code
        stays on the caller's thread) of at least ``MIN_ELEMENTS`` whose copy fits beside those
        waiting. Below that size the worker lost time on this machine: two threads taking turns at
        the GIL cost more than the kernel's array work they overlap (32 Ki elements: 1.2x the inline
        recording; 64 Ki: 0.9x)."""
        if t.device.type != "cpu" or t.numel() < MIN_ELEMENTS or not is_plain_tensor(t):
            return False
        live = self._live
        while live and live[0].future.done():  # the worker is done with their copies
            self._live_bytes -= live.popleft().nbytes
        return self._live_bytes + t.numel() * t.element_size() <= self.max_pending

    def submit(self, t: torch.Tensor, params: FingerprintParams, where: str) -> PendingFingerprint:
        """Queue a copy of ``t`` (call when :meth:`takes` said yes)."""
        nbytes = t.numel() * t.element_size()
        with self._cv:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= nbytes
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        copy = buf.view(t.dtype).view(t.shape)
        copy.copy_(t.detach())  # the snapshot, in logical order (the kernel reads values in that order)
        job = _Job(copy, buf, params, nbytes)
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="activation_guard-fingerprint", daemon=True)
                self._thread.start()
            self._jobs.append(job)
            self._cv.notify()
        self._live.append(job)
        self._live_bytes += nbytes
        self.submitted += 1
        return PendingFingerprint(dtypes.info_for(t.dtype).name, tuple(int(s) for s in t.shape), params,
                                  job.future, where, self)

    def _claim(self, back: bool) -> _Job | None:
        with self._cv:
            while self._jobs:
                job = self._jobs.pop() if back else self._jobs.popleft()
                if job.future.set_running_or_notify_cancel():
                    return job
            return None

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
            job = self._claim(back=False)
            if job is not None:
                job.run()
                self._recycle(job)

    def help_until(self, future: Future[Fingerprint]) -> None:
        """Compute queued jobs on this thread, newest first, until ``future`` is done or none is left
        (then the worker has it: wait for it)."""
        while not future.done():
            job = self._claim(back=True)
            if job is None:
                return
            self.inline += 1
            job.run()
            self._recycle(job)

    def _recycle(self, job: _Job) -> None:
        buf, job.buf = job.buf, None
        if buf is None:
            return
        with self._cv:
            if not self._stop and self._free_bytes + buf.numel() <= self.max_pending:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._free_bytes += buf.numel()

    def close(self) -> None:
        """Stop the thread: jobs not started are cancelled (a golden being aborted), a running
        kernel is waited for. A golden being committed has already taken every result."""
        with self._cv:
            self._stop = True
            for job in self._jobs:
                job.future.cancel()
                job.copy = job.buf = None
            self._jobs.clear()
            self._free.clear()
            self._free_bytes = 0
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._live.clear()
        self._live_bytes = 0


def inline_or_queued(worker: FingerprintWorker | None, t: torch.Tensor, params: FingerprintParams,
                     where: str) -> Fingerprint | PendingFingerprint:
    """The fingerprint of ``t``: from the worker when there is one and it takes ``t``, else now."""
    if worker is not None and worker.takes(t):
        return worker.submit(t, params, where)
    return compute_fingerprint(t, params)

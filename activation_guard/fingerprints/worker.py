"""Fingerprints computed beside the forward, on one worker thread.

On CPU the fingerprint kernel costs 0.15-0.33x a plain forward with the compiled pass (0.9-2.3x
with torch ops; docs/performance.md); computed inline in the hook, a recording waits for all of
it. When torch leaves a core free (fewer intra-op threads than the cores this process may use),
the recorder hands each CPU leaf to one worker thread instead: the hook takes a private copy (one
memory pass, and the snapshot: a later in-place op cannot reach it) and returns, and the kernel
runs on the copy while the forward goes on. The compiled call releases the GIL, so the two
overlap; the worker otherwise avoids torch ops (each one hands the GIL back and forth with the
forward's thread: :mod:`.plan`).

The golden is byte-identical to an inline recording: the kernel is a pure function of the values
in logical order, and the writer reserves each fingerprint's place in its pack (the blob's size
follows from dtype, shape and parameters) and fills it before the pack is written
(:meth:`GoldenWriter._flush_pack`). A kernel that fails there raises with the layer, call and path
it was computing for.

Leaves under ``MIN_ELEMENTS`` stay inline (their kernel is mostly Python: the GIL does not let
it overlap). Bounds: the copies waiting for the worker hold at most ``MAX_PENDING`` bytes; a leaf
whose copy would pass that is fingerprinted inline, without a copy (the worker is behind, or the
leaf is huge). The copy buffers are memory mappings of their own, kept for later recordings within
``staging.KEEP`` bytes (:mod:`.staging`: from malloc's heap they made the model's activations
fault on fresh pages). Tensors on other devices are fingerprinted inline as
before: there the kernel is queued on the device and the hook waits only for its few-KiB result.
Without a free core the worker stays off: with torch on both cores of a 2-core machine it made
recording GPT-2 slower (2.75x the forward against 2.13x inline). The environment variable
``ACTIVATION_GUARD_FINGERPRINT_WORKER`` (``auto``, ``on``, ``off``) overrides that choice.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError
from queue import Empty, SimpleQueue

import torch

from .._core import dtypes, native, switches
from .._core.errors import ActivationGuardError
from .._core.tensors import is_plain_tensor
from . import plan as fingerprint_plan
from . import staging
from .fingerprint import Fingerprint, FingerprintParams, compute_fingerprint, fingerprint_buffer
from .sketch import storage_holds


def _memmove_keeping_the_gil() -> Callable[[int, int, int], object] | None:
    """libc's memmove as a PyDLL function, which keeps the GIL (see FingerprintWorker._copy);
    None where the process's own symbols cannot be opened (then torch copies)."""
    try:
        fn = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError, TypeError):  # Windows: no dlopen(NULL)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_void_p
    return fn  # type: ignore[no-any-return]


_MEMMOVE = _memmove_keeping_the_gil()
MAX_PENDING = 256 << 20  # bytes of copies waiting for the worker: past that the hook computes inline
THREAD_NAME = "activation_guard-fingerprint"
IDLE_EXIT = 1.0  # seconds without a job after which the thread ends (a later job starts another)
WAKE_BYTES = 8 << 20  # copies queued before the worker is woken for them (FingerprintWorker says why)
MIN_ELEMENTS = 1 << 16  # smaller leaves stay inline: their kernel is mostly Python, which holds the GIL
ENV = "ACTIVATION_GUARD_FINGERPRINT_WORKER"


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
    switch = switches.read(ENV)
    return free_core() if switch is None else switch


class _Job:
    """One leaf's kernel. Whoever pops it from the queue runs it (the deque's pop is atomic, so
    exactly one thread does). A thread that must wait for it brings its own plain lock, which
    the finishing thread releases: any thread may release it, and a Ctrl-C cannot leave it
    half-held, unlike the Python-level condition variables of ``concurrent.futures.Future`` and
    ``threading.Event``.

    No lock is made per job. A lock is 32 bytes of malloc'd memory; one per leaf, made in the
    hook and kept until the golden was written, landed just past each activation in malloc's
    heap and kept the freed activations from merging: in some allocator states the heap then
    grew by every activation of the forward (188 MB and 49 K page faults on the wide benchmark;
    docs/performance.md, "ninth session: page faults"). Waiting is rare (the writer, at the
    end, for a job the worker is running), so its lock is made then."""

    __slots__ = ("buf", "dtype", "error", "finished", "nbytes", "params", "shape", "value", "waiters")

    def __init__(self, buf: torch.Tensor, params: FingerprintParams, nbytes: int, dtype: torch.dtype,
                 shape: tuple[int, ...]):
        # the snapshot, its values in logical order; back to the pool when the job is done (by the
        # hook's thread)
        self.buf: torch.Tensor | None = buf
        self.params, self.nbytes, self.dtype, self.shape = params, nbytes, dtype, shape
        self.value: Fingerprint | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.waiters: list[_thread.LockType] = []  # held locks of threads waiting for this job

    def run(self) -> None:
        buf = self.buf
        assert buf is not None
        try:
            self.value = fingerprint_buffer(buf, self.dtype, self.shape, self.params)
        except Exception as e:  # delivered where the writer fills the fingerprint's place
            self.error = e
        except BaseException as e:  # Ctrl-C while the caller helps: fail the result too, and stop
            self.error = e
            self.finish()
            raise
        self.finish()

    def finish(self) -> None:
        if not self.finished:
            self.finished = True  # first: a waiter that registers later sees it
            for lock in list(self.waiters):
                lock.release()

    def wait(self) -> None:
        if self.finished:
            return
        lock = _thread.allocate_lock()
        lock.acquire()
        self.waiters.append(lock)  # then check: finish() sets the flag before it reads the list
        if not self.finished:
            lock.acquire()  # a Ctrl-C here leaves nothing held that anyone waits for


class PendingFingerprint:
    """A fingerprint being computed on the worker; what the writer needs to reserve its place."""

    __slots__ = ("_job", "_worker", "dtype", "params", "shape", "where")

    def __init__(self, dtype: str, shape: tuple[int, ...], params: FingerprintParams, job: _Job, where: str,
                 worker: FingerprintWorker):
        self.dtype, self.shape, self.params, self.where = dtype, shape, params, where
        self._job, self._worker = job, worker

    def result(self) -> Fingerprint:
        """The fingerprint (the calling thread takes over jobs the worker has not started rather
        than wait idle). An error of the kernel raises naming the leaf; anything raised while
        waiting (Ctrl-C) propagates as it is."""
        job = self._job
        self._worker.help_until(job)
        job.wait()
        if isinstance(job.error, Exception):
            raise ActivationGuardError(f"fingerprinting {self.where} failed: {job.error}") from job.error
        if job.error is not None:  # a Ctrl-C that stopped the kernel on the caller's thread
            raise job.error
        assert job.value is not None
        return job.value


class FingerprintWorker:
    """One recording's worker thread and the copies queued for it (first in, first out).

    Work is shared: when the copies waiting would pass ``max_pending`` bytes (the worker is
    behind), the hook computes the leaf inline, without a copy; and a thread waiting for a result
    (the writer, at the end) takes over queued jobs from the back. So a kernel slower than the
    forward costs about half its time on two cores, not all of it after the forward.

    The hook's thread takes no Python-level lock here: jobs sit in a deque (atomic appends and
    pops; whoever pops a job runs it), the worker is woken through a ``SimpleQueue`` (reentrant),
    and a thread waiting for a job blocks on a plain lock of its own (:class:`_Job`). A Ctrl-C
    landing anywhere in the hook can leave nothing held that :meth:`close` would then wait for;
    and a thread whose :meth:`close` never ran ends after ``IDLE_EXIT`` seconds without work (any
    job it has not claimed is taken over by the thread waiting for it). The copy buffers come from
    :data:`staging.POOL` and go back to it, by the hook's thread, once their job is finished.

    The worker is woken once ``WAKE_BYTES`` of copies wait, and then runs every job queued, not
    once per job. Each wake-up and each time the two threads pass the GIL costs the forward a
    thread switch, which on a VM is tens of microseconds: woken per job, the worker's machinery
    cost GPT-2 small 21 ms per recording with the kernel taken out (1.118x the forward inline,
    1.208x on the worker; docs/performance.md, "tenth session"). The jobs left below the mark when
    the forward ends are shared by the worker (woken then) and the thread waiting for them; jobs
    that never reach it (a slow model) wait at most ``IDLE_EXIT``.
    """

    def __init__(self, max_pending: int | None = None, *, until_built: bool = False):
        """``until_built``: take leaves only while the compiled pass is being built (no free core
        for a worker, but a forward that would otherwise stop at its first leaf until the
        compiler is done); from then on the hook computes inline again."""
        self.max_pending = MAX_PENDING if max_pending is None else max_pending
        self.until_built = until_built
        self._jobs: deque[_Job] = deque()  # not started
        self._wake: SimpleQueue[bool] = SimpleQueue()  # True: run the queued jobs; False: stop
        self._unwoken = 0  # bytes of jobs queued since the worker was last woken (the hook's thread's)
        self._live: deque[_Job] = deque()  # submitted, in order; their copies count against max_pending
        self._live_bytes = 0
        self._thread: threading.Thread | None = None  # started with the first job
        # every thread started and not yet joined: one that timed out idle as a job arrived may
        # carry on beside the one started for that job, and close() stops and joins both
        self._threads: list[threading.Thread] = []
        self._exiting = False  # the thread found no work for IDLE_EXIT and is ending
        self.inline = 0  # jobs a waiting thread took over
        # the copy _copy uses: the compiled library's, else (not built, or not yet) libc's memmove
        fast = native.built()
        self._move: Callable[[int, int, int], object] | None = fast.copy_fn if fast is not None else _MEMMOVE

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the worker: a plain CPU tensor (a subclass's or a transform's code
        stays on the caller's thread) of at least ``MIN_ELEMENTS`` whose copy fits beside those
        waiting. Below that size the worker lost time on this machine: two threads taking turns at
        the GIL cost more than the kernel's array work they overlap (32 Ki elements: 1.2x the inline
        recording; 64 Ki: 0.9x)."""
        built = native.ready()
        if self.until_built and built:
            return False
        # while the compiled pass is being built every size is taken: inline, the hook would wait for it
        if t.device.type != "cpu" or (built and t.numel() < MIN_ELEMENTS) or not is_plain_tensor(t) \
                or not storage_holds(t):
            return False  # (storage that does not hold its elements: torch's copy_ would read past it)
        live = self._live
        while live and live[0].finished:  # the worker is done with their copies
            self._release(live.popleft())
        return self._live_bytes + t.numel() * t.element_size() <= self.max_pending

    def submit(self, t: torch.Tensor, params: FingerprintParams, where: str) -> PendingFingerprint:
        """Queue a copy of ``t`` (call when :meth:`takes` said yes)."""
        nbytes = t.numel() * t.element_size()
        shape = tuple(int(s) for s in t.shape)
        job = _Job(self._copy(t, nbytes), params, nbytes, t.dtype, shape)
        self._live.append(job)
        self._live_bytes += nbytes
        self._jobs.append(job)
        if self._thread is None or self._exiting or not self._thread.is_alive():  # (it ends when idle)
            self._exiting = False
            self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(self._thread)
            self._thread.start()
        self._unwoken += nbytes
        if self._unwoken >= WAKE_BYTES:
            self._wake_up()
        return PendingFingerprint(dtypes.info_for(t.dtype).name, shape, params, job, where, self)

    def _copy(self, t: torch.Tensor, nbytes: int) -> torch.Tensor:
        """The snapshot of ``t`` in logical order (the kernel reads values in that order), in a
        pooled buffer of its size when there is one. A tensor whose memory is its values in order
        is copied with one C call that keeps the GIL: the torch ops of a copy (two views, a
        detach, copy_) each release it, and each time the worker thread may take it and the
        forward then waits for the worker's Python. The compiled library's copy streams past the
        caches (``ag_copy``: GPT-2 small's recording 1.29x -> 1.27x the forward); libc's
        ``memmove`` where it is not built."""
        buf = staging.POOL.take(nbytes)  # reused: a fresh buffer costs its page faults (1.5 MB: 540 us, reused: 38)
        move = self._move
        # (the storage was checked by takes(), which the caller asked first)
        if move is not None and fingerprint_plan.in_order(t) and buf.numel() >= nbytes:
            move(buf.data_ptr(), t.data_ptr(), nbytes)
        else:  # strided, a conjugated view, other dtypes: torch copies in logical order
            buf[:nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
        return buf

    def _release(self, job: _Job) -> None:
        """A finished job leaves the live copies, and its buffer goes back to the pool."""
        self._live_bytes -= job.nbytes
        buf, job.buf = job.buf, None
        if buf is not None:
            staging.POOL.give(buf)

    def _claim(self, back: bool) -> _Job | None:
        try:
            return self._jobs.pop() if back else self._jobs.popleft()
        except IndexError:
            return None

    def _wake_up(self) -> None:
        self._unwoken = 0
        self._wake.put(True)

    def _loop(self) -> None:
        while True:
            try:
                go = self._wake.get(timeout=IDLE_EXIT)
            except Empty:  # idle: a recording a Ctrl-C stopped before close() leaves no thread behind
                self._exiting = True  # before the check: submit() appends, then reads the flag
                if not self._jobs:
                    return
                self._exiting = False
                go = True  # jobs that waited IDLE_EXIT without a wake-up: run them
            if not go:
                return
            while (job := self._claim(back=False)) is not None:  # None: none left (or the caller took it)
                job.run()

    def help_until(self, target: _Job) -> None:
        """Compute queued jobs on this thread, newest first, until ``target`` is done or none is left
        (then the worker has it: wait for it). The worker is woken for the jobs below its mark."""
        if self._unwoken and self._thread is not None:
            self._wake_up()
        while not target.finished:
            job = self._claim(back=True)
            if job is None:
                return
            self.inline += 1
            job.run()

    def close(self) -> None:
        """Stop the thread: jobs not started are cancelled (a golden being aborted), a running
        kernel is waited for. A golden being committed has already taken every result."""
        threads = list(self._threads)
        for _ in threads:  # first: the threads end even if a Ctrl-C cuts the rest short
            self._wake.put(False)  # (one per thread; a thread that already ended leaves its token unread)
        while (job := self._claim(back=False)) is not None:
            job.error = CancelledError("the recording stopped before this fingerprint was computed")
            job.buf = None
            job.finish()
        for thread in threads:  # (a thread whose start a Ctrl-C interrupted reads False when it runs)
            with contextlib.suppress(RuntimeError):  # "cannot join thread before it is started"
                thread.join()
        self._threads, self._thread = [], None
        for job in self._live:  # finished (a kernel a Ctrl-C stopped too): back; an unfinished one's goes with it
            if job.finished:
                self._release(job)
        self._live.clear()
        self._live_bytes = 0


def inline_or_queued(worker: FingerprintWorker | None, t: torch.Tensor, params: FingerprintParams,
                     where: str) -> Fingerprint | PendingFingerprint:
    """The fingerprint of ``t``: from the worker when there is one and it takes ``t``, else now."""
    if worker is not None and worker.takes(t):
        return worker.submit(t, params, where)
    return compute_fingerprint(t, params)

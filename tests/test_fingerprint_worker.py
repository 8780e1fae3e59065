"""Fingerprints computed on the worker thread while the forward goes on (fingerprint_worker).

The worker must be invisible in the golden: every recording here is made twice, with the worker
and inline, and the two files must be byte-identical, on models that modify outputs in place
after the hook has seen them (the copy is the snapshot), odd layouts and dtypes, non-finite
values, fingerprinted inputs and inference mode. Then the failure paths: a kernel that fails on
the worker, a forward that raises, the memory bound, and that no thread outlives a recording.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import one_thread
from torch import nn

import activation_guard as ag
from activation_guard._core import native
from activation_guard._core.errors import ActivationGuardError, OptionError
from activation_guard.capture import fingerprints as fingerprint_leaves
from activation_guard.fingerprints import staging
from activation_guard.fingerprints import worker as fingerprint_worker
from activation_guard.fingerprints.fingerprint import FingerprintParams, compute_fingerprint
from activation_guard.fingerprints.worker import FingerprintWorker, PendingFingerprint
from activation_guard.store import GoldenReader

THREAD = fingerprint_worker.THREAD_NAME


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch: pytest.MonkeyPatch) -> Any:
    """One torch thread, and small models' leaves sent to the worker too (by default only leaves
    of MIN_ELEMENTS or more go: test_small_leaves_stay_inline)."""
    monkeypatch.setattr(fingerprint_worker, "MIN_ELEMENTS", 1)
    with one_thread():
        yield


def _workers() -> list[threading.Thread]:
    """Running worker threads (a Ctrl-C inside ``Thread.start`` can leave a never-started thread
    object listed by ``threading.enumerate``: Python's doing, and it never runs)."""
    return [t for t in threading.enumerate() if t.name == THREAD and t.is_alive()]


class InPlaceAfter(nn.Module):
    """Outputs changed in place after their hook ran: by an in-place ReLU, and by the parent."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = nn.Linear(64, 64)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(64, 64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc(x))  # fc's output is overwritten by the ReLU
        z = self.fc2(y)
        z.mul_(3.0).add_(1.0)  # and fc2's by the parent
        return z


class Odd(nn.Module):
    """Outputs in odd layouts and dtypes: transposed, expanded (stride 0), a slice, complex,
    half precision, bfloat16, and values with NaN and Inf (the kernel's masked second pass)."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        nonfinite = x.clone()
        nonfinite[0, :7] = float("nan")
        nonfinite[1, :3] = float("inf")
        nonfinite[2, :2] = float("-inf")
        return {"t": x.t(), "expanded": x[0].expand(64, 64), "slice": x[:, ::2], "complex": torch.polar(x.abs(), x),
                "half": x.half(), "bf16": x.bfloat16(), "nonfinite": nonfinite, "f64": x.double() * 0.5}


class Outer(nn.Module):
    """A fingerprinted input that is no alias (made in the parent), and a layer called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = InPlaceAfter()
        self.odd = Odd()

    def forward(self, x: torch.Tensor) -> Any:
        a = self.inner(x * 0.5)
        b = self.inner(a.tanh())
        return self.odd(b), a


def _x() -> torch.Tensor:
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(1))


def _record_both(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: nn.Module, args: tuple[Any, ...],
                 context: Callable[[], Any] = torch.no_grad, submitted: list[int] | None = None,
                 **kw: Any) -> tuple[bytes, bytes, int]:
    """The golden recorded with the worker and inline, and how many leaves went to the worker
    (their sizes in bytes appended to ``submitted``)."""
    submitted = [] if submitted is None else submitted
    real = FingerprintWorker.submit

    def spy(self: FingerprintWorker, t: torch.Tensor, *a: Any) -> PendingFingerprint:
        submitted.append(t.numel() * t.element_size())
        return real(self, t, *a)

    monkeypatch.setattr(FingerprintWorker, "submit", spy)
    out = []
    for worker in (True, False):
        monkeypatch.setenv(fingerprint_worker.ENV, "on" if worker else "off")
        path = tmp_path / f"{worker}.h5"
        with context():
            ag.record(model, args, path=path, fingerprint=True, **kw)
        out.append(path.read_bytes())
    assert ag.compare(model, args, path=tmp_path / "True.h5").ok
    return out[0], out[1], len(submitted)


def test_worker_and_inline_write_the_same_golden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    worker, inline, n = _record_both(monkeypatch, tmp_path, Outer(), (_x(),))
    assert n >= 15  # the worker took the fingerprinted outputs and inputs
    assert worker == inline
    assert not _workers()


def test_copy_is_the_snapshot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Outputs overwritten after their hook: the golden holds the values the hook saw. A worker
    reading the live tensor instead of its copy would fingerprint the overwritten values."""
    model, x = InPlaceAfter(), _x()
    worker, inline, n = _record_both(monkeypatch, tmp_path, model, (x,))
    assert n >= 3 and worker == inline
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o.clone()))
             for k, m in model.named_children()]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    with GoldenReader(tmp_path / "True.h5") as r:
        for name in ("fc", "fc2"):
            stored = r.by_key[(name, 0)].leaves[0]
            assert stored.kind == "fingerprint"
            assert r.fingerprint(stored).identical(compute_fingerprint(seen[name]))
            assert not r.fingerprint(stored).identical(compute_fingerprint(model(x)))


def test_inference_mode_and_grad_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for ctx in (torch.inference_mode, torch.enable_grad):
        worker, inline, n = _record_both(monkeypatch, tmp_path, Outer(), (_x(),), context=ctx)
        assert n and worker == inline, ctx


def test_memory_bound_sends_leaves_inline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Copies waiting may not pass MAX_PENDING: a leaf that would is fingerprinted in the hook."""
    bound = 64 * 64 * 4 - 1  # below one float32 output
    monkeypatch.setattr(fingerprint_worker, "MAX_PENDING", bound)
    sizes: list[int] = []
    worker, inline, n = _record_both(monkeypatch, tmp_path, Outer(), (_x(),), submitted=sizes)
    assert worker == inline
    assert n and max(sizes) <= bound  # the half-size outputs went; no float32 64 x 64 did
    monkeypatch.setattr(fingerprint_worker, "MAX_PENDING", 3 * 64 * 64 * 4)  # a few at a time
    worker, inline, n = _record_both(monkeypatch, tmp_path, Outer(), (_x(),))
    assert worker == inline and n > 0


def test_kernel_failure_on_the_worker_names_the_leaf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "g.h5"
    ag.record(Outer(), (_x(),), path=path)
    before = path.read_bytes()
    real = fingerprint_worker.fingerprint_buffer

    def broken(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], params: FingerprintParams) -> Any:
        if dtype == torch.bfloat16:
            raise RuntimeError("simulated kernel failure")
        return real(buf, dtype, shape, params)

    monkeypatch.setattr(fingerprint_worker, "fingerprint_buffer", broken)
    monkeypatch.setenv(fingerprint_worker.ENV, "on")
    with pytest.raises(ActivationGuardError) as err, torch.no_grad():
        ag.record(Outer(), (_x(),), path=path, fingerprint=True)
    msg = str(err.value)
    assert "layer 'odd' call 0 output path" in msg and "bf16" in msg and "simulated kernel failure" in msg
    assert path.read_bytes() == before  # the stored golden is untouched
    assert not _workers()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.h5"]  # no temp file left


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = InPlaceAfter()
        self.b = InPlaceAfter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.b(self.a(x))
        raise ValueError("the model failed after two layers")


def test_forward_that_raises_stops_the_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(fingerprint_worker.ENV, "on")
    with pytest.raises(ValueError, match="failed after two layers"), torch.no_grad():
        ag.record(Raises(), (_x(),), path=tmp_path / "g.h5", fingerprint=True)
    assert not _workers()
    assert not list(tmp_path.iterdir())


def test_free_core_and_the_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(fingerprint_worker.ENV, raising=False)
    monkeypatch.setattr(fingerprint_worker, "usable_cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert not fingerprint_worker.free_core()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert fingerprint_worker.free_core()
    assert fingerprint_leaves.Fingerprinter(True, FingerprintParams()).worker is not None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert fingerprint_leaves.Fingerprinter(True, FingerprintParams()).worker is None
    for value, want in (("on", True), (" ON ", True), ("1", True), ("off", False), ("0", False), ("auto", False)):
        monkeypatch.setenv(fingerprint_worker.ENV, value)
        assert fingerprint_worker.wanted() is want, value
    monkeypatch.setenv(fingerprint_worker.ENV, "sometimes")
    with pytest.raises(OptionError, match=r"ACTIVATION_GUARD_FINGERPRINT_WORKER='sometimes'.*expected auto, on"):
        ag.record(InPlaceAfter(), (_x(),), path=tmp_path / "never.h5", fingerprint=True)
    assert not list(tmp_path.iterdir())  # not even a temporary file


def test_small_leaves_stay_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint_worker, "MIN_ELEMENTS", 1 << 16)
    w = FingerprintWorker()
    assert not w.takes(torch.randn(255, 256))
    assert w.takes(torch.randn(256, 256))
    w.close()


def test_only_plain_cpu_tensors_go_to_the_worker() -> None:
    class Sub(torch.Tensor):
        pass

    w = FingerprintWorker()
    t = torch.randn(64, 64)
    assert w.takes(t)
    assert not w.takes(t.as_subclass(Sub))  # a subclass's code stays on the caller's thread
    assert not w.takes(torch.randn(64, 64, device="meta"))
    w.close()


def test_a_waiting_thread_takes_over_queued_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker is stuck on its first job: waiting for the last one, the caller computes the
    jobs still queued itself, newest first, instead of waiting idle."""
    started, release = threading.Event(), threading.Event()
    real = fingerprint_worker.fingerprint_buffer
    by: dict[int, str] = {}

    def spy(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], params: FingerprintParams) -> Any:
        by[shape[0]] = threading.current_thread().name
        if shape[0] == 1000:
            started.set()
            assert release.wait(60)
        return real(buf, dtype, shape, params)

    monkeypatch.setattr(fingerprint_worker, "fingerprint_buffer", spy)
    w, p = FingerprintWorker(), FingerprintParams()
    try:
        first = w.submit(torch.randn(1000), p, "first")
        assert started.wait(60)
        rest = [w.submit(torch.randn(1000 + k), p, f"job {k}") for k in range(1, 4)]
        assert rest[-1].result().shape == (1003,)
        assert by[1003] == threading.current_thread().name  # taken over, not waited for
        assert w.inline >= 1
        release.set()
        assert first.result().shape == (1000,)
        assert [r.result().shape for r in rest] == [(1001,), (1002,), (1003,)]
        assert by[1000] == THREAD
    finally:
        release.set()
        w.close()
    assert not _workers()


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), rows=st.integers(1, 40), cols=st.integers(1, 300),
       transpose=st.booleans(), nonfinite=st.sampled_from([None, "nan", "inf", "-inf"]), seed=st.integers(0, 2**16))
def test_worker_result_equals_inline_and_ignores_later_writes(dtype: torch.dtype, rows: int, cols: int,
                                                              transpose: bool, nonfinite: str | None,
                                                              seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(dtype)
    if nonfinite is not None:
        t.view(-1)[seed % t.numel()] = float(nonfinite)
    if transpose:
        t = t.t()
    want = compute_fingerprint(t)
    w = FingerprintWorker()
    idle = threading.Thread(target=lambda: None)
    idle.start()
    idle.join()
    w._thread = idle  # no worker: the job stays queued until result() takes it over, after the write
    try:
        pending = w.submit(t, FingerprintParams(), "leaf")
        t.add_(1.0)  # after the hook: must not reach the fingerprint
        got = pending.result()
    finally:
        w.close()
    assert got.identical(want)
    assert (pending.dtype, pending.shape) == (want.dtype, want.shape)


@pytest.mark.slow
def test_ctrl_c_anywhere_in_the_worker_code_raises_and_leaves_nothing(tmp_path: Path) -> None:
    """A KeyboardInterrupt injected at each line the recording thread runs in fingerprint_worker,
    and in the threading code it calls (where a SIGINT would be handled): the record raises it
    within seconds, no thread is left, no temporary file, and a golden only when the Ctrl-C came
    after its commit. A Ctrl-C inside a `with lock:` once left the worker's lock held, and the
    record hung for good in close()."""
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)).eval()
    x = torch.randn(256, 256)
    src = fingerprint_worker.__file__

    def record_interrupted(nth: int, out: list[BaseException | None]) -> None:
        seen = [0]

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            caller = frame.f_back
            if frame.f_code.co_filename != src and not (  # or the threading code it calls, except
                    # Thread.start: an exception a tracer raises at the closing line of its
                    # `with _active_limbo_lock:` leaves that module lock held (a signal cannot land
                    # there: the lock's __exit__ is C code)
                    frame.f_code.co_filename == threading.__file__ and frame.f_code.co_name != "start"
                    and caller is not None and caller.f_code.co_filename == src):
                return None
            if event == "line":
                seen[0] += 1
                if seen[0] == nth:
                    raise KeyboardInterrupt
            return tracer

        sys.settrace(tracer)
        try:
            ag.record(model, (x,), path=tmp_path / f"{nth}.h5", fingerprint=True)
            out.append(None)
        except BaseException as e:
            out.append(e)
        finally:
            sys.settrace(None)

    os.environ[fingerprint_worker.ENV] = "on"
    try:
        nth, interrupted = 1, 0
        while True:
            out: list[BaseException | None] = []
            th = threading.Thread(target=record_interrupted, args=(nth, out))
            th.start()
            th.join(60)
            assert not th.is_alive(), f"record hung after a Ctrl-C at line event {nth}"
            if out[0] is None:  # past the last line: the record completed
                break
            assert isinstance(out[0], KeyboardInterrupt), (nth, out[0])
            interrupted += 1
            for w in _workers():  # stopped at once by close(); without it (a Ctrl-C there) when idle
                w.join(60)
            assert not _workers(), nth
            assert not list(tmp_path.glob(".*")), nth  # no temporary file
            golden = tmp_path / f"{nth}.h5"
            if golden.exists():  # the Ctrl-C came after the commit: a complete golden
                with torch.no_grad():
                    assert ag.compare(model, (x,), path=golden).ok, nth
                golden.unlink()
            nth += 1
    finally:
        del os.environ[fingerprint_worker.ENV]
    assert interrupted >= 100  # every line (about 290 on this machine): the hooks, the writer waiting, close()


def test_copies_stay_on_the_leaf_device_under_another_default(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """The pooled copy buffer once followed torch's default device instead of the leaf's: under
    ``with torch.device("meta")`` the copy failed (and a CUDA default would have moved CPU leaves)."""
    model, x = InPlaceAfter(), _x()

    def meta_default() -> Any:
        ctx = torch.device("meta")
        return ctx

    worker, inline, n = _record_both(monkeypatch, tmp_path, model, (x,), context=meta_default)
    assert n >= 3 and worker == inline


class ManySizes(nn.Module):
    """Outputs of 24 different sizes: copy buffers of sizes that never recur."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64 + 8 * k) for k in range(24))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self.layers]


def test_live_copies_stay_within_the_bound(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bound = 6 * 64 * 256 * 4  # a few outputs' worth
    monkeypatch.setattr(fingerprint_worker, "MAX_PENDING", bound)
    held: list[int] = []
    real = FingerprintWorker.submit

    def spy(self: FingerprintWorker, *a: Any) -> PendingFingerprint:
        out = real(self, *a)
        held.append(self._live_bytes)
        return out

    monkeypatch.setattr(FingerprintWorker, "submit", spy)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    worker, inline, n = _record_both(monkeypatch, tmp_path, ManySizes(), (x,))
    # how many of the 24 go to the worker depends on how fast it drains (under load the rest are
    # fingerprinted in the hook); about a dozen fit under the bound before any draining
    assert worker == inline and n >= 6
    assert max(held) <= bound


def _no_thread(w: FingerprintWorker) -> None:
    """Jobs then run on the calling thread, when a result is asked for (no worker is started)."""
    idle = threading.Thread(target=lambda: None)
    idle.start()
    idle.join()
    w._thread = idle


def test_a_finished_jobs_buffer_is_reused_and_an_unfinished_ones_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = staging.StagingPool()
    monkeypatch.setattr(staging, "POOL", pool)
    p = FingerprintParams()
    w = FingerprintWorker()
    _no_thread(w)
    try:
        x = torch.randn(4096)
        a = w.submit(x, p, "a")
        a_buf = a._job.buf
        assert a_buf is not None and pool.held == 0
        b = w.submit(x, p, "b")  # a is not finished: b must get another buffer
        assert b._job.buf is not None and b._job.buf.data_ptr() != a_buf.data_ptr()
        b_ptr = b._job.buf.data_ptr()
        assert w.takes(x) and pool.held == 0  # nothing finished: nothing went back
        assert a.result().identical(compute_fingerprint(x, p))  # (this thread ran b first: newest first)
        assert w.takes(x) and pool.held == 2 * 4096 * 4  # both finished: their buffers are idle
        c = w.submit(x * 2, p, "c")
        assert c._job.buf is not None and c._job.buf.data_ptr() in {a_buf.data_ptr(), b_ptr}
        assert pool.held == 4096 * 4
        assert c.result().identical(compute_fingerprint(x * 2, p)) and b.result().identical(a.result())
    finally:
        w.close()
    assert pool.held == 2 * 4096 * 4  # all finished: close gave c's buffer back too


def test_buffers_outlive_a_recording_within_the_pools_bound(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pool = staging.StagingPool(keep=1 << 20)
    monkeypatch.setattr(staging, "POOL", pool)
    x, model = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)), ManySizes()
    worker, inline, n = _record_both(monkeypatch, tmp_path, model, (x,))
    assert worker == inline and n >= 6
    assert 0 < pool.held <= pool.keep  # kept for the next recording, within its bound
    ptrs = {b.data_ptr() for bufs in pool._idle.values() for b in bufs}
    got: list[int] = []
    real = FingerprintWorker._copy

    def spy(self: FingerprintWorker, t: torch.Tensor, nbytes: int) -> torch.Tensor:
        buf = real(self, t, nbytes)
        got.append(buf.data_ptr())
        return buf

    monkeypatch.setattr(FingerprintWorker, "_copy", spy)
    again, _, _ = _record_both(monkeypatch, tmp_path, model, (x,))
    assert again == worker and ptrs & set(got)  # the second recording reused kept buffers


def test_the_staging_pool_keeps_recent_sizes_within_its_bound() -> None:
    pool = staging.StagingPool(keep=10_000)
    a, b, c = pool.take(4000), pool.take(3000), pool.take(3000)
    assert a.dtype == torch.uint8 and a.numel() == 4000 and a.data_ptr() % 4096 == 0
    a[:] = 7
    pool.give(a)
    pool.give(b)
    pool.give(c)
    assert pool.held == 10_000
    assert pool.take(4000).data_ptr() == a.data_ptr() and pool.held == 6000
    pool.give(a)
    big = pool.take(9000)  # no idle buffer of that size: a new mapping
    assert big.data_ptr() not in {a.data_ptr(), b.data_ptr(), c.data_ptr()}
    pool.give(big)  # the other sizes go, oldest first, to make room
    assert pool.held == 9000 and set(pool._idle) == {9000}
    pool.give(pool.take(20_000))  # larger than the whole bound: not kept
    assert pool.held == 9000
    pool.clear()
    assert pool.held == 0 and not pool._idle


def test_a_job_queued_as_the_idle_thread_ends_gets_a_new_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread ends after IDLE_EXIT without work; a job submitted while it is ending (it timed
    out, and is still alive) once waited until the writer computed it itself at the end."""
    monkeypatch.setattr(fingerprint_worker, "IDLE_EXIT", 0.01)
    w, p = FingerprintWorker(), FingerprintParams()
    try:
        first = w.submit(torch.randn(1000), p, "first")
        first.result()
        old = w._thread
        assert old is not None
        old.join(60)  # idle: it ends by itself
        assert not old.is_alive()
        w._exiting = True  # as the loop leaves it when it times out with no job queued
        w._thread = threading.current_thread()  # "still alive"
        second = w.submit(torch.randn(1001), p, "second")
        assert w._thread is not threading.current_thread()  # a new thread was started for it
        w._thread.join(60)  # it computes the job, then ends when idle
        assert second._job.finished  # done by the new thread, not by result() below
        assert second.result().shape == (1001,)
    finally:
        w.close()


def test_submitting_makes_no_lock_and_every_waiter_wakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock per job, made in the hook and kept until the golden is written, pinned malloc's
    heap between activations (fingerprint_worker._Job): submitting must make none. Waiters bring
    their own, and the finishing thread releases each one, whenever it registered."""
    import _thread

    made: list[int] = []
    real_lock = _thread.allocate_lock

    def counting() -> Any:
        made.append(1)
        return real_lock()

    monkeypatch.setattr(fingerprint_worker._thread, "allocate_lock", counting)
    w, p = FingerprintWorker(), FingerprintParams()
    try:
        pending = [w.submit(torch.randn(2048), p, f"leaf {i}") for i in range(20)]
        assert not made
    finally:
        for pend in pending:
            pend.result()
        w.close()
    x = torch.randn(2048)
    buf = torch.empty(x.numel() * 4, dtype=torch.uint8)
    buf.view(torch.float32).copy_(x)
    job = fingerprint_worker._Job(buf, p, buf.numel(), x.dtype, tuple(x.shape))
    made.clear()
    woke: list[int] = []
    waiters = [threading.Thread(target=lambda k=k: (job.wait(), woke.append(k))) for k in range(3)]
    for t in waiters:
        t.start()
    while len(job.waiters) < 3:
        threading.Event().wait(0.001)  # until all three hold their lock
    assert not woke  # nobody passes before the job is done
    job.run()
    for t in waiters:
        t.join(timeout=10)  # (a waiter never released fails here, not hangs)
    assert sorted(woke) == [0, 1, 2] and len(made) == 3
    assert job.value is not None and job.value.identical(compute_fingerprint(x, p))
    job.wait()  # finished: returns at once, without a lock
    assert len(made) == 3


def test_a_size_that_cannot_fit_evicts_nothing() -> None:
    pool = staging.StagingPool(keep=10)
    one, four_a, four_b, four_c = pool.take(1), pool.take(4), pool.take(4), pool.take(4)
    for b in (one, four_a, four_b):
        pool.give(b)
    assert pool.held == 9
    pool.give(four_c)  # a third 4 would pass the bound even alone: dropped, and the 1 stays
    assert pool.held == 9 and sorted(pool._idle) == [1, 4] and len(pool._idle[4]) == 2


@pytest.mark.parametrize("built", [True, False])
def test_the_copy_is_the_compiled_streaming_one_when_built(monkeypatch: pytest.MonkeyPatch, built: bool) -> None:
    """With the library built, the snapshot goes through ``ag_copy`` (streaming stores); without it,
    through libc's memmove; the fingerprint is the same either way, and later writes miss it."""
    fast = native.get()
    if built and fast is None:
        pytest.skip(f"no compiled pass here: {native.status()}")
    calls: list[str] = []

    def counted(which: str, fn: Callable[[int, int, int], object]) -> Callable[[int, int, int], object]:
        def copy(dst: int, src: int, n: int) -> object:
            calls.append(which)
            return fn(dst, src, n)
        return copy

    if built:
        assert fast is not None
        lib = dataclasses.replace(fast, copy_fn=counted("ag_copy", fast.copy_fn))
        monkeypatch.setattr(native, "get", lambda: lib)
        monkeypatch.setattr(native, "built", lambda: lib)  # (the worker takes the copy from a finished build)
    else:
        monkeypatch.setattr(native, "get", lambda: None)
        monkeypatch.setattr(native, "built", lambda: None)
    if fingerprint_worker._MEMMOVE is not None:
        monkeypatch.setattr(fingerprint_worker, "_MEMMOVE", counted("memmove", fingerprint_worker._MEMMOVE))
    t = torch.randn(300, 301, dtype=torch.float64)  # 722,400 bytes: past the streaming threshold, a ragged tail
    want = compute_fingerprint(t)
    w = FingerprintWorker()
    try:
        pending = w.submit(t, FingerprintParams(), "leaf")
        t.mul_(2.0)
        got = pending.result()
    finally:
        w.close()
    assert got.identical(want)
    expected = "ag_copy" if built else "memmove"
    assert calls == ([expected] if built or fingerprint_worker._MEMMOVE is not None else [])


def test_the_worker_is_woken_per_batch_of_copies_not_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wake-up costs the forward a thread switch: the worker is woken once WAKE_BYTES of copies
    wait, runs every queued job, and is woken for the rest when a result is wanted. Every job runs
    exactly once, and each result is the inline fingerprint."""
    t = torch.randn(256, 256)  # 256 KiB
    monkeypatch.setattr(fingerprint_worker, "WAKE_BYTES", 3 * t.numel() * t.element_size())
    monkeypatch.setattr(fingerprint_worker, "IDLE_EXIT", 60.0)  # no wake-up by the idle timeout here
    runs: list[int] = []
    real_run = fingerprint_worker._Job.run

    def counted(job: Any) -> None:
        runs.append(id(job))
        real_run(job)

    monkeypatch.setattr(fingerprint_worker._Job, "run", counted)
    wakes: list[bool] = []

    class Counted(SimpleQueue):  # type: ignore[type-arg]
        def put(self, go: bool, block: bool = True, timeout: float | None = None) -> None:
            wakes.append(go)
            super().put(go, block, timeout)

    w, p = FingerprintWorker(), FingerprintParams()
    w._wake = Counted()
    try:
        xs = [t * (i + 1) for i in range(7)]
        pending = []
        for i, x in enumerate(xs):
            pending.append(w.submit(x, p, f"leaf {i}"))
            assert wakes == [True] * ((i + 1) // 3), i  # woken at the third and the sixth copy only
        got = [q.result() for q in pending]
        assert wakes[:3] == [True, True, True]  # the seventh: woken when its result was wanted
        assert sorted(runs) == sorted(id(q._job) for q in pending)  # each job ran once, by someone
        for x, fp in zip(xs, got):
            assert fp.identical(compute_fingerprint(x))
    finally:
        w.close()
    assert wakes[-1] is False


def test_close_stops_a_thread_that_timed_out_as_a_job_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that timed out idle sets ``_exiting``; a job submitted then starts a second thread,
    and the first may carry on beside it (found by review). close() stops and joins both."""
    monkeypatch.setattr(fingerprint_worker, "IDLE_EXIT", 3600.0)  # neither thread ends by itself here
    w, p = FingerprintWorker(), FingerprintParams()
    closer = threading.Thread(target=w.close, daemon=True)
    try:
        first = w.submit(torch.randn(300, 300), p, "first")
        first.result()
        old = w._thread
        assert old is not None and old.is_alive()
        w._exiting = True  # as the first thread leaves it in the window between its timeout and its check
        second = w.submit(torch.randn(300, 301), p, "second")
        new = w._thread
        assert new is not old and old.is_alive() and new is not None and new.is_alive()
        assert second.result().shape == (300, 301)
        closer.start()
        closer.join(60)  # a guard against a hang, not a timing: close() stops both threads at once
        assert not closer.is_alive(), "close() waited for a thread it never told to stop"
    finally:
        if not closer.is_alive():
            w.close()
    assert not old.is_alive() and not new.is_alive()
    assert not _workers()

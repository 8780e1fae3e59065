"""Prepared compiled fingerprints (fingerprint_plan.py): the same fingerprint as the chunked path,
bit for bit, with one C call per leaf; and the buffer entry point the fingerprint worker uses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from activation_guard._core import dtypes, lru, native
from activation_guard.fingerprints import plan as fingerprint_plan
from activation_guard.fingerprints import sketch
from activation_guard.fingerprints.fingerprint import (
    Fingerprint,
    FingerprintParams,
    compute_fingerprint,
    fingerprint_buffer,
)
from activation_guard.fingerprints.worker import FingerprintWorker

needs_native = pytest.mark.skipif(native.get() is None, reason=f"no compiled pass here: {native.status()}")


def chunked(t: torch.Tensor, p: FingerprintParams | None = None, chunk: int = sketch.CHUNK) -> Fingerprint:
    """The fingerprint by the compiled pass called chunk by chunk from Python (no plan)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fingerprint_plan, "LEAF_ELEMENTS", 0)
        return compute_fingerprint(t, p, chunk=chunk)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3_000_000), chunk_log=st.integers(10, 17), buckets_log=st.integers(4, 8))
def test_window_counts_follow_the_sketchers_rule(n: int, chunk_log: int, buckets_log: int) -> None:
    chunk, buckets = 1 << chunk_log, 1 << buckets_log
    sk = sketch._Sketcher(0, 1, buckets, torch.device("cpu"), sketch.workspace(torch.device("cpu"), 1, buckets, chunk))
    sk.fold = lambda: setattr(sk, "window", 0) or setattr(sk, "folds", sk.folds + 1)  # type: ignore[method-assign]
    for off in range(0, n, chunk):
        sk._reserve(-(-min(chunk, n - off) // buckets))
    folds = sk.folds + (1 if sk.window else 0)
    assert fingerprint_plan.window_counts(n, chunk, buckets, sketch.FLUSH_BLOCKS) == (folds, sk.max_window)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.complex128])
@pytest.mark.parametrize("shape", [(1,), (7, 3), (64,), (300, 437), (2, 131_072), (3, 131_073)])
def test_a_plan_gives_the_chunked_paths_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    t = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    fp = compute_fingerprint(t)
    assert fp.identical(chunked(t))
    assert fp.shape == shape and fp.dtype == dtypes.info_for(dtype).name


@needs_native
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 400_000), rows=st.sampled_from([1, 3, 5, 7, 9]), buckets_log=st.integers(4, 7),
       chunk_log=st.integers(10, 14), seed=st.integers(0, 2**32), f64=st.booleans())
def test_plans_agree_with_chunks_everywhere(n: int, rows: int, buckets_log: int, chunk_log: int, seed: int,
                                            f64: bool) -> None:
    """Rows fused with the statistics (5) or row by row, many fold windows (small chunks), any seed."""
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed % 1000), dtype=torch.float64)
    t = t if f64 else t.float()
    p = FingerprintParams(seed=seed, rows=rows, buckets=1 << buckets_log, samples=16)
    assert compute_fingerprint(t, p, chunk=1 << chunk_log).identical(chunked(t, p, chunk=1 << chunk_log))


@needs_native
def test_nan_and_inf_leave_the_plan_for_the_masked_pass() -> None:
    t = torch.randn(70_000)
    t[[5, 60_000]] = float("nan")
    t[9] = float("-inf")
    fp = compute_fingerprint(t)
    assert (fp.nan, fp.neginf, fp.count) == (2, 1, 70_000 - 3)
    assert fp.identical(chunked(t))


@needs_native
def test_strided_conjugated_and_misaligned_leaves_take_the_general_path() -> None:
    x = torch.randn(500, 300, dtype=torch.float64)
    c = torch.randn(400, 200, dtype=torch.complex64)
    raw = torch.randn(70_001).numpy().tobytes()
    odd = torch.frombuffer(bytearray(b"\0" + raw), dtype=torch.float32, offset=1)  # one byte off
    for t, same in ((x.t(), x.t().contiguous()), (c.conj(), c.conj().resolve_conj()), (odd, odd.clone())):
        assert not fingerprint_plan.takes(t) and fingerprint_plan.takes(same)
        assert compute_fingerprint(t).identical(compute_fingerprint(same))


def test_other_layouts_are_not_taken() -> None:
    """Sparse and MKL-DNN tensors have no strides or storage to read: ``takes`` says no (it does
    not raise), and the general path says what torch says about them."""
    x = torch.randn(40, 40)
    for t in (x.to_sparse(), x.to_mkldnn()):
        assert not fingerprint_plan.takes(t)


@needs_native
def test_the_buffer_entry_point_matches_the_tensor_and_refuses_a_short_buffer() -> None:
    t = torch.randn(3, 50_000)
    buf = torch.empty(t.numel() * 4 + 64, dtype=torch.uint8)
    buf[: t.numel() * 4].view(torch.float32).copy_(t.view(-1))
    p = FingerprintParams()
    assert fingerprint_buffer(buf, t.dtype, (3, 50_000), p).identical(compute_fingerprint(t, p))
    t[1, 7] = float("nan")  # through the masked pass, as the tensor's own
    buf[: t.numel() * 4].view(torch.float32).copy_(t.view(-1))
    got = fingerprint_buffer(buf, t.dtype, (3, 50_000), p)
    assert got.nan == 1 and got.identical(compute_fingerprint(t, p))
    with pytest.raises(ValueError, match="do not fit"):
        fingerprint_buffer(buf[:100], t.dtype, (3, 50_000), p)
    with pytest.raises(ValueError, match="do not fit"):
        fingerprint_buffer(buf.view(torch.float32), t.dtype, (3, 50_000), p)


@needs_native
def test_the_worker_snapshot_of_a_conjugated_view_is_its_values() -> None:
    """The worker copies with memmove only what is its values in memory order: a conjugated,
    a transposed and a plain leaf give what the inline kernel gives."""
    c = torch.randn(300, 300, dtype=torch.complex64)
    x = torch.randn(400, 300)
    w, p = FingerprintWorker(), FingerprintParams()
    try:
        for t in (c.conj(), x.t(), x):
            assert w.takes(t)
            assert w.submit(t, p, "leaf").result().identical(compute_fingerprint(t, p))
    finally:
        w.close()


@needs_native
def test_a_library_that_folds_elsewhere_is_an_error_not_a_wrong_depth() -> None:
    t = torch.randn(10_000)
    plan = fingerprint_plan.plan_for(t.dtype, t.numel(), FingerprintParams(), sketch.CHUNK)
    assert plan is not None
    real = plan.folds
    plan.folds = real + 1
    try:
        with pytest.raises(RuntimeError, match="folded"):
            plan.run(t.data_ptr())
    finally:
        plan.folds = real


@needs_native
def test_plans_stay_within_their_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    plans: lru.ByteLRU[fingerprint_plan.LeafPlan] = lru.ByteLRU(120_000)
    monkeypatch.setattr(fingerprint_plan, "PLANS", plans)
    p = FingerprintParams()
    fast = native.get()
    assert fast is not None
    for n in (10_000, 20_000, 40_000, 80_000):
        plan = fingerprint_plan.plan_for(torch.float32, n, p, sketch.CHUNK)
        assert plan is not None and plans.used <= plans.budget
    assert len(plans.items) < 4  # the oldest went
    big = fingerprint_plan.plan_for(torch.float32, 1_000_000, p, sketch.CHUNK)  # larger than the budget: not kept
    assert big is not None and big.nbytes > plans.budget and all(v is not big for v in plans.items.values())
    assert fingerprint_plan.plan_for(torch.float32, fingerprint_plan.LEAF_ELEMENTS + 1, p, sketch.CHUNK) is None
    assert fingerprint_plan.plan_for(torch.bfloat16, 1000, p, sketch.CHUNK) is None


def test_without_the_compiled_pass_there_is_no_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "get", lambda: None)
    assert fingerprint_plan.plan_for(torch.float32, 1000, FingerprintParams(), sketch.CHUNK) is None
    t = torch.randn(5000)
    assert compute_fingerprint(t).count == 5000


def _shrunk() -> torch.Tensor:
    a = torch.ones(4096)
    t = a[:2048]
    a.untyped_storage().resize_(4096)  # 1,024 floats left under a view of 2,048
    return t


def _emptied() -> torch.Tensor:
    t = torch.ones(70_000)
    t.untyped_storage().resize_(0)  # as FSDP frees a parameter's storage between uses
    return t


@pytest.mark.parametrize("make", [_shrunk, _emptied, lambda: torch._efficientzerotensor(70_000)],
                         ids=["shrunk", "emptied", "zerotensor"])
def test_storage_that_does_not_hold_the_values_never_reaches_c(make: object) -> None:
    """The plan, the chunked compiled pass and the worker's copy read memory by address: a tensor
    whose storage does not hold its elements (or has no address) goes to torch, which raises or
    computes on what it has; before, C read address 0 or past the allocation (found by review)."""
    t = make()  # type: ignore[operator]
    assert not sketch.storage_holds(t) and not fingerprint_plan.takes(t)
    assert not FingerprintWorker().takes(t)
    if t._is_zerotensor():
        assert compute_fingerprint(t).abs_sum == 0.0
    else:
        with pytest.raises(RuntimeError, match="out of bounds"):
            compute_fingerprint(t)


def test_tensors_inside_torch_func_transforms_are_refused() -> None:
    """Their memory is not their values: a fingerprint read from it was garbage (found by review)."""
    from torch.func import functionalize, vmap

    from activation_guard.fingerprints.fingerprint import FingerprintError

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with pytest.raises(FingerprintError, match=r"torch\.func transform"):
            compute_fingerprint(y)
        return y

    functionalize(f)(torch.randn(1000))
    vmap(f)(torch.randn(3, 1000))


def test_a_fork_gives_the_child_fresh_cache_locks() -> None:
    """A fork while another thread holds a cache's lock must not leave the child's copy held."""
    for cache in (fingerprint_plan.PLANS, sketch.HASHES):
        old = cache.lock
        old.acquire()
        try:
            lru._after_fork_in_child()  # what os.register_at_fork runs in a child
            assert cache.lock is not old and cache.lock.acquire(blocking=False)
            cache.lock.release()
        finally:
            old.release()
            cache.lock = old


def test_no_plan_whose_tables_would_not_stay_cached() -> None:
    """31 rows of 16 buckets over 2^22 values: 124 MiB of hash tables, rebuilt for every leaf; the
    general path is faster there (found by review)."""
    p = FingerprintParams(rows=31, buckets=16)
    assert fingerprint_plan.plan_for(torch.float32, 1 << 22, p, sketch.CHUNK) is None
    assert fingerprint_plan.plan_for(torch.float32, 1 << 22, FingerprintParams(), sketch.CHUNK) is not None or \
        native.get() is None

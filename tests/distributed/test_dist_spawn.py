"""run_distributed: N ranks from a plain pytest run; failures and hangs come back bounded."""

from __future__ import annotations

import time

import dist_ranks
import pytest

from activation_guard.distributed.spawn import DistributedRunError, DistributedTimeout, run_distributed

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_values_env_and_a_real_collective():
    res = run_distributed(dist_ranks.env_and_allreduce, world_size=2, args=(1.5,))
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 4.0 for r in res)  # (0 + 1.5) + (1 + 1.5)
    assert [r["env"]["RANK"] for r in res] == ["0", "1"]
    assert all(r["env"]["WORLD_SIZE"] == "2" and r["env"]["LOCAL_WORLD_SIZE"] == "2" for r in res)
    assert all(r["threads"] == int(r["env"]["OMP_NUM_THREADS"]) for r in res)


@pytest.mark.slow
def test_a_failing_rank_is_reported_and_the_stuck_one_stopped():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as ei:
        run_distributed(dist_ranks.rank1_raises_rank0_stuck, world_size=2, timeout=120, grace=1)
    elapsed = time.monotonic() - t0
    e = ei.value
    assert not isinstance(e, DistributedTimeout)
    assert elapsed < 60, f"rank 0 was left hanging for {elapsed:.1f} s"
    assert "first: rank 1: ValueError: rank 1 broke on purpose" in str(e)
    assert "Traceback" in e.failures[1] and "dist_ranks.py" in e.failures[1]
    assert e.failures[0] == "killed 1 s after another rank failed"


def test_overall_timeout_kills_every_rank():
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout) as ei:
        run_distributed(dist_ranks.all_stuck, world_size=2, timeout=3)
    assert time.monotonic() - t0 < 60
    assert ei.value.failures == {0: "still running after 3 s", 1: "still running after 3 s"}


@pytest.mark.slow
def test_non_json_result_is_a_rank_error():
    with pytest.raises(DistributedRunError, match="not JSON serializable"):
        run_distributed(dist_ranks.returns_a_tensor, world_size=1)


def _nested_holder():
    def inner() -> None:
        pass

    return inner


@pytest.mark.parametrize(
    ("fn", "kwargs", "exc", "match"),
    [
        (lambda: 1, {}, TypeError, "not a module-level function"),
        (_nested_holder(), {}, TypeError, "define it at the top level"),
        (dist_ranks.env_and_allreduce, {"args": (object(),)}, TypeError, "args must be JSON values"),
        (dist_ranks.env_and_allreduce, {"world_size": 0}, ValueError, "world_size must be a positive int"),
        ("dist_ranks.env_and_allreduce", {}, ValueError, "'module:qualname'"),
        (dist_ranks.env_and_allreduce, {"timeout": 0}, ValueError, "timeout must be > 0"),
    ],
)
def test_bad_calls_fail_before_spawning(fn, kwargs, exc, match):
    t0 = time.monotonic()
    with pytest.raises(exc, match=match):
        run_distributed(fn, **kwargs)
    assert time.monotonic() - t0 < 1.0  # nothing was spawned

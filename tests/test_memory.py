"""Bounded memory: record and compare stream, so their peak RSS above a plain forward is set by
the largest single layer output, not by the total size of all activations.

Measured with Linux's peak-RSS counter (VmHWM), reset through /proc/self/clear_refs before each
phase; skipped where that counter cannot be reset. The model's activations add up to ~170 MB
while the budget is 2 x the largest output (2 MiB) + 48 MiB, so an implementation that kept the
goldens or the live outputs of all layers would fail by a wide margin.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import activation_guard as ag

ROWS, WIDTH, BLOCKS = 8192, 64, 40  # 2 MiB per output, 81 outputs (~170 MB)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _model() -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers).eval(), torch.randn(ROWS, WIDTH, generator=g)


def _peak_of(fn) -> int:
    assert _reset_peak()
    fn()
    return _peak_bytes()


@pytest.mark.slow
def test_record_and_compare_memory_is_bounded_by_the_largest_output(tmp_path):
    if not _reset_peak():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak-RSS counter")
    model, x = _model()
    path = tmp_path / "big.h5"
    largest = ROWS * WIDTH * 4
    budget = 2 * largest + 48 * 2**20

    def forward() -> None:
        with torch.no_grad():
            model(x)

    forward()  # warm up allocator and kernels before measuring anything
    fwd = _peak_of(forward)
    rec = _peak_of(lambda: ag.record(model, x, path=path))
    fwd2 = _peak_of(forward)
    report = None

    def check() -> None:
        nonlocal report
        report = ag.compare(model, x, path=path)

    cmp_peak = _peak_of(check)
    assert report is not None and report.ok
    with ag.read_golden(path) as golden:
        sizes = [leaf.nbytes for c in golden.calls for leaf in c.leaves]
    nbytes = sum(sizes)
    assert max(sizes) == largest
    assert nbytes > 3 * budget, "the workload must be much larger than the budget to prove anything"
    assert rec - fwd <= budget, (f"record peaked {(rec - fwd) / 2**20:.1f} MiB above a plain forward "
                                 f"(budget {budget / 2**20:.0f} MiB)")
    assert cmp_peak - fwd2 <= budget, (f"compare peaked {(cmp_peak - fwd2) / 2**20:.1f} MiB above a plain forward "
                                       f"(budget {budget / 2**20:.0f} MiB)")

"""CUDA code paths checked on a CPU-only machine: where golden tensors meet live ones, the precision
a device really computes in, generators and device placement.

No GPU ran these. Each test stands a CPU-visible seam in for the CUDA behaviour it guards (a
"meta" tensor for a golden left on another device, a generator or a flag reported by a patched
torch function); benchmarks/gpu_check.py runs the real thing on a machine with CUDA.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import activation_guard as ag
from activation_guard._core import devices
from activation_guard.replay.children import GoldenCache


class Block(nn.Module):
    """Two children and code of its own after the last one (``scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


def nested(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.Sequential(Block(), Block()), nn.Linear(6, 3)).eval()


@pytest.fixture
def golden_elsewhere(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Golden tensors read for a replay come back on the "meta" device, standing in for the CPU
    when the live run is on a GPU: one that meets a live tensor without going through
    ``devices.golden_on`` raises (as CUDA's ``torch.equal`` of a CPU and a CUDA tensor does), and
    ``golden_on`` hands the real values on. Returns the count of tensors it placed."""
    real: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    placed: list[int] = [0]
    load, place = GoldenCache.load, devices.golden_on

    def elsewhere(self: GoldenCache, entry: Any, where: str) -> torch.Tensor:
        t = load(self, entry, where)
        m = t.to("meta")
        real[id(m)] = (m, t)
        return m

    def golden_on(g: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None, *,
                  copy: bool = False) -> torch.Tensor:
        hit = real.get(id(g))
        if hit is not None and hit[0] is g:
            g = hit[1]
            placed[0] += 1
        return place(g, device, dtype, copy=copy)

    monkeypatch.setattr(GoldenCache, "load", elsewhere)
    monkeypatch.setattr(devices, "golden_on", golden_on)
    return placed


def test_replay_first_places_golden_tensors_on_the_live_device(tmp_path: Path, golden_elsewhere: list[int]) -> None:
    model, x = nested(), torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    p = tmp_path / "g.h5"
    ag.record(model, (x,), path=p)
    model[1][1].scale = 1.5  # its own code, after its last child: the first diverging call has children
    r = ag.compare(model, (x,), path=p)
    assert not r.ok and r.origin is not None
    assert (r.origin.name, r.origin.kind) == ("1.1", "parent-code"), r.origin
    assert golden_elsewhere[0] > 0
    assert not any("not replayed" in n for n in r.notes), r.notes


def test_replay_all_places_golden_tensors_on_the_live_device(tmp_path: Path, golden_elsewhere: list[int]) -> None:
    model, x = nested(), torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    p = tmp_path / "g.h5"
    ag.record(model, (x,), path=p)
    r = ag.compare(model, (x,), path=p, replay="all")
    assert r.ok, str(r)
    replayed = [layer for layer in r.layers if layer.own_status is not None]
    assert len(replayed) == len(r.layers)  # every call, parents with children included, was re-run
    assert not any("not replayed" in n for n in r.notes), r.notes
    assert golden_elsewhere[0] > 0


def test_golden_on_moves_casts_and_copies() -> None:
    g = torch.arange(4, dtype=torch.float32)
    same = devices.golden_on(g, torch.device("cpu"))
    assert same is g  # nothing to do: no copy
    c = devices.golden_on(g, torch.device("cpu"), copy=True)
    assert c is not g and torch.equal(c, g)
    d = devices.golden_on(g, torch.device("cpu"), torch.float64, copy=True)
    assert d.dtype == torch.float64 and d.data_ptr() != g.data_ptr()
    m = devices.golden_on(g, torch.device("meta"))
    assert m.device.type == "meta" and m.shape == g.shape


def test_fingerprint_torch_path_avoids_cumsum_under_deterministic_algorithms(monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard._core import native
    from activation_guard.fingerprints.fingerprint import FingerprintParams, compute_fingerprint

    monkeypatch.setattr(native, "get", lambda: None)  # the torch-ops path, which is what runs on a GPU
    x = torch.randn(1_500_000, generator=torch.Generator().manual_seed(3))
    params = FingerprintParams()
    real_cumsum = torch.cumsum
    calls: list[bool] = []

    def cuda_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        # what CUDA's floating cumsum does under torch.use_deterministic_algorithms(True)
        calls.append(torch.are_deterministic_algorithms_enabled())
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("cumsum_cuda_kernel does not have a deterministic implementation, but you set "
                               "'torch.use_deterministic_algorithms(True)'")
        return real_cumsum(*args, **kwargs)

    monkeypatch.setattr(torch, "cumsum", cuda_like)
    plain = compute_fingerprint(x, params, chunk=1 << 16)
    assert calls and not any(calls)  # the fold ran, through cumsum
    with ag.deterministic():
        det = compute_fingerprint(x, params, chunk=1 << 16)
    # the in-order loop gives the sequential cumsum's sums bit for bit: the same fingerprint
    for f in dataclasses.fields(plain):
        a, b = getattr(det, f.name), getattr(plain, f.name)
        assert np.array_equal(np.asarray(a), np.asarray(b)), f.name


# torch's own message when a CUDA matmul runs under deterministic algorithms without the setting
CUBLAS_MESSAGE = ("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
                  "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because "
                  "it uses CuBLAS and you have CUDA >= 10.2. To enable deterministic behavior in this case, you must "
                  "set an environment variable before running your PyTorch application: "
                  "CUBLAS_WORKSPACE_CONFIG=:4096:8 or CUBLAS_WORKSPACE_CONFIG=:16:8.")


@pytest.fixture
def cuda_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's CUDA counts as initialised (no device: its generators are empty)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: None)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: None)


def test_deterministic_warns_when_cuda_started_before_the_cublas_setting(monkeypatch: pytest.MonkeyPatch,
                                                                         cuda_started: None) -> None:
    from activation_guard.api import determinism as det

    monkeypatch.delenv(det.CUBLAS_ENV, raising=False)
    with pytest.warns(ag.ActivationGuardWarning, match="CUDA was initialised while CUBLAS_WORKSPACE_CONFIG was "
                                                       "unset") as w, ag.deterministic():
        assert os.environ[det.CUBLAS_ENV] == det.CUBLAS_DETERMINISTIC
    assert "before the process starts" in str(w[0].message)
    assert det.CUBLAS_ENV not in os.environ  # restored
    monkeypatch.setenv(det.CUBLAS_ENV, ":16:8")  # set in time: nothing to say
    with ag.deterministic():
        pass


def test_deterministic_names_the_fix_when_a_cuda_matmul_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.api import determinism as det

    with pytest.raises(det.CublasWorkspaceError, match="before the process starts") as e, ag.deterministic():
        raise RuntimeError(CUBLAS_MESSAGE)
    assert isinstance(e.value, RuntimeError) and isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match=r"^other$"), ag.deterministic():  # anything else passes through
        raise RuntimeError("other")


def test_plugin_sets_the_cublas_setting_before_tests_run(pytester: pytest.Pytester,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.api import determinism as det
    from activation_guard.plugin import hooks as plugin

    assert (plugin.CUBLAS_ENV, plugin.CUBLAS_DETERMINISTIC) == (det.CUBLAS_ENV, det.CUBLAS_DETERMINISTIC)
    monkeypatch.delenv(det.CUBLAS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a fresh process (an earlier test may use CUDA)
    pytester.makepyfile(test_cublas_variable='''
        import os

        def test_cublas_variable():
            assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    ''')
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert det.CUBLAS_ENV not in os.environ  # taken back at the end of the run
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: left to deterministic()'s warning
    pytester.makepyfile(test_cublas_variable='''
        import os

        def test_cublas_variable():
            assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    ''')
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv(det.CUBLAS_ENV, "")  # the user's choice (empty: torch's default) is kept
    pytester.makepyfile(test_cublas_variable='''
        import os

        def test_cublas_variable():
            assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ""
    ''')
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def small_cnn(seed: int = 0) -> nn.Module:
    """The example suite's CNN (tests/examples/test_cnn.py), weights drawn the same way."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()]):
            if t.is_floating_point():
                v = torch.randn(t.shape, generator=g) * 0.5
                t.copy_(v.abs() + 0.5 if name.endswith("running_var") else v)
    return model.eval()


def gpu(name: str, capability: str) -> dict[str, Any]:
    return {"device": "cuda:0", "device_type": "cuda", "device_name": name, "cuda": "12.8", "cudnn": 91000,
            "capability": capability}


def test_cpu_golden_checked_where_cudnn_runs_tf32_widens_float32_defaults_and_names_tf32(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.capture import env

    model, x = small_cnn(), torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1234))
    p = tmp_path / "g.h5"
    ag.record(model, (x,), path=p)
    # the live run as on a GPU with torch's default flags: cuDNN convolutions in TF32 (cudnn.allow_tf32
    # is on by default), their operands rounded as emulate_tf32 does on a CPU
    monkeypatch.setattr(env, "model_device", lambda *a: torch.device("cuda", 0))
    monkeypatch.setattr(env, "device_info", lambda dev: gpu("NVIDIA H100 80GB HBM3", "sm_90"))
    assert torch.backends.cudnn.allow_tf32
    with ag.emulate_tf32():
        r = ag.compare(model, (x,), path=p)
    assert r.ok, str(r)
    assert any("TF32" in c and "convolutions" in c for c in r.env_changes), r.env_changes
    conv = next(layer for layer in r.layers if layer.name == "0")
    assert conv.rtol == 1e-2 and "TF32" in (conv.leaves[0].tolerance_source or ""), conv.leaves[0]
    with torch.no_grad():
        model[4].weight.mul_(1.05)  # a real change still fails, at its layer
    with ag.emulate_tf32():
        bad = ag.compare(model, (x,), path=p, replay="off")
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.name == "4"


def test_tf32_switches_mean_nothing_on_a_cpu_or_an_old_gpu() -> None:
    from activation_guard.capture import env

    flags = {"cudnn_allow_tf32": True, "cuda_matmul_allow_tf32": True, "fp32_precision.cudnn.conv": "tf32"}
    assert set(env.effective_precision(flags, {"device_type": "cpu"}).values()) == {"ieee"}
    assert set(env.effective_precision(flags, gpu("Tesla V100", "sm_70")).values()) == {"ieee"}
    assert env.effective_precision(flags, gpu("NVIDIA A100", "sm_80")) == {"matmul": "tf32", "conv": "tf32",
                                                                           "rnn": "tf32"}
    off = {"cudnn_allow_tf32": False, "cuda_matmul_allow_tf32": False, "fp32_precision.cudnn.conv": "ieee",
           "fp32_precision.cudnn.rnn": "ieee", "float32_matmul_precision": "highest"}
    assert set(env.effective_precision(off, gpu("NVIDIA A100", "sm_80")).values()) == {"ieee"}
    assert env.precision_change(off, gpu("A", "sm_80"), off, gpu("A", "sm_80"), False) is None
    assert env.precision_change(flags, {"device_type": "cpu"}, flags, {"device_type": "cpu"}, False) is None
    assert env.effective_precision({"float32_matmul_precision": "medium"}, {"device_type": "cpu"})["matmul"] == "bf16"
    assert env.op_families(["Sequential", "Linear"]) == {"matmul"}
    assert env.op_families(["Conv2d", "LSTM", "ConvTranspose1d"]) == {"matmul", "conv", "rnn"}
    # a model without convolutions or RNNs: cuDNN's default TF32 cannot touch it, nothing widens
    default = {"cudnn_allow_tf32": True, "cuda_matmul_allow_tf32": False}  # torch's defaults
    assert env.precision_change(default, {"device_type": "cpu"}, default, gpu("A", "sm_90"), True, {"matmul"}) is None
    assert env.precision_change(default, {"device_type": "cpu"}, default, gpu("A", "sm_90"), True,
                                {"matmul", "conv"}) is not None


def test_golden_from_another_gpu_model_gets_cross_device_defaults(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.capture import env

    monkeypatch.setattr(env, "model_device", lambda *a: torch.device("cuda", 0))
    off = {**env.numerics_flags(), "cudnn_allow_tf32": False, "fp32_precision.cudnn.conv": "ieee",
           "fp32_precision.cudnn.rnn": "ieee"}
    monkeypatch.setattr(env, "numerics_flags", lambda: off)  # full float32 on both: only the GPU model differs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) * 4
    p = tmp_path / "g.h5"
    monkeypatch.setattr(env, "device_info", lambda dev: gpu("NVIDIA A100-SXM4-80GB", "sm_80"))
    ag.record(model, (x,), path=p)
    with torch.no_grad():  # another GPU's kernels: float32 rounding of a few ulps, about 1e-5 relative
        model[0].weight.mul_(1 + 1e-5)
    monkeypatch.setattr(env, "device_info", lambda dev: gpu("NVIDIA H100 80GB HBM3", "sm_90"))
    r = ag.compare(model, (x,), path=p, replay="off")
    assert r.ok, str(r)
    src = r.layers[0].leaves[0].tolerance_source or ""
    assert "A100" in src and "H100" in src and r.layers[0].rtol == 1e-4, src
    assert any("H100" in c for c in r.env_changes)
    monkeypatch.setattr(env, "device_info", lambda dev: gpu("NVIDIA A100-SXM4-80GB", "sm_80"))
    assert not ag.compare(model, (x,), path=p, replay="off").ok  # the same GPU model: same-device defaults


def test_rng_state_takes_and_restores_every_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fake CUDA generators; the model's is cuda:1 while cuda:0 is current."""
    from activation_guard.capture import hooks as capture

    gens = [torch.tensor([0], dtype=torch.uint8), torch.tensor([0], dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gens[0].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": gens[0].copy_(s))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.clone() for g in gens])

    def set_all(states: list[torch.Tensor]) -> None:
        for g, s in zip(gens, states):
            g.copy_(s)

    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    start = capture.rng_state()
    gens[1] += 7  # a dropout on cuda:1 drew numbers
    capture.set_rng_state(start)
    assert int(gens[1]) == 0
    gens[1] += 7
    assert capture.rng_moved(start)  # the replay's "it draws random numbers" hint sees it
    capture.set_rng_state(start)
    assert not capture.rng_moved(start)


def test_float64_reference_of_a_module_with_buffers_only_runs_where_its_buffers_are(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter-free module holding a table (RoPE, a mask) on the device: its float64 replay
    gets its inputs there ("meta" stands in for a GPU), not on the CPU."""
    from types import SimpleNamespace

    from activation_guard.replay import replay

    class Rope(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("freqs", torch.ones(4, dtype=torch.float64, device="meta"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.freqs

    reference = nn.Sequential(nn.Identity(), Rope())
    seen: list[torch.device] = []

    def to_reference(value: Any, device: torch.device) -> Any:
        seen.append(device)
        raise RuntimeError("stop here")

    monkeypatch.setattr(replay, "to_reference", to_reference)
    me = SimpleNamespace(reference=reference, no_reference={}, _run=lambda *a, **k: None)
    frame = SimpleNamespace(name="1")
    refs, _hooks = replay.Replayer._reference_outputs(me, frame, (torch.ones(4),), {}, [], None)  # type: ignore[arg-type]
    assert seen == [torch.device("meta")] and refs == {} and me.no_reference, me.no_reference
    assert replay.devices.module_device(nn.ReLU(), torch.device("meta")) == torch.device("meta")


def test_cotangents_are_drawn_on_the_cpu_under_another_default_device() -> None:
    """torch.set_default_device("cuda") would make the CPU generator's randn raise; "meta" stands
    in for it (there, a meta cotangent cannot be copied to the output's device)."""
    from activation_guard.gradients.loss import LossRule

    out = (torch.ones(3, requires_grad=True) * 2, torch.zeros(2, requires_grad=True) + 1)
    expect = LossRule("cotangent").roots(out)[1]
    with torch.device("meta"):
        _roots, grads = LossRule("cotangent").roots(out)
    assert grads is not None and expect is not None
    assert all(g.device.type == "cpu" for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))


def test_rank_process_group_puts_each_rank_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.plugin import ranks as rank_session

    dist = torch.distributed
    calls: dict[str, Any] = {}
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                 "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    with rank_session.process_group(5.0):
        pass
    assert calls["backend"] == "cpu:gloo,cuda:nccl"
    assert calls["set_device"] == 1 and calls["device_id"] == torch.device("cuda", 1)


def test_gather_on_an_nccl_only_group_moves_cpu_values_to_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from activation_guard.distributed import placements

    dist = torch.distributed
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert placements.comm_device(None, torch.device("cpu")) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert placements.comm_device(None, torch.device("cpu")) == torch.device("cpu")

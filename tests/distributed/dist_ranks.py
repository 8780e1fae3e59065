"""Functions the distributed tests run on every rank (through activation_guard.distributed.spawn.run_distributed).

Kept free of pytest so each rank imports only torch and activation_guard. Results are JSON.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import activation_guard as ag
from activation_guard.api.rank_summary import gather_verdicts
from activation_guard.distributed.ranks import RankInfo, rank_golden_path, rank_info


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def mlp_input() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _tp_mlp() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _describe(o: Any) -> str:
    from activation_guard.distributed.ranks import _async_type, is_dtensor

    if is_dtensor(o):
        return f"DTensor{tuple(o.shape)} local{tuple(o.to_local().shape)} {list(map(str, o.placements))}"
    act = _async_type()
    if act is not None and isinstance(o, act):
        return f"AsyncCollectiveTensor{tuple(o.shape)}"
    return f"{type(o).__name__}{tuple(o.shape)}"


def hook_view(model: nn.Module, x: torch.Tensor) -> dict[str, list[str]]:
    """What a forward hook sees on each module, registered first (prepend) and last."""
    seen: dict[str, list[str]] = {}
    handles = []
    for name, mod in model.named_modules():
        seen[name] = ["", ""]
        handles.append(mod.register_forward_hook(
            lambda m, a, o, n=name: seen[n].__setitem__(0, _describe(o)), prepend=True))
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name: seen[n].__setitem__(1, _describe(o))))
    with torch.no_grad():
        out = model(x)
    for h in handles:
        h.remove()
    seen["<returned>"] = [_describe(out), ""]
    return seen


def _summary(rep: Any) -> dict[str, Any]:
    fd = rep.first_divergence
    leaf = None if fd is None else next((x for x in fd.leaves if x.path == fd.path), None)
    return {
        "ok": rep.ok, "counts": rep.counts(), "text": str(rep),
        "first": None if fd is None else {"name": fd.name, "status": fd.status, "detail": fd.detail,
                                          "ranks": None if leaf is None else leaf.ranks},
        "max_abs": max((x.max_abs_diff or 0.0) for x in rep.layers),
        "notes": list(rep.notes),
    }


def tp_vs_single(golden: str) -> dict[str, Any]:
    """TP (Colwise '0', Rowwise '2') against a single-device golden: hook view, the ReLU's local
    shard verdict, placements, and a 1% weight bug on rank 1's shard of '0'."""
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    model = _tp_mlp()
    x = mlp_input()
    out: dict[str, Any] = {"rank": rank, "seen": hook_view(model, x)}
    out["plain"] = _summary(ag.compare(model, x, path=golden))
    placed = {"1": Shard(-1)}
    out["placed"] = _summary(ag.compare(model, x, path=golden, placements={**placed, "no.such.layer": Shard(0)}))
    # refactor check without files: the single-device model as reference, recorded privately per rank
    out["models"] = _summary(ag.compare_models(mlp(), model, x, placements=placed))
    with torch.no_grad():
        if rank == 1:
            model[0].weight.to_local().mul_(1.01)
    with gather_verdicts(tag="tp-bug", timeout=30) as g:
        g.report = ag.compare(model, x, path=golden, placements=placed)
    out["bug"] = _summary(g.report)
    out["merged"] = None if g.merged is None else {"text": g.merged.message(), "ok": g.merged.ok,
                                                   "first": vars(g.merged.first) if g.merged.first else None}
    return out


def tp_rowwise_bug(golden: str) -> dict[str, Any]:
    """A 1% bug in rank 1's shard of the Rowwise layer '2': its output is a partial sum, so the
    gathered value names every contributing rank."""
    from torch.distributed.tensor import Shard

    model = _tp_mlp()
    with torch.no_grad():
        if dist.get_rank() == 1:
            model[2].weight.to_local().mul_(1.01)
    return _summary(ag.compare(model, mlp_input(), path=golden, placements={"1": Shard(-1)}))


def fsdp_vs_single(golden: str, bug: bool) -> dict[str, Any]:
    """FSDP2 fully_shard (per layer and root) against a single-device golden."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    x = mlp_input()
    out: dict[str, Any] = {"seen": hook_view(model, x),
                           "params": {n: _describe(p) for n, p in model.named_parameters()}}
    if bug:
        with torch.no_grad():
            if dist.get_rank() == 1:
                model[0].weight.to_local().mul_(1.01)
    out["cmp"] = _summary(ag.compare(model, x, path=golden))
    return out


def per_rank_record(golden: str) -> dict[str, Any]:
    """Record this rank's golden of the TP model (local values): a plain path becomes its per-rank path."""
    model = _tp_mlp()
    s = ag.record(model, mlp_input(), path=golden)
    assert s.path == rank_golden_path(golden, rank_info())
    other = rank_golden_path(golden, RankInfo(1 - dist.get_rank(), 2))
    refused = ""
    try:
        ag.record(model, mlp_input(), path=other)
    except ValueError as e:
        refused = str(e)
    with ag.read_golden(s.path) as r:
        meta = r.meta["distributed"]
    return {"path": s.path, "calls": s.layer_calls, "refused_other": refused, "meta": meta}


def per_rank_compare(golden: str, bug_rank: int | None) -> dict[str, Any]:
    """Compare each rank with its own golden; a 1% change on ``bug_rank``'s shard of '0'."""
    model = _tp_mlp()
    with torch.no_grad():
        if dist.get_rank() == bug_rank:
            model[0].weight.to_local().mul_(1.01)
    with gather_verdicts(tag=f"per-rank-{bug_rank}", timeout=30) as g:
        g.report = ag.compare(model, mlp_input(), path=golden)  # resolves to this rank's own golden
    out = _summary(g.report)
    out["path"] = g.report.path
    out["merged"] = None if g.merged is None else {"text": g.merged.message(), "ok": g.merged.ok,
                                                   "first": vars(g.merged.first) if g.merged.first else None}
    return out


def exchange_error_paths(golden: str, silent_timeout: float) -> dict[str, Any]:
    """Rank 1 raises inside its check, then rank 1 never reaches one: rank 0's waits are bounded."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        with gather_verdicts(tag="raises", timeout=60) as g:
            if rank == 1:
                raise RuntimeError("golden unreadable on rank 1")
            g.report = ag.compare(mlp(), mlp_input(), path=golden)
    except RuntimeError as e:
        out["raised"] = str(e)
    out["raises"] = {"seconds": time.monotonic() - t0,
                     "merged": None if g.merged is None else g.merged.message(),
                     "errors": None if g.merged is None else [v.rank for v in g.merged.errors]}
    t0 = time.monotonic()
    merged = None
    if rank == 0:  # rank 1 "crashed" before its check: it posts nothing
        with gather_verdicts(tag="silent", timeout=silent_timeout) as g:
            g.report = ag.compare(mlp(), mlp_input(), path=golden)
        merged = g.merged
    out["silent"] = {"seconds": time.monotonic() - t0,
                     "merged": None if merged is None else merged.message(),
                     "silent": None if merged is None else merged.silent}
    return out


def gather_pieces() -> dict[str, Any]:
    """reassemble() on uneven pieces and odd dtypes; a shape mismatch raises on every rank."""
    from torch.distributed.tensor import Replicate, Shard

    from activation_guard.distributed.placements import reassemble

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    full = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    piece = full[:3] if rank == 0 else full[3:]  # uneven along dim 0
    got, layout = reassemble(piece, Shard(0))
    out["uneven"] = torch.equal(got, full)
    out["owner_of_row4"] = layout.owners((4, 0))[0]
    for dt in (torch.bfloat16, torch.bool, torch.int64, torch.complex64, torch.float16):
        x = torch.arange(8).reshape(2, 4).to(dt)
        got, _ = reassemble(x.chunk(2, dim=-1)[rank], Shard(-1))
        out[str(dt)] = torch.equal(got, x)
    same, _ = reassemble(full, Replicate())
    out["replicate_is_identity"] = same is full
    try:
        reassemble(torch.zeros(2, 3 + rank), Shard(0), where="layer 'x'")
    except ValueError as e:
        out["mismatch_error"] = str(e)
    return out


def parallel_suite(golden: str, llama_golden: str, per_rank_golden: str) -> dict[str, Any]:
    """Every scenario in one process group (each spawn costs seconds): against single-device
    goldens, then per-rank goldens recorded and compared."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from activation_guard.distributed.ranks import chunk_sizes

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    local_rows = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]).to_local().shape[0]
    return {
        "tp": tp_vs_single(golden),
        "rowwise_bug": tp_rowwise_bug(golden),
        "fsdp": fsdp_vs_single(golden, bug=False),
        "fsdp_bug": fsdp_vs_single(golden, bug=True),
        "pieces": gather_pieces(),
        "exchange": exchange_error_paths(golden, silent_timeout=2.0),
        "dtensor_uneven": [local_rows, chunk_sizes(5, dist.get_world_size())[dist.get_rank()]],
        "llama": tp_llama(llama_golden),
        "per_rank": {"record": per_rank_record(per_rank_golden),
                     "compare": per_rank_compare_twice(per_rank_golden, 1)},
    }


def env_and_allreduce(x: float) -> dict[str, Any]:
    import os

    t = torch.tensor([float(dist.get_rank()) + x])
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "env": {k: os.environ.get(k) for k in keys}, "threads": torch.get_num_threads()}


def _blocked_forever() -> None:
    """Wait for a store key nobody sets: stuck, and unaware that a peer died (unlike gloo ops)."""
    from activation_guard.api.rank_summary import default_store

    default_store().wait(["activation_guard/test/never-set"])


def rank1_raises_rank0_stuck() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke on purpose")
    _blocked_forever()
    return 0


def all_stuck() -> int:
    _blocked_forever()
    return 0


def returns_a_tensor() -> Any:
    return torch.ones(1)


def per_rank_compare_twice(golden: str, bug_rank: int) -> list[Any]:
    """Unchanged model, then a 1% change on ``bug_rank``'s shard of '0'."""
    return [per_rank_compare(golden, None), per_rank_compare(golden, bug_rank)]


def tiny_llama() -> nn.Module:
    """A one-layer Llama from a config (random weights; eager attention returns its weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def llama_inputs() -> dict[str, Any]:
    return {"input_ids": torch.arange(8).reshape(1, 8) % 64, "use_cache": False}


def tp_llama(golden: str) -> dict[str, Any]:
    """A Llama decoder layer under the usual TP plan against its single-device golden."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_llama()
    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    kw = llama_inputs()
    placed = {"*.mlp.act_fn": Shard(-1), "*.self_attn/1": Shard(1)}
    out = {"plain": _summary(ag.compare(model, (), kw, path=golden)),
           "placed": _summary(ag.compare(model, (), kw, path=golden, placements=placed))}
    with torch.no_grad():
        if dist.get_rank() == 1:
            model.model.layers[0].mlp.up_proj.weight.to_local().mul_(1.01)
    out["bug"] = _summary(ag.compare(model, (), kw, path=golden, placements=placed))
    return out

"""Tensor parallel and FSDP2 runs on 2 CPU ranks (gloo) against a golden recorded on one device.

One process group runs every scenario (tests/distributed/dist_ranks.py: parallel_suite); each
test below asserts one of them, on both ranks' results.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

REPLAY_OFF = ("replay is off in a multi-rank run (a layer re-run on one rank would leave the others out of its "
              "collectives)")


@pytest.fixture
def suite(suite):
    return suite["ranks"]  # [rank 0's results, rank 1's results]


@pytest.mark.slow
def test_what_capture_hooks_see_under_tensor_parallelism(suite):
    for r in suite:
        seen = r["tp"]["seen"]  # [hook registered with prepend=True, hook registered last]
        assert seen["0"] == ["DTensor(4, 16) local(4, 8) ['S(1)']", "Tensor(4, 8)"]  # Colwise
        assert seen["1"] == ["Tensor(4, 8)", "Tensor(4, 8)"]  # the ReLU: a plain local shard
        assert seen["2"] == ["DTensor(4, 8) local(4, 8) ['P(sum)']", "AsyncCollectiveTensor(4, 8)"]  # Rowwise
        assert seen[""] == ["AsyncCollectiveTensor(4, 8)", "AsyncCollectiveTensor(4, 8)"]  # the root


def test_local_shard_verdict_names_the_fix(suite):
    for r in suite:
        plain = r["tp"]["plain"]
        assert not plain["ok"]
        assert plain["counts"] == {"local_shard": 1, "match": 3}
        assert plain["first"]["name"] == "1" and plain["first"]["status"] == "local_shard"
        assert plain["first"]["detail"] == (
            "layer '1' returned a local shard (4, 8) of a tensor sharded over 2 ranks; the golden holds the "
            "full (4, 16); tell activation_guard how it is placed: placements={'1': Shard(-1)}")
        assert "a rank's local shard, not the full tensor" in plain["text"]
        assert "shape changed" not in plain["text"]


def test_tp_with_placements_matches_single_device(suite):
    for r in suite:
        placed = r["tp"]["placed"]
        assert placed["ok"], placed["text"]
        assert placed["counts"] == {"match": 4}  # every layer compared, the ReLU as a gathered full tensor
        assert placed["max_abs"] < 1e-5  # Rowwise reduces in another order than one device: not bit-equal
        assert placed["notes"] == [
            f"rank {r['tp']['rank']} of 2: DTensor outputs and placed shards compared as full tensors, other outputs "
            "as this rank's local values", REPLAY_OFF, "placements pattern 'no.such.layer' matched no layer"]


def test_compare_models_single_device_reference_vs_tp_candidate(suite):
    for r in suite:
        models = r["tp"]["models"]
        assert models["ok"], models["text"]
        assert models["counts"] == {"match": 4} and models["max_abs"] < 1e-5


def test_one_percent_bug_on_rank1_shard_found_at_its_layer_and_rank(suite):
    for r in suite:
        bug = r["tp"]["bug"]
        assert not bug["ok"]
        assert bug["first"]["name"] == "0" and bug["first"]["ranks"] == [1]
        assert "lies in the shard of rank 1 (Shard(dim=1) over mesh [2])" in bug["first"]["detail"]
    rank0, rank1 = suite
    assert rank1["tp"]["merged"] is None  # the summary is gathered to rank 0 only
    merged = rank0["tp"]["merged"]
    assert merged["first"]["rank"] == 1 and merged["first"]["name"] == "0" and merged["first"]["position"] == 0
    assert merged["first"]["seen_on"] == [0, 1]
    assert merged["text"].startswith(
        "activation_guard: first divergence across 2 ranks at layer '0' call 0 (#1 in execution order) on rank 1")


def test_rowwise_bug_is_a_partial_sum_of_every_rank(suite):
    for r in suite:
        res = r["rowwise_bug"]
        assert res["first"]["name"] == "2" and res["first"]["ranks"] == [0, 1]
        assert "a sum of partial values from ranks 0, 1" in res["first"]["detail"]


def test_fsdp2_matches_single_device(suite):
    for r in suite:
        f = r["fsdp"]
        assert f["cmp"]["ok"], f["cmp"]["text"]
        assert f["cmp"]["counts"] == {"match": 4}
        assert f["cmp"]["max_abs"] == 0.0  # parameters are gathered, the math is one device's
        # FSDP2 shards parameters (DTensor, Shard(0)); module outputs are plain full tensors
        assert f["params"]["0.weight"] == "DTensor(16, 8) local(8, 8) ['S(0)']"
        assert f["seen"] == {"": ["Tensor(4, 8)"] * 2, "0": ["Tensor(4, 16)"] * 2, "1": ["Tensor(4, 16)"] * 2,
                             "2": ["Tensor(4, 8)"] * 2, "<returned>": ["Tensor(4, 8)", ""]}
        bug = r["fsdp_bug"]["cmp"]
        assert not bug["ok"] and bug["first"]["name"] == "0" and bug["first"]["ranks"] is None


def test_reassemble_pieces(suite):
    for r in suite:
        p = r["pieces"]
        assert p["uneven"] and p["owner_of_row4"] == [1] and p["replicate_is_identity"]
        for dt in ("bfloat16", "bool", "int64", "complex64", "float16"):
            assert p[f"torch.{dt}"], dt
        # raised on both ranks, decided from the gathered shapes: nobody is left in a collective
        assert p["mismatch_error"] == ("layer 'x': the ranks' pieces differ outside dimension 0, so they are not "
                                       "shards of one tensor along it: rank 0: (2, 3), rank 1: (2, 4)")
        assert r["dtensor_uneven"][0] == r["dtensor_uneven"][1]  # chunk_sizes() is DTensor's split


def test_a_rank_raising_does_not_leave_rank0_waiting(suite):
    rank0, rank1 = suite
    ex0 = rank0["exchange"]
    assert rank1["exchange"]["raised"] == "golden unreadable on rank 1"
    # rank 1 posted its error before re-raising: rank 0 knew at once, without its 60 s timeout
    assert ex0["raises"]["errors"] == [1] and ex0["raises"]["seconds"] < 30
    assert "rank 1: raised RuntimeError: golden unreadable on rank 1" in ex0["raises"]["merged"]
    # rank 1 never reached the second check: rank 0 waited its 2 s timeout (FileStore polls per second)
    assert ex0["silent"]["silent"] == [1]
    assert 2.0 <= ex0["silent"]["seconds"] < 30
    assert "rank 1: sent no verdict within 2 s" in ex0["silent"]["merged"]


def test_llama_block_under_tp_plan(suite):
    for r in suite:
        plain = r["llama"]["plain"]
        assert plain["counts"] == {"local_shard": 2, "match": 17}
        assert plain["first"]["name"] == "model.layers.0.self_attn"  # eager attention's weights, per head
        assert plain["first"]["detail"].endswith("placements={'model.layers.0.self_attn/1': Shard(1)}")
        placed = r["llama"]["placed"]
        assert placed["ok"], placed["text"]
        assert placed["counts"] == {"match": 19} and placed["max_abs"] < 1e-5
        bug = r["llama"]["bug"]
        assert bug["first"]["name"] == "model.layers.0.mlp.up_proj" and bug["first"]["ranks"] == [1]
        assert "lies in the shard of rank 1 (Shard(dim=2) over mesh [2])" in bug["first"]["detail"]

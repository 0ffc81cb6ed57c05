"""gem plan on a small topology against formulas written out by hand for gem_tiny (configs/model/gem_tiny.yaml).

Cluster: 2 hosts x 2 GPUs; layout: HSDP 2 x 2, ep 2, embedding groups of 2 (one per host) synced every 2 steps.
"""

from __future__ import annotations

import math

import pytest

from gem.cli.plan import compose, main
from gem.parallel.dims import validate
from gem.plan.estimate import estimate, ref_rate
from gem.plan.memory import activation_bytes_per_token
from gem.plan.topology import GB, ClusterSpec

LAYOUT = ["parallel=full_5d", "parallel.emb_sync_every=2", "parallel.sharding_types=[table_wise]"]
CLUSTER = ClusterSpec(hosts=2, gpus_per_host=2, hbm_gb=80, ddr_gb=64, intra_gbps=100, inter_gbps=10)

# gem_tiny by hand: d=32, heads 2 x 16 (kv 2), d_ff 64; block 1 is MoE (4 experts, top 2, d_ff 32)
D, B = 32, 128
BLOCK0 = 32 + 32 * (2 + 2 * 2) * 16 + 32 * 32 + 32 + 3 * 32 * 64  # norms, qkv, out, SwiGLU
BLOCK1_NO_MOE = 32 + 32 * 6 * 16 + 32 * 32 + 32
ROUTER, EXPERT_W = 4 * 32, 4 * 32 * 32  # w1, w3, w2 [4, 32, 32] each
ROOT = (32 * 32 + 32 + 32  # input_proj, final_norm
        + (16 * 32 + 32) + 2 * (8 * 32 + 32)  # query_proj of cand_item / user_segment / context
        + (8 * 32 + 32) + (32 * 32 + 32) + 32  # dense_token MLP, summary token
        + 32 + 32 * 32 + 32 * 64 + 32 * 32  # interaction: q_norm, q_proj, kv_proj, out
        + (8 * 32 + 32)  # dense_mlp
        + (5 * 32 + 32) * 64 + 64  # over_arch: 5 query tokens + dense path -> 64
        + 2 * ((64 * 32 + 32) + (32 + 1)))  # two task heads
ROOT_SHARD = (ROOT - 2 * 33) // 2 + 2 * 33  # the heads' [1, 32] weight and [1] bias pad to 2 rows: 1 row each


@pytest.fixture(scope="module")
def planned():
    cfgs = compose(LAYOUT)
    par = validate(cfgs.parallel, CLUSTER.world)
    rate = ref_rate(cfgs, 100.0)  # its own reference: compute must come out at exactly 100 ms
    return cfgs, estimate(cfgs, par, CLUSTER, rate)


def test_dense_memory_per_rank(planned):
    _, est = planned
    shard = ROOT_SHARD + BLOCK0 // 2 + BLOCK1_NO_MOE // 2 + (ROUTER + 3 * EXPERT_W // 2)  # experts: ep splits them
    d = est.dense
    assert d.params == 4 * shard and d.grads == 4 * shard and d.optimizer == 8 * shard
    # backward of block 1: the root, block 1 and its MoE unit, and block 0 prefetched
    assert d.gathered == 4 * (ROOT + BLOCK1_NO_MOE + (ROUTER + 3 * EXPERT_W // 2) + BLOCK0)
    # per token: measured against saved tensors in tests/plan/test_memory_measured.py; here bf16 (autocast on the
    # GPUs) times this rank's sampled history tokens
    assert d.activations == int(est.work.tokens * activation_bytes_per_token(planned[0].model, 2))
    assert 0 < est.work.tokens <= B * 64
    for rank, used in est.hbm.items():
        assert used == d.total + est.emb.hbm[rank]  # group 0 = ranks 0, 1


def test_communication_per_collective(planned):
    _, est = planned
    got = {c.name: c for c in est.collectives}
    t = est.work.tokens
    fsdp = ROOT_SHARD + BLOCK0 // 2 + BLOCK1_NO_MOE // 2
    want = {
        "FSDP all-gather (dense)": 2 * 4 * (2 * ROOT_SHARD + 2 * BLOCK0 // 2 + BLOCK1_NO_MOE // 2),
        "FSDP reduce-scatter (dense)": 2 * 4 * fsdp,
        "HSDP replica all-reduce (dense)": 4 * fsdp,
        "HSDP replica all-reduce (experts)": 4 * (ROUTER + 3 * EXPERT_W // 2),
        "expert all-to-all (tokens)": 4 * t * 2 * D * 2,  # top-2 rows of bf16 activations
        "expert all-to-all (counts)": 4 * 8,
        "router gradient all-reduce": 4 * ROUTER,
        # table-wise: ids to one owner, one length per example, 2 (kind, type) split exchanges of 2 x 3 int64
        "embedding input dist (ids)": 8 * (2 * t + B * (1 + 1 + 2)),
        "embedding input dist (lengths, splits)": 5 * B * 8 + 2 * 2 * 3 * 8,
        # the candidate is looked up unpooled in the history's item table: one row per example
        "sequence embedding all-to-all (fwd+bwd)": 2 * (2 * t + B) * 16 * 4,
        "pooled embedding all-to-all (fwd+bwd)": 2 * B * (8 + 8) * 4,
    }
    rows = {"item": 10000, "action": 4, "user_segment": 100, "context": 50}
    dims = {"item": 16, "action": 16, "user_segment": 8, "context": 8}
    held = {0: 0, 1: 0}
    for module_plan in est.emb.plan.plan.values():
        for name, ps in module_plan.items():
            assert ps.sharding_type == "table_wise"
            held[ps.ranks[0]] += rows[name] * (dims[name] + 1)  # weights + row-wise Adagrad state
    want["embedding replica sync all-reduce"] = 4 * max(held.values()) / 2
    assert {k: c.bytes for k, c in got.items()} == pytest.approx(want, rel=1e-12)

    # wire time: (n-1)/n of the buffer (2x for all-reduce) at 100 GB/s in a host, 10 GB/s across hosts
    across = {"HSDP replica all-reduce (dense)", "HSDP replica all-reduce (experts)",
              "embedding replica sync all-reduce"}
    factor = {"all_reduce": 2 * 0.5, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5}
    ms = sum(1e3 * want[k] * factor[got[k].op] / ((10 if k in across else 100) * GB) for k in want)
    assert est.comm_ms == pytest.approx(ms, rel=1e-9)
    # the mean rank's compute is the reference's; the step waits for the slowest rank
    assert est.compute_ms == pytest.approx(100.0 * est.work.straggler_factor, rel=1e-12)
    assert est.step_ms == pytest.approx(est.compute_ms + ms, rel=1e-9)


def test_compute_scales_with_flops():
    # twice the batch: twice the history tokens and examples, so twice the FLOPs (same length law, same seed
    # prefix does not matter: compare against the estimate's own FLOP count)
    cfgs = compose(LAYOUT)
    big = compose(LAYOUT + ["data.batch_size=256"])
    rate = ref_rate(cfgs, 100.0)
    par = validate(big.parallel, CLUSTER.world)
    est = estimate(big, par, CLUSTER, rate)
    small = estimate(cfgs, par, CLUSTER, rate)
    assert est.compute_ms == pytest.approx(
        100.0 * est.work.flops / small.work.flops * est.work.straggler_factor, rel=1e-12)
    # the doubled batch really doubles the work (random lengths: within 5%), so the first check compared unequal runs
    assert est.compute_ms / small.compute_ms == pytest.approx(2.0, rel=0.05)


def test_cli_report_and_one_line_failure(capsys):
    args = ["topology.hosts=2", "topology.gpus_per_host=2", "topology.hbm_gb=80", *LAYOUT]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("embedding sharding plan", "dense memory per rank", "FSDP all-gather (dense)",
                   "expert all-to-all (tokens)", "embedding replica sync all-reduce", "step time (estimate)",
                   "parallel.emb_shard_group=2"):
        assert needle in out
    assert main(["topology.hosts=2", "topology.gpus_per_host=2", "topology.hbm_gb=0.0001", *LAYOUT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gem-plan: error: rank 0 needs ") and "bytes" in err[0]
    assert main(["topology.hosts=0"]) == 2
    assert capsys.readouterr().err.strip() == "gem-plan: error: topology.hosts: must be > 0 (got 0)"
    assert main(["topology.gpus_per_host=3", *LAYOUT]) == 2
    assert "parallel." in capsys.readouterr().err


def test_production_preset_is_production_size():
    cfgs = compose(["experiment=prod_1t"])
    sparse = sum(t.num_embeddings * t.embedding_dim for t in cfgs.model.tables)
    from gem.plan.memory import fsdp_units

    dense = sum(u.numel() for u in fsdp_units(cfgs.model, 8))
    assert sparse >= 10**12 and dense >= 10**9
    assert validate(cfgs.parallel, 512).emb_shard_group == 128
    assert math.prod([cfgs.parallel.dp_replicate, cfgs.parallel.dp_shard]) == 512


def test_production_plan_on_512_ranks_runs_on_cpu():
    import time

    t0 = time.perf_counter()
    cfgs = compose(["experiment=prod_1t"])
    cluster = ClusterSpec(hosts=64, gpus_per_host=8, hbm_gb=141, intra_gbps=450, inter_gbps=50)
    est = estimate(cfgs, validate(cfgs.parallel, 512), cluster, ref_rate(compose(["experiment=gpu_base"]), 166.0))
    assert time.perf_counter() - t0 < 120
    # 128 ranks share the tables: at least their fp32 weights and one Adagrad value per row, a little more for
    # the planner's input / output buffers
    weights = sum(t.num_embeddings * t.embedding_dim * 4 for t in cfgs.model.tables) / 128
    state = sum(t.num_embeddings * 4 for t in cfgs.model.tables) / 128
    assert min(est.emb.hbm.values()) >= 0.99 * (weights + state)
    assert max(est.emb.hbm.values()) <= 1.1 * (weights + state)
    # dense params: every parameter once over the 8 ranks of dp_shard (experts: 8-way ep), fp32
    total = est.dense.detail["total_numel"]
    assert est.dense.params == pytest.approx(4 * total / 8, rel=1e-3)
    assert max(est.hbm.values()) <= cluster.hbm_bytes and est.step_ms > est.compute_ms > 0


def test_a_group_that_spans_hosts_sets_the_bandwidth():
    from gem.parallel.dims import ParallelConfig
    from gem.plan.comm import layout_groups

    # 3 GPUs per host: FSDP pairs (0,1) and (4,5) stay in a host, (2,3) straddles hosts 0 and 1
    par = validate(ParallelConfig(dense="fsdp", dp_replicate=3, dp_shard=2, emb_shard_group=3), 6)
    groups = layout_groups(par, 6, 3)
    assert groups["dp_shard"] == (2, 3)
    assert groups["emb_shard"] == (0, 1, 2) and groups["emb_replicate"] == (0, 3)
    assert groups["dp_replicate"] == (0, 2, 4)


@pytest.mark.parametrize("form", ["rows", "interaction", "targets"])
def test_request_workload_counts_what_the_form_runs(form):
    """Requests of 1..8 candidates: the tower's tokens are a copy of the history per candidate (rows), each history
    once (interaction) or each history and its target tokens (targets); the FLOPs are the form's own count; the
    request's pooled features are looked up once per request (their all-to-all as in the row form), the candidate
    ids once per candidate (the sequence all-to-all grows with them)."""
    import torch

    from gem.data.batch import lengths_to_offsets
    from gem.data.synthetic import sample_candidate_counts, sample_lengths
    from gem.model.flops import train_flops
    from gem.plan.estimate import workload

    cfgs = compose(LAYOUT + ["data.max_candidates=8", f"model.candidates={form}"])
    work = workload(cfgs, seed=3)
    gen = torch.Generator().manual_seed(3)
    lengths = sample_lengths(cfgs.data.schema.histories[0], B, gen)
    counts = sample_candidate_counts(8, B, gen)
    assert int(counts.max()) > 1
    expect = {"rows": (lengths * counts).sum(), "interaction": lengths.sum(),
              "targets": lengths.sum() + counts.sum()}[form]
    assert work.batch == B and work.tokens == int(expect)
    assert work.flops == train_flops(cfgs.model, lengths_to_offsets(lengths), lengths_to_offsets(counts))
    assert work.candidates == int(counts.sum())
    assert work.ids_per_example["hist_item"] == pytest.approx(float(lengths.double().mean()))
    assert work.ids_per_example["cand_item"] == pytest.approx(float(counts.double().mean()))
    if form == "rows":
        par = validate(cfgs.parallel, CLUSTER.world)
        rows = estimate(compose(LAYOUT), par, CLUSTER, 1.0, seed=3)
        reqs = estimate(cfgs, par, CLUSTER, 1.0, seed=3)
        size = {c.name: c.bytes for c in reqs.collectives}
        base = {c.name: c.bytes for c in rows.collectives}
        assert size["pooled embedding all-to-all (fwd+bwd)"] == base["pooled embedding all-to-all (fwd+bwd)"]
        assert size["sequence embedding all-to-all (fwd+bwd)"] > base["sequence embedding all-to-all (fwd+bwd)"]

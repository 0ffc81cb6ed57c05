import pytest
import torch

from gem.model import GEMModel, ModelConfig, multitask_loss
from gem.model import flops as F
from tests.model._batches import data_dict, make_batch, tiny_cfg, tiny_dict, tiny_schema


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return GEMModel(cfg, embedding_device="cpu")


@pytest.mark.parametrize("lengths", [[5], [0], [0, 3, 0, 7, 1], [1, 1], [0, 0, 0], [11, 2, 9]])
def test_output_shapes_on_jagged_batches(lengths):
    cfg = tiny_cfg()
    m = _model(cfg)
    out = m(make_batch(cfg, lengths))
    assert out.logits.shape == (len(lengths), 2)
    assert torch.isfinite(out.logits).all()
    assert out.aux_loss.dim() == 0 and torch.isfinite(out.aux_loss)


def test_output_is_a_pytree_of_its_tensors():
    """FSDP2 (torch 2.11) hooks its pre-backward all-gather only on tensors it finds by pytree flattening: the
    output's tensors must be leaves of it, else the root's resharded params are freed in backward."""
    cfg = tiny_cfg()
    out = _model(cfg)(make_batch(cfg, [3, 0, 2]))
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    assert len(leaves) == 2 and leaves[0] is out.logits and leaves[1] is out.aux_loss
    again = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(again) is type(out) and again.logits is out.logits


def test_examples_are_independent_and_empty_history_sees_nothing():
    """An example's logits depend only on its own features: equal with batch-mates or alone (batch of 1)."""
    cfg = tiny_cfg(moe_every=0)  # MoE routing is per token too, but keep the check to the dense path
    m = _model(cfg).eval()
    full = make_batch(cfg, [4, 0, 6], seed=1)
    y = m(full).logits
    for i in range(3):
        one = _slice(full, i)
        torch.testing.assert_close(m(one).logits, y[i:i + 1], rtol=1e-5, atol=1e-5)
    # the empty-history example: changing another user's history does not move it
    from torchrec import KeyedJaggedTensor

    other = make_batch(cfg, [4, 0, 6], seed=2)
    other.sparse, other.dense = full.sparse, full.dense
    other.sequence = KeyedJaggedTensor.from_jt_dict(
        {k: (full if k in cfg.candidate_features else other).sequence[k] for k in full.sequence.keys()})  # noqa: SIM118 (a KJT, not a dict)
    torch.testing.assert_close(m(other).logits[1], y[1])


def _slice(batch, i):
    from torchrec import KeyedJaggedTensor

    from gem.data import Batch

    def kjt_row(kjt):
        keys = kjt.keys()
        lens = kjt.lengths().view(len(keys), -1)
        offs = kjt.offsets().view(-1)
        b = lens.shape[1]
        vals = []
        for k in range(len(keys)):
            lo, hi = int(offs[k * b + i]), int(offs[k * b + i + 1])
            vals.append(kjt.values()[lo:hi])
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(vals), lengths=lens[:, i].clone())

    L = int(batch.seq_offsets[i + 1] - batch.seq_offsets[i])
    return Batch(sequence=kjt_row(batch.sequence), sparse=kjt_row(batch.sparse), dense=batch.dense[i:i + 1],
                 labels=batch.labels[i:i + 1], seq_offsets=torch.tensor([0, L]), max_seq_len=L)


def test_gradients_reach_every_table_and_dense_parameter():
    cfg = tiny_cfg()
    m = _model(cfg)
    batch = make_batch(cfg, [6, 0, 9, 3], seed=3)
    out = m(batch)
    loss, per = multitask_loss(out.logits, batch.labels, cfg.task_weights, cfg.tasks)
    assert set(per) == {"click", "conversion"}
    (loss + out.aux_loss).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # table rows that were looked up get gradient, the others none
    for kjt, coll, attr in ((batch.sequence, m.ec, "embeddings"), (batch.sparse, m.ebc, "embedding_bags")):
        for t in cfg.tables:
            if t.name not in getattr(coll, attr):
                continue
            w = getattr(coll, attr)[t.name].weight
            ids = torch.cat([kjt[f].values() for f in t.features]).unique()
            touched = w.grad.abs().sum(1) > 0
            assert touched[ids].all(), t.name
            assert touched.sum() == ids.numel(), t.name


def test_multitask_loss_matches_bce_by_hand():
    logits = torch.randn(7, 3, dtype=torch.float64)
    labels = torch.randint(0, 2, (7, 3)).double()
    w = [0.5, 1.0, 2.0]
    total, per = multitask_loss(logits, labels, w, ["a", "b", "c"])
    p = torch.sigmoid(logits)
    by_hand = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean(0)
    torch.testing.assert_close(torch.stack([per["a"], per["b"], per["c"]]).double(), by_hand)
    torch.testing.assert_close(total.double(), (by_hand * torch.tensor(w, dtype=torch.float64)).sum())
    with pytest.raises(ValueError, match="weights"):
        multitask_loss(logits, labels, [1.0, 2.0])


def test_attention_kinds_run_and_agree_when_the_mask_is_full():
    """swa with a window >= the longest history and block with block >= it are the plain causal model."""
    lengths = [5, 0, 8, 1]
    outs = {}
    for kind, extra in (("jfa", {}), ("swa", {"window": 16}), ("block", {"block_size": 16})):
        cfg = tiny_cfg(attention=kind, **extra)
        m = _model(cfg)
        outs[kind] = m(make_batch(cfg, lengths)).logits
        outs[kind].sum().backward()
    torch.testing.assert_close(outs["swa"], outs["jfa"])
    torch.testing.assert_close(outs["block"], outs["jfa"])
    # a short window / block really changes the result
    for kind, extra in (("swa", {"window": 2}), ("block", {"block_size": 2})):
        cfg = tiny_cfg(attention=kind, **extra)
        y = _model(cfg)(make_batch(cfg, lengths)).logits
        assert not torch.allclose(y, outs["jfa"])


def test_gqa_and_sum_combine_run():
    cfg = tiny_cfg(num_heads=4, num_kv_heads=2, head_dim=8, seq_combine="sum")
    m = _model(cfg)
    out = m(make_batch(cfg, [3, 0, 2]))
    out.logits.sum().backward()
    assert m.blocks[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, cfg.d_model)


def test_triton_kernels_match_reference_on_tiny_model():
    pytest.importorskip("triton")
    import gem.ops  # noqa: F401  (the Triton ops must import)

    lengths = [3, 0, 5]
    grads = {}
    outs = {}
    for kernel in ("reference", "triton"):
        cfg = tiny_cfg(kernel=kernel, num_blocks=1, moe_every=1)
        m = _model(cfg)
        batch = make_batch(cfg, lengths, seed=5)
        out = m(batch)
        (out.logits.sum() + out.aux_loss).backward()
        outs[kernel] = out.logits.detach()
        grads[kernel] = {n: p.grad.clone() for n, p in m.named_parameters()}
    torch.testing.assert_close(outs["triton"], outs["reference"], rtol=1e-4, atol=1e-5)
    for n, g in grads["reference"].items():
        torch.testing.assert_close(grads["triton"][n], g, rtol=1e-3, atol=1e-5, msg=n)


def test_meta_embedding_device_leaves_tables_unmaterialised():
    cfg = tiny_cfg()
    m = GEMModel(cfg, embedding_device="meta")
    assert all(p.is_meta for p in m.ec.parameters()) and all(p.is_meta for p in m.ebc.parameters())
    assert not any(p.is_meta for p in m.dense_parameters())


def test_table_init_range_is_respected():
    data = data_dict()
    data["tables"]["item"]["init_range"] = 0.001
    m = _model(tiny_cfg(data=data))
    w = m.ec.embeddings["item"].weight
    assert w.abs().max() <= 0.001 and w.abs().max() > 0.0005


def test_flops_equal_a_hand_count():
    d = tiny_dict(num_blocks=2, num_heads=2, num_kv_heads=1, head_dim=16, d_ff=64, moe_every=2)
    d.update(d_model=32)
    d["moe"].update(num_experts=4, top_k=2, d_ff=32)
    d["interaction"].update(num_heads=2, head_dim=16, num_kv_heads=None, dense_hidden=[32])
    d["heads"].update(over_arch=[64], hidden=[32])
    cfg = ModelConfig.from_dict(d, tiny_schema())
    # per history token: input proj (16 + 16) * 32; block attention qkv 32 * (2 + 2) * 16 + out 32 * 32;
    # block 0 SwiGLU 3 * 32 * 64; block 1 router 32 * 4 + top-2 experts 2 * 3 * 32 * 32; interaction K/V 32 * 64
    per_tok = 32 * 32 + 2 * (32 * 4 * 16 + 32 * 32) + 3 * 32 * 64 + (32 * 4 + 2 * 3 * 32 * 32) + 32 * 64
    assert F.tower_weights_per_token(cfg) == per_tok
    # per example: query projections (candidate 16, sparse 8 + 8) * 32; dense token 8*32 + 32*32; 5 query tokens x
    # (q 32*32 + out 32*32); dense path 8*32; over arch (5*32 + 32) * 64; two heads 64*32 + 32*1
    per_ex = 32 * 32 + (8 * 32 + 32 * 32) + 5 * 2 * 32 * 32 + 8 * 32 + (5 * 32 + 32) * 64 + 2 * (64 * 32 + 32)
    assert F.weights_per_example(cfg) == per_ex
    lengths = [0, 3, 10]
    offsets = torch.tensor([0, 0, 3, 13])
    attn = 3 * 4 * 2 * 16 * (9 / 2 + 100 / 2) * 2  # causal, two blocks
    gdpa = 3 * 4 * 2 * 16 * 5 * 13
    expect = 6 * per_tok * 13 + 6 * per_ex * 3 + attn + gdpa
    assert F.train_flops(cfg, offsets) == round(expect)
    assert GEMModel(cfg, embedding_device="meta").dense_flops_per_token() == 6 * per_tok
    # windowed / block-causal pair counts
    swa = ModelConfig.from_dict({**d, "tower": {**d["tower"], "attention": "swa", "window": 4}}, tiny_schema())
    # length 10: rows see 1, 2, 3, 4 keys, then 5 (itself and 4 before); half the diagonal (10 / 2) off
    assert F.attention_pairs(swa, torch.tensor(lengths)) == 9 / 2 + (1 + 2 + 3 + 4 + 6 * 5 - 10 / 2)
    blk = ModelConfig.from_dict({**d, "tower": {**d["tower"], "attention": "block", "block_size": 4}}, tiny_schema())
    assert F.attention_pairs(blk, torch.tensor(lengths)) == 9 / 2 + (2 * 16 / 2 + 4 / 2)


def test_interaction_leaves_tokens_of_empty_histories_unchanged():
    from gem.model.gem import TargetInteraction

    cfg = tiny_cfg()
    torch.manual_seed(0)
    inter = TargetInteraction(cfg)
    tokens = torch.randn(3, cfg.num_query_tokens, cfg.d_model)
    seq = torch.randn(7, cfg.d_model)
    offsets = torch.tensor([0, 0, 7, 7])  # users 0 and 2 have no history
    out = inter(tokens, seq, offsets, 7)
    torch.testing.assert_close(out[0], tokens[0])
    torch.testing.assert_close(out[2], tokens[2])
    assert not torch.allclose(out[1], tokens[1])
    # user 1 by hand: tokens + out(sum_j gelu(q.k_j / sqrt(D)) v_j / normalize)
    h, dh = cfg.interaction.num_heads, cfg.interaction_head_dim
    q = inter.q_proj(inter.q_norm(tokens[1])).view(-1, h, dh)
    k, v = inter.kv_proj(seq).view(7, 2, h, dh).unbind(1)
    s = torch.einsum("qhd,khd->hqk", q, k) / dh ** 0.5
    o = torch.einsum("hqk,khd->qhd", torch.nn.functional.gelu(s), v) / cfg.interaction.normalize
    torch.testing.assert_close(out[1], tokens[1] + inter.out(o.reshape(-1, h * dh)), rtol=1e-5, atol=1e-5)


def _pipeline_trace(m):
    """The graph torchrec's train pipeline traces: its Tracer with the model's direct children as leaves (what
    `_get_leaf_module_names` yields once ec/ebc are sharded; here the unsharded ec/ebc are leaves by name)."""
    from torchrec.distributed.train_pipeline.utils import Tracer

    return Tracer(leaf_modules=[n for n, _ in m.named_children()]).trace(m)


@pytest.mark.parametrize("combine,moe_every", [("concat", 2), ("sum", 0)])
def test_forward_traces_for_the_sparse_dist_pipeline_and_the_graph_matches_eager(combine, moe_every):
    """The pipeline can only move an embedding module's input dist ahead if that input is a getattr chain on
    forward's argument; the traced graph must also compute exactly what eager forward does."""
    cfg = tiny_cfg(seq_combine=combine, moe_every=moe_every)
    m = _model(cfg)
    graph = _pipeline_trace(m)
    (placeholder,) = [n for n in graph.nodes if n.op == "placeholder"]
    calls = {n.target: n for n in graph.nodes if n.op == "call_module" and n.target in ("ec", "ebc")}
    assert set(calls) == {"ec", "ebc"}
    for name, attr in (("ec", "sequence"), ("ebc", "sparse")):
        (arg,) = calls[name].args
        assert not calls[name].kwargs
        assert arg.op == "call_function" and arg.target is getattr and arg.args == (placeholder, attr), name
    gm = torch.fx.GraphModule(m, graph)
    for lengths in ([5], [0], [0, 3, 0, 7, 1], [1, 1], [0, 0, 0], [16, 2, 9]):
        batch = make_batch(cfg, lengths, seed=len(lengths))
        want, got = m(batch), gm(batch)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.aux_loss, want.aux_loss), lengths
        m.zero_grad()
        (want.logits.sum() + want.aux_loss).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad()
        (got.logits.sum() + got.aux_loss).backward()
        assert grads.keys() == {n for n, p in m.named_parameters() if p.grad is not None}
        for n, g in grads.items():
            assert torch.equal(m.get_parameter(n).grad, g), (lengths, n)


def test_missing_embedding_outputs_are_named():
    from torchrec import JaggedTensor, KeyedTensor

    from gem.model.embeddings import pooled_embeddings, sequence_embeddings

    jt = JaggedTensor(values=torch.randn(3, 4), lengths=torch.tensor([1, 2]))
    assert torch.equal(sequence_embeddings({"a": jt}, ["a"])[0], jt.values())
    with pytest.raises(KeyError, match=r"features \['b'\] missing"):
        sequence_embeddings({"a": jt}, ["a", "b"])
    kt = KeyedTensor(keys=["x", "y"], length_per_key=[2, 3], values=torch.randn(4, 5))
    x, y = pooled_embeddings(kt, ["y", "x"])  # by key, in the asked order
    assert torch.equal(y, kt.values()[:, :2]) and torch.equal(x, kt.values()[:, 2:])
    with pytest.raises(KeyError, match=r"sparse features \['z'\] missing"):
        pooled_embeddings(kt, ["x", "z"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_torch_and_keeps_the_input_dtype(dtype):
    from gem.model.attention import make_norm

    torch.manual_seed(0)
    norm = make_norm("rmsnorm", 16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 16).to(dtype).requires_grad_()
    y = norm(x)
    assert y.dtype == dtype
    ref = torch.nn.functional.rms_norm(x.float(), (16,), norm.weight, 1e-6)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-6, atol=2e-2)
    y.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32

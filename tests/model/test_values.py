"""Values, not shapes: model options against hand references or a changed output, and bf16 paths against fp32.

An option that silently stops reaching the computation (a config key read but not used, a feature dropped, a
wrong dtype cast) leaves every shape intact; these tests compare numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gem.model import GEMModel, ModelConfig
from tests.model._batches import make_batch, tiny_dict, tiny_schema

LENGTHS = [5, 0, 7, 1, 3]
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7: rounding to bf16 moves a value by at most eps / 2 of it


def _cfg(d: dict) -> ModelConfig:
    cfg = ModelConfig.from_dict(d, tiny_schema())
    cfg.kernel = "reference"
    return cfg


def _model(d: dict, seed: int = 0) -> GEMModel:
    torch.manual_seed(seed)
    return GEMModel(_cfg(d), embedding_device="cpu").eval()


def _tower_out(model: GEMModel, batch) -> torch.Tensor:
    """The towers' output [T, d] (after the final norm), the interaction's keys and values."""
    return model._towers(model._history_tokens(model.ec(batch.sequence)), batch, per_candidate_copy=False)[0]


def _capture_input(module: torch.nn.Module) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    module.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach().clone()))
    return seen


@pytest.mark.parametrize("combine", ["concat", "sum"])
def test_seq_combine_feeds_the_tower_every_sequence_feature(combine):
    """The input projection sees, per history token, the looked-up rows of all sequence features: concatenated in
    feature order, or summed."""
    d = tiny_dict(seq_combine=combine)
    m = _model(d)
    (hist,) = m.cfg.histories
    seen = _capture_input(m.input_projs[hist])
    batch = make_batch(m.cfg, LENGTHS, seed=1)
    with torch.no_grad():
        m(batch)
    table = {f: t.name for t in m.cfg.sequence_tables for f in t.features}
    rows = [m.ec.embeddings[table[f]].weight.detach()[batch.sequence[f].values()]
            for f in m.cfg.history_features(hist)]
    want = torch.cat(rows, -1) if combine == "concat" else torch.stack(rows).sum(0)
    assert len(rows) >= 2 and all(r.abs().max() > 0 for r in rows)
    torch.testing.assert_close(seen[0], want, rtol=0, atol=0)


def test_bag_pooling_sum_and_mean_by_hand():
    """Each sparse feature's query token is projected from its table's rows summed (pooling sum) or averaged (mean)
    over the example's ids."""
    m = _model(tiny_dict())
    batch = make_batch(m.cfg, LENGTHS, seed=2, hots=[2, 3])  # several ids per example: sum != mean
    pooling = {f: t.pooling for t in m.cfg.bag_tables for f in t.features}
    assert set(pooling.values()) == {"sum", "mean"}
    seen = {f: _capture_input(proj) for f, proj in zip(m.cfg.query_features, m.query_proj)}
    with torch.no_grad():
        m(batch)
    for t in m.cfg.bag_tables:
        for f in t.features:
            jt = batch.sparse[f]
            w = m.ebc.embedding_bags[t.name].weight.detach()
            seg = torch.repeat_interleave(torch.arange(len(LENGTHS)), jt.lengths())
            want = torch.zeros(len(LENGTHS), w.shape[1]).index_add_(0, seg, w[jt.values()])
            if pooling[f] == "mean":
                want = want / jt.lengths().clamp(min=1).unsqueeze(1)
            torch.testing.assert_close(seen[f][0], want, rtol=1e-6, atol=1e-7, msg=f)


def test_gqa_equals_attention_with_repeated_kv_heads():
    """num_kv_heads=1 of 2 heads is the 2-head model whose two k/v heads hold the same weights."""
    gqa = _model(tiny_dict(num_heads=2, num_kv_heads=1, head_dim=16, moe_every=0))
    mha = _model(tiny_dict(num_heads=2, num_kv_heads=2, head_dim=16, moe_every=0))
    state = gqa.state_dict()
    dh = 16
    for i, blk in enumerate(gqa.blocks):
        w = state[f"blocks.{i}.attn.qkv.weight"]  # rows: q (2 heads), k (1 head), v (1 head)
        q, k, v = w.split([2 * dh, dh, dh])
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, k, v, v])
    mha.load_state_dict(state)
    batch = make_batch(gqa.cfg, LENGTHS, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(mha(batch).logits, gqa(batch).logits, rtol=1e-5, atol=1e-6)


# (section, key, value): each changes the function of a model with the same parameters
OPTIONS = [
    ("tower", "rope", False),
    ("tower", "rope_base", 10.0),
    ("tower", "norm", "layernorm"),
    ("tower", "attention", ("swa", {"window": 1})),
    ("tower", "attention", ("block", {"block_size": 2})),
    ("interaction", "activation", "gelu_tanh"),
    ("interaction", "activation", "silu"),
    ("interaction", "activation", "relu"),
    ("interaction", "activation", "relu2"),
    ("interaction", "activation", "leaky_relu"),
    ("interaction", "activation", "identity"),
    ("interaction", "approx", "poly6"),
    ("interaction", "normalize", "max_len_k"),
    ("interaction", "normalize", 32.0),
    ("moe", "top_k", 1),
    ("moe", "capacity_factor", 0.5),
]


def _with(d: dict, section: str, key: str, value) -> dict:
    d = copy.deepcopy(d)
    if isinstance(value, tuple):
        value, extra = value
        d[section].update(extra)
    d[section][key] = value
    return d


@pytest.mark.parametrize("section,key,value", OPTIONS, ids=[f"{s}.{k}={v if not isinstance(v, tuple) else v[0]}"
                                                            for s, k, v in OPTIONS])
def test_option_changes_the_output(section, key, value):
    """The same parameters under the option give another output (well above fp32 noise): the option reaches the
    computation. Tower options are read at the tower's output (the logits barely depend on the history at init),
    interaction options at the logits."""
    d = tiny_dict()
    d["interaction"]["normalize"] = 4.0
    if key == "activation":  # against an activation far from it (gelu and gelu_tanh differ by < 1e-3)
        d["interaction"]["activation"] = "gelu" if value == "relu" else "relu"
    base = _model(d)
    other = _model(_with(d, section, key, value))
    other.load_state_dict(base.state_dict(), strict=key != "norm")  # layernorm adds (zero) biases
    batch = make_batch(base.cfg, LENGTHS, seed=4)
    with torch.no_grad():
        if section == "interaction":
            y0, y1 = base(batch).logits, other(batch).logits
        else:
            y0, y1 = _tower_out(base, batch), _tower_out(other, batch)
    rel = float((y1 - y0).abs().max() / y0.abs().max())
    # the same computation gives the same bits on CPU; 1e-5 of the scale is far above fp32 rounding and below the
    # smallest change listed (poly6 against exact gelu: ~1e-4)
    assert rel > 1e-5, f"{section}.{key}={value}: output moved by {rel:.2e} of its scale"


def test_moe_aux_loss_scales_with_its_coefficient():
    d = tiny_dict()
    base = _model(d)
    d2 = copy.deepcopy(d)
    d2["moe"]["aux_loss_coef"] = 0.03
    other = _model(d2)
    other.load_state_dict(base.state_dict())
    batch = make_batch(base.cfg, LENGTHS, seed=5)
    with torch.no_grad():
        a0, a1 = base(batch).aux_loss, other(batch).aux_loss
    assert a0 > 0
    torch.testing.assert_close(a1, 3 * a0, rtol=1e-5, atol=0)


def _bf16_tol(ref: torch.Tensor, depth: int) -> float:
    """Error bound of a bf16 forward against fp32: each of `depth` rounded stages adds an error of at most eps / 2
    of the scale; independent roundings add in quadrature (sqrt(depth)), and a factor 2 covers each stage's
    accumulation over its inputs. (Measured: about a third of the bound.)"""
    return 2 * depth ** 0.5 * (BF16_EPS / 2) * float(ref.abs().max())


# stages with a bf16 rounding on the path to the logits: input projection, 2 blocks x (qkv, attention, out, ffn),
# final norm, interaction (q, kv, gdpa, out), over arch, head MLP
_DEPTH = 1 + 2 * 4 + 1 + 4 + 2 + 2


def _dense_to_bf16(model: GEMModel) -> None:
    emb = {id(p) for p in model.ec.parameters()} | {id(p) for p in model.ebc.parameters()}
    for p in model.parameters():
        if id(p) not in emb:
            p.data = p.data.to(torch.bfloat16)


@pytest.mark.parametrize("path", ["bf16_weights", "autocast_bf16"])
def test_bf16_paths_match_fp32(path):
    """FSDP mixed precision (dense weights bf16, tables fp32) and bf16 autocast (what train.autocast=bf16 runs)
    against the fp32 model: the tower output and the logits within the bf16 rounding bound of their scale. The
    tower's output and the logits are compared separately: the logits alone barely depend on the history."""
    d = tiny_dict()
    d["interaction"]["normalize"] = 4.0
    ref = _model(d)
    low = _model(d)
    batch = make_batch(ref.cfg, LENGTHS, seed=6)
    with torch.no_grad():
        tower_ref = _tower_out(ref, batch)
        logits_ref = ref(batch).logits
        if path == "bf16_weights":
            _dense_to_bf16(low)
            tower = _tower_out(low, batch)
            logits = low(batch).logits
            assert logits.dtype == torch.bfloat16
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                tower = _tower_out(low, batch)
                logits = low(batch).logits
    tower_depth = 1 + 2 * 4 + 1
    err_t = float((tower.float() - tower_ref).abs().max())
    err_l = float((logits.float() - logits_ref).abs().max())
    assert err_t <= _bf16_tol(tower_ref, tower_depth), (err_t, _bf16_tol(tower_ref, tower_depth))
    assert err_l <= _bf16_tol(logits_ref, _DEPTH), (err_l, _bf16_tol(logits_ref, _DEPTH))
    # the bound is far below the outputs' own size: a zeroed or dropped stage cannot hide in it
    assert _bf16_tol(tower_ref, tower_depth) < 0.2 * float(tower_ref.abs().max())

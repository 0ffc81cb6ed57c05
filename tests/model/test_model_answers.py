"""Model layers against answers computed independently in plain PyTorch (no gem op or module in the reference)."""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

import gem.model.precision as prec
from gem.model import GEMModel
from gem.model.attention import JaggedSelfAttention, SwiGLU, TransformerBlock
from gem.model.moe import MoE
from gem.model.precision import DEFAULT_FILTER, linear_targets
from gem.ops.rotary import RopeConfig
from gem.parallel import expert
from tests.model._batches import tiny_cfg


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, base):
    """x [L, H, D] of one sequence, position i = its row; NeoX halves, theta_j = base ** (-2j / D)."""
    n, _, dim = x.shape
    theta = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * theta[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _reference_block(blk: TransformerBlock, x: torch.Tensor, lengths: list[int], base: float) -> torch.Tensor:
    """x + attn(norm(x)), then + ffn(norm(.)), one sequence at a time, causal softmax scaled by 1/sqrt(head_dim)."""
    a = blk.attn
    h, hk, d = a.num_heads, a.num_kv_heads, a.head_dim
    outs, start = [], 0
    for n in lengths:
        xs = x[start:start + n]
        start += n
        qkv = _rms(xs, blk.attn_norm.weight) @ a.qkv.weight.T
        q = qkv[:, :h * d].reshape(n, h, d)
        k = qkv[:, h * d:(h + hk) * d].reshape(n, hk, d)
        v = qkv[:, (h + hk) * d:].reshape(n, hk, d)
        q, k = _rope(q, base), _rope(k, base)
        k, v = k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)
        s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(d)
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", s.softmax(-1), v).reshape(n, h * d)
        x1 = xs + o @ a.out.weight.T
        f = blk.ffn
        u = _rms(x1, blk.ffn_norm.weight)
        outs.append(x1 + (F.silu(u @ f.w1.weight.T) * (u @ f.w3.weight.T)) @ f.w2.weight.T)
    return torch.cat(outs)


def test_block_is_pre_norm_attention_then_swiglu_with_their_residuals():
    """GQA (4 query heads on 2 kv heads), head_dim 6 set apart from d_model / num_heads, RoPE from each sequence's
    first token: the block equals the formula written out per sequence."""
    torch.manual_seed(0)
    base, lengths = 50.0, [3, 5, 1]
    attn = JaggedSelfAttention(16, 4, 2, 6, kind="jfa", rope=RopeConfig(base=base), kernel="reference")
    blk = TransformerBlock(16, attn, SwiGLU(16, 24))  # fp32: the rope op takes no fp64
    with torch.no_grad():  # norm weights away from 1, so a norm in the wrong place shows
        blk.attn_norm.weight.uniform_(0.5, 2.0)
        blk.ffn_norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(sum(lengths), 16) * 3
    offsets = torch.tensor([0, 3, 8, 9])
    with torch.no_grad():
        got, aux = blk(x, offsets, max(lengths))
        want = _reference_block(blk.double(), x.double(), lengths, base)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert float(aux) == 0.0


def test_moe_block_is_pre_norm_with_the_residual_outside_the_experts():
    """An MoE block: x1 = x + attn(norm(x)); out = x1 + moe(norm(x1)), the MoE written out per token."""
    torch.manual_seed(1)
    attn = JaggedSelfAttention(8, 2, 2, 4, kind="jfa", rope=None, kernel="reference")
    moe = MoE(8, 12, 4, 2)
    blk = TransformerBlock(8, attn, moe)
    with torch.no_grad():
        blk.attn_norm.weight.uniform_(0.5, 2.0)
        blk.ffn_norm.weight.uniform_(0.5, 2.0)
    n = 5
    x = torch.randn(n, 8) * 2
    with torch.no_grad():
        got, _ = blk(x, torch.tensor([0, n]), n)
        blk.double()
        x = x.double()
        qkv = _rms(x, blk.attn_norm.weight) @ attn.qkv.weight.T
        q, k, v = (t.reshape(n, 2, 4) for t in qkv.split(8, dim=-1))
        s = torch.einsum("ihd,jhd->hij", q, k) / 2.0
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        x1 = x + torch.einsum("hij,jhd->ihd", s.softmax(-1), v).reshape(n, 8) @ attn.out.weight.T
        u = _rms(x1, blk.ffn_norm.weight)
        p = torch.softmax(u @ moe.router.weight.T, -1)
        g, e = torch.topk(p, 2)
        g = g / g.sum(-1, keepdim=True)
        want = x1.clone()
        for i in range(n):
            for gj, ej in zip(g[i], e[i].tolist()):
                want[i] += gj * ((F.silu(u[i] @ moe.w1[ej]) * (u[i] @ moe.w3[ej])) @ moe.w2[ej])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_precision_patterns_match_whole_names_never_a_router():
    """'blocks.*.ffn' names the MoE layer (its experts), not the router Linear inside it; the default filter
    names exactly the dense blocks' projections."""
    model = GEMModel(tiny_cfg())
    routers = [n for n, m in model.named_modules() if n.endswith(".router")]
    assert routers  # the tiny model has an MoE block
    matched, _, _ = linear_targets(model, "fp8", ("blocks.*.ffn",))
    assert matched == []
    matched, _, _ = linear_targets(model, "fp8", (*DEFAULT_FILTER, "blocks.*.ffn"))
    blocks = sorted({n.split(".")[1] for n, _ in model.named_modules() if n.startswith("blocks.")}, key=int)
    moe = {b for b in blocks if isinstance(model.get_submodule(f"blocks.{b}.ffn"), MoE)}
    want = [f"blocks.{b}.attn.{p}" for b in blocks for p in ("qkv", "out")]
    want += [f"blocks.{b}.ffn.{w}" for b in blocks if b not in moe for w in ("w1", "w2", "w3")]
    assert sorted(matched) == sorted(want)


def test_fp8_conversion_leaves_routers_as_plain_linears(monkeypatch):
    """A router whose dims would suit fp8 (16 experts on d_model 32) stays nn.Linear when the filter names its MoE
    layer."""
    monkeypatch.setattr(prec, "check_precision_device", lambda *a: None)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].ffn = MoE(32, 32, 16, 2)
    converted = prec.apply_precision(model, "fp8", "cpu", ("blocks.*.ffn",))
    assert converted == ["blocks.0.ffn"]
    assert type(model.blocks[0].ffn.router) is nn.Linear


def test_interaction_is_normed_queries_over_the_histories_with_a_residual():
    """tokens + out(sum_j act(q . k_j / sqrt(dh)) v_j / 32) per example, q from the RMS-normed tokens, k and v from
    that example's history only (the tiny config divides GDPA's sum by 32)."""
    torch.manual_seed(2)
    cfg = tiny_cfg()
    it = GEMModel(cfg).interaction
    assert it.activation == "gelu" and it.normalize == 32.0
    with torch.no_grad():
        it.q_norm.weight.uniform_(0.5, 2.0)
    d, n, lengths = cfg.d_model, 3, [4, 0, 2]
    tokens = torch.randn(len(lengths), n, d) * 2
    seq = torch.randn(sum(lengths), d)
    with torch.no_grad():
        got = it(tokens, seq, torch.tensor([0, 4, 4, 6]), max(lengths))
    h, hk, dh = it.num_heads, it.num_kv_heads, it.head_dim
    wq, wkv, wo = (m.weight.double() for m in (it.q_proj, it.kv_proj, it.out))
    want, start = [], 0
    for b, ln in enumerate(lengths):
        tb, sb = tokens[b].double(), seq[start:start + ln].double()
        start += ln
        q = (_rms(tb, it.q_norm.weight.double()) @ wq.T).reshape(n, h, dh)
        kv = (sb @ wkv.T).reshape(ln, 2, hk, dh)
        k, v = (t.repeat_interleave(h // hk, dim=1) for t in kv.unbind(1))
        a = F.gelu(torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(dh))
        o = torch.einsum("hij,jhd->ihd", a, v).reshape(n, h * dh) / 32.0
        want.append(tb + o @ wo.T)
    torch.testing.assert_close(got.double(), torch.stack(want), rtol=1e-4, atol=1e-5)


class _Exchange:
    """All-to-all among `world` threads standing in for ranks: each posts its chunks (one per destination) and
    takes the chunks addressed to it, sources in rank order."""

    def __init__(self, world: int):
        self.world, self.posted, self.barrier = world, {}, threading.Barrier(world, timeout=20)
        self.local = threading.local()

    def swap(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        r = self.local.rank
        self.barrier.wait()
        self.posted[r] = chunks
        self.barrier.wait()
        got = [self.posted[src][r] for src in range(self.world)]
        self.barrier.wait()
        return got

    def counts(self, out, inp, group=None):
        out.copy_(torch.stack(self.swap(list(inp.unbind(0)))))

    def rows(self, x, out_splits, in_splits, group):
        return torch.cat(self.swap(list(x.split(in_splits))))


def test_expert_parallel_tokens_come_back_to_their_source_rows(monkeypatch):
    """Two ranks (threads) of 2 experts each out of 4, exchanging rows through a stand-in all-to-all: every rank's
    output equals the MoE written out per token over all 4 experts, so each row returned to the token it left."""
    ex = _Exchange(2)
    monkeypatch.setattr(expert.dist, "all_to_all_single", ex.counts)
    monkeypatch.setattr(expert, "all_to_all_single_autograd", ex.rows)
    torch.manual_seed(3)
    moe = MoE(8, 12, 4, 2).double()
    xs = [torch.randn(n, 8, dtype=torch.float64) for n in (9, 6)]
    outs, errors = {}, []

    def rank(r):
        try:
            ex.local.rank = r
            m = MoE(8, 12, 4, 2).double()
            m.load_state_dict(moe.state_dict())
            d = expert.AllToAllDispatcher.__new__(expert.AllToAllDispatcher)
            d.group, d.ep, d.ep_rank = None, 2, r
            m.dispatcher = d
            with torch.no_grad():
                outs[r] = m(xs[r])[0]
        except (RuntimeError, ValueError, IndexError, threading.BrokenBarrierError) as e:  # a thread's would vanish
            errors.append(e)
            ex.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r, x in enumerate(xs):
        p = torch.softmax(x @ moe.router.weight.T, -1)
        g, e = torch.topk(p, 2)
        g = g / g.sum(-1, keepdim=True)
        want = torch.zeros_like(x)
        for i in range(x.shape[0]):
            for gj, ej in zip(g[i], e[i].tolist()):
                want[i] += gj * ((F.silu(x[i] @ moe.w1[ej]) * (x[i] @ moe.w3[ej])) @ moe.w2[ej])
        torch.testing.assert_close(outs[r], want)

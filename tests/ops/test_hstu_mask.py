"""HSTU masks (num_targets, contextual_len, max_attn_len) on jagged_attention and gdpa: the reference mask against a
per-(i, j) oracle and a hand-derived case, the Triton kernels (interpreted on CPU) against the reference, forward
and backward, the kernels' tile runs against the mask, and the argument checks."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from gem.ops import gdpa, jagged_attention
from gem.ops._common import triton_interpreting
from gem.ops.hstu_mask import HstuMask, hstu_visible_mask
from gem.ops.triton_utils import hstu_key_tiles, hstu_query_tiles, hstu_tile_count, hstu_tile_start


def _oracle(n: int, t: int, c: int, m: int) -> list[list[bool]]:
    """Key j visible to query i, one pair at a time, following generative-recommenders' steps: position ids move
    back by c - 1 (clamped at 0) when there are contextual tokens, then are capped at the first target's id; a
    query sees its own position and keys of a smaller id within m (m = 0: any); a contextual query (id 0) also
    sees every key whose id is below the first target's."""
    cap = n - t - (c - 1 if c > 0 else 0)

    def pid(p):
        x = p
        if c > 0:
            x = max(p - c + 1, 0)
        return min(x, cap)

    vis = []
    for i in range(n):
        row = []
        for j in range(n):
            d = pid(i) - pid(j)
            ok = i == j or (d > 0 and (m == 0 or d <= m))
            if c > 0 and pid(i) == 0 and pid(j) < cap:
                ok = True
            row.append(ok)
        vis.append(row)
    return vis


def _mask(lengths, targets, c, m, max_len=None):
    lengths = torch.tensor(lengths)
    max_len = int(lengths.max()) if max_len is None else max_len
    return hstu_visible_mask(lengths, max_len, HstuMask(torch.tensor(targets), c, m))


def test_hand_derived_case():
    """7 tokens, 3 contextual, 2 targets, max_attn_len 2: ids 0 0 0 1 2 3 3."""
    want = [
        [1, 1, 1, 1, 1, 0, 0],  # contextual rows: every non-target token
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],  # id 1: the contextual block (distance 1) and itself
        [1, 1, 1, 1, 1, 0, 0],  # id 2: the contextual block at distance 2, id 1, itself
        [0, 0, 0, 1, 1, 1, 0],  # targets (id 3): ids 1 and 2, themselves, not each other, not the block (3 > 2)
        [0, 0, 0, 1, 1, 0, 1],
    ]
    want = torch.tensor(want, dtype=torch.bool)
    assert torch.equal(torch.tensor(_oracle(7, 2, 3, 2)), want)
    assert torch.equal(_mask([7], [2], 3, 2)[0], want)


def test_targets_only_see_history_and_themselves():
    vis = _mask([6], [3], 0, 0)[0]
    want = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    want[4, 3] = want[5, 3] = want[5, 4] = False
    assert torch.equal(vis, want)


@pytest.mark.parametrize("c", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("m", [0, 1, 2, 4])
def test_reference_mask_matches_oracle(c, m):
    """Every (length, targets) pair up to 9 tokens, including contextual blocks longer than the sequence and
    targets that reach into the contextual block."""
    lengths, targets = zip(*[(n, t) for n in range(10) for t in range(n + 1)])
    got = _mask(list(lengths), list(targets), c, m, max_len=10)
    for b, (n, t) in enumerate(zip(lengths, targets)):
        want = torch.zeros(10, 10, dtype=torch.bool)
        if n:
            want[:n, :n] = torch.tensor(_oracle(n, t, c, m))
        assert torch.equal(got[b], want), (n, t)


# ------------------------------------------------------------------------------------------- the kernels' tile runs


@triton.jit
def _runs_kernel(OUT_K, OUT_Q, n, ft, ctx, max_attn, qoff, BLOCK: tl.constexpr, MAX_T: tl.constexpr):
    """Per tile p: the first key of each of the key tiles its query rows visit, and the first row of each of the
    query tiles its keys visit (-1 past the count). Query row r sits at key position r + qoff."""
    p = tl.program_id(0)
    hstu = (n, ft, ctx, max_attn, qoff)
    offs = tl.arange(0, MAX_T)
    k_runs = hstu_key_tiles(p * BLOCK, hstu, BLOCK, BLOCK)
    ks = hstu_tile_start(offs, k_runs, BLOCK)
    tl.store(OUT_K + p * MAX_T + offs, tl.where(offs < hstu_tile_count(k_runs), ks, -1))
    q_runs = hstu_query_tiles(p * BLOCK, hstu, BLOCK, BLOCK)
    qs = hstu_tile_start(offs, q_runs, BLOCK)
    tl.store(OUT_Q + p * MAX_T + offs, tl.where(offs < hstu_tile_count(q_runs), qs, -1))


def _cached_oracle(n, t, c, m, lq):
    """[lq, n]: query row r is position r + n - lq of the full mask (no key at a negative position)."""
    full = torch.tensor(_oracle(n, t, c, m), dtype=torch.bool).reshape(n, n)
    rows = torch.zeros(lq, n, dtype=torch.bool)
    for r in range(lq):
        if 0 <= r + n - lq < n:
            rows[r] = full[r + n - lq]
    return rows


@pytest.mark.skipif(not triton_interpreting(), reason="runs the helpers under TRITON_INTERPRET=1")
@pytest.mark.parametrize("n,t,c,m,lq", [(37, 0, 0, 0, 37), (37, 9, 0, 0, 37), (37, 20, 0, 3, 37), (37, 5, 3, 4, 37),
                                        (37, 5, 9, 6, 37), (37, 37, 0, 0, 37), (40, 12, 1, 8, 40), (33, 2, 17, 2, 33),
                                        (16, 4, 3, 0, 16), (37, 30, 2, 5, 37),
                                        # the cached form: the last lq tokens, lq > n included
                                        (37, 5, 3, 4, 6), (37, 9, 0, 0, 1), (37, 20, 2, 3, 13), (33, 2, 17, 2, 21),
                                        (9, 3, 2, 0, 14), (37, 0, 0, 6, 30), (40, 12, 1, 8, 5), (5, 2, 0, 0, 9)])
def test_tile_runs_cover_the_mask_and_skip_masked_tiles(n, t, c, m, lq):
    """The tiles each kernel loop visits (4-wide) hold every visible pair, each exactly once, and none of them is
    fully masked."""
    block, max_t = 4, 16
    tiles = -(-max(n, lq) // block)
    out_k = torch.full((tiles, max_t), -2, dtype=torch.int32)
    out_q = torch.full((tiles, max_t), -2, dtype=torch.int32)
    _runs_kernel[(tiles,)](out_k, out_q, n, n - t, c, m, n - lq, BLOCK=block, MAX_T=max_t)
    vis = _cached_oracle(n, t, c, m, lq)  # [lq, n]
    for p in range(tiles):
        rows = slice(p * block, (p + 1) * block)
        sides = (("key", out_k[p], vis[rows, :], n, lq), ("query", out_q[p], vis[:, rows].t(), lq, n))
        for name, starts, tile_vis, size, own in sides:
            if p * block >= own:
                continue  # the kernels launch no tile past the sequence's end
            starts = [s for s in starts.tolist() if s >= 0]
            assert len(set(starts)) == len(starts), f"{name} tiles of tile {p} repeat: {starts}"
            covered = torch.zeros(size, dtype=torch.bool)
            for s in starts:
                assert s % block == 0 and s < size, (name, p, starts)
                # (the contextual rows' run starts at row 0: rows before position 0, where lq > n, see nothing)
                if not (name == "query" and s < lq - n):
                    assert tile_vis[:, s:s + block].any(), f"tile {p} visits the fully masked {name} tile at {s}"
                covered[s:s + block] = True
            assert not (tile_vis & ~covered[None, :]).any(), f"tile {p} misses visible {name}s: {starts}"


# ------------------------------------------------------------------------------------------- the ops

CASES = [  # (lengths, num_targets, contextual_len, max_attn_len)
    ([0, 1, 7, 19, 33], [0, 1, 3, 19, 5], 0, None),
    ([33, 1, 0, 20], [2, 0, 0, 20], 1, 1),
    ([5, 26, 33, 2], [5, 4, 0, 1], 3, 4),
    ([33, 18, 1], [0, 7, 1], 3, None),
    ([9, 33, 17], [1, 10, 0], 0, 5),
]
CASE_IDS = [f"c{c}-m{m}" for _, _, c, m in CASES]


def _offsets(lengths):
    return torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))


def _inputs(lengths, *, h=2, h_kv=1, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(n, hh, d, generator=g).to(dtype).requires_grad_() for n, hh in ((t, h), (t, h_kv), (t, h_kv))]


def _dense_oracle(op, q, k, v, lengths, targets, c, m, scale):
    """out of the op written per sequence with the oracle's mask: softmax (jagged_attention) or silu / max_len."""
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n, t in zip(lengths, targets):
        sl = slice(start, start + n)
        start += n
        if n == 0:
            continue
        vis = torch.tensor(_oracle(n, t, c, m or 0))
        s = torch.einsum("ihd,jhd->hij", q[sl].double(), k[sl].double().repeat_interleave(rep, 1)) * scale
        if op == "jfa":
            p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
        else:
            p = torch.nn.functional.silu(s) * vis / max(lengths)
        outs.append(torch.einsum("hij,jhd->ihd", p, v[sl].double().repeat_interleave(rep, 1)))
    return torch.cat(outs)


def _call(op, q, k, v, lengths, targets, c, m, kernel, **kw):
    off = _offsets(lengths)
    hstu = {"causal": True, "num_targets": torch.tensor(targets), "contextual_len": c, "max_attn_len": m}
    if op == "jfa":
        return jagged_attention(q, k, v, off, max(lengths), kernel=kernel, **hstu, **kw)
    return gdpa(q, k, v, off, max(lengths), off, max(lengths), activation="silu", normalize="max_len_k",
                kernel=kernel, **hstu, **kw)


def _compare(op, case, dtype=torch.float32, tol=2e-5, h=2, h_kv=1, d=16, seed=0, **kw):
    lengths, targets, c, m = case
    q, k, v = _inputs(lengths, h=h, h_kv=h_kv, d=d, dtype=dtype, seed=seed)
    out = _call(op, q, k, v, lengths, targets, c, m, "triton", **kw)
    ref = _call(op, q, k, v, lengths, targets, c, m, "reference")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    got = (out, *torch.autograd.grad(out, (q, k, v), g))
    want = (ref, *torch.autograd.grad(ref, (q, k, v), g))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * max(1.0, b.float().abs().max().item()), f"{name}: max error {err:.3e}"
    return out


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_op_matches_oracle(op, case):
    lengths, targets, c, m = case
    q, k, v = _inputs(lengths, h=2, h_kv=1, d=8)
    out = _call(op, q, k, v, lengths, targets, c, m, "reference")
    want = _dense_oracle(op, q, k, v, lengths, targets, c, m, 8 ** -0.5)
    assert torch.allclose(out.double(), want, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("form", ["fused_delta", "delta_pre"])
def test_jagged_attention_triton_matches_reference(case, form, monkeypatch):
    from gem.ops import triton_jfa

    # "delta_pre": the long-row backward form (the dispatch takes it from _BWD_DELTA_PRE_MIN_LEN rows)
    monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", 0 if form == "delta_pre" else 1 << 30)
    _compare("jfa", case, mask_mode="sub" if form == "delta_pre" else "inf")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("short_kv", [False, True])
def test_gdpa_triton_matches_reference(case, short_kv):
    """short_kv: the whole-K/V-tile forward and one-pass backward; else the tiled forward and two-pass backward."""
    _compare("gdpa", case, short_kv=short_kv)


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_bf16_and_grouped_heads(op):
    _compare(op, CASES[2], dtype=torch.bfloat16, tol=3e-2, h=4, h_kv=2, d=32, seed=3)


def test_max_attn_len_zero_is_unbounded():
    """generative-recommenders spells "no limit" 0; None is the same here."""
    case = ([12, 5], [3, 0], 2, None)
    a = _compare("gdpa", case)
    b = _compare("gdpa", (*case[:3], 0))
    assert torch.equal(a, b)


def test_without_hstu_arguments_nothing_changes():
    """The HSTU kernels with no targets, no context and no limit give plain causal attention."""
    lengths = [9, 20]
    q, k, v = _inputs(lengths)
    off = _offsets(lengths)
    hstu = jagged_attention(q, k, v, off, 20, causal=True, num_targets=torch.zeros(2, dtype=torch.int64),
                            kernel="triton")
    plain = jagged_attention(q, k, v, off, 20, causal=True, kernel="triton")
    assert torch.allclose(hstu, plain, atol=1e-6)


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_bad_arguments_raise_one_clear_error(op):
    lengths = [3, 4]
    q, k, v = _inputs(lengths)
    off = _offsets(lengths)
    nt = torch.tensor([1, 1])

    def call(**kw):
        args = {"causal": True, "kernel": "reference"}
        args.update(kw)
        if op == "jfa":
            return jagged_attention(q, k, v, off, 4, **args)
        return gdpa(q, k, v, off, 4, off, 4, **args)

    with pytest.raises(ValueError, match="causal=True"):
        call(num_targets=nt, causal=False)
    with pytest.raises(ValueError, match="window"):
        call(contextual_len=1, window=(2, 0))
    with pytest.raises(ValueError, match=r"num_targets\[1\] must lie in \[0, length 4\]"):
        call(num_targets=torch.tensor([1, 5]))
    with pytest.raises(ValueError, match="num_targets must be an int32/int64 tensor"):
        call(num_targets=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="num_targets must be an int32/int64 tensor"):
        call(num_targets=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="contextual_len must be an int >= 0"):
        call(contextual_len=-1)
    with pytest.raises(ValueError, match="max_attn_len must be None or an int >= 0"):
        call(max_attn_len=-2)
    # the cached form: num_targets counts the key sequences' tokens
    k2, v2, off_k = k[:6], v[:6], _offsets([2, 4])
    with pytest.raises(ValueError, match=r"num_targets\[0\] must lie in \[0, length 2\]"):
        if op == "jfa":
            jagged_attention(q, k2, v2, off, 4, off_k, 4, causal=True, num_targets=torch.tensor([3, 1]))
        else:
            gdpa(q, k2, v2, off, 4, off_k, 4, causal=True, num_targets=torch.tensor([3, 1]))


# ------------------------------------------------------------------------------------------- the cached form
# generative-recommenders' cached ("delta") HSTU attention: the queries are the last Lq tokens of each key
# sequence, and each sees its position's row of the full self-attention mask. The reference below is the full
# self-attention call (checked against the oracle above) on a query sequence whose last rows are the given ones.


def test_cached_reference_mask_is_the_full_masks_last_rows():
    lk, lq, targets = [0, 1, 7, 9, 12, 5], [2, 1, 3, 9, 0, 8], [0, 1, 2, 9, 4, 3]
    for c, m in ((0, 0), (2, 3), (4, 1)):
        got = hstu_visible_mask(torch.tensor(lk), 12, HstuMask(torch.tensor(targets), c, m), torch.tensor(lq), 9)
        for b, (n, nq, t) in enumerate(zip(lk, lq, targets)):
            want = torch.zeros(9, 12, dtype=torch.bool)
            if n:
                want[:nq, :n] = _cached_oracle(n, t, c, m, nq)
            assert torch.equal(got[b], want), (b, c, m)


def _cached_shapes(seed):
    """Key lengths with an empty and a length-1 sequence, odd sizes; per sequence a query count from 0 to past the
    key length (those rows see no key)."""
    g = torch.Generator().manual_seed(seed)
    lk = [0, 1] + torch.randint(2, 30, (4,), generator=g).tolist()
    lq = [2, 1] + [int(torch.randint(0, n + 4, (1,), generator=g)) for n in lk[2:]]
    lq[2] = lk[2]  # the whole sequence
    lq[3] = lk[3] + 3  # more queries than keys
    targets = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in lk]
    return lk, lq, targets


def _cached_call(op, q, k, v, lq, lk, targets, c, m, kernel, **kw):
    hstu = {"causal": True, "num_targets": torch.tensor(targets), "contextual_len": c, "max_attn_len": m}
    off_q, off_k = _offsets(lq), _offsets(lk)
    if op == "jfa":
        return jagged_attention(q, k, v, off_q, max(lq), off_k, max(lk), kernel=kernel, **hstu, **kw)
    return gdpa(q, k, v, off_q, max(lq), off_k, max(lk), activation="silu", normalize="max_len_k", kernel=kernel,
                **hstu, **kw)


def _from_full_rows(op, q, k, v, lq, lk, targets, c, m):
    """The cached output built from full self attention: query row r of sequence b is position r + Lk - Lq of a
    full-length query sequence (other positions: random rows), rows at negative positions give 0."""
    rows, full = [], []
    for b, (nq, n) in enumerate(zip(lq, lk)):
        for r in range(nq):
            if r + n - nq >= 0:
                rows.append(sum(lq[:b]) + r)
                full.append(sum(lk[:b]) + r + n - nq)
    rows, full = torch.tensor(rows, dtype=torch.long), torch.tensor(full, dtype=torch.long)
    filler = torch.randn((k.shape[0], q.shape[1], q.shape[2]), generator=torch.Generator().manual_seed(7))
    q_full = filler.to(q.dtype).index_put((full,), q[rows])
    out_full = _cached_call(op, q_full, k, v, lk, lk, targets, c, m, "reference")
    return out_full.new_zeros((q.shape[0],) + out_full.shape[1:]).index_put((rows,), out_full[full])


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_equal_key_offsets_in_another_tensor_are_self_attention(op):
    """Self attention whether offsets_k is offsets_q itself, an equal copy, or absent: the alignment is per sequence,
    so nothing is compared on the host (no sync) or asserted on the device."""
    lengths, targets, c, m = CASES[2]
    q, k, v = _inputs(lengths)
    off = _offsets(lengths)
    hstu = {"causal": True, "num_targets": torch.tensor(targets), "contextual_len": c, "max_attn_len": m}
    n = max(lengths)
    for kernel in ("reference", "triton"):
        if op == "jfa":
            outs = [jagged_attention(q, k, v, off, n, o, n, kernel=kernel, **hstu) for o in (off, off.clone())]
            outs.append(jagged_attention(q, k, v, off, n, kernel=kernel, **hstu))
        else:
            outs = [gdpa(q, k, v, off, n, o, n, activation="silu", kernel=kernel, **hstu) for o in (off, off.clone())]
        for o in outs[1:]:
            assert torch.equal(o, outs[0])


CACHED = [(0, None), (3, 4), (1, 1), (2, None)]


@pytest.mark.parametrize("op,form", [("jfa", "reference"), ("jfa", "fused_delta"), ("jfa", "delta_pre"),
                                     ("gdpa", "reference"),
                                     ("gdpa", "tiled"), ("gdpa", "short")])
@pytest.mark.parametrize("ci", range(len(CACHED)))
def test_cached_form_matches_full_mask_last_rows(op, form, ci, monkeypatch):
    """Forward and backward of the cached form (reference and every Triton form) against full self attention's
    last rows."""
    from gem.ops import triton_jfa

    c, m = CACHED[ci]
    lk, lq, targets = _cached_shapes(ci)
    g = torch.Generator().manual_seed(ci + 10)
    q = torch.randn(sum(lq), 2, 16, generator=g).requires_grad_()
    k, v = (torch.randn(sum(lk), 1, 16, generator=g).requires_grad_() for _ in range(2))
    kw = {}
    if op == "jfa" and form != "reference":
        monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", 0 if form == "delta_pre" else 1 << 30)
        kw["mask_mode"] = "sub" if form == "delta_pre" else "inf"
    if op == "gdpa" and form != "reference":
        kw["short_kv"] = form == "short"
    out = _cached_call(op, q, k, v, lq, lk, targets, c, m, "reference" if form == "reference" else "triton", **kw)
    want = _from_full_rows(op, q, k, v, lq, lk, targets, c, m)
    dout = torch.randn(out.shape, generator=g)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref = (want, *torch.autograd.grad(want, (q, k, v), dout))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        err = (a - b).abs().max().item()
        assert err <= 2e-5 * max(1.0, b.abs().max().item()), f"{name}: max error {err:.3e}"
    dead = [sum(lq[:b]) + r for b in range(len(lq)) for r in range(max(lq[b] - lk[b], 0))]
    assert dead and not out[dead].any() and not got[1][dead].any()  # rows before the sequence see nothing


# ------------------------------------------------------------------------------------------- GPU (H200)

gpu = pytest.mark.gpu


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: run the GPU tests with TRITON_INTERPRET=0")


def _gpu_case(seed, c, m):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 1500, (6,), generator=g).tolist() + [0, 1, 2048, 300]
    targets = [int(torch.randint(0, n + 1, (1,), generator=g)) if n else 0 for n in lengths]
    targets[-1] = 300  # every token a target
    return lengths, targets, c, m


@gpu
@pytest.mark.parametrize("op", ["jfa", "gdpa", "jfa-delta-pre"])
@pytest.mark.parametrize("c,m", [(0, None), (1, 64), (5, 200), (37, None)])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_matches_reference(op, c, m, d, monkeypatch):
    """jfa-delta-pre: JFA's long-row backward form (dispatched from _BWD_DELTA_PRE_MIN_LEN rows)."""
    _need_gpu()
    from gem.ops import triton_jfa

    monkeypatch.setenv("GEM_AUTOTUNE", "0")
    if op == "jfa-delta-pre":
        monkeypatch.setattr(triton_jfa, "_BWD_DELTA_PRE_MIN_LEN", 0)
    lengths, targets, c, m = _gpu_case(d + c, c, m)
    q, k, v = (x.detach().cuda().requires_grad_() for x in _inputs(lengths, h=4, h_kv=2, d=d, dtype=torch.bfloat16))
    off = _offsets(lengths).cuda()
    hstu = {"causal": True, "num_targets": torch.tensor(targets).cuda(), "contextual_len": c, "max_attn_len": m}
    if op.startswith("jfa"):
        def run(x, y, z, kernel):
            return jagged_attention(x, y, z, off, 2048, kernel=kernel, **hstu)
    else:
        def run(x, y, z, kernel):
            return gdpa(x, y, z, off, 2048, off, 2048, activation="silu", normalize="max_len_k", kernel=kernel,
                        **hstu)
    out = run(q, k, v, "triton")
    g = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), g))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = run(q32, k32, v32, "reference")
    want = (ref, *torch.autograd.grad(ref, (q32, k32, v32), g.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a.float() - b).abs().max().item()
        assert err <= 3e-2 * max(1.0, b.abs().max().item()), f"{name}: max error {err:.3e}"


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_torch_compile_fullgraph_and_opcheck(op):
    from gem.ops.triton_gdpa import gdpa_op
    from gem.ops.triton_jfa import jfa_op

    lengths, targets, c, m = [6, 0, 13], [2, 0, 13], 2, 3
    q, k, v = _inputs(lengths)

    def f(q, k, v):
        return _call(op, q, k, v, lengths, targets, c, m, "triton").square().sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    want = f(q, k, v)
    for a, b in zip((loss, *grads), (want, *torch.autograd.grad(want, (q, k, v)))):
        torch.testing.assert_close(a, b)
    off, nt = _offsets(lengths), torch.tensor(targets)
    if op == "jfa":
        fn, args = jfa_op.fwd_op, (q, k, v, off, off, 13, 13, 0.25, -1, -1, False, nt, c, m)
    else:
        fn, args = gdpa_op.fwd_op, (q, k, v, off, off, 13, 13, "silu", "", -1, 0, 0.25, 1.0, True, -1, nt, c, m)
    torch.library.opcheck(fn, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_num_targets_checked_once_per_batch_and_again_after_a_write():
    """The targets check runs once per (num_targets, offsets) pair and version: a later call with the same tensors
    skips it, an in-place write to either brings it back, and a failed check is never remembered."""
    from gem.ops import hstu_mask

    lengths = [3, 4]
    q, k, v = _inputs(lengths)
    off = _offsets(lengths)
    nt = torch.tensor([1, 5])
    for _ in range(2):  # a bad tensor fails every time
        with pytest.raises(ValueError, match=r"num_targets\[1\]"):
            jagged_attention(q, k, v, off, 4, causal=True, num_targets=nt, kernel="reference")
    nt[1] = 2  # now valid: checked (the write moved its version) and remembered
    jagged_attention(q, k, v, off, 4, causal=True, num_targets=nt, kernel="reference")
    assert hstu_mask._checked_before(nt, off)
    nt[1] = 9  # invalid again: the write makes the next call check
    assert not hstu_mask._checked_before(nt, off)
    with pytest.raises(ValueError, match=r"num_targets\[1\]"):
        jagged_attention(q, k, v, off, 4, causal=True, num_targets=nt, kernel="reference")

"""BlockAttention: Triton kernel (under the interpreter on CPU) against the padded fp32 PyTorch reference."""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.ops._tune import tile_config
from gem.ops.block import block_attention, block_attention_reference
from gem.ops.jfa import jagged_attention
from gem.ops.rotary import RopeConfig, rope
from tests.ops.conftest import jagged_inputs
from tests.ops.conftest import offsets as _offsets

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (6e-2, 4e-2), torch.float16: (5e-3, 5e-3)}


def _inputs(lengths, h, hkv, d, dtype, seed=0, device="cpu"):
    q, k, v, do, offsets, _ = jagged_inputs(lengths, h, d, dtype, seed=seed, device=device, kv_heads=hkv)
    return q, k, v, do, offsets


def _run(fn, q, k, v, do):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _check(lengths, *, h=2, hkv=2, d=32, dtype=torch.float32, block_size=16, causal=True, rope_cfg=None,
           scale=None, seed=0, device="cpu", tol=None):
    q, k, v, do, offsets = _inputs(lengths, h, hkv, d, dtype, seed, device)
    max_len = max(lengths, default=0)
    kw = {"block_size": block_size, "causal": causal, "rope": rope_cfg, "scale": scale}
    got = _run(lambda a, b, c: block_attention(a, b, c, offsets, max_len, kernel="triton", **kw), q, k, v, do)
    # The reference runs in fp32 on fp32 copies of the same (rounded) inputs.
    ref = _run(lambda a, b, c: block_attention_reference(a, b, c, offsets, max_len, **kw),
               q.float(), k.float(), v.float(), do.float())
    atol, rtol = tol or TOL[dtype]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
    return got


@pytest.mark.parametrize(
    "block_size,causal,rope_cfg",
    [
        (16, True, None),  # block == tile, lengths not multiples of the block
        (32, True, RopeConfig()),  # block > tile: off-diagonal tiles without mask
        (20, True, RopeConfig(rotary_dim=16)),  # tile straddles blocks, partial rotary
        (5, True, RopeConfig(interleaved=True)),  # block < tile: mask by block id
        (7, False, None),
        (32, False, RopeConfig(rotary_dim=8, base=500.0)),
        (40, False, RopeConfig()),  # block >= every length: full attention
    ],
)
def test_matches_reference(block_size, causal, rope_cfg):
    _check([37, 1, 0, 26], block_size=block_size, causal=causal, rope_cfg=rope_cfg)


def test_gqa_and_odd_head_dim():
    # D = 48 is not a power of two; rotary half 10 is neither; 4 q heads share 2 kv heads.
    _check([29, 40], h=4, hkv=2, d=48, block_size=16, rope_cfg=RopeConfig(rotary_dim=20))
    _check([23, 9], h=3, hkv=1, d=64, block_size=8, causal=False, rope_cfg=RopeConfig(interleaved=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    _check([45, 3], h=2, hkv=1, dtype=dtype, block_size=16, rope_cfg=RopeConfig())


def test_large_scores_stay_finite():
    # Scores far from 0 (scale 4 with unit inputs) exercise the running max.
    _check([33], block_size=16, scale=4.0, rope_cfg=RopeConfig(), tol=(1e-4, 1e-4))


@pytest.mark.parametrize("lengths", [[0], [1], [0, 1, 0], [1, 1, 2]])
def test_empty_and_single_token_sequences(lengths):
    got = _check(lengths, block_size=4, rope_cfg=RopeConfig())
    if lengths == [1]:
        # One token attends to itself only: the output is its value row.
        _, _, v, _, _ = _inputs(lengths, 2, 2, 32, torch.float32)
        torch.testing.assert_close(got[0], v)


def test_no_sequences():
    q = torch.zeros(0, 2, 32)
    offsets = torch.zeros(1, dtype=torch.int32)
    out = block_attention(q, q, q, offsets, 0, block_size=8, kernel="triton")
    assert out.shape == (0, 2, 32)


@settings(max_examples=4, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 33), min_size=1, max_size=3),
    block_size=st.integers(1, 48),
    causal=st.booleans(),
    rotary=st.sampled_from([None, 8, 32]),
    hkv=st.sampled_from([1, 2]),
)
def test_hypothesis_shapes(lengths, block_size, causal, rotary, hkv):
    cfg = None if rotary is None else RopeConfig(rotary_dim=rotary)
    _check(lengths, h=2, hkv=hkv, block_size=block_size, causal=causal, rope_cfg=cfg)


def _sdpa_per_sequence(q, k, v, lengths, causal):
    outs, s = [], 0
    for n in lengths:
        a, b, c = (x[s:s + n].transpose(0, 1) for x in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal).transpose(0, 1))
        s += n
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [True, False])
def test_one_block_is_full_attention(causal):
    lengths = [19, 0, 33]
    q, k, v, _, offsets = _inputs(lengths, 2, 2, 32, torch.float32, seed=3)
    got = block_attention(q, k, v, offsets, 33, block_size=33, causal=causal, kernel="triton")
    torch.testing.assert_close(got, _sdpa_per_sequence(q, k, v, lengths, causal), atol=2e-5, rtol=2e-5)
    jfa = jagged_attention(q, k, v, offsets, 33, causal=causal, kernel="reference")
    torch.testing.assert_close(got, jfa, atol=2e-5, rtol=2e-5)


def test_blocks_are_independent():
    # Block attention over blocks of 8 == full attention over each 8-token chunk treated as its own sequence,
    # with RoPE positions restarting per chunk only when the chunk starts its sequence: check without rope.
    lengths = [20, 11]
    q, k, v, _, offsets = _inputs(lengths, 2, 2, 32, torch.float32, seed=4)
    got = block_attention(q, k, v, offsets, 20, block_size=8, kernel="triton")
    chunks = [8, 8, 4, 8, 3]
    torch.testing.assert_close(got, _sdpa_per_sequence(q, k, v, chunks, True), atol=2e-5, rtol=2e-5)


def test_fused_rope_equals_rope_then_attention():
    lengths = [30, 12]
    cfg = RopeConfig(rotary_dim=16)
    q, k, v, _, offsets = _inputs(lengths, 2, 1, 32, torch.float32, seed=5)
    fused = block_attention(q, k, v, offsets, 30, block_size=16, rope=cfg, kernel="triton")
    qr = rope(q, offsets, 30, config=cfg, kernel="triton")
    kr = rope(k, offsets, 30, config=cfg, kernel="triton")
    unfused = block_attention(qr, kr, v, offsets, 30, block_size=16, kernel="triton")
    torch.testing.assert_close(fused, unfused, atol=2e-5, rtol=2e-5)


def test_torch_compile_forward_backward():
    q, k, v, do, offsets = _inputs([21, 6], 2, 2, 32, torch.float32, seed=6)
    cfg = RopeConfig()

    def f(a, b, c):
        return block_attention(a, b, c, offsets, 21, block_size=8, rope=cfg, kernel="triton") * 2.0

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = _run(compiled, q, k, v, do)
    ref = _run(lambda a, b, c: 2.0 * block_attention_reference(a, b, c, offsets, 21, block_size=8, rope=cfg),
               q, k, v, do)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_custom_op_registration():
    from gem.ops.triton_block import block_attention_op

    q, k, v, _, offsets = _inputs([6, 3], 2, 1, 32, torch.float32, seed=7)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(block_attention_op.fwd_op, (q, k, v, offsets, 6, 4, True, 0.2, 10000.0, 16, False))


def test_reference_path_default_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _, offsets = _inputs([9], 2, 2, 32, torch.float32)
    a = block_attention(q, k, v, offsets, 9, block_size=4)
    b = block_attention_reference(q, k, v, offsets, 9, block_size=4)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -3}, "block_size"),
        ({"block_size": 4, "rope": RopeConfig(rotary_dim=7)}, "rotary_dim"),
        ({"block_size": 4, "rope": RopeConfig(rotary_dim=64)}, "rotary_dim"),
        ({"block_size": 4, "rope": RopeConfig(base=1.0)}, "base"),
        ({"block_size": 4, "scale": -1.0}, "scale"),
        ({"block_size": 4, "kernel": "cuda"}, "kernel"),
    ],
)
def test_bad_arguments(kwargs, match):
    q, k, v, _, offsets = _inputs([5], 2, 2, 32, torch.float32)
    with pytest.raises(ValueError, match=match):
        block_attention(q, k, v, offsets, 5, **kwargs)


def test_bad_shapes():
    q, k, v, _, offsets = _inputs([5], 3, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        block_attention(q, k, v, offsets, 5, block_size=4)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        block_attention(q[0], k, v, offsets, 5, block_size=4)
    with pytest.raises(ValueError, match="dtype"):
        block_attention(q.double(), q.double(), q.double(), offsets, 5, block_size=4)
    with pytest.raises(ValueError, match="k and v"):
        block_attention(q, q[:4], q[:4], offsets, 5, block_size=4)


# --------------------------------------------------------------------------------------------------------------
# GPU (run on the H200): long sequences, real tile sizes and autotuned configs.

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [64, 100, 512])
@pytest.mark.parametrize("rope_cfg", [None, RopeConfig(), RopeConfig(rotary_dim=64, interleaved=True)])
def test_gpu_bf16_long(block_size, rope_cfg):
    lengths = [1500, 1, 0, 777, 2048]
    _check(lengths, h=4, hkv=2, d=128, dtype=torch.bfloat16, block_size=block_size, rope_cfg=rope_cfg,
           device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_gpu_fp32_head_dims(d):
    _check([300, 5, 129], h=2, hkv=1, d=d, dtype=torch.float32, block_size=128, causal=False,
           rope_cfg=RopeConfig(rotary_dim=d // 2), device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [128, 512])
def test_gpu_every_config(block_size, monkeypatch):
    """Every candidate of the three kernels compiles and matches (the tuner would silently drop one that fails):
    the i-th config of each list together, with and without RoPE."""
    import gem.ops.triton_block as tb

    lists = {kind: tb.configs(kind, block_size) for kind in ("fwd", "dkdv", "dq")}
    for i in range(max(len(c) for c in lists.values())):
        picked = {kind: [c[i % len(c)]] for kind, c in lists.items()}
        monkeypatch.setattr(tb, "configs", lambda kind, bs, p=picked: p[kind])
        tb._TUNER.best.clear()
        for rope_cfg in (None, RopeConfig()):
            _check([1500, 1, 0, 777], h=4, hkv=2, d=128, dtype=torch.bfloat16, block_size=block_size,
                   rope_cfg=rope_cfg, device="cuda")
    tb._TUNER.best.clear()


@pytest.mark.parametrize("lengths,tile", [([5, 0, 35, 1], 16), ([], 16), ([0, 0], 8), ([100, 17], 32)])
def test_work_table_lists_every_tile_once(lengths, tile):
    from gem.ops.triton_utils import work_table

    offsets = _offsets(lengths)
    work = work_table("seq_len", offsets, offsets, 0, tile, total=sum(lengths), cached=False).tolist()
    expected = [[b, j] for b, n in enumerate(lengths) for j in range(-(-n // tile))]
    assert work[: len(expected)] == expected
    assert all(row == [-1, -1] for row in work[len(expected):])


# --------------------------------------------------------------------------------------------------------------
# Host-side tuner: tile sizes and warps/stages picked per key (on the GPU by timing; here with a fake clock).


@pytest.mark.parametrize("winner", [0, 1])
def test_tuner_picks_and_caches_per_key(monkeypatch, winner):
    import gem.ops.triton_block as tb

    # Two interpreter-sized configs with unequal tiles (BLOCK_M > BLOCK_N and the reverse); both are launched
    # while timing, the winner produces the checked result.
    cands = [tile_config(32, 16, 4, 1), tile_config(16, 32, 4, 1)]
    monkeypatch.setattr(tb, "configs", lambda kind, block_size: list(cands))
    monkeypatch.setattr(tb._TUNER, "best", {})
    calls = []

    def fake_bench(fn):
        fn()
        calls.append(len(calls))
        return 1.0 if (len(calls) - 1) % 2 == winner else 2.0  # candidates are timed in list order

    monkeypatch.setattr(tb._TUNER, "bench", fake_bench)
    _check([37, 1, 0, 26], h=4, hkv=2, block_size=20, rope_cfg=RopeConfig(rotary_dim=16))
    assert len(calls) == 6  # fwd, dkdv, dq: two candidates each
    assert sorted(key[0] for key in tb._TUNER.best) == ["dkdv", "dq", "fwd"]
    assert all(cfg == cands[winner] for cfg in tb._TUNER.best.values())
    _check([30, 5], h=4, hkv=2, block_size=20, rope_cfg=RopeConfig(rotary_dim=16), seed=1)
    assert len(calls) == 6  # same key (D, dtype, block, causal, rope, GROUP, ...): cached, no new timing
    _check([30, 5], h=4, hkv=2, block_size=7, causal=False, seed=2)
    assert len(calls) == 12 and len(tb._TUNER.best) == 6  # new key: tuned again


def test_tuner_off_keeps_first_config(monkeypatch):
    import gem.ops.triton_block as tb

    monkeypatch.setenv("GEM_AUTOTUNE", "0")
    monkeypatch.setattr(tb, "configs", lambda kind, block_size: [tile_config(32, 16, 4, 1), tile_config(16, 32, 4, 1)])
    monkeypatch.setattr(tb._TUNER, "best", {})
    monkeypatch.setattr(tb._TUNER, "bench", lambda fn: pytest.fail("timed with GEM_AUTOTUNE=0"))
    _check([25, 9], block_size=16, rope_cfg=RopeConfig())
    assert set(tb._TUNER.best.values()) == {tile_config(32, 16, 4, 1)}


@pytest.mark.parametrize("block_size", [1, 5, 32, 100, 128, 512, 4096])
def test_gpu_config_lists(monkeypatch, block_size):
    import gem.ops.triton_block as tb

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the lists the GPU would get (nothing is launched)
    cap = max(16, 1 << (block_size - 1).bit_length())
    for kind, tiles in (("fwd", tb.FWD_TILES), ("dkdv", tb.DKDV_TILES), ("dq", tb.DQ_TILES)):
        cfgs = tb.configs(kind, block_size)
        assert len(cfgs) == len(set(cfgs))
        assert (cfgs[0].block_m, cfgs[0].block_n) == tb._default_tiles(block_size, kind != "fwd")
        assert all(16 <= c.block_m <= cap and 16 <= c.block_n <= cap for c in cfgs), (kind, cfgs)
        # a register cap leaves room for two 8-warp programs per SM
        assert all(c.maxnreg is None or c.num_warps * 32 * c.maxnreg <= 32768 for c in cfgs), (kind, cfgs)
        if block_size >= 128:  # nothing clamped: every tile, at most three forms of one tile (warps/stages/cap)
            assert {(c.block_m, c.block_n) for c in cfgs} == set(tiles) and len(cfgs) <= len(tiles) + 2
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tb.configs("fwd", 512) == [tile_config(16, 16, 4, 1)]


def test_work_tables_built_once_per_batch(monkeypatch):
    # layers share a JaggedBatch: the forward's and backward's tables are built once and reused by later calls;
    # an in-place write to the offsets rebuilds them (and the result stays right)
    from gem.ops import JaggedBatch, triton_utils

    built = []
    real = triton_utils._seq_len_table
    monkeypatch.setattr(triton_utils, "_seq_len_table", lambda *a: built.append(a[1]) or real(*a))
    lengths = [40, 1, 0, 23]
    q, k, v, _, off = _inputs(lengths, 2, 2, 32, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    batch = JaggedBatch(off, 40)
    counts = []
    for _ in range(3):
        block_attention(q, k, v, batch, block_size=16, kernel="triton").sum().backward()
        counts.append(len(built))
    n = counts[0]
    # the first call builds one table per distinct tile height (never one twice); later calls build none
    assert n >= 1 and len(set(built)) == n and counts == [n, n, n]
    new = [23, 40, 0, 1]
    off.copy_(_offsets(new))
    out = block_attention(q, k, v, batch, 40, block_size=16, kernel="triton")
    assert len(built) > n
    ref = block_attention_reference(q, k, v, off, 40, block_size=16)
    assert torch.allclose(out, ref, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------------------------------------------
# RoPE: the streamed operand from a rotated copy (a rope-kernel pass), the stationary one rotated on load in the
# forward and read from the rotated copies in the backward.


@pytest.mark.parametrize(
    "lengths,h,hkv,block_size,causal,rope_cfg,dtype",
    [
        ([29, 0, 1, 14], 2, 2, 8, True, RopeConfig(interleaved=True), torch.float32),
        ([23, 1, 0, 9], 4, 2, 12, False, RopeConfig(rotary_dim=16), torch.float32),  # GQA, pass-through channels
        ([17, 1, 0, 20], 4, 2, 20, True, RopeConfig(rotary_dim=8, interleaved=True, base=500.0), torch.float32),
        ([21, 1, 6], 4, 2, 4, True, RopeConfig(rotary_dim=16), torch.bfloat16),
    ],
)
def test_rope_rotated_copies_match_reference(monkeypatch, lengths, h, hkv, block_size, causal, rope_cfg, dtype):
    from gem.ops import triton_block

    passes = []
    real = triton_block._rope_triton
    monkeypatch.setattr(triton_block, "_rope_triton", lambda x, *a: passes.append(x.shape[1]) or real(x, *a))
    _check(lengths, h=h, hkv=hkv, block_size=block_size, causal=causal, rope_cfg=rope_cfg, dtype=dtype)
    assert passes == [hkv, h]  # K_rot for the forward (kept for the dQ pass), then Q_rot for the backward


def test_saved_k_rot_reused_by_the_backward(monkeypatch):
    """The eager forward keeps K_rot; the backward streams it instead of rotating k again, with the same results."""
    from gem.ops import triton_block

    q, k, v, do, offsets = _inputs([23, 1, 9], 4, 2, 32, torch.float32, seed=4)
    kw = {"block_size": 8, "rope": RopeConfig(rotary_dim=16)}
    ref = _run(lambda a, b, c: block_attention_reference(a, b, c, offsets, 23, **kw), q, k, v, do)
    passes = []
    real = triton_block._rope_triton
    monkeypatch.setattr(triton_block, "_rope_triton", lambda x, *a: passes.append(x.shape[1]) or real(x, *a))
    a, b, c = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = block_attention(a, b, c, offsets, 23, kernel="triton", **kw)
    out.backward(do)
    assert passes == [2, 4]  # k once (forward), q once (backward)
    for name, x, y in zip(("out", "dq", "dk", "dv"), (out, a.grad, b.grad, c.grad), ref):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_calls_do_not_keep_offsets_alive():
    # nothing global holds a batch's tables: a cached value that referenced its offsets would leak every batch's
    import gc
    import weakref

    q, k, v, do, off = _inputs([19, 1, 0, 12], 4, 2, 32, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    block_attention(q, k, v, off, 19, block_size=8, rope=RopeConfig(), kernel="triton").backward(do)
    alive = weakref.ref(off)
    del off
    gc.collect()
    assert alive() is None


def test_rotated_copies_reuse_the_batch_positions(monkeypatch):
    # the K_rot / Q_rot passes take positions from the batch, as the rope op does: built once for all layers
    from gem.ops import JaggedBatch, rotary

    built = []
    real = rotary.positions_of
    monkeypatch.setattr(rotary, "positions_of", lambda off, t: built.append(t) or real(off, t))
    q, k, v, _, off = _inputs([19, 1, 0, 12], 4, 2, 32, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    batch = JaggedBatch(off, 19)
    for _ in range(2):
        block_attention(q, k, v, batch, 19, block_size=8, rope=RopeConfig(), kernel="triton").sum().backward()
    rope(k.detach(), batch, config=RopeConfig(), kernel="triton")  # the standalone op shares the positions
    assert built == [32]


def test_rope_reads_table_rows_of_one_block_only(monkeypatch):
    # The kernels rotate by the position within the block (the same scores as by the position within the
    # sequence): a sequence ~10 blocks long must ask for no cos/sin rows past block_size and still match the
    # reference, which rotates by the position within the sequence.
    from gem.ops import rotary, triton_block

    lengths, cfg = [157, 1, 0, 40], RopeConfig(rotary_dim=24)
    _check(lengths, h=2, hkv=1, block_size=16, causal=True, rope_cfg=cfg)
    q, k, v, do, off = _inputs(lengths, 2, 1, 32, torch.float32)
    want = _run(lambda a, b, c: block_attention(a, b, c, off, 157, block_size=16, rope=cfg, kernel="triton"),
                q, k, v, do)
    asked = []
    real = rotary.cos_sin_table

    def spy(n, *a):  # exactly n good rows, then NaN: a read past them turns the outputs NaN
        asked.append(n)
        return tuple(torch.cat((t[:n], torch.full((256, t.shape[1]), float("nan")))) for t in real(n, *a))

    monkeypatch.setattr(rotary, "cos_sin_table", spy)
    monkeypatch.setattr(triton_block, "cos_sin_table", spy)
    got = _run(lambda a, b, c: block_attention(a, b, c, off, 157, block_size=16, rope=cfg, kernel="triton"),
               q, k, v, do)
    assert asked and max(asked) <= 16
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")


# the dK/dV pass runs a ragged key tile through its unmasked q-tile loop: inf/NaN in the key rows past the
# sequence end, which it never stores
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2", "ignore:invalid value encountered in matmul")
def test_scores_far_below_zero():
    # Every score near -100 (lse ~ -150 in the log2 domain): a key row past the block's end that is only
    # zero-loaded, not masked, gets exp2(-lse) = inf, and NaN once dS @ K mixes it into dQ. Not causal, so a
    # ragged key tile meets complete query tiles.
    lengths = [37, 26]
    q, k, v, do, offsets = _inputs(lengths, 2, 2, 32, torch.float32, seed=9)
    u = torch.nn.functional.normalize(torch.randn(32, generator=torch.Generator().manual_seed(1)), dim=0)
    q, k = 0.1 * q - 24.0 * u, 0.1 * k + 24.0 * u
    kw = {"block_size": 48, "causal": False}
    got = _run(lambda a, b, c: block_attention(a, b, c, offsets, 37, kernel="triton", **kw), q, k, v, do)
    ref = _run(lambda a, b, c: block_attention_reference(a, b, c, offsets, 37, **kw), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------------------------------------
# Programs: a flat grid with the heads of one work item adjacent (they share its K/V and RoPE rows in L2).


@pytest.mark.parametrize(
    "lengths,h,hkv,block_size,rope_cfg,dtype",
    [
        ([29, 0, 1, 14], 2, 2, 8, RopeConfig(), torch.float32),
        ([23, 1, 0, 9], 4, 2, 12, RopeConfig(rotary_dim=16, interleaved=True), torch.float32),  # GQA: dK/dV over 2
        ([21, 1, 6], 3, 1, 4, None, torch.bfloat16),  # odd head count, no rope
    ],
)
def test_flat_grids_match_reference(monkeypatch, lengths, h, hkv, block_size, rope_cfg, dtype):
    import gem.ops.triton_block as tb

    launches = []

    class Spy:  # records each launch's grid
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(grid) or self.kernel[grid](*a, **kw)

    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        monkeypatch.setattr(tb, name, Spy(getattr(tb, name)))
    _check(lengths, h=h, hkv=hkv, block_size=block_size, rope_cfg=rope_cfg, dtype=dtype)
    # flat grids of W * heads programs
    assert len(launches) >= 3 and all(len(g) == 1 and any(g[0] % n == 0 for n in {h, hkv}) for g in launches)


def test_register_cap_reaches_block_launches(monkeypatch):
    """A config's register cap becomes the maxnreg launch option of the kernel it was picked for (GPU only: here the
    interpreter check is patched off and the interpreter ignores the option)."""
    import gem.ops._tune as tune
    import gem.ops.triton_block as tb

    cfgs = {"fwd": [tile_config(16, 16, 4, 1, 128)], "dkdv": [tile_config(16, 16, 4, 1)],
            "dq": [tile_config(16, 16, 4, 1, 96)]}
    monkeypatch.setattr(tb, "configs", lambda kind, block_size: cfgs[kind])
    monkeypatch.setattr(tb._TUNER, "best", {})
    monkeypatch.setattr(tune, "triton_interpreting", lambda: False)
    caps = {}

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*a, **kw):
                caps.setdefault(self.name, kw.get("maxnreg"))
                return self.kernel[grid](*a, **kw)

            return launch

    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        monkeypatch.setattr(tb, name, Spy(name, getattr(tb, name)))
    _check([9, 4, 0], block_size=8, rope_cfg=RopeConfig())
    assert caps == {"_fwd_kernel": 128, "_bwd_dkdv_kernel": None, "_bwd_dq_kernel": 96}

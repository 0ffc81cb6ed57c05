"""The candidate forms (model.candidates): a request's candidates scored against one encoding of its history.

interaction computes the row form's function per candidate (logits and gradients equal to k rows, each with its own
copy of the history); targets gives each candidate what it gets alone (candidates do not see each other), and that
is the tower run on its history followed by its one target token under the plain causal mask.
"""

import copy

import pytest
import torch
from torchrec import KeyedJaggedTensor

from gem.data import Batch
from gem.model import GEMModel
from gem.model import flops as F
from gem.model.gem import pooled_features, run_tower
from gem.parallel.fsdp import apply_compile
from tests.model._batches import make_batch, tiny_cfg

# (history lengths, candidates per request): k = 1, 2, 17, empty histories among them
CASES = {
    "k1": ([5, 0, 3], [1, 1, 1]),
    "k2": ([4, 0], [2, 2]),
    "k17": ([6, 0, 2], [17, 1, 2]),
    "empty": ([0, 0], [3, 1]),
}


def _cfg(form: str, kernel: str = "reference", **tower):
    cfg = tiny_cfg(kernel, **tower)
    cfg.candidates = form
    cfg.validate()
    return cfg


def request_batch(cfg, lengths, counts, seed=0) -> Batch:
    """R requests (these history lengths) with counts[r] candidates each; candidate rows carry their own sparse,
    dense features and labels."""
    cands = make_batch(cfg, [0] * sum(counts), seed=seed)
    hist = make_batch(cfg, lengths, seed=seed + 1)
    co = torch.zeros(len(counts) + 1, dtype=torch.int64)
    co[1:] = torch.cumsum(torch.tensor(counts), 0)
    return Batch(sequence=hist.sequence, sparse=cands.sparse, dense=cands.dense, labels=cands.labels,
                 seq_offsets=hist.seq_offsets, max_seq_len=hist.max_seq_len, cand_offsets=co,
                 max_candidates=max(counts), request_ids=torch.arange(len(counts)) + 1000)


def one_history_per_candidate(batch: Batch, *, as_requests: bool) -> Batch:
    """Every candidate with its own copy of its request's history: row data (as_requests False) or requests of
    one candidate each."""
    counts = batch.num_candidates.tolist()
    req = [r for r, k in enumerate(counts) for _ in range(k)]
    keys = batch.sequence.keys()
    lens = batch.sequence.lengths().view(len(keys), -1)
    offs = batch.sequence.offsets().view(-1)
    n = lens.shape[1]
    vals, new_lens = [], []
    for ki in range(len(keys)):
        for r in req:
            lo, hi = int(offs[ki * n + r]), int(offs[ki * n + r + 1])
            vals.append(batch.sequence.values()[lo:hi])
        new_lens.append(lens[ki, req])
    seq = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(vals), lengths=torch.cat(new_lens))
    hl = lens[0, req]
    so = torch.zeros(len(req) + 1, dtype=torch.int64)
    so[1:] = torch.cumsum(hl, 0)
    c = len(req)
    return Batch(sequence=seq, sparse=batch.sparse, dense=batch.dense, labels=batch.labels, seq_offsets=so,
                 max_seq_len=int(hl.max()) if c else 0,
                 cand_offsets=torch.arange(c + 1) if as_requests else None, max_candidates=1)


def _logits_and_grads(model, batch, seed=7):
    out = model(batch)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.logits.shape, generator=g)
    (out.logits * w).sum().backward()  # the MoE aux loss depends on the batch's tokens, not on a candidate
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.logits.detach(), grads


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
    assert a[1].keys() == b[1].keys()
    for name, g in a[1].items():
        torch.testing.assert_close(g, b[1][name], rtol=1e-4, atol=1e-5, msg=name)


def _models(cfg_a, cfg_b):
    torch.manual_seed(0)
    a = GEMModel(cfg_a)
    b = GEMModel(cfg_b)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("case", list(CASES))
def test_interaction_form_equals_k_rows(case):
    """Each candidate of a request gets the logits and gradients of one row with its own copy of the history."""
    lengths, counts = CASES[case]
    rows, inter = _models(_cfg("rows"), _cfg("interaction"))
    batch = request_batch(rows.cfg, lengths, counts, seed=3)
    expect = _logits_and_grads(rows, one_history_per_candidate(batch, as_requests=False))
    _assert_same(_logits_and_grads(inter, batch), expect)
    # the row form on the request batch copies the histories itself
    _assert_same(_logits_and_grads(rows, batch), expect)


@pytest.mark.parametrize("case", list(CASES))
def test_targets_form_equals_one_candidate_requests(case):
    lengths, counts = CASES[case]
    cfg = _cfg("targets")
    torch.manual_seed(0)
    m = GEMModel(cfg)
    batch = request_batch(cfg, lengths, counts, seed=4)
    got = _logits_and_grads(m, batch)
    _assert_same(got, _logits_and_grads(m, one_history_per_candidate(batch, as_requests=True)))
    _assert_same(got, _logits_and_grads(m, one_history_per_candidate(batch, as_requests=False)))


@pytest.mark.parametrize("tower", [{"attention": "jfa"}, {"attention": "swa", "window": 2}])
def test_targets_form_is_the_tower_over_history_then_target(tower):
    """Independent of the target mask: a candidate's output is the last row of the tower run on its history
    followed by its own target token under the plain causal mask (RoPE position = history length), so targets
    see the history (within the window) and themselves."""
    cfg = _cfg("targets", **tower)
    torch.manual_seed(1)
    m = GEMModel(cfg).eval()
    batch = request_batch(cfg, [6, 0, 3], [3, 2, 4], seed=5)
    with torch.no_grad():
        got = m(batch).logits
        x = m._history_tokens(m.ec(batch.sequence))
        dense = batch.dense
        tokens = m._query_tokens(pooled_features(m.ebc(batch.sparse), m.sparse_features), dense, x.dtype)
        tgt = m.target_token(tokens.reshape(tokens.shape[0], -1))
        so, counts = batch.seq_offsets.tolist(), batch.num_candidates.tolist()
        outs, c = [], 0
        for r, k in enumerate(counts):
            hist = x[so[r]:so[r + 1]]
            for _ in range(k):
                seq = torch.cat([hist, tgt[c:c + 1]])
                n = seq.shape[0]
                outs.append(run_tower(m.blocks, seq, torch.tensor([0, n]), n)[0][-1])
                c += 1
        cand = m.final_norm(torch.stack(outs))
        expect = m.heads(m.over_arch(torch.cat([cand, m.dense_mlp(dense)], dim=-1)))
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5)
    # and the history matters: another history moves the request's scores
    other = request_batch(cfg, [6, 0, 3], [3, 2, 4], seed=5)
    other.sequence = request_batch(cfg, [6, 0, 3], [3, 2, 4], seed=9).sequence
    with torch.no_grad():
        moved = m(other).logits
    assert not torch.allclose(moved[:3], got[:3])  # request 0 (6 history tokens)
    torch.testing.assert_close(moved[3:5], got[3:5])  # request 1 has no history


@pytest.mark.parametrize("form", ["interaction", "targets"])
def test_compiled_forms_match_eager(form):
    """The regions torch.compile takes in training (aot_eager here; the targets form's RoPE from the targets'
    positions inside them): k = 17 beside an empty history. Shape changes recompile as tests/model/test_compile
    checks for the row form."""
    torch._dynamo.reset()
    cfg = _cfg(form, num_blocks=1, moe_every=0)
    torch.manual_seed(0)
    eager = GEMModel(cfg)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, compiled.blocks, backend="aot_eager")
    batch = request_batch(cfg, *CASES["k17"], seed=1)
    _assert_same(_logits_and_grads(compiled, batch), _logits_and_grads(eager, batch))


@pytest.mark.parametrize("form", ["interaction", "targets"])
def test_triton_kernels_give_the_reference_forms(form):
    """The Triton kernels (interpreted on CPU) under each form: same logits and gradients as the references."""
    lengths, counts = [5, 0, 3], [2, 1, 3]
    ref, tri = _models(_cfg(form, num_blocks=1, moe_every=0), _cfg(form, "triton", num_blocks=1, moe_every=0))
    batch = request_batch(ref.cfg, lengths, counts, seed=6)
    _assert_same(_logits_and_grads(tri, batch), _logits_and_grads(ref, batch))


def test_targets_form_needs_a_target_mask():
    d = tiny_cfg()
    d.candidates = "targets"
    d.tower.attention, d.tower.block_size = "block", 4
    with pytest.raises(Exception, match="model.candidates"):
        d.validate()


@pytest.mark.parametrize("form", ["rows", "interaction", "targets"])
def test_flops_count_what_each_form_computes(form):
    """The weight matmuls torch's FlopCounterMode sees on a request batch equal the analytic count of the form;
    the attention pairs follow the form (rows: per candidate copy; interaction: per request; targets: per request
    plus each target's history)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = _cfg(form, num_blocks=2, moe_every=2)
    lengths, counts = [6, 0, 3], [3, 2, 1]
    torch.manual_seed(0)
    m = GEMModel(cfg)
    batch = request_batch(cfg, lengths, counts, seed=2)
    counter = FlopCounterMode(display=False)
    with counter:
        out = m(batch)
        (out.logits.float().sum() + out.aux_loss).backward()
    counted = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    got = sum(n for op, n in counted.items() if op in ("mm", "addmm", "_grouped_mm"))
    L, k = torch.tensor(lengths), torch.tensor(counts)
    cands = int(k.sum())
    hist = {"rows": int((L * k).sum()), "interaction": int(L.sum()), "targets": int(L.sum())}[form]
    weights = 6 * F.tower_weights_per_token(cfg) * hist + 6 * F.weights_per_example(cfg) * cands
    weights -= 6 * F.input_weights_per_token(cfg) * (hist - int(L.sum()))  # projected before the copies
    if form == "targets":
        weights += 6 * F.block_weights_per_token(cfg) * cands
    assert got == pytest.approx(weights, rel=5e-3)
    t, it = cfg.tower, cfg.interaction
    attn = 3 * 4 * t.num_heads * cfg.tower_head_dim * t.num_blocks
    gdpa = 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * int((L * k).sum())
    pairs = {"rows": (36 + 36 + 36 + 9) / 2, "interaction": (36 + 9) / 2,
             "targets": (36 + 9) / 2 + 3 * 6.5 + 2 * 0.5 + 1 * 3.5}[form]
    expect = weights + attn * pairs + (0 if form == "targets" else gdpa)
    assert F.train_flops(cfg, batch.seq_offsets, batch.cand_offsets) == round(expect)
    assert m.flops(batch) == round(expect)

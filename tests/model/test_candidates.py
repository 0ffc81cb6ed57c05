"""The candidate forms (model.candidates): a request's candidates scored against one encoding of its history.

interaction computes the row form's function per candidate (logits and gradients equal to k rows, each with its own
copy of the history and of its request's features); targets gives each candidate what it gets alone (candidates do
not see each other), and that is the tower run on its history followed by its one target token under the plain
causal mask.
"""

import copy

import pytest
import torch
from torchrec import KeyedJaggedTensor

from gem.data import Batch
from gem.data.batch import history_fields, lengths_to_offsets, request_fields
from gem.model import GEMModel
from gem.model import flops as F
from gem.model.gem import run_tower
from gem.parallel.fsdp import apply_compile
from tests.model._batches import data_dict, make_batch, tiny_cfg

# (history lengths, candidates per request): k = 1, 2, 17, empty histories among them
CASES = {
    "k1": ([5, 0, 3], [1, 1, 1]),
    "k2": ([4, 0], [2, 2]),
    "k17": ([6, 0, 2], [17, 1, 2]),
    "empty": ([0, 0], [3, 1]),
}


def two_histories() -> dict:
    """The default declaration plus a second history (searches) on the item table."""
    d = data_dict()
    d["histories"]["searches"] = {"max_len": 16}
    d["features"]["search_item"] = {"kind": "sequence", "table": "item", "history": "searches"}
    return d


def _cfg(form: str, kernel: str = "reference", data: dict | None = None, **tower):
    cfg = tiny_cfg(kernel, data=data, **tower)
    cfg.candidates = form
    cfg.validate()
    return cfg


def _gather(values: torch.Tensor, offsets: torch.Tensor, rows: list[int]) -> torch.Tensor:
    parts = [values[int(offsets[r]):int(offsets[r + 1])] for r in rows]
    return torch.cat(parts) if parts else values[:0]


def _gather_kjt(kjt: KeyedJaggedTensor, rows: list[int], keep: set[str] = frozenset()) -> KeyedJaggedTensor:
    """Per key the jagged rows `rows` (in that order); keys in `keep` as they are."""
    vals, lens = [], []
    for k in kjt.keys():
        jt = kjt[k]
        if k in keep:
            vals.append(jt.values())
            lens.append(torch.ones(jt.values().numel(), dtype=torch.int64))
        else:
            vals.append(_gather(jt.values(), jt.offsets(), rows))
            lens.append(jt.lengths()[rows])
    return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=torch.cat(vals), lengths=torch.cat(lens))


def one_history_per_candidate(batch: Batch, cfg, *, as_requests: bool) -> Batch:
    """Every candidate with its own copy of its request's histories and features: row data (as_requests False) or
    requests of one candidate each."""
    req = torch.repeat_interleave(torch.arange(batch.num_requests), batch.num_candidates).tolist()
    c = len(req)
    lengths = [(o[1:] - o[:-1])[req] for o in batch.history_offsets]
    times = tuple(_gather(t, o, req) for t, o in zip(batch.history_times, batch.history_offsets))
    return Batch(sequence=_gather_kjt(batch.sequence, req, set(cfg.candidate_features)),
                 sparse=_gather_kjt(batch.sparse, req), dense=batch.dense[req], labels=batch.labels,
                 **history_fields(lengths), history_times=times,
                 **request_fields(torch.ones(c, dtype=torch.int64) if as_requests else None))


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


def test_request_batch_layout():
    """Candidate features hold one id per candidate on their request's row of the KJT; the rest is per request."""
    cfg = _cfg("interaction")
    b = make_batch(cfg, [3, 0], candidates=[2, 3])
    assert b.num_requests == 2 and b.batch_size == 5 and b.max_candidates == 3
    assert b.sequence["cand_item"].lengths().tolist() == [2, 3]
    assert b.sparse.stride() == 2 and tuple(b.dense.shape) == (2, cfg.num_dense)
    assert b.candidate_groups().tolist() == [1000, 1000, 1001, 1001, 1001]


@pytest.mark.parametrize("case", list(CASES))
def test_interaction_form_equals_k_rows(case):
    """Each candidate of a request gets the logits and gradients of one row with its own copy of the history."""
    lengths, counts = CASES[case]
    rows, inter = _models(_cfg("rows"), _cfg("interaction"))
    batch = make_batch(rows.cfg, lengths, candidates=counts, seed=3)
    expect = _logits_and_grads(rows, one_history_per_candidate(batch, rows.cfg, as_requests=False))
    _assert_same(_logits_and_grads(inter, batch), expect)
    # the row form on the request batch copies the histories itself
    _assert_same(_logits_and_grads(rows, batch), expect)


def test_interaction_form_equals_k_rows_two_histories():
    """Two histories, a tower each: still the row form's function per candidate."""
    data = two_histories()
    rows, inter = _models(_cfg("rows", data=data), _cfg("interaction", data=data))
    batch = make_batch(rows.cfg, [[4, 0, 2], [0, 3, 5]], candidates=[3, 1, 2], seed=8)
    expect = _logits_and_grads(rows, one_history_per_candidate(batch, rows.cfg, as_requests=False))
    _assert_same(_logits_and_grads(inter, batch), expect)
    _assert_same(_logits_and_grads(rows, batch), expect)


@pytest.mark.parametrize("case", list(CASES))
def test_targets_form_equals_one_candidate_requests(case):
    lengths, counts = CASES[case]
    cfg = _cfg("targets")
    torch.manual_seed(0)
    m = GEMModel(cfg)
    batch = make_batch(cfg, lengths, candidates=counts, seed=4)
    got = _logits_and_grads(m, batch)
    _assert_same(got, _logits_and_grads(m, one_history_per_candidate(batch, cfg, as_requests=True)))
    _assert_same(got, _logits_and_grads(m, one_history_per_candidate(batch, cfg, as_requests=False)))


@pytest.mark.parametrize("tower", [{"attention": "jfa"}, {"attention": "swa", "window": 2}])
def test_targets_form_is_the_tower_over_history_then_target(tower):
    """Independent of the target mask: a candidate's output is the last row of the tower run on its history
    followed by its own target token under the plain causal mask (RoPE position = history length), so targets
    see the history (within the window) and themselves."""
    cfg = _cfg("targets", **tower)
    torch.manual_seed(1)
    m = GEMModel(cfg).eval()
    batch = make_batch(cfg, [6, 0, 3], candidates=[3, 2, 4], seed=5)
    with torch.no_grad():
        got = m(batch).logits
        ec_out = m.ec(batch.sequence)
        x = m._history_tokens(ec_out)[0]
        tokens, dense = m._query_tokens(ec_out, batch, x.dtype)
        tgt = m.target_token(tokens.reshape(tokens.shape[0], -1))
        so, counts = batch.seq_offsets.tolist(), batch.num_candidates.tolist()
        outs, c = [], 0
        for r, k in enumerate(counts):
            hist = x[so[r]:so[r + 1]]
            for _ in range(k):
                seq = torch.cat([hist, tgt[c:c + 1]])
                n = seq.shape[0]
                outs.append(run_tower(m.blocks, seq, torch.tensor([0, n]), n, m.tower_spans[0])[0][-1])
                c += 1
        cand = m.final_norms[m.towers[0]](torch.stack(outs))
        expect = m.heads(m.over_arch(torch.cat([cand, m.dense_mlp(dense)], dim=-1)))
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5)
    # and the history matters: another history moves the request's scores
    other = make_batch(cfg, [6, 0, 3], candidates=[3, 2, 4], seed=5)
    fresh = make_batch(cfg, [6, 0, 3], candidates=[3, 2, 4], seed=9).sequence
    keep = {k: other.sequence[k] for k in cfg.candidate_features}
    vals = [fresh[k].values() if k not in keep else keep[k].values() for k in fresh.keys()]
    lens = [fresh[k].lengths() if k not in keep else keep[k].lengths() for k in fresh.keys()]
    other.sequence = KeyedJaggedTensor.from_lengths_sync(keys=fresh.keys(), values=torch.cat(vals),
                                                         lengths=torch.cat(lens))
    with torch.no_grad():
        moved = m(other).logits
    assert not torch.allclose(moved[:3], got[:3])  # request 0 (6 history tokens)
    torch.testing.assert_close(moved[3:5], got[3:5])  # request 1 has no history


@pytest.mark.parametrize("form", ["interaction", "targets"])
def test_compiled_forms_match_eager(form):
    """The regions torch.compile takes in training (aot_eager here; the targets form's RoPE from the targets'
    positions inside them): k = 17 beside an empty history."""
    torch._dynamo.reset()
    cfg = _cfg(form, num_blocks=1, moe_every=0)
    torch.manual_seed(0)
    eager = GEMModel(cfg)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, compiled.blocks, backend="aot_eager")
    batch = make_batch(cfg, CASES["k17"][0], candidates=CASES["k17"][1], seed=1)
    _assert_same(_logits_and_grads(compiled, batch), _logits_and_grads(eager, batch))


@pytest.mark.parametrize("form", ["interaction", "targets"])
def test_triton_kernels_give_the_reference_forms(form):
    """The Triton kernels (interpreted on CPU) under each form: same logits and gradients as the references."""
    ref, tri = _models(_cfg(form, num_blocks=1, moe_every=0), _cfg(form, "triton", num_blocks=1, moe_every=0))
    batch = make_batch(ref.cfg, [5, 0, 3], candidates=[2, 1, 3], seed=6)
    _assert_same(_logits_and_grads(tri, batch), _logits_and_grads(ref, batch))


def test_targets_form_needs_a_target_mask_and_one_tower():
    with pytest.raises(Exception, match="model.candidates.*block attention"):
        _cfg("targets", attention="block", block_size=4)
    with pytest.raises(Exception, match="model.candidates.*one tower"):
        _cfg("targets", data=two_histories())


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
    batch = make_batch(cfg, lengths, candidates=counts, seed=2)
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
    t, it = cfg.tower_for(), cfg.interaction
    attn = 3 * 4 * t.num_heads * t.head_dim * t.num_blocks
    gdpa = 3 * 4 * it.num_heads * cfg.interaction_head_dim * cfg.num_query_tokens * int((L * k).sum())
    pairs = {"rows": (36 + 36 + 36 + 9) / 2, "interaction": (36 + 9) / 2,
             "targets": (36 + 9) / 2 + 3 * 6.5 + 2 * 0.5 + 1 * 3.5}[form]
    expect = weights + attn * pairs + (0 if form == "targets" else gdpa)
    assert F.train_flops(cfg, batch.history_offsets, batch.cand_offsets) == round(expect)
    assert m.flops(batch) == round(expect)
    # one candidate per request as requests counts what the row form counts
    row = make_batch(cfg, lengths, seed=2)
    assert F.train_flops(cfg, row.history_offsets, lengths_to_offsets(torch.ones(3, dtype=torch.int64))) == \
        F.train_flops(cfg, row.history_offsets)


def test_histories_merged_by_time_under_both_request_forms():
    """history_merge=time (one tower over two time-stamped histories): interaction is the row form's function and
    targets scores each candidate as it would alone, on synthetic requests."""
    from gem.data import Schema, SyntheticDataset

    data = two_histories()
    data["histories"]["events"]["timestamp"] = "ts_events"
    data["histories"]["searches"]["timestamp"] = "ts_searches"
    data["histories"]["events"]["max_len"] = 8
    batch = SyntheticDataset(Schema.from_dict(data), seed=1, batch_size=4, max_candidates=6).batch(0)
    assert batch.max_candidates > 1 and len(batch.history_times) == 2

    def cfg(form):
        c = tiny_cfg(data=data, num_blocks=1)
        c.candidates, c.history_merge = form, "time"
        c.validate()
        return c

    rows, inter = _models(cfg("rows"), cfg("interaction"))
    expect = _logits_and_grads(rows, one_history_per_candidate(batch, rows.cfg, as_requests=False))
    _assert_same(_logits_and_grads(inter, batch), expect)
    torch.manual_seed(0)
    m = GEMModel(cfg("targets"))
    _assert_same(_logits_and_grads(m, batch),
                 _logits_and_grads(m, one_history_per_candidate(batch, m.cfg, as_requests=True)))

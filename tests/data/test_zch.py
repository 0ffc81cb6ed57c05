"""`ids: raw` with `hash: zch`: TorchRec's managed-collision modules, sharded by gem.parallel (one gloo rank), give
distinct raw ids distinct rows where modulo hashing collides, evict when more ids come than rows (rows and their
optimizer state re-initialised), and raw ids reach them unchanged from Parquet."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.modules.mc_modules import LRU_EvictionPolicy, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor

from gem.data import Schema, validate_batch
from gem.data.parquet import ParquetDataset
from gem.model.embeddings import ZchModule, build_embeddings, zch_input_hash, zch_modules
from gem.parallel import parallelize
from tests.model._batches import data_dict, tiny_cfg

INIT = 0.05


def _data(rows: int, policy: str = "distance_lfu", bag_rows: int = 0) -> dict:
    """The default declaration with the item table (history + candidate) as a zch table of `rows` rows and, with
    `bag_rows`, the user_segment table (a pooled sparse feature) too."""
    d = data_dict()
    d["tables"]["item"].update(num_embeddings=rows, ids="raw", hash="zch", zch_eviction_policy=policy)
    if bag_rows:
        d["tables"]["user_segment"].update(num_embeddings=bag_rows, ids="raw", hash="zch")
    return d


class Tables(nn.Module):
    """The model's zch collections alone; loss = sum of <c, looked-up rows> (a gradient on every lookup)."""

    def __init__(self, data: dict) -> None:
        super().__init__()
        e = build_embeddings(tiny_cfg(data=data))
        self.mc_ec, self.mc_ebc = e.mc_ec, e.mc_ebc

    def forward(self, seq: KeyedJaggedTensor, bag: KeyedJaggedTensor | None = None):
        out, _ = self.mc_ec(seq)
        loss = sum((jt.values() * (i + 1)).sum() for i, jt in enumerate(out.values()))
        if bag is not None:
            kt, _ = self.mc_ebc(bag)
            loss = loss + kt.values().sum()
        return out, loss


def _shard(data: dict, device, lr: float = 0.5):
    torch.manual_seed(0)
    p = parallelize(Tables(data), {}, sparse_optimizer_cfg={"name": "rowwise_adagrad", "lr": lr}, device=device)
    return p, zch_modules(p.inner)


def _seq(ids: torch.Tensor, device: torch.device) -> KeyedJaggedTensor:
    """All `ids` as one history (hist_item), no action ids, one candidate id (the first)."""
    n = ids.numel()
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["hist_item", "hist_action", "cand_item"], values=torch.cat([ids, torch.zeros(n, dtype=torch.int64),
                                                                          ids[:1]]),
        lengths=torch.tensor([n, n, 1])).to(device)


def _rows(m: ZchModule, ids: torch.Tensor) -> torch.Tensor:
    """The table row each raw id maps to now (the last row: not in the map)."""
    ids = ids.to(m.device)
    jt = {"t": JaggedTensor(values=ids, lengths=torch.tensor([ids.numel()], device=m.device))}
    return m.remap(m.preprocess(jt))["t"].values().cpu()


def _weights(p, name: str) -> torch.Tensor:
    (w,) = [v for k, v in p.model.state_dict().items() if k.endswith(f"{name}.weight")]
    return w.local_shards()[0].tensor.detach().cpu()


def _random_ids(n: int, seed: int) -> torch.Tensor:
    """n distinct 64-bit ids, negative ones among them, in random order."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-(2**62), 2**62, (n,), generator=g) * 2 + 1
    assert ids.unique().numel() == n
    return ids


def test_distinct_ids_get_distinct_rows_where_modulo_collides(process_group):
    rows = 64
    dev = process_group
    p, (m,) = _shard(_data(rows), dev)
    ids = _random_ids(rows - 1, seed=1)  # as many as the map holds (one row is kept for ids not in it)
    assert ids.numel() == rows - 1
    modulo = torch.remainder(ids, rows)
    assert modulo.unique().numel() < ids.numel()  # what hash: modulo does with the same ids
    out, loss = p.model(_seq(ids, dev))
    got = _rows(m, ids)
    assert got.unique().numel() == ids.numel() and int(got.max()) < rows - 1
    # each id's embedding is its own row, the same in a later batch (the map is stable while it fits)
    w = _weights(p, "item").clone()
    torch.testing.assert_close(out["hist_item"].values().cpu(), w[got], rtol=0, atol=0)
    torch.testing.assert_close(out["cand_item"].values().cpu(), w[got[:1]], rtol=0, atol=0)
    loss.backward()
    p.model(_seq(ids.flip(0), dev))
    assert torch.equal(_rows(m, ids), got)
    assert int(m.open_slots()) == 0
    # one id more than the map holds: one of the 64 (the lowest scored) has the shared row of ids not in the map,
    # the 63 others keep distinct rows
    everyone = torch.cat([ids, torch.tensor([12345])])
    p.model(_seq(everyone[-1:], dev))
    now = _rows(m, everyone)
    assert int((now == rows - 1).sum()) == 1 and now[now != rows - 1].unique().numel() == rows - 1


def test_more_ids_than_rows_evicts_and_resets_the_rows(process_group):
    """lru: the ids of the first step leave for newer ones; their rows get the newcomers, re-initialised (weights
    drawn again from the table's init, row-wise Adagrad state 0) before the newcomers' first lookup."""
    rows, dev = 9, process_group
    p, (m,) = _shard(_data(rows, policy="lru"), dev)
    first, second = torch.arange(8) * 7919 + 11, torch.arange(4) * 104729 - 5
    _, loss = p.model(_seq(first, dev))
    loss.backward()  # every row trained once: weights moved, Adagrad sums > 0
    rows_first = _rows(m, first)
    assert sorted(rows_first.tolist()) == list(range(rows - 1))
    (tbe,) = [k for k in p.embeddings._kernels()]
    trained = _weights(p, "item").clone()
    assert (tbe.split_optimizer_states()[0][0][: rows - 1] > 0).all()
    out, _ = p.model(_seq(second, dev))  # forward only: the eviction happens before the lookup
    rows_second = _rows(m, second)
    assert rows_second.unique().numel() == 4 and int(rows_second.max()) < rows - 1
    now_first = _rows(m, first)
    evicted = now_first == rows - 1
    assert int(evicted.sum()) == 4
    assert sorted(rows_second.tolist()) == sorted(rows_first[evicted].tolist())  # the freed rows, reused
    assert torch.equal(now_first[~evicted], rows_first[~evicted])  # the others keep theirs
    w = _weights(p, "item")
    state = tbe.split_optimizer_states()[0][0].cpu()
    for r in rows_second.tolist():
        assert state[r] == 0
        assert not torch.equal(w[r], trained[r]) and float(w[r].abs().max()) <= INIT
    kept = rows_first[~evicted]
    assert torch.equal(w[kept], trained[kept]) and (state[kept] > 0).all()
    torch.testing.assert_close(out["hist_item"].values().cpu(), w[rows_second], rtol=0, atol=0)


def test_pooled_zch_table(process_group):
    """A sparse feature's zch table (ManagedCollisionEmbeddingBagCollection): distinct raw ids, distinct rows; the
    pooled embedding is the sum of its ids' rows."""
    dev = process_group
    p, mods = _shard(_data(64, bag_rows=16), dev)
    bag_m = next(m for m in mods if m.output_size() == 16)
    ids = torch.tensor([-3, 2**40, 7, 2**40 + 1, 99], dtype=torch.int64)
    bag = KeyedJaggedTensor.from_lengths_sync(keys=["user_segment", "context"], values=torch.cat(
        [ids, torch.tensor([1, 2])]), lengths=torch.tensor([2, 3, 1, 1])).to(dev)
    p.model(_seq(torch.tensor([5, 6]), dev), bag)
    got = _rows(bag_m, ids)
    assert got.unique().numel() == 5 and int(got.max()) < 15
    w = _weights(p, "user_segment")
    kt, _ = p.inner.mc_ebc(bag)
    expect = torch.stack([w[got[:2]].sum(0), w[got[2:]].sum(0)])
    torch.testing.assert_close(kt["user_segment"].cpu(), expect, rtol=0, atol=1e-6)


def test_the_id_history_grows_with_the_batch():
    """TorchRec's module sizes its id history from the first batch and drops the ids past it: a first batch of 2
    ids, then 20 new ones, leaves most of them out of the map. gem's keeps all."""
    def make(cls):
        return cls(zch_size=32, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(),
                   eviction_interval=1, input_hash_size=2**62, input_hash_func=zch_input_hash)

    small, big = torch.tensor([1, 2]), torch.arange(100, 120)
    admitted = {}
    for cls in (MCHManagedCollisionModule, ZchModule):
        m = make(cls).train()
        for ids in (small, big):
            m({"t": JaggedTensor(values=ids, lengths=torch.tensor([ids.numel()]))})
        admitted[cls] = int((_rows(m, torch.cat([small, big])) != 31).sum())
    assert admitted[ZchModule] == 22
    assert admitted[MCHManagedCollisionModule] < 22


def test_input_hash_is_uniform_and_in_range():
    """Sequential ids spread evenly over the blocks of [0, size) that row-wise sharding gives each rank."""
    ids = torch.arange(-5000, 5000)
    h = zch_input_hash(ids, 2**62)
    assert int(h.min()) >= 0 and int(h.max()) < 2**62 and h.unique().numel() == ids.numel()
    counts = torch.bincount(h // (2**62 // 8), minlength=8)
    assert counts.numel() == 8 and int(counts.min()) > 1100  # 1250 each on average
    assert torch.equal(zch_input_hash(torch.tensor([2**63 - 1, -(2**63)]), 7).clamp(0, 6),
                       zch_input_hash(torch.tensor([2**63 - 1, -(2**63)]), 7))


def _write(path, rows: dict) -> str:
    pq.write_table(pa.table(rows), path)
    return str(path)


def test_parquet_raw_ids_reach_the_batch_unchanged(tmp_path):
    """A zch table's ids are not range-checked nor hashed by the reader (the model's managed-collision module
    takes any int64); the batch checks accept them; a dense table's out-of-range id is still refused."""
    d = _data(64)
    d["features"]["dense"]["size"] = 1
    schema = Schema.from_dict(d)
    big = [2**63 - 1, -(2**63), 2**40, -7]
    rows = {
        "hist_item": [big[:2], big[2:], []], "hist_action": [[0, 1], [2, 3], []],
        "cand_item": [big[0], -1, 5], "user_segment": [1, 2, 3], "context": [[1], [2, 3], [4]],
        "dense": [0.1, 0.2, 0.3], "click": [0, 1, 0], "conversion": [0, 0, 1],
    }
    batch = ParquetDataset(schema, _write(tmp_path / "raw.parquet", rows), batch_size=3).batch(0)
    assert batch.sequence["hist_item"].values().tolist() == big
    assert batch.sequence["cand_item"].values().tolist() == [2**63 - 1, -1, 5]
    validate_batch(batch, schema)
    rows["user_segment"] = [1, 2, 300]
    with pytest.raises(ValueError, match="feature 'user_segment': id outside its table 'user_segment' range"):
        ParquetDataset(schema, _write(tmp_path / "bad.parquet", rows), batch_size=3).batch(0)


def test_resume_refuses_a_world_that_splits_a_saved_shard():
    """A map saved in row-wise shards loads into shards that join whole saved ones (the same or fewer ranks), not
    into one that splits a saved shard (more ranks): one line naming the table and the bounds."""
    from gem.parallel.embedding import zch_resume_problem

    m = ZchModule(zch_size=64, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(), eviction_interval=1,
                  input_hash_size=2**62, input_hash_func=zch_input_hash, name="item")
    second_half = nn.ModuleDict({"item": m.rebuild_with_output_id_range((32, 64), [0, 32, 64])})

    def saved(*bounds: int) -> dict:
        segs = torch.full((1025,), -1, dtype=torch.int64)
        segs[: len(bounds)] = torch.tensor(bounds)
        return {"mc_ec._managed_collision_collection._managed_collision_modules.item._output_segments_tensor": segs}

    assert zch_resume_problem(nn.ModuleDict({"item": m}), saved(0, 32, 64)) is None  # 2 shards -> 1
    assert zch_resume_problem(second_half, saved(0, 32, 64)) is None  # 2 -> 2
    assert zch_resume_problem(second_half, saved(0, 16, 32, 48, 64)) is None  # 4 -> 2
    problem = zch_resume_problem(second_half, saved(0, 64))  # 1 -> 2
    assert problem.startswith("the hash: zch table 'item' was saved in 1 row-wise shard(s) (row bounds [0, 64]); "
                              "this rank's shard [32, 64) would split one")

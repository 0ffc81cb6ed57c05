"""Synthetic GEM-style examples with labels from a hidden ground-truth model.

Any declaration (gem/data/schema.py) generates: the items are the rows of the first candidate feature's table.
The hidden world (fixed by `seed`, shared by every split and rank): items have a popularity rank r (Zipf) and a
cluster r mod K; each cluster has a unit vector. A user has a favourite cluster; each history has its own length
(its length law) and each event of a sequence feature on the item table comes from that cluster with probability
`in_cluster` (else from the global popularity law); the `data.synthetic.action` feature, if declared, holds an
event type drawn from P(a) ~ 2^-a. Sequence and candidate features on another candidate feature's table hold an
attribute of the item (a fixed hash of it, e.g. its category); other sequence features hold uniform ids. The
candidate comes from the favourite cluster with probability `cand_in_cluster`. Item ids are an affine permutation
of popularity ranks, so popular items are spread over the id range.

Labels (the model can only see the features, and the truth uses only the features):
    taste     = weighted mean of the history items' cluster vectors (all histories), weight = action_weight[a] *
                recency decay
    affinity  = <taste, cand cluster vector>                     (0 for an empty history)
    logit_0   = affinity_scale * affinity + popularity(cand) + dense @ w_0 + sum of sparse-feature effects + bias
    task 0 (e.g. click)        ~ Bernoulli(sigmoid(logit_0))
    task t>0 (e.g. conversion) = task 0 * Bernoulli(sigmoid(c_t + affinity + dense @ w_t))
`batch(i, return_truth=True)` also returns the true probabilities P(task = 1) [C, num_tasks].

Requests (`max_candidates` K > 1): each of a batch's `batch_size` users is one request with k ~ uniform{1..K}
candidates (mean (K + 1) / 2), each drawn as the one candidate of the row form is (from the favourite cluster with
probability `cand_in_cluster`) and labelled by the same hidden model. The request's own features (sparse, dense)
are drawn once per request. Request ids are global: batch g's requests are g * batch_size + 0 .. batch_size - 1.
With K = 1 the batches are exactly the row-form batches (no cand_offsets).

Streams. Examples come in global batches g = 0, 1, 2, ...; rank r of a world of size W takes g = i * W + r as its
i-th batch, so the union over ranks is the same stream for any world size. Batch g is generated from a generator
seeded by (seed, split, g) alone: deterministic, random-access and resumable by batch index. `eval` draws from a
different seed stream than `train` (held out) over the same hidden world.

DataLoader workers: with num_workers = n > 1, worker w yields this rank's batches start + w, start + w + n, ...
(start = the current position) and the DataLoader's round-robin restores the single-process order. Use `batch_size=None` in the DataLoader (the dataset
yields whole batches). The dataset's position (`state_dict`) only advances in the process that iterates, so with
workers the trainer counts consumed batches and restores with `load_state_dict({"batch_index": n})` (`data.num_workers`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem.data.batch import Batch, history_fields, request_fields, stream_batches
from gem.data.schema import HistorySpec, Schema

_SPLITS = {"train": 0, "eval": 1}
_HASH_P = 2_147_483_647  # 2^31 - 1 (prime); keeps products of two residues inside int64


def _stream_seed(*words: int) -> int:
    return int(np.random.SeedSequence([int(w) & 0xFFFFFFFF for w in words] + [len(words)]).generate_state(1)[0])


def _hash01(x: torch.Tensor, salt: int) -> torch.Tensor:
    """Deterministic pseudo-uniform [0, 1) per integer id (float32)."""
    h = ((x % _HASH_P) * 48_271 + salt) % _HASH_P
    h = (h * 16_807 + 12_345) % _HASH_P
    return h.to(torch.float32) / _HASH_P


def zipf_ranks(u: torch.Tensor, n: torch.Tensor | int, alpha: float) -> torch.Tensor:
    """Popularity ranks in [0, n) with P(k) ~ (k + 1)^-alpha (continuous inverse-CDF approximation), from u ~ U[0, 1)."""
    u = u.to(torch.float64)
    n_f = torch.as_tensor(n, dtype=torch.float64)
    if alpha == 0.0:
        x = 1.0 + u * n_f
    elif abs(alpha - 1.0) < 1e-9:
        x = torch.exp(u * torch.log1p(n_f))
    else:
        e = 1.0 - alpha
        x = torch.pow(1.0 + u * torch.expm1(e * torch.log1p(n_f)), 1.0 / e)
    r = x.floor().to(torch.int64) - 1
    return torch.minimum(r.clamp_min(0), torch.as_tensor(n, dtype=torch.int64) - 1)


def sample_lengths(h: HistorySpec, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    """History lengths [batch_size] (int64) following the history's length law."""
    if h.distribution == "uniform":
        lo, hi = h.uniform_range()
        return torch.randint(lo, hi + 1, (batch_size,), generator=gen, dtype=torch.int64)
    if h.distribution == "zipf":
        lo = max(h.min_len, 1)
        cdf = torch.cumsum(torch.arange(1, h.max_len - lo + 2, dtype=torch.float64) ** -h.alpha, 0)
        u = torch.rand(batch_size, generator=gen, dtype=torch.float64) * cdf[-1]
        return lo + torch.searchsorted(cdf, u, right=True).clamp_max(h.max_len - lo)  # exact inverse CDF
    z = torch.randn(batch_size, generator=gen, dtype=torch.float64)
    return torch.exp(h.mu + h.sigma * z).round().clamp(h.min_len, h.max_len).to(torch.int64)


class _HiddenWorld:
    """The ground-truth model; depends on (schema, seed) only."""

    dim = 8
    in_cluster = 0.8
    cand_in_cluster = 0.35
    affinity_scale = 5.0
    recency_tau = 16.0

    def __init__(self, schema: Schema, seed: int) -> None:
        g = torch.Generator().manual_seed(_stream_seed(seed, 0x5EED, 7))
        tables = schema.table
        self.item_table = schema.feature[schema.candidate_names[0]].table
        n = tables[self.item_table].num_embeddings
        if n >= 2**31:  # rank * multiplier must stay inside int64
            raise ValueError(f"synthetic data supports item tables of < 2^31 rows, got {n}")
        self.n = n
        self.k = min(32, n)
        centers = torch.randn(self.k, self.dim, generator=g)
        self.centers = centers / centers.norm(dim=1, keepdim=True)
        # Affine permutation rank -> id: id = (r * a + b) mod n with gcd(a, n) = 1.
        a = max(1, int(n * 0.6180339887))
        while math.gcd(a, n) != 1:
            a += 1
        self.perm_a, self.perm_b = a % max(n, 1), int(torch.randint(n, (1,), generator=g))
        # Items per cluster (cluster c holds ranks c, c + k, ...).
        self.cluster_sizes = (n - torch.arange(self.k) + self.k - 1) // self.k
        action = schema.synthetic.action
        self.action = action
        self.num_actions = tables[schema.feature[action].table].num_embeddings if action else 0
        # tables of candidate attributes (a candidate feature's table other than the item table): row = hash(item)
        self.attr_salts = {f.table: int(torch.randint(1, _HASH_P, (1,), generator=g))
                           for f in schema.of_kind("candidate") if f.table != self.item_table}
        self.rows = {t.name: t.num_embeddings for t in schema.tables}
        if self.num_actions:
            p = 0.5 ** torch.arange(self.num_actions, dtype=torch.float64)
            self.action_cdf = torch.cumsum(p / p.sum(), 0)
            self.action_weight = 1.0 + torch.arange(self.num_actions, dtype=torch.float32)
        nd, nt = schema.num_dense, schema.num_tasks
        self.dense_w = torch.randn(nt, nd, generator=g) * (0.8 / math.sqrt(max(nd, 1)))
        self.task_bias = torch.tensor([-2.5] + [-0.5] * (nt - 1))
        self.sparse_salts = {f.name: int(torch.randint(1, _HASH_P, (1,), generator=g)) for f in schema.of_kind("sparse")}
        self.sparse_scale = 0.6

    def rank_to_id(self, r: torch.Tensor) -> torch.Tensor:
        return (r * self.perm_a + self.perm_b) % self.n

    def attribute(self, item_rank: torch.Tensor, table: str) -> torch.Tensor:
        """The item's row in an attribute table (a fixed hash of the item)."""
        u = _hash01(item_rank, self.attr_salts[table])
        return (u.to(torch.float64) * self.rows[table]).to(torch.int64).clamp_max(self.rows[table] - 1)

    def popularity_effect(self, r: torch.Tensor) -> torch.Tensor:
        # Popular items are clicked more: +0.5 for the top item down to -0.5 for the tail.
        return 0.5 - torch.log1p(r.to(torch.float32)) / math.log1p(self.n)

    def sample_items(self, u_cluster: torch.Tensor, p_in: float, alpha: float, gen: torch.Generator):
        """Popularity ranks for examples whose users favour `u_cluster`: from it with prob. p_in, else global."""
        m = u_cluster.numel()
        u = torch.rand(2, m, generator=gen, dtype=torch.float64)
        own = zipf_ranks(u[0], self.cluster_sizes[u_cluster], alpha) * self.k + u_cluster
        glob = zipf_ranks(u[1], self.n, alpha)
        pick = torch.rand(m, generator=gen) < p_in
        return torch.where(pick, own, glob)


class SyntheticDataset(IterableDataset):
    """Streaming synthetic batches of `batch_size` examples per rank (see the module docstring).

    `num_batches`: batches per rank in one pass (None: endless). A finished pass rewinds to batch 0.
    """

    def __init__(
        self,
        schema: Schema,
        seed: int = 0,
        batch_size: int = 128,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
        num_batches: int | None = None,
        max_candidates: int = 1,
    ) -> None:
        super().__init__()
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'eval', got '{split}'")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0 or None, got {num_batches}")
        self.schema, self.seed, self.batch_size = schema, int(seed), int(batch_size)
        self.rank, self.world_size, self.split, self.num_batches = rank, world_size, split, num_batches
        self.max_candidates = int(max_candidates)
        self.world = _HiddenWorld(schema, self.seed)
        self._position = 0

    # ---- random access ------------------------------------------------------------------------------------
    def batch(self, index: int, return_truth: bool = False, rank: int | None = None):
        """This rank's (or `rank`'s) batch number `index` (0-based); with return_truth, (batch, true probabilities)."""
        return self.global_batch(index * self.world_size + (self.rank if rank is None else rank), return_truth)

    def global_batch(self, g: int, return_truth: bool = False):
        gen = torch.Generator().manual_seed(_stream_seed(self.seed, _SPLITS[self.split], g, 0xBA7C))
        return _generate(self.schema, self.world, self.batch_size, gen, return_truth, self.max_candidates, g)

    # ---- streaming and position ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return stream_batches(self, self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("endless SyntheticDataset has no length (num_batches=None)")
        return self.num_batches

    def state_dict(self) -> dict[str, int]:
        return {"batch_index": self._position, "world_size": self.world_size, "seed": self.seed,
                "max_candidates": self.max_candidates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position. A position saved at another world size is rescaled by global batches."""
        index = int(state["batch_index"])
        saved_world = int(state.get("world_size", self.world_size))
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this dataset has seed {self.seed}")
        if "max_candidates" in state and int(state["max_candidates"]) != self.max_candidates:
            raise ValueError(f"state was saved with max_candidates {state['max_candidates']}, this dataset has "
                             f"{self.max_candidates}: its batches would be different ones")
        global_done = index * saved_world
        if global_done % self.world_size:
            raise ValueError(
                f"cannot resume {global_done} global batches (world {saved_world}) on a world of {self.world_size}"
            )
        self._position = global_done // self.world_size


def _segment_sum(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    out = torch.zeros((num_segments,) + values.shape[1:], dtype=values.dtype)
    return out.index_add_(0, segment, values)


def sample_candidate_counts(max_candidates: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Candidates per request [n] (int64), uniform over 1..max_candidates."""
    return torch.randint(1, max_candidates + 1, (n,), generator=gen, dtype=torch.int64)


def _generate(schema: Schema, w: _HiddenWorld, bsz: int, gen: torch.Generator, return_truth: bool,
              max_candidates: int = 1, global_index: int = 0):
    alpha = schema.synthetic.zipf_alpha
    u_cluster = None
    seq_values: dict[str, torch.Tensor] = {}
    hist_lengths, hist_times = [], []
    per_cluster = torch.zeros(bsz * w.k)
    for h in schema.histories:
        lengths = sample_lengths(h, bsz, gen)
        hist_lengths.append(lengths)
        if u_cluster is None:
            u_cluster = torch.randint(w.k, (bsz,), generator=gen)
        total = int(lengths.sum())
        offsets = torch.zeros(bsz + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        user = torch.repeat_interleave(torch.arange(bsz), lengths, output_size=total)
        pos_from_end = (offsets[1:][user] - 1) - torch.arange(total)
        names = schema.history_features(h.name)
        tables = {n: schema.feature[n].table for n in names}
        has_items = any(t == w.item_table for t in tables.values())
        hist_rank = w.sample_items(u_cluster[user], w.in_cluster, alpha, gen) if has_items else None
        weight = torch.exp(-pos_from_end.to(torch.float32) / w.recency_tau)
        for n in names:
            t = tables[n]
            if n == w.action:
                u = torch.rand(total, generator=gen, dtype=torch.float64)
                actions = torch.searchsorted(w.action_cdf, u, right=True).clamp_max(w.num_actions - 1)
                seq_values[n] = actions
                weight = weight * w.action_weight[actions]
            elif t == w.item_table:
                seq_values[n] = w.rank_to_id(hist_rank)
            elif hist_rank is not None and t in w.attr_salts:
                seq_values[n] = w.attribute(hist_rank, t)
            else:  # carries no signal
                seq_values[n] = torch.randint(w.rows[t], (total,), generator=gen)
        if schema.has_times:  # uniform order statistics in [0, 1) per example: the histories interleave
            gaps = -torch.log1p(-torch.rand(total + bsz, generator=gen, dtype=torch.float64))
            ends = torch.cumsum(gaps[:total], 0)
            start = (ends - gaps[:total])[offsets[:-1].clamp_max(max(total - 1, 0))] if total else ends
            span = _segment_sum(gaps[:total], user, bsz) + gaps[total:]
            hist_times.append((ends - start[user]) / span[user])
        if has_items:
            # Summing weights per (user, cluster) first keeps the scatter one-dimensional.
            per_cluster += _segment_sum(weight, user * w.k + hist_rank % w.k, bsz * w.k)

    # Taste: weighted mean of the histories' cluster vectors (0 for empty histories).
    per_cluster = per_cluster.view(bsz, w.k)
    wsum = per_cluster.sum(1, keepdim=True)
    taste = (per_cluster / wsum.clamp_min(1e-12)) @ w.centers

    # Requests: k candidates each (the row form: one); req [C] = each candidate's request.
    counts = sample_candidate_counts(max_candidates, bsz, gen) if max_candidates > 1 else None
    req = torch.arange(bsz) if counts is None else torch.repeat_interleave(torch.arange(bsz), counts)
    cand_rank = w.sample_items(u_cluster[req], w.cand_in_cluster, alpha, gen)
    affinity = (taste[req] * w.centers[cand_rank % w.k]).sum(1)
    cand_values = {f.name: w.rank_to_id(cand_rank) if f.table == w.item_table else w.attribute(cand_rank, f.table)
                   for f in schema.of_kind("candidate")}

    dense = torch.randn(bsz, schema.num_dense, generator=gen)
    sparse_vals, sparse_lens = [], []
    sparse_effect = torch.zeros(bsz)
    for f in schema.of_kind("sparse"):
        lens = torch.randint(f.min_hot, f.max_hot + 1, (bsz,), generator=gen)
        vals = torch.randint(w.rows[f.table], (int(lens.sum()),), generator=gen)
        eff = w.sparse_scale * (2.0 * _hash01(vals, w.sparse_salts[f.name]) - 1.0)
        owner = torch.repeat_interleave(torch.arange(bsz), lens, output_size=vals.numel())
        sparse_effect += _segment_sum(eff, owner, bsz) / lens.clamp_min(1)
        sparse_vals.append(vals)
        sparse_lens.append(lens)

    dense_logits = (dense @ w.dense_w.T)[req]  # [C, num_tasks]
    logit0 = w.affinity_scale * affinity + w.popularity_effect(cand_rank) + sparse_effect[req]
    logit0 = logit0 + dense_logits[:, 0] + w.task_bias[0]
    p0 = torch.sigmoid(logit0)
    p_cond = torch.sigmoid(w.task_bias[1:] + affinity[:, None] + dense_logits[:, 1:])
    draws = torch.rand(req.numel(), schema.num_tasks, generator=gen)
    first = draws[:, 0] < p0
    labels = torch.cat([first[:, None], first[:, None] & (draws[:, 1:] < p_cond)], 1).to(torch.float32)

    hist_of = {n: i for i, h in enumerate(schema.histories) for n in schema.history_features(h.name)}
    unpooled = schema.unpooled_names
    per_request = torch.ones(bsz, dtype=torch.int64) if counts is None else counts  # candidates per request
    empty = torch.zeros(0, dtype=torch.int64)
    batch = Batch(
        sequence=KeyedJaggedTensor(
            keys=unpooled,
            values=torch.cat([seq_values[n] if n in seq_values else cand_values[n] for n in unpooled]),
            lengths=torch.cat([hist_lengths[hist_of[n]] if n in hist_of else per_request for n in unpooled]),
        ),
        sparse=KeyedJaggedTensor(
            keys=schema.sparse_names, values=torch.cat(sparse_vals) if sparse_vals else empty,
            lengths=torch.cat(sparse_lens) if sparse_lens else empty,
        ),
        dense=dense,
        labels=labels,
        **history_fields(hist_lengths),
        history_times=tuple(hist_times),
        **request_fields(counts, None if counts is None else global_index * bsz + torch.arange(bsz)),
    )
    if not return_truth:
        return batch
    truth = torch.cat([p0[:, None], p0[:, None] * p_cond], 1)
    return batch, truth

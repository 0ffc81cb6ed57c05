"""The GEM-style model: TorchRec embeddings -> jagged transformer tower -> GDPA target interaction -> heads.

  history tokens  : per history, its sequence features (EmbeddingCollection) concatenated (or summed) and
                    projected to d_model, then its tower (pre-norm causal transformer blocks over the jagged
                    histories) and a final norm. The towers' blocks are `blocks`, one tower after another.
  query tokens    : per example one token per candidate feature (EmbeddingCollection, one id) and per sparse
                    feature (pooled EmbeddingBagCollection output), in declaration order, one dense-feature token
                    (MLP of the dense features) and one learned summary token, each in d_model.
  interaction     : the query tokens attend to every history's tower output of their example (the histories one
                    after another) with GDPA cross attention (pointwise activation, no softmax; no history gives a
                    zero update), residual added; the tokens are flattened and concatenated with a dense-feature
                    MLP path.
  heads           : a shared MLP, then one MLP per task -> logits [C, num_tasks], one row per candidate.

A batch holds R examples (requests), each with its histories and 1 or more candidates, C candidates in all
(gem.data.Batch; the row form has C = R). The request's own features (sparse, dense) are looked up once per request
and repeated on its candidates. How the candidates of a request meet its history is `model.candidates`:
  rows        : every candidate gets its own copy of its request's histories through the towers (a request of k
                candidates costs k tower passes); on one-candidate data this is the plain model.
  interaction : the towers run once per request; each candidate's query tokens attend to the shared tower output
                (GDPA jagged by candidates per request). Per candidate the same function as `rows`.
  targets     : each candidate becomes one token (a projection of its query tokens) appended to its request's
                history as an HSTU target (gem.model.attention.Targets): it attends to the history and itself in every
                block of the one tower (one history, or the histories merged by time), and the heads read its tower
                output. Candidates do not see each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gem import ops
from gem.model import flops as flops_mod
from gem.model.attention import Targets, build_blocks, make_norm
from gem.model.config import ModelConfig
from gem.model.embeddings import build_embeddings, pooled_embeddings, sequence_embeddings, unpooled_outputs
from gem.model.heads import MultiTaskHeads, mlp, mlp_out_dim

# TorchRec's TrainPipelineSparseDist fx-traces forward to find each sharded embedding module's input, which must be
# a plain attribute of the batch. Its tracer treats only the model's direct children as leaves, so what would need
# Python control flow on traced values (the embedding outputs' key checks and per-feature loops, the blocks' jagged
# ops) runs inside these fx-wrapped functions, recorded as single calls. They live here because torch.fx.wrap
# patches the globals of the module whose forward is traced.


def history_input(ec_out, names: list[str], combine: str) -> torch.Tensor:
    """The tower's input [T, sum (concat) or one (sum) embedding dim] from the EmbeddingCollection's output."""
    embs = sequence_embeddings(ec_out, names)
    return torch.cat(embs, dim=-1) if combine == "concat" else torch.stack(embs).sum(0)


def pooled_features(kts, names: list[str]) -> tuple[torch.Tensor, ...]:
    """Per sparse feature (in `names` order) its pooled embedding [B, dim] from the bag collections' outputs."""
    return tuple(pooled_embeddings(kts, names))


def unpooled_features(ec_out, mc_out) -> dict:
    """feature -> JaggedTensor over both unpooled collections (plain and zch tables; None: not in the model)."""
    return unpooled_outputs(ec_out, mc_out)


def candidate_features(ec_out, names: list[str]) -> tuple[torch.Tensor, ...]:
    """Per candidate feature (in `names` order) its embedding [B, dim] from the EmbeddingCollection (one id each)."""
    return tuple(sequence_embeddings(ec_out, names))


def merge_histories(xs: list[torch.Tensor], offsets: list[torch.Tensor], total: torch.Tensor) -> torch.Tensor:
    """Every example's histories one after another: towers' outputs [T_i, d] jagged by offsets[i] -> [sum T_i, d]
    jagged by `total` (the offsets of the summed lengths)."""
    base = total[:-1]
    dest = []
    for x, o in zip(xs, offsets):
        lens = o[1:] - o[:-1]
        user = torch.repeat_interleave(torch.arange(lens.numel(), device=o.device), lens, output_size=x.shape[0])
        dest.append(base[user] + torch.arange(x.shape[0], device=o.device) - o[:-1][user])
        base = base + lens
    dest = torch.cat(dest)
    inv = torch.empty_like(dest)
    inv[dest] = torch.arange(dest.numel(), device=dest.device)
    return torch.cat(xs)[inv]


def run_tower(blocks: nn.ModuleList, x: torch.Tensor, offsets: torch.Tensor, max_len: int,
              span: tuple[int, int] | None = None, targets: Targets | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [span) (default: all) over the jagged histories -> (x, summed MoE aux loss fp32). The whole
    ModuleList travels with the span: the tracer can only name a registered module. The blocks share one
    JaggedBatch: their kernels' tables and offsets checks are built once per batch. `targets`: the last tokens of
    each sequence are HSTU targets (the targets form)."""
    aux = torch.zeros((), dtype=torch.float32, device=x.device)
    hist = ops.JaggedBatch(offsets, max_len)
    for blk in (blocks if span is None else blocks[span[0]:span[1]]):
        x, a = blk(x, hist, max_len) if targets is None else blk(x, hist, max_len, targets)
        aux = aux + a
    return x, aux


def _owner(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """For each of `rows` jagged rows, the index of its sequence ([rows] int64)."""
    n = offsets.numel() - 1
    return torch.repeat_interleave(torch.arange(n, device=offsets.device), offsets[1:] - offsets[:-1],
                                   output_size=rows)


def per_candidate(xs: tuple[torch.Tensor, ...], cand_offsets: torch.Tensor | None, num_candidates: int
                  ) -> tuple[torch.Tensor, ...]:
    """Per-request rows [R, ...] repeated on each of the request's candidates -> [C, ...] (unchanged in the row
    form, cand_offsets None)."""
    if cand_offsets is None:
        return tuple(xs)
    req = _owner(cand_offsets, num_candidates)
    return tuple(x.index_select(0, req) for x in xs)


def expand_offsets(offsets: torch.Tensor, cand_offsets: torch.Tensor | None) -> torch.Tensor:
    """Offsets [R+1] of the requests' histories -> offsets [C+1] of one copy per candidate (the rows form)."""
    if cand_offsets is None:
        return offsets
    req = _owner(cand_offsets, int(cand_offsets[-1]))
    out = torch.zeros(req.numel() + 1, dtype=offsets.dtype, device=offsets.device)
    torch.cumsum((offsets[1:] - offsets[:-1])[req], 0, out=out[1:])
    return out


def expand_histories(x: torch.Tensor, offsets: torch.Tensor, cand_offsets: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows form on a request batch: one copy of each request's history tokens x [T, d] (jagged by offsets
    [R+1]) per candidate -> (x [T', d], offsets [C+1]). Unchanged in the row form (cand_offsets None)."""
    if cand_offsets is None:
        return x, offsets
    out = expand_offsets(offsets, cand_offsets)
    total = int(out[-1])  # a host sync: the rows form on request data is the reference, not the fast path
    owner = _owner(out, total)
    req = _owner(cand_offsets, out.numel() - 1)
    idx = offsets[:-1][req][owner] + torch.arange(total, device=x.device) - out[:-1][owner]
    return x.index_select(0, idx), out


def append_targets(x: torch.Tensor, tgt: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                   cand_offsets: torch.Tensor | None, max_candidates: int):
    """The targets form's tower input: each request's history tokens x [T, d] followed by its candidates' tokens
    tgt [C, d] -> (merged [T + C, d], offsets [R+1], max_len, Targets, rows of the targets in merged [C])."""
    t, c = x.shape[0], tgt.shape[0]
    dev = x.device
    if cand_offsets is None:  # one candidate per example
        cand_offsets = torch.arange(seq_offsets.numel(), dtype=seq_offsets.dtype, device=dev)
        max_candidates = 1
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    req_t, req_c = _owner(seq_offsets, t), _owner(cand_offsets, c)
    hist_rows = torch.arange(t, device=dev) + cand_offsets[:-1][req_t]
    tgt_rows = torch.arange(c, device=dev) + seq_offsets[1:][req_c]
    src = torch.empty(t + c, dtype=torch.int64, device=dev)
    src[hist_rows] = torch.arange(t, device=dev)
    src[tgt_rows] = torch.arange(t, t + c, device=dev)
    positions = torch.empty(t + c, dtype=torch.int32, device=dev)
    positions[hist_rows] = (torch.arange(t, device=dev) - seq_offsets[:-1][req_t]).to(torch.int32)
    positions[tgt_rows] = lengths[req_c].to(torch.int32)
    merged = torch.cat([x, tgt.to(x.dtype)]).index_select(0, src)
    targets = Targets(cand_offsets[1:] - cand_offsets[:-1], positions)
    return merged, seq_offsets + cand_offsets, max_seq_len + max_candidates, targets, tgt_rows


torch.fx.wrap("history_input")
def merge_by_time(xs: list[torch.Tensor], offsets: list[torch.Tensor], times: list[torch.Tensor]) -> torch.Tensor:
    """Every example's events of all histories in one sequence, oldest first (ties: history order, then position):
    [T_i, d] jagged by offsets[i], with times [T_i] -> [sum T_i, d] jagged by the offsets of the summed lengths."""
    users = [torch.repeat_interleave(torch.arange(o.numel() - 1, device=o.device), o[1:] - o[:-1],
                                     output_size=x.shape[0]) for x, o in zip(xs, offsets)]
    order = torch.sort(torch.cat(times), stable=True).indices
    order = order[torch.sort(torch.cat(users)[order], stable=True).indices]
    return torch.cat(xs)[order]


def final_norm(norms: nn.ModuleDict, name: str, x: torch.Tensor) -> torch.Tensor:
    """Tower `name`'s final norm. Called through this wrapped function: TorchRec's pipeline tracer treats only the
    top-level `final_norms` as a leaf, and would otherwise trace into the compiled norm."""
    return norms[name](x)


torch.fx.wrap("merge_by_time")
torch.fx.wrap("final_norm")
torch.fx.wrap("pooled_features")
torch.fx.wrap("unpooled_features")
torch.fx.wrap("candidate_features")
torch.fx.wrap("merge_histories")
torch.fx.wrap("run_tower")
torch.fx.wrap("per_candidate")
torch.fx.wrap("expand_offsets")
torch.fx.wrap("expand_histories")
torch.fx.wrap("append_targets")


MERGED = "merged"  # the one tower's name when the histories are merged by time


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [C, num_tasks], one row per candidate
    aux_loss: torch.Tensor  # scalar fp32 (sum of MoE load-balancing losses; 0 without MoE)


# A pytree node, so that FSDP2 finds the output tensors to hook its pre-backward all-gather on. torch 2.11 only
# looks through pytree nodes: without this the root's resharded params (the heads) stayed freed in backward.
torch.utils._pytree.register_dataclass(ModelOutput)


class TargetInteraction(nn.Module):
    """GDPA cross attention of per-example query tokens over the tower's output sequence."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        it = cfg.interaction
        self.num_heads, self.num_kv_heads, self.head_dim = it.num_heads, cfg.interaction_kv_heads, \
            cfg.interaction_head_dim
        self.activation, self.approx, self.normalize, self.kernel = it.activation, it.approx, it.normalize, cfg.kernel
        d = cfg.d_model
        self.q_norm = make_norm(cfg.tower.norm, d)
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(d, 2 * self.num_kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def _project(self, tokens: torch.Tensor, seq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, d = tokens.shape
        h, hk, dh = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(self.q_norm(tokens.reshape(b * n, d))).reshape(b * n, h, dh)
        # k and v contiguous (one fused copy here): as strided views of the projection, GDPA made them contiguous
        # in its forward and backward and autograd re-laid their gradients, six copies in all.
        k, v = (t.contiguous() for t in self.kv_proj(seq).reshape(seq.shape[0], 2, hk, dh).unbind(1))
        return q, k, v

    def _finish(self, tokens: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        b, n, d = tokens.shape
        return tokens + self.out(o.reshape(b * n, self.num_heads * self.head_dim)).reshape(b, n, d)

    def forward(self, tokens: torch.Tensor, seq: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                cand_offsets: torch.Tensor | None = None, max_candidates: int = 1) -> torch.Tensor:
        """tokens [C, n, d], seq [T, d] (jagged by seq_offsets [R+1]) -> tokens + attention update [C, n, d].
        cand_offsets [R+1]: the candidates of sequence r are rows cand_offsets[r]:cand_offsets[r+1] of tokens
        (None: one per sequence, C = R)."""
        b, n, _ = tokens.shape
        q, k, v = self._project(tokens, seq)
        if cand_offsets is None:
            offsets_q = torch.arange(b + 1, device=seq_offsets.device, dtype=seq_offsets.dtype) * n
            max_q = n
        else:
            offsets_q, max_q = (cand_offsets * n).to(seq_offsets.dtype), n * max_candidates
        o = ops.gdpa(q, k, v, offsets_q, max_q, seq_offsets, max_seq_len, activation=self.activation,
                     approx=self.approx, normalize=self.normalize, kernel=self.kernel)
        return self._finish(tokens, o)

    def compile_regions(self, **compile_kwargs) -> None:
        """torch.compile the projections around the GDPA kernel."""
        self._project = torch.compile(self._project, **compile_kwargs)
        self._finish = torch.compile(self._finish, **compile_kwargs)


class GEMModel(nn.Module):
    def __init__(self, cfg: ModelConfig, *, embedding_device: torch.device | str = "cpu"):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError("GEMModel needs a ModelConfig built with its data schema (ModelConfig.from_dict(model, "
                            "schema))")
        self.cfg = cfg
        d = cfg.d_model
        self.histories = cfg.histories
        self.history_features = [cfg.history_features(h) for h in self.histories]
        self.candidate_features = cfg.candidate_features
        self.sparse_features = cfg.sparse_features
        self.query_features = cfg.query_features
        # plain tables (ec, ebc) and hash: zch tables (mc_ec, mc_ebc); None where a model has none of that kind
        self.ec, self.ebc, self.mc_ec, self.mc_ebc = build_embeddings(cfg, embedding_device)

        self.input_projs = nn.ModuleDict()
        for h, names in zip(self.histories, self.history_features):
            dims = [cfg.embedding_dim(n) for n in names]  # seq_combine: the history's tower's (model.towers.<h>)
            self.input_projs[h] = nn.Linear(sum(dims) if cfg.tower_for(h).seq_combine == "concat" else dims[0], d)
        # a tower per history, or one over the histories merged by time
        self.towers = [MERGED] if cfg.merged else list(self.histories)
        self.final_norms = nn.ModuleDict()
        blocks, self.tower_spans = [], []
        for h in self.towers:
            tower = cfg.tower_for(None if h == MERGED else h)
            start = len(blocks)
            blocks.extend(build_blocks(cfg, tower))
            self.tower_spans.append((start, len(blocks)))
            self.final_norms[h] = make_norm(tower.norm, d)
        self.blocks = nn.ModuleList(blocks)

        self.query_proj = nn.ModuleList([nn.Linear(cfg.embedding_dim(f), d) for f in self.query_features])
        self.dense_token = mlp(cfg.num_dense, cfg.interaction.dense_hidden, d)
        self.summary_token = nn.Parameter(torch.randn(d) * 0.02)
        if cfg.candidates == "targets":
            self.target_token = nn.Linear(cfg.num_query_tokens * d, d)  # a candidate's query tokens -> its target
        else:
            self.interaction = TargetInteraction(cfg)
        self.dense_mlp = mlp(cfg.num_dense, cfg.interaction.dense_hidden)

        z_dim = cfg.head_input_dim
        self.over_arch = mlp(z_dim, cfg.heads.over_arch)
        self.heads = MultiTaskHeads(mlp_out_dim(z_dim, cfg.heads.over_arch), cfg.tasks, cfg.heads.hidden)

    @property
    def tasks(self) -> list[str]:
        return list(self.cfg.tasks)

    @property
    def sequence_features(self) -> list[str]:
        return [n for names in self.history_features for n in names]

    def dense_parameters(self):
        """Every parameter outside the embedding tables (what the dense optimizer / FSDP own)."""
        emb = {id(p) for m in self.embedding_collections() for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in emb]

    def embedding_collections(self) -> list[nn.Module]:
        return [m for m in (self.ec, self.ebc, self.mc_ec, self.mc_ebc) if m is not None]

    def _dense_dtype(self) -> torch.dtype:
        return self.summary_token.dtype

    def _history_tokens(self, ec_out) -> list[torch.Tensor]:
        """Per history its tokens [T_h, d_model] (the input projection of its sequence features)."""
        xs = []
        for i, h in enumerate(self.histories):
            # Embedding outputs are fp32; under FSDP mixed precision the dense weights are bf16 during forward.
            proj = self.input_projs[h]
            x = history_input(ec_out, self.history_features[i], self.cfg.tower_for(h).seq_combine)
            xs.append(proj(x.to(proj.weight.dtype)))
        return xs

    def _towers(self, xs: list[torch.Tensor], batch, per_candidate_copy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every history through its tower -> (output [T, d] with an example's histories one after another, MoE
        aux loss, its offsets). `per_candidate_copy` (the rows form): one copy of a request's histories per
        candidate, offsets [C+1]; else offsets [R+1] (batch.seq_offsets)."""
        cand = batch.cand_offsets if per_candidate_copy else None
        if self.cfg.merged:
            x = merge_by_time(xs, batch.history_offsets, batch.history_times)
            x, offsets = expand_histories(x, batch.seq_offsets, cand)
            x, aux = run_tower(self.blocks, x, offsets, batch.max_seq_len, self.tower_spans[0])
            return final_norm(self.final_norms, MERGED, x), aux, offsets
        outs, offs, aux = [], [], None
        for i, h in enumerate(self.histories):
            x, off = expand_histories(xs[i], batch.history_offsets[i], cand)
            x, a_loss = run_tower(self.blocks, x, off, batch.history_max_lens[i], self.tower_spans[i])
            outs.append(final_norm(self.final_norms, h, x))
            offs.append(off)
            aux = a_loss if aux is None else aux + a_loss
        if len(outs) == 1:
            return outs[0], aux, offs[0]
        total = expand_offsets(batch.seq_offsets, cand)
        return merge_histories(outs, offs, total), aux, total

    def _target_tower(self, xs: list[torch.Tensor], tgt: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The targets form: the one tower over each request's history followed by its candidates' tokens tgt
        [C, d] -> (the candidates' outputs [C, d], MoE aux loss)."""
        x = merge_by_time(xs, batch.history_offsets, batch.history_times) if self.cfg.merged else xs[0]
        merged, offsets, max_len, targets, rows = append_targets(x, tgt, batch.seq_offsets, batch.max_seq_len,
                                                                 batch.cand_offsets, batch.max_candidates)
        out, aux = run_tower(self.blocks, merged, offsets, max_len, self.tower_spans[0], targets)
        return final_norm(self.final_norms, self.towers[0], out.index_select(0, rows)), aux

    def _query_tokens(self, ec_out, batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per candidate its query tokens [C, n, d] and its request's dense features [C, num_dense]."""
        cands = candidate_features(ec_out, self.candidate_features)  # [C, dim] each
        c = cands[0].shape[0]
        pooled = ()
        if self.sparse_features:
            pooled = pooled_features([self.ebc(batch.sparse) if self.ebc is not None else None,
                                      self.mc_ebc(batch.sparse) if self.mc_ebc is not None else None],
                                     self.sparse_features)
        pooled = per_candidate(pooled, batch.cand_offsets, c)  # a request's features on each of its candidates
        dense = per_candidate((batch.dense,), batch.cand_offsets, c)[0].to(self._dense_dtype())
        # Indexing, not iterating: under tracing `cands` / `pooled` are single Proxies.
        ci, si, tokens = 0, 0, []
        for f, proj in zip(self.query_features, self.query_proj):
            if f in self.candidate_features:
                e, ci = cands[ci], ci + 1
            else:
                e, si = pooled[si], si + 1
            tokens.append(proj(e.to(proj.weight.dtype)))
        tokens.append(self.dense_token(dense))
        tokens.append(self.summary_token.to(dtype).expand(c, -1))
        return torch.stack([t.to(dtype) for t in tokens], dim=1), dense

    def forward(self, batch) -> ModelOutput:
        # The embedding modules are called on the batch's attributes directly (see the note at the top).
        ec_out = unpooled_features(self.ec(batch.sequence) if self.ec is not None else None,
                                   self.mc_ec(batch.sequence) if self.mc_ec is not None else None)
        xs = self._history_tokens(ec_out)
        tokens, dense = self._query_tokens(ec_out, batch, xs[0].dtype)
        c = tokens.shape[0]
        form = self.cfg.candidates
        if form == "targets":
            out, aux = self._target_tower(xs, self.target_token(tokens.reshape(c, -1)), batch)
        else:
            seq, aux, offsets = self._towers(xs, batch, per_candidate_copy=form == "rows")
            if form == "rows":  # one history copy per candidate: one set of query tokens per sequence
                tokens = self.interaction(tokens, seq, offsets, batch.max_seq_len)
            else:
                tokens = self.interaction(tokens, seq, offsets, batch.max_seq_len, batch.cand_offsets,
                                          batch.max_candidates)
            out = tokens.reshape(c, -1)
        z = torch.cat([out, self.dense_mlp(dense).to(out.dtype)], dim=-1)
        logits = self.heads(self.over_arch(z))
        return ModelOutput(logits=logits, aux_loss=aux)

    def compile_regions(self, **compile_kwargs) -> None:
        """torch.compile the dense parts outside the tower's blocks (the blocks compile their own regions): the final
        norm, the interaction's projections, the over-arch and the heads. The embedding modules and the kernels
        stay outside the graphs."""
        if self.cfg.candidates != "targets":
            self.interaction.compile_regions(**compile_kwargs)
        for m in (*self.final_norms.values(), self.over_arch, self.heads):
            m.compile(**compile_kwargs)

    # -- FLOP accounting (see gem.model.flops) -------------------------------------------------------------------------
    def dense_flops_per_token(self) -> int:
        return flops_mod.dense_flops_per_token(self.cfg)

    def flops(self, batch) -> int:
        """Training FLOPs (fwd + bwd) of one step on `batch` (jagged lengths counted exactly)."""
        return flops_mod.train_flops(self.cfg, batch.history_offsets, batch.cand_offsets)

"""The GEM-style model: TorchRec embeddings -> jagged transformer tower -> GDPA target interaction -> heads.

  history tokens  : sequence features (EmbeddingCollection) concatenated (or summed) and projected to d_model,
                    then `blocks` (pre-norm causal transformer over the jagged histories) and a final norm.
  query tokens    : per candidate one token per sparse feature (pooled EmbeddingBagCollection output, the candidate
                    item among them), one dense-feature token (MLP of the dense features) and one learned summary
                    token, each in d_model: a jagged q stream of num_sparse + 2 tokens per candidate.
  interaction     : the query tokens attend to their user's history with GDPA cross attention (pointwise
                    activation, no softmax; an empty history gives a zero update), residual added; the tokens are
                    flattened and concatenated with a dense-feature MLP path.
  heads           : a shared MLP, then one MLP per task -> logits [C, num_tasks], one row per candidate.

A batch holds R histories and C candidates (gem.data.Batch; the row form of the data has C = R). How the
candidates of a request meet its history is `model.candidates`:
  rows        : every candidate gets its own copy of its request's history through the tower (a request of k
                candidates costs k tower passes); on one-candidate data this is the plain model.
  interaction : the tower runs once per request; each candidate's query tokens attend to the shared tower output
                (GDPA jagged by candidates per request). Per candidate the same function as `rows`.
  targets     : each candidate becomes one token (a projection of its query tokens) appended to its request's
                history as an HSTU target (gem.model.attention.Targets): it attends to the history and itself in every
                block, and the heads read its tower output. Candidates do not see each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gem import ops
from gem.model import flops as flops_mod
from gem.model.attention import Targets, build_blocks, make_norm
from gem.model.config import ModelConfig
from gem.model.embeddings import build_embeddings, pooled_embeddings, sequence_embeddings
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


def pooled_features(kt, names: list[str]) -> tuple[torch.Tensor, ...]:
    """Per sparse feature (in `names` order) its pooled embedding [B, dim] from the EmbeddingBagCollection."""
    return tuple(pooled_embeddings(kt, names))


def run_tower(blocks: nn.ModuleList, x: torch.Tensor, offsets: torch.Tensor, max_len: int,
              targets: Targets | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer blocks over the jagged sequences -> (x, summed MoE aux loss fp32)."""
    aux = torch.zeros((), dtype=torch.float32, device=x.device)
    for blk in blocks:
        x, a = blk(x, offsets, max_len) if targets is None else blk(x, offsets, max_len, targets)
        aux = aux + a
    return x, aux


def _request_of(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """For each of `rows` jagged rows, the index of its sequence ([rows] int64, no host sync)."""
    n = offsets.numel() - 1
    return torch.repeat_interleave(torch.arange(n, device=offsets.device), offsets[1:] - offsets[:-1],
                                   output_size=rows)


def expand_histories(x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int, cand_offsets: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The row form on a request batch: one copy of its request's history tokens per candidate -> (x [T', d],
    offsets [C+1], max_len). Unchanged for row batches (cand_offsets None)."""
    if cand_offsets is None:
        return x, seq_offsets, max_seq_len
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    req = _request_of(cand_offsets, int(cand_offsets[-1]))
    per_cand = lengths[req]
    offsets = torch.zeros(req.numel() + 1, dtype=seq_offsets.dtype, device=seq_offsets.device)
    torch.cumsum(per_cand, 0, out=offsets[1:])
    total = int(offsets[-1])  # one host sync: the rows form on request data is the reference, not the fast path
    owner = _request_of(offsets, total)
    idx = seq_offsets[:-1][req][owner] + torch.arange(total, device=x.device) - offsets[:-1][owner]
    return x.index_select(0, idx), offsets, max_seq_len


def append_targets(x: torch.Tensor, tgt: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                   cand_offsets: torch.Tensor | None, max_candidates: int):
    """The targets form's tower input: each request's history tokens x [T, d] followed by its candidates' tokens
    tgt [C, d] -> (merged [T + C, d], offsets [R+1], max_len, Targets, rows of the targets in merged [C])."""
    t, c = x.shape[0], tgt.shape[0]
    dev = x.device
    if cand_offsets is None:  # one candidate per history
        cand_offsets = torch.arange(seq_offsets.numel(), dtype=seq_offsets.dtype, device=dev)
        max_candidates = 1
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    req_t, req_c = _request_of(seq_offsets, t), _request_of(cand_offsets, c)
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
torch.fx.wrap("pooled_features")
torch.fx.wrap("run_tower")
torch.fx.wrap("expand_histories")
torch.fx.wrap("append_targets")


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, num_tasks]
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

    def _offsets_q(self, b: int, n: int, like: torch.Tensor) -> torch.Tensor:
        """[0, n, 2n, ...]: one tensor per (B, n), so GDPA's checks and work tables are built once, not per step."""
        if torch.compiler.is_compiling():
            return torch.arange(b + 1, device=like.device, dtype=like.dtype) * n
        key = (b, n, like.dtype, like.device)
        cached = self.__dict__.get("_offsets_q_cache")
        if cached is None or cached[0] != key:
            cached = (key, torch.arange(b + 1, device=like.device, dtype=like.dtype) * n)
            self.__dict__["_offsets_q_cache"] = cached  # not a buffer: never saved, moved or sharded
        return cached[1]

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
            offsets_q, max_q = self._offsets_q(b, n, seq_offsets), n
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
        if not isinstance(cfg, ModelConfig):  # the `model:` DictConfig / mapping
            cfg = ModelConfig.from_dict(cfg)
        self.cfg = cfg
        d = cfg.d_model
        self.sequence_features = cfg.sequence_features
        self.sparse_features = cfg.sparse_features
        self.ec, self.ebc = build_embeddings(cfg, embedding_device)

        seq_dims = [t.embedding_dim for t in cfg.sequence_tables for _ in t.features]
        in_dim = sum(seq_dims) if cfg.tower.seq_combine == "concat" else seq_dims[0]
        self.input_proj = nn.Linear(in_dim, d)
        self.blocks = build_blocks(cfg)
        self.final_norm = make_norm(cfg.tower.norm, d)

        bag_dims = {f: t.embedding_dim for t in cfg.bag_tables for f in t.features}
        self.sparse_proj = nn.ModuleList([nn.Linear(bag_dims[f], d) for f in self.sparse_features])
        self.dense_token = mlp(cfg.num_dense, cfg.interaction.dense_hidden, d)
        self.summary_token = nn.Parameter(torch.randn(d) * 0.02)
        if cfg.candidates == "targets":
            self.target_token = nn.Linear(cfg.num_query_tokens * d, d)  # a candidate's query tokens -> its target
        else:
            self.interaction = TargetInteraction(cfg)
        self.dense_mlp = mlp(cfg.num_dense, cfg.interaction.dense_hidden)

        z_dim = cfg.head_input_dim
        self.over_arch = mlp(z_dim, cfg.heads.over_arch)
        self.heads = MultiTaskHeads(mlp_out_dim(z_dim, cfg.heads.over_arch), cfg.heads.tasks, cfg.heads.hidden)

    @property
    def tasks(self) -> list[str]:
        return list(self.cfg.heads.tasks)

    def dense_parameters(self):
        """Every parameter outside the embedding tables (what the dense optimizer / FSDP own)."""
        emb = {id(p) for p in self.ec.parameters()} | {id(p) for p in self.ebc.parameters()}
        return [p for p in self.parameters() if id(p) not in emb]

    def _history_tokens(self, ec_out) -> torch.Tensor:
        # Embedding outputs are fp32; under FSDP mixed precision the dense weights are bf16 during forward.
        x = history_input(ec_out, self.sequence_features, self.cfg.tower.seq_combine)
        return self.input_proj(x.to(self.input_proj.weight.dtype))

    def _query_tokens(self, pooled, dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Per candidate its query tokens [C, n, d]."""
        b = dense.shape[0]
        # Indexing, not iterating: under tracing `pooled` is a single Proxy.
        tokens = [proj(pooled[i].to(proj.weight.dtype)) for i, proj in enumerate(self.sparse_proj)]
        tokens.append(self.dense_token(dense))
        tokens.append(self.summary_token.to(dtype).expand(b, -1))
        return torch.stack([t.to(dtype) for t in tokens], dim=1)

    def forward(self, batch) -> ModelOutput:
        # The embedding modules are called on the batch's attributes directly (see the note at the top).
        x = self._history_tokens(self.ec(batch.sequence))
        pooled = pooled_features(self.ebc(batch.sparse), self.sparse_features)
        dense = batch.dense.to(self.input_proj.weight.dtype)
        b = dense.shape[0]
        tokens = self._query_tokens(pooled, dense, x.dtype)  # [C, n, d]
        if self.cfg.candidates == "targets":
            tgt = self.target_token(tokens.reshape(b, -1))
            merged = append_targets(x, tgt, batch.seq_offsets, batch.max_seq_len, batch.cand_offsets,
                                    batch.max_candidates)
            tower = run_tower(self.blocks, merged[0], merged[1], merged[2], merged[3])
            cand = self.final_norm(tower[0].index_select(0, merged[4]))  # [C, d]: the targets' outputs
        else:
            if self.cfg.candidates == "rows":
                seq = expand_histories(x, batch.seq_offsets, batch.max_seq_len, batch.cand_offsets)
                offsets, max_len, cand_offsets = seq[1], seq[2], None
                tower = run_tower(self.blocks, seq[0], offsets, max_len)
            else:
                offsets, max_len, cand_offsets = batch.seq_offsets, batch.max_seq_len, batch.cand_offsets
                tower = run_tower(self.blocks, x, offsets, max_len)
            tokens = self.interaction(tokens, self.final_norm(tower[0]), offsets, max_len, cand_offsets,
                                      batch.max_candidates)
            cand = tokens.reshape(b, -1)
        z = torch.cat([cand, self.dense_mlp(dense).to(cand.dtype)], dim=-1)
        logits = self.heads(self.over_arch(z))
        return ModelOutput(logits=logits, aux_loss=tower[1])

    def compile_regions(self, **compile_kwargs) -> None:
        """torch.compile the dense parts outside the tower's blocks (the blocks compile their own regions): the final
        norm, the interaction's projections, the over-arch and the heads. The embedding modules and the kernels
        stay outside the graphs."""
        if self.cfg.candidates != "targets":
            self.interaction.compile_regions(**compile_kwargs)
        for m in (self.final_norm, self.over_arch, self.heads):
            m.compile(**compile_kwargs)

    # -- FLOP accounting (see gem.model.flops) -------------------------------------------------------------------------
    def dense_flops_per_token(self) -> int:
        return flops_mod.dense_flops_per_token(self.cfg)

    def flops(self, batch) -> int:
        """Training FLOPs (fwd + bwd) of one step on `batch` (jagged lengths counted exactly)."""
        return flops_mod.train_flops(self.cfg, batch.seq_offsets, batch.cand_offsets)

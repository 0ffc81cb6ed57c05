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
  heads           : a shared MLP, then one MLP per task -> logits [B, num_tasks].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gem import ops
from gem.model import flops as flops_mod
from gem.model.attention import build_blocks, make_norm
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
              span: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [span) (default: all) over the jagged histories -> (x, summed MoE aux loss fp32). The whole
    ModuleList travels with the span: the tracer can only name a registered module. The blocks share one
    JaggedBatch: their kernels' tables and offsets checks are built once per batch."""
    aux = torch.zeros((), dtype=torch.float32, device=x.device)
    hist = ops.JaggedBatch(offsets, max_len)
    for blk in (blocks if span is None else blocks[span[0]:span[1]]):
        x, a = blk(x, hist, max_len)
        aux = aux + a
    return x, aux


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
torch.fx.wrap("candidate_features")
torch.fx.wrap("merge_histories")
torch.fx.wrap("run_tower")


MERGED = "merged"  # the one tower's name when the histories are merged by time


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

    def forward(self, tokens: torch.Tensor, seq: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int
                ) -> torch.Tensor:
        """tokens [B, n, d], seq [T, d] (jagged by seq_offsets) -> tokens + attention update [B, n, d]."""
        b, n, _ = tokens.shape
        q, k, v = self._project(tokens, seq)
        offsets_q = torch.arange(b + 1, device=seq_offsets.device, dtype=seq_offsets.dtype) * n
        o = ops.gdpa(q, k, v, offsets_q, n, seq_offsets, max_seq_len, activation=self.activation,
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
        self.ec, self.ebc = build_embeddings(cfg, embedding_device)

        combine = cfg.tower.seq_combine
        self.input_projs = nn.ModuleDict()
        for h, names in zip(self.histories, self.history_features):
            dims = [cfg.embedding_dim(n) for n in names]
            self.input_projs[h] = nn.Linear(sum(dims) if combine == "concat" else dims[0], d)
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
        self.interaction = TargetInteraction(cfg)
        self.dense_mlp = mlp(cfg.num_dense, cfg.interaction.dense_hidden)

        z_dim = cfg.num_query_tokens * d + mlp_out_dim(cfg.num_dense, cfg.interaction.dense_hidden)
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
        emb = {id(p) for m in (self.ec, self.ebc) if m is not None for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in emb]

    def _dense_dtype(self) -> torch.dtype:
        return self.summary_token.dtype

    def _towers(self, ec_out, batch) -> tuple[torch.Tensor, torch.Tensor]:
        combine = self.cfg.tower.seq_combine
        xs = []
        for i, h in enumerate(self.histories):
            # Embedding outputs are fp32; under FSDP mixed precision the dense weights are bf16 during forward.
            proj = self.input_projs[h]
            x = history_input(ec_out, self.history_features[i], combine)
            xs.append(proj(x.to(proj.weight.dtype)))
        if self.cfg.merged:
            x = merge_by_time(xs, batch.history_offsets, batch.history_times)
            x, aux = run_tower(self.blocks, x, batch.seq_offsets, batch.max_seq_len, self.tower_spans[0])
            return final_norm(self.final_norms, MERGED, x), aux
        outs, aux = [], None
        for i, h in enumerate(self.histories):
            x, a_loss = run_tower(self.blocks, xs[i], batch.history_offsets[i], batch.history_max_lens[i],
                                  self.tower_spans[i])
            outs.append(final_norm(self.final_norms, h, x))
            aux = a_loss if aux is None else aux + a_loss
        if len(outs) == 1:
            return outs[0], aux
        return merge_histories(outs, batch.history_offsets, batch.seq_offsets), aux

    def forward(self, batch) -> ModelOutput:
        # The embedding modules are called on the batch's attributes directly (see the note at the top).
        ec_out = self.ec(batch.sequence)
        seq, aux = self._towers(ec_out, batch)
        cands = candidate_features(ec_out, self.candidate_features)
        pooled = pooled_features(self.ebc(batch.sparse), self.sparse_features) if self.ebc is not None else ()
        dense = batch.dense.to(self._dense_dtype())
        b = dense.shape[0]
        # Indexing, not iterating: under tracing `cands` / `pooled` are single Proxies.
        ci, si, tokens = 0, 0, []
        for f, proj in zip(self.query_features, self.query_proj):
            if f in self.candidate_features:
                e, ci = cands[ci], ci + 1
            else:
                e, si = pooled[si], si + 1
            tokens.append(proj(e.to(proj.weight.dtype)))
        tokens.append(self.dense_token(dense))
        tokens.append(self.summary_token.to(seq.dtype).expand(b, -1))
        tokens = torch.stack([t.to(seq.dtype) for t in tokens], dim=1)  # [B, n, d]
        tokens = self.interaction(tokens, seq, batch.seq_offsets, batch.max_seq_len)
        z = torch.cat([tokens.reshape(b, -1), self.dense_mlp(dense).to(tokens.dtype)], dim=-1)
        logits = self.heads(self.over_arch(z))
        return ModelOutput(logits=logits, aux_loss=aux)

    def compile_regions(self, **compile_kwargs) -> None:
        """torch.compile the dense parts outside the tower's blocks (the blocks compile their own regions): the final
        norm, the interaction's projections, the over-arch and the heads. The embedding modules and the kernels
        stay outside the graphs."""
        self.interaction.compile_regions(**compile_kwargs)
        for m in (*self.final_norms.values(), self.over_arch, self.heads):
            m.compile(**compile_kwargs)

    # -- FLOP accounting (see gem.model.flops) -------------------------------------------------------------------------
    def dense_flops_per_token(self) -> int:
        return flops_mod.dense_flops_per_token(self.cfg)

    def flops(self, batch) -> int:
        """Training FLOPs (fwd + bwd) of one step on `batch` (jagged lengths counted exactly)."""
        return flops_mod.train_flops(self.cfg, batch.history_offsets)

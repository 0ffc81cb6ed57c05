"""The GEM-style model: TorchRec embeddings -> jagged transformer tower -> GDPA target interaction -> heads.

  history tokens  : sequence features (EmbeddingCollection) concatenated (or summed) and projected to d_model,
                    then `blocks` (pre-norm causal transformer over the jagged histories) and a final norm.
  query tokens    : per example one token per sparse feature (pooled EmbeddingBagCollection output, the candidate
                    item among them), one dense-feature token (MLP of the dense features) and one learned summary
                    token, each in d_model: a jagged q stream of num_sparse + 2 tokens per example.
  interaction     : the query tokens attend to their user's history with GDPA cross attention (pointwise
                    activation, no softmax; an empty history gives a zero update), residual added; the tokens are
                    flattened and concatenated with a dense-feature MLP path.
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


def run_tower(blocks: nn.ModuleList, x: torch.Tensor, offsets: torch.Tensor, max_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer blocks over the jagged histories -> (x, summed MoE aux loss fp32). The blocks share one
    JaggedBatch: their kernels' tables and offsets checks are built once per batch."""
    aux = torch.zeros((), dtype=torch.float32, device=x.device)
    hist = ops.JaggedBatch(offsets, max_len)
    for blk in blocks:
        x, a = blk(x, hist, max_len)
        aux = aux + a
    return x, aux


torch.fx.wrap("history_input")
torch.fx.wrap("pooled_features")
torch.fx.wrap("run_tower")


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
        self.interaction = TargetInteraction(cfg)
        self.dense_mlp = mlp(cfg.num_dense, cfg.interaction.dense_hidden)

        z_dim = cfg.num_query_tokens * d + mlp_out_dim(cfg.num_dense, cfg.interaction.dense_hidden)
        self.over_arch = mlp(z_dim, cfg.heads.over_arch)
        self.heads = MultiTaskHeads(mlp_out_dim(z_dim, cfg.heads.over_arch), cfg.heads.tasks, cfg.heads.hidden)

    @property
    def tasks(self) -> list[str]:
        return list(self.cfg.heads.tasks)

    def dense_parameters(self):
        """Every parameter outside the embedding tables (what the dense optimizer / FSDP own)."""
        emb = {id(p) for p in self.ec.parameters()} | {id(p) for p in self.ebc.parameters()}
        return [p for p in self.parameters() if id(p) not in emb]

    def _tower(self, ec_out, batch) -> tuple[torch.Tensor, torch.Tensor]:
        # Embedding outputs are fp32; under FSDP mixed precision the dense weights are bf16 during forward.
        x = history_input(ec_out, self.sequence_features, self.cfg.tower.seq_combine)
        x = self.input_proj(x.to(self.input_proj.weight.dtype))
        tower = run_tower(self.blocks, x, batch.seq_offsets, batch.max_seq_len)
        return self.final_norm(tower[0]), tower[1]

    def forward(self, batch) -> ModelOutput:
        # The embedding modules are called on the batch's attributes directly (see the note at the top).
        seq, aux = self._tower(self.ec(batch.sequence), batch)
        pooled = pooled_features(self.ebc(batch.sparse), self.sparse_features)
        dense = batch.dense.to(self.input_proj.weight.dtype)
        b = dense.shape[0]
        # Indexing, not iterating: under tracing `pooled` is a single Proxy.
        tokens = [proj(pooled[i].to(proj.weight.dtype)) for i, proj in enumerate(self.sparse_proj)]
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
        for m in (self.final_norm, self.over_arch, self.heads):
            m.compile(**compile_kwargs)

    # -- FLOP accounting (see gem.model.flops) -------------------------------------------------------------------------
    def dense_flops_per_token(self) -> int:
        return flops_mod.dense_flops_per_token(self.cfg)

    def flops(self, batch) -> int:
        """Training FLOPs (fwd + bwd) of one step on `batch` (jagged lengths counted exactly)."""
        return flops_mod.train_flops(self.cfg, batch.seq_offsets)

"""The planner's memory against measurement.

Activations: the bytes autograd saves for backward, counted with `torch.autograd.graph.saved_tensors_hooks` on a
tiny GEM (Triton kernels, as on the GPU; interpreted here) with each activation-checkpoint choice, against
`activation_bytes_per_token` x tokens. With checkpointing, backward recomputes one checkpointed block at a time:
the peak is what the checkpointed forward saved plus the largest checkpointed block's own saved tensors (measured
without checkpointing).
"""

from __future__ import annotations

import pytest
import torch

from gem.model import GEMModel, ModelConfig, MoE
from gem.parallel.fsdp import apply_activation_checkpointing
from gem.plan.memory import activation_bytes_per_token
from tests.model._batches import make_batch, tiny_cfg

LENGTHS = [7, 0, 12, 5, 9]  # 33 tokens: no per-example tensor of these 5 examples has 33 (or 66) rows
TOL = 0.10


class SavedBytes:
    """Bytes of distinct storages autograd saves (parameters excluded), split into per-history-token tensors (a
    dimension of T or top_k * T rows among the first two, or anything saved inside the MoE experts, where each row
    is one routed (token, slot) and an expert's rows number whatever the router gave it) and the rest, attributed
    to the module running."""

    def __init__(self, model: torch.nn.Module, tokens: int, top_k: int) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.token_rows = {tokens, top_k * tokens}
        self.seen: dict[int, tuple[str, bool, int]] = {}
        self.module = "?"
        self.routed = False
        for name, m in model.named_modules():
            m.register_forward_pre_hook(lambda _m, _a, name=name: setattr(self, "module", name))
            if isinstance(m, MoE):
                m.experts = self._routed(m.experts)

    def _routed(self, experts):
        def run(*args, **kwargs):
            self.routed = True
            try:
                return experts(*args, **kwargs)
            finally:
                self.routed = False
        return run

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            per_token = self.routed or any(n in self.token_rows for n in tuple(t.shape)[:2])
            self.seen[ptr] = (self.module, per_token, st.nbytes())
        return t

    def per_token(self, prefix: str = "") -> int:
        return sum(n for m, tok, n in self.seen.values() if tok and m.startswith(prefix))


def _measure(cfg: ModelConfig, checkpoint: str, every: int) -> tuple[SavedBytes, int]:
    torch.manual_seed(0)
    m = GEMModel(cfg)
    apply_activation_checkpointing(m.blocks, checkpoint, every)
    batch = make_batch(cfg, LENGTHS, seed=1)
    tokens = int(batch.seq_offsets[-1])
    saved = SavedBytes(m, tokens, cfg.moe.top_k)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        m(batch)
    return saved, tokens


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    # three blocks, the middle one MoE: checkpointed blocks of two sizes
    return tiny_cfg("triton", num_blocks=3, moe_every=2)


@pytest.fixture(scope="module")
def plain(cfg):
    return _measure(cfg, "none", 1)


@pytest.mark.parametrize("checkpoint,every", [("none", 1), ("full", 1), ("selective", 2)])
def test_activation_estimate_matches_saved_tensors(cfg, plain, checkpoint, every):
    base, tokens = plain
    if checkpoint == "none":
        measured = base.per_token()
        ckpt = []
    else:
        saved, _ = _measure(cfg, checkpoint, every)
        ckpt = [i for i in range(cfg.tower.num_blocks) if checkpoint == "full" or i % every == 0]
        # backward recomputes one checkpointed block at a time, on top of what the checkpointed forward saved
        measured = saved.per_token() + max(base.per_token(f"blocks.{i}.") for i in ckpt)
    planned = tokens * activation_bytes_per_token(cfg, 4, checkpoint, every)
    assert abs(planned - measured) <= TOL * measured, (checkpoint, every, ckpt, planned, measured)


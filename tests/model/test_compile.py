"""The compiled regions (gem.parallel.fsdp.apply_compile, on by default on CUDA) compute what the eager model does."""

import copy

import pytest
import torch

from gem import ops
from gem.model import GEMModel
from gem.parallel.fsdp import apply_compile
from tests.model._batches import make_batch, tiny_cfg


def _loss_and_grads(model, batch):
    out = model(batch)
    loss = out.logits.float().square().mean() + out.aux_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def _assert_match(eager, compiled, batch):
    """Same loss and gradients (same parameters) from both models on batch."""
    loss_e, grads_e = _loss_and_grads(eager, batch)
    loss_c, grads_c = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _pair(backend, kernel="reference", **tower):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = tiny_cfg(kernel, **tower)
    eager = GEMModel(cfg, embedding_device="cpu")
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, compiled.blocks, backend=backend)
    return cfg, eager, compiled


def test_compiled_regions_match_eager_over_changing_batch_shapes():
    """Every region traced (dense and MoE blocks, interaction, heads), graphs recompiled when the token count
    changes: same loss and gradients as eager, batch after batch; parameter names unchanged."""
    cfg, eager, compiled = _pair("aot_eager", num_blocks=3, moe_every=2)
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    for i, lengths in enumerate([[5, 3], [0, 9, 1], [11, 2, 9, 4], [1]]):
        _assert_match(eager, compiled, make_batch(cfg, lengths, seed=i))


@pytest.mark.slow
def test_inductor_fused_block_matches_eager():
    """The fused kernels Inductor generates for a dense block (RMSNorm, SwiGLU, residuals) and the heads."""
    cfg, eager, compiled = _pair("inductor", num_blocks=1, moe_every=0)
    _assert_match(eager, compiled, make_batch(cfg, [7, 0, 12], seed=3))


@pytest.mark.parametrize("tower", [{"attention": "jfa", "num_kv_heads": 1}, {"attention": "swa", "window": 3}])
def test_rope_runs_inside_the_compiled_region(monkeypatch, tower):
    """With compiled regions RoPE is part of the `_qkv` graph: the rope op is not called, and loss and gradients
    equal the eager model's, which rotates q and k with the Triton rope op, over batches of changing shape."""
    cfg, eager, compiled = _pair("aot_eager", kernel="triton", num_blocks=2, moe_every=0, **tower)
    calls, running = [], {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        model.register_forward_pre_hook(lambda m, args, _name=name: running.update(model=_name))
    rope_op = ops.rope

    def counted(*args, **kwargs):
        calls.append(running["model"])
        return rope_op(*args, **kwargs)

    monkeypatch.setattr(ops, "rope", counted)
    from gem.ops import rotary

    launch, strided = rotary._rope_launch, []

    def spy(cfg_, x, y, *args, **kwargs):  # a rope kernel writing into a wider buffer: the one-pass q/k/v gradient
        strided.append(y.stride(0) != y.shape[1] * y.shape[2])
        return launch(cfg_, x, y, *args, **kwargs)

    monkeypatch.setattr(rotary, "_rope_launch", spy)
    for i, lengths in enumerate([[5, 3], [11, 0, 2, 7]]):
        calls.clear()
        strided.clear()
        _assert_match(eager, compiled, make_batch(cfg, lengths, seed=i))
        assert calls == ["eager"] * (2 * cfg.tower.num_blocks)  # q and k per block, none in the compiled model
        # the compiled model's backward rotates dq and dk of each block straight into the q/k/v gradient
        assert strided.count(True) == 2 * cfg.tower.num_blocks, strided


def test_backward_makes_no_copies_of_attention_operands():
    """q/k/v of the tower and k/v of the interaction leave their compiled regions contiguous, so neither the
    attention ops nor autograd copy them or their gradients: outside the compiled forward regions (where Inductor
    fuses the copies into the kernels that produce q/k/v), the only [T, H, D] copy left is dv's into the q/k/v
    gradient (one per block)."""
    cfg, _, compiled = _pair("aot_eager", kernel="triton", num_blocks=2, moe_every=0)
    batch = make_batch(cfg, [7, 5, 12], seed=1)
    t = int(batch.seq_offsets[-1])
    _loss_and_grads(compiled, batch)  # compile first
    with torch.profiler.profile(record_shapes=True) as prof:
        _loss_and_grads(compiled, batch)
    copies = []
    for e in prof.events():
        shapes = e.input_shapes or []
        if e.name == "aten::copy_" and shapes and len(shapes[0]) == 3 and shapes[0][0] == t:
            chain, p = [], e.cpu_parent
            while p is not None:
                chain.append(p.name)
                p = p.cpu_parent
            if "CompiledFunction" not in chain:
                copies.append(chain)
    assert len(copies) == cfg.tower.num_blocks, copies
    assert all("gem::qkv_rope_grad" in c for c in copies), copies


@pytest.mark.parametrize("histories,candidates", [(1, "rows"), (2, "rows"), (1, "interaction"), (1, "targets")])
def test_pipeline_tracer_never_enters_a_compiled_region(histories, candidates):
    """TorchRec's sparse-dist pipeline FX-traces the model with only its top-level children as leaves: a compiled
    region reached below one (a ModuleDict entry, say) fails that trace on the GPU."""
    from torchrec.distributed.train_pipeline import tracing

    torch._dynamo.reset()
    data = None
    if histories == 2:
        from tests.model._batches import data_dict

        data = data_dict()
        name, spec = next(iter(data["histories"].items()))
        data["histories"]["second"] = copy.deepcopy(spec)
        for f, feat in list(data["features"].items()):
            if feat.get("kind") == "sequence":
                data["features"][f"{f}_2"] = {**feat, "history": "second", "column": f"{f}_2"}
    cfg = tiny_cfg("reference", data=data)
    cfg.candidates = candidates
    model = GEMModel(cfg, embedding_device="cpu")
    apply_compile(model, model.blocks, backend="aot_eager")
    # As sharded: the embedding modules are ShardedModules, so every other top-level child is a leaf by name.
    tracer = tracing.Tracer(leaf_modules=[n for n, _ in model.named_children()])
    graph = tracer.trace(model)
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    assert "ec" in called

"""Request batches in the training loop's pieces: batch checks, evaluation with GAUC by request, throughput that
counts candidates scored."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from gem.data import Schema, validate_batch
from gem.model import GEMModel
from gem.train.evaluator import Evaluator
from gem.train.metrics import gauc_with_ties
from gem.train.step import StepConfig
from tests.model._batches import make_batch, tiny_cfg

SCHEMA = Schema.from_dict(OmegaConf.to_container(
    OmegaConf.load(Path(__file__).resolve().parents[2] / "configs" / "data" / "synthetic.yaml"), resolve=True))


def request_batch(cfg, lengths, counts, seed=0):
    return make_batch(cfg, lengths, candidates=counts, seed=seed, hots=[1, 2])  # within the declared hots


def _cfg(form="interaction"):
    cfg = tiny_cfg()
    cfg.candidates = form
    return cfg


def _labelled(batch, seed):
    """Labels with both classes in most requests, so GAUC has groups to count."""
    g = torch.Generator().manual_seed(seed)
    batch.labels = (torch.rand(batch.labels.shape, generator=g) < 0.5).float()
    return batch


def test_request_batches_pass_the_checks_and_bad_request_fields_are_named():
    cfg = _cfg()
    b = request_batch(cfg, [5, 0, 3], [2, 4, 1])
    validate_batch(b, SCHEMA)
    bad = request_batch(cfg, [5, 0, 3], [2, 4, 1])
    bad.cand_offsets = torch.tensor([0, 2, 2, 7])
    with pytest.raises(ValueError, match="cand_offsets: request 1 has 0 candidates"):
        validate_batch(bad, SCHEMA)
    bad.cand_offsets = torch.tensor([0, 2, 6, 6])
    with pytest.raises(ValueError, match="cand_offsets: request 2 has 0 candidates"):
        validate_batch(bad, SCHEMA)
    bad.cand_offsets = torch.tensor([0, 2, 6, 8])  # the candidate ids say 1 for request 2
    with pytest.raises(ValueError, match="candidate feature 'cand_item': 1 ids at example 2, which has 2"):
        validate_batch(bad, SCHEMA)
    bad = request_batch(cfg, [5, 0, 3], [2, 4, 1])
    bad.labels = bad.labels[:6]
    with pytest.raises(ValueError, match="labels"):
        validate_batch(bad, SCHEMA)
    bad = request_batch(cfg, [5, 0, 3], [2, 4, 1])
    bad.max_candidates = 3
    with pytest.raises(ValueError, match="max_candidates: 3 but the most candidates of a request is 4"):
        validate_batch(bad, SCHEMA)
    bad = request_batch(cfg, [5, 0, 3], [2, 4, 1])
    bad.request_ids = torch.arange(2)
    with pytest.raises(ValueError, match=r"request_ids: expected shape \[3\]"):
        validate_batch(bad, SCHEMA)


@pytest.mark.parametrize("with_ids", [True, False])
def test_evaluation_reports_gauc_by_request(with_ids):
    """GAUC groups the candidates by request across batches: by the data's request ids, or, without them, by the
    request's place in the pass (two batches' request 0 are different requests)."""
    cfg = _cfg()
    torch.manual_seed(0)
    model = GEMModel(cfg)
    batches = [_labelled(request_batch(cfg, [5, 0, 3], [6, 9, 4], seed=s), s) for s in (1, 2)]
    if not with_ids:
        for b in batches:
            b.request_ids = None
    else:
        batches[1].request_ids = batches[1].request_ids + 3
    par = SimpleNamespace(model=model, embeddings=None)
    ev = Evaluator(par, batches, SCHEMA, StepConfig(tasks=cfg.tasks, task_weights=None), torch.device("cpu"))
    m = ev()
    model.eval()
    with torch.no_grad():
        preds = torch.cat([torch.sigmoid(model(b).logits.double()) for b in batches])
    labels = torch.cat([b.labels for b in batches]).double()
    groups = torch.repeat_interleave(torch.arange(6), torch.tensor([6, 9, 4, 6, 9, 4]))
    for i, task in enumerate(cfg.tasks):
        expect, counted = gauc_with_ties(preds[:, i], labels[:, i], groups)
        assert counted >= 3
        assert m[f"{task}/gauc"] == pytest.approx(expect, abs=1e-9)
    assert m["num_samples"] == 38  # candidates, not requests


def test_row_batches_have_no_gauc():
    cfg = _cfg("rows")
    model = GEMModel(cfg)
    b = request_batch(cfg, [5, 1], [1, 1])
    b.cand_offsets, b.request_ids = None, None
    ev = Evaluator(SimpleNamespace(model=model, embeddings=None), [b], SCHEMA,
                   StepConfig(tasks=cfg.tasks, task_weights=None), torch.device("cpu"))
    assert not any(k.endswith("/gauc") for k in ev())


def test_throughput_counts_candidates_scored():
    from gem.train.config import TrainConfig
    from gem.train.metrics_log import TrainLogger
    from gem.train.reporting import MetricsReporter
    from gem.train.step import StepOutput

    class _Opt:
        last_lr, last_grad_norm = 1e-3, None

    rep = MetricsReporter(TrainLogger(None, enabled=False, tensorboard=False), _Opt(), TrainConfig(steps=4), run_dir=None,
                          rank=0, world_size=1, device=torch.device("cpu"), tasks=["click"], global_batch=8)
    zero = torch.zeros(())
    for samples in (30, 50):
        rep.step_done(zero, 1.0, samples)
    rep.window_t0 -= 1.0  # at least a second for 80 candidates
    rep.log_window(2, StepOutput(zero, zero, zero), {})
    assert 0 < rep.samples_per_s <= 80 and rep.run_samples == 80


@pytest.mark.parametrize("form", ["interaction", "targets"])
def test_request_training_pipelined_and_resumed_follows_the_plain_loop(tmp_path, form):
    """Requests through torchrec's TrainPipelineSparseDist (each form's forward traced: the request fields reach
    the fx-wrapped helpers as batch attributes) and from a checkpoint: the plain loop's steps, and GAUC."""
    import shutil

    from tests.train.test_trainer import _fit

    common = ("train.steps=4", "train.eval_every=0", "data.max_candidates=5", f"model.candidates={form}",
              "data.batch_size=8", "train.seed=3", "model.kernel=reference")  # the kernels: tests/model
    plain, _ = _fit(tmp_path / "plain", *common, "train.pipeline=none", "train.checkpoint.every=2")
    piped, t = _fit(tmp_path / "piped", *common, "train.pipeline=sparse_dist")
    assert t.loop == "sparse_dist"
    assert max(plain.losses) - min(plain.losses) > 1e-4
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(plain.losses), rtol=0, atol=1e-6)
    assert "click/gauc" in plain.eval_metrics
    for k, v in plain.eval_metrics.items():
        assert piped.eval_metrics[k] == pytest.approx(v, abs=1e-6), k
    shutil.rmtree(tmp_path / "plain" / "checkpoints" / "step_4")
    resumed, t = _fit(tmp_path / "plain", *common, "train.pipeline=none", "train.resume=true")
    assert t.step == 4 and len(resumed.losses) == 2
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(plain.losses[2:]), rtol=0, atol=1e-6)

import copy
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gem.model import ConfigError, ModelConfig, validate_against_schema
from tests.model._batches import tiny_dict

ROOT = Path(__file__).resolve().parents[2]


def _cfg(mutate):
    d = tiny_dict()
    mutate(d)
    return d


def test_shipped_configs_build_and_match_the_synthetic_schema():
    schema = OmegaConf.load(ROOT / "configs/data/synthetic.yaml").schema
    for name in ("gem_tiny", "gem_base"):
        cfg = ModelConfig.from_dict(OmegaConf.load(ROOT / f"configs/model/{name}.yaml"))
        validate_against_schema(cfg, schema)
        assert cfg.sequence_features == ["hist_item", "hist_action"]
        assert "cand_item" in cfg.sparse_features
    tiny = ModelConfig.from_dict(OmegaConf.load(ROOT / "configs/model/gem_tiny.yaml"))
    assert tiny.is_moe_block(1) and not tiny.is_moe_block(0)
    assert tiny.num_query_tokens == len(tiny.sparse_features) + 2


@pytest.mark.parametrize("mutate,key", [
    (lambda d: d.pop("d_model"), "model.d_model"),
    (lambda d: d.update(bogus=1), "model.bogus"),
    (lambda d: d["tower"].update(num_heeds=2), "model.tower.num_heeds"),
    (lambda d: d["tables"][0].pop("num_embeddings"), "model.tables[0].num_embeddings"),
    (lambda d: d["tables"][1].update(kind="pooled"), "model.tables[1].kind"),
    (lambda d: d["tables"][2].update(pooling="max"), "model.tables[2].pooling"),
    (lambda d: d.update(d_model="wide"), "model.d_model"),
    (lambda d: d["tower"].update(head_dim=None, num_heads=3), "model.tower.num_heads"),
    (lambda d: d["tower"].update(num_kv_heads=3), "model.tower.num_kv_heads"),
    (lambda d: d["tower"].update(attention="flash"), "model.tower.attention"),
    (lambda d: d["tower"].update(attention="swa", window=None), "model.tower.window"),
    (lambda d: d["tower"].update(attention="block", block_size=None), "model.tower.block_size"),
    (lambda d: d["moe"].update(top_k=9), "model.moe.top_k"),
    (lambda d: d["moe"].update(grouped_mm="yes"), "model.moe.grouped_mm"),
    (lambda d: d["heads"].update(weights=[1.0]), "model.heads.weights"),
    (lambda d: d["interaction"].update(activation="tanh"), "model.interaction.activation"),
    (lambda d: d.update(kernel="cuda"), "model.kernel"),
    (lambda d: d["tables"][1].update(embedding_dim=8), "model.tables"),
    (lambda d: d["tables"][1].update(features=["hist_item"]), "model.tables[1].features"),
    (lambda d: d.update(tables=[t for t in d["tables"] if t["kind"] == "sequence"]), "model.tables"),
    (lambda d: d["tower"].update(rope_base=-1), "model.tower.rope_base"),
    (lambda d: d["tower"].update(window=0), "model.tower.window"),
    (lambda d: d["moe"].update(num_experts=0), "model.moe.num_experts"),
    (lambda d: d["interaction"].update(normalize="sqrt"), "model.interaction.normalize"),
    (lambda d: d["interaction"].update(approx="poly9"), "model.interaction.approx"),
])
def test_config_errors_name_the_key(mutate, key):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(_cfg(mutate))
    assert str(e.value).startswith(key + ":"), str(e.value)


def test_dictconfig_and_dict_give_the_same_config():
    d = tiny_dict()
    assert ModelConfig.from_dict(OmegaConf.create(d)) == ModelConfig.from_dict(copy.deepcopy(d))


@pytest.mark.parametrize("mutate,key", [
    (lambda s: s["sequence_features"].append({"name": "hist_dwell", "num_embeddings": 10}), "model.tables"),
    (lambda s: s["sparse_features"].pop(), "model.tables[4].features"),
    (lambda s: s.update(num_dense=3), "model.num_dense"),
    (lambda s: s.update(tasks=["click", "like"]), "model.heads.tasks"),
    (lambda s: s["sparse_features"][1].update(num_embeddings=1000), "model.tables[3].num_embeddings"),
    (lambda s: s.update(num_items=20000), "model.tables[0].num_embeddings"),
])
def test_schema_mismatch_names_the_key(mutate, key):
    schema = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/data/synthetic.yaml").schema)
    mutate(schema)
    cfg = ModelConfig.from_dict(tiny_dict())
    with pytest.raises(ConfigError) as e:
        validate_against_schema(cfg, schema)
    assert str(e.value).startswith(key + ":"), str(e.value)


def test_schema_object_from_the_data_layer_is_accepted():
    from gem.data import DataConfig

    data = DataConfig.from_dict(OmegaConf.load(ROOT / "configs/data/synthetic.yaml"))
    validate_against_schema(ModelConfig.from_dict(tiny_dict()), data.schema)


@pytest.mark.parametrize("value", [True, False, None])
def test_moe_grouped_mm_reaches_every_moe_block(value):
    from gem.model.attention import build_blocks
    from gem.model.moe import MoE

    cfg = ModelConfig.from_dict(_cfg(lambda d: d["moe"].update(grouped_mm=value)))
    moes = [b.ffn for b in build_blocks(cfg) if isinstance(b.ffn, MoE)]
    assert moes and all(m.use_grouped_mm is value for m in moes)


@pytest.mark.parametrize("mutate,line", [
    (lambda d: d["tower"].update(rope_base=-1), "model.tower.rope_base: must be > 0 (got -1.0)"),
    (lambda d: d["tower"].update(attention="flash"), "model.tower.attention: must be jfa, swa or block (got flash)"),
    (lambda d: d["tower"].update(num_blocks="two"), "model.tower.num_blocks: expected an integer (got two)"),
    (lambda d: d["tower"].update(depth=3), "model.tower.depth: unknown key (expected one of"),
])
def test_one_message_format(mutate, line):
    """`<key>: <what> (got <value>)`, the format of every config group."""
    from gem.config import ConfigError as AnyConfigError

    with pytest.raises(AnyConfigError) as e:
        ModelConfig.from_dict(_cfg(mutate))
    assert str(e.value).startswith(line), str(e.value)

import copy
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gem.model import ConfigError, ModelConfig
from tests.model._batches import data_dict, tiny_dict, tiny_schema

ROOT = Path(__file__).resolve().parents[2]


def _cfg(mutate):
    d = tiny_dict()
    mutate(d)
    return d


def test_shipped_configs_build_over_the_synthetic_schema():
    schema = tiny_schema()
    for name in ("gem_tiny", "gem_base", "gem_prod"):
        cfg = ModelConfig.from_dict(OmegaConf.load(ROOT / f"configs/model/{name}.yaml"), schema)
        assert cfg.sequence_features == ["hist_item", "hist_action"]
        assert cfg.candidate_features == ["cand_item"] and cfg.sparse_features == ["user_segment", "context"]
        # the candidate shares the history's item table (one EmbeddingCollection table)
        assert [t.features for t in cfg.sequence_tables] == [("hist_item", "cand_item"), ("hist_action",)]
        assert cfg.tasks == ["click", "conversion"] and cfg.num_dense == 8
    tiny = ModelConfig.from_dict(OmegaConf.load(ROOT / "configs/model/gem_tiny.yaml"), schema)
    assert tiny.is_moe_block(1) and not tiny.is_moe_block(0)
    assert tiny.num_query_tokens == 3 + 2


@pytest.mark.parametrize("mutate,key", [
    (lambda d: d.pop("d_model"), "model.d_model"),
    (lambda d: d.update(bogus=1), "model.bogus"),
    (lambda d: d["tower"].update(num_heeds=2), "model.tower.num_heeds"),
    (lambda d: d.update(tables=[]), "model.tables"),
    (lambda d: d.update(num_dense=8), "model.num_dense"),
    (lambda d: d["heads"].update(tasks=["click"]), "model.heads.tasks"),
    (lambda d: d["heads"].update(weights={"click": 1.0, "like": 2.0}), "model.heads.weights.like"),
    (lambda d: d.update(towers={"searches": {"num_blocks": 1}}), "model.towers.searches"),
    (lambda d: d.update(towers={"events": {"attention": "swa"}}), "model.towers.events.window"),
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
    (lambda d: d["tower"].update(rope_base=-1), "model.tower.rope_base"),
    (lambda d: d["tower"].update(window=0), "model.tower.window"),
    (lambda d: d["moe"].update(num_experts=0), "model.moe.num_experts"),
    (lambda d: d["interaction"].update(normalize="sqrt"), "model.interaction.normalize"),
    (lambda d: d["interaction"].update(approx="poly9"), "model.interaction.approx"),
])
def test_config_errors_name_the_key(mutate, key):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(_cfg(mutate), tiny_schema())
    assert str(e.value).startswith(key + ":"), str(e.value)


def test_old_model_keys_say_what_they_became():
    with pytest.raises(ConfigError, match=r"^model.tables: moved to data.tables"):
        ModelConfig.from_dict(_cfg(lambda d: d.update(tables=[])), tiny_schema())
    with pytest.raises(ConfigError, match=r"^model.heads.weights: a mapping task -> weight"):
        ModelConfig.from_dict(_cfg(lambda d: d["heads"].update(weights=[1.0, 1.0])), tiny_schema())


def test_task_weights_follow_the_labels():
    cfg = ModelConfig.from_dict(_cfg(lambda d: d["heads"].update(weights={"conversion": 0.5})), tiny_schema())
    assert cfg.task_weights == [1.0, 0.5]


def test_a_tower_per_history_overrides_the_default_tower():
    data = data_dict()
    data["features"]["searches"] = {"kind": "sequence", "table": "action", "history": "searches"}
    data["histories"]["searches"] = {"max_len": 8}
    cfg = ModelConfig.from_dict(_cfg(lambda d: d.update(towers={"events": {"attention": "block", "block_size": 8},
                                                                "searches": {"num_blocks": 1}})), tiny_schema(data))
    events, searches = cfg.tower_for("events"), cfg.tower_for("searches")
    assert (events.attention, events.block_size, events.num_blocks) == ("block", 8, 2)
    assert (searches.attention, searches.num_blocks, searches.head_dim, searches.d_ff) == ("jfa", 1, 16, 64)


def test_dictconfig_and_dict_give_the_same_config():
    d = tiny_dict()
    assert ModelConfig.from_dict(OmegaConf.create(d), tiny_schema()) == ModelConfig.from_dict(copy.deepcopy(d),
                                                                                             tiny_schema())


@pytest.mark.parametrize("value", [True, False, None])
def test_moe_grouped_mm_reaches_every_moe_block(value):
    from gem.model.attention import build_blocks
    from gem.model.moe import MoE

    cfg = ModelConfig.from_dict(_cfg(lambda d: d["moe"].update(grouped_mm=value)), tiny_schema())
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
        ModelConfig.from_dict(_cfg(mutate), tiny_schema())
    assert str(e.value).startswith(line), str(e.value)

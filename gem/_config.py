"""Config plumbing shared by the layers' typed configs."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def to_plain(cfg: Any) -> Any:
    """DictConfig / ListConfig -> plain containers (interpolations resolved, missing values an error); other
    values pass through, so plain dicts work too."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    return cfg

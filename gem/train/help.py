"""`python -m gem.train --help` / `scripts/train.sh --help`: how to run gem, and the config groups it offers.

Standard library only, and runnable as a file (`python gem/train/help.py CONFIG_DIR`), so scripts/train.sh can
print it before it sets up the Python environment and without starting any rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_USAGE = """\
gem-train: train a GEM-style recommender (TorchRec embeddings + jagged transformer tower) from one Hydra config.

The two commands:
  scripts/train.sh [--nproc N] [--check] [KEY=VALUE ...]   train (sets up .venv with the CPU stack on first use)
  scripts/test.sh [PYTEST ARGS ...]                         run the test suite

  scripts/train.sh                                  the embedded default: tiny GEM, synthetic data, 2 ranks on CPU
  scripts/train.sh train.steps=600 model.tower.num_blocks=4    any config value, as KEY=VALUE (Hydra overrides)
  scripts/train.sh --nproc 1 train.steps=50         --nproc N: ranks on this machine (1: one plain process)
  python -m gem.train experiment=gpu_base           one GPU (the GPU stack installed: see docs/GPU.md)
  scripts/train.sh --check parallel.dp_replicate=2  check the config against --nproc ranks, start nothing

Options:
  --check        compose and validate the config (every value, the parallel layout on WORLD_SIZE ranks), then
                 exit: 0 if good, else one line `gem-train: error: <key>: <what> (got <value>)` and status 2
  --nproc N      scripts/train.sh only: how many ranks torchrun starts on this machine (default 2, or $NPROC)
  -h, --help     this text; --hydra-help: Hydra's own options (--cfg job prints the composed config)

Without the script:
  python -m gem.train [--check] [KEY=VALUE ...]                            one process
  torchrun --standalone --nproc_per_node=N -m gem.train [KEY=VALUE ...]    N ranks on one machine
  Multi-node: run scripts/launch_multinode.sh on every node with NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and
  NPROC_PER_NODE set (it calls torchrun with a shared rendezvous).
  Runs write to outputs/<date>/<time>.<ms>-<id>/ (hydra.run.dir=DIR to choose): metrics.jsonl, tb/ (TensorBoard),
  checkpoints/ (train.checkpoint.every=N; train.resume=true continues from the newest).

Errors a user can fix (a config value, a data file, a run dir, a checkpoint) print one line `gem-train: error: ...`
and exit with status 2 (scripts/train.sh and single-process runs; torchrun itself reports a failed worker as 1).
SIGTERM, SIGINT and SIGUSR1 stop every rank after one step with a checkpoint of it and one line `gem-train: stopped
by ...`; status 143 / 130, and 0 for SIGUSR1 (a wrapper requeues). One job at a time per run dir.
"""


def config_groups(config_dir: str | os.PathLike) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(group, [(option, first comment line)])] for every config group directory, in name order."""
    root = Path(config_dir)
    out = []
    for group in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        options = []
        for f in sorted(group.glob("*.yaml")):
            options.append((f.stem, _first_comment(f)))
        if options:
            out.append((group.name, options))
    return out


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text.startswith("#"):
            continue
        text = text.lstrip("#").strip()
        if text and not text.startswith("@package"):
            return text
    return ""


def _defaults(config_dir: Path) -> dict[str, str]:
    """group -> the option config.yaml picks (a plain reading of its `defaults:` list)."""
    out = {}
    path = config_dir / "config.yaml"
    if not path.is_file():
        return out
    in_defaults = False
    for line in path.read_text().splitlines():
        if line.startswith("defaults:"):
            in_defaults = True
            continue
        if in_defaults:
            item = line.strip()
            if not item.startswith("- "):
                if item and not item.startswith("#"):
                    break
                continue
            key, _, value = item[2:].partition(":")
            if value.strip():
                out[key.strip()] = value.split("#")[0].strip()
    return out


def help_text(config_dir: str | os.PathLike) -> str:
    root = Path(config_dir)
    lines = [_USAGE, f"Config groups (pick one with GROUP=OPTION; files in {root}):"]
    defaults = _defaults(root)
    for group, options in config_groups(root):
        lines.append(f"  {group}:")
        names = [f"{group}={name}" + (" (default)" if defaults.get(group) == name else "") for name, _ in options]
        width = max(len(n) for n in names)
        for n, (_, comment) in zip(names, options):
            lines.append(f"    {n:<{width}}  {comment}".rstrip())
    lines.append("Every key of a group can be set as GROUP.KEY=VALUE; the yaml files explain each key.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(help_text(sys.argv[1]))
